"""Real servers for the remote-store tests and benchmarks, started and
stopped by the fixtures (or by ``python servers.py s3|nfs`` for manual use).

* :class:`MotoServer`: ``moto_server`` (PyPI ``moto[server]``) on a free
  127.0.0.1 port. With ``auth=True`` it enforces AWS SigV4 signatures and
  access keys (moto's ``INITIAL_NO_AUTH_ACTION_COUNT``): the fixture creates
  an IAM user and key during the first unauthenticated requests, so wrong
  credentials are rejected as by a real service.
* :class:`NfsServer`: NFS-Ganesha (VFS FSAL) exporting a temporary
  directory over NFSv3, with rpcbind, inside a private network and mount
  namespace (``unshare``): nothing listens outside it, several instances
  can run at once, and no kernel NFS client is involved. Clients reach it
  from a thread that joined the namespace (:meth:`NfsServer.in_netns`: a
  store opened there keeps working from any thread, since its I/O threads
  start inside) or from a process started with :meth:`NfsServer.nsenter`.
* :class:`DelayProxy`: a TCP proxy on 127.0.0.1 that holds every reply for
  a configurable time (a slow server).

Tests skip only when a server binary is missing (or, for NFS, when not
running as root, which network namespaces need); CI installs them
(``requirements-dev.txt``, ``tools/apt-packages.txt``).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from support.tiny_serve import free_port

CLONE_NEWNET = 0x40000000


def find_binary(name: str) -> str | None:
    """``name`` next to this interpreter (the venv), on PATH, or in sbin."""
    here = Path(sys.executable).parent / name
    if here.exists():
        return str(here)
    found = shutil.which(name)
    if found:
        return found
    for d in ("/usr/sbin", "/sbin", "/usr/bin"):
        if (Path(d) / name).exists():
            return str(Path(d) / name)
    return None


def pause_process(proc: subprocess.Popen[bytes]) -> None:
    """Stops ``proc`` (SIGSTOP) and waits until it no longer answers."""
    proc.send_signal(signal.SIGSTOP)
    wait_stopped(proc.pid)


def resume_process(proc: subprocess.Popen[bytes] | None) -> None:
    """Lets a paused ``proc`` run again (SIGCONT)."""
    if proc is not None:
        proc.send_signal(signal.SIGCONT)


def kill_process(proc: subprocess.Popen[bytes] | None) -> None:
    """Kills ``proc``, woken first should it be paused, and reaps it."""
    if proc is not None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGCONT)
        proc.kill()
        proc.wait(timeout=10)


def wait_stopped(pid: int, timeout: float = 5.0) -> None:
    """Waits until every thread of ``pid`` is stopped: SIGSTOP takes effect
    asynchronously, and a request already being served could complete."""
    until = time.monotonic() + timeout
    while time.monotonic() < until:
        states = []
        for task in Path(f"/proc/{pid}/task").glob("*"):
            with contextlib.suppress(OSError):
                states.append((task / "stat").read_text().rsplit(")", 1)[1].split()[0])
        if states and all(s in ("T", "t") for s in states):
            time.sleep(0.05)
            return
        time.sleep(0.01)


@contextlib.contextmanager
def joined_netns(netns: str) -> Iterator[None]:
    """Runs the block with the calling thread in the network namespace
    ``netns`` (a ``/proc/<pid>/ns/net`` path); threads started meanwhile
    stay there."""
    libc = ctypes.CDLL(None, use_errno=True)
    with open(f"/proc/self/task/{threading.get_native_id()}/ns/net") as home:
        with open(netns) as target:
            if libc.setns(target.fileno(), CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), "setns")
        try:
            yield
        finally:
            libc.setns(home.fileno(), CLONE_NEWNET)


def _port_open(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


def _http_ok(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
            s.sendall(b"GET / HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
            return s.recv(64).startswith(b"HTTP/1.1 200") or False
    except OSError:
        return False


class ServerProcess:
    """Stop, pause and resume for a server that runs as one process,
    ``self.proc`` (None while stopped)."""

    proc: subprocess.Popen[bytes] | None = None

    def stop(self) -> None:
        kill_process(self.proc)
        self.proc = None

    def pause(self) -> None:
        """Stops answering (SIGSTOP) until :meth:`resume`."""
        assert self.proc is not None
        pause_process(self.proc)

    def resume(self) -> None:
        resume_process(self.proc)


class MotoServer(ServerProcess):
    """``moto_server`` on 127.0.0.1 (in-memory S3)."""

    def __init__(self, auth: bool = False, log_dir: Path | None = None) -> None:
        binary = find_binary("moto_server")
        if binary is None:
            raise FileNotFoundError("moto_server (pip install 'moto[server]')")
        self.binary = binary
        self.auth = auth
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = (log_dir or Path(tempfile.gettempdir())) / f"moto-{self.port}.log"
        self.access_key = "testing"
        self.secret_key = "testing"
        try:
            self.start()
        except BaseException:
            self.stop()  # never leave a server behind a failed fixture
            raise

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def store_keys(self, bucket: str, prefix: str) -> dict[str, str]:
        """The config keys of an S3 store at ``s3://bucket/prefix`` on this server."""
        return {
            "storage_backends": f"s3://{bucket}/{prefix}",
            "s3_endpoint": self.endpoint,
            "s3_access_key": self.access_key,
            "s3_secret_key": self.secret_key,
        }

    def start(self) -> None:
        env = dict(os.environ)
        if self.auth:
            # Enforce signatures after the IAM setup's three requests.
            env["INITIAL_NO_AUTH_ACTION_COUNT"] = "3"
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [self.binary, "-H", "127.0.0.1", "-p", str(self.port)],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
            )
        until = time.monotonic() + 30
        # With auth, every request counts against the unauthenticated ones
        # the IAM setup needs: only probe that the port is open.
        ready = _port_open if self.auth else _http_ok
        while not ready(self.port):
            if self.proc.poll() is not None or time.monotonic() > until:
                raise RuntimeError(f"moto_server did not start; see {self.log}")
            time.sleep(0.05)
        if self.auth:
            self._create_user()

    def _create_user(self) -> None:
        import boto3

        iam = boto3.client(
            "iam",
            endpoint_url=self.endpoint,
            region_name="us-east-1",
            aws_access_key_id="bootstrap",
            aws_secret_access_key="bootstrap",
        )
        iam.create_user(UserName="ucm")
        key = iam.create_access_key(UserName="ucm")["AccessKey"]
        policy = {
            "Version": "2012-10-17",
            "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}],
        }
        iam.put_user_policy(UserName="ucm", PolicyName="all", PolicyDocument=json.dumps(policy))
        self.access_key = key["AccessKeyId"]
        self.secret_key = key["SecretAccessKey"]

    def client(self) -> Any:
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            region_name="us-east-1",
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
        )

    def create_bucket(self, name: str | None = None) -> str:
        name = name or f"ucm-{uuid.uuid4().hex[:12]}"
        self.client().create_bucket(Bucket=name)
        return name

    def restart(self) -> None:
        """Starts again on the same port (moto keeps nothing: buckets are gone)."""
        self.stop()
        self.start()

    def close(self) -> None:
        self.stop()
        with contextlib.suppress(FileNotFoundError):
            self.log.unlink()  # kept only while the server runs (a failing test reads it)


# One export for the Python and the Rust NFS tests alike.
GANESHA_CONF = Path(__file__).resolve().parents[3] / "tools" / "nfs" / "ganesha-test.conf"

# Inside the new namespaces: private /run (rpcbind's socket and state) and
# /var/lib/nfs (ganesha's recovery state), loopback up.
_NS_INIT = (
    "mount -t tmpfs tmpfs /run && mkdir -p /run/rpcbind && "
    "(mount -t tmpfs tmpfs /var/lib/nfs 2>/dev/null || true) && "
    "ip link set lo up && echo ready && exec sleep infinity"
)


class NfsServer(ServerProcess):
    """NFS-Ganesha + rpcbind in private namespaces, exporting ``<dir>/export``."""

    NFS_PORT = 2049
    MOUNT_PORT = 20048

    def __init__(self, base: Path | None = None) -> None:
        missing = [
            b for b in ("ganesha.nfsd", "rpcbind", "unshare", "nsenter", "ip") if not find_binary(b)
        ]
        if missing:
            raise FileNotFoundError(
                f"{', '.join(missing)} (apt-get install nfs-ganesha nfs-ganesha-vfs rpcbind)"
            )
        if os.geteuid() != 0:
            raise PermissionError("the NFS server needs root (network namespaces)")
        self.base = Path(base or tempfile.mkdtemp(prefix="ucm-nfs-"))
        self._own_base = base is None
        self.export = self.base / "export"
        self.export.mkdir(parents=True, exist_ok=True)
        self.conf = self.base / "ganesha.conf"
        self.conf.write_text(GANESHA_CONF.read_text().replace("@EXPORT@", str(self.export)))
        self.log = self.base / "ganesha.log"
        self.holder = subprocess.Popen(
            ["unshare", "--net", "--mount", "--", "sh", "-c", _NS_INIT],
            stdout=subprocess.PIPE,
        )
        assert self.holder.stdout is not None
        if self.holder.stdout.readline().strip() != b"ready":
            self.holder.kill()
            raise RuntimeError("could not set up the network namespace")
        self.rpcbind = subprocess.Popen(
            self.nsenter(["rpcbind", "-f", "-w"], mount=True),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        time.sleep(0.2)
        self.proc: subprocess.Popen[bytes] | None = None  # Ganesha
        try:
            self.start()
        except BaseException:
            self.close()  # never leave servers behind a failed fixture
            raise

    @property
    def netns(self) -> str:
        return f"/proc/{self.holder.pid}/ns/net"

    def nsenter(self, cmd: list[str], mount: bool = False) -> list[str]:
        """``cmd`` run inside the server's network (and mount) namespace."""
        ns = ["--net", "--mount"] if mount else ["--net"]
        return ["nsenter", "--target", str(self.holder.pid), *ns, "--", *cmd]

    def url(self, sub: str = "") -> str:
        return f"nfs://127.0.0.1{self.export}/{sub}".rstrip("/")

    def in_netns(self) -> contextlib.AbstractContextManager[None]:
        """Runs the block with the calling thread in the server's network
        namespace (threads started meanwhile stay there)."""
        return joined_netns(self.netns)

    def start(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.log.unlink()
        self.proc = subprocess.Popen(
            self.nsenter(
                [
                    find_binary("ganesha.nfsd") or "ganesha.nfsd",
                    "-F",
                    "-N",
                    "NIV_EVENT",
                    "-L",
                    str(self.log),
                    "-f",
                    str(self.conf),
                    "-p",
                    str(self.base / "ganesha.pid"),
                ],
                mount=True,
            ),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        until = time.monotonic() + 30
        connect = f"import socket; socket.create_connection(('127.0.0.1', {self.NFS_PORT}), 1)"
        while True:
            probe = subprocess.run(
                self.nsenter([sys.executable, "-c", connect]), capture_output=True
            )
            if probe.returncode == 0:
                time.sleep(0.2)
                return
            if self.proc.poll() is not None or time.monotonic() > until:
                raise RuntimeError(f"ganesha did not start; see {self.log}")
            time.sleep(0.1)

    def close(self) -> None:
        self.stop()
        for p in (self.rpcbind, self.holder):
            p.kill()
            p.wait(timeout=10)
        if self._own_base:
            shutil.rmtree(self.base, ignore_errors=True)


class DelayProxy:
    """TCP proxy 127.0.0.1:<port> -> 127.0.0.1:<target>; every chunk coming
    back from the server is held ``delay`` seconds (a slow server)."""

    def __init__(self, target_port: int, delay: float = 0.0) -> None:
        self.target_port = target_port
        self.delay = delay
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = int(self.sock.getsockname()[1])
        self.closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while not self.closed:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target_port))
            except OSError:
                client.close()
                continue
            threading.Thread(target=self._pump, args=(client, upstream, 0), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, 1), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, slow: int) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                if slow and self.delay:
                    time.sleep(self.delay)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
                s.close()

    def close(self) -> None:
        self.closed = True
        # shutdown() wakes the thread blocked in accept(); close() alone
        # would leave the socket listening until that call returns.
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


_TINY_MODEL: str | None = None  # made once per session


def vllm_two_engines(
    tmp: Path,
    ucm: dict[str, Any],
    spawn_in: Callable[[str], contextlib.AbstractContextManager[Any]] = lambda _: (
        contextlib.nullcontext()
    ),
) -> list[dict[str, Any]]:
    """Two vLLM engines, one after the other in their own processes (two
    "nodes"), with the same ``ucm`` store config: A computes and saves, B
    should hit A's blocks. Returns both engines' ``generate`` results.
    ``spawn_in(name)`` is entered while engine ``name`` ("A", "B") starts
    (the NFS tests start both inside the server's network namespace, the
    Mooncake tests each on a host of its own).

    The connector creates ``storage_backends`` as local directories even
    for URLs (``s3://b/p`` gives ``/b/p``); what that leaves behind at the
    file system root is removed here."""
    from ucm.vllm_demo.engine_process import EngineProcess, engine_env
    from ucm.vllm_demo.tiny_model import make_tiny_llama

    global _TINY_MODEL
    if _TINY_MODEL is None or not Path(_TINY_MODEL).exists():
        where = tempfile.mkdtemp(prefix="ucm-tiny-model-")
        atexit.register(shutil.rmtree, where, True)
        _TINY_MODEL = str(make_tiny_llama(Path(where)))
    model = _TINY_MODEL
    rng = np.random.default_rng(5)
    prompts = [[int(t) for t in rng.integers(4, 500, size=n)] for n in (100, 70)]
    url = str(ucm.get("storage_backends", ""))
    junk = Path("/" + url.split("://", 1)[1].split("/", 1)[0]) if "://" in url else None
    existed = junk is not None and junk.exists()
    outs = []
    try:
        for name in ("A", "B"):
            with spawn_in(name):
                engine = EngineProcess(
                    {"model": model, "ucm": ucm}, tmp / f"{name}.log", env=engine_env(), cwd=tmp
                )
            try:
                out = engine.generate(prompts, 6)
                out["prompts"] = prompts
                outs.append(out)
            finally:
                engine.close()  # flushes the cache tier
    finally:
        if junk is not None and not existed and junk.is_dir():
            shutil.rmtree(junk, ignore_errors=True)
    return outs


def main() -> None:
    """``servers.py s3`` / ``servers.py nfs``: start one, print how to reach
    it, run until interrupted."""
    kind = sys.argv[1] if len(sys.argv) > 1 else "s3"
    server: MotoServer | NfsServer
    if kind == "s3":
        server = MotoServer()
        bucket = server.create_bucket("ucm-bench")
        print(json.dumps({"endpoint": server.endpoint, "bucket": bucket}), flush=True)
    else:
        server = NfsServer()
        print(json.dumps({"url": server.url(), "netns": server.netns}), flush=True)
    try:
        signal.sigwait({signal.SIGINT, signal.SIGTERM})
    finally:
        server.close()


if __name__ == "__main__":
    main()
