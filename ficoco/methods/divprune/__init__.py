"""DivPrune (docs/methods/divprune.md): after the projector, keep the projected patches of greatest
Max-Min cosine diversity, in image order.

This module is its spec, its defaults (the official code's) and its schedule arithmetic; no torch.
Its tensor functions are in `ops`.
"""

from __future__ import annotations

from ficoco.methods.base import ExtraMacs, MethodSpec, Need, StepContext
from ficoco.methods.common import ALL_FAMILIES, PER_ITEM, cut_steps, ratio_for_keep

RATIO = 0.098  # SUBSET_RATIO: the share of the patches kept without keep= (56 of 576)

steps = cut_steps("DivPrune", "after_projector")
settings_for_keep = ratio_for_keep("DivPrune", "ratio")


def extra_macs(ctx: StepContext) -> ExtraMacs:
    """1 - cos of every pair of projected tokens; the greedy Max-Min picks are comparisons (no MACs)."""
    tokens = ctx.visual_before
    return [(ctx.step.layer, "divprune_projected_cosine_distance", tokens * tokens * ctx.projected_width)]


SPEC = MethodSpec(
    name="divprune", title="DivPrune", acts_at="after_projector", placement="after_projector",
    positions="grid",
    needs=(Need("hidden", "projector", "all", "the projector's output, every patch"),),
    hyperparameters={"ratio": RATIO},
    families=ALL_FAMILIES, module=f"{__name__}.ops", function="divprune_reduce",
    source="vbdi/divprune 799e2d9",
    summary="keep the projected patches of greatest Max-Min cosine diversity, in image order",
    keep_means=PER_ITEM + " (default: SUBSET_RATIO 0.098, 56 of 576)",
    steps=steps, settings_for_keep=settings_for_keep, extra_macs=extra_macs, wired=True,
)
