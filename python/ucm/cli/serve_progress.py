"""What ``ucm serve`` says while vLLM starts, and when it is ready.

vLLM takes minutes to serve on a CPU machine, with silent stretches of half a
minute and more (a new process importing torch and vLLM, compiling the
model). ``ucm serve`` runs vLLM as its child with the output coming through
a pipe: every line is passed on unchanged, and the lines that begin a
start-up phase are named on a line of its own (``ucm serve: loading
weights``); a silence of :data:`SILENCE_S` seconds is reported with the
phase and the time so far; and once ``/health`` answers,
``ucm serve: ready: http://HOST:PORT/v1`` is printed, once.
"""

from __future__ import annotations

import contextlib
import ctypes
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import IO

#: vLLM's log text that begins each phase, in start-up order. A phase only
#: ever moves forward: vLLM logs some of these twice (the API server creates
#: the connector again after the engine is up).
PHASES: tuple[tuple[str, str], ...] = (
    ("non-default args", "starting the engine process, which imports torch and vLLM again"),
    ("Initializing a V1 LLM engine", "starting the model worker"),
    ("Starting to load model", "loading weights"),
    ("Warming up model", "warming up and compiling the model, the longest step on a CPU"),
    ("Capturing CUDA graph", "capturing CUDA graphs"),
    ("Creating v1 connector", "opening the UCM store (indexing the blocks it holds)"),
    ("init engine", "starting the API server"),
    ("Starting vLLM server on", "starting the HTTP server"),
)
#: Seconds without output after which the phase is named again.
SILENCE_S = 20.0
WILDCARD_HOSTS = ("", "0.0.0.0", "::")


def server_url(vllm_args: Sequence[str]) -> str:
    """``http://HOST:PORT`` of the server that ``vllm serve`` with these
    arguments starts (vLLM's defaults: all interfaces, port 8000; all
    interfaces are reached on 127.0.0.1)."""
    opts = {"--host": "", "--port": "8000"}
    for i, a in enumerate(vllm_args):
        for flag in opts:
            if a == flag and i + 1 < len(vllm_args):
                opts[flag] = vllm_args[i + 1]
            elif a.startswith(flag + "="):
                opts[flag] = a.split("=", 1)[1]
    host = opts["--host"]
    if host in WILDCARD_HOSTS:
        host = "127.0.0.1"
    elif ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{opts['--port']}"


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as r:
            return int(r.status) == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


@dataclass
class Progress:
    """The start-up state ``ucm serve`` reports on ``out``."""

    url: str
    out: IO[str]
    silence_s: float = SILENCE_S
    started: float = field(default_factory=time.monotonic)
    phase: int = -1
    last_output: float = field(default_factory=time.monotonic)
    ready: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)

    def say(self, text: str) -> None:
        with self.lock:
            print(f"ucm serve: {text}", file=self.out, flush=True)

    def elapsed(self) -> int:
        return round(time.monotonic() - self.started)

    def phase_name(self) -> str:
        return PHASES[self.phase][1] if self.phase >= 0 else "starting vLLM"

    def passthrough(self, line: str) -> None:
        """Passes one line of vLLM's output on; names a phase it begins."""
        with self.lock:
            self.out.write(line)
            self.out.flush()
            self.last_output = time.monotonic()
        if self.ready:
            return
        for i in range(self.phase + 1, len(PHASES)):
            if PHASES[i][0] in line:
                self.phase = i
                self.say(f"{self.phase_name()} ({self.elapsed()} s)")
                return

    def tick(self) -> None:
        """One poll: the ready line once /health answers, else the phase
        again after a silence."""
        if self.ready:
            return
        if healthy(self.url):
            self.ready = True
            self.say(f"ready: {self.url}/v1 (after {self.elapsed()} s)")
        elif time.monotonic() - self.last_output >= self.silence_s:
            self.last_output = time.monotonic()
            self.say(f"still {self.phase_name()} ({self.elapsed()} s so far)")


def _die_with_parent() -> None:
    # A vLLM server left behind by a killed `ucm serve` would hold its port
    # and memory: the child gets SIGTERM when its parent dies (Linux).
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def run_with_progress(cmd: list[str], url: str, env: dict[str, str]) -> int:
    """Runs ``cmd`` (a vLLM server reached at ``url``) with its output
    passed through :class:`Progress`; returns its exit status. vLLM stays in
    ucm's process group, so what is sent to the group (a terminal's Ctrl-C, a
    supervisor's ``kill -- -PGID``, SIGKILL included) reaches it as sent;
    a SIGTERM sent to ucm alone is passed on, and ucm waits for it to stop."""
    progress = Progress(url, sys.stdout)
    progress.say(f"starting vLLM; the API will be at {url}/v1")
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
        preexec_fn=_die_with_parent,
    )

    def forward(signum: int, _frame: object) -> None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    # A terminal's Ctrl-C reaches vLLM from the terminal (same group): sent
    # again from here it would be a second Ctrl-C, which vLLM's server takes
    # as "quit now".
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    def poll() -> None:
        while proc.poll() is None and not progress.ready:
            progress.tick()
            time.sleep(1.0)

    threading.Thread(target=poll, daemon=True).start()
    assert proc.stdout is not None
    for raw in proc.stdout:
        progress.passthrough(raw.decode(errors="replace"))
    code = proc.wait()
    return code if code >= 0 else 128 - code
