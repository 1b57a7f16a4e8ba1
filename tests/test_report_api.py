"""The reports are built by the library: `ficoco.flops(...)` and `ficoco.profile(...)` return the
dicts `ficoco flops --json` and `ficoco profile --json` write for the same settings, and the flops
path never imports torch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import ficoco
from ficoco.report import FLOPS_SCHEMA, REPORT_SCHEMA

ROOT = Path(__file__).resolve().parents[1]
ENV = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}

# (CLI arguments, the same settings as ficoco.flops keywords)
FLOPS_SETTINGS = {
    "methods, quants, gpu, per layer": (
        ["--model", "llava-1.5-7b", "--variant", "vanilla,v,l,fastv", "--keep", "64", "--quant", "fp16,int4",
         "--gpu", "a100-80gb", "--per-layer"],
        dict(model="llava-1.5-7b", variants=["vanilla", "v", "l", "fastv"], keep=64, quants=["fp16", "int4"],
             gpu="a100-80gb", per_layer=True)),
    "budget, convention, scope, layout": (
        ["--model", "qwen2-vl-7b", "--variant", "vanilla,v", "--tflops", "9", "--convention", "macs",
         "--scope", "all", "--equivalent", "--image-size", "448x336", "--text-tokens", "40", "--batch", "2",
         "--lm-head", "last", "--set", "vision_layers=30"],
        dict(model="qwen2-vl-7b", variants="vanilla,v", tflops=9.0, convention="macs", scope="all",
             equivalent=True, image_size=(336, 448), text_tokens=40, batch=2, lm_head="last",
             overrides=["vision_layers=30"])),
}


@pytest.mark.parametrize("cli_args, settings", FLOPS_SETTINGS.values(), ids=list(FLOPS_SETTINGS))
def test_flops_returns_the_report_the_cli_writes(cli_args, settings, cli):
    # In a process of its own, as a user runs it.
    result = cli("flops", *cli_args, "--json", "-", in_subprocess=True, cwd=ROOT, env=ENV, timeout=120)
    assert result.code == 0, result.err
    written = json.loads(result.out)
    returned = ficoco.flops(**settings)
    assert returned["schema"] == FLOPS_SCHEMA
    assert len(returned["rows"]) >= 2
    # No timestamp in a flops report: equal field for field, once written as JSON (tuples become lists).
    assert json.loads(json.dumps(returned)) == written


def test_flops_imports_no_torch():
    script = ("import sys, ficoco\n"
              "report = ficoco.flops('llava-1.5-7b', 'vanilla,v,l', keep=64, gpu='h100-sxm')\n"
              "assert [r['variant'] for r in report['rows']] == ['vanilla', 'v', 'l'], report['rows']\n"
              "print('torch' in sys.modules)\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT,
                            env=ENV, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


def test_a_library_mistake_is_a_ficoco_error():
    with pytest.raises(ficoco.FicocoError, match="no-such-model"):
        ficoco.flops("no-such-model", "vanilla")


# ---- profile: llava-tiny, one timed run, on the CPU ---------------------------------------------------------

PROFILE = dict(model="llava-tiny", variants=["v"], keep=8, repeat=1, warmup=0, device="cpu", seed=3)
PROFILE_CLI = ["--model", "llava-tiny", "--variant", "v", "--keep", "8", "--repeat", "1", "--warmup", "0",
               "--device", "cpu", "--seed", "3"]
# What does not depend on the clock: the row's identity, the accountant's figures and the measured sizes.
DETERMINISTIC = ("variant", "quant", "batch", "status", "analytic", "visual_tokens", "kv_cache_bytes",
                 "flops_ratio_vs_vanilla")


@pytest.fixture(scope="module")
def profiles(cli, tmp_path_factory):
    """The report ficoco.profile returns (and what its callbacks saw) and the one the CLI wrote."""
    path = tmp_path_factory.mktemp("report_api") / "cli.json"
    code, _, stderr = cli(*["profile", *PROFILE_CLI, "--json", str(path)])
    assert code == 0, stderr
    seen: dict = {"plans": [], "rows": [], "phases": 0}

    def on_plan(planned):
        seen["plans"].append(len(planned.plan.rows))

    def on_row(report):
        seen["rows"].append([row["variant"] for row in report["rows"]])

    def on_phase(phase):
        seen["phases"] += 1

    returned = ficoco.profile(**PROFILE, on_plan=on_plan, on_row=on_row, on_phase=on_phase)
    return json.loads(json.dumps(returned)), json.loads(path.read_text()), seen


def test_profile_returns_the_report_the_cli_writes(profiles):
    returned, written, _ = profiles
    assert returned["schema"] == written["schema"] == REPORT_SCHEMA
    assert set(returned) == set(written)
    assert returned["config"] == written["config"]
    assert set(returned["environment"]) == set(written["environment"])
    assert set(returned["estimate"]) == set(written["estimate"])
    assert [row["variant"] for row in returned["rows"]] == ["vanilla", "v"]
    for mine, theirs in zip(returned["rows"], written["rows"], strict=True):
        assert set(mine) == set(theirs)
        assert {k: mine.get(k) for k in DETERMINISTIC} == {k: theirs.get(k) for k in DETERMINISTIC}
        assert mine["status"] == "ok"
    # The pairing with vanilla was made by the library: a ratio of this report's own figures.
    vanilla, reduced = returned["rows"]
    assert reduced["speedup_vs_vanilla"] == pytest.approx(
        vanilla["latency"]["median_ms"] / reduced["latency"]["median_ms"])
    assert reduced["flops_ratio_vs_vanilla"] > 1


def test_profile_callbacks_see_the_plan_then_each_row(profiles):
    _, _, seen = profiles
    assert seen["plans"] == [2]
    assert seen["rows"] == [["vanilla"], ["vanilla", "v"]]  # the report as it grows, after every row
    assert seen["phases"] > 0


def test_profile_dry_run_plans_without_measuring_and_keeps_the_notes():
    planned = []
    report = ficoco.profile("llava-tiny", "v,holitom", keep=8, reference=False, device="cpu", dry_run=True,
                            on_plan=planned.append)
    assert report["schema"] == REPORT_SCHEMA and report["rows"] == []
    assert list(report["config"]["variants"]) == ["v", "holitom"]  # reference=False: no vanilla row added
    assert len(planned) == 1 and [row.variant for row in planned[0].plan.rows] == ["v"]
    # HoliTom (a video method) is left out on LLaVA: said in the report, not only printed.
    assert [note for note in report["notes"] if note.startswith("left out holitom")]


# --- The typed requests: one ScheduleRequest, one ProfileConfig --------------------------------


def test_a_schedule_request_takes_at_most_one_source_and_names_those_given():
    assert ficoco.ScheduleRequest().given() == []
    assert ficoco.ScheduleRequest(preset=64).keep_or_preset == 64
    with pytest.raises(ficoco.FicocoError, match=r"^give one of keep=, preset=, tflops= and schedule=, "
                                                 r"not keep= and tflops=$"):
        ficoco.ScheduleRequest(keep=64, tflops=1.5)
    folded = ficoco.ScheduleRequest(preset=64, shape="oneshot").folded()
    assert (folded.keep, folded.preset, folded.shape) == (64, None, "oneshot")
    # A mapping schedule is copied: the request is frozen, the caller's dict is not.
    removals = {2: 100}
    request = ficoco.ScheduleRequest(schedule=removals)
    removals[3] = 5
    assert request.schedule == {2: 100} and request.to_json()["schedule"] == "2:100"


def test_flops_takes_a_request_or_its_keywords_not_both():
    by_keywords = ficoco.flops("llava-1.5-7b", "vanilla,v,fastv", preset=128, shape="oneshot")
    by_request = ficoco.flops("llava-1.5-7b", "vanilla,v,fastv",
                              request=ficoco.ScheduleRequest(preset=128, shape="oneshot"))
    for report in (by_keywords, by_request):
        del report["environment"]
    assert by_keywords == by_request and by_request["preset"] == 128
    with pytest.raises(ficoco.FicocoError, match=r"^give request= or keep=, not both$"):
        ficoco.flops("llava-1.5-7b", "v", keep=64, request=ficoco.ScheduleRequest(keep=64))


def test_profile_takes_one_profile_config_with_the_same_report_as_its_keywords():
    config = ficoco.ProfileConfig(model="llava-tiny", variants=("vanilla", "v"), keep=8, device="cpu")
    from_config = ficoco.profile(config, dry_run=True)
    from_keywords = ficoco.profile("llava-tiny", "v", keep=8, device="cpu", dry_run=True)
    for report in (from_config, from_keywords):
        for key in ("created", "environment", "estimate"):
            del report[key]
    assert from_config == from_keywords
    with pytest.raises(ficoco.FicocoError, match=r"^give a ProfileConfig or its settings \(keep=\), not both$"):
        ficoco.profile(config, keep=8)


def test_a_profile_config_folds_the_preset_into_keep_and_checks_its_request_once():
    config = ficoco.ProfileConfig(model="llava-tiny", preset=64)
    assert config.keep == 64 and config.request == ficoco.ScheduleRequest(keep=64)
    assert "preset" not in config.to_json() and config.to_json()["keep"] == 64  # the report's schema
    import dataclasses

    assert dataclasses.replace(config, text_tokens=30).keep == 64  # a copy keeps the fold
    built = ficoco.ProfileConfig.with_request("llava-tiny", ficoco.ScheduleRequest(schedule={2: 100}))
    assert built.schedule == "2:100" and built.to_json()["schedule"] == "2:100"
    with pytest.raises(ficoco.FicocoError, match="^give one of keep=, preset=, tflops= and schedule="):
        ficoco.ProfileConfig(model="llava-tiny", keep=8, tflops=1.0)
