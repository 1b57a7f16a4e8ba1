"""What a method's attention reads cost in a profile report, against what a fused kernel could make them cost.

    python benchmarks/read_floor.py reports/cpu-2026/epyc-avx2/qwen3-vl-8b.json --variant v,l

ficoco computes a read by blocks of scores (the product, the scale, the softmax and the sums each one pass
over the block, in the model's eager rule), beside the layer's own SDPA. For every layer a report row's
method reads (ficoco.accounting.reads.method_reads at the row's schedule, as the prediction prices them),
this times here, in the row's compute dtype and thread count, the layer's SDPA over the rows the reads ask
for (every query for a column read) and every key: one fused kernel (scores, softmax and weighted values
in cache-sized tiles), taken at its time per score for the scores the reads compute.

It prints the method's own work (its stages as the row measured them plus its reads) as a share of the
prefill time its fewer tokens save: as the row measured it, with every read at that SDPA rate, and at half
of it (the scores are half of SDPA's products: about the least a fused read of every score could cost at
that kernel's rate). A method whose share stays above the goal at half of SDPA does not reach the goal on
this machine by a faster read alone. Time it on the machine that measured the report.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from ficoco.accounting import Schedule, architecture
from ficoco.accounting.reads import Read, method_reads
from ficoco.accounting.schedule import Removal, plan_tokens
from ficoco.errors import FicocoError
from ficoco.profiles import load_profile
from ficoco.profiling.environment import environment


def _median_ms(call, repeat: int) -> float:
    call()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def _schedule(row: dict) -> Schedule:
    removals = tuple(Removal(step["stage"], step["layer"], step["remove"], step.get("where", "in_layer"),
                             step.get("added", 0)) for step in row["schedule"])
    settings = tuple(sorted((key, tuple(value) if isinstance(value, list) else value)
                            for key, value in (row["analytic"].get("settings") or {}).items()))
    return Schedule(row["variant"], removals, settings)


def _fused_ms(reads: list[Read], kv_heads: int, dtype: torch.dtype, repeat: int) -> float:
    """What one sequence's `reads` of one layer would cost at a fused kernel's rate: the layer's SDPA over every
    row the reads ask for (every query for a column read) and every key, timed here, at its time per score
    times the scores the reads compute."""
    first = reads[0]
    keys, heads, head_dim = max(r.keys for r in reads), first.heads, first.head_dim
    if any(r.kind == "columns" for r in reads):
        queried = keys
    else:
        queried = min(keys, sum(r.rows for r in reads))
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(1, heads, queried, head_dim, generator=generator).to(dtype)
    key = torch.randn(1, kv_heads, keys, head_dim, generator=generator).to(dtype)
    value = torch.randn(1, kv_heads, keys, head_dim, generator=generator).to(dtype)

    def sdpa() -> None:
        F.scaled_dot_product_attention(query, key, value, enable_gqa=kv_heads != heads)

    scores = sum(r.scores for r in reads) / first.sequences
    with torch.inference_mode():
        return _median_ms(sdpa, repeat) * scores / (heads * queried * keys)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("report", type=Path)
    parser.add_argument("--variant", default="v", help="comma-separated variants of the report's rows")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--goal", type=float, default=0.10, help="own work / savings to compare with")
    args = parser.parse_args()
    try:
        report = json.loads(args.report.read_text())
    except (OSError, ValueError) as exc:
        print(f"read_floor: cannot read {args.report}: {exc}; give a ficoco profile report", file=sys.stderr)
        return 2
    config = report["config"]
    try:
        profile = load_profile(config["model"], config.get("overrides") or [])
    except FicocoError as exc:
        print(f"read_floor: {exc}", file=sys.stderr)
        return 2
    arch = architecture(profile)
    cpu = report["environment"].get("cpu", "?")
    print(f"{config['model']} ({' '.join(config.get('overrides') or []) or 'as published'}); report measured on {cpu}")
    here = environment(torch.device("cpu"))
    caps = " ".join(f"{name}={value}" for name, value in here["cpu_isa_overrides"].items())
    print(f"timed here on: {here['cpu']}, torch {here['torch']}, capability {here['cpu_capability']}"
          f"{f' (capped: {caps})' if caps else ''}")
    wanted = args.variant.split(",")
    rows = [row for row in report.get("rows", []) if row.get("variant") in wanted and row.get("status") == "ok"
            and row.get("own_work_vs_savings")]
    if not rows:
        print(f"read_floor: {args.report} has no measured row of {args.variant} beside a vanilla row; give variants "
              f"it profiled (--variant)", file=sys.stderr)
        return 2
    for row in rows:
        torch.set_num_threads(row.get("threads") or torch.get_num_threads())
        dtype = getattr(torch, row["backend"]["compute_dtype"])
        schedule = _schedule(row)
        plan = plan_tokens(arch, schedule, text_tokens=row["text_tokens"])
        reads = method_reads(arch, schedule, plan, batch=row["batch"])
        layers: dict[tuple[str, int], list[Read]] = {}
        for read in reads:
            layers.setdefault((read.stage, read.layer), []).append(read)
        timed: dict[tuple, float] = {}
        sdpa_ms, windowed = 0.0, 0
        for (stage, _), layer_reads in layers.items():
            if any(read.pairs is not None for read in layer_reads):
                windowed += 1
                continue
            kv_heads = arch.decoder.kv_heads if stage == "llm" else layer_reads[0].heads
            shape = (stage, *((read.kind, read.rows, read.keys) for read in layer_reads))
            if shape not in timed:
                timed[shape] = _fused_ms(layer_reads, kv_heads, dtype, args.repeat)
            sdpa_ms += timed[shape] * layer_reads[0].sequences
        stages_ms = row["reduction_stages_ms"]
        saved_ms = row["own_work_vs_savings"]["saved_ms"]
        measured = row["own_work_vs_savings"]["own_ms"]

        def share(own: float, saved_ms: float = saved_ms) -> str:
            return f"{own:,.0f} ms = {own / saved_ms:.0%}"

        print(f"\n{row['method_label']} {row['quant']} batch {row['batch']} ({len(reads)} reads at {len(layers)} "
              f"layers, {dtype}, {row['threads']} threads): savings {saved_ms:,.0f} ms, stages {stages_ms:,.0f} ms "
              f"as measured")
        if windowed:
            print(f"  ({windowed} windowed layers' reads left out: this script times whole layers)")
        print(f"  reads: {row['probe_ms']:,.0f} ms measured in the row; at the layers' SDPA rate (timed here) "
              f"{sdpa_ms:,.0f} ms; at half of it {sdpa_ms / 2:,.0f} ms")
        if saved_ms <= 0:
            print("  own work / savings: its fewer tokens saved no time in this row, so no share")
            continue
        print(f"  own work / savings: measured {share(measured)}; reads at SDPA {share(stages_ms + sdpa_ms)}; "
              f"reads at half SDPA {share(stages_ms + sdpa_ms / 2)} (goal {args.goal:.0%})")
        if (stages_ms + sdpa_ms / 2) / saved_ms > args.goal:
            print("  -> above the goal even with reads at half the layers' SDPA: no faster read alone reaches it")
    return 0


if __name__ == "__main__":
    sys.exit(main())
