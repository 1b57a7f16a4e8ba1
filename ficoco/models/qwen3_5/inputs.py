"""Inputs laid out like Qwen3.5's processor: Qwen3-VL's image grid (16 px patches, the checkpoints'
65536..16777216-pixel bounds) and Qwen2-VL's chat template ("<|im_start|>user\\n<|vision_start|>" before the
image span, one `<|image_pad|>` per 2 x 2 merge group, "<|vision_end|>" and the question after it)."""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from ficoco.models.qwen2_vl.inputs import PREFIX_TOKENS, PROMPT
from ficoco.models.qwen3_vl.inputs import image_grid, images_only_inputs

__all__ = ["PREFIX_TOKENS", "PROMPT", "image_grid", "synthetic_inputs"]


def synthetic_inputs(model: nn.Module, **kwargs: Any) -> dict[str, Tensor]:
    """`batch` prompts of one image each, laid out like Qwen3.5's processor (random ordinary ids for the words,
    `text_tokens` text tokens in all): `input_ids`, `attention_mask`, `pixel_values` (batch x rows x cols
    flattened patches of 3 x 2 x 16 x 16), `image_grid_thw` and `mm_token_type_ids`. The image is `image_size`
    (H, W), the profile's by default; images only (`images_only_inputs`)."""
    known = ("batch", "text_tokens", "seed", "dtype", "device", "image_size", "frames")
    return images_only_inputs(model, "Qwen3.5", ("qwen3_5",), **{k: v for k, v in kwargs.items() if k in known})
