"""VLM-Pruner's official rule, re-stated here and checked against ficoco's run of it.

Official code: Casey-bit's VLM-Pruner at 556a914, read in the fork xipingyan/VLMPruner @ 2eb1965 (the fork's two
commits change paths and a crash, not the selection): llava/model/language_model/modeling_llama_self.py:331-362
(the step at layer K=2: layer K-1's output ``layer_outputs[0]`` and its post-RoPE keys ``layer_outputs[-2]``, which
the patched SDPA attention returns after ``repeat_kv``, :951 and :982; kept indices sorted, original position ids),
:399-413 (BSS: ``sim * (1 + 0.5 * amin(dist) / (24 sqrt 2))`` on positions ``(i % 24, i // 24)``), :415-521
(``get_retained_image_token``: pivots, the 256-channel cosine, the greedy rounds, SWA);
Qwen2-VL/Qwen2VL_VLMPruner/modeling_qwen2_vl_self.py:406-521 (the same rule, BSS on ``image_grid_thw``'s height
and width, read at lmms-eval/lmms_eval/models/qwen2_vl.py:312-313, before the 2x2 merge; budget ``int()``).

`official_vlmpruner` below is that rule in plain torch on the quantities the official code reads, taken from the
unpatched model: layer K-1's output (``output_hidden_states``) and its post-RoPE keys (caught where the layer's
attention hands them to SDPA, repeated per query head as the official SDPA path does). The official code
hard-codes LLaVA-1.5's 24 x 24 CLIP grid; the tiny LLaVA's CLIP grid is 8 x 8, so the width is the profile's own.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import ficoco
from ficoco.models import hf_compat as hf
from ficoco.models import synthetic_inputs
from ficoco.models.qwen2_vl.inputs import qwen_template_inputs

K = 2  # the official --pruned_layer


def official_vlmpruner(keys: torch.Tensor, states: torch.Tensor, budget: int, width: int, norm_hw: tuple[int, int],
                       pivot_image_token: int = 4, threshold: float = 0.8, token_batch: int = 16,
                       channels: int = 256, rounds: list[float] | None = None
                       ) -> tuple[list[int], torch.Tensor, list[int]]:
    """One image's ``get_retained_image_token``: keys ``(N, H d)`` and layer K-1's output ``(N, D)`` of its tokens.
    Returns (the kept tokens in the order taken, the states after SWA, per discarded token ascending the kept
    token it joined); `rounds` gets every round's threshold."""
    count = keys.shape[0]
    norm_factor = 1.0 / math.sqrt(norm_hw[0] ** 2 + norm_hw[1] ** 2)
    # Step 1: pivots (the largest L1 key norm, then farthest points).
    pivot_indices = torch.zeros(pivot_image_token, dtype=torch.long)
    pivot_indices[0] = torch.norm(keys, p=1, dim=-1).argmax()
    for i in range(1, pivot_image_token):
        dists = torch.cdist(keys, keys[pivot_indices[:i]])
        pivot_indices[i] = dists.min(dim=1).values.argmax()
    selected = pivot_indices.clone().tolist()
    level = threshold - 0.1
    # The cosine of every pair on the channels of highest variance.
    top = torch.topk(states.var(dim=0), k=min(channels, states.shape[1])).indices
    screen = states[:, top]
    sim_all = F.cosine_similarity(screen.unsqueeze(1), screen.unsqueeze(0), dim=-1)
    index = torch.arange(count)
    places = torch.stack([index % width, index // width], dim=-1).float()
    spatial_all = torch.cdist(places, places)

    def bss(sim: torch.Tensor, dist: torch.Tensor) -> torch.Tensor:
        return sim * (1.0 + 0.5 * (torch.amin(dist, dim=1, keepdim=True) * norm_factor))

    # Step 2: the greedy rounds.
    before = 0
    while len(selected) < budget:
        if before == len(selected):
            break
        before = len(selected)
        level = level + 0.1
        if rounds is not None:
            rounds.append(level)
        mask = torch.ones(count, dtype=torch.bool)
        mask[torch.tensor(selected)] = False
        candidates = index[mask]
        if len(candidates) == 0:
            break
        chosen = torch.tensor(selected)
        scores = 1.0 - bss(sim_all[candidates][:, chosen], spatial_all[candidates][:, chosen]).max(dim=1).values
        ranked = candidates[torch.argsort(scores, descending=True)]
        for i in range(0, len(ranked), token_batch):
            if i == token_batch and before == len(selected):
                break
            batch = ranked[i:i + token_batch]
            chosen = torch.tensor(selected)
            max_sims = bss(sim_all[batch][:, chosen], spatial_all[batch][:, chosen]).max(dim=1).values
            valid = batch[max_sims < level]
            if len(selected) + len(valid) > budget:
                valid = batch[torch.topk(1.0 - max_sims, budget - len(selected)).indices]
            if len(valid) > 0:
                selected.extend(valid.tolist())
                if len(selected) >= budget:
                    break
    # Step 3: SWA.
    states = states.clone()
    discarded = index[~torch.isin(index, torch.tensor(selected))]
    chosen = torch.tensor(selected)
    sims = sim_all[discarded][:, chosen]
    most_similar = sims.max(dim=1).indices
    weights = sims * torch.zeros_like(sims).scatter(1, most_similar.unsqueeze(1), 1)
    weights = weights / weights.sum(dim=0, keepdim=True).clamp(min=1e-8)
    aggregated = torch.mm(weights.T, states[discarded])
    update = weights.sum(dim=0) > 0
    states[chosen[update]] = 0.3 * states[chosen[update]] + 0.7 * aggregated[update]
    return selected, states, chosen[most_similar].tolist()


@contextlib.contextmanager
def keys_of_layer(model: Any, layer: int, store: dict[str, torch.Tensor]) -> Iterator[None]:
    """Catch decoder layer `layer`'s post-RoPE keys where its attention hands them to SDPA, repeated per query
    head as the official SDPA path does (``repeat_kv``), heads concatenated: ``store["keys"]`` ``(B, T, H d)``."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    attention = hf.layer_parts(hf.decoder_layers(model)[layer], hf.DECODER_LAYER).attention
    original = ALL_ATTENTION_FUNCTIONS["sdpa"]

    def catching(module: Any, query: torch.Tensor, key: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if module is attention:
            repeated = key.repeat_interleave(query.shape[1] // key.shape[1], dim=1)
            store["keys"] = repeated.transpose(1, 2).reshape(key.shape[0], key.shape[2], -1)
        return original(module, query, key, *args, **kwargs)

    ALL_ATTENTION_FUNCTIONS["sdpa"] = catching
    try:
        yield
    finally:
        ALL_ATTENTION_FUNCTIONS["sdpa"] = original


def layer_input(model: Any, layer: int, store: dict[str, torch.Tensor]) -> Any:
    """A hook keeping what decoder layer `layer` runs on (the input of its first norm: after a step at its input)
    in ``store["input"]``."""
    def hook(_module: Any, args: tuple[Any, ...]) -> None:
        store["input"] = args[0].detach().clone()

    norm = hf.layer_parts(hf.decoder_layers(model)[layer], hf.DECODER_LAYER).input_norm
    return norm.register_forward_pre_hook(hook)


def reference(model: Any, inputs: dict[str, torch.Tensor], budget: int, width: int, norm_hw: tuple[int, int],
              **settings: Any) -> tuple[list[int], torch.Tensor, list[int], int]:
    """The official rule on the unpatched model's layer K-1 output and keys: (kept in the order taken, the image's
    states after SWA, every discarded token's kept token, the image's first position)."""
    store: dict[str, torch.Tensor] = {}
    with torch.no_grad(), keys_of_layer(model, K - 1, store):
        out = model(**inputs, output_hidden_states=True)
    image = inputs["input_ids"][0] == model.config.image_token_id
    start, count = int(image.nonzero()[0]), int(image.sum())
    states = out.hidden_states[K][0, start:start + count]  # layer K-1's output
    keys = store["keys"][0, start:start + count]
    selected, merged, targets = official_vlmpruner(keys, states, budget, width, norm_hw, **settings)
    return selected, merged, targets, start


def ficoco_run(model: Any, inputs: dict[str, torch.Tensor], **options: Any) -> tuple[Any, torch.Tensor]:
    """(layer K's record, what layer K received) under ficoco's VLM-Pruner."""
    store: dict[str, torch.Tensor] = {}
    hook = layer_input(model, K, store)
    try:
        with torch.no_grad(), ficoco.apply(model, "vlmpruner", **options) as handle:
            model(**inputs)
            record = handle.records[0]
    finally:
        hook.remove()
    return record, store["input"][0]


def check(model: Any, inputs: dict[str, torch.Tensor], budget: int, width: int, norm_hw: tuple[int, int],
          options: dict[str, Any], **settings: Any) -> list[int]:
    """ficoco's kept, discarded and merged tokens and the states layer K receives are the official rule's."""
    selected, merged, targets, start = reference(model, inputs, budget, width, norm_hw, **settings)
    record, received = ficoco_run(model, inputs, keep=budget, **options, **settings)
    kept = sorted(selected)
    count = merged.shape[0]
    assert record.layer == K
    assert record.kept[0].tolist() == kept
    assert record.discarded[0].tolist() == [i for i in range(count) if i not in set(selected)]
    assert record.merged_into is not None and record.merged_into[0].tolist() == targets
    torch.testing.assert_close(received[start:start + len(kept)], merged[kept], atol=1e-5, rtol=1e-5)
    return kept


@pytest.fixture(scope="module")
def llava() -> Any:
    return ficoco.build_model("llava-tiny", dtype="fp32")


@pytest.fixture(scope="module")
def qwen() -> Any:
    return ficoco.build_model("qwen2-vl-tiny", dtype="fp32")


def llava_grid(model: Any) -> int:
    vision = model.config.vision_config
    return vision.image_size // vision.patch_size


# Settings chosen so that the channel screen reads fewer channels than the width and a round ends with a batch
# that would overshoot the budget.
SETTINGS = {"channels": 24}


@contextlib.contextmanager
def closer_states(model: Any, inputs: dict[str, torch.Tensor], scale: float | None) -> Iterator[None]:
    """Layer K-1's output with the image tokens' deviations from their mean scaled by `scale` (None: as the model
    computes it): similar enough that the thresholds decide, over several rounds (0.8, 0.9, 1.0 at scale 0.4)."""
    if scale is None:
        yield
        return
    image = inputs["input_ids"][0] == model.config.image_token_id
    start, count = int(image.nonzero()[0]), int(image.sum())

    def closer(_module: Any, _args: Any, output: Any) -> Any:
        hidden = output[0] if isinstance(output, tuple) else output
        span = hidden[:, start:start + count]
        mean = span.mean(dim=1, keepdim=True)
        hidden[:, start:start + count] = mean + scale * (span - mean)
        return output

    hook = hf.decoder_layers(model)[K - 1].register_forward_hook(closer)
    try:
        yield
    finally:
        hook.remove()


@pytest.mark.parametrize(("scale", "budget"), [(None, 12), (None, 40), (0.4, 20), (0.4, 40)])
def test_llava_keeps_merges_and_positions_as_the_official_rule(llava: Any, scale: float | None,
                                                               budget: int) -> None:
    inputs = synthetic_inputs(llava, batch=1, text_tokens=12, seed=3)
    side = llava_grid(llava)
    rounds: list[float] = []
    with closer_states(llava, inputs, scale):
        reference(llava, inputs, budget, side, (side, side), rounds=rounds, **SETTINGS)
        check(llava, inputs, budget, side, (side, side), {}, **SETTINGS)
    assert len(rounds) == (1 if scale is None else 3)  # the thresholds decide over several rounds where close


def qwen_inputs(model: Any, seed: int = 1) -> dict[str, torch.Tensor]:
    """One image of 12 x 16 patches (6 x 8 tokens after the 2x2 merge; `QWEN_IMAGE` in pixels): the official
    width (16) and the token grid's (8) differ, and so do the diagonals."""
    return qwen_template_inputs(model, (12, 16), batch=1, text_tokens=12, seed=seed)


QWEN_IMAGE = {"image_size": (12 * 14, 16 * 14)}  # the accountant counts the image's own tokens


@pytest.mark.parametrize("budget", [10, 24])
def test_qwen2_vl_reads_image_grid_thw_before_the_merge_as_the_official_code(qwen: Any, budget: int) -> None:
    inputs = qwen_inputs(qwen)
    _, height, width = inputs["image_grid_thw"][0].tolist()
    check(qwen, inputs, budget, width, (height, width), QWEN_IMAGE, **SETTINGS)


@pytest.mark.parametrize("budget", [10, 24])
def test_qwen2_vl_token_grid_correction_places_tokens_on_the_merged_grid(qwen: Any, budget: int) -> None:
    inputs = qwen_inputs(qwen)
    _, height, width = inputs["image_grid_thw"][0].tolist()
    merged = (height // 2, width // 2)
    kept = check(qwen, inputs, budget, merged[1], merged, {"bss_grid": "tokens", **QWEN_IMAGE}, **SETTINGS)
    official, *_ = reference(qwen, inputs, budget, width, (height, width), **SETTINGS)
    if budget == 24:
        assert kept != sorted(official)  # the two readings keep different tokens of this image


def test_the_qwen2_vl_default_row_rounds_as_its_code_with_budget_rounding_int(arch_of: Any) -> None:
    from ficoco.accounting.methods import method_schedule

    arch = arch_of("qwen2-vl-7b")
    n = arch.visual_tokens
    rounded = method_schedule(arch, "vlmpruner").settings_dict()["keep"]
    truncated = method_schedule(arch, "vlmpruner", budget_rounding="int").settings_dict()["keep"]
    assert rounded == round(n * (1 - 0.778)) and truncated == int(n * (1 - 0.778))


def test_llava_1_5_presets_keep_the_official_rows(arch_of: Any) -> None:
    from ficoco.accounting.methods import method_schedule

    arch = arch_of("llava-1.5-7b")
    for ratio, keep in ((0.667, 192), (0.778, 128), (0.889, 64)):
        assert round(576 * (1 - ratio)) == keep
        assert method_schedule(arch, "vlmpruner", keep).settings_dict()["keep"] == keep
        assert method_schedule(arch, "vlmpruner", reduction_ratio=ratio).settings_dict()["keep"] == keep
    assert method_schedule(arch, "vlmpruner").settings_dict()["keep"] == 128  # --reduction_ratio 0.778


def test_a_round_that_keeps_nothing_ends_the_selection_with_fewer_tokens(llava: Any) -> None:
    """Image tokens all but alike at layer K-1's output: the first round's first batch keeps nothing, the pivots
    alone stay (the official early end), and the run reports that count."""
    inputs = synthetic_inputs(llava, batch=1, text_tokens=12, seed=3)
    image = inputs["input_ids"][0] == llava.config.image_token_id
    start, count = int(image.nonzero()[0]), int(image.sum())

    def alike(_module: Any, _args: Any, output: Any) -> Any:
        hidden = output[0] if isinstance(output, tuple) else output
        span = hidden[:, start:start + count]
        noise = 1e-3 * torch.randn(span.shape, generator=torch.Generator().manual_seed(0))
        hidden[:, start:start + count] = span.mean(dim=1, keepdim=True) + noise
        return output

    hook = hf.decoder_layers(llava)[K - 1].register_forward_hook(alike)
    try:
        selected, merged, targets, _ = reference(llava, inputs, 32, llava_grid(llava), (8, 8))
        assert len(selected) == 4
        with torch.no_grad(), ficoco.apply(llava, "vlmpruner", keep=32) as handle:
            logits = llava(**inputs).logits
            assert handle.records[0].kept[0].tolist() == sorted(selected)
            assert handle.measured_tokens_per_item == 4
            assert logits.shape[1] == inputs["input_ids"].shape[1] - (count - 4)
    finally:
        hook.remove()


@pytest.mark.parametrize("break_", ["no spatial buffer", "kept share 0.5", "threshold from 0.9"])
def test_a_deliberate_break_of_ficoco_s_rule_fails_the_check(llava: Any, monkeypatch: pytest.MonkeyPatch,
                                                             break_: str) -> None:
    from ficoco.methods.vlmpruner import ops

    if break_ == "no spatial buffer":
        monkeypatch.setattr(ops, "grid_distances", lambda xy, region, scale: torch.zeros(
            xy.shape[0], xy.shape[1], xy.shape[1], device=xy.device))
    elif break_ == "kept share 0.5":
        monkeypatch.setattr(ops, "KEPT_SHARE", 0.5)
    else:
        original = ops.greedy_selection  # called (similarity, distances, start, budget, threshold, token_batch)
        monkeypatch.setattr(ops, "greedy_selection", lambda *a: original(*a[:4], 0.9, *a[5:]))
    inputs = synthetic_inputs(llava, batch=1, text_tokens=12, seed=3)
    side = llava_grid(llava)
    with closer_states(llava, inputs, 0.4), pytest.raises(AssertionError):
        check(llava, inputs, 20, side, (side, side), {}, **SETTINGS)
