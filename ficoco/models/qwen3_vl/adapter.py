"""The Qwen3-VL adapter (`Qwen3VLForConditionalGeneration`, and `Qwen3VLMoeForConditionalGeneration`, whose
decoder routes every token to a few experts): Qwen2-VL's adapter and parts (the packed tower's blocks, the cuts,
the prompt shortening, FiCoCo-L in the decoder), on Qwen2-VL's grid order, with DeepStack's features following
whatever a method does to the visual tokens (ficoco.models.qwen3_vl.deepstack).

Everything tower-side reads no DeepStack where a tower has none (`deepstack_mergers` empty): a family whose
tower is Qwen3-VL's without the taps (Qwen3.5) derives from this class and names none.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from torch import Tensor, nn

from ficoco.errors import FicocoError
from ficoco.methods.deepstack import check_layer_input
from ficoco.methods.pixelprune import HALF_NORMALISATION
from ficoco.models import hf_compat as hf
from ficoco.models.patching import Patches
from ficoco.models.qwen2_vl.adapter import Qwen2VLAdapter
from ficoco.models.qwen2_vl.tower_pass import TowerPass
from ficoco.models.qwen3_vl.deepstack import DecoderTaps, DeepStackOrder, TowerTaps

if TYPE_CHECKING:
    from ficoco.models.entry import Entry
    from ficoco.models.handle import Handle

# Methods whose Qwen3-VL run DeepStack's features cannot follow, and why (their refusals name the family too).
FEATURE_MERGES = ("HoliTom merges a video's tokens by the similarity of the very features it merges, and hands "
                  "back no weights, so DeepStack's features cannot be merged as its tokens were")


class Qwen3VLAdapter(Qwen2VLAdapter):
    """Where the method goes in a Qwen3-VL (or Qwen3-VL-MoE) model: Qwen2-VL's adapter with DeepStack kept
    consistent with the visual tokens a method leaves, before the LLM and in the decoder."""

    family_title = "Qwen3-VL"
    order_strategy = DeepStackOrder
    # Qwen3-VL's (and Qwen3.5's) image processor normalises with mean 0.5 and std 0.5, undone as x * 0.5 + 0.5.
    pixel_mean, pixel_std = HALF_NORMALISATION

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        self.tower_taps = TowerTaps(self)

    def deepstack_mergers(self) -> list[tuple[int, nn.Module]]:
        """(tower layer, merger) of every DeepStack tap; none on a tower without DeepStack."""
        return hf.qwen3_vl_deepstack_mergers(self.visual)

    # -- the entry's hooks: Qwen2-VL's, whose one-line refusals name this family -------------------------
    @contextlib.contextmanager
    def _in_family_words(self) -> Iterator[None]:
        try:
            yield
        except FicocoError as exc:
            if "Qwen2-VL" not in str(exc):
                raise
            raise FicocoError(str(exc).replace("Qwen2-VL", self.family_title)) from None

    def enter_forward(self, entry: Entry, call: dict[str, Any]) -> tuple[Tensor | None, bool]:
        with self._in_family_words():
            return super().enter_forward(entry, call)

    def enter_generate(self, entry: Entry, kwargs: dict[str, Any]) -> bool:
        with self._in_family_words():
            return super().enter_generate(entry, kwargs)

    # -- before the LLM ---------------------------------------------------------------------------
    def patch_tower(self, handle: Handle, patches: Patches, spec: Any, schedule: Any) -> None:
        """Qwen2-VL's hook points in the packed tower, with every DeepStack tap's features following the
        method's steps (kept where its tokens are kept, merged with its own weights where they merge)."""
        if spec.pooled_grid and self.tower_taps.taps and not spec.features_follow_places:
            raise FicocoError(f"variant={spec.name}: {spec.title} on {self.family_title}: {FEATURE_MERGES}; run it "
                              "on Qwen2-VL or Qwen2.5-VL")
        super().patch_tower(handle, patches, spec, schedule)
        if self.tower_taps.taps:
            self.tower_taps.install(patches, spec)

    def riding_features(self, tower: TowerPass, images: list[int]) -> Tensor | None:
        return self.tower_taps.riding(images)

    def follow_groups(self, tower: TowerPass, images: list[int], kept_at: Tensor, *, merges: bool | None,
                      features: Tensor | None = None) -> None:
        self.tower_taps.follow(images, kept_at, merges, features)

    # -- in the decoder ----------------------------------------------------------------------------
    def patch_in_layer(self, handle: Handle, patches: Patches, spec: Any, schedule: Any, first: int) -> None:
        """FiCoCo-L's hook point (the base adapter's), with DeepStack's additions sliced to the tokens it keeps
        and its merges run on the features of the taps still to come."""
        from ficoco.models.llm_steps import InLayerPatch

        patch = InLayerPatch(self, handle, spec, schedule, first)
        if self.deepstack_mergers():
            taps = DecoderTaps(self, handle, spec.title)
            patch.step = taps.merge_step(patch.step, spec.merges_by_keys)
            taps.install(patches)
        patch.install(patches)

    def patch_layer_input(self, handle: Handle, patches: Patches, spec: Any, schedule: Any) -> None:
        """The layer-input methods' hook points (the base adapter's), with DeepStack's additions sliced to the
        visual tokens still present."""
        taps = len(self.deepstack_mergers())
        check_layer_input(spec, schedule.removals, taps)
        super().patch_layer_input(handle, patches, spec, schedule)
        if taps:
            DecoderTaps(self, handle, spec.title).install(patches)
