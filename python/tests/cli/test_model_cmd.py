"""``ucm model`` and :mod:`ucm.models` without the model: where it lives, what
counts as a complete conversion, and the skip path when it cannot be had.
Nothing here downloads (``UCM_SKIP_MODEL=1``, an empty directory)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import save_file

from ucm import models
from ucm.cli import main


@pytest.fixture
def empty_model_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    target = tmp_path / "model"
    monkeypatch.setenv(models.DIR_ENV, str(target))
    monkeypatch.setenv(models.SKIP_ENV, "1")
    return target


def test_model_dir_follows_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(models.DIR_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert models.model_dir() == tmp_path / "xdg" / "ucm" / "models" / models.NAME
    monkeypatch.setenv(models.DIR_ENV, str(tmp_path / "here"))
    assert models.model_dir() == tmp_path / "here"


def test_absent_model_fails_with_the_reason(empty_model_dir: Path) -> None:
    runner = CliRunner()
    res = runner.invoke(main, ["model", "path"])
    assert res.exit_code == 1
    assert str(empty_model_dir) in res.output
    res = runner.invoke(main, ["model", "verify"])
    assert res.exit_code == 1
    assert "ucm model fetch" in res.output
    res = runner.invoke(main, ["model", "fetch"])
    assert res.exit_code == 2
    assert "UCM_SKIP_MODEL=1" in res.output
    with pytest.raises(models.ModelUnavailable, match="no converted model"):
        models.ensure()


def _fake_conversion(target: Path, digest: str) -> None:
    target.mkdir(parents=True)
    save_file({"w": torch.zeros(4)}, str(target / "model.safetensors"))
    for f in ("config.json", "tokenizer.json"):
        (target / f).write_text("{}")
    manifest = {
        "weights_sha256": digest,
        "weights_bytes": (target / "model.safetensors").stat().st_size,
    }
    (target / models.MANIFEST).write_text(json.dumps(manifest))


def test_only_a_complete_pinned_conversion_counts(empty_model_dir: Path) -> None:
    _fake_conversion(empty_model_dir, "0" * 64)
    assert models.available() is None  # another digest: converted by something else
    (empty_model_dir / models.MANIFEST).unlink()
    manifest = {
        "weights_sha256": models.WEIGHTS_SHA256,
        "weights_bytes": (empty_model_dir / "model.safetensors").stat().st_size,
    }
    (empty_model_dir / models.MANIFEST).write_text(json.dumps(manifest))
    assert models.available() == empty_model_dir
    (empty_model_dir / "tokenizer.json").unlink()
    assert models.available() is None  # incomplete
    (empty_model_dir / "tokenizer.json").write_text("{}")
    with open(empty_model_dir / "model.safetensors", "ab") as f:
        f.write(b"x")
    assert models.available() is None  # truncated or appended to
    # The manifest only says it is complete; verify re-hashes the weights.
    with open(empty_model_dir / "model.safetensors", "r+b") as f:
        f.truncate(manifest["weights_bytes"])
    res = CliRunner().invoke(main, ["model", "verify"])
    assert res.exit_code == 1
    assert "pinned" in res.output


def test_weights_digest_ignores_file_layout(tmp_path: Path) -> None:
    a = {"b": torch.arange(6.0).reshape(2, 3), "a": torch.ones(3, dtype=torch.float16)}
    save_file(a, str(tmp_path / "one.safetensors"))
    save_file(dict(reversed(a.items())), str(tmp_path / "two.safetensors"), metadata={"x": "y"})
    d1 = models.weights_digest(tmp_path / "one.safetensors")
    assert d1 == models.weights_digest(tmp_path / "two.safetensors")
    a["b"][1, 2] = 0.5
    save_file(a, str(tmp_path / "three.safetensors"))
    assert models.weights_digest(tmp_path / "three.safetensors") != d1
