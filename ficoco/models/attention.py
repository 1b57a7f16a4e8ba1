"""Attention probabilities only where a layer reduces.

Every other layer keeps the model's attention implementation (SDPA by default). A reducing
layer's attention module is pointed at `ficoco_probe`, an attention function registered with
transformers' `AttentionInterface`: it computes the layer's output from the probabilities it
needs anyway (one pass, no second forward) and leaves their head mean, and the key states
when asked, in the module's probe slot for the reduction to read.
"""

from __future__ import annotations

import copy
import sys
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from transformers import AttentionInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

PROBE_IMPLEMENTATION = "ficoco_probe"


@dataclass
class ProbeSlot:
    """What the probe leaves for one forward of one attention module."""

    want_keys: bool = False
    armed: bool = True  # when False the module runs its own implementation (e.g. decode steps)
    attn: Tensor | None = None  # (B, Tq, Tk) head-mean probabilities, float32
    keys: Tensor | None = None  # (B, H, Tk, d) key states (after rotary), when want_keys

    def take(self) -> tuple[Tensor, Tensor | None]:
        if self.attn is None:
            raise RuntimeError("the reducing layer's attention did not run through the FiCoCo probe")
        attn, keys = self.attn, self.keys
        self.attn = self.keys = None
        return attn, keys


def _apply_mask(scores: Tensor, mask: Tensor | None, causal: bool) -> Tensor:
    q_len, k_len = scores.shape[-2:]
    if mask is not None:
        mask = mask[..., :k_len]
        if mask.dtype == torch.bool:
            return scores.masked_fill(~mask, float("-inf"))
        return scores + mask.to(scores.dtype)
    if causal and q_len > 1:
        # Queries are the last q_len positions of the k_len keys.
        offset = k_len - q_len
        rows = torch.arange(q_len, device=scores.device)[:, None] + offset
        cols = torch.arange(k_len, device=scores.device)[None, :]
        return scores.masked_fill(cols > rows, float("-inf"))
    return scores


def probe_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                    dropout: float = 0.0, scaling: float | None = None, is_causal: bool | None = None,
                    **kwargs: object) -> tuple[Tensor, None]:
    """Eager attention that keeps the head-mean probabilities in `module._ficoco_probe`."""
    slot: ProbeSlot = module._ficoco_probe  # type: ignore[assignment]
    if not slot.armed:
        own = module._ficoco_original_config._attn_implementation  # type: ignore[union-attr]
        # "eager" is not in the registry: each model file has its own eager function.
        eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
        implementation = ALL_ATTENTION_FUNCTIONS.get_interface(own, eager)
        return implementation(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                              is_causal=is_causal, **kwargs)
    groups = query.shape[1] // key.shape[1]
    keys = key.repeat_interleave(groups, dim=1) if groups > 1 else key
    values = value.repeat_interleave(groups, dim=1) if groups > 1 else value
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    causal = is_causal if is_causal is not None else bool(getattr(module, "is_causal", False))
    # Softmax in float32, as the eager paths of transformers do.
    scores = torch.matmul(query, keys.transpose(-1, -2)).float() * scale
    probs = torch.softmax(_apply_mask(scores, attention_mask, causal), dim=-1)
    probs = torch.nan_to_num(probs)  # fully masked rows (padding queries) give zeros, not NaN
    output = torch.matmul(probs.to(values.dtype), values).transpose(1, 2).contiguous()
    slot.attn = probs.mean(dim=1)
    slot.keys = key if slot.want_keys else None
    return output, None


AttentionInterface.register(PROBE_IMPLEMENTATION, probe_attention)


def install_probe(attention: nn.Module, *, want_keys: bool = False, armed: bool = True) -> ProbeSlot:
    """Route one attention module through the probe (its own config copy; the model's stays)."""
    slot = ProbeSlot(want_keys=want_keys, armed=armed)
    attention._ficoco_original_config = attention.config  # type: ignore[assignment]
    probe_config = copy.copy(attention.config)
    probe_config._attn_implementation_internal = PROBE_IMPLEMENTATION
    attention.config = probe_config
    attention._ficoco_probe = slot  # type: ignore[assignment]
    return slot


def remove_probe(attention: nn.Module) -> None:
    """Restore the module's own config and attention implementation."""
    attention.config = attention._ficoco_original_config
    del attention._ficoco_original_config
    del attention._ficoco_probe
