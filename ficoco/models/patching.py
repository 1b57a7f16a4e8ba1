"""Reversible attribute patches and the per-forward state the patched layers share."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

import torch
from torch import Tensor

_MISSING = object()


def _accelerate_wrapped(obj: Any) -> bool:
    """True for a module accelerate's `add_hook_to_module` wrapped (a device-map's alignment hook,
    offload hook): its `forward` is accelerate's wrapper, which calls `_old_forward` between the
    hook's pre_forward (inputs and weights onto the module's device) and post_forward."""
    return "_hf_hook" in obj.__dict__ and "_old_forward" in obj.__dict__


def forward_of(module: Any) -> Callable[..., Any]:
    """The forward a patch wraps: the module's own (`module.forward`), or under an accelerate hook
    the wrapped one (`_old_forward`), so that the patch runs inside the hook, on the module's device
    with its offloaded weights loaded, and calling `module.forward` still runs the hook first."""
    return module.__dict__["_old_forward"] if _accelerate_wrapped(module) else module.forward


class Patches:
    """Instance attributes set on modules, restored exactly (in reverse order) by `undo`.

    Setting `forward` on a module accelerate has wrapped sets its wrapped forward (`_old_forward`)
    instead, keeping the hook outside the patch; a patch takes its original from `forward_of`."""

    def __init__(self) -> None:
        self._undo: list[Callable[[], None]] = []

    def set(self, obj: Any, name: str, value: Any) -> None:
        if name == "forward" and _accelerate_wrapped(obj):
            name = "_old_forward"
        previous = obj.__dict__.get(name, _MISSING)

        def restore() -> None:
            if previous is _MISSING:
                obj.__dict__.pop(name, None)
            else:
                obj.__dict__[name] = previous

        obj.__dict__[name] = value
        self._undo.append(restore)

    def on_undo(self, fn: Callable[[], None]) -> None:
        self._undo.append(fn)

    def undo(self) -> None:
        while self._undo:
            self._undo.pop()()


def _moved(value: Any, device: torch.device) -> Any:
    if isinstance(value, Tensor):
        return value if value.device == device else value.to(device)
    if isinstance(value, tuple) and value and all(v is None or isinstance(v, (Tensor, float, int)) for v in value):
        return tuple(_moved(v, device) for v in value)
    if isinstance(value, list) and value and all(v is None or isinstance(v, Tensor) for v in value):
        return [_moved(v, device) for v in value]
    if isinstance(value, dict):
        return {key: _moved(v, device) for key, v in value.items()}
    return value


def follow_device(state: Any, device: torch.device, skip: tuple[str, ...] = ()) -> None:
    """Move a per-forward state dataclass's tensors (also inside its tuples and dicts) onto `device`:
    the device of the layer about to read them, under a device map that splits the model."""
    for item in fields(state):
        if item.name not in skip:
            setattr(state, item.name, _moved(getattr(state, item.name), device))


def gather_rows(x: Tensor | None, index: Tensor, dim: int) -> Tensor | None:
    """x[b, ..., index[b], ...] along `dim` (batch 0), broadcasting a batch-1 `x` first."""
    if x is None:
        return None
    batch, kept = index.shape
    if batch == 1 and x.shape[0] == 1 and index.device == x.device:
        # One sample: index_select copies by strides; gather with an expanded index walks every element.
        return x.index_select(dim, index[0])
    if x.shape[0] != batch:
        x = x.expand(batch, *x.shape[1:])
    view = [batch] + [1] * (x.dim() - 1)
    view[dim] = kept
    sizes = list(x.shape)
    sizes[dim] = kept
    return torch.gather(x, dim, index.view(view).expand(sizes))


def span_lengths(is_placeholder: Tensor) -> list[list[int]]:
    """Per sample, the lengths of its runs of placeholders, in reading order (one host copy)."""
    pad = torch.nn.functional.pad
    starts = is_placeholder & ~pad(is_placeholder[:, :-1], (1, 0), value=False)
    ends = is_placeholder & ~pad(is_placeholder[:, 1:], (0, 1), value=False)
    first, last = starts.nonzero(), ends.nonzero()  # row-major: the same spans in the same order
    rows: list[list[int]] = [[] for _ in range(is_placeholder.shape[0])]
    samples, lengths = torch.stack([first[:, 0], last[:, 1] - first[:, 1] + 1]).tolist()
    for sample, length in zip(samples, lengths, strict=True):
        rows[sample].append(length)
    return rows


def method_settings(handle: Any, spec: Any, schedule: Any) -> dict[str, Any]:
    """The settings a method's functions get: its registry defaults, the schedule's own settings, and
    the handle's hyperparameters where they name one of the method's (FiCoCo's, set per handle)."""
    settings = dict(spec.hyperparameters)
    settings.update(schedule.settings_dict())
    for name in spec.hyperparameters:
        if hasattr(handle.hyperparameters, name):
            settings[name] = getattr(handle.hyperparameters, name)
    return settings


@dataclass
class LanguageState:
    """FiCoCo-L bookkeeping for one prefill and the decode steps that follow it.

    A prefill is one forward that holds image placeholders; it may follow earlier turns whose
    keys and values are in the cache already (`past_length` of them in the unreduced layout:
    layer 0, which never reduces, holds them all). `index` holds, per sample, the position in
    this call's `input_ids` of every token still in the sequence; each reducing layer shrinks
    it. Layers slice the mask and rotary tables with it, and each layer remembers which
    positions of the whole conversation (unreduced layout) its KV cache holds, for decoding
    and for the next turn.
    """

    index: Tensor  # (B, T_now) position in this call's input_ids
    visual_rows: Tensor  # (B, N_now) where the visual tokens still present are in the current sequence
    visual_ranks: Tensor  # (B, N_now) their rank among the sample's original visual tokens (0..N-1)
    suffix_mask: Tensor  # (B, T_now) real text tokens after the last visual token
    prefill_length: int  # past_length + this call's length: the first position after the prefill
    past_length: int = 0
    images: int = 1  # image spans per sample: the schedule's per-layer counts are per image
    # Per layer: the conversation positions that layer's cache held before this call (multi-turn);
    # absent: every earlier position.
    prior_positions: dict[int, Tensor] = field(default_factory=dict)
    # Host copies of what the reduction needs to know about the span, so that no reducing
    # layer asks the device (each question would synchronise it): the earliest row a suffix
    # token can be in (min over samples of the last visual row + 1).
    first_suffix_row: int = 0
    # and the latest row a visual token can be in (max over samples of the last visual row; None: unknown), below
    # which a causal read of the visual rows need not look.
    last_visual_row: int | None = None
    # (B, N_now) visual tokens the reduction must keep (LLaVA-NeXT's row newlines); None: none
    protected: Tensor | None = None
    max_protected: int = 0  # the most protected tokens of any sample (constant: never removed)
    cached_positions: dict[int, Tensor] = field(default_factory=dict)
    cache: Any = None
    decoding: bool = False
    # Where a method compacts the positions of the tokens that stay (a layer-input method's `compact` scheme, FiCoCo-L
    # under rule="official"): (B, T_now) the position ids the later layers use, their rotary tables, and per layer
    # the positions compacted away before it, which its decode steps subtract.
    positions: Tensor | None = None
    rotary: tuple[Tensor, Tensor] | None = None
    shift: dict[int, int] = field(default_factory=dict)

    @property
    def num_visual(self) -> int:
        return self.visual_rows.shape[1]

    def follow(self, device: torch.device) -> None:
        """Move the bookkeeping onto `device`, the device of the layer about to run: under a device map
        (accelerate) a layer's hook moves its inputs there, not this state, which the layers share.
        Free when nothing moves (one device compare); the KV cache itself stays where each layer keeps it."""
        if self.index.device == device:
            return
        follow_device(self, device, skip=("_mask_cache",))
        if hasattr(self, "_mask_cache"):
            self._mask_cache = {}  # a mask sliced on the previous device: sliced again here

    def keep(self, kept_positions: Tensor, kept_visual: Tensor, visual_rows: Tensor) -> None:
        """Apply one reduction: `kept_positions` index the current sequence, `kept_visual` the
        current visual tokens; `visual_rows` are the kept visual tokens' rows afterwards."""
        removed = self.visual_rows.shape[1] - kept_visual.shape[1]
        self.first_suffix_row -= removed
        # Every row moves down by the removed tokens before it; the last kept visual token by all of them.
        if self.last_visual_row is not None:
            self.last_visual_row -= removed
        self.index = torch.gather(self.index, 1, kept_positions)
        self.suffix_mask = torch.gather(self.suffix_mask, 1, kept_positions)
        self.visual_ranks = torch.gather(self.visual_ranks, 1, kept_visual)
        self.visual_rows = visual_rows
        if self.protected is not None:
            self.protected = torch.gather(self.protected, 1, kept_visual)

    def key_positions(self, layer: int) -> Tensor:
        """(B, K) conversation positions of the keys `layer` attends to in this prefill: what its
        cache held before, then this call's tokens still present."""
        current = self.index + self.past_length
        prior = self.prior_positions.get(layer)
        if prior is None:
            prior = torch.arange(self.past_length, device=current.device).expand(current.shape[0], -1)
        return torch.cat([prior.to(current.device), current], dim=1)

    def slice_mask(self, mask: Tensor | None, layer: int, query_len: int) -> Tensor | None:
        """The layer's view of a mask built for the unreduced sequence."""
        if mask is None:
            return None
        if mask.dim() == 2:
            # A recurrent (linear-attention) layer's padding mask (Qwen3.5's Gated DeltaNet): one column per
            # token of this call and none for earlier turns, so a prefill keeps the columns of the tokens
            # still present and a decode step's is its own.
            return mask if self.decoding or mask.shape[1] == self.index.shape[1] else torch.gather(mask, 1, self.index)
        if not self.decoding:
            keys = self.key_positions(layer)
            if mask.shape[-1] == keys.shape[1] and mask.shape[-2] == query_len:
                return mask  # nothing removed before this layer, in this call or an earlier one
            return gather_rows(gather_rows(mask, self.index, 2), keys, 3)
        cached = self.cached_positions[layer]
        new = torch.arange(self.prefill_length, mask.shape[-1], device=cached.device)
        keys = torch.cat([cached, new.expand(cached.shape[0], -1)], dim=1)
        return gather_rows(mask, keys, 3)

    def next_turn_priors(self, past_length: int) -> dict[int, Tensor]:
        """Per layer, the positions its cache holds after this prefill and the decode steps up to
        `past_length` (every decoded token is cached by every layer)."""
        priors = {}
        for layer, cached in self.cached_positions.items():
            decoded = torch.arange(self.prefill_length, past_length, device=cached.device)
            priors[layer] = torch.cat([cached, decoded.expand(cached.shape[0], -1)], dim=1)
        return priors
