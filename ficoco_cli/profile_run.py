"""`ficoco profile`'s run: the plan and its time estimate first, then a progress display that
names the step under way (a rich bar on a terminal, one line per step elsewhere), the report
rewritten after every row."""

from __future__ import annotations

import contextlib
import datetime as dt
import time
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, ProgressColumn, Task, TextColumn, TimeElapsedColumn
from rich.text import Text

from ficoco.profiling.config import ProfileConfig
from ficoco.profiling.estimate import Eta, RunEstimate
from ficoco.profiling.matrix import BUILD_STEP, Phase, Plan, RowSpec
from ficoco.report import ProfilePlan, write_json_atomic
from ficoco.report.precision import precision_of
from ficoco_cli.flags import cli_message
from ficoco_cli.render import fmt_duration, print_profile

# In a log, a step's line is printed when the kind of step changes (build, warm-up, timed runs,
# generation, done) or when this long has passed since the last line: a tiny model's ten 5 ms
# runs make one line, a 7B model's minute-long runs one line each.
LINE_EVERY_S = 5.0


def _clock(seconds: float) -> str:
    return str(dt.timedelta(seconds=round(seconds)))


def device_line(env: dict[str, Any], plan: Plan) -> str:
    """What the run will measure on, said before anything is built."""
    if plan.device.type == "cuda":
        where = f"cuda: {env.get('device')} (CUDA {env.get('cuda')}, driver {env.get('driver')})"
        roofline = f", roofline profile {plan.gpu.key}" if plan.gpu else ", no roofline profile for this GPU"
    else:
        where = f"cpu: {env.get('cpu')} ({env.get('threads')} threads)"
        reads = env.get("read_kernel") or {}
        if reads.get("kernel") == "native":
            where += "; methods read attention with ficoco's CPU kernel"
        elif reads:
            where += f"; methods read attention in torch ({reads.get('reason')})"
        roofline = ""
    if plan.warmup is not None and plan.repeat is not None:
        runs = f"{plan.warmup} warm-up and {plan.repeat} timed run(s) per row"
    else:
        runs = "warm-up and timed runs per row by a time budget"
    return f"device {where}{roofline}; {runs}"


def row_label(plan: Plan, index: int) -> str:
    """`[2/3] v bf16 b1`: the row's place in the run and what it measures (the dtype it computes in where the
    plan chose one, else its quant)."""
    row: RowSpec = plan.rows[index]
    return f"[{index + 1}/{len(plan.rows)}] {row.variant} {_precision(plan, row.quant)} b{row.batch}"


def _precision(plan: Plan, quant: str) -> str:
    """What rows of `quant` compute in (bf16, fp16, fp32; int8, int4), where the plan chose the dtype."""
    return precision_of(quant, getattr(getattr(plan, "dtype", None), "compute", None))


def estimate_lines(plan: Plan, estimate: RunEstimate) -> list[str]:
    """The plan with its time estimate: rows, dtype, memory, the time of every build and row."""
    rates = estimate.rates
    lines = [f"plan: {len(plan.rows)} row(s), computing in {estimate.dtype}; memory {estimate.memory}",
             f"estimate: {fmt_duration(estimate.total_s)} in all, from the accountant's counts at this machine's "
             f"measured rates (matmul {rates.matmul_flops_per_s / 1e12:.3g} TFLOP/s in {rates.dtype}, copy "
             f"{rates.copy_bytes_per_s / 1e9:.3g} GB/s, {rates.small_op_s * 1e6:.3g} us per small op)"]
    for quant, build_s in estimate.build_s.items():
        lines.append(f"  {_precision(plan, quant)} model build ~{fmt_duration(build_s)}")
    for index, row in enumerate(estimate.rows):
        runs = f"{row.warmup} warm-up + {row.repeat} timed"
        generation = "" if row.generation_s is None else f", generation ~{fmt_duration(row.generation_s)}"
        lines.append(f"  {row_label(plan, index)}: {row.tflops:.4g} TFLOPs, prefill ~{fmt_duration(row.prefill_s)}"
                     f"{generation}, {runs}: ~{fmt_duration(row.wall_s)}")
    return lines


class _EtaColumn(ProgressColumn):
    """The time left, recomputed at every refresh, so it counts down during a long run."""

    def __init__(self, display: ProgressDisplay) -> None:
        super().__init__()
        self.display = display

    def render(self, task: Task) -> Text:
        return Text(f"ETA {_clock(self.display.remaining_s())}")


class ProgressDisplay:
    """The step under way (building the model, warm-up k/n, timed run k/n), its row, the elapsed
    time and the ETA: a rich progress bar on a terminal, one plain line per step elsewhere
    (CI logs, pipes), each naming how long the step before it took."""

    def __init__(self, console: Console, plan: Plan, estimate: RunEstimate) -> None:
        self.console, self.plan, self.eta = console, plan, Eta(estimate)
        self.begin = self.step_begin = time.monotonic()
        self.last: str | None = None  # what the step before took, for the next line
        self.said: tuple[int, str] | None = None  # the row and kind of step of the last line printed
        self.said_at = -LINE_EVERY_S
        self.interactive = console.is_terminal
        self.progress: Progress | None = None
        self.task: Any = None
        if self.interactive:
            self.progress = Progress(TextColumn("{task.description}"), BarColumn(bar_width=20), TimeElapsedColumn(),
                                     _EtaColumn(self), console=console, transient=True)
            self.task = self.progress.add_task("planning", total=1.0)

    def __enter__(self) -> ProgressDisplay:
        if self.progress:
            self.progress.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.progress:
            self.progress.__exit__(*exc)

    def remaining_s(self) -> float:
        return self.eta.remaining_s(time.monotonic() - self.step_begin)

    def _say(self, row: int, what: str, kind: str) -> None:
        now = time.monotonic()
        elapsed = now - self.begin
        remaining = self.remaining_s()
        label = (f"[{row + 1}/{len(self.plan.rows)}] {_precision(self.plan, self.plan.rows[row].quant)}"
                 if what == BUILD_STEP
                 else row_label(self.plan, row))
        if self.progress is not None:
            done = elapsed / (elapsed + remaining) if elapsed + remaining > 0 else 0.0
            self.progress.update(self.task, description=f"{label}: {what}", completed=done)
            return
        if self.said == (row, kind) and now - self.said_at < LINE_EVERY_S:
            return
        self.said, self.said_at = (row, kind), now
        before = f" ({self.last})" if self.last else ""
        self.console.print(f"{label}: {what}{before}, elapsed {_clock(elapsed)}, ETA {_clock(remaining)}",
                           markup=False, highlight=False, soft_wrap=True)

    def on_phase(self, phase: Phase) -> None:
        """A step of `run_profile` started or ended."""
        what = phase.step if phase.step == BUILD_STEP else f"{phase.step} {phase.k}/{phase.n}"
        if phase.seconds is None:
            self.eta.started(phase.row, phase.step, phase.k, phase.n)
            self.step_begin = time.monotonic()
            self._say(phase.row, what, phase.step)
            self.last = None
        else:
            self.eta.finished(phase.row, phase.step, phase.seconds)
            self.step_begin = time.monotonic()
            self.last = f"built in {fmt_duration(phase.seconds)}" if phase.step == BUILD_STEP else (
                f"{what} took {fmt_duration(phase.seconds)}")

    def on_row(self, index: int, row: dict[str, Any]) -> None:
        """A row ended: say so with its time and its status."""
        self.eta.row_done(index)
        self.step_begin = time.monotonic()
        wall = row.get("wall_s")
        status = row.get("status")
        what = "done" if status == "ok" else str(status)
        if isinstance(wall, float):
            what += f" {'in' if status == 'ok' else 'after'} {fmt_duration(wall)}"
        self._say(index, what, "done")
        self.last = None


def run_and_report(config: ProfileConfig, json_path: str | None, console: Console, wide: bool = False,
                   dry_run: bool = False) -> dict[str, Any] | None:
    """`ficoco.profile(config)` with the plan and its estimate printed first, a progress display,
    the report rewritten after every row (`--json FILE`) and its table at the end; returns the
    report (None after a dry run: the plan is printed, nothing else)."""
    import ficoco

    held: dict[str, Any] = {}  # the report as it grows: its table is printed even after Ctrl-C

    with contextlib.ExitStack() as stack:

        def on_plan(planned: ProfilePlan) -> None:
            plan, estimate = planned.plan, planned.estimate
            held["report"] = planned.report
            for note in plan.notes:
                console.print(cli_message(note), markup=False, highlight=False, soft_wrap=True)
            if not dry_run:
                console.print(device_line(planned.report["environment"], plan), markup=False, highlight=False,
                              soft_wrap=True)
            for line in estimate_lines(plan, estimate):
                console.print(line, markup=False, highlight=False, soft_wrap=True)
            if not dry_run:
                held["display"] = stack.enter_context(ProgressDisplay(console, plan, estimate))

        def on_phase(phase: Phase) -> None:
            held["display"].on_phase(phase)

        def on_row(report: dict[str, Any]) -> None:
            # Rewritten after every row, atomically: an interrupted run keeps what it measured.
            if json_path and json_path != "-":
                write_json_atomic(json_path, report)
            index = len(report["rows"]) - 1
            held["display"].on_row(index, report["rows"][index])

        try:
            ficoco.profile(config, on_plan=on_plan, on_phase=on_phase, on_row=on_row, dry_run=dry_run)
        finally:
            stack.close()  # the progress display ends before the table
            if held.get("report", {}).get("rows"):
                print_profile(console, held["report"], wide)
    if dry_run:
        return None
    if json_path == "-":
        write_json_atomic("-", held["report"])
    return held["report"]
