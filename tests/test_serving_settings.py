"""The vLLM plugin's torch-free half, in the main suite (no vLLM needed): an engine's settings and their
refusals, the plan of an image's tokens as the accountant plans it, and the serving reports that
`ficoco serve-bench` writes, as `ficoco report` and `ficoco compare` read them."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from ficoco.accounting import CountOptions, ScheduleRequest, architecture, resolve_schedule
from ficoco.accounting.schedule import plan_tokens
from ficoco.errors import FicocoError
from ficoco.profiles import load_profile
from ficoco.report.schemas import SERVE_SCHEMA
from ficoco.serving.vllm.settings import (
    PIXEL_COUNTED,
    REFUSED,
    SUPPORTED,
    Settings,
    _profile,
    plan_image,
    settings_from,
)

PROFILE = "qwen2.5-vl-tiny"


def _config_json() -> str:
    return json.dumps(load_profile(PROFILE).config)


@pytest.mark.parametrize("method", sorted(REFUSED))
def test_every_method_the_plugin_does_not_serve_is_refused_with_its_reason(method: str) -> None:
    with pytest.raises(FicocoError) as caught:
        Settings.parse({"method": method, "keep": 8})
    message = str(caught.value)
    assert "\n" not in message and method in message and REFUSED[method] in message


@pytest.mark.parametrize("raw, words", [
    ({"method": "visionzip", "keep": 8, "tflops": 1.0}, "not keep and tflops"),
    ({"method": "visionzip", "kept": 8}, "unknown setting kept"),
    ({"keep": 8}, "give a method"),
    ({"method": "visionzip", "keep": "many"}, "keep must be a number"),
    ({"method": "nonesuch"}, "unknown method 'nonesuch'"),
])
def test_a_mistaken_setting_is_one_line(raw: dict[str, Any], words: str) -> None:
    with pytest.raises(FicocoError, match=words):
        Settings.parse(raw)


def test_the_settings_come_from_the_config_or_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    class Config:
        ficoco_vllm = {"method": "divprune", "keep": 4}

    assert settings_from(Config()) == Settings(method="divprune", keep=4)
    monkeypatch.setenv("FICOCO_VLLM", '{"method": "vispruner", "keep": 6}')
    assert settings_from(object()) == Settings(method="vispruner", keep=6)
    monkeypatch.setenv("FICOCO_VLLM", "{not json")
    with pytest.raises(FicocoError, match="not JSON"):
        settings_from(object())
    monkeypatch.delenv("FICOCO_VLLM")
    assert settings_from(object()) is None


@pytest.mark.parametrize("raw", [{"keep": 8}, {"preset": 64}, {"tflops": 1.0}], ids=["keep", "preset", "tflops"])
def test_pixelprune_refuses_a_budget_in_one_line_and_plans_every_group_without_one(raw: dict[str, Any]) -> None:
    with pytest.raises(FicocoError, match="PixelPrune has no token budget") as caught:
        Settings.parse({"method": "pixelprune", **raw})
    assert "\n" not in str(caught.value)
    # Without one: the count is each image's own, so the plan (the placeholders' upper bound) keeps every group.
    plan = plan_image(_config_json(), Settings.parse({"method": "pixelprune"}), (1, 10, 8), 14)
    assert plan.tokens == plan.vanilla_tokens == 20 and plan.settings_dict()["threshold"] == 0.0


@pytest.mark.parametrize("method", [m for m in SUPPORTED if m != "v" and m not in PIXEL_COUNTED])
@pytest.mark.parametrize("request_", [{"keep": 8}, {"tflops": 3.4e-05}], ids=["keep", "tflops"])
def test_an_images_tokens_are_the_accountants_for_its_grid(method: str, request_: dict[str, Any]) -> None:
    # The tiny profile's 140x112 image: a 10x8 patch grid of 20 merge groups.
    plan = plan_image(_config_json(), Settings(method=method, **request_), (1, 10, 8), 14)
    # A served checkpoint carries no profile's defaults: the family's (its text tokens) count, as for any folder.
    arch = architecture(_profile(load_profile(PROFILE).config, "served"), image_size=(140, 112))
    schedule = resolve_schedule(arch, method, CountOptions(), ScheduleRequest(**request_))
    assert plan.tokens == plan_tokens(arch, schedule).llm_visual_tokens < arch.visual_tokens == plan.vanilla_tokens
    assert plan.tflops < plan.vanilla_tflops


def test_a_budget_is_resolved_for_each_grid() -> None:
    # The LLM's cost (scope llm) depends on the tokens that reach it: a larger image keeps as many under one budget;
    # counting the tower too (scope all), its larger tower leaves fewer.
    small = plan_image(_config_json(), Settings(method="divprune", tflops=3.4e-05), (1, 10, 8), 14)
    large = plan_image(_config_json(), Settings(method="divprune", tflops=3.4e-05), (1, 20, 16), 14)
    assert large.vanilla_tokens == 4 * small.vanilla_tokens and large.tokens == small.tokens
    everything = Settings(method="divprune", tflops=2.3e-04, scope="all")
    small = plan_image(_config_json(), everything, (1, 10, 8), 14)
    large = plan_image(_config_json(), everything, (1, 20, 16), 14)
    assert small.tokens == small.vanilla_tokens and large.tokens < large.vanilla_tokens


def test_an_impossible_budget_is_one_line() -> None:
    with pytest.raises(FicocoError):
        plan_image(_config_json(), Settings(method="visionzip", keep=500), (1, 10, 8), 14)


def _report(rps: dict[tuple[str, int], float], tflops: float = 2.3e-05) -> dict[str, Any]:
    rows = []
    for (variant, level), value in rps.items():
        rows.append({"variant": variant, "concurrency": level, "requests": 8, "wall_s": 8 / value,
                     "ttft_p50_s": 0.02, "ttft_p90_s": 0.04, "requests_per_s": value, "output_tokens_per_s": 8 * value,
                     "output_tokens": 64, "tflops_per_request": 3.0e-05 if variant == "vanilla" else tflops,
                     "visual_tokens_per_request": 20 if variant == "vanilla" else 8, "settings": None})
    return {"schema": SERVE_SCHEMA, "config": {"model": "/tmp/tiny", "requests": 8, "new_tokens": 8,
                                               "dtype": "float32"},
            "environment": {"device_kind": "cpu", "device": "a CPU", "vllm": "0.32.0"},
            "engine_start_s": {"vanilla": 30.0}, "rows": rows, "note": "random weights"}


RPS = {("vanilla", 1): 10.0, ("vanilla", 4): 30.0, ("visionzip", 1): 12.0, ("visionzip", 4): 45.0}


def test_a_serving_report_renders_as_a_table_markdown_csv_and_a_figure(cli: Any, tmp_path: Path) -> None:
    path = tmp_path / "serve.json"
    path.write_text(json.dumps(_report(RPS)))
    code, out, _ = cli("report", str(path))
    assert code == 0 and "visionzip" in out and "1.50x" in out
    code, out, _ = cli("report", str(path), "--format", "markdown")
    assert code == 0 and "| visionzip | 4 | 8 |" in out
    code, out, _ = cli("report", str(path), "--format", "csv", "--plot", str(tmp_path / "figs"))
    assert code == 0 and out.splitlines()[0].startswith("variant,concurrency")
    assert (tmp_path / "figs" / "serve_throughput.png").stat().st_size > 1000


def test_compare_judges_a_serving_reports_tflops_and_its_throughput_against_vanilla(cli: Any, tmp_path: Path) -> None:
    base = tmp_path / "base.json"
    base.write_text(json.dumps(_report(RPS)))
    same = tmp_path / "same.json"
    same.write_text(json.dumps(_report(RPS)))
    assert cli("compare", str(base), str(same)).code == 0
    slower = copy.deepcopy(RPS)
    slower[("visionzip", 4)] = 30.0  # 1.5x vanilla -> 1.0x: a regression of the ratio
    worse = tmp_path / "worse.json"
    worse.write_text(json.dumps(_report(slower)))
    code, out, err = cli("compare", str(base), str(worse), "--cross-machine")  # the test names no real CPU
    assert code == 1 and "requests_per_s / vanilla (visionzip x4)" in err
    moved = tmp_path / "moved.json"
    moved.write_text(json.dumps(_report(RPS, tflops=2.5e-05)))
    code, _, err = cli("compare", str(base), str(moved), "--judge", "deterministic")
    assert code == 1 and "tflops_per_request" in err


def test_a_malformed_serving_report_is_one_line_and_exit_2(cli: Any, tmp_path: Path) -> None:
    broken = _report(RPS)
    del broken["rows"][0]["requests_per_s"]
    path = tmp_path / "broken.json"
    path.write_text(json.dumps(broken))
    code, _, err = cli("report", str(path))
    assert code == 2 and "lacks requests_per_s" in err and len(err.strip().splitlines()) == 1
