"""PruMerge+'s official rule, re-stated here and checked against ficoco on llava-tiny (issue 53).

Official code: 42Shawn/LLaVA-PruMerge at 097c04116a58465e4bcb58cec44a94018a68ff1a,
llava/model/multimodal_encoder/clip_encoder.py (``forward`` L286-300 calls ``token_prune_merge_advanced_plus``,
L174-281):

- L28-32, L182-183: forward hooks keep the **last** tower layer's (``layers[23]`` of 24) ``q_proj`` and
  ``k_proj`` outputs, heads not split; L186-189: the features are ``hidden_states[select_layer][:, 1:]``
  (layer 22, the projector's input), ``C`` their width.
- L198-201: ``softmax(q @ k^T * C ** -0.5)``, one head as wide as the layer; ``cls_attn = attn[:, 0, 1:]``.
- L34-47 (``outlier_dectection``): numpy's 25th and 75th percentiles of ``cls_attn``; ``ratio`` = the share
  above ``Q3 + 1.5 * IQR``; L205: ``idx = topk(cls_attn, int(N * ratio))``, in score order.
- L208-214: ``arange(0, 575, int(int(1 / ratio) / 3))``, the samples not in ``idx``, appended after it.
- L231-276: for every kept patch, its 32 most cosine-similar other patches (kept or not) by the L2-normalised
  last-layer keys (``Key_wo_cls``), summed weighted by their ``cls_attn`` onto it, unnormalised (L274:
  ``#/ torch.sum(weights)``); L278-279: one extra token, the ``cls_attn``-weighted sum of the patches not kept.

Where ficoco departs (docs/methods/prumerge.md), the rule below says so: the official code's defects, fixed in
every run (the sampling ``arange`` ends at ``N``, not ``N - 1``; the step is at least 1; the IQR runs per item,
where the official code pools a batch, so the adaptive cases run one image per call, as the official code
does), and ficoco's fixed count (``keep=``, not an official setting: the outliers by score, then the samples,
then the next patches by score). The official settings are ficoco's defaults; the corrections ``attention=
"heads"`` and ``order="spatial"`` are checked to change what they say.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from rule_support_vision import TowerPass, assert_decided, feature_layer, patched_run, unpatched_tower
from torch import Tensor, nn

import ficoco.methods.prumerge.ops as prumerge_ops
from ficoco.models import synthetic_inputs

TINY_PROFILE = "llava-tiny"  # built as this module's `model` (conftest.py): 64 patches, [CLS] first
NEIGHBOURS = 32
GAP = 1e-7  # what decides a comparison here: rounding between eager and ficoco's SDPA tower stays below it


def cls_attention(tower: TowerPass, attention: str = "official") -> Tensor:
    """(B, N) ``cls_attn``: the official single 1024-wide head of the last layer's raw projections, or
    (``"heads"``, ficoco's correction) the layer's own per-head softmax, head mean."""
    if attention == "heads":
        return tower.attentions[-1][:, :, 0, 1:].mean(dim=1)
    q, k = tower.queries[-1], tower.keys[-1]
    width = q.shape[-1]
    return F.softmax(q @ k.transpose(-2, -1) * width ** -0.5, dim=-1)[:, 0, 1:]


def selection(cls_attn: Tensor, tokens: int | None) -> list[int]:
    """One item's kept patches in the order they are handed on: ``tokens=None`` the official adaptive count."""
    patches = cls_attn.shape[0]
    values = cls_attn.numpy().astype(np.float32)
    q1, q3 = np.percentile(values, 25), np.percentile(values, 75)
    bound = q3 + 1.5 * (q3 - q1)
    if np.abs(values - bound).min() <= GAP:
        raise RuntimeError("these inputs put a score on the IQR bound; pick another seed")
    ratio = max(1, int((values > bound).sum())) / patches  # ficoco's fix: at least one (the official divides by 0)
    assert_decided(cls_attn[None], int(patches * ratio))
    by_score = torch.topk(cls_attn, patches).indices.tolist()
    idx = by_score[:int(patches * ratio)]
    step = max(1, int(int(1 / ratio) / 3))  # ficoco's fix: at least 1 (the official arange raises on 0)
    samples = [x for x in range(0, patches, step) if x not in idx]  # official end: 575 = N - 1; ficoco's fix: N
    order = idx + samples
    if tokens is None:
        return order
    assert_decided(cls_attn[None], tokens - 1)
    return (order + [x for x in by_score if x not in order])[:tokens - 1]  # ficoco's fixed count


def official_prumerge(tower: TowerPass, layer: int, tokens: int | None, attention: str = "official",
                      order: str = "official") -> tuple[Tensor, Tensor]:
    """(the tokens handed to the projector (B, kept + 1, C), the record (B, kept + 1): the kept patches in their
    order, -1 for the extra token)."""
    x = tower.hidden_states[layer + 1][:, 1:]
    keys = F.normalize(tower.keys[-1][:, 1:], p=2, dim=-1)
    cls_attn = cls_attention(tower, attention)
    tokens_out, records = [], []
    for b in range(x.shape[0]):
        kept = selection(cls_attn[b], tokens)
        if order == "spatial":
            kept = sorted(kept)
        merged = []
        for i in kept:
            others = [j for j in range(x.shape[1]) if j != i]
            similarity = keys[b, others] @ keys[b, i]
            assert_decided(similarity[None], NEIGHBOURS)
            nearest = [others[j] for j in torch.topk(similarity, NEIGHBOURS).indices.tolist()]
            merged.append(x[b, i] + (x[b, nearest] * cls_attn[b, nearest, None]).sum(dim=0))
        rest = [j for j in range(x.shape[1]) if j not in kept]
        extra = (x[b, rest] * cls_attn[b, rest, None]).sum(dim=0)
        tokens_out.append(torch.stack([*merged, extra]))
        records.append(torch.tensor([*kept, -1]))
    return torch.stack(tokens_out), torch.stack(records)


def check_prumerge(model: nn.Module, seed: int, batch: int, setting: dict, tokens: int | None, **corrections
                   ) -> Tensor:
    """Runs ficoco, checks it against the rule (with `corrections`); returns the record's kept patches."""
    inputs = synthetic_inputs(model, batch=batch, text_tokens=12, seed=seed)
    expected, kept = official_prumerge(unpatched_tower(model, inputs["pixel_values"]), feature_layer(model),
                                       tokens, **corrections)
    run = patched_run(model, inputs, "prumerge", **setting)
    (record,) = run.records
    assert torch.equal(record.kept, kept)
    torch.testing.assert_close(run.projector_input, expected, rtol=1e-5, atol=1e-5)
    return record.kept


# Images of the tiny tower (its attention is nearly flat: 0 to 2 outliers) for the adaptive count: one the
# official code runs as it is (2 outliers, a sampling step of 10), one where the sampling reaches the last patch
# (1 outlier, step 21: patch 63 is a sample only by ficoco's fix) and one without outliers (ficoco's fix keeps
# the top one; step 21 again).
ADAPTIVE_SEEDS = {"official_as_is": 28, "last_patch_sampled": 1, "no_outlier": 4}
LAST_PATCH = 63


@pytest.mark.parametrize("case", ADAPTIVE_SEEDS)
def test_prumerge_adaptive_count_keeps_and_merges_as_the_official_code(model: nn.Module, case: str) -> None:
    # The official setting (no keep=): its own count per image, one image per call as the official code runs it.
    kept = check_prumerge(model, ADAPTIVE_SEEDS[case], 1, {}, None)
    assert (LAST_PATCH in kept.tolist()[0]) == (case != "official_as_is")


def test_prumerge_adaptive_counts_of_these_images_differ(model: nn.Module) -> None:
    counts = {len(check_prumerge(model, seed, 1, {}, None)[0]) for seed in ADAPTIVE_SEEDS.values()}
    assert len(counts) > 1, counts  # more than one budget among the adaptive cases


@pytest.mark.parametrize("tokens", [12, 24])
def test_prumerge_fixed_count_keeps_and_merges_by_the_official_priority(model: nn.Module, tokens: int) -> None:
    check_prumerge(model, 1, 2, {"keep": tokens}, tokens)


def test_prumerge_attention_over_heads_correction_scores_by_the_layers_own_heads(model: nn.Module) -> None:
    official = check_prumerge(model, 1, 2, {"keep": 12}, 12)
    heads = check_prumerge(model, 1, 2, {"keep": 12, "attention": "heads"}, 12, attention="heads")
    assert not torch.equal(heads, official)


def test_prumerge_spatial_order_correction_only_reorders_the_kept_patches(model: nn.Module) -> None:
    official = check_prumerge(model, 1, 2, {"keep": 12}, 12)
    spatial = check_prumerge(model, 1, 2, {"keep": 12, "order": "spatial"}, 12, order="spatial")
    assert not torch.equal(spatial, official) and torch.equal(spatial[:, :-1], official[:, :-1].sort(dim=1).values)


@pytest.mark.parametrize("broken", ["head_scale", "one_neighbour_short"])
def test_prumerge_rule_check_catches_a_broken_scale_or_merge(model: nn.Module, monkeypatch: pytest.MonkeyPatch,
                                                             broken: str) -> None:
    if broken == "head_scale":  # the wide head scaled as one of the layer's 4 heads
        real_rows = prumerge_ops.last_row_attention
        monkeypatch.setattr(prumerge_ops, "last_row_attention",
                            lambda q, k, mask=None, scale=None, scores="model": real_rows(
                                q, k, mask, (q.shape[-1] // 4) ** -0.5, scores))
    else:
        real_reduce = prumerge_ops.prumerge_reduce
        monkeypatch.setattr(prumerge_ops, "prumerge_reduce",
                            lambda *args, **kwargs: real_reduce(*args, **{**kwargs, "neighbours": NEIGHBOURS - 1}))
    with pytest.raises(AssertionError):
        check_prumerge(model, 1, 2, {"keep": 12}, 12)
