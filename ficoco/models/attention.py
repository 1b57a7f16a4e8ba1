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
    # A module that calls its attention function once per segment (Qwen2-VL's vision attention:
    # once per image) leaves one (attn, keys) per call here; None: only the last call's, above.
    chunks: list[tuple[Tensor, Tensor | None]] | None = None

    def take(self) -> tuple[Tensor, Tensor | None]:
        if self.attn is None:
            raise RuntimeError("the reducing layer's attention did not run through the FiCoCo probe")
        attn, keys = self.attn, self.keys
        self.attn = self.keys = None
        return attn, keys

    def take_chunks(self) -> list[tuple[Tensor, Tensor | None]]:
        """Every call's (attn, keys) since the last take, in call order (a chunked slot)."""
        if not self.chunks:
            raise RuntimeError("the reducing layer's attention did not run through the FiCoCo probe")
        chunks, self.chunks = self.chunks, []
        return chunks


def _mask_scores_(scores: Tensor, mask: Tensor | None, causal: bool) -> bool:
    """Apply the attention mask to `scores` in place; True when some query row may be fully
    masked (padding), so the softmax can produce NaN rows that must be zeroed."""
    q_len, k_len = scores.shape[-2:]
    if mask is not None:
        mask = mask[..., :k_len]
        if mask.dtype == torch.bool:
            scores.masked_fill_(~mask, float("-inf"))
            return bool((~mask).all(dim=-1).any())
        scores.add_(mask.to(scores.dtype))
        return bool(torch.isinf(mask).all(dim=-1).any()) if mask.is_floating_point() else False
    if causal and q_len > 1:
        # Queries are the last q_len positions of the k_len keys.
        future = torch.ones(q_len, k_len, dtype=torch.bool, device=scores.device).triu_(k_len - q_len + 1)
        scores.masked_fill_(future, float("-inf"))
    return False


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
    batch, heads, q_len, head_dim = query.shape
    k_len = key.shape[2]
    groups = heads // key.shape[1]
    scale = scaling if scaling is not None else head_dim**-0.5
    causal = is_causal if is_causal is not None else bool(getattr(module, "is_causal", False))
    # Heads go in chunks of at most 16M float32 scores (64 MB), which bounds the probe's memory
    # on long sequences (LLaVA-NeXT: ~2,900 tokens) while LLaVA-1.5 runs in one chunk.
    chunk = max(1, min(heads, (1 << 24) // max(1, batch * q_len * k_len)))
    output = torch.empty(batch, heads, q_len, value.shape[-1], dtype=value.dtype, device=value.device)
    attn_sum = torch.zeros(batch, q_len, k_len, dtype=torch.float32, device=query.device)
    may_be_empty = False
    for first in range(0, heads, chunk):
        last = min(first + chunk, heads)
        if groups == 1:
            k, v = key[:, first:last], value[:, first:last]
        else:  # grouped-query attention: each KV head serves `groups` query heads
            kv = torch.arange(first, last, device=key.device) // groups
            k, v = key[:, kv], value[:, kv]
        # Scores and softmax in float32, as transformers' eager paths do.
        scores = torch.matmul((query[:, first:last] * scale).float(), k.float().transpose(-1, -2))
        may_be_empty = _mask_scores_(scores, attention_mask, causal) or may_be_empty
        probs = torch.softmax(scores, dim=-1)
        if may_be_empty:
            probs = torch.nan_to_num_(probs)  # fully masked (padding) rows give zeros, not NaN
        output[:, first:last] = torch.matmul(probs.to(value.dtype), v)
        attn_sum += probs.sum(dim=1)
    attn, keys = attn_sum.div_(heads), (key if slot.want_keys else None)
    if slot.chunks is not None:
        slot.chunks.append((attn, keys))
    else:
        slot.attn, slot.keys = attn, keys
    return output.transpose(1, 2).contiguous(), None


AttentionInterface.register(PROBE_IMPLEMENTATION, probe_attention)


def install_probe(attention: nn.Module, *, want_keys: bool = False, armed: bool = True,
                  chunked: bool = False) -> ProbeSlot:
    """Route one attention module through the probe (its own config copy; the model's stays).
    `chunked` keeps every call's result (`ProbeSlot.take_chunks`), not the last call's alone."""
    slot = ProbeSlot(want_keys=want_keys, armed=armed, chunks=[] if chunked else None)
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
