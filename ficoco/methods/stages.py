"""Pieces the in-LLM methods share: top-k with a fixed tie rule, one attention row from q and k,
and rebuilding a sequence around its kept visual tokens.

Every function works on a whole batch. A sample's visual span is ``[visual_start[b],
visual_start[b] + N)``: the span may start anywhere (left padding, different prompts) but
holds the same ``N`` tokens in every sample, and with left padding the last prompt token is
position ``T - 1`` in every sample. The text after the span (the suffix) is every position
from the span's end on.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ficoco.errors import FicocoError
from ficoco.reduction.stages import compute_dtype, gather_tokens


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
            numbered on from its first position, the suffix shifted down by the tokens that left).
        attention_mask: ``(B, T')`` the input's 2-D padding mask carried along (added tokens are
            real), or None when none was given.
        kept_visual: ``(B, k)`` indices within the span of the kept visual tokens, ascending.
        num_visual: visual tokens after the step (kept plus added); the span still starts at
            ``visual_start``.
    """

    hidden: Tensor
    kept_positions: Tensor
    position_ids: Tensor
    attention_mask: Tensor | None
    kept_visual: Tensor
    num_visual: int


def check_span(hidden: Tensor, visual_start: Tensor, num_visual: int) -> None:
    """Shapes of a batched call: hidden ``(B, T, D)``, ``visual_start`` ``(B,)``, ``0 < N <= T``."""
    if hidden.dim() != 3:
        raise ValueError(f"hidden must be (B, T, D), got shape {tuple(hidden.shape)}")
    if tuple(visual_start.shape) != (hidden.shape[0],):
        raise ValueError(f"visual_start must be (B,) = ({hidden.shape[0]},), got {tuple(visual_start.shape)}")
    if not 0 < num_visual <= hidden.shape[1]:
        raise ValueError(f"num_visual must be between 1 and the sequence length {hidden.shape[1]}, got {num_visual}")


def top_indices(scores: Tensor, k: int) -> Tensor:
    """``(B, k)`` indices of the ``k`` highest scores, returned ascending (original order).

    Equal scores are taken lowest index first (a stable descending sort): ``torch.topk``, which
    the official codes call, leaves the order among ties unspecified, so the two agree wherever
    the scores differ.
    """
    if not 0 <= k <= scores.shape[1]:
        raise FicocoError(f"cannot keep {k} of {scores.shape[1]} tokens")
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :k]
    return torch.sort(order, dim=1).values


def last_row_attention(query: Tensor, keys: Tensor, key_mask: Tensor | None = None,
                       scale: float | None = None) -> Tensor:
    """Softmax probabilities of one query row per sample over all keys, per head.

    This is the probe FastV and PDrop need (the last prompt token's attention row), computed
    from post-RoPE q and k so that the layer itself keeps running SDPA. The causal mask hides
    nothing from the last row; padding keys are masked.

    Args:
        query: ``(B, H, d)`` the row's query, post-RoPE.
        keys: ``(B, H_kv, T, d)`` post-RoPE keys; ``H`` must be a multiple of ``H_kv`` (GQA).
        key_mask: ``(B, T)`` bool or 0/1, True on real tokens; None: all real.
        scale: logit scale, ``1 / sqrt(d)`` by default.

    Returns:
        ``(B, H, T)`` probabilities in float32 (or wider).
    """
    batch, heads, dim = query.shape
    kv_heads = keys.shape[1]
    if heads % kv_heads:
        raise ValueError(f"query heads {heads} are not a multiple of key heads {kv_heads}")
    dtype = compute_dtype(query.dtype)
    k = keys.to(dtype).repeat_interleave(heads // kv_heads, dim=1)
    logits = torch.einsum("bhd,bhtd->bht", query.to(dtype), k) * (dim**-0.5 if scale is None else scale)
    if key_mask is not None:
        logits = logits.masked_fill(~key_mask.to(torch.bool).unsqueeze(1), float("-inf"))
    return torch.softmax(logits, dim=-1)


def rebuild(hidden: Tensor, kept_visual: Tensor, visual_start: Tensor, num_visual: int, position_ids: Tensor,
            positions: str, attention_mask: Tensor | None = None, added: Tensor | None = None) -> Reduced:
    """The sequence ``[prefix, kept visual (original order), added, suffix]`` of every sample.

    Args:
        hidden: ``(B, T, D)``.
        kept_visual: ``(B, k)`` ascending indices within the span of the tokens that stay.
        visual_start: ``(B,)``; num_visual: ``N``.
        position_ids: ``(B, T)`` the input's position ids.
        positions: ``"original"`` (FastV, DART) or ``"compact"`` (PDrop, SparseVLM).
        attention_mask: optional ``(B, T)`` 2-D padding mask.
        added: optional ``(B, C, D)`` tokens placed right after the kept visual tokens.

    Returns:
        A :class:`Reduced`. Kept tokens are copied bit for bit.
    """
    if positions not in ("original", "compact"):
        raise ValueError(f"unknown position scheme {positions!r}")
    batch, seq_len, _ = hidden.shape
    device = hidden.device
    kept = kept_visual.shape[1]
    extra = 0 if added is None else added.shape[1]
    start = visual_start.to(device=device, dtype=torch.long).unsqueeze(1)
    removed = num_visual - kept
    out_len = seq_len - removed + extra
    slot = torch.arange(out_len, device=device).unsqueeze(0)
    # Output slot -> input position: prefix as is; kept visual via kept_visual; added: -1; suffix shifted.
    in_prefix = slot < start
    in_kept = (slot >= start) & (slot < start + kept)
    in_added = (slot >= start + kept) & (slot < start + kept + extra)
    kept_index = (slot - start).clamp(0, max(kept - 1, 0))
    from_kept = start + torch.gather(kept_visual.to(torch.long), 1, kept_index) if kept else slot
    from_suffix = (slot + removed - extra).expand(batch, -1)
    source = torch.where(in_prefix, slot, torch.where(in_kept, from_kept, from_suffix))
    source = torch.where(in_added, torch.full_like(source, -1), source)
    gathered = gather_tokens(hidden, source.clamp(min=0))
    if extra:
        added_index = (slot - start - kept).clamp(0, extra - 1)
        placed = gather_tokens(added.to(hidden.dtype), added_index)
        gathered = torch.where(in_added.unsqueeze(-1), placed, gathered)
    if positions == "original":
        if extra:
            raise ValueError("added tokens have no original position; use the compact scheme")
        new_positions = torch.gather(position_ids, 1, source)
    else:
        first = torch.gather(position_ids, 1, start)
        span_positions = first + (slot - start)
        suffix_positions = torch.gather(position_ids, 1, from_suffix.clamp(max=seq_len - 1)) - (removed - extra)
        prefix_positions = torch.gather(position_ids, 1, slot.clamp(max=seq_len - 1).expand(batch, -1))
        new_positions = torch.where(in_prefix, prefix_positions,
                                    torch.where(in_kept | in_added, span_positions, suffix_positions))
    mask = None
    if attention_mask is not None:
        mask = torch.gather(attention_mask, 1, source.clamp(min=0))
        mask = torch.where(in_added, torch.ones_like(mask), mask)
    return Reduced(hidden=gathered, kept_positions=source, position_ids=new_positions, attention_mask=mask,
                   kept_visual=kept_visual, num_visual=kept + extra)


def rows_attention(query_rows: Tensor, keys: Tensor, visible: Tensor, scale: float | None = None) -> Tensor:
    """Head-mean softmax probabilities of some query rows over all keys (SparseVLM's rater rows).

    Args:
        query_rows: ``(B, H, M, d)`` the rows' queries, post-RoPE.
        keys: ``(B, H_kv, T, d)`` post-RoPE keys (GQA: ``H`` a multiple of ``H_kv``).
        visible: ``(B, M, T)`` bool, True where row ``m`` may attend key ``t`` (causal and padding).
        scale: logit scale, ``1 / sqrt(d)`` by default.

    Returns:
        ``(B, M, T)`` float32 (or wider) probabilities averaged over heads; a row with no
        visible key (a padding row) is all zeros.
    """
    heads, dim = query_rows.shape[1], query_rows.shape[-1]
    kv_heads = keys.shape[1]
    if heads % kv_heads:
        raise ValueError(f"query heads {heads} are not a multiple of key heads {kv_heads}")
    dtype = compute_dtype(query_rows.dtype)
    k = keys.to(dtype).repeat_interleave(heads // kv_heads, dim=1)
    logits = torch.matmul(query_rows.to(dtype), k.transpose(-1, -2)) * (dim**-0.5 if scale is None else scale)
    logits = logits.masked_fill(~visible.unsqueeze(1), float("-inf"))
    return torch.nan_to_num(torch.softmax(logits, dim=-1)).mean(dim=1)


@dataclass
class StepInput:
    """What the model adapter hands a method at the input of a reducing decoder layer ``L``.

    A method's module offers ``step(inputs, settings) -> Reduced`` (and, if it reads the input
    embeddings, ``prepare(embeds, visual_start, num_visual) -> state``); the adapter fills only
    what the method's registry entry says it needs, the rest stays None.

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


@dataclass(frozen=True)
class InLayerInput:
    """What the model adapter hands a method that acts inside decoder layer ``L`` (after its attention
    residual, before its MLP; FiCoCo-L). A method's module offers
    ``layer_step(inputs, settings) -> LReduction`` (ficoco.reduction.ficoco_l's result type: the
    kept positions of the sequence and of the visual tokens, the discarded ones and their merge
    targets, where the kept visual tokens are afterwards).

    Attributes:
        hidden: ``(B, T, D)`` the layer's tokens after the attention residual.
        attention: ``(B, T, T)`` head-mean probabilities of this call's queries over this call's keys
            (the layer's own attention, computed once by the probe; keys of earlier turns left out).
        remove: visual tokens to remove at this layer, all image spans of a sample together.
        visual_rows: ``(B, N)`` where the visual tokens are in the current sequence (several spans).
        suffix_mask: ``(B, T)`` True on real text tokens after the last visual token.
        first_suffix_row: the earliest row a suffix token can be in (host-known).
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

