"""INT8 (LLM.int8) and INT4 (NF4) weights with bitsandbytes, on CUDA and on x86 CPUs.

A checkpoint is quantized by transformers at load time (`BitsAndBytesConfig`). A random-weight
model is built in 16 bits and its linear layers are swapped for bitsandbytes modules here,
skipping what transformers skips (`get_keys_to_not_convert`: the LM head and tied weights).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from ficoco.errors import FicocoError

QUANTS = ("fp16", "int8", "int4")


def bitsandbytes_config(quant: str, compute_dtype: torch.dtype) -> Any:
    """transformers' BitsAndBytesConfig for `from_pretrained` (None for fp16)."""
    if quant == "fp16":
        return None
    _bitsandbytes()
    from transformers import BitsAndBytesConfig

    if quant == "int8":
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=compute_dtype)


def _bitsandbytes() -> Any:
    # bitsandbytes logs a warning on every INT8 matmul with bf16 inputs (it casts them to
    # fp16, which the report states once) and an optional-kernel notice at import.
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    try:
        import bitsandbytes
    except ImportError as exc:  # pragma: no cover - a dependency of the package
        raise FicocoError(f"bitsandbytes is not installed ({exc}); pip install bitsandbytes") from None
    return bitsandbytes


def quantize_linears_(model: nn.Module, quant: str, *, compute_dtype: torch.dtype) -> dict[str, Any]:
    """Replace the model's nn.Linear layers with bitsandbytes INT8 or NF4 ones, in place."""
    if quant not in ("int8", "int4"):
        raise FicocoError(f"unknown quant '{quant}': choose from {', '.join(QUANTS)}")
    bnb = _bitsandbytes()
    from transformers.quantizers.base import get_keys_to_not_convert

    skip = get_keys_to_not_convert(model)
    converted = 0
    for name, module in list(model.named_modules()):
        if type(module) is not nn.Linear or any(name == s or name.startswith(f"{s}.") for s in skip):
            continue
        device = module.weight.device
        weight = module.weight.data
        if quant == "int8":
            new = bnb.nn.Linear8bitLt(module.in_features, module.out_features, bias=module.bias is not None,
                                      has_fp16_weights=False, threshold=6.0)
            new.weight = bnb.nn.Int8Params(weight, requires_grad=False, has_fp16_weights=False)
        else:
            new = bnb.nn.Linear4bit(module.in_features, module.out_features, bias=module.bias is not None,
                                    compute_dtype=compute_dtype, quant_type="nf4")
            new.weight = bnb.nn.Params4bit(weight, requires_grad=False, quant_type="nf4")
        if module.bias is not None:
            new.bias = nn.Parameter(module.bias.data, requires_grad=False)
        # Moving to the device is what makes bitsandbytes quantize the weight.
        new = new.to(device)
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, attr, new)
        converted += 1
    return {"backend": f"bitsandbytes {bnb.__version__}", "converted_linears": converted, "kept_16bit": skip,
            "scheme": "LLM.int8 (threshold 6.0)" if quant == "int8" else f"NF4, compute {compute_dtype}"}
