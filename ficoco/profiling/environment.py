"""What a report records about where it was made."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

import ficoco
from ficoco import testing_hooks
from ficoco.machine.host_runtime import host_runtime
from ficoco.versions import environment_versions


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# The /proc/cpuinfo flags that decide which dtype and kernels are fast on a CPU: AMX tiles and
# AVX512-BF16 make bf16 matrix work fast; without them bf16 falls back to slow paths, and AVX2
# alone is several times slower again. Two CPUs that differ in these time differently.
CPU_FEATURES = ("amx_bf16", "amx_tile", "avx512_bf16", "avx512f", "avx2")
# Environment variables that cap the vector ISA torch and oneDNN use below what the CPU has
# (as one emulates a smaller CPU): a report made under them times like another processor.
ISA_OVERRIDES = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")


def cpu_features(cpuinfo: str | Path = "/proc/cpuinfo") -> dict[str, bool]:
    """Which of CPU_FEATURES this CPU has, from the first `flags` line of `cpuinfo`; empty when
    that cannot be read (not Linux), which callers must treat as unknown, not as "none"."""
    try:
        with open(cpuinfo) as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return {name: name in flags for name in CPU_FEATURES}
    except OSError:
        pass
    return {}


def isa_overrides() -> dict[str, str]:
    """The ISA-capping environment variables that are set, with their values."""
    return {name: os.environ[name] for name in ISA_OVERRIDES if os.environ.get(name)}


def git_commit() -> str | None:
    """The project's commit when it runs from a git checkout (with "+dirty" for local edits)."""
    root = Path(ficoco.__file__).resolve().parent.parent
    try:
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=5, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=5, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return commit + ("+dirty" if dirty else "")


def nvidia_driver() -> str | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            version = pynvml.nvmlSystemGetDriverVersion()
            return version.decode() if isinstance(version, bytes) else str(version)
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no NVML, no driver: the field stays empty
        return None


def environment(device: torch.device) -> dict[str, Any]:
    """Versions, device (the GPU's name on CUDA), driver, CPU model and features, threads and the git commit."""
    env: dict[str, Any] = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "ficoco": ficoco.__version__,
        # torch, transformers, accelerate, hqq and bitsandbytes, their tested ranges and any outside them.
        **environment_versions(),
        "torch": torch.__version__,
        "device_kind": device.type,
        "cpu": _cpu_model(),
        # The best vector ISA torch dispatches to here (AVX2, AVX512, AMX-capable ...): it
        # decides which dtype is fast, so a timing means little without it.
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        # What the CPU itself offers, and any cap put on it: `ficoco compare` judges timings only
        # between reports whose processors agree on these.
        "cpu_flags": cpu_features(),
        "cpu_isa_overrides": isa_overrides(),
        "cpu_count": os.cpu_count(),
        "threads": torch.get_num_threads(),
        # oneDNN's primitive cache and glibc's thresholds, set before the first matmul (machine/host_runtime.py).
        "host_runtime": host_runtime(),
        "git_commit": git_commit(),
    }
    if testing_hooks.active():
        env["test_hooks"] = testing_hooks.active()
    if device.type == "cuda":
        env.update({
            "device": torch.cuda.get_device_name(device),
            "cuda": torch.version.cuda,
            "driver": nvidia_driver(),
            "device_memory_bytes": torch.cuda.get_device_properties(device).total_memory,
        })
        env["read_kernel"] = {"kernel": "torch", "reason": "a method's reads on CUDA run in torch"}
    else:
        env["device"] = env["cpu"]
        # What computed the methods' reads of attention (ficoco.methods.reads.native): ficoco's fused CPU kernel,
        # or torch (and why), as their probe times depend on it.
        from ficoco.methods.reads import native

        status = native.status()
        env["read_kernel"] = {"kernel": status.kernel, "reason": status.reason}
    return env
