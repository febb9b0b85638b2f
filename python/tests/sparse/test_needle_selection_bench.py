"""The offline needle bench (``benches/needle_selection.py``) on one 2k-token
needle: dense attention, ESA as shipped and the attention-mass oracle all
find the key, so the rules see the real model's keys and queries and keep
the block the answer needs. Skips, with the reason, where the model cannot
be fetched."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]


def test_needle_selection_bench_finds_a_2k_needle() -> None:
    from ucm.models import ModelUnavailable, ensure

    try:
        ensure()
    except ModelUnavailable as e:
        pytest.skip(f"the real model is not available: {e}")
    rules = ["dense", "esa:4", "oracle"]
    out = subprocess.run(
        [
            sys.executable,
            str(REPO / "benches" / "needle_selection.py"),
            "--lengths",
            "2048",
            "--needles",
            "1",
            "--rules",
            *rules,
        ],
        check=True,
        capture_output=True,
        text=True,
        timeout=600,
    ).stdout
    rows = [line.split() for line in out.splitlines() if line.startswith("  2048")]
    assert rows == [["2048", "1", "1", "1"]], out
