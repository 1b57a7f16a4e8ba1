"""check_report.py REPORT [cuda|cpu] [--own-work SHARE] [--expect V1,V2]: assert that a ficoco.report/1 is sane for
its device and print one line per row; exit 1 on the first kind of doubt, 0 with PASS. `--expect` names the variants
that must each have a row (a variant the run left out, with its reason in the report's notes, fails).

On a 7B model's shapes and on the 2026 backbones' (PREDICTED_BACKBONES, decoder cuts included):
- the prediction (on a CPU): every row's measured prefill is within PREDICTION_TOLERANCE of the time this
  machine's measured rates predict for it (profiling/predict.py: the accountant's ops at the rates of
  the row's own shapes and of the calls its family makes, probed before, between and after its runs);
- method speed: every reduced row's measured speedup is at least SPEED_OVER_PREDICTED of the
  speedup those rates predict: the honest yardstick, where a FLOPs ratio overstates what fewer
  tokens can save on any machine.
Every reduced row's own work (its steps and its reads of the attention) is printed as a share of the prefill
time its fewer tokens save, and its reads in ms and as a multiple of the attention they read; `--own-work SHARE`
(e.g. 0.10) fails a row whose work takes more, unless its reads cost at most 0.6x the attention they read and its
steps at most 3 % of the savings (ficoco.report.pairing.own_work_verdict: a method whose design reads more than it
saves is printed as that, in words).
On every report: each row records the attention kernel every layer ran, and on a GPU vanilla's SDPA
calls reach a fused backend; slower kernels than vanilla's in a row's non-reducing layers are printed."""

from __future__ import annotations

import json
import statistics
import sys

from ficoco.report.pairing import own_work_verdict, reads_share_predicted
from ficoco.report.precision import precision

SPEED_OVER_PREDICTED = 0.9
PREDICTION_TOLERANCE = 0.15


# The 2026 backbones whose prediction is checked too (reports/README.md, cpu-2026): their MoE experts, Gated
# DeltaNet layers and Qwen towers are priced at the rates of the calls they make.
PREDICTED_BACKBONES = ("qwen3-vl-8b", "qwen3-vl-30b-a3b", "qwen3.5-0.8b", "internvl3-8b")


def seven_b_shapes(config: dict) -> bool:
    """A 7B model's widths (its name says so; fewer layers through --set keep them)."""
    return "7b" in str(config.get("model", "")).lower()


def prediction_checked(config: dict) -> bool:
    """A model whose prediction is judged: a 7B model's widths, or a 2026 backbone's (its name says so)."""
    name = str(config.get("model", "")).lower()
    return seven_b_shapes(config) or any(backbone in name for backbone in PREDICTED_BACKBONES)


def check(path: str, kind: str, own_work: float | None = None, expect: list[str] | None = None) -> list[str]:
    with open(path) as f:
        report = json.load(f)
    env, config, bad = report["environment"], report["config"], []
    ran = {row["variant"] for row in report["rows"]}
    vanillas = {(row["quant"], row["batch"]): row for row in report["rows"]
                if row["variant"] == "vanilla" and row.get("status") == "ok"}
    for variant in expect or []:
        if variant not in ran:
            why = [note for note in report.get("notes", []) if note.startswith(f"left out {variant}:")]
            bad.append(f"{variant}: no row" + (f" ({why[0]})" if why else ""))
    print(f"{path}: {env['device']} ({env['device_kind']}), torch {env['torch']} cuda {env.get('cuda')} "
          f"driver {env.get('driver')}, gpu_profile {config.get('gpu_profile')}, "
          f"{config.get('warmup')} warm-up / {config.get('repeat')} timed runs")
    if env["device_kind"] != kind:
        bad.append(f"device_kind {env['device_kind']} != {kind}")
    for row in report["rows"]:
        tag = f"{row['variant']:7} {precision(row):4} b{row['batch']}"
        if row["status"] != "ok":
            bad.append(f"{tag}: {row['status']}: {row.get('reason')}")
            continue
        memory, latency, analytic = row["memory"], row["latency"], row["analytic"]
        if latency["timer"] != ("cuda-events" if kind == "cuda" else "perf_counter"):
            bad.append(f"{tag}: timer {latency['timer']}")
        if kind == "cuda":
            if not memory.get("cuda_max_allocated_bytes"):
                bad.append(f"{tag}: no allocator peak")
            if memory.get("nvml_peak_used_bytes") is None:
                bad.append(f"{tag}: no NVML peak")
            if config.get("gpu_profile") and analytic["roofline_ms"] is None:
                bad.append(f"{tag}: no roofline")
            reserved = memory.get("cuda_max_reserved_bytes") or 0
            if reserved > 1.5 * memory["peak_bytes"] + 1e9:
                bad.append(f"{tag}: reserved {reserved / 1e9:.1f} GB >> peak {memory['peak_bytes'] / 1e9:.1f} GB "
                           "(stale allocator cache)")
        measured_weights = row.get("weight_bytes")
        # With a device map the measured weights are those in memory; the accountant places the rest on disk.
        placed = row.get("memory_per_device") or {}
        expected = sum(d["weights_bytes"] for where, d in placed.items() if where != "disk") if placed \
            else analytic["weight_bytes"]
        # Decoder layers that share another layer's weights (--distinct-layers) hold none of their own.
        expected -= (row.get("weights_shared") or {}).get("shared_bytes", 0.0)
        if measured_weights is None or abs(measured_weights / expected - 1) > 0.005:
            bad.append(f"{tag}: weights measured {measured_weights} vs analytic {expected:.0f}"
                       + (" in memory" if placed else "") + " (unquantized weights or a quantization-layout mismatch)")
        if row["variant"] != "vanilla" and (row.get("memory_saving_vs_vanilla") or 0) > 0.25 and row["batch"] == 1:
            bad.append(f"{tag}: saves {row['memory_saving_vs_vanilla']:.0%} of the whole peak at batch 1: "
                       "the vanilla row carried extra memory")
        # Quantized caches too (issue 12): the accountant stores their scales and residual window.
        if row["kv_cache_bytes"] != analytic["kv_cache_bytes"]:
            bad.append(f"{tag}: KV measured {row['kv_cache_bytes']} != analytic {analytic['kv_cache_bytes']}")
        decoded = (row.get("generation") or {}).get("kv_cache_bytes")
        if decoded is not None and decoded != analytic.get("kv_cache_bytes_after_decode"):
            bad.append(f"{tag}: KV after decoding {decoded} != analytic {analytic.get('kv_cache_bytes_after_decode')}")
        if row["generation"] is not None and row["generation"]["new_tokens"] != row["new_tokens"]:
            bad.append(f"{tag}: generated {row['generation']['new_tokens']} != {row['new_tokens']}")
        # Issue 41: every row names the kernel each layer ran; on a GPU vanilla's SDPA calls must reach a
        # fused backend (math there would make every reduced row's speedup a statement about math).
        kernels = row.get("attention_kernels")
        if not kernels:
            bad.append(f"{tag}: no attention_kernels record")
        elif kind == "cuda" and row["variant"] == "vanilla":
            math = [e["layers"] for stage in kernels.values() for e in stage
                    if e["implementation"] == "sdpa" and e["backend"] == "math"]
            if math:
                bad.append(f"{tag}: vanilla's SDPA runs the math backend in layers {math}")
        for slower in row.get("slower_kernels_vs_vanilla") or []:
            print(f"  {tag} runs {slower['ran']} in {slower['stage']} layers {slower['layers']} where vanilla runs "
                  f"{slower['vanilla']}")
        speedup, ratio = row.get("speedup_vs_vanilla"), row.get("flops_ratio_vs_vanilla")
        roofline = row.get("measured_over_roofline")
        predicted = row.get("predicted_speedup_vs_vanilla")
        speed = speedup / predicted if speedup is not None and predicted else None
        over = row.get("measured_over_predicted")
        spread = (row.get("predicted") or {}).get("spread")
        # Judged on CPUs, where it was shown to hold; on a GPU printed only, until a GPU run shows it.
        if kind == "cpu" and prediction_checked(config) and (over is None or abs(over - 1) > PREDICTION_TOLERANCE):
            bad.append(f"{tag}: measured/predicted prefill {over} is not within {PREDICTION_TOLERANCE:.0%} of 1")
        work = row.get("own_work_vs_savings") or {}
        share = work["own_ms"] / work["saved_ms"] if work.get("saved_ms", 0) > 0 else None
        # The floor under it: the method's reads alone against its savings, both at this machine's rates (a
        # report from before the floor was recorded: computed here from the rows' predictions).
        base = vanillas.get((row["quant"], row["batch"]))
        floor = work.get("reads_share_predicted") if "reads_share_predicted" in work else (
            reads_share_predicted(row, base) if base is not None else None)
        if row["variant"] != "vanilla" and own_work is not None and row.get("own_work_vs_savings"):
            passes, verdict = own_work_verdict(row, own_work)
            if passes and (share is None or share > own_work):
                print(f"  {tag}: {verdict}")
            elif not passes:
                bad.append(f"{tag}: {verdict}")
        faults = row.get("page_faults") or {}
        if row["variant"] != "vanilla" and prediction_checked(config):
            if speed is None:
                bad.append(f"{tag}: no predicted speedup to check the method's speed against")
            elif speed < SPEED_OVER_PREDICTED:
                bad.append(f"{tag}: speedup {speedup:.2f}x is {speed:.2f} of the predicted {predicted:.2f}x "
                           f"(< {SPEED_OVER_PREDICTED})")
        print(f"  {tag} {latency['median_ms']:10.2f} ms  peak {memory['peak_bytes'] / 1e9:6.2f} GB  "
              f"nvml peak {(memory.get('nvml_peak_used_bytes') or 0) / 1e9:6.2f} GB  "
              f"KV {row['kv_cache_bytes'] / 1e6:8.2f} MB  weights {measured_weights / 1e9:6.3f} GB  "
              f"speedup {'-' if speedup is None else f'{speedup:.2f}x'}  "
              f"FLOPs ratio {'-' if ratio is None else f'{ratio:.2f}x'}  "
              f"predicted {'-' if predicted is None else f'{predicted:.2f}x'}  "
              f"measured/predicted speedup {'-' if speed is None else f'{speed:.2f}'}  "
              f"prefill measured/predicted {'-' if over is None else f'{over:.2f}'}  "
              f"pass spread {'-' if spread is None else f'{spread:.2f}'}  "
              f"measured/roofline {'-' if roofline is None else f'{roofline:.2f}'}  "
              f"method {row['reduction_share'] * 100:.1f}%  "
              f"own work / saved {'-' if share is None else f'{share:.0%}'}  "
              f"reads / saved predicted {'-' if floor is None else f'{floor:.0%}'}  "
              f"reads {_reads_words(row.get('reads'))}"
              + (f"  page faults per run: minor {statistics.median(faults['minor']):.0f}, major "
                 f"{max(faults['major'])}" if faults.get("minor") else ""))
    return bad


def _reads_words(reads: dict | None) -> str:
    """A row's reads of attention: ms, and as a multiple of the attention they read."""
    if not reads:
        return "-"
    over = reads.get("x_attention")
    return f"{reads['ms']:.1f} ms ({'-' if over is None else f'{over:.2f}x'} attention)"


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="check_report.py", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("report", help="a ficoco.report/1 JSON file (ficoco profile --json)")
    parser.add_argument("kind", nargs="?", default="cuda", choices=("cuda", "cpu"), help="the device it ran on")
    parser.add_argument("--own-work", type=float, default=None, metavar="SHARE",
                        help="fail a row whose own work exceeds this share of its savings (e.g. 0.10), unless its "
                             "reads and steps pass on their own")
    parser.add_argument("--expect", default=None, metavar="V1,V2", help="variants that must each have a row")
    args = parser.parse_args()  # a mistake: argparse's one line, exit 2
    expect = [v for v in args.expect.split(",") if v] if args.expect else None
    try:
        bad = check(args.report, args.kind, args.own_work, expect)
    except (OSError, ValueError) as exc:  # a missing or unreadable file: one line, exit 2
        print(f"check_report.py: {args.report}: {exc.strerror if isinstance(exc, OSError) else exc}",
              file=sys.stderr)
        sys.exit(2)
    print("FAIL:\n  " + "\n  ".join(bad) if bad else "PASS")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
