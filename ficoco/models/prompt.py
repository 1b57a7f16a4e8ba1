"""Real prompts: an image (or a video) and a question laid out by a local checkpoint's own
processor and chat template, for every family.

`encode_prompt` reads only the checkpoint's processor files (tokenizer, image processor, chat
template), never its weights, so every mistake in the input (a folder without a processor, an
image the processor rejects, more placeholders than images) is found before a model is built.
It returns one prompt's encoding with the layout the accountant must plan for: the visual
tokens the processor laid out, the text tokens around them, the image size (AnyRes and Qwen2-VL
follow it) or the frames of the video.

How a family lays a prompt out is its module's `PROMPT` (a `PromptFormat`: the media it takes, its
documented template, its pieces' encoding, where its image size comes from), so this module names
no family. Where transformers can build the checkpoint's processor (`AutoProcessor`), the processor lays
out the prompt. Qwen2-VL's and Video-LLaVA's processors also hold a video processor, which
transformers 5 builds only with torchvision; without it their pieces are used: the tokenizer,
the image processor and the chat template from the checkpoint, and the processor's own rule
for the number of placeholders (Qwen2-VL: one per merge group of `image_grid_thw`; Video-LLaVA:
frames x (patches + [CLS])), which is what the model checks its features against.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ficoco.errors import FicocoError
from ficoco.models import family_module
from ficoco.models import hf_compat as hf

DEFAULT_QUESTION = {"video": "Describe the video.", "image": "Describe the image."}
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff")
# Inputs that hold pixels: cast to the model's floating dtype; the rest keep theirs.
PIXEL_INPUTS = ("pixel_values", "pixel_values_videos", "pixel_values_images")


@dataclass
class PromptInputs:
    """One prompt as the checkpoint's processor laid it out, and the layout the accountant plans."""

    encoded: dict[str, Tensor]  # batch 1, on the CPU, as the processor returned it
    family: str
    media: str  # "image" or "video"
    visual_tokens: int  # placeholders the processor laid out
    text_tokens: int  # every other token of the prompt
    image_size: tuple[int, int] | None  # (H, W) the accountant plans with (LLaVA-NeXT, Qwen2-VL)
    frames: int | None  # Video-LLaVA
    text: str  # the prompt as the chat template rendered it, before placeholders were expanded
    tokenizer: Any = field(repr=False, default=None)
    notes: list[str] = field(default_factory=list)

    def batch(self, batch: int, *, device: torch.device | str, dtype: torch.dtype) -> dict[str, Tensor]:
        """`batch` copies of the prompt on `device`, pixels in `dtype`. Every input is stacked
        along its first dimension: rows of ids, images, image sizes, grids, and (Qwen2-VL) the
        flattened patches of each image one after the other, as the processor batches them."""
        return {name: torch.cat([value] * batch).to(device=device, dtype=dtype if name in PIXEL_INPUTS else None)
                for name, value in self.encoded.items()}


def _token_id(config: dict[str, Any], *keys: str) -> int | None:
    for key in keys:
        value = config.get(key)
        if isinstance(value, int):
            return value
    return None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:200] if text else type(exc).__name__


def read_image(path: str) -> Any:
    """The image at `path` in RGB, or one error line."""
    from PIL import Image, UnidentifiedImageError

    if not Path(path).is_file():
        raise FicocoError(f"image={path}: no such file")
    try:
        with Image.open(path) as picture:
            return picture.convert("RGB")
    except (OSError, UnidentifiedImageError, SyntaxError, ValueError) as exc:
        raise FicocoError(f"image={path}: not a readable image ({_first_line(exc)})") from None


def _sample(count: int, frames: int) -> list[int]:
    """`frames` indices spread evenly over `count` frames, first and last included (Video-LLaVA's
    uniform sampling)."""
    if frames == 1:
        return [count // 2]
    return [round(i * (count - 1) / (frames - 1)) for i in range(frames)]


def read_video(path: str, frames: int | None, default_frames: int) -> tuple[list[Any], list[str]]:
    """`frames` RGB frames sampled evenly from a folder of frame images (in name order) or a video
    file (with a decoder library); without `frames`, the profile's `default_frames`, or every
    frame of a shorter folder. Returns the frames and notes."""
    import numpy as np
    from PIL import Image

    source = Path(path)
    notes: list[str] = []
    if source.is_dir():
        files = sorted(p for p in source.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file())
        if not files:
            raise FicocoError(f"video={path}: the folder holds no frame images ({', '.join(IMAGE_SUFFIXES)})")
        wanted = frames if frames is not None else min(default_frames, len(files))
        if wanted > len(files):
            raise FicocoError(f"video={path}: frames={wanted} but the folder holds {len(files)} frame(s); "
                              f"give frames={len(files)} or fewer")
        if frames is None and len(files) < default_frames:
            notes.append(f"note: video={path} holds {len(files)} frame(s), fewer than the profile's "
                         f"{default_frames}: all are used")
        return [read_image(str(files[i])) for i in _sample(len(files), wanted)], notes
    if not source.is_file():
        raise FicocoError(f"video={path}: no such file or folder")
    backend = hf.video_backend()
    if backend is None:
        raise FicocoError(f"video={path}: reading a video file needs a decoder library (pip install av); "
                          "or give a folder of frame images")
    wanted = frames if frames is not None else default_frames
    try:
        loaded = hf.load_video(str(source), backend=backend,
                            sample_indices_fn=lambda metadata, **_: np.asarray(_sample(metadata.total_num_frames,
                                                                                      wanted)))
    except Exception as exc:  # each decoder raises its own errors
        raise FicocoError(f"video={path}: cannot decode it ({_first_line(exc)})") from None
    video = loaded[0] if isinstance(loaded, tuple) else loaded
    return [Image.fromarray(np.asarray(frame)).convert("RGB") for frame in video], notes


@dataclass
class _Processor:
    """The checkpoint's processor, or its pieces when transformers cannot build it whole."""

    tokenizer: Any
    image_processor: Any
    chat_template: str | None
    whole: Any = None  # the processor, when it could be built


def _chat_template(folder: Path, tokenizer: Any) -> str | None:
    """The processor's chat template as a checkpoint stores it (chat_template.jinja, or
    chat_template.json), else the tokenizer's."""
    jinja, stored = folder / "chat_template.jinja", folder / "chat_template.json"
    if jinja.is_file():
        return jinja.read_text()
    if stored.is_file():
        try:
            template = json.loads(stored.read_text()).get("chat_template")
        except (ValueError, AttributeError):
            template = None
        if isinstance(template, str):
            return template
    return getattr(tokenizer, "chat_template", None)


def load_processor(folder: str) -> _Processor:
    """The processor of a local checkpoint folder (offline), or one error line saying what is missing."""
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoImageProcessor, AutoProcessor, AutoTokenizer
    from transformers.utils import logging as hf_logging

    missing = (f"weights={folder} has no processor to lay out image=/video=/prompt= with; save the "
               "checkpoint's processor there (processor.save_pretrained) or copy its preprocessor_config.json "
               "and tokenizer files")
    if not Path(folder).is_dir():
        raise FicocoError(f"weights={folder}: image=/video=/prompt= need a local checkpoint folder with its "
                          "processor")
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the PIL fallback's warning is not the user's business
    try:
        try:
            whole = AutoProcessor.from_pretrained(folder, local_files_only=True)
        except Exception:  # noqa: BLE001 - torchvision missing, or no processor files: try the pieces
            whole = None
        if whole is not None and hasattr(whole, "image_processor") and hasattr(whole, "tokenizer"):
            return _Processor(whole.tokenizer, whole.image_processor,
                              getattr(whole, "chat_template", None) or _chat_template(Path(folder), whole.tokenizer),
                              whole)
        try:
            tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
            image_processor = AutoImageProcessor.from_pretrained(folder, local_files_only=True)
        except Exception as exc:  # noqa: BLE001 - OSError, ValueError, KeyError from the loaders
            raise FicocoError(f"{missing} ({_first_line(exc)})") from None
    finally:
        hf_logging.set_verbosity(verbosity)
    return _Processor(tokenizer, image_processor, _chat_template(Path(folder), tokenizer))


# The documented prompt of the LLaVA families, for a checkpoint without a chat template.
LLAVA_TEMPLATE = "USER: <{media}>\n{question} ASSISTANT:"


@dataclass(frozen=True)
class PromptFormat:
    """How a family's checkpoints lay out one prompt; each family module holds its own (`PROMPT`), so this
    module names no family.

    Attributes:
        media: what a prompt of the family holds, the default first ("image"; Video-LLaVA "video";
            LLaVA-OneVision either, a video when one is given).
        template: the family's documented prompt, for a checkpoint without a chat template
            (``{media}`` and ``{question}`` filled in).
        encode_pieces: the encoding from the processor's pieces where transformers cannot build the
            whole processor (it needs torchvision): ``(processor, media, text, pictures, placeholder,
            config) -> encoded``, with the processor's own placeholder rule; None: the whole processor
            or nothing.
        image_size: for an image, the (H, W) the accountant plans with, read from the encoding, and a
            note where the processor resized: ``(encoded, config, picture, visual_tokens) -> (size,
            note or None)``; None where the count does not follow the image's size.
    """

    media: tuple[str, ...] = ("image",)
    template: str = LLAVA_TEMPLATE
    encode_pieces: Callable[..., dict[str, Tensor]] | None = None
    image_size: Callable[..., tuple[tuple[int, int], str | None]] | None = None


def anyres_image_size(encoded: dict[str, Tensor], config: dict[str, Any], picture: Any,
                      visual_tokens: int) -> tuple[tuple[int, int], str | None]:
    """The image's own size as the AnyRes processor records it (LLaVA-NeXT, LLaVA-OneVision)."""
    height, width = (int(v) for v in encoded["image_sizes"][0].tolist())
    return (height, width), None


def encode_prompt(folder: str, config: dict[str, Any], *, image: str | None = None, video: str | None = None,
                  prompt: str | None = None, frames: int | None = None, default_frames: int = 8) -> PromptInputs:
    """One prompt with its image (or video) laid out by the processor and chat template of the
    checkpoint in `folder`; `config` is the checkpoint's config dict. No model is built: every
    error is one FicocoError line."""
    family = config.get("model_type", "")
    form: PromptFormat = family_module(family).PROMPT
    media = "video" if video is not None and "video" in form.media else form.media[0]
    given = video if media == "video" else image
    if media == "video" and image is not None:
        raise FicocoError("image=: Video-LLaVA runs are planned for a video; give video= (a video file or a "
                          "folder of frames) instead")
    if media == "image" and video is not None:
        raise FicocoError(f"video= applies to Video-LLaVA and LLaVA-OneVision checkpoints, not '{family}'; "
                          "give image=")
    if given is None:
        raise FicocoError(f"prompt= needs {media}= as well (a {family} prompt here holds one {media})")
    notes: list[str] = []
    if media == "video":
        pictures, notes = read_video(given, frames, default_frames)
    else:
        if frames is not None:
            raise FicocoError(f"frames= applies to Video-LLaVA videos, not {family}")
        pictures = [read_image(given)]
    return encode_request(load_processor(folder), config, question=prompt, pictures=pictures, media=media,
                          source=given, notes=notes, folder=folder)


def encode_request(processor: _Processor, config: dict[str, Any], *, question: str | None, pictures: list[Any],
                   media: str, source: str = "the request", notes: list[str] | None = None,
                   folder: str = "the checkpoint") -> PromptInputs:
    """One prompt laid out by a loaded checkpoint processor (`load_processor`): `question` with
    `pictures` (PIL images: the images of an image prompt, in order, or the frames of one video) placed
    by the chat template, or where the question holds the family's placeholders already. Every mistake
    is one FicocoError line; `source` names the input in it. The layout (image size, frames) is that
    of a prompt of one image or one video; a prompt of several images has none (`image_size` None)."""
    family = config.get("model_type", "")
    form: PromptFormat = family_module(family).PROMPT
    notes = list(notes or [])
    tokenizer = processor.tokenizer
    placeholder_id = (_token_id(config, "video_token_id", "video_token_index") if media == "video"
                      else _token_id(config, "image_token_id", "image_token_index"))
    placeholder = tokenizer.convert_ids_to_tokens(placeholder_id) if placeholder_id is not None else None
    if not isinstance(placeholder, str):
        raise FicocoError(f"weights={folder}: the tokenizer has no token for the config's {media} placeholder id "
                          f"{placeholder_id}; is it this checkpoint's tokenizer?")
    items = 1 if media == "video" else len(pictures)
    question = question if question is not None and question.strip() else DEFAULT_QUESTION[media]
    # A question that holds placeholders places the media itself; otherwise the template puts it first.
    content = [{"type": "text", "text": question}] if placeholder in question else \
        [*([{"type": media}] * items), {"type": "text", "text": question}]
    if processor.chat_template:
        try:
            text = tokenizer.apply_chat_template([{"role": "user", "content": content}],
                                                 chat_template=processor.chat_template, tokenize=False,
                                                 add_generation_prompt=True)
        except Exception as exc:  # noqa: BLE001 - jinja errors of the checkpoint's template
            raise FicocoError(f"weights={folder}: its chat template fails on this prompt ({_first_line(exc)})") \
                from None
    else:
        text = question if placeholder in question else \
            form.template.format(media=media, question=question).replace(placeholder, placeholder * items, 1)
        notes.append(f"note: {folder} has no chat template; the prompt follows the {family} format: {text!r}")
    count = text.count(placeholder)
    if count != items:
        given = "one" if items == 1 else str(items)
        raise FicocoError(f"the prompt holds {count} {placeholder} placeholders but {given} {media}"
                          f"{'' if items == 1 else 's'} {'is' if items == 1 else 'are'} given; use one {placeholder} "
                          f"per {media} in the prompt, or none")
    encoded = _encode(processor, form, family, media, text, pictures, placeholder, config, source)
    ids = encoded["input_ids"]
    visual = int((ids == placeholder_id).sum())
    image_size: tuple[int, int] | None = None
    if form.image_size is not None and media == "image" and items == 1:
        image_size, note = form.image_size(encoded, config, pictures[0], visual)
        notes.extend([note] if note else [])
    frame_count = int(encoded["pixel_values_videos"].shape[1]) if media == "video" else None
    return PromptInputs(encoded=encoded, family=family, media=media, visual_tokens=visual,
                        text_tokens=int(ids.shape[1]) - visual, image_size=image_size, frames=frame_count,
                        text=text, tokenizer=tokenizer, notes=notes)


def _encode(processor: _Processor, form: PromptFormat, family: str, media: str, text: str, pictures: list[Any],
            placeholder: str, config: dict[str, Any], given: str) -> dict[str, Tensor]:
    """The processor's encoding of `text` with `pictures`: the whole processor where transformers
    built it, else the pieces with the processor's placeholder rule."""
    try:
        if processor.whole is not None:
            key = "videos" if media == "video" else "images"
            encoded = dict(processor.whole(text=[text], **{key: [pictures] if media == "video" else pictures},
                                           return_tensors="pt"))
        elif form.encode_pieces is not None:
            encoded = form.encode_pieces(processor, media, text, pictures, placeholder, config)
        else:
            raise FicocoError(f"the checkpoint's {family} processor could not be built by transformers here; "
                              "check its processor files")
    except FicocoError:
        raise
    except Exception as exc:  # noqa: BLE001 - processors raise ValueError, TypeError, ...
        raise FicocoError(f"--{media} {given}: the checkpoint's processor rejects it ({_first_line(exc)})") from None
    if "input_ids" not in encoded:
        raise FicocoError(f"--{media} {given}: the checkpoint's processor returned no input_ids")
    return {name: value for name, value in encoded.items() if isinstance(value, Tensor)}
