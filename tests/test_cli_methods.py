"""`ficoco methods`, the method comparison on the accountant's path, --preset, and the one-line refusal
of methods the models do not run yet (real subprocesses, as a user runs them)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from test_cli_flops import assert_one_error_line, ficoco_cli

from ficoco.methods import METHODS

ALL = "vanilla,v,l,fastv,pdrop,sparsevlm,dart"


def test_methods_lists_every_registry_entry_with_where_it_acts(tmp_path: Path):
    result = ficoco_cli("methods", "--json", str(tmp_path / "m.json"))
    assert result.returncode == 0, result.stderr
    for name, spec in METHODS.items():
        assert name in result.stdout and spec.title in result.stdout
    report = json.loads((tmp_path / "m.json").read_text())
    by_name = {m["name"]: m for m in report["methods"]}
    assert set(by_name) == set(METHODS)
    assert by_name["fastv"]["acts_at"] == "llm_layer" and by_name["fastv"]["placement"] == "layer_input"
    assert by_name["fastv"]["hyperparameters"] == {"layer": 2, "ratio": 0.5}
    assert by_name["v"]["acts_at"] == "vision_layer" and by_name["v"]["wired"]
    assert by_name["pdrop"]["families"] == ["llava", "llava_next"]


def test_the_comparison_line_costs_every_method_under_one_budget(tmp_path: Path):
    # FiCoCo-L cannot reach 3.3 TFLOPs layer-exact from layer 4 with the uniform shape; one-shot can.
    result = ficoco_cli("flops", "--model", "llava-1.5-7b", "--variant", ALL, "--tflops", "3.3", "--shape", "oneshot",
                        "--json", str(tmp_path / "r.json"))
    assert result.returncode == 0, result.stderr
    rows = {r["variant"]: r for r in json.loads((tmp_path / "r.json").read_text())["rows"]}
    assert list(rows) == ALL.split(",")
    for name, row in rows.items():
        if name != "vanilla":
            assert row["tflops"] <= 3.3, name
            assert row["tflops"] > 2.5, name  # the most tokens that fit, not any setting that fits
    assert rows["fastv"]["settings"]["layer"] == 2
    assert rows["sparsevlm"]["settings"]["keeps"] == [303, 110, 36]
    assert rows["pdrop"]["method_tflops"] > 0  # its recomputed k projections are counted, apart from the total
    assert "avg" in result.stdout  # the layer-average column


def test_preset_gives_the_literature_rows_in_visual_macs(tmp_path: Path):
    result = ficoco_cli("flops", "--model", "llava-1.5-7b", "--variant", "vanilla,fastv,sparsevlm,dart", "--preset",
                        "128", "--convention", "visual-macs", "--json", str(tmp_path / "r.json"))
    assert result.returncode == 0, result.stderr
    report = json.loads((tmp_path / "r.json").read_text())
    rows = {r["variant"]: r for r in report["rows"]}
    assert report["preset"] == 128 and report["units"] == "TMACs (visual tokens)"
    assert round(rows["vanilla"]["tflops"], 2) == 3.82
    assert (rows["fastv"]["visual_tokens"], round(rows["fastv"]["layer_average_visual_tokens"], 1)) == (98, 127.9)
    sparse = rows["sparsevlm"]
    assert (sparse["visual_tokens"], round(sparse["layer_average_visual_tokens"], 1)) == (39, 145.4)
    assert (rows["dart"]["visual_tokens"], rows["dart"]["layer_average_visual_tokens"]) == (132, 159.75)
    assert [r["where"] for r in rows["sparsevlm"]["schedule"]] == ["layer_input"] * 3
    assert [r["added"] for r in rows["sparsevlm"]["schedule"]] == [9, 7, 3]


@pytest.mark.parametrize("argv", [
    ["profile", "--model", "llava-tiny", "--variant", "fastv", "--dry-run"],
    ["flops", "--verify", "--model", "llava-tiny", "--variant", "v,pdrop", "--keep", "8"],
])
def test_an_unwired_method_is_refused_in_one_line(argv):
    # Every shipped method is wired now: one marked unwired stands for a method the accountant plans
    # before its model hooks exist.
    unwired = [sys.executable, "-c", "import dataclasses, ficoco.methods.registry as r; "
               "r.METHODS['fastv'] = dataclasses.replace(r.METHODS['fastv'], wired=False); "
               "r.METHODS['pdrop'] = dataclasses.replace(r.METHODS['pdrop'], wired=False); "
               "from ficoco_cli.app import main; main()"]
    result = subprocess.run([*unwired, *argv], capture_output=True, text=True, timeout=600)
    line = assert_one_error_line(result)
    assert "is not wired into the models yet" in line and "--variant" in line


def test_a_family_the_method_is_not_defined_on_is_named():
    line = assert_one_error_line(ficoco_cli("flops", "--model", "qwen2-vl-7b", "--variant", "pdrop"))
    assert "PDrop is defined on llava, llava_next" in line


def test_visual_macs_refuses_scope_all():
    line = assert_one_error_line(ficoco_cli("flops", "--model", "llava-1.5-7b", "--convention", "visual-macs",
                                            "--scope", "all"))
    assert "decoder only" in line
