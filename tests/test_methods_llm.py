"""The method registry and the in-LLM baselines (FastV, PDrop, SparseVLM v1.5, DART).

Each method's batched tensor function is checked against a small independent
re-implementation of its score written from its official code
(docs/methods/<name>.md; per sample, loops, the whole causal
attention matrix where the official code builds it), on random tensors with left padding and
different spans per sample; a batch must equal its samples run alone; a full keep must be
the identity; the accountant's per-layer token counts must equal what the functions produce
step by step; and the visual-macs convention must reproduce the figures PDrop prints.
"""

from __future__ import annotations

import math
import random
import subprocess
import sys

import pytest
import torch

from ficoco import accounting as acc
from ficoco.errors import FicocoError
from ficoco.methods import METHODS
from ficoco.methods.dart.ops import cpython_set_order, dart_reduce, dart_select
from ficoco.methods.fastv.ops import fastv_reduce, fastv_scores
from ficoco.methods.ops import last_row_attention
from ficoco.methods.pdrop.ops import pdrop_keep, pdrop_reduce, pdrop_scores
from ficoco.methods.sparsevlm.ops import (
    dpc_knn_merge,
    select_raters,
    sparsevlm_reduce,
    sparsevlm_scores,
    suffix_rows,
)
from ficoco.profiles import load_profile

HEADS, KV_HEADS, HEAD_DIM, DIM = 4, 2, 8, 16


def _batch(spans: list[tuple[int, int]], num_visual: int, seed: int = 0):
    """Left-padded random inputs: sample b has `prefix` tokens, the span, `suffix` tokens."""
    gen = torch.Generator().manual_seed(seed)
    lengths = [p + num_visual + s for p, s in spans]
    seq_len = max(lengths)
    batch = len(spans)
    hidden = torch.randn(batch, seq_len, DIM, generator=gen, dtype=torch.float64)
    keys = torch.randn(batch, KV_HEADS, seq_len, HEAD_DIM, generator=gen, dtype=torch.float64)
    query = torch.randn(batch, HEADS, seq_len, HEAD_DIM, generator=gen, dtype=torch.float64)
    pad = torch.tensor([seq_len - n for n in lengths])
    mask = (torch.arange(seq_len).unsqueeze(0) >= pad.unsqueeze(1)).long()
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    start = pad + torch.tensor([p for p, _ in spans])
    return hidden, keys, query, mask, positions, start


def _alone(tensor: torch.Tensor, b: int, pad: int, dim: int = 1) -> torch.Tensor:
    """Sample b without its padding, as a batch of one."""
    return tensor[b:b + 1].narrow(dim, pad, tensor.shape[dim] - pad)


def _reference_last_row(query_b, keys_b, real_from: int) -> torch.Tensor:
    """Head-mean softmax of the last query over the real keys: the whole causal matrix, read at its last row."""
    seq_len = keys_b.shape[1]
    rows = []
    for h in range(HEADS):
        k = keys_b[h // (HEADS // KV_HEADS)]
        logits = query_b[h] @ k.T / math.sqrt(HEAD_DIM)
        causal = torch.ones(seq_len, seq_len, dtype=torch.bool).tril()
        causal[:, :real_from] = False
        rows.append(torch.softmax(logits.masked_fill(~causal, float("-inf")), dim=-1)[-1])
    return torch.stack(rows).mean(0)


def _top_set(values: list[float], k: int) -> list[int]:
    return sorted(sorted(range(len(values)), key=lambda i: (-values[i], i))[:k])


SPANS = [(2, 5), (4, 3), (1, 7)]
N = 12


@pytest.mark.parametrize("name", ["fastv", "pdrop"])
def test_last_row_methods_pick_the_reference_tokens(name):
    hidden, keys, query, mask, positions, start = _batch(SPANS, N)
    keep = 5
    row = last_row_attention(query[:, :, -1], keys, mask)
    scores = (fastv_scores if name == "fastv" else pdrop_scores)(row, start, N)
    reduce = fastv_reduce if name == "fastv" else pdrop_reduce
    out = reduce(hidden, scores, keep, start, N, positions, mask)
    pad = hidden.shape[1] - mask.sum(1)
    for b in range(len(SPANS)):
        ref_row = _reference_last_row(query[b, :, :], keys[b], int(pad[b]))
        image = ref_row[int(start[b]):int(start[b]) + N].tolist()
        assert out.kept_visual[b].tolist() == _top_set(image, keep)


def test_fastv_keeps_original_positions_and_pdrop_compacts():
    hidden, keys, query, mask, positions, start = _batch(SPANS, N)
    scores = torch.randn(len(SPANS), N, dtype=torch.float64)
    fast = fastv_reduce(hidden, scores, 4, start, N, positions, mask)
    drop = pdrop_reduce(hidden, scores, 4, start, N, positions, mask)
    assert torch.equal(fast.position_ids, torch.gather(positions, 1, fast.kept_positions))
    for b in range(len(SPANS)):
        real = drop.attention_mask[b].bool()
        # An unpadded sample's compacted positions are arange over its real tokens.
        assert drop.position_ids[b][real].tolist() == list(range(int(real.sum())))
    assert torch.equal(fast.hidden, drop.hidden)  # same tokens, different positions


@pytest.mark.parametrize("name", ["fastv", "pdrop", "dart"])
def test_full_keep_is_the_identity(name):
    hidden, keys, query, mask, positions, start = _batch(SPANS, N)
    if name == "dart":
        flat_keys = keys.transpose(1, 2).reshape(len(SPANS), hidden.shape[1], -1)
        out = dart_reduce(hidden, flat_keys, hidden, start, N, positions, max_num_trunction=8 * N, attention_mask=mask)
    else:
        scores = torch.randn(len(SPANS), N, dtype=torch.float64)
        out = (fastv_reduce if name == "fastv" else pdrop_reduce)(hidden, scores, N, start, N, positions, mask)
    assert torch.equal(out.hidden, hidden)
    assert torch.equal(out.position_ids, positions)
    assert torch.equal(out.attention_mask, mask)


def test_fastv_and_pdrop_batch_equals_samples_alone():
    hidden, keys, query, mask, positions, start = _batch(SPANS, N, seed=3)
    row = last_row_attention(query[:, :, -1], keys, mask)
    pad = (hidden.shape[1] - mask.sum(1)).tolist()
    for reduce in (fastv_reduce, pdrop_reduce):
        out = reduce(hidden, fastv_scores(row, start, N), 6, start, N, positions, mask)
        for b in range(len(SPANS)):
            p = pad[b]
            row_b = last_row_attention(query[b:b + 1, :, -1], _alone(keys, b, p, dim=2))
            alone = reduce(_alone(hidden, b, p), fastv_scores(row_b, start[b:b + 1] - p, N), 6, start[b:b + 1] - p,
                           N, _alone(positions, b, p))
            assert torch.equal(out.hidden[b, p:], alone.hidden[0])
            assert torch.equal(out.position_ids[b, p:], alone.position_ids[0])


# ---- SparseVLM ---------------------------------------------------------------------------------------------------

def _reference_raters(embeds_b: torch.Tensor, start: int) -> list[int]:
    """Sequence positions of the raters: softmax over text of V T^T, mean over V, above the mean."""
    image, text = embeds_b[start:start + N], embeds_b[start + N:]
    m = torch.softmax(image @ text.T, dim=-1).mean(0)
    return [start + N + t for t in range(len(m)) if m[t] > m.mean()]


def _reference_dpc(x: torch.Tensor, clusters: int) -> list[list[int]]:
    """DPC-kNN by loops: which tokens (by index) end up in each cluster, centers in score order; a density
    tie goes to the lower index (ficoco's rule in place of the official noise)."""
    count, dim = x.shape
    d = [[float(torch.linalg.vector_norm(x[i] - x[j])) / math.sqrt(dim) for j in range(count)] for i in range(count)]
    rho = [math.exp(-sum(v * v for v in sorted(d[i])[:clusters]) / clusters) for i in range(count)]
    dmax = max(max(r) for r in d)
    delta = [min([d[i][j] for j in range(count) if rho[j] > rho[i] or (rho[j] == rho[i] and j < i)], default=dmax)
             for i in range(count)]
    centers = sorted(range(count), key=lambda i: (-rho[i] * delta[i], i))[:clusters]
    members: list[list[int]] = [[] for _ in centers]
    for i in range(count):
        c = centers.index(i) if i in centers else min(range(clusters), key=lambda c: (d[i][centers[c]], c))
        members[c].append(i)
    return members


def test_sparsevlm_matches_the_reference_raters_scores_and_clusters():
    hidden, keys, query, mask, positions, start = _batch([(2, 6), (4, 5)], N, seed=5)
    batch, seq_len, _ = hidden.shape
    raters = select_raters(hidden, start, N)
    rows, valid = suffix_rows(seq_len, start, N)
    # Head-mean rows of the trailing `rows` queries, from the whole causal matrix the official code builds.
    pad = (seq_len - mask.sum(1)).tolist()
    full = []
    for b in range(batch):
        heads = []
        for h in range(HEADS):
            logits = query[b, h] @ keys[b, h // (HEADS // KV_HEADS)].T / math.sqrt(HEAD_DIM)
            allowed = torch.ones(seq_len, seq_len, dtype=torch.bool).tril()
            allowed[:, :pad[b]] = False
            allowed[:pad[b], :pad[b]] = torch.eye(pad[b], dtype=torch.bool)  # padded rows: anything finite
            heads.append(torch.softmax(logits.masked_fill(~allowed, float("-inf")), dim=-1))
        full.append(torch.stack(heads).mean(0))
    attention = torch.stack(full)
    scores = sparsevlm_scores(attention[:, seq_len - rows:], raters, start, N)
    out = sparsevlm_reduce(hidden, scores, 7, start, N, positions, mask)
    for b in range(batch):
        s = int(start[b])
        ref_raters = _reference_raters(hidden[b], s)
        got_raters = [seq_len - rows + i for i in range(rows) if raters[b, i]]
        assert got_raters == ref_raters
        ref_scores = attention[b][ref_raters][:, s:s + N].mean(0)
        assert torch.allclose(scores[b], ref_scores)
        kept = _top_set(ref_scores.tolist(), 7)
        assert out.kept_visual[b].tolist() == kept
        pruned = [i for i in range(N) if i not in kept]
        recycled_count = int(0.3 * len(pruned)) + 1
        recycled = sorted(pruned, key=lambda i: (-float(ref_scores[i]), i))[:recycled_count]  # by score, as topk
        clusters = int(recycled_count / 10) + 1
        tokens = hidden[b, [s + i for i in recycled]]
        expected = torch.stack([tokens[m].mean(0) for m in _reference_dpc(tokens, clusters)])
        assert torch.allclose(out.hidden[b, s + 7:s + 7 + clusters], expected)
        assert out.num_visual == 7 + clusters
    assert torch.equal(valid, raters | valid)


def test_dpc_knn_groups_separated_blobs():
    gen = torch.Generator().manual_seed(0)
    centers = torch.tensor([[0.0] * 4, [10.0] * 4, [-10.0, 10.0, -10.0, 10.0]])
    points = torch.cat([c + 0.01 * torch.randn(5, 4, generator=gen) for c in centers]).unsqueeze(0)
    merged = dpc_knn_merge(points, 3)[0]
    for c in centers:
        assert min(float(torch.linalg.vector_norm(m - c)) for m in merged) < 0.05


def test_sparsevlm_batch_equals_samples_alone():
    hidden, keys, query, mask, positions, start = _batch([(2, 6), (5, 4)], N, seed=7)
    seq_len = hidden.shape[1]
    rows, _ = suffix_rows(seq_len, start, N)
    rows_attention = torch.softmax(torch.randn(2, rows, seq_len, dtype=torch.float64), dim=-1)
    raters = select_raters(hidden, start, N)
    out = sparsevlm_reduce(hidden, sparsevlm_scores(rows_attention, raters, start, N), 5, start, N, positions, mask)
    pad = (seq_len - mask.sum(1)).tolist()
    for b in range(2):
        p = pad[b]
        h, st = _alone(hidden, b, p), start[b:b + 1] - p
        rows_b, _ = suffix_rows(h.shape[1], st, N)
        attn_b = _alone(rows_attention[:, rows - rows_b:], b, p, dim=2)
        sc = sparsevlm_scores(attn_b, select_raters(h, st, N), st, N)
        alone = sparsevlm_reduce(h, sc, 5, st, N, _alone(positions, b, p))
        assert torch.allclose(out.hidden[b, p:], alone.hidden[0], atol=1e-12)
        assert torch.equal(out.position_ids[b, p:], alone.position_ids[0])


# ---- DART --------------------------------------------------------------------------------------------------------

def test_cpython_set_order_is_the_interpreters():
    rng = random.Random(0)
    for _ in range(3000):
        values = [rng.randint(0, rng.choice([16, 700, 5000])) for _ in range(rng.randint(1, 12))]
        assert cpython_set_order(values) == list(set(values))


def _reference_dart(keys_b, normed_b, start, suffix_from, max_num_trunction, n=N):
    """The official get_retained_image_token, batch 1, with Python sets and lists."""
    image_norm = keys_b[start:start + n].abs().sum(-1)
    text_norm = keys_b[suffix_from:].abs().sum(-1)
    image_idx = [start + int(i) for i in torch.sort(image_norm, descending=True, stable=True).indices[:4]]
    text_idx = [suffix_from + int(i) for i in torch.sort(text_norm, descending=True, stable=True).indices[:4]]
    per_pivot = max_num_trunction // 8
    retained = set(image_idx + text_idx)
    valid = set(range(start, start + n)) - set(image_idx)
    for item in list(retained):
        valid_list = sorted(valid)
        sim = -torch.nn.functional.cosine_similarity(normed_b[item], normed_b[valid_list], dim=-1)
        picks = [valid_list[i] for i in torch.sort(sim, descending=True, stable=True).indices[:per_pivot]]
        retained.update(picks)
        valid.difference_update(picks)
    retained.difference_update(text_idx)
    return sorted(i - start for i in retained)


def test_dart_matches_the_official_greedy_unpadded():
    # Unpadded samples, where the official code's absolute positions are the position ids. With 40 image
    # tokens and 4 picks per pivot the pivots compete for candidates, so the set's order matters.
    n, order_mattered = 40, False
    for seed, (prefix, suffix) in enumerate([(5, 9), (35, 12), (3, 6), (20, 7), (9, 30)]):
        hidden, keys, _, mask, positions, start = _batch([(prefix, suffix)], n, seed=seed)
        flat = keys.transpose(1, 2).reshape(1, hidden.shape[1], -1)
        kept = dart_select(flat, hidden, start, n, positions, max_num_trunction=32)
        assert kept[0].tolist() == _reference_dart(flat[0], hidden[0], prefix, prefix + n, 32, n)
        assert kept.shape[1] == 4 + 8 * (32 // 8)
        by_score = dart_select(flat, hidden, start, n, positions, max_num_trunction=32, pivot_order="score")
        order_mattered |= not torch.equal(kept, by_score)
    assert order_mattered, "no case where the pivot order changes the result: the test would not see it"


def test_dart_batch_equals_samples_alone():
    hidden, keys, _, mask, positions, start = _batch([(2, 6), (5, 4), (1, 8)], N, seed=11)
    flat = keys.transpose(1, 2).reshape(3, hidden.shape[1], -1)
    out = dart_reduce(hidden, flat, hidden, start, N, positions, max_num_trunction=4, attention_mask=mask)
    pad = (hidden.shape[1] - mask.sum(1)).tolist()
    for b in range(3):
        p = pad[b]
        alone = dart_reduce(_alone(hidden, b, p), _alone(flat, b, p), _alone(hidden, b, p), start[b:b + 1] - p, N,
                            _alone(positions, b, p), max_num_trunction=4)
        assert torch.equal(out.hidden[b, p:], alone.hidden[0])
        assert torch.equal(out.position_ids[b, p:], alone.position_ids[0])


# ---- the accountant and the functions agree ------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["fastv", "pdrop", "sparsevlm", "dart"])
@pytest.mark.parametrize("keep", [None, 192, 128, 64])
def test_per_layer_tokens_equal_the_functions_step_by_step(name, keep, arch_of):
    """Run each step's tensor function on a 7B-shaped token count (tiny width) and compare every layer's
    sequence length with the accountant's plan."""
    arch = arch_of("llava-1.5-7b")
    schedule = acc.resolve_schedule(arch, name, acc.CountOptions(), keep=keep)
    plan = acc.plan_tokens(arch, schedule)
    gen = torch.Generator().manual_seed(0)
    text, prefix = plan.text_tokens, 5
    seq = prefix + arch.visual_tokens + text - prefix
    hidden = torch.randn(1, seq, 8, generator=gen)
    positions = torch.arange(seq).unsqueeze(0)
    start, visual = torch.tensor([prefix]), arch.visual_tokens
    steps = {r.layer: r for r in schedule.removals}
    settings = schedule.settings_dict()
    stage = 0
    for layer in range(arch.decoder.layers):
        if layer in steps:
            scores = torch.rand(1, visual, generator=gen)
            step = steps[layer]
            if name == "fastv":
                out = fastv_reduce(hidden, scores, visual - step.remove, start, visual, positions)
            elif name == "pdrop":
                keep_count = pdrop_keep(arch.visual_tokens, settings["ratio"], stage)
                out = pdrop_reduce(hidden, scores, keep_count, start, visual, positions)
            elif name == "sparsevlm":
                out = sparsevlm_reduce(hidden, scores, settings["keeps"][stage], start, visual, positions)
            else:
                keys = torch.randn(1, hidden.shape[1], 8, generator=gen)
                out = dart_reduce(hidden, keys, hidden, start, visual, positions,
                                  max_num_trunction=settings["max_num_trunction"])
            hidden, positions, visual = out.hidden, out.position_ids, out.num_visual
            stage += 1
        assert (hidden.shape[1], hidden.shape[1]) == plan.llm[layer], f"layer {layer}"
        assert plan.llm_visual[layer][0] == visual
    assert visual == plan.visual_tokens


def test_empty_schedule_plans_like_vanilla(arch_of):
    arch = arch_of("llava-1.5-7b")
    for name in ("fastv", "dart"):
        full = acc.method_schedule(arch, name, 576) if name == "dart" else acc.resolve_schedule(
            arch, name, acc.CountOptions(), schedule="2:0")
        assert full.removals == ()
        assert acc.plan_tokens(arch, full).llm == acc.plan_tokens(arch, acc.Schedule("vanilla")).llm


# ---- visual-macs: the figures the papers print ---------------------------------------------------------------------

def _visual_macs(name: str, keep: int | None = None) -> acc.CostRow:
    arch = acc.architecture(load_profile("llava-1.5-7b"))
    opts = acc.CountOptions(convention="visual-macs")
    return acc.account(arch, acc.resolve_schedule(arch, name, opts, keep=keep), acc.make_quant("fp16", None), opts)


def test_visual_macs_reproduces_pdrops_table():
    # PDrop's table: 3.82 T vanilla, 1.78 T PDrop (visual tokens only, 4nd^2 + 2n^2d + 3ndm, 32 layers).
    assert round(_visual_macs("vanilla").tflops, 2) == 3.82
    row = _visual_macs("pdrop")
    assert round(row.tflops, 2) == 1.78
    assert row.plan.layer_average_visual_tokens == 270


@pytest.mark.parametrize(("name", "keep", "average", "final", "tmacs"), [
    ("fastv", 192, 191.6, 166, 1.253), ("fastv", 128, 127.9, 98, 0.836), ("fastv", 64, 64.1, 30, 0.421),
    ("sparsevlm", 192, 206.5, 113, 1.353), ("sparsevlm", 128, 145.4, 39, 0.954), ("sparsevlm", 64, 82.3, 18, 0.541),
    ("dart", 128, 159.8, 132, 1.044),
])
def test_literature_rows_layer_average_final_and_visual_macs(name, keep, average, final, tmacs):
    row = _visual_macs(name, keep)
    assert row.plan.layer_average_visual_tokens == pytest.approx(average, abs=0.051)  # BASELINES prints one decimal
    assert row.plan.visual_tokens == final
    assert round(row.tflops, 3) == tmacs


def test_visual_macs_defines_the_decoder_only():
    with pytest.raises(FicocoError, match="decoder only"):
        acc.CountOptions(convention="visual-macs", scope="all")


# ---- registry and layering -----------------------------------------------------------------------------------------

def test_registry_and_accountant_import_no_torch():
    code = ("import sys, ficoco.methods, ficoco.accounting, ficoco.accounting.methods; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_every_method_loads_its_entry_point():
    for spec in METHODS.values():
        assert callable(spec.entry_point())


def test_a_method_refuses_families_it_is_not_defined_on(arch_of):
    arch = arch_of("qwen2-vl-7b")
    with pytest.raises(Exception, match="PruMerge\\+ is defined on llava, llava_next, video_llava, internvl models"):
        acc.resolve_schedule(arch, "prumerge", acc.CountOptions(), keep=128)


def test_sparsevlm_keeps_only_published_schedules_and_budgets_pick_among_them(arch_of):
    arch = arch_of("llava-1.5-7b")
    with pytest.raises(Exception, match="v1.5 schedules exist for"):
        acc.resolve_schedule(arch, "sparsevlm", acc.CountOptions(), keep=150)
    budget = acc.resolve_schedule(arch, "sparsevlm", acc.CountOptions(), tflops=3.3)
    assert budget.settings_dict()["keeps"] == [303, 110, 36]  # "192" costs 3.54 TFLOPs, "128" 2.72


@pytest.mark.parametrize("name", ["fastv", "pdrop", "dart"])
def test_a_budget_keeps_the_most_tokens_that_fit(name, arch_of):
    arch = arch_of("llava-1.5-7b")
    opts = acc.CountOptions()
    schedule = acc.resolve_schedule(arch, name, opts, tflops=3.3)
    cost = acc.account(arch, schedule, acc.make_quant("fp16", None), opts).tflops
    assert cost <= 3.3
    keep = int(round(acc.plan_tokens(arch, schedule).layer_average_visual_tokens))
    richer = acc.method_schedule(arch, name, keep + 8)
    assert acc.account(arch, richer, acc.make_quant("fp16", None), opts).tflops > 3.3
