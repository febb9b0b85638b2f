"""Bad input gets a clear exception naming the problem, and never harms
what is already stored."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from support.store_helpers import SHARD, SHARDS, base_config

from ucm.shared.config import ConfigError
from ucm.store import (
    InvalidParamError,
    NoSpaceError,
    PipelineStoreConfig,
    UcmConnectorFactory,
    UcmStoreError,
    UnsupportedError,
)


def block(seed: int) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        [torch.randint(0, 255, (SHARD // 2,), dtype=torch.uint8, generator=g) for _ in range(2)]
        for _ in range(SHARDS)
    ]


def put(store, bid: bytes, data) -> None:
    store.wait(store.dump([bid] * SHARDS, list(range(SHARDS)), data))


def get(store, bid: bytes):
    out = [[torch.empty(SHARD // 2, dtype=torch.uint8) for _ in range(2)] for _ in range(SHARDS)]
    store.wait(store.load([bid] * SHARDS, list(range(SHARDS)), out))
    return out


def same(a, b) -> bool:
    return all(
        torch.equal(x, y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True)
    )


def test_id_length_is_named(make_store) -> None:
    store = make_store()
    with pytest.raises(InvalidParamError, match=r"block_ids\[1\] must be exactly 16 bytes, got 3"):
        store.lookup([b"a" * 16, b"abc"])
    with pytest.raises(InvalidParamError, match="must be bytes"):
        store.lookup(["a" * 16])
    with pytest.raises(InvalidParamError) as info:
        store.lookup_on_prefix([b"a" * 20])
    assert info.value.code == -50000 and isinstance(info.value, ValueError)


def test_shard_index_length_must_match(make_store) -> None:
    store = make_store()
    with pytest.raises(InvalidParamError, match="shard_index has 1 entries but block_ids has 2"):
        store.dump([b"a" * 16, b"b" * 16], [0], block(0)[:2])
    with pytest.raises(InvalidParamError, match="out of range"):
        store.dump([b"a" * 16], [SHARDS], block(0)[:1])
    with pytest.raises(InvalidParamError, match="negative"):
        store.dump([b"a" * 16], [-1], block(0)[:1])


def test_tensor_sizes_must_sum_to_shard_size(make_store) -> None:
    store = make_store()
    short = [torch.zeros(SHARD // 2, dtype=torch.uint8)]
    with pytest.raises(InvalidParamError, match=f"expected shard_size {SHARD}"):
        store.dump([b"a" * 16], [0], [short])
    # Any split is fine as long as the bytes add up.
    store.wait(store.dump([b"a" * 16], [0], [[torch.zeros(SHARD // 4, dtype=torch.float32)]]))


def test_non_contiguous_and_non_cpu_tensors(make_store) -> None:
    store = make_store()
    t = torch.zeros(SHARD, dtype=torch.uint8).view(2, -1).t()
    with pytest.raises(InvalidParamError, match="not contiguous"):
        store.dump([b"a" * 16], [0], [[t]])
    meta = torch.empty(SHARD, dtype=torch.uint8, device="meta")
    with pytest.raises(InvalidParamError, match="meta"):
        store.load([b"a" * 16], [0], [[meta]])
    ro = np.zeros(SHARD, dtype=np.uint8)
    ro.flags.writeable = False
    with pytest.raises(InvalidParamError, match="read-only"):
        store.load([b"a" * 16], [0], [[ro]])
    with pytest.raises(InvalidParamError, match="torch CPU tensor or a numpy array"):
        store.dump([b"a" * 16], [0], [[b"\0" * SHARD]])


def test_address_matrix_shape_is_checked(make_store) -> None:
    store = make_store()
    with pytest.raises(InvalidParamError, match="one row per block id"):
        store.dump_data([b"a" * 16, b"b" * 16], [0, 0], np.zeros((1, 2), dtype=np.uint64))
    with pytest.raises(InvalidParamError, match="column"):
        store.dump_data([b"a" * 16], [0], np.zeros((1, 3), dtype=np.uint64))
    with pytest.raises(InvalidParamError, match="null memory address"):
        store.dump_data([b"a" * 16], [0], np.zeros((1, 2), dtype=np.uint64))


def test_missing_directory_is_created_private_or_named(tmp_path: Path) -> None:
    # As the quick start's example writes it: the directory does not exist yet.
    missing = tmp_path / "data" / "kvcache"
    store = UcmConnectorFactory.create_connector("UcmPipelineStore", base_config(missing))
    store.close()
    assert missing.is_dir()
    assert (missing.stat().st_mode & 0o777) == 0o700
    assert ((tmp_path / "data").stat().st_mode & 0o777) == 0o700
    # A lookup-only store creates nothing.
    other = tmp_path / "not-made"
    with pytest.raises(InvalidParamError, match=rf"storage_backends\[0\].*{other}"):
        UcmConnectorFactory.create_connector("UcmPipelineStore", base_config(other, device_id=-1))
    assert not other.exists()
    # One that can't be created is named.
    (tmp_path / "file").write_text("x")
    bad = tmp_path / "file" / "kv"
    with pytest.raises(InvalidParamError, match=rf"storage_backends\[0\].*{bad}.*can't be created"):
        UcmConnectorFactory.create_connector("UcmPipelineStore", base_config(bad))


def test_unwritable_directory_is_named(small_tmpfs) -> None:
    ro = small_tmpfs("1m", "ro")
    with pytest.raises(InvalidParamError, match="not writable"):
        UcmConnectorFactory.create_connector("UcmPipelineStore", base_config(ro))
    # A lookup-only store (the scheduler role) may sit on a read-only directory.
    store = UcmConnectorFactory.create_connector("UcmPipelineStore", base_config(ro, device_id=-1))
    assert store.lookup([b"a" * 16]) == [False]
    with pytest.raises(UnsupportedError, match="device_id = -1"):
        store.dump([b"a" * 16], [0], block(0)[:1])
    store.close()


def test_full_disk_fails_the_dump_and_keeps_stored_blocks(small_tmpfs) -> None:
    root = small_tmpfs("3m")
    store = UcmConnectorFactory.create_connector("UcmPipelineStore", base_config(root))
    kept = {}
    error = None
    for n in range(40):  # ~290 KiB per block: the 3 MiB file system fills up
        bid = n.to_bytes(16, "little")
        data = block(n)
        try:
            put(store, bid, data)
            kept[bid] = data
        except UcmStoreError as e:
            error = e
            break
    assert isinstance(error, NoSpaceError), error
    assert error.code == -50009 and "No space" in str(error)
    assert kept, "nothing fit before the disk filled"
    for bid, data in kept.items():
        assert same(get(store, bid), data)
    store.close()
    # Failed dumps leave no temporary file (spare files stay for the next
    # store to adopt).
    leftovers = [
        p for p in root.glob(".work/*/*") if not p.name.startswith(("spare.", "lock", "closed"))
    ]
    assert leftovers == []


def test_config_errors_name_key_and_source(tmp_path: Path) -> None:
    with pytest.raises(
        ConfigError, match=r"unknown config key 'blok_size' \(config\).*valid keys:.*block_size"
    ):
        PipelineStoreConfig.from_dict({**base_config(tmp_path), "blok_size": 1})
    with pytest.raises(ConfigError, match=r"io_threads \(config\): expected an integer"):
        PipelineStoreConfig.from_dict({**base_config(tmp_path), "io_threads": "many"})
    with pytest.raises(ConfigError, match="io_engine"):
        PipelineStoreConfig.from_dict({**base_config(tmp_path), "io_engine": "aio"})
    with pytest.raises(ConfigError, match="unknown stage 'Cash'"):
        PipelineStoreConfig.from_dict({**base_config(tmp_path), "store_pipeline": "Cash"})
    with pytest.raises(ConfigError, match="tensor_size_list"):
        PipelineStoreConfig.from_dict({**base_config(tmp_path), "tensor_size_list": [1, 2]})
    assert isinstance(ConfigError("x"), InvalidParamError)


def test_yaml_config(tmp_path: Path) -> None:
    root = tmp_path / "kv"
    root.mkdir()
    path = tmp_path / "store.yaml"
    path.write_text(
        f"store_pipeline: Posix\nstorage_backends: {root}\nblock_size: {SHARD * SHARDS}\n"
        f"shard_size: {SHARD}\ntensor_size: {SHARD // 2}\nposix_capacity_gb: 0.5\n"
    )
    cfg = PipelineStoreConfig.from_yaml(path)
    ((name, posix),) = cfg.stages
    assert name == "Posix" and posix.tensor_size_list == [SHARD // 2] * 2
    assert posix.storage_backends == [str(root)]
    bad = tmp_path / "bad.yaml"
    bad.write_text("store_pipeline: Posix\nblock_size: [1\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        PipelineStoreConfig.from_yaml(bad)
    bad.write_text(f"storage_backends: {root}\nblock_size: 1\nshard_sise: 1\n")
    with pytest.raises(ConfigError, match=rf"shard_sise.*\({bad}\)"):
        PipelineStoreConfig.from_yaml(bad)


def test_minimal_config_uses_defaults(tmp_path: Path) -> None:
    store = UcmConnectorFactory.create_connector(
        "UcmPipelineStore", {"storage_backends": str(tmp_path), "block_size": SHARD}
    )
    assert store.stage_name == "Posix"
    assert store.stats()["io_engine"] in ("uring", "psync")
    store.wait(store.dump([b"k" * 16], [0], [[torch.ones(SHARD, dtype=torch.uint8)]]))
    assert store.lookup([b"k" * 16]) == [True]
    store.close()


def test_native_transfer_takes_exactly_one_form_of_memory(tmp_path: Path) -> None:
    # The binding's one transfer entry point, below the pipeline API.
    from ucm import _native

    values = {"storage_backends": str(tmp_path), "block_size": SHARD, "shard_size": SHARD}
    store = _native.NativeStore.open_pipeline([("Posix", {**values, "tensor_size_list": [SHARD]})])
    ids, idx = [bytes(16)], [0]
    dst = torch.zeros(SHARD, dtype=torch.uint8)
    segments = ([dst.data_ptr()], [SHARD], [0, 1])
    addrs = np.array([[dst.data_ptr()]], dtype=np.uint64)
    one_form = "give either segments, or addrs with sizes"
    try:
        for kwargs in (
            {},
            {"segments": segments, "addrs": addrs, "sizes": [SHARD]},
            {"addrs": addrs},
            {"segments": segments, "bounds": [(dst.data_ptr(), SHARD)]},
        ):
            with pytest.raises(InvalidParamError, match=one_form):
                store.transfer("load", ids, idx, owner=dst, **kwargs)
        with pytest.raises(InvalidParamError, match='direction must be "load" or "dump"'):
            store.transfer("sideways", ids, idx, segments=segments, owner=dst)
        with pytest.raises(InvalidParamError, match="a load has no prerequisite_handle"):
            store.transfer("load", ids, idx, segments=segments, prerequisite_handle=7, owner=dst)
    finally:
        store.close()


class ClosingRecorder:
    """A store written in Python that only counts how often it was closed."""

    def __init__(self) -> None:
        self.closed = 0

    def close(self) -> None:
        self.closed += 1


def test_a_pipeline_owns_the_store_it_is_given_and_closes_it_when_it_fails(
    tmp_path: Path,
) -> None:
    from ucm import _native

    cache = {"block_size": SHARD, "tensor_size_list": [SHARD], "buffer_number": 16}
    posix = {"storage_backends": str(tmp_path), "block_size": SHARD}
    given = ClosingRecorder()
    store = _native.NativeStore.open_pipeline([("Cache", cache)], given)
    assert given.closed == 0
    store.close()
    assert given.closed == 1
    for stages, clients, reason in (
        ([("Cache", {**cache, "fill_policy": "sometimes"})], {}, "fill_policy"),
        ([("Posix", posix)], {}, r"stage 1 \('Posix'\) .* only 'Cache' can"),
        ([("Cache", cache)], {"ftp": object()}, 'no stage is opened with a client "ftp"'),
    ):
        given = ClosingRecorder()
        with pytest.raises(InvalidParamError, match=reason):
            _native.NativeStore.open_pipeline(stages, given, clients)
        assert given.closed == 1, reason


def test_the_stages_of_a_pipeline_agree_on_the_geometry(tmp_path: Path) -> None:
    from ucm import _native

    cache = {"block_size": SHARD, "buffer_number": 16}
    posix = {"storage_backends": str(tmp_path), "block_size": 2 * SHARD}
    with pytest.raises(InvalidParamError, match=r"stage Posix: .* differ from stage Cache's"):
        _native.NativeStore.open_pipeline([("Cache", cache), ("Posix", posix)])
