"""Unified Cache Manager: tiered KV-cache storage for LLM inference.

Subpackages (``docs/architecture.md`` draws how they fit):

* :mod:`ucm.store` -- the store API (``UcmKVStoreBase``), the factory, configs
  and pipelines of stages over the Rust core (``ucm._native``);
* :mod:`ucm.hashing` -- chained block ids;
* :mod:`ucm.integration` -- engines: :mod:`ucm.integration.vllm`, the
  ``UCMConnector`` KV connector and the sparse methods' bridge into vLLM;
* :mod:`ucm.sparse` -- sparse attention and KV reuse methods (ESA, KVStar,
  GSA, Blend, ReRoPE, users' own), engine-neutral, with their kernels;
* :mod:`ucm.shared` -- logging, config parsing, metrics;
* :mod:`ucm.models` -- the demo's real model, fetched from PyPI and converted once;
* :mod:`ucm.testing` -- the store conformance suite, to check a store of yours;
* :mod:`ucm.vllm_demo` -- the README's main job: vLLM engines in child
  processes, small random-weight models and generated prompts it runs;
* :mod:`ucm.demo` -- a store round trip without an engine.
"""

from ucm.shared.logging import init_logging

init_logging()

__version__ = "0.1.0"

#: The PyPI distribution that installs this package. PyPI's ``ucm`` is an
#: unrelated project with a top-level ``ucm`` package too; ``ucm_kvcache``
#: tells the two apart by this attribute.
__distribution__ = "ucm-kvcache"
