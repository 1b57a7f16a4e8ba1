"""The methods before the LLM on a Qwen video (Qwen2-VL, Qwen2.5-VL, Qwen3-VL): every temporal slice is one item,
reduced exactly as the method reduces one image of that slice's grid (`MethodSpec.video_slices`).

- The rule's ground: Qwen's vision tower computes the same hidden states (and merged features, and Qwen3-VL's
  DeepStack taps) for a video of grid (t, h, w) as for t images of grid (1, h, w) made of its slices' pixel rows:
  its attention segments, rotary table, windows and position embeddings are per slice.
- (a) the groups a video keeps in every slice, read from where the prefill's kept tokens stand in the caller's
  prompt, equal the groups the method keeps on the t images made of its slices (read from their records), and the
  video's features equal those images' features one after the other;
- (b) the video span in the prefill holds t x the per-slice count (Qwen3-VL: every slice's span holds it);
- (c) generate runs with the video and the cache, and the accountant plans the visual tokens the run handed on.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor, nn

import ficoco
from ficoco.accounting import architecture
from ficoco.accounting.schedule import plan_tokens
from ficoco.api import profile_of
from ficoco.errors import FicocoError
from ficoco.models import synthetic_inputs
from ficoco.profiles import load_profile, set_layout

FRAMES, SLICES = 6, 3  # 6 frames: 3 temporal slices of 2 frames
TEXT = 40

# Per profile: the merge groups of one slice, and per method two budgets of (keep, groups every slice keeps); FiCoCo-V's
# keep counts every visual token that reaches the LLM (`ficoco methods`: its keep), the others' one item's.
PROFILES = {
    "qwen2.5-vl-tiny": (20, {"v": ((6, 2), (30, 10)), "visionzip": ((4, 4), (12, 12)),
                             "divprune": ((3, 3), (10, 10))}),
    "qwen3-vl-tiny": (80, {"v": ((24, 8), (90, 30)), "visionzip": ((8, 8), (30, 30)),
                           "divprune": ((6, 6), (40, 40))}),
}
CASES = [(profile, variant, keep, per_slice) for profile, (_, budgets) in PROFILES.items()
         for variant, pairs in budgets.items() for keep, per_slice in pairs]


@pytest.fixture(scope="module")
def models() -> dict[str, nn.Module]:
    """The tiny profiles laid out as a video of FRAMES frames, built once (fp32, seeded random weights)."""
    built = {}
    for name in (*PROFILES, "qwen2-vl-tiny"):
        profile = load_profile(name)
        set_layout(profile, frames=FRAMES)
        built[name] = ficoco.build_model(profile, dtype="fp32")
    return built


def video(model: nn.Module, seed: int = 0, batch: int = 1) -> dict[str, Tensor]:
    return synthetic_inputs(model, batch=batch, text_tokens=TEXT if model.config.model_type != "qwen3_vl" else 60,
                            seed=seed, frames=FRAMES)


def as_images(grid: Tensor) -> Tensor:
    """A video's grid rows (t, h, w) as the t image rows (1, h, w) of its slices."""
    rows = grid.repeat_interleave(grid[:, 0], dim=0).clone()
    rows[:, 0] = 1
    return rows


def slice_spans(input_ids: Tensor, video_token: int) -> list[tuple[int, int]]:
    """(start, length) of every run of video placeholders of a prompt row, in order."""
    flags = (input_ids == video_token).tolist()
    spans, start = [], None
    for i, flag in enumerate([*flags, False]):
        if flag and start is None:
            start = i
        elif not flag and start is not None:
            spans.append((start, i - start))
            start = None
    return spans


def kept_units(input_ids: Tensor, positions: Tensor, video_token: int, groups: int) -> list[int]:
    """The video units (slice x groups + group) whose placeholders the prefill kept, from its positions in the
    caller's prompt: one span per video (Qwen2-VL's layout) or one per slice (Qwen3-VL's)."""
    spans = slice_spans(input_ids, video_token)
    units = []
    for p in positions.tolist():
        for index, (start, length) in enumerate(spans):
            if start <= p < start + length:
                units.append(p - start + (index * groups if len(spans) > 1 else 0))
    return units


def image_groups(record: Any, grid_w: int, merge_size: int) -> list[list[int]]:
    """Per image of a record, the merge groups whose patches it kept (row-major patch indices -> group indices)."""
    out = []
    for row in record.kept.tolist():
        patches = [p for p in row if p >= 0]
        out.append(sorted({(p // grid_w // merge_size) * (grid_w // merge_size) + (p % grid_w) // merge_size
                           for p in patches}))
    return out


# -- the rule's ground: the tower's states of a video equal those of its slices as images -------------------------

@pytest.mark.parametrize("name", ["qwen2-vl-tiny", "qwen2.5-vl-tiny", "qwen3-vl-tiny"])
def test_the_tower_states_of_a_video_equal_those_of_its_slices_as_images(models, name) -> None:
    model = models[name]
    inp = video(model, seed=1)
    visual = model.model.visual
    pixels, grid = inp["pixel_values_videos"], inp["video_grid_thw"]
    assert grid[0, 0] == SLICES
    with torch.no_grad():
        whole = visual(pixels, grid_thw=grid)
        sliced = visual(pixels, grid_thw=as_images(grid))
    torch.testing.assert_close(sliced.last_hidden_state, whole.last_hidden_state, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(sliced.pooler_output, whole.pooler_output, atol=1e-5, rtol=1e-5)
    taps = getattr(whole, "deepstack_features", None)
    if name.startswith("qwen3"):
        assert taps
        for a, b in zip(sliced.deepstack_features, taps, strict=True):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


# -- (a), (b), (c) for every method and budget -------------------------------------------------------------------

@pytest.mark.parametrize(("name", "variant", "keep", "per_slice"), CASES,
                         ids=[f"{p}-{v}-{k}" for p, v, k, _ in CASES])
def test_every_slice_keeps_what_the_method_keeps_on_it_as_an_image(models, name, variant, keep, per_slice) -> None:
    model = models[name]
    groups = PROFILES[name][0]
    config = model.config
    merge_size = config.vision_config.spatial_merge_size
    inp = video(model, seed=3)
    pixels, grid = inp["pixel_values_videos"], inp["video_grid_thw"]
    grid_w = int(grid[0, 2])
    ids = inp["input_ids"]
    with torch.no_grad(), ficoco.apply(model, variant, keep=keep) as handle:
        logits = model(**inp).logits
        positions = handle.output_positions[0]
        kept_ids = ids[0, positions]
        # (b) the video's span(s) in the prefill
        units = kept_units(ids[0], positions[kept_ids == config.video_token_id], config.video_token_id, groups)
        spans = slice_spans(ids[0], config.video_token_id)
        plan = plan_tokens(architecture(profile_of(model)), handle.schedule,
                           text_tokens=int((ids[0] != config.video_token_id).sum()))
        video_features = model.model.get_video_features(pixels, grid)
        # (c) generate with the video and the cache
        out = model.generate(**inp, max_new_tokens=3, min_new_tokens=3, do_sample=False, use_cache=True)
    with torch.no_grad(), ficoco.apply(model, variant, keep=keep) as handle:
        image_features = model.model.get_image_features(pixels, as_images(grid))
        records = [r for r in handle.records if r.stage == "vision"]
    # (a) the rule restated: every slice keeps the groups the method keeps on the image of that slice
    per_image = image_groups(records[-1], grid_w, merge_size)
    assert len(per_image) == SLICES and all(len(g) == per_slice for g in per_image)
    assert len({tuple(g) for g in per_image}) > 1, "the slices should keep different groups (a check with teeth)"
    assert units == [s * groups + g for s, kept in enumerate(per_image) for g in kept]
    (joined,) = video_features.pooler_output
    torch.testing.assert_close(joined, torch.cat(image_features.pooler_output), atol=1e-5, rtol=1e-5)
    if name.startswith("qwen3"):
        for tap_video, tap_images in zip(video_features.deepstack_features, image_features.deepstack_features,
                                         strict=True):
            torch.testing.assert_close(tap_video[0], torch.cat(tap_images), atol=1e-5, rtol=1e-5)
    # (b) t x keep in the video span (Qwen3-VL: keep in each slice's span)
    assert len(units) == SLICES * per_slice
    assert logits.shape[1] == ids.shape[1] - SLICES * (groups - per_slice)
    if len(spans) > 1:
        assert len(spans) == SLICES
        assert [sum(start <= p < start + n for p in positions.tolist()) for start, n in spans] == [per_slice] * SLICES
    # (c) generate ran on the cache; the accountant plans the visual tokens the run handed the LLM
    assert out.shape == (1, ids.shape[1] + 3) and torch.equal(out[:, :ids.shape[1]], ids)
    assert plan.llm_visual_tokens == len(units) == SLICES * per_slice


def test_a_batch_of_videos_equals_each_alone(models) -> None:
    model = models["qwen2.5-vl-tiny"]
    inp = video(model, seed=5, batch=2)
    inp["second_per_grid_ts"] = torch.tensor([1.0, 2.5])  # temporal positions scaled per video
    rows = inp["pixel_values_videos"].shape[0] // 2
    with torch.no_grad(), ficoco.apply(model, "visionzip", keep=6):
        together = model(**inp).logits[:, -1]
        for i in range(2):
            alone = {k: v[i:i + 1] for k, v in inp.items() if k != "pixel_values_videos"}
            alone["pixel_values_videos"] = inp["pixel_values_videos"][i * rows:(i + 1) * rows]
            torch.testing.assert_close(together[i:i + 1], model(**alone).logits[:, -1], atol=1e-4, rtol=0)


OTHERS = ("tome", "fastervlm", "vispruner", "cdpruner", "hiprune", "gprune", "vscan")


@pytest.mark.parametrize("variant", OTHERS)
@pytest.mark.parametrize("name", list(PROFILES))
def test_the_other_methods_before_the_llm_reduce_every_slice_as_planned(models, name, variant) -> None:
    """Every other method before the LLM wired on Qwen comes along (`MethodSpec.video_slices`): at its default
    setting the video hands the LLM what the accountant plans for its slices, and generate runs on the cache."""
    from ficoco.methods.registry import METHODS

    assert METHODS[variant].video_slices
    model = models[name]
    inp = video(model, seed=9)
    ids, token = inp["input_ids"], model.config.video_token_id
    with torch.no_grad(), ficoco.apply(model, variant) as handle:
        model(**inp)
        run = int((ids[0, handle.output_positions[0]] == token).sum())
        plan = plan_tokens(architecture(profile_of(model)), handle.schedule, text_tokens=int((ids[0] != token).sum()))
        out = model.generate(**inp, max_new_tokens=2, min_new_tokens=2, do_sample=False)
    assert run == plan.llm_visual_tokens and run % SLICES == 0 and run < int((ids == token).sum())
    assert out.shape == (1, ids.shape[1] + 2)


# -- what stays refused, in one line -----------------------------------------------------------------------------

def test_a_method_without_a_fixed_count_and_images_with_videos_are_refused_in_one_line(models) -> None:
    model = models["qwen3-vl-tiny"]
    inp = video(model, seed=7)
    # Planned on the video layout: the accountant refuses it before the run.
    with pytest.raises(FicocoError, match="PixelPrune on qwen3-vl-tiny reduces images, and a video here passes it"):
        ficoco.apply(model, "pixelprune")
    # Planned on an image, given a video: the entry refuses it.
    image_layout = ficoco.build_model("qwen3-vl-tiny", dtype="fp32")
    with torch.no_grad(), ficoco.apply(image_layout, "pixelprune"), pytest.raises(FicocoError) as refused:
        image_layout(**inp)
    assert "PixelPrune on Qwen3-VL reduces images only" in str(refused.value) and "\n" not in str(refused.value)
    picture = synthetic_inputs(image_layout, batch=1, text_tokens=TEXT, seed=8)
    both = {**inp, "pixel_values": picture["pixel_values"], "image_grid_thw": picture["image_grid_thw"]}
    with torch.no_grad(), ficoco.apply(model, "divprune", keep=8), pytest.raises(FicocoError) as refused:
        model(**both)
    assert "one kind per call" in str(refused.value) and "\n" not in str(refused.value)
