"""ToMe's official rule, re-stated here and checked against ficoco in llava-tiny's CLIP tower (issue 53).

Official code: facebookresearch/ToMe at af95e4b1befa172dadccd8c81e223b10090f9579.

- tome/patch/timm.py L34-56 (``ToMeBlock.forward``): in every block, between the attention residual and the
  MLP, ``r`` tokens merge by the block's own head-mean keys; L66-96 (``ToMeAttention``): the keys returned are
  ``k.mean(1)`` and, with proportional attention (``prop_attn=True``, ``apply_patch``'s default for models
  used off the shelf, L116-137), ``log(size)`` of every key is added to the logits before the softmax (L85-86).
- tome/merge.py L18-97 (``bipartite_soft_matching``): ``r`` capped at ``(t - protected) // 2`` (L43-44); the
  metric L2-normalised, ``a`` / ``b`` its even / odd places, ``scores = a @ b^T``, [CLS]'s row ``-inf``
  (L50-57); every ``a`` token's best ``b`` (L59), the ``r`` of highest score merge into it (L60-64), the
  unmerged ``a`` tokens sorted by index when there is a [CLS] (L66-68); ``merge`` returns ``[unmerged a, all
  b]`` (L70-80). L210-224 (``merge_wavg``): ``x <- merge(x * s, sum) / merge(s, sum)``, ``s <- merge(s, sum)``,
  sizes starting at 1 and carried from block to block.

The rule below runs its own ToMe'd forward of the tower's layers up to the one the projector reads, from the
layers' own weights (LayerNorms, projections, MLP) and the unpatched tower's input to its first layer, with
eager attention, and is checked against every record of ficoco's merges (exact) and the tokens it hands the
projector (allclose). The official order is ficoco's default; its correction ``order="spatial"``
(docs/methods/tome.md) is checked to keep the tokens in image order and merge as the rule does on that order.
The per-layer ``r`` comes from ficoco's schedule for ``keep=`` (the merges spread evenly, the extra ones in the
earliest layers, docs/methods/tome.md; the official code takes any list) or, without it, ToMe's constant
``r = 16`` capped at half the tokens, which the test re-states too.
"""

from __future__ import annotations

import math

import pytest
import torch
from rule_support_vision import assert_decided, feature_layer, patched_run, tower_layers, unpatched_tower
from torch import Tensor, nn

import ficoco.methods.tome.ops as tome_ops
from ficoco.models import synthetic_inputs

TINY_PROFILE = "llava-tiny"  # built as this module's `model` (conftest.py): 64 patches, [CLS] first
SEED = 1
PATCHES = 64


def rates_for(keep: int | None, layers: int, r: int = 16) -> list[int]:
    """Per-layer r: ``keep`` patches left, the merges spread evenly (extra ones first); None: a constant
    ``r``; each at most half of the layer's patches."""
    rates, current, left = [], PATCHES, (PATCHES - keep if keep is not None else None)
    for layer in range(layers):
        want = r if left is None else math.ceil(left / (layers - layer))
        rates.append(min(want, current // 2))
        current -= rates[-1]
        left = None if left is None else left - rates[-1]
    return rates


def attention(layer: nn.Module, x: Tensor, size: Tensor | None) -> tuple[Tensor, Tensor]:
    """ToMe's attention on a CLIP layer (its own q/k/v/out projections, eager): (output, head-mean keys)."""
    attn = layer.self_attn
    batch, tokens, width = x.shape
    heads = attn.num_heads
    q, k, v = (proj(x).reshape(batch, tokens, heads, width // heads).transpose(1, 2)
               for proj in (attn.q_proj, attn.k_proj, attn.v_proj))
    logits = (q @ k.transpose(-2, -1)) * attn.scale
    if size is not None:  # proportional attention
        logits = logits + size.log()[:, None, None, :, 0]
    out = (logits.softmax(dim=-1) @ v).transpose(1, 2).reshape(batch, tokens, width)
    return attn.out_proj(out), k.mean(dim=1)


def bipartite_merge(metric: Tensor, r: int, x: Tensor, size: Tensor, positions: Tensor
                    ) -> tuple[Tensor, Tensor, Tensor]:
    """ToMe's matching with a [CLS] token and its size-weighted merge: (x, size, original positions), each
    ``[unmerged a (by index), all b]``."""
    r = min(r, (metric.shape[1] - 1) // 2)
    metric = metric / metric.norm(dim=-1, keepdim=True)
    a, b = metric[:, ::2], metric[:, 1::2]
    scores = a @ b.transpose(-1, -2)
    scores[:, 0, :] = -math.inf
    node_max, node_idx = scores.max(dim=-1)
    assert_decided(node_max, r)
    edge_idx = node_max.argsort(dim=-1, descending=True)[..., None]
    unm_idx, src_idx = edge_idx[:, r:], edge_idx[:, :r]
    dst_idx = node_idx[..., None].gather(dim=-2, index=src_idx)
    for row, src in zip(scores, src_idx[..., 0], strict=True):  # each merging token's match decided too
        assert_decided(row[src], 1)
    unm_idx = unm_idx.sort(dim=1)[0]

    def merge(t: Tensor) -> Tensor:
        src, dst = t[:, ::2], t[:, 1::2]
        n, t1, c = src.shape
        unm = src.gather(dim=-2, index=unm_idx.expand(n, t1 - r, c))
        src = src.gather(dim=-2, index=src_idx.expand(n, r, c))
        return torch.cat([unm, dst.scatter_reduce(-2, dst_idx.expand(n, r, c), src, reduce="sum")], dim=1)

    summed, new_size = merge(x * size), merge(size)
    kept_a = positions[:, ::2].gather(1, unm_idx[..., 0])
    return summed / new_size, new_size, torch.cat([kept_a, positions[:, 1::2]], dim=1)


def official_tome(model: nn.Module, pixel_values: Tensor, rates: list[int], prop_attn: bool = True,
                  order: str = "official") -> tuple[Tensor, list[Tensor]]:
    """(the projector's input (B, patches left, C), per merging layer the original patch each remaining patch
    token continues, in the sequence's order). ``order="spatial"``: ficoco's correction, image order kept."""
    x = unpatched_tower(model, pixel_values).hidden_states[0]  # the first layer's input
    batch, tokens, _ = x.shape
    size = torch.ones(batch, tokens, 1)
    positions = torch.arange(tokens).expand(batch, -1)
    records = []
    with torch.no_grad():
        for layer, r in zip(tower_layers(model)[:feature_layer(model) + 1], rates, strict=True):
            attn_out, metric = attention(layer, layer.layer_norm1(x), size if prop_attn else None)
            x = x + attn_out
            if r:
                x, size, positions = bipartite_merge(metric, r, x, size, positions)
                if order == "spatial":
                    spatial = positions.argsort(dim=1)
                    x, size, positions = (t.gather(1, spatial.reshape(*spatial.shape, *[1] * (t.dim() - 2))
                                                   .expand_as(t)) for t in (x, size, positions))
                records.append(positions[:, 1:] - 1)
            x = x + layer.mlp(layer.layer_norm2(x))
    return x[:, 1:], records


def check_tome(model: nn.Module, setting: dict, keep: int | None, **options) -> Tensor:
    """Runs ficoco, checks it against the rule; returns the tokens ficoco handed the projector."""
    inputs = synthetic_inputs(model, batch=2, text_tokens=12, seed=SEED)
    rates = rates_for(keep, feature_layer(model) + 1)
    tokens, merges = official_tome(model, inputs["pixel_values"], rates, **options)
    run = patched_run(model, inputs, "tome", **setting)
    assert list(run.settings["rates"]) == rates
    assert [record.layer for record in run.records] == [layer for layer, r in enumerate(rates) if r]
    for record, kept in zip(run.records, merges, strict=True):
        assert torch.equal(record.kept, kept)
    torch.testing.assert_close(run.projector_input, tokens, rtol=1e-4, atol=1e-5)
    return run.projector_input


@pytest.mark.parametrize("setting,keep,options", [
    ({}, None, {}),  # ToMe's constant r = 16: 16, 16, 16, 8, 4 merges, 4 patches left
    ({"keep": 40}, 40, {}),
    ({"keep": 16}, 16, {}),
    ({"keep": 40, "prop_attn": False}, 40, {"prop_attn": False}),  # apply_patch(prop_attn=False)
])
def test_tome_merges_in_every_layer_as_the_official_bipartite_matching(model: nn.Module, setting: dict,
                                                                       keep: int | None, options: dict) -> None:
    check_tome(model, setting, keep, **options)


def test_tome_spatial_order_correction_keeps_image_order_and_merges_on_it(model: nn.Module) -> None:
    check_tome(model, {"keep": 16, "order": "spatial"}, 16, order="spatial")
    official = patched_run(model, synthetic_inputs(model, batch=2, text_tokens=12, seed=SEED), "tome", keep=16)
    spatial = patched_run(model, synthetic_inputs(model, batch=2, text_tokens=12, seed=SEED), "tome", keep=16,
                          order="spatial")
    last = spatial.records[-1].kept
    assert torch.equal(last, last.sort(dim=1).values) and not torch.equal(official.records[-1].kept,
                                                                          official.records[-1].kept.sort(dim=1).values)


@pytest.mark.parametrize("broken", ["no_proportional_attention", "least_similar_pairs"])
def test_tome_rule_check_catches_a_broken_attention_or_matching(model: nn.Module, monkeypatch: pytest.MonkeyPatch,
                                                                broken: str) -> None:
    if broken == "no_proportional_attention":
        monkeypatch.setattr(tome_ops, "proportional_attention_bias",
                            lambda size, dtype=None: torch.zeros_like(size)[:, None, None, :].to(dtype or size.dtype))
    else:  # the B half's keys negated: every score's sign flipped, the least similar pairs merge
        real_matching = tome_ops.bipartite_matching
        flip = torch.tensor([1.0, -1.0])
        monkeypatch.setattr(tome_ops, "bipartite_matching", lambda metric, r, has_cls=True: real_matching(
            metric * flip.repeat(metric.shape[1] // 2 + 1)[:metric.shape[1], None], r, has_cls))
    with pytest.raises(AssertionError):
        check_tome(model, {"keep": 40}, 40)
