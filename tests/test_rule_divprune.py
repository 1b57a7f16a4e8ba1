"""DivPrune's official rule, re-stated here and checked against ficoco on llava-tiny (issue 53).

Official code: vbdi/divprune at 799e2d950aa01ba7860907f5a6d86061f885dca6 (the file last changed at 689ab4d),
LLaVA/llava/model/llava_arch.py:

- L147-150 (``pairwise_cosine_similarity``) and L152-172 (``DivPrune``): ``threshold_terms =
  int(round(threshold_ratio * N))`` (L153); the distance ``1 - cos`` of every pair (L155); the first pick is
  the argmax over tokens of the second-smallest distance in its column (``topk(m2, 2, dim=0,
  largest=False).values[1, :]``, L165: the smallest is the token's own), every later one the argmax of the
  minimum distance to the picked rows (L167-169).
- L352-383: with ``LAYER_INDEX=0`` the rule runs on the image's tokens in the LLM's input, i.e. the
  projector's output (L374-375), ``SUBSET_RATIO`` of them; the kept indices are sorted (L378-379), so the
  tokens stay in image order.

The rule is computed on the unpatched tower and projector. docs/methods/divprune.md lists ficoco's departures
(a picked token masked out rather than left at its near-zero distance to itself, the diagonal masked at the
first pick rather than taken as the smallest, one image per item where the official code reads sample 0): none
changes a pick on inputs without duplicate tokens, such as these, so the rule below is the official code's as
it is.
"""

from __future__ import annotations

import pytest
import torch
from rule_support_vision import assert_decided, feature_layer, patched_run, unpatched_projector, unpatched_tower
from torch import Tensor, nn

import ficoco.methods.divprune.ops as divprune_ops
from ficoco.models import synthetic_inputs

TINY_PROFILE = "llava-tiny"  # built as this module's `model` (conftest.py): 64 patches, [CLS] first
SEED = 1


def official_divprune(features: Tensor, threshold_terms: int) -> list[int]:
    """One image's kept token indices (ascending) of its ``(N, D)`` projected tokens."""
    unit = features / features.norm(dim=1, keepdim=True)
    cosine_matrix = 1.0 - unit @ unit.t()
    selected: list[int] = []
    for i in range(threshold_terms):
        if i == 0:
            scores = torch.topk(cosine_matrix, 2, dim=0, largest=False).values[1, :]
        else:
            scores = cosine_matrix[selected].min(dim=0).values
        assert_decided(scores[None], 1)
        selected.append(int(torch.argmax(scores)))
    return sorted(selected)


def check_divprune(model: nn.Module, setting: dict, keep: int) -> None:
    inputs = synthetic_inputs(model, batch=2, text_tokens=12, seed=SEED)
    tower = unpatched_tower(model, inputs["pixel_values"])
    projected = unpatched_projector(model, tower.hidden_states[feature_layer(model) + 1][:, 1:])
    kept = torch.tensor([official_divprune(item, keep) for item in projected])
    run = patched_run(model, inputs, "divprune", **setting)
    (record,) = run.records
    assert torch.equal(record.kept, kept)
    torch.testing.assert_close(run.llm_visual, torch.stack([p[k] for p, k in zip(projected, kept, strict=True)]),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("setting,keep", [({}, 6), ({"keep": 16}, 16), ({"keep": 40}, 40)])
def test_divprune_keeps_the_official_greedy_max_min_picks_in_image_order(model: nn.Module, setting: dict,
                                                                         keep: int) -> None:
    # {}: the default SUBSET_RATIO 0.098, int(round(0.098 * 64)) = 6 tokens.
    check_divprune(model, setting, keep)


@pytest.mark.parametrize("broken", ["similarity_for_distance", "first_pick_dropped"])
def test_divprune_rule_check_catches_a_broken_distance_or_greedy(model: nn.Module, monkeypatch: pytest.MonkeyPatch,
                                                                 broken: str) -> None:
    if broken == "similarity_for_distance":  # 1 + cos: the most similar tokens picked
        real_distance = divprune_ops.cosine_distance
        monkeypatch.setattr(divprune_ops, "cosine_distance", lambda features: 2 - real_distance(features))
    else:  # an off-by-one in the greedy: one pick too many, the first left out
        real_select = divprune_ops.max_min_select
        monkeypatch.setattr(divprune_ops, "max_min_select",
                            lambda distance, keep: real_select(distance, keep + 1)[:, 1:])
    with pytest.raises(AssertionError):
        check_divprune(model, {"keep": 16}, 16)
