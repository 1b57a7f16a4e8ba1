"""Time spans inside a forward pass without synchronising the device.

On CUDA each span records a pair of events into the stream; nothing waits for them until the
totals are read, after the caller's own final synchronise. Synchronising per span (as a
perf_counter timer must on a GPU) would stall the launch queue in every reducing layer and
bias the reduced variants' latency against vanilla. On CPU spans are timed with perf_counter.

Spans are exclusive: a span opened inside another (a method's attention read inside its reduction
step) pauses the outer one, so that every moment is counted in one span and the spans add up.
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
        # The spans open now, innermost last: (name, device, the start of its running segment).
        self._open: list[list] = []

    def reset(self) -> None:
        self._events.clear()
        self._seconds.clear()

    @staticmethod
    def _mark(device: torch.device) -> object:
        if device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _close(self, frame: list) -> None:
        """End the running segment of an open span (it resumes with `_resume`)."""
        name, device, start = frame
        end = self._mark(device)
        if device.type == "cuda":
            self._events[name].append((start, end))  # type: ignore[arg-type]
        else:
            self._seconds[name] += end - start  # type: ignore[operator]

    def _resume(self, frame: list) -> None:
        frame[2] = self._mark(frame[1])

    @contextmanager
    def span(self, name: str, device: torch.device) -> Iterator[None]:
        if self._open:
            self._close(self._open[-1])  # the outer span pauses while this one runs
        frame = [name, device, self._mark(device)]
        self._open.append(frame)
        try:
            yield
        finally:
            self._close(frame)
            self._open.pop()
            if self._open:
                self._resume(self._open[-1])

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
