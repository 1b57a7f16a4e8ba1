"""FiCoCo inside Hugging Face's Video-LLaVA (`VideoLlavaForConditionalGeneration`).

Video-LLaVA is LLaVA-1.5 built twice over: an image tower and a video tower (both CLIP
ViT-L/14 at 224 px, 16 x 16 patches + [CLS]), one projector and a LLaMA decoder. A video's
frames go through the video tower as batch items, and transformers keeps each frame's
[CLS] in the video features, so a video fills `frames x (1 + patches)` placeholders
(`video_token_index`): 8 x 257 = 2056 for Video-LLaVA-7B.

Everything but that bookkeeping is LLaVA's (`LlavaAdapter`): the same CLIP layers are
re-composed for FiCoCo-V, now in the video tower, where frames are batch items and [CLS] stays
at position 0 of each; the same decoder wrapping does FiCoCo-L, over the whole video span.
What differs is set here: the tower, the placeholder, the inputs that carry pixels, and the
span unit of FiCoCo-V's shortened prompt (a frame: [CLS] + the patches the tower kept).

Images (`pixel_values`) go through the image tower, which FiCoCo leaves alone: a
video-only prompt runs only the video tower, and that is the tower the stages count.

Records: for V one row per frame, sample-major (row `b * frames + f`), holding grid indices
0..patches-1 of that frame; for L one row per sample, holding offsets inside the whole video
span (0..2055 for 8 frames).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from ficoco.errors import FicocoError
from ficoco.models import hf_compat as hf
from ficoco.models.inputs import place_inputs
from ficoco.models.llava import LlavaAdapter
from ficoco.models.patching import Patches
from ficoco.models.prompt import PromptFormat
from ficoco.profiles import FAMILY_DEFAULTS

if TYPE_CHECKING:
    from ficoco.models.handle import Handle

# "<s> USER :" before the video, as the Video-LLaVA template ("USER: <video>\n... ASSISTANT:")
# tokenises it with the LLaMA tokenizer: the same prefix as LLaVA-1.5's.
PREFIX_TOKENS = 5


class VideoLlavaAdapter(LlavaAdapter):
    """Where the method goes in a Video-LLaVA model: the video tower and the video span."""

    tower_attribute = "video_tower"
    placeholder_config_keys = ("video_token_id", "video_token_index")
    # Any visual input starts a new forward (records and state of the previous one are dropped);
    # images run the untouched image tower, so their forward records nothing.
    pixel_inputs = ("pixel_values_videos", "pixel_values", "pixel_values_images")
    # Vision-side methods: the video features keep each frame's [CLS] before the projector, and
    # an adaptive count is measured by encoding the video first.
    projector_keeps_cls = True
    encoder_inputs = (("pixel_values_videos", "video", hf.VIDEO_ENCODER),)

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        if self.image_token_id is None:
            raise FicocoError(f"{type(model).__name__}'s config has no video_token_index")
        # A frame fills 1 + patches placeholders: transformers keeps its [CLS].
        self.span_tokens = self.patches + 1
        config = model.config
        self.still_image_token_id = getattr(config, "image_token_id", getattr(config, "image_token_index", None))

    # Frames per video of the call being encoded (its pixel_values_videos), for a method that reads a
    # video's frames together (HoliTom); the tower sees them as batch items, sample-major.
    frames_in_call: int | None = None

    def patch_tower(self, handle: Handle, patches: Patches, spec: Any, schedule: Any) -> None:
        """LLaVA's hook points, and the frame count of every video call kept for the cut."""
        super().patch_tower(handle, patches, spec, schedule)
        inner = hf.inner_model(self.model)
        original = getattr(inner, hf.VIDEO_ENCODER)

        def encode(pixel_values_videos: Tensor, *args: Any, **kwargs: Any) -> Any:
            self.frames_in_call = int(pixel_values_videos.shape[1])
            return original(pixel_values_videos, *args, **kwargs)

        patches.set(inner, hf.VIDEO_ENCODER, encode)

    def unreduced_visual(self, input_ids: Tensor) -> Tensor:
        """Image placeholders beside a video: FiCoCo leaves images alone (their tower is not the
        one the accountant plans), and FiCoCo-L does not count them as text either."""
        if self.still_image_token_id is None:
            return torch.zeros_like(input_ids, dtype=torch.bool)
        return input_ids == self.still_image_token_id

    def entry_keep(self, handle: Handle, spec: Any, keep_per_image: int | None) -> int | None:
        """A method acting before the LLM (FiCoCo-V, ToMe, VisionZip, ...) shortens the video span frame by
        frame: the accountant's count per video is frames x (1 + kept patches) for the profile's frame
        count; per frame, every frame's [CLS] and kept patches stay whatever the number of frames the
        input holds. An adaptive count (None) is measured per frame when the video is encoded."""
        if not spec.per_item or keep_per_image is None:
            return None
        # [CLS] and the patches every frame keeps (merged tokens a method adds count too).
        change = sum(r.added - r.remove for r in handle.schedule.removals if r.stage == "vision")
        return 1 + self.patches + change


def frames_of(model: nn.Module) -> int:
    """Frames per video the model was built for (its profile's `frames`, else the family's)."""
    defaults = {**FAMILY_DEFAULTS["video_llava"], **(getattr(model, "_ficoco_defaults", None) or {})}
    return int(defaults["frames"])


def synthetic_inputs(model: nn.Module, *, batch: int = 1, text_tokens: int = 60, seed: int = 0,
                     dtype: torch.dtype | None = None, device: torch.device | str | None = None,
                     frames: int | None = None) -> dict[str, Tensor]:
    """input_ids, attention_mask and pixel_values_videos for `batch` prompts of one video each.

    Laid out like "USER: <video>\\n{question} ASSISTANT:": `PREFIX_TOKENS` text tokens, the
    video span (frames x (1 + patches) placeholders), then the rest of the text. Token ids are
    random (seeded) text ids; pixels are (batch, frames, 3, size, size) random values.
    """
    config = model.config
    if config.model_type != "video_llava":
        raise FicocoError(f"these synthetic inputs are laid out for Video-LLaVA only, not '{config.model_type}'")
    if text_tokens <= PREFIX_TOKENS:
        raise FicocoError(f"text_tokens= must exceed the {PREFIX_TOKENS} template tokens before the video")
    frames = frames_of(model) if frames is None else frames
    if frames < 1:
        raise FicocoError(f"frames={frames} must be at least 1")
    vision = config.vision_config
    per_frame = (vision.image_size // vision.patch_size) ** 2 + 1  # patches + [CLS]
    video_token = config.video_token_id
    vocab = config.text_config.vocab_size
    # Ordinary text ids: below the special tokens the vocabulary appends (<image>, <video>).
    special = [t for t in (config.image_token_id, video_token) if t is not None]
    text_vocab = min(vocab, *special) - 3
    generator = torch.Generator().manual_seed(seed)
    text = torch.randint(3, 3 + text_vocab, (batch, text_tokens), generator=generator)
    text[:, 0] = 1  # BOS
    video = torch.full((batch, frames * per_frame), video_token, dtype=torch.long)
    input_ids = torch.cat([text[:, :PREFIX_TOKENS], video, text[:, PREFIX_TOKENS:]], dim=1)
    pixels = torch.randn(batch, frames, vision.num_channels, vision.image_size, vision.image_size,
                         generator=generator)
    return place_inputs(model, input_ids, "pixel_values_videos", pixels, dtype=dtype, device=device)


def encode_pieces(processor: Any, media: str, text: str, pictures: list[Any], placeholder: str,
                  config: dict[str, Any]) -> dict[str, Tensor]:
    """A video prompt from the processor's pieces (its video processor needs torchvision): every frame
    through the image processor, frames x (patches + [CLS]) placeholders (Video-LLaVA keeps each frame's
    [CLS])."""
    vision = config.get("vision_config") or {}
    out = processor.image_processor(images=pictures, return_tensors="pt")
    frames = out.get("pixel_values_images", out.get("pixel_values"))
    frames = torch.stack(list(frames)) if isinstance(frames, list) else frames
    patch = int(vision.get("patch_size", 14))
    per_frame = (frames.shape[-2] // patch) * (frames.shape[-1] // patch) + 1
    ids = processor.tokenizer([text.replace(placeholder, placeholder * (per_frame * frames.shape[0]))],
                              return_tensors="pt")
    return {**ids, "pixel_values_videos": frames.unsqueeze(0)}


PROMPT = PromptFormat(media=("video",), encode_pieces=encode_pieces)
