"""FitPrune's official rule, re-stated here and held against what ficoco deletes.

Official code: ywh187/FitPrune at d28e418, LLaVA_1.5/llava/model/language_model/modeling_llama.py:

- :350-351, :393: the layer's softmaxed attention (eager: ``softmax(q k^T / sqrt(d) + mask)`` in float32), and
  its maximum over the heads, ``attn_weights.max(dim=1).values.squeeze()`` (batch 1);
- :395-396: ``self = sum over the visual query rows of A[35:35+n, 35:35+n] / n``;
- :398: ``cross = sum over every row after the visual span of A[35+n:, 35:35+n]``;
- :400-402: the ``delete_scheme[layer]`` visual tokens of lowest ``cross * self`` (``torch.sort(...).indices``,
  ascending) are deleted, at every layer whose count is not 0 (:392), prefill only;
- :405, :495-499: the attention output's rows and the residual's are cut, so the next layers receive the other
  tokens in order; :812: their position ids are sliced (the original positions stay);
- :357-391: the counts per ``--reduction_ratio``; scripts/v1_5/eval/textvqa.sh:10 runs ratio 60.

The test recomputes the head-max attention itself from each layer's own projections and rotary tables, on what
the layer received (captured by a hook on its attention module: for layer 0 the unpatched model's input, for a
later layer what the patched model handed it), deletes by the rule above, and checks ficoco's records (the kept
and deleted visual tokens) and the positions the next layer receives, at several budgets; a second test breaks
one piece of ficoco's method and sees the check fail. On a LLaVA-1.5 of 32 layers and 576 visual tokens the
published schemes run as they are (scheme "published"); the 4-layer tiny model runs ficoco's scaled scheme.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import ficoco
import ficoco.models.llm_steps as llm_steps
from ficoco.methods import fitprune
from ficoco.methods.fitprune import ops as fitprune_ops
from ficoco.methods.registry import method_label
from ficoco.models import synthetic_inputs

IMAGE_TOKEN = 300
TEXT = 12
# LLaVA-1.5-7B's shape, tiny in width: the published schemes run there as they are.
SEVEN_B_SHAPE = {"text_config.num_hidden_layers": 32, "vision_config.image_size": 336, "image_seq_length": 576,
                 "ficoco.visual_tokens_per_image": 576}


# The seeded init weights give nearly flat attention, under which the self term falls with the position (a later
# visual token is seen by fewer visual rows under the causal mask) and any head statistic deletes the last tokens:
# the decoder's q and k projections are scaled up, so that the attention is peaked and the content decides.
SHARPEN = 16.0


def sharpened(overrides: dict[str, Any] | None = None) -> nn.Module:
    """llava-tiny (4 decoder layers, 64 visual tokens, 4 heads; or `overrides`) in fp32, its attention peaked."""
    model = ficoco.build_model("llava-tiny", dtype="fp32", overrides=overrides)
    with torch.no_grad():
        for layer in model.model.language_model.layers:
            layer.self_attn.q_proj.weight.mul_(SHARPEN)
            layer.self_attn.k_proj.weight.mul_(SHARPEN)
    return model


@pytest.fixture(scope="module")
def model() -> nn.Module:
    return sharpened()


def rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def head_max_attention(attention: nn.Module, received: dict[str, Any]) -> Tensor:
    """(T, T) the layer's softmaxed attention, max over heads, of batch 1, from the attention module's own q/k
    projections and the rotary tables it received (eager attention's arithmetic, in float32)."""
    hidden = received["hidden_states"]
    cos, sin = received["position_embeddings"]
    _, length, _ = hidden.shape
    head_dim = attention.head_dim
    query = attention.q_proj(hidden).view(1, length, -1, head_dim).transpose(1, 2)
    key = attention.k_proj(hidden).view(1, length, -1, head_dim).transpose(1, 2)
    query = query * cos.unsqueeze(1) + rotate_half(query) * sin.unsqueeze(1)
    key = key * cos.unsqueeze(1) + rotate_half(key) * sin.unsqueeze(1)
    key = key.repeat_interleave(query.shape[1] // key.shape[1], dim=1)
    scores = torch.matmul(query, key.transpose(2, 3)) / math.sqrt(head_dim)
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    scores = scores.masked_fill(~causal, torch.finfo(scores.dtype).min)
    weights = nn.functional.softmax(scores, dim=-1, dtype=torch.float32)
    return weights.max(dim=1).values.squeeze(0)


def official_deletion(weights: Tensor, start: int, n_visual: int, count: int) -> list[int]:
    """The visual tokens (indices within the span) the official code deletes: the `count` lowest cross x self."""
    self_attention = (weights[start:start + n_visual, start:start + n_visual] / n_visual).sum(dim=0)
    cross_attention = weights[start + n_visual:, start:start + n_visual].sum(dim=0)
    return torch.sort(cross_attention * self_attention, dim=-1).indices[:count].tolist()


def capture(model: nn.Module, inputs: dict[str, Tensor]) -> list[dict[str, Any]]:
    """What every decoder layer's attention module received in one prefill (its keyword arguments)."""
    received: list[dict[str, Any]] = [{} for _ in model.model.language_model.layers]
    hooks = []
    for index, layer in enumerate(model.model.language_model.layers):
        def keep(module: nn.Module, args: tuple, kwargs: dict, index: int = index) -> None:
            received[index] = {"hidden_states": args[0] if args else kwargs["hidden_states"],
                               "position_embeddings": kwargs["position_embeddings"]}
        hooks.append(layer.self_attn.register_forward_pre_hook(keep, with_kwargs=True))
    try:
        with torch.no_grad():
            model(**inputs)
    finally:
        for hook in hooks:
            hook.remove()
    return received


def check_the_official_rule(model: nn.Module, inputs: dict[str, Tensor], **setting: Any) -> Any:
    """Run ficoco's FitPrune on batch-1 `inputs` and hold every layer's deletion to the official rule; returns
    the handle's schedule."""
    unpatched = capture(model, inputs)
    start = int((inputs["input_ids"][0] == IMAGE_TOKEN).nonzero()[0])
    n_visual = int((inputs["input_ids"][0] == IMAGE_TOKEN).sum())
    with ficoco.apply(model, "fitprune", **setting) as handle:
        patched = capture(model, inputs)
        records = {record.layer: record for record in handle.records}
        counts = handle.schedule.removed_at()
    assert counts, "the setting must delete on this decoder"
    layers = model.model.language_model.layers
    # Layer 0 received the unpatched model's input (checked, not assumed).
    assert torch.equal(patched[0]["hidden_states"], unpatched[0]["hidden_states"])
    ranks = list(range(n_visual))  # the original rank of every visual token still in the span
    positions = list(range(inputs["input_ids"].shape[1]))  # the original position of every token still there
    for layer, decoder_layer in enumerate(layers):
        received = patched[layer]
        # The layer receives the tokens still there at their original rotary positions (:812).
        cos, sin = unpatched[0]["position_embeddings"]
        assert torch.equal(received["position_embeddings"][0], cos[:, positions])
        assert torch.equal(received["position_embeddings"][1], sin[:, positions])
        count = counts.get(layer, 0)
        if not count:
            assert layer not in records  # a layer whose count is 0 deletes (and reads) nothing (:392)
            continue
        deleted = official_deletion(head_max_attention(decoder_layer.self_attn, received), start, len(ranks), count)
        expected_deleted = sorted(ranks[i] for i in deleted)
        expected_kept = [rank for i, rank in enumerate(ranks) if i not in set(deleted)]
        assert records[layer].discarded[0].tolist() == expected_deleted, f"layer {layer}"
        assert records[layer].kept[0].tolist() == expected_kept, f"layer {layer}"
        gone = {start + i for i in deleted}
        positions = [p for k, p in enumerate(positions) if k not in gone]
        ranks = expected_kept
    return handle.schedule


@pytest.mark.parametrize("setting", [
    {},  # the scripts' reduction ratio 60, scaled to the tiny decoder: 34, 6, 10, 0
    {"preset": 64},  # ratio 90, scaled: 59, 0, 1, 0
    {"schedule": "0:5,1:10,2:20,3:3"},  # every layer, the last included
], ids=["ratio-60", "preset-64", "schedule"])
def test_each_layer_deletes_what_the_official_rule_deletes(model: nn.Module, setting: dict) -> None:
    inputs = synthetic_inputs(model, batch=1, text_tokens=TEXT, seed=4)
    check_the_official_rule(model, inputs, **setting)


@pytest.mark.parametrize("break_it", ["sign", "head-mean", "no-self-term"])
def test_the_rule_check_fails_on_a_broken_method(model: nn.Module, monkeypatch: pytest.MonkeyPatch,
                                                 break_it: str) -> None:
    inputs = synthetic_inputs(model, batch=1, text_tokens=TEXT, seed=4)
    scores = fitprune_ops.fitprune_scores
    if break_it == "sign":  # deletes the highest scores
        monkeypatch.setattr(fitprune_ops, "fitprune_scores", lambda *a, **k: -scores(*a, **k))
    elif break_it == "head-mean":  # the probe reads the head-mean, not the head-max
        install = llm_steps.install_probe
        monkeypatch.setattr(llm_steps, "install_probe", lambda *a, **k: install(*a, **{**k, "heads": "mean"}))
    else:  # ranks by the cross term alone
        def cross_only(attn, visual_rows, text_mask, *args: Any, **kwargs: Any) -> Tensor:  # noqa: ANN001
            rows = torch.arange(attn.shape[1]).expand(visual_rows.shape[0], -1)
            block = attn.block(rows, visual_rows, attn.shape[1] - 1)
            return torch.where(text_mask.unsqueeze(2), block, torch.zeros_like(block)).sum(dim=1)
        monkeypatch.setattr(fitprune_ops, "fitprune_scores", cross_only)
    with pytest.raises(AssertionError):
        check_the_official_rule(model, inputs, schedule="0:5,1:10,2:20,3:3")


def test_the_published_schemes_are_the_official_counts() -> None:
    # modeling_llama.py:357-391, per ratio: the total deleted and the first three layers' counts.
    totals = {0: 0, 10: 66, 20: 149, 30: 264, 40: 336, 50: 403, 55: 424, 60: 449, 70: 488, 80: 514, 90: 539}
    firsts = {0: (0, 0, 0), 10: (0, 0, 1), 20: (0, 0, 3), 30: (0, 0, 7), 40: (0, 1, 21), 50: (3, 7, 49),
              55: (6, 17, 69), 60: (14, 33, 89), 70: (48, 79, 118), 80: (128, 127, 118), 90: (262, 153, 80)}
    assert set(fitprune.PUBLISHED_SCHEMES) == set(totals)
    for ratio, counts in fitprune.PUBLISHED_SCHEMES.items():
        assert len(counts) == 32 and sum(counts) == totals[ratio] and counts[:3] == firsts[ratio], ratio
        # ficoco's scaling is the identity on the shape they were fitted on.
        assert fitprune.scaled_scheme(ratio, 576, 32) == counts
    # The rows of --keep / --preset: the literature's 192 / 128 / 64 are ratios 70 / 80 / 90, whose layer averages
    # are 187.9 / 130.6 / 72.8; every other row is its ratio's layer average, rounded.
    for keep, ratio in fitprune.KEEP_ROWS.items():
        average = fitprune.layer_average(fitprune.PUBLISHED_SCHEMES[ratio], 576)
        expected = {70: 192, 80: 128, 90: 64}.get(ratio, round(average))
        assert keep == expected, (keep, ratio, average)


def test_the_published_scheme_runs_as_published_on_llava_7bs_shape() -> None:
    seven_b = sharpened(SEVEN_B_SHAPE)
    inputs = synthetic_inputs(seven_b, batch=1, text_tokens=TEXT, seed=5)
    schedule = check_the_official_rule(seven_b, inputs, preset=192)
    settings = schedule.settings_dict()
    assert settings == {"reduction_ratio": 70, "scheme": "published"}
    assert method_label("fitprune", settings) == "FitPrune"
    assert tuple(schedule.removed_at().get(layer, 0) for layer in range(32)) == fitprune.PUBLISHED_SCHEMES[70]
