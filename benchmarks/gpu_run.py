"""The Python half of benchmarks/gpu_run.sh: what a shell does badly (deciding, planning, summing up).

    python benchmarks/gpu_run.py install DIR --record FILE       # the carried wheels, offline, where needed
    python benchmarks/gpu_run.py env --device cuda|cpu ...        # the environment step's report and verdict
    python benchmarks/gpu_run.py plan --models A,B --variants ... # keep groups that run every method (no torch)
    python benchmarks/gpu_run.py ready quant|pytest|lmms          # exit 0 when a step's tools are there
    python benchmarks/gpu_run.py fits MODEL --margin-gb 4         # the accountant's weights against free GPU memory
    python benchmarks/gpu_run.py lmms --device cuda --out DIR     # the lmms-eval plugin on a tiny checkpoint
    python benchmarks/gpu_run.py tally STEP_DIR                   # a profile step's verdict from its checks
    python benchmarks/gpu_run.py record / summary ...             # a step's line; summary.json and summary.txt

Each subcommand prints what it found; `why` files hold the one line a step's verdict gives.
"""

from __future__ import annotations

import argparse
import importlib.metadata as metadata
import json
import os
import re
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# The packages a step needs beside ficoco's own imports, and why.
QUANT_PACKAGES = ("bitsandbytes", "hqq")  # int8/int4 weights; their quantized KV cache (transformers' HQQ backend)


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _write(path: str | None, text: str) -> None:
    if path:
        Path(path).write_text(text.rstrip("\n") + "\n")


# ---- install: the carried wheels, offline ---------------------------------------------------------------------

def _wheel_name(path: Path) -> tuple[str, str]:
    """(normalised distribution name, version) from a wheel's file name (PEP 427)."""
    parts = path.name[:-len(".whl")].split("-")
    return re.sub(r"[-_.]+", "-", parts[0]).lower(), parts[1]


def cmd_install(args: argparse.Namespace) -> int:
    from packaging.version import InvalidVersion, Version

    folder = Path(args.wheels)
    wheels = sorted(folder.glob("*.whl")) if folder.is_dir() else []
    record: dict = {"carried": folder.name if folder.is_dir() else None, "installed": [], "kept": [], "how": None}
    if not wheels:
        print(f"nothing carried: no {folder}/*.whl (bash benchmarks/gpu_wheels.sh fetches them; a machine with "
              "network pip installs instead)")
        Path(args.record).write_text(json.dumps(record, indent=1))
        return 0
    chosen = []
    for wheel in wheels:
        name, version = _wheel_name(wheel)
        installed = _version(name)
        try:
            newer_here = installed is not None and Version(installed) >= Version(version)
        except InvalidVersion:
            newer_here = False
        if newer_here:
            record["kept"].append(f"{name} {installed} (carried {version})")
            say(f"keep    {name} {installed}: the carried {version} is not newer")
        else:
            chosen.append(wheel)
            record["installed"].append(f"{name} {version}" + (f" (was {installed})" if installed else ""))
            say(f"install {name} {version}" + (f" over {installed}" if installed else " (absent here)"))
    if not chosen:
        Path(args.record).write_text(json.dumps(record, indent=1))
        return 0
    pip = subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True, text=True)
    if pip.returncode == 0:
        # No index, no dependencies, no build isolation: nothing here may reach a network.
        command = [sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", "--no-build-isolation",
                   "--disable-pip-version-check", "--quiet", *map(str, chosen)]
        record["how"] = "pip install --no-index --no-deps"
        done = subprocess.run(command, capture_output=True, text=True)
        print(done.stdout[-2000:] + done.stderr[-2000:], end="")
        if done.returncode == 0:
            Path(args.record).write_text(json.dumps(record, indent=1))
            return 0
        print(f"pip install failed (exit {done.returncode}); unpacking the wheels into {args.site} instead")
    # No pip, or an environment pip cannot write: a wheel is a zip of what site-packages would hold; gpu_run.sh
    # puts this folder on PYTHONPATH ahead of the environment's own packages.
    site = Path(args.site)
    site.mkdir(parents=True, exist_ok=True)
    for wheel in chosen:
        with zipfile.ZipFile(wheel) as archive:
            archive.extractall(site)
    record["how"] = f"unpacked into {site} (on PYTHONPATH)"
    Path(args.record).write_text(json.dumps(record, indent=1))
    return 0


# ---- env: the environment step -------------------------------------------------------------------------------

def say(text: str) -> None:
    """A line gpu_run.sh shows on its console too (it shows a step's lines that start with two spaces)."""
    print("\n".join(f"  {line}" for line in text.splitlines()))


def _nvidia_smi() -> str | None:
    if shutil.which("nvidia-smi") is None:
        return None
    done = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,memory.used,driver_version",
                           "--format=csv,noheader"], capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else f"nvidia-smi failed: {done.stderr.strip()[:200]}"


def _import(name: str) -> str | None:
    """None when `name` imports, else the one line why not."""
    try:
        __import__(name)
    except Exception as exc:  # a broken install is a finding, not a crash of this step
        return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]
    return None


def quant_ready(device: str) -> str | None:
    """None when int8/int4 can run on `device`, else why not."""
    for name in QUANT_PACKAGES:
        if _version(name) is None:
            return f"{name} is not installed (carry it: bash benchmarks/gpu_wheels.sh)"
        failed = _import(name)
        if failed:
            return f"{name} does not import: {failed}"
    if device == "cuda":
        from bitsandbytes import cextension

        if type(cextension.lib).__name__.startswith("ErrorHandlerMock"):
            import torch

            return (f"bitsandbytes {_version('bitsandbytes')} has no native library for CUDA {torch.version.cuda} "
                    "(gpu_wheels.sh keeps CUDA 12.8/13.0/13.2 only: GPU_WHEELS_BNB_CUDA)")
    return None


def lmms_ready() -> str | None:
    if _version("lmms_eval") is None and _version("lmms-eval") is None:
        return "lmms-eval is not installed here (not carried: it and its dependencies, datasets and pyarrow " \
               "among them, are far above the 64 MiB a call sends)"
    failed = _import("lmms_eval")
    if failed:
        return f"lmms-eval does not import: {failed}"
    if not any(e.name == "ficoco" for e in metadata.entry_points(group="lmms_eval.models")):
        return "ficoco's lmms-eval entry point is not registered (pip install --no-deps -e . registers it)"
    return None


def pytest_ready() -> str | None:
    if _version("pytest") is None:
        return "pytest is not installed (carry it: bash benchmarks/gpu_wheels.sh)"
    return None


def cmd_ready(args: argparse.Namespace) -> int:
    """Exit 0 when `what` is ready; else print why and exit 1. The environment step's findings when it wrote them
    (`--env`: asking again imports torch and bitsandbytes, seconds a step)."""
    if args.env and Path(args.env).is_file():
        why = json.loads(Path(args.env).read_text()).get("not_ready", {}).get(args.what)
    else:
        check = {"quant": lambda: quant_ready(args.device), "pytest": pytest_ready, "lmms": lmms_ready}[args.what]
        why = check()
    if why:
        print(why)
    return 1 if why else 0


def cmd_env(args: argparse.Namespace) -> int:
    found: dict = {"device_asked": args.device, "python": sys.version.split()[0], "nvidia_smi": _nvidia_smi()}
    install = json.loads(Path(args.install).read_text()) if args.install and Path(args.install).is_file() else None
    found["install"] = install
    problems: list[str] = []
    say(f"python {found['python']} ({sys.executable})")
    say(f"nvidia-smi: {found['nvidia_smi'] or 'not found'}")
    failed = _import("torch")
    if failed:
        problems.append(f"torch does not import: {failed}")
    else:
        import torch

        found |= {"torch": torch.__version__, "torch_cuda": torch.version.cuda,
                  "cuda_available": torch.cuda.is_available()}
        say(f"torch {torch.__version__}, built for CUDA {torch.version.cuda}, cuda available: "
              f"{torch.cuda.is_available()}")
        if torch.cuda.is_available():
            free, total = torch.cuda.mem_get_info()
            name = torch.cuda.get_device_name(0)
            found |= {"gpu": name, "gpu_count": torch.cuda.device_count(),
                      "capability": ".".join(map(str, torch.cuda.get_device_capability(0))),
                      "gpu_free_bytes": free, "gpu_total_bytes": total}
            say(f"GPU 0: {name}, capability {found['capability']}, {free / 2**30:.1f} of {total / 2**30:.1f} GiB "
                  f"free, {found['gpu_count']} device(s)")
        elif args.device == "cuda":
            problems.append("torch sees no CUDA device (a CPU build of torch, or no driver)")
    for name in ("transformers", "accelerate", "bitsandbytes", "hqq", "pytest", "lmms_eval", "typer", "rich",
                 "nvidia-ml-py", "pillow", "fvcore"):
        found[name] = _version(name)
    say("packages: " + ", ".join(f"{n} {found[n] or '-'}" for n in ("transformers", "accelerate", "bitsandbytes",
                                                                       "hqq", "pytest", "lmms_eval", "pillow")))
    failed = _import("ficoco_cli.app")
    if failed:
        problems.append(f"ficoco does not import: {failed}")
    else:
        import ficoco
        from ficoco.versions import outside_tested_range, package_versions

        found["ficoco"] = f"{ficoco.__version__} from {Path(ficoco.__file__).parent.parent}"
        found["tested"] = [p.describe() for p in package_versions()]
        found["outside_tested_range"] = [p.name for p in outside_tested_range()]
        say(f"ficoco {found['ficoco']}")
        for line in found["tested"]:
            say(f"  {line}")
    readiness = {"quant": quant_ready(args.device) if "torch" in found else "torch is missing",
                 "pytest": pytest_ready(), "lmms": lmms_ready()}
    found["not_ready"] = {k: v for k, v in readiness.items() if v}
    for what, why in readiness.items():
        say(f"{what}: {'ready' if why is None else why}")
    if install:
        say(f"carried and installed: {', '.join(install['installed']) or 'nothing'}"
              + (f" ({install['how']})" if install.get("how") else "")
              + (f"; kept: {', '.join(install['kept'])}" if install["kept"] else ""))
    Path(args.json).write_text(json.dumps(found, indent=1, default=str))
    if problems:
        _write(args.why, problems[0])
        say("\n".join(problems))
        return 1
    where = found.get("gpu") or "CPU"
    outside = f"; OUTSIDE the tested range: {', '.join(found['outside_tested_range'])}" \
        if found["outside_tested_range"] else ""
    installed = f"; installed {', '.join(install['installed'])}" if install and install["installed"] else ""
    _write(args.why, f"{where}, torch {found['torch']} (CUDA {found.get('torch_cuda')}), transformers "
                     f"{found['transformers']}, bitsandbytes {found['bitsandbytes'] or '-'}{installed}{outside}")
    return 0


# ---- plan: keep groups that run every method on a tiny family (torch-free, the accountant only) ----------------

# Keyword settings a family needs for a method to run at all (reports/README.md: FastV on Qwen3.5 at layer 4).
FAMILY_SETTINGS = {"qwen3_5": ({"layer": 4},)}


def _reachable(model: str, variants: list[str], keep: int, settings: dict) -> tuple[set[str], dict[str, str]]:
    """The variants the accountant runs at `keep` under `settings`, and why each other one is left out."""
    import ficoco
    from ficoco.errors import FicocoError

    try:
        report = ficoco.flops(model, ",".join(variants), keep=keep, hyperparameters=settings or None)
        return {r["variant"] for r in report["rows"]}, {s["variant"]: s["reason"] for s in report["skipped"]}
    except FicocoError:  # one variant refused outright: ask one at a time
        pass
    ran, why = set(), {}
    for variant in variants:
        try:
            report = ficoco.flops(model, variant, keep=keep, hyperparameters=settings or None)
            ran |= {r["variant"] for r in report["rows"]}
            why |= {s["variant"]: s["reason"] for s in report["skipped"]}
        except FicocoError as exc:
            why[variant] = str(exc)
    return ran, why


def plan_model(model: str, variants: list[str]) -> tuple[list[tuple[int, dict, list[str]]], list[tuple[str, str]]]:
    """The fewest (keep, settings) groups that run every variant the family runs, each keep as near half the
    visual tokens as the methods allow; and (variant, reason) for those the family refuses or no keep reaches."""
    import ficoco
    from ficoco.methods.registry import method_matrix
    from ficoco.profiles import load_profile

    family = load_profile(model).family
    cells = {row["name"]: row["families"][family] for row in method_matrix([family])}
    refused = [(v, f"refused by {family}: {cells[v]['reason']}") for v in variants
               if v != "vanilla" and cells.get(v, {}).get("status") != "yes"]
    wanted = [v for v in variants if v != "vanilla" and v not in dict(refused)]
    tokens = int(ficoco.flops(model, "vanilla")["rows"][0]["visual_tokens"])
    options: dict[tuple[int, str], set[str]] = {}
    reasons: dict[str, str] = {}
    for settings in ({}, *FAMILY_SETTINGS.get(family, ())):
        key = json.dumps(settings, sort_keys=True)
        for keep in range(1, tokens + 1):
            ran, why = _reachable(model, wanted, keep, settings)
            options[(keep, key)] = ran & set(wanted)
            for variant, reason in why.items():
                if keep == max(1, tokens // 2) and not settings:
                    reasons.setdefault(variant, reason)
    groups, left = [], list(wanted)
    # Keeps that reduce first (at every visual token a method may run without removing one); a variant that
    # runs at no other keep (SparseVLM's published schedules start at 64 tokens) then runs at all of them.
    for reducing in (True, False):
        candidates = {k: v for k, v in options.items() if (k[0] < tokens) == reducing}
        while left and candidates:
            # Most variants first; then plain settings; then the keep nearest half the visual tokens.
            (keep, key), covered = max(candidates.items(), key=lambda item: (
                len(item[1] & set(left)), item[0][1] == "{}", -abs(item[0][0] - tokens / 2)))
            covered = covered & set(left)
            if not covered:
                break
            groups.append((keep, json.loads(key), [v for v in wanted if v in covered]))
            left = [v for v in left if v not in covered]
    refused += [(v, f"no keep in 1..{tokens} runs it: {reasons.get(v, 'left out at every keep')}") for v in left]
    return groups, refused


def cmd_plan(args: argparse.Namespace) -> int:
    """One line a group: run<TAB>MODEL<TAB>KEEP<TAB>--hp values (or -)<TAB>VARIANTS; refusals: refused<TAB>MODEL<TAB>
    VARIANT<TAB>REASON."""
    variants = args.variants.split(",")
    for model in args.models.split(","):
        groups, refused = plan_model(model, variants)
        for keep, settings, names in groups:
            hp = ",".join(f"{k}={v}" for k, v in settings.items()) or "-"
            print(f"run\t{model}\t{keep}\t{hp}\t{','.join(['vanilla', *names])}")
        for variant, reason in refused:
            print(f"refused\t{model}\t{variant}\t{reason}")
    return 0


# ---- fits: a model's weights against the GPU's free memory ----------------------------------------------------

def cmd_fits(args: argparse.Namespace) -> int:
    import ficoco

    weights = ficoco.flops(args.model, "vanilla", quants="fp16")["rows"][0]["weight_bytes"]  # 16-bit: bf16 alike
    import torch

    if not torch.cuda.is_available():
        print(f"{args.model}: {weights / 1e9:.1f} GB of 16-bit weights; no CUDA device here")
        return 1
    free, total = torch.cuda.mem_get_info()
    need = weights + args.margin_gb * 1e9
    print(f"{args.model}: {weights / 1e9:.1f} GB of bf16 weights (the accountant) + {args.margin_gb:g} GB for "
          f"activations and cache = {need / 1e9:.1f} GB; the GPU has {free / 1e9:.1f} of {total / 1e9:.1f} GB free")
    return 0 if need <= free else 1


# ---- lmms: the lmms-eval plugin on a tiny checkpoint ---------------------------------------------------------

def cmd_lmms(args: argparse.Namespace) -> int:
    sys.path.insert(0, str(ROOT / "tests"))
    from helpers import make_checkpoint, make_eval_task, run_lmms_eval

    out = Path(args.out)
    checkpoint = make_checkpoint("llava", out / "checkpoint")
    tasks = make_eval_task(out / "tasks", "ficoco_colours", size=(112, 112))
    bad = []
    for method, budget in (("vanilla", ""), ("v", ",keep=16")):
        model_args = (f"pretrained={checkpoint},method={method},profile=llava-tiny,device={args.device}"
                      f"{budget},out={out / method / 'ficoco.json'}")
        print(f"lmms-eval --model ficoco --model_args {model_args} --tasks ficoco_colours")
        result, results, samples = run_lmms_eval(out / method, model_args, "ficoco_colours", tasks, batch_size=2)
        (out / method / "stderr.txt").write_text(result.err[-20000:])
        if result.code != 0 or results is None:
            bad.append(f"{method}: lmms-eval exit {result.code}: {result.err.strip().splitlines()[-1:]}")
            continue
        score = results["results"]["ficoco_colours"].get("exact_match,none")
        record = json.loads((out / method / "ficoco.json").read_text())
        costed = record.get("samples", [])
        tokens = sorted({s.get("visual_tokens") for s in costed}, key=str)
        print(f"  {method}: exact_match {score}, {len(samples)} samples logged, visual tokens per sample {tokens}, "
              f"TFLOPs mean {record.get('tflops_mean')}, device {record.get('device')}")
        if len(samples) != 4 or len(costed) != 4 or any(s.get("tflops") is None for s in costed):
            bad.append(f"{method}: {len(samples)} samples logged, {len(costed)} costed in the record")
        elif not str(record.get("device")).startswith(args.device):
            bad.append(f"{method}: ran on {record.get('device')}, not {args.device}")
    if bad:
        _write(args.why, bad[0])
        return 1
    _write(args.why, f"vanilla and v (keep 16) through `lmms-eval --model ficoco` on a tiny LLaVA checkpoint, "
                     f"device={args.device}: 4 samples each, visual tokens and TFLOPs recorded")
    return 0


# ---- tally: a profile step's verdict ------------------------------------------------------------------------

def cmd_tally(args: argparse.Namespace) -> int:
    """Read STEP_DIR/checks.tsv (one line per report: name, profile exit, check exit, rows, first problem) and
    STEP_DIR/refused.tsv; write the step's why; exit 1 when any report failed."""
    folder = Path(args.step_dir)
    lines = [line.split("\t") for line in (folder / "checks.tsv").read_text().splitlines() if line.strip()] \
        if (folder / "checks.tsv").is_file() else []
    refused = [line.split("\t") for line in (folder / "refused.tsv").read_text().splitlines() if line.strip()] \
        if (folder / "refused.tsv").is_file() else []
    failed = [line for line in lines if line[1] != "0" or line[2] != "0"]
    rows = sum(int(line[3]) for line in lines if line[3].isdigit())
    refusals = f"; {len(refused)} refused by their family or budget ({', '.join(f'{m}:{v}' for m, v, *_ in refused)})" \
        if refused else ""
    for model, variant, reason in refused:
        print(f"  refused {model} {variant}: {reason}")
    if not lines:
        _write(args.why, "no report was made")
        return 1
    if failed:
        name, profile_rc, check_rc, _, problem = (failed[0] + ["", "", "", "", ""])[:5]
        _write(args.why, f"{len(failed)} of {len(lines)} report(s) failed; first: {name} (profile exit {profile_rc}, "
                         f"check exit {check_rc}): {problem}")
        return 1
    _write(args.why, f"{len(lines)} report(s), {rows} row(s) ok and checked{refusals}")
    return 0


def cmd_report_rows(args: argparse.Namespace) -> int:
    """The number of rows in a report (0 when unreadable)."""
    try:
        print(len(json.loads(Path(args.report).read_text())["rows"]))
    except (OSError, ValueError, KeyError):
        print(0)
    return 0


# ---- record and summary ----------------------------------------------------------------------------------------

def cmd_record(args: argparse.Namespace) -> int:
    entry = {"name": args.name, "title": args.title, "status": args.status, "why": args.why,
             "seconds": round(args.seconds, 1), "estimate_s": args.estimate, "expect": args.expect}
    with open(args.file, "a") as f:
        f.write(json.dumps(entry) + "\n")
    return 0


def cmd_summary(args: argparse.Namespace) -> int:
    steps = [json.loads(line) for line in Path(args.steps).read_text().splitlines() if line.strip()]
    counts = {status: sum(s["status"] == status for s in steps) for status in ("PASS", "FAIL", "SKIPPED")}
    env_file = Path(args.env)
    environment = json.loads(env_file.read_text()) if env_file.is_file() else None
    summary = {"schema": "ficoco.gpu_run/1", "device": args.device, "scope": args.scope,
               "deadline_s": args.deadline, "wall_s": round(args.wall, 1),
               "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "counts": counts, "steps": steps,
               "environment": environment, "files": args.files.split(",")}
    Path(args.out, "summary.json").write_text(json.dumps(summary, indent=1, default=str) + "\n")
    width = max(len(s["name"]) for s in steps) if steps else 10
    text = [f"gpu_run.sh on {args.device} (scope {args.scope}): {counts['PASS']} PASS, {counts['FAIL']} FAIL, "
            f"{counts['SKIPPED']} SKIPPED in {args.wall:.0f} s (deadline {args.deadline} s)"]
    for s in steps:
        text.append(f"{s['status']:7} {s['name']:{width}} {s['seconds']:6.0f} s (est. {s['estimate_s']:>4} s)  "
                    f"{s['why']}")
    text.append(f"files in {args.out}: {', '.join(summary['files'])}")
    Path(args.out, "summary.txt").write_text("\n".join(text) + "\n")
    print("\n".join(text))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("install")
    p.add_argument("wheels")
    p.add_argument("--record", required=True)
    p.add_argument("--site", required=True)
    p = sub.add_parser("env")
    p.add_argument("--device", required=True)
    p.add_argument("--install")
    p.add_argument("--json", required=True)
    p.add_argument("--why")
    p = sub.add_parser("ready")
    p.add_argument("what", choices=("quant", "pytest", "lmms"))
    p.add_argument("--device", default="cuda")
    p.add_argument("--env", help="the environment step's environment.json")
    p = sub.add_parser("plan")
    p.add_argument("--models", required=True)
    p.add_argument("--variants", required=True)
    p = sub.add_parser("fits")
    p.add_argument("model")
    p.add_argument("--margin-gb", type=float, default=4.0)
    p = sub.add_parser("lmms")
    p.add_argument("--device", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--why")
    p = sub.add_parser("tally")
    p.add_argument("step_dir")
    p.add_argument("--why")
    p = sub.add_parser("rows")
    p.add_argument("report")
    p = sub.add_parser("record")
    for name in ("file", "name", "title", "status", "why", "expect"):
        p.add_argument(f"--{name}", required=True)
    p.add_argument("--seconds", type=float, required=True)
    p.add_argument("--estimate", type=int, required=True)
    p = sub.add_parser("summary")
    for name in ("steps", "env", "out", "device", "scope", "files"):
        p.add_argument(f"--{name}", required=True)
    p.add_argument("--deadline", type=int, required=True)
    p.add_argument("--wall", type=float, required=True)
    args = parser.parse_args()
    commands = {"install": cmd_install, "env": cmd_env, "ready": cmd_ready, "plan": cmd_plan, "fits": cmd_fits,
                "lmms": cmd_lmms, "tally": cmd_tally, "rows": cmd_report_rows, "record": cmd_record,
                "summary": cmd_summary}
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return commands[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
