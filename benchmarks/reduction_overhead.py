"""Time FiCoCo's reduction stages alone against the whole reduced prefill.

    python benchmarks/reduction_overhead.py --model llava-1.5-7b --variant v --tflops 1.5
    python benchmarks/reduction_overhead.py --model llava-1.5-7b --variant l --keep 64

Builds the model with random weights (bf16 on CPU), runs `--warmup` + `--repeat` reduced
prefills on a synthetic LLaVA-1.5 prompt, and prints the median prefill time, the median
time inside the reduction stages (filter, correlate, compress; measured by the handle) and
their share. Goal (issue 3): under 3%.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import ficoco
from ficoco.models.inputs import synthetic_inputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llava-1.5-7b")
    parser.add_argument("--variant", choices=("v", "l"), default="v")
    parser.add_argument("--keep", type=int)
    parser.add_argument("--tflops", type=float)
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args()
    if args.keep is None and args.tflops is None:
        args.tflops = 1.5

    start = time.perf_counter()
    model = ficoco.build_model(args.model, dtype=args.dtype, overrides=args.overrides)
    print(f"built {args.model} ({args.dtype}, random weights) in {time.perf_counter() - start:.1f} s; "
          f"{torch.get_num_threads()} threads")
    inputs = synthetic_inputs(model, batch=1, text_tokens=60)
    handle = ficoco.apply(model, args.variant, keep=args.keep, tflops=args.tflops)
    print(f"schedule: {handle.schedule.to_json()}")
    totals, stages, probes = [], [], []
    with torch.inference_mode():
        for step in range(args.warmup + args.repeat):
            handle.timer.reset()
            begin = time.perf_counter()
            model(**inputs)
            elapsed = time.perf_counter() - begin
            if step >= args.warmup:
                totals.append(elapsed)
                stages.append(handle.timer.total_ms("reduction") / 1e3)
                probes.append(handle.timer.total_ms("probe") / 1e3)
    handle.remove()
    total, stage = statistics.median(totals), statistics.median(stages)
    print(f"reduced prefill: median {total * 1e3:.1f} ms over {args.repeat} runs {[round(t * 1e3) for t in totals]}")
    print(f"reduction stages: median {stage * 1e3:.1f} ms ({len(handle.schedule.removals)} reducing layers)")
    print(f"overhead share: {stage / total * 100:.2f}% of the reduced prefill (goal: under 3%)")
    probe = statistics.median(probes)
    print(f"attention probes (reducing layers' attention with probabilities, replacing SDPA there): "
          f"median {probe * 1e3:.1f} ms, {probe / total * 100:.2f}% of the reduced prefill")


if __name__ == "__main__":
    main()
