"""The packed tower's token order, the window strategy of Qwen2-VL's parts: where the order of the
tower's tokens matters to a pass (which segments a block runs on, how its attention calls map to
images, in which order a cut or a merge sees the groups, what the merger and the encoder hand out).

`GridOrder` is Qwen2-VL's: every image's merge groups in grid order, one attention segment per
image. Qwen2.5-VL's windowed tower derives its `WindowOrder` from it (ficoco.models.qwen2_5_vl) and
the adapter names the one it runs (`Qwen2VLAdapter.order_strategy`); the passes themselves
(ficoco.models.qwen2_vl.tower_pass, .cut, .prompt) are the same on both.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from ficoco.errors import FicocoError
from ficoco.models import hf_compat as hf
from ficoco.models.patching import Patches
from ficoco.models.qwen2_vl.tower_pass import TowerPass

if TYPE_CHECKING:
    from ficoco.models.qwen2_vl.adapter import Qwen2VLAdapter

# ToMe's merge step on the pass's groups: (pass, hidden, keys per image, rotary table, segments) -> hidden.
MergeStep = Callable[[TowerPass, Tensor, list[Tensor], tuple[Tensor, Tensor], Tensor], Tensor]


class GridOrder:
    """The packed tower's order, as Qwen2-VL runs it: every image's merge groups in grid order, one
    attention segment (cu_seqlens) per image in every block. The adapter's tower passes (FiCoCo-V's
    reduction, ToMe's merges, a cut before or after the merger) ask it where the order matters;
    Qwen2.5-VL's windowed tower gives its own (`ficoco.models.qwen2_5_vl.WindowOrder`)."""

    # Whether a block's query-key pairs depend on what the method removed (windows), so that every
    # block's are recorded for `flops --verify` (`Handle.vision_attention_pairs`).
    records_pairs = False

    def __init__(self, adapter: Qwen2VLAdapter) -> None:
        self.adapter = adapter

    def start_pass(self, grid_thw: Tensor) -> TowerPass:
        """A new pass of the tower over the items of `grid_thw`: every group of every item present."""
        adapter = self.adapter
        grids = [(int(t), int(h), int(w)) for t, h, w in grid_thw.tolist()]
        if not adapter.video_cut and any(t != 1 for t, _, _ in grids):
            # The encoder hands the tower a video's temporal slices as images (`slice_items`); a direct call does not.
            raise FicocoError(f"{adapter.method_title} on {adapter.family_title} reduces a video's temporal slices "
                              "as images when the model encodes it (forward, generate, get_image_features, "
                              "get_video_features); this call gave the vision tower a video grid (t > 1) itself: "
                              "call the model instead")
        device = grid_thw.device
        return TowerPass(grids=[(h, w) for _, h, w in grids],
                         kept_groups=[torch.arange(t * h * w // adapter.merge, device=device) for t, h, w in grids],
                         merge=adapter.merge, frames=[t for t, _, _ in grids])

    def segments(self, tower: TowerPass | None, idx: int, cu_seqlens: Tensor, position_embeddings: Any,
                 kwargs: dict[str, Any]) -> tuple[Tensor, Any]:
        """The segments and the rotary table block `idx` runs on once an earlier block reduced: the pass's,
        not the unreduced ones transformers hands it; `max_seqlen` in `kwargs` follows."""
        if tower is not None and tower.cu_seqlens is not None:  # an earlier block reduced
            cu_seqlens, position_embeddings = tower.cu_seqlens, tower.position_embeddings
            if "max_seqlen" in kwargs:
                kwargs["max_seqlen"] = tower.max_seqlen
        return cu_seqlens, position_embeddings

    def image_chunks(self, tower: TowerPass, idx: int, chunks: list[tuple[Tensor, Any]]
                     ) -> list[tuple[Tensor, Any]]:
        """Block `idx`'s probed (attention, keys), one per image (here: one call per image already)."""
        return chunks

    def after_reduce(self, tower: TowerPass, cu_seqlens: Tensor) -> None:
        """The pass's bookkeeping after a reducing block (nothing beyond the images' segments here)."""

    def call_bias(self, tower: TowerPass, idx: int) -> list[Tensor | None]:
        """Proportional attention's log(size) per attention call of block `idx` (one call per image)."""
        return list(tower.bias)

    def block_keys(self, tower: TowerPass, idx: int, keys: list[Tensor]) -> list[Tensor]:
        """Block `idx`'s keys from its attention calls, one (1, H, T, d) per image."""
        return keys

    def merge(self, step: MergeStep, tower: TowerPass, hidden: Tensor, keys: list[Tensor],
              position_embeddings: tuple[Tensor, Tensor], cu_seqlens: Tensor) -> Tensor:
        """ToMe's merge `step` (`TowerBlocks._merge`) on every image's groups, here in grid order already."""
        return step(tower, hidden, keys, position_embeddings, cu_seqlens)

    def patch_merger(self, patches: Patches) -> None:
        """The merger's output after a reduced pass: in grid order already, nothing to put back."""

    def image_keys(self, chunks: list[tuple[Tensor, Tensor]], tower: TowerPass) -> list[Tensor]:
        """The last block's keys from its attention calls, one (1, H, T, d) per image in the tower's
        token order (the packed tower runs one segment per image)."""
        keys = [key for _, key in chunks]
        if len(keys) != len(tower.grids):
            raise RuntimeError(f"the last vision block ran {len(keys)} segments for {len(tower.grids)} images")
        return keys

    def image_reads(self, tower: TowerPass, idx: int, chunks: list[tuple[Any, Any]], whole_item: bool
                    ) -> list[tuple[Any, Any]]:
        """Block `idx`'s probed (reads, keys) of an unreduced pass, one per image in the grid order a cut reads
        (a merge group's patches consecutive, the groups row-major): here one call per image already, the block's
        attention over the whole image (`whole_item` changes nothing: no windows)."""
        if len(chunks) != len(tower.grids):
            raise RuntimeError(f"vision block {idx} ran {len(chunks)} segments for {len(tower.grids)} images")
        return chunks

    def grid_keys(self, tower: TowerPass, idx: int, chunks: list[tuple[Any, Any]]) -> list[tuple[None, Any]]:
        """Block `idx`'s keys of an unreduced pass, one (1, H, T, d) per image in grid order (no reads)."""
        return [(None, keys) for _, keys in self.image_reads(tower, idx, chunks, False)]

    def cut_input(self, tower: TowerPass, units: Tensor, keys: list[Tensor]) -> tuple[Tensor, list[Tensor]]:
        """The units (groups of all images) and the last block's keys per image, in the grid order a cut at the
        tower's output or after the merger reads (it keeps groups by their grid indices): here as they are."""
        return units, keys

    def video_grid_order(self, scores: Tensor, video: int) -> Tensor:
        """Per-slice group scores ``(t, groups)`` of video `video` in grid order (the tower's order here)."""
        return scores

    def slice_items(self, grid_thw: Tensor) -> tuple[Tensor, list[int] | None]:
        """The tower's items for the given items `grid_thw` under a method before the LLM: a video's row (t, h, w)
        as t rows (1, h, w), its temporal slices as images (`MethodSpec.video_slices`), and the slices of every given
        item; `grid_thw` itself and None where every item is one slice, or under a video method (HoliTom, FlashVID),
        which reads a video's slices together.

        The tower's hidden states are the same either way: its attention segments (cu_seqlens), its rotary table,
        Qwen2.5-VL's windows and Qwen3-VL's interpolated position embeddings and DeepStack taps are per temporal
        slice, the (h, w) ones repeated t times, and the pixel rows of a video are its slices' one after the other
        (tests/test_qwen_video_items.py checks it on every family)."""
        adapter = self.adapter
        if adapter.video_cut or grid_thw is None:
            return grid_thw, None
        frames = [int(t) for t in grid_thw[:, 0].tolist()]
        if all(t == 1 for t in frames):
            return grid_thw, None
        if not adapter.video_slices:
            raise FicocoError(f"{adapter.method_title} on {adapter.family_title} reduces images only: "
                              f"{adapter.video_refusal}; run the video unreduced, or with a method that reduces "
                              "every temporal slice (v, visionzip, divprune, `ficoco methods`)")
        items = grid_thw.repeat_interleave(grid_thw[:, 0].to(torch.long), dim=0).clone()
        items[:, 0] = 1
        return items, frames

    def join_slices(self, tower: TowerPass, pieces: tuple[Tensor, ...], frames: list[int]) -> tuple[Tensor, ...]:
        """Every video's slices put back together after a pass over them as images: the merged features of its
        slices one after the other, and the pass per given item again, each video's kept groups numbered slice by
        slice (slice x groups per slice + group, ascending within a slice: the order of the features), as a
        video method's pass numbers them (`TowerPass.frames`)."""
        merge = self.adapter.merge
        joined, kept, grids, at = [], [], [], 0
        for t in frames:
            rows, cols = tower.grids[at]
            groups = rows * cols // merge
            joined.append(torch.cat(pieces[at:at + t]))
            kept.append(torch.cat([s * groups + tower.kept_groups[at + s].sort().values for s in range(t)]))
            grids.append((rows, cols))
            at += t
        if at != len(pieces):
            raise RuntimeError(f"the tower ran {len(pieces)} items for videos of {sum(frames)} slices")
        tower.kept_groups, tower.grids, tower.frames = kept, grids, list(frames)
        return tuple(joined)

    def split_features(self, out: Any, tower: TowerPass) -> tuple[Tensor, ...]:
        """The tower's merged features of every item's kept groups, split per item, in grid order."""
        features = getattr(out, hf.FEATURES_FIELD)
        return torch.split(features, [len(groups) for groups in tower.kept_groups])

    def encode(self, pixel_values: Tensor, image_grid_thw: Tensor, **kwargs: Any) -> Any:
        """The (reduced) tower's output, merged features split per item by the groups it kept
        (transformers' `get_image_features` splits by the unreduced counts); a video's temporal slices run as
        images (`slice_items`) and are joined per video after (`join_slices`)."""
        adapter = self.adapter
        grid, frames = self.slice_items(image_grid_thw)
        out = adapter.run_tower(pixel_values, grid, **kwargs)
        tower = adapter.tower_pass
        if tower is None:
            raise RuntimeError("the Qwen2-VL vision tower ran without FiCoCo-V's bookkeeping")
        pieces = self.split_features(out, tower)
        if frames is not None:
            pieces = self.join_slices(tower, pieces, frames)
        setattr(out, hf.FEATURES_FIELD, pieces)
        return out
