"""What a report records about where it was made."""

from __future__ import annotations

import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

import ficoco


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


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
    """Versions, device, driver, CPU, threads and the git commit."""
    env: dict[str, Any] = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "ficoco": ficoco.__version__,
        "torch": torch.__version__,
        "transformers": _version("transformers"),
        "bitsandbytes": _version("bitsandbytes"),
        "accelerate": _version("accelerate"),
        "device_kind": device.type,
        "cpu": _cpu_model(),
        # The best vector ISA torch dispatches to here (AVX2, AVX512, AMX-capable ...): it
        # decides which dtype is fast, so a timing means little without it.
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu_count": __import__("os").cpu_count(),
        "threads": torch.get_num_threads(),
        "git_commit": git_commit(),
    }
    if device.type == "cuda":
        env.update({
            "device": torch.cuda.get_device_name(device),
            "cuda": torch.version.cuda,
            "driver": nvidia_driver(),
            "device_memory_bytes": torch.cuda.get_device_properties(device).total_memory,
        })
    else:
        env["device"] = env["cpu"]
    return env
