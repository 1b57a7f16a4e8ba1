"""Decode metrics of `ficoco profile --new-tokens N` and their judgement in `ficoco compare` (issue 12).

One real run on llava-tiny (vanilla, V, L; 4-bit quantized KV cache; 2 timed generations of
4 tokens); compare tests edit copies of its report. No test times anything: figures are
checked for presence and for the identities that define them.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from ficoco.report.compare import compare

NEW, REPEAT, KEEP = 4, 2, 8


@pytest.fixture(scope="module")
def report(tmp_path_factory, cli) -> dict[str, Any]:
    path = tmp_path_factory.mktemp("decode") / "d.json"
    result = cli("profile", "--model", "llava-tiny", "--variant", "vanilla,v,l", "--keep", KEEP, "--quant", "fp16",
                 "--kv-bits", "4", "--new-tokens", NEW, "--repeat", REPEAT, "--warmup", "0", "--json", path,
                 in_subprocess=True)
    assert result.code == 0, result.err[-3000:]
    return json.loads(path.read_text())


def row(report: dict[str, Any], variant: str) -> dict[str, Any]:
    (found,) = [r for r in report["rows"] if r["variant"] == variant]
    return found


def test_every_row_reports_prefill_ttft_decode_total_and_throughput(report):
    for r in report["rows"]:
        assert r["status"] == "ok", r.get("reason")
        assert r["kv_bits"] == 4
        gen = r["generation"]
        assert gen["new_tokens"] == NEW
        assert gen["prefill_ms"] == r["latency"]["median_ms"]
        assert len(gen["ttft"]["samples_ms"]) == len(gen["total"]["samples_ms"]) == REPEAT
        # one decode step per new token after the first, pooled over the timed runs
        assert len(gen["decode_per_token"]["samples_ms"]) == REPEAT * (NEW - 1)
        assert gen["decode_per_token"]["median_ms"] <= gen["decode_per_token"]["p90_ms"]
        total_s = gen["total"]["median_ms"] / 1e3
        assert gen["images_per_s"] == pytest.approx(r["batch"] / total_s)
        assert gen["tokens_per_s"] == pytest.approx(r["batch"] * NEW / total_s)
        assert gen["generated_tokens_per_s"] == gen["tokens_per_s"]
        assert gen["decode_tokens_per_s"] == pytest.approx(r["batch"] / (gen["decode_per_token"]["median_ms"] / 1e3))


def test_total_is_ttft_plus_the_decode_steps_within_timer_resolution(report):
    resolution_ms = 1e-3  # perf_counter's microsecond readings, summed
    for r in report["rows"]:
        gen = r["generation"]
        steps = gen["decode_per_token"]["samples_ms"]
        for k, (ttft, total) in enumerate(zip(gen["ttft"]["samples_ms"], gen["total"]["samples_ms"], strict=True)):
            run_steps = steps[k * (NEW - 1):(k + 1) * (NEW - 1)]
            assert total == pytest.approx(ttft + sum(run_steps), abs=resolution_ms)
            assert all(s > 0 for s in run_steps) and ttft > 0
        # generate() returns after its last token: its wall time holds the total
        for total, wall in zip(gen["total"]["samples_ms"], gen["generate_wall"]["samples_ms"], strict=True):
            assert total <= wall
        # The row's timer encloses each generate() call (its wall is read inside): never less, one run each.
        # How much more is the timer's own overhead, which a loaded machine stretches: not judged here.
        assert len(gen["latency"]["samples_ms"]) == len(gen["generate_wall"]["samples_ms"])
        for outer, inner in zip(gen["latency"]["samples_ms"], gen["generate_wall"]["samples_ms"], strict=True):
            assert outer >= inner - resolution_ms


def test_the_kv_cache_at_the_end_of_decoding_is_measured_and_is_the_accountants(report):
    for r in report["rows"]:
        gen = r["generation"]
        assert gen["kv_cache_tokens"] == [n + NEW - 1 for n in r["kv_cache_tokens"]]
        assert gen["kv_cache_bytes"] == r["analytic"]["kv_cache_bytes_after_decode"]
        assert r["kv_cache_bytes"] == r["analytic"]["kv_cache_bytes"]
        assert gen["kv_cache_bytes"] > r["kv_cache_bytes"]
    assert row(report, "l")["kv_cache_tokens"][-1] < row(report, "vanilla")["kv_cache_tokens"][-1]


def test_generation_speedup_is_vanilla_total_over_the_rows(report):
    vanilla = row(report, "vanilla")["generation"]["total"]["median_ms"]
    for variant in ("v", "l"):
        r = row(report, variant)
        assert r["generation_speedup_vs_vanilla"] == pytest.approx(vanilla / r["generation"]["total"]["median_ms"])


# ---- compare: direction, tolerance, significance ------------------------------------------------------------

def verdict(result: Any, variant: str, metric: str) -> Any:
    # The unquantized rows are named by the dtype they computed in (this CPU's choice: bf16 or fp32).
    (found,) = [v for v in result.verdicts if v.metric == metric
                and any(f" {variant} {dtype} " in v.row + " " for dtype in ("bf16", "fp16", "fp32"))]
    return found


def steady(report: dict[str, Any], factor: float = 1.0, variant: str = "v") -> dict[str, Any]:
    """A copy whose rows decode with 5 tight, tie-free samples around their medians (two real runs
    cannot reach significance), the `variant` row's scaled by `factor`."""
    new = copy.deepcopy(report)
    for r in new["rows"]:
        gen = r["generation"]
        scale = factor if r["variant"] == variant else 1.0
        for part in ("ttft", "total", "decode_per_token"):
            base = gen[part]["median_ms"]
            n = 5
            gen[part]["samples_ms"] = [base * scale * (1 + 0.01 * (i - n / 2)) for i in range(n)]
            gen[part]["median_ms"] = base * scale
            gen[part]["p90_ms"] = max(gen[part]["samples_ms"])
        gen["images_per_s"] = r["batch"] / (gen["total"]["median_ms"] / 1e3)
        gen["tokens_per_s"] = r["batch"] * NEW / (gen["total"]["median_ms"] / 1e3)
    vanilla = row(new, "vanilla")["generation"]["total"]["median_ms"]
    for r in new["rows"]:
        if r["variant"] != "vanilla":
            r["generation_speedup_vs_vanilla"] = vanilla / r["generation"]["total"]["median_ms"]
    return new


def test_identical_decode_metrics_are_ok_or_not_judged(report):
    result = compare(report, copy.deepcopy(report))
    names = {v.metric for v in result.verdicts}
    assert {"decode_kv_cache_bytes", "generation_speedup_vs_vanilla", "ttft_ms", "decode_ms_per_token",
            "decode_p90_ms_per_token", "generation_total_ms", "generation_images_per_s",
            "generation_tokens_per_s"} <= names
    assert not result.regressions


def test_a_larger_decode_kv_cache_is_a_deterministic_regression(report):
    new = copy.deepcopy(report)
    row(new, "l")["generation"]["kv_cache_bytes"] *= 1.01
    result = compare(report, new, judge="deterministic")
    assert [(v.metric, v.verdict) for v in result.regressions] == [("decode_kv_cache_bytes", "regression")]


def test_slower_answering_is_a_significant_ratio_regression_and_faster_an_improvement(report):
    base = steady(report)
    slower = steady(report, factor=1.3)
    result = compare(base, slower)
    found = verdict(result, "v", "generation_speedup_vs_vanilla")
    assert found.verdict == "regression" and found.change == pytest.approx(1 / 1.3 - 1)
    assert "significant" in found.detail
    # absolute decode figures are shown, judged only with --absolute, in their own direction
    assert verdict(result, "v", "decode_ms_per_token").verdict == "not judged"
    absolute = compare(base, slower, absolute=True)
    for metric in ("ttft_ms", "decode_ms_per_token", "generation_total_ms", "generation_images_per_s",
                   "generation_tokens_per_s"):
        assert verdict(absolute, "v", metric).verdict == "regression", metric
    faster = compare(base, steady(report, factor=0.7), absolute=True)
    for metric in ("generation_speedup_vs_vanilla", "decode_ms_per_token", "generation_tokens_per_s"):
        assert verdict(faster, "v", metric).verdict == "improvement", metric


def test_a_change_within_tolerance_is_ok_and_an_unsupported_one_is_noise(report):
    base = steady(report)
    assert verdict(compare(base, steady(report, factor=1.05)), "v", "generation_speedup_vs_vanilla").verdict == "ok"
    # 30% worse in the median, but the samples overlap the base's: not significant
    noisy = steady(report, factor=1.3)
    for r, b in zip(noisy["rows"], base["rows"], strict=True):
        r["generation"]["total"]["samples_ms"] = b["generation"]["total"]["samples_ms"][::-1]
    found = verdict(compare(base, noisy), "v", "generation_speedup_vs_vanilla")
    assert found.verdict == "noise" and "not significant" in found.detail
