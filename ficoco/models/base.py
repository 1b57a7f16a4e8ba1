"""The base of every family adapter: the defaults of the entry wrapper's hooks (`EntryHooks`,
ficoco.models.entry) and the decoder-side parts every family shares.

A family adapter derives from `FamilyAdapter`, sets where its layers are, and overrides only what
its family does differently: LLaVA-1.5 (ficoco.models.llava) finds its CLIP tower and shortens
image spans to their first `keep` placeholders; LLaVA-NeXT and LLaVA-OneVision lay out AnyRes crops;
Qwen2-VL (the package ficoco.models.qwen2_vl) is composed of parts (tower blocks, cuts, prompt
shortening) over the tower's token order, and Qwen2.5-VL is the same adapter naming its window order.

What the base reads from its subclass: `model`, `decoder_layers` (the decoder's layers) and
`image_token_id` (the placeholder of the span the methods act on); and, for a method before the LLM
that shortens the prompt itself, `kept_token_index`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from ficoco.errors import FicocoError
from ficoco.models import hf_compat as hf
from ficoco.models.entry import follow_shortened_prompt, shorten_call
from ficoco.models.patching import LanguageState, Patches

if TYPE_CHECKING:
    from ficoco.methods.inputs import ImageGrids
    from ficoco.models.entry import Entry
    from ficoco.models.handle import Handle


class FamilyAdapter:
    """Every hook of the entry wrapper with its default, and the decoder-side parts of a family whose
    decoder is LLaMA-like (every family here): FiCoCo-L's state, the layer-input methods' state, the
    rotary tables and the final norm."""

    model: nn.Module
    decoder_layers: Any
    image_token_id: int | None
    # The forward/generate inputs that carry pixels (each starts a new visual forward).
    pixel_inputs: tuple[str, ...] = ("pixel_values",)
    # Whether a method of the "compact" position scheme (PDrop, SparseVLM) renumbers the reduced
    # sequence's 1-D positions here (False: the kept tokens keep their original positions).
    compacts_positions = True
    # Whether the decoder's rotary positions are 3-D (Qwen2-VL's M-RoPE: temporal, height, width) rather than 1-D;
    # a method's own recomputed row whose need says ``rope="1d"`` (VScan's official Qwen code) leaves RoPE out there.
    multimodal_rope = False

    # -- methods that act before the LLM (FiCoCo-V, ToMe, VisionZip, FasterVLM, PruMerge+, ...) ---
    # Where an image call's pixels go and the model's own function that encodes them, for a method
    # whose count is known only once the tower ran (an adaptive count): (input, modality, encoder).
    encoder_inputs: tuple[tuple[str, str, str], ...] = (("pixel_values", "image", hf.IMAGE_ENCODER),)
    # Whether the projector's input keeps every item's [CLS] first (Video-LLaVA's frames).
    projector_keeps_cls = False

    def encode_first(self, handle: Handle, call: dict[str, Any]) -> int | None:
        """Encode the call's pixels before the LLM runs (the model's own encoder, patched), hand the
        features to the forward as `mm_encoder_outputs`, and return the visual tokens every item
        hands the LLM, as measured; None when the call holds no pixels."""
        encoded = call.get(hf.ENCODED_FEATURES_KEYWORD) or {}
        for key, modality, encoder in self.encoder_inputs:
            pixels = call.get(key)
            if pixels is None:
                continue
            options = {name: call[name] for name in ("vision_feature_layer", "vision_feature_select_strategy",
                                                     "image_sizes") if call.get(name) is not None}
            encoded[modality] = hf.encode_features(self.model, encoder, pixels, **options)
            del call[key]
        if not encoded:
            return None
        call[hf.ENCODED_FEATURES_KEYWORD] = encoded
        measured = handle.measured_tokens_per_item
        # The placeholders of one span unit: the method's tokens, and the [CLS] a frame keeps (Video-LLaVA).
        return None if measured is None else measured + int(self.projector_keeps_cls)

    # -- FiCoCo-L ---------------------------------------------------------------------------
    def language_tokens(self, input_ids: Tensor) -> Tensor:
        """(B, T) bool: the placeholders FiCoCo-L reduces (every image span of the prompt)."""
        return input_ids == self.image_token_id

    def unreduced_visual(self, input_ids: Tensor) -> Tensor:
        """(B, T) bool: visual placeholders FiCoCo leaves alone (none here; Video-LLaVA's images)."""
        return torch.zeros_like(input_ids, dtype=torch.bool)

    def language_state(self, input_ids: Tensor, attention_mask: Tensor | None, past_length: int = 0,
                       prior_positions: dict[int, Tensor] | None = None) -> LanguageState | None:
        """Find the visual tokens of every sample from its placeholder tokens (never from offsets):
        all image spans of a sample together. None when the input holds no placeholder. One host
        synchronisation per prefill.

        `past_length` tokens of earlier turns are in the cache already (the unreduced layout), and
        `prior_positions` say which of them each reducing layer's cache holds (multi-turn)."""
        is_image = self.language_tokens(input_ids)
        counts = is_image.sum(dim=1)
        batch, length = input_ids.shape
        positions = torch.arange(length, device=input_ids.device).expand(batch, -1)
        last = torch.where(is_image, positions, -1).max(dim=1).values
        # Spans: runs of placeholders (every family's template puts a token between two images).
        starts = is_image & ~torch.nn.functional.pad(is_image[:, :-1], (1, 0), value=False)
        spans = starts.sum(dim=1)
        # Everything the host must know, in one transfer.
        fewest, most, earliest_last, latest_last, fewest_spans, most_spans = torch.stack(
            [counts.min(), counts.max(), last.min(), last.max(), spans.min(), spans.max()]).tolist()
        if most == 0:
            return None
        if fewest != most:
            raise FicocoError("every sample of a batch must hold the same number of image tokens for FiCoCo-L")
        if fewest_spans != most_spans:
            raise FicocoError("every sample of a batch must hold the same number of images for FiCoCo-L")
        num_visual = most
        # A stable sort of the "not visual" flags lists every sample's visual rows first, in order.
        visual_rows = torch.sort((~is_image).to(torch.int8), dim=1, stable=True).indices[:, :num_visual]
        real = attention_mask.bool() if attention_mask is not None else torch.ones_like(is_image)
        suffix = (positions > last[:, None]) & real & ~self.unreduced_visual(input_ids)
        ranks = torch.arange(num_visual, device=input_ids.device).expand(batch, -1)
        return LanguageState(index=positions.clone(), visual_rows=visual_rows, visual_ranks=ranks,
                             suffix_mask=suffix, prefill_length=past_length + length, past_length=past_length,
                             prior_positions=dict(prior_positions or {}), first_suffix_row=earliest_last + 1,
                             last_visual_row=latest_last, images=most_spans)

    # -- methods in the decoder (FiCoCo-L inside layers; FastV, PDrop, SparseVLM, DART at their input)
    def patch_in_layer(self, handle: Handle, patches: Patches, spec: Any, schedule: Any, first: int) -> None:
        """The decoder's in-layer hook point (ficoco.models.llm_steps): layers from `first` on see the
        shorter sequence through sliced masks and rotary tables."""
        from ficoco.models.llm_steps import InLayerPatch

        InLayerPatch(self, handle, spec, schedule, first).install(patches)

    # -- methods at the input of decoder layers (FastV, PDrop, SparseVLM, DART, ...) -----------
    def patch_layer_input(self, handle: Handle, patches: Patches, spec: Any, schedule: Any) -> None:
        """The decoder's hook points and probes for a method acting at layer inputs (ficoco.models.llm_steps)."""
        from ficoco.models.llm_steps import LayerInputPatch

        LayerInputPatch(self, handle, spec, schedule).install(patches)

    def step_state(self, title: str, input_ids: Tensor, attention_mask: Tensor | None, past_length: int = 0,
                   prior_positions: dict[int, Tensor] | None = None, *, grids: bool = False) -> LanguageState | None:
        """The state of a layer-input method's prefill: the visual span found from the placeholders, and with
        `grids` (a method that reads them: a need of kind ``grid``) every image's grids (`image_grids`)."""
        from ficoco.models.llm_steps import step_state

        state = step_state(input_ids, attention_mask, self.language_tokens(input_ids), past_length, title)
        if state is not None and grids:
            state.image_grids = self.image_grids(title, input_ids)
        return state

    def image_grids(self, title: str, input_ids: Tensor) -> tuple[tuple[ImageGrids, ...], ...]:
        """Per sample, every image of its visual spans (`language_tokens`, in reading order) with the grids its
        tokens lie on (ficoco.methods.inputs.ImageGrids), from what the family knows of the call's images; a
        family that cannot tell refuses the method in one line."""
        raise FicocoError(f"{title} reads where every visual token stands on its image's grid, which ficoco's "
                          f"{type(self).__name__} cannot tell; run it on another family")

    def rotary(self, hidden: Tensor, position_ids: Tensor) -> tuple[Tensor, Tensor]:
        """The decoder's rotary tables at `position_ids` (compacted positions)."""
        return hf.decoder_rotary(self.model)(hidden, position_ids)

    @property
    def final_norm(self) -> nn.Module:
        """The decoder's final norm (DART reads hidden states through it)."""
        return hf.decoder_norm(self.model)

    # -- the top-level model: the hooks of the one entry wrapper (ficoco.models.entry) ------------
    def entry_keep(self, handle: Handle, spec: Any, keep_per_image: int | None) -> int | None:
        """The count a method before the LLM shortens every image span to (None: measured per call)."""
        return keep_per_image

    @contextlib.contextmanager
    def call_scope(self, call: dict[str, Any], *, generating: bool) -> Iterator[None]:
        """The context a forward (or generate) call runs in: nothing by default."""
        yield

    def enter_forward(self, entry: Entry, call: dict[str, Any]) -> tuple[Tensor | None, bool]:
        """A forward's start, in place: a call with pixels starts a visual prefill (its prompt kept for
        the methods that read the instruction); a method before the LLM shortens its image spans to the
        kept tokens. Returns (the kept positions in the caller's prompt or None, whether the call starts
        a prefill of the decoder's state)."""
        handle = entry.handle
        input_ids = call.get("input_ids")
        # A call with pixels, or with the visual features generate() encoded before its first forward,
        # starts a visual prefill; one without (a decode step, text only) cannot hold image features,
        # and is passed on without asking the device anything.
        has_pixels = any(call.get(key) is not None for key in self.pixel_inputs)
        if has_pixels:
            handle.begin_forward()
            if input_ids is not None:
                handle.prompt_ids = (input_ids, call.get("attention_mask"))
        visual = has_pixels or bool(call.get(hf.ENCODED_FEATURES_KEYWORD))
        positions = None
        if entry.shortens and not visual:
            follow_shortened_prompt(handle, call)
            if entry.gapped:
                self.continue_positions(entry, call)
        if entry.shortens and visual and input_ids is not None and (entry.keep is not None or entry.adaptive):
            if entry.generating is not None:
                # generate's prefill, shortened already (its rows repeated for beams/samples): the part
                # after what a cache holds (a later turn), or, without a cache, the whole prompt again at
                # every step, followed by the new tokens.
                kept, length = entry.generating
                kept = kept.repeat_interleave(input_ids.shape[0] // kept.shape[0], dim=0)
                cache = hf.cache_in(call)
                past = int(cache.get_seq_length()) if cache is not None else 0
                end = past + input_ids.shape[1]
                extra = torch.arange(length, length + max(0, end - kept.shape[1]), device=kept.device)
                positions = torch.cat([kept, extra.expand(kept.shape[0], -1)], dim=1)[:, past:end]
            else:
                if entry.adaptive and has_pixels:
                    keep = self.encode_first(handle, call)
                else:
                    if entry.gapped and has_pixels:  # what the cut kept decides the position ids
                        self.encode_first(handle, call)
                    keep = entry.keep
                positions = self.kept_token_index(input_ids, keep) if keep is not None else None
                if positions is not None:
                    if entry.gapped:
                        positions = self.original_positions(entry, call, input_ids, positions, generating=False,
                                                            images=visual)
                    shorten_call(call, positions, input_ids.shape[1])
                    handle.prompt_map = (positions, input_ids.shape[1])
        return positions, visual and input_ids is not None

    def enter_generate(self, entry: Entry, kwargs: dict[str, Any]) -> bool:
        """generate's start, in place: a method before the LLM shortens the prompt's image spans (also
        those of earlier turns on a cache that holds them shortened); True when it did."""
        handle = entry.handle
        # transformers encodes the images before its first forward call, so a new generation starts
        # here, not in forward.
        prompt = kwargs.get("input_ids")
        if any(kwargs.get(key) is not None for key in self.pixel_inputs):
            handle.begin_forward()
            if prompt is not None:  # generate may encode the images before its first forward
                handle.prompt_ids = (prompt, kwargs.get("attention_mask"))
        if not entry.shortens or prompt is None:
            return False
        keep = entry.keep
        if entry.gapped and not entry.adaptive and any(kwargs.get(key) is not None for key in self.pixel_inputs):
            self.encode_first(handle, kwargs)  # what the cut kept decides the position ids
        if entry.adaptive:
            cache = hf.cache_in(kwargs)
            if cache is not None and cache.get_seq_length() and bool((prompt == self.image_token_id).any()):
                # Each turn's count is measured on its own images: the spans the cache holds shortened
                # cannot be told from this call's (silently misaligned otherwise).
                raise FicocoError(f"{entry.spec.title}'s adaptive count is measured per call, so the image spans "
                                  "of a conversation on a cache cannot be shortened as its earlier turns were; "
                                  "give a fixed count with keep=")
            keep = self.encode_first(handle, kwargs)
        kept = self.kept_token_index(prompt, keep) if keep is not None else None
        if kept is None:
            return False
        if entry.gapped:
            images = any(kwargs.get(key) is not None for key in self.pixel_inputs) or \
                bool(kwargs.get(hf.ENCODED_FEATURES_KEYWORD))
            kept = self.original_positions(entry, kwargs, prompt, kept, generating=True, images=images)
        shorten_call(kwargs, kept, prompt.shape[1])
        entry.generating = (kept, prompt.shape[1])
        return True

    # -- a method before the LLM whose kept tokens keep their original position ids (G-Prune) -----------
    def kept_span_flags(self, handle: Handle) -> Tensor | None:
        """(this call's placeholders,) bool, sample after sample: True on the placeholders of this call's image
        spans whose tokens the cut kept (their original places); None when the family cannot tell."""
        return None

    def gapped_index(self, input_ids: Tensor, kept: Tensor, flags: Tensor) -> Tensor:
        """`kept` (B, T') (the shortened prompt's positions in `input_ids`: the first placeholders of every span)
        with the placeholders of this call's own spans (the last of every sample) taken where `flags` says the
        cut's tokens came from: the shortened prompt is the same, its tokens' positions the original ones. Spans of
        earlier turns (in the cache already) keep their first placeholders."""
        batch = input_ids.shape[0]
        is_visual = input_ids == self.image_token_id
        own = flags.numel() // batch
        if own * batch != flags.numel() or not own:
            raise FicocoError(f"the images of this call give {flags.numel()} image tokens, which the {batch} prompts "
                              "cannot share evenly: give every sample the same images' count")
        rank = torch.cumsum(is_visual.long(), dim=1) - 1
        first_own = is_visual.sum(dim=1, keepdim=True) - own
        mine = is_visual & (rank >= first_own)
        index = (rank - first_own).clamp(0, own - 1)
        keep = torch.zeros_like(is_visual).scatter(1, kept, torch.ones_like(kept, dtype=torch.bool))
        keep = torch.where(mine, torch.gather(flags.view(batch, own).to(keep.device), 1, index), keep)
        length = kept.shape[1]
        short, miscounted = torch.stack([(first_own < 0).any(), (keep.sum(dim=1) != length).any()]).tolist()
        if short:  # one host read for both checks
            raise FicocoError(f"the prompt holds fewer image placeholders than this call's images need ({own} per "
                              "sample): give the prompt as the processor lays it out")
        if miscounted:
            raise RuntimeError("the cut's kept tokens and the shortened prompt's spans disagree in count")
        # A stable sort of the drop flags lists the kept positions first, in order.
        return torch.sort((~keep).to(torch.int8), dim=1, stable=True).indices[:, :length]

    def original_positions(self, entry: Entry, call: dict[str, Any], input_ids: Tensor, kept: Tensor, *,
                           generating: bool, images: bool) -> Tensor:
        """The kept positions (B, T') of a prompt a method of original position ids shortens, its visual tokens at
        the placeholders they came from, and in `call` the caller's unreduced position ids for `shorten_call` to
        take at them (G-Prune, llava_arch.py:290 and :406): the caller's own, else the ones transformers would give
        the unreduced prompt (generate: from the attention mask, as `generate` numbers a prompt; a forward: after the
        cache, continued from where its prefill's ids left it). Nothing changes when nothing is removed."""
        batch, length = input_ids.shape
        if kept.shape[1] == length:
            return kept
        if images:  # this call's own images: the last spans of every sample (a text turn has none)
            flags = self.kept_span_flags(entry.handle)
            if flags is None:
                raise FicocoError(f"{entry.spec.title} gives the kept tokens their original position ids, read from "
                                  "the images it encodes in this call: pass the images (pixel values), not encoded "
                                  "features")
            kept = self.gapped_index(input_ids, kept, flags)
        if call.get("position_ids") is not None:
            return kept
        device = input_ids.device
        mask = call.get("attention_mask")
        cache = hf.cache_in(call)
        past = int(cache.get_seq_length()) if cache is not None else 0
        if generating and mask is not None and mask.dim() == 2 and mask.shape[1] == length:
            numbered = mask.long().cumsum(-1) - 1
            call["position_ids"] = numbered.masked_fill(mask == 0, 0).to(device)
        elif generating:
            call["position_ids"] = torch.arange(length, device=device).expand(batch, -1)
        else:
            shift = entry.position_shifts.get(cache) if cache is not None else None
            ids = torch.arange(past, past + length, device=device).expand(batch, -1)
            call["position_ids"] = ids + shift.to(device).unsqueeze(1) if shift is not None else ids
        if mask is None and cache is None:
            # transformers reads gapped position ids without a mask and without a cache as packed sequences
            # (masking_utils.find_packed_sequence_indices): an explicit mask of the one sequence.
            call["attention_mask"] = torch.ones(batch, length, dtype=torch.long, device=device)
        return kept

    def continue_positions(self, entry: Entry, call: dict[str, Any]) -> None:
        """A call without images on a cache a method of original position ids filled (a decode step, a text
        turn): its position ids continue from the last one the cache's calls ran at (llava_llama.py:86-90, the
        last kept id + 1), unless the caller gives them."""
        input_ids = call.get("input_ids")
        cache = hf.cache_in(call)
        if call.get("position_ids") is not None or input_ids is None or cache is None:
            return
        shift = entry.position_shifts.get(cache)
        if shift is None:
            return
        past = int(cache.get_seq_length())
        ids = torch.arange(past, past + input_ids.shape[1], device=input_ids.device)
        call["position_ids"] = ids.unsqueeze(0) + shift.to(input_ids.device).unsqueeze(1)

    def after_forward(self, entry: Entry, call: dict[str, Any], output: Any, positions: Tensor | None) -> None:
        """Bookkeeping of a forward's output: for a method of original position ids, where the cache's next
        position id stands (`Entry.position_shifts`)."""
        ids = call.get("position_ids")
        if not entry.gapped or not isinstance(ids, Tensor) or ids.dim() != 2:
            return
        cache = hf.output_cache(output)
        if cache is not None:
            entry.position_shifts[cache] = ids[:, -1] + 1 - int(cache.get_seq_length())

    def patch_encoders(self, entry: Entry, patches: Patches) -> None:
        """The model's own encoders the method needs patched beside forward and generate: none here."""

    def turn_on_cache(self, cache: Any, state: LanguageState | None) -> tuple[int, dict[int, Tensor]]:
        """(tokens already in `cache`, per reducing layer the positions its cache holds) for a
        FiCoCo-L prefill that continues a conversation; (0, {}) for a fresh one."""
        past = int(cache.get_seq_length()) if cache is not None else 0
        if not past:
            return 0, {}
        if state is not None:
            return past, state.next_turn_priors(past)
        lengths = {int(cache.get_seq_length(i)) for i in self.token_cache_layers()}
        if lengths != {past}:
            raise FicocoError("this cache holds FiCoCo-L-reduced layers that the handle did not fill (a copy, or "
                              "another handle's); continue the conversation on the cache object the model returned")
        return past, {}

    def token_cache_layers(self) -> range | tuple[int, ...]:
        """The decoder layers whose cache holds tokens (every layer here; a hybrid decoder's full-attention
        layers alone: a linear-attention layer's cache holds a state, and transformers refuses its length)."""
        return range(len(self.decoder_layers))

    def kept_token_index(self, input_ids: Tensor, keep: int | None) -> Tensor | None:
        """(B, T') the positions of `input_ids` a method before the LLM keeps when every span unit keeps
        `keep` placeholders; a family that shortens its spans otherwise refuses (its own entry hooks)."""
        raise NotImplementedError(f"{type(self).__name__} shortens its spans in its own entry hooks")
