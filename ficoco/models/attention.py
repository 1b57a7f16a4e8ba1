"""Attention probabilities only where a layer reduces.

Every other layer keeps the model's attention implementation (SDPA by default). A reducing
layer's attention module is pointed at `ficoco_probe`, an attention function registered with
transformers' `AttentionInterface`: it computes the layer's output from the probabilities it
needs anyway (one pass, no second forward) and leaves their head mean, and the key states
when asked, in the module's probe slot for the reduction to read.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ficoco.errors import FicocoError
from ficoco.models import hf_compat as hf

PROBE_IMPLEMENTATION = "ficoco_probe"


# The patches slice 4-D masks and route reducing layers through an eager probe; flash and flex
# attention take other mask forms (none, or block masks) that the patches cannot slice.
SUPPORTED_ATTENTION = ("sdpa", "eager")


def check_attention_implementation(model: nn.Module) -> None:
    """Refuse, at apply(), attention implementations the patches cannot serve."""
    config = getattr(model, "config", None)
    configs = [config] + [getattr(config, key, None) for key in ("text_config", "vision_config")]
    for sub in filter(None, configs):
        implementation = hf.attention_implementation(sub)
        if implementation is not None and implementation not in SUPPORTED_ATTENTION:
            raise FicocoError(f"attn_implementation '{implementation}' is not supported by the FiCoCo patches; "
                              f"load the model with attn_implementation='sdpa' (or 'eager')")


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
    timer: Any = None  # a StageTimer: the probe's time goes into its "probe" span

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


# Elements of float32 scores one chunk of the probe may hold. CPU: 64 MB, which keeps the
# working set near the caches; CUDA: 1 GiB, so LLaVA-NeXT's ~2,900-token sequences run in a
# few large matmuls instead of dozens of launch-bound small ones.
SCORE_BUDGET_ELEMENTS = {"cpu": 1 << 24, "cuda": 1 << 28}


def probe_chunks(batch: int, heads: int, q_len: int, k_len: int, budget: int) -> tuple[int, int, int]:
    """Steps over (batch, heads, query rows) so that one chunk holds at most `budget` scores
    (or one query row of one head, when even that is larger)."""
    if q_len * k_len > budget:
        return 1, 1, max(1, budget // max(1, k_len))
    head_step = min(heads, budget // (q_len * k_len))
    if head_step < heads:
        return 1, head_step, q_len
    return max(1, min(batch, budget // (heads * q_len * k_len))), heads, q_len


def _chunk_mask(mask: Tensor | None, rows: slice, queries: slice, k_len: int, q_len: int, causal: bool,
                device: torch.device) -> Tensor | None:
    """The additive or boolean mask of one chunk; a causal pattern when no mask was given."""
    if mask is not None:
        batch_rows = rows if mask.shape[0] > 1 else slice(None)
        query_rows = queries if mask.shape[-2] > 1 else slice(None)
        return mask[batch_rows, ..., query_rows, :k_len]
    if causal and q_len > 1:
        # Query i (of the last q_len positions of the k_len keys) sees keys j <= i + k_len - q_len.
        query_pos = torch.arange(queries.start, queries.stop, device=device).unsqueeze(1) + (k_len - q_len)
        return torch.arange(k_len, device=device).unsqueeze(0) <= query_pos
    return None


def own_attention(module: nn.Module, own_config: Any, query: Tensor, key: Tensor, value: Tensor,
                  attention_mask: Tensor | None, **kwargs: Any) -> tuple[Tensor, Any]:
    """The module's own attention implementation (the one `own_config` names), for a routed module
    whose config copy points at one of ficoco's registered functions."""
    implementation = hf.attention_function(module, hf.attention_implementation(own_config))
    return implementation(module, query, key, value, attention_mask, **kwargs)


def route_attention(attention: nn.Module, implementation: str, patches: Any, config_attribute: str,
                    **attributes: Any) -> None:
    """Route one attention module through a registered `implementation` via its own config copy
    (the model's config stays): the original config is kept under `config_attribute`, with the
    other `attributes` (a slot), and `patches` undoes all of it."""
    original = attention.config
    config = copy.copy(original)
    hf.set_attention_implementation(config, implementation)
    patches.set(attention, config_attribute, original)
    for name, value in attributes.items():
        patches.set(attention, name, value)
    patches.set(attention, "config", config)


def probe_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                    dropout: float = 0.0, scaling: float | None = None, is_causal: bool | None = None,
                    **kwargs: object) -> tuple[Tensor, None]:
    """Eager attention that keeps the head-mean probabilities in `module._ficoco_probe`."""
    slot: ProbeSlot = module._ficoco_probe  # type: ignore[assignment]
    if not slot.armed:
        return own_attention(module, module._ficoco_original_config, query, key, value, attention_mask,
                             dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs)
    timer = slot.timer
    # A module whose own implementation is eager returns its attention matrix (what
    # output_attentions collects): return the one this layer computed, every head.
    own_config = getattr(module, "_ficoco_original_config", None)
    weights = own_config is not None and hf.attention_implementation(own_config) == "eager"
    with timer.span("probe", query.device) if timer is not None else contextlib.nullcontext():
        output, attn, per_head = attention_with_probabilities(module, query, key, value, attention_mask, scaling,
                                                               is_causal, keep_heads=weights)
    keys = key if slot.want_keys else None
    if slot.chunks is not None:
        slot.chunks.append((attn, keys))
    else:
        slot.attn, slot.keys = attn, keys
    return output, per_head


def attention_with_probabilities(module: nn.Module, query: Tensor, key: Tensor, value: Tensor,
                                  attention_mask: Tensor | None, scaling: float | None,
                                  is_causal: bool | None, keep_heads: bool = False
                                  ) -> tuple[Tensor, Tensor, Tensor | None]:
    """(B, T, H, d) attention output, (B, Tq, Tk) head-mean float32 probabilities and, with
    `keep_heads`, the (B, H, Tq, Tk) probabilities of every head in the query's dtype."""
    batch, heads, q_len, head_dim = query.shape
    k_len = key.shape[2]
    groups = heads // key.shape[1]
    scale = scaling if scaling is not None else head_dim**-0.5
    causal = is_causal if is_causal is not None else bool(getattr(module, "is_causal", False))
    budget = SCORE_BUDGET_ELEMENTS.get(query.device.type, SCORE_BUDGET_ELEMENTS["cpu"])
    batch_step, head_step, query_step = probe_chunks(batch, heads, q_len, k_len, budget)
    output = torch.empty(batch, heads, q_len, value.shape[-1], dtype=value.dtype, device=value.device)
    attn_sum = torch.zeros(batch, q_len, k_len, dtype=torch.float32, device=query.device)
    per_head = torch.empty(batch, heads, q_len, k_len, dtype=query.dtype, device=query.device) if keep_heads else None
    for b0 in range(0, batch, batch_step):
        rows = slice(b0, min(b0 + batch_step, batch))
        for h0 in range(0, heads, head_step):
            h1 = min(h0 + head_step, heads)
            if groups == 1:
                k, v = key[rows, h0:h1], value[rows, h0:h1]
            else:  # grouped-query attention: each KV head serves `groups` query heads
                kv = torch.arange(h0, h1, device=key.device) // groups
                k, v = key[rows][:, kv], value[rows][:, kv]
            for q0 in range(0, q_len, query_step):
                queries = slice(q0, min(q0 + query_step, q_len))
                # Scores and softmax in float32, as transformers' eager paths do.
                scores = torch.matmul((query[rows, h0:h1, queries] * scale).float(), k.float().transpose(-1, -2))
                mask = _chunk_mask(attention_mask, rows, queries, k_len, q_len, causal, query.device)
                if mask is not None:
                    if mask.dtype == torch.bool:
                        scores.masked_fill_(~mask, float("-inf"))
                    else:
                        scores.add_(mask.to(scores.dtype))
                probs = torch.softmax(scores, dim=-1)
                if attention_mask is not None:
                    # A fully masked (padding) query row gives NaN; zero it without asking the
                    # host whether one exists (that question would synchronise the device).
                    probs = torch.nan_to_num_(probs)
                output[rows, h0:h1, queries] = torch.matmul(probs.to(value.dtype), v)
                attn_sum[rows, queries] += probs.sum(dim=1)
                if per_head is not None:
                    per_head[rows, h0:h1, queries] = probs.to(per_head.dtype)
    return output.transpose(1, 2).contiguous(), attn_sum.div_(heads), per_head


hf.register_attention(PROBE_IMPLEMENTATION, probe_attention)


def install_probe(attention: nn.Module, *, want_keys: bool = False, armed: bool = True,
                  chunked: bool = False, timer: Any = None) -> ProbeSlot:
    """Route one attention module through the probe (its own config copy; the model's stays).
    `chunked` keeps every call's result (`ProbeSlot.take_chunks`), not the last call's alone;
    `timer` (a StageTimer) times every armed call in its "probe" span."""
    slot = ProbeSlot(want_keys=want_keys, armed=armed, chunks=[] if chunked else None, timer=timer)
    attention._ficoco_original_config = attention.config  # type: ignore[assignment]
    probe_config = copy.copy(attention.config)
    hf.set_attention_implementation(probe_config, PROBE_IMPLEMENTATION)
    attention.config = probe_config
    attention._ficoco_probe = slot  # type: ignore[assignment]
    return slot


def remove_probe(attention: nn.Module) -> None:
    """Restore the module's own config and attention implementation."""
    attention.config = attention._ficoco_original_config
    del attention._ficoco_original_config
    del attention._ficoco_probe
