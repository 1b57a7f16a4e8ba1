"""FlashVID (docs/methods/flashvid.md): after the projector, split a video's frames into segments by the
similarity of consecutive frames, keep each frame's most attended and diverse tokens (ADTS), merge the rest into
trees over time (TSTM) and cluster each frame's roots (DPC-kNN); inside the LLM, keep the visual tokens the last
prompt token attends to most at layer 20 (FastV's rule).

This module is its two specs (the cut after the projector, and its `inner` part in the decoder), its
defaults (the official `flashvid()` and scripts/*.sh) and its schedule arithmetic; no torch. Its tensor
functions are in `ops`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from ficoco.errors import FicocoError
from ficoco.methods.base import ExtraMacs, MethodSpec, Need, Step, StepContext
from ficoco.methods.common import LAST_ROW, QWEN3_VL_FAMILIES, check_keep
from ficoco.methods.reads import DEFAULT_ATTENTION_SCORES, SCORES_CORRECTION, ReadContext, ReadShape

# The official defaults (flashvid/__init__.py `flashvid()`, flashvid/configuration_flashvid.py, scripts/llava_ov.sh).
RETENTION_RATIO = 0.25  # r: the share of a frame's tokens the LLM keeps on average over its layers (0.10..0.25)
EXPANSION = 1.25  # the vision side keeps ceil(N * r * expansion) per frame, so that the layers average r
ALPHA = 0.7  # the share of a frame's budget ADTS selects (ceil); the rest is TSTM's
ADTS_V2 = "attn_div_v2"  # ADTS calibrated by [CLS] attention and event relevance (LLaVA-OneVision, LLaVA-Video)
ADTS_V1 = "attn_div"  # ADTS calibrated by [CLS] attention alone (the Qwen scripts)
SELECTIONS = (ADTS_V2, ADTS_V1)
TEMPORAL_THRESHOLD = 0.8  # tau_t: a token joins its most similar one of the previous frame above this cosine
SEGMENT_THRESHOLD = 0.9  # DySeg: a new segment where consecutive frames' mean features fall below this cosine
MIN_SEGMENT_NUM = 8  # DySeg: at least this many segments (more cuts at the lowest similarities)
PRUNING_LAYER = 20  # K: the decoder layer at whose input FastV's rule keeps llm_retention_ratio of the visual tokens
LLM_RETENTION_RATIO = 0.3
FAMILIES = ("video_llava", "llava_onevision", "qwen2_vl", "qwen2_5_vl", *QWEN3_VL_FAMILIES)

# The official scripts' values on the Qwen backbones (scripts/qwen2_5_vl.sh, scripts/qwen3_vl.sh); LLaVA-OneVision
# and LLaVA-Video (scripts/llava_ov.sh, llava_vid.sh) run `flashvid()`'s defaults. Qwen2-VL takes Qwen2.5-VL's,
# Qwen3-VL-MoE Qwen3-VL-8B's (the official code runs neither).
QWEN2_5_VL = {"token_selection_method": ADTS_V1, "min_segment_num": 4}
QWEN3_VL = {**QWEN2_5_VL, "pruning_layer": 28, "llm_retention_ratio": 0.1}
FAMILY_HYPERPARAMETERS = {"qwen2_vl": QWEN2_5_VL, "qwen2_5_vl": QWEN2_5_VL, "qwen3_vl": QWEN3_VL,
                          "qwen3_vl_moe": QWEN3_VL}

IMAGE_ONLY_REFUSAL = ("a video method: its segmentation and temporal merging need a video's frames, and this family "
                      "takes images (an image is one frame)")
# Qwen3.5 lays a video out as Qwen3-VL does (one span per temporal slice, after its timestamp), in a hybrid decoder.
QWEN3_5_REFUSAL = ("not wired: FlashVID's cut of a video's slices runs on Qwen3-VL's layout, and ficoco's Qwen3.5 "
                   "entry lays out images only (the official code runs Qwen3-VL); run it on Qwen3-VL or Qwen2.5-VL")

# The settings a schedule carries (what the models read): the per-frame budget and the rule's knobs.
_RIDING = ("alpha", "token_selection_method", "temporal_threshold", "segment_threshold", "min_segment_num",
           "pruning_layer", "llm_retention_ratio")


def adts_tokens(keep: int, alpha: float) -> int:
    """Tokens ADTS selects per frame: the official ``math.ceil(token_budget * alpha)`` (Python floats)."""
    return math.ceil(keep * alpha)


def check_settings(settings: Mapping[str, Any]) -> None:
    """Refuse, in one line each, knobs the official rule cannot run with."""
    if settings["token_selection_method"] not in SELECTIONS:
        raise FicocoError(f"FlashVID token_selection_method {settings['token_selection_method']!r}: choose "
                          f"{' or '.join(map(repr, SELECTIONS))} (ADTS v2 or v1)")
    if not 0 <= settings["alpha"] <= 1:
        raise FicocoError(f"FlashVID alpha {settings['alpha']} is outside [0, 1] (the share of a frame's budget ADTS "
                          "selects)")
    if not -1 <= settings["temporal_threshold"] < 1:
        raise FicocoError(f"FlashVID temporal_threshold {settings['temporal_threshold']} is outside [-1, 1) (the "
                          "cosine above which a token joins the previous frame's)")
    if settings["min_segment_num"] < 1:
        raise FicocoError(f"FlashVID min_segment_num {settings['min_segment_num']} must be at least 1")
    if not 0 < settings["llm_retention_ratio"] <= 1:
        raise FicocoError(f"FlashVID llm_retention_ratio {settings['llm_retention_ratio']} is outside (0, 1] (the "
                          "share of the visual tokens kept inside the LLM)")
    if settings["pruning_layer"] < 1:
        raise FicocoError(f"FlashVID pruning_layer {settings['pruning_layer']} must be at least 1 (it reads the "
                          "layer before)")


def steps(settings: Mapping[str, Any], n_visual: int, n_layers: int) -> tuple[Step, ...]:
    """One cut after the projector keeping `keep` tokens per frame on average."""
    keep = settings["keep"]
    check_keep("FlashVID", keep, n_visual)
    return (Step(n_layers - 1, n_visual - keep, 0, "after_projector", "vision"),) if keep < n_visual else ()


def settings_for_keep(keep: int | None, n_visual: int, n_layers: int, hp: Mapping[str, Any]) -> dict[str, Any]:
    """`keep` tokens per frame; None: the official ``ceil(N * retention_ratio * expansion)`` (utils.py L46)."""
    if keep is None:
        if not 0 < hp["retention_ratio"] <= 1 or hp["expansion"] <= 0:
            raise FicocoError(f"FlashVID retention_ratio {hp['retention_ratio']} and expansion {hp['expansion']}: "
                              "give a ratio in (0, 1] and a positive expansion")
        keep = min(n_visual, math.ceil(n_visual * hp["retention_ratio"] * hp["expansion"]))
    check_keep("FlashVID", keep, n_visual)
    settings = {"keep": keep, **{name: hp[name] for name in _RIDING}}
    check_settings(settings)
    return settings


def inner_steps(settings: Mapping[str, Any], n_visual: int, n_layers: int) -> tuple[Step, ...]:
    """FastV's rule inside the LLM on the `n_visual` tokens the outer part handed it: ``ceil(n * ratio)`` stay
    (utils.py L370) at the input of `pruning_layer` (a shallower decoder: its last layer)."""
    ratio = settings["llm_retention_ratio"]
    if not 0 < ratio <= 1:
        raise FicocoError(f"FlashVID llm_retention_ratio {ratio} is outside (0, 1] (the share of the visual tokens "
                          "kept inside the LLM)")
    keep = math.ceil(n_visual * ratio)
    layer = min(settings["pruning_layer"], n_layers - 1)
    return (Step(layer, n_visual - keep),) if keep < n_visual and layer >= 1 else ()


def inner_extra_macs(ctx: StepContext) -> ExtraMacs:
    """The last row of layer K-1 over every key, all heads (FastV's probe)."""
    d = ctx.dims
    return [(ctx.step.layer - 1, "flashvid_last_row_scores", d.heads * d.head_dim * ctx.seq_before)]


def extra_macs(ctx: StepContext) -> ExtraMacs:
    """Per video (``extra_per_sample``): the products on its ``items`` frames of ``visual_before`` projected
    tokens of width ``projected_width``, as the batched module runs them (every frame slot, masked):
    consecutive frame means' cosines (DySeg), every frame's token-token cosines (ADTS), their dot products with
    the segment's mean frame (ADTS v2), consecutive frames' token-token cosines (TSTM) and every frame's
    token-token distances (DPC-kNN)."""
    frames, tokens, width, layer = ctx.items, ctx.visual_before, ctx.projected_width, ctx.step.layer
    keep = tokens - ctx.step.remove
    adts = adts_tokens(keep, ctx.settings["alpha"])
    square = tokens * tokens * width
    rows = [(layer, "flashvid_segment_similarity", (frames - 1) * width)]
    if adts:
        rows.append((layer, "flashvid_adts_distances", frames * square))
        if ctx.settings["token_selection_method"] == ADTS_V2:
            rows.append((layer, "flashvid_event_relevance", frames * tokens * width))
    if keep > adts:  # TSTM and DPC-kNN share the rest of the budget
        rows += [(layer, "flashvid_temporal_similarity", (frames - 1) * square),
                 (layer, "flashvid_cluster_distances", frames * square)]
    return [row for row in rows if row[2]]


def reads(ctx: ReadContext) -> tuple[ReadShape, ...]:
    """What FlashVID reads of the attention of the tower layer the projector reads (the last): what every patch
    receives, summed over every query (the column sums). Its step inside the LLM reads one row (`extra_macs`)."""
    return (("columns", ctx.tokens, ctx.tokens),) if ctx.stage == "vision" else ()


INNER = MethodSpec(
    name="flashvid", title="FlashVID", acts_at="llm_layer", placement="layer_input", positions="original",
    needs=(Need("attention_rows", "L-1", "last", "softmax over all keys of layer K-1, head mean, of " + LAST_ROW
                + "; recomputed from post-RoPE q and k (the official code's FlashAttention path), so SDPA stays on"),
           Need("hidden", "L", "all", "the input of layer K")),
    hyperparameters={"pruning_layer": PRUNING_LAYER, "llm_retention_ratio": LLM_RETENTION_RATIO},
    families=FAMILIES, module=f"{__name__}.ops", function="step",
    source="Fanziyang-v/FlashVID 1d37422 (flashvid/utils.py fastv_prune, flashvid/modeling_qwen2.py)",
    summary="keep the visual tokens the last prompt token attends to most",
    keep_means="the share llm_retention_ratio of the visual tokens stays at pruning_layer",
    steps=inner_steps, extra_macs=inner_extra_macs, wired=True,
)

SPEC = MethodSpec(
    name="flashvid", title="FlashVID", acts_at="after_projector", placement="after_projector", positions="grid",
    needs=(Need("attention_rows", "vision L", "all", "head-mean probabilities of every query over every key of the "
                "tower layer the projector reads (the last): the mean attention each patch receives (queries and "
                "heads averaged; LLaVA-OneVision pools it 2x2 as the frame, Qwen averages a merge group's 4)"),
           Need("hidden", "projector", "all", "the projector's output, every token of every frame of a video "
                "together (the adapter groups a video's frames)")),
    hyperparameters={"retention_ratio": RETENTION_RATIO, "expansion": EXPANSION, "alpha": ALPHA,
                     "token_selection_method": ADTS_V2, "temporal_threshold": TEMPORAL_THRESHOLD,
                     "segment_threshold": SEGMENT_THRESHOLD, "min_segment_num": MIN_SEGMENT_NUM,
                     "pruning_layer": PRUNING_LAYER, "llm_retention_ratio": LLM_RETENTION_RATIO,
                     "attention_scores": DEFAULT_ATTENTION_SCORES},
    family_hyperparameters=FAMILY_HYPERPARAMETERS,
    corrections=SCORES_CORRECTION, reads=reads,
    families=FAMILIES, module=f"{__name__}.ops", function="flashvid_reduce",
    refusals={"llava": IMAGE_ONLY_REFUSAL, "llava_next": IMAGE_ONLY_REFUSAL, "internvl": IMAGE_ONLY_REFUSAL,
              "qwen3_5": QWEN3_5_REFUSAL},
    pooled_grid=True, features_follow_places=True,
    source="Fanziyang-v/FlashVID 1d37422 (flashvid/utils.py, flashvid/token_selection.py, flashvid/llava_arch.py, "
           "flashvid/modeling_qwen2_5_vl.py; scripts/*.sh: r 0.10-0.25, alpha 0.7, tau_t 0.8, expansion 1.25)",
    summary="segment a video by consecutive frames' similarity, keep each frame's most attended and diverse tokens "
            "(ADTS), merge the rest into trees over time and cluster each frame's roots (TSTM, DPC-kNN); inside "
            "the LLM, keep the visual tokens the last prompt token attends to most at layer 20",
    keep_means="visual tokens per frame that reach the LLM, on average: a video hands on frames x keep tokens "
               "(official: ceil(N x retention_ratio x expansion); Video-LLaVA's frame [CLS] and OneVision's newline "
               "apart; on OneVision keep counts the frame's pooled grid; on the Qwen families a frame is one temporal "
               "slice of 2 frames and keep counts its merge groups), ceil(alpha x keep) of every frame by "
               "ADTS and the rest by TSTM; inside the LLM llm_retention_ratio of them stay at pruning_layer",
    steps=steps, settings_for_keep=settings_for_keep, extra_macs=extra_macs, wired=True,
    extra_per_sample=True, inner=INNER,
)
