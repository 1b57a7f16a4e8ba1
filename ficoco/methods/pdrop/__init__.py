"""PDrop / PyramidDrop (docs/methods/pdrop.md): rank the image tokens by the last instruction token at
three stages of the decoder and keep a pyramid of them.

This module is its spec, its defaults (the official code's) and its schedule arithmetic; no torch.
Its tensor functions are in `ops`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ficoco.errors import FicocoError
from ficoco.methods.base import ExtraMacs, MethodSpec, Need, Step, StepContext
from ficoco.methods.common import TESTED_FAMILIES, check_keep, check_layer
from ficoco.methods.reads import DEFAULT_ATTENTION_SCORES, SCORES_CORRECTION

# The official pyramid: stages after layers 7, 15, 23 (rank & drop at the input of 8, 16, 24), lambda 0.5.
SPACING = 8
RATIO = 0.5
# The stage spacings a `--keep` row may pick, latest first (the repo publishes no 192/128/64 settings).
PDROP_SPACINGS = (8, 4, 2, 1)


def stage_layers(spacing: int, n_layers: int) -> tuple[int, ...]:
    """The layers at whose input the three stages rank and drop (those the decoder has)."""
    return tuple(layer for layer in (spacing, 2 * spacing, 3 * spacing) if layer < n_layers)


def stage_keeps(n_visual: int, ratio: float, stages: int) -> tuple[int, ...]:
    """keep = int(N * ratio_list[stage + 1]), counted from the original N (pdrop_rank_drop); at least one stays."""
    return tuple(max(1, int(n_visual * ratio ** (k + 1))) for k in range(stages))


def steps(settings: Mapping[str, Any], n_visual: int, n_layers: int) -> tuple[Step, ...]:
    """One step per stage, each keeping its share of the original N (never more than the previous stage)."""
    layers = tuple(settings["layers"])
    keeps = stage_keeps(n_visual, settings["ratio"], len(layers))
    found, current = [], n_visual
    for layer, keep in zip(layers, keeps, strict=True):
        check_layer("PDrop", layer, n_layers)
        keep = min(keep, current)
        if keep < current:
            found.append(Step(layer, current - keep))
        current = keep
    return tuple(found)


def layer_average(schedule: tuple[Step, ...], n_visual: int, n_layers: int) -> float:
    """The visual tokens every decoder layer sees, averaged over the layers (the literature's row)."""
    by_layer = {s.layer: s for s in schedule}
    total, current = 0, n_visual
    for layer in range(n_layers):
        if layer in by_layer:
            current += by_layer[layer].added - by_layer[layer].remove
        total += current
    return total / n_layers


def settings_for_keep(keep: int | None, n_visual: int, n_layers: int, hp: Mapping[str, Any]) -> dict[str, Any]:
    """The pyramid of the literature's "`keep` tokens" row (a layer average); None: the official one."""
    if keep is None:
        layers = stage_layers(hp["spacing"], n_layers)
        if not layers:
            raise FicocoError(f"PDrop's stages {hp['spacing']}, {2 * hp['spacing']}, {3 * hp['spacing']} lie beyond "
                              f"a {n_layers}-layer decoder; give keep= to plan a shorter pyramid")
        return {"layers": list(layers), "ratio": hp["ratio"]}
    check_keep("PDrop", keep, n_visual)
    # The repo publishes no 192/128/64 settings (PyramidDrop issues #10, #27, #28). Rule used here: the
    # official equal stage spacing, the latest spacing of 8, 4, 2, 1 whose pyramid can average `keep`,
    # and the largest lambda whose layer average does not exceed `keep`.
    for spacing in PDROP_SPACINGS:
        layers = stage_layers(spacing, n_layers)
        if not layers:
            continue

        def average(ratio: float, layers: tuple[int, ...] = layers) -> float:
            return layer_average(steps({"layers": layers, "ratio": ratio}, n_visual, n_layers), n_visual, n_layers)

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


def extra_macs(ctx: StepContext) -> ExtraMacs:
    """The rank layer's own k over the whole entering sequence and q of the last instruction token (the
    official code projects q for every row; one row is all the score reads), and that row's scores."""
    d, layer, n = ctx.dims, ctx.step.layer, ctx.seq_before
    return [(layer, "pdrop_k_proj", n * d.hidden * d.kv_heads * d.head_dim),
            (layer, "pdrop_q_proj_last_row", d.hidden * d.heads * d.head_dim),
            (layer, "pdrop_last_row_scores", d.heads * d.head_dim * n)]


SPEC = MethodSpec(
    name="pdrop", title="PDrop", acts_at="llm_layer", placement="layer_input", positions="compact",
    needs=(Need("query_key", "L", "last", "the rank layer's own input_layernorm, q_proj (last row) and k_proj "
                "(all rows), RoPE, softmax over all keys, head mean: one row, on the sequence entering the stage"),
           Need("hidden", "L", "all", "the input of the rank layer")),
    hyperparameters={"spacing": SPACING, "ratio": RATIO,
                     "attention_scores": DEFAULT_ATTENTION_SCORES},
    corrections=SCORES_CORRECTION,
    families=TESTED_FAMILIES, module=f"{__name__}.ops", function="pdrop_reduce",
    source="Cooperx521/PyramidDrop 6444f30",
    summary="rank by the last instruction token at 3 stages, keep a pyramid",
    keep_means="layer-average visual tokens",
    steps=steps, settings_for_keep=settings_for_keep, extra_macs=extra_macs, wired=True,
)
