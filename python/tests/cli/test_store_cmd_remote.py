"""``ucm store`` on the remote stages: S3 against a real S3-compatible
server (``moto_server``), NFS through a kernel-mounted export (a directory
in the Posix layout; here a temporary directory the NFS stage writes as it
writes a mount) and through the built-in client against NFS-Ganesha. Only
objects and files whose first header names their block are ever removed."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import yaml
from click.testing import CliRunner
from support.remote_helpers import SHARD, SHARDS, bid, dump
from support.servers import MotoServer, NfsServer

from ucm.cli import main
from ucm.store import UcmConnectorFactory

GEOMETRY = {
    "block_size": SHARD * SHARDS,
    "shard_size": SHARD,
    "tensor_size_list": [SHARD // 2, SHARD // 2],
    "timeout_ms": 10000,
}


def fill(cfg: dict[str, Any], blocks: list[int]) -> None:
    store = UcmConnectorFactory.create_connector("UcmPipelineStore", {**cfg, **GEOMETRY})
    dump(store, blocks)
    store.close()


def write_config(path: Path, cfg: dict[str, Any]) -> str:
    """A store config file as a user writes one: no geometry (the blocks
    declare it)."""
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def run(*args: str) -> tuple[int, str]:
    res = CliRunner().invoke(main, ["store", *args])
    return res.exit_code, res.output


def test_s3_info_ls_verify_gc_clear(moto: MotoServer, tmp_path: Path) -> None:
    bucket = moto.create_bucket()
    cfg = {"store_pipeline": "Cache|S3", **moto.store_keys(bucket, "kv")}
    fill({**cfg, "store_pipeline": "S3"}, [1, 2, 3])
    client = moto.client()
    # An object that is not at a block key is not a block.
    client.put_object(Bucket=bucket, Key="kv/notes.txt", Body=b"hello")
    conf = write_config(tmp_path / "s3.yaml", cfg)
    code, out = run("info", "--config", conf)
    assert code == 0, out
    assert f"store      S3 at s3://{bucket}/kv" in out
    assert "blocks     3" in out and "< 1 hour   3" in out
    code, out = run("ls", "--config", conf)
    assert code == 0 and {bid(n).hex() for n in (1, 2, 3)} <= set(out.split()), out
    code, out = run("verify", "--config", conf)
    assert code == 0 and "3 of 3 block(s) verified, 0 corrupt" in out, out
    # One bit flipped in the data of block 2's second shard.
    h = bid(2).hex()
    key = f"kv/{h[:2]}/{h}"
    raw = bytearray(client.get_object(Bucket=bucket, Key=key)["Body"].read())
    stride = len(raw) // SHARDS
    raw[stride + 4096 + 10] ^= 1
    client.put_object(Bucket=bucket, Key=key, Body=bytes(raw))
    code, out = run("verify", "--config", conf)
    assert code == 1 and f"corrupt {h}" in out and "shard 1: data checksum mismatch" in out, out
    code, out = run("gc", "--config", conf, "--yes")
    assert code == 0 and "removed 1 corrupt block(s)" in out, out
    assert "blocks     2" in run("info", "--config", conf)[1]
    code, out = run("clear", "--config", conf, "--yes")
    assert code == 0 and "removed 2 block(s)" in out, out
    keys = [o["Key"] for o in client.list_objects_v2(Bucket=bucket).get("Contents", [])]
    assert keys == ["kv/notes.txt"]


def test_s3_removes_only_objects_that_are_ucm_blocks(moto: MotoServer, tmp_path: Path) -> None:
    bucket = moto.create_bucket()
    cfg = {"store_pipeline": "S3", **moto.store_keys(bucket, "kv")}
    fill(cfg, [1, 2])
    client = moto.client()

    def key(n: int) -> str:
        h = bid(n).hex()
        return f"kv/{h[:2]}/{h}"

    # At block keys: a user's object, and block 1's bytes under block 9's key.
    client.put_object(Bucket=bucket, Key=key(8), Body=os.urandom(5000))
    block1 = client.get_object(Bucket=bucket, Key=key(1))["Body"].read()
    client.put_object(Bucket=bucket, Key=key(9), Body=block1)
    conf = write_config(tmp_path / "s3.yaml", cfg)

    def objects() -> dict[str, bytes]:
        listed = client.list_objects_v2(Bucket=bucket).get("Contents", [])
        return {
            o["Key"]: client.get_object(Bucket=bucket, Key=o["Key"])["Body"].read() for o in listed
        }

    before = objects()
    code, out = run("clear", "--config", conf, "--dry-run")
    assert code == 0 and f"would remove s3://{bucket}/{key(1)} (block file)" in out, out
    assert f"would leave s3://{bucket}/{key(8)}: not a ucm block file" in out, out
    assert f"would leave s3://{bucket}/{key(9)}: a ucm block file of another block" in out, out
    code, out = run("clear", "--config", conf)
    assert code != 0 and "no terminal to ask on" in out, out
    assert objects() == before
    code, out = run("clear", "--config", conf, "--yes")
    assert code == 0 and "removed 2 block(s)" in out, out
    assert objects() == {k: v for k, v in before.items() if k not in (key(1), key(2))}


def test_s3_errors_name_the_key(moto: MotoServer, tmp_path: Path) -> None:
    conf = write_config(
        tmp_path / "s3.yaml",
        {"store_pipeline": "S3", **moto.store_keys("no-such-bucket-here", "kv")},
    )
    code, out = run("info", "--config", conf)
    assert code != 0 and "storage_backends" in out and "no-such-bucket-here" in out, out


def test_nfs_through_a_mount_is_a_directory(tmp_path: Path) -> None:
    root = tmp_path / "export"
    root.mkdir()
    cfg = {"store_pipeline": "NFS", "storage_backends": str(root)}
    fill(cfg, [4, 5])
    conf = write_config(tmp_path / "nfs.yaml", {**cfg, "store_pipeline": "Cache|NFS"})
    code, out = run("info", "--config", conf)
    assert code == 0 and f"store      NFS at {root}" in out and "blocks     2" in out, out
    code, out = run("ls", "--config", conf)
    assert code == 0 and {bid(4).hex(), bid(5).hex()} <= set(out.split()), out
    code, out = run("verify", "--config", conf)
    assert code == 0 and "2 of 2 block(s) verified, 0 corrupt" in out, out


def test_nfs_through_the_built_in_client(nfs: NfsServer, tmp_path: Path) -> None:
    cfg = {"store_pipeline": "NFS", "storage_backends": nfs.url("cli")}
    with nfs.in_netns():
        fill(cfg, [6, 7, 8])
    root = nfs.export / "cli"
    conf = write_config(tmp_path / "nfs.yaml", cfg)
    h = bid(7).hex()
    # A temporary of a writer gone for two hours, and one being written.
    old = root / h[:2] / f"{h}.tmp.0badc0de.1"
    old.write_bytes(b"x")
    os.utime(old, (time.time() - 7200, time.time() - 7200))
    fresh = root / h[:2] / f"{h}.tmp.0badc0de.2"
    fresh.write_bytes(b"x")
    with nfs.in_netns():
        code, out = run("info", "--config", conf)
        assert code == 0 and f"store      NFS at {nfs.url('cli')}" in out, out
        assert "blocks     3" in out, out
        code, out = run("ls", "--config", conf)
        assert code == 0 and {bid(n).hex() for n in (6, 7, 8)} <= set(out.split()), out
        code, out = run("verify", "--config", conf)
        assert code == 0 and "3 of 3 block(s) verified, 0 corrupt" in out, out
    path = root / h[:2] / h
    raw = bytearray(path.read_bytes())
    raw[(4096 + SHARD) + 4096 + 10] ^= 1
    path.write_bytes(bytes(raw))
    with nfs.in_netns():
        code, out = run("verify", "--config", conf)
        assert code == 1 and f"corrupt {h}" in out, out
        code, out = run("gc", "--config", conf, "--dry-run")
        assert code == 0 and "nothing was removed" in out, out
        assert path.exists() and old.exists()
        code, out = run("gc", "--config", conf, "--yes")
        assert code == 0 and "removed 1 corrupt block(s)" in out, out
        assert "1 abandoned temporary file(s)" in out, out
        assert not path.exists() and not old.exists() and fresh.exists()
    # A user's file at a block's name stays.
    h9 = bid(9).hex()
    stranger = root / h9[:2] / h9
    stranger.write_bytes(os.urandom(3000))
    with nfs.in_netns():
        code, out = run("clear", "--config", conf, "--yes")
        assert code == 0 and "removed 2 block(s)" in out, out
        assert f"leaving {nfs.url('cli')}/{h9[:2]}/{h9}: not a ucm block file" in out, out
        assert "blocks     1" in run("info", "--config", conf)[1]
    assert stranger.exists() and fresh.exists()
