"""ViTCoP (chaser682/ViTCoP 627f632, AAAI'26): visual and textual semantic collaborative pruning.

**The cut** (`tower_step`; LLaVA/llava/model/multimodal_encoder/clip_encoder.py L187-244), at the output of the
tower layer the projector reads (LLaVA-1.5: layer 22, ``hidden_states[-2]``), before the projector:

1. **Score**: the [CLS] query's softmax over every key of that layer, **summed** over heads (L208-209).
2. **Keep** the ``int(vision_ratio x patches)`` highest, in image order (a mask, L217-222).
3. **VIC** (`vic_labels`; multimodal_encoder/utils.py L56-150) on the kept patches, per item: features = that
   layer's ``k_proj`` output (a forward hook, heads concatenated, bias included, L194-204), Euclidean distances
   ``sqrt(|x_i - x_j|^2 + 1e-8)`` (0 on the diagonal); density ``rho_i = sum_j exp(-(d_ij / 8)^2)`` (itself
   included); ``delta_i`` the distance to the nearest token ``j != i`` with ``rho_j >= rho_i`` whose position
   (``(row, col) / side``) lies within 0.6 of ``i``'s, ``inf`` when there is none (its parent is then token 0, as
   ``torch.min`` over an all-inf row names it); the ``max(1, int(cluster_share x n))`` tokens of highest
   ``rho x delta`` are centres, labelled in that order; every other token takes the label its chain of parents
   reaches (``labels[parent]`` until nothing changes: here by pointer doubling, the same fixed point); a chain
   that reaches no centre leaves ``-1``, which the decoder treats as one more cluster.

The tokens go on in image order; their labels go to the decoder's part (`TowerOutput.carry`), made unique over
the call's items (item ``i``'s label ``c`` becomes ``i x (n + 1) + c + 1``: its ``-1`` first, as the official
multi-image offset keeps them apart).

**The shallow stage** (`step` at ``shallow_layer``, `cluster_merge`; language_model/vitcop_modeling_llama.py
L1191-1354): scores = the L2 norm of the head mean of layer L-1's post-RoPE keys over the visual span (the KV
cache's, L1307), **smaller is more important**. With K clusters and R tokens to leave:

- K > R: the R - 1 clusters of smallest **sum** of norms each become one merged token, all other clusters
  together one more (L1212-1232);
- else each cluster keeps ``round((size - 1) / (N - K) x (R - K))`` tokens (at most size - 1), then +-1 in
  the order of the clusters' norm sums (ascending to add, descending to take) until they sum to R - K, in one
  pass (L1236-1260); a cluster keeps its smallest-norm tokens and merges the rest into one (L1263-1286).

A merged token is ``h[median member] + mean(h[members])`` (a sum, about twice a token's norm: L1328), at the
median member's place (the upper median of the sorted members). Kept and merged tokens go on in position order,
at their original (gapped) position ids (L1344-1354).

**The deep stage** (`step` at ``deep_layer``, L1361-1383): the ``round(R / 5)`` visual tokens of smallest norm of
layer L-1's head-mean keys stay; the position ids become every token's row index in the sequence entering the
layer (``all_keep``), which closes the gaps the shallow stage left: the adapter numbers them (scheme
``reindexed``). Decode steps keep the model's own position ids at every layer, as the official code's (its
mask-derived positions).

**Where this differs from the official code** (docs/methods/vitcop.md):

- *Batched*: the official code reads sample 0's labels and span for the whole batch (``cluster_labels[0]``,
  ``pre_prompt_length_list[0]``); here every sample is reduced by its own, with no host synchronisation.
- *Ties* (``topk``/``argsort`` leave them open): the lowest index (token, cluster) first; equal gammas among the
  centres likewise.
- *float32*: distances, densities, norms and merges in float32 (the official code runs them in the model's
  float16); the distances by one Gram product (``|a|^2 + |b|^2 - 2 a.b``) rather than a broadcast difference.
- A visual token the cut did not label (Video-LLaVA's frame [CLS]) is a cluster of its own.
- ``deep_span="real"`` (ficoco's correction): where the shallow stage cannot leave its count (more asked than
  the cut kept), the deep stage reads the tokens really left; the official code reads that count into the text.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from ficoco.methods.inputs import Reduced, StepInput, TowerInput, TowerOutput
from ficoco.methods.ops import (
    check_span,
    compute_dtype,
    gather_tokens,
    patch_scores_from_cls,
    rebuild,
    top_indices,
    visual_positions,
)
from ficoco.methods.reads import DEFAULT_ATTENTION_SCORES
from ficoco.methods.vitcop import CLUSTER_SHARE, DENSITY_CUTOFF, SPATIAL_RADIUS

__all__ = ["cluster_merge", "deep_keep", "grid_positions", "key_norms", "step", "tower_step", "vic_labels"]


# ---- the cut: [CLS] top-k and VIC ------------------------------------------------------------------------------

def grid_positions(patches: Tensor, grid_hw: tuple[int, int]) -> Tensor:
    """``(B, n, 2)`` the (row / rows, col / cols) of row-major patch indices ``(B, n)`` (``get_pos``, L170-185)."""
    rows, cols = grid_hw
    return torch.stack([torch.div(patches, cols, rounding_mode="floor") / rows, (patches % cols) / cols], dim=-1)


def vic_labels(features: Tensor, positions: Tensor, share: float = CLUSTER_SHARE,
               cutoff: float = DENSITY_CUTOFF, radius: float = SPATIAL_RADIUS) -> Tensor:
    """VIC's cluster labels of every item's tokens, batched.

    Args:
        features: ``(B, n, C)`` the tokens' features (the layer's k_proj outputs).
        positions: ``(B, n, 2)`` their normalised grid positions.
        share: the share of the tokens that become centres (``max(1, int(share x n))``).
        cutoff: the density's cutoff distance ``dc``; radius: the spatial radius ``k``.

    Returns ``(B, n)`` long: the centres' labels ``0..centres - 1`` in descending ``rho x delta``, every other
    token its chain's centre, ``-1`` where the chain reaches none.
    """
    batch, count, _ = features.shape
    x = features.to(compute_dtype(features.dtype))
    squares = (x * x).sum(dim=-1)
    gram = x @ x.transpose(1, 2)
    eye = torch.eye(count, dtype=torch.bool, device=x.device)
    distance = torch.sqrt((squares.unsqueeze(2) + squares.unsqueeze(1) - 2 * gram).clamp(min=0) + 1e-8)
    distance = distance.masked_fill(eye, 0.0)
    density = torch.exp(-(distance / cutoff) ** 2).sum(dim=-1)
    offset = positions.to(x.dtype).unsqueeze(2) - positions.to(x.dtype).unsqueeze(1)
    near = torch.sqrt((offset * offset).sum(dim=-1) + 1e-8) <= radius
    denser = (density.unsqueeze(1) >= density.unsqueeze(2)) & ~eye & near  # [i, j]: j may be i's parent
    conditioned = torch.where(denser, distance, torch.full_like(distance, math.inf))
    delta, parent = conditioned.min(dim=-1)  # an all-inf row names token 0, as the official torch.min does
    gamma = delta * density
    centres = max(1, int(share * count))
    ranked = torch.sort(-gamma, dim=1, stable=True).indices[:, :centres]
    labels = torch.full((batch, count), -1, dtype=torch.long, device=x.device)
    labels = labels.scatter(1, ranked, torch.arange(centres, device=x.device).expand(batch, -1))
    # Every token's label is the first labelled token of its chain of parents (the official loop's fixed point):
    # a labelled token is its own root, and doubling the jumps reaches the root of any chain of n - 1 links.
    own = torch.arange(count, device=x.device).expand(batch, -1)
    root = torch.where(labels >= 0, own, parent)
    for _ in range(max(1, math.ceil(math.log2(count))) + 1):
        root = torch.gather(root, 1, root)
    return torch.gather(labels, 1, root)


def tower_step(inputs: TowerInput, settings: Mapping[str, Any]) -> TowerOutput:
    """The adapters' call at the tower's output: ``inputs.hidden`` ``(items, N, D)`` the patches the projector
    would map ([CLS] dropped), ``inputs.keys`` that layer's keys ([CLS] first). Keeps the ``N - remove`` patches
    [CLS] attends to most (head sum), in image order, and hands their VIC labels on (unique over the items)."""
    if inputs.keys is None or not inputs.has_cls:
        raise RuntimeError("ViTCoP needs the [CLS] query and the keys of the layer the projector reads")
    if inputs.grid_hw is None:
        raise RuntimeError("ViTCoP needs the item's patch grid from the adapter (its spatial radius)")
    scores = patch_scores_from_cls(inputs, "sum", settings.get("attention_scores", DEFAULT_ATTENTION_SCORES))
    items, patches = scores.shape
    keep = patches - inputs.remove
    kept = top_indices(scores, keep)  # ascending: image order
    hidden = gather_tokens(inputs.hidden, kept)
    keys = inputs.keys.transpose(1, 2).flatten(2)[:, 1:]  # (items, N, H x d): k_proj's output
    labels = vic_labels(gather_tokens(keys, kept), grid_positions(kept, inputs.grid_hw),
                        settings.get("cluster_share", CLUSTER_SHARE), settings.get("density_cutoff", DENSITY_CUTOFF),
                        settings.get("spatial_radius", SPATIAL_RADIUS))
    item = torch.arange(items, device=labels.device).unsqueeze(1)
    return TowerOutput(hidden=hidden, kept=kept, carry=item * (keep + 1) + labels + 1)


# ---- inside the LLM ----------------------------------------------------------------------------------------------

def key_norms(keys: Tensor, key_heads: int, visual_start: Tensor, num_visual: int) -> Tensor:
    """``(B, N)`` the L2 norm of the head mean of the keys ``(B, T, H x d)`` over the visual span (float32; the
    squares by one dot product per token)."""
    columns = visual_positions(visual_start.to(keys.device), num_visual)
    span = gather_tokens(keys, columns)
    batch = span.shape[0]
    mean = span.view(batch, num_visual, key_heads, -1).to(compute_dtype(span.dtype)).mean(dim=2)
    return torch.sqrt((mean.unsqueeze(-2) @ mean.unsqueeze(-1)).flatten(1))


def _dense_clusters(labels: Tensor) -> tuple[Tensor, Tensor]:
    """``(cluster, count)``: every token's cluster as ``0..K-1`` in ascending label order (``torch.unique``'s),
    a negative label a cluster of its own, and ``K`` ``(B,)``."""
    batch, count = labels.shape
    own = torch.arange(count, device=labels.device).expand(batch, -1)
    top = labels.amax(dim=1, keepdim=True).clamp(min=0) + 1
    labels = torch.where(labels < 0, top + own, labels)
    ordered, order = torch.sort(labels, dim=1, stable=True)
    starts = torch.cat([torch.zeros_like(ordered[:, :1]), (ordered[:, 1:] != ordered[:, :-1]).long()], dim=1)
    dense = starts.cumsum(dim=1)
    return torch.empty_like(dense).scatter(1, order, dense), dense[:, -1] + 1


def _within(group: Tensor, key: Tensor, slots: int) -> tuple[Tensor, Tensor]:
    """``(rank, size)``: every token's rank inside its group ``(B, n)`` (groups ``0..slots - 1``) in the order of
    `key` (ties: the lower index), and its group's size."""
    by_key = torch.sort(key, dim=1, stable=True).indices
    by_group = torch.gather(by_key, 1, torch.sort(torch.gather(group, 1, by_key), dim=1, stable=True).indices)
    sizes = torch.zeros(group.shape[0], slots, dtype=torch.long, device=group.device).scatter_add(
        1, group, torch.ones_like(group))
    first = sizes.cumsum(dim=1) - sizes  # where each group starts in the sorted order
    place = torch.arange(group.shape[1], device=group.device).expand_as(group)
    ranked = place - torch.gather(first, 1, torch.gather(group, 1, by_group))
    rank = torch.empty_like(ranked).scatter(1, by_group, ranked)
    return rank, torch.gather(sizes, 1, group)


def cluster_merge(visual: Tensor, labels: Tensor, norms: Tensor, keep: int) -> tuple[Tensor, Tensor]:
    """ViTCoP's shallow stage on every sample's visual span, batched.

    Args:
        visual: ``(B, N, D)`` the visual tokens at the layer's input.
        labels: ``(B, N)`` their cluster labels (a negative one: a cluster of its own).
        norms: ``(B, N)`` their key norms (smaller: more important).
        keep: ``R``, the tokens that go on (kept and merged); at most ``N``.

    Returns ``(kept, tokens)``: ``kept`` ``(B, R)`` ascending span indices (kept tokens, and each merged token's
    median member), ``tokens`` ``(B, R, D)`` their states after the stage.
    """
    batch, count, width = visual.shape
    device = visual.device
    cluster, clusters = _dense_clusters(labels)
    valid = torch.arange(count, device=device).unsqueeze(0) < clusters.unsqueeze(1)  # (B, slots)
    work = compute_dtype(norms.dtype)
    sizes = torch.zeros(batch, count, dtype=torch.long, device=device).scatter_add(1, cluster, torch.ones_like(cluster))
    sums = torch.zeros(batch, count, dtype=work, device=device).scatter_add(1, cluster, norms.to(work))
    inf = torch.full_like(sums, math.inf)
    # K > R: the R - 1 clusters of smallest norm sums stay apart, the others go together (group `count`).
    by_sum = torch.sort(torch.where(valid, sums, inf), dim=1, stable=True).indices
    chosen_apart = by_sum[:, :max(keep - 1, 0)]
    # A tensor source, not a bool scalar: torch.jit's trace (fvcore) has no scatter overload for one.
    apart = torch.zeros_like(valid).scatter(1, chosen_apart, torch.ones_like(chosen_apart, dtype=torch.bool)) & valid
    many_group = torch.where(torch.gather(apart, 1, cluster), cluster, torch.full_like(cluster, count))
    # K <= R: quotas in proportion to size - 1, in float32 as the official weights, then one pass of +-1.
    room = keep - clusters  # R - K
    spare = (count - clusters).unsqueeze(1)  # N - K
    # N = K (every cluster one token: the official 0 / 0) makes every size - 1 zero: weights 0.
    weights = (sizes.float() - 1) / spare.clamp(min=1)
    limit = torch.where(valid, (sizes - 1).clamp(min=0), torch.zeros_like(sizes))
    quota = torch.minimum((weights * room.unsqueeze(1)).round().long(), limit)
    quota = torch.where(valid, quota, torch.zeros_like(quota))
    diff = room - quota.sum(dim=1)  # (B,)
    adding = (diff > 0).unsqueeze(1)
    order = torch.sort(torch.where(valid, torch.where(adding, sums, -sums), inf), dim=1, stable=True).indices
    movable = torch.where(adding, quota < limit, quota > 0) & valid
    movable = torch.gather(movable, 1, order)
    moved = movable & (movable.long().cumsum(dim=1) <= diff.abs().unsqueeze(1))
    step = torch.where(adding, 1, -1) * moved.long()
    quota = quota + torch.zeros_like(quota).scatter(1, order, step)
    # Each cluster keeps its `quota` smallest norms; the rest of it is one group.
    rank, _ = _within(cluster, norms.to(work), count)
    kept_here = rank < torch.gather(quota, 1, cluster)
    few_group = torch.where(kept_here, torch.full_like(cluster, -1), cluster)
    many = (clusters > keep).unsqueeze(1)
    group = torch.where(many, many_group, few_group)
    kept_here = kept_here & ~many
    # A group's token stands at its upper median member (rank size // 2 by index).
    slot = torch.where(group < 0, torch.full_like(group, count + 1), group)
    position = torch.arange(count, device=device).expand(batch, -1)
    member_rank, group_size = _within(slot, position, count + 2)
    median = (group >= 0) & (member_rank == group_size // 2)
    chosen = kept_here | median
    kept = torch.sort((~chosen).to(torch.int8), dim=1, stable=True).indices[:, :keep]  # ascending
    # Every output token as one weighted row over the span: a kept token itself; a merged one its median member
    # plus its group's mean (the official sum).
    out_group = torch.gather(group, 1, kept)
    out_size = torch.gather(group_size, 1, kept).to(work)
    members = (group.unsqueeze(1) == out_group.unsqueeze(2)) & (out_group >= 0).unsqueeze(2)
    weights_out = members.to(work) / out_size.unsqueeze(2)
    # Each output token's own row (scattered: one_hot would check the indices on the host).
    weights_out = weights_out.scatter_add(2, kept.unsqueeze(-1), torch.ones_like(kept, dtype=work).unsqueeze(-1))
    tokens = weights_out @ visual.to(work)
    return kept, tokens.to(visual.dtype)


def deep_keep(norms: Tensor, keep: int) -> Tensor:
    """``(B, keep)`` ascending span indices of the `keep` smallest norms (ties: the lower index)."""
    return top_indices(-norms, keep)


def step(inputs: StepInput, settings: Mapping[str, Any]) -> Reduced:
    """The adapters' call at the input of ViTCoP's two decoder layers (`inputs.stage` 0: the shallow stage, 1: the
    deep one), ranked by layer L-1's key norms."""
    if inputs.keys is None or not inputs.key_heads:
        raise RuntimeError("ViTCoP needs layer L-1's post-RoPE keys from the adapter's probe")
    check_span(inputs.hidden, inputs.visual_start, inputs.num_visual)
    start = inputs.visual_start.to(inputs.hidden.device)
    norms = key_norms(inputs.keys, inputs.key_heads, start, inputs.num_visual)
    if inputs.stage == 0:
        if inputs.carried is None:
            raise RuntimeError("ViTCoP's shallow stage needs the cluster labels its cut handed on")
        columns = visual_positions(start, inputs.num_visual)
        kept, tokens = cluster_merge(gather_tokens(inputs.hidden, columns), inputs.carried.to(norms.device), norms,
                                     inputs.keep)
        at = torch.gather(columns, 1, kept).unsqueeze(-1).expand(-1, -1, inputs.hidden.shape[-1])
        hidden = inputs.hidden.scatter(1, at, tokens)
    else:
        kept, hidden = deep_keep(norms, inputs.keep), inputs.hidden
    # Original ids; the deep stage's are renumbered by the adapter (its scheme: reindexed).
    return rebuild(hidden, kept, start, inputs.num_visual, inputs.position_ids, "original", inputs.attention_mask)
