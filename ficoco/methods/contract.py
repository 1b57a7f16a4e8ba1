"""The contract between a method's tensor module and the model adapters, as `typing.Protocol`s.

A spec names its module (`MethodSpec.module`: its folder's ``ops.py``); the adapters import it on use
(`MethodSpec.load()`) and call the functions its placement needs, through `Handle.run_method`:

- a method at the input of decoder layers (``placement="layer_input"``: FastV, PDrop, SparseVLM,
  DART, HoliTom's inner merge) is a `LayerInputModule`: ``step(StepInput, settings) -> Reduced``
  at every step, ``prepare(embeds, visual_start, num_visual)`` once per prefill when the entry
  needs the input embeddings (SparseVLM's raters; `PreparesModule`), and optionally
  ``several_images(settings, images)`` to rescale per-image settings (DART's pivots);
- a method inside decoder layers (``acts_at="llm_layer"``, ``placement="in_layer"``: FiCoCo-L) is an
  `InLayerModule`: ``layer_step(InLayerInput, settings)`` returns a reduction with ``hidden``,
  ``kept_positions``, ``discarded_positions`` (and ``merge_target``);
- a method before the LLM (in tower layers, at the tower's output or after the projector: FiCoCo-V,
  ToMe, VisionZip, FasterVLM, ...; at the tower's input, from the pixels: PixelPrune) is a `TowerModule`:
  ``tower_step(TowerInput, settings) -> TowerOutput``;
  Qwen2-VL's packed tower runs an in-layer method on whole merge groups through ``reduce_groups`` where
  the module offers it (FiCoCo-V; `GroupsModule`).

`contract_of(spec)` says which protocol a module must meet; tests check every entry's module
against it. Importing this module imports no torch (the types are for type checkers only).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, runtime_checkable

from ficoco.errors import FicocoError

if TYPE_CHECKING:
    from torch import Tensor

    from ficoco.methods.base import MethodSpec
    from ficoco.methods.inputs import InLayerInput, Reduced, StepInput, TowerInput, TowerOutput


@runtime_checkable
class LayerInputModule(Protocol):
    """A method run at the input of decoder layers (`ficoco.models.llm_steps.LayerInputPatch`)."""

    def step(self, inputs: StepInput, settings: Mapping[str, Any]) -> Reduced:
        """Remove (or merge) the step's visual tokens of every sample: ``inputs.keep`` stay."""
        ...


@runtime_checkable
class PreparesModule(LayerInputModule, Protocol):
    """A layer-input method that reads the LLM's input embeddings once per prefill (its entry needs
    ``input_embeddings``): `prepare`'s result reaches every step as ``StepInput.prepared``."""

    def prepare(self, embeds: Tensor, visual_start: Tensor, num_visual: int) -> Tensor:
        """What the steps need from the input embeddings (SparseVLM: the rater text tokens)."""
        ...


@runtime_checkable
class InLayerModule(Protocol):
    """A method run inside decoder layers, after attention and before the MLP
    (`ficoco.models.llm_steps.InLayerPatch`)."""

    def layer_step(self, inputs: InLayerInput, settings: Mapping[str, Any]) -> Any:
        """One layer's reduction: ``hidden``, ``kept_positions``, ``discarded_positions``, ``merge_target``."""
        ...


@runtime_checkable
class TowerModule(Protocol):
    """A method run before the LLM: in tower layers, at the tower's output or after the projector
    (`ficoco.models.vision_steps.TowerPatch`, Qwen2-VL's packed tower)."""

    def tower_step(self, inputs: TowerInput, settings: Mapping[str, Any]) -> TowerOutput:
        """Reduce a batch of tower items (patches, [CLS] first where the tower has one)."""
        ...


@runtime_checkable
class GroupsModule(TowerModule, Protocol):
    """An in-layer tower method that also reduces whole merge groups in Qwen2-VL's packed tower."""

    def reduce_groups(self, hidden: Tensor, attn: Tensor, keys: Tensor, r: int, group_index: Tensor,
                      group_grid: tuple[int, int], **settings: Any) -> Any:
        """Remove `r` merge groups of `merge` consecutive patches; ``riding=`` (B, G, C) per-group features (Qwen3-VL's
        DeepStack taps) come back folded with the groups' weights as the result's ``riding``."""
        ...


MethodModule = LayerInputModule | InLayerModule | TowerModule


def contract_of(spec: MethodSpec) -> tuple[type, ...]:
    """The protocols `spec`'s module must meet, by where the entry acts (its inner part's apart)."""
    if spec.placement == "layer_input":
        return (PreparesModule if spec.probes.input_embeddings else LayerInputModule,)
    if spec.acts_at == "llm_layer":
        return (InLayerModule,)
    return (TowerModule,)


ModuleT = TypeVar("ModuleT")


def load_module(spec: MethodSpec, protocol: type[ModuleT]) -> ModuleT:
    """`spec`'s tensor module (imports torch), checked against `protocol`: a module that lacks a function
    the adapter calls is refused in one line naming it, before anything is patched."""
    module = spec.load()
    if not isinstance(module, protocol):
        missing = [name for name in ("step", "prepare", "layer_step", "tower_step", "reduce_groups")
                   if hasattr(protocol, name) and not callable(getattr(module, name, None))]
        raise FicocoError(f"variant={spec.name}: its module {spec.module} offers no {', '.join(missing)}, which "
                          f"the model adapters call for a method at {spec.placement} (ficoco.methods.contract."
                          f"{protocol.__name__})")
    return module
