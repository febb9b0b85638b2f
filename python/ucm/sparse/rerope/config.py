"""``ucm_sparse_config: {ReRoPE: {...}}``: the ReRoPE parameters.

Every error names its key; :func:`ucm.sparse.factory.build_method_config`
prefixes it with ``ucm_sparse_config.ReRoPE.``. The original UCM reads the
same two numbers from the environment (``REROPE_WINDOW``,
``TRAINING_LENGTH``).
"""

from __future__ import annotations

from dataclasses import dataclass

from ucm.shared.config import ConfigError


@dataclass
class ReRoPEConfig:
    """ReRoPE (Jianlin Su, 2023): exact relative positions inside a window,
    clamped to the window beyond it."""

    rerope_window: int = 512
    """``W``: a key at distance ``i - j < W`` from the query gets its exact
    relative position, a farther one gets ``W``. Must not exceed
    ``training_length`` (every position seen must have been trained)."""
    training_length: int | None = None
    """The model's pre-training context length, the base of the log-n query
    scaling ``max(1, log(pos + 1) / log(training_length))``. ``None``: the
    model's ``max_position_embeddings`` before any override."""
    log_n_scaling: bool = True
    """Scale queries by the log-n factor (ReRoPE-w-log n, the best variant
    in Su's table). False leaves queries unscaled."""
    always_on: bool = False
    """Use the ReRoPE attention even in steps where every sequence fits in
    the window (then it equals RoPE attention up to rounding and the native
    backend is used, as in the original's per-batch ``use_rerope``)."""

    def __post_init__(self) -> None:
        if self.rerope_window < 1:
            raise ConfigError(f"rerope_window: must be >= 1, got {self.rerope_window}")
        if self.training_length is not None:
            if self.training_length < 2:
                raise ConfigError(f"training_length: must be >= 2, got {self.training_length}")
            if self.rerope_window > self.training_length:
                raise ConfigError(
                    f"rerope_window: must be <= training_length ({self.training_length}), "
                    f"got {self.rerope_window}"
                )

    def resolved(self, max_position_embeddings: int) -> ReRoPEConfig:
        """A copy with ``training_length`` filled from the model (validated)."""
        if self.training_length is not None:
            return self
        return ReRoPEConfig(
            rerope_window=self.rerope_window,
            training_length=int(max_position_embeddings),
            log_n_scaling=self.log_n_scaling,
            always_on=self.always_on,
        )
