"""FiCoCo and the registry methods inside Hugging Face LLaVA-OneVision (issue 25), end to end.

A seeded random llava-onevision-tiny model in fp32 on CPU: a SigLIP tower of 4 layers without [CLS]
over 56 px items (a 4 x 4 patch grid; V reduces in layers 2..3 with the equivalent token), a Qwen2
decoder of 4 layers (L reduces in 1..3). The default 112 x 112 image is a base view and 2 x 2 crops
(5 items): 16 + 8 x 8 + 8 newlines = 88 visual tokens. At 168 x 168 the 3 x 3 crops' 12 x 12 grid is
over the profile's anyres_max_4 budget and transformers resizes it to 8 x 8. A video of 3 frames is
3 x (2 x 2 pooled) + 1 newline = 13 tokens. Prompts are 12 text tokens around the visual span.
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
from ficoco.accounting import CountOptions, architecture, resolve_schedule
from ficoco.accounting.methods import extra_macs
from ficoco.accounting.schedule import plan_tokens, schedule_for_keep
from ficoco.api import profile_of
from ficoco.errors import FicocoError
from ficoco.models.hf_compat import cache_argument, output_cache
from ficoco.models.llava_onevision import PREFIX_TOKENS, LlavaOnevisionAdapter, image_layout, synthetic_inputs
from ficoco.profiles import load_profile, set_layout
from ficoco.profiling.verify import verify

NAME = "llava-onevision-tiny"
TEXT = 12
SIDE = 4
PATCHES = SIDE * SIDE
ITEMS = 5
ROWS = 2 * SIDE
VISUAL = PATCHES + ROWS * ROWS + ROWS  # 88
IMAGE_TOKEN, VIDEO_TOKEN = 300, 301
NEW = 4


TINY_PROFILE = NAME  # built as this module's `model` (conftest.py)


@pytest.fixture(scope="module")
def arch(model: nn.Module) -> Any:
    return architecture(profile_of(model, NAME))


def inputs(model: nn.Module, batch: int = 1, seed: int = 0, **kwargs: Any) -> dict[str, Tensor]:
    return synthetic_inputs(model, batch=batch, text_tokens=TEXT, seed=seed, **kwargs)


def greedy(model: nn.Module, inp: dict[str, Tensor], **kwargs: Any) -> Any:
    return model.generate(**inp, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, **kwargs)


def v_keep(kept_per_item: int) -> int:
    return ITEMS * kept_per_item + ROWS


@contextlib.contextmanager
def entering_tokens(model: nn.Module) -> Iterator[dict[str, dict[int, list[tuple[int, int]]]]]:
    """(batch rows, tokens) at the entry of every SigLIP and decoder layer and of its MLP."""
    seen: dict[str, dict[int, list[tuple[int, int]]]] = {k: defaultdict(list) for k in ("vision", "llm", "llm-mlp")}
    hooks = []
    for stage, layers in (("vision", model.model.vision_tower.encoder.layers),
                          ("llm", model.model.language_model.layers)):
        for i, layer in enumerate(layers):
            def hook(module: nn.Module, args: tuple, kwargs: dict, _stage: str = stage, _i: int = i) -> None:
                hidden = args[0] if args else kwargs["hidden_states"]
                seen[_stage][_i].append(tuple(hidden.shape[:2]))

            def mlp_hook(module: nn.Module, args: tuple, _stage: str = stage, _i: int = i) -> None:
                seen[f"{_stage}-mlp"][_i].append(tuple(args[0].shape[:2]))

            hooks.append(layer.register_forward_pre_hook(hook, with_kwargs=True))
            if stage == "llm":
                hooks.append(layer.mlp.register_forward_pre_hook(mlp_hook))
    try:
        yield seen
    finally:
        for h in hooks:
            h.remove()


# -- layouts: the model's own packing, the accountant's counts ------------------------------------

@pytest.mark.parametrize("size", [(112, 112), (168, 168), (60, 100), (56, 56)])
def test_layouts_equal_the_accountant_and_transformers_packing(model: nn.Module, size: tuple[int, int]) -> None:
    layout = image_layout(model.config, size)
    profile = load_profile(NAME)
    set_layout(profile, image_size=size)
    arch = architecture(profile)
    assert (layout.items, layout.tokens, layout.newline_rows) == (arch.vision.items, arch.visual_tokens,
                                                                  arch.newline_tokens)
    assert layout.downscaled == bool(arch.post_projector_drops) == (size == (168, 168))
    features, newline = torch.randn(layout.items, PATCHES, 8), torch.randn(8)
    expected = model.model.pack_image_features([features], torch.tensor([size]), newline,
                                               model.config.vision_aspect_ratio)[0][0]
    assert expected.shape[0] == layout.tokens
    assert torch.equal(expected[layout.newline_flags()], newline.expand(layout.newline_rows, -1))
    if layout.downscaled:  # the traceable stand-in (flops --verify) computes transformers' resize
        torch.testing.assert_close(layout.pack_resized(features, newline), expected)
    else:
        assert torch.equal(layout.pack(features, torch.arange(PATCHES).expand(layout.items, -1), newline), expected)
    inp = inputs(model, image_size=size)
    assert int((inp["input_ids"] == IMAGE_TOKEN).sum()) == layout.tokens
    assert bool((inp["input_ids"][0, PREFIX_TOKENS:PREFIX_TOKENS + layout.tokens] == IMAGE_TOKEN).all())


# -- an empty schedule is the unpatched model ---------------------------------------------------

@pytest.mark.parametrize("variant", ["v", "l"])
def test_empty_schedule_logits_loss_and_generate_equal_unpatched(model: nn.Module, variant: str) -> None:
    inp = inputs(model, batch=2)
    labels = inp["input_ids"].masked_fill(inp["input_ids"] == IMAGE_TOKEN, -100)
    ref = model(**inp, labels=labels)
    ref_tokens = greedy(model, inp)
    with ficoco.apply(model, variant, schedule={}) as handle:
        assert isinstance(handle.model, nn.Module) and "forward" in model.__dict__
        out = model(**inp, labels=labels)
        tokens = greedy(model, inp)
        assert handle.records == []
    assert torch.equal(out.logits, ref.logits)
    torch.testing.assert_close(out.loss, ref.loss, atol=1e-6, rtol=0)
    assert torch.equal(tokens, ref_tokens)


# -- tokens every layer processes == the accountant's plan --------------------------------------

SCHEDULES = [("v", {"keep": v_keep(8)}), ("v", {"schedule": {2: 4, 3: 6}}), ("l", {"keep": 40}),
             ("l", {"keep": 30, "image_size": (168, 168)}), ("l", {"keep": 7, "frames": 3})]


@pytest.mark.parametrize(("variant", "how"), SCHEDULES, ids=[f"{v}-{sorted(h)}" for v, h in SCHEDULES])
def test_tokens_entering_every_layer_equal_the_plan(model: nn.Module, variant: str, how: dict) -> None:
    how = dict(how)
    layout = {k: how.pop(k) for k in ("image_size", "frames") if k in how}
    inp = inputs(model, batch=2, seed=3, **layout)
    with ficoco.apply(model, variant, **how, **layout) as handle, entering_tokens(model) as seen:
        logits = model(**inp).logits
    profile = profile_of(model, NAME)
    set_layout(profile, **layout)
    arch = architecture(profile)
    plan = plan_tokens(arch, handle.schedule, text_tokens=TEXT)
    assert handle.schedule.total_removed > 0
    for i, (n_in, _) in enumerate(plan.vision):
        assert seen["vision"][i] == [(2 * plan.vision_items, n_in)], f"vision layer {i}"
    for i, (n_in, n_out) in enumerate(plan.llm):
        assert seen["llm"][i] == [(2, n_in)] and seen["llm-mlp"][i] == [(2, n_out)], f"decoder layer {i}"
    assert logits.shape[1] == plan.llm[-1][1] == TEXT + plan.visual_tokens
    if "keep" in how:
        assert plan.visual_tokens == how["keep"]


def test_l_keeps_the_video_newline_and_the_image_newlines(model: nn.Module) -> None:
    for layout, newlines in (({"frames": 3}, [12]), ({}, [PATCHES + (r + 1) * (ROWS + 1) - 1 for r in range(ROWS)])):
        inp = inputs(model, batch=2, seed=8, **layout)
        span = int(torch.isin(inp["input_ids"][0], torch.tensor([IMAGE_TOKEN, VIDEO_TOKEN])).sum())
        with ficoco.apply(model, "l", keep=len(newlines) + 1, shape="oneshot", **layout) as handle:
            model(**inp)
            kept = handle.records[-1].kept
        assert tuple(kept.shape) == (2, len(newlines) + 1), span
        assert bool(torch.isin(torch.tensor(newlines), kept).all())


# -- batches, generation, a second turn -----------------------------------------------------------

@pytest.mark.parametrize("variant", ["v", "l"])
def test_batch_and_generate_equal_samples_alone(model: nn.Module, variant: str) -> None:
    batch = inputs(model, batch=2, seed=4)
    with ficoco.apply(model, variant, keep=v_keep(6)):
        together = model(**batch).logits
        tokens = greedy(model, batch)
        for i in range(2):
            alone = {k: v[i:i + 1] for k, v in batch.items()}
            torch.testing.assert_close(together[i:i + 1], model(**alone).logits, atol=1e-5, rtol=0)
            assert torch.equal(tokens[i:i + 1], greedy(model, alone))
        prefill_last = model(**batch).logits[:, -1]
    length = batch["input_ids"].shape[1]
    assert torch.equal(tokens[:, :length], batch["input_ids"])  # the caller's prompt given back
    assert torch.equal(tokens[:, length], prefill_last.argmax(-1))
    assert not torch.allclose(together[0], together[1], atol=1e-3)


@pytest.mark.parametrize("variant", ["v", "l"])
def test_text_turn_on_the_cache_equals_the_whole_conversation(model: nn.Module, variant: str) -> None:
    first = inputs(model, seed=36)
    question = inputs(model, seed=37)["input_ids"][:, -4:]
    with ficoco.apply(model, variant, keep=v_keep(5)):
        turn1 = greedy(model, first, return_dict_in_generate=True)
        ids = torch.cat([turn1.sequences, question], dim=1)
        nxt = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        turn2 = greedy(model, nxt, return_dict_in_generate=True, **cache_argument(output_cache(turn1)))
        whole = greedy(model, {**nxt, "pixel_values": first["pixel_values"], "image_sizes": first["image_sizes"]},
                       return_dict_in_generate=True)
    assert torch.equal(turn2.sequences[:, :ids.shape[1]], ids)
    assert torch.equal(turn2.sequences, whole.sequences)
    assert output_cache(turn2).get_seq_length() == output_cache(whole).get_seq_length()


def test_images_of_a_multi_image_sample_are_base_views_with_one_newline(model: nn.Module) -> None:
    """batch_num_images [2]: transformers packs each image as its base view and one newline (17 tokens);
    the empty schedule is the unpatched model, V hands on 2 x (kept + 1) tokens, L keeps both newlines."""
    prompt = inputs(model, seed=40)["input_ids"]
    text = prompt[prompt != IMAGE_TOKEN].view(1, TEXT)
    span = torch.full((1, PATCHES + 1), IMAGE_TOKEN)
    ids = torch.cat([text[:, :3], span, text[:, 3:6], span, text[:, 6:]], dim=1)
    inp = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "pixel_values": torch.randn(2, ITEMS, 3, 56, 56),
           "image_sizes": torch.tensor([[112, 112], [112, 112]]), "batch_num_images": torch.tensor([2])}
    reference = model(**inp).logits
    for variant in ("v", "l"):
        with ficoco.apply(model, variant, schedule={}):
            assert torch.equal(model(**inp).logits, reference)
    with ficoco.apply(model, "v", keep=v_keep(8)):
        assert model(**inp).logits.shape[1] == TEXT + 2 * (8 + 1)
    with ficoco.apply(model, "l", schedule={1: 6}) as handle:  # removed per image span
        assert model(**inp).logits.shape[1] == ids.shape[1] - 12
        kept = handle.records[0].kept[0]
    newlines = torch.tensor([PATCHES, 2 * PATCHES + 1])
    assert bool(torch.isin(newlines, kept).all())


# -- refusals -------------------------------------------------------------------------------------

def test_methods_that_cut_before_the_llm_refuse_resampled_grids(model: nn.Module) -> None:
    with pytest.raises(FicocoError, match="anyres_max_4 and is downscaled"):
        ficoco.apply(model, "v", keep=v_keep(8), image_size=(168, 168))
    with pytest.raises(FicocoError, match="pooled 2x2"):
        ficoco.apply(model, "visionzip", keep=4, frames=3)
    with pytest.raises(FicocoError, match="PruMerge\\+ is defined on .*SigLIP has no \\[CLS\\]"):
        ficoco.apply(model, "prumerge", keep=4)
    with pytest.raises(FicocoError, match="HoliTom on llava-onevision-tiny: a video method.*give frames="):
        ficoco.apply(model, "holitom", keep=2)  # the profile's image
    assert "forward" not in model.__dict__


# -- registry methods besides FiCoCo --------------------------------------------------------------

@pytest.mark.parametrize(("variant", "keep"), [("visionzip", 8), ("dart", 40)])
def test_registry_methods_run_batched_as_samples_alone(model: nn.Module, variant: str, keep: int) -> None:
    batch = inputs(model, batch=2, seed=12)
    with ficoco.apply(model, variant, keep=keep) as handle:
        together = model(**batch).logits
        for i in range(2):
            alone = {k: v[i:i + 1] for k, v in batch.items()}
            torch.testing.assert_close(together[i:i + 1], model(**alone).logits, atol=1e-5, rtol=0)
        settings = handle.schedule.settings_dict()
    assert together.shape[1] < batch["input_ids"].shape[1]
    if variant == "visionzip":  # SigLIP has no [CLS]: the equivalent token scores, and says so
        assert "equivalent token" in settings["score"]
        assert together.shape[1] == TEXT + ITEMS * keep + ROWS


# -- the accountant's counts are what runs ---------------------------------------------------------

def test_verify_passes_on_tiny_for_vanilla_v_and_l_and_a_downscaled_image(model: nn.Module, arch: Any) -> None:
    schedules = [schedule_for_keep(arch, variant, v_keep(8)) for variant in ("vanilla", "v", "l")]
    result = verify(load_profile(NAME), schedules, tolerance_percent=0.5, model=model)
    assert result.passed, result.to_json()
    assert [run.plan.visual_tokens for run in result.runs] == [VISUAL, v_keep(8), v_keep(8)]
    assert all(run.skipped_matrix_ops == [] for run in result.runs)  # SigLIP's "valid" convolution counted
    assert isinstance(ficoco.models.adapter_for(model), LlavaOnevisionAdapter)
    assert "pack_image_features" not in model.model.__dict__
    profile = load_profile(NAME)
    set_layout(profile, image_size=(168, 168))
    big = architecture(profile)
    result = verify(profile, [schedule_for_keep(big, "l", 30)], tolerance_percent=0.5)
    assert result.passed, result.to_json()
    # VisionZip scores with the equivalent token: no [CLS] row is computed, and none is counted.
    schedule = resolve_schedule(arch, "visionzip", CountOptions(), keep=8)
    result = verify(load_profile(NAME), [schedule], tolerance_percent=0.5, model=model)
    assert result.passed, result.to_json()
    assert not any(term.endswith("_cls_row") for _, term, _ in
                   extra_macs(arch, schedule, plan_tokens(arch, schedule)))


# -- the diversity methods on an image: the plan runs, batched, and fvcore agrees -----------------

def test_divprune_vispruner_and_cdpruner_run_the_plan_generate_batched_and_verify(model: nn.Module, arch: Any) -> None:
    batch = inputs(model, batch=2, seed=13)
    schedules = []
    for variant in ("divprune", "vispruner", "cdpruner"):
        with torch.no_grad(), ficoco.apply(model, variant, keep=8) as handle:
            length = model(**batch).logits.shape[1]
            together = greedy(model, batch)
            alone = greedy(model, {k: v[1:] for k, v in batch.items()})
        assert length == TEXT + plan_tokens(arch, handle.schedule, text_tokens=TEXT).llm_visual_tokens
        assert length == TEXT + ITEMS * 8 + ROWS
        assert torch.equal(together[1:], alone), variant
        schedules.append(handle.schedule)
    result = verify(load_profile(NAME), schedules, tolerance_percent=0.5, model=model)
    assert result.passed, result.to_json()
    assert all(run.stages[-1].analytic > 0 for run in result.runs)  # the method's own stage is counted


# -- HoliTom on a video: every frame's pooled grid, as its official code runs on OneVision ----------

FRAMES, POOLED, KEEP_FRAME = 3, 4, 2  # a frame's 4 x 4 patches pool to 2 x 2; HoliTom keeps 2 per frame


@pytest.fixture()
def video_model(model: nn.Module, monkeypatch: pytest.MonkeyPatch) -> nn.Module:
    """The tiny model laid out for a video of FRAMES frames (its synthetic inputs, verify's run)."""
    defaults = {k: v for k, v in model.__dict__["_ficoco_defaults"].items() if k != "image_size"}
    monkeypatch.setitem(model.__dict__, "_ficoco_defaults", {**defaults, "frames": FRAMES})
    return model


def video_arch() -> Any:
    profile = load_profile(NAME)
    set_layout(profile, frames=FRAMES)
    return architecture(profile)


def test_holitom_on_a_video_runs_the_plan_batched_as_videos_alone_and_keep_all_is_vanilla(
        video_model: nn.Module) -> None:
    model, arch = video_model, video_arch()
    inp = inputs(model, batch=2, seed=5)
    with torch.no_grad():
        vanilla = model(**inp).logits
        with ficoco.apply(model, "holitom", keep=POOLED, merge_ratio=0.0) as handle:
            assert not handle.schedule.removals and torch.equal(model(**inp).logits, vanilla)
        with entering_tokens(model) as seen, ficoco.apply(model, "holitom", keep=KEEP_FRAME) as handle:
            together = model(**inp).logits[:, -1]
            assert handle.measured_tokens_per_item == KEEP_FRAME
            for i in range(2):
                alone = model(**{k: v[i:i + 1] for k, v in inp.items()}).logits[:, -1]
                torch.testing.assert_close(together[i:i + 1], alone, atol=1e-5, rtol=0)
    plan = plan_tokens(arch, handle.schedule, text_tokens=TEXT)
    # Outer: 3 frames x 2 + the newline; inner: round(7 / 2) stay at the tiny's last layer (HOLITOM_k 18).
    assert plan.llm_visual_tokens == FRAMES * KEEP_FRAME + 1
    # (The merge runs at layer 3's input, inside the layer's call: its MLP sees the merged sequence.)
    assert [seen["llm-mlp"][i][0][1] for i in range(4)] == [n for n, _ in plan.llm] == [TEXT + 7] * 3 + [TEXT + 4]
    assert seen["vision"][0][0] == (2 * FRAMES, PATCHES)  # the tower runs every patch of every frame
    from ficoco.profiling.verify import verify_run

    run = verify_run(model, arch, handle.schedule, text_tokens=TEXT, batch=2)
    stages = {s.stage: s for s in run.stages}
    assert stages["method"].analytic > 0 and run.passed(0.5)


def test_holitom_on_a_video_generates_as_a_hand_written_decode_and_refuses_an_image(video_model: nn.Module) -> None:
    from helpers import prefill_and_decode

    model = video_model
    inp = inputs(model, batch=2, seed=6)
    prompt = inp["input_ids"].shape[1]
    with torch.no_grad(), ficoco.apply(model, "holitom", keep=KEEP_FRAME) as handle:
        generated = greedy(model, inp)
        out, positions, decoded, _ = prefill_and_decode(model, inp, NEW, handle)
        with pytest.raises(FicocoError, match="an image is one frame"):
            model(**inputs(model, image_size=(112, 112)))
    assert torch.equal(generated[:, :prompt], inp["input_ids"]) and torch.equal(generated[:, prompt:], decoded)
    ids = torch.gather(inp["input_ids"], 1, positions)
    assert torch.equal(positions[:, -1], torch.full((2,), prompt - 1))
    assert bool((ids == VIDEO_TOKEN).sum(dim=1).eq(4).all())  # 7 outer tokens, 3 merged inside the LLM


def test_holitom_text_turn_on_a_video_cache_equals_the_whole_conversation(video_model: nn.Module) -> None:
    model = video_model
    first, question = inputs(model, seed=36), inputs(model, seed=37)["input_ids"][:, -4:]
    with torch.no_grad(), ficoco.apply(model, "holitom", keep=KEEP_FRAME):
        turn1 = greedy(model, first, return_dict_in_generate=True)
        ids = torch.cat([turn1.sequences, question], dim=1)
        nxt = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        turn2 = greedy(model, nxt, return_dict_in_generate=True, **cache_argument(output_cache(turn1)))
        whole = greedy(model, {**nxt, "pixel_values_videos": first["pixel_values_videos"]},
                       return_dict_in_generate=True)
    assert torch.equal(turn2.sequences, whole.sequences)
    assert output_cache(turn2).get_seq_length() == output_cache(whole).get_seq_length()


def test_holitom_merges_pooled_frames_by_the_pooled_attention_each_patch_receives(video_model: nn.Module) -> None:
    """Independently: the last SigLIP layer's softmax (heads and queries averaged) and the projector's
    output, both pooled 2x2 bilinearly as the official code pools them, through the per-video reference
    of tests/helpers.py (holitom_reference); frames 0 and 1 are one picture, so the temporal merge acts."""
    from helpers import holitom_reference

    model = video_model
    inp = inputs(model, batch=1, seed=11)
    inp["pixel_values_videos"][:, 1] = inp["pixel_values_videos"][:, 0]
    tower, last = model.model.vision_tower, model.model.vision_tower.encoder.layers[-1]

    def pool(x: Tensor) -> Tensor:
        grid = x.view(FRAMES, SIDE, SIDE, -1).permute(0, 3, 1, 2)
        return torch.nn.functional.interpolate(grid, size=(2, 2), mode="bilinear").permute(0, 2, 3, 1).flatten(1, 2)

    with torch.no_grad():
        states = tower(inp["pixel_values_videos"].flatten(0, 1), output_hidden_states=True).hidden_states
        normed = last.layer_norm1(states[-2])
        heads = last.self_attn.num_heads
        q = last.self_attn.q_proj(normed).unflatten(-1, (heads, -1)).transpose(1, 2)
        k = last.self_attn.k_proj(normed).unflatten(-1, (heads, -1)).transpose(1, 2)
        received = ((q @ k.transpose(-1, -2)) * last.self_attn.scale).softmax(-1).mean(dim=1).mean(dim=1)
        scores = pool(received.unsqueeze(-1)).squeeze(-1)
        projected = pool(model.model.multi_modal_projector(states[-1]))
        tokens, units = holitom_reference(projected, scores, FRAMES * KEEP_FRAME)
        seen: list[Tensor] = []
        first = model.model.language_model.layers[0]
        hook = first.register_forward_pre_hook(lambda m, a, kw: seen.append(a[0] if a else kw["hidden_states"]),
                                               with_kwargs=True)
        try:
            with ficoco.apply(model, "holitom", keep=KEEP_FRAME):
                model(**inp)
        finally:
            hook.remove()
    assert len(units) == FRAMES * KEEP_FRAME
    span = seen[0][0, PREFIX_TOKENS:PREFIX_TOKENS + FRAMES * KEEP_FRAME]
    torch.testing.assert_close(span, tokens, atol=1e-4, rtol=1e-4)


# -- a real prompt through a local checkout's processor pieces -------------------------------------

def test_real_prompt_of_a_local_checkout_runs_vanilla_v_and_l(tmp_path: Any) -> None:
    """A 150 x 90 picture through the checkout's OneVision image processor and ChatML template (the
    whole processor needs torchvision, so ficoco counts the placeholders by the processor's rule):
    the count is the accountant's, the model accepts it, and FiCoCo-V and -L run on it."""
    import sys
    from pathlib import Path

    from PIL import Image

    from ficoco.models.prompt import encode_prompt

    sys.path.insert(0, str(Path(__file__).parent))
    from helpers import make_checkpoint

    folder = make_checkpoint("llava_onevision", tmp_path / "ov")
    picture = tmp_path / "wide.png"
    Image.new("RGB", (150, 90), (40, 90, 160)).save(picture)
    profile = load_profile(str(folder))
    prompt = encode_prompt(str(folder), profile.config, image=str(picture), prompt="What is shown?")
    assert prompt.text.startswith("<|im_start|>user\n<image>\nWhat is shown?<|im_end|>")
    assert prompt.image_size == (90, 150)
    set_layout(profile, image_size=prompt.image_size)
    arch = architecture(profile)
    assert arch.visual_tokens == prompt.visual_tokens == int((prompt.encoded["input_ids"] == IMAGE_TOKEN).sum())
    model = ficoco.build_model(str(folder), dtype="fp32", check_memory=False)
    encoded = {k: v for k, v in prompt.encoded.items()}
    reference = model(**encoded).logits
    assert reference.shape[1] == prompt.encoded["input_ids"].shape[1]
    # A checkout has no ficoco section: the family's first reducing layer (4) is past this decoder's.
    with ficoco.apply(model, "l", keep=arch.newline_tokens + 10, first_layer=1, image_size=prompt.image_size):
        assert model(**encoded).logits.shape[1] == prompt.text_tokens + arch.newline_tokens + 10
    # 150 x 90: 2 x 3 crops, unpadded to 8 x 12 (over anyres_max_4, resized to 6 x 9): V is refused.
    assert arch.post_projector_drops > 0
    with pytest.raises(FicocoError, match="unpadding drops 48 tokens"):
        ficoco.apply(model, "v", keep=arch.vision.items * 4 + arch.newline_tokens, first_layer=1,
                     image_size=prompt.image_size)
    square = tmp_path / "square.png"
    Image.new("RGB", (112, 112), (40, 90, 160)).save(square)
    prompt = encode_prompt(str(folder), profile.config, image=str(square))
    keep = v_keep(6)
    with ficoco.apply(model, "v", keep=keep, first_layer=1, image_size=prompt.image_size):
        assert model(**prompt.encoded).logits.shape[1] == prompt.text_tokens + keep
    # A video: a folder of 3 frames, every one pooled 2 x 2 after the projector, one newline after them.
    frames = tmp_path / "frames"
    frames.mkdir()
    for index in range(3):
        Image.new("RGB", (80, 60), (30 * index, 90, 160)).save(frames / f"{index}.png")
    profile = load_profile(str(folder))
    prompt = encode_prompt(str(folder), profile.config, video=str(frames), frames=3)
    assert prompt.media == "video" and prompt.frames == 3 and prompt.visual_tokens == 3 * 4 + 1
    assert "<video>" in prompt.text
    set_layout(profile, frames=prompt.frames)
    assert architecture(profile).visual_tokens == prompt.visual_tokens
    with ficoco.apply(model, "l", keep=7, first_layer=1, frames=3) as handle:
        assert model(**prompt.encoded).logits.shape[1] == prompt.text_tokens + 7
        assert bool((handle.records[-1].kept == prompt.visual_tokens - 1).any())  # the newline stays
