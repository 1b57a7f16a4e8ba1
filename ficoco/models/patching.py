"""Reversible attribute patches and the per-forward state the patched layers share."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

_MISSING = object()


class Patches:
    """Instance attributes set on modules, restored exactly (in reverse order) by `undo`."""

    def __init__(self) -> None:
        self._undo: list[Callable[[], None]] = []

    def set(self, obj: Any, name: str, value: Any) -> None:
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


def gather_rows(x: Tensor | None, index: Tensor, dim: int) -> Tensor | None:
    """x[b, ..., index[b], ...] along `dim` (batch 0), broadcasting a batch-1 `x` first."""
    if x is None:
        return None
    batch, kept = index.shape
    if x.shape[0] != batch:
        x = x.expand(batch, *x.shape[1:])
    view = [batch] + [1] * (x.dim() - 1)
    view[dim] = kept
    sizes = list(x.shape)
    sizes[dim] = kept
    return torch.gather(x, dim, index.view(view).expand(sizes))


@dataclass
class LanguageState:
    """FiCoCo-L bookkeeping for one prefill and the decode steps that follow it.

    `index` holds, per sample, the original position of every token still in the sequence;
    each reducing layer shrinks it. Layers slice the mask and rotary tables with it, and each
    layer remembers which original positions its KV cache holds, for decoding.
    """

    index: Tensor  # (B, T_now) original positions
    visual_start: Tensor  # (B,) start of the visual span (the prefix is never reduced)
    visual_positions: Tensor  # (B, N_now) original positions of the visual tokens still present
    suffix_mask: Tensor  # (B, T_now) real text tokens after the visual span
    prefill_length: int
    # Host copies of what the reduction needs to know about the span, so that no reducing
    # layer asks the device (each question would synchronise it): the earliest row a suffix
    # token can be in (min visual start + N_now).
    first_suffix_row: int = 0
    # (B, N_now) visual tokens the reduction must keep (LLaVA-NeXT's row newlines); None: none
    protected: Tensor | None = None
    max_protected: int = 0  # the most protected tokens of any sample (constant: never removed)
    cached_positions: dict[int, Tensor] = field(default_factory=dict)
    cache: Any = None
    decoding: bool = False

    @property
    def num_visual(self) -> int:
        return self.visual_positions.shape[1]

    def keep(self, kept_positions: Tensor, kept_visual: Tensor) -> None:
        """Apply one reduction: `kept_positions` index the current sequence."""
        self.first_suffix_row -= self.visual_positions.shape[1] - kept_visual.shape[1]
        self.index = torch.gather(self.index, 1, kept_positions)
        self.suffix_mask = torch.gather(self.suffix_mask, 1, kept_positions)
        self.visual_positions = torch.gather(self.visual_positions, 1, kept_visual)
        if self.protected is not None:
            self.protected = torch.gather(self.protected, 1, kept_visual)

    def slice_mask(self, mask: Tensor | None, layer: int, query_len: int) -> Tensor | None:
        """The layer's view of a mask built for the original sequence."""
        if mask is None:
            return None
        if not self.decoding:
            if mask.shape[-1] == self.index.shape[1] and mask.shape[-2] == query_len:
                return mask
            return gather_rows(gather_rows(mask, self.index, 2), self.index, 3)
        cached = self.cached_positions[layer]
        new = torch.arange(self.prefill_length, mask.shape[-1], device=cached.device)
        keys = torch.cat([cached, new.expand(cached.shape[0], -1)], dim=1)
        return gather_rows(mask, keys, 3)
