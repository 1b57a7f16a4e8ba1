"""VTW through the command line (docs/methods/vtw.md): `ficoco flops --verify` (no work of its own), `ficoco
calibrate vtw` (the search for K: on random weights, on a local checkpoint's images and prompt, the candidates, the
official eta and the one-line refusals), and one smoke each of `ficoco profile`, `ficoco sweep` and `ficoco show`, on
llava-tiny (4 decoder layers, 64 visual tokens).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from helpers import assert_one_error_line, make_checkpoint

from ficoco.accounting import architecture
from ficoco.calibration.vtw import searched_layers
from ficoco.errors import FicocoError
from ficoco.profiles import load_profile

VISUAL = 64


def test_flops_verify_passes_with_no_work_of_its_own(flops_verify: Any) -> None:
    run = flops_verify("--model", "llava-tiny", "--variant", "vtw", "--hp", "layer=2")["runs"][0]
    stages = {s["stage"]: s for s in run["stages"]}
    assert stages["method"]["analytic_flops"] == 0 and all(s["within_tolerance"] for s in stages.values())


# ---- ficoco calibrate vtw ---------------------------------------------------------------------------------------

def test_the_search_candidates_are_the_official_range_or_a_hybrid_decoders_later_full_layers() -> None:
    assert searched_layers(architecture(load_profile("llava-1.5-7b")), 5) == list(range(5, 32))  # 27 candidates
    assert searched_layers(architecture(load_profile("qwen3.5-0.8b")), 5) == [7, 11, 15, 19, 23]
    assert searched_layers(architecture(load_profile("qwen3.5-tiny")), 1) == [7]
    with pytest.raises(FicocoError, match="no layer from 5 on is left to search; give a lower first_layer="):
        searched_layers(architecture(load_profile("llava-tiny")), 5)


def test_calibrate_on_random_weights_prints_k_and_how_to_run_with_it(cli: Any, tmp_path: Path) -> None:
    out = tmp_path / "vtw.json"
    result = cli("calibrate", "vtw", "--model", "llava-tiny", "--limit", "2", "--first-layer", "1", "--eta", "1",
                 "--dtype", "fp32", "--device", "cpu", "--json", out)
    assert result.code == 0, result.err
    data = json.loads(out.read_text())
    assert data["searched_layers"] == [1, 2, 3] and data["layer"] == 1 and data["eta_source"] == "given"
    assert len(data["samples"]) == 2 and data["forwards"] == 8 and data["search_tflops"] > 0
    assert "random weights and synthetic prompts" in data["notes"][0]
    assert "K = 1:" in result.out and "--variant vtw --hp layer=1" in result.out
    assert "note: random weights" in result.out
    # No layer within eta: said so, exit code 1 (no K to run with), the JSON written all the same.
    result = cli("calibrate", "vtw", "--model", "llava-tiny", "--limit", "1", "--first-layer", "3", "--eta", "1e-12",
                 "--dtype", "fp32", "--device", "cpu", "--json", out)
    assert result.code == 1 and "no searched layer's mean KL is within eta" in result.out
    assert json.loads(out.read_text())["layer"] is None


def test_calibrate_lays_out_a_checkpoints_images_and_prompt(cli: Any, tmp_path: Path) -> None:
    from PIL import Image

    folder = make_checkpoint("llava", tmp_path / "llava")
    images = tmp_path / "images"
    images.mkdir()
    for name, colour in (("a.png", (200, 10, 10)), ("b.png", (10, 200, 10))):
        Image.new("RGB", (40, 30), colour).save(images / name)
    result = cli("calibrate", "vtw", "--model", "llava-tiny", "--weights", folder, "--image", images, "--prompt",
                 "What colour?", "--first-layer", "2", "--dtype", "fp32", "--device", "cpu", "--json", "-")
    assert result.code == 0, result.err
    data = json.loads(result.out)
    assert [s["sample"] for s in data["samples"]] == [f"image={images / n} prompt='What colour?'" for n in ("a.png",
                                                                                                             "b.png")]
    assert data["eta"] == 0.003 and data["eta_source"] == "the official eta of any other checkpoint"
    assert data["notes"] == ["2 sample(s) given, fewer than limit=20: all are used"]


@pytest.mark.parametrize("argv,named", [
    (["--model", "llava-tiny"], "--first-layer 5: llava-tiny's decoder has layers 0..3"),
    (["--model", "llava-tiny", "--first-layer", "1", "--image", "x.png"], "--image, --video and --prompt are laid out"),
    (["--model", "llava-tiny", "--eta", "0"], "--eta 0"),
    (["--model", "llava-tiny", "--limit", "0"], "--limit 0"),
    (["--model", "nonesuch"], "nonesuch"),
])
def test_calibrate_refuses_a_mistake_in_one_line(cli: Any, argv: list[str], named: str) -> None:
    line = assert_one_error_line(cli("calibrate", "vtw", *argv))
    assert named in line


def test_eta_defaults_to_the_official_value_of_the_checkpoint() -> None:
    from ficoco.methods.vtw import default_eta

    assert default_eta("llava-1.5-13b")[0] == 0.0005
    assert default_eta("liuhaotian/llava-v1.5-7b")[0] == 0.003
    assert default_eta("llava-next-7b", "", "llava-hf/llava-v1.6-vicuna-7b-hf")[0] == 0.0001
    assert default_eta("qwen2-vl-7b") == (0.003, "the official eta of any other checkpoint")


# ---- the CLI's other commands -----------------------------------------------------------------------------------

def test_profile_sweep_and_show_run_vtw(cli: Any, tmp_path: Path) -> None:
    report = tmp_path / "profile.json"
    result = cli("profile", "--model", "llava-tiny", "--variant", "vtw", "--hp", "layer=2", "--warmup", "0",
                 "--repeat", "1", "--device", "cpu", "--dtype", "fp32", "--text-tokens", "12", "--no-reference",
                 "--json", report)
    assert result.code == 0, result.err
    (row,) = json.loads(report.read_text())["rows"]
    # Layers 0 and 1 cache the 64 visual and 12 text tokens, layers 2 and 3 the text alone.
    assert row["status"] == "ok" and row["kv_cache_tokens"] == [76, 76, 12, 12]
    swept = tmp_path / "sweep.json"
    result = cli("sweep", "--model", "llava-tiny", "--variant", "vtw", "--keep", "32,16", "--json", swept)
    assert result.code == 0, result.err
    points = [(p["variant"], p["analytic"]["visual_tokens"], p["analytic"]["layer_average_visual_tokens"])
              for p in json.loads(swept.read_text())["points"]]
    assert points == [("vanilla", 64, 64), ("vtw", 0, 32), ("vtw", 0, 16)]
    shown = tmp_path / "show.json"
    result = cli("show", "--model", "llava-tiny", "--variant", "vtw", "--keep", "32", "--out", tmp_path / "show.png",
                 "--json", shown, "--dtype", "fp32")
    assert result.code == 0, result.err
    (step,) = json.loads(shown.read_text())["steps"]
    assert step["layer"] == 2 and step["records"]["kept"] == [[]]
    assert step["records"]["discarded"] == [list(range(VISUAL))]
