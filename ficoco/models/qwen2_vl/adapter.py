"""The Qwen2-VL adapter: where the method goes in `Qwen2VLForConditionalGeneration`, composed of its
parts (ficoco.models.qwen2_vl: the tower's order, the tower blocks, the cuts, the prompt shortening).
The adapter finds the model's modules, picks the part a method's hook point needs, and answers the
entry wrapper's hooks (ficoco.models.entry); FiCoCo-L and the other methods in the decoder are the base
adapter's (`FamilyAdapter`).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from torch import Tensor, nn

from ficoco.errors import FicocoError
from ficoco.methods.contract import GroupsModule, TowerModule
from ficoco.methods.inputs import ImageGrids, TokenGrid
from ficoco.methods.pixelprune import CLIP_NORMALISATION
from ficoco.methods.pixelprune.ops import group_pixels
from ficoco.models import hf_compat as hf
from ficoco.models.base import FamilyAdapter
from ficoco.models.entry import follow_shortened_prompt
from ficoco.models.patching import Patches, span_lengths
from ficoco.models.qwen2_vl.cut import TowerCuts
from ficoco.models.qwen2_vl.order import GridOrder
from ficoco.models.qwen2_vl.prompt import PromptShortener
from ficoco.models.qwen2_vl.tower_pass import TowerBlocks, TowerPass

if TYPE_CHECKING:
    from ficoco.models.entry import Entry
    from ficoco.models.handle import Handle


class Qwen2VLAdapter(FamilyAdapter):
    """Where the method goes in a Qwen2-VL model; FiCoCo-L is the base adapter's, FiCoCo-V this class's."""

    # Videos start a new visual forward as well (FiCoCo-L leaves them unreduced).
    pixel_inputs = ("pixel_values", "pixel_values_videos")
    # PDrop's and SparseVLM's compaction renumbers 1-D positions; Qwen2-VL's rotary table is 3-D
    # (an image's tokens share their row/column positions and the text after it starts past the
    # grid, not past the token count), so a renumbered arange would throw the image grid away and
    # disagree with the decode steps' positions (cache length + rope_deltas). The kept tokens keep
    # their 3-D positions instead, as FastV's and DART's do; an added (recycled) token takes its
    # image span's last placeholder's.
    compacts_positions = False
    multimodal_rope = True
    # True under a method that cuts a video's temporal slices together after the merger (HoliTom): the
    # tower takes videos, the entry shortens video spans, and the LLM-side steps see video placeholders.
    video_cut = False
    # True under a method before the LLM that reduces a video's temporal slices as images (`MethodSpec.video_slices`:
    # the encoder runs them through the tower as images and joins them per video, `GridOrder.slice_items`); else
    # `video_refusal` says why a video is refused, in the words of the method (`method_title`).
    video_slices = False
    video_refusal = "a video's temporal slices are not its items"
    method_title = "FiCoCo-V"
    family_title = "Qwen2-VL"  # in the one-line refusals
    # The tower's token order (the window strategy): Qwen2-VL's grid order; Qwen2.5-VL names its window order,
    # and every part below runs on whichever the family names.
    order_strategy: type[GridOrder] = GridOrder
    # The processor's normalisation of the pixels, undone for a method that reads the image's [0, 1] pixels
    # (PixelPrune): OpenAI CLIP's mean and std on Qwen2-VL and Qwen2.5-VL.
    pixel_mean, pixel_std = CLIP_NORMALISATION

    def __init__(self, model: nn.Module) -> None:
        # The base adapter's attributes (the L code reads them), found where Qwen2-VL keeps them.
        self.model = model
        self.visual = hf.qwen2_vl_tower(model)
        self.vision_layers = hf.qwen2_vl_blocks(self.visual)
        self.decoder_layers = hf.decoder_layers(model)
        config = model.config
        self.image_token_id = config.image_token_id
        self.video_token_id = getattr(config, "video_token_id", None)
        self.merge_size = config.vision_config.spatial_merge_size
        self.merge = self.merge_size**2
        self.image_grid_thw: Tensor | None = None  # the current call's (see call_scope)
        # The current run of the tower under a method before the LLM (None outside one): the parts share it.
        self.tower_pass: TowerPass | None = None
        # FiCoCo-V: merge groups (placeholders) every image loses; None: each image its own count (PixelPrune)
        self.removed_per_image: int | None = 0
        # The pixels the caller gave the tower call in progress, before its cast to the tower's dtype (`run_tower`).
        self.caller_pixels: Tensor | None = None
        # FiCoCo-V: the rope_deltas of the prefill that filled each cache, for the next turn on it
        # (the model's own rope_deltas are the last prefill's, of whichever conversation).
        self.turn_deltas: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        # The parts the methods before the LLM run on: the tower's order first (the others ask it).
        self.order = self.order_strategy(self)
        self.blocks = TowerBlocks(self)
        self.cuts = TowerCuts(self)
        self.prompt = PromptShortener(self)

    def stage_modules(self) -> dict[str, nn.Module]:
        """The accountant's stages; the projector (PatchMerger) sits inside the vision tower."""
        model = self.model
        return {"vision": self.visual, "projector": hf.qwen2_vl_merger(self.visual), "llm": hf.language_model(model),
                "lm_head": hf.lm_head(model)}

    def patch_tower(self, handle: Handle, patches: Patches, spec: Any, schedule: Any) -> None:
        """The packed tower's hook points (cu_seqlens: every image one segment), on whole merge groups:
        inside a tower layer for a method whose module offers ``reduce_groups`` (FiCoCo-V); a cut at the
        tower's output (before the PatchMerger: VisionZip) or after it (FasterVLM) for one whose module
        offers ``tower_step``, scored by the equivalent token in place of [CLS]; a video method's cut on the
        merger's output of a video's temporal slices together (HoliTom, ``patch_video_cut``). Others: one line,
        in the family's name."""
        self.method_title, self.video_slices = spec.title, spec.video_slices
        self.video_refusal = ("each image keeps its own count, set by its content" if spec.budget_refusal
                              or spec.content_counts else "a video's temporal slices are not its items")
        patches.on_undo(lambda: setattr(self, "video_slices", False))
        try:
            self._install_tower(handle, patches, spec, schedule)
        except FicocoError as exc:
            if self.family_title == "Qwen2-VL":
                raise
            raise FicocoError(str(exc).replace("Qwen2-VL", self.family_title)) from None

    def _install_tower(self, handle: Handle, patches: Patches, spec: Any, schedule: Any) -> None:
        if spec.pooled_grid:  # a cut of a video's frames together (HoliTom)
            self.cuts.patch_video_cut(handle, patches, spec, schedule)
            return
        if spec.placement == "after_projector" and not spec.probes.reads_tower:
            # A cut on the merger's output that reads nothing of the tower (DivPrune, CDPruner).
            self.cuts.patch_projector_cut(handle, patches, spec, schedule)
            return
        module = spec.load()
        if spec.placement == "tower_input" and isinstance(module, TowerModule):  # from the pixels (PixelPrune)
            self.cuts.patch_input_cut(handle, patches, spec, schedule)
            return
        if spec.placement == "in_layer" and isinstance(module, GroupsModule):
            self.blocks.patch_vision(handle, patches, schedule.removed_at(), module.reduce_groups)
            return
        if spec.placement in ("tower_output", "after_projector") and isinstance(module, TowerModule):
            self.cuts.patch_cut(handle, patches, spec, schedule)
            return
        if spec.placement == "in_layer" and isinstance(module, TowerModule):
            self.blocks.patch_merges(handle, patches, spec, schedule)
            return
        raise FicocoError(f"variant={spec.name}: {spec.title} on Qwen2-VL is planned and counted by `ficoco "
                          "flops` (the equivalent token in place of [CLS]) but not wired into Qwen2-VL's packed "
                          "vision tower yet; run it on a LLaVA-1.5 or Video-LLaVA model, or use FiCoCo-V (v) here")

    def run_tower(self, pixel_values: Tensor, grid_thw: Tensor, **kwargs: Any) -> Any:
        """The vision tower on `pixel_values` cast to its dtype, as transformers' encoder calls it, with the
        caller's own pixels at hand meanwhile (`caller_pixels`: a method reading pixels sees them uncast)."""
        visual = self.visual
        self.caller_pixels = pixel_values
        try:
            return visual(pixel_values.type(visual.dtype), grid_thw=grid_thw, **kwargs)
        finally:
            self.caller_pixels = None

    def group_pixels(self, pixels: Tensor) -> Tensor:
        """(groups, merge x C x P x P) every merge group's [0, 1] pixels from the tower's flattened patches
        (`ficoco.methods.pixelprune.ops.group_pixels` under this family's normalisation)."""
        vision = self.model.config.vision_config
        return group_pixels(pixels, channels=vision.in_channels, temporal_patch_size=vision.temporal_patch_size,
                            patch_size=vision.patch_size, merge=self.merge, mean=self.pixel_mean, std=self.pixel_std)

    def riding_features(self, tower: TowerPass, images: list[int]) -> Tensor | None:
        """(n, G, C) per-group features that ride with the units of `images` through a method step before the LLM
        (Qwen3-VL's DeepStack taps, under a method whose merges are decided from the keys alone); none here."""
        return None

    def follow_groups(self, tower: TowerPass, images: list[int], kept_at: Tensor, *, merges: bool | None,
                      features: Tensor | None = None) -> None:
        """What else follows the groups a method step in the tower kept or merged for `images` (of the pass):
        nothing here; Qwen3-VL's DeepStack features (ficoco.models.qwen3_vl). `kept_at` (n, K): where every
        unit that goes on was among the step's units (-1: a unit the step made); `merges`: whether the step merged
        (None: where `kept_at` holds a made unit); `features`: what rode through the step (`riding_features`)."""

    def language_tokens(self, input_ids: Tensor) -> Tensor:
        """(B, T) bool: the placeholders an LLM-side step reduces: the images', and under a video method
        (HoliTom's inner merge) the videos' as well."""
        tokens = super().language_tokens(input_ids)
        if self.video_cut and self.video_token_id is not None:
            tokens = tokens | (input_ids == self.video_token_id)
        return tokens

    @contextlib.contextmanager
    def call_scope(self, call: dict[str, Any], *, generating: bool) -> Iterator[None]:
        """Keep the call's image_grid_thw while it runs (a method in the decoder that reads the images' grids
        asks for it once per prefill; a forward inside generate sees the generation's, or its own)."""
        grid = call.get("image_grid_thw")
        if grid is None:
            yield
            return
        previous, self.image_grid_thw = self.image_grid_thw, grid
        try:
            yield
        finally:
            self.image_grid_thw = previous

    def image_grids(self, title: str, input_ids: Tensor) -> tuple[tuple[ImageGrids, ...], ...]:
        """Every image's span: its merged token grid (image_grid_thw's height and width over the merge size,
        one grid per temporal slice); the tower's patch grid is image_grid_thw's height and width, before the
        merge. One host synchronisation (the grids and the span lengths)."""
        if self.image_grid_thw is None:
            raise FicocoError(f"{title} on {self.family_title} reads every image's grid: give image_grid_thw in the "
                              "same forward or generate call as the image placeholders")
        thw = self.image_grid_thw.tolist()
        spans = span_lengths(self.language_tokens(input_ids))
        images = len(spans[0]) if spans else 0
        if not images or len(thw) != len(spans) * images:
            raise FicocoError(f"{title} on {self.family_title}: image_grid_thw has {len(thw)} rows for "
                              f"{len(spans)} sample(s) of image spans {spans}: give every sample's images")
        found = []
        for b, lengths in enumerate(spans):
            sample, start = [], 0
            for (t, h, w), length in zip(thw[b * images:(b + 1) * images], lengths, strict=True):
                rows, cols = h // self.merge_size, w // self.merge_size
                if length != t * rows * cols:
                    raise FicocoError(f"{title} on {self.family_title}: an image span of {length} placeholders "
                                      f"for an image of grid {[t, h, w]} ({t * rows * cols} tokens)")
                grids = tuple(TokenGrid(start + s * rows * cols, rows, cols, cols) for s in range(t))
                sample.append(ImageGrids(start, length, grids, (h, w)))
                start += length
            found.append(tuple(sample))
        return tuple(found)

    def step_state(self, title: str, input_ids: Tensor, attention_mask: Tensor | None, past_length: int = 0,
                   prior_positions: dict[int, Tensor] | None = None, *, grids: bool = False) -> Any:
        """The base adapter's state of a layer-input step; under a video method, whose counts are per video, a video
        counts once, whether one span holds it (Qwen2-VL) or one span per temporal slice (Qwen3-VL's layout)."""
        state = super().step_state(title, input_ids, attention_mask, past_length, prior_positions, grids=grids)
        tower = self.tower_pass
        if state is not None and self.video_cut and tower is not None and tower.frames:
            state.images = max(1, len(tower.frames) // input_ids.shape[0])
        return state

    def encode_images(self, pixel_values: Tensor, image_grid_thw: Tensor, **kwargs: Any) -> Any:
        """The (reduced) tower's output, every item's kept groups in grid order, split per item (transformers'
        `get_image_features` splits by the unreduced counts); the tower's order reads it (`GridOrder.encode`)."""
        return self.order.encode(pixel_values, image_grid_thw, **kwargs)

    def kept_token_index(self, input_ids: Tensor, keep: int) -> Tensor | None:
        """Not LLaVA's first-`keep` rule: Qwen2-VL's spans keep the groups the tower kept
        (`PromptShortener.shorten_prompt`), which also fixes the kept tokens' 3-D positions."""
        raise FicocoError("Qwen2-VL image spans are shortened by shorten_prompt, from the groups the tower kept")

    # -- the hooks of the one entry wrapper (ficoco.models.entry) ------------------------------
    # FiCoCo-L and the other methods in the decoder: the base adapter's hooks, with later turns' images encoded
    # first. A method before the LLM: the images encoded first, then the shortened prompt run with the
    # kept tokens' original 3-D positions (forward and generate).
    def enter_forward(self, entry: Entry, call: dict[str, Any]) -> tuple[Tensor | None, bool]:
        if not entry.shortens:
            return super().enter_forward(entry, call)
        handle = entry.handle
        input_length = call["input_ids"].shape[1] if call.get("input_ids") is not None else 0
        if call.get("pixel_values") is not None or call.get("pixel_values_videos") is not None:
            self.prompt.prepare(entry, call, text_row=False)
            handle.prompt_map = (entry.generating[0], input_length)
        elif not call.get(hf.ENCODED_FEATURES_KEYWORD):
            follow_shortened_prompt(handle, call)
        # Otherwise: text, a decode step, or generate's prefill, whose images generate() encoded.
        positions = None
        if call.get(hf.ENCODED_FEATURES_KEYWORD) and entry.generating is not None:
            positions, entry.generating = entry.generating[0], None
        ids = call.get("input_ids")
        if positions is not None and ids is not None and positions.shape[1] > ids.shape[1]:
            # generate's prefill on a later turn's cache runs the part after what the cache holds.
            past = int(hf.cache_in(call).get_seq_length())
            positions = positions[:, past:past + ids.shape[1]]
        return positions, positions is not None

    def after_forward(self, entry: Entry, call: dict[str, Any], output: Any, positions: Tensor | None) -> None:
        """A shortened prefill's rope deltas, kept per cache for the next turn on it."""
        output_cache = hf.output_cache(output)
        if entry.shortens and positions is not None and output_cache is not None:
            self.turn_deltas[output_cache] = hf.rope_deltas(self.model)

    def enter_generate(self, entry: Entry, kwargs: dict[str, Any]) -> bool:
        if not entry.shortens:
            self.prompt.encode_later_turn_images(kwargs)
            if kwargs.get(hf.ENCODED_FEATURES_KEYWORD):  # images encoded beforehand: a new visual generation
                entry.handle.begin_forward()
            return super().enter_generate(entry, kwargs)
        if kwargs.get("pixel_values") is None and kwargs.get("pixel_values_videos") is None:
            return self.prompt.text_turn(entry, kwargs)
        self.prompt.prepare(entry, kwargs, text_row=True)
        return True

    def patch_encoders(self, entry: Entry, patches: Patches) -> None:
        """A method before the LLM: get_image_features and get_video_features called directly (not through
        forward or generate) split their output by what the tower kept (a video's slices run as images)."""
        if not entry.shortens:
            return

        def get_image_features(pixel_values: Tensor, image_grid_thw: Tensor | None = None, **kwargs: Any) -> Any:
            return_dict = kwargs.pop("return_dict", True)
            out = self.encode_images(pixel_values, image_grid_thw, **kwargs)
            return out if return_dict else out.to_tuple()

        def get_video_features(pixel_values_videos: Tensor, video_grid_thw: Tensor | None = None,
                               **kwargs: Any) -> Any:
            return get_image_features(pixel_values_videos, video_grid_thw, **kwargs)

        patches.set(hf.inner_model(self.model), hf.IMAGE_ENCODER, get_image_features)
        patches.set(hf.inner_model(self.model), hf.VIDEO_ENCODER, get_video_features)
