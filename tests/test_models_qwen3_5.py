"""Every method inside Hugging Face Qwen3.5 (issue 34), lean.

A random seeded qwen3.5-tiny model in fp32 on CPU: a Qwen3-VL-like ViT of 3 blocks (16-pixel patches, no
DeepStack) over a 256 x 320 image (16 x 20 patches, 8 x 10 merge groups: 80 LLM tokens), and a hybrid decoder
of 8 layers: Gated DeltaNet (linear attention) in 0-2 and 4-6, full gated attention in 3 and 7; prompts are
12 text tokens of the chat template around one image span.
"""

from __future__ import annotations

import copy
from collections import defaultdict
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_batch_equals_samples_alone
from torch import Tensor, nn

import ficoco
from ficoco.accounting import CountOptions, ScheduleRequest, architecture, plan_request
from ficoco.accounting.planners import PLANNERS
from ficoco.accounting.schedule import plan_tokens
from ficoco.api import profile_of
from ficoco.errors import FicocoError
from ficoco.methods import METHODS
from ficoco.models import adapter_for
from ficoco.models import hf_compat as hf
from ficoco.models.hf_compat import cache_argument, output_cache
from ficoco.models.qwen3_5 import synthetic_inputs
from ficoco.profiling.trackers import cache_bytes_per_layer, cache_tokens

TINY_PROFILE = "qwen3.5-tiny"  # built as this module's `model` (conftest.py)
TEXT = 12
VISUAL = 80
NEW = 4
FULL = (3, 7)
# Special ids of the tiny vocabulary (image, video, vision start/end, ...): a random model may pick them.
SPECIAL = list(range(300, 320))

# One setting per method that runs here: FastV, DART and SparseVLM read layer 3 (full attention) at layer
# 4's input; PDrop ranks with full layer 7's own projections; FiCoCo-L reduces inside the full layers.
RUNS = {
    "v": {"keep": 40}, "tome": {"keep": 40}, "visionzip": {"keep": 40}, "fastervlm": {"keep": 40},
    "divprune": {"keep": 40}, "vispruner": {"keep": 40}, "cdpruner": {"keep": 40},
    "l": {"schedule": {3: 20, 7: 10}}, "fastv": {"schedule": "4:30"}, "dart": {"keep": 32, "layer": 4},
    "sparsevlm": {"schedule": "4:20"}, "pdrop": {"schedule": "7:30"},
}
IN_LLM = ("l", "fastv", "dart", "sparsevlm", "pdrop")


@pytest.fixture(scope="module")
def arch(model: nn.Module) -> Any:
    return architecture(profile_of(model, TINY_PROFILE))


def inputs(model: nn.Module, batch: int = 1, seed: int = 0, text: int = TEXT) -> dict[str, Tensor]:
    return synthetic_inputs(model, batch=batch, text_tokens=text, seed=seed)


def sample(batch: dict[str, Tensor], i: int) -> dict[str, Tensor]:
    patches = batch["pixel_values"].shape[0] // batch["input_ids"].shape[0]
    return {k: v[i * patches:(i + 1) * patches] if k == "pixel_values" else v[i:i + 1] for k, v in batch.items()}


def greedy(model: nn.Module, inp: dict[str, Tensor], **kwargs: Any) -> Any:
    return model.generate(**inp, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, suppress_tokens=SPECIAL,
                          **kwargs)


def on_cache(model: nn.Module, ids: Tensor, mask: Tensor, cache: Any) -> Any:
    """A forward of `ids` after what `cache` holds, `mask` covering both, with its 3-D positions given: the
    mask's running count plus the prefill's rope deltas (transformers' Qwen3.5 derives them from the whole mask
    without taking the call's columns, which only generate's own position ids avoid)."""
    text = (mask.long().cumsum(-1) - 1)[:, -ids.shape[1]:]
    positions = (text + model.model.rope_deltas).unsqueeze(0).expand(3, -1, -1)
    return model(input_ids=ids, attention_mask=mask, position_ids=positions, **cache_argument(cache), use_cache=True)


def hand_decode(model: nn.Module, inp: dict[str, Tensor], new: int) -> tuple[Tensor, Any]:
    """The prefill of `inp`, then `new - 1` greedy steps on its cache: the tokens (B, new) and the cache."""
    out = model(**inp, use_cache=True)
    cache, mask = output_cache(out), inp["attention_mask"]
    logits = out.logits[:, -1].masked_fill(torch.isin(torch.arange(out.logits.shape[-1]), torch.tensor(SPECIAL)),
                                           float("-inf"))
    tokens = [logits.argmax(-1)]
    for _ in range(new - 1):
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        step = on_cache(model, tokens[-1][:, None], mask, cache)
        cache = output_cache(step)
        logits = step.logits[:, -1].masked_fill(torch.isin(torch.arange(step.logits.shape[-1]),
                                                           torch.tensor(SPECIAL)), float("-inf"))
        tokens.append(logits.argmax(-1))
    return torch.stack(tokens, dim=1), cache


def entering(model: nn.Module) -> tuple[dict[int, list[int]], list[Any]]:
    """Tokens entering every decoder layer's MLP (what the layer hands on), per call."""
    seen: dict[int, list[int]] = defaultdict(list)
    hooks = [layer.mlp.register_forward_pre_hook(lambda m, args, i=i: seen[i].append(args[0].shape[1]))
             for i, layer in enumerate(model.model.language_model.layers)]
    return seen, hooks


# -- the model and its layer kinds ------------------------------------------------------------------

def test_layer_kinds_and_paths_are_the_built_models(model: nn.Module, arch: Any) -> None:
    adapter = adapter_for(model)
    assert adapter.full_layers == FULL and adapter.linear_layers == (0, 1, 2, 4, 5, 6)
    hf.check_model(model)
    assert arch.visual_tokens == VISUAL
    # A DeltaNet layer that lost its mixer is named in one line.
    layer = model.model.language_model.layers[0]
    moved = layer._modules.pop("linear_attn")
    try:
        with pytest.raises(hf.ContactChanged, match=r"has no 'linear_attn'") as raised:
            hf.check_model(model)
        assert "\n" not in str(raised.value)
    finally:
        layer._modules["linear_attn"] = moved


def test_deltanet_layers_get_a_2d_padding_mask_and_full_layers_a_4d_one(model: nn.Module) -> None:
    """The contact the shared patches rely on: a left-padded batch hands every DeltaNet layer this call's
    (B, T) padding mask and every full layer a 4-D mask; the cache reads its length from layer 3."""
    batch = inputs(model, batch=2, seed=1)
    batch["attention_mask"][0, :2] = 0
    masks: dict[int, Any] = {}
    def keep(module: nn.Module, args: tuple, kwargs: dict, i: int) -> None:
        # The wrapped layers bind by keyword what the model passes by keyword (hidden_states alone by position).
        assert len(args) == 1 and {*hf.DECODER_LAYER_KEYWORDS, hf.cache_keyword()} <= set(kwargs)
        masks.setdefault(i, kwargs["attention_mask"])

    hooks = [layer.register_forward_pre_hook(lambda m, a, kw, i=i: keep(m, a, kw, i), with_kwargs=True)
             for i, layer in enumerate(model.model.language_model.layers)]
    try:
        out = model(**batch, use_cache=True)
    finally:
        for hook in hooks:
            hook.remove()
    length = batch["input_ids"].shape[1]
    assert all(masks[i].shape == (2, length) for i in (0, 1, 2, 4, 5, 6))
    assert all(masks[i].dim() == 4 for i in FULL)
    assert output_cache(out).get_seq_length() == length


# -- identity settings are the unpatched model ------------------------------------------------------

@pytest.mark.parametrize(("variant", "how"), [
    ("v", {"schedule": {}}), ("l", {"schedule": {}}), ("fastv", {"keep": VISUAL, "layer": 4}),
    ("dart", {"keep": VISUAL, "layer": 4}), ("divprune", {"keep": VISUAL})])
def test_identity_settings_equal_the_unpatched_model(model: nn.Module, variant: str, how: dict) -> None:
    inp = inputs(model, batch=2)
    ref_logits, ref_tokens = model(**inp).logits, greedy(model, inp)
    with ficoco.apply(model, variant, **how) as handle:
        assert "forward" in model.__dict__ and handle.schedule.total_removed == 0
        logits, tokens = model(**inp).logits, greedy(model, inp)
    assert torch.equal(logits, ref_logits)
    assert torch.equal(tokens, ref_tokens)


# -- every method: the planned counts, a batch equal to its samples alone -------------------------

@pytest.mark.parametrize("variant", sorted(RUNS))
def test_every_method_runs_the_planned_counts_and_a_batch_equals_its_samples(model: nn.Module, arch: Any,
                                                                            variant: str) -> None:
    batch = inputs(model, batch=2, seed=3)
    with ficoco.apply(model, variant, **RUNS[variant]) as handle:
        seen, hooks = entering(model)
        try:
            assert_batch_equals_samples_alone(model, handle, batch, [sample(batch, i) for i in range(2)])
        finally:
            for hook in hooks:
                hook.remove()
    plan = plan_tokens(arch, handle.schedule, text_tokens=TEXT)
    assert handle.schedule.total_removed > 0
    # FastV, PDrop, SparseVLM and DART cut at a layer's input, inside the wrapped layer: its MLP sees what it
    # hands on; FiCoCo-L inside the layer, before its MLP.
    assert [seen[i][0] for i in range(8)] == [n for _, n in plan.llm], variant


def test_a_left_padded_batch_equals_its_samples_through_the_deltanet_padding_mask(model: nn.Module) -> None:
    """Prompts of 12 and 16 text tokens, the shorter left-padded: the DeltaNet layers take the padding mask of
    the tokens that remain (FastV and FiCoCo-L cut before some of them), and every sample's last logits and
    greedy tokens are its own alone."""
    short, long = inputs(model, seed=4), inputs(model, seed=5, text=16)
    pad = long["input_ids"].shape[1] - short["input_ids"].shape[1]
    batch = {k: torch.cat([F.pad(short[k], (pad, 0)), long[k]]) for k in ("input_ids", "attention_mask",
                                                                           "mm_token_type_ids")}
    batch["pixel_values"] = torch.cat([short["pixel_values"], long["pixel_values"]])
    batch["image_grid_thw"] = torch.cat([short["image_grid_thw"], long["image_grid_thw"]])
    for variant in ("fastv", "l", "v"):
        with ficoco.apply(model, variant, **RUNS[variant]):
            together, tokens = model(**batch).logits[:, -1], greedy(model, batch)
            alone = [model(**x).logits[:, -1] for x in (short, long)]
            alone_tokens = [greedy(model, x) for x in (short, long)]
        for i in range(2):
            torch.testing.assert_close(together[i:i + 1], alone[i], atol=1e-4, rtol=0)
            assert torch.equal(tokens[i:i + 1, -NEW:], alone_tokens[i][:, -NEW:]), variant


# -- the refusals at a linear-attention layer ------------------------------------------------------

@pytest.mark.parametrize(("variant", "how", "words"), [
    ("fastv", {"schedule": "2:30"}, "layer 1 of this Qwen3.5 decoder is Gated DeltaNet .* after a full-attention "
                                    "layer: 4$"),
    ("dart", {"keep": 32}, "DART at layer 2 reads layer 1's attention keys"),
    ("sparsevlm", {"schedule": "6:20"}, "layer 5 of this Qwen3.5 decoder is Gated DeltaNet"),
    ("l", {"schedule": {4: 20}}, "layer 4 of this Qwen3.5 decoder is Gated DeltaNet .* a recurrent state has no "
                                 "tokens to remove; reduce at the full-attention layers 3, 7"),
    ("pdrop", {"schedule": "5:20"}, "ranks with layer 5's own attention projections, and layer 5 .* is Gated "
                                    "DeltaNet"),
    ("pdrop", {"schedule": "3:20"}, "layer 3 .* is the first full-attention layer, whose cache must keep every "
                                    "token; rank at the full-attention layers 7$"),
])
def test_a_method_at_a_linear_attention_layer_refuses_in_one_line(model: nn.Module, arch: Any, variant: str,
                                                                  how: dict, words: str) -> None:
    with pytest.raises(FicocoError, match=words) as raised:
        ficoco.apply(model, variant, **how)
    assert "\n" not in str(raised.value)
    assert "forward" not in model.__dict__ and "_ficoco_handle" not in model.__dict__  # left as it was
    # The adapter refuses a schedule resolved elsewhere (its planner's, unchecked) in the accountant's own words:
    # `ficoco flops` prices nothing the model refuses (ficoco.methods.hybrid holds the rule both apply).
    spec = METHODS[variant]
    unchecked = PLANNERS[spec.planner](arch, spec, plan_request(ScheduleRequest.of(None, **how), CountOptions(), None))
    with pytest.raises(FicocoError) as by_adapter:
        ficoco.apply(model, variant, schedule=unchecked)
    assert str(by_adapter.value) == str(raised.value)
    assert "forward" not in model.__dict__ and "_ficoco_handle" not in model.__dict__


def test_l_plans_keep_over_the_full_attention_layers_alone(model: nn.Module) -> None:
    """FiCoCo-L's planner spreads `keep=` over the full-attention layers from its first reducing layer (3) on,
    and "oneshot" puts it all at layer 3; both run."""
    inp = inputs(model, seed=6)
    for shape, planned in (("uniform", {3: 20, 7: 20}), ("oneshot", {3: 40})):
        with ficoco.apply(model, "l", keep=40, shape=shape) as handle:
            logits = model(**inp).logits
        assert handle.schedule.removed_at() == planned
        assert logits.shape[1] == inp["input_ids"].shape[1] - 40


# -- generate, a second turn on the cache, labels ----------------------------------------------------

@pytest.mark.parametrize("variant", ["v", "divprune"])
def test_before_the_llm_generate_and_a_text_turn_on_its_cache_equal_the_whole_conversation(
        model: nn.Module, variant: str) -> None:
    first = inputs(model, batch=2, seed=9)
    length = first["input_ids"].shape[1]
    question = inputs(model, seed=10)["input_ids"][:, -4:].expand(2, -1)
    with ficoco.apply(model, variant, **RUNS[variant]):
        turn1 = greedy(model, first, return_dict_in_generate=True)
        alone = [greedy(model, sample(first, i)) for i in range(2)]
        ids = torch.cat([turn1.sequences, question], dim=1)
        nxt = {"input_ids": ids, "attention_mask": torch.ones_like(ids),
               "mm_token_type_ids": (ids == model.config.image_token_id).int()}
        turn2 = greedy(model, nxt, **cache_argument(output_cache(turn1)), return_dict_in_generate=True)
        images = {key: first[key] for key in ("pixel_values", "image_grid_thw")}
        whole = greedy(model, {**nxt, **images}, return_dict_in_generate=True)
    assert torch.equal(turn1.sequences[:, :length], first["input_ids"])
    for i in range(2):
        assert torch.equal(turn1.sequences[i:i + 1], alone[i])
    # The recurrent and conv states carried over the cache give what the whole conversation gives in one prompt.
    assert torch.equal(turn2.sequences, whole.sequences)
    assert output_cache(turn2).get_seq_length() == output_cache(whole).get_seq_length() == ids.shape[1] - 40 + NEW - 1


@pytest.mark.parametrize("variant", IN_LLM)
def test_in_the_llm_generate_is_the_hand_written_decode_and_a_text_turn_is_the_same_token_by_token(
        model: nn.Module, variant: str) -> None:
    """generate equals a hand-written greedy decode on the reduced cache, each sample as if alone; a text turn of
    4 tokens on that cache in one forward (the DeltaNet layers' chunked recurrence and padding mask, the full
    layers' sliced 4-D mask) gives what the same tokens give fed one at a time (the single-token paths)."""
    first = inputs(model, batch=2, seed=11)
    question = inputs(model, seed=12)["input_ids"][:, -4:].expand(2, -1)
    with ficoco.apply(model, variant, **RUNS[variant]):
        turn1 = greedy(model, first, return_dict_in_generate=True)
        tokens, cache = hand_decode(model, first, NEW)
        _, stepped_cache = hand_decode(model, first, NEW)  # the same conversation on a cache of its own
        alone = [greedy(model, sample(first, i)) for i in range(2)]
        mask = torch.ones(2, first["input_ids"].shape[1] + NEW - 1, dtype=torch.long)
        whole_turn = on_cache(model, question, torch.cat([mask, torch.ones_like(question)], 1), cache).logits
        stepped = []
        for t in range(question.shape[1]):
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            stepped.append(on_cache(model, question[:, t:t + 1], mask, stepped_cache).logits[:, -1])
    assert torch.equal(turn1.sequences[:, -NEW:], tokens)
    for i in range(2):
        assert torch.equal(turn1.sequences[i:i + 1], alone[i])
    torch.testing.assert_close(whole_turn, torch.stack(stepped, dim=1), atol=1e-4, rtol=0)
    # The first full layer holds every token; the reduced full layer 7 fewer; a DeltaNet layer no token at all.
    tokens_held = cache_tokens(cache)
    assert tokens_held[3] == cache.get_seq_length() == first["input_ids"].shape[1] + NEW - 1 + 4
    assert tokens_held[7] < tokens_held[3] and tokens_held[0] == 0


def test_labels_score_the_remaining_positions(model: nn.Module) -> None:
    inp = inputs(model, batch=2, seed=13)
    labels = inp["input_ids"].masked_fill(inp["input_ids"] == model.config.image_token_id, -100)
    for variant in ("v", "l", "fastv"):
        with ficoco.apply(model, variant, **RUNS[variant]) as handle:
            out = model(**inp, labels=labels)
            kept = torch.gather(labels, 1, handle.output_positions)
        shifted = F.cross_entropy(out.logits[:, :-1].flatten(0, 1), kept[:, 1:].flatten(), ignore_index=-100)
        torch.testing.assert_close(out.loss, shifted)


# -- the cache: fewer tokens in the full layers, the DeltaNet state unchanged ------------------------

def test_a_reduced_runs_cache_saves_the_removed_tokens_in_the_full_layers_only(model: nn.Module) -> None:
    inp = inputs(model, batch=2, seed=14)
    vanilla = output_cache(model(**inp, use_cache=True))
    text = model.config.text_config
    per_token = 2 * 2 * text.num_key_value_heads * text.head_dim * 4  # batch x (K, V) x heads x dim x fp32
    # FastV cuts at layer 4's input, FiCoCo-L inside layer 3 (after its attention cached every token), so full
    # layer 7 caches 30 and 20 tokens fewer; FiCoCo-V hands both full layers 40 fewer.
    for variant, removed in (("fastv", {7: 30}), ("l", {7: 20}), ("v", {3: 40, 7: 40})):
        with ficoco.apply(model, variant, **RUNS[variant]):
            reduced = output_cache(model(**inp, use_cache=True))
        before, after = cache_bytes_per_layer(vanilla), cache_bytes_per_layer(reduced)
        for layer in range(8):
            saved = removed.get(layer, 0) * per_token
            assert before[layer] - after[layer] == saved, (variant, layer)
        # A DeltaNet layer keeps its conv window and recurrent state whatever the prompt's length.
        assert after[0] == before[0] > 0
        delta = model.model.language_model.layers[0].linear_attn
        conv = 2 * delta.conv_dim * delta.conv_kernel_size * 4
        state = 2 * delta.num_v_heads * delta.head_k_dim * delta.head_v_dim * 4
        assert after[0] == conv + state


# -- PDrop's own row of a gated attention layer ---------------------------------------------------

def test_pdrops_own_row_is_the_gated_layers_own_attention_row(model: nn.Module) -> None:
    """The last row recomputed from layer 7's query half of q_proj, q_norm/k_norm and the partial rotary table
    equals the head-mean of the layer's own eager attention row."""
    from ficoco.models.qwen3_5.hybrid import HybridDecoder

    inp = inputs(model, seed=15)
    layer = model.model.language_model.layers[7]
    captured: dict[str, Any] = {}

    def keep_input(module: nn.Module, args: tuple, kwargs: dict) -> None:
        captured["hidden"], captured["rotary"] = args[0], kwargs["position_embeddings"]

    def keep_weights(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        captured["weights"] = output[1]

    attention = layer.self_attn
    own_config = attention.config
    eager = copy.copy(own_config)
    hf.set_attention_implementation(eager, "eager")
    attention.config = eager
    hooks = [layer.register_forward_pre_hook(keep_input, with_kwargs=True),
             attention.register_forward_hook(keep_weights, with_kwargs=True)]
    try:
        model(**inp)
    finally:
        attention.config = own_config
        for hook in hooks:
            hook.remove()
    hidden, (cos, sin) = captured["hidden"], captured["rotary"]
    length = hidden.shape[1]
    visible = torch.ones(1, length, dtype=torch.bool)
    row = HybridDecoder.own_last_row(layer, hidden, cos, sin, visible)
    expected = captured["weights"][:, :, -1]
    torch.testing.assert_close(row, expected.float(), atol=1e-5, rtol=0)


# -- a real prompt through a local checkout's processor ---------------------------------------------

def test_a_real_prompt_through_a_local_checkouts_processor_runs_v_and_fastv(tmp_path: Any) -> None:
    """The checkpoint's processor and chat template lay the prompt out; the accountant plans the processor's
    grid; FiCoCo-V and FastV (at layer 4, after full layer 3) run on it."""
    from helpers import make_checkpoint
    from PIL import Image

    from ficoco.models.prompt import encode_prompt
    from ficoco.profiles import load_profile, set_layout

    folder = make_checkpoint("qwen3_5", tmp_path / "checkpoint")
    picture = Image.new("RGB", (150, 100))
    picture.putdata([(x % 256, (3 * x) % 256, 40) for x in range(150 * 100)])
    picture.save(tmp_path / "wide.png")
    profile = load_profile(str(folder))
    prompt = encode_prompt(str(folder), profile.config, image=str(tmp_path / "wide.png"), prompt="What is shown?")
    assert prompt.text.startswith("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What is shown?")
    # 150x100 grows to Qwen3-VL's 65536-pixel floor in 32 px steps: 320 x 224, 20 x 14 patches, 70 merge groups.
    assert prompt.image_size == (224, 320) and prompt.visual_tokens == 70
    set_layout(profile, image_size=prompt.image_size)
    assert architecture(profile).visual_tokens == prompt.visual_tokens
    model = ficoco.build_model(str(folder), weights=str(folder), dtype="fp32", check_memory=False)
    length = prompt.encoded["input_ids"].shape[1]
    with ficoco.apply(model, "v", schedule={1: 8}):
        assert model(**prompt.encoded).logits.shape[1] == length - 8
    with ficoco.apply(model, "fastv", schedule="4:30"):
        assert model(**prompt.encoded).logits.shape[1] == length - 30


def test_a_quantized_kv_cache_is_refused_in_one_line(model: nn.Module) -> None:
    """transformers' QuantizedCache builds full-attention layers only: kv_bits is refused before it raises."""
    with pytest.raises(FicocoError, match="quantized cache holds full-attention layers only") as raised:
        ficoco.quantized_cache(model, 4)
    assert "\n" not in str(raised.value)


def test_l_runs_a_new_image_on_an_earlier_turns_cache(model: nn.Module) -> None:
    """FiCoCo-L's later turn with an image of its own on the reduced cache: the DeltaNet layers continue their
    states over the new turn's tokens, the first full layer caches every token of both turns and layer 7 both
    turns' images 20 tokens short each (reduced inside layer 3)."""
    first, second = inputs(model, seed=16), inputs(model, seed=17)
    with ficoco.apply(model, "l", **RUNS["l"]):
        turn1 = greedy(model, first, return_dict_in_generate=True)
        ids = torch.cat([turn1.sequences, second["input_ids"]], 1)
        later = {"input_ids": ids, "attention_mask": torch.ones_like(ids),
                 "mm_token_type_ids": (ids == model.config.image_token_id).int(),
                 "pixel_values": second["pixel_values"],
                 "image_grid_thw": torch.cat([first["image_grid_thw"], second["image_grid_thw"]])}
        turn2 = greedy(model, later, **cache_argument(output_cache(turn1)), return_dict_in_generate=True)
    cache = output_cache(turn2)
    assert cache.get_seq_length() == cache.get_seq_length(3) == ids.shape[1] + NEW - 1
    assert cache.get_seq_length(7) == cache.get_seq_length(3) - 2 * 20
    assert torch.equal(turn2.sequences[:, :ids.shape[1]], ids)
