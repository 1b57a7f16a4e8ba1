"""FiCoCo-V as a registry entry: the algorithm lives in ficoco.reduction.ficoco_v (SPEC.md).

It acts inside vision-tower layers (after attention, before the MLP) from layer 12 up to the
layer the projector reads. The tower's in-layer hook point (ficoco.models.vision_steps.TowerPatch,
the same one ToMe uses) calls `tower_step` with the layer's tokens and its head-mean attention;
`reduce` is `reduce_v`, the batched step itself: filter, correlate and compress ``r`` patches.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ficoco.methods.hyperparameters import PAPER
from ficoco.methods.vision_stages import TowerInput, TowerOutput
from ficoco.reduction.ficoco_v import VReduction, equivalent_token_redundancy, vision_correlation, vision_scores
from ficoco.reduction.ficoco_v import reduce_v as reduce

__all__ = ["GroupReduction", "reduce", "reduce_groups", "tower_step", "vision_correlation", "vision_scores"]


def tower_step(inputs: TowerInput, settings: Mapping[str, Any]) -> TowerOutput:
    """One FiCoCo-V step on a batch of tower items ([CLS] first): `settings` carry lam, eps, window,
    coefficient and equivalent_token (score with the equivalent token instead of [CLS])."""
    if inputs.attention is None or inputs.grid_hw is None:
        raise RuntimeError("FiCoCo-V needs the layer's head-mean attention and the item grid from the adapter")
    items, tokens = inputs.hidden.shape[:2]
    patches = tokens - int(inputs.has_cls)
    grid = inputs.positions[:, int(inputs.has_cls):] - int(inputs.has_cls) if inputs.positions is not None else \
        torch.arange(patches, device=inputs.hidden.device).expand(items, -1)
    red = reduce(inputs.hidden, inputs.attention, inputs.remove, grid, inputs.grid_hw, has_cls=inputs.has_cls,
                 keys=inputs.keys, lam=settings["lam"], eps=settings["eps"], window=settings["window"],
                 coefficient=settings["coefficient"], equivalent=settings["equivalent_token"])
    cls = torch.zeros(items, int(inputs.has_cls), dtype=red.grid_index.dtype, device=red.grid_index.device)
    merged = None if red.merge_target is None else torch.gather(red.grid_index, 1, red.merge_target)
    return TowerOutput(hidden=red.hidden, kept=red.grid_index,
                       positions=torch.cat([cls, red.grid_index + int(inputs.has_cls)], dim=1),
                       discarded=red.discarded_grid, merged_into=merged)


# ---- Qwen2-VL: patches that leave in 2 x 2 merge groups (the packed tower's hook point calls this) --------

@dataclass(frozen=True)
class GroupReduction:
    """One FiCoCo-V step on merge groups.

    Attributes:
        hidden: ``(B, (G - r) * merge, D)`` the kept groups' patches, members consecutive.
        kept_groups: ``(B, G - r)`` original group index (row-major on the group grid) of every
            kept group, increasing.
        discarded_groups: ``(B, r)`` original group index of every removed group, increasing.
        kept_positions: ``(B, G - r)`` index of every kept group in the input sequence of groups.
        merge_target: ``(B, r)`` for every removed group, the column in ``kept_groups`` of the
            group that received most of it (member m went into member m); None when none was removed.
    """

    hidden: Tensor
    kept_groups: Tensor
    discarded_groups: Tensor
    kept_positions: Tensor
    merge_target: Tensor | None = None


def reduce_groups(hidden: Tensor, attn: Tensor, keys: Tensor, r: int, group_index: Tensor,
                  group_grid: tuple[int, int], *, merge: int = 4, lam: float = PAPER.lam, eps: float = PAPER.eps,
                  window: int = PAPER.window, coefficient: float = PAPER.coefficient) -> GroupReduction:
    """FiCoCo-V on patches that leave in groups of `merge` consecutive tokens.

    A group's redundancy is the mean of its members' (`lam * v_j - (1 - lam) * a_j`, `a_j`
    from the equivalent token of `keys`), its correlation to another group is the mean
    attention between their members, and compressing folds member `m` of a discarded group
    into member `m` of the kept groups it correlates with. The local penalty acts on the grid
    of groups.

    Args:
        hidden: ``(B, G * merge, D)`` patches of one image per sample, members consecutive.
        attn: ``(B, T, T)`` head-mean attention probabilities of the layer (T = G * merge).
        keys: ``(B, H, T, d)`` the layer's key states.
        r: groups to remove, ``0 <= r < G``.
        group_index: ``(B, G)`` original group index of every current group (row-major on
            the group grid).
        group_grid: ``(rows, cols)`` of the original group grid.

    Returns:
        A :class:`GroupReduction`.
    """
    batch, tokens, dim = hidden.shape
    if tokens % merge:
        raise ValueError(f"{tokens} tokens are not whole groups of {merge}")
    groups = tokens // merge
    # Both terms of the score are linear, so the mean of the members' scores is the score of
    # the members' mean terms; the correlation is the block mean of the attention.
    semantic = equivalent_token_redundancy(keys, has_cls=False).view(batch, groups, merge).mean(dim=2)
    group_attn = attn.view(batch, groups, merge, groups, merge).mean(dim=(2, 4))
    # reduce_v reads the semantic term of its score from the [CLS] query's row (A[0, j]).
    # Groups have no [CLS], so a stand-in row 0 carries the groups' equivalent-token term there;
    # the stand-in token is never removed and is dropped below. The members of a group travel
    # as one vector of merge x D, so compress folds them member by member.
    stand_in = group_attn.new_zeros(batch, 1 + groups, 1 + groups)
    stand_in[:, 0, 1:] = semantic.to(stand_in.dtype)
    stand_in[:, 1:, 1:] = group_attn
    vectors = torch.cat([hidden.new_zeros(batch, 1, merge * dim), hidden.reshape(batch, groups, merge * dim)], 1)
    red: VReduction = reduce(vectors, stand_in, r, group_index, group_grid, has_cls=True, lam=lam, eps=eps,
                               window=window, coefficient=coefficient)
    return GroupReduction(
        hidden=red.hidden[:, 1:].reshape(batch, -1, dim),
        kept_groups=red.grid_index,
        discarded_groups=red.discarded_grid,
        kept_positions=red.kept_positions[:, 1:] - 1,
        merge_target=red.merge_target,
    )
