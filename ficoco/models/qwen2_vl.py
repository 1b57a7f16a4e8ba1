"""FiCoCo inside Hugging Face's Qwen2-VL (`Qwen2VLForConditionalGeneration`): a ViT without
[CLS] over native-resolution patches, a PatchMerger that joins every 2 x 2 group of patches
into one LLM token, and a Qwen2 decoder with multimodal (3-D) rotary positions.

FiCoCo-L is the base adapter's (`FamilyAdapter`, as LLaVA's): the decoder layers have the same parts and signature,
the 3-D positions arrive as one (B, T, head_dim) rotary table per sequence, which the wrapped
layers slice with the kept tokens like LLaVA's, and decoding needs nothing more because layer
0 (never reduced) keeps the full prompt, so transformers' `rope_deltas` and the cache length
are the unreduced layout's.

FiCoCo-V is this file's:

- The ViT runs every image of a batch as one flat sequence, `cu_seqlens` cutting it into
  images and a (tokens, head_dim) rotary table giving each patch its 2-D place. Its tokens
  come in merge-group order (the 4 patches of a 2 x 2 group are consecutive), so V removes
  whole groups: a group's score and correlation are its members' means, the semantic term
  is the equivalent token's (no [CLS]), the local penalty works on the grid of groups, and
  compressing folds a group into another member by member. Every image loses the same number
  of groups; images of different sizes are reduced in one batch per size. After a reducing
  layer the later blocks get the rotary table sliced to the kept patches and `cu_seqlens`
  of the shorter images, and the merger reads whole groups as before.
- The entry (forward and generate) encodes the images first, so that it knows which groups
  every image kept, then shortens each image's placeholder span to its kept groups and
  passes the 3-D position ids the unreduced prompt gives the kept tokens (computed with
  transformers' `get_rope_index` on the unreduced prompt), and the `rope_deltas` that put
  the next token where the unreduced model would.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ficoco.errors import FicocoError
from ficoco.methods.contract import GroupsModule, TowerModule
from ficoco.models import hf_compat as hf
from ficoco.models.attention import install_probe, own_attention, remove_probe, route_attention
from ficoco.models.base import FamilyAdapter
from ficoco.models.entry import follow_shortened_prompt
from ficoco.models.inputs import place_inputs
from ficoco.models.patching import Patches, follow_device, forward_of, span_lengths
from ficoco.profiles import FAMILY_DEFAULTS

if TYPE_CHECKING:
    from ficoco.models.entry import Entry
    from ficoco.models.handle import Handle

# "<|im_start|> user \n <|vision_start|>" before the image span.
PREFIX_TOKENS = 4
# "<|vision_end|>" before the question, "<|im_end|> \n <|im_start|> assistant \n" after it.
_SUFFIX_TEMPLATE_TOKENS = 6


def _members(groups: Tensor, grid_w: int, merge_size: int) -> Tensor:
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
    return _members(groups, grid_w, merge_size).sort(dim=1).values


def group_patch_targets(discarded: Tensor, targets: Tensor, grid_w: int, merge_size: int = 2) -> Tensor:
    """For every patch of the `discarded` groups, in `group_patches(discarded)` order, the patch
    of its target group (`targets`, `(B, r)`, group-grid indices) it was folded into: member m of
    a group goes into member m of its target."""
    members = _members(discarded, grid_w, merge_size)
    order = members.argsort(dim=1)
    return torch.gather(_members(targets, grid_w, merge_size), 1, order)


@dataclass
class _TowerPass:
    """One run of the vision tower under FiCoCo-V: what every image still holds."""

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
    # Per item: its temporal slices (video_grid_thw's t; 1 for an image), whose groups `kept_groups` numbers
    # slice by slice (slice x groups per slice + group).
    frames: list[int] = field(default_factory=list)

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


class GridOrder:
    """The packed tower's order, as Qwen2-VL runs it: every image's merge groups in grid order, one
    attention segment (cu_seqlens) per image in every block. The adapter's tower passes (FiCoCo-V's
    reduction, ToMe's merges, a cut before the merger) ask it where the order matters; Qwen2.5-VL's
    windowed tower gives its own (`ficoco.models.qwen2_5_vl.WindowOrder`)."""

    # Whether a block's query-key pairs depend on what the method removed (windows), so that every
    # block's are recorded for `flops --verify` (`Handle.vision_attention_pairs`).
    records_pairs = False

    def __init__(self, adapter: Qwen2VLAdapter) -> None:
        self.adapter = adapter

    def segments(self, tower: _TowerPass | None, idx: int, cu_seqlens: Tensor, position_embeddings: Any,
                 kwargs: dict[str, Any]) -> tuple[Tensor, Any]:
        """The segments and the rotary table block `idx` runs on once an earlier block reduced: the pass's,
        not the unreduced ones transformers hands it; `max_seqlen` in `kwargs` follows."""
        if tower is not None and tower.cu_seqlens is not None:  # an earlier block reduced
            cu_seqlens, position_embeddings = tower.cu_seqlens, tower.position_embeddings
            if "max_seqlen" in kwargs:
                kwargs["max_seqlen"] = tower.max_seqlen
        return cu_seqlens, position_embeddings

    def image_chunks(self, tower: _TowerPass, idx: int, chunks: list[tuple[Tensor, Any]]
                     ) -> list[tuple[Tensor, Any]]:
        """Block `idx`'s probed (attention, keys), one per image (here: one call per image already)."""
        return chunks

    def after_reduce(self, tower: _TowerPass, cu_seqlens: Tensor) -> None:
        """The pass's bookkeeping after a reducing block (nothing beyond the images' segments here)."""

    def call_bias(self, tower: _TowerPass, idx: int) -> list[Tensor | None]:
        """Proportional attention's log(size) per attention call of block `idx` (one call per image)."""
        return list(tower.bias)

    def block_keys(self, tower: _TowerPass, idx: int, keys: list[Tensor]) -> list[Tensor]:
        """Block `idx`'s keys from its attention calls, one (1, H, T, d) per image."""
        return keys

    def merge(self, handle: Handle, module: Any, settings: dict[str, Any], tower: _TowerPass, hidden: Tensor,
              keys: list[Tensor], r: int, layer_idx: int, position_embeddings: tuple[Tensor, Tensor],
              cu_seqlens: Tensor) -> Tensor:
        """ToMe's merge step on every image's groups in grid order (`Qwen2VLAdapter._merge`)."""
        return self.adapter._merge(handle, module, settings, tower, hidden, keys, r, layer_idx, position_embeddings,
                                   cu_seqlens)

    def patch_merger(self, patches: Patches) -> None:
        """The merger's output after a reduced pass: in grid order already, nothing to put back."""


class Qwen2VLAdapter(FamilyAdapter):
    """Where the method goes in a Qwen2-VL model; FiCoCo-L is the base adapter's, FiCoCo-V this class's."""

    # Videos start a new visual forward as well (FiCoCo-L leaves them unreduced).
    pixel_inputs = ("pixel_values", "pixel_values_videos")
    # PDrop's and SparseVLM's compaction renumbers 1-D positions; Qwen2-VL's rotary table is 3-D
    # (an image's tokens share their row/column positions and the text after it starts past the
    # grid, not past the token count), so a renumbered arange would throw the image grid away and
    # disagree with the decode steps' positions (cache length + rope_deltas). The kept tokens keep
    # their 3-D positions instead, as FastV's and DART's do; an added (recycled) token takes its
    # image span's last placeholder's.
    compacts_positions = False
    # True under a method that cuts a video's temporal slices together after the merger (HoliTom): the
    # tower takes videos, the entry shortens video spans, and the LLM-side steps see video placeholders.
    video_cut = False
    family_title = "Qwen2-VL"  # in the one-line refusals
    # The tower's token order (window strategy): Qwen2-VL's grid order; Qwen2.5-VL's window order.
    order_strategy: type[GridOrder] = GridOrder

    def __init__(self, model: nn.Module) -> None:
        # The base adapter's attributes (the L code reads them), found where Qwen2-VL keeps them.
        self.model = model
        self.visual = hf.qwen2_vl_tower(model)
        self.vision_layers = hf.qwen2_vl_blocks(self.visual)
        self.decoder_layers = hf.decoder_layers(model)
        config = model.config
        self.image_token_id = config.image_token_id
        self.video_token_id = getattr(config, "video_token_id", None)
        self.merge_size = config.vision_config.spatial_merge_size
        self.merge = self.merge_size**2
        self._tower: _TowerPass | None = None
        self.removed_per_image = 0  # FiCoCo-V: merge groups (placeholders) every image loses
        # FiCoCo-V: the rope_deltas of the prefill that filled each cache, for the next turn on it
        # (the model's own rope_deltas are the last prefill's, of whichever conversation).
        self.turn_deltas: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.order = self.order_strategy(self)

    def stage_modules(self) -> dict[str, nn.Module]:
        """The accountant's stages; the projector (PatchMerger) sits inside the vision tower."""
        model = self.model
        return {"vision": self.visual, "projector": hf.qwen2_vl_merger(self.visual), "llm": hf.language_model(model),
                "lm_head": hf.lm_head(model)}

    def patch_tower(self, handle: Handle, patches: Patches, spec: Any, schedule: Any) -> None:
        """The packed tower's hook points (cu_seqlens: every image one segment), on whole merge groups:
        inside a tower layer for a method whose module offers ``reduce_groups`` (FiCoCo-V); a cut at the
        tower's output (before the PatchMerger: VisionZip) or after it (FasterVLM) for one whose module
        offers ``tower_step``, scored by the equivalent token in place of [CLS]; a video method's cut on the
        merger's output of a video's temporal slices together (HoliTom, ``patch_video_cut``). Others: one line,
        in the family's name."""
        try:
            self._install_tower(handle, patches, spec, schedule)
        except FicocoError as exc:
            if self.family_title == "Qwen2-VL":
                raise
            raise FicocoError(str(exc).replace("Qwen2-VL", self.family_title)) from None

    def _install_tower(self, handle: Handle, patches: Patches, spec: Any, schedule: Any) -> None:
        if spec.pooled_grid:  # a cut of a video's frames together (HoliTom)
            self.patch_video_cut(handle, patches, spec, schedule)
            return
        if spec.placement == "after_projector" and not any(n.layer.startswith("vision") for n in spec.needs):
            # A cut on the merger's output that reads nothing of the tower (DivPrune, CDPruner).
            self.patch_projector_cut(handle, patches, spec, schedule)
            return
        module = spec.load()
        if spec.placement == "in_layer" and isinstance(module, GroupsModule):
            self.patch_vision(handle, patches, schedule.removed_at(), module.reduce_groups)
            return
        if spec.placement in ("tower_output", "after_projector") and isinstance(module, TowerModule):
            self.patch_cut(handle, patches, spec, schedule)
            return
        if spec.placement == "in_layer" and isinstance(module, TowerModule):
            self.patch_merges(handle, patches, spec, schedule)
            return
        raise FicocoError(f"variant={spec.name}: {spec.title} on Qwen2-VL is planned and counted by `ficoco "
                          "flops` (the equivalent token in place of [CLS]) but not wired into Qwen2-VL's packed "
                          "vision tower yet; run it on a LLaVA-1.5 or Video-LLaVA model, or use FiCoCo-V (v) here")

    # -- merges of whole merge groups inside tower blocks (ToMe) ------------------------------
    def patch_merges(self, handle: Handle, patches: Patches, spec: Any, schedule: Any) -> None:
        """A method that merges units inside tower blocks (ToMe's `tower_step`), on whole merge groups:
        a group's patches side by side are one unit, its head-mean keys averaged over the group are
        the matching metric, a merged group stands at its destination's place (the rotary table and
        the segments follow, as FiCoCo-V's path does), and with proportional attention every later block
        adds log(size) to each patch's logits, image by image. The tower's order (`self.order`) gives the
        segments, the calls' biases and keys, and the merge step in it."""
        from ficoco.models.patching import method_settings

        module = spec.load()
        settings = method_settings(handle, spec, schedule)
        if settings.get("order", "spatial") != "spatial":
            raise FicocoError(f"{spec.title} on {self.family_title} keeps the groups in image order (the PatchMerger "
                              "and the 3-D positions read them so); order='official' is not supported here")
        rates = {r.layer: r.remove for r in schedule.removals if r.stage == "vision" and r.where == "in_layer"}
        self.removed_per_image = sum(rates.values())
        order = self.order
        visual = self.visual
        original_tower = forward_of(visual)
        pairs = handle.vision_attention_pairs

        def tower_forward(hidden_states: Tensor, grid_thw: Tensor, **kwargs: Any) -> Any:
            self._tower = self._start_pass(grid_thw)
            if order.records_pairs:
                pairs.clear()
            return original_tower(hidden_states, grid_thw, **kwargs)

        patches.set(visual, "forward", tower_forward)
        patches.on_undo(lambda: setattr(self, "_tower", None))
        first = min(rates) if rates else len(self.vision_layers)
        # Every block when its pairs are recorded (the windows it runs follow the merges), else from the first merge.
        for layer_idx in range(0 if order.records_pairs else first, len(self.vision_layers)):
            layer = self.vision_layers[layer_idx]
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
                tower = self._tower
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
                hidden = order.merge(handle, module, settings, tower, hidden_states + attn_out, keys, _r, _idx,
                                     position_embeddings, cu_seqlens)
                return hidden + _parts.mlp(_parts.post_norm(hidden))

            patches.set(layer, "forward", forward)
        order.patch_merger(patches)

    def _merge(self, handle: Handle, module: Any, settings: dict[str, Any], tower: _TowerPass, hidden: Tensor,
               keys: list[Tensor], r: int, layer_idx: int, position_embeddings: tuple[Tensor, Tensor],
               cu_seqlens: Tensor) -> Tensor:
        """Merge `r` groups of every image (one batched call per image size); update the pass."""
        from ficoco.methods.inputs import TowerInput

        lengths = tower.lengths
        if len(keys) != len(lengths):
            raise RuntimeError(f"the vision attention ran {len(keys)} segments for {len(lengths)} images")
        if tower.size is None:
            tower.size = [torch.ones(len(groups), device=hidden.device) for groups in tower.kept_groups]
            tower.bias = [None] * len(lengths)
        sizes: dict[tuple[int, int], list[int]] = {}
        for image, grid in enumerate(tower.grids):
            sizes.setdefault(grid, []).append(image)
        pieces = hidden.split(lengths)
        new_hidden: list[Tensor | None] = [None] * len(lengths)
        current: list[Tensor | None] = [None] * len(lengths)
        width = hidden.shape[-1] * self.merge
        for (rows, cols), images in sizes.items():
            before = torch.stack([tower.kept_groups[i] for i in images])
            inputs = TowerInput(hidden=torch.stack([pieces[i] for i in images]).view(len(images), -1, width),
                                has_cls=False, remove=r, keys=torch.cat([keys[i] for i in images]),
                                size=torch.stack([tower.size[i] for i in images]), positions=before,
                                merge=self.merge, grid_hw=(rows // self.merge_size, cols // self.merge_size))
            out = handle.run_method(("vision", layer_idx), module.tower_step, inputs, settings)
            kept = out.positions  # original group of every unit that goes on, in image order
            gone = torch.zeros(len(images), rows * cols // self.merge, dtype=torch.bool, device=kept.device)
            # Tensor sources (fvcore's torch.jit trace has no scatter overload for a bool scalar).
            gone = gone.scatter(1, before, torch.ones_like(before, dtype=torch.bool)).scatter(
                1, kept, torch.zeros_like(kept, dtype=torch.bool))
            discarded = torch.sort((~gone).to(torch.int8), dim=1, stable=True).indices[:, :r]
            handle.record("vision", layer_idx, kept=group_patches(kept, cols, self.merge_size),
                          discarded=group_patches(discarded, cols, self.merge_size))
            # Where the units that go on were among this block's units (both lists ascending).
            where = torch.searchsorted(before, kept)
            for b, image in enumerate(images):
                new_hidden[image] = out.hidden[b].reshape(-1, hidden.shape[-1])
                current[image] = where[b]
                tower.kept_groups[image] = kept[b]
                tower.size[image] = out.size[b]
                tower.bias[image] = None if out.attention_bias is None else \
                    out.size[b].log().repeat_interleave(self.merge)[None, None, None, :]
        members = torch.arange(self.merge, device=hidden.device)
        starts = [0, *torch.tensor(lengths).cumsum(0).tolist()[:-1]]
        rows_now = torch.cat([start + (units[:, None] * self.merge + members).flatten()
                              for start, units in zip(starts, current, strict=True)])
        tower.position_embeddings = (position_embeddings[0][rows_now], position_embeddings[1][rows_now])
        tower.cu_seqlens = F.pad(torch.tensor(tower.lengths, device=cu_seqlens.device).cumsum(0), (1, 0)).to(
            cu_seqlens.dtype)
        tower.max_seqlen = max(tower.lengths)
        return torch.cat(new_hidden)  # type: ignore[arg-type]

    # -- cuts of whole merge groups at the tower's output or after the PatchMerger -------------
    def patch_cut(self, handle: Handle, patches: Patches, spec: Any, schedule: Any) -> None:
        """One cut per image of whole merge groups: before the PatchMerger on the groups' patches side by
        side (what the merger reads; a merged token averages its groups patch by patch) or on the merger's
        output. The last block's keys (one chunk per image) give the equivalent token's scores. The
        groups the cut keeps, or where its merged tokens stand, go into `_TowerPass.kept_groups`, from
        which the entry shortens the prompt and gives the kept tokens their 3-D positions."""
        from ficoco.models.patching import method_settings

        module = spec.load()
        settings = method_settings(handle, spec, schedule)
        removals = [r for r in schedule.removals if r.stage == "vision"]
        if len(removals) > 1 or any(r.where not in ("tower_output", "after_projector") for r in removals):
            raise FicocoError(f"{spec.title} on Qwen2-VL cuts once, at the tower's output or after the merger")
        removal = removals[0] if removals else None
        visual = self.visual
        original_tower = forward_of(visual)
        attention = hf.layer_parts(self.vision_layers[-1], hf.QWEN2_VL_VISION_BLOCK).attention
        slot = None
        if removal is not None:
            slot = install_probe(attention, want_keys=True, chunked=True, timer=handle.timer)
            patches.on_undo(lambda: remove_probe(attention))

        def tower_forward(hidden_states: Tensor, grid_thw: Tensor, **kwargs: Any) -> Any:
            self._tower = self._start_pass(grid_thw)
            if slot is not None:  # nothing left over from a pass that ended in an error
                slot.chunks.clear()
            return original_tower(hidden_states, grid_thw, **kwargs)

        patches.set(visual, "forward", tower_forward)
        patches.on_undo(lambda: setattr(self, "_tower", None))
        self.removed_per_image = removal.remove - removal.added if removal is not None else 0
        merger = hf.qwen2_vl_merger(visual)
        original_merger = forward_of(merger)

        def merger_forward(hidden: Tensor, *args: Any, **kwargs: Any) -> Tensor:
            tower = self._tower
            if tower is not None:  # a tower split across devices (device maps)
                follow_device(tower, hidden.device)
            if tower is None or removal is None or slot is None:
                return original_merger(hidden, *args, **kwargs)
            keys = self._image_keys(slot.take_chunks(), tower)
            if removal.where == "tower_output":
                units = hidden.reshape(-1, hidden.shape[-1] * self.merge)  # a group's patches side by side
                reduced = self._cut(handle, module, settings, spec, removal, units, keys, tower)
                return original_merger(reduced.reshape(-1, hidden.shape[-1]), *args, **kwargs)
            out = original_merger(hidden, *args, **kwargs)
            return self._cut(handle, module, settings, spec, removal, out, keys, tower)

        patches.set(merger, "forward", merger_forward)
        self.order.patch_merger(patches)

    def _image_keys(self, chunks: list[tuple[Tensor, Tensor]], tower: _TowerPass) -> list[Tensor]:
        """The last block's keys from its attention calls, one (1, H, T, d) per image in the tower's
        token order (the packed tower runs one segment per image; a windowed one overrides this)."""
        keys = [key for _, key in chunks]
        if len(keys) != len(tower.grids):
            raise RuntimeError(f"the last vision block ran {len(keys)} segments for {len(tower.grids)} images")
        return keys

    def _cut(self, handle: Handle, module: Any, settings: dict[str, Any], spec: Any, removal: Any, units: Tensor,
             keys: list[Tensor], tower: _TowerPass) -> Tensor:
        """Run the method's `tower_step` on every image's groups (one batched call per image size);
        `units` (groups of all images, W) -> the tokens that go on, in group order."""
        from ficoco.methods.inputs import TowerInput
        from ficoco.methods.ops import gather_tokens
        from ficoco.models.vision_steps import complement

        sizes: dict[tuple[int, int], list[int]] = {}
        for image, grid in enumerate(tower.grids):
            sizes.setdefault(grid, []).append(image)
        pieces = units.split([len(groups) for groups in tower.kept_groups])
        out_pieces: list[Tensor | None] = [None] * len(pieces)
        for (rows, cols), images in sizes.items():
            groups = pieces[images[0]].shape[0]
            inputs = TowerInput(hidden=torch.stack([pieces[i] for i in images]), has_cls=False,
                                remove=removal.remove, added=removal.added,
                                keys=torch.cat([keys[i] for i in images]), merge=self.merge,
                                grid_hw=(rows // self.merge_size, cols // self.merge_size))
            out = handle.run_method(("projector", None), module.tower_step, inputs, settings)
            places = out.positions if out.positions is not None else out.kept
            if out.counts is not None or places.shape[1] != out.hidden.shape[1] or bool((places < 0).any()):
                raise FicocoError(f"{spec.title} on Qwen2-VL hands the LLM tokens without a merge group's place "
                                  "(3-D position); it runs on LLaVA-1.5 and Video-LLaVA models")
            order = torch.sort(places, dim=1)
            kept = order.values
            hidden = gather_tokens(out.hidden, order.indices)
            discarded = complement(kept, groups, groups - kept.shape[1])
            handle.record("vision", removal.layer, kept=group_patches(kept, cols, self.merge_size),
                          discarded=group_patches(discarded, cols, self.merge_size))
            for b, image in enumerate(images):
                out_pieces[image] = hidden[b]
                tower.kept_groups[image] = kept[b]
        return torch.cat(out_pieces)  # type: ignore[arg-type]

    # -- a cut after the merger (DivPrune, CDPruner): whole merge groups per image ------------------------
    def patch_projector_cut(self, handle: Handle, patches: Patches, spec: Any, schedule: Any) -> None:
        """Run the method's `tower_step` on the PatchMerger's output of every image (the LLM tokens, one
        per 2 x 2 group), batched per image size, keeping ``keep`` groups per image; the prompt's spans are
        then shortened to the kept groups and their 3-D positions, as for FiCoCo-V."""
        from ficoco.methods.inputs import TowerInput
        from ficoco.models.patching import method_settings
        from ficoco.models.vision_steps import complement, prompt_text

        module, settings = spec.load(), method_settings(handle, spec, schedule)
        cut = next((r for r in schedule.removals if r.where == "after_projector"), None)
        wants_text = any(need.kind == "input_embeddings" for need in spec.needs)
        visual = self.visual
        original_tower = forward_of(visual)

        def tower_forward(hidden_states: Tensor, grid_thw: Tensor, **kwargs: Any) -> Any:
            tower = self._tower = self._start_pass(grid_thw)
            out = original_tower(hidden_states, grid_thw, **kwargs)
            if cut is None:
                return out
            features = getattr(out, hf.FEATURES_FIELD)
            pieces = list(features.split([len(groups) for groups in tower.kept_groups]))
            text = prompt_text(handle, self, len(pieces), spec.title) if wants_text else (None, None)
            sizes: dict[tuple[int, int], list[int]] = {}
            for image, grid in enumerate(tower.grids):
                sizes.setdefault(grid, []).append(image)
            for (rows, cols), images in sizes.items():
                groups, keep = len(tower.kept_groups[images[0]]), settings["keep"]
                if keep > groups:
                    raise FicocoError(f"{spec.title} keeps {keep} tokens per image, but an image of {rows}x{cols} "
                                      f"patches has {groups}; give a smaller keep=")
                chosen = torch.tensor(images, device=features.device)
                inputs = TowerInput(hidden=torch.stack([pieces[i] for i in images]), has_cls=False,
                                    remove=groups - keep,
                                    text=None if text[0] is None else text[0][chosen.to(text[0].device)],
                                    text_mask=None if text[1] is None else text[1][chosen.to(text[1].device)])
                red = handle.run_method(("projector", None), module.tower_step, inputs, settings)
                gone = complement(red.kept, groups)
                handle.record("vision", cut.layer, kept=group_patches(red.kept, cols, self.merge_size),
                              discarded=group_patches(gone, cols, self.merge_size))
                for b, image in enumerate(images):
                    pieces[image] = red.hidden[b]
                    tower.kept_groups[image] = red.kept[b]
            setattr(out, hf.FEATURES_FIELD, torch.cat(pieces))
            return out

        patches.set(visual, "forward", tower_forward)
        patches.on_undo(lambda: setattr(self, "_tower", None))

    # -- a video's temporal slices cut together after the merger (HoliTom) ---------------------------
    def patch_video_cut(self, handle: Handle, patches: Patches, spec: Any, schedule: Any) -> None:
        """Run the method's `tower_step` on the PatchMerger's output of every video, its t temporal slices
        (``video_grid_thw``'s t: ``temporal_patch_size`` frames each, one attention segment of the tower) as
        the frames it reads together, batched per video shape. A token's score is the attention its merge
        group's patches receive in the last vision block (the merger's input), queries, heads and the group's
        4 patches averaged: Qwen2-VL has no [CLS] and no pooling. Every video keeps ``t x keep`` tokens at
        the units `TowerOutput.positions` names (a merged token: its window's first slice, or its cluster's
        centre), from which the entry shortens the video span and gives each token that unit's 3-D position."""
        from ficoco.methods.inputs import TowerInput
        from ficoco.models.patching import method_settings
        from ficoco.models.vision_steps import complement

        module, settings = spec.load(), method_settings(handle, spec, schedule)
        cut = next((r for r in schedule.removals if r.where == "after_projector"), None)
        self.video_cut = True
        patches.on_undo(lambda: setattr(self, "video_cut", False))
        visual = self.visual
        original_tower = forward_of(visual)
        attention = hf.layer_parts(self.vision_layers[-1], hf.QWEN2_VL_VISION_BLOCK).attention
        slot = None
        if cut is not None:
            slot = install_probe(attention, chunked=True, timer=handle.timer)
            patches.on_undo(lambda: remove_probe(attention))

        def tower_forward(hidden_states: Tensor, grid_thw: Tensor, **kwargs: Any) -> Any:
            tower = self._tower = self._start_pass(grid_thw)
            if slot is not None:  # nothing left over from a pass that ended in an error
                slot.chunks.clear()
            out = original_tower(hidden_states, grid_thw, **kwargs)
            if cut is None or slot is None:
                return out
            received = self._received_by_group(slot.take_chunks(), tower)
            features = getattr(out, hf.FEATURES_FIELD)
            pieces = list(features.split([len(groups) for groups in tower.kept_groups]))
            shapes: dict[tuple[int, int, int], list[int]] = {}
            for video, ((rows, cols), frames) in enumerate(zip(tower.grids, tower.frames, strict=True)):
                shapes.setdefault((frames, rows, cols), []).append(video)
            keep = settings["keep"]
            for (frames, rows, cols), videos in shapes.items():
                groups = rows * cols // self.merge
                if keep > groups:
                    raise FicocoError(f"{spec.title} keeps {keep} tokens per frame, but a video frame of {rows}x{cols} "
                                      f"patches has {groups}; give a smaller keep=")
                count = len(videos)
                inputs = TowerInput(hidden=torch.stack([pieces[v] for v in videos]).view(count * frames, groups, -1),
                                    has_cls=False, remove=groups - keep, frames=frames,
                                    attention=torch.stack([received[v] for v in videos]).view(count * frames, 1,
                                                                                               groups))
                red = handle.run_method(("projector", None), module.tower_step, inputs, settings)
                units = red.positions.reshape(count, frames * keep)
                gone = complement(units, frames * groups)
                handle.record("vision", cut.layer, kept=self._video_patches(units, groups, rows, cols),
                              discarded=self._video_patches(gone, groups, rows, cols))
                tokens = red.hidden.reshape(count, frames * keep, -1)
                for b, video in enumerate(videos):
                    pieces[video] = tokens[b]
                    tower.kept_groups[video] = units[b]
            setattr(out, hf.FEATURES_FIELD, torch.cat(pieces))
            return out

        patches.set(visual, "forward", tower_forward)
        patches.on_undo(lambda: setattr(self, "_tower", None))

    def _received_by_group(self, chunks: list[tuple[Tensor, Any]], tower: _TowerPass) -> list[Tensor]:
        """Per video, ``(t, groups)`` in grid order: the mean attention each merge group's patches receive
        in the probed block over every query of its slice (heads averaged), from the block's calls in
        sequence order (one per temporal slice; a windowed block one per window, whose keys no query
        outside the window attends to: its column sums over the window's queries are the slice's)."""
        received = torch.cat([attn[0].sum(dim=0) for attn, _ in chunks])  # every patch, in sequence order
        patches = [frames * rows * cols for (rows, cols), frames in zip(tower.grids, tower.frames, strict=True)]
        if received.shape[0] != sum(patches):
            raise RuntimeError(f"the last vision block's calls hold {received.shape[0]} keys for {sum(patches)} "
                               "patches")
        out = []
        for video, piece in enumerate(received.split(patches)):
            rows, cols = tower.grids[video]
            slices = piece.view(tower.frames[video], rows * cols) / (rows * cols)  # the mean over the slice's queries
            out.append(self._video_grid_order(slices.view(tower.frames[video], -1, self.merge).mean(dim=-1), video))
        return out

    def _video_grid_order(self, scores: Tensor, video: int) -> Tensor:
        """Per-slice group scores ``(t, groups)`` of video `video` in grid order (the tower's order here)."""
        return scores

    def _video_patches(self, units: Tensor, groups: int, rows: int, cols: int) -> Tensor:
        """Video patch indices (slice x rows x cols + row-major patch) of the video units `units` (B, K)
        (slice x groups + group), ascending."""
        frame, group = units // groups, units % groups
        members = _members(group, cols, self.merge_size).view(*units.shape, -1)
        return (members + (frame * rows * cols).unsqueeze(-1)).flatten(1).sort(dim=1).values

    def language_tokens(self, input_ids: Tensor) -> Tensor:
        """(B, T) bool: the placeholders an LLM-side step reduces: the images', and under a video method
        (HoliTom's inner merge) the videos' as well."""
        tokens = super().language_tokens(input_ids)
        if self.video_cut and self.video_token_id is not None:
            tokens = tokens | (input_ids == self.video_token_id)
        return tokens

    # -- FiCoCo-V: the tower ----------------------------------------------------------------
    def patch_vision(self, handle: Handle, patches: Patches, removed: dict[int, int],
                     reduce_groups: Callable[..., Any]) -> None:
        """Reduce whole merge groups in the ViT blocks of `removed`; the blocks after the first
        reducing one run on the kept patches' rotary table and on the segments the tower's order
        (`self.order`) gives them: the shorter images, or the windows the kept groups form."""
        params = handle.hyperparameters
        order = self.order
        visual = self.visual
        original_tower = forward_of(visual)
        slots: list[Any] = []
        pairs = handle.vision_attention_pairs

        def tower_forward(hidden_states: Tensor, grid_thw: Tensor, **kwargs: Any) -> Any:
            self._tower = self._start_pass(grid_thw)
            if order.records_pairs:
                pairs.clear()
            for slot in slots:  # nothing left over from a pass that ended in an error
                slot.chunks.clear()
            return original_tower(hidden_states, grid_thw, **kwargs)

        patches.set(visual, "forward", tower_forward)
        patches.on_undo(lambda: setattr(self, "_tower", None))
        self.removed_per_image = sum(removed.values())
        first = min(removed) if removed else len(self.vision_layers)
        # Every block when its pairs are recorded (the windows it runs follow the reductions), else from the first.
        for layer_idx in range(0 if order.records_pairs else first, len(self.vision_layers)):
            layer = self.vision_layers[layer_idx]
            r = removed.get(layer_idx, 0)
            slot = None
            parts = hf.layer_parts(layer, hf.QWEN2_VL_VISION_BLOCK)
            if r:
                slot = install_probe(parts.attention, want_keys=True, chunked=True, timer=handle.timer)
                slots.append(slot)
                patches.on_undo(lambda attn=parts.attention: remove_probe(attn))

            original = forward_of(layer)  # accelerate's wrapped forward where a device map hooked it
            def forward(hidden_states: Tensor, cu_seqlens: Tensor, position_embeddings: Any = None, *,
                        _parts: hf.Parts = parts, _slot: Any = slot, _r: int = r, _idx: int = layer_idx,
                        _original: Callable[..., Tensor] = original, **kwargs: Any) -> Tensor:
                tower = self._tower
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
                hidden = self._reduce(handle, reduce_groups, tower, hidden, chunks, _r, _idx, position_embeddings,
                                      cu_seqlens, params)
                order.after_reduce(tower, cu_seqlens)
                return hidden + _parts.mlp(_parts.post_norm(hidden))

            patches.set(layer, "forward", forward)
        order.patch_merger(patches)

    def _start_pass(self, grid_thw: Tensor) -> _TowerPass:
        grids = [(int(t), int(h), int(w)) for t, h, w in grid_thw.tolist()]
        if not self.video_cut and any(t != 1 for t, _, _ in grids):
            raise FicocoError("FiCoCo-V on Qwen2-VL reduces images (grid_t = 1); videos are not supported, "
                              "use FiCoCo-L for them")
        device = grid_thw.device
        return _TowerPass(grids=[(h, w) for _, h, w in grids],
                          kept_groups=[torch.arange(t * h * w // self.merge, device=device) for t, h, w in grids],
                          merge=self.merge, frames=[t for t, _, _ in grids])

    def _reduce(self, handle: Handle, reduce_groups: Callable[..., Any], tower: _TowerPass, hidden: Tensor,
                chunks: list[tuple[Tensor, Any]], r: int, layer_idx: int,
                position_embeddings: tuple[Tensor, Tensor], cu_seqlens: Tensor, params: Any) -> Tensor:
        """Remove `r` groups of every image (one batched step per image size); update the pass."""
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
            attn = torch.cat([chunks[i][0] for i in images])
            keys = torch.cat([chunks[i][1] for i in images])
            index = torch.stack([tower.kept_groups[i] for i in images])
            red = handle.run_method(("vision", layer_idx), reduce_groups, x, attn, keys, r, index,
                                    (rows // self.merge_size, cols // self.merge_size), merge=self.merge,
                                    lam=params.lam, eps=params.eps, window=params.window,
                                    coefficient=params.coefficient)
            merged_into = None if red.merge_target is None else group_patch_targets(
                red.discarded_groups, torch.gather(red.kept_groups, 1, red.merge_target), cols, self.merge_size)
            handle.record("vision", layer_idx, kept=group_patches(red.kept_groups, cols, self.merge_size),
                          discarded=group_patches(red.discarded_groups, cols, self.merge_size),
                          merged_into=merged_into)
            for b, image in enumerate(images):
                new_hidden[image] = red.hidden[b]
                kept_positions[image] = red.kept_positions[b]
                tower.kept_groups[image] = red.kept_groups[b]
        members = torch.arange(self.merge, device=hidden.device)
        starts = [0, *torch.tensor(lengths).cumsum(0).tolist()[:-1]]
        rows_now = torch.cat([start + (kept[:, None] * self.merge + members).flatten()
                              for start, kept in zip(starts, kept_positions, strict=True)])
        tower.position_embeddings = (position_embeddings[0][rows_now], position_embeddings[1][rows_now])
        new_lengths = torch.tensor(tower.lengths, device=cu_seqlens.device)
        tower.cu_seqlens = F.pad(new_lengths.cumsum(0), (1, 0)).to(cu_seqlens.dtype)
        tower.max_seqlen = max(tower.lengths)
        if pieces is None:
            return torch.stack(new_hidden).reshape(-1, hidden.shape[-1])
        return torch.cat(new_hidden)

    def encode_images(self, pixel_values: Tensor, image_grid_thw: Tensor, **kwargs: Any) -> Any:
        """The (reduced) tower's output, merged features split per image by the groups it kept
        (transformers' `get_image_features` splits by the unreduced counts)."""
        visual = self.visual
        out = visual(pixel_values.type(visual.dtype), grid_thw=image_grid_thw, **kwargs)
        tower = self._tower
        if tower is None:
            raise RuntimeError("the Qwen2-VL vision tower ran without FiCoCo-V's bookkeeping")
        features = getattr(out, hf.FEATURES_FIELD)
        setattr(out, hf.FEATURES_FIELD, torch.split(features, [len(groups) for groups in tower.kept_groups]))
        return out

    def kept_token_index(self, input_ids: Tensor, keep: int) -> Tensor | None:
        """Not LLaVA's first-`keep` rule: Qwen2-VL's spans keep the groups the tower kept
        (`shorten_prompt`), which also fixes the kept tokens' 3-D positions."""
        raise FicocoError("Qwen2-VL image spans are shortened by shorten_prompt, from the groups the tower kept")

    # -- FiCoCo-V: the prompt ---------------------------------------------------------------
    def shorten_prompt(self, input_ids: Tensor, attention_mask: Tensor | None, mm_token_type_ids: Tensor | None,
                       image_grid_thw: Tensor, kept_groups: list[Tensor], position_ids: Tensor | None = None,
                       *, video: bool = False, second_per_grid_ts: Tensor | None = None
                       ) -> tuple[dict[str, Tensor | None], Tensor, Tensor]:
        """Shorten every image's placeholder span to its kept groups (`video`: every video's span, to the
        units of its temporal slices it kept; `image_grid_thw` is then `video_grid_thw`, and Qwen2.5-VL's
        `second_per_grid_ts` scale its temporal positions).

        Returns the shortened `input_ids`, `attention_mask`, `mm_token_type_ids` and 3-D
        `position_ids` (3, B, T'): the positions the unreduced prompt gives the kept tokens
        (transformers' `get_rope_index` on the unreduced prompt, or the caller's own
        unreduced position ids, sliced), the `rope_deltas` (B, 1) that place the token
        after the shortened prompt where it follows the unreduced one, and the (B, T') position
        in `input_ids` of every token of the shortened prompt.
        """
        batch, length = input_ids.shape
        device = input_ids.device
        is_image = input_ids == (self.video_token_id if video else self.image_token_id)
        if mm_token_type_ids is None:
            mm_token_type_ids = (input_ids == self.image_token_id).int()
            if self.video_token_id is not None:
                mm_token_type_ids = mm_token_type_ids + 2 * (input_ids == self.video_token_id).int()
        groups = [int(t * h * w) // self.merge for t, h, w in image_grid_thw.tolist()]
        # Spans in reading order, sample after sample: the order of image_grid_thw's rows.
        starts = is_image & ~F.pad(is_image[:, :-1], (1, 0), value=False)
        span = (starts.flatten().long().cumsum(0) - 1).view(batch, length)
        positions = torch.arange(length, device=device).expand(batch, -1)
        span_start = torch.where(starts, positions, torch.zeros_like(positions)).cummax(dim=1).values
        rank = positions - span_start
        span_lengths = torch.bincount(span[is_image], minlength=len(groups)).tolist() if bool(is_image.any()) else []
        if span_lengths != groups:
            raise FicocoError(f"the prompt's image spans hold {span_lengths} placeholders, image_grid_thw asks for "
                              f"{groups} (one per merge group): give the unreduced prompt")
        table = torch.zeros(len(groups), max(groups), dtype=torch.bool, device=device)
        for image, kept in enumerate(kept_groups):
            table[image, kept.to(device)] = True
        keep = ~is_image | table[span.clamp(min=0), rank.clamp(0, max(groups) - 1)]
        counts = keep.sum(dim=1)
        if not bool((counts == counts[0]).all()):
            raise FicocoError("FiCoCo-V on Qwen2-VL: every sample of a batch must lose the same number of "
                              "placeholders (the same number of images)")
        if position_ids is None:
            grids = (None, image_grid_thw) if video else (image_grid_thw, None)
            position_ids, deltas = hf.rope_index(self.model, input_ids, mm_token_type_ids, grids[0], attention_mask,
                                                 video_grid_thw=grids[1], second_per_grid_ts=second_per_grid_ts)
        else:
            # A 4-row tensor's first row is plain text order; a 2-D one is the same on all three axes.
            position_ids = position_ids[-3:] if position_ids.dim() == 3 else position_ids[None]
            position_ids = position_ids.expand(3, batch, length)
            real = attention_mask.bool() if attention_mask is not None else torch.ones_like(is_image)
            last = torch.where(real, position_ids.amax(dim=0), torch.zeros_like(position_ids[0])).amax(dim=1)
            deltas = (last + 1 - real.sum(dim=1)).unsqueeze(1)
        removed = (length - counts).unsqueeze(1)
        kept_index = torch.sort((~keep).to(torch.int8), dim=1, stable=True).indices[:, :int(counts[0])]
        short = {
            "input_ids": input_ids[keep].view(batch, -1),
            "attention_mask": attention_mask[keep].view(batch, -1) if attention_mask is not None else None,
            "mm_token_type_ids": mm_token_type_ids[keep].view(batch, -1),
            "position_ids": position_ids[:, keep].view(3, batch, -1),
        }
        return short, deltas.to(device) + removed, kept_index

    def cached_part(self, is_image: Tensor, past: int) -> tuple[Tensor, int]:
        """Where a whole conversation (`is_image` its placeholders) continues after the `past`
        tokens a FiCoCo-V cache holds of it: (B, T') the positions of the conversation as this
        handle shortens it (every image span loses its last `removed_per_image` placeholders;
        the ids are all the placeholder's, whichever groups stayed), and the position in the
        conversation of its first token the cache lacks."""
        length = is_image.shape[1]
        flags = F.pad(is_image.long(), (0, self.removed_per_image))
        run = flags.cumsum(dim=1)
        ahead = run[:, self.removed_per_image:] - run[:, :length]  # placeholders among the next r tokens
        drop = is_image & (ahead < self.removed_per_image)
        dropped = drop.sum(dim=1)
        short_length = length - int(dropped.max())
        if past >= short_length or not bool((dropped == length - short_length).all()):
            raise FicocoError(f"the cache holds {past} tokens, which is not the start of this conversation as "
                              "FiCoCo-V shortened it: give the whole conversation's input_ids (its earlier turns "
                              "run under this handle) and the new turn's images")
        kept_all = torch.sort(drop.to(torch.int8), dim=1, stable=True).indices[:, :short_length]
        starts = kept_all[:, past]
        start = int(starts[0])
        if not bool((starts == start).all()) or bool((is_image[:, start - 1] & is_image[:, start]).any()):
            raise FicocoError("the cache ends inside an image span or at different places of the samples: give the "
                              "whole conversation's input_ids and the new turn's images")
        return kept_all, start

    def continue_prompt(self, call: dict[str, Any], pixel_values: Tensor | None, past: int, *, whole: bool
                        ) -> tuple[dict[str, Tensor | None], Tensor, Tensor, Any]:
        """FiCoCo-V's shortened prompt of a later turn, on a cache that holds `past` tokens of the
        earlier turns (shortened by this handle: every earlier image lost `removed_per_image`
        placeholders). `pixel_values` are this turn's images.

        `whole`: `input_ids` is the whole conversation (generate's convention), and the shortened
        prompt is too; its first `past` tokens stand for what the cache holds (generate runs
        the rest). Otherwise `input_ids` is what follows the cache (a forward's convention; the
        attention mask may cover the cache as well). `image_grid_thw` holds this turn's images,
        or every image of the conversation (as transformers' 3-D positions need them); the
        kept tokens get the positions the unreduced conversation gives them: from every image's
        grid, or after the earlier turns' last position (their `rope_deltas`).

        Returns what `shorten_prompt` returns, for the whole prompt (kept positions in the
        caller's `input_ids`), and the encoded images.
        """
        input_ids, grid = call["input_ids"], call["image_grid_thw"]
        mask, types = call.get("attention_mask"), call.get("mm_token_type_ids")
        batch, length = input_ids.shape
        is_image = input_ids == self.image_token_id
        if types is None:
            types = is_image.int()
        spans = span_lengths(is_image)
        start, prefix = 0, None
        if whole:
            kept_all, start = self.cached_part(is_image, past)
            prefix = kept_all[:, :past]
        new_ids, new_types = input_ids[:, start:], types[:, start:]
        new_mask = None
        if mask is not None:
            new_mask = mask[:, past:] if not whole and mask.shape[1] == past + length else mask[:, start:]
        new_spans = span_lengths(new_ids == self.image_token_id)
        images = len(new_spans[0])
        per_sample, rest = divmod(grid.shape[0], batch)
        if rest or per_sample < images or any(len(row) != images for row in new_spans):
            raise FicocoError(f"this turn's image spans hold {new_spans} placeholders, but image_grid_thw has "
                              f"{grid.shape[0]} rows: give this turn's images' grids, or every image's")
        new_grid = grid.view(batch, per_sample, 3)[:, per_sample - images:].reshape(-1, 3)
        patches = int(new_grid.prod(dim=-1).sum())
        if pixel_values is None or pixel_values.shape[0] != patches:
            held = "no pixel_values" if pixel_values is None else f"pixel_values of {pixel_values.shape[0]} patches"
            raise FicocoError(f"{held} for this turn's images of {patches} patches: give the pixel values of the "
                              "images after what the cache holds")
        encoded = self.encode_images(pixel_values, new_grid)
        if whole and all(len(row) == per_sample for row in spans):  # every image's grid: the whole layout
            full_mask = mask if mask is not None and mask.shape[1] == length else None
            positions = hf.rope_index(self.model, input_ids, types, grid, full_mask)[0][:, :, start:]
        else:
            earlier = self.turn_deltas.get(hf.cache_in(call), hf.rope_deltas(self.model))
            if earlier is None or batch % earlier.shape[0]:
                raise FicocoError("FiCoCo-V on Qwen2-VL continues a conversation after the earlier turns' positions "
                                  "(rope_deltas of the turn that filled the cache); give every image's "
                                  "image_grid_thw with the whole conversation's input_ids")
            local = hf.rope_index(self.model, new_ids, new_types, new_grid, new_mask)[0]
            offset = past + earlier.repeat_interleave(batch // earlier.shape[0], dim=0).to(local.device)
            positions = local + offset.view(1, batch, 1)
        short, deltas, kept = self.shorten_prompt(new_ids, new_mask, new_types, new_grid, self._tower.kept_groups,
                                                  positions)
        # shorten_prompt's deltas place the next token after this part alone; the cache precedes it.
        deltas = deltas - past
        if not whole:
            if mask is not None and mask.shape[1] == past + length:
                short["attention_mask"] = torch.cat([mask[:, :past], short["attention_mask"]], dim=1)
            return short, deltas, kept, encoded
        # generate slices off what the cache holds before any forward: the prefix's positions are
        # never read; text order stands in for them.
        cached_positions = torch.arange(past, device=input_ids.device).expand(3, batch, -1)
        short = {
            "input_ids": torch.cat([torch.gather(input_ids, 1, prefix), short["input_ids"]], dim=1),
            "attention_mask": None if mask is None else torch.cat([torch.gather(mask, 1, prefix),
                                                                   short["attention_mask"]], dim=1),
            "mm_token_type_ids": torch.cat([torch.gather(types, 1, prefix), short["mm_token_type_ids"]], dim=1),
            "position_ids": torch.cat([cached_positions.to(short["position_ids"]), short["position_ids"]], dim=2),
        }
        return short, deltas, torch.cat([prefix, kept + start], dim=1), encoded

    # -- the hooks of the one entry wrapper (ficoco.models.entry) ------------------------------
    # FiCoCo-L and the other methods in the decoder: the base adapter's hooks, with later turns' images encoded
    # first. A method before the LLM: the images encoded first, then the shortened prompt run with the
    # kept tokens' original 3-D positions (forward and generate).
    def enter_forward(self, entry: Entry, call: dict[str, Any]) -> tuple[Tensor | None, bool]:
        if not entry.shortens:
            return super().enter_forward(entry, call)
        handle = entry.handle
        input_length = call["input_ids"].shape[1] if call.get("input_ids") is not None else 0
        if call.get("pixel_values") is not None or call.get("pixel_values_videos") is not None:
            self._prepare(entry, call, text_row=False)
            handle.prompt_map = (entry.generating[0], input_length)
        elif not call.get(hf.ENCODED_FEATURES_KEYWORD):
            follow_shortened_prompt(handle, call)
        # Otherwise: text, a decode step, or generate's prefill, whose images generate() encoded.
        positions = None
        if call.get(hf.ENCODED_FEATURES_KEYWORD) and entry.generating is not None:
            positions, entry.generating = entry.generating[0], None
        ids = call.get("input_ids")
        if positions is not None and ids is not None and positions.shape[1] > ids.shape[1]:
            # generate's prefill on a later turn's cache runs the part after what the cache holds.
            past = int(hf.cache_in(call).get_seq_length())
            positions = positions[:, past:past + ids.shape[1]]
        return positions, positions is not None

    def after_forward(self, entry: Entry, call: dict[str, Any], output: Any, positions: Tensor | None) -> None:
        """A shortened prefill's rope deltas, kept per cache for the next turn on it."""
        output_cache = hf.output_cache(output)
        if entry.shortens and positions is not None and output_cache is not None:
            self.turn_deltas[output_cache] = hf.rope_deltas(self.model)

    def enter_generate(self, entry: Entry, kwargs: dict[str, Any]) -> bool:
        if not entry.shortens:
            self._encode_later_turn_images(kwargs)
            if kwargs.get(hf.ENCODED_FEATURES_KEYWORD):  # images encoded beforehand: a new visual generation
                entry.handle.begin_forward()
            return super().enter_generate(entry, kwargs)
        if kwargs.get("pixel_values") is None and kwargs.get("pixel_values_videos") is None:
            return self._text_turn(entry, kwargs)
        self._prepare(entry, kwargs, text_row=True)
        return True

    def patch_encoders(self, entry: Entry, patches: Patches) -> None:
        """A method before the LLM: get_image_features called directly (not through forward or generate)
        splits its output by what the tower kept."""
        if not entry.shortens:
            return

        def get_image_features(pixel_values: Tensor, image_grid_thw: Tensor | None = None, **kwargs: Any) -> Any:
            return_dict = kwargs.pop("return_dict", True)
            out = self.encode_images(pixel_values, image_grid_thw, **kwargs)
            return out if return_dict else out.to_tuple()

        patches.set(hf.inner_model(self.model), hf.IMAGE_ENCODER, get_image_features)

    def _encode_later_turn_images(self, kwargs: dict[str, Any]) -> None:
        """FiCoCo-L's generate on a later turn's cache, with new images: transformers computes the
        whole conversation's 3-D positions there, so it needs every image's `image_grid_thw`, and
        takes the new images only encoded beforehand (`mm_encoder_outputs`; the tower would read
        every grid against the new pixels). Given `pixel_values` of the new images and every
        image's grid, encode the new ones with their own grids (in `kwargs`), as that form has it;
        given the new images' grids alone, refuse at the call (transformers would stop inside)."""
        cache, input_ids = hf.cache_in(kwargs), kwargs.get("input_ids")
        grid, pixel_values = kwargs.get("image_grid_thw"), kwargs.get("pixel_values")
        past = int(cache.get_seq_length()) if cache is not None else 0
        if not past or input_ids is None or grid is None or input_ids.shape[1] <= past:
            return
        batch = input_ids.shape[0]
        every = span_lengths(input_ids == self.image_token_id)
        new = span_lengths(input_ids[:, past:] == self.image_token_id)
        images = len(new[0])
        if grid.shape[0] != batch * len(every[0]) or any(len(row) != len(every[0]) for row in every):
            raise FicocoError(f"FiCoCo-L on Qwen2-VL: image_grid_thw has {grid.shape[0]} rows for a conversation "
                              f"of image spans {every}; on an earlier turn's cache give every image's grid, "
                              "earlier turns' first (transformers' 3-D positions count them all)")
        if pixel_values is not None and images:
            new_grid = grid.view(batch, -1, 3)[:, len(every[0]) - images:].reshape(-1, 3)
            if pixel_values.shape[0] != int(new_grid.prod(dim=-1).sum()):
                raise FicocoError(f"FiCoCo-L on Qwen2-VL: pixel_values of {pixel_values.shape[0]} patches for this "
                                  f"turn's images of grids {new_grid.tolist()}: give the images after what the "
                                  "cache holds")
            encoded = hf.encode_features(self.model, hf.IMAGE_ENCODER, kwargs.pop("pixel_values"), new_grid)
            features = hf.ENCODED_FEATURES_KEYWORD
            kwargs[features] = {**(kwargs.get(features) or {}), "image": encoded}

    def _prepare(self, entry: Entry, call: dict[str, Any], *, text_row: bool) -> None:
        """Encode the images, shorten the prompt and set its positions (in `call`)."""
        if self.video_cut:
            self._prepare_video(entry, call, text_row=text_row)
            return
        if call.get("pixel_values_videos") is not None:
            raise FicocoError("FiCoCo-V on Qwen2-VL reduces images only; run videos with FiCoCo-L")
        handle = entry.handle
        pixel_values = call.pop("pixel_values", None)
        input_ids = call.get("input_ids")
        grid = call.get("image_grid_thw")
        if input_ids is None or grid is None:
            raise FicocoError("FiCoCo-V on Qwen2-VL needs input_ids and image_grid_thw with pixel_values "
                              "(the image spans are shortened in input_ids)")
        handle.begin_forward()
        handle.prompt_ids = (input_ids, call.get("attention_mask"))  # a method that reads the instruction
        cache = hf.cache_in(call)
        past = int(cache.get_seq_length()) if cache is not None else 0
        if past:  # a later turn of a conversation whose earlier turns the cache holds
            short, deltas, kept, encoded = self.continue_prompt(call, pixel_values, past, whole=text_row)
        else:
            encoded = self.encode_images(pixel_values, grid)
            short, deltas, kept = self.shorten_prompt(input_ids, call.get("attention_mask"),
                                                      call.get("mm_token_type_ids"), grid,
                                                      self._tower.kept_groups, call.get("position_ids"))
        self._finish(entry, call, short, deltas, kept, "image", encoded, text_row=text_row)

    def _prepare_video(self, entry: Entry, call: dict[str, Any], *, text_row: bool) -> None:
        """A video method's prompt: encode the videos (the cut runs in the tower's forward), shorten
        every video span to the units it kept, at their unreduced 3-D positions."""
        title = f"{entry.spec.title} on {self.family_title}"
        if call.get("pixel_values") is not None:
            raise FicocoError(f"{title} acts on a video's frames; an image is one frame: give the image as a "
                              "video, or a method that reduces images")
        pixel_values = call.pop("pixel_values_videos")
        input_ids, grid = call.get("input_ids"), call.get("video_grid_thw")
        if input_ids is None or grid is None:
            raise FicocoError(f"{title} needs input_ids and video_grid_thw with pixel_values_videos (the video "
                              "spans are shortened in input_ids)")
        cache = hf.cache_in(call)
        if cache is not None and int(cache.get_seq_length()):
            raise FicocoError(f"{title}: a video on a later turn's cache is not supported; give the video in the "
                              "conversation's first turn")
        entry.handle.begin_forward()
        entry.handle.prompt_ids = (input_ids, call.get("attention_mask"))
        encoded = self.encode_images(pixel_values, grid)
        short, deltas, kept = self.shorten_prompt(input_ids, call.get("attention_mask"),
                                                  call.get("mm_token_type_ids"), grid, self._tower.kept_groups,
                                                  call.get("position_ids"), video=True,
                                                  second_per_grid_ts=call.get("second_per_grid_ts"))
        self._finish(entry, call, short, deltas, kept, "video", encoded, text_row=text_row)

    def _finish(self, entry: Entry, call: dict[str, Any], short: dict[str, Tensor | None], deltas: Tensor,
                kept: Tensor, modality: str, encoded: Any, *, text_row: bool) -> None:
        """Put the shortened prompt, its positions and the encoded features into `call`; the kept positions
        go to the forward that runs it (generate's prefill runs later, inside generate)."""
        input_ids = call["input_ids"]
        if isinstance(call.get("labels"), Tensor) and call["labels"].shape == input_ids.shape:
            short["labels"] = torch.gather(call["labels"], 1, kept.to(call["labels"].device))
        entry.generating = (kept, input_ids.shape[1])
        if text_row:
            # generate keeps a 4th (first) row of plain text order for its masks and extends all
            # four by one per new token; that row follows the shortened prompt.
            mask = short["attention_mask"]
            if mask is None:
                text = torch.arange(short["input_ids"].shape[1], device=input_ids.device)
                text = text.expand(short["input_ids"].shape[0], -1)
            else:
                text = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)
            short["position_ids"] = torch.cat([text[None].to(short["position_ids"]), short["position_ids"]])
        call.update({k: v for k, v in short.items() if v is not None or k in call})
        features = hf.ENCODED_FEATURES_KEYWORD
        call[features] = {**(call.get(features) or {}), modality: encoded}
        # Decode steps that come without position ids take them from here (and the cache length).
        hf.set_rope_deltas(self.model, deltas)

    def _text_turn(self, entry: Entry, kwargs: dict[str, Any]) -> bool:
        """generate without images: on a cache of earlier turns with images, the whole conversation
        as this handle shortened it (the cache holds that), so that generate runs what follows; True
        when it shortened the prompt (in `kwargs`)."""
        cache, prompt = hf.cache_in(kwargs), kwargs.get("input_ids")
        past = int(cache.get_seq_length()) if cache is not None else 0
        if past and prompt is not None and self.video_cut and bool((prompt == self.video_token_id).any()):
            raise FicocoError(f"{entry.spec.title} on {self.family_title}: a later turn on a video's cache is "
                              "not supported; run the whole conversation in one prompt")
        if not past or prompt is None or not bool((prompt == self.image_token_id).any()):
            return False
        kept, _ = self.cached_part(prompt == self.image_token_id, past)
        for key in ("input_ids", "attention_mask", "mm_token_type_ids"):
            value = kwargs.get(key)
            if isinstance(value, Tensor) and value.shape == prompt.shape:
                kwargs[key] = torch.gather(value, 1, kept.to(value.device))
        return True


def image_grid(model: nn.Module, image_size: tuple[int, int] | None = None) -> tuple[int, int]:
    """(rows, cols) of patches Qwen2-VL's (and Qwen2.5-VL's) processor makes of an image of
    `image_size` (H, W), by default the profile's image size."""
    from ficoco.accounting.families.qwen2_vl import qwen2_vl_resize

    if image_size is None:
        defaults = {**FAMILY_DEFAULTS[model.config.model_type], **(getattr(model, "_ficoco_defaults", None) or {})}
        image_size = tuple(defaults["image_size"])
    vision = model.config.vision_config
    height, width = qwen2_vl_resize(tuple(image_size), vision.patch_size * vision.spatial_merge_size)
    return height // vision.patch_size, width // vision.patch_size


def synthetic_inputs(model: nn.Module, *, batch: int = 1, text_tokens: int = 60, seed: int = 0,
                     dtype: torch.dtype | None = None, device: torch.device | str | None = None,
                     image_size: tuple[int, int] | None = None, frames: int | None = None) -> dict[str, Tensor]:
    """Inputs of `batch` prompts of one image each, laid out like Qwen2-VL's processor; with `frames`
    (or a profile whose layout is a video) one video of that many frames of `image_size` instead:
    ceil(frames / temporal_patch_size) temporal slices, `<|video_pad|>` placeholders,
    `pixel_values_videos` and `video_grid_thw`.

    Text: "<|im_start|>user\\n<|vision_start|>" + one `<|image_pad|>` per merge group +
    "<|vision_end|>{question}<|im_end|>\\n<|im_start|>assistant\\n", `text_tokens` text tokens
    in all (random ordinary ids for the words). Pixels: the flattened patches the processor
    makes, (batch x rows x cols, 3 x 2 x 14 x 14), with `image_grid_thw` and `mm_token_type_ids`.
    The image is `image_size` (H, W), the profile's by default. Qwen2.5-VL's processor lays prompts
    out the same way and adds a video's `second_per_grid_ts` (here 1 s per slice: 2 frames per second).
    """
    config = model.config
    if config.model_type not in ("qwen2_vl", "qwen2_5_vl"):
        raise FicocoError(f"these synthetic inputs are laid out for Qwen2-VL and Qwen2.5-VL only, not "
                          f"'{config.model_type}'")
    fixed = PREFIX_TOKENS + _SUFFIX_TEMPLATE_TOKENS
    if text_tokens < fixed:
        raise FicocoError(f"text_tokens= must be at least the {fixed} template tokens around the image")
    rows, cols = image_grid(model, image_size)
    vision = config.vision_config
    if frames is None and image_size is None:
        frames = (getattr(model, "_ficoco_defaults", None) or {}).get("frames")
    if frames is not None and frames < 1:
        raise FicocoError(f"frames={frames} must be at least 1")
    slices = 1 if frames is None else -(-frames // vision.temporal_patch_size)
    placeholder = config.image_token_id if frames is None else config.video_token_id
    placeholders = slices * rows * cols // vision.spatial_merge_size**2
    start, end = config.vision_start_token_id, config.vision_end_token_id
    # Qwen2's tokenizer puts <|im_start|> and <|im_end|> 8 and 7 ids before <|vision_start|>.
    im_start, im_end = start - 8, start - 7
    special = [t for t in (config.image_token_id, config.video_token_id, start, end, im_start) if t is not None]
    text_vocab = min(config.text_config.vocab_size, *special) - 3
    generator = torch.Generator().manual_seed(seed)
    words = torch.randint(3, 3 + text_vocab, (batch, text_tokens), generator=generator)
    column = functools.partial(torch.full, (batch, 1), dtype=torch.long)
    question = text_tokens - fixed
    input_ids = torch.cat([
        column(im_start), words[:, :2], column(start),  # <|im_start|> user \n <|vision_start|>
        torch.full((batch, placeholders), placeholder, dtype=torch.long),
        column(end), words[:, 2:2 + question],
        column(im_end), words[:, 2 + question:3 + question], column(im_start), words[:, 3 + question:5 + question],
    ], dim=1)
    channels = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
    pixels = torch.randn(batch * slices * rows * cols, channels, generator=generator)
    if frames is not None:
        seconds = {"second_per_grid_ts": torch.ones(batch)} if config.model_type == "qwen2_5_vl" else {}
        return place_inputs(model, input_ids, "pixel_values_videos", pixels, dtype=dtype, device=device,
                            video_grid_thw=torch.tensor([[slices, rows, cols]] * batch),
                            mm_token_type_ids=2 * (input_ids == placeholder).int(), **seconds)
    return place_inputs(model, input_ids, "pixel_values", pixels, dtype=dtype, device=device,
                        image_grid_thw=torch.tensor([[1, rows, cols]] * batch),
                        mm_token_type_ids=(input_ids == config.image_token_id).int())
