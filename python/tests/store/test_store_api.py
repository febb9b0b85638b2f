"""The store API's entry points: ``ucm.store.open``, its original-UCM alias
``UcmConnectorFactory.create_connector``, and the one home of the errors."""

from __future__ import annotations

import functools
import importlib
import importlib.util
from pathlib import Path

import numpy as np
import pytest
from support.store_helpers import SHARD, SHARDS, base_config

import ucm.errors
import ucm.store
from ucm.shared.config import ConfigError
from ucm.store import UcmConnectorFactory
from ucm.store.pipeline import UcmPipelineStore


def test_errors_have_one_home() -> None:
    assert importlib.util.find_spec("ucm.store.errors") is None
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("ucm.store.errors")
    for name in ucm.errors.__all__:
        assert getattr(ucm.errors, name).__module__ == "ucm.errors"
    # The store API re-exports the same classes, not copies.
    reexported = [n for n in ucm.store.__all__ if n in ucm.errors.__all__]
    assert "UcmStoreError" in reexported and "InvalidParamError" in reexported
    for name in reexported:
        assert getattr(ucm.store, name) is getattr(ucm.errors, name)


def test_the_core_raises_the_classes_of_ucm_errors(tmp_path: Path) -> None:
    store = ucm.store.open(base_config(tmp_path))
    try:
        with pytest.raises(ucm.errors.InvalidParamError) as bad_id:
            store.lookup([b"short"])
        assert bad_id.value.code == -50000 and isinstance(bad_id.value, ValueError)
        assert type(bad_id.value).__module__ == "ucm.errors"
        out = [[np.zeros(SHARD // 2, dtype=np.uint8)] * 2]
        with pytest.raises(ucm.errors.UcmStoreError) as missing:
            store.wait(store.load([b"m" * 16], [0], out))
        assert type(missing.value).__module__ == "ucm.errors"
    finally:
        store.close()
    assert ucm.errors.error_from_code(-50009, "full").__class__ is ucm.errors.NoSpaceError


def test_open_builds_the_pipeline_store(tmp_path: Path) -> None:
    store = ucm.store.open(base_config(tmp_path))
    try:
        assert isinstance(store, UcmPipelineStore)
        data = [[np.full(SHARD // 2, 7, dtype=np.uint8)] * 2 for _ in range(SHARDS)]
        store.wait(store.dump([b"o" * 16] * SHARDS, list(range(SHARDS)), data))
        assert store.lookup([b"o" * 16]) == [True]
    finally:
        store.close()


def test_create_connector_is_an_alias_of_open(tmp_path: Path) -> None:
    cfg = base_config(tmp_path)
    alias = UcmConnectorFactory.create_connector("UcmPipelineStore", cfg)
    try:
        assert type(alias) is UcmPipelineStore
        assert alias.lookup([b"o" * 16]) == [False]
    finally:
        alias.close()
    assert "original UCM API" in (UcmConnectorFactory.create_connector.__doc__ or "")
    assert "ucm.store.open" in (UcmConnectorFactory.create_connector.__doc__ or "")
    # Both refuse the same bad configs the same way.
    by_name = functools.partial(UcmConnectorFactory.create_connector, "UcmPipelineStore")
    for make in (ucm.store.open, by_name):
        with pytest.raises(ConfigError, match="must be a mapping"):
            make(["not", "a", "mapping"])
        with pytest.raises(ConfigError, match="storage_backendz"):
            make({**cfg, "storage_backendz": str(tmp_path)})
