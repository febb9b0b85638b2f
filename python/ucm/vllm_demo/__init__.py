"""The README's main job (``./tools/vllm-demo.sh``, ``python -m ucm.vllm_demo``)
and what it runs; shipped with the product so an installed ucm can run it.

* :mod:`.demo` -- the demo: a long prompt before and after an engine
  restart, cold against warm time to first token;
* :mod:`.engine_process` -- a vLLM engine in its own process, driven by JSON
  lines (also what the end-to-end tests and benchmarks start engines with);
* :mod:`.tiny_model` -- small random-weight Llama checkpoints, made locally,
  for when the real model is not available (and for the tests);
* :mod:`.corpus` -- generated English text and prompts in the real model's
  chat format (also the quality benchmark's texts).

Nothing else in :mod:`ucm` imports this package.
"""
