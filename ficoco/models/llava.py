"""FiCoCo inside Hugging Face's LLaVA-1.5 (`LlavaForConditionalGeneration`): a CLIP tower and a
LLaMA decoder. This file alone knows those classes; the method lives in ficoco.reduction.

Nothing of transformers' model source is copied: reducing layers are re-composed from the
layer's own submodules (norms, attention, MLP) so the reduction can sit between the
attention residual and the MLP, and every other layer runs its own forward.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from ficoco import testing_hooks
from ficoco.errors import FicocoError
from ficoco.models.attention import install_probe, remove_probe
from ficoco.models.inputs import PREFIX_TOKENS, synthetic_inputs  # noqa: F401  (the family's, for the registry)
from ficoco.models.patching import LanguageState, Patches, gather_rows
from ficoco.reduction import reduce_l, reduce_v

if TYPE_CHECKING:
    from ficoco.api import Handle


def _targets(kept: Tensor, merge_target: Tensor | None) -> Tensor | None:
    """The kept token (in `kept`'s index space) each discarded token went into, for the records."""
    return None if merge_target is None else torch.gather(kept, 1, merge_target)


def _timed(handle: Handle, device: torch.device, fn: Callable[[], Any]) -> Any:
    """Run one reduction inside the handle's "reduction" span (CUDA events, no host sync)."""
    with handle.timer.span("reduction", device):
        if testing_hooks.REDUCTION_DELAY_S:  # test-only slowdown (FICOCO_TEST_DELAY_REDUCTION_MS), off unless set
            testing_hooks.delay_reduction()
        return fn()


class LlavaAdapter:
    """Where the method goes in a LLaVA-1.5 model, and the image-span bookkeeping."""

    # Families built the same way (a CLIP tower, a LLaMA decoder, one placeholder token per
    # visual token) subclass this and set these: the inner model's tower that FiCoCo-V
    # reduces in, the config keys of the placeholder id of the span both variants act on,
    # and the forward/generate inputs that carry pixels (each starts a new visual forward).
    tower_attribute = "vision_tower"
    placeholder_config_keys: tuple[str, ...] = ("image_token_id", "image_token_index")
    pixel_inputs: tuple[str, ...] = ("pixel_values",)

    def __init__(self, model: nn.Module) -> None:
        inner = getattr(model, "model", None)
        if inner is None or not hasattr(inner, self.tower_attribute) or not hasattr(inner, "language_model"):
            raise FicocoError(f"{type(model).__name__} is not a LLaVA-style model "
                              f"(no {self.tower_attribute}/language_model)")
        self.model = model
        tower = getattr(inner, self.tower_attribute)
        # transformers 5 flattens CLIPVisionModel; older layouts nest it under vision_model.
        tower = getattr(tower, "vision_model", tower)
        self.vision_layers = tower.encoder.layers
        self.decoder_layers = inner.language_model.layers
        config = model.config
        # The placeholder id of the span FiCoCo acts on (LLaVA: the image placeholder).
        self.image_token_id = next((value for key in self.placeholder_config_keys
                                    if (value := getattr(config, key, None)) is not None), None)
        vision = config.vision_config
        side = vision.image_size // vision.patch_size
        self.grid_hw = (side, side)
        self.patches = side * side
        # Placeholders of one unshortened span unit (LLaVA: one image, one per patch).
        self.span_tokens = self.patches

    def stage_modules(self) -> dict[str, nn.Module]:
        """The modules of the accountant's stages, for counters that attribute by module."""
        inner = self.model.model
        return {"vision": getattr(inner, self.tower_attribute), "projector": inner.multi_modal_projector,
                "llm": inner.language_model, "lm_head": self.model.lm_head}

    # -- FiCoCo-V ---------------------------------------------------------------------------
    def patch_vision(self, handle: Handle, patches: Patches, removed: dict[int, int]) -> None:
        """Reduce inside the CLIP layers of `removed`; the LLM gets a shorter image span."""
        params = handle.hyperparameters
        for layer_idx, r in sorted(removed.items()):
            layer = self.vision_layers[layer_idx]
            slot = install_probe(layer.self_attn, want_keys=params.equivalent_token, timer=handle.timer)
            patches.on_undo(lambda attn=layer.self_attn: remove_probe(attn))

            def forward(hidden_states: Tensor, attention_mask: Tensor | None = None, *args: Any,
                        _layer: nn.Module = layer, _slot: Any = slot, _r: int = r, _idx: int = layer_idx,
                        **kwargs: Any) -> Tensor:
                residual = hidden_states
                attn_out, _ = _layer.self_attn(hidden_states=_layer.layer_norm1(hidden_states),
                                               attention_mask=attention_mask, **kwargs)
                hidden = residual + attn_out
                attn, keys = _slot.take()
                state = handle.vision_state
                if state is None or state.shape[0] != hidden.shape[0] or state.shape[1] != hidden.shape[1] - 1:
                    # First reducing layer of this forward: every patch at its own grid place.
                    state = torch.arange(self.patches, device=hidden.device).expand(hidden.shape[0], -1)
                red = _timed(handle, hidden.device, lambda: reduce_v(
                    hidden, attn, _r, state, self.grid_hw, has_cls=True, keys=keys, lam=params.lam,
                    eps=params.eps, window=params.window, coefficient=params.coefficient,
                    equivalent=params.equivalent_token))
                handle.vision_state = red.grid_index
                handle.record("vision", _idx, kept=red.grid_index, discarded=red.discarded_grid,
                              merged_into=_targets(red.grid_index, red.merge_target))
                hidden = red.hidden
                return hidden + _layer.mlp(_layer.layer_norm2(hidden))

            patches.set(layer, "forward", forward)

    def shrink_image_spans(self, input_ids: Tensor, attention_mask: Tensor | None, keep: int
                           ) -> tuple[Tensor, Tensor | None]:
        """Keep the first `keep` placeholders of every full span unit (`span_tokens`: an image's 576
        for LLaVA-1.5). One host synchronisation (the placeholder counts) per call."""
        is_image = input_ids == self.image_token_id
        counts = is_image.sum(dim=1).tolist()
        if not any(counts):
            return input_ids, attention_mask
        if len(set(counts)) != 1:
            raise FicocoError("every sample of a batch must hold the same number of images for FiCoCo-V")
        total = counts[0]
        if total % self.span_tokens:
            if total % keep == 0:
                return input_ids, attention_mask  # already shortened (generate's prefill)
            raise FicocoError(f"image spans of {total} placeholders are not multiples of {self.span_tokens}")
        # Rank of each placeholder inside its span unit: position in the run of placeholders.
        rank = (torch.cumsum(is_image.long(), dim=1) - 1) % self.span_tokens
        drop = is_image & (rank >= keep)
        # Every sample drops the same (host-known) number of placeholders, so a stable sort of
        # the drop flags lists the kept positions in order without a data-dependent nonzero().
        length = input_ids.shape[1] - (total // self.span_tokens) * (self.span_tokens - keep)
        kept = torch.sort(drop.to(torch.int8), dim=1, stable=True).indices[:, :length]
        new_ids = torch.gather(input_ids, 1, kept)
        new_mask = torch.gather(attention_mask, 1, kept) if attention_mask is not None else None
        return new_ids, new_mask

    # -- FiCoCo-L ---------------------------------------------------------------------------
    def language_state(self, input_ids: Tensor, attention_mask: Tensor | None) -> LanguageState | None:
        """Find the visual span of every sample from its placeholder tokens (never from offsets);
        None when the input holds no placeholder. One host synchronisation per prefill."""
        is_image = input_ids == self.image_token_id
        counts = is_image.sum(dim=1)
        batch, length = input_ids.shape
        positions = torch.arange(length, device=input_ids.device).expand(batch, -1)
        start = torch.where(is_image, positions, length).min(dim=1).values
        in_span = (positions >= start[:, None]) & (positions < (start + counts)[:, None])
        contiguous = (in_span & is_image).sum(1).eq(counts).all()
        # Everything the host must know, in one transfer.
        fewest, most, earliest, is_contiguous = torch.stack(
            [counts.min(), counts.max(), start.min(), contiguous.long()]).tolist()
        if most == 0:
            return None
        if fewest != most:
            raise FicocoError("every sample of a batch must hold the same number of image tokens for FiCoCo-L")
        if not is_contiguous:
            raise FicocoError("FiCoCo-L needs one contiguous image span per sample")
        num_visual = most
        end = start + num_visual
        real = attention_mask.bool() if attention_mask is not None else torch.ones_like(is_image)
        suffix = (positions >= end[:, None]) & real
        visual = start[:, None] + torch.arange(num_visual, device=input_ids.device)
        return LanguageState(index=positions.clone(), visual_start=start, visual_positions=visual,
                             suffix_mask=suffix, prefill_length=length, first_suffix_row=earliest + num_visual)

    def patch_language(self, handle: Handle, patches: Patches, removed: dict[int, int], first: int) -> None:
        """Reduce inside the decoder layers of `removed`; layers from `first` on see the shorter
        sequence through sliced masks and rotary tables."""
        params = handle.hyperparameters
        for layer_idx in range(first, len(self.decoder_layers)):
            layer = self.decoder_layers[layer_idx]
            r = removed.get(layer_idx, 0)
            original = layer.forward
            slot = None
            if r:
                slot = install_probe(layer.self_attn, armed=False, timer=handle.timer)
                patches.on_undo(lambda attn=layer.self_attn: remove_probe(attn))

            def forward(hidden_states: Tensor, attention_mask: Tensor | None = None,
                        position_ids: Tensor | None = None, past_key_values: Any = None, use_cache: bool = False,
                        position_embeddings: tuple[Tensor, Tensor] | None = None, *,
                        _layer: nn.Module = layer, _slot: Any = slot, _r: int = r, _idx: int = layer_idx,
                        _original: Callable[..., Tensor] = original, **kwargs: Any) -> Tensor:
                state = handle.language_state
                if state is None:
                    return _original(hidden_states, attention_mask=attention_mask, position_ids=position_ids,
                                     past_key_values=past_key_values, use_cache=use_cache,
                                     position_embeddings=position_embeddings, **kwargs)
                query_len = hidden_states.shape[1]
                attention_mask = state.slice_mask(attention_mask, _idx, query_len)
                if not state.decoding:
                    index = state.index
                    if position_ids is not None and position_ids.shape[-1] != index.shape[1]:
                        position_ids = gather_rows(position_ids, index, 1)
                    if position_embeddings is not None and position_embeddings[0].shape[1] != index.shape[1]:
                        cos, sin = position_embeddings
                        position_embeddings = (gather_rows(cos, index, 1), gather_rows(sin, index, 1))
                    state.cached_positions[_idx] = index
                if state.decoding or not _r:
                    return _original(hidden_states, attention_mask=attention_mask, position_ids=position_ids,
                                     past_key_values=past_key_values, use_cache=use_cache,
                                     position_embeddings=position_embeddings, **kwargs)
                residual = hidden_states
                _slot.armed = True
                try:
                    attn_out, _ = _layer.self_attn(
                        hidden_states=_layer.input_layernorm(hidden_states), attention_mask=attention_mask,
                        position_ids=position_ids, past_key_values=past_key_values, use_cache=use_cache,
                        position_embeddings=position_embeddings, **kwargs)
                finally:
                    _slot.armed = False
                hidden = residual + attn_out
                attn, _ = _slot.take()
                # The prefix is never reduced, so the span starts where it started.
                red = _timed(handle, hidden.device, lambda: reduce_l(
                    hidden, attn, _r, state.visual_start, state.num_visual, state.suffix_mask, beta=params.beta,
                    gamma=params.gamma, eps=params.eps, protected=state.protected,
                    first_suffix_row=state.first_suffix_row, max_protected=state.max_protected))
                kept_original = torch.gather(state.visual_positions, 1, red.kept_visual)
                discarded_original = torch.gather(state.visual_positions, 1, red.discarded_visual)
                span_start = state.visual_start[:, None]
                handle.record("llm", _idx, kept=kept_original - span_start, discarded=discarded_original - span_start,
                              merged_into=_targets(kept_original - span_start, red.merge_target))
                state.keep(red.kept_positions, red.kept_visual)
                hidden = red.hidden
                return hidden + _layer.mlp(_layer.post_attention_layernorm(hidden))

            patches.set(layer, "forward", forward)

    # -- the top-level model ----------------------------------------------------------------
    def patch_entry(self, handle: Handle, patches: Patches, variant: str, keep_per_image: int | None) -> None:
        """Wrap forward (and generate) to shorten V's image spans and to start L's state."""
        model = self.model
        original_forward = model.forward
        original_generate = model.generate
        signature = inspect.signature(original_forward)

        # generate() validates its kwargs against forward's signature: keep the original's.
        @functools.wraps(original_forward)
        def forward(*args: Any, **kwargs: Any) -> Any:
            bound = signature.bind_partial(*args, **kwargs)
            call = dict(bound.arguments)
            call.update(call.pop("kwargs", {}))
            input_ids = call.get("input_ids")
            # A call with pixels, or with the visual features generate() encoded before its first
            # forward, starts a visual prefill; one without (a decode step, text only) cannot
            # hold image features, and is passed on without asking the device anything.
            has_pixels = any(call.get(key) is not None for key in self.pixel_inputs)
            if has_pixels:
                handle.begin_forward()
            visual = has_pixels or call.get("mm_encoder_outputs") is not None
            if variant == "v" and visual and input_ids is not None and keep_per_image is not None:
                call["input_ids"], call["attention_mask"] = self.shrink_image_spans(
                    input_ids, call.get("attention_mask"), keep_per_image)
            starts_prefill = visual and input_ids is not None
            cache = call.get("past_key_values")
            if variant == "l":
                current = handle.language_state
                if starts_prefill:
                    handle.language_state = self.language_state(input_ids, call.get("attention_mask"))
                elif current is None or cache is None or cache is not current.cache:
                    handle.language_state = None
                else:
                    current.decoding = True
            output = original_forward(**call)
            state = handle.language_state
            if variant == "l" and state is not None and not state.decoding:
                state.cache = getattr(output, "past_key_values", None)
                state.decoding = True
            return output

        @functools.wraps(original_generate)
        def generate(*args: Any, **kwargs: Any) -> Any:
            # transformers encodes the images before its first forward call, so a new
            # generation starts here, not in forward.
            if any(kwargs.get(key) is not None for key in self.pixel_inputs):
                handle.begin_forward()
            if variant == "v" and keep_per_image is not None:
                input_ids = kwargs.get("input_ids", args[0] if args else None)
                if input_ids is not None:
                    ids, mask = self.shrink_image_spans(input_ids, kwargs.get("attention_mask"), keep_per_image)
                    args = args[1:] if args else args
                    kwargs["input_ids"] = ids
                    if mask is not None:
                        kwargs["attention_mask"] = mask
            return original_generate(*args, **kwargs)

        patches.set(model, "forward", forward)
        patches.set(model, "generate", generate)
