"""FiCoCo inside Hugging Face's LLaVA-NeXT (`LlavaNextForConditionalGeneration`): LLaVA-1.5's CLIP
tower and LLaMA decoder, with AnyRes images. This file alone knows LLaVA-NeXT's layout; the layer
patches are LLaVA-1.5's (`LlavaAdapter`), and the method lives in ficoco.methods.

AnyRes, as transformers computes it: an image becomes a base view plus a grid of crops, every one
a CLIP batch item; the crop features are put back on one large patch grid, the grid is unpadded
to the image's aspect ratio, and one `image_newline` token ends every row; the base view's tokens
come first. So:

- Every method that acts before the LLM (FiCoCo-V, ToMe, VisionZip, FasterVLM, PruMerge+) runs
  through LLaVA-1.5's tower and projector hook points, every item (base view and crops) a batch
  row reduced alike. The packing that follows cannot reshape reduced crops into a grid, so it is
  replaced, while such a method runs, by `ImageLayout.pack`: every token that continues a patch
  goes where the unreduced packing puts that patch, every row still ends with a newline token,
  and tokens without a grid place (contextual, extra) follow the crop grid; FiCoCo-V's kept grid
  is the case "every token placed". The prompt's placeholder span is shortened to the reduced
  count at the entry.
- FiCoCo-L reduces the whole span (base, crops and newlines) with LLaVA-1.5's decoder patch; the
  newline tokens count as visual tokens but are protected: never selected for removal.

Both need each image's layout, which follows from its `image_sizes` row; the entry wrappers keep
the call's `image_sizes` for the span bookkeeping (generate encodes the images before its first
forward call, so a generation's sizes are taken at `generate`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from ficoco.errors import FicocoError
from ficoco.methods.anyres.ops import ImageLayout, anyres_layout
from ficoco.methods.inputs import ImageGrids
from ficoco.models import hf_compat as hf
from ficoco.models.inputs import PREFIX_TOKENS, place_inputs
from ficoco.models.llava import LlavaAdapter
from ficoco.models.patching import LanguageState, Patches, method_settings, span_lengths
from ficoco.models.prompt import PromptFormat, anyres_image_size

if TYPE_CHECKING:
    from ficoco.models.handle import Handle

__all__ = ["PREFIX_TOKENS", "ImageLayout", "LlavaNextAdapter", "image_layout", "synthetic_inputs"]


def _flagged(flags: Tensor) -> Tensor:
    """(rows, n) the indices of the True entries of every row of `flags` (rows, n), ascending, then -1s."""
    order = torch.sort((~flags).to(torch.int8), dim=1, stable=True).indices
    present = torch.arange(flags.shape[1], device=flags.device).unsqueeze(0) < flags.sum(dim=1, keepdim=True)
    return torch.where(present, order, torch.full_like(order, -1))


def image_layout(config: Any, size_hw: Any) -> ImageLayout:
    """The layout of one image of `size_hw` (H, W), from transformers' own AnyRes grid choice and
    its unpadding arithmetic, so that it is what the model packs."""
    size = [int(v) for v in (size_hw.tolist() if isinstance(size_hw, Tensor) else size_hw)]
    if len(size) != 2 or min(size) < 1:
        raise FicocoError(f"image size {size_hw} is not (height, width) in pixels")
    vision = config.vision_config
    side = vision.image_size // vision.patch_size
    return anyres_layout(side, hf.anyres_grid(size, config.image_grid_pinpoints, vision.image_size), size)


class LlavaNextAdapter(LlavaAdapter):
    """Where the method goes in a LLaVA-NeXT model, and the AnyRes span bookkeeping."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        config = model.config
        if not getattr(config, "image_grid_pinpoints", None):
            raise FicocoError(f"{type(model).__name__} has no image_grid_pinpoints; not a LLaVA-NeXT model")
        self._layouts: dict[tuple[int, int], ImageLayout] = {}
        # A method that cuts before the LLM (FiCoCo-V, ToMe, VisionZip, ...): its title, and the tokens
        # every item hands on with a grid place and without one (None: an adaptive count, measured).
        self.method_title = "FiCoCo-V"
        self.kept_per_item: int | None = None
        self.unplaced_per_item = 0
        self.image_sizes: Tensor | None = None  # the current call's image_sizes (see call_scope)

    def layout(self, size_hw: Any) -> ImageLayout:
        key = tuple(int(v) for v in (size_hw.tolist() if isinstance(size_hw, Tensor) else size_hw))
        if key not in self._layouts:
            self._layouts[key] = image_layout(self.model.config, key)
        return self._layouts[key]

    def _sizes_of_call(self) -> list[list[int]]:
        return self.image_sizes.tolist() if self.image_sizes is not None else []

    def _layouts_of_call(self, what: str) -> list[ImageLayout]:
        if self.image_sizes is None:
            raise FicocoError(f"{what} on LLaVA-NeXT needs the images' image_sizes in the same forward or "
                              "generate call as the image placeholders")
        return [self.layout(size) for size in self.image_sizes]

    def patch_tower(self, handle: Handle, patches: Patches, spec: Any, schedule: Any) -> None:
        """A method that acts before the LLM (FiCoCo-V, ToMe, VisionZip, FasterVLM, PruMerge+), per
        crop: every item (base view and crops) is a batch row of LLaVA-1.5's tower and projector hook
        points, reduced alike; the AnyRes packing is replaced by `ImageLayout.pack`, which reads where
        every output token came from (`TowerOutput.kept`, left by the hook points in
        `handle.vision_state`).

        Placement, after VisionZip's official AnyRes code (`restore_image_features_sorted`): the base
        view's tokens in the method's order; the crops' placed tokens at their grid places; then every
        crop's unplaced tokens (contextual, extra) in crop order. Its defects, fixed here: it ignores
        AnyRes unpadding (it reshapes the whole crop grid, so a non-square image is mis-packed; here the
        layout's unpadded grid, and images whose unpadding drops tokens are refused, since the count
        would depend on which tokens stay) and it drops the newline tokens (computed, never used; here
        one ends every row, as in the unreduced model). FiCoCo-V places every token.

        The span length follows from the schedule before the LLM runs: items x (placed + unplaced) +
        newline rows. An adaptive count (PruMerge+ without --keep) is measured by encoding first; the
        items of one call (every crop of every image) must then agree, or the call is refused."""
        if getattr(self.model.config, "vision_feature_select_strategy", "default") != "default":
            raise FicocoError(f"{spec.title} on LLaVA-NeXT needs vision_feature_select_strategy='default' "
                              "([CLS] dropped before packing)")
        super().patch_tower(handle, patches, spec, schedule)
        self._pack_reduced_items(handle, patches, spec, schedule)

    def _pack_reduced_items(self, handle: Handle, patches: Patches, spec: Any, schedule: Any) -> list[Any]:
        """What every item hands on under the schedule's vision steps (placed and unplaced tokens; None
        for an adaptive count), and the layout packing in place of `pack_image_features` while the
        method runs. Returns the vision removals."""
        removals = [r for r in schedule.removals if r.stage == "vision"]
        self.method_title = spec.title
        adaptive = bool(schedule.settings_dict().get("adaptive"))
        self.kept_per_item = None if adaptive else self.patches - sum(r.remove for r in removals)
        self.unplaced_per_item = sum(r.added for r in removals)
        cut = next((r for r in removals if r.where == "after_projector"), None)
        if getattr(spec, "anyres_grid", False) and cut is not None:
            # The cut runs in the packing, on every image's base view and whole crop grid (`_cut_whole_images`).
            self.grid_cut = (handle, spec.load(), method_settings(handle, spec, schedule), cut)
            patches.on_undo(self._end_grid_cut)
        inner = hf.inner_model(self.model)
        packing = hf.PACK_FEATURES
        patches.set(inner, packing, self._packing(getattr(inner, packing), lambda: handle.vision_state))
        return removals

    # -- a cut of every AnyRes image whole: its base view and its crop grid (G-Prune) -------------------
    # (handle, the method's module, its settings, the removal) while such a method runs; None otherwise.
    grid_cut: tuple[Any, Any, dict[str, Any], Any] | None = None
    # Per image of the last call cut whole, in call order: True on the placeholders of its unreduced span whose
    # tokens go on (what the kept tokens' original position ids are read from).
    span_flags: list[Tensor] | None = None

    @property
    def cut_after_packing(self) -> bool:
        """Whether the projector leaves its cut to the packing (`MethodSpec.anyres_grid`)."""
        return self.grid_cut is not None

    def kept_span_flags(self, handle: Handle) -> Tensor | None:
        """Every image of this call cut whole: True where its kept tokens and its newline tokens stand in its
        unreduced span (`span_flags`, taken once); None otherwise."""
        flags, self.span_flags = self.span_flags, None
        return torch.cat(flags) if flags else None

    def _end_grid_cut(self) -> None:
        self.grid_cut = self.span_flags = None

    def _cut_whole_images(self, image_features: Any, layouts: list[ImageLayout], newline: Tensor | None
                          ) -> list[Tensor]:
        """Run the method on every image as its official code cuts LLaVA-NeXT's (G-Prune, llava_arch.py:246-288):
        the base view as one part, the whole unpadded crop grid as packed (rows of the grid, row-major, the
        newline tokens left out) as another; the newline tokens always go on. The base view keeps the schedule's
        count per item, the grid that count per crop in all (as a cut of every crop apart would hand on). The
        bases of a call are one batched call, the grids one per grid size. Returns every image's packed span:
        the kept tokens and the newline tokens in the span's order; leaves `span_flags`.

        One record per call, as for a cut of every crop apart: a row per item (every image's base view, then its
        crops), the patch indices (row-major) the item kept and lost, ascending, each row padded with -1 to the
        item's patches (a crop's share of its grid's count varies)."""
        from ficoco.methods.inputs import TowerInput

        assert self.grid_cut is not None
        handle, module, settings, removal = self.grid_cut
        if newline is None:
            raise FicocoError(f"{self.method_title} on LLaVA-NeXT packs the newline tokens of the model's "
                              "image_newline parameter, which this model lacks")
        keep = self.patches - removal.remove
        for layout in layouts:  # an image whose unpadding drops tokens is refused, as for every cut
            layout.reduced_tokens(keep, 0, self.method_title)

        def cut(parts: Tensor, remove: int) -> Tensor:
            out = handle.run_method(("projector", None), module.tower_step,
                                    TowerInput(hidden=parts, has_cls=False, remove=remove), settings)
            if out.counts is not None or out.kept.shape[1] != parts.shape[1] - remove or bool((out.kept < 0).any()):
                raise RuntimeError(f"{self.method_title}'s cut of whole images hands on kept tokens only")
            return out

        device = image_features[0].device
        bases = cut(torch.stack([features[0] for features in image_features]), removal.remove)
        # Per image, (items, patches): True on the patches every item (base view, crops) kept.
        held = [torch.zeros(layout.items, self.patches, dtype=torch.bool, device=device) for layout in layouts]
        for image in range(len(layouts)):
            held[image][0, bases.kept[image].to(device)] = True
        tokens = [[bases.hidden[i]] for i in range(len(layouts))]
        slots = [[bases.kept[i]] for i in range(len(layouts))]
        by_grid: dict[tuple[int, int, int, int], list[int]] = {}
        for image, layout in enumerate(layouts):
            if layout.items > 1:
                by_grid.setdefault((*layout.crops_hw, *layout.unpadded.shape), []).append(image)
        for images in by_grid.values():
            layout = layouts[images[0]]
            order = layout.grid_order().to(device)
            width = image_features[images[0]].shape[-1]
            grids = torch.stack([image_features[i][1:].reshape(-1, width)[order] for i in images])
            crops = layout.items - 1
            out = cut(grids, crops * removal.remove)
            grid_slots, crop_patches = layout.grid_slots().to(out.kept.device), order.to(out.kept.device)
            for b, image in enumerate(images):
                tokens[image].append(out.hidden[b])
                slots[image].append(grid_slots[out.kept[b]])
                held[image][1:].view(-1)[crop_patches[out.kept[b]].to(device)] = True
        packed, flags = [], []
        for image, layout in enumerate(layouts):
            lines = layout.newline_slots().to(device)
            place = torch.cat([s.to(device) for s in slots[image]] + [lines])
            span = torch.cat(tokens[image] + [newline.to(device, image_features[image].dtype)[None].expand(
                lines.shape[0], -1)])
            packed.append(span[torch.argsort(place)])
            flag = torch.zeros(layout.tokens, dtype=torch.bool, device=device)
            flags.append(flag.scatter(0, place, torch.ones_like(place, dtype=torch.bool)))
        self.span_flags = flags
        items = torch.cat(held)
        handle.record("vision", removal.layer, kept=_flagged(items), discarded=_flagged(~items))
        return packed

    def patch_for_tracing(self, patches: Patches) -> None:
        """Let torch.jit trace the forward (fvcore counts by tracing): transformers' unpadding rounds
        sizes that the tracer turns into tensors, so the layout packing (the same result) stands in."""
        inner, packing = hf.inner_model(self.model), hf.PACK_FEATURES
        if packing not in inner.__dict__:  # a reducing method's packing is traceable already
            patches.set(inner, packing, self._packing(getattr(inner, packing), lambda: None))

    def _packing(self, original: Callable[..., Any], kept_grid_of: Callable[[], Tensor | None]
                 ) -> Callable[..., tuple[list[Tensor], Tensor]]:
        """A stand-in for `pack_image_features` that packs the items a method reduced before the LLM
        (where each output token came from: `kept_grid_of`, see `ImageLayout.pack`) in AnyRes order;
        unreduced items go to `original`, except under torch.jit tracing."""

        def pack_image_features(image_features: Any, image_sizes: Tensor, vision_feature_select_strategy: str,
                                image_newline: Tensor | None = None) -> tuple[list[Tensor], Tensor]:
            kept_grid = kept_grid_of()
            items = sum(int(f.shape[0]) for f in image_features)
            if kept_grid is None:
                if not torch.jit.is_tracing():
                    return original(image_features, image_sizes, vision_feature_select_strategy,
                                    image_newline=image_newline)
                kept_grid = torch.arange(self.patches, device=image_features[0].device).expand(items, -1)
            if vision_feature_select_strategy != "default":
                raise FicocoError("FiCoCo on LLaVA-NeXT packs features of vision_feature_select_strategy="
                                  f"'default' only, not '{vision_feature_select_strategy}'")
            if tuple(kept_grid.shape) != (items, image_features[0].shape[1]):
                raise RuntimeError(f"the method kept {tuple(kept_grid.shape)} tokens for {items} items of "
                                   f"{image_features[0].shape[1]} features")
            if self.grid_cut is not None:  # every image cut whole (G-Prune's parts)
                packed = self._cut_whole_images(image_features, [self.layout(size) for size in image_sizes],
                                                image_newline)
                lengths = torch.tensor([p.shape[0] for p in packed], dtype=torch.long, device=packed[0].device)
                return packed, lengths
            packed, start = [], 0
            for features, size in zip(image_features, image_sizes, strict=True):
                grid = kept_grid[start:start + features.shape[0]]
                start += features.shape[0]
                packed.append(self.layout(size).pack(features, grid, image_newline))
            lengths = torch.tensor([p.shape[0] for p in packed], dtype=torch.long, device=packed[0].device)
            return packed, lengths

        return pack_image_features

    def kept_token_index(self, input_ids: Tensor, keep: int | None) -> Tensor | None:
        """(B, T') the positions the shortened prompt of a method that cuts before the LLM keeps: the
        first placeholders of every image span, as many as the image's reduced count (items x the
        tokens every item hands on + its newline rows). `keep` is the count at the profile's image size
        and is not read, except for an adaptive count: then it is the tokens every item of this call
        measured. None without placeholders.

        The call's image_sizes give the layouts of its own images, the last spans of every sample.
        Spans before them belong to earlier turns of a conversation, whose images came in earlier
        calls (their shortened form is in the cache): each one's layout follows from its length
        (`earlier_span_layout`); an adaptive count cannot tell theirs, and refuses them. One host
        synchronisation (the span lengths)."""
        is_image = input_ids == self.image_token_id
        if not bool(is_image.any()):
            return None
        title = self.method_title
        adaptive = self.kept_per_item is None
        if adaptive and keep is None:
            raise RuntimeError(f"{title} on LLaVA-NeXT shortens prompts only after patch_tower")
        placed, unplaced = (keep, 0) if adaptive else (self.kept_per_item, self.unplaced_per_item)
        layouts = self._layouts_of_call(title)
        batch = input_ids.shape[0]
        spans = span_lengths(is_image)
        if len(layouts) % batch or any(len(row) < len(layouts) // batch for row in spans):
            raise FicocoError(f"the input holds image spans of {spans} image placeholders, but image_sizes gives "
                              f"{len(layouts)} image(s) for {batch} sample(s): give every sample's images")
        own = len(layouts) // batch
        full, reduced = [], []
        for b, row in enumerate(spans):
            earlier = row[:len(row) - own]
            if earlier and adaptive:
                raise FicocoError(f"{title}'s adaptive count was measured on each earlier turn's images, which this "
                                  "call does not hold, so the cache's spans are unknown: give a fixed count with "
                                  "keep= to continue a conversation on its cache")
            span_layouts = [self.earlier_span_layout(tokens) for tokens in earlier]
            span_layouts += layouts[b * own:(b + 1) * own]
            expected = [layout.tokens for layout in span_layouts]
            if row != expected:
                raise FicocoError(f"the input's image spans hold {row} image placeholders, but its images "
                                  f"(image_sizes {self._sizes_of_call()}, earlier turns' first) need {expected}")
            full += expected
            for layout in span_layouts:
                count = layout.reduced_tokens(placed, unplaced, title)
                if count > layout.tokens:  # the prompt is shortened, never lengthened
                    raise FicocoError(f"{title} hands the LLM {count} visual tokens for an image of "
                                      f"{layout.tokens} placeholders; give a setting that keeps fewer")
                reduced.append(count)
        full_t, reduced_t = torch.tensor(full), torch.tensor(reduced)
        # Placeholders are consumed in row-major order (masked_scatter): the k-th one overall
        # belongs to the span whose cumulative count first exceeds k.
        rank = torch.cumsum(is_image.flatten().long(), 0).view_as(input_ids) - 1
        ends = torch.cumsum(full_t, 0).to(input_ids.device)
        image = torch.bucketize(rank, ends, right=True).clamp(max=len(full) - 1)
        starts = (ends - full_t.to(ends.device))[image]
        drop = is_image & (rank - starts >= reduced_t.to(ends.device)[image])
        kept = ~drop
        lengths = kept.sum(dim=1)
        if not bool((lengths == lengths[0]).all()):
            raise FicocoError("every sample of a batch must hold the same number of images of the same "
                              f"layout for {title}")
        length = int(lengths[0])
        # A stable sort of the drop flags lists the kept positions first, in order.
        return torch.sort(drop.to(torch.int8), dim=1, stable=True).indices[:, :length]

    def earlier_span_layout(self, tokens: int) -> ImageLayout:
        """The layout of an image of an earlier turn, from its span's `tokens` placeholders: the
        AnyRes grid (one of the config's pinpoints) whose unpadded span has that many (a method
        that cuts before the LLM serves images whose unpadding drops nothing, so the span is the
        whole grid). Fixed counts only (see `kept_token_index`)."""
        assert self.kept_per_item is not None
        candidates = {}
        for height, width in self.model.config.image_grid_pinpoints:
            layout = self.layout((height, width))
            if layout.tokens == tokens and not layout.unpadding_drops:
                candidates[layout.reduced_tokens(self.kept_per_item, self.unplaced_per_item)] = layout
        if len(candidates) != 1:
            what = "no AnyRes grid" if not candidates else "several AnyRes grids"
            raise FicocoError(f"an earlier turn's image span of {tokens} placeholders matches {what} of this model, "
                              f"so {self.method_title} cannot tell how many the cache holds; run the conversation in "
                              "one prompt")
        return next(iter(candidates.values()))

    # -- the decoder's methods ------------------------------------------------------------------
    def _layouts_per_sample(self, input_ids: Tensor, what: str) -> list[list[ImageLayout]]:
        """Per sample, the layouts of its images (the call's image_sizes), each prompt's repeated as generate
        repeats the prompt for beams and returned sequences; refused where the spans do not match them. One host
        synchronisation (the span lengths)."""
        layouts = self._layouts_of_call(what)
        spans = span_lengths(self.language_tokens(input_ids))
        batch, images = input_ids.shape[0], len(spans[0]) if spans else 0
        prompts = len(layouts) // images if images else 0
        if not images or len(layouts) % images or not prompts or batch % prompts:
            raise FicocoError(f"the input holds image spans of {spans} placeholders, but image_sizes gives "
                              f"{len(layouts)} image(s) for {batch} sample(s): give every sample's images")
        copies = batch // prompts
        found = [layouts[p * images:(p + 1) * images] for p in range(prompts) for _ in range(copies)]
        for row, sample in zip(spans, found, strict=True):
            if row != [layout.tokens for layout in sample]:
                raise FicocoError(f"the input's image spans hold {row} image placeholders, but its images "
                                  f"(image_sizes {self._sizes_of_call()}) need {[x.tokens for x in sample]}")
        return found

    def image_grids(self, title: str, input_ids: Tensor) -> tuple[tuple[ImageGrids, ...], ...]:
        """Every image's span: its base view's grid, then its packed crop grid (unpadded; a newline after every
        row, on no grid); the tower's patch grid is one crop's (a CLIP item's)."""
        found = []
        for layouts in self._layouts_per_sample(input_ids, title):
            images, start = [], 0
            for layout in layouts:
                images.append(ImageGrids(start, layout.tokens, layout.token_grids(start), self.patch_grid_hw))
                start += layout.tokens
            found.append(tuple(images))
        return tuple(found)

    # -- FiCoCo-L ---------------------------------------------------------------------------
    def language_state(self, input_ids: Tensor, attention_mask: Tensor | None, past_length: int = 0,
                       prior_positions: dict[int, Tensor] | None = None) -> LanguageState | None:
        """LLaVA-1.5's span bookkeeping, with the newline tokens of the spans protected."""
        state = super().language_state(input_ids, attention_mask, past_length, prior_positions)
        if state is None:
            return None
        layouts = self._layouts_of_call("FiCoCo-L")
        flags = torch.cat([layout.newline_flags() for layout in layouts]).to(input_ids.device)
        is_image = input_ids == self.image_token_id
        placeholders = state.visual_rows.numel()  # every sample holds the same count
        batch = input_ids.shape[0]
        copies = placeholders // flags.numel() if flags.numel() else 0
        if copies > 1 and placeholders == copies * flags.numel() and batch % copies == 0:
            # generate's beams (or returned sequences) repeat every prompt `copies` times after it
            # took the call's image_sizes: repeat each prompt's images' flags alike.
            per_prompt = len(layouts) * copies // batch
            groups = [torch.cat([layout.newline_flags() for layout in layouts[i:i + per_prompt]])
                      for i in range(0, len(layouts), per_prompt)]
            flags = torch.cat([group for group in groups for _ in range(copies)]).to(input_ids.device)
        if flags.numel() != placeholders:
            raise FicocoError(f"the input holds {placeholders} image placeholders, but its "
                              f"{len(layouts)} image(s) of image_sizes {self._sizes_of_call()} need {flags.numel()}")
        newline = torch.zeros_like(is_image)
        newline[is_image] = flags
        state.protected = torch.gather(newline, 1, state.visual_rows)
        # Asked once per prefill, so that no reducing layer has to (a host synchronisation).
        state.max_protected = int(state.protected.sum(dim=1).max())
        return state

    # -- the top-level model ----------------------------------------------------------------
    @contextlib.contextmanager
    def call_scope(self, call: dict[str, Any], *, generating: bool) -> Iterator[None]:
        """Keep the call's image_sizes for the span bookkeeping while it runs (a forward inside generate
        sees the generation's)."""
        sizes = call.get("image_sizes")
        if generating and sizes is None and call.get("pixel_values") is None:
            # No images in this call: every span of the prompt is an earlier turn's (a text turn of a
            # conversation on its cache).
            sizes = torch.zeros(0, 2, dtype=torch.long)
        if sizes is None:
            yield
            return
        previous, self.image_sizes = self.image_sizes, torch.as_tensor(sizes).reshape(-1, 2).cpu()
        try:
            yield
        finally:
            self.image_sizes = previous


def synthetic_inputs(model: nn.Module, *, batch: int = 1, text_tokens: int = 60, seed: int = 0,
                     dtype: torch.dtype | None = None, device: torch.device | str | None = None,
                     image_size: tuple[int, int] | None = None) -> dict[str, Tensor]:
    """input_ids, attention_mask, pixel_values (B, items, 3, crop, crop) and image_sizes for `batch`
    prompts "USER: <image>\\n... ASSISTANT:" of one image of `image_size` (H, W; the profile's default
    image size otherwise), laid out as the LLaVA-NeXT processor lays them out."""
    config = model.config
    if config.model_type != "llava_next":
        raise FicocoError(f"synthetic inputs here are laid out for LLaVA-NeXT only, not '{config.model_type}'")
    if text_tokens <= PREFIX_TOKENS:
        raise FicocoError(f"text_tokens= must exceed the {PREFIX_TOKENS} template tokens before the image")
    vision = config.vision_config
    if image_size is None:
        default = (getattr(model, "_ficoco_defaults", None) or {}).get("image_size")
        image_size = tuple(default) if default else (2 * vision.image_size, 2 * vision.image_size)
    height, width = (int(v) for v in image_size)
    layout = image_layout(config, (height, width))
    image_token = getattr(config, "image_token_id", None)
    if image_token is None:
        image_token = config.image_token_index
    # Ordinary text ids: below the special tokens the LLaVA vocabulary appends.
    text_vocab = min(config.text_config.vocab_size, image_token) - 3
    generator = torch.Generator().manual_seed(seed)
    text = torch.randint(3, 3 + text_vocab, (batch, text_tokens), generator=generator)
    text[:, 0] = 1  # BOS
    image = torch.full((batch, layout.tokens), image_token, dtype=torch.long)
    input_ids = torch.cat([text[:, :PREFIX_TOKENS], image, text[:, PREFIX_TOKENS:]], dim=1)
    pixels = torch.randn(batch, layout.items, vision.num_channels, vision.image_size, vision.image_size,
                         generator=generator)
    return place_inputs(model, input_ids, "pixel_values", pixels, dtype=dtype, device=device,
                        image_sizes=torch.tensor([[height, width]] * batch, dtype=torch.long))


# AnyRes: the accountant plans with the image's own size, as the processor records it.
PROMPT = PromptFormat(image_size=anyres_image_size)
