"""HiPrune in ficoco (its official rule is tests/test_rule_hiprune.py): the named tower layer it reads (the
``vision named`` need every family's tower pass probes), its budgets and refusals, its reads in the accountant,
and the method inside the tiny models: the planned tokens, a left-padded batch, generate, the full keep, flops
--verify, one light run per family, and the CLI's profile, sweep and show.

llava-tiny: a 6-layer CLIP tower whose projector reads layer 4 (64 patches of an 8 x 8 grid per image, [CLS]
first), a 4-layer LLaMA decoder, 12 text tokens per prompt.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import assert_batch_equals_samples_alone, assert_one_error_line, forward_with_hooks, prefill_and_decode
from torch import Tensor, nn

import ficoco
from ficoco.accounting import architecture
from ficoco.accounting.methods import method_schedule
from ficoco.accounting.reads import method_reads
from ficoco.accounting.schedule import plan_tokens
from ficoco.api import profile_of
from ficoco.errors import FicocoError
from ficoco.methods import METHODS, MethodSpec, Need, ProbePlan, TowerProbe, registered
from ficoco.methods.inputs import TowerInput, TowerOutput
from ficoco.models import hf_compat as hf
from ficoco.models import synthetic_inputs

TINY_PROFILE = "llava-tiny"  # built as this module's `model` (conftest.py)
TEXT = 12
PATCHES = 64
KEEP = 16
NEW = 4
SPEC = METHODS["hiprune"]


def inputs(model: nn.Module, batch: int = 1, seed: int = 0, text: int = TEXT) -> dict[str, Tensor]:
    return synthetic_inputs(model, batch=batch, text_tokens=text, seed=seed)


# ---- the spec: the layers it reads, its budgets, its reads -------------------------------------------------------

def test_its_probe_plan_reads_the_projector_s_layer_and_the_named_object_layer_over_whole_items() -> None:
    whole = TowerProbe(probabilities=True, whole_item=True)
    assert SPEC.probes == ProbePlan(step_tower_layers=whole, named_tower_layers=(("object_layer", whole),))
    assert SPEC.probes.reads_tower
    with pytest.raises(ValueError, match="names the setting that holds its tower layer"):
        Need("attention_rows", "vision named", "all", "no setting named")
    with pytest.raises(ValueError, match="only such a need does"):
        Need("attention_rows", "vision L", "all", "a setting where none is read", at="object_layer")
    with pytest.raises(ValueError, match="'deep_layer', which is not one of its hyperparameters"):
        dataclasses.replace(SPEC, needs=(*SPEC.needs, Need("keys", "vision named", "all", "x", at="deep_layer")))
    # One layer's probabilities both as it ran and over the whole item: no probe keeps both.
    with pytest.raises(ValueError, match="read by no hook point"):
        dataclasses.replace(SPEC, needs=(*SPEC.needs, Need("attention_rows", "vision L", "all", "as it ran")))


@pytest.mark.parametrize("profile,object_layer", [
    ("llava-1.5-7b", 8),  # the official HIPRUNE_OBJECT_LAYER = 9 of CLIP's 24 layers
    ("llava-next-7b", 8), ("video-llava-7b", 8), ("internvl3-8b", 8),
    ("llava-onevision-7b", 9),  # SigLIP's 26 layers: l = round(9 x 26 / 24) = 10
    ("qwen2.5-vl-7b", 15),  # the official l = 16 of 32 blocks: block 15, a full-attention block
    ("qwen2-vl-7b", 15),
    ("qwen3-vl-8b", 13),  # 27 blocks: l = round(16 x 27 / 32) = 14
    ("qwen3.5-0.8b", 5),  # 12 blocks: l = 6
    ("qwen2.5-vl-tiny", 2),  # 4 blocks: l = 2 (block 1) attends within windows; the nearest full block is 2
    ("llava-tiny", 1),
])
def test_the_object_layer_is_the_official_one_scaled_to_the_tower(arch_of, profile: str, object_layer: int) -> None:
    schedule = method_schedule(arch_of(profile), "hiprune")
    assert schedule.settings_dict()["object_layer"] == object_layer
    # Given, it is the 0-based layer given.
    assert method_schedule(arch_of(profile), "hiprune", object_layer=1).settings_dict()["object_layer"] == 1


@pytest.mark.parametrize("preset,anchors", [(192, 4), (128, 3), (64, 1)])
def test_presets_plan_the_literature_rows_and_the_official_anchor_counts(flops_report, preset: int,
                                                                         anchors: int) -> None:
    from ficoco.methods.hiprune import anchor_count

    report = flops_report("--model", "llava-1.5-7b", "--variant", "vanilla,hiprune", "--preset", str(preset))
    row = next(r for r in report["rows"] if r["variant"] == "hiprune")
    assert row["visual_tokens"] == preset and row["settings"]["keep"] == preset
    assert anchor_count(preset, row["settings"]["alpha"]) == anchors
    # LLaVA-NeXT's official HIPRUNE_RETENTION (640 / 320 / 160 over the base view and four crops) is keep per crop.
    nexts = flops_report("--model", "llava-next-7b", "--variant", "hiprune", "--keep", str(preset * 2 // 3 // 1))
    (next_row,) = nexts["rows"]
    assert next_row["settings"]["keep"] == preset * 2 // 3


def test_the_default_keeps_a_third_and_a_tflops_budget_plans(arch_of) -> None:
    arch = arch_of("llava-1.5-7b")
    assert method_schedule(arch, "hiprune").settings_dict()["keep"] == 192  # round(576 x 0.334)
    assert method_schedule(arch_of("qwen2.5-vl-tiny"), "hiprune").settings_dict()["keep"] == 7  # round(20 x 0.334)
    report = ficoco.flops("llava-1.5-7b", "vanilla,hiprune", tflops=4.0)
    row = next(r for r in report["rows"] if r["variant"] == "hiprune")
    assert row["tflops"] <= 4.0 and 1 <= row["visual_tokens"] < 576


@pytest.mark.parametrize("setting,message", [
    ({"keep": 0}, "keep 0 is outside 1..576"),
    ({"keep": 577}, "keep 577 is outside 1..576"),
    ({"keep": 3, "alpha": 1.0}, "anchors and buffers .up to 5. do not fit keep=3"),
    ({"keep": 64, "alpha": 1.5}, "alpha=1.5 is outside 0..1"),
    ({"keep": 64, "object_layer": 24}, "object_layer=24 names no layer of this 24-layer vision tower"),
    ({"keep": 64, "object_layer": "middle"}, "give a 0-based tower layer"),
    ({"keep": 64, "buffers": "wrap"}, "give 'official' .the official code's. or 'grid'"),
])
def test_an_impossible_setting_is_refused_in_one_line(arch_of, setting: dict, message: str) -> None:
    keep = setting.pop("keep")
    with pytest.raises(FicocoError, match=message) as info:
        method_schedule(arch_of("llava-1.5-7b"), "hiprune", keep, **setting)
    assert "\n" not in str(info.value)


def test_the_cli_refuses_an_impossible_budget_in_one_line(cli) -> None:
    line = assert_one_error_line(cli("flops", "--model", "llava-1.5-7b", "--variant", "hiprune", "--keep", "600"))
    assert "keep 600 is outside 1..576" in line


@pytest.mark.parametrize("profile,layers,windowed", [
    ("llava-1.5-7b", (22, 8), False),
    ("qwen2.5-vl-7b", (31, 15), False),
    ("qwen2.5-vl-tiny", (3, 2), True),  # block 3 attends within windows: read over the whole image all the same
])
def test_it_reads_two_whole_layers_column_sums(arch_of, profile: str, layers: tuple[int, int], windowed: bool) -> None:
    arch = arch_of(profile)
    schedule = method_schedule(arch, "hiprune", 64 if arch.vision.units >= 64 else 10)
    plan = plan_tokens(arch, schedule)
    reads = method_reads(arch, schedule, plan)
    tokens = arch.vision.tokens(arch.vision.units)
    assert sorted({read.layer for read in reads}, reverse=True) == list(layers)
    assert arch.vision.windowed(layers[0]) == windowed
    for layer in layers:  # every query row over every key, per item
        assert sum(read.scores for read in reads if read.layer == layer) == arch.vision.heads * tokens * tokens
    assert all(read.pairs is None for read in reads)


# ---- in the model ----------------------------------------------------------------------------------------------

def entering(model: nn.Module, inp: dict[str, Tensor]) -> tuple[list[int], list[int]]:
    """Tokens every tower layer's and every decoder layer's attention ran on in one forward."""
    seen: dict[str, list[int]] = {"vision": [], "llm": []}
    hooks = []
    towers = (("vision", model.model.vision_tower.encoder.layers), ("llm", model.model.language_model.layers))
    for stage, layers in towers:
        for layer in layers:
            hooks.append(layer.self_attn.register_forward_pre_hook(
                lambda m, args, kwargs, stage=stage: seen[stage].append(
                    (args[0] if args else kwargs["hidden_states"]).shape[1]), with_kwargs=True))
    forward_with_hooks(model, inp, hooks)
    return seen["vision"], seen["llm"]


def test_tokens_of_every_tower_and_decoder_layer_equal_the_plan(model: nn.Module) -> None:
    inp = inputs(model, batch=2)
    with ficoco.apply(model, "hiprune", keep=KEEP) as handle:
        vision, llm = entering(model, inp)
        plan = plan_tokens(architecture(profile_of(model)), handle.schedule, text_tokens=TEXT)
        (record,) = handle.records
    assert vision == [n_in for n_in, _ in plan.vision] and llm == [n_in for n_in, _ in plan.llm]
    assert llm[0] == TEXT + KEEP and handle.measured_tokens_per_item == plan.llm_visual_tokens == KEEP
    assert record.layer == plan.reductions[0].layer == 4 and record.kept.shape == (2, KEEP)
    for kept, gone in zip(record.kept, record.discarded, strict=True):
        assert torch.equal(kept, kept.sort().values)  # image order
        assert sorted(kept.tolist() + gone[gone >= 0].tolist()) == list(range(PATCHES))


def left_padded(model: nn.Module) -> tuple[dict[str, Tensor], list[dict[str, Tensor]]]:
    short, long = inputs(model, seed=1, text=TEXT), inputs(model, seed=2, text=TEXT + 3)
    pad = long["input_ids"].shape[1] - short["input_ids"].shape[1]
    zeros = torch.zeros(1, pad, dtype=torch.long)
    batch = {"input_ids": torch.cat([torch.cat([zeros, short["input_ids"]], 1), long["input_ids"]]),
             "attention_mask": torch.cat([torch.cat([zeros, short["attention_mask"]], 1), long["attention_mask"]]),
             "pixel_values": torch.cat([short["pixel_values"], long["pixel_values"]])}
    return batch, [short, long]


def test_a_left_padded_batch_equals_its_samples_run_alone(model: nn.Module) -> None:
    batch, alone = left_padded(model)
    # Each image keeps its own budget, whatever the batch (the official code divides it by the batch's images).
    with torch.no_grad(), ficoco.apply(model, "hiprune", keep=40, alpha=0.5) as handle:
        assert_batch_equals_samples_alone(model, handle, batch, alone)


def test_generate_matches_a_hand_written_prefill_and_decode_loop(model: nn.Module) -> None:
    inp = inputs(model, batch=2, seed=3)
    prompt = inp["input_ids"].shape[1]
    with torch.no_grad(), ficoco.apply(model, "hiprune", keep=KEEP) as handle:
        generated = model.generate(**inp, max_new_tokens=NEW, do_sample=False, min_new_tokens=NEW)
        out, positions, decoded, cache = prefill_and_decode(model, inp, NEW, handle)
    assert torch.equal(generated[:, :prompt], inp["input_ids"]) and torch.equal(generated[:, prompt:], decoded)
    assert cache.get_seq_length() == prompt - PATCHES + KEEP + NEW - 1
    assert positions.shape == out.logits.shape[:2] == (2, prompt - PATCHES + KEEP)


def test_a_full_keep_is_bitwise_vanilla(model: nn.Module) -> None:
    inp = inputs(model, batch=2)
    with torch.no_grad():
        reference = model(**inp).logits
        with ficoco.apply(model, "hiprune", keep=PATCHES) as handle:
            out = model(**inp).logits
    assert not handle.schedule.removals and torch.equal(out, reference)


def test_flops_verify_counts_its_two_layers_reads(flops_verify) -> None:
    # Qwen2.5-VL's tiny tower: the object layer a full block (2), the deep one a window block (3) read over the
    # whole image, both through the packed tower's probes.
    (run,) = flops_verify("--model", "qwen2.5-vl-tiny", "--variant", "hiprune", "--keep", "8")["runs"]
    stages = {stage["stage"]: stage for stage in run["stages"]}
    assert all(stage["within_tolerance"] for stage in stages.values())
    heads, tokens, head_dim = 4, 80, 16  # two reads of every query over every key, 2 FLOPs a multiply-add
    assert stages["probe"]["analytic_flops"] == 2 * 2 * heads * tokens * tokens * head_dim
    assert stages["method"]["analytic_flops"] == 0


# ---- a tower layer named by a setting, for any method (VScan's [CLS] rows will read one) ------------------------

SEEN: dict[str, Any] = {}


def tower_step(inputs: TowerInput, settings: Mapping[str, Any]) -> TowerOutput:
    """Keep the first units; leave what the named layer's probe handed over for the test."""
    SEEN.update(inputs.named or {})
    keep = inputs.hidden.shape[1] - inputs.remove
    kept = torch.arange(keep, device=inputs.hidden.device).expand(inputs.hidden.shape[0], -1)
    return TowerOutput(hidden=inputs.hidden[:, :keep], kept=kept)


def _named_settings(keep: int | None, n_visual: int, n_layers: int, hp: Mapping[str, Any]) -> dict[str, Any]:
    return {"keep": n_visual // 2 if keep is None else keep, "probe_layer": hp["probe_layer"]}


NAMED = MethodSpec(
    name="named_probe", title="Named probe (toy)", acts_at="after_projector", placement="after_projector",
    positions="grid", needs=(Need("attention_rows", "vision named", "cls", "[CLS]'s row of a named layer",
                                  at="probe_layer"),
                             Need("hidden", "projector", "all", "the projector's output")),
    hyperparameters={"probe_layer": 2}, families=("llava",), module=__name__, function="tower_step",
    source="tests/test_method_hiprune.py", summary="keep the first units", keep_means="units per image",
    steps=METHODS["fastervlm"].steps, settings_for_keep=_named_settings, wired=True)


def test_any_method_reads_the_tower_layer_its_setting_names(model: nn.Module) -> None:
    inp = inputs(model, batch=2, seed=5)
    attention = model.model.vision_tower.encoder.layers[3].self_attn
    seen: dict[str, Tensor] = {}
    hooks = [attention.q_proj.register_forward_hook(lambda m, a, o: seen.__setitem__("q", o)),
             attention.k_proj.register_forward_hook(lambda m, a, o: seen.__setitem__("k", o))]
    forward_with_hooks(model, inp, hooks)
    heads = attention.num_heads
    with registered(NAMED), torch.no_grad(), ficoco.apply(model, "named_probe", keep=8, probe_layer=3):
        SEEN.clear()
        model(**inp)
    probe = SEEN["probe_layer"]
    items, tokens, width = seen["k"].shape
    assert probe.layer == 3 and probe.attention is None
    torch.testing.assert_close(probe.keys, seen["k"].view(items, tokens, heads, -1).transpose(1, 2))
    torch.testing.assert_close(probe.cls_query, seen["q"][:, 0].view(items, heads, -1))


# ---- every family ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("profile", ["video-llava-tiny", "llava-onevision-tiny", "internvl3-tiny", "qwen2-vl-tiny",
                                     "qwen3-vl-tiny", "qwen3-vl-moe-tiny", "qwen3.5-tiny"])
def test_every_family_hands_the_decoder_the_planned_tokens(profile: str) -> None:
    family_model = ficoco.build_model(profile, dtype="fp32")
    inp = synthetic_inputs(family_model, batch=1, text_tokens=TEXT, seed=2)
    arch = architecture(profile_of(family_model))
    keep = max(2, arch.vision.units // 2)
    seen: list[int] = []
    first = hf.decoder_layers(family_model)[0]
    with ficoco.apply(family_model, "hiprune", keep=keep, alpha=0.5) as handle:
        hook = first.register_forward_pre_hook(
            lambda m, args, kwargs: seen.append((args[0] if args else kwargs["hidden_states"]).shape[1]),
            with_kwargs=True)
        forward_with_hooks(family_model, inp, [hook])
        plan = plan_tokens(arch, handle.schedule, text_tokens=TEXT)
        (record,) = handle.records
    assert seen == [plan.llm[0][0]] and plan.llm_visual_tokens < arch.visual_tokens
    # A record lists every kept unit's patches (a merge group's 4 on the Qwen towers and InternVL).
    assert record.kept.shape[1] == keep * arch.vision.merge


# ---- the CLI -------------------------------------------------------------------------------------------------

def test_profile_sweep_and_show_run_it(cli, tmp_path: Path) -> None:
    path = tmp_path / "profile.json"
    code, out, err = cli("profile", "--model", "llava-tiny", "--variant", "hiprune", "--keep", str(KEEP), "--quant",
                         "fp16", "--warmup", "0", "--repeat", "1", "--no-reference", "--json", str(path))
    assert code == 0, err
    (row,) = json.loads(path.read_text())["rows"]
    assert row["variant"] == "hiprune" and row["analytic"]["visual_tokens"] == KEEP
    sweep = tmp_path / "sweep.json"
    code, _, err = cli("sweep", "--model", "llava-tiny", "--variant", "hiprune", "--keep", "32,16", "--json",
                       str(sweep))
    assert code == 0, err
    points = [p for p in json.loads(sweep.read_text())["points"] if p["variant"] == "hiprune"]
    assert sorted(p["analytic"]["visual_tokens"] for p in points) == [16, 32]
    picture, data = tmp_path / "tokens.png", tmp_path / "tokens.json"
    code, _, err = cli("show", "--model", "llava-tiny", "--variant", "hiprune", "--keep", str(KEEP), "--out",
                       str(picture), "--json", str(data), "--dtype", "fp32")
    assert code == 0, err
    (step,) = json.loads(data.read_text())["steps"]
    assert picture.stat().st_size > 0 and len(step["records"]["kept"][0]) == KEEP
