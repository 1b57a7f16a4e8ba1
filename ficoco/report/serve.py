"""Serving reports (`ficoco.serve/1`, written by `ficoco serve-bench`): validation, the table's rows, and the
comparison of two reports, torch-free.

A row is one variant at one concurrency level: time to first token (p50, p90), requests/s, output tokens/s,
and the accountant's TFLOPs and visual tokens per request. `compare_serve` judges the accountant's figures as
deterministic (they may not move by more than 0.1 %) and, on the same processor only, each method's throughput
as a ratio to vanilla's at the same level within the run (timed: `tolerance_pct`), as `ficoco compare` judges
profile reports.
"""

from __future__ import annotations

from typing import Any

from ficoco.errors import FicocoError
from ficoco.report.schemas import SERVE_SCHEMA

ROW_FIELDS = ("variant", "concurrency", "requests", "ttft_p50_s", "ttft_p90_s", "requests_per_s",
              "output_tokens_per_s", "tflops_per_request", "visual_tokens_per_request")
DETERMINISTIC = ("tflops_per_request", "visual_tokens_per_request")
DETERMINISTIC_TOLERANCE_PCT = 0.1
TIMED = ("requests_per_s", "output_tokens_per_s")  # judged as the ratio to vanilla at the same level


def check_serve_report(data: dict[str, Any], path: str = "the report") -> dict[str, Any]:
    """`data` if it is a serving report with well-formed rows; one FicocoError line otherwise."""
    if data.get("schema") != SERVE_SCHEMA:
        raise FicocoError(f"{path} has schema '{data.get('schema')}', not '{SERVE_SCHEMA}'")
    rows = data.get("rows")
    if not isinstance(rows, list) or not rows:
        raise FicocoError(f"{path} has no rows; give a report written by ficoco serve-bench")
    for row in rows:
        missing = [name for name in ROW_FIELDS if not isinstance(row, dict) or name not in row]
        if missing:
            raise FicocoError(f"{path}: a row lacks {', '.join(missing)}; give a report written by ficoco serve-bench")
    return data


def table_rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The rows as the table shows them (variant, concurrency order), with the throughput against vanilla's."""
    vanilla = {row["concurrency"]: row for row in report["rows"] if row["variant"] == "vanilla"}
    shown = []
    for row in report["rows"]:
        base = vanilla.get(row["concurrency"])
        ratio = row["requests_per_s"] / base["requests_per_s"] if base and base["requests_per_s"] else None
        shown.append({**{name: row[name] for name in ROW_FIELDS}, "vs_vanilla": ratio})
    return shown


def _key(row: dict[str, Any]) -> tuple[str, int]:
    return row["variant"], int(row["concurrency"])


def compare_serve(base: dict[str, Any], new: dict[str, Any], *, tolerance_pct: float = 10.0, judge: str = "all",
                  cross_machine: bool = False) -> Any:
    """A `ficoco.report.compare.Comparison` of two serving reports (rows matched by variant and level)."""
    from ficoco.report.compare import Comparison, Verdict, same_processor

    for side, report in (("base", base), ("new", new)):
        check_serve_report(report, f"the {side} report")
    result = Comparison()
    base_rows = {_key(r): r for r in base["rows"]}
    new_rows = {_key(r): r for r in new["rows"]}
    result.only_base = [f"{v} x{c}" for v, c in base_rows if (v, c) not in new_rows]
    result.only_new = [f"{v} x{c}" for v, c in new_rows if (v, c) not in base_rows]
    same, words = same_processor(base.get("environment") or {}, new.get("environment") or {})
    timed = same or cross_machine
    if not timed:
        result.warnings.append(f"timed figures not judged: {words}")
    for key in base_rows.keys() & new_rows.keys():
        b, n = base_rows[key], new_rows[key]
        name = f"{key[0]} x{key[1]}"
        for metric in DETERMINISTIC:
            bv, nv = b[metric], n[metric]
            if bv is None or nv is None:  # a variant the accountant does not count (vLLM's EVS)
                if bv is not None or nv is not None:
                    result.verdicts.append(Verdict(name, metric, "deterministic", bv, nv, None, "regression"))
                continue
            change = (nv - bv) / bv if bv else (0.0 if nv == bv else float("inf"))
            if judge == "timed":
                verdict = "not judged"
            else:
                verdict = "regression" if abs(change) * 100 > DETERMINISTIC_TOLERANCE_PCT else "ok"
            result.verdicts.append(Verdict(name, metric, "deterministic", bv, nv, change, verdict))
        if key[0] == "vanilla":
            continue
        for metric in TIMED:
            bvan, nvan = base_rows.get(("vanilla", key[1])), new_rows.get(("vanilla", key[1]))
            if not bvan or not nvan or not bvan[metric] or not nvan[metric]:
                result.verdicts.append(Verdict(name, f"{metric} / vanilla", "ratio", None, None, None, "missing",
                                               "no vanilla row at this level"))
                continue
            bv, nv = b[metric] / bvan[metric], n[metric] / nvan[metric]
            change = (nv - bv) / bv if bv else 0.0
            if judge == "deterministic" or not timed:
                verdict = "not judged"
            elif change * 100 < -tolerance_pct:
                verdict = "regression"
            elif change * 100 > tolerance_pct:
                verdict = "improvement"
            else:
                verdict = "ok"
            result.verdicts.append(Verdict(name, f"{metric} / vanilla", "ratio", bv, nv, change, verdict))
    result.verdicts.sort(key=lambda v: (v.row, v.metric))
    return result
