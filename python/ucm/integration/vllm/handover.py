"""Prefill/decode (P/D) handover through vLLM's ``kv_transfer_params``.

A prefill engine (``kv_role: kv_producer``) and a decode engine
(``kv_role: kv_consumer``) share one store. A router (``ucm proxy``) sends
the prompt to the prefill engine with vLLM's P/D field::

    {"do_remote_decode": true}

The prefill engine saves the whole prompt (its last, partial block too,
under a key of its own: :func:`tail_key`), its workers wait for those saves
before the step ends, and so its response names only blocks that are
readable::

    {"do_remote_prefill": true, "do_remote_decode": false,
     "ucm_blocks": N,          # full blocks of the prompt in the store
     "ucm_tail_tokens": T,     # tokens of the partial last block saved too (0: none)
     "ucm_last_block": "hex"}  # id of the last of them (the tail's when T > 0)

The router passes these to the decode engine, whose scheduler waits until
the store shows those blocks (the store may lag behind the prefill engine's
write: a Cache tier writes back later, NFS caches attributes), bounded by
``handover_timeout_s``, and then loads all but the prompt's last token.

Block ids are chained, so the last id names the whole prefix: a decode
engine whose own id differs (another model, salt or block size) warns and
computes the prompt instead of waiting for blocks that never come. Bad
values are ignored with a warning, never fatal.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ucm.shared.logging import get_logger

logger = get_logger(__name__)

_TAIL_PERSON = b"ucm-pd-tail-v1"


def tail_key(parent: bytes, tokens: Sequence[int]) -> bytes:
    """Store key of a prompt's partial last block: its tokens chained to the
    previous block's id (or, for a prompt shorter than a block, the hash
    namespace), in a keyspace of its own so prefix lookups never see it."""
    h = hashlib.blake2b(digest_size=16, person=_TAIL_PERSON)
    h.update(len(parent).to_bytes(4, "little"))
    h.update(parent)
    h.update(np.asarray(tokens, dtype=np.int64).tobytes())
    return h.digest()


def prompt_tail_key(
    ids: Sequence[bytes], tokens: Sequence[int], namespace: str, block_size: int, end: int
) -> bytes:
    """:func:`tail_key` of the partial block ending a prompt of ``end``
    tokens, chained to its last full block's id in ``ids``."""
    full = end // block_size
    parent = ids[full - 1] if full else namespace.encode()
    return tail_key(parent, tokens[full * block_size : end])


def wants_handover(request: Any) -> bool:
    """Whether the request asks this (prefill) engine to hand its KV over."""
    params = getattr(request, "kv_transfer_params", None)
    return isinstance(params, Mapping) and params.get("do_remote_decode") is True


@dataclass(frozen=True)
class Handover:
    """The blocks a prefill engine handed over for one request."""

    blocks: int
    tail_tokens: int
    last_block: bytes

    def params(self) -> dict[str, Any]:
        """The prefill engine's ``kv_transfer_params``."""
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "ucm_blocks": self.blocks,
            "ucm_tail_tokens": self.tail_tokens,
            "ucm_last_block": self.last_block.hex(),
        }

    @classmethod
    def of(cls, request: Any, block_size: int) -> Handover | None:
        """The handover a decode request carries, or None (none, or a bad
        one: ignored with a warning)."""
        params = getattr(request, "kv_transfer_params", None)
        if not isinstance(params, Mapping) or params.get("do_remote_prefill") is not True:
            return None
        if "ucm_blocks" not in params:
            return None  # another connector's handover
        rid = getattr(request, "request_id", "?")
        blocks = params.get("ucm_blocks")
        tail = params.get("ucm_tail_tokens", 0)
        last = params.get("ucm_last_block")
        n_tokens = int(getattr(request, "num_prompt_tokens", 0) or 0)
        problem = None
        last_b = b""
        if not _is_int(blocks) or not _is_int(tail):
            problem = "ucm_blocks and ucm_tail_tokens must be integers"
        elif blocks < 0 or not 0 <= tail < block_size:
            problem = f"ucm_blocks must be >= 0 and ucm_tail_tokens in [0, {block_size})"
        elif blocks * block_size + tail > n_tokens:
            problem = f"they cover more than the prompt's {n_tokens} tokens"
        elif not isinstance(last, str) or len(last) != 32:
            problem = "ucm_last_block must be a 32-digit hex string"
        else:
            try:
                last_b = bytes.fromhex(last)
            except ValueError:
                problem = "ucm_last_block must be a 32-digit hex string"
        if problem is not None:
            logger.warning(
                "request %s: kv_transfer_params of the P/D handover ignored (%s); "
                "the prompt is computed here",
                rid,
                problem,
            )
            return None
        if blocks == 0 and tail == 0:
            return None
        return cls(blocks=blocks, tail_tokens=tail, last_block=last_b)

    def expected_keys(
        self, ids: list[bytes], tokens: Sequence[int], namespace: str, block_size: int
    ) -> list[bytes] | None:
        """This engine's keys of the handed-over blocks (the tail's last), or
        None when they are not the ones the prefill engine saved."""
        keys = list(ids[: self.blocks])
        if len(keys) < self.blocks:
            return None
        if self.tail_tokens:
            end = self.blocks * block_size + self.tail_tokens
            keys.append(prompt_tail_key(keys, tokens, namespace, block_size, end))
        return keys if keys and keys[-1] == self.last_block else None


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


__all__ = ["Handover", "prompt_tail_key", "tail_key", "wants_handover"]
