"""HiPrune (Danielement321/HiPrune 6e83a12): anchors, buffers and registers from two tower layers' attention.

The official rule, per item (an image, a crop, a frame), before the LLM, text-agnostic
(LLaVA/llava/model/llava_arch.py:140-184; Qwen2_5_VL/qwen2_5_vl_HiPrune.py:1854-1893):

1. **Scores**: what every unit receives in a tower layer's attention, heads averaged, every query row of the
   item taken (LLaVA: the mean over CLIP's 577 rows, the [CLS] column dropped, :146-152; Qwen2.5-VL: the sum over
   the rows, then the mean over each 2x2 merge unit's patches, :570-576). The deep score reads the layer the
   projector reads (``attentions[-2]``: CLIP layer 22; Qwen: the last block), the object score the object layer
   (``attentions[l - 1]``, l = HIPRUNE_OBJECT_LAYER: 9 on CLIP, 16 on Qwen). A sum over rows is the mean times
   the item's row count: the same ranking.
2. **Anchors**: the ``round(budget * alpha / 5)`` units of highest object score (:153-157).
3. **Buffers**: every anchor's neighbours ``-1, +1, -W, +W`` (W the grid's width in units: 24 on CLIP, the merged
   width on Qwen), clamped to the item's units and deduplicated (:158-164): a neighbour past the grid's first or
   last unit becomes that unit, and the +-1 neighbours wrap across a row's end.
4. **Registers**: the ``budget - |anchors and buffers|`` units of highest deep score among the others (the
   official code subtracts 1 from the deep score of the anchors and buffers, :165-172).
5. The union in image order (a boolean mask, :174-182); every unit was projected first, the mask then keeps the
   budget (no merge). LLaVA compacts the positions; Qwen keeps each kept token's 3-D position.

**The official behaviour is the default; ficoco's correction is a named setting**: ``buffers="grid"`` takes only
the neighbours inside the grid (no wrap across a row's end, none past an edge).

Departures that are not settings (the official code's defects, fixed): the registers are the highest deep scores
*outside* the anchors and buffers, so that every item keeps exactly its budget. On LLaVA the official subtraction
of 1 does exactly that (a mean over the rows of probabilities is at most 1); on Qwen2.5-VL the score is a sum over
the rows, about 1 on average and far above it on the most attended units, so an anchor or buffer can be picked
again as a register and the official code then keeps fewer tokens than its budget. The budget is the item's own
whatever the batch (the official ``int(HIPRUNE_RETENTION / B)`` divides by every image of the batch). Ties among
equal scores go to the lowest index (``topk`` leaves them open).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from ficoco.errors import FicocoError
from ficoco.methods.hiprune import ALPHA, BUFFER_RULES, BUFFERS, anchor_count
from ficoco.methods.inputs import TowerInput, TowerOutput
from ficoco.methods.ops import gather_tokens, top_indices
from ficoco.methods.reads.ops import AttentionReads, as_reads

__all__ = ["buffered_anchors", "hiprune_select", "received", "tower_step"]


def received(attention: Tensor | AttentionReads, has_cls: bool, merge: int = 1) -> Tensor:
    """``(items, N)`` what every unit receives: the column sums of the head-mean probabilities ``(items, T, T)``
    over every query row, the [CLS] column dropped where the tower has one, averaged over each merge unit's
    ``merge`` consecutive patches (Qwen's 2x2 groups, InternVL's pixel-shuffle groups)."""
    columns = as_reads(attention).column_sum()[:, int(has_cls):]
    items, patches = columns.shape
    if patches % merge:
        raise ValueError(f"{patches} patches are not whole merge units of {merge}")
    return columns.view(items, patches // merge, merge).mean(dim=-1)


def buffered_anchors(object_scores: Tensor, anchors: int, width: int, buffers: str = BUFFERS) -> Tensor:
    """``(items, N)`` True on the anchors (the ``anchors`` highest object scores) and their buffers: the neighbours
    -1, +1, -`width`, +`width`, clamped to the item's units (``"official"``: the +-1 neighbours wrap across a row's
    end, one past the grid becomes its first or last unit) or only those inside the grid (``"grid"``)."""
    if buffers not in BUFFER_RULES:
        raise FicocoError(f"HiPrune buffers={buffers!r}: give one of {', '.join(BUFFER_RULES)}")
    items, units = object_scores.shape
    chosen = torch.zeros(items, units, dtype=torch.bool, device=object_scores.device)
    if anchors == 0:
        return chosen
    anchor = top_indices(object_scores, anchors)
    steps = torch.tensor([0, -1, 1, -width, width], device=anchor.device)
    around = anchor.unsqueeze(-1) + steps  # (items, anchors, 5)
    if buffers == "official":
        around = around.clamp(0, units - 1)
    else:
        column = anchor.unsqueeze(-1) % width
        inside = (around >= 0) & (around < units)
        inside[..., 1] &= column[..., 0] > 0  # no left neighbour in the first column
        inside[..., 2] &= column[..., 0] < width - 1  # no right neighbour in the last column
        around = torch.where(inside, around, anchor.unsqueeze(-1))
    # A tensor source, not a bool scalar: torch.jit's trace (fvcore) has no scatter overload for one.
    flat = around.flatten(1)
    return chosen.scatter(1, flat, torch.ones_like(flat, dtype=torch.bool))


def hiprune_select(deep_scores: Tensor, object_scores: Tensor, keep: int, width: int, alpha: float = ALPHA,
                   buffers: str = BUFFERS) -> Tensor:
    """``(items, keep)`` the units HiPrune keeps, ascending (image order): the anchors and their buffers
    (`buffered_anchors`), then the registers, the highest `deep_scores` among the other units, up to `keep`.

    Args:
        deep_scores: ``(items, N)`` what every unit receives in the layer the projector reads (`received`).
        object_scores: ``(items, N)`` the same in the object layer.
        keep: units each item keeps (the official ``int(HIPRUNE_RETENTION / B)``).
        width: units per row of the item's grid (the buffers' +-width neighbours).
        alpha: the official HIPRUNE_ALPHA: ``round(keep * alpha / 5)`` anchors.
        buffers: ``"official"`` (the default) or ``"grid"`` (ficoco's correction), see `buffered_anchors`.
    """
    if deep_scores.shape != object_scores.shape:
        raise ValueError(f"deep {tuple(deep_scores.shape)} and object {tuple(object_scores.shape)} scores must agree")
    units = deep_scores.shape[1]
    if not 1 <= keep <= units:
        raise FicocoError(f"HiPrune keeps 1..{units} units of an item, got {keep}")
    anchors = anchor_count(keep, alpha)
    if 5 * anchors > keep:
        raise FicocoError(f"HiPrune: {anchors} anchors and their buffers do not fit keep={keep}: give a smaller alpha")
    chosen = buffered_anchors(object_scores, anchors, width, buffers)
    # The anchors and buffers rank above every other unit (at most 5 x anchors <= keep of them), the others by their
    # deep score: the top `keep` are the anchors, the buffers and the registers.
    priority = torch.where(chosen, torch.full_like(deep_scores, float("inf")), deep_scores)
    return top_indices(priority, keep)


def tower_step(inputs: TowerInput, settings: Mapping[str, Any]) -> TowerOutput:
    """The model adapters' call after the projector: ``inputs.hidden`` is the projector's output for every unit,
    ``inputs.attention`` the reads of the layer the projector reads and ``inputs.named["object_layer"]`` those of
    the object layer; ``remove`` units leave, the rest stay in image order."""
    named = inputs.named or {}
    probe = named.get("object_layer")
    if inputs.attention is None or probe is None or probe.attention is None:
        raise RuntimeError("HiPrune needs the attention of the layer the projector reads and of the object layer "
                           "from the adapter's probes")
    if inputs.grid_hw is None:
        raise RuntimeError("HiPrune needs the item's grid (its buffers' rows) from the adapter")
    deep = received(inputs.attention, inputs.has_cls, inputs.merge)
    objects = received(probe.attention, inputs.has_cls, inputs.merge)
    units = int(inputs.hidden.shape[1])  # a plain int under torch.jit's trace too (flops --verify)
    if deep.shape[1] != units or inputs.grid_hw[0] * inputs.grid_hw[1] != units:
        raise RuntimeError(f"HiPrune scores {deep.shape[1]} units on a {inputs.grid_hw} grid; the cut holds {units}")
    kept = hiprune_select(deep, objects, units - inputs.remove, inputs.grid_hw[1],
                          alpha=float(settings.get("alpha", ALPHA)), buffers=settings.get("buffers", BUFFERS))
    return TowerOutput(hidden=gather_tokens(inputs.hidden, kept), kept=kept)
