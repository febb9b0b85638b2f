"""Engine processes forked from one process that has imported vLLM once.

A fresh engine process spends about 11 of its 20 seconds of start-up on 2
cores importing vLLM, torch and the connector, and a few more tearing the
interpreter down at exit. A bench that starts a dozen engines pays minutes
for that. :class:`EngineForker` imports all of it once and forks each
engine from there: every engine is still a process of its own with its own
engine, store and connector (it inherits imported modules, nothing an
earlier engine did), and it exits with ``os._exit`` once it has shut its
engine down.

The forker runs no torch op and starts no Python thread, and it refuses to
fork while it has a second Python thread: a forked child may inherit locks
held by threads that do not exist in it. Importing torch does leave idle
native helper threads; a forked child has none of them, and torch's fork
handlers have it build its own thread pools (a forked engine's prefill here
used both cores, and ``test_engine_forker.py`` checks that its answers match
an engine started in a new interpreter).

Protocol: the parent runs this file as a script (with the
engine environment), which answers one ``@@UCM@@ {"ready": true}`` line.
Each stdin line ``{"config", "log", "cwd", "socket"}`` forks an engine that
appends its output to ``log``, connects to the Unix socket ``socket`` and
speaks :mod:`ucm.vllm_demo.engine_process`'s JSON lines over it; the forker answers
``{"pid": n}`` (or ``{"error": ...}``).

Test and benchmark tooling (the tests' ``support`` package), not product API.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import IO, Any

MARK = "@@UCM@@ "
CONNECT_TIMEOUT_S = 120.0


class ForkedEngine:
    """The parent's handle on a forked engine: ``poll``, ``wait`` and ``kill``
    like :class:`subprocess.Popen`'s. The forker reaps its children, so the
    exit status is not known here: ``returncode`` is 0 once the process is
    gone, and errors quote :attr:`status_text` instead."""

    status_text = "forked, exit status not known: see the log"

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                os.kill(self.pid, 0)
            except ProcessLookupError:
                self.returncode = 0
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        end = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if end is not None and time.monotonic() > end:
                raise subprocess.TimeoutExpired(f"engine pid {self.pid}", timeout or 0.0)
            time.sleep(0.05)
        return 0

    def kill(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


class EngineForker:
    """Parent side: the forker process, and :meth:`spawn` to fork an engine."""

    def __init__(self, env: dict[str, str], log: str | Path) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="ucm-forker-")
        self._log = open(log, "w")
        self._n = 0
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve())],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            env=env,
        )
        if not self._request(None).get("ready"):
            raise RuntimeError(f"the engine forker did not start; see {log}")

    def _request(self, req: dict[str, Any] | None) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        if req is not None:
            self.proc.stdin.write(json.dumps(req) + "\n")
            self.proc.stdin.flush()
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"the engine forker exited ({self.proc.wait()})")
            if line.startswith(MARK):
                return json.loads(line[len(MARK) :])

    def spawn(
        self, config: dict[str, Any], log: Path, cwd: Path
    ) -> tuple[ForkedEngine, IO[str], IO[str]]:
        """Forks an engine for ``config``: its handle, and the files to read
        its answers from and write commands to."""
        self._n += 1
        path = os.path.join(self._dir.name, f"{self._n}.sock")
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
            listener.bind(path)
            listener.listen(1)
            listener.settimeout(CONNECT_TIMEOUT_S)
            reply = self._request(
                {"config": config, "log": str(log), "cwd": str(cwd), "socket": path}
            )
            if "pid" not in reply:
                raise RuntimeError(f"the engine forker could not fork: {reply}")
            conn, _ = listener.accept()
        conn.settimeout(None)
        return ForkedEngine(reply["pid"]), conn.makefile("r"), conn.makefile("w")

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        self._dir.cleanup()

    def __enter__(self) -> EngineForker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ------------------------------------------------------------------------------ forker side


def _engine(req: dict[str, Any]) -> None:
    """In the forked child: never returns."""
    code = 1
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # vLLM waits for its own children
        fd = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        os.chdir(req["cwd"])
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(req["socket"])
        from ucm.vllm_demo import engine_process

        engine_process.run_engine(req["config"], sock.makefile("r"), sock.makefile("w"))
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _serve() -> None:
    from ucm.vllm_demo import engine_process

    engine_process.prepare_engine_child()
    engine_process.import_engine_modules()
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children are reaped by the kernel
    out = sys.stdout
    out.write(MARK + json.dumps({"ready": True}) + "\n")
    out.flush()
    for line in sys.stdin:
        req = json.loads(line)
        n = threading.active_count()
        if n != 1:
            reply: dict[str, Any] = {"error": f"the forker has {n} threads; it forks only with one"}
        else:
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                _engine(req)
            reply = {"pid": pid}
        out.write(MARK + json.dumps(reply) + "\n")
        out.flush()


if __name__ == "__main__":
    _serve()
