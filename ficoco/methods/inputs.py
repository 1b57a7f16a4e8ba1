"""The records that pass between the model adapters and a method's tensor functions (the contract
of ficoco.methods.contract): what an adapter hands a method at each placement, and what the method
hands back. Plain dataclasses; importing this module imports no torch (the tensors are annotations).

- at the input of a decoder layer (``layer_input``): `StepInput` in, `Reduced` out; where the method reads
  the grid of every image (a need of kind ``grid``), `StepInput.images` holds each sample's `ImageGrids`;
- inside a decoder layer (``in_layer`` in the LLM, FiCoCo-L): `InLayerInput` in;
- before the LLM (tower layers, tower output, after the projector): `TowerInput` in, `TowerOutput` out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Mapping

    from torch import Tensor

    from ficoco.methods.reads.ops import AttentionReads


@dataclass(frozen=True)
class Reduced:
    """A sequence after a method removed (and perhaps added) visual tokens.

    Attributes:
        hidden: ``(B, T', D)``: prefix, kept visual tokens in their original order, any added
            tokens (SparseVLM's recycled clusters), suffix.
        kept_positions: ``(B, T')`` index into the input sequence of every output token, ``-1``
            for added tokens; slices anything indexed like the input (masks, rotary tables, 3-D
            position ids).
        position_ids: ``(B, T')`` position ids for the later layers: the input's own
            (``original`` scheme, gaps included) or re-compacted (``compact``: the span's tokens
            numbered on from its first position, the suffix shifted down by the tokens that left). A step of
            the ``reindexed`` scheme returns the input's own; the adapter numbers them (it knows where the span
            started before any step).
        attention_mask: ``(B, T')`` the input's 2-D padding mask carried along (added tokens are
            real), or None when none was given.
        kept_visual: ``(B, k)`` indices within the span of the kept visual tokens, ascending (``k`` may be 0: a
            withdrawal of every visual token, VTW).
        num_visual: visual tokens after the step (kept plus added; 0 after a withdrawal); the span still starts
            at ``visual_start``. A method whose count is adaptive (its settings say ``adaptive``) may leave
            fewer than the step's ``keep``, the same number in every sample.
        merge_target: ``(B, N - k)`` for a method that folds every removed token into a kept one
            (VLM-Pruner's SWA): per removed token, in ascending span order, the index into `kept_visual`
            of the kept token it joined; None for a method that only drops (the records' `merged_into`).
    """

    hidden: Tensor
    kept_positions: Tensor
    position_ids: Tensor
    attention_mask: Tensor | None
    kept_visual: Tensor
    num_visual: int
    merge_target: Tensor | None = None


@dataclass(frozen=True)
class TokenGrid:
    """One grid of visual tokens in a sample's span: an image, LLaVA-NeXT's packed crop grid, an InternVL tile,
    a video frame. ``rows x cols`` tokens laid out row-major from span index `start` (the unreduced span), one
    row every `stride` tokens (`cols`, or ``cols + 1`` where a newline token ends every row)."""

    start: int
    rows: int
    cols: int
    stride: int

    def place(self, index: int) -> tuple[int, int] | None:
        """(row, col) of span index `index` on this grid, or None where it is not one of its tokens."""
        offset = index - self.start
        if offset < 0 or offset >= self.rows * self.stride:
            return None
        row, col = divmod(offset, self.stride)
        return (row, col) if col < self.cols else None


@dataclass(frozen=True)
class ImageGrids:
    """One image (or video) of a sample's visual span as the decoder receives it, for methods that read where
    its tokens stand (a need of kind ``grid``; VLM-Pruner's spatial buffer).

    Attributes:
        start, tokens: where its placeholders are in the sample's visual span (unreduced, the spans of a sample
            one after the other in reading order) and how many.
        grids: the token grids its tokens lie on (`TokenGrid`, span indices); a token on none has no place on
            a grid (a frame's [CLS], a newline token).
        patches: ``(rows, cols)`` of the vision tower's patch grid of one of its items, before any merge of
            patches into tokens: the grid the processor reports (Qwen's ``image_grid_thw`` height and width, each
            twice the token grid's), one CLIP item's 24 x 24 for LLaVA-1.5 and each LLaVA-NeXT crop, an
            InternViT tile's 32 x 32 before pixel shuffle.
    """

    start: int
    tokens: int
    grids: tuple[TokenGrid, ...]
    patches: tuple[int, int]


@dataclass
class StepInput:
    """What the model adapter hands a method at the input of a reducing decoder layer ``L``.

    A method's module offers ``step(inputs, settings) -> Reduced`` (and, if it reads the input
    embeddings, ``prepare(embeds, visual_start, num_visual) -> state``); the adapter fills only
    what the method's spec says it needs (its probe plan), the rest stays None.

    Attributes:
        hidden: ``(B, T, D)`` the input of layer ``L`` (the output of layer ``L - 1``).
        visual_start: ``(B,)``; num_visual: the visual tokens now in the span.
        keep: visual tokens that stay before any are added (the schedule's ``N - remove``).
        stage: 0-based order of this step among the method's steps.
        position_ids: ``(B, T)`` the position ids the layers use (rebuilt by compacting methods).
        text_positions: ``(B, T)`` positions that do not move with left padding.
        attention_mask: ``(B, T)`` 2-D padding mask, or None.
        row_attention: layer ``L - 1``'s probe: ``(B, H, T)`` last-row probabilities per head, or
            ``(B, M, T)`` head-mean rows of the trailing ``M`` rows.
        keys: ``(B, T, H_kv * d)`` layer ``L - 1``'s post-RoPE keys, heads concatenated.
        query_key_row: ``(B, H, T)`` the last row recomputed with layer ``L``'s own projections.
        final_norm: the decoder's final norm, for methods that read normed hidden states.
        prepared: what ``prepare`` returned for this prefill.
        visual_ranks: ``(B, N)`` every visual token's index in the sample's unreduced span (``-1`` for a token
            a method added), the index `images` are laid out in.
        images: per sample, its images' `ImageGrids` in span order, where the method needs them (a need of
            kind ``grid``); else None.
        key_heads: the key heads ``H_kv`` that `keys` concatenates (0 without keys).
        carried: ``(B, N)`` for a method acting before the LLM and again inside it, what its part before the
            LLM handed on per visual token (`TowerOutput.carry`: ViTCoP's cluster labels, MustDrop's key set), the
            sample's items in order, following the tokens the earlier steps kept; ``-1`` on a visual token that part
            did not hand on (Video-LLaVA's frame [CLS]) or one a step added. None when that part hands nothing on.
    """

    hidden: Tensor
    visual_start: Tensor
    num_visual: int
    keep: int
    stage: int
    position_ids: Tensor
    text_positions: Tensor
    attention_mask: Tensor | None = None
    row_attention: Tensor | None = None
    keys: Tensor | None = None
    query_key_row: Tensor | None = None
    final_norm: object = None
    prepared: object = None
    visual_ranks: Tensor | None = None
    images: tuple[tuple[ImageGrids, ...], ...] | None = None
    key_heads: int = 0
    carried: Tensor | None = None


@dataclass(frozen=True)
class InLayerInput:
    """What the model adapter hands a method that acts inside decoder layer ``L`` (after its attention
    residual, before its MLP; FiCoCo-L). A method's module offers
    ``layer_step(inputs, settings) -> LReduction`` (ficoco.methods.ficoco_l.ops's result type: the
    kept positions of the sequence and of the visual tokens, the discarded ones and their merge
    targets, where the kept visual tokens are afterwards).

    Attributes:
        hidden: ``(B, T, D)`` the layer's tokens after the attention residual.
        attention: ``(B, T, T)`` head-mean probabilities of this call's queries over this call's keys
            (the layer's own attention, computed once by the probe; keys of earlier turns left out); head-max
            ones where the spec's need asks ``heads="max"`` (FitPrune).
        remove: visual tokens to remove at this layer, all image spans of a sample together.
        visual_rows: ``(B, N)`` where the visual tokens are in the current sequence (several spans).
        suffix_mask: ``(B, T)`` True on real text tokens after the last visual token.
        first_suffix_row: the earliest row a suffix token can be in (host-known); last_visual_row: the latest
            row a visual token can be in (host-known; None: unknown).
        protected: ``(B, N)`` visual tokens that must stay (LLaVA-NeXT's row newlines), or None;
            max_protected: the most of them in any sample.
    """

    hidden: Tensor
    attention: Tensor
    remove: int
    visual_rows: Tensor
    suffix_mask: Tensor
    first_suffix_row: int
    protected: Tensor | None = None
    max_protected: int = 0
    last_visual_row: int | None = None


@dataclass(frozen=True)
class TowerLayerProbe:
    """What the adapters kept of a tower layer a setting of the method names (a ``vision named`` need,
    ficoco.methods.needs), in the layout of `TowerInput`'s own `keys` and `attention`: [CLS] first where the
    tower has one, a merge unit's patches consecutive, the units in grid order.

    Attributes:
        layer: the 0-based tower layer read (the setting's value).
        keys: ``(items, H, T, d)`` its key states, or None where the adapter does not hand them (Qwen2-VL's
            packed tower hands them; the probe asks for them only where it asks for [CLS] or keys).
        cls_query: ``(items, H, d)`` the query of [CLS] there, for a ``cls`` need on a tower with [CLS]; else None.
        scale: its attention scale, where the keys come with it.
        attention: reads of its ``(items, T, T)`` head-mean probabilities (ficoco.methods.reads.ops), for an
            ``attention_rows`` need of ``all`` or ``item`` rows; else None.
    """

    layer: int
    keys: Tensor | None = None
    cls_query: Tensor | None = None
    scale: float | None = None
    attention: AttentionReads | None = None


@dataclass(frozen=True)
class TowerInput:
    """What the model adapters hand a vision-side method's `tower_step` (a batch of tower items).

    Attributes:
        hidden: ``(items, T, D)``: for an ``in_layer`` step the layer's tokens after its attention
            residual ([CLS] first when ``has_cls``); for a ``tower_output`` step the patches the
            projector would map (the layer the projector reads, [CLS] dropped); for an
            ``after_projector`` step the projector's output for every patch; for a ``tower_input`` step
            (PixelPrune) every merge group's pixels (the processor's normalisation undone, the first
            temporal frame, the group's patches side by side), before the tower runs.
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
        cls_hidden: ``(items, 1, D)`` for a ``tower_output`` cut, the [CLS] token's state at the layer the
            projector reads, where the projector can take it among the cut's tokens (VisionZip's official
            layout): the tower has [CLS], the projector maps single patches and the model does not hand
            [CLS] to the LLM itself; else None.
        image_order: the adapter keeps an ``in_layer`` step's tokens in image order (the later layers and
            the projector read them so: InternVL's pixel shuffle, the Qwen towers' merge groups); a method
            whose own order differs (ToMe's official order) returns them in image order and carries its own
            order in `TowerOutput.sequence`. False: the tokens go on in the order the method returns them.
        sequence: with ``image_order``, ``(items, T)`` the method's own order of `hidden`'s tokens as
            indices into it, as its previous step of this forward left it (`TowerOutput.sequence`); None
            before the first step (image order).
        named: per setting of a ``vision named`` need (ficoco.methods.needs: HiPrune's ``object_layer``), what
            the adapter kept of the tower layer it names (`TowerLayerProbe`); None when the method names none.
        riding: the trailing channels of `hidden` that only ride with the tokens (Qwen3-VL's DeepStack features,
            for a method of `MethodSpec.merges_by_keys`): the method merges them as it merges the tokens and
            decides nothing by them; 0: none.
        placement: where the adapter runs this step (`ficoco.methods.base.PLACEMENTS`: ``in_layer``,
            ``layer_input`` (at a tower layer's input: MustDrop's merge of layer 0's output), ``tower_output``,
            ``after_projector``, ``tower_input``), for a method whose steps sit at more than one; "" where the
            adapter does not say.
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
    cls_hidden: Tensor | None = None
    image_order: bool = False
    sequence: Tensor | None = None
    named: Mapping[str, TowerLayerProbe] | None = None
    riding: int = 0
    placement: str = ""


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
        sequence: for an adapter that keeps image order (`TowerInput.image_order`), ``(items, T')`` the
            method's own order of the tokens it returns (indices into `hidden`), carried to its next step of
            the same forward; None: image order.
        carry: for a cut of a method that acts again inside the LLM (`MethodSpec.inner`), ``(items, T')``
            non-negative integers per output token that its part in the decoder reads
            (`StepInput.carried`: ViTCoP's cluster labels, unique within a call's items; MustDrop's key set, 1 on
            its tokens); None: nothing.

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
    sequence: Tensor | None = None
    carry: Tensor | None = None
