"""The vision tower's and the projector's hook points for every method that acts before the LLM
(ToMe, VisionZip, FasterVLM, PruMerge+, and any later one): one implementation, read from the
method's registry entry, for the families whose tower is a stack of CLIP encoder layers.

What a method asks for (its `MethodSpec.needs` of a ``vision`` layer, read through the spec's one
probe plan, `MethodSpec.probes`) decides what is probed, and only there:

- ``keys`` / ``attention_rows`` / ``query_key`` of ``vision L`` (the layer of each of its steps),
  ``vision last`` (the tower's last layer) or ``vision named`` (the layer a setting of the method
  names, handed to its steps as `TowerInput.named`): that layer's attention module is routed through
  `tower_rows_attention`, which keeps the key states (heads split) and, for ``cls`` rows, the
  query of [CLS], then calls the module's own implementation (SDPA stays on). The method computes
  the one [CLS] row it needs from them (a tower attends without a mask, so the row is exact). For
  ``attention_rows`` of ``all`` or ``item`` rows (FiCoCo-V, HoliTom, HiPrune; a CLIP or SigLIP tower
  has no windows, so the two are one read) it also keeps the reads of the layer's
  attention (ficoco.methods.reads.ops): the column means and the rows the method asks for, computed
  from the layer's queries and keys beside its own kernel.

Where the method's `tower_step` runs follows the step's placement:

- ``in_layer`` (ToMe): the layer is re-composed from its own submodules so that the step sits
  between the attention residual and the MLP; what the step carries (token sizes, original
  positions, an additive attention bias for later layers) lives in the forward's `TowerState`,
  never on the modules, and every later tower layer adds the bias to its attention mask.
- ``layer_input`` (MustDrop's merge of layer 0's output): on a tower layer's input, before the layer runs, so
  that it and every later layer run on what the step leaves; what it carries lives in `TowerState` as above.
- ``tower_output`` (VisionZip, PruMerge+): on the projector's input, the patches of the layer it
  reads ([CLS] dropped), before the projector maps them.
- ``after_projector`` (FasterVLM): on the projector's output; on an AnyRes image of a method that cuts it
  whole (G-Prune: `MethodSpec.anyres_grid`), in the adapter's packing (`cut_after_packing`), which sees the
  base view and the crop grid as packed.

The method's own matrix work runs through `Handle.run_method` (a plain call, or a counter's module
during `flops --verify`), keyed ``("vision", layer)`` or ``("projector", None)`` by where it runs.
The visual tokens each item hands the LLM are left in `Handle.measured_tokens_per_item`; the entry
wrapper shortens the prompt's image spans to them (ficoco.models.llava).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from ficoco.accounting.schedule import Removal, Schedule
from ficoco.errors import FicocoError
from ficoco.methods.base import MethodSpec
from ficoco.methods.contract import TowerModule, load_module
from ficoco.methods.inputs import TowerInput, TowerLayerProbe, TowerOutput
from ficoco.methods.needs import TowerProbe
from ficoco.methods.reads import DEFAULT_ATTENTION_SCORES
from ficoco.methods.reads.ops import AttentionReads, ReadRunner
from ficoco.models import hf_compat as hf
from ficoco.models.attention import attend, own_attention, route_attention
from ficoco.models.patching import Patches, follow_device, forward_of, method_settings

if TYPE_CHECKING:
    from ficoco.models.handle import Handle

TOWER_ROWS_IMPLEMENTATION = "ficoco_tower_rows"


@dataclass
class TowerSlot:
    """What one tower attention module is asked to keep in a forward, and what it left."""

    want_cls: bool = False
    # The layer's head-mean probabilities of every query (FiCoCo-V, HoliTom): reads of the attention the module's
    # own kernel ran, computed from its queries and keys when the method asks (ficoco.methods.reads.ops).
    want_probabilities: bool = False
    runner: ReadRunner | None = None  # how a read runs: in the handle's "probe" span
    scores: str = DEFAULT_ATTENTION_SCORES  # the rule the reads compute scores by
    armed: bool = False
    keys: Tensor | None = None  # (items, H, T, d)
    cls_query: Tensor | None = None  # (items, H, d)
    scale: float | None = None
    probabilities: AttentionReads | None = None  # reads of the (items, T, T) head-mean probabilities

    def take(self) -> tuple[Tensor | None, Tensor | None, float | None, AttentionReads | None]:
        taken = self.keys, self.cls_query, self.scale, self.probabilities
        self.keys = self.cls_query = self.probabilities = None
        return taken


def tower_rows_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor,
                         attention_mask: Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                         is_causal: bool | None = None, **kwargs: Any) -> tuple[Tensor, Any]:
    """The module's own attention, after keeping its keys (and the [CLS] query, and the reads of its
    attention) for a method."""
    slot: TowerSlot = module._ficoco_tower  # type: ignore[assignment]
    if slot.armed:
        slot.keys = key
        slot.cls_query = query[:, :, 0] if slot.want_cls else None
        slot.scale = scaling
        if slot.want_probabilities:
            result, slot.probabilities = attend(module, module._ficoco_tower_config, query, key, value,
                                                attention_mask, dropout, scaling, is_causal, slot.scores,
                                                slot.runner, **kwargs)
            return result
    return own_attention(module, module._ficoco_tower_config, query, key, value, attention_mask, dropout=dropout,
                         scaling=scaling, is_causal=is_causal, **kwargs)


hf.register_attention(TOWER_ROWS_IMPLEMENTATION, tower_rows_attention)


def install_tower_rows(attention: nn.Module, slot: TowerSlot, patches: Patches) -> None:
    """Route one tower attention module through `tower_rows_attention` (its own config copy)."""
    route_attention(attention, TOWER_ROWS_IMPLEMENTATION, patches, "_ficoco_tower_config", _ficoco_tower=slot)


@dataclass
class TowerState:
    """One tower forward: what the in-layer steps carry, and what the probes left for later steps."""

    size: Tensor | None = None
    positions: Tensor | None = None
    bias: Tensor | None = None
    # (items, 1, D) [CLS] at the output of the layer a tower-output cut reads, for a cut that hands it on.
    cls: Tensor | None = None
    probes: dict[int, tuple[Tensor | None, Tensor | None, float | None, Tensor | None]] = field(default_factory=dict)


def complement(kept: Tensor, total: int, width: int | None = None) -> Tensor:
    """(items, width) ascending indices in 0..total-1 not in `kept` (entries -1 in `kept` are
    ignored), padded with -1 where an item misses fewer; `width` None: the most any item misses
    (one host read)."""
    valid = kept >= 0
    flags = torch.zeros(kept.shape[0], total + 1, dtype=torch.int8, device=kept.device)
    flags = flags.scatter(1, torch.where(valid, kept, total), 1)[:, :total]
    kept_counts = flags.sum(dim=1)
    if width is None:
        width = total - int(kept_counts.min())
    order = torch.sort(flags, dim=1, stable=True).indices[:, :width]
    missing = torch.arange(width, device=kept.device).unsqueeze(0) < (total - kept_counts).unsqueeze(1)
    return torch.where(missing, order, torch.full_like(order, -1))


class TowerPatch:
    """Patches a CLIP tower and the projector for one vision-side method: probes, the steps at their
    placements, and the proportional-attention bias of every layer after an in-layer step."""

    def __init__(self, adapter: Any, handle: Handle, spec: MethodSpec, schedule: Schedule) -> None:
        self.adapter, self.handle, self.spec = adapter, handle, spec
        self.module: TowerModule = load_module(spec, TowerModule)
        self.settings = method_settings(handle, spec, schedule)
        # A tower without [CLS] (SigLIP): positions are patch indices, and the methods score with the
        # equivalent token in place of the [CLS] row.
        self.has_cls = bool(getattr(adapter, "tower_has_cls", True))
        removals = [r for r in schedule.removals if r.stage == "vision"]
        self.in_layer: dict[int, Removal] = {r.layer: r for r in removals if r.where == "in_layer"}
        self.at_input: dict[int, Removal] = {r.layer: r for r in removals if r.where == "layer_input"}
        self.cuts: dict[str, Removal] = {r.where: r for r in removals if r.where not in ("in_layer", "layer_input")}
        last = len(adapter.vision_layers) - 1
        step_layers = sorted({r.layer for r in removals})
        # tower layer -> (whether the [CLS] query is wanted, whether every row's probabilities are), from the
        # spec's one probe plan (ficoco.methods.needs): the layers of its steps and/or the tower's last layer.
        plan = spec.probes
        wanted: dict[int, TowerProbe] = {}
        for probe, layers in ((plan.step_tower_layers, step_layers), (plan.last_tower_layer, [last])):
            if probe is not None:
                for layer in layers:
                    wanted[layer] = merged_probe(spec, layer, probe, wanted.get(layer))
        # The probe a cut reads: the one layer probed for it (the layer the projector reads, or the last).
        self.cut_probe = next(iter(sorted(set(wanted) - set(self.in_layer))), None)
        # The tower layers the method's settings name (``vision named``), probed too where a step runs: setting ->
        # layer; their probes reach the steps as `TowerInput.named`.
        self.named: dict[str, int] = plan.named_layers(self.settings, len(adapter.vision_layers)) if removals else {}
        for name, probe in plan.named_tower_layers:
            if name in self.named:
                layer = self.named[name]
                wanted[layer] = merged_probe(spec, layer, probe, wanted.get(layer))
        self.probes: dict[int, tuple[bool, bool]] = {
            layer: (probe.cls_query and self.has_cls, probe.probabilities) for layer, probe in wanted.items()}
        # A method that reads the instruction (CDPruner): the prompt's text embeddings at its cut.
        self.wants_text = plan.input_embeddings
        self.slots: dict[int, TowerSlot] = {}
        # The layer whose [CLS] a tower-output cut may hand on with its tokens (VisionZip's official layout): the
        # layer the projector reads, when the tower has [CLS] and the model does not pass [CLS] to the LLM itself.
        cut = self.cuts.get("tower_output")
        self.cls_layer = cut.layer if cut is not None and self.has_cls and not adapter.projector_keeps_cls else None
        # The after-projector cut of this forward, left to the adapter to run after its pooling
        # (LLaVA-OneVision's video frames, `cut_after_pooling`), with the tower pass it reads.
        self.deferred: tuple[Removal, TowerState] | None = None

    def install(self, patches: Patches) -> None:
        layers = self.adapter.vision_layers
        for layer, (want_cls, want_probabilities) in self.probes.items():
            slot = TowerSlot(want_cls=want_cls, want_probabilities=want_probabilities,
                             runner=self.handle.read_runner(("vision", layer)), scores=self.handle.attention_scores)
            install_tower_rows(hf.layer_parts(layers[layer], hf.CLIP_LAYER).attention, slot, patches)
            self.slots[layer] = slot
        for index, layer in enumerate(layers):
            patches.set(layer, "forward", self._forward(index, layer, forward_of(layer)))
        # The projector always: it measures what every item hands the LLM (and runs the cuts).
        projector = self.adapter.stage_modules()["projector"]
        patches.set(projector, "forward", self._projector(forward_of(projector)))

    # -- tower layers -----------------------------------------------------------------------
    def _forward(self, index: int, layer: nn.Module, original: Callable[..., Tensor]) -> Callable[..., Tensor]:
        parts = hf.layer_parts(layer, hf.CLIP_LAYER)

        def forward(hidden_states: Tensor, attention_mask: Tensor | None = None, **kwargs: Any) -> Tensor:
            if index == 0:  # a new tower pass (each image call runs the tower once)
                self.handle.tower_state = TowerState()
                self.handle.measured_tokens_per_item = None
            state = self.handle.tower_state
            if state is None:  # a tower call that did not start at layer 0 is not ours to change
                return original(hidden_states, attention_mask, **kwargs)
            follow_device(state, hidden_states.device)  # a tower split across devices (device maps)
            entering = self.at_input.get(index)
            if entering is not None:  # a step at this layer's input: the layer runs on what it leaves
                hidden_states = self._at_input(index, entering, state, hidden_states)
            if state.bias is not None:
                bias = state.bias.to(hidden_states.dtype)
                attention_mask = bias if attention_mask is None else attention_mask + bias
            slot = self.slots.get(index)
            removal = self.in_layer.get(index)
            if slot is not None:
                slot.armed = True
            try:
                if removal is None:
                    output = original(hidden_states, attention_mask, **kwargs)
                    if index == self.cls_layer:  # the layer the projector reads: its [CLS], for the cut
                        state.cls = output[:, :1]
                    return output
                residual = hidden_states
                attn_out, _ = parts.attention(hidden_states=parts.input_norm(hidden_states),
                                              attention_mask=attention_mask, **kwargs)
            finally:
                if slot is not None:
                    slot.armed = False
                    state.probes[index] = slot.take()
            hidden = residual + attn_out
            named = self._named(state, index)
            keys, query, scale, probabilities = state.probes.pop(index, (None, None, None, None))
            inputs = TowerInput(hidden=hidden, has_cls=self.has_cls, remove=removal.remove, added=removal.added,
                                keys=keys, cls_query=query, scale=scale, size=state.size, positions=state.positions,
                                attention=probabilities, grid_hw=self.adapter.grid_hw, named=named,
                                placement="in_layer")
            before = state.positions
            out: TowerOutput = self.handle.run_method(("vision", index), self.module.tower_step, inputs,
                                                      self.settings)
            state.size, state.positions, state.bias = out.size, out.positions, out.attention_bias
            patches = self.adapter.patches
            offset = int(self.has_cls)
            present = before[:, offset:] - offset if before is not None else \
                torch.arange(patches, device=hidden.device).expand(hidden.shape[0], -1)
            discarded = out.discarded if out.discarded is not None else \
                _gone(present, out.kept, patches, removal.remove)
            self.handle.record("vision", index, kept=out.kept, discarded=discarded, merged_into=out.merged_into)
            hidden = out.hidden
            return hidden + parts.mlp(parts.post_norm(hidden))

        return forward

    def _at_input(self, index: int, removal: Removal, state: TowerState, hidden: Tensor) -> Tensor:
        """The method's step at tower layer `index`'s input (the previous layer's output: MustDrop's merge of layer
        0's output), before the layer runs; what it carries goes on in `state`. A method whose counts are the
        input's own (`MethodSpec.content_counts`) may remove any count, the same in every item (measured);
        any other removes its schedule's."""
        named = self._named(state, index)
        inputs = TowerInput(hidden=hidden, has_cls=self.has_cls, remove=removal.remove, added=removal.added,
                            size=state.size, positions=state.positions, grid_hw=self.adapter.grid_hw, named=named,
                            placement="layer_input")
        before = state.positions
        out: TowerOutput = self.handle.run_method(("vision", index), self.module.tower_step, inputs, self.settings)
        removed = hidden.shape[1] - out.hidden.shape[1] + removal.added
        if removed != removal.remove and not self.spec.content_counts:
            raise FicocoError(f"{self.spec.title} at tower layer {index}'s input left {out.hidden.shape[1]} tokens "
                              f"where its schedule plans {hidden.shape[1] - removal.remove + removal.added}")
        self._measured("vision", index, "layer_input", removed)
        state.size, state.positions, state.bias = out.size, out.positions, out.attention_bias
        patches = self.adapter.patches
        offset = int(self.has_cls)
        present = before[:, offset:] - offset if before is not None else \
            torch.arange(patches, device=hidden.device).expand(hidden.shape[0], -1)
        discarded = out.discarded if out.discarded is not None else _gone(present, out.kept, patches, removed)
        self.handle.record("vision", index, kept=out.kept, discarded=discarded, merged_into=out.merged_into)
        return out.hidden

    def _measured(self, stage: str, layer: int, where: str, removed: int) -> None:
        """What a step of a method whose counts are the input's own removed per item (`Handle.measured_steps`)."""
        if self.spec.content_counts:
            self.handle.measured_steps[(stage, layer, where)] = removed

    # -- the projector ----------------------------------------------------------------------
    def _projector(self, original: Callable[..., Tensor]) -> Callable[..., Tensor]:
        def forward(features: Tensor, *args: Any, **kwargs: Any) -> Tensor:
            state = self.handle.tower_state
            if state is None:  # features of a tower the method leaves alone (Video-LLaVA's images)
                return original(features, *args, **kwargs)
            self.handle.tower_state = None  # this tower pass's features: consumed once
            follow_device(state, features.device)
            # Video-LLaVA keeps every frame's [CLS] in the LLM: the cuts act on the patches after it.
            keeps_cls = self.adapter.projector_keeps_cls
            # Where every token the projector maps came from: the patch each continues after the in-layer
            # steps (ToMe's merged tokens continue their B token), every patch when none ran.
            offset = int(self.has_cls)
            origin = state.positions[:, offset:] - offset if state.positions is not None else \
                torch.arange(self.adapter.patches, device=features.device).expand(features.shape[0], -1)
            cut = self.cuts.get("tower_output")
            if cut is not None:
                reduced, origin = self._cut(cut, features[:, int(keeps_cls):], state, origin)
                features = torch.cat([features[:, :1], reduced], dim=1) if keeps_cls else reduced
                self._carry_cls(keeps_cls)
            out = original(features, *args, **kwargs)
            cut = self.cuts.get("after_projector")
            if cut is not None and getattr(self.adapter, "cut_after_pooling", False):
                # LLaVA-OneVision's video: the cut acts on every frame's pooled grid, so the adapter
                # runs it after the pooling (`cut_pooled`), which also measures the count.
                self.deferred = (cut, state)
                self.handle.vision_state = None
                return out
            if cut is not None and getattr(self.adapter, "cut_after_packing", False):
                # An AnyRes image cut whole (`MethodSpec.anyres_grid`: its base view and its crop grid as two
                # parts): the adapter's packing runs the cut on every image, handing each item's count in all.
                self.handle.vision_state = origin
                self.handle.measured_tokens_per_item = int(out.shape[1]) - cut.remove
                return out
            if cut is not None:
                reduced, origin = self._cut(cut, out[:, int(keeps_cls):], state, origin)
                out = torch.cat([out[:, :1], reduced], dim=1) if keeps_cls else reduced
                self._carry_cls(keeps_cls)
            # (items, tokens) per output token its original patch, -1 without a grid place: what an
            # adapter that packs the tokens by place reads (LLaVA-NeXT's AnyRes grid).
            self.handle.vision_state = origin
            # Counted as the method's settings count (Video-LLaVA's frame [CLS] apart).
            self.handle.measured_tokens_per_item = int(out.shape[1]) - int(keeps_cls)
            return out

        return forward

    def _carry_cls(self, keeps_cls: bool) -> None:
        """What the cut handed on per token (`Handle.vision_carry`), lined up with the tokens that reach the LLM:
        -1 for the item's [CLS] the model hands on before them (Video-LLaVA), which the cut did not see."""
        carry = self.handle.vision_carry
        if keeps_cls and carry is not None:
            self.handle.vision_carry = torch.cat([torch.full_like(carry[:, :1], -1), carry], dim=1)

    def cut_pooled(self, features: Tensor, pool: Callable[[Tensor], Tensor]) -> Tensor:
        """Run the cut the projector left (`deferred`) on `features` (items, pooled, D), every video frame's
        pooled grid, with the probed attention each patch receives pooled by `pool` (the model's own
        pooling of a (items, patches, channels) grid) as the features were: the official code pools both.
        Returns what goes on: `features` as they are when no cut was left."""
        if self.deferred is None:
            return features
        (cut, state), self.deferred = self.deferred, None
        if self.cut_probe is not None and self.cut_probe in state.probes:
            keys, query, scale, probabilities = state.probes[self.cut_probe]
            if probabilities is not None:
                # Queries averaged first (pooling is linear over keys): one pooled row per item, which the
                # method averages over its one query as it would over every query.
                received = pool(probabilities.column_mean().unsqueeze(-1)).transpose(1, 2)
                state.probes[self.cut_probe] = (keys, query, scale, received)
        items, units = features.shape[:2]
        origin = torch.arange(units, device=features.device).expand(items, -1)
        reduced, origin = self._cut(cut, features, state, origin, expected_units=units)
        self.handle.vision_state = origin
        self.handle.measured_tokens_per_item = int(reduced.shape[1])
        return reduced

    def _cut(self, removal: Removal, features: Tensor, state: TowerState, origin: Tensor,
             expected_units: int | None = None) -> tuple[Tensor, Tensor]:
        """Run a cut on `features` (items, units, D) whose tokens continue the patches `origin`; the
        tokens that go on and the patch each continues (-1 without a grid place). `expected_units`: the count the
        cut expects per item (None: the tower's patches after its in-layer steps)."""
        items, units = features.shape[:2]
        if expected_units is not None:
            expected = expected_units
        elif self.spec.content_counts and state.positions is not None:  # what the tower's own steps left
            expected = state.positions.shape[1] - int(self.has_cls)
        else:
            expected = self.adapter.patches - sum(r.remove for r in (*self.in_layer.values(), *self.at_input.values()))
        if units != expected:
            raise FicocoError(f"{self.spec.title} cuts {expected} patches per item at the tower's output, but the "
                              f"projector received {units}; vision_feature_select_strategy must be 'default'")
        keys, query, scale, probabilities = state.probes.get(self.cut_probe, (None, None, None, None)) \
            if self.cut_probe is not None else (None, None, None, None)
        text = text_mask = None
        if self.wants_text:
            text, text_mask = prompt_text(self.handle, self.adapter, items, self.spec.title)
        # [CLS] where the projector can take it among the cut's tokens (its width the features').
        cls = state.cls if removal.where == "tower_output" and state.cls is not None \
            and state.cls.shape[0] == items and state.cls.shape[-1] == features.shape[-1] else None
        # A video's frames, for a method that reads them together (HoliTom); None: independent items.
        # The patch grid, where the units are the tower's own patches (not a pooled grid, none merged in a layer).
        grid = self.adapter.grid_hw if expected_units is None and not self.in_layer else None
        inputs = TowerInput(hidden=features, has_cls=self.has_cls, remove=removal.remove, added=removal.added,
                            keys=keys, cls_query=query, scale=scale, attention=probabilities, text=text,
                            text_mask=text_mask, frames=getattr(self.adapter, "frames_in_call", None),
                            cls_hidden=None if cls is None else cls.to(features.device), grid_hw=grid,
                            named=self._named(state, None), placement=removal.where)
        out: TowerOutput = self.handle.run_method(("projector", None), self.module.tower_step, inputs, self.settings)
        hidden = out.hidden
        if out.counts is not None:
            # An adaptive count: one host read. Items of one call must agree, since their image spans
            # are shortened alike (a batch's prompts keep equal lengths).
            counts = sorted(set(out.counts.tolist()))
            if len(counts) > 1:
                raise FicocoError(f"{self.spec.title}'s adaptive count differs between the items (images, crops, "
                                  f"frames) of this call ({', '.join(map(str, counts))} tokens): give a fixed count "
                                  "with keep=, or run one single-item image per call (LLaVA-1.5)")
            hidden = hidden[:, :counts[0]]
        # What a method acting again inside the LLM hands its part there (ViTCoP's cluster labels, MustDrop's key set),
        # per token that goes on.
        self.handle.vision_carry = None if out.carry is None else out.carry[:, :hidden.shape[1]]
        self._measured("vision", removal.layer, removal.where, units + removal.added - hidden.shape[1])
        present = torch.arange(units, device=features.device).expand(items, -1)
        kept = out.kept[:, :hidden.shape[1]]
        self.handle.record("vision", removal.layer, kept=kept, discarded=_gone(present, kept, units))
        placed = torch.gather(origin.to(kept.device), 1, kept.clamp(min=0))
        return hidden, torch.where(kept >= 0, placed, torch.full_like(kept, -1))


    def _named(self, state: TowerState, index: int | None) -> dict[str, TowerLayerProbe] | None:
        """What the probes of the layers the method's settings name kept in this pass (`TowerInput.named`), for a
        step at tower layer `index` (None: a cut after the tower). A named layer that runs after the step is
        refused in one line: the step cannot read it."""
        if not self.named:
            return None
        out = {}
        for name, layer in self.named.items():
            if layer not in state.probes:
                raise FicocoError(f"{self.spec.title}: {name}={layer} names a tower layer that runs after its step at "
                                  f"layer {index}; give a layer up to {index}")
            keys, query, scale, probabilities = state.probes[layer]
            out[name] = TowerLayerProbe(layer, keys=keys, cls_query=query, scale=scale, attention=probabilities)
        return out


def merged_probe(spec: MethodSpec, layer: int, probe: TowerProbe, other: TowerProbe | None) -> TowerProbe:
    """One probe of tower layer `layer` that serves `probe`'s needs and `other`'s; refused in one line where they ask
    the layer's probabilities both as it ran and over the whole item."""
    merged = probe.merged(other)
    if merged is None:
        raise FicocoError(f"{spec.title} reads tower layer {layer}'s attention both as the layer ran and over the "
                          "whole item; one probe keeps one of them")
    return merged


def prompt_text(handle: Handle, adapter: Any, items: int, title: str) -> tuple[Tensor, Tensor]:
    """(items, M, D) the LLM's input embeddings of the text after the last visual placeholder of the
    prompt each tower item belongs to, and (items, M) True on real tokens, for a method that reads the
    instruction (a need of kind ``input_embeddings``: CDPruner). The items of a call are the samples'
    images, crops or frames in sample order (generate repeats a prompt's rows in place), so item i
    belongs to sample i // (items / samples). One host read (the longest text)."""
    if handle.prompt_ids is None:
        raise FicocoError(f"{title} reads the prompt's text: call the model with input_ids")
    input_ids, mask = handle.prompt_ids
    samples, length = input_ids.shape
    if items % samples:
        raise FicocoError(f"{title}: {items} tower items do not split evenly among the {samples} prompts of this "
                          "call; give every sample the same number of images (crops, frames)")
    visual = adapter.language_tokens(input_ids) | adapter.unreduced_visual(input_ids)
    positions = torch.arange(length, device=input_ids.device).expand(samples, -1)
    last = torch.where(visual, positions, -1).max(dim=1).values
    text = positions > last.unsqueeze(1)
    if mask is not None:
        text = text & mask[:, -length:].bool().to(text.device)
    counts = text.sum(dim=1)
    width = max(1, int(counts.max()))
    # A stable sort of the "not text" flags lists every sample's text positions first, in order.
    order = torch.sort((~text).to(torch.int8), dim=1, stable=True).indices[:, :width]
    embeds = hf.embed_tokens(adapter.model, torch.gather(input_ids, 1, order))
    real = torch.arange(width, device=input_ids.device).unsqueeze(0) < counts.unsqueeze(1)
    copies = items // samples
    return embeds.repeat_interleave(copies, dim=0), real.repeat_interleave(copies, dim=0)


def _gone(present: Tensor, kept: Tensor, total: int, width: int | None = None) -> Tensor:
    """(items, width) the patch indices of `present` that `kept` no longer holds (ascending, -1
    padded); `width` None: the most any item lost (one host read)."""
    absent = complement(present, total, total - present.shape[1])  # patches gone before this step
    return complement(torch.cat([kept, absent], dim=1), total, width)
