"""DeepStack kept consistent with the tokens a method leaves (Qwen3-VL).

Qwen3-VL's tower runs the output of every `deepstack_visual_indexes` block through its own merger (one feature
per merge group), and its decoder adds tap i's features to the hidden states at the visual positions after
decoder layer i. A method that removes or merges visual tokens must do the same to those features:

- before the LLM (`TowerTaps`): every tap's output is kept per image beside the tower pass (`carried`, the
  taps side by side in the channels, rows in the pass's group order) and follows every step of the method
  (`follow`, called by Qwen2-VL's parts through `Qwen2VLAdapter.follow_groups`): a step that only keeps hands
  on the rows of the groups it kept, exactly; a step that merges (FiCoCo-V, ToMe, VisionZip's contextual
  tokens) runs again on the features, with the same keys and attention, so they are folded with the weights the
  patches were folded with (each of those methods decides from the keys and attention alone, never from the
  features it merges). A tap after a reducing block sees only the kept groups already; the encoder
  (`DeepStackOrder.encode`) hands the decoder every image's kept features per tap.
- in the decoder (`DecoderTaps`): a method that removes tokens at a layer where DeepStack still adds (layers
  0..taps-1) gets the mask and the features sliced to the visual tokens still present (`LanguageState.index`);
  FiCoCo-L's merges run again on the features of the taps still to come (it decides from the attention alone),
  so merged tokens carry merged features. A token a method adds (SparseVLM's recycled clusters) where DeepStack
  still adds is refused in one line: the method does not say which features it stands for.
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
        self.width = 0  # channels of one tap's features (out_hidden_size)
        # Per image of the current pass: the taps that ran so far side by side, (groups now, taps x width).
        self.carried: list[Tensor | None] = []

    def start(self, images: int) -> None:
        self.carried = [None] * images

    def install(self, patches: Patches) -> None:
        """Record every tap's merger output per image while a tower pass runs under a method."""
        adapter = self.adapter
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

    def follow(self, tower: TowerPass, images: list[int], kept_at: Tensor,
               rerun: Callable[[Tensor], Tensor] | None, merges: bool | None) -> None:
        """Apply one step of the method to the features the taps gave so far (see the module's docstring)."""
        if not self.carried or self.carried[images[0]] is None:
            return  # no tap ran before this step: the later taps see its result
        features = torch.stack([self.carried[i] for i in images])  # type: ignore[misc]
        if merges is None:
            merges = bool((kept_at < 0).any())
        if merges and rerun is not None:
            followed = rerun(features)  # type: ignore[misc]
        else:
            if bool((kept_at < 0).any()):
                raise FicocoError("a method step hands on tokens that continue no merge group and says not how they "
                                  "were made: Qwen3-VL's DeepStack features cannot follow them")
            followed = gather_rows(features, kept_at.to(features.device), 1)
        for b, image in enumerate(images):
            self.carried[image] = followed[b]

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

    def encode(self, pixel_values: Tensor, image_grid_thw: Tensor, **kwargs: Any) -> Any:
        """The (reduced) tower's output split per image by the groups it kept, its DeepStack features too."""
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

    def merge_step(self, step: Callable[..., Any]) -> Callable[..., Any]:
        """FiCoCo-L's `layer_step`, whose merges the features of the taps still to come follow: the same step
        run on them (it decides from the attention alone) in the sequence it reduces."""
        def merged_step(inputs: Any, settings: Any) -> Any:
            red = step(inputs, settings)
            if self.features is None or self.added >= self._taps():
                return red
            state = self.handle.language_state
            start = (self.added - self.first) * self.width
            features = self.features[..., start:]
            if not self.merged:
                features = gather_rows(features, state.index.to(features.device), 1)
            followed = step(replace(inputs, hidden=features.to(inputs.hidden.device)), settings)
            self.features, self.first, self.merged = followed.hidden, self.added, True
            return red

        return merged_step
