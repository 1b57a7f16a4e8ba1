"""FiCoCo-V's and -L's own work at a reducing layer, as formulas (no torch): the hooks their
registry entries set as `paper_overhead` and `layer_macs`.

`paper_overhead` is the FiCoCo appendix's overhead formula as printed (MAC-style units,
elementwise terms included): the `paper` convention adds it at every in-layer reduction.
`layer_macs` is the method's matrix products as ficoco.methods.ficoco_v / ficoco_l compute them
(multiply-accumulates): what `--verify` checks against fvcore's and torch's counts per layer.
"""

from __future__ import annotations

from ficoco.methods.base import LayerWork


def paper_overhead(stage: str, visual: int, removed: int, dim: int) -> int:
    """The appendix's cost of one reducing layer (stage "vision": FiCoCo-V, "llm": FiCoCo-L) that
    removes `removed` of `visual` tokens of width `dim`: N^2 + 2N + N_S(N_T + 2D + 1) + D, the
    first term doubled in the decoder (the indirect, task-guided correlation)."""
    kept = visual - removed
    quadratic = visual * visual + 2 * visual
    if stage == "llm":
        quadratic *= 2
    return quadratic + removed * (kept + 2 * dim + 1) + dim


def layer_macs(work: LayerWork) -> int:
    """The compress step's matrix products at one reducing layer, over all its items: kept x removed
    similarities of width D (Qwen2-VL folds merge groups: (kept / m) * (removed / m) * (m * D)), and
    in the decoder the indirect correlation through the suffix tokens, removed x suffix x kept."""
    kept = work.visual_before - work.removed
    if work.stage == "vision":
        return work.items * kept * work.removed * work.dim // work.merge
    return work.items * (kept * work.removed * work.dim + work.removed * work.suffix_tokens * kept)
