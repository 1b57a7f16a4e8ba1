"""FasterVLM (Theia-4869/FasterVLM f5d5f12): [CLS]-attention top-k after the projector.

The score comes from the tower: the [CLS] query's softmax attention over all keys of the layer
the projector reads (``attentions[select_layer=-2]``, layer 22 on LLaVA), **averaged over
heads**, patch columns (clip_encoder.py ``feature_select``). The projector maps every patch;
then a boolean mask keeps the top ``keep`` (llava_arch.py ``encode_images``,
``image_feature[index_mask]``), so the kept tokens stay in **image order**. No merge, and
[CLS] is not added.

Departures: the official code gets the row from ``output_attentions=True``, i.e. eager
attention in all 24 tower layers; here the adapters compute one row (q of [CLS] against the
layer's keys, `ficoco.methods.ops.cls_attention`), which is exact because a tower
attends without a mask, so SDPA stays on. Ties among equal scores go to the lowest index
(``topk`` leaves them open). It projects every patch before the cut, as the official code does
(the accountant counts the projector on all of them). On a tower without [CLS] (Qwen2-VL) the
score is FiCoCo's equivalent token, per merge group, and reports label it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor

from ficoco.errors import FicocoError
from ficoco.methods.inputs import TowerInput, TowerOutput
from ficoco.methods.ops import gather_tokens, patch_scores_from_cls, top_indices
from ficoco.methods.reads import DEFAULT_ATTENTION_SCORES

__all__ = ["fastervlm_reduce", "fastervlm_scores", "tower_step"]


def fastervlm_scores(cls_row: Tensor, has_cls: bool = True) -> Tensor:
    """``(B, N)`` the head-mean [CLS] attention ``(B, H, T)`` over the patch columns."""
    return cls_row[:, :, int(has_cls):].mean(dim=1)


def fastervlm_reduce(features: Tensor, scores: Tensor, keep: int) -> tuple[Tensor, Tensor]:
    """Keep the ``keep`` highest-scoring projected patches of every item, in image order.

    Args:
        features: ``(B, N, D)`` the projector's output for every patch.
        scores: ``(B, N)`` from `fastervlm_scores` (or the equivalent token's).
        keep: patches that stay, the same for every item.

    Returns:
        ``(features (B, keep, D), kept (B, keep))``; ``keep == N`` returns the input unchanged.
    """
    if features.shape[:2] != scores.shape:
        raise ValueError(f"features (B, N, D) and scores (B, N) must agree, got {tuple(features.shape)} and "
                         f"{tuple(scores.shape)}")
    if not 1 <= keep <= scores.shape[1]:
        raise FicocoError(f"FasterVLM keeps 1..{scores.shape[1]} patches, got {keep}")
    kept = top_indices(scores, keep)
    return gather_tokens(features, kept), kept


def tower_step(inputs: TowerInput, settings: Mapping[str, Any]) -> TowerOutput:
    """The model adapters' call after the projector: ``inputs.hidden`` is the projector's output
    for every patch, scored by the [CLS] row of the layer the projector reads (head mean; the
    equivalent token on a tower without [CLS]); ``remove`` of them leave."""
    scores = patch_scores_from_cls(inputs, "mean", settings.get("attention_scores", DEFAULT_ATTENTION_SCORES))
    features, kept = fastervlm_reduce(inputs.hidden, scores, scores.shape[1] - inputs.remove)
    return TowerOutput(hidden=features, kept=kept)
