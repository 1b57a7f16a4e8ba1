"""LLaVA-NeXT's shapes (`LlavaNextForConditionalGeneration`): LLaVA's CLIP tower and LLaMA decoder
with AnyRes: an image is a base view plus a grid of crops (the config's grid pinpoint that best fits
its size), whose patches are unpadded to the image's aspect ratio and end each row with an
image_newline token. No torch."""

from __future__ import annotations

import math
from typing import Any

from ficoco.accounting.families.llava import LLAVA_CLIP_DEFAULTS, llava_decoder, mlp_projector
from ficoco.accounting.families.parts import clip_tower
from ficoco.accounting.shapes import Architecture, Family, Layout, get, size
from ficoco.errors import FicocoError


def select_best_resolution(size_hw: tuple[int, int], pinpoints: list[list[int]]) -> tuple[int, int]:
    """LLaVA-NeXT's AnyRes choice: the pinpoint with the most effective pixels, then least waste."""
    height, width = size_hw
    best, best_effective, best_wasted = None, -1, math.inf
    for ph, pw in pinpoints:
        scale = min(pw / width, ph / height)
        down_w, down_h = int(width * scale), int(height * scale)
        effective = min(down_w * down_h, width * height)
        wasted = pw * ph - effective
        if effective > best_effective or (effective == best_effective and wasted < best_wasted):
            best, best_effective, best_wasted = (ph, pw), effective, wasted
    assert best is not None
    return best


def unpadded_grid(rows: int, cols: int, size_hw: tuple[int, int]) -> tuple[int, int]:
    """Rows and columns left after LLaVA-NeXT removes the padding of the resized image."""
    orig_h, orig_w = size_hw
    if orig_w / orig_h > cols / rows:
        new_h = int(round(orig_h * (cols / orig_w), 7))
        pad = (rows - new_h) // 2
        return rows - 2 * pad, cols
    new_w = int(round(orig_w * (rows / orig_h), 7))
    pad = (cols - new_w) // 2
    return rows, cols - 2 * pad


def anyres_crops(cfg: dict[str, Any], size_hw: tuple[int, int], crop_px: int) -> tuple[int, int]:
    """(rows, cols) of crops AnyRes (LLaVA-NeXT, LLaVA-OneVision) cuts an image of `size_hw` into: the
    config's grid pinpoint that best fits it, in whole `crop_px` crops."""
    pinpoints = cfg.get("image_grid_pinpoints") or [[crop_px, crop_px]]
    if not isinstance(pinpoints, list):
        raise FicocoError(f"config value image_grid_pinpoints={pinpoints!r} must be a list of [height, width]")
    pinpoints = [size("image_grid_pinpoints", p) for p in pinpoints]
    best_h, best_w = select_best_resolution(size_hw, pinpoints)
    crops_h, crops_w = best_h // crop_px, best_w // crop_px
    if not (crops_h and crops_w):
        raise FicocoError(f"image_grid_pinpoints: the chosen [{best_h}, {best_w}] is smaller than one "
                          f"{crop_px}-pixel crop (vision_config.image_size)")
    return crops_h, crops_w


def shape(cfg: dict[str, Any], layout: Layout) -> Architecture:
    """One image of `layout.image_size` (a square of 2 x 2 crops by default): the base view, the
    unpadded crop grid, one newline per kept row."""
    decoder = llava_decoder(cfg)
    vcfg = cfg.get("vision_config") or {}
    crop_px = get(vcfg, "image_size", LLAVA_CLIP_DEFAULTS)
    size_hw = layout.image_size or (crop_px * 2, crop_px * 2)
    crops_h, crops_w = anyres_crops(cfg, size_hw, crop_px)
    vision = clip_tower(vcfg, LLAVA_CLIP_DEFAULTS, cfg.get("vision_feature_layer", -2), image_px=None,
                        items=1 + crops_h * crops_w, towers=1)
    rows, cols = crops_h * vision.grid_h, crops_w * vision.grid_w
    kept_rows, kept_cols = unpadded_grid(rows, cols, size_hw)
    return Architecture(
        name=layout.name, family=layout.family, vision=vision, projector=mlp_projector(vision.hidden, decoder.hidden),
        decoder=decoder, visual_tokens=vision.patches + kept_rows * kept_cols + kept_rows, newline_tokens=kept_rows,
        cls_in_llm=False, unpadding_drops=rows * cols - kept_rows * kept_cols, image_newline_param=True,
        text_tokens=layout.text_tokens, first_reducing_layers=layout.first_reducing_layers, image_size=size_hw,
    )


FAMILY = Family(name="llava_next", defaults={"text_tokens": 60, "image_size": [672, 672]}, shape=shape, prefix_tokens=5,
                takes_image_size=True)
