"""Inputs laid out like Qwen3-VL's processor: the patch grid of an image (`image_grid`: Qwen2-VL's smart resize
with 16 px patches and the checkpoints' 65536..16777216-pixel bounds) and random-token prompts of one image
each (`synthetic_inputs`), in Qwen2-VL's chat template (the same special tokens, the same layout)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from ficoco.errors import FicocoError
from ficoco.models.qwen2_vl.inputs import PREFIX_TOKENS, PROMPT, qwen_template_inputs
from ficoco.profiles import FAMILY_DEFAULTS

__all__ = ["PREFIX_TOKENS", "PROMPT", "image_grid", "synthetic_inputs"]

# The families whose processor lays prompts out this way (Qwen3-VL's dense and MoE checkpoints).
LAID_OUT = ("qwen3_vl", "qwen3_vl_moe")


def image_grid(model: nn.Module, image_size: tuple[int, int] | None = None) -> tuple[int, int]:
    """(rows, cols) of patches Qwen3-VL's processor makes of an image of `image_size` (H, W), by default the
    profile's image size."""
    from ficoco.accounting.families.qwen2_vl import qwen2_vl_resize
    from ficoco.accounting.families.qwen3_vl import MAX_PIXELS, MIN_PIXELS

    if image_size is None:
        defaults = {**FAMILY_DEFAULTS[model.config.model_type], **(getattr(model, "_ficoco_defaults", None) or {})}
        image_size = tuple(defaults["image_size"])
    vision = model.config.vision_config
    height, width = qwen2_vl_resize(tuple(image_size), vision.patch_size * vision.spatial_merge_size, MIN_PIXELS,
                                    MAX_PIXELS)
    return height // vision.patch_size, width // vision.patch_size


def images_only_inputs(model: nn.Module, title: str, model_types: tuple[str, ...], *, batch: int = 1,
                       text_tokens: int = 60, seed: int = 0, dtype: torch.dtype | None = None,
                       device: torch.device | str | None = None, image_size: tuple[int, int] | None = None,
                       frames: int | None = None) -> dict[str, Tensor]:
    """Prompts of one image each in Qwen2-VL's template on Qwen3-VL's grid, for the model types `model_types`
    (`title` in the refusals). Videos are refused: these processors put a timestamp and their own
    vision_start/vision_end around every temporal slice, a layout these inputs do not make."""
    if model.config.model_type not in model_types:
        raise FicocoError(f"these synthetic inputs are laid out for {title} only, not '{model.config.model_type}'")
    if frames is not None or (image_size is None and (getattr(model, "_ficoco_defaults", None) or {}).get("frames")):
        raise FicocoError(f"{title}'s synthetic inputs are images only: its processor lays a video out slice by "
                          "slice with timestamps between them; give a real video through the checkpoint's processor")
    return qwen_template_inputs(model, image_grid(model, image_size), batch=batch, text_tokens=text_tokens,
                                seed=seed, dtype=dtype, device=device)


def synthetic_inputs(model: nn.Module, **kwargs: Any) -> dict[str, Tensor]:
    """Inputs of `batch` prompts of one image each, laid out like Qwen3-VL's processor (Qwen2-VL's template:
    "<|im_start|>user\\n<|vision_start|>" + one `<|image_pad|>` per merge group + "<|vision_end|>{question}
    <|im_end|>\\n<|im_start|>assistant\\n"; pixels (batch x rows x cols, 3 x 2 x 16 x 16) with
    `image_grid_thw` and `mm_token_type_ids`); images only (`images_only_inputs`)."""
    known = ("batch", "text_tokens", "seed", "dtype", "device", "image_size", "frames")
    return images_only_inputs(model, "Qwen3-VL", LAID_OUT, **{k: v for k, v in kwargs.items() if k in known})
