"""No refactor moves a figure: every report `ficoco flops --json` gives for each shipped profile x method x
convention x scope x quant x budget form equals the golden set made on main before the change
(tests/golden/make_flops_golden.py says how it was made; rewrite it only when a figure is meant to move)."""

from __future__ import annotations

import gzip
import json

import pytest
from golden.make_flops_golden import GOLDEN, run

GOLDEN_CASES = json.loads(gzip.decompress(GOLDEN.read_bytes()))


def _id(entry: dict) -> str:
    case = entry["case"]
    budget = ",".join(f"{k}={case[k]}" for k in sorted(case) if k not in
                      ("model", "variants", "convention", "scope", "quants", "per_layer", "gpu"))
    return f"{case['model']}-{case['convention']}-{case['scope']}-{budget or 'default'}"


def test_the_golden_set_covers_every_profile_and_convention():
    from ficoco.accounting.flops import CONVENTIONS
    from ficoco.profiles import list_profiles

    models = {entry["case"]["model"] for entry in GOLDEN_CASES}
    conventions = {entry["case"]["convention"] for entry in GOLDEN_CASES}
    assert models == set(list_profiles()), "a profile was added or removed: extend the golden set on purpose"
    assert conventions == set(CONVENTIONS)
    assert sum(len(entry["report"].get("rows", ())) for entry in GOLDEN_CASES) > 15000


def test_the_golden_set_counts_every_registered_method():
    """A method added to the registry joins a wave of make_flops_golden.METHOD_WAVES and its cases are added on
    purpose (`make_flops_golden.py --add-methods NAME`), so that its figures are held as the others' are."""
    from golden.make_flops_golden import METHOD_WAVES

    from ficoco.methods import METHODS

    counted = {name for entry in GOLDEN_CASES for name in entry["case"]["variants"]}
    assert set(METHODS) <= {name for wave in METHOD_WAVES for name in wave}, "a method is in no wave"
    assert set(METHODS) <= counted, f"no golden case counts {sorted(set(METHODS) - counted)}: add the wave's cases"


@pytest.mark.parametrize("model", sorted({entry["case"]["model"] for entry in GOLDEN_CASES}))
def test_every_flops_figure_equals_the_golden_set(model):
    mismatched = []
    for entry in GOLDEN_CASES:
        if entry["case"]["model"] != model:
            continue
        now = json.loads(json.dumps(run(entry["case"]), sort_keys=True))
        if now != entry["report"]:
            mismatched.append(_id(entry))
    assert not mismatched, f"{len(mismatched)} report(s) moved, first: {mismatched[:5]}"
