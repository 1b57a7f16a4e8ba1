"""A row's attention kernels against its vanilla row's, layer by layer (no torch: read back by `ficoco
report` too).

A profile row's `attention_kernels` (profiling/kernels.py) names, per stage ("vision", "llm") and run of
layers, the implementation every layer ran, its backend, its calls per layer and whether the module was
routed through a function of ficoco's that reads beside the kernel. Here a reduced row is held against
its vanilla row in the layers its schedule does not reduce: a layer that runs a kernel that materialises
the attention matrix (eager, ficoco's probe, SDPA's math backend) where vanilla runs a fused one (SDPA's
flash, efficient or cuDNN backend, a flash-attention implementation) pays for more than its tokens there.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

Place = tuple[str, int]  # (stage, layer)
STAGE_ORDER = ("vision", "llm")  # the order the model runs them
Kernel = tuple[str, str | None]  # (implementation, backend)

# Kernels that materialise the (queries x keys) matrix: the slower kind wherever a fused one runs.
MATERIALISING_IMPLEMENTATIONS = ("eager", "probe")
MATERIALISING_SDPA_BACKENDS = ("math",)


def is_fused(implementation: str, backend: str | None) -> bool:
    """Whether a kernel computes attention without the matrix in memory (SDPA with an unnamed backend
    counts as fused: nothing says it is not)."""
    if implementation in MATERIALISING_IMPLEMENTATIONS:
        return False
    return not (implementation == "sdpa" and backend in MATERIALISING_SDPA_BACKENDS)


def layer_kernels(record: Any) -> dict[Place, list[dict[str, Any]]]:
    """Every layer's entries of an `attention_kernels` record ({} for a report without one)."""
    layers: dict[Place, list[dict[str, Any]]] = {}
    if not isinstance(record, dict):
        return layers
    for stage, entries in record.items():
        for entry in entries if isinstance(entries, list) else []:
            span = entry.get("layers") if isinstance(entry, dict) else None
            if not (isinstance(span, list) and len(span) == 2 and all(isinstance(n, int) for n in span)):
                continue
            for layer in range(span[0], span[1] + 1):
                layers.setdefault((stage, layer), []).append(entry)
    return layers


def _slowest(entries: list[dict[str, Any]]) -> Kernel:
    """The slowest kernel a layer ran (a materialising one before a fused one)."""
    kernels = [(str(e.get("implementation")), e.get("backend")) for e in entries]
    return min(kernels, key=lambda kernel: is_fused(*kernel))


def reduced_layers(schedule: Any) -> set[Place]:
    """The (stage, layer) places a row's schedule reduces at."""
    places = set()
    for entry in schedule if isinstance(schedule, list) else []:
        if isinstance(entry, dict) and isinstance(entry.get("layer"), int):
            places.add((str(entry.get("stage")), entry["layer"]))
    return places


def ranges(layers: Iterable[int]) -> list[list[int]]:
    """Sorted layers as [first, last] runs of consecutive ones."""
    runs: list[list[int]] = []
    for layer in sorted(set(layers)):
        if runs and runs[-1][1] == layer - 1:
            runs[-1][1] = layer
        else:
            runs.append([layer, layer])
    return runs


def slower_kernels(row: dict[str, Any], base: dict[str, Any]) -> list[dict[str, Any]] | None:
    """Where `row` runs a slower attention kernel than `base` (its vanilla row) in a layer its schedule does
    not reduce: [{"stage", "layers": [[first, last], ...], "ran": {implementation, backend}, "vanilla":
    {implementation, backend}}], one entry per stage and pair of kernels ([] where it runs none). None for
    vanilla, and where either row has no record (a report made before it)."""
    if row.get("variant") == "vanilla" or not row.get("attention_kernels") or not base.get("attention_kernels"):
        return None
    ours, theirs = layer_kernels(row["attention_kernels"]), layer_kernels(base["attention_kernels"])
    reducing = reduced_layers(row.get("schedule"))
    slower: dict[tuple[str, Kernel, Kernel], list[int]] = {}
    for place, entries in ours.items():
        if place in reducing or place not in theirs:
            continue
        ran, vanilla = _slowest(entries), _slowest(theirs[place])
        if is_fused(*vanilla) and not is_fused(*ran):
            slower.setdefault((place[0], ran, vanilla), []).append(place[1])
    return [{"stage": stage, "layers": ranges(layers), "ran": {"implementation": ran[0], "backend": ran[1]},
             "vanilla": {"implementation": vanilla[0], "backend": vanilla[1]}}
            for (stage, ran, vanilla), layers in sorted(slower.items(), key=_model_order)]


def _model_order(item: tuple[tuple[str, Kernel, Kernel], list[int]]) -> tuple[int, str, int]:
    stage = item[0][0]
    return (STAGE_ORDER.index(stage) if stage in STAGE_ORDER else len(STAGE_ORDER)), stage, min(item[1])
