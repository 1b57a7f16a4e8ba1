"""FiCoCo-V's official rule, re-stated in this file's own code, against ficoco's ``rule="official"`` on llava-tiny.

FiCoCo is ficoco's own method: its default rule is its paper's text, from which the official vision code departs
(raw scores, the row mean, the weights, the window minimum), so the official rule runs under the named setting
``rule="official"`` (`--hp rule=official`). The official code: kawhiiiileo/FiCoCo at commit
8995e93bf5c62435979f500e9d335e4810301656 (yiming-l21/FiCoCo at 58bfa8a casts the quantile's input to float32 and
sets r = 32, changing no rule):

- llava/model/multimodal_encoder/clip_encoder.py:18-24, 120-134: r = 42 patches at every tower layer with
  ``idx_now > control_encoding_layer`` = 11 (layer 12, the paper's first: the profile's, 2 on llava-tiny);
- clip_encoder.py:46-56: the scores are the head-mean raw ``(q * scale) . k^T``, before the softmax;
- FiCoCo_V.py:56-124 (Filter): the [CLS] row over the patches and the patch rows' mean over the patch keys, each at
  unit L2 norm (lines 74-80); ``0.35 * cls - 0.65 * rows`` (line 82); in every 2 x 2 window the lowest score halved
  when positive, doubled otherwise (lines 92-114); the r lowest go (lines 115-123), [CLS] never (its inf, line 117);
- FiCoCo_V.py:127-141 (Correlate): a removed patch's raw row over every token; K the most entries above the row's
  0.998 quantile; its targets the top K of ``softmax`` of its row, weighted by those probabilities over their sum;
- FiCoCo_V.py:15-39, 143-168 (Compress): ``(x_j + sum_i w_ij x_i) / (1 + sum_i w_ij)`` (the sizes).

Where the official code cannot run as written, this file follows ficoco's setting (docs/methods/ficoco.md): the
tokens stay in their order with [CLS] first (the official code reorders them by score, so later layers read an
ordinary patch as [CLS]), a target is the token the official index names (the official code scatters it into the
score-ordered tensor), and the window penalty reads the patches present on the original grid (the official code's
module-global buffer marks the 144 penalised positions of its 24 x 24 grid, not the removed ones, and keeps them from
one image to the next; at the first reducing layer of a first image both agree).

The test recomputes every tower layer from the first reducing one to the layer the projector reads, from the
unpatched tower's hidden states there, with its own LayerNorm, attention and MLP from the layers' weights, and checks
ficoco's kept and removed patches exactly, where each removed patch's largest share went, the merged hidden states
and the projector's input, at three budgets; a deliberate break of ficoco's rule fails the same check.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F

import ficoco
from ficoco.errors import FicocoError
from ficoco.methods.ficoco_v import ops as official_rule
from ficoco.methods.registry import METHODS
from ficoco.models.inputs import synthetic_inputs

BETA = 0.35  # FiCoCo_V.py:77, on the [CLS] term
QUANTILE = 0.998  # FiCoCo_V.py:133
WINDOW = 2  # FiCoCo_V.py:92-93
R = 42  # clip_encoder.py:18


@pytest.fixture(scope="module")
def tiny():
    model = ficoco.build_model("llava-tiny", dtype="fp32", seed=4)
    inputs = synthetic_inputs(model, text_tokens=12, seed=7)
    tower = model.model.vision_tower
    with torch.no_grad():
        hidden = tower(inputs["pixel_values"], output_hidden_states=True).hidden_states
    return model, inputs, hidden


# ---- the official rule, in this file's own code ------------------------------------------------------------------

def attention(layer, h):
    """A CLIP attention block with its residual, from the layer's weights, and the raw head-mean scores (T, T)
    (clip_encoder.py:46-56: the queries scaled, the product, the mean over heads, before the softmax)."""
    attn = layer.self_attn
    length, width = h.shape[1], h.shape[2]
    heads = attn.num_heads
    dim = width // heads
    x = F.layer_norm(h, (width,), layer.layer_norm1.weight, layer.layer_norm1.bias, layer.layer_norm1.eps)
    q = (F.linear(x, attn.q_proj.weight, attn.q_proj.bias) * dim ** -0.5).view(1, length, heads, dim).transpose(1, 2)
    k = F.linear(x, attn.k_proj.weight, attn.k_proj.bias).view(1, length, heads, dim).transpose(1, 2)
    v = F.linear(x, attn.v_proj.weight, attn.v_proj.bias).view(1, length, heads, dim).transpose(1, 2)
    weights = q @ k.transpose(-1, -2)
    att_score = weights.mean(dim=1)[0]
    out = (torch.softmax(weights, dim=-1) @ v).transpose(1, 2).reshape(1, length, width)
    return h + F.linear(out, attn.out_proj.weight, attn.out_proj.bias), att_score


def mlp_block(layer, h):
    width = h.shape[2]
    y = F.layer_norm(h, (width,), layer.layer_norm2.weight, layer.layer_norm2.bias, layer.layer_norm2.eps)
    y = F.linear(y, layer.mlp.fc1.weight, layer.mlp.fc1.bias)
    y = y * torch.sigmoid(1.702 * y)  # quick_gelu
    return h + F.linear(y, layer.mlp.fc2.weight, layer.mlp.fc2.bias)


def official_step(h, att_score, grid, side, r):
    """FiCoCo_V.py's Filter, Correlate and Compress at one tower layer ([CLS] first, then the patches in grid order;
    `grid` the original grid index of every current patch). Returns (the reduced hidden states, the kept and removed
    grid indices, where each removed patch's largest share went: a kept grid index or -1)."""
    cls_similarity = F.normalize(att_score[0, 1:], p=2, dim=-1)  # lines 74, 79
    patch_similarity = F.normalize(att_score[1:, 1:].mean(dim=-1), p=2, dim=-1)  # lines 75, 80
    dst = BETA * cls_similarity - (1 - BETA) * patch_similarity  # line 82
    # The local penalty (lines 92-114): the lowest score of every 2 x 2 window of the grid of patches present.
    board = torch.full((side * side,), float("inf"))
    board[grid] = dst
    windows = board.view(side // WINDOW, WINDOW, side // WINDOW, WINDOW).permute(0, 2, 1, 3).reshape(-1, WINDOW ** 2)
    lowest = windows.argmin(dim=-1)  # find_windows_min_indices, lines 41-52
    place = {p: j for j, p in enumerate(grid)}
    for window, k in enumerate(lowest.tolist()):
        row = window // (side // WINDOW) * WINDOW + k // WINDOW
        col = window % (side // WINDOW) * WINDOW + k % WINDOW
        j = place.get(row * side + col)
        if j is not None:  # an empty window's minimum is no patch
            dst[j] = dst[j] / 2 if dst[j] > 0 else dst[j] * 2  # lines 112-114
    values = torch.cat([torch.full((1,), float("inf")), dst])  # line 118: index k is token k, [CLS] 0
    order = values.argsort(dim=-1, descending=False)  # line 121
    merge, remain = order[:r], order[r:]  # lines 122-123
    rows = att_score[merge, :]  # Correlate, line 132
    threshold = torch.quantile(rows, QUANTILE, dim=-1, keepdim=True)  # line 133
    top_k = int((rows > threshold).sum(dim=-1).max())  # lines 134-136
    top_values, top_indices = torch.softmax(att_score, dim=-1).topk(top_k, dim=-1)  # lines 137-138
    targets, chosen = top_indices[merge], top_values[merge]  # line 140
    weights = chosen / chosen.sum(dim=-1, keepdim=True)  # lines 156-159
    x, width = h[0], h.shape[2]
    added = x.scatter_add(0, targets.reshape(-1, 1).expand(-1, width),  # lines 160-165
                          (x[merge][:, None] * weights[..., None]).reshape(-1, width))
    size = torch.ones(x.shape[0]).scatter_add(0, targets.reshape(-1), weights.reshape(-1))  # line 36
    merged = added / size[:, None]  # line 38
    kept = [0] + sorted(t for t in remain.tolist() if t)  # [CLS] first, the patches in grid order (ficoco)
    removed = sorted(merge.tolist())
    kept_set = set(kept[1:])
    into = {grid[t - 1]: (grid[m - 1] if m in kept_set else -1) for t, m in zip(merge.tolist(), targets[:, 0].tolist(),
                                                                              strict=True)}
    return merged[kept][None], [grid[t - 1] for t in kept[1:]], [grid[t - 1] for t in removed], into


def official_tower(model, hidden_in, first, last, removals):
    """The tower from layer `first` to `last` (the one the projector reads), as the official code runs it."""
    layers = model.model.vision_tower.encoder.layers
    side = model.config.vision_config.image_size // model.config.vision_config.patch_size
    h, grid, steps = hidden_in, list(range(side * side)), {}
    for index in range(first, last + 1):
        h, att_score = attention(layers[index], h)
        if removals.get(index, 0):
            h, grid, removed, into = official_step(h, att_score, grid, side, removals[index])
            steps[index] = (grid, removed, into, h)
        h = mlp_block(layers[index], h)
    return steps, h


# ---- ficoco's rule="official" against it ------------------------------------------------------------------------

def check_official(tiny, removals, **apply):
    """ficoco's kept and removed patches, merge targets, merged hidden states and the projector's input under
    rule="official" equal the official rule's at the reducing layers `removals` ({layer: r})."""
    model, inputs, hidden = tiny
    first, last = min(removals), 4  # llava-tiny's projector reads layer 4's output (vision_feature_layer -2)
    expected, features = official_tower(model, hidden[first], first, last, removals)
    layers = model.model.vision_tower.encoder.layers
    seen = {}
    hooks = [layers[index].layer_norm2.register_forward_pre_hook(
        lambda _, args, index=index: seen.__setitem__(index, args[0].detach().clone())) for index in removals]
    hooks.append(layers[last].register_forward_hook(
        lambda _, args, output: seen.__setitem__("out", (output[0] if isinstance(output, tuple) else output).clone())))
    try:
        with torch.no_grad(), ficoco.apply(model, "v", rule="official", **apply) as handle:
            model(**inputs)
            records = {record.layer: record for record in handle.records}
    finally:
        for hook in hooks:
            hook.remove()
    assert handle.schedule.removed_at() == removals
    assert sorted(records) == sorted(removals)
    for index, (kept, removed, into, reduced) in expected.items():
        record = records[index]
        assert record.kept[0].tolist() == kept, f"layer {index}: kept"
        assert record.discarded[0].tolist() == removed, f"layer {index}: removed"
        assert dict(zip(record.discarded[0].tolist(), record.merged_into[0].tolist(), strict=True)) == into
        torch.testing.assert_close(seen[index], reduced, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(seen["out"], features, rtol=1e-4, atol=1e-5)


BUDGETS = {
    # keep 40 of the 64 patches: 8 at each tower layer from the first (2) to the one the projector reads (4).
    "keep=40": ({2: 8, 3: 8, 4: 8}, {"keep": 40}),
    "schedule 2:20,4:12": ({2: 20, 4: 12}, {"schedule": "2:20,4:12"}),
    "oneshot keep=16 at layer 3": ({3: 48}, {"keep": 16, "shape": "oneshot", "first_layer": 3}),
}


@pytest.mark.parametrize("budget", list(BUDGETS))
def test_ficoco_v_rule_official_keeps_and_merges_as_the_official_code(tiny, budget):
    removals, apply = BUDGETS[budget]
    check_official(tiny, removals, **apply)


SCORES, PENALTY = official_rule.official_scores, official_rule.local_penalty


def _paper_weights(scores, lam=0.35):
    # The paper's weights: lam on the patch term, 1 - lam on the [CLS] term.
    return SCORES(scores, 1.0 - lam)


BREAKS = {
    "the paper's weights": lambda mp: mp.setattr(official_rule, "official_scores", _paper_weights),
    "no window penalty": lambda mp: mp.setattr(official_rule, "local_penalty", lambda scores, *args, **kw: scores),
    "first layer one later": lambda mp: mp.setitem(
        METHODS["v"].rules, "official", dataclasses.replace(METHODS["v"].rules["official"], first_layer_offset=1)),
}


@pytest.mark.parametrize("broken", list(BREAKS))
def test_ficoco_v_rule_official_check_catches_a_deliberate_break(tiny, broken, monkeypatch):
    BREAKS[broken](monkeypatch)
    removals, apply = BUDGETS["keep=40"]
    with pytest.raises(AssertionError):
        check_official(tiny, removals, **apply)


# ---- the setting's own count, and what it does not run on --------------------------------------------------------

def test_ficoco_v_rule_official_is_planned_at_r_42_from_layer_12_and_named_in_every_row(cli, tmp_path):
    """llava-1.5-7b without a budget: the official code's own setting, 42 patches at tower layers 12..22 (the layer
    LLaVA's projector reads), 114 of 576 reach the LLM; the row names the rule."""
    out = tmp_path / "r.json"
    result = cli("flops", "--model", "llava-1.5-7b", "--variant", "v", "--hp", "rule=official", "--json", str(out))
    assert result.code == 0, result.err
    row = json.loads(out.read_text())["rows"][0]
    assert row["schedule"] == [{"stage": "vision", "layer": layer, "remove": R} for layer in range(12, 23)]
    assert row["visual_tokens"] == 576 - 11 * R == 114
    assert row["method_label"] == "FiCoCo-V (official code's rule)" and row["settings"] == {"rule": "official"}


def test_ficoco_v_rule_official_refuses_what_it_cannot_run_in_one_line():
    with pytest.raises(FicocoError, match="removes 42 at each of the 3 layers from layer 2 .* give keep="):
        ficoco.flops("llava-tiny", ["v"], hyperparameters={"rule": "official"})
    with pytest.raises(FicocoError, match="runs on llava, llava_next, video_llava models; .* 'llava_onevision' model "
                                          "\\(its vision rule reads the \\[CLS\\] row"):
        ficoco.flops("llava-onevision-7b", ["v"], keep=64, hyperparameters={"rule": "official"})
