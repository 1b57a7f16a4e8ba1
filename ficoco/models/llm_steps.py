"""The decoder's hook points and probes for every method that acts in the LLM, read from the method's
registry entry, for every family whose decoder is a stack of LLaMA-style layers. Two placements:

- ``in_layer`` (FiCoCo-L, FitPrune, and any later method that reduces between a layer's attention and
  its MLP): `InLayerPatch`. The reducing layer is re-composed from its own submodules; its attention
  runs through the probe (ficoco.models.attention): the layer's own kernel computes the output, and the
  method's ``layer_step`` gets the reads of its probabilities (head-mean, or head-max where the spec's need
  says so) with the layer's tokens.
- ``layer_input`` (FastV, PDrop, SparseVLM, DART, and any later one): `LayerInputPatch`, below.

The rest of this docstring is about ``layer_input``.

What a method asks for (its `MethodSpec.needs`, read through the spec's one probe plan,
`MethodSpec.probes`) decides what is computed, and only there:

- ``attention_rows`` of layer L-1 (``last``: the last prompt token's row per head; ``suffix``:
  the head-mean rows of the text after the visual span): the layer's attention module is routed
  through `rows_attention_function`, which computes those rows from the post-RoPE q and k that
  the layer computed anyway, in float32 over the real keys, then calls the module's own
  implementation for the output (SDPA stays on, and so does eager with output_attentions).
- ``keys`` of layer L-1: the same function keeps the post-RoPE keys.
- ``query_key`` at layer L (PDrop): the layer's own input norm, q (last row only) and k
  projections and RoPE at the current positions.
- ``input_embeddings``: the input of layer 0, handed to the method's ``prepare`` once.
- ``grid``: where every visual token stands on its image's grids (`StepInput.images`), which the family's
  adapter reads from the call's images once per prefill (`FamilyAdapter.image_grids`).

At layer L's input the method's ``step`` returns a `Reduced`; the state then slices the 4-D mask
(its own rows and columns, plus the causal order of added tokens), the rotary tables (original
positions) or recomputes them (compacted positions), and records what every layer caches, so
that decode steps slice their masks to each layer's cache and continue compacted positions. A step
may leave no visual token at all (VTW's withdrawal, `MethodSpec.removes_all`): the later layers then
run and cache the text alone, and nothing after the step reads a visual row.

The method's own matrix work runs through `Handle.run_method` (a plain call, or a counter's
module during `flops --verify`); its time goes into the handle's "reduction" span.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ficoco.accounting.schedule import Removal, Schedule
from ficoco.errors import FicocoError
from ficoco.methods.base import MethodSpec
from ficoco.methods.contract import InLayerModule, LayerInputModule, PreparesModule, load_module
from ficoco.methods.inputs import InLayerInput, Reduced, StepInput
from ficoco.methods.ops import last_row_attention, rows_attention
from ficoco.methods.reads import DEFAULT_ATTENTION_SCORES
from ficoco.models import hf_compat as hf
from ficoco.models.attention import install_probe, own_attention, remove_probe, route_attention
from ficoco.models.patching import LanguageState, Patches, forward_of, gather_rows, method_settings
from ficoco.models.upcast import compute_weight

if TYPE_CHECKING:
    from ficoco.models.handle import Handle

ROWS_IMPLEMENTATION = "ficoco_rows"


@dataclass
class RowsSlot:
    """What one attention module is asked for in a prefill, and what it leaves."""

    rows: str | None = None  # "last", "suffix" or None
    want_keys: bool = False
    armed: bool = False
    suffix_rows: int = 0  # M, for "suffix"
    # (B, M) the rows to compute for "suffix" when they are not the trailing M (several image spans:
    # the text between spans and after the last); None: the trailing M rows.
    row_index: Tensor | None = None
    layer: int = 0
    runner: Callable[..., Any] | None = None  # runs the method's matrix work (Handle.run_method)
    scores: str = DEFAULT_ATTENTION_SCORES  # the rule the rows' scores are computed by (ficoco.methods.reads)
    row_attention: Tensor | None = None
    keys: Tensor | None = None
    key_heads: int = 0  # the key heads `keys` concatenates


def _visible(mask: Tensor | None, batch: int, rows: int, q_len: int, k_len: int, device: torch.device) -> Tensor:
    """(B, rows, K) bool: which keys the last `rows` queries may attend, from the layer's 4-D mask
    (boolean, or additive with 0 where visible), or the causal rule when the mask is None."""
    if mask is not None:
        part = mask[:, 0, -rows:, :k_len] if mask.shape[-2] > 1 else mask[:, 0, :, :k_len].expand(-1, rows, -1)
        visible = part if part.dtype == torch.bool else part == 0
        return visible.expand(batch, -1, -1)
    query = torch.arange(q_len - rows, q_len, device=device).unsqueeze(1) + (k_len - q_len)
    return (torch.arange(k_len, device=device).unsqueeze(0) <= query).unsqueeze(0).expand(batch, -1, -1)


def _visible_rows(mask: Tensor | None, rows: Tensor, q_len: int, k_len: int) -> Tensor:
    """(B, M, K) bool: which keys the query rows `rows` ((B, M) indices among the q_len queries) may
    attend, from the layer's 4-D mask, or the causal rule when the mask is None."""
    if mask is not None:
        part = gather_rows(mask[:, 0], rows, 1)[..., :k_len] if mask.shape[-2] > 1 else \
            mask[:, 0, :, :k_len].expand(rows.shape[0], rows.shape[1], -1)
        return part if part.dtype == torch.bool else part == 0
    keys = torch.arange(k_len, device=rows.device)
    return keys.view(1, 1, -1) <= (rows + (k_len - q_len)).unsqueeze(-1)


def rows_attention_function(module: nn.Module, query: Tensor, key: Tensor, value: Tensor,
                            attention_mask: Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                            is_causal: bool | None = None, **kwargs: Any) -> tuple[Tensor, Any]:
    """The module's own attention, after keeping the rows (and keys) a method asked for."""
    slot: RowsSlot = module._ficoco_rows  # type: ignore[assignment]
    if slot.armed:
        batch, _, q_len, _ = query.shape
        k_len = key.shape[2]
        if slot.rows == "last":
            visible = _visible(attention_mask, batch, 1, q_len, k_len, query.device)[:, 0]
            slot.row_attention = slot.runner(slot.layer, last_row_attention, query[:, :, -1], key, visible, scaling,
                                             slot.scores)
        elif slot.rows == "suffix" and slot.row_index is not None:
            index = slot.row_index
            visible = _visible_rows(attention_mask, index, q_len, k_len)
            slot.row_attention = slot.runner(slot.layer, rows_attention, gather_rows(query, index, 2), key, visible,
                                             scaling, slot.scores)
        elif slot.rows == "suffix":
            rows = slot.suffix_rows
            visible = _visible(attention_mask, batch, rows, q_len, k_len, query.device)
            slot.row_attention = slot.runner(slot.layer, rows_attention, query[:, :, q_len - rows:], key, visible,
                                             scaling, slot.scores)
        if slot.want_keys:
            slot.keys = key.transpose(1, 2).reshape(batch, k_len, -1)
            slot.key_heads = key.shape[1]
    return own_attention(module, module._ficoco_rows_config, query, key, value, attention_mask, dropout=dropout,
                         scaling=scaling, is_causal=is_causal, **kwargs)


hf.register_attention(ROWS_IMPLEMENTATION, rows_attention_function)


def install_rows(attention: nn.Module, slot: RowsSlot, patches: Patches) -> None:
    """Route one attention module through `rows_attention_function` (its own config copy)."""
    route_attention(attention, ROWS_IMPLEMENTATION, patches, "_ficoco_rows_config", _ficoco_rows=slot)


def rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """LLaMA's rotary embedding of ``(B, H, T, d)`` states with ``(B, T, d)`` tables."""
    return x * cos.unsqueeze(1) + rotate_half(x) * sin.unsqueeze(1)


def _project(linear: nn.Module, x: Tensor) -> Tensor:
    """`linear` applied to `x` as the method's own work: F.linear on its weights (flops --verify counts it
    in the method's stage, not the layer's), or, where accelerate hooked the linear itself (a checkpoint
    offloaded by from_pretrained's device map, whose weights wait on meta until the module is called),
    the module call, which loads them."""
    if "_hf_hook" in linear.__dict__:
        return linear(x)
    # A layer stored in 16 bits and upcast as it runs (the fp32 layout where float32 weights do not fit) is
    # multiplied in its compute dtype, as its own forward would.
    return F.linear(x, compute_weight(linear), linear.bias)


def own_last_row(layer: nn.Module, hidden: Tensor, cos: Tensor | None, sin: Tensor | None, visible: Tensor,
                 scores: str = DEFAULT_ATTENTION_SCORES) -> Tensor:
    """(B, H, T) the last row's attention recomputed with the layer's own input norm, q (last row) and
    k projections and RoPE (PDrop's rank layer; no RoPE where `cos` and `sin` are None: VScan's Qwen code),
    softmaxed in float32 over the visible keys, its scores by the rule `scores` names."""
    parts = hf.layer_parts(layer, hf.DECODER_LAYER)
    q_proj, k_proj, head_dim, scaling = hf.attention_projections(parts.attention)
    normed = parts.input_norm(hidden)
    batch, length, _ = normed.shape
    query = _project(q_proj, normed[:, -1:]).view(batch, 1, -1, head_dim).transpose(1, 2)
    keys = _project(k_proj, normed).view(batch, length, -1, head_dim).transpose(1, 2)
    if cos is not None and sin is not None:
        query = rope(query, cos[:, -1:].expand(batch, -1, -1), sin[:, -1:].expand(batch, -1, -1))
        keys = rope(keys, cos.expand(batch, -1, -1), sin.expand(batch, -1, -1))
    return last_row_attention(query[:, :, 0], keys, visible, scaling, scores)


def merge_targets(kept: Tensor, merge_target: Tensor | None) -> Tensor | None:
    """The kept token (in `kept`'s index space) each discarded token went into, for the records; -1 where it went
    into no kept token (FiCoCo-L's official code's rule: into a token removed in the same step)."""
    if merge_target is None:
        return None
    return torch.where(merge_target >= 0, torch.gather(kept, 1, merge_target.clamp(min=0)), -1)


class InLayerPatch:
    """Patches a decoder for a method that reduces inside its layers (between the attention residual
    and the MLP): the probe on every reducing layer's attention, the step, and the masks, positions
    and caches of every later layer (FiCoCo-L's `LanguageState`: several image spans, a new turn on
    an earlier turn's cache, decode steps)."""

    def __init__(self, adapter: Any, handle: Handle, spec: MethodSpec, schedule: Schedule, first: int) -> None:
        self.adapter, self.handle, self.spec = adapter, handle, spec
        self.step = load_module(spec, InLayerModule).layer_step
        self.settings = method_settings(handle, spec, schedule)
        self.removed = schedule.removed_at()
        self.first = first
        # The method's position scheme under its rule: the kept tokens' own positions ("original"), or numbered
        # on without gaps for the later layers ("compact": FiCoCo-L's official code's rule).
        self.rule = spec.rule(self.settings)
        self.compact = spec.position_scheme(self.settings) == "compact"
        if self.compact and not adapter.compacts_positions:
            raise FicocoError(f"{spec.title} compacts the kept tokens' positions under this rule, which "
                              f"{type(adapter).__name__}'s positions have no form for; use the default rule")

    def _check_prefill(self, state: LanguageState) -> None:
        """Refuse, in one line, a prefill the rule cannot run: more image spans than it reads, or (compacted
        positions) a new image on an earlier turn's cache, whose layers hold positions of their own."""
        if self.rule is not None and self.rule.images is not None and state.images > self.rule.images:
            raise FicocoError(f"{self.spec.title} under the {self.rule.label} reads {self.rule.images} image per "
                              f"prompt; this prompt holds {state.images}: give one, or use the default rule")
        if self.compact and state.past_length:
            raise FicocoError(f"{self.spec.title} under the {self.rule.label if self.rule else 'rule'} compacts "
                              "positions from an empty cache: a new image on an earlier turn's cache is not "
                              "supported (text turns on its cache are); start a new cache for a new image")

    def _compacted(self, state: LanguageState, position_ids: Tensor | None, kept: Tensor, hidden: Tensor) -> None:
        """After a reduction, the later layers' positions numbered on without gaps (every kept token moves down by
        the tokens removed before it) and their rotary tables."""
        batch = kept.shape[0]
        if position_ids is None or position_ids.dim() != 2:
            position_ids = state.index + state.past_length
        before = position_ids.expand(batch, -1) if position_ids.shape[0] != batch else position_ids
        slots = torch.arange(kept.shape[1], device=kept.device)
        state.positions = torch.gather(before.to(kept.device), 1, kept) - (kept - slots)
        state.rotary = self.adapter.rotary(hidden, state.positions)

    def install(self, patches: Patches) -> None:
        layers = self.adapter.decoder_layers
        for index in range(self.first, len(layers)):
            layer = layers[index]
            slot = None
            if self.removed.get(index, 0):
                attention = hf.layer_parts(layer, hf.DECODER_LAYER).attention
                slot = install_probe(attention, armed=False, runner=self.handle.read_runner(index),
                                     scores=self.handle.attention_scores, heads=self.spec.probes.layer_heads)
                patches.on_undo(lambda attn=attention: remove_probe(attn))
            patches.set(layer, "forward", self._forward(index, layer, forward_of(layer), slot))

    def _forward(self, index: int, layer: nn.Module, original: Callable[..., Tensor], slot: Any
                 ) -> Callable[..., Tensor]:
        handle, remove = self.handle, self.removed.get(index, 0)
        # Only a reducing layer is re-composed from its parts (a layer the adapter admits: on a hybrid decoder a
        # non-reducing layer may be another kind, Qwen3.5's Gated DeltaNet).
        parts = hf.layer_parts(layer, hf.DECODER_LAYER) if remove else None

        # The model calls its layers with these by keyword (hf_compat.DECODER_LAYER_KEYWORDS); the
        # cache and everything else pass through under the installed release's own names.
        def forward(hidden_states: Tensor, attention_mask: Tensor | None = None, position_ids: Tensor | None = None,
                    position_embeddings: tuple[Tensor, Tensor] | None = None, **kwargs: Any) -> Tensor:
            state = handle.language_state
            if state is None:
                return original(hidden_states, attention_mask=attention_mask, position_ids=position_ids,
                                position_embeddings=position_embeddings, **kwargs)
            state.follow(hidden_states.device)
            attention_mask = state.slice_mask(attention_mask, index, hidden_states.shape[1])
            if not state.decoding:
                rows = state.index
                if self.compact:
                    self._check_prefill(state)
                    # Positions compacted away before this layer: what its decode steps subtract.
                    state.shift[index] = state.prefill_length - state.past_length - rows.shape[1]
                if self.compact and state.positions is not None:
                    position_ids, position_embeddings = state.positions, state.rotary
                else:
                    if position_ids is not None and position_ids.shape[-1] != rows.shape[1]:
                        position_ids = gather_rows(position_ids, rows, 1)
                    if position_embeddings is not None and position_embeddings[0].shape[1] != rows.shape[1]:
                        cos, sin = position_embeddings
                        position_embeddings = (gather_rows(cos, rows, 1), gather_rows(sin, rows, 1))
                # What this layer's cache holds after the call: its earlier keys and the tokens it
                # sees now (before its own reduction).
                state.cached_positions[index] = state.key_positions(index)
            elif self.compact and state.shift.get(index) and position_ids is not None:
                # A decode step (or a text turn) on a compacted cache: its positions continue this layer's own.
                position_ids = position_ids - state.shift[index]
                position_embeddings = self.adapter.rotary(hidden_states, position_ids)
            if state.decoding or not remove:
                return original(hidden_states, attention_mask=attention_mask, position_ids=position_ids,
                                position_embeddings=position_embeddings, **kwargs)
            residual = hidden_states
            slot.armed = True
            try:
                attn_out, _ = parts.attention(
                    hidden_states=parts.input_norm(hidden_states), attention_mask=attention_mask,
                    position_ids=position_ids, position_embeddings=position_embeddings, **kwargs)
            finally:
                slot.armed = False
            hidden = residual + attn_out
            attn, _ = slot.take()
            # Keys of earlier turns come first; the method reads this call's tokens alone. The
            # schedule's counts are per image: a prompt of k images loses k times as many tokens
            # at this layer, chosen among all its visual tokens together.
            if attn.shape[2] != attn.shape[1]:
                attn = attn.last_keys(attn.shape[1])
            inputs = InLayerInput(hidden=hidden, attention=attn,
                                  remove=remove * state.images, visual_rows=state.visual_rows,
                                  suffix_mask=state.suffix_mask, first_suffix_row=state.first_suffix_row,
                                  protected=state.protected, max_protected=state.max_protected,
                                  last_visual_row=state.last_visual_row)
            # What the step leaves for the later layers (the rows, positions and ranks kept) is the method's work
            # as much as the step: timed with it.
            with handle.timer.span("reduction", hidden.device):
                red = handle.run_method(index, self.step, inputs, self.settings)
                kept_ranks = torch.gather(state.visual_ranks, 1, red.kept_visual)
                handle.record("llm", index, kept=kept_ranks,
                              discarded=torch.gather(state.visual_ranks, 1, red.discarded_visual),
                              merged_into=merge_targets(kept_ranks, red.merge_target))
                state.keep(red.kept_positions, red.kept_visual, red.visual_positions)
                if self.compact:
                    self._compacted(state, position_ids, red.kept_positions, red.hidden)
            hidden = red.hidden
            return hidden + parts.mlp(parts.post_norm(hidden))

        return forward


@dataclass
class StepState(LanguageState):
    """One prefill of a layer-input method and the decode steps that follow it.

    `index` holds, per sample, the position in this call's input_ids of every token still in the
    sequence; a token a method added (SparseVLM's recycled clusters) stands at its span's last
    placeholder there (`added` marks it), which is what masks and output positions use for it.
    """

    visual_start: Tensor | None = None  # (B,)
    # `positions` ((B, T_now) the position ids the layers use, LLaMA 1-D), `rotary` (recomputed tables, compacted
    # positions) and `shift` (per layer: positions compacted away before it) are LanguageState's.
    text_positions: Tensor | None = None  # (B, T_now) positions that do not move with left padding
    mask2d: Tensor | None = None  # (B, T_now) padding mask
    added: Tensor | None = None  # (B, T_now) True on added tokens, None while there are none
    # Per layer: what a decode step subtracts from the model's position ids (the shift, where the last step that
    # renumbered positions compacted them, so that decoding continues from them; else 0).
    decode_shift: dict[int, int] = field(default_factory=dict)
    continues: bool = False  # the last step that renumbered positions compacted them
    # (B, N_now) what the method's part before the LLM handed on per visual token (StepInput.carried), or None.
    carried: Tensor | None = None
    # (B, 1) the position id of the first visual token when the prefill started: where a reindexed step numbers on.
    span_position: Tensor | None = None
    stage: int = 0
    prepared: Any = None
    # M: the trailing rows (of the grouped order, with several spans) that can hold text after the visual span
    # (T minus the earliest span end of any sample), the "suffix" rows a probe computes; steps leave it as it is.
    text_rows: int = 0
    steps_done: int = 0
    # Several image spans per sample (text between them): the methods, which read one span, see the
    # sequence grouped (`grouping`), their result is put back in reading order.
    gapped: bool = False
    # Per sample, its images' grids (ficoco.methods.inputs.ImageGrids) where the method reads them; else None.
    image_grids: tuple[tuple[Any, ...], ...] | None = None
    _mask_cache: dict[int, tuple[Any, Tensor | None]] = field(default_factory=dict)

    def layer_mask(self, mask: Tensor | None, layer: int) -> Tensor | None:
        """This layer's prefill mask: the model's, with the removed tokens' rows and columns taken
        out and added tokens seen in causal order (computed once per step)."""
        if mask is None or not self.steps_done:
            return mask
        if mask.dim() == 2:  # a recurrent layer's padding mask: the columns of the tokens still present
            return torch.gather(mask, 1, self.index)
        cached = self._mask_cache.get(self.steps_done)
        if cached is not None and cached[0] is mask:
            return cached[1]
        sliced = gather_rows(gather_rows(mask, self.index, 2), self.index, 3)
        if self.added is not None:
            slots = torch.arange(self.index.shape[1], device=mask.device)
            order = slots.unsqueeze(0) <= slots.unsqueeze(1)  # key slot <= query slot
            if sliced.dtype == torch.bool:
                sliced = sliced & order
            else:
                sliced = sliced.masked_fill(~order, torch.finfo(sliced.dtype).min)
        self._mask_cache = {self.steps_done: (mask, sliced)}
        return sliced

    def grouping(self) -> Tensor:
        """(B, T_now) an order of the current sequence with every visual token in one span: the
        prefix before the first, the visual tokens in reading order, then the text after the first
        (between spans and after the last) in reading order; the last prompt token stays last."""
        batch, length = self.index.shape
        slots = torch.arange(length, device=self.index.device).expand(batch, -1)
        # (A tensor source, not a Python bool: torch.jit's trace, which flops --verify runs, takes no bool scalar.)
        visual = torch.zeros_like(slots, dtype=torch.bool).scatter(1, self.visual_rows,
                                                                   torch.ones_like(self.visual_rows, dtype=torch.bool))
        before = slots < self.visual_start.unsqueeze(1)
        key = torch.where(before, slots, torch.where(visual, length + slots, 2 * length + slots))
        return torch.sort(key, dim=1).indices

    def decode_mask(self, mask: Tensor | None, layer: int) -> Tensor | None:
        """A decode step's mask sliced to what this layer cached (a layer before any step: as is)."""
        if mask is None or self.shift.get(layer) is None:
            return mask
        return self.slice_mask(mask, layer, 0)


class LayerInputPatch:
    """Patches a decoder for one layer-input method: probes, the step at each reducing layer, and
    the masks, positions and caches of every later layer."""

    def __init__(self, adapter: Any, handle: Handle, spec: MethodSpec, schedule: Schedule) -> None:
        self.adapter, self.handle, self.spec = adapter, handle, spec
        # What to capture, from the spec's one probe plan (ficoco.methods.needs): layer L-1's rows and keys,
        # layer L's own last row, the input embeddings.
        probes = spec.probes
        protocol = PreparesModule if probes.input_embeddings else LayerInputModule
        self.module: LayerInputModule = load_module(spec, protocol)
        self.settings = schedule.settings_dict()
        self.steps: dict[int, Removal] = {r.layer: r for r in schedule.removals}
        self.order = {layer: k for k, layer in enumerate(sorted(self.steps))}
        # Each step's position scheme: the entry's (a method's steps may differ: ViTCoP's), or the run's `positions`
        # setting where the official code offers both (VTW's pe_type); the schemes that renumber positions do so
        # where the adapter's positions can be recomputed (1-D LLaMA ids; Qwen2-VL's 3-D ids stay original), and a
        # compaction asked for by name where they cannot is refused.
        chosen = self.settings.get("positions")
        if chosen == "compact" and spec.positions != "compact" and not adapter.compacts_positions:
            raise FicocoError(f"{spec.title} positions=compact renumbers 1-D position ids; "
                              f"{getattr(adapter, 'family_title', 'this family')}'s are 3-D (M-RoPE: an image's tokens "
                              "share their rows and columns), which the methods keep; give positions=original")
        self.schemes = {layer: chosen or spec.step_positions_at(k) for layer, k in self.order.items()}
        self.renumbers = {layer: scheme in ("compact", "reindexed") and adapter.compacts_positions
                          for layer, scheme in self.schemes.items()}
        self.rows = probes.previous_layer_rows
        self.keys = probes.previous_layer_keys
        self.own_row = probes.own_query_key_row
        # The own row's RoPE: always, or (``rope="1d"``) only on a decoder of 1-D positions.
        self.own_row_rope = probes.own_row_rope == "always" or not adapter.multimodal_rope
        # The rank layer's own last row (PDrop): a family whose attention projects otherwise (Qwen3.5's gated,
        # normed queries and partial rotary) gives its own.
        self.own_last_row = getattr(adapter, "own_last_row", own_last_row)
        self.embeddings = probes.input_embeddings
        # A count known only once the step ran (VLM-Pruner's selection may end early): the step may leave fewer
        # visual tokens than its schedule plans, the same number in every sample, measured for the accountant.
        self.adaptive = bool(self.settings.get("adaptive"))
        # Counts the input decides as it runs (MustDrop's thresholds): a step may leave any count, the same in every
        # sample, which the handle records per step (`Handle.measured_steps`) for the accountant.
        self.content_counts = spec.content_counts
        self.slots: dict[int, RowsSlot] = {}

    def install(self, patches: Patches) -> None:
        layers = self.adapter.decoder_layers
        if (self.rows or self.keys) and any(layer < 1 for layer in self.steps):
            raise FicocoError(f"{self.spec.title} reads layer L-1 of a step at layer L: its steps start at layer 1")
        for layer in self.steps:
            if self.rows or self.keys:
                slot = RowsSlot(rows=self.rows, want_keys=self.keys, layer=layer - 1, runner=self.handle.run_method,
                                scores=self.handle.attention_scores)
                install_rows(hf.layer_parts(layers[layer - 1], hf.DECODER_LAYER).attention, slot, patches)
                self.slots[layer - 1] = slot
        for index, layer in enumerate(layers):
            patches.set(layer, "forward", self._forward(index, layer, forward_of(layer)))

    # -- the wrapped decoder layer ----------------------------------------------------------
    def _forward(self, index: int, layer: nn.Module, original: Callable[..., Tensor]) -> Callable[..., Tensor]:
        def forward(hidden_states: Tensor, attention_mask: Tensor | None = None, position_ids: Tensor | None = None,
                    position_embeddings: tuple[Tensor, Tensor] | None = None, **kwargs: Any) -> Tensor:
            state = self.handle.language_state
            if not isinstance(state, StepState):
                return original(hidden_states, attention_mask=attention_mask, position_ids=position_ids,
                                position_embeddings=position_embeddings, **kwargs)
            state.follow(hidden_states.device)
            if state.decoding:
                attention_mask = state.decode_mask(attention_mask, index)
                shift = state.decode_shift.get(index)
                if shift and position_ids is not None:
                    position_ids = position_ids - shift
                    position_embeddings = self.adapter.rotary(hidden_states, position_ids)
                return original(hidden_states, attention_mask=attention_mask, position_ids=position_ids,
                                position_embeddings=position_embeddings, **kwargs)
            if index == 0:
                self._start(state, hidden_states, position_ids)
            if index in self.steps:
                hidden_states = self._step(state, index, layer, hidden_states, attention_mask, position_embeddings)
            attention_mask = state.layer_mask(attention_mask, index)
            if state.steps_done:
                if state.rotary is not None:  # positions a step renumbered: their own tables
                    position_ids = state.positions
                    position_embeddings = state.rotary
                else:
                    if position_ids is not None and position_ids.shape[-1] != state.index.shape[1]:
                        position_ids = gather_rows(position_ids, state.index, 1)
                    if position_embeddings is not None and position_embeddings[0].shape[1] != state.index.shape[1]:
                        cos, sin = position_embeddings
                        position_embeddings = (gather_rows(cos, state.index, 1), gather_rows(sin, state.index, 1))
                state.cached_positions[index] = state.key_positions(index)
                # Positions compacted away before this layer (removed minus added tokens).
                state.shift[index] = state.prefill_length - state.past_length - state.index.shape[1]
                state.decode_shift[index] = state.shift[index] if state.continues else 0
            slot = self.slots.get(index)
            if slot is not None:
                slot.armed = True
                if slot.rows == "suffix":
                    slot.suffix_rows = state.prepared.shape[1] if state.prepared is not None else state.text_rows
                    slot.row_index = state.grouping()[:, -slot.suffix_rows:] if state.gapped else None
            try:
                return original(hidden_states, attention_mask=attention_mask, position_ids=position_ids,
                                position_embeddings=position_embeddings, **kwargs)
            finally:
                if slot is not None:
                    slot.armed = False

        return forward

    def _start(self, state: StepState, embeds: Tensor, position_ids: Tensor | None) -> None:
        """Layer 0's input: the prefill's positions, and the method's `prepare` on the embeddings."""
        batch, length = state.index.shape
        if position_ids is not None and position_ids.dim() == 2:
            state.positions = position_ids.expand(batch, -1)
        else:
            state.positions = torch.arange(length, device=embeds.device).expand(batch, -1)
        state.span_position = torch.gather(state.positions, 1, state.visual_start.unsqueeze(1))
        mask = state.mask2d
        state.text_positions = (mask.long().cumsum(1) - 1).clamp(min=0) if mask is not None else \
            torch.arange(length, device=embeds.device).expand(batch, -1)
        carry, self.handle.vision_carry = self.handle.vision_carry, None
        if carry is not None:  # what the method's part before the LLM handed on: per sample, its items in order
            if carry.shape[0] % batch or carry.numel() != batch * state.num_visual:
                raise FicocoError(f"{self.spec.title}: its part before the LLM handed on {tuple(carry.shape)} values "
                                  f"for {batch} prompts of {state.num_visual} visual tokens each; give every prompt "
                                  "its images' full spans")
            state.carried = carry.reshape(batch, -1).to(embeds.device)
        if self.embeddings:
            grouped = gather_rows(embeds, state.grouping(), 1) if state.gapped else embeds
            prepare = cast(PreparesModule, self.module).prepare
            state.prepared = self.handle.run_method(0, prepare, grouped, state.visual_start, state.num_visual)

    def _step(self, state: StepState, index: int, layer: nn.Module, hidden: Tensor, mask: Tensor | None,
              position_embeddings: tuple[Tensor, Tensor] | None) -> Tensor:
        """Run the method at layer `index`'s input and move the state to the reduced sequence."""
        removal = self.steps[index]
        slot = self.slots.get(index - 1)
        row_attention = keys = own_row = None
        key_heads = 0
        if slot is not None:
            row_attention, keys, key_heads = slot.row_attention, slot.keys, slot.key_heads
            slot.row_attention = slot.keys = None
        if self.own_row:
            if not self.own_row_rope:
                cos = sin = None  # the row without the rotary embedding (VScan's Qwen code)
            elif state.rotary is not None:
                cos, sin = state.rotary
            elif position_embeddings is not None and state.steps_done:
                cos, sin = (gather_rows(t, state.index, 1) for t in position_embeddings)
            else:
                cos, sin = position_embeddings
            visible = _visible(state.layer_mask(mask, index), hidden.shape[0], 1, hidden.shape[1], hidden.shape[1],
                               hidden.device)[:, 0]
            own_row = self.handle.run_method(index, self.own_last_row, layer, hidden, cos, sin, visible,
                                             self.handle.attention_scores)
        # The schedule's counts are per image: a prompt of k images loses k times as many tokens,
        # chosen among all its visual tokens together (FiCoCo-L's rule).
        remove = removal.remove * state.images
        inputs = StepInput(
            hidden=hidden, visual_start=state.visual_start, num_visual=state.num_visual,
            keep=state.num_visual - remove, stage=self.order[index], position_ids=state.positions,
            text_positions=state.text_positions, attention_mask=state.mask2d, row_attention=row_attention,
            keys=keys, query_key_row=own_row, final_norm=self.adapter.final_norm, prepared=state.prepared,
            visual_ranks=state.visual_ranks, images=state.image_grids, key_heads=key_heads,
            carried=state.carried)
        order = state.grouping() if state.gapped else None
        if order is not None:
            inputs = _grouped(inputs, order)
        settings = self.settings
        if state.images > 1 and hasattr(self.module, "several_images"):  # counts per image (DART's pivots)
            settings = self.module.several_images(settings, state.images)  # type: ignore[attr-defined]
        red = self.handle.run_method(index, self.module.step, inputs, settings)
        scheme = self.schemes[index]
        if order is not None:
            red = _reading_order(red, order, state, scheme)
        if scheme == "reindexed":
            red = replace(red, position_ids=_reindexed(state, red.kept_positions))
        # Tokens a method adds (SparseVLM's clusters) follow from all the pruned tokens of the prompt
        # together: with several images only the kept count is the schedule's.
        expected = state.num_visual - remove + removal.added
        kept_count = red.kept_visual.shape[1]
        if self.content_counts and 1 <= red.num_visual <= state.num_visual + removal.added:
            # The count the input decided (the schedule's is an assumption), per sample of one-image prompts.
            if state.images == 1:
                self.handle.measured_steps[("llm", index, "layer_input")] = \
                    state.num_visual + removal.added - red.num_visual
        elif self.adaptive and not removal.added and 1 <= red.num_visual <= expected:
            # The count as it ran, per image of the profile's one-image prompt (with several images the count is
            # the prompt's, which the accountant does not plan).
            self.handle.measured_tokens_per_item = red.num_visual if state.images == 1 else None
        elif red.num_visual != expected and (state.images == 1 or kept_count != state.num_visual - remove):
            raise FicocoError(f"{self.spec.title} at layer {index} left {red.num_visual} visual tokens where its "
                              f"schedule plans {expected}; give a schedule the method can meet")
        # Bookkeeping: added tokens stand at the last visual token's place in input positions.
        source = red.kept_positions
        is_added = source < 0
        last_visual = state.visual_rows[:, -1:]
        anchor = torch.where(is_added, last_visual, source)
        discarded = self._discarded(red.kept_visual, state.num_visual)
        kept_ranks = torch.gather(state.visual_ranks, 1, red.kept_visual)
        self.handle.record("llm", index, kept=kept_ranks, discarded=torch.gather(state.visual_ranks, 1, discarded),
                           merged_into=merge_targets(kept_ranks, red.merge_target))
        extra = red.num_visual - red.kept_visual.shape[1]
        ranks = kept_ranks
        if extra:
            ranks = torch.cat([kept_ranks, kept_ranks.new_full((kept_ranks.shape[0], extra), -1)], dim=1)
        previously_added = state.added
        state.index = torch.gather(state.index, 1, anchor)
        state.text_positions = torch.gather(state.text_positions, 1, anchor)
        state.suffix_mask = torch.gather(state.suffix_mask, 1, anchor)
        added = is_added if previously_added is None else is_added | torch.gather(previously_added, 1, anchor)
        state.added = added if bool(extra) or previously_added is not None else None
        state.visual_ranks = ranks
        if state.carried is not None:  # follows the kept visual tokens; an added token carries nothing (-1)
            carried = torch.gather(state.carried, 1, red.kept_visual)
            state.carried = torch.cat([carried, carried.new_full((carried.shape[0], extra), -1)], dim=1) \
                if extra else carried
        if state.gapped:  # kept visual tokens and added ones, wherever they are now
            was_visual = torch.zeros(source.shape[0], hidden.shape[1], dtype=torch.bool, device=hidden.device)
            rows = state.visual_rows
            was_visual = was_visual.scatter(1, rows, torch.ones_like(rows, dtype=torch.bool))
            now = torch.gather(was_visual, 1, anchor) | is_added
            slots = torch.arange(now.shape[1], device=hidden.device).expand(now.shape[0], -1)
            state.visual_rows = torch.sort(torch.where(now, slots, now.shape[1]), dim=1).values[:, :red.num_visual]
        else:
            state.visual_rows = state.visual_start.unsqueeze(1) + torch.arange(red.num_visual, device=hidden.device)
        state.mask2d = red.attention_mask
        if self.renumbers[index]:
            state.positions = red.position_ids
            state.rotary = self.adapter.rotary(red.hidden, red.position_ids)
            state.continues = scheme == "compact"
        else:
            state.positions = torch.gather(state.positions, 1, anchor)
            if state.rotary is not None:  # tables an earlier step renumbered travel with their tokens
                state.rotary = (gather_rows(state.rotary[0], anchor, 1), gather_rows(state.rotary[1], anchor, 1))
        state.steps_done += 1
        return red.hidden

    @staticmethod
    def _discarded(kept: Tensor, count: int) -> Tensor:
        """(B, count - k) ascending span indices not in `kept`."""
        flags = torch.ones(kept.shape[0], count, dtype=torch.int8, device=kept.device)
        flags = flags.scatter(1, kept, torch.zeros_like(kept, dtype=torch.int8))
        return torch.sort(torch.sort(1 - flags, dim=1, stable=True).indices[:, :count - kept.shape[1]], dim=1).values


def step_state(input_ids: Tensor, attention_mask: Tensor | None, visual: Tensor, past_length: int,
               title: str) -> StepState | None:
    """The state of a prefill whose visual tokens are `visual` ((B, T) bool): one span, or several
    (images with text between them: the visual tokens are their union, and the method ranks them all
    together), the same number of tokens and of spans in every sample (found from the placeholders,
    never from offsets). None when the input holds no placeholder. One host synchronisation."""
    batch, length = input_ids.shape
    positions = torch.arange(length, device=input_ids.device).expand(batch, -1)
    counts = visual.sum(dim=1)
    first = torch.where(visual, positions, length).min(dim=1).values
    last = torch.where(visual, positions, -1).max(dim=1).values
    spans = (visual & ~F.pad(visual[:, :-1], (1, 0), value=False)).sum(dim=1)
    fewest, most, gaps, fewest_spans, most_spans, ends_visual, earliest = torch.stack(
        [counts.min(), counts.max(), (last - first + 1 - counts).abs().max(), spans.min(), spans.max(),
         visual[:, -1].any(), first.min()]).tolist()
    if most == 0:
        return None
    if fewest != most:
        raise FicocoError(f"every sample of a batch must hold the same number of image tokens for {title}")
    if fewest_spans != most_spans:
        raise FicocoError(f"every sample of a batch must hold the same number of images for {title}")
    if gaps and ends_visual:
        raise FicocoError(f"{title} ranks the images of a prompt by the text after them; end the prompt with text")
    if past_length:
        raise FicocoError(f"{title} starts a conversation on an empty cache: a new image on an earlier turn's cache "
                          "is not supported (text turns on its cache are); start a new cache for a new image")
    if gaps:  # a stable sort of the "not visual" flags lists every sample's visual rows first, in order
        rows = torch.sort((~visual).to(torch.int8), dim=1, stable=True).indices[:, :most]
    else:
        rows = first.unsqueeze(1) + torch.arange(most, device=input_ids.device)
    real = attention_mask.bool() if attention_mask is not None else torch.ones_like(visual)
    suffix = (positions > last[:, None]) & real
    ranks = torch.arange(most, device=input_ids.device).expand(batch, -1)
    return StepState(index=positions.clone(), visual_rows=rows, visual_ranks=ranks, suffix_mask=suffix,
                     text_rows=length - earliest - most,
                     prefill_length=length, past_length=0, visual_start=first, images=most_spans, gapped=bool(gaps),
                     mask2d=attention_mask.to(torch.long) if attention_mask is not None else None)


def _grouped(inputs: StepInput, order: Tensor) -> StepInput:
    """`inputs` seen in `order` (`StepState.grouping`): one visual span, as every method reads it."""
    def rows(x: Tensor | None) -> Tensor | None:
        return None if x is None else gather_rows(x, order, 1)

    def columns(x: Tensor | None) -> Tensor | None:
        return None if x is None else gather_rows(x, order, x.dim() - 1)

    return replace(inputs, hidden=rows(inputs.hidden), position_ids=rows(inputs.position_ids),
                   text_positions=rows(inputs.text_positions), attention_mask=rows(inputs.attention_mask),
                   row_attention=columns(inputs.row_attention), keys=rows(inputs.keys),
                   query_key_row=columns(inputs.query_key_row))


def _reindexed(state: StepState, kept_positions: Tensor) -> Tensor:
    """(B, T') the "reindexed" position ids of a step's output (MethodSpec.positions): the prefix keeps its own;
    from the visual span on, every token is numbered by the row it held in the sequence entering the step,
    counted on from the first visual token's id when the prefill started. The gaps earlier steps left close,
    this step's own stay (ViTCoP's deep stage: ``position_ids = all_keep``). An added token stands at the last
    visual row."""
    rows = torch.where(kept_positions < 0, state.visual_rows[:, -1:], kept_positions)
    start = state.visual_start.unsqueeze(1)
    own = torch.gather(state.positions, 1, rows)
    return torch.where(rows < start, own, state.span_position + rows - start)


def _reading_order(red: Reduced, order: Tensor, state: StepState, scheme: str) -> Reduced:
    """A method's result on the grouped sequence put back in reading order: every token at its
    place, added tokens right after the last visual token, compacted or reindexed positions numbered again
    (`scheme`, the step's; reindexed positions are numbered by the caller, `_reindexed`)."""
    source = red.kept_positions
    is_added = source < 0
    current = torch.where(is_added, -1, torch.gather(order, 1, source.clamp(min=0)))
    last_visual = state.visual_rows[:, -1:]
    place = torch.where(is_added, 2 * last_visual + 1, 2 * current)  # added: just after the last visual
    back = torch.sort(place, dim=1, stable=True).indices
    hidden = gather_rows(red.hidden, back, 1)
    kept_positions = torch.gather(current, 1, back)
    mask = None if red.attention_mask is None else torch.gather(red.attention_mask, 1, back)
    if scheme != "compact":  # original positions travel with their tokens (reindexed ones are numbered after)
        positions = torch.gather(red.position_ids, 1, back)
    else:  # compacted: the prefix keeps its own, then numbered on from the first visual token's
        start = state.visual_start.unsqueeze(1)
        slots = torch.arange(source.shape[1], device=source.device).expand(source.shape[0], -1)
        prefix = torch.gather(state.positions, 1, slots.clamp(max=state.positions.shape[1] - 1))
        positions = torch.where(slots < start, prefix, torch.gather(state.positions, 1, start) + slots - start)
    return Reduced(hidden=hidden, kept_positions=kept_positions, position_ids=positions, attention_mask=mask,
                   kept_visual=red.kept_visual, num_visual=red.num_visual, merge_target=red.merge_target)
