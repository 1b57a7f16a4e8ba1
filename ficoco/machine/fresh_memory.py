"""How fast this machine fills memory a process has never touched: what building a model costs.

A model built with random weights (ficoco.models.build) writes every weight into fresh memory: each
4 KiB page faults on its first touch, and the kernel zeroes it before the fill writes it. On a VM whose
kernel reports free memory back to its hypervisor (virtio-balloon free page reporting: firecracker,
cloud-hypervisor, QEMU with `free-page-reporting=on`), memory that has been free a few seconds is handed
back, and its next first touch also faults in the host: on a 2-core AMX VM (24 GB) the first ~4.5 GB a
process filled went at 4.4 GiB/s, every further GiB at 0.6, and a second pass over the same memory, or
one started right after a process freed it, at 4.4 throughout. A fresh machine's build pays the host's
fault on nearly all of its weights; a small probe cannot see that cost (it is served from the memory
the guest still holds), so it is a constant here, applied only where the kernel reports free pages.
"""

from __future__ import annotations

import functools
import glob
import statistics
import time

import torch

from ficoco.machine.compute_rate import synchronize

# The host's share of a first touch of memory it has handed back, beyond the guest's own fault and
# fill: seconds per byte. Measured on a 2-core AMX VM (firecracker, 24 GB, free page reporting on),
# quiet: llava-1.5-7b's 14.2 GB of bf16 weights took 23.7 s to fill (two fresh processes, 1 min apart)
# where this module's probe filled at 4.7 GB/s (3.0 s of it): (23.7 - 3.0) s / 14.2 GB.
HOST_FIRST_TOUCH_S_PER_BYTE = 1.46e-9
# virtio's feature bit of a balloon that reports free pages (VIRTIO_BALLOON_F_REPORTING).
_BALLOON_REPORTING_BIT = 5
_PROBE_VALUES = 1 << 25  # 64 MiB of bfloat16
_POOL_VALUES = 1 << 22  # the build's random pool (ficoco.models.build._POOL_SIZE)


def host_reclaims_free_memory(pattern: str = "/sys/bus/virtio/drivers/virtio_balloon/virtio*/features") -> bool:
    """Whether this machine is a VM whose balloon reports free pages to the host (so that memory a
    process touches for the first time may fault in the host too): a bound virtio-balloon device with
    the reporting feature, read from sysfs; False where that cannot be read (not Linux, not a VM)."""
    for path in glob.glob(pattern):
        try:
            with open(path) as f:
                bits = f.read().strip()
        except OSError:
            continue
        if len(bits) > _BALLOON_REPORTING_BIT and bits[_BALLOON_REPORTING_BIT] == "1":
            return True
    return False


def host_first_touch_s_per_byte() -> float:
    """The host's cost of a first touch per byte on this machine: HOST_FIRST_TOUCH_S_PER_BYTE on a VM
    that hands free memory back to its host, else 0."""
    return HOST_FIRST_TOUCH_S_PER_BYTE if host_reclaims_free_memory() else 0.0


@functools.cache
def fill_bytes_per_s(device_type: str = "cpu") -> float:
    """Bytes per second written into new memory the way a build fills its weights (a new 64 MiB
    tensor, filled with slices of a 4 M-value pool), the median of three; once per process. On a CPU
    each fill pays its pages' first-touch faults in the guest (the host's share is not seen here:
    `host_first_touch_s_per_byte`)."""
    device = torch.device(device_type)
    pool = torch.full((_POOL_VALUES,), 0.02, dtype=torch.bfloat16, device=device)
    times = []
    for _ in range(3):
        synchronize(device)
        begin = time.perf_counter()
        target = torch.empty(_PROBE_VALUES, dtype=torch.bfloat16, device=device)
        for start in range(0, _PROBE_VALUES, _POOL_VALUES):
            target[start:start + _POOL_VALUES].copy_(pool)
        synchronize(device)
        times.append(time.perf_counter() - begin)
        del target  # freed, so the next fill takes new pages again (a large block goes back to the kernel)
    return _PROBE_VALUES * 2 / statistics.median(times)
