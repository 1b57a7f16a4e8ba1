"""VTW, visual tokens withdrawal (lzhxmu/VTW @ a3d8cfc): every visual token leaves at the input of decoder layer K.

The official rule (llava/model/language_model/VTW.py:308-314, the `pe_type == "keep"` branch, prefill only):

    hidden_states = cat([hidden_states[:, :35], hidden_states[:, 35 + 576:]], dim=1)
    position_ids  = cat([position_ids[:, :35],  position_ids[:, 35 + 576:]],  dim=1)

before layer K runs; layers K and later run, and cache, the text alone. The text keeps its original position ids
(gaps where the image was), and decode positions continue from the full length (generate counts them from the
attention mask, which the official code leaves unsliced). The other `pe_type` branch (:322-328) re-packs the ids
after the withdrawal (``position_ids[:, :len]``) and continues decoding from layer K's cache length: ficoco's
"compact" scheme (`positions="compact"`).

Departures, for batching and correctness only (docs/methods/vtw.md): the span is found from each sample's image
placeholders instead of the hard-coded 35 and 576 (which fit only LLaVA-1.5's template with one image); the
padding mask is sliced with the tokens (the official default path leaves it unsliced, which only SDPA/FA2 without
padding survive); several image spans of a prompt all leave. Nothing is scored, so there are no ties.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from ficoco.errors import FicocoError
from ficoco.methods.inputs import Reduced, StepInput
from ficoco.methods.ops import check_span, rebuild

__all__ = ["step", "withdraw", "withdrawal_kl"]


def withdraw(hidden: Tensor, visual_start: Tensor, num_visual: int, position_ids: Tensor,
             attention_mask: Tensor | None = None, positions: str = "original") -> Reduced:
    """Every sample's sequence without its ``num_visual`` visual tokens (``[prefix, suffix]``).

    Args:
        hidden: ``(B, T, D)`` the input of layer K.
        visual_start: ``(B,)`` where each sample's visual span starts; num_visual: ``N`` tokens in it.
        position_ids: ``(B, T)`` the input's position ids.
        attention_mask: optional ``(B, T)`` 2-D padding mask, sliced alike.
        positions: ``"original"`` (the text keeps its ids, the official ``pe_type="keep"``) or ``"compact"`` (the
            suffix's ids move down by ``N``, the official other ``pe_type``).

    Returns:
        A :class:`~ficoco.methods.inputs.Reduced` holding no visual token (``num_visual == 0``); the text tokens are
        copied bit for bit.
    """
    check_span(hidden, visual_start, num_visual)
    none_kept = torch.empty(hidden.shape[0], 0, dtype=torch.long, device=hidden.device)
    return rebuild(hidden, none_kept, visual_start.to(hidden.device), num_visual, position_ids, positions,
                   attention_mask)


def step(inputs: StepInput, settings: Mapping[str, Any]) -> Reduced:
    """The model adapters' call at layer K's input: withdraw every visual token."""
    if inputs.keep != 0:
        raise FicocoError(f"VTW withdraws every visual token at its layer; a schedule keeping {inputs.keep} of "
                          f"{inputs.num_visual} is not VTW's: give K as the layer hyperparameter (or keep=, the "
                          "layer average)")
    return withdraw(inputs.hidden, inputs.visual_start, inputs.num_visual, inputs.position_ids, inputs.attention_mask,
                    settings.get("positions", "original"))


def withdrawal_kl(full_logits: Tensor, withdrawn_logits: Tensor) -> Tensor:
    """``(B,)`` KL(p_K || p_full) in nats: how far withdrawing at K moves the next-token distribution of the last
    token, the distribution with the withdrawal weighing the log ratio. The official search's
    ``nn.KLDivLoss(reduction='batchmean')(log_softmax(full), softmax(withdrawn))`` at batch 1 (VTW.py:105-106),
    here per sample and in float64.

    Args:
        full_logits: ``(B, V)`` the last position's logits of the forward with every token.
        withdrawn_logits: ``(B, V)`` those of the forward withdrawing at K.
    """
    log_full = torch.log_softmax(full_logits.double(), dim=-1)
    log_withdrawn = torch.log_softmax(withdrawn_logits.double(), dim=-1)
    return (log_withdrawn.exp() * (log_withdrawn - log_full)).sum(dim=-1)
