"""ToMe, VisionZip, FasterVLM and PruMerge+ inside LLaVA-NeXT, per crop (issue 15): every item
(base view and crops) reduced alike through the tower/projector hook points, packed in AnyRes
order, the prompt's spans shortened before the LLM runs; decoding, labels, several images, a
conversation on its cache, flops --verify. Seeded random llava-next-tiny models, fp32, CPU.

llava-next-tiny: a 6-layer CLIP tower over 56 px items (4 x 4 = 16 patches, [CLS] first; the
projector reads layer 4), a 4-layer LLaMA decoder. A 112 x 112 image is a base view and 2 x 2
crops (5 items; the crops' 8 x 8 grid, one newline per row: 16 + 64 + 8 = 88 tokens); a 56 x 112
(H x W) image a base view and 1 x 2 crops (3 items; a 4 x 8 grid: 16 + 32 + 4 = 52 tokens).
Neither unpadding drops a token. `keep` counts tokens per item for these methods.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from helpers import assert_batch_equals_samples_alone, prefill_and_decode
from torch import Tensor, nn

import ficoco
from ficoco.accounting import architecture
from ficoco.accounting.schedule import plan_tokens
from ficoco.api import profile_of
from ficoco.errors import FicocoError
from ficoco.models.hf_compat import cache_argument, output_cache
from ficoco.models.llava_next import PREFIX_TOKENS, image_layout, synthetic_inputs

TEXT = 12
SIDE = 4
PATCHES = SIDE * SIDE
IMAGE_TOKEN = 300
NEW = 5
KEEP = 8  # tokens per item
METHODS = ("tome", "visionzip", "fastervlm", "prumerge")
SQUARE, WIDE = (112, 112), (56, 112)  # (H, W)
# Independent of the code under test: (crops high, crops wide) and unreduced tokens of each size.
CROPS = {SQUARE: (2, 2), WIDE: (1, 2)}
TOKENS = {SQUARE: 88, WIDE: 52}


def items_of(size: tuple[int, int]) -> int:
    return 1 + CROPS[size][0] * CROPS[size][1]


def rows_of(size: tuple[int, int]) -> int:
    return CROPS[size][0] * SIDE


def reduced(size: tuple[int, int], per_item: int = KEEP) -> int:
    """Visual tokens of an image when every item hands the LLM `per_item` tokens."""
    return items_of(size) * per_item + rows_of(size)


TINY_PROFILE = "llava-next-tiny"  # built as this module's `model` (conftest.py)


def inputs(model: nn.Module, batch: int = 1, seed: int = 0, size: tuple[int, int] = SQUARE,
           text: int = TEXT) -> dict[str, Tensor]:
    return synthetic_inputs(model, batch=batch, text_tokens=text, seed=seed, image_size=size)


def greedy(model: nn.Module, inp: dict[str, Tensor], new: int = NEW) -> Tensor:
    return model.generate(**inp, max_new_tokens=new, min_new_tokens=new, do_sample=False)


def two_images(model: nn.Module, sizes: tuple[tuple[int, int], ...], batch: int = 1, seed: int = 0
               ) -> dict[str, Tensor]:
    """One prompt per sample holding an image of each of `sizes` (two text tokens between the
    spans), as the processor lays it out: pixel_values padded to the most items, image_sizes
    sample-major."""
    singles = [inputs(model, batch=batch, seed=seed + i, size=size) for i, size in enumerate(sizes)]
    pieces = [singles[0]["input_ids"][:, :PREFIX_TOKENS]]
    for i, (single, size) in enumerate(zip(singles, sizes, strict=True)):
        span = single["input_ids"][:, PREFIX_TOKENS:PREFIX_TOKENS + TOKENS[size]]
        assert bool((span == IMAGE_TOKEN).all())
        pieces.append(span)
        if i < len(sizes) - 1:
            pieces.append(single["input_ids"][:, -2:])
    pieces.append(singles[0]["input_ids"][:, PREFIX_TOKENS + TOKENS[sizes[0]]:])
    input_ids = torch.cat(pieces, dim=1)
    most = max(items_of(size) for size in sizes)
    pixels = []
    for b in range(batch):
        for single in singles:
            item = single["pixel_values"][b]
            pixels.append(torch.cat([item, item.new_zeros(most - item.shape[0], *item.shape[1:])]))
    return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids),
            "pixel_values": torch.stack(pixels),
            "image_sizes": torch.stack([s["image_sizes"][b] for b in range(batch) for s in singles])}


@contextlib.contextmanager
def captured(model: nn.Module) -> Iterator[dict[str, Any]]:
    """The projector's output (items, k, D), the decoder's input embeddings, and the tokens every
    tower and decoder layer's attention ran on, in the next forward."""
    seen: dict[str, Any] = {"vision": [], "llm": []}

    def projector(module: nn.Module, args: tuple, output: Tensor) -> None:
        seen["projected"] = output

    def decoder(module: nn.Module, args: tuple, kwargs: dict) -> None:
        seen.setdefault("embeds", kwargs["inputs_embeds"])

    hooks = [model.model.multi_modal_projector.register_forward_hook(projector),
             model.model.language_model.register_forward_pre_hook(decoder, with_kwargs=True)]
    for stage, layers in (("vision", model.model.vision_tower.encoder.layers),
                          ("llm", model.model.language_model.layers)):
        for layer in layers:
            hooks.append(layer.self_attn.register_forward_pre_hook(
                lambda m, args, kwargs, stage=stage: seen[stage].append(
                    tuple((args[0] if args else kwargs["hidden_states"]).shape[:2])), with_kwargs=True))
    try:
        yield seen
    finally:
        for hook in hooks:
            hook.remove()


# -- identity settings -------------------------------------------------------------------------

@pytest.mark.parametrize("method,setting", [
    ("tome", {"keep": PATCHES}),  # every layer's r is 0
    # VisionZip's identity: [CLS] left out of the dominant tokens (ficoco's correction); with the official [CLS]
    # among them a patch makes room for it.
    ("visionzip", {"dominant": PATCHES, "contextual": 0, "include_cls": False}),
    ("fastervlm", {"keep": PATCHES}),
])
def test_full_keep_is_bitwise_vanilla_where_the_method_has_an_identity(model: nn.Module, method: str,
                                                                      setting: dict) -> None:
    inp = inputs(model, batch=2)
    labels = inp["input_ids"].masked_fill(inp["input_ids"] == IMAGE_TOKEN, -100)
    with torch.no_grad():
        reference = model(**inp, labels=labels)
        reference_tokens = greedy(model, inp)
        with ficoco.apply(model, method, **setting) as handle:
            assert "pack_image_features" in model.model.__dict__  # the method's packing really runs
            out = model(**inp, labels=labels)
            tokens = greedy(model, inp)
    assert not any(r.remove for r in handle.schedule.removals)
    assert torch.equal(out.logits, reference.logits) and torch.equal(out.loss, reference.loss)
    assert torch.equal(tokens, reference_tokens)
    assert "pack_image_features" not in model.model.__dict__


# -- counts: every layer, and the accountant's numbers for the image's size -------------------------

@pytest.mark.parametrize("method", METHODS)
def test_tokens_of_every_tower_and_decoder_layer_equal_the_plan(model: nn.Module, method: str) -> None:
    batch = 2
    inp = inputs(model, batch=batch, seed=1)
    with torch.no_grad(), ficoco.apply(model, method, keep=KEEP) as handle, captured(model) as seen:
        logits = model(**inp).logits
    plan = plan_tokens(architecture(profile_of(model)), handle.schedule, text_tokens=TEXT)
    assert seen["vision"] == [(batch * items_of(SQUARE), n_in) for n_in, _ in plan.vision]
    assert seen["llm"] == [(batch, n_in) for n_in, _ in plan.llm]
    assert logits.shape[1] == TEXT + reduced(SQUARE) == TEXT + plan.llm_visual_tokens == TEXT + handle.keep_per_image
    assert handle.measured_tokens_per_item == KEEP


def test_visionzip_at_the_edge_cuts_every_item_with_cls_among_its_dominant_tokens(model: nn.Module) -> None:
    """keep=16, 14 dominant + 2 contextual = every patch of an item: with the official [CLS] among the dominant tokens
    13 patches stay and 3 remain for 2 contextual tokens, so every item's cut runs (the plan says so) and the LLM
    receives the planned count, the unreduced one."""
    inp = inputs(model, batch=2, seed=1)
    with torch.no_grad(), ficoco.apply(model, "visionzip", keep=PATCHES) as handle, captured(model) as seen:
        logits = model(**inp).logits
    plan = plan_tokens(architecture(profile_of(model)), handle.schedule, text_tokens=TEXT)
    assert [(r.where, r.remove, r.added) for r in handle.schedule.removals] == [("tower_output", 2, 2)]
    assert logits.shape[1] == TEXT + plan.llm_visual_tokens == TEXT + TOKENS[SQUARE] and seen["llm"][0][1] == \
        logits.shape[1]
    (record,) = handle.records
    assert record.kept.shape[0] == 2 * items_of(SQUARE)
    assert ((record.kept >= 0).sum(dim=1) == 13).all() and (record.kept[:, 0] == -1).all()


@pytest.mark.parametrize("size", [SQUARE, WIDE])
def test_measured_visual_tokens_per_image_equal_ficoco_flops_at_that_size(model: nn.Module, size: tuple[int, int],
                                                                         tmp_path: Any, cli: Any) -> None:
    """`ficoco flops --image-size WxH` (the CLI's report) counts what the model runs, for every method;
    a model planned at the profile's 112 x 112 still shortens a 56 x 112 image to its own count."""
    path = tmp_path / "flops.json"
    result = cli("flops", "--model", "llava-next-tiny", "--variant", ",".join(METHODS), "--keep", KEEP,
                 "--image-size", f"{size[1]}x{size[0]}", "--json", path, in_subprocess=True)
    assert result.code == 0, result.err
    planned = {row["variant"]: row["visual_tokens"] for row in json.loads(path.read_text())["rows"]}
    inp = inputs(model, seed=2, size=size)
    for method in METHODS:
        with torch.no_grad(), ficoco.apply(model, method, keep=KEEP) as handle, captured(model) as seen:
            out = model(**inp)
            positions = handle.output_positions
            tokens = greedy(model, inp, new=2)
        visual = seen["llm"][0][1] - TEXT
        assert visual == planned[method] == reduced(size), method
        assert out.logits.shape[1] == TEXT + visual
        ids = torch.gather(inp["input_ids"], 1, positions)
        assert int((ids == IMAGE_TOKEN).sum()) == visual  # output_positions name the placeholders that remain
        assert torch.equal(tokens[:, :inp["input_ids"].shape[1]], inp["input_ids"])


# -- the packed order, checked by hand ------------------------------------------------------------

def packed_by_hand(features: Tensor, kept: Tensor, newline: Tensor, crops_hw: tuple[int, int]) -> Tensor:
    """An image's span from its items' tokens (items, k, D) and their patch indices (items, k; -1:
    no grid place), the placement rule in plain Python: the base view as it comes; every crop grid
    row's placed tokens by column, then a newline; then every crop's unplaced tokens, crop by crop."""
    crops_h, crops_w = crops_hw
    out = [features[0, j] for j in range(features.shape[1])]
    rows: dict[int, list[tuple[int, Tensor]]] = {r: [] for r in range(crops_h * SIDE)}
    unplaced = []
    for crop in range(1, features.shape[0]):
        for j, patch in enumerate(kept[crop].tolist()):
            if patch < 0:
                unplaced.append(features[crop, j])
                continue
            row = ((crop - 1) // crops_w) * SIDE + patch // SIDE
            col = ((crop - 1) % crops_w) * SIDE + patch % SIDE
            rows[row].append((col, features[crop, j]))
    for row in sorted(rows):
        out += [token for _, token in sorted(rows[row], key=lambda pair: pair[0])] + [newline]
    return torch.stack(out + unplaced)


@pytest.mark.parametrize("size", [SQUARE, WIDE])
def test_layout_pack_places_every_placed_token_and_puts_the_extras_after_the_grid(model: nn.Module,
                                                                                  size: tuple[int, int]) -> None:
    layout = image_layout(model.config, size)
    generator = torch.Generator().manual_seed(7)
    items = items_of(size)
    for placed, unplaced in ((PATCHES, 0), (5, 0), (5, 3), (1, 2)):
        kept = torch.stack([torch.randperm(PATCHES, generator=generator)[:placed] for _ in range(items)])
        kept = torch.cat([kept, torch.full((items, unplaced), -1)], dim=1)
        kept = torch.stack([row[torch.randperm(row.numel(), generator=generator)] for row in kept])  # any order
        features = torch.randn(items, placed + unplaced, 3, generator=generator)
        newline = torch.randn(3, generator=generator)
        packed = layout.pack(features, kept, newline)
        assert torch.equal(packed, packed_by_hand(features, kept, newline, CROPS[size]))
        assert packed.shape[0] == layout.reduced_tokens(placed, unplaced) == items * (placed + unplaced) + rows_of(size)


@pytest.mark.parametrize("method", METHODS)
def test_the_image_span_is_each_items_tokens_in_anyres_order(model: nn.Module, method: str) -> None:
    """The LLM's input span equals the hand packing of the projector's output, read with the patch
    each token continues from the method's own record (its last step's kept indices)."""
    batch = 2
    inp = inputs(model, batch=batch, seed=3)
    with torch.no_grad(), ficoco.apply(model, method, keep=KEEP) as handle, captured(model) as seen:
        model(**inp)
        kept = handle.records[-1].kept
    items = items_of(SQUARE)
    projected = seen["projected"]
    assert tuple(projected.shape[:2]) == tuple(kept.shape) == (batch * items, KEEP)
    if method in ("visionzip", "prumerge"):  # contextual / extra tokens have no grid place
        assert bool((kept < 0).any())
    span = seen["embeds"][:, PREFIX_TOKENS:PREFIX_TOKENS + reduced(SQUARE)]
    for b in range(batch):
        rows = slice(b * items, (b + 1) * items)
        expected = packed_by_hand(projected[rows], kept[rows], model.model.image_newline, CROPS[SQUARE])
        torch.testing.assert_close(span[b], expected, atol=0, rtol=0)


# -- batches, several images --------------------------------------------------------------------------

def left_padded(model: nn.Module) -> tuple[dict[str, Tensor], list[dict[str, Tensor]]]:
    short, long = inputs(model, seed=4), inputs(model, seed=5, text=TEXT + 3)
    pad = long["input_ids"].shape[1] - short["input_ids"].shape[1]
    zeros = torch.zeros(1, pad, dtype=torch.long)
    batch = {"input_ids": torch.cat([torch.cat([zeros, short["input_ids"]], 1), long["input_ids"]]),
             "attention_mask": torch.cat([torch.cat([zeros, short["attention_mask"]], 1), long["attention_mask"]]),
             "pixel_values": torch.cat([short["pixel_values"], long["pixel_values"]]),
             "image_sizes": torch.cat([short["image_sizes"], long["image_sizes"]])}
    return batch, [short, long]


@pytest.mark.parametrize("method", METHODS)
def test_a_left_padded_batch_equals_its_samples_run_alone(model: nn.Module, method: str) -> None:
    batch, alone = left_padded(model)
    items = items_of(SQUARE)
    with torch.no_grad(), ficoco.apply(model, method, keep=KEEP) as handle:
        together = assert_batch_equals_samples_alone(model, handle, batch, alone, items_per_sample=items)
    assert not torch.allclose(together[0], together[1], atol=1e-3)


@pytest.mark.parametrize("method", METHODS)
def test_two_images_of_different_crop_grids_in_one_prompt_each_as_if_alone(model: nn.Module, method: str) -> None:
    """A 112 x 112 and a 56 x 112 image in every prompt of a batch of two: each span is shortened to
    its own count, and holds what that image's span holds when it is the prompt's only image; the
    batch equals its samples."""
    inp = two_images(model, (SQUARE, WIDE), batch=2, seed=6)
    with torch.no_grad(), ficoco.apply(model, method, keep=KEEP):
        with captured(model) as seen:
            together = model(**inp).logits
        embeds = seen["embeds"]
        second = PREFIX_TOKENS + reduced(SQUARE) + 2
        assert together.shape[1] == TEXT + 2 + reduced(SQUARE) + reduced(WIDE)
        for b in range(2):
            for size, start, seed in ((SQUARE, PREFIX_TOKENS, 6), (WIDE, second, 7)):
                single = inputs(model, batch=2, seed=seed, size=size)
                with captured(model) as alone:
                    model(**{k: v[b:b + 1] for k, v in single.items()})
                span = alone["embeds"][0, PREFIX_TOKENS:PREFIX_TOKENS + reduced(size)]
                torch.testing.assert_close(embeds[b, start:start + reduced(size)], span, atol=1e-5, rtol=0)
            sample = model(**{k: v[b:b + 1] if k != "pixel_values" and k != "image_sizes" else v[2 * b:2 * b + 2]
                              for k, v in inp.items()}).logits
            torch.testing.assert_close(together[b:b + 1], sample, atol=1e-4, rtol=0)


# -- decoding and labels ----------------------------------------------------------------------------

@pytest.mark.parametrize("method", METHODS)
def test_generate_matches_a_hand_written_prefill_and_decode_loop(model: nn.Module, method: str) -> None:
    inp = inputs(model, batch=2, seed=8)
    prompt = inp["input_ids"].shape[1]
    with torch.no_grad(), ficoco.apply(model, method, keep=KEEP) as handle:
        generated = greedy(model, inp)
        # The mask grows from the caller's prompt, as a hand-written loop grows it.
        out, positions, decoded, cache = prefill_and_decode(model, inp, NEW, handle)
    assert torch.equal(generated[:, :prompt], inp["input_ids"])  # the caller's own prompt comes back
    assert torch.equal(generated[:, prompt:], decoded)
    short = prompt - TOKENS[SQUARE] + reduced(SQUARE)
    assert cache.get_seq_length() == short + NEW - 1
    assert positions.shape == out.logits.shape[:2] == (2, short)
    assert torch.equal(positions[:, -1], torch.full((2,), prompt - 1))


@pytest.mark.parametrize("method", METHODS)
def test_labels_give_the_models_loss_over_the_positions_that_remain(model: nn.Module, method: str) -> None:
    inp = inputs(model, batch=2, seed=9)
    labels = inp["input_ids"].masked_fill(inp["input_ids"] == IMAGE_TOKEN, -100)
    with torch.no_grad(), ficoco.apply(model, method, keep=KEEP) as handle:
        out = model(**inp, labels=labels)
        kept_labels = torch.gather(labels, 1, handle.output_positions)
    vocab = model.config.text_config.vocab_size
    expected = model.loss_function(logits=out.logits, labels=kept_labels, vocab_size=vocab)
    assert torch.equal(out.loss, expected) and torch.isfinite(out.loss)


# -- a conversation on its cache ---------------------------------------------------------------------

def next_turn(model: nn.Module, sequences: Tensor, seed: int) -> dict[str, Tensor]:
    """The conversation so far, then a new user turn with a new 56 x 112 image: the whole
    conversation's input_ids and the new turn's image inputs, as HF users continue on a cache."""
    turn = inputs(model, batch=sequences.shape[0], seed=seed, size=WIDE)
    ids = torch.cat([sequences, turn["input_ids"][:, 1:]], dim=1)  # no second BOS
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "pixel_values": turn["pixel_values"],
            "image_sizes": turn["image_sizes"]}


def as_one_prompt(first: dict[str, Tensor], turn: dict[str, Tensor]) -> dict[str, Tensor]:
    """The same conversation without a cache: both turns' images in one call (padded to 5 items)."""
    batch = turn["input_ids"].shape[0]
    pixels = []
    for b in range(batch):
        later = turn["pixel_values"][b]
        pixels += [first["pixel_values"][b], torch.cat([later, later.new_zeros(2, *later.shape[1:])])]
    sizes = torch.stack([first["image_sizes"], turn["image_sizes"]], dim=1).flatten(0, 1)
    return {**turn, "pixel_values": torch.stack(pixels), "image_sizes": sizes}


@pytest.mark.parametrize("method", METHODS)
def test_a_new_image_and_a_text_turn_on_the_cache_equal_the_whole_conversation(model: nn.Module, method: str) -> None:
    options = {"max_new_tokens": NEW, "min_new_tokens": NEW, "do_sample": False, "return_dict_in_generate": True}
    first = inputs(model, batch=2, seed=10)
    question = inputs(model, seed=11)["input_ids"][:, -4:].expand(2, -1)
    with torch.no_grad(), ficoco.apply(model, method, keep=KEEP):
        turn1 = model.generate(**first, **options)
        turn = next_turn(model, turn1.sequences, seed=12)
        turn2 = model.generate(**turn, **cache_argument(output_cache(turn1)), **options)
        whole = model.generate(**as_one_prompt(first, turn), **options)
        length = turn["input_ids"].shape[1]
        assert torch.equal(turn2.sequences[:, :length], turn["input_ids"])
        assert torch.equal(turn2.sequences[:, length:], whole.sequences[:, length:])
        # The cache holds the shortened conversation, as long as the one prompt's.
        visual = reduced(SQUARE) + reduced(WIDE)
        assert output_cache(turn2).get_seq_length() == output_cache(whole).get_seq_length() == \
            length - TOKENS[SQUARE] - TOKENS[WIDE] + visual + NEW - 1
        # A text turn on the first turn's cache: runs only what the cache lacks, as the one prompt.
        turn1 = model.generate(**first, **options)
        ids = torch.cat([turn1.sequences, question], dim=1)
        text = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        later = model.generate(**text, **cache_argument(output_cache(turn1)), **options)
        one = model.generate(**text, pixel_values=first["pixel_values"], image_sizes=first["image_sizes"], **options)
    assert torch.equal(later.sequences, one.sequences)
    assert output_cache(later).get_seq_length() == output_cache(one).get_seq_length()


# -- refusals, in one line ---------------------------------------------------------------------------------

def test_prumerge_adaptive_count_that_differs_between_crops_is_refused_naming_keep(model: nn.Module) -> None:
    inp = inputs(model, seed=13)
    with torch.no_grad(), ficoco.apply(model, "prumerge") as handle:
        assert handle.schedule.settings_dict()["adaptive"] is True
        counts = set()
        for seed in range(4):  # the crops of one image rarely agree; the tiny profile's never did here
            try:
                model(**inputs(model, seed=seed))
            except FicocoError as error:
                assert "\n" not in str(error) and "keep=" in str(error)
                assert "adaptive count differs between the items" in str(error)
                counts.add("refused")
            else:
                counts.add(handle.measured_tokens_per_item)
        assert "refused" in counts
        with pytest.raises(FicocoError, match="keep="):
            greedy(model, inp)


def test_an_image_whose_unpadding_drops_tokens_is_refused_at_the_call(model: nn.Module) -> None:
    size = (60, 100)
    assert image_layout(model.config, size).unpadding_drops > 0
    inp = inputs(model, seed=14, size=size)
    with ficoco.apply(model, "visionzip", keep=KEEP), pytest.raises(FicocoError, match="unpadding") as info:
        model(**inp)
    assert "\n" not in str(info.value) and "VisionZip" in str(info.value)
    with pytest.raises(FicocoError, match="unpadding"):  # planned at that size: refused at apply
        ficoco.apply(model, "fastervlm", keep=KEEP, image_size=size)
    assert "_ficoco_handle" not in model.__dict__


# -- flops --verify ------------------------------------------------------------------------------------

@pytest.mark.parametrize("size", [SQUARE, WIDE])
def test_flops_verify_passes_per_crop_with_the_methods_work_as_its_own_stage(size: tuple[int, int],
                                                                             tmp_path: Any, cli: Any) -> None:
    path = tmp_path / "verify.json"
    result = cli("flops", "--verify", "--model", "llava-next-tiny", "--variant", ",".join(METHODS), "--keep", KEEP,
                 "--image-size", f"{size[1]}x{size[0]}", "--json", path, in_subprocess=True)
    assert result.code == 0, result.err
    runs = json.loads(path.read_text())["runs"]
    assert [run["variant"] for run in runs] == list(METHODS)
    for run in runs:
        stages = {s["stage"]: s for s in run["stages"]}
        assert stages["method"]["analytic_flops"] > 0 and all(s["within_tolerance"] for s in stages.values())
        assert run["visual_tokens"] == reduced(size)
