"""The store keys the connector reads and writes, pinned to known bytes.

Stores on disk are found again only while every key comes out exactly as
it did when they were written: a block's id on rank 0, its key on every
other TP rank, the key of a P/D handover's partial last block. These values
were computed before the per-rank keys were cached; a change of any
derivation fails here.
"""

from __future__ import annotations

import numpy as np
import pytest

from ucm.hashing import block_ids
from ucm.integration.vllm import rank_keys as rank_keys_module
from ucm.integration.vllm.handover import prompt_tail_key, tail_key
from ucm.integration.vllm.rank_keys import RankKeys, rank_key, rank_keys

META = "ucm-vllm-v1|model=m|dtype=torch.float16|tp=2|kv=cpu:NHD|block=16"
TOKENS = np.arange(1000, 1040, dtype=np.int64)  # two full blocks of 16 and 8 more

#: algo -> (block ids, rank 1's keys, rank 3's keys), hex
PINNED = {
    "blake3": (
        ["ce3646a055e352077938c471eca4247d", "f93ee7bc874cf9d54d1867a42f4883c4"],
        ["ca0e7cf727a5d94162d772bd62be2a8c", "cc22826206df36855bb83b169757c3af"],
        ["7fbda6add66700b161998ecacff6883f", "c00c259e944e8dce10af9f373472fe22"],
    ),
    "xxh3_128": (
        ["096e4c4f0b3125911ff2bd9fd8c62917", "b802f3d24a2d89db0c7c785fa22a62d0"],
        ["3e9449ee092dd3935c5b042a032ddf50", "1640220281eb0806e205e8516c52c315"],
        ["3cf2fb185651c40e49c71cca93156a2c", "87c66e8b43632e59e7633d71144e70c5"],
    ),
    "md5_ucm": (
        ["3765282dc9c04d47df1818363fbfde8a", "f66cac394d9d183643514762ff5ddf71"],
        ["9a9ea1c09a87dfc3267fddf5fcaff1ed", "822f449fe9723cd72c32c6dbb6e30fa4"],
        ["cb03e3c6d01fa667b823647900c1d8d1", "c9b751097d9bd63e55e6144b53a7411c"],
    ),
}


def _hex(keys: list[bytes]) -> list[str]:
    return [k.hex() for k in keys]


@pytest.mark.parametrize("algo", sorted(PINNED))
def test_block_ids_and_rank_keys_keep_their_bytes(algo: str) -> None:
    ids_hex, rank1_hex, rank3_hex = PINNED[algo]
    ids = block_ids(TOKENS, 16, META, algo)
    assert _hex(ids) == ids_hex
    assert _hex(rank_keys(ids, 1)) == rank1_hex
    assert _hex(rank_keys(ids, 3)) == rank3_hex
    assert _hex(RankKeys(1)(ids)) == rank1_hex
    assert _hex(RankKeys(3)(ids)) == rank3_hex


def test_rank_key_of_a_known_id() -> None:
    block = bytes(range(16))
    assert rank_key(block, 1).hex() == "2b4dad5e379d3b8852e640db10fb9c39"
    assert rank_key(block, 2).hex() == "5a0fbf1a732796748279bff3dbc83c99"


def test_handover_tail_keys_keep_their_bytes() -> None:
    assert tail_key(bytes(range(16)), [7, 8, 9]).hex() == "4e774f85fc5eae96de2a456817b8c346"
    assert tail_key(b"ns", [1]).hex() == "41887d97c91bc4a81111f93772b7130c"
    ids = [bytes.fromhex(h) for h in PINNED["blake3"][0]]
    # The tail of a 40-token prompt is chained to its second block's id ...
    assert prompt_tail_key(ids, TOKENS.tolist(), META, 16, 40) == tail_key(
        ids[1], TOKENS[32:].tolist()
    )
    # ... and that of a prompt shorter than a block to the hash namespace.
    assert prompt_tail_key([], [5, 6], "ns", 16, 2) == tail_key(b"ns", [5, 6])


def test_rank_keys() -> None:
    ids = [bytes([i]) * 16 for i in range(3)]
    assert rank_keys(ids, 0) is ids
    r1 = rank_keys(ids, 1)
    assert r1 == rank_keys(ids, 1) and len(set(r1) | set(ids)) == 6
    assert all(len(k) == 16 for k in r1)
    assert r1 != rank_keys(ids, 2)


def test_a_worker_derives_each_key_once(monkeypatch: pytest.MonkeyPatch) -> None:
    ids = [bytes([i]) * 16 for i in range(4)]
    expected = rank_keys(ids, 2)
    calls: list[bytes] = []

    def counting(block_id: bytes, rank: int) -> bytes:
        calls.append(block_id)
        return rank_key(block_id, rank)

    monkeypatch.setattr(rank_keys_module, "rank_key", counting)
    keys = RankKeys(2)
    first = keys(ids[:3])
    again = keys(ids)  # a later transfer of the same blocks and one more
    assert again[:3] == first and again == expected
    assert calls == ids  # each block once
    assert RankKeys(0)(ids) is ids


def test_the_remembered_keys_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(RankKeys, "MAX", 4)
    keys = RankKeys(1)
    ids = [bytes([i]) * 16 for i in range(10)]
    assert keys(ids) == rank_keys(ids, 1)
    assert keys(ids[:2]) == rank_keys(ids[:2], 1)  # evicted, derived again: same bytes
