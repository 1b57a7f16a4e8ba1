"""Quantized builds: weights quantized at build on any device, no throwaway fp32 layers, the
16-bit layers released as they are replaced, and measured weight bytes equal to the
accountant's (the check that catches unquantized INT8 weights and a double-quantization
mismatch)."""

from __future__ import annotations

import json
import weakref
from pathlib import Path

import bitsandbytes as bnb
import pytest
import torch
from torch import nn

import ficoco
from ficoco.accounting import architecture
from ficoco.accounting.memory import make_quant, weight_bytes
from ficoco.errors import FicocoError
from ficoco.models import quantize
from ficoco.models.build import checkpoint_dtype, resolve_dtype
from ficoco.profiles import load_profile
from ficoco.profiling.trackers import model_weight_bytes

TINY = ["llava-tiny", "llava-gqa-tiny", "llava-next-tiny", "qwen2-vl-tiny", "video-llava-tiny"]
# 7B widths at one decoder and two vision layers: the shapes of every 7B layer, buildable in a test.
SEVEN_B_SHAPES = ["text_config.num_hidden_layers=1", "vision_config.num_hidden_layers=2"]


def bnb_weights(model: nn.Module) -> list[torch.Tensor]:
    return [m.weight for m in model.modules() if isinstance(m, (bnb.nn.Linear8bitLt, bnb.nn.Linear4bit))]


def test_int8_weights_are_quantized_at_build_even_where_moving_them_does_not_quantize(monkeypatch) -> None:
    # On a GPU, Int8Params.to() quantizes only data that comes from the CPU: a model built on
    # the GPU kept 16-bit weights until its first forward. Make .to() behave that way here.
    monkeypatch.setattr(bnb.nn.Int8Params, "to", lambda self, *args, **kwargs: self)
    model = ficoco.build_model("llava-tiny", quant="int8")
    weights = bnb_weights(model)
    assert weights and {w.dtype for w in weights} == {torch.int8}
    assert all(w.SCB is not None and w.SCB.dtype == torch.float32 for w in weights)


def test_nf4_weights_are_quantized_at_build_without_double_quantization() -> None:
    model = ficoco.build_model("llava-tiny", quant="int4")
    weights = bnb_weights(model)
    assert weights and {w.dtype for w in weights} == {torch.uint8}
    assert all(w.bnb_quantized and w.quant_state is not None and not w.quant_state.nested for w in weights)
    assert all(w.quant_state.blocksize == quantize.NF4_BLOCK for w in weights)


@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_bitsandbytes_layers_are_built_without_real_fp32_weights(monkeypatch, quant: str) -> None:
    devices: list[str] = []
    original = nn.Linear.reset_parameters

    def spy(self: nn.Linear) -> None:
        devices.append(self.weight.device.type)
        original(self)

    model = ficoco.build_model("llava-tiny", quant="fp16", dtype="fp32")
    monkeypatch.setattr(nn.Linear, "reset_parameters", spy)
    quantize.quantize_linears_(model, quant, compute_dtype=torch.float32)
    assert devices and set(devices) == {"meta"}  # initialised on meta: no memory, no time


def test_each_16bit_layer_is_released_once_replaced(monkeypatch) -> None:
    model = ficoco.build_model("llava-tiny", dtype="fp32")
    alive = [weakref.ref(m) for m in model.modules() if type(m) is nn.Linear]
    alive_at_each_quantization: list[int] = []
    original = bnb.functional.int8_vectorwise_quant

    def spy(*args, **kwargs):
        alive_at_each_quantization.append(sum(ref() is not None for ref in alive))
        return original(*args, **kwargs)

    monkeypatch.setattr(bnb.functional, "int8_vectorwise_quant", spy)
    quantize.quantize_linears_(model, "int8", compute_dtype=torch.float32)
    converted = len(alive_at_each_quantization)
    assert converted > 10
    # At the k-th layer, the k-1 layers before it are gone (the LM head is never converted).
    assert alive_at_each_quantization[-1] <= len(alive) - converted + 1


def test_an_unquantized_bitsandbytes_layer_is_refused() -> None:
    model = ficoco.build_model("llava-tiny", quant="int8")
    layer = next(m for m in model.modules() if isinstance(m, bnb.nn.Linear8bitLt))
    layer.weight = bnb.nn.Int8Params(torch.zeros(layer.out_features, layer.in_features, dtype=torch.bfloat16),
                                     requires_grad=False, has_fp16_weights=False)
    with pytest.raises(FicocoError, match="did not quantize"):
        quantize.check_quantized(model, "int8")


@pytest.mark.parametrize("quant", ["fp16", "int8", "int4"])
@pytest.mark.parametrize("name", TINY)
def test_measured_weight_bytes_equal_the_accountants_on_every_tiny_profile(name: str, quant: str, arch_of) -> None:
    model = ficoco.build_model(name, quant=quant)  # auto: the dtype depends on this CPU
    measured = model_weight_bytes(model)
    element_bytes = torch.finfo(model._ficoco_dtype.compute).bits / 8
    analytic = weight_bytes(arch_of(name), "all", make_quant(quant), element_bytes=element_bytes)
    assert measured == pytest.approx(analytic, rel=0.005)
    # What is left is the buffers (rotary tables, position ids), which the accountant omits.
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    assert measured - buffers == pytest.approx(analytic, abs=1)


@pytest.mark.shapes_7b
@pytest.mark.parametrize("quant", ["fp16", "int8", "int4"])
def test_measured_weight_bytes_equal_the_accountants_at_7b_shapes(quant: str) -> None:
    model = ficoco.build_model("llava-1.5-7b", quant=quant, dtype="bf16", overrides=list(SEVEN_B_SHAPES))
    measured = model_weight_bytes(model)
    analytic = weight_bytes(architecture(load_profile("llava-1.5-7b", list(SEVEN_B_SHAPES))), "all",
                            make_quant(quant))
    assert measured == pytest.approx(analytic, rel=0.005)
    del model


def test_tied_and_shared_storage_is_counted_once() -> None:
    model = nn.Sequential(nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False))
    model[1].weight = model[0].weight
    assert model_weight_bytes(model) == 16 * 4


def test_a_bf16_checkpoint_stays_bf16_by_default_also_on_a_gpu(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2_vl", "torch_dtype": "bfloat16"}))
    native = checkpoint_dtype(tmp_path)
    assert native == torch.bfloat16
    assert resolve_dtype(None, "cuda", native) == torch.bfloat16  # fp16 would overflow Qwen2-VL
    assert resolve_dtype("auto", "cuda", native) == torch.bfloat16
    assert resolve_dtype(None, "cuda", None) == torch.float16
    assert resolve_dtype("fp16", "cuda", native) == torch.float16  # an explicit choice wins
    assert resolve_dtype("fp16", "cpu", None) == torch.float16  # also on a CPU: no silent bfloat16
