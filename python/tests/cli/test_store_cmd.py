"""``ucm store``: info, ls, verify, gc and clear on a real Posix store."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from ucm.cli import main
from ucm.store import UcmConnectorFactory

SHARD = 4096


def fill(root: Path, n: int) -> list[bytes]:
    store = UcmConnectorFactory.create_connector(
        "UcmPipelineStore",
        {
            "storage_backends": str(root),
            "block_size": 2 * SHARD,
            "shard_size": SHARD,
            "posix_spare_files": 2,
        },
    )
    data = torch.arange(2 * SHARD, dtype=torch.int32).to(torch.uint8)
    ids = [bytes([i + 1]) * 16 for i in range(n)]
    for bid in ids:
        store.wait(store.dump([bid] * 2, [0, 1], [[data[:SHARD]], [data[SHARD:]]]))
    store.close()
    return ids


def run(*args: str, input: str | None = None) -> tuple[int, str]:
    res = CliRunner().invoke(main, ["store", *args], input=input)
    return res.exit_code, res.output


def test_info_ls_verify_on_a_directory(tmp_path: Path) -> None:
    ids = fill(tmp_path, 4)
    code, out = run("info", "--dir", str(tmp_path))
    assert code == 0 and "blocks     4" in out and "< 1 hour   4" in out
    code, out = run("ls", "--dir", str(tmp_path))
    assert code == 0 and {i.hex() for i in ids} <= set(out.split())
    code, out = run("verify", "--dir", str(tmp_path))
    assert code == 0 and "4 of 4 block(s) verified, 0 corrupt" in out
    # One bit flipped in the data of block 3's second shard (each shard is a
    # 4 KiB header, then its data).
    path = tmp_path / ids[2].hex()[:2] / ids[2].hex()
    raw = bytearray(path.read_bytes())
    raw[(4096 + SHARD) + 4096 + 100] ^= 1
    path.write_bytes(bytes(raw))
    code, out = run("verify", "--dir", str(tmp_path))
    assert code == 1
    assert f"corrupt {ids[2].hex()}" in out and "shard 1: data checksum mismatch" in out
    code, out = run("verify", "--dir", str(tmp_path), "--remove")
    assert code == 0 and not path.exists()


def test_gc_removes_what_a_killed_store_left_and_corrupt_blocks(tmp_path: Path) -> None:
    ids = fill(tmp_path, 2)
    writer = textwrap.dedent(
        f"""
        import os, signal
        from ucm.store import UcmConnectorFactory
        UcmConnectorFactory.create_connector("UcmPipelineStore", {{
            "storage_backends": {str(tmp_path)!r}, "block_size": {2 * SHARD},
            "shard_size": {SHARD}}})
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    subprocess.run([sys.executable, "-c", writer], check=False)
    # The killed store adopted the closed one's spares; its own directory stays.
    assert len(list((tmp_path / ".work").iterdir())) == 1
    path = tmp_path / ids[0].hex()[:2] / ids[0].hex()
    path.write_bytes(path.read_bytes()[:100])  # truncated
    code, out = run("gc", "--dir", str(tmp_path))
    assert code == 0, out
    assert "1 corrupt block(s)" in out and not path.exists()
    assert list((tmp_path / ".work").iterdir()) == []
    assert run("verify", "--dir", str(tmp_path))[0] == 0


def test_clear_asks_first(tmp_path: Path) -> None:
    fill(tmp_path, 3)
    code, out = run("clear", "--dir", str(tmp_path), input="n\n")
    assert code != 0 and "remove all 3 block(s)" in out
    assert "blocks     3" in run("info", "--dir", str(tmp_path))[1]
    code, out = run("clear", "--dir", str(tmp_path), input="y\n")
    assert code == 0 and "removed 3 block(s)" in out
    assert run("clear", "--dir", str(tmp_path), "--yes")[0] == 0


@pytest.mark.parametrize("shape", ["connector", "flat"])
def test_config_files_name_the_store(tmp_path: Path, shape: str) -> None:
    root = tmp_path / "kv"
    fill(root, 2)
    cfg = tmp_path / "c.yaml"
    if shape == "connector":
        cfg.write_text(
            "ucm_connectors:\n  - ucm_connector_name: UcmPipelineStore\n"
            f"    ucm_connector_config:\n      store_pipeline: Cache|Posix\n"
            f"      storage_backends: {root}\n      posix_capacity_gb: 1\n"
        )
    else:
        cfg.write_text(f"store_pipeline: Posix\nstorage_backends: {root}\nblock_size: 8192\n")
    code, out = run("info", "--config", str(cfg))
    assert code == 0 and "blocks     2" in out, out
    assert run("info")[0] != 0  # neither --dir nor --config
    bad = tmp_path / "bad.yaml"
    bad.write_text("store_pipeline: Cache|Empty\n")
    code, out = run("info", "--config", str(bad))
    assert code != 0 and "Posix, S3 and NFS" in out
