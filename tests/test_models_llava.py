"""FiCoCo-V / FiCoCo-L inside Hugging Face LLaVA-1.5, end to end (issue 3).

Random seeded llava-tiny models in fp32 on CPU: a CLIP tower of 6 layers over an 8 x 8
patch grid (64 visual tokens, V reduces in layers 0..4) and a LLaMA decoder of 4 layers
(L reduces in layers 1..3); prompts are 12 text tokens around one image span.
"""

from __future__ import annotations

import contextlib
import copy
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import ficoco
from ficoco.accounting import architecture
from ficoco.accounting.schedule import Schedule, make_schedule, plan_tokens
from ficoco.api import Hyperparameters, profile_of
from ficoco.errors import FicocoError
from ficoco.models.attention import PROBE_IMPLEMENTATION
from ficoco.models.hf_compat import cache_argument, output_cache
from ficoco.models.inputs import PREFIX_TOKENS, synthetic_inputs

TEXT = 12  # text tokens per prompt
PATCHES = 64  # 8 x 8 grid of llava-tiny
IMAGE_TOKEN = 300  # profiles/llava-tiny.json image_token_index
NEW = 16  # generated tokens


# -- fixtures and helpers ---------------------------------------------------------------------

TINY_PROFILE = "llava-tiny"  # built as this module's `model` (conftest.py)


@pytest.fixture(scope="module")
def gqa_model() -> nn.Module:
    return ficoco.build_model("llava-gqa-tiny", dtype="fp32")


@pytest.fixture(scope="module")
def arch(model: nn.Module) -> Any:
    return architecture(profile_of(model, "llava-tiny"))


def inputs(model: nn.Module, batch: int = 1, seed: int = 0) -> dict[str, Tensor]:
    return synthetic_inputs(model, batch=batch, text_tokens=TEXT, seed=seed)


def sample(batch: dict[str, Tensor], i: int) -> dict[str, Tensor]:
    return {k: v[i:i + 1] for k, v in batch.items()}


def greedy(model: nn.Module, inp: dict[str, Tensor], new: int = NEW) -> Tensor:
    return model.generate(**inp, max_new_tokens=new, do_sample=False)


def vision_layers(model: nn.Module) -> nn.ModuleList:
    return model.model.vision_tower.encoder.layers


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    return model.model.language_model.layers


@contextlib.contextmanager
def entering_tokens(model: nn.Module) -> Iterator[dict[str, dict[int, list[int]]]]:
    """Record hidden_states.shape[1] at the entry of every CLIP and decoder layer, per call
    (and, under "vision-mlp" / "llm-mlp", at the entry of each layer's MLP)."""
    seen: dict[str, dict[int, list[int]]] = {k: defaultdict(list) for k in ("vision", "llm", "vision-mlp", "llm-mlp")}
    hooks = []
    for stage, layers in (("vision", vision_layers(model)), ("llm", decoder_layers(model))):
        for i, layer in enumerate(layers):
            def hook(module: nn.Module, args: tuple, kwargs: dict, _stage: str = stage, _i: int = i) -> None:
                hidden = args[0] if args else kwargs["hidden_states"]
                seen[_stage][_i].append(hidden.shape[1])

            def mlp_hook(module: nn.Module, args: tuple, _stage: str = stage, _i: int = i) -> None:
                seen[f"{_stage}-mlp"][_i].append(args[0].shape[1])

            hooks.append(layer.register_forward_pre_hook(hook, with_kwargs=True))
            hooks.append(layer.mlp.register_forward_pre_hook(mlp_hook))
    try:
        yield seen
    finally:
        for h in hooks:
            h.remove()


@contextlib.contextmanager
def probe_calls(implementation: str = PROBE_IMPLEMENTATION, slot: str = "_ficoco_probe"
                ) -> Iterator[list[tuple[nn.Module, bool]]]:
    """Count calls of a registered ficoco attention function (module, armed): the decoder's probe
    (`ficoco_probe`), or the tower's hook point (`ficoco_tower_rows`, slot `_ficoco_tower`)."""
    function = ALL_ATTENTION_FUNCTIONS[implementation]
    calls: list[tuple[nn.Module, bool]] = []

    def counting(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        calls.append((module, getattr(module, slot).armed))
        return function(module, *args, **kwargs)

    ALL_ATTENTION_FUNCTIONS[implementation] = counting  # an instance-local override
    try:
        yield calls
    finally:
        del ALL_ATTENTION_FUNCTIONS[implementation]  # back to the global registration
    assert ALL_ATTENTION_FUNCTIONS[implementation] is function


def instance_attributes(model: nn.Module) -> dict[str, set[str]]:
    return {name: set(module.__dict__) for name, module in model.named_modules()}


def attention_configs(model: nn.Module) -> dict[str, Any]:
    return {name: module.config for name, module in model.named_modules() if name.endswith("self_attn")}


def check_records(records: list, stage: str, schedule: Schedule, batch: int) -> None:
    """One record per reducing layer; kept/discarded partition the previous kept set, sorted."""
    removed = schedule.removed_at()
    assert [r.layer for r in records] == sorted(removed)
    assert {r.stage for r in records} <= {stage}
    previous = torch.arange(PATCHES).expand(batch, -1)
    left = PATCHES
    for rec in records:
        left -= removed[rec.layer]
        assert tuple(rec.kept.shape) == (batch, left)
        assert tuple(rec.discarded.shape) == (batch, removed[rec.layer])
        for part in (rec.kept, rec.discarded):
            assert bool((part[:, 1:] > part[:, :-1]).all()), f"layer {rec.layer}: indices not ascending"
        union = torch.cat([rec.kept, rec.discarded], dim=1).sort(dim=1).values
        assert torch.equal(union, previous), f"layer {rec.layer}: kept + discarded != the previous kept set"
        previous = rec.kept


# -- 1. an empty schedule is the unpatched model ----------------------------------------------

@pytest.mark.parametrize("variant", ["v", "l"])
def test_empty_schedule_logits_and_generate_are_bitwise_unpatched(model: nn.Module, variant: str) -> None:
    inp = inputs(model, batch=2)
    ref_logits = model(**inp).logits
    ref_tokens = greedy(model, inp)
    with ficoco.apply(model, variant, schedule={}) as handle:
        assert "forward" in model.__dict__  # the patched path really runs
        logits = model(**inp).logits
        tokens = greedy(model, inp)
        assert handle.records == []
    assert torch.equal(logits, ref_logits)
    assert torch.equal(tokens, ref_tokens)


# -- 2. remove() and `with` restore the model exactly -----------------------------------------

def _assert_restored(model: nn.Module, attrs: dict[str, set[str]], configs: dict[str, Any]) -> None:
    assert instance_attributes(model) == attrs
    for name, module in model.named_modules():
        assert "forward" not in module.__dict__, name
        assert "generate" not in module.__dict__, name
        assert not hasattr(module, "_ficoco_probe"), name
    assert "_ficoco_handle" not in model.__dict__
    now = attention_configs(model)
    assert now.keys() == configs.keys()
    assert all(now[k] is configs[k] for k in configs)
    assert model.config.text_config._attn_implementation == "sdpa"
    assert model.config.vision_config._attn_implementation == "sdpa"


@pytest.mark.parametrize("variant", ["v", "l"])
def test_remove_restores_model_bitwise_and_leaves_no_attributes(model: nn.Module, variant: str) -> None:
    inp = inputs(model, batch=2, seed=1)
    before = model(**inp).logits
    attrs, configs = instance_attributes(model), attention_configs(model)
    handle = ficoco.apply(model, variant, keep=8)
    patched = model(**inp).logits
    greedy(model, inp, new=2)
    assert patched.shape != before.shape or not torch.equal(patched, before)
    assert any("forward" in m.__dict__ for m in model.modules())
    assert any(configs[k] is not v for k, v in attention_configs(model).items())  # probes are in
    handle.remove()
    _assert_restored(model, attrs, configs)
    assert torch.equal(model(**inp).logits, before)
    handle.remove()  # a second remove is harmless
    _assert_restored(model, attrs, configs)


@pytest.mark.parametrize("variant", ["v", "l"])
def test_leaving_with_block_restores_model_even_on_error(model: nn.Module, variant: str) -> None:
    inp = inputs(model, seed=2)
    before = model(**inp).logits
    attrs, configs = instance_attributes(model), attention_configs(model)
    with ficoco.apply(model, variant, keep=8) as handle:
        assert handle.model is model and handle.variant == variant
        model(**inp)
    _assert_restored(model, attrs, configs)
    assert torch.equal(model(**inp).logits, before)
    with pytest.raises(RuntimeError, match="boom"), ficoco.apply(model, variant, keep=8):
        model(**inp)
        raise RuntimeError("boom")
    _assert_restored(model, attrs, configs)
    assert torch.equal(model(**inp).logits, before)


@pytest.mark.parametrize(("first", "second"), [("v", "v"), ("v", "l"), ("l", "v"), ("l", "l")])
def test_applying_twice_without_remove_raises(model: nn.Module, first: str, second: str) -> None:
    attrs = instance_attributes(model)
    with ficoco.apply(model, first, keep=8):
        patched = instance_attributes(model)
        with pytest.raises(FicocoError, match="already patched"):
            ficoco.apply(model, second, keep=16)
        assert instance_attributes(model) == patched  # the failed apply changed nothing
    assert instance_attributes(model) == attrs


def test_stale_handle_remove_does_not_unmark_a_newer_patch(model: nn.Module) -> None:
    old = ficoco.apply(model, "v", keep=8)
    old.remove()
    new = ficoco.apply(model, "l", keep=8)
    try:
        old.remove()  # stale: must not touch the model that `new` patched
        try:
            third = ficoco.apply(model, "v", keep=8)
        except FicocoError:
            third = None
        if third is not None:
            third.remove()
        assert third is None, "a third apply stacked patches on a model that is still patched"
    finally:
        new.remove()


# -- 3. tokens every layer processes == the schedule's plan -----------------------------------

SCHEDULES = [
    ("v", {"keep": 8}),
    ("v", {"keep": 8, "shape": "oneshot"}),
    ("v", {"schedule": {2: 10, 4: 20}}),
    ("v", {"keep": 32, "first_layer": 0}),
    ("l", {"keep": 8}),
    ("l", {"keep": 8, "shape": "oneshot"}),
    ("l", {"schedule": {1: 5, 3: 30}}),
    ("l", {"keep": 20, "first_layer": 2}),
]


@pytest.mark.parametrize(("variant", "how"), SCHEDULES, ids=[f"{v}-{h}" for v, h in SCHEDULES])
def test_tokens_entering_every_layer_equal_schedule_plan(model: nn.Module, arch: Any, variant: str,
                                                         how: dict) -> None:
    inp = inputs(model, batch=2, seed=3)
    with ficoco.apply(model, variant, **how) as handle, entering_tokens(model) as seen:
        logits = model(**inp).logits
        records = list(handle.records)
    plan = plan_tokens(arch, handle.schedule, text_tokens=TEXT)
    assert handle.schedule.total_removed > 0
    for i in range(len(vision_layers(model))):
        assert seen["vision"][i] == [plan.vision[i][0]], f"vision layer {i}"
        assert seen["vision-mlp"][i] == [plan.vision[i][1]], f"vision layer {i}: the MLP runs on the kept tokens"
    for i in range(len(decoder_layers(model))):
        assert seen["llm"][i] == [plan.llm[i][0]], f"decoder layer {i}"
        assert seen["llm-mlp"][i] == [plan.llm[i][1]], f"decoder layer {i}: the MLP runs on the kept tokens"
    if variant == "v":
        assert logits.shape[1] == TEXT + plan.llm_visual_tokens
        assert plan.llm_visual_tokens == handle.keep_per_image
    else:
        assert logits.shape[1] == plan.llm[-1][1] == TEXT + plan.visual_tokens
    check_records(records, "vision" if variant == "v" else "llm", handle.schedule, batch=2)
    if "keep" in how:
        assert records[-1].kept.shape[1] == how["keep"]
    assert handle.reduction_seconds > 0


# -- 4. batches: every sample as if alone; runs deterministic ---------------------------------

# With random weights FiCoCo-L's default scores are dominated by the causal vision-aware term
# and discard the earliest visual tokens of every sample alike; beta=0 (task-aware term only)
# makes the kept sets depend on the sample, so a mix-up between samples would show.
L_SAMPLE_DEPENDENT = {"beta": 0.0}


@pytest.mark.parametrize(("variant", "params"), [("v", {}), ("l", {}), ("l", L_SAMPLE_DEPENDENT)],
                         ids=["v", "l", "l-beta0"])
def test_batch_gives_each_sample_its_batch_of_one_result(model: nn.Module, variant: str, params: dict) -> None:
    batch = inputs(model, batch=3, seed=4)
    with ficoco.apply(model, variant, keep=8, **params) as handle:
        together = model(**batch).logits
        kept_together = [r.kept for r in handle.records]
        for i in range(3):
            alone = model(**sample(batch, i)).logits
            torch.testing.assert_close(together[i:i + 1], alone, atol=1e-5, rtol=0)
            for rec, kept in zip(handle.records, kept_together, strict=True):
                assert torch.equal(rec.kept[0], kept[i])
    assert not torch.allclose(together[0], together[1], atol=1e-3)
    if variant == "v" or params:
        assert not torch.equal(kept_together[0][0], kept_together[0][1])


@pytest.mark.parametrize("variant", ["v", "l"])
def test_patched_runs_are_bitwise_deterministic(model: nn.Module, variant: str) -> None:
    inp = inputs(model, batch=2, seed=5)
    runs = []
    for _ in range(2):
        with ficoco.apply(model, variant, keep=8) as handle:
            first = model(**inp).logits
            second = model(**inp).logits  # no state leaks from one forward to the next
            runs.append((first, second, [(r.kept, r.discarded) for r in handle.records]))
    (a1, a2, ra), (b1, b2, rb) = runs
    assert torch.equal(a1, a2) and torch.equal(a1, b1) and torch.equal(b1, b2)
    assert len(ra) == len(rb) == 3
    assert all(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) for x, y in zip(ra, rb, strict=True))


# -- 5. FiCoCo-L: generation and decoding after a reduced prefill -----------------------------

def test_l_generate_batch_equals_each_sample_generated_alone(model: nn.Module, arch: Any) -> None:
    batch = inputs(model, batch=2, seed=6)
    length = batch["input_ids"].shape[1]
    with ficoco.apply(model, "l", keep=8) as handle:
        with entering_tokens(model) as seen:
            together = greedy(model, batch)
        check_records(handle.records, "llm", handle.schedule, batch=2)
        plan = plan_tokens(arch, handle.schedule, text_tokens=TEXT)
        prefill_last = model(**batch).logits[:, -1]
        alone = [greedy(model, sample(batch, i)) for i in range(2)]
    assert together.shape == (2, length + NEW)
    assert torch.equal(together[:, :length], batch["input_ids"])
    for i in range(2):
        assert torch.equal(together[i:i + 1], alone[i])
    assert torch.equal(together[:, length], prefill_last.argmax(-1))
    for i in range(len(decoder_layers(model))):
        # Reduced prefill, then one token per decode step.
        assert seen["llm"][i] == [plan.llm[i][0]] + [1] * (NEW - 1), f"decoder layer {i}"


@pytest.mark.parametrize("params", [{}, L_SAMPLE_DEPENDENT], ids=["default", "beta0"])
def test_l_generate_left_padded_batch_equals_samples_alone(model: nn.Module, params: dict) -> None:
    long, short = inputs(model, seed=7), synthetic_inputs(model, batch=1, text_tokens=TEXT - 3, seed=8)
    pad = torch.full((1, 3), model.config.pad_token_id)
    batch = {
        "input_ids": torch.cat([long["input_ids"], torch.cat([pad, short["input_ids"]], 1)]),
        "attention_mask": torch.cat([long["attention_mask"],
                                     torch.cat([torch.zeros_like(pad), short["attention_mask"]], 1)]),
        "pixel_values": torch.cat([long["pixel_values"], short["pixel_values"]]),
    }
    with ficoco.apply(model, "l", keep=8, **params):
        together = greedy(model, batch, new=8)[:, -8:]
        alone = [greedy(model, x, new=8)[:, -8:] for x in (long, short)]
    assert torch.equal(together[0:1], alone[0])
    assert torch.equal(together[1:2], alone[1])


@pytest.mark.parametrize("params", [{}, L_SAMPLE_DEPENDENT], ids=["default", "beta0"])
def test_l_decode_step_uses_original_length_position_and_each_layers_cache(model: nn.Module, params: dict) -> None:
    inp = inputs(model, batch=2, seed=9)
    batch, length = inp["input_ids"].shape
    with ficoco.apply(model, "l", keep=8, **params):
        out = model(**inp, use_cache=True)
        reference_cache = copy.deepcopy(output_cache(out))
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        mask = torch.cat([inp["attention_mask"], torch.ones(batch, 1, dtype=torch.long)], dim=1)
        position = torch.full((batch, 1), length)
        step = model(input_ids=token, **cache_argument(output_cache(out)), attention_mask=mask,
                     position_ids=position, use_cache=True).logits[:, -1]
        generated = model.generate(**inp, max_new_tokens=2, do_sample=False, output_logits=True,
                                   return_dict_in_generate=True)
    assert torch.equal(generated.sequences[:, length:length + 1], token)
    assert torch.equal(generated.sequences[:, length + 1], step.argmax(-1))
    torch.testing.assert_close(generated.logits[1], step, atol=1e-5, rtol=0)
    # Independent reference: the unpatched model, every layer attending to all of its own
    # cache entries, the new token at the original (unreduced) length.
    reference = model(input_ids=token, **cache_argument(copy.deepcopy(reference_cache)), position_ids=position,
                      use_cache=True).logits[:, -1]
    torch.testing.assert_close(step, reference, atol=1e-5, rtol=0)
    # ... and the position matters: the reduced length would give other logits.
    wrong = model(input_ids=token, **cache_argument(copy.deepcopy(reference_cache)),
                  position_ids=torch.full((batch, 1), out.logits.shape[1]), use_cache=True).logits[:, -1]
    assert (wrong - step).abs().max() > 1e-4


def test_l_decode_mask_follows_each_layers_cached_positions(model: nn.Module) -> None:
    """A masked-out suffix token sits at a different cache index in every reduced layer; the
    decode step must mask exactly that entry in each layer's own cache."""
    inp = inputs(model, batch=2, seed=27)
    batch, length = inp["input_ids"].shape
    hole = length - 3  # a suffix token the prompt masks out
    inp["attention_mask"][:, hole] = 0
    with ficoco.apply(model, "l", keep=8, **L_SAMPLE_DEPENDENT):
        out = model(**inp, use_cache=True)
        reference_cache = copy.deepcopy(output_cache(out))
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        mask = torch.cat([inp["attention_mask"], torch.ones(batch, 1, dtype=torch.long)], dim=1)
        position = torch.full((batch, 1), length)
        step = model(input_ids=token, **cache_argument(output_cache(out)), attention_mask=mask,
                     position_ids=position, use_cache=True).logits[:, -1]
    # Reference: drop the masked entry from every layer's cache (the suffix is never reduced,
    # so it is the same distance from the end everywhere) and attend to all that is left.
    for layer in reference_cache.layers:
        j = layer.keys.shape[-2] - (length - hole)
        layer.keys = torch.cat([layer.keys[..., :j, :], layer.keys[..., j + 1:, :]], dim=-2)
        layer.values = torch.cat([layer.values[..., :j, :], layer.values[..., j + 1:, :]], dim=-2)
    reference = model(input_ids=token, **cache_argument(reference_cache), position_ids=position,
                      use_cache=True).logits[:, -1]
    torch.testing.assert_close(step, reference, atol=1e-5, rtol=0)


@pytest.mark.parametrize("how", [{"keep": 8}, {"schedule": {1: 5, 3: 30}}, {"keep": 20, "first_layer": 2}])
def test_l_kv_cache_of_each_layer_holds_the_tokens_it_saw(model: nn.Module, arch: Any, how: dict) -> None:
    inp = inputs(model, batch=2, seed=10)
    with ficoco.apply(model, "l", **how) as handle:
        cache = output_cache(model(**inp, use_cache=True))
        plan = plan_tokens(arch, handle.schedule, text_tokens=TEXT)
    lengths = [layer.keys.shape[-2] for layer in cache.layers]
    assert lengths == [entering for entering, _ in plan.llm]
    assert [layer.values.shape[-2] for layer in cache.layers] == lengths
    assert cache.get_seq_length() == inp["input_ids"].shape[1]  # layer 0 holds every token


def test_l_kept_tokens_keep_their_original_rotary_positions(model: nn.Module) -> None:
    inp = inputs(model, batch=2, seed=11)
    length = inp["input_ids"].shape[1]
    cos_seen: dict[int, Tensor] = {}
    hooks = []
    for i, layer in enumerate(decoder_layers(model)):
        def hook(module: nn.Module, args: tuple, kwargs: dict, _i: int = i) -> None:
            cos_seen[_i] = kwargs["position_embeddings"][0]

        hooks.append(layer.self_attn.register_forward_pre_hook(hook, with_kwargs=True))
    try:
        with ficoco.apply(model, "l", schedule={1: 5, 3: 30}, **L_SAMPLE_DEPENDENT) as handle:
            model(**inp)
            records = {r.layer: r for r in handle.records}
    finally:
        for h in hooks:
            h.remove()
    full = cos_seen[0].expand(2, -1, -1)  # layer 0 is never wrapped: tables of the whole sequence
    assert full.shape[1] == length
    prefix = torch.arange(PREFIX_TOKENS).expand(2, -1)
    suffix = torch.arange(PREFIX_TOKENS + PATCHES, length).expand(2, -1)
    for layer, kept_offsets in ((1, torch.arange(PATCHES).expand(2, -1)), (2, records[1].kept),
                                (3, records[1].kept)):
        positions = torch.cat([prefix, PREFIX_TOKENS + kept_offsets, suffix], dim=1)
        expected = torch.gather(full, 1, positions[..., None].expand(-1, -1, full.shape[-1]))
        assert torch.equal(cos_seen[layer].expand(2, -1, -1), expected), f"decoder layer {layer}"


def test_l_prefix_logits_equal_unpatched(gqa_model: nn.Module) -> None:
    """Prefix tokens attend only to the prefix: reduction (and the probe's eager attention,
    with grouped-query heads here) must leave their outputs as the unpatched model's."""
    inp = inputs(gqa_model, seed=12)
    ref = gqa_model(**inp).logits[:, :PREFIX_TOKENS]
    with ficoco.apply(gqa_model, "l", keep=8, shape="oneshot"):
        out = gqa_model(**inp).logits[:, :PREFIX_TOKENS]
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("variant", ["v", "l"])
def test_records_after_generate_describe_that_generate_alone(model: nn.Module, variant: str) -> None:
    first, second = inputs(model, batch=2, seed=25), inputs(model, batch=2, seed=26)
    with ficoco.apply(model, variant, keep=8, **L_SAMPLE_DEPENDENT) as handle:
        greedy(model, second, new=2)
        fresh = [(r.layer, r.kept) for r in handle.records]
    with ficoco.apply(model, variant, keep=8, **L_SAMPLE_DEPENDENT) as handle:
        model(**first)  # an earlier forward on the same handle
        greedy(model, second, new=2)
        check_records(handle.records, "vision" if variant == "v" else "llm", handle.schedule, batch=2)
        after = [(r.layer, r.kept) for r in handle.records]
    assert [layer for layer, _ in after] == [layer for layer, _ in fresh]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(after, fresh, strict=True))


# -- 6. FiCoCo-V: generation and records -------------------------------------------------------

def test_v_generate_batch_one_and_two(model: nn.Module, arch: Any) -> None:
    batch = inputs(model, batch=2, seed=13)
    with ficoco.apply(model, "v", keep=8) as handle:
        with entering_tokens(model) as seen:
            together = greedy(model, batch)
        check_records(handle.records, "vision", handle.schedule, batch=2)
        prefill_last = model(**batch).logits[:, -1]
        alone = [greedy(model, sample(batch, i)) for i in range(2)]
        plan = plan_tokens(arch, handle.schedule, text_tokens=TEXT)
    # The caller's own prompt comes back, then the new tokens (the LLM ran the shortened prompt).
    assert together.shape == (2, TEXT + PATCHES + NEW)
    assert torch.equal(together[:, :TEXT + PATCHES], batch["input_ids"])
    for i in range(2):
        assert torch.equal(together[i:i + 1, -NEW:], alone[i][:, -NEW:])
    assert torch.equal(together[:, -NEW], prefill_last.argmax(-1))
    for i in range(len(vision_layers(model))):
        assert seen["vision"][i] == [plan.vision[i][0]], f"vision layer {i}: the tower runs once"
    assert seen["llm"][0] == [TEXT + 8] + [1] * (NEW - 1)


@pytest.mark.parametrize("variant", ["v", "l"])
def test_records_are_kept_and_discarded_indices_per_reducing_layer(model: nn.Module, variant: str) -> None:
    inp = inputs(model, batch=2, seed=14)
    how = {2: 10, 3: 14, 4: 20} if variant == "v" else {1: 10, 2: 14, 3: 20}
    with ficoco.apply(model, variant, schedule=how) as handle:
        model(**inp)
        records = list(handle.records)
        model(**inp)
        assert len(handle.records) == 3  # a new forward starts new records
    check_records(records, "vision" if variant == "v" else "llm", handle.schedule, batch=2)
    assert all(r.stage == ("vision" if variant == "v" else "llm") for r in records)
    assert all(r.kept.dtype == torch.long and r.kept.device.type == "cpu" for r in records)


# -- 7. [CLS] and the equivalent token ----------------------------------------------------------

def _layer_output(model: nn.Module, layer: int, inp: dict[str, Tensor]) -> Tensor:
    captured = []

    def hook(module: nn.Module, args: tuple, output: Any) -> None:
        captured.append(output[0] if isinstance(output, tuple) else output)

    h = vision_layers(model)[layer].register_forward_hook(hook)
    try:
        model(**inp)
    finally:
        h.remove()
    return captured[0]


def test_v_keeps_cls_at_position_zero_unchanged_by_compress(model: nn.Module) -> None:
    inp = inputs(model, batch=2, seed=15)
    ref = _layer_output(model, 2, inp)
    with ficoco.apply(model, "v", keep=8) as handle:
        first = _layer_output(model, 2, inp)
        last = _layer_output(model, 4, inp)
        kept = handle.records[-1].kept
    assert first.shape[1] == 1 + PATCHES - handle.schedule.removed_at()[2]
    assert last.shape[1] == 1 + 8 and kept.shape == (2, 8)
    # [CLS] attended to every patch before the first reduction and received nothing: the
    # reducing layer's output at position 0 is the unpatched one (probe vs SDPA rounding).
    torch.testing.assert_close(first[:, 0], ref[:, 0], atol=1e-5, rtol=0)
    assert (first[:, 1:] - ref[:, 0:1]).abs().amax(dim=2).min() > 1e-3  # no patch looks like [CLS]


def test_v_equivalent_token_path_runs_and_scores_differently(model: nn.Module) -> None:
    inp = inputs(model, batch=2, seed=16)
    kept = {}
    for equivalent in (False, True):
        with ficoco.apply(model, "v", keep=8, equivalent_token=equivalent) as handle:
            logits = model(**inp).logits
            assert handle.hyperparameters.equivalent_token is equivalent
            assert logits.shape[1] == TEXT + 8 and bool(torch.isfinite(logits).all())
            check_records(handle.records, "vision", handle.schedule, batch=2)
            kept[equivalent] = [r.kept for r in handle.records]
    assert any(not torch.equal(a, b) for a, b in zip(kept[False], kept[True], strict=True))


# -- 8. attention probabilities only in reducing layers ---------------------------------------

@pytest.mark.parametrize(("variant", "how"), [("v", {2: 10, 4: 20}), ("l", {1: 5, 3: 30})])
def test_probe_only_in_reducing_layers_others_stay_sdpa(model: nn.Module, variant: str, how: dict) -> None:
    state: dict[tuple[str, int], tuple[str, bool]] = {}
    hooks = []
    for stage, layers in (("vision", vision_layers(model)), ("llm", decoder_layers(model))):
        for i, layer in enumerate(layers):
            def hook(module: nn.Module, args: tuple, _key: tuple = (stage, i)) -> None:
                attn = module.self_attn
                state[_key] = (attn.config._attn_implementation, hasattr(attn, slot))

            hooks.append(layer.register_forward_pre_hook(hook))
    stage = "vision" if variant == "v" else "llm"
    # V's probe is the tower's hook point (shared with ToMe, VisionZip, ...), L's the decoder's.
    implementation, slot = ("ficoco_tower_rows", "_ficoco_tower") if variant == "v" else \
        (PROBE_IMPLEMENTATION, "_ficoco_probe")
    try:
        with ficoco.apply(model, variant, schedule=how), probe_calls(implementation, slot) as calls:
            model(**inputs(model, batch=2, seed=17))
    finally:
        for h in hooks:
            h.remove()
    assert len(state) == len(vision_layers(model)) + len(decoder_layers(model))
    probe = implementation
    for (where, i), (implementation, probed) in state.items():
        reducing = where == stage and i in how
        assert implementation == (probe if reducing else "sdpa"), (where, i)
        assert probed is reducing, (where, i)
    layers = vision_layers(model) if variant == "v" else decoder_layers(model)
    assert [(m, armed) for m, armed in calls] == [(layers[i].self_attn, True) for i in sorted(how)]
    assert model.config.text_config._attn_implementation == "sdpa"
    assert model.config.vision_config._attn_implementation == "sdpa"


def test_l_probe_armed_once_per_reducing_layer_in_prefill_never_in_decode(model: nn.Module) -> None:
    inp = inputs(model, seed=18)
    with ficoco.apply(model, "l", keep=8) as handle:
        reducing = sorted(handle.schedule.removed_at())
        with probe_calls() as calls:
            greedy(model, inp, new=4)
    prefill, decode = calls[:len(reducing)], calls[len(reducing):]
    assert prefill == [(decoder_layers(model)[i].self_attn, True) for i in reducing]
    # Three decode steps: the probe only delegates to the model's own implementation.
    assert decode == [(decoder_layers(model)[i].self_attn, False) for i in reducing] * 3


def test_v_probe_armed_once_per_reducing_layer_per_image_forward(model: nn.Module) -> None:
    with ficoco.apply(model, "v", keep=8) as handle, probe_calls("ficoco_tower_rows", "_ficoco_tower") as calls:
        greedy(model, inputs(model, batch=2, seed=19), new=4)
    reducing = sorted(handle.schedule.removed_at())
    assert calls == [(vision_layers(model)[i].self_attn, True) for i in reducing]


# -- 9. hyperparameters on the handle; independent models -------------------------------------

def test_hyperparameters_default_to_paper_and_live_on_the_handle(model: nn.Module) -> None:
    inp = inputs(model, batch=2, seed=20)
    with ficoco.apply(model, "v", keep=8) as handle:
        model(**inp)
        default_kept = [r.kept for r in handle.records]
    params = handle.hyperparameters
    assert params == Hyperparameters()
    assert (params.lam, params.beta, params.gamma, params.eps) == (0.35, 0.6, 0.6, 0.998)
    assert (params.window, params.coefficient, params.equivalent_token) == (2, 2.0, False)
    with ficoco.apply(model, "v", keep=8, lam=0.5) as handle:
        model(**inp)
        assert handle.hyperparameters.lam == 0.5 and handle.hyperparameters.beta == 0.6
        lam_kept = [r.kept for r in handle.records]
    assert any(not torch.equal(a, b) for a, b in zip(default_kept, lam_kept, strict=True))
    l_runs = {}
    for params in ({}, {"beta": 0.0}, {"gamma": 1.0}):
        with ficoco.apply(model, "l", keep=8, **params) as handle:
            assert all(getattr(handle.hyperparameters, k) == v for k, v in params.items())
            l_runs[tuple(params)] = (model(**inp).logits, [r.kept for r in handle.records])
    (base_logits, base_kept), (_, beta_kept), (gamma_logits, _) = l_runs.values()
    assert any(not torch.equal(a, b) for a, b in zip(base_kept, beta_kept, strict=True))
    assert not torch.equal(base_logits, gamma_logits)  # gamma weighs how discarded tokens are folded in
    with ficoco.apply(model, "v", keep=8) as handle:  # nothing global was changed
        assert handle.hyperparameters == Hyperparameters()
        model(**inp)
        assert all(torch.equal(a, r.kept) for a, r in zip(default_kept, handle.records, strict=True))


def test_unknown_hyperparameter_raises(model: nn.Module) -> None:
    attrs = instance_attributes(model)
    with pytest.raises(FicocoError, match="unknown hyperparameter"):
        ficoco.apply(model, "v", keep=8, lambda_=0.5)
    assert instance_attributes(model) == attrs


def test_two_models_patched_with_different_variants_do_not_interfere(model: nn.Module,
                                                                      gqa_model: nn.Module) -> None:
    a_in, b_in = inputs(model, batch=2, seed=21), inputs(gqa_model, batch=2, seed=22)
    with ficoco.apply(model, "v", keep=8) as ha:
        a_ref, a_rec = model(**a_in).logits, [r.kept for r in ha.records]
    with ficoco.apply(gqa_model, "l", keep=8) as hb:
        b_ref, b_rec = gqa_model(**b_in).logits, [r.kept for r in hb.records]
        b_tokens = greedy(gqa_model, b_in, new=4)
    with ficoco.apply(model, "v", keep=8) as ha, ficoco.apply(gqa_model, "l", keep=8) as hb:
        a1 = model(**a_in).logits
        b1 = gqa_model(**b_in).logits
        a2 = model(**a_in).logits
        assert all(r.stage == "vision" for r in ha.records) and all(r.stage == "llm" for r in hb.records)
        assert all(torch.equal(x, r.kept) for x, r in zip(a_rec, ha.records, strict=True))
        assert all(torch.equal(x, r.kept) for x, r in zip(b_rec, hb.records, strict=True))
        b2 = greedy(gqa_model, b_in, new=4)
    assert torch.equal(a1, a_ref) and torch.equal(a2, a_ref)
    assert torch.equal(b1, b_ref) and torch.equal(b2, b_tokens)
    assert a1.shape[1] == b1.shape[1] == TEXT + 8


# -- 10. LLaVA-1.5-7B at reduced depth ----------------------------------------------------------

@pytest.fixture(scope="module")
def llava7b() -> Iterator[nn.Module]:
    built = ficoco.build_model("llava-1.5-7b", dtype="fp32", overrides=[
        "text_config.num_hidden_layers=2", "vision_config.num_hidden_layers=4", "text_config.vocab_size=32064"])
    yield built
    del built


@pytest.mark.shapes_7b
@pytest.mark.parametrize(("variant", "how"), [("v", {1: 200, 2: 300}), ("l", {1: 500})])
def test_llava_7b_reduced_depth_prefill_and_generate_follow_schedule(llava7b: nn.Module, variant: str,
                                                                     how: dict) -> None:
    arch7 = architecture(profile_of(llava7b, "llava-1.5-7b"))
    inp = inputs(llava7b, seed=23)
    assert inp["input_ids"].shape[1] == TEXT + 576
    with ficoco.apply(llava7b, variant, schedule=how) as handle, entering_tokens(llava7b) as seen:
        out = llava7b.generate(**inp, max_new_tokens=4, do_sample=False, output_logits=True,
                               return_dict_in_generate=True)
        records = list(handle.records)
    plan = plan_tokens(arch7, handle.schedule, text_tokens=TEXT)
    assert plan.visual_tokens == 76
    for i in range(4):
        assert seen["vision"][i] == [plan.vision[i][0]], f"vision layer {i}"
    for i in range(2):
        assert seen["llm"][i] == [plan.llm[i][0]] + [1] * 3, f"decoder layer {i}"
    assert [r.layer for r in records] == sorted(how)
    assert records[-1].kept.shape == (1, 76)
    # Both give back the caller's prompt (V ran a shortened one), then the new tokens.
    assert out.sequences.shape[1] == TEXT + 576 + 4
    assert torch.equal(out.sequences[:, :TEXT + 576], inp["input_ids"])
    assert all(bool(torch.isfinite(x).all()) for x in out.logits)


# -- 11. bad use raises FicocoError -------------------------------------------------------------

@pytest.mark.parametrize(("variant", "how", "message"), [
    ("x", {"keep": 8}, "variant must be one of"),
    ("v", {"keep": 100}, "not reachable"),
    ("l", {"keep": 100}, "outside"),
    ("v", {"schedule": {5: 10}}, "outside the vision tower's reducing layers 0..4"),
    ("l", {"schedule": {0: 5}}, "outside the decoder's reducing layers 1..3"),
    ("l", {"schedule": {4: 5}}, "outside the decoder's reducing layers 1..3"),
    ("v", {"schedule": {2: 40, 3: 30}}, "removes more visual tokens than exist"),
    ("v", {"keep": 8, "tflops": 1.0}, "give one of"),
])
def test_bad_arguments_raise_ficoco_error(model: nn.Module, variant: str, how: dict, message: str) -> None:
    attrs = instance_attributes(model)
    with pytest.raises(FicocoError, match=message):
        ficoco.apply(model, variant, **how)
    assert instance_attributes(model) == attrs


def test_schedule_of_the_other_variant_raises(model: nn.Module, arch: Any) -> None:
    with pytest.raises(FicocoError, match="is for variant 'l'"):
        ficoco.apply(model, "v", schedule=make_schedule(arch, "l", {1: 5}))


def test_model_that_is_not_llava_raises() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=2, vocab_size=32)
    with pytest.raises(FicocoError, match="'llama' is not supported"):
        ficoco.apply(LlamaForCausalLM(config), "l", keep=8)


def test_module_without_config_raises_ficoco_error() -> None:
    with pytest.raises(FicocoError, match="Linear"):
        ficoco.apply(nn.Linear(2, 2), "v", keep=8)


@pytest.mark.parametrize(("variant", "message"), [("l", "same number of image tokens"),
                                                  ("v", "same number of images")])
def test_batch_with_unequal_image_token_counts_raises(model: nn.Module, variant: str, message: str) -> None:
    good = inputs(model, batch=2, seed=24)
    bad = {k: v.clone() for k, v in good.items()}
    bad["input_ids"][1, PREFIX_TOKENS + PATCHES - 1] = 7  # one placeholder fewer in sample 1
    with ficoco.apply(model, variant, keep=8) as handle:
        with pytest.raises(FicocoError, match=message):
            model(**bad)
        out = model(**good).logits  # the handle recovers on the next good batch
        assert out.shape[1] == TEXT + 8
        assert len(handle.records) == 3
