"""Inputs: synthetic ones laid out like the LLaVA-1.5 chat template (random-weight runs), and
real ones from a local checkpoint's own processor and chat template (`encode_prompt`).

"USER: <image>\\n{question} ASSISTANT:" puts a few text tokens before the image span and
the question and the assistant prompt after it; the processor expands `<image>` into one
placeholder per visual token. Synthetic token ids are random (seeded) text ids.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ficoco.errors import FicocoError

# "<s> USER :" before the image, as the LLaVA-1.5 template tokenises it.
PREFIX_TOKENS = 5


def synthetic_inputs(model: nn.Module, *, batch: int = 1, text_tokens: int = 60, seed: int = 0,
                     dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> dict[str, Tensor]:
    """input_ids, attention_mask and pixel_values for `batch` prompts of one image each."""
    config = model.config
    if config.model_type != "llava":
        raise FicocoError(f"synthetic inputs are laid out for LLaVA-1.5 only, not '{config.model_type}'")
    if text_tokens <= PREFIX_TOKENS:
        raise FicocoError(f"text_tokens= must exceed the {PREFIX_TOKENS} template tokens before the image")
    vision = config.vision_config
    patches = (vision.image_size // vision.patch_size) ** 2
    image_token = getattr(config, "image_token_id", None)
    if image_token is None:
        image_token = config.image_token_index
    vocab = config.text_config.vocab_size
    # Ordinary text ids: below the special tokens the LLaVA vocabulary appends.
    text_vocab = min(vocab, image_token) - 3
    generator = torch.Generator().manual_seed(seed)
    text = torch.randint(3, 3 + text_vocab, (batch, text_tokens), generator=generator)
    text[:, 0] = 1  # BOS
    image = torch.full((batch, patches), image_token, dtype=torch.long)
    input_ids = torch.cat([text[:, :PREFIX_TOKENS], image, text[:, PREFIX_TOKENS:]], dim=1)
    pixels = torch.randn(batch, vision.num_channels, vision.image_size, vision.image_size, generator=generator)
    return place_inputs(model, input_ids, "pixel_values", pixels, dtype=dtype, device=device)


def input_device(model: nn.Module) -> torch.device:
    """Where a model's inputs go: its first parameter's device, or under a device map (whose first
    parameter may wait on disk, on the meta device) the device the map computes on first."""
    from ficoco.models.device_map import main_device_of

    return main_device_of(model) or next(model.parameters()).device


def place_inputs(model: nn.Module, input_ids: Tensor, pixel_name: str, pixels: Tensor, *,
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None,
                 **extra: Tensor) -> dict[str, Tensor]:
    """The inputs on the model's device (or `device`), pixels in its floating dtype (or `dtype`),
    with an all-ones attention mask."""
    param = next(model.parameters())
    device = device or input_device(model)
    pixel_dtype = dtype or (param.dtype if param.is_floating_point() else torch.float16)
    return {
        "input_ids": input_ids.to(device),
        "attention_mask": torch.ones_like(input_ids).to(device),
        pixel_name: pixels.to(device=device, dtype=pixel_dtype),
        **{name: value.to(device) for name, value in extra.items()},
    }


def real_inputs(model: nn.Module, weights: str, *, image: str | None, prompt: str | None, batch: int = 1,
                device: torch.device | str | None = None, text_tokens: int = 60, seed: int = 0) -> dict[str, Tensor]:
    """Random-weight LLaVA-1.5 inputs with a real image: the image goes through CLIP's preprocessing
    at the tower's size and the text ids stay synthetic. A checkpoint's prompt is laid out by its
    own processor instead (`ficoco.models.prompt.encode_prompt`)."""
    from PIL import Image, UnidentifiedImageError
    from transformers import CLIPImageProcessor

    if weights != "random" or prompt is not None:
        raise FicocoError("a checkpoint's prompt is laid out by its processor: use ficoco.models.prompt.encode_prompt")
    try:
        picture = Image.open(image).convert("RGB") if image else None
    except (OSError, UnidentifiedImageError) as exc:
        raise FicocoError(f"image={image}: cannot read it as an image ({exc})") from None
    param = next(model.parameters())
    device = device or input_device(model)
    pixel_dtype = param.dtype if param.is_floating_point() else torch.float16
    size = model.config.vision_config.image_size
    # LLaVA-1.5's preprocessing: shortest side to the tower's size, centre crop, CLIP's mean/std.
    processor = CLIPImageProcessor(size={"shortest_edge": size}, crop_size={"height": size, "width": size})
    pixels = processor(images=[picture] * batch, return_tensors="pt")["pixel_values"]
    inputs = synthetic_inputs(model, batch=batch, text_tokens=text_tokens, seed=seed, device=device)
    inputs["pixel_values"] = pixels.to(device=device, dtype=pixel_dtype)
    return inputs
