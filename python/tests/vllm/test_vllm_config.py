"""Connector config: sources, priority (env > inline > YAML > defaults), validation."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from ucm.integration.vllm.config import (
    default_storage_dir,
    resolve_config,
)
from ucm.integration.vllm.store_handle import build_store_config
from ucm.shared.config import ConfigError

ROOT = Path(__file__).resolve().parents[3]

SEED_YAML = """
ucm_connectors:
  - ucm_connector_name: "UcmPipelineStore"
    ucm_connector_config:
      store_pipeline: "Cache|Posix"
      storage_backends: "/data/ucm_cache"
      cache_buffer_capacity_gb: 2
ucm_sparse_config:
  ESA:
    sparse_ratio: 0.3
    local_window_sz: 2
    retrieval_stride: 5
metrics_config_path: "{metrics}"
load_only_first_rank: false
use_layerwise: true
"""


@pytest.fixture
def seed_yaml(tmp_path: Path) -> Path:
    metrics = tmp_path / "metrics.yaml"
    metrics.write_text("enabled: true\nduration_buckets_ms: [1, 10, 100]\n")
    p = tmp_path / "ucm.yaml"
    p.write_text(SEED_YAML.format(metrics=metrics))
    return p


def test_defaults() -> None:
    r = resolve_config({}, env={})
    assert r.connector.use_layerwise is False
    assert r.connector.hash_algo == "blake3"
    assert r.store.name == "UcmPipelineStore"
    assert r.store.config["storage_backends"] == default_storage_dir()
    assert r.store.config["store_pipeline"] in ("Cache|Posix", "Posix")
    assert r.store.source_of("storage_backends") == "default"


def test_seed_yaml_shape_is_accepted(seed_yaml: Path) -> None:
    r = resolve_config({"UCM_CONFIG_FILE": str(seed_yaml)}, env={})
    assert r.connector.use_layerwise is True
    assert r.connector.ucm_sparse_config == {
        "ESA": {"sparse_ratio": 0.3, "local_window_sz": 2, "retrieval_stride": 5}
    }
    assert r.store.config["store_pipeline"] == "Cache|Posix"
    assert r.store.config["storage_backends"] == "/data/ucm_cache"
    assert r.metrics["duration_buckets_ms"] == [1, 10, 100]
    assert r.sources["use_layerwise"] == f"YAML {seed_yaml}"


def test_priority_env_over_inline_over_yaml_over_defaults(seed_yaml: Path) -> None:
    inline = {
        "UCM_CONFIG_FILE": str(seed_yaml),
        "use_layerwise": False,  # overrides YAML
        "hash_salt": "inline",
        "storage_backends": "/inline/dir",  # store shorthand, overrides YAML's store key
    }
    env = {"UCM_HASH_SALT": "from-env", "UCM_IO_DIRECT": "1", "UCM_UNRELATED_THING": "x"}
    r = resolve_config(inline, env=env)
    assert r.connector.use_layerwise is False
    assert r.sources["use_layerwise"] == "kv_connector_extra_config"
    assert r.connector.hash_salt == "from-env"
    assert r.sources["hash_salt"] == "environment UCM_HASH_SALT"
    assert r.store.config["storage_backends"] == "/inline/dir"
    assert r.store.config["store_pipeline"] == "Cache|Posix"  # from YAML
    assert r.store.source_of("store_pipeline") == f"YAML {seed_yaml}"
    assert r.store.config["io_direct"] == "1"
    assert r.store.source_of("io_direct") == "environment UCM_IO_DIRECT"
    assert r.connector.layerwise_lookahead == 0  # default: every layer in flight


def test_config_file_from_environment(seed_yaml: Path, tmp_path: Path) -> None:
    other = tmp_path / "other.yaml"
    other.write_text("use_layerwise: false\n")
    r = resolve_config({"UCM_CONFIG_FILE": str(other)}, env={"UCM_CONFIG_FILE": str(seed_yaml)})
    assert r.config_file == str(seed_yaml)
    assert r.connector.use_layerwise is True


def test_errors_name_key_and_source(seed_yaml: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"use_layerwise \(environment UCM_USE_LAYERWISE\)"):
        resolve_config({}, env={"UCM_USE_LAYERWISE": "maybe"})
    with pytest.raises(ConfigError, match=r"unknown config key 'use_layerwize' \(kv_connector"):
        resolve_config({"use_layerwize": True}, env={})
    bad = tmp_path / "bad.yaml"
    bad.write_text("hash_algo: sha1\n")
    with pytest.raises(ConfigError, match="hash_algo"):
        resolve_config({"UCM_CONFIG_FILE": str(bad)}, env={})
    with pytest.raises(ConfigError, match=r"layerwise_lookahead \(kv_connector_extra_config\)"):
        resolve_config({"layerwise_lookahead": "two"}, env={})
    with pytest.raises(ConfigError, match=r"block_size .*set by the connector"):
        resolve_config({"block_size": 4096}, env={})
    with pytest.raises(ConfigError, match="exactly one store"):
        resolve_config({"ucm_connectors": []}, env={})
    with pytest.raises(ConfigError, match="cannot read config file"):
        resolve_config({"UCM_CONFIG_FILE": str(tmp_path / "missing.yaml")}, env={})


def test_store_key_errors_name_their_source(tmp_path: Path) -> None:
    r = resolve_config({"store_pipeline": "Posix"}, env={"UCM_IO_ENGINE": "warp"})
    keys = {"block_size": 8192, "shard_size": 4096, "tensor_size_list": [4096]}
    with pytest.raises(ConfigError, match=r"io_engine.*environment UCM_IO_ENGINE"):
        build_store_config(r.store, keys, device_id=0)
    y = tmp_path / "s.yaml"
    y.write_text(
        yaml.safe_dump(
            {
                "ucm_connectors": [
                    {
                        "ucm_connector_name": "UcmPipelineStore",
                        "ucm_connector_config": {"store_pipeline": "Posix", "io_threads": 0},
                    }
                ]
            }
        )
    )
    r = resolve_config({"UCM_CONFIG_FILE": str(y)}, env={})
    with pytest.raises(ConfigError, match=f"io_threads.*YAML {y}"):
        build_store_config(r.store, keys, device_id=0)


def test_a_shared_cache_gets_a_stable_segment_name_per_store_and_layout(tmp_path: Path) -> None:
    keys = {"block_size": 8192, "shard_size": 4096, "tensor_size_list": [4096]}

    def unique_id(extra: dict[str, Any], layout: dict[str, Any] = keys) -> str | None:
        r = resolve_config(
            {"store_pipeline": "Cache|Posix", "storage_backends": str(tmp_path), **extra}, env={}
        )
        return build_store_config(r.store, layout, device_id=0).get("unique_id")

    shared = {"share_buffer_enable": True, "share_buffer_keep": True}
    first = unique_id(shared)
    assert first and first == unique_id(shared), "not stable across restarts"
    assert first != unique_id(shared, {**keys, "block_size": 16384}), "layouts share a name"
    r = resolve_config(
        {"store_pipeline": "Cache|Posix", "storage_backends": str(tmp_path / "b"), **shared},
        env={},
    )
    assert build_store_config(r.store, keys, device_id=0)["unique_id"] != first
    assert unique_id({**shared, "unique_id": "mine"}) == "mine"
    assert not unique_id({}), "a private cache got a segment name"


def test_default_keys_dropped_for_other_pipelines() -> None:
    r = resolve_config({"store_pipeline": "Empty"}, env={})
    cfg = build_store_config(r.store, {"block_size": 8192, "shard_size": 4096}, device_id=0)
    assert "storage_backends" not in cfg
    assert cfg["store_pipeline"] == "Empty"


def test_example_configs_load() -> None:
    files = sorted((ROOT / "configs").glob("ucm-vllm*.yaml"))
    assert files, "configs/ucm-vllm*.yaml examples are missing"
    for f in files:
        r = resolve_config({"UCM_CONFIG_FILE": str(f)}, env={})
        build_store_config(
            r.store,
            {"block_size": 8192, "shard_size": 4096, "tensor_size_list": [4096]},
            device_id=0,
        )
