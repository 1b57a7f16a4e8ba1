"""VTW (docs/methods/vtw.md) on llava-tiny: every visual token withdrawn at decoder layer K, the later layers running
and caching the text alone (zero visual tokens after the step, in the model and in the accountant), left padding,
several images, both position schemes, the budgets and their refusals. The command line (verify, calibrate, profile,
sweep, show): tests/test_method_vtw_cli.py; the other families: tests/test_method_vtw_families.py.

llava-tiny: a 4-layer LLaMA decoder, one image span of 64 visual tokens, 12 text tokens per prompt.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from helpers import assert_batch_equals_samples_alone, assert_one_error_line, prefill_and_decode
from torch import Tensor, nn

import ficoco
from ficoco.accounting import architecture
from ficoco.accounting.schedule import plan_tokens
from ficoco.api import profile_of
from ficoco.errors import FicocoError
from ficoco.models import synthetic_inputs
from ficoco.models.hf_compat import cache_argument, output_cache

TINY_PROFILE = "llava-tiny"  # built as this module's `model` (conftest.py)
TEXT = 12
VISUAL = 64
NEW = 4


def inputs(model: nn.Module, batch: int = 1, seed: int = 0, text: int = TEXT) -> dict[str, Tensor]:
    return synthetic_inputs(model, batch=batch, text_tokens=text, seed=seed)


def entering_tokens(model: nn.Module, inp: dict[str, Tensor]) -> list[int]:
    """The sequence every decoder layer's attention ran on in one prefill (pre-hooks: after the step)."""
    seen: list[int] = []
    hooks = [layer.self_attn.register_forward_pre_hook(
        lambda m, args, kwargs: seen.append(kwargs["hidden_states"].shape[1]), with_kwargs=True)
        for layer in model.model.language_model.layers]
    try:
        with torch.no_grad():
            model(**inp)
    finally:
        for hook in hooks:
            hook.remove()
    return seen


@pytest.mark.parametrize("setting", [{"layer": 1}, {"layer": 3}, {"keep": 32}])
def test_tokens_entering_every_layer_and_every_layers_cache_equal_the_accountants_plan(model: nn.Module,
                                                                                      setting: dict) -> None:
    inp = inputs(model, batch=2)
    with torch.no_grad(), ficoco.apply(model, "vtw", **setting) as handle:
        seen = entering_tokens(model, inp)
        generated = model.generate(**inp, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
        out, positions, decoded, cache = prefill_and_decode(model, inp, NEW, handle)
    (step,) = handle.schedule.removals
    plan = plan_tokens(architecture(profile_of(model)), handle.schedule, text_tokens=TEXT)
    assert seen == [entering for entering, _ in plan.llm]
    assert [v for v, _ in plan.llm_visual] == [VISUAL] * step.layer + [0] * (4 - step.layer)  # none from K on
    # generate is the hand-written loop; layers from K on cache the text and the new tokens alone.
    assert torch.equal(generated[:, -NEW:], decoded)
    assert [cache.get_seq_length(i) for i in range(4)] == [entering + NEW - 1 for entering, _ in plan.llm]
    prompt = inp["input_ids"].shape[1]
    assert torch.equal(positions, torch.cat([torch.arange(5), torch.arange(5 + VISUAL, prompt)]).expand(2, -1))
    assert out.logits.shape[1] == TEXT


@pytest.mark.parametrize("setting", [{"schedule": {}}, {"layer": 4}, {"keep": VISUAL}])
def test_an_empty_schedule_or_k_at_the_decoders_depth_is_bitwise_vanilla(model: nn.Module, setting: dict) -> None:
    inp = inputs(model, batch=2)
    labels = inp["input_ids"].masked_fill(inp["input_ids"] == 300, -100)
    with torch.no_grad():
        reference = model(**inp, labels=labels)
        tokens = model.generate(**inp, max_new_tokens=3, do_sample=False)
        with ficoco.apply(model, "vtw", **setting) as handle:
            assert handle.schedule.removals == ()
            out = model(**inp, labels=labels)
            patched = model.generate(**inp, max_new_tokens=3, do_sample=False)
    assert torch.equal(out.logits, reference.logits) and torch.equal(out.loss, reference.loss)
    assert torch.equal(patched, tokens)


def test_a_text_turn_on_the_cache_in_one_forward_is_the_same_tokens_one_by_one(model: nn.Module) -> None:
    """Every layer's mask is sliced to what it cached (layers from K on: no visual token) for a turn of several
    tokens as for single decode steps."""
    inp = inputs(model, batch=2, seed=5)
    question = torch.tensor([[11, 12, 13], [21, 22, 23]])
    with torch.no_grad(), ficoco.apply(model, "vtw", layer=2):
        cache = output_cache(model(**inp, use_cache=True))
        mask = torch.cat([inp["attention_mask"], torch.ones_like(question)], dim=1)
        whole = model(input_ids=question, attention_mask=mask, **cache_argument(cache), use_cache=True).logits
        cache, mask, stepped = output_cache(model(**inp, use_cache=True)), inp["attention_mask"], []
        for t in range(question.shape[1]):
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            step = model(input_ids=question[:, t:t + 1], attention_mask=mask, **cache_argument(cache), use_cache=True)
            stepped.append(step.logits[:, -1])
    torch.testing.assert_close(whole, torch.stack(stepped, dim=1), atol=1e-5, rtol=0)


def left_padded(model: nn.Module) -> tuple[dict[str, Tensor], list[dict[str, Tensor]]]:
    short, long = inputs(model, seed=1), inputs(model, seed=2, text=TEXT + 3)
    pad = long["input_ids"].shape[1] - short["input_ids"].shape[1]
    zeros = torch.zeros(1, pad, dtype=torch.long)
    ids = torch.cat([torch.cat([zeros, short["input_ids"]], 1), long["input_ids"]])
    mask = torch.cat([torch.cat([zeros, short["attention_mask"]], 1), long["attention_mask"]])
    return {"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(1) - 1).clamp(min=0),
            "pixel_values": torch.cat([short["pixel_values"], long["pixel_values"]])}, [short, long]


@pytest.mark.parametrize("positions", ["original", "compact"])
def test_a_left_padded_batch_equals_its_samples_run_alone(model: nn.Module, positions: str) -> None:
    batch, alone = left_padded(model)
    with torch.no_grad(), ficoco.apply(model, "vtw", layer=2, positions=positions) as handle:
        assert_batch_equals_samples_alone(model, handle, batch, alone)


def test_the_text_keeps_its_ids_unless_positions_compact_repacks_them(model: nn.Module) -> None:
    """The last prompt token's position id at the last layer: its own (the official default), or the prompt's length
    less the withdrawn tokens (the official other pe_type), which decode steps continue from as well."""
    inp = inputs(model)
    length = inp["input_ids"].shape[1]
    seen: list[Tensor] = []
    hook = model.model.language_model.layers[-1].self_attn.register_forward_pre_hook(
        lambda m, args, kwargs: seen.append(kwargs["position_ids"]), with_kwargs=True)
    try:
        for positions, last in (("original", length - 1), ("compact", length - 1 - VISUAL)):
            seen.clear()
            with torch.no_grad(), ficoco.apply(model, "vtw", layer=2, positions=positions) as handle:
                prefill_and_decode(model, inp, 2, handle)
            assert [int(ids.reshape(-1)[-1]) for ids in seen] == [last, last + 1], positions
    finally:
        hook.remove()


def two_image_prompts(model: nn.Module) -> tuple[dict[str, Tensor], list[dict[str, Tensor]]]:
    """Prompts of two images each with text between them (the template twice), batched and alone."""
    alone = []
    for seed in (0, 1):
        first, second = inputs(model, seed=seed), inputs(model, seed=seed + 10)
        ids = torch.cat([first["input_ids"], second["input_ids"][:, 1:]], 1)
        alone.append({"input_ids": ids, "attention_mask": torch.ones_like(ids),
                      "pixel_values": torch.cat([first["pixel_values"], second["pixel_values"]])})
    return {key: torch.cat([a[key] for a in alone]) for key in alone[0]}, alone


def test_every_image_of_a_prompt_is_withdrawn(model: nn.Module) -> None:
    batch, alone = two_image_prompts(model)
    length = batch["input_ids"].shape[1]
    with torch.no_grad(), ficoco.apply(model, "vtw", layer=2) as handle:
        seen = entering_tokens(model, batch)
        (record,) = handle.records
        generated = model.generate(**batch, max_new_tokens=3, do_sample=False)
        _, _, decoded, _ = prefill_and_decode(model, batch, 3, handle)
        singles = [model.generate(**sample, max_new_tokens=3, do_sample=False) for sample in alone]
    assert seen == [length, length, length - 2 * VISUAL, length - 2 * VISUAL]
    assert record.kept.shape == (2, 0) and torch.equal(record.discarded, torch.arange(2 * VISUAL).expand(2, -1))
    assert torch.equal(generated[:, -3:], decoded)
    for i, single in enumerate(singles):
        assert torch.equal(generated[i:i + 1], single)


@pytest.mark.parametrize("setting,message", [
    ({}, "layer 15 is outside 1..4"),  # the official K=15 on a 4-layer decoder
    ({"layer": 0}, "layer 0 is outside 1..4"),
    ({"keep": 15}, "keep=15 is outside 16..64"),
    ({"keep": 65}, "keep=65 is outside 16..64"),
    ({"keep": 32, "layer": 2}, "keep=32 picks K itself"),
    ({"positions": "repacked", "layer": 2}, "positions='repacked': give original"),
    ({"schedule": "2:30"}, "withdraws every visual token at its layer: layer 2 removes 30 of the 64 left; give 2:64"),
])
def test_a_setting_vtw_cannot_run_is_refused_in_one_line(model: nn.Module, setting: dict, message: str) -> None:
    with pytest.raises(FicocoError, match=message.replace("(", r"\(").replace(")", r"\)")) as info:
        ficoco.apply(model, "vtw", **setting)
    assert "\n" not in str(info.value) and "_ficoco_handle" not in model.__dict__


def test_a_qwen_model_refuses_compact_positions_and_qwen35_a_deltanet_k_in_one_line(cli: Any) -> None:
    qwen = ficoco.build_model("qwen2-vl-tiny", dtype="fp32")
    with pytest.raises(FicocoError, match="positions=compact renumbers 1-D position ids; Qwen2-VL's are 3-D"):
        ficoco.apply(qwen, "vtw", layer=2, positions="compact")
    assert "_ficoco_handle" not in qwen.__dict__
    line = assert_one_error_line(cli("flops", "--model", "qwen3.5-tiny", "--variant", "vtw", "--hp", "layer=5"))
    assert "layer 5 of this Qwen3.5 decoder is Gated DeltaNet" in line and line.endswith("full-attention layer: 7")
    line = assert_one_error_line(cli("flops", "--model", "qwen3.5-tiny", "--variant", "vtw", "--hp", "layer=3"))
    assert "is the first full-attention layer, whose cache keeps every token" in line


def test_flops_plans_the_official_default_the_presets_and_a_budget(flops_report: Any) -> None:
    """LLaVA-1.5-7B (576 tokens, 32 layers): K=15 by default (a layer average of 270); the 192/128/64 rows are the
    K whose average is nearest (11/7/4: 198/126/72); a budget keeps the most tokens that fit."""
    def row(**request: Any) -> dict:
        return flops_report("--model", "llava-1.5-7b", "--variant", "vtw", *request.get("args", ()))["rows"][0]

    default = row()
    assert default["settings"] == {"layer": 15, "positions": "original"}
    assert (default["visual_tokens"], default["layer_average_visual_tokens"]) == (0, 270)
    assert default["method_tflops"] == 0
    for preset, layer, average in ((192, 11, 198), (128, 7, 126), (64, 4, 72)):
        planned = row(args=("--preset", str(preset)))
        assert (planned["settings"]["layer"], planned["layer_average_visual_tokens"]) == (layer, average)
    budget = row(args=("--tflops", str(default["tflops"])))
    assert budget["settings"]["layer"] == 15 and budget["tflops"] <= default["tflops"]
    # Qwen3.5-0.8B's hybrid decoder (24 layers, full attention at 3, 7, .., 23): K among the later full layers.
    hybrid = flops_report("--model", "qwen3.5-0.8b", "--variant", "vtw", "--preset", "192")["rows"][0]
    assert hybrid["settings"]["layer"] == 7
    with pytest.raises(FicocoError, match=r"K in 7, 11, 15, 19, 23 of 24: .* keep=64 is outside 168..576"):
        flops_report("--model", "qwen3.5-0.8b", "--variant", "vtw", "--preset", "64")
