"""The plugin's tensor work on a Qwen tower's merge groups, engine-free: the method's own ops
(`ficoco.methods.<name>.ops`) on every image's groups in grid order, batched per image size as ficoco's
transformers adapters batch them, and the kept tokens' M-RoPE positions.

- `TowerCut` runs a cut of whole merge groups at the tower's output (before the PatchMerger: VisionZip,
  VisPruner; scored by the last block's keys, the equivalent token in place of [CLS]) or after the merger on
  its output alone (DivPrune), and says which groups every image kept (grid indices, ascending) and where a
  merged token stands (VisionZip's contextual token: at its target's group). DeepStack features ride with the
  units through a step whose merges are decided from the keys alone (VisionZip), else follow the kept rows.
- `grid_positions` appends each kept token's (t, row, column) in its image's group grid to its embedding, and
  `place_positions` writes them into the prompt's M-RoPE positions once the encoder ran: the kept tokens keep the
  positions the unreduced prompt gives them, the text after an image the unreduced layout's (fixed by the grid).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

from ficoco.errors import FicocoError
from ficoco.methods.inputs import TowerInput
from ficoco.methods.ops import gather_tokens

POSITION_CHANNELS = 3  # (t, row, column) of a kept token in its image's group grid, appended to its embedding


@dataclass
class TowerPass:
    """One run of the tower over the images of a call: their grids (patches), where every group's row is in
    the tower's token order (Qwen2.5-VL's windows; Qwen3-VL's grid order), what the probes left, and what the cut
    kept (per image: ascending group indices in grid order)."""

    grids: list[tuple[int, int, int]]
    merge_size: int
    rows: list[Tensor]  # per image: the tower-order row of every group (grid index -> row)
    keys: Tensor | None = None  # (1, S, H, d) the last block's keys, every image in the tower's order
    taps: list[Tensor] = field(default_factory=list)  # DeepStack merger outputs, (groups of all images, D) each
    kept: list[Tensor | None] = field(default_factory=list)

    @property
    def merge(self) -> int:
        return self.merge_size**2

    def groups(self, image: int) -> int:
        t, h, w = self.grids[image]
        return t * h * w // self.merge

    def starts(self) -> list[int]:
        """The first group row of every image in the call's sequence."""
        sizes = [self.groups(i) for i in range(len(self.grids))]
        return [0, *np.cumsum(sizes).tolist()[:-1]]

    def by_size(self) -> dict[tuple[int, int, int], list[int]]:
        sizes: dict[tuple[int, int, int], list[int]] = {}
        for image, grid in enumerate(self.grids):
            sizes.setdefault(grid, []).append(image)
        return sizes


Runner = Callable[[TowerInput, dict[str, Any]], Any]
# A grid's step: the settings the method's ops run with, the units it removes and adds (the plan for that grid:
# under a tflops budget images of different sizes keep different counts).
StepOf = Callable[[tuple[int, int, int]], tuple[dict[str, Any], int, int]]


def _sorted_places(out: Any, title: str) -> tuple[Tensor, Tensor]:
    places = out.positions if out.positions is not None else out.kept
    if out.counts is not None or places.shape[1] != out.hidden.shape[1] or bool((places < 0).any()):
        raise FicocoError(f"ficoco.vllm: {title} hands the LLM tokens without a merge group's place (M-RoPE position)")
    order = torch.sort(places, dim=1)
    return order.values, order.indices


def cut_units(tower: TowerPass, units: Tensor, step: Runner, step_of: StepOf, title: str, rides: bool) -> list[Tensor]:
    """A cut at the tower's output: `units` (groups of every image in the tower's order, merge x C) -> per image
    the units that go on, in grid order of their places; `tower.kept` is filled, and the DeepStack taps (rows
    in the tower's order) are rewritten in place at the kept groups' rows where the step merged them."""
    if tower.keys is None:
        raise RuntimeError("ficoco.vllm: the last vision block's keys were not captured")
    keys = tower.keys.transpose(1, 2)  # (1, H, S, d)
    merge = tower.merge
    members = torch.arange(merge, device=units.device)
    starts = tower.starts()
    out_units: list[Tensor | None] = [None] * len(tower.grids)
    tower.kept = [None] * len(tower.grids)
    width = units.shape[-1]
    for grid, images in tower.by_size().items():
        _, h, w = grid
        settings, remove, added = step_of(grid)
        rows = [starts[i] + tower.rows[i].to(units.device) for i in images]
        step_units = torch.stack([units[r] for r in rows])
        if not remove and not added:  # the plan keeps every group (a budget these images fit whole)
            for b, image in enumerate(images):
                out_units[image] = step_units[b]
                tower.kept[image] = torch.arange(step_units.shape[1], device=units.device)
            continue
        patch_rows = [(r[:, None] * merge + members).flatten() for r in rows]
        step_keys = torch.cat([keys[:, :, p.to(keys.device)] for p in patch_rows])
        riding = None
        if tower.taps:
            riding = torch.stack([torch.cat([tap[r] for tap in tower.taps], dim=-1) for r in rows])
            if rides:  # merged as the units are (the step decides from the keys alone)
                step_units = torch.cat([step_units, riding.to(step_units.dtype)], dim=-1)
        inputs = TowerInput(hidden=step_units, has_cls=False, remove=remove, added=added, keys=step_keys,
                            merge=merge, grid_hw=(h // tower.merge_size, w // tower.merge_size))
        out = step(inputs, settings)
        kept, order = _sorted_places(out, title)
        hidden = gather_tokens(out.hidden, order)
        if riding is not None:
            # The taps at the kept groups' rows: what rode through the step, or the kept rows' own features.
            kept_at = torch.gather(out.kept, 1, order)
            follow = hidden[..., width:] if rides else gather_tokens(riding, kept.clamp(min=0))
            if not rides and bool((kept_at < 0).any()):
                raise FicocoError(f"ficoco.vllm: {title} merges tokens, which DeepStack's features cannot follow")
            _write_taps(tower, [starts[i] + tower.rows[i].to(units.device)[kept[b]] for b, i in enumerate(images)],
                        follow)
        for b, image in enumerate(images):
            out_units[image] = hidden[b, :, :width]
            tower.kept[image] = kept[b]
    return out_units  # type: ignore[return-value]


def _write_taps(tower: TowerPass, rows: list[Tensor], features: Tensor) -> None:
    width = tower.taps[0].shape[-1]
    for b, row in enumerate(rows):
        for j, tap in enumerate(tower.taps):
            tap[row] = features[b, :, j * width:(j + 1) * width].to(tap.dtype)


def cut_projected(tower: TowerPass, features: list[Tensor], step: Runner, step_of: StepOf, title: str,
                  width: int) -> list[Tensor]:
    """A cut after the merger on its output alone (DivPrune): per image, `features` (groups, width + DeepStack
    channels) in grid order -> the rows of the groups the step kept (every channel: DeepStack follows)."""
    out: list[Tensor | None] = [None] * len(features)
    tower.kept = [None] * len(features)
    for grid, images in tower.by_size().items():
        _, h, w = grid
        settings, remove, added = step_of(grid)
        if not remove and not added:  # the plan keeps every group (a budget these images fit whole)
            for image in images:
                out[image] = features[image]
                tower.kept[image] = torch.arange(features[image].shape[0], device=features[image].device)
            continue
        main = torch.stack([features[i][:, :width] for i in images])
        inputs = TowerInput(hidden=main, has_cls=False, remove=remove, merge=tower.merge,
                            grid_hw=(h // tower.merge_size, w // tower.merge_size))
        red = step(inputs, settings)
        kept, _ = _sorted_places(red, title)
        for b, image in enumerate(images):
            out[image] = features[image][kept[b].to(features[image].device)]
            tower.kept[image] = kept[b]
    return out  # type: ignore[return-value]


@dataclass(frozen=True)
class PatchLayout:
    """How a Qwen processor packs an image's patches (`pixel_values` rows: C x T x P x P each, a merge group's
    patches consecutive, every image's groups in grid order) and how it normalises them (8-bit values times
    `rescale`, then mean and std per channel)."""

    channels: int
    temporal_patch_size: int
    patch_size: int
    merge_size: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    rescale: float = 1 / 255  # the Qwen processors' rescale_factor

    def normalised(self, pixels: Tensor) -> Tensor:
        """The processor's float pixels: `pixels` as given where they are floats; 8-bit values (vLLM hands the
        model its processor's raw values and normalises them in the tower, `mm_input_norm`) normalised as
        transformers' processor does (rescale and normalisation fused: (x - mean / rescale) / (std / rescale) in
        float32), so that the selector reads the very values ficoco's transformers adapter reads."""
        if pixels.is_floating_point():
            return pixels
        shape = (1, self.channels, 1)
        mean = (torch.tensor(self.mean, device=pixels.device) * (1.0 / self.rescale)).view(shape)
        std = (torch.tensor(self.std, device=pixels.device) * (1.0 / self.rescale)).view(shape)
        flat = pixels.to(torch.float32).reshape(pixels.shape[0], self.channels, -1)
        return ((flat - mean) / std).reshape(pixels.shape)


def pixel_kept_groups(pixels: Tensor, grids: Sequence[tuple[int, int, int]], layout: PatchLayout, step: Runner,
                      step_of: StepOf) -> list[Tensor]:
    """Every image's kept merge groups (grid indices, ascending), chosen from its pixels by a cut at the tower's
    input (PixelPrune's `tower_step`), one batched call per image size as ficoco's transformers adapter runs it:
    `pixels` the packed patches of the images of `grids`. The processor calls it to write an image's
    placeholders and the model to cut its tower's input: the same pixels give both the same groups."""
    from ficoco.methods.pixelprune.ops import group_pixels

    merge = layout.merge_size**2
    units = group_pixels(layout.normalised(pixels), channels=layout.channels,
                         temporal_patch_size=layout.temporal_patch_size, patch_size=layout.patch_size, merge=merge,
                         mean=layout.mean, std=layout.std)
    lengths = [t * h * w // merge for t, h, w in grids]
    if sum(lengths) != units.shape[0]:
        raise RuntimeError(f"ficoco.vllm: {units.shape[0]} merge groups of pixels for grids {list(grids)}")
    pieces = units.split(lengths)
    kept: list[Tensor | None] = [None] * len(grids)
    sizes: dict[tuple[int, int, int], list[int]] = {}
    for image, grid in enumerate(grids):
        sizes.setdefault(tuple(grid), []).append(image)  # type: ignore[arg-type]
    for grid, images in sizes.items():
        t, h, w = grid
        if t != 1:
            raise FicocoError("ficoco.vllm: PixelPrune reduces images; its grid of merge groups does not fit a "
                              "video's temporal slices")
        settings, _, _ = step_of(grid)
        inputs = TowerInput(hidden=torch.stack([pieces[i] for i in images]), has_cls=False, remove=0, merge=merge,
                            grid_hw=(h // layout.merge_size, w // layout.merge_size))
        out = step(inputs, settings)
        counts = out.counts.tolist() if out.counts is not None else [out.kept.shape[1]] * len(images)
        for b, image in enumerate(images):
            kept[image] = out.kept[b, :counts[b]]
    return kept  # type: ignore[return-value]


def grid_positions(embeds: Tensor, kept: Tensor, grid: tuple[int, int, int], merge_size: int) -> Tensor:
    """`embeds` (K, D) of an image's kept groups `kept` (grid indices, ascending) with their (t, row, column) in
    the image's group grid appended (K, D + 3), as vLLM's own pruning carries positions to the runner."""
    _, h, w = grid
    cols = w // merge_size
    per_frame = (h // merge_size) * cols
    kept = kept.to(embeds.device)
    place = torch.stack([kept // per_frame, (kept % per_frame) // cols, kept % cols], dim=1)
    return torch.cat([embeds, place.to(embeds.dtype)], dim=1)


def prompt_positions(length: int, spans: Sequence[tuple[int, int, int, int, int, float]]) -> tuple[Tensor, int]:
    """(3, length) M-RoPE positions of a prompt whose media spans are `spans` (offset, tokens, t, h, w,
    t_factor; h and w in merge groups), and the delta decoding continues with. Text and every span start where
    the unreduced prompt puts them (the next text after a span at the full grid's largest position + 1); a
    reduced span's tokens get the grid's first positions here, which `place_positions` replaces by the kept
    tokens' own once the encoder ran."""
    pieces: list[np.ndarray] = []
    start = 0
    next_position = 0
    for offset, tokens, t, h, w, t_factor in sorted(spans):
        text = offset - start
        pieces.append(np.broadcast_to(np.arange(text), (3, text)) + next_position)
        base = next_position + text
        grid = np.indices((t, h, w))
        if t_factor != 1.0:
            grid[0] = (grid[0] * t_factor).astype(np.int64)
        grid = grid.reshape(3, -1) + base
        pieces.append(grid[:, :tokens])
        next_position = int(grid.max()) + 1
        start = offset + tokens
    if start < length:
        text = length - start
        pieces.append(np.broadcast_to(np.arange(text), (3, text)) + next_position)
    positions = np.concatenate(pieces, axis=1).reshape(3, -1) if pieces else np.zeros((3, 0), dtype=np.int64)
    delta = int(max(next_position, int(positions.max()) + 1 if positions.size else 0) - length)
    return torch.from_numpy(np.ascontiguousarray(positions)).long(), delta


def place_positions(input_ids: Sequence[int] | Tensor, embeddings: Sequence[Tensor], positions: Tensor,
                    computed: int, media_token_ids: int | Sequence[int]) -> tuple[list[Tensor], Tensor, int]:
    """The runner's call once the encoder ran (vLLM's `recompute_mrope_positions`): `embeddings` are the image
    (and video) rows this step feeds (each with its 3 position channels), in prompt order from token `computed` on,
    their placeholders the tokens of `media_token_ids` (image and video spans never touch: a vision start and end
    token stand around each); their
    placeholders get the kept tokens' positions, base + (t, row, column), where base is the position after the
    token before the image's span (the unreduced prompt's first grid position). Returns the embeddings without
    the channels, the positions, and the delta decoding continues with."""
    ids = torch.as_tensor(input_ids, dtype=torch.long).cpu()
    out = positions.clone()
    stripped = [e[:, :-POSITION_CHANNELS] for e in embeddings]
    places = [e[:, -POSITION_CHANNELS:].round().long().cpu() for e in embeddings]
    total = sum(p.shape[0] for p in places)
    if total:
        wanted = torch.as_tensor([media_token_ids] if isinstance(media_token_ids, int) else list(media_token_ids))
        is_image = torch.isin(ids, wanted)
        index = torch.arange(ids.numel())
        # The first token of every image span, for every token: the latest span start at or before it.
        begins = is_image & ~torch.cat([torch.zeros(1, dtype=torch.bool), is_image[:-1]])
        span_start = torch.cummax(torch.where(begins, index, torch.zeros_like(index)), dim=0).values
        targets = index[is_image & (index >= computed)][:total]
        if targets.numel() != total:
            raise RuntimeError(f"ficoco.vllm: {total} image rows for {targets.numel()} placeholders left in the prompt")
        first = span_start[targets]
        base = torch.where(first > 0, out[0, (first - 1).clamp(min=0)] + 1, torch.zeros_like(first))
        out[:3, targets] = (base.unsqueeze(1) + torch.cat(places)).T.to(out.dtype)
    delta = int(out[:3].max()) + 1 - ids.numel() if out.numel() else -ids.numel()
    return stripped, out, delta
