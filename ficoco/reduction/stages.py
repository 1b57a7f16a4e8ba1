"""Stages shared by FiCoCo-V and FiCoCo-L: select, token-adaptive weights, compress.

Every function works on a whole batch at once. Indices are ``long`` tensors shaped
``(B, K)`` that point into dimension 1 of the tensors they go with; ``r`` (how many tokens
leave) is the same for every sample so that all shapes stay rectangular.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ficoco.errors import FicocoError
from ficoco.methods.hyperparameters import PAPER


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype to do score, quantile and merge arithmetic in for inputs of ``dtype``.

    Half-precision inputs are promoted to float32 (bf16 has 8 bits of mantissa, too few for
    quantiles over near-equal attention values); float64 inputs stay float64.
    """
    return torch.promote_types(dtype, torch.float32)


def gather_tokens(x: Tensor, index: Tensor) -> Tensor:
    """Pick tokens along dimension 1 of ``x`` for every sample.

    Args:
        x: ``(B, N, ...)``; any number of trailing dimensions.
        index: ``(B, K)`` long indices into dimension 1 of ``x``.

    Returns:
        ``(B, K, ...)`` where ``out[b, k] = x[b, index[b, k]]``.
    """
    if index.dim() != 2 or index.shape[0] != x.shape[0]:
        raise ValueError(f"index must be (B, K) with B = {x.shape[0]}, got shape {tuple(index.shape)}")
    # Advanced indexing copies whole rows; torch.gather with an expanded index walks every
    # element and is several times slower on CPU for (B, T, D) hidden states.
    batch = torch.arange(x.shape[0], device=index.device).unsqueeze(1)
    return x[batch, index]


def visual_positions(visual_start: Tensor, num_visual: int) -> Tensor:
    """``(B, N)`` sequence positions of every sample's contiguous visual span."""
    return visual_start.to(torch.long).unsqueeze(1) + torch.arange(num_visual, device=visual_start.device)


def gather_block(matrix: Tensor, rows: Tensor, cols: Tensor) -> Tensor:
    """Pick a sub-matrix ``matrix[b, rows[b]][:, cols[b]]`` for every sample.

    Args:
        matrix: ``(B, X, Y)``.
        rows: ``(B, R)`` long indices into dimension 1.
        cols: ``(B, C)`` long indices into dimension 2.

    Returns:
        ``(B, R, C)``. Only the selected rows are read, so rows the caller never asks for
        may hold anything.
    """
    batch = torch.arange(matrix.shape[0], device=rows.device).view(-1, 1, 1)
    return matrix[batch, rows.unsqueeze(2), cols.unsqueeze(1)]


def select(scores: Tensor, r: int) -> tuple[Tensor, Tensor]:
    """Split tokens into the ``r`` most redundant (source) and the rest (target).

    Args:
        scores: ``(B, N)`` redundancy scores; higher means more redundant.
        r: how many tokens to discard, ``0 <= r <= N``.

    Returns:
        ``(source, target)``: long tensors ``(B, r)`` and ``(B, N - r)``, each sorted
        ascending so that kept tokens stay in their original order. Equal scores are
        broken lowest index first (a stable descending sort, unlike ``topk``, whose order
        among ties is unspecified).
    """
    if scores.dim() != 2:
        raise ValueError(f"scores must be (B, N), got shape {tuple(scores.shape)}")
    num_tokens = scores.shape[1]
    if not 0 <= r <= num_tokens:
        raise FicocoError(f"r must be between 0 and the token count {num_tokens}, got {r}")
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices
    source = torch.sort(order[:, :r], dim=1).values
    target = torch.sort(order[:, r:], dim=1).values
    return source, target


def adaptive_weights(correlation: Tensor, eps: float = PAPER.eps) -> Tensor:
    """Token-adaptive K: each discarded token spreads its weight over its top kept tokens.

    For row ``i`` (a discarded token) ``tau_i = quantile(C[i, :], eps)`` with linear
    interpolation; ``J_i = {j : C[i, j] >= tau_i}`` and
    ``alpha[i, j] = C[i, j] / sum_{j' in J_i} C[i, j']`` on ``J_i``, 0 elsewhere.

    The row maximum is always in ``J_i`` (added explicitly, so that rounding in the
    interpolation can never empty the set). When the selected sum of a row is not positive
    (an all-zero row, e.g. a discarded token whose every kept partner lies after it under a
    causal mask and no text token looks at it), the row falls back to uniform weights over
    ``J_i`` instead of dividing by zero; every row of the result therefore sums to 1.

    Args:
        correlation: ``(B, r, Nt)`` non-negative correlations, ``Nt >= 1``.
        eps: quantile level in ``[0, 1]``; higher keeps fewer partners.

    Returns:
        ``(B, r, Nt)`` weights in the compute dtype (float32 for half inputs).
    """
    if correlation.dim() != 3:
        raise ValueError(f"correlation must be (B, r, Nt), got shape {tuple(correlation.shape)}")
    if not 0.0 <= eps <= 1.0:
        raise FicocoError(f"eps is a quantile level and must lie in [0, 1], got {eps}")
    if correlation.shape[2] == 0:
        raise ValueError("correlation has no kept tokens to merge into (Nt = 0)")
    c = correlation.to(compute_dtype(correlation.dtype))
    if c.shape[1] == 0:
        return c.clone()
    tau = torch.quantile(c, eps, dim=2, keepdim=True, interpolation="linear")
    row_max = c.amax(dim=2, keepdim=True)
    chosen = (c >= tau) | (c == row_max)
    chosen_c = torch.where(chosen, c, torch.zeros_like(c))
    chosen_sum = chosen_c.sum(dim=2, keepdim=True)
    uniform = chosen.to(c.dtype) / chosen.sum(dim=2, keepdim=True).to(c.dtype)
    degenerate = chosen_sum <= 0
    proportional = chosen_c / torch.where(degenerate, torch.ones_like(chosen_sum), chosen_sum)
    return torch.where(degenerate, uniform, proportional)


def main_targets(alpha: Tensor) -> Tensor:
    """For every discarded token, the column of the kept token that receives its largest weight.

    With the default quantile (eps = 0.998) a discarded token feeds exactly one kept token below
    ~500 kept tokens, so this is where it went; beyond that it names the largest of its few
    partners. Pictures and reports use it (it costs one argmax, no host synchronisation).

    Args:
        alpha: ``(B, r, N - r)`` weights from :func:`adaptive_weights`.

    Returns:
        ``(B, r)`` long column indices into the kept tokens (ties: the lowest column).
    """
    return alpha.argmax(dim=2)


def compress(tokens: Tensor, source: Tensor, target: Tensor, alpha: Tensor) -> Tensor:
    """Self-preserving compress: fold the source tokens into the targets, keep the targets.

    ``X_j <- (X_j + sum_i alpha[i, j] X_i) / (1 + sum_i alpha[i, j])`` for every target
    ``j``: a weighted mean in which the kept token's own weight (1) is at least any single
    source's weight (``alpha <= 1``). A target that receives nothing is returned bit for bit
    unchanged.

    Args:
        tokens: ``(B, N, D)`` hidden states of the tokens being reduced.
        source: ``(B, r)`` indices of the discarded tokens.
        target: ``(B, N - r)`` indices of the kept tokens, in output order.
        alpha: ``(B, r, N - r)`` weights; row ``i`` belongs to ``source[:, i]``, column ``j``
            to ``target[:, j]``.

    Returns:
        ``(B, N - r, D)`` merged kept tokens in ``target`` order, in the dtype of ``tokens``
        (accumulated in float32 or wider).
    """
    expected = (tokens.shape[0], source.shape[1], target.shape[1])
    if tuple(alpha.shape) != expected:
        raise ValueError(f"alpha must be (B, r, N - r) = {expected}, got {tuple(alpha.shape)}")
    work_dtype = compute_dtype(tokens.dtype)
    discarded = gather_tokens(tokens, source).to(work_dtype)
    kept = gather_tokens(tokens, target).to(work_dtype)
    weights = alpha.to(work_dtype)
    received = weights.transpose(1, 2) @ discarded
    received_weight = weights.sum(dim=1).unsqueeze(-1)
    merged = (kept + received) / (1.0 + received_weight)
    return merged.to(tokens.dtype)
