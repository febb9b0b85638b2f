"""LMCache as a comparator for ``benches/ttft.py``.

LMCache's in-process connector (``LMCacheConnectorV1``) has no CPU path: on a
machine without an accelerator it finds no KV connector for the ``cpu``
device, logs the error and silently recomputes every prompt. Its CPU path is
the multi-process one: an LMCache server process (``lmcache.v1.multiprocess.
server``) holds the cache (an L1 pool in shared memory, an L2 tier of files),
and vLLM's ``LMCacheMPConnector`` in the engine copies KV between that pool
and vLLM's cache. This module starts that server and engines that use it.

LMCache is not a dependency of this project: install it into a directory of
its own, without its CUDA-only dependencies, and pass that directory to
``ttft.py --lmcache-path``::

    python -m pip install --no-deps --target DIR lmcache==0.5.6 \\
        sortedcontainers aiofile aiofiles caio

(its other runtime dependencies are already in this project's environment).

Run as a script, this file is the engine child: the harness's engine with a
workaround applied first (see :func:`_main`).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python" / "tests"))

from support.tiny_serve import free_port

CONNECTOR = "LMCacheMPConnector"


def lmcache_import_error(path: Path, env: dict[str, str]) -> str | None:
    """Why LMCache's vLLM connector cannot be imported from ``path`` (None if it can).

    Checked in a child process so that this one does not import vLLM."""
    proc = subprocess.run(
        [sys.executable, "-c", "import lmcache.integration.vllm.lmcache_mp_connector"],
        env=with_lmcache(env, path),
        capture_output=True,
        text=True,
    )
    if proc.returncode == 0:
        return None
    lines = proc.stderr.strip().splitlines()
    return lines[-1] if lines else f"exit status {proc.returncode}"


def with_lmcache(env: dict[str, str], path: Path) -> dict[str, str]:
    """``env`` with ``path`` first on the Python path, LMCache's banner off."""
    out = dict(env)
    out["PYTHONPATH"] = os.pathsep.join(p for p in (str(path), env.get("PYTHONPATH", "")) if p)
    out["LMCACHE_DISABLE_BANNER"] = "1"
    return out


class LMCacheServer:
    """An LMCache multi-process server: an L1 pool of ``l1_gib`` in shared
    memory and an L2 tier of files under ``disk``, with ``chunk`` tokens per
    cache entry (one file each). ``l2``: LMCache's file adapter, ``fs``
    (Python, asyncio) or ``fs_native`` (its C++ connector, a thread pool)."""

    def __init__(
        self,
        path: Path,
        env: dict[str, str],
        disk: Path,
        chunk: int,
        l1_gib: float,
        log: Path,
        l2: str = "fs",
        start_timeout_s: float = 180.0,
    ) -> None:
        self.port = free_port()
        self.disk = disk
        self.chunk = chunk
        disk.mkdir(parents=True, exist_ok=True)
        self._log = open(log, "w")
        args = [
            sys.executable,
            "-m",
            "lmcache.v1.multiprocess.server",
            "--host",
            "localhost",
            "--port",
            str(self.port),
            "--chunk-size",
            str(chunk),
            "--l1-size-gb",
            str(l1_gib),
            "--eviction-policy",
            "LRU",
            # The engine copies KV straight between this shared pool and
            # its own cache; without it, every chunk is pickled over ZMQ.
            "--supported-transfer-mode",
            "engine_driven",
            "--shm-name",
            f"ucm-ttft-{os.getpid()}-{self.port}",
            "--l2-adapter",
            json.dumps({"type": l2, "base_path": str(disk)}),
            "--disable-observability",
        ]
        self.proc = subprocess.Popen(
            args,
            env=with_lmcache(env, path),
            stdout=self._log,
            stderr=subprocess.STDOUT,
            cwd=str(log.parent),
        )
        deadline = time.monotonic() + start_timeout_s
        while True:
            if self.proc.poll() is not None:
                self._log.close()
                raise RuntimeError(f"LMCache server exited ({self.proc.returncode}); see {log}")
            try:
                socket.create_connection(("localhost", self.port), timeout=1).close()
                break
            except OSError as err:
                if time.monotonic() > deadline:
                    self.close()
                    raise RuntimeError(f"LMCache server did not listen in time; see {log}") from err
                time.sleep(0.5)

    def kv_transfer_config(self) -> dict[str, Any]:
        """vLLM's ``kv_transfer_config`` for an engine that uses this server."""
        return {
            "kv_connector": CONNECTOR,
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "lmcache.mp.host": "tcp://localhost",
                "lmcache.mp.port": self.port,
            },
        }

    def files(self) -> int:
        return sum(1 for p in self.disk.iterdir() if p.name.endswith(".data"))

    def wait_for_files(self, n: int, timeout_s: float = 300.0) -> int:
        """Waits until the L2 tier holds at least ``n`` chunk files (it is
        written behind L1); returns how many it holds."""
        deadline = time.monotonic() + timeout_s
        while (have := self.files()) < n and time.monotonic() < deadline:
            time.sleep(0.5)
        return have

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if not self._log.closed:
            self._log.close()


class LMCacheSpawner:
    """Starts harness engines (``ucm.vllm_demo.engine_process.EngineSpawner``) as this
    file run as a script, with LMCache importable."""

    def __init__(self, path: Path, env: dict[str, str]) -> None:
        self.env = with_lmcache(env, path)

    def spawn(
        self, config: dict[str, Any], log: Path, cwd: Path
    ) -> tuple[subprocess.Popen[str], IO[str], IO[str]]:
        # Appends: EngineProcess has just created the log and writes the
        # child's stray stdout lines to it as well.
        err = open(log, "a")
        try:
            proc = subprocess.Popen(
                [sys.executable, str(Path(__file__).resolve()), json.dumps(config)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                env=self.env,
                cwd=str(cwd),
            )
        finally:
            err.close()
        assert proc.stdin is not None and proc.stdout is not None
        return proc, proc.stdout, proc.stdin


def _main() -> None:
    # When the worker starts, vLLM's CPU platform scans the attributes of
    # every loaded module for Triton kernels and calls
    # ``vars(value).get("kernel")`` on each (vllm/triton_utils/dispatcher.py,
    # _rebind_kernels). LMCache's connector imports numba, whose llvmlite
    # library wrapper answers ``__dict__`` with a wrapped C function, and the
    # scan raises. A real (empty) dict there makes it skip the wrapper.
    from llvmlite.binding import ffi

    ffi.lib._fntab["__dict__"] = {}

    from ucm.vllm_demo.engine_process import run_engine

    run_engine(json.loads(sys.argv[1]), sys.stdin, sys.stdout)


if __name__ == "__main__":
    _main()
