"""HoliTom (outer-LLM merging of a video's frames after the projector): the tensor module against a
small per-video re-implementation written from the paper and the official code's structure
(helpers.holitom_reference), and the method inside the tiny Video-LLaVA (4 frames of 16 patches +
[CLS], seeded random weights, fp32)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from helpers import holitom_reference, prefill_and_decode
from torch import Tensor, nn

import ficoco
from ficoco import accounting as acc
from ficoco.accounting import architecture
from ficoco.accounting.methods import extra_macs
from ficoco.accounting.schedule import plan_tokens
from ficoco.api import profile_of
from ficoco.methods.holitom.ops import holitom_reduce, inner_merge, segment_frames
from ficoco.methods.registry import method
from ficoco.models import synthetic_inputs
from ficoco.profiles import load_profile

TEXT = 12
FRAMES, PATCHES = 4, 16
KEEP = 3


def videos(count: int = 2, frames: int = 6, tokens: int = 12, width: int = 16, seed: int = 0) -> Tensor:
    """Videos with temporal redundancy: a few positions change little over runs of frames."""
    generator = torch.Generator().manual_seed(seed)
    out = torch.randn(count, frames, tokens, width, generator=generator)
    for v in range(count):
        still = torch.rand(tokens, generator=generator) < 0.6
        cut = 2 + v  # the scene changes after frame `cut`
        for f in range(1, frames):
            if f != cut:
                noise = 0.1 * torch.randn(tokens, width, generator=generator)
                out[v, f, still] = out[v, f - 1, still] + noise[still]
    return out


@pytest.mark.parametrize("budget,share", [(10, 0.0), (23, 0.0), (17, 0.5), (40, 0.3)])
def test_an_independent_per_video_reimplementation_picks_the_same_tokens(budget: int, share: float) -> None:
    features = videos()
    scores = torch.rand(features.shape[:3], generator=torch.Generator().manual_seed(1))
    out = holitom_reduce(features, scores, budget, contextual_share=share)
    assert out.hidden.shape == (2, budget, 16)
    for v in range(2):
        hidden, units = holitom_reference(features[v], scores[v], budget, share=share)
        assert out.origin[v].tolist() == units
        torch.testing.assert_close(out.hidden[v], hidden, atol=1e-5, rtol=1e-5)
    # The temporal merge found windows of several frames (the test data has them).
    assert bool((out.segment_start != torch.arange(6)).any())


def test_a_batch_equals_its_videos_alone_and_a_full_budget_is_the_identity() -> None:
    features = videos(count=3, seed=4)
    scores = torch.rand(features.shape[:3], generator=torch.Generator().manual_seed(5))
    together = holitom_reduce(features, scores, 20, contextual_share=0.4)
    for v in range(3):
        alone = holitom_reduce(features[v:v + 1], scores[v:v + 1], 20, contextual_share=0.4)
        assert torch.equal(alone.hidden[0], together.hidden[v]) and torch.equal(alone.origin[0], together.origin[v])
    whole = holitom_reduce(features, scores, 6 * 12)
    assert torch.equal(whole.hidden, features.flatten(1, 2)) and not whole.merged.any()


def test_the_segmentation_saves_the_most_tokens_and_keeps_a_frame_alone_on_a_tie() -> None:
    # Frames 0-2 alike at every position, frame 3 new, frame 4 like frame 3 at 2 of 4 positions.
    static_pairs = torch.tensor([[[True] * 4, [True] * 4, [False] * 4, [True, True, False, False]]])
    start, end, saved = segment_frames(static_pairs, max_window=8)
    assert start.tolist() == [[0, 0, 0, 3, 3]] and end.tolist() == [[2, 2, 2, 4, 4]]
    assert saved.tolist() == [2 * 4 + 1 * 2]
    start, _, saved = segment_frames(static_pairs, max_window=2)  # windows of at most 2 frames
    assert start.tolist() == [[0, 0, 2, 3, 3]] and saved.tolist() == [4 + 2]


def test_the_plan_counts_each_videos_work_once_and_maps_the_retain_ratio(arch_of) -> None:
    spec = method("holitom")
    settings = spec.settings_for_keep(None, 256, 23, spec.hyperparameters)
    assert settings["keep"] == 26  # ceil(10 % of 256) per frame on average
    arch = arch_of("video-llava-7b")
    schedule = acc.resolve_schedule(arch, "holitom", acc.CountOptions(), keep=26)
    plan = plan_tokens(arch, schedule, text_tokens=TEXT)
    assert plan.llm_visual_tokens == 8 * (26 + 1)
    rows = {term: macs for _, term, macs in extra_macs(arch, schedule, plan, batch=2)}
    width, visual = arch.decoder.hidden, 8 * 27
    assert [(r.stage, r.layer, r.remove) for r in schedule.removals] == [("vision", 22, 256 - 26), ("llm", 18, 108)]
    assert rows == {"holitom_frame_similarity": 2 * 7 * 256 * width,
                    "holitom_static_cluster_distances": 2 * 7 * 256 * 256 * width,
                    # inside the LLM: the last row of layer 17 over every key, then 108 merged x 108 kept cosines
                    "holitom_last_row_scores": 2 * width * (TEXT + visual),
                    "holitom_merge_similarity": 2 * 108 * 108 * width}


# ---- inside the tiny Video-LLaVA ----------------------------------------------------------------------------------

TINY_PROFILE = "video-llava-tiny"  # built as this module's `model` (conftest.py)


def test_keep_all_equals_vanilla(model: nn.Module) -> None:
    inp = synthetic_inputs(model, batch=1, text_tokens=TEXT)
    with torch.no_grad():
        vanilla = model(**inp).logits
        with ficoco.apply(model, "holitom", keep=PATCHES, merge_ratio=0.0) as handle:
            same = model(**inp).logits
    assert not handle.schedule.removals and torch.equal(same, vanilla)


def test_the_llm_sees_the_planned_tokens_and_a_batch_equals_its_videos_alone(model: nn.Module) -> None:
    inp = synthetic_inputs(model, batch=2, text_tokens=TEXT, seed=7)
    arch = architecture(profile_of(model))
    seen: list[int] = []
    with torch.no_grad(), ficoco.apply(model, "holitom", keep=KEEP) as handle:
        hooks = [layer.self_attn.register_forward_pre_hook(
            lambda m, a, k: seen.append(k["hidden_states"].shape[1]), with_kwargs=True)
            for layer in model.model.language_model.layers]
        try:
            together = model(**inp).logits[:, -1]
        finally:
            for hook in hooks:
                hook.remove()
        plan = plan_tokens(arch, handle.schedule, text_tokens=TEXT)
        # Outer: 4 frames x ([CLS] + 3); inner: half of them merged at the last layer (3, the tiny has 4).
        assert seen == [n for n, _ in plan.llm] == [TEXT + 16] * 3 + [TEXT + 8]
        assert plan.llm_visual_tokens == FRAMES * (KEEP + 1)
        assert handle.measured_tokens_per_item == KEEP
        for i in range(2):
            alone = model(**{k: v[i:i + 1] for k, v in inp.items()}).logits[:, -1]
            torch.testing.assert_close(together[i:i + 1], alone, atol=1e-4, rtol=0)


def test_a_left_padded_batch_equals_its_videos_alone(model: nn.Module) -> None:
    short = synthetic_inputs(model, batch=1, text_tokens=TEXT, seed=1)
    long = synthetic_inputs(model, batch=1, text_tokens=TEXT + 3, seed=2)
    zeros = torch.zeros(1, 3, dtype=torch.long)
    batch = {"input_ids": torch.cat([torch.cat([zeros, short["input_ids"]], 1), long["input_ids"]]),
             "attention_mask": torch.cat([torch.cat([zeros, short["attention_mask"]], 1), long["attention_mask"]]),
             "pixel_values_videos": torch.cat([short["pixel_values_videos"], long["pixel_values_videos"]])}
    with torch.no_grad(), ficoco.apply(model, "holitom", keep=KEEP):
        together = model(**batch).logits[:, -1]
        for i, sample in enumerate((short, long)):
            torch.testing.assert_close(together[i:i + 1], model(**sample).logits[:, -1], atol=1e-4, rtol=0)


def test_generate_matches_a_hand_written_prefill_and_decode_loop(model: nn.Module) -> None:
    inp = synthetic_inputs(model, batch=2, text_tokens=TEXT, seed=3)
    prompt = inp["input_ids"].shape[1]
    with torch.no_grad(), ficoco.apply(model, "holitom", keep=KEEP) as handle:
        generated = model.generate(**inp, max_new_tokens=4, min_new_tokens=4, do_sample=False)
        out, positions, decoded, cache = prefill_and_decode(model, inp, 4, handle)
    assert torch.equal(generated[:, :prompt], inp["input_ids"]) and torch.equal(generated[:, prompt:], decoded)
    shortened = prompt - FRAMES * (PATCHES - KEEP)
    merged = FRAMES * (KEEP + 1) // 2  # inside the LLM, at the tiny's last layer (its cache keeps the rest)
    assert out.logits.shape[1] == shortened - merged and cache.get_seq_length() == shortened + 3
    # Output positions name the caller's prompt: the last is its last token, the video's are placeholders.
    ids = torch.gather(inp["input_ids"], 1, positions)
    assert torch.equal(positions[:, -1], torch.full_like(positions[:, -1], prompt - 1))
    assert torch.equal((ids == model.config.video_token_id).sum(dim=1), torch.full((2,), FRAMES * (KEEP + 1) - merged))


def test_labels_give_the_loss_over_the_positions_that_remain(model: nn.Module) -> None:
    inp = synthetic_inputs(model, batch=2, text_tokens=TEXT, seed=4)
    labels = inp["input_ids"].masked_fill(inp["input_ids"] == model.config.video_token_id, -100)
    with torch.no_grad(), ficoco.apply(model, "holitom", keep=KEEP) as handle:
        out = model(**inp, labels=labels)
        kept_labels = torch.gather(labels, 1, handle.output_positions)
    vocab = model.config.text_config.vocab_size
    expected = model.loss_function(logits=out.logits, labels=kept_labels, vocab_size=vocab)
    assert torch.equal(out.loss, expected) and torch.isfinite(out.loss)


def test_the_inner_merge_equals_the_official_one_token_at_a_time_average() -> None:
    generator = torch.Generator().manual_seed(9)
    visual, scores = torch.randn(3, 20, 8, generator=generator), torch.rand(3, 20, generator=generator)
    merged, kept = inner_merge(visual, scores, 7)
    for b in range(3):
        top = sorted(sorted(range(20), key=lambda i: (-float(scores[b, i]), i))[:7])
        states = visual[b].double().clone()
        unit = torch.nn.functional.normalize(states, dim=-1)
        for j in (j for j in range(20) if j not in top):  # ascending, similarities of the layer's input
            target = top[max(range(7), key=lambda t: (float(unit[j] @ unit[top[t]]), -t))]
            states[target] = (states[target] + states[j]) / 2
        assert kept[b].tolist() == top
        torch.testing.assert_close(merged[b].double(), states[top], atol=1e-5, rtol=1e-5)


def test_flops_verify_counts_the_methods_work_as_fvcore_sees_it(model: nn.Module) -> None:
    """What `ficoco flops --model video-llava-tiny --variant holitom --verify` checks, in process."""
    from ficoco.profiling.verify import verify_run

    arch = architecture(profile_of(model))
    schedule = acc.resolve_schedule(arch, "holitom", acc.CountOptions(), keep=KEEP)
    run = verify_run(model, arch, schedule, text_tokens=TEXT, batch=2)
    stages = {s.stage: s for s in run.stages}
    assert stages["method"].analytic > 0 and run.passed(0.5)


def test_the_llm_receives_the_reference_tokens_of_an_independent_attention_and_projector(model: nn.Module) -> None:
    """The scores from the tower layer the projector reads, recomputed here from its q and k (every
    query's softmax, heads and queries averaged), and the vanilla projector output, through the
    per-video reference: the tokens the LLM's first layer receives in the video span."""
    inp = synthetic_inputs(model, batch=1, text_tokens=TEXT, seed=11)
    tower, layer = model.model.video_tower, model.model.video_tower.encoder.layers[4]
    with torch.no_grad():
        states = tower(inp["pixel_values_videos"].flatten(0, 1), output_hidden_states=True).hidden_states
        normed = layer.layer_norm1(states[4])
        heads = layer.self_attn.num_heads
        q = layer.self_attn.q_proj(normed).unflatten(-1, (heads, -1)).transpose(1, 2)
        k = layer.self_attn.k_proj(normed).unflatten(-1, (heads, -1)).transpose(1, 2)
        probabilities = ((q @ k.transpose(-1, -2)) * layer.self_attn.scale).softmax(-1).mean(dim=1)
        scores = probabilities.mean(dim=1)[:, 1:].reshape(FRAMES, PATCHES)
        projected = model.model.multi_modal_projector(states[5])[:, 1:]
        tokens, _ = holitom_reference(projected, scores, FRAMES * KEEP)
        seen: list[Tensor] = []
        first = model.model.language_model.layers[0]
        hook = first.register_forward_pre_hook(lambda m, a, kw: seen.append(a[0] if a else kw["hidden_states"]),
                                            with_kwargs=True)
        try:
            with ficoco.apply(model, "holitom", keep=KEEP):
                model(**inp)
        finally:
            hook.remove()
    span = seen[0][0, 5:5 + FRAMES * (KEEP + 1)].reshape(FRAMES, KEEP + 1, -1)
    torch.testing.assert_close(span[:, 1:].flatten(0, 1), tokens, atol=1e-4, rtol=1e-4)


# ---- inside the tiny Qwen2-VL, on a video: its temporal slices are HoliTom's frames -------------------------------

Q_FRAMES, Q_SLICES, Q_GROUPS, Q_KEEP = 6, 3, 16, 4  # 6 frames of 8 x 8 patches: 3 slices of 16 merge groups


@pytest.fixture(scope="module")
def qwen_video() -> nn.Module:
    from ficoco.profiles import set_layout

    profile = load_profile("qwen2-vl-tiny")
    set_layout(profile, frames=Q_FRAMES)
    return ficoco.build_model(profile, dtype="fp32")


def qwen_inputs(model: nn.Module, batch: int, seed: int) -> dict[str, Tensor]:
    """Synthetic video prompts whose first two slices are one picture (the temporal merge acts)."""
    inp = synthetic_inputs(model, batch=batch, text_tokens=TEXT, seed=seed)
    pixels = inp["pixel_values_videos"].view(batch, Q_SLICES, -1, inp["pixel_values_videos"].shape[-1]).clone()
    pixels[:, 1] = pixels[:, 0]
    inp["pixel_values_videos"] = pixels.flatten(0, 2)
    return inp


def qwen_sample(inp: dict[str, Tensor], i: int) -> dict[str, Tensor]:
    """Prompt `i` of a batch alone (its video's rows of the flattened patches)."""
    rows = inp["pixel_values_videos"].shape[0] // inp["input_ids"].shape[0]
    alone = {k: v[i:i + 1] for k, v in inp.items() if k != "pixel_values_videos"}
    return {**alone, "pixel_values_videos": inp["pixel_values_videos"][i * rows:(i + 1) * rows]}


def test_qwen2_vl_video_keep_all_equals_vanilla_and_an_image_layout_is_refused(qwen_video: nn.Module, arch_of) -> None:
    inp = qwen_inputs(qwen_video, batch=1, seed=0)
    assert inp["video_grid_thw"].tolist() == [[Q_SLICES, 8, 8]]
    with torch.no_grad():
        vanilla = qwen_video(**inp).logits
        with ficoco.apply(qwen_video, "holitom", keep=Q_GROUPS, merge_ratio=0.0) as handle:
            same = qwen_video(**inp).logits
    assert not handle.schedule.removals and torch.equal(same, vanilla)
    picture = synthetic_inputs(qwen_video, batch=1, text_tokens=TEXT, image_size=(112, 112))
    with ficoco.apply(qwen_video, "holitom", keep=Q_KEEP), \
            pytest.raises(ficoco.FicocoError, match="HoliTom on Qwen2-VL acts on a video's frames; an image"):
        qwen_video(**picture)
    image = arch_of("qwen2-vl-tiny")
    with pytest.raises(ficoco.FicocoError, match="HoliTom on qwen2-vl-tiny: a video method.*frames="):
        acc.resolve_schedule(image, "holitom", acc.CountOptions(), keep=Q_KEEP)


def test_qwen2_vl_video_runs_the_plan_at_the_unreduced_positions_batched_as_videos_alone(
        qwen_video: nn.Module) -> None:
    from ficoco.models import hf_compat as hf

    model = qwen_video
    inp = qwen_inputs(model, batch=2, seed=7)
    arch = architecture(profile_of(model))
    seen: list[int] = []
    given: list[Tensor] = []
    language_model = model.model.language_model
    hooks = [layer.self_attn.register_forward_pre_hook(
        lambda m, a, k: seen.append(k["hidden_states"].shape[1]), with_kwargs=True) for layer in language_model.layers]
    hooks.append(language_model.register_forward_pre_hook(lambda m, a, k: given.append(k["position_ids"]),
                                                          with_kwargs=True))
    try:
        with torch.no_grad(), ficoco.apply(model, "holitom", keep=Q_KEEP) as handle:
            together = model(**inp).logits[:, -1]
            kept_in_prompt = handle.prompt_map[0]
            plan = plan_tokens(arch, handle.schedule, text_tokens=TEXT)
            # Outer: 3 slices x 4; inner: half of the 12 merged at the tiny's last layer (HOLITOM_k 18).
            assert seen == [n for n, _ in plan.llm] == [TEXT + 12] * 3 + [TEXT + 6]
            assert plan.llm_visual_tokens == Q_SLICES * Q_KEEP
            for i in range(2):
                alone = model(**qwen_sample(inp, i)).logits[:, -1]
                torch.testing.assert_close(together[i:i + 1], alone, atol=1e-4, rtol=0)
    finally:
        for hook in hooks:
            hook.remove()
    # Every kept token sits at the 3-D position the unreduced prompt gives it (transformers' rope index).
    unreduced, _ = hf.rope_index(model, inp["input_ids"], inp["mm_token_type_ids"], None, inp["attention_mask"],
                                 video_grid_thw=inp["video_grid_thw"])
    expected = torch.gather(unreduced, 2, kept_in_prompt.unsqueeze(0).expand(3, -1, -1))
    assert torch.equal(given[0], expected)
    # The temporal merge acted: slices 0 and 1 are one picture, so slice 1 hands on none of its own tokens.
    video = kept_in_prompt[0][torch.gather(inp["input_ids"][0], 0, kept_in_prompt[0]) == model.config.video_token_id]
    slices = (video - int((inp["input_ids"][0] == model.config.video_token_id).nonzero()[0])) // Q_GROUPS
    assert 1 not in slices.tolist() and len(video) == Q_SLICES * Q_KEEP


def test_qwen2_vl_video_generate_equals_each_video_alone_and_continues_where_the_unreduced_model_would(
        qwen_video: nn.Module) -> None:
    """generate of a batch equals each video alone, its first token is the reduced prefill's, and the
    rope_deltas it decodes with put the next token where the unreduced prompt's would be. (A hand-written
    decode loop with a grown attention mask and no position ids fails on vanilla Qwen2-VL in transformers
    5.24 itself: its 3-D positions from the mask are not cut to the new token.)"""
    from ficoco.models import hf_compat as hf

    model = qwen_video
    inp = qwen_inputs(model, batch=2, seed=3)
    prompt, new = inp["input_ids"].shape[1], 3
    with torch.no_grad():
        model(**inp)
        unreduced_deltas = hf.rope_deltas(model).clone()
        with ficoco.apply(model, "holitom", keep=Q_KEEP):
            prefill = model(**inp).logits[:, -1].argmax(-1)
            deltas = hf.rope_deltas(model).clone()
            together = model.generate(**inp, max_new_tokens=new, min_new_tokens=new, do_sample=False)
            singles = [model.generate(**qwen_sample(inp, i), max_new_tokens=new, min_new_tokens=new,
                                      do_sample=False) for i in range(2)]
    removed = Q_SLICES * (Q_GROUPS - Q_KEEP)
    assert torch.equal(together[:, :prompt], inp["input_ids"]) and torch.equal(together[:, prompt], prefill)
    assert all(torch.equal(together[i:i + 1], singles[i]) for i in range(2))
    # The next token's position: the shortened prompt's length + deltas = the unreduced prompt's + its deltas.
    assert torch.equal(deltas, unreduced_deltas + removed)


def test_qwen2_vl_video_flops_verify_counts_the_methods_work_as_fvcore_sees_it(qwen_video: nn.Module) -> None:
    """What `ficoco flops --model qwen2-vl-tiny --frames 6 --variant holitom --verify` checks, in process."""
    from ficoco.profiling.verify import verify_run

    arch = architecture(profile_of(qwen_video))
    assert arch.vision.items == Q_SLICES and arch.visual_tokens == Q_SLICES * Q_GROUPS
    schedule = acc.resolve_schedule(arch, "holitom", acc.CountOptions(), keep=Q_KEEP)
    run = verify_run(qwen_video, arch, schedule, text_tokens=TEXT, batch=2)
    stages = {s.stage: s for s in run.stages}
    assert stages["method"].analytic > 0 and run.passed(0.5)


def llm_video_tokens_against_reference(model: nn.Module, inp: dict[str, Tensor], slices: int, groups: int,
                                       keep: int, window_order: Tensor | None) -> None:
    """The last vision block's attention recomputed here from its q and k (rotary applied, every segment
    the block ran its own softmax: a slice, or a window of it; the received attention summed over the
    segment's queries and divided by the slice's patches, heads averaged, a merge group's 4 patches
    averaged, put in grid order by `window_order` (the video unit of every row; None: the rows are in
    grid order)) and the vanilla merger output, through the per-video reference: the tokens the LLM
    receives in the video span, each at its unit's place in the unreduced span."""
    import importlib

    rotary = importlib.import_module(type(model).__module__).apply_rotary_pos_emb_vision
    visual, block = model.model.visual, model.model.visual.blocks[-1]
    captured: dict[str, Any] = {}
    hook = block.register_forward_pre_hook(lambda m, a, k: captured.update(x=a[0] if a else k["hidden_states"], **k),
                                           with_kwargs=True)
    with torch.no_grad():
        try:
            features = visual(inp["pixel_values_videos"], grid_thw=inp["video_grid_thw"]).pooler_output
        finally:
            hook.remove()
        x, (cos, sin), bounds = captured["x"], captured["position_embeddings"], captured["cu_seqlens"].tolist()
        heads = block.attn.num_heads
        q, k, _ = block.attn.qkv(block.norm1(x)).reshape(x.shape[0], 3, heads, -1).permute(1, 0, 2, 3).unbind(0)
        q, k = rotary(q, k, cos, sin)
        received = torch.cat([((q[a:b].transpose(0, 1) @ k[a:b].transpose(0, 1).transpose(-1, -2))
                               * block.attn.scaling).softmax(-1).mean(dim=0).sum(dim=0)
                              for a, b in zip(bounds[:-1], bounds[1:], strict=True)])
        rows = (received.view(slices, -1) / (received.numel() // slices)).view(slices, groups, 4).mean(-1).flatten()
        scores = rows if window_order is None else torch.empty_like(rows).index_copy(0, window_order, rows)
        tokens, units = holitom_reference(features.view(slices, groups, -1), scores.view(slices, groups), slices * keep)
        seen: list[Tensor] = []
        language = model.model.language_model
        hook = language.register_forward_pre_hook(lambda m, a, kw: seen.append(kw["inputs_embeds"]),
                                                  with_kwargs=True)
        try:
            with ficoco.apply(model, "holitom", keep=keep, merge_ratio=0.0) as handle:
                model(**inp)
                kept_in_prompt = handle.prompt_map[0][0]
        finally:
            hook.remove()
    is_video = inp["input_ids"][0, kept_in_prompt] == model.config.video_token_id
    torch.testing.assert_close(seen[0][0, is_video], tokens, atol=1e-4, rtol=1e-4)
    span_start = int((inp["input_ids"][0] == model.config.video_token_id).nonzero()[0])
    assert (kept_in_prompt[is_video] - span_start).tolist() == units


def test_qwen2_vl_video_llm_receives_the_reference_tokens_of_an_independent_attention_and_merger(
        qwen_video: nn.Module) -> None:
    llm_video_tokens_against_reference(qwen_video, qwen_inputs(qwen_video, batch=1, seed=11), Q_SLICES, Q_GROUPS,
                                       Q_KEEP, None)


def test_qwen2_vl_video_left_padded_batch_equals_its_videos_alone_and_labels_give_the_remaining_loss(
        qwen_video: nn.Module) -> None:
    model = qwen_video
    short = synthetic_inputs(model, batch=1, text_tokens=TEXT, seed=1)
    long = synthetic_inputs(model, batch=1, text_tokens=TEXT + 3, seed=2)
    zeros = torch.zeros(1, 3, dtype=torch.long)
    batch = {key: torch.cat([torch.cat([zeros.to(short[key].dtype), short[key]], 1), long[key]])
             for key in ("input_ids", "attention_mask", "mm_token_type_ids")}
    batch.update({key: torch.cat([short[key], long[key]]) for key in ("pixel_values_videos", "video_grid_thw")})
    inp = qwen_inputs(model, batch=2, seed=4)
    labels = inp["input_ids"].masked_fill(inp["input_ids"] == model.config.video_token_id, -100)
    with torch.no_grad(), ficoco.apply(model, "holitom", keep=Q_KEEP) as handle:
        together = model(**batch).logits[:, -1]
        for i, sample in enumerate((short, long)):
            torch.testing.assert_close(together[i:i + 1], model(**sample).logits[:, -1], atol=1e-4, rtol=0)
        out = model(**inp, labels=labels)
        kept_labels = torch.gather(labels, 1, handle.output_positions)
    assert out.logits.shape[1] == inp["input_ids"].shape[1] - Q_SLICES * (Q_GROUPS - Q_KEEP) - Q_SLICES * Q_KEEP // 2
    vocab = model.config.text_config.vocab_size
    expected = model.loss_function(logits=out.logits, labels=kept_labels, vocab_size=vocab)
    assert torch.equal(out.loss, expected) and torch.isfinite(out.loss)


# ---- the tiny Qwen2.5-VL (windowed tower: its last block attends within windows), on a video ----------------------

W_SLICES, W_GROUPS, W_KEEP = 3, 20, 4  # 6 frames of 10 x 8 patches (its 140 x 112 image size): 3 slices of 20 groups


@pytest.fixture(scope="module")
def qwen25_video() -> nn.Module:
    from ficoco.profiles import set_layout

    profile = load_profile("qwen2.5-vl-tiny")
    set_layout(profile, frames=Q_FRAMES)
    return ficoco.build_model(profile, dtype="fp32")


def test_qwen2_5_vl_video_keep_all_is_vanilla_the_plan_runs_at_the_unreduced_positions_as_videos_alone(
        qwen25_video: nn.Module) -> None:
    from ficoco.models import hf_compat as hf

    model = qwen25_video
    inp = synthetic_inputs(model, batch=2, text_tokens=TEXT, seed=5)
    inp["second_per_grid_ts"] = torch.tensor([1.0, 2.5])  # temporal positions scaled per video, as the processor's
    assert inp["video_grid_thw"].tolist() == [[W_SLICES, 10, 8]] * 2
    arch = architecture(profile_of(model))
    given: list[Tensor] = []
    language = model.model.language_model
    hook = language.register_forward_pre_hook(lambda m, a, k: given.append(k["position_ids"]), with_kwargs=True)
    try:
        with torch.no_grad():
            vanilla = model(**inp).logits
            with ficoco.apply(model, "holitom", keep=W_GROUPS, merge_ratio=0.0):
                assert torch.equal(model(**inp).logits, vanilla)
            given.clear()
            with ficoco.apply(model, "holitom", keep=W_KEEP) as handle:
                together = model(**inp).logits
                kept_in_prompt = handle.prompt_map[0]
                plan = plan_tokens(arch, handle.schedule, text_tokens=TEXT)
                for i in range(2):
                    torch.testing.assert_close(together[i:i + 1, -1], model(**qwen_sample(inp, i)).logits[:, -1],
                                               atol=1e-4, rtol=0)
    finally:
        hook.remove()
    assert plan.llm_visual_tokens == W_SLICES * W_KEEP and together.shape[1] == TEXT + W_SLICES * W_KEEP // 2
    unreduced, _ = hf.rope_index(model, inp["input_ids"], inp["mm_token_type_ids"], None, inp["attention_mask"],
                                 video_grid_thw=inp["video_grid_thw"], second_per_grid_ts=inp["second_per_grid_ts"])
    assert torch.equal(given[0], torch.gather(unreduced, 2, kept_in_prompt.unsqueeze(0).expand(3, -1, -1)))


def test_qwen2_5_vl_video_generate_equals_each_video_alone_and_verify_passes(qwen25_video: nn.Module) -> None:
    from ficoco.models import hf_compat as hf
    from ficoco.profiling.verify import verify_run

    model = qwen25_video
    inp = synthetic_inputs(model, batch=2, text_tokens=TEXT, seed=6)
    prompt = inp["input_ids"].shape[1]
    with torch.no_grad():
        model(**inp)
        unreduced_deltas = hf.rope_deltas(model).clone()
        with ficoco.apply(model, "holitom", keep=W_KEEP):
            prefill = model(**inp).logits[:, -1].argmax(-1)
            deltas = hf.rope_deltas(model).clone()
            together = model.generate(**inp, max_new_tokens=3, min_new_tokens=3, do_sample=False)
            singles = [model.generate(**qwen_sample(inp, i), max_new_tokens=3, min_new_tokens=3, do_sample=False)
                       for i in range(2)]
    assert torch.equal(together[:, :prompt], inp["input_ids"]) and torch.equal(together[:, prompt], prefill)
    assert all(torch.equal(together[i:i + 1], singles[i]) for i in range(2))
    assert torch.equal(deltas, unreduced_deltas + W_SLICES * (W_GROUPS - W_KEEP))
    arch = architecture(profile_of(model))
    schedule = acc.resolve_schedule(arch, "holitom", acc.CountOptions(), keep=W_KEEP)
    run = verify_run(model, arch, schedule, text_tokens=TEXT, batch=2)
    assert {s.stage: s for s in run.stages}["method"].analytic > 0 and run.passed(0.5)


def test_qwen2_5_vl_video_llm_receives_the_reference_tokens_of_its_windowed_attention(qwen25_video: nn.Module) -> None:
    from ficoco.models import hf_compat as hf

    model = qwen25_video
    inp = synthetic_inputs(model, batch=1, text_tokens=TEXT, seed=12)
    pixels = inp["pixel_values_videos"].view(W_SLICES, -1, inp["pixel_values_videos"].shape[-1]).clone()
    pixels[1] = pixels[0]  # one picture over the first two slices: the temporal merge acts
    inp["pixel_values_videos"] = pixels.flatten(0, 1)
    order = hf.qwen2_5_vl_window_index(model.model.visual, inp["video_grid_thw"])[0]
    assert not torch.equal(order, torch.arange(order.numel()))  # the windows reorder the groups
    llm_video_tokens_against_reference(model, inp, W_SLICES, W_GROUPS, W_KEEP, order)
