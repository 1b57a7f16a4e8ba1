"""Real prompts through tiny local checkpoints of every family (issue 11, line 6), fidelity
against vanilla (line 7), and the bad inputs that end in one error line before any model work.

The checkpoints are made offline (tests/helpers.py, make_checkpoint): a tiny profile's random model
saved with save_pretrained, a byte-level tokenizer made here and the family's processor config
with a chat template.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from helpers import make_checkpoint

# Tiny checkpoints carry no ficoco section: move the first reducing layers into their 4 layers.
LAYERS = ["--set", "ficoco.first_reducing_layer.v=2", "--set", "ficoco.first_reducing_layer.l=1"]
FAMILIES = ("llava", "llava_next", "qwen2_vl", "video_llava")


@pytest.fixture(scope="module")
def media(tmp_path_factory) -> dict[str, Path]:
    from PIL import Image

    folder = tmp_path_factory.mktemp("media")
    wide = Image.new("RGB", (150, 100))  # a non-square image: AnyRes and Qwen2-VL follow its size
    wide.putdata([(x % 256, (3 * x) % 256, 40) for x in range(150 * 100)])
    wide.save(folder / "wide.png")
    Image.new("RGB", (120, 120), (5, 90, 200)).save(folder / "square.png")
    Image.new("RGB", (2, 600), (0, 0, 0)).save(folder / "thin.png")  # aspect 300: Qwen2-VL refuses it
    frames = folder / "frames"
    frames.mkdir()
    for i in range(6):
        Image.new("RGB", (80, 60), (40 * i, 100, 0)).save(frames / f"frame_{i:02d}.png")
    (folder / "clip.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42")  # a video file; no decoder is installed
    return {"wide": folder / "wide.png", "square": folder / "square.png", "thin": folder / "thin.png",
            "frames": frames, "video_file": folder / "clip.mp4"}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("checkpoints")
    made = {family: make_checkpoint(family, root / family) for family in FAMILIES}
    made["bare"] = make_checkpoint("llava", root / "bare", processor=False)
    made["no_template"] = make_checkpoint("llava", root / "no_template", chat_template=False)
    return made


def media_args(family: str, media: dict[str, Path], *, square: bool = False) -> list[str]:
    if family == "video_llava":
        return ["--video", str(media["frames"])]
    return ["--image", str(media["square" if square else "wide"])]



def encode(family: str, checkpoints, media, **kwargs):
    from ficoco.models.prompt import encode_prompt
    from ficoco.profiles import load_profile

    profile = load_profile(str(checkpoints[family]))
    given = {"video": str(media["frames"])} if family == "video_llava" else {"image": str(media["wide"])}
    return profile, encode_prompt(str(checkpoints[family]), profile.config,
                                  default_frames=int(profile.defaults.get("frames", 8)),
                                  **{"prompt": "What is shown?", **given, **kwargs})


# ---- the layout: the checkpoint's processor and chat template, the accountant's token counts -------------------

@pytest.mark.parametrize("family", FAMILIES)
def test_prompt_is_laid_out_by_the_checkpoints_processor_and_the_accountant_plans_its_tokens(
        family, checkpoints, media):
    from ficoco.accounting import architecture
    from ficoco.profiles import set_layout

    profile, prompt = encode(family, checkpoints, media)
    if family == "qwen2_vl":
        assert prompt.text.startswith("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What is shown?")
        # 150x100 resizes to 140x112 (multiples of 28): 10 x 8 patches, 20 merge groups.
        assert prompt.image_size == (112, 140) and prompt.visual_tokens == 20
    else:
        assert prompt.text == f"USER: <{prompt.media}>\nWhat is shown? ASSISTANT:"
        assert int(prompt.encoded["input_ids"][0, 0]) == 1  # the tokenizer's <s>
    if family == "llava_next":
        assert prompt.image_size == (100, 150)  # the real size picks the AnyRes grid
    if family == "video_llava":
        assert prompt.frames == 6  # the folder's 6 frames (fewer than the default 8: all of them)
        assert prompt.visual_tokens == 6 * (16 + 1)
    set_layout(profile, image_size=prompt.image_size, frames=prompt.frames)
    assert architecture(profile).visual_tokens == prompt.visual_tokens
    assert prompt.text_tokens == prompt.encoded["input_ids"].shape[1] - prompt.visual_tokens


def test_anyres_grid_follows_the_image_size(checkpoints, media):
    """A wide and a square image give LLaVA-NeXT different grids; the accountant follows both."""
    from ficoco.accounting import architecture
    from ficoco.models.prompt import encode_prompt
    from ficoco.profiles import load_profile, set_layout

    counts = {}
    for name in ("wide", "square"):
        profile = load_profile(str(checkpoints["llava_next"]))
        prompt = encode_prompt(str(checkpoints["llava_next"]), profile.config, image=str(media[name]))
        set_layout(profile, image_size=prompt.image_size)
        assert architecture(profile).visual_tokens == prompt.visual_tokens
        counts[name] = prompt.visual_tokens
    assert counts["wide"] != counts["square"]


def test_a_question_with_its_own_placeholder_places_the_image(checkpoints, media):
    _, prompt = encode("llava", checkpoints, media, prompt="Look: <image> what colour?")
    assert prompt.text == "USER: Look: <image> what colour? ASSISTANT:"


def test_a_checkpoint_without_a_chat_template_uses_the_family_format_and_says_so(checkpoints, media):
    from ficoco.models.prompt import encode_prompt
    from ficoco.profiles import load_profile

    profile = load_profile(str(checkpoints["no_template"]))
    prompt = encode_prompt(str(checkpoints["no_template"]), profile.config, image=str(media["wide"]), prompt="Hi?")
    assert prompt.text == "USER: <image>\nHi? ASSISTANT:"
    assert any("no chat template" in note for note in prompt.notes)


# ---- profile, flops and generate through the checkpoints -----------------------------------------------------

@pytest.mark.parametrize("family", FAMILIES)
def test_profile_runs_a_real_prompt_with_fidelity_through_a_local_checkpoint(cli, family, checkpoints, media, tmp_path):
    folder = str(checkpoints[family])
    report_path = tmp_path / "r.json"
    # V on LLaVA-NeXT needs a grid whose unpadding drops nothing: the square image.
    keep = {"llava": 8, "llava_next": 18, "qwen2_vl": 8, "video_llava": 18}[family]
    code, out, err = cli(*["profile", "--model", folder, "--weights", folder,
                              *media_args(family, media, square=True), "--prompt", "What is shown?",
                              "--variant", "v,l", "--keep", str(keep), *LAYERS, "--repeat", "1", "--warmup", "0",
                              "--device", "cpu", "--new-tokens", "2", "--fidelity", "--json", str(report_path)])
    assert code == 0, err
    report = json.loads(report_path.read_text())
    _, prompt = encode(family, checkpoints, {**media, "wide": media["square"]})
    assert report["config"]["text_tokens"] == prompt.text_tokens
    rows = {row["variant"]: row for row in report["rows"]}
    assert all(row["status"] == "ok" for row in rows.values()), [row.get("reason") for row in rows.values()]
    assert rows["vanilla"]["analytic"]["visual_tokens"] == prompt.visual_tokens
    for row in rows.values():
        # The accountant planned the inputs that ran: its KV cache is the one the model filled.
        assert row["kv_cache_bytes"] == row["analytic"]["kv_cache_bytes"]
    assert rows["vanilla"].get("fidelity") is None
    for variant in ("v", "l"):
        fidelity = rows[variant]["fidelity"]
        assert math.isfinite(fidelity["kl_divergence"]) and fidelity["kl_divergence"] >= 0
        assert 0 <= fidelity["top1_agreement"] <= 1 and fidelity["new_tokens"] == 2
        assert len(fidelity["texts"]["vanilla"]) == len(fidelity["texts"]["reduced"]) == 1
    assert "fidelity against vanilla" in out


def test_flops_reads_a_checkpoint_folder_and_plans_the_processors_tokens(cli, checkpoints, media):
    _, prompt = encode("llava_next", checkpoints, media)
    height, width = prompt.image_size
    folder = str(checkpoints["llava_next"])
    code, out, err = cli(*["flops", "--model", folder, "--image-size", f"{width}x{height}", "--json", "-"])
    assert code == 0, err
    assert json.loads(out)["rows"][0]["visual_tokens"] == prompt.visual_tokens


@pytest.mark.parametrize("family", FAMILIES)
def test_generate_through_a_local_checkpoint_and_decode_the_new_tokens(family, checkpoints, media):
    """The idiom of docs/api.md (a local checkpoint): processor inputs, generate, decode the tokens after the prompt."""
    import ficoco

    folder = str(checkpoints[family])
    _, prompt = encode(family, checkpoints, media)
    model = ficoco.build_model(folder, weights=folder, dtype="fp32", check_memory=False)
    inputs = prompt.batch(1, device="cpu", dtype=torch.float32)
    with torch.no_grad():
        vanilla = model.generate(**inputs, max_new_tokens=3, do_sample=False)
        assert torch.equal(vanilla[:, :inputs["input_ids"].shape[1]], inputs["input_ids"])
        with ficoco.apply(model, "l", keep=8, first_layer=1, image_size=prompt.image_size, frames=prompt.frames):
            reduced = model.generate(**inputs, max_new_tokens=3, do_sample=False)
    texts = prompt.tokenizer.batch_decode(reduced[:, -3:], skip_special_tokens=True)
    assert len(texts) == 1 and isinstance(texts[0], str)
    assert reduced.shape[1] >= 3


# ---- fidelity ----------------------------------------------------------------------------------------------------

def test_empty_schedule_gives_kl_0_and_full_agreement_and_random_weights_are_named(cli, tmp_path):
    report_path = tmp_path / "r.json"
    # llava-tiny's 64 visual tokens all kept: the patched path with nothing removed.
    code, out, err = cli(*["profile", "--model", "llava-tiny", "--variant", "v,l", "--keep", "64", "--repeat", "1",
                              "--warmup", "0", "--device", "cpu", "--dtype", "fp32", "--new-tokens", "4",
                              "--fidelity", "--json", str(report_path)])
    assert code == 0, err
    report = json.loads(report_path.read_text())
    for row in report["rows"][1:]:
        assert row["schedule"] == [] or all(e.get("remove", 0) == 0 for e in row["schedule"])
        fidelity = row["fidelity"]
        assert fidelity["kl_divergence"] == pytest.approx(0, abs=1e-9)
        assert fidelity["top1_agreement"] == 1 and fidelity["greedy_prefix_share"] == 1
        assert fidelity["greedy_prefix_tokens"] == 4 and fidelity["texts"] is None  # no tokenizer
        assert "random weights" in fidelity["note"]
    assert "random weights" in out


def test_a_reduction_moves_the_next_token_distribution():
    from ficoco.profiling.fidelity import Observation, compare, kl_divergence, matching_prefix

    reference = torch.tensor([[2.0, 1.0, 0.0], [0.0, 0.0, 5.0]])
    moved = torch.tensor([[0.0, 1.0, 2.0], [0.0, 0.0, 5.0]])
    kl = kl_divergence(reference, moved)
    assert kl[0] > 0.5 and kl[1] == pytest.approx(0)
    prefix = matching_prefix(torch.tensor([[1, 2, 3], [1, 2, 3]]), torch.tensor([[1, 9, 3], [1, 2, 3]]))
    assert prefix.tolist() == [1, 3]
    result = compare(Observation(reference, torch.tensor([[1, 2, 3, 4], [1, 2, 3, 4]])),
                     Observation(moved, torch.tensor([[1, 2, 0, 4], [1, 2, 3, 4]])))
    assert result.top1_agreement == 0.5
    assert result.greedy_prefix_tokens == 3 and result.greedy_prefix_share == 0.75  # (2 + 4) / 2


def test_compare_calls_a_drop_in_agreement_beyond_tolerance_a_regression():
    from ficoco.report.compare import compare

    def report(agreement: float, kl: float) -> dict:
        row = {"model": "m", "variant": "v", "schedule": [{"layer": 2, "remove": 8}], "quant": "fp16", "batch": 1,
               "text_tokens": 12, "new_tokens": 4, "device_kind": "cpu", "status": "ok", "backend": {},
               "fidelity": {"top1_agreement": agreement, "greedy_prefix_share": agreement, "kl_divergence": kl}}
        return {"schema": "ficoco.report/1", "environment": {}, "rows": [row]}

    same = compare(report(1.0, 0.01), report(0.95, 0.0105))
    assert not same.regressions
    worse = compare(report(1.0, 0.01), report(0.5, 0.2))
    assert {v.metric for v in worse.regressions} == {"top1_agreement", "greedy_prefix_share", "kl_divergence"}
    assert not compare(report(1.0, 0.01), report(0.5, 0.2), judge="timed").regressions


# ---- bad input: one error line, exit 2, before any model work ----------------------------------------------------

BAD = {
    "folder without a processor": ("bare", ["--image", "{wide}"], "has no processor"),
    "image the processor rejects": ("qwen2_vl", ["--image", "{thin}"], "processor rejects it"),
    "more placeholders than images": ("llava", ["--image", "{wide}", "--prompt", "<image> and <image>?"],
                                      "2 <image> placeholders but one image"),
    "video for an image model": ("llava", ["--video", "{frames}"], "--video applies to Video-LLaVA"),
    "image for Video-LLaVA": ("video_llava", ["--image", "{wide}"], "give --video"),
    "video file without a decoder": ("video_llava", ["--video", "{video_file}"], "decoder library"),
    "more frames than the folder holds": ("video_llava", ["--video", "{frames}", "--frames", "9"], "--frames 9"),
    "prompt without media": ("llava", ["--prompt", "hi"], "--prompt needs --image"),
    "image size beside an image": ("llava_next", ["--image", "{wide}", "--image-size", "64x64"], "--image-size"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_real_input_is_one_error_line_before_any_model_work(cli, name, checkpoints, media, tmp_path, monkeypatch):
    import ficoco.models.build as build

    family, extra, needle = BAD[name]
    built: list[str] = []

    def no_build(*args, **kwargs):
        built.append("model")
        raise RuntimeError("a model was built")

    monkeypatch.setattr(build, "build_model", no_build)
    folder = str(checkpoints[family])
    extra = [x.format(**{k: str(v) for k, v in media.items()}) for x in extra]
    code, out, err = cli(*["profile", "--model", folder, "--weights", folder, "--variant", "l", "--keep", "4",
                              *LAYERS, *extra, "--json", str(tmp_path / "r.json")])
    assert code == 2, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), err
    assert needle in lines[0]
    assert "Traceback" not in out + err
    assert built == [] and not (tmp_path / "r.json").exists()


@pytest.mark.parametrize("args", [["--model", "internvl3-tiny"],  # no layout without a processor
                                  ["--model", "qwen2-vl-tiny", "--batch", "1,2"],  # one picture, one layout
                                  ["--model", "qwen2-vl-tiny", "--image-size", "64x64"]])
def test_random_weights_with_an_image_the_picture_layout_cannot_make_is_refused_before_the_build(cli, media, args):
    code, _, err = cli(*["profile", *args, "--variant", "l", "--keep", "4", "--image", str(media["wide"]),
                         "--dry-run"])
    assert code == 2 and err.startswith("error: --image with random weights"), err
    assert len(err.strip().splitlines()) == 1
