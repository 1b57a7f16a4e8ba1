"""DeepStack kept consistent with the tokens a method leaves (Qwen3-VL).

Qwen3-VL's tower runs the output of every `deepstack_visual_indexes` block through its own merger (one feature
per merge group), and its decoder adds tap i's features to the hidden states at the visual positions after
decoder layer i. A method that removes or merges visual tokens must do the same to those features:

- before the LLM (`TowerTaps`): every tap's output is kept per image beside the tower pass (`carried`, the
  taps side by side in the channels, rows in the pass's group order) and follows every step of the method
  (Qwen2-VL's parts ask `Qwen2VLAdapter.riding_features` before a step and tell `follow_groups` after it): a
  method whose merges are decided from the keys and the attention alone (`MethodSpec.merges_by_keys`: FiCoCo-V,
  ToMe, VisionZip) takes the features through its one step beside the hidden states (in extra channels; FiCoCo-V
  as `reduce_groups`' riding features, folded apart with the same weights), so they are merged with its own
  weights; a step of any other method that only keeps hands on the rows of the
  groups it kept, exactly (one that merges otherwise is refused in one line). A tap after a reducing block sees
  only the kept groups already; the encoder (`DeepStackOrder.encode`) hands the decoder every image's kept
  features per tap.
- in the decoder (`DecoderTaps`): a method that removes tokens at a layer where DeepStack still adds (layers
  0..taps-1) gets the mask and the features sliced to the visual tokens still present (`LanguageState.index`);
  the features of the taps still to come ride through FiCoCo-L's step (it decides from the attention alone),
  so merged tokens carry merged features. A token a method adds (SparseVLM's recycled clusters) where DeepStack
  still adds is refused in one line: the method does not say which features they stand for.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from ficoco.errors import FicocoError
from ficoco.models import hf_compat as hf
from ficoco.models.patching import Patches, forward_of, gather_rows
from ficoco.models.qwen2_vl.order import GridOrder
from ficoco.models.qwen2_vl.tower_pass import TowerPass

if TYPE_CHECKING:
    from ficoco.models.handle import Handle
    from ficoco.models.qwen3_vl.adapter import Qwen3VLAdapter


class TowerTaps:
    """The DeepStack features of one tower pass, per image, following the method's steps before the LLM."""

    def __init__(self, adapter: Qwen3VLAdapter) -> None:
        self.adapter = adapter
        self.taps = adapter.deepstack_mergers()
        self.rides = False  # whether the method's merges are decided from the keys alone (its spec says so)
        self.title = ""
        self.width = 0  # channels of one tap's features (out_hidden_size)
        # Per image of the current pass: the taps that ran so far side by side, (groups now, taps x width).
        self.carried: list[Tensor | None] = []

    def start(self, images: int) -> None:
        self.carried = [None] * images

    def install(self, patches: Patches, spec: Any) -> None:
        """Record every tap's merger output per image while a tower pass runs under the method of `spec`."""
        adapter = self.adapter
        self.rides, self.title = spec.merges_by_keys, spec.title
        for _, merger in self.taps:
            original = forward_of(merger)

            def forward(hidden: Tensor, *args: Any, _original: Callable[..., Tensor] = original, **kwargs: Any
                        ) -> Tensor:
                out = _original(hidden, *args, **kwargs)
                tower = adapter.tower_pass
                if tower is not None:
                    self.width = out.shape[-1]
                    pieces = out.split([len(groups) for groups in tower.kept_groups])
                    self.carried = [piece if held is None else torch.cat([held, piece], dim=-1)
                                    for held, piece in zip(self.carried, pieces, strict=True)]
                return out

            patches.set(merger, "forward", forward)
        patches.on_undo(lambda: setattr(self, "carried", []))

    def riding(self, images: list[int]) -> Tensor | None:
        """(n, G, C) the features of `images` that ride through a step whose merges are decided from the keys
        alone (None: no tap ran yet, or the method's step may read what it merges: they follow its kept tokens)."""
        if not self.rides or not self.carried or self.carried[images[0]] is None:
            return None
        return torch.stack([self.carried[i] for i in images])  # type: ignore[misc]

    def follow(self, images: list[int], kept_at: Tensor, merges: bool | None, features: Tensor | None) -> None:
        """Apply one step of the method to the features the taps gave so far (see the module's docstring)."""
        if not self.carried or self.carried[images[0]] is None:
            return  # no tap ran before this step: the later taps see its result
        if features is None:
            if merges is None:
                merges = bool((kept_at < 0).any())
            if merges:
                raise FicocoError(f"{self.title} merges visual tokens before the LLM by what it merges (not by the "
                                  f"keys alone): {self.adapter.family_title}'s DeepStack features cannot be merged "
                                  "as its tokens were; use a method that keeps tokens, or one that merges by the keys")
            held = torch.stack([self.carried[i] for i in images])  # type: ignore[misc]
            features = gather_rows(held, kept_at.to(held.device), 1)
        for b, image in enumerate(images):
            self.carried[image] = features[b]

    def per_tap(self, counts: list[int]) -> list[tuple[Tensor, ...]]:
        """Every tap's features split per image (the layout of transformers' `deepstack_features`)."""
        if any(held is None or held.shape[0] != count for held, count in zip(self.carried, counts, strict=True)):
            raise RuntimeError("the DeepStack taps did not follow every image's kept groups")
        width = self.width
        return [tuple(held[:, t * width:(t + 1) * width] for held in self.carried)  # type: ignore[index]
                for t in range(len(self.taps))]


class DeepStackOrder(GridOrder):
    """Qwen2-VL's grid order (Qwen3-VL's tower has no windows) whose passes carry DeepStack's features."""

    adapter: Qwen3VLAdapter

    def start_pass(self, grid_thw: Tensor) -> TowerPass:
        tower = super().start_pass(grid_thw)
        self.adapter.tower_taps.start(len(tower.kept_groups))
        return tower

    def join_slices(self, tower: TowerPass, pieces: tuple[Tensor, ...], frames: list[int]) -> tuple[Tensor, ...]:
        """Qwen2-VL's join of every video's slices, every tap's features joined alike (the rows of the features)."""
        taps = self.adapter.tower_taps
        if taps.taps and taps.carried:
            joined, at = [], 0
            for t in frames:
                held = taps.carried[at:at + t]
                joined.append(None if any(h is None for h in held) else torch.cat(held))  # type: ignore[arg-type]
                at += t
            taps.carried = joined
        return super().join_slices(tower, pieces, frames)

    def encode(self, pixel_values: Tensor, image_grid_thw: Tensor, **kwargs: Any) -> Any:
        """The (reduced) tower's output split per item by the groups it kept, its DeepStack features too."""
        out = super().encode(pixel_values, image_grid_thw, **kwargs)
        taps = self.adapter.tower_taps
        if taps.taps:
            counts = [len(groups) for groups in self.adapter.tower_pass.kept_groups]  # type: ignore[union-attr]
            setattr(out, hf.DEEPSTACK_FEATURES_FIELD, taps.per_tap(counts))
        return out


class DecoderTaps:
    """DeepStack's additions in the decoder, sliced (and merged) to the visual tokens a method in the decoder
    leaves; one prefill at a time (the text model's forward hands the features, its layers add them)."""

    def __init__(self, adapter: Qwen3VLAdapter, handle: Handle, title: str) -> None:
        self.adapter, self.handle, self.title = adapter, handle, title
        self.mask: Tensor | None = None  # (B, T) this prefill's visual positions
        self.features: Tensor | None = None  # (B, T_now, C): the taps still to add, side by side
        self.first = 0  # the tap the first channels of `features` belong to
        self.width = 0
        self.added = 0  # taps added so far in this prefill
        self.merged = False  # `features` is laid out as the current (merged) sequence, not as the prompt

    def install(self, patches: Patches) -> None:
        text = hf.language_model(self.adapter.model)
        original_forward = forward_of(text)
        original_add = getattr(text, hf.DEEPSTACK_ADD)

        def forward(*args: Any, **kwargs: Any) -> Any:
            self._begin(kwargs.get(hf.DEEPSTACK_MASK_KEYWORD), kwargs.get(hf.DEEPSTACK_EMBEDS_KEYWORD))
            try:
                return original_forward(*args, **kwargs)
            finally:
                self.mask, self.features = None, None

        def add(hidden_states: Tensor, visual_pos_masks: Tensor, visual_embeds: Tensor) -> Tensor:
            tap, self.added = self.added, self.added + 1
            if self.features is None or (not self.merged and hidden_states.shape[1] == visual_pos_masks.shape[1]):
                return original_add(hidden_states, visual_pos_masks, visual_embeds)
            mask, features = self._now(hidden_states, tap)
            return original_add(hidden_states, mask, features[..., :self.width][mask])

        patches.set(text, "forward", forward)
        patches.set(text, hf.DEEPSTACK_ADD, add)

    def _begin(self, mask: Tensor | None, embeds: list[Tensor] | None) -> None:
        self.added, self.first, self.merged = 0, 0, False
        self.mask, self.features = None, None
        if mask is None or not embeds:
            return
        self.mask = mask
        self.width = embeds[0].shape[-1]
        side_by_side = torch.cat(list(embeds), dim=-1)
        dense = side_by_side.new_zeros(*mask.shape, side_by_side.shape[-1])
        self.features = dense.masked_scatter(mask.unsqueeze(-1).to(dense.device), side_by_side)

    def _now(self, hidden: Tensor, tap: int) -> tuple[Tensor, Tensor]:
        """(B, T_now) visual positions and (B, T_now, C) features of taps `tap`.. on the current sequence."""
        state = self.handle.language_state
        features = self.features
        assert features is not None and self.mask is not None and state is not None
        start = (tap - self.first) * self.width
        if self.merged:
            features = features[..., start:]
        else:
            index = state.index.to(features.device)
            added = getattr(state, "added", None)
            if added is not None and bool(added.any()):
                raise FicocoError(f"{self.title} on {self.adapter.family_title} adds tokens at a layer where DeepStack "
                                  f"still adds the tower's features (decoder layers 0..{self._taps() - 1}) and says "
                                  "not which features they stand for: give its steps layers from "
                                  f"{self._taps()} on")
            features = gather_rows(features[..., start:], index, 1)
        rows = state.visual_rows.to(features.device)
        mask = torch.zeros(hidden.shape[:2], dtype=torch.bool, device=features.device).scatter(
            1, rows, torch.ones_like(rows, dtype=torch.bool))
        if features.shape[1] != hidden.shape[1]:
            raise RuntimeError(f"DeepStack's features hold {features.shape[1]} rows for {hidden.shape[1]} tokens")
        return mask, features

    def _taps(self) -> int:
        return len(self.adapter.deepstack_mergers())

    def merge_step(self, step: Callable[..., Any], rides: bool) -> Callable[..., Any]:
        """An in-layer step (FiCoCo-L's `layer_step`) whose merges the features of the taps still to come follow:
        they ride with the hidden states through the step (`rides`: its merges are decided from the attention
        alone), in the sequence it reduces; a step that merges otherwise where DeepStack still adds is refused."""
        def merged_step(inputs: Any, settings: Any) -> Any:
            if self.features is None or self.added >= self._taps():
                return step(inputs, settings)
            state = self.handle.language_state
            start = (self.added - self.first) * self.width
            features = self.features[..., start:]
            if not self.merged:
                features = gather_rows(features, state.index.to(features.device), 1)
            if not rides:
                red = step(inputs, settings)
                if getattr(red, "merge_target", None) is not None:
                    raise FicocoError(f"{self.title} merges visual tokens where {self.adapter.family_title}'s "
                                      "DeepStack still adds the tower's features, and not by the attention alone: "
                                      f"they cannot be merged as its tokens were; give its layers from "
                                      f"{self._taps()} on")
                self.features, self.first, self.merged = gather_rows(features, red.kept_positions, 1), self.added, True
                return red
            width = inputs.hidden.shape[-1]
            riding = torch.cat([inputs.hidden, features.to(inputs.hidden)], dim=-1)
            red = step(replace(inputs, hidden=riding), settings)
            self.features, self.first, self.merged = red.hidden[..., width:], self.added, True
            return replace(red, hidden=red.hidden[..., :width])

        return merged_step
