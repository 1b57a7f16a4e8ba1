"""HiPrune (docs/methods/hiprune.md): after the projector, keep every item's anchor tokens (the most attended
patches of a middle tower layer), their buffer neighbours, and register tokens (the most attended of the rest in
the layer the projector reads), in image order; training-free, no text.

This module is its spec, its defaults (the official code's) and its schedule arithmetic; no torch. Its tensor
functions are in `ops`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ficoco.errors import FicocoError
from ficoco.methods.base import ExtraMacs, MethodSpec, Need, StepContext, TowerLayout
from ficoco.methods.common import ALL_FAMILIES, PER_ITEM, check_keep, cut_steps
from ficoco.methods.reads import DEFAULT_ATTENTION_SCORES, SCORES_CORRECTION, ReadContext, ReadShape

# The share of an item's units kept without keep=: HIPRUNE_QWEN_RETENTION's first row (README table), which is
# bench_llava.sh's HIPRUNE_RETENTION=192 of LLaVA-1.5's 576 patches once rounded.
RETENTION = 0.334
ALPHA = 0.1  # HIPRUNE_ALPHA: anchors are round(budget x alpha / 5), each with up to 4 buffers
# HIPRUNE_OBJECT_LAYER: "auto" picks the official layer for the tower (`object_layer_for`); an int is a 0-based
# tower layer (the official l = 9 is attentions[8]: object_layer=8).
OBJECT_LAYER = "auto"
# The official buffers: anchor +-1 and +-grid width, clamped to the item's first and last unit ("grid": ficoco's
# correction, only the neighbours inside the grid: no wrap across a row's end, none past an edge).
BUFFERS = "official"
BUFFER_RULES = ("official", "grid")
CORRECTIONS = {"buffers": {"grid": "buffers inside the grid"}}
# The official object layers (l, 1-based: attentions[l - 1]) and the tower depths they were set for: CLIP ViT-L
# (LLaVA-1.5, LLaVA-NeXT: bench_llava.sh) and Qwen2.5-VL's 32-block tower (bench_qwen.sh).
CLIP_OBJECT_LAYER, CLIP_DEPTH = 9, 24
QWEN_OBJECT_LAYER, QWEN_DEPTH = 16, 32
QWEN_FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5")


def anchor_count(keep: int, alpha: float) -> int:
    """Anchors of an item that keeps `keep` units: ``round(keep * alpha / 5)``, Python's rounding of the float, as
    the official code computes it (192 / 128 / 64 at alpha 0.1: 4 / 3 / 1)."""
    return round(keep * alpha / 5)


def object_layer_for(tower: TowerLayout) -> int:
    """The official object layer for `tower`, 0-based: l = 9 of CLIP's 24 layers (LLaVA-1.5, LLaVA-NeXT, and
    the towers of the other LLaVA-style families: Video-LLaVA's LanguageBind, OneVision's SigLIP, InternViT),
    l = 16 of Qwen2.5-VL's 32 blocks (every Qwen tower); a tower of another depth takes l at the same share of its
    depth, ``round(l * layers / depth)`` (at least 1), so Qwen3-VL-8B's 27 blocks take l = 14 (block 13). Where
    the tower attends within windows (Qwen2.5-VL), the nearest full-attention block (the lower on a tie), as the
    official default (block 15) is."""
    official, depth = (QWEN_OBJECT_LAYER, QWEN_DEPTH) if tower.family in QWEN_FAMILIES else \
        (CLIP_OBJECT_LAYER, CLIP_DEPTH)
    layer = min(tower.layers, max(1, round(official * tower.layers / depth))) - 1
    if layer not in tower.full_attention and tower.full_attention:
        layer = min(tower.full_attention, key=lambda full: (abs(full - layer), full))
    return layer


def tower_layers(tower: TowerLayout, settings: Mapping[str, Any]) -> dict[str, int]:
    """The object layer on `tower`: "auto" picks the official one (`object_layer_for`), a number is the 0-based
    tower layer given (checked against the tower by the accountant)."""
    value = settings.get("object_layer", OBJECT_LAYER)
    if value == OBJECT_LAYER:
        return {"object_layer": object_layer_for(tower)}
    try:
        if isinstance(value, bool) or float(value) != int(value):
            raise ValueError
        return {"object_layer": int(value)}
    except (TypeError, ValueError):
        raise FicocoError(f"HiPrune object_layer={value!r}: give a 0-based tower layer (the official "
                          "HIPRUNE_OBJECT_LAYER l is l - 1) or auto") from None


steps = cut_steps("HiPrune", "after_projector")


def settings_for_keep(keep: int | None, n_visual: int, n_layers: int, hp: Mapping[str, Any]) -> dict[str, Any]:
    """`keep` units per item (the official HIPRUNE_RETENTION divided by the items of the image: 640 over LLaVA-NeXT's
    five crops is keep=128); None: the official `retention` share of the item's units (192 of 576)."""
    if keep is None:
        keep = max(1, round(n_visual * float(hp["retention"])))
    check_keep("HiPrune", keep, n_visual)
    alpha = float(hp["alpha"])
    if not 0 <= alpha <= 1:
        raise FicocoError(f"HiPrune alpha={alpha:g} is outside 0..1 (the share of the budget anchors and buffers take)")
    anchors = anchor_count(keep, alpha)
    if 5 * anchors > keep:
        raise FicocoError(f"HiPrune: alpha={alpha:g} makes {anchors} anchors per item, whose anchors and buffers "
                          f"(up to {5 * anchors}) do not fit keep={keep}: give a smaller alpha or a larger keep")
    if hp["buffers"] not in BUFFER_RULES:
        raise FicocoError(f"HiPrune buffers={hp['buffers']!r}: give one of {', '.join(BUFFER_RULES)}")
    return {"keep": keep, "alpha": alpha, "object_layer": hp["object_layer"], "buffers": hp["buffers"]}


def extra_macs(ctx: StepContext) -> ExtraMacs:
    """None: HiPrune ranks, sorts and gathers (elementwise work no convention counts); its scores are the column
    sums of two tower layers' attention, which are its `reads`."""
    return []


def reads(ctx: ReadContext) -> tuple[ReadShape, ...]:
    """What every unit receives in the layer the projector reads (the deep score) and in the object layer (the
    object score): each a column sum over every query row of the item."""
    if ctx.stage != "vision":
        return ()
    return (("columns", ctx.tokens, ctx.tokens), ("columns", ctx.tokens, ctx.tokens, "object_layer"))


SPEC = MethodSpec(
    name="hiprune", title="HiPrune", acts_at="after_projector", placement="after_projector", positions="grid",
    needs=(Need("attention_rows", "vision L", "item", "head-mean probabilities of every query over every key of "
                "the layer the projector reads (LLaVA: attentions[-2], CLIP layer 22; Qwen: the last block), over "
                "the whole item: what each unit receives, the deep score the registers are ranked by"),
           Need("attention_rows", "vision named", "item", "the same of the object layer (HIPRUNE_OBJECT_LAYER l: "
                "attentions[l - 1]): the object score the anchors are ranked by", at="object_layer"),
           Need("hidden", "projector", "all", "the projector's output, every unit (all projected, then masked)")),
    hyperparameters={"retention": RETENTION, "alpha": ALPHA, "object_layer": OBJECT_LAYER, "buffers": BUFFERS,
                     "attention_scores": DEFAULT_ATTENTION_SCORES},
    corrections={**CORRECTIONS, **SCORES_CORRECTION},
    families=ALL_FAMILIES, module=f"{__name__}.ops", function="hiprune_select",
    source="Danielement321/HiPrune 6e83a12 (LLaVA/llava/model/llava_arch.py, Qwen2_5_VL/qwen2_5_vl_HiPrune.py)",
    summary="keep the most attended patches of a middle tower layer (anchors) with their neighbours (buffers), "
            "and the most attended of the rest in the layer the projector reads (registers)",
    keep_means=PER_ITEM + " (the official HIPRUNE_RETENTION over the image's items; default: 33.4 %)",
    steps=steps, settings_for_keep=settings_for_keep, extra_macs=extra_macs, reads=reads,
    tower_layers=tower_layers, wired=True,
)
