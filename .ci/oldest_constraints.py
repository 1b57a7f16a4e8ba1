"""Print pip constraints that pin every package whose internals ficoco touches to the lower bound of
its tested range in pyproject.toml (`name==lower`), for CI's run on the oldest allowed releases.

The bounds are read from pyproject.toml, so raising a lower bound there changes what CI tests. torch
is left out on purpose: its lower bound (2.11) is the build the project's lent GPU machine comes with,
below what CI installs, and CI installs torch first at the README's pin (2.13.0, the CPU build here), so
the oldest-release run tests torch 2.13 beside the other packages' lower bounds; torch 2.11 is exercised
by benchmarks/gpu_run.sh on that machine (docs/install.md, "Tested releases").

`--requirements` prints instead every requirement of ficoco with its `dev` extra (extras of ficoco itself
expanded), so that CI can install them while the suite runs and ficoco itself (`--no-deps`) after it: two
editable builds of one tree at once would write the same build metadata.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import tomllib

PACKAGES = ("transformers", "accelerate", "hqq", "bitsandbytes")  # never torch: see above


def lower_bounds(pyproject: Path) -> dict[str, str]:
    dependencies = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    bounds = {}
    for requirement in dependencies:
        name = re.match(r"[A-Za-z0-9_.-]+", requirement).group(0).lower()
        lower = re.search(r">=\s*([^,;\s]+)", requirement)
        if name in PACKAGES:
            if lower is None:
                sys.exit(f"pyproject.toml states no lower bound for {name}: CI cannot test its oldest release")
            bounds[name] = lower.group(1)
    missing = [name for name in PACKAGES if name not in bounds]
    if missing:
        sys.exit(f"pyproject.toml lists no {', '.join(missing)}")
    return bounds


def requirements(pyproject: Path, extra: str = "dev") -> list[str]:
    project = tomllib.loads(pyproject.read_text())["project"]
    extras = project["optional-dependencies"]
    wanted, pending, seen = list(project["dependencies"]), [extra], set()
    while pending:
        name = pending.pop()
        if name in seen:
            continue
        seen.add(name)
        for requirement in extras[name]:
            own = re.fullmatch(r"ficoco\[([a-z0-9_,-]+)\]", requirement.replace(" ", ""))
            if own:
                pending += own.group(1).split(",")
            else:
                wanted.append(requirement)
    return list(dict.fromkeys(wanted))


if __name__ == "__main__":
    pyproject = Path(__file__).resolve().parent.parent / "pyproject.toml"
    if sys.argv[1:] == ["--requirements"]:
        print("\n".join(requirements(pyproject)))
        sys.exit(0)
    for name, version in lower_bounds(pyproject).items():
        print(f"{name}=={version}")
