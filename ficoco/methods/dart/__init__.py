"""DART (docs/methods/dart.md): at the input of decoder layer K, keep pivot tokens and the image tokens
least similar to them (least duplicated).

This module is its spec, its defaults (the official scripts') and its schedule arithmetic; no torch.
Its tensor functions are in `ops`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ficoco.errors import FicocoError
from ficoco.methods.base import ExtraMacs, MethodSpec, Need, Step, StepContext
from ficoco.methods.common import ALL_FAMILIES, check_keep, check_layer

LAYER = 2  # K (--pruned_layer 2)
PIVOT_IMAGE = 4  # image pivots: the image tokens with the largest key L1 norm
PIVOT_TEXT = 4  # text pivots: the text tokens after the image with the largest key L1 norm
MAX_NUM_TRUNCTION = 128  # the official name: the row's N (TOKEN_TOPK = N // pivots)


def retained(settings: Mapping[str, Any], n_visual: int) -> int:
    """Image tokens that stay: the image pivots and TOKEN_TOPK picks per pivot."""
    pivots = settings["pivot_image"] + settings["pivot_text"]
    per_pivot = settings["max_num_trunction"] // pivots  # TOKEN_TOPK
    picks = min(n_visual - settings["pivot_image"], pivots * per_pivot)
    return settings["pivot_image"] + max(0, picks)


def steps(settings: Mapping[str, Any], n_visual: int, n_layers: int) -> tuple[Step, ...]:
    """One step at layer K removing what is not retained."""
    check_layer("DART", settings["layer"], n_layers)
    if settings["pivot_image"] > n_visual:
        raise FicocoError(f"DART: {settings['pivot_image']} image pivots exceed the {n_visual} visual tokens")
    kept = retained(settings, n_visual)
    return (Step(settings["layer"], n_visual - kept),) if kept < n_visual else ()


def settings_for_keep(keep: int | None, n_visual: int, n_layers: int, hp: Mapping[str, Any]) -> dict[str, Any]:
    """The official scripts pass (reduction_ratio, max_num_trunction) = (0.778, 128) for "128": the target is
    the row's N, and 4 image pivots + 8 pivots x N // 8 picks stay (132 for 128)."""
    settings = {key: hp[key] for key in ("layer", "pivot_image", "pivot_text")}
    settings["max_num_trunction"] = hp["max_num_trunction"] if keep is None else keep
    check_keep("DART", settings["max_num_trunction"], n_visual)
    return settings


def extra_macs(ctx: StepContext) -> ExtraMacs:
    """Cosine similarity of every pivot's normed hidden state with every image token."""
    s = ctx.settings
    pivots = s["pivot_image"] + s["pivot_text"]
    return [(ctx.step.layer - 1, "dart_pivot_similarity", pivots * ctx.visual_before * ctx.dims.hidden)]


SPEC = MethodSpec(
    name="dart", title="DART", acts_at="llm_layer", placement="layer_input", positions="original",
    needs=(Need("keys", "L-1", "visual+suffix", "post-RoPE key states of layer K-1, heads concatenated"),
           Need("hidden", "L-1", "all", "the output of layer K-1 through the final norm (model.norm)")),
    hyperparameters={"layer": LAYER, "pivot_image": PIVOT_IMAGE, "pivot_text": PIVOT_TEXT,
                     "max_num_trunction": MAX_NUM_TRUNCTION},
    families=ALL_FAMILIES, module=f"{__name__}.ops", function="dart_reduce",
    source="ZichenWen1/DART 5a19452 (its history in the fork xqy1111111/DART)",
    summary="keep pivots and the tokens least similar to them",
    keep_means="max_num_trunction (4 image pivots + 8 x N // 8 tokens stay)",
    steps=steps, settings_for_keep=settings_for_keep, extra_macs=extra_macs, wired=True,
)
