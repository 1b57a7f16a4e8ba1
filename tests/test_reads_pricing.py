"""Each read priced against the attention it reads (issue 54 item 3): a profile row's `reads` record, and the rule
benchmarks/check_report.py judges a method's own work by (ficoco.report.pairing.own_work_verdict)."""

from __future__ import annotations

import pytest

from ficoco.profiling.rows import PrefillRecord, reads_record
from ficoco.profiling.trackers import LatencyStats
from ficoco.report.pairing import own_work_verdict


def prefill(**fields) -> PrefillRecord:
    return PrefillRecord(latency=LatencyStats(samples_ms=(100.0,), timer="perf_counter"), runs={}, batch=1,
                         **{"reduction_stages_ms": 2.0, "probe_ms": 1.0, **fields})


def test_a_fused_reads_cost_is_what_it_took_beyond_the_models_kernel() -> None:
    record = prefill(fused_ms=30.0, fused_reference_ms=24.0, attention_ms=10.0)
    assert record.reads_ms == pytest.approx(1.0 + 6.0)  # the reads after the layer, and the fused pass's extra
    assert record.read_attention_ms == pytest.approx(34.0)  # the kernel beside the reads, and on the fused layers
    assert record.reduction_ms == pytest.approx(2.0 + 7.0)
    reads = reads_record(record)
    assert reads["x_attention"] == pytest.approx(7.0 / 34.0)
    assert reads["steps_ms"] == 2.0
    # A fused pass faster than the kernel reads for free; never a negative cost.
    assert prefill(fused_ms=20.0, fused_reference_ms=24.0).reads_ms == pytest.approx(1.0)


def test_without_the_reference_a_fused_rows_attention_is_unknown_not_guessed() -> None:
    record = prefill(fused_ms=30.0)
    assert record.read_attention_ms is None
    assert reads_record(record)["x_attention"] is None
    assert reads_record(prefill(probe_ms=0.0)) is None  # no read: no record


def row(own_ms: float, saved_ms: float, reads: dict | None) -> dict:
    return {"own_work_vs_savings": {"own_ms": own_ms, "saved_ms": saved_ms}, "reads": reads}


def test_the_own_work_rule() -> None:
    # Within a tenth of the savings: passes, whatever it reads.
    assert own_work_verdict(row(5.0, 100.0, None), 0.10)[0]
    # More, but its reads cost at most 0.6x the attention they read and its steps at most 3 %: the method's design.
    passes, words = own_work_verdict(row(40.0, 100.0, {"ms": 38.0, "attention_ms": 80.0, "x_attention": 0.475,
                                                       "steps_ms": 2.0}), 0.10)
    assert passes and "reads more than it saves" in words and "0.47x" in words
    # Reads dearer than 0.6x: fails, and says both.
    passes, words = own_work_verdict(row(60.0, 100.0, {"ms": 58.0, "attention_ms": 80.0, "x_attention": 0.725,
                                                       "steps_ms": 2.0}), 0.10)
    assert not passes and "0.72x" in words
    # Cheap reads but heavy steps: fails.
    assert not own_work_verdict(row(40.0, 100.0, {"ms": 10.0, "attention_ms": 80.0, "x_attention": 0.125,
                                                  "steps_ms": 30.0}), 0.10)[0]
    # A report from before reads were priced: the share alone.
    assert not own_work_verdict(row(40.0, 100.0, None), 0.10)[0]
