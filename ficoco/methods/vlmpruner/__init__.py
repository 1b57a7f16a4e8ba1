"""VLM-Pruner (docs/methods/vlmpruner.md): at the input of decoder layer K, keep pivot tokens and grow the kept
set outward from them, a batch of the least duplicated candidates at a time under a spatially buffered
similarity (BSS), then fold every discarded token into its most similar kept one (SWA).

This module is its spec, its defaults (the official code's) and its schedule arithmetic; no torch. Its tensor
functions are in `ops`. Official code: Casey-bit's VLM-Pruner at 556a914, read in the fork xipingyan/VLMPruner
@ 2eb1965 (the fork's two commits change paths and a crash, not the selection):
llava/model/language_model/modeling_llama_self.py:331-362 (the step), :399-521 (the rule);
Qwen2-VL/Qwen2VL_VLMPruner/modeling_qwen2_vl_self.py:335-365, :406-521.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ficoco.errors import FicocoError
from ficoco.methods.base import ExtraMacs, MethodSpec, Need, Step, StepContext
from ficoco.methods.common import ALL_FAMILIES, check_keep, check_layer

LAYER = 2  # K (--pruned_layer 2): the step runs at layer K's input, from layer K-1's keys and output
REDUCTION_RATIO = 0.778  # --reduction_ratio's default (llava/eval/model_vqa_loader.py:178): 128 of 576 kept
# How the default row's budget R = N (1 - ratio) is made whole: round() in the LLaVA code (:421); "int": the
# Qwen2-VL code's int() (modeling_qwen2_vl_self.py:430), which keeps one token fewer where the share's fraction
# is at least one half.
BUDGET_ROUNDING = "round"
BUDGET_ROUNDINGS = ("round", "int")
PIVOT_IMAGE_TOKEN = 4  # pivots: the largest key L1 norm, then farthest-point sampling on the keys
THRESHOLD = 0.8  # the first round's similarity threshold; every later round raises it by 0.1
TOKEN_BATCH = 16  # candidates taken per batch, their similarities recomputed against the kept set
CHANNELS = 256  # the highest-variance channels of layer K-1's output the cosine similarity reads (:444)
# Where BSS places every token: "official", as the official code reads a width (LLaVA: 24, its CLIP item's patch
# grid; Qwen2-VL: image_grid_thw's width, the tower's patch grid before the 2x2 merge), the image's placeholders
# laid out in rows of the tower's patch-grid width and normalised by that grid's diagonal; "tokens" (ficoco's
# correction): every image, packed crop grid, tile and frame on its own grid of LLM tokens.
BSS_GRID = "official"
BSS_GRIDS = ("official", "tokens")
CORRECTIONS = {"bss_grid": {"tokens": "token grids"}}
# SWA's weights: a kept token becomes KEPT_SHARE of itself plus the rest of its members' weighted mean (:513).
KEPT_SHARE = 0.3


def retained(settings: Mapping[str, Any], n_visual: int) -> int:
    """R: the visual tokens the step keeps at most (its selection may end with fewer, measured at run time)."""
    return int(settings["keep"])


def steps(settings: Mapping[str, Any], n_visual: int, n_layers: int) -> tuple[Step, ...]:
    """One step at layer K removing all but R visual tokens."""
    layer, keep = settings["layer"], retained(settings, n_visual)
    check_layer("VLM-Pruner", layer, n_layers)
    check_keep("VLM-Pruner", keep, n_visual)
    return (Step(layer, n_visual - keep),) if keep < n_visual else ()


def settings_for_keep(keep: int | None, n_visual: int, n_layers: int, hp: Mapping[str, Any]) -> dict[str, Any]:
    """R = `keep` visual tokens from layer K on (the literature's rows: the official scripts' reduction ratios
    0.667 / 0.778 / 0.889 keep 192 / 128 / 64 of LLaVA-1.5's 576); None: the official default ratio, R =
    round(N (1 - ratio)). The count is adaptive: a round that accepts nothing ends the selection early."""
    layer = hp["layer"]
    check_layer("VLM-Pruner", layer, n_layers)
    if hp["budget_rounding"] not in BUDGET_ROUNDINGS:
        raise FicocoError(f"VLM-Pruner budget_rounding={hp['budget_rounding']!r}: give one of "
                          f"{', '.join(BUDGET_ROUNDINGS)}")
    if keep is None:
        share = n_visual * (1 - hp["reduction_ratio"])
        keep = round(share) if hp["budget_rounding"] == "round" else int(share)
    check_keep("VLM-Pruner", keep, n_visual)
    if keep < hp["pivot_image_token"]:
        raise FicocoError(f"VLM-Pruner keeps its {hp['pivot_image_token']} pivots whatever the budget: keep={keep} "
                          "is below them; give at least as many")
    for name in ("token_batch", "channels", "pivot_image_token"):
        if hp[name] < 1:
            raise FicocoError(f"VLM-Pruner {name}={hp[name]} must be at least 1")
    return {"layer": layer, "keep": keep, "pivot_image_token": hp["pivot_image_token"],
            "threshold": hp["threshold"], "token_batch": hp["token_batch"], "channels": hp["channels"],
            "adaptive": True}


def extra_macs(ctx: StepContext) -> ExtraMacs:
    """The pivots' key distances (one product of every key with each of the first P - 1 pivots, its running
    minimum kept), the cosine of every pair on the highest-variance channels, the grid positions' pairwise
    distances (one product of 2-wide positions), and SWA's weighted sums of the discarded tokens into the kept
    ones (a dense product, as the official torch.mm). The greedy rounds only index those matrices and scale
    them elementwise: no matrix work."""
    s, d = ctx.settings, ctx.dims
    n = ctx.visual_before
    kept = n - ctx.step.remove
    pivots = int(s.get("pivot_image_token", PIVOT_IMAGE_TOKEN))
    channels = min(int(s.get("channels", CHANNELS)), d.hidden)
    layer = ctx.step.layer - 1
    return [(layer, "vlmpruner_pivot_key_distances", max(0, pivots - 1) * n * d.kv_heads * d.head_dim),
            (layer, "vlmpruner_channel_cosine", n * n * channels),
            (layer, "vlmpruner_grid_distances", n * n * 2),
            (layer, "vlmpruner_swa_merge", (n - kept) * kept * d.hidden)]


SPEC = MethodSpec(
    name="vlmpruner", title="VLM-Pruner", acts_at="llm_layer", placement="layer_input", positions="original",
    needs=(Need("keys", "L-1", "all", "post-RoPE key states of layer K-1, heads concatenated: the pivots (L1 norm, "
                "farthest-point sampling)"),
           Need("hidden", "L-1", "all", "the output of layer K-1 (the input of layer K): the cosine on its "
                "highest-variance channels, and the states SWA folds"),
           Need("grid", "embeddings", "all", "where every visual token stands on its image's grid: BSS's "
                "spatial buffer")),
    hyperparameters={"layer": LAYER, "reduction_ratio": REDUCTION_RATIO, "budget_rounding": BUDGET_ROUNDING,
                     "pivot_image_token": PIVOT_IMAGE_TOKEN, "threshold": THRESHOLD, "token_batch": TOKEN_BATCH,
                     "channels": CHANNELS, "bss_grid": BSS_GRID},
    corrections=CORRECTIONS,
    families=ALL_FAMILIES, module=f"{__name__}.ops", function="vlmpruner_reduce",
    source="Casey-bit VLM-Pruner 556a914 (read in xipingyan/VLMPruner 2eb1965)",
    summary="pivots by key norm and farthest points, then the least duplicated tokens under a spatially "
            "buffered similarity in growing rounds; discarded tokens folded into their most similar kept one",
    keep_means="visual tokens kept from layer K on, at most (the selection may end with fewer: measured)",
    steps=steps, settings_for_keep=settings_for_keep, extra_macs=extra_macs, wired=True, folds_removed=True,
)
