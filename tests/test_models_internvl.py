"""InternVL3 (issue 34) end to end: the accountant's shapes against transformers' InternVL, and the methods
inside the model.

internvl3-tiny: InternViT of 3 layers over 64 px tiles (8 x 8 patches + [CLS]; pixel shuffle joins 2 x 2
patches, 16 tokens a tile), a Qwen2 decoder of 4 layers. The profile's 128 x 64 image (H x W) is 2 tiles
and a thumbnail: 3 tower items, 48 visual tokens; prompts are 12 text tokens around the span
("<|im_start|>user\\n<img>" ... "</img>\\n{question}<|im_end|>\\n<|im_start|>assistant\\n").
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import ficoco
from ficoco.accounting import architecture, parameter_counts
from ficoco.accounting.families import FAMILIES
from ficoco.accounting.shapes import Layout
from ficoco.api import profile_of
from ficoco.errors import FicocoError
from ficoco.methods.ops import pixel_shuffle_order as group_order
from ficoco.methods.registry import METHODS
from ficoco.models import hf_compat as hf
from ficoco.models.hf_compat import cache_argument, output_cache
from ficoco.models.internvl import PREFIX_TOKENS, synthetic_inputs
from ficoco.profiles import load_profile, set_layout
from ficoco.profiling.verify import verify

NAME = "internvl3-tiny"
TINY_PROFILE = NAME  # built as this module's `model` (conftest.py)
TEXT = 12
UNITS = 16  # pixel-shuffle groups (LLM tokens) of a tile
ITEMS = 3
VISUAL = ITEMS * UNITS
IMAGE_TOKEN = 300
NEW = 4
# A setting of every method the models run here that reduces, and one that is the unreduced model.
REDUCING = {"v": {"keep": 24}, "tome": {"keep": 8}, "l": {"keep": 30}, "fastv": {"keep": 30}, "pdrop": {"keep": 24},
            "sparsevlm": {"schedule": {2: 12}}, "dart": {"keep": 24}, "visionzip": {"keep": 8},
            "vispruner": {"keep": 8}, "fastervlm": {"keep": 8}, "divprune": {"keep": 8}, "cdpruner": {"keep": 8},
            "prumerge": {"keep": 8}, "hiprune": {"keep": 8, "alpha": 0.7}, "vlmpruner": {"keep": 24}, "fitprune": {},
            "gprune": {"keep": 8}, "vtw": {"layer": 2},
            "vscan": {"keep": 6}}
IDENTITY = {"v": {"schedule": {}}, "tome": {"schedule": {}}, "l": {"schedule": {}}, "fastv": {"keep": VISUAL},
            "pdrop": {"keep": VISUAL}, "sparsevlm": {"schedule": {}}, "dart": {"keep": VISUAL},
            "visionzip": {"keep": UNITS}, "vispruner": {"keep": UNITS}, "fastervlm": {"keep": UNITS},
            "divprune": {"keep": UNITS}, "cdpruner": {"keep": UNITS}, "hiprune": {"keep": UNITS},
            "gprune": {"keep": UNITS}, "vscan": {"keep": UNITS}}


def inputs(model: nn.Module, batch: int = 1, seed: int = 0, **kwargs: Any) -> dict[str, Tensor]:
    return synthetic_inputs(model, batch=batch, text_tokens=TEXT, seed=seed, **kwargs)


def sample(batch: dict[str, Tensor], i: int) -> dict[str, Tensor]:
    """Sample `i` of a batch of one image each (pixel rows are tiles, ITEMS per sample)."""
    return {k: v[i * ITEMS:(i + 1) * ITEMS] if k == "pixel_values" else v[i:i + 1] for k, v in batch.items()}


def greedy(model: nn.Module, inp: dict[str, Tensor], **kwargs: Any) -> Any:
    return model.generate(**inp, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, **kwargs)


def config_dict(name: str) -> dict[str, Any]:
    return copy.deepcopy(load_profile(name).config)


def shape_of(cfg: dict[str, Any], image_size: tuple[int, int] = (128, 64), **defaults: Any) -> Any:
    layout = Layout(name="x", family="internvl", defaults={"min_tiles": 1, "max_tiles": 12, **defaults},
                    text_tokens=TEXT, first_reducing_layers=(), image_size=image_size, frames=None)
    return FAMILIES["internvl"].shape(cfg, layout)


def meta_model(cfg: dict[str, Any]) -> nn.Module:
    from transformers import AutoConfig, InternVLForConditionalGeneration

    data = {k: v for k, v in cfg.items() if k != "model_type"}
    with torch.device("meta"):
        return InternVLForConditionalGeneration(AutoConfig.for_model("internvl", **data))


def part_sizes(model: nn.Module) -> dict[str, int]:
    inner = model.model
    return {"vision": sum(p.numel() for p in inner.vision_tower.parameters()),
            "projector": sum(p.numel() for p in inner.multi_modal_projector.parameters()),
            "decoder": sum(p.numel() for p in inner.language_model.parameters()),
            "total": sum(p.numel() for p in model.parameters())}  # a tied head is counted once


# -- the accountant's shapes are transformers' ------------------------------------------------------

VARIANTS = [{}, {"vision_config.use_qk_norm": True, "vision_config.norm_type": "rms_norm"},
            {"vision_config.attention_bias": False, "vision_config.use_mean_pooling": False,
             "vision_config.use_mask_token": True, "tie_word_embeddings": None}]


@pytest.mark.parametrize("edits", VARIANTS, ids=["tiny", "qk-norm-rms", "no-bias-final-norm-mask-tied"])
def test_parameter_counts_equal_the_built_models(edits: dict[str, Any]) -> None:
    cfg = config_dict(NAME)
    for key, value in edits.items():
        section, _, name = key.rpartition(".")
        target = cfg[section] if section else cfg
        if value is None:
            target.pop(name)  # InternVLConfig's default: a tied LM head
        else:
            target[name] = value
    counts = parameter_counts(shape_of(cfg))
    sizes = part_sizes(meta_model(cfg))
    assert (counts.vision, counts.projector, counts.decoder, counts.total) == \
        (sizes["vision"], sizes["projector"], sizes["decoder"], sizes["total"])


def test_parameter_counts_of_internvl3_8b_equal_the_model_on_the_meta_device() -> None:
    counts = parameter_counts(architecture(load_profile("internvl3-8b")))
    sizes = part_sizes(meta_model(config_dict("internvl3-8b")))
    assert (counts.vision, counts.projector, counts.decoder, counts.total) == \
        (sizes["vision"], sizes["projector"], sizes["decoder"], sizes["total"]) == \
        (304_012_288, 27_540_480, 7_069_221_376, 7_944_373_760)


@pytest.mark.parametrize(("size", "low", "high"), [((128, 64), 1, 12), ((64, 128), 1, 12), ((64, 64), 1, 12),
                                                   ((128, 128), 1, 12), ((60, 400), 1, 12), ((300, 200), 2, 6),
                                                   ((128, 64), 1, 1)])
def test_tiles_are_the_processors(model: nn.Module, size: tuple[int, int], low: int, high: int) -> None:
    arch = shape_of(config_dict(NAME), size, min_tiles=low, max_tiles=high)
    tiles = hf.internvl_tiles(size, (64, 64), low, high)
    assert arch.vision.items == tiles and arch.visual_tokens == tiles * UNITS
    assert arch.vision.tokens(UNITS) == 65 and arch.vision.merge == 4  # 64 patches and [CLS] in every layer


def test_synthetic_prompt_is_the_chat_template_and_the_model_takes_it(model: nn.Module) -> None:
    inp = inputs(model, batch=2)
    ids = inp["input_ids"]
    assert ids.shape == (2, TEXT + VISUAL) and inp["pixel_values"].shape == (2 * ITEMS, 3, 64, 64)
    assert PREFIX_TOKENS == FAMILIES["internvl"].prefix_tokens
    assert ids[0, PREFIX_TOKENS - 1] == IMAGE_TOKEN - 2 and ids[0, PREFIX_TOKENS + VISUAL] == IMAGE_TOKEN - 1
    assert bool((ids[:, PREFIX_TOKENS:PREFIX_TOKENS + VISUAL] == IMAGE_TOKEN).all())
    assert model(**inp).logits.shape[1] == TEXT + VISUAL


def test_group_order_is_pixel_shuffles() -> None:
    """The patches of every shuffled token, as transformers packs them (channel = patch index)."""
    grid = torch.arange(64.0).view(1, 8, 8, 1)
    shuffled = type(meta_model(config_dict(NAME)).model).pixel_shuffle(None, grid, 0.5).reshape(-1)
    assert torch.equal(shuffled.long(), group_order(8, 2))


GEOMETRY = [({"vision_config.image_size": [64, 48]}, "square"),
            ({"vision_config.image_size": [56, 56], "image_seq_length": 9}, "pixel-shuffle groups"),
            ({"image_seq_length": 20}, "image_seq_length=20 .* give image_seq_length=16"),
            ({"downsample_ratio": 0.4}, "1 / a whole number"),
            ({"vision_feature_select_strategy": "full"}, "give 'default'"),
            ({"vision_config.num_attention_heads": 5}, "InternVLVisionAttention"),
            ({"vision_config.norm_type": "batch_norm"}, "norm_type")]


@pytest.mark.parametrize(("edits", "match"), GEOMETRY, ids=[m.split()[0] for _, m in GEOMETRY])
def test_geometry_transformers_refuses_is_refused_in_one_line(edits: dict[str, Any], match: str) -> None:
    cfg = config_dict(NAME)
    for key, value in edits.items():
        section, _, name = key.rpartition(".")
        (cfg[section] if section else cfg)[name] = value
    with pytest.raises(FicocoError, match=match) as caught:
        shape_of(cfg)
    assert "\n" not in str(caught.value)


# -- the methods inside the model ---------------------------------------------------------------

@pytest.mark.parametrize("method", sorted(IDENTITY))
def test_identity_settings_are_the_unpatched_model(model: nn.Module, method: str) -> None:
    inp = inputs(model, batch=2)
    labels = inp["input_ids"].masked_fill(inp["input_ids"] == IMAGE_TOKEN, -100)
    with torch.no_grad():
        reference = model(**inp, labels=labels)
        with ficoco.apply(model, method, **IDENTITY[method]) as handle:
            out = model(**inp, labels=labels)
    assert not any(r.remove for r in handle.schedule.removals)
    assert torch.equal(out.logits, reference.logits) and torch.equal(out.loss, reference.loss)


def test_every_method_runs_or_refuses_in_one_line(model: nn.Module) -> None:
    inp = inputs(model, seed=2)
    for name, spec in METHODS.items():
        status, reason = spec.family_status("internvl")
        if status == "yes":
            with torch.no_grad(), ficoco.apply(model, name, **REDUCING[name]) as handle:
                logits = model(**inp).logits
            arch = architecture(profile_of(model, NAME))
            from ficoco.accounting.schedule import plan_tokens

            assert logits.shape[1] == TEXT + plan_tokens(arch, handle.schedule).visual_tokens < TEXT + VISUAL, name
            continue
        assert reason and name not in REDUCING
        with pytest.raises(FicocoError) as caught:
            ficoco.apply(model, name, keep=8)
        assert "\n" not in str(caught.value) and reason in str(caught.value)
        assert "forward" not in model.__dict__


def test_cuts_keep_whole_groups_scored_by_their_patches_cls_attention(model: nn.Module) -> None:
    """FasterVLM keeps, in every tile, the groups whose 4 patches [CLS] attends to most on average (head
    mean, the last layer), in image order; the records name the kept groups' patches."""
    inp = inputs(model, seed=5)
    attention = model.model.vision_tower.encoder.layer[-1].attention
    seen: dict[str, Tensor] = {}
    hooks = [attention.q_proj.register_forward_hook(lambda m, a, o: seen.__setitem__("q", o)),
             attention.k_proj.register_forward_hook(lambda m, a, o: seen.__setitem__("k", o))]
    with torch.no_grad():
        model(**inp)
    for hook in hooks:
        hook.remove()
    heads = model.config.vision_config.num_attention_heads
    q, k = (seen[x].view(ITEMS, 65, heads, -1).transpose(1, 2) for x in ("q", "k"))
    row = torch.softmax(q[:, :, :1] @ k.transpose(-1, -2) * q.shape[-1] ** -0.5, dim=-1)[:, :, 0, 1:].mean(1)
    groups = row[:, group_order(8, 2)].view(ITEMS, UNITS, 4).mean(-1)
    expected = groups.topk(6, dim=1).indices.sort(dim=1).values
    with torch.no_grad(), ficoco.apply(model, "fastervlm", keep=6) as handle:
        model(**inp)
    kept = handle.records[0].kept
    assert torch.equal(kept, group_order(8, 2).view(UNITS, 4)[expected].flatten(1).sort(dim=1).values)


def test_v_removes_whole_groups_and_every_layer_runs_the_plan(model: nn.Module) -> None:
    """FiCoCo-V removes whole pixel-shuffle groups inside InternViT (layers 1 and 2 here): kept and discarded
    patches are whole 2 x 2 groups partitioning the previous kept set, every later layer runs [CLS] and the
    kept groups' patches, and the projector maps the kept groups' tokens only."""
    from ficoco.accounting.schedule import plan_tokens

    inp = inputs(model, batch=2, seed=6)
    seen: dict[str, list[int]] = {"vision": [], "projector": []}
    hooks = [layer.register_forward_pre_hook(lambda m, a, k: seen["vision"].append(a[0].shape[1]), with_kwargs=True)
             for layer in model.model.vision_tower.encoder.layer]
    hooks.append(model.model.multi_modal_projector.layer_norm.register_forward_pre_hook(
        lambda m, a: seen["projector"].append(a[0].shape[1])))
    try:
        with torch.no_grad(), ficoco.apply(model, "v", schedule={1: 5, 2: 3}) as handle:
            model(**inp)
    finally:
        for hook in hooks:
            hook.remove()
    plan = plan_tokens(architecture(profile_of(model, NAME)), handle.schedule, text_tokens=TEXT)
    assert seen["vision"] == [n_in for n_in, _ in plan.vision] == [65, 65, 45]
    assert seen["projector"] == [UNITS - 8]
    group_of = torch.empty(64, dtype=torch.long)
    group_of[group_order(8, 2)] = torch.arange(64) // 4
    previous = torch.arange(64).expand(2 * ITEMS, -1)
    for record, removed in zip(handle.records, (5, 3), strict=True):
        assert record.discarded.shape == (2 * ITEMS, 4 * removed)
        for part in (record.kept, record.discarded):
            counts = torch.stack([(group_of[part] == g).sum(1) for g in range(UNITS)], 1)
            assert bool(((counts == 0) | (counts == 4)).all())
        assert torch.equal(torch.cat([record.kept, record.discarded], 1).sort(1).values, previous)
        assert bool(torch.isin(record.merged_into, record.kept).all())
        previous = record.kept


def test_tome_merges_whole_groups_and_later_layers_weigh_them_by_size(model: nn.Module) -> None:
    """ToMe merges whole pixel-shuffle groups (a group's 4 patches side by side, [CLS] protected); every layer
    after a merge adds log(size of the patch's group) to its keys' logits, as the official proportional
    attention does per token."""
    inp = inputs(model, seed=7)
    masks: list[Any] = []
    attention = model.model.vision_tower.encoder.layer[2].attention
    hook = attention.register_forward_pre_hook(lambda m, a, k: masks.append(k.get("attention_mask")),
                                               with_kwargs=True)
    try:
        with torch.no_grad(), ficoco.apply(model, "tome", schedule={1: 6}) as handle:
            logits = model(**inp).logits
    finally:
        hook.remove()
    assert logits.shape[1] == TEXT + ITEMS * (UNITS - 6)
    record = handle.records[0]
    assert record.kept.shape == (ITEMS, 4 * (UNITS - 6)) and record.discarded.shape == (ITEMS, 24)
    group_of = torch.empty(64, dtype=torch.long)
    group_of[group_order(8, 2)] = torch.arange(64) // 4
    for part in (record.kept, record.discarded):
        counts = torch.stack([(group_of[part] == g).sum(1) for g in range(UNITS)], 1)
        assert bool(((counts == 0) | (counts == 4)).all())
    bias = masks[0]
    assert bias.shape == (ITEMS, 1, 1, 1 + 4 * (UNITS - 6))
    sizes = bias[:, 0, 0, 1:].exp().round().view(ITEMS, -1, 4)
    assert bool((sizes == sizes[..., :1]).all())  # a group's patches weigh alike
    assert bias[:, 0, 0, 0].abs().max() == 0 and sizes.sum(dim=(1, 2)).tolist() == [4 * UNITS] * ITEMS


@pytest.mark.parametrize("method", ["v", "tome", "l", "fastv", "fastervlm", "visionzip"])
def test_batch_generate_and_labels_equal_samples_alone(model: nn.Module, method: str) -> None:
    batch = inputs(model, batch=2, seed=4)
    labels = batch["input_ids"].masked_fill(batch["input_ids"] == IMAGE_TOKEN, -100)
    with torch.no_grad(), ficoco.apply(model, method, **REDUCING[method]) as handle:
        out = model(**batch, labels=labels)
        kept_labels = torch.gather(labels, 1, handle.output_positions)
        tokens = greedy(model, batch)
        for i in range(2):
            alone = sample(batch, i)
            torch.testing.assert_close(out.logits[i:i + 1], model(**alone).logits, atol=1e-5, rtol=0)
            assert torch.equal(tokens[i:i + 1], greedy(model, alone))
    vocab = model.config.text_config.vocab_size
    assert torch.equal(out.loss, model.loss_function(logits=out.logits, labels=kept_labels, vocab_size=vocab))
    assert out.logits.shape[1] < batch["input_ids"].shape[1]
    assert torch.equal(tokens[:, :batch["input_ids"].shape[1]], batch["input_ids"])  # the caller's prompt back


def test_prumerge_adaptive_count_is_measured_per_call_and_tiles_must_agree(model: nn.Module) -> None:
    """PruMerge+ without keep=: IQR outliers of [CLS]'s attention summed over each group's patches, measured
    per call; one tile's count shortens its span, tiles of one call that disagree are refused in one line."""
    one = inputs(model, image_size=(64, 64), seed=9)
    with torch.no_grad(), ficoco.apply(model, "prumerge", image_size=(64, 64)) as handle:
        logits = model(**one).logits
        measured = handle.measured_tokens_per_item
    assert 2 <= measured < UNITS and logits.shape[1] == TEXT + measured
    with ficoco.apply(model, "prumerge"), pytest.raises(FicocoError, match="differs between the tiles") as caught:
        model(**inputs(model, batch=2))
    assert "\n" not in str(caught.value)


# FastV (and the other layer-input methods) score by the prompt's last token, which a later turn moves: the whole
# conversation in one prompt is not their reference.
@pytest.mark.parametrize("method", ["v", "l", "fastervlm", "visionzip"])
def test_text_turn_on_the_cache_equals_the_whole_conversation(model: nn.Module, method: str) -> None:
    first = inputs(model, seed=36)
    question = inputs(model, seed=37)["input_ids"][:, -4:]
    with torch.no_grad(), ficoco.apply(model, method, **REDUCING[method]):
        turn1 = greedy(model, first, return_dict_in_generate=True)
        ids = torch.cat([turn1.sequences, question], dim=1)
        nxt = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        turn2 = greedy(model, nxt, return_dict_in_generate=True, **cache_argument(output_cache(turn1)))
        whole = greedy(model, {**nxt, "pixel_values": first["pixel_values"]}, return_dict_in_generate=True)
    assert torch.equal(turn2.sequences[:, :ids.shape[1]], ids)
    assert torch.equal(turn2.sequences, whole.sequences)


def test_other_image_sizes_tile_as_the_accountant_plans(model: nn.Module) -> None:
    profile = profile_of(model, NAME)
    set_layout(profile, image_size=(64, 192))
    arch = architecture(profile)
    inp = inputs(model, image_size=(64, 192))
    assert inp["pixel_values"].shape[0] == arch.vision.items == 4  # 3 tiles and a thumbnail
    with torch.no_grad(), ficoco.apply(model, "fastervlm", keep=5, image_size=(64, 192)):
        assert model(**inp).logits.shape[1] == TEXT + 4 * 5


def test_verify_passes_on_tiny_within_half_a_percent(model: nn.Module) -> None:
    profile = profile_of(model, NAME)
    arch = architecture(profile)
    from ficoco.accounting import CountOptions, resolve_schedule

    schedules = [resolve_schedule(arch, variant, CountOptions(), keep=keep)
                 for variant, keep in (("vanilla", None), ("v", 24), ("tome", 8), ("l", 30), ("fastervlm", 8),
                                       ("visionzip", 8))]
    result = verify(profile, schedules, text_tokens=TEXT, model=model)
    assert result.passed and result.largest_fvcore_diff <= 0.005
    for run in result.runs:
        assert not run.skipped_matrix_ops
        assert all(abs(stage.torch_diff) <= 0.005 for stage in run.stages), run.variant


def test_real_prompt_of_a_local_checkout_is_the_accountants_layout(tmp_path: Any) -> None:
    """A 150 x 90 picture through the checkout's GotOcr2 image processor (tiles, thumbnail) and its ChatML
    template: the placeholders are the accountant's, the model takes them, and a cut and FiCoCo-L run."""
    import sys
    from pathlib import Path

    from PIL import Image

    from ficoco.models.prompt import encode_prompt

    sys.path.insert(0, str(Path(__file__).parent))
    from helpers import make_checkpoint

    folder = make_checkpoint("internvl", tmp_path / "internvl")
    picture = tmp_path / "wide.png"
    Image.new("RGB", (150, 90), (40, 90, 160)).save(picture)
    profile = load_profile(str(folder))
    prompt = encode_prompt(str(folder), profile.config, image=str(picture), prompt="What is shown?")
    assert prompt.text.startswith("<|im_start|>user\n<IMG_CONTEXT>\nWhat is shown?<|im_end|>")
    assert prompt.image_size == (90, 150)
    set_layout(profile, image_size=prompt.image_size)
    arch = architecture(profile)
    assert arch.visual_tokens == prompt.visual_tokens == int((prompt.encoded["input_ids"] == IMAGE_TOKEN).sum())
    assert prompt.encoded["pixel_values"].shape[0] == arch.vision.items
    model = ficoco.build_model(str(folder), dtype="fp32", check_memory=False)
    with torch.no_grad():
        assert model(**prompt.encoded).logits.shape[1] == prompt.encoded["input_ids"].shape[1]
        with ficoco.apply(model, "fastervlm", keep=4, image_size=prompt.image_size):
            assert model(**prompt.encoded).logits.shape[1] == prompt.text_tokens + arch.vision.items * 4
        with ficoco.apply(model, "l", keep=10, first_layer=1, image_size=prompt.image_size):
            assert model(**prompt.encoded).logits.shape[1] == prompt.text_tokens + 10
