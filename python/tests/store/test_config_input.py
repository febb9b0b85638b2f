"""Config input a user names can't exhaust the host, and every bad value is
a clear error naming the key.

Each hostile config file (``/dev/zero``, a FIFO, a 100 MiB file, a
directory, a symlink to ``/dev/zero``) is read in a child process with a
time limit and a memory ceiling, so a reader that blocks or reads without
bound fails the test instead of hanging it or the machine; every entry point
that reads a file a user names is tried with a FIFO the same way.
"""

from __future__ import annotations

import ast
import json
import os
import resource
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ucm.errors import InvalidParamError
from ucm.integration.vllm.config import resolve_config
from ucm.shared.config import MAX_CONFIG_BYTES, ConfigError, build_dataclass, load_yaml
from ucm.store import Regions, UcmConnectorFactory
from ucm.store.config import PipelineStoreConfig, check_stage
from ucm.store.pipeline import UcmPipelineStore

PACKAGE = Path(__file__).resolve().parents[2] / "ucm"
#: Address space of a child: far more than reading a config needs, far less
#: than the machine has, so reading without bound ends in MemoryError.
CHILD_MEMORY = 2 << 30
#: Seconds a child may take; reading a config takes milliseconds.
CHILD_TIMEOUT = 60


def posix(root: Path, **overrides: Any) -> dict[str, Any]:
    """A small Posix store config: one 4 KiB shard of one tensor per block."""
    return {
        "store_pipeline": "Posix",
        "storage_backends": str(root),
        "block_size": 4096,
        "tensor_size_list": [4096],
        **overrides,
    }


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (CHILD_MEMORY, CHILD_MEMORY))


def run_child(
    argv: list[str], env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``argv`` under the time and memory limits; a hang fails the test."""
    try:
        return subprocess.run(
            argv,
            capture_output=True,
            text=True,
            timeout=CHILD_TIMEOUT,
            preexec_fn=_limit_memory,
            env={**os.environ, **(env or {})},
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"{argv} did not return within {CHILD_TIMEOUT}s")


def read_in_child(code: str, **env: str) -> dict[str, Any]:
    """Runs ``code`` (which sets ``result``) in a limited child; returns
    ``{"error": type, "message": ..., "grew_kib": ...}`` or ``{"ok": result}``."""
    script = textwrap.dedent(
        """
        import json, resource
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        try:
        {code}
            out = {{"ok": repr(result)}}
        except BaseException as e:
            out = {{"error": type(e).__name__, "message": str(e),
                    "config_error": type(e).__name__ == "ConfigError"}}
        out["grew_kib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
        print(json.dumps(out))
        """
    ).format(code=textwrap.indent(textwrap.dedent(code), "    "))
    res = run_child([sys.executable, "-c", script], env)
    assert res.returncode == 0 and res.stdout.strip(), res.stderr[-4000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.fixture
def fifo(tmp_path: Path) -> Path:
    path = tmp_path / "config.fifo"
    os.mkfifo(path)
    return path


def hostile_files(tmp_path: Path) -> dict[str, Path]:
    big = tmp_path / "big.yaml"
    with open(big, "wb") as f:  # sparse: 100 MiB that take no disk
        f.truncate(100 << 20)
    link = tmp_path / "zero-link.yaml"
    link.symlink_to("/dev/zero")
    fifo = tmp_path / "named.fifo"
    os.mkfifo(fifo)
    (tmp_path / "a-directory").mkdir()
    return {
        "dev-zero": Path("/dev/zero"),
        "fifo": fifo,
        "100-MiB": big,
        "directory": tmp_path / "a-directory",
        "symlink-to-dev-zero": link,
    }


@pytest.mark.parametrize(
    ("kind", "expected"),
    [
        ("dev-zero", "a character device"),
        ("fifo", "a FIFO"),
        ("100-MiB", "1 MiB"),
        ("directory", "a directory"),
        ("symlink-to-dev-zero", "a character device"),
    ],
)
def test_a_hostile_config_file_is_refused_at_once_naming_the_path(
    tmp_path: Path, kind: str, expected: str
) -> None:
    path = hostile_files(tmp_path)[kind]
    out = read_in_child(
        f"""
        from ucm.shared.config import load_yaml
        result = load_yaml({str(path)!r})
        """
    )
    assert out.get("config_error"), out
    assert str(path) in out["message"] and expected in out["message"], out
    if kind != "100-MiB":
        assert "regular file" in out["message"], out
    else:
        assert str(MAX_CONFIG_BYTES) in out["message"], out
    if kind == "symlink-to-dev-zero":
        assert "/dev/zero" in out["message"], out
    # Nothing was read into memory: the child grew by far less than the file.
    assert out["grew_kib"] < 16 << 10, out


def test_a_file_just_under_the_limit_is_read_and_one_byte_more_is_not(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    head = b"use_layerwise: true\n#"
    path.write_bytes(head + b"x" * (MAX_CONFIG_BYTES - len(head) - 1) + b"\n")
    assert load_yaml(path) == {"use_layerwise": True}
    with open(path, "ab") as f:
        f.write(b"y")
    with pytest.raises(ConfigError, match=rf"{path}.*{MAX_CONFIG_BYTES} bytes \(1 MiB\)"):
        load_yaml(path)


def test_values_that_expand_or_nest_without_bound_are_refused(tmp_path: Path) -> None:
    # "Billion laughs": 9 levels of 10 aliases each, a few hundred bytes of
    # YAML that expand to a billion list items for whatever walks them.
    lines = ["a0: &a0 [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]"]
    for i in range(1, 10):
        refs = ", ".join([f"*a{i - 1}"] * 10)
        lines.append(f"a{i}: &a{i} [{refs}]")
    laughs = tmp_path / "laughs.yaml"
    laughs.write_text("\n".join(lines) + "\n")
    out = read_in_child(
        f"from ucm.shared.config import load_yaml\nresult = load_yaml({str(laughs)!r})"
    )
    assert out.get("config_error") and "expands to more than" in out["message"], out
    assert str(laughs) in out["message"]
    # Brackets nested far past the parser's recursion, and just past the limit.
    for depth in (100_000, 65):
        deep = tmp_path / f"deep{depth}.yaml"
        deep.write_text("k: " + "[" * depth + "]" * depth + "\n")
        with pytest.raises(ConfigError, match=rf"{deep} nests values deeper than 64 levels"):
            load_yaml(deep)
    ok = tmp_path / "ok.yaml"
    ok.write_text("k: " + "[" * 60 + "]" * 60 + "\n")
    assert load_yaml(ok)


def test_a_list_as_a_key_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "key.yaml"
    path.write_text("? [a, b]\n: 1\n")
    with pytest.raises(ConfigError, match=rf"(?s){path} is not valid YAML: .*unhashable key"):
        load_yaml(path)


def test_a_config_file_that_is_not_utf8_names_the_byte(tmp_path: Path) -> None:
    path = tmp_path / "latin1.yaml"
    path.write_bytes(b"hash_salt: caf\xe9\n")
    with pytest.raises(ConfigError, match=rf"{path} is not UTF-8 text \(byte 14"):
        load_yaml(path)


# Every entry point that reads a file a user names, given a FIFO: each goes
# through the one reader, so each returns at once with its message.
ENTRY_POINTS: dict[str, tuple[str, ...]] = {
    "UCM_CONFIG_FILE": (
        "-c",
        "from ucm.integration.vllm.config import resolve_config\nresolve_config({})",
    ),
    "ucm config check FILE": ("-m", "ucm", "config", "check", "{path}"),
    "PipelineStoreConfig.from_yaml": (
        "-c",
        "import sys\nfrom ucm.store.config import PipelineStoreConfig\n"
        "PipelineStoreConfig.from_yaml(sys.argv[1])",
        "{path}",
    ),
    "ucm store --config": ("-m", "ucm", "store", "info", "--config", "{path}"),
    "ucm serve --ucm-config": ("-m", "ucm", "serve", "m", "--ucm-config", "{path}"),
}


@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
def test_every_config_file_reader_refuses_a_fifo_at_once(fifo: Path, entry: str) -> None:
    argv = [sys.executable, *(a.replace("{path}", str(fifo)) for a in ENTRY_POINTS[entry])]
    env = {"UCM_CONFIG_FILE": str(fifo)} if entry == "UCM_CONFIG_FILE" else {}
    res = run_child(argv, env)
    assert res.returncode != 0
    assert str(fifo) in res.stderr and "is a FIFO" in res.stderr, res.stderr[-4000:]


def test_the_metrics_config_file_goes_through_the_same_reader(tmp_path: Path) -> None:
    metrics = tmp_path / "metrics.yaml"
    metrics.write_text("enabled: true\n#" + "x" * MAX_CONFIG_BYTES + "\n")
    cfg = tmp_path / "ucm.yaml"
    cfg.write_text(f"metrics_config_path: {metrics}\n")
    with pytest.raises(ConfigError, match=rf"metrics config file {metrics} is larger than"):
        resolve_config({}, env={"UCM_CONFIG_FILE": str(cfg)})


def test_only_the_shared_reader_parses_yaml_or_reads_config_files() -> None:
    """A guard: no other module of the package calls a YAML loader (each
    would need the reader's limits again)."""
    loaders = {"load", "safe_load", "full_load", "unsafe_load", "load_all", "safe_load_all"}
    found = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in loaders
                and isinstance(node.func.value, ast.Name)
                and node.func.value.id == "yaml"
            ):
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert found and all(f.startswith("shared/config.py:") for f in found), found


# -- bad values: each a clear error naming the key ---------------------------


def test_ucm_config_check_refuses_an_unknown_store_name(tmp_path: Path) -> None:
    cfg = tmp_path / "ucm.yaml"
    cfg.write_text(
        "ucm_connectors:\n"
        "  - ucm_connector_name: UcmPipelineStor\n"
        "    ucm_connector_config: {storage_backends: /tmp/x}\n"
    )
    res = run_child([sys.executable, "-m", "ucm", "config", "check", str(cfg)])
    assert res.returncode == 1, res.stdout
    assert "ok" not in res.stdout.split()
    msg = res.stderr
    assert "ucm_connector_name" in msg and f"YAML {cfg}" in msg, msg
    assert "'UcmPipelineStor'" in msg and "did you mean 'UcmPipelineStore'?" in msg, msg
    # A store of one's own, named with its module, is still accepted.
    spec = resolve_config(
        {
            "ucm_connectors": [
                {
                    "ucm_connector_name": "MyStore",
                    "ucm_connector_module_path": "my_pkg.stores",
                    "ucm_connector_config": {},
                }
            ]
        },
        env={},
    ).store
    assert (spec.name, spec.module_path) == ("MyStore", "my_pkg.stores")


def test_tensor_size_beside_tensor_size_list_is_refused(tmp_path: Path) -> None:
    both = posix(tmp_path, tensor_size=1024)
    for stage in ("Posix", "Cache|Posix"):
        with pytest.raises(ConfigError, match=r"tensor_size .*tensor_size_list, not both"):
            PipelineStoreConfig.from_dict({**both, "store_pipeline": stage})
    # Either alone is fine, and a store opens with it.
    for key in ("tensor_size", "tensor_size_list"):
        cfg = {k: v for k, v in both.items() if k != key}
        with UcmPipelineStore(cfg) as store:
            assert store.lookup([bytes(16)]) == [False]
    cfg = {k: v for k, v in both.items() if k not in ("tensor_size_list", "store_pipeline")}
    checked = check_stage("Posix", cfg, "test")
    assert checked.tensor_size_list == [1024] * 4 and checked.tensor_size is None


def test_lookup_of_none_names_the_argument(tmp_path: Path) -> None:
    with UcmPipelineStore(posix(tmp_path)) as store:
        for call in (store.lookup, store.lookup_on_prefix, store.prefetch):
            with pytest.raises(InvalidParamError, match=r"block_ids: expected .*NoneType"):
                call(None)  # type: ignore[arg-type]
            with pytest.raises(InvalidParamError, match=r"block_ids: expected .*int"):
                call(5)  # type: ignore[arg-type]


def test_a_negative_region_address_names_regions(tmp_path: Path) -> None:
    with UcmPipelineStore(posix(tmp_path)) as store:
        owner = np.zeros(4096, dtype=np.uint8)
        for bad in ([[-1]], [["x"]], None):
            with pytest.raises(InvalidParamError, match=r"Regions\.addrs"):
                store.dump([bytes(16)], [0], Regions([owner], bad))


@pytest.mark.parametrize("bad", [[1, 2], "store_pipeline: Posix", None, 7])
def test_a_config_that_is_not_a_mapping_is_a_config_error(bad: Any) -> None:
    from ucm.integration.vllm.config import UcmConnectorConfig

    with pytest.raises(ConfigError, match=r"must be a mapping of keys to values"):
        PipelineStoreConfig.from_dict(bad)
    with pytest.raises(ConfigError, match=r"must be a mapping"):
        UcmPipelineStore(bad)
    with pytest.raises(ConfigError, match=r"config of store 'UcmPipelineStore'"):
        UcmConnectorFactory.create_connector("UcmPipelineStore", bad)
    with pytest.raises(ConfigError, match=r"stage Posix"):
        check_stage("Posix", bad, "test")
    with pytest.raises(ConfigError, match=r"test: a config must be a mapping"):
        build_dataclass(UcmConnectorConfig, bad, "test")
    if bad:  # no extra config at all is fine
        with pytest.raises(ConfigError, match=r"kv_connector_extra_config"):
            resolve_config(bad, env={})


def test_a_config_file_holding_a_list_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "list.yaml"
    path.write_text("- store_pipeline: Posix\n")
    with pytest.raises(ConfigError, match=rf"{path} must hold a mapping .*got list"):
        PipelineStoreConfig.from_yaml(path)
