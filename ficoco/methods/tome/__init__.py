"""ToMe (docs/methods/tome.md): merge the most similar patch pairs (bipartite matching) in every vision
layer up to the one the projector reads, size-weighted, with proportional attention.

This module is its spec, its defaults and its schedule arithmetic; no torch. Its tensor functions
are in `ops`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ficoco.errors import FicocoError
from ficoco.methods.base import ExtraMacs, MethodSpec, Need, Step, StepContext
from ficoco.methods.common import PER_ITEM, TESTED_FAMILIES, check_keep

R = 16  # patches merged per layer without keep= (ToMe's parse_r for an int; LightCompress's r=16)
PROP_ATTN = True  # proportional attention: log(size) added to every key's logits
# The official order after a merge: [unmerged A, all B], which the next layer's even/odd split runs on
# ("spatial": ficoco's image order, a correction a label names).
ORDER = "official"
CORRECTIONS = {"order": {"spatial": "spatial order"}}


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


def steps(settings: Mapping[str, Any], n_visual: int, n_layers: int) -> tuple[Step, ...]:
    """One in-layer step per tower layer with a positive rate."""
    rates = tuple(settings["rates"])
    if len(rates) > n_layers:
        raise FicocoError(f"ToMe: {len(rates)} layer rates for a tower whose projector reads layer {n_layers - 1}")
    found, current = [], n_visual
    for layer, r in enumerate(rates):
        if r > current // 2:
            raise FicocoError(f"ToMe: layer {layer} merges {r} of {current} patches; at most half can merge")
        if r:
            found.append(Step(layer, r, 0, "in_layer", "vision"))
        current -= r
    return tuple(found)


def settings_for_keep(keep: int | None, n_visual: int, n_layers: int, hp: Mapping[str, Any]) -> dict[str, Any]:
    """The per-layer rates that leave `keep` patches per item; None: a constant r in every layer."""
    if keep is None:  # a constant r in every layer (ToMe's own parse_r for an int; LightCompress's r=16)
        rates, current = [], n_visual
        for _ in range(n_layers):
            rates.append(min(hp["r"], current // 2))
            current -= rates[-1]
    else:
        check_keep("ToMe", keep, n_visual)
        rates = list(tome_rates(n_visual, n_visual - keep, n_layers))
    return {"rates": rates, "prop_attn": hp["prop_attn"], "order": hp["order"]}


def extra_macs(ctx: StepContext) -> ExtraMacs:
    """Cosine scores of the A half (even positions) against the B half, head-mean keys (head_dim wide)."""
    tokens = ctx.visual_before + int(ctx.has_cls)  # units that match (Qwen2-VL: merge groups), [CLS] included
    return [(ctx.step.layer, "tome_vision_matching", ((tokens + 1) // 2) * (tokens // 2) * ctx.dims.head_dim)]


SPEC = MethodSpec(
    name="tome", title="ToMe", acts_at="vision_layer", placement="in_layer", positions="grid",
    needs=(Need("keys", "vision L", "all", "head-mean key states of the layer's attention (the matching metric)"),
           Need("hidden", "vision L", "all", "after the attention residual, before the MLP; the token sizes "
                "carried from layer to layer add log(size) to every key's logits (proportional attention)")),
    hyperparameters={"r": R, "prop_attn": PROP_ATTN, "order": ORDER}, corrections=CORRECTIONS,
    families=TESTED_FAMILIES, module=f"{__name__}.ops", function="tome_merge",
    source="facebookresearch/ToMe af95e4b",
    summary="merge the most similar patch pairs (bipartite) in every vision layer, size-weighted",
    keep_means=PER_ITEM,
    steps=steps, settings_for_keep=settings_for_keep, extra_macs=extra_macs, wired=True, merges_by_keys=True,
)
