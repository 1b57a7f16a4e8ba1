"""The methods that act before the LLM: ToMe, VisionZip, FasterVLM and PruMerge+.

Each batched tensor function is checked against a small independent re-implementation written
from the official code (docs/methods/<name>.md; per sample, Python loops and sets, the official
code's order of operations),
on random tensors; a batch must equal its items run alone; a full keep must be the identity;
and the token counts must equal the accountant's plan for the literature's rows.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
import torch

from ficoco import accounting as acc
from ficoco.errors import FicocoError
from ficoco.methods.fastervlm.ops import fastervlm_reduce, fastervlm_scores
from ficoco.methods.inputs import TowerInput
from ficoco.methods.ops import cls_attention, equivalent_token_scores, merge_group_scores
from ficoco.methods.prumerge.ops import prumerge_cls_attention, prumerge_reduce
from ficoco.methods.prumerge.ops import tower_step as prumerge_tower_step
from ficoco.methods.tome import tome_rates
from ficoco.methods.tome.ops import proportional_attention_bias, tome_merge
from ficoco.methods.tome.ops import tower_step as tome_tower_step
from ficoco.methods.visionzip import VISIONZIP_SPLITS
from ficoco.methods.visionzip.ops import tower_step as visionzip_tower_step
from ficoco.methods.visionzip.ops import visionzip_reduce, visionzip_scores
from ficoco.profiles import load_profile

PATCHES, DIM, HEADS, HEAD_DIM = 24, 6, 2, 4


def _items(batch: int = 3, patches: int = PATCHES, seed: int = 0):
    """Random tower items: hidden (B, 1 + N, D) with [CLS] first, keys (B, H, 1 + N, d), q of [CLS]."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(batch, patches + 1, DIM, generator=gen, dtype=torch.float64)
    keys = torch.randn(batch, HEADS, patches + 1, HEAD_DIM, generator=gen, dtype=torch.float64)
    query = torch.randn(batch, HEADS, HEAD_DIM, generator=gen, dtype=torch.float64)
    return hidden, keys, query


def _arch(name: str = "llava-1.5-7b", **kw):
    return acc.architecture(load_profile(name), **kw)


# ---- ToMe --------------------------------------------------------------------------------------------------------

def _reference_tome(x: torch.Tensor, metric: torch.Tensor, size: list[float], r: int):
    """ToMe's bipartite_soft_matching + merge_wavg for one sample, by loops (official order)."""
    tokens = x.shape[0]
    a_idx, b_idx = list(range(0, tokens, 2)), list(range(1, tokens, 2))
    unit = [metric[i] / metric[i].norm() for i in range(tokens)]
    best = []
    for ai in a_idx:
        scores = [float(unit[ai] @ unit[bi]) for bi in b_idx]
        value = -math.inf if ai == 0 else max(scores)
        best.append((value, scores.index(max(scores))))
    edges = sorted(range(len(a_idx)), key=lambda i: (-best[i][0], i))
    src, unmerged = edges[:r], sorted(edges[r:])
    b_rows = [x[bi] * size[bi] for bi in b_idx]
    b_size = [size[bi] for bi in b_idx]
    for i in src:
        j = best[i][1]
        b_rows[j] = b_rows[j] + x[a_idx[i]] * size[a_idx[i]]
        b_size[j] += size[a_idx[i]]
    rows = [x[a_idx[i]] for i in unmerged] + [b_rows[j] / b_size[j] for j in range(len(b_idx))]
    sizes = [size[a_idx[i]] for i in unmerged] + b_size
    origin = [a_idx[i] for i in unmerged] + b_idx
    return torch.stack(rows), sizes, origin


@pytest.mark.parametrize("order", ["official", "spatial"])
def test_tome_matches_the_reference_over_three_layers(order):
    hidden, _, _ = _items(seed=1)
    gen = torch.Generator().manual_seed(2)
    out_hidden, size, positions = hidden, None, None
    ref = [(hidden[b], [1.0] * hidden.shape[1], list(range(hidden.shape[1]))) for b in range(hidden.shape[0])]
    for r in (6, 5, 4):
        metric = torch.randn(*out_hidden.shape[:2], HEAD_DIM, generator=gen, dtype=torch.float64)
        merged = tome_merge(out_hidden, metric, r, size, positions, order=order)
        for b, (x, s, origin) in enumerate(ref):
            # The reference runs on the same token order the function holds.
            rows, sizes, picked = _reference_tome(x, metric[b], s, r)
            origin = [origin[i] for i in picked]
            if order == "spatial":
                perm = sorted(range(len(picked)), key=lambda i: picked[i])
                rows, sizes, origin = rows[perm], [sizes[i] for i in perm], [origin[i] for i in perm]
            ref[b] = (rows, sizes, origin)
            assert torch.allclose(merged.hidden[b], rows, atol=1e-12)
            assert merged.size[b].tolist() == sizes
            assert merged.positions[b].tolist() == origin
        out_hidden, size, positions = merged.hidden, merged.size, merged.positions
    assert positions[:, 0].tolist() == [0, 0, 0]  # [CLS] stays first, never merged
    if order == "spatial":
        assert torch.equal(positions, torch.sort(positions, dim=1).values)


def test_tome_by_default_merges_in_the_official_order():
    hidden, _, _ = _items(seed=14)
    metric = torch.randn(*hidden.shape[:2], HEAD_DIM, dtype=torch.float64)
    default, named = tome_merge(hidden, metric, 6), tome_merge(hidden, metric, 6, order="official")
    assert torch.equal(default.positions, named.positions)
    settings = acc.method_schedule(_arch(), "tome").settings_dict()
    assert settings["order"] == "official"
    out = tome_tower_step(TowerInput(hidden=hidden, has_cls=True, remove=6, keys=metric.unsqueeze(1)), settings)
    for b in range(hidden.shape[0]):
        rows, sizes, origin = _reference_tome(hidden[b], metric[b], [1.0] * hidden.shape[1], 6)
        assert torch.allclose(out.hidden[b], rows, atol=1e-12) and out.positions[b].tolist() == origin
    assert not torch.equal(out.positions, torch.sort(out.positions, dim=1).values)  # the official order shuffles
    spatial = tome_tower_step(TowerInput(hidden=hidden, has_cls=True, remove=6, keys=metric.unsqueeze(1)),
                              settings | {"order": "spatial"})
    assert torch.equal(spatial.positions, torch.sort(out.positions, dim=1).values)


@pytest.mark.parametrize("has_cls", [True, False])
def test_tome_official_order_in_a_tower_that_keeps_image_order_makes_the_official_merges(has_cls):
    # InternVL's and the Qwen towers' adapters keep the tokens in image order and carry ToMe's own sequence: over
    # several layers the merges, sizes and states equal the official order's, in image order.
    batch, tokens = 2, PATCHES + int(has_cls)
    gen = torch.Generator().manual_seed(15)
    hidden = torch.randn(batch, tokens, DIM, generator=gen, dtype=torch.float64)
    official = image = (hidden, None, None, None)
    for r in (6, 4, 3):
        weights = torch.randn(DIM, HEADS * HEAD_DIM, generator=gen, dtype=torch.float64)

        def step(state, image_order, weights=weights, r=r):
            x, size, positions, sequence = state
            keys = (x @ weights).view(batch, -1, HEADS, HEAD_DIM).transpose(1, 2)
            out = tome_tower_step(TowerInput(hidden=x, has_cls=has_cls, remove=r, keys=keys, size=size,
                                             positions=positions, image_order=image_order, sequence=sequence),
                                  {"order": "official"})
            return out.hidden, out.size, out.positions, out.sequence

        official, image = step(official, False), step(image, True)
        to_image = torch.sort(official[2], dim=1).indices
        assert torch.equal(torch.gather(official[2], 1, to_image), image[2])  # image order, the same tokens
        assert torch.allclose(torch.gather(official[0], 1, to_image.unsqueeze(-1).expand(-1, -1, DIM)), image[0],
                              atol=1e-12)
        assert torch.equal(torch.gather(official[1], 1, to_image), image[1])
        assert torch.equal(torch.gather(image[2], 1, image[3]), official[2])  # the carried sequence is the official


def test_tome_conserves_the_size_weighted_sum_and_r0_is_the_identity():
    hidden, _, _ = _items(seed=3)
    metric = torch.randn(*hidden.shape[:2], HEAD_DIM, dtype=torch.float64)
    same = tome_merge(hidden, metric, 0)
    assert same.hidden is hidden and torch.equal(same.size, torch.ones(hidden.shape[:2], dtype=torch.float64))
    merged = tome_merge(hidden, metric, 9)
    assert merged.hidden.shape[1] == hidden.shape[1] - 9
    assert torch.allclose((merged.hidden * merged.size.unsqueeze(-1)).sum(1), hidden.sum(1), atol=1e-12)
    assert merged.size.sum(1).tolist() == [hidden.shape[1]] * hidden.shape[0]
    with pytest.raises(FicocoError, match="at most half"):
        tome_merge(hidden, metric, PATCHES // 2 + 1)


def test_tome_batch_equals_items_alone():
    hidden, _, _ = _items(seed=4)
    metric = torch.randn(*hidden.shape[:2], HEAD_DIM, dtype=torch.float64)
    merged = tome_merge(hidden, metric, 7)
    for b in range(hidden.shape[0]):
        alone = tome_merge(hidden[b:b + 1], metric[b:b + 1], 7)
        assert torch.equal(merged.hidden[b], alone.hidden[0]) and torch.equal(merged.positions[b], alone.positions[0])


def test_proportional_attention_weighs_a_merged_token_as_its_copies():
    # Two identical keys/values merged into one of size 2: with log(size) on its logit, a query's attention
    # output is the same as over the two copies.
    gen = torch.Generator().manual_seed(5)
    keys = torch.randn(5, HEAD_DIM, generator=gen, dtype=torch.float64)
    values = torch.randn(5, HEAD_DIM, generator=gen, dtype=torch.float64)
    keys[4], values[4] = keys[3], values[3]
    query = torch.randn(1, HEAD_DIM, generator=gen, dtype=torch.float64)
    full = torch.nn.functional.scaled_dot_product_attention(query, keys, values)
    size = torch.tensor([[1.0, 1.0, 1.0, 2.0]], dtype=torch.float64)
    bias = proportional_attention_bias(size)[0, 0]
    merged = torch.nn.functional.scaled_dot_product_attention(query, keys[:4], values[:4], attn_mask=bias)
    assert torch.allclose(full, merged, atol=1e-12)


@pytest.mark.parametrize(("keep", "rates"), [(192, [17] * 16 + [16] * 7), (128, [20] * 11 + [19] * 12),
                                             (64, [23] * 6 + [22] * 17)])
def test_tome_schedules_of_the_literature_rows(keep, rates):
    assert list(tome_rates(576, 576 - keep, 23)) == rates
    arch = _arch()
    schedule = acc.resolve_schedule(arch, "tome", acc.CountOptions(), preset=keep)
    assert schedule.settings_dict()["rates"] == rates
    plan = acc.plan_tokens(arch, schedule)
    # The functions, layer by layer (tiny width, 7B token counts), leave what the plan says.
    hidden = torch.randn(1, 577, 4)
    size = positions = None
    for layer, r in enumerate(rates):
        assert plan.vision[layer][0] == hidden.shape[1]
        merged = tome_merge(hidden, torch.randn(1, hidden.shape[1], 4), r, size, positions)
        hidden, size, positions = merged.hidden, merged.size, merged.positions
        assert plan.vision[layer][1] == hidden.shape[1]
    assert hidden.shape[1] - 1 == plan.llm_visual_tokens == keep  # LLaVA drops [CLS]


def test_tome_refuses_a_keep_it_cannot_reach_and_plans_merge_groups_on_qwen2_vl():
    with pytest.raises(FicocoError, match="cannot merge"):
        tome_rates(576, 575, 3)
    # Issue 25: on Qwen2-VL ToMe merges whole 2x2 merge groups (one LLM token each).
    arch = _arch("qwen2-vl-7b")
    schedule = acc.resolve_schedule(arch, "tome", acc.CountOptions(), keep=64)
    plan = acc.plan_tokens(arch, schedule)
    assert plan.llm_visual_tokens == 64 and plan.vision[-1][1] == 64 * 4


# ---- VisionZip ---------------------------------------------------------------------------------------------------

def _reference_visionzip(x, cls_row, metric, dominant, contextual):
    """The official visionzip forward for one item (dominant counts [CLS]; contextual = target + member mean)."""
    scores = cls_row[:, 0, 1:].sum(0)
    top = sorted(sorted(range(len(scores)), key=lambda i: (-float(scores[i]), i))[:dominant - 1])
    keep = [0] + [i + 1 for i in top]
    rest = [i for i in range(x.shape[0]) if i not in keep]
    normed = [metric[i] / metric[i].norm() for i in rest]
    step = max(1, len(rest) // contextual)
    targets = list(range(0, len(rest), step))[:contextual]
    groups: dict[int, list[int]] = {t: [] for t in targets}
    for i in range(len(rest)):
        if i in targets:
            continue
        sims = [float(normed[i] @ normed[t]) for t in targets]
        groups[targets[sims.index(max(sims))]].append(i)
    contextual_rows = []
    for t in targets:
        members = [x[rest[i]] for i in groups[t]]
        mean = torch.stack(members).mean(0) if members else torch.zeros_like(x[0])
        contextual_rows.append(x[rest[t]] + mean)
    return torch.stack([x[i] for i in keep] + contextual_rows)


def test_visionzip_by_default_is_the_official_forward():
    hidden, keys, query = _items(seed=6)
    cls_row = cls_attention(query, keys)
    metric = keys.mean(1)
    out = visionzip_reduce(hidden, visionzip_scores(cls_row), metric, 7, 4)  # the defaults: the official code
    named = visionzip_reduce(hidden, visionzip_scores(cls_row), metric, 7, 4, include_cls=True,
                             contextual_mode="official")
    assert torch.equal(out.hidden, named.hidden)
    for b in range(hidden.shape[0]):
        full_row = torch.softmax(torch.einsum("hd,htd->ht", query[b], keys[b]) / math.sqrt(HEAD_DIM), -1)
        ref = _reference_visionzip(hidden[b], full_row.unsqueeze(1), metric[b], 7, 4)
        assert torch.allclose(out.hidden[b], ref, atol=1e-12)
        assert torch.equal(out.hidden[b, 0], hidden[b, 0])  # [CLS] first among the dominant tokens


def test_visionzip_tower_step_by_default_is_the_official_forward_where_the_projector_takes_cls():
    # What a LLaVA adapter hands the cut: the patches ([CLS] dropped by the feature selection), the layer's keys
    # and [CLS] query, and [CLS]'s state at that layer. Official: [CLS] + 6 patches, contextual = target + mean.
    hidden, keys, query = _items(seed=16)
    metric = keys.mean(1)
    settings = acc.method_schedule(_arch(), "visionzip", 11).settings_dict() | {"dominant": 7, "contextual": 4}
    assert settings["include_cls"] is True and settings["contextual_mode"] == "official"
    inputs = TowerInput(hidden=hidden[:, 1:], has_cls=True, remove=PATCHES - 7, added=4, keys=keys, cls_query=query,
                        cls_hidden=hidden[:, :1])
    out = visionzip_tower_step(inputs, settings)
    for b in range(hidden.shape[0]):
        full_row = torch.softmax(torch.einsum("hd,htd->ht", query[b], keys[b]) / math.sqrt(HEAD_DIM), -1)
        assert torch.allclose(out.hidden[b], _reference_visionzip(hidden[b], full_row.unsqueeze(1), metric[b], 7, 4),
                              atol=1e-12)
    assert (out.kept[:, 0] == -1).all() and (out.kept[:, 1:7] >= 0).all() and (out.kept[:, 7:] == -1).all()
    # ficoco's corrections, named: dominant patches only, and the mean of a target and its members.
    fixed = visionzip_tower_step(inputs, settings | {"include_cls": False, "contextual_mode": "mean"})
    scores = visionzip_scores(cls_attention(query, keys))
    assert torch.equal(fixed.hidden, visionzip_reduce(hidden, scores, metric, 7, 4, include_cls=False,
                                                      contextual_mode="mean").hidden)
    # Where the projector cannot take [CLS] (no cls_hidden: InternVL's groups, Video-LLaVA, towers without one) the
    # dominant tokens are patches, whatever include_cls says.
    without = visionzip_tower_step(replace(inputs, cls_hidden=None), settings)
    assert torch.equal(without.hidden, visionzip_reduce(hidden, scores, metric, 7, 4, include_cls=False).hidden)


def test_visionzip_corrections_average_the_contextual_token_and_keep_patches_only():
    hidden, keys, query = _items(seed=7)
    scores = visionzip_scores(cls_attention(query, keys))
    metric = keys.mean(1)
    fixed = visionzip_reduce(hidden, scores, metric, 7, 4, include_cls=False, contextual_mode="mean")
    official = visionzip_reduce(hidden, scores, metric, 7, 4)
    assert fixed.hidden.shape[1] == official.hidden.shape[1] == 11  # the same count reaches the LLM
    assert torch.equal(fixed.hidden[:, :7], hidden[:, 1:][torch.arange(3).unsqueeze(1), fixed.dominant_index])
    assert torch.equal(official.hidden[:, 0], hidden[:, 0]) and official.dominant_index.shape[1] == 6
    # The fixed contextual token is a convex mix of the target and its members: its norm stays a token's.
    assert fixed.hidden[:, 7:].norm(dim=-1).max() < official.hidden[:, 7:].norm(dim=-1).max()
    mean_only = visionzip_reduce(hidden, scores, metric, 7, 4, contextual_mode="mean")
    assert torch.equal(mean_only.hidden[:, :7], official.hidden[:, :7])  # [CLS] and the same dominant patches
    assert not torch.allclose(mean_only.hidden[:, 7:], official.hidden[:, 7:])


def test_visionzip_full_keep_is_the_identity_and_batch_equals_items_alone():
    hidden, keys, query = _items(seed=8)
    scores = visionzip_scores(cls_attention(query, keys))
    metric = keys.mean(1)
    assert torch.equal(visionzip_reduce(hidden, scores, metric, PATCHES, 0, include_cls=False).hidden, hidden[:, 1:])
    out = visionzip_reduce(hidden, scores, metric, 9, 5)
    for b in range(3):
        alone = visionzip_reduce(hidden[b:b + 1], scores[b:b + 1], metric[b:b + 1], 9, 5)
        assert torch.equal(out.hidden[b], alone.hidden[0])


@pytest.mark.parametrize("keep", [192, 128, 64])
def test_visionzip_splits_and_counts_equal_the_plan(keep):
    dominant, contextual = VISIONZIP_SPLITS[keep]
    arch = _arch()
    schedule = acc.resolve_schedule(arch, "visionzip", acc.CountOptions(), preset=keep)
    assert (schedule.settings_dict()["dominant"], schedule.settings_dict()["contextual"]) == (dominant, contextual)
    hidden = torch.randn(1, 577, 4)
    out = visionzip_reduce(hidden, torch.rand(1, 576), torch.randn(1, 577, 4), dominant, contextual)
    plan = acc.plan_tokens(arch, schedule)
    assert out.hidden.shape[1] == plan.llm_visual_tokens == plan.projector_tokens == keep
    assert plan.vision == acc.plan_tokens(arch, acc.Schedule("vanilla")).vision  # the tower runs whole


@pytest.mark.parametrize(("profile", "settings", "cut"), [
    ("llava-tiny", {}, True),  # [CLS] among the dominant tokens: 53 patches stay, 11 remain for 10 targets
    ("llava-tiny", {"include_cls": False}, False),  # ficoco's correction: 10 remain for 10 targets, nothing merges
    ("qwen2-vl-tiny", {}, False),  # a tower without [CLS]: the dominant tokens are groups, nothing merges
    ("video-llava-tiny", {}, False),  # its [CLS] reaches the LLM anyway: never a dominant token
])
def test_visionzip_at_dominant_plus_contextual_equal_the_patches_cuts_only_with_cls_among_the_dominant(
        profile, settings, cut):
    """The official code counts [CLS] among the dominant tokens, so when dominant + contextual equal an item's patches
    one patch is still left to merge into the contextual tokens: the cut runs (and its contextual similarities count
    one row: that patch against every target); without [CLS] there nothing is left to merge: no cut, no cost."""
    arch = _arch(profile)
    units = arch.vision.units
    dominant, contextual = units - round(units * 5 / 32), round(units * 5 / 32)
    opts = acc.CountOptions()
    hp = {"dominant": dominant, "contextual": contextual, **settings}
    schedule = acc.resolve_schedule(arch, "visionzip", opts, hyperparameters=hp)
    row = acc.account(arch, schedule, acc.make_quant("fp16", None), opts)
    assert row.plan.llm_visual_tokens == arch.visual_tokens  # the count is the same either way
    if cut:
        head_dim = arch.vision.hidden // arch.vision.heads
        assert [(r.where, r.remove, r.added) for r in schedule.removals] == [("tower_output", contextual, contextual)]
        similarity = [t for _, term, t in row.method_terms if term == "visionzip_vision_contextual_similarity"]
        assert similarity == [pytest.approx(2 * 1 * contextual * head_dim * arch.vision.items / 1e12)]
    else:
        assert schedule.removals == () and row.method_terms == ()


# ---- FasterVLM ---------------------------------------------------------------------------------------------------

def test_fastervlm_matches_a_boolean_mask_of_the_head_mean_topk():
    hidden, keys, query = _items(seed=9)
    row = cls_attention(query, keys)
    features = torch.randn(3, PATCHES, 5, dtype=torch.float64)
    kept_features, kept = fastervlm_reduce(features, fastervlm_scores(row), 10)
    for b in range(3):
        attn = torch.softmax(torch.einsum("hd,htd->ht", query[b], keys[b]) / math.sqrt(HEAD_DIM), -1)
        mean = attn[:, 1:].mean(0).tolist()
        top = set(sorted(range(PATCHES), key=lambda i: (-mean[i], i))[:10])
        mask = torch.tensor([i in top for i in range(PATCHES)])
        assert torch.equal(kept_features[b], features[b][mask])  # image order, as image_feature[index_mask]
        alone, _ = fastervlm_reduce(features[b:b + 1], fastervlm_scores(row[b:b + 1]), 10)
        assert torch.equal(alone[0], kept_features[b])
    assert torch.equal(fastervlm_reduce(features, fastervlm_scores(row), PATCHES)[0], features)


def test_fastervlm_projects_every_patch_and_the_llm_sees_the_kept():
    arch = _arch()
    for keep in (192, 128, 64):
        plan = acc.plan_tokens(arch, acc.resolve_schedule(arch, "fastervlm", acc.CountOptions(), preset=keep))
        assert (plan.projector_tokens, plan.llm_visual_tokens) == (576, keep)
    default = acc.resolve_schedule(arch, "fastervlm", acc.CountOptions())
    assert default.settings_dict() == {"keep": 144}  # the paper's 75 % row


# ---- PruMerge+ ---------------------------------------------------------------------------------------------------

def _reference_prumerge(x, q, k, tokens_all, neighbours):
    """The official token_prune_merge_advanced_plus for one item (single head), with the named fixes:
    arange(0, N) and a step of at least 1. `tokens_all` (1 + N, C) keys with [CLS] first."""
    n, channels = x.shape
    attn = torch.softmax(q @ tokens_all.T / math.sqrt(channels), -1)[1:]
    a = attn.numpy()
    q1, q3 = np.percentile(a, 25), np.percentile(a, 75)
    outliers = max(1, int((a > q3 + 1.5 * (q3 - q1)).sum()))
    ratio = outliers / n
    idx = sorted(range(n), key=lambda i: (-a[i], i))[:int(n * ratio)]
    step = max(1, int(int(1 / ratio) / 3))
    idx += [p for p in range(0, n, step) if p not in idx]
    keys = tokens_all[1:] / tokens_all[1:].norm(dim=-1, keepdim=True)
    rows = []
    for i in idx:
        others = [j for j in range(n) if j != i]
        sims = [float(keys[i] @ keys[j]) for j in others]
        near = [others[m] for m in sorted(range(len(others)), key=lambda m: (-sims[m], m))[:neighbours]]
        rows.append(x[i] + sum((attn[j] * x[j] for j in near), torch.zeros(channels, dtype=x.dtype)))
    rest = [j for j in range(n) if j not in idx]
    rows.append(sum((attn[j] * x[j] for j in rest), torch.zeros(channels, dtype=x.dtype)))
    return torch.stack(rows), idx


def _peaked_items(batch: int = 3, patches: int = 40, seed: int = 10):
    """Keys with a few strongly attended patches, so the IQR finds outliers as on real images."""
    gen = torch.Generator().manual_seed(seed)
    width = 8
    keys = torch.randn(batch, patches + 1, width, generator=gen, dtype=torch.float64)
    query = torch.randn(batch, width, generator=gen, dtype=torch.float64)
    for b in range(batch):
        for p in torch.randperm(patches, generator=gen)[:2 + b]:
            keys[b, 1 + p] += 3 * query[b] / query[b].norm()
    hidden = torch.randn(batch, patches, width, generator=gen, dtype=torch.float64)
    return hidden, query, keys


def test_prumerge_by_default_is_the_official_forward_per_item():
    hidden, query, keys = _peaked_items()
    cls_attn = prumerge_cls_attention(query, keys, 2)  # the defaults: the official single head, score order
    assert torch.equal(cls_attn, prumerge_cls_attention(query, keys, 2, attention="official"))
    out = prumerge_reduce(hidden, cls_attn, keys[:, 1:], neighbours=5)
    for b in range(3):
        ref, idx = _reference_prumerge(hidden[b], query[b], keys[b], keys[b], 5)
        count = int(out.counts[b])
        assert count == len(idx) + 1
        assert out.kept[b, :count - 1].tolist() == idx
        assert torch.allclose(out.hidden[b, :count], ref, atol=1e-12)
        assert not out.hidden[b, count:].any()  # padding after an item with fewer tokens


def test_prumerge_tower_step_by_default_reads_the_official_single_head_attention():
    # What the adapters hand the cut: the last layer's keys and [CLS] query, heads split (q . k of the raw
    # projections). Official: one head as wide as the layer, scaled by 1 / sqrt(width), kept patches by score.
    hidden, query, keys = _peaked_items(seed=13)
    heads = 2
    items, tokens, width = keys.shape
    split_keys = keys.reshape(items, tokens, heads, width // heads).transpose(1, 2)
    inputs = TowerInput(hidden=hidden, has_cls=True, remove=0, keys=split_keys,
                        cls_query=query.reshape(items, heads, width // heads))
    settings = acc.method_schedule(_arch(), "prumerge").settings_dict() | {"neighbours": 5}
    assert settings["attention"] == "official" and settings["order"] == "official"
    out = prumerge_tower_step(inputs, settings)
    for b in range(items):
        ref, idx = _reference_prumerge(hidden[b], query[b], keys[b], keys[b], 5)
        count = int(out.counts[b])
        assert out.kept[b, :count - 1].tolist() == idx
        assert torch.allclose(out.hidden[b, :count], ref, atol=1e-12)
    # ficoco's corrections, named: the layer's own heads (their mean), image order.
    fixed = prumerge_tower_step(inputs, settings | {"attention": "heads", "order": "spatial"})
    heads_attn = prumerge_cls_attention(query, keys, heads, attention="heads")
    assert not torch.allclose(heads_attn, prumerge_cls_attention(query, keys, heads))
    expected = prumerge_reduce(hidden, heads_attn, keys[:, 1:], neighbours=5, order="spatial")
    assert torch.equal(fixed.hidden, expected.hidden) and torch.equal(fixed.counts, expected.counts)


def test_prumerge_batch_equals_items_alone_with_their_own_counts():
    hidden, query, keys = _peaked_items(seed=11)
    cls_attn = prumerge_cls_attention(query, keys, 2)
    for order in ("official", "spatial"):
        out = prumerge_reduce(hidden, cls_attn, keys[:, 1:], neighbours=4, order=order)
        assert len(set(out.counts.tolist())) > 1, "the items should keep different adaptive counts"
        for b in range(3):
            alone = prumerge_reduce(hidden[b:b + 1], cls_attn[b:b + 1], keys[b:b + 1, 1:], neighbours=4, order=order)
            count = int(alone.counts[0])
            assert int(out.counts[b]) == count
            assert torch.equal(out.hidden[b, :count], alone.hidden[0])
            if order == "spatial":  # ficoco's image order
                assert torch.equal(out.kept[b, :count - 1], torch.sort(out.kept[b, :count - 1]).values)


def test_prumerge_full_keep_without_neighbours_is_the_identity_plus_a_zero_token():
    hidden, query, keys = _peaked_items(seed=12)
    cls_attn = prumerge_cls_attention(query, keys, 2)
    out = prumerge_reduce(hidden, cls_attn, keys[:, 1:], tokens=hidden.shape[1] + 1, neighbours=0, order="spatial")
    assert torch.equal(out.hidden[:, :-1], hidden)
    assert not out.hidden[:, -1].any()


@pytest.mark.parametrize("keep", [192, 128, 64])
def test_prumerge_fixed_count_equals_the_plan(keep):
    arch = _arch()
    schedule = acc.resolve_schedule(arch, "prumerge", acc.CountOptions(), preset=keep)
    gen = torch.Generator().manual_seed(keep)
    keys = torch.randn(2, 577, 8, generator=gen)
    cls_attn = prumerge_cls_attention(torch.randn(2, 8, generator=gen), keys, 2)
    out = prumerge_reduce(torch.randn(2, 576, 8, generator=gen), cls_attn, keys[:, 1:], tokens=keep)
    assert out.hidden.shape[1] == acc.plan_tokens(arch, schedule).llm_visual_tokens == keep
    assert out.counts.tolist() == [keep, keep]


def test_prumerge_adaptive_plan_is_labelled_as_assumed():
    arch = _arch()
    schedule = acc.resolve_schedule(arch, "prumerge", acc.CountOptions())
    assert schedule.settings_dict()["adaptive"] is True
    assert acc.plan_tokens(arch, schedule).llm_visual_tokens == 144
    with pytest.raises(FicocoError, match="PruMerge\\+ is defined on llava"):
        acc.resolve_schedule(_arch("qwen2-vl-7b"), "prumerge", acc.CountOptions(), keep=64)


# ---- towers without [CLS], AnyRes, frames ------------------------------------------------------------------------

def test_equivalent_token_stands_in_for_cls_on_qwen2_vl_and_is_labelled():
    arch = _arch("qwen2-vl-7b")
    for name in ("visionzip", "fastervlm"):
        schedule = acc.resolve_schedule(arch, name, acc.CountOptions(), preset=128)
        assert schedule.settings_dict()["score"] == "equivalent token (no [CLS])"
        assert acc.plan_tokens(arch, schedule).llm_visual_tokens == 128
    keys = torch.randn(2, HEADS, 16, HEAD_DIM)
    scores = merge_group_scores(equivalent_token_scores(keys), 4)
    assert scores.shape == (2, 4)
    mean_keys = keys.mean(1)
    expected = -torch.nn.functional.cosine_similarity(mean_keys.mean(1, keepdim=True), mean_keys, dim=-1)
    assert torch.allclose(scores, expected.reshape(2, 4, 4).mean(-1))


def test_vision_methods_count_per_crop_and_per_frame():
    next_arch = _arch("llava-next-7b")
    for name in ("tome", "visionzip", "fastervlm", "prumerge"):
        plan = acc.plan_tokens(next_arch, acc.resolve_schedule(next_arch, name, acc.CountOptions(), preset=64))
        assert plan.llm_visual_tokens == next_arch.vision.items * 64 + next_arch.newline_tokens
    video = _arch("video-llava-7b")
    plan = acc.plan_tokens(video, acc.resolve_schedule(video, "visionzip", acc.CountOptions(), preset=64))
    assert plan.llm_visual_tokens == video.vision.items * (64 + 1)  # each frame's [CLS] reaches the LLM too


def test_anyres_unpadding_is_refused_for_cuts_before_the_llm():
    arch = _arch("llava-next-7b", image_size=(500, 700))
    assert arch.unpadding_drops
    with pytest.raises(FicocoError, match="unpadding drops"):
        acc.resolve_schedule(arch, "visionzip", acc.CountOptions(), preset=64)


def test_method_terms_are_counted_per_item():
    arch = _arch()
    opts = acc.CountOptions()
    quant = acc.make_quant("fp16", None)
    single = acc.account(arch, acc.resolve_schedule(arch, "tome", opts, preset=128), quant, opts)
    double = acc.account(arch, acc.resolve_schedule(arch, "tome", opts, preset=128), quant,
                         acc.CountOptions(batch=2))
    assert single.method_tflops > 0 and double.method_tflops == pytest.approx(2 * single.method_tflops)
    layer0 = [t for layer, term, t in single.method_terms if layer == 0]
    assert layer0 == [pytest.approx(2 * 289 * 288 * 64 / 1e12)]  # A x B cosine scores, 64-wide head-mean keys


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("has_cls", [True, False])
@pytest.mark.parametrize("order", ["official", "spatial"])
def test_tome_merge_at_its_receivers_is_the_dense_merge_bit_for_bit(dtype: torch.dtype, has_cls: bool,
                                                                     order: str) -> None:
    # On a CPU, half-precision tokens are merged only at the B tokens that receive a source; every other
    # token's x * s / s rounds back to x, so the two forms agree exactly, sizes and positions included.
    import ficoco.methods.ops as method_ops

    generator = torch.Generator().manual_seed(11)
    hidden = torch.randn(3, 41, 24, generator=generator).to(dtype)
    metric = torch.randn(3, 41, 8, generator=generator)
    size = torch.randint(1, 40, (3, 41), generator=generator).float()
    positions = torch.randint(0, 500, (3, 41), generator=generator)
    sparse = tome_merge(hidden, metric, 13, size=size, positions=positions, has_cls=has_cls, order=order)
    try:
        method_ops.SPARSE_MERGES_ON_CPU = False
        dense = tome_merge(hidden, metric, 13, size=size, positions=positions, has_cls=has_cls, order=order)
    finally:
        method_ops.SPARSE_MERGES_ON_CPU = True
    assert torch.equal(sparse.hidden, dense.hidden)
    assert torch.equal(sparse.size, dense.size)
    assert torch.equal(sparse.positions, dense.positions)
