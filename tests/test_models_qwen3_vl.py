"""Every method inside Hugging Face Qwen3-VL and Qwen3-VL-MoE, with DeepStack kept consistent (issue 34), lean.

Random seeded qwen3-vl-tiny and qwen3-vl-moe-tiny models in fp32 on CPU: a ViT of 4 blocks over a 256 x 320 image
(16 x 20 patches of 16 px, 8 x 10 merge groups, so 80 LLM tokens) whose blocks 1 and 2 feed DeepStack's mergers,
added to the visual positions after decoder layers 0 and 1 of a Qwen3 decoder of 4 layers (the MoE one: 8 experts,
2 per token, layer 1 dense); prompts are 12 text tokens of the chat template around one image span.

What the tests hold: a method with identity settings is the unpatched model; a method that keeps tokens hands the
decoder exactly the DeepStack features at their original places; one that merges (FiCoCo-V, VisionZip, FiCoCo-L)
merges them with its own weights (read off the method's own function on an identity basis); a method in the
decoder slices them to the kept tokens; generate, labels, a second turn on the cache and a batch equal to its
samples alone; every method runs or refuses in one line.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import ficoco
from ficoco.errors import FicocoError
from ficoco.methods.registry import METHODS
from ficoco.models.hf_compat import cache_argument, output_cache
from ficoco.models.qwen3_vl import PREFIX_TOKENS, Qwen3VLAdapter, synthetic_inputs

pytestmark = pytest.mark.transformers

TEXT = 12
ROWS, COLS = 8, 10  # merge groups of the 16 x 20 patch grid
GROUPS = ROWS * COLS
GRID_W = 2 * COLS
NEW = 3


@pytest.fixture(scope="module", params=["qwen3-vl-tiny", "qwen3-vl-moe-tiny"])
def model(request: pytest.FixtureRequest) -> nn.Module:
    return ficoco.build_model(request.param, dtype="fp32")


def inputs(model: nn.Module, batch: int = 1, seed: int = 0) -> dict[str, Tensor]:
    return synthetic_inputs(model, batch=batch, text_tokens=TEXT, seed=seed)


def sample(batch: dict[str, Tensor], i: int) -> dict[str, Tensor]:
    patches = batch["pixel_values"].shape[0] // batch["input_ids"].shape[0]
    return {k: v[i * patches:(i + 1) * patches] if k == "pixel_values" else v[i:i + 1] for k, v in batch.items()}


def greedy(model: nn.Module, inp: dict[str, Tensor], **kwargs: Any) -> Any:
    return model.generate(**inp, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, **kwargs)


def groups_of(patches: Tensor) -> Tensor:
    """Merge groups (row-major on the 8 x 10 group grid) of row-major patch indices, one per group, ascending."""
    return ((patches // GRID_W // 2) * COLS + (patches % GRID_W) // 2).unique(sorted=True)


def vanilla_taps(model: nn.Module, inp: dict[str, Tensor]) -> list[Tensor]:
    """Per tap, (B, groups, width): the unpatched tower's DeepStack features of every image."""
    with torch.no_grad():
        out = model.model.get_image_features(inp["pixel_values"], inp["image_grid_thw"])
    return [torch.stack(per_image) for per_image in out.deepstack_features]


@contextlib.contextmanager
def deepstack_additions(model: nn.Module) -> Iterator[list[tuple[Tensor, Tensor]]]:
    """Every DeepStack addition the decoder makes: (visual_pos_masks, visual_embeds), in layer order."""
    text_class = type(model.model.language_model)
    original = text_class._deepstack_process
    seen: list[tuple[Tensor, Tensor]] = []

    def spy(self: nn.Module, hidden_states: Tensor, visual_pos_masks: Tensor, visual_embeds: Tensor) -> Tensor:
        seen.append((visual_pos_masks.clone(), visual_embeds.clone()))
        return original(self, hidden_states, visual_pos_masks, visual_embeds)

    text_class._deepstack_process = spy
    try:
        yield seen
    finally:
        text_class._deepstack_process = original


@contextlib.contextmanager
def method_calls(handle: Any, function_name: str) -> Iterator[list[tuple[tuple, dict]]]:
    """The calls of the method's function `function_name` the adapters make through the handle."""
    original = handle.run_method
    calls: list[tuple[tuple, dict]] = []

    def run_method(key: Any, function: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(function, "__name__", "") == function_name:
            calls.append((args, kwargs))
        return original(key, function, *args, **kwargs)

    handle.run_method = run_method
    try:
        yield calls
    finally:
        handle.run_method = original


def per_image(seen: tuple[Tensor, Tensor], batch: int) -> Tensor:
    """An addition's features as (B, visual tokens per sample, width)."""
    mask, embeds = seen
    return embeds.view(batch, int(mask[0].sum()), -1)


# -- the adapter and its inputs ---------------------------------------------------------------------

def test_both_model_types_run_the_one_adapter_with_the_tiny_taps(model: nn.Module) -> None:
    from ficoco.models import adapter_for

    adapter = adapter_for(model)
    assert isinstance(adapter, Qwen3VLAdapter)
    assert [layer for layer, _ in adapter.deepstack_mergers()] == [1, 2]
    inp = inputs(model)
    assert int((inp["input_ids"] == model.config.image_token_id).sum()) == GROUPS
    assert int(inp["input_ids"][0, PREFIX_TOKENS - 1]) == model.config.vision_start_token_id
    # A video: one span per temporal slice, each after its timestamp, between its own markers (issue 53).
    video = synthetic_inputs(model, frames=4)
    assert video["video_grid_thw"].tolist() == [[2, 16, 20]]
    assert int((video["input_ids"] == model.config.vision_start_token_id).sum()) == 2
    assert int((video["input_ids"] == model.config.video_token_id).sum()) == 2 * GROUPS


# -- identity settings are the unpatched model -------------------------------------------------------

IDENTITY = [("v", {"schedule": {}}), ("l", {"schedule": {}}), ("fastv", {"keep": GROUPS}), ("tome", {"keep": GROUPS}),
            ("visionzip", {"keep": GROUPS}), ("fastervlm", {"keep": GROUPS}), ("divprune", {"keep": GROUPS}),
            ("dart", {"keep": GROUPS}), ("vispruner", {"keep": GROUPS}), ("cdpruner", {"keep": GROUPS}),
            ("pdrop", {"schedule": {}}), ("sparsevlm", {"schedule": {}})]


@pytest.mark.parametrize(("variant", "settings"), IDENTITY, ids=[v for v, _ in IDENTITY])
def test_identity_settings_equal_the_unpatched_model(model: nn.Module, variant: str, settings: dict) -> None:
    inp = inputs(model, batch=2, seed=1)
    with torch.no_grad(), deepstack_additions(model) as plain:
        reference = model(**inp).logits
    with torch.no_grad(), deepstack_additions(model) as seen, ficoco.apply(model, variant, **settings) as handle:
        assert "forward" in model.__dict__  # the patched entry really runs
        logits = model(**inp).logits
        assert not any(r.remove for r in handle.schedule.removals)
    assert torch.equal(logits, reference)
    assert len(seen) == len(plain) == 2
    for (mask, embeds), (plain_mask, plain_embeds) in zip(seen, plain, strict=True):
        assert torch.equal(mask, plain_mask) and torch.equal(embeds, plain_embeds)


# -- before the LLM: kept tokens keep their own DeepStack features, merged ones merge with the method's weights --

@pytest.mark.parametrize("variant", ["fastervlm", "divprune", "vispruner", "cdpruner"])
def test_a_cut_that_keeps_hands_each_kept_token_its_own_deepstack_features(model: nn.Module, variant: str) -> None:
    inp = inputs(model, batch=2, seed=2)
    taps = vanilla_taps(model, inp)
    with torch.no_grad(), deepstack_additions(model) as seen, ficoco.apply(model, variant, keep=20) as handle:
        model(**inp)
        kept = [groups_of(handle.records[-1].kept[b]) for b in range(2)]
    assert len(seen) == 2
    for tap, addition in enumerate(seen):
        features = per_image(addition, 2)
        assert features.shape[1] == 20
        for b in range(2):
            assert torch.equal(features[b], taps[tap][b][kept[b]])


def group_basis(count: int, groups: int, merge: int = 4) -> Tensor:
    """(count, groups x merge, groups): member m of group g carries the one-hot e_g (a step's weights, read off)."""
    return torch.eye(groups).repeat_interleave(merge, dim=0).expand(count, -1, -1).contiguous()


def test_ficoco_v_merges_earlier_taps_with_its_own_weights(model: nn.Module) -> None:
    """FiCoCo-V in tower block 2: tap 1 ran before it (features of every group), tap 2 after it (kept groups only).
    Tap 1's features ride through FiCoCo-V's one step and reach the decoder folded with the weights FiCoCo-V folded
    the patches with (its function on an identity basis, with the same attention and keys); tap 2's are the
    reduced tower's own."""
    from ficoco.methods.ficoco_v.ops import reduce_groups

    inp = inputs(model, batch=2, seed=3)
    taps = vanilla_taps(model, inp)
    with torch.no_grad(), deepstack_additions(model) as seen, ficoco.apply(model, "v", schedule={2: 30}) as handle:
        with method_calls(handle, "reduce_groups") as calls:
            model(**inp)
    args, kwargs = calls[0]  # one step: tap 1's features ride with the groups, one row per group
    x, attn, keys, r, index, grid = args
    vision = model.config.vision_config
    riding = kwargs.pop("riding")
    assert len(calls) == 1 and x.shape[-1] == vision.hidden_size
    assert riding.shape == (2, GROUPS, vision.out_hidden_size)
    weights = reduce_groups(group_basis(2, GROUPS), attn, keys, r, index, grid, **kwargs).hidden[:, ::4]
    expected = weights @ taps[0]
    first, second = per_image(seen[0], 2), per_image(seen[1], 2)
    assert first.shape[1] == second.shape[1] == GROUPS - 30
    torch.testing.assert_close(first, expected, atol=1e-5, rtol=1e-5)
    # A fold, not a selection: the kept groups' own rows differ from what they carry now.
    assert not torch.allclose(expected, taps[0][torch.arange(2)[:, None], weights.argmax(-1)], atol=1e-4)


def test_visionzip_merges_its_contextual_tokens_deepstack_features_with_its_weights(model: nn.Module) -> None:
    inp = inputs(model, batch=2, seed=4)
    taps = vanilla_taps(model, inp)
    with torch.no_grad(), deepstack_additions(model) as seen, ficoco.apply(model, "visionzip", keep=20) as handle:
        with method_calls(handle, "tower_step") as calls:
            model(**inp)
        module, settings = METHODS["visionzip"].load(), dict(calls[0][0][1])
    step_inputs = calls[0][0][0]
    basis = replace(step_inputs, hidden=torch.eye(GROUPS).expand(2, -1, -1).contiguous())
    out = module.tower_step(basis, settings)
    order = out.positions.sort(dim=1).indices
    weights = torch.gather(out.hidden, 1, order[..., None].expand(-1, -1, GROUPS))
    assert bool(((weights > 0).sum(-1) > 1).any())  # some tokens are merges of several groups
    for tap, addition in enumerate(seen):
        torch.testing.assert_close(per_image(addition, 2), weights @ taps[tap], atol=1e-5, rtol=1e-5)


def test_tome_merges_keep_deepstack_consistent_and_a_batch_equal_to_its_samples(model: nn.Module) -> None:
    batch = inputs(model, batch=2, seed=5)
    with torch.no_grad(), deepstack_additions(model) as seen, ficoco.apply(model, "tome", keep=20):
        together = model(**batch).logits
        alone = [model(**sample(batch, i)).logits for i in range(2)]
    assert [int(mask.sum()) for mask, _ in seen[:2]] == [40, 40]
    for i in range(2):
        torch.testing.assert_close(together[i:i + 1], alone[i], atol=1e-5, rtol=0)


# -- in the decoder: DeepStack sliced to the kept tokens (merged under FiCoCo-L) ------------------------

@pytest.mark.parametrize(("variant", "schedule"), [("fastv", "1:40"), ("pdrop", "1:30,3:20")])
def test_a_decoder_method_slices_deepstack_to_the_kept_tokens(model: nn.Module, variant: str, schedule: str) -> None:
    """A step at layer 1's input, before DeepStack adds tap 1 after layer 1: the kept tokens get their own
    features, exactly; tap 0 (after layer 0) still reaches every visual token."""
    inp = inputs(model, batch=2, seed=6)
    taps = vanilla_taps(model, inp)
    with torch.no_grad(), deepstack_additions(model) as seen, ficoco.apply(model, variant, schedule=schedule) as handle:
        model(**inp)
        kept = next(r.kept for r in handle.records if r.layer == 1)
    assert [int(mask[0].sum()) for mask, _ in seen] == [GROUPS, GROUPS - int(schedule.split(",")[0][2:])]
    assert torch.equal(per_image(seen[0], 2), taps[0])
    later = per_image(seen[1], 2)
    for b in range(2):
        assert torch.equal(later[b], taps[1][b][kept[b]])


def test_ficoco_l_merges_the_later_taps_with_its_own_weights(model: nn.Module) -> None:
    from ficoco.methods.ficoco_l.ops import layer_step

    inp = inputs(model, batch=2, seed=7)
    taps = vanilla_taps(model, inp)
    with torch.no_grad(), deepstack_additions(model) as seen, ficoco.apply(model, "l", schedule={1: 30}) as handle:
        with method_calls(handle, "merged_step") as calls:
            model(**inp)
        settings = calls[0][0][1]
    step_inputs = calls[0][0][0]
    mask = inp["input_ids"] == model.config.image_token_id
    length = mask.shape[1]
    weights = layer_step(replace(step_inputs, hidden=torch.eye(length).expand(2, -1, -1).contiguous()),
                         settings).hidden  # (B, T', T): the reduced sequence in terms of the prompt's tokens
    dense = torch.zeros(2, length, taps[1].shape[-1]).masked_scatter(mask[..., None], taps[1])
    expected = weights @ dense
    later_mask, later = seen[1]
    assert int(later_mask[0].sum()) == GROUPS - 30
    torch.testing.assert_close(later, expected[later_mask], atol=1e-5, rtol=1e-5)
    assert float(expected[~later_mask].abs().max()) == 0.0  # FiCoCo-L merges visual tokens into visual ones
    assert torch.equal(per_image(seen[0], 2), taps[0])


def test_sparsevlm_refuses_recycling_where_deepstack_adds_and_runs_after(model: nn.Module) -> None:
    inp = inputs(model, batch=1, seed=8)
    with pytest.raises(FicocoError) as refused:
        ficoco.apply(model, "sparsevlm", schedule="1:30,3:20")
    assert "\n" not in str(refused.value) and "DeepStack" in str(refused.value)
    with torch.no_grad(), ficoco.apply(model, "sparsevlm", schedule="2:30,3:20"):
        assert model(**inp).logits.shape[1] < inp["input_ids"].shape[1]


# -- generate, labels, a second turn on the cache, a batch -------------------------------------------

RUNS = [("v", {"keep": 40}), ("l", {"keep": 40}), ("fastv", {"schedule": "1:40"}), ("divprune", {"keep": 20})]


@pytest.mark.parametrize(("variant", "settings"), RUNS, ids=[v for v, _ in RUNS])
def test_generate_of_a_batch_equals_its_samples_alone(model: nn.Module, variant: str, settings: dict) -> None:
    batch = inputs(model, batch=2, seed=9)
    length = batch["input_ids"].shape[1]
    with torch.no_grad(), ficoco.apply(model, variant, **settings):
        together = greedy(model, batch)
        alone = [greedy(model, sample(batch, i)) for i in range(2)]
    assert torch.equal(together[:, :length], batch["input_ids"])
    for i in range(2):
        assert torch.equal(together[i:i + 1], alone[i])


def test_labels_score_the_remaining_positions(model: nn.Module) -> None:
    inp = inputs(model, batch=2, seed=10)
    labels = inp["input_ids"].masked_fill(inp["input_ids"] == model.config.image_token_id, -100)
    for variant in ("v", "l"):
        with torch.no_grad(), ficoco.apply(model, variant, keep=40) as handle:
            out = model(**inp, labels=labels)
            kept = torch.gather(labels, 1, handle.output_positions)
        shifted = F.cross_entropy(out.logits[:, :-1].flatten(0, 1), kept[:, 1:].flatten(), ignore_index=-100)
        torch.testing.assert_close(out.loss, shifted)


@pytest.mark.parametrize("variant", ["v", "l"])
def test_a_text_turn_on_the_cache_equals_the_whole_conversation(model: nn.Module, variant: str) -> None:
    first = inputs(model, batch=2, seed=11)
    question = inputs(model, seed=12)["input_ids"][:, -4:].expand(2, -1)
    with torch.no_grad(), ficoco.apply(model, variant, keep=40):
        turn1 = greedy(model, first, return_dict_in_generate=True)
        ids = torch.cat([turn1.sequences, question], dim=1)
        nxt = {"input_ids": ids, "attention_mask": torch.ones_like(ids),
               "mm_token_type_ids": (ids == model.config.image_token_id).int()}
        turn2 = greedy(model, nxt, **cache_argument(output_cache(turn1)), return_dict_in_generate=True)
        images = {key: first[key] for key in ("pixel_values", "image_grid_thw")}
        whole = greedy(model, {**nxt, **images}, return_dict_in_generate=True)
    assert torch.equal(turn2.sequences, whole.sequences)


# -- every method runs or refuses in one line ------------------------------------------------------------

SETTINGS = {"v": {"keep": 20}, "l": {"keep": 20}, "fastv": {}, "pdrop": {"schedule": "1:30,3:20"},
            "sparsevlm": {"schedule": "2:30,3:20"}, "dart": {"keep": 20}, "tome": {"keep": 20},
            "visionzip": {"keep": 20}, "fastervlm": {"keep": 20}, "divprune": {"keep": 20},
            "vispruner": {"keep": 20}, "cdpruner": {"keep": 20}, "hiprune": {"keep": 20}, "vlmpruner": {"keep": 20},
            "fitprune": {}, "gprune": {"keep": 20}, "vtw": {"layer": 2},
            "pixelprune": {}, "vscan": {"keep": 20}}


@pytest.mark.parametrize("variant", list(METHODS))
def test_every_method_runs_or_refuses_in_one_line(model: nn.Module, variant: str) -> None:
    family = model.config.model_type
    status, reason = METHODS[variant].family_status(family)
    inp = inputs(model, seed=13)
    if METHODS[variant].pooled_grid and status == "yes":  # a video method (FlashVID): an image is refused
        with pytest.raises(FicocoError, match="an image is one frame") as refused:
            ficoco.apply(model, variant)
        assert "\n" not in str(refused.value)
        return
    if variant not in SETTINGS:
        assert status == "refused" and reason
        with pytest.raises(FicocoError) as refused:
            ficoco.apply(model, variant)
        assert "\n" not in str(refused.value) and family in str(refused.value)
        return
    assert status == "yes"
    with torch.no_grad(), ficoco.apply(model, variant, **SETTINGS[variant]) as handle:
        logits = model(**inp).logits
    # An adaptive count is the image's own: random pixels keep every group (PixelPrune).
    assert logits.shape[1] < inp["input_ids"].shape[1] or any(r.layer >= 1 for r in handle.schedule.removals) \
        or handle.schedule.settings_dict().get("adaptive")


# -- a real prompt through the checkpoint's processor ----------------------------------------------------

def test_a_real_prompt_is_laid_out_by_the_processor_planned_and_run(model: nn.Module, tmp_path: Any) -> None:
    """A local checkpoint (the tiny model saved with Qwen2-VL's image processor at Qwen3-VL's 16 px patches and
    65536..16777216-pixel bounds, and the ChatML template): a 150 x 100 image resizes to 320 x 224 (multiples of
    32 above 65536 pixels), 7 x 10 merge groups; the accountant plans the same count; FiCoCo-V and FastV generate
    from it."""
    from helpers import make_checkpoint
    from PIL import Image

    from ficoco.accounting import architecture
    from ficoco.models.prompt import encode_prompt
    from ficoco.profiles import load_profile, set_layout

    family = model.config.model_type
    folder = make_checkpoint(family, tmp_path / family)
    picture = tmp_path / "wide.png"
    Image.new("RGB", (150, 100), (30, 120, 200)).save(picture)
    profile = load_profile(str(folder))
    prompt = encode_prompt(str(folder), profile.config, image=str(picture), prompt="What is shown?")
    assert prompt.text.startswith("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What is shown?")
    assert prompt.image_size == (224, 320) and prompt.visual_tokens == 70
    set_layout(profile, image_size=prompt.image_size)
    assert architecture(profile).visual_tokens == 70
    built = ficoco.build_model(str(folder), weights=str(folder), dtype="fp32", check_memory=False)
    batch = prompt.batch(1, device="cpu", dtype=torch.float32)
    with torch.no_grad():
        for variant, settings in (("v", {"keep": 30, "first_layer": 2}), ("fastv", {"schedule": "1:30"})):
            with ficoco.apply(built, variant, image_size=prompt.image_size, **settings):
                out = greedy(built, batch)
            assert torch.equal(out[:, :batch["input_ids"].shape[1]], batch["input_ids"]) and out.shape[1] > 3


def test_images_of_two_sizes_in_one_prompt_keep_their_own_deepstack_features(model: nn.Module) -> None:
    """One prompt, a 16 x 20-patch image then a 16 x 16 one (cut in one batched step per size): every kept token
    of either image reaches the decoder with exactly its own group's features, in reading order."""
    wide, square = inputs(model, seed=14), synthetic_inputs(model, text_tokens=TEXT, seed=15, image_size=(256, 256))
    ids = torch.cat([wide["input_ids"][:, :-5], square["input_ids"][:, 1:]], dim=1)
    inp = {"input_ids": ids, "attention_mask": torch.ones_like(ids),
           "mm_token_type_ids": (ids == model.config.image_token_id).int(),
           "pixel_values": torch.cat([wide["pixel_values"], square["pixel_values"]]),
           "image_grid_thw": torch.cat([wide["image_grid_thw"], square["image_grid_thw"]])}
    with torch.no_grad():
        plain = model.model.get_image_features(inp["pixel_values"], inp["image_grid_thw"]).deepstack_features
    with torch.no_grad(), deepstack_additions(model) as seen, ficoco.apply(model, "fastervlm", keep=20) as handle:
        model(**inp)
        first, second = handle.records[-2].kept[0], handle.records[-1].kept[0]
    kept = [((first // 20 // 2) * 10 + (first % 20) // 2).unique(),
            ((second // 16 // 2) * 8 + (second % 16) // 2).unique()]
    assert [len(k) for k in kept] == [20, 4]  # 60 of 80 groups cut from each image
    for tap, (mask, embeds) in enumerate(seen):
        assert int(mask.sum()) == 24
        assert torch.equal(embeds, torch.cat([plain[tap][0][kept[0]], plain[tap][1][kept[1]]]))


@pytest.mark.parametrize("every_grid", [False, True], ids=["this-turns-grid", "every-grid"])
def test_v_second_turn_with_a_new_image_on_the_cache_equals_the_one_prompt(model: nn.Module, every_grid: bool) -> None:
    """generate with the whole conversation on the first turn's cache, a new image in the second turn (its grid
    alone, or every image's): the tokens of the whole conversation run as one prompt, whose DeepStack features
    (both images', kept groups only) reach the decoder as the turns' do."""
    first = inputs(model, batch=2, seed=16)
    with torch.no_grad(), ficoco.apply(model, "v", keep=40):
        turn1 = greedy(model, first, return_dict_in_generate=True)
        turn = inputs(model, batch=2, seed=17)
        ids = torch.cat([turn1.sequences, turn["input_ids"]], dim=1)
        nxt = {"input_ids": ids, "attention_mask": torch.ones_like(ids),
               "mm_token_type_ids": (ids == model.config.image_token_id).int(), "pixel_values": turn["pixel_values"],
               "image_grid_thw": turn["image_grid_thw"]}
        both_grids = torch.stack([first["image_grid_thw"], turn["image_grid_thw"]], dim=1).flatten(0, 1)
        if every_grid:
            nxt["image_grid_thw"] = both_grids
        turn2 = greedy(model, nxt, **cache_argument(output_cache(turn1)), return_dict_in_generate=True)
        pixels = torch.cat([first["pixel_values"].view(2, -1, first["pixel_values"].shape[-1]),
                            turn["pixel_values"].view(2, -1, turn["pixel_values"].shape[-1])], dim=1).flatten(0, 1)
        whole = greedy(model, {**nxt, "pixel_values": pixels, "image_grid_thw": both_grids},
                       return_dict_in_generate=True)
    length = ids.shape[1]
    assert torch.equal(turn2.sequences[:, :length], ids)
    assert torch.equal(turn2.sequences[:, length:], whole.sequences[:, length:])
    assert output_cache(turn2).get_seq_length() == output_cache(whole).get_seq_length()


def test_l_second_turn_with_a_new_image_slices_its_deepstack_features(model: nn.Module) -> None:
    """FiCoCo-L on a later turn's cache with a new image (every image's grid, as transformers' 3-D positions
    take them): the new image's DeepStack features reach the decoder, tap 1's sliced and merged to what layer 1
    kept (FiCoCo-L's weights), with nothing removed the unpatched conversation."""
    first, turn = inputs(model, seed=18), inputs(model, seed=19)

    def conversation() -> tuple[Any, dict[str, Tensor]]:
        turn1 = greedy(model, first, return_dict_in_generate=True)
        ids = torch.cat([turn1.sequences, turn["input_ids"]], dim=1)
        nxt = {"input_ids": ids, "attention_mask": torch.ones_like(ids),
               "mm_token_type_ids": (ids == model.config.image_token_id).int(), "pixel_values": turn["pixel_values"],
               "image_grid_thw": torch.cat([first["image_grid_thw"], turn["image_grid_thw"]])}
        return greedy(model, nxt, **cache_argument(output_cache(turn1))), nxt

    with torch.no_grad():
        turn1 = greedy(model, first, return_dict_in_generate=True)
        ids = torch.cat([turn1.sequences, turn["input_ids"]], dim=1)
        encoded = model.model.get_image_features(turn["pixel_values"], turn["image_grid_thw"], return_dict=True)
        vanilla = greedy(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids),
                                 "mm_token_type_ids": (ids == model.config.image_token_id).int(),
                                 "image_grid_thw": torch.cat([first["image_grid_thw"], turn["image_grid_thw"]]),
                                 "mm_encoder_outputs": {"image": encoded}}, **cache_argument(output_cache(turn1)))
        with ficoco.apply(model, "l", schedule={}):
            assert torch.equal(conversation()[0], vanilla)
        taps = vanilla_taps(model, turn)
        with deepstack_additions(model) as seen, ficoco.apply(model, "l", schedule={1: 30}) as handle:
            reduced, nxt = conversation()
            last = handle.records[-1]
    assert torch.equal(reduced[:, :nxt["input_ids"].shape[1]], nxt["input_ids"])
    assert last.layer == 1 and last.kept.shape[1] == GROUPS - 30
    mask, later = seen[-1]  # the second turn's prefill, tap 1
    assert int(mask.sum()) == GROUPS - 30 and mask.shape[1] < nxt["input_ids"].shape[1]
    assert torch.equal(seen[-2][1], taps[0][0])  # tap 0: every token of the new image
    # Kept tokens that absorbed nothing carry their own features exactly.
    untouched = [rank for rank in last.kept[0].tolist()
                 if last.merged_into is None or rank not in last.merged_into[0].tolist()]
    rows = {rank: row for row, rank in enumerate(last.kept[0].tolist())}
    assert untouched
    for rank in untouched:
        assert torch.equal(later[rows[rank]], taps[1][0][rank])


def test_refusals_at_the_call_name_the_family(model: nn.Module) -> None:
    """Qwen2-VL's parts refuse in one line; on Qwen3-VL the line names Qwen3-VL (PixelPrune reduces images only: each
    keeps its own count, so a video's slices are not its items; tests/test_qwen_video_items.py has the methods that
    reduce them)."""
    inp = inputs(model, seed=20)
    video = {key: value for key, value in inp.items() if key not in ("pixel_values", "image_grid_thw")}
    video.update(pixel_values_videos=inp["pixel_values"], video_grid_thw=inp["image_grid_thw"])
    with torch.no_grad(), ficoco.apply(model, "pixelprune"), pytest.raises(FicocoError) as refused:
        model(**video)
    assert "Qwen3-VL" in str(refused.value) and "Qwen2-VL" not in str(refused.value)
    assert "\n" not in str(refused.value)


def test_offloaded_to_cpu_and_disk_gives_the_unsplit_results(model: nn.Module) -> None:
    """A device map (tower and decoder between CPU memory and disk, accelerate's hooks on the DeepStack mergers
    too): FiCoCo-V and FastV give the unsplit model's logits and records."""
    split = ficoco.build_model(model._ficoco_profile_name, dtype="fp32", device_map="cpu-offload",
                               max_memory={"cpu": 700_000})
    assert {"cpu", "disk"} <= set(split.hf_device_map.values())
    inp = inputs(model, seed=21)
    for variant, settings in (("v", {"keep": 40}), ("fastv", {"schedule": "1:40"})):
        results = []
        for built in (model, split):
            with torch.no_grad(), ficoco.apply(built, variant, **settings) as handle:
                results.append((built(**inp).logits, [r.kept.tolist() for r in handle.records]))
        (logits, kept), (split_logits, split_kept) = results
        assert kept and kept == split_kept and torch.equal(logits, split_logits)


def test_verify_holds_every_stage_with_deepstack_riding_through_the_methods(model: nn.Module) -> None:
    """`flops --verify` on the tiny model: the methods whose merges DeepStack's features ride through (ToMe,
    VisionZip) and those that slice them (FastV, a keep-only cut) count within 0.5 % on every stage, the method's
    own included (the features ride in extra channels of its scatter-adds: no second run)."""
    from ficoco.accounting import CountOptions, architecture, resolve_schedule
    from ficoco.accounting.schedule import Schedule
    from ficoco.profiles import load_profile
    from ficoco.profiling.verify import verify

    profile = load_profile(model._ficoco_profile_name)
    arch = architecture(profile)
    schedules = [Schedule("vanilla")] + [resolve_schedule(arch, variant, CountOptions(), **settings)
                                         for variant, settings in (("tome", {"keep": 20}), ("visionzip", {"keep": 20}),
                                                                   ("fastv", {"schedule": "1:40"}),
                                                                   ("divprune", {"keep": 20}))]
    result = verify(profile, schedules, tolerance_percent=0.5, model=model)
    assert result.passed, [(run.variant, s.stage, s.fvcore_diff) for run in result.runs for s in run.stages]
