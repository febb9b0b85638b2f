"""Helpers shared by the test modules and the benchmarks; not product API
(importable as ``support``: pytest puts ``python/tests`` on the path, see
``pythonpath`` in ``pyproject.toml``; a benchmark in ``benches/`` puts it on
``sys.path`` itself).

* :mod:`.store_helpers` -- the block geometry and config of the store tests;
* :mod:`.py_stores` -- stores written in Python (a dict store for pipelines);
* :mod:`.remote_helpers` -- block data and transfers of the S3 and NFS tests;
* :mod:`.servers` -- real S3 (moto) and NFS (Ganesha) servers, two vLLM
  engines sharing a store;
* :mod:`.engines` -- vLLM engines in child processes for the end-to-end tests;
* :mod:`.kernel_checks` -- tolerances and seeding of the Triton kernel tests;
* :mod:`.offload_sim` -- an engine-free simulation of an offloading method;
* :mod:`.tiny_serve` -- ``vllm serve`` of the tiny model, over HTTP;
* :mod:`.forker` -- engine processes forked from one that imported vLLM once;
* :mod:`.vllm_child` -- one vLLM engine per child process (Blend);
* :mod:`.refmodel` -- a torch Llama with vLLM's CPU KV layout that runs the
  Blend and ReRoPE hooks without vLLM;
* :mod:`.synthetic` -- synthetic KV and queries for the sparse methods;
* :mod:`.store_debug` -- debug hooks of the built-in stores.
* :mod:`.docs` -- the README and the docs site's pages, and their code blocks.

Engines in child processes (:mod:`ucm.vllm_demo.engine_process`), tiny
models and generated texts are in the product: its demo runs them. The
store conformance suite is public: :mod:`ucm.testing.conformance`.
"""
