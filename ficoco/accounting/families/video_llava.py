"""Video-LLaVA's shapes (`VideoLlavaForConditionalGeneration`): LLaVA's layout with two CLIP towers
(images and videos; the video tower encodes every frame as an item) and every frame's [CLS] passed
to the LLM with its patches. No torch."""

from __future__ import annotations

from typing import Any

from ficoco.accounting.families.llava import llava_decoder, mlp_projector
from ficoco.accounting.families.parts import clip_tower
from ficoco.accounting.shapes import Architecture, Family, Layout, whole
from ficoco.errors import FicocoError

# CLIPVisionConfig's own defaults (VideoLlavaConfig's default towers).
CLIP_DEFAULTS = {
    "hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12,
    "patch_size": 32, "image_size": 224, "num_channels": 3,
}


def shape(cfg: dict[str, Any], layout: Layout) -> Architecture:
    """One video of `layout.frames` (the profile's frames by default): every frame's patches and [CLS]."""
    decoder = llava_decoder(cfg)
    frames = layout.frames
    items = whole("ficoco.frames", layout.defaults.get("frames", 8)) if frames is None else frames
    if items < 1:
        raise FicocoError(f"frames={items} must be at least 1")
    vision = clip_tower(cfg.get("vision_config") or {}, CLIP_DEFAULTS, cfg.get("vision_feature_layer", -2),
                        image_px=None, items=items, towers=2)
    return Architecture(
        name=layout.name, family=layout.family, vision=vision, projector=mlp_projector(vision.hidden, decoder.hidden),
        decoder=decoder, visual_tokens=items * (vision.patches + 1), newline_tokens=0, cls_in_llm=True,
        unpadding_drops=0, image_newline_param=False, text_tokens=layout.text_tokens,
        first_reducing_layers=layout.first_reducing_layers, image_size=layout.image_size,
    )


FAMILY = Family(name="video_llava", defaults={"text_tokens": 60, "frames": 8}, shape=shape, prefix_tokens=5,
                takes_frames=True)
