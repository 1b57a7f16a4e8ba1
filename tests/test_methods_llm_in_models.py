"""FastV, PDrop, SparseVLM and DART inside the models (issue 14, phase 2): the adapters' hook points
and probes, positions, masks and KV-cache decoding, on seeded random tiny models in fp32 on the CPU.

llava-tiny: a 4-layer LLaMA decoder, one image span of 64 visual tokens, 12 text tokens per prompt.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from helpers import assert_batch_equals_samples_alone, forward_with_hooks, prefill_and_decode
from torch import Tensor, nn

import ficoco
import ficoco.models.llm_steps
from ficoco.accounting import architecture
from ficoco.accounting.schedule import plan_tokens
from ficoco.api import profile_of
from ficoco.errors import FicocoError
from ficoco.methods import registry
from ficoco.models import synthetic_inputs
from ficoco.models.hf_compat import cache_argument, output_cache

TEXT = 12
VISUAL = 64
NEW = 6
# One setting per method that reduces on a 4-layer decoder (the official layers lie beyond it).
SETTINGS: dict[str, dict[str, Any]] = {
    "fastv": {},  # layer 2, half the image
    "pdrop": {"keep": 24},  # stages at layers 1, 2, 3
    "sparsevlm": {"schedule": "1:30,3:10"},  # recycles 2 and 1 clusters
    "dart": {"keep": 32},  # 4 image pivots + 8 x 4 picks
}
METHODS = tuple(SETTINGS)


TINY_PROFILE = "llava-tiny"  # built as this module's `model` (conftest.py)


def inputs(model: nn.Module, batch: int = 1, seed: int = 0, text: int = TEXT) -> dict[str, Tensor]:
    return synthetic_inputs(model, batch=batch, text_tokens=text, seed=seed)


def greedy(model: nn.Module, inp: dict[str, Tensor], new: int = NEW) -> Tensor:
    return model.generate(**inp, max_new_tokens=new, do_sample=False, min_new_tokens=new)


def entering_tokens(model: nn.Module, inp: dict[str, Tensor]) -> list[int]:
    """The sequence length every decoder layer ran on in one prefill, seen by pre-hooks on its attention
    (a layer-input method reduces inside the layer's wrapped forward, before its attention)."""
    seen: list[int] = []
    layers = model.model.language_model.layers
    hooks = [layer.self_attn.register_forward_pre_hook(lambda m, args, kwargs: seen.append(
        (args[0] if args else kwargs["hidden_states"]).shape[1]), with_kwargs=True) for layer in layers]
    forward_with_hooks(model, inp, hooks)
    return seen


@pytest.mark.parametrize("method,setting", [
    *[(m, {"schedule": {}}) for m in METHODS],  # empty schedule
    ("fastv", {"keep": VISUAL}), ("dart", {"keep": VISUAL}),  # full keep
])
def test_empty_or_full_keep_schedule_is_bitwise_vanilla(model: nn.Module, method: str, setting: dict) -> None:
    inp = inputs(model, batch=2)
    labels = inp["input_ids"].masked_fill(inp["input_ids"] == 300, -100)
    with torch.no_grad():
        reference = model(**inp, labels=labels)
        reference_tokens = greedy(model, inp)
        with ficoco.apply(model, method, **setting) as handle:
            assert handle.schedule.removals == ()
            out = model(**inp, labels=labels)
            tokens = greedy(model, inp)
    assert torch.equal(out.logits, reference.logits) and torch.equal(out.loss, reference.loss)
    assert torch.equal(tokens, reference_tokens)


@pytest.mark.parametrize("method", METHODS)
def test_tokens_entering_every_layer_equal_the_accountants_plan(model: nn.Module, method: str) -> None:
    inp = inputs(model, batch=2)
    with ficoco.apply(model, method, **SETTINGS[method]) as handle:
        seen = entering_tokens(model, inp)
        plan = plan_tokens(architecture(profile_of(model)), handle.schedule, text_tokens=TEXT)
        records = handle.records
    assert handle.schedule.removals, "the setting must reduce on the tiny decoder"
    assert seen == [entering for entering, _ in plan.llm]
    steps = {r.layer: r for r in handle.schedule.removals}
    assert [r.layer for r in records] == sorted(steps)
    for record, reduction in zip(records, [r for r in plan.reductions if r.stage == "llm"], strict=True):
        kept = reduction.visual_before - reduction.removed
        assert tuple(record.kept.shape) == (2, kept) and tuple(record.discarded.shape) == (2, reduction.removed)


def left_padded(model: nn.Module) -> tuple[dict[str, Tensor], list[dict[str, Tensor]]]:
    """Two prompts of different lengths (so different image spans) in one left-padded batch."""
    short, long = inputs(model, seed=1, text=TEXT), inputs(model, seed=2, text=TEXT + 3)
    pad = long["input_ids"].shape[1] - short["input_ids"].shape[1]
    ids = torch.cat([torch.cat([torch.zeros(1, pad, dtype=torch.long), short["input_ids"]], 1), long["input_ids"]])
    mask = torch.cat([torch.cat([torch.zeros(1, pad, dtype=torch.long), short["attention_mask"]], 1),
                      long["attention_mask"]])
    # Position ids from the padding mask, as generate gives them: DART's pivots are L1 norms of post-RoPE
    # keys, which a rotation by a padding-shifted absolute position would change.
    batch = {"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(1) - 1).clamp(min=0),
             "pixel_values": torch.cat([short["pixel_values"], long["pixel_values"]])}
    return batch, [short, long]


@pytest.mark.parametrize("method", METHODS)
def test_a_left_padded_batch_equals_its_samples_run_alone(model: nn.Module, method: str) -> None:
    batch, alone = left_padded(model)
    assert not torch.equal(*(torch.nonzero(b["input_ids"][0] == 300)[0] for b in (
        {"input_ids": batch["input_ids"][:1]}, {"input_ids": batch["input_ids"][1:]})))
    with torch.no_grad(), ficoco.apply(model, method, **SETTINGS[method]) as handle:
        assert_batch_equals_samples_alone(model, handle, batch, alone)


@pytest.mark.parametrize("method", METHODS)
def test_generate_matches_a_hand_written_prefill_and_decode_loop(model: nn.Module, method: str) -> None:
    inp = inputs(model, batch=2, seed=3)
    prompt = inp["input_ids"].shape[1]
    with torch.no_grad(), ficoco.apply(model, method, **SETTINGS[method]) as handle:
        generated = greedy(model, inp)
        # The mask grows from the caller's prompt, as a hand-written loop grows it.
        out, positions, decoded, cache = prefill_and_decode(model, inp, NEW, handle)
    # generate returns the caller's prompt, then the new tokens; each layer cached what it saw.
    assert torch.equal(generated[:, :prompt], inp["input_ids"])
    assert torch.equal(generated[:, prompt:], decoded)
    plan = plan_tokens(architecture(profile_of(model)), handle.schedule, text_tokens=TEXT)
    lengths = [cache.get_seq_length(i) for i in range(len(plan.llm))]
    assert lengths == [entering + NEW - 1 for entering, _ in plan.llm]
    # Output positions name the input position of every output position (added tokens: the span's end).
    assert positions.shape == out.logits.shape[:2] and torch.equal(positions[:, -1], torch.full((2,), prompt - 1))


def test_pdrop_and_sparsevlm_compact_positions_fastv_and_dart_keep_them(model: nn.Module) -> None:
    # The rotary positions of the last prompt token at the last layer: original for FastV and DART,
    # the prompt's length minus what left before that layer for PDrop and SparseVLM.
    inp = inputs(model)
    last_layer = model.model.language_model.layers[-1].self_attn
    for method, compact in (("fastv", False), ("dart", False), ("pdrop", True), ("sparsevlm", True)):
        seen: list[Tensor] = []
        hook = last_layer.register_forward_pre_hook(
            lambda m, args, kwargs, seen=seen: seen.append(kwargs["position_ids"]), with_kwargs=True)
        try:
            with torch.no_grad(), ficoco.apply(model, method, **SETTINGS[method]) as handle:
                model(**inp)
        finally:
            hook.remove()
        removed = sum(r.remove - r.added for r in handle.schedule.removals)
        length = inp["input_ids"].shape[1]
        assert int(seen[0].reshape(-1)[-1]) == (length - 1 - removed if compact else length - 1), method


def test_probes_run_only_in_the_layers_a_method_reads_and_sdpa_stays_on(model: nn.Module) -> None:
    # FastV at layer 2 reads layer 1's last row; every attention module keeps its own implementation.
    inp = inputs(model)
    calls: list[tuple[int, int]] = []
    original = last_row = ficoco.models.llm_steps.last_row_attention  # type: ignore[attr-defined]

    def spy(query: Tensor, keys: Tensor, *args: Any) -> Tensor:
        calls.append((query.shape[0], keys.shape[2]))
        return original(query, keys, *args)

    ficoco.models.llm_steps.last_row_attention = spy  # type: ignore[attr-defined]
    try:
        with torch.no_grad(), ficoco.apply(model, "fastv"):
            greedy(model, inp, new=3)
            layers = model.model.language_model.layers
            assert layers[1].self_attn._ficoco_rows_config._attn_implementation == "sdpa"
            assert [hasattr(layer.self_attn, "_ficoco_rows") for layer in layers] == [False, True, False, False]
    finally:
        ficoco.models.llm_steps.last_row_attention = last_row  # type: ignore[attr-defined]
    assert calls == [(1, inp["input_ids"].shape[1])]  # once, in the prefill, over every key


@pytest.mark.parametrize("name,method", [
    ("llava-next-tiny", "fastv"), ("video-llava-tiny", "dart"), ("qwen2-vl-tiny", "fastv"), ("qwen2-vl-tiny", "dart"),
    ("llava-next-tiny", "pdrop"), ("video-llava-tiny", "sparsevlm"), ("video-llava-tiny", "pdrop"),
])
def test_other_families_run_the_methods_they_are_defined_on(name: str, method: str) -> None:
    model = ficoco.build_model(name, dtype="fp32")
    inp = synthetic_inputs(model, batch=2, text_tokens=TEXT)
    arch = architecture(profile_of(model))
    n = arch.visual_tokens
    setting = {"fastv": {"schedule": f"2:{n // 2}"}, "dart": {"keep": 8 * ((n // 2) // 8)},
               "pdrop": {"schedule": f"1:{n // 2},3:{n // 4}"}, "sparsevlm": {"schedule": f"1:{n // 2}"}}[method]
    with torch.no_grad(), ficoco.apply(model, method, **setting) as handle:
        seen = entering_tokens(model, inp)
        tokens = model.generate(**inp, max_new_tokens=3, do_sample=False)
    plan = plan_tokens(arch, handle.schedule, text_tokens=inp["input_ids"].shape[1] - n)
    assert seen == [entering for entering, _ in plan.llm]
    assert tokens.shape[1] == inp["input_ids"].shape[1] + 3


def test_a_family_the_method_is_not_defined_on_is_refused_naming_those_it_is() -> None:
    # PDrop runs on Qwen2-VL since issue 25; PruMerge+ is still refused there, with the registry's reason.
    model = ficoco.build_model("qwen2-vl-tiny", dtype="fp32")
    with pytest.raises(FicocoError,
                       match="PruMerge\\+ is defined on llava, llava_next, video_llava, internvl models") as info:
        ficoco.apply(model, "prumerge", keep=8)
    assert registry.METHODS["prumerge"].refusals["qwen2_vl"] in str(info.value)
    assert "_ficoco_handle" not in model.__dict__


def two_image_prompts(model: nn.Module, seeds: tuple[int, ...] = (0, 1)) -> tuple[dict[str, Tensor],
                                                                                   list[dict[str, Tensor]]]:
    """Prompts of two images each with text between them (the template twice), batched and alone."""
    alone = []
    for seed in seeds:
        first, second = inputs(model, seed=seed), inputs(model, seed=seed + 10)
        ids = torch.cat([first["input_ids"], second["input_ids"][:, 1:]], 1)
        alone.append({"input_ids": ids, "attention_mask": torch.ones_like(ids),
                      "pixel_values": torch.cat([first["pixel_values"], second["pixel_values"]])})
    return {key: torch.cat([a[key] for a in alone]) for key in alone[0]}, alone


def fastv_reference_kept(model: nn.Module, inp: dict[str, Tensor], layer: int, keep: int) -> Tensor:
    """FastV's choice written out on the unpatched model: layer K-1's last-row attention (its own norm,
    q/k projections and RoPE), head mean, over every image token of the prompt; the top `keep`, sorted."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    language = model.model.language_model
    with torch.no_grad():
        hidden = model(**inp, output_hidden_states=True).hidden_states[layer - 1]
        attention = language.layers[layer - 1].self_attn
        normed = language.layers[layer - 1].input_layernorm(hidden)
        batch, length, _ = normed.shape
        dim = attention.head_dim
        q = attention.q_proj(normed).view(batch, length, -1, dim).transpose(1, 2)
        k = attention.k_proj(normed).view(batch, length, -1, dim).transpose(1, 2)
        cos, sin = language.rotary_emb(normed, torch.arange(length)[None])
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        row = torch.softmax((q[:, :, -1:] @ k.transpose(-1, -2)).squeeze(2) * dim**-0.5, dim=-1).mean(dim=1)
    scores = row[inp["input_ids"] == model.config.image_token_id].view(batch, -1)
    return torch.sort(torch.topk(scores, keep, dim=1).indices, dim=1).values


@pytest.mark.parametrize("method", METHODS)
def test_several_images_are_reduced_together_keeping_the_planned_count(model: nn.Module, method: str) -> None:
    """Issue 25: two image spans per prompt are one set of visual tokens; every step removes twice one
    image's planned count among them (SparseVLM's clusters follow from all the pruned tokens together)."""
    batch, alone = two_image_prompts(model)
    length = batch["input_ids"].shape[1]
    with torch.no_grad(), ficoco.apply(model, method, **SETTINGS[method]) as handle:
        seen = entering_tokens(model, batch)
        records = list(handle.records)
        generated = greedy(model, batch, new=3)
        _, _, decoded, _ = prefill_and_decode(model, batch, 3, handle)
        singles = [greedy(model, sample, new=3) for sample in alone]
    removals = handle.schedule.removals
    assert [tuple(r.discarded.shape) for r in records] == [(2, 2 * r.remove) for r in removals]
    if method != "sparsevlm":  # no added tokens: the sequence is twice one image's plan shorter
        plan = plan_tokens(architecture(profile_of(model)), handle.schedule, text_tokens=TEXT)
        assert seen == [length - 2 * (VISUAL - (entering - TEXT)) for entering, _ in plan.llm]
    assert seen[-1] < length and torch.equal(generated[:, -3:], decoded)
    for i, single in enumerate(singles):
        assert torch.equal(generated[i:i + 1], single)
    if method == "fastv":  # across both images, as written out on the unpatched model
        keep = records[0].kept.shape[1]
        assert torch.equal(records[0].kept, fastv_reference_kept(model, batch, 2, keep))
        assert bool((records[0].kept < VISUAL).any()) and bool((records[0].kept >= VISUAL).any())


def test_a_new_image_on_a_cache_is_refused_in_one_line(model: nn.Module) -> None:
    inp = inputs(model)
    with torch.no_grad(), ficoco.apply(model, "fastv"):
        out = model(**inp, use_cache=True)
        with pytest.raises(FicocoError, match="new image on an earlier turn's cache"):
            model(**inp, **cache_argument(output_cache(out)))


def test_a_method_added_to_the_registry_runs_without_a_change_elsewhere(model: nn.Module,
                                                                         monkeypatch: pytest.MonkeyPatch,
                                                                         cli: Any) -> None:
    # A new entry (here FastV's module under another name and layer) is planned, applied and verified.
    mine = dataclasses.replace(registry.METHODS["fastv"], name="mine", title="Mine",
                               hyperparameters={"layer": 1, "ratio": 0.25, "attention_scores": "model"})
    monkeypatch.setitem(registry.METHODS, "mine", mine)
    inp = inputs(model)
    with torch.no_grad(), ficoco.apply(model, "mine") as handle:
        seen = entering_tokens(model, inp)
    assert [r.layer for r in handle.schedule.removals] == [1] and seen[1] == seen[0] - VISUAL // 4
    mine_registered = ("import dataclasses, ficoco.methods.registry as r; "
                       "r.METHODS['mine'] = dataclasses.replace(r.METHODS['fastv'], name='mine', title='Mine'); "
                       "r.VARIANTS = ('vanilla', *r.METHODS)")
    result = cli("flops", "--verify", "--model", "llava-tiny", "--variant", "vanilla,mine", prelude=mine_registered)
    assert result.code == 0, result.err
    assert "mine" in result.out and "method" in result.out and "verdict: pass" in result.out


@pytest.mark.parametrize("method", METHODS)
def test_flops_verify_passes_with_the_methods_work_as_its_own_stage(method: str, flops_verify: Any) -> None:
    setting = {"fastv": [], "pdrop": ["--keep", "24"], "sparsevlm": ["--schedule", "1:30,3:10"],
               "dart": ["--keep", "32"]}[method]
    run = flops_verify("--model", "llava-tiny", "--variant", method, *setting)["runs"][0]
    stages = {s["stage"]: s for s in run["stages"]}
    assert stages["method"]["analytic_flops"] > 0 and all(s["within_tolerance"] for s in stages.values())
