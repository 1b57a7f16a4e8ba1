"""FiCoCo-V / FiCoCo-L inside Hugging Face Video-LLaVA, end to end (issue 7).

A random seeded video-llava-tiny in fp32 on CPU: two CLIP towers (image and video) of 6 layers
over a 4 x 4 patch grid, 4 frames per video (each frame 16 patches + [CLS], all 17 reach the
LLM: a 68-token video span), V reduces per frame in video-tower layers 0..4, and a LLaMA
decoder of 4 layers (L reduces in layers 1..3, over the whole video span); prompts are 12
text tokens around one video span ("USER: <video>\\n... ASSISTANT:").
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import ficoco
from ficoco.accounting import architecture
from ficoco.accounting.schedule import Schedule, plan_tokens, schedule_for_keep
from ficoco.api import profile_of
from ficoco.errors import FicocoError
from ficoco.models import adapter_for
from ficoco.models.video_llava import PREFIX_TOKENS, VideoLlavaAdapter, synthetic_inputs

TEXT = 12  # text tokens per prompt
FRAMES = 4  # profiles/video-llava-tiny.json ficoco.frames
PATCHES = 16  # 4 x 4 grid per frame
PER_FRAME = PATCHES + 1  # transformers keeps each frame's [CLS] in the video features
SPAN = FRAMES * PER_FRAME  # 68 video placeholders
VIDEO_TOKEN = 301  # video_token_index of the tiny profile
IMAGE_TOKEN = 300
NEW = 8  # generated tokens


# -- fixtures and helpers ---------------------------------------------------------------------

TINY_PROFILE = "video-llava-tiny"  # built as this module's `model` (conftest.py)


@pytest.fixture(scope="module")
def arch(model: nn.Module) -> Any:
    return architecture(profile_of(model, "video-llava-tiny"))


def inputs(model: nn.Module, batch: int = 1, seed: int = 0, **kwargs: Any) -> dict[str, Tensor]:
    return synthetic_inputs(model, batch=batch, text_tokens=TEXT, seed=seed, **kwargs)


def sample(batch: dict[str, Tensor], i: int) -> dict[str, Tensor]:
    return {k: v[i:i + 1] for k, v in batch.items()}


def greedy(model: nn.Module, inp: dict[str, Tensor], new: int = NEW) -> Tensor:
    return model.generate(**inp, max_new_tokens=new, do_sample=False)


def video_layers(model: nn.Module) -> nn.ModuleList:
    return model.model.video_tower.encoder.layers


def image_layers(model: nn.Module) -> nn.ModuleList:
    return model.model.image_tower.encoder.layers


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    return model.model.language_model.layers


@contextlib.contextmanager
def entering_tokens(model: nn.Module) -> Iterator[dict[str, dict[int, list[tuple[int, int]]]]]:
    """(items, tokens) of hidden_states at the entry of every layer and of its MLP, per call,
    for the video tower, the image tower and the decoder."""
    seen: dict[str, dict[int, list[tuple[int, int]]]] = defaultdict(lambda: defaultdict(list))
    hooks = []
    for stage, layers in (("vision", video_layers(model)), ("image", image_layers(model)),
                          ("llm", decoder_layers(model))):
        for i, layer in enumerate(layers):
            def hook(module: nn.Module, args: tuple, kwargs: dict, _stage: str = stage, _i: int = i) -> None:
                hidden = args[0] if args else kwargs["hidden_states"]
                seen[_stage][_i].append(tuple(hidden.shape[:2]))

            def mlp_hook(module: nn.Module, args: tuple, _stage: str = stage, _i: int = i) -> None:
                seen[f"{_stage}-mlp"][_i].append(tuple(args[0].shape[:2]))

            hooks.append(layer.register_forward_pre_hook(hook, with_kwargs=True))
            hooks.append(layer.mlp.register_forward_pre_hook(mlp_hook))
    try:
        yield seen
    finally:
        for h in hooks:
            h.remove()


def check_records(records: list, variant: str, schedule: Schedule, batch: int) -> None:
    """One record per reducing layer; kept/discarded partition the previous kept set, sorted.

    V: one row per frame (batch x frames), grid indices 0..15; L: one row per sample, offsets
    0..67 inside the video span."""
    removed = schedule.removed_at()
    assert [r.layer for r in records] == sorted(removed)
    assert {r.stage for r in records} <= {"vision" if variant == "v" else "llm"}
    rows, units = (batch * FRAMES, PATCHES) if variant == "v" else (batch, SPAN)
    previous = torch.arange(units).expand(rows, -1)
    left = units
    for rec in records:
        left -= removed[rec.layer]
        assert tuple(rec.kept.shape) == (rows, left)
        assert tuple(rec.discarded.shape) == (rows, removed[rec.layer])
        assert rec.kept.dtype == torch.long and rec.kept.device.type == "cpu"
        for part in (rec.kept, rec.discarded):
            assert bool((part[:, 1:] > part[:, :-1]).all()), f"layer {rec.layer}: indices not ascending"
        union = torch.cat([rec.kept, rec.discarded], dim=1).sort(dim=1).values
        assert torch.equal(union, previous), f"layer {rec.layer}: kept + discarded != the previous kept set"
        previous = rec.kept


def image_inputs(model: nn.Module, batch: int = 2, seed: int = 0) -> dict[str, Tensor]:
    """An image prompt ("USER: <image>\\n..."): 16 image placeholders (no [CLS]) and pixel_values."""
    video = inputs(model, batch=batch, seed=seed)
    ids = video["input_ids"]
    ids = torch.cat([ids[:, :PREFIX_TOKENS], torch.full((batch, PATCHES), IMAGE_TOKEN),
                     ids[:, PREFIX_TOKENS + SPAN:]], dim=1)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids),
            "pixel_values": video["pixel_values_videos"][:, 0]}


# -- 1. the adapter and the synthetic inputs ---------------------------------------------------

def test_adapter_points_at_the_video_tower_and_video_placeholder(model: nn.Module) -> None:
    adapter = adapter_for(model)
    assert isinstance(adapter, VideoLlavaAdapter)
    assert adapter.stage_modules()["vision"] is model.model.video_tower
    assert adapter.vision_layers is video_layers(model)
    assert adapter.decoder_layers is decoder_layers(model)
    assert adapter.image_token_id == VIDEO_TOKEN  # the span both variants act on
    assert (adapter.patches, adapter.span_tokens, adapter.grid_hw) == (PATCHES, PER_FRAME, (4, 4))


def test_synthetic_inputs_follow_the_video_chat_template(model: nn.Module) -> None:
    inp = inputs(model, batch=2)
    ids = inp["input_ids"]
    assert ids.shape == (2, TEXT + SPAN)
    assert inp["pixel_values_videos"].shape == (2, FRAMES, 3, 56, 56)
    assert bool((ids[:, PREFIX_TOKENS:PREFIX_TOKENS + SPAN] == VIDEO_TOKEN).all())
    text = torch.cat([ids[:, :PREFIX_TOKENS], ids[:, PREFIX_TOKENS + SPAN:]], dim=1)
    assert bool((text < IMAGE_TOKEN).all()) and bool((ids[:, 0] == 1).all())
    assert inputs(model, frames=2)["pixel_values_videos"].shape[1] == 2


def test_synthetic_inputs_of_video_llava_7b_are_8_frames_of_257_tokens_at_224px() -> None:
    from ficoco.models.build import _hf_config
    from ficoco.profiles import load_profile

    profile = load_profile("video-llava-7b")

    class Shell(nn.Module):  # the config and a parameter are all synthetic_inputs reads
        def __init__(self) -> None:
            super().__init__()
            self.config = _hf_config(profile)
            self.weight = nn.Parameter(torch.zeros(1, dtype=torch.bfloat16))
            self.__dict__["_ficoco_defaults"] = dict(profile.defaults)

    inp = synthetic_inputs(Shell(), text_tokens=60)
    assert inp["pixel_values_videos"].shape == (1, 8, 3, 224, 224)
    assert inp["pixel_values_videos"].dtype == torch.bfloat16
    assert inp["input_ids"].shape == (1, 60 + 2056)
    assert int((inp["input_ids"] == 32001).sum()) == 2056 == architecture(profile).visual_tokens


# -- 2. an empty schedule is the unpatched model ----------------------------------------------

@pytest.mark.parametrize("variant", ["v", "l"])
def test_empty_schedule_logits_and_generate_are_bitwise_unpatched(model: nn.Module, variant: str) -> None:
    inp = inputs(model, batch=2)
    ref_logits = model(**inp).logits
    ref_tokens = greedy(model, inp)
    with ficoco.apply(model, variant, schedule={}) as handle:
        assert "forward" in model.__dict__ and "generate" in model.__dict__  # the patched path runs
        logits = model(**inp).logits
        tokens = greedy(model, inp)
        assert handle.records == []
    assert torch.equal(logits, ref_logits)
    assert torch.equal(tokens, ref_tokens)


@pytest.mark.parametrize("variant", ["v", "l"])
def test_remove_restores_the_model_bitwise(model: nn.Module, variant: str) -> None:
    inp = inputs(model, batch=2, seed=1)
    before = model(**inp).logits
    attrs = {name: set(m.__dict__) for name, m in model.named_modules()}
    with ficoco.apply(model, variant, keep=28):
        assert model(**inp).logits.shape[1] == TEXT + 28  # both variants shorten the sequence
    assert {name: set(m.__dict__) for name, m in model.named_modules()} == attrs
    assert torch.equal(model(**inp).logits, before)


# -- 3. tokens every layer processes == the schedule's plan -----------------------------------

SCHEDULES = [
    ("v", {"keep": 28}),  # 4 x (1 + 6): 10 patches per frame removed in layers 2..4
    ("v", {"keep": 12, "shape": "oneshot"}),  # 4 x (1 + 2), all at layer 2
    ("v", {"schedule": {0: 5, 3: 4}}),
    ("l", {"keep": 20}),
    ("l", {"keep": 30, "shape": "oneshot", "first_layer": 2}),
    ("l", {"schedule": {1: 10, 3: 30}}),
]


@pytest.mark.parametrize(("variant", "how"), SCHEDULES, ids=[f"{v}-{h}" for v, h in SCHEDULES])
def test_tokens_entering_every_layer_equal_schedule_plan(model: nn.Module, arch: Any, variant: str,
                                                         how: dict) -> None:
    batch = 2
    inp = inputs(model, batch=batch, seed=3)
    with ficoco.apply(model, variant, **how) as handle, entering_tokens(model) as seen:
        logits = model(**inp).logits
        records = list(handle.records)
    plan = plan_tokens(arch, handle.schedule, text_tokens=TEXT)
    assert handle.schedule.total_removed > 0
    items = batch * FRAMES  # frames are the video tower's batch items
    for i in range(len(video_layers(model))):
        assert seen["vision"][i] == [(items, plan.vision[i][0])], f"video-tower layer {i}"
        assert seen["vision-mlp"][i] == [(items, plan.vision[i][1])], f"video-tower layer {i}: MLP on kept"
    assert "image" not in seen  # a video prompt never runs the image tower
    for i in range(len(decoder_layers(model))):
        assert seen["llm"][i] == [(batch, plan.llm[i][0])], f"decoder layer {i}"
        assert seen["llm-mlp"][i] == [(batch, plan.llm[i][1])], f"decoder layer {i}: MLP on kept"
    if variant == "v":
        per_frame = PATCHES - handle.schedule.total_removed
        assert plan.llm_visual_tokens == handle.keep_per_image == FRAMES * (1 + per_frame)
        assert logits.shape[1] == TEXT + FRAMES * (1 + per_frame)
    else:
        assert logits.shape[1] == plan.llm[-1][1] == TEXT + plan.visual_tokens
    check_records(records, variant, handle.schedule, batch=batch)
    if "keep" in how:
        assert records[-1].kept.shape[1] == (how["keep"] // FRAMES - 1 if variant == "v" else how["keep"])


# -- 4. batches: every sample as if alone ------------------------------------------------------

@pytest.mark.parametrize(("variant", "params"), [("v", {}), ("l", {}), ("l", {"beta": 0.0})],
                         ids=["v", "l", "l-beta0"])
def test_batch_gives_each_sample_its_batch_of_one_result(model: nn.Module, variant: str, params: dict) -> None:
    batch = inputs(model, batch=2, seed=4)
    with ficoco.apply(model, variant, keep=28, **params) as handle:
        together = model(**batch).logits
        kept_together = [r.kept for r in handle.records]
        rows = FRAMES if variant == "v" else 1  # record rows per sample
        for i in range(2):
            alone = model(**sample(batch, i)).logits
            torch.testing.assert_close(together[i:i + 1], alone, atol=1e-5, rtol=0)
            for rec, kept in zip(handle.records, kept_together, strict=True):
                assert torch.equal(rec.kept, kept[i * rows:(i + 1) * rows])
    assert not torch.allclose(together[0], together[1], atol=1e-3)
    if variant == "v":  # frames of one video are reduced independently
        first = kept_together[0]
        assert any(not torch.equal(first[0], first[f]) for f in range(1, FRAMES))


# -- 5. generation after a reduced prefill -----------------------------------------------------

@pytest.mark.parametrize("variant", ["v", "l"])
def test_generate_after_reduced_prefill_follows_plan_and_equals_samples_alone(model: nn.Module, arch: Any,
                                                                              variant: str) -> None:
    batch = inputs(model, batch=2, seed=6)
    length = batch["input_ids"].shape[1]
    with ficoco.apply(model, variant, keep=28) as handle:
        with entering_tokens(model) as seen:
            together = greedy(model, batch)
        check_records(handle.records, variant, handle.schedule, batch=2)
        plan = plan_tokens(arch, handle.schedule, text_tokens=TEXT)
        prefill_last = model(**batch).logits[:, -1]
        alone = [greedy(model, sample(batch, i)) for i in range(2)]
    # Both give back the caller's own prompt (V ran it with the video span shortened to
    # frames x ([CLS] + kept patches)).
    prompt = length
    assert together.shape == (2, prompt + NEW)
    assert torch.equal(together[:, :length], batch["input_ids"])
    for i in range(2):
        assert torch.equal(together[i:i + 1, -NEW:], alone[i][:, -NEW:])
    assert torch.equal(together[:, prompt], prefill_last.argmax(-1))
    for i in range(len(video_layers(model))):
        assert seen["vision"][i] == [(2 * FRAMES, plan.vision[i][0])], f"video-tower layer {i}: runs once"
    for i in range(len(decoder_layers(model))):
        # The reduced prefill, then one token per decode step.
        assert seen["llm"][i] == [(2, plan.llm[i][0])] + [(2, 1)] * (NEW - 1), f"decoder layer {i}"


def test_l_generate_left_padded_batch_finds_each_span_from_its_placeholders(model: nn.Module) -> None:
    long = inputs(model, seed=7)
    short = synthetic_inputs(model, batch=1, text_tokens=TEXT - 3, seed=8)
    pad = torch.full((1, 3), model.config.pad_token_id)
    batch = {
        "input_ids": torch.cat([long["input_ids"], torch.cat([pad, short["input_ids"]], 1)]),
        "attention_mask": torch.cat([long["attention_mask"],
                                     torch.cat([torch.zeros_like(pad), short["attention_mask"]], 1)]),
        "pixel_values_videos": torch.cat([long["pixel_values_videos"], short["pixel_values_videos"]]),
    }
    with ficoco.apply(model, "l", keep=20, beta=0.0) as handle:
        together = greedy(model, batch)[:, -NEW:]
        kept_together = handle.records[-1].kept
        alone = []
        for x in (long, short):
            alone.append(greedy(model, x)[:, -NEW:])
            alone_kept = handle.records[-1].kept
            assert torch.equal(alone_kept[0], kept_together[len(alone) - 1])
    assert torch.equal(together[0:1], alone[0])
    assert torch.equal(together[1:2], alone[1])


# -- 6. FiCoCo-V per frame: [CLS], frame counts ------------------------------------------------

def _video_layer_output(model: nn.Module, layer: int, inp: dict[str, Tensor]) -> Tensor:
    captured = []
    h = video_layers(model)[layer].register_forward_hook(lambda m, a, out: captured.append(out))
    try:
        model(**inp)
    finally:
        h.remove()
    return captured[0]


def test_v_keeps_each_frames_cls_at_position_zero(model: nn.Module) -> None:
    inp = inputs(model, batch=2, seed=9)
    ref = _video_layer_output(model, 2, inp)
    with ficoco.apply(model, "v", keep=28) as handle:
        first = _video_layer_output(model, 2, inp)
        last = _video_layer_output(model, 4, inp)
    removed = handle.schedule.removed_at()
    assert first.shape == (2 * FRAMES, 1 + PATCHES - removed[2], 64)
    assert last.shape == (2 * FRAMES, 1 + 6, 64)
    # [CLS] of every frame attended to all patches before the first reduction and received
    # nothing: the reducing layer's output at position 0 is the unpatched one.
    torch.testing.assert_close(first[:, 0], ref[:, 0], atol=1e-5, rtol=0)
    assert (first[:, 1:] - ref[:, 0:1]).abs().amax(dim=2).min() > 1e-3  # no patch looks like [CLS]


def test_v_shortens_a_video_of_other_frame_count_frame_by_frame(model: nn.Module) -> None:
    inp = inputs(model, batch=2, seed=10, frames=2)
    assert inp["input_ids"].shape[1] == TEXT + 2 * PER_FRAME
    with ficoco.apply(model, "v", keep=28) as handle:
        logits = model(**inp).logits
        tokens = greedy(model, inp, new=2)
        assert handle.records[-1].kept.shape == (2 * 2, 6)
    assert logits.shape[1] == TEXT + 2 * (1 + 6)
    assert torch.equal(tokens[:, :-2], inp["input_ids"])


# -- 7. images run the untouched image tower ---------------------------------------------------

@pytest.mark.parametrize("variant", ["v", "l"])
def test_image_prompt_is_not_reduced(model: nn.Module, variant: str) -> None:
    inp = image_inputs(model, seed=11)
    ref = model(**inp).logits
    with ficoco.apply(model, variant, keep=28) as handle, entering_tokens(model) as seen:
        logits = model(**inp).logits
        assert handle.records == []
    assert "vision" not in seen and seen["image"][0] == [(2, 1 + PATCHES)]
    assert torch.equal(logits, ref)


# -- 8. the analytic count is what ran ---------------------------------------------------------

def test_verify_passes_on_tiny_for_vanilla_v_and_l(model: nn.Module, arch: Any) -> None:
    from ficoco.profiles import load_profile
    from ficoco.profiling.verify import verify

    schedules = [Schedule("vanilla"), schedule_for_keep(arch, "v", 28), schedule_for_keep(arch, "l", 28)]
    result = verify(load_profile("video-llava-tiny"), schedules, model=model, tolerance_percent=0.1)
    assert result.passed, result.to_json()
    for run in result.runs:
        assert all(abs(stage.fvcore_diff) <= 1e-3 for stage in run.stages), run.variant
        vision = next(stage for stage in run.stages if stage.stage == "vision")
        assert vision.analytic == vision.fvcore  # the video tower alone, at the plan's tokens
        assert run.skipped_matrix_ops == []
        assert not any("video_tower" in name for name in run.uncalled_modules)
        assert any("image_tower" in name for name in run.uncalled_modules)
    assert [len(run.method) for run in result.runs] == [0, 3, 3]


def test_cli_flops_verify_video_llava_tiny_passes_within_0_1_percent(flops_verify: Any) -> None:
    # a failed verdict (exit code 1) raises SystemExit
    report = flops_verify("--model", "video-llava-tiny", "--variant", "vanilla,v,l", "--keep", "28",
                          "--tolerance", "0.1")
    assert report["passed"] is True
    assert [(run["variant"], run["llm_visual_tokens"], run["visual_tokens"]) for run in report["runs"]] == [
        ("vanilla", SPAN, SPAN), ("v", 28, 28), ("l", SPAN, 28)]


# -- 9. bad use raises FicocoError -------------------------------------------------------------

@pytest.mark.parametrize(("variant", "how", "message"), [
    ("v", {"keep": 30}, "not reachable"),
    ("v", {"schedule": {5: 1}}, "outside the vision tower's reducing layers 0..4"),
    ("l", {"keep": 69}, "outside"),
])
def test_bad_arguments_raise_ficoco_error(model: nn.Module, variant: str, how: dict, message: str) -> None:
    with pytest.raises(FicocoError, match=message):
        ficoco.apply(model, variant, **how)
    assert "_ficoco_handle" not in model.__dict__


@pytest.mark.parametrize(("variant", "message"), [("l", "same number of image tokens"),
                                                  ("v", "same number of images")])
def test_batch_with_unequal_video_token_counts_raises(model: nn.Module, variant: str, message: str) -> None:
    good = inputs(model, batch=2, seed=12)
    bad = {k: v.clone() for k, v in good.items()}
    bad["input_ids"][1, PREFIX_TOKENS + SPAN - 1] = 7  # one placeholder fewer in sample 1
    with ficoco.apply(model, variant, keep=28):
        with pytest.raises(FicocoError, match=message):
            model(**bad)
        assert model(**good).logits.shape[1] == TEXT + 28  # recovers on the next good batch
