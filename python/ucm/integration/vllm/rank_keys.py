"""Store keys of tensor-parallel ranks.

The scheduler's block ids (:func:`ucm.hashing.block_ids`) are rank 0's store
keys. Every other rank holds other heads of the same blocks and stores them
under keys of its own, derived from the id (:func:`rank_key`). The bytes of
that derivation are part of the on-disk format: a store written before must
keep hitting, so it never changes (the tests pin known values).

A worker derives each block's key once (:class:`RankKeys`) and reuses it
for every later transfer of that block: a load of a prefix that other
requests saved or loaded before, a sparse method's per-step loads of the
blocks it selects.
"""

from __future__ import annotations

import hashlib
import threading


def rank_key(block_id: bytes, rank: int) -> bytes:
    """Store key of block ``block_id`` on TP rank ``rank`` (>= 1)."""
    # A second hash over the block id on purpose: the block hasher can't take
    # the rank into its chain without changing rank 0's keys, which the
    # scheduler (rank-less) looks up.
    salt = b"ucm-tp-rank:" + rank.to_bytes(4, "little")
    return hashlib.blake2b(block_id + salt, digest_size=16).digest()


def rank_keys(ids: list[bytes], rank: int) -> list[bytes]:
    """Store keys of TP rank ``rank`` (rank 0 uses the scheduler's ids as is)."""
    if rank == 0:
        return ids
    return [rank_key(i, rank) for i in ids]


class RankKeys:
    """One worker's store keys of the scheduler's block ids, each derived
    once and remembered (the most recent :attr:`MAX` blocks)."""

    MAX = 1 << 15

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self._keys: dict[bytes, bytes] = {}
        # The sparse bridge's loads may run beside the worker's own.
        self._lock = threading.Lock()

    def __call__(self, ids: list[bytes]) -> list[bytes]:
        """This rank's keys of ``ids`` (``ids`` itself on rank 0)."""
        if self.rank == 0:
            return ids
        out = []
        with self._lock:
            for i in ids:
                k = self._keys.get(i)
                if k is None:
                    k = self._keys[i] = rank_key(i, self.rank)
                out.append(k)
            # Oldest first: a block evicted while still in use costs one hash.
            while len(self._keys) > self.MAX:
                del self._keys[next(iter(self._keys))]
        return out


__all__ = ["RankKeys", "rank_key", "rank_keys"]
