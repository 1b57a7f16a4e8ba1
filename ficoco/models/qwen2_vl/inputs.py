"""Inputs laid out like Qwen2-VL's processor (Qwen2.5-VL's lays prompts out the same way): the patch grid
of an image (`image_grid`) and random-token prompts of one image or one video each (`synthetic_inputs`)."""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import Tensor, nn

from ficoco.errors import FicocoError
from ficoco.models.inputs import place_inputs
from ficoco.models.prompt import PromptFormat
from ficoco.profiles import FAMILY_DEFAULTS

# "<|im_start|> user \n <|vision_start|>" before the image span.
PREFIX_TOKENS = 4
# "<|vision_end|>" before the question, "<|im_end|> \n <|im_start|> assistant \n" after it.
_SUFFIX_TEMPLATE_TOKENS = 6


def image_grid(model: nn.Module, image_size: tuple[int, int] | None = None) -> tuple[int, int]:
    """(rows, cols) of patches Qwen2-VL's (and Qwen2.5-VL's) processor makes of an image of
    `image_size` (H, W), by default the profile's image size."""
    from ficoco.accounting.families.qwen2_vl import qwen2_vl_resize

    if image_size is None:
        defaults = {**FAMILY_DEFAULTS[model.config.model_type], **(getattr(model, "_ficoco_defaults", None) or {})}
        image_size = tuple(defaults["image_size"])
    vision = model.config.vision_config
    height, width = qwen2_vl_resize(tuple(image_size), vision.patch_size * vision.spatial_merge_size)
    return height // vision.patch_size, width // vision.patch_size


def synthetic_inputs(model: nn.Module, *, batch: int = 1, text_tokens: int = 60, seed: int = 0,
                     dtype: torch.dtype | None = None, device: torch.device | str | None = None,
                     image_size: tuple[int, int] | None = None, frames: int | None = None) -> dict[str, Tensor]:
    """Inputs of `batch` prompts of one image each, laid out like Qwen2-VL's processor; with `frames`
    (or a profile whose layout is a video) one video of that many frames of `image_size` instead:
    ceil(frames / temporal_patch_size) temporal slices, `<|video_pad|>` placeholders,
    `pixel_values_videos` and `video_grid_thw`.

    Text: "<|im_start|>user\\n<|vision_start|>" + one `<|image_pad|>` per merge group +
    "<|vision_end|>{question}<|im_end|>\\n<|im_start|>assistant\\n", `text_tokens` text tokens
    in all (random ordinary ids for the words). Pixels: the flattened patches the processor
    makes, (batch x rows x cols, 3 x 2 x 14 x 14), with `image_grid_thw` and `mm_token_type_ids`.
    The image is `image_size` (H, W), the profile's by default. Qwen2.5-VL's processor lays prompts
    out the same way and adds a video's `second_per_grid_ts` (here 1 s per slice: 2 frames per second).
    """
    if model.config.model_type not in ("qwen2_vl", "qwen2_5_vl"):
        raise FicocoError(f"these synthetic inputs are laid out for Qwen2-VL and Qwen2.5-VL only, not "
                          f"'{model.config.model_type}'")
    return qwen_template_inputs(model, image_grid(model, image_size), batch=batch, text_tokens=text_tokens,
                                seed=seed, dtype=dtype, device=device, frames=frames,
                                default_frames=frames is None and image_size is None)


def qwen_template_inputs(model: nn.Module, grid: tuple[int, int], *, batch: int = 1, text_tokens: int = 60,
                         seed: int = 0, dtype: torch.dtype | None = None, device: torch.device | str | None = None,
                         frames: int | None = None, default_frames: bool = False) -> dict[str, Tensor]:
    """`synthetic_inputs` on an image of `grid` (rows, cols) patches, for every family whose processor lays
    prompts out as Qwen2-VL's (Qwen3-VL's images: ficoco.models.qwen3_vl); `default_frames`: a profile's
    video layout when it has one."""
    config = model.config
    fixed = PREFIX_TOKENS + _SUFFIX_TEMPLATE_TOKENS
    if text_tokens < fixed:
        raise FicocoError(f"text_tokens= must be at least the {fixed} template tokens around the image")
    rows, cols = grid
    vision = config.vision_config
    if default_frames:
        frames = (getattr(model, "_ficoco_defaults", None) or {}).get("frames")
    if frames is not None and frames < 1:
        raise FicocoError(f"frames={frames} must be at least 1")
    slices = 1 if frames is None else -(-frames // vision.temporal_patch_size)
    placeholder = config.image_token_id if frames is None else config.video_token_id
    placeholders = slices * rows * cols // vision.spatial_merge_size**2
    start, end = config.vision_start_token_id, config.vision_end_token_id
    # Qwen2's tokenizer puts <|im_start|> and <|im_end|> 8 and 7 ids before <|vision_start|>.
    im_start, im_end = start - 8, start - 7
    special = [t for t in (config.image_token_id, config.video_token_id, start, end, im_start) if t is not None]
    text_vocab = min(config.text_config.vocab_size, *special) - 3
    generator = torch.Generator().manual_seed(seed)
    words = torch.randint(3, 3 + text_vocab, (batch, text_tokens), generator=generator)
    column = functools.partial(torch.full, (batch, 1), dtype=torch.long)
    question = text_tokens - fixed
    input_ids = torch.cat([
        column(im_start), words[:, :2], column(start),  # <|im_start|> user \n <|vision_start|>
        torch.full((batch, placeholders), placeholder, dtype=torch.long),
        column(end), words[:, 2:2 + question],
        column(im_end), words[:, 2 + question:3 + question], column(im_start), words[:, 3 + question:5 + question],
    ], dim=1)
    channels = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
    pixels = torch.randn(batch * slices * rows * cols, channels, generator=generator)
    if frames is not None:
        seconds = {"second_per_grid_ts": torch.ones(batch)} if config.model_type == "qwen2_5_vl" else {}
        return place_inputs(model, input_ids, "pixel_values_videos", pixels, dtype=dtype, device=device,
                            video_grid_thw=torch.tensor([[slices, rows, cols]] * batch),
                            mm_token_type_ids=2 * (input_ids == placeholder).int(), **seconds)
    return place_inputs(model, input_ids, "pixel_values", pixels, dtype=dtype, device=device,
                        image_grid_thw=torch.tensor([[1, rows, cols]] * batch),
                        mm_token_type_ids=(input_ids == config.image_token_id).int())


QWEN_TEMPLATE = ("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>{question}<|im_end|>\n"
                 "<|im_start|>assistant\n")


def encode_pieces(processor: Any, media: str, text: str, pictures: list[Any], placeholder: str,
                  config: dict[str, Any]) -> dict[str, Tensor]:
    """A prompt from the processor's pieces (its video processor needs torchvision): the image processor's
    patches and grids, and for each image in order one placeholder per merge group of its `image_grid_thw`
    row (the processor's own rule, image by image)."""
    vision = config.get("vision_config") or {}
    pixels = processor.image_processor(images=pictures, return_tensors="pt")
    grid = pixels["image_grid_thw"]
    merge = int(getattr(processor.image_processor, "merge_size", vision.get("spatial_merge_size", 2)))
    pieces = text.split(placeholder)
    expanded = pieces[0]
    for index, piece in enumerate(pieces[1:]):
        expanded += placeholder * (int(grid[min(index, len(grid) - 1)].prod()) // merge**2) + piece
    ids = processor.tokenizer([expanded], return_tensors="pt")
    image_id = ids["input_ids"].new_tensor(processor.tokenizer.convert_tokens_to_ids(placeholder))
    # The processor marks image tokens 1 (videos 2, text 0) for the rotary position layout.
    return {**ids, "pixel_values": pixels["pixel_values"], "image_grid_thw": grid,
            "mm_token_type_ids": (ids["input_ids"] == image_id).int()}


def processed_image_size(encoded: dict[str, Tensor], config: dict[str, Any], picture: Any,
                         visual_tokens: int) -> tuple[tuple[int, int], str | None]:
    """The size the processor resized to, which the accountant's resize keeps within the processor's pixel bounds
    (a model built from the checkpoint's folder plans with its preprocessor_config.json's bounds:
    `profiles.processor_pixel_bounds`); a note where it differs from the picture's."""
    patch = int((config.get("vision_config") or {}).get("patch_size", 14))
    _, rows, cols = (int(v) for v in encoded["image_grid_thw"][0].tolist())
    size = (rows * patch, cols * patch)
    note = None
    if size != (picture.height, picture.width):
        note = (f"note: the processor resized the {picture.width}x{picture.height} image to "
                f"{cols * patch}x{rows * patch} ({visual_tokens} visual tokens)")
    return size, note


PROMPT = PromptFormat(template=QWEN_TEMPLATE, encode_pieces=encode_pieces, image_size=processed_image_size)
