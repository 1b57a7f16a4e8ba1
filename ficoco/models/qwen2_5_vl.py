"""FiCoCo inside Hugging Face's Qwen2.5-VL (`Qwen2_5_VLForConditionalGeneration`): Qwen2-VL's
layout (a ViT without [CLS] over native-resolution patches, a PatchMerger joining every 2 x 2
group into one LLM token, a Qwen2 decoder with 3-D rotary positions) with a tower that attends
within windows in every layer outside `fullatt_block_indexes` and over the whole image in those.

Everything outside the tower's order is Qwen2-VL's (`Qwen2VLAdapter` and its parts, ficoco.models.qwen2_vl):
FiCoCo-L in the decoder, the tower passes, the cuts, and FiCoCo-V's entry, which encodes the images first
and shortens every placeholder span to the groups the tower kept, with the unreduced prompt's 3-D
positions. What differs is the order of the tower's tokens, this file's `WindowOrder` (the window
strategy), which the adapter names; `Qwen2_5_VLAdapter` overrides none of Qwen2-VL's helpers.

The tower, as transformers runs it: the merge groups of every image are put in window order
before the first block (`window_index`: windows row-major over the group grid, padded to whole
windows whose padding is dropped, so windows at the bottom and right edges are partial; groups
row-major inside a window), window layers cut the packed sequence at `cu_window_seqlens`, full
layers at `cu_seqlens` (images), and the merger's output is put back in grid order after it.

FiCoCo-V in this tower:

- The tokens stay in window order throughout. Every image's current groups are kept as their
  original group-grid indices in window order (`kept_groups`), so the method's local penalty and
  every record work on the original grid of groups, whatever order the sequence is in.
- A reducing window layer ran one attention per window: the image's attention map is the block
  diagonal of its windows' maps (a group attends to, and correlates with, the groups of its own
  window only, as the layer computed), assembled before the method reads it; a full layer's map
  is the image's. So a discarded group is folded into kept groups of its own window; one whose
  window keeps no other group correlates with no kept group (a zero row), and FiCoCo's adaptive
  weights spread it uniformly over the image's kept groups, as they do for any zero row.
- A removed group leaves its window: the window boundaries after a reduction are recomputed from
  the windows of the groups still present (each keeps the window it started in; the sequence
  stays in window order because the method keeps the remaining groups in sequence order), and a
  window left empty is dropped, as transformers drops its padding windows. Full layers get the
  shorter images' boundaries, every later layer the rotary table sliced to the kept patches.
- After the blocks the merger maps the kept groups only; its output is scattered back to the
  unreduced window-order rows (the removed groups' rows zero), so that the tower's own reverse
  order puts it in grid order, and the entry reads every image's kept groups from there.
- The query-key pairs every vision layer ran (the sum over its windows of tokens^2) are left in
  `Handle.vision_attention_pairs`, which `flops --verify` hands the accountant: which windows
  lose groups is known only once the method ran.

The other vision-side methods run Qwen2-VL's merge-group steps (`TowerCuts.patch_cut`,
`patch_projector_cut`, `TowerBlocks._merge`) on every image's groups put in grid order, the order they
have on Qwen2-VL, and this file's `WindowOrder` maps between the orders around them:

- A cut at the tower's output or after the merger (VisionZip, VisPruner, FasterVLM): the units
  (window order) and the last block's keys (one chunk per window in a window block, joined per
  image) are put in grid order before the method, which keeps groups by their grid indices; the
  merger's output of the kept groups is scattered back to their unreduced window-order rows, so
  the tower's own reverse order puts it in grid order, and `WindowOrder.encode` reads the kept rows.
- A cut on the tower's output (DivPrune, CDPruner) sees the grid order the tower hands out.
- HoliTom on a video (its temporal slices together, after the merger): Qwen2-VL's cut on the tower's
  grid-order output; only the scores (the attention each group's patches receive in the last block,
  one call per slice or per window) come in window order, and are put back in grid order per video.
- ToMe merges in the blocks: the matching runs over the whole image in grid order, as on
  Qwen2-VL; the units that go on return to window order, each at its destination group's place
  (its window, its rotary rows), the window boundaries are recomputed as for FiCoCo-V, and
  proportional attention's log(size) is split per window in the window blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ficoco.methods.reads.ops import ProbedAttention, SegmentedReads
from ficoco.models import hf_compat as hf
from ficoco.models.patching import Patches, follow_device, forward_of

# The prompt layout and the image grid are Qwen2-VL's (the same processor rules): one function each.
from ficoco.models.qwen2_vl import (
    PREFIX_TOKENS,
    PROMPT,
    GridOrder,
    Qwen2VLAdapter,
    TowerPass,
    image_grid,
    synthetic_inputs,
)
from ficoco.models.qwen2_vl.order import MergeStep

__all__ = ["PREFIX_TOKENS", "PROMPT", "Qwen2_5_VLAdapter", "image_grid", "synthetic_inputs"]


@dataclass
class WindowPass(TowerPass):
    """Qwen2-VL's tower pass plus the windows: per image, the window of every original group and the
    group's row in the unreduced window order; the window boundaries after a reduction."""

    group_window: list[Tensor] = field(default_factory=list)  # per image: window id of every original group
    window_rows: list[Tensor] = field(default_factory=list)  # per image: window-order row of every group
    image_rows: list[int] = field(default_factory=list)  # first window-order row of every image
    windows: list[int] = field(default_factory=list)  # windows of every image, unreduced
    cu_window_seqlens: Tensor | None = None
    max_window_seqlen: int | None = None

    def window_lengths(self) -> list[Tensor]:
        """Per image, the tokens now in every window (empty windows included)."""
        return [torch.bincount(self.group_window[i][kept], minlength=self.windows[i]) * self.merge
                for i, kept in enumerate(self.kept_groups)]


def _total_groups(tower: WindowPass) -> int:
    """Merge groups of every image of the pass, unreduced."""
    return tower.image_rows[-1] + len(tower.window_rows[-1])


def _to_window_rows(merged: Tensor, tower: WindowPass) -> Tensor:
    """The merger's output of every image's kept groups (in `kept_groups` order) at the groups' rows of the
    unreduced window order (the removed groups' rows zero), which the tower's reverse order expects."""
    rows = torch.cat([start + tower.window_rows[i][kept]
                      for i, (start, kept) in enumerate(zip(tower.image_rows, tower.kept_groups, strict=True))])
    out = merged.new_zeros(_total_groups(tower), merged.shape[-1])
    return out.index_copy(0, rows.to(merged.device), merged)


def _keys_per_image(keys: list[Tensor], tower: WindowPass) -> list[Tensor]:
    """A window block's keys, one (1, H, T_w, d) per window it ran, as one (1, H, T, d) per image."""
    per_image, at = [], 0
    for lengths in tower.window_lengths():
        count = int((lengths > 0).sum())
        per_image.append(torch.cat(keys[at:at + count], dim=2))
        at += count
    if at != len(keys):
        raise RuntimeError(f"the vision attention ran {len(keys)} windows, the tower pass holds {at}")
    return per_image


class WindowOrder(GridOrder):
    """Qwen2.5-VL's tower order: every image's merge groups in window order, window blocks cut the
    packed sequence at the windows (`cu_window_seqlens`), full blocks at the images; Qwen2-VL's passes
    run on it through these hooks."""

    records_pairs = True  # which windows lose groups is known only once the method ran

    def __init__(self, adapter: Qwen2VLAdapter) -> None:
        super().__init__(adapter)
        # The blocks that attend over whole images (fullatt_block_indexes); the others attend within windows.
        self.full_layers = frozenset(hf.qwen2_5_vl_full_attention_layers(adapter.visual))
        self.video_windows: list[Tensor] = []  # HoliTom: per video, the video unit of every window-order row

    def full(self, idx: int) -> bool:
        """Whether block `idx` attends over whole images (fullatt_block_indexes) rather than windows."""
        return idx in self.full_layers

    def start_pass(self, grid_thw: Tensor) -> TowerPass:
        """A new pass with every image's groups in window order, the windows of every group recorded. Under a
        video cut (HoliTom) Qwen2-VL's pass, and every video's window order for its scores."""
        adapter = self.adapter
        if adapter.video_cut:
            window_index = hf.qwen2_5_vl_window_index(adapter.visual, grid_thw)[0].to(grid_thw.device)
            counts = (grid_thw.prod(dim=-1) // adapter.merge).tolist()
            starts = [0, *torch.tensor(counts).cumsum(0).tolist()[:-1]]
            self.video_windows = [window_index[a:a + n] - a for a, n in zip(starts, counts, strict=True)]
            return super().start_pass(grid_thw)
        base = super().start_pass(grid_thw)
        window_index, cu_window = hf.qwen2_5_vl_window_index(adapter.visual, grid_thw)
        window_index, cu_window = window_index.to(grid_thw.device), cu_window.to(grid_thw.device)
        groups = [h * w // adapter.merge for h, w in base.grids]
        bounds = (cu_window // adapter.merge).tolist()
        group_window, window_rows, kept, image_rows, windows = [], [], [], [], []
        start = 0
        for count in groups:
            order = window_index[start:start + count] - start  # original group of every window-order row
            rows = torch.empty_like(order)
            rows[order] = torch.arange(count, device=order.device)
            # Windows of this image: the boundaries inside [start, start + count).
            inner = [b - start for b in bounds if start < b <= start + count]
            sizes = torch.tensor([inner[0]] + [b - a for a, b in zip(inner, inner[1:], strict=False)],
                                 device=order.device)
            window_of_row = torch.repeat_interleave(torch.arange(len(inner), device=order.device), sizes)
            group_window.append(window_of_row[rows])
            window_rows.append(rows)
            kept.append(order)
            image_rows.append(start)
            windows.append(len(inner))
            start += count
        return WindowPass(grids=base.grids, kept_groups=kept, merge=adapter.merge, group_window=group_window,
                          window_rows=window_rows, image_rows=image_rows, windows=windows)

    def segments(self, tower: TowerPass | None, idx: int, cu_seqlens: Tensor, position_embeddings: Any,
                 kwargs: dict[str, Any]) -> tuple[Tensor, Any]:
        """The segments (windows, or whole images in a full-attention block) and the rotary table block
        `idx` runs on once an earlier block reduced: the pass's, not the unreduced ones transformers
        hands it; `max_seqlen` in `kwargs` follows."""
        if tower is None or tower.cu_seqlens is None:
            return cu_seqlens, position_embeddings
        assert isinstance(tower, WindowPass)
        full = self.full(idx)
        if "max_seqlen" in kwargs:
            kwargs["max_seqlen"] = tower.max_seqlen if full else tower.max_window_seqlen
        return (tower.cu_seqlens if full else tower.cu_window_seqlens), tower.position_embeddings

    def image_chunks(self, tower: TowerPass, idx: int, chunks: list[tuple[Tensor, Any]]
                     ) -> list[tuple[Tensor, Any]]:
        """A window block's per-window (reads, keys) as one per image: the reads of the block diagonal of the
        image's windows' attention (no attention across windows ran), the keys in sequence order."""
        if self.full(idx):
            return chunks
        assert isinstance(tower, WindowPass)
        per_image = []
        at = 0
        for lengths in tower.window_lengths():
            count = int((lengths > 0).sum())
            mine = chunks[at:at + count]
            at += count
            attn = SegmentedReads([a for a, _ in mine])
            keys = torch.cat([k for _, k in mine], dim=2)
            per_image.append((attn, keys))
        if at != len(chunks):
            raise RuntimeError(f"the vision attention ran {len(chunks)} windows, the tower pass holds {at}")
        return per_image

    def after_reduce(self, tower: TowerPass, cu_seqlens: Tensor) -> None:
        """The window boundaries of the groups still present (empty windows dropped)."""
        assert isinstance(tower, WindowPass)
        lengths = torch.cat(tower.window_lengths())
        lengths = lengths[lengths > 0]
        tower.cu_window_seqlens = F.pad(lengths.cumsum(0), (1, 0)).to(cu_seqlens.dtype)
        tower.max_window_seqlen = int(lengths.max())

    def call_bias(self, tower: TowerPass, idx: int) -> list[Tensor | None]:
        """Proportional attention's log(size) per attention call: per image in a full block, per (non-empty)
        window in a window block, in sequence order."""
        assert isinstance(tower, WindowPass)
        if not self.full(idx) and tower.bias:  # (no bias before the first merge)
            pieces: list[Tensor | None] = []
            for bias, lengths in zip(tower.bias, tower.window_lengths(), strict=True):
                tokens = [int(n) for n in lengths if n > 0]
                pieces += [None] * len(tokens) if bias is None else list(bias.split(tokens, dim=-1))
            return pieces
        return list(tower.bias)

    def block_keys(self, tower: TowerPass, idx: int, keys: list[Tensor]) -> list[Tensor]:
        """A window block's keys, one chunk per window, joined per image."""
        assert isinstance(tower, WindowPass)
        return keys if self.full(idx) else _keys_per_image(keys, tower)

    def merge(self, step: MergeStep, tower: TowerPass, hidden: Tensor, keys: list[Tensor],
              position_embeddings: tuple[Tensor, Tensor], cu_seqlens: Tensor) -> Tensor:
        """ToMe's merge `step` (`TowerBlocks._merge`) on every image's groups in grid order (the matching runs
        over the whole image), the result put back in window order: every unit that goes on in its destination
        group's window, at its rotary rows, with the windows recomputed."""
        assert isinstance(tower, WindowPass)
        adapter = self.adapter
        merge = adapter.merge
        members = torch.arange(merge, device=hidden.device)
        lengths = tower.lengths
        starts = [0, *torch.tensor(lengths).cumsum(0).tolist()[:-1]]

        def patch_rows(units: Tensor) -> Tensor:
            return (units[:, None] * merge + members).flatten()

        # Sequence (window) order -> grid order, image by image.
        to_grid = [kept.argsort() for kept in tower.kept_groups]
        rows = torch.cat([start + patch_rows(order) for start, order in zip(starts, to_grid, strict=True)])
        keys = [key[:, :, patch_rows(order).to(key.device)] for key, order in zip(keys, to_grid, strict=True)]
        tower.kept_groups = [kept[order] for kept, order in zip(tower.kept_groups, to_grid, strict=True)]
        if tower.size is not None:
            tower.size = [size[order] for size, order in zip(tower.size, to_grid, strict=True)]
        grid_embeddings = (position_embeddings[0][rows], position_embeddings[1][rows])
        merged = step(tower, hidden[rows], keys, grid_embeddings, cu_seqlens)
        # Grid order -> window order: every unit that goes on at its destination group's window row.
        to_window = [tower.window_rows[i][kept].argsort() for i, kept in enumerate(tower.kept_groups)]
        starts = [0, *torch.tensor(tower.lengths).cumsum(0).tolist()[:-1]]
        rows = torch.cat([start + patch_rows(order) for start, order in zip(starts, to_window, strict=True)])
        tower.kept_groups = [kept[order] for kept, order in zip(tower.kept_groups, to_window, strict=True)]
        tower.size = [size[order] for size, order in zip(tower.size, to_window, strict=True)]  # type: ignore[arg-type]
        tower.bias = [None if bias is None else bias[..., patch_rows(order)]
                      for bias, order in zip(tower.bias, to_window, strict=True)]
        embeddings = tower.position_embeddings
        tower.position_embeddings = (embeddings[0][rows], embeddings[1][rows])  # type: ignore[index]
        self.after_reduce(tower, cu_seqlens)
        return merged[rows]

    def patch_merger(self, patches: Patches) -> None:
        """The merger's output of a reduced pass back at the unreduced window-order rows (`_to_window_rows`),
        which the tower's own reverse order puts in grid order (the removed groups' rows zero)."""
        adapter = self.adapter
        merger = hf.qwen2_vl_merger(adapter.visual)
        inner_merger = forward_of(merger)

        def merger_forward(hidden_states: Tensor, *args: Any, **kwargs: Any) -> Tensor:
            merged = inner_merger(hidden_states, *args, **kwargs)
            tower = adapter.tower_pass
            if tower is not None:  # a tower split across devices (device maps)
                follow_device(tower, merged.device)
            if tower is None or merged.shape[0] == _total_groups(tower):  # type: ignore[arg-type]
                return merged
            return _to_window_rows(merged, tower)  # type: ignore[arg-type]

        patches.set(merger, "forward", merger_forward)

    def image_keys(self, chunks: list[tuple[Tensor, Tensor]], tower: TowerPass) -> list[Tensor]:
        """The last block's keys per image, in window order: a window layer ran one call per window."""
        assert isinstance(tower, WindowPass)
        if len(self.adapter.vision_layers) - 1 in self.full_layers:
            return super().image_keys(chunks, tower)
        return _keys_per_image([key for _, key in chunks], tower)

    def image_reads(self, tower: TowerPass, idx: int, chunks: list[tuple[Any, Any]], whole_item: bool
                    ) -> list[tuple[Any, Any]]:
        """Block `idx`'s probed (reads, keys) of an unreduced pass, one per image in grid order (a merge group's
        patches consecutive, the groups row-major), from its calls in window order: a full block's one call per
        image, reordered; a window block's calls per window joined per image, read over the whole image with the
        window mask left out where `whole_item` asks (the block's queries and keys, every pair: HiPrune's official
        recompute), else as the block ran (every window's own attention, the image's block diagonal: VScan's
        official read with the window mask applied), both put in grid order."""
        assert isinstance(tower, WindowPass)
        merge = self.adapter.merge
        out: list[tuple[Any, Any]] = []
        at = 0
        counts = [1] * len(tower.grids) if self.full(idx) else \
            [int((lengths > 0).sum()) for lengths in tower.window_lengths()]
        for image, count in enumerate(counts):
            pieces = chunks[at:at + count]
            at += count
            rows = tower.window_rows[image]  # window-order row of every group, in grid order
            keys = torch.cat([k for _, k in pieces], dim=2) if pieces[0][1] is not None else None
            device = keys.device if keys is not None else rows.device
            order = (rows.to(device)[:, None] * merge + torch.arange(merge, device=device)).flatten()
            reads = pieces[0][0]
            if reads is not None and count > 1 and not whole_item:
                # As the block ran: every window's own attention, the block diagonal of the image's windows in the
                # sequence's window order (a column sum over the image's queries is a window's own), put in grid
                # order below (`SegmentedReads.reordered`).
                reads = SegmentedReads([r for r, _ in pieces])
            elif reads is not None and count > 1:
                first = reads
                reads = ProbedAttention(torch.cat([r.query for r, _ in pieces], dim=2),
                                        torch.cat([r.key for r, _ in pieces], dim=2), first.scale,
                                        scores=first.scores, runner=first.runner, budget=first.budget)
            out.append((None if reads is None else reads.reordered(order),
                        None if keys is None else keys[:, :, order]))
        if at != len(chunks):
            raise RuntimeError(f"vision block {idx} ran {len(chunks)} calls, the tower pass holds {at}")
        return out

    def cut_input(self, tower: TowerPass, units: Tensor, keys: list[Tensor]) -> tuple[Tensor, list[Tensor]]:
        """Every image's groups put in grid order (units, and the keys patch by patch) for Qwen2-VL's cut, which
        then keeps groups by their grid indices (`kept_groups` restarts from the grid order)."""
        assert isinstance(tower, WindowPass)
        merge = self.adapter.merge
        members = torch.arange(merge, device=units.device)
        rows = [r.to(units.device) for r in tower.window_rows]  # window-order row of every group
        order = torch.cat([start + r for start, r in zip(tower.image_rows, rows, strict=True)])
        grid_keys = [key[:, :, (r[:, None] * merge + members).flatten().to(key.device)]
                     for key, r in zip(keys, rows, strict=True)]
        tower.kept_groups = [torch.arange(len(r), device=units.device) for r in rows]
        return units[order], grid_keys

    def video_grid_order(self, scores: Tensor, video: int) -> Tensor:
        """A video's per-slice group scores from the tower's window order (slice by slice: the window
        index is frame-major) to grid order."""
        order = self.video_windows[video]  # the video unit of every window-order row
        flat = scores.flatten()
        return torch.empty_like(flat).index_copy(0, order.to(flat.device), flat).view_as(scores)

    def split_features(self, out: Any, tower: TowerPass) -> tuple[Tensor, ...]:
        """Every image's kept groups in grid order (the rows of the removed groups dropped), split per image.
        HoliTom's videos: Qwen2-VL's (the tower hands out grid order)."""
        if self.adapter.video_cut:
            return super().split_features(out, tower)
        assert isinstance(tower, WindowPass)
        features = getattr(out, hf.FEATURES_FIELD)
        if features.shape[0] == _total_groups(tower):  # every group's row, the removed ones' zero
            rows = torch.cat([start + kept.sort().values for start, kept in zip(tower.image_rows, tower.kept_groups,
                                                                                 strict=True)])
            kept = features.index_select(0, rows.to(features.device))
        else:  # a cut on the tower's grid-order output (DivPrune, CDPruner): the kept groups only
            kept = features
        return torch.split(kept, [len(groups) for groups in tower.kept_groups])


class Qwen2_5_VLAdapter(Qwen2VLAdapter):
    """Where the method goes in a Qwen2.5-VL model: Qwen2-VL's adapter and parts, on the tower's window order."""

    family_title = "Qwen2.5-VL"
    order_strategy = WindowOrder  # FiCoCo-V, ToMe and the cuts run Qwen2-VL's passes on the window order
