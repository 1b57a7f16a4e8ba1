"""Inputs laid out like Qwen3.5's processor: Qwen3-VL's image grid (16 px patches, the checkpoints'
65536..16777216-pixel bounds) and Qwen2-VL's chat template ("<|im_start|>user\\n<|vision_start|>" before the
image span, one `<|image_pad|>` per 2 x 2 merge group, "<|vision_end|>" and the question after it)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from ficoco.errors import FicocoError
from ficoco.models.qwen2_vl.inputs import PREFIX_TOKENS, PROMPT, qwen_template_inputs
from ficoco.models.qwen3_vl.inputs import image_grid

__all__ = ["PREFIX_TOKENS", "PROMPT", "image_grid", "synthetic_inputs"]


def synthetic_inputs(model: nn.Module, *, batch: int = 1, text_tokens: int = 60, seed: int = 0,
                     dtype: torch.dtype | None = None, device: torch.device | str | None = None,
                     image_size: tuple[int, int] | None = None, frames: int | None = None,
                     **_: Any) -> dict[str, Tensor]:
    """`batch` prompts of one image each, laid out like Qwen3.5's processor (random ordinary ids for the words,
    `text_tokens` text tokens in all): `input_ids`, `attention_mask`, `pixel_values` (batch x rows x cols
    flattened patches of 3 x 2 x 16 x 16), `image_grid_thw` and `mm_token_type_ids`. The image is `image_size`
    (H, W), the profile's by default. Videos are refused: the processor lays a video out slice by slice with
    timestamps between them."""
    if model.config.model_type != "qwen3_5":
        raise FicocoError(f"these synthetic inputs are laid out for Qwen3.5 only, not '{model.config.model_type}'")
    if frames is not None or (image_size is None and (getattr(model, "_ficoco_defaults", None) or {}).get("frames")):
        raise FicocoError("Qwen3.5's synthetic inputs are images only: its processor lays a video out slice by "
                          "slice with timestamps between them; give a real video through the checkpoint's processor")
    return qwen_template_inputs(model, image_grid(model, image_size), batch=batch, text_tokens=text_tokens,
                                seed=seed, dtype=dtype, device=device)
