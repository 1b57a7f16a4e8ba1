"""PruMerge+ (docs/methods/prumerge.md): at the tower's output, keep the IQR-outlier and spatially
sampled patches by [CLS] attention and merge their key-nearest neighbours into them.

This module is its spec, its defaults (the official code's) and its schedule arithmetic; no torch.
Its tensor functions are in `ops`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ficoco.errors import FicocoError
from ficoco.methods.base import ExtraMacs, MethodSpec, Need, Step, StepContext
from ficoco.methods.common import LLAVA_FAMILIES
from ficoco.methods.reads import DEFAULT_ATTENTION_SCORES, SCORES_CORRECTION

# Without keep= the count is adaptive (per image, measured at run time); the plan assumes this many, about
# 144 on LLaVA-1.5 (an unverified recollection, docs/methods/prumerge.md).
ASSUMED_TOKENS = 144
NEIGHBOURS = 32  # key-nearest neighbours merged into each kept patch
# How the [CLS] attention is read: the official single head as wide as the layer (q . k of the raw projections,
# scaled by 1 / sqrt(width)); "heads": ficoco's correction, the layer's own heads, their mean.
ATTENTION = "official"
# The kept patches' order: the official priority (outliers by score, then the spatial samples); "spatial":
# ficoco's correction, image order.
ORDER = "official"
CORRECTIONS = {"attention": {"heads": "attention over heads"}, "order": {"spatial": "spatial order"}}

# Why a family does not run it (MethodSpec.refusals; `ficoco methods --matrix` prints them).
# One line for every Qwen family (Qwen2-VL's parts): their packed towers and 3-D positions are alike.
QWEN_REFUSAL = ("not wired: PruMerge+'s extra token (the sum of the patches it did not keep) stands at no merge "
                "group, so the Qwen families' 3-D positions give it no place; whole groups without it would be "
                "another method")
ONEVISION_REFUSAL = ("not wired: PruMerge+ picks IQR outliers of [CLS]'s softmax attention and weighs the patches "
                     "it merges by it; SigLIP has no [CLS], and FiCoCo's equivalent token gives a signed cosine, "
                     "not weights that sum to one, so the kept and merged tokens would not be PruMerge+'s")


def steps(settings: Mapping[str, Any], n_visual: int, n_layers: int) -> tuple[Step, ...]:
    """One cut at the tower's output: the kept patches absorb their neighbours; the extra token sums the
    patches that were not kept."""
    tokens = settings["tokens"]
    if not 2 <= tokens <= n_visual + 1:
        raise FicocoError(f"PruMerge+ hands the LLM 2..{n_visual + 1} tokens per item (kept patches and one extra "
                          f"token); got {tokens}")
    kept = tokens - 1
    return (Step(n_layers - 1, n_visual - kept, 1, "tower_output", "vision"),)


def settings_for_keep(keep: int | None, n_visual: int, n_layers: int, hp: Mapping[str, Any]) -> dict[str, Any]:
    """A fixed count of `keep` tokens per item, the extra one included; None: adaptive, planned at
    `assumed_tokens`."""
    if keep is None:
        # Adaptive: the count depends on each image and is measured at run time; the plan assumes
        # `assumed_tokens`. At most the item's patches: the prompt's span of placeholders is shortened,
        # never lengthened.
        tokens = min(hp["assumed_tokens"], n_visual)
        return {"adaptive": True, "tokens": tokens, "neighbours": hp["neighbours"], "attention": hp["attention"],
                "order": hp["order"]}
    if not 2 <= keep <= n_visual + 1:
        raise FicocoError(f"PruMerge+ hands the LLM 2..{n_visual + 1} tokens per item; keep={keep} is outside")
    return {"adaptive": False, "tokens": keep, "neighbours": hp["neighbours"], "attention": hp["attention"],
            "order": hp["order"]}


def extra_macs(ctx: StepContext) -> ExtraMacs:
    """The [CLS] row, the kept patches' key similarities, their neighbours' sums and the extra token (the sums
    over units as wide as the projector reads them: InternVL's pixel-shuffle groups, 4 patches side by side)."""
    d, s = ctx.dims, ctx.settings
    kept = s["tokens"] - 1
    layer = ctx.step.layer
    width = ctx.unit_width or d.hidden
    return [(layer, "prumerge_vision_cls_row", d.hidden * ctx.seq_before),
            (layer, "prumerge_vision_key_similarity", kept * ctx.visual_before * d.hidden),
            (layer, "prumerge_vision_neighbour_sums", kept * min(s["neighbours"], ctx.visual_before - 1) * width),
            (layer, "prumerge_vision_extra_token", ctx.visual_before * width)]


SPEC = MethodSpec(
    name="prumerge", title="PruMerge+", acts_at="vision_layer", placement="tower_output", positions="grid",
    needs=(Need("query_key", "vision last", "cls", "the last tower layer's q_proj (the [CLS] row) and k_proj "
                "(every row) outputs: the [CLS] attention and the full-width merge keys"),
           Need("hidden", "vision L", "all", "the output of the layer the projector reads")),
    hyperparameters={"assumed_tokens": ASSUMED_TOKENS, "neighbours": NEIGHBOURS, "attention": ATTENTION,
                     "order": ORDER, "attention_scores": DEFAULT_ATTENTION_SCORES},
    corrections={**CORRECTIONS, **SCORES_CORRECTION},
    families=(*LLAVA_FAMILIES, "internvl"), module=f"{__name__}.ops", function="prumerge_reduce",
    refusals={"llava_onevision": ONEVISION_REFUSAL,
              **dict.fromkeys(("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5"), QWEN_REFUSAL)},
    source="42Shawn/LLaVA-PruMerge 097c041",
    summary="keep IQR-outlier and spatially sampled patches, merge their key-nearest neighbours into them",
    keep_means="tokens per item that reach the LLM, one extra token included (fixed count; without keep="
               "the count is adaptive, planned at assumed_tokens and measured at run time)",
    steps=steps, settings_for_keep=settings_for_keep, extra_macs=extra_macs, wired=True,
)
