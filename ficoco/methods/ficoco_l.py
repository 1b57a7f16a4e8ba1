"""FiCoCo-L as a registry entry: the algorithm lives in ficoco.reduction.ficoco_l (SPEC.md).

It acts inside decoder layers (after attention, before the MLP) from layer 4 on. The decoder's
in-layer hook point (ficoco.models.llm_steps.InLayerPatch) calls `layer_step` with the layer's
tokens and its head-mean attention; `reduce` is `reduce_l`, the batched step itself: filter,
correlate and compress ``r`` visual tokens of one layer, kept tokens at their original positions.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ficoco.methods.stages import InLayerInput
from ficoco.reduction.ficoco_l import LReduction, language_correlation, language_scores
from ficoco.reduction.ficoco_l import reduce_l as reduce

__all__ = ["language_correlation", "language_scores", "layer_step", "reduce"]


def layer_step(inputs: InLayerInput, settings: Mapping[str, Any]) -> LReduction:
    """One FiCoCo-L step on what the in-layer hook point hands over (`settings`: beta, gamma, eps)."""
    return reduce(inputs.hidden, inputs.attention, inputs.remove, inputs.visual_rows[:, 0],
                  inputs.visual_rows.shape[1], inputs.suffix_mask, beta=settings["beta"], gamma=settings["gamma"],
                  eps=settings["eps"], protected=inputs.protected, first_suffix_row=inputs.first_suffix_row,
                  max_protected=inputs.max_protected, visual_positions=inputs.visual_rows)
