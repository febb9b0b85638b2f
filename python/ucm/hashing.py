"""Chained block ids for KV-cache blocks.

``block_ids(token_ids, block_size, meta)`` returns one 16-byte id per *full*
block of ``block_size`` tokens; block ``i``'s id hashes block ``i - 1``'s id
and its own tokens, so equal ids mean equal prefixes. ``meta`` names the
deployment (model, dtype, tensor-parallel size and rank, KV layout) so that
different models or layouts never share ids; :func:`ucm_meta` builds the
original UCM meta string.

Algorithms (``algo=``):

* ``"blake3"`` (default): keyed BLAKE3, key ``derive_key("ucm block id v1", meta)``;
  ids can't be forged by crafting prompts. Token ids must be in ``0..2**32``.
* ``"xxh3_128"``: XXH3-128 seeded with ``xxh3_64(meta)``; fastest, not
  collision-resistant against an adversary. Token ids must be in ``0..2**32``.
* ``"md5_ucm"``: byte-compatible with the original UCM chain
  (``md5(meta + pickle.dumps((parent, tuple(tokens)), protocol=5))``, seeded with
  ``md5(meta + pickle.dumps("UCM_HASH_SEED", protocol=5))``), so caches written by
  UCM are found again. Any int64 token id.

The hashing runs in Rust (``ucm._native``) with the GIL released for long
prompts.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ucm import _native

HASH_ALGOS: tuple[str, ...] = ("blake3", "xxh3_128", "md5_ucm")
"""Accepted values of ``algo``."""

BLOCK_ID_LEN = 16
"""Length of every block id, in bytes."""

# Buffer item types the native code reads directly (numpy dtype chars).
_NATIVE_INT_CHARS = frozenset("iIlLqQ")


def ucm_meta(model: str, tp_size: int, dtype: str, rank: int) -> bytes:
    """The original UCM meta string, ``f"{model}:{tp_size}:{dtype}:{rank}"`` (UTF-8).

    ``dtype`` is the torch dtype string, e.g. ``"torch.bfloat16"`` (``str(torch.bfloat16)``);
    ``rank`` is 0 on the scheduler.
    """
    return f"{model}:{tp_size}:{dtype}:{rank}".encode()


def _as_native_tokens(token_ids: Any) -> Any:
    """Converts torch tensors and odd numpy dtypes into something Rust reads directly."""
    mod = type(token_ids).__module__
    if mod.startswith("torch") and hasattr(token_ids, "detach"):
        import torch

        t = token_ids.detach().cpu()
        if t.dtype not in (torch.int32, torch.int64):
            if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
                raise _invalid(f"token_ids must be an integer tensor, got {t.dtype}")
            t = t.to(torch.int64)
        return t.contiguous().numpy()
    dtype = getattr(token_ids, "dtype", None)
    if mod.startswith("numpy") and dtype is not None:
        if dtype.kind in "iu" and not (dtype.char in _NATIVE_INT_CHARS and dtype.isnative):
            import numpy as np

            return token_ids.astype(np.uint64 if dtype.kind == "u" else np.int64)
    return token_ids


def _invalid(message: str) -> Exception:
    from ucm.errors import InvalidParamError

    return InvalidParamError(message)


def block_ids(
    token_ids: Iterable[int] | Any,
    block_size: int,
    meta: str | bytes,
    algo: str = "blake3",
    parent: bytes | None = None,
) -> list[bytes]:
    """One 16-byte id per full block of ``token_ids``, each chained on its parent's id.

    Args:
        token_ids: a list/tuple of ints, a 1-D numpy array or torch tensor of any
            integer dtype (CPU or device; it is copied to the host).
        block_size: tokens per block (>= 1). A trailing partial block gets no id.
        meta: the deployment's meta string (str or bytes), e.g. :func:`ucm_meta`.
        algo: one of :data:`HASH_ALGOS`.
        parent: the id to chain block 0 on; ``None`` means :func:`root_id` of
            ``meta``. Pass the last id of a prefix to continue its chain.

    Returns:
        ``len(token_ids) // block_size`` ids, as ``bytes`` of length 16.

    Raises:
        InvalidParamError: (a ``ValueError``) for ``block_size < 1``, a ``parent`` that
            is not 16 bytes, an unknown ``algo``, non-integer tokens, or (``blake3``,
            ``xxh3_128``) tokens outside ``0..2**32``.
    """
    return _native.block_ids(_as_native_tokens(token_ids), block_size, meta, algo, parent)


def root_id(meta: str | bytes, algo: str = "blake3") -> bytes:
    """The root id of ``meta``: the implicit parent of block 0.

    For ``md5_ucm`` this is the original UCM seed,
    ``md5(meta + pickle.dumps("UCM_HASH_SEED", protocol=5)).digest()``.
    """
    return _native.root_id(meta, algo)


__all__ = ["BLOCK_ID_LEN", "HASH_ALGOS", "block_ids", "root_id", "ucm_meta"]
