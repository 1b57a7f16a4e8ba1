"""lmms-eval's --model_args for `--model ficoco` read into EvalSettings (ficoco.eval.settings): every key
checked before a model is built, a mistake one line that says what to write; no torch."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import tomllib

from ficoco.accounting.request import ScheduleRequest
from ficoco.errors import FicocoError
from ficoco.eval.settings import model_args_string, parse_model_args

ROOT = Path(__file__).resolve().parent.parent


def test_the_budget_keys_spell_one_schedule_request_as_the_cli_does() -> None:
    settings = parse_model_args({"pretrained": "/ckpt", "method": "v", "tflops": 1.5, "shape": "uniform",
                                 "first_layer": 2})
    assert settings.request == ScheduleRequest(tflops=1.5, shape="uniform", first_layer=2)
    assert settings.budget() == {"tflops": 1.5, "shape": "uniform", "first_layer": 2}
    assert parse_model_args({"pretrained": "/ckpt", "method": "fastv", "keep": 64}).request == ScheduleRequest(keep=64)
    assert parse_model_args({"pretrained": "/ckpt", "method": "l", "preset": 128}).request.preset == 128


def test_a_schedule_is_written_with_semicolons_or_quoted_since_lmms_eval_splits_at_commas() -> None:
    semicolons = parse_model_args({"pretrained": "/ckpt", "method": "l", "schedule": "2:10;3:20"})
    quoted = parse_model_args({"pretrained": "/ckpt", "method": "l", "schedule": '"2:10,3:20"'})
    assert semicolons.request.schedule == quoted.request.schedule == "2:10,3:20"
    assert model_args_string({"pretrained": "/ckpt", "method": "l", "schedule": "2:10,3:20", "keep": None}) == \
        "pretrained=/ckpt,method=l,schedule=2:10;3:20"


def test_lmms_eval_own_keys_and_the_build_settings_are_read() -> None:
    settings = parse_model_args({"pretrained": "'/my ckpt'", "batch_size": "4", "device": "CPU", "quant": "int8",
                                 "kv_bits": 4, "dtype": "bf16", "convention": "paper", "scope": "all",
                                 "text_tokens": 40, "max_new_tokens": 8, "profile": "llava-tiny", "max_batch_size": 9})
    assert (settings.pretrained, settings.batch_size, settings.device, settings.quant, settings.kv_bits) == \
        ("/my ckpt", 4, "cpu", "int8", 4)
    assert (settings.dtype, settings.convention, settings.scope, settings.text_tokens, settings.max_new_tokens,
            settings.profile) == ("bf16", "paper", "all", 40, 8, "llava-tiny")


def test_the_rest_are_the_methods_hyperparameters_as_lmms_eval_parsed_them() -> None:
    settings = parse_model_args({"pretrained": "/ckpt", "method": "visionzip", "keep": 64, "contextual_mode": "mean"})
    assert settings.hyperparameters == {"contextual_mode": "mean"}
    fastv = parse_model_args({"pretrained": "/ckpt", "method": "fastv", "layer": 3, "ratio": 0.75})
    assert fastv.hyperparameters == {"layer": 3, "ratio": 0.75}
    sparse = parse_model_args({"pretrained": "/ckpt", "method": "sparsevlm", "layers": "[2, 6, 15]"})
    assert sparse.hyperparameters == {"layers": [2, 6, 15]}
    assert parse_model_args({"pretrained": "/ckpt", "method": "v", "lam": 0.5}).hyperparameters == {"lam": 0.5}


@pytest.mark.parametrize(("args", "says"), [
    ({}, "give pretrained=PATH"),
    ({"pretrained": "/c", "method": "fastvv"}, "method=fastvv is not a method; choose from"),
    ({"pretrained": "/c", "method": "vanilla", "keep": 64}, "method=vanilla reduces nothing"),
    ({"pretrained": "/c", "method": "v", "keep": 64, "tflops": 1.5}, "give one of keep=, preset=, tflops="),
    ({"pretrained": "/c", "method": "v", "tflops": -1}, "tflops=-1 must be a positive number"),
    ({"pretrained": "/c", "method": "v", "keep": 2.5}, "keep=2.5 must be a whole number"),
    ({"pretrained": "/c", "quant": "int3"}, "quant=int3: choose from fp16, int8, int4"),
    ({"pretrained": "/c", "kv_bits": 3}, "kv_bits=3: choose from 2, 4, 8"),
    ({"pretrained": "/c", "device": "tpu"}, "device=tpu: choose auto, cpu, cuda or cuda:N"),
    ({"pretrained": "/c", "batch_size": "auto"}, "batch_size auto is not supported"),
    ({"pretrained": "/c", "convention": "gflops"}, "convention=gflops: choose from"),
    ({"pretrained": "/c", "method": "fastv", "keep": 64, "lam": 0.3}, "unknown key lam=;"),
    ({"pretrained": "/c", "method": "fastv", "keep": 64, "lyaer": 3}, "fastv's hyperparameters: layer, ratio"),
    ({"pretrained": ""}, "pretrained= is empty"),
])
def test_a_mistake_in_model_args_is_one_line_that_says_what_to_write(args: dict, says: str) -> None:
    with pytest.raises(FicocoError) as caught:
        parse_model_args(args)
    assert says in str(caught.value)
    assert "\n" not in str(caught.value)


def test_the_readme_installs_the_lmms_eval_release_range_the_eval_extra_names() -> None:
    """The CPU recipe (`pip install --no-deps "lmms-eval..."`) and the extra name one tested range."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    pinned = next(r for r in extras["eval"] if r.startswith("lmms-eval"))
    readme = (ROOT / "README.md").read_text()
    commands = re.findall(r'pip install --no-deps "(lmms-eval[^"]*)"', readme)
    assert commands and all(c == pinned for c in commands), (pinned, commands)
    assert (ROOT / ".ci" / "run").read_text().count(f'pip install --no-deps "{pinned}"') >= 1


def test_an_evaluated_points_model_args_carry_its_budget_and_its_methods_own_corrections(tmp_path: Path) -> None:
    """`ficoco eval --hp contextual_mode=mean`: VisionZip's points run (and are labelled) with the correction,
    FiCoCo-V's points are not handed a setting their method does not have."""
    from ficoco.methods.registry import method_label
    from ficoco.sweep.plan import SweepConfig, eval_model_args, plan_points, sweep_profile

    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text((ROOT / "profiles" / "llava-tiny.json").read_text())
    config = SweepConfig(model="llava-tiny", variants=("vanilla", "v", "visionzip"), keep=(16,),
                         weights=str(checkpoint), eval_tasks=("colours",), hyperparameters={"contextual_mode": "mean"})
    points = {p.variant: p for p in plan_points(config, sweep_profile(config))}
    zipped = eval_model_args(config, points["visionzip"], "out.json")
    assert zipped["contextual_mode"] == "mean" and zipped["keep"] == 16 and zipped["profile"] == "llava-tiny"
    assert "contextual_mode" not in eval_model_args(config, points["v"], None)
    assert method_label("visionzip", points["visionzip"].schedule.settings_dict()) == \
        "VisionZip (ficoco: mean contextual token)"
    assert parse_model_args(zipped).hyperparameters == {"contextual_mode": "mean"}
