"""Qwen3-VL's shapes (`Qwen3VLForConditionalGeneration`): a ViT without [CLS] over native-resolution patches
of 16 px (fused qkv with bias, LayerNorms, a GELU MLP, learned position embeddings bilinearly resampled to
each image's grid, 2-D rotary), a merger joining every 2 x 2 group into one LLM token, DeepStack mergers on
the outputs of the `deepstack_visual_indexes` tower layers whose features are added to the visual positions
after the first decoder layers, and a Qwen3 decoder (QK-norm, no biases). A video is one tower item per
temporal slice, as Qwen2-VL's. No torch.

Qwen3-VL-MoE (ficoco.accounting.families.qwen3_vl_moe) and Qwen3.5 (ficoco.accounting.families.qwen3_5)
reuse the tower and the resize.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from ficoco.accounting.families.parts import llama_decoder
from ficoco.accounting.families.qwen2_vl import (
    MAX_ASPECT,
    check_tower_heads,
    image_pixels,
    pixel_bounds,
    qwen_architecture,
)
from ficoco.accounting.shapes import Architecture, Decoder, Family, Layout, Projector, VisionTower, get, whole
from ficoco.errors import FicocoError

# Qwen3VLTextConfig's defaults.
TEXT_DEFAULTS = {
    "hidden_size": 4096, "intermediate_size": 22016, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 32, "head_dim": 128, "vocab_size": 151936,
}
# Qwen3VLVisionConfig's defaults (Qwen3VLMoeVisionConfig's and, without DeepStack, Qwen3_5VisionConfig's are
# the same).
VISION_DEFAULTS = {
    "depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "num_heads": 16, "in_channels": 3,
    "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2, "out_hidden_size": 3584,
    "num_position_embeddings": 2304, "deepstack_visual_indexes": [8, 16, 24], "hidden_act": "gelu_pytorch_tanh",
}
# The image processor the checkpoints name is Qwen2-VL's, with their preprocessor_config.json's bounds
# (size.shortest_edge and size.longest_edge): 256 x 256 to 4096 x 4096 pixels. Qwen3.5's checkpoints give
# the same.
MIN_PIXELS = 65536
MAX_PIXELS = 16777216
# The default image: a 768 px square (48 x 48 patches, 576 LLM tokens).
DEFAULT_IMAGE = (768, 768)
# The checkpoints' video processor (Qwen3VLVideoProcessor, video_preprocessor_config.json's size): the whole
# video's pixels (frames rounded to the temporal patch, times height and width) between these bounds.
VIDEO_MIN_PIXELS = 4096
VIDEO_MAX_PIXELS = 25165824


def video_frame_pixels(frames: int, size_hw: tuple[int, int], factor: int, temporal: int) -> tuple[int, int]:
    """(height, width) in pixels Qwen3-VL's video processor resizes `frames` frames of `size_hw` to (its
    smart_resize: multiples of patch x merge, the video's pixels within the bounds), or one line on why not."""
    if frames < temporal:
        raise FicocoError(f"frames={frames}: Qwen3-VL's video processor needs at least temporal_patch_size="
                          f"{temporal} frames; give frames={temporal} or more, or an image")
    height, width = size_hw
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > MAX_ASPECT:
        raise FicocoError(f"image size {size_hw[1]}x{size_hw[0]} (image_size=): the video processor takes aspect "
                          f"ratios up to {MAX_ASPECT}")
    h = round(height / factor) * factor
    w = round(width / factor) * factor
    t = round(frames / temporal) * temporal
    if t * h * w > VIDEO_MAX_PIXELS:
        beta = math.sqrt(frames * height * width / VIDEO_MAX_PIXELS)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif t * h * w < VIDEO_MIN_PIXELS:
        beta = math.sqrt(VIDEO_MIN_PIXELS / (frames * height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w


def text_section(cfg: dict[str, Any], defaults: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """The decoder's config section with the text config class's defaults for the keys it leaves out (or
    sets to null), and the section's name."""
    tcfg = cfg.get("text_config")
    section = "text_config" if tcfg else ""
    given = {key: value for key, value in (tcfg or cfg).items() if value is not None}
    return {**defaults, **given}, section


def qwen3_decoder(cfg: dict[str, Any], defaults: dict[str, Any]) -> Decoder:
    """A Qwen3 decoder (grouped-query attention with per-head RMSNorms on q and k, no biases by default) read
    from the config's text_config; the top level's tie_word_embeddings decides the LM head's tying, as
    transformers' PreTrainedModel reads it."""
    tcfg, section = text_section(cfg, defaults)
    decoder = llama_decoder(tcfg, defaults, section=section or "text_config")
    tied = cfg.get("tie_word_embeddings")
    return replace(decoder, qk_norm=True, o_bias=decoder.qkv_bias, tied_embeddings=bool(tied))


def deepstack_layers(vcfg: dict[str, Any], defaults: dict[str, Any], tower_layers: int,
                     decoder_layers: int) -> tuple[int, ...]:
    """The tower layers DeepStack taps (`deepstack_visual_indexes`), each run through its own merger."""
    value = vcfg.get("deepstack_visual_indexes")
    value = defaults.get("deepstack_visual_indexes", []) if value is None else value
    if not isinstance(value, (list, tuple)) or not all(isinstance(i, int) and not isinstance(i, bool)
                                                        for i in value):
        raise FicocoError(f"config value deepstack_visual_indexes={value!r} must be a list of tower layer indices")
    taps = tuple(value)
    outside = [i for i in taps if not 0 <= i < tower_layers]
    if outside:
        raise FicocoError(f"deepstack_visual_indexes {list(taps)} name layer {outside[0]}, outside the "
                          f"{tower_layers}-layer tower: its merger would never run; give indices from 0 to "
                          f"{tower_layers - 1}")
    if len(set(taps)) != len(taps):
        raise FicocoError(f"deepstack_visual_indexes {list(taps)} repeats a layer: transformers runs only the "
                          "first of its mergers; give each layer once")
    if len(taps) > decoder_layers:
        raise FicocoError(f"deepstack_visual_indexes has {len(taps)} layers but the decoder {decoder_layers}: the "
                          "features past the last decoder layer are never added; give at most one per decoder layer")
    return taps


def qwen3_vision(vcfg: dict[str, Any], layout: Layout, title: str) -> tuple[VisionTower, Projector, tuple[int, int]]:
    """Qwen3-VL's (Qwen3.5's) tower and merger for the layout's image (a 768 px square by default), or for
    every frame of its video (the video processor's resize), and the image size asked for."""
    d = VISION_DEFAULTS
    patch, merge = get(vcfg, "patch_size", d), get(vcfg, "spatial_merge_size", d)
    size_hw = layout.image_size or DEFAULT_IMAGE
    frames = layout.frames if layout.frames is not None else layout.defaults.get("frames")
    if frames is None:
        h_px, w_px = image_pixels(size_hw, patch, merge, title, *pixel_bounds(layout, MIN_PIXELS, MAX_PIXELS))
    else:
        h_px, w_px = video_frame_pixels(whole("ficoco.frames", frames), size_hw, patch * merge,
                                        get(vcfg, "temporal_patch_size", d))
    hidden, layers, heads = get(vcfg, "hidden_size", d), get(vcfg, "depth", d), get(vcfg, "num_heads", d)
    check_tower_heads("hidden_size", hidden, heads, title)
    vision = VisionTower(
        kind="qwen3_vl", layers=layers, hidden=hidden, ffn=get(vcfg, "intermediate_size", d), heads=heads,
        patch_size=patch, channels=get(vcfg, "in_channels", d), temporal_patch=get(vcfg, "temporal_patch_size", d),
        grid_h=h_px // patch, grid_w=w_px // patch, items=1, has_cls=False, feature_layer=layers - 1,
        merge=merge * merge, towers=1, position_embeddings=get(vcfg, "num_position_embeddings", d), fused_qkv=True,
        act=str(get(vcfg, "hidden_act", d)),
    )
    merged = hidden * merge * merge
    projector = Projector(((merged, merged), (merged, get(vcfg, "out_hidden_size", d))), hidden)
    return vision, projector, size_hw


def qwen3_vl_architecture(cfg: dict[str, Any], layout: Layout, decoder: Decoder, title: str,
                          deepstack: bool = True) -> Architecture:
    """A Qwen3-VL-like model's shapes: the tower, merger (and DeepStack mergers) of `cfg`'s vision_config
    before `decoder`."""
    vcfg = cfg.get("vision_config") or {}
    vision, projector, size_hw = qwen3_vision(vcfg, layout, title)
    arch = qwen_architecture(layout, vision, projector, decoder, size_hw)
    taps = deepstack_layers(vcfg, VISION_DEFAULTS, vision.layers, decoder.layers) if deepstack else ()
    return replace(arch, deepstack_layers=taps)


def shape(cfg: dict[str, Any], layout: Layout) -> Architecture:
    """One image of `layout.image_size` (a 768 px square by default), or a video of `layout.frames`."""
    return qwen3_vl_architecture(cfg, layout, qwen3_decoder(cfg, TEXT_DEFAULTS), "Qwen3-VL")


FAMILY = Family(name="qwen3_vl", defaults={"text_tokens": 60, "image_size": list(DEFAULT_IMAGE)}, shape=shape,
                prefix_tokens=4, video_slices=True, takes_image_size=True, takes_frames=True)
