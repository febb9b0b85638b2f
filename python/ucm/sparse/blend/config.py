"""``ucm_sparse_config: {Blend: {...}}``: the CacheBlend parameters.

Every error names its key; :func:`ucm.sparse.factory.build_method_config`
prefixes it with ``ucm_sparse_config.Blend.``. Defaults: the CacheBlend
paper's recompute ratio (15 %), the original UCM example's check layer
(``model.layers.1``) and its hard-coded minimum of 16 chunk-block hits.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ucm.shared.config import ConfigError

#: Key of the explicit chunk list in a request's ``kv_transfer_params``:
#: ``[[start, end], ...]`` token spans (end exclusive) of the RAG chunks.
CHUNKS_PARAM = "ucm_blend_chunks"
#: Key of ``kv_transfer_params`` that marks a chunk-cache build request
#: (``True``): the prompt is one chunk served alone, hashed from the root.
BUILD_PARAM = "ucm_blend_build"


@dataclass
class BlendConfig:
    """Cache Blend (CacheBlend, EuroSys 2025): non-prefix KV reuse for RAG."""

    blend_recompute_ratio: float = 0.15
    """Share of the *reused* tokens of a request recomputed at the last check
    layer: the ``floor(ratio * n_reused)`` tokens whose keys deviate most.
    1.0 recomputes every token (equals a full prefill); 0.0 recomputes only
    the forced ones (missed chunks, the suffix)."""
    blend_check_layers: list[int] = field(default_factory=lambda: [1])
    """Layers where the high-KV-deviation selection runs (ascending). Layers
    before the first one run the full prefill. With several check layers the
    share narrows geometrically, ``ratio ** ((k + 1) / n)`` at the k-th, so
    the last one keeps ``ratio`` (CacheBlend's gradual filtering)."""
    chunk_end_token_id: int | None = None
    """Token that ends a RAG chunk: a chunk ends at a block whose last token
    is this id (clients pad chunks to a multiple of the block size). ``None``:
    chunks come only from ``kv_transfer_params['ucm_blend_chunks']``."""
    min_blend_hit_blocks: int = 16
    """Below this many chunk blocks found in the store the request falls back
    to ordinary prefix reuse (the original hard-codes 16)."""

    def __post_init__(self) -> None:
        r = self.blend_recompute_ratio
        if not (0.0 <= r <= 1.0):
            raise ConfigError(f"blend_recompute_ratio: must be in [0, 1], got {r}")
        if not self.blend_check_layers:
            raise ConfigError("blend_check_layers: must name at least one layer")
        for i, layer in enumerate(self.blend_check_layers):
            if layer < 0:
                raise ConfigError(f"blend_check_layers[{i}]: must be >= 0, got {layer}")
        if sorted(set(self.blend_check_layers)) != list(self.blend_check_layers):
            raise ConfigError(
                "blend_check_layers: must be strictly ascending without duplicates, "
                f"got {self.blend_check_layers}"
            )
        if self.chunk_end_token_id is not None and self.chunk_end_token_id < 0:
            raise ConfigError(f"chunk_end_token_id: must be >= 0, got {self.chunk_end_token_id}")
        if self.min_blend_hit_blocks < 1:
            raise ConfigError(
                f"min_blend_hit_blocks: must be >= 1, got {self.min_blend_hit_blocks}"
            )

    def check_layer_ratios(self) -> dict[int, float]:
        """Share of the reused tokens kept at each check layer (the last: the ratio)."""
        n = len(self.blend_check_layers)
        r = self.blend_recompute_ratio
        return {layer: r ** ((k + 1) / n) for k, layer in enumerate(self.blend_check_layers)}

    def validate_for_model(self, num_layers: int, source: str = "ucm_sparse_config.Blend") -> None:
        """Raises :class:`ConfigError` if a check layer is past the model's last layer."""
        for i, layer in enumerate(self.blend_check_layers):
            if layer >= num_layers:
                raise ConfigError(
                    f"{source}.blend_check_layers[{i}]: layer {layer} does not exist "
                    f"(the model has {num_layers} layers)"
                )
