"""ToMe (facebookresearch/ToMe af95e4b, ICLR'23) in the vision tower: bipartite soft matching.

Inside every tower layer up to the one the projector reads, **between attention and MLP**
(``ToMeBlock.forward``), ToMe merges ``r`` pairs of similar tokens (tome/merge.py):

1. **Metric**: the layer's key states averaged over heads (``k.mean(1)``), L2-normalised.
2. **Bipartite split**: A = even positions, B = odd positions; ``scores = A B^T`` (cosine);
   with a [CLS] token its row is ``-inf``, so it is never merged.
3. Each A token's best B match; the ``r`` A tokens with the highest best score are merged into
   their match (``r`` is capped at half of the mergeable tokens).
4. **Size-weighted average** (``merge_wavg``): ``x <- merge(x * s, sum) / merge(s, sum)``,
   ``s <- merge(s, sum)``, sizes starting at 1 and **carried from layer to layer**.
5. **Proportional attention** (``prop_attn``, on for off-the-shelf models): every later
   attention adds ``log(s_j)`` to the logits of key ``j`` before the softmax
   (`proportional_attention_bias`), so a merged token weighs as the tokens it stands for.

**Order.** The official merge returns ``[unmerged A (sorted by index when there is a [CLS]),
all B]``, which shuffles the patches; the next layer's even/odd split then runs on that
shuffled order. ``order="official"`` (the default) reproduces it. ``order="spatial"`` (ficoco's
correction, which reports label) returns the remaining tokens in their original order instead (the
attention and MLP do not see the order; only the next split does), so the tokens reach the
projector in image order. ``positions`` tracks each token's original patch index through either
order. A tower whose later layers or projector read the tokens in image order (InternVL's pixel
shuffle, the Qwen towers' merge groups and 3-D positions) keeps them so: under the official order
the merges are the official ones, computed on the official sequence, which `tower_step` carries
from layer to layer beside the tokens (``TowerInput.sequence``), and the tokens go on in image order.

Departures (the official defects and what the batched form needs): ``argsort`` over equal
scores has an unspecified order in the official code; here a stable sort takes the lowest
index first, so a batch equals its samples run alone and runs are reproducible. The official
repository patches timm ViTs only and keeps ``_tome_info`` on the model (state between calls);
here sizes and positions are plain inputs and outputs. LightCompress's LLaVA port carries no
size between layers and no proportional attention; both are kept here, as in the original.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ficoco.errors import FicocoError
from ficoco.methods import ops as method_ops
from ficoco.methods.inputs import TowerInput, TowerOutput
from ficoco.methods.ops import compute_dtype, gather_tokens, unit_keys
from ficoco.methods.tome import ORDER

__all__ = ["ToMeMerged", "bipartite_matching", "proportional_attention_bias", "tome_merge", "tower_step"]

ORDERS = ("official", "spatial")


@dataclass(frozen=True)
class ToMeMerged:
    """The tokens of one layer after ToMe's merge.

    Attributes:
        hidden: ``(B, T - r, D)`` merged tokens (the [CLS] token, if any, stays first).
        size: ``(B, T - r)`` how many original tokens each stands for (float, for the next layer's
            proportional attention and merge).
        positions: ``(B, T - r)`` the original index of the token that each one continues (its
            own for an unmerged token, the destination's for a merged pair).
    """

    hidden: Tensor
    size: Tensor
    positions: Tensor


@dataclass(frozen=True)
class Matching:
    """Which tokens merge: indices into the current sequence, per sample.

    ``src`` ``(B, r)`` A tokens that merge into ``dst`` ``(B, r)`` B tokens; ``unmerged`` ``(B, |A| - r)``
    the A tokens that stay, in the official order (descending best score, then sorted by index
    when there is a [CLS])."""

    src: Tensor
    dst: Tensor
    unmerged: Tensor


def bipartite_matching(metric: Tensor, r: int, has_cls: bool = True) -> Matching:
    """ToMe's bipartite soft matching on ``metric`` ``(B, T, C)`` (head-mean keys), batched.

    Args:
        metric: ``(B, T, C)``; position 0 is [CLS] when ``has_cls``.
        r: pairs to merge, at most the A tokens that may merge and at most ``|B|``.
        has_cls: protect position 0 (its row of scores is ``-inf``).
    """
    batch, tokens, _ = metric.shape
    limit = (tokens - int(has_cls)) // 2
    if not 0 <= r <= limit:
        raise FicocoError(f"ToMe merges at most half of a layer's {tokens - int(has_cls)} mergeable tokens "
                          f"({limit}); asked {r}")
    normed = F.normalize(metric.to(compute_dtype(metric.dtype)), dim=-1)
    a, b = normed[:, ::2], normed[:, 1::2]
    scores = a @ b.transpose(1, 2)
    if has_cls:
        scores[:, 0, :] = -math.inf
    best, best_index = scores.max(dim=-1)
    # Stable descending order: equal best scores merge lowest A index first.
    edges = torch.sort(best, dim=-1, descending=True, stable=True).indices
    unmerged, src = edges[:, r:], edges[:, :r]
    if has_cls:  # the official code sorts the unmerged A tokens so that [CLS] stays first
        unmerged = torch.sort(unmerged, dim=-1).values
    dst = torch.gather(best_index, 1, src)
    return Matching(src=src, dst=dst, unmerged=unmerged)


def _merge_sum(x: Tensor, matching: Matching) -> tuple[Tensor, Tensor]:
    """(unmerged A rows, B rows with their sources summed in) of ``x`` ``(B, T, C)``."""
    a, b = x[:, ::2], x[:, 1::2]
    channels = x.shape[-1]
    unmerged = torch.gather(a, 1, matching.unmerged.unsqueeze(-1).expand(-1, -1, channels))
    src = torch.gather(a, 1, matching.src.unsqueeze(-1).expand(-1, -1, channels))
    b = b.scatter_add(1, matching.dst.unsqueeze(-1).expand(-1, -1, channels), src)
    return unmerged, b


def _receivers_only(hidden: Tensor) -> bool:
    """Whether `tome_merge` may compute only the B tokens that receive a source (`_merge_at_receivers`): on a CPU
    (it asks the host which ones), for half-precision tokens (every other token's size-weighted mean, x * s / s in
    float32, rounds back to x exactly there; in float32 it may sit an ulp away), with nothing recording
    gradients or counting ops (which count the dense form)."""
    return (hidden.device.type == "cpu" and hidden.dtype in (torch.bfloat16, torch.float16)
            and method_ops.SPARSE_MERGES_ON_CPU and not (torch.is_grad_enabled() and hidden.requires_grad)
            and not method_ops.watched())


def _merge_at_receivers(hidden: Tensor, size: Tensor, matching: Matching, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """ToMe's size-weighted merge, `[unmerged A, B]` and their sizes, computed in `dtype` only at the B tokens that
    receive a source (any sample's): the same sums in the same order as the dense form, the rest copied."""
    a, b = hidden[:, ::2], hidden[:, 1::2]
    size_a, size_b = size[:, ::2], size[:, 1::2]
    unmerged = gather_tokens(a, matching.unmerged)
    new_hidden = torch.cat([unmerged, b], dim=1)
    source_size = torch.gather(size_a, 1, matching.src)
    new_size = torch.cat([torch.gather(size_a, 1, matching.unmerged),
                          size_b.scatter_add(1, matching.dst, source_size)], dim=1)
    receivers = torch.unique(matching.dst)  # sorted
    slot = torch.searchsorted(receivers, matching.dst)  # each source's receiver, among the receivers
    channels = hidden.shape[-1]
    weighted = b[:, receivers].to(dtype) * size_b[:, receivers].unsqueeze(-1)
    sources = gather_tokens(a, matching.src).to(dtype) * source_size.unsqueeze(-1)
    weighted.scatter_add_(1, slot.unsqueeze(-1).expand(-1, -1, channels), sources)
    total = size_b[:, receivers].scatter_add(1, slot, source_size)
    new_hidden[:, unmerged.shape[1] + receivers] = (weighted / total.unsqueeze(-1)).to(hidden.dtype)
    return new_hidden, new_size


def tome_merge(hidden: Tensor, metric: Tensor, r: int, size: Tensor | None = None, positions: Tensor | None = None,
               has_cls: bool = True, order: str = ORDER) -> ToMeMerged:
    """Merge ``r`` token pairs of one layer by size-weighted averages (ToMe's ``merge_wavg``).

    Args:
        hidden: ``(B, T, D)`` after the attention residual, before the MLP.
        metric: ``(B, T, C)`` the layer's head-mean keys.
        r: pairs to merge (the same for every sample, so shapes stay rectangular).
        size: ``(B, T)`` sizes carried from earlier layers (None: every token stands for one).
        positions: ``(B, T)`` original indices carried from earlier layers (None: ``arange``).
        has_cls: whether position 0 is [CLS] (never merged, stays first).
        order: ``"official"`` (the default: ``[unmerged A, B]``) or ``"spatial"`` (ficoco's correction:
            the current order kept).

    Returns:
        A :class:`ToMeMerged`; ``r == 0`` returns the input (bit for bit) with its sizes.
    """
    if order not in ORDERS:
        raise FicocoError(f"ToMe order must be one of {', '.join(ORDERS)}, got {order!r}")
    if hidden.dim() != 3 or metric.shape[:2] != hidden.shape[:2]:
        raise ValueError(f"hidden (B, T, D) and metric (B, T, C) must agree, got {tuple(hidden.shape)} and "
                         f"{tuple(metric.shape)}")
    batch, tokens, _ = hidden.shape
    device = hidden.device
    dtype = compute_dtype(hidden.dtype)
    if size is None:
        size = torch.ones(batch, tokens, device=device, dtype=dtype)
    if positions is None:
        positions = torch.arange(tokens, device=device).expand(batch, -1)
    if r == 0:
        return ToMeMerged(hidden=hidden, size=size, positions=positions)
    matching = bipartite_matching(metric, r, has_cls)
    if _receivers_only(hidden):
        new_hidden, new_size = _merge_at_receivers(hidden, size.to(dtype), matching, dtype)
    else:
        weights = size.to(dtype).unsqueeze(-1)
        summed_a, summed_b = _merge_sum(torch.cat([hidden.to(dtype) * weights, weights], dim=-1), matching)
        merged = torch.cat([summed_a, summed_b], dim=1)
        new_size = merged[..., -1]
        new_hidden = (merged[..., :-1] / new_size.unsqueeze(-1)).to(hidden.dtype)
    # Current indices of the survivors: unmerged A tokens sit at 2i, B tokens at 2j + 1.
    current = torch.cat([2 * matching.unmerged, 2 * torch.arange(tokens // 2, device=device).expand(batch, -1) + 1],
                        dim=1)
    if order == "spatial":
        permutation = torch.sort(current, dim=1).indices
        new_hidden = gather_tokens(new_hidden, permutation)
        new_size = torch.gather(new_size, 1, permutation)
        current = torch.gather(current, 1, permutation)
    return ToMeMerged(hidden=new_hidden, size=new_size, positions=torch.gather(positions, 1, current))


def proportional_attention_bias(size: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """``(B, 1, 1, T)`` additive logits ``log(size)`` per key: ToMe's proportional attention.

    Added to the attention mask of a layer that follows a merge (SDPA takes a float mask), so
    that a key standing for ``s`` tokens weighs as ``s`` copies of itself."""
    bias = size.log()
    return bias[:, None, None, :].to(dtype or bias.dtype)


def _merge_in_image_order(inputs: TowerInput, metric: Tensor, order: str) -> tuple[ToMeMerged, Tensor | None]:
    """The merge of `order` for an adapter that keeps image order: on the method's own sequence (the previous
    step's, `inputs.sequence`; image order before the first), the tokens handed back in image order with the
    sequence they now form (indices into them)."""
    hidden, size, positions, sequence = inputs.hidden, inputs.size, inputs.positions, inputs.sequence
    items, tokens = hidden.shape[:2]
    if size is None:
        size = torch.ones(items, tokens, device=hidden.device, dtype=compute_dtype(hidden.dtype))
    if positions is None:
        positions = torch.arange(tokens, device=hidden.device).expand(items, -1)
    if not inputs.remove:
        return ToMeMerged(hidden=hidden, size=size, positions=positions), sequence
    if sequence is not None:
        hidden, metric = gather_tokens(hidden, sequence), gather_tokens(metric, sequence)
        size, positions = torch.gather(size, 1, sequence), torch.gather(positions, 1, sequence)
    merged = tome_merge(hidden, metric, inputs.remove, size, positions, has_cls=inputs.has_cls, order=order)
    to_image = torch.sort(merged.positions, dim=1).indices  # original indices ascending: image order
    in_image = ToMeMerged(hidden=gather_tokens(merged.hidden, to_image), size=torch.gather(merged.size, 1, to_image),
                          positions=torch.gather(merged.positions, 1, to_image))
    # The official sequence as indices into the image-ordered tokens: where each of its tokens now stands.
    return in_image, torch.sort(to_image, dim=1).indices


def tower_step(inputs: TowerInput, settings: Mapping[str, Any]) -> TowerOutput:
    """The model adapters' call inside a tower layer, between attention and MLP: merge ``remove``
    pairs by the layer's head-mean keys, carrying sizes and positions to the next layer; with
    ``prop_attn`` every later layer adds ``log(size)`` to its keys' logits."""
    if inputs.keys is None:
        raise RuntimeError("ToMe needs the layer's key states from the adapter's probe")
    # Units of several patches (Qwen2-VL's merge groups): their head-mean keys averaged over the group.
    metric = inputs.keys.mean(dim=1) if inputs.merge == 1 else unit_keys(inputs)
    if inputs.merge > 1 and inputs.has_cls:  # [CLS] stays a unit of its own, first (InternVL's groups)
        metric = torch.cat([inputs.keys.mean(dim=1)[:, :1].to(metric.dtype), metric], dim=1)
    order = settings.get("order", ORDER)
    if inputs.image_order and order != "spatial":
        merged, sequence = _merge_in_image_order(inputs, metric, order)
    else:
        merged = tome_merge(inputs.hidden, metric, inputs.remove, inputs.size, inputs.positions,
                            has_cls=inputs.has_cls, order=order)
        sequence = None
    offset = int(inputs.has_cls)
    bias = proportional_attention_bias(merged.size, inputs.hidden.dtype) if settings.get("prop_attn", True) else None
    return TowerOutput(hidden=merged.hidden, kept=merged.positions[:, offset:] - offset, size=merged.size,
                       positions=merged.positions, attention_bias=bias, sequence=sequence)
