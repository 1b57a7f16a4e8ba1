"""Cuts of whole merge groups before the LLM on Qwen2-VL's packed tower: once at the tower's output or
after the PatchMerger, scored by the last block's keys (VisionZip, VisPruner, FasterVLM: `patch_cut`);
on the merger's output alone (DivPrune, CDPruner: `patch_projector_cut`); on a video's temporal slices
together after the merger (HoliTom: `patch_video_cut`).

Every cut leaves the groups every image kept in the adapter's tower pass (`TowerPass.kept_groups`),
from which the entry shortens the prompt and gives the kept tokens their 3-D positions
(ficoco.models.qwen2_vl.prompt). The tower's order (`adapter.order`) puts the groups in the grid order
the methods read and the merger's output back where the tower expects it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from ficoco.errors import FicocoError
from ficoco.models import hf_compat as hf
from ficoco.models.attention import install_probe, remove_probe
from ficoco.models.patching import Patches, follow_device, forward_of
from ficoco.models.qwen2_vl.tower_pass import TowerPass, group_members, group_patches

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

        adapter = self.adapter
        module = spec.load()
        settings = method_settings(handle, spec, schedule)
        removals = [r for r in schedule.removals if r.stage == "vision"]
        if len(removals) > 1 or any(r.where not in ("tower_output", "after_projector") for r in removals):
            raise FicocoError(f"{spec.title} on Qwen2-VL cuts once, at the tower's output or after the merger")
        removal = removals[0] if removals else None
        visual = adapter.visual
        original_tower = forward_of(visual)
        attention = hf.layer_parts(adapter.vision_layers[-1], hf.QWEN2_VL_VISION_BLOCK).attention
        slot = None
        if removal is not None:
            slot = install_probe(attention, want_keys=True, want_reads=False, chunked=True)
            patches.on_undo(lambda: remove_probe(attention))

        def tower_forward(hidden_states: Tensor, grid_thw: Tensor, **kwargs: Any) -> Any:
            adapter.tower_pass = adapter.order.start_pass(grid_thw)
            if slot is not None:  # nothing left over from a pass that ended in an error
                slot.chunks.clear()
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
            keys = adapter.order.image_keys(slot.take_chunks(), tower)
            if removal.where == "tower_output":
                units = hidden.reshape(-1, hidden.shape[-1] * adapter.merge)  # a group's patches side by side
                reduced = self._cut(handle, module, settings, spec, removal, units, keys, tower)
                return original_merger(reduced.reshape(-1, hidden.shape[-1]), *args, **kwargs)
            out = original_merger(hidden, *args, **kwargs)
            return self._cut(handle, module, settings, spec, removal, out, keys, tower)

        patches.set(merger, "forward", merger_forward)
        adapter.order.patch_merger(patches)

    def _cut(self, handle: Handle, module: Any, settings: dict[str, Any], spec: Any, removal: Any, units: Tensor,
             keys: list[Tensor], tower: TowerPass) -> Tensor:
        """Run the method's `tower_step` on every image's groups (one batched call per image size);
        `units` (groups of all images, W) -> the tokens that go on, in group order."""
        from ficoco.methods.inputs import TowerInput
        from ficoco.methods.ops import gather_tokens
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
            inputs = TowerInput(hidden=step_units, has_cls=False,
                                remove=removal.remove, added=removal.added,
                                keys=torch.cat([keys[i] for i in images]), merge=adapter.merge,
                                grid_hw=(rows // adapter.merge_size, cols // adapter.merge_size))
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
