"""Config input can't hurt the host: every key of every built-in store
stage, and every connector key, fed values of the wrong type, huge,
negative, NaN and infinite, either gets a ConfigError that names the key or
is a value inside the key's declared range. Nothing else escapes."""

from __future__ import annotations

import math
import random
from pathlib import Path
from typing import Any

import pytest

from ucm.shared.config import ConfigError, load_yaml
from ucm.store import PipelineStoreConfig, UcmConnectorFactory
from ucm.store.config import iter_keys, stage_schemas

HOSTILE: list[Any] = [
    {},
    {"a": 1},
    object(),
    [],
    [1.5],
    [-1],
    2**64 + 5,
    2**63,
    -(2**70),
    10**400,
    -1,
    float("nan"),
    float("inf"),
    1e300,
    "1e3",
    "nan",
    "-5",
    "",
    "x" * 300,
    b"bytes",
    True,
    0,
]


def base(stage: str, tmp_path: Path) -> dict[str, Any]:
    cfg: dict[str, Any] = {"store_pipeline": stage, "block_size": 8192}
    if stage in ("Posix", "Cache"):
        cfg["storage_backends"] = str(tmp_path)
    if stage == "Cache":
        cfg["store_pipeline"] = "Cache|Posix"
        cfg["cache_buffer_capacity_gb"] = 0.01
    if stage == "S3":
        cfg["storage_backends"] = "s3://bucket/prefix"
    if stage == "NFS":
        cfg["storage_backends"] = "nfs://server/export"
    if stage == "Mooncake":
        cfg["mooncake_master"] = "10.0.0.5:50051"
    if stage == "Empty":
        del cfg["block_size"]
    return cfg


def accepted_value_is_sane(spec: Any, value: Any) -> bool:
    if spec.type in ("int", "float"):
        return (
            isinstance(value, int | float)
            and not isinstance(value, bool)
            and math.isfinite(value)
            and spec.min <= value <= spec.max
        )
    if spec.type == "choice":
        return value in spec.choices
    if spec.type == "bool":
        return isinstance(value, bool)
    return True


@pytest.mark.parametrize("stage", sorted({s.name for s in stage_schemas().values()}))
def test_every_store_key_names_itself_or_stays_in_range(stage: str, tmp_path: Path) -> None:
    keys = [k for s, k in iter_keys() if s.name == stage]
    assert keys
    rng = random.Random(stage)
    for spec in keys:
        values = [*HOSTILE, *(rng.choice(HOSTILE) for _ in range(5))]
        for value in values:
            cfg = {**base(stage, tmp_path), spec.name: value}
            try:
                pipeline = PipelineStoreConfig.from_dict(cfg)
            except ConfigError as e:
                assert spec.name in str(e), f"{spec.name}={value!r}: {e}"
                continue
            except Exception as e:  # a builtin exception is the bug
                pytest.fail(f"{stage}.{spec.name}={value!r} raised {type(e).__name__}: {e}")
            stage_cfg = dict(pipeline.stages)[stage if stage != "Cache" else "Cache"]
            got = stage_cfg.values[spec.name]
            assert got is None or accepted_value_is_sane(spec, got), (
                f"{stage}.{spec.name}={value!r} accepted as {got!r}"
            )


def test_accepted_values_open_without_harm(tmp_path: Path) -> None:
    # The values the issue reported as accepted-and-then-hurting are refused
    # up front, naming the key and the value.
    for key, value in (
        ("io_threads", 2**63),
        ("posix_capacity_gb", 2**64 + 5),
        ("posix_capacity_gb", float("nan")),
        ("posix_capacity_gb", 1e300),
        ("device_id", 2**64),
        ("posix_spare_files", 10**9),
    ):
        with pytest.raises(ConfigError, match=rf"{key} \(config\)"):
            UcmConnectorFactory.create_connector(
                "UcmPipelineStore", {**base("Posix", tmp_path), key: value}
            )
    for key, value in (
        ("write_back_batch_size", 2**63),
        ("write_back_interval", -1),
        ("write_back_max_backoff", float("inf")),
        ("cache_backend_threads", 10**6),
        ("cache_buffer_capacity_gb", "1e3"),  # more than this machine's memory
        ("buffer_number", 2**40),
    ):
        with pytest.raises(ConfigError, match=rf"{key}"):
            UcmConnectorFactory.create_connector(
                "UcmPipelineStore", {**base("Cache", tmp_path), key: value}
            )


def test_cache_larger_than_shared_memory_is_refused(tmp_path: Path) -> None:
    cfg = {
        **base("Cache", tmp_path),
        "share_buffer_enable": True,
        "unique_id": "fuzz",
        "cache_buffer_capacity_gb": 1024,
    }
    with pytest.raises(ConfigError, match=r"cache_buffer_capacity_gb.*(/dev/shm|memory)"):
        PipelineStoreConfig.from_dict(cfg)


def test_unknown_keys_suggest_the_closest(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"'io_thread'.*did you mean 'io_threads'"):
        PipelineStoreConfig.from_dict({**base("Posix", tmp_path), "io_thread": 2})
    with pytest.raises(ConfigError, match=r"io_engine.*did you mean `psync`"):
        PipelineStoreConfig.from_dict({**base("Posix", tmp_path), "io_engine": "psyn"})


def test_every_connector_key_names_itself() -> None:
    vllm_config = pytest.importorskip("ucm.integration.vllm.config")
    for key in vllm_config.TOP_LEVEL_KEYS:
        for value in HOSTILE:
            try:
                vllm_config.resolve_config({key: value}, env={})
            except ConfigError as e:
                assert key in str(e), f"{key}={value!r}: {e}"
            except Exception as e:
                pytest.fail(f"{key}={value!r} raised {type(e).__name__}: {e}")


def test_duplicate_yaml_keys_are_an_error(tmp_path: Path) -> None:
    path = tmp_path / "dup.yaml"
    path.write_text("block_size: 4096\nio_threads: 2\nblock_size: 8192\n")
    with pytest.raises(
        ConfigError, match=rf"{path}.*'block_size'.*more than once \(lines 1 and 3\)"
    ):
        load_yaml(path)
    nested = tmp_path / "nested.yaml"
    nested.write_text("ucm_connectors:\n  - a: 1\n    a: 2\n")
    with pytest.raises(ConfigError, match=r"'a'.*more than once"):
        load_yaml(nested)
