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


def device_line(env: dict[str, Any], plan: Plan) -> str:
    """What the run will measure on, said before anything is built."""
    if plan.device.type == "cuda":
        where = f"cuda: {env.get('device')} (CUDA {env.get('cuda')}, driver {env.get('driver')})"
        roofline = f", roofline profile {plan.gpu.key}" if plan.gpu else ", no roofline profile for this GPU"
    else:
        where = f"cpu: {env.get('cpu')} ({env.get('threads')} threads)"
        roofline = ""
    return f"device {where}{roofline}; {plan.warmup} warm-up and {plan.repeat} timed run(s) per row"


def run_and_report(config: ProfileConfig, plan: Plan, json_path: str | None, console: Console,
                   wide: bool = False) -> dict[str, Any]:
    """Run the plan, rewriting the report after every row; returns the report."""
    env = environment(plan.device)
    report: dict[str, Any] = {
        "schema": SCHEMA,
        "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "environment": env,
        "config": config.to_json() | {"gpu_profile": plan.gpu.key if plan.gpu else None,
                                      "warmup": plan.warmup, "repeat": plan.repeat},
        "rows": [],
    }
    for note in plan.notes:
        console.print(note, markup=False, highlight=False, soft_wrap=True)
    console.print(device_line(env, plan), markup=False, highlight=False, soft_wrap=True)
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
    return report
