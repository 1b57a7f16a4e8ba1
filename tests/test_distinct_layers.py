"""--distinct-layers: a decoder deeper than memory runs at its full depth, its deeper layers sharing the weights of
layer i mod N (models/build.py's share_decoder_layers_), which the memory guard, the report and its check count."""

from __future__ import annotations

import pytest
import torch

from ficoco.errors import FicocoError
from ficoco.machine.dtype_choice import DtypeChoice
from ficoco.machine.memory_guard import VanillaRow, memory_need_bytes, shared_weight_bytes
from ficoco.models.build import build_model
from ficoco.profiles import load_profile
from ficoco.profiling.trackers import model_weight_bytes

BF16 = DtypeChoice(torch.bfloat16, torch.bfloat16, "")


def test_deeper_layers_share_the_weights_of_layer_i_mod_n_and_keep_their_own_modules() -> None:
    model = build_model("qwen3.5-tiny", dtype="bf16", distinct_layers=4)
    layers = model.get_decoder().layers
    assert len(layers) == 8
    for index in range(4, 8):
        own, source = dict(layers[index].named_parameters()), dict(layers[index % 4].named_parameters())
        assert own.keys() == source.keys()
        assert all(own[name] is source[name] for name in own)
        assert layers[index] is not layers[index % 4]  # its own module: its own index in the KV cache
    assert not any(p is q for p, q in zip(layers[0].parameters(), layers[1].parameters(), strict=True))
    separate = build_model("qwen3.5-tiny", dtype="bf16")
    from ficoco.accounting import architecture

    arch = architecture(load_profile("qwen3.5-tiny"))
    assert model_weight_bytes(model) == model_weight_bytes(separate) - shared_weight_bytes(arch, 4, 2)
    assert shared_weight_bytes(arch, 4, 2) > 0 and shared_weight_bytes(arch, 8, 2) == 0


def test_a_shared_decoder_generates_with_a_cache_over_every_layer() -> None:
    from ficoco.models import synthetic_inputs

    model = build_model("qwen3-vl-tiny", dtype="bf16", distinct_layers=1)
    inputs = synthetic_inputs(model)
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=3, do_sample=False)
        cache = model(**inputs, use_cache=True).past_key_values
    assert out.shape[1] == inputs["input_ids"].shape[1] + 3
    # Every layer cached its own keys: shared weights, separate layers.
    assert len(cache.layers) == len(model.get_decoder().layers) == 4


def test_the_memory_guard_counts_only_the_distinct_layers_weights() -> None:
    profile = load_profile("qwen3-vl-30b-a3b")
    full = memory_need_bytes(profile, [VanillaRow()], BF16, "fp16")
    shared = memory_need_bytes(profile, [VanillaRow()], BF16, "fp16", distinct_layers=12)
    # 36 of the 48 sparse layers (623 M parameters each) hold no weights of their own.
    assert full["weights"] - shared["weights"] == pytest.approx(36 * 623_120_640 * 2)
    assert shared["kv_cache"] == full["kv_cache"] and shared["activations"] == full["activations"]


@pytest.mark.parametrize(("model", "distinct", "quants", "says"), [
    ("qwen3.5-tiny", 3, ("fp16",), "decoder layer 3 is not shaped like layer 0"),
    ("qwen3.5-tiny", 9, ("fp16",), "the decoder has 8 layers; give 1 to 8"),
    ("qwen3-vl-tiny", 1, ("int8",), "unquantized model"),
])
def test_a_distinct_count_that_cannot_be_built_is_refused_before_anything_is_built(model, distinct, quants, says):
    from ficoco.profiling.config import ProfileConfig
    from ficoco.profiling.matrix import plan_run

    config = ProfileConfig(model=model, variants=("vanilla",), quants=quants, device="cpu", distinct_layers=distinct)
    with pytest.raises(FicocoError, match=says):
        plan_run(config)
    with pytest.raises(FicocoError, match=says.split(";")[0]):
        build_model(model, dtype="bf16", quant=quants[0], distinct_layers=distinct)


def test_the_cli_refuses_a_bad_count_in_one_line_with_exit_2(cli) -> None:
    result = cli("profile", "-m", "qwen3.5-tiny", "--variant", "vanilla", "--distinct-layers", "3", "--device", "cpu")
    assert result.code == 2
    assert "not shaped like layer 0" in result.err and "Traceback" not in result.err + result.out
