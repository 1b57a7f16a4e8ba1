"""`ficoco flops --verify`: the analytic count checked against fvcore and torch's counter.

Wiring and rendering only; the measurement is `ficoco.profiling.verify`. The exit code is the verdict:
0 when every stage's analytic and fvcore counts agree within the tolerance, 1 otherwise
(after the tables are printed).
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

from rich.console import Console
from rich.table import Table

import ficoco
from ficoco.accounting.schedule import Schedule
from ficoco.errors import FicocoError
from ficoco.profiles import Profile
from ficoco_cli.flags import cli_message
from ficoco_cli.options import finite_percent

DEFAULT_TOLERANCE_PERCENT = 0.5


def check_verify_options(*, quant: str, kv_bits: int | None, gpu: str | None) -> None:
    """Options of `flops` that say nothing about the FLOPs of a run are refused with --verify."""
    if quant != "fp16":
        raise FicocoError("--verify counts the unquantized model (quantized linears are not matrix ops the "
                          "counters see); drop --quant")
    if kv_bits is not None:
        raise FicocoError("--kv-bits does not change FLOPs; drop it with --verify")
    if gpu is not None:
        raise FicocoError("--gpu sets the roofline, which --verify does not compute; drop it with --verify")


def fmt_flops(x: float) -> str:
    """Four significant digits with a decimal prefix: 79.32 M, 1.234 T."""
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.4g} {unit}"
    return f"{x:.0f}"


def fmt_diff(x: float | None) -> str:
    if x is None or math.isinf(x):
        return "inf"
    return f"{x * 100:+.3f}%"


def stage_table(report: dict[str, Any]) -> Table:
    head = "all tokens" if report["lm_head_tokens"] == "all" else "the last token"
    title = (f"{report['model']}: analytic vs fvcore vs torch FlopCounterMode, in FLOPs (2 per multiply-add; "
             f"fvcore's multiply-adds x2), scope all, layer-exact; batch {report['batch']}, "
             f"{report['text_tokens']} text tokens, LM head over {head}; {report['dtype']} on CPU"
             + (f" ({cli_message(report['dtype_reason'])})" if report.get("dtype_reason") else ""))
    caption = (f"gate: |fvcore - analytic| <= {report['tolerance_percent']:g}% on every stage; torch's count "
               "(math SDPA backend) is shown, not gated")
    if any(run["method"] for run in report["runs"]):
        caption += "; FiCoCo's own matrix work is outside the stages, in the method table below"
    table = Table(title=title, title_justify="left", caption=caption, caption_justify="left")
    for col in ("variant", "visual", "stage", "analytic", "fvcore", "fvcore diff", "torch", "torch diff", "check"):
        table.add_column(col, justify="left" if col in ("variant", "stage", "check") else "right")
    for run in report["runs"]:
        first = True
        for row in [*run["stages"], run["total"]]:
            is_total = row["stage"] == "total"
            check = "" if is_total else ("ok" if row["within_tolerance"] else "FAIL")
            table.add_row(run["variant"] if first else "", str(run["visual_tokens"]) if first else "",
                          row["stage"], fmt_flops(row["analytic_flops"]), fmt_flops(row["fvcore_flops"]),
                          fmt_diff(row["fvcore_rel_diff"]), fmt_flops(row["torch_flops"]),
                          fmt_diff(row["torch_rel_diff"]), check,
                          end_section=is_total)
            first = False
    return table


def method_table(report: dict[str, Any]) -> Table | None:
    rows = [(run["variant"], m) for run in report["runs"] for m in run["method"]]
    if not rows:
        return None
    title = "method: FiCoCo's own matrix work per reducing layer (FLOPs; not gated)"
    caption = ("matmul formula: compress B*kept*removed*D, plus L's indirect correlation B*removed*suffix*kept, x2 "
               "(rule=official: L's B*removed*suffix*visual, V's none); "
               "paper overhead: the appendix's N^2 + 2N + N_S(N_T + 2D + 1) + D (V; L doubles the first term), "
               "as printed (multiply-add style, elementwise terms included)")
    table = Table(title=title, title_justify="left", caption=caption, caption_justify="left")
    for col in ("variant", "stage", "layer", "visual before", "removed", "fvcore", "torch", "matmul formula",
                "paper overhead"):
        table.add_column(col, justify="left" if col in ("variant", "stage") else "right")
    for variant, m in rows:
        table.add_row(variant, m["stage"], str(m["layer"]), str(m["visual_before"]), str(m["removed"]),
                      fmt_flops(m["fvcore_flops"]), fmt_flops(m["torch_flops"]),
                      fmt_flops(m["matmul_formula_flops"]), fmt_flops(m["paper_overhead"]))
    return table


def per_layer_table(run: dict[str, Any]) -> Table:
    table = Table(title=f"{run['variant']} per layer (FLOPs)", title_justify="left")
    for col in ("stage", "layer", "tokens in", "tokens out", "analytic", "fvcore", "fvcore diff", "torch",
                "torch diff"):
        table.add_column(col, justify="left" if col == "stage" else "right")
    def show(x: int | None) -> str:
        return "-" if x is None else str(x)

    for row in run["per_layer"]:
        table.add_row(row["stage"], show(row["layer"]), show(row["tokens_in"]), show(row["tokens_out"]),
                      fmt_flops(row["analytic_flops"]), fmt_flops(row["fvcore_flops"]),
                      fmt_diff(row["fvcore_rel_diff"]), fmt_flops(row["torch_flops"]),
                      fmt_diff(row["torch_rel_diff"]))
    return table


def notes(report: dict[str, Any]) -> list[str]:
    """What fvcore skipped (ops without a handle) and whether any is matrix work; runs that reduce nothing."""
    skipped: Counter[str] = Counter()
    for run in report["runs"]:
        skipped.update(run["skipped_ops"])
    matrix = sorted({op for run in report["runs"] for op in run["skipped_matrix_ops"]})
    names = ", ".join(f"{op.removeprefix('aten::')} x{n}" for op, n in sorted(skipped.items()))
    lines = [f"fvcore skipped (no handle, over {len(report['runs'])} run(s)): {names or 'nothing'}"]
    if matrix:
        lines.append(f"skipped ops that carry matrix work: {', '.join(matrix)} - the fvcore count misses them")
    else:
        lines.append("skipped ops that carry matrix work: none (the skipped ops are elementwise, reductions, "
                     "sorting and indexing, which the flops convention does not count)")
    for run in report["runs"]:
        if run["variant"] != "vanilla" and not run["schedule"]:
            lines.append(f"note: the {run['variant']} schedule removes no visual token (its budget or keep is met "
                         "without reduction), so it runs as vanilla does")
    uncalled = sorted({m for run in report["runs"] for m in run["uncalled_modules"]})
    if uncalled:
        lines.append(f"modules with parameters that fvcore's trace never saw: {', '.join(uncalled)}")
    return lines


def verdict_line(report: dict[str, Any]) -> str:
    tolerance = report["tolerance_percent"]
    failures = [(run["variant"], s) for run in report["runs"] for s in run["stages"] if not s["within_tolerance"]]
    if not failures:
        largest = max((abs(s["fvcore_rel_diff"]) for run in report["runs"] for s in run["stages"]), default=0.0)
        return f"verdict: pass - every stage's analytic and fvcore counts agree within {tolerance:g}% " \
               f"(largest difference {largest * 100:.4f}%)"
    parts = ", ".join(f"{variant} {s['stage']} {fmt_diff(s['fvcore_rel_diff'])}" for variant, s in failures)
    return f"verdict: FAIL - analytic and fvcore differ by more than {tolerance:g}% on: {parts}"


def verify_command(profile: Profile, schedules: list[Schedule], *, text_tokens: int | None, batch: int,
                   lm_head: str, tolerance: float | None, per_layer: bool, json_path: str | None,
                   console: Console, request: dict[str, Any], dtype: str = "auto") -> int:
    """Run the verification, print its tables and write its report; the exit code is the verdict."""
    from ficoco.profiling.verify import check_supported, verify
    from ficoco.report import write_json_atomic

    check_supported(profile)
    tolerance = DEFAULT_TOLERANCE_PERCENT if tolerance is None else tolerance
    finite_percent("--tolerance", tolerance)
    with console.status(f"verifying {len(schedules)} run(s) of {profile.name} under fvcore and torch's counter"):
        result = verify(profile, schedules, text_tokens=text_tokens, batch=batch, lm_head_tokens=lm_head,
                        tolerance_percent=tolerance, dtype=dtype)
    report = result.to_json()
    report["ficoco_version"] = ficoco.__version__
    report["overrides"] = profile.overrides
    report["request"] = request
    console.print(stage_table(report))
    methods = method_table(report)
    if methods is not None:
        console.print(methods)
    if per_layer:
        for run in report["runs"]:
            console.print(per_layer_table(run))
    for line in notes(report):
        console.print(line, markup=False, highlight=False, soft_wrap=True)
    console.print(verdict_line(report), markup=False, highlight=False, soft_wrap=True)
    if json_path:
        write_json_atomic(json_path, report)
    return 0 if result.passed else 1
