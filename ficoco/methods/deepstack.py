"""Where a method at a decoder layer's input may act on a decoder that DeepStack feeds (Qwen3-VL, dense and MoE): the
one rule the model adapter (ficoco.models.qwen3_vl.adapter) and the accountant (ficoco.accounting.methods.
check_placement) both apply, so that they refuse a schedule in the same words and `ficoco flops` prices only what
`ficoco profile` can run. No torch.

DeepStack adds tap i of the tower's features to the visual tokens after decoder layer i (layers 0..taps-1). A step
before the last addition must say which features each token it leaves stands for:
- a token it keeps stands for its own: followed (sliced to the kept tokens);
- a token it adds (SparseVLM's recycled clusters) stands for no one token: refused;
- a token that folds removed ones into itself by their hidden states (VLM-Pruner's SWA, `folds_removed`): its
  features would have to fold alike, with weights from states the features are not part of: refused.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ficoco.errors import FicocoError

# The families whose decoder DeepStack feeds, in a refusal's words: Qwen3-VL's, dense and MoE alike.
FAMILY_TITLE = "Qwen3-VL"


def check_layer_input(spec: Any, removals: Iterable[Any], taps: int) -> None:
    """Refuse a layer-input schedule (`removals`: the schedule's `Removal`s) of `spec` (a MethodSpec) on a decoder
    whose first `taps` layers still get DeepStack's additions; nothing where `taps` is 0."""
    if not taps:
        return
    early = [r for r in removals if r.stage == "llm" and r.layer < taps]
    folded = [r.layer for r in early if spec.folds_removed]
    added = [r.layer for r in early if r.added]
    if folded:
        raise FicocoError(f"variant={spec.name}: {spec.title} on {FAMILY_TITLE} folds the visual tokens it removes at "
                          f"decoder layer {folded[0]} into those it keeps by their hidden states, where DeepStack "
                          f"still adds the tower's features (after layers 0..{taps - 1}), which cannot be folded "
                          f"alike: give its step a layer from {taps} on (layer={taps})")
    if added:
        raise FicocoError(f"variant={spec.name}: {spec.title} on {FAMILY_TITLE} adds tokens at decoder layer "
                          f"{added[0]}, where DeepStack still adds the tower's features (after layers 0.."
                          f"{taps - 1}), and says not which features they stand for: give its steps layers from "
                          f"{taps} on (schedule=)")
