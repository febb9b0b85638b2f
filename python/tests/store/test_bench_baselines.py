"""The same-run baselines the benchmarks divide by, through the binding:
each returns a positive rate, and work that cannot be measured is refused
with the store's parameter error, not a crash or a zero. They are in the
extension the tests build (the ``bench`` feature, see ``tools/setup.sh``),
not in wheels."""

from __future__ import annotations

from pathlib import Path

import pytest

from ucm import _native
from ucm.errors import InvalidParamError

if not hasattr(_native, "baseline_checksum_gbps"):
    pytest.fail(
        "the native extension was built without the `bench` feature (tools/setup.sh "
        "builds it with): maturin develop --release --features bench",
        pytrace=False,
    )


def test_checksum_baseline_measures_and_refuses_empty_work() -> None:
    gbps = _native.baseline_checksum_gbps(8 << 20, 256 << 10, 2)
    assert 0.0 < gbps < float("inf")
    with pytest.raises(InvalidParamError, match="must be positive"):
        _native.baseline_checksum_gbps(8 << 20, 0, 2)


def test_direct_io_baseline_measures_and_refuses_unknown_ops(tmp_path: Path) -> None:
    for op in ("write", "read"):
        assert _native.baseline_direct_io_gbps(str(tmp_path), op, 4 << 20, 1 << 20, 2) > 0.0
    with pytest.raises(InvalidParamError, match="op must be"):
        _native.baseline_direct_io_gbps(str(tmp_path), "erase", 4 << 20, 1 << 20, 2)
    assert list(tmp_path.iterdir()) == []
