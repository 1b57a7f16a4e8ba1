"""The join of an evaluated sweep's accuracy with its cost (ficoco.eval.join) and its table (ficoco_cli.render):
retention and answer agreement against vanilla, failed and missing points, several quants, and the
table's text in a console, markdown and CSV. Synthetic reports (tests/eval_reports.py), every figure
known; no model runs."""

from __future__ import annotations

import ast
import csv
import io
from pathlib import Path

import pytest
from eval_reports import (
    TASKS,
    answers,
    eval_block,
    evaluated_report,
    failed_block,
    find,
    point,
    standard_points,
    standard_report,
)
from rich.console import Console

from ficoco.eval.join import budget_label, eval_rows, eval_tasks, evaluated, point_id, retention
from ficoco_cli.render import eval_csv, eval_markdown, eval_table, print_evaluated_sweep


def rows_by(report: dict) -> dict[tuple[str, str], dict]:
    return {(r["method_label"], r["budget_label"]): r for r in eval_rows(report)}


def test_an_evaluated_report_is_a_sweep_with_eval_tasks() -> None:
    report = standard_report()
    assert evaluated(report) and eval_tasks(report) == list(TASKS)
    assert not evaluated({**report, "config": {**report["config"], "eval_tasks": []}})
    assert not evaluated({**report, "config": {k: v for k, v in report["config"].items() if k != "eval_tasks"}})
    assert not evaluated({**report, "schema": "ficoco.report/1"})


def test_rows_put_vanilla_first_and_keep_every_point_with_its_status() -> None:
    points = standard_points()
    report = evaluated_report([*points[1:], points[0]])  # vanilla last in the report
    rows = eval_rows(report)
    assert [(r["variant"], r["budget_label"], r["status"]) for r in rows] == [
        ("vanilla", "-", "ok"), ("v", "keep 64", "ok"), ("v", "keep 32", "ok"), ("l", "keep 64", "failed"),
        ("l", "keep 32", "missing")]
    failed, missing = rows[3], rows[4]
    assert failed["reason"] == "lmms-eval: CUDA out of memory" and missing["reason"] == "not evaluated"
    for row in (failed, missing):
        assert row["score"] is None and row["relative_score"] is None and row["agreement"] is None
        assert row["tflops_mean"] is None and set(row["scores"].values()) == {None}
        assert row["method_label"] == "l"  # no block to name it: the variant


def test_scores_retention_and_agreement_are_the_known_figures() -> None:
    rows = rows_by(standard_report())
    vanilla, k64, k32 = rows["Vanilla", "-"], rows["VisionZip", "keep 64"], rows["VisionZip", "keep 32"]
    assert vanilla["scores"] == {"task_a": 0.8, "task_b": 60.0} and vanilla["score"] == pytest.approx(30.4)
    assert vanilla["relative_score"] == 1.0 and vanilla["agreement"] == 1.0 and vanilla["agreement_samples"] == 10
    # Retention per task on each task's own scale, then the mean: (0.8/0.8 + 50/60) / 2.
    assert k64["retention"] == pytest.approx({"task_a": 1.0, "task_b": 50 / 60})
    assert k64["relative_score"] == pytest.approx((1 + 50 / 60) / 2)
    assert k32["relative_score"] == pytest.approx((0.6 / 0.8 + 40 / 60) / 2)
    # One and three of the ten answers differ; the others differ only in white space, which is ignored.
    assert (k64["agreement"], k64["agreement_samples"]) == (pytest.approx(0.9), 10)
    assert (k32["agreement"], k32["agreement_samples"]) == (pytest.approx(0.7), 10)
    assert (k64["tflops_mean"], k64["visual_tokens_mean"], k64["prefill_ms_mean"]) == (2.0, 64.0, 8.0)
    assert (k64["ttft_ms_mean"], k64["decode_ms_per_token_mean"], k64["timed_on"]) == (8.5, 2.0, "cpu: Test CPU")


def test_agreement_compares_the_same_documents_only() -> None:
    report = standard_report()
    block = find(report, "v", 64)["eval"]
    # The point answered only task_a's documents 0-2, one of them otherwise than vanilla, and a document
    # vanilla never saw.
    block["samples"] = [s for s in block["samples"] if s["task"] == "task_a" and s["doc_id"] < 3]
    block["samples"].append({"task": "task_a", "doc_id": 99, "answer": "red"})
    row = rows_by(report)["VisionZip", "keep 64"]
    assert row["agreement_samples"] == 3 and row["agreement"] == pytest.approx(2 / 3)


def test_without_an_evaluated_vanilla_nothing_is_relative() -> None:
    report = standard_report()
    find(report, "vanilla")["eval"] = failed_block("vanilla's run died")
    rows = eval_rows(report)
    assert rows[0]["status"] == "failed"
    for row in rows[1:3]:
        assert row["status"] == "ok" and row["score"] is not None
        assert row["relative_score"] is None and row["agreement"] is None
        assert set(row["retention"].values()) == {None}


def test_a_vanilla_score_of_zero_has_no_retention() -> None:
    report = standard_report()
    find(report, "vanilla")["eval"]["tasks"]["task_b"]["score"] = 0.0
    row = rows_by(report)["VisionZip", "keep 64"]
    assert row["retention"]["task_a"] == 1.0 and row["retention"]["task_b"] is None
    assert row["relative_score"] is None  # a mean over some of the tasks would be another number


def test_a_lower_is_better_task_retains_vanilla_over_the_score() -> None:
    assert retention(0.5, 0.8) == pytest.approx(0.625)
    assert retention(0.4, 0.2, higher_is_better=False) == pytest.approx(0.5)  # twice the error: half retained
    assert retention(0.5, 0.0) is None and retention(None, 0.8) is None


def test_the_mean_score_is_computed_when_the_block_has_none() -> None:
    report = standard_report()
    del find(report, "v", 64)["eval"]["score"]
    assert rows_by(report)["VisionZip", "keep 64"]["score"] == pytest.approx(25.4)
    del find(report, "v", 64)["eval"]["tasks"]["task_b"]
    row = rows_by(report)["VisionZip", "keep 64"]
    assert row["scores"]["task_b"] is None and row["score"] is None


def test_each_quant_is_relative_to_its_own_vanilla() -> None:
    points = standard_points()[:2]
    int4 = [point("vanilla", None, eval_block("Vanilla", {"task_a": 0.5, "task_b": 50.0}, answers(2), tflops=8.0,
                                              tokens=576), quant="int4"),
            point("v", {"keep": 64}, eval_block("VisionZip", {"task_a": 0.5, "task_b": 25.0}, answers(2),
                                                tflops=2.0, tokens=64), quant="int4")]
    rows = eval_rows(evaluated_report([*points, *int4]))
    assert [(r["variant"], r["quant"]) for r in rows] == [("vanilla", "fp16"), ("v", "fp16"), ("vanilla", "int4"),
                                                          ("v", "int4")]
    assert rows[3]["relative_score"] == pytest.approx((1 + 0.5) / 2)
    assert rows[3]["agreement"] == 1.0  # the same answers as int4's vanilla (both changed the first two)


def test_points_are_identified_by_variant_label_quant_and_budget() -> None:
    rows = eval_rows(standard_report())
    assert len({point_id(r) for r in rows}) == len(rows)
    assert point_id(rows[1]) == ("v", "VisionZip", "fp16", "keep=64")
    assert budget_label({"tflops": 1.5}) == "tflops 1.5" and budget_label(None) == "-"


def test_the_join_imports_no_torch_nor_the_sweeps_planner() -> None:
    source = Path(__file__).resolve().parents[1] / "ficoco" / "eval" / "join.py"
    imported = {node.module if isinstance(node, ast.ImportFrom) else alias.name
                for node in ast.walk(ast.parse(source.read_text())) if isinstance(node, ast.Import | ast.ImportFrom)
                for alias in node.names}
    assert not any(name.split(".")[0] in ("torch", "matplotlib") or name.startswith("ficoco.sweep")
                   for name in imported if name)


# ---- the table ----------------------------------------------------------------------------------------------------

def rendered(renderable, width: int = 200) -> str:
    console = Console(file=io.StringIO(), width=width, record=False)
    console.print(renderable)
    return console.file.getvalue()


def test_the_table_has_a_line_per_point_and_the_columns_asked_for() -> None:
    text = rendered(eval_table(standard_report()))
    for header in ("method", "budget", "task_a", "task_b", "mean", "retained", "agrees", "cost per", "TFLOPs",
                   "visual", "prefill", "status"):
        assert header in text, header
    lines = text.splitlines()
    vanilla = next(line for line in lines if line.startswith("Vanilla"))
    k64 = next(line for line in lines if line.startswith("VisionZip") and "keep 64" in line)
    assert vanilla.split()[1:] == ["-", "0.800", "60.00", "30.40", "100.0", "100.0", "8.000", "576.0", "20.00", "ok"]
    assert k64.split()[1:] == ["keep", "64", "0.800", "50.00", "25.40", "91.7", "90.0", "2.000", "64.0", "8.000",
                               "ok"]
    assert any(line.startswith("l ") and line.rstrip().endswith("failed") for line in lines)
    assert any(line.startswith("l ") and line.rstrip().endswith("not run") for line in lines)
    assert "flops convention, scope all" in text and "failed l fp16 keep 64: lmms-eval: CUDA out of memory" in text
    assert "1 of 5 point(s) not evaluated yet" in text
    assert "RANDOM WEIGHTS" not in text


def test_the_table_says_that_scores_of_random_weights_mean_nothing() -> None:
    text = rendered(eval_table(standard_report(random_weights=True)))
    assert "RANDOM WEIGHTS: the scores of an untrained model mean nothing" in " ".join(text.split())


def test_a_report_that_was_not_evaluated_has_no_table() -> None:
    report = standard_report()
    report["config"]["eval_tasks"] = []
    assert eval_table(report) is None


def test_markdown_and_csv_carry_the_same_rows() -> None:
    report = standard_report(random_weights=True)
    markdown = eval_markdown(report)
    table = [line for line in markdown.splitlines() if line.startswith("|")]
    assert len(table) == 2 + 5
    assert table[0].startswith("| method | budget | task_a score | task_b score | mean score | retained % vanilla")
    assert "| VisionZip | keep 64 | 0.800 | 50.00 | 25.40 | 91.7 | 90.0 |" in markdown
    assert "- RANDOM WEIGHTS" in markdown
    rows = list(csv.DictReader(io.StringIO(eval_csv(report))))
    assert [(r["method_label"], r["budget"], r["status"]) for r in rows] == [
        ("Vanilla", "-", "ok"), ("VisionZip", "keep 64", "ok"), ("VisionZip", "keep 32", "ok"),
        ("l", "keep 64", "failed"), ("l", "keep 32", "missing")]
    assert float(rows[1]["relative_score"]) == pytest.approx((1 + 50 / 60) / 2)
    assert float(rows[2]["agreement"]) == pytest.approx(0.7) and rows[2]["agreement_samples"] == "10"
    assert rows[3]["score_task_a"] == "" and rows[3]["reason"] == "lmms-eval: CUDA out of memory"


@pytest.mark.parametrize("fmt, first", [("table", "llava-tiny: accuracy (lmms-eval: task_a, task_b)"),
                                        ("markdown", "### llava-tiny: accuracy"),
                                        ("csv", "model,variant,method_label,quant,budget,status,score_task_a")])
def test_an_evaluated_sweep_prints_its_accuracy_in_every_format(fmt: str, first: str) -> None:
    console = Console(file=io.StringIO(), width=200)
    assert print_evaluated_sweep(console, standard_report(), fmt)
    text = console.file.getvalue()
    assert text.startswith(first) and "VisionZip" in text
    if fmt != "table":  # plain text: what --format writes, one line per row, no wrapping
        assert text == (eval_markdown(standard_report()) if fmt == "markdown" else eval_csv(standard_report()))


def test_a_sweep_that_was_not_evaluated_prints_nothing() -> None:
    report = standard_report()
    report["config"]["eval_tasks"] = []
    console = Console(file=io.StringIO(), width=200)
    assert not print_evaluated_sweep(console, report, "markdown") and console.file.getvalue() == ""
