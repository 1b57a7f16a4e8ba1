"""time_reads.py [--device cuda|cpu] [--json PATH]: a layer's attention reads timed beside the model's SDPA at two real
shapes (Qwen3-VL-8B's 2,304-token tower layer, LLaVA-1.5-7B's 650-token decoder layer): each read as ms and as a
multiple of SDPA's time at the same shape.

- cuda (bfloat16): a column read (every row's head-mean, what FiCoCo-V reads) by ficoco's Triton kernels (the two-loop
  log-sum-exp scheme, ficoco.methods.reads.ops.triton_kernels) and by torch ops over blocks of scores;
- cpu (float32, the CPU's fastest here): the fused pass (the layer's output and its head-mean matrix,
  ficoco.methods.reads.ops.fused) against SDPA alone, and the read beside SDPA (the native kernel).

benchmarks/gpu_run.sh runs it in its gpu-tests step. Medians of a few calls after one warm-up; on a CPU name the
processor beside the figures (they move with a shared VM's load)."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

SHAPES = {  # name: (heads, kv heads, tokens, head width, causal)
    "qwen3-vl-8b tower": (16, 16, 2304, 72, False),
    "llava-1.5-7b decoder": (32, 32, 650, 128, True),
}


def timed(device: str, function: Callable[[], object], repeat: int = 5) -> float:
    function()
    samples = []
    for _ in range(repeat):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        function()
        if device == "cuda":
            torch.cuda.synchronize()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def measure(name: str, heads: int, kv_heads: int, tokens: int, width: int, causal: bool, device: str,
            dtype: torch.dtype) -> dict:
    """One shape's row: SDPA's time and each read's, in ms and as a multiple of SDPA's."""
    from ficoco.methods.reads import native
    from ficoco.methods.reads.ops import ProbedAttention
    from ficoco.methods.reads.ops import triton_kernels as triton_reads
    from ficoco.methods.reads.ops.fused import fused_attention

    generator = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(1, h, tokens, width, generator=generator).to(device, dtype)
                         for h in (heads, kv_heads, kv_heads))
    sdpa_ms = timed(device, lambda: F.scaled_dot_product_attention(query, key, value, is_causal=causal,
                                                                   enable_gqa=True))
    row = {"shape": name, "device": device, "dtype": str(dtype).removeprefix("torch."), "sdpa_ms": sdpa_ms}
    os.environ[native.ENV] = "torch"
    row["torch_read_ms"] = timed(device, lambda: ProbedAttention(query, key, causal=causal).column_sum())
    os.environ.pop(native.ENV)
    if device == "cuda" and triton_reads.available("cuda"):
        positions = torch.arange(tokens, device=device)
        row["triton_read_ms"] = timed(device, lambda: triton_reads.column_sum(query, key, positions, causal=causal))
    if device == "cpu" and native.library() is not None:
        row["native_read_ms"] = timed(device, lambda: ProbedAttention(query, key, causal=causal).column_sum())
        row["fused_ms"] = timed(device, lambda: fused_attention(query, key, value, causal=causal))
        row["fused_extra_x_sdpa"] = (row["fused_ms"] - sdpa_ms) / sdpa_ms
    for field in ("torch_read_ms", "triton_read_ms", "native_read_ms"):
        if field in row:
            row[field.replace("_ms", "_x_sdpa")] = row[field] / sdpa_ms
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json")
    args = parser.parse_args()
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    results = []
    for name, shape in SHAPES.items():
        row = measure(name, *shape, device=args.device, dtype=dtype)
        results.append(row)
        print("  " + "  ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"cpu": torch.backends.cpu.get_cpu_capability(), "rows": results}, handle, indent=1)


if __name__ == "__main__":
    main()
