"""LLaVA-OneVision's shapes (`LlavaOnevisionForConditionalGeneration`): a SigLIP tower (no [CLS]) and
a Qwen2 decoder. An image is AnyRes as LLaVA-NeXT's, its packed crop grid downscaled over the
anyres_max_N budget; a video's frames are each pooled 2 x 2 after the projector, with one
image_newline after the whole video. No torch."""

from __future__ import annotations

import math
from typing import Any

from ficoco.accounting.families.llava import mlp_projector
from ficoco.accounting.families.llava_next import anyres_crops, select_best_resolution, unpadded_grid
from ficoco.accounting.families.parts import llama_decoder
from ficoco.accounting.shapes import (
    Architecture,
    Family,
    Layout,
    VisionTower,
    check_divisible,
    feature_layer,
    get,
    size,
    whole,
)
from ficoco.errors import FicocoError

# Qwen2Config's defaults (LLaVA-OneVision's text model; Qwen2's attention takes any hidden size, with
# head_dim = hidden // heads) and SiglipVisionConfig's as LlavaOnevisionConfig overrides them (so400m at
# 384 px, 26 layers, no pooling head).
QWEN2_TEXT_DEFAULTS = {
    "hidden_size": 4096, "intermediate_size": 22016, "num_hidden_layers": 32, "num_attention_heads": 32,
    "vocab_size": 151936, "tie_word_embeddings": False,
}
SIGLIP_DEFAULTS = {
    "hidden_size": 1152, "intermediate_size": 4304, "num_hidden_layers": 26, "num_attention_heads": 16,
    "patch_size": 14, "image_size": 384, "num_channels": 3,
}


def siglip_tower(vcfg: dict[str, Any], feature: Any, *, items: int) -> VisionTower:
    """SigLIP as LLaVA-OneVision builds it: no [CLS], learned positions for the patches alone, a
    post-LayerNorm (run, its output unread at vision_feature_layer -1) and no pooling head."""
    d = SIGLIP_DEFAULTS
    layers = get(vcfg, "num_hidden_layers", d)
    patch, side_px = get(vcfg, "patch_size", d), get(vcfg, "image_size", d)
    grid = side_px // patch
    if grid < 1:
        raise FicocoError(f"config value image_size={side_px} is smaller than patch_size={patch}: no patch fits")
    if vcfg.get("vision_use_head"):
        raise FicocoError("vision_config.vision_use_head=true: LLaVA-OneVision's SigLIP runs without the pooling "
                          "head (its output is never read); set it to false")
    hidden, heads = get(vcfg, "hidden_size", d), get(vcfg, "num_attention_heads", d)
    check_divisible("vision_config", "hidden_size", hidden, "num_attention_heads", heads,
                    "transformers' SiglipAttention")
    return VisionTower(
        kind="siglip", layers=layers, hidden=hidden, ffn=get(vcfg, "intermediate_size", d),
        heads=heads, patch_size=patch, channels=get(vcfg, "num_channels", d),
        temporal_patch=1, grid_h=grid, grid_w=grid, items=items, has_cls=False,
        feature_layer=feature_layer(feature, layers), merge=1, towers=1, position_embeddings=grid * grid,
    )


def anyres_max_patches(value: Any) -> int:
    """N of LLaVA-OneVision's `vision_aspect_ratio` "anyres_max_N": the packed crop grid's budget, in
    crops' worth of patches."""
    text = str(value)
    digits = text.strip("anyres_max_")  # noqa: B005 - transformers' own parsing (a character strip)
    if not text.startswith("anyres_max_") or not digits.isdigit() or int(digits) < 1:
        raise FicocoError(f"config value vision_aspect_ratio={value!r} must be 'anyres_max_N' with N >= 1")
    return int(digits)


def onevision_downscaled(rows: int, cols: int, side: int, max_patches: int) -> tuple[int, int]:
    """The crop grid LLaVA-OneVision packs after unpadding: `rows x cols` as it is, or, when it holds
    more than 1.1^2 x `max_patches` crops' worth (`side`^2 each), bilinearly resized to
    (rows // ratio, cols // ratio), ratio = sqrt(rows * cols / (max_patches * side^2))."""
    ratio = math.sqrt(rows * cols / (max_patches * side**2))
    if ratio > 1.1:
        return int(rows // ratio), int(cols // ratio)
    return rows, cols


def pooled_side(side: int) -> int:
    """Patches per axis of a LLaVA-OneVision video frame after its 2x2 bilinear pooling (ceil)."""
    return -(-side // 2)


def onevision_image_tokens(cfg: dict[str, Any], size_hw: tuple[int, int]) -> int:
    """Visual tokens LLaVA-OneVision's processor gives one image of `size_hw` (H, W) of a config dict:
    the base view, the unpadded (and, over anyres_max_N, downscaled) crop grid, a newline per row."""
    vcfg = cfg.get("vision_config") or {}
    crop = get(vcfg, "image_size", SIGLIP_DEFAULTS)
    side = crop // get(vcfg, "patch_size", SIGLIP_DEFAULTS)
    pinpoints = [size("image_grid_pinpoints", p) for p in cfg.get("image_grid_pinpoints") or [[crop, crop]]]
    best_h, best_w = select_best_resolution(size_hw, pinpoints)
    rows, cols = unpadded_grid(best_h // crop * side, best_w // crop * side, size_hw)
    rows, cols = onevision_downscaled(rows, cols, side, anyres_max_patches(cfg.get("vision_aspect_ratio",
                                                                                  "anyres_max_9")))
    return side * side + rows * cols + rows


def shape(cfg: dict[str, Any], layout: Layout) -> Architecture:
    """One video of `layout.frames` frames (the profile's, when it sets frames), else one image of
    `layout.image_size` (a square of 2 x 2 crops by default)."""
    decoder = llama_decoder(cfg.get("text_config") or {}, QWEN2_TEXT_DEFAULTS, qkv_bias=True)
    feature = cfg.get("vision_feature_layer", -1)
    if cfg.get("vision_feature_select_strategy", "full") != "full":
        raise FicocoError("vision_feature_select_strategy must be 'full' for LLaVA-OneVision: SigLIP has no "
                          "[CLS] to drop")
    vcfg = cfg.get("vision_config") or {}
    video_frames = layout.frames if layout.frames is not None else layout.defaults.get("frames")
    unpadding_drops = 0
    if video_frames is not None:
        items = whole("ficoco.frames", video_frames)
        vision = siglip_tower(vcfg, feature, items=items)
        pooled = pooled_side(vision.grid_h) * pooled_side(vision.grid_w)
        # Every frame pooled 2x2, then one image_newline after the whole video (transformers' order).
        newline_tokens = 1
        visual = items * pooled + newline_tokens
        post_drops = items * (vision.patches - pooled)
        resampled = "every video frame is pooled 2x2 (bilinear) after the projector, which needs its whole grid"
        pooled_frames: tuple[int, int] | None = (items, pooled)
        size_hw = None
    else:
        crop_px = get(vcfg, "image_size", SIGLIP_DEFAULTS)
        size_hw = layout.image_size or (crop_px * 2, crop_px * 2)
        crops_h, crops_w = anyres_crops(cfg, size_hw, crop_px)
        vision = siglip_tower(vcfg, feature, items=1 + crops_h * crops_w)
        rows, cols = crops_h * vision.grid_h, crops_w * vision.grid_w
        kept_rows, kept_cols = unpadded_grid(rows, cols, size_hw)
        budget = anyres_max_patches(cfg.get("vision_aspect_ratio", "anyres_max_9"))
        packed_rows, packed_cols = onevision_downscaled(kept_rows, kept_cols, vision.grid_h, budget)
        newline_tokens = packed_rows
        unpadding_drops = rows * cols - kept_rows * kept_cols
        post_drops = kept_rows * kept_cols - packed_rows * packed_cols
        resampled = "" if not post_drops else (
            f"the packed crop grid ({kept_rows}x{kept_cols}) exceeds anyres_max_{budget} and is downscaled "
            f"bilinearly to {packed_rows}x{packed_cols}, which needs the whole grid")
        pooled_frames = None
        visual = vision.patches + packed_rows * packed_cols + newline_tokens
    return Architecture(
        name=layout.name, family=layout.family, vision=vision, projector=mlp_projector(vision.hidden, decoder.hidden),
        decoder=decoder, visual_tokens=visual, newline_tokens=newline_tokens, cls_in_llm=False,
        unpadding_drops=unpadding_drops, image_newline_param=True,
        text_tokens=layout.text_tokens, first_reducing_layers=layout.first_reducing_layers, image_size=size_hw,
        post_projector_drops=post_drops, resampled=resampled, pooled_frames=pooled_frames,
    )


# An image by default (a 768 px square: the 2 x 2 AnyRes grid); frames= makes the input a video instead.
FAMILY = Family(name="llava_onevision", defaults={"text_tokens": 60, "image_size": [768, 768]}, shape=shape,
                prefix_tokens=3, takes_image_size=True, takes_frames=True, image_or_video=True)
