"""Mooncake's own client, joined to a pool from the ``Mooncake`` stage's keys.

The store itself (block format, staging, verified loads, failures) is in the
Rust core; what lives here is the part only Python can do: importing
``mooncake.store`` (from ``mooncake-transfer-engine-non-cuda`` on PyPI, or
the CUDA and RDMA builds), calling ``setup`` and wrapping the calls the
core makes in :class:`MooncakePool`. Blocks go through ``batch_put_from``,
``batch_get_into`` and ranged gets (``get_into_ranges``) on memory the core
registered, so no block is ever copied into a Python object.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Sequence
from typing import Any

from ucm import _native
from ucm.errors import InvalidParamError, StoreTimeoutError, TaskFailedError
from ucm.store.config import StageConfig

_GIB = 1 << 30
# Mooncake's client refuses a zero-sized transfer buffer, and segments
# under 16 MiB.
_MIN_LOCAL_BUFFER = 1 << 20
_MIN_SEGMENT = 16 << 20
# Mooncake's ErrorCodes that answer a size query for a key without a usable
# replica.
_OBJECT_NOT_FOUND = -704
_REPLICA_IS_NOT_READY = -703
_INVALID_PARAMS = -600


def _import_client() -> Any:
    try:
        from mooncake import store  # type: ignore[import-not-found]
    except ImportError as e:
        raise InvalidParamError(
            "store_pipeline: the Mooncake stage needs Mooncake's client; install it with "
            "`pip install 'ucm-kvcache[mooncake]'` (mooncake-transfer-engine-non-cuda, "
            "the TCP build; use mooncake-transfer-engine for CUDA and RDMA) and, on Debian, "
            f"`apt-get install libibverbs1` ({e})"
        ) from None
    return store


def _split_host_port(key: str, addr: str) -> tuple[str, int]:
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise InvalidParamError(f"{key}: {addr!r} is not host:port")
    return host.strip("[]"), int(port)


def route_address(master: str) -> str:
    """The address this host uses to reach ``master`` (``host:port``): what
    other clients should connect to. No packet is sent."""
    host, port = _split_host_port("mooncake_master", master)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
    except OSError as e:
        raise InvalidParamError(f"mooncake_master: cannot resolve {host!r}: {e}") from None
    family, _, _, _, sockaddr = infos[0]
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        try:
            s.connect(sockaddr)
        except OSError as e:
            raise InvalidParamError(
                f"mooncake_master: no route to {master} from this host ({e}); set "
                f"mooncake_local_hostname"
            ) from None
        return str(s.getsockname()[0])


def _check_reachable(master: str, budget: float) -> None:
    """Fails at once, naming the key, when nothing answers at ``master``
    (Mooncake's own setup retries for minutes)."""
    host, port = _split_host_port("mooncake_master", master)
    try:
        socket.create_connection((host, port), timeout=min(budget, 5.0)).close()
    except OSError as e:
        raise StoreTimeoutError(
            f"mooncake_master: nothing answers at {master} ({e}); is mooncake_master running there?"
        ) from None


def _call_within(budget: float, late: str, fn: Any, *args: Any) -> Any:
    """``fn(*args)`` on a helper thread, waited for ``budget`` seconds. A
    call that overruns is left to finish on its own (the client can't be
    interrupted) and the error ``late`` is raised."""
    out: list[Any] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            out.append(fn(*args))
        except BaseException as e:
            errors.append(e)

    t = threading.Thread(target=run, name="ucm-mooncake-setup", daemon=True)
    t.start()
    t.join(budget)
    if t.is_alive():
        raise StoreTimeoutError(late)
    if errors:
        raise TaskFailedError(f"mooncake_master: the Mooncake client's setup raised: {errors[0]}")
    return out[0]


def _size_of(replicas: Any) -> int:
    """An object's size from its replica descriptors: the first complete
    memory replica's; Mooncake's code when there is none."""
    if not replicas:
        return _OBJECT_NOT_FOUND
    for r in replicas:
        if r.is_memory_replica() and r.status.name == "COMPLETE":
            return int(r.get_memory_descriptor().buffer_descriptor.size)
    return _REPLICA_IS_NOT_READY


class MooncakePool:
    """A Mooncake client joined to a pool, with the calls the core makes.
    Every call returns one Mooncake code per key (``>= 0`` is success)."""

    def __init__(self, client: Any, replicate: Any) -> None:
        self._client = client
        self._replicate = replicate
        self._lock = threading.Lock()
        self._closed = False

    @classmethod
    def connect(cls, cfg: StageConfig) -> MooncakePool:
        """Sets up Mooncake's client from the stage's keys (``${VAR}``
        expanded) and joins the pool; raises naming the key at fault."""
        store = _import_client()
        master = _native.expand_env("mooncake_master", cfg.mooncake_master).strip()
        _split_host_port("mooncake_master", master)
        metadata = _native.expand_env(
            "mooncake_metadata_server", cfg.mooncake_metadata_server
        ).strip()
        hostname = _native.expand_env(
            "mooncake_local_hostname", cfg.mooncake_local_hostname
        ).strip() or route_address(master)
        device = _native.expand_env("mooncake_device_name", cfg.mooncake_device_name).strip()
        segment = int(cfg.mooncake_global_segment_gb * _GIB)
        if 0 < segment < _MIN_SEGMENT:
            raise InvalidParamError(
                f"mooncake_global_segment_gb: {cfg.mooncake_global_segment_gb} is below "
                f"Mooncake's smallest segment (16 MiB); use 0 to lend no memory"
            )
        local_buffer = max(int(cfg.mooncake_local_buffer_gb * _GIB), _MIN_LOCAL_BUFFER)
        budget = cfg.timeout_ms / 1000 if cfg.timeout_ms else 30.0
        _check_reachable(master, budget)
        client = store.MooncakeDistributedStore()
        rc = _call_within(
            budget,
            f"mooncake_master: {master} accepted a connection but the Mooncake client's setup "
            f"did not finish within {budget:g} s (timeout_ms)",
            client.setup,
            hostname,
            metadata,
            segment,
            local_buffer,
            cfg.mooncake_protocol,
            device,
            master,
        )
        if rc != 0:
            raise TaskFailedError(
                f"mooncake_master: could not join the Mooncake pool at {master} (setup returned "
                f"{rc}; local host {hostname!r}, metadata {metadata!r}, protocol "
                f"{cfg.mooncake_protocol}). Is mooncake_master running and reachable, and is "
                f"{hostname!r} an address of this host other than loopback?"
            )
        replicate = store.ReplicateConfig()
        replicate.replica_num = int(cfg.mooncake_replica_num)
        if cfg.mooncake_soft_pin:
            replicate.soft_pin_action = store.SoftPinAction.ENABLE
        return cls(client, replicate)

    # -- the calls the core makes (on its own threads, GIL released inside)
    def sizes(self, keys: Sequence[str]) -> list[int]:
        # One round trip to the master for all keys (get_size is one each).
        descs = self._client.batch_get_replica_desc(list(keys))
        return [_size_of(descs.get(k)) for k in keys]

    def put_from(self, keys: Sequence[str], addrs: Sequence[int], lens: Sequence[int]) -> list[int]:
        return list(
            self._client.batch_put_from(list(keys), list(addrs), list(lens), self._replicate)
        )

    def get_whole(
        self, keys: Sequence[str], addrs: Sequence[int], lens: Sequence[int]
    ) -> list[int]:
        """Each whole object into its buffer (``lens[i]`` bytes at least)."""
        return list(self._client.batch_get_into(list(keys), list(addrs), list(lens)))

    def get_ranges(
        self,
        keys: Sequence[str],
        addrs: Sequence[int],
        lens: Sequence[int],
        offsets: Sequence[int],
    ) -> list[int]:
        """``lens[i]`` bytes of each object from byte ``offsets[i]`` (one
        ranged get for all: a layer-wise load reads a shard, not the block)."""
        out = self._client.get_into_ranges(
            list(addrs),
            [[k] for k in keys],
            [[[0]] for _ in keys],
            [[[int(o)]] for o in offsets],
            [[[int(n)]] for n in lens],
        )
        return [int(r[0][0]) if r and r[0] else _INVALID_PARAMS for r in out]

    def remove(self, keys: Sequence[str]) -> list[int]:
        return [int(self._client.remove(k, True)) for k in keys]

    def register(self, addr: int, size: int) -> int:
        return int(self._client.register_buffer(addr, size))

    def unregister(self, addr: int) -> None:
        with self._lock:
            if not self._closed:
                self._client.unregister_buffer(addr)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._client.close()
