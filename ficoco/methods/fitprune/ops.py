"""FitPrune's tensor functions (docs/methods/fitprune.md): the deletion inside one decoder layer; the spec, the
published schemes and the scaling rule are in ficoco.methods.fitprune.

The official rule (ywh187/FitPrune d28e418, LLaVA_1.5/llava/model/language_model/modeling_llama.py:392-405), on
the layer's softmaxed attention ``A`` of batch 1, its visual span at rows and columns ``[35, 35 + n_v)``:

- ``A_max = A.max(dim=1)``: the largest probability any head gives each query and key (:393);
- ``self_j = sum_i A_max[i, j] / n_v`` over the visual rows ``i`` (:395-396);
- ``cross_j = sum_k A_max[k, j]`` over every row ``k`` after the visual span, the text (:398);
- the ``delete_scheme[l]`` tokens of lowest ``cross_j * self_j`` (an ascending sort) are deleted (:400-402): the
  attention output's rows before o_proj (:405) and the residual's (:495-499), so the layer's MLP and every later
  layer see the others, in their order, at their original positions (:812). The layer's own KV cache keeps all.

Batched here: the visual tokens are found per sample (`InLayerInput.visual_rows`: every image span of the
prompt, ranked together), the text rows are the real tokens after the last visual token (`suffix_mask`: no
padding; with several images the text after the last, the only text that sees every image), ties go to the lower
index (a stable sort), and a protected token (LLaVA-NeXT's row newlines) is never deleted.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ficoco.errors import FicocoError
from ficoco.methods.inputs import InLayerInput
from ficoco.methods.ops import compute_dtype, gather_tokens
from ficoco.methods.reads.ops import AttentionReads, as_reads

__all__ = ["FitPruneReduction", "fitprune_reduce", "fitprune_scores", "layer_step"]


@dataclass(frozen=True)
class FitPruneReduction:
    """What one FitPrune deletion leaves (the in-layer contract's result, ficoco.methods.contract.InLayerModule).

    Attributes:
        hidden: ``(B, T - r, D)`` the kept tokens' hidden states, in order.
        kept_positions: ``(B, T - r)`` index into the input sequence of every token that stays.
        kept_visual: ``(B, N - r)`` indices within the visual tokens of the kept ones, ascending.
        discarded_visual: ``(B, r)`` indices within the visual tokens of the deleted ones, ascending.
        visual_positions: ``(B, N - r)`` where the kept visual tokens are in the reduced sequence.
        merge_target: None: FitPrune merges nothing.
    """

    hidden: Tensor
    kept_positions: Tensor
    kept_visual: Tensor
    discarded_visual: Tensor
    visual_positions: Tensor
    merge_target: Tensor | None = None


def _first_text_row(visual_rows: Tensor) -> int:
    """The earliest row a text token after the last visual token can be in (one host read; callers that know it
    pass it)."""
    return int(visual_rows[:, -1].min()) + 1 if visual_rows.numel() else 0


def fitprune_scores(attn: Tensor | AttentionReads, visual_rows: Tensor, text_mask: Tensor,
                    first_text_row: int | None = None, last_visual_row: int | None = None) -> Tensor:
    """``(B, N)`` FitPrune's score of every visual token, ``cross_j * self_j`` (lower: deleted first).

    Args:
        attn: ``(B, T, T)`` the layer's head-max probabilities (a `ProbedAttention` made with ``heads="max"``, or
            the matrix itself); only the visual and trailing rows at the visual columns are read.
        visual_rows: ``(B, N)`` increasing positions of the visual tokens (several image spans: all of them).
        text_mask: ``(B, T)`` True on the text rows the cross term sums (real tokens after the last visual one).
        first_text_row: the earliest row a text token can be in, when the caller knows it on the host.
        last_visual_row: the latest row a visual token can be in (a causal read of the visual rows skips the
            keys they cannot see), when known.
    """
    attn = as_reads(attn)
    batch, seq_len, _ = attn.shape
    n_visual = visual_rows.shape[1]
    device = visual_rows.device
    if first_text_row is None:
        first_text_row = _first_text_row(visual_rows)
    first = min(max(first_text_row, 0), seq_len)
    among = attn.block(visual_rows, visual_rows, last_visual_row)  # (B, N, N): visual rows, visual columns
    tail = torch.arange(first, seq_len, device=device).expand(batch, -1)
    trailing = attn.block(tail, visual_rows, seq_len - 1)  # (B, T - first, N): the rows that may be text
    dtype = compute_dtype(among.dtype)
    among, trailing = among.to(dtype), trailing.to(dtype)
    # A visual query sees no later visual key: the block above the diagonal is the causal mask's zeros, kept at
    # zero whatever a reader holds there (the positions increase, across spans as well).
    sees = torch.ones(n_visual, n_visual, dtype=torch.bool, device=device).tril()
    self_attention = torch.where(sees, among, torch.zeros_like(among)).sum(dim=1) / n_visual
    # Only the text rows: `where` rather than a product, so that whatever a non-text row holds (padding, even NaN)
    # cannot leak in.
    text = text_mask[:, first:].to(device=device, dtype=torch.bool).unsqueeze(2)
    cross_attention = torch.where(text, trailing, torch.zeros_like(trailing)).sum(dim=1)
    return cross_attention * self_attention


def fitprune_reduce(hidden: Tensor, attn: Tensor | AttentionReads, remove: int, visual_rows: Tensor,
                    text_mask: Tensor, *, first_text_row: int | None = None, last_visual_row: int | None = None,
                    protected: Tensor | None = None, max_protected: int | None = None) -> FitPruneReduction:
    """Delete the `remove` visual tokens of lowest score (`fitprune_scores`) from every sample.

    Args:
        hidden: ``(B, T, D)`` the layer's tokens after the attention residual (the official code cuts the attention
            output before o_proj and the residual: the same rows, as o_proj acts on each row alone).
        attn: ``(B, T, T)`` the layer's head-max probabilities, or reads of them.
        remove: visual tokens to delete from every sample, ``0 <= remove < N``.
        visual_rows, text_mask, first_text_row, last_visual_row: as in `fitprune_scores`.
        protected: optional ``(B, N)`` bool, visual tokens that must stay (LLaVA-NeXT's row newlines): scored, never
            deleted; ``max_protected``, the most of them in any sample, when the caller knows it.

    Returns:
        A `FitPruneReduction`; with ``remove == 0`` the input hidden states come back unchanged.
    """
    if hidden.dim() != 3:
        raise ValueError(f"hidden must be (B, T, D), got shape {tuple(hidden.shape)}")
    batch, seq_len, _ = hidden.shape
    attn = as_reads(attn)
    if tuple(attn.shape) != (batch, seq_len, seq_len):
        raise ValueError(f"attn must be (B, T, T) = {(batch, seq_len, seq_len)}, got {tuple(attn.shape)}")
    n_visual = visual_rows.shape[1]
    if visual_rows.shape[0] != batch or tuple(text_mask.shape) != (batch, seq_len):
        raise ValueError(f"visual_rows must be (B, N) and text_mask (B, T) = {(batch, seq_len)}, got "
                         f"{tuple(visual_rows.shape)} and {tuple(text_mask.shape)}")
    if not 0 <= remove < n_visual:
        raise FicocoError(f"FitPrune deletes at least 0 and fewer than the {n_visual} visual tokens of a layer (at "
                          f"least one must stay), got {remove}")
    device = hidden.device
    visual_rows = visual_rows.to(device=device, dtype=torch.long)
    if protected is not None:
        protected = protected.to(device=device, dtype=torch.bool)
        if max_protected is None:
            max_protected = int(protected.sum(dim=1).max()) if batch else 0
        if remove > n_visual - max_protected:
            raise FicocoError(f"FitPrune deletes {remove} visual tokens where {n_visual - max_protected} of "
                              f"{n_visual} may go ({max_protected} are protected): give a smaller scheme")
    if remove == 0:
        every = torch.arange(n_visual, device=device).expand(batch, -1)
        return FitPruneReduction(hidden=hidden, kept_positions=torch.arange(seq_len, device=device).expand(batch, -1),
                                 kept_visual=every, discarded_visual=every[:, :0], visual_positions=visual_rows)
    scores = fitprune_scores(attn, visual_rows, text_mask.to(device), first_text_row, last_visual_row)
    if protected is not None:
        scores = scores.masked_fill(protected, float("inf"))  # sorts after every real score: never deleted
    # The official ascending sort (torch.sort(...).indices[:count]); stable, so that ties go to the lower index.
    order = torch.sort(scores, dim=1, stable=True).indices
    discarded = torch.sort(order[:, :remove], dim=1).values
    kept_visual = torch.sort(order[:, remove:], dim=1).values
    # The deleted tokens' rows flagged; a stable sort of the flags lists the kept rows in order, T - r per sample.
    flags = torch.zeros(batch, seq_len, dtype=torch.int32, device=device)
    flags = flags.scatter(1, torch.gather(visual_rows, 1, discarded), 1)
    kept_positions = torch.sort(flags, dim=1, stable=True).indices[:, :seq_len - remove]
    kept_rows = torch.gather(visual_rows, 1, kept_visual)
    visual_positions = kept_rows - torch.gather(flags.cumsum(dim=1), 1, kept_rows)
    return FitPruneReduction(hidden=gather_tokens(hidden, kept_positions), kept_positions=kept_positions,
                             kept_visual=kept_visual, discarded_visual=discarded, visual_positions=visual_positions)


def layer_step(inputs: InLayerInput, settings: Mapping[str, Any]) -> FitPruneReduction:
    """One FitPrune deletion on what the in-layer hook point hands over (its probe reads the head-max)."""
    return fitprune_reduce(inputs.hidden, inputs.attention, inputs.remove, inputs.visual_rows, inputs.suffix_mask,
                           first_text_row=inputs.first_suffix_row, last_visual_row=inputs.last_visual_row,
                           protected=inputs.protected, max_protected=inputs.max_protected)
