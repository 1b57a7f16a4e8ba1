"""The method registry: one `MethodSpec` per method, and the arithmetic of its schedule.

Adding a method is adding its tensor module under ficoco/methods/ (the functions
ficoco.methods.contract names) and one entry here, or `register_method(spec)` from outside the
package; the CLI, the accountant and the report read the registry and name no method themselves.
Each entry is planned through its `planner` and states its defaults once, in its
`hyperparameters`. No torch is imported here (the accountant reads this module).

Settings follow each method's official code (../shared/BASELINES.md); where a paper's table
has no published setting, the rule used instead is stated in the entry.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from ficoco.errors import FicocoError
from ficoco.methods.base import Dims, ExtraMacs, MethodSpec, Need, Step, StepContext
from ficoco.methods.ficoco_costs import layer_macs as ficoco_layer_macs
from ficoco.methods.ficoco_costs import paper_overhead as ficoco_paper_overhead

LLAVA_FAMILIES = ("llava", "llava_next", "video_llava")
ALL_FAMILIES = ("llava", "llava_next", "qwen2_vl", "video_llava", "llava_onevision")
# Qwen2.5-VL runs every method Qwen2-VL runs (its adapter maps its tower's window order to grid order).
ALL_FAMILIES += ("qwen2_5_vl",)
# The families the entries that name this tuple are tested on (issue 25's matrix): written out, so that a
# family added to ALL_FAMILIES shows as refused ("not wired") for them until their tests run there.
TESTED_FAMILIES = ("llava", "llava_next", "qwen2_vl", "video_llava", "llava_onevision")
# PDrop and SparseVLM act in Qwen2-VL's decoder (3-D positions kept, no compaction), ToMe merges groups in its
# windowed tower in grid order: tested on Qwen2.5-VL too (issue 25).
TESTED_FAMILIES += ("qwen2_5_vl",)
# The rows the literature reports: "192 / 128 / 64 tokens" on LLaVA-1.5-7B.
PRESETS = (192, 128, 64)


def _check_layer(name: str, layer: int, n_layers: int, low: int = 1) -> None:
    if not low <= layer < n_layers:
        raise FicocoError(f"{name}: layer {layer} is outside the decoder's layers {low}..{n_layers - 1}")


def _check_keep(name: str, keep: int, n_visual: int) -> None:
    if not 1 <= keep <= n_visual:
        raise FicocoError(f"{name}: keep {keep} is outside 1..{n_visual}, the visual tokens the LLM receives")


# ---- FastV -----------------------------------------------------------------------------------------------------

def _fastv_steps(settings: Mapping[str, Any], n_visual: int, n_layers: int) -> tuple[Step, ...]:
    layer, keep = settings["layer"], settings["keep"]
    _check_layer("FastV", layer, n_layers)
    _check_keep("FastV", keep, n_visual)
    return (Step(layer, n_visual - keep),) if keep < n_visual else ()


def _fastv_for_keep(keep: int | None, n_visual: int, n_layers: int, hp: Mapping[str, Any]) -> dict[str, Any]:
    layer = hp["layer"]
    _check_layer("FastV", layer, n_layers)
    if keep is None:  # the official default: drop R of the image tokens (HF fork: round(N * (1 - R)))
        return {"layer": layer, "keep": max(1, round(n_visual * (1 - hp["ratio"])))}
    # The literature's "N tokens" row is the layer average: K layers at all N, L - K at k.
    kept = round((n_layers * keep - layer * n_visual) / (n_layers - layer))
    if kept < 1 or keep > n_visual:
        low = -(-(layer * n_visual + n_layers - layer) // n_layers)
        raise FicocoError(f"FastV at layer {layer} averages {low}..{n_visual} visual tokens over {n_layers} layers; "
                          f"keep={keep} is outside")
    return {"layer": layer, "keep": kept}


def _fastv_extra(ctx: StepContext) -> ExtraMacs:
    d = ctx.dims
    # q of the last prompt token against every key of layer K-1, all heads (the probe's one row).
    return [(ctx.step.layer - 1, "fastv_last_row_scores", d.heads * d.head_dim * ctx.seq_before)]


# ---- PDrop -----------------------------------------------------------------------------------------------------

# The official pyramid: stages after layers 7, 15, 23 (rank & drop at the input of 8, 16, 24), lambda 0.5.
PDROP_SPACINGS = (8, 4, 2, 1)


def _pdrop_layers(spacing: int, n_layers: int) -> tuple[int, ...]:
    return tuple(layer for layer in (spacing, 2 * spacing, 3 * spacing) if layer < n_layers)


def _pdrop_keeps(n_visual: int, ratio: float, stages: int) -> tuple[int, ...]:
    # keep = int(N * ratio_list[stage + 1]), counted from the original N (pdrop_rank_drop); at least one stays.
    return tuple(max(1, int(n_visual * ratio ** (k + 1))) for k in range(stages))


def _pdrop_steps(settings: Mapping[str, Any], n_visual: int, n_layers: int) -> tuple[Step, ...]:
    layers = tuple(settings["layers"])
    keeps = _pdrop_keeps(n_visual, settings["ratio"], len(layers))
    steps, current = [], n_visual
    for layer, keep in zip(layers, keeps, strict=True):
        _check_layer("PDrop", layer, n_layers)
        keep = min(keep, current)
        if keep < current:
            steps.append(Step(layer, current - keep))
        current = keep
    return tuple(steps)


def _layer_average(steps: tuple[Step, ...], n_visual: int, n_layers: int) -> float:
    by_layer = {s.layer: s for s in steps}
    total, current = 0, n_visual
    for layer in range(n_layers):
        if layer in by_layer:
            current += by_layer[layer].added - by_layer[layer].remove
        total += current
    return total / n_layers


def _pdrop_for_keep(keep: int | None, n_visual: int, n_layers: int, hp: Mapping[str, Any]) -> dict[str, Any]:
    if keep is None:
        layers = _pdrop_layers(hp["spacing"], n_layers)
        if not layers:
            raise FicocoError(f"PDrop's stages {hp['spacing']}, {2 * hp['spacing']}, {3 * hp['spacing']} lie beyond "
                              f"a {n_layers}-layer decoder; give keep= to plan a shorter pyramid")
        return {"layers": list(layers), "ratio": hp["ratio"]}
    _check_keep("PDrop", keep, n_visual)
    # The repo publishes no 192/128/64 settings (PyramidDrop issues #10, #27, #28). Rule used here: the
    # official equal stage spacing, the latest spacing of 8, 4, 2, 1 whose pyramid can average `keep`,
    # and the largest lambda whose layer average does not exceed `keep`.
    for spacing in PDROP_SPACINGS:
        layers = _pdrop_layers(spacing, n_layers)
        if not layers:
            continue

        def average(ratio: float, layers: tuple[int, ...] = layers) -> float:
            return _layer_average(_pdrop_steps({"layers": layers, "ratio": ratio}, n_visual, n_layers),
                                  n_visual, n_layers)

        if average(0.0) > keep:
            continue
        low, high = 0.0, 1.0
        if average(high) <= keep:
            low = high
        for _ in range(60):
            mid = (low + high) / 2
            low, high = (mid, high) if average(mid) <= keep else (low, mid)
        return {"layers": list(layers), "ratio": low}
    raise FicocoError(f"PDrop cannot average {keep} visual tokens on a {n_layers}-layer decoder: even stages at "
                      f"layers 1, 2, 3 keeping one token average more")


def _pdrop_extra(ctx: StepContext) -> ExtraMacs:
    d, layer, n = ctx.dims, ctx.step.layer, ctx.seq_before
    # The rank layer's own k over the whole entering sequence and q of the last instruction token
    # (the official code projects q for every row; one row is all the score reads).
    return [(layer, "pdrop_k_proj", n * d.hidden * d.kv_heads * d.head_dim),
            (layer, "pdrop_q_proj_last_row", d.hidden * d.heads * d.head_dim),
            (layer, "pdrop_last_row_scores", d.heads * d.head_dim * n)]


# ---- SparseVLM (v1.5) --------------------------------------------------------------------------------------------

# score.py of the v1.5 branch (96 from main): tokens kept after each of the layers 2, 6, 15.
SPARSEVLM_SCHEDULES = {192: (300, 200, 110), 128: (303, 110, 36), 96: (238, 48, 26), 64: (66, 30, 17)}


def sparsevlm_recycled(pruned: int, ratio: float = 0.3, divisor: int = 10) -> tuple[int, int]:
    """(pruned tokens that are recycled, clusters they are merged into): int(0.3 n) + 1 and int(p / 10) + 1."""
    recycled = min(pruned, int(ratio * pruned) + 1)
    return recycled, int(recycled / divisor) + 1


def _sparsevlm_steps(settings: Mapping[str, Any], n_visual: int, n_layers: int) -> tuple[Step, ...]:
    steps, current = [], n_visual
    for layer, keep in zip(settings["layers"], settings["keeps"], strict=True):
        if layer + 1 >= n_layers:  # pruning the output of the last layer changes nothing
            break
        if current < 2:
            break
        kept = min(keep, current - 1)  # k = min(schedule[layer], N_v - 1)
        pruned = current - kept
        _, clusters = sparsevlm_recycled(pruned, settings["recycle_ratio"], settings["cluster_divisor"])
        steps.append(Step(layer + 1, pruned, clusters))
        current = kept + clusters
    return tuple(steps)


def _sparsevlm_for_keep(keep: int | None, n_visual: int, n_layers: int, hp: Mapping[str, Any]) -> dict[str, Any]:
    keep = 192 if keep is None else keep
    if keep not in SPARSEVLM_SCHEDULES:
        raise FicocoError(f"SparseVLM's v1.5 schedules exist for {', '.join(map(str, SPARSEVLM_SCHEDULES))} tokens; "
                          f"keep={keep} has none (schedule= gives any)")
    return {"layers": list(hp["layers"]), "keeps": list(SPARSEVLM_SCHEDULES[keep]),
            "recycle_ratio": hp["recycle_ratio"], "cluster_divisor": hp["cluster_divisor"]}


def _sparsevlm_added(removed: int, settings: Mapping[str, Any]) -> int:
    # --schedule LAYER:REMOVED: the recycled clusters join at the same step, by the default rule.
    return sparsevlm_recycled(removed, settings["recycle_ratio"], settings["cluster_divisor"])[1]


def _sparsevlm_extra(ctx: StepContext) -> ExtraMacs:
    d, s = ctx.dims, ctx.settings
    rows: ExtraMacs = []
    if ctx.index == 0:
        # Raters: visual x text similarity of the input embeddings, once per prefill.
        rows.append((None, "sparsevlm_raters", ctx.visual_initial * ctx.suffix_tokens * d.hidden))
    recycled, clusters = sparsevlm_recycled(ctx.step.remove, s["recycle_ratio"], s["cluster_divisor"])
    sparse_layer = ctx.step.layer - 1
    rows += [
        # Attention rows of every suffix token (raters are a subset) over all keys of the sparse layer.
        (sparse_layer, "sparsevlm_rater_rows", ctx.suffix_tokens * ctx.seq_before * d.heads * d.head_dim),
        # DPC-kNN: pairwise distances among the recycled tokens.
        (sparse_layer, "sparsevlm_cluster_distances", recycled * recycled * d.hidden),
        # Cluster means: the (clusters x recycled) assignment times the recycled tokens.
        (sparse_layer, "sparsevlm_cluster_means", clusters * recycled * d.hidden),
    ]
    return rows


# ---- DART --------------------------------------------------------------------------------------------------------

def _dart_retained(settings: Mapping[str, Any], n_visual: int) -> int:
    pivots = settings["pivot_image"] + settings["pivot_text"]
    per_pivot = settings["max_num_trunction"] // pivots  # TOKEN_TOPK
    picks = min(n_visual - settings["pivot_image"], pivots * per_pivot)
    return settings["pivot_image"] + max(0, picks)


def _dart_steps(settings: Mapping[str, Any], n_visual: int, n_layers: int) -> tuple[Step, ...]:
    _check_layer("DART", settings["layer"], n_layers)
    if settings["pivot_image"] > n_visual:
        raise FicocoError(f"DART: {settings['pivot_image']} image pivots exceed the {n_visual} visual tokens")
    retained = _dart_retained(settings, n_visual)
    return (Step(settings["layer"], n_visual - retained),) if retained < n_visual else ()


def _dart_for_keep(keep: int | None, n_visual: int, n_layers: int, hp: Mapping[str, Any]) -> dict[str, Any]:
    # The official scripts pass (reduction_ratio, max_num_trunction) = (0.778, 128) for "128": the target is the
    # row's N, and 4 image pivots + 8 pivots x N // 8 picks stay (132 for 128).
    settings = {key: hp[key] for key in ("layer", "pivot_image", "pivot_text")}
    settings["max_num_trunction"] = hp["max_num_trunction"] if keep is None else keep
    _check_keep("DART", settings["max_num_trunction"], n_visual)
    return settings


def _dart_extra(ctx: StepContext) -> ExtraMacs:
    s = ctx.settings
    pivots = s["pivot_image"] + s["pivot_text"]
    # Cosine similarity of every pivot's normed hidden state with every image token.
    return [(ctx.step.layer - 1, "dart_pivot_similarity", pivots * ctx.visual_before * ctx.dims.hidden)]


# ---- ToMe (in every CLIP layer up to the one the projector reads) -----------------------------------------------

def tome_rates(units: int, merged: int, layers: int) -> tuple[int, ...]:
    """ToMe's per-layer r: `merged` patches over `layers` layers, the same r per layer with the extra
    ones in the earliest layers (16x17 + 7x16 for 576 -> 192 over 23 layers), each at most half of
    the layer's patches (the bipartite split). Raises when no such schedule merges `merged`."""
    rates: list[int] = []
    current, left = units, merged
    for layer in range(layers):
        r = min(-(-left // (layers - layer)), current // 2)
        rates.append(r)
        current, left = current - r, left - r
    if left:
        raise FicocoError(f"ToMe cannot merge {merged} of {units} patches in {layers} layers merging at most half "
                          f"of a layer's tokens each (evenly spread, {merged - left} merge)")
    return tuple(rates)


def _tome_steps(settings: Mapping[str, Any], n_visual: int, n_layers: int) -> tuple[Step, ...]:
    rates = tuple(settings["rates"])
    if len(rates) > n_layers:
        raise FicocoError(f"ToMe: {len(rates)} layer rates for a tower whose projector reads layer {n_layers - 1}")
    steps, current = [], n_visual
    for layer, r in enumerate(rates):
        if r > current // 2:
            raise FicocoError(f"ToMe: layer {layer} merges {r} of {current} patches; at most half can merge")
        if r:
            steps.append(Step(layer, r, 0, "in_layer", "vision"))
        current -= r
    return tuple(steps)


def _tome_for_keep(keep: int | None, n_visual: int, n_layers: int, hp: Mapping[str, Any]) -> dict[str, Any]:
    if keep is None:  # a constant r in every layer (ToMe's own parse_r for an int; LightCompress's r=16)
        rates, current = [], n_visual
        for _ in range(n_layers):
            rates.append(min(hp["r"], current // 2))
            current -= rates[-1]
    else:
        _check_keep("ToMe", keep, n_visual)
        rates = list(tome_rates(n_visual, n_visual - keep, n_layers))
    return {"rates": rates, "prop_attn": hp["prop_attn"], "order": hp["order"]}


def _tome_extra(ctx: StepContext) -> ExtraMacs:
    tokens = ctx.visual_before + int(ctx.has_cls)  # units that match (Qwen2-VL: merge groups), [CLS] included
    # Cosine scores of the A half (even positions) against the B half, head-mean keys (head_dim wide).
    return [(ctx.step.layer, "tome_vision_matching", ((tokens + 1) // 2) * (tokens // 2) * ctx.dims.head_dim)]


# ---- VisionZip (dominant + contextual tokens at the tower's output) -----------------------------------------------

# dominant + contextual of the literature's rows (LightCompress visionzip.yml; README 54 + 10).
VISIONZIP_SPLITS = {192: (162, 30), 128: (108, 20), 64: (54, 10)}


def visionzip_split(keep: int) -> tuple[int, int]:
    """(dominant, contextual) for `keep` tokens: the published splits, else the same 27:5 ratio."""
    if keep in VISIONZIP_SPLITS:
        return VISIONZIP_SPLITS[keep]
    contextual = round(keep * 5 / 32)
    return keep - contextual, contextual


def _visionzip_steps(settings: Mapping[str, Any], n_visual: int, n_layers: int) -> tuple[Step, ...]:
    dominant, contextual = settings["dominant"], settings["contextual"]
    if dominant < 1 or contextual < 0 or dominant + contextual > n_visual:
        raise FicocoError(f"VisionZip: {dominant} dominant + {contextual} contextual tokens do not fit the "
                          f"{n_visual} patches of an item (at least one dominant)")
    if contextual and n_visual - dominant < contextual:
        raise FicocoError(f"VisionZip: {contextual} contextual tokens need as many patches left after "
                          f"{dominant} dominant ones")
    removed = n_visual - dominant
    if removed == contextual:  # every remaining patch is a target: nothing merges, the tokens are all kept
        return ()
    return (Step(n_layers - 1, removed, contextual, "tower_output", "vision"),)


def _visionzip_for_keep(keep: int | None, n_visual: int, n_layers: int, hp: Mapping[str, Any]) -> dict[str, Any]:
    if keep is None:
        dominant, contextual = hp["dominant"], hp["contextual"]
    else:
        _check_keep("VisionZip", keep, n_visual)
        dominant, contextual = visionzip_split(keep)
    return {"dominant": dominant, "contextual": contextual, "contextual_mode": hp["contextual_mode"]}


def _visionzip_extra(ctx: StepContext) -> ExtraMacs:
    d, s = ctx.dims, ctx.settings
    remaining = ctx.visual_before - s["dominant"]
    cls_row = [(ctx.step.layer, "visionzip_vision_cls_row", d.heads * d.head_dim * ctx.seq_before)] if ctx.has_cls \
        else []
    # Cosine of every non-target remaining patch (merge group) with every target, head-mean keys.
    return cls_row + [(ctx.step.layer, "visionzip_vision_contextual_similarity",
                       (remaining - s["contextual"]) * s["contextual"] * d.head_dim)]


# ---- FasterVLM ([CLS] attention top-k after the projector) --------------------------------------------------------

def _fastervlm_steps(settings: Mapping[str, Any], n_visual: int, n_layers: int) -> tuple[Step, ...]:
    keep = settings["keep"]
    _check_keep("FasterVLM", keep, n_visual)
    return (Step(n_layers - 1, n_visual - keep, 0, "after_projector", "vision"),) if keep < n_visual else ()


def _fastervlm_for_keep(keep: int | None, n_visual: int, n_layers: int, hp: Mapping[str, Any]) -> dict[str, Any]:
    if keep is None:  # the paper's 75 % row (144 of 576)
        keep = max(1, round(n_visual * (1 - hp["ratio"])))
    _check_keep("FasterVLM", keep, n_visual)
    return {"keep": keep}


def _fastervlm_extra(ctx: StepContext) -> ExtraMacs:
    d = ctx.dims
    return [(ctx.step.layer, "fastervlm_vision_cls_row", d.heads * d.head_dim * ctx.seq_before)] if ctx.has_cls else []


# ---- PruMerge+ (IQR outliers + spatial samples, merged by key similarity) -----------------------------------------

def _prumerge_steps(settings: Mapping[str, Any], n_visual: int, n_layers: int) -> tuple[Step, ...]:
    tokens = settings["tokens"]
    if not 2 <= tokens <= n_visual + 1:
        raise FicocoError(f"PruMerge+ hands the LLM 2..{n_visual + 1} tokens per item (kept patches and one extra "
                          f"token); got {tokens}")
    kept = tokens - 1
    # The kept patches absorb their neighbours; the extra token sums the patches that were not kept.
    return (Step(n_layers - 1, n_visual - kept, 1, "tower_output", "vision"),)


def _prumerge_for_keep(keep: int | None, n_visual: int, n_layers: int, hp: Mapping[str, Any]) -> dict[str, Any]:
    if keep is None:
        # Adaptive: the count depends on each image and is measured at run time; the plan assumes
        # `assumed_tokens` (about 144 on LLaVA-1.5, BASELINES.md's unverified recollection).
        # At most the item's patches: the prompt's span of placeholders is shortened, never lengthened.
        tokens = min(hp["assumed_tokens"], n_visual)
        return {"adaptive": True, "tokens": tokens, "neighbours": hp["neighbours"], "attention": hp["attention"]}
    if not 2 <= keep <= n_visual + 1:
        raise FicocoError(f"PruMerge+ hands the LLM 2..{n_visual + 1} tokens per item; keep={keep} is outside")
    return {"adaptive": False, "tokens": keep, "neighbours": hp["neighbours"], "attention": hp["attention"]}


def _prumerge_extra(ctx: StepContext) -> ExtraMacs:
    d, s = ctx.dims, ctx.settings
    kept = s["tokens"] - 1
    layer = ctx.step.layer
    return [(layer, "prumerge_vision_cls_row", d.hidden * ctx.seq_before),
            (layer, "prumerge_vision_key_similarity", kept * ctx.visual_before * d.hidden),
            (layer, "prumerge_vision_neighbour_sums", kept * min(s["neighbours"], ctx.visual_before - 1) * d.hidden),
            (layer, "prumerge_vision_extra_token", ctx.visual_before * d.hidden)]


# ---- DivPrune, VisPruner, CDPruner (diversity-based selection before the LLM) -----------------------------------

def _vispruner_rounds(residual: int, diverse: int) -> list[tuple[int, int, int]]:
    # The duplicate-removal rounds (a, b, removed); ficoco.methods.vispruner runs the same plan (no torch here).
    rounds = []
    while (r := min(8, residual - diverse)) > 0:
        a = (residual + 1) // 2
        rounds.append((a, residual // 2, min(r, a)))
        residual -= min(r, a)
    return rounds


def _cut_steps(title: str, where: str) -> Any:
    def steps(settings: Mapping[str, Any], n_visual: int, n_layers: int) -> tuple[Step, ...]:
        keep = settings["keep"]
        _check_keep(title, keep, n_visual)
        return (Step(n_layers - 1, n_visual - keep, 0, where, "vision"),) if keep < n_visual else ()
    return steps


def _ratio_for_keep(title: str, ratio_name: str, **fixed: Any) -> Any:
    def for_keep(keep: int | None, n_visual: int, n_layers: int, hp: Mapping[str, Any]) -> dict[str, Any]:
        if keep is None:  # the official default row, scaled to the item's tokens
            keep = max(1, round(n_visual * hp[ratio_name]))
        _check_keep(title, keep, n_visual)
        return {"keep": keep, **{name: hp[name] for name in hp if name != ratio_name}, **fixed}
    return for_keep


def _divprune_extra(ctx: StepContext) -> ExtraMacs:
    tokens = ctx.visual_before
    # 1 - cos of every pair of projected tokens; the greedy Max-Min picks are comparisons (no MACs).
    return [(ctx.step.layer, "divprune_projected_cosine_distance", tokens * tokens * ctx.projected_width)]


def _vispruner_extra(ctx: StepContext) -> ExtraMacs:
    d, s = ctx.dims, ctx.settings
    important = int(s["keep"] * s["important_ratio"])
    rounds = _vispruner_rounds(ctx.visual_before - important, s["keep"] - important)
    # No [CLS] row on a tower without one: the equivalent token is elementwise work no convention counts.
    cls_row = [(ctx.step.layer, "vispruner_vision_cls_row", d.heads * d.head_dim * ctx.seq_before)] if ctx.has_cls \
        else []
    return [*cls_row,
            # Each round: cosine of every even-place residual token with every odd-place one, at the units' width
            # (Qwen2-VL: a merge group's patches side by side).
            (ctx.step.layer, "vispruner_vision_duplicate_similarity",
             sum(a * b for a, b, _ in rounds) * (ctx.unit_width or d.hidden))]


def _cdpruner_extra(ctx: StepContext) -> ExtraMacs:
    tokens, keep, width = ctx.visual_before, ctx.settings["keep"], ctx.projected_width
    return [(ctx.step.layer, "cdpruner_projected_similarity", tokens * tokens * width),
            (ctx.step.layer, "cdpruner_text_relevance", tokens * ctx.suffix_tokens * width),
            # Fast greedy MAP: pick t projects the kernel row on the t earlier factor rows.
            (ctx.step.layer, "cdpruner_greedy_map", tokens * keep * (keep - 1) // 2)]


_divprune_steps = _cut_steps("DivPrune", "after_projector")
_vispruner_steps = _cut_steps("VisPruner", "tower_output")
_cdpruner_steps = _cut_steps("CDPruner", "after_projector")
_divprune_for_keep = _ratio_for_keep("DivPrune", "ratio")
_vispruner_for_keep = _ratio_for_keep("VisPruner", "default_keep_ratio")
_CDPRUNER_RELEVANCE = "LLM input embeddings of the prompt text (no CLIP text tower)"
_cdpruner_for_keep = _ratio_for_keep("CDPruner", "default_keep_ratio", relevance=_CDPRUNER_RELEVANCE)


# FiCoCo-V and -L: any count at any reducing layer from `first_layer` (ficoco.accounting.schedule plans them).
_PER_LAYER = "ficoco.accounting.schedule:plan_per_layer"

# ---- the registry --------------------------------------------------------------------------------------------------

_PER_ITEM = "visual tokens per image, crop or frame that reach the LLM"
_EQUIVALENT = ("towers without [CLS] (Qwen2-VL): FiCoCo's equivalent token (-cos of each patch's head-mean key to "
               "their mean) scores the patches in place of the [CLS] attention, averaged over each 2x2 merge group")
_LAST_ROW = "the last prompt token (left padding puts it at T - 1 in every sample)"
# Why a family does not run a method (MethodSpec.refusals; `ficoco methods --matrix` prints them).
_QWEN2_VL_PRUMERGE = ("not wired: PruMerge+'s extra token (the sum of the patches it did not keep) stands at no "
                      "merge group, so Qwen2-VL's 3-D positions give it no place; whole groups without it would be "
                      "another method")
_ONEVISION_PRUMERGE = ("not wired: PruMerge+ picks IQR outliers of [CLS]'s softmax attention and weighs the patches "
                       "it merges by it; SigLIP has no [CLS], and FiCoCo's equivalent token gives a signed cosine, "
                       "not weights that sum to one, so the kept and merged tokens would not be PruMerge+'s")

METHODS: dict[str, MethodSpec] = {spec.name: spec for spec in (
    MethodSpec(
        name="v", title="FiCoCo-V", acts_at="vision_layer", placement="in_layer", positions="grid",
        needs=(Need("attention_rows", "vision L", "all", "head-mean probabilities of every query over every key "
                    "of the reducing vision layer (B, T, T)"),
               Need("keys", "vision L", "all", "head-mean keys, only for towers without [CLS] (equivalent token)"),
               Need("hidden", "vision L", "all", "after the attention residual, before the MLP")),
        hyperparameters={"lam": 0.35, "eps": 0.998, "window": 2, "coefficient": 2.0, "first_layer": 12,
                         "equivalent_token": False},
        families=ALL_FAMILIES, module="ficoco.methods.ficoco_v", function="reduce",
        source="SPEC.md (FiCoCo paper)", summary="filter by vision- and [CLS]-redundancy, fold into kept patches",
        keep_means="visual tokens that reach the LLM", wired=True,
        planner=_PER_LAYER, default_setting=False,
        paper_overhead=ficoco_paper_overhead, layer_macs=ficoco_layer_macs,
    ),
    MethodSpec(
        name="l", title="FiCoCo-L", acts_at="llm_layer", placement="in_layer", positions="original",
        needs=(Need("attention_rows", "L", "visual+suffix", "head-mean probabilities of the visual and suffix "
                    "queries over every key of the reducing layer"),
               Need("hidden", "L", "all", "after the attention residual, before the MLP")),
        hyperparameters={"beta": 0.6, "gamma": 0.6, "eps": 0.998, "first_layer": 4},
        families=ALL_FAMILIES, module="ficoco.methods.ficoco_l", function="reduce",
        source="SPEC.md (FiCoCo paper)", summary="filter by vision- and task-redundancy, fold into kept tokens",
        keep_means="visual tokens that leave the LLM", wired=True,
        planner=_PER_LAYER, default_setting=False,
        paper_overhead=ficoco_paper_overhead, layer_macs=ficoco_layer_macs,
    ),
    MethodSpec(
        name="fastv", title="FastV", acts_at="llm_layer", placement="layer_input", positions="original",
        needs=(Need("attention_rows", "L-1", "last", "softmax over all keys of layer K-1, head mean, of "
                    + _LAST_ROW + "; recomputed from post-RoPE q and k, so SDPA stays on"),
               Need("hidden", "L", "all", "the input of layer K")),
        hyperparameters={"layer": 2, "ratio": 0.5},
        families=ALL_FAMILIES, module="ficoco.methods.fastv", function="fastv_reduce",
        source="pkunlp-icler/FastV d165972", summary="keep the image tokens the last prompt token attends to most",
        keep_means="layer-average visual tokens (K layers at all, the rest at the kept)",
        steps=_fastv_steps, settings_for_keep=_fastv_for_keep, extra_macs=_fastv_extra, wired=True,
    ),
    MethodSpec(
        name="pdrop", title="PDrop", acts_at="llm_layer", placement="layer_input", positions="compact",
        needs=(Need("query_key", "L", "last", "the rank layer's own input_layernorm, q_proj (last row) and k_proj "
                    "(all rows), RoPE, softmax over all keys, head mean: one row, on the sequence entering the stage"),
               Need("hidden", "L", "all", "the input of the rank layer")),
        hyperparameters={"spacing": 8, "ratio": 0.5},
        families=TESTED_FAMILIES, module="ficoco.methods.pdrop", function="pdrop_reduce",
        source="Cooperx521/PyramidDrop 6444f30",
        summary="rank by the last instruction token at 3 stages, keep a pyramid",
        keep_means="layer-average visual tokens",
        steps=_pdrop_steps, settings_for_keep=_pdrop_for_keep, extra_macs=_pdrop_extra, wired=True,
    ),
    MethodSpec(
        name="sparsevlm", title="SparseVLM", acts_at="llm_layer", placement="layer_input", positions="compact",
        needs=(Need("input_embeddings", "embeddings", "visual+suffix", "the LLM's input embeddings, once, to "
                    "choose the rater text tokens"),
               Need("attention_rows", "L-1", "suffix", "softmax over all keys of the sparse layer, head mean, for "
                    "every suffix row (raters are a subset)"),
               Need("hidden", "L", "all", "the output of the sparse layer (input of the next)")),
        hyperparameters={"layers": (2, 6, 15), "recycle_ratio": 0.3, "cluster_divisor": 10},
        families=TESTED_FAMILIES, module="ficoco.methods.sparsevlm", function="sparsevlm_reduce",
        source="Gumpest/SparseVLMs v1.5 (56bef80)",
        summary="rate image tokens by text raters, prune after layers 2/6/15, recycle pruned tokens into clusters",
        keep_means="the v1.5 schedule of the literature's row (192, 128, 96, 64)",
        keep_choices=tuple(sorted(SPARSEVLM_SCHEDULES)),
        steps=_sparsevlm_steps, settings_for_keep=_sparsevlm_for_keep, extra_macs=_sparsevlm_extra, wired=True,
        added_for_removed=_sparsevlm_added,
    ),
    MethodSpec(
        name="dart", title="DART", acts_at="llm_layer", placement="layer_input", positions="original",
        needs=(Need("keys", "L-1", "visual+suffix", "post-RoPE key states of layer K-1, heads concatenated"),
               Need("hidden", "L-1", "all", "the output of layer K-1 through the final norm (model.norm)")),
        hyperparameters={"layer": 2, "pivot_image": 4, "pivot_text": 4, "max_num_trunction": 128},
        families=ALL_FAMILIES, module="ficoco.methods.dart", function="dart_reduce",
        source="ZichenWen1/DART (README, code copy)", summary="keep pivots and the tokens least similar to them",
        keep_means="max_num_trunction (4 image pivots + 8 x N // 8 tokens stay)",
        steps=_dart_steps, settings_for_keep=_dart_for_keep, extra_macs=_dart_extra, wired=True,
    ),
    MethodSpec(
        name="tome", title="ToMe", acts_at="vision_layer", placement="in_layer", positions="grid",
        needs=(Need("keys", "vision L", "all", "head-mean key states of the layer's attention (the matching metric)"),
               Need("hidden", "vision L", "all", "after the attention residual, before the MLP; the token sizes "
                    "carried from layer to layer add log(size) to every key's logits (proportional attention)")),
        hyperparameters={"r": 16, "prop_attn": True, "order": "spatial"},
        families=TESTED_FAMILIES, module="ficoco.methods.tome", function="tome_merge",
        source="facebookresearch/ToMe af95e4b",
        summary="merge the most similar patch pairs (bipartite) in every vision layer, size-weighted",
        keep_means=_PER_ITEM,
        steps=_tome_steps, settings_for_keep=_tome_for_keep, extra_macs=_tome_extra, wired=True,
    ),
    MethodSpec(
        name="visionzip", title="VisionZip", acts_at="vision_layer", placement="tower_output", positions="grid",
        needs=(Need("attention_rows", "vision L", "cls", "the [CLS] query's softmax over every key of the layer the "
                    "projector reads, per head (q_cls from q_proj, K from k_proj)"),
               Need("keys", "vision L", "all", "head-mean key states of that layer (the contextual merge metric)"),
               Need("hidden", "vision L", "all", "that layer's output, the projector's input")),
        hyperparameters={"dominant": 54, "contextual": 10, "contextual_mode": "mean"},
        families=ALL_FAMILIES, module="ficoco.methods.visionzip", function="visionzip_reduce",
        source="dvlab-research/VisionZip 3151f6d",
        summary="keep the patches [CLS] attends to most, merge the rest into a few contextual tokens",
        keep_means=_PER_ITEM + " (dominant + contextual: 162+30, 108+20, 54+10)", cls_note=_EQUIVALENT,
        steps=_visionzip_steps, settings_for_keep=_visionzip_for_keep, extra_macs=_visionzip_extra, wired=True,
    ),
    MethodSpec(
        name="fastervlm", title="FasterVLM", acts_at="after_projector", placement="after_projector",
        positions="grid",
        needs=(Need("attention_rows", "vision L", "cls", "the [CLS] query's softmax over every key of the layer the "
                    "projector reads, head mean"),
               Need("hidden", "projector", "all", "the projector's output, every patch")),
        hyperparameters={"ratio": 0.75},
        families=ALL_FAMILIES, module="ficoco.methods.fastervlm", function="fastervlm_reduce",
        source="Theia-4869/FasterVLM f5d5f12",
        summary="keep the projected patches [CLS] attends to most, in image order",
        keep_means=_PER_ITEM, cls_note=_EQUIVALENT,
        steps=_fastervlm_steps, settings_for_keep=_fastervlm_for_keep, extra_macs=_fastervlm_extra, wired=True,
    ),
    MethodSpec(
        name="prumerge", title="PruMerge+", acts_at="vision_layer", placement="tower_output", positions="grid",
        needs=(Need("query_key", "vision last", "cls", "the last tower layer's q_proj (the [CLS] row) and k_proj "
                    "(every row) outputs: the [CLS] attention and the full-width merge keys"),
               Need("hidden", "vision L", "all", "the output of the layer the projector reads")),
        hyperparameters={"assumed_tokens": 144, "neighbours": 32, "attention": "heads"},
        families=LLAVA_FAMILIES, module="ficoco.methods.prumerge", function="prumerge_reduce",
        refusals={"qwen2_vl": _QWEN2_VL_PRUMERGE, "llava_onevision": _ONEVISION_PRUMERGE,
                  "qwen2_5_vl": _QWEN2_VL_PRUMERGE.replace("Qwen2-VL", "Qwen2.5-VL")},
        source="42Shawn/LLaVA-PruMerge 097c041",
        summary="keep IQR-outlier and spatially sampled patches, merge their key-nearest neighbours into them",
        keep_means="tokens per item that reach the LLM, one extra token included (fixed count; without keep="
                   "the count is adaptive, planned at assumed_tokens and measured at run time)",
        steps=_prumerge_steps, settings_for_keep=_prumerge_for_keep, extra_macs=_prumerge_extra, wired=True,
    ),
    MethodSpec(
        name="divprune", title="DivPrune", acts_at="after_projector", placement="after_projector",
        positions="grid",
        needs=(Need("hidden", "projector", "all", "the projector's output, every patch"),),
        hyperparameters={"ratio": 0.098},
        families=ALL_FAMILIES, module="ficoco.methods.divprune", function="divprune_reduce",
        source="vbdi/divprune (README; its DivPrune function as copied verbatim in ModelTC/llmc)",
        summary="keep the projected patches of greatest Max-Min cosine diversity, in image order",
        keep_means=_PER_ITEM + " (default: SUBSET_RATIO 0.098, 56 of 576)",
        steps=_divprune_steps, settings_for_keep=_divprune_for_keep, extra_macs=_divprune_extra, wired=True,
    ),
    MethodSpec(
        name="vispruner", title="VisPruner", acts_at="vision_layer", placement="tower_output", positions="grid",
        needs=(Need("attention_rows", "vision L", "cls", "the [CLS] query's softmax over every key of the layer the "
                    "projector reads, head mean"),
               Need("hidden", "vision L", "all", "that layer's output, the projector's input (the duplicate "
                    "similarity's features)")),
        hyperparameters={"important_ratio": 0.5, "default_keep_ratio": 0.2222},
        families=ALL_FAMILIES, module="ficoco.methods.vispruner", function="vispruner_reduce",
        source="Theia-4869/VisPruner (copy anonymous-4869/VisPruner d01c757)",
        summary="keep half by [CLS] attention, the rest by removing duplicates among the others, then project",
        keep_means=_PER_ITEM + " (default: the README's 128 of 576)", cls_note=_EQUIVALENT,
        steps=_vispruner_steps, settings_for_keep=_vispruner_for_keep, extra_macs=_vispruner_extra, wired=True,
    ),
    MethodSpec(
        name="cdpruner", title="CDPruner", acts_at="after_projector", placement="after_projector",
        positions="grid",
        needs=(Need("hidden", "projector", "all", "the projector's output, every patch"),
               Need("input_embeddings", "embeddings", "suffix", "the LLM's input embeddings of the prompt's text "
                    "after the visual span: the instruction, in place of the CLIP text tower")),
        hyperparameters={"default_keep_ratio": 0.2222},
        families=ALL_FAMILIES, module="ficoco.methods.cdpruner", function="cdpruner_reduce",
        source="Theia-4869/CDPruner ed9c12d",
        summary="conditional DPP (cosine kernel weighted by instruction relevance), fast greedy MAP; relevance "
                "from the LLM's input embeddings of the instruction (the checkpoints carry no CLIP text tower)",
        keep_means=_PER_ITEM + " (default: the README's 128 of 576)",
        steps=_cdpruner_steps, settings_for_keep=_cdpruner_for_keep, extra_macs=_cdpruner_extra, wired=True,
    ),
)}

# ---- HoliTom (temporal segmentation, temporal + spatial merging of a video's frames, after the projector) --------

def _holitom_steps(settings: Mapping[str, Any], n_visual: int, n_layers: int) -> tuple[Step, ...]:
    keep = settings["keep"]
    _check_keep("HoliTom", keep, n_visual)
    return (Step(n_layers - 1, n_visual - keep, 0, "after_projector", "vision"),) if keep < n_visual else ()


def _holitom_for_keep(keep: int | None, n_visual: int, n_layers: int, hp: Mapping[str, Any]) -> dict[str, Any]:
    if keep is None:  # the official RETAIN_RATIO of every frame's tokens (default 0.10; the paper's rows 25/15/10 %)
        keep = max(1, math.ceil(n_visual * hp["retain_ratio"] - 1e-9))
    _check_keep("HoliTom", keep, n_visual)
    return {"keep": keep, **{name: hp[name] for name in ("tau", "beta", "neighbours", "contextual_share",
                                                         "max_window", "merge_layer", "merge_ratio")}}


def _holitom_inner_steps(settings: Mapping[str, Any], n_visual: int, n_layers: int) -> tuple[Step, ...]:
    """The inner-LLM merge on the `n_visual` tokens the outer part handed the LLM."""
    ratio = settings["merge_ratio"]
    if not 0 <= ratio < 1:
        raise FicocoError(f"HoliTom: merge_ratio {ratio} is outside [0, 1) (the share of visual tokens merged "
                          "inside the LLM)")
    keep = max(1, round(n_visual * (1 - ratio)))
    # The official HOLITOM_k (18, a layer every 7B decoder has); a shallower decoder merges at its last layer.
    layer = min(settings["merge_layer"], n_layers - 1)
    return (Step(layer, n_visual - keep),) if keep < n_visual else ()


def _holitom_inner_extra(ctx: StepContext) -> ExtraMacs:
    d = ctx.dims
    kept = ctx.visual_before - ctx.step.remove
    return [(ctx.step.layer - 1, "holitom_last_row_scores", d.heads * d.head_dim * ctx.seq_before),
            # Cosine of every merged visual token with every kept one (the layer's input).
            (ctx.step.layer, "holitom_merge_similarity", ctx.step.remove * kept * d.hidden)]


_HOLITOM_INNER = MethodSpec(
    name="holitom", title="HoliTom", acts_at="llm_layer", placement="layer_input", positions="original",
    needs=(Need("attention_rows", "L-1", "last", "softmax over all keys of layer K-1, head mean, of " + _LAST_ROW),
           Need("hidden", "L", "all", "the input of layer K (the merge's cosine similarities)")),
    hyperparameters={"merge_layer": 18, "merge_ratio": 0.5},
    families=("video_llava", "llava_onevision", "qwen2_vl", "qwen2_5_vl"),
    module="ficoco.methods.holitom", function="step", source="cokeshao/HoliTom e5f7da2 (holitom/modeling_qwen2.py)",
    summary="keep the visual tokens the last prompt token attends to most, average the rest into their most "
            "similar kept token", keep_means="the share merge_ratio of the visual tokens merged at merge_layer",
    steps=_holitom_inner_steps, extra_macs=_holitom_inner_extra, wired=True,
)


def _holitom_extra(ctx: StepContext) -> ExtraMacs:
    """Per video (``extra_per_sample``): the work on its ``items`` frames of ``visual_before`` projected
    tokens of width ``projected_width``, as the batched module runs it (every frame slot, masked)."""
    frames, tokens, width, layer = ctx.items, ctx.visual_before, ctx.projected_width, ctx.step.layer
    rows = [(layer, "holitom_frame_similarity", (frames - 1) * tokens * width),
            # DPC-kNN distances of the static tokens of every window that can start at a frame (not the last).
            (layer, "holitom_static_cluster_distances", (frames - 1) * tokens * tokens * width)]
    if ctx.settings["contextual_share"] > 0:
        rows.append((layer, "holitom_contextual_cluster_distances", frames * tokens * tokens * width))
    return [row for row in rows if row[2]]


# HoliTom's cells outside its families: one line each on why (LLaVA-OneVision runs it on videos, after the
# 2x2 pooling of every frame, as the official code does on OneVision / LLaVA-Video).
_HOLITOM_IMAGE_ONLY = ("a video method: its temporal segmentation and merging need a video's frames, and this family "
                       "takes images (an image is one frame)")
# Qwen2-VL and Qwen2.5-VL (issue 25) run it on videos: their temporal slices are the frames.
_HOLITOM_REFUSALS = {"llava": _HOLITOM_IMAGE_ONLY, "llava_next": _HOLITOM_IMAGE_ONLY}

METHODS["holitom"] = MethodSpec(
    name="holitom", title="HoliTom", acts_at="after_projector", placement="after_projector", positions="grid",
    needs=(Need("attention_rows", "vision L", "all", "head-mean probabilities of every query over every key of the "
                "layer the projector reads: the mean attention each patch receives (queries and heads averaged)"),
           Need("hidden", "projector", "all", "the projector's output, every patch of every frame of a video "
                "together (the adapter groups a video's frames)")),
    hyperparameters={"retain_ratio": 0.10, "tau": 0.8, "beta": 0.6, "neighbours": 7, "contextual_share": 0.0,
                     "max_window": 1024, "merge_layer": 18, "merge_ratio": 0.5},
    families=("video_llava", "llava_onevision", "qwen2_vl", "qwen2_5_vl"), module="ficoco.methods.holitom",
    function="holitom_reduce",
    refusals=_HOLITOM_REFUSALS, pooled_grid=True,
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
    steps=_holitom_steps, settings_for_keep=_holitom_for_keep, extra_macs=_holitom_extra, wired=True,
    extra_per_sample=True, inner=_HOLITOM_INNER,
)

class _Variants(Sequence[str]):
    """"vanilla" and every registered method, as the registry holds them now (a method registered later,
    `register_method`, is a variant as soon as it is registered, wherever VARIANTS was imported)."""

    def _names(self) -> tuple[str, ...]:
        return ("vanilla", *METHODS)

    def __getitem__(self, index: Any) -> Any:
        return self._names()[index]

    def __len__(self) -> int:
        return 1 + len(METHODS)

    def __contains__(self, name: object) -> bool:
        return name == "vanilla" or name in METHODS

    def __iter__(self) -> Iterator[str]:
        return iter(self._names())

    def __eq__(self, other: object) -> bool:
        return tuple(self) == (tuple(other) if isinstance(other, Sequence) else other)

    def __hash__(self) -> int:
        return hash(self._names())

    def __repr__(self) -> str:
        return repr(self._names())


VARIANTS: Sequence[str] = _Variants()


def method(name: str) -> MethodSpec:
    """The spec of `name`, or one line naming the registered methods."""
    if name not in METHODS:
        raise FicocoError(f"unknown method '{name}': choose from {', '.join(METHODS)}")
    return METHODS[name]


def method_matrix(families: Iterable[str]) -> list[dict[str, Any]]:
    """Methods x `families` (ficoco.profiles.FAMILY_DEFAULTS, so a new family shows up as soon as it has
    defaults): per method and family, "yes", "flops only" or "refused", and the one-line reason."""
    families = tuple(families)
    rows = []
    for spec in METHODS.values():
        cells = {}
        for family in families:
            status, reason = spec.family_status(family)
            if status == "yes" and not spec.wired:
                status, reason = "flops only", "not wired into the models yet"
            cells[family] = {"status": status, "reason": reason}
        rows.append({"name": spec.name, "title": spec.title, "families": cells})
    return rows


def dims_of(hidden: int, heads: int, kv_heads: int, head_dim: int, ffn: int) -> Dims:
    return Dims(hidden=hidden, heads=heads, kv_heads=kv_heads, head_dim=head_dim, ffn=ffn)


# ---- methods registered from outside the package (a plugin, a test's toy method) -------------------------------

def register_method(spec: MethodSpec) -> MethodSpec:
    """Add `spec` to the registry: the CLI, the accountant, `apply` and `ficoco methods` see it at once.
    Its module is imported on use; its planner plans it (`plan_by_steps` by default). Refuses a name
    that is taken."""
    if spec.name == "vanilla" or spec.name in METHODS:
        raise FicocoError(f"method '{spec.name}' is registered already; choose another name")
    METHODS[spec.name] = spec
    return spec


def unregister_method(name: str) -> None:
    """Remove a method `register_method` added (one of the package's own entries is refused)."""
    if name not in METHODS:
        raise FicocoError(f"unknown method '{name}': choose from {', '.join(METHODS)}")
    if name in _BUILT_IN:
        raise FicocoError(f"method '{name}' is one of the package's own entries; it cannot be unregistered")
    del METHODS[name]


@contextmanager
def registered(spec: MethodSpec) -> Iterator[MethodSpec]:
    """`register_method(spec)` for the block, `unregister_method` after it (even on an error)."""
    register_method(spec)
    try:
        yield spec
    finally:
        unregister_method(spec.name)


_BUILT_IN = frozenset(METHODS)
