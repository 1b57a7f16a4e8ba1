"""Sweeps: every method at every budget point, measured and stored point by point.

- `ficoco.sweep.plan`: the sweep's configuration, its points, the accountant per point, one point
  measured (with its fidelity), the report a store assembles;
- `ficoco.sweep.store`: a sweep's results store: one record per point, claims, progress, the report;
- `ficoco.sweep.executors`: where points run: a local pool, Ray tasks, a Slurm job array (submitit);
- `ficoco.sweep.worker`: one point in one process (`python -m ficoco.sweep.worker STORE KEY`), what
  every executor runs;
- `ficoco.sweep.figures`: every figure, drawn with matplotlib (Agg) from report data only.

This package's `__init__` loads the plan's names only (no torch, no matplotlib).
"""

from __future__ import annotations

from ficoco.sweep.plan import (
    VANILLA,
    Point,
    SweepConfig,
    check_run_here,
    default_store,
    finite,
    new_report,
    plan_points,
    points_of,
    read_report_any,
    run_point,
    sweep_profile,
)

__all__ = ["VANILLA", "Point", "SweepConfig", "check_run_here", "default_store", "finite", "new_report",
           "plan_points", "points_of", "read_report_any", "run_point", "sweep_profile"]
