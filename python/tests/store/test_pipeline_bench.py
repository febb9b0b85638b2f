"""The pipeline benchmark runs end to end on a small size: both pipelines
round-trip the same bytes in fresh processes and every line is printed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def test_pipeline_bench_prints_every_ratio(tmp_path: Path) -> None:
    out = subprocess.run(
        [
            sys.executable,
            str(REPO / "benches" / "store_bench.py"),
            "--pipeline",
            "--dir",
            str(tmp_path),
            "--mib",
            "8",
            "--rounds",
            "1",
            "--settle",
            "0",
        ],
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    ).stdout
    for line in (
        "memcpy of the same bytes",
        "cold load (page cache)",
        "dump until persisted",
        "dump until wait()",
        "Cache|Posix second load",
        "Cache|Posix third load, during those fills",
        "Cache|Posix hot load",
        "Posix from the page cache",
        "kept /dev/shm segment, first load",
        "kept /dev/shm segment, second load",
    ):
        assert line in out, out
