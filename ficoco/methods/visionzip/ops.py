"""VisionZip (dvlab-research/VisionZip 3151f6d, CVPR'25): dominant and contextual tokens.

At the output of the tower layer the projector reads (LLaVA: ``hidden_states[-2]``, layer 22),
before the projector, text-agnostic:

1. **Score**: the [CLS] query's softmax attention over all keys of that layer, summed over
   heads (``attn[:, :, 0, 1:]``). The sum ranks as the mean does.
2. **Dominant** tokens: the top ``dominant`` patches, in original order.
3. **Contextual** tokens: the remaining patches, in original order, with the layer's head-mean
   keys L2-normalised; targets are taken at a fixed stride (``step = max(1, N_r // contextual)``,
   ``arange(0, N_r, step)[:contextual]``); every other remaining patch joins the target of
   highest cosine similarity (argmax).
4. Output ``[dominant, contextual]`` (``dominant + contextual`` tokens), then the projector.

**The official behaviour is the default; ficoco's corrections are named settings** (a report labels
them, ``ficoco.methods.registry.method_label``):

- *The contextual token is a sum*: the official ``target + mean(members)`` (``contextual_mode=
  "official"``, the default) has about twice a token's norm. ``contextual_mode="mean"`` (ficoco's
  correction) averages the target with its members (``(h_t + sum h_j) / (1 + count)``).
- *[CLS] is re-introduced into the LLM*: ``visionzip(dominant=D)`` keeps ``D - 1`` patches plus
  [CLS] first (``include_cls=True``, the default), which LLaVA's feature selection drops.
  ``include_cls=False`` (ficoco's correction) makes the ``dominant`` tokens patches. Where the
  projector cannot take [CLS] the dominant tokens are patches whatever the setting: a tower
  without one (SigLIP, the Qwen towers), InternVL's pixel-shuffle groups (four patches side by
  side; [CLS] is not one), and Video-LLaVA, which hands every item's [CLS] to the LLM itself.

Departures that are not settings (the official code's defects, fixed):

- Global class patches of ``CLIPAttention``/``CLIPEncoderLayer`` with per-call state in
  ``_info``, and eager attention in all 24 layers: here a pure function of one layer's [CLS]
  row, keys and hidden states (the adapters compute that one row; SDPA stays on).
- Ties among equal scores or similarities: the lowest index (``topk``/``argmax`` leave them open).

Order: the dominant tokens keep image order; the contextual tokens follow in the order of their
targets (image order too), as in the official output. On a tower without [CLS] (Qwen2-VL) the
score is FiCoCo's equivalent token (`ficoco.methods.ops.equivalent_token_scores`),
per merge group, and the tokens are merge groups; reports label it.
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
from ficoco.methods.ops import compute_dtype, gather_tokens, patch_scores_from_cls, top_indices, unit_keys
from ficoco.methods.reads import DEFAULT_ATTENTION_SCORES
from ficoco.methods.visionzip import CONTEXTUAL_MODE, INCLUDE_CLS

__all__ = ["VisionZipOutput", "tower_step", "visionzip_reduce", "visionzip_scores"]

CONTEXTUAL_MODES = ("official", "mean")


@dataclass(frozen=True)
class VisionZipOutput:
    """``hidden`` ``(B, dominant + contextual, D)``: dominant patches (image order; [CLS] first with
    ``include_cls``), then contextual tokens. ``dominant_index`` ``(B, k)`` the dominant patches'
    indices among the patches; ``target_index`` ``(B, contextual)`` the targets' indices."""

    hidden: Tensor
    dominant_index: Tensor
    target_index: Tensor


def visionzip_scores(cls_row: Tensor, has_cls: bool = True) -> Tensor:
    """``(B, N)`` patch scores from the [CLS] row ``(B, H, T)``: the head sum over the patch columns."""
    return cls_row[:, :, int(has_cls):].sum(dim=1)


def visionzip_reduce(hidden: Tensor, scores: Tensor, metric: Tensor, dominant: int, contextual: int,
                     has_cls: bool = True, include_cls: bool = INCLUDE_CLS, contextual_mode: str = CONTEXTUAL_MODE
                     ) -> VisionZipOutput:
    """Dominant patches plus contextual merged tokens, batched.

    Args:
        hidden: ``(B, T, D)`` the output of the layer the projector reads (``T = N + has_cls``).
        scores: ``(B, N)`` patch scores (`visionzip_scores`, or the equivalent token's).
        metric: ``(B, T, C)`` the layer's head-mean keys ([CLS] row included when ``has_cls``).
        dominant: dominant tokens (with ``include_cls``, [CLS] is one of them).
        contextual: contextual tokens; 0 drops the rest.
        has_cls: whether position 0 is [CLS].
        include_cls: the official code's [CLS] among the dominant tokens (the default; False: ficoco's
            correction, patches only). Only with ``has_cls``: without [CLS] the dominant tokens are patches.
        contextual_mode: ``"official"`` (the default: target plus the mean of its members) or ``"mean"``
            (ficoco's correction: the mean of the target and its members).
    """
    if contextual_mode not in CONTEXTUAL_MODES:
        raise FicocoError(f"VisionZip contextual_mode must be one of {', '.join(CONTEXTUAL_MODES)}")
    batch, tokens, width = hidden.shape
    offset = int(has_cls)
    patches = tokens - offset
    include_cls = include_cls and has_cls  # no [CLS] to keep: the dominant tokens are patches
    kept_patches = dominant - int(include_cls)
    remaining = patches - kept_patches
    if not (0 <= kept_patches <= patches and 0 <= contextual <= remaining and dominant >= 1):
        raise FicocoError(f"VisionZip: {dominant} dominant + {contextual} contextual tokens do not fit {patches} "
                          "patches")
    patch_hidden = hidden[:, offset:]
    chosen = top_indices(scores, kept_patches)  # ascending: image order
    # A tensor source, not a bool scalar: torch.jit's trace (fvcore) has no scatter overload for one.
    is_dominant = torch.zeros(batch, patches, dtype=torch.bool, device=hidden.device).scatter(
        1, chosen, torch.ones_like(chosen, dtype=torch.bool))
    parts = [hidden[:, :1]] if include_cls else []
    parts.append(gather_tokens(patch_hidden, chosen))
    # The remaining patches in image order (a stable sort puts the non-dominant first, in order).
    rest = torch.sort(is_dominant.to(torch.int8), dim=1, stable=True).indices[:, :remaining]
    targets_in_rest = torch.empty(batch, 0, dtype=torch.long, device=hidden.device)
    if contextual:
        step = max(1, remaining // contextual)
        targets_in_rest = torch.arange(0, remaining, step, device=hidden.device)[:contextual].expand(batch, -1)
        is_target = torch.zeros(remaining, dtype=torch.bool, device=hidden.device)
        is_target[targets_in_rest[0]] = True
        members_in_rest = torch.nonzero(~is_target).squeeze(-1).expand(batch, -1)
        dtype = compute_dtype(metric.dtype)
        rest_metric = F.normalize(gather_tokens(metric[:, offset:].to(dtype), rest), dim=-1)
        rest_hidden = gather_tokens(patch_hidden, rest).to(dtype)
        similarity = gather_tokens(rest_metric, members_in_rest) @ gather_tokens(rest_metric, targets_in_rest
                                                                                  ).transpose(1, 2)
        # argmax ties: the first (lowest) target, as a stable descending sort gives.
        assign = torch.sort(similarity, dim=-1, descending=True, stable=True).indices[..., 0]
        members = gather_tokens(rest_hidden, members_in_rest)
        sums = torch.zeros(batch, contextual, width, dtype=dtype, device=hidden.device)
        sums = sums.scatter_add(1, assign.unsqueeze(-1).expand(-1, -1, width), members)
        counts = torch.zeros(batch, contextual, dtype=dtype, device=hidden.device)
        counts = counts.scatter_add(1, assign, torch.ones_like(assign, dtype=dtype))
        target_hidden = gather_tokens(rest_hidden, targets_in_rest)
        if contextual_mode == "official":
            merged = target_hidden + sums / counts.clamp(min=1).unsqueeze(-1)
        else:
            merged = (target_hidden + sums) / (1 + counts).unsqueeze(-1)
        parts.append(merged.to(hidden.dtype))
    target_index = torch.gather(rest, 1, targets_in_rest) if contextual else targets_in_rest
    return VisionZipOutput(hidden=torch.cat(parts, dim=1), dominant_index=chosen, target_index=target_index)


def tower_step(inputs: TowerInput, settings: Mapping[str, Any]) -> TowerOutput:
    """The model adapters' call at the tower's output, before the projector: ``inputs.hidden`` are
    the patches the projector would map ([CLS] dropped), scored by the [CLS] row of the layer the
    projector reads (head sum; the equivalent token on a tower without [CLS]). With ``include_cls``
    (the official layout) and the [CLS] state the adapter hands over where the projector can take it
    (``inputs.cls_hidden``), [CLS] goes first among the dominant tokens."""
    if inputs.keys is None:
        raise RuntimeError("VisionZip needs the layer's key states from the adapter's probe")
    scores = patch_scores_from_cls(inputs, "sum", settings.get("attention_scores", DEFAULT_ATTENTION_SCORES))
    metric = unit_keys(inputs)
    dominant, contextual = settings["dominant"], settings["contextual"]
    hidden = inputs.hidden
    with_cls = bool(settings.get("include_cls", INCLUDE_CLS)) and inputs.cls_hidden is not None
    if with_cls:
        # [CLS] in front of the patches; its row of the merge metric is never read (it is not merged).
        hidden = torch.cat([inputs.cls_hidden.to(hidden.dtype), hidden], dim=1)
        metric = torch.cat([metric[:, :1], metric], dim=1)
    out = visionzip_reduce(hidden, scores, metric, dominant, contextual, has_cls=with_cls, include_cls=with_cls,
                           contextual_mode=settings.get("contextual_mode", CONTEXTUAL_MODE))
    items, device = hidden.shape[0], hidden.device
    merged = torch.full((items, contextual), -1, dtype=torch.long, device=device)
    cls = torch.full((items, int(with_cls)), -1, dtype=torch.long, device=device)  # [CLS] continues no patch
    # positions: where each token stands (a contextual token at its target), for adapters that place by unit.
    return TowerOutput(hidden=out.hidden, kept=torch.cat([cls, out.dominant_index, merged], dim=1),
                       positions=torch.cat([cls, out.dominant_index, out.target_index], dim=1))
