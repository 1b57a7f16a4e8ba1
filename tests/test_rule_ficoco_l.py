"""FiCoCo-L's official rule, re-stated in this file's own code, against ficoco's ``rule="official"`` on llava-tiny.

FiCoCo is ficoco's own method: its default rule is its paper's text. ``rule="official"`` (`--hp rule=official`)
runs the rule of the authors' code, kawhiiiileo/FiCoCo at commit 8995e93bf5c62435979f500e9d335e4810301656
(yiming-l21/FiCoCo at 58bfa8a re-indents FiCoCo_L.py:140 and sets AT=False, changing no rule):

- llava/model/language_model/llava_llama.py:39-50, 242, 439-441: r = 14 tokens at every layer with
  ``layer_idx > control_encoding_layer`` = 4, one layer after the paper's first (the profile's: 1 on llava-tiny);
- llava_llama.py:64-92: the layer's scores are the head-mean raw ``q . k^T * scale`` taken before the causal mask
  and the softmax (line 87);
- llava_llama.py:138-144 (``adjust_position_ids``): the later layers' positions are compacted, 0..T'-1;
- FiCoCo_L.py:44-86 (Filter): ``0.6 * (visual rows' sum over the visual keys) - 0.4 * (their mean over the text
  keys)``, the first visual token protected (lines 73-74), the top r removed;
- FiCoCo_L.py:88-116 (Correlate): ``C = 0.6 * S_vv + 0.4 * S_vt @ S_tv``, diagonal -inf; ``K`` the most entries
  above the 0.998 quantile of a removed row; targets the top K of ``softmax(C)`` over every visual token;
- FiCoCo_L.py:17-42, 118-140 (Compress): every target adds ``weight * x_source`` (weights: the K probabilities over
  their sum), no renormalisation; then the removed tokens go.

Where ficoco's setting runs the rule on what the official code cannot (docs/methods/ficoco.md), this file follows
ficoco: the visual span is the image's own (the official code takes the first 576 positions, llava_llama.py:54,
380), and the text is the text after it.

The test recomputes every reducing layer and every layer after it from the unpatched model's hidden states at the
first reducing layer's input, with its own RMSNorm, rotary, attention and MLP from the layers' weights, and checks
ficoco's kept and removed sets exactly, where each removed token's largest share went, the merged hidden states
and the logits, at three budgets; a deliberate break of ficoco's rule (a sign, the positions, the first layer)
fails the same check.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_batch_equals_samples_alone

import ficoco
from ficoco.errors import FicocoError
from ficoco.methods.ficoco_l import ops as official_rule
from ficoco.methods.registry import METHODS
from ficoco.models import hf_compat as hf
from ficoco.models.inputs import synthetic_inputs
from ficoco.models.llm_steps import InLayerPatch

G = 0.6  # FiCoCo_L.py:69, the filter's weight (g)
A = 0.6  # FiCoCo_L.py:96, the correlation's weight (a)
QUANTILE = 0.998  # FiCoCo_L.py:108
R = 14  # llava_llama.py:39
PAPER_FIRST = 1  # llava-tiny's first reducing layer (its profile); the official code reduces after it


@pytest.fixture(scope="module")
def tiny():
    model = ficoco.build_model("llava-tiny", dtype="fp32", seed=3)
    inputs = synthetic_inputs(model, text_tokens=20, seed=5)
    image = model.config.image_token_index
    span = (inputs["input_ids"][0] == image).nonzero()[:, 0]
    with torch.no_grad():
        plain = model(**inputs, output_hidden_states=True)
    return model, inputs, int(span[0]), span.numel(), plain.hidden_states


# ---- the official rule, in this file's own code ------------------------------------------------------------------

def rms_norm(x, norm):
    variance = x.pow(2).mean(-1, keepdim=True)
    return norm.weight * (x * torch.rsqrt(variance + norm.variance_epsilon))


def rotary(positions, dim, theta):
    inverse = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    angles = positions.float()[:, None] * inverse[None]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def rope(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


def official_step(h, att_score, start, n, r):
    """FiCoCo_L.py's Filter, Correlate and Compress at one layer, on the visual span [start, start + n) of one
    sample (batch 1, as the official code): `h` (1, T, D) after the attention residual, `att_score` (1, T, T)."""
    vis, text = slice(start, start + n), slice(start + n, None)
    att_vv, att_vt, att_tv = att_score[:, vis, vis], att_score[:, vis, text], att_score[:, text, vis]
    scores = G * att_vv.sum(dim=-1) - (1 - G) * att_vt.mean(dim=-1)  # lines 68-71
    scores[..., :1] = -float("inf")  # lines 73-74: the first token never goes
    merge = torch.topk(scores, r, dim=-1).indices[0]  # line 77
    remain = [j for j in range(n) if j not in set(merge.tolist())]  # lines 81-84
    con = A * att_vv + (1 - A) * torch.einsum("bij,bjk->bik", att_vt, att_tv)  # lines 95-97
    con[0].fill_diagonal_(-float("inf"))  # lines 99-100
    chosen = con[0, merge, :].float()  # lines 106-107
    threshold = torch.quantile(chosen, QUANTILE, dim=-1, keepdim=True)  # line 108
    top_k = int((chosen > threshold).sum(dim=-1).max())  # lines 109-111
    top_values, top_indices = torch.softmax(con, dim=-1).topk(top_k, dim=-1)  # lines 112-113
    targets = top_indices[0, merge]  # lines 114-115
    weights = top_values[0, merge] / top_values[0, merge].sum(dim=-1, keepdim=True)  # lines 129-132
    visual = h[0, vis].clone()
    sources = visual[merge]  # line 133: gathered before the scatter
    width = visual.shape[-1]
    visual.scatter_add_(0, targets.reshape(-1, 1).expand(-1, width),  # lines 134-137
                        (sources[:, None] * weights[..., None]).reshape(-1, width))
    reduced = torch.cat([h[0, :start], visual[remain], h[0, start + n:]])[None]  # line 139; llava_llama.py:263
    return reduced, remain, merge.tolist(), targets[:, 0].tolist()


def shapes(model):
    config = model.config.text_config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    return heads, kv_heads, config.hidden_size // heads, config.rope_parameters["rope_theta"]


def attention(layer, h, positions, model, past=None):
    """One LLaMA attention block with its residual, from the layer's weights: (h + attention, raw head-mean scores
    (1, T, T) before the mask and the softmax (llava_llama.py:85-87), (k, v) as the layer caches them)."""
    heads, kv_heads, dim, theta = shapes(model)
    attn, length = layer.self_attn, h.shape[1]
    cos, sin = rotary(positions, dim, theta)
    x = rms_norm(h, layer.input_layernorm)
    q = F.linear(x, attn.q_proj.weight).view(1, length, heads, dim).transpose(1, 2)
    k = F.linear(x, attn.k_proj.weight).view(1, length, kv_heads, dim).transpose(1, 2)
    v = F.linear(x, attn.v_proj.weight).view(1, length, kv_heads, dim).transpose(1, 2)
    q, k = rope(q, cos, sin), rope(k, cos, sin)
    if past is not None:
        k, v = torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)
    cache = (k, v)
    k, v = k.repeat_interleave(heads // kv_heads, 1), v.repeat_interleave(heads // kv_heads, 1)
    weight = q @ k.transpose(-1, -2) * dim ** -0.5  # llava_llama.py:85
    att_score = weight.mean(dim=1)  # line 87: before the mask and the softmax
    future = torch.ones(length, k.shape[2], dtype=torch.bool).triu(k.shape[2] - length + 1)
    weight = weight.masked_fill(future, -float("inf"))
    out = (torch.softmax(weight, dim=-1) @ v).transpose(1, 2).reshape(1, length, -1)
    return h + F.linear(out, attn.o_proj.weight), att_score, cache


def mlp_block(layer, h):
    y = rms_norm(h, layer.post_attention_layernorm)
    mlp = layer.mlp
    return h + F.linear(F.silu(F.linear(y, mlp.gate_proj.weight)) * F.linear(y, mlp.up_proj.weight),
                        mlp.down_proj.weight)


def official_run(model, hidden_in, first, removals, start, n):
    """The decoder from layer `first` on, as the official code runs it: per reducing layer (kept, removed and where
    each removed token's largest share went, as original span ranks or -1, the hidden states entering the MLP), the
    logits, and per layer the keys and values it caches."""
    lm = model.model.language_model
    h, ranks, steps, caches = hidden_in, list(range(n)), {}, {}
    for index in range(first, model.config.text_config.num_hidden_layers):
        layer = lm.layers[index]
        # Positions 0..T'-1: the first kv_seq_len position ids (llava_llama.py:138-141).
        h, att_score, caches[index] = attention(layer, h, torch.arange(h.shape[1]), model)
        r = removals.get(index, 0)
        if r:
            h, remain, merge, main = official_step(h, att_score, start, n, r)
            kept_ranks = [ranks[j] for j in remain]
            into = [ranks[t] if t in set(remain) else -1 for t in main]
            steps[index] = (kept_ranks, sorted(ranks[j] for j in merge), dict(zip((ranks[j] for j in merge), into,
                                                                                 strict=True)), h)
            ranks, n = kept_ranks, n - r
        h = mlp_block(layer, h)
    logits = model.lm_head(rms_norm(h, lm.norm))
    return steps, logits, caches


# ---- ficoco's rule="official" against it ------------------------------------------------------------------------

def check_official(tiny, removals, **apply):
    """ficoco's kept and removed sets, merge targets, merged hidden states and logits under rule="official" equal the
    official rule's at the reducing layers `removals` ({layer: r}) the budget `apply` asks for."""
    model, inputs, start, n, hidden = tiny
    first = min(removals)
    expected, logits, _ = official_run(model, hidden[first], first, removals, start, n)
    layers = model.model.language_model.layers
    entering_mlp = {}
    hooks = [layers[index].post_attention_layernorm.register_forward_pre_hook(
        lambda _, args, index=index: entering_mlp.__setitem__(index, args[0].detach().clone()))
        for index in removals]
    try:
        with torch.no_grad(), ficoco.apply(model, "l", rule="official", **apply) as handle:
            out = model(**inputs).logits
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
        torch.testing.assert_close(entering_mlp[index], reduced, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(out, logits, rtol=1e-4, atol=1e-4)


BUDGETS = {
    # The rule's own setting: r = 14 at every layer after the paper's first (llava_llama.py:39, 242).
    "official r=14": ({layer: R for layer in range(PAPER_FIRST + 1, 4)}, {}),
    # A budget: keep 40 of the 64 visual tokens, the same count at every layer from layer 1.
    "keep=40 from layer 1": ({1: 8, 2: 8, 3: 8}, {"keep": 40, "first_layer": 1}),
    "schedule 1:20,3:10": ({1: 20, 3: 10}, {"schedule": "1:20,3:10"}),
}


@pytest.mark.parametrize("budget", list(BUDGETS))
def test_ficoco_l_rule_official_keeps_merges_and_positions_as_the_official_code(tiny, budget):
    removals, apply = BUDGETS[budget]
    check_official(tiny, removals, **apply)


def test_ficoco_l_rule_official_decodes_at_each_layer_s_compacted_positions(tiny):
    """A decode step after the reduced prefill: the new token's position at a layer is the count of tokens that
    layer cached (the official code subtracts r at every layer after the fourth, in place, llava_llama.py:142-143,
    which puts every reduced layer r positions off: ficoco continues each layer's own numbering, and the test does)."""
    model, inputs, start, n, hidden = tiny
    removals, apply = BUDGETS["official r=14"]
    first = min(removals)
    _, logits, caches = official_run(model, hidden[first], first, removals, start, n)
    token = logits[:, -1].argmax(-1)[:, None]
    mask = torch.cat([inputs["attention_mask"], torch.ones_like(inputs["attention_mask"][:, :1])], dim=1)
    lm = model.model.language_model
    with torch.no_grad():
        plain = hf.output_cache(model(**inputs, use_cache=True))
        with ficoco.apply(model, "l", rule="official", **apply):
            prefill = model(**inputs, use_cache=True)
            step = model(input_ids=token, attention_mask=mask, **hf.cache_argument(hf.output_cache(prefill)),
                         use_cache=True).logits
    h = lm.embed_tokens(token)
    for index, layer in enumerate(lm.layers):
        if index < first:  # unreduced: the layer caches every token, at its own position
            past = (hf.cache_layers(plain)[index].keys, hf.cache_layers(plain)[index].values)
        else:
            past = caches[index]
        h, _, _ = attention(layer, h, torch.tensor([past[0].shape[2]]), model, past)
        h = mlp_block(layer, h)
    torch.testing.assert_close(step, model.lm_head(rms_norm(h, lm.norm)), rtol=1e-4, atol=1e-4)


SCORES, CORRELATION = official_rule.official_scores, official_rule.official_correlation


def _masked_scores(among, to_text, text, beta=0.6):
    # The scores after the causal mask: a visual row's later keys (visual and text) left out.
    return SCORES(among.tril(), torch.zeros_like(to_text), text, beta)


def _kept_targets_only(among, to_text, from_text, source, gamma=0.6):
    # The paper's candidates: the kept tokens alone, where the official code's are every visual token.
    correlation = CORRELATION(among, to_text, from_text, source, gamma)
    return correlation.index_fill(2, source[0], -float("inf"))


BREAKS = {
    "scores after the mask": lambda mp: mp.setattr(official_rule, "official_scores", _masked_scores),
    "targets among the kept": lambda mp: mp.setattr(official_rule, "official_correlation", _kept_targets_only),
    "positions not compacted": lambda mp: mp.setattr(InLayerPatch, "_compacted", lambda *args: None),
    "first layer the paper's": lambda mp: mp.setitem(
        METHODS["l"].rules, "official", dataclasses.replace(METHODS["l"].rules["official"], first_layer_offset=0)),
}


@pytest.mark.parametrize("broken", list(BREAKS))
def test_ficoco_l_rule_official_check_catches_a_deliberate_break(tiny, broken, monkeypatch):
    BREAKS[broken](monkeypatch)
    removals, apply = BUDGETS["official r=14"]
    with pytest.raises(AssertionError):
        check_official(tiny, removals, **apply)


# ---- where the official code cannot run as written: ficoco's setting runs it per sample, or refuses in one line --

def test_ficoco_l_rule_official_runs_a_batch_as_each_sample_alone(tiny):
    """The official code runs one prompt at a time (its K is the first sample's, FiCoCo_L.py:106): ficoco's setting
    runs every sample of a batch as it runs alone."""
    model = tiny[0]
    alone = [synthetic_inputs(model, text_tokens=20, seed=seed) for seed in (5, 6)]
    batch = {key: torch.cat([sample[key] for sample in alone]) for key in alone[0]}
    with torch.no_grad(), ficoco.apply(model, "l", rule="official") as handle:
        assert_batch_equals_samples_alone(model, handle, batch, alone)


def test_ficoco_l_rule_official_refuses_what_it_cannot_run_in_one_line(tiny):
    model, inputs = tiny[0], tiny[1]
    second = synthetic_inputs(model, text_tokens=20, seed=9)
    ids = torch.cat([inputs["input_ids"], second["input_ids"][:, 1:]], dim=1)
    two_images = {"input_ids": ids, "attention_mask": torch.ones_like(ids),
                  "pixel_values": torch.cat([inputs["pixel_values"], second["pixel_values"]])}
    with torch.no_grad(), ficoco.apply(model, "l", rule="official", keep=40), \
            pytest.raises(FicocoError, match="reads 1 image per prompt; this prompt holds 2"):
        model(**two_images)
    # A new image on an earlier turn's cache: its reduced layers hold positions of their own (text turns run).
    later = synthetic_inputs(model, text_tokens=20, seed=8)
    with torch.no_grad(), ficoco.apply(model, "l", rule="official", keep=40):
        cache = hf.output_cache(model(**inputs, use_cache=True))
        mask = torch.cat([inputs["attention_mask"], later["attention_mask"]], dim=1)
        with pytest.raises(FicocoError, match="compacts positions from an empty cache: a new image on an earlier"):
            model(input_ids=later["input_ids"], pixel_values=later["pixel_values"], attention_mask=mask,
                  **hf.cache_argument(cache), use_cache=True)
    with pytest.raises(FicocoError, match="rule=official runs on llava, .* 'qwen2_vl' model"):
        ficoco.flops("qwen2-vl-7b", ["l"], keep=64, hyperparameters={"rule": "official"})
    with pytest.raises(FicocoError, match="rule='oficial': give 'paper' \\(the default\\) or 'official'"):
        ficoco.flops("llava-1.5-7b", ["l"], keep=64, hyperparameters={"rule": "oficial"})


def test_ficoco_l_rule_official_is_planned_at_r_14_from_layer_5_and_named_in_every_row(cli, tmp_path):
    """llava-1.5-7b without a budget: the official code's own setting, 14 tokens at layers 5..31 (198 of 576 leave
    the LLM); a budget picks the count per layer instead; the row names the rule."""
    out = tmp_path / "r.json"
    result = cli("flops", "--model", "llava-1.5-7b", "--variant", "l", "--hp", "rule=official", "--json", str(out))
    assert result.code == 0, result.err
    row = json.loads(out.read_text())["rows"][0]
    assert row["schedule"] == [{"stage": "llm", "layer": layer, "remove": R} for layer in range(5, 32)]
    assert row["visual_tokens"] == 576 - 27 * R == 198
    assert row["method_label"] == "FiCoCo-L (official code's rule)" and row["settings"] == {"rule": "official"}
    assert "l (official code's rule)" in result.out
    paper = ficoco.flops("llava-1.5-7b", ["l"], keep=198)["rows"][0]
    assert paper["method_label"] == "FiCoCo-L" and paper["schedule"][0]["layer"] == 4


def test_ficoco_rule_official_passes_flops_verify(flops_verify):
    """The accountant plans the official code's rule (token counts per layer, its raw-score reads, L's products)
    and --verify counts the same (V and L, on llava-tiny: 24 of 64 go at layers 2-4 and 2-3)."""
    report = flops_verify("--model", "llava-tiny", "--variant", "v,l", "--keep", "40", "--hp", "rule=official",
                          "--dtype", "fp32")
    assert report["passed"] is True
    assert [(run["variant"], run["visual_tokens"]) for run in report["runs"]] == [("v", 40), ("l", 40)]
    assert [[(m["layer"], m["removed"]) for m in run["method"]] for run in report["runs"]] == [
        [(2, 8), (3, 8), (4, 8)], [(2, 12), (3, 12)]]
