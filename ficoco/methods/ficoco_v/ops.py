"""FiCoCo-V's tensor functions: visual-token reduction inside a vision encoder layer
(docs/methods/ficoco.md); the spec and defaults are in ficoco.methods.ficoco_v.

The sequence is ``[CLS]`` at position 0 followed by ``N`` patch tokens when ``has_cls``,
otherwise ``N`` patch tokens only (SigLIP, Qwen2-VL's ViT), in which case the *equivalent
token* computed from the key states stands in for ``[CLS]``. Every patch carries its flat
index on the original ``grid_h x grid_w`` grid (row-major), so that the local penalty and
later layers know where a token sits after earlier layers removed others.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ficoco.errors import FicocoError
from ficoco.methods.base import RULE
from ficoco.methods.ficoco_v import COEFFICIENT, EPS, LAM, OFFICIAL_RULE, PAPER_RULE, WINDOW
from ficoco.methods.inputs import TowerInput, TowerOutput
from ficoco.methods.ops import (
    adaptive_weights,
    compress,
    compute_dtype,
    equivalent_token_redundancy,
    gather_tokens,
    main_targets,
    official_targets,
    select,
)
from ficoco.methods.reads.ops import AttentionReads, DenseLogits, GroupReads, as_reads

__all__ = ["GroupReduction", "VReduction", "equivalent_token_redundancy", "local_penalty", "official_scores",
           "official_tower_step", "reduce", "reduce_groups", "reduce_v", "reduce_v_official", "tower_step",
           "vision_correlation", "vision_scores"]


@dataclass(frozen=True)
class VReduction:
    """What one FiCoCo-V step leaves behind.

    Attributes:
        hidden: ``(B, T - r, D)`` hidden states; ``[CLS]`` (if any) still at position 0.
        grid_index: ``(B, N - r)`` original-grid index of every kept patch, increasing.
        discarded_grid: ``(B, r)`` original-grid index of every removed patch, increasing.
        kept_positions: ``(B, T - r)`` index into the input sequence of every token that
            stays, ``[CLS]`` included, so a caller can slice position tensors alike.
        merge_target: ``(B, r)`` for every removed patch (in ``discarded_grid`` order), the
            column in ``grid_index`` of the kept patch that received most of it; None when
            nothing was removed.
        riding: ``(B, N - r, C)`` the features that rode with the patches (``riding`` of
            `reduce_v`), folded with the patches' weights; None when none rode.
    """

    hidden: Tensor
    grid_index: Tensor
    discarded_grid: Tensor
    kept_positions: Tensor
    merge_target: Tensor | None = None
    riding: Tensor | None = None

    @property
    def kept_grid(self) -> Tensor:
        """Original-grid index of every kept patch (the same tensor as ``grid_index``)."""
        return self.grid_index


def _patch_offset(has_cls: bool) -> int:
    return 1 if has_cls else 0


def vision_scores(
    attn: Tensor | AttentionReads,
    has_cls: bool,
    keys: Tensor | None = None,
    lam: float = LAM,
    equivalent: bool = False,
    semantic: Tensor | None = None,
) -> Tensor:
    """FiCoCo-V redundancy of every patch, ``s_j = lam * v_j - (1 - lam) * a_j``.

    ``v_j`` is the mean attention patch ``j`` receives from the patch queries; ``a_j`` is
    ``A[0, j]`` (the ``[CLS]`` query's attention) when ``has_cls``, else the equivalent
    token's ``-cos(mu, M_j)`` computed from ``keys``. What is read of the attention: the
    column means over the patch rows, and the [CLS] row.

    Args:
        attn: ``(B, T, T)`` head-mean attention probabilities (query dim -2, key dim -1), or
            reads of them (ficoco.methods.reads.ops).
        has_cls: whether position 0 is ``[CLS]``.
        keys: ``(B, H, T, d)`` key states; required when ``has_cls`` is False, unused otherwise.
        lam: weight of the vision-aware term.
        equivalent: use the equivalent token even when ``[CLS]`` is present (it still stays).
        semantic: ``(B, N)`` the semantic term ``a_j`` given (merge groups: their members' mean);
            nothing is read for it then.

    Returns:
        ``(B, N)`` scores in the compute dtype; higher means more redundant.
    """
    reads = as_reads(attn)
    if reads.shape[1] != reads.shape[2]:
        raise ValueError(f"attn must be (B, T, T), got shape {tuple(reads.shape)}")
    offset = _patch_offset(has_cls)
    received = reads.column_mean(first_row=offset)[:, offset:]
    received = received.to(compute_dtype(received.dtype))
    if semantic is not None:
        semantic = semantic.to(received.dtype)
    elif has_cls and not equivalent:
        cls_row = torch.zeros(reads.shape[0], 1, dtype=torch.long, device=received.device)
        semantic = reads.rows(cls_row)[:, 0, offset:].to(received.dtype)
    else:
        if keys is None:
            raise FicocoError("the equivalent token needs the layer's key states: pass keys=(B, H, T, d)")
        semantic = equivalent_token_redundancy(keys, has_cls=has_cls).to(received.dtype)
    return lam * received - (1.0 - lam) * semantic


def local_penalty(
    scores: Tensor,
    grid_index: Tensor,
    grid_hw: tuple[int, int],
    window: int = WINDOW,
    coefficient: float = COEFFICIENT,
) -> Tensor:
    """Raise the top score of every ``window x window`` cell of the original grid.

    Scores are placed on the original grid (positions removed by earlier layers are empty
    and never win), the grid is cut into non-overlapping windows (the last row/column of
    windows is partial when the grid size is not a multiple of ``window``), and in every
    non-empty window the maximum (ties: lowest flat grid index) is multiplied by
    ``coefficient`` if positive or divided by it if negative; zero stays zero. This spreads
    the discarded tokens over the image instead of emptying one region.

    Args:
        scores: ``(B, N)`` redundancy scores in sequence order.
        grid_index: ``(B, N)`` long original-grid flat index (row-major) of every token.
        grid_hw: ``(grid_h, grid_w)`` of the original grid.
        window: window side ``W``.
        coefficient: factor ``c >= 1`` applied to each window's maximum.

    Returns:
        ``(B, N)`` penalised scores in sequence order, in the dtype of ``scores``.
    """
    if scores.shape != grid_index.shape:
        raise ValueError(f"scores {tuple(scores.shape)} and grid_index {tuple(grid_index.shape)} must match")
    if window < 1:
        raise FicocoError(f"window must be at least 1, got {window}")
    grid_h, grid_w = grid_hw
    batch = scores.shape[0]
    windows_h = -(-grid_h // window)
    windows_w = -(-grid_w // window)
    # Pad the grid up to whole windows so one reshape cuts it; padding is empty like any
    # removed position (-inf never wins unless the whole window is empty, which is ignored).
    padded_w = windows_w * window
    padded_index = (grid_index // grid_w) * padded_w + grid_index % grid_w
    padded = scores.new_full((batch, windows_h * window * padded_w), float("-inf"))
    padded = padded.scatter(1, padded_index, scores)
    cells = (
        padded.reshape(batch, windows_h, window, windows_w, window)
        .permute(0, 1, 3, 2, 4)
        .reshape(batch, windows_h * windows_w, window * window)
    )
    # Row-major order inside a window is flat-grid order, and argmax returns the first
    # maximum, so ties go to the lowest grid index.
    winner_in_cell = cells.argmax(dim=2, keepdim=True)
    # A tensor source, not the scalar True: torch.jit's tracer (fvcore counts by tracing) has no
    # schema for scatter with a bool scalar and fails an internal assert.
    is_winner_cells = torch.zeros_like(cells, dtype=torch.bool).scatter(
        2, winner_in_cell, torch.ones_like(winner_in_cell, dtype=torch.bool))
    is_winner_grid = (
        is_winner_cells.reshape(batch, windows_h, windows_w, window, window).permute(0, 1, 3, 2, 4).reshape(batch, -1)
    )
    # An empty window's argmax lands on an empty position, which no token reads back.
    is_winner = torch.gather(is_winner_grid, 1, padded_index)
    raised = torch.where(scores > 0, scores * coefficient, torch.where(scores < 0, scores / coefficient, scores))
    return torch.where(is_winner, raised, scores)


def vision_correlation(attn: Tensor | AttentionReads, source: Tensor, target: Tensor, has_cls: bool) -> Tensor:
    """Direct correlation ``C[i, j] = A[patch i, patch j]`` for discarded ``i``, kept ``j``: only the
    discarded patches' rows are read, once the filter chose them.

    Args:
        attn: ``(B, T, T)`` head-mean attention probabilities, or reads of them.
        source: ``(B, r)`` patch indices (0 = first patch) of the discarded tokens.
        target: ``(B, N - r)`` patch indices of the kept tokens.
        has_cls: whether position 0 is ``[CLS]``.

    Returns:
        ``(B, r, N - r)`` in the compute dtype.
    """
    offset = _patch_offset(has_cls)
    block = as_reads(attn).block(source + offset, target + offset)
    return block.to(compute_dtype(block.dtype))


def reduce_v(
    hidden: Tensor,
    attn: Tensor | AttentionReads,
    r: int,
    grid_index: Tensor,
    grid_hw: tuple[int, int],
    has_cls: bool = True,
    keys: Tensor | None = None,
    lam: float = LAM,
    eps: float = EPS,
    window: int = WINDOW,
    coefficient: float = COEFFICIENT,
    equivalent: bool = False,
    semantic: Tensor | None = None,
    riding: Tensor | None = None,
) -> VReduction:
    """One FiCoCo-V step: filter, correlate and compress ``r`` patches of one layer.

    Args:
        hidden: ``(B, T, D)`` hidden states (after the attention residual, before the MLP).
        attn: ``(B, T, T)`` head-mean attention probabilities of the same layer, or reads of them.
        r: patches to remove, ``0 <= r < N``; the same for every sample.
        grid_index: ``(B, N)`` long original-grid flat index of every current patch.
        grid_hw: ``(grid_h, grid_w)`` of the original patch grid.
        has_cls: whether position 0 is ``[CLS]``; it is never removed nor changed.
        keys: ``(B, H, T, d)`` key states, needed only when ``has_cls`` is False.
        lam: weight of the vision-aware term in the score.
        eps: quantile level of the token-adaptive K.
        window: local-penalty window side.
        coefficient: local-penalty factor.
        equivalent: score with the equivalent token instead of ``[CLS]`` (which still stays at 0).
        semantic: ``(B, N)`` the semantic term given instead of read (``vision_scores``).
        riding: ``(B, N, C)`` per-patch features that ride with the patches (Qwen3-VL's DeepStack taps so
            far): nothing is decided from them; they are folded with the weights the patches are folded with,
            apart from the hidden states (a fold is per channel, so this equals folding them in extra channels
            of the hidden states, without the copies that would make them part of every step's tensors).

    Returns:
        A :class:`VReduction`. With ``r == 0`` the input hidden states come back unchanged.
    """
    if hidden.dim() != 3:
        raise ValueError(f"hidden must be (B, T, D), got shape {tuple(hidden.shape)}")
    batch, seq_len, _ = hidden.shape
    attn = as_reads(attn)
    if tuple(attn.shape) != (batch, seq_len, seq_len):
        raise ValueError(f"attn must be (B, T, T) = {(batch, seq_len, seq_len)}, got {tuple(attn.shape)}")
    offset = _patch_offset(has_cls)
    num_patches = seq_len - offset
    if tuple(grid_index.shape) != (batch, num_patches):
        raise ValueError(f"grid_index must be (B, N) = {(batch, num_patches)}, got {tuple(grid_index.shape)}")
    if not 0 <= r < num_patches:
        raise FicocoError(
            f"r must be at least 0 and below the patch count {num_patches} (at least one patch must stay), got {r}"
        )
    if r == 0:
        positions = torch.arange(seq_len, device=hidden.device).expand(batch, -1)
        return VReduction(
            hidden=hidden,
            grid_index=grid_index,
            discarded_grid=grid_index[:, :0],
            kept_positions=positions,
            riding=riding,
        )

    scores = vision_scores(attn, has_cls, keys=keys, lam=lam, equivalent=equivalent, semantic=semantic)
    scores = local_penalty(scores, grid_index, grid_hw, window=window, coefficient=coefficient)
    source, target = select(scores, r)
    correlation = vision_correlation(attn, source, target, has_cls)
    alpha = adaptive_weights(correlation, eps=eps)
    merged = compress(hidden[:, offset:], source, target, alpha)

    cls_positions = torch.zeros(batch, offset, dtype=torch.long, device=hidden.device)
    return VReduction(
        # Without [CLS] (merge groups, towers without one) the merged tokens are the output: no copy of them.
        hidden=torch.cat([hidden[:, :offset], merged], dim=1) if offset else merged,
        grid_index=torch.gather(grid_index, 1, target),
        discarded_grid=torch.gather(grid_index, 1, source),
        kept_positions=torch.cat([cls_positions, target + offset], dim=1),
        merge_target=main_targets(alpha),
        riding=None if riding is None else compress(riding, source, target, alpha),
    )


# The spec's entry point (MethodSpec.function): one batched step.
reduce = reduce_v


def tower_step(inputs: TowerInput, settings: Mapping[str, Any]) -> TowerOutput:
    """One FiCoCo-V step on a batch of tower items ([CLS] first): `settings` carry lam, eps, window,
    coefficient and equivalent_token (score with the equivalent token instead of [CLS]), and the rule: the paper's
    by default, the official code's with ``rule="official"`` (`official_tower_step`)."""
    if settings.get(RULE, PAPER_RULE) == OFFICIAL_RULE:
        return official_tower_step(inputs, settings)
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
        riding: ``(B, G - r, C)`` per-group features folded with the groups' weights (`reduce_groups`'
            ``riding``); None when none rode.
    """

    hidden: Tensor
    kept_groups: Tensor
    discarded_groups: Tensor
    kept_positions: Tensor
    merge_target: Tensor | None = None
    riding: Tensor | None = None


def reduce_groups(hidden: Tensor, attn: Tensor | AttentionReads, keys: Tensor | None, r: int, group_index: Tensor,
                  group_grid: tuple[int, int], *, merge: int = 4, lam: float = LAM, eps: float = EPS,
                  window: int = WINDOW, coefficient: float = COEFFICIENT, has_cls: bool = False,
                  equivalent: bool = False, riding: Tensor | None = None) -> GroupReduction:
    """FiCoCo-V on patches that leave in groups of `merge` consecutive tokens.

    A group's redundancy is the mean of its members' (`lam * v_j - (1 - lam) * a_j`, `a_j`
    from the equivalent token of `keys`), its correlation to another group is the mean
    attention between their members, and compressing folds member `m` of a discarded group
    into member `m` of the kept groups it correlates with. The local penalty acts on the grid
    of groups.

    Args:
        hidden: ``(B, G * merge, D)`` patches of one image per sample, members consecutive ([CLS] kept
            aside by the caller).
        attn: ``(B, T, T)`` head-mean attention probabilities of the layer, or reads of them (T = G * merge,
            or 1 + G * merge with [CLS] first when ``has_cls``: InternVL's pixel-shuffle groups).
        keys: ``(B, H, T, d)`` the layer's key states (for the equivalent token; unused with [CLS]).
        r: groups to remove, ``0 <= r < G``.
        group_index: ``(B, G)`` original group index of every current group (row-major on
            the group grid).
        group_grid: ``(rows, cols)`` of the original group grid.
        has_cls: ``attn`` holds [CLS] at 0: a group's semantic term is the mean of its members' ``A[0, j]``
            (the equivalent token's with ``equivalent``), as a patch's is on a tower with [CLS].
        riding: ``(B, G, C)`` per-group features that ride with the groups (Qwen3-VL's DeepStack taps so far),
            folded with the weights the groups are folded with: a group's weight applies to all its members
            alike, so its features fold as its members do.

    Returns:
        A :class:`GroupReduction`.
    """
    batch, tokens, dim = hidden.shape
    if tokens % merge:
        raise ValueError(f"{tokens} tokens are not whole groups of {merge}")
    groups = tokens // merge
    # Both terms of the score are linear, so the mean of the members' scores is the score of the members'
    # mean terms; the correlation is the block mean of the attention (GroupReads reads it at group level:
    # the column means, then only the discarded groups' member rows).
    offset = int(has_cls)
    reads = as_reads(attn)
    if has_cls and not equivalent:
        cls_row = torch.zeros(batch, 1, dtype=torch.long, device=hidden.device)
        semantic = reads.rows(cls_row)[:, 0, 1:].reshape(batch, groups, merge).mean(dim=2)
    else:
        if keys is None:
            raise FicocoError("the equivalent token needs the layer's key states: pass keys=(B, H, T, d)")
        semantic = equivalent_token_redundancy(keys, has_cls=has_cls).view(batch, groups, merge).mean(dim=2)
    # The members of a group travel as one vector of merge x D, so compress folds them member by member.
    red: VReduction = reduce(hidden.reshape(batch, groups, merge * dim), GroupReads(reads, merge, offset), r,
                             group_index, group_grid, has_cls=False, lam=lam, eps=eps, window=window,
                             coefficient=coefficient, semantic=semantic, riding=riding)
    return GroupReduction(
        hidden=red.hidden.reshape(batch, -1, dim),
        kept_groups=red.grid_index,
        discarded_groups=red.discarded_grid,
        kept_positions=red.kept_positions,
        merge_target=red.merge_target,
        riding=red.riding,
    )

# ---- the official code's rule (rule="official") -------------------------------------------------------------------
#
# FiCoCo-V's official code's rule (``rule="official"``), as ficoco runs it.
#
# The rule is read from kawhiiiileo/FiCoCo at commit 8995e93bf5c62435979f500e9d335e4810301656,
# llava/model/multimodal_encoder/FiCoCo_V.py and clip_encoder.py (its fork yiming-l21/FiCoCo only casts the
# quantile's input to float32 and sets r = 32):
#
# - the layer's scores are the head-mean raw ``q . k^T`` times the scale, before the softmax
#   (clip_encoder.py:46-56);
# - **filter** (FiCoCo_V.py:72-123): the [CLS] row over the patches and every patch row's mean over the patch
#   keys (the attention a patch *gives*), each scaled to unit L2 norm over the patches;
#   ``d_j = lam * cls_j - (1 - lam) * row_j`` (``beta = 0.35`` on the [CLS] term); in every ``W x W`` window of the
#   patch grid the *lowest* ``d`` is halved when positive and doubled when not (``c = 2``); the ``r`` lowest go, [CLS]
#   never;
# - **correlate** (lines 127-141): a removed patch's row of raw scores over every token ([CLS] and itself included);
#   ``tau = quantile(row, eps)``, ``K`` the most entries above ``tau`` of any removed row; its targets are its ``K``
#   largest ``softmax(row)`` among every token, weighted by those probabilities over their sum
#   (`ficoco.methods.ops.official_targets`);
# - **compress** (lines 15-39, 143-168): every target ``j`` becomes ``(x_j + sum_i w_ij x_i) / (1 + sum_i w_ij)``
#   (its size, 1, plus the weights it received); what a removed patch gives itself or another removed one leaves
#   with it.
#
# ficoco keeps the token order, [CLS] at 0 and every patch's grid place, where the official code reorders the
# tokens by score and scatters by original indices into the reordered tensor; docs/methods/ficoco.md lists that and
# the rest of what is not copied (the module-global score buffer, the batch-1 head mean).


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


def official_tower_step(inputs: TowerInput, settings: Mapping[str, Any]) -> TowerOutput:
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
