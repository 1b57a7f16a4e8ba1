"""FiCoCo-L's official code's rule (``rule="official"``), as ficoco runs it: the tensor functions.

The rule is read from kawhiiiileo/FiCoCo at commit 8995e93bf5c62435979f500e9d335e4810301656 (its fork
yiming-l21/FiCoCo changes no line of it), llava/model/language_model/FiCoCo_L.py and llava_llama.py:

- the layer's scores are the head-mean raw ``q . k^T`` times the scale, taken before the causal mask and the
  softmax (llava_llama.py:85-87), so a visual row reads the visual and text keys after it too;
- **filter** (FiCoCo_L.py:60-86): ``s_i = beta * sum_j S[i, j] - (1 - beta) * mean_t S[i, t]`` over every visual
  key ``j`` and every text key ``t`` after the image (the visual rows' sum minus their mean score to the text);
  the first visual token is never removed (``include_class_token``, lines 73-74); the ``r`` highest go;
- **correlate** (lines 94-116): ``C = gamma * S_vv + (1 - gamma) * S_vt @ S_tv`` over every visual token, its own
  entry excluded; ``tau = quantile(C[i, :], eps)``, ``K`` the most entries above ``tau`` of any removed row; a
  removed token's targets are its ``K`` largest ``softmax(C[i, :])`` among *all* visual tokens (removed ones
  included), weighted by those probabilities over their sum (`ficoco.methods.ops.official_targets`);
- **compress** (lines 118-140): every target adds the weighted removed token (the value it had entering the
  step), with no renormalisation; what a removed token gives another removed token leaves with it.

The positions of the kept tokens are re-compacted for the later layers (llava_llama.py:138-141): the model
adapter does that (the rule's position scheme, `Rule.positions`). What ficoco does not copy (the visual span
hard-coded to the first 576 positions, the decode-time shift, the batch-1 limits) is on docs/methods/ficoco.md.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from ficoco.errors import FicocoError
from ficoco.methods.ficoco_l import BETA, EPS, GAMMA
from ficoco.methods.ficoco_l.ops import LReduction, fold_back, suffix_start
from ficoco.methods.inputs import InLayerInput
from ficoco.methods.ops import gather_tokens, official_targets, select
from ficoco.methods.reads.ops import AttentionReads, DenseLogits

__all__ = ["layer_step", "official_correlation", "official_scores", "reduce_l_official"]


def _blocks(scores: AttentionReads, visual: Tensor, suffix_mask: Tensor, first_suffix_row: int
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
    among, to_text, from_text, text = _blocks(reads, visual, suffix_mask.to(device), first_suffix_row)
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


def layer_step(inputs: InLayerInput, settings: Mapping[str, Any]) -> LReduction:
    """One step of the official code's rule on what the in-layer hook point hands over (`settings`: beta, gamma,
    eps)."""
    return reduce_l_official(inputs.hidden, inputs.attention, inputs.remove, inputs.visual_rows, inputs.suffix_mask,
                             beta=settings["beta"], gamma=settings["gamma"], eps=settings["eps"],
                             protected=inputs.protected, first_suffix_row=inputs.first_suffix_row,
                             max_protected=inputs.max_protected if inputs.protected is not None else None)
