"""FiCoCo-V's official code's rule (``rule="official"``), as ficoco runs it: the tensor functions.

The rule is read from kawhiiiileo/FiCoCo at commit 8995e93bf5c62435979f500e9d335e4810301656,
llava/model/multimodal_encoder/FiCoCo_V.py and clip_encoder.py (its fork yiming-l21/FiCoCo only casts the
quantile's input to float32 and sets r = 32):

- the layer's scores are the head-mean raw ``q . k^T`` times the scale, before the softmax
  (clip_encoder.py:46-56);
- **filter** (FiCoCo_V.py:72-123): the [CLS] row over the patches and every patch row's mean over the patch
  keys (the attention a patch *gives*), each scaled to unit L2 norm over the patches;
  ``d_j = lam * cls_j - (1 - lam) * row_j`` (``beta = 0.35`` on the [CLS] term); in every ``W x W`` window of the
  patch grid the *lowest* ``d`` is halved when positive and doubled when not (``c = 2``); the ``r`` lowest go, [CLS]
  never;
- **correlate** (lines 127-141): a removed patch's row of raw scores over every token ([CLS] and itself included);
  ``tau = quantile(row, eps)``, ``K`` the most entries above ``tau`` of any removed row; its targets are its ``K``
  largest ``softmax(row)`` among every token, weighted by those probabilities over their sum
  (`ficoco.methods.ops.official_targets`);
- **compress** (lines 15-39, 143-168): every target ``j`` becomes ``(x_j + sum_i w_ij x_i) / (1 + sum_i w_ij)``
  (its size, 1, plus the weights it received); what a removed patch gives itself or another removed one leaves
  with it.

ficoco keeps the token order, [CLS] at 0 and every patch's grid place, where the official code reorders the
tokens by score and scatters by original indices into the reordered tensor; docs/methods/ficoco.md lists that and
the rest of what is not copied (the module-global score buffer, the batch-1 head mean).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ficoco.errors import FicocoError
from ficoco.methods.ficoco_v import COEFFICIENT, EPS, LAM, WINDOW
from ficoco.methods.ficoco_v.ops import VReduction, local_penalty
from ficoco.methods.inputs import TowerInput, TowerOutput
from ficoco.methods.ops import gather_tokens, official_targets, select
from ficoco.methods.reads.ops import AttentionReads, DenseLogits

__all__ = ["official_scores", "reduce_v_official", "tower_step"]


def official_scores(scores: Tensor, lam: float = LAM) -> Tensor:
    """``(B, N)`` the official filter's score of every patch before the local penalty (lower goes first):
    ``lam * cls - (1 - lam) * row``, the [CLS] row and the patch rows' means over the patch keys of the raw scores
    `scores` ((B, 1 + N, 1 + N), [CLS] first), each at unit L2 norm over the patches (FiCoCo_V.py:74-82)."""
    cls = F.normalize(scores[:, 0, 1:], p=2, dim=-1)
    given = F.normalize(scores[:, 1:, 1:].mean(dim=-1), p=2, dim=-1)
    return lam * cls - (1.0 - lam) * given


def reduce_v_official(hidden: Tensor, scores: Tensor | AttentionReads, r: int, grid_index: Tensor,
                      grid_hw: tuple[int, int], lam: float = LAM, eps: float = EPS, window: int = WINDOW,
                      coefficient: float = COEFFICIENT) -> VReduction:
    """One step of the official code's vision rule on a tower layer with [CLS] at position 0.

    Args:
        hidden: ``(B, 1 + N, D)`` hidden states (after the attention residual, before the MLP), [CLS] first.
        scores: the layer's reads (their `logits`), or a ``(B, 1 + N, 1 + N)`` head-mean matrix of raw scores.
        r: patches to remove, ``0 <= r < N``.
        grid_index: ``(B, N)`` original-grid flat index of every current patch.
        grid_hw: the original patch grid (rows, cols).
        lam: the filter's weight of the [CLS] term (the official code's ``beta = 0.35``).
        eps: the quantile level of its token-adaptive K (0.998).
        window: the local penalty's window side (2); coefficient: its factor (2).

    Returns:
        A `VReduction` ([CLS] kept at 0, the patches in order); `merge_target` names, per removed patch, the kept
        patch (a column of `grid_index`) its largest share went to, or -1 where it went to [CLS] or a removed patch.
    """
    if hidden.dim() != 3:
        raise ValueError(f"hidden must be (B, T, D), got shape {tuple(hidden.shape)}")
    batch, seq_len, width = hidden.shape
    patches = seq_len - 1
    if tuple(grid_index.shape) != (batch, patches):
        raise ValueError(f"grid_index must be (B, N) = {(batch, patches)}, got {tuple(grid_index.shape)}")
    if not 0 <= r < patches:
        raise FicocoError(f"r must be at least 0 and below the patch count {patches} (at least one patch must stay), "
                          f"got {r}")
    device = hidden.device
    if r == 0:
        return VReduction(hidden=hidden, grid_index=grid_index, discarded_grid=grid_index[:, :0],
                          kept_positions=torch.arange(seq_len, device=device).expand(batch, -1))
    reads = DenseLogits(scores) if isinstance(scores, Tensor) else scores
    every = torch.arange(seq_len, device=device).expand(batch, -1)
    raw = reads.logits(every)  # (B, T, T) float32
    # The local penalty on the lowest score of every window: ficoco's (which raises the highest) on the negated
    # scores, whose highest is the lowest, raised (x c when positive) exactly as the lowest is lowered (/ c, x c).
    penalised = -local_penalty(-official_scores(raw, lam), grid_index, grid_hw, window=window, coefficient=coefficient)
    source, target = select(-penalised, r)  # the r lowest (ties: the lowest index first)
    # Correlate: the removed patches' rows over every token ([CLS] at 0), candidates for their K targets.
    targets, weights = official_targets(gather_tokens(raw, source + 1), eps)
    given = weights.to(hidden.dtype)
    flat = targets.flatten(1)
    x = hidden.scatter_add(1, flat.unsqueeze(-1).expand(-1, -1, width),
                           (gather_tokens(hidden, source + 1).unsqueeze(2) * given.unsqueeze(-1)).flatten(1, 2))
    size = torch.ones(batch, seq_len, dtype=hidden.dtype, device=device).scatter_add(1, flat, given.flatten(1))
    kept_positions = torch.cat([torch.zeros(batch, 1, dtype=torch.long, device=device), target + 1], dim=1)
    merged = gather_tokens(x / size.unsqueeze(-1), kept_positions)
    # Where each removed patch's largest share went, as a column of the kept patches (-1: [CLS] or a removed one).
    column = torch.full((batch, seq_len), -1, dtype=torch.long, device=device)
    column = column.scatter(1, target + 1, torch.arange(target.shape[1], device=device).expand(batch, -1))
    main = torch.gather(column, 1, targets[:, :, 0]) if targets.shape[2] else torch.full_like(source, -1)
    return VReduction(hidden=merged, grid_index=torch.gather(grid_index, 1, target),
                      discarded_grid=torch.gather(grid_index, 1, source), kept_positions=kept_positions,
                      merge_target=main)


def tower_step(inputs: TowerInput, settings: Mapping[str, Any]) -> TowerOutput:
    """One step of the official code's vision rule on a batch of tower items ([CLS] first)."""
    if not inputs.has_cls or inputs.merge != 1:
        raise FicocoError("FiCoCo-V rule=official reads the [CLS] row of a tower of single patches (CLIP); this "
                          "tower has none: use the default rule")
    if inputs.attention is None or inputs.grid_hw is None:
        raise RuntimeError("FiCoCo-V needs the layer's attention reads and the item grid from the adapter")
    items, tokens = inputs.hidden.shape[:2]
    grid = inputs.positions[:, 1:] - 1 if inputs.positions is not None else \
        torch.arange(tokens - 1, device=inputs.hidden.device).expand(items, -1)
    red = reduce_v_official(inputs.hidden, inputs.attention, inputs.remove, grid, inputs.grid_hw, lam=settings["lam"],
                            eps=settings["eps"], window=settings["window"], coefficient=settings["coefficient"])
    cls = torch.zeros(items, 1, dtype=red.grid_index.dtype, device=red.grid_index.device)
    merged = None
    if red.merge_target is not None:
        merged = torch.where(red.merge_target >= 0,
                             torch.gather(red.grid_index, 1, red.merge_target.clamp(min=0)), -1)
    return TowerOutput(hidden=red.hidden, kept=red.grid_index, positions=torch.cat([cls, red.grid_index + 1], dim=1),
                       discarded=red.discarded_grid, merged_into=merged)
