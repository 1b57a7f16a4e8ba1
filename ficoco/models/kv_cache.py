"""transformers' quantized KV cache, as ficoco runs it: `QuantizedCache` with the HQQ backend.

Why HQQ and not optimum-quanto (both are backends of transformers' QuantizedCache): the quanto
layer of transformers 5 accepts 2 and 4 bits only (it raises for 8), while the HQQ layer takes
8, 4 and 2; HQQ's quantizer is plain torch (packing included), so the same code runs on the CPU
and on CUDA with no compiled kernel. The layout (group size, residual window) is the
accountant's (ficoco.accounting.memory), so the measured bytes and the analytic ones describe
the same cache.

Every decoder layer of a QuantizedCache keeps its own length, so FiCoCo-L's shortened layers
(a layer after a reducing one caches fewer tokens) need nothing special: each layer quantizes
what it holds, and the mask a decode step sees is sliced per layer by the patches.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from torch import nn

from ficoco.accounting.memory import KV_QUANT_BITS, KV_RESIDUAL_TOKENS, kv_group_size
from ficoco.errors import FicocoError

BACKEND = "hqq"


def check_backend() -> None:
    """A FicocoError (one line, what to do) when the HQQ backend is not installed."""
    if importlib.util.find_spec("hqq") is None:
        raise FicocoError("kv_bits=: transformers' quantized KV cache needs the hqq package, a ficoco dependency "
                          "that is not installed here (pip install hqq)")


def cache_config(model: nn.Module, kv_bits: int, residual_tokens: int = KV_RESIDUAL_TOKENS) -> dict[str, Any]:
    """QuantizedCache's arguments for `model` at `kv_bits` (8, 4 or 2)."""
    if kv_bits not in KV_QUANT_BITS:
        raise FicocoError(f"kv_bits={kv_bits}: the quantized KV cache stores 8, 4 or 2 bits")
    text = model.config.get_text_config(decoder=True)
    if "linear_attention" in (getattr(text, "layer_types", None) or ()):
        # transformers' QuantizedCache builds full-attention layers only (it refuses a hybrid config).
        raise FicocoError(f"kv_bits={kv_bits}: transformers' quantized cache holds full-attention layers only, and "
                          "this decoder's Gated DeltaNet layers keep a recurrent state; run it without kv_bits")
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    # axis 0 is transformers' default; a group must divide every tensor HQQ quantizes
    # (batch x kv heads x tokens x head_dim values), which a divisor of head_dim always does.
    return {"backend": BACKEND, "nbits": kv_bits, "axis_key": 0, "axis_value": 0,
            "q_group_size": kv_group_size(head_dim), "residual_length": residual_tokens}


def quantized_cache(model: nn.Module, kv_bits: int, residual_tokens: int = KV_RESIDUAL_TOKENS) -> Any:
    """A fresh, empty QuantizedCache for one forward or generate() call of `model`."""
    from ficoco.models.hf_compat import new_quantized_cache

    check_backend()
    return new_quantized_cache(model.config, **cache_config(model, kv_bits, residual_tokens))

