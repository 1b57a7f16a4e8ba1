"""CDPruner (NeurIPS'25, Theia-4869/CDPruner ed9c12d, the same rule at 9541616, llava_arch.py
``encode_images`` and clip_encoder.py): conditional DPP over the projected visual tokens, by fast
greedy MAP inference.

Per item (image, crop: LLaVA-NeXT's "32 x 5" rows keep ``T`` per crop), after the projector:

1. **Similarity**: ``S = cos`` between every pair of the projector's output tokens (``N x N``).
2. **Relevance** of every token to the instruction: ``-cos(image_embed_i, text_embed_m)``
   averaged over the ``M`` text embeddings, then min-max normalised:
   ``(r - min + 1e-6) / (max - min)``. The official LLaVA code (clip_encoder.py ``forward``, L62-98
   at 9541616) takes ``image_embeds`` from the CLIP vision model's ``post_layernorm`` and
   ``visual_projection`` of the selected layer's patches, and ``text_embeds`` from the CLIP **text
   tower** (``CLIPTextModelWithProjection``) run on the **bare question**: the benchmark's question
   with its answer-format line removed (llava/eval/model_vqa_loader.py L106-120), without the
   system prompt or the chat template, cut into 77-token segments, one pooled embedding per segment
   (``M`` segments: one for a short question).
3. **Kernel**: ``L = diag(r) S diag(r)`` (the ``exp(theta ...)`` reweighting is commented out in the
   official LLaVA code, so ``r`` enters as it is).
4. **Fast greedy MAP** (Chen et al., 2018): ``d_i^2 = L_ii``; ``T`` times pick
   ``j = argmax d^2``, ``e = (L_j - c_{<t,j} . c_{<t}) / sqrt(d_j^2)``, ``d^2 -= e^2``, ``d_j^2 = -inf``.
5. The ``T`` picks, sorted into image order, go to the LLM.

**No CLIP text tower here.** Hugging Face's LLaVA checkpoints carry only ``CLIPVisionModel`` (no
``visual_projection``, no text tower), and Qwen2-VL / LLaVA-OneVision have none at all. ficoco
then computes the relevance in the LLM's input space: the projected visual tokens (the
similarity's own features, in place of ``image_embeds``) against the LLM's input embeddings of the
prompt's tokens **after the sample's last visual placeholder**, padding left out (the adapters'
``prompt_text``), in place of ``text_embeds``, with the official ``-cos``, mean and min-max. These
are one embedding per token (``M`` = those tokens), not one pooled embedding of the question, and
they are what the prompt holds there: the question and whatever the chat template puts after it
(LLaVA-1.5's ``ASSISTANT:``); text before the image (the system prompt, a question written before the
image) is not read. This is what the OpenVINO GenAI port of CDPruner does for backbones without a
CLIP text tower; the official repository's Qwen2.5-VL / LLaVA-OneVision code is not in the stored
index, so whether it does the same could not be checked. Reports say so (the settings'
``relevance``, the entry's summary).

Departures: every pick is a new token (past the kernel's rank - more picks than the features'
width, as a large Qwen2-VL image can ask - the official gains turn non-positive or NaN and its
argmax picks NaN's index again; here a chosen token never outranks one not chosen, and NaN gains
rank lowest); the min-max runs per item (the official code normalises over the whole batch of crops
of one call, which would make an item's choice depend on its batch-mates); ``keep == N`` returns
the input (the greedy would pick every token). Ties go to the lowest index (``argmax``). The kernel
runs in float32 at least, as the official code does.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ficoco.errors import FicocoError
from ficoco.methods.inputs import TowerInput, TowerOutput
from ficoco.methods.ops import compute_dtype, gather_tokens

__all__ = ["cdpruner_reduce", "cdpruner_select", "conditional_kernel", "greedy_map", "relevance", "tower_step"]


def relevance(image: Tensor, text: Tensor, text_mask: Tensor | None = None) -> Tensor:
    """``(B, N)`` min-max normalised ``-cos`` of every visual token to the instruction, mean over its tokens.

    Args:
        image: ``(B, N, C)`` the visual tokens' embeddings.
        text: ``(B, M, C)`` the instruction's embeddings in the same space.
        text_mask: ``(B, M)`` True on real instruction tokens (padding left out of the mean).
    """
    dtype = compute_dtype(image.dtype)
    cos = F.normalize(image.to(dtype), dim=-1) @ F.normalize(text.to(dtype), dim=-1).transpose(1, 2)
    if text_mask is None:
        score = (-cos).mean(dim=-1)
    else:
        weight = text_mask.to(dtype).unsqueeze(1)
        score = (-cos * weight).sum(dim=-1) / weight.sum(dim=-1).clamp(min=1)
    low, high = score.min(dim=1, keepdim=True).values, score.max(dim=1, keepdim=True).values
    # Equal relevance everywhere (no text, or one token): the official 0 / 0; any constant picks the same.
    return (score - low + 1e-6) / (high - low).clamp(min=1e-12)


def conditional_kernel(features: Tensor, relevance_scores: Tensor) -> Tensor:
    """``(B, N, N)`` ``diag(r) S diag(r)``, ``S`` the cosine similarity of the ``(B, N, D)`` tokens."""
    unit = F.normalize(features.to(compute_dtype(features.dtype)), dim=-1)
    similarity = unit @ unit.transpose(1, 2)
    r = relevance_scores.to(similarity.dtype)
    return r.unsqueeze(2) * similarity * r.unsqueeze(1)


def greedy_map(kernel: Tensor, keep: int) -> Tensor:
    """``(B, keep)`` the fast greedy MAP picks of the DPP with kernel ``(B, N, N)``, in the order
    chosen (Chen et al., 2018: incremental Cholesky rows). One loop over the picks, batched."""
    batch, tokens, _ = kernel.shape
    rows = torch.arange(batch, device=kernel.device)
    gains = torch.diagonal(kernel, dim1=1, dim2=2).clone()  # d_i^2
    factors = kernel.new_zeros(keep, batch, tokens)  # c_t, one row per pick
    chosen = torch.empty(batch, keep, dtype=torch.long, device=kernel.device)
    selected = torch.zeros(batch, tokens, dtype=torch.bool, device=kernel.device)
    lowest = torch.finfo(kernel.dtype).max
    for step in range(keep):
        # Past the kernel's rank the gains are rounding noise, non-positive or NaN (the official code
        # then picks NaN's index again and again): a token not yet chosen always outranks a chosen one.
        scores = torch.nan_to_num(gains, nan=-lowest, posinf=lowest, neginf=-lowest)
        pick = torch.where(selected, -float("inf"), scores).argmax(dim=1)
        chosen[:, step] = pick
        selected[rows, pick] = True
        row = kernel[rows, pick]  # (B, N)
        if step:
            previous = factors[:step]  # (t, B, N)
            row = row - torch.einsum("tb,tbn->bn", previous[:, rows, pick], previous)
        direction = row / torch.sqrt(gains[rows, pick]).unsqueeze(-1)
        factors[step] = direction
        gains = gains - direction.square()
    return chosen


def cdpruner_select(features: Tensor, image_embeds: Tensor, text: Tensor, keep: int,
                    text_mask: Tensor | None = None) -> Tensor:
    """``(B, keep)`` ascending indices of the tokens the conditional DPP keeps of ``features`` ``(B, N, D)``."""
    if not 1 <= keep <= features.shape[1]:
        raise FicocoError(f"CDPruner keeps 1..{features.shape[1]} tokens per item, got {keep}")
    kernel = conditional_kernel(features, relevance(image_embeds, text, text_mask))
    return greedy_map(kernel, keep).sort(dim=1).values


def cdpruner_reduce(features: Tensor, text: Tensor, keep: int, text_mask: Tensor | None = None
                    ) -> tuple[Tensor, Tensor]:
    """``(features (B, keep, D), kept (B, keep))`` with the relevance in the features' own space (the
    LLM's input space: ficoco's stand-in for the CLIP text tower); ``keep == N`` returns the input."""
    if keep == features.shape[1]:
        return features, torch.arange(keep, device=features.device).expand(features.shape[0], -1)
    kept = cdpruner_select(features, features, text, keep, text_mask)
    return gather_tokens(features, kept), kept


def tower_step(inputs: TowerInput, settings: Mapping[str, Any]) -> TowerOutput:
    """The adapters' call after the projector: ``inputs.hidden`` the projector's output for every patch,
    ``inputs.text`` the LLM's input embeddings of each item's prompt text (``inputs.text_mask``)."""
    if inputs.text is None:
        raise RuntimeError("CDPruner needs the prompt's text embeddings from the adapter")
    features, kept = cdpruner_reduce(inputs.hidden, inputs.text, inputs.hidden.shape[1] - inputs.remove,
                                     inputs.text_mask)
    return TowerOutput(hidden=features, kept=kept)
