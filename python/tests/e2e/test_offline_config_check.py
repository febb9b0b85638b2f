"""``LLM(...)`` (vLLM's offline API) refuses a misspelled UCM key before
the engine core starts, as ``vllm serve`` does, instead of failing the
engine core after the model loaded."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from support.engines import engine_env

OFFLINE_LLM = """
import sys
from vllm import LLM
from ucm.vllm_demo.engine_process import CONNECTOR
from ucm.shared.config import ConfigError

try:
    LLM(
        model=sys.argv[1],
        enforce_eager=True,
        dtype="float32",
        max_model_len=512,
        block_size=32,
        kv_cache_memory_bytes=16 << 20,
        kv_transfer_config=dict(CONNECTOR, kv_connector_extra_config={"use_layerwsie": True}),
    )
except ConfigError as e:
    print("REFUSED:", e)
    sys.exit(3)
"""


def test_offline_llm_names_the_misspelled_key_before_the_engine_core_starts(
    tiny_model: Path,
) -> None:
    res = subprocess.run(
        [sys.executable, "-c", OFFLINE_LLM, str(tiny_model)],
        env=engine_env(VLLM_LOGGING_LEVEL="INFO"),
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = res.stdout + res.stderr
    assert res.returncode == 3, out[-3000:]
    assert "REFUSED: UCM config error" in out
    assert "'use_layerwsie'" in out and "did you mean 'use_layerwise'?" in out
    # vLLM's engine core logs this first thing; it never got there.
    assert "Initializing a V1 LLM engine" not in out
