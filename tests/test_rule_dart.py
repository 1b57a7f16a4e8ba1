"""DART's official rule, re-stated here, against ficoco's kept set on llava-tiny.

The official code: ZichenWen1/DART, whose history is public in the fork xqy1111111/DART (ZichenWen1's commits
ef78fa9 .. 5a19452, 2025-02-22 .. 2025-08-31); read at 5a19452, llava/model/language_model/modeling_llama_self.py:

- at ``layer_idx == K`` (``--pruned_layer 2``, scripts/v1_5/eval/*.sh with ``--attn_implementation sdpa``), from
  layer K-1's outputs: ``last_layer_state = self.norm(layer_outputs[0])`` and ``any_states = layer_outputs[-2]``,
  the key states the attention returns (L337-349): **post-RoPE** - the SDPA attention applies RoPE (L875) and
  returns those keys (L912), as the eager (L572, L621) and FlashAttention-2 ones (L678, L728) do;
- `get_retained_image_token` (L397-449): ``TOKEN_TOPK = max_num_trunction // (4 + 4)`` (L409); the keys with
  heads concatenated (L419); the 4 image and 4 text (after the image) tokens of largest L1 norm are the pivots
  (L421-429); ``for item in list(indices_set)`` - a Python set of absolute positions - each pivot adds the
  ``TOKEN_TOPK`` remaining image tokens of lowest cosine similarity to it (L431-443); the text pivots are dropped
  (L445);
- ``keep_indexs`` sorted, ``position_ids = keep_indexs`` (original positions; L351-359). Nothing is merged.

The keys are recomputed here from the unpatched model's input of layer K-1 with that layer's own weights and RoPE
at ``arange`` positions (batch 1), the pivot order is CPython's own ``set`` (ficoco emulates it), and the final
norm is the decoder's. The official ``topk`` tie order is unspecified: the inputs are checked to have no near-tie.
"""

from __future__ import annotations

import math

import pytest
import torch
from rule_support import assert_decided, decoder, eager_run, fails_when, own_query_key, rotary, watch_layers
from torch import Tensor, nn

import ficoco
from ficoco.methods.dart import ops as dart_ops
from ficoco.models import synthetic_inputs

TINY_PROFILE = "llava-tiny"  # built as this module's `model` (conftest.py)
START, N = 5, 64
TEXT = 12


def official_dart(model: nn.Module, inputs: dict[str, Tensor], layer: int, max_num_trunction: int) -> list[int]:
    """The retained image positions (absolute, sorted) of the official rule, from the unpatched model."""
    states = eager_run(model, inputs).hidden_states
    entering = states[layer - 1]  # the input of layer K-1
    length = entering.shape[1]
    cos, sin = rotary(model, entering, torch.arange(length).unsqueeze(0))
    _, keys = own_query_key(decoder(model).layers[layer - 1], entering, cos, sin)
    keys = keys.permute(0, 2, 1, 3).reshape(1, length, -1)[0]  # heads concatenated
    with torch.no_grad():
        last_layer_state = decoder(model).norm(states[layer])[0]  # layer K-1's output through the final norm
    token_topk = math.ceil(max_num_trunction // (4 + 4))
    image_norms = keys[START:START + N].abs().sum(dim=-1)
    text_norms = keys[START + N:].abs().sum(dim=-1)
    assert_decided(image_norms, 4)
    assert_decided(text_norms, 4)
    image_indices = (image_norms.topk(4).indices + START).tolist()
    query_indices = (text_norms.topk(4).indices + START + N).tolist()
    indices_set = set(image_indices + query_indices)
    valid_indices = set(range(START, START + N)) - set(image_indices)
    valid_list = list(valid_indices)
    for item in list(indices_set):
        cos_sim = -torch.nn.functional.cosine_similarity(last_layer_state[item], last_layer_state[valid_list], dim=-1)
        assert_decided(cos_sim, token_topk)
        picked = [valid_list[i] for i in cos_sim.topk(token_topk).indices.tolist()]
        indices_set.update(picked)
        valid_indices.difference_update(picked)
        valid_list = list(valid_indices)
    indices_set.difference_update(query_indices)
    return sorted(indices_set)


def check_dart(model: nn.Module, layer: int, max_num_trunction: int, seed: int) -> None:
    inputs = synthetic_inputs(model, batch=1, text_tokens=TEXT, seed=seed)
    expected = official_dart(model, inputs, layer, max_num_trunction)
    assert len(expected) == 4 + 8 * (max_num_trunction // 8)
    with torch.no_grad(), ficoco.apply(model, "dart", layer=layer, keep=max_num_trunction) as handle, \
            watch_layers(model, [layer]) as seen:
        model(**inputs)
    (record,) = handle.records
    assert record.layer == layer and record.kept[0].tolist() == [p - START for p in expected]
    length = inputs["input_ids"].shape[1]
    rows = [*range(START), *expected, *range(START + N, length)]
    assert torch.equal(seen[layer].ran_on[0], seen[layer].received[0, rows])
    cos, _ = rotary(model, seen[layer].received, torch.tensor([rows]))  # original positions: keep_indexs
    assert torch.equal(seen[layer].rotary[0], cos)


@pytest.mark.parametrize("layer,max_num_trunction,seed", [(2, 32, 0), (2, 16, 1), (1, 24, 2)])
def test_dart_keeps_the_pivots_and_the_tokens_least_similar_to_them_in_python_set_order(
        model: nn.Module, layer: int, max_num_trunction: int, seed: int) -> None:
    check_dart(model, layer, max_num_trunction, seed)


def test_the_dart_rule_check_fails_when_the_pivots_are_visited_in_score_order(
        model: nn.Module, monkeypatch: pytest.MonkeyPatch) -> None:
    # ficoco's own named alternative (pivot_order="score") as a break of the default: the sorted order of a set's
    # values is not CPython's iteration order once the set has grown past 8 slots.
    fails_when(monkeypatch, dart_ops, "cpython_set_order", sorted, lambda: check_dart(model, 2, 32, 0))
