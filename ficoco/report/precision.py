"""What a profile row computed in, as a user reads it (torch-free).

A row's `quant` says how its weights were stored: `fp16` is ficoco's name for "not quantized" (the model's own
16-bit or wider precision), `int8` and `int4` bitsandbytes' or hqq's quantized linears. Which dtype an unquantized
row computed in is the machine's and the model's choice (bfloat16 on a CPU with AMX, float32 where 16-bit
matmuls crawl, float16 on a GPU), recorded in the row's `backend.compute_dtype`; every table, verdict and
check line names that dtype (`bf16`, `fp16`, `fp32`), never `fp16` for a row that ran in bfloat16.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

SHORT_NAMES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "float64": "fp64"}
UNQUANTIZED = "fp16"  # the quant that stores the model's own precision (ficoco.models.quantize.QUANTS)


def precision_of(quant: Any, compute_dtype: Any) -> str:
    """`int8` / `int4` for quantized weights; for unquantized ones the short name of the dtype that ran (the
    quant's own name where a report does not say which: reports before compute dtypes were recorded)."""
    if quant != UNQUANTIZED or compute_dtype is None:
        return str(quant)
    name = str(compute_dtype).removeprefix("torch.")
    return SHORT_NAMES.get(name, name)


def precision(row: Mapping[str, Any]) -> str:
    """The precision a profile row ran at (`precision_of` its quant and its backend's compute dtype)."""
    backend = row.get("backend")
    compute = backend.get("compute_dtype") if isinstance(backend, Mapping) else None
    return precision_of(row.get("quant"), compute)
