"""Qwen2.5-VL's shapes (`Qwen2_5_VLForConditionalGeneration`): Qwen2-VL's layout (its decoder, resize
and video slices: ficoco.accounting.families.qwen2_vl) with a tower of gated MLPs and RMSNorms that
attends within windows outside `fullatt_block_indexes`, and an RMSNorm merger. No torch."""

from __future__ import annotations

from typing import Any

from ficoco.accounting.families.qwen2_vl import (
    DEFAULT_IMAGE,
    check_tower_heads,
    image_pixels,
    pixel_bounds,
    qwen_architecture,
    qwen_decoder,
)
from ficoco.accounting.shapes import Architecture, Family, Layout, Projector, VisionTower, get
from ficoco.errors import FicocoError

# Qwen2_5_VLVisionConfig's defaults (its hidden_size is the tower width, out_hidden_size the LLM's).
VISION_DEFAULTS = {
    "depth": 32, "hidden_size": 3584, "intermediate_size": 3420, "num_heads": 16, "in_channels": 3,
    "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 112,
    "out_hidden_size": 3584, "fullatt_block_indexes": [7, 15, 23, 31],
}


def windows(group_rows: int, group_cols: int, window_groups: int) -> tuple[int, ...]:
    """Merge groups in every attention window of a Qwen2.5-VL image of `group_rows` x `group_cols`
    groups, in the tower's window order (row-major over windows): transformers' window index pads the
    group grid to whole windows of `window_groups` per side and drops the padding, so the windows of
    the last row and column are partial."""
    sizes = []
    for top in range(0, group_rows, window_groups):
        for left in range(0, group_cols, window_groups):
            sizes.append(min(window_groups, group_rows - top) * min(window_groups, group_cols - left))
    return tuple(sizes)


def shape(cfg: dict[str, Any], layout: Layout) -> Architecture:
    """One image of `layout.image_size` (a 672 px square by default), or a video of `layout.frames`:
    every temporal slice an item, in its own windows (as Qwen2-VL)."""
    decoder = qwen_decoder(cfg, "Qwen2_5_VL")
    vcfg = cfg.get("vision_config") or {}
    d = VISION_DEFAULTS
    patch, merge = get(vcfg, "patch_size", d), get(vcfg, "spatial_merge_size", d)
    size_hw = layout.image_size or DEFAULT_IMAGE
    h_px, w_px = image_pixels(size_hw, patch, merge, "Qwen2.5-VL", *pixel_bounds(layout))
    embed = get(vcfg, "hidden_size", d)
    layers = get(vcfg, "depth", d)
    window_px = get(vcfg, "window_size", d)
    window_groups = window_px // merge // patch
    if window_groups < 1:
        raise FicocoError(f"config value window_size={window_px} is smaller than one merge group "
                          f"({patch * merge} pixels); give a window of at least one group")
    full = vcfg.get("fullatt_block_indexes", d["fullatt_block_indexes"])
    if not isinstance(full, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in full):
        raise FicocoError(f"config value fullatt_block_indexes={full!r} must be a list of layer indices")
    heads = get(vcfg, "num_heads", d)
    check_tower_heads("hidden_size", embed, heads, "Qwen2.5-VL")
    grid_h, grid_w = h_px // patch, w_px // patch
    vision = VisionTower(
        kind="qwen2_5_vl", layers=layers, hidden=embed, ffn=get(vcfg, "intermediate_size", d),
        heads=heads, patch_size=patch, channels=get(vcfg, "in_channels", d),
        temporal_patch=get(vcfg, "temporal_patch_size", d), grid_h=grid_h, grid_w=grid_w,
        items=1, has_cls=False, feature_layer=layers - 1, merge=merge * merge, towers=1,
        position_embeddings=0,
        window_groups=windows(grid_h // merge, grid_w // merge, window_groups),
        full_attention_layers=frozenset(full), fused_qkv=True, gated_mlp=True,
    )
    merged = embed * merge * merge
    projector = Projector(((merged, merged), (merged, get(vcfg, "out_hidden_size", d))), embed, 1)
    return qwen_architecture(layout, vision, projector, decoder, size_hw)


FAMILY = Family(name="qwen2_5_vl", defaults={"text_tokens": 60, "image_size": list(DEFAULT_IMAGE)}, shape=shape,
                prefix_tokens=4, video_slices=True, takes_image_size=True, takes_frames=True)
