"""Pieces the methods that act before the LLM share: the [CLS] attention row of a tower layer,
its stand-in on towers without [CLS], and scores per Qwen2-VL merge group.

Every function works on a batch of tower items (images, crops, frames), ``(B, T, ...)``, with
``T`` the item's tokens ([CLS] first when the tower has one).
"""

from __future__ import annotations

from torch import Tensor

from ficoco.methods.stages import last_row_attention
from ficoco.reduction.ficoco_v import equivalent_token_redundancy

__all__ = ["cls_attention", "equivalent_token_scores", "merge_group_scores"]


def cls_attention(query: Tensor, keys: Tensor, scale: float | None = None) -> Tensor:
    """``(B, H, T)`` the [CLS] query's softmax over every key of a tower layer, per head.

    Args:
        query: ``(B, H, d)`` q of position 0 (``q_proj`` output, heads split; a tower applies no rotary).
        keys: ``(B, H, T, d)`` k of every position.
        scale: logit scale, ``1 / sqrt(d)`` (the layer's own) by default.

    A tower attends without a mask, so the row is exact whether the layer ran eager or SDPA.
    """
    return last_row_attention(query, keys, None, scale)


def equivalent_token_scores(keys: Tensor) -> Tensor:
    """``(B, N)`` importance of every patch on a tower without [CLS]: FiCoCo's equivalent token.

    ``-cos(mu, M_j)``, with ``M`` the head-mean keys ``(B, H, N, d) -> (B, N, d)`` and ``mu`` their
    mean over the patches (SPEC.md): a patch far from the global mean says more of its own, as a
    patch that [CLS] attends to does. Used in place of the [CLS] attention, and labelled so."""
    return equivalent_token_redundancy(keys, has_cls=False)


def merge_group_scores(scores: Tensor, merge: int) -> Tensor:
    """``(B, N / merge)`` mean score of every merge group (Qwen2-VL's PatchMerger joins ``merge``
    consecutive patches - a 2 x 2 group, as its processor orders them - into one LLM token)."""
    batch, patches = scores.shape
    if patches % merge:
        raise ValueError(f"{patches} patches do not split into groups of {merge}")
    return scores.reshape(batch, patches // merge, merge).mean(dim=-1)
