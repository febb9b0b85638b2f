"""Tests of ucm.hashing: md5_ucm against the original pickle+hashlib chain, input types, errors."""

from __future__ import annotations

import importlib.util
import pathlib
import random

import numpy as np
import pytest

from ucm import hashing
from ucm.errors import InvalidParamError

_REF_PATH = pathlib.Path(__file__).with_name("ucm_reference_hash.py")
_spec = importlib.util.spec_from_file_location("ucm_reference_hash", _REF_PATH)
assert _spec is not None and _spec.loader is not None
ref = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ref)

META = hashing.ucm_meta("Qwen/Qwen3-8B", 2, "torch.bfloat16", 0)

# Values at and around every pickle int opcode boundary (BININT1/2, BININT, LONG1).
EDGE_VALUES = [
    0, 1, 127, 128, 255, 256, 65535, 65536, 2**31 - 1, 2**31, 2**32 - 1, 2**32,
    2**39, 2**63 - 1, -1, -128, -129, -256, -32768, -32769, -65536, -(2**31),
    -(2**31) - 1, -(2**32), -(2**39), -(2**63),
]  # fmt: skip


def _random_tokens(rng: random.Random, n: int) -> list[int]:
    kind = rng.randrange(5)
    if kind == 0:  # vocabulary-like ids
        return [rng.randrange(152_064) for _ in range(n)]
    if kind == 1:  # everything, incl. negative and > 2**32
        ranges = [(0, 256), (256, 65536), (-(2**31), 2**31), (-(2**63), 2**63), (-300, 0)]
        return [rng.randrange(*rng.choice(ranges)) for _ in range(n)]
    if kind == 2:
        return [rng.choice(EDGE_VALUES) for _ in range(n)]
    if kind == 3:
        return [rng.randrange(2**31, 2**40) for _ in range(n)]
    return [rng.randrange(256) for _ in range(n)]


def test_meta_string_matches_original() -> None:
    assert hashing.ucm_meta("m", 4, "torch.float16", 3) == b"m:4:torch.float16:3"
    assert hashing.ucm_meta("m", 4, "torch.float16", 3) == ref.ucm_meta(
        "m", 4, "torch.float16", 3
    ).encode("utf-8")


def test_md5_ucm_root_is_original_seed() -> None:
    for meta in (META, b"", "über-model:1:torch.bfloat16:0"):
        assert hashing.root_id(meta, "md5_ucm") == ref.reference_root_id(meta)


@pytest.mark.parametrize("seed", range(8))
def test_md5_ucm_matches_reference_random(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(25):
        block_size = rng.choice([1, 2, 3, 4, 5, 16, 127, 128, 256, rng.randrange(1, 600)])
        n = rng.randrange(0, block_size * 6 + 3)
        tokens = _random_tokens(rng, n)
        meta = rng.choice(
            [META, b"", "m:1:torch.float16:0", bytes(rng.randrange(256) for _ in range(70))]
        )
        parent = None if rng.random() < 0.5 else rng.randbytes(16)
        got = hashing.block_ids(tokens, block_size, meta, algo="md5_ucm", parent=parent)
        assert got == ref.reference_block_ids(tokens, block_size, meta, parent=parent)
        assert len(got) == n // block_size


@pytest.mark.parametrize("block_size", [1, 16, 128])
def test_md5_ucm_edge_values(block_size: int) -> None:
    rng = random.Random(block_size)
    tokens = EDGE_VALUES * 8
    rng.shuffle(tokens)
    got = hashing.block_ids(tokens, block_size, META, algo="md5_ucm")
    assert got == ref.reference_block_ids(tokens, block_size, META)


@pytest.mark.parametrize("block_size", [20_000, 13_107, 32_768])
def test_md5_ucm_big_blocks_pickle_framing(block_size: int) -> None:
    # Pickles > 64 KiB are split into several FRAMEs by CPython.
    rng = random.Random(block_size)
    for kind in range(3):
        if kind == 0:
            tokens = [rng.randrange(2**31, 2**62) for _ in range(2 * block_size + 7)]
        elif kind == 1:
            tokens = [rng.randrange(-(2**40), 2**40) for _ in range(2 * block_size)]
        else:
            tokens = [rng.randrange(65536) for _ in range(block_size)]
        for parent in (None, rng.randbytes(16)):
            got = hashing.block_ids(tokens, block_size, META, algo="md5_ucm", parent=parent)
            assert got == ref.reference_block_ids(tokens, block_size, META, parent=parent)


def test_md5_ucm_frame_boundary_exact() -> None:
    # 32758 one-byte ints put the frame exactly at 64 KiB after the last int.
    for n in range(32_750, 32_766):
        tokens = [5] * n + [300]
        assert hashing.block_ids(tokens, len(tokens), META, algo="md5_ucm") == (
            ref.reference_block_ids(tokens, len(tokens), META)
        )


@pytest.mark.parametrize("algo", hashing.HASH_ALGOS)
def test_input_types_agree(algo: str) -> None:
    rng = random.Random(1)
    tokens = [rng.randrange(152_064) for _ in range(1000)]
    expected = hashing.block_ids(tokens, 16, META, algo=algo)
    assert len(expected) == 1000 // 16
    assert all(isinstance(i, bytes) and len(i) == 16 for i in expected)
    variants = [
        tuple(tokens),
        np.array(tokens, dtype=np.int32),
        np.array(tokens, dtype=np.int64),
        np.array(tokens, dtype=np.uint32),
        np.array(tokens, dtype=np.uint64),
        np.repeat(np.array(tokens, dtype=np.int64), 2)[::2],  # non-contiguous
        np.array(tokens, dtype=">i8"),  # non-native byte order
        iter(tokens),
    ]
    torch = pytest.importorskip("torch")
    variants += [
        torch.tensor(tokens, dtype=torch.int32),
        torch.tensor(tokens, dtype=torch.int64),
        torch.tensor(tokens, dtype=torch.int64).repeat_interleave(2)[::2],
    ]
    for v in variants:
        assert hashing.block_ids(v, 16, META, algo=algo) == expected, type(v)
    # Narrow dtypes too.
    small = [t % 200 for t in tokens]
    expected_small = hashing.block_ids(small, 16, META, algo=algo)
    assert hashing.block_ids(np.array(small, dtype=np.uint8), 16, META, algo=algo) == (
        expected_small
    )
    assert hashing.block_ids(torch.tensor(small, dtype=torch.int16), 16, META, algo=algo) == (
        expected_small
    )


@pytest.mark.parametrize("algo", hashing.HASH_ALGOS)
def test_chain_properties(algo: str) -> None:
    rng = random.Random(2)
    tokens = [rng.randrange(152_064) for _ in range(1000)]
    ids = hashing.block_ids(tokens, 64, META, algo=algo)
    assert len(ids) == 15
    assert len(set(ids)) == len(ids)
    # Partial last block ignored; prefix of tokens -> prefix of ids.
    assert hashing.block_ids(tokens[:-1], 64, META, algo=algo) == ids
    assert hashing.block_ids(tokens[: 64 * 7 + 5], 64, META, algo=algo) == ids[:7]
    assert hashing.block_ids(tokens[:63], 64, META, algo=algo) == []
    assert hashing.block_ids(tokens, 2**62, META, algo=algo) == []
    assert hashing.block_ids([], 64, META, algo=algo) == []
    # Continuing a chain from a parent.
    assert hashing.block_ids(tokens[64 * 7 :], 64, META, algo=algo, parent=ids[6]) == ids[7:]
    assert hashing.block_ids(tokens, 64, META, algo=algo, parent=hashing.root_id(META, algo)) == ids
    # Different meta (another model, TP rank, dtype) -> different ids.
    for other in (
        hashing.ucm_meta("Qwen/Qwen3-8B", 2, "torch.bfloat16", 1),
        hashing.ucm_meta("Qwen/Qwen3-8B", 1, "torch.bfloat16", 0),
        hashing.ucm_meta("Qwen/Qwen3-8B", 2, "torch.float16", 0),
    ):
        other_ids = hashing.block_ids(tokens, 64, other, algo=algo)
        assert not set(other_ids) & set(ids)
    # str and bytes meta are the same thing.
    assert hashing.block_ids(tokens, 64, META.decode(), algo=algo) == ids
    # A one-token change changes that block's id and every later one.
    changed = list(tokens)
    changed[64 * 3 + 5] += 1
    changed_ids = hashing.block_ids(changed, 64, META, algo=algo)
    assert changed_ids[:3] == ids[:3]
    assert all(a != b for a, b in zip(changed_ids[3:], ids[3:], strict=True))


def test_algorithms_differ_and_default_is_blake3() -> None:
    tokens = list(range(512))
    per_algo = {a: hashing.block_ids(tokens, 128, META, algo=a) for a in hashing.HASH_ALGOS}
    assert len({tuple(v) for v in per_algo.values()}) == 3
    assert hashing.block_ids(tokens, 128, META) == per_algo["blake3"]
    assert hashing.root_id(META) == hashing.root_id(META, "blake3")
    assert len({hashing.root_id(META, a) for a in hashing.HASH_ALGOS}) == 3


def test_large_prompt_releases_gil_and_matches_reference() -> None:
    rng = random.Random(3)
    tokens = [rng.randrange(152_064) for _ in range(32 * 1024 + 77)]
    got = hashing.block_ids(np.array(tokens), 128, META, algo="md5_ucm")
    assert got == ref.reference_block_ids(tokens, 128, META)


@pytest.mark.parametrize("algo", hashing.HASH_ALGOS)
def test_bad_inputs(algo: str) -> None:
    with pytest.raises(InvalidParamError, match="block_size"):
        hashing.block_ids([1, 2, 3], 0, META, algo=algo)
    with pytest.raises(InvalidParamError, match="block_size"):
        hashing.block_ids([1, 2, 3], -4, META, algo=algo)
    with pytest.raises(InvalidParamError, match="15"):
        hashing.block_ids([1, 2, 3], 1, META, algo=algo, parent=b"x" * 15)
    with pytest.raises(InvalidParamError):
        hashing.block_ids([1, 2, 3], 1, META, algo=algo, parent="x" * 16)
    with pytest.raises(InvalidParamError, match="float"):
        hashing.block_ids(np.array([1.0, 2.0]), 1, META, algo=algo)
    with pytest.raises(InvalidParamError):
        hashing.block_ids(np.zeros((2, 2), dtype=np.int64), 1, META, algo=algo)
    with pytest.raises(InvalidParamError):
        hashing.block_ids([1, "2", 3], 1, META, algo=algo)
    with pytest.raises(InvalidParamError):
        hashing.block_ids([1, 2**64], 1, META, algo=algo)
    with pytest.raises(InvalidParamError):
        hashing.block_ids(np.array([2**63], dtype=np.uint64), 1, META, algo=algo)
    with pytest.raises(InvalidParamError):
        hashing.block_ids([1, 2], 1, 12, algo=algo)  # meta must be str or bytes
    torch = pytest.importorskip("torch")
    with pytest.raises(InvalidParamError, match="float"):
        hashing.block_ids(torch.tensor([1.0, 2.0]), 1, META, algo=algo)
    # InvalidParamError is a ValueError.
    with pytest.raises(ValueError):
        hashing.block_ids([1], 0, META, algo=algo)


def test_unknown_algo_names_valid_ones() -> None:
    with pytest.raises(InvalidParamError) as e:
        hashing.block_ids([1, 2], 1, META, algo="sha1")
    for name in hashing.HASH_ALGOS:
        assert name in str(e.value)
    with pytest.raises(InvalidParamError):
        hashing.root_id(META, algo="md5")


@pytest.mark.parametrize("algo", ["blake3", "xxh3_128"])
def test_token_range_for_u32_algos(algo: str) -> None:
    assert len(hashing.block_ids([0, 2**32 - 1], 2, META, algo=algo)) == 1
    for bad in (-1, 2**32):
        with pytest.raises(InvalidParamError, match="index 1"):
            hashing.block_ids([0, bad], 2, META, algo=algo)
    # md5_ucm takes any int64, like the original.
    assert len(hashing.block_ids([0, -1, 2**32], 1, META, algo="md5_ucm")) == 3


def test_native_algos_match_python_constant() -> None:
    from ucm import _native

    assert tuple(_native.HASH_ALGOS) == hashing.HASH_ALGOS
