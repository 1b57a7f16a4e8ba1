"""Pieces the methods that act before the LLM share: the [CLS] attention row of a tower layer,
its stand-in on towers without [CLS], and scores per Qwen2-VL merge group.

Every function works on a batch of tower items (images, crops, frames), ``(B, T, ...)``, with
``T`` the item's tokens ([CLS] first when the tower has one).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from ficoco.methods.stages import last_row_attention
from ficoco.reduction.ficoco_v import equivalent_token_redundancy

__all__ = ["TowerInput", "TowerOutput", "cls_attention", "equivalent_token_scores", "merge_group_scores",
           "patch_scores_from_cls", "unit_keys"]


def cls_attention(query: Tensor, keys: Tensor, scale: float | None = None) -> Tensor:
    """``(B, H, T)`` the [CLS] query's softmax over every key of a tower layer, per head.

    Args:
        query: ``(B, H, d)`` q of position 0 (``q_proj`` output, heads split; a tower applies no rotary).
        keys: ``(B, H, T, d)`` k of every position.
        scale: logit scale, ``1 / sqrt(d)`` (the layer's own) by default.

    A tower attends without a mask, so the row is exact whether the layer ran eager or SDPA.
    """
    return last_row_attention(query, keys, None, scale)


def equivalent_token_scores(keys: Tensor) -> Tensor:
    """``(B, N)`` importance of every patch on a tower without [CLS]: FiCoCo's equivalent token.

    ``-cos(mu, M_j)``, with ``M`` the head-mean keys ``(B, H, N, d) -> (B, N, d)`` and ``mu`` their
    mean over the patches (SPEC.md): a patch far from the global mean says more of its own, as a
    patch that [CLS] attends to does. Used in place of the [CLS] attention, and labelled so."""
    return equivalent_token_redundancy(keys, has_cls=False)


def merge_group_scores(scores: Tensor, merge: int) -> Tensor:
    """``(B, N / merge)`` mean score of every merge group (Qwen2-VL's PatchMerger joins ``merge``
    consecutive patches - a 2 x 2 group, as its processor orders them - into one LLM token)."""
    batch, patches = scores.shape
    if patches % merge:
        raise ValueError(f"{patches} patches do not split into groups of {merge}")
    return scores.reshape(batch, patches // merge, merge).mean(dim=-1)


# ---- the adapters' call: one interface for every method that acts before the LLM ---------------------------------

@dataclass(frozen=True)
class TowerInput:
    """What the model adapters hand a vision-side method's `tower_step` (a batch of tower items).

    Attributes:
        hidden: ``(items, T, D)``: for an ``in_layer`` step the layer's tokens after its attention
            residual ([CLS] first when ``has_cls``); for a ``tower_output`` step the patches the
            projector would map (the layer the projector reads, [CLS] dropped); for an
            ``after_projector`` step the projector's output for every patch.
        has_cls: whether the tower has a [CLS] token (position 0 of `keys`, and of an in-layer
            step's `hidden`).
        remove: units the step removes per item (the schedule's count); ``added``: units it adds.
        keys: ``(items, H, T, d)`` the key states of the layer the method reads (the layer's own
            attention computed them; a tower applies no rotary), or None when not asked for.
        cls_query: ``(items, H, d)`` the query of [CLS] in that layer, or None.
        scale: that layer's attention scale.
        size: ``(items, T)`` how many original tokens each token stands for (carried between a
            forward's in-layer steps; None before the first).
        positions: ``(items, T)`` the original token index each token continues (None: ``arange``).
        attention: ``(items, T, T)`` head-mean probabilities of every query over every key of the
            step's layer (the probe computed the layer's output from them), when the method asks for
            ``attention_rows`` of ``all`` rows; else None. For a cut on LLaVA-OneVision's pooled video
            frames, ``(items, 1, T')``: the query-mean row, pooled as the frame's grid was.
        grid_hw: the item's patch grid (rows, cols), for methods that act on the grid.
        text: ``(items, M, D)`` the LLM's input embeddings of the text after the visual span of the
            prompt each item belongs to (padded to the longest), for a method that reads the
            instruction (a need of kind ``input_embeddings``); else None. ``text_mask``: ``(items, M)``
            True on real tokens.
        frames: items that belong to one sample, consecutive (a video's frames, for a method that
            reads them together: HoliTom), or None when the adapter hands independent items.
        merge: patches per unit: 1, or Qwen2-VL's merge group (4 consecutive patches, one LLM
            token) for a cut of whole groups; `hidden` then holds one row per group (its members'
            states side by side, as the PatchMerger reads them, or the merger's output), `keys`
            every patch's.
    """

    hidden: Tensor
    has_cls: bool
    remove: int
    added: int = 0
    keys: Tensor | None = None
    cls_query: Tensor | None = None
    scale: float | None = None
    size: Tensor | None = None
    positions: Tensor | None = None
    attention: Tensor | None = None
    grid_hw: tuple[int, int] | None = None
    text: Tensor | None = None
    text_mask: Tensor | None = None
    frames: int | None = None
    merge: int = 1


@dataclass(frozen=True)
class TowerOutput:
    """What a vision-side method's `tower_step` returns.

    Attributes:
        hidden: ``(items, T', D)`` the tokens that go on (an in-layer step: [CLS] first).
        kept: ``(items, K)`` the original patch index (0..N-1) of every output token that continues
            one patch, ``-1`` for a token that does not (merged, contextual, extra) or padding.
        counts: ``(items,)`` tokens each item really hands on when items differ (an adaptive count;
            the rest of its row is padding), None when every item hands on ``T'``.
        size, positions: carried to the next in-layer step of the same forward (see `TowerInput`).
        attention_bias: ``(items, 1, 1, T')`` additive logits every later tower layer adds to its
            keys (ToMe's proportional attention), or None.
        discarded: ``(items, r)`` the original patch index of every patch the step removed, in the
            order `merged_into` follows; None: the adapter derives them (ascending).
        merged_into: ``(items, r)`` the kept patch (original index) that received the largest share
            of each discarded one, for a method that folds what it removes into kept tokens; or None.

    A cut's `positions` (optional): ``(items, T')`` the unit every output token stands at, a merged
    token included (VisionZip's contextual token: its target's), for adapters that place tokens by
    unit (Qwen2-VL's 3-D positions).
    """

    hidden: Tensor
    kept: Tensor
    counts: Tensor | None = None
    size: Tensor | None = None
    positions: Tensor | None = None
    attention_bias: Tensor | None = None
    discarded: Tensor | None = None
    merged_into: Tensor | None = None


def patch_scores_from_cls(inputs: TowerInput, reduce_heads: str = "mean") -> Tensor:
    """``(items, N)`` the [CLS] query's attention over the patches of the probed layer, heads
    reduced by ``mean`` or ``sum``; on a tower without [CLS], the equivalent token's scores."""
    if inputs.keys is None:
        raise RuntimeError("the method needs the probed layer's keys from the adapter")
    if not inputs.has_cls:
        scores = equivalent_token_scores(inputs.keys)
        return merge_group_scores(scores, inputs.merge) if inputs.merge > 1 else scores
    if inputs.cls_query is None:
        raise RuntimeError("the method needs the [CLS] query of the probed layer from the adapter")
    row = cls_attention(inputs.cls_query, inputs.keys, inputs.scale)[:, :, 1:]
    return row.sum(dim=1) if reduce_heads == "sum" else row.mean(dim=1)


def unit_keys(inputs: TowerInput) -> Tensor:
    """``(items, units, d)`` the head-mean keys of every unit's patches ([CLS] dropped), averaged over a
    merge group's patches when units are groups (a merge metric for whole groups)."""
    if inputs.keys is None:
        raise RuntimeError("the method needs the probed layer's keys from the adapter")
    keys = inputs.keys.mean(dim=1)[:, int(inputs.has_cls):]
    if inputs.merge > 1:
        items, patches, dim = keys.shape
        keys = keys.reshape(items, patches // inputs.merge, inputs.merge, dim).mean(dim=2)
    return keys
