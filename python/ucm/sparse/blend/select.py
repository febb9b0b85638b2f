"""High-KV-deviation (HKVD) token selection and the per-step row bookkeeping.

At a check layer every recomputed row has a *fresh* key; the rows whose KV
was loaded from a chunk cache also have the *loaded* key (delta-RoPE moved,
still in the paged cache because this layer's write has not happened). The
L1 distance between the two (:func:`ucm.sparse.kernels.keys.kv_deviation`)
measures how much the chunk's neighbours changed the token: CacheBlend
recomputes the top share of reused tokens by that distance and keeps the
loaded KV of all others.

:class:`BlendStep` tracks a step's flattened batch rows (every request's
query tokens, decode requests included) through the shrinking: ``active``
holds the original row numbers still computed, and :meth:`BlendStep.shrink`
cuts any per-row tensor (positions, hidden states, residual) down to them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


def select_hkvd(
    deviation: torch.Tensor,
    candidates: torch.Tensor,
    forced: torch.Tensor,
    budget: int,
) -> torch.Tensor:
    """Rows to recompute: ``forced`` rows plus the ``budget`` candidates that deviate most.

    Args:
        deviation: ``[n]`` fp32 per-row deviation.
        candidates: ``[n]`` bool, rows eligible for selection (reused rows).
        forced: ``[n]`` bool, rows always kept.
        budget: how many candidates to keep (clamped to their number). Ties
            are broken towards the earlier row (stable).

    Returns:
        ``[k]`` int64 sorted row indices.
    """
    n = deviation.numel()
    keep = forced.clone()
    cand_idx = torch.nonzero(candidates & ~forced, as_tuple=False).flatten()
    budget = max(0, min(int(budget), cand_idx.numel()))
    if budget:
        dev = deviation[cand_idx].float()
        # stable: sort by (-deviation, row)
        order = torch.sort(-dev, stable=True).indices[:budget]
        keep[cand_idx[order]] = True
    return torch.nonzero(keep, as_tuple=False).flatten().to(torch.int64) if n else keep.long()


@dataclass
class BlendRequestRows:
    """One request's rows in a step."""

    req_id: str
    start: int
    end: int
    num_reused: int
    """Reused (chunk-loaded) rows of the request: the base of the budget."""


@dataclass
class BlendStep:
    """A step's rows and their shrinking (see the module doc).

    ``reused``/``forced``/``slots``/``positions`` are indexed by *original*
    rows. A row of a request that is not blended is forced (always computed).
    """

    requests: list[BlendRequestRows]
    reused: torch.Tensor
    forced: torch.Tensor
    slots: torch.Tensor
    positions: torch.Tensor
    active: torch.Tensor = field(init=False)
    prev_rows: int = field(init=False)
    last_local: torch.Tensor | None = field(init=False, default=None)
    selections: dict[int, int] = field(default_factory=dict)
    """Check layer -> rows kept there (for stats)."""

    def __post_init__(self) -> None:
        n = self.num_rows
        for name in ("reused", "forced", "slots", "positions"):
            if getattr(self, name).numel() != n:
                raise ValueError(f"{name} must have {n} rows")
        self.active = torch.arange(n, dtype=torch.int64)
        self.prev_rows = n

    @property
    def num_rows(self) -> int:
        return int(self.reused.numel())

    @property
    def num_active(self) -> int:
        return int(self.active.numel())

    @property
    def shrunk(self) -> bool:
        return self.num_active != self.num_rows

    def select(self, layer: int, deviation: torch.Tensor, share: float) -> torch.Tensor:
        """Keeps, per request, the forced active rows and the top ``floor(share * num_reused)``
        reused active rows by ``deviation`` (``[num_active]``, aligned with
        ``active``). Returns the kept *local* indices (into the active rows)."""
        if deviation.numel() != self.num_active:
            raise ValueError(f"deviation must have {self.num_active} rows")
        act = self.active
        cand = self.reused[act]
        forced = self.forced[act]
        keep_local = []
        for r in self.requests:
            lo = int(torch.searchsorted(act, torch.tensor(r.start)))
            hi = int(torch.searchsorted(act, torch.tensor(r.end)))
            if lo == hi:
                continue
            budget = math.floor(share * r.num_reused + 1e-9)
            sel = select_hkvd(deviation[lo:hi], cand[lo:hi], forced[lo:hi], budget)
            keep_local.append(sel + lo)
        local = torch.cat(keep_local) if keep_local else torch.zeros(0, dtype=torch.int64)
        self.prev_rows = self.num_active
        self.last_local = local
        self.active = act[local]
        self.selections[layer] = int(local.numel())
        return local

    def shrink(self, t: torch.Tensor | None) -> torch.Tensor | None:
        """``t`` cut to the active rows if it still has the original or the
        previous row count; returned unchanged otherwise."""
        if t is None or not self.shrunk:
            return t
        n = t.shape[0]
        if n == self.num_rows:
            return t[self.active.to(t.device)]
        if n == self.prev_rows and self.last_local is not None:
            return t[self.last_local.to(t.device)]
        return t

    def active_query_start_loc(self) -> torch.Tensor:
        """``[S + 1]`` int32 query start offsets of the active rows."""
        out = [0]
        for r in self.requests:
            out.append(out[-1] + int(((self.active >= r.start) & (self.active < r.end)).sum()))
        return torch.tensor(out, dtype=torch.int32)

    def logits_indices(self, original: torch.Tensor) -> torch.Tensor:
        """Maps original-row logits indices (each request's last row, always
        forced, hence active) to active-row indices."""
        idx = torch.searchsorted(self.active, original.to(torch.int64).cpu())
        if idx.numel() and (
            bool((idx >= self.num_active).any())
            or not torch.equal(self.active[idx.clamp(max=self.num_active - 1)], original.cpu())
        ):
            raise RuntimeError("a logits row was dropped by the Blend selection")
        return idx.to(original.device)
