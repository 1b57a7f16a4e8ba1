"""The `ficoco` command: help, version, models, the flops report, and one-line errors.

Exit codes and streams are checked on real subprocesses; the report's content is checked
in-process (faster) through the same Typer app (both through the suite's runner, `cli`).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import assert_one_error_line

import ficoco
from ficoco.accounting import CountOptions, compute_tera
from ficoco.accounting.schedule import uniform_schedule

PROFILES = [
    "llava-1.5-13b", "llava-1.5-7b", "llava-gqa-tiny", "llava-next-7b", "llava-next-tiny", "llava-onevision-7b",
    "llava-onevision-tiny", "llava-tiny", "qwen2-vl-7b", "qwen2-vl-tiny", "video-llava-7b", "video-llava-tiny",
]
STAGES = ["vision", "projector", "llm", "lm_head"]
SCOPE_STAGES = {"llm": ["llm", "lm_head"], "all": STAGES}


# ---- help, version, models ---------------------------------------------------------------------------------

def test_help_lists_models_and_flops_with_descriptions(cli):
    result = cli("--help", in_subprocess=True)
    assert result.code == 0
    commands = {line.split()[0]: line.split(None, 1)[1:] for line in result.out.splitlines()
                if line.strip() and line.split()[0] in ("models", "flops")}
    assert set(commands) == {"models", "flops"}
    assert all(description and description[0].strip() for description in commands.values())


def test_flops_help_names_the_options(cli):
    result = cli("flops", "--help", in_subprocess=True)
    assert result.code == 0
    for option in ("--model", "--variant", "--keep", "--tflops", "--schedule", "--convention", "--scope",
                   "--equivalent", "--quant", "--gpu", "--json"):
        assert option in result.out


def test_version(cli):
    result = cli("--version", in_subprocess=True)
    assert result.code == 0
    assert result.out.splitlines()[0] == f"ficoco {ficoco.__version__}"  # then the packages (test_versions.py)


def test_models_lists_every_profile(cli):
    result = cli("models", in_subprocess=True)
    assert result.code == 0, result.err
    for name in PROFILES:
        assert name in result.out


def test_flops_default_run_exits_zero_and_prints_the_vanilla_total(cli):
    result = cli("flops", "--model", "llava-1.5-7b", in_subprocess=True)
    assert result.code == 0, result.err
    assert "llava-1.5-7b" in result.out
    assert "8.617" in result.out  # vanilla, flops convention, scope llm
    assert result.err == ""


# ---- JSON report --------------------------------------------------------------------------------------------

def test_json_path_writes_the_flops_report(tmp_path, cli):
    path = tmp_path / "flops.json"
    result = cli("flops", "--model", "llava-1.5-7b", "--variant", "vanilla,v,l", "--keep", "64",
                 "--quant", "fp16,int8", "--gpu", "a100-80gb", "--json", str(path), in_subprocess=True)
    assert result.code == 0, result.err
    report = json.loads(path.read_text())
    assert report["schema"] == "ficoco.flops/1"
    assert report["model"] == "llava-1.5-7b"
    assert (report["convention"], report["scope"], report["equivalent"]) == ("flops", "llm", False)
    assert (report["text_tokens"], report["batch"]) == (60, 1)
    rows = report["rows"]
    assert [(r["variant"], r["quant"]) for r in rows] == [
        (v, q) for v in ("vanilla", "v", "l") for q in ("fp16", "int8")]
    for row in rows:
        for field in ("visual_tokens", "tflops", "tflops_by_stage", "kv_cache_bytes", "kv_cache_figure",
                      "kv_cache_stored_bytes", "weight_bytes", "memory_access_bytes", "schedule", "roofline_ms"):
            assert field in row, field
        assert set(row["tflops_by_stage"]) == set(STAGES)
        assert row["tflops"] == pytest.approx(sum(row["tflops_by_stage"][s] for s in ("llm", "lm_head")), rel=1e-12)
        assert row["roofline_ms"] > 0
        assert all(set(entry) == {"stage", "layer", "remove"} for entry in row["schedule"])
    vanilla, v, l_ = rows[0], rows[2], rows[4]
    assert vanilla["visual_tokens"] == 576 and vanilla["schedule"] == []
    assert vanilla["kv_cache_bytes"] == 333_447_168
    values = 333_447_168 / 2  # int8 cache: one byte per value, and per group of 64 a 16-bit scale and zero point
    assert rows[1]["kv_cache_bytes"] == values + values / 64 * 2 * 2
    assert v["visual_tokens"] == l_["visual_tokens"] == 64
    assert sum(e["remove"] for e in v["schedule"]) == sum(e["remove"] for e in l_["schedule"]) == 512
    assert {e["stage"] for e in v["schedule"]} == {"vision"} and {e["stage"] for e in l_["schedule"]} == {"llm"}
    assert [e["layer"] for e in v["schedule"]] == list(range(12, 23))
    assert v["tflops"] < l_["tflops"] < vanilla["tflops"]
    assert vanilla["reduction_vs_vanilla"] is None
    assert v["reduction_vs_vanilla"] == pytest.approx(1 - v["tflops"] / vanilla["tflops"], rel=1e-12)


def llm_viewer_kv_by_hand(profile: str, kv_bits: int) -> tuple[float, float]:
    """LLM-Viewer's prefill KV cache of a profile's vanilla prompt, and the stored one, from the profile's own
    shapes: every layer's k_proj and v_proj store tokens x (kv heads x head dim) values (LLM-Viewer: `oc * b *
    s * kv_byte`), at kv_bits / 8 bytes each; stored, a 16-bit scale and zero point per group of 64 as well."""
    config = json.loads((Path(__file__).resolve().parents[1] / "profiles" / f"{profile}.json").read_text())
    text, extra = config["text_config"], config["ficoco"]
    tokens = extra["text_tokens"] + extra["visual_tokens_per_image"]
    kv_width = text["num_key_value_heads"] * text["hidden_size"] // text["num_attention_heads"]
    values = text["num_hidden_layers"] * 2 * tokens * kv_width
    return values * kv_bits / 8, values * kv_bits / 8 + values / 64 * 2 * 2


def test_llm_viewer_reports_llm_viewers_kv_cache_and_the_stored_one_by_name(cli, flops_report):
    """Issue 24: LLaVA-1.5-7B int8 at 60 text tokens is 166.7 MB in LLM-Viewer, 177.1 MB as stored."""
    args = ("flops", "--model", "llava-1.5-7b", "--variant", "vanilla", "--quant", "int8", "--convention", "llm-viewer")
    result = cli(*args, in_subprocess=True)
    assert result.code == 0, result.err
    words = " ".join(result.out.split())
    (row,) = [line.split() for line in result.out.splitlines() if line.split()[:2] == ["vanilla", "576"]]
    assert row[-3] == "166.7"  # KV viewer, weights, memory access
    assert "KV viewer: LLM-Viewer's KV cache, values x KV bits / 8" in words
    assert "KV stored (kv_cache_stored_bytes:" in words and "vanilla int8 177.1 MB" in words
    report = flops_report("--model", "llava-1.5-7b", "--quant", "int8,int4", "--convention", "llm-viewer")
    for row, bits in zip(report["rows"], (8, 4), strict=True):
        viewer, stored = llm_viewer_kv_by_hand("llava-1.5-7b", bits)
        assert (row["kv_cache_figure"], row["kv_cache_bytes"], row["kv_cache_stored_bytes"]) == (
            "llm-viewer", viewer, stored)
    assert (report["rows"][0]["kv_cache_bytes"], report["rows"][0]["kv_cache_stored_bytes"]) == (
        166_723_584, 177_143_808)
    # The default convention reports the stored cache, named so.
    flops = flops_report("--model", "llava-1.5-7b", "--quant", "int8")["rows"][0]
    assert (flops["kv_cache_figure"], flops["kv_cache_bytes"], flops["kv_cache_stored_bytes"]) == (
        "stored", 177_143_808, 177_143_808)


def test_lm_head_last_counts_one_token_per_sample(flops_report):
    report = flops_report("--model", "llava-1.5-7b", "--lm-head", "last", "--batch", "2")
    assert report["lm_head_tokens"] == "last"
    assert report["rows"][0]["tflops_by_stage"]["lm_head"] == pytest.approx(2 * 2 * 4096 * 32064 / 1e12, rel=1e-12)


def test_json_dash_writes_parseable_json_to_stdout_and_tables_to_stderr(cli):
    result = cli("flops", "--model", "llava-tiny", "--variant", "vanilla,l", "--keep", "16", "--per-layer",
                 "--json", "-", in_subprocess=True)
    assert result.code == 0, result.err
    report = json.loads(result.out)
    assert report["schema"] == "ficoco.flops/1"
    assert [r["visual_tokens"] for r in report["rows"]] == [64, 16]
    assert "llava-tiny" in result.err  # the table went to stderr


@pytest.mark.parametrize("convention,scope", [("flops", "llm"), ("flops", "all"), ("macs", "all"),
                                              ("llm-viewer", "llm"), ("paper", "llm"), ("paper", "all")])
@pytest.mark.parametrize("equivalent", [False, True])
def test_total_is_the_sum_of_the_scopes_stages(convention, scope, equivalent, flops_report):
    args = ["--model", "llava-1.5-7b", "--variant", "vanilla,v,l", "--keep", "64", "--convention", convention,
            "--scope", scope, "--per-layer"]
    report = flops_report(*args, *(["--equivalent"] if equivalent else []))
    assert report["scope_stages"] == SCOPE_STAGES[scope]
    assert (report["convention"], report["scope"], report["equivalent"]) == (convention, scope, equivalent)
    for row in report["rows"]:
        in_scope = sum(row["tflops_by_stage"][s] for s in SCOPE_STAGES[scope])
        assert row["tflops"] == pytest.approx(in_scope, rel=1e-12)
        layers = sum(layer["tera"] for layer in row["per_layer"] if layer["stage"] in SCOPE_STAGES[scope])
        assert row["tflops"] == pytest.approx(layers, rel=1e-12)
        if scope == "llm" and convention != "llm-viewer":
            assert row["tflops_by_stage"]["vision"] > 0  # computed, shown, but outside the total
            assert row["tflops"] < sum(row["tflops_by_stage"].values())


def test_budget_run_reports_a_fitting_schedule(flops_report):
    for args in (["--variant", "v"], ["--variant", "v,l", "--equivalent"]):
        report = flops_report("--model", "llava-1.5-7b", *args, "--tflops", "3.3")
        assert report["budget_tflops"] == 3.3
        assert all(row["tflops"] <= 3.3 for row in report["rows"])
        assert all(0 < row["visual_tokens"] < 576 for row in report["rows"])


def test_impossible_layer_exact_budget_fits_when_equivalent(flops_report):
    report = flops_report("--model", "llava-1.5-7b", "--variant", "l", "--tflops", "1.5", "--equivalent")
    (row,) = report["rows"]
    assert row["tflops"] <= 1.5
    assert report["equivalent"] is True


def test_set_override_reaches_the_report(flops_report):
    report = flops_report("--model", "llava-1.5-7b", "--set", "text_config.num_hidden_layers=4")
    assert report["overrides"] == {"text_config.num_hidden_layers": 4}
    full = flops_report("--model", "llava-1.5-7b")
    assert report["rows"][0]["tflops_by_stage"]["llm"] == pytest.approx(
        full["rows"][0]["tflops_by_stage"]["llm"] * 4 / 32, rel=1e-12)


# ---- no torch on the accounting path ------------------------------------------------------------------------

NO_TORCH = """
import sys
import ficoco, ficoco.accounting, ficoco_cli.app
from ficoco_cli.app import main
for argv in (["ficoco", "models"],
             ["ficoco", "flops", "--model", "llava-tiny", "--variant", "vanilla,v,l", "--keep", "16",
              "--quant", "fp16,int8,int4", "--gpu", "a100-80gb", "--per-layer", "--convention", "paper"],
             ["ficoco", "flops", "--model", "llava-1.5-7b", "--variant", "v", "--tflops", "3.3"]):
    sys.argv = argv
    try:
        main()
    except SystemExit as exc:
        assert not exc.code, exc.code
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "transformers"))
print("HEAVY:", heavy)
assert not heavy
"""


def test_accounting_path_imports_no_torch():
    result = subprocess.run([sys.executable, "-c", NO_TORCH], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "HEAVY: []" in result.stdout


# ---- bad input: exit code 2, one line -----------------------------------------------------------------------

M7 = ["flops", "--model", "llava-1.5-7b"]
BAD_INPUT = {
    "unknown model": (["flops", "--model", "nosuch"], "unknown --model 'nosuch'"),
    "bad schedule syntax": ([*M7, "--variant", "v", "--schedule", "12-40"], "'12-40' is not LAYER:REMOVED"),
    "v layer outside range": ([*M7, "--variant", "v", "--schedule", "30:10"], "layer 30 is outside"),
    "l layer outside range": ([*M7, "--variant", "l", "--schedule", "40:10"], "layer 40 is outside"),
    "removes more than exist": ([*M7, "--variant", "v", "--schedule", "12:600"], "more visual tokens than exist"),
    "negative budget": ([*M7, "--variant", "v", "--tflops", "-1"], "--tflops -1: give a finite number above 0"),
    "zero budget": ([*M7, "--variant", "l", "--tflops", "0"], "--tflops 0: give a finite number above 0"),
    "nan budget": ([*M7, "--variant", "v", "--tflops", "nan"], "--tflops nan: give a finite number above 0"),
    "infinite budget": ([*M7, "--variant", "v", "--tflops", "inf"], "--tflops inf: give a finite number above 0"),
    "overflowing budget": ([*M7, "--variant", "v", "--tflops", "1e309"], "--tflops inf: give a finite number"),
    "batch past 2**31 - 1": ([*M7, "--batch", "9" * 400], "--batch 9999"),
    "non-ascii digits in image size": (["flops", "--model", "qwen2-vl-tiny", "--image-size", "²x5"], "--image-size"),
    "qwen2-vl aspect ratio past 200": (["flops", "--model", "qwen2-vl-tiny", "--image-size", "1x2147483647"],
                                       "(--image-size): Qwen2-VL's processor takes aspect ratios up to 200"),
    "empty schedule": ([*M7, "--variant", "v", "--schedule", " , "], "--schedule is empty"),
    "shape of a schedule that removes nothing": ([*M7, "--variant", "l", "--keep", "576", "--shape", "zig"],
                                                 "unknown --shape 'zig'"),
    "unknown gpu": ([*M7, "--gpu", "b200"], "unknown --gpu 'b200'"),
    "unknown quant": ([*M7, "--quant", "fp16,fp8"], "unknown --quant 'fp8'"),
    "unknown convention": ([*M7, "--convention", "bogus"], "unknown --convention 'bogus'"),
    "unknown scope": ([*M7, "--scope", "vision"], "unknown --scope 'vision'"),
    "unknown variant": ([*M7, "--variant", "vanilla,x"], "unknown --variant 'x'"),
    "llm-viewer with scope all": ([*M7, "--convention", "llm-viewer", "--scope", "all"], "llm-viewer"),
    "keep above range v": ([*M7, "--variant", "v", "--keep", "577"], "--keep 577"),
    "keep zero v": ([*M7, "--variant", "v", "--keep", "0"], "--keep 0"),
    "keep above range l": ([*M7, "--variant", "l", "--keep", "600"], "--keep 600"),
    "keep negative l": ([*M7, "--variant", "l", "--keep", "-3"], "--keep -3"),
    "set without equals": ([*M7, "--set", "text_config.num_hidden_layers"], "--set 'text_config.num_hidden_layers'"),
    "several schedule sources": ([*M7, "--variant", "l", "--keep", "64", "--tflops", "3"], "give one of"),
    "batch zero": ([*M7, "--batch", "0"], "--batch 0"),
    "text tokens zero": ([*M7, "--text-tokens", "0"], "--text-tokens 0"),
    "unknown kv bits": ([*M7, "--kv-bits", "3"], "--kv-bits 3"),
    "unknown lm-head mode": ([*M7, "--lm-head", "middle"], "'middle'"),
    "unknown shape": ([*M7, "--variant", "v", "--keep", "64", "--shape", "zigzag"], "'zigzag'"),
    "first layer outside range": ([*M7, "--variant", "l", "--keep", "64", "--first-layer", "40"], "40 is outside"),
    "bad image size": ([*M7, "--image-size", "672"], "--image-size '672'"),
    "anyres unpadding with v": (["flops", "--model", "llava-next-7b", "--variant", "v", "--keep", "100",
                                 "--image-size", "800x600"], "unpadding"),
    "json folder missing": ([*M7, "--json", "/nonexistent-ficoco-dir/report.json"], "does not exist"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUT))
def test_bad_input_ends_with_exit_2_and_one_error_line(case, cli):
    args, expected = BAD_INPUT[case]
    line = assert_one_error_line(cli(*args, in_subprocess=True))
    assert expected in line


def test_impossible_budget_names_the_cheapest_reachable_cost(arch_of, cli):
    # An explicit --shape is honoured (the default would shorten the run of layers to fit).
    line = assert_one_error_line(cli(*M7, "--variant", "l", "--tflops", "1.5", "--shape", "uniform",
                                     in_subprocess=True))
    arch = arch_of("llava-1.5-7b")
    cheapest = compute_tera(arch, uniform_schedule(arch, "l", 575), CountOptions())
    assert cheapest > 1.5
    assert "1.5" in line and f"costs {cheapest:.3g}" in line
    assert "--equivalent" in line  # and what would reach lower


def test_impossible_budget_hint_flags_do_fit(cli, flops_report):
    line = assert_one_error_line(cli(*M7, "--variant", "l", "--tflops", "1.5", "--shape", "uniform",
                                     in_subprocess=True))
    match = re.search(r"; ((?:--[a-z-]+ \S+ ?)+) reaches \S+ \(fits\)", line)
    assert match, line
    report = flops_report("--model", "llava-1.5-7b", "--variant", "l", "--tflops", "1.5", *match[1].split())
    assert report["rows"][0]["tflops"] <= 1.5


# Click/Typer usage errors: typer 0.29 raises its vendored `typer._click` exceptions, which
# `main()` does not catch (it catches the separate `click` package's UsageError).
USAGE_ERRORS = {
    "unknown option": [*M7, "--bogus"],
    "not an integer": [*M7, "--keep", "abc"],
    "missing --model": ["flops"],
    "unknown command": ["bogus"],
}


def test_the_comparison_line_runs_every_method_at_one_budget(cli, flops_report):
    # FiCoCo-L's full uniform run cannot reach 3.3 TFLOPs on LLaVA-1.5-7B: its default budget shape is the
    # longest uniform run from layer 4 that does, named in the row's settings.
    report = flops_report("--model", "llava-1.5-7b", "--variant", "vanilla,v,l,fastv,pdrop,sparsevlm,dart",
                       "--tflops", "3.3")
    rows = {row["variant"]: row for row in report["rows"]}
    assert list(rows) == ["vanilla", "v", "l", "fastv", "pdrop", "sparsevlm", "dart"]
    assert all(row["tflops"] <= 3.3 for row in rows.values() if row["variant"] != "vanilla")
    layers = [r["layer"] for r in rows["l"]["schedule"]]
    assert layers == list(range(4, 4 + len(layers))) and layers[-1] < 31
    assert "longest run from layer 4" in rows["l"]["settings"]["shape"]
    # The printed comparison names the shortened run too, not only the JSON.
    printed = cli("flops", "--model", "llava-1.5-7b", "--variant", "vanilla,v,l", "--tflops", "3.3", in_subprocess=True)
    assert printed.code == 0
    assert "l: uniform over layers 4.." in " ".join(printed.out.split())


@pytest.mark.parametrize("case", sorted(USAGE_ERRORS))
def test_usage_error_ends_with_exit_2_and_one_error_line(case, cli):
    assert_one_error_line(cli(*USAGE_ERRORS[case], in_subprocess=True))


# A schedule option given with only the vanilla variant would be ignored: it is refused instead
# (a value wrong by its kind alone, such as a negative budget, is refused first, where it enters).
IGNORED_FOR_VANILLA = {
    "bad schedule syntax": ([*M7, "--schedule", "12-40"], "applies to the reducing methods"),
    "budget": ([*M7, "--tflops", "1.5"], "--tflops applies to the reducing methods"),
    "negative budget": ([*M7, "--tflops", "-1"], "--tflops -1: give a finite number above 0"),
}


@pytest.mark.parametrize("case", sorted(IGNORED_FOR_VANILLA))
def test_bad_values_are_refused_for_the_default_vanilla_variant(case, cli):
    args, expected = IGNORED_FOR_VANILLA[case]
    assert expected in assert_one_error_line(cli(*args, in_subprocess=True))


# Shapes and frames are checked before they reach the cost model.
UNCHECKED_SHAPES = {
    "zero frames": ["flops", "--model", "video-llava-tiny", "--frames", "0"],  # silently the profile's 4 frames
    "negative frames": ["flops", "--model", "video-llava-tiny", "--frames", "-1"],  # negative TFLOPs, exit 0
    "non-integer layer count": [*M7, "--set", "text_config.num_hidden_layers=abc"],  # TypeError traceback
    "zero attention heads": [*M7, "--set", "text_config.num_attention_heads=0"],  # ZeroDivisionError traceback
}


@pytest.mark.parametrize("case", sorted(UNCHECKED_SHAPES))
def test_invalid_shapes_and_frames_end_with_exit_2_and_one_error_line(case, cli):
    assert_one_error_line(cli(*UNCHECKED_SHAPES[case], in_subprocess=True))


def test_methods_side_by_side_leave_out_those_a_family_refuses_with_the_reason(cli, flops_report) -> None:
    """Several methods at one setting run on any family, as a sweep does: HoliTom (a video method) on
    LLaVA-1.5 and FastV below its reachable layer average are left out with their one-line reasons,
    the others are costed; one method alone, or none left, is refused in one line."""
    from ficoco.methods import METHODS

    report = flops_report("--model", "llava-1.5-7b", "--variant", "vanilla,v,holitom,fastv,divprune",
                       "--keep", "30")
    assert [r["variant"] for r in report["rows"]] == ["vanilla", "v", "divprune"]
    skipped = {entry["variant"]: entry["reason"] for entry in report["skipped"]}
    assert set(skipped) == {"holitom", "fastv"}
    assert METHODS["holitom"].family_status("llava")[1] in skipped["holitom"]
    assert "FastV at layer 2 averages" in skipped["fastv"]
    printed = cli("flops", "--model", "llava-1.5-7b", "--variant", "vanilla,v,holitom", "--keep", "64",
                  in_subprocess=True)
    assert printed.code == 0 and "left out holitom: --variant holitom:" in printed.out
    assert "HoliTom is defined on" in assert_one_error_line(cli(
        "flops", "--model", "llava-1.5-7b", "--variant", "vanilla,holitom", "--keep", "64", in_subprocess=True))
    assert "HoliTom is defined on" in assert_one_error_line(cli(
        "flops", "--model", "llava-1.5-7b", "--variant", "holitom,fastv", "--keep", "30", in_subprocess=True))


def test_flops_prices_visionzips_cut_at_dominant_plus_contextual_equal_the_patches_only_with_cls(flops_report):
    """llava-tiny has 64 patches, VisionZip's keep 64 is 54 + 10: with the official [CLS] among the dominant tokens
    one patch is left to merge, so the cut and its own work are priced; with [CLS] dropped nothing merges."""
    official, = flops_report("--model", "llava-tiny", "--variant", "visionzip", "--keep", "64")["rows"]
    dropped, = flops_report("--model", "llava-tiny", "--variant", "visionzip", "--keep", "64",
                            "--hp", "include_cls=false")["rows"]
    assert official["schedule"] == [{"stage": "vision", "layer": 4, "remove": 10, "where": "tower_output", "added": 10}]
    assert [t["term"] for t in official["method_terms"]] == ["visionzip_vision_cls_row",
                                                             "visionzip_vision_contextual_similarity"]
    assert dropped["schedule"] == [] and dropped["method_tflops"] == 0 < official["method_tflops"]
    assert official["tflops"] == dropped["tflops"] and official["visual_tokens"] == dropped["visual_tokens"] == 64
