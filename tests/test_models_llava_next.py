"""FiCoCo-V / FiCoCo-L inside Hugging Face LLaVA-NeXT (AnyRes), end to end (issue 7).

Random seeded llava-next-tiny models in fp32 on CPU: a CLIP tower of 6 layers over 56 px items
(a 4 x 4 patch grid; V reduces in layers 0..4), a LLaMA decoder of 4 layers (L reduces in 1..3).
The default 112 x 112 image is a base view and 2 x 2 crops (5 items); the crops' 8 x 8 grid
keeps every patch after unpadding and gets one newline per row: 16 + 64 + 8 = 88 visual tokens.
Prompts are 12 text tokens around the image span.
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
from ficoco.accounting.schedule import plan_tokens
from ficoco.api import profile_of
from ficoco.errors import FicocoError
from ficoco.methods.ficoco_l.ops import reduce_l
from ficoco.models import adapter_for
from ficoco.models.build import _hf_config
from ficoco.models.llava_next import PREFIX_TOKENS, image_layout, synthetic_inputs
from ficoco.profiles import load_profile
from ficoco.profiling.verify import verify

TEXT = 12  # text tokens per prompt
SIDE = 4  # patches per item side
PATCHES = SIDE * SIDE
ITEMS = 5  # base view + 2 x 2 crops
ROWS = COLS = 2 * SIDE  # the crops' patch grid
VISUAL = PATCHES + ROWS * COLS + ROWS  # 88
IMAGE_TOKEN = 300  # profiles/llava-next-tiny.json image_token_index
NEW = 8  # generated tokens
# Offsets of the newline tokens inside the unreduced span: the end of every row of the crop grid.
NEWLINES = [PATCHES + (row + 1) * (COLS + 1) - 1 for row in range(ROWS)]


# -- fixtures and helpers ---------------------------------------------------------------------

TINY_PROFILE = "llava-next-tiny"  # built as this module's `model` (conftest.py)


@pytest.fixture(scope="module")
def arch(model: nn.Module) -> Any:
    return architecture(profile_of(model, "llava-next-tiny"))


def inputs(model: nn.Module, batch: int = 1, seed: int = 0, **kwargs: Any) -> dict[str, Tensor]:
    return synthetic_inputs(model, batch=batch, text_tokens=TEXT, seed=seed, **kwargs)


def sample(batch: dict[str, Tensor], i: int) -> dict[str, Tensor]:
    return {k: v[i:i + 1] for k, v in batch.items()}


def greedy(model: nn.Module, inp: dict[str, Tensor], new: int = NEW) -> Tensor:
    return model.generate(**inp, max_new_tokens=new, do_sample=False)


def vision_layers(model: nn.Module) -> nn.ModuleList:
    return model.model.vision_tower.encoder.layers


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    return model.model.language_model.layers


def v_keep(kept_per_item: int) -> int:
    """Visual tokens reaching the LLM when FiCoCo-V keeps `kept_per_item` patches of every item."""
    return ITEMS * kept_per_item + ROWS


@contextlib.contextmanager
def entering_tokens(model: nn.Module) -> Iterator[dict[str, dict[int, list[tuple[int, int]]]]]:
    """Record (batch rows, tokens) at the entry of every CLIP and decoder layer and of its MLP."""
    seen: dict[str, dict[int, list[tuple[int, int]]]] = {
        k: defaultdict(list) for k in ("vision", "llm", "vision-mlp", "llm-mlp")}
    hooks = []
    for stage, layers in (("vision", vision_layers(model)), ("llm", decoder_layers(model))):
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


@contextlib.contextmanager
def llm_inputs(model: nn.Module) -> Iterator[dict[str, Tensor]]:
    """The projector's output (items, k, D) and the decoder's input embeddings of the next forward."""
    captured: dict[str, Tensor] = {}

    def projector(module: nn.Module, args: tuple, output: Tensor) -> None:
        captured["projected"] = output

    def decoder(module: nn.Module, args: tuple, kwargs: dict) -> None:
        captured.setdefault("embeds", kwargs["inputs_embeds"])

    hooks = [model.model.multi_modal_projector.register_forward_hook(projector),
             model.model.language_model.register_forward_pre_hook(decoder, with_kwargs=True)]
    try:
        yield captured
    finally:
        for h in hooks:
            h.remove()


# -- 1. inputs and layouts as the processor and the model make them -----------------------------

def test_synthetic_inputs_follow_the_processor_layout_and_the_accountant(model: nn.Module, arch: Any) -> None:
    inp = inputs(model, batch=2)
    assert tuple(inp["pixel_values"].shape) == (2, ITEMS, 3, 56, 56)
    assert inp["image_sizes"].tolist() == [[112, 112], [112, 112]]
    image = inp["input_ids"] == IMAGE_TOKEN
    assert image.sum(1).tolist() == [VISUAL, VISUAL] == [arch.visual_tokens] * 2
    assert inp["input_ids"].shape[1] == TEXT + VISUAL
    assert bool(image[:, PREFIX_TOKENS:PREFIX_TOKENS + VISUAL].all())  # "USER: <image>\n..." span
    assert (arch.vision.items, arch.newline_tokens, arch.unpadding_drops) == (ITEMS, ROWS, 0)
    # The real-size profile: 672 x 672 is a base view and 2 x 2 crops of 576 patches.
    profile = load_profile("llava-next-7b")
    layout = image_layout(_hf_config(profile), (672, 672))
    assert (layout.items, layout.tokens, layout.newline_rows) == (5, 2928, 48)
    assert layout.tokens == architecture(profile).visual_tokens


@pytest.mark.parametrize("size", [(112, 112), (56, 112), (112, 56), (60, 100), (100, 60), (30, 111), (56, 56)])
def test_layout_counts_equal_the_accountants_and_packing_every_patch_equals_transformers(
        model: nn.Module, size: tuple[int, int]) -> None:
    layout = image_layout(model.config, size)
    arch = architecture(load_profile("llava-next-tiny"), image_size=size)
    assert (layout.items, layout.tokens) == (arch.vision.items, arch.visual_tokens)
    assert (layout.newline_rows, layout.unpadding_drops) == (arch.newline_tokens, arch.unpadding_drops)
    features = torch.randn(layout.items, PATCHES, 8)
    newline = torch.randn(8)
    expected = model.model.pack_image_features([features], torch.tensor([size]), "default", newline)[0][0]
    everything = torch.arange(PATCHES).expand(layout.items, -1)
    assert torch.equal(layout.pack(features, everything, newline), expected)
    assert int(layout.newline_flags().sum()) == layout.newline_rows
    assert torch.equal(expected[layout.newline_flags()], newline.expand(layout.newline_rows, -1))


# -- 2. an empty schedule is the unpatched model ----------------------------------------------

@pytest.mark.parametrize("variant", ["v", "l"])
def test_empty_schedule_logits_and_generate_equal_unpatched(model: nn.Module, variant: str) -> None:
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


@pytest.mark.parametrize("variant", ["v", "l"])
def test_remove_restores_the_model_and_its_packing(model: nn.Module, variant: str) -> None:
    inp = inputs(model, batch=2, seed=1)
    before = model(**inp).logits
    attrs = {name: set(module.__dict__) for name, module in model.named_modules()}
    with ficoco.apply(model, variant, keep=v_keep(4)):
        reduced = model(**inp).logits
        assert ("pack_image_features" in model.model.__dict__) is (variant == "v")
    assert reduced.shape[1] == TEXT + v_keep(4) or variant == "l"
    assert {name: set(module.__dict__) for name, module in model.named_modules()} == attrs
    assert torch.equal(model(**inp).logits, before)


# -- 3. tokens every layer processes == the schedule's plan -----------------------------------

SCHEDULES = [
    ("v", {"keep": v_keep(8)}),
    ("v", {"schedule": {2: 4, 4: 6}}),
    ("v", {"keep": v_keep(3), "shape": "oneshot", "first_layer": 0}),
    ("l", {"keep": 40}),
    ("l", {"schedule": {1: 20, 3: 30}}),
    ("l", {"keep": ROWS + 1, "shape": "oneshot"}),  # every token but the newlines and one more
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
    assert plan.vision_items == ITEMS
    for i in range(len(vision_layers(model))):  # every item of every sample is a batch row
        assert seen["vision"][i] == [(batch * ITEMS, plan.vision[i][0])], f"vision layer {i}"
        assert seen["vision-mlp"][i] == [(batch * ITEMS, plan.vision[i][1])], f"vision layer {i} MLP"
    for i in range(len(decoder_layers(model))):
        assert seen["llm"][i] == [(batch, plan.llm[i][0])], f"decoder layer {i}"
        assert seen["llm-mlp"][i] == [(batch, plan.llm[i][1])], f"decoder layer {i} MLP"
    removed = handle.schedule.removed_at()
    assert [r.layer for r in records] == sorted(removed)
    if variant == "v":
        assert logits.shape[1] == TEXT + plan.llm_visual_tokens == TEXT + handle.keep_per_image
        left = PATCHES - handle.schedule.total_removed
        assert plan.llm_visual_tokens == v_keep(left)
        assert tuple(records[-1].kept.shape) == (batch * ITEMS, left)
    else:
        assert logits.shape[1] == plan.llm[-1][1] == TEXT + plan.visual_tokens
        assert tuple(records[-1].kept.shape) == (batch, VISUAL - handle.schedule.total_removed)
    if "keep" in how:
        assert plan.visual_tokens == how["keep"]


# -- 4. batches: every sample as if alone -------------------------------------------------------

@pytest.mark.parametrize(("variant", "params"), [("v", {}), ("l", {}), ("l", {"beta": 0.0})],
                         ids=["v", "l", "l-beta0"])
def test_batch_gives_each_sample_its_batch_of_one_result(model: nn.Module, variant: str, params: dict) -> None:
    batch = inputs(model, batch=2, seed=4)
    keep = v_keep(6) if variant == "v" else 30
    with ficoco.apply(model, variant, keep=keep, **params) as handle:
        together = model(**batch).logits
        kept_together = [r.kept for r in handle.records]
        for i in range(2):
            alone = model(**sample(batch, i)).logits
            torch.testing.assert_close(together[i:i + 1], alone, atol=1e-5, rtol=0)
            rows = slice(i * ITEMS, (i + 1) * ITEMS) if variant == "v" else slice(i, i + 1)
            for rec, kept in zip(handle.records, kept_together, strict=True):
                assert torch.equal(rec.kept, kept[rows])
    assert not torch.allclose(together[0], together[1], atol=1e-3)


# -- 5. generation after a reduced prefill ------------------------------------------------------

@pytest.mark.parametrize("variant", ["v", "l"])
def test_generate_after_reduced_prefill_batch_equals_samples_alone(model: nn.Module, arch: Any,
                                                                   variant: str) -> None:
    batch = inputs(model, batch=2, seed=6)
    length = batch["input_ids"].shape[1]
    keep = v_keep(5)
    with ficoco.apply(model, variant, keep=keep) as handle:
        with entering_tokens(model) as seen:
            together = greedy(model, batch)
        plan = plan_tokens(arch, handle.schedule, text_tokens=TEXT)
        prefill_last = model(**batch).logits[:, -1]
        alone = [greedy(model, sample(batch, i)) for i in range(2)]
    # Both give back the caller's own prompt (V ran it with the image span shortened).
    prompt = length
    assert together.shape == (2, prompt + NEW)
    assert torch.equal(together[:, :prompt], batch["input_ids"])
    for i in range(2):
        assert torch.equal(together[i:i + 1], alone[i])
    assert torch.equal(together[:, prompt], prefill_last.argmax(-1))
    for i in range(len(vision_layers(model))):
        assert seen["vision"][i] == [(2 * ITEMS, plan.vision[i][0])], f"vision layer {i}: the tower runs once"
    for i in range(len(decoder_layers(model))):
        assert seen["llm"][i] == [(2, plan.llm[i][0])] + [(2, 1)] * (NEW - 1), f"decoder layer {i}"


# -- 6. FiCoCo-L: newline tokens are visual tokens that never leave ------------------------------

@pytest.mark.parametrize("params", [{}, {"beta": 0.0}, {"beta": 1.0}], ids=["default", "beta0", "beta1"])
def test_l_never_removes_newline_tokens(model: nn.Module, params: dict) -> None:
    inp = inputs(model, batch=2, seed=8)
    with ficoco.apply(model, "l", schedule={1: 30, 2: 30, 3: VISUAL - 60 - ROWS - 1}, **params) as handle:
        model(**inp)
        records = list(handle.records)
    newline = torch.tensor(NEWLINES)
    for rec in records:
        assert not bool(torch.isin(rec.discarded, newline).any()), f"layer {rec.layer} removed a newline"
        assert bool(torch.isin(newline, rec.kept[0]).all() and torch.isin(newline, rec.kept[1]).all())
    # The last layer keeps the newlines and exactly one other visual token.
    assert tuple(records[-1].kept.shape) == (2, ROWS + 1)


def test_l_protects_newlines_of_a_non_square_image(model: nn.Module) -> None:
    """60 x 100 px: unpadding drops crop rows (FiCoCo-V refuses it), FiCoCo-L reduces the span
    and keeps every newline."""
    inp = inputs(model, batch=2, seed=9, image_size=(60, 100))
    layout = image_layout(model.config, (60, 100))
    assert layout.unpadding_drops > 0
    assert int((inp["input_ids"][0] == IMAGE_TOKEN).sum()) == layout.tokens
    newline = torch.nonzero(layout.newline_flags()).flatten()
    removable = layout.tokens - newline.numel()
    with ficoco.apply(model, "l", keep=newline.numel() + 1, image_size=(60, 100)) as handle, \
            entering_tokens(model) as seen:
        logits = model(**inp).logits
        plan = plan_tokens(architecture(profile_of(model), image_size=(60, 100)), handle.schedule, text_tokens=TEXT)
        assert [seen["llm"][i] for i in range(4)] == [[(2, n_in)] for n_in, _ in plan.llm]
        tokens = greedy(model, inp, new=3)
    assert handle.schedule.total_removed == removable - 1
    assert logits.shape[1] == inp["input_ids"].shape[1] - removable + 1
    assert tokens.shape == (2, inp["input_ids"].shape[1] + 3)
    kept = handle.records[-1].kept
    assert kept.shape == (2, newline.numel() + 1)
    assert all(bool(torch.isin(newline, kept[i]).all()) for i in range(2))
    with ficoco.apply(model, "v", keep=v_keep(8)), pytest.raises(FicocoError, match="unpadding"):
        model(**inp)


def test_reduce_l_never_selects_protected_tokens_even_the_most_redundant() -> None:
    torch.manual_seed(0)
    batch, seq, num_visual, start = 2, 20, 12, 3
    hidden = torch.randn(batch, seq, 8)
    attn = torch.softmax(torch.randn(batch, seq, seq).masked_fill(torch.ones(seq, seq).triu(1).bool(), -1e9), -1)
    suffix = torch.zeros(batch, seq, dtype=torch.bool)
    suffix[:, start + num_visual:] = True
    visual_start = torch.full((batch,), start)
    plain = reduce_l(hidden, attn, 4, visual_start, num_visual, suffix)
    protected = torch.zeros(batch, num_visual, dtype=torch.bool)
    protected[torch.arange(batch)[:, None], plain.discarded_visual[:, :2]] = True  # the most redundant ones
    guarded = reduce_l(hidden, attn, 4, visual_start, num_visual, suffix, protected=protected)
    assert not bool(torch.isin(plain.discarded_visual[:, :2], guarded.discarded_visual).any())
    assert guarded.kept_visual.shape == (batch, num_visual - 4)
    with pytest.raises(FicocoError, match="protected"):
        reduce_l(hidden, attn, num_visual - 1, visual_start, num_visual, suffix, protected=protected)


# -- 7. FiCoCo-V: reduced crops packed in the unreduced order -----------------------------------

@pytest.mark.parametrize("size", [(112, 112), (56, 112), (60, 100), (100, 60)])
def test_v_packing_keeps_the_unreduced_relative_order_and_every_newline(model: nn.Module,
                                                                        size: tuple[int, int]) -> None:
    layout = image_layout(model.config, size)
    generator = torch.Generator().manual_seed(10)
    # Feature = (item, grid index) so that every packed token says where it came from.
    ids = (torch.arange(layout.items)[:, None] * 100 + torch.arange(PATCHES)[None]).float()
    features = ids[..., None].expand(-1, -1, 2).clone()
    newline = torch.full((2,), -1.0)
    full = model.model.pack_image_features([features], torch.tensor([size]), "default", newline)[0][0][:, 0]
    for kept_per_item in (1, 5, 11):
        kept = torch.stack([torch.randperm(PATCHES, generator=generator)[:kept_per_item].sort().values
                            for _ in range(layout.items)])
        reduced = torch.gather(features, 1, kept[..., None].expand(-1, -1, 2))
        packed = layout.pack(reduced, kept, newline)[:, 0]
        kept_ids = torch.gather(ids, 1, kept).flatten()
        expected = full[torch.isin(full, kept_ids) | (full == -1)]
        assert torch.equal(packed, expected)
        assert int((packed == -1).sum()) == layout.newline_rows  # rows that lost tokens keep their newline
        if not layout.unpadding_drops:
            assert packed.numel() == layout.reduced_tokens(kept_per_item)


def test_v_image_span_is_the_kept_tokens_in_packed_order_with_a_newline_per_row(model: nn.Module) -> None:
    batch = 2
    inp = inputs(model, batch=batch, seed=11)
    with ficoco.apply(model, "v", schedule={1: 3, 3: 6}) as handle, llm_inputs(model) as seen:
        model(**inp)
        kept_grid = handle.records[-1].kept  # (batch * items, 7) original grid indices
    kept = PATCHES - 9
    projected = seen["projected"]
    assert tuple(projected.shape[:2]) == (batch * ITEMS, kept)
    span = seen["embeds"][:, PREFIX_TOKENS:PREFIX_TOKENS + v_keep(kept)]
    newline = model.model.image_newline
    for b in range(batch):
        items = slice(b * ITEMS, (b + 1) * ITEMS)
        grid, features = kept_grid[items], projected[items]
        expected = [features[0]]  # the base view first, in grid order
        by_row: dict[int, list[tuple[int, Tensor]]] = defaultdict(list)
        for crop in range(4):
            for j, g in enumerate(grid[crop + 1].tolist()):
                row = (crop // 2) * SIDE + g // SIDE
                col = (crop % 2) * SIDE + g % SIDE
                by_row[row].append((col, features[crop + 1, j]))
        for row in range(ROWS):
            expected += [f[None] for _, f in sorted(by_row[row], key=lambda x: x[0])] + [newline[None]]
        torch.testing.assert_close(span[b], torch.cat(expected), atol=0, rtol=0)


def test_v_runs_on_a_non_square_image_whose_unpadding_drops_nothing(model: nn.Module) -> None:
    """56 x 112 px: a base view and 1 x 2 crops, no unpadding. Planned at that size, the budget
    counts its 3 items; planned at the profile's 112 x 112, the span still shrinks to the
    image's own reduced count."""
    size = (56, 112)
    inp = inputs(model, batch=2, seed=12, image_size=size)
    layout = image_layout(model.config, size)
    assert (layout.items, layout.unpadding_drops, layout.newline_rows) == (3, 0, 4)
    with ficoco.apply(model, "v", keep=3 * 6 + 4, image_size=size) as handle, entering_tokens(model) as seen:
        logits = model(**inp).logits
    plan = plan_tokens(architecture(profile_of(model), image_size=size), handle.schedule, text_tokens=TEXT)
    assert (plan.vision_items, plan.llm_visual_tokens, handle.keep_per_image) == (3, 3 * 6 + 4, 3 * 6 + 4)
    assert [seen["vision"][i] for i in range(6)] == [[(2 * 3, n_in)] for n_in, _ in plan.vision]
    assert [seen["llm"][i] for i in range(4)] == [[(2, n_in)] for n_in, _ in plan.llm]
    assert logits.shape[1] == TEXT + 3 * 6 + 4
    with ficoco.apply(model, "v", keep=v_keep(6)) as handle:  # planned at 112 x 112
        logits = model(**inp).logits
        tokens = greedy(model, inp, new=3)
        assert tuple(handle.records[-1].kept.shape) == (2 * 3, 6)
    assert logits.shape[1] == TEXT + 3 * 6 + 4
    assert tokens.shape == (2, inp["input_ids"].shape[1] + 3)
    assert torch.equal(tokens[:, :-3], inp["input_ids"])


def test_v_refuses_placeholder_counts_that_fit_no_layout(model: nn.Module) -> None:
    bad = inputs(model, batch=2, seed=13)
    bad["input_ids"][:, PREFIX_TOKENS] = 7  # one placeholder fewer per sample
    with ficoco.apply(model, "v", keep=v_keep(4)), pytest.raises(FicocoError, match="image placeholders"):
        model(**bad)


# -- 8. the accountant's counts are what runs ---------------------------------------------------

def test_verify_passes_on_tiny_for_vanilla_v_and_l(model: nn.Module, arch: Any) -> None:
    from ficoco.accounting.schedule import schedule_for_keep

    schedules = [schedule_for_keep(arch, variant, v_keep(8)) for variant in ("vanilla", "v", "l")]
    result = verify(load_profile("llava-next-tiny"), schedules, tolerance_percent=0.1, model=model)
    assert result.passed, result.to_json()
    assert [run.plan.visual_tokens for run in result.runs] == [VISUAL, v_keep(8), v_keep(8)]
    for run in result.runs:
        assert run.skipped_matrix_ops == []
        assert all(abs(stage.fvcore_diff) <= 1e-3 for stage in run.stages)
    assert isinstance(adapter_for(model), ficoco.models.llava_next.LlavaNextAdapter)
    assert "pack_image_features" not in model.model.__dict__  # the tracing stand-in is gone


def test_verify_passes_on_an_image_whose_unpadding_drops_tokens() -> None:
    """The projector runs before unpadding: it also projects the crop tokens unpadding drops."""
    from ficoco.accounting.schedule import schedule_for_keep
    from ficoco.profiles import set_layout

    profile = load_profile("llava-next-tiny")
    set_layout(profile, image_size=(60, 100))
    arch = architecture(profile)
    assert arch.unpadding_drops > 0
    schedules = [schedule_for_keep(arch, variant, arch.newline_tokens + 10) for variant in ("vanilla", "l")]
    result = verify(profile, schedules, tolerance_percent=0.1)
    assert result.passed, result.to_json()
    projector = [next(s for s in run.stages if s.stage == "projector") for run in result.runs]
    assert all(s.analytic == s.fvcore > 0 for s in projector)
