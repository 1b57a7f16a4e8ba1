"""Writes tests/golden/flops.json.gz: what `ficoco flops --json` reports for every shipped profile x
method x convention x quant x budget form, made on main before a refactor so that
tests/test_flops_golden.py can prove the refactor moved no figure.

    python tests/golden/make_flops_golden.py          # rewrite (only when a figure is meant to move)
    python tests/golden/make_flops_golden.py --add qwen3-vl-8b qwen3-vl-tiny   # add (or redo) these profiles'
                                                                               # cases; every other case stays
    python tests/golden/make_flops_golden.py --add-methods vtw gprune         # add (or redo) these methods'
                                                                               # cases (a later wave's)

The methods come in waves (`METHOD_WAVES`): each wave's methods are counted in cases of their own, so that
adding a wave adds rows and moves none (`--add-methods NAME...` computes those methods' cases and keeps every
other case as it is). A registered method in no wave fails the golden test.

The environment and version fields are left out: they describe the machine, not the count.
"""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
GOLDEN = HERE / "flops.json.gz"
# The fields of a report that say where and when it was made, not what it counts.
VOLATILE = ("environment", "ficoco_version")
# The methods of each case, wave by wave: the first fourteen (FiCoCo and the baselines of 2024-2025), counted together
# in every convention, then the methods the 2025-2026 literature compares against (issue 53), each in cases of its
# own (one variant refused by a budget ends a whole case in an error, and these refuse budgets often: PixelPrune has
# none), in the `flops` convention over the whole model (the conventions are the accountant's, the same for every
# method: the first wave holds them). A new method joins a wave of its own, so that no existing case changes.
METHOD_WAVES: tuple[tuple[str, ...], ...] = (
    ("v", "l", "fastv", "pdrop", "sparsevlm", "dart", "tome", "visionzip", "fastervlm", "prumerge", "divprune",
     "vispruner", "cdpruner", "holitom"),
    ("fitprune", "hiprune", "vlmpruner", "gprune", "vtw", "pixelprune", "vitcop", "vscan", "flashvid", "mustdrop"),
)


def cases() -> list[dict]:
    """Every profile x convention x scope x budget form; all methods and quants in each call."""
    from ficoco.accounting.flops import CONVENTIONS, LLM_ONLY_CONVENTIONS
    from ficoco.methods import METHODS
    from ficoco.profiles import list_profiles

    unplaced = [name for name in METHODS if not any(name in wave for wave in METHOD_WAVES)]
    if unplaced:
        raise SystemExit(f"methods in no wave of METHOD_WAVES: {', '.join(unplaced)}; add them as a new wave")
    budgets = [{}, {"preset": 64}, {"preset": 192}, {"keep": 100}, {"keep": 16}, {"tflops": 1.5}, {"tflops": 3.3},
               {"schedule": "2:100", "variants": ["v", "l", "fastv", "pdrop", "tome"]}]
    out = []
    for model in list_profiles():
        for convention in CONVENTIONS:
            scopes = ("llm",) if convention in LLM_ONLY_CONVENTIONS else ("llm", "all")
            for scope in scopes:
                for index, wave in enumerate(METHOD_WAVES[:1]):
                    for budget in budgets:
                        budget = dict(budget)
                        if "variants" in budget and index:  # the --schedule case names first-wave methods
                            continue
                        names = budget.pop("variants", list(wave))
                        out.append({"model": model, "variants": names, "convention": convention, "scope": scope,
                                    "quants": ["fp16", "int8", "int4"], "per_layer": True, "gpu": "h100-sxm",
                                    **budget})
    # The later waves: each method alone, in the `flops` convention over the whole model, and on a video of 8 frames
    # (FlashVID's only input; the other methods' frames).
    for model in list_profiles():
        for wave in METHOD_WAVES[1:]:
            for name in wave:
                for budget in (*budgets, {"frames": 8}):
                    if "variants" not in budget:
                        out.append({"model": model, "variants": [name], "convention": "flops", "scope": "all",
                                    "quants": ["fp16", "int8", "int4"], "per_layer": True, "gpu": "h100-sxm",
                                    **budget})
    # The count's other options, once each on the main job's model.
    for options in ({"equivalent": True}, {"kv_bits": 4}, {"batch": 2}, {"text_tokens": 100}, {"lm_head": "last"},
                    {"first_layer": 4, "tflops": 2.0}, {"shape": "uniform", "tflops": 2.0}):
        for names in (list(METHOD_WAVES[0]), *([name] for wave in METHOD_WAVES[1:] for name in wave)):
            out.append({"model": "llava-1.5-7b", "variants": names, "convention": "flops", "scope": "all",
                        "quants": ["fp16", "int8", "int4"], "per_layer": True, "gpu": "a800-80gb", **options})
    return out


def run(case: dict) -> dict:
    """The report for one case, or the one-line error it ends in (a refused budget is a figure too)."""
    import ficoco
    from ficoco.errors import FicocoError

    kwargs = {k: v for k, v in case.items() if k not in ("model", "variants")}
    try:
        report = ficoco.flops(case["model"], case["variants"], **kwargs)
    except FicocoError as error:
        return {"error": str(error)}
    return {k: v for k, v in report.items() if k not in VOLATILE}


def main() -> None:
    args = sys.argv[1:]
    if args and args[0] == "--add-methods":
        # A later wave's methods' cases, made on purpose: every other case is kept as it is.
        named = set(args[1:])
        if not named:
            raise SystemExit("--add-methods needs the methods whose cases to add")
        later = {name for wave in METHOD_WAVES[1:] for name in wave}
        if not named <= later:
            raise SystemExit(f"{', '.join(sorted(named - later))}: not in a later wave of METHOD_WAVES")

        def of_added(case: dict) -> bool:
            return set(case["variants"]) <= named

        kept = [entry for entry in json.loads(gzip.decompress(GOLDEN.read_bytes())) if not of_added(entry["case"])]
        new = [{"case": case, "report": run(case)} for case in cases() if of_added(case)]
        order = {json.dumps(case, sort_keys=True): k for k, case in enumerate(cases())}
        results = sorted(kept + new, key=lambda entry: order.get(json.dumps(entry["case"], sort_keys=True), -1))
    elif args and args[0] == "--add":
        # A new profile's cases, made on purpose: the cases of every other profile are kept as they are.
        added = set(args[1:])
        if not added:
            raise SystemExit("--add needs the profiles whose cases to add")
        kept = [entry for entry in json.loads(gzip.decompress(GOLDEN.read_bytes()))
                if entry["case"]["model"] not in added]
        new = [{"case": case, "report": run(case)} for case in cases() if case["model"] in added]
        order = {json.dumps(case, sort_keys=True): k for k, case in enumerate(cases())}
        results = sorted(kept + new, key=lambda entry: order.get(json.dumps(entry["case"], sort_keys=True), -1))
    elif args:
        raise SystemExit(f"unknown arguments {args}: give none (rewrite all), --add PROFILE... or --add-methods "
                         "NAME...")
    else:
        results = [{"case": case, "report": run(case)} for case in cases()]
    data = json.dumps(results, sort_keys=True, separators=(",", ":")).encode()
    with gzip.GzipFile(GOLDEN, "wb", mtime=0) as f:
        f.write(data)
    print(f"{len(results)} cases -> {GOLDEN} ({GOLDEN.stat().st_size} bytes)", file=sys.stderr)


if __name__ == "__main__":
    main()
