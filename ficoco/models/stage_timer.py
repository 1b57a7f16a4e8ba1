"""Time spans inside a forward pass without synchronising the device.

On CUDA each span records a pair of events into the stream; nothing waits for them until the
totals are read, after the caller's own final synchronise. Synchronising per span (as a
perf_counter timer must on a GPU) would stall the launch queue in every reducing layer and
bias the reduced variants' latency against vanilla. On CPU spans are timed with perf_counter.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager

import torch


class StageTimer:
    """Named spans, summed per name; `reset()` before a run, `total_ms()` after it."""

    def __init__(self) -> None:
        self._events: dict[str, list[tuple[torch.cuda.Event, torch.cuda.Event]]] = defaultdict(list)
        self._seconds: dict[str, float] = defaultdict(float)

    def reset(self) -> None:
        self._events.clear()
        self._seconds.clear()

    @contextmanager
    def span(self, name: str, device: torch.device) -> Iterator[None]:
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            try:
                yield
            finally:
                end.record()
                self._events[name].append((start, end))
        else:
            begin = time.perf_counter()
            try:
                yield
            finally:
                self._seconds[name] += time.perf_counter() - begin

    def total_ms(self, *names: str) -> float:
        """Milliseconds in the named spans (all names when none is given). On CUDA this waits
        for the last recorded event, so call it after the timed region."""
        wanted = names or tuple(set(self._events) | set(self._seconds))
        total = sum(self._seconds.get(name, 0.0) for name in wanted) * 1e3
        pairs = [pair for name in wanted for pair in self._events.get(name, [])]
        if pairs:
            pairs[-1][1].synchronize()
            total += sum(start.elapsed_time(end) for start, end in pairs)
        return total

    @property
    def span_count(self) -> int:
        return sum(len(v) for v in self._events.values()) + len(self._seconds)
