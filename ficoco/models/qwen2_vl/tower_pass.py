"""Qwen2-VL's packed tower pass: what every image still holds while a method runs inside the tower's
blocks (`TowerPass`), and what runs the blocks with a method in them (`TowerBlocks`: FiCoCo-V's
reduction of whole merge groups, ToMe's merges of them).

The tower runs every image of a batch as one flat sequence, `cu_seqlens` cutting it into images
(Qwen2.5-VL: into windows as well) and a (tokens, head_dim) rotary table giving each patch its 2-D
place; its tokens come in merge-group order (the 4 patches of a 2 x 2 group are consecutive), so the
methods act on whole groups. After a reducing block the later blocks get the rotary table sliced to
the kept patches and the segments of the shorter images, which the tower's order
(`ficoco.models.qwen2_vl.order.GridOrder`) gives them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ficoco.errors import FicocoError
from ficoco.methods.reads.ops import stack_reads
from ficoco.models import hf_compat as hf
from ficoco.models.attention import install_probe, own_attention, remove_probe, route_attention
from ficoco.models.patching import Patches, follow_device, forward_of

if TYPE_CHECKING:
    from ficoco.models.handle import Handle
    from ficoco.models.qwen2_vl.adapter import Qwen2VLAdapter


def group_members(groups: Tensor, grid_w: int, merge_size: int) -> Tensor:
    """Row-major patch-grid indices of the members of `groups`, group by group, members in
    row-major order within the group: `(B, K)` -> `(B, K * merge_size**2)`."""
    cols = grid_w // merge_size
    row, col = groups // cols, groups % cols
    offsets = torch.arange(merge_size, device=groups.device)
    rows = (row[:, :, None] * merge_size + offsets).unsqueeze(3)  # (B, K, m, 1)
    cols_ = (col[:, :, None] * merge_size + offsets).unsqueeze(2)  # (B, K, 1, m)
    return (rows * grid_w + cols_).flatten(1)


def group_patches(groups: Tensor, grid_w: int, merge_size: int = 2) -> Tensor:
    """Row-major indices on the patch grid of the patches of `groups` (group-grid indices),
    sorted: `(B, K)` groups -> `(B, K * merge_size**2)` patches."""
    return group_members(groups, grid_w, merge_size).sort(dim=1).values


def group_patch_targets(discarded: Tensor, targets: Tensor, grid_w: int, merge_size: int = 2) -> Tensor:
    """For every patch of the `discarded` groups, in `group_patches(discarded)` order, the patch
    of its target group (`targets`, `(B, r)`, group-grid indices) it was folded into: member m of
    a group goes into member m of its target."""
    members = group_members(discarded, grid_w, merge_size)
    order = members.argsort(dim=1)
    return torch.gather(group_members(targets, grid_w, merge_size), 1, order)


@dataclass
class TowerPass:
    """One run of the vision tower under a method before the LLM (FiCoCo-V, ToMe, a cut): what every
    image still holds. The adapter keeps the current one (`Qwen2VLAdapter.tower_pass`)."""

    grids: list[tuple[int, int]]  # (rows, cols) of patches of every image
    kept_groups: list[Tensor]  # per image: original group index of every group still present
    merge: int
    # Set by the first reducing layer, for the blocks after it.
    cu_seqlens: Tensor | None = None
    max_seqlen: int | None = None
    position_embeddings: tuple[Tensor, Tensor] | None = None
    # ToMe: per image, how many original groups every group stands for, and the log of it per patch
    # (proportional attention: every later block adds it to its keys' logits); None before a merge.
    size: list[Tensor] | None = None
    bias: list[Tensor | None] = field(default_factory=list)
    # A method with an order of its own (ToMe's official one): per image, that order of its groups (indices into
    # them, `TowerOutput.sequence`), carried between blocks while the groups stay in image order; None: image order.
    sequence: list[Tensor | None] = field(default_factory=list)
    # Per item: its temporal slices (video_grid_thw's t; 1 for an image), whose groups `kept_groups` numbers
    # slice by slice (slice x groups per slice + group).
    frames: list[int] = field(default_factory=list)
    # A cut at the tower's input (PixelPrune): the rows of the packed sequence the first block keeps, until it ran.
    input_rows: Tensor | None = None

    @property
    def lengths(self) -> list[int]:
        return [self.merge * len(groups) for groups in self.kept_groups]


# The packed tower's attention runs one call per image (cu_seqlens segments, outside flash attention):
# a routed module keeps each call's keys and adds each image's proportional-attention bias (ToMe).
CHUNKS_IMPLEMENTATION = "ficoco_qwen2_vl_chunks"


@dataclass
class _ChunkSlot:
    """One tower block's routed attention in one call of the block: per image, in call order."""

    bias: list[Tensor | None] = field(default_factory=list)  # (1, 1, 1, T_i) additive logits, or None
    keys: list[Tensor] = field(default_factory=list)  # (1, H, T_i, d) post-rotary keys, when armed
    armed: bool = False
    call: int = 0


def chunks_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                     **kwargs: Any) -> tuple[Tensor, Any]:
    """The module's own attention on one image's segment, with that image's bias added to the keys'
    logits and its keys kept when the slot is armed."""
    slot: _ChunkSlot = module._ficoco_chunks  # type: ignore[assignment]
    index, slot.call = slot.call, slot.call + 1
    if slot.armed:
        slot.keys.append(key)
    bias = slot.bias[index] if index < len(slot.bias) else None
    if bias is not None:
        bias = bias.to(query.dtype)
        attention_mask = bias if attention_mask is None else attention_mask + bias
    return own_attention(module, module._ficoco_chunks_config, query, key, value, attention_mask, **kwargs)


hf.register_attention(CHUNKS_IMPLEMENTATION, chunks_attention)


def attention_pairs(cu_seqlens: Tensor) -> int:
    """Query-key pairs of a block's attention over the segments `cu_seqlens` cuts (sum of length^2)."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    return int((lengths * lengths).sum())


class TowerBlocks:
    """The tower's blocks with a method inside them, on whole merge groups: FiCoCo-V's reduction
    (`patch_vision`) and ToMe's merges (`patch_merges`). The adapter's tower order (`adapter.order`)
    gives every block its segments and puts the pass in the order the method reads."""

    def __init__(self, adapter: Qwen2VLAdapter) -> None:
        self.adapter = adapter

    # -- FiCoCo-V: reductions of whole merge groups inside tower blocks ----------------------
    def patch_vision(self, handle: Handle, patches: Patches, removed: dict[int, int],
                     reduce_groups: Callable[..., Any]) -> None:
        """Reduce whole merge groups in the ViT blocks of `removed`; the blocks after the first
        reducing one run on the kept patches' rotary table and on the segments the tower's order
        (`adapter.order`) gives them: the shorter images, or the windows the kept groups form."""
        adapter = self.adapter
        params = handle.hyperparameters
        order = adapter.order
        visual = adapter.visual
        original_tower = forward_of(visual)
        slots: list[Any] = []
        pairs = handle.vision_attention_pairs

        def tower_forward(hidden_states: Tensor, grid_thw: Tensor, **kwargs: Any) -> Any:
            adapter.tower_pass = order.start_pass(grid_thw)
            if order.records_pairs:
                pairs.clear()
            for slot in slots:  # nothing left over from a pass that ended in an error
                slot.chunks.clear()
            return original_tower(hidden_states, grid_thw, **kwargs)

        patches.set(visual, "forward", tower_forward)
        patches.on_undo(lambda: setattr(adapter, "tower_pass", None))
        adapter.removed_per_image = sum(removed.values())
        first = min(removed) if removed else len(adapter.vision_layers)
        # Every block when its pairs are recorded (the windows it runs follow the reductions), else from the first.
        for layer_idx in range(0 if order.records_pairs else first, len(adapter.vision_layers)):
            layer = adapter.vision_layers[layer_idx]
            r = removed.get(layer_idx, 0)
            slot = None
            parts = hf.layer_parts(layer, hf.QWEN2_VL_VISION_BLOCK)
            if r:
                slot = install_probe(parts.attention, want_keys=True, chunked=True,
                                     runner=handle.read_runner(("vision", layer_idx)), scores=handle.attention_scores)
                slots.append(slot)
                patches.on_undo(lambda attn=parts.attention: remove_probe(attn))

            original = forward_of(layer)  # accelerate's wrapped forward where a device map hooked it
            def forward(hidden_states: Tensor, cu_seqlens: Tensor, position_embeddings: Any = None, *,
                        _parts: hf.Parts = parts, _slot: Any = slot, _r: int = r, _idx: int = layer_idx,
                        _original: Callable[..., Tensor] = original, **kwargs: Any) -> Tensor:
                tower = adapter.tower_pass
                if tower is not None:  # a tower split across devices (device maps)
                    follow_device(tower, hidden_states.device)
                cu_seqlens, position_embeddings = order.segments(tower, _idx, cu_seqlens, position_embeddings, kwargs)
                if order.records_pairs:
                    pairs[_idx] = attention_pairs(cu_seqlens)
                if tower is None or not _r:
                    return _original(hidden_states, cu_seqlens=cu_seqlens, position_embeddings=position_embeddings,
                                     **kwargs)
                residual = hidden_states
                attn_out = _parts.attention(_parts.input_norm(hidden_states), cu_seqlens=cu_seqlens,
                                            position_embeddings=position_embeddings, **kwargs)
                hidden = residual + attn_out
                chunks = order.image_chunks(tower, _idx, _slot.take_chunks())
                # The pass's bookkeeping (DeepStack's riding features, the positions and segments of the groups
                # left) is the method's work as much as its step: timed with it.
                with handle.timer.span("reduction", hidden.device):
                    hidden = self._reduce(handle, reduce_groups, tower, hidden, chunks, _r, _idx,
                                          position_embeddings, cu_seqlens, params)
                    order.after_reduce(tower, cu_seqlens)
                return hidden + _parts.mlp(_parts.post_norm(hidden))

            patches.set(layer, "forward", forward)
        order.patch_merger(patches)

    def _reduce(self, handle: Handle, reduce_groups: Callable[..., Any], tower: TowerPass, hidden: Tensor,
                chunks: list[tuple[Tensor, Any]], r: int, layer_idx: int,
                position_embeddings: tuple[Tensor, Tensor], cu_seqlens: Tensor, params: Any) -> Tensor:
        """Remove `r` groups of every image (one batched step per image size); update the pass."""
        adapter = self.adapter
        lengths = tower.lengths
        if len(chunks) != len(lengths):
            raise RuntimeError(f"the vision attention ran {len(chunks)} segments for {len(lengths)} images")
        sizes: dict[tuple[int, int], list[int]] = {}
        for image, grid in enumerate(tower.grids):
            sizes.setdefault(grid, []).append(image)
        pieces = hidden.split(lengths) if len(sizes) > 1 else None
        new_hidden: list[Tensor | None] = [None] * len(lengths)
        kept_positions: list[Tensor | None] = [None] * len(lengths)
        for (rows, cols), images in sizes.items():
            groups = len(tower.kept_groups[images[0]])
            if not 0 <= r < groups:
                raise FicocoError(f"vision layer {layer_idx} would remove {r} of the {groups} merge groups left in "
                                  f"an image of {rows}x{cols} patches; at least one must stay (plan the schedule "
                                  "for this image size)")
            if pieces is None:
                x = hidden.view(len(images), lengths[0], hidden.shape[-1])
            else:
                x = torch.stack([pieces[i] for i in images])
            attn = stack_reads([chunks[i][0] for i in images])
            # One image's keys as its attention call kept them (a copy per reducing layer otherwise).
            keys = chunks[images[0]][1] if len(images) == 1 else torch.cat([chunks[i][1] for i in images])
            index = torch.stack([tower.kept_groups[i] for i in images])
            # Per-group features that ride with the patches (Qwen3-VL's DeepStack taps so far): FiCoCo-V decides
            # from the attention and keys alone, so they are folded with the weights the groups are folded with.
            riding = adapter.riding_features(tower, images)
            red = handle.run_method(("vision", layer_idx), reduce_groups, x, attn, keys, r, index,
                                    (rows // adapter.merge_size, cols // adapter.merge_size), merge=adapter.merge,
                                    lam=params.lam, eps=params.eps, window=params.window,
                                    coefficient=params.coefficient, riding=riding)
            merged_into = None if red.merge_target is None else group_patch_targets(
                red.discarded_groups, torch.gather(red.kept_groups, 1, red.merge_target), cols, adapter.merge_size)
            handle.record("vision", layer_idx, kept=group_patches(red.kept_groups, cols, adapter.merge_size),
                          discarded=group_patches(red.discarded_groups, cols, adapter.merge_size),
                          merged_into=merged_into)
            adapter.follow_groups(tower, images, red.kept_positions, merges=True, features=red.riding)
            for b, image in enumerate(images):
                new_hidden[image] = red.hidden[b]
                kept_positions[image] = red.kept_positions[b]
                tower.kept_groups[image] = red.kept_groups[b]
        members = torch.arange(adapter.merge, device=hidden.device)
        starts = [0, *torch.tensor(lengths).cumsum(0).tolist()[:-1]]
        rows_now = torch.cat([start + (kept[:, None] * adapter.merge + members).flatten()
                              for start, kept in zip(starts, kept_positions, strict=True)])
        tower.position_embeddings = (position_embeddings[0][rows_now], position_embeddings[1][rows_now])
        new_lengths = torch.tensor(tower.lengths, device=cu_seqlens.device)
        tower.cu_seqlens = F.pad(new_lengths.cumsum(0), (1, 0)).to(cu_seqlens.dtype)
        tower.max_seqlen = max(tower.lengths)
        if pieces is None:  # one image size, so one step above: its output holds every image, in order
            return red.hidden.reshape(-1, hidden.shape[-1])
        return torch.cat(new_hidden)

    # -- merges of whole merge groups inside tower blocks (ToMe) ------------------------------
    def patch_merges(self, handle: Handle, patches: Patches, spec: Any, schedule: Any) -> None:
        """A method that merges units inside tower blocks (ToMe's `tower_step`), on whole merge groups:
        a group's patches side by side are one unit, its head-mean keys averaged over the group are
        the matching metric, a merged group stands at its destination's place (the rotary table and
        the segments follow, as FiCoCo-V's path does), and with proportional attention every later block
        adds log(size) to each patch's logits, image by image. The tower's order (`adapter.order`) gives the
        segments, the calls' biases and keys, and the merge step in it."""
        from ficoco.models.patching import method_settings

        adapter = self.adapter
        module = spec.load()
        settings = method_settings(handle, spec, schedule)
        rates = {r.layer: r.remove for r in schedule.removals if r.stage == "vision" and r.where == "in_layer"}
        adapter.removed_per_image = sum(rates.values())
        order = adapter.order
        visual = adapter.visual
        original_tower = forward_of(visual)
        pairs = handle.vision_attention_pairs

        def tower_forward(hidden_states: Tensor, grid_thw: Tensor, **kwargs: Any) -> Any:
            adapter.tower_pass = order.start_pass(grid_thw)
            if order.records_pairs:
                pairs.clear()
            return original_tower(hidden_states, grid_thw, **kwargs)

        patches.set(visual, "forward", tower_forward)
        patches.on_undo(lambda: setattr(adapter, "tower_pass", None))
        first = min(rates) if rates else len(adapter.vision_layers)
        # Every block when its pairs are recorded (the windows it runs follow the merges), else from the first merge.
        for layer_idx in range(0 if order.records_pairs else first, len(adapter.vision_layers)):
            layer = adapter.vision_layers[layer_idx]
            parts = hf.layer_parts(layer, hf.QWEN2_VL_VISION_BLOCK)
            slot = None
            if layer_idx >= first:
                slot = _ChunkSlot()
                route_attention(parts.attention, CHUNKS_IMPLEMENTATION, patches, "_ficoco_chunks_config",
                                _ficoco_chunks=slot)

            original = forward_of(layer)  # accelerate's wrapped forward where a device map hooked it
            def forward(hidden_states: Tensor, cu_seqlens: Tensor, position_embeddings: Any = None, *,
                        _parts: hf.Parts = parts, _slot: _ChunkSlot | None = slot, _r: int = rates.get(layer_idx, 0),
                        _idx: int = layer_idx, _original: Callable[..., Tensor] = original,
                        **kwargs: Any) -> Tensor:
                tower = adapter.tower_pass
                if tower is not None:  # a tower split across devices (device maps)
                    follow_device(tower, hidden_states.device)
                cu_seqlens, position_embeddings = order.segments(tower, _idx, cu_seqlens, position_embeddings, kwargs)
                if order.records_pairs:
                    pairs[_idx] = attention_pairs(cu_seqlens)
                if _slot is None:
                    return _original(hidden_states, cu_seqlens=cu_seqlens, position_embeddings=position_embeddings,
                                     **kwargs)
                _slot.call, _slot.keys = 0, []
                _slot.bias = order.call_bias(tower, _idx) if tower is not None else []
                _slot.armed = tower is not None and bool(_r)
                if not _slot.armed:
                    return _original(hidden_states, cu_seqlens=cu_seqlens, position_embeddings=position_embeddings,
                                     **kwargs)
                try:
                    attn_out = _parts.attention(_parts.input_norm(hidden_states), cu_seqlens=cu_seqlens,
                                                position_embeddings=position_embeddings, **kwargs)
                finally:
                    _slot.armed = False
                keys = order.block_keys(tower, _idx, _slot.keys)
                step = functools.partial(self._merge, handle=handle, module=module, settings=settings, r=_r,
                                         layer_idx=_idx)
                hidden = hidden_states + attn_out
                with handle.timer.span("reduction", hidden.device):  # the pass's bookkeeping too, as above
                    hidden = order.merge(step, tower, hidden, keys, position_embeddings, cu_seqlens)
                return hidden + _parts.mlp(_parts.post_norm(hidden))

            patches.set(layer, "forward", forward)
        order.patch_merger(patches)

    def _merge(self, tower: TowerPass, hidden: Tensor, keys: list[Tensor], position_embeddings: tuple[Tensor, Tensor],
               cu_seqlens: Tensor, *, handle: Handle, module: Any, settings: dict[str, Any], r: int,
               layer_idx: int) -> Tensor:
        """Merge `r` groups of every image (one batched call per image size), the groups in the pass's order
        (`GridOrder.merge` hands them over in grid order); update the pass."""
        from ficoco.methods.inputs import TowerInput

        adapter = self.adapter
        lengths = tower.lengths
        if len(keys) != len(lengths):
            raise RuntimeError(f"the vision attention ran {len(keys)} segments for {len(lengths)} images")
        if tower.size is None:
            tower.size = [torch.ones(len(groups), device=hidden.device) for groups in tower.kept_groups]
            tower.bias = [None] * len(lengths)
            tower.sequence = [None] * len(lengths)
        sizes: dict[tuple[int, int], list[int]] = {}
        for image, grid in enumerate(tower.grids):
            sizes.setdefault(grid, []).append(image)
        pieces = hidden.split(lengths)
        new_hidden: list[Tensor | None] = [None] * len(lengths)
        current: list[Tensor | None] = [None] * len(lengths)
        width = hidden.shape[-1] * adapter.merge
        for (rows, cols), images in sizes.items():
            before = torch.stack([tower.kept_groups[i] for i in images])
            units = torch.stack([pieces[i] for i in images]).view(len(images), -1, width)
            # Per-group features that ride with the units (Qwen3-VL's DeepStack taps so far): ToMe matches by the
            # keys alone, so they average with the sizes the units average with.
            riding = adapter.riding_features(tower, images)
            if riding is not None:
                units = torch.cat([units, riding.to(units.dtype)], dim=-1)
            # The groups stay in image order (the PatchMerger and the 3-D positions read them so); a method with an
            # order of its own (ToMe's official one) carries it in `sequence`, per image.
            carried = [tower.sequence[i] for i in images]
            inputs = TowerInput(hidden=units, has_cls=False, remove=r, keys=torch.cat([keys[i] for i in images]),
                                size=torch.stack([tower.size[i] for i in images]), positions=before,
                                merge=adapter.merge, grid_hw=(rows // adapter.merge_size, cols // adapter.merge_size),
                                image_order=True,
                                sequence=None if any(q is None for q in carried) else torch.stack(carried))
            out = handle.run_method(("vision", layer_idx), module.tower_step, inputs, settings)
            kept = out.positions  # original group of every unit that goes on, in image order
            gone = torch.zeros(len(images), rows * cols // adapter.merge, dtype=torch.bool, device=kept.device)
            # Tensor sources (fvcore's torch.jit trace has no scatter overload for a bool scalar).
            gone = gone.scatter(1, before, torch.ones_like(before, dtype=torch.bool)).scatter(
                1, kept, torch.zeros_like(kept, dtype=torch.bool))
            discarded = torch.sort((~gone).to(torch.int8), dim=1, stable=True).indices[:, :r]
            handle.record("vision", layer_idx, kept=group_patches(kept, cols, adapter.merge_size),
                          discarded=group_patches(discarded, cols, adapter.merge_size))
            # Where the units that go on were among this block's units (both lists ascending).
            where = torch.searchsorted(before, kept)
            merged = out.hidden[..., :width]
            adapter.follow_groups(tower, images, where, merges=True,
                                  features=None if riding is None else out.hidden[..., width:])
            for b, image in enumerate(images):
                new_hidden[image] = merged[b].reshape(-1, hidden.shape[-1])
                current[image] = where[b]
                tower.kept_groups[image] = kept[b]
                tower.size[image] = out.size[b]
                tower.sequence[image] = None if out.sequence is None else out.sequence[b]
                tower.bias[image] = None if out.attention_bias is None else \
                    out.size[b].log().repeat_interleave(adapter.merge)[None, None, None, :]
        members = torch.arange(adapter.merge, device=hidden.device)
        starts = [0, *torch.tensor(lengths).cumsum(0).tolist()[:-1]]
        rows_now = torch.cat([start + (units[:, None] * adapter.merge + members).flatten()
                              for start, units in zip(starts, current, strict=True)])
        tower.position_embeddings = (position_embeddings[0][rows_now], position_embeddings[1][rows_now])
        tower.cu_seqlens = F.pad(torch.tensor(tower.lengths, device=cu_seqlens.device).cumsum(0), (1, 0)).to(
            cu_seqlens.dtype)
        tower.max_seqlen = max(tower.lengths)
        return torch.cat(new_hidden)  # type: ignore[arg-type]
