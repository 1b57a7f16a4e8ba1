"""FlashVID (docs/methods/flashvid.md) in ficoco: its official rows and per-family defaults, its tensor functions
(a batch is its videos alone, DySeg's extra cuts, the fixed count, a place held twice), and the method inside the
tiny Video-LLaVA, LLaVA-OneVision, Qwen2-VL and Qwen2.5-VL on videos: the tokens every layer runs on are the
accountant's plan, a batch (left-padded too) is its videos alone, generate is a hand-written decode loop, keeping
everything is bitwise vanilla, mistakes and the families it refuses are one line, `ficoco flops` plans the official
rows, the presets and a budget and verifies, and the CLI's profile, sweep and show run it. Seeded random tiny
models in fp32 on the CPU; the official rule itself is tests/test_rule_flashvid.py's."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import assert_one_error_line, forward_with_hooks, prefill_and_decode
from torch import Tensor, nn

import ficoco
from ficoco import accounting as acc
from ficoco.accounting import architecture
from ficoco.accounting.methods import extra_macs
from ficoco.accounting.schedule import plan_tokens
from ficoco.api import profile_of
from ficoco.errors import FicocoError
from ficoco.methods import flashvid
from ficoco.methods.flashvid.ops import apportion, flashvid_reduce, segment_frames
from ficoco.methods.registry import METHODS
from ficoco.models import synthetic_inputs
from ficoco.profiles import load_profile, set_layout

TINY_PROFILE = "video-llava-tiny"  # 4 frames of 16 patches + [CLS], 4 decoder layers
TEXT = 12
FRAMES, PATCHES, KEEP = 4, 16, 5


def videos(count: int, frames: int, tokens: int, width: int, seed: int) -> Tensor:
    """Videos whose first frames repeat with a little noise (TSTM links them), then change."""
    generator = torch.Generator().manual_seed(seed)
    out = torch.randn(count, frames, tokens, width, generator=generator) + 2.0
    out[:, 1] = out[:, 0] + 0.05 * torch.randn(count, tokens, width, generator=generator)
    return out


def assert_videos_alone(model: nn.Module, handle: Any, batch: dict[str, Tensor], frames: int) -> None:
    """The batch's last logits and kept tokens (the cut's rows: `frames` per video; the decoder's: one per video)
    are each video's run alone."""
    together = model(**batch).logits[:, -1]
    records = [(r.stage, r.kept) for r in handle.records]
    for i in range(batch["input_ids"].shape[0]):
        alone = model(**{k: v[i:i + 1] for k, v in batch.items()}).logits[:, -1]
        torch.testing.assert_close(together[i:i + 1], alone, atol=1e-4, rtol=0)
        for record, (stage, kept) in zip(handle.records, records, strict=True):
            rows = frames if stage == "vision" else 1
            assert torch.equal(record.kept, kept[i * rows:(i + 1) * rows])


def entering_tokens(model: nn.Module, inp: dict[str, Tensor]) -> list[int]:
    """The sequence length every decoder layer's attention ran on in one prefill."""
    seen: list[int] = []
    hooks = [layer.self_attn.register_forward_pre_hook(lambda m, args, kwargs: seen.append(
        (args[0] if args else kwargs["hidden_states"]).shape[1]), with_kwargs=True)
        for layer in model.model.language_model.layers]
    forward_with_hooks(model, inp, hooks)
    return seen


# ---- the spec: official rows, per-family defaults, the plan and its cost terms (no torch) ------------------------

def test_the_official_rows_of_retention_ratio_and_each_familys_scripts(arch_of) -> None:
    spec = METHODS["flashvid"]
    # LLaVA-OneVision-7B's 196 pooled tokens per frame: r = 0.10 .. 0.25 at expansion 1.25 (ADTS ceil(0.7 b)).
    rows = {}
    for r in (0.10, 0.15, 0.20, 0.25):
        keep = spec.settings_for_keep(None, 196, 28, {**spec.hyperparameters, "retention_ratio": r})["keep"]
        rows[r] = (keep, flashvid.adts_tokens(keep, 0.7))
    assert rows == {0.10: (25, 18), 0.15: (37, 26), 0.20: (49, 35), 0.25: (62, 44)}
    onevision = architecture(set_frames(load_profile("llava-onevision-7b"), 32))
    schedule = acc.method_schedule(onevision, "flashvid")
    settings = schedule.settings_dict()
    assert settings["keep"] == 62 and settings["token_selection_method"] == "attn_div_v2"
    assert settings["min_segment_num"] == 8
    visual = 32 * 62 + 1  # the video's newline rides along
    assert [(r.stage, r.layer, r.remove) for r in schedule.removals] == [
        ("vision", onevision.vision.feature_layer, 196 - 62), ("llm", 20, visual - math.ceil(visual * 0.3))]
    # The Qwen scripts: ADTS v1 and 4 segments; Qwen3-VL-8B prunes at layer 28 to 0.1; a value given wins.
    qwen25 = acc.method_schedule(architecture(set_frames(load_profile("qwen2.5-vl-7b"), 32)), "flashvid")
    assert {k: qwen25.settings_dict()[k] for k in ("token_selection_method", "min_segment_num", "pruning_layer")} \
        == {"token_selection_method": "attn_div", "min_segment_num": 4, "pruning_layer": 20}
    qwen3 = acc.method_schedule(architecture(set_frames(load_profile("qwen3-vl-8b"), 32)), "flashvid",
                                min_segment_num=6)
    assert qwen3.settings_dict()["min_segment_num"] == 6 and qwen3.removals[-1].layer == 28
    slices, groups, keep = 16, 576, qwen3.settings_dict()["keep"]
    assert keep == math.ceil(groups * 0.25 * 1.25)
    assert qwen3.removals[-1].remove == slices * keep - math.ceil(slices * keep * 0.1)
    assert spec.to_json()["family_hyperparameters"]["qwen3_vl"]["llm_retention_ratio"] == 0.1


def set_frames(profile: Any, frames: int) -> Any:
    set_layout(profile, frames=frames)
    return profile


def test_the_plan_counts_each_videos_work_once(arch_of) -> None:
    arch = architecture(set_frames(load_profile("llava-onevision-7b"), 32))
    schedule = acc.resolve_schedule(arch, "flashvid", acc.CountOptions(), keep=62)
    plan = plan_tokens(arch, schedule, text_tokens=TEXT)
    rows = {term: macs for _, term, macs in extra_macs(arch, schedule, plan, batch=2)}
    width, frames, tokens = arch.decoder.hidden, 32, 196
    visual = frames * 62 + 1
    assert rows == {"flashvid_segment_similarity": 2 * (frames - 1) * width,
                    "flashvid_adts_distances": 2 * frames * tokens * tokens * width,
                    "flashvid_event_relevance": 2 * frames * tokens * width,
                    "flashvid_temporal_similarity": 2 * (frames - 1) * tokens * tokens * width,
                    "flashvid_cluster_distances": 2 * frames * tokens * tokens * width,
                    "flashvid_last_row_scores": 2 * width * (TEXT + visual)}
    # ADTS v1 reads no event relevance; a budget all ADTS's runs no TSTM and no DPC-kNN.
    v1 = acc.resolve_schedule(arch, "flashvid", acc.CountOptions(), keep=62,
                              hyperparameters={"token_selection_method": "attn_div", "alpha": 1.0})
    terms = {term for _, term, _ in extra_macs(arch, v1, plan_tokens(arch, v1, text_tokens=TEXT))}
    assert terms == {"flashvid_segment_similarity", "flashvid_adts_distances", "flashvid_last_row_scores"}
    # The last vision layer's column read is declared.
    from ficoco.accounting.reads import method_reads

    reads = method_reads(arch, schedule, plan)
    assert [(r.stage, r.kind) for r in reads][:1] == [("vision", "columns")]


# ---- the tensor functions ----------------------------------------------------------------------------------------

def test_a_batch_of_videos_equals_each_video_alone() -> None:
    features = videos(3, 5, 12, 8, seed=0)
    scores = torch.rand(3, 5, 12, generator=torch.Generator().manual_seed(1))
    for selection in ("attn_div_v2", "attn_div"):
        together = flashvid_reduce(features, scores, 7, token_selection_method=selection, min_segment_num=2)
        assert together.hidden.shape == (3, 5 * 7, 8)
        assert bool((together.origin[:, 1:] >= together.origin[:, :-1]).all())  # place order
        for v in range(3):
            alone = flashvid_reduce(features[v:v + 1], scores[v:v + 1], 7, token_selection_method=selection,
                                    min_segment_num=2)
            assert torch.equal(alone.origin[0], together.origin[v])
            torch.testing.assert_close(alone.hidden[0], together.hidden[v])


def test_dyseg_adds_cuts_at_the_lowest_similarities_and_a_short_video_is_every_frame_alone() -> None:
    e = torch.eye(4)
    # Frame means (one token each): 0 ~ 1 (0.995), 1 ~ 2 (0.96), 2 | 3 (a cut: 0), 3 ~ 4 (0.98).
    means = [e[0], e[0] + 0.1 * e[1], e[0] + 0.4 * e[1], e[2], e[2] + 0.2 * e[3]]
    features = torch.stack(means).view(1, 5, 1, 4)
    assert segment_frames(features, 0.9, 1).tolist() == [[0, 0, 0, 1, 1]]
    assert segment_frames(features, 0.9, 3).tolist() == [[0, 0, 1, 2, 2]]  # then 1 | 2, the lowest left
    assert segment_frames(features, 0.9, 4).tolist() == [[0, 0, 1, 2, 3]]
    assert segment_frames(features, 0.9, 8).tolist() == [[0, 1, 2, 3, 4]]


def test_a_segments_clusters_are_apportioned_to_its_frames_by_their_roots() -> None:
    sizes = torch.tensor([[7, 2, 0, 5, 5]])
    group = torch.tensor([[0, 0, 0, 1, 1]])
    totals = torch.tensor([[6, 6, 6, 3, 3]])
    # 6 of 9 roots: 4.67, 1.33, 0 -> floors 4, 1, 0 and one more to the largest remainder; 3 of 10: 1.5, 1.5 -> the
    # earlier frame.
    assert apportion(sizes, group, totals).tolist() == [[5, 1, 0, 2, 1]]


def test_a_one_frame_segments_cluster_may_stand_on_an_adts_token_and_both_go_on_adts_first() -> None:
    features = torch.randn(1, 1, 4, 6, generator=torch.Generator().manual_seed(4))
    scores = torch.tensor([[[0.7, 0.1, 0.1, 0.1]]])
    out = flashvid_reduce(features, scores, 4)  # ADTS 3, one cluster of all 4 tokens (one density: the first)
    assert out.origin[0].tolist().count(0) == 2
    first = out.origin[0].tolist().index(0)
    torch.testing.assert_close(out.hidden[0, first], features[0, 0, 0])  # ADTS's token, as it is
    torch.testing.assert_close(out.hidden[0, first + 1], features[0, 0].mean(dim=0))  # the cluster of all
    assert out.merged[0].tolist()[first:first + 2] == [False, True]


# ---- inside the tiny Video-LLaVA -----------------------------------------------------------------------------------

def test_video_llava_runs_the_plan_batched_as_its_videos_alone_and_keep_all_is_vanilla(model: nn.Module) -> None:
    arch = architecture(profile_of(model))
    inp = synthetic_inputs(model, batch=2, text_tokens=TEXT, seed=3)
    with torch.no_grad():
        vanilla = model(**inp).logits
        with ficoco.apply(model, "flashvid", keep=PATCHES, llm_retention_ratio=1.0) as handle:
            assert not handle.schedule.removals and torch.equal(model(**inp).logits, vanilla)
        with ficoco.apply(model, "flashvid", keep=KEEP) as handle:
            seen = entering_tokens(model, inp)
            plan = plan_tokens(arch, handle.schedule, text_tokens=TEXT)
            # 4 frames x ([CLS] + 5), then ceil(0.3 x 24) stay at the tiny's last layer (pruning_layer 20).
            assert seen == [n for n, _ in plan.llm] == [TEXT + 24] * 3 + [TEXT + 8]
            assert_videos_alone(model, handle, inp, FRAMES)


def test_video_llava_left_padding_and_generate_equal_the_videos_alone_and_a_decode_loop(model: nn.Module) -> None:
    short = synthetic_inputs(model, batch=1, text_tokens=TEXT, seed=1)
    long = synthetic_inputs(model, batch=1, text_tokens=TEXT + 3, seed=2)
    zeros = torch.zeros(1, 3, dtype=torch.long)
    batch = {"input_ids": torch.cat([torch.cat([zeros, short["input_ids"]], 1), long["input_ids"]]),
             "attention_mask": torch.cat([torch.cat([zeros, short["attention_mask"]], 1), long["attention_mask"]]),
             "pixel_values_videos": torch.cat([short["pixel_values_videos"], long["pixel_values_videos"]])}
    inp = synthetic_inputs(model, batch=2, text_tokens=TEXT, seed=5)
    prompt = inp["input_ids"].shape[1]
    with torch.no_grad(), ficoco.apply(model, "flashvid", keep=KEEP) as handle:
        together = model(**batch).logits[:, -1]
        for i, sample in enumerate((short, long)):
            torch.testing.assert_close(together[i:i + 1], model(**sample).logits[:, -1], atol=1e-4, rtol=0)
        generated = model.generate(**inp, max_new_tokens=4, min_new_tokens=4, do_sample=False)
        out, positions, decoded, cache = prefill_and_decode(model, inp, 4, handle)
    assert torch.equal(generated[:, :prompt], inp["input_ids"]) and torch.equal(generated[:, prompt:], decoded)
    shortened = prompt - FRAMES * (PATCHES - KEEP)
    assert out.logits.shape[1] == shortened - (24 - 8) and cache.get_seq_length() == shortened + 3
    assert torch.equal(positions[:, -1], torch.full((2,), prompt - 1))


def test_mistakes_and_the_families_it_refuses_are_one_line(model: nn.Module, cli: Any) -> None:
    for setting, message in (({"keep": 0}, "keep 0 is outside 1..16"),
                             ({"token_selection_method": "attn"}, "choose 'attn_div_v2' or 'attn_div'"),
                             ({"llm_retention_ratio": 0.0}, r"llm_retention_ratio 0.0 is outside \(0, 1\]")):
        with pytest.raises(FicocoError, match=message):
            ficoco.apply(model, "flashvid", **setting)
        assert "_ficoco_handle" not in model.__dict__
    line = assert_one_error_line(cli("flops", "--model", "llava-1.5-7b", "--variant", "flashvid"))
    assert "a video method" in line
    line = assert_one_error_line(cli("flops", "--model", "video-llava-7b", "--variant", "flashvid", "--tflops", "0.1"))
    assert "no FlashVID setting" in line
    with pytest.raises(FicocoError, match="a video method") as error:
        ficoco.apply(ficoco.build_model("llava-tiny", dtype="fp32"), "flashvid", keep=4)
    assert "\n" not in str(error.value)
    # Qwen3.5 (not the official code's; ficoco lays out its images only) and InternVL3 (images).
    for family, words in (("qwen3_5", "run it on Qwen3-VL"), ("internvl", "a video method")):
        assert METHODS["flashvid"].family_status(family)[0] == "refused"
        with pytest.raises(FicocoError, match=words) as error:
            METHODS["flashvid"].check_runs(family, "tiny")
        assert "\n" not in str(error.value)


def test_flops_plans_the_presets_and_a_budget_and_verify_passes(flops_report: Any, flops_verify: Any) -> None:
    def row(*args: str) -> dict:
        report = flops_report("--model", "llava-onevision-7b", "--frames", "32", "--variant", "flashvid", *args)
        return report["rows"][0]

    default, presets = row(), {}
    assert default["settings"]["keep"] == 62 and default["method_label"] == "FlashVID"
    for preset in (192, 128, 64):
        planned = presets[preset] = row("--preset", str(preset))
        assert planned["settings"]["keep"] == preset and planned["llm_visual_tokens"] == 32 * preset + 1
    budget = row("--tflops", "20")
    assert budget["tflops"] <= 20 < default["tflops"] and 1 < budget["settings"]["keep"] < 62
    run = flops_verify("--model", "video-llava-tiny", "--variant", "flashvid", "--keep", str(KEEP))["runs"][0]
    stages = {s["stage"]: s for s in run["stages"]}
    assert stages["method"]["analytic_flops"] > 0 and stages["probe"]["analytic_flops"] > 0
    assert all(s["within_tolerance"] for s in stages.values())


def test_the_cli_profiles_sweeps_and_shows_it(cli: Any, tmp_path: Path) -> None:
    result = cli("profile", "--model", "video-llava-tiny", "--variant", "flashvid", "--keep", str(KEEP),
                 "--no-reference", "--repeat", "1", "--warmup", "0", "--dtype", "fp32", "--json", tmp_path / "p.json")
    assert result.code == 0, result.err
    assert "flashvid" in result.out
    result = cli("sweep", "--model", "video-llava-tiny", "--variant", "flashvid", "--keep", str(KEEP),
                 "--json", tmp_path / "s.json")
    assert result.code == 0, result.err
    result = cli("show", "--model", "video-llava-tiny", "--variant", "flashvid", "--keep", str(KEEP), "--layer", "4",
                 "--out", tmp_path / "show.png", "--dtype", "fp32")
    assert result.code == 0, result.err
    assert (tmp_path / "show.png").stat().st_size > 0


# ---- LLaVA-OneVision, Qwen2-VL and Qwen2.5-VL on videos -------------------------------------------------------------

def video_model(name: str, frames: int) -> nn.Module:
    return ficoco.build_model(set_frames(load_profile(name), frames), dtype="fp32")


def qwen_sample(inp: dict[str, Tensor], i: int) -> dict[str, Tensor]:
    """Prompt `i` of a Qwen batch alone (its video's rows of the flattened patches)."""
    rows = inp["pixel_values_videos"].shape[0] // inp["input_ids"].shape[0]
    alone = {k: v[i:i + 1] for k, v in inp.items() if k not in ("pixel_values_videos", "second_per_grid_ts")}
    return {**alone, "pixel_values_videos": inp["pixel_values_videos"][i * rows:(i + 1) * rows]}


def test_onevision_cuts_the_pooled_frames_as_planned_batched_as_videos_alone_and_refuses_an_image() -> None:
    model = video_model("llava-onevision-tiny", 3)  # 3 frames of 4 x 4 patches, pooled to 2 x 2
    arch = architecture(profile_of(model))
    inp = synthetic_inputs(model, batch=2, text_tokens=TEXT, seed=5)
    with torch.no_grad():
        vanilla = model(**inp).logits
        with ficoco.apply(model, "flashvid", keep=4, llm_retention_ratio=1.0) as handle:
            assert not handle.schedule.removals and torch.equal(model(**inp).logits, vanilla)
        with ficoco.apply(model, "flashvid", keep=3) as handle:
            seen = entering_tokens(model, inp)
            plan = plan_tokens(arch, handle.schedule, text_tokens=TEXT)
            # 3 frames x 3 + the newline; ceil(0.3 x 10) stay at the last layer.
            assert seen == [n for n, _ in plan.llm] == [TEXT + 10] * 3 + [TEXT + 3]
            assert_videos_alone(model, handle, inp, 3)
            generated = model.generate(**inp, max_new_tokens=3, min_new_tokens=3, do_sample=False)
            _, _, decoded, _ = prefill_and_decode(model, inp, 3, handle)
            assert torch.equal(generated[:, inp["input_ids"].shape[1]:], decoded)
            picture = synthetic_inputs(model, batch=1, text_tokens=TEXT, image_size=(56, 56))
            with pytest.raises(FicocoError, match="an image is one frame"):
                model(**picture)


@pytest.mark.parametrize("name,slices,groups", [("qwen2-vl-tiny", 4, 16), ("qwen2.5-vl-tiny", 4, 20)])
def test_qwen_videos_run_the_plan_at_the_unreduced_positions_batched_as_videos_alone(
        name: str, slices: int, groups: int) -> None:
    from ficoco.models import hf_compat as hf

    model = video_model(name, 2 * slices)
    arch = architecture(profile_of(model))
    inp = synthetic_inputs(model, batch=2, text_tokens=TEXT, seed=7)
    keep = 5
    given: list[Tensor] = []
    language = model.model.language_model
    hook = language.register_forward_pre_hook(lambda m, a, k: given.append(k["position_ids"]), with_kwargs=True)
    try:
        with torch.no_grad():
            vanilla = model(**inp).logits
            unreduced_deltas = hf.rope_deltas(model).clone()
            with ficoco.apply(model, "flashvid", keep=groups, llm_retention_ratio=1.0):
                assert torch.equal(model(**inp).logits, vanilla)
            given.clear()
            with ficoco.apply(model, "flashvid", keep=keep) as handle:
                seen = entering_tokens(model, inp)
                kept_in_prompt = handle.prompt_map[0]
                deltas = hf.rope_deltas(model).clone()
                plan = plan_tokens(arch, handle.schedule, text_tokens=TEXT)
                visual = slices * keep
                assert seen == [n for n, _ in plan.llm] == [TEXT + visual] * 3 + [TEXT + math.ceil(visual * 0.3)]
                together = model(**inp).logits[:, -1]
                for i in range(2):
                    torch.testing.assert_close(together[i:i + 1], model(**qwen_sample(inp, i)).logits[:, -1],
                                               atol=1e-4, rtol=0)
                if name == "qwen2-vl-tiny":  # (Qwen2.5-VL's decode is Qwen2-VL's)
                    generated = model.generate(**inp, max_new_tokens=2, min_new_tokens=2, do_sample=False)
                    singles = [model.generate(**qwen_sample(inp, i), max_new_tokens=2, min_new_tokens=2,
                                              do_sample=False) for i in range(2)]
                    assert all(torch.equal(generated[i:i + 1], singles[i]) for i in range(2))
    finally:
        hook.remove()
    assert handle.schedule.settings_dict()["token_selection_method"] == "attn_div"  # Qwen's official ADTS v1
    unreduced, _ = hf.rope_index(model, inp["input_ids"], inp["mm_token_type_ids"], None, inp["attention_mask"],
                                 video_grid_thw=inp["video_grid_thw"])
    assert torch.equal(given[0], torch.gather(unreduced, 2, kept_in_prompt.unsqueeze(0).expand(3, -1, -1)))
    assert torch.equal(deltas, unreduced_deltas + slices * (groups - keep))  # decode where the unreduced would


def test_a_qwen_place_held_twice_goes_on_as_two_tokens_at_one_position(monkeypatch: pytest.MonkeyPatch) -> None:
    """Qwen's shortened prompt repeats a placeholder a video method hands two tokens for (FlashVID: a one-slice
    segment's cluster centred on an ADTS token): both tokens reach the LLM at that group's 3-D position."""
    from ficoco.methods.flashvid import ops

    model = video_model("qwen2-vl-tiny", 8)
    inp = synthetic_inputs(model, batch=1, text_tokens=TEXT, seed=0)
    original = ops.flashvid_reduce
    held: list[Tensor] = []

    def twice_at_first(*args: Any, **kwargs: Any) -> Any:
        out = original(*args, **kwargs)
        origin = out.origin.clone()
        origin[:, 1] = origin[:, 0]  # the first place held twice (its second token's own place dropped)
        held.append(out.hidden[0, :2])
        return type(out)(hidden=out.hidden, origin=origin, merged=out.merged, segment=out.segment)

    monkeypatch.setattr(ops, "flashvid_reduce", twice_at_first)
    embeds: list[Tensor] = []
    language = model.model.language_model
    hook = language.register_forward_pre_hook(lambda m, a, k: embeds.append(k), with_kwargs=True)
    try:
        with torch.no_grad(), ficoco.apply(model, "flashvid", keep=5, llm_retention_ratio=1.0) as handle:
            model(**inp)
            kept = handle.prompt_map[0][0]
    finally:
        hook.remove()
    video = inp["input_ids"][0, kept] == model.config.video_token_id
    first = int(video.nonzero()[0])
    assert kept[first] == kept[first + 1] and int(video.sum()) == 4 * 5
    torch.testing.assert_close(embeds[0]["inputs_embeds"][0, first:first + 2], held[0])
    positions = embeds[0]["position_ids"]
    assert torch.equal(positions[..., first], positions[..., first + 1])


@pytest.mark.parametrize("name", ["qwen3-vl-tiny", "qwen3-vl-moe-tiny"])
def test_qwen3_vl_videos_run_the_plan_slice_by_slice_with_the_deepstack_features_of_the_kept_places(name: str) -> None:
    """Qwen3-VL lays a video out one span per temporal slice, each after its timestamp: the cut shortens every
    slice's span to its kept places, the decoder's step counts the video once, and DeepStack adds to every token the
    features of its place (an ADTS token's own, a cluster's centre's), as the official code gathers them."""
    from ficoco.models import hf_compat as hf
    from ficoco.profiling.verify import verify_run

    model = video_model(name, 8)  # 4 slices of 80 merge groups
    arch = architecture(profile_of(model))
    text, keep, slices, groups = 40, 10, 4, 80
    inp = synthetic_inputs(model, batch=2, text_tokens=text, seed=3)
    language = model.model.language_model
    original = getattr(language, hf.DEEPSTACK_ADD)
    added: list[tuple[Tensor, Tensor]] = []

    def spy(hidden: Tensor, mask: Tensor, embeds: Tensor) -> Tensor:
        added.append((mask.clone(), embeds.clone()))
        return original(hidden, mask, embeds)

    setattr(language, hf.DEEPSTACK_ADD, spy)
    try:
        with torch.no_grad():
            taps = getattr(model.model.visual(inp["pixel_values_videos"], grid_thw=inp["video_grid_thw"]),
                           hf.DEEPSTACK_FEATURES_FIELD)
            with ficoco.apply(model, "flashvid", keep=keep) as handle:
                seen = entering_tokens(model, inp)
                kept_in_prompt = handle.prompt_map[0]
                plan = plan_tokens(arch, handle.schedule, text_tokens=text)
                visual = slices * keep  # inside the LLM: Qwen3-VL-8B's 0.1 at the tiny's last layer
                assert seen == [n for n, _ in plan.llm] == [text + visual] * 3 + [text + math.ceil(visual * 0.1)]
                together = model(**inp).logits[:, -1]
                for i in range(2):
                    torch.testing.assert_close(together[i:i + 1], model(**qwen_sample(inp, i)).logits[:, -1],
                                               atol=1e-4, rtol=0)
    finally:
        delattr(language, hf.DEEPSTACK_ADD)
    for tap, (mask, embeds) in enumerate(added[:len(taps)]):
        expected = []
        for b in range(2):
            ids = inp["input_ids"][b]
            placeholders = (ids == model.config.video_token_id).nonzero().flatten()
            kept = kept_in_prompt[b][ids[kept_in_prompt[b]] == model.config.video_token_id]
            units = torch.searchsorted(placeholders, kept)  # a place: slice x groups + group
            expected.append(taps[tap][b * slices * groups + units])
        assert int(mask.sum()) == 2 * visual
        torch.testing.assert_close(embeds, torch.cat(expected))
    # Every slice's span keeps its markers and timestamp; the video counts once inside the LLM.
    assert int((inp["input_ids"][0, kept_in_prompt[0]] == model.config.vision_start_token_id).sum()) == slices
    if name == "qwen3-vl-tiny":
        run = verify_run(model, arch, handle.schedule, text_tokens=text, batch=1)
        assert {s.stage: s for s in run.stages}["method"].analytic > 0 and run.passed(0.5)
