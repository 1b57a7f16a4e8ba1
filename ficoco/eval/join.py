"""An evaluated sweep's accuracy joined with its cost, point by point: pure data, no torch.

An evaluated sweep report is a `ficoco.sweep/1` report whose config names `eval_tasks` and whose
points may carry an `eval` block (`ficoco.eval/1`, written by the lmms-eval run of the point):
the score of every task on lmms-eval's own scale (0..1 or 0..100, as the task reports it), the
answer generated for every document, and the mean cost of the samples (TFLOPs in the block's
convention and scope, visual tokens, timings). A point not evaluated yet has no block (or None);
a point whose evaluation failed has `{"status": "failed", "reason": ...}`.

`eval_rows` turns the points into rows, vanilla first in each quant, and adds what needs vanilla:

- `retention` / `relative_score`: the papers' "performance retention", each task's score over
  vanilla's score of the same task and quant (a fraction: 0.95 keeps 95 % of vanilla's score),
  and its mean over the tasks;
- `agreement`: the share of documents whose generated answer is vanilla's answer to the same
  document (exact match after stripping white space), a measure that needs no labels.

Nothing here imports torch, matplotlib or the sweep's planner: `ficoco report`, `ficoco compare`
(ficoco.report.compare) and the accuracy figure (ficoco.sweep.figures) read it.
"""

from __future__ import annotations

import math
from typing import Any

from ficoco.report.schemas import SWEEP_SCHEMA

VANILLA = "vanilla"  # the reference point's variant (ficoco.sweep.plan.VANILLA; not imported: no cycle)
STATUSES = ("ok", "failed", "missing")


def eval_tasks(report: dict[str, Any]) -> list[str]:
    """The tasks the sweep was evaluated on (its config's `eval_tasks`), in the config's order; []
    for a sweep that was not evaluated or a report of another kind."""
    tasks = (report.get("config") or {}).get("eval_tasks") if isinstance(report.get("config"), dict) else None
    return [str(t) for t in tasks] if isinstance(tasks, (list, tuple)) else []


def evaluated(report: dict[str, Any]) -> bool:
    """Whether `report` is a sweep report that was (or is being) evaluated: its config names tasks."""
    return report.get("schema") == SWEEP_SCHEMA and bool(eval_tasks(report))


def budget_label(budget: dict[str, Any] | None) -> str:
    """A point's budget in words: "keep 64", "tflops 1.5"; "-" for vanilla (every token)."""
    if not budget:
        return "-"
    return ", ".join(f"{k} {v:g}" if isinstance(v, (int, float)) else f"{k} {v}" for k, v in budget.items())


def _number(x: Any) -> float | None:
    """A finite number as a float, else None (missing, null, NaN, a string)."""
    if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x):
        return float(x)
    return None


def _mean(values: list[float | None]) -> float | None:
    """The mean of `values`, None when any is missing (a mean over some tasks is another number)."""
    if not values or any(v is None for v in values):
        return None
    return sum(values) / len(values)  # type: ignore[arg-type]


def _answer(value: Any) -> str:
    return "" if value is None else str(value).strip()


def _doc_key(sample: dict[str, Any]) -> tuple[str, str] | None:
    if not isinstance(sample, dict) or sample.get("task") is None or sample.get("doc_id") is None:
        return None
    return str(sample["task"]), str(sample["doc_id"])


def _status(block: Any) -> tuple[str, str]:
    """The eval block's status and why: "ok", "failed" (with the reason) or "missing" (not run yet)."""
    if not isinstance(block, dict):
        return "missing", "not evaluated"
    status = block.get("status")
    if status == "ok":
        return "ok", ""
    if status == "failed":
        return "failed", str(block.get("reason") or "no reason recorded")
    return "failed", f"eval block with status {status!r}"


def _row(point: dict[str, Any], tasks: list[str]) -> dict[str, Any]:
    """One point's own figures (nothing that needs vanilla yet)."""
    block = point.get("eval")
    status, reason = _status(block)
    block = block if isinstance(block, dict) else {}
    per_task = block.get("tasks") if isinstance(block.get("tasks"), dict) else {}
    scores, stderr, samples, higher = {}, {}, {}, {}
    for task in tasks:
        entry = per_task.get(task) if isinstance(per_task.get(task), dict) else {}
        scores[task] = _number(entry.get("score")) if status == "ok" else None
        stderr[task] = _number(entry.get("stderr")) if status == "ok" else None
        samples[task] = entry.get("samples") if isinstance(entry.get("samples"), int) else None
        higher[task] = entry.get("higher_is_better") is not False
    score = _number(block.get("score")) if status == "ok" else None
    if score is None and status == "ok":
        score = _mean([scores[t] for t in tasks])
    timing = block.get("timing") if isinstance(block.get("timing"), dict) else {}
    label = block.get("method_label")
    return {
        "variant": point.get("variant"),
        "method_label": str(label) if label else str(point.get("variant")),
        "labelled": bool(label),
        "quant": point.get("quant"),
        "budget": point.get("budget"),
        "budget_label": budget_label(point.get("budget")),
        "status": status,
        "reason": reason,
        "tasks": list(tasks),
        "scores": scores,
        "stderr": stderr,
        "samples": samples,
        "higher_is_better": higher,
        "score": score,
        "retention": dict.fromkeys(tasks),
        "relative_score": None,
        "agreement": None,
        "agreement_samples": 0,
        "tflops_mean": _number(block.get("tflops_mean")),
        "visual_tokens_mean": _number(block.get("visual_tokens_mean")),
        "prefill_ms_mean": _number(timing.get("prefill_ms_mean")),
        "ttft_ms_mean": _number(timing.get("ttft_ms_mean")),
        "decode_ms_per_token_mean": _number(timing.get("decode_ms_per_token_mean")),
        "timed_on": timing.get("timed_on"),
        "convention": block.get("convention"),
        "scope": block.get("scope"),
        "units": block.get("units"),
        "_answers": {key: _answer(s.get("answer")) for s in block.get("samples") or []
                     if (key := _doc_key(s)) is not None} if status == "ok" else {},
    }


def retention(score: float | None, reference: float | None, higher_is_better: bool = True) -> float | None:
    """`score` as a fraction of vanilla's `reference` score (1.0: as good as vanilla). For a task whose
    metric is better lower (an error rate), vanilla's over the score, so that below 1 is still worse.
    None where either is missing or the denominator is 0 (no share of nothing)."""
    if score is None or reference is None:
        return None
    numerator, denominator = (score, reference) if higher_is_better else (reference, score)
    return numerator / denominator if denominator else None


def eval_rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per point of an evaluated sweep report, in each quant vanilla first, then the other
    points in the report's order. Every point is a row, with its `status`: "ok", "failed" (its
    `reason`), or "missing" (not evaluated yet). A row holds:

    - `variant`, `method_label` (the eval block's display name, with any non-official setting;
      else the variant, and `labelled` is False: a failed run may name none), `quant`, `budget`
      (the point's {"keep": N} / {"tflops": X}, None for vanilla) and `budget_label` ("keep 64",
      "-" for vanilla);
    - `scores`: per task (the config's `eval_tasks`), the score lmms-eval reported for the task's
      main metric, on the task's own scale; `stderr`, `samples` (documents scored) and
      `higher_is_better` beside it; `score`: their mean (the block's, else computed);
    - `retention`: per task, the score over vanilla's score of the same task and quant (a fraction;
      see `retention`), and `relative_score`: its mean over the tasks, the papers' "performance
      retention" (None where vanilla's score of a task is 0 or missing: no retention of nothing);
    - `agreement`: the share of the point's documents whose generated answer equals vanilla's answer
      to the same (task, doc_id), exact match after stripping white space (vanilla's own: 1.0; None
      without an evaluated vanilla of the quant), and `agreement_samples`: how many were compared;
    - `tflops_mean`, `visual_tokens_mean`: the mean over the samples of each sample's cost (the
      block's `convention`, `scope` and `units`) and of its visual tokens reaching the LLM;
    - `prefill_ms_mean`, `ttft_ms_mean`, `decode_ms_per_token_mean`: the mean timings of the
      evaluation's batches on `timed_on` (wall-clock, not comparable across machines).

    Rows of points that are not "ok" carry None for every figure that needs an evaluation."""
    tasks = eval_tasks(report)
    points = [p for p in report.get("points") or [] if isinstance(p, dict)]
    rows = [_row(p, tasks) for p in points]
    quants = list(dict.fromkeys(r["quant"] for r in rows))
    ordered: list[dict[str, Any]] = []
    for quant in quants:
        mine = [r for r in rows if r["quant"] == quant]
        ordered += [r for r in mine if r["variant"] == VANILLA] + [r for r in mine if r["variant"] != VANILLA]
    for quant in quants:
        vanilla = next((r for r in ordered if r["quant"] == quant and r["variant"] == VANILLA
                        and r["status"] == "ok"), None)
        if vanilla is None:
            continue
        for row in (r for r in ordered if r["quant"] == quant and r["status"] == "ok"):
            row["retention"] = {t: retention(row["scores"][t], vanilla["scores"][t], row["higher_is_better"][t])
                                for t in tasks}
            row["relative_score"] = _mean([row["retention"][t] for t in tasks])
            if row is vanilla:
                row["agreement"], row["agreement_samples"] = 1.0, len(row["_answers"])
                continue
            compared = [(answer, vanilla["_answers"][key]) for key, answer in row["_answers"].items()
                        if key in vanilla["_answers"]]
            row["agreement_samples"] = len(compared)
            row["agreement"] = sum(a == b for a, b in compared) / len(compared) if compared else None
    for row in ordered:
        del row["_answers"]
    return ordered


def point_id(row: dict[str, Any]) -> tuple[str, str, str, str]:
    """What makes two reports' rows the same point: variant, method label, quant and budget."""
    budget = row.get("budget") or {}
    return (str(row.get("variant")), str(row.get("method_label")), str(row.get("quant")),
            ",".join(f"{k}={float(v):g}" if isinstance(v, (int, float)) else f"{k}={v}"
                     for k, v in sorted(budget.items())))


def match_points(base: list[dict[str, Any]], new: list[dict[str, Any]]
                 ) -> tuple[list[tuple[dict[str, Any], dict[str, Any]]], list[dict[str, Any]], list[dict[str, Any]]]:
    """The rows of two reports paired as the same point (`point_id`), and the rows of each left
    unpaired. A row without a label of its own (a failed or missing evaluation names none) pairs with
    the one row of the other report of the same variant, quant and budget, whatever its label."""
    new_by_id = {point_id(r): r for r in new}
    pairs, only_base = [], []
    for row in base:
        other = new_by_id.pop(point_id(row), None)
        if other is not None:
            pairs.append((row, other))
            continue
        variant, _, quant, budget = point_id(row)
        candidates = [k for k, r in new_by_id.items() if (k[0], k[2], k[3]) == (variant, quant, budget)
                      and not (row["labelled"] and r["labelled"])]
        if len(candidates) == 1:
            pairs.append((row, new_by_id.pop(candidates[0])))
        else:
            only_base.append(row)
    only_new = [r for r in new if any(r is v for v in new_by_id.values())]
    return pairs, only_base, only_new


def eval_cost(report: dict[str, Any], rows: list[dict[str, Any]] | None = None) -> tuple[str, str, str]:
    """The unit, convention and scope of the evaluated points' cost, as their eval blocks state them (the
    report's own where no block says): ("TFLOPs", "flops", "all")."""
    rows = eval_rows(report) if rows is None else rows
    first = next((r for r in rows if r["status"] == "ok"), {})
    return (str(first.get("units") or report.get("units") or "TFLOPs"),
            str(first.get("convention") or report.get("convention") or "flops"),
            str(first.get("scope") or report.get("scope") or "all"))


def eval_cost_words(report: dict[str, Any], rows: list[dict[str, Any]] | None = None) -> str:
    """`eval_cost` in words: "TFLOPs, flops convention, scope all"."""
    units, convention, scope = eval_cost(report, rows)
    return f"{units}, {convention} convention, scope {scope}"
