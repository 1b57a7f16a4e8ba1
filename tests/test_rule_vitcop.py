"""ViTCoP's official rule, re-stated here and checked against ficoco on llava-tiny (issue 53).

Official code: chaser682/ViTCoP at 627f632 (LLaVA/llava/model/...):

- **the cut** (multimodal_encoder/clip_encoder.py L187-244): a forward hook on ``layers[-2].self_attn.k_proj``
  (L194, L200-204: the layer's k_proj output, heads not split, bias included), the tower run with
  ``output_attentions=True`` (L195); ``attentions[-2][:, :, 0, 1:].sum(dim=1)`` (L208-209), ``topk(int(
  VISION_PRUNE_RARIO x 576))`` applied through a mask (L217-222: image order), ``hidden_states[-2][:, 1:]`` and
  the metric's patches taken at the kept places, and their positions ``(row, col) / 24`` (`get_pos` L170-185).
- **VIC** (multimodal_encoder/utils.py L56-150, called with ``dc=8, k=0.6``, L233-237): Euclidean distances
  ``sqrt(sum (x_i - x_j)^2 + 1e-8)``, clamped at 0, diagonal 0 (L73-76, L163-170); ``rho = exp(-(d / dc)^2).sum(1)``
  (L81); ``delta, parent = min(where(rho_j >= rho_i, j != i and |pos_i - pos_j| <= k, d, inf))`` (L85-101);
  ``gamma = delta x rho``, the ``max(1, int(CLUSTER_PERCENTAGE x n))`` highest are centres labelled 0.. in that
  order (L110-124); every unlabelled token takes its parent's label until nothing changes (L131-147).
- **the shallow stage** (language_model/vitcop_modeling_llama.py L1191-1354) at ``SHALLOW_PRUNED_LAYER``: the
  layer before's cached keys (L1409-1410), ``k.mean(dim=1).norm(p=2, dim=-1)`` over the visual span (L1307),
  ``token_filter_l2_norm_cluster`` (L1191-1288): ``torch.unique`` labels, per-cluster norm sums and sizes; K > R:
  the R - 1 smallest sums each one token, the rest one token; else quotas ``round((size - 1) / (N - K) x (R -
  K))`` capped at size - 1, one +-1 pass in sum order, each cluster's ``quota`` smallest norms kept, the rest
  merged; a merged token ``h[median] + h[group].mean()`` (L1328) at the upper median member, all sorted by
  position (L1344-1349), ``position_ids = [before, sorted_mid, after]`` (L1354).
- **the deep stage** (L1361-1383) at ``DEEP_PRUNED_LAYER``: the layer before's cached keys (L1412-1413), the
  ``round(R / 5)`` smallest norms among the next R tokens, ``position_ids = all_keep`` (the rows' indices).

The cut and VIC are computed on the unpatched tower (eager attention); the two decoder stages on what the patched
layers really received (hooks), the keys recomputed from the layer before's own weights on what it ran on, with
the rotary tables it was called with. The 4-layer tiny decoder places the stages at layers 2 and 3 (the official
22 lies beyond it: ``shallow_layer``/``deep_layer``), the counts by the official formula with its 4 layers in
place of 32; positions normalise by the tiny's 8 x 8 grid, as 24 is LLaVA-1.5's. The inputs decide every
comparison the rule makes (no near-tie: checked). ficoco's correction ``deep_span="real"`` only acts where the
official code reads text as visual tokens (docs/methods/vitcop.md): none of these settings reach it.
"""

from __future__ import annotations

import math

import pytest
import torch
from rule_support import decoder, fails_when, own_query_key, rotary, watch_layers
from rule_support_vision import feature_layer, unpatched_tower
from torch import Tensor, nn

import ficoco
import ficoco.methods.vitcop.ops as vitcop_ops
from ficoco.models import synthetic_inputs

TINY_PROFILE = "llava-tiny"  # built as this module's `model` (conftest.py): 8 x 8 patches, [CLS] first
START, TEXT, SIDE = 5, 12, 8
SHALLOW, DEEP = 2, 3
DC, RADIUS = 8.0, 0.6
# (keep or None, hyperparameters, seed): two --keep rows (every cluster keeps some tokens), and the official knobs
# given directly with many centres (more clusters than the shallow stage's tokens: the K > R branch).
SETTINGS = [(16, {}, 0), (20, {}, 1), (None, {"ratio": 0.3, "vision_ratio": 0.5, "cluster_share": 0.5}, 2)]


def decided(values: Tensor, gap: float = 1e-5) -> None:
    """No two of `values` (1-D) are closer than `gap`, far above the rounding between the official quantities and
    ficoco's own: the comparisons the rule makes on them are decided (RuntimeError, not AssertionError: a break
    test cannot pass on unfit inputs)."""
    ranked = values.sort().values
    if ranked.numel() > 1 and float((ranked[1:] - ranked[:-1]).min()) <= gap:
        raise RuntimeError("near-tie in the rule's comparisons: pick another seed")


def official_cut(model: nn.Module, pixels: Tensor, vision_ratio: float) -> tuple[list[int], Tensor, Tensor, Tensor]:
    """(kept patches, their hidden states, k_proj outputs and positions) of the one image."""
    layer = feature_layer(model)
    tower = unpatched_tower(model, pixels)
    hidden = tower.hidden_states[layer + 1][0, 1:]  # hidden_states[-2]: the layer's output
    metric = tower.keys[layer][0, 1:]
    scores = tower.attentions[layer][0, :, 0, 1:].sum(dim=0)
    keep = int(vision_ratio * scores.numel())
    ranked = scores.sort(descending=True).values
    if keep < scores.numel() and float(ranked[keep - 1] - ranked[keep]) <= 1e-7:
        raise RuntimeError("near-tie in the [CLS] scores: pick another seed")
    kept = sorted(scores.topk(keep).indices.tolist())
    pos = torch.tensor([[p // SIDE, p % SIDE] for p in kept], dtype=torch.float) / SIDE
    return kept, hidden[kept], metric[kept], pos


def official_vic(x: Tensor, pos: Tensor, percentage: float) -> list[int]:
    """VIC's labels of `x` ``(n, C)`` at `pos` ``(n, 2)``, as utils.py computes them."""
    n = x.shape[0]
    dist = torch.sqrt(((x.unsqueeze(1) - x.unsqueeze(0)) ** 2).sum(dim=2) + 1e-8).clamp(min=0.0)
    dist.fill_diagonal_(0)
    rho = torch.exp(-(dist / DC) ** 2).sum(dim=1)
    higher = ~torch.gt(rho.unsqueeze(1).expand(n, n), rho.unsqueeze(1).expand(n, n).t())
    higher.fill_diagonal_(False)
    spatial = torch.sqrt(((pos.unsqueeze(1) - pos.unsqueeze(0)) ** 2).sum(dim=2) + 1e-8).clamp(min=0.0)
    # The densities the rule compares (spatial neighbours) are decided.
    compared = (spatial <= RADIUS) & ~torch.eye(n, dtype=torch.bool)
    if bool(((rho.unsqueeze(1) - rho.unsqueeze(0)).abs()[compared] <= 2e-5).any()):
        raise RuntimeError("near-tie between neighbours' densities: pick another seed")
    conditioned = torch.where(higher & (spatial <= RADIUS), dist, torch.full_like(dist, float("inf")))
    delta, parent = torch.min(conditioned, dim=1)
    for row in conditioned:  # every parent is decided: the nearest candidate is apart from the next
        candidates = row[torch.isfinite(row)].sort().values
        if candidates.numel() > 1 and float(candidates[1] - candidates[0]) <= 1e-5:
            raise RuntimeError("near-tie among a token's parents: pick another seed")
    gamma = delta * rho
    centres = max(1, int(percentage * n))
    infinite = int((~torch.isfinite(gamma)).sum())
    if infinite > centres:  # the official argsort orders equal (infinite) gammas at random
        raise RuntimeError("more tokens without a denser neighbour than centres: pick another seed")
    if infinite < centres < n:
        decided(gamma[torch.isfinite(gamma)], 1e-4)
    order = torch.argsort(-gamma)
    labels = torch.full((n,), -1, dtype=torch.long)
    labels[order[:centres]] = torch.arange(centres)
    while True:
        update = (labels == -1) & (labels[parent] != -1)
        if not update.any():
            break
        labels[update] = labels[parent[update]]
    return labels.tolist()


def official_shallow(labels: Tensor, norms: Tensor, keep: int) -> tuple[list[int], list[list[int]], list[int]]:
    """`token_filter_l2_norm_cluster`: (kept span indices, merged groups, their medians)."""
    clusters = torch.unique(labels)
    count, k = labels.numel(), clusters.numel()
    sums = torch.stack([norms[labels == c].sum() for c in clusters])
    sizes = torch.tensor([int((labels == c).sum()) for c in clusters])
    selected: list[int] = []
    groups: list[list[int]] = []
    if k > keep:
        decided(sums)
        retained = clusters[torch.topk(sums, keep - 1, largest=False).indices].tolist()
        for c in retained:
            groups.append((labels == c).nonzero().squeeze(1).tolist())
        rest = [i for i in range(count) if int(labels[i]) not in retained]
        if rest:
            groups.append(rest)
    else:
        weights = (sizes.float() - 1) / (count - k)
        quotas = torch.minimum((weights * (keep - k)).round().long(), (sizes - 1).clamp(min=0))
        diff = (keep - k) - int(quotas.sum())
        if diff:
            decided(sums)
            for i in torch.argsort(sums, descending=diff < 0).tolist():
                if diff > 0 and quotas[i] < sizes[i] - 1:
                    quotas[i] += 1
                    diff -= 1
                elif diff < 0 and quotas[i] > 0:
                    quotas[i] -= 1
                    diff += 1
                if diff == 0:
                    break
        for i, c in enumerate(clusters.tolist()):
            members = (labels == c).nonzero().squeeze(1)
            quota = min(int(quotas[i]), members.numel() - 1)
            if quota > 0:
                decided(norms[members])
                top = members[torch.topk(norms[members], quota, largest=False).indices].tolist()
                selected += top
                members = torch.tensor([m for m in members.tolist() if m not in top])
            groups.append(members.tolist())
    medians = [sorted(g)[len(g) // 2] for g in groups]
    return sorted(selected + medians), groups, medians


def layer_keys(model: nn.Module, seen: dict, layer: int) -> Tensor:
    """``(H, T, d)`` the post-RoPE keys decoder layer `layer` cached in the patched run (sample 0), recomputed from
    its own weights on what it ran on, with the rotary tables it was called with."""
    cos, sin = seen[layer].rotary
    _, key = own_query_key(decoder(model).layers[layer], seen[layer].ran_on, cos, sin)
    return key[0]


def check_vitcop(model: nn.Module, keep: int | None, setting: dict, seed: int) -> None:
    inputs = synthetic_inputs(model, batch=1, text_tokens=TEXT, seed=seed)
    with torch.no_grad(), ficoco.apply(model, "vitcop", keep=keep, shallow_layer=SHALLOW, deep_layer=DEEP,
                                       **setting) as handle, \
            watch_layers(model, [0, SHALLOW - 1, SHALLOW, DEEP - 1, DEEP]) as seen:
        model(**inputs)
    settings = handle.schedule.settings_dict()
    cut, after_shallow, after_deep = handle.schedule.removals
    records = {(r.stage, r.layer): r for r in handle.records}
    kept_patches, hidden, metric, pos = official_cut(model, inputs["pixel_values"], settings["vision_ratio"])
    n = len(kept_patches)
    assert cut.remove == SIDE * SIDE - n
    labels = torch.tensor(official_vic(metric, pos, settings["cluster_share"]))
    # The official counts (L1295-1296) with the tiny's 4 layers in place of 32.
    shallow = round((4 * settings["ratio"] / settings["vision_ratio"] - SHALLOW) / (DEEP - SHALLOW + (4 - DEEP) / 5)
                    * n)
    deep = round(shallow / 5)
    assert (after_shallow.remove, after_deep.remove) == (n - shallow, shallow - deep)
    # The cut: the kept patches in image order, through the projector.
    assert records["vision", feature_layer(model)].kept[0].tolist() == kept_patches
    with torch.no_grad():
        projected = model.model.multi_modal_projector(hidden)
    torch.testing.assert_close(seen[0].received[0, START:START + n], projected, rtol=1e-5, atol=1e-6)
    # The shallow stage, on the keys layer SHALLOW - 1 cached and the input layer SHALLOW received.
    norms = layer_keys(model, seen, SHALLOW - 1).mean(dim=0).norm(p=2, dim=-1)[START:START + n]
    kept, groups, medians = official_shallow(labels, norms, shallow)
    assert len(kept) == shallow and records["llm", SHALLOW].kept[0].tolist() == kept
    entering = seen[SHALLOW].received[0]
    expected = entering[START:START + n].clone()
    for group, median in zip(groups, medians, strict=True):
        expected[median] = entering[START + median] + entering[START + torch.tensor(group)].mean(dim=0)
    ran_on = seen[SHALLOW].ran_on[0]
    torch.testing.assert_close(ran_on[START:START + shallow], expected[kept], rtol=1e-5, atol=1e-5)
    assert torch.equal(ran_on[START + shallow:], entering[START + n:])
    length = entering.shape[0]
    gapped = [*range(START), *(START + i for i in kept), *range(START + n, length)]
    cos, _ = rotary(model, ran_on[None], torch.tensor([gapped]))
    assert torch.equal(seen[SHALLOW].rotary[0], cos)
    # The deep stage: the next `shallow` tokens' key norms of layer DEEP - 1, the smallest stay.
    norms = layer_keys(model, seen, DEEP - 1).mean(dim=0).norm(p=2, dim=-1)[START:START + shallow]
    decided(norms, 1e-5)
    top = sorted(torch.topk(norms, deep, largest=False).indices.tolist())
    assert records["llm", DEEP].kept[0].tolist() == [kept[i] for i in top]
    current = seen[DEEP].received.shape[1]
    all_keep = [*range(START), *(START + i for i in top), *range(START + shallow, current)]
    cos, _ = rotary(model, ran_on[None], torch.tensor([all_keep]))
    assert torch.equal(seen[DEEP].rotary[0], cos)


@pytest.mark.parametrize("keep,setting,seed", SETTINGS)
def test_vitcop_cuts_clusters_and_prunes_inside_the_decoder_as_the_official_code(
        model: nn.Module, keep: int | None, setting: dict, seed: int) -> None:
    check_vitcop(model, keep, setting, seed)


def test_the_vitcop_rule_check_fails_when_the_shallow_stage_keeps_the_largest_norms(
        model: nn.Module, monkeypatch: pytest.MonkeyPatch) -> None:
    original = vitcop_ops.cluster_merge

    def largest(visual: Tensor, labels: Tensor, norms: Tensor, keep: int) -> tuple[Tensor, Tensor]:
        return original(visual, labels, -norms, keep)

    fails_when(monkeypatch, vitcop_ops, "cluster_merge", largest, lambda: check_vitcop(model, *SETTINGS[0]))


def test_the_vitcop_rule_check_fails_when_vic_ignores_the_spatial_radius(
        model: nn.Module, monkeypatch: pytest.MonkeyPatch) -> None:
    original = vitcop_ops.vic_labels

    def unbounded(features: Tensor, positions: Tensor, share: float, cutoff: float, radius: float) -> Tensor:
        return original(features, positions, share, cutoff, math.inf)

    fails_when(monkeypatch, vitcop_ops, "vic_labels", unbounded, lambda: check_vitcop(model, *SETTINGS[2]))


def test_the_vitcop_rule_check_fails_when_a_merged_token_is_the_group_mean(
        model: nn.Module, monkeypatch: pytest.MonkeyPatch) -> None:
    original = vitcop_ops.cluster_merge

    def mean_only(visual: Tensor, labels: Tensor, norms: Tensor, keep: int) -> tuple[Tensor, Tensor]:
        kept, tokens = original(visual, labels, norms, keep)
        own = torch.gather(visual, 1, kept.unsqueeze(-1).expand(-1, -1, visual.shape[-1]))
        return kept, torch.where((tokens == own).all(dim=-1, keepdim=True), tokens, tokens - own)

    fails_when(monkeypatch, vitcop_ops, "cluster_merge", mean_only, lambda: check_vitcop(model, *SETTINGS[0]))
