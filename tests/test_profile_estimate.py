"""The time estimate of `ficoco profile` and the warm-up/repeat rule (issue 13): the arithmetic
with given rates, the rule with scripted run times, the ETA with scripted durations, the
measurement loop with a fake clock. Nothing here times anything."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from ficoco.accounting import architecture
from ficoco.profiling import estimate as est
from ficoco.profiling import predict, trackers
from ficoco.profiling.matrix import ProfileConfig, plan_run
from ficoco.profiling.runs import choose_runs, rule_text

RATES = est.Rates(device="cpu", dtype="bfloat16", matmul_flops_per_s=1e12, small_op_s=1e-5, copy_bytes_per_s=1e10,
                  threads=2)


# ---- the warm-up / repeat rule ------------------------------------------------------------------------------------

@pytest.mark.parametrize(("run_s", "device", "runs"), [
    (0.005, "cuda", (3, 10)),  # a GPU prefill in milliseconds: the most of both
    (0.005, "cpu", (1, 10)),
    (9.0, "cpu", (1, 3)),  # 3 timed runs fit in 30 s
    (27.0, "cpu", (1, 1)),
    (59.0, "cpu", (1, 1)),
    (61.0, "cpu", (0, 1)),  # over a minute: no warm-up
    (600.0, "cuda", (0, 1)),  # ten minutes: one timed run, never zero
])
def test_runs_follow_the_time_of_one_run(run_s, device, runs):
    assert choose_runs(run_s, device) == runs


def test_given_warmup_or_repeat_always_wins():
    assert choose_runs(600.0, "cpu", warmup=2) == (2, 1)
    assert choose_runs(600.0, "cpu", repeat=5) == (0, 5)
    assert choose_runs(0.001, "cuda", warmup=0, repeat=1) == (0, 1)
    assert "30 s" in rule_text("cpu") and "60 s" in rule_text("cpu")


class FakeClock:
    """perf_counter for LatencyTracker: every call of the measured function advances it by the next
    scripted duration."""

    def __init__(self, durations_s: list[float]) -> None:
        self.now, self.durations = 0.0, list(durations_s)

    def perf_counter(self) -> float:
        return self.now

    def run(self) -> None:
        self.now += self.durations.pop(0) if len(self.durations) > 1 else self.durations[0]


def measure(monkeypatch, durations_s: list[float], warmup: int, repeat: int, **kwargs: Any):
    clock = FakeClock(durations_s)
    monkeypatch.setattr(trackers.time, "perf_counter", clock.perf_counter)
    events: list[tuple[str, int, int, float | None]] = []
    stats = trackers.LatencyTracker(torch.device("cpu")).measure(
        clock.run, warmup=warmup, repeat=repeat, on_run=lambda *e: events.append(e), **kwargs)
    return stats, events


def test_a_first_run_of_minutes_cuts_the_planned_runs(monkeypatch):
    # Planned from a wrong estimate: 1 warm-up + 10 timed; the warm-up takes two minutes.
    stats, events = measure(monkeypatch, [120.0], 1, 10, choose=lambda s: choose_runs(s, "cpu"))
    assert stats.warmup_ms == (120_000.0,) and stats.samples_ms == (120_000.0,)
    assert [(e[0], e[1], e[2]) for e in events if e[3] is None] == [("warm-up", 1, 1), ("timed run", 1, 1)]


def test_a_fast_first_run_planned_as_timed_becomes_the_warm_up(monkeypatch):
    # The estimate said minutes (0 warm-up, 1 timed); the run takes 0.5 s: it ran cold, so it is the
    # warm-up, and as many timed runs as fit in 30 s (at most 10) follow.
    stats, _ = measure(monkeypatch, [0.5], 0, 1, choose=lambda s: choose_runs(s, "cpu"))
    assert stats.warmup_ms == (500.0,)
    assert stats.samples_ms == (500.0,) * 10


def test_without_a_rule_the_counts_are_kept_and_every_run_is_announced(monkeypatch):
    stats, events = measure(monkeypatch, [1.0, 2.0, 3.0], 1, 2, after_each=lambda k: None)
    assert stats.warmup_ms == (1000.0,) and stats.samples_ms == (2000.0, 3000.0)
    assert events == [("warm-up", 1, 1, None), ("warm-up", 1, 1, 1.0), ("timed run", 1, 2, None),
                      ("timed run", 1, 2, 2.0), ("timed run", 2, 2, None), ("timed run", 2, 2, 3.0)]


# ---- the estimate's arithmetic ------------------------------------------------------------------------------------

def test_prefill_is_the_roofline_at_this_machines_rates_plus_dispatch_plus_probe_passes():
    ops = predict.FORWARD_OPS["fp16"] + 10 * predict.LAYER_OPS["fp16"] + 3 * predict.REDUCING_LAYER_OPS
    probe_s = 1e9 / 1e10  # the method's probe moves 1 GB at 10 GB/s
    assert est.dispatch_s(10, 3, "fp16", RATES) == pytest.approx(ops * 1e-5)
    assert est.predict_prefill_s(4.0, 10, 3, "fp16", RATES) == pytest.approx(4.0 + ops * 1e-5)
    assert est.predict_prefill_s(4.0, 10, 3, "fp16", RATES, probe_bytes=1e9) == pytest.approx(
        4.0 + ops * 1e-5 + probe_s)
    # bitsandbytes layers dispatch more
    assert est.predict_prefill_s(4.0, 10, 3, "int4", RATES) > est.predict_prefill_s(4.0, 10, 3, "fp16", RATES)


def test_the_machine_is_a_roofline_of_its_measured_rates():
    from ficoco.accounting import Quant, account, architecture

    fp16, int4 = est.machine(RATES, "fp16"), est.machine(RATES, "int4")
    assert fp16.fp16_ops_per_s == pytest.approx(1e12 * est.MATMUL_EFFICIENCY["fp16"])
    assert fp16.bandwidth_bytes_per_s == pytest.approx(1e10 * est.BANDWIDTH_EFFICIENCY)
    assert int4.fp16_ops_per_s == pytest.approx(1e12 * est.MATMUL_EFFICIENCY["int4"])
    # Many tokens: bound by the FLOPs. Few tokens: by reading the weights once.
    from ficoco.accounting import CountOptions, Schedule

    arch = architecture(plan_run(ProfileConfig(model="llava-1.5-7b", variants=("vanilla",), device="cpu")).profile)
    opts = CountOptions(convention="flops", scope="all", text_tokens=60, lm_head_tokens="last")
    cost = account(arch, Schedule("vanilla"), Quant("fp16", 16, 16, 16), opts, gpu=fp16)
    flops_s = cost.tflops * 1e12 / fp16.fp16_ops_per_s
    assert flops_s <= cost.roofline_s < 1.1 * flops_s
    slow_memory = est.machine(est.Rates(**{**RATES.to_json(), "copy_bytes_per_s": 1e8}), "fp16")
    reading_s = cost.weight_bytes / slow_memory.bandwidth_bytes_per_s
    slow = account(arch, Schedule("vanilla"), Quant("fp16", 16, 16, 16), opts, gpu=slow_memory)
    assert reading_s <= slow.roofline_s


def test_read_scores_are_heads_times_their_rows_and_the_entering_tokens_per_reducing_layer(arch_of):
    from ficoco.accounting import CountOptions, resolve_schedule

    arch = arch_of("llava-tiny")
    opts = CountOptions(text_tokens=12)
    v = resolve_schedule(arch, "v", opts, keep=8)
    l_schedule = resolve_schedule(arch, "l", opts, keep=8)

    def scores(schedule, batch):
        return sum(r.scores for r in predict.schedule_reads(arch, schedule, 12, batch))

    assert scores(resolve_schedule(arch, "vanilla", opts), 1) == 0
    first = v.removals[0]
    # A tiny layer is read whole, once: its first reducing layer's 65 rows over its 65 keys ([CLS] and 64 patches).
    assert first.stage == "vision" and scores(v, 1) > arch.vision.heads * 65 * 65 - 1
    # the first reducing layer sees every patch and the CLS token; later ones fewer
    assert scores(v, 1) < len(v.removals) * arch.vision.heads * 65 * 65
    assert scores(v, 2) == 2 * scores(v, 1)
    entering = 12 + 64  # text and every visual token enter L's first reducing layer
    assert scores(l_schedule, 1) >= arch.decoder.heads * entering * entering


FILL = est.Rates(**{**RATES.to_json(), "fill_bytes_per_s": 2e9, "host_touch_s_per_byte": 1e-9})


def test_build_bytes_count_what_a_fresh_build_fills_and_keeps(arch_of):
    from ficoco.accounting.memory import Quant, weight_bytes

    arch = arch_of("llava-tiny")
    sixteen = Quant("fp16", 16, 16, 16)
    weights = weight_bytes(arch, "all", sixteen)
    bf16 = est.build_bytes(arch, "fp16", 16)
    assert (bf16.filled, bf16.resident, bf16.weights_16bit) == (weights, weights, weights)
    fp32 = est.build_bytes(arch, "fp16", 32)
    assert fp32.filled == fp32.resident == 2 * weights
    # An upcast layout: built in bf16, then everything but the upcast layers' linears written again in fp32,
    # plus the scratch of the largest upcast weight.
    d = arch.decoder
    layer_linear = d.hidden * d.heads * d.head_dim * 2 + 2 * d.hidden * d.kv_heads * d.head_dim + 3 * d.hidden * d.ffn
    upcast = est.build_bytes(arch, "fp16", 32, storage_bits=16, upcast_layers=d.layers)
    scratch = max(d.hidden * d.ffn, d.hidden * d.heads * d.head_dim) * 4
    kept_fp32 = (weights / 2 - d.layers * layer_linear) * 4
    assert upcast.filled == pytest.approx(weights + kept_fp32 + scratch)
    assert upcast.resident == pytest.approx(kept_fp32 + d.layers * layer_linear * 2 + scratch)
    # Quantized: every weight materialised once in the compute dtype; less stays.
    int4 = est.build_bytes(arch, "int4", 16)
    assert int4.filled == weights and int4.resident < weights / 2


def test_build_and_row_arithmetic():
    size = est.BuildBytes(filled=1e10, resident=8e9, weights_16bit=1e10)
    fill_s, host_s = 1e10 / 2e9, 8e9 * 1e-9  # at the fill rate; the host's first touch of what stays
    assert est.predict_build_s(size, "fp16", FILL) == pytest.approx(est.BUILD_OVERHEAD_S + fill_s + host_s)
    assert est.predict_build_s(size, "int8", FILL, imports_s=2.0) == pytest.approx(
        2.0 + est.BUILD_OVERHEAD_S + fill_s + host_s + 1.0 * est.QUANTIZE_PASSES["int8"])  # 1 s per copy of 10 GB
    # Off a VM that reclaims free memory, no host share; without a measured fill rate, the copy rate.
    assert est.predict_build_s(size, "fp16", RATES) == pytest.approx(est.BUILD_OVERHEAD_S + 1e10 / 1e10)
    # A row's rate probe: its passes, each its FLOPs at the matmul share, its copies and a small op per call.
    one_pass = 1e12 / (1e12 * est.MATMUL_EFFICIENCY["fp16"]) + 1e9 / 1e10 + 10 * 1e-5
    assert est.rate_probe_s(1e12, 1e9, 10, 3, "fp16", RATES) == pytest.approx(3 * one_pass)
    assert predict.rate_probe_passes(repeat=3) == 2 * (1 + predict.PASSES) + 3
    assert est.row_runs_s(2.0, (1, 3)) == pytest.approx(4 * 2.0)
    assert est.row_runs_s(2.0, (1, 3), 0.5, 5.0, (1, 2)) == pytest.approx(4 * 2.0 + 0.5 + 3 * 5.0)


def test_estimate_of_a_plan_with_given_rates():
    config = ProfileConfig(model="llava-1.5-7b", variants=("vanilla", "v"), tflops=1.5, device="cpu",
                          dtype="bf16")  # auto would differ on a CPU without fast bf16
    plan = plan_run(config)
    estimate = est.estimate_run(config, plan, RATES)
    vanilla, v = estimate.rows
    assert (vanilla.variant, v.variant) == ("vanilla", "v")
    assert vanilla.tflops > 5 * v.tflops > 0
    from ficoco.profiling.matrix import analytic

    roofline_s = [analytic(plan.profile, row, config, est.machine(RATES, "fp16"))["roofline_ms"] / 1e3
                  for row in plan.rows]
    assert vanilla.prefill_s == pytest.approx(est.predict_prefill_s(roofline_s[0], 24 + 32, 0, "fp16", RATES))
    arch = architecture(plan.profile)
    probe = predict.probe_bytes(arch, plan.rows[1].schedule, 60, 1, 2.0)
    assert probe > 0
    assert v.prefill_s == pytest.approx(est.predict_prefill_s(roofline_s[1], 24 + 32, 11, "fp16", RATES, probe))
    assert v.first_extra_s == pytest.approx(est.FIRST_RUN_DISPATCH * est.dispatch_s(24 + 32, 11, "fp16", RATES))
    for spec, row in zip(plan.rows, estimate.rows, strict=True):
        assert (row.warmup, row.repeat) == choose_runs(row.prefill_s, "cpu")
        shapes = predict.rate_probe_shapes(arch, spec.schedule, text_tokens=60)
        assert shapes.linear and shapes.attention
        assert row.rate_probe_s == pytest.approx(est.rate_probe_s(
            shapes.pass_flops(), shapes.pass_bytes(), shapes.calls, predict.rate_probe_passes(row.repeat), "fp16",
            RATES)) and row.rate_probe_s > 0
        assert row.wall_s == pytest.approx(est.ROW_OVERHEAD_S + row.rate_probe_s + est.row_runs_s(
            row.prefill_s, (row.warmup, row.repeat), row.first_extra_s))
    assert set(estimate.build_s) == {"fp16"} and estimate.build_s["fp16"] > 13.9e9 / 1e10  # 7B in 16 bits
    assert estimate.total_s == pytest.approx(estimate.build_s["fp16"] + vanilla.wall_s + v.wall_s)
    assert estimate.dtype.startswith("bfloat16")
    # The memory guard's need against the free memory the tests see (tests/conftest.py: 64 GB).
    assert estimate.memory.startswith("need ") and estimate.memory.endswith(" vs 64.00 GB free")
    est.plan_runs(plan, estimate)
    assert [(r.warmup, r.repeat) for r in plan.rows] == [(r.warmup, r.repeat) for r in estimate.rows]
    data = estimate.to_json()
    assert data["total_s"] == estimate.total_s and data["rows"] == 2 and data["rates"]["small_op_s"] == 1e-5


def test_given_runs_are_kept_and_generation_is_estimated():
    config = ProfileConfig(model="llava-tiny", variants=("vanilla",), device="cpu", warmup=0, repeat=2, new_tokens=4)
    estimate = est.estimate_run(config, plan_run(config), RATES)
    (row,) = estimate.rows
    assert (row.warmup, row.repeat) == (0, 2) and row.generation_runs == (0, 2)
    assert row.generation_s is not None and row.generation_s > row.prefill_s
    assert estimate.runs_rule == "warmup=/repeat="


def test_the_plans_dtype_and_memory_are_shown_when_it_has_them():
    config = ProfileConfig(model="llava-tiny", variants=("vanilla",), device="cpu")
    plan = plan_run(config)

    class Choice:
        storage, compute, reason, upcast = torch.float32, torch.float32, "AVX2 without AMX: fp32 is fastest", False

    plan.__dict__["dtype"] = Choice()
    plan.__dict__["memory"] = {"total": 15.9e9, "free": 21.0e9}
    estimate = est.estimate_run(config, plan, RATES)
    assert estimate.dtype == "float32 (AVX2 without AMX: fp32 is fastest)"
    assert estimate.memory == "need 15.90 GB vs 21.00 GB free"


# ---- the ETA -------------------------------------------------------------------------------------------------------

def two_rows() -> est.RunEstimate:
    rows = [est.RowEstimate("vanilla", "fp16", 1, 8.0, 10.0, 1, 2, 1.0, None, (0, 0), 0.0),
            est.RowEstimate("v", "fp16", 1, 2.0, 2.0, 1, 10, 0.5, None, (0, 0), 0.0)]
    for row in rows:
        row.wall_s = est.ROW_OVERHEAD_S + est.row_runs_s(row.prefill_s, (row.warmup, row.repeat), row.first_extra_s)
    return est.RunEstimate(rates=RATES, dtype="bfloat16", memory="-", rows=rows, build_s={"fp16": 20.0})


def test_eta_starts_at_the_estimate_and_counts_down_within_a_step():
    estimate = two_rows()
    eta = est.Eta(estimate)
    assert eta.remaining_s() == pytest.approx(estimate.total_s)
    eta.started(0, "building the model")
    assert eta.remaining_s(5.0) == pytest.approx(estimate.total_s - 5.0)
    assert eta.remaining_s(500.0) == pytest.approx(estimate.total_s - 20.0)  # an overrun step stops at zero


def test_eta_follows_the_runs_measured_so_far():
    estimate = two_rows()
    eta = est.Eta(estimate)
    eta.started(0, "building the model")
    eta.finished(0, "building the model", 40.0)  # builds take twice the estimate: none left
    eta.started(0, "warm-up", 1, 1)
    eta.finished(0, "warm-up", 2 * (10.0 + 1.0))  # runs take twice the estimate too (the first one's extra 1 s)
    eta.started(0, "timed run", 1, 2)
    eta.finished(0, "timed run", 20.0)
    eta.started(0, "timed run", 2, 2)
    # this row: one run at its own median (20 s); the next row: its estimate, doubled
    expected_next = est.ROW_OVERHEAD_S + (estimate.rows[1].wall_s - est.ROW_OVERHEAD_S) * 2
    assert eta.remaining_s() == pytest.approx(20.0 + expected_next)
    eta.finished(0, "timed run", 20.0)
    eta.row_done(0)
    assert eta.remaining_s() == pytest.approx(expected_next)
    eta.started(1, "warm-up", 1, 1)
    eta.finished(1, "warm-up", 12.0)
    eta.started(1, "timed run", 1, 3)  # the time rule revised 10 timed runs to 3
    eta.finished(1, "timed run", 3.0)
    assert eta.remaining_s() == pytest.approx(2 * 3.0)
    eta.row_done(1)
    assert eta.remaining_s() == 0.0


# ---- the command: --dry-run, and the rule inside a real measurement -------------------------------------------------

def test_dry_run_prints_the_plan_and_estimate_and_builds_nothing(monkeypatch, tmp_path, cli):
    import ficoco.models.build as build
    from ficoco.profiling import matrix

    built: list[str] = []
    monkeypatch.setattr(build, "build_model", lambda *a, **k: built.append("build_model"))
    monkeypatch.setattr(matrix, "build_for", lambda *a, **k: built.append("build_for"))
    monkeypatch.setattr(est, "measure_rates", lambda dtype, device: RATES)
    path = tmp_path / "r.json"
    # --dtype bf16: auto would pick another dtype on a CPU without fast bf16 (CI's CPU varies).
    result = cli("profile", "--model", "llava-1.5-7b", "--variant", "v", "--tflops", "1.5",
                 "--dry-run", "--dtype", "bf16", "--json", str(path))
    assert result.code == 0, result.err
    assert built == [] and not path.exists()
    lines = result.out.splitlines()
    assert lines[0].startswith("plan: 2 row(s), computing in bfloat16 (")
    assert lines[0].endswith(" vs 64.00 GB free") and "; memory need " in lines[0]
    assert lines[1].startswith("estimate: ") and "matmul 1 TFLOP/s in bfloat16, copy 10 GB/s" in lines[1]
    assert "10 us per small op" in lines[1]
    assert lines[2].startswith("  bf16 model build ~")  # the unquantized model, named by the dtype it runs in
    assert lines[3].startswith("  [1/2] vanilla bf16 b1: 8.856 TFLOPs, prefill ~")
    assert lines[4].startswith("  [2/2] v bf16 b1: ")
    assert "warm-up +" in lines[3] and "timed: ~" in lines[3]


def test_the_time_rule_revises_a_rows_runs_from_its_first_run(monkeypatch):
    from ficoco.profiling import matrix

    config = ProfileConfig(model="llava-tiny", variants=("vanilla",), device="cpu")
    plan = plan_run(config)
    model = matrix.build_for(config, plan, "fp16")
    seen: list[float] = []

    def one_timed_run(run_s: float, device_type: str, warmup: int | None, repeat: int | None) -> tuple[int, int]:
        seen.append(run_s)
        return (0 if warmup is None else warmup), (1 if repeat is None else repeat)  # a run of minutes

    monkeypatch.setattr(matrix, "choose_runs", one_timed_run)
    steps: list[tuple[str, int, int, float | None]] = []
    result = matrix.measure_row(model, plan.rows[0], config, plan, on_run=lambda *e: steps.append(e))
    # Planned as the device's most (1 + 10); the first run was the warm-up, then one timed run.
    assert len(seen) == 1 and seen[0] > 0
    assert result["runs"]["warmup"] == 1 and result["runs"]["repeat"] == 1
    assert result["runs"]["chosen_by"].startswith("time budget, from the first run (")
    assert len(result["latency"]["samples_ms"]) == 1 and len(result["latency"]["warmup_ms"]) == 1
    assert [(s[0], s[1], s[2]) for s in steps if s[3] is None] == [("warm-up", 1, 1), ("timed run", 1, 1)]
    explicit = ProfileConfig(model="llava-tiny", variants=("vanilla",), device="cpu", repeat=2)
    plan = plan_run(explicit)
    result = matrix.measure_row(model, plan.rows[0], explicit, plan)
    assert result["runs"]["repeat"] == 2  # --repeat wins over the rule
    assert result["runs"]["chosen_by"].endswith("; repeat= as given")


def test_the_time_line_compares_the_estimate_with_the_measured_time():
    from ficoco_cli.render import time_line

    report: dict[str, Any] = {"estimate": {"total_s": 90.0, "rows": 2}, "wall_s": 100.0, "rows": [
        {"wall_s": 40.0, "estimate": {"wall_s": 36.0}}, {"wall_s": 50.0, "estimate": {"wall_s": 60.0}}]}
    assert time_line(report) == ("time: estimated 1:30 before the run, measured 1:40 (-10 %); rows (builds apart): "
                                 "estimate -10 % to +20 % of the measured")
    report["rows"].pop()  # an interrupted run: no total to compare
    assert time_line(report) == ("time: estimated 1:30 before the run, measured 1:40 for 1 of 2 rows; rows (builds "
                                 "apart): estimate -10 % to -10 % of the measured")
    assert time_line({"rows": []}) is None  # a report made before the estimate


def test_the_title_says_what_ran_when_the_rule_gave_rows_different_counts():
    import io

    from rich.console import Console

    from ficoco_cli.render import profile_table

    rows = [{"variant": "vanilla", "quant": "fp16", "batch": 1, "status": "ok", "runs": {"warmup": 1, "repeat": 3}},
            {"variant": "v", "quant": "fp16", "batch": 1, "status": "ok", "runs": {"warmup": 0, "repeat": 10}}]
    console = Console(width=200, record=True, file=io.StringIO())
    console.print(profile_table({"config": {"warmup": "auto", "repeat": "auto"}, "rows": rows}))
    assert "3-10 runs after 0-1 warm-up" in " ".join(console.export_text().split())
    rows[1]["runs"] = {"warmup": 1, "repeat": 3}
    console.print(profile_table({"config": {"warmup": "auto", "repeat": "auto"}, "rows": rows}))
    assert "3 runs after 1 warm-up" in " ".join(console.export_text(clear=True).split())


# ---- the per-row prediction at rates for the row's shapes (profiling/predict.py) ---------------------------------

# The decoder's norms and gated activation are elementwise kernels (elements per second, not FLOPs): free here.
FREE_ELEMENTWISE = {kind: {1: 1e30} for kind in ("rms_norm", "gated_rms_norm", "gated_act")}


def _flat_rates(flops_per_s: float, **kwargs: Any):
    from ficoco.profiling.predict import TableRates

    # Memory so fast that only FLOPs count, no dispatch: the time is the FLOPs at the table's rates.
    return TableRates(dtype="float32", flops_per_s_by_tokens={2: flops_per_s}, bandwidth_bytes_per_s=1e30,
                      kernels_by_tokens=FREE_ELEMENTWISE, **kwargs)


def _tiny(variant: str = "vanilla", **budget: Any):
    from ficoco.accounting import CountOptions, architecture, resolve_schedule
    from ficoco.profiles import load_profile

    arch = architecture(load_profile("llava-tiny"))
    return arch, resolve_schedule(arch, variant, CountOptions(text_tokens=12), **budget)


def _accountant_flops(arch, schedule) -> float:
    from ficoco.accounting import CountOptions, Quant, account

    opts = CountOptions(convention="flops", scope="all", text_tokens=12, lm_head_tokens="last")
    return account(arch, schedule, Quant("fp16", 16, 32, 32), opts).tflops * 1e12


def test_a_prediction_at_one_rate_is_the_accountants_flops_at_that_rate():
    from ficoco.profiling.predict import predict_prefill

    arch, vanilla = _tiny()
    prediction = predict_prefill(arch, vanilla, _flat_rates(1e9), text_tokens=12, compute_bits=32)
    assert prediction.total_s == pytest.approx(_accountant_flops(arch, vanilla) / 1e9, rel=1e-9)
    assert prediction.parts_s["upcast"] == prediction.parts_s["dispatch"] == prediction.parts_s["probe"] == 0


def test_the_matmul_rate_is_the_one_measured_at_the_ops_token_count():
    from ficoco.profiling.predict import TableRates, predict_prefill

    arch, vanilla = _tiny()
    # One token (the LM head on the last token) multiplies 1000 times slower than every longer op.
    rates = TableRates(dtype="float32", flops_per_s_by_tokens={1: 1e6, 2: 1e9}, bandwidth_bytes_per_s=1e30,
                       kernels_by_tokens=FREE_ELEMENTWISE)
    head_flops = 2 * arch.decoder.hidden * arch.decoder.vocab
    expected_s = (_accountant_flops(arch, vanilla) - head_flops) / 1e9 + head_flops / 1e6
    assert predict_prefill(arch, vanilla, rates, text_tokens=12, compute_bits=32).total_s == pytest.approx(
        expected_s, rel=1e-9)


def test_attention_takes_its_own_rate():
    from ficoco.accounting.flops import model_ops
    from ficoco.accounting.schedule import plan_tokens
    from ficoco.profiling.predict import predict_prefill

    arch, vanilla = _tiny()
    plain = predict_prefill(arch, vanilla, _flat_rates(1e9), text_tokens=12, compute_bits=32)
    slow = predict_prefill(arch, vanilla, _flat_rates(1e9, attention_by_tokens={2: 5e8}), text_tokens=12,
                           compute_bits=32)
    ops = model_ops(arch, plan_tokens(arch, vanilla, text_tokens=12), lm_head_tokens="last")
    attention_flops = sum(2 * op.macs for op in ops if op.name in ("qk", "sv"))
    assert slow.parts_s["attention"] == pytest.approx(attention_flops / 5e8)
    assert slow.total_s - plain.total_s == pytest.approx(attention_flops / 1e9)


def test_memory_bound_ops_and_the_upcast_copy_take_bytes_over_the_measured_rates():
    from ficoco.profiling.predict import TableRates, predict_prefill

    arch, vanilla = _tiny()
    d = arch.decoder
    layer_weights = (d.hidden * d.heads * d.head_dim * 2 + 2 * d.hidden * d.kv_heads * d.head_dim
                     + 3 * d.hidden * d.ffn)
    # Matmuls infinitely fast: what is left is reading and writing memory, and converting 2 layers' weights.
    rates = TableRates(dtype="float32", flops_per_s_by_tokens={2: 1e30}, bandwidth_bytes_per_s=1e9,
                       convert_bytes_per_s=2e9)
    upcast = predict_prefill(arch, vanilla, rates, text_tokens=12, compute_bits=32, upcast_layers=2)
    assert upcast.parts_s["upcast"] == pytest.approx(2 * layer_weights * 4 / 2e9)
    plain = predict_prefill(arch, vanilla, rates, text_tokens=12, compute_bits=32)
    assert plain.parts_s["upcast"] == 0 and plain.parts_s["memory"] > 0
    # A linear layer of one token is bound by reading its weights: the LM head's vocab x hidden floats.
    assert plain.parts_s["linear"] >= d.vocab * d.hidden * 4 / 1e9


def test_dispatch_probe_and_method_work_are_added_for_a_reducing_row():
    from ficoco.accounting import CountOptions, Quant, account
    from ficoco.profiling.predict import TableRates, predict_prefill

    arch, v = _tiny("v", keep=8)
    rates = TableRates(dtype="float32", flops_per_s_by_tokens={2: 1e9}, bandwidth_bytes_per_s=1e9, small_op_s=1e-5)
    prediction = predict_prefill(arch, v, rates, text_tokens=12, compute_bits=32)
    parts = prediction.parts_s
    layers = arch.vision.layers + arch.decoder.layers
    assert parts["dispatch"] == pytest.approx(est.dispatch_s(layers, len(v.removals), "fp16", rates))
    # V's reads priced as their score products at the matmul rate (the table gives no reads rate)
    reads = predict.schedule_reads(arch, v, 12, 1)
    assert parts["probe"] == pytest.approx(sum(2 * r.macs for r in reads) / 1e9) and parts["probe"] > 0
    opts = CountOptions(convention="flops", scope="all", text_tokens=12, lm_head_tokens="last")
    method_tflops = account(arch, v, Quant("fp16", 16, 32, 32), opts).method_tflops
    assert parts["method"] == pytest.approx(method_tflops * 1e12 / 1e9)
    assert prediction.total_s == pytest.approx(sum(parts.values()))
    assert prediction.to_json()["prefill_ms"] == pytest.approx(prediction.total_s * 1e3)


def test_a_profile_row_carries_its_prediction_and_the_pair_its_predicted_speedup():
    from ficoco.profiling.matrix import predicted
    from ficoco.report import add_comparisons

    config = ProfileConfig(model="llava-tiny", variants=("vanilla", "v"), keep=8, device="cpu", dtype="fp32")
    plan = plan_run(config)
    rows = []
    for spec in plan.rows:
        figures = predicted(plan, config, spec)
        assert figures["predicted_ms"] == pytest.approx(figures["predicted"]["prefill_ms"])
        assert figures["predicted_ms"] > 0
        rows.append({"variant": spec.variant, "quant": "fp16", "batch": 1, "status": "ok",
                     "latency": {"median_ms": 10.0}, "analytic": {"tflops": 1.0}, "memory": {}, **figures})
    add_comparisons(rows)
    vanilla, v = rows
    assert v["predicted_speedup_vs_vanilla"] == pytest.approx(vanilla["predicted_ms"] / v["predicted_ms"])
    assert v["measured_over_predicted"] == pytest.approx(10.0 / v["predicted_ms"])
    assert predicted(plan, ProfileConfig(model="llava-tiny", device_map="auto"), plan.rows[0]) == {"predicted_ms": None}


# ---- the rate probe: round-robin passes before, between and after a row's runs ---------------------------------------

class _Clock:
    """perf_counter for the probe: every timed call takes the next of `durations` (cycled)."""

    def __init__(self, durations: list[float]) -> None:
        self.durations, self.now, self.calls, self.started = durations, 0.0, 0, False

    def __call__(self) -> float:
        if self.started:  # an end: the call took its duration
            self.now += self.durations[self.calls % len(self.durations)]
            self.calls += 1
        self.started = not self.started
        return self.now


LINEAR = [(4, 8, 8), (2, 8, 16)]
ATTENTION = [(2, 4, 8, True)]


def test_every_pass_times_every_shape_once_and_a_shape_is_measured_once():
    rates = predict.MeasuredRates("float32")
    rates.measure(linear=LINEAR, attention=ATTENTION)
    keys = {("linear", *s) for s in LINEAR} | {("attention", *s) for s in ATTENTION} | {("bandwidth",)}
    assert len(rates._passes) == predict.PASSES
    assert all(set(one) == keys for one in rates._passes)
    rates.measure(linear=LINEAR[:1])  # measured already: no new pass
    assert len(rates._passes) == predict.PASSES
    rates.measure(linear=[(3, 8, 8)])  # a new shape: passes of it alone
    assert len(rates._passes) == 2 * predict.PASSES and set(rates._passes[-1]) == {("linear", 3, 8, 8)}
    assert rates.linear_flops_per_s(3, 8, 8) > 0 and rates.attention_flops_per_s(*ATTENTION[0]) > 0


def test_a_shapes_rate_is_its_work_over_its_mean_time_per_pass(monkeypatch):
    """A run of seconds lasts the time-average of the machine's states it meets: with two states (a
    neighbour busy, then idle), the mean time of point samples estimates it, their median would sit
    in one of the states."""
    rates = predict.MeasuredRates("float32", passes=3)
    # One linear shape and the bandwidth copy per pass (sorted: bandwidth, then linear); the middle
    # pass meets the machine in its fast state.
    clock = _Clock([1.0, 2.0, 1.0, 0.5, 1.0, 2.0])
    monkeypatch.setattr(predict.time, "perf_counter", clock)
    rates.measure(linear=[(4, 8, 8)])
    assert clock.calls == 6
    assert rates.linear_flops_per_s(4, 8, 8) == pytest.approx(2 * 4 * 8 * 8 / 1.5)
    assert rates.bandwidth_bytes_per_s == pytest.approx(2 * (1 << 25) * 2 / 1.0)
    # Each pass's own rates.
    per_pass = [one.linear_flops_per_s(4, 8, 8) for one in rates.pass_rates()]
    assert per_pass == pytest.approx([2 * 4 * 8 * 8 / s for s in (2.0, 0.5, 2.0)])


def test_a_pass_between_runs_borrows_the_models_weights_and_allocates_none(monkeypatch):
    """Between timed runs the probe must not add memory beside the model (the row's peak is being
    measured): a linear shape runs on the model's own weight of as many values, a shape with none is
    left for the passes after the runs, and the bandwidth copy too."""
    model = torch.nn.Linear(8, 16, bias=False)  # a weight of 128 values: the (2, 8, 16) shape borrows it
    rates = predict.MeasuredRates("float32", weights=predict.model_weights(model))
    rates.measure(linear=LINEAR, attention=ATTENTION)
    requested: list[tuple[int, ...]] = []
    weights_used: list[int] = []
    original_tensor, original_linear = predict.MeasuredRates._tensor, torch.nn.functional.linear

    def tensor(self, *shape, kind=None):
        requested.append(shape)
        return original_tensor(self, *shape, kind=kind)

    def linear(x, weight, *args):
        weights_used.append(weight.untyped_storage().data_ptr())
        return original_linear(x, weight, *args)

    monkeypatch.setattr(predict.MeasuredRates, "_tensor", tensor)
    monkeypatch.setattr(torch.nn.functional, "linear", linear)
    rates.sample()
    assert set(rates._passes[-1]) == {("linear", 2, 8, 16), ("attention", *ATTENTION[0])}
    assert weights_used == [model.weight.untyped_storage().data_ptr()]
    # Activations only: the (2 x 8) input and attention's q, k, v; no weight-sized buffer.
    assert sorted(requested) == sorted([(2, 8), *[(1, 2, 4, 8)] * 3])
    rates.sample(passes=2)  # after the runs: everything again, a buffer for the shape with no weight
    assert len(rates._passes) == predict.PASSES + 3
    assert all(len(one) == 4 for one in rates._passes[-2:])


def test_expected_shapes_are_timed_from_the_next_pass_on_and_untried_kernel_kinds_are_left_out():
    """A row's shapes at counts its warm-up decided join the passes between the timed runs (`expect`), with no
    burst of their own; a kernel key of a kind never called here waits for `measure`, which can find it fails."""
    model = torch.nn.Linear(8, 16, bias=False)
    rates = predict.MeasuredRates("float32", weights=predict.model_weights(model))
    rates.measure(linear=LINEAR)
    before = len(rates._passes)
    shapes = predict.ProbeShapes(linear=[(5, 8, 16)], kernels={("rms_norm", 5, 8): 40.0})
    rates.expect(shapes)
    assert len(rates._passes) == before  # nothing timed yet
    rates.sample()
    assert ("linear", 5, 8, 16) in rates._passes[-1] and ("rms_norm", 5, 8) not in rates._work
    assert rates.linear_flops_per_s(5, 8, 16) > 0 and len(rates._passes) == before + 1


def test_a_prediction_prices_the_row_at_each_pass_and_says_how_far_they_spread(monkeypatch):
    from ficoco.profiles import load_profile

    arch, vanilla = _tiny()
    rates = predict.MeasuredRates("float32")
    monkeypatch.setattr(predict.time, "perf_counter", _Clock([1e-3]))  # a steady machine: every call alike
    steady = predict.row_prediction(load_profile("llava-tiny"), vanilla, quant="fp16", batch=1, text_tokens=12,
                                    dtype=torch.float32, rates=rates)
    assert len(steady.passes_s) == predict.PASSES
    assert steady.passes_s == pytest.approx([steady.total_s] * predict.PASSES) and steady.spread == 0
    # One pass twice as slow for every shape (of three): its total is twice the rate-bound parts
    # (dispatch is not a rate), and the mean time of each shape is 4/3 of the steady one.
    monkeypatch.setattr(predict.time, "perf_counter", _Clock([2e-3]))
    rates._passes.clear()
    rates._run_passes(sorted(rates._work, key=str), 1, allocate=True, warm_up=False)
    monkeypatch.setattr(predict.time, "perf_counter", _Clock([1e-3]))
    rates._run_passes(sorted(rates._work, key=str), 2, allocate=True, warm_up=False)
    moved = predict.row_prediction(load_profile("llava-tiny"), vanilla, quant="fp16", batch=1, text_tokens=12,
                                   dtype=torch.float32, rates=rates)
    # The prediction is the median pass's (the measured prefill is its runs' median): the slow pass moves
    # it not at all; at the mean rates it would be a third of the rate-bound parts longer.
    assert moved.total_s == pytest.approx(steady.total_s)
    assert moved.parts_s == pytest.approx(steady.parts_s)
    assert moved.at_mean_rates_s == pytest.approx(steady.total_s + (steady.total_s - steady.parts_s["dispatch"]) / 3)
    assert moved.passes_s[1:] == pytest.approx([steady.total_s] * 2)
    assert moved.passes_s[0] == pytest.approx(2 * steady.total_s - steady.parts_s["dispatch"])
    assert moved.spread == pytest.approx((moved.passes_s[0] - steady.total_s) / moved.total_s)
    as_json = moved.to_json()
    assert as_json["spread"] == moved.spread and len(as_json["passes_ms"]) == 3
    assert as_json["prefill_at_mean_rates_ms"] == pytest.approx(moved.at_mean_rates_s * 1e3)


def test_a_prediction_at_an_even_number_of_passes_is_the_mean_of_the_two_in_the_middle():
    one, two, three, four = (predict.Prediction(total, {"linear": total - 1.0, "dispatch": 1.0})
                             for total in (5.0, 2.0, 9.0, 3.0))
    at_mean = predict.Prediction(4.5, {"linear": 3.5, "dispatch": 1.0})
    median = predict.Prediction.at_median_pass([one, two, three, four], at_mean)
    # Sorted by total 2, 3, 5, 9: the middle two are 3 and 5; their parts are averaged, so the parts still add up.
    assert median.total_s == pytest.approx(4.0) and median.parts_s == pytest.approx({"linear": 3.0, "dispatch": 1.0})
    assert median.passes_s == [5.0, 2.0, 9.0, 3.0] and median.at_mean_rates_s == 4.5
    odd = predict.Prediction.at_median_pass([one, two, three], at_mean)
    assert odd.total_s == pytest.approx(5.0) and odd.parts_s == pytest.approx(one.parts_s)


@pytest.mark.parametrize(("warmup", "passes"), [(1, 1 + 2 + predict.PASSES), (0, predict.PASSES + 2 + predict.PASSES)])
def test_a_measured_rows_rates_are_probed_before_between_and_after_its_runs(monkeypatch, warmup, passes):
    from ficoco.profiling.matrix import run_profile

    order: list[str] = []
    original = predict.MeasuredRates._run_passes

    def recorded(self, keys, count, *, allocate, warm_up):
        order.append(f"{count} pass{'es' if count > 1 else ''}")
        return original(self, keys, count, allocate=allocate, warm_up=warm_up)

    monkeypatch.setattr(predict.MeasuredRates, "_run_passes", recorded)
    config = ProfileConfig(model="llava-tiny", variants=("vanilla",), device="cpu", dtype="fp32", warmup=warmup,
                           repeat=2, text_tokens=12)
    rows: list[dict[str, Any]] = []
    run_profile(config, plan_run(config), rows.append)
    (row,) = rows
    assert row["status"] == "ok"
    # With a warm-up: the passes before it are dropped once it has run, and one pass is made then (they met the
    # process before the row's first forward); one after each of the 2 timed runs; PASSES after. Without a
    # warm-up the passes before the first timed run stay.
    assert order[0] == f"{predict.PASSES} passes" and order[-1] == f"{predict.PASSES} passes"
    assert len(row["predicted"]["passes_ms"]) == passes
    assert row["predicted_ms"] == pytest.approx(row["predicted"]["prefill_ms"]) and row["predicted_ms"] > 0


def test_a_width_with_many_token_counts_is_timed_at_a_few_and_read_between_them():
    shapes = [(tokens, 8, 16) for tokens in range(1, 21)] + [(5, 4, 4), (9, 4, 4)]
    grid = predict._TokenGrid(shapes, position=0)
    timed = sorted(shape[0] for shape in grid.timed if shape[1:] == (8, 16))
    assert len(timed) == predict.GRID_COUNTS and timed[0] == 1 and timed[-1] == 20
    assert {shape for shape in grid.timed if shape[1:] == (4, 4)} == {(5, 4, 4), (9, 4, 4)}  # few: each timed
    asked: list[tuple] = []

    def rate_at(tokens: int, inner: int, outer: int) -> float:
        asked.append((tokens, inner, outer))
        return 10.0 * tokens + (0.5 if tokens % 2 else 0.0)

    untimed = next(t for t in range(1, 21) if t not in timed)
    below, above = max(t for t in timed if t < untimed), min(t for t in timed if t > untimed)
    expected = rate_at(below, 8, 16) + (rate_at(above, 8, 16) - rate_at(below, 8, 16)) * (untimed - below) / (
        above - below)
    asked.clear()
    assert grid.rate(rate_at, (untimed, 8, 16)) == pytest.approx(expected)
    assert {shape[0] for shape in asked} == {below, above}  # only timed shapes are asked for
    assert grid.rate(rate_at, (timed[2], 8, 16)) == rate_at(timed[2], 8, 16)
    # Attention's count is its second field.
    attention = predict._TokenGrid([(2, tokens, 8, True) for tokens in range(10, 30)], position=1)
    assert all(shape[0] == 2 and shape[2:] == (8, True) for shape in attention.timed)
    assert len(attention.timed) == predict.GRID_COUNTS
