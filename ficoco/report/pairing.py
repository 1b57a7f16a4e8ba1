"""The pairing of each measured row with its vanilla row (same quant and batch) of the same run:
speedup, FLOPs ratio, memory saving, the method's own work against what it saves, slower attention
kernels than vanilla's where it does not reduce. No torch: read back by `ficoco report` and a sweep's
store."""

from __future__ import annotations

from typing import Any

from ficoco.report.kernels import slower_kernels


def own_work_vs_savings(row: dict[str, Any], base: dict[str, Any]) -> dict[str, Any] | None:
    """What the method's own work (its reduction stages and probes, `reduction_ms`) costs against
    what its fewer tokens save: ``saved_ms`` is vanilla's median less this row's model time
    without the method's work. ``eats_savings`` when the work costs at least that (DivPrune's
    search on a short prompt, say): the row would be faster without its own overhead than it is
    faster than vanilla. None for vanilla and for rows whose method ran no timed work."""
    own_ms = row.get("reduction_ms") or 0.0
    if row["variant"] == "vanilla" or own_ms <= 0:
        return None
    saved_ms = base["latency"]["median_ms"] - (row["latency"]["median_ms"] - own_ms)
    return {"own_ms": own_ms, "saved_ms": saved_ms, "eats_savings": own_ms >= saved_ms,
            "reads_share_predicted": reads_share_predicted(row, base)}


# The rule a method's own work is judged by (benchmarks/check_report.py --own-work): at most a share of what its
# fewer tokens save; else, where the method's design reads more attention than it saves, its reads at most
# READS_OVER_ATTENTION of the attention they read (what a fused read can reach: the read is then ficoco's cost only
# as far as it exceeds the layer's own attention) and its steps at most STEPS_SHARE of the savings.
READS_OVER_ATTENTION = 0.6
STEPS_SHARE = 0.03


def own_work_verdict(row: dict[str, Any], own_work_share: float) -> tuple[bool, str]:
    """(passes, the verdict in words) of a reduced row's own work under the rule above. A row without a record of
    its reads (a report from before they were priced) is judged by the share alone."""
    work = row.get("own_work_vs_savings") or {}
    saved_ms, own_ms = work.get("saved_ms", 0.0), work.get("own_ms", 0.0)
    share = own_ms / saved_ms if saved_ms > 0 else None
    words = (f"its own work ({own_ms:.0f} ms) takes {'-' if share is None else f'{share:.0%}'} of the "
             f"{saved_ms:.0f} ms its fewer tokens save")
    if share is not None and share <= own_work_share:
        return True, words + f" (<= {own_work_share:.0%})"
    reads = row.get("reads") or {}
    over_attention = reads.get("x_attention")
    if over_attention is None:
        return False, words + f" (> {own_work_share:.0%}; no record of its reads against the attention they read)"
    steps_share = reads.get("steps_ms", 0.0) / saved_ms if saved_ms > 0 else None
    reads_words = (f"its reads ({reads['ms']:.0f} ms) cost {over_attention:.2f}x the attention they read "
                   f"({reads['attention_ms']:.0f} ms), its steps ({reads.get('steps_ms', 0.0):.0f} ms) "
                   f"{'-' if steps_share is None else f'{steps_share:.0%}'} of the savings")
    if over_attention <= READS_OVER_ATTENTION and steps_share is not None and steps_share <= STEPS_SHARE:
        return True, (words + f": the method's design reads more than it saves; {reads_words} "
                      f"(<= {READS_OVER_ATTENTION}x and <= {STEPS_SHARE:.0%})")
    return False, (words + f" (> {own_work_share:.0%}) and {reads_words} (the rule: reads <= {READS_OVER_ATTENTION}x, "
                   f"steps <= {STEPS_SHARE:.0%})")


def reads_share_predicted(row: dict[str, Any], base: dict[str, Any]) -> float | None:
    """The share of what the row's fewer tokens save that the method's reads of attention alone take, both
    at this machine's measured rates (the rows' `predicted` parts): a floor under its own work that no faster
    step can lower, set by what the method reads (FiCoCo-L reads the visual rows of every decoder layer from
    the fourth; one removing a few tokens per layer saves little per read). None without both predictions or
    where the row's method reads nothing."""
    parts, base_parts = row.get("predicted") or {}, base.get("predicted") or {}
    reads_ms = parts.get("probe_ms") or 0.0
    if reads_ms <= 0 or not parts.get("prefill_ms") or not base_parts.get("prefill_ms"):
        return None
    saved_ms = base_parts["prefill_ms"] - (parts["prefill_ms"] - reads_ms - (parts.get("method_ms") or 0.0))
    return reads_ms / saved_ms if saved_ms > 0 else None


def add_comparisons(rows: list[dict[str, Any]]) -> None:
    """Speedup, memory saving and roofline ratio of every row against its vanilla row (same
    quant and batch) of the same run."""
    reference = {(r["quant"], r["batch"]): r for r in rows if r["variant"] == "vanilla" and r.get("status") == "ok"}
    for row in rows:
        if row.get("status") != "ok":
            continue
        latency = row["latency"]["median_ms"]
        row["achieved_tflops_per_s"] = row["analytic"]["tflops"] / (latency / 1e3)
        roofline = row["analytic"].get("roofline_ms")
        row["measured_over_roofline"] = latency / roofline if roofline else None
        predicted = row.get("predicted_ms")
        row["measured_over_predicted"] = latency / predicted if predicted else None
        base = reference.get((row["quant"], row["batch"]))
        if base is None:
            row["speedup_vs_vanilla"] = row["memory_saving_vs_vanilla"] = row["flops_ratio_vs_vanilla"] = None
            row["predicted_speedup_vs_vanilla"] = None
            continue
        row["speedup_vs_vanilla"] = base["latency"]["median_ms"] / latency
        row["flops_ratio_vs_vanilla"] = base["analytic"]["tflops"] / row["analytic"]["tflops"]
        # What this machine's rates predict for the pair (profiling/predict.py): the yardstick of the speedup.
        base_predicted = base.get("predicted_ms")
        row["predicted_speedup_vs_vanilla"] = base_predicted / predicted if base_predicted and predicted else None
        row["own_work_vs_savings"] = own_work_vs_savings(row, base)
        # Slower attention kernels than vanilla's where the row does not reduce (report/kernels.py).
        row["slower_kernels_vs_vanilla"] = slower_kernels(row, base)
        peak, base_peak = row["memory"].get("peak_bytes"), base["memory"].get("peak_bytes")
        row["memory_saving_vs_vanilla"] = 1 - peak / base_peak if peak and base_peak else None
        # Answering end to end (decode.py's total), when both rows generated.
        total, base_total = ((r.get("generation") or {}).get("total", {}).get("median_ms") for r in (row, base))
        if total and base_total:
            row["generation_speedup_vs_vanilla"] = base_total / total
