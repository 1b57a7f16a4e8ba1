"""MustDrop inside the models (its official rule: tests/test_rule_mustdrop.py): the accountant's plan at the counts
the run measured, batches, generate, the vanilla edge, refusals, its own work counted and verified, the CLI.

The model: llava-tiny with 126-pixel images (a 9 x 9 patch grid: 3 x 3 windows of 3 x 3; the shipped 8 x 8 grid
is refused), a 6-layer tower (the projector reads layer 4; the key set comes from layer 5) and a 4-layer decoder
(pruning layer 2: the step at layer 3's input). Its tower has no position embedding and its decoder's queries are
scaled up, so that near-uniform windows of the prompts' images merge and the text attends unevenly to the image.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import assert_batch_equals_samples_alone, assert_one_error_line, forward_with_hooks, prefill_and_decode
from torch import Tensor, nn

import ficoco
from ficoco.accounting import architecture
from ficoco.accounting.methods import at_measured_steps, method_schedule
from ficoco.accounting.schedule import plan_tokens
from ficoco.api import profile_of
from ficoco.errors import FicocoError
from ficoco.models import hf_compat as hf
from ficoco.models import synthetic_inputs

SIDE, TEXT, NEW = 9, 12, 4
OVERRIDES = ["vision_config.image_size=126", f"image_seq_length={SIDE * SIDE}"]
SET = [arg for value in OVERRIDES for arg in ("--set", value)]  # the same model on the CLI
# Per image, the windows (row, col) made near-uniform (the batch merges the fewest any image has).
UNIFORM = ((0, 0), (1, 1)), ((0, 0), (1, 2), (2, 2))
DROPPING = {"global_thr": 0.014, "individual_thr": 0.02}  # drops about half of the tiny model's visual tokens


@pytest.fixture(scope="module")
def model() -> Iterator[nn.Module]:
    built = ficoco.build_model("llava-tiny", dtype="fp32", overrides=OVERRIDES)
    built.model.vision_tower.embeddings.position_embedding.weight.data.zero_()
    for layer in hf.decoder_layers(built):
        layer.self_attn.q_proj.weight.data.mul_(30)
    yield built
    handle = built.__dict__.get("_ficoco_handle")
    if handle is not None:
        handle.remove()


def inputs(model: nn.Module, batch: int = 1, seed: int = 0, text: int = TEXT, windows: int | None = None
           ) -> dict[str, Tensor]:
    """Synthetic prompts whose images have near-uniform windows (`UNIFORM`: 2 or 3 by sample; `windows` picks one
    layout for every sample)."""
    inp = synthetic_inputs(model, batch=batch, text_tokens=text, seed=seed)
    generator = torch.Generator().manual_seed(seed)
    size = 3 * 14
    for b in range(batch):
        for row, col in UNIFORM[(b + seed) % 2 if windows is None else windows]:
            block = inp["pixel_values"][b, :, row * size:(row + 1) * size, col * size:(col + 1) * size]
            block.copy_(block[:, :1, :1] + 0.1 * torch.randn(block.shape, generator=generator))
    return inp


def entering_tokens(model: nn.Module, inp: dict[str, Tensor]) -> tuple[list[int], list[int]]:
    """The tokens every tower layer and every decoder layer ran on in one prefill (their first norm's input)."""
    tower, llm = [], []
    hooks = [layer.layer_norm1.register_forward_pre_hook(lambda _m, args: tower.append(args[0].shape[1]))
             for layer in model.model.vision_tower.encoder.layers]
    hooks += [layer.input_layernorm.register_forward_pre_hook(lambda _m, args: llm.append(args[0].shape[1]))
              for layer in hf.decoder_layers(model)]
    forward_with_hooks(model, inp, hooks)
    return tower, llm


def measured_plan(model: nn.Module, handle: Any, text: int) -> Any:
    """The accountant's plan of the handle's schedule at the counts its steps measured."""
    arch = architecture(profile_of(model))
    return plan_tokens(arch, at_measured_steps(handle.schedule, handle.measured_steps), text_tokens=text)


# ---- the accountant's plan, batches, generate ------------------------------------------------------------------

@pytest.mark.parametrize("setting", [{}, DROPPING, {"preset": 192}])
def test_tokens_entering_every_layer_equal_the_accountants_plan_at_the_measured_counts(
        model: nn.Module, setting: dict) -> None:
    inp = inputs(model, batch=1, seed=0)
    with torch.no_grad(), ficoco.apply(model, "mustdrop", **setting) as handle:
        tower, llm = entering_tokens(model, inp)
        plan = measured_plan(model, handle, TEXT)
        measured = dict(handle.measured_steps)
        planned = plan_tokens(architecture(profile_of(model)), handle.schedule, text_tokens=TEXT)
    merged = measured[("vision", 1, "layer_input")]
    assert merged % 8 == 0 and merged > 0  # whole windows of 9 tokens, each into one
    assert tower == [entering for entering, _ in plan.vision] == [1 + 81] + [1 + 81 - merged] * 5
    assert llm == [entering for entering, _ in plan.llm]
    assert planned.vision[1][0] == 1 + 81  # the plan assumed no window merged: the count is the image's
    if setting is DROPPING:
        assert llm[-1] < llm[0]  # the filter dropped tokens after layer 2


def test_the_measured_counts_and_the_official_layer_average_reach_the_profile_rows(cli: Any, tmp_path: Path) -> None:
    report = tmp_path / "profile.json"
    result = cli("profile", "--model", "llava-tiny", *SET, "--variant", "mustdrop", "--hp", "global_thr=1",
                 "--hp", "individual_thr=1", "--warmup", "0", "--repeat", "1", "--dtype", "fp32", "--text-tokens",
                 str(TEXT), "--no-reference", "--json", str(report))
    assert result.code == 0, result.err[-2000:]
    row = next(r for r in json.loads(report.read_text())["rows"] if r["variant"] == "mustdrop")
    assert row["status"] == "ok", row.get("reason")
    # Random pixels merge no window; thresholds of 1 drop every token but the key set (ceil(0.08 x 81) = 7).
    steps = {(s["stage"], s["layer"]): s["removed"] for s in row["measured_steps"]}
    assert steps == {("vision", 1): 0, ("vision", 4): 0, ("llm", 3): 81 - 7}
    assert row["analytic"]["visual_tokens"] == 7 and row["analytic"]["settings"]["measured"] is True
    assert row["analytic"]["layer_average_visual_tokens"] == pytest.approx((3 * 81 + 7) / 4)
    assert row["layer_average_visual_tokens_printed"] == pytest.approx((2 * 81 + 2 * 7) / 4)
    assert "counts decided by the input" in row["note"] and "as the official code prints it" in row["note"]


def test_the_rates_time_the_measured_counts_shapes_between_the_timed_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """The counts are the input's own, known from the warm-up: the rates time the shapes of the run as it went
    in every pass after it (between the timed runs too), not in a burst of their own when the prediction asks
    (a burst meets the machine at one moment: on a shared VM that priced LLaVA-1.5-7B's MustDrop 16 % fast)."""
    from ficoco.profiling import predict
    from ficoco.profiling.matrix import ProfileConfig, plan_run, run_profile

    seen: list[predict.MeasuredRates] = []
    original = predict.MeasuredRates.after_warm_up

    def spy(self: predict.MeasuredRates) -> None:
        seen.append(self)
        original(self)

    monkeypatch.setattr(predict.MeasuredRates, "after_warm_up", spy)
    config = ProfileConfig(model="llava-tiny", variants=("mustdrop",), warmup=1, repeat=2, device="cpu",
                           dtype="float32", text_tokens=TEXT, overrides=tuple(OVERRIDES),
                           hyperparameters={"global_thr": 1.0, "individual_thr": 1.0})
    rows: list[dict[str, Any]] = []
    run_profile(config, plan_run(config), rows.append)
    row = rows[-1]
    assert row["status"] == "ok", row.get("reason")
    (rates,) = seen
    # 7 visual tokens from decoder layer 3 on (planned at 64 assumed): its layers' linear shapes, text included.
    ran = {key[1] for key in rates._work if key[0] == "linear"}
    assert TEXT + 7 in ran
    after_warm_up, between = rates._passes[0], rates._passes[1]
    for one in (after_warm_up, between):
        assert any(key[0] == "linear" and key[1] == TEXT + 7 for key in one)


@pytest.mark.parametrize("setting", [{}, {"global_thr": 1.0, "individual_thr": 1.0}])
def test_a_left_padded_batch_equals_its_samples_run_alone(model: nn.Module, setting: dict) -> None:
    """Samples of one image layout (the same window count) and thresholds that leave them one count (none
    dropped; the key set alone)."""
    short, long = inputs(model, seed=1, windows=0), inputs(model, seed=2, text=TEXT + 3, windows=0)
    pad = long["input_ids"].shape[1] - short["input_ids"].shape[1]
    zeros = torch.zeros(1, pad, dtype=torch.long)
    ids = torch.cat([torch.cat([zeros, short["input_ids"]], 1), long["input_ids"]])
    mask = torch.cat([torch.cat([zeros, short["attention_mask"]], 1), long["attention_mask"]])
    batch = {"input_ids": ids, "attention_mask": mask,
             "pixel_values": torch.cat([short["pixel_values"], long["pixel_values"]])}
    with torch.no_grad(), ficoco.apply(model, "mustdrop", **setting) as handle:
        assert_batch_equals_samples_alone(model, handle, batch, [short, long])


def test_generate_matches_a_hand_written_prefill_and_decode_loop(model: nn.Module) -> None:
    inp = inputs(model, batch=1, seed=3)
    prompt = inp["input_ids"].shape[1]
    with torch.no_grad(), ficoco.apply(model, "mustdrop", **DROPPING) as handle:
        generated = model.generate(**inp, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
        out, positions, decoded, cache = prefill_and_decode(model, inp, NEW, handle)
        plan = measured_plan(model, handle, TEXT)
    assert torch.equal(generated[:, :prompt], inp["input_ids"]) and torch.equal(generated[:, prompt:], decoded)
    assert [cache.get_seq_length(i) for i in range(len(plan.llm))] == [entering + NEW - 1 for entering, _ in plan.llm]
    assert out.logits.shape[1] == plan.llm[-1][1] < prompt


def test_no_window_merged_and_nothing_dropped_is_bitwise_vanilla(model: nn.Module) -> None:
    """Random pixels (no window scores 1) and the official default thresholds (nothing dropped in the LLM)."""
    inp = synthetic_inputs(model, batch=2, text_tokens=TEXT, seed=4)
    with torch.no_grad():
        reference = model(**inp).logits
        with ficoco.apply(model, "mustdrop", window_threshold=1.0) as handle:
            assert torch.equal(model(**inp).logits, reference)
            assert set(handle.measured_steps.values()) == {0}


# ---- refusals ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("setting", "words"), [
    ({"keep": 100}, "published for TextVQA's 192, 128, 64-token rows; keep=100 has none"),
    ({"preset": 64, "global_thr": 0.005}, "keep=64 sets MustDrop's thresholds"),
    ({"global_thr": -1.0}, "global_thr=-1.0: give a number >= 0"),
    ({"window_threshold": 2.0}, r"window_threshold=2.0: give a cosine in \[-1, 1\]"),
    ({"window_count": "image"}, "window_count='image': give 'batch'"),
    ({"layers": (6, 2)}, "layers=.*increasing"),
    ({"schedule": "3:10"}, "MustDrop's counts are the input's own"),
])
def test_impossible_settings_are_refused_in_one_line(model: nn.Module, setting: dict, words: str) -> None:
    with pytest.raises(FicocoError, match=words) as info:
        ficoco.apply(model, "mustdrop", **setting)
    assert "\n" not in str(info.value) and "_ficoco_handle" not in model.__dict__


def test_a_batch_whose_samples_keep_different_counts_is_refused_in_one_line(model: nn.Module) -> None:
    inp = inputs(model, batch=2, seed=0)
    with torch.no_grad(), ficoco.apply(model, "mustdrop", **DROPPING):
        with pytest.raises(FicocoError, match=r"kept different counts in the samples of this batch .*one at a "
                                              r"time") as info:
            model(**inp)
    assert "\n" not in str(info.value)


def test_the_per_image_window_count_refuses_images_that_differ_and_the_official_count_couples_them(
        model: nn.Module) -> None:
    inp = inputs(model, batch=2, seed=0)  # 2 and 3 near-uniform windows
    with torch.no_grad(), ficoco.apply(model, "mustdrop", window_count="item") as handle:
        assert handle.schedule.settings_dict()["window_count"] == "item"
        with pytest.raises(FicocoError, match=r"window_count='item': the images of this call have 2\.\.3") as info:
            model(**inp)
    assert "\n" not in str(info.value)
    with torch.no_grad(), ficoco.apply(model, "mustdrop") as handle:
        model(**inp)
        assert handle.measured_steps[("vision", 1, "layer_input")] == 2 * 8  # the fewest: 2 windows each
    from ficoco.methods.registry import method_label

    assert method_label("mustdrop", {"window_count": "item"}) == "MustDrop (ficoco: per-image window count)"


def test_a_grid_that_3x3_windows_do_not_tile_is_refused_in_one_line(cli: Any) -> None:
    line = assert_one_error_line(cli("flops", "--model", "llava-tiny", "--variant", "mustdrop"))
    assert "3 x 3 windows of a square patch grid whose side 3 divides" in line and "64 patches (8 x 8)" in line


@pytest.mark.parametrize("name", ["llava-next-tiny", "video-llava-tiny", "llava-onevision-tiny", "qwen2-vl-tiny",
                                  "internvl3-tiny"])
def test_every_other_family_is_refused_in_one_line_with_the_reason(cli: Any, name: str) -> None:
    line = assert_one_error_line(cli("flops", "--model", name, "--variant", "mustdrop"))
    assert "MustDrop is defined on llava models" in line


# ---- its own work, counted and verified -----------------------------------------------------------------------

def test_flops_plans_the_textvqa_rows_and_the_official_default(flops_report: Any) -> None:
    rows = {preset: flops_report("--model", "llava-1.5-7b", "--variant", "mustdrop", "--preset", preset)["rows"][0]
            for preset in ("192", "128", "64")}
    default = flops_report("--model", "llava-1.5-7b", "--variant", "mustdrop")["rows"][0]
    for preset, (global_thr, individual_thr) in {"192": (0.001, 0.001), "128": (0.0012, 0.001),
                                                 "64": (0.011, 0.01)}.items():
        settings = rows[preset]["settings"]
        assert (settings["global_thr"], settings["individual_thr"]) == (global_thr, individual_thr)
        assert settings["adaptive"] is True and settings["assumed_kept"] == int(preset)
        # Assumed: no window merged, the row's count from layer 3 (after pruning layer 2) on.
        assert rows[preset]["layer_average_visual_tokens"] == pytest.approx((3 * 576 + 29 * int(preset)) / 32)
    assert (default["settings"]["global_thr"], default["settings"]["individual_thr"]) == (1.0, 0.0)
    assert default["visual_tokens"] == 576
    terms = {term["term"] for term in rows["64"]["method_terms"]}
    assert terms == {"mustdrop_window_cosines", "mustdrop_key_set_cls_row", "mustdrop_text_rows"}
    budget = flops_report("--model", "llava-1.5-7b", "--variant", "mustdrop", "--tflops", "3.0")["rows"][0]
    assert budget["settings"]["assumed_kept"] == 64  # the most tokens whose assumed cost fits 3 TFLOPs (llm)


def test_extra_macs_count_the_cosines_the_cls_row_and_the_text_rows() -> None:
    from ficoco.methods.base import Dims, Step, StepContext
    from ficoco.methods.registry import method

    spec = method("mustdrop")
    tower = Dims(hidden=1024, heads=16, kv_heads=16, head_dim=64, ffn=4096)
    merge = StepContext(step=Step(1, 0, 0, "layer_input", "vision"), index=0, seq_before=577, visual_before=576,
                        visual_initial=576, suffix_tokens=40, dims=tower, settings={})
    cut = StepContext(step=Step(22, 0, 0, "tower_output", "vision"), index=1, seq_before=505, visual_before=504,
                      visual_initial=576, suffix_tokens=40, dims=tower, settings={})
    assert spec.extra_macs(merge) == [(1, "mustdrop_window_cosines", 64 * 81 * 1024)]
    assert spec.extra_macs(cut) == [(22, "mustdrop_key_set_cls_row", 16 * 64 * 505)]
    llm = Dims(hidden=4096, heads=32, kv_heads=32, head_dim=128, ffn=11008)
    step = StepContext(step=Step(3, 100), index=0, seq_before=620, visual_before=576, visual_initial=576,
                       suffix_tokens=40, dims=llm, settings={})
    assert spec.inner.extra_macs(step) == [(2, "mustdrop_text_rows", 40 * 620 * 32 * 128)]


def test_flops_verify_passes_at_the_counts_the_run_measured(model: nn.Module) -> None:
    """`ficoco flops --verify`'s run on this module's model: windows merged and tokens dropped, every stage
    (the method's own work too) counted by fvcore and torch's counter as the accountant counts the measured run."""
    from ficoco.profiling.verify import verify_run

    arch = architecture(profile_of(model))
    run = verify_run(model, arch, method_schedule(arch, "mustdrop", **DROPPING), text_tokens=TEXT,
                     inputs=inputs(model, seed=0))
    assert run.plan.vision[1][0] < 82 and run.plan.llm_visual_tokens > run.plan.visual_tokens  # both decided
    assert run.passed(0.5), [s for s in run.stages if not s.within(0.5)]
    method = next(s for s in run.stages if s.stage == "method")
    assert method.analytic > 0


def test_the_cli_verify_passes_on_the_tiny_model(flops_verify: Any) -> None:
    run = flops_verify("--model", "llava-tiny", *SET, "--variant", "mustdrop", "--hp", "global_thr=1",
                       "--hp", "individual_thr=1")["runs"][0]
    stages = {s["stage"]: s for s in run["stages"]}
    assert stages["method"]["analytic_flops"] > 0 and all(s["within_tolerance"] for s in stages.values())


# ---- the CLI ------------------------------------------------------------------------------------------------------

def test_sweep_and_show_run_it_on_the_tiny_model(cli: Any, tmp_path: Path) -> None:
    plan = tmp_path / "sweep.json"  # planned only: the profile's run above measures
    result = cli("sweep", "--model", "llava-tiny", *SET, "--variant", "mustdrop", "--keep", "64", "--json", str(plan))
    assert result.code == 0, result.err[-2000:]
    points = [p for p in json.loads(plan.read_text())["points"] if p["variant"] == "mustdrop"]
    assert [p["analytic"]["visual_tokens"] for p in points] == [64]
    picture, data = tmp_path / "tokens.png", tmp_path / "tokens.json"
    result = cli("show", "--model", "llava-tiny", *SET, "--variant", "mustdrop", "--dtype", "fp32",
                 "--out", str(picture), "--json", str(data))
    assert result.code == 0, result.err[-2000:]
    steps = json.loads(data.read_text())["steps"]
    assert [(s["stage"], s["layer"]) for s in steps][:2] == [("vision", 1), ("vision", 4)]
