"""PixelPrune's official rule as a test (OPPO-Mente-Lab/PixelPrune @ a870e31).

The rule, re-stated here in plain loops from the official code, independent of ficoco's ops:

- the selector's input (pixelprune/patches/qwen3_vl_hf.py:31-42): every patch of Qwen3-VL's pixel_values viewed as
  (C=3, T=2, 16, 16), temporal frame 0, normalisation undone as x * 0.5 + 0.5; a merge group's 4 patches
  concatenated (pixelprune/methods/base.py:86-92);
- the default selector `pred_2d` with metric `max` and threshold 0 (pixelprune/core.py:51-56): on the grid of
  merge groups, (0, 0) kept; row 0 against its left neighbour, column 0 against the one above; elsewhere, with
  A = left, B = above, C = above-left, the prediction is B when C ~ A and not C ~ B, else A; a group is dropped
  when it is similar to its prediction (methods/pred_2d.py:137-182; similarity :32-62). With a threshold > 0 and
  `anchored` (the default) the loop compares with the reconstructed grid (:188-237); the dispatch is :128-131;
- the kept groups in raster order, 4 patch indices each (core.py:72-97);
- the tower runs on the kept patches only: the patch embeddings, the interpolated position embeddings and the
  2-D rotary rows selected at the original positions, cu_seqlens rebuilt, DeepStack's mergers and the merger on
  the kept rows (patches/qwen3_vl_hf.py:324-395);
- the LLM's 3-D positions computed on the original ids, then the removed placeholders' columns dropped; the
  rope deltas are the original prompt's (:619-644), so decoding continues where the unreduced prompt would.

The quantities are read from the unpatched model (its tower's first-block inputs, its own blocks and mergers,
its `get_rope_index`); ficoco runs `ficoco.apply(model, "pixelprune", ...)` on Qwen3-VL (tiny, fp32), on images
whose groups repeat exactly (or within the threshold), at several thresholds and metrics (PixelPrune has no
token budget: its threshold is its only setting).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from helpers import qwen_patches
from torch import Tensor, nn

import ficoco
from ficoco.methods.pixelprune import ops as pixelprune_ops
from ficoco.models import synthetic_inputs
from ficoco.models.qwen2_vl.cut import TowerCuts

TINY_PROFILE = "qwen3-vl-tiny"  # 16 x 20 patches of 16 px: 8 x 10 merge groups
TEXT = 12
GROUP = 32  # pixels per merge group side (2 x 16 px patches)


# ---- the official rule, re-stated --------------------------------------------------------------------------------

def official_units(pixel_values: Tensor) -> Tensor:
    """patches/qwen3_vl_hf.py:31-42 and methods/base.py:86-92: frame 0, x * 0.5 + 0.5, 4 patches side by side."""
    frame = pixel_values.view(-1, 3, 2, 16, 16)[:, :, 0]
    flat = ((frame * 0.5) + 0.5).reshape(pixel_values.shape[0], -1)
    return flat.reshape(-1, flat.shape[-1] * 4)


def official_similar(x: Tensor, y: Tensor, metric: str, threshold: float) -> bool:
    """methods/pred_2d.py:32-62 for one pair of units."""
    diff = x - y
    if metric in ("max", "exact"):
        return bool(diff.abs().max() <= (0.0 if metric == "exact" else threshold))
    if metric == "mae":
        return bool(diff.abs().mean() <= threshold)
    return bool(diff.pow(2).mean().sqrt() <= threshold)


def official_kept(units: Tensor, rows: int, cols: int, metric: str = "max", threshold: float = 0.0,
                  anchored: bool = True) -> list[int]:
    """methods/pred_2d.py:128-237: the kept merge groups of one image, in raster order."""
    grid = [[units[r * cols + c] for c in range(cols)] for r in range(rows)]
    similar = lambda a, b: official_similar(a, b, metric, threshold)  # noqa: E731
    kept = [0]
    if metric == "exact" or (metric == "max" and threshold == 0) or not anchored:
        for r in range(rows):
            for c in range(cols):
                if r == 0 and c == 0:
                    continue
                if r == 0:
                    prediction = grid[0][c - 1]
                elif c == 0:
                    prediction = grid[r - 1][0]
                else:
                    a, b, corner = grid[r][c - 1], grid[r - 1][c], grid[r - 1][c - 1]
                    prediction = b if similar(corner, a) and not similar(corner, b) else a
                if not similar(grid[r][c], prediction):
                    kept.append(r * cols + c)
        return kept
    anchor = [[grid[r][c].clone() for c in range(cols)] for r in range(rows)]
    for r in range(rows):
        for c in range(cols):
            if r == 0 and c == 0:
                continue
            a = anchor[r][c - 1] if c > 0 else anchor[r - 1][0]
            b = anchor[r - 1][c] if r > 0 else a
            corner = anchor[r - 1][c - 1] if (r > 0 and c > 0) else b
            prediction = (b if (similar(corner, a) and not similar(corner, b)) else a) if r > 0 and c > 0 else a
            if not similar(grid[r][c], prediction):
                kept.append(r * cols + c)
                anchor[r][c] = grid[r][c]
            else:
                anchor[r][c] = prediction
    return kept


def patches_of(groups: list[int], cols: int) -> list[int]:
    """The row-major patch-grid indices of merge groups (cols: groups per row), ascending (ficoco's records)."""
    return sorted((g // cols * 2 + dr) * (2 * cols) + g % cols * 2 + dc
                  for g in groups for dr in (0, 1) for dc in (0, 1))


# ---- images whose merge groups repeat ----------------------------------------------------------------------------

def picture(kind: str, rows: int, cols: int, seed: int = 0) -> Tensor:
    """(H, W, 3) in [0, 1], rows x cols merge groups of 32 px: `stripes` (every column of groups one texture:
    only the vertical-edge prediction, B, drops its interior), `blocks` (a random image with a repeated-texture
    band, a flat band and a checkerboard of two textures), `drift` (one texture plus 0.01 per group column: within
    a threshold of 0.015 of its neighbours, not of a neighbour two groups away)."""
    generator = torch.Generator().manual_seed(seed)
    image = torch.rand(rows * GROUP, cols * GROUP, 3, generator=generator)
    texture = torch.rand(cols, GROUP, GROUP, 3, generator=generator) * 0.5
    for r in range(rows):
        for c in range(cols):
            cell = (slice(r * GROUP, (r + 1) * GROUP), slice(c * GROUP, (c + 1) * GROUP))
            if kind == "stripes":
                image[cell] = texture[c]
            elif kind == "drift":
                image[cell] = texture[0] + 0.01 * c
            elif kind == "blocks":
                if r < 2:
                    image[cell] = texture[0]
                elif r == 2:
                    image[cell] = 0.25
                elif r >= rows - 3 and c < 6:
                    image[cell] = texture[(r + c) % 2]
    return image


def image_inputs(model: nn.Module, kind: str) -> tuple[dict[str, Tensor], int, int]:
    """One prompt of one `kind` picture at the profile's grid; (inputs, group rows, group cols)."""
    inputs = synthetic_inputs(model, batch=1, text_tokens=TEXT)
    _, rows, cols = (int(v) for v in inputs["image_grid_thw"][0])
    inputs["pixel_values"] = qwen_patches(picture(kind, rows // 2, cols // 2), model.config.vision_config,
                                          (0.5,) * 3, (0.5,) * 3)
    return inputs, rows // 2, cols // 2


# ---- the kept groups ---------------------------------------------------------------------------------------------

CASES = [("stripes", {}), ("blocks", {}), ("blocks", {"metric": "exact"}),
         ("drift", {"threshold": 0.015}), ("drift", {"threshold": 0.015, "anchored": False}),
         ("drift", {"threshold": 0.015, "metric": "mae"}), ("drift", {"threshold": 0.005})]


def check_kept(model: nn.Module, kind: str, settings: dict[str, Any]) -> list[int]:
    inputs, rows, cols = image_inputs(model, kind)
    expected = official_kept(official_units(inputs["pixel_values"]), rows, cols, **settings)
    with torch.no_grad(), ficoco.apply(model, "pixelprune", **settings) as handle:
        model(**inputs)
        records = handle.records
    assert len(records) == 1 and (records[0].stage, records[0].layer) == ("vision", 0)
    assert records[0].kept[0].tolist() == patches_of(expected, cols), kind
    assert handle.measured_tokens_per_item == len(expected)
    gone = [g for g in range(rows * cols) if g not in expected]
    assert records[0].discarded[0].tolist() == patches_of(gone, cols)
    return expected


@pytest.mark.parametrize("kind,settings", CASES, ids=[f"{k}-{'-'.join(map(str, s.values())) or 'default'}"
                                                      for k, s in CASES])
def test_pixelprune_keeps_the_groups_the_official_loco_i_prediction_keeps(model: nn.Module, kind: str,
                                                                         settings: dict[str, Any]) -> None:
    kept = check_kept(model, kind, settings)
    groups = 80
    assert 1 <= len(kept) < groups  # the rule decided something on every case
    if kind == "stripes":
        assert kept == list(range(10))  # row 0 only: every interior group predicted from above (a vertical edge)


def test_the_anchored_loop_keeps_more_than_the_vectorised_path_where_errors_would_drift(model: nn.Module) -> None:
    anchored = check_kept(model, "drift", {"threshold": 0.015})
    sliding = check_kept(model, "drift", {"threshold": 0.015, "anchored": False})
    assert len(sliding) == 1 and len(anchored) > 1  # 0.01 per column: within tau of the left, not of its anchor


def test_breaking_the_vertical_edge_prediction_fails_the_rule(model: nn.Module, monkeypatch) -> None:
    """Predicting every interior group from its left neighbour (never B) keeps the stripes' interior."""
    def left_only(grid: Tensor, metric: str, threshold: float) -> Tensor:
        keep = torch.zeros(grid.shape[:3], dtype=torch.bool)
        keep[:, 0, 0] = True
        keep[:, 0, 1:] = ~pixelprune_ops.similar(grid[:, 0, 1:], grid[:, 0, :-1], metric, threshold)
        # Column 0 from the group above, every other group from its left neighbour.
        prediction = torch.cat([grid[:, :-1, :1], grid[:, 1:, :-1]], dim=2)
        keep[:, 1:, :] = ~pixelprune_ops.similar(grid[:, 1:, :], prediction, metric, threshold)
        return keep

    monkeypatch.setattr(pixelprune_ops, "_keep_vectorised", left_only)
    with pytest.raises(AssertionError):
        check_kept(model, "stripes", {})


# ---- the tower on the kept patches, positions selected at their original places ------------------------------

@contextlib.contextmanager
def first_block_inputs(model: nn.Module) -> Iterator[dict[str, Any]]:
    """What the tower's first block receives: the full hidden states (patch embeddings + interpolated position
    embeddings) and the 2-D rotary table of every patch."""
    seen: dict[str, Any] = {}

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
        seen.setdefault("hidden", args[0] if args else kwargs["hidden_states"])
        seen.setdefault("rotary", kwargs["position_embeddings"])

    handle = model.model.visual.blocks[0].register_forward_pre_hook(hook, with_kwargs=True)
    try:
        yield seen
    finally:
        handle.remove()


def official_tower(model: nn.Module, inputs: dict[str, Tensor], kept: list[int]) -> tuple[Tensor, list[Tensor]]:
    """patches/qwen3_vl_hf.py:324-395 with PIXELPRUNE_VIT_LAYER 0, on the unpatched model's own modules: the
    first block's inputs selected at the kept groups' 4 patches each, cu_seqlens of the kept patches, every
    block, DeepStack's mergers at their layers and the merger."""
    visual = model.model.visual
    with torch.no_grad(), first_block_inputs(model) as seen:
        model.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"])
    index = torch.tensor([4 * g + m for g in kept for m in range(4)])
    hidden = seen["hidden"][index]
    rotary = (seen["rotary"][0][index], seen["rotary"][1][index])
    cu_seqlens = torch.tensor([0, len(index)], dtype=torch.int32)
    taps = []
    with torch.no_grad():
        for layer, block in enumerate(visual.blocks):
            hidden = block(hidden, cu_seqlens=cu_seqlens, position_embeddings=rotary)
            if layer in visual.deepstack_visual_indexes:
                taps.append(visual.deepstack_merger_list[visual.deepstack_visual_indexes.index(layer)](hidden))
        return visual.merger(hidden), taps


def check_tower(model: nn.Module, kind: str) -> None:
    inputs, rows, cols = image_inputs(model, kind)
    kept = official_kept(official_units(inputs["pixel_values"]), rows, cols)
    merged, taps = official_tower(model, inputs, kept)
    with torch.no_grad(), ficoco.apply(model, "pixelprune"):
        out = model.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"])
    assert out.pooler_output[0].shape[0] == len(kept)
    torch.testing.assert_close(out.pooler_output[0], merged, rtol=1e-5, atol=1e-5)
    for ours, theirs in zip(out.deepstack_features, taps, strict=True):
        torch.testing.assert_close(ours[0], theirs, rtol=1e-5, atol=1e-5)


def test_the_tower_runs_on_the_kept_patches_at_their_original_positions(model: nn.Module) -> None:
    check_tower(model, "blocks")


def test_rotary_rows_of_a_compacted_grid_fail_the_rule(model: nn.Module, monkeypatch) -> None:
    """The rotary rows of the first patches (a recomputed, smaller grid) in place of the kept patches' own."""
    original = TowerCuts._enter

    def compacted(self: TowerCuts, tower: Any, hidden: Tensor, position_embeddings: Any, cu_seqlens: Tensor) -> Any:
        out = original(self, tower, hidden, position_embeddings, cu_seqlens)
        count = out.shape[0]
        tower.position_embeddings = (position_embeddings[0][:count], position_embeddings[1][:count])
        return out

    monkeypatch.setattr(TowerCuts, "_enter", compacted)
    with pytest.raises(AssertionError):
        check_tower(model, "blocks")


# ---- the LLM's positions: the original prompt's, the removed placeholders dropped -------------------------------

def test_the_llm_runs_the_original_3d_positions_of_the_kept_tokens_and_the_original_deltas(model: nn.Module) -> None:
    inputs, rows, cols = image_inputs(model, "blocks")
    kept = official_kept(official_units(inputs["pixel_values"]), rows, cols)
    ids = inputs["input_ids"]
    positions, deltas = model.model.get_rope_index(ids, inputs["mm_token_type_ids"],
                                                   image_grid_thw=inputs["image_grid_thw"],
                                                   attention_mask=inputs["attention_mask"])
    # patches/qwen3_vl_hf.py:255-266: the image span's placeholders kept at the kept groups, the rest dropped.
    start = int((ids[0] == model.config.image_token_id).nonzero()[0])
    keep = torch.ones(ids.shape[1], dtype=torch.bool)
    keep[start:start + rows * cols] = False
    keep[start + torch.tensor(kept)] = True
    seen: list[Tensor] = []
    hook = model.model.language_model.register_forward_pre_hook(
        lambda m, args, kwargs: seen.append(kwargs["position_ids"]), with_kwargs=True)
    try:
        with torch.no_grad(), ficoco.apply(model, "pixelprune"):
            out = model(**inputs)
            ficoco_deltas = model.model.rope_deltas
    finally:
        hook.remove()
    assert out.logits.shape[1] == int(keep.sum())
    assert torch.equal(seen[0][-3:], positions[:, :, keep])
    # The first new token: the official decode at cache position L (generate counts the caller's prompt) plus the
    # original deltas; ficoco's at its cache length L' plus its deltas. The same place.
    assert int(keep.sum()) + int(ficoco_deltas[0, 0]) == ids.shape[1] + int(deltas[0, 0])
