"""Measurement: one tracker, one job. Trackers time and weigh callables; they know nothing of
the method (optimum-benchmark's habit)."""

from __future__ import annotations

import gc
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from ficoco.models import hf_compat as hf


@dataclass(frozen=True)
class LatencyStats:
    """Wall times of repeated runs after warm-up, in milliseconds."""

    samples_ms: tuple[float, ...]
    timer: str
    warmup_ms: tuple[float, ...] = ()  # the warm-up runs' wall times (perf_counter, synchronised)

    @property
    def median_ms(self) -> float:
        return statistics.median(self.samples_ms)

    @property
    def p90_ms(self) -> float:
        ordered = sorted(self.samples_ms)
        # Nearest-rank 90th percentile: honest for the handful of samples a prefill allows.
        return ordered[max(0, -(-9 * len(ordered) // 10) - 1)]

    @property
    def min_ms(self) -> float:
        return min(self.samples_ms)

    @property
    def stdev_ms(self) -> float:
        return statistics.stdev(self.samples_ms) if len(self.samples_ms) > 1 else 0.0

    def to_json(self) -> dict[str, Any]:
        return {"median_ms": self.median_ms, "p90_ms": self.p90_ms, "min_ms": self.min_ms, "stdev_ms": self.stdev_ms,
                "samples_ms": list(self.samples_ms), "timer": self.timer, "warmup_ms": list(self.warmup_ms)}


# Told when a run starts (seconds None) and when it ends: ("warm-up" | "timed run", k, n, seconds).
RunHook = Callable[[str, int, int, float | None], None]


class LatencyTracker:
    """CUDA events (synchronised) on GPU, `perf_counter` on CPU."""

    def __init__(self, device: torch.device, per_device: bool = False) -> None:
        self.device = device
        # Under a device map: every GPU's allocator peak and the process's (weights offloaded to CPU
        # memory), in `peak_bytes_per_device`.
        self.per_device = per_device

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def measure(self, fn: Callable[[], Any], *, warmup: int, repeat: int,
                after_each: Callable[[int], None] | None = None, on_run: RunHook | None = None,
                choose: Callable[[float], tuple[int, int]] | None = None) -> LatencyStats:
        """Run `fn` warmup + repeat times; `after_each(k)` sees every timed run's index.

        `choose(seconds)` is asked once, after the first run, for the (warm-up, timed) counts that
        this run's duration calls for; a first run that was timed becomes the warm-up when the new
        counts want one (it ran cold). `on_run` is told when every run starts and ends."""
        warmup_ms: list[float] = []
        samples: list[float] = []
        first = True
        while len(warmup_ms) < warmup or len(samples) < repeat:
            timed = len(warmup_ms) >= warmup
            phase, k, n = ("timed run", len(samples) + 1, repeat) if timed else ("warm-up", len(warmup_ms) + 1, warmup)
            if on_run:
                on_run(phase, k, n, None)
            sample_ms, wall_ms = self._run(fn, timed)
            if first and choose is not None:
                warmup, repeat = choose(wall_ms / 1e3)
                if timed and warmup > 0:
                    timed = False
            first = False
            if timed:
                samples.append(sample_ms)
                if after_each:
                    after_each(len(samples) - 1)
            else:
                warmup_ms.append(wall_ms)
            if on_run:
                on_run(phase, k, n, wall_ms / 1e3)
        return LatencyStats(tuple(samples), "cuda-events" if self.device.type == "cuda" else "perf_counter",
                            tuple(warmup_ms))

    def _run(self, fn: Callable[[], Any], timed: bool) -> tuple[float, float]:
        """(the sample, the synchronised wall time) of one run, in milliseconds."""
        if self.device.type == "cuda" and timed:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(self.device)
            begin = time.perf_counter()
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize(self.device)
            return start.elapsed_time(end), (time.perf_counter() - begin) * 1e3
        self._synchronize()
        begin = time.perf_counter()
        fn()
        self._synchronize()
        wall_ms = (time.perf_counter() - begin) * 1e3
        return wall_ms, wall_ms


def _proc_status_bytes(key: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _reset_cpu_peak() -> bool:
    """Linux resets the peak resident set (VmHWM) when "5" is written to clear_refs."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


@dataclass
class MemoryReading:
    """Peak memory of one measured block."""

    device: str
    values: dict[str, int | None] = field(default_factory=dict)
    method: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"method": self.method, **self.values}


class _NvmlSampler(threading.Thread):
    """Polls the device's used memory (NVML) while a block runs and keeps the highest value.

    NVML sees the whole device (other processes and the CUDA context included) and has no
    peak counter of its own, so one reading after the run would miss the peak."""

    def __init__(self, device: torch.device, interval_s: float = 0.01) -> None:
        super().__init__(daemon=True)
        self.device, self.interval_s = device, interval_s
        self.peak: int | None = None
        self._stop_event = threading.Event()

    def run(self) -> None:
        while True:
            used = nvml_used_bytes(self.device)
            if used is None:
                return
            self.peak = used if self.peak is None else max(self.peak, used)
            if self._stop_event.wait(self.interval_s):
                return

    def stop(self) -> int | None:
        self._stop_event.set()
        self.join()
        return self.peak


class MemoryTracker:
    """Peak memory of a block: CUDA allocator peaks and NVML's device-wide peak (sampled) on
    GPU; the process's peak resident set on CPU. Both start from a clean slate: garbage is
    collected and the allocator's cached blocks returned before the peak is reset, so earlier
    rows and the build do not leak in."""

    def __init__(self, device: torch.device, per_device: bool = False) -> None:
        self.device = device
        # Under a device map: every GPU's allocator peak and the process's (weights offloaded to CPU
        # memory), in `peak_bytes_per_device`.
        self.per_device = per_device

    @contextmanager
    def track(self) -> Iterator[MemoryReading]:
        reading = MemoryReading(device=self.device.type)
        if self.device.type == "cuda":
            # Cyclic garbage can hold device tensors until collected; on CPU the row's own
            # cleanup (release_device_cache) has collected already.
            gc.collect()
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
            gpus = range(torch.cuda.device_count()) if self.per_device else ()
            for index in gpus:
                torch.cuda.reset_peak_memory_stats(index)
            if self.per_device:
                _reset_cpu_peak()
            before = nvml_used_bytes(self.device)
            sampler = _NvmlSampler(self.device)
            sampler.start()
            try:
                yield reading
                torch.cuda.synchronize(self.device)
            finally:
                nvml_peak = sampler.stop()
            reading.values = {
                "cuda_max_allocated_bytes": torch.cuda.max_memory_allocated(self.device),
                "cuda_max_reserved_bytes": torch.cuda.max_memory_reserved(self.device),
                "nvml_used_before_bytes": before,
                "nvml_peak_used_bytes": nvml_peak,
                # kept under its old name for reports made before the sampler
                "nvml_used_bytes": nvml_peak,
            }
            reading.method = ("torch.cuda max_memory_allocated/reserved (reset after empty_cache); NVML device "
                              "used memory sampled every 10 ms (device-wide: other processes included)")
            reading.values["peak_bytes"] = reading.values["cuda_max_allocated_bytes"]
            if self.per_device:
                for index in gpus:
                    torch.cuda.synchronize(index)
                reading.values["peak_bytes_per_device"] = {
                    **{f"cuda:{index}": torch.cuda.max_memory_allocated(index) for index in gpus},
                    "cpu": _proc_status_bytes("VmHWM")}
                reading.values["nvml_used_bytes_per_device"] = {
                    f"cuda:{index}": nvml_used_bytes(torch.device("cuda", index)) for index in gpus}
        else:
            reset = _reset_cpu_peak()
            yield reading
            peak = _proc_status_bytes("VmHWM")
            reading.values = {"peak_rss_bytes": peak, "peak_bytes": peak}
            if self.per_device:
                reading.values["peak_bytes_per_device"] = {"cpu": peak}
            reading.method = ("process peak RSS (VmHWM), reset via /proc/self/clear_refs before the row" if reset else
                              "process peak RSS (VmHWM) since start: could not reset, rows may include earlier peaks")


def nvml_used_bytes(device: torch.device) -> int | None:
    """Device-wide used memory from NVML, None where NVML is unavailable.

    torch.cuda.device_memory_used maps torch's device index to NVML's through
    CUDA_VISIBLE_DEVICES (and MIG instances); NVML's own index would name another GPU there."""
    try:
        return int(torch.cuda.device_memory_used(device))
    except Exception:  # NVML missing or not permitted: the figure is simply absent
        return None


def nvml_visible_gpus() -> int:
    """GPUs the driver (NVML) reports, whether or not torch can use them."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            return int(pynvml.nvmlDeviceGetCount())
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no driver, no NVML
        return 0


def cache_bytes(cache: Any) -> int:
    """Bytes held by a transformers cache: every tensor its layers hold, also inside the tuples
    and dicts a quantized cache keeps (codes, scales, zero points) and its unquantized residual
    window; a storage shared by two attributes counts once."""
    seen: set[tuple[int, int]] = set()

    def walk(value: Any) -> int:
        if isinstance(value, torch.Tensor):
            key = (value.data_ptr(), value.numel())
            if key in seen:
                return 0
            seen.add(key)
            return value.numel() * value.element_size()
        if isinstance(value, (tuple, list)):
            return sum(walk(v) for v in value)
        if isinstance(value, dict):
            return sum(walk(v) for v in value.values())
        return 0

    return sum(walk(list(vars(layer).values())) for layer in hf.cache_layers(cache))


def cache_bytes_per_layer(cache: Any) -> list[int]:
    """`cache_bytes`, decoder layer by decoder layer."""
    return [cache_bytes(_OneLayer(layer)) for layer in hf.cache_layers(cache)]


class _OneLayer:
    """A cache of one layer, for `cache_bytes` (which walks `hf.cache_layers`)."""

    def __init__(self, layer: Any) -> None:
        self.layers = [layer]


def cache_tokens(cache: Any) -> list[int]:
    """Tokens every decoder layer of a transformers cache holds (a quantized layer counts its
    quantized and residual tokens: `cumulative_length`)."""
    return [hf.cache_layer_tokens(layer) for layer in hf.cache_layers(cache)]


def _quant_state_tensors(quant_state: Any) -> list[torch.Tensor]:
    """The tensors of a bitsandbytes 4-bit QuantState (absmax, code book, nested statistics)."""
    if quant_state is None:
        return []
    found = [getattr(quant_state, name, None) for name in ("absmax", "code", "offset")]
    nested = getattr(quant_state, "state2", None)
    if nested is not None:
        found += _quant_state_tensors(nested)
    return [t for t in found if isinstance(t, torch.Tensor)]


def model_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes the built model holds: parameters, buffers and bitsandbytes' quantization state
    (INT8 row scales, NF4 block absmax and code book), each storage counted once (tied
    weights share one)."""
    seen: set[tuple[int, int]] = set()
    total = 0

    def add(tensor: torch.Tensor | None) -> None:
        nonlocal total
        if not isinstance(tensor, torch.Tensor) or tensor.device.type == "meta":
            return
        key = (tensor.data_ptr(), tensor.numel())
        if key in seen:
            return
        seen.add(key)
        total += tensor.numel() * tensor.element_size()

    for param in model.parameters():
        add(param)
        add(getattr(param, "SCB", None))
        for tensor in _quant_state_tensors(getattr(param, "quant_state", None)):
            add(tensor)
    for module in model.modules():
        # LLM.int8 moves the row scales from the weight to the layer's state at its first forward.
        add(getattr(getattr(module, "state", None), "SCB", None))
    for buffer in model.buffers():
        add(buffer)
    return total
