"""Decode measured inside `generate()`: time to first token, per-token decode latency, total.

A stopping criterion that never stops reads the clock each time generate() has chosen a token
(after the device has finished it). With t0 taken just before generate() is called and t_k
after the k-th new token:

    time to first token  TTFT = t_1 - t0      (encoding the images, the prefill, the first token)
    decode step k             = t_k - t_{k-1}  (k = 2..N: one forward over the cache each)
    total                     = t_N - t0 = TTFT + the N - 1 decode steps

Throughput counts what the FiCoCo paper's throughput table counts, answering with decoding
included: images/s = batch / total (one image, or video, per sample), tokens/s = batch * N /
total (new tokens only). On a GPU the criterion synchronises the device once per token;
generate() itself waits for every token already (its stopping check reads the device), so this
adds no wait that an untimed generate() does not have.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ficoco.profiling.rows import DecodeFigures


@dataclass(frozen=True)
class DecodeRun:
    """Clock readings of one generate() call, in milliseconds from its start."""

    token_ms: tuple[float, ...]  # t_k - t0 for every new token k = 1..N
    wall_ms: float  # until generate() returned (its output built)

    @property
    def ttft_ms(self) -> float:
        return self.token_ms[0]

    @property
    def steps_ms(self) -> tuple[float, ...]:
        return tuple(b - a for a, b in zip(self.token_ms, self.token_ms[1:], strict=False))

    @property
    def total_ms(self) -> float:
        return self.token_ms[-1]


class TokenClock:
    """A transformers stopping criterion that stops nothing and reads the clock per new token."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.start = 0.0
        self.readings: list[float] = []

    def reset(self) -> None:
        self.readings = []
        self.start = time.perf_counter()

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.readings.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def timed_generate(generate: Callable[..., Any], device: torch.device, **kwargs: Any) -> tuple[Any, DecodeRun]:
    """Call `generate(**kwargs, stopping_criteria=...)` once; its output and its clock readings."""
    from transformers import StoppingCriteriaList

    clock = TokenClock(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    clock.reset()
    out = generate(**kwargs, stopping_criteria=StoppingCriteriaList([clock]))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    end = time.perf_counter()
    if not clock.readings:
        raise RuntimeError("generate() produced no token")
    return out, DecodeRun(tuple((t - clock.start) * 1e3 for t in clock.readings), (end - clock.start) * 1e3)


def _p90(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[max(0, -(-9 * len(ordered) // 10) - 1)]  # nearest rank, as LatencyStats


def _stats(values: list[float]) -> dict[str, Any]:
    return {"median_ms": statistics.median(values), "p90_ms": _p90(values), "min_ms": min(values),
            "samples_ms": values}


def decode_metrics(runs: list[DecodeRun], batch: int, prefill_ms: float) -> DecodeFigures:
    """The report's decode figures from the timed generate() runs (see the module docstring).

    Per-token decode latency pools the steps of every run (median and p90 over the generated
    tokens); TTFT and total are medians over runs; throughputs follow the median total.
    `prefill_ms` is the row's prefill latency (a forward alone), shown beside TTFT."""
    new_tokens = len(runs[0].token_ms)
    totals = [r.total_ms for r in runs]
    steps = [s for r in runs for s in r.steps_ms]
    total_s = statistics.median(totals) / 1e3
    decode = _stats(steps) if steps else None
    return DecodeFigures(
        new_tokens=new_tokens, prefill_ms=prefill_ms, ttft=_stats([r.ttft_ms for r in runs]),
        decode_per_token=decode, total=_stats(totals), generate_wall=_stats([r.wall_ms for r in runs]),
        images_per_s=batch / total_s, tokens_per_s=batch * new_tokens / total_s,
        decode_tokens_per_s=batch / (decode["median_ms"] / 1e3) if decode else None)
