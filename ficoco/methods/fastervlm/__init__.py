"""FasterVLM (docs/methods/fastervlm.md): after the projector, keep the projected patches [CLS] attends to
most, in image order.

This module is its spec, its defaults (the paper's) and its schedule arithmetic; no torch. Its
tensor functions are in `ops`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ficoco.methods.base import ExtraMacs, MethodSpec, Need, StepContext
from ficoco.methods.common import ALL_FAMILIES, EQUIVALENT, PER_ITEM, check_keep, cut_steps
from ficoco.methods.reads import DEFAULT_ATTENTION_SCORES, SCORES_CORRECTION

RATIO = 0.75  # the share of the patches dropped without keep= (the paper's 75 % row: 144 of 576)

steps = cut_steps("FasterVLM", "after_projector")


def settings_for_keep(keep: int | None, n_visual: int, n_layers: int, hp: Mapping[str, Any]) -> dict[str, Any]:
    """`keep` patches per item; None: the paper's 75 % row."""
    if keep is None:  # the paper's 75 % row (144 of 576)
        keep = max(1, round(n_visual * (1 - hp["ratio"])))
    check_keep("FasterVLM", keep, n_visual)
    return {"keep": keep}


def extra_macs(ctx: StepContext) -> ExtraMacs:
    """The [CLS] row of the layer the projector reads (none on a tower without [CLS])."""
    d = ctx.dims
    return [(ctx.step.layer, "fastervlm_vision_cls_row", d.heads * d.head_dim * ctx.seq_before)] if ctx.has_cls else []


SPEC = MethodSpec(
    name="fastervlm", title="FasterVLM", acts_at="after_projector", placement="after_projector",
    positions="grid",
    needs=(Need("attention_rows", "vision L", "cls", "the [CLS] query's softmax over every key of the layer the "
                "projector reads, head mean"),
           Need("hidden", "projector", "all", "the projector's output, every patch")),
    hyperparameters={"ratio": RATIO,
                     "attention_scores": DEFAULT_ATTENTION_SCORES},
    corrections=SCORES_CORRECTION,
    families=ALL_FAMILIES, module=f"{__name__}.ops", function="fastervlm_reduce",
    source="Theia-4869/FasterVLM f5d5f12",
    summary="keep the projected patches [CLS] attends to most, in image order",
    keep_means=PER_ITEM, cls_note=EQUIVALENT,
    steps=steps, settings_for_keep=settings_for_keep, extra_macs=extra_macs, wired=True,
)
