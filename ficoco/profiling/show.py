"""`ficoco show`'s data: which tokens of an image each reducing layer kept, discarded and merged,
placed on the image's patch grid.

A *cell* is `[panel, row, col, height, width]` in patch units: the panel is the part of the
picture a token belongs to (the image; LLaVA-NeXT's base view and its crops; a video frame),
height and width are 2 for Qwen2-VL's LLM tokens (one per 2 x 2 group of patches). Record
indices come from `handle.records` (ficoco.models.handle.LayerRecord) and are mapped to cells here, the
one place that knows how each family lays its tokens out. Tokens that have no place on the
picture (LLaVA-NeXT's row newlines, Video-LLaVA's per-frame [CLS]) map to None.

`picture_inputs` lays out the image for the model minimally (PIL, the tower's normalisation,
synthetic text ids, the profile's image size); it is one small function so that the
checkpoint-processor layout of real prompts can take its place.
"""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from ficoco.errors import FicocoError
from ficoco.versions import report_environment

# The families whose tokens are merge groups of a native-resolution patch grid (their module's `image_grid`).
MERGE_GROUP_FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")
MERGE_GROUP_FAMILIES += ("qwen3_5",)  # Qwen3.5: Qwen3-VL's tower without DeepStack
# The families whose picture `picture_inputs` lays out without a processor (random weights).
LAID_OUT_FAMILIES = ("llava", "llava_next", "video_llava", "llava_onevision", *MERGE_GROUP_FAMILIES)

# CLIP's normalisation (LLaVA, LLaVA-NeXT, Video-LLaVA and Qwen2-VL's processors all use it).
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)

Cell = list[int] | None


def _defaults(model: nn.Module) -> dict[str, Any]:
    from ficoco.profiles import FAMILY_DEFAULTS

    return {**FAMILY_DEFAULTS.get(model.config.model_type, {}), **(getattr(model, "_ficoco_defaults", None) or {})}


class Layout:
    """Panels of one family's picture and the map from record indices to cells."""

    def __init__(self, model: nn.Module) -> None:
        config = model.config
        self.family = config.model_type
        vision = config.vision_config
        self.patch = vision.patch_size
        if self.family in ("llava", "llava_next", "video_llava", "llava_onevision"):
            self.side = vision.image_size // vision.patch_size
        if self.family == "llava":
            self.panels = [{"name": "image", "rows": self.side, "cols": self.side}]
        elif self.family in ("llava_next", "llava_onevision"):  # OneVision: NeXT's AnyRes (no [CLS], images)
            if self.family == "llava_next":
                from ficoco.models.llava_next import image_layout
            else:
                from ficoco.models.llava_onevision import image_layout

            self.image_size = tuple(_defaults(model).get("image_size") or (2 * vision.image_size,) * 2)
            self.next = image_layout(config, self.image_size)
            self.panels = [{"name": "base view", "rows": self.side, "cols": self.side}]
            if self.next.items > 1:
                rows, cols = self.next.grid_hw
                self.panels.append({"name": f"{self.next.crops_hw[0]}x{self.next.crops_hw[1]} crops", "rows": rows,
                                    "cols": cols, "crop_side": self.side})
        elif self.family in MERGE_GROUP_FAMILIES:  # Qwen2.5-VL, Qwen3-VL: the same grid and merge groups
            from ficoco.models import family_module

            image_grid = family_module(self.family).image_grid
            self.image_size = tuple(_defaults(model)["image_size"])
            self.rows, self.cols = image_grid(model, self.image_size)
            self.merge = vision.spatial_merge_size
            self.panels = [{"name": "image", "rows": self.rows, "cols": self.cols, "group": self.merge}]
        elif self.family == "video_llava":
            from ficoco.models.video_llava import frames_of

            self.frames = frames_of(model)
            self.panels = [{"name": f"frame {f}", "rows": self.side, "cols": self.side} for f in range(self.frames)]
        else:
            raise FicocoError(f"ficoco show does not know how '{self.family}' models lay out their tokens")

    def cell(self, stage: str, item: int, index: int) -> Cell:
        """The cell of record index `index` of record row `item` (a vision item for V, the sample for L); None for
        -1, a merge that went into no kept token (FiCoCo's official code's rule)."""
        if index < 0:
            return None
        if self.family == "llava":
            return [0, index // self.side, index % self.side, 1, 1]
        if self.family in MERGE_GROUP_FAMILIES:
            if stage == "vision":  # patch-grid indices
                return [0, index // self.cols, index % self.cols, 1, 1]
            groups_w = self.cols // self.merge  # LLM tokens: one per group, row-major on the group grid
            return [0, index // groups_w * self.merge, index % groups_w * self.merge, self.merge, self.merge]
        if self.family == "video_llava":
            if stage == "vision":  # one record row per frame
                return [item, index // self.side, index % self.side, 1, 1]
            frame, place = divmod(index, self.side * self.side + 1)
            return None if place == 0 else [frame, (place - 1) // self.side, (place - 1) % self.side, 1, 1]
        # LLaVA-NeXT
        side, layout = self.side, self.next
        if stage == "vision":
            if item == 0:
                return [0, index // side, index % side, 1, 1]
            crop_row, crop_col = divmod(item - 1, layout.crops_hw[1])
            return [1, crop_row * side + index // side, crop_col * side + index % side, 1, 1]
        if index < side * side:
            return [0, index // side, index % side, 1, 1]
        if layout.items == 1:
            return None  # the newline after the base view
        cols_u = layout.unpadded.shape[1]
        row_u, col_u = divmod(index - side * side, cols_u + 1)
        if getattr(layout, "packed_hw", None) is not None:
            return None  # OneVision's downscaled grid: a token is a blend of patches, no one cell
        if col_u == cols_u:
            return None  # a row's newline
        flat = int(layout.unpadded[row_u, col_u])
        return [1, flat // layout.grid_hw[1], flat % layout.grid_hw[1], 1, 1]


    def cut_span(self, kept: torch.Tensor) -> list[Cell] | None:
        """The cells of the LLM's visual span after a cut before the LLM whose record kept `kept` ``(items, k)``
        (patch indices, -1 for a token without one): every item's tokens in turn, a Video-LLaVA frame's [CLS]
        (None) first. Record indices of a later LLM step are offsets into this span (ViTCoP, HoliTom). None
        where the family's span is not the items' tokens in turn (LLaVA-NeXT's packing, the merge groups)."""
        if self.family not in ("llava", "video_llava"):
            return None
        cls: list[Cell] = [None] if self.family == "video_llava" else []
        return [cell for item, row in enumerate(kept.tolist())
                for cell in cls + [None if index < 0 else self.cell("vision", item, index) for index in row]]


def _normalised(picture: Any, mean: tuple[float, ...], std: tuple[float, ...]) -> torch.Tensor:
    """(3, H, W) float tensor of a PIL image, normalised."""
    array = np.asarray(picture, dtype=np.float32) / 255.0
    return torch.from_numpy((array - np.asarray(mean, np.float32)) / np.asarray(std, np.float32)).permute(2, 0, 1)


def _centre_square(picture: Any, size: int) -> Any:
    """Shortest side to `size`, then the centre `size x size` (CLIP's preprocessing)."""
    from PIL import Image

    width, height = picture.size
    scale = size / min(width, height)
    resized = picture.resize((max(size, round(width * scale)), max(size, round(height * scale))), Image.BICUBIC)
    left, top = (resized.width - size) // 2, (resized.height - size) // 2
    return resized.crop((left, top, left + size, top + size))


def _normalisation(weights: str) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """The checkpoint's image mean and std (its preprocessor_config.json), CLIP's otherwise."""
    config = Path(weights).expanduser() / "preprocessor_config.json" if weights != "random" else None
    if config is not None and config.is_file():
        try:
            data = json.loads(config.read_text())
            return tuple(data["image_mean"]), tuple(data["image_std"])
        except (ValueError, KeyError, TypeError):
            pass
    return CLIP_MEAN, CLIP_STD


def picture_inputs(model: nn.Module, layout: Layout, image: str | None, *, weights: str = "random",
                   text_tokens: int = 60, seed: int = 0) -> tuple[dict[str, Any], list[np.ndarray | None]]:
    """The model's inputs for one image (synthetic text ids around it), and the picture of every
    panel as the model sees it (uint8 H x W x 3), or Nones without an image (random pixels)."""
    from ficoco.models import synthetic_inputs

    layout_kwargs: dict[str, Any] = {}
    if layout.family in ("llava_next", "llava_onevision", *MERGE_GROUP_FAMILIES):
        layout_kwargs["image_size"] = layout.image_size
    inputs = synthetic_inputs(model, batch=1, text_tokens=text_tokens, seed=seed, **layout_kwargs)
    if image is None:
        return inputs, [None] * len(layout.panels)
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(image) as opened:
            picture = opened.convert("RGB")
    except (OSError, UnidentifiedImageError) as exc:
        raise FicocoError(f"image={image}: cannot read it as an image ({exc})") from None
    mean, std = _normalisation(weights)
    vision = model.config.vision_config
    if layout.family in ("llava", "video_llava"):
        square = _centre_square(picture, vision.image_size)
        pixels = _normalised(square, mean, std)
        if layout.family == "llava":
            name, value = "pixel_values", pixels[None]
        else:  # the picture as every frame of a still video
            name, value = "pixel_values_videos", pixels[None, None].expand(1, layout.frames, -1, -1, -1)
        pictures = [np.asarray(square)] * len(layout.panels)
    elif layout.family in ("llava_next", "llava_onevision"):
        size = vision.image_size
        base = picture.resize((size, size), Image.BICUBIC)
        items = [_normalised(base, mean, std)]
        pictures = [np.asarray(base)]
        if layout.next.items > 1:
            rows, cols = layout.next.crops_hw
            grid = picture.resize((cols * size, rows * size), Image.BICUBIC)
            pictures.append(np.asarray(grid))
            for r in range(rows):
                for c in range(cols):
                    items.append(_normalised(grid.crop((c * size, r * size, (c + 1) * size, (r + 1) * size)), mean,
                                             std))
        name, value = "pixel_values", torch.stack(items)[None]
    else:  # Qwen2-VL: the processor's flattened patches, in merge-group order
        patch, merge, temporal = vision.patch_size, vision.spatial_merge_size, vision.temporal_patch_size
        resized = picture.resize((layout.cols * patch, layout.rows * patch), Image.BICUBIC)
        pictures = [np.asarray(resized)]
        frames = _normalised(resized, mean, std)[None].expand(temporal, -1, -1, -1)  # a still image: frame repeated
        channels = frames.shape[1]
        blocks = frames.reshape(1, temporal, channels, layout.rows // merge, merge, patch, layout.cols // merge, merge,
                                patch)
        blocks = blocks.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
        name, value = "pixel_values", blocks.reshape(layout.rows * layout.cols, channels * temporal * patch * patch)
    reference = inputs[name]
    inputs[name] = value.to(device=reference.device, dtype=reference.dtype).contiguous()
    return inputs, pictures


def _cells(layout: Layout, stage: str, tensor: torch.Tensor, span: list[Cell] | None = None) -> list[Cell]:
    """The cells of a record's indices; an LLM record's through `span` (`Layout.cut_span`) after a cut. -1: a row's
    padding (an item that kept or lost fewer than the widest row), no cell."""
    if stage == "llm" and span is not None:
        return [span[index] if 0 <= index < len(span) else None for row in tensor.tolist() for index in row]
    return [layout.cell(stage, item, int(index)) if index >= 0 else None
            for item, row in enumerate(tensor.tolist()) for index in row]


def show_data(model: nn.Module, variant: str, schedule: Any, inputs: dict[str, Any], layout: Layout,
              pictures: list[np.ndarray | None]) -> dict[str, Any]:
    """Run the model once under the method and place every record's tokens on the picture.

    Returns the JSON-able data `ficoco.sweep.figures.token_figure` draws: panels, one step per reducing
    layer (kept, discarded, merged-into and earlier-removed cells, and the handle's raw records)
    and the end state (every discarded token linked to the kept token it finally went into).
    """
    import ficoco

    with torch.inference_mode(), ficoco.apply(model, variant, schedule=schedule) as handle:
        model(**inputs, use_cache=False, logits_to_keep=1)
        records = list(handle.records)
    steps: list[dict[str, Any]] = []
    removed: list[Cell] = []
    owner: dict[tuple[int, ...], Cell] = {}
    # A cut before the LLM shortens the span a later LLM step's records index (ViTCoP, HoliTom).
    cuts = [r for r in schedule.removals if r.stage == "vision" and r.where != "in_layer"]
    span: list[Cell] | None = None
    for record in records:
        kept = [c for c in _cells(layout, record.stage, record.kept, span) if c is not None]
        discarded = _cells(layout, record.stage, record.discarded, span)
        merged = None if record.merged_into is None else _cells(layout, record.stage, record.merged_into, span)
        if record.stage == "vision" and cuts:
            span = layout.cut_span(record.kept)
        steps.append({
            "stage": record.stage, "layer": record.layer, "kept": kept, "discarded": discarded, "merged_into": merged,
            "removed_before": list(removed),
            "records": {"kept": record.kept.tolist(), "discarded": record.discarded.tolist(),
                        "merged_into": None if record.merged_into is None else record.merged_into.tolist()},
        })
        removed += [c for c in discarded if c is not None]
        for k, cell in enumerate(discarded):
            if cell is not None:
                owner[tuple(cell)] = merged[k] if merged is not None else None
    end_kept = steps[-1]["kept"] if steps else [[p, r, c, 1, 1] for p, panel in enumerate(layout.panels)
                                                 for r in range(panel["rows"]) for c in range(panel["cols"])]
    if layout.family in MERGE_GROUP_FAMILIES and not steps:
        merge = layout.merge
        end_kept = [[0, r, c, merge, merge] for r in range(0, layout.rows, merge) for c in range(0, layout.cols, merge)]

    def final(cell: Cell) -> Cell:
        # A kept token may itself be discarded by a later layer: follow it to where it ended.
        seen = 0
        while cell is not None and tuple(cell) in owner and seen <= len(owner):
            cell, seen = owner[tuple(cell)], seen + 1
        return cell

    end_discarded = [c for c in removed]
    end = {"stage": steps[-1]["stage"] if steps else "none", "layer": None, "label": "end (merged into, finally)",
           "kept": end_kept, "discarded": end_discarded,
           "merged_into": [final(owner.get(tuple(c))) for c in end_discarded] if any(
               s["merged_into"] is not None for s in steps) else None,
           "removed_before": []}
    # The pictures stay arrays for drawing; `to_json` leaves them out of the report.
    panels = [dict(panel, picture=picture) for panel, picture in zip(layout.panels, pictures, strict=True)]
    return {"schema": "ficoco.show/1", "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "environment": report_environment(), "family": layout.family, "variant": variant,
            "schedule": schedule.to_json(), "panels": panels, "steps": steps, "end": end}


def to_json(data: dict[str, Any]) -> dict[str, Any]:
    """The show data without the panels' pixels (the report names the image file instead)."""
    panels = [{k: v for k, v in panel.items() if k != "picture"} for panel in data["panels"]]
    # Each step's earlier removals are the earlier steps' discarded cells: not repeated per step.
    steps = [{k: v for k, v in step.items() if k != "removed_before"} for step in data["steps"]]
    return {**data, "panels": panels, "steps": steps}
