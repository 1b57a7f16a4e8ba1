"""VisionZip (docs/methods/visionzip.md): at the tower's output, keep the patches [CLS] attends to most
(dominant) and merge the rest into a few contextual tokens.

This module is its spec, its defaults (the official code's) and its schedule arithmetic; no torch.
Its tensor functions are in `ops`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ficoco.errors import FicocoError
from ficoco.methods.base import CLS_TO_PROJECTOR, ExtraMacs, MethodSpec, Need, Step, StepContext
from ficoco.methods.common import ALL_FAMILIES, EQUIVALENT, PER_ITEM, check_keep
from ficoco.methods.reads import DEFAULT_ATTENTION_SCORES, SCORES_CORRECTION

DOMINANT = 54  # dominant tokens without keep= (the README's 54 + 10)
CONTEXTUAL = 10  # contextual tokens without keep=
# The official contextual token: its target plus the mean of its members ("mean": ficoco's average of both).
CONTEXTUAL_MODE = "official"
# The official dominant tokens: [CLS] and the dominant - 1 top patches (False: ficoco's, dominant patches). Where
# the projector cannot take [CLS] (a tower without one, InternVL's pixel-shuffle groups, Video-LLaVA's [CLS] that
# reaches the LLM anyway) the dominant tokens are patches whatever this says.
INCLUDE_CLS = True
# ficoco's corrections of the official code, each a named value (MethodSpec.corrections): what a label says.
CORRECTIONS = {"contextual_mode": {"mean": "mean contextual token"}, "include_cls": {False: "[CLS] dropped"}}
# dominant + contextual of the literature's rows (LightCompress visionzip.yml; README 54 + 10).
VISIONZIP_SPLITS = {192: (162, 30), 128: (108, 20), 64: (54, 10)}


def visionzip_split(keep: int) -> tuple[int, int]:
    """(dominant, contextual) for `keep` tokens: the published splits, else the same 27:5 ratio."""
    if keep in VISIONZIP_SPLITS:
        return VISIONZIP_SPLITS[keep]
    contextual = round(keep * 5 / 32)
    return keep - contextual, contextual


def steps(settings: Mapping[str, Any], n_visual: int, n_layers: int) -> tuple[Step, ...]:
    """One cut at the tower's output: all but the dominant patches leave, the contextual tokens join. With [CLS]
    among the dominant tokens (the official layout, where the accountant says [CLS] reaches the projector:
    `CLS_TO_PROJECTOR`) only dominant - 1 patches stay, so a patch is left to merge even when dominant +
    contextual equal the patches, and the cut runs; without [CLS] every remaining patch is then a target and
    nothing merges: no cut."""
    dominant, contextual = settings["dominant"], settings["contextual"]
    if dominant < 1 or contextual < 0 or dominant + contextual > n_visual:
        raise FicocoError(f"VisionZip: {dominant} dominant + {contextual} contextual tokens do not fit the "
                          f"{n_visual} patches of an item (at least one dominant)")
    if contextual and n_visual - dominant < contextual:
        raise FicocoError(f"VisionZip: {contextual} contextual tokens need as many patches left after "
                          f"{dominant} dominant ones")
    removed = n_visual - dominant
    with_cls = bool(settings.get("include_cls", INCLUDE_CLS)) and bool(settings.get(CLS_TO_PROJECTOR, False))
    if removed == contextual and not with_cls:  # every remaining patch is a target: nothing merges, all are kept
        return ()
    return (Step(n_layers - 1, removed, contextual, "tower_output", "vision"),)


def settings_for_keep(keep: int | None, n_visual: int, n_layers: int, hp: Mapping[str, Any]) -> dict[str, Any]:
    """The dominant + contextual split of `keep` tokens; None: the official 54 + 10."""
    if keep is None:
        dominant, contextual = hp["dominant"], hp["contextual"]
    else:
        check_keep("VisionZip", keep, n_visual)
        dominant, contextual = visionzip_split(keep)
    return {"dominant": dominant, "contextual": contextual, "contextual_mode": hp["contextual_mode"],
            "include_cls": hp["include_cls"]}


def extra_macs(ctx: StepContext) -> ExtraMacs:
    """The [CLS] row (where the tower has one) and the contextual merge's similarities: with [CLS] among the
    dominant tokens (the official layout, where the projector can take it) one more patch is left to merge."""
    d, s = ctx.dims, ctx.settings
    with_cls = bool(s.get("include_cls", INCLUDE_CLS)) and ctx.cls_to_projector
    remaining = ctx.visual_before - s["dominant"] + int(with_cls)
    cls_row = [(ctx.step.layer, "visionzip_vision_cls_row", d.heads * d.head_dim * ctx.seq_before)] if ctx.has_cls \
        else []
    # Cosine of every non-target remaining patch (merge group) with every target, head-mean keys.
    return cls_row + [(ctx.step.layer, "visionzip_vision_contextual_similarity",
                       (remaining - s["contextual"]) * s["contextual"] * d.head_dim)]


SPEC = MethodSpec(
    name="visionzip", title="VisionZip", acts_at="vision_layer", placement="tower_output", positions="grid",
    needs=(Need("attention_rows", "vision L", "cls", "the [CLS] query's softmax over every key of the layer the "
                "projector reads, per head (q_cls from q_proj, K from k_proj)"),
           Need("keys", "vision L", "all", "head-mean key states of that layer (the contextual merge metric)"),
           Need("hidden", "vision L", "all", "that layer's output, the projector's input")),
    hyperparameters={"dominant": DOMINANT, "contextual": CONTEXTUAL, "contextual_mode": CONTEXTUAL_MODE,
                     "include_cls": INCLUDE_CLS, "attention_scores": DEFAULT_ATTENTION_SCORES},
    corrections={**CORRECTIONS, **SCORES_CORRECTION},
    families=ALL_FAMILIES, module=f"{__name__}.ops", function="visionzip_reduce",
    source="dvlab-research/VisionZip 3151f6d",
    summary="keep the patches [CLS] attends to most, merge the rest into a few contextual tokens",
    keep_means=PER_ITEM + " (dominant + contextual: 162+30, 108+20, 54+10)", cls_note=EQUIVALENT,
    steps=steps, settings_for_keep=settings_for_keep, extra_macs=extra_macs, wired=True, merges_by_keys=True,
)
