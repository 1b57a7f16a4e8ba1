"""FiCoCo inside Hugging Face's InternVL3 (`InternVLForConditionalGeneration`): InternViT with [CLS], pixel
shuffle (every 2 x 2 group of a tile's patches one token of 4x the width) before the projector, dynamic tiles
plus a thumbnail, and a Qwen2 decoder with 1-D positions. This file alone knows InternVL's layout; the
methods live in ficoco.methods.

Every tile (and the thumbnail) is one tower item and one span unit of `image_seq_length` placeholders; an
image's span is its tiles' units one after the other between `<img>` and `</img>`. So:

- The methods inside the decoder (FiCoCo-L, FastV, PDrop, SparseVLM, DART) run through the base adapter
  (`FamilyAdapter`): the placeholders of an image are one span, as on LLaVA-1.5.
- A method before the LLM acts on the pixel-shuffle groups, the tokens the LLM receives, never on single
  patches (pixel shuffle needs every tile's whole square grid). A cut runs at the tower's output on the
  shuffled tokens (a group's 4 patches side by side, what the projector reads: VisionZip, VisPruner) or on
  the projector's output (FasterVLM, DivPrune, CDPruner); a group's [CLS] attention is its patches' mean
  ([CLS] attends over single patches in InternViT), its key the patches' mean key. FiCoCo-V removes whole
  groups inside InternViT's layers (its `reduce_groups`, as on Qwen2-VL, scored by [CLS]), and ToMe merges
  whole groups there (its `tower_step` on a group's patches side by side, [CLS] a unit of its own, every later
  layer weighing a patch by its group's size); the tower's output is put back on the whole patch grid (removed
  groups empty) so that pixel shuffle runs as transformers wrote it, and the projector maps the kept groups
  only. Every tile keeps the same count; the prompt's span units are shortened to it at the entry (LLaVA-1.5's
  bookkeeping, one unit per tile). PruMerge+ cuts groups at the tower's output (a group's share of [CLS]'s
  attention the sum of its patches', its key their mean); its adaptive count is measured per call, and the
  tiles of a call must agree. HoliTom is a video method, refused here.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from ficoco.errors import FicocoError
from ficoco.methods.ops import pixel_shuffle_order
from ficoco.models import hf_compat as hf
from ficoco.models.inputs import place_inputs
from ficoco.models.llava import LlavaAdapter
from ficoco.models.patching import Patches, forward_of, method_settings
from ficoco.models.prompt import PromptFormat

if TYPE_CHECKING:
    from ficoco.models.handle import Handle

__all__ = ["PREFIX_TOKENS", "PROMPT", "InternVLAdapter", "synthetic_inputs"]

# "<|im_start|> user \n <img>" before the first tile's placeholders (the accountant's FAMILY.prefix_tokens).
PREFIX_TOKENS = 4
# "</img> \n" before the question, "<|im_end|> \n <|im_start|> assistant \n" after it.
_SUFFIX_TEMPLATE_TOKENS = 7
# The InternVL3 tokenizer's special ids around the image placeholder (<IMG_CONTEXT>): <img> and </img> are the
# two ids before it, <|im_start|> and <|im_end|> 23 and 22 before it (151644, 151645 beside 151667).
_IMG_START, _IMG_END, _IM_START, _IM_END = 2, 1, 23, 22


class InternVLAdapter(LlavaAdapter):
    """Where the methods go in an InternVL model: the decoder's parts (the base's), and for a method before
    the LLM its work on the pixel-shuffle groups of every tile (inside InternViT's layers, or a cut)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        config = model.config
        self.tower = hf.clip_tower(model, "vision_tower")
        self.vision_layers = hf.internvl_layers(self.tower)
        self.decoder_layers = hf.decoder_layers(model)
        self.image_token_id = config.image_token_id
        vision = config.vision_config
        size = vision.image_size[0] if isinstance(vision.image_size, (list, tuple)) else vision.image_size
        patch = vision.patch_size[0] if isinstance(vision.patch_size, (list, tuple)) else vision.patch_size
        side = size // patch
        self.factor = round(1 / config.downsample_ratio)
        self.merge = self.factor**2
        self.grid_hw = (side // self.factor, side // self.factor)  # a tile's grid of groups (LLM tokens)
        self.patch_grid_hw = (side, side)  # a tile's patch grid before pixel shuffle
        self.patches = side * side
        self.units = self.patches // self.merge
        # Placeholders of one span unit: one tile's tokens (image_seq_length).
        self.span_tokens = self.units
        self.order = pixel_shuffle_order(side, self.factor)
        # A cut before the LLM: the tokens every tile hands the LLM (set by patch_tower).
        self.kept_per_item: int | None = None

    def stage_modules(self) -> dict[str, nn.Module]:
        """The modules of the accountant's stages (pixel shuffle, between the tower and the projector, is a
        reshape inside get_image_features: no stage's work)."""
        model = self.model
        return {"vision": self.tower, "projector": hf.projector(model), "llm": hf.language_model(model),
                "lm_head": hf.lm_head(model)}

    def entry_keep(self, handle: Handle, spec: Any, keep_per_image: int | None) -> int | None:
        """A cut before the LLM shortens every tile's span unit to the tokens each tile keeps."""
        return self.kept_per_item if spec.per_item else keep_per_image

    def patch_tower(self, handle: Handle, patches: Patches, spec: Any, schedule: Any) -> None:
        """A method before the LLM on whole pixel-shuffle groups: inside InternViT's layers (FiCoCo-V's
        `reduce_groups`, or a merging `tower_step`: ToMe), or one cut per tile at the tower's output on the
        shuffled tokens (the projector's input) or on the projector's output, scored by the probed layer's
        [CLS] query and keys (InternViT's attention routed through the tower probe), pooled over each group's
        patches."""
        from ficoco.methods.contract import TowerModule, load_module
        from ficoco.methods.needs import TowerProbe
        from ficoco.models.vision_steps import TowerSlot, install_tower_rows, merged_probe

        config = self.model.config
        if getattr(config, "vision_feature_select_strategy", "default") != "default":
            raise FicocoError(f"{spec.title} on InternVL needs vision_feature_select_strategy='default' ([CLS] "
                              "dropped before pixel shuffle)")
        removals = [r for r in schedule.removals if r.stage == "vision"]
        if spec.placement == "in_layer" and hasattr(spec.load(), "reduce_groups"):
            self._patch_group_reduction(handle, patches, spec, schedule)
            return
        if spec.placement == "in_layer":
            self._patch_group_merges(handle, patches, spec, schedule)
            return
        if any(r.where not in ("tower_output", "after_projector") for r in removals) or len(removals) > 1:
            raise FicocoError(f"{spec.title} on InternVL: a method that cuts before the LLM cuts whole pixel-shuffle "
                              "groups once, at the tower's output or after the projector")
        removal = removals[0] if removals else None
        self.kept_per_item = self.units - (removal.remove - removal.added if removal is not None else 0)
        patches.on_undo(lambda: setattr(self, "kept_per_item", None))
        module = load_module(spec, TowerModule)
        settings = method_settings(handle, spec, schedule)
        last = len(self.vision_layers) - 1
        wanted: dict[int, TowerProbe] = {}
        plan = spec.probes
        for probe, layers in ((plan.step_tower_layers, [r.layer for r in removals]), (plan.last_tower_layer, [last])):
            if probe is not None and removal is not None:
                for layer in layers:
                    wanted[layer] = merged_probe(spec, layer, probe, wanted.get(layer))
        cut_layer = min(wanted) if wanted else None
        # The tower layers the method's settings name (``vision named``): probed too, handed as `TowerInput.named`.
        named = plan.named_layers(settings, len(self.vision_layers)) if removal is not None else {}
        for name, probe in plan.named_tower_layers:
            if name in named:
                wanted[named[name]] = merged_probe(spec, named[name], probe, wanted.get(named[name]))
        # InternViT has no windows: a read over the whole tile is the layer's own.
        slots = {layer: TowerSlot(want_cls=probe.cls_query, want_probabilities=probe.probabilities,
                                  runner=handle.read_runner(("vision", layer)), scores=handle.attention_scores)
                 for layer, probe in wanted.items()}
        for layer, slot in slots.items():
            parts = hf.internvl_layer_parts(self.vision_layers[layer])[0]
            install_tower_rows(parts.attention, slot, patches)
        taken: dict[int, Any] = {}
        original_tower = forward_of(self.tower)

        def tower_forward(*args: Any, **kwargs: Any) -> Any:
            taken.clear()
            for slot in slots.values():
                slot.armed = True
            try:
                return original_tower(*args, **kwargs)
            finally:
                for layer, slot in slots.items():
                    slot.armed = False
                    taken[layer] = slot.take()

        patches.set(self.tower, "forward", tower_forward)
        projector = hf.projector(self.model)
        original_projector = forward_of(projector)
        cut = functools.partial(self._cut, handle, module, settings, spec, removal, taken, cut_layer, named)

        def projector_forward(features: Tensor, *args: Any, **kwargs: Any) -> Tensor:
            if removal is None:
                return original_projector(features, *args, **kwargs)
            if removal.where == "tower_output":
                return original_projector(cut(features), *args, **kwargs)
            return cut(original_projector(features, *args, **kwargs))

        patches.set(projector, "forward", projector_forward)

    # -- FiCoCo-V: whole pixel-shuffle groups removed inside InternViT's layers -----------------------
    def _patch_group_reduction(self, handle: Handle, patches: Patches, spec: Any, schedule: Any) -> None:
        """Remove whole pixel-shuffle groups inside the tower layers of the schedule (the method module's
        `reduce_groups`: a group's scores are its patches' means, its [CLS] term the mean of [CLS]'s attention
        to them, and a removed group folds into kept ones member by member). The first reducing layer puts the
        patches in group order (members consecutive); the later layers run on the kept groups' patches. The
        tower's output is put back on the whole patch grid (removed groups empty) so that pixel shuffle runs as
        transformers wrote it, and the projector maps the kept groups' tokens only."""
        from ficoco.models.vision_steps import TowerSlot, install_tower_rows

        config = self.model.config
        last = len(self.vision_layers) - 1
        if config.vision_feature_layer not in (-1, last):
            raise FicocoError(f"{spec.title} on InternVL reduces inside the tower, so the projector must read its "
                              f"last layer (vision_feature_layer -1, not {config.vision_feature_layer})")
        removed = {r.layer: r.remove for r in schedule.removals if r.stage == "vision" and r.remove}
        self.kept_per_item = self.units - sum(removed.values())
        patches.on_undo(lambda: setattr(self, "kept_per_item", None))
        reduce_groups = spec.load().reduce_groups
        params = handle.hyperparameters
        kept = self._regrid(handle, patches)
        # [CLS], then the patches in group order: the permutation the first reducing layer applies.
        to_groups = torch.cat([torch.zeros(1, dtype=torch.long), self.order + 1])
        for index, r in removed.items():
            layer = self.vision_layers[index]
            parts, scale_1, scale_2, dropout = hf.internvl_layer_parts(layer)
            slot = TowerSlot(want_probabilities=True, runner=handle.read_runner(("vision", index)),
                             scores=handle.attention_scores)
            install_tower_rows(parts.attention, slot, patches)

            def forward(hidden_states: Tensor, *args: Any, _parts: hf.Parts = parts, _slot: TowerSlot = slot,
                        _index: int = index, _r: int = r, _dropout: nn.Module = dropout, _scale_1: Tensor = scale_1,
                        _scale_2: Tensor = scale_2, **kwargs: Any) -> Tensor:
                _slot.armed = True
                try:
                    attn_out, _ = _parts.attention(_parts.input_norm(hidden_states))
                finally:
                    _slot.armed = False
                keys, _, _, attention = _slot.take()
                hidden = hidden_states + _scale_1 * attn_out
                items = hidden.shape[0]
                groups = kept["groups"]
                if groups is None:  # the first reducing layer of this pass: patches into group order
                    order = to_groups.to(hidden.device)
                    hidden, keys = hidden[:, order], keys[:, :, order]
                    attention = attention.reordered(order)
                    groups = torch.arange(self.units, device=hidden.device).expand(items, -1)
                if not 0 <= _r < groups.shape[1]:
                    raise FicocoError(f"vision layer {_index} would remove {_r} of the {groups.shape[1]} groups left "
                                      "in a tile; at least one must stay")
                red = handle.run_method(("vision", _index), reduce_groups, hidden[:, 1:], attention, keys, _r, groups,
                                        self.grid_hw, merge=self.merge, lam=params.lam, eps=params.eps,
                                        window=params.window, coefficient=params.coefficient, has_cls=True,
                                        equivalent=params.equivalent_token)
                into = None if red.merge_target is None else self._patches_of(
                    torch.gather(red.kept_groups, 1, red.merge_target), sort=False)
                handle.record("vision", _index, kept=self._patches_of(red.kept_groups),
                              discarded=self._patches_of(red.discarded_groups), merged_into=self._targets(
                                  red.discarded_groups, into))
                kept["groups"] = red.kept_groups
                hidden = torch.cat([hidden[:, :1], red.hidden], dim=1)
                out = _dropout(_parts.mlp(_parts.post_norm(hidden)))
                return hidden + _scale_2 * out

            patches.set(layer, "forward", forward)

    # -- ToMe: whole pixel-shuffle groups merged inside InternViT's layers ------------------------------
    def _patch_group_merges(self, handle: Handle, patches: Patches, spec: Any, schedule: Any) -> None:
        """Merge whole pixel-shuffle groups inside the tower layers of the schedule (the method's `tower_step`
        on units of a group's 4 patches side by side, [CLS] a unit of its own; the matching metric is a group's
        head-mean keys averaged over its patches, a merged group stands at its destination's place). With
        proportional attention every later layer adds log(size) of a patch's group to its logits; InternViT's
        layers take no mask, so every layer from the first merge on is re-composed from its parts."""
        from ficoco.methods.contract import TowerModule, load_module
        from ficoco.methods.inputs import TowerInput
        from ficoco.models.vision_steps import TowerSlot, install_tower_rows

        config = self.model.config
        last = len(self.vision_layers) - 1
        if config.vision_feature_layer not in (-1, last):
            raise FicocoError(f"{spec.title} on InternVL merges inside the tower, so the projector must read its "
                              f"last layer (vision_feature_layer -1, not {config.vision_feature_layer})")
        settings = method_settings(handle, spec, schedule)
        module = load_module(spec, TowerModule)
        rates = {r.layer: r.remove for r in schedule.removals if r.stage == "vision" and r.remove}
        self.kept_per_item = self.units - sum(rates.values())
        patches.on_undo(lambda: setattr(self, "kept_per_item", None))
        kept = self._regrid(handle, patches)
        to_groups = torch.cat([torch.zeros(1, dtype=torch.long), self.order + 1])
        first = min(rates) if rates else len(self.vision_layers)
        for index in range(first, len(self.vision_layers)):
            layer = self.vision_layers[index]
            parts, scale_1, scale_2, dropout = hf.internvl_layer_parts(layer)
            slot = None
            if rates.get(index):
                slot = TowerSlot()
                install_tower_rows(parts.attention, slot, patches)

            def forward(hidden_states: Tensor, *args: Any, _parts: hf.Parts = parts, _slot: TowerSlot | None = slot,
                        _index: int = index, _r: int = rates.get(index, 0), _dropout: nn.Module = dropout,
                        _scale_1: Tensor = scale_1, _scale_2: Tensor = scale_2, **kwargs: Any) -> Tensor:
                bias = kept["bias"]
                if _slot is not None:
                    _slot.armed = True
                try:
                    mask = None if bias is None else bias.to(hidden_states.dtype)
                    attn_out, _ = _parts.attention(_parts.input_norm(hidden_states), attention_mask=mask)
                finally:
                    if _slot is not None:
                        _slot.armed = False
                hidden = hidden_states + _scale_1 * attn_out
                if _slot is not None:
                    keys = _slot.take()[0]
                    items, width = hidden.shape[0], hidden.shape[-1]
                    groups = kept["groups"]
                    if groups is None:  # the first merge of this pass: patches into group order
                        order = to_groups.to(hidden.device)
                        hidden, keys = hidden[:, order], keys[:, :, order]
                        groups = torch.arange(self.units, device=hidden.device).expand(items, -1)
                        kept["size"] = torch.ones(items, 1 + self.units, device=hidden.device)
                    # [CLS] a unit of its own (its width padded: ToMe never merges or changes it).
                    cls = torch.cat([hidden[:, :1], hidden.new_zeros(items, 1, width * (self.merge - 1))], dim=-1)
                    units = torch.cat([cls, hidden[:, 1:].reshape(items, -1, width * self.merge)], dim=1)
                    # The groups stay in image order (pixel shuffle and the projector read them so); a method with an
                    # order of its own (ToMe's official one) carries it in `sequence`.
                    inputs = TowerInput(hidden=units, has_cls=True, remove=_r, keys=keys, size=kept["size"],
                                        positions=torch.cat([torch.zeros_like(groups[:, :1]), groups + 1], dim=1),
                                        merge=self.merge, grid_hw=self.grid_hw, image_order=True,
                                        sequence=kept["sequence"])
                    out = handle.run_method(("vision", _index), module.tower_step, inputs, settings)
                    kept["sequence"] = out.sequence
                    merged = out.positions[:, 1:] - 1  # the original group every unit that goes on stands at
                    discarded = self._gone(groups, merged)
                    handle.record("vision", _index, kept=self._patches_of(merged),
                                  discarded=self._patches_of(discarded))
                    kept.update(groups=merged, size=out.size)
                    hidden = torch.cat([out.hidden[:, :1, :width], out.hidden[:, 1:].reshape(items, -1, width)], 1)
                    if out.attention_bias is not None:  # log(size) for [CLS] and every patch of a group
                        logs = out.size.log()
                        kept["bias"] = torch.cat([logs[:, :1], logs[:, 1:].repeat_interleave(self.merge, dim=1)],
                                                 dim=1)[:, None, None, :]
                out = _dropout(_parts.mlp(_parts.post_norm(hidden)))
                return hidden + _scale_2 * out

            patches.set(layer, "forward", forward)

    def _gone(self, before: Tensor, after: Tensor) -> Tensor:
        """(items, r) the groups of `before` that `after` no longer holds, ascending."""
        from ficoco.models.vision_steps import complement

        absent = complement(before, self.units, self.units - before.shape[1])  # gone before this layer
        return complement(torch.cat([after, absent], dim=1), self.units, before.shape[1] - after.shape[1])

    def _regrid(self, handle: Handle, patches: Patches) -> dict[str, Any]:
        """The tower's and the projector's patches of a method inside the tower: the tower's output put back on
        the whole patch grid ([CLS], then every kept group's patches at their row-major places, removed groups
        empty) so that pixel shuffle runs as transformers wrote it; the projector maps the kept groups' tokens
        only, in group order. Returns the pass's state: its kept groups ("groups", (items, k) ascending; None
        before the first reduction of a pass) and what the method carries between layers."""
        kept: dict[str, Any] = {"groups": None, "size": None, "bias": None, "sequence": None}
        members = self.order.view(self.units, self.merge)  # a group's patches, row-major on the tile's grid
        original_tower = forward_of(self.tower)

        def tower_forward(*args: Any, **kwargs: Any) -> Any:
            kept.update(groups=None, size=None, bias=None, sequence=None)
            out = original_tower(*args, **kwargs)
            groups = kept["groups"]
            if groups is not None:  # back on the whole grid: [CLS], then every patch at its row-major place
                hidden = out.last_hidden_state
                full = hidden.new_zeros(hidden.shape[0], 1 + self.patches, hidden.shape[-1])
                places = members.to(hidden.device)[groups].flatten(1) + 1
                full[:, 0] = hidden[:, 0]
                full = full.scatter(1, places.unsqueeze(-1).expand(-1, -1, hidden.shape[-1]), hidden[:, 1:])
                out.last_hidden_state = full
            return out

        patches.set(self.tower, "forward", tower_forward)
        projector = hf.projector(self.model)
        original_projector = forward_of(projector)

        def projector_forward(features: Tensor, *args: Any, **kwargs: Any) -> Tensor:
            groups = kept["groups"]
            if groups is not None:  # the shuffled tokens of the kept groups, in group order
                features = torch.gather(features, 1, groups.to(features.device).unsqueeze(-1).expand(
                    -1, -1, features.shape[-1]))
                handle.measured_tokens_per_item = int(features.shape[1])
            return original_projector(features, *args, **kwargs)

        patches.set(projector, "forward", projector_forward)
        return kept

    def _targets(self, discarded: Tensor, into: Tensor | None) -> Tensor | None:
        """For every patch of the `discarded` groups, in ascending patch order, the patch it was folded into
        (member m of a group into member m of its target group, `into`: the targets' patches group by group)."""
        if into is None:
            return None
        own = self.order.to(discarded.device).view(-1, self.merge)[discarded].flatten(1)
        return torch.gather(into, 1, own.argsort(dim=1))

    def _cut(self, handle: Handle, module: Any, settings: dict[str, Any], spec: Any, removal: Any,
             taken: dict[int, Any], cut_layer: int | None, named: dict[str, int], features: Tensor) -> Tensor:
        """Run the method's `tower_step` on every tile's groups `features` (tiles, units, W); the tokens that
        go on, in the method's order."""
        from ficoco.methods.inputs import TowerInput, TowerLayerProbe
        from ficoco.models.vision_steps import complement, prompt_text

        items, units = features.shape[:2]
        if units != self.units:
            raise FicocoError(f"{spec.title} cuts {self.units} pixel-shuffle groups per tile, but the projector "
                              f"received {units}; vision_feature_select_strategy must be 'default'")
        keys = query = scale = attention = None
        if cut_layer is not None:
            keys, query, scale, attention = self._in_group_order(taken[cut_layer], features.device)
        layers = {name: TowerLayerProbe(layer, *self._in_group_order(taken[layer], features.device))
                  for name, layer in named.items()} or None
        taken.clear()
        text = text_mask = None
        if spec.probes.input_embeddings:
            text, text_mask = prompt_text(handle, self, items, spec.title)
        inputs = TowerInput(hidden=features, has_cls=True, remove=removal.remove, added=removal.added, keys=keys,
                            cls_query=query, scale=scale, attention=attention, grid_hw=self.grid_hw, text=text,
                            text_mask=text_mask, merge=self.merge, named=layers)
        out = handle.run_method(("projector", None), module.tower_step, inputs, settings)
        hidden = out.hidden
        if out.counts is not None:
            # An adaptive count (PruMerge+ without keep=): one host read. The tiles of a call must agree, since
            # their span units are shortened alike.
            counts = sorted(set(out.counts.tolist()))
            if len(counts) > 1:
                raise FicocoError(f"{spec.title}'s adaptive count differs between the tiles of this call "
                                  f"({', '.join(map(str, counts))} tokens): give a fixed count with keep=")
            hidden = hidden[:, :counts[0]]
        kept = out.kept[:, :hidden.shape[1]]
        gone = complement(kept, units)
        handle.record("vision", removal.layer, kept=self._patches_of(kept), discarded=self._patches_of(gone))
        handle.measured_tokens_per_item = int(hidden.shape[1])
        handle.vision_state = kept  # the group every token continues: its place in the tile's span unit
        return hidden

    def _in_group_order(self, probe: tuple[Any, ...], device: torch.device) -> tuple[Any, ...]:
        """A probed layer's (keys, [CLS] query, scale, reads) with its tokens as a cut reads them: [CLS] first, then
        every patch in group order (a group's members consecutive, `TowerInput.merge`)."""
        keys, query, scale, attention = probe
        order = torch.cat([torch.zeros(1, dtype=torch.long), self.order + 1])
        if keys is not None:
            keys = keys[:, :, order.to(keys.device)].to(device)
        if attention is not None:
            attention = attention.reordered(order.to(device))
        return keys, None if query is None else query.to(device), scale, attention

    def _patches_of(self, groups: Tensor, sort: bool = True) -> Tensor:
        """(items, k * merge) the row-major patch indices of the groups `groups` (items, k), ascending (or group
        by group, members in order, without `sort`); a -1 (a token without a group: merged from many) gives -1s."""
        members = self.order.to(groups.device).view(-1, self.merge)[groups.clamp(min=0)]
        members = torch.where((groups >= 0).unsqueeze(-1), members, torch.full_like(members, -1)).flatten(1)
        return members.sort(dim=1).values if sort else members


def synthetic_inputs(model: nn.Module, *, batch: int = 1, text_tokens: int = 60, seed: int = 0,
                     dtype: torch.dtype | None = None, device: torch.device | str | None = None,
                     image_size: tuple[int, int] | None = None) -> dict[str, Tensor]:
    """input_ids, attention_mask and pixel_values (batch x tiles, 3, tile, tile) for `batch` prompts of one
    image of `image_size` (H, W; the profile's by default), laid out as InternVL's processor and its Qwen2
    chat template lay them out: "<|im_start|>user\\n<img>" + image_seq_length `<IMG_CONTEXT>` per tile (the
    tiles of the processor's dynamic tiling, a thumbnail when more than one) + "</img>\\n{question}<|im_end|>
    \\n<|im_start|>assistant\\n", `text_tokens` text tokens in all (random ordinary ids for the words)."""
    from ficoco.profiles import FAMILY_DEFAULTS

    config = model.config
    if config.model_type != "internvl":
        raise FicocoError(f"these synthetic inputs are laid out for InternVL only, not '{config.model_type}'")
    fixed = PREFIX_TOKENS + _SUFFIX_TEMPLATE_TOKENS
    if text_tokens < fixed:
        raise FicocoError(f"text_tokens= must be at least the {fixed} template tokens around the image")
    defaults = {**FAMILY_DEFAULTS["internvl"], **(getattr(model, "_ficoco_defaults", None) or {})}
    vision = config.vision_config
    tile = tuple(vision.image_size) if isinstance(vision.image_size, (list, tuple)) else (vision.image_size,) * 2
    height, width = (int(v) for v in (image_size or defaults["image_size"]))
    tiles = hf.internvl_tiles((height, width), tile, int(defaults["min_tiles"]), int(defaults["max_tiles"]))
    image = config.image_token_id
    column = functools.partial(torch.full, (batch, 1), dtype=torch.long)
    text_vocab = min(config.text_config.vocab_size, image - _IM_START) - 3
    generator = torch.Generator().manual_seed(seed)
    words = torch.randint(3, 3 + text_vocab, (batch, text_tokens), generator=generator)
    question = text_tokens - fixed
    input_ids = torch.cat([
        column(image - _IM_START), words[:, :2], column(image - _IMG_START),  # <|im_start|> user \n <img>
        torch.full((batch, tiles * config.image_seq_length), image, dtype=torch.long),
        column(image - _IMG_END), words[:, 2:3 + question],  # </img> \n {question}
        column(image - _IM_END), words[:, 3 + question:4 + question], column(image - _IM_START),
        words[:, 4 + question:6 + question],  # <|im_end|> \n <|im_start|> assistant \n
    ], dim=1)
    pixels = torch.randn(batch * tiles, vision.num_channels, *tile, generator=generator)
    return place_inputs(model, input_ids, "pixel_values", pixels, dtype=dtype, device=device)


# InternVL3's -hf chat template puts an image first in the user's turn, as this documented form does.
INTERNVL_TEMPLATE = "<|im_start|>user\n<IMG_CONTEXT>\n{question}<|im_end|>\n<|im_start|>assistant\n"


def encode_pieces(processor: Any, media: str, text: str, pictures: list[Any], placeholder: str,
                  config: dict[str, Any]) -> dict[str, Tensor]:
    """A prompt from the processor's pieces (InternVLProcessor holds a video processor, which transformers 5
    builds only with torchvision): the image processor's tiles (crop_to_patches on, as InternVLProcessor
    sets it), and the processor's own expansion of the placeholder: "<img>" + image_seq_length x tiles
    placeholders + "</img>"."""
    pixels = processor.image_processor(images=pictures, crop_to_patches=True, return_tensors="pt")
    tiles = int(pixels["num_patches"][0]) if "num_patches" in pixels else int(pixels["pixel_values"].shape[0])
    seq = int(config.get("image_seq_length", 256))
    tokenizer = processor.tokenizer
    start = getattr(tokenizer, "start_image_token", "<img>")
    end = getattr(tokenizer, "end_image_token", "</img>")
    ids = tokenizer([text.replace(placeholder, start + placeholder * (seq * tiles) + end)], return_tensors="pt")
    return {**ids, "pixel_values": pixels["pixel_values"]}


def picture_size(encoded: dict[str, Tensor], config: dict[str, Any], picture: Any,
                 visual_tokens: int) -> tuple[tuple[int, int], str | None]:
    """The image's own size: the accountant tiles it as the processor did (its min and max tiles are the
    profile's ficoco.min_tiles and max_tiles)."""
    return (picture.height, picture.width), None


PROMPT = PromptFormat(template=INTERNVL_TEMPLATE, encode_pieces=encode_pieces, image_size=picture_size)
