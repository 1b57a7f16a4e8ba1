"""`ficoco compare` and `ficoco report`: verdicts and saved reports as tables, markdown, CSV."""

from __future__ import annotations

import csv
import io
import json
import math
from typing import Any

from rich.table import Table

from ficoco.errors import FicocoError
from ficoco.report.compare import Comparison
from ficoco_cli.flags import cli_message
from ficoco_cli.render import fmt_bytes, markdown_table

FORMATS = ("table", "markdown", "json")
REPORT_FORMATS = ("table", "markdown", "csv")


def _value(x: float | None, unit: str = "") -> str:
    if x is None:
        return "-"
    if not math.isfinite(x):
        return str(x)
    if unit == "B":
        return fmt_bytes(x)
    if abs(x) >= 100 or x == int(x):
        return f"{x:,.1f}" if x != int(x) else f"{int(x):,}"
    return f"{x:.4g}"


def _change(x: float | None) -> str:
    if x is None:
        return "-"
    if math.isinf(x):
        return "new"
    return f"{x * 100:+.1f}%"


def _units() -> dict[str, str]:
    from ficoco.report.compare import METRICS

    return {m.name: m.unit for m in METRICS}


def comparison_rows(result: Comparison) -> list[list[str]]:
    units = _units()
    return [[v.row, v.metric, v.kind, _value(v.base, units.get(v.metric, "")),
             _value(v.new, units.get(v.metric, "")), _change(v.change), v.verdict, cli_message(v.detail)]
            for v in result.verdicts]


HEADER = ["row", "metric", "class", "base", "new", "change", "verdict", "why"]


def comparison_table(result: Comparison) -> Table:
    n = len(result.regressions)
    table = Table(title=f"ficoco compare: {n} regression(s)", title_justify="left")
    for col in HEADER:
        table.add_column(col, justify="right" if col in ("base", "new", "change") else "left")
    styles = {"regression": "bold red", "improvement": "green", "noise": "yellow"}
    for cells in comparison_rows(result):
        table.add_row(*cells, style=styles.get(cells[6]))
    return table


def comparison_markdown(result: Comparison) -> str:
    parts = [f"### ficoco compare: {len(result.regressions)} regression(s)\n"]
    parts += [f"> warning: {cli_message(w)}\n" for w in result.warnings]
    if result.only_base:
        parts.append("Only in base: " + ", ".join(result.only_base) + "\n")
    if result.only_new:
        parts.append("Only in new: " + ", ".join(result.only_new) + "\n")
    parts.append("\n" + markdown_table(HEADER, comparison_rows(result)))
    return "\n".join(parts)


def comparison_json(result: Comparison) -> str:
    return json.dumps(result.to_json(), indent=2) + "\n"


REPORT_HEADER = ["model", "variant", "quant", "dtype", "batch", "visual", "status", "median_ms", "p90_ms",
                 "images_per_s", "analytic_tflops", "speedup", "peak_memory_bytes", "kv_cache_bytes",
                 "kv_cache_bytes_analytic", "method_ms", "method_share"]


def report_rows(report: dict[str, Any]) -> list[list[str]]:
    rows = []
    for r in report["rows"]:
        ok = r.get("status") == "ok"
        lat = r.get("latency") or {}
        analytic = r.get("analytic") or {}

        def num(x: Any, digits: int = 4) -> str:
            return "" if x is None else (f"{x:.{digits}g}" if isinstance(x, float) else str(x))

        rows.append([
            r.get("model", ""), r.get("variant", ""), r.get("quant", ""), (r.get("backend") or {}).get("compute_dtype",
                                                                                                       ""),
            str(r.get("batch", "")), num(analytic.get("visual_tokens")), r.get("status", "") if ok else
            f"{r.get('status')}: {r.get('reason', '')}", num(lat.get("median_ms"), 6), num(lat.get("p90_ms"), 6),
            num(r.get("images_per_s")), num(analytic.get("tflops")), num(r.get("speedup_vs_vanilla")),
            num((r.get("memory") or {}).get("peak_bytes")), num(r.get("kv_cache_bytes")),
            num(analytic.get("kv_cache_bytes")), num(r.get("reduction_ms")), num(r.get("reduction_share")),
        ])
    return rows


def report_csv(report: dict[str, Any]) -> str:
    buffer = io.StringIO()
    writer = csv.writer(buffer)
    writer.writerow(REPORT_HEADER)
    writer.writerows(report_rows(report))
    return buffer.getvalue()


def report_markdown(report: dict[str, Any]) -> str:
    from ficoco_cli.render import compares_methods, method_comparison_markdown

    env = report.get("environment", {})
    head = (f"### {report.get('config', {}).get('model')} on {env.get('device')} "
            f"({env.get('device_kind')}, {env.get('threads')} threads), {report.get('created')}\n\n")
    text = head + markdown_table(REPORT_HEADER, report_rows(report))
    if compares_methods(report):
        text += "\n" + method_comparison_markdown(report)
    return text


def check_flops_rows(report: dict[str, Any], path: str) -> None:
    """A flops report's rows carry a variant and the accountant's figures (a profile report's rows,
    mislabelled, do not): one line otherwise."""
    for row in report["rows"]:
        if not isinstance(row.get("variant"), str) or not isinstance(row.get("tflops"), int | float) \
                or not isinstance(row.get("tflops_by_stage"), dict):
            raise FicocoError(f"{path}: a row of this ficoco.flops/1 report lacks variant, tflops or tflops_by_stage; "
                              "write it again with `ficoco flops --json`")


FLOPS_HEADER = ["model", "variant", "quant", "visual_tokens", "layer_average_visual_tokens", "tflops_vision",
                "tflops_projector", "tflops_llm", "tflops_lm_head", "method_tflops", "tflops", "kv_cache_bytes",
                "kv_cache_figure", "kv_cache_stored_bytes", "settings"]


def flops_report_csv(report: dict[str, Any]) -> str:
    """A flops report (ficoco.flops/1) as CSV: one line per row, the cost by stage in its convention's unit, the
    KV cache in its convention's figure (kv_cache_figure) and as stored."""
    buffer = io.StringIO()
    writer = csv.writer(buffer)
    writer.writerow(FLOPS_HEADER)
    for r in report["rows"]:
        stages = r.get("tflops_by_stage") or {}
        writer.writerow([report.get("model", ""), r.get("variant", ""), r.get("quant", ""), r.get("visual_tokens", ""),
                         r.get("layer_average_visual_tokens", ""),
                         *(stages.get(s, "") for s in ("vision", "projector", "llm", "lm_head")),
                         r.get("method_tflops", ""), r.get("tflops", ""), r.get("kv_cache_bytes", ""),
                         r.get("kv_cache_figure", ""), r.get("kv_cache_stored_bytes", ""),
                         json.dumps(r.get("settings") or {}, sort_keys=True)])
    return buffer.getvalue()
