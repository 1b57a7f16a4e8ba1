"""FiCoCo-L's tensor functions: visual-token reduction inside an LLM decoder layer
(docs/methods/ficoco.md); the spec and defaults are in ficoco.methods.ficoco_l.

The sequence is ``[prefix text] [N visual tokens] [suffix text]``; the visual span may
start at a different position in every sample (left padding, different prompts) but holds
the same ``N`` tokens. Under the causal mask only the suffix can attend to the image, so
the suffix is the text that provides the task prior. Only rows of the attention matrix that
belong to the visual span or to the suffix are read.

A sample may also hold several image spans with text between them (several images in one
prompt): pass their ``visual_positions`` and all of them are reduced together as one set of
``N`` visual tokens. The suffix is then the text after the *last* visual token, the only text
that can see every image under the causal mask (text between two spans sees the earlier
image alone and would weigh the images unequally).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ficoco.errors import FicocoError
from ficoco.methods.base import RULE
from ficoco.methods.ficoco_l import BETA, EPS, GAMMA, OFFICIAL_RULE, PAPER_RULE
from ficoco.methods.inputs import InLayerInput
from ficoco.methods.ops import (
    adaptive_weights,
    compress,
    compute_dtype,
    gather_tokens,
    main_targets,
    official_targets,
    select,
)
from ficoco.methods.ops import visual_positions as span_positions  # "visual_positions" is a parameter here
from ficoco.methods.reads.ops import AttentionReads, DenseLogits, as_reads

__all__ = ["LReduction", "fold_back", "language_correlation", "language_scores", "layer_step", "official_correlation",
           "official_layer_step", "official_scores", "reduce", "reduce_l", "reduce_l_official", "suffix_start"]


@dataclass(frozen=True)
class LReduction:
    """What one FiCoCo-L step leaves behind.

    Attributes:
        hidden: ``(B, T - r, D)`` hidden states; prefix and suffix tokens unchanged.
        kept_positions: ``(B, T - r)`` index into the input sequence of every token that
            stays (prefix, kept visual, suffix, in order), to slice position ids, rotary
            embeddings and masks alike.
        kept_visual: ``(B, N - r)`` indices within the visual span of the kept tokens.
        discarded_visual: ``(B, r)`` indices within the visual span of the removed tokens.
        merge_target: ``(B, r)`` for every removed token, the column in ``kept_visual`` of the
            kept token that received most of it; None when nothing was removed.
    """

    hidden: Tensor
    kept_positions: Tensor
    kept_visual: Tensor
    discarded_visual: Tensor
    # (B, N - r) position in the reduced sequence of every kept visual token, in order.
    visual_positions: Tensor | None = None
    merge_target: Tensor | None = None


def _visual_positions(visual_start: Tensor, num_visual: int, positions: Tensor | None = None) -> Tensor:
    """``(B, N)`` sequence positions of the visual tokens of every sample: the caller's
    ``positions`` (several spans) or one contiguous span from ``visual_start``."""
    return positions.to(torch.long) if positions is not None else span_positions(visual_start, num_visual)


def _suffix_rows(suffix_mask: Tensor, visual: Tensor) -> Tensor:
    """``(B, T)`` bool: real text tokens after the last visual token (``visual``: ``(B, N)``
    increasing positions).

    The caller's mask is intersected with "after the last visual token" so that a mask which
    also marks prefix text (or text between spans) cannot leak rows into the task prior.
    """
    positions = torch.arange(suffix_mask.shape[1], device=suffix_mask.device)
    after_span = positions.unsqueeze(0) > visual[:, -1:].to(suffix_mask.device)
    return suffix_mask.to(torch.bool) & after_span


def suffix_start(visual_start: Tensor, num_visual: int, visual_positions: Tensor | None = None) -> int:
    """The first row that can hold a suffix token in any sample (earliest end of the visual tokens).

    Reading it from the device synchronises with the host; callers that know it (the model
    adapters keep it per forward) pass it instead, so that no reducing layer waits."""
    if visual_positions is not None:
        return int(visual_positions[:, -1].min()) + 1 if visual_positions.numel() else 0
    return int(visual_start.min()) + num_visual if visual_start.numel() else 0


def _visual_blocks(attn: AttentionReads, visual: Tensor, first_row: int,
                   last_visual_row: int | None = None) -> tuple[Tensor, Tensor]:
    """What FiCoCo-L reads of a layer's attention: ``(B, N, N)`` the visual rows at the visual columns, and
    ``(B, T', N)`` the trailing rows from ``first_row`` (the earliest span end: only they can hold suffix
    tokens, about M of the T rows) at the visual columns; in the compute dtype. `last_visual_row`, the latest
    row a visual token can be in, lets a causal read of the visual rows skip the keys they cannot see."""
    batch, seq_len, _ = attn.shape
    first = min(max(first_row, 0), seq_len)
    tail = torch.arange(first, seq_len, device=visual.device).expand(batch, -1)
    among = attn.block(visual, visual, last_visual_row)
    trailing = attn.block(tail, visual, seq_len - 1)
    dtype = compute_dtype(among.dtype)
    return among.to(dtype), trailing.to(dtype)


def _on_suffix(tail: Tensor, suffix: Tensor, first_row: int) -> Tensor:
    """The trailing rows' block ``tail`` (B, T', K), zero on rows that are not suffix tokens. ``torch.where``
    rather than a product so that garbage (even NaN) in rows the method does not need cannot leak in."""
    first = min(max(first_row, 0), suffix.shape[1])
    return torch.where(suffix[:, first:].unsqueeze(2), tail, torch.zeros_like(tail))


def _check_inputs(attn: AttentionReads, visual_start: Tensor, num_visual: int, suffix_mask: Tensor,
                  visual_positions: Tensor | None = None) -> None:
    if attn.shape[1] != attn.shape[2]:
        raise ValueError(f"attn must be (B, T, T), got shape {tuple(attn.shape)}")
    batch, seq_len, _ = attn.shape
    if tuple(visual_start.shape) != (batch,):
        raise ValueError(f"visual_start must be (B,) = ({batch},), got {tuple(visual_start.shape)}")
    if tuple(suffix_mask.shape) != (batch, seq_len):
        raise ValueError(f"suffix_mask must be (B, T) = {(batch, seq_len)}, got {tuple(suffix_mask.shape)}")
    if not 0 < num_visual <= seq_len:
        raise ValueError(f"num_visual must be between 1 and the sequence length {seq_len}")
    if visual_positions is not None and tuple(visual_positions.shape) != (batch, num_visual):
        raise ValueError(f"visual_positions must be (B, N) = {(batch, num_visual)}, "
                         f"got {tuple(visual_positions.shape)}")


def _scores_of(among_visual: Tensor, tail: Tensor, suffix: Tensor, first_suffix_row: int, beta: float) -> Tensor:
    """The redundancy from the read blocks (`language_scores`)."""
    num_visual = among_visual.shape[1]
    # Entries above the diagonal are masked-out keys: ignore them even if not exactly zero. The
    # positions increase, so "query i can see key j" is i >= j in rank, across spans as well.
    sees = torch.ones(num_visual, num_visual, dtype=torch.bool, device=among_visual.device).tril()
    column_sum = torch.where(sees, among_visual, torch.zeros_like(among_visual)).sum(dim=1)
    viewers = torch.arange(num_visual, 0, -1, device=among_visual.device).to(column_sum.dtype)
    vision_term = column_sum / viewers
    text_attention = _on_suffix(tail, suffix, first_suffix_row)
    suffix_count = suffix.sum(dim=1, keepdim=True).clamp(min=1).to(text_attention.dtype)
    task_term = text_attention.sum(dim=1) / suffix_count
    return beta * vision_term - (1.0 - beta) * task_term


def _correlation_of(among_visual: Tensor, tail: Tensor, suffix: Tensor, first_suffix_row: int, source: Tensor,
                    target: Tensor, gamma: float) -> Tensor:
    """The correlation from the read blocks (`language_correlation`)."""
    batch = torch.arange(among_visual.shape[0], device=source.device).view(-1, 1, 1)
    direct = among_visual[batch, source.unsqueeze(2), target.unsqueeze(1)]
    text = _on_suffix(tail, suffix, first_suffix_row)
    text_to_source = gather_tokens(text.transpose(1, 2), source).transpose(1, 2)
    text_to_target = gather_tokens(text.transpose(1, 2), target).transpose(1, 2)
    suffix_count = suffix.sum(dim=1).clamp(min=1).to(direct.dtype).reshape(-1, 1, 1)
    indirect = (text_to_source.transpose(1, 2) @ text_to_target) / suffix_count
    return gamma * direct + (1.0 - gamma) * indirect


def language_scores(
    attn: Tensor | AttentionReads,
    visual_start: Tensor,
    num_visual: int,
    suffix_mask: Tensor,
    beta: float = BETA,
    first_suffix_row: int | None = None,
    visual_positions: Tensor | None = None,
) -> Tensor:
    """FiCoCo-L redundancy of every visual token, ``s_j = beta * v_j - (1 - beta) * t_j``.

    ``v_j`` is the mean attention visual token ``j`` receives from the visual queries that
    can see it (causal: ``i >= j``, so the column sum is divided by ``N - j``); ``t_j`` is
    the mean attention it receives from the suffix text queries. A sample without suffix
    tokens has no task prior (``t = 0``). What is read: the visual and trailing rows at the
    visual columns.

    Args:
        attn: ``(B, T, T)`` head-mean causal attention probabilities, or reads of them.
        visual_start: ``(B,)`` long position of the first visual token of every sample.
        num_visual: ``N``, visual tokens per sample.
        suffix_mask: ``(B, T)`` bool, True on real text tokens after the visual span.
        beta: weight of the vision-aware term.
        first_suffix_row: ``min(visual_start) + N`` when the caller knows it on the host;
            computed (one host synchronisation) otherwise.
        visual_positions: optional ``(B, N)`` increasing positions of the visual tokens when a
            sample holds several spans (``visual_start`` is then unused).

    Returns:
        ``(B, N)`` scores in the compute dtype; higher means more redundant.
    """
    attn = as_reads(attn)
    _check_inputs(attn, visual_start, num_visual, suffix_mask, visual_positions)
    device = suffix_mask.device
    visual = _visual_positions(visual_start.to(device=device, dtype=torch.long), num_visual, visual_positions)
    visual = visual.to(device)
    if first_suffix_row is None:
        first_suffix_row = suffix_start(visual_start, num_visual, visual)
    suffix = _suffix_rows(suffix_mask, visual)
    among_visual, tail = _visual_blocks(attn, visual, first_suffix_row)
    return _scores_of(among_visual, tail, suffix, first_suffix_row, beta)


def language_correlation(
    attn: Tensor | AttentionReads,
    source: Tensor,
    target: Tensor,
    visual_start: Tensor,
    num_visual: int,
    suffix_mask: Tensor,
    gamma: float = GAMMA,
    first_suffix_row: int | None = None,
    visual_positions: Tensor | None = None,
) -> Tensor:
    """Direct plus indirect correlation between discarded and kept visual tokens.

    ``C[i, j] = gamma * A[i, j] + (1 - gamma) * mean_{k in suffix} A[k, i] * A[k, j]``: the
    indirect term is high when the same text tokens attend to both, and is one batched
    matmul over the suffix rows.

    Args:
        attn: ``(B, T, T)`` head-mean causal attention probabilities, or reads of them.
        source: ``(B, r)`` indices within the visual span of the discarded tokens.
        target: ``(B, N - r)`` indices within the visual span of the kept tokens.
        visual_start: ``(B,)`` long position of the first visual token.
        num_visual: ``N``.
        suffix_mask: ``(B, T)`` bool, True on real text tokens after the visual span.
        gamma: weight of the direct term.
        first_suffix_row: as in :func:`language_scores`.
        visual_positions: as in :func:`language_scores`.

    Returns:
        ``(B, r, N - r)`` in the compute dtype.
    """
    attn = as_reads(attn)
    _check_inputs(attn, visual_start, num_visual, suffix_mask, visual_positions)
    device = suffix_mask.device
    visual = _visual_positions(visual_start.to(device=device, dtype=torch.long), num_visual, visual_positions)
    visual = visual.to(device)
    if first_suffix_row is None:
        first_suffix_row = suffix_start(visual_start, num_visual, visual)
    suffix = _suffix_rows(suffix_mask, visual)
    among_visual, tail = _visual_blocks(attn, visual, first_suffix_row)
    return _correlation_of(among_visual, tail, suffix, first_suffix_row, source.to(device), target.to(device), gamma)


def reduce_l(
    hidden: Tensor,
    attn: Tensor | AttentionReads,
    r: int,
    visual_start: Tensor,
    num_visual: int,
    suffix_mask: Tensor,
    beta: float = BETA,
    gamma: float = GAMMA,
    eps: float = EPS,
    protected: Tensor | None = None,
    first_suffix_row: int | None = None,
    max_protected: int | None = None,
    visual_positions: Tensor | None = None,
    last_visual_row: int | None = None,
) -> LReduction:
    """One FiCoCo-L step: filter, correlate and compress ``r`` visual tokens of one layer.

    Text tokens are copied unchanged; the kept visual tokens stay contiguous at
    ``visual_start``, so the next layer's span is ``(visual_start, N - r)``. With several spans
    (``visual_positions``) every span keeps its place and loses the tokens removed from it; the
    result's ``visual_positions`` are where the kept ones are in the reduced sequence.

    Args:
        hidden: ``(B, T, D)`` hidden states (after the attention residual, before the MLP).
        attn: ``(B, T, T)`` head-mean causal attention probabilities of the same layer, or reads
            of them; only the visual and trailing rows at the visual columns are read, once.
        r: visual tokens to remove, ``0 <= r < N``; the same for every sample.
        visual_start: ``(B,)`` long position of the first visual token of every sample.
        num_visual: ``N``, visual tokens per sample.
        suffix_mask: ``(B, T)`` bool, True on real text tokens after the visual span.
        beta: weight of the vision-aware term in the score.
        gamma: weight of the direct term in the correlation.
        eps: quantile level of the token-adaptive K.
        protected: optional ``(B, N)`` bool, visual tokens that must stay (e.g. LLaVA-NeXT's
            row separators): they are never in the source set, but still count as visual
            tokens, are scored with the others and may receive discarded tokens like any kept
            token. ``r`` may not exceed the unprotected tokens of any sample.
        first_suffix_row: ``min(visual_start) + N``, and ``max_protected``, the most protected
            tokens of any sample: host-known values the caller passes so that the step needs
            no host synchronisation; computed from the tensors when omitted.
        visual_positions: optional ``(B, N)`` increasing positions of the visual tokens of a
            sample with several image spans (text between them); they are reduced as one set.
        last_visual_row: the latest row a visual token can be in, when the caller knows it on the
            host (a causal read of the visual rows then skips the keys they cannot see).

    Returns:
        An :class:`LReduction`. With ``r == 0`` the input hidden states come back unchanged.
    """
    if hidden.dim() != 3:
        raise ValueError(f"hidden must be (B, T, D), got shape {tuple(hidden.shape)}")
    batch, seq_len, _ = hidden.shape
    attn = as_reads(attn)
    if tuple(attn.shape) != (batch, seq_len, seq_len):
        raise ValueError(f"attn must be (B, T, T) = {(batch, seq_len, seq_len)}, got {tuple(attn.shape)}")
    _check_inputs(attn, visual_start, num_visual, suffix_mask, visual_positions)
    if not 0 <= r < num_visual:
        raise FicocoError(
            f"r must be at least 0 and below the visual token count {num_visual} "
            f"(at least one visual token must stay), got {r}"
        )
    device = hidden.device
    if protected is not None:
        if tuple(protected.shape) != (batch, num_visual):
            raise ValueError(f"protected must be (B, N) = {(batch, num_visual)}, got {tuple(protected.shape)}")
        protected = protected.to(device=device, dtype=torch.bool)
        if max_protected is None:
            max_protected = int(protected.sum(dim=1).max()) if batch else 0
        removable = num_visual - max_protected
        if r > removable:
            raise FicocoError(
                f"r = {r} exceeds the {removable} visual tokens that may be removed "
                f"({num_visual - removable} of {num_visual} are protected)"
            )
    visual_start = visual_start.to(device=device, dtype=torch.long)
    visual_positions = _visual_positions(visual_start, num_visual, visual_positions).to(device)
    if r == 0:
        every_visual = torch.arange(num_visual, device=device).expand(batch, -1)
        return LReduction(
            hidden=hidden,
            kept_positions=torch.arange(seq_len, device=device).expand(batch, -1),
            kept_visual=every_visual,
            discarded_visual=every_visual[:, :0],
            visual_positions=visual_positions,
        )

    if first_suffix_row is None:
        first_suffix_row = suffix_start(visual_start, num_visual, visual_positions)
    suffix = _suffix_rows(suffix_mask.to(device), visual_positions)
    among_visual, tail = _visual_blocks(attn, visual_positions, first_suffix_row, last_visual_row)
    scores = _scores_of(among_visual, tail, suffix, first_suffix_row, beta)
    if protected is not None:
        # -inf sorts after every real score, so a protected token is never among the r selected.
        scores = scores.masked_fill(protected, float("-inf"))
    source, target = select(scores, r)
    correlation = _correlation_of(among_visual, tail, suffix, first_suffix_row, source, target, gamma)
    alpha = adaptive_weights(correlation, eps=eps)
    merged = compress(gather_tokens(hidden, visual_positions), source, target, alpha)
    return fold_back(hidden, visual_positions, source, target, merged, main_targets(alpha))


def fold_back(hidden: Tensor, visual_positions: Tensor, source: Tensor, target: Tensor, merged: Tensor,
              merge_target: Tensor | None) -> LReduction:
    """The reduced sequence: `hidden` without the discarded visual tokens (`source`, span indices), the kept ones
    (`target`) replaced by their `merged` values, every other token as it was, all in sequence order."""
    batch, seq_len, _ = hidden.shape
    r = source.shape[1]
    device = hidden.device
    # A stable sort of the 0/1 "discarded" flags lists the kept positions in sequence order
    # with the same length T - r in every sample, without a data-dependent nonzero().
    discarded_flag = torch.zeros(batch, seq_len, dtype=torch.int32, device=device)
    discarded_flag = discarded_flag.scatter(1, torch.gather(visual_positions, 1, source), 1)
    kept_positions = torch.sort(discarded_flag, dim=1, stable=True).indices[:, : seq_len - r]

    reduced = gather_tokens(hidden, kept_positions)
    # A kept token moves forward by the discarded tokens before it (one span: the prefix is
    # unchanged, so the kept visual tokens start at visual_start again).
    target_positions = torch.gather(visual_positions, 1, target)
    discarded_before = torch.gather(discarded_flag.cumsum(dim=1), 1, target_positions)
    merged_positions = target_positions - discarded_before
    reduced[torch.arange(batch, device=device).unsqueeze(1), merged_positions] = merged
    return LReduction(
        hidden=reduced,
        kept_positions=kept_positions,
        kept_visual=target,
        discarded_visual=source,
        visual_positions=merged_positions,
        merge_target=merge_target,
    )


# The spec's entry point (MethodSpec.function): one batched step.
reduce = reduce_l


def layer_step(inputs: InLayerInput, settings: Mapping[str, Any]) -> LReduction:
    """One FiCoCo-L step on what the in-layer hook point hands over (`settings`: beta, gamma, eps, and the rule:
    the paper's by default, the official code's with ``rule="official"``, `official_layer_step`)."""
    if settings.get(RULE, PAPER_RULE) == OFFICIAL_RULE:
        return official_layer_step(inputs, settings)
    return reduce(inputs.hidden, inputs.attention, inputs.remove, inputs.visual_rows[:, 0],
                  inputs.visual_rows.shape[1], inputs.suffix_mask, beta=settings["beta"], gamma=settings["gamma"],
                  eps=settings["eps"], protected=inputs.protected, first_suffix_row=inputs.first_suffix_row,
                  max_protected=inputs.max_protected, visual_positions=inputs.visual_rows,
                  last_visual_row=inputs.last_visual_row)

# ---- the official code's rule (rule="official") -------------------------------------------------------------------
#
# FiCoCo-L's official code's rule (``rule="official"``), as ficoco runs it.
#
# The rule is read from kawhiiiileo/FiCoCo at commit 8995e93bf5c62435979f500e9d335e4810301656,
# llava/model/language_model/FiCoCo_L.py and llava_llama.py (its fork yiming-l21/FiCoCo re-indents
# FiCoCo_L.py:140 and changes no rule):
#
# - the layer's scores are the head-mean raw ``q . k^T`` times the scale, taken before the causal mask and the
#   softmax (llava_llama.py:85-87), so a visual row reads the visual and text keys after it too;
# - **filter** (FiCoCo_L.py:60-86): ``s_i = beta * sum_j S[i, j] - (1 - beta) * mean_t S[i, t]`` over every visual
#   key ``j`` and every text key ``t`` after the image (the visual rows' sum minus their mean score to the text);
#   the first visual token is never removed (``include_class_token``, lines 73-74); the ``r`` highest go;
# - **correlate** (lines 94-116): ``C = gamma * S_vv + (1 - gamma) * S_vt @ S_tv`` over every visual token, its own
#   entry excluded; ``tau = quantile(C[i, :], eps)``, ``K`` the most entries above ``tau`` of any removed row; a
#   removed token's targets are its ``K`` largest ``softmax(C[i, :])`` among *all* visual tokens (removed ones
#   included), weighted by those probabilities over their sum (`ficoco.methods.ops.official_targets`);
# - **compress** (lines 118-140): every target adds the weighted removed token (the value it had entering the
#   step), with no renormalisation; what a removed token gives another removed token leaves with it.
#
# The positions of the kept tokens are re-compacted for the later layers (llava_llama.py:138-141): the model
# adapter does that (the rule's position scheme, `Rule.positions`). What ficoco does not copy (the visual span
# hard-coded to the first 576 positions, the decode-time shift, the batch-1 limits) is on docs/methods/ficoco.md.


def _official_blocks(scores: AttentionReads, visual: Tensor, suffix_mask: Tensor, first_suffix_row: int
            ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The raw scores the rule reads, in one read of the visual rows and the trailing rows (from the earliest row a
    text token after the image can be in) over every key: ``(B, N, N)`` visual to visual, ``(B, N, T')`` visual to
    the trailing tokens and ``(B, T', N)`` the trailing tokens to visual, zero where a trailing token is no text
    after the image (padding, another sample's image), and the ``(B, T')`` text flags."""
    batch, seq_len = suffix_mask.shape
    first = min(max(first_suffix_row, 0), seq_len)
    tail = torch.arange(first, seq_len, device=visual.device).expand(batch, -1)
    rows = scores.logits(torch.cat([visual, tail], dim=1))  # (B, N + T', T) float32
    count = visual.shape[1]
    positions = torch.arange(seq_len, device=visual.device)
    text = suffix_mask[:, first:].to(torch.bool) & (positions[first:].unsqueeze(0) > visual[:, -1:])
    among = torch.gather(rows[:, :count], 2, visual.unsqueeze(1).expand(-1, count, -1))
    to_text = torch.where(text.unsqueeze(1), rows[:, :count, first:], torch.zeros((), device=rows.device))
    from_text = torch.gather(rows[:, count:], 2, visual.unsqueeze(1).expand(-1, seq_len - first, -1))
    from_text = torch.where(text.unsqueeze(2), from_text, torch.zeros((), device=rows.device))
    return among, to_text, from_text, text


def official_scores(among: Tensor, to_text: Tensor, text: Tensor, beta: float = BETA) -> Tensor:
    """The official filter's score of every visual token (higher goes first), before its first token's protection:
    ``beta * (sum of its raw scores to every visual key) - (1 - beta) * (mean of its raw scores to the text)``
    (FiCoCo_L.py:68-71). `among` (B, N, N), `to_text` (B, N, T') zero off the text, `text` (B, T') its flags."""
    count = text.sum(dim=1, keepdim=True).clamp(min=1).to(to_text.dtype)
    return beta * among.sum(dim=2) - (1.0 - beta) * to_text.sum(dim=2) / count


def official_correlation(among: Tensor, to_text: Tensor, from_text: Tensor, source: Tensor,
                         gamma: float = GAMMA) -> Tensor:
    """``(B, r, N)``: the removed tokens' rows of ``gamma * S_vv + (1 - gamma) * S_vt @ S_tv`` over every visual
    token, each token's own entry -inf (FiCoCo_L.py:95-100). Only the removed rows are computed: the official code
    computes every row and reads these."""
    direct = gather_tokens(among, source)
    indirect = gather_tokens(to_text, source) @ from_text
    correlation = gamma * direct + (1.0 - gamma) * indirect
    return correlation.scatter(2, source.unsqueeze(2), float("-inf"))


def reduce_l_official(hidden: Tensor, scores: Tensor | AttentionReads, r: int, visual_positions: Tensor,
                      suffix_mask: Tensor, beta: float = BETA, gamma: float = GAMMA, eps: float = EPS,
                      protected: Tensor | None = None, first_suffix_row: int | None = None,
                      max_protected: int | None = None) -> LReduction:
    """One step of the official code's rule: filter, correlate and compress ``r`` visual tokens of one layer.

    Args:
        hidden: ``(B, T, D)`` hidden states (after the attention residual, before the MLP).
        scores: the layer's reads (their `logits`), or a ``(B, T, T)`` head-mean matrix of raw scores.
        r: visual tokens to remove, ``0 <= r < N``.
        visual_positions: ``(B, N)`` increasing positions of the visual tokens (one image span).
        suffix_mask: ``(B, T)`` True on real text tokens after the visual span.
        beta: the filter's weight of the visual term (the official code's ``g = 0.6``).
        gamma: the correlation's weight of the direct term (its ``a = 0.6``).
        eps: the quantile level of its token-adaptive K (0.998).
        protected: optional ``(B, N)`` visual tokens that must stay beside the first one (LLaVA-NeXT's newlines).
        first_suffix_row: the earliest row a text token after the image can be in, and `max_protected` the most
            `protected` tokens of any sample, when the caller knows them on the host.

    Returns:
        An `LReduction`; `merge_target` names, per removed token, the kept column its largest share went to, or
        -1 where that share went to a token removed in the same step (it leaves with it).
    """
    if hidden.dim() != 3:
        raise ValueError(f"hidden must be (B, T, D), got shape {tuple(hidden.shape)}")
    batch, seq_len, _ = hidden.shape
    num_visual = visual_positions.shape[1]
    if tuple(visual_positions.shape) != (batch, num_visual) or tuple(suffix_mask.shape) != (batch, seq_len):
        raise ValueError(f"visual_positions must be (B, N) and suffix_mask (B, T) = {(batch, seq_len)}")
    if not 0 <= r < num_visual:
        raise FicocoError(f"r must be at least 0 and below the visual token count {num_visual} "
                          f"(at least one visual token must stay), got {r}")
    device = hidden.device
    visual = visual_positions.to(device=device, dtype=torch.long)
    if r == 0:
        every = torch.arange(num_visual, device=device).expand(batch, -1)
        return LReduction(hidden=hidden, kept_positions=torch.arange(seq_len, device=device).expand(batch, -1),
                          kept_visual=every, discarded_visual=every[:, :0], visual_positions=visual)
    reads = DenseLogits(scores) if isinstance(scores, Tensor) else scores
    if first_suffix_row is None:
        first_suffix_row = suffix_start(visual[:, 0], num_visual, visual)
    among, to_text, from_text, text = _official_blocks(reads, visual, suffix_mask.to(device), first_suffix_row)
    score = official_scores(among, to_text, text, beta)
    # The first visual token is never removed (FiCoCo_L.py:73-74, include_class_token), nor a protected one.
    keep = torch.zeros(batch, num_visual, dtype=torch.bool, device=device)
    keep[:, 0] = True
    if protected is not None:
        protected = protected.to(device=device, dtype=torch.bool)
        if max_protected is None:
            max_protected = int((protected & ~keep).sum(dim=1).max()) if batch else 0
        keep |= protected
    removable = num_visual - 1 - (max_protected or 0)
    if r > removable:
        raise FicocoError(f"r = {r} exceeds the {removable} visual tokens the official rule may remove "
                          f"(the first visual token and {num_visual - removable - 1} protected ones stay)")
    source, target = select(score.masked_fill(keep, float("-inf")), r)
    targets, weights = official_targets(official_correlation(among, to_text, from_text, source, gamma), eps)
    # Every target adds the weighted removed tokens as they entered the step; no renormalisation.
    tokens = gather_tokens(hidden, visual)
    given = gather_tokens(tokens, source).unsqueeze(2) * weights.to(tokens.dtype).unsqueeze(-1)  # (B, r, K, D)
    width = tokens.shape[-1]
    flat = targets.flatten(1)
    added = tokens.scatter_add(1, flat.unsqueeze(-1).expand(-1, -1, width), given.flatten(1, 2))
    merged = gather_tokens(added, target)
    # Where each removed token's largest share went, as a column of the kept tokens (-1: a removed token).
    column = torch.full((batch, num_visual), -1, dtype=torch.long, device=device)
    column = column.scatter(1, target, torch.arange(target.shape[1], device=device).expand(batch, -1))
    main = torch.gather(column, 1, targets[:, :, 0]) if targets.shape[2] else torch.full_like(source, -1)
    return fold_back(hidden, visual, source, target, merged, main)


def official_layer_step(inputs: InLayerInput, settings: Mapping[str, Any]) -> LReduction:
    """One step of the official code's rule on what the in-layer hook point hands over (`settings`: beta, gamma,
    eps)."""
    return reduce_l_official(inputs.hidden, inputs.attention, inputs.remove, inputs.visual_rows, inputs.suffix_mask,
                             beta=settings["beta"], gamma=settings["gamma"], eps=settings["eps"],
                             protected=inputs.protected, first_suffix_row=inputs.first_suffix_row,
                             max_protected=inputs.max_protected if inputs.protected is not None else None)
