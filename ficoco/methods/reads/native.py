"""ficoco's fused CPU read kernel (softmax_sums.c): built with the machine's C compiler at first use, loaded
with ctypes, and used by ficoco.methods.reads.ops for the column and row sums (and a row's head-max) a method
reads on a CPU.

Why a kernel of our own: a read in torch makes a pass over the whole block of scores per op (scale,
softmax, a float32 copy, the sum), about 2.5 times the cost of the layer's own fused attention (SDPA) at
the same shape; the kernel makes those steps on one row at a time, with the same roundings, at about 1.3
times SDPA's cost. Its float32 steps (exp, the order of the softmax's sum) are its own, so about one
probability in 10^5 rounds to the neighbouring bfloat16 value; each thread sums its rows in float32 (as
torch sums a block) and those sums are added in double precision.

It is built once per source and machine into ``$FICOCO_CACHE_DIR/kernels`` (default
``~/.cache/ficoco/kernels``) with ``cc -O3 -march=native -fopenmp``, linked against the OpenMP runtime torch
has loaded (one pool of threads for both). Where there is no C compiler, or ``FICOCO_READ_KERNEL=torch``,
reads run in torch as before; `status()` says which and why, and profiles record it.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

SOURCE = Path(__file__).with_name("softmax_sums.c")
ABI = 3  # 2: the head-max rows (ficoco_rowmax_*); 3: the fused softmax of a layer's output (ficoco_attend_*)
ENV = "FICOCO_READ_KERNEL"  # "torch": never use the kernel; "triton": the Triton reads; "native"/unset: where it builds
# -march=native: the vector width and instructions of the machine it runs on (hence a library per processor);
# on x86, AVX-512's full width where the processor has it (compilers default to half of it).
# -fno-trapping-math: the softmax's exp has selects (a clamp, a zero scale) the compiler may only turn into vector
# blends where no floating-point exception is observed (nothing here reads one); with traps it kept the loop scalar,
# 3 ns a probability against 0.4 on a 2-core AVX2 EPYC.
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-fno-trapping-math",
         *(("-mprefer-vector-width=512",) if platform.machine() in ("x86_64", "AMD64") else ()))


@dataclass(frozen=True)
class KernelStatus:
    """Which read kernel runs on a CPU: ``"native"`` (this module's) or ``"torch"``, and why."""

    kernel: str
    reason: str


# The kernel as loaded, per value of FICOCO_READ_KERNEL (a test or a benchmark may switch between the two).
_LOADED: dict[str, tuple[ctypes.CDLL | None, KernelStatus]] = {}


def _cpu_key() -> str:
    """What -march=native compiles for: the processor's model and flags (a cache shared between machines keeps
    one library per processor)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    model = next((line for line in text.splitlines() if line.startswith("model name")), "")
    flags = next((line for line in text.splitlines() if line.startswith("flags")), "")
    return model + "|" + flags


def _openmp_runtime() -> str | None:
    """The path of the OpenMP runtime this process has loaded (torch's), so that the kernel links that one."""
    try:
        maps = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return None
    for line in maps:
        path = line.split()[-1] if line.split() else ""
        name = os.path.basename(path)
        if name.startswith(("libgomp", "libiomp5", "libomp")) and ".so" in name:
            return path
    return None


def cache_dir() -> Path:
    root = os.environ.get("FICOCO_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "ficoco")
    return Path(root) / "kernels"


def _build(target: Path, runtime: str | None) -> None:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if compiler is None:
        raise OSError("no C compiler (cc, gcc or clang) on PATH")
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build into a temporary name and rename: parallel workers may build the same library at once.
    handle, temporary = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(handle)
    objects = temporary[:-3] + ".o"
    # Compiled with OpenMP's pragmas, linked to the runtime torch loaded (by its path, so that the library needs
    # that runtime's name and shares its threads), or to the compiler's own where torch has none loaded.
    compile_command = [compiler, *FLAGS, "-c", "-o", objects, str(SOURCE)]
    link_command = [compiler, "-shared", "-o", temporary, objects, *([runtime] if runtime else ["-fopenmp"])]
    try:
        for command in (compile_command, link_command):
            done = subprocess.run(command, capture_output=True, text=True, timeout=120)
            if done.returncode != 0:
                raise OSError(f"{os.path.basename(compiler)} failed: {done.stderr.strip().splitlines()[-1:]}")
        os.replace(temporary, target)
    finally:
        for path in (temporary, objects):
            if os.path.exists(path):
                os.unlink(path)


def _load() -> tuple[ctypes.CDLL | None, KernelStatus]:
    if _setting() == "torch":
        return None, KernelStatus("torch", f"{ENV}=torch")
    if platform.system() != "Linux":
        return None, KernelStatus("torch", f"the native read kernel is built on Linux only, not {platform.system()}")
    import torch  # noqa: F401 (its OpenMP runtime must be loaded before the kernel links to it)

    runtime = _openmp_runtime()
    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join(FLAGS).encode() + _cpu_key().encode()
                            + (os.path.basename(runtime or "")).encode()).hexdigest()[:16]
    target = cache_dir() / f"reads-{digest}.so"
    try:
        if not target.exists():
            _build(target, runtime)
        library = ctypes.CDLL(str(target))
        if library.ficoco_reads_abi() != ABI:
            raise OSError(f"{target} is of another interface")
    except (OSError, subprocess.SubprocessError) as exc:
        return None, KernelStatus("torch", f"the native read kernel did not build or load: {exc}")
    i64, f32, ptr, c_int = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p, ctypes.c_int
    for name in ("ficoco_colsum_bf16", "ficoco_colsum_f32"):
        getattr(library, name).argtypes = [ptr, i64, i64, f32, ptr, ptr, c_int]
        getattr(library, name).restype = None
    for name in ("ficoco_rowsum_bf16", "ficoco_rowsum_f32", "ficoco_rowmax_bf16", "ficoco_rowmax_f32"):
        getattr(library, name).argtypes = [ptr, i64, i64, i64, i64, f32, ptr, ptr, c_int]
        getattr(library, name).restype = None
    for name in ("ficoco_attend_bf16", "ficoco_attend_f32"):
        getattr(library, name).argtypes = [ptr, i64, i64, i64, i64, f32, ptr, ptr, i64, i64, c_int, c_int]
        getattr(library, name).restype = None
    return library, KernelStatus("native", f"built with {' '.join(FLAGS)} in {target.parent}"
                                          + (f", linked to {os.path.basename(runtime)}" if runtime else ""))


def _setting() -> str:
    return os.environ.get(ENV, "").strip().lower()


def setting() -> str:
    """FICOCO_READ_KERNEL as the reads see it: "torch" (never a kernel of ficoco's), "triton" (the Triton kernels,
    also on the CPU under Triton's interpreter: the tests), "native" or "" (the native kernel on a CPU, Triton on a
    GPU where it is installed)."""
    return _setting()


def library() -> ctypes.CDLL | None:
    """The loaded kernel, or None where reads run in torch (`status()` says why). Built at the first call."""
    setting = _setting()
    if setting not in _LOADED:
        _LOADED[setting] = _load()
    return _LOADED[setting][0]


def status() -> KernelStatus:
    """Which kernel a CPU read runs, and why (builds the kernel when it has not been tried)."""
    library()
    return _LOADED[_setting()][1]
