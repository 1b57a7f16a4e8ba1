"""How many warm-up and timed runs a row gets when --warmup/--repeat are not given.

The count follows the cost, in the spirit of timeit's autorange and pytest-benchmark's
max-time: as many timed runs as fit a time budget (at least one, at most ten), and a warm-up
unless one run takes over a minute. A millisecond prefill on a GPU gets 3 + 10 runs; a
27 s prefill on a CPU gets 1 + 1; a prefill of several minutes gets one timed run and no
warm-up, whose job (kernel selection, allocator growth, first-touch page faults) is then a
small share of the run. The rule is applied to the estimated prefill before a row starts and
again to the first run measured, so a wrong estimate does not multiply a slow run.
"""

from __future__ import annotations

# Most (warm-up, timed) runs per row. A GPU's first runs pay for kernel selection and
# allocator growth, so it gets more warm-ups; a CPU's one warm-up absorbs its first-call costs.
MAX_RUNS = {"cuda": (3, 10), "cpu": (1, 10)}
TIMED_BUDGET_S = 30.0  # timed runs per row: as many as fit in this (at least one)
WARMUP_BUDGET_S = 60.0  # warm-ups per row: as many as fit in this (so none when one run takes over a minute)


def max_runs(device_type: str) -> tuple[int, int]:
    """The most (warm-up, timed) runs a row gets on this kind of device."""
    return MAX_RUNS.get(device_type, MAX_RUNS["cpu"])


def choose_runs(run_s: float, device_type: str, warmup: int | None = None,
                repeat: int | None = None) -> tuple[int, int]:
    """(warm-up, timed) runs for a row whose one run takes `run_s` seconds; a given `warmup`
    or `repeat` (the user's option) always wins."""
    most_warmup, most_repeat = max_runs(device_type)
    run_s = max(run_s, 1e-9)
    chosen_warmup = min(most_warmup, int(WARMUP_BUDGET_S // run_s))
    chosen_repeat = max(1, min(most_repeat, int(TIMED_BUDGET_S // run_s)))
    return (chosen_warmup if warmup is None else warmup, chosen_repeat if repeat is None else repeat)


def rule_text(device_type: str) -> str:
    """The rule in words, for the report."""
    most_warmup, most_repeat = max_runs(device_type)
    return (f"time budget: timed runs fill {TIMED_BUDGET_S:g} s (1 to {most_repeat}), warm-ups fill "
            f"{WARMUP_BUDGET_S:g} s (0 to {most_warmup}); from the estimated run, then from the first measured run")
