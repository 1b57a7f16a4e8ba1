"""How fast this machine multiplies matrices, per dtype, measured rather than assumed.

CPUs differ from one machine to the next: with AMX a 2-core VM multiplies bf16 at ~500
GFLOP/s and fp32 at ~125; with AVX2 alone bf16 runs at ~20, fp16 at ~25 and fp32 at ~100.
Which dtype is fast, and how long a prefill will take, follows from a short calibration
(a few small matmuls, well under a second on any of them), cached per process.
"""

from __future__ import annotations

import functools
import time

import torch

# (rows, inner, columns) of the calibration matmul: the decoder's projection shapes at a few
# hundred tokens, small enough that a slow 16-bit path on an AVX2 CPU still takes ~0.1 s.
_SMALL = (128, 1024, 1024)
_LARGE = (512, 2048, 2048)
# Above this rate the small matmul is too short to time well, so the large one is timed.
_FAST_FLOPS_PER_S = 20e9


def cpu_flags() -> set[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _time_matmul(shape: tuple[int, int, int], dtype: torch.dtype, device: torch.device) -> float:
    rows, inner, columns = shape
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(rows, inner, generator=generator).to(device=device, dtype=dtype)
    b = torch.randn(inner, columns, generator=generator).to(device=device, dtype=dtype)
    torch.matmul(a, b)  # first call: kernel selection, allocation
    best = float("inf")
    for _ in range(3):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        begin = time.perf_counter()
        torch.matmul(a, b)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - begin)
    return 2 * rows * inner * columns / best


@functools.cache
def _rate(dtype: torch.dtype, device_type: str, threads: int) -> float:
    device = torch.device(device_type)
    rate = _time_matmul(_SMALL, dtype, device)
    if rate > _FAST_FLOPS_PER_S:
        rate = _time_matmul(_LARGE, dtype, device)
    return rate


def matmul_flops_per_s(dtype: torch.dtype, device: torch.device | str = "cpu") -> float:
    """Measured matmul throughput (FLOP/s, 2 per multiply-add) of `dtype` on `device` with the
    current thread count; measured once per process."""
    device = torch.device(device)
    return _rate(dtype, device.type, torch.get_num_threads())
