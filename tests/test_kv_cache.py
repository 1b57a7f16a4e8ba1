"""transformers' quantized KV cache (HQQ backend) under FiCoCo, and its bytes (issue 12).

Random seeded tiny models on the CPU. The patched path with an empty schedule must decode
exactly as the unpatched model with the same quantized cache; with a real schedule every
decoder layer's cache must hold the tokens the accountant plans, in the bytes it predicts
(codes, per-group scales and zero points, the unquantized residual window).
"""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
import torch
from torch import nn
from transformers import LlamaConfig

import ficoco
from ficoco.accounting import CONVENTIONS, CountOptions, account, architecture, make_quant
from ficoco.accounting.memory import KV_RESIDUAL_TOKENS, kv_group_size, kv_layer_bytes, stored_kv_cache_bytes
from ficoco.accounting.schedule import Schedule, plan_tokens
from ficoco.api import profile_of
from ficoco.errors import FicocoError
from ficoco.models import synthetic_inputs
from ficoco.models.hf_compat import cache_argument, output_cache
from ficoco.models.kv_cache import cache_config, quantized_cache
from ficoco.profiling.trackers import cache_bytes, cache_tokens

TEXT = 12
NEW = 10
FAMILIES = ("llava-tiny", "llava-gqa-tiny", "qwen2-vl-tiny")  # MHA, GQA (2 kv heads), Qwen2-VL's rotary
_models: dict[tuple[str, str], nn.Module] = {}


def model_of(name: str, dtype: str = "fp32") -> nn.Module:
    if (name, dtype) not in _models:
        _models[(name, dtype)] = ficoco.build_model(name, dtype=dtype)
    return _models[(name, dtype)]


def inputs(model: nn.Module, batch: int = 2) -> dict[str, Any]:
    return synthetic_inputs(model, batch=batch, text_tokens=TEXT, seed=3)


def greedy(model: nn.Module, inp: dict[str, Any], cache: Any, new: int = NEW) -> Any:
    return model.generate(**inp, max_new_tokens=new, min_new_tokens=new, do_sample=False, **cache_argument(cache),
                          return_dict_in_generate=True)


# ---- the patched path with nothing removed is the unpatched model, quantized cache and all ------------------

@pytest.mark.parametrize("kv_bits", [8, 4, 2])
@pytest.mark.parametrize("variant", ["v", "l"])
@pytest.mark.parametrize("name", FAMILIES)
def test_empty_schedule_decodes_like_the_unpatched_model_with_a_quantized_cache(name, variant, kv_bits):
    model = model_of(name)
    inp = inputs(model)
    # A residual window of 4 tokens: the 9 decode steps flush it into the quantized states twice.
    ref = greedy(model, inp, quantized_cache(model, kv_bits, residual_tokens=4))
    with ficoco.apply(model, variant, schedule={}):
        assert "forward" in model.__dict__  # the patched path really runs
        out = greedy(model, inp, quantized_cache(model, kv_bits, residual_tokens=4))
    assert torch.equal(out.sequences, ref.sequences)
    assert cache_tokens(output_cache(out)) == cache_tokens(output_cache(ref))
    assert cache_bytes(output_cache(out)) == cache_bytes(output_cache(ref))
    for mine, theirs in zip(output_cache(out).layers, output_cache(ref).layers, strict=True):
        assert torch.equal(mine._quantized_keys[0], theirs._quantized_keys[0])
        assert torch.equal(mine.keys, theirs.keys)  # the residual window


def test_a_quantized_cache_really_quantizes_and_differs_from_the_full_precision_cache():
    """Guards the test above against a cache that silently stays at full precision."""
    model = model_of("llava-tiny")
    inp = inputs(model, batch=1)
    with torch.inference_mode():
        full = output_cache(model(**inp, use_cache=True))
        quantized = output_cache(model(**inp, use_cache=True, **cache_argument(quantized_cache(model, 2))))
    layer = quantized.layers[0]
    codes, meta = layer._quantized_keys
    assert codes.dtype == torch.uint8 and meta["nbits"] == 2
    restored = layer._dequantize(layer._quantized_keys)
    assert restored.shape == full.layers[0].keys.shape
    assert not torch.equal(restored, full.layers[0].keys)
    assert cache_bytes(quantized) < cache_bytes(full) / 4


# ---- token counts and bytes are the accountant's ---------------------------------------------------------------

def planned_layers(model: nn.Module, name: str, variant: str, keep: int | None) -> tuple[Any, Any, list[int]]:
    """The architecture, (the handle of `variant` applied to `model` or None, the accountant's
    token plan) and the tokens each decoder layer attends over in the prefill."""
    arch = architecture(profile_of(model, name))
    handle = ficoco.apply(model, variant, keep=keep) if variant != "vanilla" else None
    plan = plan_tokens(arch, handle.schedule if handle else Schedule("vanilla"), text_tokens=TEXT)
    return arch, (handle, plan), [n_in for n_in, _ in plan.llm]


@pytest.mark.parametrize("kv_bits", [16, 8, 4, 2])
@pytest.mark.parametrize("variant", ["vanilla", "v", "l"])
@pytest.mark.parametrize("name,dtype", [("llava-tiny", "fp32"), ("llava-gqa-tiny", "bf16"), ("qwen2-vl-tiny", "fp32")])
def test_cache_tokens_and_bytes_equal_the_accountant_after_prefill_and_decode(name, dtype, variant, kv_bits):
    model = model_of(name, dtype)
    element_bytes = torch.finfo(next(model.parameters()).dtype).bits / 8
    arch, (handle, plan), per_layer = planned_layers(model, name, variant, 8)
    batch = 2
    inp = inputs(model, batch=batch)
    try:
        def cache() -> Any:
            return quantized_cache(model, kv_bits) if kv_bits < 16 else None

        with torch.inference_mode():
            prefill = output_cache(model(**inp, use_cache=True, **cache_argument(cache())))
        out = greedy(model, inp, cache(), new=NEW)
    finally:
        if handle is not None:
            handle.remove()
    if variant == "l":
        assert len(set(per_layer)) > 1  # FiCoCo-L really shortens later layers' caches
    bits = kv_bits if kv_bits < 16 else int(element_bytes * 8)
    assert cache_tokens(prefill) == per_layer
    assert cache_bytes(prefill) == stored_kv_cache_bytes(arch, plan, batch=batch, kv_bits=bits,
                                                         element_bytes=element_bytes)
    # generate() feeds back all but the last new token.
    assert cache_tokens(output_cache(out)) == [n + NEW - 1 for n in per_layer]
    assert cache_bytes(output_cache(out)) == stored_kv_cache_bytes(
        arch, plan, batch=batch, kv_bits=bits, element_bytes=element_bytes, decode_steps=NEW - 1)


@pytest.mark.parametrize("kv_bits", [8, 4])
@pytest.mark.parametrize("variant", ["vanilla", "l"])
def test_flops_rows_name_the_measured_cache_kv_cache_stored_bytes_under_every_convention(variant, kv_bits):
    """`ficoco flops` assumes 16-bit compute: a bf16 model's prefill cache is every row's kv_cache_stored_bytes,
    whatever the convention; under llm-viewer the row's kv_cache_bytes is LLM-Viewer's values x kv_bits / 8,
    the measured cache less its scales and zero points."""
    name, batch = "llava-gqa-tiny", 2
    model = model_of(name, "bf16")
    arch, (handle, plan), per_layer = planned_layers(model, name, variant, 8)
    try:
        with torch.inference_mode():
            prefill = output_cache(model(**inputs(model, batch=batch), use_cache=True,
                            **cache_argument(quantized_cache(model, kv_bits))))
    finally:
        if handle is not None:
            handle.remove()
    schedule = handle.schedule if handle is not None else Schedule("vanilla")
    measured = cache_bytes(prefill)
    rows = {convention: account(arch, schedule, make_quant("fp16", kv_bits),
                                CountOptions(convention=convention, batch=batch, text_tokens=TEXT))
            for convention in CONVENTIONS}
    assert {c: row.kv_cache_stored_bytes for c, row in rows.items()} == dict.fromkeys(CONVENTIONS, measured)
    values = 2 * batch * sum(per_layer) * 2 * 16  # 2 kv heads of 16
    groups = values / 16  # gcd(64, 16) values per group, a bf16 scale and zero point each
    assert measured == values * kv_bits / 8 + groups * 2 * 2
    assert rows["llm-viewer"].kv_cache_bytes == values * kv_bits / 8 < measured
    assert all(rows[c].kv_cache_bytes == measured for c in CONVENTIONS if c != "llm-viewer")


@pytest.mark.parametrize("variant", ["vanilla", "l"])
def test_bytes_follow_the_residual_window_across_a_flush(variant):
    """Past KV_RESIDUAL_TOKENS decode steps the window is quantized and starts again."""
    model = model_of("llava-tiny")
    new = KV_RESIDUAL_TOKENS + 3
    arch, (handle, plan), per_layer = planned_layers(model, "llava-tiny", variant, 8)
    try:
        out = greedy(model, inputs(model, batch=1), quantized_cache(model, 4), new=new)
    finally:
        if handle is not None:
            handle.remove()
    steps = new - 1
    assert [layer.keys.shape[-2] for layer in output_cache(out).layers] == [steps % KV_RESIDUAL_TOKENS] * 4
    assert cache_tokens(output_cache(out)) == [n + steps for n in per_layer]
    assert cache_bytes(output_cache(out)) == stored_kv_cache_bytes(arch, plan, batch=1, kv_bits=4,
                                                                     element_bytes=4, decode_steps=steps)


@pytest.mark.shapes_7b
@pytest.mark.parametrize("kv_bits", [8, 4, 2])
def test_a_7b_layer_holds_the_accountants_bytes(kv_bits):
    """LLaVA-1.5-7B's decoder layer (32 kv heads of 128) at its real widths, fed keys and values
    directly (a built 7B model is not needed for one layer's cache)."""
    config = LlamaConfig(num_hidden_layers=1, hidden_size=4096, num_attention_heads=32, num_key_value_heads=32,
                         intermediate_size=16, vocab_size=16)
    holder = type("Holder", (), {"config": config})()
    cache = quantized_cache(holder, kv_bits, residual_tokens=KV_RESIDUAL_TOKENS)
    tokens, steps = 160, 3
    generator = torch.Generator().manual_seed(0)

    def states(n: int) -> torch.Tensor:
        return torch.randn(1, 32, n, 128, generator=generator, dtype=torch.bfloat16)

    cache.update(states(tokens), states(tokens), 0)
    for _ in range(steps):
        cache.update(states(1), states(1), 0)
    expected = kv_layer_bytes(tokens + steps, batch=1, kv_heads=32, head_dim=128, kv_bits=kv_bits, element_bytes=2,
                              decode_steps=steps)
    assert cache_bytes(cache) == expected
    # 64-value groups: one bf16 scale and zero point per 64 codes, and 3 residual tokens at 16 bits.
    assert expected == (2 * 32 * 160 * 128 * kv_bits / 8 + 2 * 2 * 32 * 160 * 128 / 64 * 2 + 2 * 32 * 3 * 128 * 2)


def test_group_size_divides_every_head_dimension():
    assert [kv_group_size(d) for d in (16, 64, 80, 96, 128, 256)] == [16, 64, 16, 32, 64, 64]
    model = model_of("llava-tiny")
    assert cache_config(model, 4)["q_group_size"] == 16  # llava-tiny: 64 wide, 4 heads


def test_unknown_bits_and_a_missing_backend_are_one_clear_error(monkeypatch):
    model = model_of("llava-tiny")
    with pytest.raises(FicocoError, match="8, 4 or 2"):
        quantized_cache(model, 3)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "hqq" else real(name, *a))
    with pytest.raises(FicocoError, match="pip install hqq"):
        quantized_cache(model, 4)
