"""VLM-Pruner (Casey-bit's code 556a914, read in xipingyan/VLMPruner @ 2eb1965): the step at decoder layer K.

At the input of layer K (default 2), from layer K-1's post-RoPE keys (heads concatenated) and its output
(`get_retained_image_token`, llava/model/language_model/modeling_llama_self.py:415-521; the Qwen2-VL code,
Qwen2-VL/Qwen2VL_VLMPruner/modeling_qwen2_vl_self.py:417-521, is the same rule):

1. **Pivots** (:427-435): the image token whose key has the largest L1 norm, then ``P - 1`` more by
   farthest-point sampling: each the token whose Euclidean key distance to its nearest pivot is largest.
2. **Similarity** (:442-451): cosine on layer K-1's output restricted to the 256 channels of highest variance
   across the image tokens.
3. **BSS** (:399-413, :452): a candidate's similarity to every kept token is scaled by ``1 + 0.5 r``, ``r`` its
   grid distance to its nearest kept token over the grid's diagonal.
4. **Greedy rounds** (:455-493): the threshold starts at 0.8 and rises by 0.1 per round; a round sorts the
   candidates by ``1 - max`` buffered similarity to the kept set and takes them 16 at a time, recomputing the
   similarities against the kept set per batch; a candidate is kept when its ``max < threshold``, a batch that
   would overshoot the budget R keeps its ``R - kept`` least similar (topk). A round whose first batch keeps
   nothing ends the selection, so fewer than R tokens may stay (the count is adaptive: measured, the same in
   every sample of a batch or the batch is refused).
5. **SWA** (:495-515): every discarded token joins its most similar kept token (plain cosine); a kept token
   whose members' similarities sum above zero becomes ``0.3 h + 0.7 sum(w h_member)``, ``w`` the similarities
   over their sum.
6. The kept tokens stay in their original order with their **original** position ids (:354-362).

The grid BSS reads (`spatial_places`): ``bss_grid="official"`` lays every image's placeholders out in rows of the
tower's patch-grid width and normalises by that grid's diagonal, as the official code does (LLaVA: 24 and
24 sqrt 2, its CLIP item's grid, exact for LLaVA-1.5; Qwen2-VL: image_grid_thw's width and diagonal, before the
2x2 merge, so a row of the layout holds two rows of tokens); ``"tokens"`` (ficoco's correction) places every
token on its own image's, packed crop grid's, tile's or frame's grid of LLM tokens. Tokens of different images
(grids), and tokens on no grid (a frame's [CLS], a newline), are a whole diagonal apart (ficoco's extension: the
official code reads one image).

Departures (docs/methods/vlmpruner.md): batched (the official code asserts batch 1), the greedy run per sample;
the selection's arithmetic in float32 (the official code runs in the model's half precision); distances and
cosines as matrix products (counters see them; the official cdist of 576 rows takes the same product form);
keys of the key-value heads (the official SDPA path repeats them per query head, which scales every norm and
distance alike); candidates of equal buffered similarity are taken lowest index first (the official argsort is
unstable); ``channels`` is at most the hidden width.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from ficoco.errors import FicocoError
from ficoco.methods.inputs import ImageGrids, Reduced, StepInput
from ficoco.methods.ops import check_span, compute_dtype, gather_tokens, rebuild, visual_positions
from ficoco.methods.vlmpruner import (
    BSS_GRID,
    BSS_GRIDS,
    CHANNELS,
    KEPT_SHARE,
    PIVOT_IMAGE_TOKEN,
    THRESHOLD,
    TOKEN_BATCH,
)

__all__ = ["buffered_similarity", "channel_cosine", "greedy_selection", "grid_distances", "pivots",
           "spatial_places", "step", "vlmpruner_reduce", "vlmpruner_select"]


def spatial_places(images: Sequence[Sequence[ImageGrids]], visual_ranks: Tensor, num_visual: int,
                   bss_grid: str = BSS_GRID) -> tuple[Tensor, Tensor, Tensor]:
    """Where BSS places every visual token: ``(xy (B, N, 2) float, region (B, N) long, scale (B, N) float)``.

    `images` per sample (`StepInput.images`), `visual_ranks` ``(B, N)`` each token's index in the unreduced span.
    ``region`` is the image (``"official"``) or grid (``"tokens"``) a token's distances are measured in, ``-1`` on
    no grid; ``scale`` is one over that grid's diagonal. Built on the host from the records (no device read).
    """
    if bss_grid not in BSS_GRIDS:
        raise FicocoError(f"VLM-Pruner bss_grid={bss_grid!r}: give one of {', '.join(BSS_GRIDS)}")
    if len(images) != visual_ranks.shape[0]:
        raise ValueError(f"{len(images)} samples of image grids for a batch of {visual_ranks.shape[0]}")
    tables = []
    for sample in images:
        span = sum(image.tokens for image in sample)
        xy, region, scale = [[0.0, 0.0] for _ in range(span)], [-1] * span, [1.0] * span
        grid_id = 0
        for m, image in enumerate(sample):
            if bss_grid == "official":
                rows, width = image.patches
                diagonal = 1.0 / math.sqrt(rows ** 2 + width ** 2)
                for offset in range(image.tokens):
                    xy[image.start + offset] = [float(offset % width), float(offset // width)]
                    region[image.start + offset], scale[image.start + offset] = m, diagonal
                continue
            for grid in image.grids:
                diagonal = 1.0 / math.sqrt(grid.rows ** 2 + grid.cols ** 2)
                for row in range(grid.rows):
                    for col in range(grid.cols):
                        index = grid.start + row * grid.stride + col
                        xy[index], region[index], scale[index] = [float(col), float(row)], grid_id, diagonal
                grid_id += 1
        tables.append((xy, region, scale))
    width = max(len(t[1]) for t in tables) if tables else 0
    if width < num_visual:
        raise ValueError(f"the images' grids cover {width} span tokens, fewer than the {num_visual} visual tokens")
    device = visual_ranks.device
    xy_t = torch.tensor([t[0] + [[0.0, 0.0]] * (width - len(t[0])) for t in tables], device=device)
    region_t = torch.tensor([t[1] + [-1] * (width - len(t[1])) for t in tables], device=device)
    scale_t = torch.tensor([t[2] + [1.0] * (width - len(t[2])) for t in tables], device=device)
    ranks = visual_ranks.to(device=device, dtype=torch.long)
    index = ranks.clamp(min=0)
    region = torch.where(ranks >= 0, torch.gather(region_t, 1, index), -1)  # a token a method added: no grid
    return gather_tokens(xy_t, index), region, torch.gather(scale_t, 1, index)


def grid_distances(xy: Tensor, region: Tensor, scale: Tensor) -> Tensor:
    """``(B, N, N)``: the grid distance of every pair over the row token's grid diagonal, 1 between regions and
    from a token on no grid. One product of the 2-wide positions (as cdist's product form for many rows)."""
    xy = xy.float()
    squares = (xy * xy).sum(dim=-1)
    product = xy @ xy.transpose(1, 2)
    distance = (squares.unsqueeze(2) + squares.unsqueeze(1) - 2 * product).clamp(min=0).sqrt()
    same = (region.unsqueeze(2) == region.unsqueeze(1)) & (region >= 0).unsqueeze(2)
    return torch.where(same, distance * scale.unsqueeze(2), torch.ones_like(distance))


def pivots(keys: Tensor, count: int = PIVOT_IMAGE_TOKEN) -> Tensor:
    """``(B, P)`` pivots of ``keys`` ``(B, N, C)``: the largest L1 norm, then farthest-point sampling on the
    Euclidean distance (each new pivot the token farthest from its nearest pivot), one product per pivot."""
    keys = keys.to(compute_dtype(keys.dtype))
    chosen = [keys.abs().sum(dim=-1).argmax(dim=1)]
    squares = (keys * keys).sum(dim=-1)
    nearest = None
    for _ in range(1, count):
        last = chosen[-1]
        pivot = gather_tokens(keys, last.unsqueeze(1))  # (B, 1, C)
        product = (keys @ pivot.transpose(1, 2)).squeeze(-1)
        distance = (squares + torch.gather(squares, 1, last.unsqueeze(1)) - 2 * product).clamp(min=0).sqrt()
        nearest = distance if nearest is None else torch.minimum(nearest, distance)
        chosen.append(nearest.argmax(dim=1))
    return torch.stack(chosen, dim=1)


def channel_cosine(states: Tensor, channels: int = CHANNELS) -> Tensor:
    """``(B, N, N)`` cosine of every pair of ``states`` ``(B, N, D)`` on the ``channels`` channels of highest
    variance across the N tokens (all of them when the width is smaller), as one product of unit vectors."""
    states = states.to(compute_dtype(states.dtype))
    width = min(channels, states.shape[-1])
    top = torch.topk(states.var(dim=1), width, dim=-1).indices  # (B, C)
    screened = torch.gather(states, 2, top.unsqueeze(1).expand(-1, states.shape[1], -1))
    unit = F.normalize(screened, dim=-1, eps=1e-8)
    return unit @ unit.transpose(1, 2)


def buffered_similarity(similarity: Tensor, distances: Tensor, rows: Tensor, kept: Tensor) -> Tensor:
    """BSS: ``similarity[rows][:, kept]`` scaled by ``1 + 0.5 min_k distance[rows][:, kept]`` (per row)."""
    reward = distances[rows][:, kept].amin(dim=1, keepdim=True)
    return similarity[rows][:, kept] * (1.0 + 0.5 * reward)


def greedy_selection(similarity: Tensor, distances: Tensor, start: Tensor, budget: int,
                     threshold: float = THRESHOLD, token_batch: int = TOKEN_BATCH) -> Tensor:
    """One sample's kept tokens ``(k,)`` in the order they were taken (the pivots `start` first), by the official
    rounds: a round whose first batch keeps nothing ends the selection (fewer than `budget` may stay).

    The kept set stays a tensor built from the similarities, the distances and the pivots (only its length
    steers the loop), so that a tracing counter (fvcore) sees the products it is made from."""
    count = similarity.shape[0]
    every = torch.arange(count, device=similarity.device)
    selected = start
    level = threshold - 0.1  # the official accumulation: 0.8 - 0.1, then + 0.1 per round
    before = 0
    while selected.numel() < budget:
        if before == selected.numel():
            break
        before = selected.numel()
        level = level + 0.1
        free = torch.ones(count, dtype=torch.bool, device=similarity.device).scatter(
            0, selected, torch.zeros_like(selected, dtype=torch.bool))
        candidates = every[free]
        if candidates.numel() == 0:
            break
        nearest = buffered_similarity(similarity, distances, candidates, selected).max(dim=1).values
        ranked = candidates[torch.sort(1.0 - nearest, descending=True, stable=True).indices]
        for i in range(0, ranked.numel(), token_batch):
            if i == token_batch and before == selected.numel():
                break
            batch = ranked[i:i + token_batch]
            nearest = buffered_similarity(similarity, distances, batch, selected).max(dim=1).values
            accepted = batch[nearest < level]
            if selected.numel() + accepted.numel() > budget:
                accepted = batch[torch.topk(1.0 - nearest, budget - selected.numel()).indices]
            if accepted.numel():
                selected = torch.cat([selected, accepted])
                if selected.numel() >= budget:
                    break
    return selected


def vlmpruner_select(keys: Tensor, states: Tensor, distances: Tensor, budget: int,
                     pivot_image_token: int = PIVOT_IMAGE_TOKEN, threshold: float = THRESHOLD,
                     token_batch: int = TOKEN_BATCH, channels: int = CHANNELS) -> tuple[Tensor, Tensor]:
    """``(selected (B, k) in the order taken, similarity (B, N, N))`` of the span's tokens ``keys`` ``(B, N, C)``
    and ``states`` ``(B, N, D)`` under BSS ``distances`` ``(B, N, N)`` (`grid_distances`). Every sample must end
    at the same count ``k <= budget``, or the batch is refused in one line."""
    if not 1 <= pivot_image_token <= budget:
        raise FicocoError(f"VLM-Pruner keeps its {pivot_image_token} pivots whatever the budget: a budget of "
                          f"{budget} is below them")
    similarity = channel_cosine(states, channels)
    first = pivots(keys, pivot_image_token)
    runs = []
    for b in range(keys.shape[0]):
        start = first[b]
        if pivot_image_token > 1 and torch.unique(start).numel() < pivot_image_token:
            # Keys with no distance left between them (every key alike): each pivot once.
            start = torch.tensor(list(dict.fromkeys(start.tolist())), dtype=torch.long, device=start.device)
        runs.append(greedy_selection(similarity[b], distances[b], start, budget, threshold, token_batch))
    counts = sorted({run.numel() for run in runs})
    if len(counts) > 1:
        raise FicocoError(f"VLM-Pruner's selection ended at different counts in the samples of this batch "
                          f"({', '.join(map(str, counts))} of a budget of {budget}: a round kept nothing), which one "
                          "batch cannot carry; run the samples one at a time (the official code runs batch 1)")
    return torch.stack(runs), similarity


def swa(states: Tensor, similarity: Tensor, selected: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """SWA: ``(states with the kept tokens folded, kept (B, k) ascending, merge_target (B, N - k))``.

    Every discarded token joins the kept token it is most similar to (plain cosine; the first in the order
    taken on equal values); a kept token whose members' similarities sum above zero becomes ``0.3 h + 0.7 sum(w
    h_member)``, ``w`` the similarities over that sum (at least 1e-8), one dense product as the official
    ``torch.mm``. ``merge_target`` indexes the ascending kept tokens, per discarded token in ascending order."""
    batch, count, _ = states.shape
    taken = selected.shape[1]
    # A tensor source (a Python bool value does not trace for fvcore's torch.jit counter).
    flags = torch.ones(batch, count, dtype=torch.bool, device=states.device).scatter(
        1, selected, torch.zeros_like(selected, dtype=torch.bool))
    order = torch.sort(flags.to(torch.int8), dim=1, stable=True).indices  # kept ascending, then discarded
    kept, discarded = order[:, :taken], order[:, taken:]
    rows = torch.gather(similarity, 1, discarded.unsqueeze(-1).expand(-1, -1, count))
    sims = torch.gather(rows, 2, selected.unsqueeze(1).expand(-1, discarded.shape[1], -1))  # (B, r, k)
    target = sims.argmax(dim=2)
    weights = sims * torch.zeros_like(sims).scatter(2, target.unsqueeze(-1), 1.0)
    weights = weights / weights.sum(dim=1, keepdim=True).clamp(min=1e-8)
    dtype = compute_dtype(states.dtype)
    members = gather_tokens(states, discarded).to(dtype)
    folded = weights.transpose(1, 2) @ members  # (B, k, D)
    update = weights.sum(dim=1) > 0  # (B, k)
    own = gather_tokens(states, selected)
    merged = torch.where(update.unsqueeze(-1), (KEPT_SHARE * own.to(dtype) + (1 - KEPT_SHARE) * folded)
                         .to(states.dtype), own)
    out = states.scatter(1, selected.unsqueeze(-1).expand(-1, -1, states.shape[-1]), merged)
    # The kept token (ascending index) every discarded one joined.
    merge_target = torch.searchsorted(kept.contiguous(), torch.gather(selected, 1, target).contiguous())
    return out, kept, merge_target


def vlmpruner_reduce(hidden: Tensor, keys: Tensor, visual_start: Tensor, num_visual: int, keep: int,
                     position_ids: Tensor, xy: Tensor, region: Tensor, scale: Tensor,
                     attention_mask: Tensor | None = None, pivot_image_token: int = PIVOT_IMAGE_TOKEN,
                     threshold: float = THRESHOLD, token_batch: int = TOKEN_BATCH,
                     channels: int = CHANNELS) -> Reduced:
    """Prune the input of layer K to VLM-Pruner's kept tokens, SWA folded into them, original positions.

    Args:
        hidden: ``(B, T, D)`` the input of layer K (the output of layer K-1).
        keys: ``(B, T, H_kv * d)`` layer K-1's post-RoPE keys, heads concatenated.
        visual_start: ``(B,)``; num_visual: ``N``; keep: the budget R.
        position_ids: ``(B, T)`` the input's position ids; attention_mask: optional ``(B, T)``.
        xy, region, scale: every visual token's place for BSS (`spatial_places`).
        pivot_image_token, threshold, token_batch, channels: the official settings (4, 0.8, 16, 256).
    """
    check_span(hidden, visual_start, num_visual)
    start = visual_start.to(device=hidden.device, dtype=torch.long)
    span = visual_positions(start, num_visual)
    states = gather_tokens(hidden, span)
    selected, similarity = vlmpruner_select(gather_tokens(keys, span.to(keys.device)), states,
                                            grid_distances(xy, region, scale), keep, pivot_image_token,
                                            threshold, token_batch, channels)
    folded, kept, merge_target = swa(states, similarity, selected)
    merged = hidden.scatter(1, span.unsqueeze(-1).expand(-1, -1, hidden.shape[-1]), folded)
    red = rebuild(merged, kept, start, num_visual, position_ids, "original", attention_mask)
    return dataclasses.replace(red, merge_target=merge_target)


def step(inputs: StepInput, settings: dict) -> Reduced:
    """The model adapters' call at the input of layer K: pivots from layer K-1's keys, similarities from its
    output, BSS on the images' grids (`StepInput.images`)."""
    if inputs.keys is None or inputs.images is None or inputs.visual_ranks is None:
        raise RuntimeError("VLM-Pruner needs layer K-1's keys and the images' grids from the adapter")
    xy, region, scale = spatial_places(inputs.images, inputs.visual_ranks, inputs.num_visual,
                                       settings.get("bss_grid", BSS_GRID))
    return vlmpruner_reduce(inputs.hidden, inputs.keys, inputs.visual_start, inputs.num_visual, inputs.keep,
                            inputs.position_ids, xy, region, scale, attention_mask=inputs.attention_mask,
                            pivot_image_token=settings.get("pivot_image_token", PIVOT_IMAGE_TOKEN),
                            threshold=settings.get("threshold", THRESHOLD),
                            token_batch=settings.get("token_batch", TOKEN_BATCH),
                            channels=settings.get("channels", CHANNELS))
