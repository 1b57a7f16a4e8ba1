"""FlashVID (Fanziyang-v/FlashVID @ 1d37422, ICLR 2026): training-free video token compression.

**The cut after the projector** (`tower_step`, `flashvid_reduce`; ``flashvid/utils.py`` `flashvid_compression`,
``flashvid/token_selection.py``), on the projector's output of every frame of one video, ``(frames, N, D)``,
with the attention each token receives in the tower's last layer (heads and queries averaged), each frame
handing on ``b = keep`` tokens on average:

1. **DySeg** (utils.py L168-226): the cosine of consecutive frames' mean features; a new segment starts after
   every transition below ``segment_threshold`` (0.9); with fewer than ``min_segment_num`` segments, the
   transitions of lowest similarity are cut too (every frame alone when the video has no more frames).
2. **ADTS** (token_selection.py L28-130) per frame: ``a = ceil(alpha * b)`` tokens by greedy max-min
   diversity over the cosine distances ``1 - cos``, every column scaled by its token's attention x 1e6 (v1,
   ``attn_div``) and, in v2 (``attn_div_v2``), by its dot product with the segment's frame means averaged;
   the first token has the largest distance to its nearest other token (the column's second smallest), every
   next one the largest distance to the nearest chosen (v1 never picks a chosen token twice; v2 does not
   exclude them, as the official code); the indices sorted.
3. **TSTM** (utils.py L283-349) on the tokens ADTS left, within a segment of several frames: every token links
   to its most similar token of the previous frame (ADTS's tokens neither link nor receive) when the cosine
   exceeds ``temporal_threshold`` (0.8); where fewer than ``(a + s) x frames`` tokens of the segment (ADTS's
   included) would stay unlinked, the threshold drops to the ``(frames x N - (a + s) x frames)``-th largest
   similarity (strictly above it links; at least ``-1 + 1e-6``). Walking the frames backwards, every linked
   token's value (its own plus what its subtree sent it) is added to its anchor, and every root (unlinked)
   token is divided by ``1 +`` its direct children: the official count, not the tree's size.
4. **DPC-kNN** (utils.py L115-165, L229-280) per frame on the roots TSTM left (a frame alone in its segment:
   on all its ``N`` tokens, ADTS's included, as the official code), ``s x frames`` clusters per segment: the
   distances ``|x_i - x_j| / sqrt(D)``, density ``exp(-mean of the k = min(clusters, 7) nearest squared)``
   (itself included), the distance to the nearest denser token (the largest distance where none is), the
   centres of largest ``distance x density``; every token joins its nearest centre, a cluster token is its
   members' mean, at its centre's place. A segment whose roots already fit keeps them all.
5. **Order** (utils.py L73-78): ADTS's tokens and the clusters of the whole video sorted by their place
   (frame x N + token); a place both hold (a one-frame segment's cluster centred on an ADTS token) holds both,
   ADTS's first.

**Inside the LLM** (`step`; utils.py L352-405, modeling_qwen2.py L88-107): at the input of ``pruning_layer``
(20), the ``ceil(llm_retention_ratio x n)`` visual tokens the last prompt token attends to most in the layer
before (head mean) stay, at their positions: FastV's rule and ficoco's FastV probe (the last row recomputed
from post-RoPE q and k, as the official code recomputes it beside FlashAttention).

**Where this differs from the official code** (each says why; docs/methods/flashvid.md):

- *A fixed count*: the official per-frame cluster counts are ``ceil(n_f x s x frames / C)`` of a segment whose
  ``C`` roots exceed its ``s x frames``, so that a segment may hand on a few more tokens than its budget (and
  the lowered threshold leaves ``C = s x frames + 1``); here each segment hands on exactly ``s x frames``
  clusters, apportioned to its frames in proportion to their roots (floors, then the largest remainders, ties to
  the earlier frame), so that a video hands on ``frames x keep`` tokens and a batch keeps one layout. Where the
  official counts are whole numbers the two agree.
- *No random noise*: DPC-kNN's ``density + rand * 1e-6`` tie-break is replaced by a deterministic one (equal
  densities: the lower index ranks higher); equal scores and similarities elsewhere: the lowest index (the
  official ``topk`` leaves them open), except a token's centre, which goes to the centre of higher score, as
  the official ``argmin`` over the centres in score order.
- *Float32*: every product in float32 (the official code computes TSTM's similarities and sums in the model's
  dtype), the distances by one product (``|a|^2 + |b|^2 - 2 a.b``) in place of ``torch.cdist``, ADTS v2's mean
  of dot products as the dot product with the mean, TSTM's and DPC-kNN's one-hot products as scatter-adds:
  the same sums.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ficoco.methods.fastv.ops import fastv_reduce, fastv_scores
from ficoco.methods.flashvid import (
    ADTS_V1,
    ADTS_V2,
    ALPHA,
    MIN_SEGMENT_NUM,
    SEGMENT_THRESHOLD,
    TEMPORAL_THRESHOLD,
    adts_tokens,
)
from ficoco.methods.inputs import Reduced, StepInput, TowerInput, TowerOutput
from ficoco.methods.ops import compute_dtype, dpc_knn_scores
from ficoco.methods.reads.ops import AttentionReads, as_reads

__all__ = ["FlashvidOutput", "adts_select", "apportion", "dpc_knn", "flashvid_reduce", "segment_frames", "step",
           "temporal_merge", "tower_step"]

NEIGHBOURS = 7  # DPC-kNN's k (utils.py L155: min(clusters, 7))
ATTENTION_SCALE = 1e6  # token_selection.py L46: "Scale attention to avoid numerical issues"


@dataclass(frozen=True)
class FlashvidOutput:
    """``hidden`` ``(V, frames x keep, D)`` the tokens every video hands on, in place order; ``origin``
    ``(V, frames x keep)`` the place each stands at (``frame x N + token``: an ADTS token's own, a cluster's
    centre's), ascending; ``merged`` ``(V, frames x keep)`` True for a token that is not one place's own
    features (a cluster of several, or a root that absorbed others); ``segment`` ``(V, frames)`` the segment
    of every frame."""

    hidden: Tensor
    origin: Tensor
    merged: Tensor
    segment: Tensor


def segment_frames(features: Tensor, threshold: float = SEGMENT_THRESHOLD,
                   min_segments: int = MIN_SEGMENT_NUM) -> Tensor:
    """DySeg: ``(V, F)`` the segment of every frame of ``features`` ``(V, F, N, D)`` (0 for the first).

    A cut follows every transition whose frame means' cosine is below ``threshold``; with fewer than
    ``min_segments`` segments, the transitions of lowest similarity not cut yet are cut too (ties: the earlier).
    """
    videos, frames = features.shape[:2]
    if frames == 1:
        return torch.zeros(videos, 1, dtype=torch.long, device=features.device)
    unit = F.normalize(features.mean(dim=2), dim=-1)  # (V, F, D)
    # One product per transition, so that counters see it.
    similarity = (unit[:, :-1].unsqueeze(-2) @ unit[:, 1:].unsqueeze(-1)).flatten(1)  # (V, F - 1)
    cut = similarity < threshold
    missing = (min_segments - 1 - cut.sum(dim=1)).clamp(min=0)  # (V,)
    inf = torch.tensor(float("inf"), dtype=similarity.dtype, device=similarity.device)
    order = torch.sort(torch.where(cut, inf, similarity), dim=1, stable=True).indices
    rank = torch.empty_like(order).scatter_(1, order, torch.arange(frames - 1, device=order.device)
                                            .expand_as(order).contiguous())
    cut = cut | (rank < missing.unsqueeze(1))
    return F.pad(cut.long().cumsum(dim=1), (1, 0))


def adts_select(features: Tensor, attention: Tensor, count: int, relevance: Tensor | None = None) -> Tensor:
    """ADTS: ``(G, count)`` ascending indices of the tokens every frame of ``features`` ``(G, N, D)`` keeps.

    The cosine distances scaled column-wise by ``attention`` ``(G, N)`` x 1e6 and, for v2, by ``relevance``
    ``(G, N)``; greedy max-min (the first: the largest distance to its nearest other token; then the largest
    distance to the nearest chosen one). v1 (``relevance`` None) never chooses a token twice; v2 may, as the
    official code does not exclude the chosen ones (token_selection.py L124-125).
    """
    groups, tokens, _ = features.shape
    unit = features / features.norm(dim=-1, keepdim=True)
    distance = 1.0 - unit @ unit.transpose(1, 2)  # (G, N, N)
    distance = distance * (attention * ATTENTION_SCALE).unsqueeze(1)
    if relevance is not None:
        distance = distance * relevance.unsqueeze(1)
    if tokens > 1:  # every column's second smallest (its smallest is, in general, the token itself)
        nearest_other = torch.topk(distance, 2, dim=1, largest=False).values[:, 1]
    else:
        nearest_other = distance[:, 0]
    chosen = torch.argmax(nearest_other, dim=-1, keepdim=True)  # (G, 1): the first maximum
    picks = [chosen]
    nearest = torch.gather(distance, 1, chosen.unsqueeze(-1).expand(-1, 1, tokens)).squeeze(1)  # (G, N)
    for _ in range(1, count):
        candidates = nearest
        if relevance is None:  # v1 marks the chosen ones -1
            candidates = nearest.scatter(1, torch.cat(picks, dim=1), -1.0)
        chosen = torch.argmax(candidates, dim=-1, keepdim=True)
        picks.append(chosen)
        row = torch.gather(distance, 1, chosen.unsqueeze(-1).expand(-1, 1, tokens)).squeeze(1)
        nearest = torch.minimum(nearest, row)
    return torch.sort(torch.cat(picks, dim=1), dim=1).values


def temporal_merge(x: Tensor, free: Tensor, starts: Tensor, segment: Tensor, threshold: float, floor: int
                   ) -> tuple[Tensor, Tensor, Tensor]:
    """TSTM on ``x`` ``(V, F, N, D)``: ``free`` ``(V, F, N)`` the tokens ADTS left, ``starts`` ``(V, F)`` the
    first frame of every segment, ``segment`` ``(V, F)`` every frame's segment, ``floor`` ``(a + s)``: the tokens
    per frame a segment keeps unlinked at least.

    Returns ``(value, root, absorbed)``: every token's value after the trees are summed into their roots (a
    root: divided by 1 + its direct children, as the official code), ``root`` ``(V, F, N)`` the tokens that link
    to none (ADTS's included), ``absorbed`` ``(V, F, N)`` the roots that received others.
    """
    videos, frames, tokens, width = x.shape
    unit = x / x.norm(dim=-1, keepdim=True)
    similarity = unit[:, 1:] @ unit[:, :-1].transpose(-1, -2)  # (V, F - 1, N, N): frame f's rows, f - 1's columns
    similarity = similarity.masked_fill(~free[:, 1:].unsqueeze(-1), -1.0)
    similarity = similarity.masked_fill(~free[:, :-1].unsqueeze(-2), -1.0)
    best, anchor = similarity.max(dim=-1)  # ties: the first (torch.max's documented rule)
    best = F.pad(best, (0, 0, 1, 0), value=-1.0)  # (V, F, N): frame 0 links to none
    anchor = F.pad(anchor, (0, 0, 1, 0))
    best = best.masked_fill(starts.unsqueeze(-1), -1.0)  # a segment's first frame links to none
    link = best > threshold
    # Where too few tokens of a segment would stay, the threshold drops (utils.py L307-312): one host read of the
    # segments and their unlinked counts.
    kept = (~link).sum(dim=-1)  # (V, F)
    for v, row in enumerate(segment.tolist()):
        start = 0
        while start < frames:
            end = start
            while end + 1 < frames and row[end + 1] == row[start]:
                end += 1
            length = end - start + 1
            if length > 1 and int(kept[v, start:end + 1].sum()) < floor * length:
                linked = length * tokens - floor * length  # the most that may link
                if linked <= 0:  # every token stays (the official topk(0) fails there)
                    link[v, start:end + 1] = False
                else:
                    soft = torch.topk(best[v, start:end + 1].flatten(), linked).values[-1]
                    soft = torch.clamp(soft, min=-1.0 + 1e-6)
                    link[v, start:end + 1] = best[v, start:end + 1] > soft
            start = end + 1
    frames_value = list(x.unbind(dim=1))
    counts = [torch.ones(videos, tokens, dtype=x.dtype, device=x.device) for _ in range(frames)]
    for f in range(frames - 1, 0, -1):  # backwards: a frame's tokens hold their subtrees before they link
        weight = link[:, f].to(x.dtype)
        target = anchor[:, f]
        frames_value[f - 1] = frames_value[f - 1].scatter_add(
            1, target.unsqueeze(-1).expand(-1, -1, width), frames_value[f] * weight.unsqueeze(-1))
        counts[f - 1] = counts[f - 1].scatter_add(1, target, weight)
    value = torch.stack(frames_value, dim=1)
    count = torch.stack(counts, dim=1)
    root = ~link
    value = torch.where(root.unsqueeze(-1), value / count.unsqueeze(-1), value)
    return value, root, root & (count > 1)


def apportion(sizes: Tensor, group: Tensor, totals: Tensor) -> Tensor:
    """``(V, F)`` counts: every group (a segment) of ``sizes`` ``(V, F)`` shares its ``totals`` ``(V, F)`` (the
    group's total, on each of its members) in proportion to the sizes: floors, then one more to the largest
    remainders (ties: the earlier). ``group`` ``(V, F)`` the group of each member (non-decreasing)."""
    videos, frames = sizes.shape
    flat = group + frames * torch.arange(videos, device=group.device).unsqueeze(1)  # (V, F) groups apart
    size_sum = torch.zeros(videos * frames, dtype=sizes.dtype, device=sizes.device).scatter_add(
        0, flat.flatten(), sizes.flatten())[flat].clamp(min=1)
    floor = sizes * totals // size_sum
    remainder = sizes * totals % size_sum
    left = totals - torch.zeros_like(size_sum).flatten().scatter_add(0, flat.flatten(), floor.flatten())[flat]
    # Rank within the group by remainder (descending, ties: the earlier frame).
    key = flat * (size_sum.max() + 1) * 2 - remainder  # sorts by group, then by remainder descending
    order = torch.sort(key.flatten(), stable=True).indices
    position = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
    first = torch.zeros(videos * frames, dtype=torch.long, device=sizes.device).scatter_reduce(
        0, flat.flatten(), position, reduce="amin", include_self=False)
    rank = (position - first[flat.flatten()]).view(videos, frames)
    return floor + (rank < left).long()


def dpc_knn(x: Tensor, valid: Tensor, clusters: Tensor, neighbours: int = NEIGHBOURS) -> tuple[Tensor, Tensor]:
    """DPC-kNN of the valid tokens of every group, batched.

    Args:
        x: ``(G, N, D)`` tokens (float32).
        valid: ``(G, N)`` the tokens of each group that take part.
        clusters: ``(G,)`` centres per group (at most its valid tokens; 0: the group is unused).
        neighbours: the density's k (``min(k, clusters)`` per group, as the official code).

    Returns ``centre`` ``(G, N)`` bool and ``assign`` ``(G, N)``: the centre (a token index) every valid token
    joins (a centre: itself).
    """
    groups, tokens, _ = x.shape
    distance, score = dpc_knn_scores(x, valid, clusters, neighbours)
    inf = torch.tensor(float("inf"), dtype=x.dtype, device=x.device)
    index = torch.arange(tokens, device=x.device)
    order = torch.sort(score, dim=1, descending=True, stable=True).indices  # the centres first, in score order
    is_centre_slot = index.unsqueeze(0) < clusters.unsqueeze(1)  # (G, N) over `order`'s slots
    centre = torch.zeros_like(valid).scatter(1, order, is_centre_slot) & valid
    # Every token to its nearest centre; equal distances: the centre of higher score (argmin's first, in order).
    to_centres = torch.gather(distance, 2, order.unsqueeze(1).expand(-1, tokens, -1))
    to_centres = torch.where(is_centre_slot.unsqueeze(1), to_centres, inf)
    slot = to_centres.argmin(dim=-1)
    assign = torch.gather(order, 1, slot)
    assign = torch.where(centre, index.expand(groups, -1), assign)
    return centre, assign


def flashvid_reduce(features: Tensor, scores: Tensor, keep: int, *, alpha: float = ALPHA,
                    token_selection_method: str = ADTS_V2, temporal_threshold: float = TEMPORAL_THRESHOLD,
                    segment_threshold: float = SEGMENT_THRESHOLD, min_segment_num: int = MIN_SEGMENT_NUM,
                    **_: Any) -> FlashvidOutput:
    """FlashVID's cut of a batch of videos, each handing on exactly ``frames x keep`` tokens.

    Args:
        features: ``(V, F, N, D)`` the projector's output of every frame.
        scores: ``(V, F, N)`` the mean attention each token receives in the tower's last layer.
        keep: tokens per frame on average (``b``), at most ``N``.
        alpha: ADTS's share of ``keep`` (``ceil``).
        token_selection_method: ``"attn_div_v2"`` (ADTS v2) or ``"attn_div"`` (v1).
        temporal_threshold: TSTM's cosine threshold.
        segment_threshold, min_segment_num: DySeg's threshold and least segments.
    """
    videos, frames, tokens, width = features.shape
    if not 1 <= keep <= tokens:
        raise ValueError(f"FlashVID hands on 1..{tokens} tokens per frame; got {keep}")
    if token_selection_method not in (ADTS_V1, ADTS_V2):
        raise ValueError(f"unknown token_selection_method {token_selection_method!r}")
    dtype = compute_dtype(features.dtype)
    x = features.to(dtype)
    device = x.device
    adts = adts_tokens(keep, alpha)
    rest = keep - adts
    segment = segment_frames(x, segment_threshold, min_segment_num)  # (V, F)
    starts = F.pad(segment[:, 1:] != segment[:, :-1], (1, 0), value=True)
    flat = videos * frames
    frame_x = x.reshape(flat, tokens, width)
    # ADTS on every frame.
    free = torch.ones(videos, frames, tokens, dtype=torch.bool, device=device)
    if adts:
        relevance = None
        if token_selection_method == ADTS_V2:
            # The mean over the segment's frames of every token's dot product with each frame's mean feature:
            # the dot product with the mean of the segment's frame means (token_selection.py L96-105).
            means = x.mean(dim=2)  # (V, F, D)
            sums = torch.zeros_like(means).scatter_add(1, segment.unsqueeze(-1).expand(-1, -1, width), means)
            lengths = torch.zeros(videos, frames, dtype=dtype, device=device).scatter_add(
                1, segment, torch.ones_like(segment, dtype=dtype))
            segment_mean = torch.gather(sums / lengths.clamp(min=1).unsqueeze(-1), 1,
                                        segment.unsqueeze(-1).expand(-1, -1, width))  # (V, F, D)
            relevance = (frame_x @ segment_mean.reshape(flat, width, 1)).squeeze(-1)  # (V x F, N)
        picked = adts_select(frame_x, scores.reshape(flat, tokens).to(dtype), adts, relevance)  # (V x F, a)
        free = free.view(flat, tokens).scatter(1, picked, torch.zeros_like(picked, dtype=torch.bool))
        free = free.view(videos, frames, tokens)
        adts_place = (picked + tokens * torch.arange(frames, device=device).repeat(videos).unsqueeze(1))
        adts_place = adts_place.view(videos, frames * adts)
        adts_hidden = torch.gather(frame_x, 1, picked.unsqueeze(-1).expand(-1, -1, width)).view(videos, -1, width)
    else:
        adts_place = torch.zeros(videos, 0, dtype=torch.long, device=device)
        adts_hidden = x.new_zeros(videos, 0, width)
    places, hidden_parts = [adts_place], [adts_hidden]
    merged_parts = [torch.zeros_like(adts_place, dtype=torch.bool)]
    if rest:
        alone = starts & F.pad(starts[:, 1:], (0, 1), value=True)  # a frame alone in its segment
        if frames > 1:
            value, root, absorbed = temporal_merge(x, free, starts, segment, temporal_threshold, keep)
        else:
            value, root, absorbed = x, torch.ones_like(free), torch.zeros_like(free)
        # The tokens each frame clusters: TSTM's roots that ADTS left; a frame alone: every token, as it is.
        pool = alone.unsqueeze(-1) | (root & free)
        value = torch.where(alone.unsqueeze(-1).unsqueeze(-1), x, value)
        absorbed = absorbed & ~alone.unsqueeze(-1)
        sizes = pool.sum(dim=-1)  # (V, F)
        lengths = torch.zeros_like(segment).scatter_add(1, segment, torch.ones_like(segment))
        totals = rest * torch.gather(lengths, 1, segment)  # every frame: its segment's s x frames
        clusters = apportion(sizes, segment, totals)  # (V, F); a segment whose roots fit keeps them all
        centre, assign = dpc_knn(value.reshape(flat, tokens, width), pool.reshape(flat, tokens),
                                 clusters.reshape(flat))
        members = pool.reshape(flat, tokens).to(dtype)
        sums = torch.zeros_like(frame_x).scatter_add(1, assign.unsqueeze(-1).expand(-1, -1, width),
                                                     value.reshape(flat, tokens, width) * members.unsqueeze(-1))
        size = torch.zeros(flat, tokens, dtype=dtype, device=device).scatter_add(1, assign, members)
        cluster = sums / size.clamp(min=1).unsqueeze(-1)
        merged = (size > 1) | absorbed.reshape(flat, tokens)
        count = frames * rest
        if int(centre.sum()) != videos * count:
            raise RuntimeError(f"FlashVID's clusters hold {int(centre.sum())} centres for {videos * count} tokens")
        order = torch.sort((~centre).view(videos, -1).to(torch.int8), dim=1, stable=True).indices[:, :count]
        places.append(order)
        hidden_parts.append(torch.gather(cluster.view(videos, -1, width), 1, order.unsqueeze(-1).expand(-1, -1, width)))
        merged_parts.append(torch.gather(merged.view(videos, -1), 1, order))
    place = torch.cat(places, dim=1)
    hidden = torch.cat(hidden_parts, dim=1)
    merged_flag = torch.cat(merged_parts, dim=1)
    # Place order; a place held twice: ADTS's token first (it comes first, and the sort is stable).
    by_place = torch.sort(place, dim=1, stable=True)
    hidden = torch.gather(hidden, 1, by_place.indices.unsqueeze(-1).expand(-1, -1, width))
    return FlashvidOutput(hidden=hidden.to(features.dtype), origin=by_place.values,
                          merged=torch.gather(merged_flag, 1, by_place.indices), segment=segment)


def attention_received(attention: Tensor | AttentionReads, has_cls: bool) -> Tensor:
    """``(items, N)`` the mean attention every patch receives over every query of the layer (the official
    SigLIP score ``attentions.mean(heads).mean(queries)``, siglip_encoder.py L71), from head-mean probabilities
    ``(items, T, T)`` or reads of them, or a query-mean row ``(items, 1, N)`` (a pooled or merge-group score);
    [CLS]'s column dropped."""
    return as_reads(attention).column_mean()[:, int(has_cls):]


def tower_step(inputs: TowerInput, settings: Mapping[str, Any]) -> TowerOutput:
    """The adapters' call after the projector: ``inputs.hidden`` ``(videos x frames, N, D)`` the projected
    tokens of every frame, consecutive per video (``inputs.frames`` each; None: every item a one-frame video);
    every item hands on ``settings["keep"]`` tokens: the video's ``frames x keep`` tokens in place order,
    ``keep`` per frame's row of the prompt's span. ``positions`` ``(items, keep)`` name the video place each
    token stands at (frame x N + token)."""
    if inputs.attention is None:
        raise RuntimeError("FlashVID needs the last tower layer's attention probabilities from the adapter")
    items, tokens, width = inputs.hidden.shape
    frames = inputs.frames or 1
    videos = items // frames
    keep = settings["keep"]
    scores = attention_received(inputs.attention, inputs.has_cls)
    out = flashvid_reduce(inputs.hidden.reshape(videos, frames, tokens, width), scores.reshape(videos, frames, tokens),
                          keep, **{name: settings[name] for name in
                                   ("alpha", "token_selection_method", "temporal_threshold", "segment_threshold",
                                    "min_segment_num")})
    hidden = out.hidden.reshape(items, keep, width)
    # A row's token continues one patch of its own frame, or is -1 (merged, or another frame's).
    row_frame = torch.arange(items, device=hidden.device).remainder(frames).view(items, 1)
    origin = out.origin.reshape(items, keep)
    own = ~out.merged.reshape(items, keep) & (origin // tokens == row_frame)
    kept = torch.where(own, origin % tokens, torch.full_like(origin, -1))
    return TowerOutput(hidden=hidden, kept=kept, positions=origin)


def step(inputs: StepInput, settings: Mapping[str, Any]) -> Reduced:
    """The adapters' call at the input of ``pruning_layer`` (FlashVID inside the LLM): FastV's rule, the
    visual tokens the last prompt token attends to most in the layer before stay at their positions."""
    if inputs.row_attention is None:
        raise RuntimeError("FlashVID's step inside the LLM needs layer K-1's last-row attention from the adapter")
    scores = fastv_scores(inputs.row_attention, inputs.visual_start, inputs.num_visual)
    return fastv_reduce(inputs.hidden, scores, inputs.keep, inputs.visual_start, inputs.num_visual,
                        inputs.position_ids, inputs.attention_mask)
