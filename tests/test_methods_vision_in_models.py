"""ToMe, VisionZip, FasterVLM and PruMerge+ inside the models (issue 15, phase 2): the tower and
projector hook points, the shortened prompt, decoding, labels and flops --verify, on seeded random
tiny models in fp32 on the CPU.

llava-tiny: a 6-layer CLIP tower whose projector reads layer 4 (64 patches per image, [CLS] first),
a 4-layer LLaMA decoder, 12 text tokens per prompt.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from helpers import assert_batch_equals_samples_alone, forward_with_hooks, prefill_and_decode
from torch import Tensor, nn

import ficoco
from ficoco.accounting import architecture
from ficoco.accounting.schedule import plan_tokens
from ficoco.api import profile_of
from ficoco.errors import FicocoError
from ficoco.models import synthetic_inputs
from ficoco.models.hf_compat import cache_argument, output_cache

TEXT = 12
PATCHES = 64
FEATURE_LAYER = 4
NEW = 5
KEEP = 16
METHODS = ("tome", "visionzip", "fastervlm", "prumerge")


TINY_PROFILE = "llava-tiny"  # built as this module's `model` (conftest.py)


def inputs(model: nn.Module, batch: int = 1, seed: int = 0, text: int = TEXT) -> dict[str, Tensor]:
    return synthetic_inputs(model, batch=batch, text_tokens=text, seed=seed)


def greedy(model: nn.Module, inp: dict[str, Tensor], new: int = NEW) -> Tensor:
    return model.generate(**inp, max_new_tokens=new, do_sample=False, min_new_tokens=new)


def entering(model: nn.Module, inp: dict[str, Tensor]) -> tuple[list[int], list[int]]:
    """Tokens every tower layer's and every decoder layer's attention ran on in one forward."""
    seen: dict[str, list[int]] = {"vision": [], "llm": []}
    hooks = []
    towers = (("vision", model.model.vision_tower.encoder.layers), ("llm", model.model.language_model.layers))
    for stage, layers in towers:
        for layer in layers:
            hooks.append(layer.self_attn.register_forward_pre_hook(
                lambda m, args, kwargs, stage=stage: seen[stage].append(
                    (args[0] if args else kwargs["hidden_states"]).shape[1]), with_kwargs=True))
    forward_with_hooks(model, inp, hooks)
    return seen["vision"], seen["llm"]


@pytest.mark.parametrize("method,setting", [
    ("tome", {"keep": PATCHES}),  # every layer's r is 0
    # VisionZip's identity: [CLS] left out of the dominant tokens (ficoco's correction), every patch kept; with the
    # official [CLS] among them a patch makes room for it (test_visionzip_at_the_edge_...).
    ("visionzip", {"dominant": PATCHES, "contextual": 0, "include_cls": False}),
    ("visionzip", {"keep": PATCHES, "include_cls": False}),  # 54 + 10: every remaining patch a target
    ("fastervlm", {"keep": PATCHES}),
    ("tome", {"schedule": ""}),
])
def test_full_keep_is_bitwise_vanilla_where_the_method_has_an_identity(model: nn.Module, method: str,
                                                                      setting: dict) -> None:
    inp = inputs(model, batch=2)
    labels = inp["input_ids"].masked_fill(inp["input_ids"] == 300, -100)
    with torch.no_grad():
        reference = model(**inp, labels=labels)
        reference_tokens = greedy(model, inp)
        with ficoco.apply(model, method, **setting) as handle:
            out = model(**inp, labels=labels)
            tokens = greedy(model, inp)
    assert not any(r.remove for r in handle.schedule.removals)
    assert torch.equal(out.logits, reference.logits) and torch.equal(out.loss, reference.loss)
    assert torch.equal(tokens, reference_tokens)


def test_a_setting_that_would_lengthen_the_prompt_is_refused_in_one_line(model: nn.Module) -> None:
    # PruMerge+ at every patch plus its extra token: 65 tokens for a 64-placeholder span.
    with pytest.raises(FicocoError, match="more than the 64 placeholders"):
        ficoco.apply(model, "prumerge", keep=PATCHES + 1)
    assert "_ficoco_handle" not in model.__dict__ and "forward" not in model.__dict__


@pytest.mark.parametrize("method", METHODS)
def test_tokens_of_every_tower_and_decoder_layer_equal_the_plan(model: nn.Module, method: str) -> None:
    inp = inputs(model, batch=2)
    with ficoco.apply(model, method, keep=KEEP) as handle:
        vision, llm = entering(model, inp)
        plan = plan_tokens(architecture(profile_of(model)), handle.schedule, text_tokens=TEXT)
        records = handle.records
    assert handle.schedule.removals
    assert vision == [n_in for n_in, _ in plan.vision]
    assert llm == [n_in for n_in, _ in plan.llm] and llm[0] == TEXT + KEEP
    assert handle.measured_tokens_per_item == plan.llm_visual_tokens == KEEP
    reductions = [r for r in plan.reductions if r.stage == "vision"]
    assert [r.layer for r in records] == [r.layer for r in reductions]
    for record in records:
        assert record.kept.shape[0] == 2 and record.kept.max() < PATCHES
        for kept, gone in zip(record.kept, record.discarded, strict=True):
            assert not set(kept[kept >= 0].tolist()) & set(gone[gone >= 0].tolist())


def left_padded(model: nn.Module) -> tuple[dict[str, Tensor], list[dict[str, Tensor]]]:
    """Two prompts of different lengths (so different image spans) in one left-padded batch."""
    short, long = inputs(model, seed=1, text=TEXT), inputs(model, seed=2, text=TEXT + 3)
    pad = long["input_ids"].shape[1] - short["input_ids"].shape[1]
    zeros = torch.zeros(1, pad, dtype=torch.long)
    batch = {"input_ids": torch.cat([torch.cat([zeros, short["input_ids"]], 1), long["input_ids"]]),
             "attention_mask": torch.cat([torch.cat([zeros, short["attention_mask"]], 1), long["attention_mask"]]),
             "pixel_values": torch.cat([short["pixel_values"], long["pixel_values"]])}
    return batch, [short, long]


@pytest.mark.parametrize("method", METHODS)
def test_a_left_padded_batch_equals_its_samples_run_alone(model: nn.Module, method: str) -> None:
    batch, alone = left_padded(model)
    with torch.no_grad(), ficoco.apply(model, method, keep=KEEP) as handle:
        assert_batch_equals_samples_alone(model, handle, batch, alone)


@pytest.mark.parametrize("method", [*METHODS, "prumerge-adaptive"])
def test_generate_matches_a_hand_written_prefill_and_decode_loop(model: nn.Module, method: str) -> None:
    adaptive = method == "prumerge-adaptive"
    inp = inputs(model, batch=1 if adaptive else 2, seed=3)
    prompt = inp["input_ids"].shape[1]
    setting = {} if adaptive else {"keep": KEEP}
    with torch.no_grad(), ficoco.apply(model, method.removesuffix("-adaptive"), **setting) as handle:
        generated = greedy(model, inp)
        # The mask grows from the caller's prompt, as a hand-written loop grows it.
        out, positions, decoded, cache = prefill_and_decode(model, inp, NEW, handle)
        keep = handle.measured_tokens_per_item
    assert torch.equal(generated[:, :prompt], inp["input_ids"])  # the caller's own prompt comes back
    assert torch.equal(generated[:, prompt:], decoded)
    assert (keep == KEEP) if not adaptive else 2 <= keep <= PATCHES + 1
    # The LLM ran the prompt with `keep` placeholders per image; output positions name input positions.
    assert cache.get_seq_length() == prompt - PATCHES + keep + NEW - 1
    assert positions.shape == out.logits.shape[:2] == (inp["input_ids"].shape[0], prompt - PATCHES + keep)
    ids = torch.gather(inp["input_ids"], 1, positions)
    assert int((ids == 300).sum(dim=1)[0]) == keep and torch.equal(positions[:, -1], torch.full_like(positions[:, -1],
                                                                                                    prompt - 1))


@pytest.mark.parametrize("method", METHODS)
def test_labels_give_the_models_loss_over_the_positions_that_remain(model: nn.Module, method: str) -> None:
    inp = inputs(model, batch=2, seed=4)
    labels = inp["input_ids"].masked_fill(inp["input_ids"] == 300, -100)
    with torch.no_grad(), ficoco.apply(model, method, keep=KEEP) as handle:
        out = model(**inp, labels=labels)
        kept_labels = torch.gather(labels, 1, handle.output_positions)
    vocab = model.config.text_config.vocab_size
    expected = model.loss_function(logits=out.logits, labels=kept_labels, vocab_size=vocab)
    assert torch.equal(out.loss, expected) and torch.isfinite(out.loss)


def _cls_rows(model: nn.Module, inp: dict[str, Tensor], layer: int) -> Tensor:
    """(B, H, T) the [CLS] query's softmax over tower layer `layer`'s keys, by hand from its q_proj and
    k_proj outputs on the unpatched model (docs/methods/visionzip.md: one CLS row at the layer the projector reads)."""
    attn = model.model.vision_tower.encoder.layers[layer].self_attn
    seen: dict[str, Tensor] = {}
    hooks = [attn.q_proj.register_forward_hook(lambda m, a, o: seen.__setitem__("q", o)),
             attn.k_proj.register_forward_hook(lambda m, a, o: seen.__setitem__("k", o))]
    forward_with_hooks(model, inp, hooks)
    heads = attn.num_heads
    batch, tokens, width = seen["k"].shape
    d = width // heads
    q = seen["q"][:, 0].reshape(batch, heads, d)
    k = seen["k"].reshape(batch, tokens, heads, d)
    rows = torch.zeros(batch, heads, tokens, dtype=torch.float64)
    for b in range(batch):
        for h in range(heads):
            logits = [float(q[b, h].double() @ k[b, t, h].double()) / math.sqrt(d) for t in range(tokens)]
            top = max(logits)
            exps = [math.exp(x - top) for x in logits]
            rows[b, h] = torch.tensor([e / sum(exps) for e in exps], dtype=torch.float64)
    return rows


@pytest.mark.parametrize("method,reduce_heads,kept_patches,settings", [
    ("fastervlm", "mean", KEEP, {}),
    ("visionzip", "sum", 13, {}),  # the official 14 dominant ([CLS] and 13 patches) + 2 contextual
    ("visionzip", "sum", 14, {"include_cls": False}),  # ficoco's correction: 14 dominant patches + 2 contextual
])
def test_an_independent_cls_row_picks_the_same_patches_as_the_model(model: nn.Module, method: str, reduce_heads: str,
                                                                   kept_patches: int, settings: dict) -> None:
    inp = inputs(model, batch=2, seed=5)
    rows = _cls_rows(model, inp, FEATURE_LAYER)[:, :, 1:]
    scores = rows.sum(1) if reduce_heads == "sum" else rows.mean(1)
    with torch.no_grad(), ficoco.apply(model, method, keep=KEEP, **settings) as handle:
        model(**inp)
        (record,) = handle.records
    for b in range(2):
        ranked = sorted(range(PATCHES), key=lambda i: (-float(scores[b, i]), i))
        assert record.kept[b][record.kept[b] >= 0].tolist() == sorted(ranked[:kept_patches])


@pytest.mark.parametrize("settings", [{}, {"include_cls": False}])
def test_visionzip_hands_the_llm_the_feature_layers_cls_first_as_the_official_code(model: nn.Module,
                                                                                   settings: dict) -> None:
    # Official VisionZip keeps [CLS] of the layer the projector reads among its dominant tokens (LLaVA's feature
    # selection drops it); ficoco's correction (include_cls=False) hands on patches only.
    inp = inputs(model, batch=2, seed=6)
    layer = model.model.vision_tower.encoder.layers[FEATURE_LAYER]
    seen: dict[str, Tensor] = {}
    with torch.no_grad():
        forward_with_hooks(model, inp, [layer.register_forward_hook(lambda m, a, o: seen.__setitem__("cls", o[:, 0]))])
        projector = model.model.multi_modal_projector
        with ficoco.apply(model, "visionzip", keep=KEEP, **settings) as handle:
            hook = projector.linear_1.register_forward_pre_hook(lambda m, args: seen.__setitem__("features", args[0]))
            try:
                model(**inp)
            finally:
                hook.remove()
    features = seen["features"]
    assert features.shape[:2] == (2, KEEP) and handle.measured_tokens_per_item == KEEP
    assert torch.equal(features[:, 0], seen["cls"]) == (settings == {})
    assert ((handle.records[0].kept[:, 0] == -1).all()) == (settings == {})


def test_visionzip_at_the_edge_merges_the_patch_cls_displaces_as_the_official_code(model: nn.Module) -> None:
    """keep=64 (54 dominant + 10 contextual = the 64 patches): the official code keeps [CLS] and 53 patches, so 11
    patches remain for 10 contextual tokens and one of them merges (target + mean of its members). The projector
    receives exactly `visionzip_reduce` of the layer's output, [CLS] first; the planned schedule has the cut and its
    count, 64 tokens per image, as the run measures."""
    from ficoco.methods.visionzip.ops import visionzip_reduce

    inp = inputs(model, batch=2, seed=6)
    layer = model.model.vision_tower.encoder.layers[FEATURE_LAYER]
    seen: dict[str, Tensor] = {}
    forward_with_hooks(model, inp, [
        layer.register_forward_hook(lambda m, a, o: seen.__setitem__("out", o)),
        layer.self_attn.k_proj.register_forward_hook(lambda m, a, o: seen.__setitem__("k", o))])
    batch, tokens, width = seen["k"].shape
    keys = seen["k"].reshape(batch, tokens, layer.self_attn.num_heads, -1).mean(dim=2)
    scores = _cls_rows(model, inp, FEATURE_LAYER)[:, :, 1:].sum(1).to(seen["out"].dtype)
    expected = visionzip_reduce(seen["out"], scores, keys, 54, 10, has_cls=True, include_cls=True)
    with torch.no_grad(), ficoco.apply(model, "visionzip", keep=PATCHES) as handle:
        projector = model.model.multi_modal_projector
        hook = projector.linear_1.register_forward_pre_hook(lambda m, args: seen.__setitem__("features", args[0]))
        try:
            model(**inp)
        finally:
            hook.remove()
    assert [(r.where, r.remove, r.added) for r in handle.schedule.removals] == [("tower_output", 10, 10)]
    assert handle.measured_tokens_per_item == PATCHES
    (record,) = handle.records
    assert ((record.kept >= 0).sum(dim=1) == 53).all() and (record.kept[:, 0] == -1).all()
    features = seen["features"]
    assert features.shape[:2] == (2, PATCHES) and torch.equal(features[:, 0], seen["out"][:, 0])
    torch.testing.assert_close(features, expected.hidden, rtol=1e-5, atol=1e-5)
    # Ten targets, one of which took the eleventh remaining patch: nine contextual tokens are their targets alone.
    targets = torch.gather(seen["out"][:, 1:], 1, expected.target_index.unsqueeze(-1).expand(-1, -1, width))
    alone = (features[:, 54:] - targets).abs().amax(dim=-1) < 1e-6
    assert alone.sum(dim=1).tolist() == [9, 9]


def _adaptive_counts(model: nn.Module, seed: int) -> int:
    with torch.no_grad(), ficoco.apply(model, "prumerge") as handle:
        model(**inputs(model, seed=seed))
        return handle.measured_tokens_per_item


def test_prumerge_adaptive_count_is_measured_and_a_batch_that_disagrees_is_refused(model: nn.Module) -> None:
    counts = {seed: _adaptive_counts(model, seed) for seed in range(8)}
    with torch.no_grad(), ficoco.apply(model, "prumerge") as handle:
        inp = inputs(model, seed=0)
        _, llm = entering(model, inp)
        assert handle.schedule.settings_dict()["adaptive"] is True
        assert llm[0] == TEXT + counts[0]  # the LLM received the measured count, not the planned one
        (record,) = handle.records
        assert int((record.kept[0] >= 0).sum()) == counts[0] - 1  # kept patches, then the extra token
        a, b = next(((a, b) for a in counts for b in counts if counts[a] != counts[b]), (None, None))
        assert a is not None, f"every seed kept the same count: {counts}"
        two = [inputs(model, seed=s) for s in (a, b)]
        batch = {k: torch.cat([t[k] for t in two]) for k in two[0]}
        with pytest.raises(FicocoError, match="adaptive count differs between the items"):
            model(**batch)


@pytest.mark.parametrize("name,method", [("video-llava-tiny", m) for m in METHODS])
def test_video_llava_runs_the_methods_per_frame(name: str, method: str) -> None:
    model = ficoco.build_model(name, dtype="fp32")
    inp = synthetic_inputs(model, batch=2, text_tokens=TEXT)
    arch = architecture(profile_of(model))
    with torch.no_grad(), ficoco.apply(model, method, keep=8) as handle:
        layers = model.model.language_model.layers
        seen: list[int] = []
        hook = layers[0].self_attn.register_forward_pre_hook(
            lambda m, args, kwargs: seen.append(kwargs["hidden_states"].shape[1]), with_kwargs=True)
        try:
            model(**inp)
        finally:
            hook.remove()
        tokens = model.generate(**inp, max_new_tokens=3, do_sample=False)
    plan = plan_tokens(arch, handle.schedule, text_tokens=TEXT)
    assert seen == [plan.llm[0][0]] and plan.llm_visual_tokens == arch.vision.items * (8 + 1)
    assert handle.measured_tokens_per_item == 8  # the 8 kept of every frame ([CLS] reaches the LLM too)
    assert torch.equal(tokens[:, :inp["input_ids"].shape[1]], inp["input_ids"])


@pytest.mark.parametrize("name,method", [("qwen2-vl-tiny", "prumerge")])
def test_families_not_wired_yet_are_refused_in_one_line_and_left_unpatched(name: str, method: str) -> None:
    # ToMe, VisionZip and FasterVLM run on Qwen2-VL since issue 25 (tests/test_models_qwen2_vl.py).
    model = ficoco.build_model(name, dtype="fp32")
    with pytest.raises(FicocoError, match="not wired: ") as info:
        ficoco.apply(model, method, keep=4)
    assert "\n" not in str(info.value)
    assert "_ficoco_handle" not in model.__dict__ and "forward" not in model.__dict__


@pytest.mark.parametrize("method,setting", [("tome", ["--keep", "16"]), ("visionzip", ["--keep", "16"]),
                                            ("fastervlm", ["--keep", "16"]), ("prumerge", ["--keep", "16"]),
                                            ("prumerge", [])])
def test_flops_verify_passes_with_the_methods_work_as_its_own_stage(method: str, setting: list[str],
                                                                    flops_verify: Any) -> None:
    run = flops_verify("--model", "llava-tiny", "--variant", method, *setting)["runs"][0]
    stages = {s["stage"]: s for s in run["stages"]}
    assert stages["method"]["analytic_flops"] > 0 and all(s["within_tolerance"] for s in stages.values())
    if not setting:  # the adaptive count is counted as measured
        assert any(r.get("added") == 1 for r in run["schedule"]) and run["visual_tokens"] < 65


def _next_turn(model: nn.Module, sequences: Tensor, seed: int) -> dict[str, Tensor]:
    """The conversation so far, then a new user turn with a new image: the whole conversation's
    input_ids and the new image, as HF users continue a chat on a cache."""
    turn = inputs(model, batch=sequences.shape[0], seed=seed)
    ids = torch.cat([sequences, turn["input_ids"][:, 1:]], dim=1)  # no second BOS
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "pixel_values": turn["pixel_values"]}


@pytest.mark.parametrize("method", METHODS)
def test_a_new_image_and_a_text_turn_on_the_cache_equal_the_whole_conversation(model: nn.Module, method: str) -> None:
    """generate with the whole conversation's input_ids on the first turn's cache gives the tokens
    of the conversation run as one prompt (every image span shortened alike, wherever it is), and
    the cache ends as long; a text turn runs only what the cache lacks."""
    options = {"max_new_tokens": NEW, "min_new_tokens": NEW, "do_sample": False, "return_dict_in_generate": True}
    first = inputs(model, batch=2, seed=20)
    question = inputs(model, seed=21)["input_ids"][:, -4:].expand(2, -1)
    with torch.no_grad(), ficoco.apply(model, method, keep=KEEP):
        turn1 = model.generate(**first, **options)
        turn = _next_turn(model, turn1.sequences, seed=22)
        turn2 = model.generate(**turn, **cache_argument(output_cache(turn1)), **options)
        pixels = torch.stack([first["pixel_values"], turn["pixel_values"]], dim=1).flatten(0, 1)
        whole = model.generate(**{**turn, "pixel_values": pixels}, **options)
        length = turn["input_ids"].shape[1]
        assert torch.equal(turn2.sequences[:, :length], turn["input_ids"])
        assert torch.equal(turn2.sequences[:, length:], whole.sequences[:, length:])
        assert output_cache(turn2).get_seq_length() == output_cache(whole).get_seq_length() == \
            length - 2 * (PATCHES - KEEP) + NEW - 1
        turn1 = model.generate(**first, **options)
        ids = torch.cat([turn1.sequences, question], dim=1)
        text = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        later = model.generate(**text, **cache_argument(output_cache(turn1)), **options)
        one = model.generate(**text, pixel_values=first["pixel_values"], **options)
    assert torch.equal(later.sequences, one.sequences)
    assert output_cache(later).get_seq_length() == output_cache(one).get_seq_length()


def test_prumerge_adaptive_count_on_a_conversations_cache_is_refused_in_one_line(model: nn.Module) -> None:
    """Each turn's adaptive count is measured on its own images, so the earlier turns' spans the cache
    holds cannot be told from this call's: refused (it ran silently misaligned before)."""
    options = {"max_new_tokens": NEW, "min_new_tokens": NEW, "do_sample": False, "return_dict_in_generate": True}
    first = inputs(model, seed=23)
    with torch.no_grad(), ficoco.apply(model, "prumerge"):
        turn1 = model.generate(**first, **options)
        turn = _next_turn(model, turn1.sequences, seed=24)
        ids = torch.cat([turn1.sequences, inputs(model, seed=25)["input_ids"][:, -4:]], dim=1)
        for call in (turn, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}):  # a new image; text only
            with pytest.raises(FicocoError, match="adaptive count is measured per call") as info:
                model.generate(**call, **cache_argument(output_cache(turn1)), **options)
            assert "\n" not in str(info.value) and "keep=" in str(info.value)
        # Without a cache the turn is a prompt of its own: served.
        fresh = model.generate(**inputs(model, seed=24), **options)
    assert fresh.sequences.shape[1] == TEXT + PATCHES + NEW


def test_profile_rows_name_the_official_method_and_a_correction_apart(cli: Any, tmp_path: Any) -> None:
    # Issue 35: `--hp` turns one of ficoco's corrections on; the row's method_label, its analytic settings and the
    # table say so, and the official method keeps its plain name.
    path = tmp_path / "p.json"
    result = cli("profile", "--model", "llava-tiny", "--variant", "visionzip,tome", "--keep", str(KEEP),
                 "--hp", "include_cls=false", "--repeat", "1", "--warmup", "0", "--device", "cpu", "--dtype", "fp32",
                 "--json", str(path))
    assert result.code == 0, result.err[-2000:]
    import json

    rows = {r["variant"]: r for r in json.loads(path.read_text())["rows"]}
    assert all(r["status"] == "ok" for r in rows.values()), rows
    assert rows["visionzip"]["method_label"] == "VisionZip (ficoco: [CLS] dropped)"
    assert rows["visionzip"]["analytic"]["settings"]["include_cls"] is False
    assert rows["tome"]["method_label"] == "ToMe" and rows["tome"]["analytic"]["settings"]["order"] == "official"
    assert rows["vanilla"]["method_label"] == "vanilla"
    assert "visionzip (ficoco: [CLS] dropped)" in result.out


def test_a_correction_given_beside_a_resolved_schedule_joins_it_and_a_planned_setting_is_refused(model: nn.Module
                                                                                                ) -> None:
    from ficoco.accounting import CountOptions, resolve_schedule
    from ficoco.methods import method_label

    arch = architecture(profile_of(model))
    schedule = resolve_schedule(arch, "visionzip", CountOptions(), keep=KEEP)
    with ficoco.apply(model, "visionzip", schedule=schedule, contextual_mode="mean") as handle:
        settings = handle.schedule.settings_dict()
    assert settings["contextual_mode"] == "mean" and handle.schedule.removals == schedule.removals
    assert method_label("visionzip", settings) == "VisionZip (ficoco: mean contextual token)"
    with pytest.raises(FicocoError, match="dominant set the schedule"):
        ficoco.apply(model, "visionzip", schedule=schedule, dominant=3)
    assert "_ficoco_handle" not in model.__dict__
