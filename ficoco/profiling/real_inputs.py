"""`ficoco profile --weights DIR --image FILE --prompt TEXT` (`--video` for Video-LLaVA): the
prompt is laid out by the checkpoint's processor before anything is built, and the run is planned
for the layout it made (image size, frames, text tokens), so the accountant's figures are those
of the inputs the model runs on."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from ficoco.errors import FicocoError
from ficoco.profiles import load_profile, set_layout


def resolve_prompt(config: Any) -> tuple[Any, Any]:
    """(config, prompt): with a checkpoint and an --image, --video or --prompt, the prompt as the
    checkpoint's processor lays it out (models.prompt.PromptInputs) and the config with its
    layout (text tokens, image size, frames); otherwise the config unchanged and None. Every
    mistake in the input is one FicocoError, before any model is built."""
    from ficoco.accounting import architecture
    from ficoco.models.prompt import encode_prompt

    wanted = (config.image, config.video, config.prompt)
    if config.weights == "random" or all(value is None for value in wanted):
        return config, None
    if config.image_size is not None:
        raise FicocoError("image_size=: with image= the image gives the size; drop image_size=")
    folder = str(Path(config.weights).expanduser())
    source = folder if Path(folder).is_dir() else config.model
    profile = load_profile(source, list(config.overrides))
    prompt = encode_prompt(folder, profile.config, image=config.image, video=config.video, prompt=config.prompt,
                           frames=config.frames, default_frames=int(profile.defaults.get("frames", 8)))
    set_layout(profile, image_size=prompt.image_size, frames=prompt.frames)
    planned = architecture(profile).visual_tokens
    if planned != prompt.visual_tokens:
        raise FicocoError(f"the processor of {folder} laid out {prompt.visual_tokens} placeholders for the "
                          f"{prompt.media}, but the model's config plans {planned}; the processor files and "
                          "config.json disagree (are they from the same checkpoint?)")
    return dataclasses.replace(config, text_tokens=prompt.text_tokens, image_size=prompt.image_size,
                               frames=prompt.frames), prompt
