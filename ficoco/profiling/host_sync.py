"""Count the operations that make the host wait for the device.

On a GPU, `bool(t)`, `int(t)`, `t.item()`, `t.tolist()`, `nonzero()` and boolean-mask
indexing each block the host until the queue drains; inside a timed forward they stall
kernel launches. They cannot be timed on a CPU, but they can be counted there: each reaches
the dispatcher as one of the ops below (scalar reads as `_local_scalar_dense`; `tolist()` and
host copies of device tensors never reach it on a CPU, so `Tensor.tolist`, `Tensor.cpu` and
`Tensor.numpy` calls are counted at the Python level too). A test compares a patched
model's count with vanilla's; on CUDA, `torch.cuda.set_sync_debug_mode` is the live check.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_SYNCING_OPS = {"aten._local_scalar_dense.default", "aten.nonzero.default", "aten.masked_select.default",
                "aten.unique_consecutive.default", "aten._unique2.default", "aten.equal.default"}


class _SyncCounter(TorchDispatchMode):
    def __init__(self, counts: Counter) -> None:
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        name = str(func)
        if name in _SYNCING_OPS:
            self.counts[name.split(".")[1]] += 1
        elif name.startswith("aten.index.Tensor") and any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] if len(args) > 1 else [])):
            self.counts["boolean index"] += 1
        elif name.startswith(("aten.repeat_interleave.Tensor", "aten.repeat_interleave.self_Tensor")) and (
                kwargs or {}).get("output_size") is None:
            self.counts["repeat_interleave"] += 1
        return func(*args, **(kwargs or {}))


@contextmanager
def count_host_syncs() -> Iterator[Counter]:
    """Counts, by kind, the host-synchronising operations run inside the block."""
    counts: Counter = Counter()
    originals = {name: getattr(torch.Tensor, name) for name in ("tolist", "cpu", "numpy")}

    def counting(name: str) -> Any:
        original = originals[name]

        def wrapper(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            counts[f"Tensor.{name}"] += 1
            return original(self, *args, **kwargs)

        return wrapper

    for name in originals:
        setattr(torch.Tensor, name, counting(name))
    try:
        with _SyncCounter(counts):
            yield counts
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
