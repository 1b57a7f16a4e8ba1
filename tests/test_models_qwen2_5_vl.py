"""FiCoCo inside Hugging Face Qwen2.5-VL, end to end (issue 25), lean.

A random seeded qwen2.5-vl-tiny model in fp32 on CPU: a ViT of 4 blocks (block 2 attends over the
whole image, blocks 0, 1 and 3 within windows of 2 x 2 merge groups) over a 140 x 112 image (10 x 8
patches, 5 x 4 merge groups, so 20 LLM tokens; its windows hold 4, 4, 4, 4, 2 and 2 groups, the last
row of windows partial), and a Qwen2 decoder of 4 layers with 3-D rotary positions; prompts are 12
text tokens of the chat template around one image span.
"""

from __future__ import annotations

import contextlib
import inspect
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import ficoco
from ficoco.accounting import architecture
from ficoco.accounting.architecture import parameter_counts
from ficoco.accounting.families.qwen2_5_vl import windows as qwen2_5_vl_windows
from ficoco.accounting.schedule import Schedule, make_schedule, plan_tokens
from ficoco.api import profile_of
from ficoco.models.hf_compat import cache_argument, output_cache
from ficoco.models.qwen2_5_vl import synthetic_inputs
from ficoco.profiles import load_profile
from ficoco.profiling.verify import verify

TEXT = 12
ROWS, COLS = 5, 4  # merge groups of the 10 x 8 patch grid
GROUPS = ROWS * COLS
PATCHES = 4 * GROUPS
GRID_W = 2 * COLS
NEW = 4


TINY_PROFILE = "qwen2.5-vl-tiny"  # built as this module's `model` (conftest.py)


@pytest.fixture(scope="module")
def arch(model: nn.Module) -> Any:
    return architecture(profile_of(model, "qwen2.5-vl-tiny"))


def inputs(model: nn.Module, batch: int = 1, seed: int = 0) -> dict[str, Tensor]:
    return synthetic_inputs(model, batch=batch, text_tokens=TEXT, seed=seed)


def sample(batch: dict[str, Tensor], i: int) -> dict[str, Tensor]:
    patches = batch["pixel_values"].shape[0] // batch["input_ids"].shape[0]
    return {k: v[i * patches:(i + 1) * patches] if k == "pixel_values" else v[i:i + 1] for k, v in batch.items()}


def greedy(model: nn.Module, inp: dict[str, Tensor], **kwargs: Any) -> Any:
    return model.generate(**inp, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, **kwargs)


def window_of(group: int) -> int:
    """The window (row-major over the 3 x 2 windows of 2 x 2 groups) of a group of the 5 x 4 grid."""
    return (group // COLS // 2) * 2 + (group % COLS) // 2


def groups_of(patches: Tensor) -> list[int]:
    """The merge groups (row-major on the group grid) of row-major patch indices, sorted."""
    return sorted({int(p) // GRID_W // 2 * COLS + int(p) % GRID_W // 2 for p in patches})


@contextlib.contextmanager
def captured(module: nn.Module, *names: str) -> Iterator[list[dict[str, Any]]]:
    calls: list[dict[str, Any]] = []
    hook = module.register_forward_pre_hook(
        lambda mod, args, kwargs: calls.append({n: kwargs.get(n) for n in names}), with_kwargs=True)
    try:
        yield calls
    finally:
        hook.remove()


@contextlib.contextmanager
def entering_tokens(model: nn.Module, images: int) -> Iterator[dict[str, dict[int, list[int]]]]:
    """Tokens at the entry of every ViT block (per image) and decoder layer, and of each one's MLP."""
    seen: dict[str, dict[int, list[int]]] = {k: defaultdict(list) for k in ("vision", "llm", "vision-mlp", "llm-mlp")}
    hooks = []
    for stage, layers in (("vision", model.model.visual.blocks), ("llm", model.model.language_model.layers)):
        dim, per = (0, images) if stage == "vision" else (1, 1)
        for i, layer in enumerate(layers):
            def hook(module: nn.Module, args: tuple, kwargs: dict, _s: str = stage, _i: int = i, _d: int = dim,
                     _p: int = per) -> None:
                seen[_s][_i].append((args[0] if args else kwargs["hidden_states"]).shape[_d] // _p)

            def mlp_hook(module: nn.Module, args: tuple, _s: str = stage, _i: int = i, _d: int = dim,
                         _p: int = per) -> None:
                seen[f"{_s}-mlp"][_i].append(args[0].shape[_d] // _p)

            hooks += [layer.register_forward_pre_hook(hook, with_kwargs=True),
                      layer.mlp.register_forward_pre_hook(mlp_hook)]
    try:
        yield seen
    finally:
        for h in hooks:
            h.remove()


# -- the profile and the accountant's windows ----------------------------------------------------

def test_windows_and_parameters_are_the_built_models(arch_of) -> None:
    real = arch_of("qwen2.5-vl-7b")
    # 672 x 672: 24 x 24 groups in windows of 112 px = 4 x 4 groups, 36 whole windows.
    assert real.vision.window_groups == (16,) * 36 and real.vision.full_attention_layers == {7, 15, 23, 31}
    assert qwen2_5_vl_windows(5, 4, 2) == (4, 4, 4, 4, 2, 2)
    assert qwen2_5_vl_windows(3, 5, 2) == (4, 4, 2, 2, 2, 1)
    model = ficoco.build_model("qwen2.5-vl-tiny", dtype="fp32")
    arch = architecture(profile_of(model, "qwen2.5-vl-tiny"))
    counts = parameter_counts(arch)
    assert counts.vision + counts.projector == sum(p.numel() for p in model.model.visual.parameters())
    assert counts.total == sum(p.numel() for p in model.parameters())
    # The tiny tower's window layers attend over 4 windows of 16 tokens and 2 of 8; the full one over 80.
    assert [arch.vision.attention_pairs(layer, GROUPS) for layer in range(4)] == [1152, 1152, 6400, 1152]


# -- an empty schedule is the unpatched model ----------------------------------------------------

@pytest.mark.parametrize("variant", ["v", "l"])
def test_empty_schedule_logits_and_generate_equal_unpatched(model: nn.Module, variant: str) -> None:
    inp = inputs(model, batch=2)
    ref_logits, ref_tokens = model(**inp).logits, greedy(model, inp)
    with ficoco.apply(model, variant, schedule={}) as handle:
        assert "forward" in model.__dict__
        logits, tokens = model(**inp).logits, greedy(model, inp)
        assert handle.records == []
    assert torch.equal(logits, ref_logits)
    assert torch.equal(tokens, ref_tokens)
    assert torch.equal(model(**inp).logits, ref_logits)


# -- tokens every layer processes == the plan -----------------------------------------------------

@pytest.mark.parametrize(("variant", "how"), [("v", {"keep": 10}), ("l", {"schedule": {1: 5, 3: 6}})])
def test_tokens_entering_every_layer_equal_schedule_plan(model: nn.Module, arch: Any, variant: str,
                                                         how: dict) -> None:
    inp = inputs(model, batch=2, seed=3)
    with ficoco.apply(model, variant, **how) as handle, entering_tokens(model, images=2) as seen:
        logits = model(**inp).logits
    plan = plan_tokens(arch, handle.schedule, text_tokens=TEXT)
    assert handle.schedule.total_removed > 0
    for i in range(4):
        assert seen["vision"][i] == [plan.vision[i][0]], f"vision layer {i}"
        assert seen["vision-mlp"][i] == [plan.vision[i][1]], f"vision layer {i}"
        assert seen["llm"][i] == [plan.llm[i][0]], f"decoder layer {i}"
        assert seen["llm-mlp"][i] == [plan.llm[i][1]], f"decoder layer {i}"
    assert logits.shape[1] == plan.llm[-1][1]


# -- the windows after a reduction -----------------------------------------------------------------

def test_v_in_a_window_layer_leaves_the_kept_groups_in_their_windows(model: nn.Module) -> None:
    inp = inputs(model, batch=2, seed=4)
    blocks = model.model.visual.blocks
    names = ("cu_seqlens", "position_embeddings")
    with captured(blocks[0].attn, *names) as first, captured(blocks[2].attn, *names) as full, \
            captured(blocks[3].attn, *names) as later, ficoco.apply(model, "v", schedule={1: 7}) as handle:
        model(**inp)
        records = list(handle.records)
        pairs = dict(handle.vision_attention_pairs)
    windows = [16, 16, 16, 16, 8, 8]
    assert first[0]["cu_seqlens"].tolist() == [0, *torch.tensor(windows * 2).cumsum(0).tolist()]
    kept_tokens = 4 * (GROUPS - 7)
    assert full[0]["cu_seqlens"].tolist() == [0, kept_tokens, 2 * kept_tokens]  # images, in the full layer
    # Window layer 3: every kept group in the window it started in, windows in order, empty ones dropped.
    expected, rows = [], []
    for b in range(2):
        kept = groups_of(records[0].kept[b])
        assert len(kept) == GROUPS - 7
        counts = [sum(window_of(g) == w for g in kept) for w in range(6)]
        expected += [4 * c for c in counts if c]
        # The tower's window order: windows in turn, groups row-major inside; the kept patches keep their rows.
        order = sorted(range(GROUPS), key=lambda g: (window_of(g), g))
        for g in sorted(kept, key=lambda g: (window_of(g), g)):
            rows += [b * PATCHES + 4 * order.index(g) + m for m in range(4)]
    assert later[0]["cu_seqlens"].tolist() == [0, *torch.tensor(expected).cumsum(0).tolist()]
    assert torch.equal(later[0]["position_embeddings"][0], first[0]["position_embeddings"][0][torch.tensor(rows)])
    assert pairs[3] == sum(n * n for n in expected) and pairs[2] == 2 * kept_tokens**2
    # The window layer's attention map held no pair across windows: a discarded group folds into a kept
    # group of its own window wherever its window keeps one.
    rec = records[0]
    for b in range(2):
        kept = groups_of(rec.kept[b])
        for patch, target in zip(rec.discarded[b].tolist(), rec.merged_into[b].tolist(), strict=True):
            source, into = groups_of(torch.tensor([patch]))[0], groups_of(torch.tensor([target]))[0]
            if any(window_of(k) == window_of(source) for k in kept):
                assert window_of(into) == window_of(source), f"group {source} folded into group {into}"
    assert pairs[0] == 2 * sum(n * n for n in windows)


# -- batches and generate ----------------------------------------------------------------------------

@pytest.mark.parametrize(("variant", "params"), [("v", {}), ("l", {"beta": 0.0})], ids=["v", "l-beta0"])
def test_batch_gives_each_sample_its_batch_of_one_result(model: nn.Module, variant: str, params: dict) -> None:
    batch = inputs(model, batch=2, seed=6)
    with ficoco.apply(model, variant, keep=10, **params) as handle:
        together = model(**batch).logits
        kept_together = [r.kept for r in handle.records]
        for i in range(2):
            torch.testing.assert_close(together[i:i + 1], model(**sample(batch, i)).logits, atol=1e-5, rtol=0)
            for rec, kept in zip(handle.records, kept_together, strict=True):
                assert torch.equal(rec.kept[0], kept[i])
    assert not torch.equal(kept_together[-1][0], kept_together[-1][1])


def test_v_generate_after_reduced_prefill_and_a_text_turn_on_its_cache(model: nn.Module) -> None:
    first = inputs(model, batch=2, seed=9)
    length = first["input_ids"].shape[1]
    question = inputs(model, seed=10)["input_ids"][:, -4:].expand(2, -1)
    with ficoco.apply(model, "v", keep=10):
        turn1 = greedy(model, first, return_dict_in_generate=True)
        alone = [greedy(model, sample(first, i)) for i in range(2)]
        ids = torch.cat([turn1.sequences, question], dim=1)
        nxt = {"input_ids": ids, "attention_mask": torch.ones_like(ids),
               "mm_token_type_ids": (ids == model.config.image_token_id).int()}
        turn2 = greedy(model, nxt, **cache_argument(output_cache(turn1)), return_dict_in_generate=True)
        # Reference without a cache: the whole conversation with its image, in one prompt.
        images = {key: first[key] for key in ("pixel_values", "image_grid_thw")}
        whole = greedy(model, {**nxt, **images}, return_dict_in_generate=True)
    assert torch.equal(turn1.sequences[:, :length], first["input_ids"])
    for i in range(2):
        assert torch.equal(turn1.sequences[i:i + 1], alone[i])
    assert torch.equal(turn2.sequences, whole.sequences)
    # The cache holds the shortened conversation (10 placeholders fewer), the last new token not yet run.
    assert output_cache(turn2).get_seq_length() == output_cache(whole).get_seq_length() == ids.shape[1] - 10 + NEW - 1


def test_labels_score_the_remaining_positions(model: nn.Module) -> None:
    inp = inputs(model, batch=2, seed=11)
    labels = inp["input_ids"].masked_fill(inp["input_ids"] == model.config.image_token_id, -100)
    for variant in ("v", "l"):
        with ficoco.apply(model, variant, keep=10) as handle:
            out = model(**inp, labels=labels)
            kept = torch.gather(labels, 1, handle.output_positions)
        shifted = F.cross_entropy(out.logits[:, :-1].flatten(0, 1), kept[:, 1:].flatten(), ignore_index=-100)
        torch.testing.assert_close(out.loss, shifted)


# -- the analytic count matches the counters; another method of the registry ---------------------------

def test_verify_passes_on_tiny_layer_exact(model: nn.Module) -> None:
    profile = load_profile("qwen2.5-vl-tiny")
    arch = architecture(profile)
    schedules = [Schedule("vanilla"), make_schedule(arch, "v", {1: 5, 2: 3, 3: 4}),
                 make_schedule(arch, "l", {1: 4, 3: 4})]
    result = verify(profile, schedules, tolerance_percent=0.5, model=model)
    assert result.passed, [(run.variant, s.stage, s.fvcore_diff) for run in result.runs for s in run.stages]
    for run in result.runs:
        assert run.skipped_matrix_ops == []
        assert all(layer.fvcore == layer.analytic for layer in run.layers)
    # The V run's window layers were counted with the windows it left, below the full square.
    v_plan = result.runs[1].plan
    assert v_plan.vision_attention_pairs[3] < v_plan.vision[3][0] ** 2


def test_fastv_runs_on_qwen2_5_vl_and_its_count_is_verified(model: nn.Module, arch: Any) -> None:
    inp = inputs(model, batch=2, seed=12)
    with torch.no_grad(), ficoco.apply(model, "fastv", schedule="2:10") as handle, \
            entering_tokens(model, images=2) as seen:
        model(**inp)
    plan = plan_tokens(arch, handle.schedule, text_tokens=TEXT)
    # FastV cuts at layer 2's input, inside the wrapped layer: its MLP (and every later layer) runs on 10 fewer.
    entering_mlp = [seen["llm-mlp"][i][0] for i in range(4)]
    assert entering_mlp == [n for _, n in plan.llm] == [TEXT + GROUPS] * 2 + [TEXT + 10] * 2
    result = verify(load_profile("qwen2.5-vl-tiny"), [handle.schedule], model=model)
    assert result.passed


def test_v_images_of_different_sizes_each_keep_their_own_windows(model: nn.Module) -> None:
    """A 6 x 7-group image (its right column of windows one group wide) beside a 5 x 4-group one."""
    small = inputs(model, seed=7)
    large = synthetic_inputs(model, text_tokens=TEXT, seed=8, image_size=(168, 196))
    pad = large["input_ids"].shape[1] - small["input_ids"].shape[1]
    batch = {k: torch.cat([torch.cat([torch.zeros(1, pad, dtype=small[k].dtype), small[k]], 1), large[k]])
             for k in ("input_ids", "attention_mask", "mm_token_type_ids")}
    batch["pixel_values"] = torch.cat([small["pixel_values"], large["pixel_values"]])
    batch["image_grid_thw"] = torch.cat([small["image_grid_thw"], large["image_grid_thw"]])
    with ficoco.apply(model, "v", schedule={1: 4, 2: 3, 3: 4}):
        together = model(**batch).logits
        alone = [model(**x).logits for x in (small, large)]
    assert together.shape[1] == large["input_ids"].shape[1] - 11
    torch.testing.assert_close(together[0:1, pad:], alone[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(together[1:2], alone[1], atol=1e-5, rtol=0)


def test_a_real_prompt_through_a_local_checkouts_processor_runs_v(tmp_path: Any) -> None:
    """The checkpoint's processor and chat template lay the prompt out (Qwen2-VL's); the accountant plans
    the processor's grid and V runs on it."""
    from helpers import make_checkpoint
    from PIL import Image

    from ficoco.models.prompt import encode_prompt
    from ficoco.profiles import set_layout

    folder = make_checkpoint("qwen2_5_vl", tmp_path / "checkpoint")
    picture = Image.new("RGB", (150, 100))
    picture.putdata([(x % 256, (3 * x) % 256, 40) for x in range(150 * 100)])
    picture.save(tmp_path / "wide.png")
    profile = load_profile(str(folder))
    prompt = encode_prompt(str(folder), profile.config, image=str(tmp_path / "wide.png"), prompt="What is shown?")
    assert prompt.text.startswith("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What is shown?")
    # 150x100 resizes to 140x112: 10 x 8 patches, 20 merge groups.
    assert prompt.image_size == (112, 140) and prompt.visual_tokens == 20
    set_layout(profile, image_size=prompt.image_size)
    assert architecture(profile).visual_tokens == prompt.visual_tokens
    model = ficoco.build_model(str(folder), weights=str(folder), dtype="fp32", check_memory=False)
    with ficoco.apply(model, "v", schedule={1: 8}):
        logits = model(**prompt.encoded).logits
    assert logits.shape[1] == prompt.encoded["input_ids"].shape[1] - 8


# -- every other method Qwen2-VL runs (issue 25's matrix) ---------------------------------------------

@pytest.mark.parametrize(("method", "how"), [
    ("divprune", {"keep": 6}), ("cdpruner", {"keep": 6}), ("vispruner", {"keep": 6}), ("visionzip", {"keep": 6}),
    ("fastervlm", {"keep": 6}), ("tome", {"keep": 6}), ("pdrop", {"schedule": "1:6,3:4"}),
    ("sparsevlm", {"schedule": "1:6,3:4"})])
def test_every_method_runs_the_planned_counts_batch_equals_samples_and_verifies(model: nn.Module, arch: Any,
                                                                               method: str, how: dict) -> None:
    """The tokens entering every layer are the plan's, each sample of a batch is as if alone, whole merge
    groups leave (the records), and the accountant's count is what fvcore measures (`flops --verify`)."""
    from ficoco.profiling.verify import verify_run

    batch = inputs(model, batch=2, seed=15)
    with torch.no_grad(), ficoco.apply(model, method, **how) as handle:
        with entering_tokens(model, images=2) as seen:
            together = model(**batch).logits
        records = list(handle.records)
        alone = [model(**sample(batch, i)).logits for i in range(2)]
    plan = plan_tokens(arch, handle.schedule, text_tokens=TEXT)
    assert handle.schedule.total_removed > 0
    for i in range(4):
        assert seen["vision"][i][0] == plan.vision[i][0] and seen["vision-mlp"][i][0] == plan.vision[i][1]
        # PDrop and SparseVLM cut at a layer's input, inside the wrapped layer: its MLP sees what it hands on.
        assert seen["llm-mlp"][i][0] == plan.llm[i][0 if method in ("pdrop", "sparsevlm") else 1]
    for i in range(2):
        torch.testing.assert_close(together[i:i + 1], alone[i], atol=1e-5, rtol=0)
    for rec in records if records and records[0].stage == "vision" else []:
        for b in range(2):
            groups = groups_of(rec.kept[b])
            assert len(groups) * 4 == rec.kept.shape[1]  # whole 2 x 2 groups, each once
    run = verify_run(model, arch, handle.schedule, text_tokens=TEXT)
    assert all(abs(stage.fvcore - stage.analytic) <= 0.005 * max(stage.analytic, 1) for stage in run.stages), \
        [(s.stage, s.analytic, s.fvcore) for s in run.stages]


def test_divprune_keeps_the_groups_an_independent_max_min_picks_on_the_unpatched_features(model: nn.Module) -> None:
    """DivPrune on the merger's output in grid order (the tower's own reverse of its window order): the
    kept groups are those a plain-loop Max-Min choice picks from the unpatched model's image features."""
    batch = inputs(model, batch=2, seed=16)
    with torch.no_grad():
        features = model.model.get_image_features(batch["pixel_values"], image_grid_thw=batch["image_grid_thw"],
                                                  return_dict=True).pooler_output
        with ficoco.apply(model, "divprune", keep=5) as handle:
            model(**batch)
            (record,) = handle.records
    for b in range(2):
        unit = F.normalize(features[b].double(), dim=-1)
        distance = (1 - unit @ unit.T).tolist()
        nearest = [min(d for j, d in enumerate(row) if j != i) for i, row in enumerate(distance)]
        picked = [max(range(GROUPS), key=lambda i: (nearest[i], -i))]
        while len(picked) < 5:
            rest = [i for i in range(GROUPS) if i not in picked]
            picked.append(max(rest, key=lambda i: (min(distance[i][j] for j in picked), -i)))
        assert groups_of(record.kept[b]) == sorted(picked)


def test_tome_merges_keep_every_unit_in_its_destination_groups_window(model: nn.Module) -> None:
    """After ToMe's merges the window layers run on the windows the destination groups stand in, in
    the tower's window order, and the query-key pairs are those windows'."""
    batch = inputs(model, batch=2, seed=17)
    blocks, names = model.model.visual.blocks, ("cu_seqlens", "position_embeddings")
    with torch.no_grad(), captured(blocks[0].attn, *names) as first, captured(blocks[3].attn, *names) as last, \
            ficoco.apply(model, "tome", schedule={0: 3, 1: 3, 2: 3}) as handle:
        model(**batch)
        records, pairs = list(handle.records), dict(handle.vision_attention_pairs)
    expected, rows = [], []
    order = sorted(range(GROUPS), key=lambda g: (window_of(g), g))  # the tower's window order
    for b in range(2):
        kept = groups_of(records[-1].kept[b])
        assert len(kept) == GROUPS - 9
        expected += [4 * c for w in range(6) if (c := sum(window_of(g) == w for g in kept))]
        for g in sorted(kept, key=lambda g: (window_of(g), g)):  # every unit at its destination's rotary rows
            rows += [b * PATCHES + 4 * order.index(g) + m for m in range(4)]
    assert last[0]["cu_seqlens"].tolist() == [0, *torch.tensor(expected).cumsum(0).tolist()]
    assert torch.equal(last[0]["position_embeddings"][0], first[0]["position_embeddings"][0][torch.tensor(rows)])
    assert pairs[3] == sum(n * n for n in expected)


def test_fastervlm_keeps_the_groups_the_last_blocks_equivalent_token_ranks_first(model: nn.Module) -> None:
    """FasterVLM through the cut at the merger: the last block (a window block) ran per window in window
    order; the groups kept are the top ones by the equivalent token (-cos of a patch's head-mean key to
    the image's mean key, averaged per group) computed here from the unpatched block's own input, and
    the LLM receives the unpatched merger's features of exactly those groups."""
    batch = inputs(model, batch=1, seed=18)
    attn = model.model.visual.blocks[3].attn
    seen: list[tuple[Tensor, tuple[Tensor, Tensor]]] = []
    hook = attn.register_forward_pre_hook(
        lambda mod, args, kwargs: seen.append((args[0] if args else kwargs["hidden_states"],
                                               kwargs["position_embeddings"])), with_kwargs=True)
    try:
        with torch.no_grad():
            features = model.model.get_image_features(batch["pixel_values"], image_grid_thw=batch["image_grid_thw"],
                                                      return_dict=True).pooler_output[0]
    finally:
        hook.remove()
    hidden, (cos, sin) = seen[0]
    heads = model.config.vision_config.num_heads
    keys = attn.qkv(hidden).reshape(PATCHES, 3, heads, -1)[:, 1]  # (patches, heads, d), window order
    half = keys.shape[-1] // 2
    rotated = torch.cat([-keys[..., half:], keys[..., :half]], dim=-1)
    keys = (keys * cos[:, None] + rotated * sin[:, None]).mean(dim=1)
    scores = -F.cosine_similarity(keys, keys.mean(dim=0, keepdim=True), dim=-1).view(GROUPS, 4).mean(dim=1)
    order = sorted(range(GROUPS), key=lambda g: (window_of(g), g))  # the group at every window-order row
    by_group = torch.empty(GROUPS)
    by_group[torch.tensor(order)] = scores
    expected = sorted(by_group.topk(7).indices.tolist())
    captured_features: list[Tensor] = []
    with torch.no_grad(), ficoco.apply(model, "fastervlm", keep=7) as handle:
        hook = model.model.language_model.register_forward_pre_hook(
            lambda mod, args, kwargs: captured_features.append(kwargs["inputs_embeds"]), with_kwargs=True)
        try:
            model(**batch)
        finally:
            hook.remove()
        (record,) = handle.records
    assert groups_of(record.kept[0]) == expected
    span = captured_features[0][0, 4:4 + 7]  # the image span after "<|im_start|> user \n <|vision_start|>"
    torch.testing.assert_close(span, features[torch.tensor(expected)], atol=1e-5, rtol=0)


# -- Qwen2.5-VL is Qwen2-VL's adapter and parts with a window order -------------------------------


def _methods(cls: type) -> dict[str, Any]:
    """The functions, properties and method descriptors `cls` itself defines (not its bases; not a class it names)."""
    return {name: value for name, value in vars(cls).items()
            if inspect.isfunction(value) or isinstance(value, (property, staticmethod, classmethod))}


def test_qwen2_5_vl_adapter_overrides_no_private_helper_of_qwen2_vl() -> None:
    from ficoco.models.qwen2_5_vl import Qwen2_5_VLAdapter
    from ficoco.models.qwen2_vl import Qwen2VLAdapter

    overridden = sorted(name for name in _methods(Qwen2_5_VLAdapter)
                        if name.startswith("_") and hasattr(Qwen2VLAdapter, name))
    assert overridden == []


def test_the_window_order_is_the_only_difference_from_qwen2_vl(model: nn.Module) -> None:
    from ficoco.models import adapter_for
    from ficoco.models.qwen2_5_vl import Qwen2_5_VLAdapter, WindowOrder
    from ficoco.models.qwen2_vl import GridOrder, Qwen2VLAdapter
    from ficoco.models.qwen2_vl.adapter import PromptShortener, TowerBlocks, TowerCuts

    # The class defines no method at all: it names its strategy and its title (the refusals' family name).
    assert _methods(Qwen2_5_VLAdapter) == {}
    own = {name for name in vars(Qwen2_5_VLAdapter) if not name.startswith("__")}
    assert own == {"family_title", "order_strategy"}
    assert Qwen2_5_VLAdapter.order_strategy is WindowOrder and issubclass(WindowOrder, GridOrder)
    assert Qwen2VLAdapter.order_strategy is GridOrder
    # Built on the model: Qwen2-VL's parts, sharing the adapter, with the window order.
    adapter = adapter_for(model)
    assert type(adapter) is Qwen2_5_VLAdapter and type(adapter.order) is WindowOrder
    parts = {"blocks": TowerBlocks, "cuts": TowerCuts, "prompt": PromptShortener}
    assert {name: type(getattr(adapter, name)) for name in parts} == parts
    assert all(getattr(adapter, name).adapter is adapter for name in (*parts, "order"))
    assert adapter.order.full_layers == frozenset({2})  # block 2 attends over the whole image
