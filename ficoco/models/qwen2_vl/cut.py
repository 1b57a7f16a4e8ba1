"""Cuts of whole merge groups before the LLM on Qwen2-VL's packed tower: once at the tower's output or
after the PatchMerger, scored by the last block's keys (VisionZip, VisPruner, FasterVLM: `patch_cut`);
on the merger's output alone (DivPrune, CDPruner: `patch_projector_cut`); on a video's temporal slices
together after the merger (HoliTom: `patch_video_cut`); at the tower's input, from every group's pixels
(PixelPrune: `patch_input_cut`).

Every cut leaves the groups every image kept in the adapter's tower pass (`TowerPass.kept_groups`),
from which the entry shortens the prompt and gives the kept tokens their 3-D positions
(ficoco.models.qwen2_vl.prompt). The tower's order (`adapter.order`) puts the groups in the grid order
the methods read and the merger's output back where the tower expects it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ficoco.errors import FicocoError
from ficoco.methods.needs import TowerProbe
from ficoco.models import hf_compat as hf
from ficoco.models.attention import install_probe, remove_probe
from ficoco.models.patching import Patches, follow_device, forward_of
from ficoco.models.qwen2_vl.tower_pass import TowerPass, attention_pairs, group_members, group_patches

if TYPE_CHECKING:
    from ficoco.models.handle import Handle
    from ficoco.models.qwen2_vl.adapter import Qwen2VLAdapter


class TowerCuts:
    """The cuts of whole merge groups at the tower's output or after the merger, one method per hook point."""

    def __init__(self, adapter: Qwen2VLAdapter) -> None:
        self.adapter = adapter

    # -- a cut at the tower's output or after the PatchMerger, scored by the last block's keys ----------
    def patch_cut(self, handle: Handle, patches: Patches, spec: Any, schedule: Any) -> None:
        """One cut per image of whole merge groups: before the PatchMerger on the groups' patches side by
        side (what the merger reads; a merged token averages its groups patch by patch) or on the merger's
        output. The last block's keys (one chunk per image) give the equivalent token's scores. The
        groups the cut keeps, or where its merged tokens stand, go into `TowerPass.kept_groups`, from
        which the entry shortens the prompt and gives the kept tokens their 3-D positions."""
        from ficoco.models.patching import method_settings
        from ficoco.models.vision_steps import merged_probe

        adapter = self.adapter
        module = spec.load()
        settings = method_settings(handle, spec, schedule)
        removals = [r for r in schedule.removals if r.stage == "vision"]
        if len(removals) > 1 or any(r.where not in ("tower_output", "after_projector") for r in removals):
            raise FicocoError(f"{spec.title} on Qwen2-VL cuts once, at the tower's output or after the merger")
        removal = removals[0] if removals else None
        visual = adapter.visual
        original_tower = forward_of(visual)
        last = len(adapter.vision_layers) - 1
        # The last block's keys (always: the equivalent token scores by them), its reads where the method asks for
        # every row's probabilities, and the blocks the method's settings name (``vision named``), which reach
        # its step as `TowerInput.named`: block -> (reads wanted, over the whole image).
        plan = spec.probes
        probes: dict[int, TowerProbe] = {last: TowerProbe()}
        for probe in (plan.step_tower_layers, plan.last_tower_layer):
            if probe is not None:
                probes[last] = merged_probe(spec, last, probe, probes[last])
        named = plan.named_layers(settings, len(adapter.vision_layers)) if removal is not None else {}
        for name, probe in plan.named_tower_layers:
            if name in named:
                probes[named[name]] = merged_probe(spec, named[name], probe, probes.get(named[name]))
        slots: dict[int, Any] = {}
        if removal is not None:
            for block, probe in probes.items():
                attention = hf.layer_parts(adapter.vision_layers[block], hf.QWEN2_VL_VISION_BLOCK).attention
                runner = handle.read_runner(("vision", block)) if probe.probabilities else None
                slots[block] = install_probe(attention, want_keys=True, want_reads=probe.probabilities, chunked=True,
                                             runner=runner, scores=handle.attention_scores)
                patches.on_undo(lambda attention=attention: remove_probe(attention))
        slot = slots.get(last)

        def tower_forward(hidden_states: Tensor, grid_thw: Tensor, **kwargs: Any) -> Any:
            adapter.tower_pass = adapter.order.start_pass(grid_thw)
            for probed in slots.values():  # nothing left over from a pass that ended in an error
                probed.chunks.clear()
            return original_tower(hidden_states, grid_thw, **kwargs)

        patches.set(visual, "forward", tower_forward)
        patches.on_undo(lambda: setattr(adapter, "tower_pass", None))
        adapter.removed_per_image = removal.remove - removal.added if removal is not None else 0
        merger = hf.qwen2_vl_merger(visual)
        original_merger = forward_of(merger)

        def merger_forward(hidden: Tensor, *args: Any, **kwargs: Any) -> Tensor:
            tower = adapter.tower_pass
            if tower is not None:  # a tower split across devices (device maps)
                follow_device(tower, hidden.device)
            if tower is None or removal is None or slot is None:
                return original_merger(hidden, *args, **kwargs)
            # Every probed block's calls, per image in grid order (before the cut puts the pass in grid order).
            order = adapter.order
            taken = {block: probed.take_chunks() for block, probed in slots.items()}
            read = {block: order.image_reads(tower, block, chunks, probes[block].whole_item)
                    for block, chunks in taken.items() if probes[block].probabilities}
            attention = [reads for reads, _ in read[last]] if last in read else None
            layers = {name: (block, read[block] if block in read else order.grid_keys(tower, block, taken[block]))
                      for name, block in named.items()}
            keys = order.image_keys(taken[last], tower)
            if removal.where == "tower_output":
                units = hidden.reshape(-1, hidden.shape[-1] * adapter.merge)  # a group's patches side by side
                reduced = self._cut(handle, module, settings, spec, removal, units, keys, tower, attention, layers)
                return original_merger(reduced.reshape(-1, hidden.shape[-1]), *args, **kwargs)
            out = original_merger(hidden, *args, **kwargs)
            return self._cut(handle, module, settings, spec, removal, out, keys, tower, attention, layers)

        patches.set(merger, "forward", merger_forward)
        adapter.order.patch_merger(patches)

    def _cut(self, handle: Handle, module: Any, settings: dict[str, Any], spec: Any, removal: Any, units: Tensor,
             keys: list[Tensor], tower: TowerPass, attention: list[Any] | None = None,
             layers: dict[str, tuple[int, list[tuple[Any, Tensor | None]]]] | None = None) -> Tensor:
        """Run the method's `tower_step` on every image's groups (one batched call per image size);
        `units` (groups of all images, W) -> the tokens that go on, in group order. `attention`: the last block's
        reads per image in grid order, where the method reads them; `layers`: per setting of a ``vision named``
        need, its block and that block's (reads, keys) per image in grid order."""
        from ficoco.methods.inputs import TowerInput, TowerLayerProbe
        from ficoco.methods.ops import gather_tokens
        from ficoco.methods.reads.ops import stack_reads
        from ficoco.models.vision_steps import complement

        adapter = self.adapter
        units, keys = adapter.order.cut_input(tower, units, keys)  # every image's groups in grid order
        sizes: dict[tuple[int, int], list[int]] = {}
        for image, grid in enumerate(tower.grids):
            sizes.setdefault(grid, []).append(image)
        pieces = units.split([len(groups) for groups in tower.kept_groups])
        out_pieces: list[Tensor | None] = [None] * len(pieces)
        for (rows, cols), images in sizes.items():
            groups = pieces[images[0]].shape[0]
            step_units = torch.stack([pieces[i] for i in images])
            width = step_units.shape[-1]
            # Per-group features that ride with the units (Qwen3-VL's DeepStack taps), for a cut whose merges are
            # decided from the keys alone (VisionZip's contextual tokens): they merge as the units do.
            riding = adapter.riding_features(tower, images)
            if riding is not None:
                step_units = torch.cat([step_units, riding.to(step_units.dtype)], dim=-1)
            named = None
            if layers:
                named = {}
                for name, (block, per_image) in layers.items():
                    reads = [per_image[i][0] for i in images]
                    block_keys = [per_image[i][1] for i in images]
                    named[name] = TowerLayerProbe(
                        block, keys=None if block_keys[0] is None else torch.cat(block_keys),
                        attention=None if reads[0] is None else stack_reads(reads))
            inputs = TowerInput(hidden=step_units, has_cls=False,
                                remove=removal.remove, added=removal.added,
                                keys=torch.cat([keys[i] for i in images]), merge=adapter.merge,
                                grid_hw=(rows // adapter.merge_size, cols // adapter.merge_size),
                                attention=None if attention is None else stack_reads([attention[i] for i in images]),
                                named=named, riding=0 if riding is None else int(riding.shape[-1]))
            out = handle.run_method(("projector", None), module.tower_step, inputs, settings)
            places = out.positions if out.positions is not None else out.kept
            if out.counts is not None or places.shape[1] != out.hidden.shape[1] or bool((places < 0).any()):
                raise FicocoError(f"{spec.title} on Qwen2-VL hands the LLM tokens without a merge group's place "
                                  "(3-D position); it runs on LLaVA-1.5 and Video-LLaVA models")
            order = torch.sort(places, dim=1)
            kept = order.values
            hidden = gather_tokens(out.hidden, order.indices)
            discarded = complement(kept, groups, groups - kept.shape[1])
            handle.record("vision", removal.layer, kept=group_patches(kept, cols, adapter.merge_size),
                          discarded=group_patches(discarded, cols, adapter.merge_size))
            # Where every token that goes on continues one group (-1: a merged token), in the units' order.
            adapter.follow_groups(tower, images, torch.gather(out.kept, 1, order.indices), merges=None,
                                  features=None if riding is None else hidden[..., width:])
            hidden = hidden[..., :width]
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

        adapter = self.adapter
        module, settings = spec.load(), method_settings(handle, spec, schedule)
        cut = next((r for r in schedule.removals if r.where == "after_projector"), None)
        wants_text = spec.probes.input_embeddings
        visual = adapter.visual
        original_tower = forward_of(visual)
        # What every image span lost, for a later turn on the cache (`PromptShortener.cached_part`).
        adapter.removed_per_image = cut.remove - cut.added if cut is not None else 0

        def tower_forward(hidden_states: Tensor, grid_thw: Tensor, **kwargs: Any) -> Any:
            tower = adapter.tower_pass = adapter.order.start_pass(grid_thw)
            out = original_tower(hidden_states, grid_thw, **kwargs)
            if cut is None:
                return out
            features = getattr(out, hf.FEATURES_FIELD)
            pieces = list(features.split([len(groups) for groups in tower.kept_groups]))
            text = prompt_text(handle, adapter, len(pieces), spec.title) if wants_text else (None, None)
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
                handle.record("vision", cut.layer, kept=group_patches(red.kept, cols, adapter.merge_size),
                              discarded=group_patches(gone, cols, adapter.merge_size))
                adapter.follow_groups(tower, images, red.kept, merges=False)  # a cut that only keeps
                for b, image in enumerate(images):
                    pieces[image] = red.hidden[b]
                    tower.kept_groups[image] = red.kept[b]
            setattr(out, hf.FEATURES_FIELD, torch.cat(pieces))
            return out

        patches.set(visual, "forward", tower_forward)
        patches.on_undo(lambda: setattr(adapter, "tower_pass", None))

    # -- a cut at the tower's input, decided from the pixels (PixelPrune) ---------------------------------------
    def patch_input_cut(self, handle: Handle, patches: Patches, spec: Any, schedule: Any) -> None:
        """Run the method's `tower_step` on every image's merge groups' pixels before the tower's first block
        (one batched call per image size): the pixels the caller gave (before the tower's dtype cast), the
        processor's normalisation undone (`Qwen2VLAdapter.pixel_mean`, `pixel_std`), the first temporal frame
        of every patch, a group's 4 patches side by side. Every image keeps its own count. The tower's own
        forward still embeds every patch and (Qwen3-VL) resamples its position grid for the whole image; the
        first block then takes the kept groups' rows, and every block runs on them, with the rotary rows of
        their original places and the segments of the shorter images (Qwen2.5-VL: the windows the kept groups
        form), as after FiCoCo-V's reduction. The merger, DeepStack's taps and the encoder read the kept groups
        from the pass."""
        from ficoco.models.patching import method_settings

        adapter = self.adapter
        module, settings = spec.load(), method_settings(handle, spec, schedule)
        order, visual = adapter.order, adapter.visual
        original_tower = forward_of(visual)
        pairs = handle.vision_attention_pairs
        # Every image loses its own count: a later turn on the cache cannot tell what it holds (`cached_part`).
        adapter.removed_per_image = None
        patches.on_undo(lambda: setattr(adapter, "removed_per_image", 0))

        def tower_forward(hidden_states: Tensor, grid_thw: Tensor, **kwargs: Any) -> Any:
            if bool((grid_thw[:, 0] != 1).any()):
                raise FicocoError(f"{spec.title} on {adapter.family_title} reduces images: its grid of merge groups "
                                  "(pred_2d.py:157) does not fit a video's temporal slices; run the video unreduced "
                                  "or with another method")
            tower = adapter.tower_pass = order.start_pass(grid_thw)
            if order.records_pairs:
                pairs.clear()
            given = adapter.caller_pixels
            pixels = given if given is not None and given.shape == hidden_states.shape else hidden_states
            tower.input_rows = self._select_at_input(handle, module, settings, tower, pixels)
            return original_tower(hidden_states, grid_thw, **kwargs)

        patches.set(visual, "forward", tower_forward)
        patches.on_undo(lambda: setattr(adapter, "tower_pass", None))
        for layer_idx, layer in enumerate(adapter.vision_layers):
            original = forward_of(layer)  # accelerate's wrapped forward where a device map hooked it

            def forward(hidden_states: Tensor, cu_seqlens: Tensor, position_embeddings: Any = None, *,
                        _idx: int = layer_idx, _original: Any = original, **kwargs: Any) -> Tensor:
                tower = adapter.tower_pass
                if tower is not None:
                    follow_device(tower, hidden_states.device)  # a tower split across devices (device maps)
                    if _idx == 0 and tower.input_rows is not None:
                        hidden_states = self._enter(tower, hidden_states, position_embeddings, cu_seqlens)
                cu_seqlens, position_embeddings = order.segments(tower, _idx, cu_seqlens, position_embeddings, kwargs)
                if order.records_pairs:
                    pairs[_idx] = attention_pairs(cu_seqlens)
                return _original(hidden_states, cu_seqlens=cu_seqlens, position_embeddings=position_embeddings,
                                 **kwargs)

            patches.set(layer, "forward", forward)
        order.patch_merger(patches)

    def _select_at_input(self, handle: Handle, module: Any, settings: dict[str, Any], tower: TowerPass,
                         pixels: Tensor) -> Tensor | None:
        """The groups every image keeps (into `tower.kept_groups`, in the pass's order) and the rows of the packed
        sequence the first block keeps; None when every group of every image stays (the tower runs as it is).
        One host read per image size (the counts)."""
        from ficoco.methods.inputs import TowerInput
        from ficoco.models.vision_steps import complement

        adapter = self.adapter
        merge, size = adapter.merge, adapter.merge_size
        units = adapter.group_pixels(pixels)  # (groups of every image, merge x C x P x P), grid order
        lengths = [len(groups) for groups in tower.kept_groups]
        pieces = units.split(lengths)
        sizes: dict[tuple[int, int], list[int]] = {}
        for image, grid in enumerate(tower.grids):
            sizes.setdefault(grid, []).append(image)
        kept_of: list[Tensor | None] = [None] * len(lengths)
        for (rows, cols), images in sizes.items():
            groups = lengths[images[0]]
            inputs = TowerInput(hidden=torch.stack([pieces[i] for i in images]), has_cls=False, remove=0,
                                merge=merge, grid_hw=(rows // size, cols // size))
            out = handle.run_method(("vision", 0), module.tower_step, inputs, settings)
            counts = out.counts.tolist() if out.counts is not None else [out.kept.shape[1]] * len(images)
            kept = [out.kept[b, :count] for b, count in enumerate(counts)]
            gone = [complement(k[None], groups)[0] for k in kept]
            handle.record("vision", 0, kept=_padded([group_patches(k[None], cols, size)[0] for k in kept]),
                          discarded=_padded([group_patches(g[None], cols, size)[0] for g in gone]))
            for b, image in enumerate(images):
                kept_of[image] = kept[b]
        counts = sorted({len(k) for k in kept_of})  # type: ignore[arg-type]
        # What every image handed the LLM, as measured: one count when they agree (the accountant plans one).
        handle.measured_tokens_per_item = counts[0] if len(counts) == 1 else None
        if all(len(k) == n for k, n in zip(kept_of, lengths, strict=True)):  # type: ignore[arg-type]
            return None
        members = torch.arange(merge, device=units.device)
        rows_now, start = [], 0
        for image, kept in enumerate(kept_of):
            present = tower.kept_groups[image]  # original group of every row of the image, in the pass's order
            flags = torch.zeros(lengths[image], dtype=torch.bool, device=present.device)
            flags[kept.to(present.device)] = True  # type: ignore[union-attr]
            at = flags[present].nonzero()[:, 0]  # where the kept groups are in the pass's order
            tower.kept_groups[image] = present[at]
            rows_now.append(start + (at[:, None] * merge + members.to(at.device)).flatten())
            start += lengths[image] * merge
        return torch.cat(rows_now)

    def _enter(self, tower: TowerPass, hidden: Tensor, position_embeddings: tuple[Tensor, Tensor],
               cu_seqlens: Tensor) -> Tensor:
        """The first block's input cut to the rows the input cut kept; the pass holds the kept patches' rotary rows
        (their original places) and the segments of the shorter images (and windows) for every block."""
        rows = tower.input_rows.to(hidden.device)  # type: ignore[union-attr]
        tower.input_rows = None
        tower.position_embeddings = (position_embeddings[0][rows], position_embeddings[1][rows])
        lengths = torch.tensor(tower.lengths, device=cu_seqlens.device)
        tower.cu_seqlens = F.pad(lengths.cumsum(0), (1, 0)).to(cu_seqlens.dtype)
        tower.max_seqlen = max(tower.lengths)
        self.adapter.order.after_reduce(tower, tower.cu_seqlens)
        return hidden[rows]

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

        adapter = self.adapter
        module, settings = spec.load(), method_settings(handle, spec, schedule)
        cut = next((r for r in schedule.removals if r.where == "after_projector"), None)
        adapter.video_cut = True
        patches.on_undo(lambda: setattr(adapter, "video_cut", False))
        visual = adapter.visual
        original_tower = forward_of(visual)
        attention = hf.layer_parts(adapter.vision_layers[-1], hf.QWEN2_VL_VISION_BLOCK).attention
        slot = None
        if cut is not None:
            last = len(adapter.vision_layers) - 1
            slot = install_probe(attention, chunked=True, runner=handle.read_runner(("vision", last)),
                                 scores=handle.attention_scores)
            patches.on_undo(lambda: remove_probe(attention))

        def tower_forward(hidden_states: Tensor, grid_thw: Tensor, **kwargs: Any) -> Any:
            tower = adapter.tower_pass = adapter.order.start_pass(grid_thw)
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
                groups = rows * cols // adapter.merge
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
                # What follows the tokens (Qwen3-VL's DeepStack features): a method whose features follow the places
                # takes each token's place's (FlashVID, as its official code gathers them); else Qwen3-VL refused it.
                adapter.follow_groups(tower, videos, units, merges=False)
                tokens = red.hidden.reshape(count, frames * keep, -1)
                for b, video in enumerate(videos):
                    pieces[video] = tokens[b]
                    tower.kept_groups[video] = units[b]
            setattr(out, hf.FEATURES_FIELD, torch.cat(pieces))
            return out

        patches.set(visual, "forward", tower_forward)
        patches.on_undo(lambda: setattr(adapter, "tower_pass", None))

    def _received_by_group(self, chunks: list[tuple[Tensor, Any]], tower: TowerPass) -> list[Tensor]:
        """Per video, ``(t, groups)`` in grid order: the mean attention each merge group's patches receive
        in the probed block over every query of its slice (heads averaged), from the block's calls in
        sequence order (one per temporal slice; a windowed block one per window, whose keys no query
        outside the window attends to: its column sums over the window's queries are the slice's)."""
        adapter = self.adapter
        received = torch.cat([attn.column_sum()[0] for attn, _ in chunks])  # every patch, in sequence order
        patches = [frames * rows * cols for (rows, cols), frames in zip(tower.grids, tower.frames, strict=True)]
        if received.shape[0] != sum(patches):
            raise RuntimeError(f"the last vision block's calls hold {received.shape[0]} keys for {sum(patches)} "
                               "patches")
        out = []
        for video, piece in enumerate(received.split(patches)):
            rows, cols = tower.grids[video]
            slices = piece.view(tower.frames[video], rows * cols) / (rows * cols)  # the mean over the slice's queries
            scores = slices.view(tower.frames[video], -1, adapter.merge).mean(dim=-1)
            out.append(adapter.order.video_grid_order(scores, video))
        return out

    def _video_patches(self, units: Tensor, groups: int, rows: int, cols: int) -> Tensor:
        """Video patch indices (slice x rows x cols + row-major patch) of the video units `units` (B, K)
        (slice x groups + group), ascending."""
        adapter = self.adapter
        frame, group = units // groups, units % groups
        members = group_members(group, cols, adapter.merge_size).view(*units.shape, -1)
        return (members + (frame * rows * cols).unsqueeze(-1)).flatten(1).sort(dim=1).values


def _padded(rows: list[Tensor]) -> Tensor:
    """(n, most) the index rows `rows` side by side, each padded with -1 to the longest (a record's layout where
    items keep different counts)."""
    width = max(len(row) for row in rows)
    return torch.stack([F.pad(row, (0, width - len(row)), value=-1) for row in rows])
