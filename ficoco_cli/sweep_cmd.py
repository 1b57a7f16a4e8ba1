"""`ficoco sweep`, `ficoco show` and `ficoco report --plot`: wiring and rendering only (the work
is in ficoco.sweep, ficoco.profiling.show and ficoco.sweep.figures)."""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from ficoco.accounting.request import ScheduleRequest
from ficoco.errors import FicocoError
from ficoco_cli.flags import cli_message


def sweep_table(report: dict[str, Any]) -> Table:
    """One line per point: method, budget, visual tokens, the accountant's count, and what was
    measured (median latency, speedup) and compared (agreement, KL)."""
    table = Table(title=f"{report.get('model')}: sweep ({report.get('units')}, {report.get('convention')} convention, "
                        f"scope {report.get('scope')})", title_justify="left")
    for name in ("variant", "quant", "budget", "visual tokens", report.get("units") or "TFLOPs", "median ms",
                 "speedup", "top-1 agree", "KL"):
        table.add_column(name, justify="left" if name in ("variant", "quant", "budget") else "right")
    for point in report["points"]:
        analytic = point.get("analytic") or {}
        measured = point.get("measured") or {}
        fidelity = point.get("fidelity") or {}
        budget = point.get("budget") or {}
        latency = (measured.get("latency") or {}).get("median_ms")
        speedup = measured.get("speedup_vs_vanilla")
        table.add_row(
            str(point.get("variant")), str(point.get("quant")),
            ", ".join(f"{k} {v:g}" for k, v in budget.items()) or "-",
            str(analytic.get("visual_tokens", "-")), _num(analytic.get("tflops"), ".4g"),
            _num(latency, ".4g") if measured.get("status") in (None, "ok") else str(measured.get("status")),
            _num(speedup, ".2f", "x"), _num(fidelity.get("top1_agreement"), ".2f"),
            _num(fidelity.get("kl_divergence"), ".3g"))
    skipped = sweep_notes(report)
    if skipped:
        table.caption = "\n".join(skipped)
        table.caption_justify = "left"
    return table


def sweep_notes(report: dict[str, Any]) -> list[str]:
    """The lines under a sweep's table: the points a method cannot run here (the family refuses it, or the
    budget is out of its reach), the failed ones, the store's progress, a concurrency note."""
    skipped = []
    for entry in report.get("skipped") or []:
        budget = ", ".join(f"{k} {v:g}" for k, v in (entry.get("budget") or {}).items())
        skipped.append(f"skipped {entry.get('variant')} {entry.get('quant')}{' ' + budget if budget else ''}: "
                       f"{cli_message(str(entry.get('reason')))}")
    for entry in report.get("failed") or []:
        skipped.append(f"failed {entry.get('key')} (attempt {entry.get('attempt')}): "
                       f"{cli_message(str(entry.get('error')))}")
    progress = report.get("progress") or {}
    if progress and progress.get("done") != progress.get("total"):
        from ficoco.sweep.store import Progress

        skipped.append(f"store {report.get('store')}: {Progress(**progress).line()}")
    if report.get("concurrency_note"):
        skipped.append(f"note: {cli_message(report['concurrency_note'])}")
    return skipped


def _num(value: Any, fmt: str, suffix: str = "") -> str:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return f"{value:{fmt}}{suffix}"
    return "-"


def draw_report(report: dict[str, Any], folder: str, console: Console) -> list[str]:
    """Every figure the report has data for, as PNG and SVG in `folder`; the paths written."""
    from ficoco.sweep.figures import save_figure, sweep_figures

    written: list[str] = []
    for name, figure in sweep_figures(report).items():
        written += save_figure(figure, folder, name)
    console.print(f"figures: {', '.join(written)}", markup=False, highlight=False, soft_wrap=True)
    return written


def run_sweep(config: Any, json_path: str | None, plot: str | None, console: Console, *,
              out: str | None = None, executor: Any = None) -> dict[str, Any]:
    """Plan every point (all mistakes first) and cost it; when models run, run each point in its
    own process on the executor, every finished point stored at once in the results store (`out`)
    and a rerun of the same command resuming it; then the report (atomically, after every point)
    and the figures. The report's `failed` names the points that failed (the CLI exits 1)."""
    from ficoco.report import write_json_atomic
    from ficoco.sweep import default_store, new_report, plan_points, sweep_profile

    profile = sweep_profile(config)
    skipped: list[dict[str, Any]] = []
    points = plan_points(config, profile, skipped)
    report = new_report(config, profile, points, skipped)
    failed: list[str] = []
    if config.measure or config.fidelity or config.evaluates:
        report, failed = _run_stored(config, report, points, out or default_store(config), executor, json_path,
                                     plot, console)
    from ficoco_cli.render import print_evaluated_sweep

    if print_evaluated_sweep(console, report):  # an evaluated sweep's table is its accuracy beside its cost
        for line in sweep_notes(report):
            console.print(line, markup=False, highlight=False, soft_wrap=True)
    else:
        console.print(sweep_table(report))
    if json_path:
        write_json_atomic(json_path, report)
    if plot:
        draw_report(report, plot, console)
    if failed:
        console.print(f"{len(failed)} of {len(points)} point(s) failed ({', '.join(failed)}; the reasons are under the "
                      f"table and in {report.get('store')}); rerun the same command to redo them",
                      markup=False, highlight=False, soft_wrap=True)
    return report


# While a sweep runs, its figures (--plot) are redrawn from the store at most this often: minutes-long
# points get every point drawn, a tiny test sweep is not slowed by drawing.
REDRAW_EVERY_S = 60.0


def _run_stored(config: Any, report: dict[str, Any], points: list[Any], folder: str, options: Any,
                json_path: str | None, plot: str | None, console: Console) -> tuple[dict[str, Any], list[str]]:
    from ficoco.report import write_json_atomic
    from ficoco.sweep import check_run_here
    from ficoco.sweep.executors import ExecutorOptions, make_executor, run_points
    from ficoco.sweep.store import SweepStore

    options = options or ExecutorOptions(device=config.device)
    if options.name == "local" and not config.evaluates:  # an evaluation's worker checks its checkpoint itself
        check_run_here(config, points)
    store = SweepStore(folder)
    keys = [p.key for p in points]
    resumed = store.create_or_resume(config.to_json(), report, keys)
    executor = make_executor(options)
    by_key = {p.key: p for p in points}

    def say(text: str) -> None:
        console.print(text, markup=False, highlight=False, soft_wrap=True)

    drawn = [time.monotonic()]

    def save() -> dict[str, Any]:
        current = store.report()
        write_json_atomic(str(store.report_path), current)
        if json_path and json_path != "-":
            write_json_atomic(json_path, current)
        if plot and time.monotonic() - drawn[0] >= REDRAW_EVERY_S:
            from ficoco.sweep.figures import save_figure, sweep_figures

            for name, figure in sweep_figures(current).items():
                save_figure(figure, plot, name)
            drawn[0] = time.monotonic()
        return current

    with store.driver_lock():
        store.clear_stale_claims()
        seen = {k: (store.record(k) or {}).get("finished_unix") for k in keys}
        done = sum(store.is_done(k) for k in keys)
        what = " and ".join(w for w, on in (("measuring", config.measure), ("comparing with vanilla", config.fidelity),
                                            (f"evaluating on {','.join(config.eval_tasks)}", config.evaluates)) if on)
        say(f"{len(points)} point(s), {what}, each in its own process; results store {store.folder} "
            f"({f'resuming: {done} done' if resumed else 'new'}; rerun the same command to resume)")
        say(cli_message(executor.describe()))

        def on_tick() -> None:
            changed = False
            for key in keys:
                record = store.record(key) or {}
                if record.get("finished_unix") == seen[key]:
                    continue
                seen[key], changed = record.get("finished_unix"), True
                point = by_key[key]
                budget = ", ".join(f"{k} {v:g}" for k, v in (point.budget or {}).items()) or "reference"
                took = record.get("duration_s")
                how = f"done in {took:.1f} s" if record.get("status") == "done" and took is not None else \
                    f"failed: {cli_message(str(record.get('error')))}"
                say(f"[{store.progress(executor.parallel).line()}] {point.variant} {point.quant} {budget}: {how}")
            if changed:
                save()

        try:
            failed = run_points(store, executor, keys, on_tick)
            # After the run: Ray knows the resources per point (and so whether CPU points shared) only connected.
            store.note_run({"executor": options.name, "describe": executor.describe(),
                            "parallel": executor.parallel, "shares_cpu": executor.shares_cpu,
                            "failed": failed})
        except KeyboardInterrupt:
            save()
            say(f"stopped: {sum(store.is_done(k) for k in keys)} of {len(keys)} point(s) are in {store.folder}; "
                "rerun the same command to finish")
            raise
        on_tick()
    return save(), failed


def run_show(*, model: str, variant: str, request: ScheduleRequest, image: str | None, layer: int | None, out: str,
             json_path: str | None, weights: str, overrides: list[str], seed: int, dtype: str,
             console: Console) -> dict[str, Any]:
    """Run the model once under the method on the image and draw its tokens (and write the data)."""
    from ficoco import accounting as acc
    from ficoco.profiles import load_profile
    from ficoco.report import write_json_atomic

    if Path(out).suffix.lower() not in (".png", ".svg"):
        raise FicocoError(f"--out {out}: give a .png or .svg file name")
    if image is not None:
        from ficoco.profiling.matrix import check_image

        check_image(image)
    source = weights if weights != "random" and Path(weights).expanduser().is_dir() else None
    profile = load_profile(source or model, overrides)
    arch = acc.architecture(profile)
    sched = acc.resolve_schedule(arch, variant, acc.CountOptions(), request)
    if layer is not None and layer not in sched.removed_at():
        layers = ", ".join(str(k) for k in sorted(sched.removed_at())) or "none"
        raise FicocoError(f"--layer {layer} does not reduce in this schedule; reducing layers: {layers}")

    import torch

    from ficoco.models.build import build_model
    from ficoco.profiling.show import Layout, picture_inputs, show_data, to_json
    from ficoco.sweep.figures import save_figure, token_figure

    built = build_model(profile if weights == "random" else model, weights, dtype=dtype, device="cpu", seed=seed)
    layout = Layout(built)
    inputs, pictures = picture_inputs(built, layout, image, weights=weights, seed=seed)
    data = show_data(built, variant, sched, inputs, layout, pictures)
    budget = next(f"{name} {value:g}" if isinstance(value, float) else f"{name} {value}"
                  for name, value in (("keep", request.keep), ("tflops", request.tflops),
                                      ("schedule", request.schedule), ("all", "tokens"))
                  if value is not None)
    data.update(model=arch.name, weights=weights, random_weights=weights == "random", image=image, budget=budget,
                device="cpu", compute_dtype=str(next(built.parameters()).dtype).removeprefix("torch."),
                torch=torch.__version__)
    figure = token_figure(data, layer)
    folder, name = Path(out).expanduser().parent, Path(out).stem
    fmt = Path(out).suffix.lower().lstrip(".")
    written = save_figure(figure, folder, name, formats=(fmt,))
    console.print(f"figure: {written[0]}", markup=False, highlight=False, soft_wrap=True)
    if json_path:
        write_json_atomic(json_path, to_json(data))
    return data
