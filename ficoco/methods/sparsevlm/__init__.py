"""SparseVLM v1.5 (docs/methods/sparsevlm.md): text raters prune the image tokens after decoder layers
2, 6 and 15 and recycle part of what they prune into a few clusters.

This module is its spec, its defaults and published schedules (the v1.5 code's) and its schedule
arithmetic; no torch. Its tensor functions are in `ops`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ficoco.errors import FicocoError
from ficoco.methods.base import ExtraMacs, MethodSpec, Need, Step, StepContext
from ficoco.methods.common import TESTED_FAMILIES
from ficoco.methods.reads import DEFAULT_ATTENTION_SCORES, SCORES_CORRECTION

LAYERS = (2, 6, 15)  # the sparse layers: their output is pruned
RECYCLE_RATIO = 0.3  # int(0.3 n) + 1 of the n pruned tokens are recycled
CLUSTER_DIVISOR = 10  # ... into int(recycled / 10) + 1 clusters
# score.py of the v1.5 branch (96 from main): tokens kept after each of the layers 2, 6, 15.
SPARSEVLM_SCHEDULES = {192: (300, 200, 110), 128: (303, 110, 36), 96: (238, 48, 26), 64: (66, 30, 17)}
DEFAULT_ROW = 192  # the row planned without keep=


def sparsevlm_recycled(pruned: int, ratio: float = RECYCLE_RATIO, divisor: int = CLUSTER_DIVISOR) -> tuple[int, int]:
    """(pruned tokens that are recycled, clusters they are merged into): int(0.3 n) + 1 and int(p / 10) + 1."""
    recycled = min(pruned, int(ratio * pruned) + 1)
    return recycled, int(recycled / divisor) + 1


def steps(settings: Mapping[str, Any], n_visual: int, n_layers: int) -> tuple[Step, ...]:
    """One step at the input of the layer after each sparse layer: the pruned tokens leave, their
    recycled clusters join."""
    found, current = [], n_visual
    for layer, keep in zip(settings["layers"], settings["keeps"], strict=True):
        if layer + 1 >= n_layers:  # pruning the output of the last layer changes nothing
            break
        if current < 2:
            break
        kept = min(keep, current - 1)  # k = min(schedule[layer], N_v - 1)
        pruned = current - kept
        _, clusters = sparsevlm_recycled(pruned, settings["recycle_ratio"], settings["cluster_divisor"])
        found.append(Step(layer + 1, pruned, clusters))
        current = kept + clusters
    return tuple(found)


def settings_for_keep(keep: int | None, n_visual: int, n_layers: int, hp: Mapping[str, Any]) -> dict[str, Any]:
    """The published v1.5 schedule of the literature's "`keep` tokens" row (None: 192)."""
    keep = DEFAULT_ROW if keep is None else keep
    if keep not in SPARSEVLM_SCHEDULES:
        raise FicocoError(f"SparseVLM's v1.5 schedules exist for {', '.join(map(str, SPARSEVLM_SCHEDULES))} tokens; "
                          f"keep={keep} has none (schedule= gives any)")
    return {"layers": list(hp["layers"]), "keeps": list(SPARSEVLM_SCHEDULES[keep]),
            "recycle_ratio": hp["recycle_ratio"], "cluster_divisor": hp["cluster_divisor"]}


def added_for_removed(removed: int, settings: Mapping[str, Any]) -> int:
    """--schedule LAYER:REMOVED: the recycled clusters join at the same step, by the default rule."""
    return sparsevlm_recycled(removed, settings["recycle_ratio"], settings["cluster_divisor"])[1]


def extra_macs(ctx: StepContext) -> ExtraMacs:
    """The raters (once), the rater rows of each sparse layer, and the recycling's clustering."""
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


SPEC = MethodSpec(
    name="sparsevlm", title="SparseVLM", acts_at="llm_layer", placement="layer_input", positions="compact",
    needs=(Need("input_embeddings", "embeddings", "visual+suffix", "the LLM's input embeddings, once, to "
                "choose the rater text tokens"),
           Need("attention_rows", "L-1", "suffix", "softmax over all keys of the sparse layer, head mean, for "
                "every suffix row (raters are a subset)"),
           Need("hidden", "L", "all", "the output of the sparse layer (input of the next)")),
    hyperparameters={"layers": LAYERS, "recycle_ratio": RECYCLE_RATIO, "cluster_divisor": CLUSTER_DIVISOR,
                     "attention_scores": DEFAULT_ATTENTION_SCORES},
    corrections=SCORES_CORRECTION,
    families=TESTED_FAMILIES, module=f"{__name__}.ops", function="sparsevlm_reduce",
    source="Gumpest/SparseVLMs v1.5 (56bef80)",
    summary="rate image tokens by text raters, prune after layers 2/6/15, recycle pruned tokens into clusters",
    keep_means="the v1.5 schedule of the literature's row (192, 128, 96, 64)",
    keep_choices=tuple(sorted(SPARSEVLM_SCHEDULES)),
    steps=steps, settings_for_keep=settings_for_keep, extra_macs=extra_macs, wired=True,
    added_for_removed=added_for_removed,
)
