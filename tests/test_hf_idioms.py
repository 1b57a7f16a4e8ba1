"""The patched model is a faithful Hugging Face model (issue 11, acceptance lines 1-5).

Random seeded tiny models in fp32 on CPU, one per family. Prompts follow each family's
template; prompts of several images repeat the image span with two text tokens between the
spans (Qwen2-VL: <|vision_end|><|vision_start|>), as the processors lay them out. llava-36 is
llava-tiny with 84 px images (6 x 6 = 36 patches), so that 2 and 3 images have keep values
where `images x keep` is a multiple of the span length (the case generate shortened twice).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import ficoco
from ficoco.errors import FicocoError
from ficoco.models import synthetic_inputs
from ficoco.models.hf_compat import cache_argument, output_cache

TEXT = 12  # text tokens per prompt
NEW = 6  # generated tokens

FAMILIES = ["llava-tiny", "llava-next-tiny", "qwen2-vl-tiny", "video-llava-tiny"]
# Visual tokens one image (Video-LLaVA: one video) keeps under V and under L in these tests.
KEEP = {"llava-tiny": 8, "llava-next-tiny": 48, "qwen2-vl-tiny": 8, "video-llava-tiny": 28, "llava-36": 12}
DECODER_LAYERS = 4


@pytest.fixture(scope="module")
def models() -> Iterator[dict[str, nn.Module]]:
    built: dict[str, nn.Module] = {}

    def get(name: str) -> nn.Module:
        if name not in built:
            if name == "llava-36":
                built[name] = ficoco.build_model("llava-tiny", dtype="fp32", overrides=[
                    "vision_config.image_size=84", "image_seq_length=36"])
            elif name.endswith("-eager"):
                built[name] = ficoco.build_model(name.removesuffix("-eager"), dtype="fp32",
                                                 attn_implementation="eager")
            else:
                built[name] = ficoco.build_model(name, dtype="fp32")
        return built[name]

    yield get  # type: ignore[misc]
    built.clear()


def placeholder(model: nn.Module) -> int:
    config = model.config
    if config.model_type == "video_llava":
        return config.video_token_id
    return getattr(config, "image_token_id", None) or config.image_token_index


def inputs(model: nn.Module, batch: int = 1, seed: int = 0) -> dict[str, Tensor]:
    return synthetic_inputs(model, batch=batch, text_tokens=TEXT, seed=seed)


def multi_image_inputs(model: nn.Module, images: int, batch: int = 1, seed: int = 0) -> dict[str, Tensor]:
    """`images` images per prompt (LLaVA-1.5, LLaVA-NeXT, Qwen2-VL), in the family's layout:
    the image inputs of the single-image prompts of seeds seed..seed+images-1, sample-major."""
    config = model.config
    singles = [inputs(model, batch=batch, seed=seed + i) for i in range(images)]
    token = placeholder(model)
    ids = singles[0]["input_ids"]
    is_image = (ids[0] == token).nonzero().flatten()
    start, count = int(is_image[0]), int(is_image.numel())
    pieces = [ids[:, :start]]
    for i, single in enumerate(singles):
        pieces.append(single["input_ids"][:, start:start + count])
        if i < images - 1:
            if config.model_type == "qwen2_vl":
                between = torch.tensor([config.vision_end_token_id, config.vision_start_token_id])
                pieces.append(between.expand(batch, -1))
            else:
                pieces.append(single["input_ids"][:, start + count:start + count + 2])
    pieces.append(ids[:, start + count:])
    input_ids = torch.cat(pieces, dim=1)
    out: dict[str, Tensor] = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}
    if config.model_type == "qwen2_vl":
        per_image = singles[0]["pixel_values"].shape[0] // batch
        out["pixel_values"] = torch.cat([s["pixel_values"][b * per_image:(b + 1) * per_image]
                                         for b in range(batch) for s in singles])
        out["image_grid_thw"] = torch.cat([s["image_grid_thw"][b:b + 1] for b in range(batch) for s in singles])
        out["mm_token_type_ids"] = (input_ids == token).int()
        return out
    out["pixel_values"] = torch.stack([s["pixel_values"][b] for b in range(batch) for s in singles])
    if "image_sizes" in singles[0]:
        out["image_sizes"] = torch.stack([s["image_sizes"][b] for b in range(batch) for s in singles])
    return out


def image_and_video_inputs(model: nn.Module, batch: int = 1, seed: int = 0) -> dict[str, Tensor]:
    """Video-LLaVA: "USER: <image>\\n<video>\\n... ASSISTANT:" with one image and one video."""
    video = inputs(model, batch=batch, seed=seed)
    vision = model.config.vision_config
    patches = (vision.image_size // vision.patch_size) ** 2
    ids = video["input_ids"]
    start = int((ids[0] == model.config.video_token_id).nonzero()[0])
    image = torch.full((batch, patches), model.config.image_token_id)
    input_ids = torch.cat([ids[:, :start], image, ids[:, -2:], ids[:, start:]], dim=1)
    return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids),
            "pixel_values_images": video["pixel_values_videos"][:, 0] * 0.5,
            "pixel_values_videos": video["pixel_values_videos"]}


def greedy_by_hand(model: nn.Module, inp: dict[str, Tensor], new: int) -> Tensor:
    """The greedy new tokens from a prefill and decode steps on its cache: what generate must
    give after the caller's prompt (an independent decode loop). The attention mask grows from
    the caller's prompt, as in a hand-written loop (Qwen2-VL's unpatched decode steps take
    none: with one, transformers recomputes 3-D positions from the mask alone)."""
    out = model(**inp, use_cache=True)
    tokens = [out.logits[:, -1].argmax(-1, keepdim=True)]
    cache = output_cache(out)
    mask = inp["attention_mask"]
    for _ in range(new - 1):
        mask = torch.cat([mask, torch.ones_like(tokens[-1])], dim=1)
        step = {} if model.config.model_type == "qwen2_vl" else {"attention_mask": mask}
        out = model(input_ids=tokens[-1], **cache_argument(cache), use_cache=True, **step)
        tokens.append(out.logits[:, -1].argmax(-1, keepdim=True))
    return torch.cat(tokens, dim=1)


def decoder_entry_lengths(model: nn.Module) -> Iterator[list[list[int]]]:
    """Sequence length entering every decoder layer, per call."""
    layers = model.model.language_model.layers
    seen: list[list[int]] = [[] for _ in layers]
    hooks = [layer.register_forward_pre_hook(
        lambda m, a, k, i=i: seen[i].append((a[0] if a else k["hidden_states"]).shape[1]), with_kwargs=True)
        for i, layer in enumerate(layers)]
    return seen, hooks  # type: ignore[return-value]


# -- line 1: generate returns the caller's prompt, then exactly the new tokens -------------------

@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("variant", ["v", "l"])
def test_generate_returns_the_callers_prompt_then_exactly_the_new_tokens(models: Any, name: str,
                                                                         variant: str) -> None:
    model = models(name)
    inp = inputs(model, batch=2, seed=3)
    length = inp["input_ids"].shape[1]
    with ficoco.apply(model, variant, keep=KEEP[name]):
        expected = greedy_by_hand(model, inp, NEW)
        tensor = model.generate(**inp, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
        out = model.generate(**inp, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                             return_dict_in_generate=True, output_scores=True, output_logits=True)
    assert torch.equal(tensor[:, :length], inp["input_ids"])
    assert torch.equal(tensor[:, length:], expected)  # the usual idiom: exactly the new tokens
    assert torch.equal(out.sequences, tensor)
    assert len(out.scores) == len(out.logits) == NEW
    # Scores line up with the new tokens: greedy picked each one's maximum.
    assert torch.equal(torch.stack(out.logits, 1).argmax(-1), expected)
    assert torch.equal(torch.stack(out.scores, 1).argmax(-1), expected)


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("variant", ["v", "l"])
def test_sampling_and_beam_search_return_the_callers_prompt(models: Any, name: str, variant: str) -> None:
    model = models(name)
    inp = inputs(model, batch=2, seed=4)
    length = inp["input_ids"].shape[1]
    with ficoco.apply(model, variant, keep=KEEP[name]):
        torch.manual_seed(0)
        sampled = model.generate(**inp, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=True, top_k=0)
        torch.manual_seed(0)
        sampled_dict = model.generate(**inp, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=True, top_k=0,
                                      return_dict_in_generate=True, output_scores=True)
        beams = model.generate(**inp, max_new_tokens=NEW, min_new_tokens=NEW, num_beams=3, num_return_sequences=2,
                               do_sample=False, return_dict_in_generate=True, output_scores=True)
    assert torch.equal(sampled[:, :length], inp["input_ids"])
    assert torch.equal(sampled_dict.sequences, sampled)
    assert sampled.shape[1] == length + NEW and len(sampled_dict.scores) == NEW
    # Each sampled token had a finite score (it was allowed at its step).
    chosen = torch.stack(sampled_dict.scores, 1).gather(2, sampled[:, length:, None])
    assert bool(torch.isfinite(chosen).all())
    assert beams.sequences.shape == (4, length + NEW)
    assert torch.equal(beams.sequences[:, :length], inp["input_ids"].repeat_interleave(2, dim=0))
    assert len(beams.scores) == NEW


def test_more_new_tokens_than_v_removed_are_all_returned(models: Any) -> None:
    model = models("llava-tiny")
    inp = inputs(model, seed=5)
    length = inp["input_ids"].shape[1]
    new = 64 - 8 + 4  # V removes 56 placeholders of the 64
    with ficoco.apply(model, "v", keep=8):
        out = model.generate(**inp, max_new_tokens=new, min_new_tokens=new, do_sample=False)
        expected = greedy_by_hand(model, inp, new)
    assert torch.equal(out[:, length:], expected)


# -- line 2: labels give a loss; the handle maps output positions to input positions --------------

def image_labels(model: nn.Module, inp: dict[str, Tensor]) -> Tensor:
    """Labels in the families' convention: the input ids, -100 on every image placeholder."""
    ids = inp["input_ids"]
    config = model.config
    visual = [t for t in (getattr(config, "image_token_id", None), getattr(config, "video_token_id", None),
                          getattr(config, "image_token_index", None)) if t is not None]
    return ids.masked_fill(torch.isin(ids, torch.tensor(visual)), -100)


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("variant", ["v", "l"])
def test_empty_schedule_loss_equals_unpatched(models: Any, name: str, variant: str) -> None:
    model = models(name)
    inp = inputs(model, batch=2, seed=6)
    labels = image_labels(model, inp)
    vanilla = model(**inp, labels=labels).loss
    with ficoco.apply(model, variant, schedule={}) as handle:
        patched = model(**inp, labels=labels).loss
        positions = handle.output_positions
    torch.testing.assert_close(patched, vanilla, atol=1e-6, rtol=0)
    assert torch.equal(positions, torch.arange(inp["input_ids"].shape[1]).expand(2, -1))


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("variant", ["v", "l"])
def test_reduced_loss_is_the_loss_over_the_remaining_positions(models: Any, name: str, variant: str) -> None:
    model = models(name)
    inp = inputs(model, batch=2, seed=7)
    labels = image_labels(model, inp)
    vanilla = model(**inp).logits
    with ficoco.apply(model, variant, keep=KEEP[name]) as handle:
        out = model(**inp, labels=labels)
        positions = handle.output_positions
    batch, kept = positions.shape
    assert out.logits.shape[:2] == (batch, kept) and kept < inp["input_ids"].shape[1]
    assert bool((positions[:, 1:] > positions[:, :-1]).all())
    # The text before the first image runs as in the unpatched model (causal): the map lines
    # those logits up with the unpatched ones.
    first_image = int((labels[0] == -100).nonzero()[0])
    torch.testing.assert_close(out.logits[:, :first_image],
                               torch.gather(vanilla, 1, positions[:, :first_image, None].expand(-1, -1,
                                                                                               vanilla.shape[-1])))
    # Every text token stays, at its input position.
    text = labels != -100
    assert torch.equal(torch.gather(text, 1, positions).sum(1), text.sum(1))
    # The loss: each remaining position scored against the next remaining label.
    kept_labels = torch.gather(labels, 1, positions)
    expected = nn.functional.cross_entropy(out.logits[:, :-1].reshape(-1, out.logits.shape[-1]),
                                           kept_labels[:, 1:].reshape(-1), ignore_index=-100)
    torch.testing.assert_close(out.loss, expected)
    assert out.loss.requires_grad or not torch.is_grad_enabled()


def test_l_output_positions_follow_the_last_reducing_layer(models: Any) -> None:
    model = models("llava-tiny")
    inp = inputs(model, seed=8)
    with ficoco.apply(model, "l", schedule={1: 20, 3: 30}) as handle:
        model(**inp)
        positions = handle.output_positions
        last = handle.records[-1].kept
    text = TEXT
    assert positions.shape == (1, text + 64 - 50)
    # The visual outputs are the kept image tokens, at their place in the prompt.
    start = int((inp["input_ids"][0] == placeholder(model)).nonzero()[0])
    visual = positions[(positions >= start) & (positions < start + 64)]
    assert torch.equal(visual - start, last[0])


# -- line 3: several images per prompt, for every keep value --------------------------------------

@pytest.mark.parametrize(("name", "images", "keep"), [
    ("llava-36", 2, 18), ("llava-36", 2, 6), ("llava-36", 3, 12), ("llava-36", 3, 24),
    ("llava-tiny", 2, 32), ("llava-tiny", 3, 8),
    ("llava-next-tiny", 2, 48), ("llava-next-tiny", 3, 28),
    ("qwen2-vl-tiny", 2, 8), ("qwen2-vl-tiny", 3, 4),
])
@pytest.mark.parametrize("variant", ["v", "l"])
def test_several_images_per_prompt_prefill_and_generate(models: Any, name: str, images: int, keep: int,
                                                        variant: str) -> None:
    model = models(name)
    inp = multi_image_inputs(model, images, batch=2, seed=9)
    length = inp["input_ids"].shape[1]
    placeholders = int((inp["input_ids"][0] == placeholder(model)).sum())
    with ficoco.apply(model, variant, keep=keep) as handle:
        visual_kept = handle.keep_per_image if variant == "v" else keep
        logits = model(**inp).logits
        positions = handle.output_positions
        expected = greedy_by_hand(model, inp, NEW)
        out = model.generate(**inp, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
        records = handle.records
    assert logits.shape[1] == length - placeholders + images * visual_kept
    kept_image = (torch.gather(inp["input_ids"], 1, positions) == placeholder(model)).sum(1)
    assert kept_image.tolist() == [images * visual_kept] * 2
    assert torch.equal(out[:, :length], inp["input_ids"])
    assert torch.equal(out[:, length:], expected)
    if variant == "l":
        # All spans are reduced together: one record per layer over every visual token.
        assert records[-1].kept.shape == (2, images * keep)
        assert int(records[-1].kept.max()) < placeholders


@pytest.mark.parametrize("variant", ["v", "l"])
def test_l_treats_all_spans_together_and_v_each_image_alone(models: Any, variant: str) -> None:
    """V reduces every image alone: two images give each one's single-image visual tokens. L picks
    among all visual tokens of the sample at once: its kept set is not the per-image union."""
    model = models("llava-36")
    two = multi_image_inputs(model, 2, seed=10)
    with ficoco.apply(model, variant, keep=18) as handle:
        model(**two)
        kept_two = handle.records[-1].kept
        singles = []
        for i in range(2):
            one = inputs(model, seed=10 + i)
            model(**one)
            singles.append(handle.records[-1].kept)
    if variant == "v":
        assert torch.equal(kept_two, torch.cat(singles))  # rows: images, each as if alone
    else:
        assert kept_two.shape == (1, 36) and int(kept_two.max()) >= 36  # both spans in one set


@pytest.mark.parametrize("variant", ["v", "l"])
def test_video_llava_image_and_video_in_one_prompt(models: Any, variant: str) -> None:
    model = models("video-llava-tiny")
    inp = image_and_video_inputs(model, batch=2, seed=11)
    length = inp["input_ids"].shape[1]
    with ficoco.apply(model, variant, keep=KEEP["video-llava-tiny"]) as handle:
        logits = model(**inp).logits
        positions = handle.output_positions
        expected = greedy_by_hand(model, inp, NEW)
        out = model.generate(**inp, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
    kept = torch.gather(inp["input_ids"], 1, positions)
    # The image span stays whole; the video span keeps the planned tokens.
    assert (kept == model.config.image_token_id).sum(1).tolist() == [16, 16]
    assert (kept == model.config.video_token_id).sum(1).tolist() == [28, 28]
    assert logits.shape[1] == length - 68 + 28
    assert torch.equal(out[:, :length], inp["input_ids"])
    assert torch.equal(out[:, length:], expected)


# -- line 4: output options work aligned, or are refused at the call ------------------------------

@pytest.mark.parametrize("variant", ["v", "l"])
def test_return_dict_false_gives_the_tuple_and_keeps_decode_state(models: Any, variant: str) -> None:
    model = models("llava-tiny")
    inp = inputs(model, seed=12)
    with ficoco.apply(model, variant, keep=8):
        as_dict = model(**inp, use_cache=True)
        token = as_dict.logits[:, -1:].argmax(-1)
        step_dict = model(input_ids=token, **cache_argument(output_cache(as_dict)), use_cache=True).logits
        as_tuple = model(**inp, use_cache=True, return_dict=False)
        assert isinstance(as_tuple, tuple)
        step_tuple = model(input_ids=token, **cache_argument(as_tuple[1]), use_cache=True, return_dict=False)[0]
    torch.testing.assert_close(as_tuple[0], as_dict.logits)
    torch.testing.assert_close(step_tuple, step_dict)


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("variant", ["v", "l"])
def test_use_cache_false_forward_and_generate_equal_the_cached_path(models: Any, name: str, variant: str) -> None:
    model = models(name)
    inp = inputs(model, seed=13)
    with ficoco.apply(model, variant, keep=KEEP[name]):
        cached = model(**inp, use_cache=True).logits
        uncached = model(**inp, use_cache=False)
        with_cache = model.generate(**inp, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
        without = model.generate(**inp, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, use_cache=False)
    assert output_cache(uncached) is None
    torch.testing.assert_close(uncached.logits, cached)
    assert torch.equal(without, with_cache)


@pytest.mark.parametrize("variant", ["v", "l"])
def test_hidden_states_one_per_layer_as_long_as_the_sequence_it_ran(models: Any, variant: str) -> None:
    model = models("llava-tiny")
    inp = inputs(model, seed=14)
    how = {"keep": 8} if variant == "v" else {"schedule": {1: 20, 3: 30}}
    with ficoco.apply(model, variant, **how) as handle:
        seen, hooks = decoder_entry_lengths(model)
        try:
            out = model(**inp, output_hidden_states=True)
        finally:
            for h in hooks:
                h.remove()
        positions = handle.output_positions
    assert len(out.hidden_states) == DECODER_LAYERS + 1
    # hidden_states[i] enters layer i; each reducing layer's output is its own, shorter sequence.
    assert [h.shape[1] for h in out.hidden_states[:-1]] == [lengths[0] for lengths in seen]
    assert out.hidden_states[-1].shape[1] == out.logits.shape[1] == positions.shape[1]
    if variant == "l":
        assert [h.shape[1] for h in out.hidden_states] == [TEXT + 64, TEXT + 64, TEXT + 44, TEXT + 44, TEXT + 14]


@pytest.mark.parametrize("variant", ["v", "l"])
def test_output_attentions_under_sdpa_is_refused_at_the_call(models: Any, variant: str) -> None:
    model = models("llava-tiny")
    inp = inputs(model, seed=15)
    with ficoco.apply(model, variant, keep=8):
        with pytest.raises(FicocoError, match="attn_implementation='eager'"):
            model(**inp, output_attentions=True)
        with pytest.raises(FicocoError, match="attn_implementation='eager'"):
            model.generate(**inp, max_new_tokens=2, output_attentions=True, return_dict_in_generate=True)


def test_l_output_attentions_under_eager_are_each_layers_own_matrix(models: Any) -> None:
    model = models("llava-tiny-eager")
    inp = inputs(model, seed=16)
    vanilla = model(**inp, output_attentions=True).attentions
    with ficoco.apply(model, "l", schedule={1: 20, 3: 30}):
        out = model(**inp, output_attentions=True)
    full = TEXT + 64
    assert [tuple(a.shape) for a in out.attentions] == [(1, 4, n, n) for n in (full, full, full - 20, full - 20)]
    for a in out.attentions:
        torch.testing.assert_close(a.sum(-1), torch.ones(a.shape[:-1]))
    # Layers 0 and 1 see every token: their matrices are the unpatched model's (layer 1 computes
    # its own through the probe before it reduces).
    torch.testing.assert_close(out.attentions[0], vanilla[0])
    torch.testing.assert_close(out.attentions[1], vanilla[1], atol=1e-5, rtol=0)


def test_v_output_attentions_under_eager_cover_every_decoder_layer(models: Any) -> None:
    model = models("llava-tiny-eager")
    inp = inputs(model, seed=17)
    with ficoco.apply(model, "v", keep=8):
        out = model(**inp, output_attentions=True)
    assert [tuple(a.shape) for a in out.attentions] == [(1, 4, TEXT + 8, TEXT + 8)] * DECODER_LAYERS


# -- line 5: multi-turn; caches and attention implementations the patches cannot serve ------------

IMAGE_INPUTS = ("pixel_values", "image_sizes", "image_grid_thw")


def second_turn(model: nn.Module, first: Tensor, seed: int, every_grid: Tensor | None = None) -> dict[str, Tensor]:
    """The conversation so far (`first`: the first turn's prompt and answer), then a new user turn
    with a new image, as HF users continue a chat on a cache: the whole conversation's input_ids,
    the new turn's image inputs (Qwen2-VL: `every_grid`, the earlier images' image_grid_thw, come
    first when given, as transformers' own 3-D positions want every image's grid)."""
    turn = inputs(model, batch=first.shape[0], seed=seed)
    qwen = model.config.model_type == "qwen2_vl"
    ids = torch.cat([first, turn["input_ids"][:, 0 if qwen else 1:]], dim=1)  # no second BOS
    out = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    out.update({key: turn[key] for key in IMAGE_INPUTS if key in turn})
    if qwen:
        out["mm_token_type_ids"] = (ids == model.config.image_token_id).int()
        if every_grid is not None:
            out["image_grid_thw"] = interleave(every_grid, turn["image_grid_thw"])
    return out


def interleave(earlier: Tensor, later: Tensor) -> Tensor:
    """Per-image rows of two turns (one image per sample each) in the sample-major order of one
    prompt holding both: sample 0's earlier and later image, then sample 1's, ..."""
    return torch.stack([earlier, later], dim=1).flatten(0, 1)


def whole_conversation(model: nn.Module, conversation: dict[str, Tensor], first: dict[str, Tensor]
                       ) -> dict[str, Tensor]:
    """The same conversation as one prompt without a cache: both turns' images in the call."""
    batch = conversation["input_ids"].shape[0]
    whole = dict(conversation)
    for key in IMAGE_INPUTS:
        if key not in first:
            continue
        earlier, new = first[key], conversation[key]
        if key == "image_grid_thw" and new.shape[0] == 2 * batch:  # every image's grid already
            continue
        if key == "pixel_values" and model.config.model_type == "qwen2_vl":  # patch rows, per sample
            whole[key] = torch.cat([earlier.view(batch, -1, earlier.shape[-1]),
                                    new.view(batch, -1, new.shape[-1])], dim=1).flatten(0, 1)
        else:
            whole[key] = interleave(earlier, new)
    return whole


def encoded_beforehand(model: nn.Module, conversation: dict[str, Tensor], turn_grid: Tensor) -> dict[str, Tensor]:
    """Unpatched Qwen2-VL's form of a new image on a cache: the new images encoded beforehand
    (with their own grids) and every image's grid."""
    out = dict(conversation)
    out["mm_encoder_outputs"] = {"image": model.model.get_image_features(out.pop("pixel_values"), turn_grid,
                                                                         return_dict=True)}
    return out


V_TURNS = ["llava-tiny", "llava-next-tiny", "qwen2-vl-tiny"]


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("name", V_TURNS)
def test_v_second_turn_with_a_new_image_on_the_first_turns_cache(models: Any, name: str, batch: int) -> None:
    """generate with the whole conversation's input_ids on the first turn's cache gives the tokens
    of the whole conversation run as one prompt (V shortens every image alike, wherever it is);
    Qwen2-VL with this turn's grids and with every image's grids."""
    model = models(name)
    first = inputs(model, batch=batch, seed=18)
    grids = [None, first.get("image_grid_thw")] if name == "qwen2-vl-tiny" else [None]
    with ficoco.apply(model, "v", keep=KEEP[name]):
        for every_grid in grids:
            turn1 = model.generate(**first, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                                   return_dict_in_generate=True)
            nxt = second_turn(model, turn1.sequences, seed=19, every_grid=every_grid)
            turn2 = model.generate(**nxt, **cache_argument(output_cache(turn1)), max_new_tokens=NEW,
                                   min_new_tokens=NEW, do_sample=False, return_dict_in_generate=True)
            # Reference without a cache: the whole conversation, both images, in one prompt.
            whole = model.generate(**whole_conversation(model, nxt, first), max_new_tokens=NEW, min_new_tokens=NEW,
                                   do_sample=False, return_dict_in_generate=True)
            length = nxt["input_ids"].shape[1]
            assert torch.equal(turn2.sequences[:, :length], nxt["input_ids"])
            assert torch.equal(turn2.sequences[:, length:], whole.sequences[:, length:])
            # The cache holds the shortened conversation, as long as the one prompt's.
            assert output_cache(turn2).get_seq_length() == output_cache(whole).get_seq_length()


@pytest.mark.parametrize("name", V_TURNS)
def test_v_text_turn_on_the_cache_of_an_image_turn_runs_only_what_follows(models: Any, name: str) -> None:
    """A second turn without an image: generate with the whole conversation's input_ids on the
    first turn's cache runs only what the cache lacks (the cache ends as long as the one prompt's)
    and gives the one prompt's tokens."""
    model = models(name)
    first = inputs(model, seed=36)
    question = inputs(model, seed=37)["input_ids"][:, -4:]  # text of the second turn
    with ficoco.apply(model, "v", keep=KEEP[name]):
        turn1 = model.generate(**first, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                               return_dict_in_generate=True)
        ids = torch.cat([turn1.sequences, question], dim=1)
        nxt = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        if name == "qwen2-vl-tiny":
            nxt["mm_token_type_ids"] = (ids == model.config.image_token_id).int()
        turn2 = model.generate(**nxt, **cache_argument(output_cache(turn1)), max_new_tokens=NEW,
                               min_new_tokens=NEW, do_sample=False, return_dict_in_generate=True)
        images = {key: first[key] for key in IMAGE_INPUTS if key in first}
        whole = model.generate(**nxt, **images, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                               return_dict_in_generate=True)
    assert torch.equal(turn2.sequences[:, :ids.shape[1]], ids)
    assert torch.equal(turn2.sequences, whole.sequences)
    assert output_cache(turn2).get_seq_length() == output_cache(whole).get_seq_length()


@pytest.mark.parametrize("name", V_TURNS)
def test_v_second_turn_forward_on_the_cache_equals_the_one_prompt(models: Any, name: str) -> None:
    """A plain forward of what follows the cache (the first answer's last token and the new turn),
    with the new image, gives the one prompt's logits at the same positions; output_positions
    point into the call's own input_ids; the mask may cover the cache too (HF's convention)."""
    model = models(name)
    first = inputs(model, seed=30)
    with ficoco.apply(model, "v", keep=KEEP[name]) as handle:
        turns = [model.generate(**first, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                                return_dict_in_generate=True) for _ in range(2)]
        nxt = second_turn(model, turns[0].sequences, seed=31)
        # Run after the first turns: each turn continues on its own cache, whatever ran since.
        one = model(**whole_conversation(model, nxt, first))
        one_positions = handle.output_positions
        past = output_cache(turns[0]).get_seq_length()
        after = nxt["input_ids"].shape[1] - (turns[0].sequences.shape[1] - 1)  # what the cache lacks
        call = {key: value[:, -after:] if key in ("input_ids", "mm_token_type_ids") else value
                for key, value in nxt.items() if key != "attention_mask"}
        for turn1, mask in zip(turns, (None, torch.ones(1, past + after, dtype=torch.long)), strict=True):
            cache = output_cache(turn1)
            out = model(**call, **cache_argument(cache), use_cache=True,
                        **({} if mask is None else {"attention_mask": mask}))
            kept = out.logits.shape[1]
            torch.testing.assert_close(out.logits, one.logits[:, -kept:], atol=1e-5, rtol=1e-5)
            assert cache.get_seq_length() == one.logits.shape[1] == past + kept
            start = nxt["input_ids"].shape[1] - after
            assert torch.equal(handle.output_positions + start, one_positions[:, -kept:])


@pytest.mark.parametrize("name", V_TURNS)
def test_v_second_turn_with_an_empty_schedule_is_the_unpatched_conversation(models: Any, name: str) -> None:
    model = models(name)
    first = inputs(model, seed=32)
    every_grid = first.get("image_grid_thw")

    def conversation(vanilla: bool = False) -> tuple[Tensor, dict[str, Tensor]]:
        turn1 = model.generate(**first, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                               return_dict_in_generate=True)
        nxt = second_turn(model, turn1.sequences, seed=33, every_grid=every_grid)
        call = nxt
        if vanilla and every_grid is not None:
            call = encoded_beforehand(model, nxt, inputs(model, seed=33)["image_grid_thw"])
        return model.generate(**call, **cache_argument(output_cache(turn1)), max_new_tokens=NEW,
                              min_new_tokens=NEW, do_sample=False), nxt

    with ficoco.apply(model, "v", schedule={}):
        empty, nxt = conversation()
    assert torch.equal(empty, conversation(vanilla=True)[0])
    whole = model.generate(**whole_conversation(model, nxt, first), max_new_tokens=NEW, min_new_tokens=NEW,
                           do_sample=False)
    assert torch.equal(empty, whole)


def test_l_second_turn_on_qwen2_vl_takes_every_images_grid_as_transformers_does(models: Any) -> None:
    """Unpatched Qwen2-VL computes a later turn's 3-D positions over the whole conversation, from
    every image's grid, and takes the new images encoded beforehand. FiCoCo-L takes that form,
    and this turn's pixel_values with every image's grid; this turn's grid alone is refused at
    the call. Empty schedule: the unpatched conversation; with a reduction, every layer's cache
    holds what it kept of both turns."""
    model = models("qwen2-vl-tiny")
    first = inputs(model, seed=34)
    turn_grid = inputs(model, seed=35)["image_grid_thw"]
    every_grid = first["image_grid_thw"]
    run = {"max_new_tokens": NEW, "min_new_tokens": NEW, "do_sample": False}

    def turns(encode: bool) -> tuple[Any, dict[str, Tensor], Tensor]:
        turn1 = model.generate(**first, **run, return_dict_in_generate=True)
        nxt = second_turn(model, turn1.sequences, seed=35, every_grid=every_grid)
        call = encoded_beforehand(model, nxt, turn_grid) if encode else nxt
        return turn1, nxt, model.generate(**call, **cache_argument(output_cache(turn1)), **run)

    vanilla = turns(encode=True)[2]
    with ficoco.apply(model, "l", schedule={}):
        assert torch.equal(turns(encode=False)[2], vanilla)
        assert torch.equal(turns(encode=True)[2], vanilla)
    with ficoco.apply(model, "l", schedule={1: 4}) as handle:
        turn1, nxt, reduced = turns(encode=False)
        cache = output_cache(turn1)
        after = [cache.get_seq_length(i) for i in range(DECODER_LAYERS)]
        records = handle.records
        assert torch.equal(turns(encode=True)[2], reduced)
        this_turn_only = dict(nxt, image_grid_thw=turn_grid)
        turn1 = model.generate(**first, **run, return_dict_in_generate=True)
        with pytest.raises(FicocoError, match="every image's grid") as info:
            model.generate(**this_turn_only, **cache_argument(output_cache(turn1)), **run)
        assert "\n" not in str(info.value)
    length = nxt["input_ids"].shape[1]
    assert torch.equal(reduced[:, :length], nxt["input_ids"])
    # Layers up to the reducing one hold the whole conversation; later ones 4 fewer tokens per image.
    full = length + NEW - 1
    assert after == [full, full, full - 8, full - 8]
    assert [r.layer for r in records] == [1]


def test_l_second_turn_with_a_new_image_on_the_first_turns_cache(models: Any) -> None:
    model = models("llava-tiny")
    first = inputs(model, seed=20)
    how = {1: 20, 3: 30}
    with ficoco.apply(model, "l", schedule={}):
        turn1 = model.generate(**first, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                               return_dict_in_generate=True)
        nxt = second_turn(model, turn1.sequences, seed=21)
        empty = model.generate(**nxt, **cache_argument(output_cache(turn1)), max_new_tokens=NEW,
                               min_new_tokens=NEW, do_sample=False)
    vanilla1 = model.generate(**first, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                              return_dict_in_generate=True)
    vanilla2 = model.generate(**nxt, **cache_argument(output_cache(vanilla1)), max_new_tokens=NEW,
                              min_new_tokens=NEW, do_sample=False)
    assert torch.equal(empty, vanilla2)  # nothing removed: the unpatched conversation

    with ficoco.apply(model, "l", schedule=how) as handle:
        # Two first turns, two caches: a forward on one, generate on the other.
        turn1, again = (model.generate(**first, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                                       return_dict_in_generate=True) for _ in range(2))
        nxt = second_turn(model, turn1.sequences, seed=21)
        cache = output_cache(turn1)
        before = [cache.get_seq_length(i) for i in range(DECODER_LAYERS)]
        step = model(**{k: v[:, before[0]:] if k in ("input_ids", "attention_mask") else v for k, v in nxt.items()},
                     **cache_argument(output_cache(again)), use_cache=True)
        with pytest.raises(FicocoError, match="cache object the model returned"):
            model(input_ids=nxt["input_ids"][:, -1:], **cache_argument(copy.deepcopy(cache)))
        turn2 = model.generate(**nxt, **cache_argument(cache), max_new_tokens=NEW, min_new_tokens=NEW,
                               do_sample=False)
        after = [cache.get_seq_length(i) for i in range(DECODER_LAYERS)]
        records = handle.records
    length = nxt["input_ids"].shape[1]
    assert torch.equal(turn2[:, :length], nxt["input_ids"])
    assert turn2[0, length] == step.logits[0, -1].argmax()
    # Each layer's cache holds what it saw in both turns: reducing layers fewer image tokens.
    turn = length - before[0]
    assert after == [before[0] + turn + NEW - 1, before[1] + turn + NEW - 1,
                     before[2] + turn - 20 + NEW - 1, before[3] + turn - 20 + NEW - 1]
    assert before == [TEXT + 64 + NEW - 1] * 2 + [TEXT + 44 + NEW - 1] * 2
    assert [r.layer for r in records] == [1, 3]


def test_l_second_turn_of_a_left_padded_batch_equals_each_conversation_alone(models: Any) -> None:
    """A later turn on a padded batch: generate hands the forward a mask over the cache and the new
    turn (transformers keeps it when it is not all ones). Nothing removed: the unpatched
    conversation; with a reduction: every sample's second turn as its conversation alone."""
    model = models("llava-tiny")
    long, short = inputs(model, seed=20), inputs(model, seed=23)
    pad = torch.full((1, 2), model.config.pad_token_id)
    short_ids = torch.cat([pad, short["input_ids"][:, :-2]], dim=1)  # two tokens shorter, padded left
    first = {"input_ids": torch.cat([long["input_ids"], short_ids]),
             "attention_mask": torch.cat([long["attention_mask"],
                                          torch.cat([torch.zeros_like(pad), short["attention_mask"][:, :-2]], 1)]),
             "pixel_values": torch.cat([long["pixel_values"], short["pixel_values"]])}
    run = {"max_new_tokens": NEW, "min_new_tokens": NEW, "do_sample": False}
    new_turn = inputs(model, batch=2, seed=21)  # each sample's new user turn and image

    def conversation(prompt: dict[str, Tensor], rows: slice) -> Tensor:
        turn1 = model.generate(**prompt, **run, return_dict_in_generate=True)
        added = new_turn["input_ids"][rows, 1:]  # no second BOS
        nxt = {"input_ids": torch.cat([turn1.sequences, added], dim=1),
               # The whole conversation's mask, the first turn's padding kept: not all ones.
               "attention_mask": torch.cat([prompt["attention_mask"],
                                            torch.ones(added.shape[0], NEW + added.shape[1], dtype=torch.long)], 1),
               "pixel_values": new_turn["pixel_values"][rows]}
        return model.generate(**nxt, **cache_argument(output_cache(turn1)), **run)[:, -NEW:]

    vanilla = conversation(first, slice(0, 2))
    with ficoco.apply(model, "l", schedule={}):
        assert torch.equal(conversation(first, slice(0, 2)), vanilla)
    alone = [{"input_ids": long["input_ids"], "attention_mask": long["attention_mask"],
              "pixel_values": long["pixel_values"]},
             {"input_ids": short_ids[:, 2:], "attention_mask": short["attention_mask"][:, :-2],
              "pixel_values": short["pixel_values"]}]
    with ficoco.apply(model, "l", schedule={1: 20, 3: 30}):
        together = conversation(first, slice(0, 2))
        for i, prompt in enumerate(alone):
            assert torch.equal(together[i:i + 1], conversation(prompt, slice(i, i + 1))), f"sample {i}"


@pytest.mark.parametrize("variant", ["v", "l"])
def test_static_cache_is_refused_at_apply_and_at_the_call(models: Any, variant: str) -> None:
    from transformers import StaticCache

    model = models("llava-tiny")
    inp = inputs(model, seed=22)
    model.generation_config.cache_implementation = "static"
    try:
        with pytest.raises(FicocoError, match="dynamic"):
            ficoco.apply(model, variant, keep=8)
    finally:
        model.generation_config.cache_implementation = None
    assert "_ficoco_handle" not in model.__dict__
    with ficoco.apply(model, variant, keep=8):
        with pytest.raises(FicocoError, match="DynamicCache"):
            model(**inp, **cache_argument(StaticCache(config=model.config, max_cache_len=128)))
        with pytest.raises(FicocoError, match="dynamic"):
            model.generate(**inp, max_new_tokens=2, cache_implementation="static")


@pytest.mark.parametrize("implementation", ["flash_attention_2", "flex_attention"])
@pytest.mark.parametrize("name", FAMILIES)
def test_unsupported_attention_is_refused_at_apply_naming_what_works(models: Any, name: str,
                                                                    implementation: str) -> None:
    model = copy.deepcopy(models(name))
    for config in (model.config, model.config.text_config):
        config._attn_implementation_internal = implementation
    for variant in ("v", "l"):
        with pytest.raises(FicocoError, match="sdpa.*eager") as info:
            ficoco.apply(model, variant, keep=KEEP[name])
        assert "\n" not in str(info.value)
        assert "_ficoco_handle" not in model.__dict__


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("variant", ["v", "l"])
def test_eager_attention_works_like_sdpa(models: Any, name: str, variant: str) -> None:
    sdpa, eager = models(name), models(f"{name}-eager")
    inp = inputs(sdpa, seed=23)
    with ficoco.apply(sdpa, variant, keep=KEEP[name]):
        expected = sdpa(**inp).logits
    with ficoco.apply(eager, variant, keep=KEEP[name]):
        got = eager(**inp).logits
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_attention_switched_after_apply_is_refused_at_the_call(models: Any) -> None:
    model = copy.deepcopy(models("llava-tiny"))
    inp = inputs(model, seed=24)
    with ficoco.apply(model, "l", keep=8):
        model.config.text_config._attn_implementation_internal = "flex_attention"
        with pytest.raises(FicocoError, match="attn_implementation='sdpa'"):
            model(**inp)
