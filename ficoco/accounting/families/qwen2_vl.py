"""Qwen2-VL's shapes (`Qwen2VLForConditionalGeneration`): a ViT without [CLS] over native-resolution
patches (the processor's smart resize), a PatchMerger joining every 2 x 2 group into one LLM token,
and a Qwen2 decoder. A video is one tower item per temporal slice. No torch.

Qwen2.5-VL's shape module reuses the decoder, the resize and the video
layout, with its own windowed tower.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from ficoco.accounting.families.parts import llama_decoder
from ficoco.accounting.shapes import (
    Architecture,
    Decoder,
    Family,
    Layout,
    Projector,
    VisionTower,
    check_divisible,
    get,
    whole,
)
from ficoco.errors import FicocoError

# Qwen2VLTextConfig's defaults.
TEXT_DEFAULTS = {
    "hidden_size": 8192, "intermediate_size": 29568, "num_hidden_layers": 80, "num_attention_heads": 64,
    "num_key_value_heads": 8, "vocab_size": 152064, "tie_word_embeddings": False,
}
# Qwen2VLVisionConfig's defaults.
VISION_DEFAULTS = {
    "depth": 32, "embed_dim": 1280, "hidden_size": 3584, "mlp_ratio": 4, "num_heads": 16, "in_channels": 3,
    "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2,
}
# Qwen2-VL's image processor bounds (min_pixels, max_pixels).
MIN_PIXELS = 56 * 56
MAX_PIXELS = 28 * 28 * 1280
MAX_ASPECT = 200  # smart_resize refuses a longer side over 200 x the shorter
# The default image: a 672 px square.
DEFAULT_IMAGE = (672, 672)


def qwen_decoder(cfg: dict[str, Any], title: str) -> Decoder:
    """The Qwen2 decoder of a Qwen2-VL or Qwen2.5-VL config (its text_config, or the top level of a
    config without one); its attention refuses a hidden size that is not a multiple of the heads."""
    tcfg = cfg.get("text_config")
    return llama_decoder(tcfg or cfg, TEXT_DEFAULTS, qkv_bias=True, section="text_config" if tcfg else "",
                         heads_refuser=f"transformers' {title}Attention")


def qwen2_vl_resize(size_hw: tuple[int, int], factor: int, min_pixels: int = MIN_PIXELS,
                    max_pixels: int = MAX_PIXELS) -> tuple[int, int]:
    """Qwen2-VL's smart resize: multiples of patch x merge within the pixel bounds (Qwen2-VL's by default;
    Qwen3-VL's and Qwen3.5's checkpoints give the same image processor other bounds)."""
    height, width = size_hw
    h = max(factor, round(height / factor) * factor)
    w = max(factor, round(width / factor) * factor)
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = math.floor(height / beta / factor) * factor
        w = math.floor(width / beta / factor) * factor
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w


def image_pixels(size_hw: tuple[int, int], patch: int, merge: int, title: str, min_pixels: int = MIN_PIXELS,
                 max_pixels: int = MAX_PIXELS) -> tuple[int, int]:
    """(height, width) in pixels Qwen2-VL's and Qwen2.5-VL's processor (with other pixel bounds: Qwen3-VL's and
    Qwen3.5's) resizes `size_hw` to, or one line on why no image of that shape fits."""
    if max(size_hw) / min(size_hw) > MAX_ASPECT:
        raise FicocoError(f"image size {size_hw[1]}x{size_hw[0]} (image_size=): {title}'s processor takes aspect "
                          f"ratios up to {MAX_ASPECT}")
    h_px, w_px = qwen2_vl_resize(size_hw, patch * merge, min_pixels, max_pixels)
    if not (h_px and w_px):
        raise FicocoError(f"config values patch_size={patch} x spatial_merge_size={merge} exceed {title}'s "
                          f"largest image ({max_pixels} pixels): no visual token fits")
    return h_px, w_px


def pixel_bounds(layout: Layout, min_default: int = MIN_PIXELS, max_default: int = MAX_PIXELS) -> tuple[int, int]:
    """The image processor's (min_pixels, max_pixels): the family's defaults, or a checkpoint's own (the
    profile's `ficoco.min_pixels` / `ficoco.max_pixels`, which a checkpoint's preprocessor_config.json sets where
    ficoco reads it, and which the vLLM plugin sets to admit the grid vLLM's processor made)."""
    low = whole("ficoco.min_pixels", layout.defaults.get("min_pixels", min_default))
    high = whole("ficoco.max_pixels", layout.defaults.get("max_pixels", max_default))
    if low > high:
        raise FicocoError(f"ficoco.min_pixels={low} exceeds ficoco.max_pixels={high}: give min_pixels <= max_pixels")
    return low, high


def check_tower_heads(width_key: str, width: int, heads: int, title: str) -> None:
    """The packed tower's attention splits its width into heads (a reshape that fails otherwise)."""
    check_divisible("vision_config", width_key, width, "num_heads", heads, f"transformers' {title} vision attention")


def with_video(vision: VisionTower, layout: Layout) -> tuple[VisionTower, int | None]:
    """The tower for the layout's video (one item, attention segment, per temporal slice of
    temporal_patch frames; the last padded by repetition, as the processor does), and its frames;
    an image's tower and None."""
    frames = layout.frames if layout.frames is not None else layout.defaults.get("frames")
    if frames is None:
        return vision, None
    frames = whole("ficoco.frames", frames)
    return replace(vision, items=-(-frames // vision.temporal_patch)), frames


def qwen_architecture(layout: Layout, vision: VisionTower, projector: Projector, decoder: Decoder,
                      size_hw: tuple[int, int]) -> Architecture:
    """A Qwen2-VL-like model's shapes for the layout's image (or video): one LLM token per merge group."""
    vision, frames = with_video(vision, layout)
    return Architecture(
        name=layout.name, family=layout.family, vision=vision, projector=projector, decoder=decoder,
        visual_tokens=vision.items * vision.units, newline_tokens=0, cls_in_llm=False, unpadding_drops=0,
        image_newline_param=False, text_tokens=layout.text_tokens,
        first_reducing_layers=layout.first_reducing_layers, image_size=size_hw, video_frames=frames,
    )


def shape(cfg: dict[str, Any], layout: Layout) -> Architecture:
    """One image of `layout.image_size` (a 672 px square by default), or a video of `layout.frames`."""
    decoder = qwen_decoder(cfg, "Qwen2VL")
    vcfg = cfg.get("vision_config") or {}
    d = VISION_DEFAULTS
    patch, merge = get(vcfg, "patch_size", d), get(vcfg, "spatial_merge_size", d)
    size_hw = layout.image_size or DEFAULT_IMAGE
    h_px, w_px = image_pixels(size_hw, patch, merge, "Qwen2-VL", *pixel_bounds(layout))
    embed = get(vcfg, "embed_dim", d)
    layers = get(vcfg, "depth", d)
    heads = get(vcfg, "num_heads", d)
    check_tower_heads("embed_dim", embed, heads, "Qwen2-VL")
    vision = VisionTower(
        kind="qwen2_vl", layers=layers, hidden=embed, ffn=embed * get(vcfg, "mlp_ratio", d),
        heads=heads, patch_size=patch, channels=get(vcfg, "in_channels", d),
        temporal_patch=get(vcfg, "temporal_patch_size", d), grid_h=h_px // patch, grid_w=w_px // patch,
        items=1, has_cls=False, feature_layer=layers - 1, merge=merge * merge, towers=1,
        position_embeddings=0, fused_qkv=True,
    )
    merged = embed * merge * merge
    projector = Projector(((merged, merged), (merged, get(vcfg, "hidden_size", d))), embed)
    return qwen_architecture(layout, vision, projector, decoder, size_hw)


FAMILY = Family(name="qwen2_vl", defaults={"text_tokens": 60, "image_size": list(DEFAULT_IMAGE)}, shape=shape,
                prefix_tokens=4, video_slices=True, takes_image_size=True, takes_frames=True)
