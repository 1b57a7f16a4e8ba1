"""VisPruner (ICCV'25, Theia-4869/VisPruner aefa01a, first read from its copy anonymous-4869/VisPruner
d01c757; llava_arch.py ``encode_images`` and clip_encoder.py): important tokens by [CLS] attention, then
diverse tokens from the rest by removing duplicates.

At the output of the tower layer the projector reads (LLaVA: ``hidden_states[-2]``), before the
projector, per item (image, crop, frame), text-agnostic, for ``T`` tokens kept:

1. **Importance**: the [CLS] query's softmax attention over the patches of that layer
   (``attentions[select_layer][:, :, 0, 1:]``), **mean over heads**.
2. **Important** tokens: the ``int(T * 0.5)`` patches of highest importance
   (``important_ratio``); the rest, in descending importance order, are the residual.
3. **Diverse** tokens: the layer's patch features, L2-normalised. While the residual holds more
   than ``T - important`` tokens: ``r = min(8, R - diverse)``; split the residual in its
   current order into ``a`` (even places) and ``b`` (odd places); each ``a`` token's score is its
   highest cosine similarity to a ``b`` token; the ``r`` ``a`` tokens of highest score leave
   (at most all of ``a``); the residual becomes the remaining ``a`` tokens (in descending score
   order) followed by ``b``.
4. The important and diverse tokens, sorted into image order, go through the projector (only
   they are projected).

Departures: the official code reads the row from ``output_attentions=True`` (eager attention in
every tower layer); here the adapters compute that one row from the layer's own q of [CLS] and
keys (exact: a tower attends without a mask), so SDPA stays on. Sorts are stable, so ties go to
the lowest index or earlier place (``argsort`` leaves them open). An odd residual: the official
indexing takes ``R // 2 - r`` rows against ``ceil(R / 2) - r`` picks and raises (58 of 576
patches, for one), as it does where ``r`` exceeds the ``a`` tokens; here ``a`` holds
``ceil(R / 2)`` tokens and at most all of them leave in a round. On a tower without [CLS]
(Qwen2-VL) the importance is FiCoCo's equivalent token, and reports label it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ficoco.errors import FicocoError
from ficoco.methods.inputs import TowerInput, TowerOutput
from ficoco.methods.ops import compute_dtype, gather_tokens, patch_scores_from_cls
from ficoco.methods.reads import DEFAULT_ATTENTION_SCORES
from ficoco.methods.vispruner import IMPORTANT_RATIO

__all__ = ["DUPLICATES_PER_ROUND", "important_count", "tower_step", "vispruner_reduce", "vispruner_rounds",
           "vispruner_select"]

# The official loop removes at most 8 duplicates per round.
DUPLICATES_PER_ROUND = 8


def important_count(keep: int, important_ratio: float) -> int:
    """Important tokens of ``keep``: ``int(keep * important_ratio)``, as the official code truncates."""
    return int(keep * important_ratio)


def vispruner_rounds(residual: int, diverse: int) -> list[tuple[int, int, int]]:
    """The duplicate-removal rounds on ``residual`` tokens down to ``diverse``: per round
    ``(a tokens, b tokens, removed)`` (plain ints: the accountant's count and the loop's plan)."""
    rounds = []
    while True:
        r = min(DUPLICATES_PER_ROUND, residual - diverse)
        if r <= 0:
            return rounds
        a, b = (residual + 1) // 2, residual // 2
        removed = min(r, a)
        rounds.append((a, b, removed))
        residual -= removed


def vispruner_select(features: Tensor, scores: Tensor, keep: int, important_ratio: float = IMPORTANT_RATIO
                     ) -> Tensor:
    """``(B, keep)`` ascending indices of the important and diverse tokens.

    Args:
        features: ``(B, N, D)`` the patches of the layer the projector reads.
        scores: ``(B, N)`` the head-mean [CLS] attention over them (or the equivalent token's).
        keep: tokens that stay per item.
        important_ratio: the share of ``keep`` chosen by importance.
    """
    batch, tokens, _ = features.shape
    if not 1 <= keep <= tokens:
        raise FicocoError(f"VisPruner keeps 1..{tokens} tokens per item, got {keep}")
    important = important_count(keep, important_ratio)
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices
    residual = order[:, important:]
    unit = F.normalize(features.to(compute_dtype(features.dtype)), dim=-1)
    for _, _, removed in vispruner_rounds(tokens - important, keep - important):
        current = gather_tokens(unit, residual)
        a, b = current[:, ::2], current[:, 1::2]
        best = (a @ b.transpose(1, 2)).max(dim=-1).values
        distinct = torch.sort(best, dim=1, descending=True, stable=True).indices[:, removed:]
        residual = torch.cat([torch.gather(residual[:, ::2], 1, distinct), residual[:, 1::2]], dim=1)
    return torch.cat([order[:, :important], residual], dim=1).sort(dim=1).values


def vispruner_reduce(features: Tensor, scores: Tensor, keep: int, important_ratio: float = IMPORTANT_RATIO
                     ) -> tuple[Tensor, Tensor]:
    """``(features (B, keep, D), kept (B, keep))`` in image order; ``keep == N`` returns the input."""
    kept = vispruner_select(features, scores, keep, important_ratio)
    return gather_tokens(features, kept), kept


def tower_step(inputs: TowerInput, settings: Mapping[str, Any]) -> TowerOutput:
    """The adapters' call at the tower's output, before the projector: ``inputs.hidden`` are the
    patches the projector would map ([CLS] dropped), scored by the head-mean [CLS] row of that layer
    (the equivalent token on a tower without [CLS])."""
    scores = patch_scores_from_cls(inputs, "mean", settings.get("attention_scores", DEFAULT_ATTENTION_SCORES))
    keep = inputs.hidden.shape[1] - inputs.remove
    features, kept = vispruner_reduce(inputs.hidden, scores, keep, settings.get("important_ratio", 0.5))
    return TowerOutput(hidden=features, kept=kept)
