"""FiCoCo-V inside vLLM's Qwen2.5-VL and Qwen3-VL towers, and PixelPrune's cut at their input (knows vLLM's
vision blocks; calls ficoco's ops).

PixelPrune's groups are chosen from the pixels before the tower runs (`TowerBlocks.keep_at_input`); the first
block takes their patch rows, and every block runs on them as on the kept groups after a FiCoCo-V reduction:
their rotary rows at their original places, the shorter images' segments (Qwen2.5-VL: the windows the kept groups
form). The tower's own patch embedding and (Qwen3-VL) position interpolation run on every patch first, as on
transformers.

FiCoCo-V removes whole merge groups inside the blocks its schedule names, after a block's attention residual and
before its MLP, as ficoco's transformers adapter does (ficoco.models.qwen2_vl's tower passes, on Qwen2.5-VL's
window order): every image's groups stay in the tower's window order; a reducing block's attention is read from
its own queries and keys (after rotary) segment by segment (`ProbedAttention`: the windows of a window block, side
by side as the block diagonal the block computed; the whole image in a full block); the method's `reduce_groups`
runs on every image's groups, batched per image size; the blocks after it run on the kept patches' rotary rows,
the shorter images and the windows their kept groups form (a window left empty is dropped). The merger maps the
kept groups only; its output goes back to the unreduced window-order rows (the removed ones zero), which the
tower's own reordering puts in grid order, and the model keeps each image's kept rows.

On Qwen3-VL (no windows: every block attends over whole images) DeepStack's taps ride through every reduction
after them, as on transformers: a tap's features per group are folded with the weights the groups are folded
with (`reduce_groups`' riding features); a tap after a reduction sees the kept groups only. Each tap's output goes
back to every group's row (the removed ones zero), and once the tower ran its rows hold what rode to the end, so
that the model keeps each image's kept rows of every tap.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ficoco.errors import FicocoError
from ficoco.methods.reads import DEFAULT_ATTENTION_SCORES
from ficoco.methods.reads.ops import ProbedAttention, SegmentedReads, stack_reads
from ficoco.serving.vllm.settings import ImagePlan
from ficoco.serving.vllm.tokens import TowerPass


@dataclass
class BlocksPass(TowerPass):
    """A tower pass under FiCoCo-V: per image the groups still present (original grid index, in window order),
    every original group's window, and, once a block reduced, the segments and rotary rows later blocks run on."""

    current: list[Tensor] = field(default_factory=list)  # per image: original group of every group present
    group_window: list[Tensor] = field(default_factory=list)
    windows: list[int] = field(default_factory=list)
    cu_seqlens: Tensor | None = None
    cu_window_seqlens: Tensor | None = None
    cos: Tensor | None = None
    sin: Tensor | None = None
    probe: dict[str, Tensor] = field(default_factory=dict)  # the reducing block's query, key and segments
    carried: list[Tensor | None] = field(default_factory=list)  # per image: the DeepStack taps so far, side by side
    input_rows: Tensor | None = None  # a cut at the tower's input: the patch rows the first block keeps
    tap_outputs: list[Tensor] = field(default_factory=list)  # every tap's output, all groups' rows

    def lengths(self) -> list[int]:
        return [self.merge * len(groups) for groups in self.current]

    def window_lengths(self) -> list[Tensor]:
        return [torch.bincount(self.group_window[i][groups], minlength=self.windows[i]) * self.merge
                for i, groups in enumerate(self.current)]


class TowerBlocks:
    """The reducing blocks of one model's tower (installed once; a pass per encoder call)."""

    def __init__(self, model: Any) -> None:
        self.model = model
        visual = model.visual
        self.visual = visual
        self.windowed = bool(model.windowed)
        self.full_layers = frozenset(int(i) for i in visual.fullatt_block_indexes) if self.windowed else \
            frozenset(range(len(visual.blocks)))
        self.plans: dict[tuple[int, int, int], ImagePlan] = {}
        spec = model.ficoco_spec
        # FiCoCo-V's step inside the blocks; a cut at the tower's input (PixelPrune) has none (`keep_at_input`).
        self.reduce_groups = getattr(model.ficoco_module, "reduce_groups", None)
        self.title = spec.title
        self.removed: dict[tuple[int, int, int], dict[int, int]] = {}  # per grid: block -> groups removed
        for index, block in enumerate(visual.blocks):
            block.attn.attn.register_forward_pre_hook(self._probe, with_kwargs=True)
            block.forward = self._forward(index, block, block.forward)
        merger = visual.merger
        original = merger.forward

        def merger_forward(x: Tensor) -> Tensor:
            return self._merger(x, original)

        merger.forward = merger_forward
        for tap in getattr(visual, "deepstack_merger_list", []):
            tap.register_forward_hook(self._tap)

    def start(self, grids: list[tuple[int, int, int]], plans: dict[tuple[int, int, int], ImagePlan | None]
              ) -> BlocksPass:
        """A new pass over `grids` under each grid's plan (its vision removals, per block; None: no plan fits the
        grid, which only vLLM's start-up image brings, and it goes through whole)."""
        self.plans = plans
        self.removed = {grid: {} if plan is None else {r.layer: r.remove for r in plan.removals
                                                       if r.stage == "vision" and r.where == "in_layer"}
                        for grid, plan in plans.items()}
        merge_size = self.visual.spatial_merge_size
        merge = merge_size**2
        current, group_window, windows, rows = [], [], [], []
        for t, h, w in grids:
            if not self.windowed:  # every block attends over the whole image, in grid order
                groups = t * h * w // merge
                current.append(torch.arange(groups))
                group_window.append(torch.zeros(groups, dtype=torch.long))
                windows.append(1)
                rows.append(torch.arange(groups))
                continue
            order, cu_window = self.visual.get_window_index_thw(t, h, w)
            groups = order.numel()
            bounds = (cu_window.long() // merge).tolist()
            sizes = torch.tensor([bounds[0]] + [b - a for a, b in zip(bounds, bounds[1:], strict=False)])
            window_of_row = torch.repeat_interleave(torch.arange(len(bounds)), sizes)
            window = torch.empty(groups, dtype=torch.long)
            window[order] = window_of_row
            row = torch.empty_like(order)
            row[order] = torch.arange(groups)
            current.append(order.long())
            group_window.append(window)
            windows.append(len(bounds))
            rows.append(row)
        return BlocksPass(grids=grids, merge_size=merge_size, rows=rows, current=current, group_window=group_window,
                          windows=windows, carried=[None] * len(grids))

    def keep_at_input(self, tower: BlocksPass, kept: list[Tensor]) -> None:
        """A cut at the tower's input: every image keeps the groups `kept` (grid indices), in the tower's order (a
        window's kept groups stay in it); the first block takes their patch rows (`_enter`). Nothing is cut where
        every image keeps every group."""
        merge = tower.merge
        members = torch.arange(merge)
        rows, start, cut = [], 0, False
        for image, groups in enumerate(kept):
            present = tower.current[image]  # original group of every group row, in the tower's order
            flags = torch.zeros(present.numel(), dtype=torch.bool)
            flags[groups.cpu()] = True
            at = flags[present].nonzero()[:, 0]  # where the kept groups stand in the tower's order
            cut = cut or at.numel() < present.numel()
            tower.current[image] = present[at]
            rows.append(start + (at[:, None] * merge + members).flatten())
            start += present.numel() * merge
        tower.input_rows = torch.cat(rows) if cut else None

    def _enter(self, tower: BlocksPass, x: Tensor, cos: Tensor, sin: Tensor, cu_seqlens: Tensor) -> Tensor:
        """The first block's input cut to the rows `keep_at_input` kept; the pass then holds their rotary rows
        (their original places) and the segments of the shorter images (and windows) for every block."""
        rows = tower.input_rows.to(x.device)  # type: ignore[union-attr]
        tower.input_rows = None
        self._resegment(tower, rows, cos, sin, cu_seqlens.dtype)
        return x[rows]

    @staticmethod
    def _resegment(tower: BlocksPass, rows: Tensor, cos: Tensor, sin: Tensor, dtype: torch.dtype) -> None:
        """The rotary rows of the patch rows `rows` and the segments of the groups `tower.current` (whole images;
        the windows their groups form, a window left empty dropped) for the blocks after a cut."""
        tower.cos, tower.sin = cos[rows], sin[rows]
        tower.cu_seqlens = F.pad(torch.tensor(tower.lengths()).cumsum(0), (1, 0)).to(dtype)
        windows = torch.cat(tower.window_lengths())
        tower.cu_window_seqlens = F.pad(windows[windows > 0].cumsum(0), (1, 0)).to(dtype)

    # -- the probe and the blocks -----------------------------------------------------------------------------
    def _pass(self) -> BlocksPass | None:
        tower = self.model.ficoco_pass
        return tower if isinstance(tower, BlocksPass) else None

    def _probe(self, module: Any, args: tuple, kwargs: dict) -> None:
        tower = self._pass()
        if tower is not None and tower.probe.get("armed") is not None:
            tower.probe.update(query=kwargs["query"], key=kwargs["key"], cu_seqlens=kwargs["cu_seqlens"],
                               scale=torch.tensor(float(module.scale)))

    def _tap(self, module: Any, args: tuple, output: Tensor) -> Tensor | None:
        """A DeepStack tap's output on the groups present: carried per image, and handed on at every group's row."""
        tower = self._pass()
        if tower is None:
            return None
        pieces = output.split([len(groups) for groups in tower.current])
        tower.carried = [piece if held is None else torch.cat([held, piece], dim=-1)
                         for held, piece in zip(tower.carried, pieces, strict=True)]
        full = output.new_zeros(sum(tower.groups(i) for i in range(len(tower.grids))), output.shape[-1])
        tower.tap_outputs.append(full)
        return full

    def _forward(self, index: int, block: Any, original: Any) -> Any:
        def forward(x: Tensor, cu_seqlens: Tensor, rotary_pos_emb_cos: Tensor, rotary_pos_emb_sin: Tensor,
                    max_seqlen: Tensor, sequence_lengths: Tensor | None = None) -> Tensor:
            tower = self._pass()
            if tower is not None and index == 0 and tower.input_rows is not None:  # a cut at the tower's input
                x = self._enter(tower, x, rotary_pos_emb_cos, rotary_pos_emb_sin, cu_seqlens)
            if tower is not None and tower.cos is not None:  # an earlier cut or block reduced: the pass's segments
                full = index in self.full_layers
                cu_seqlens = tower.cu_seqlens if full else tower.cu_window_seqlens  # type: ignore[assignment]
                rotary_pos_emb_cos, rotary_pos_emb_sin = tower.cos, tower.sin  # type: ignore[assignment]
                max_seqlen = (cu_seqlens[1:] - cu_seqlens[:-1]).max()
                sequence_lengths = None
            remove = tower is not None and any(removed.get(index, 0) for removed in self.removed.values())
            if not remove:
                return original(x, cu_seqlens=cu_seqlens, rotary_pos_emb_cos=rotary_pos_emb_cos,
                                rotary_pos_emb_sin=rotary_pos_emb_sin, max_seqlen=max_seqlen,
                                sequence_lengths=sequence_lengths)
            assert tower is not None
            tower.probe = {"armed": torch.tensor(1)}
            try:
                attended = block.attn(block.norm1(x), cu_seqlens=cu_seqlens, rotary_pos_emb_cos=rotary_pos_emb_cos,
                                      rotary_pos_emb_sin=rotary_pos_emb_sin, max_seqlen=max_seqlen,
                                      sequence_lengths=sequence_lengths)
                probe = dict(tower.probe)
            finally:
                tower.probe = {}
            hidden = self._reduce(tower, index, x + attended, probe, rotary_pos_emb_cos, rotary_pos_emb_sin)
            return hidden + block.mlp(block.norm2(hidden))

        return forward

    def _reduce(self, tower: BlocksPass, index: int, hidden: Tensor, probe: dict[str, Tensor], cos: Tensor,
                sin: Tensor) -> Tensor:
        """The groups each image's plan removes at this block leave (one batched step per image size); the pass
        follows."""
        merge = tower.merge
        query, key = probe["query"], probe["key"]  # (1, S, H, d)
        bounds = probe["cu_seqlens"].tolist()
        segments = list(zip(bounds[:-1], bounds[1:], strict=True))
        lengths = tower.lengths()
        full = index in self.full_layers
        planned = next((plan.settings_dict() for plan in self.plans.values() if plan is not None), {})
        scores = planned.get("attention_scores", DEFAULT_ATTENTION_SCORES)
        reads, keys, at, start = [], [], 0, 0
        for length in lengths:  # the segments of every image, in sequence order
            mine = []
            while at < len(segments) and segments[at][1] <= start + length:
                mine.append(segments[at])
                at += 1
            if not mine or mine[0][0] != start or mine[-1][1] != start + length:
                raise RuntimeError(f"ficoco.vllm: vision block {index}'s segments do not cover the images")
            parts = [ProbedAttention(query[:, a:b].transpose(1, 2), key[:, a:b].transpose(1, 2),
                                     float(probe["scale"]), scores=scores) for a, b in mine]
            reads.append(parts[0] if full else SegmentedReads(parts))
            keys.append(torch.cat([key[:, a:b].transpose(1, 2) for a, b in mine], dim=2))
            start += length
        pieces = hidden.squeeze(1).split(lengths)
        new_hidden: list[Tensor | None] = [None] * len(lengths)
        kept_at: list[Tensor | None] = [None] * len(lengths)
        for grid, images in tower.by_size().items():
            _, h, w = grid
            remove = self.removed[grid].get(index, 0)
            groups = len(tower.current[images[0]])
            if not remove:  # this size's plan removes nothing here: its groups go on as they are
                for image in images:
                    new_hidden[image] = pieces[image]
                    kept_at[image] = torch.arange(groups, device=hidden.device)
                continue
            settings = self.plans[grid].settings_dict()  # type: ignore[union-attr]
            if not 0 <= remove < groups:
                raise FicocoError(f"ficoco.vllm: vision block {index} would remove {remove} of the {groups} merge "
                                  f"groups left in an image of {h}x{w} patches")
            x = torch.stack([pieces[i] for i in images])
            riding = None
            if tower.carried and tower.carried[images[0]] is not None:  # DeepStack's taps so far ride along
                riding = torch.stack([tower.carried[i] for i in images]).to(x.dtype)  # type: ignore[misc]
            red = self.reduce_groups(x, stack_reads([reads[i] for i in images]),
                                     torch.cat([keys[i] for i in images]), remove,
                                     torch.stack([tower.current[i] for i in images]),
                                     (h // tower.merge_size, w // tower.merge_size), merge=merge,
                                     lam=settings["lam"], eps=settings["eps"], window=settings["window"],
                                     coefficient=settings["coefficient"], riding=riding)
            rode = red.riding
            for b, image in enumerate(images):
                new_hidden[image] = red.hidden[b]
                kept_at[image] = red.kept_positions[b]
                tower.current[image] = red.kept_groups[b]
                if rode is not None:
                    tower.carried[image] = rode[b]
        members = torch.arange(merge, device=hidden.device)
        starts = [0, *torch.tensor(lengths).cumsum(0).tolist()[:-1]]
        rows = torch.cat([first + (kept[:, None] * merge + members).flatten()
                          for first, kept in zip(starts, kept_at, strict=True)])  # type: ignore[index]
        self._resegment(tower, rows, cos, sin, probe["cu_seqlens"].dtype)
        return torch.cat(new_hidden).unsqueeze(1)  # type: ignore[arg-type]

    def _merger(self, x: Tensor, original: Any) -> Tensor:
        """The merger on the kept groups, its rows put back at the unreduced window-order rows (the others zero)."""
        tower = self._pass()
        merged = original(x)
        if tower is None:
            return merged
        starts = tower.starts()
        tower.kept = [groups.sort().values for groups in tower.current]
        if tower.tap_outputs:  # every tap's rows: what rode to the end, at the groups kept
            width = tower.tap_outputs[0].shape[-1]
            for j, full_rows in enumerate(tower.tap_outputs):
                full_rows.zero_()
                for i, (first, groups) in enumerate(zip(starts, tower.current, strict=True)):
                    held = tower.carried[i]
                    assert held is not None
                    full_rows[first + tower.rows[i][groups].to(full_rows.device)] = \
                        held[:, j * width:(j + 1) * width].to(full_rows.dtype)
        if tower.cos is None:  # no block reduced (an empty schedule)
            return merged
        rows = torch.cat([first + tower.rows[i][groups] for i, (first, groups) in enumerate(zip(starts, tower.current,
                                                                                              strict=True))])
        total = sum(tower.groups(i) for i in range(len(tower.grids)))
        full = merged.new_zeros(total, merged.shape[-1])
        return full.index_copy(0, rows.to(merged.device), merged)
