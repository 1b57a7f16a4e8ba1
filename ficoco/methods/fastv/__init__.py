"""FastV (docs/methods/fastv.md): at the input of decoder layer K, keep the image tokens the last prompt
token attended to most in layer K-1.

This module is its spec, its defaults (the official code's) and its schedule arithmetic; no torch.
Its tensor functions are in `ops`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ficoco.errors import FicocoError
from ficoco.methods.base import ExtraMacs, MethodSpec, Need, Step, StepContext
from ficoco.methods.common import ALL_FAMILIES, LAST_ROW, check_keep, check_layer
from ficoco.methods.reads import DEFAULT_ATTENTION_SCORES, SCORES_CORRECTION

LAYER = 2  # K: the layer at whose input the image tokens are dropped
RATIO = 0.5  # R: the share of the image tokens dropped (the official default)


def steps(settings: Mapping[str, Any], n_visual: int, n_layers: int) -> tuple[Step, ...]:
    """One step at layer K removing all but `keep` image tokens."""
    layer, keep = settings["layer"], settings["keep"]
    check_layer("FastV", layer, n_layers)
    check_keep("FastV", keep, n_visual)
    return (Step(layer, n_visual - keep),) if keep < n_visual else ()


def settings_for_keep(keep: int | None, n_visual: int, n_layers: int, hp: Mapping[str, Any]) -> dict[str, Any]:
    """The setting of the literature's "`keep` tokens" row: the layer average (K layers at all N, the
    rest at the kept); None: the official ratio R."""
    layer = hp["layer"]
    check_layer("FastV", layer, n_layers)
    if keep is None:  # the official default: drop R of the image tokens (HF fork: round(N * (1 - R)))
        return {"layer": layer, "keep": max(1, round(n_visual * (1 - hp["ratio"])))}
    # The literature's "N tokens" row is the layer average: K layers at all N, L - K at k.
    kept = round((n_layers * keep - layer * n_visual) / (n_layers - layer))
    if kept < 1 or keep > n_visual:
        low = -(-(layer * n_visual + n_layers - layer) // n_layers)
        raise FicocoError(f"FastV at layer {layer} averages {low}..{n_visual} visual tokens over {n_layers} layers; "
                          f"keep={keep} is outside")
    return {"layer": layer, "keep": kept}


def extra_macs(ctx: StepContext) -> ExtraMacs:
    """The probe: q of the last prompt token against every key of layer K-1, all heads (one row)."""
    d = ctx.dims
    return [(ctx.step.layer - 1, "fastv_last_row_scores", d.heads * d.head_dim * ctx.seq_before)]


SPEC = MethodSpec(
    name="fastv", title="FastV", acts_at="llm_layer", placement="layer_input", positions="original",
    needs=(Need("attention_rows", "L-1", "last", "softmax over all keys of layer K-1, head mean, of "
                + LAST_ROW + "; recomputed from post-RoPE q and k, so SDPA stays on"),
           Need("hidden", "L", "all", "the input of layer K")),
    hyperparameters={"layer": LAYER, "ratio": RATIO,
                     "attention_scores": DEFAULT_ATTENTION_SCORES},
    corrections=SCORES_CORRECTION,
    families=ALL_FAMILIES, module=f"{__name__}.ops", function="fastv_reduce",
    source="pkunlp-icler/FastV d165972", summary="keep the image tokens the last prompt token attends to most",
    keep_means="layer-average visual tokens (K layers at all, the rest at the kept)",
    steps=steps, settings_for_keep=settings_for_keep, extra_macs=extra_macs, wired=True,
)
