"""SparseVLM v1.5 (Gumpest/SparseVLMs, ICML'25; branch v1.5, code 56bef80): text raters prune
the image tokens after layers 2, 6 and 15 and recycle part of what they prune.

1. **Raters**, once, on the LLM's input embeddings: with V the image embeddings and T every
   token after the image, ``m = softmax_over_T(V T^T).mean(over V)``; the raters are the text
   tokens with ``m_t > mean(m)`` (modelling_sparse_llama.py ~L198-206).
2. At a sparse layer (which itself runs on the full current sequence), the head-mean softmax
   attention ``A`` (post-RoPE, causal, all keys) gives ``r = A[raters, image].mean(raters)``
   (score.py ``attn_postprocess_topk``). The official v1.5 code materialises the whole
   ``L x L x H`` matrix; only the rater rows are read, so the adapters compute the suffix rows
   alone (raters are a subset), and the layer's output still comes from SDPA.
3. Its **output** is pruned: the top ``k = min(schedule[stage], N_v - 1)`` image tokens stay
   in original order; of the pruned ones the top ``int(0.3 n) + 1`` by ``r`` (in that order, as
   the official ``topk`` lists them) are clustered by DPC-kNN into ``int(p / 10) + 1`` tokens, each
   the plain mean of its cluster, placed after the kept tokens in centre order (utils.py
   ``cluster_and_merge`` L247-310). The current image span - kept plus recycled - is what the
   next stage scores.
4. Position ids are **re-compacted**; each layer caches what it saw, and decoding continues
   from each cache's own length.

Schedules (tokens kept after layers 2/6/15): 192 -> 300/200/110, 128 -> 303/110/36,
64 -> 66/30/17 (96 -> 238/48/26 on main); with recycling the image keeps 309/204/113,
312/117/39 and 82/32/18 tokens.

Departures: batched with spans per sample and left padding (padding keys masked; the official
code is batch 1 with ``.cuda()`` and a magic ``init_token_total_shape``). DPC-kNN's density gets
``1e-6 * rand`` in the official code to break ties (utils.py L258-260); here a tie goes to the
lowest index instead - the token the raters scored higher - so that a run is reproducible and a
batch equals its samples (`dpc_knn_clusters` says when ties happen and what the noise does with
them). A sample whose ``m`` is constant (no token above the mean) uses every suffix token as a
rater rather than dividing by zero.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ficoco.errors import FicocoError
from ficoco.methods.inputs import Reduced, StepInput
from ficoco.methods.ops import check_span, compute_dtype, gather_tokens, rebuild, top_indices, visual_positions

__all__ = ["dpc_knn_clusters", "dpc_knn_merge", "prepare", "select_raters", "sparsevlm_reduce", "sparsevlm_scores",
           "step", "suffix_rows"]


def suffix_rows(seq_len: int, visual_start: Tensor, num_visual: int) -> tuple[int, Tensor]:
    """The trailing rows that can hold text after the span: ``(M, valid)``.

    ``M = T - min(span end)``; ``valid`` ``(B, M)`` is True where row ``T - M + i`` lies after
    that sample's span. The suffix is the tail of every left-padded sample, so the same rows
    (counted from the end) stay the suffix after image tokens are removed."""
    ends = visual_start.to(torch.long) + num_visual
    rows = seq_len - int(ends.min())
    positions = torch.arange(seq_len - rows, seq_len, device=visual_start.device)
    return rows, positions.unsqueeze(0) >= ends.unsqueeze(1)


def select_raters(embeds: Tensor, visual_start: Tensor, num_visual: int) -> Tensor:
    """``(B, M)`` bool over the trailing ``M`` rows (`suffix_rows`): the rater text tokens.

    Args:
        embeds: ``(B, T, D)`` the LLM's input embeddings (image features already in place).
        visual_start: ``(B,)``; num_visual: ``N``.
    """
    check_span(embeds, visual_start, num_visual)
    seq_len = embeds.shape[1]
    rows, valid = suffix_rows(seq_len, visual_start, num_visual)
    dtype = compute_dtype(embeds.dtype)
    image = gather_tokens(embeds, visual_positions(visual_start, num_visual)).to(dtype)
    text = embeds[:, seq_len - rows:].to(dtype)
    logits = (image @ text.transpose(1, 2)).masked_fill(~valid.unsqueeze(1), float("-inf"))
    relevance = torch.softmax(logits, dim=-1).mean(dim=1)  # (B, M): mean over image tokens
    count = valid.sum(dim=1, keepdim=True).clamp(min=1)
    mean = torch.where(valid, relevance, torch.zeros_like(relevance)).sum(dim=1, keepdim=True) / count
    raters = (relevance > mean) & valid
    return torch.where(raters.any(dim=1, keepdim=True), raters, valid)


def sparsevlm_scores(rows_attention: Tensor, raters: Tensor, visual_start: Tensor, num_visual: int) -> Tensor:
    """``(B, N)`` mean attention the raters give each current image token.

    Args:
        rows_attention: ``(B, M, T)`` head-mean probabilities of the trailing ``M`` rows of
            the sparse layer over all its keys (``(B, H, M, T)`` is averaged over heads).
        raters: ``(B, M)`` from :func:`select_raters`.
        visual_start: ``(B,)``; num_visual: the current ``N`` (kept plus recycled).
    """
    attn = rows_attention.mean(dim=1) if rows_attention.dim() == 4 else rows_attention
    attn = attn.to(compute_dtype(attn.dtype))
    columns = visual_positions(visual_start.to(attn.device), num_visual)
    picked = torch.gather(attn, 2, columns.unsqueeze(1).expand(-1, attn.shape[1], -1))  # (B, M, N)
    weights = raters.to(attn.dtype).unsqueeze(-1)
    return (picked * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1)


def dpc_knn_clusters(tokens: Tensor, clusters: int, neighbours: int | None = None) -> Tensor:
    """DPC-kNN of ``(B, P, D)`` tokens, batched: ``(B, P)`` the cluster of every token, clusters numbered
    in centre order (highest ``rho * delta`` first), as the official ``cluster_and_merge`` numbers them.

    ``d_ij = ||x_i - x_j|| / sqrt(D)``; density ``rho_i = exp(-mean of d^2 over the k nearest``
    (self included, ``k = clusters`` as SparseVLM calls it)); ``delta_i`` = distance to the
    nearest token ranked above it (the largest distance for the first); centres = the ``clusters``
    highest ``rho * delta``, in that order; every token joins its nearest centre (ties: the earlier
    centre).

    A token ranks above another when it is denser, or as dense and earlier in ``tokens``. The official
    code adds ``1e-6 * rand`` to the density instead and ranks by density alone: the two tokens of every
    mutually nearest pair, which have the same density whenever ``k = 2``, are then ordered by the noise,
    and where rounding swallows it (in float32 now and then; in float16, the official scripts' dtype,
    always) neither ranks above the other, so both can become centres (docs/methods/sparsevlm.md).
    The distances are made symmetric with a zero diagonal, as the official ``(x_i - x_j).norm()`` is,
    so that two tokens tie here exactly where they tie there.
    """
    batch, count, dim = tokens.shape
    if not 1 <= clusters <= count:
        raise FicocoError(f"cannot make {clusters} clusters of {count} tokens")
    k = clusters if neighbours is None else neighbours
    x = tokens.to(compute_dtype(tokens.dtype))
    # Distances through one matrix product (|x|^2 + |y|^2 - 2 x.y), as cdist's mm mode computes
    # them: the product is matrix work that counters see (cdist is one opaque op to them).
    squares = (x * x).sum(dim=-1)
    dist = (squares.unsqueeze(2) + squares.unsqueeze(1) - 2 * (x @ x.transpose(1, 2))).clamp(min=0).sqrt() / dim**0.5
    eye = torch.eye(count, dtype=torch.bool, device=tokens.device)
    dist = ((dist + dist.transpose(1, 2)) / 2).masked_fill(eye, 0.0)
    nearest = torch.topk(dist, k, dim=-1, largest=False).values
    density = torch.exp(-(nearest**2).mean(dim=-1))
    index = torch.arange(count, device=tokens.device)
    # [b, i, j]: j ranks above i (denser, or as dense and earlier: in place of the official noise).
    above = (density.unsqueeze(1) > density.unsqueeze(2)) | \
        ((density.unsqueeze(1) == density.unsqueeze(2)) & (index.view(1, 1, -1) < index.view(1, -1, 1)))
    farthest = dist.flatten(1).amax(dim=1).view(-1, 1, 1)
    delta = torch.where(above, dist, farthest).amin(dim=-1)
    order = torch.sort(density * delta, dim=1, descending=True, stable=True).indices
    centers = order[:, :clusters]
    to_center = torch.gather(dist, 2, centers.unsqueeze(1).expand(-1, count, -1))  # (B, P, C)
    assign = to_center.argmin(dim=-1)
    rank = torch.arange(clusters, device=tokens.device).expand(batch, -1)
    return assign.scatter(1, centers, rank)


def dpc_knn_merge(tokens: Tensor, clusters: int, neighbours: int | None = None) -> Tensor:
    """DPC-kNN clustering of ``(B, P, D)`` tokens into ``clusters`` plain means, batched
    (`dpc_knn_clusters`; the official ``token_weight`` is 1).

    Returns:
        ``(B, clusters, D)`` in the dtype of ``tokens``, cluster ``c`` the mean of its members.
    """
    assign = dpc_knn_clusters(tokens, clusters, neighbours)
    x = tokens.to(compute_dtype(tokens.dtype))
    one_hot = torch.nn.functional.one_hot(assign, clusters).to(x.dtype)  # (B, P, C)
    sums = one_hot.transpose(1, 2) @ x
    return (sums / one_hot.sum(dim=1).unsqueeze(-1)).to(tokens.dtype)


def sparsevlm_reduce(hidden: Tensor, scores: Tensor, keep: int, visual_start: Tensor, num_visual: int,
                     position_ids: Tensor, attention_mask: Tensor | None = None, recycle_ratio: float = 0.3,
                     cluster_divisor: int = 10) -> Reduced:
    """Prune the output of a sparse layer and recycle the best pruned tokens as cluster means.

    Args:
        hidden: ``(B, T, D)`` the sparse layer's output.
        scores: ``(B, N)`` from :func:`sparsevlm_scores` (same layer).
        keep: the schedule's count for this stage; ``min(keep, N - 1)`` stay.
        visual_start: ``(B,)``; num_visual: the current ``N``.
        position_ids: ``(B, T)``; attention_mask: optional ``(B, T)``.
        recycle_ratio, cluster_divisor: ``int(ratio * pruned) + 1`` tokens recycled into
            ``int(recycled / divisor) + 1`` clusters.

    Returns:
        A :class:`~ficoco.methods.inputs.Reduced` whose span holds the kept tokens then the
        clusters, positions compacted.
    """
    check_span(hidden, visual_start, num_visual)
    if num_visual < 2:
        raise FicocoError("SparseVLM needs at least two image tokens to prune one")
    kept_count = min(keep, num_visual - 1)
    pruned = num_visual - kept_count
    recycled_count = min(pruned, int(recycle_ratio * pruned) + 1)
    clusters = int(recycled_count / cluster_divisor) + 1
    kept = top_indices(scores, kept_count)
    is_kept = torch.zeros_like(scores, dtype=torch.bool).scatter(1, kept, torch.ones_like(kept, dtype=torch.bool))
    pruned_scores = scores.to(compute_dtype(scores.dtype)).masked_fill(is_kept, float("-inf"))
    # The official order: the pruned tokens by descending score (its `topk`), the order DPC-kNN's ties follow.
    recycled = torch.sort(pruned_scores, dim=1, descending=True, stable=True).indices[:, :recycled_count]
    start = visual_start.to(hidden.device)
    tokens = gather_tokens(hidden, visual_positions(start, num_visual))
    merged = dpc_knn_merge(gather_tokens(tokens, recycled), clusters)
    return rebuild(hidden, kept, start, num_visual, position_ids, "compact", attention_mask, added=merged)


def prepare(embeds: Tensor, visual_start: Tensor, num_visual: int) -> Tensor:
    """The model adapters' call on the LLM's input embeddings: the rater mask, once per prefill."""
    return select_raters(embeds, visual_start, num_visual)


def step(inputs: StepInput, settings: dict) -> Reduced:
    """The model adapters' call at the input of the layer after a sparse layer: prune its output."""
    if inputs.row_attention is None or inputs.prepared is None:
        raise RuntimeError("SparseVLM needs the sparse layer's suffix rows and the raters from the adapter")
    scores = sparsevlm_scores(inputs.row_attention, inputs.prepared, inputs.visual_start, inputs.num_visual)
    return sparsevlm_reduce(inputs.hidden, scores, inputs.keep, inputs.visual_start, inputs.num_visual,
                            inputs.position_ids, inputs.attention_mask,
                            recycle_ratio=settings.get("recycle_ratio", 0.3),
                            cluster_divisor=settings.get("cluster_divisor", 10))
