"""`ficoco profile`: the measured report (issue 4's acceptance), its streams, and its errors.

The expensive runs happen once each, in real subprocesses, in module-scoped fixtures; many
tests then read their reports. Timings are never compared ("faster than"): the tests check
presence, types and the consistency of every derived figure with the figures it comes from.
User mistakes are checked in-process through `main()` (the console script's entry point),
with two of them also on a real subprocess.
"""

from __future__ import annotations

import datetime as dt
import io
import json
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from helpers import COMMAND, CliResult, assert_one_error_line

MODEL = "llava-tiny"
VARIANTS = ["vanilla", "v", "l"]
QUANTS = ["fp16", "int8", "int4"]
KEEP = 8
REPEAT = 2
VISUAL_TOKENS = 64  # llava-tiny: (image 32 / patch 4)^2 patches
TEXT_TOKENS = 60  # the profile command's default


def by_key(report: dict[str, Any]) -> dict[tuple[str, str, int], dict[str, Any]]:
    return {(r["variant"], r["quant"], r["batch"]): r for r in report["rows"]}


def assert_clean_exit(result: CliResult) -> None:
    assert result.code == 0, result.err[-3000:]
    assert "Traceback" not in result.out + result.err
    assert "error:" not in result.err


# ---- the acceptance run: 3 variants x 3 quants --------------------------------------------------------------

@pytest.fixture(scope="module")
def full(tmp_path_factory, cli) -> dict[str, Any]:
    folder = tmp_path_factory.mktemp("profile_full")
    path = folder / "r.json"
    result = cli("profile", "--model", MODEL, "--variant", ",".join(VARIANTS), "--keep", str(KEEP),
                 "--quant", ",".join(QUANTS), "--json", str(path), "--warmup", "0", "--repeat", str(REPEAT),
                 in_subprocess=True)
    assert_clean_exit(result)
    return {"result": result, "report": json.loads(path.read_text()), "folder": folder}


@pytest.fixture(scope="module")
def report(full) -> dict[str, Any]:
    return full["report"]


@pytest.fixture(scope="module")
def rows(report) -> dict[tuple[str, str, int], dict[str, Any]]:
    return by_key(report)


def test_full_run_exits_cleanly_and_prints_the_table(full):
    stdout = full["result"].out
    assert f"{MODEL} on " in stdout and "prefill" in stdout
    for column in ("variant", "quant", "median", "speedup", "KV"):
        assert column in stdout
    assert stdout.count(" ok ") == len(VARIANTS) * len(QUANTS)


def test_report_schema_and_created_timestamp(report):
    assert report["schema"] == "ficoco.report/1"
    created = dt.datetime.fromisoformat(report["created"])
    assert created.tzinfo is not None
    assert abs((dt.datetime.now(dt.timezone.utc) - created).total_seconds()) < 3600
    assert set(report) >= {"schema", "created", "environment", "config", "rows"}


def test_report_environment(report):
    env = report["environment"]
    for key in ("python", "torch", "transformers", "bitsandbytes"):
        assert isinstance(env[key], str) and env[key], key
    assert env["python"] == sys.version.split()[0]
    from importlib import metadata

    assert env["torch"] == metadata.version("torch")
    assert env["transformers"] == metadata.version("transformers")
    assert env["bitsandbytes"] == metadata.version("bitsandbytes")
    assert env["device_kind"] == "cpu"
    assert isinstance(env["device"], str) and env["device"]
    assert isinstance(env["cpu"], str) and env["cpu"]
    assert isinstance(env["threads"], int) and env["threads"] >= 1
    assert "git_commit" in env
    assert env["git_commit"] is None or isinstance(env["git_commit"], str)


def test_report_config_echoes_the_options(report):
    config = report["config"]
    assert config["model"] == MODEL
    assert config["variants"] == VARIANTS
    assert config["keep"] == KEEP
    assert config["quants"] == QUANTS
    assert config["batches"] == [1]
    assert config["warmup"] == 0
    assert config["repeat"] == REPEAT
    assert config["new_tokens"] == 0
    assert config["text_tokens"] == TEXT_TOKENS
    assert config["device"] == "auto"
    assert config["weights"] == "random"
    assert config["kv_bits"] is None
    assert config["tflops"] is None and config["schedule"] is None
    assert "gpu_profile" in config and config["gpu_profile"] is None  # no GPU: no roofline profile


def test_nine_ok_rows_in_matrix_order(report):
    assert [(r["quant"], r["variant"]) for r in report["rows"]] == [(q, v) for q in QUANTS for v in VARIANTS]
    for row in report["rows"]:
        assert row["status"] == "ok", row.get("reason")
        assert "reason" not in row
        assert row["model"] == MODEL
        assert row["batch"] == 1
        assert row["text_tokens"] == TEXT_TOKENS
        assert row["new_tokens"] == 0
        assert row["generation"] is None
        assert row["device_kind"] == "cpu"


def test_latency_block(report):
    for row in report["rows"]:
        lat = row["latency"]
        assert lat["timer"] == "perf_counter"
        samples = lat["samples_ms"]
        assert len(samples) == REPEAT
        assert all(isinstance(s, float) and s > 0 for s in samples)
        assert lat["median_ms"] == pytest.approx(statistics.median(samples))
        assert lat["min_ms"] == min(samples)
        assert lat["p90_ms"] in samples
        assert lat["min_ms"] <= lat["median_ms"] <= lat["p90_ms"] <= max(samples)
        assert lat["stdev_ms"] == pytest.approx(statistics.stdev(samples))


def test_throughput_and_achieved_tflops_follow_the_median(report):
    for row in report["rows"]:
        seconds = row["latency"]["median_ms"] / 1e3
        assert row["images_per_s"] == pytest.approx(row["batch"] / seconds)
        assert row["achieved_tflops_per_s"] == pytest.approx(row["analytic"]["tflops"] / seconds)
        assert row["achieved_tflops_per_s"] > 0
        assert row["measured_over_roofline"] is None  # CPU: no roofline


def test_memory_block(report):
    for row in report["rows"]:
        memory = row["memory"]
        assert isinstance(memory["peak_bytes"], int) and memory["peak_bytes"] > 0
        assert isinstance(memory["method"], str) and memory["method"]
        assert "RSS" in memory["method"]


def test_analytic_block(report):
    for row in report["rows"]:
        a = row["analytic"]
        assert a["tflops"] > 0
        assert a["tflops"] == pytest.approx(sum(a["tflops_by_stage"].values()))
        assert set(a["tflops_by_stage"]) == {"vision", "projector", "llm", "lm_head"}
        assert a["kv_cache_bytes"] > 0 and a["weight_bytes"] > 0
        assert (a["convention"], a["scope"], a["lm_head_tokens"]) == ("flops", "all", "last")
        assert a["roofline_ms"] is None
        assert isinstance(a["visual_tokens"], int) and isinstance(a["llm_visual_tokens"], int)


@pytest.mark.parametrize("quant", QUANTS)
def test_measured_weight_bytes_stand_beside_the_accountants_within_half_a_percent(rows, quant):
    for variant in VARIANTS:
        row = rows[(variant, quant, 1)]
        assert isinstance(row["weight_bytes"], int)
        assert row["weight_bytes"] == pytest.approx(row["analytic"]["weight_bytes"], rel=0.005)


def test_reduction_time_splits_into_stages_and_reads(report):
    for row in report["rows"]:
        reads = row["reads"]
        if reads is None:  # a method that read no attention: its time is its stages
            assert row["probe_ms"] == 0
            assert row["reduction_ms"] == pytest.approx(row["reduction_stages_ms"])
        else:
            # The reads: the probe span, and what fused passes took beyond the model's kernel (never below zero).
            extra = max(reads["fused_ms"] - (reads["fused_reference_ms"] or 0.0), 0.0) if reads["fused_ms"] else 0.0
            assert reads["probe_ms"] == row["probe_ms"] and reads["steps_ms"] == row["reduction_stages_ms"]
            assert reads["ms"] == pytest.approx(row["probe_ms"] + extra)
            assert row["reduction_ms"] == pytest.approx(row["reduction_stages_ms"] + reads["ms"])
        assert row["runs"] == {"warmup": 0, "repeat": REPEAT, "chosen_by": "warmup=/repeat="}


def test_analytic_weight_bytes_shrink_with_the_quant(rows):
    for variant in VARIANTS:
        weights = [rows[(variant, q, 1)]["analytic"]["weight_bytes"] for q in QUANTS]
        assert weights[0] > weights[1] > weights[2], weights


def test_visual_tokens_and_schedules(rows):
    for quant in QUANTS:
        vanilla, v, l_row = (rows[(name, quant, 1)] for name in VARIANTS)
        assert vanilla["analytic"]["visual_tokens"] == VISUAL_TOKENS
        assert vanilla["analytic"]["llm_visual_tokens"] == VISUAL_TOKENS
        assert vanilla["schedule"] == []
        assert v["analytic"]["visual_tokens"] == KEEP
        assert v["analytic"]["llm_visual_tokens"] == KEEP  # V reduces in the vision tower
        assert l_row["analytic"]["visual_tokens"] == KEEP
        assert l_row["analytic"]["llm_visual_tokens"] == VISUAL_TOKENS  # L receives all, reduces inside
        assert {s["stage"] for s in v["schedule"]} == {"vision"}
        assert {s["stage"] for s in l_row["schedule"]} == {"llm"}
        for row in (v, l_row):
            assert sum(s["remove"] for s in row["schedule"]) == VISUAL_TOKENS - KEEP


def test_reduction_time_and_share(report):
    for row in report["rows"]:
        ms, share = row["reduction_ms"], row["reduction_share"]
        assert isinstance(ms, float) and isinstance(share, float)
        if row["variant"] == "vanilla":
            assert ms == 0.0 and share == 0.0
        else:
            assert ms > 0 and 0 < share < 1, row["variant"]
            assert share == pytest.approx(ms / row["latency"]["median_ms"])


def test_comparisons_against_the_vanilla_row_of_the_same_quant(rows):
    for quant in QUANTS:
        base = rows[("vanilla", quant, 1)]
        assert base["speedup_vs_vanilla"] == 1.0
        assert base["memory_saving_vs_vanilla"] == 0.0
        assert base["flops_ratio_vs_vanilla"] == 1.0
        for variant in ("v", "l"):
            row = rows[(variant, quant, 1)]
            assert row["speedup_vs_vanilla"] == pytest.approx(
                base["latency"]["median_ms"] / row["latency"]["median_ms"])
            assert row["memory_saving_vs_vanilla"] == pytest.approx(
                1 - row["memory"]["peak_bytes"] / base["memory"]["peak_bytes"])
            assert row["flops_ratio_vs_vanilla"] == pytest.approx(
                base["analytic"]["tflops"] / row["analytic"]["tflops"])
            assert row["flops_ratio_vs_vanilla"] > 1


def test_threads_recorded_on_every_row(report):
    for row in report["rows"]:
        assert isinstance(row["threads"], int) and row["threads"] >= 1
        assert row["threads"] == report["environment"]["threads"]


def test_backend_names_the_storage_and_compute_dtypes_and_why(report):
    """--dtype auto decides from this CPU's measured rates, so the dtype itself may differ
    between machines; every row must name it, the same for the whole run, with the reason."""
    assert report["config"]["dtype"] == "auto"
    compute = {row["backend"]["compute_dtype"] for row in report["rows"]}
    assert len(compute) == 1 and compute <= {"bfloat16", "float16", "float32"}
    for row in report["rows"]:
        backend = row["backend"]
        assert backend["quant"] == row["quant"]
        assert backend["dtype_reason"].startswith("auto: ")
        assert backend["compute_dtype"] in backend["dtype_reason"]
        if row["quant"] == "fp16":
            assert backend["backend"] == "torch"
            assert backend["storage_dtype"] in (backend["compute_dtype"], "bfloat16 (upcast linears), float32 rest")
        else:
            assert backend["backend"].startswith("bitsandbytes")
            assert backend["converted_linears"] > 0
            assert backend["storage_dtype"].startswith("int8 linears" if row["quant"] == "int8" else "NF4 linears")
    int8 = [r for r in report["rows"] if r["quant"] == "int8"]
    assert all("casts activations to float16" in r["backend"]["dtype_reason"] for r in int8)


@pytest.mark.parametrize("quant", QUANTS)
def test_measured_kv_cache_equals_the_accountant(rows, quant):
    """int8/int4 rows quantize the KV cache to their bits (HQQ codes, scales and zero points):
    every row must still match the accountant's figure to the byte."""
    for variant in VARIANTS:
        row = rows[(variant, quant, 1)]
        assert isinstance(row["kv_cache_bytes"], int)
        assert row["kv_cache_bytes"] > 0
        assert row["kv_cache_bytes"] == row["analytic"]["kv_cache_bytes"], (variant, quant)


def test_kv_cache_follows_the_weights_bits_unless_kv_bits_is_given(rows):
    for variant in VARIANTS:
        by_quant = {q: rows[(variant, q, 1)] for q in QUANTS}
        assert [by_quant[q]["kv_bits"] for q in QUANTS] == [{"fp16": None, "int8": 8, "int4": 4}[q] for q in QUANTS]
        sizes = [by_quant[q]["kv_cache_bytes"] for q in QUANTS]
        assert sizes == sorted(sizes, reverse=True) and len(set(sizes)) == len(QUANTS), variant


def test_kv_cache_follows_the_accounting_formula(rows, arch_of):
    """docs/accounting.md: sum over layers of 2 * b * s_layer * nkv * hd * kv_bytes (the cache is
    kept in the compute dtype, which --dtype auto picks for this CPU)."""
    import torch

    dec = arch_of(MODEL).decoder
    compute = rows[("vanilla", "fp16", 1)]["backend"]["compute_dtype"]
    per_token = 2 * dec.kv_heads * dec.head_dim * torch.finfo(getattr(torch, compute)).bits // 8
    seq = TEXT_TOKENS + VISUAL_TOKENS
    assert rows[("vanilla", "fp16", 1)]["kv_cache_bytes"] == dec.layers * seq * per_token
    assert rows[("v", "fp16", 1)]["kv_cache_bytes"] == dec.layers * (TEXT_TOKENS + KEEP) * per_token
    # L: a layer's cache holds the tokens it processed; removals at layer k apply from layer k+1.
    l_row = rows[("l", "fp16", 1)]
    removed = {s["layer"]: s["remove"] for s in l_row["schedule"]}
    tokens = [seq - sum(n for layer, n in removed.items() if layer < i) for i in range(dec.layers)]
    assert l_row["kv_cache_bytes"] == sum(tokens) * per_token
    assert rows[("v", "fp16", 1)]["kv_cache_bytes"] < l_row["kv_cache_bytes"] < rows[("vanilla", "fp16", 1)][
        "kv_cache_bytes"]


def test_progress_in_a_pipe_is_plain_lines_naming_step_row_elapsed_and_eta(full):
    stdout = full["result"].out
    assert "\x1b[" not in stdout and "\r" not in stdout  # no redrawing bar in a log
    lines = stdout.splitlines()
    # The dtype is auto's choice for this CPU (bfloat16 with AMX, float32 with AVX2 alone).
    compute = full["report"]["rows"][0]["backend"]["compute_dtype"]
    plan = next(i for i, line in enumerate(lines) if line.startswith(f"plan: 9 row(s), computing in {compute}"))
    assert lines[plan + 1].startswith("estimate: ") and "TFLOP/s" in lines[plan + 1]
    steps = [line for line in lines if line.startswith("[")]
    assert lines.index(steps[0]) > plan  # the estimate comes first
    # Unquantized rows are named by the dtype they compute in (bf16, fp32), never "fp16" for another dtype.
    unquantized = {"bfloat16": "bf16", "float32": "fp32", "float16": "fp16"}[compute]
    assert steps[0].startswith(f"[1/9] {unquantized}: building the model, elapsed 0:00:00, ETA ")
    for n, (quant, variant) in enumerate([(q, v) for q in QUANTS for v in VARIANTS], start=1):
        label = f"[{n}/9] {variant} {unquantized if quant == 'fp16' else quant} b1: "
        mine = [line[len(label):] for line in steps if line.startswith(label)]
        # the first timed run (after the build for a quant's first row), then the row's end
        assert mine[0].startswith(f"timed run 1/{REPEAT}"), mine
        assert mine[-1].startswith("done in "), mine
        assert all(", elapsed " in line and ", ETA " in line for line in mine)
    assert steps[1].startswith(f"[1/9] vanilla {unquantized} b1: timed run 1/{REPEAT} (built in ")
    assert any(line.startswith("[4/9] int8: building the model") for line in steps)
    time_line = next(line for line in lines if line.startswith("time: estimated "))
    assert "measured" in time_line and "rows (builds apart)" in time_line


def test_report_records_the_estimate_beside_the_measured_wall_time(report):
    estimate = report["estimate"]
    assert estimate["rows"] == len(report["rows"]) and estimate["runs_rule"] == "warmup=/repeat="
    assert set(estimate["build_s"]) == set(QUANTS) and estimate["total_s"] > 0
    assert estimate["total_s"] == pytest.approx(sum(estimate["build_s"].values())
                                                + sum(r["estimate"]["wall_s"] for r in report["rows"]))
    assert estimate["rates"]["matmul_flops_per_s"] > 0 and estimate["rates"]["small_op_s"] > 0
    assert estimate["dtype"].startswith(report["rows"][0]["backend"]["compute_dtype"]) and estimate["memory"]
    builds = {}
    for row in report["rows"]:
        assert row["estimate"]["prefill_ms"] > 0 and row["estimate"]["wall_s"] > 0
        assert (row["estimate"]["warmup"], row["estimate"]["repeat"]) == (0, REPEAT)  # as given
        assert row["estimate"]["build_s"] == estimate["build_s"][row["quant"]]
        runs_s = (sum(row["latency"]["samples_ms"]) + sum(row["latency"]["warmup_ms"])) / 1e3
        assert row["wall_s"] > runs_s  # the row's time holds its runs
        builds.setdefault(row["quant"], row["build_s"])
        assert row["build_s"] == builds[row["quant"]] > 0  # one build per quant, on each of its rows
    assert report["wall_s"] > sum(builds.values()) + sum(r["wall_s"] for r in report["rows"]) - 1e-6


def test_no_temporary_files_are_left_beside_the_report(full):
    assert sorted(p.name for p in full["folder"].iterdir()) == ["r.json"]


# ---- --new-tokens: the generation block ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def generation(tmp_path_factory, cli) -> dict[str, Any]:
    path = tmp_path_factory.mktemp("profile_gen") / "g.json"
    result = cli("profile", "--model", MODEL, "--variant", "vanilla,v", "--keep", str(KEEP), "--quant", "fp16",
                 "--new-tokens", "2", "--repeat", "1", "--warmup", "0", "--json", str(path), in_subprocess=True)
    assert_clean_exit(result)
    return {"result": result, "report": json.loads(path.read_text())}


def test_new_tokens_adds_a_generation_block(generation):
    report = generation["report"]
    assert report["config"]["new_tokens"] == 2
    assert [r["variant"] for r in report["rows"]] == ["vanilla", "v"]
    for row in report["rows"]:
        assert row["status"] == "ok", row.get("reason")
        assert row["new_tokens"] == 2
        gen = row["generation"]
        assert gen["new_tokens"] == 2
        assert gen["latency"]["timer"] == "perf_counter"
        assert len(gen["latency"]["samples_ms"]) == 1
        seconds = gen["total"]["median_ms"] / 1e3  # call to last token (profiling/decode.py)
        assert gen["images_per_s"] == pytest.approx(row["batch"] / seconds)
        assert gen["generated_tokens_per_s"] == pytest.approx(row["batch"] * 2 / seconds)
        # the prefill figures are still there
        assert len(row["latency"]["samples_ms"]) == 1
        assert row["kv_cache_bytes"] == row["analytic"]["kv_cache_bytes"]
    # The default table keeps its 80 columns: generation is in the verdict line, and in --wide's columns.
    (verdict,) = [line for line in generation["result"].out.splitlines() if line.startswith("v: ")]
    assert "generating 2 tokens end to end" in verdict and "tok/s" in verdict
    from rich.console import Console

    from ficoco_cli.render import profile_table

    console = Console(width=200, record=True, file=io.StringIO())
    console.print(profile_table(report, wide=True))
    header = console.export_text()
    assert "e2e" in header and "tok/s" in header


# ---- --no-reference with --batch 1,2 ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def batches(tmp_path_factory, cli) -> dict[str, Any]:
    path = tmp_path_factory.mktemp("profile_batch") / "b.json"
    result = cli("profile", "--model", MODEL, "--variant", "v", "--keep", str(KEEP), "--quant", "fp16",
                 "--no-reference", "--batch", "1,2", "--repeat", "1", "--warmup", "0", "--json", str(path),
                 in_subprocess=True)
    assert_clean_exit(result)
    return json.loads(path.read_text())


def test_no_reference_drops_the_vanilla_rows(batches):
    assert batches["config"]["variants"] == ["v"]
    assert [(r["variant"], r["batch"]) for r in batches["rows"]] == [("v", 1), ("v", 2)]
    for row in batches["rows"]:
        assert row["status"] == "ok", row.get("reason")
        # nothing to compare against
        assert row["speedup_vs_vanilla"] is None
        assert row["memory_saving_vs_vanilla"] is None
        assert row["flops_ratio_vs_vanilla"] is None


def test_batch_list_gives_a_row_per_batch_and_kv_scales_with_it(batches):
    assert batches["config"]["batches"] == [1, 2]
    one, two = batches["rows"]
    assert two["kv_cache_bytes"] == 2 * one["kv_cache_bytes"]
    assert two["analytic"]["kv_cache_bytes"] == 2 * one["analytic"]["kv_cache_bytes"]
    assert two["kv_cache_bytes"] == two["analytic"]["kv_cache_bytes"]
    assert two["analytic"]["tflops"] > one["analytic"]["tflops"]
    for row in (one, two):
        assert row["images_per_s"] == pytest.approx(row["batch"] / (row["latency"]["median_ms"] / 1e3))


# ---- --json -: report on stdout, table on stderr; the default reference rows ---------------------------------

@pytest.fixture(scope="module")
def to_stdout(tmp_path_factory, cli) -> dict[str, Any]:
    folder = tmp_path_factory.mktemp("profile_stdout")
    result = cli("profile", "--model", MODEL, "--variant", "v", "--keep", str(KEEP), "--quant", "fp16",
                 "--repeat", "1", "--warmup", "0", "--json", "-", cwd=folder, in_subprocess=True)
    assert_clean_exit(result)
    return {"result": result, "folder": folder}


def test_json_dash_writes_the_report_to_stdout_and_the_table_to_stderr(to_stdout):
    result = to_stdout["result"]
    report = json.loads(result.out)  # the whole of stdout is the report
    assert report["schema"] == "ficoco.report/1"
    assert all(r["status"] == "ok" for r in report["rows"])
    assert "variant" in result.err and "median" in result.err and MODEL in result.err
    assert list(to_stdout["folder"].iterdir()) == []  # no file named "-" (nor anything else)


def test_variant_v_alone_adds_the_vanilla_reference_by_default(to_stdout):
    report = json.loads(to_stdout["result"].out)
    assert report["config"]["variants"] == ["vanilla", "v"]
    assert [r["variant"] for r in report["rows"]] == ["vanilla", "v"]
    assert report["rows"][1]["speedup_vs_vanilla"] is not None


# ---- a failing row is recorded and the run goes on ----------------------------------------------------------

@pytest.fixture(scope="module")
def kv_bits(tmp_path_factory, cli) -> dict[str, Any]:
    path = tmp_path_factory.mktemp("profile_kvbits") / "k.json"
    result = cli("profile", "--model", MODEL, "--variant", "vanilla,v", "--keep", str(KEEP), "--quant",
                 "fp16,int4", "--kv-bits", "8", "--dtype", "bf16", "--repeat", "1", "--warmup", "0", "--json",
                 str(path), in_subprocess=True)
    return {"result": result, "report": json.loads(path.read_text())}


def test_kv_bits_runs_the_quantized_cache_and_measures_the_accountants_bytes(kv_bits):
    result, report = kv_bits["result"], kv_bits["report"]
    assert_clean_exit(result)
    assert report["config"]["kv_bits"] == 8
    assert [(r["variant"], r["quant"], r["kv_bits"]) for r in report["rows"]] == [
        ("vanilla", "fp16", 8), ("v", "fp16", 8), ("vanilla", "int4", 8), ("v", "int4", 8)]
    for row in report["rows"]:
        assert row["status"] == "ok", row.get("reason")
        assert row["kv_cache_bytes"] == row["analytic"]["kv_cache_bytes"]
    # vanilla's bf16 cache is 126,976 B (reports/llava-tiny-cpu.json); at 8 bits: the codes (half
    # of it) and a bf16 scale and zero point per 16-value group (a quarter of the codes).
    assert report["rows"][0]["kv_cache_bytes"] == 126976 // 2 * 5 // 4


def test_int8_and_int4_quantize_the_kv_cache_to_their_bits_unless_kv_bits_says_otherwise():
    from ficoco.profiling.matrix import ProfileConfig, row_kv_bits

    config = ProfileConfig(model=MODEL)
    assert [row_kv_bits(config, q) for q in ("fp16", "int8", "int4")] == [None, 8, 4]
    assert [row_kv_bits(ProfileConfig(model=MODEL, kv_bits=2), q) for q in ("fp16", "int8")] == [2, 2]
    assert row_kv_bits(ProfileConfig(model=MODEL, kv_bits=16), "int4") is None


def test_a_missing_kv_backend_is_one_error_line_before_any_build(monkeypatch, cli):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "hqq" else real(name, *a))
    result = cli("profile", "--model", MODEL, "--variant", "v", "--keep", KEEP, "--quant", "int8", "--dry-run")
    err = result.err.strip().splitlines()
    assert result.code == 2 and len(err) == 1
    assert err[0].startswith("error: --kv-bits") and "pip install hqq" in err[0]


def test_a_row_that_raises_is_recorded_and_later_rows_still_run(tmp_path, monkeypatch, cli):
    """In-process: the v row's measurement fails; vanilla before it and l after it are measured."""
    import ficoco.profiling.matrix as matrix

    real = matrix.measure_row

    def flaky(model, row, config, plan, **kwargs):
        if row.variant == "v":
            raise RuntimeError("simulated kernel failure\nsecond line")
        return real(model, row, config, plan, **kwargs)

    monkeypatch.setattr(matrix, "measure_row", flaky)
    path = tmp_path / "m.json"
    result = cli("profile", "--model", MODEL, "--variant", "vanilla,v,l", "--keep", KEEP, "--repeat", "1",
                 "--warmup", "0", "--json", path)
    assert result.code == 0, result.err
    report = json.loads(path.read_text())
    statuses = {r["variant"]: r["status"] for r in report["rows"]}
    assert statuses == {"vanilla": "ok", "v": "error", "l": "ok"}
    failed = report["rows"][1]
    assert failed["reason"] == "RuntimeError: simulated kernel failure"
    assert "latency" not in failed
    assert report["rows"][2]["speedup_vs_vanilla"] is not None
    assert "error:" not in result.err


# ---- interrupted runs keep their finished rows --------------------------------------------------------------

# Timed runs per row of the interrupted run: enough that the rows after the first outlast the
# SIGINT's way in.
INTERRUPT_REPEAT = 10


def _default_sigint() -> None:
    # A shell without job control starts background jobs with SIGINT ignored (POSIX), and children
    # inherit that: `bash .ci/run &` would hand this run a SIGINT it ignores. The run under test gets
    # the default disposition, as one started from a terminal has, so Python turns it into
    # KeyboardInterrupt.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory) -> dict[str, Any]:
    folder = tmp_path_factory.mktemp("profile_interrupt")
    path = folder / "p.json"
    proc = subprocess.Popen([*COMMAND, "profile", "--model", MODEL, "--variant", ",".join(VARIANTS), "--keep",
                             str(KEEP), "--quant", ",".join(QUANTS), "--repeat", str(INTERRUPT_REPEAT), "--json",
                             str(path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=_default_sigint)
    seen: list[dict[str, Any]] = []
    reads = 0
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            if path.exists():
                data = json.loads(path.read_text())  # whenever it exists, it is a whole JSON document
                reads += 1
                assert data["schema"] == "ficoco.report/1"
                if data["rows"]:
                    seen = data["rows"]
                    break
            time.sleep(0.02)
        assert seen, "no row was written within 120 s (or the run ended first)"
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return {"seen": seen, "reads": reads, "returncode": proc.returncode, "stdout": stdout, "stderr": stderr,
            "report": json.loads(path.read_text()), "folder": folder}


def test_interrupted_run_keeps_every_finished_row(interrupted):
    report = interrupted["report"]
    rows = report["rows"]
    assert interrupted["reads"] >= 1
    assert 1 <= len(interrupted["seen"]) <= len(rows) < len(VARIANTS) * len(QUANTS)
    matrix_order = [(v, q) for q in QUANTS for v in VARIANTS]
    assert [(r["variant"], r["quant"]) for r in rows] == matrix_order[: len(rows)]
    assert rows[: len(interrupted["seen"])] == interrupted["seen"]
    for row in rows:
        assert row["status"] == "ok"
        assert len(row["latency"]["samples_ms"]) == INTERRUPT_REPEAT
        assert row["kv_cache_bytes"] == row["analytic"]["kv_cache_bytes"]
    assert "Traceback" not in interrupted["stderr"] + interrupted["stdout"]
    assert sorted(p.name for p in interrupted["folder"].iterdir()) == ["p.json"]  # no stray temporary file


def test_interrupted_run_exits_non_zero(interrupted):
    assert interrupted["returncode"] != 0
    assert "interrupted" in interrupted["stderr"]


def test_keyboard_interrupt_in_main_exits_130(monkeypatch, cli):
    import ficoco.profiling.matrix as matrix

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(matrix, "run_profile", interrupt)  # what ficoco.profile runs the rows with
    result = cli("profile", "--model", MODEL, "--variant", "v", "--keep", "8")
    assert result.code == 130
    assert "interrupted" in result.err


# ---- user mistakes: one "error:" line on stderr, exit code 2 -------------------------------------------------

@pytest.fixture(scope="module")
def bert_folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("bert_checkpoint")
    (folder / "config.json").write_text(json.dumps({"model_type": "bert"}))
    return folder


BAD_OPTIONS = {
    "unknown quant": (["--quant", "int3"], "int3"),
    "repeat 0": (["--repeat", "0"], "--repeat"),
    "missing image": (["--image", "/nonexistent.png"], "/nonexistent.png"),
    "not a llava checkpoint": (["--weights", "{bert}"], "bert"),
    "cuda without a GPU": (["--device", "cuda"], "cuda"),
    "batch 0": (["--batch", "0"], "--batch"),
    "unreachable keep": (["--keep", "9999"], "9999"),
    "impossible budget": (["--tflops", "0.000000001"], "1e-09"),
    "unknown device": (["--device", "tpu"], "tpu"),
    "negative warmup": (["--warmup", "-1"], "--warmup"),
    "kv bits 3": (["--kv-bits", "3"], "--kv-bits"),
    "prompt without tokenizer": (["--prompt", "hi"], "--prompt"),
    "unknown variant": (["--variant", "x"], "x"),
    "unknown option": (["--bogus"], "--bogus"),
    "unknown dtype": (["--dtype", "fp8"], "fp8"),
}


def profile_args(extra: list[str], bert: Path) -> list[str]:
    args = ["profile", "--model", MODEL, "--variant", "v", "--keep", str(KEEP)]
    extra = [str(bert) if x == "{bert}" else x for x in extra]
    if "--keep" in extra or "--tflops" in extra:  # one schedule option at a time
        args = args[:-2]
    if "--variant" in extra:
        args = args[:3]
    return [*args, *extra]


@pytest.mark.parametrize("name", list(BAD_OPTIONS))
def test_bad_input_is_one_error_line_and_exit_2(name, bert_folder, tmp_path, cli):
    import torch

    extra, needle = BAD_OPTIONS[name]
    if name == "cuda without a GPU" and torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    path = tmp_path / "r.json"
    line = assert_one_error_line(cli(*profile_args(extra, bert_folder), "--json", path))
    assert needle in line
    assert not path.exists()  # nothing was measured


def test_bad_input_in_a_real_process(bert_folder, cli):
    extra, needle = BAD_OPTIONS["not a llava checkpoint"]
    result = cli(*profile_args(extra, bert_folder), in_subprocess=True, timeout=120)
    assert needle in assert_one_error_line(result)
    assert result.out == ""


def test_missing_json_folder_is_reported_before_any_model_is_built(tmp_path, monkeypatch, cli):
    import ficoco.models.build as build

    built: list[str] = []

    def no_build(*args, **kwargs):
        built.append("model")
        raise RuntimeError("a model was built")

    monkeypatch.setattr(build, "build_model", no_build)
    result = cli("profile", "--model", MODEL, "--variant", "v", "--keep", "8",
                 "--json", tmp_path / "missing" / "r.json")
    assert "missing" in assert_one_error_line(result)
    assert built == []


def test_unreadable_image_is_a_user_error(tmp_path, cli):
    image = tmp_path / "picture.png"
    image.write_text("not an image")
    result = cli("profile", "--model", MODEL, "--variant", "v", "--keep", "8", "--repeat", "1", "--warmup", "0",
                 "--image", image, "--json", tmp_path / "r.json")
    assert "picture.png" in assert_one_error_line(result)
