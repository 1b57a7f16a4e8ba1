"""`ficoco eval`: methods x budgets through lmms-eval on a local checkpoint, each point in its own process on
the sweep's store (resumed by the same command), joined into one table (score, retention, agreement with
vanilla's answers, TFLOPs, visual tokens, prefill), a figure of score against TFLOPs, a report that
`ficoco report` shows and `ficoco compare` judges; a user's mistake is one line before any point runs."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
from helpers import assert_one_error_line, make_checkpoint, make_eval_task, run_cli

pytest.importorskip("lmms_eval", reason="the README's test command installs lmms-eval")


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("ficoco-eval")
    checkpoint = make_checkpoint("llava", root / "llava")
    tasks = make_eval_task(root / "tasks", "colours_cli", size=(112, 112))
    command = ("eval", "--model", "llava-tiny", "--weights", checkpoint, "--variant", "vanilla,v,fastv,holitom",
               "--keep", "40", "--tasks", "colours_cli", "--include-path", tasks, "--batch-size", "2", "--out",
               root / "store", "--json", root / "report.json", "--plot", root / "figures")
    first = run_cli(*command, in_subprocess=True, cwd=root, env={"HF_HOME": str(root / "hf-home")})
    again = run_cli(*command, in_subprocess=True, cwd=root, env={"HF_HOME": str(root / "hf-home")})
    return {"root": root, "checkpoint": checkpoint, "tasks": tasks, "first": first, "again": again,
            "report": json.loads((root / "report.json").read_text())}


def test_every_point_is_evaluated_and_joined_into_one_table(evaluated: dict[str, Any]) -> None:
    first = evaluated["first"]
    assert first.code == 0, first.err[-3000:]
    for column in ("colours_cli", "retained", "agrees", "visual", "prefill"):
        assert column in first.out
    # FiCoCo-V keeps 40 of 64, FastV averages 40 over the decoder; HoliTom, a video method, is left out of an
    # image family's run with its reason.
    points = {(p["variant"], (p["budget"] or {}).get("keep")): p for p in evaluated["report"]["points"]}
    assert set(points) == {("vanilla", None), ("v", 40), ("fastv", 40)}
    assert "skipped holitom fp16 keep 40: refused on llava" in first.out
    for point in points.values():
        assert point["eval"]["status"] == "ok"
        assert point["eval"]["tasks"]["colours_cli"]["metric"] == "exact_match"
        assert len(point["eval"]["samples"]) == 4


def test_the_join_gives_vanilla_full_agreement_and_each_method_the_share_of_vanillas_answers(evaluated) -> None:
    from ficoco.eval.join import eval_rows

    report = evaluated["report"]
    rows = {(r["variant"], r["budget_label"] if "budget_label" in r else json.dumps(r.get("budget"))): r
            for r in eval_rows(report)}
    vanilla = next(r for r in rows.values() if r["variant"] == "vanilla")
    assert vanilla["agreement"] == 1.0
    reference = {s["doc_id"]: s["answer"].strip() for p in report["points"] if p["variant"] == "vanilla"
                 for s in p["eval"]["samples"]}
    for point in report["points"]:
        if point["variant"] == "vanilla":
            continue
        row = next(r for r in eval_rows(report) if r["variant"] == point["variant"]
                   and (r.get("budget") or {}) == (point["budget"] or {}))
        same = sum(s["answer"].strip() == reference[s["doc_id"]] for s in point["eval"]["samples"]) / 4
        assert row["agreement"] == pytest.approx(same)


def test_the_rerun_resumes_the_store_and_runs_no_point_again(evaluated: dict[str, Any]) -> None:
    again = evaluated["again"]
    assert again.code == 0, again.err[-2000:]
    assert "resuming: 3 done" in again.out
    assert "done in" not in again.out
    records = sorted((evaluated["root"] / "store" / "eval").glob("*.json"))
    assert len(records) == 3 and all(json.loads(p.read_text())["schema"] == "ficoco.eval/1" for p in records)


def test_the_figure_of_score_against_tflops_is_drawn(evaluated: dict[str, Any]) -> None:
    figures = evaluated["root"] / "figures"
    assert (figures / "accuracy.png").stat().st_size > 0 and (figures / "accuracy.svg").is_file()


def test_report_shows_the_table_and_compare_judges_the_scores(evaluated: dict[str, Any], tmp_path: Path) -> None:
    path = evaluated["root"] / "report.json"
    shown = run_cli("report", path, "--format", "markdown")
    assert shown.code == 0 and "colours_cli" in shown.out
    same = run_cli("compare", path, path)
    assert same.code == 0, same.out + same.err
    # A base whose methods scored one point more: the new report's scores dropped beyond the tolerance.
    better = copy.deepcopy(evaluated["report"])
    for point in better["points"]:
        task = point["eval"]["tasks"]["colours_cli"]
        task["score"] = task["score"] + 1.0
        task["metrics"] = {k: v + 1.0 if k.startswith("exact_match") else v for k, v in task["metrics"].items()}
        point["eval"]["score"] = point["eval"]["score"] + 1.0
    (tmp_path / "better.json").write_text(json.dumps(better))
    dropped = run_cli("compare", tmp_path / "better.json", path)
    assert dropped.code == 1, dropped.out + dropped.err
    assert "colours_cli" in dropped.out


@pytest.mark.parametrize(("args", "says"), [
    (("--model", "llava-tiny", "--tasks", "colours_cli", "--keep", "16"), "--model llava-tiny: not a folder"),
    (("--model", "llava-tiny", "--weights", "{checkpoint}", "--tasks", "no_such_task", "--keep", "16",
      "--include-path", "{tasks}"), "--tasks no_such_task: lmms-eval knows no task no_such_task"),
    (("--model", "{checkpoint}", "--tasks", "colours_cli", "--keep", "16", "--include-path", "{tasks}"),
     "sweep point v at --keep 16: the profile's first reducing layer (12;"),
    (("--model", "{checkpoint}", "--tasks", "colours_cli", "--include-path", "{tasks}"), "needs the points"),
    (("--model", "llava-tiny", "--weights", "{checkpoint}", "--tasks", "colours_cli", "--keep", "16",
      "--include-path", "/no/such/tasks"), "--include-path /no/such/tasks: no such folder"),
])
def test_a_mistake_is_one_line_before_any_point_runs(evaluated: dict[str, Any], args: tuple[str, ...],
                                                    says: str) -> None:
    given = [a.format(checkpoint=evaluated["checkpoint"], tasks=evaluated["tasks"]) for a in args]
    result = run_cli("eval", *given)
    line = assert_one_error_line(result)
    assert says in line
