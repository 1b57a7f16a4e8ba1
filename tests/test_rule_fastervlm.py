"""FasterVLM's official rule, re-stated here and checked against ficoco on llava-tiny (issue 53).

Official code: Theia-4869/FasterVLM at f5d5f12037e105a51865ecb4b28a73cd86eb4921.

- llava/model/multimodal_encoder/clip_encoder.py L36-47 (`feature_select`): the features are
  ``hidden_states[select_layer][:, 1:]`` and the score row is ``attentions[select_layer][:, :, 0, 1:]``, the
  [CLS] query's softmax over every key, patch columns; L60: the tower runs with ``output_attentions=True``
  (eager attention), ``select_layer = -2`` (the layer the projector reads).
- llava/model/llava_arch.py L141-157 (`encode_images`): the head mean (L148), ``topk(T)`` (L149), a boolean
  index mask (L152-153), the projector on every patch (L155); L242-247: ``image_feature[index_mask]``, so the
  kept tokens stay in image order.

The rule is computed on the unpatched tower (eager attention, its own attention probabilities) and the
unpatched projector; ficoco computes its [CLS] row beside SDPA. docs/methods/fastervlm.md lists no departure a
setting restores (ties aside, which these inputs do not have), so the official default is what runs.

On Qwen2-VL (qwen2-vl-tiny) the tower has no [CLS] and the LLM's tokens are the PatchMerger's 2 x 2 groups: the
official code defines neither, and ficoco scores every group by FiCoCo's equivalent token over the last block's
keys (docs/methods/fastervlm.md), keeps the top groups after the merger, in group order; that case re-states
that rule on the unpatched tower's keys and merger output.
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
import ficoco.methods.fastervlm.ops as fastervlm_ops
from ficoco.models import qwen2_vl, synthetic_inputs

TINY_PROFILE = "llava-tiny"  # built as this module's `model` (conftest.py): 64 patches, [CLS] first
SEED = 1


def official_fastervlm(model: nn.Module, inputs: dict[str, Tensor], keep: int) -> tuple[Tensor, Tensor]:
    """(kept patch indices (B, keep), the tokens the LLM receives (B, keep, D)) by the official code's rule."""
    layer = model.config.vision_feature_layer  # select_layer
    tower = unpatched_tower(model, inputs["pixel_values"])
    features = tower.hidden_states[layer][:, 1:]
    image_attentions = tower.attentions[layer][:, :, 0, 1:].mean(dim=1)  # (B, N)
    assert_decided(image_attentions, keep)
    token_indices = torch.topk(image_attentions, k=keep, dim=1).indices
    index_masks = torch.zeros_like(image_attentions, dtype=torch.bool).scatter(1, token_indices, True)
    projected = unpatched_projector(model, features)
    batch, _, width = projected.shape
    kept = torch.stack([mask.nonzero().squeeze(-1) for mask in index_masks])
    return kept, projected[index_masks].reshape(batch, keep, width)


def check_fastervlm(model: nn.Module, setting: dict, keep: int) -> None:
    inputs = synthetic_inputs(model, batch=2, text_tokens=12, seed=SEED)
    kept, tokens = official_fastervlm(model, inputs, keep)
    run = patched_run(model, inputs, "fastervlm", **setting)
    (record,) = run.records
    assert torch.equal(record.kept, kept)
    torch.testing.assert_close(run.llm_visual, tokens, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("setting,keep", [({}, 16), ({"keep": 8}, 8), ({"keep": 40}, 40)])
def test_fastervlm_keeps_the_official_cls_attention_top_k_in_image_order(model: nn.Module, setting: dict,
                                                                         keep: int) -> None:
    # {}: the default, the paper's 75 % row (ratio 0.75): 16 of 64 patches.
    check_fastervlm(model, setting, keep)


@pytest.fixture(scope="module")
def qwen() -> nn.Module:
    return ficoco.build_model("qwen2-vl-tiny", dtype="fp32")


@pytest.mark.parametrize("keep", [4, 10])
def test_fastervlm_on_qwen2_vl_keeps_the_merge_groups_of_highest_equivalent_token_score(qwen: nn.Module,
                                                                                        keep: int) -> None:
    inputs = qwen2_vl.synthetic_inputs(qwen, batch=2, text_tokens=12, seed=SEED)
    tower = unpatched_qwen_tower(qwen, inputs)
    kept_patches, tokens = [], []
    for image, (keys, (_, cols)) in enumerate(zip(tower.keys, tower.grids, strict=True)):
        scores = equivalent_token_group_scores(keys)
        assert_decided(scores[None], keep)
        groups = sorted(torch.topk(scores, keep).indices.tolist())
        kept_patches.append(group_patch_indices(groups, cols))
        tokens.append(tower.image_groups(image, tower.merger_output)[groups])
    run = qwen_patched_run(qwen, inputs, "fastervlm", keep=keep)
    (record,) = run.records
    assert record.kept.tolist() == kept_patches
    torch.testing.assert_close(run.llm_visual, torch.cat(tokens), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("broken", ["column_off_by_one", "lowest_scores"])
def test_fastervlm_rule_check_catches_a_broken_score_or_pick(model: nn.Module, monkeypatch: pytest.MonkeyPatch,
                                                             broken: str) -> None:
    if broken == "column_off_by_one":
        real = fastervlm_ops.patch_scores_from_cls
        monkeypatch.setattr(fastervlm_ops, "patch_scores_from_cls",
                            lambda inputs, reduce_heads="mean", scores="model": torch.roll(
                                real(inputs, reduce_heads, scores), 1, dims=1))
    else:
        real_top = fastervlm_ops.top_indices
        monkeypatch.setattr(fastervlm_ops, "top_indices", lambda scores, k: real_top(-scores, k))
    with pytest.raises(AssertionError):
        check_fastervlm(model, {"keep": 16}, 16)
