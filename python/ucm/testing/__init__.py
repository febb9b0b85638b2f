"""Test and demo tooling; not part of the product API.

* :mod:`.tiny_model` -- small random-weight Llama checkpoints, made locally;
* :mod:`.harness` -- a vLLM engine in a child process driven by JSON lines
  (the end-to-end tests, the README's main job, ``benches/ttft.py``);
* :mod:`.vllm_demo` -- the README's main job (``./tools/vllm-demo.sh``);
* :mod:`.vllm_child` -- one vLLM engine per child process for the Blend tests
  and ``benches/blend_ttft.py``;
* :mod:`.refmodel` -- a torch Llama with vLLM's CPU KV layout that runs the
  Blend and ReRoPE hooks without vLLM (the reference the vLLM runs are
  compared with);
* :mod:`.synthetic` -- synthetic KV and queries for the sparse tests and the
  quality benchmark;
* :mod:`.elf` -- an ELF file's section names (the install check's test that
  the wheel's extension is stripped).

Nothing in :mod:`ucm` outside this package imports it.
"""
