"""VScan in ficoco (its official rule is tests/test_rule_vscan.py): the code each family runs, its official settings
and the `--keep` rule, refusals, its reads and extra work in the accountant, and the method inside the tiny models:
the planned tokens at every layer, a left-padded batch, generate, the full keep, flops --verify, one light run per
family (DeepStack's features merged with the tokens on Qwen3-VL), and the CLI's profile, sweep and show.

llava-tiny: a 6-layer CLIP tower whose projector reads layer 4 (64 patches of an 8 x 8 grid per image, [CLS]
first), a 4-layer LLaMA decoder (stage 2 at layer 2), 12 text tokens per prompt.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_batch_equals_samples_alone, assert_one_error_line, forward_with_hooks, prefill_and_decode
from torch import Tensor, nn

import ficoco
from ficoco.accounting import architecture
from ficoco.accounting.methods import method_schedule
from ficoco.accounting.reads import method_reads
from ficoco.accounting.schedule import plan_tokens
from ficoco.api import profile_of
from ficoco.errors import FicocoError
from ficoco.methods import METHODS, Need, ProbePlan, TowerProbe
from ficoco.methods.vscan import ops as vscan_ops
from ficoco.models import hf_compat as hf
from ficoco.models import synthetic_inputs

TINY_PROFILE = "llava-tiny"  # built as this module's `model` (conftest.py)
TEXT = 12
PATCHES = 64
KEEP = 8  # the layer average: stage 1 keeps 12 patches per image, stage 2 at layer 2 keeps 4
FIRST, SECOND = 12, 4
NEW = 4
SPEC = METHODS["vscan"]


def inputs(model: nn.Module, batch: int = 1, seed: int = 0, text: int = TEXT) -> dict[str, Tensor]:
    return synthetic_inputs(model, batch=batch, text_tokens=text, seed=seed)


# ---- the spec ----------------------------------------------------------------------------------------------------

def test_its_probe_plans_read_two_tower_layers_as_they_ran_and_the_rank_layer_s_own_row() -> None:
    as_ran = TowerProbe(probabilities=True)
    assert SPEC.probes == ProbePlan(step_tower_layers=as_ran, named_tower_layers=(("local_layer", as_ran),))
    inner = SPEC.inner.probes
    assert inner.own_query_key_row and inner.own_row_rope == "1d" and inner.previous_layer_rows is None
    assert SPEC.inner.positions == "compact" and SPEC.merges_by_keys
    with pytest.raises(ValueError, match="rope='1d' is a rule of a query_key need's recomputed row only"):
        Need("keys", "L-1", "all", "keys", rope="1d")
    with pytest.raises(ValueError, match="rope 'none' is not one of always, 1d"):
        Need("query_key", "L", "last", "row", rope="none")


@pytest.mark.parametrize("profile,settings,llm_layer", [
    # LLaVA's released scripts: 96 tokens per image (per crop on NeXT), 32 from layer 16; [CLS] rows, 6 x 6 windows.
    ("llava-1.5-7b", {"keep": 96, "llm_keep": 32, "local_layer": 5, "window_size": 6, "scan": "cls"}, 16),
    ("llava-next-7b", {"keep": 96, "llm_keep": 32, "local_layer": 5, "window_size": 6, "scan": "cls"}, 16),
    # LanguageBind's 16 x 16 grid: 96 of 576 as a share, rounded (43), a third of it from the middle layer.
    ("video-llava-7b", {"keep": 43, "llm_keep": 14, "handed": 42, "scan": "cls"}, 16),
    # Qwen2.5-VL's: int(0.167 x n) of the image's 576 merged tokens, int(0.333 x 96) from layer 14; block 7.
    ("qwen2.5-vl-7b", {"keep": 96, "llm_keep": 31, "local_layer": 7, "window_size": 4, "scan": "columns"}, 14),
    ("qwen2-vl-7b", {"keep": 96, "llm_keep": 31, "local_layer": 7, "scan": "columns"}, 14),
    ("internvl3-8b", {"keep": 42, "llm_keep": 13, "local_layer": 5, "scan": "columns"}, 14),
    ("qwen3-vl-8b", {"local_layer": 6, "scan": "columns"}, 18),
    # Qwen3.5's hybrid decoder: the full-attention layer nearest its middle (11 of 3, 7, ..., 23).
    ("qwen3.5-0.8b", {"local_layer": 2, "scan": "columns"}, 11),
    ("qwen2.5-vl-tiny", {"keep": 3, "llm_keep": 1, "local_layer": 2, "scan": "columns"}, 2),
    ("qwen3.5-tiny", {"scan": "columns"}, 7),
])
def test_the_official_default_follows_the_family_s_code(arch_of, profile: str, settings: dict,
                                                        llm_layer: int) -> None:
    schedule = method_schedule(arch_of(profile), "vscan")
    got = schedule.settings_dict()
    assert {name: got[name] for name in settings} == settings
    assert [r.layer for r in schedule.removals if r.stage == "llm"] == [llm_layer]


@pytest.mark.parametrize("preset,first,second", [(64, 96, 32), (128, 192, 64), (192, 288, 96)])
def test_presets_plan_the_layer_average_of_the_official_shape(flops_report, preset: int, first: int,
                                                              second: int) -> None:
    report = flops_report("--model", "llava-1.5-7b", "--variant", "vanilla,vscan", "--preset", str(preset))
    row = next(r for r in report["rows"] if r["variant"] == "vscan")
    assert (row["settings"]["keep"], row["settings"]["llm_keep"]) == (first, second)
    assert row["llm_visual_tokens"] == first and row["visual_tokens"] == second
    assert row["layer_average_visual_tokens"] == preset


def test_keep_beyond_two_thirds_keeps_every_unit_in_stage_one_and_a_tflops_budget_plans(arch_of) -> None:
    settings = method_schedule(arch_of("llava-1.5-7b"), "vscan", 480).settings_dict()
    assert (settings["keep"], settings["llm_keep"]) == (576, 384)  # the middle layer's average is 480 again
    report = ficoco.flops("llava-1.5-7b", "vanilla,vscan", tflops=4.0)
    row = next(r for r in report["rows"] if r["variant"] == "vscan")
    assert row["tflops"] <= 4.0 and 1 <= row["visual_tokens"] < 576


def test_the_llava_local_scan_falls_short_as_the_official_code_does(arch_of) -> None:
    # T = 101: int(101 / 2) = 50 over 16 windows is 3 each (48), two short; the global scan takes its 51 all the same.
    schedule = method_schedule(arch_of("llava-1.5-7b"), "vscan", 67)
    settings = schedule.settings_dict()
    assert settings["keep"] == 101 and settings["handed"] == 51 + 16 * 3
    assert plan_tokens(arch_of("llava-1.5-7b"), schedule).llm_visual_tokens == 99
    # The Qwen code's greedy takes its half exactly.
    assert method_schedule(arch_of("qwen2.5-vl-7b"), "vscan", 67).settings_dict()["handed"] == 101


@pytest.mark.parametrize("profile,setting,message", [
    ("llava-1.5-7b", {"keep": 0}, "keep 0 is outside 1..576"),
    ("llava-1.5-7b", {"keep": 577}, "keep 577 is outside 1..576"),
    ("llava-1.5-7b", {"keep": 64, "global_ratio": 1.5}, "global_ratio=1.5 is outside 0..1"),
    ("llava-1.5-7b", {"keep": 64, "window_size": 0}, "window_size=0: give a window side of at least 1"),
    ("llava-1.5-7b", {"keep": 64, "local_layer": 24}, "local_layer=24 names no layer of this 24-layer vision tower"),
    ("llava-1.5-7b", {"keep": 64, "local_layer": "deep"}, "give a 0-based tower layer"),
    ("llava-1.5-7b", {"keep": 64, "llm_layer": 32}, "the LLM step at layer 32 .* does not fit the decoder"),
    ("llava-1.5-7b", {"keep": 64, "llm_layer": "middle"}, "llm_layer='middle': give a decoder layer"),
    ("llava-1.5-7b", {"keep": 64, "window_size": 2.5}, "window_size=2.5: give a window side"),
])
def test_an_impossible_setting_is_refused_in_one_line(arch_of, profile: str, setting: dict, message: str) -> None:
    keep = setting.pop("keep")
    with pytest.raises(FicocoError, match=message) as info:
        method_schedule(arch_of(profile), "vscan", keep, **setting)
    assert "\n" not in str(info.value)


def test_a_gated_deltanet_rank_layer_and_an_impossible_budget_are_refused_in_one_line(cli) -> None:
    line = assert_one_error_line(cli("flops", "--model", "qwen3.5-0.8b", "--variant", "vscan", "--keep", "64",
                                     "--hp", "llm_layer=12"))
    assert "ranks with layer 12's own attention projections" in line and "Gated DeltaNet" in line
    line = assert_one_error_line(cli("flops", "--model", "llava-1.5-7b", "--variant", "vscan", "--keep", "600"))
    assert "keep 600 is outside 1..576" in line


@pytest.mark.parametrize("profile,layers,kind", [
    ("llava-1.5-7b", (22, 5), "rows"),  # [CLS]'s row of two CLIP layers
    ("qwen2.5-vl-7b", (31, 7), "columns"),  # two full-attention blocks' column sums
])
def test_it_reads_the_two_scans_layers(arch_of, profile: str, layers: tuple[int, int], kind: str) -> None:
    arch = arch_of(profile)
    schedule = method_schedule(arch, "vscan")
    reads = [read for read in method_reads(arch, schedule, plan_tokens(arch, schedule)) if read.stage == "vision"]
    assert sorted({read.layer for read in reads}, reverse=True) == list(layers)
    tokens = arch.vision.tokens(arch.vision.units)
    for layer in layers:
        (read,) = [read for read in reads if read.layer == layer]
        assert (read.kind, read.rows, read.keys, read.pairs) == (kind, 1 if kind == "rows" else tokens, tokens, None)


def test_a_windowed_last_block_is_read_within_its_windows(arch_of) -> None:
    # Qwen2.5-VL's tiny tower: block 3 attends within windows, and the global scan reads it as it ran.
    arch = arch_of("qwen2.5-vl-tiny")
    schedule = method_schedule(arch, "vscan")
    reads = {read.layer: read for read in method_reads(arch, schedule, plan_tokens(arch, schedule))
             if read.stage == "vision"}
    assert sorted(reads) == [2, 3] and arch.vision.windowed(3) and not arch.vision.windowed(2)
    tokens = arch.vision.tokens(arch.vision.units)
    assert reads[3].kind == "columns" and reads[3].pairs is not None and reads[3].pairs < tokens * tokens


def test_its_own_work_is_the_merge_and_stage_two_s_row(arch_of) -> None:
    from ficoco.accounting.methods import extra_macs

    arch = arch_of("llava-1.5-7b")
    schedule = method_schedule(arch, "vscan")
    terms = {term: macs for _, term, macs in extra_macs(arch, schedule, plan_tokens(arch, schedule))}
    seq = plan_tokens(arch, schedule).llm[15][1]  # what layer 15 hands the rank layer
    assert terms == {"vscan_merge_similarity": 480 * 96 * 4096, "vscan_k_proj": seq * 4096 * 4096,
                     "vscan_q_proj_last_row": 4096 * 4096, "vscan_last_row_scores": 4096 * seq}


# ---- the tensor functions ----------------------------------------------------------------------------------------

def test_the_merge_leaves_riding_channels_out_of_its_similarities_and_merges_them_alike() -> None:
    torch.manual_seed(0)
    hidden, riding = torch.randn(2, 10, 6), torch.randn(2, 10, 3) * 100
    kept = torch.tensor([[0, 3, 7], [1, 2, 9]])
    plain, discarded, target = vscan_ops.merge_into_kept(hidden, kept)
    carried, discarded_too, target_too = vscan_ops.merge_into_kept(torch.cat([hidden, riding], -1), kept, riding=3)
    assert torch.equal(target, target_too) and torch.equal(discarded, discarded_too)
    torch.testing.assert_close(carried[..., :6], plain)
    expected = torch.stack([torch.stack([
        torch.cat([riding[b, kept[b, k]][None], riding[b, discarded[b][target[b] == k]]]).mean(0)
        for k in range(3)]) for b in range(2)])
    torch.testing.assert_close(carried[..., 6:], expected)
    # Every other unit went to its most cosine-similar kept one.
    similar = F.cosine_similarity(vscan_ops.gather_tokens(hidden, discarded).unsqueeze(2),
                                  vscan_ops.gather_tokens(hidden, kept).unsqueeze(1), dim=-1).argmax(-1)
    assert torch.equal(similar, target)


def test_the_qwen_greedy_fills_its_shortfall_from_the_global_scan() -> None:
    # One 4 x 4 grid, windows of 2: a cap of ceil(7 / 4) = 2 a window; the local scores favour one window, so the
    # greedy takes 2 there and walks on; T is kept whatever the caps allow.
    local = torch.arange(16.0).flip(0)[None]
    kept = vscan_ops.vscan_select(local, torch.rand(1, 16), 14, (4, 4), 2, "columns")
    assert kept.shape == (1, 14) and torch.equal(kept, kept.sort().values)


def test_a_windowed_layer_s_reads_in_another_order_are_its_block_diagonal_permuted() -> None:
    from ficoco.methods.reads.ops import DenseAttention, SegmentedReads

    torch.manual_seed(3)
    windows = [torch.softmax(torch.randn(1, n, n), dim=-1) for n in (3, 5, 4)]
    dense = torch.block_diag(*(w[0] for w in windows))[None]  # (1, 12, 12): no attention across windows
    order = torch.randperm(12)  # the image's grid order of the window-ordered tokens
    reads = SegmentedReads([DenseAttention(w) for w in windows]).reordered(order)
    expected = dense[:, order][:, :, order]
    rows, cols = torch.tensor([[0, 7, 11]]), torch.tensor([[2, 5]])
    torch.testing.assert_close(reads.column_sum(), expected.sum(dim=1))
    torch.testing.assert_close(reads.column_sum(rows), expected[:, rows[0]].sum(dim=1))
    torch.testing.assert_close(reads.column_mean(), expected.mean(dim=1))
    torch.testing.assert_close(reads.column_mean(first_row=4), expected[:, 4:].mean(dim=1))
    torch.testing.assert_close(reads.rows(rows), expected[:, rows[0]])
    torch.testing.assert_close(reads.block(rows, cols), expected[:, rows[0]][:, :, cols[0]])
    again = torch.randperm(12)
    torch.testing.assert_close(reads.reordered(again).column_sum(), expected[:, again][:, :, again].sum(dim=1))


# ---- in the model ------------------------------------------------------------------------------------------------

def entering(model: nn.Module, inp: dict[str, Tensor]) -> list[int]:
    """Tokens every decoder layer's attention ran on in one forward."""
    seen: list[int] = []
    hooks = [layer.self_attn.register_forward_pre_hook(
        lambda m, args, kwargs: seen.append((args[0] if args else kwargs["hidden_states"]).shape[1]),
        with_kwargs=True) for layer in model.model.language_model.layers]
    forward_with_hooks(model, inp, hooks)
    return seen


def test_tokens_of_every_decoder_layer_equal_the_plan(model: nn.Module) -> None:
    inp = inputs(model, batch=2)
    with ficoco.apply(model, "vscan", keep=KEEP) as handle:
        llm = entering(model, inp)
        plan = plan_tokens(architecture(profile_of(model)), handle.schedule, text_tokens=TEXT)
        vision, stage_two = handle.records
    assert llm == [n_in for n_in, _ in plan.llm]
    assert llm[0] == TEXT + FIRST and llm[2] == TEXT + SECOND and handle.measured_tokens_per_item == FIRST
    assert vision.layer == 4 and vision.kept.shape == (2, FIRST) and stage_two.layer == 2
    assert stage_two.kept.shape == (2, SECOND)
    for kept, gone in zip(vision.kept, vision.discarded, strict=True):
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
    with torch.no_grad(), ficoco.apply(model, "vscan", keep=KEEP, window_size=4) as handle:
        assert_batch_equals_samples_alone(model, handle, batch, alone)


def test_generate_matches_a_hand_written_prefill_and_decode_loop(model: nn.Module) -> None:
    inp = inputs(model, batch=2, seed=3)
    prompt = inp["input_ids"].shape[1]
    with torch.no_grad(), ficoco.apply(model, "vscan", keep=KEEP) as handle:
        generated = model.generate(**inp, max_new_tokens=NEW, do_sample=False, min_new_tokens=NEW)
        out, positions, decoded, cache = prefill_and_decode(model, inp, NEW, handle)
    assert torch.equal(generated[:, :prompt], inp["input_ids"]) and torch.equal(generated[:, prompt:], decoded)
    # Layers before the rank layer cache every token stage 1 handed on, the later ones the kept.
    assert cache.get_seq_length(0) == prompt - PATCHES + FIRST + NEW - 1
    assert cache.get_seq_length(3) == prompt - PATCHES + SECOND + NEW - 1
    assert positions.shape == out.logits.shape[:2] == (2, prompt - PATCHES + SECOND)


def test_a_full_keep_is_bitwise_vanilla(model: nn.Module) -> None:
    inp = inputs(model, batch=2)
    with torch.no_grad():
        reference = model(**inp).logits
        with ficoco.apply(model, "vscan", keep=PATCHES) as handle:
            out = model(**inp).logits
    assert not handle.schedule.removals and torch.equal(out, reference)


def test_flops_verify_counts_its_reads_merge_and_row(flops_verify) -> None:
    # Qwen2.5-VL's tiny tower: the local layer a full block (2), the global one a window block (3) read within its
    # windows; the merge on the merger's output, stage 2's row at decoder layer 2 (no RoPE).
    (run,) = flops_verify("--model", "qwen2.5-vl-tiny", "--variant", "vscan", "--keep", "8")["runs"]
    stages = {stage["stage"]: stage for stage in run["stages"]}
    assert all(stage["within_tolerance"] for stage in stages.values())
    assert stages["method"]["analytic_flops"] > 0 and stages["probe"]["analytic_flops"] > 0


# ---- every family ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("profile", ["llava-next-tiny", "video-llava-tiny", "llava-onevision-tiny", "internvl3-tiny",
                                     "qwen2-vl-tiny", "qwen3.5-tiny"])  # Qwen3-VL: the DeepStack test below
def test_every_family_hands_the_decoder_the_planned_tokens(profile: str) -> None:
    family_model = ficoco.build_model(profile, dtype="fp32")
    inp = synthetic_inputs(family_model, batch=1, text_tokens=TEXT, seed=2)
    arch = architecture(profile_of(family_model))
    keep = max(2, arch.vision.units // 3)
    seen: list[int] = []
    layers = hf.decoder_layers(family_model)
    with ficoco.apply(family_model, "vscan", keep=keep) as handle:
        hooks = [layer.register_forward_pre_hook(
            lambda m, args, kwargs: seen.append((args[0] if args else kwargs["hidden_states"]).shape[1]),
            with_kwargs=True) for layer in layers]
        forward_with_hooks(family_model, inp, hooks)
        plan = plan_tokens(arch, handle.schedule, text_tokens=TEXT)
        vision, stage_two = handle.records
    # What every layer receives: the previous layer's output (a step at a layer's input shortens it there).
    assert seen == [plan.llm[0][0], *(n_out for _, n_out in plan.llm[:-1])]
    assert plan.llm_visual_tokens < arch.visual_tokens
    assert vision.kept.shape[1] == handle.schedule.settings_dict()["handed"] * arch.vision.merge
    assert stage_two.layer == plan.reductions[-1].layer


def test_qwen3_vl_deepstack_features_are_merged_with_the_tokens() -> None:
    family_model = ficoco.build_model("qwen3-vl-tiny", dtype="fp32")
    inp = synthetic_inputs(family_model, batch=1, text_tokens=TEXT, seed=2)
    cols = int(inp["image_grid_thw"][0, 2])
    with torch.no_grad():
        reference = family_model.model.get_image_features(inp["pixel_values"], inp["image_grid_thw"])
        with ficoco.apply(family_model, "vscan", keep=10) as handle:
            reduced = family_model.model.get_image_features(inp["pixel_values"], inp["image_grid_thw"])
    patches = handle.records[0].kept[0]
    groups = torch.unique((patches // cols) // 2 * (cols // 2) + (patches % cols) // 2)  # the kept merge groups
    (full,) = getattr(reference, hf.FEATURES_FIELD)
    merged, discarded, target = vscan_ops.merge_into_kept(full[None], groups[None])
    torch.testing.assert_close(getattr(reduced, hf.FEATURES_FIELD)[0], merged[0])
    # Every DeepStack tap's features merged by the same assignment (decided on the merger's output alone).
    for (tap,), (kept_tap,) in zip(getattr(reference, hf.DEEPSTACK_FEATURES_FIELD),
                                   getattr(reduced, hf.DEEPSTACK_FEATURES_FIELD), strict=True):
        expected = torch.stack([torch.cat([tap[group][None], tap[discarded[0][target[0] == k]]]).mean(0)
                                for k, group in enumerate(groups.tolist())])
        torch.testing.assert_close(kept_tap, expected)


# ---- the CLI -------------------------------------------------------------------------------------------------

def test_profile_sweep_and_show_run_it(cli, tmp_path: Path) -> None:
    path = tmp_path / "profile.json"
    code, out, err = cli("profile", "--model", "llava-tiny", "--variant", "vscan", "--keep", str(KEEP), "--quant",
                         "fp16", "--warmup", "0", "--repeat", "1", "--no-reference", "--json", str(path))
    assert code == 0, err
    (row,) = json.loads(path.read_text())["rows"]
    assert row["variant"] == "vscan" and row["analytic"]["visual_tokens"] == SECOND
    sweep = tmp_path / "sweep.json"
    code, _, err = cli("sweep", "--model", "llava-tiny", "--variant", "vscan", "--keep", "16,8", "--json", str(sweep))
    assert code == 0, err
    points = [p for p in json.loads(sweep.read_text())["points"] if p["variant"] == "vscan"]
    assert sorted(p["analytic"]["layer_average_visual_tokens"] for p in points) == [8.0, 16.0]
    picture, data = tmp_path / "tokens.png", tmp_path / "tokens.json"
    code, _, err = cli("show", "--model", "llava-tiny", "--variant", "vscan", "--keep", str(KEEP), "--out",
                       str(picture), "--json", str(data), "--dtype", "fp32")
    assert code == 0, err
    steps = json.loads(data.read_text())["steps"]
    assert picture.stat().st_size > 0 and len(steps[0]["records"]["kept"][0]) == FIRST


def test_the_spec_s_departures_are_stated_on_its_page() -> None:
    page = (Path(__file__).parents[1] / "docs" / "methods" / "vscan.md").read_text()
    for words in ("min(96", "divides by zero", "without RoPE", "twice", "Tencent/SelfEvolvingAgent", "a82450e"):
        assert words in page
    assert dataclasses.replace(SPEC).name == "vscan"
