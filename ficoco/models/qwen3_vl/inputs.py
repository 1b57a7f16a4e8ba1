"""Inputs laid out like Qwen3-VL's processor: the patch grid of an image (`image_grid`: Qwen2-VL's smart resize
with 16 px patches and the checkpoints' 65536..16777216-pixel bounds) and random-token prompts of one image
each (`synthetic_inputs`), in Qwen2-VL's chat template (the same special tokens, the same layout); or of one video
each (`video_inputs`), laid out slice by slice as the processor lays a video out."""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import Tensor, nn

from ficoco.errors import FicocoError
from ficoco.models.inputs import place_inputs
from ficoco.models.qwen2_vl.inputs import PREFIX_TOKENS, PROMPT, qwen_template_inputs
from ficoco.profiles import FAMILY_DEFAULTS

__all__ = ["PREFIX_TOKENS", "PROMPT", "TIMESTAMP_TOKENS", "image_grid", "synthetic_inputs", "video_inputs"]

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
    `image_grid_thw` and `mm_token_type_ids`); with `frames=` (or a profile whose layout is a video) one video each
    instead (`video_inputs`)."""
    known = ("batch", "text_tokens", "seed", "dtype", "device", "image_size", "frames")
    given = {k: v for k, v in kwargs.items() if k in known}
    frames = given.pop("frames", None)
    if frames is None and given.get("image_size") is None:
        frames = (getattr(model, "_ficoco_defaults", None) or {}).get("frames")
    if frames is not None:
        return video_inputs(model, frames=frames, **given)
    return images_only_inputs(model, "Qwen3-VL", LAID_OUT, **given)


# "<{t:.1f} seconds>" before every temporal slice of a video, as random words (the tokenizer makes about this many).
TIMESTAMP_TOKENS = 4
# Around the slices: "<|im_start|>user\n" before, "{question}<|im_end|>\n<|im_start|>assistant\n" after.
_VIDEO_PREFIX, _VIDEO_SUFFIX = 3, 5


def video_inputs(model: nn.Module, *, frames: int, batch: int = 1, text_tokens: int = 60, seed: int = 0,
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None,
                 image_size: tuple[int, int] | None = None) -> dict[str, Tensor]:
    """`batch` prompts of one video of `frames` frames each, laid out like Qwen3-VL's processor: every temporal slice
    (``temporal_patch_size`` frames, the frames' size from its video processor's resize, `image_size` the profile's
    by default) as ``<{t} seconds><|vision_start|>`` + one `<|video_pad|>` per merge group + ``<|vision_end|>``,
    between "<|im_start|>user\\n" and "{question}<|im_end|>\\n<|im_start|>assistant\\n". `text_tokens`: every
    token but the placeholders (the timestamps, the slices' markers and the template's included); pixels
    (batch x slices x rows x cols, 3 x 2 x 16 x 16) with `video_grid_thw` and `mm_token_type_ids` (2 on
    the placeholders)."""
    from ficoco.accounting.families.qwen3_vl import video_frame_pixels

    config = model.config
    if config.model_type not in LAID_OUT:
        raise FicocoError(f"these video inputs are laid out for Qwen3-VL only, not '{config.model_type}'")
    vision = config.vision_config
    if image_size is None:
        defaults = {**FAMILY_DEFAULTS[config.model_type], **(getattr(model, "_ficoco_defaults", None) or {})}
        image_size = tuple(defaults["image_size"])
    height, width = video_frame_pixels(frames, tuple(image_size), vision.patch_size * vision.spatial_merge_size,
                                       vision.temporal_patch_size)
    rows, cols = height // vision.patch_size, width // vision.patch_size
    slices = -(-frames // vision.temporal_patch_size)
    per_slice = TIMESTAMP_TOKENS + 2
    fixed = _VIDEO_PREFIX + slices * per_slice + _VIDEO_SUFFIX
    if text_tokens <= fixed:
        raise FicocoError(f"text_tokens={text_tokens}: a video of {slices} slices takes {fixed} text tokens around "
                          f"its placeholders (timestamps and markers); give text_tokens={fixed + 1} or more")
    start, end = config.vision_start_token_id, config.vision_end_token_id
    im_start, im_end = start - 8, start - 7  # Qwen2's tokenizer: 8 and 7 ids before <|vision_start|>
    special = [t for t in (config.image_token_id, config.video_token_id, start, end, im_start) if t is not None]
    generator = torch.Generator().manual_seed(seed)
    words = torch.randint(3, 3 + min(config.text_config.vocab_size, *special) - 3, (batch, text_tokens),
                          generator=generator)
    column = functools.partial(torch.full, (batch, 1), dtype=torch.long)
    pads = torch.full((batch, rows * cols // vision.spatial_merge_size ** 2), config.video_token_id)
    pieces = [column(im_start), words[:, :2]]
    used = 2
    for _ in range(slices):
        pieces += [words[:, used:used + TIMESTAMP_TOKENS], column(start), pads, column(end)]
        used += TIMESTAMP_TOKENS
    question = text_tokens - fixed
    pieces += [words[:, used:used + question], column(im_end), words[:, used + question:used + question + 1],
               column(im_start), words[:, used + question + 1:used + question + 3]]
    input_ids = torch.cat(pieces, dim=1)
    channels = vision.in_channels * vision.temporal_patch_size * vision.patch_size ** 2
    pixels = torch.randn(batch * slices * rows * cols, channels, generator=generator)
    return place_inputs(model, input_ids, "pixel_values_videos", pixels, dtype=dtype, device=device,
                        video_grid_thw=torch.tensor([[slices, rows, cols]] * batch),
                        mm_token_type_ids=2 * (input_ids == config.video_token_id).int())
