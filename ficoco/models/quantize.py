"""INT8 (LLM.int8) and INT4 (NF4) weights with bitsandbytes, on CUDA and on x86 CPUs.

A checkpoint is quantized by transformers at load time (`BitsAndBytesConfig`). A random-weight
model is built in 16 bits and its linear layers are swapped for bitsandbytes modules here,
skipping what transformers skips (`get_keys_to_not_convert`: the LM head and tied weights).

Quantization happens here, explicitly, on whatever device the model was built on.
bitsandbytes' own `Int8Params.to()` quantizes only when the data comes from the CPU, so a
model built on a GPU would keep 16-bit weights until its first forward quantized them lazily
(the first measured row would then carry 16-bit weights and the quantization time).
"""

from __future__ import annotations

import gc
import logging
from typing import Any

import torch
from torch import nn

from ficoco.errors import FicocoError

QUANTS = ("fp16", "int8", "int4")
# The same NF4 layout as a checkpoint loaded with BitsAndBytesConfig(load_in_4bit=True,
# bnb_4bit_quant_type="nf4") and as the accountant: 64-weight blocks, fp32 absmax, no double
# quantization.
NF4_BLOCK = 64


def bitsandbytes_config(quant: str, compute_dtype: torch.dtype) -> Any:
    """transformers' BitsAndBytesConfig for `from_pretrained` (None for fp16)."""
    if quant == "fp16":
        return None
    _bitsandbytes()
    from transformers import BitsAndBytesConfig

    if quant == "int8":
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=compute_dtype,
                              bnb_4bit_use_double_quant=False)


def _bitsandbytes() -> Any:
    # bitsandbytes logs a warning on every INT8 matmul with bf16 inputs (it casts them to
    # fp16, which the report states once) and an optional-kernel notice at import.
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    try:
        import bitsandbytes
    except ImportError as exc:  # pragma: no cover - a dependency of the package
        raise FicocoError(f"bitsandbytes is not installed ({exc}); pip install bitsandbytes") from None
    return bitsandbytes


def _int8_linear(bnb: Any, linear: nn.Linear) -> nn.Module:
    # Built on the meta device: the constructor's own fp32 weight (allocated and initialised
    # by nn.Linear, then thrown away) cost ~75 s per 7B build on one thread.
    new = bnb.nn.Linear8bitLt(linear.in_features, linear.out_features, bias=linear.bias is not None,
                              has_fp16_weights=False, threshold=6.0, device="meta")
    # LLM.int8's row-wise absmax quantization, run on the weight's own device.
    rows, scales, _ = bnb.functional.int8_vectorwise_quant(linear.weight.data.to(torch.float16).contiguous())
    new.weight = bnb.nn.Int8Params(rows, requires_grad=False, has_fp16_weights=False, CB=rows, SCB=scales)
    return new


def _nf4_linear(bnb: Any, linear: nn.Linear, compute_dtype: torch.dtype) -> nn.Module:
    new = bnb.nn.Linear4bit(linear.in_features, linear.out_features, bias=linear.bias is not None,
                            compute_dtype=compute_dtype, compress_statistics=False, quant_type="nf4", device="meta")
    weight = bnb.nn.Params4bit(linear.weight.data, requires_grad=False, quant_type="nf4", blocksize=NF4_BLOCK,
                               compress_statistics=False, module=new)
    # `_quantize` on the weight's own device (Params4bit.to() would too, but only as a side
    # effect of a move).
    new.weight = weight._quantize(linear.weight.device)
    return new


def _skipped(name: str, skip: list[str]) -> bool:
    return any(name == s or name.startswith(f"{s}.") for s in skip)


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, attr, new)


def _quantized(bnb: Any, linear: nn.Linear, quant: str, compute_dtype: torch.dtype) -> nn.Module:
    new = _int8_linear(bnb, linear) if quant == "int8" else _nf4_linear(bnb, linear, compute_dtype)
    if linear.bias is not None:
        new.bias = nn.Parameter(linear.bias.data, requires_grad=False)
    return new


class Quantizer:
    """Quantizes a model's linear layers one at a time as a build materialises them
    (`quantizer(model, ...)(name, module)`), so the build never holds the whole model in 16
    or 32 bits; skips what transformers skips. For fp16 it does nothing."""

    def __init__(self, model: nn.Module, quant: str, compute_dtype: torch.dtype) -> None:
        if quant not in QUANTS:
            raise FicocoError(f"unknown quant '{quant}': choose from {', '.join(QUANTS)}")
        self.model, self.quant, self.compute_dtype = model, quant, compute_dtype
        self.converted = 0
        self.bnb: Any = None
        self.skip: list[str] = []
        if quant != "fp16":
            self.bnb = _bitsandbytes()
            from ficoco.models.hf_compat import keys_to_not_convert

            self.skip = keys_to_not_convert(model)

    def __call__(self, name: str, module: nn.Module) -> None:
        if self.bnb is None or type(module) is not nn.Linear or _skipped(name, self.skip):
            return
        _replace(self.model, name, _quantized(self.bnb, module, self.quant, self.compute_dtype))
        self.converted += 1

    def info(self) -> dict[str, Any]:
        return {"backend": f"bitsandbytes {self.bnb.__version__}", "converted_linears": self.converted,
                "kept_16bit": self.skip,
                "scheme": "LLM.int8 (threshold 6.0)" if self.quant == "int8" else f"NF4, compute {self.compute_dtype}"}


def quantizer(model: nn.Module, quant: str, *, compute_dtype: torch.dtype) -> Quantizer:
    """A Quantizer for `model` (built, or with its parameters still on the meta device)."""
    return Quantizer(model, quant, compute_dtype)


def quantize_linears_(model: nn.Module, quant: str, *, compute_dtype: torch.dtype) -> dict[str, Any]:
    """Replace the model's nn.Linear layers with bitsandbytes INT8 or NF4 ones, in place.

    Each 16-bit layer is released as soon as its replacement is in place, so the build peaks
    at the quantized model plus one 16-bit layer, not at both models.
    """
    if quant not in ("int8", "int4"):
        raise FicocoError(f"unknown quant '{quant}': choose from {', '.join(QUANTS)}")
    convert = quantizer(model, quant, compute_dtype=compute_dtype)
    # Names only: a list of the modules themselves would keep every 16-bit layer alive.
    names = [name for name, module in model.named_modules() if type(module) is nn.Linear]
    for name in names:
        convert(name, model.get_submodule(name))
    gc.collect()
    check_quantized(model, quant)
    return convert.info()


def check_quantized(model: nn.Module, quant: str) -> int:
    """Every bitsandbytes layer holds quantized storage (int8 rows with their scales, or NF4
    packed in uint8 with its quant state) on a real device; returns how many there are."""
    if quant == "fp16":
        return 0
    bnb = _bitsandbytes()
    kind = bnb.nn.Linear8bitLt if quant == "int8" else bnb.nn.Linear4bit
    layers = [(name, m) for name, m in model.named_modules() if isinstance(m, kind)]
    if not layers:
        raise FicocoError(f"{quant}: the model has no bitsandbytes {kind.__name__} layers after quantization")
    for name, layer in layers:
        weight = layer.weight
        if weight.device.type == "meta":
            raise FicocoError(f"{quant}: {name} has no weight storage (meta device) after quantization")
        if quant == "int8":
            # The scales move from the weight to the layer's state at its first forward.
            scales = getattr(weight, "SCB", None)
            if scales is None:
                scales = getattr(getattr(layer, "state", None), "SCB", None)
            ok = weight.dtype == torch.int8 and scales is not None
        else:
            ok = weight.dtype == torch.uint8 and getattr(weight, "quant_state", None) is not None
        if not ok:
            raise FicocoError(f"{quant}: {name} holds {weight.dtype} weights after quantization; "
                              "bitsandbytes did not quantize it")
    return len(layers)
