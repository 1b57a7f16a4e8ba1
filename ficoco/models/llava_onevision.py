"""FiCoCo inside Hugging Face's LLaVA-OneVision (`LlavaOnevisionForConditionalGeneration`): a SigLIP
tower (no [CLS]; the projector reads the last layer's every patch, `vision_feature_select_strategy`
"full"), a Qwen2 decoder, AnyRes images as LLaVA-NeXT packs them, and videos. This file alone knows
what OneVision does differently from LLaVA-NeXT (ficoco.models.llava_next, whose adapter it extends):

- The packed crop grid of an image has a budget, `vision_aspect_ratio` "anyres_max_N": when the
  unpadded grid holds more than 1.1^2 x N crops' worth of patches, transformers resizes it bilinearly
  to (rows // ratio, cols // ratio) before the newline tokens are appended. The layout
  (`OnevisionLayout`) follows the model's own arithmetic, so the span FiCoCo-L reduces is exact; a
  method that cuts every item before the LLM is refused on such an image (the resize needs the whole
  grid), as LLaVA-NeXT refuses images whose unpadding drops patches.
- In a sample of several images (`batch_num_images` > 1) every image is its base view alone (one
  item, one newline), as transformers packs them.
- A video: every frame through the tower, projected, pooled 2x2 (bilinear, `ceil(side / 2)` per
  axis), the frames' tokens in a row and one `image_newline` after the whole video. FiCoCo-L and the
  methods inside the decoder reduce the video span (its newline protected, as LLaVA-NeXT's); a method
  that cuts frames before the LLM is refused (the pooling needs every patch of the frame), except one
  that cuts after the pooling (`MethodSpec.pooled_grid`: HoliTom, where its official code acts on
  OneVision), which reads a video's frames together, with the attention each patch receives pooled alike.
- SigLIP has no [CLS]: FiCoCo-V scores with FiCoCo's equivalent token (docs/methods/ficoco.md), and the methods
  that rank by the [CLS] attention use it too (their registry `cls_note`).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from ficoco.accounting.families.llava_onevision import anyres_max_patches
from ficoco.errors import FicocoError
from ficoco.methods.anyres.ops import ImageLayout, OnevisionLayout, anyres_layout
from ficoco.methods.inputs import ImageGrids, TokenGrid
from ficoco.models import hf_compat as hf
from ficoco.models.inputs import place_inputs
from ficoco.models.llava_next import LlavaNextAdapter
from ficoco.models.patching import Patches, span_lengths
from ficoco.models.prompt import PromptFormat, anyres_image_size

if TYPE_CHECKING:
    from ficoco.models.handle import Handle

__all__ = ["PREFIX_TOKENS", "LlavaOnevisionAdapter", "OnevisionLayout", "image_layout", "synthetic_inputs",
           "video_tokens"]

# "<|im_start|>user\n" before the image span, as Qwen2's template tokenises it.
PREFIX_TOKENS = 3


def image_layout(config: Any, size_hw: Any, patched: bool = True) -> OnevisionLayout:
    """The layout of one image of `size_hw` (H, W): transformers' AnyRes grid choice, its unpadding
    and its anyres_max_N downscale; `patched` False: the base view alone (an image of a sample with
    several, `batch_num_images` > 1)."""
    size = [int(v) for v in (size_hw.tolist() if isinstance(size_hw, Tensor) else size_hw)]
    if len(size) != 2 or min(size) < 1:
        raise FicocoError(f"image size {size_hw} is not (height, width) in pixels")
    vision = config.vision_config
    side = vision.image_size // vision.patch_size
    grid = hf.onevision_anyres_grid(size, config.image_grid_pinpoints, vision.image_size) if patched else None
    budget = anyres_max_patches(getattr(config, "vision_aspect_ratio", "anyres_max_9"))
    layout = anyres_layout(side, grid, size, budget)
    assert isinstance(layout, OnevisionLayout)
    return layout


def video_tokens(config: Any, frames: int) -> int:
    """Visual tokens of a video of `frames` frames: every frame pooled 2x2, one newline after them."""
    side = config.vision_config.image_size // config.vision_config.patch_size
    return frames * math.ceil(side / 2) ** 2 + 1


class LlavaOnevisionAdapter(LlavaNextAdapter):
    """Where the method goes in a LLaVA-OneVision model: LLaVA-NeXT's AnyRes bookkeeping with the
    anyres_max_N downscale, a tower without [CLS], and video spans."""

    tower_has_cls = False
    pixel_inputs = ("pixel_values", "pixel_values_videos")
    encoder_inputs = (("pixel_values", "image", hf.IMAGE_ENCODER),)

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        config = model.config
        self.video_token_id = getattr(config, "video_token_id", None)
        self.batch_num_images: Tensor | None = None  # the current call's batch_num_images (see call_scope)
        self.video_frames: list[int] = []  # the current call's frames per video, in order

    def layout(self, size_hw: Any, patched: bool = True) -> OnevisionLayout:
        key = (*(int(v) for v in (size_hw.tolist() if isinstance(size_hw, Tensor) else size_hw)), patched)
        if key not in self._layouts:
            self._layouts[key] = image_layout(self.model.config, key[:2], patched)
        return self._layouts[key]  # type: ignore[return-value]

    def _patched_flags(self, images: int) -> list[bool]:
        """Per image of the call, whether transformers cuts it into AnyRes crops (not in a sample of several)."""
        if self.batch_num_images is None:
            return [True] * images
        flags = [int(n) == 1 for n in self.batch_num_images.tolist() for _ in range(int(n))]
        if len(flags) != images:
            raise FicocoError(f"batch_num_images {self.batch_num_images.tolist()} counts {len(flags)} images, but "
                              f"image_sizes gives {images}")
        return flags

    def _layouts_of_call(self, what: str) -> list[ImageLayout]:
        if self.image_sizes is None:
            raise FicocoError(f"{what} on LLaVA-OneVision needs the images' image_sizes in the same forward or "
                              "generate call as the image placeholders")
        flags = self._patched_flags(len(self.image_sizes))
        return [self.layout(size, patched) for size, patched in zip(self.image_sizes, flags, strict=True)]

    # -- the span FiCoCo-L and the decoder methods reduce: images and videos ----------------------------
    def language_tokens(self, input_ids: Tensor) -> Tensor:
        """(B, T) bool: the image and video placeholders (every visual span of the prompt)."""
        visual = input_ids == self.image_token_id
        if self.video_token_id is not None:
            visual = visual | (input_ids == self.video_token_id)
        return visual

    def language_state(self, input_ids: Tensor, attention_mask: Tensor | None, past_length: int = 0,
                       prior_positions: dict[int, Tensor] | None = None) -> Any:
        """LLaVA-NeXT's state for the images; a video span's last token (its newline) is protected too.
        One prompt holds images or videos, not both (the spans' order would be the template's)."""
        is_video = input_ids == self.video_token_id if self.video_token_id is not None else None
        if is_video is None or not bool(is_video.any()):
            return super().language_state(input_ids, attention_mask, past_length, prior_positions)
        if bool((input_ids == self.image_token_id).any()):
            raise FicocoError("FiCoCo-L on LLaVA-OneVision reduces the images or the video of a prompt, not both "
                              "in one prompt; give them in separate turns")
        state = super(LlavaNextAdapter, self).language_state(input_ids, attention_mask, past_length, prior_positions)
        if state is None:
            return None
        # The newline ends every run of video placeholders (the token after it is text).
        following = torch.nn.functional.pad(is_video[:, 1:], (0, 1), value=False)
        newline = is_video & ~following
        state.protected = torch.gather(newline, 1, state.visual_rows)
        state.max_protected = int(state.protected.sum(dim=1).max())
        return state

    def image_grids(self, title: str, input_ids: Tensor) -> tuple[tuple[ImageGrids, ...], ...]:
        """LLaVA-NeXT's grids for the images (a downscaled crop grid as packed); a video's span: every frame's
        pooled grid, then its one newline (on no grid). One prompt holds images or videos, not both."""
        is_video = input_ids == self.video_token_id if self.video_token_id is not None else None
        if is_video is None or not bool(is_video.any()):
            return super().image_grids(title, input_ids)
        if bool((input_ids == self.image_token_id).any()):
            raise FicocoError(f"{title} on LLaVA-OneVision reads the images or the video of a prompt, not both in "
                              "one prompt; give them in separate turns")
        side = math.ceil(self.grid_hw[0] / 2), math.ceil(self.grid_hw[1] / 2)
        per_frame = side[0] * side[1]
        found = []
        for lengths in span_lengths(is_video):
            videos, start = [], 0
            for length in lengths:
                if (length - 1) % per_frame:
                    raise FicocoError(f"{title}: a video span of {length} placeholders is not frames x {per_frame} "
                                      "+ 1 (give the prompt as the processor lays it out)")
                grids = tuple(TokenGrid(start + offset, side[0], side[1], side[1])
                              for offset in range(0, length - 1, per_frame))
                videos.append(ImageGrids(start, length, grids, self.patch_grid_hw))
                start += length
            found.append(tuple(videos))
        return tuple(found)

    # -- methods that cut before the LLM ---------------------------------------------------------------
    def patch_tower(self, handle: Handle, patches: Patches, spec: Any, schedule: Any) -> None:
        """LLaVA-NeXT's per-crop hook points (ficoco.models.vision_steps.TowerPatch) on a tower without
        [CLS] (`tower_has_cls`: the methods score with the equivalent token), and OneVision's packing
        in place of `pack_image_features` while the method runs. Videos are refused (each frame is
        pooled 2x2 after the projector, which needs its whole grid), except for a method that cuts the
        pooled frames (`pooled_grid`): its cut runs after the pooling (`_patch_video_cut`)."""
        from ficoco.models.vision_steps import TowerPatch

        config = self.model.config
        if getattr(config, "vision_feature_select_strategy", "full") != "full" or \
                not isinstance(getattr(config, "vision_feature_layer", -1), int):
            raise FicocoError(f"{spec.title} on LLaVA-OneVision needs vision_feature_select_strategy='full' and one "
                              "vision_feature_layer (SigLIP has no [CLS])")
        tower = TowerPatch(self, handle, spec, schedule)
        tower.install(patches)
        removals = self._pack_reduced_items(handle, patches, spec, schedule)
        self.pooled_cut = bool(getattr(spec, "pooled_grid", False))
        if self.pooled_cut:
            self._patch_video_cut(tower, removals, patches)

    # -- a cut on a video's pooled frames (HoliTom, where its official code acts on OneVision) ----------
    pooled_cut = False  # whether the method cuts a video's frames after their 2x2 pooling
    cut_after_pooling = False  # True while a video is encoded: the projector leaves the cut to the pooling
    frames_in_call: int | None = None  # frames per video of the call being encoded (TowerInput.frames)

    def _patch_video_cut(self, tower: Any, removals: list[Any], patches: Patches) -> None:
        """The video encoder marks its call (the frames the method reads together) and the pooling runs the
        cut that the projector left (`TowerPatch.cut_pooled`), on every frame's pooled grid."""
        pooled_side = math.ceil(self.grid_hw[0] / 2), math.ceil(self.grid_hw[1] / 2)
        self.pooled_per_frame = pooled_side[0] * pooled_side[1]
        self.video_keep_per_frame = self.pooled_per_frame - sum(r.remove - r.added for r in removals
                                                                if r.where == "after_projector")
        inner = hf.inner_model(self.model)
        encode_video, pooling = getattr(inner, hf.VIDEO_ENCODER), getattr(inner, hf.ONEVISION_POOLING)

        def encode(pixel_values_videos: Tensor, *args: Any, **kwargs: Any) -> Any:
            previous = self.frames_in_call, self.cut_after_pooling
            self.frames_in_call, self.cut_after_pooling = int(pixel_values_videos.shape[1]), True
            try:
                return encode_video(pixel_values_videos, *args, **kwargs)
            finally:
                self.frames_in_call, self.cut_after_pooling = previous

        def apply_pooling(image_features: Tensor) -> Tensor:
            return tower.cut_pooled(pooling(image_features), pooling)

        patches.set(inner, hf.VIDEO_ENCODER, encode)
        patches.set(inner, hf.ONEVISION_POOLING, apply_pooling)

    def _video_kept_index(self, input_ids: Tensor, is_video: Tensor) -> Tensor:
        """The positions a video prompt keeps when the method cuts its pooled frames: the first
        `frames x keep + 1` placeholders of every video span (its tokens, then its newline), the frames
        read from the span's length. One host synchronisation (the span lengths)."""
        pooled, keep = self.pooled_per_frame, self.video_keep_per_frame
        limits = []
        for row in span_lengths(is_video):
            if any((length - 1) % pooled for length in row):
                raise FicocoError(f"video spans of {row} placeholders are not frames x {pooled} + 1 (give the prompt "
                                  f"as the processor lays it out; {self.method_title} cannot continue a "
                                  "conversation whose cache holds a shortened video)")
            limits.append([(length - 1) // pooled * keep + 1 for length in row])
        most = max(len(row) for row in limits)
        limit = torch.tensor([row + [0] * (most - len(row)) for row in limits], device=input_ids.device)
        positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        starts = is_video & ~torch.nn.functional.pad(is_video[:, :-1], (1, 0), value=False)
        span = (torch.cumsum(starts.long(), dim=1) - 1).clamp(min=0)
        rank = positions - torch.where(starts, positions, 0).cummax(dim=1).values
        drop = is_video & (rank >= torch.gather(limit, 1, span.clamp(max=most - 1)))
        lengths = (~drop).sum(dim=1).tolist()
        if len(set(lengths)) != 1:
            raise FicocoError(f"every sample of a batch must hold videos of the same frame count for "
                              f"{self.method_title}")
        # A stable sort of the drop flags lists the kept positions first, in order.
        return torch.sort(drop.to(torch.int8), dim=1, stable=True).indices[:, :lengths[0]]

    def _packing(self, original: Callable[..., Any], kept_grid_of: Callable[[], Tensor | None]
                 ) -> Callable[..., tuple[list[Tensor], Tensor]]:
        """A stand-in for OneVision's `pack_image_features(image_features, image_sizes, image_newline,
        vision_aspect_ratio)` that packs reduced items by place (`ImageLayout.pack`); unreduced items go to
        `original`, except under torch.jit tracing (its unpadding rounds traced sizes)."""

        def pack_image_features(image_features: Any, image_sizes: Tensor, image_newline: Tensor | None = None,
                                vision_aspect_ratio: str = "anyres_max_9") -> tuple[list[Tensor], Tensor]:
            kept_grid = kept_grid_of()
            items = sum(int(f.shape[0]) for f in image_features)
            if kept_grid is None:
                if not torch.jit.is_tracing():
                    return original(image_features, image_sizes, image_newline=image_newline,
                                    vision_aspect_ratio=vision_aspect_ratio)
                kept_grid = torch.arange(self.patches, device=image_features[0].device).expand(items, -1)
            if tuple(kept_grid.shape) != (items, image_features[0].shape[1]):
                raise RuntimeError(f"the method kept {tuple(kept_grid.shape)} tokens for {items} items of "
                                   f"{image_features[0].shape[1]} features")
            if self.grid_cut is not None:  # every image cut whole (G-Prune's parts)
                layouts = [self.layout(size, patched=features.shape[0] > 1)
                           for features, size in zip(image_features, image_sizes, strict=True)]
                packed = self._cut_whole_images(image_features, layouts, image_newline)
                lengths = torch.tensor([p.shape[0] for p in packed], dtype=torch.long, device=packed[0].device)
                return packed, lengths
            packed, start = [], 0
            for features, size in zip(image_features, image_sizes, strict=True):
                grid = kept_grid[start:start + features.shape[0]]
                start += features.shape[0]
                packed.append(self.layout(size, patched=features.shape[0] > 1).pack(features, grid, image_newline))
            lengths = torch.tensor([p.shape[0] for p in packed], dtype=torch.long, device=packed[0].device)
            return packed, lengths

        return pack_image_features

    def patch_for_tracing(self, patches: Patches) -> None:
        """Let torch.jit trace the forward: the unpadding's rounded sizes become layout packing, except
        where the grid is downscaled (then transformers' own packing runs; fvcore counts no resize)."""
        inner, packing = hf.inner_model(self.model), hf.PACK_FEATURES
        if packing not in inner.__dict__:
            original = getattr(inner, packing)
            stand_in = self._packing(original, lambda: None)

            def pack_image_features(image_features: Any, image_sizes: Tensor, image_newline: Tensor | None = None,
                                    vision_aspect_ratio: str = "anyres_max_9") -> tuple[list[Tensor], Tensor]:
                if not torch.jit.is_tracing():
                    return original(image_features, image_sizes, image_newline=image_newline,
                                    vision_aspect_ratio=vision_aspect_ratio)
                packed = []
                for features, size in zip(image_features, image_sizes, strict=True):
                    layout = self.layout(size, patched=features.shape[0] > 1)
                    packed.append(layout.pack_resized(features, image_newline) if layout.downscaled else
                                  stand_in([features], size[None], image_newline, vision_aspect_ratio)[0][0])
                lengths = torch.tensor([p.shape[0] for p in packed], dtype=torch.long, device=packed[0].device)
                return packed, lengths

            patches.set(inner, packing, pack_image_features)

    def kept_token_index(self, input_ids: Tensor, keep: int | None) -> Tensor | None:
        """LLaVA-NeXT's shortened prompt; a prompt with a video is refused for a method that cuts before
        the LLM (each frame is pooled 2x2 after the projector, which needs its whole grid), except for one
        that cuts the pooled frames (HoliTom), which shortens video spans and refuses images."""
        if self.pooled_cut:
            if bool((input_ids == self.image_token_id).any()):
                raise FicocoError(f"{self.method_title} on LLaVA-OneVision acts on a video's pooled frames; an image "
                                  "is one frame: give the images to a method that reduces images")
            is_video = input_ids == self.video_token_id
            return self._video_kept_index(input_ids, is_video) if bool(is_video.any()) else None
        if self.video_token_id is not None and bool((input_ids == self.video_token_id).any()):
            raise FicocoError(f"{self.method_title} on a LLaVA-OneVision video: every frame is pooled 2x2 "
                              "(bilinear) after the projector, which needs its whole grid; use a method inside "
                              "the LLM (FiCoCo-L)")
        return super().kept_token_index(input_ids, keep)

    def earlier_span_layout(self, tokens: int) -> ImageLayout:
        """LLaVA-NeXT's reading of an earlier turn's span, among the pinpoint grids that a method cutting
        before the LLM serves (neither unpadded nor downscaled)."""
        assert self.kept_per_item is not None
        candidates = {}
        for height, width in self.model.config.image_grid_pinpoints:
            layout = self.layout((height, width))
            if layout.tokens == tokens and not layout.unpadding_drops and not layout.downscaled:
                candidates[layout.reduced_tokens(self.kept_per_item, self.unplaced_per_item)] = layout
        if len(candidates) != 1:
            what = "no AnyRes grid" if not candidates else "several AnyRes grids"
            raise FicocoError(f"an earlier turn's image span of {tokens} placeholders matches {what} of this model, "
                              f"so {self.method_title} cannot tell how many the cache holds; run the conversation in "
                              "one prompt")
        return next(iter(candidates.values()))

    # -- the top-level model ---------------------------------------------------------------------------
    @contextlib.contextmanager
    def call_scope(self, call: dict[str, Any], *, generating: bool) -> Iterator[None]:
        """LLaVA-NeXT's scope, inside one that keeps the call's batch_num_images (a sample of several images
        packs each as its base view alone)."""
        counts = call.get("batch_num_images")
        with super().call_scope(call, generating=generating):
            if counts is None:
                yield
                return
            previous, self.batch_num_images = self.batch_num_images, torch.as_tensor(counts).reshape(-1).cpu()
            try:
                yield
            finally:
                self.batch_num_images = previous


def synthetic_inputs(model: nn.Module, *, batch: int = 1, text_tokens: int = 60, seed: int = 0,
                     dtype: torch.dtype | None = None, device: torch.device | str | None = None,
                     image_size: tuple[int, int] | None = None, frames: int | None = None) -> dict[str, Tensor]:
    """`batch` prompts "<|im_start|>user\\n<image>\\n...": input_ids, attention_mask, pixel_values (B, items,
    3, crop, crop) and image_sizes for one image of `image_size` (H, W; the profile's default otherwise),
    laid out as the OneVision processor lays them out; with `frames` (or a profile whose layout is a
    video) one video of that many frames instead: pixel_values_videos (B, frames, 3, crop, crop)."""
    config = model.config
    if config.model_type != "llava_onevision":
        raise FicocoError(f"these synthetic inputs are laid out for LLaVA-OneVision only, not '{config.model_type}'")
    if text_tokens <= PREFIX_TOKENS:
        raise FicocoError(f"text_tokens= must exceed the {PREFIX_TOKENS} template tokens before the image")
    defaults = getattr(model, "_ficoco_defaults", None) or {}
    if frames is None and image_size is None:
        frames = defaults.get("frames")
    vision = config.vision_config
    special = [t for t in (config.image_token_id, getattr(config, "video_token_id", None)) if t is not None]
    # Ordinary text ids: below the special tokens the vocabulary appends.
    text_vocab = min(config.text_config.vocab_size, *special) - 3
    generator = torch.Generator().manual_seed(seed)
    text = torch.randint(3, 3 + text_vocab, (batch, text_tokens), generator=generator)
    if frames is not None:
        if frames < 1:
            raise FicocoError(f"frames={frames} must be at least 1")
        span = torch.full((batch, video_tokens(config, frames)), config.video_token_id, dtype=torch.long)
        input_ids = torch.cat([text[:, :PREFIX_TOKENS], span, text[:, PREFIX_TOKENS:]], dim=1)
        pixels = torch.randn(batch, frames, vision.num_channels, vision.image_size, vision.image_size,
                             generator=generator)
        return place_inputs(model, input_ids, "pixel_values_videos", pixels, dtype=dtype, device=device)
    if image_size is None:
        default = defaults.get("image_size")
        image_size = tuple(default) if default else (2 * vision.image_size, 2 * vision.image_size)
    height, width = (int(v) for v in image_size)
    layout = image_layout(config, (height, width))
    span = torch.full((batch, layout.tokens), config.image_token_id, dtype=torch.long)
    input_ids = torch.cat([text[:, :PREFIX_TOKENS], span, text[:, PREFIX_TOKENS:]], dim=1)
    pixels = torch.randn(batch, layout.items, vision.num_channels, vision.image_size, vision.image_size,
                         generator=generator)
    return place_inputs(model, input_ids, "pixel_values", pixels, dtype=dtype, device=device,
                        image_sizes=torch.tensor([[height, width]] * batch, dtype=torch.long))


ONEVISION_TEMPLATE = "<|im_start|>user\n<{media}>\n{question}<|im_end|>\n<|im_start|>assistant\n"


def _video_pieces(processor: Any, text: str, pictures: list[Any], placeholder: str,
                     vision: dict[str, Any]) -> dict[str, Tensor]:
    """A LLaVA-OneVision video as its video processor lays it out (which transformers builds only with
    torchvision): every frame resized to the tower's square (bicubic), rescaled and normalised with the
    checkpoint's image mean and std (one SigLIP normalisation for images and videos); the
    placeholders frames x ceil(side / 2)^2 + 1 (the 2x2 pooling and the newline)."""
    import numpy as np
    from PIL import Image

    size = int(vision.get("image_size", 384))
    side = size // int(vision.get("patch_size", 14))
    mean = tuple(getattr(processor.image_processor, "image_mean", None) or (0.48145466, 0.4578275, 0.40821073))
    std = tuple(getattr(processor.image_processor, "image_std", None) or (0.26862954, 0.26130258, 0.27577711))
    frames = []
    for picture in pictures:
        array = np.asarray(picture.resize((size, size), Image.BICUBIC), dtype=np.float32) / 255.0
        frames.append(torch.from_numpy((array - np.asarray(mean, np.float32)) / np.asarray(std, np.float32))
                      .permute(2, 0, 1))
    count = len(frames) * (-(-side // 2)) ** 2 + 1
    ids = processor.tokenizer([text.replace(placeholder, placeholder * count)], return_tensors="pt")
    return {**ids, "pixel_values_videos": torch.stack(frames)[None]}


def encode_pieces(processor: Any, media: str, text: str, pictures: list[Any], placeholder: str,
                  config: dict[str, Any]) -> dict[str, Tensor]:
    """A prompt from the processor's pieces: transformers builds LlavaOnevisionProcessor only with its
    video processor (torchvision). An image: the image processor's crops and sizes, and the placeholder
    count by the processor's own rule; a video: `_video_pieces`."""
    vision = config.get("vision_config") or {}
    if media == "video":
        return _video_pieces(processor, text, pictures, placeholder, vision)
    from ficoco.accounting.families.llava_onevision import onevision_image_tokens

    pixels = processor.image_processor(images=pictures, return_tensors="pt")
    sizes = pixels["image_sizes"]
    count = onevision_image_tokens(config, (int(sizes[0][0]), int(sizes[0][1])))
    ids = processor.tokenizer([text.replace(placeholder, placeholder * count)], return_tensors="pt")
    return {**ids, "pixel_values": pixels["pixel_values"], "image_sizes": sizes}


PROMPT = PromptFormat(media=("image", "video"), template=ONEVISION_TEMPLATE, encode_pieces=encode_pieces,
                      image_size=anyres_image_size)
