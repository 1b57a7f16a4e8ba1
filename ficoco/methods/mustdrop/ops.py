"""MustDrop (liuting20/MustDrop @ 909afa5; arXiv 2411.10803): its three steps, batched.

1. **Window merge** at tower layer 0's output (clip_encoder.py:110-112, local_merge.py:30-146): the patch grid
   (``side x side``, [CLS] apart) is cut into ``3 x 3`` windows, row-major; a window's score is the mean cosine
   of its 9 tokens' 72 ordered pairs (self excluded). ``r`` = the windows scoring at least 0.8, **the fewest of any
   item of the call** (``.min()`` over the batch, :79). Every item merges its ``r`` best windows (``topk``: by
   score, descending) into one token each, the mean of its 9 tokens (``merge_wavg`` with every size 1; the mean
   lands on the window's last token, :114-116, whose place the merged token continues). The tokens go on as
   ``[CLS, merged (by score), the other windows' tokens (original order)]`` (:129-130); the sizes are not carried
   to later layers (no proportional attention: ``size`` is dropped at :112).
2. **Key set** at the last tower layer (:86-108): the head-mean [CLS] row of its attention over the ``N - 1``
   tokens the merge left, softmax over all ``N``; its ``ceil(0.08 (N - 1))`` largest are the key set (indices
   into the tokens the projector maps, whose features come from the layer before: select layer -2). ficoco hands
   it to the decoder's part as a 0/1 flag per token (`TowerOutput.carry`).
3. **Dual-attention filter** after decoder layers 2, 6, 10, 14 (modelling_sparse_llama.py:235-266, :336-350):
   with ``A`` the layer's own attention, head mean, of every token after the visual span (rows) over the visual
   tokens (columns), a visual token is dropped iff ``sum_rows A < global_thr * sum_all A`` and
   ``max_rows A < individual_thr``; the key set is kept whatever its scores (:256-258); the kept tokens stay in
   order, the positions are compacted (truncated, :266).

Departures (docs/methods/mustdrop.md): batched (spans per sample, left padding masked), every count the
input's own, the same in every item (merge) or sample (filter) or refused in one line; ``topk`` ties go to the
lowest index; the filter's statistics are summed in float32 over the probabilities the model's eager rule gives.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ficoco.errors import FicocoError
from ficoco.methods.inputs import Reduced, StepInput, TowerInput, TowerOutput
from ficoco.methods.mustdrop import KEY_RATIO, WINDOW, WINDOW_COUNT, WINDOW_THRESHOLD, key_set_size, window_grid
from ficoco.methods.ops import check_span, compute_dtype, patch_scores_from_cls, rebuild, visual_positions
from ficoco.methods.reads import DEFAULT_ATTENTION_SCORES

__all__ = ["dual_attention_keep", "key_set", "merge_windows", "step", "tower_step", "window_members",
           "window_scores", "windows_to_merge"]


def window_members(side: int, window: int = WINDOW) -> Tensor:
    """``(windows, window * window)`` the patch indices of every window of a ``side x side`` grid: windows
    row-major, each window's patches row-major (local_merge.py:86-96's unfold)."""
    grid = torch.arange(side * side).reshape(side, side)
    cells = side // window
    return grid.reshape(cells, window, cells, window).permute(0, 2, 1, 3).reshape(cells * cells, window * window)


def window_scores(patches: Tensor, window: int = WINDOW) -> Tensor:
    """``(items, windows)`` every window's mean pairwise cosine, self excluded (local_merge.py:54-70).

    Args:
        patches: ``(items, side * side, C)`` the patch tokens ([CLS] dropped), row-major on their grid.
    """
    items, count, channels = patches.shape
    members = window_members(window_grid(count, window), window).to(patches.device)
    dtype = compute_dtype(patches.dtype)
    tokens = patches.to(dtype)[:, members.flatten()].reshape(items, members.shape[0], window * window, channels)
    unit = F.normalize(tokens, dim=-1, eps=1e-8)
    cosines = unit @ unit.transpose(-1, -2)  # (items, windows, 9, 9): the matrix work a counter sees
    area = window * window
    off_diagonal = ~torch.eye(area, dtype=torch.bool, device=patches.device)
    return (cosines * off_diagonal).sum(dim=(-1, -2)) / (area * (area - 1))


def windows_to_merge(counts: Tensor, window_count: str = WINDOW_COUNT) -> int:
    """``r``, the windows every item of a call merges, from ``(items,)`` the windows each has at or above the
    threshold: the fewest (``"batch"``, the official ``.min()``), or (``"item"``) the count they all share, a call
    whose items differ refused in one line. One host read."""
    fewest, most = (int(v) for v in torch.stack([counts.min(), counts.max()]).tolist())
    if window_count == "item" and fewest != most:
        raise FicocoError(f"MustDrop window_count='item': the images of this call have {fewest}..{most} uniform "
                          "windows, and the tower runs them as one batch of equal lengths; run them one at a time, "
                          "or use window_count='batch' (the official code's: the fewest for every image)")
    return fewest


def merge_windows(hidden: Tensor, threshold: float = WINDOW_THRESHOLD, window_count: str = WINDOW_COUNT,
                  has_cls: bool = True, window: int = WINDOW) -> tuple[Tensor, Tensor, Tensor, Tensor, int]:
    """The window merge of tower layer 0's output.

    Args:
        hidden: ``(items, [1 +] side * side, D)`` the tokens ([CLS] first with `has_cls`).
        threshold: a window merges when its score is at least this.
        window_count: ``"batch"`` (official: every item merges the fewest count any item of the call has) or
            ``"item"`` (ficoco's correction: each its own; a call whose items differ is refused in one line).

    Returns:
        ``(hidden', kept, discarded, merged_into, r)``: ``hidden'`` ``(items, [1 +] N - (area - 1) r, D)`` in the
        official order; ``kept`` ``(items, N - (area - 1) r)`` the patch each output token continues (a merged
        window's last patch); ``discarded`` ``(items, (area - 1) r)`` the other patches of the merged windows and
        ``merged_into`` the patch each went into; ``r`` the windows each item merged. One host read (``r``).
    """
    offset = int(has_cls)
    patches = hidden[:, offset:]
    items, count, channels = patches.shape
    scores = window_scores(patches, window)
    area = window * window
    r = windows_to_merge((scores >= threshold).sum(dim=1), window_count)
    members = window_members(window_grid(count, window), window).to(hidden.device)  # (windows, area)
    # The r best windows by score, descending (the official topk; ties to the lowest window).
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices
    chosen = order[:, :r]
    merged_windows = members[chosen]  # (items, r, area)
    dtype = compute_dtype(hidden.dtype)
    merged = torch.gather(patches, 1, merged_windows.flatten(1).unsqueeze(-1).expand(-1, -1, channels))
    merged = merged.to(dtype).reshape(items, r, area, channels).sum(dim=2) / area  # size-weighted, every size 1
    taken = torch.zeros(items, count, dtype=torch.bool, device=hidden.device)
    flat = merged_windows.flatten(1)
    taken = taken.scatter(1, flat, torch.ones_like(flat, dtype=torch.bool))
    # The other windows' patches in their original order (a stable sort of the flags lists them first).
    rest = torch.sort(taken.to(torch.int8), dim=1, stable=True).indices[:, :count - area * r]
    unmerged = torch.gather(patches, 1, rest.unsqueeze(-1).expand(-1, -1, channels))
    parts = [hidden[:, :offset]] if has_cls else []
    out = torch.cat([*parts, merged.to(hidden.dtype), unmerged], dim=1)
    target = merged_windows[:, :, -1]  # the window's last patch receives the others (dst_idx, :116)
    kept = torch.cat([target, rest], dim=1)
    discarded = merged_windows[:, :, :-1].flatten(1)
    merged_into = target.repeat_interleave(area - 1, dim=1)
    return out, kept, discarded, merged_into, r


def key_set(inputs: TowerInput, ratio: float = KEY_RATIO, scores: str = DEFAULT_ATTENTION_SCORES) -> Tensor:
    """``(items, units)`` 1 on the key set's tokens, 0 elsewhere: the ``ceil(ratio (N - 1))`` patches with the
    largest head-mean [CLS] attention of the last tower layer (ties to the lowest index), in the order of the tokens
    the projector maps (the merge's)."""
    row = patch_scores_from_cls(inputs, "mean", scores)  # (items, units)
    items, units = row.shape
    size = key_set_size(units, ratio)
    chosen = torch.sort(row.to(compute_dtype(row.dtype)), dim=1, descending=True, stable=True).indices[:, :size]
    return torch.zeros(items, units, dtype=torch.long, device=row.device).scatter(1, chosen, torch.ones_like(chosen))


def tower_step(inputs: TowerInput, settings: Mapping[str, Any]) -> TowerOutput:
    """The model adapters' calls before the LLM: the window merge at tower layer 1's input (``layer_input``),
    and at the tower's output (``tower_output``) the key set, handed on as ``carry``, every token kept."""
    if inputs.placement == "layer_input":
        if not inputs.has_cls:
            raise FicocoError("MustDrop needs a tower with [CLS]")
        hidden, kept, discarded, merged_into, _ = merge_windows(
            inputs.hidden, settings.get("window_threshold", WINDOW_THRESHOLD),
            settings.get("window_count", WINDOW_COUNT), inputs.has_cls)
        offset = int(inputs.has_cls)
        positions = torch.cat([torch.zeros_like(kept[:, :offset]), kept + offset], dim=1)
        return TowerOutput(hidden=hidden, kept=kept, positions=positions, discarded=discarded,
                           merged_into=merged_into)
    if inputs.placement != "tower_output":
        raise RuntimeError(f"MustDrop runs at a tower layer's input and at the tower's output, not at "
                           f"{inputs.placement or 'an unnamed placement'}")
    items, units = inputs.hidden.shape[:2]
    carry = key_set(inputs, settings.get("key_ratio", KEY_RATIO),
                    settings.get("attention_scores", DEFAULT_ATTENTION_SCORES))
    if carry.shape[1] != units:
        raise RuntimeError(f"MustDrop's key set covers {carry.shape[1]} tokens, the projector maps {units}")
    kept = torch.arange(units, device=inputs.hidden.device).expand(items, -1)
    return TowerOutput(hidden=inputs.hidden, kept=kept, carry=carry)


def _text_rows(seq_len: int, visual_start: Tensor, num_visual: int) -> Tensor:
    """``(B, M)`` True where row ``T - M + i`` lies after the sample's visual span, ``M = T - min(span end)``: the
    trailing rows the adapter's ``suffix`` probe computed (left padding puts every sample's text at the end)."""
    ends = visual_start.to(torch.long) + num_visual
    rows = seq_len - int(ends.min())
    positions = torch.arange(seq_len - rows, seq_len, device=visual_start.device)
    return positions.unsqueeze(0) >= ends.unsqueeze(1)


def dual_attention_keep(rows_attention: Tensor, valid: Tensor, visual_start: Tensor, num_visual: int,
                        global_thr: float, individual_thr: float, protected: Tensor | None = None) -> Tensor:
    """``(B, N)`` True on the visual tokens the dual-attention filter keeps (modelling_sparse_llama.py:336-350).

    Args:
        rows_attention: ``(B, M, T)`` head-mean probabilities of the trailing ``M`` rows over every key.
        valid: ``(B, M)`` True on the rows that are the sample's text after its span.
        visual_start: ``(B,)``; num_visual: ``N``.
        global_thr, individual_thr: a token is dropped iff its column sum is below ``global_thr`` times the
            sum over every visual column, and its largest entry below ``individual_thr``.
        protected: ``(B, N)`` True on tokens kept whatever their scores (the key set), or None.
    """
    attention = rows_attention.to(compute_dtype(rows_attention.dtype))
    columns = visual_positions(visual_start.to(attention.device), num_visual)
    block = torch.gather(attention, 2, columns.unsqueeze(1).expand(-1, attention.shape[1], -1))  # (B, M, N)
    block = block * valid.to(block.dtype).unsqueeze(-1)  # probabilities are >= 0: a zeroed row moves no max
    column_sum = block.sum(dim=1)
    dropped = (column_sum < column_sum.sum(dim=1, keepdim=True) * global_thr) & \
        (block.amax(dim=1) < individual_thr)
    keep = ~dropped
    return keep | protected if protected is not None else keep


def step(inputs: StepInput, settings: Mapping[str, Any]) -> Reduced:
    """The model adapters' call at the input of the layer after a pruning layer: filter its output's visual
    tokens, the key set kept, positions compacted. Every sample must keep the same count (one host read)."""
    if inputs.row_attention is None:
        raise RuntimeError("MustDrop needs the pruning layer's text rows from the adapter")
    hidden, start, count = inputs.hidden, inputs.visual_start, inputs.num_visual
    check_span(hidden, start, count)
    valid = _text_rows(hidden.shape[1], start, count).to(hidden.device)
    if valid.shape[1] != inputs.row_attention.shape[1]:
        raise RuntimeError(f"MustDrop's probe computed {inputs.row_attention.shape[1]} text rows, the span leaves "
                           f"{valid.shape[1]}")
    protected = inputs.carried > 0 if inputs.carried is not None else None
    keep = dual_attention_keep(inputs.row_attention, valid, start, count, settings["global_thr"],
                               settings["individual_thr"], protected)
    counts = keep.sum(dim=1)
    fewest, most = (int(v) for v in torch.stack([counts.min(), counts.max()]).tolist())
    if fewest != most:
        raise FicocoError(f"MustDrop kept different counts in the samples of this batch ({fewest}..{most} visual "
                          f"tokens at this layer; its thresholds decide each sample's): run them one at a time")
    if not fewest:
        raise FicocoError("MustDrop's filter dropped every visual token (no key set to keep); give a key_ratio above "
                          "0 or lower thresholds")
    kept = torch.sort(torch.where(keep, 0, 1).to(torch.int8), dim=1, stable=True).indices[:, :fewest]
    return rebuild(hidden, kept, start.to(hidden.device), count, inputs.position_ids, "compact",
                   inputs.attention_mask)

