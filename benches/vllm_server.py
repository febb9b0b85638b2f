"""``vllm serve`` for ``benches/serving.py``: vLLM's own command line (through
:mod:`ucm.integration.vllm.cli`, which also runs vLLM's CPU build), with the
workaround LMCache's connector needs on the CPU build applied in every
process of the server.

Run as ``python benches/vllm_server.py serve MODEL ...``. vLLM starts its
engine-core and worker processes with ``spawn``, which imports this file
again in each of them (as ``__mp_main__``): what runs at import time here
runs in all of them, and LMCache's connector lives in the worker.
"""

from __future__ import annotations

import os
import sys

#: Set (to anything) by the bench for LMCache's server only.
LMCACHE_ENV = "SERVING_BENCH_LMCACHE"

if os.environ.get(LMCACHE_ENV):
    # vLLM's CPU platform scans every loaded module for Triton kernels and
    # calls ``vars(value).get("kernel")`` on each; LMCache's connector imports
    # numba, whose llvmlite wrapper answers ``__dict__`` with a C function, and
    # the scan raises. See benches/lmcache_engine.py, which does the same for
    # an engine in one process.
    from llvmlite.binding import ffi

    ffi.lib._fntab["__dict__"] = {}


if __name__ == "__main__":
    from ucm.integration.vllm.cli import run_vllm

    sys.exit(run_vllm(sys.argv[1:]))
