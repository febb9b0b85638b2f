"""Kernels shared by the sparse methods: Triton kernels with torch references.

* :mod:`.selection` -- block representatives, dot and Hamming block scores,
  KVStar votes, SRP key codes (ESA, KVStar, GSA);
* :mod:`.attention` -- attention over paged KV: decode over selected blocks,
  position-causal prefill, ReRoPE's two-score attention (one set of kernels);
* :mod:`.keys` -- delta-RoPE of cached keys and the deviation of fresh keys
  from cached ones (Blend, ReRoPE);
* :mod:`.rope` -- rotary embedding in vLLM's conventions (torch);
* :mod:`.views` -- the kernels' view of vLLM's paged KV caches;
* :mod:`.dispatch` -- Triton or torch (``impl``), argument checks, the
  interpreter lock; :mod:`.triton_utils` -- Triton kept optional.

Each family has a dispatching module (its package), a ``reference`` (the
specification), a ``jit`` (the ``@triton.jit`` layer) and ``launchers``.
Triton is optional: without it (or on CPU tensors without
``TRITON_INTERPRET=1``) every op runs its torch reference.
"""
