"""Pure-Python reference of the original UCM block-id chain (pickle + hashlib.md5).

This mirrors ``RequestHasher`` and ``UCMDirectConnector.generate_hash`` from
``ucm/integration/vllm/ucm_connector.py`` of the original UCM, line for line:

* ``meta = f"{model}:{tensor_parallel_size}:{dtype}:{rank_id}"`` (UTF-8);
* ``hash(x) = md5(meta + (x if bytes else pickle.dumps(x, HIGHEST_PROTOCOL))).digest()``;
* ``seed = hash("UCM_HASH_SEED")`` (the *str* is pickled, so meta is prefixed);
* ``id_i = hash((id_{i-1}, tuple(tokens_i)))`` over full blocks only.

It is the oracle for ``ucm.hashing.block_ids(..., algo="md5_ucm")`` in the tests
and the baseline of ``benches/hash_bench.py``. Keep it dependency-free.
"""

from __future__ import annotations

import hashlib
import pickle


class RequestHasher:
    """hash(md5) request to generate ucm block id (as in the original UCM)."""

    def __init__(self, meta: str | bytes) -> None:
        self.meta_bytes = meta.encode("utf-8") if isinstance(meta, str) else bytes(meta)

    def __call__(self, input_data) -> bytes:
        if isinstance(input_data, bytes):
            input_bytes = input_data
        else:
            input_bytes = pickle.dumps(input_data, protocol=pickle.HIGHEST_PROTOCOL)

        h = hashlib.md5(self.meta_bytes + input_bytes)
        return h.digest()


def ucm_meta(model: str, tp_size: int, dtype: str, rank: int) -> str:
    """The original meta string: ``f"{model}:{tp_size}:{dtype}:{rank}"``."""
    return f"{model}:{tp_size}:{dtype}:{rank}"


def generate_hash(
    request_hasher: RequestHasher,
    block_size: int,
    token_ids: list[int],
    parent_block_hash_value: bytes,
) -> list[bytes]:
    """``UCMDirectConnector.generate_hash``: one id per full block, chained."""
    ret = []
    for start in range(0, len(token_ids), block_size):
        end = start + block_size
        block_token_ids = token_ids[start:end]
        # Do not hash the block if it is not full.
        if len(block_token_ids) < block_size:
            break

        block_token_ids_tuple = tuple(block_token_ids)
        hash_value = request_hasher((parent_block_hash_value, block_token_ids_tuple))
        parent_block_hash_value = hash_value
        ret.append(hash_value)

    return ret


def reference_root_id(meta: str | bytes) -> bytes:
    """The scheduler seed: ``RequestHasher(meta)("UCM_HASH_SEED")``."""
    return RequestHasher(meta)("UCM_HASH_SEED")


def reference_block_ids(
    token_ids: list[int],
    block_size: int,
    meta: str | bytes,
    parent: bytes | None = None,
) -> list[bytes]:
    """Block ids of ``token_ids`` chained from ``parent`` (default: the seed)."""
    hasher = RequestHasher(meta)
    seed = hasher("UCM_HASH_SEED") if parent is None else parent
    return generate_hash(hasher, block_size, list(token_ids), seed)
