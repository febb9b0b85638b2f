"""A real Mooncake Store cluster for the Mooncake tests and benchmark:
``mooncake_master`` and a standalone store service (``mooncake_client``)
that lends the pool its memory, on two private "hosts".

Each host is a network namespace of its own (``unshare --net``), joined
by a veth pair: host 1 is ``192.0.2.10`` and runs the master and the store
service, host 2 is ``192.0.2.11``. The master binds ``0.0.0.0`` whatever
it is told, and Mooncake's transfer engine refuses hosts with loopback
only; inside the namespaces neither matters, and nothing listens outside
them. Clients join a host from a thread (:meth:`MooncakeCluster.on_host`:
a store opened there keeps working from any thread, since its own threads
and the client's start inside) or from a process started there.

Needs root (namespaces), ``ip`` and the binaries from
``mooncake-transfer-engine-non-cuda`` (with ``libibverbs1``); the tests
skip without them and CI installs them.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from support.servers import find_binary, joined_netns, kill_process

HOST_ADDRS = ("192.0.2.10", "192.0.2.11")
MASTER_PORT = 50051
SERVICE_PORT = 50052
_HOLD = "ip link set lo up && echo ready && exec sleep infinity"


def binary(name: str) -> str | None:
    # The binaries come with the Python package, next to the interpreter.
    local = Path(sys.executable).parent / name
    return str(local) if local.exists() else find_binary(name)


def missing_requirements() -> str | None:
    """Why the cluster can't run here, or None."""
    if os.geteuid() != 0:
        return "Mooncake tests need root (network namespaces)"
    for b in ("mooncake_master", "mooncake_client"):
        if binary(b) is None:
            return f"{b} not found (pip install mooncake-transfer-engine-non-cuda)"
    for b in ("unshare", "nsenter", "ip"):
        if find_binary(b) is None:
            return f"{b} not found (apt-get install iproute2 util-linux)"
    probe = subprocess.run([binary("mooncake_master") or "", "--version"], capture_output=True)
    if b"libibverbs" in probe.stderr:
        return "mooncake_master needs libibverbs1 (apt-get install libibverbs1)"
    return None


class MooncakeCluster:
    """A master and one store service lending ``pool_mb`` MiB, on host 1."""

    def __init__(
        self,
        pool_mb: int = 64,
        lease_ms: int = 200,
        master_cmd: list[str] | None = None,
        service_cmd: list[str] | None = None,
    ) -> None:
        """``master_cmd`` / ``service_cmd``: other command lines for the two
        servers (the Mooncake page's), run on the first host as they are."""
        why = missing_requirements()
        if why:
            raise FileNotFoundError(why)
        self.pool_mb = pool_mb
        self.lease_ms = lease_ms
        self.master_cmd = master_cmd
        self.service_cmd = service_cmd
        self.dir = Path(tempfile.mkdtemp(prefix="ucm-mooncake-"))
        self.hosts = [self._namespace() for _ in HOST_ADDRS]
        self.master: subprocess.Popen[bytes] | None = None
        self.service: subprocess.Popen[bytes] | None = None
        try:
            self._wire()
            self.start_master()
            self.start_service()
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _namespace() -> subprocess.Popen[bytes]:
        holder = subprocess.Popen(
            ["unshare", "--net", "--", "sh", "-c", _HOLD], stdout=subprocess.PIPE
        )
        assert holder.stdout is not None
        if holder.stdout.readline().strip() != b"ready":
            holder.kill()
            raise RuntimeError("could not set up a network namespace")
        return holder

    def netns(self, host: int) -> str:
        return f"/proc/{self.hosts[host].pid}/ns/net"

    def nsenter(self, host: int, cmd: list[str]) -> list[str]:
        """``cmd`` run on ``host`` (0 or 1)."""
        return ["nsenter", "--target", str(self.hosts[host].pid), "--net", "--", *cmd]

    def on_host(self, host: int = 0) -> contextlib.AbstractContextManager[None]:
        """The calling thread on ``host`` for the block."""
        return joined_netns(self.netns(host))

    def _wire(self) -> None:
        run = lambda host, *cmd: subprocess.run(self.nsenter(host, ["ip", *cmd]), check=True)  # noqa: E731
        run(0, "link", "add", "mc0", "type", "veth", "peer", "name", "mc1")
        run(0, "link", "set", "mc1", "netns", str(self.hosts[1].pid))
        for host, dev in ((0, "mc0"), (1, "mc1")):
            run(host, "addr", "add", f"{HOST_ADDRS[host]}/24", "dev", dev)
            run(host, "link", "set", dev, "up")

    @property
    def master_addr(self) -> str:
        return f"{HOST_ADDRS[0]}:{MASTER_PORT}"

    def store_keys(self, prefix: str, **overrides: object) -> dict[str, object]:
        """The Mooncake stage's keys for a client of this cluster that lends
        no memory itself (the store service holds the pool)."""
        return {
            "mooncake_master": self.master_addr,
            "mooncake_global_segment_gb": 0,
            "mooncake_key_prefix": prefix,
            "mooncake_staging_buffer_gb": 0.02,
            **overrides,
        }

    def _start(self, name: str, cmd: list[str], port: int) -> subprocess.Popen[bytes]:
        """``cmd`` on host 1, logging to ``<name>.log``, once it listens on ``port``."""
        with open(self.dir / f"{name}.log", "ab") as log:
            proc = subprocess.Popen(self.nsenter(0, cmd), stdout=log, stderr=subprocess.STDOUT)
        connect = f"import socket; socket.create_connection(('{HOST_ADDRS[0]}', {port}), 1)"
        until = time.monotonic() + 30
        while subprocess.run(
            self.nsenter(0, [sys.executable, "-c", connect]), capture_output=True
        ).returncode:
            if proc.poll() is not None or time.monotonic() > until:
                kill_process(proc)
                raise RuntimeError(f"{cmd[0]} did not start; see {self.dir}")
            time.sleep(0.1)
        return proc

    def start_master(self) -> None:
        cmd = self.master_cmd or [
            binary("mooncake_master") or "mooncake_master",
            f"--rpc_address={HOST_ADDRS[0]}",
            f"--rpc_port={MASTER_PORT}",
            "--metrics_port=9003",
            "--rpc_thread_num=4",
            f"--default_kv_lease_ttl={self.lease_ms}",
        ]
        self.master = self._start("master", cmd, MASTER_PORT)

    def start_service(self) -> None:
        cmd = self.service_cmd or [
            binary("mooncake_client") or "mooncake_client",
            f"--master_server_address={self.master_addr}",
            "--metadata_server=P2PHANDSHAKE",
            f"--host={HOST_ADDRS[0]}",
            f"--global_segment_size={self.pool_mb} MB",
            "--protocol=tcp",
            f"--port={SERVICE_PORT}",
        ]
        self.service = self._start("service", cmd, SERVICE_PORT)
        time.sleep(0.5)  # its segment is mounted right after it listens

    def stop_master(self) -> None:
        kill_process(self.master)
        self.master = None

    def close(self) -> None:
        for p in (self.service, self.master):
            kill_process(p)
        for h in self.hosts:
            h.kill()
            h.wait(timeout=10)
        self.service = self.master = None
        shutil.rmtree(self.dir, ignore_errors=True)
