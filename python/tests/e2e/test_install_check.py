"""The newcomer's path, scripted: the wheel installed into a new virtual
environment, `ucm serve`, requests across a restart, `ucm store`."""

from __future__ import annotations

import subprocess
import sys

from support.engines import ROOT


def test_wheel_installs_serves_and_maintains_from_a_new_venv() -> None:
    res = subprocess.run(
        # The release profile reuses what setup.sh compiled: the wheel is the
        # same but for debug info, and CI skips a second full compile of every
        # dependency (about ten minutes on two cores). That the documented
        # build strips the extension is checked by the packaging tests and by
        # `tools/install_check.py` run as documented (dist profile).
        [sys.executable, str(ROOT / "tools" / "install_check.py"), "--profile", "release"],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    assert "install check: ok" in res.stdout
    assert "store round trip ok" in res.stdout
