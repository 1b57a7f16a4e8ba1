"""PixelPrune (docs/methods/pixelprune.md): before the vision tower, drop every merge group whose pixels the
LOCO-I prediction from its left, upper and upper-left neighbours reproduces (bit-identical by default).

This module is its spec, its defaults (the official code's: OPPO-Mente-Lab/PixelPrune a870e31, core.py:51-56,
methods/pred_2d.py:84-94) and its schedule arithmetic; no torch. Its tensor functions are in `ops`.

The count is the image's own, known once its pixels are read and before the tower runs: there is no token
budget. The accountant plans the content-free worst case, every group kept (a natural photo keeps nearly all),
and a run measures what each image kept (`measured`); --keep, --preset, --tflops and --schedule are refused in
one line (`budget_refusal`): a threshold chosen per budget would not be the official behaviour.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from ficoco.errors import FicocoError
from ficoco.methods.base import ExtraMacs, MethodSpec, Need, Step, StepContext

METRIC = "max"  # core.py:53-54: PIXELPRUNE_METRIC's default, the L-infinity distance
THRESHOLD = 0.0  # core.py:55-56: PIXELPRUNE_THRESHOLD's default, tau in [0, 1] pixel units (bit-identical)
ANCHORED = True  # pred_2d.py:92-93: PIXELPRUNE_ANCHORED's default (tau > 0 compares with the reconstruction)
METRICS = ("max", "exact", "mae", "rmse")  # pred_2d.py:49-61

# The families whose tower takes any subset of its merge groups: 2-D rotary positions and a packed sequence cut
# into images (Qwen3-VL's learned positions are resampled to the image's grid, then selected at the kept places).
QWEN_FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5")
# How each family's image processor normalises its pixels (mean, std per channel), which the selector undoes to
# read the image's [0, 1] pixels as the official code does (patches/qwen3_vl_hf.py:31-42: x * 0.5 + 0.5 on
# Qwen3-VL). Qwen2-VL's and Qwen2.5-VL's processors use OpenAI CLIP's; Qwen3-VL's and Qwen3.5's transformers'
# IMAGENET_STANDARD_MEAN / _STD (0.5 and 0.5). Read by ficoco's transformers adapters and its vLLM plugin alike.
CLIP_NORMALISATION = ((0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711))
HALF_NORMALISATION = ((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))
NORMALISATION = {"qwen2_vl": CLIP_NORMALISATION, "qwen2_5_vl": CLIP_NORMALISATION, "qwen3_vl": HALF_NORMALISATION,
                 "qwen3_vl_moe": HALF_NORMALISATION, "qwen3_5": HALF_NORMALISATION}
FIXED_GRID = ("a fixed-grid encoder (CLIP, SigLIP, InternViT): its learned absolute positions over one fixed square "
              "of patches need every patch, so patches removed before it would be another model (no official code)")
REFUSALS = dict.fromkeys(("llava", "llava_next", "video_llava", "llava_onevision", "internvl"), FIXED_GRID)
BUDGET_REFUSAL = ("PixelPrune has no token budget: every image keeps its own count, the merge groups its pixels' "
                  "LOCO-I prediction does not reproduce; run it without keep/preset/tflops/schedule, and set "
                  "threshold=TAU (pixel units, 0 by default) to drop near-identical groups too")


def check_settings(hp: Mapping[str, Any]) -> None:
    """Refuse a metric, threshold or anchored flag the official selector does not take, in one line."""
    if hp["metric"] not in METRICS:
        raise FicocoError(f"PixelPrune metric={hp['metric']!r}: choose from {', '.join(METRICS)}")
    threshold = hp["threshold"]
    if isinstance(threshold, bool) or not isinstance(threshold, int | float) or not math.isfinite(threshold) \
            or threshold < 0:
        raise FicocoError(f"PixelPrune threshold={threshold!r}: give a number >= 0 (pixel units in [0, 1]; "
                          "0 keeps every group that is not bit-identical to its prediction)")
    if not isinstance(hp["anchored"], bool):
        raise FicocoError(f"PixelPrune anchored={hp['anchored']!r}: give true or false")


def steps(settings: Mapping[str, Any], n_visual: int, n_layers: int) -> tuple[Step, ...]:
    """One cut at the tower's input (before tower layer 0) to the settings' `tokens` groups per image: the
    planned worst case (every group: no step), or the count a run measured."""
    tokens = settings["tokens"]
    if not 1 <= tokens <= n_visual:
        raise FicocoError(f"PixelPrune keeps 1..{n_visual} merge groups of an image (the first always stays); "
                          f"got {tokens}")
    return (Step(0, n_visual - tokens, 0, "tower_input", "vision"),) if tokens < n_visual else ()


def settings_for_keep(keep: int | None, n_visual: int, n_layers: int, hp: Mapping[str, Any]) -> dict[str, Any]:
    """The official setting, planned at the content-free worst case (every group kept: `tokens` = the image's
    groups; a run measures each image's own); a `keep` is refused (`BUDGET_REFUSAL`)."""
    if keep is not None:
        raise FicocoError(BUDGET_REFUSAL)
    check_settings(hp)
    return {"adaptive": True, "tokens": n_visual, "metric": hp["metric"], "threshold": hp["threshold"],
            "anchored": hp["anchored"]}


def extra_macs(ctx: StepContext) -> ExtraMacs:
    """None: the selector compares pixels (differences, absolute values, maxima, a where), no matrix product,
    so no convention counts a multiply-accumulate for it (its time is the profile's reduction stage)."""
    return []


SPEC = MethodSpec(
    name="pixelprune", title="PixelPrune", acts_at="vision_layer", placement="tower_input", positions="grid",
    needs=(Need("pixels", "tower input", "all", "every merge group's pixels: the processor's normalisation undone, "
                "the first frame of each patch, the group's 4 patches side by side"),),
    hyperparameters={"metric": METRIC, "threshold": THRESHOLD, "anchored": ANCHORED},
    families=QWEN_FAMILIES, module=f"{__name__}.ops", function="tower_step", refusals=REFUSALS,
    source="OPPO-Mente-Lab/PixelPrune a870e31",
    summary="before the tower, drop the merge groups whose pixels LOCO-I prediction from their neighbours "
            "reproduces (bit-identical by default)",
    keep_means="no budget: each image keeps its own count, known before the tower runs (planned at every group "
               "kept, measured at run time); keep, preset, tflops and schedule are refused",
    steps=steps, settings_for_keep=settings_for_keep, extra_macs=extra_macs, wired=True,
    budget_refusal=BUDGET_REFUSAL,
)
