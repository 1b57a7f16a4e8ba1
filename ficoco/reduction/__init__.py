"""FiCoCo's algorithm as pure, batched tensor functions (no model classes)."""

from ficoco.reduction.ficoco_l import (
    LReduction,
    language_correlation,
    language_scores,
    reduce_l,
)
from ficoco.reduction.ficoco_v import (
    VReduction,
    equivalent_token_redundancy,
    local_penalty,
    reduce_v,
    vision_correlation,
    vision_scores,
)
from ficoco.reduction.stages import (
    adaptive_weights,
    compress,
    compute_dtype,
    gather_block,
    gather_tokens,
    main_targets,
    select,
)

__all__ = [
    "LReduction",
    "VReduction",
    "adaptive_weights",
    "compress",
    "compute_dtype",
    "equivalent_token_redundancy",
    "gather_block",
    "gather_tokens",
    "language_correlation",
    "language_scores",
    "local_penalty",
    "main_targets",
    "reduce_l",
    "reduce_v",
    "select",
    "vision_correlation",
    "vision_scores",
]
