"""How fast this machine multiplies matrices, per dtype, measured rather than assumed.

CPUs differ from one machine to the next: with AMX a 2-core VM multiplies bf16 at ~500
GFLOP/s and fp32 at ~125; with AVX2 alone bf16 runs at ~20, fp16 at ~25 and fp32 at ~100.
Which dtype is fast, and how long a prefill will take, follows from a short calibration
(a few small matmuls, well under a second on any of them), cached per process.
"""

from __future__ import annotations

import functools
import statistics
import time

import torch

# (rows, inner, columns) of the calibration matmul: the decoder's projection shapes at a few
# hundred tokens, small enough that a slow 16-bit path on an AVX2 CPU still takes ~0.1 s.
_SMALL = (128, 1024, 1024)
_LARGE = (512, 2048, 2048)
# Above this rate the small matmul is too short to time well, so the large one is timed.
_FAST_FLOPS_PER_S = 20e9
# A first call longer than this is timed once more rather than three times.
_LONG_CALL_S = 0.1


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
    synchronize(device)
    begin = time.perf_counter()
    torch.matmul(a, b)  # first call: kernel selection, allocation
    synchronize(device)
    first_s = time.perf_counter() - begin
    # A call this long is timed well by one more (a 16-bit matmul without the CPU's support for it runs at
    # ~1 GFLOP/s: 0.3 s a call); short ones take the best of three.
    best = float("inf")
    for _ in range(1 if first_s > _LONG_CALL_S else 3):
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


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a GPU's; nothing to wait for on a CPU), so a timer reads it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@functools.cache
def small_op_s(dtype: torch.dtype, device_type: str) -> float:
    """The time of one small op (dispatch and Python: what a tiny model's prefill is made of), the
    median over a few blocks of a transformer layer's kinds of op; measured once per process."""
    device = torch.device(device_type)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(64, 64, generator=generator).to(device=device, dtype=dtype)
    w = torch.randn(64, 64, generator=generator).to(device=device, dtype=dtype)

    def block() -> torch.Tensor:
        # The kinds of op a transformer layer dispatches: a small linear, an activation, products,
        # a norm, a softmax, a layout copy.
        y = torch.nn.functional.linear(x, w)
        y = torch.nn.functional.silu(y) * x + x
        y = torch.nn.functional.layer_norm(y, (64,))
        return torch.softmax(y, dim=-1).transpose(0, 1).contiguous()

    ops_per_block, blocks = 8, 25
    # Dispatch is the main thread's work. Timed on one thread, a small op does not wait at an
    # OpenMP barrier for a second thread whose core another process holds: on a shared machine
    # that wait multiplied this probe by up to 300 while a tiny prefill slowed 15-fold.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        block()
        times = []
        for _ in range(5):
            synchronize(device)
            begin = time.perf_counter()
            for _ in range(blocks):
                block()
            synchronize(device)
            times.append((time.perf_counter() - begin) / (blocks * ops_per_block))
    finally:
        torch.set_num_threads(threads)
    # The median, not the best: a prefill meets this machine's typical dispatch cost.
    return statistics.median(times)


@functools.cache
def copy_bytes_per_s(device_type: str, threads: int) -> float:
    """Bytes a 64 MiB copy moves per second (counted once), the best of three; once per process."""
    device = torch.device(device_type)
    source = torch.ones(1 << 25, dtype=torch.bfloat16, device=device)  # 64 MiB
    target = torch.empty_like(source)
    target.copy_(source)
    best = float("inf")
    for _ in range(3):
        synchronize(device)
        begin = time.perf_counter()
        target.copy_(source)
        synchronize(device)
        best = min(best, time.perf_counter() - begin)
    return source.numel() * source.element_size() / best
