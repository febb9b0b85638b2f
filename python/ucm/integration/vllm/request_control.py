"""Per-request control of UCM through vLLM's ``kv_transfer_params``.

A request may carry (OpenAI API: ``"kv_transfer_params": {...}`` in the
request body; Python: ``SamplingParams(extra_args={"kv_transfer_params":
{...}})``)::

    ucm_skip_load: true       # compute the prompt; load nothing from the store
    ucm_skip_save: true       # save nothing of this request (e.g. private data)
    ucm_max_load_tokens: N    # load at most N prompt tokens (whole blocks)

A bad value never fails the request: it is ignored with a warning naming
the key, and the request is served as if the key were absent.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ucm.shared.logging import get_logger

logger = get_logger(__name__)

KEYS = ("ucm_skip_load", "ucm_skip_save", "ucm_max_load_tokens")


@dataclass(frozen=True)
class RequestControl:
    """What one request asks of UCM."""

    skip_load: bool = False
    skip_save: bool = False
    max_load_tokens: int | None = None

    @classmethod
    def of(cls, request: Any) -> RequestControl:
        """The control a vLLM request carries (none: the defaults)."""
        params = getattr(request, "kv_transfer_params", None)
        if not isinstance(params, Mapping) or not any(k in params for k in KEYS):
            return NONE
        rid = getattr(request, "request_id", "?")

        def flag(key: str) -> bool:
            v = params.get(key, False)
            if isinstance(v, bool):
                return v
            logger.warning(
                "request %s: kv_transfer_params.%s=%r is not a boolean; ignored", rid, key, v
            )
            return False

        limit = params.get("ucm_max_load_tokens")
        if limit is not None and (
            isinstance(limit, bool) or not isinstance(limit, int) or limit < 0
        ):
            logger.warning(
                "request %s: kv_transfer_params.ucm_max_load_tokens=%r is not a non-negative "
                "integer; ignored",
                rid,
                limit,
            )
            limit = None
        return cls(flag("ucm_skip_load"), flag("ucm_skip_save"), limit)

    def cap_load(self, tokens: int, block_size: int) -> int:
        """``tokens`` of store hits reduced to what this request allows."""
        if self.skip_load:
            return 0
        if self.max_load_tokens is not None:
            tokens = min(tokens, self.max_load_tokens // block_size * block_size)
        return tokens


NONE = RequestControl()

__all__ = ["KEYS", "RequestControl"]
