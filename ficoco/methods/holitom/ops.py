"""HoliTom (cokeshao/HoliTom, NeurIPS'25): holistic token merging for video LLMs.

**Outer-LLM merging** (`tower_step`, `holitom_reduce`), on the projector's output of every frame
of one video, ``(frames, N, D)``, before the LLM:

1. **Frame similarity**: the cosine of every grid position between consecutive frames,
   ``(frames - 1, N)``.
2. **Global redundancy-aware temporal segmentation**: a token is *static* over a window of frames
   ``[s, e]`` when every consecutive pair inside it is more similar than ``tau`` at its position;
   merging it saves ``e - s`` tokens. A dynamic programme over the frames picks the segmentation
   (each frame alone, or windows of 2.. ``max_window`` frames) that saves the most
   (``select_static_windows``: strict improvement, so ties keep the shorter window / the frame alone).
3. **Temporal merging**: in a window of several frames, every static token becomes the mean of
   its frames, placed at the window's first frame; the rest of the window's tokens are *dynamic*.
4. **Spatial merging**: the budget left (``retain_ratio / (1 - saved / total)`` in the official
   code) is spent part by part: the dynamic tokens of every frame keep their ``dominant`` tokens
   (the highest mean attention received in the tower layer the projector reads) and merge the rest
   into ``contextual`` DPC-kNN clusters; the static tokens of every window are merged into DPC-kNN
   clusters. A cluster token is ``beta * centre + (1 - beta) * mean(members)`` (the official
   default, ``BETA=0.6``, ``NO_BETA`` unset), a centre without members stays as it is.
5. **Order**: frame by frame, every frame's tokens in grid order, a window's static clusters with
   its first frame (the official ``mm_newline_position="grid"`` order, without newline tokens).

**Where it runs**: on Video-LLaVA, on every frame's projected patches ([CLS] apart); on LLaVA-OneVision
(the official code's backbone), after every frame's 2x2 pooling, on the pooled grid, with the attention
each patch receives pooled the same way (the official ``get_2dPool`` of the scores; the adapter hands a
pooled query-mean row, whose mean is the same score since pooling is linear); on Qwen2-VL videos, on the
PatchMerger's output: a "frame" is one temporal slice of ``temporal_patch_size`` (2) frames (the tower's
attention segment, ``video_grid_thw``'s t), its tokens the (h/2) x (w/2) merge groups, and a token's score
the mean attention received by the group's 4 patches in the last vision block (the merger's input; no
[CLS], no pooling), each kept token at its unit's 3-D position of the unreduced prompt; on Qwen2.5-VL
alike, the scores put back from the tower's window order into grid order (its last block may attend within
windows: a window's received attention over the slice's queries is its column sums, since no query outside
the window attends to it) and the temporal positions scaled by ``second_per_grid_ts`` as transformers does.

**Where this differs from the official code** (each says why):

- *A fixed count*: the official per-part counts (``round``/``ceil`` of ``size * ratio``) make the
  video's total vary around ``ratio * frames * N``; here the video hands on exactly ``budget``
  tokens, spread over the parts in proportion to their sizes (largest remainders; ties to the
  earlier part), so that a batch's prompts keep one layout and the accountant plans the count.
- *Over-merged videos*: when the temporal merge alone leaves fewer tokens than the budget (a
  nearly still video), the official code hands on fewer; here the video is not segmented (every
  frame its own window) and the spatial stage alone meets the budget.
- *No random noise*: DPC-kNN's ``density + rand * 1e-6`` tie-break is replaced by a deterministic
  one (equal densities: the lower index ranks higher), so runs and batches repeat exactly.
- *Distances by one matrix product* (``|a|^2 + |b|^2 - 2 a.b``) instead of ``torch.cdist``, batched
  over every frame slot with masks, so the work is one counted product per group.

Ties among equal attention scores or cluster scores: the lowest index.

**Inner-LLM merging** (`step`, `inner_merge`; ``holitom/modeling_qwen2.py``): at the input of decoder
layer K (``HOLITOM_k``, 18 in the README's runs), the ``round(n * (1 - r))`` visual tokens the last
prompt token attends to most in layer K-1 (head mean, FastV's row) stay, with their original
position ids; every other one is averaged into the kept token it is most cosine-similar to
(``HOLITOM_r = 0.5``). The official code reads the row from eager attention of batch 1; here the
probe recomputes it from layer K-1's q and k (SDPA stays on), per sample, padding masked.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ficoco.methods.holitom import BETA, CONTEXTUAL_SHARE, MAX_WINDOW, NEIGHBOURS, TAU
from ficoco.methods.inputs import Reduced, StepInput, TowerInput, TowerOutput
from ficoco.methods.ops import (
    check_span,
    compute_dtype,
    dpc_knn_scores,
    gather_tokens,
    rebuild,
    top_indices,
    visual_positions,
)
from ficoco.methods.ops import last_row_scores as fastv_scores  # FastV's rule
from ficoco.methods.reads.ops import AttentionReads, as_reads

__all__ = ["HolitomOutput", "apportion", "dpc_knn_merge", "frame_similarity", "holitom_reduce", "inner_merge",
           "segment_frames", "step", "tower_step"]


@dataclass(frozen=True)
class HolitomOutput:
    """``hidden`` ``(V, budget, D)`` the tokens every video hands on, frame by frame in grid order;
    ``origin`` ``(V, budget)`` the unit each continues (``frame * N + position``; a cluster: its centre);
    ``merged`` ``(V, budget)`` True for a token that is not one unit as it was (static or cluster);
    ``segment_start`` ``(V, frames)`` the first frame of every frame's window."""

    hidden: Tensor
    origin: Tensor
    merged: Tensor
    segment_start: Tensor


def frame_similarity(features: Tensor) -> Tensor:
    """``(V, F - 1, N)`` cosine similarity of every position between frame f and f + 1 (one product
    per position, so counters see it)."""
    unit = F.normalize(features, dim=-1)
    return (unit[:, :-1].unsqueeze(-2) @ unit[:, 1:].unsqueeze(-1)).squeeze(-1).squeeze(-1)


def segment_frames(static_pairs: Tensor, max_window: int) -> tuple[Tensor, Tensor, Tensor]:
    """The temporal segmentation of every video, batched: ``(start, end, saved)``.

    Args:
        static_pairs: ``(V, F - 1, N)`` bool, position n similar enough between frame f and f + 1.
        max_window: the longest window, in frames.

    Returns ``start`` and ``end`` ``(V, F)`` the window of every frame, ``saved`` ``(V,)`` the tokens
    the temporal merge saves, and (through ``start == end``) which frames stand alone.
    """
    videos, pairs, _ = static_pairs.shape
    frames = pairs + 1
    device = static_pairs.device
    # saved_in[v, s, e]: tokens a window [s, e] saves = (e - s) x its positions static throughout.
    saved_in = torch.zeros(videos, frames, frames, dtype=torch.long, device=device)
    for start in range(frames - 1):
        run = torch.cumprod(static_pairs[:, start:].long(), dim=1).sum(dim=-1)  # (V, F - 1 - start)
        lengths = torch.arange(1, frames - start, device=device)
        saved_in[:, start, start + 1:] = run * lengths
    best = torch.zeros(videos, frames + 1, dtype=torch.long, device=device)  # best[i + 1]: frames 0..i
    first = torch.zeros(videos, frames, dtype=torch.long, device=device)
    for i in range(frames):
        value = best[:, i].clone()
        start = torch.full((videos,), i, dtype=torch.long, device=device)
        for window in range(2, min(i + 1, max_window) + 1):
            j = i - window + 1  # the window [j, i]
            candidate = best[:, j] + saved_in[:, j, i]
            better = candidate > value
            value = torch.where(better, candidate, value)
            start = torch.where(better, torch.full_like(start, j), start)
        best[:, i + 1] = value
        first[:, i] = start
    return *_backtrack(first), best[:, frames]


def _backtrack(first: Tensor) -> tuple[Tensor, Tensor]:
    """(start, end) ``(V, F)`` of every frame's window from each window end's best start."""
    videos, frames = first.shape
    frame = torch.arange(frames, device=first.device)
    start = torch.zeros_like(first)
    end = torch.zeros_like(first)
    current = torch.full((videos,), frames - 1, dtype=torch.long, device=first.device)
    for _ in range(frames):
        active = current >= 0
        begin = torch.gather(first, 1, current.clamp(min=0).unsqueeze(1)).squeeze(1)
        inside = active.unsqueeze(1) & (frame >= begin.unsqueeze(1)) & (frame <= current.unsqueeze(1))
        start = torch.where(inside, begin.unsqueeze(1), start)
        end = torch.where(inside, current.unsqueeze(1), end)
        current = torch.where(active, begin - 1, current)
    return start, end


def apportion(sizes: Tensor, budget: int) -> Tensor:
    """``(V, P)`` counts summing to ``budget`` per row, in proportion to ``sizes`` ``(V, P)`` (whose
    rows sum to at least ``budget``): floors, then one more to the largest remainders (ties: the
    earlier part). A part never gets more than its size."""
    total = sizes.sum(dim=1, keepdim=True).clamp(min=1)
    floor = sizes * budget // total
    remainder = sizes * budget % total
    left = budget - floor.sum(dim=1, keepdim=True)
    order = torch.sort(remainder, dim=1, descending=True, stable=True).indices
    rank = torch.empty_like(order).scatter_(1, order, torch.arange(sizes.shape[1], device=sizes.device)
                                            .expand_as(order).contiguous())
    return floor + (rank < left).long()


def _rank_descending(scores: Tensor) -> Tensor:
    """The rank of every entry of ``scores`` ``(G, N)`` in descending order (ties: the lower index)."""
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices
    positions = torch.arange(scores.shape[1], device=scores.device).expand_as(order).contiguous()
    return torch.empty_like(order).scatter_(1, order, positions)


def dpc_knn_merge(x: Tensor, valid: Tensor, clusters: Tensor, neighbours: int, beta: float
                  ) -> tuple[Tensor, Tensor]:
    """DPC-kNN clustering of the valid tokens of every group, and the cluster tokens, batched.

    Args:
        x: ``(G, N, D)`` tokens (compute dtype).
        valid: ``(G, N)`` the tokens of each group that take part.
        clusters: ``(G,)`` centres per group (at most its valid tokens; 0: the group is unused).
        neighbours: the density's k (``min(k, clusters)`` per group, as the official code).
        beta: a cluster token's weight on its centre.

    Returns ``centre`` ``(G, N)`` bool and ``merged`` ``(G, N, D)`` (the cluster token at each centre).
    """
    groups, tokens, width = x.shape
    distance, score = dpc_knn_scores(x, valid, clusters, neighbours)
    inf = torch.tensor(float("inf"), dtype=x.dtype, device=x.device)
    centre = valid & (_rank_descending(score) < clusters.unsqueeze(1))
    # Every other valid token joins its nearest centre (ties: the lower index).
    assign = torch.where(centre.unsqueeze(1), distance, inf).argmin(dim=-1)
    member = valid & ~centre
    weight = member.to(x.dtype)
    sums = torch.zeros_like(x).scatter_add(1, assign.unsqueeze(-1).expand(-1, -1, width), x * weight.unsqueeze(-1))
    counts = torch.zeros(groups, tokens, dtype=x.dtype, device=x.device).scatter_add(1, assign, weight)
    mean = sums / counts.clamp(min=1).unsqueeze(-1)
    merged = torch.where((counts > 0).unsqueeze(-1), beta * x + (1 - beta) * mean, x)
    return centre, merged


def holitom_reduce(features: Tensor, scores: Tensor, budget: int, *, tau: float = TAU,
                   beta: float = BETA, neighbours: int = NEIGHBOURS,
                   contextual_share: float = CONTEXTUAL_SHARE, max_window: int = MAX_WINDOW
                   ) -> HolitomOutput:
    """HoliTom's outer-LLM merging of a batch of videos, each handing on exactly ``budget`` tokens.

    Args:
        features: ``(V, F, N, D)`` the projector's output of every frame (no [CLS]).
        scores: ``(V, F, N)`` each token's mean attention received in the tower layer the projector reads.
        budget: tokens per video, at most ``F * N``.
        tau: the static threshold on consecutive frames' cosine similarity (``T``).
        beta: a cluster token's weight on its centre (``BETA``).
        neighbours: DPC-kNN's k (``K``).
        contextual_share: the share of a frame's dynamic quota merged into clusters (``D``; 0: every
            dynamic token kept is a dominant one, the official default).
        max_window: the longest temporal window (``MAX_WINDOW_SIZE``).
    """
    videos, frames, tokens, width = features.shape
    if not 1 <= budget <= frames * tokens:
        raise ValueError(f"HoliTom hands on 1..{frames * tokens} tokens per video; got {budget}")
    dtype = compute_dtype(features.dtype)
    x = features.to(dtype)
    device = x.device
    frame = torch.arange(frames, device=device)
    if frames > 1:
        static_pairs = frame_similarity(x) > tau
        start, end, saved = segment_frames(static_pairs, max_window)
        # A video the temporal merge alone takes below the budget is not segmented.
        whole = (frames * tokens - saved) < budget
        start = torch.where(whole.unsqueeze(1), frame, start)
        end = torch.where(whole.unsqueeze(1), frame, end)
        # Static throughout a window: every pair inside it (none for a frame alone).
        pair = frame[:-1].view(1, -1)
        inside = (pair >= start.unsqueeze(2)) & (pair < end.unsqueeze(2))  # (V, F, F - 1): frame f's window pairs
        broken = (inside.unsqueeze(-1) & ~static_pairs.unsqueeze(1)).any(dim=2)  # (V, F, N)
        static = ~broken & (end > start).unsqueeze(-1)
    else:
        start = end = torch.zeros(videos, 1, dtype=torch.long, device=device)
        static = torch.zeros(videos, 1, tokens, dtype=torch.bool, device=device)
    is_first = (start == frame).unsqueeze(-1)  # (V, F, 1)
    static_unit = static & is_first  # a window's static tokens, at its first frame
    dynamic = ~static
    # The mean of every static token over its window's frames, at the window's first frame.
    weight = static.to(dtype).unsqueeze(-1)
    sums = torch.zeros_like(x).scatter_add(1, start.view(videos, frames, 1, 1).expand_as(x), x * weight)
    lengths = (end - start + 1).to(dtype).view(videos, frames, 1, 1)
    temporal = torch.where(static_unit.unsqueeze(-1), sums / lengths, x)
    # The budget, part by part: [static of frame 0's window, dynamic of frame 0, static of frame 1, ...].
    sizes = torch.stack([static_unit.sum(-1), dynamic.sum(-1)], dim=2).flatten(1)  # (V, 2F)
    quota = apportion(sizes, budget).view(videos, frames, 2)
    static_quota, dynamic_quota = quota[..., 0], quota[..., 1]
    contextual = dynamic_quota - torch.round(dynamic_quota.to(torch.float64) * (1 - contextual_share)).long()
    dominant_quota = dynamic_quota - contextual
    flat = videos * frames
    neg = torch.tensor(float("-inf"), dtype=dtype, device=device)
    rank = _rank_descending(torch.where(dynamic, scores.to(dtype), neg).view(flat, tokens)).view(videos, frames, tokens)
    dominant = dynamic & (rank < dominant_quota.unsqueeze(-1))
    selected = dominant.clone()
    out = x.clone()
    if contextual_share > 0:
        centre, merged = dpc_knn_merge(x.reshape(flat, tokens, width), (dynamic & ~dominant).view(flat, tokens),
                                       contextual.view(flat), neighbours, beta)
        centre = centre.view(videos, frames, tokens)
        out = torch.where(centre.unsqueeze(-1), merged.view_as(x), out)
        selected = selected | centre
    if frames > 1:
        # A window starts at most at frame F - 2: the last frame's slot never holds static tokens.
        slots = frames - 1
        centre, merged = dpc_knn_merge(temporal[:, :slots].reshape(videos * slots, tokens, width),
                                       static_unit[:, :slots].reshape(videos * slots, tokens),
                                       static_quota[:, :slots].reshape(videos * slots), neighbours, beta)
        centre = torch.cat([centre.view(videos, slots, tokens), torch.zeros_like(static_unit[:, :1])], dim=1)
        merged = torch.cat([merged.view(videos, slots, tokens, width), x[:, slots:]], dim=1)
        out = torch.where(centre.unsqueeze(-1), merged, out)
        selected = selected | centre
    chosen = torch.sort((~selected).view(videos, -1).to(torch.int8), dim=1, stable=True).indices[:, :budget]
    hidden = torch.gather(out.view(videos, -1, width), 1, chosen.unsqueeze(-1).expand(-1, -1, width))
    merged_flag = ~torch.gather(dominant.view(videos, -1), 1, chosen)
    return HolitomOutput(hidden=hidden.to(features.dtype), origin=chosen, merged=merged_flag, segment_start=start)


def attention_received(attention: Tensor | AttentionReads, has_cls: bool) -> Tensor:
    """``(items, N)`` the mean attention every patch receives over every query of the layer (the
    official SigLIP score: ``attentions.mean(heads).mean(queries)``), from head-mean probabilities
    ``(items, T, T)`` or reads of them (the column means: no row is kept); [CLS]'s column dropped, its
    row counted as every query's."""
    return as_reads(attention).column_mean()[:, int(has_cls):]


def tower_step(inputs: TowerInput, settings: Mapping[str, Any]) -> TowerOutput:
    """The adapters' call after the projector: ``inputs.hidden`` ``(videos x frames, N, D)`` the
    projected patches of every frame, consecutive per video (``inputs.frames`` each; None: every item
    a one-frame video); every item hands on ``settings["keep"]`` tokens: the video's
    ``frames x keep`` tokens in HoliTom's order, ``keep`` per frame's row of the prompt's span.
    ``positions`` ``(items, keep)`` name the video unit each token stands at (frame x N + token)."""
    if inputs.attention is None:
        raise RuntimeError("HoliTom needs the probed layer's attention probabilities from the adapter")
    items, tokens, width = inputs.hidden.shape
    frames = inputs.frames or 1
    videos = items // frames
    keep = settings["keep"]
    scores = attention_received(inputs.attention, inputs.has_cls)
    out = holitom_reduce(inputs.hidden.reshape(videos, frames, tokens, width), scores.reshape(videos, frames, tokens),
                         frames * keep, tau=settings["tau"], beta=settings["beta"], neighbours=settings["neighbours"],
                         contextual_share=settings["contextual_share"], max_window=settings["max_window"])
    hidden = out.hidden.reshape(items, keep, width)
    # A row's token continues one patch of its own frame, or is -1 (merged, or another frame's).
    row_frame = torch.arange(items, device=hidden.device).remainder(frames).view(items, 1)
    origin = out.origin.reshape(items, keep)
    own = ~out.merged.reshape(items, keep) & (origin // tokens == row_frame)
    kept = torch.where(own, origin % tokens, torch.full_like(origin, -1))
    # positions: the video's unit (frame x N + token) every token stands at (a static token: its window's
    # first frame; a cluster: its centre), ascending over the video: Qwen2-VL gives it that unit's 3-D position.
    return TowerOutput(hidden=hidden, kept=kept, positions=origin)


# ---- inside the LLM: attention-ranked keep, the rest merged into their most similar kept token ----------------------

def inner_merge(visual: Tensor, scores: Tensor, keep: int) -> tuple[Tensor, Tensor]:
    """HoliTom's inner-LLM merge of every sample's visual span, batched.

    The ``keep`` tokens of highest ``scores`` (the last prompt token's head-mean attention in the
    layer before) stay; every other visual token is averaged into the kept token of highest cosine
    similarity (similarities of the layer's input, computed once). The official code averages one
    token at a time in ascending order (``h_t = (h_t + h_j) / 2``), so a kept token with members
    ``j_1 < ... < j_m`` ends as ``h_t / 2^m + sum_i h_{j_i} / 2^(m - i + 1)``: that closed form,
    in float32.

    Args:
        visual: ``(B, N, D)`` the visual tokens at the merge layer's input.
        scores: ``(B, N)`` their scores.
        keep: tokens that stay.

    Returns ``(merged, kept)``: ``merged`` ``(B, keep, D)`` the kept tokens after the merge, and
    ``kept`` ``(B, keep)`` their ascending indices in the span.
    """
    batch, count, width = visual.shape
    kept = top_indices(scores, keep)
    dtype = compute_dtype(visual.dtype)
    stays = torch.zeros(batch, count, dtype=torch.int8, device=visual.device).scatter(
        1, kept, torch.ones_like(kept, dtype=torch.int8))
    rest = torch.sort(stays, dim=1, stable=True).indices[:, :count - keep]  # ascending
    kept_hidden = gather_tokens(visual, kept).to(dtype)
    if keep == count:
        return kept_hidden.to(visual.dtype), kept
    rest_hidden = gather_tokens(visual, rest).to(dtype)
    similarity = F.normalize(rest_hidden, dim=-1) @ F.normalize(kept_hidden, dim=-1).transpose(1, 2)
    target = torch.sort(similarity, dim=-1, descending=True, stable=True).indices[..., 0]  # (B, N - keep)
    one_hot = F.one_hot(target, keep).to(dtype)  # (B, N - keep, keep)
    # Members of the same target at this index or later: the halvings each member still goes through.
    later = one_hot.flip(1).cumsum(1).flip(1)
    halvings = torch.gather(later, 2, target.unsqueeze(-1)).squeeze(-1)
    members = one_hot.sum(dim=1)  # (B, keep)
    weighted = torch.zeros_like(kept_hidden).scatter_add(
        1, target.unsqueeze(-1).expand(-1, -1, width), rest_hidden * torch.pow(0.5, halvings).unsqueeze(-1))
    merged = kept_hidden * torch.pow(0.5, members).unsqueeze(-1) + weighted
    return merged.to(visual.dtype), kept


def step(inputs: StepInput, settings: Mapping[str, Any]) -> Reduced:
    """The adapters' call at the input of the merge layer (HoliTom's inner-LLM part): rank by the
    last prompt token's attention in the layer before, merge, and keep the original positions."""
    if inputs.row_attention is None:
        raise RuntimeError("HoliTom's inner merge needs layer K-1's last-row attention from the adapter's probe")
    check_span(inputs.hidden, inputs.visual_start, inputs.num_visual)
    scores = fastv_scores(inputs.row_attention, inputs.visual_start, inputs.num_visual)
    columns = visual_positions(inputs.visual_start.to(inputs.hidden.device), inputs.num_visual)
    merged, kept = inner_merge(gather_tokens(inputs.hidden, columns), scores, inputs.keep)
    at = torch.gather(columns, 1, kept).unsqueeze(-1).expand(-1, -1, inputs.hidden.shape[-1])
    hidden = inputs.hidden.scatter(1, at, merged)
    return rebuild(hidden, kept, inputs.visual_start.to(hidden.device), inputs.num_visual, inputs.position_ids,
                   "original", inputs.attention_mask)
