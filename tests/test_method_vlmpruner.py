"""VLM-Pruner inside the models (its official rule: tests/test_rule_vlmpruner.py): the accountant's plan at the count
the run measured, batches, generate, vanilla edges, refusals, its own work counted and verified, the CLI, and every
family's images' grids as the decoder adapters hand them (`StepInput.images`).

llava-tiny: a 4-layer LLaMA decoder, one image span of 64 visual tokens (an 8 x 8 grid), 12 text tokens per prompt.
"""

from __future__ import annotations

import contextlib
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
from ficoco.accounting.methods import at_measured_count
from ficoco.accounting.schedule import plan_tokens
from ficoco.api import profile_of
from ficoco.errors import FicocoError
from ficoco.methods.inputs import ImageGrids, TokenGrid
from ficoco.models import adapter_for, synthetic_inputs
from ficoco.models import hf_compat as hf

TINY_PROFILE = "llava-tiny"  # built as this module's `model` (conftest.py)
TEXT = 12
VISUAL = 64
KEEP = 20
NEW = 4


def inputs(model: nn.Module, batch: int = 1, seed: int = 0, text: int = TEXT) -> dict[str, Tensor]:
    return synthetic_inputs(model, batch=batch, text_tokens=text, seed=seed)


def entering_tokens(model: nn.Module, inp: dict[str, Tensor]) -> list[int]:
    """The sequence length every decoder layer ran on in one prefill (pre-hooks on its first norm, which every
    family's decoder layer names `input_layernorm`, Gated DeltaNet layers too)."""
    seen: list[int] = []
    hooks = [layer.input_layernorm.register_forward_pre_hook(lambda _m, args: seen.append(args[0].shape[1]))
             for layer in hf.decoder_layers(model)]
    forward_with_hooks(model, inp, hooks)
    return seen


def measured_plan(model: nn.Module, handle: Any, text: int) -> Any:
    """The accountant's plan of the handle's schedule at the count its step measured."""
    arch = architecture(profile_of(model))
    return plan_tokens(arch, at_measured_count(arch, handle.schedule, handle.measured_tokens_per_item),
                       text_tokens=text)


@contextlib.contextmanager
def alike_images(model: nn.Module, inp: dict[str, Tensor], samples: tuple[int, ...]) -> Iterator[None]:
    """Layer 1's output with the image tokens of `samples` all but alike: their selection ends at the pivots."""
    image = inp["input_ids"] == model.config.image_token_id

    def hook(_module: Any, _args: Any, output: Any) -> Any:
        hidden = output[0] if isinstance(output, tuple) else output
        for b in samples:
            rows = image[b].nonzero().flatten()
            span = hidden[b, rows]
            hidden[b, rows] = span.mean(dim=0) + 1e-3 * torch.randn(span.shape,
                                                                    generator=torch.Generator().manual_seed(b))
        return output

    handle = hf.decoder_layers(model)[1].register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


# ---- the accountant's plan, batches, generate ------------------------------------------------------------------

def test_tokens_entering_every_layer_equal_the_accountants_plan(model: nn.Module) -> None:
    inp = inputs(model, batch=2)
    with torch.no_grad(), ficoco.apply(model, "vlmpruner", keep=KEEP) as handle:
        seen = entering_tokens(model, inp)
        record = handle.records[0]
        assert handle.measured_tokens_per_item == KEEP  # these prompts reach the budget
        plan = measured_plan(model, handle, TEXT)
    assert seen == [entering for entering, _ in plan.llm]
    assert seen == [TEXT + VISUAL] * 2 + [TEXT + KEEP] * 2  # layer 2 on: the kept tokens
    assert tuple(record.kept.shape) == (2, KEEP) and tuple(record.merged_into.shape) == (2, VISUAL - KEEP)
    assert set(record.merged_into.flatten().tolist()) <= set(record.kept.flatten().tolist())


def test_a_selection_that_ends_early_is_measured_and_the_plan_follows_it(model: nn.Module) -> None:
    inp = inputs(model, batch=2)
    with torch.no_grad(), alike_images(model, inp, (0, 1)), ficoco.apply(model, "vlmpruner", keep=KEEP) as handle:
        seen = entering_tokens(model, inp)
        assert handle.measured_tokens_per_item == 4  # the pivots alone: the first round kept nothing
        plan = measured_plan(model, handle, TEXT)
        planned = plan_tokens(architecture(profile_of(model)), handle.schedule, text_tokens=TEXT)
    assert seen == [entering for entering, _ in plan.llm] == [TEXT + VISUAL] * 2 + [TEXT + 4] * 2
    assert planned.llm[-1][0] == TEXT + KEEP  # what was planned: the budget, an upper bound


def test_a_batch_whose_samples_end_at_different_counts_is_refused_in_one_line(model: nn.Module) -> None:
    inp = inputs(model, batch=2)
    with torch.no_grad(), alike_images(model, inp, (0,)), ficoco.apply(model, "vlmpruner", keep=KEEP):
        with pytest.raises(FicocoError, match=r"different counts in the samples of this batch \(4, 20 .*one at a "
                                              r"time") as info:
            model(**inp)
    assert "\n" not in str(info.value)


def test_a_left_padded_batch_equals_its_samples_run_alone(model: nn.Module) -> None:
    short, long = inputs(model, seed=1), inputs(model, seed=2, text=TEXT + 3)
    pad = long["input_ids"].shape[1] - short["input_ids"].shape[1]
    zeros = torch.zeros(1, pad, dtype=torch.long)
    ids = torch.cat([torch.cat([zeros, short["input_ids"]], 1), long["input_ids"]])
    mask = torch.cat([torch.cat([zeros, short["attention_mask"]], 1), long["attention_mask"]])
    # Position ids from the padding mask, as generate gives them: the pivots are L1 norms of post-RoPE keys.
    batch = {"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(1) - 1).clamp(min=0),
             "pixel_values": torch.cat([short["pixel_values"], long["pixel_values"]])}
    with torch.no_grad(), ficoco.apply(model, "vlmpruner", keep=KEEP) as handle:
        assert_batch_equals_samples_alone(model, handle, batch, [short, long])


def test_generate_matches_a_hand_written_prefill_and_decode_loop(model: nn.Module) -> None:
    inp = inputs(model, batch=2, seed=3)
    prompt = inp["input_ids"].shape[1]
    with torch.no_grad(), ficoco.apply(model, "vlmpruner", keep=KEEP) as handle:
        generated = model.generate(**inp, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
        out, positions, decoded, cache = prefill_and_decode(model, inp, NEW, handle)
        plan = measured_plan(model, handle, TEXT)
    assert torch.equal(generated[:, :prompt], inp["input_ids"]) and torch.equal(generated[:, prompt:], decoded)
    assert [cache.get_seq_length(i) for i in range(len(plan.llm))] == [entering + NEW - 1 for entering, _ in plan.llm]
    # Original positions: the last prompt token is still at its input position.
    assert torch.equal(positions[:, -1], torch.full((2,), prompt - 1))


@pytest.mark.parametrize("setting", [{"keep": VISUAL}, {"schedule": {}}])
def test_a_full_keep_or_an_empty_schedule_is_bitwise_vanilla(model: nn.Module, setting: dict) -> None:
    inp = inputs(model, batch=2)
    with torch.no_grad():
        reference = model(**inp).logits
        with ficoco.apply(model, "vlmpruner", **setting) as handle:
            assert handle.schedule.removals == ()
            assert torch.equal(model(**inp).logits, reference)


def test_several_images_are_selected_together_each_on_its_own_grid(model: nn.Module) -> None:
    first, second = inputs(model, seed=0), inputs(model, seed=10)
    ids = torch.cat([first["input_ids"], second["input_ids"][:, 1:]], 1)
    inp = {"input_ids": ids, "attention_mask": torch.ones_like(ids),
           "pixel_values": torch.cat([first["pixel_values"], second["pixel_values"]])}
    grids = adapter_for(model).image_grids("VLM-Pruner", ids)
    assert grids == ((ImageGrids(0, VISUAL, (TokenGrid(0, 8, 8, 8),), (8, 8)),
                      ImageGrids(VISUAL, VISUAL, (TokenGrid(VISUAL, 8, 8, 8),), (8, 8))),)
    with torch.no_grad(), ficoco.apply(model, "vlmpruner", keep=KEEP) as handle:
        model(**inp)
        kept = handle.records[0].kept[0]
        assert handle.measured_tokens_per_item is None  # two images: the prompt's count, not one image's
    assert kept.numel() == 2 * KEEP and bool((kept < VISUAL).any()) and bool((kept >= VISUAL).any())


# ---- refusals ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("setting", "words"), [
    ({"keep": 3}, "keeps its 4 pivots whatever the budget: keep=3"),
    ({"keep": 65}, "outside 1..64"),
    ({"keep": KEEP, "bss_grid": "patches"}, "bss_grid='patches': give 'official'"),
    ({"keep": KEEP, "budget_rounding": "floor"}, "budget_rounding='floor'"),
    ({"keep": KEEP, "token_batch": 0}, "token_batch=0 must be at least 1"),
])
def test_impossible_settings_are_refused_in_one_line(model: nn.Module, setting: dict, words: str) -> None:
    with pytest.raises(FicocoError, match=words.replace("(", r"\(").replace(")", r"\)")) as info:
        ficoco.apply(model, "vlmpruner", **setting)
    assert "\n" not in str(info.value) and "_ficoco_handle" not in model.__dict__


def test_the_cli_refuses_an_impossible_budget_in_one_line(cli: Any) -> None:
    line = assert_one_error_line(cli("flops", "--model", "llava-1.5-7b", "--variant", "vlmpruner", "--keep", "2"))
    assert "pivots" in line


# ---- its own work, counted and verified -----------------------------------------------------------------------

def test_flops_plans_the_literatures_rows_and_the_official_default(flops_report: Any) -> None:
    rows = {}
    for preset in ("192", "128", "64"):
        row = flops_report("--model", "llava-1.5-7b", "--variant", "vlmpruner", "--preset", preset)["rows"][0]
        rows[preset] = row
    default = flops_report("--model", "llava-1.5-7b", "--variant", "vlmpruner")["rows"][0]
    for preset, row in rows.items():
        kept = int(preset)
        assert row["settings"]["keep"] == kept and row["settings"]["adaptive"] is True
        assert row["layer_average_visual_tokens"] == pytest.approx((kept * 30 + 576 * 2) / 32)
    assert default["settings"]["keep"] == 128  # --reduction_ratio 0.778
    terms = {term for term in json.dumps(rows["192"]).split('"') if term.startswith("vlmpruner_")}
    assert terms == {"vlmpruner_pivot_key_distances", "vlmpruner_channel_cosine", "vlmpruner_grid_distances",
                     "vlmpruner_swa_merge"}


def test_extra_macs_count_the_products_of_its_step() -> None:
    from ficoco.methods.base import Dims, Step, StepContext
    from ficoco.methods.registry import method

    dims = Dims(hidden=4096, heads=32, kv_heads=32, head_dim=128, ffn=11008)
    ctx = StepContext(step=Step(2, 576 - 192), index=0, seq_before=636, visual_before=576, visual_initial=576,
                      suffix_tokens=25, dims=dims, settings={"keep": 192, "pivot_image_token": 4, "channels": 256})
    terms = {name: macs for _, name, macs in method("vlmpruner").extra_macs(ctx)}
    assert terms == {"vlmpruner_pivot_key_distances": 3 * 576 * 4096, "vlmpruner_channel_cosine": 576 * 576 * 256,
                     "vlmpruner_grid_distances": 576 * 576 * 2, "vlmpruner_swa_merge": 384 * 192 * 4096}


def test_flops_verify_passes_with_its_work_as_its_own_stage(flops_verify: Any) -> None:
    run = flops_verify("--model", "llava-tiny", "--variant", "vlmpruner", "--keep", str(KEEP))["runs"][0]
    stages = {s["stage"]: s for s in run["stages"]}
    assert stages["method"]["analytic_flops"] > 0 and all(s["within_tolerance"] for s in stages.values())


# ---- the CLI ------------------------------------------------------------------------------------------------------

def test_profile_sweep_and_show_run_it_on_a_tiny_model(cli: Any, tmp_path: Path) -> None:
    report = tmp_path / "profile.json"
    result = cli("profile", "--model", "llava-tiny", "--variant", "vlmpruner", "--keep", str(KEEP), "--warmup", "0",
                 "--repeat", "1", "--dtype", "fp32", "--text-tokens", str(TEXT), "--no-reference",
                 "--json", str(report))
    assert result.code == 0, result.err[-2000:]
    rows = {row["variant"]: row for row in json.loads(report.read_text())["rows"]}
    assert rows["vlmpruner"]["status"] == "ok" and rows["vlmpruner"]["visual_tokens_per_item_measured"] == KEEP
    plan = tmp_path / "sweep.json"  # planned only: measuring a sweep's points is the profile's run above
    result = cli("sweep", "--model", "llava-tiny", "--variant", "vlmpruner", "--keep", f"{KEEP},8", "--json", str(plan))
    assert result.code == 0, result.err[-2000:]
    points = json.loads(plan.read_text())["points"]
    assert sorted(p["analytic"]["visual_tokens"] for p in points if p["variant"] == "vlmpruner") == [8, KEEP]
    picture, data = tmp_path / "tokens.png", tmp_path / "tokens.json"
    result = cli("show", "--model", "llava-tiny", "--variant", "vlmpruner", "--keep", str(KEEP), "--dtype", "fp32",
                 "--out", str(picture), "--json", str(data))
    assert result.code == 0, result.err[-2000:]
    step = json.loads(data.read_text())["steps"][0]
    assert len(step["records"]["kept"][0]) == KEEP and len(step["records"]["merged_into"][0]) == VISUAL - KEEP


# ---- every family: the images' grids its adapter hands, and a run at the accountant's (measured) plan ----------

def grids(start: int, tokens: int, pieces: list[tuple[int, int, int, int]], patches: tuple[int, int]) -> ImageGrids:
    return ImageGrids(start, tokens, tuple(TokenGrid(*piece) for piece in pieces), patches)


# (profile, settings, the first sample's images as its adapter lays them out)
FAMILIES = [
    # The base view's 4 x 4 grid, then the unpadded 8 x 8 crop grid, a newline after every row (stride 9).
    ("llava-next-tiny", {"keep": 24, "bss_grid": "tokens"}, grids(0, 88, [(0, 4, 4, 4), (16, 8, 8, 9)], (4, 4))),
    ("llava-onevision-tiny", {"keep": 24}, grids(0, 88, [(0, 4, 4, 4), (16, 8, 8, 9)], (4, 4))),
    # Four frames of [CLS] and 4 x 4 patches: the [CLS] on no grid.
    ("video-llava-tiny", {"keep": 24, "bss_grid": "tokens"},
     grids(0, 68, [(1, 4, 4, 4), (18, 4, 4, 4), (35, 4, 4, 4), (52, 4, 4, 4)], (4, 4))),
    # The merged token grid; image_grid_thw's patch grid, twice as tall and wide.
    ("qwen2-vl-tiny", {"keep": 8, "bss_grid": "tokens"}, grids(0, 16, [(0, 4, 4, 4)], (8, 8))),
    ("qwen2.5-vl-tiny", {"keep": 8}, grids(0, 20, [(0, 5, 4, 4)], (10, 8))),
    ("qwen3-vl-tiny", {"keep": 24, "bss_grid": "tokens"}, grids(0, 80, [(0, 8, 10, 10)], (16, 20))),
    ("qwen3-vl-moe-tiny", {"keep": 24}, grids(0, 80, [(0, 8, 10, 10)], (16, 20))),
    # Layer 4: after the full-attention layer 3 (layer 1, which layer 2's step would read, is Gated DeltaNet).
    ("qwen3.5-tiny", {"keep": 24, "layer": 4, "bss_grid": "tokens"}, grids(0, 80, [(0, 8, 10, 10)], (16, 20))),
    # Three tiles of 4 x 4 tokens, each pixel-shuffled from 8 x 8 patches.
    ("internvl3-tiny", {"keep": 16, "bss_grid": "tokens"},
     grids(0, 48, [(0, 4, 4, 4), (16, 4, 4, 4), (32, 4, 4, 4)], (8, 8))),
]


@pytest.mark.parametrize(("name", "setting", "image"), FAMILIES, ids=[f[0] for f in FAMILIES])
def test_every_family_hands_its_images_grids_and_runs_the_plan(name: str, setting: dict, image: ImageGrids) -> None:
    """One forward per family (generate and batches are checked on LLaVA-1.5 above: the decoder's patch is
    shared; the families differ in the grids their adapters hand and in their positions)."""
    model = ficoco.build_model(name, dtype="fp32")
    inp = synthetic_inputs(model, batch=2, text_tokens=TEXT)
    adapter = adapter_for(model)
    with adapter.call_scope(inp, generating=False):
        assert adapter.image_grids("VLM-Pruner", inp["input_ids"]) == ((image,), (image,))
    text = inp["input_ids"].shape[1] - image.tokens
    with torch.no_grad(), ficoco.apply(model, "vlmpruner", **setting) as handle:
        seen = entering_tokens(model, inp)
        assert handle.measured_tokens_per_item == setting["keep"]
        plan = measured_plan(model, handle, text)
    assert seen == [entering for entering, _ in plan.llm] and min(seen) == text + setting["keep"]


def test_a_onevision_video_lays_every_frame_out_on_its_pooled_grid() -> None:
    from ficoco.models.llava_onevision import synthetic_inputs as onevision_inputs

    model = ficoco.build_model("llava-onevision-tiny", dtype="fp32")
    inp = onevision_inputs(model, batch=1, text_tokens=TEXT, frames=3)
    # Three frames of 2 x 2 pooled tokens, then the video's one newline (on no grid).
    video = grids(0, 13, [(0, 2, 2, 2), (4, 2, 2, 2), (8, 2, 2, 2)], (4, 4))
    assert adapter_for(model).image_grids("VLM-Pruner", inp["input_ids"]) == ((video,),)
    with torch.no_grad(), ficoco.apply(model, "vlmpruner", keep=6, frames=3, bss_grid="tokens") as handle:
        model(**inp)
        kept = handle.records[0].kept
        assert kept.shape[1] == handle.measured_tokens_per_item <= 6  # its selection may end early


@pytest.mark.parametrize(("name", "setting", "words"), [
    ("qwen3.5-tiny", {"keep": 24}, "reads layer 1's attention keys, and layer 1 of this Qwen3.5 decoder is Gated "
                                   "DeltaNet"),
    ("qwen3-vl-tiny", {"keep": 24, "layer": 1}, "folds the visual tokens it removes at decoder layer 1 .* DeepStack "
                                                r"still adds .*\(layer=2\)"),
])
def test_a_step_the_family_cannot_take_is_refused_in_one_line(name: str, setting: dict, words: str) -> None:
    """The model refuses it at apply, and the accountant in the same words (`ficoco flops` prices no run that
    cannot happen)."""
    from ficoco.accounting import CountOptions, architecture, resolve_schedule
    from ficoco.profiles import load_profile

    model = ficoco.build_model(name, dtype="fp32")
    with pytest.raises(FicocoError, match=words) as info:
        ficoco.apply(model, "vlmpruner", **setting)
    assert "\n" not in str(info.value) and "_ficoco_handle" not in model.__dict__
    hyperparameters = {k: v for k, v in setting.items() if k != "keep"}
    with pytest.raises(FicocoError) as planned:
        resolve_schedule(architecture(load_profile(name)), "vlmpruner", CountOptions(), keep=setting["keep"],
                         hyperparameters=hyperparameters)
    assert str(planned.value) == str(info.value)


def test_its_default_layer_on_qwen3_vl_is_refused_by_the_accountant_and_layer_3_planned() -> None:
    """Qwen3-VL-8B's DeepStack adds after decoder layers 0..2, and the official default step is at layer 2: `ficoco
    flops` refuses it as the model does, and plans the step at layer 3 that the model runs."""
    from ficoco.accounting import CountOptions, architecture, resolve_schedule
    from ficoco.profiles import load_profile

    arch = architecture(load_profile("qwen3-vl-8b"))
    with pytest.raises(FicocoError, match=r"decoder layer 2 .* give its step a layer from 3 on \(layer=3\)"):
        resolve_schedule(arch, "vlmpruner", CountOptions(), keep=144)
    schedule = resolve_schedule(arch, "vlmpruner", CountOptions(), keep=144, hyperparameters={"layer": 3})
    assert [(r.stage, r.layer) for r in schedule.removals] == [("llm", 3)]
