"""VisPruner's official rule, re-stated here and checked against ficoco on llava-tiny (issue 53).

Official code: Theia-4869/VisPruner at aefa01adc7c7ce6334e880c88225e90cede760d1 (ficoco first read its copy
anonymous-4869/VisPruner d01c757).

- llava/model/multimodal_encoder/clip_encoder.py L36-52 (``feature_select``) and L64-66: the features are
  ``hidden_states[select_layer][:, 1:]`` and the score row ``attentions[select_layer][:, :, 0, 1:]`` of a tower
  run with ``output_attentions=True`` (eager attention), ``select_layer = -2``.
- llava/model/llava_arch.py L141-186 (``encode_images``): ``int(T * important_ratio)`` important tokens by the
  head-mean [CLS] attention, ``argsort`` descending (L150, L154-157); the rest is the residual, in that order;
  the features L2-normalised (L160); while the residual holds more than the diverse count: ``r = min(8, R -
  diverse)``, ``a`` / ``b`` its even / odd places, each ``a`` token's best cosine to ``b``, the ``r`` highest
  leave, the residual becomes the other ``a`` tokens (descending) then ``b`` (L161-176); the important and
  diverse tokens make a boolean mask (L178-183), so the projected tokens (L185) stay in image order.

The rule is computed on the unpatched tower (eager attention, its own probabilities) and projector.
docs/methods/vispruner.md lists no departure a setting restores (ties aside, which these inputs do not have).
Where the residual is odd the official indexing raises (``R // 2 - r`` rows against ``ceil(R / 2) - r``
picks; ficoco's default 14 of 64 patches here, or 58 of 576): ficoco lets the ``ceil(R / 2)`` ``a`` tokens go
at most all, a behaviour the official code does not define, so the budgets below keep every residual even.

On Qwen2-VL (qwen2-vl-tiny, a 224 x 224 image: 64 merge groups) the tower has no [CLS] and the units are the
PatchMerger's 2 x 2 groups: the official code defines neither, and ficoco (docs/methods/vispruner.md) scores
every group by FiCoCo's equivalent token over the last block's keys and takes a group's 4 patches side by side
(the merger's input) as its features; that case runs the rule above on those quantities of the unpatched tower.
"""

from __future__ import annotations

import pytest
import torch
from rule_support_vision import (
    assert_decided,
    equivalent_token_group_scores,
    group_patch_indices,
    patched_run,
    qwen_patched_run,
    unpatched_projector,
    unpatched_qwen_tower,
    unpatched_tower,
)
from torch import Tensor, nn

import ficoco
import ficoco.methods.vispruner.ops as vispruner_ops
from ficoco.models import qwen2_vl, synthetic_inputs

TINY_PROFILE = "llava-tiny"  # built as this module's `model` (conftest.py): 64 patches, [CLS] first
SEED = 1
IMPORTANT_RATIO = 0.5


def official_vispruner(features: Tensor, image_attentions: Tensor, visual_token_num: int) -> Tensor:
    """(B, T) the kept patch indices, ascending, of ``features`` ``(B, N, C)`` scored by ``(B, H, N)``."""
    batch = features.shape[0]
    important_token_num = int(visual_token_num * IMPORTANT_RATIO)
    diverse_token_num = visual_token_num - important_token_num
    scores = image_attentions.mean(dim=1)
    assert_decided(scores, important_token_num)
    token_indices = scores.argsort(dim=-1, descending=True)
    important_indices = token_indices[:, :important_token_num]
    residual_indices = token_indices[:, important_token_num:]
    normalized = features / features.norm(dim=-1, keepdim=True)
    rows = torch.arange(batch).unsqueeze(-1)
    while True:
        residual = residual_indices.shape[1]
        r = min(8, residual - diverse_token_num)
        if r <= 0:
            break
        if residual % 2:
            raise RuntimeError("the official code raises on an odd residual: choose another budget")
        tokens = normalized[rows, residual_indices]
        a, b = tokens[:, ::2], tokens[:, 1::2]
        best = (a @ b.transpose(-1, -2)).max(dim=-1).values
        assert_decided(best, r)
        distinct = best.argsort(dim=-1, descending=True)[:, r:]
        residual_indices = torch.cat([residual_indices[:, ::2][rows, distinct], residual_indices[:, 1::2]], dim=-1)
    selected = torch.cat([important_indices, residual_indices], dim=-1)
    return selected.sort(dim=-1).values


def check_vispruner(model: nn.Module, keep: int) -> None:
    inputs = synthetic_inputs(model, batch=2, text_tokens=12, seed=SEED)
    layer = model.config.vision_feature_layer  # select_layer
    tower = unpatched_tower(model, inputs["pixel_values"])
    features = tower.hidden_states[layer][:, 1:]
    kept = official_vispruner(features, tower.attentions[layer][:, :, 0, 1:], keep)
    projected = unpatched_projector(model, features)
    run = patched_run(model, inputs, "vispruner", keep=keep)
    (record,) = run.records
    assert torch.equal(record.kept, kept)
    torch.testing.assert_close(run.llm_visual, torch.stack([p[k] for p, k in zip(projected, kept, strict=True)]),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("keep", [16, 32, 40])
def test_vispruner_keeps_the_official_important_and_diverse_patches(model: nn.Module, keep: int) -> None:
    check_vispruner(model, keep)


QWEN_IMAGE = (224, 224)  # 16 x 16 patches, 64 merge groups


@pytest.fixture(scope="module")
def qwen() -> nn.Module:
    return ficoco.build_model("qwen2-vl-tiny", dtype="fp32")


@pytest.mark.parametrize("keep", [16, 32])
def test_vispruner_on_qwen2_vl_keeps_the_rules_merge_groups_by_the_equivalent_token(qwen: nn.Module,
                                                                                    keep: int) -> None:
    inputs = qwen2_vl.synthetic_inputs(qwen, batch=2, text_tokens=12, seed=SEED, image_size=QWEN_IMAGE)
    tower = unpatched_qwen_tower(qwen, inputs)
    kept_patches, tokens = [], []
    for image, (keys, (_, cols)) in enumerate(zip(tower.keys, tower.grids, strict=True)):
        patches = tower.image_groups(image, tower.merger_input, per_group=4)
        units = patches.reshape(-1, 4 * patches.shape[-1])  # a group's 4 patches side by side
        groups = official_vispruner(units[None], equivalent_token_group_scores(keys)[None, None], keep)[0].tolist()
        kept_patches.append(group_patch_indices(groups, cols))
        tokens.append(tower.image_groups(image, tower.merger_output)[groups])
    run = qwen_patched_run(qwen, inputs, "vispruner", keep=keep, image_size=QWEN_IMAGE)
    (record,) = run.records
    assert record.kept.tolist() == kept_patches
    torch.testing.assert_close(run.llm_visual, torch.cat(tokens), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("broken", ["four_per_round", "one_more_important"])
def test_vispruner_rule_check_catches_a_broken_round_or_split(model: nn.Module, monkeypatch: pytest.MonkeyPatch,
                                                              broken: str) -> None:
    if broken == "four_per_round":
        monkeypatch.setattr(vispruner_ops, "DUPLICATES_PER_ROUND", 4)
    else:
        monkeypatch.setattr(vispruner_ops, "important_count", lambda keep, ratio: int(keep * ratio) + 1)
    with pytest.raises(AssertionError):
        check_vispruner(model, 16)
