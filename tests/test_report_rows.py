"""A profile row's measured figures are typed records (ficoco.profiling.rows) that become the report's
row fields only at the boundary (`MeasuredRow.to_json`), with the `ficoco.report/1` names and order."""

from __future__ import annotations

import json
from pathlib import Path

from ficoco.profiling.rows import (
    DecodeFigures,
    FidelityFigures,
    FidelityRecord,
    GenerationRecord,
    MeasuredRow,
    MemoryRecord,
    PrefillRecord,
)
from ficoco.profiling.trackers import LatencyStats, MemoryReading

ROOT = Path(__file__).resolve().parents[1]
MEASURED = ["latency", "runs", "images_per_s", "memory", "kv_cache_bytes", "kv_cache_tokens", "reduction_ms",
            "reduction_stages_ms", "probe_ms", "reads", "reduction_share", "generation"]


def _row(**parts) -> MeasuredRow:
    latency = LatencyStats(samples_ms=(20.0, 30.0, 40.0), timer="perf_counter", warmup_ms=(50.0,))
    runs = {"warmup": 1, "repeat": 3, "chosen_by": "warmup=/repeat="}
    prefill = PrefillRecord(latency=latency, runs=runs, batch=2, reduction_stages_ms=1.5, probe_ms=0.5,
                            visual_tokens_per_item_measured=parts.pop("measured", None))
    memory = MemoryRecord(peak=MemoryReading("cpu", {"peak_bytes": 7}, "rss"), kv_cache_bytes=100, kv_cache_tokens=9)
    return MeasuredRow(prefill, memory, **parts)


def test_a_prefill_row_has_the_reports_fields_in_its_order() -> None:
    row = _row().to_json()
    assert list(row) == MEASURED
    assert row["images_per_s"] == 2 / 0.030 and row["reduction_ms"] == 2.0 and row["reduction_share"] == 2.0 / 30
    assert row["memory"] == {"method": "rss", "peak_bytes": 7} and row["generation"] is None
    json.dumps(row)  # JSON as it is


def test_generation_fidelity_and_a_measured_count_add_their_fields() -> None:
    e2e = LatencyStats(samples_ms=(100.0,), timer="perf_counter")
    step = {"median_ms": 10.0, "p90_ms": 10.0, "min_ms": 10.0, "samples_ms": [10.0]}
    decode = DecodeFigures(new_tokens=4, prefill_ms=30.0, ttft=step, decode_per_token=step, total=step,
                           generate_wall=step, images_per_s=20.0, tokens_per_s=80.0, decode_tokens_per_s=100.0)
    generation = GenerationRecord(latency=e2e, decode=decode, kv_cache_bytes=120, kv_cache_tokens=12,
                                  memory=MemoryReading("cpu", {"peak_bytes": 9}, "rss"), runs={"repeat": 1})
    row = _row(generation=generation, fidelity=FidelityRecord(is_reference=True), measured=24).to_json()
    assert list(row) == [*MEASURED, "fidelity", "visual_tokens_per_item_measured"]
    assert list(row["generation"]) == ["latency", "new_tokens", "prefill_ms", "ttft", "decode_per_token", "total",
                                       "generate_wall", "images_per_s", "tokens_per_s", "decode_tokens_per_s",
                                       "definition", "generated_tokens_per_s", "kv_cache_bytes", "kv_cache_tokens",
                                       "memory", "runs"]
    assert row["generation"]["generated_tokens_per_s"] == 80.0 and row["fidelity"] is None


def test_the_committed_reports_rows_hold_the_fields_the_records_write() -> None:
    report = json.loads((ROOT / "reports" / "llava-tiny-cpu.json").read_text())
    measured = [row for row in report["rows"] if row.get("status") == "ok"]
    assert measured
    for row in measured:
        assert [key for key in row if key in MEASURED] == MEASURED


def test_a_reduced_rows_fidelity_names_its_reference_and_carries_its_figures_in_the_reports_order() -> None:
    figures = FidelityFigures(kl_divergence=0.1, kl_divergence_max=0.2, top1_agreement=1.0, prompts=2)
    entry = FidelityRecord(reference="vanilla fp16 batch 1", figures=figures, note="random weights").to_json()
    assert list(entry) == ["reference", "kl_divergence", "kl_divergence_max", "top1_agreement", "prompts",
                           "new_tokens", "greedy_prefix_tokens", "greedy_prefix_share", "texts", "note"]
    assert entry["reference"] == "vanilla fp16 batch 1" and entry["new_tokens"] is None
    alone = FidelityRecord(note="no measured vanilla row").to_json()
    assert alone == {"reference": None, "note": "no measured vanilla row"}
