"""FitPrune inside the models (docs/methods/fitprune.md): the tokens every layer runs on are the accountant's plan,
a left-padded batch is its samples run alone, generate is a hand-written decode loop, a scheme that deletes
nothing is bitwise vanilla, two images are scored together, mistakes are one line, `ficoco flops` plans the
presets and verifies, the CLI's profile, sweep and show run it, and every family runs it (Qwen3.5 at its
full-attention layers). Seeded random tiny models in fp32 on the CPU; the official rule itself is
tests/test_rule_fitprune.py's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import assert_batch_equals_samples_alone, assert_one_error_line, forward_with_hooks, prefill_and_decode
from torch import Tensor, nn

import ficoco
from ficoco.accounting import architecture
from ficoco.accounting.schedule import plan_tokens
from ficoco.api import profile_of
from ficoco.errors import FicocoError
from ficoco.methods import fitprune
from ficoco.methods.needs import Need, probe_plan
from ficoco.methods.registry import METHODS, method_label
from ficoco.models import synthetic_inputs

TINY_PROFILE = "llava-tiny"  # 4 decoder layers, 64 visual tokens
TEXT = 12
NEW = 5
SCALED = "FitPrune (ficoco: scheme scaled from LLaVA-1.5-7B's)"
# One setting per budget kind: the default (ratio 60 scaled: 34, 6, 10, 0 at layers 0..3) and an explicit
# schedule that deletes at every layer, the last included.
SETTINGS = {"default": {}, "schedule": {"schedule": "0:5,1:10,2:20,3:3"}}


def inputs(model: nn.Module, batch: int = 1, seed: int = 0, text: int = TEXT) -> dict[str, Tensor]:
    return synthetic_inputs(model, batch=batch, text_tokens=text, seed=seed)


def greedy(model: nn.Module, inp: dict[str, Tensor], new: int = NEW) -> Tensor:
    return model.generate(**inp, max_new_tokens=new, do_sample=False, min_new_tokens=new)


def entering_tokens(model: nn.Module, inp: dict[str, Tensor], layers: Any = None) -> list[int]:
    """The sequence length every decoder layer's attention ran on in one prefill."""
    seen: list[int] = []
    layers = model.model.language_model.layers if layers is None else layers
    hooks = [layer.self_attn.register_forward_pre_hook(lambda m, args, kwargs: seen.append(
        (args[0] if args else kwargs["hidden_states"]).shape[1]), with_kwargs=True)
        for layer in layers if hasattr(layer, "self_attn")]
    forward_with_hooks(model, inp, hooks)
    return seen


@pytest.mark.parametrize("setting", SETTINGS.values(), ids=SETTINGS)
def test_tokens_entering_every_layer_equal_the_accountants_plan(model: nn.Module, setting: dict) -> None:
    inp = inputs(model, batch=2)
    with ficoco.apply(model, "fitprune", **setting) as handle:
        seen = entering_tokens(model, inp)
        records = list(handle.records)
    plan = plan_tokens(architecture(profile_of(model)), handle.schedule, text_tokens=TEXT)
    assert handle.schedule.removals and seen == [entering for entering, _ in plan.llm]
    assert [r.layer for r in records] == [r.layer for r in handle.schedule.removals]
    for record, reduction in zip(records, plan.reductions, strict=True):
        kept = reduction.visual_before - reduction.removed
        assert tuple(record.kept.shape) == (2, kept) and tuple(record.discarded.shape) == (2, reduction.removed)
        assert record.merged_into is None  # FitPrune deletes, merges nothing


def test_the_default_runs_ficocos_scaled_scheme_labelled_so(model: nn.Module) -> None:
    with ficoco.apply(model, "fitprune") as handle:
        schedule = handle.schedule
    assert schedule.settings_dict() == {"reduction_ratio": 60, "scheme": "scaled"}
    assert schedule.removed_at() == {0: 34, 1: 6, 2: 10}  # the scripts' ratio 60, scaled to 4 layers x 64 tokens
    assert method_label("fitprune", schedule.settings_dict()) == SCALED


def left_padded(model: nn.Module) -> tuple[dict[str, Tensor], list[dict[str, Tensor]]]:
    """Two prompts of different lengths (so different image spans) in one left-padded batch."""
    short, long = inputs(model, seed=1), inputs(model, seed=2, text=TEXT + 3)
    pad = long["input_ids"].shape[1] - short["input_ids"].shape[1]
    ids = torch.cat([torch.cat([torch.zeros(1, pad, dtype=torch.long), short["input_ids"]], 1), long["input_ids"]])
    mask = torch.cat([torch.cat([torch.zeros(1, pad, dtype=torch.long), short["attention_mask"]], 1),
                      long["attention_mask"]])
    batch = {"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(1) - 1).clamp(min=0),
             "pixel_values": torch.cat([short["pixel_values"], long["pixel_values"]])}
    return batch, [short, long]


@pytest.mark.parametrize("setting", SETTINGS.values(), ids=SETTINGS)
def test_a_left_padded_batch_equals_its_samples_run_alone(model: nn.Module, setting: dict) -> None:
    batch, alone = left_padded(model)
    with torch.no_grad(), ficoco.apply(model, "fitprune", **setting) as handle:
        assert_batch_equals_samples_alone(model, handle, batch, alone)


def test_generate_matches_a_hand_written_prefill_and_decode_loop(model: nn.Module) -> None:
    inp = inputs(model, batch=2, seed=3)
    prompt = inp["input_ids"].shape[1]
    with torch.no_grad(), ficoco.apply(model, "fitprune", **SETTINGS["schedule"]) as handle:
        generated = greedy(model, inp)
        out, positions, decoded, cache = prefill_and_decode(model, inp, NEW, handle)
    assert torch.equal(generated[:, :prompt], inp["input_ids"]) and torch.equal(generated[:, prompt:], decoded)
    # Each layer cached the tokens it received: layer 0 every one (it deletes after its attention).
    plan = plan_tokens(architecture(profile_of(model)), handle.schedule, text_tokens=TEXT)
    assert [cache.get_seq_length(i) for i in range(len(plan.llm))] == [n + NEW - 1 for n, _ in plan.llm]
    assert plan.llm[0][0] == prompt
    assert positions.shape == out.logits.shape[:2] and torch.equal(positions[:, -1], torch.full((2,), prompt - 1))


@pytest.mark.parametrize("setting", [{"schedule": {}}, {"keep": 576}, {"reduction_ratio": 0}],
                         ids=["empty-schedule", "keep-576", "ratio-0"])
def test_a_scheme_that_deletes_nothing_is_bitwise_vanilla(model: nn.Module, setting: dict) -> None:
    inp = inputs(model, batch=2)
    with torch.no_grad():
        reference, reference_tokens = model(**inp).logits, greedy(model, inp)
        with ficoco.apply(model, "fitprune", **setting) as handle:
            assert handle.schedule.removals == ()
            logits, tokens = model(**inp).logits, greedy(model, inp)
    assert torch.equal(logits, reference) and torch.equal(tokens, reference_tokens)


def two_image_prompts(model: nn.Module) -> tuple[dict[str, Tensor], list[dict[str, Tensor]]]:
    """Prompts of two images each, text between them (the template twice), batched and alone."""
    alone = []
    for seed in (0, 1):
        first, second = inputs(model, seed=seed), inputs(model, seed=seed + 10)
        ids = torch.cat([first["input_ids"], second["input_ids"][:, 1:]], 1)
        alone.append({"input_ids": ids, "attention_mask": torch.ones_like(ids),
                      "pixel_values": torch.cat([first["pixel_values"], second["pixel_values"]])})
    return {key: torch.cat([a[key] for a in alone]) for key in alone[0]}, alone


def test_two_images_are_scored_together_and_lose_twice_the_count(model: nn.Module) -> None:
    batch, alone = two_image_prompts(model)
    with torch.no_grad(), ficoco.apply(model, "fitprune", **SETTINGS["schedule"]) as handle:
        generated = greedy(model, batch, new=3)
        records = list(handle.records)  # of generate's prefill
        singles = [greedy(model, sample, new=3) for sample in alone]
    assert [tuple(r.discarded.shape) for r in records] == [(2, 2 * r.remove) for r in handle.schedule.removals]
    for i, single in enumerate(singles):
        assert torch.equal(generated[i:i + 1], single)


def test_the_probe_reads_the_head_max_and_only_at_deleting_layers(model: nn.Module) -> None:
    assert METHODS["fitprune"].probes.layer_heads == "max" and METHODS["l"].probes.layer_heads == "mean"
    with ficoco.apply(model, "fitprune", schedule="1:8,3:2"):
        layers = model.model.language_model.layers
        probed = [getattr(layer.self_attn, "_ficoco_probe", None) for layer in layers]
        assert [slot is not None for slot in probed] == [False, True, False, True]
        assert {slot.heads for slot in probed if slot is not None} == {"max"}
    # A head-max need is read by the decoder's in-layer probe alone.
    with pytest.raises(ValueError, match="read by no hook point"):
        probe_plan("x", (Need("attention_rows", "L-1", "last", "x", heads="max"),), "llm_layer", "layer_input")


def test_mistakes_are_refused_in_one_line(model: nn.Module, cli: Any) -> None:
    cases = [({"reduction_ratio": 65}, "published for 0, 10"), ({"keep": 100}, "keep=100 is none of them"),
             ({"scheme": "bogus"}, "scheme='bogus'"), ({"schedule": "0:40,1:30"}, "at least one must stay")]
    for setting, message in cases:
        with pytest.raises(FicocoError, match=message):
            ficoco.apply(model, "fitprune", **setting)
        assert "_ficoco_handle" not in model.__dict__
    line = assert_one_error_line(cli("flops", "--model", "llava-1.5-7b", "--variant", "fitprune", "--keep", "100"))
    assert "64, 128, 192, 245" in line
    line = assert_one_error_line(cli("flops", "--model", "llava-1.5-7b", "--variant", "fitprune", "--tflops", "0.5"))
    assert "no FitPrune setting" in line


def test_flops_plans_the_official_default_the_presets_and_a_budget(flops_report: Any) -> None:
    def row(*args: str) -> dict:
        return flops_report("--model", "llava-1.5-7b", "--variant", "fitprune", *args)["rows"][0]

    default = row()
    assert default["settings"] == {"reduction_ratio": 60, "scheme": "published"}
    assert default["method_label"] == "FitPrune" and default["visual_tokens"] == 127
    # The literature's rows are the published ratios 70 / 80 / 90, as their official dicts run.
    for preset, (ratio, left, average) in {192: (70, 88, 187.875), 128: (80, 62, 130.59375),
                                           64: (90, 37, 72.84375)}.items():
        planned = row("--preset", str(preset))
        assert planned["settings"] == {"reduction_ratio": ratio, "scheme": "published"}
        assert planned["visual_tokens"] == left and planned["layer_average_visual_tokens"] == average
        counts = {r["layer"]: r["remove"] for r in planned["schedule"]}
        assert tuple(counts.get(layer, 0) for layer in range(32)) == fitprune.PUBLISHED_SCHEMES[ratio]
        assert planned["method_tflops"] == 0  # its own work is elementwise
    budget = row("--tflops", "3")
    assert budget["tflops"] <= 3 and budget["settings"]["reduction_ratio"] == 80
    # Elsewhere ficoco's scaled scheme, labelled.
    other = flops_report("--model", "llava-next-7b", "--variant", "fitprune", "--preset", "192")["rows"][0]
    assert other["settings"]["scheme"] == "scaled" and other["method_label"] == SCALED


def test_flops_verify_passes_with_the_head_max_reads_priced(flops_verify: Any) -> None:
    run = flops_verify("--model", "llava-tiny", "--variant", "fitprune", "--schedule", "0:5,1:10,2:20,3:3")["runs"][0]
    stages = {s["stage"]: s for s in run["stages"]}
    assert "probe" in stages and stages["probe"]["analytic_flops"] > 0
    # Its own work is elementwise: a "method" stage of zero matrix FLOPs, gated like the others.
    assert stages["method"]["analytic_flops"] == 0 == stages["method"]["fvcore_flops"]
    assert all(s["within_tolerance"] for s in stages.values())


def test_the_cli_profiles_sweeps_and_shows_it(cli: Any, tmp_path: Path) -> None:
    result = cli("profile", "--model", "llava-tiny", "--variant", "fitprune", "--no-reference", "--repeat", "1",
                 "--warmup", "0", "--dtype", "fp32", "--json", tmp_path / "p.json")
    assert result.code == 0, result.err
    assert "fitprune (ficoco: scheme scaled from LLaVA-1.5-7B's)" in result.out
    result = cli("sweep", "--model", "llava-tiny", "--variant", "fitprune", "--keep", "64",
                 "--json", tmp_path / "s.json")
    assert result.code == 0, result.err
    result = cli("show", "--model", "llava-tiny", "--variant", "fitprune", "--keep", "64", "--layer", "0",
                 "--out", tmp_path / "show.png", "--dtype", "fp32")
    assert result.code == 0, result.err
    assert (tmp_path / "show.png").stat().st_size > 0


@pytest.mark.parametrize("name", ["llava-next-tiny", "video-llava-tiny", "qwen2-vl-tiny", "qwen2.5-vl-tiny",
                                  "llava-onevision-tiny", "qwen3-vl-tiny", "qwen3-vl-moe-tiny", "qwen3.5-tiny",
                                  "internvl3-tiny"])
def test_every_family_runs_it(name: str) -> None:
    other = ficoco.build_model(name, dtype="fp32")
    inp = synthetic_inputs(other, batch=2, text_tokens=TEXT)
    arch = architecture(profile_of(other))
    with torch.no_grad(), ficoco.apply(other, "fitprune", preset=192) as handle:
        layers = getattr(other.model, "language_model", None)
        seen = entering_tokens(other, inp, layers.layers if layers is not None else None)
        tokens = other.generate(**inp, max_new_tokens=2, do_sample=False)
    schedule = handle.schedule
    assert schedule.removals and schedule.settings_dict()["scheme"] == "scaled"
    plan = plan_tokens(arch, schedule, text_tokens=inp["input_ids"].shape[1] - arch.visual_tokens)
    if name == "qwen3.5-tiny":  # deletions only inside its full-attention layers
        full = [layer for layer in range(arch.decoder.layers) if arch.decoder.full_attention(layer)]
        assert {r.layer for r in schedule.removals} <= set(full)
        assert seen == [plan.llm[layer][0] for layer in full]
    else:
        assert seen == [entering for entering, _ in plan.llm]
    assert tokens.shape[1] == inp["input_ids"].shape[1] + 2
