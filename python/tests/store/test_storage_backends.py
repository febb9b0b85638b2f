"""``storage_backends`` of a Posix store: absolute directories, one per
string, several as a list; a relative one is refused with its absolute form."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

import ucm.store
from ucm.cli import main
from ucm.shared.config import ConfigError
from ucm.store.config import PipelineStoreConfig

GEOMETRY = {"block_size": 4096, "shard_size": 4096}


def posix_dirs(value: object) -> list[str]:
    cfg = PipelineStoreConfig.from_dict(
        {"store_pipeline": "Posix", "storage_backends": value, **GEOMETRY}
    )
    ((_, stage),) = cfg.stages
    return list(stage.storage_backends)


def test_one_string_is_one_directory_colons_and_all() -> None:
    assert posix_dirs("/data/kv:/more") == ["/data/kv:/more"]


def test_several_directories_are_a_list() -> None:
    assert posix_dirs(["/data/a", "/data/b"]) == ["/data/a", "/data/b"]


@pytest.mark.parametrize("value", ["kv", "./kv", "~/kv", ["/data/a", "kv"]])
def test_a_relative_directory_is_refused_with_its_absolute_form(value: object) -> None:
    with pytest.raises(ConfigError, match="relative path") as e:
        posix_dirs(value)
    assert "storage_backends" in str(e.value) and "give an absolute one" in str(e.value)


def test_the_absolute_form_suggested_is_the_working_directorys(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as e:
        posix_dirs("kv")
    assert json.dumps(str(tmp_path / "kv")) in str(e.value)


def test_a_directory_with_a_colon_holds_the_blocks(tmp_path: Path) -> None:
    where = tmp_path / "a:b"
    where.mkdir()
    store = ucm.store.open({"store_pipeline": "Posix", "storage_backends": str(where), **GEOMETRY})
    store.close()
    assert not (tmp_path / "a").exists() and not Path("b").exists()
    assert any(where.iterdir())


def test_config_check_refuses_what_it_used_to_split(tmp_path: Path) -> None:
    cfg = tmp_path / "ucm.yaml"
    cfg.write_text('storage_backends: "/data/kv:relative/kv"\n')
    res = CliRunner().invoke(main, ["config", "check", str(cfg)])
    assert res.exit_code == 0, res.output
    assert "'/data/kv:relative/kv'" in res.output
    cfg.write_text('storage_backends: "relative/kv"\n')
    res = CliRunner().invoke(main, ["config", "check", str(cfg)])
    assert res.exit_code == 1
    assert "'relative/kv'" in res.output or '"relative/kv"' in res.output
    assert "relative path" in res.output


def test_ucm_serve_storage_is_taken_from_where_it_was_typed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ucm.cli.serve_cmd import build_vllm_args

    monkeypatch.chdir(tmp_path)
    argv, _ = build_vllm_args("m", (), config_file=None, storage="kv", layerwise=False, cpu=True)
    extra = json.loads(argv[argv.index("--kv-transfer-config") + 1])["kv_connector_extra_config"]
    assert extra["storage_backends"] == str(tmp_path / "kv")
