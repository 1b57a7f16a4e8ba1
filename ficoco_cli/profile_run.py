"""`ficoco profile`'s run: a live progress display, the report rewritten after every row."""

from __future__ import annotations

import datetime as dt
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from ficoco.profiling.environment import environment
from ficoco.profiling.matrix import Plan, ProfileConfig, RowSpec, add_comparisons, run_profile
from ficoco.report import write_json_atomic
from ficoco_cli.render import print_profile

SCHEMA = "ficoco.report/1"


def run_and_report(config: ProfileConfig, plan: Plan, json_path: str | None, console: Console,
                   wide: bool = False) -> None:
    report: dict[str, Any] = {
        "schema": SCHEMA,
        "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "environment": environment(plan.device),
        "config": config.to_json() | {"gpu_profile": plan.gpu.key if plan.gpu else None},
        "rows": [],
    }
    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        console=console, transient=True)
    task = progress.add_task("profiling", total=len(plan.rows))

    def on_start(row: RowSpec) -> None:
        progress.update(task, description=f"{row.variant} {row.quant} batch {row.batch}")

    def on_row(row: dict[str, Any]) -> None:
        report["rows"].append(row)
        add_comparisons(report["rows"])
        # Rewritten after every row, atomically: an interrupted run keeps what it measured.
        if json_path and json_path != "-":
            write_json_atomic(json_path, report)
        progress.advance(task)

    try:
        with progress:
            run_profile(config, plan, on_row, on_start)
    finally:
        if report["rows"]:
            print_profile(console, report, wide)
    if json_path == "-":
        write_json_atomic("-", report)
