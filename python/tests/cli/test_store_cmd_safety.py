"""``ucm store`` never removes what ucm did not write: a folder that is not
a store is refused and left as it was; in a store, links at block
directories' and blocks' names are never followed, and users' files, FIFOs
and other blocks' copies at block names stay; ``--dry-run`` lists and
removes nothing; without ``--yes`` the command asks (on a terminal; with
none it refuses)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from support.store_cli import (
    block_path,
    fill,
    run,
    run_child,
    run_on_terminal,
    snapshot,
)

DESTRUCTIVE = (
    ("clear", "--yes"),
    ("gc", "--yes"),
    ("verify", "--remove", "--yes"),
    ("clear", "--dry-run"),
)


def user_folder(root: Path) -> None:
    """A user's folder that looks like a store to a careless eye: files at
    block names in block-like directories, a work directory with a lock and
    spares, notes, a link out."""
    (root / "ab").mkdir(parents=True)
    (root / "ab" / ("ab" * 16)).write_bytes(os.urandom(8192))
    (root / "01").mkdir()
    (root / "01" / ("01" * 16)).write_bytes(b"\0" * 8192)
    work = root / ".work" / "0123456789abcdef"
    work.mkdir(parents=True)
    (work / "lock").write_bytes(b"")
    (work / "spare.1").write_bytes(b"my data")
    (root / "notes.txt").write_text("mine")
    (root / "elsewhere").symlink_to("/etc")


@pytest.mark.parametrize("args", DESTRUCTIVE, ids=lambda a: " ".join(a))
def test_a_folder_that_is_not_a_store_is_refused_and_left_alone(
    tmp_path: Path, args: tuple[str, ...]
) -> None:
    folder = tmp_path / "home"
    user_folder(folder)
    before = snapshot(folder)
    code, out = run_child(args[0], "--dir", str(folder), *args[1:])
    assert code != 0, out
    assert f"{folder} is not a ucm store" in out and "nothing there was changed" in out, out
    assert "not a ucm block file" in out and ("01" * 16) in out, out
    assert snapshot(folder) == before


def test_an_empty_folder_is_not_a_store(tmp_path: Path) -> None:
    code, out = run("clear", "--dir", str(tmp_path), "--yes")
    assert code != 0 and "no block file to recognise it by" in out, out
    code, out = run("info", "--dir", str(tmp_path))
    assert code != 0 and f"{tmp_path} is not a ucm store" in out, out
    assert list(tmp_path.iterdir()) == []


def plant(root: Path, outside: Path, ids: list[bytes]) -> dict[str, str]:
    """Around a store's real blocks: block directory of `ids[2]` replaced by
    a link to a folder outside (holding that real block); at other block
    names a link to a real block file outside, a user's file, `ids[0]`'s
    copy and a FIFO; users' notes beside the blocks and a user's folder in
    the root. What each planted name is, by path."""
    linked = ids[2].hex()[:2]
    shutil.move(root / linked, outside / linked)
    (root / linked).symlink_to(outside / linked)
    shutil.copy(block_path(root, ids[0]), outside / "copy")
    names = {
        "link": bytes([0x71]) * 16,
        "user": bytes([0x72]) * 16,
        "copy": bytes([0x73]) * 16,
        "fifo": bytes([0x74]) * 16,
    }
    block_path(root, names["link"]).symlink_to(outside / "copy")
    block_path(root, names["user"]).write_bytes(os.urandom(8192 + 8192))
    shutil.copy(block_path(root, ids[0]), block_path(root, names["copy"]))
    os.mkfifo(block_path(root, names["fifo"]))
    (root / ids[0].hex()[:2] / "notes.txt").write_text("mine")
    (root / "mine").mkdir()
    (root / "mine" / ("ab" * 16)).write_bytes(b"not a block")
    return {what: str(block_path(root, bid)) for what, bid in names.items()}


def test_only_the_stores_own_blocks_go(tmp_path: Path) -> None:
    root, outside = tmp_path / "kv", tmp_path / "outside"
    outside.mkdir()
    ids = fill(root, 4)
    planted = plant(root, outside, ids)
    outside_before = snapshot(outside)
    mine = [block_path(root, ids[i]) for i in (0, 1, 3)]
    before = snapshot(root)
    code, out = run("clear", "--dir", str(root), "--yes")
    assert code == 0 and "removed 3 block(s)" in out, out
    for what, reason in (
        ("link", "symbolic link at a block's name"),
        ("user", "not a ucm block file"),
        ("copy", "another block"),
        ("fifo", "FIFO at a block's name"),
    ):
        assert f"leaving {planted[what]}: " in out and reason in out, (what, out)
    assert f"leaving {root / ids[2].hex()[:2]}: a symbolic link, not a block directory" in out
    for p in mine:
        del before[str(p.relative_to(root))]
    after = snapshot(root)
    # The usage record is ucm's: the removals are taken off it.
    assert after.pop(".ucm-usage") != before.pop(".ucm-usage")
    assert after == before, "only the three blocks went"
    assert snapshot(outside) == outside_before, "nothing outside the store changed"
    # Nothing of ucm's left to remove: the next run says so.
    code, out = run("clear", "--dir", str(root), "--yes")
    assert code == 0 and "nothing to remove" in out, out


def test_dry_run_lists_what_would_go_and_removes_nothing(tmp_path: Path) -> None:
    root, outside = tmp_path / "kv", tmp_path / "outside"
    outside.mkdir()
    ids = fill(root, 3)
    planted = plant(root, outside, ids)
    raw = bytearray(block_path(root, ids[1]).read_bytes())
    raw[4096 + 10] ^= 1  # corrupt
    block_path(root, ids[1]).write_bytes(bytes(raw))
    before = snapshot(root)
    code, out = run("clear", "--dir", str(root), "--dry-run")
    assert code == 0, out
    for bid in (ids[0], ids[1]):
        assert f"would remove {block_path(root, bid)} (block file)" in out, out
    assert f"would leave {planted['user']}: not a ucm block file" in out, out
    assert "nothing was removed" in out
    code, out = run("gc", "--dir", str(root), "--dry-run")
    assert code == 0 and f"would remove {block_path(root, ids[1])} (corrupt: " in out, out
    assert "work directory of a stopped store" in out, out
    code, out = run("verify", "--dir", str(root), "--remove", "--dry-run")
    assert code == 1 and f"would remove {block_path(root, ids[1])} (corrupt: " in out, out
    assert snapshot(root) == before


def test_without_yes_it_asks_and_no_removes_nothing(tmp_path: Path) -> None:
    root = tmp_path / "kv"
    ids = fill(root, 3)
    before = snapshot(root)
    code, out = run_on_terminal("clear", "--dir", str(root), answer="n\n")
    assert code != 0 and "about to remove from" in out and "3 block file(s)" in out, out
    assert "remove them? [y/N]" in out, out
    assert snapshot(root) == before
    # No terminal to ask on: refused, without waiting for an answer.
    for args in (("clear",), ("gc",), ("verify", "--remove")):
        block_path(root, ids[0]).write_bytes(block_path(root, ids[0]).read_bytes()[:9000])
        before = snapshot(root)
        code, out = run_child(*args, "--dir", str(root))
        assert code != 0 and "no terminal to ask on" in out and "--yes" in out, (args, out)
        assert snapshot(root) == before
    code, out = run_on_terminal("clear", "--dir", str(root), answer="y\n")
    assert code == 0 and "removed 3 block(s)" in out, out
    assert not any(block_path(root, b).exists() for b in ids)


def test_a_store_from_before_the_marker_is_adopted_when_its_blocks_verify(
    tmp_path: Path,
) -> None:
    root = tmp_path / "old"
    ids = fill(root, 3)
    (root / ".ucm-store").unlink()
    code, out = run("info", "--dir", str(root))
    assert code == 0 and "its 3 sampled block file(s) are ucm blocks" in out, out
    assert not (root / ".ucm-store").exists(), "a look changes nothing"
    code, out = run("clear", "--dir", str(root), "--dry-run")
    assert code == 0 and f"would mark {root} as a ucm store" in out, out
    assert not (root / ".ucm-store").exists()
    code, out = run("clear", "--dir", str(root), "--yes")
    assert code == 0 and f"marked {root} as a ucm store" in out, out
    assert (root / ".ucm-store").read_text() == "ucm store\nformat 1\n"
    assert not any(block_path(root, b).exists() for b in ids)
    # One sampled file that is not a ucm block: refused, naming it.
    other = tmp_path / "other"
    fill(other, 2)
    (other / ".ucm-store").unlink()
    stranger = block_path(other, bytes([0x99]) * 16)
    stranger.write_bytes(b"x" * 100)
    before = snapshot(other)
    code, out = run("clear", "--dir", str(other), "--yes")
    assert code != 0 and f"{other} is not a ucm store" in out and str(stranger) in out, out
    assert snapshot(other) == before


def test_gc_leaves_live_stores_and_users_files(tmp_path: Path) -> None:
    from ucm.store import UcmConnectorFactory

    root = tmp_path / "kv"
    fill(root, 2)
    live = UcmConnectorFactory.create_connector(
        "UcmPipelineStore",
        {"storage_backends": str(root), "block_size": 8192, "shard_size": 4096},
    )
    try:
        work = root / ".work"
        (live_dir,) = list(work.iterdir())
        live_before = snapshot(live_dir)
        killed = work / "00112233aabbccdd"
        killed.mkdir()
        (killed / "lock").write_bytes(b"")
        (killed / "spare.7").write_bytes(b"\0" * 8192)
        (killed / "notes.txt").write_text("mine")
        code, out = run("gc", "--dir", str(root), "--yes")
        assert code == 0, out
        assert "removed 0 corrupt block(s), 2 file(s) in 1 work directory" in out, out
        assert f"leaving {killed / 'notes.txt'}: not a file a store writes there" in out, out
        assert [p.name for p in killed.iterdir()] == ["notes.txt"]
        # The live store's directory lost nothing (its pool of spare files
        # may have grown meanwhile).
        assert set(live_before) <= set(snapshot(live_dir)), "the live store's files stay"
    finally:
        live.close()
