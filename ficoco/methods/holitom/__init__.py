"""HoliTom (docs/methods/holitom.md): segment a video's frames by temporal redundancy, merge static tokens
over each segment and cluster each frame's tokens after the projector; inside the LLM, merge half the
visual tokens into the most attended ones at layer 18.

This module is its two specs (the cut after the projector, and its `inner` part in the decoder), its
defaults (the official README's run) and its schedule arithmetic; no torch. Its tensor functions
are in `ops`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from ficoco.errors import FicocoError
from ficoco.methods.base import ExtraMacs, MethodSpec, Need, Step, StepContext
from ficoco.methods.common import LAST_ROW, check_keep
from ficoco.methods.reads import DEFAULT_ATTENTION_SCORES, SCORES_CORRECTION, ReadContext, ReadShape

RETAIN_RATIO = 0.10  # RETAIN_RATIO of every frame's tokens (default 0.10; the paper's rows 25/15/10 %)
TAU = 0.8  # T: the temporal-redundancy threshold of the segmentation
BETA = 0.6
NEIGHBOURS = 7  # DPC-kNN's k
CONTEXTUAL_SHARE = 0.0
MAX_WINDOW = 1024
MERGE_LAYER = 18  # HOLITOM_k: the decoder layer of the inner merge
MERGE_RATIO = 0.5  # HOLITOM_r: the share of the visual tokens merged there
FAMILIES = ("video_llava", "llava_onevision", "qwen2_vl", "qwen2_5_vl")

# HoliTom's cells outside its families: one line each on why (LLaVA-OneVision runs it on videos, after the
# 2x2 pooling of every frame, as the official code does on OneVision / LLaVA-Video).
# Qwen3.5 lays a video out as one span per temporal slice, each after its timestamp text; HoliTom's cut of a
# video's slices together (one span per video) is not wired into that layout.
QWEN3_5_REFUSAL = ("not wired: Qwen3.5 lays a video out as one placeholder span per temporal slice, each after its "
                   "timestamp text, and HoliTom's cut and inner merge read a video as one span; run it on Qwen2-VL "
                   "or LLaVA-OneVision")
IMAGE_ONLY_REFUSAL = ("a video method: its temporal segmentation and merging need a video's frames, and this family "
                      "takes images (an image is one frame)")
# Qwen3-VL adds DeepStack's features (from earlier tower layers) to the tokens HoliTom hands the decoder.
DEEPSTACK_REFUSAL = ("not wired: HoliTom merges a video's tokens by the similarity of the very features it merges "
                     "and hands back no weights, so Qwen3-VL's DeepStack features (added to those tokens in the "
                     "first decoder layers) cannot be merged as its tokens were")


def steps(settings: Mapping[str, Any], n_visual: int, n_layers: int) -> tuple[Step, ...]:
    """One cut after the projector keeping `keep` tokens per frame on average."""
    keep = settings["keep"]
    check_keep("HoliTom", keep, n_visual)
    return (Step(n_layers - 1, n_visual - keep, 0, "after_projector", "vision"),) if keep < n_visual else ()


def settings_for_keep(keep: int | None, n_visual: int, n_layers: int, hp: Mapping[str, Any]) -> dict[str, Any]:
    """`keep` tokens per frame; None: the official RETAIN_RATIO of every frame's tokens."""
    if keep is None:  # the official RETAIN_RATIO of every frame's tokens (default 0.10; the paper's rows 25/15/10 %)
        keep = max(1, math.ceil(n_visual * hp["retain_ratio"] - 1e-9))
    check_keep("HoliTom", keep, n_visual)
    return {"keep": keep, **{name: hp[name] for name in ("tau", "beta", "neighbours", "contextual_share",
                                                         "max_window", "merge_layer", "merge_ratio")}}


def inner_steps(settings: Mapping[str, Any], n_visual: int, n_layers: int) -> tuple[Step, ...]:
    """The inner-LLM merge on the `n_visual` tokens the outer part handed the LLM."""
    ratio = settings["merge_ratio"]
    if not 0 <= ratio < 1:
        raise FicocoError(f"HoliTom: merge_ratio {ratio} is outside [0, 1) (the share of visual tokens merged "
                          "inside the LLM)")
    keep = max(1, round(n_visual * (1 - ratio)))
    # The official HOLITOM_k (18, a layer every 7B decoder has); a shallower decoder merges at its last layer.
    layer = min(settings["merge_layer"], n_layers - 1)
    return (Step(layer, n_visual - keep),) if keep < n_visual else ()


def inner_extra_macs(ctx: StepContext) -> ExtraMacs:
    """The last row's scores of layer K-1 and the merge's similarities at layer K."""
    d = ctx.dims
    kept = ctx.visual_before - ctx.step.remove
    return [(ctx.step.layer - 1, "holitom_last_row_scores", d.heads * d.head_dim * ctx.seq_before),
            # Cosine of every merged visual token with every kept one (the layer's input).
            (ctx.step.layer, "holitom_merge_similarity", ctx.step.remove * kept * d.hidden)]


def extra_macs(ctx: StepContext) -> ExtraMacs:
    """Per video (``extra_per_sample``): the work on its ``items`` frames of ``visual_before`` projected
    tokens of width ``projected_width``, as the batched module runs it (every frame slot, masked)."""
    frames, tokens, width, layer = ctx.items, ctx.visual_before, ctx.projected_width, ctx.step.layer
    rows = [(layer, "holitom_frame_similarity", (frames - 1) * tokens * width),
            # DPC-kNN distances of the static tokens of every window that can start at a frame (not the last).
            (layer, "holitom_static_cluster_distances", (frames - 1) * tokens * tokens * width)]
    if ctx.settings["contextual_share"] > 0:
        rows.append((layer, "holitom_contextual_cluster_distances", frames * tokens * tokens * width))
    return [row for row in rows if row[2]]


INNER = MethodSpec(
    name="holitom", title="HoliTom", acts_at="llm_layer", placement="layer_input", positions="original",
    needs=(Need("attention_rows", "L-1", "last", "softmax over all keys of layer K-1, head mean, of " + LAST_ROW),
           Need("hidden", "L", "all", "the input of layer K (the merge's cosine similarities)")),
    hyperparameters={"merge_layer": MERGE_LAYER, "merge_ratio": MERGE_RATIO},
    families=FAMILIES,
    module=f"{__name__}.ops", function="step", source="cokeshao/HoliTom e5f7da2 (holitom/modeling_qwen2.py)",
    summary="keep the visual tokens the last prompt token attends to most, average the rest into their most "
            "similar kept token", keep_means="the share merge_ratio of the visual tokens merged at merge_layer",
    steps=inner_steps, extra_macs=inner_extra_macs, wired=True,
)

def reads(ctx: ReadContext) -> tuple[ReadShape, ...]:
    """What HoliTom reads of the attention of the layer the projector reads: what every patch receives,
    summed over every query (the column sums). Its merge inside the LLM reads the last row only (its
    `extra_macs`)."""
    return (("columns", ctx.tokens, ctx.tokens),) if ctx.stage == "vision" else ()


SPEC = MethodSpec(
    name="holitom", title="HoliTom", acts_at="after_projector", placement="after_projector", positions="grid",
    needs=(Need("attention_rows", "vision L", "all", "head-mean probabilities of every query over every key of the "
                "layer the projector reads: the mean attention each patch receives (queries and heads averaged)"),
           Need("hidden", "projector", "all", "the projector's output, every patch of every frame of a video "
                "together (the adapter groups a video's frames)")),
    hyperparameters={"retain_ratio": RETAIN_RATIO, "tau": TAU, "beta": BETA, "neighbours": NEIGHBOURS,
                     "contextual_share": CONTEXTUAL_SHARE, "max_window": MAX_WINDOW, "merge_layer": MERGE_LAYER,
                     "merge_ratio": MERGE_RATIO,
                     "attention_scores": DEFAULT_ATTENTION_SCORES},
    corrections=SCORES_CORRECTION, reads=reads,
    families=FAMILIES, module=f"{__name__}.ops",
    function="holitom_reduce",
    # Qwen2-VL and Qwen2.5-VL (issue 25) run it on videos: their temporal slices are the frames.
    refusals={"llava": IMAGE_ONLY_REFUSAL, "llava_next": IMAGE_ONLY_REFUSAL, "qwen3_vl": DEEPSTACK_REFUSAL,
              "qwen3_vl_moe": DEEPSTACK_REFUSAL, "qwen3_5": QWEN3_5_REFUSAL,
              "internvl": IMAGE_ONLY_REFUSAL}, pooled_grid=True,
    source="cokeshao/HoliTom b1d1412 (holitom/llava_arch.py, holitom/modeling_qwen2.py; README's run: "
           "RETAIN_RATIO T=0.80 HOLITOM_k=18 HOLITOM_r=0.5)",
    summary="segment a video's frames by global temporal redundancy, merge static tokens over each segment, "
            "keep each frame's most attended tokens and cluster the static ones (DPC-kNN); inside the LLM, "
            "merge half the visual tokens into the most attended ones at layer 18",
    keep_means="visual tokens per frame that reach the LLM, on average: a video hands on frames x keep tokens "
               "(Video-LLaVA's frame [CLS] and OneVision's newline apart; on OneVision keep counts the frame's "
               "pooled grid; on Qwen2-VL and Qwen2.5-VL a frame is one temporal slice of 2 frames (video_grid_thw's "
               "t) and keep counts its merge groups), spread over its segments and frames by HoliTom; inside the LLM "
               "merge_ratio of them merge into the rest at merge_layer",
    steps=steps, settings_for_keep=settings_for_keep, extra_macs=extra_macs, wired=True,
    extra_per_sample=True, inner=INNER,
)
