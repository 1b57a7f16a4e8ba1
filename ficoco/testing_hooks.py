"""Test-only hooks, read once from the environment at import; unset, each costs one falsy check.

FICOCO_TEST_DELAY_REDUCTION_MS: sleep this many milliseconds inside every timed reduction span
(`ficoco.models.handle.Handle.run_method`), a known slowdown of the method's own stages. It exists so that the
CI gate's power to catch a slower reduction can be shown (benchmarks/gate_noise.py); a report
made with it set records the fact in its environment (`test_hooks`). Never set it otherwise.

FICOCO_TEST_SWEEP_POINT_DELAY_MS: a sweep's worker sleeps this long after claiming its point and
before building its model (ficoco.sweep.worker), so that a test can kill a worker or the driver
while points run. It delays no timed span.
"""

from __future__ import annotations

import os
import time

DELAY_REDUCTION_VARIABLE = "FICOCO_TEST_DELAY_REDUCTION_MS"


def _milliseconds(name: str) -> float:
    text = os.environ.get(name, "").strip()
    try:
        value = float(text or 0)
    except ValueError:
        raise ValueError(f"{name}={text!r} is not a number of milliseconds") from None
    if value < 0:
        raise ValueError(f"{name}={text!r} must not be negative")
    return value


REDUCTION_DELAY_S = _milliseconds(DELAY_REDUCTION_VARIABLE) / 1e3
SWEEP_POINT_DELAY_VARIABLE = "FICOCO_TEST_SWEEP_POINT_DELAY_MS"
SWEEP_POINT_DELAY_S = _milliseconds(SWEEP_POINT_DELAY_VARIABLE) / 1e3


def delay_reduction() -> None:
    """The injected slowdown of one reduction span (call only when REDUCTION_DELAY_S is set)."""
    time.sleep(REDUCTION_DELAY_S)


def active() -> dict[str, float]:
    """The hooks that are on, for a report's environment: a measurement made with one is not a real one."""
    hooks = {DELAY_REDUCTION_VARIABLE: REDUCTION_DELAY_S * 1e3} if REDUCTION_DELAY_S else {}
    if SWEEP_POINT_DELAY_S:
        hooks[SWEEP_POINT_DELAY_VARIABLE] = SWEEP_POINT_DELAY_S * 1e3
    return hooks
