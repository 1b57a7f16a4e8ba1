"""The patched model's `forward` and `generate`: one wrapper for every family and method.

What every family shares lives here: binding the call, refusing options the patched model cannot
honour, the decoder's per-prefill state (FiCoCo-L's, or a layer-input method's) started on every
visual prefill and followed on its cache, the loss over the positions that remain, the position in
the caller's `input_ids` of every output position (`Handle.output_positions`), the output in the
form the caller asked for, and the caller's own prompt put back into what generate returns.

What differs by family are the adapter's hooks (defaults on the base adapter,
ficoco.models.base.FamilyAdapter, overridden where a family differs):

- `entry_keep(handle, spec, keep)`: the count a method before the LLM shortens each span unit to
  (Video-LLaVA: per frame, not per video);
- `call_scope(call, generating=)`: a context the call runs in (LLaVA-NeXT's image_sizes,
  LLaVA-OneVision's batch_num_images, read by the span bookkeeping);
- `enter_forward(entry, call)`: a visual forward's start, in place: a method before the LLM
  shortens the prompt's spans; returns (positions in the caller's prompt or None, starts a prefill);
- `enter_generate(entry, kwargs)`: generate's start, in place; True when it shortened the prompt
  (the caller's prompt is then put back into the output);
- `after_forward(entry, call, output, positions)`: bookkeeping of the output (Qwen2-VL's rope deltas);
- `patch_encoders(entry, patches)`: the model's own encoders a method needs patched as well.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import weakref
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch
from torch import Tensor, nn

from ficoco.errors import FicocoError
from ficoco.models import hf_compat as hf
from ficoco.models.attention import check_attention_implementation
from ficoco.models.patching import Patches, forward_of, gather_rows

if TYPE_CHECKING:
    from ficoco.models.handle import Handle


@runtime_checkable
class EntryHooks(Protocol):
    """What a family's adapter gives the entry wrapper (`FamilyAdapter` has every default)."""

    model: Any
    pixel_inputs: tuple[str, ...]

    def entry_keep(self, handle: Handle, spec: Any, keep_per_image: int | None) -> int | None: ...

    def call_scope(self, call: dict[str, Any], *, generating: bool) -> contextlib.AbstractContextManager[None]: ...

    def enter_forward(self, entry: Entry, call: dict[str, Any]) -> tuple[Tensor | None, bool]: ...

    def enter_generate(self, entry: Entry, kwargs: dict[str, Any]) -> bool: ...

    def after_forward(self, entry: Entry, call: dict[str, Any], output: Any, positions: Tensor | None) -> None: ...

    def patch_encoders(self, entry: Entry, patches: Patches) -> None: ...

    def language_state(self, input_ids: Tensor, attention_mask: Tensor | None, past_length: int = 0,
                       prior_positions: dict[int, Tensor] | None = None) -> Any: ...

    def step_state(self, title: str, input_ids: Tensor, attention_mask: Tensor | None, past_length: int = 0,
                   prior_positions: dict[int, Tensor] | None = None, *, grids: bool = False) -> Any: ...

    def turn_on_cache(self, cache: Any, state: Any) -> tuple[int, dict[int, Tensor]]: ...


class Entry:
    """The wrapper of one handle: its method's settings and the state shared between generate and
    the forwards it makes."""

    def __init__(self, adapter: EntryHooks, handle: Handle, spec: Any, keep_per_item: int | None) -> None:
        if not isinstance(adapter, EntryHooks):
            raise TypeError(f"{type(adapter).__name__} does not offer the entry wrapper's hooks (EntryHooks)")
        self.adapter = adapter
        self.handle = handle
        self.spec = spec
        self.model = adapter.model
        # A method that acts before the LLM (FiCoCo-V, ToMe, VisionZip, ...) hands it fewer visual tokens per
        # item: the prompt's spans are shortened to them. Every other keeps a per-prefill state of the
        # decoder's sequence; a method acting before the LLM and again inside it (HoliTom) does both.
        self.shortens = spec.per_item
        self.in_llm = not spec.per_item or spec.inner is not None
        self.keep = adapter.entry_keep(handle, spec, keep_per_item)
        # A count known only once the tower ran (PruMerge+ without a fixed count): the items are encoded
        # first, and the spans shortened to what they measured.
        self.adaptive = bool(handle.schedule.settings_dict().get("adaptive"))
        if spec.placement == "in_layer" and not spec.per_item:  # in the decoder (FiCoCo-L)
            self.new_state = adapter.language_state
        else:  # at layer inputs (the registry entry's title names the method in refusals; the images' grids
            # where the method reads them)
            self.new_state = functools.partial(adapter.step_state, spec.title, grids=spec.probes.image_grids)
        # Set while generate runs a prompt it shortened already: (kept positions, the caller's prompt
        # length). Its forwards must not shorten again; the prefill's positions refer to the caller's prompt.
        self.generating: tuple[Tensor, int] | None = None
        # A method before the LLM whose kept tokens keep their original position ids (G-Prune: `positions`
        # "original"): the shortened prompt runs at the caller's unreduced position ids, gaps included, and what
        # follows on its cache continues from them. Per cache it filled, (B,) what the next token's position id
        # exceeds the cache's length by (the unreduced model's id of it; ficoco.models.base).
        self.gapped = spec.per_item and spec.positions == "original"
        self.position_shifts: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def install(self, patches: Patches) -> None:
        """Wrap the model's forward and generate (and the encoders the family's hook names)."""
        model = self.model
        original_forward = forward_of(model)
        original_generate = model.generate
        signature = inspect.signature(original_forward)

        # generate() validates its kwargs against forward's signature: keep the original's.
        @functools.wraps(original_forward)
        def forward(*args: Any, **kwargs: Any) -> Any:
            bound = signature.bind_partial(*args, **kwargs)
            call = dict(bound.arguments)
            call.update(call.pop("kwargs", {}))
            with self.adapter.call_scope(call, generating=False):
                return self.forward(original_forward, call)

        @functools.wraps(original_generate)
        def generate(*args: Any, **kwargs: Any) -> Any:
            if args:
                kwargs["input_ids"], args = args[0], args[1:]
            with self.adapter.call_scope(kwargs, generating=True):
                return self.generate(original_generate, args, kwargs)

        patches.set(model, "forward", forward)
        patches.set(model, "generate", generate)
        self.adapter.patch_encoders(self, patches)

    def forward(self, original: Any, call: dict[str, Any]) -> Any:
        """One forward: the family's start, the decoder's state, the model's own forward, the bookkeeping."""
        model, handle = self.model, self.handle
        check_call_options(model, call, self.spec.name)
        positions, starts_prefill = self.adapter.enter_forward(self, call)
        labels = self.start_language_state(call, starts_prefill) if self.in_llm else None
        # The state for the next step lives in the output: ask for the object form and give the caller
        # the tuple it asked for at the end.
        return_dict = call.pop("return_dict", None)
        output = original(**call, return_dict=True)
        self.adapter.after_forward(self, call, output, positions)
        if positions is not None and positions.shape[0] != output.logits.shape[0]:
            # generate's prefill repeats each prompt for beams and samples.
            positions = positions.repeat_interleave(output.logits.shape[0] // positions.shape[0], dim=0)
        state = handle.language_state
        if self.in_llm and state is not None and not state.decoding:
            state.follow(output.logits.device)  # the last layer's device, under a device map
            state.cache = hf.output_cache(output)
            if state.cache is not None:
                handle.cache_states[state.cache] = state
            state.decoding = True
            if labels is not None:  # the call's labels (of the shortened prompt, if shortened before the LLM)
                output.loss = remaining_loss(model, output.logits, labels, state.index)
            # Positions in the caller's prompt: through the shortened prompt's, where shortened before the LLM.
            positions = state.index if positions is None else torch.gather(positions, 1, state.index)
        handle.output_positions = positions if positions is not None else arange_like(output.logits)
        return output if wants_dict(model, return_dict) else output.to_tuple()

    def start_language_state(self, call: dict[str, Any], starts_prefill: bool) -> Tensor | None:
        """Set `handle.language_state` for this call (a prefill's new state, a decode step's, or none);
        return the labels the call held when its prefill's loss is computed over what remains."""
        handle, adapter = self.handle, self.adapter
        cache = hf.cache_in(call)
        # The state that filled this cache (a conversation may go on on any cache the handle filled;
        # one it did not fill must hold every token in every layer).
        filled = handle.cache_states.get(cache) if cache is not None else None
        input_ids = call.get("input_ids")
        if starts_prefill and input_ids is not None:
            past, priors = adapter.turn_on_cache(cache, filled)
            mask = call.get("attention_mask")
            if mask is not None and past and mask.shape[-1] == past + input_ids.shape[1]:
                # A later turn's mask covers the cache too (generate's, on a padded batch): the state
                # reads this call's columns.
                mask = mask[:, past:]
            # The prompt the LLM runs (shortened by a method acting before the LLM too).
            handle.language_state = self.new_state(input_ids, mask, past, priors)
        elif filled is None:
            adapter.turn_on_cache(cache, None)  # refuses a reduced cache it cannot follow
            handle.language_state = None
        else:
            handle.language_state = filled
            filled.decoding = True
        state = handle.language_state
        return call.pop("labels", None) if state is not None and not state.decoding else None

    def generate(self, original: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """generate on the family's start; the caller's own prompt back in the output where it was shortened."""
        check_call_options(self.model, kwargs, self.spec.name)
        prompt = kwargs.get("input_ids")
        shortened = self.adapter.enter_generate(self, kwargs)
        try:
            output = original(*args, **kwargs)
        finally:
            self.generating = None
        return restore_prompt(output, prompt, kwargs["input_ids"].shape[1]) if shortened else output


def follow_shortened_prompt(handle: Handle, call: dict[str, Any]) -> None:
    """A decode step after a FiCoCo-V prefill, with the caller's attention mask grown from the
    caller's (unshortened) prompt, as a hand-written decode loop grows it: drop the columns of
    the placeholders the prefill removed, so the mask lines up with the cache."""
    mask, cache, prompt = call.get("attention_mask"), hf.cache_in(call), handle.prompt_map
    input_ids = call.get("input_ids")
    if mask is None or cache is None or prompt is None or input_ids is None or mask.dim() != 2:
        return
    kept, length = prompt
    removed = length - kept.shape[1]
    if mask.shape[1] != int(cache.get_seq_length()) + input_ids.shape[1] + removed or mask.shape[0] != kept.shape[0]:
        return  # lined up with the cache already (generate's own steps), or not this prompt's
    at = kept.to(mask.device)  # -1: a pad the shortening added (samples of different counts), masked
    kept_mask = torch.where(at >= 0, torch.gather(mask[:, :length], 1, at.clamp(min=0)), torch.zeros_like(at))
    call["attention_mask"] = torch.cat([kept_mask.to(mask.dtype), mask[:, length:]], dim=1)


def arange_like(logits: Tensor) -> Tensor:
    """(B, T) 0..T-1: output positions of a call that removed nothing."""
    return torch.arange(logits.shape[1], device=logits.device).expand(logits.shape[0], -1)


def shorten_call(call: dict[str, Any], kept: Tensor, length: int) -> None:
    """Keep the `kept` positions of every per-token input of `call` (ids, masks, labels, 2-D
    position ids, token types): FiCoCo-V's shortened prompt, in place."""
    for key in ("input_ids", "attention_mask", "labels", "token_type_ids", "mm_token_type_ids"):
        value = call.get(key)
        if isinstance(value, Tensor) and value.dim() == 2 and value.shape[1] == length:
            call[key] = torch.gather(value, 1, kept.to(value.device))
    position_ids = call.get("position_ids")
    if isinstance(position_ids, Tensor) and position_ids.dim() == 2 and position_ids.shape[1] == length:
        call["position_ids"] = gather_rows(position_ids, kept.to(position_ids.device), 1)


def restore_prompt(output: Any, prompt_ids: Tensor, short_length: int) -> Any:
    """generate's output with the caller's prompt in place of the shortened one it ran, so that
    `out[:, prompt_ids.shape[1]:]` is exactly the new tokens (every returned sequence: beams and
    num_return_sequences repeat each prompt, as generate expands them)."""
    sequences = output if isinstance(output, Tensor) else output.sequences
    copies = sequences.shape[0] // prompt_ids.shape[0]
    prompt = prompt_ids.to(sequences.device).repeat_interleave(copies, dim=0)
    restored = torch.cat([prompt, sequences[:, short_length:]], dim=1)
    if isinstance(output, Tensor):
        return restored
    output.sequences = restored
    return output


def wants_dict(model: nn.Module, return_dict: bool | None) -> bool:
    """Whether the caller asked for the output object (return_dict, else the config's)."""
    if return_dict is not None:
        return bool(return_dict)
    return bool(getattr(model.config, "return_dict", True))


def remaining_loss(model: nn.Module, logits: Tensor, labels: Tensor, positions: Tensor) -> Tensor:
    """The model's own causal-LM loss over the positions that remain: `labels` taken at the input
    position of every output position (`positions`), so the logits at output t are scored
    against the next token that remains, as transformers' shift does for an unreduced sequence."""
    kept_labels = torch.gather(labels.to(positions.device), 1, positions)
    vocab = getattr(getattr(model.config, "text_config", model.config), "vocab_size", logits.shape[-1])
    return model.loss_function(logits=logits, labels=kept_labels, vocab_size=vocab)


def check_call_options(model: nn.Module, call: dict[str, Any], variant: str) -> None:
    """Refuse, at the call, options whose outputs the patched model could not give in full."""
    check_attention_implementation(model)  # changed after apply() (set_attn_implementation)
    wants_attentions = call.get("output_attentions")
    if wants_attentions is None:
        wants_attentions = getattr(model.config, "output_attentions", False)
    if wants_attentions:
        text = getattr(model.config, "text_config", model.config)
        if hf.attention_implementation(text) != "eager":
            raise FicocoError("output_attentions=True needs the model loaded with attn_implementation='eager' "
                              "(sdpa returns no attention matrices, so some layers would be missing)")
    cache = hf.cache_in(call)
    if cache is not None and getattr(cache, "is_compileable", False):
        raise FicocoError(f"{type(cache).__name__} is not supported by the FiCoCo patches (reduced layers cache "
                          "fewer tokens); use the default DynamicCache")
    if call.get("cache_implementation") not in (None, "dynamic"):
        raise FicocoError(f"cache_implementation='{call['cache_implementation']}' is not supported by the FiCoCo "
                          "patches (reduced layers cache fewer tokens); use the default dynamic cache")
