"""VisionZip's official rule, re-stated here and checked against ficoco on llava-tiny (issue 53).

Official code: dvlab-research/VisionZip at 3151f6df4fca36a4cd1c985e5956e725b1f9ad02.

- visionzip/main.py L5-7: ``visionzip(model, dominant, contextual)`` calls ``apply_info(dominant_num=dominant
  - 1, ...)``: [CLS] is one of the ``dominant`` tokens.
- visionzip/utils.py L22-24 and L89: the attention keeps ``raw_key_states.mean(1)``, the layer's keys averaged
  over heads (the merge metric), L61 its softmax; L122-124 and L191: the metric is kept at layer 22 of 24,
  the layer the projector reads.
- visionzip/clip_encoder.py L42-45: ``attentions[-2]``, ``hidden_states[-2]`` and that layer's metric, from a
  tower run with ``output_attentions=True``; L50-57 (dominant): the [CLS] row over the patch columns summed
  over heads, ``topk(dominant_num) + 1``, [CLS] (index 0) added, the tokens taken by a mask (original order);
  L59-64: the other patches, in order, with their metric L2-normalised; L66-80 (contextual): targets at the
  stride ``max(1, N_r // contextual)``, ``arange(0, N_r, step)[:contextual]``, every other patch assigned to the
  target of highest cosine (argmax), ``counts`` clamped at 1, ``target + sum / counts``; L83: ``[dominant,
  contextual]``, then the projector.

The rule is computed on the unpatched tower (eager attention, its own probabilities, its k_proj output) and
checked against the tokens ficoco hands the projector (allclose) and its record of kept patches (exact). The
official settings are ficoco's defaults; its two corrections (docs/methods/visionzip.md: ``contextual_mode=
"mean"``, ``include_cls=False``) are checked to change what they say and nothing else.

On Qwen2-VL (qwen2-vl-tiny, a 224 x 224 image: 64 merge groups) the tower has no [CLS] and the units are the
PatchMerger's 2 x 2 groups: the official code defines neither, and ficoco (docs/methods/visionzip.md) scores
every group by FiCoCo's equivalent token over the last block's keys, merges by the groups' mean head-mean keys,
cuts the groups' patches side by side before the merger and puts each contextual token at its target's place;
that case re-states the rule above on those quantities of the unpatched tower.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from rule_support_vision import (
    TowerPass,
    assert_decided,
    equivalent_token_group_scores,
    feature_layer,
    group_patch_indices,
    patched_run,
    qwen_patched_run,
    unpatched_qwen_tower,
    unpatched_tower,
)
from torch import Tensor, nn

import ficoco
import ficoco.methods.visionzip.ops as visionzip_ops
from ficoco.models import qwen2_vl, synthetic_inputs

TINY_PROFILE = "llava-tiny"  # built as this module's `model` (conftest.py): 64 patches, [CLS] first
SEED = 1


def official_visionzip(tower: TowerPass, layer: int, dominant: int, contextual: int, include_cls: bool = True,
                       contextual_mode: str = "official") -> tuple[Tensor, Tensor]:
    """(the tokens handed to the projector (B, dominant + contextual, C), the kept patches' record (B, tokens):
    -1 for [CLS] and the contextual tokens). ``include_cls=False`` / ``contextual_mode="mean"``: ficoco's
    corrections, as its docs page states them."""
    hidden = tower.hidden_states[layer + 1]  # the layer's output, [CLS] first
    metric = tower.head_mean_keys(layer)
    scores = tower.attentions[layer][:, :, 0, 1:].sum(dim=1)
    batch, patches = scores.shape
    width = hidden.shape[-1]
    dominant_patches = dominant - 1 if include_cls else dominant
    assert_decided(scores, dominant_patches)
    top = torch.topk(scores, dominant_patches, dim=1).indices
    is_dominant = torch.zeros(batch, patches, dtype=torch.bool).scatter(1, top, True)
    dominant_tokens = hidden[:, 1:][is_dominant].reshape(batch, dominant_patches, width)  # image order
    if include_cls:
        dominant_tokens = torch.cat([hidden[:, :1], dominant_tokens], dim=1)
    rest = patches - dominant_patches
    rest_hidden = hidden[:, 1:][~is_dominant].reshape(batch, rest, width)
    rest_metric = metric[:, 1:][~is_dominant].reshape(batch, rest, -1)
    rest_metric = rest_metric / rest_metric.norm(dim=-1, keepdim=True)
    step = max(1, rest // contextual)
    targets = torch.arange(0, rest, step)[:contextual]
    others = ~torch.isin(torch.arange(rest), targets)
    similarity = rest_metric[:, others] @ rest_metric[:, targets].transpose(1, 2)
    assert_decided(similarity.reshape(-1, contextual), 1)
    assign = F.one_hot(similarity.argmax(dim=2), contextual).to(hidden.dtype)  # (B, members, contextual)
    sums = assign.transpose(1, 2) @ rest_hidden[:, others]
    counts = assign.sum(dim=1).unsqueeze(-1)
    if contextual_mode == "official":
        contextual_tokens = rest_hidden[:, targets] + sums / counts.clamp(min=1)
    else:
        contextual_tokens = (rest_hidden[:, targets] + sums) / (1 + counts)
    tokens = torch.cat([dominant_tokens, contextual_tokens], dim=1)
    dominant_index = torch.stack([row.nonzero().squeeze(-1) for row in is_dominant])
    none = torch.full((batch, 1), -1)
    record = torch.cat([none] * include_cls + [dominant_index, none.expand(-1, contextual)], dim=1)
    return tokens, record


def check_visionzip(model: nn.Module, setting: dict, dominant: int, contextual: int, **corrections) -> Tensor:
    """Runs ficoco, checks it against the rule (with `corrections`); returns the tokens ficoco handed on."""
    inputs = synthetic_inputs(model, batch=2, text_tokens=12, seed=SEED)
    tokens, kept = official_visionzip(unpatched_tower(model, inputs["pixel_values"]), feature_layer(model),
                                      dominant, contextual, **corrections)
    run = patched_run(model, inputs, "visionzip", **setting)
    assert (run.settings["dominant"], run.settings["contextual"]) == (dominant, contextual)
    (record,) = run.records
    assert torch.equal(record.kept, kept)
    torch.testing.assert_close(run.projector_input, tokens, rtol=1e-5, atol=1e-5)
    return run.projector_input


@pytest.mark.parametrize("setting,dominant,contextual", [
    ({}, 54, 10),  # the default, the README's 54 + 10: [CLS] and 53 patches, 11 patches left for 10 targets
    ({"keep": 16}, 14, 2),  # the 27 : 5 split of the published rows
    ({"keep": 32}, 27, 5),
])
def test_visionzip_hands_the_projector_the_official_dominant_and_contextual_tokens(
        model: nn.Module, setting: dict, dominant: int, contextual: int) -> None:
    check_visionzip(model, setting, dominant, contextual)


def test_visionzip_mean_contextual_correction_changes_only_the_contextual_tokens(model: nn.Module) -> None:
    official = check_visionzip(model, {"keep": 16}, 14, 2)
    mean = check_visionzip(model, {"keep": 16, "contextual_mode": "mean"}, 14, 2, contextual_mode="mean")
    assert torch.equal(mean[:, :14], official[:, :14])
    assert not torch.allclose(mean[:, 14:], official[:, 14:])


def test_visionzip_cls_dropped_correction_makes_every_dominant_token_a_patch(model: nn.Module) -> None:
    official = check_visionzip(model, {"keep": 16}, 14, 2)
    dropped = check_visionzip(model, {"keep": 16, "include_cls": False}, 14, 2, include_cls=False)
    assert not torch.allclose(dropped[:, 0], official[:, 0])  # official: [CLS] of the layer first


QWEN_IMAGE = (224, 224)  # 16 x 16 patches, 64 merge groups


@pytest.fixture(scope="module")
def qwen() -> nn.Module:
    return ficoco.build_model("qwen2-vl-tiny", dtype="fp32")


def official_visionzip_groups(units: Tensor, scores: Tensor, metric: Tensor, dominant: int, contextual: int
                              ) -> tuple[list[int], Tensor]:
    """One Qwen2-VL image: (the groups whose places the tokens take, ascending; the units handed on there,
    (dominant + contextual, 4C)) by the rule above with groups for patches and no [CLS]."""
    assert_decided(scores[None], dominant)
    top = sorted(torch.topk(scores, dominant).indices.tolist())
    rest = [g for g in range(units.shape[0]) if g not in top]
    rest_metric = metric[rest] / metric[rest].norm(dim=-1, keepdim=True)
    step = max(1, len(rest) // contextual)
    targets = list(range(0, len(rest), step))[:contextual]
    members = [i for i in range(len(rest)) if i not in targets]
    similarity = rest_metric[members] @ rest_metric[targets].t()
    assert_decided(similarity, 1)
    assign = similarity.argmax(dim=1)
    placed = {g: units[g] for g in top}
    for t, target in enumerate(targets):
        joined = [rest[members[m]] for m in (assign == t).nonzero().squeeze(-1).tolist()]
        mean = units[joined].mean(dim=0) if joined else torch.zeros_like(units[0])
        placed[rest[target]] = units[rest[target]] + mean
    places = sorted(placed)
    return places, torch.stack([placed[g] for g in places])


@pytest.mark.parametrize("keep,dominant,contextual", [(16, 14, 2), (32, 27, 5)])
def test_visionzip_on_qwen2_vl_hands_the_merger_the_rules_groups(qwen: nn.Module, keep: int, dominant: int,
                                                                 contextual: int) -> None:
    inputs = qwen2_vl.synthetic_inputs(qwen, batch=2, text_tokens=12, seed=SEED, image_size=QWEN_IMAGE)
    tower = unpatched_qwen_tower(qwen, inputs)
    kept_patches, handed = [], []
    for image, (keys, (_, cols)) in enumerate(zip(tower.keys, tower.grids, strict=True)):
        patches = tower.image_groups(image, tower.merger_input, per_group=4)
        units = patches.reshape(-1, 4 * patches.shape[-1])  # a group's 4 patches side by side
        metric = keys.mean(dim=0).reshape(-1, 4, keys.shape[-1]).mean(dim=1)  # head mean, then group mean
        places, tokens = official_visionzip_groups(units, equivalent_token_group_scores(keys), metric, dominant,
                                                   contextual)
        kept_patches.append(group_patch_indices(places, cols))
        handed.append(tokens.reshape(-1, patches.shape[-1]))
    run = qwen_patched_run(qwen, inputs, "visionzip", keep=keep, image_size=QWEN_IMAGE)
    (record,) = run.records
    assert record.kept.tolist() == kept_patches
    torch.testing.assert_close(run.projector_input, torch.cat(handed), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("broken", ["lowest_scores", "mean_contextual"])
def test_visionzip_rule_check_catches_a_broken_pick_or_merge(model: nn.Module, monkeypatch: pytest.MonkeyPatch,
                                                             broken: str) -> None:
    if broken == "lowest_scores":
        real_top = visionzip_ops.top_indices
        monkeypatch.setattr(visionzip_ops, "top_indices", lambda scores, k: real_top(-scores, k))
    else:  # the contextual token averaged with its target, under the official setting's name
        real_reduce = visionzip_ops.visionzip_reduce
        monkeypatch.setattr(visionzip_ops, "visionzip_reduce",
                            lambda *args, **kwargs: real_reduce(*args, **{**kwargs, "contextual_mode": "mean"}))
    with pytest.raises(AssertionError):
        check_visionzip(model, {"keep": 16}, 14, 2)
