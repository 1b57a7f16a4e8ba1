"""PixelPrune (OPPO-Mente-Lab/PixelPrune a870e31): LOCO-I prediction on the merge-group grid of an image's
pixels, before the vision tower runs.

Every merge group (2 x 2 patches, one LLM token) is one unit: its patches' pixels side by side, as the model
adapter hands them (the processor's normalisation undone, the first temporal frame of every patch:
patches/qwen3_vl_hf.py:31-42; the four patches concatenated: methods/base.py:86-92). On the grid of units
(methods/pred_2d.py:137-182) the first unit is kept; in row 0 a unit is predicted by its left neighbour, in
column 0 by the one above; elsewhere, with A = left, B = above, C = above-left, the prediction is B where
C is similar to A and not to B (a vertical edge), else A. A unit is dropped when it is similar to its
prediction: its distance (``max``: L-infinity, the official default; ``exact``; ``mae``; ``rmse``) is at most
the threshold tau (0 by default: bit-identical pixels). With tau > 0 and a metric other than ``exact`` (and
``max`` at tau 0) the official "anchored" loop compares every unit with the reconstructed grid (a dropped
unit stands for its prediction), so that errors do not drift (pred_2d.py:128-131, :188-237); ``anchored=False``
gives the official vectorised path for any tau. The kept units are listed in raster order (core.py:72-97).

Nothing here is a matrix product: comparisons, absolute differences and maxima (the accountant counts no
multiply-accumulates for it).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from ficoco.errors import FicocoError
from ficoco.methods.inputs import TowerInput, TowerOutput

__all__ = ["METRICS", "group_pixels", "keep_map", "kept_units", "similar", "tower_step"]

METRICS = ("max", "exact", "mae", "rmse")


def group_pixels(pixels: Tensor, *, channels: int, temporal_patch_size: int, patch_size: int, merge: int,
                 mean: tuple[float, ...], std: tuple[float, ...]) -> Tensor:
    """``(groups, merge x C x P x P)`` every merge group's pixels from a packed tower's flattened patches `pixels`
    ``(patches, C x T x P x P)`` (every image's groups in grid order, a group's `merge` patches consecutive, as the
    Qwen processors lay them out): the first temporal frame of every patch (patches/qwen3_vl_hf.py:31-42), the
    processor's normalisation undone (x * std + mean per channel), the group's patches side by side
    (methods/base.py:86-92)."""
    frames = pixels.reshape(-1, channels, temporal_patch_size, patch_size, patch_size)[:, :, 0]
    shape = (1, channels, 1, 1)
    mean_t = torch.tensor(mean, dtype=frames.dtype, device=frames.device).view(shape)
    std_t = torch.tensor(std, dtype=frames.dtype, device=frames.device).view(shape)
    return (frames * std_t + mean_t).reshape(-1, merge * channels * patch_size * patch_size)


def similar(x: Tensor, y: Tensor, metric: str, threshold: float) -> Tensor:
    """``(...)`` True where the units `x` and `y` (``(..., D)``) are within `threshold` of each other under
    `metric` (pred_2d.py:32-62: ``exact`` is ``max`` at threshold 0)."""
    diff = x - y
    if metric in ("max", "exact"):
        distance = diff.abs().amax(dim=-1)
        limit = 0.0 if metric == "exact" else threshold
    elif metric == "mae":
        distance, limit = diff.abs().mean(dim=-1), threshold
    elif metric == "rmse":
        distance, limit = diff.pow(2).mean(dim=-1).sqrt(), threshold
    else:
        raise FicocoError(f"PixelPrune metric={metric!r}: choose from {', '.join(METRICS)}")
    return distance <= limit


def _keep_vectorised(grid: Tensor, metric: str, threshold: float) -> Tensor:
    """(B, h, w) keep flags of the grids `grid` (B, h, w, D), every unit against its raw neighbours
    (pred_2d.py:137-182)."""
    batch, rows, cols, _ = grid.shape
    keep = torch.zeros(batch, rows, cols, dtype=torch.bool, device=grid.device)
    keep[:, 0, 0] = True
    if cols > 1:
        keep[:, 0, 1:] = ~similar(grid[:, 0, 1:], grid[:, 0, :-1], metric, threshold)
    if rows > 1:
        keep[:, 1:, 0] = ~similar(grid[:, 1:, 0], grid[:, :-1, 0], metric, threshold)
    if rows > 1 and cols > 1:
        left, above, corner = grid[:, 1:, :-1], grid[:, :-1, 1:], grid[:, :-1, :-1]
        use_above = similar(corner, left, metric, threshold) & ~similar(corner, above, metric, threshold)
        prediction = torch.where(use_above.unsqueeze(-1), above, left)
        keep[:, 1:, 1:] = ~similar(grid[:, 1:, 1:], prediction, metric, threshold)
    return keep


def _keep_anchored(grid: Tensor, metric: str, threshold: float) -> Tensor:
    """(h, w) keep flags of one grid (h, w, D), every unit against the reconstructed grid: a dropped unit
    stands for its prediction (pred_2d.py:188-237). A Python loop over the units, as the official one."""
    rows, cols, _ = grid.shape
    keep = torch.zeros(rows, cols, dtype=torch.bool, device=grid.device)
    keep[0, 0] = True
    anchor = grid.clone()

    def near(a: Tensor, b: Tensor) -> bool:
        return bool(similar(a, b, metric, threshold))

    for r in range(rows):
        for c in range(cols):
            if r == 0 and c == 0:
                continue
            left = anchor[r, c - 1] if c > 0 else anchor[r - 1, 0]
            if r > 0 and c > 0:
                above, corner = anchor[r - 1, c], anchor[r - 1, c - 1]
                prediction = above if near(corner, left) and not near(corner, above) else left
            else:
                prediction = left
            if near(grid[r, c], prediction):
                anchor[r, c] = prediction
            else:
                keep[r, c] = True
    return keep


def keep_map(grid: Tensor, metric: str = "max", threshold: float = 0.0, anchored: bool = True) -> Tensor:
    """``(B, h, w)`` True on the units of the grids `grid` ``(B, h, w, D)`` that PixelPrune's LOCO-I
    prediction keeps. The official dispatch (pred_2d.py:128-131): the vectorised path for ``exact``, for
    ``max`` at threshold 0 and whenever `anchored` is off (exact similarity is transitive, so comparing
    with raw or reconstructed neighbours agrees); the anchored loop otherwise, one grid at a time."""
    if metric not in METRICS:
        raise FicocoError(f"PixelPrune metric={metric!r}: choose from {', '.join(METRICS)}")
    if grid.dim() != 4:
        raise ValueError(f"PixelPrune reads grids of units (B, h, w, D), got {tuple(grid.shape)}")
    if metric == "exact" or (metric == "max" and threshold == 0) or not anchored:
        return _keep_vectorised(grid, metric, threshold)
    return torch.stack([_keep_anchored(g, metric, threshold) for g in grid])


def kept_units(keep: Tensor) -> tuple[Tensor, Tensor]:
    """``(kept (B, K), counts (B,))`` of the flags `keep` ``(B, N)``: every item's kept unit indices in raster
    order, ascending, padded with -1 to the most any item keeps (one host read), and how many each keeps."""
    counts = keep.sum(dim=1)
    width = int(counts.max()) if keep.shape[0] else 0
    # A stable sort of the "dropped" flags lists every item's kept units first, in raster order.
    order = torch.sort((~keep).to(torch.int8), dim=1, stable=True).indices[:, :width]
    real = torch.arange(width, device=keep.device).unsqueeze(0) < counts.unsqueeze(1)
    return torch.where(real, order, torch.full_like(order, -1)), counts


def tower_step(inputs: TowerInput, settings: Mapping[str, Any]) -> TowerOutput:
    """The model adapters' call at the tower's input: ``inputs.hidden`` ``(items, G, D)`` every merge group's
    pixels (the processor's normalisation undone, the first frame, the group's patches side by side) of
    items of one grid, ``inputs.grid_hw`` the grid of groups. Returns the kept groups (raster order, -1
    padded), their pixels (zero rows for padding) and every item's count: the count is the image's own."""
    if inputs.grid_hw is None:
        raise ValueError("PixelPrune needs the grid of merge groups (TowerInput.grid_hw)")
    rows, cols = inputs.grid_hw
    units = inputs.hidden
    if units.shape[1] != rows * cols:
        raise ValueError(f"PixelPrune got {units.shape[1]} units for a {rows}x{cols} grid")
    threshold = float(settings.get("threshold", 0.0))
    keep = keep_map(units.view(units.shape[0], rows, cols, units.shape[-1]), str(settings.get("metric", "max")),
                    threshold, bool(settings.get("anchored", True)))
    kept, counts = kept_units(keep.flatten(1))
    gathered = torch.gather(units, 1, kept.clamp(min=0).unsqueeze(-1).expand(-1, -1, units.shape[-1]))
    hidden = torch.where((kept >= 0).unsqueeze(-1), gathered, torch.zeros_like(gathered))
    return TowerOutput(hidden=hidden, kept=kept, counts=counts)
