"""The CI regression gate (issue 19): `python -m ficoco_cli.gate`, run by .ci/run after the tests.

Timed figures are judged on one machine only: the base commit and the tree under test are
profiled in the same job, alternately (base, new, new, base, base, new, ...: ABBA rounds, so a
drift of the machine's speed over the job hits both sides alike), each side's runs are
combined, and `ficoco compare --judge timed` judges the pair. A timed regression fails the gate
only when it reproduces: base and new are then profiled again, interleaved as before, and only
a verdict that regresses in both passes stands (a burst of load from a neighbour lasts one pass,
a slower change lasts both). Deterministic figures (visual
tokens, TFLOPs, KV and weight bytes) are judged against the committed reference
(reports/llava-tiny-cpu.json), which stays the record of what the numbers are.

The base, first match wins (`choose_base`):
  1. FICOCO_GATE_BASE, any git revision, when set;
  2. HEAD's first parent when HEAD is a merge: the line the merged change starts from;
  3. the commit the committed reference was made from (its `environment.git_commit`), when that
     is an ancestor of HEAD other than HEAD; else the last commit that changed the reference;
  4. HEAD's parent, when the reference was made at HEAD itself.
The base is exported with `git archive` into a temporary folder and runs there with this
environment's installed dependencies but its own code (PYTHONPATH; every run checks where
`ficoco` was imported from). A base that cannot run the gate's profile command (an old CLI, a
dependency it does not support) leaves the timed pair unjudged, loudly, rather than failing a
change for what its base cannot do; the deterministic check still runs. Test-only variables
(FICOCO_TEST_*) reach the new tree's runs only.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ficoco.errors import FicocoError
from ficoco.report.compare import (
    METRICS,
    Comparison,
    Verdict,
    compare,
    describe,
    fingerprint,
    processor,
    read_report,
    speedup_samples,
    vanilla_of,
)
from ficoco.report.precision import precision
from ficoco_cli.flags import cli_message, error_text

REFERENCE = "reports/llava-tiny-cpu.json"
# The reference's own rows (reports/README.md), on the CPU. More timed runs than the reference's 7:
# a row's median then outlasts a burst of load on the other core (each costs ~15 ms; a process
# costs ~10 s of start-up and builds).
PROFILE_ARGS = ("profile", "--device", "cpu", "--model", "llava-tiny", "--variant", "vanilla,v,l", "--keep", "8",
                "--quant", "fp16,int8,int4", "--warmup", "2", "--repeat", "15")
ROUNDS = 5  # runs per side: Mann-Whitney over 5 against 5 runs can reach p < 0.05
# Percent a speedup may move between base and new before the Mann-Whitney test is asked; set from
# the gate's measured noise on an unchanged tree (reports/README.md), with room to spare.
TOLERANCE_PCT = 15.0
RUN_TIMEOUT_S = 600
BASE_VARIABLE = "FICOCO_GATE_BASE"
TEST_ONLY_PREFIX = "FICOCO_TEST_"
# Runs a side's own code: the first argument is the tree whose `ficoco` must be the one imported
# (an editable install of another tree must not shadow it), the rest is the `ficoco` command line.
BOOTSTRAP = (
    "import sys, pathlib, ficoco, ficoco_cli\n"
    "root = pathlib.Path(sys.argv.pop(1)).resolve()\n"
    "for module in (ficoco, ficoco_cli):\n"
    "    where = pathlib.Path(module.__file__).resolve()\n"
    "    if root not in where.parents:\n"
    "        sys.exit(f'gate: {module.__name__} imported from {where}, not from {root}')\n"
    "from ficoco_cli.app import main\n"
    "main()\n"
)
DETERMINISTIC = [m for m in METRICS if m.kind == "deterministic"]


@dataclass(frozen=True)
class Base:
    """The commit the new tree is timed against, and why it was chosen (None: there is none)."""

    commit: str | None
    reason: str


def _git(root: Path, *args: str) -> str | None:
    result = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True)
    return result.stdout.strip() if result.returncode == 0 else None


def choose_base(root: Path, reference: Path, override: str | None = None) -> Base:
    """The base commit by the rule in this module's docstring."""
    head = _git(root, "rev-parse", "HEAD")
    if head is None:
        raise FicocoError(f"{root} is not a git checkout with a commit: the gate needs the history")
    if override:
        commit = _git(root, "rev-parse", "--verify", "--quiet", f"{override}^{{commit}}")
        if commit is None:
            raise FicocoError(f"{BASE_VARIABLE}={override} names no commit in {root}")
        return Base(commit, f"{BASE_VARIABLE}={override}")
    parents = (_git(root, "rev-list", "--parents", "-n", "1", "HEAD") or "").split()[1:]
    if len(parents) >= 2:
        return Base(parents[0], "HEAD is a merge: its first parent, the line the merged change starts from")
    try:
        recorded = str(read_report(reference).get("environment", {}).get("git_commit") or "")
    except FicocoError:
        recorded = ""
    dirty = recorded.endswith("+dirty")
    recorded = recorded.removesuffix("+dirty")
    commit = _git(root, "rev-parse", "--verify", "--quiet", f"{recorded}^{{commit}}") if recorded else None
    if commit and commit != head and _git(root, "merge-base", "--is-ancestor", commit, "HEAD") is not None:
        return Base(commit, f"the commit {reference.name} was made from (recorded in it"
                            + (", with local edits)" if dirty else ")"))
    last = _git(root, "log", "-n", "1", "--format=%H", "--", str(reference))
    if last and last != head:
        return Base(last, f"the last commit that changed {reference.name}")
    if parents:
        return Base(parents[0], f"HEAD's parent ({reference.name} was made at HEAD)")
    return Base(None, "none: HEAD has no parent and no earlier commit made the reference")


def export_commit(root: Path, commit: str, folder: Path) -> Path:
    """The tree of `commit`, as files in `folder` (no checkout, no change to the repository)."""
    archive = subprocess.run(["git", "-C", str(root), "archive", "--format=tar", commit], capture_output=True)
    if archive.returncode != 0:
        raise FicocoError(f"git archive {commit[:12]} failed: {archive.stderr.decode(errors='replace').strip()}")
    folder.mkdir(parents=True, exist_ok=True)
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive.stdout, check=True)
    return folder


@dataclass
class Run:
    side: str  # "base" or "new"
    round: int
    seconds: float
    report: dict[str, Any] | None
    error: str = ""
    pass_: int = 1  # 1: the measurement; 2: the re-measurement of a timed regression


def dtype_args(code: Path) -> tuple[str, ...]:
    """`--dtype bf16` where the side's CLI has --dtype: the reference's rows are bf16, and `auto`
    would pick another dtype on another CPU (float32 with AVX2 alone). A base from before the
    option computes bf16 on CPU anyway, so both sides of the pair measure the same dtype."""
    app_source = code / "ficoco_cli" / "app.py"
    return ("--dtype", "bf16") if app_source.is_file() and '"--dtype"' in app_source.read_text() else ()


def run_profile(code: Path, json_path: Path, *, side: str, round_: int, environ: dict[str, str] | None = None) -> Run:
    """One `ficoco profile` of the gate's configuration with the code in `code`, on one thread."""
    env = dict(os.environ if environ is None else environ)
    if side == "base":  # a test-only slowdown is for the tree under test
        env = {k: v for k, v in env.items() if not k.startswith(TEST_ONLY_PREFIX)}
    env.update(PYTHONPATH=str(code), OMP_NUM_THREADS="1")
    command = [sys.executable, "-c", BOOTSTRAP, str(code), *PROFILE_ARGS, *dtype_args(code), "--json", str(json_path)]
    began = time.perf_counter()
    try:
        result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=json_path.parent,
                                timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return Run(side, round_, time.perf_counter() - began, None, f"no result in {RUN_TIMEOUT_S} s")
    seconds = time.perf_counter() - began
    if result.returncode != 0:
        lines = [x for x in (result.stderr or result.stdout).strip().splitlines() if x.strip()]
        return Run(side, round_, seconds, None, f"exit {result.returncode}: " + " | ".join(lines[-3:])[-600:])
    try:
        return Run(side, round_, seconds, read_report(json_path))
    except FicocoError as exc:
        return Run(side, round_, seconds, None, error_text(exc))


def _deterministic(row: dict[str, Any]) -> dict[str, Any]:
    values = {}
    for metric in DETERMINISTIC:
        node: Any = row
        for part in metric.path:
            node = node.get(part) if isinstance(node, dict) else None
        values[metric.name] = node
    return values


def combine(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """One report from several runs (processes) of one configuration on one machine, whose samples are
    the runs: a row's `samples_ms` holds each run's median latency (its raw samples stay, by run, in
    `samples_ms_by_run`), so its speedup is the median of the runs' own speedups and compare's
    Mann-Whitney test counts runs. Samples within one run are not independent: on a shared machine
    a whole row's samples move together when the other core gets busy (2x here), and pooling them
    would call that significant. Other measured figures are the median over runs. A row that failed
    in any run is failed; deterministic figures must agree between runs."""
    if not reports:
        raise FicocoError("no run to combine")
    combined = copy.deepcopy(reports[0])
    combined["combined"] = {"runs": len(reports), "samples_ms": "one per run: the run's median latency"}
    rows = {fingerprint(r): r for r in combined["rows"]}
    for key, row in rows.items():
        versions = [next((r for r in report["rows"] if fingerprint(r) == key), None) for report in reports]
        missing = [i for i, v in enumerate(versions) if v is None]
        if missing:
            raise FicocoError(f"{describe(key)} is missing from run(s) {', '.join(str(i + 1) for i in missing)}")
        failed = next((v for v in versions if v.get("status") != "ok"), None)
        if failed is not None:
            row.clear()
            row.update(copy.deepcopy(failed))
            continue
        figures = [_deterministic(v) for v in versions]
        if any(f != figures[0] for f in figures):
            raise FicocoError(f"{describe(key)}: deterministic figures differ between runs: {figures}")
        per_run = [v["latency"]["median_ms"] for v in versions]
        ordered = sorted(per_run)
        row["latency"].update(samples_ms=per_run, median_ms=statistics.median(per_run), min_ms=ordered[0],
                              p90_ms=ordered[max(0, -(-9 * len(ordered) // 10) - 1)],
                              stdev_ms=statistics.stdev(per_run) if len(per_run) > 1 else 0.0,
                              samples_ms_by_run=[v["latency"]["samples_ms"] for v in versions])
        row["images_per_s"] = row["batch"] / (row["latency"]["median_ms"] / 1e3)
        for name in ("memory_saving_vs_vanilla", "reduction_ms", "reduction_stages_ms", "probe_ms"):
            values = [v[name] for v in versions if isinstance(v.get(name), (int, float))]
            if len(values) == len(versions):
                row[name] = statistics.median(values)
        peaks = [(v.get("memory") or {}).get("peak_bytes") for v in versions]
        if row.get("memory") and all(isinstance(p, (int, float)) for p in peaks):
            row["memory"]["peak_bytes"] = statistics.median(peaks)
    for key, row in rows.items():
        vanilla = vanilla_of(rows, key)
        if row.get("status") == "ok" and vanilla is not None and vanilla.get("status") == "ok":
            row["speedup_vs_vanilla"] = statistics.median(speedup_samples(row, vanilla))
            row["reduction_share"] = row.get("reduction_ms", 0.0) / row["latency"]["median_ms"]
    return combined


@dataclass
class GateResult:
    base: Base
    runs: list[Run] = field(default_factory=list)
    reference: Comparison | None = None
    pair: Comparison | None = None
    recheck: Comparison | None = None  # the re-measured pair, when the first had a timed regression
    pair_skipped: str = ""  # why the timed pair was not judged, when it was not
    failures: list[str] = field(default_factory=list)  # what makes the gate fail besides regressions

    @property
    def timed_regressions(self) -> list[Verdict]:
        """The pair's regressions that stand: those of the first pass that the re-measurement
        reproduced (every one of them when there was no re-measurement)."""
        if self.pair is None:
            return []
        if self.recheck is None:
            return list(self.pair.regressions)
        again = {(v.metric, v.row) for v in self.recheck.regressions}
        return [v for v in self.pair.regressions if (v.metric, v.row) in again]

    @property
    def passed(self) -> bool:
        return not self.failures and not (self.reference and self.reference.regressions) and not (
            self.timed_regressions)


def speedups(comparison: Comparison) -> list[dict[str, Any]]:
    """The pair's speedup verdicts, one per reduced row: base and new speedup, change, verdict."""
    return [{"row": v.row, "base": v.base, "new": v.new, "change": v.change, "verdict": v.verdict,
             "detail": v.detail} for v in comparison.verdicts if v.metric == "speedup_vs_vanilla"]


def run_gate(root: Path, out: Path, *, reference: Path | None = None, base_override: str | None = None,
             rounds: int = ROUNDS, tolerance_pct: float = TOLERANCE_PCT, recheck: bool = True,
             log: Any = print) -> GateResult:
    """Profile base and new alternately, then judge: deterministic figures against the reference,
    timed ratios on the pair; a timed regression is measured again (`recheck`) and stands only when
    it reproduces. Files (each run, the combined reports, the comparisons) go to `out`."""
    if rounds < 1:
        raise FicocoError(f"--rounds {rounds} must be at least 1")
    reference = reference or root / REFERENCE
    reference_report = read_report(reference)
    base = choose_base(root, reference, base_override)
    result = GateResult(base)
    out.mkdir(parents=True, exist_ok=True)
    head = _git(root, "rev-parse", "HEAD") or ""
    dirty = bool(_git(root, "status", "--porcelain", "--untracked-files=no"))
    log(f"gate: new = the working tree at {head[:12]}{' with local edits' if dirty else ''}; base = "
        + (f"{base.commit[:12]}, {base.reason}" if base.commit else base.reason))
    base_code = None
    if base.commit is None:
        result.pair_skipped = f"no base commit ({base.reason})"
    else:
        if base.commit == head and not dirty:
            log("gate: the base is HEAD itself: the timed pair measures only the gate's own noise")
        base_code = export_commit(root, base.commit, Path(tempfile.mkdtemp(prefix="ficoco-gate-base-")))
    try:
        _alternate(result, root, base_code, out, rounds, log, pass_=1)
        if result.failures:
            _write(out / "gate.json", gate_json(result, tolerance_pct))
            return result
        new = combine(_reports(result, "new", 1))
        _write(out / "new.json", new)
        result.reference = compare(reference_report, new, judge="deterministic")
        if result.reference.only_base:
            result.failures.append("reference rows the gate's profile no longer produces: "
                                   + ", ".join(result.reference.only_base))
        _write(out / "reference-comparison.json", result.reference.to_json())
        if not result.pair_skipped:
            result.pair = _judge_pair(result, new, out, 1, tolerance_pct)
            if result.pair is not None and result.pair.regressions and recheck:
                log(f"gate: {len(result.pair.regressions)} timed regression(s) in the first pass; measuring base "
                    "and new again, interleaved, to see whether they reproduce")
                _alternate(result, root, base_code, out, rounds, log, pass_=2)
                if not result.failures and not result.pair_skipped:
                    result.recheck = _judge_pair(result, combine(_reports(result, "new", 2)), out, 2, tolerance_pct)
    finally:
        if base_code is not None:
            shutil.rmtree(base_code, ignore_errors=True)
    _write(out / "gate.json", gate_json(result, tolerance_pct))
    return result


def _reports(result: GateResult, side: str, pass_: int) -> list[dict[str, Any]]:
    return [r.report for r in result.runs if r.side == side and r.pass_ == pass_ and r.report is not None]


def _prefix(pass_: int) -> str:
    """The file-name prefix of a pass's runs and comparisons ("recheck-" for the re-measurement)."""
    return "" if pass_ == 1 else "recheck-"


def _judge_pair(result: GateResult, new: dict[str, Any], out: Path, pass_: int,
                tolerance_pct: float) -> Comparison | None:
    """The timed comparison of one pass's base runs with `new` (its new runs combined); None, with
    the reason in `pair_skipped`, when the base's runs cannot be combined."""
    prefix = _prefix(pass_)
    try:
        base_report = combine(_reports(result, "base", pass_))
    except FicocoError as exc:
        result.pair_skipped = f"the base's runs cannot be combined ({error_text(exc)})"
        return None
    _same_machine(base_report, new, result.base)
    _write(out / f"{prefix}base.json", base_report)
    if prefix:
        _write(out / f"{prefix}new.json", new)
    pair = compare(base_report, new, judge="timed", tolerance_pct=tolerance_pct)
    _write(out / f"{prefix}pair-comparison.json", pair.to_json())
    return pair


def _alternate(result: GateResult, root: Path, base_code: Path | None, out: Path, rounds: int, log: Any,
               pass_: int = 1) -> None:
    """The profile runs of one pass, ABBA: base, new, new, base, ... A base run that fails ends the
    base's runs (the pair is then not judged); a new run that fails ends the gate."""
    prefix = _prefix(pass_)
    for round_ in range(1, rounds + 1):
        for side in ("base", "new") if round_ % 2 else ("new", "base"):
            if side == "base" and (base_code is None or result.pair_skipped):
                continue
            run = run_profile(base_code if side == "base" else root, out / f"{prefix}{side}-{round_}.json",
                              side=side, round_=round_)
            run.pass_ = pass_
            result.runs.append(run)
            log(f"gate: {'re-measure ' if pass_ == 2 else ''}round {round_}/{rounds} {side:4} {run.seconds:5.1f} s  "
                + (_speedup_line(run.report) if run.report else f"FAILED: {run.error}"))
            if run.report is not None:
                continue
            if side == "base":
                result.pair_skipped = (f"the base {result.base.commit[:12]} cannot run the gate's profile "
                                       f"command ({run.error})")
            else:
                where = "the re-measurement, " if pass_ == 2 else ""
                result.failures.append(f"the new tree's profile failed in {where}round {round_}: {run.error}")
                return


def _same_machine(base_report: dict[str, Any], new_report: dict[str, Any], base: Base) -> None:
    """Both sides ran here, in this job: a base too old to record its processor gets the new runs'
    record of it (and says so), so compare does not refuse the pair as "unknown"."""
    env, new_env = base_report.setdefault("environment", {}), new_report.get("environment", {})
    env["git_commit"] = base.commit
    if processor(env)[0] is None and processor(new_env)[0] is not None:
        for key in ("device_kind", "device", "cpu", "cpu_flags", "cpu_capability", "cpu_isa_overrides"):
            env[key] = new_env.get(key)
        env["processor_note"] = "recorded by the gate: profiled on the same machine as new, in the same job"


def _speedup_line(report: dict[str, Any]) -> str:
    parts = [f"{r['variant']} {precision(r)} {r['speedup_vs_vanilla']:.3f}x" for r in report["rows"]
             if r.get("status") == "ok" and r.get("variant") != "vanilla" and r.get("speedup_vs_vanilla")]
    return "speedup " + ", ".join(parts) if parts else "no reduced row measured"


def _write(path: Path, data: dict[str, Any]) -> None:
    from ficoco.report import write_text_atomic

    write_text_atomic(str(path), json.dumps(data, indent=1, allow_nan=False, default=str) + "\n")


def gate_json(result: GateResult, tolerance_pct: float) -> dict[str, Any]:
    """The gate's outcome in one JSON object (what benchmarks/gate_noise.py collects)."""
    return {
        "schema": "ficoco.gate/1", "passed": result.passed, "base": vars(result.base),
        "tolerance_pct": tolerance_pct, "failures": result.failures, "pair_skipped": result.pair_skipped,
        "runs": [{"side": r.side, "round": r.round, "pass": r.pass_, "seconds": r.seconds, "error": r.error}
                 for r in result.runs],
        "reference_regressions": [f"{v.metric} ({v.row})" for v in result.reference.regressions]
        if result.reference else None,
        "pair_regressions": [f"{v.metric} ({v.row})" for v in result.pair.regressions] if result.pair else None,
        "recheck_regressions": [f"{v.metric} ({v.row})" for v in result.recheck.regressions]
        if result.recheck else None,
        "standing_regressions": [f"{v.metric} ({v.row})" for v in result.timed_regressions],
        "speedups": speedups(result.pair) if result.pair else [],
        "recheck_speedups": speedups(result.recheck) if result.recheck else [],
    }


def render(result: GateResult) -> str:
    """What CI prints: the pair's speedups, every verdict that is not ok, and the outcome."""
    lines = []
    if result.reference is not None:
        judged = [v for v in result.reference.verdicts if v.kind == "deterministic" or v.metric == "status"]
        bad = [v for v in judged if v.verdict not in ("ok", "not judged")]
        lines.append(f"deterministic figures against the committed reference: {len(judged)} judged, "
                     f"{len(result.reference.regressions)} regression(s)")
        lines += [f"  {v.verdict}: {v.metric} ({v.row}) {v.base} -> {v.new}: {cli_message(v.detail)}" for v in bad]
        lines += [f"  warning: {cli_message(w)}" for w in result.reference.warnings]
    for label, pair in (("", result.pair), ("re-measured: ", result.recheck)):
        if pair is None:
            continue
        lines.append(f"{label}timed ratios, base against new on this machine: {len(pair.regressions)} regression(s)")
        lines.append(f"  {'row':44} {'base':>8} {'new':>8} {'change':>8}  verdict")
        for s in speedups(pair):
            change = "-" if s["change"] is None else f"{s['change'] * 100:+.1f}%"
            lines.append(f"  {s['row']:44} {s['base'] or 0:8.3f} {s['new'] or 0:8.3f} {change:>8}  "
                         f"{s['verdict']} ({cli_message(s['detail'])})")
        # Deterministic figures are the reference's to judge; a row that failed is shown here too.
        others = [v for v in pair.verdicts if v.metric != "speedup_vs_vanilla"
                  and (v.kind != "deterministic" or v.metric == "status")
                  and v.verdict in ("regression", "noise", "missing")]
        lines += [f"  {v.verdict}: {v.metric} ({v.row}): {cli_message(v.detail)}" for v in others]
        lines += [f"  warning: {cli_message(w)}" for w in pair.warnings]
    if result.recheck is not None and result.pair is not None:
        standing = {(v.metric, v.row) for v in result.timed_regressions}
        for v in result.pair.regressions:
            outcome = "reproduced: it stands" if (v.metric, v.row) in standing else "not reproduced: noise, not judged"
            lines.append(f"  first-pass regression {v.metric} ({v.row}): {outcome}")
    if result.pair_skipped:
        lines.append(f"timed ratios NOT judged: {result.pair_skipped}")
    lines += [f"failure: {f}" for f in result.failures]
    lines.append("gate: " + ("pass" if result.passed else "FAIL"))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """`python -m ficoco_cli.gate`: exit 0 pass, 1 regression or a failed new run, 2 bad setup."""
    parser = argparse.ArgumentParser(prog="python -m ficoco_cli.gate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", default=".", help="the git checkout under test (default: here)")
    parser.add_argument("--reference", help=f"the committed reference (default: ROOT/{REFERENCE})")
    parser.add_argument("--base", help=f"the base revision (default: ${BASE_VARIABLE}, else the rule above)")
    parser.add_argument("--rounds", type=int, default=ROUNDS, help=f"ABBA rounds (default {ROUNDS})")
    parser.add_argument("--tolerance", type=float, default=TOLERANCE_PCT,
                        help=f"percent a speedup may move between base and new (default {TOLERANCE_PCT:g})")
    parser.add_argument("--out", help="keep every run's report and the comparisons here (default: a temp folder)")
    parser.add_argument("--no-recheck", action="store_true",
                        help="judge a timed regression on the first pass alone (no re-measurement)")
    args = parser.parse_args(argv)
    root = Path(args.root).resolve()
    out = Path(args.out).resolve() if args.out else Path(tempfile.mkdtemp(prefix="ficoco-gate-"))
    try:
        result = run_gate(root, out, reference=Path(args.reference).resolve() if args.reference else None,
                          base_override=args.base or os.environ.get(BASE_VARIABLE), rounds=args.rounds,
                          tolerance_pct=args.tolerance, recheck=not args.no_recheck)
    except FicocoError as exc:
        print(f"error: {error_text(exc)}", file=sys.stderr)
        return 2
    print(render(result))
    print(f"gate: every run's report and both comparisons are in {out}")
    return 0 if result.passed else 1


if __name__ == "__main__":
    sys.exit(main())
