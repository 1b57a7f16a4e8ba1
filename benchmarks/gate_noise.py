"""The CI gate's own noise and power on this machine (issue 19).

Runs the gate N times on an unchanged tree (base = HEAD, the working tree clean), then once per
injected delay of the reduction stages (FICOCO_TEST_DELAY_REDUCTION_MS, new side only), and
prints each run's timed-pair verdicts and, per reduced row, the spread of the speedup's change
between base and new. Every run's combined reports are kept, so the verdicts are also re-judged
at other tolerances without profiling again.

    python benchmarks/gate_noise.py --runs 5 --delay-ms 1,2 --out /tmp/gate-noise

Takes about (runs + delays) x 3 minutes on a 2-core machine; the numbers are in reports/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from ficoco.report.compare import compare, read_report
from ficoco.testing_hooks import DELAY_REDUCTION_VARIABLE


def gate_run(out: Path, delay_ms: float | None, root: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FICOCO_TEST_")}
    env["PYTHONPATH"] = str(root)  # the gate itself from the tree measured, too
    if delay_ms:
        env[DELAY_REDUCTION_VARIABLE] = str(delay_ms)
    subprocess.run([sys.executable, "-m", "ficoco_cli.gate", "--root", str(root), "--base", "HEAD",
                    "--out", str(out)], env=env, cwd=root, check=False, capture_output=True, text=True)
    return json.loads((out / "gate.json").read_text())


def rejudge(out: Path, tolerance_pct: float) -> list[str]:
    result = compare(read_report(out / "base.json"), read_report(out / "new.json"), judge="timed",
                     tolerance_pct=tolerance_pct)
    return [f"{v.metric} ({v.row})" for v in result.regressions]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="gate runs on the unchanged tree")
    parser.add_argument("--delay-ms", default="2", help="injected delays per reduction span, comma-separated")
    parser.add_argument("--tolerances", default="10,15,20,25", help="also re-judge at these tolerances")
    parser.add_argument("--out", required=True)
    parser.add_argument("--root", default=".")
    args = parser.parse_args()
    root, out = Path(args.root).resolve(), Path(args.out).resolve()
    plan = [(f"unchanged-{i + 1}", None) for i in range(args.runs)]
    plan += [(f"delay-{d}ms", float(d)) for d in args.delay_ms.split(",") if d.strip()]
    tolerances = [float(t) for t in args.tolerances.split(",")]
    summary = {}
    for name, delay in plan:
        gate = gate_run(out / name, delay, root)
        changes = {s["row"].split(" batch")[0]: s["change"] for s in gate["speedups"]}
        summary[name] = {"delay_ms": delay, "pair_regressions": gate["pair_regressions"],
                         "pair_skipped": gate["pair_skipped"], "changes": changes,
                         "speedups": {s["row"].split(" batch")[0]: (s["base"], s["new"]) for s in gate["speedups"]},
                         "seconds": sum(r["seconds"] for r in gate["runs"]),
                         "rejudged": {str(t): rejudge(out / name, t) for t in tolerances}}
        regressions = gate["pair_regressions"]
        print(f"{name:14} {summary[name]['seconds']:5.0f} s of profiling  pair: "
              + (f"{len(regressions)} regression(s) {regressions}" if regressions else "no regression")
              + "  changes: " + ", ".join(f"{r.split(' ', 1)[1]} {c * 100:+.1f}%" for r, c in changes.items()),
              flush=True)
    unchanged = [s for s in summary.values() if s["delay_ms"] is None]
    if unchanged:
        print("spread of the speedup change on the unchanged tree (min .. max over runs):")
        for row in unchanged[0]["changes"]:
            values = [s["changes"][row] * 100 for s in unchanged if s["changes"].get(row) is not None]
            print(f"  {row:28} {min(values):+6.1f}% .. {max(values):+6.1f}%")
    for tolerance in tolerances:
        false = sum(bool(s["rejudged"][str(tolerance)]) for s in unchanged)
        caught = {n: bool(s["rejudged"][str(tolerance)]) for n, s in summary.items() if s["delay_ms"]}
        print(f"tolerance {tolerance:g}%: unchanged runs with a regression {false}/{len(unchanged)}; delays caught "
              + ", ".join(f"{n}: {'yes' if c else 'NO'}" for n, c in caught.items()))
    (out / "noise.json").write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main()
