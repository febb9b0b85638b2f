"""The newcomer's path, scripted: the wheel installed into a new virtual
environment, `ucm serve`, requests across a restart, `ucm store`."""

from __future__ import annotations

import subprocess
import sys

from support.engines import ROOT


def test_wheel_installs_serves_and_maintains_from_a_new_venv() -> None:
    res = subprocess.run(
        # The profile and features setup.sh built the extension with: the
        # wheel packs that build instead of compiling the crates again (a
        # second compile of every dependency in the dist profile is about ten
        # minutes on two cores; of the core without the measurement
        # baselines, two or three). It differs from what ships only by debug
        # info and those baselines: that the documented build strips the
        # extension is checked by the packaging tests and by
        # `tools/install_check.py` run as documented (dist profile).
        [
            sys.executable,
            str(ROOT / "tools" / "install_check.py"),
            "--profile",
            "release",
            "--features",
            "bench",
        ],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    assert "install check: ok" in res.stdout
    assert "store round trip ok" in res.stdout
