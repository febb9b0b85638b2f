"""Chunk segmentation, position-independent chunk block ids, and the per-request plan.

**Chunks.** A RAG prompt is ``[chunk_0][chunk_1]...[chunk_n-1][suffix]``.
Chunks are found in one of two ways:

* *end token* (the original UCM protocol): the client pads each chunk to a
  multiple of the block size ``B`` and ends it with ``chunk_end_token_id``;
  a chunk ends at every block whose last token is that id. Whatever follows
  the last such block is the suffix (the question).
* *explicit spans*: ``kv_transfer_params["ucm_blend_chunks"] = [[start, end], ...]``
  (token offsets, end exclusive, sorted, disjoint). Tokens outside every
  span are recomputed.

**Ids.** A chunk's blocks are hashed *from the root* (``parent=None``), on the
chunk's own tokens: ``block_ids(tokens[start:end], B, meta, algo)``. The ids
therefore depend only on the chunk's content, not on where it sits in a
prompt, and equal the ordinary prefix ids of the chunk served alone -- which
is how chunk caches are built (a *build* request is the chunk alone, hashed
and dumped like any prompt). Only whole blocks of a chunk get ids, and a
chunk's blocks can be loaded only if the chunk starts on a block boundary of
the prompt (a cached block must land on one paged block); a chunk that
starts mid-block is recomputed (clients pad chunks to ``B`` to avoid it).

**Decision** (:func:`plan_request`), per request:

1. *BUILD_CHUNK_CACHE*: the request is a chunk served alone (``ucm_blend_build``
   in ``kv_transfer_params``, or, end-token protocol, the prompt is a whole
   number of blocks and ends with ``chunk_end_token_id``): ordinary prefix
   reuse and dump, so the chunk's blocks are stored under its root-hashed ids.
2. Otherwise the prompt's ordinary (chained) prefix ids are looked up; the
   leading hits are an exact prefix and are loaded as such.
3. Each chunk block past that prefix is looked up by its chunk id. With at
   least ``min_blend_hit_blocks`` hits the request is *BLEND*: the hit
   blocks are loaded and moved to their new positions (delta-RoPE), missed
   chunk blocks and every token outside a hit block (the suffix, unaligned
   chunk tails) are recomputed, and the high-KV-deviation selection picks
   which reused tokens are recomputed too. The blended KV is not dumped (it
   depends on the neighbouring chunks).
4. Below the threshold: *PREFIX* (fallback), ordinary prefix reuse and dump.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from ucm.hashing import block_ids
from ucm.shared.config import ConfigError
from ucm.sparse.blend.config import BUILD_PARAM, CHUNKS_PARAM, BlendConfig


class BlendMode(enum.Enum):
    """What a request does with the store."""

    BUILD_CHUNK_CACHE = "build_chunk_cache"
    """A chunk served alone: prefix reuse, all full blocks dumped."""
    BLEND = "blend"
    """Non-prefix reuse of chunk caches, partial recompute, nothing dumped."""
    PREFIX = "prefix"
    """Ordinary prefix reuse and dump (no chunks, or too few chunk hits)."""


@dataclass(frozen=True)
class ChunkSpan:
    """Tokens ``[start, end)`` of the prompt that form one RAG chunk."""

    start: int
    end: int

    def __len__(self) -> int:
        return self.end - self.start


class BlockLookup(Protocol):
    """What the planner needs from a store (``UcmKVStoreBase`` has both)."""

    def lookup(self, block_ids: Sequence[bytes]) -> list[bool]: ...

    def lookup_on_prefix(self, block_ids: Sequence[bytes]) -> int: ...


# ---------------------------------------------------------------------------- segmentation


def _tokens_list(token_ids: Any) -> list[int]:
    if isinstance(token_ids, torch.Tensor):
        return [int(t) for t in token_ids.reshape(-1).tolist()]
    return [int(t) for t in token_ids]


def segment_by_end_token(
    token_ids: Sequence[int], block_size: int, chunk_end_token_id: int
) -> list[ChunkSpan]:
    """Chunks ending at every block whose last token is ``chunk_end_token_id``.

    The first chunk starts at 0 and each next one where the previous ended;
    tokens after the last such block are the suffix (no chunk). Only full
    blocks are inspected, so every chunk is block aligned.
    """
    toks = _tokens_list(token_ids)
    spans: list[ChunkSpan] = []
    start = 0
    for blk in range(len(toks) // block_size):
        end = (blk + 1) * block_size
        if toks[end - 1] == chunk_end_token_id:
            spans.append(ChunkSpan(start, end))
            start = end
    return spans


def parse_chunk_spans(raw: Any, num_tokens: int) -> list[ChunkSpan]:
    """Validates ``kv_transfer_params["ucm_blend_chunks"]`` against the prompt length.

    Raises :class:`ConfigError` naming the key for anything but a sorted
    list of disjoint, non-empty ``[start, end]`` pairs inside the prompt.
    """
    key = f"kv_transfer_params.{CHUNKS_PARAM}"
    if not isinstance(raw, list | tuple):
        raise ConfigError(f"{key}: expected a list of [start, end] pairs, got {type(raw).__name__}")
    spans: list[ChunkSpan] = []
    prev_end = 0
    for i, pair in enumerate(raw):
        if not (isinstance(pair, list | tuple) and len(pair) == 2):
            raise ConfigError(f"{key}[{i}]: expected [start, end], got {pair!r}")
        try:
            a, b = (int(x) for x in pair)
        except (TypeError, ValueError):
            raise ConfigError(f"{key}[{i}]: expected integers, got {pair!r}") from None
        if not (0 <= a < b <= num_tokens):
            raise ConfigError(
                f"{key}[{i}]: span [{a}, {b}) must be non-empty and inside the "
                f"{num_tokens}-token prompt"
            )
        if a < prev_end:
            raise ConfigError(
                f"{key}[{i}]: spans must be sorted and disjoint, [{a}, {b}) "
                f"starts before the previous end {prev_end}"
            )
        spans.append(ChunkSpan(a, b))
        prev_end = b
    return spans


def find_chunks(
    token_ids: Sequence[int],
    block_size: int,
    config: BlendConfig,
    kv_transfer_params: Mapping[str, Any] | None = None,
) -> list[ChunkSpan]:
    """The request's chunks: explicit spans win over the end-token protocol."""
    params = kv_transfer_params or {}
    if params.get(CHUNKS_PARAM) is not None:
        return parse_chunk_spans(params[CHUNKS_PARAM], len(token_ids))
    if config.chunk_end_token_id is not None:
        return segment_by_end_token(token_ids, block_size, config.chunk_end_token_id)
    return []


def is_build_request(
    token_ids: Sequence[int],
    block_size: int,
    config: BlendConfig,
    kv_transfer_params: Mapping[str, Any] | None = None,
) -> bool:
    """Whether the request is a chunk served alone to build its cache."""
    params = kv_transfer_params or {}
    if BUILD_PARAM in params:
        return bool(params[BUILD_PARAM])
    end = config.chunk_end_token_id
    n = len(token_ids)
    return end is not None and n > 0 and n % block_size == 0 and int(token_ids[-1]) == end


# ---------------------------------------------------------------------------- ids


@dataclass(frozen=True)
class ChunkBlocks:
    """The loadable blocks of one chunk."""

    index: int
    """Chunk number in the prompt."""
    span: ChunkSpan
    ids: list[bytes]
    """Root-hashed ids of the chunk's full blocks (position independent)."""
    first_block: int | None
    """Prompt block index of the chunk's block 0; ``None``: the chunk starts
    mid-block and cannot be loaded."""


def chunk_block_ids(
    token_ids: Sequence[int],
    chunks: Sequence[ChunkSpan],
    block_size: int,
    meta: str | bytes,
    algo: str = "blake3",
) -> list[ChunkBlocks]:
    """Position-independent ids of every chunk (``block_ids(..., parent=None)`` per chunk)."""
    toks = _tokens_list(token_ids)
    out = []
    for i, span in enumerate(chunks):
        ids = block_ids(toks[span.start : span.end], block_size, meta, algo, None)
        first = span.start // block_size if span.start % block_size == 0 else None
        out.append(ChunkBlocks(i, span, ids, first))
    return out


# ---------------------------------------------------------------------------- plan


@dataclass(frozen=True)
class BlockLoad:
    """One store block loaded into one prompt block."""

    block_index: int
    """Prompt block it fills (tokens ``[i*B, (i+1)*B)``)."""
    block_id: bytes
    chunk_index: int
    """Chunk it comes from; -1 for an exact-prefix block."""
    cached_start: int
    """Position of the block's first token when it was computed."""
    new_start: int
    """Position of the block's first token in this prompt."""

    @property
    def delta(self) -> int:
        """Positions to rotate the block's keys by (``new_start - cached_start``)."""
        return self.new_start - self.cached_start


@dataclass
class BlendPlan:
    """What one request loads, recomputes and dumps (see the module doc)."""

    mode: BlendMode
    num_tokens: int
    block_size: int
    prefix_ids: list[bytes]
    """Ordinary chained ids of the prompt's full blocks."""
    prefix_hit_blocks: int = 0
    """Leading prompt blocks that are an exact prefix (device or store)."""
    device_hit_blocks: int = 0
    """Of those, blocks already in device memory (vLLM's prefix cache)."""
    chunks: list[ChunkBlocks] = field(default_factory=list)
    loads: list[BlockLoad] = field(default_factory=list)
    """Store blocks to load: prefix blocks first, then chunk blocks."""
    chunk_hit_blocks: int = 0
    chunk_blocks_total: int = 0

    # -------------------------------------------------------------- token sets

    @property
    def prefix_tokens(self) -> int:
        """Tokens of the exact prefix: not part of the step's query."""
        return self.prefix_hit_blocks * self.block_size

    @property
    def chunk_loads(self) -> list[BlockLoad]:
        return [ld for ld in self.loads if ld.chunk_index >= 0]

    def reused_mask(self) -> torch.Tensor:
        """``[num_tokens]`` bool: tokens whose KV is loaded from a chunk cache
        (the HKVD candidates)."""
        m = torch.zeros(self.num_tokens, dtype=torch.bool)
        b = self.block_size
        for ld in self.chunk_loads:
            m[ld.block_index * b : (ld.block_index + 1) * b] = True
        return m

    def forced_mask(self) -> torch.Tensor:
        """``[num_tokens]`` bool: query tokens that are always recomputed
        (missed chunk blocks, the suffix, unaligned tails, the last token)."""
        m = ~self.reused_mask()
        m[: self.prefix_tokens] = False
        if self.num_tokens:
            m[self.num_tokens - 1] = True
        return m

    @property
    def num_reused_tokens(self) -> int:
        return len(self.chunk_loads) * self.block_size

    @property
    def num_load_blocks(self) -> int:
        return len(self.loads)

    @property
    def dump_block_indices(self) -> list[int]:
        """Prompt blocks to dump after computing them (none when blending)."""
        if self.mode is BlendMode.BLEND:
            return []
        return list(range(self.prefix_hit_blocks, len(self.prefix_ids)))

    def summary(self) -> dict[str, Any]:
        return {
            "mode": self.mode.value,
            "tokens": self.num_tokens,
            "prefix_hit_blocks": self.prefix_hit_blocks,
            "chunk_hit_blocks": self.chunk_hit_blocks,
            "chunk_blocks_total": self.chunk_blocks_total,
            "reused_tokens": self.num_reused_tokens,
            "forced_tokens": int(self.forced_mask().sum()),
        }


def plan_request(
    token_ids: Sequence[int],
    block_size: int,
    meta: str | bytes,
    store: BlockLookup,
    config: BlendConfig,
    kv_transfer_params: Mapping[str, Any] | None = None,
    *,
    algo: str = "blake3",
    num_computed_tokens: int = 0,
) -> BlendPlan:
    """Plans one request (the scheduler side of Blend; see the module doc).

    ``num_computed_tokens`` is vLLM's device prefix-cache hit (whole blocks);
    those blocks are part of the exact prefix and are not loaded.
    """
    toks = _tokens_list(token_ids)
    n = len(toks)
    b = block_size
    if num_computed_tokens % b:
        raise ValueError(f"num_computed_tokens {num_computed_tokens} is not a multiple of {b}")
    prefix_ids = block_ids(toks, b, meta, algo, None)
    dev_hit = min(num_computed_tokens // b, len(prefix_ids))
    found = store.lookup_on_prefix(prefix_ids[dev_hit:]) + 1 if dev_hit < len(prefix_ids) else 0
    prefix_hit = dev_hit + max(0, found)
    plan = BlendPlan(BlendMode.PREFIX, n, b, prefix_ids, prefix_hit, dev_hit)

    def prefix_loads() -> list[BlockLoad]:
        return [BlockLoad(i, prefix_ids[i], -1, i * b, i * b) for i in range(dev_hit, prefix_hit)]

    if is_build_request(toks, b, config, kv_transfer_params):
        plan.mode = BlendMode.BUILD_CHUNK_CACHE
        plan.loads = prefix_loads()
        return plan
    chunks = chunk_block_ids(toks, find_chunks(toks, b, config, kv_transfer_params), b, meta, algo)
    plan.chunks = chunks
    candidates: list[tuple[int, int, bytes]] = []  # (chunk, local block, id)
    for ch in chunks:
        if ch.first_block is None:
            continue
        for j, cid in enumerate(ch.ids):
            if ch.first_block + j >= prefix_hit:
                candidates.append((ch.index, j, cid))
    plan.chunk_blocks_total = len(candidates)
    hits = store.lookup([c[2] for c in candidates]) if candidates else []
    chunk_loads = []
    for (ci, j, cid), hit in zip(candidates, hits, strict=True):
        if hit:
            first = chunks[ci].first_block
            assert first is not None
            chunk_loads.append(BlockLoad(first + j, cid, ci, j * b, (first + j) * b))
    plan.chunk_hit_blocks = len(chunk_loads)
    plan.loads = prefix_loads()
    if chunk_loads and len(chunk_loads) >= config.min_blend_hit_blocks:
        plan.mode = BlendMode.BLEND
        plan.loads += chunk_loads
    return plan
