"""FiCoCo-V / FiCoCo-L inside Hugging Face Qwen2-VL, end to end (issue 7).

A random seeded qwen2-vl-tiny model in fp32 on CPU: a ViT of 6 blocks without [CLS] over a
112 x 112 image (8 x 8 patches, 16 merge groups of 2 x 2, so 16 LLM tokens; V reduces in
blocks 0..5), and a Qwen2 decoder of 4 layers with 3-D rotary positions (L reduces in layers
1..3); prompts are 12 text tokens of the chat template around one image span.
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

import ficoco
from ficoco.accounting import architecture
from ficoco.accounting.schedule import Schedule, make_schedule, plan_tokens
from ficoco.api import profile_of
from ficoco.errors import FicocoError
from ficoco.models.hf_compat import cache_argument, output_cache
from ficoco.models.qwen2_vl import PREFIX_TOKENS, synthetic_inputs
from ficoco.profiles import load_profile
from ficoco.profiling.verify import verify

TEXT = 12  # text tokens per prompt
GROUPS = 16  # 4 x 4 merge groups of the 8 x 8 patch grid = LLM visual tokens
PATCHES = 64
GRID_W = 8
IMAGE_TOKEN = 300  # profiles/qwen2-vl-tiny.json image_token_id
NEW = 8  # generated tokens


# -- fixtures and helpers ---------------------------------------------------------------------

TINY_PROFILE = "qwen2-vl-tiny"  # built as this module's `model` (conftest.py)


@pytest.fixture(scope="module")
def arch(model: nn.Module) -> Any:
    return architecture(profile_of(model, "qwen2-vl-tiny"))


def inputs(model: nn.Module, batch: int = 1, seed: int = 0, **kwargs: Any) -> dict[str, Tensor]:
    return synthetic_inputs(model, batch=batch, text_tokens=TEXT, seed=seed, **kwargs)


def sample(batch: dict[str, Tensor], i: int) -> dict[str, Tensor]:
    """Sample `i` of a batch of one image per sample (pixel rows are per patch)."""
    patches = batch["pixel_values"].shape[0] // batch["input_ids"].shape[0]
    return {k: v[i * patches:(i + 1) * patches] if k == "pixel_values" else v[i:i + 1] for k, v in batch.items()}


def greedy(model: nn.Module, inp: dict[str, Tensor], new: int = NEW, **kwargs: Any) -> Any:
    # min_new_tokens: random weights may emit EOS early, which would end samples unevenly.
    return model.generate(**inp, max_new_tokens=new, min_new_tokens=new, do_sample=False, **kwargs)


def vision_layers(model: nn.Module) -> nn.ModuleList:
    return model.model.visual.blocks


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    return model.model.language_model.layers


@contextlib.contextmanager
def entering_tokens(model: nn.Module, images: int) -> Iterator[dict[str, dict[int, list[int]]]]:
    """Tokens at the entry of every ViT block (per image: the tower runs all images as one
    flat sequence) and decoder layer, per call, and at the entry of each one's MLP."""
    seen: dict[str, dict[int, list[int]]] = {k: defaultdict(list) for k in ("vision", "llm", "vision-mlp", "llm-mlp")}
    hooks = []
    for stage, layers in (("vision", vision_layers(model)), ("llm", decoder_layers(model))):
        dim = 0 if stage == "vision" else 1
        per = images if stage == "vision" else 1
        for i, layer in enumerate(layers):
            def hook(module: nn.Module, args: tuple, kwargs: dict, _s: str = stage, _i: int = i, _d: int = dim,
                     _p: int = per) -> None:
                hidden = args[0] if args else kwargs["hidden_states"]
                seen[_s][_i].append(hidden.shape[_d] // _p)

            def mlp_hook(module: nn.Module, args: tuple, _s: str = stage, _i: int = i, _d: int = dim,
                         _p: int = per) -> None:
                seen[f"{_s}-mlp"][_i].append(args[0].shape[_d] // _p)

            hooks.append(layer.register_forward_pre_hook(hook, with_kwargs=True))
            hooks.append(layer.mlp.register_forward_pre_hook(mlp_hook))
    try:
        yield seen
    finally:
        for h in hooks:
            h.remove()


@contextlib.contextmanager
def captured_kwargs(module: nn.Module, *names: str) -> Iterator[list[dict[str, Any]]]:
    calls: list[dict[str, Any]] = []

    def hook(mod: nn.Module, args: tuple, kwargs: dict) -> None:
        calls.append({name: kwargs.get(name) for name in names})

    h = module.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        yield calls
    finally:
        h.remove()


def groups_of(patches: Tensor) -> Tensor:
    """Merge-group index (row-major on the 4 x 4 group grid) of row-major patch indices."""
    return (patches // GRID_W // 2) * (GRID_W // 2) + (patches % GRID_W) // 2


def group_tokens(groups: Tensor) -> Tensor:
    """Indices in the ViT's token order (group-major, members consecutive) of the groups' patches."""
    return (groups[..., None] * 4 + torch.arange(4)).flatten(-2)


def check_whole_groups(records: list, schedule: Schedule, batch: int) -> None:
    """One record per reducing layer; kept/discarded are whole 2 x 2 groups and partition the
    previous kept set."""
    removed = schedule.removed_at()
    assert [r.layer for r in records] == sorted(removed)
    previous = torch.arange(PATCHES).expand(batch, -1)
    left = GROUPS
    for rec in records:
        left -= removed[rec.layer]
        assert rec.stage == "vision"
        assert tuple(rec.kept.shape) == (batch, 4 * left)
        assert tuple(rec.discarded.shape) == (batch, 4 * removed[rec.layer])
        for part in (rec.kept, rec.discarded):
            assert bool((part[:, 1:] > part[:, :-1]).all()), f"layer {rec.layer}: indices not ascending"
            # Every group present is present with all four of its patches.
            members = torch.stack([(groups_of(part) == g).sum(1) for g in range(GROUPS)], 1)
            assert bool(((members == 0) | (members == 4)).all()), f"layer {rec.layer}: a group was split"
        union = torch.cat([rec.kept, rec.discarded], dim=1).sort(dim=1).values
        assert torch.equal(union, previous), f"layer {rec.layer}: kept + discarded != the previous kept set"
        previous = rec.kept


def kept_groups(records: list, batch: int) -> list[Tensor]:
    """Per sample: the kept merge groups after the last reducing layer (all without records)."""
    if not records:
        return [torch.arange(GROUPS)] * batch
    return [groups_of(records[-1].kept[b]).unique(sorted=True) for b in range(batch)]


# -- 1. an empty schedule is the unpatched model ----------------------------------------------

@pytest.mark.parametrize("variant", ["v", "l"])
def test_empty_schedule_logits_and_generate_equal_unpatched(model: nn.Module, variant: str) -> None:
    inp = inputs(model, batch=2)
    ref_logits = model(**inp).logits
    ref_tokens = greedy(model, inp)
    with ficoco.apply(model, variant, schedule={}) as handle:
        assert "forward" in model.__dict__  # the patched entry really runs
        logits = model(**inp).logits
        tokens = greedy(model, inp)
        assert handle.records == []
    assert torch.equal(logits, ref_logits)
    assert torch.equal(tokens, ref_tokens)
    assert torch.equal(model(**inp).logits, ref_logits)  # and remove() restores it


# -- 2. tokens every layer processes == the schedule's plan -----------------------------------

SCHEDULES = [
    ("v", {"keep": 8}),
    ("v", {"keep": 4, "shape": "oneshot"}),
    ("v", {"schedule": {0: 3, 4: 5}}),
    ("l", {"keep": 8}),
    ("l", {"keep": 4, "shape": "oneshot"}),
    ("l", {"schedule": {1: 5, 3: 6}}),
]


@pytest.mark.parametrize(("variant", "how"), SCHEDULES, ids=[f"{v}-{h}" for v, h in SCHEDULES])
def test_tokens_entering_every_layer_equal_schedule_plan(model: nn.Module, arch: Any, variant: str,
                                                         how: dict) -> None:
    inp = inputs(model, batch=2, seed=3)
    with ficoco.apply(model, variant, **how) as handle, entering_tokens(model, images=2) as seen:
        logits = model(**inp).logits
        records = list(handle.records)
    plan = plan_tokens(arch, handle.schedule, text_tokens=TEXT)
    assert handle.schedule.total_removed > 0
    for i in range(len(vision_layers(model))):
        # Vision counts are tokens per image: kept groups x 4.
        assert seen["vision"][i] == [plan.vision[i][0]], f"vision layer {i}"
        assert seen["vision-mlp"][i] == [plan.vision[i][1]], f"vision layer {i}: the MLP runs on the kept tokens"
    for i in range(len(decoder_layers(model))):
        assert seen["llm"][i] == [plan.llm[i][0]], f"decoder layer {i}"
        assert seen["llm-mlp"][i] == [plan.llm[i][1]], f"decoder layer {i}: the MLP runs on the kept tokens"
    if variant == "v":
        assert logits.shape[1] == TEXT + plan.llm_visual_tokens == TEXT + handle.keep_per_image
        check_whole_groups(records, handle.schedule, batch=2)
    else:
        assert logits.shape[1] == plan.llm[-1][1] == TEXT + plan.visual_tokens
        assert [r.layer for r in records] == sorted(handle.schedule.removed_at())
    if "keep" in how:
        assert plan.visual_tokens == how["keep"]
    assert handle.reduction_seconds > 0


def test_token_counts_follow_the_image_size(model: nn.Module) -> None:
    """A 168 x 168 image is 12 x 12 patches, 36 groups: the same schedule leaves more tokens."""
    profile = profile_of(model, "qwen2-vl-tiny")
    wide = architecture(profile, image_size=(168, 168))
    assert (wide.vision.grid_h, wide.vision.grid_w, wide.visual_tokens) == (12, 12, 36)
    inp = inputs(model, batch=2, seed=30, image_size=(168, 168))
    assert int((inp["input_ids"] == IMAGE_TOKEN).sum(1)[0]) == 36
    assert tuple(inp["image_grid_thw"][0].tolist()) == (1, 12, 12)
    with ficoco.apply(model, "v", schedule={1: 4, 3: 6}) as handle, entering_tokens(model, images=2) as seen:
        logits = model(**inp).logits
    plan = plan_tokens(wide, make_schedule(wide, "v", {1: 4, 3: 6}), text_tokens=TEXT)
    assert [seen["vision"][i][0] for i in range(6)] == [n for n, _ in plan.vision]
    assert logits.shape[1] == TEXT + 36 - 10 == TEXT + plan.llm_visual_tokens
    assert handle.records[-1].kept.shape == (2, 4 * 26)


# -- 3. FiCoCo-V: whole groups, rotary table, image boundaries, 3-D positions ----------------

def test_v_removes_whole_groups_and_slices_rotary_table_and_boundaries(model: nn.Module) -> None:
    inp = inputs(model, batch=2, seed=4)
    blocks = vision_layers(model)
    with captured_kwargs(blocks[0].attn, "position_embeddings", "cu_seqlens") as first, \
            captured_kwargs(blocks[5].attn, "position_embeddings", "cu_seqlens") as last, \
            ficoco.apply(model, "v", schedule={2: 3, 4: 5}) as handle:
        model(**inp)
        records = list(handle.records)
    check_whole_groups(records, handle.schedule, batch=2)
    full_cos = first[0]["position_embeddings"][0]
    assert full_cos.shape[0] == 2 * PATCHES
    assert first[0]["cu_seqlens"].tolist() == [0, PATCHES, 2 * PATCHES]
    kept = 4 * (GROUPS - 8)
    assert last[0]["cu_seqlens"].tolist() == [0, kept, 2 * kept]  # every image loses the same groups
    rows = torch.cat([b * PATCHES + group_tokens(g) for b, g in enumerate(kept_groups(records, 2))])
    # The kept patches keep their own 2-D rotary rows, in the tower's group-major order.
    assert torch.equal(last[0]["position_embeddings"][0], full_cos[rows])
    assert torch.equal(last[0]["position_embeddings"][1], first[0]["position_embeddings"][1][rows])
    assert not torch.equal(kept_groups(records, 2)[0], kept_groups(records, 2)[1])


def test_v_kept_tokens_get_the_unreduced_prompts_3d_positions(model: nn.Module) -> None:
    inp = inputs(model, batch=2, seed=5)
    full, _ = model.model.get_rope_index(inp["input_ids"], inp["mm_token_type_ids"],
                                         image_grid_thw=inp["image_grid_thw"], attention_mask=inp["attention_mask"])
    with captured_kwargs(model.model.language_model, "position_ids") as seen, \
            ficoco.apply(model, "v", keep=6) as handle:
        model(**inp)
        groups = kept_groups(handle.records, 2)
    positions = seen[0]["position_ids"]
    assert positions.shape == (3, 2, TEXT + 6)
    for b in range(2):
        keep = torch.ones(full.shape[-1], dtype=torch.bool)
        keep[PREFIX_TOKENS:PREFIX_TOKENS + GROUPS] = False
        keep[PREFIX_TOKENS + groups[b]] = True
        assert torch.equal(positions[:, b], full[:, b, keep])
        # Independently of get_rope_index: group (row, col) of the 4 x 4 grid sits at
        # (s, s + row, s + col), s = the span's start; the text after it from s + 4 on.
        s = PREFIX_TOKENS
        image = positions[:, b, s:s + 6]
        assert torch.equal(image, torch.stack([torch.full((6,), s), s + groups[b] // 4, s + groups[b] % 4]))
        assert positions[:, b, s + 6:].tolist() == [list(range(s + 4, s + 4 + TEXT - s))] * 3


def test_remove_restores_the_model_and_v_refuses_images_with_videos_in_one_call(model: nn.Module) -> None:
    """FiCoCo-V reduces a video's temporal slices as images (tests/test_qwen_video_items.py), images and videos
    in separate calls."""
    inp = inputs(model, batch=2, seed=12)
    before = model(**inp).logits
    attrs = {name: set(module.__dict__) for name, module in model.named_modules()}
    configs = {name: module.config for name, module in model.named_modules() if name.endswith(("attn", "self_attn"))}
    for variant in ("v", "l"):
        with ficoco.apply(model, variant, keep=8):
            assert not torch.equal(model(**inp).logits[:, -1], before[:, -1])
            if variant == "v":
                assert "get_image_features" in model.model.__dict__ and "forward" in model.model.visual.__dict__
                with pytest.raises(FicocoError, match="one kind per call"):
                    model(**inp, pixel_values_videos=inp["pixel_values"])
        assert {name: set(module.__dict__) for name, module in model.named_modules()} == attrs
        assert all(module.config is configs[name] for name, module in model.named_modules() if name in configs)
    assert torch.equal(model(**inp).logits, before)


# -- 4. batches: every sample as if alone ------------------------------------------------------

@pytest.mark.parametrize(("variant", "params"), [("v", {}), ("l", {"beta": 0.0})], ids=["v", "l-beta0"])
def test_batch_gives_each_sample_its_batch_of_one_result(model: nn.Module, variant: str, params: dict) -> None:
    batch = inputs(model, batch=2, seed=6)
    with ficoco.apply(model, variant, keep=8, **params) as handle:
        together = model(**batch).logits
        kept_together = [r.kept for r in handle.records]
        for i in range(2):
            alone = model(**sample(batch, i)).logits
            torch.testing.assert_close(together[i:i + 1], alone, atol=1e-5, rtol=0)
            for rec, kept in zip(handle.records, kept_together, strict=True):
                assert torch.equal(rec.kept[0], kept[i])
    assert not torch.equal(kept_together[-1][0], kept_together[-1][1])


def test_v_images_of_different_sizes_lose_the_same_number_of_groups(model: nn.Module) -> None:
    small, large = inputs(model, seed=7), inputs(model, seed=8, image_size=(112, 168))
    pad = large["input_ids"].shape[1] - small["input_ids"].shape[1]  # 8 more groups
    padded = {k: torch.cat([torch.zeros(1, pad, dtype=v.dtype), v], 1) for k, v in small.items()
              if k in ("input_ids", "attention_mask", "mm_token_type_ids")}
    batch = {k: torch.cat([padded[k], large[k]]) for k in padded}
    batch["pixel_values"] = torch.cat([small["pixel_values"], large["pixel_values"]])
    batch["image_grid_thw"] = torch.cat([small["image_grid_thw"], large["image_grid_thw"]])
    with ficoco.apply(model, "v", schedule={1: 4, 3: 4}) as handle:
        together = model(**batch).logits
        assert [tuple(r.kept.shape) for r in handle.records] == [(1, 48), (1, 80), (1, 32), (1, 64)]
        alone = [model(**x).logits for x in (small, large)]
    assert together.shape[1] == large["input_ids"].shape[1] - 8  # 8 groups = 8 LLM tokens per image
    torch.testing.assert_close(together[0:1, pad:], alone[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(together[1:2], alone[1], atol=1e-5, rtol=0)


# -- 5. generate after a reduced prefill -------------------------------------------------------

def test_v_generate_and_decoding_after_reduced_prefill(model: nn.Module, arch: Any) -> None:
    batch = inputs(model, batch=2, seed=9)
    length = batch["input_ids"].shape[1]
    full_last = int(model.model.get_rope_index(batch["input_ids"], batch["mm_token_type_ids"],
                                               image_grid_thw=batch["image_grid_thw"])[0].max())
    with ficoco.apply(model, "v", keep=8) as handle:
        with entering_tokens(model, images=2) as seen:
            together = greedy(model, batch)
        check_whole_groups(handle.records, handle.schedule, batch=2)
        plan = plan_tokens(arch, handle.schedule, text_tokens=TEXT)
        alone = [greedy(model, sample(batch, i)) for i in range(2)]
        out = model(**batch, use_cache=True)
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        reference_cache = copy.deepcopy(output_cache(out))
        # A decode step without position ids: transformers adds the rope_deltas to the cache length.
        step = model(input_ids=token, **cache_argument(output_cache(out)), use_cache=True).logits[:, -1]
        generated = greedy(model, batch, new=2, output_logits=True, return_dict_in_generate=True)
    # The caller's own prompt comes back (the LLM ran it with the image spans shortened to the
    # kept groups), then the new tokens.
    assert together.shape == (2, length + NEW)
    assert torch.equal(together[:, :length], batch["input_ids"])
    for i in range(2):
        assert torch.equal(together[i:i + 1], alone[i])
    assert torch.equal(together[:, -NEW], token[:, 0])
    for i in range(len(vision_layers(model))):
        assert seen["vision"][i] == [plan.vision[i][0]], f"vision layer {i}: the tower runs once"
    assert seen["llm"][0] == [TEXT + 8] + [1] * (NEW - 1)
    torch.testing.assert_close(generated.logits[1], step, atol=1e-5, rtol=0)
    # Independent reference: the next token at the unreduced prompt's next 3-D position.
    after = torch.full((3, 2, 1), full_last + 1)
    reference = model(input_ids=token, **cache_argument(copy.deepcopy(reference_cache)), position_ids=after,
                      use_cache=True).logits[:, -1]
    torch.testing.assert_close(step, reference, atol=1e-5, rtol=0)
    wrong = model(input_ids=token, **cache_argument(copy.deepcopy(reference_cache)),
                  position_ids=torch.full((3, 2, 1), TEXT + 8), use_cache=True).logits[:, -1]
    assert (wrong - step).abs().max() > 1e-4


def test_l_generate_and_decoding_after_reduced_prefill(model: nn.Module, arch: Any) -> None:
    batch = inputs(model, batch=2, seed=10)
    length = batch["input_ids"].shape[1]
    full_last = int(model.model.get_rope_index(batch["input_ids"], batch["mm_token_type_ids"],
                                               image_grid_thw=batch["image_grid_thw"])[0].max())
    with ficoco.apply(model, "l", keep=6, beta=0.0) as handle:
        with entering_tokens(model, images=2) as seen:
            together = greedy(model, batch)
        plan = plan_tokens(arch, handle.schedule, text_tokens=TEXT)
        alone = [greedy(model, sample(batch, i)) for i in range(2)]
        out = model(**batch, use_cache=True)
        lengths = [layer.keys.shape[-2] for layer in output_cache(out).layers]
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        reference_cache = copy.deepcopy(output_cache(out))
        step = model(input_ids=token, **cache_argument(output_cache(out)), use_cache=True).logits[:, -1]
        generated = greedy(model, batch, new=2, output_logits=True, return_dict_in_generate=True)
    assert together.shape == (2, length + NEW)
    for i in range(2):
        assert torch.equal(together[i:i + 1], alone[i])
    assert torch.equal(together[:, length], token[:, 0])
    for i in range(len(decoder_layers(model))):
        assert seen["llm"][i] == [plan.llm[i][0]] + [1] * (NEW - 1), f"decoder layer {i}"
    # Each layer cached what it saw; layer 0 holds the whole prompt (so rope_deltas and the
    # cache length describe the unreduced layout).
    assert lengths == [entering for entering, _ in plan.llm]
    assert lengths[0] == length
    torch.testing.assert_close(generated.logits[1], step, atol=1e-5, rtol=0)
    # Independent reference: the unpatched model on the reduced cache, each layer attending to
    # all of its own entries, the new token at the unreduced prompt's next 3-D position.
    after = torch.full((3, 2, 1), full_last + 1)
    reference = model(input_ids=token, **cache_argument(copy.deepcopy(reference_cache)), position_ids=after,
                      use_cache=True).logits[:, -1]
    torch.testing.assert_close(step, reference, atol=1e-5, rtol=0)
    wrong = model(input_ids=token, **cache_argument(copy.deepcopy(reference_cache)),
                  position_ids=torch.full((3, 2, 1), plan.llm[-1][1]), use_cache=True).logits[:, -1]
    assert (wrong - step).abs().max() > 1e-4


def reference_decode(model: nn.Module, batch: dict[str, Tensor], new: int) -> Tensor:
    """Greedy tokens of a prefill and decode steps at the unreduced prompt's next 3-D positions (no
    rope_deltas read), EOS kept out as generate's min_new_tokens does."""
    full_last = int(model.model.get_rope_index(batch["input_ids"], batch["mm_token_type_ids"],
                                               image_grid_thw=batch["image_grid_thw"])[0].max())
    eos = torch.tensor(model.generation_config.eos_token_id).reshape(-1)
    out = model(**batch, use_cache=True)
    tokens, cache = [out.logits[:, -1].index_fill(-1, eos, -torch.inf).argmax(-1)], output_cache(out)
    rows = batch["input_ids"].shape[0]
    for k in range(new - 1):
        step = model(input_ids=tokens[-1][:, None], **cache_argument(cache), use_cache=True,
                     position_ids=torch.full((3, rows, 1), full_last + 1 + k))
        cache = output_cache(step)
        tokens.append(step.logits[:, -1].index_fill(-1, eos, -torch.inf).argmax(-1))
    return torch.stack(tokens, dim=1)


@pytest.mark.parametrize("method", ["visionzip", "fastervlm"])
def test_cuts_of_whole_groups_run_with_the_kept_groups_3d_positions(model: nn.Module, arch: Any, method: str) -> None:
    """VisionZip (before the PatchMerger) and FasterVLM (after it), issue 25: whole merge groups, the
    planned count, each sample as if alone, generate equal to a decode at the unreduced next position."""
    batch = inputs(model, batch=2, seed=13)
    length, new = batch["input_ids"].shape[1], 3
    with torch.no_grad(), ficoco.apply(model, method, keep=8) as handle:
        with entering_tokens(model, images=2) as seen:
            together = greedy(model, batch, new=new)
        records = list(handle.records)
        plan = plan_tokens(arch, handle.schedule, text_tokens=TEXT)
        alone = [greedy(model, sample(batch, i), new=new) for i in range(2)]
        reference = reference_decode(model, batch, new)
    assert seen["llm"][0][0] == plan.llm[0][0] == TEXT + 8
    assert [tuple(r.kept.shape) for r in records] == [(2, 8 * 4)]
    rec = records[0]
    members = torch.stack([(groups_of(rec.kept) == g).sum(1) for g in range(GROUPS)], 1)
    assert bool(((members == 0) | (members == 4)).all())  # whole 2 x 2 groups (a contextual token: its target's)
    assert torch.equal(torch.cat([rec.kept, rec.discarded], 1).sort(1).values, torch.arange(PATCHES).expand(2, -1))
    assert torch.equal(together[:, :length], batch["input_ids"])
    for i in range(2):
        assert torch.equal(together[i:i + 1], alone[i])
    assert torch.equal(together[:, -new:], reference)


def test_tome_merges_whole_groups_in_tower_blocks(model: nn.Module, arch: Any) -> None:
    """ToMe (issue 25): whole merge groups merge in the tower's blocks (rotary table and cu_seqlens follow),
    the planned counts, each sample as if alone, generate equal to a decode at the unreduced next position."""
    batch = inputs(model, batch=2, seed=14)
    with torch.no_grad(), ficoco.apply(model, "tome", keep=8) as handle:
        with entering_tokens(model, images=2) as seen:
            together = greedy(model, batch, new=3)
        records = list(handle.records)
        plan = plan_tokens(arch, handle.schedule, text_tokens=TEXT)
        alone = [greedy(model, sample(batch, i), new=3) for i in range(2)]
        reference = reference_decode(model, batch, 3)
    assert [seen["vision"][i][0] for i in range(len(vision_layers(model)))] == [entering for entering, _ in plan.vision]
    assert seen["llm"][0][0] == plan.llm[0][0] == TEXT + 8
    assert tuple(records[-1].kept.shape) == (2, 8 * 4) and len(records) > 1
    for rec in records:
        members = torch.stack([(groups_of(part) == g).sum(1) for part in (rec.kept, rec.discarded)
                               for g in range(GROUPS)], 1)
        assert bool(((members == 0) | (members == 4)).all())
    for i in range(2):
        assert torch.equal(together[i:i + 1], alone[i])
    assert torch.equal(together[:, -3:], reference)


@pytest.mark.parametrize("method", ["pdrop", "sparsevlm"])
def test_compacting_methods_run_keeping_3d_positions(model: nn.Module, arch: Any, method: str) -> None:
    """PDrop and SparseVLM (issue 25): the planned counts, each sample as if alone, and generate equal to a
    decode at the unreduced prompt's next 3-D positions (the kept tokens keep theirs; no 1-D compaction)."""
    batch = inputs(model, batch=2, seed=12)
    full_last = int(model.model.get_rope_index(batch["input_ids"], batch["mm_token_type_ids"],
                                               image_grid_thw=batch["image_grid_thw"])[0].max())
    new = 3
    with torch.no_grad(), ficoco.apply(model, method, schedule="1:6,3:4") as handle:
        with entering_tokens(model, images=2) as seen:
            together = greedy(model, batch, new=new)
        plan = plan_tokens(arch, handle.schedule, text_tokens=TEXT)
        alone = [greedy(model, sample(batch, i), new=new) for i in range(2)]
        cos_seen: list[Tensor] = []
        hooks = [layer.self_attn.register_forward_pre_hook(
            lambda m, args, kwargs: cos_seen.append(kwargs["position_embeddings"][0]), with_kwargs=True)
            for layer in (decoder_layers(model)[0], decoder_layers(model)[-1])]
        try:
            out = model(**batch, use_cache=True)
        finally:
            for hook in hooks:
                hook.remove()
        # generate's min_new_tokens keeps EOS out: so does the reference.
        eos = torch.tensor(model.generation_config.eos_token_id).reshape(-1)
        tokens, cache = [out.logits[:, -1].index_fill(-1, eos, -torch.inf).argmax(-1)], output_cache(out)
        for k in range(new - 1):
            step = model(input_ids=tokens[-1][:, None], **cache_argument(cache), use_cache=True,
                         position_ids=torch.full((3, 2, 1), full_last + 1 + k))
            cache = output_cache(step)
            tokens.append(step.logits[:, -1].index_fill(-1, eos, -torch.inf).argmax(-1))
    assert [calls[0] for _, calls in sorted(seen["llm-mlp"].items())] == [entering for entering, _ in plan.llm]
    assert plan.llm[-1][0] < plan.llm[0][0]
    for i in range(2):
        assert torch.equal(together[i:i + 1], alone[i])
    assert torch.equal(together[:, -new:], torch.stack(tokens, dim=1))
    # After the steps the last prompt token still has its 3-D position (1-D compaction would move it).
    assert cos_seen[1].shape[1] < cos_seen[0].shape[1]
    assert torch.equal(cos_seen[1][:, -1], cos_seen[0][:, -1])


@pytest.mark.parametrize(("variant", "params"), [("v", {}), ("l", {}), ("l", {"beta": 0.0})],
                         ids=["v", "l", "l-beta0"])
def test_generate_left_padded_batch_equals_samples_alone(model: nn.Module, variant: str, params: dict) -> None:
    """Padding shifts where the image sits and the 3-D positions of everything after it."""
    long, short = (synthetic_inputs(model, batch=1, text_tokens=TEXT + 3, seed=14),
                   synthetic_inputs(model, batch=1, text_tokens=TEXT, seed=15))
    batch = {k: torch.cat([long[k], torch.cat([torch.zeros(1, 3, dtype=short[k].dtype), short[k]], 1)])
             for k in ("input_ids", "attention_mask", "mm_token_type_ids")}
    batch["pixel_values"] = torch.cat([long["pixel_values"], short["pixel_values"]])
    batch["image_grid_thw"] = torch.cat([long["image_grid_thw"], short["image_grid_thw"]])
    with ficoco.apply(model, variant, keep=8, **params):
        together = greedy(model, batch)[:, -NEW:]
        alone = [greedy(model, x)[:, -NEW:] for x in (long, short)]
    assert torch.equal(together[0:1], alone[0])
    assert torch.equal(together[1:2], alone[1])


def test_l_kept_tokens_keep_their_3d_rotary_positions(model: nn.Module) -> None:
    inp = inputs(model, batch=2, seed=11)
    length = inp["input_ids"].shape[1]
    cos_seen: dict[int, Tensor] = {}
    hooks = []
    for i, layer in enumerate(decoder_layers(model)):
        def hook(module: nn.Module, args: tuple, kwargs: dict, _i: int = i) -> None:
            cos_seen[_i] = kwargs["position_embeddings"][0]

        hooks.append(layer.self_attn.register_forward_pre_hook(hook, with_kwargs=True))
    try:
        with ficoco.apply(model, "l", schedule={1: 5, 3: 6}, beta=0.0) as handle:
            model(**inp)
            records = {r.layer: r for r in handle.records}
    finally:
        for h in hooks:
            h.remove()
    full = cos_seen[0].expand(2, -1, -1)  # layer 0 is never wrapped: the whole prompt's table
    assert full.shape[1] == length
    # The image's rows differ from plain 1-D positions: the table really is the 3-D one.
    assert not torch.equal(full[:, PREFIX_TOKENS + 1], full[:, PREFIX_TOKENS + 2])
    prefix = torch.arange(PREFIX_TOKENS).expand(2, -1)
    suffix = torch.arange(PREFIX_TOKENS + GROUPS, length).expand(2, -1)
    for layer, kept in ((1, torch.arange(GROUPS).expand(2, -1)), (2, records[1].kept), (3, records[1].kept)):
        positions = torch.cat([prefix, PREFIX_TOKENS + kept, suffix], dim=1)
        expected = torch.gather(full, 1, positions[..., None].expand(-1, -1, full.shape[-1]))
        assert torch.equal(cos_seen[layer].expand(2, -1, -1), expected), f"decoder layer {layer}"


# -- 6. the analytic count matches the counters ------------------------------------------------

def test_verify_passes_on_tiny_within_a_tenth_of_a_percent(model: nn.Module) -> None:
    profile = load_profile("qwen2-vl-tiny")
    arch = architecture(profile)
    schedules = [Schedule("vanilla"), make_schedule(arch, "v", {2: 4, 4: 4}), make_schedule(arch, "l", {1: 4, 3: 4})]
    result = verify(profile, schedules, tolerance_percent=0.1, model=model)
    assert result.passed, [(run.variant, s.stage, s.fvcore_diff) for run in result.runs for s in run.stages]
    for run in result.runs:
        assert run.skipped_matrix_ops == []
        assert all(s.fvcore == s.analytic for s in run.stages)
        assert all(layer.fvcore == layer.analytic for layer in run.layers)
    v_method = result.runs[1].method
    assert [m.fvcore for m in v_method] == [m.matmul_formula for m in v_method]


def test_the_adapter_is_composed_of_parts_on_the_grid_order(model: nn.Module) -> None:
    """Qwen2-VL's adapter composes its parts (tower blocks, cuts, prompt shortening) over one tower order,
    which Qwen2.5-VL swaps for its window order (tests/test_models_qwen2_5_vl.py); a run leaves no pass."""
    from ficoco.models import adapter_for
    from ficoco.models.qwen2_vl import GridOrder, Qwen2VLAdapter
    from ficoco.models.qwen2_vl.adapter import PromptShortener, TowerBlocks, TowerCuts

    adapter = adapter_for(model)
    assert type(adapter) is Qwen2VLAdapter and type(adapter.order) is GridOrder
    parts = {"blocks": TowerBlocks, "cuts": TowerCuts, "prompt": PromptShortener}
    assert {name: type(getattr(adapter, name)) for name in parts} == parts
    assert all(getattr(adapter, name).adapter is adapter for name in (*parts, "order"))
    assert adapter.tower_pass is None
