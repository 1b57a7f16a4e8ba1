"""The host settings a profile measures under: two libraries under torch keep state between forwards
that decides how fast the next forward runs, and left at their defaults that state depends on what ran
before (measured on the project's 2-core AMX Xeon, bf16, Qwen3-VL-30B-A3B at 48 decoder layers with 4
distinct, one process: vanilla 8.4-9.1 s, then FiCoCo-L 10.9-11.6 s, then vanilla again 10.1-10.3 s).

- **oneDNN's primitive cache.** On a CPU torch runs a bf16 matmul through oneDNN, which compiles a
  primitive per shape (about 1.4 ms each here) and keeps the last 1,024. A sparse decoder layer's experts
  run one matmul per expert at its row count (transformers' grouped_mm on CPU): one prefill of the 30B
  meets more than a thousand shapes, a schedule that shortens the sequence layer by layer (FiCoCo-L) more,
  and the cache then evicts within a forward what the next needs: FiCoCo-L's prefill ran slower than
  vanilla's. ficoco sets `ONEDNN_PRIMITIVE_CACHE_CAPACITY` (unless the user did) before the process's
  first matmul; oneDNN reads it once, when it first caches a primitive.
- **glibc's malloc.** torch allocates a CPU tensor with the C allocator and frees it at once. glibc gives
  free memory at the top of its heap back to the system past a threshold it moves by itself, and serves
  a block above another moving threshold from fresh pages, so the pages a forward touches first fault
  again (a first touch costs ~1.5 ns a byte on this VM), and how many depends on what the process
  allocated before: vanilla faulted 1.5 GB a prefill, 2.9 GB after a FiCoCo-L row had run. ficoco fixes
  both thresholds (`mallopt`): freed memory stays with the process between the forwards of a row, as a
  serving process keeps it (PyTorch's CPU guides use jemalloc or tcmalloc for the same reason), and goes
  back between rows (`release_host_memory`), so each row's peak memory is its own. With both settings the
  same sequence ran 8.6, 7.8 (FiCoCo-L) and 8.5 s, with no page faults left in vanilla's timed runs.

Neither changes what is computed. A process whose C library is not glibc (macOS, musl) keeps its
allocator as it is, and says so.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
from typing import Any

ONEDNN_CACHE_VARIABLE = "ONEDNN_PRIMITIVE_CACHE_CAPACITY"
# Primitives oneDNN keeps (its default: 1,024): the 30B's prefill meets ~1,300 matmul shapes (row counts 1 to
# 636 at two expert widths, the dense layers' and the tower's), FiCoCo-L's more; each primitive holds a few kB.
ONEDNN_CACHE_CAPACITY = 16384
# mallopt's parameters (malloc.h).
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
# Free memory glibc may keep at its heap's top (mallopt takes a C int): more than a 2026 backbone's prefill
# frees between two forwards at the profiled shapes.
TRIM_THRESHOLD_BYTES = (1 << 31) - 1
# Blocks from this size up come from their own mapping (fresh pages every time); 32 MiB is the most glibc
# allows on 64 bits, and fixing it stops glibc from moving it as blocks are freed.
MMAP_THRESHOLD_BYTES = 32 << 20

_settings: dict[str, Any] = {}


@functools.lru_cache(maxsize=1)
def _glibc() -> Any:
    """The process's C library where it is glibc (it has mallopt and malloc_trim), else None."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        # gnu_get_libc_version exists in glibc alone: musl has a mallopt that does nothing.
        return libc if all(hasattr(libc, name) for name in ("gnu_get_libc_version", "mallopt", "malloc_trim")) \
            else None
    except (OSError, AttributeError):
        return None


def steady_host_runtime() -> dict[str, Any]:
    """Set oneDNN's primitive cache (unless the environment already sets it) and glibc's two thresholds,
    once per process; returns what the process runs with (`host_runtime`)."""
    if not _settings:
        given = os.environ.get(ONEDNN_CACHE_VARIABLE)
        if given is None:
            os.environ[ONEDNN_CACHE_VARIABLE] = str(ONEDNN_CACHE_CAPACITY)
        libc = _glibc()
        malloc = "not glibc: the C allocator as it is"
        if libc is not None:
            kept = libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
            mapped = libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
            malloc = ("glibc: freed memory kept within a row (trim threshold 2 GiB), given back between rows; "
                      "blocks from 32 MiB mapped" if kept and mapped else "glibc: mallopt refused, as it is")
        capacity = os.environ[ONEDNN_CACHE_VARIABLE]
        _settings.update({
            "onednn_primitive_cache": int(capacity) if capacity.isdigit() else capacity,
            "onednn_primitive_cache_set_by": "ficoco" if given is None else "the environment",
            "malloc": malloc,
        })
    return host_runtime()


def host_runtime() -> dict[str, Any]:
    """What `steady_host_runtime` set in this process ({} before it ran)."""
    return dict(_settings)


def release_host_memory() -> None:
    """Give the heap's free pages back to the system (glibc's malloc_trim), so that the next row's peak
    resident memory starts from what is alive, not from what an earlier row freed."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


def page_faults() -> tuple[int, int] | None:
    """The process's page faults so far, (minor, major), where the system counts them (getrusage; None on
    Windows). A minor fault maps a page the process touches first (fresh memory); a major one reads a page
    back from disk (memory the system took away under pressure): a timed run that faults many pages pays for
    them in its time, which no rate probe sees."""
    try:
        import resource
    except ImportError:
        return None
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_minflt, usage.ru_majflt
