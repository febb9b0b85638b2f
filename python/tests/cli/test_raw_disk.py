"""The raw disk figure of ``ucm bench``: a positive rate for both directions
and odd sizes, no scratch file left behind, unknown operations refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from ucm.cli.raw_disk import direct_io_gbps


def test_measures_both_directions_and_cleans_up(tmp_path: Path) -> None:
    for op in ("write", "read"):
        gbps = direct_io_gbps(tmp_path, op, 4 << 20, 1 << 20, 2)
        assert 0.0 < gbps < float("inf"), (op, gbps)
    # Odd sizes are rounded, not rejected.
    assert direct_io_gbps(tmp_path, "read", 1000, 1000, 3) > 0.0
    assert list(tmp_path.iterdir()) == []


def test_refuses_unknown_operations(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="op must be"):
        direct_io_gbps(tmp_path, "erase", 4 << 20, 1 << 20, 2)
    assert list(tmp_path.iterdir()) == []
