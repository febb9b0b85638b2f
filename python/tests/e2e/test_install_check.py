"""The newcomer's path, scripted: the wheel installed into a new virtual
environment, `ucm serve`, requests across a restart, `ucm store`."""

from __future__ import annotations

import subprocess
import sys

from support.engines import ROOT


def test_wheel_installs_serves_and_maintains_from_a_new_venv() -> None:
    res = subprocess.run(
        # The dist profile, what ships: one more full compile than setup.sh's
        # release build, the price of checking that the wheel is stripped.
        [sys.executable, str(ROOT / "tools" / "install_check.py"), "--profile", "dist"],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    assert "install check: ok" in res.stdout
    assert "store round trip ok" in res.stdout
    assert "MB, stripped" in res.stdout
