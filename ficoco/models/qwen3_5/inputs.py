"""Inputs laid out like Qwen3.5's processor: the chat template's "<|im_start|>user\n<|vision_start|>" before
the image span, one `<|image_pad|>` per 2 x 2 merge group of 16-pixel patches, "<|vision_end|>" and the
question after it (Qwen2-VL's layout, with Qwen3.5's token ids and patch size read from the config)."""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import Tensor, nn

from ficoco.errors import FicocoError
from ficoco.models.inputs import place_inputs
from ficoco.models.qwen2_vl.inputs import PROMPT
from ficoco.profiles import FAMILY_DEFAULTS

# "<|im_start|> user \n <|vision_start|>" before the image span.
PREFIX_TOKENS = 4
# "<|vision_end|>" before the question, "<|im_end|> \n <|im_start|> assistant \n" after it.
_SUFFIX_TEMPLATE_TOKENS = 6

__all__ = ["PREFIX_TOKENS", "PROMPT", "image_grid", "synthetic_inputs"]


def image_grid(model: nn.Module, image_size: tuple[int, int] | None = None) -> tuple[int, int]:
    """(rows, cols) of patches Qwen3.5's processor makes of an image of `image_size` (H, W), by default the
    profile's: the accountant's resize with Qwen3-VL's pixel bounds."""
    from ficoco.accounting.families.qwen2_vl import image_pixels
    from ficoco.accounting.families.qwen3_vl import MAX_PIXELS, MIN_PIXELS

    if image_size is None:
        defaults = {**FAMILY_DEFAULTS[model.config.model_type], **(getattr(model, "_ficoco_defaults", None) or {})}
        image_size = tuple(defaults["image_size"])
    vision = model.config.vision_config
    height, width = image_pixels(tuple(image_size), vision.patch_size, vision.spatial_merge_size, "Qwen3.5",
                                 MIN_PIXELS, MAX_PIXELS)
    return height // vision.patch_size, width // vision.patch_size


def synthetic_inputs(model: nn.Module, *, batch: int = 1, text_tokens: int = 60, seed: int = 0,
                     dtype: torch.dtype | None = None, device: torch.device | str | None = None,
                     image_size: tuple[int, int] | None = None, **unused: Any) -> dict[str, Tensor]:
    """`batch` prompts of one image each, laid out like Qwen3.5's processor (random ordinary ids for the
    words, `text_tokens` text tokens in all): `input_ids`, `attention_mask`, `pixel_values` (batch x rows x
    cols flattened patches of 3 x 2 x 16 x 16), `image_grid_thw` and `mm_token_type_ids`. The image is
    `image_size` (H, W), the profile's by default."""
    config = model.config
    if config.model_type != "qwen3_5":
        raise FicocoError(f"these synthetic inputs are laid out for Qwen3.5 only, not '{config.model_type}'")
    if unused.get("frames") is not None:
        raise FicocoError("Qwen3.5's synthetic inputs hold one image per prompt; videos are not laid out here")
    fixed = PREFIX_TOKENS + _SUFFIX_TEMPLATE_TOKENS
    if text_tokens < fixed:
        raise FicocoError(f"text_tokens= must be at least the {fixed} template tokens around the image")
    rows, cols = image_grid(model, image_size)
    vision = config.vision_config
    placeholders = rows * cols // vision.spatial_merge_size**2
    start, end = config.vision_start_token_id, config.vision_end_token_id
    # Qwen's tokenizer puts <|im_start|> and <|im_end|> 8 and 7 ids before <|vision_start|>.
    im_start, im_end = start - 8, start - 7
    special = [t for t in (config.image_token_id, config.video_token_id, start, end, im_start) if t is not None]
    text_vocab = min(config.text_config.vocab_size, *special) - 3
    generator = torch.Generator().manual_seed(seed)
    words = torch.randint(3, 3 + text_vocab, (batch, text_tokens), generator=generator)
    column = functools.partial(torch.full, (batch, 1), dtype=torch.long)
    question = text_tokens - fixed
    input_ids = torch.cat([
        column(im_start), words[:, :2], column(start),  # <|im_start|> user \n <|vision_start|>
        torch.full((batch, placeholders), config.image_token_id, dtype=torch.long),
        column(end), words[:, 2:2 + question],
        column(im_end), words[:, 2 + question:3 + question], column(im_start), words[:, 3 + question:5 + question],
    ], dim=1)
    channels = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
    pixels = torch.randn(batch * rows * cols, channels, generator=generator)
    return place_inputs(model, input_ids, "pixel_values", pixels, dtype=dtype, device=device,
                        image_grid_thw=torch.tensor([[1, rows, cols]] * batch),
                        mm_token_type_ids=(input_ids == config.image_token_id).int())
