"""PruMerge+ (42Shawn/LLaVA-PruMerge 097c041, ``token_prune_merge_advanced_plus``).

At the tower's output, before the projector:

1. **Score**: the [CLS] row of an attention built from the **last** tower layer's q and k
   projections (forward hooks on ``layers[23].self_attn.{q,k}_proj``): ``cls_attn``.
2. **IQR outliers**: the share of patches above ``Q3 + 1.5 IQR`` of ``cls_attn`` gives the
   ratio; ``int(N * ratio)`` top patches are kept (an **adaptive count**).
3. **Spatial samples** (the "+"): every ``int(int(1 / ratio) / 3)``-th patch not kept yet joins.
4. **Merge**: every kept patch ``i`` adds its 32 most key-similar other patches (cosine of the
   full-width layer-23 keys, kept ones included) weighted by their ``cls_attn``:
   ``x_i + sum_j a_j x_j`` (the weights are not normalised; ``/ sum(weights)`` is commented out
   in the official code, and that is kept). ``x`` is the feature layer's output (layer 22).
5. One **extra token** ``sum_{j not kept} a_j x_j`` is appended.

**The official behaviour is the default; ficoco's corrections are named settings** (a report labels
them, ``ficoco.methods.registry.method_label``):

- *The attention is not the model's*: a single 1024-wide "head" of the raw q and k projections,
  scaled by ``1024 ** -0.5`` (``attention="official"``, the default). ``attention="heads"``
  (ficoco's correction) uses the layer's own per-head softmax, head mean.
- *Score order*: the official output lists the kept patches by score, then the samples
  (``order="official"``, the default); ``order="spatial"`` (ficoco's correction) lists them in
  image order, which the merge does not depend on.

**Defects of the official code, fixed here** (not settings: the official code fails or couples
images there):

- *The IQR runs over the whole batch* (flattened), which couples the images: here each item has
  its own quartiles and count, so a batch equals its items run alone; items of one batch then
  keep different counts, returned padded with ``counts`` (the adaptive count "as measured").
- *Batch 1 only* in the "+" branch (``idx.flatten()``, ``unsqueeze(0)``) and a Python double
  loop over ``B x k`` with a topk each: here one batched similarity and one topk.
- *``int(1 / ratio) < 3`` makes the sampling step 0* and ``arange`` raises; no outlier at all
  divides by zero. Here the step is at least 1 and at least one outlier is kept.
- *``arange(0, 575, step)``* can never sample the last patch; here ``arange(0, N, step)``.

Ties among equal scores or similarities go to the lowest index. **Fixed count** (not in the
official code; for comparisons at one budget): ``tokens=N`` keeps ``N - 1`` patches, taken
from the outliers by score, then the spatial samples in order, then the next patches by score,
plus the extra token.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ficoco.errors import FicocoError
from ficoco.methods.inputs import TowerInput, TowerOutput
from ficoco.methods.ops import compute_dtype, gather_tokens, last_row_attention
from ficoco.methods.prumerge import ATTENTION, ORDER
from ficoco.methods.reads import DEFAULT_ATTENTION_SCORES

__all__ = ["PruMergeOutput", "prumerge_cls_attention", "prumerge_reduce", "prumerge_selection", "tower_step"]

ATTENTIONS = ("official", "heads")
ORDERS = ("official", "spatial")


@dataclass(frozen=True)
class PruMergeOutput:
    """``hidden`` ``(B, K + 1, D)``: the kept patches (merged into), then the extra token, then
    padding where an item kept fewer than ``K``; ``counts`` ``(B,)`` tokens each item hands the LLM
    (kept + 1); ``kept`` ``(B, K)`` the kept patches' indices (``-1`` in padding)."""

    hidden: Tensor
    counts: Tensor
    kept: Tensor


def prumerge_cls_attention(query: Tensor, keys: Tensor, heads: int, attention: str = ATTENTION,
                           scores: str = DEFAULT_ATTENTION_SCORES) -> Tensor:
    """``(B, N)`` ``cls_attn``: the [CLS] row over every key, patch columns.

    Args:
        query: ``(B, C)`` the last layer's ``q_proj`` output at [CLS] (heads not split).
        keys: ``(B, T, C)`` its ``k_proj`` output at every position.
        heads: the layer's attention heads (``C = heads * d``).
        attention: ``"official"`` (the default: one ``C``-wide head scaled by ``C ** -0.5``) or ``"heads"``
            (ficoco's correction: the layer's own per-head softmax at ``d ** -0.5``, head mean).
        scores: the rule the scores are computed by (ficoco.methods.reads: the model's dtype, or float32).
    """
    if attention not in ATTENTIONS:
        raise FicocoError(f"PruMerge+ attention must be one of {', '.join(ATTENTIONS)}, got {attention!r}")
    batch, tokens, width = keys.shape
    if attention == "official":
        heads = 1
    if width % heads:
        raise ValueError(f"{heads} heads do not split a {width}-wide projection")
    split_query = query.reshape(batch, heads, width // heads)
    split_keys = keys.reshape(batch, tokens, heads, width // heads).transpose(1, 2)
    return last_row_attention(split_query, split_keys, None, None, scores).mean(dim=1)[:, 1:]


def prumerge_selection(cls_attn: Tensor, tokens: int | None = None) -> tuple[Tensor, Tensor]:
    """Which patches each item keeps: ``(priority (B, N) order, counts (B,))``.

    ``priority[b, :counts[b]]`` are the kept patches: the IQR outliers by score, then the spatial
    samples in order, then (fixed count only) the next patches by score. ``tokens=None``: the
    adaptive count (outliers and samples); ``tokens=N``: ``N - 1`` patches for every item.
    """
    batch, patches = cls_attn.shape
    scores = cls_attn.to(compute_dtype(cls_attn.dtype))
    q1, q3 = torch.quantile(scores, 0.25, dim=1, keepdim=True), torch.quantile(scores, 0.75, dim=1, keepdim=True)
    outliers = (scores > q3 + 1.5 * (q3 - q1)).sum(dim=1).clamp(min=1)  # at least one: no division by zero
    by_score = torch.sort(scores, dim=1, descending=True, stable=True).indices
    ranks = torch.arange(patches, device=cls_attn.device).expand(batch, -1)
    score_rank = torch.empty_like(by_score).scatter_(1, by_score, ranks)
    is_outlier = score_rank < outliers.unsqueeze(1)
    # step = int(int(1 / ratio) / 3) with ratio = outliers / N, at least 1.
    step = torch.clamp((patches // outliers) // 3, min=1)
    index = ranks
    is_sample = (index % step.unsqueeze(1) == 0) & ~is_outlier
    later = torch.where(is_sample, patches + index, 2 * patches + score_rank)
    priority_key = torch.where(is_outlier, score_rank, later)
    priority = torch.sort(priority_key, dim=1, stable=True).indices
    if tokens is None:
        counts = (is_outlier | is_sample).sum(dim=1)
    else:
        if not 2 <= tokens <= patches + 1:
            raise FicocoError(f"PruMerge+ hands the LLM 2..{patches + 1} tokens per item, got {tokens}")
        counts = torch.full((batch,), tokens - 1, dtype=torch.long, device=cls_attn.device)
    return priority, counts


def prumerge_reduce(hidden: Tensor, cls_attn: Tensor, keys: Tensor, tokens: int | None = None,
                    neighbours: int = 32, order: str = ORDER) -> PruMergeOutput:
    """PruMerge+ on a batch of items.

    Args:
        hidden: ``(B, N, D)`` the patches of the layer the projector reads ([CLS] dropped).
        cls_attn: ``(B, N)`` from `prumerge_cls_attention`.
        keys: ``(B, N, C)`` the last layer's ``k_proj`` output at the patches (full width).
        tokens: None (adaptive) or the fixed count per item, the extra token included.
        neighbours: the 32 nearest patches each kept one absorbs.
        order: ``"official"`` (the default: kept patches by priority) or ``"spatial"`` (ficoco's correction:
            image order).
    """
    if order not in ORDERS:
        raise FicocoError(f"PruMerge+ order must be one of {', '.join(ORDERS)}, got {order!r}")
    batch, patches, width = hidden.shape
    priority, counts = prumerge_selection(cls_attn, tokens)
    most = int(counts.max())  # one host read: the padded width of an adaptive batch
    taken = priority[:, :most]
    valid = torch.arange(most, device=hidden.device).unsqueeze(0) < counts.unsqueeze(1)
    if order == "spatial":
        key = torch.where(valid, taken, patches + taken)
        taken = torch.sort(key, dim=1).values % patches
    dtype = compute_dtype(hidden.dtype)
    x, a = hidden.to(dtype), cls_attn.to(dtype)
    normed = F.normalize(keys.to(dtype), dim=-1)
    similarity = gather_tokens(normed, taken) @ normed.transpose(1, 2)  # (B, K, N)
    similarity = similarity.scatter(2, taken.unsqueeze(-1), float("-inf"))  # never itself
    k = min(neighbours, patches - 1)
    nearest = torch.sort(similarity, dim=-1, descending=True, stable=True).indices[..., :k]  # (B, K, k)
    weights = torch.gather(a.unsqueeze(1).expand(-1, most, -1), 2, nearest)
    neighbours_x = gather_tokens(x, nearest.reshape(batch, -1)).reshape(batch, most, k, width)
    # The weighted sums as matrix products (einsum, bmm): the work the counters of flops --verify
    # see and the accountant's terms count.
    merged = gather_tokens(x, taken) + torch.einsum("bkn,bknd->bkd", weights, neighbours_x)
    is_kept = torch.zeros(batch, patches, dtype=torch.bool, device=hidden.device)
    # A tensor source, not a bool scalar: torch.jit's trace (fvcore) has no scatter overload for one.
    is_kept = is_kept.scatter(1, torch.where(valid, taken, taken[:, :1]), torch.ones_like(taken, dtype=torch.bool))
    extra = torch.bmm(torch.where(is_kept, torch.zeros_like(a), a).unsqueeze(1), x)
    out = torch.cat([merged, torch.zeros_like(extra)], dim=1)
    # The extra token goes right after each item's own kept patches; padding after it is zero.
    slot = torch.arange(most + 1, device=hidden.device).unsqueeze(0)
    out = torch.where((slot == counts.unsqueeze(1)).unsqueeze(-1), extra.expand(-1, most + 1, -1), out)
    out = torch.where((slot > counts.unsqueeze(1)).unsqueeze(-1), torch.zeros_like(out), out)
    kept = torch.where(valid, taken, torch.full_like(taken, -1))
    return PruMergeOutput(hidden=out.to(hidden.dtype), counts=counts + 1, kept=kept)


def tower_step(inputs: TowerInput, settings: Mapping[str, Any]) -> TowerOutput:
    """The model adapters' call at the tower's output, before the projector: ``inputs.hidden`` are
    the feature layer's patches ([CLS] dropped); ``cls_query`` and ``keys`` come from the **last**
    tower layer's attention (its q_proj and k_proj outputs, heads split), as the official hooks
    read them. Adaptive settings return each item's measured count in ``counts``."""
    if inputs.keys is None or inputs.cls_query is None or not inputs.has_cls:
        raise RuntimeError("PruMerge+ needs the last tower layer's [CLS] query and keys from the adapter's probe")
    items, heads, tokens, head_dim = inputs.keys.shape
    keys = inputs.keys.transpose(1, 2).reshape(items, tokens, heads * head_dim)
    cls_attn = prumerge_cls_attention(inputs.cls_query.reshape(items, heads * head_dim), keys, heads,
                                      settings.get("attention", ATTENTION),
                                      settings.get("attention_scores", DEFAULT_ATTENTION_SCORES))
    patch_keys = keys[:, 1:]
    if inputs.merge > 1:
        # Units of `merge` consecutive patches (InternVL's pixel-shuffle groups): a unit's share of [CLS]'s
        # attention is its patches' sum (the weights still sum to one over the item), its key their mean.
        cls_attn = cls_attn.reshape(items, -1, inputs.merge).sum(dim=-1)
        patch_keys = patch_keys.reshape(items, -1, inputs.merge, patch_keys.shape[-1]).mean(dim=2)
    adaptive = bool(settings.get("adaptive"))
    out = prumerge_reduce(inputs.hidden, cls_attn, patch_keys, tokens=None if adaptive else settings["tokens"],
                          neighbours=settings.get("neighbours", 32), order=settings.get("order", ORDER))
    extra = torch.full((items, 1), -1, dtype=torch.long, device=inputs.hidden.device)
    return TowerOutput(hidden=out.hidden, kept=torch.cat([out.kept, extra], dim=1),
                       counts=out.counts if adaptive else None)
