"""The connector's unit tests import vLLM's connector API: skipped without vLLM."""

from __future__ import annotations

import importlib.util

if importlib.util.find_spec("vllm") is None:
    collect_ignore_glob = ["test_*.py"]
