"""MustDrop's official rule, re-stated here and checked against ficoco on a tiny LLaVA-1.5 (issue 53).

Official code: liuting20/MustDrop @ 909afa5 (SparseVLM-derived), llava/model/:

- multimodal_encoder/clip_encoder.py:110-112: CLIP layer 0's output goes through ``conditional_pooling(hidden,
  0.8, (3, 3))`` and ``merge_wavg`` (multimodal_encoder/local_merge.py:30-146): the patches ([CLS] apart, :43) are
  cut into 3 x 3 windows (:49-55, windows and their patches row-major); a window's score is the sum of its
  ``F.cosine_similarity`` matrix with the diagonal zeroed, over 9 x 8 (:63-70); ``r = (score >= 0.8).sum(1).min()``
  over the batch (:79); ``topk(r)`` windows (:83); each window's first 8 patches are summed onto its last (:114-116,
  :125-128, sizes all 1, ``x / size``: the mean); the tokens go on as ``[CLS, merged, the rest sorted]`` (:113,
  :129-130); the sizes are dropped (clip_encoder.py:112).
- clip_encoder.py:86-108: at layer 23 (the last), ``attn[:, :, 0, 1:].mean(1)`` (eager probabilities) and its
  ``topk(ceil(0.08 (N - 1)))``, N the layer's tokens: the key set, indices of the tokens the projector maps
  (hidden_states[-2], the merged order).
- language_model/modelling_sparse_llama.py:235-266, :336-350: after decoder layers 2, 6, 10, 14 (:103) the layer's
  eager attention, text rows (everything after the image) x image columns, head mean: a token is dropped iff
  ``sum_rows < global_thr * sum_all`` and ``max_rows < individual_thr``; the key set is unioned back, in order
  (``torch.unique``); the layer's output is cut to the kept rows, positions truncated (compacted).

ficoco runs its defaults (the official rule: ``window_count="batch"``, ``attention_scores="model"``). The tower's
first check reads the unpatched tower (layer 0's output); the key set and the decoder's filter depend on the merge,
so they are recomputed from what the patched model's layers ran on. The tiny tower has no position embedding (zeroed)
and images with near-uniform windows, so that some windows score above 0.8 and the rest near 0; its decoder's
queries are scaled up, so that the text attends unevenly enough for the thresholds to decide.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from rule_support import decoder, fails_when, own_query_key, probabilities, rotary, watch_layers
from rule_support_vision import tower_layers, unpatched_tower
from torch import Tensor, nn

import ficoco
import ficoco.methods.mustdrop.ops as mustdrop_ops
from ficoco.models import synthetic_inputs

SIDE = 9  # patches per row: a 126-pixel image of 14-pixel patches, 3 x 3 windows of 3 x 3
START, TEXT = 5, 12
GAP = 1e-5  # what decides a comparison here: rounding between these recomputations and ficoco's stays far below
# Per image, the windows (row, col) made near-uniform: image 0 has 2, image 1 has 3 (the batch merges 2 each).
UNIFORM = ((0, 0), (1, 1)), ((0, 0), (1, 2), (2, 2))


@pytest.fixture(scope="module")
def model() -> Iterator[nn.Module]:
    built = ficoco.build_model("llava-tiny", dtype="fp32", overrides=[
        "vision_config.image_size=126", f"image_seq_length={SIDE * SIDE}"])
    built.model.vision_tower.embeddings.position_embedding.weight.data.zero_()
    for layer in decoder(built).layers:  # sharper decoder attention: the text attends unevenly to the image
        layer.self_attn.q_proj.weight.data.mul_(30)
    yield built


def images(model: nn.Module, batch: int, seed: int) -> dict[str, Tensor]:
    """Synthetic prompts whose images have the windows of `UNIFORM` near-uniform (one colour, small noise)."""
    inputs = synthetic_inputs(model, batch=batch, text_tokens=TEXT, seed=seed)
    pixels = inputs["pixel_values"]
    generator = torch.Generator().manual_seed(seed)
    size = 3 * 14
    for b in range(batch):
        for row, col in UNIFORM[(b + seed) % 2]:
            block = pixels[b, :, row * size:(row + 1) * size, col * size:(col + 1) * size]
            block.copy_(block[:, :1, :1] + 0.1 * torch.randn(block.shape, generator=generator))
    return inputs


def decided(values: Tensor, bound: float | Tensor, what: str) -> None:
    """No value sits within `GAP` (relative) of its bound: else these inputs do not decide the rule (RuntimeError,
    not AssertionError, so that a deliberate break cannot pass on it)."""
    bound = torch.as_tensor(bound, dtype=values.dtype)
    scale = max(float(values.abs().max()), float(bound.abs().max()), 1e-12)
    if bool(((values - bound).abs() <= GAP * scale).any()):
        raise RuntimeError(f"these inputs put a {what} on its threshold; pick other inputs")


# ---- the window merge at layer 0's output ------------------------------------------------------------------------

def official_merge(hidden: Tensor, threshold: float) -> tuple[Tensor, list[list[int]], list[list[int]]]:
    """`conditional_pooling` + `merge_wavg` on layer 0's output ``(B, 1 + N, D)``: the merged sequence, and per item
    the patch each output token continues (a merged window's last patch) and the patches merged away."""
    cls, feat = hidden[:, :1], hidden[:, 1:]
    batch, count, width = feat.shape
    cells = SIDE // 3
    # 'b (h w) c -> b c h w', then 'b c (gh ps_h) (gw ps_w) -> b gh gw c ps_h ps_w', flattened per window.
    grid = feat.reshape(batch, SIDE, SIDE, width).permute(0, 3, 1, 2)
    windows = grid.reshape(batch, width, cells, 3, cells, 3).permute(0, 2, 4, 1, 3, 5).reshape(batch, cells, cells,
                                                                                              width, 9)
    sims = F.cosine_similarity(windows.unsqueeze(-1), windows.unsqueeze(-2), dim=3) * (1 - torch.eye(9))
    score = (sims.sum(-1).sum(-1) / (9 * 8)).reshape(batch, -1)
    decided(score, threshold, "window score")
    r = int((score >= threshold).sum(dim=1).min())
    patch = torch.arange(count).reshape(SIDE, SIDE).unfold(0, 3, 3).unfold(1, 3, 3).reshape(-1, 9)
    out, kept, discarded = [], [], []
    for b in range(batch):
        ranked = score[b].sort(descending=True).values
        if 0 < r < ranked.numel():
            assert float(ranked[r - 1] - ranked[r]) > GAP, "a tie at the top-r cut: pick other inputs"
        chosen = score[b].topk(r).indices.tolist()
        merged = [feat[b, patch[w]].sum(dim=0) / 9 for w in chosen]
        rest = sorted(set(range(count)) - {int(p) for w in chosen for p in patch[w]})
        out.append(torch.cat([cls[b], torch.stack(merged) if merged else feat[b, :0], feat[b, rest]]))
        kept.append([int(patch[w][-1]) for w in chosen] + rest)
        discarded.append([int(p) for w in chosen for p in patch[w][:-1]])
    return torch.stack(out), kept, discarded


@contextlib.contextmanager
def tower_inputs(model: nn.Module, indices: list[int]) -> Iterator[dict[int, Tensor]]:
    """What tower layers `indices` ran on (their first norm's input) in the forwards inside the block."""
    seen: dict[int, Tensor] = {}
    layers = tower_layers(model)
    hooks = [layers[i].layer_norm1.register_forward_pre_hook(
        lambda _m, args, i=i: seen.__setitem__(i, args[0].detach().clone())) for i in indices]
    try:
        yield seen
    finally:
        for hook in hooks:
            hook.remove()


def check_merge(model: nn.Module, threshold: float, seed: int) -> None:
    inputs = images(model, batch=2, seed=seed)
    tower = unpatched_tower(model, inputs["pixel_values"])
    expected, kept, discarded = official_merge(tower.hidden_states[1], threshold)
    merged = (len(tower.hidden_states[1][0]) - len(expected[0])) // 8
    # The official default thresholds drop nothing in the decoder: the two prompts keep one count.
    with torch.no_grad(), tower_inputs(model, [1]) as seen, \
            ficoco.apply(model, "mustdrop", window_threshold=threshold) as handle:
        model(**inputs)
        record = next(r for r in handle.records if r.stage == "vision" and r.layer == 1)
    torch.testing.assert_close(seen[1], expected, rtol=1e-5, atol=1e-5)
    assert record.kept.tolist() == kept
    assert record.discarded.tolist() == discarded
    assert record.merged_into.tolist() == [[k for k in item[:merged] for _ in range(8)] for item in kept]


@pytest.mark.parametrize(("threshold", "seed"), [(0.8, 0), (0.8, 1), (0.9, 1)])
def test_mustdrop_merges_the_fewest_uniform_windows_of_the_batch_into_their_means_merged_first(
        model: nn.Module, threshold: float, seed: int) -> None:
    check_merge(model, threshold, seed)


def test_the_mustdrop_merge_check_fails_when_each_image_merges_the_most_windows_of_the_batch(
        model: nn.Module, monkeypatch: pytest.MonkeyPatch) -> None:
    def most(counts: Tensor, window_count: str = "batch") -> int:
        return int(counts.max())

    fails_when(monkeypatch, mustdrop_ops, "windows_to_merge", most, lambda: check_merge(model, 0.8, 0))


# ---- the key set at the last tower layer, and the dual-attention filter in the decoder --------------------------

def official_key_set(model: nn.Module, ran_on: Tensor, ratio: float = 0.08) -> set[int]:
    """The last tower layer's eager [CLS] row, head mean, over the tokens it ran on (``(1, T, D)``): its
    ``ceil(0.08 (T - 1))`` largest, as indices of the tokens the projector maps."""
    layer = tower_layers(model)[-1]
    attention = layer.self_attn
    with torch.no_grad():
        normed = layer.layer_norm1(ran_on)
        batch, tokens, _ = normed.shape
        heads, dim = attention.num_heads, attention.head_dim
        query = attention.q_proj(normed).view(batch, tokens, heads, dim).transpose(1, 2)
        key = attention.k_proj(normed).view(batch, tokens, heads, dim).transpose(1, 2)
        row = torch.softmax(query @ key.transpose(-1, -2) * attention.scale, dim=-1)[0, :, 0, 1:].mean(dim=0)
    size = math.ceil(ratio * (tokens - 1))
    ranked = row.sort(descending=True).values
    if size < ranked.numel() and float(ranked[size - 1] - ranked[size]) <= GAP * float(ranked[0]):
        raise RuntimeError("a tie at the key set's cut: pick other inputs")
    return set(row.topk(size).indices.tolist())


def check_filter(model: nn.Module, setting: dict, seed: int) -> None:
    inputs = images(model, batch=1, seed=seed)
    layers = setting.get("layers", (2,))
    steps = [layer + 1 for layer in layers if layer + 1 < len(decoder(model).layers)]
    last = len(tower_layers(model)) - 1
    with torch.no_grad(), tower_inputs(model, [last]) as tower, \
            watch_layers(model, sorted(set(layers) | set(steps))) as seen, \
            ficoco.apply(model, "mustdrop", **setting) as handle:
        model(**inputs)
        records = [r for r in handle.records if r.stage == "llm"]
        settings = handle.schedule.settings_dict()
    global_thr, individual_thr = settings["global_thr"], settings["individual_thr"]
    key_set = official_key_set(model, tower[last])
    ranks = list(range(tower[last].shape[1] - 1))  # the span as the LLM received it: the merged order
    assert [r.layer for r in records] == steps
    for step, record in zip(steps, records, strict=True):
        ran_on = seen[step - 1].ran_on  # what the pruning layer ran on: its attention
        length, visual = ran_on.shape[1], len(ranks)
        cos, sin = rotary(model, ran_on, torch.arange(length).unsqueeze(0))
        query, key = own_query_key(decoder(model).layers[step - 1], ran_on, cos, sin)
        block = probabilities(query, key)[0][:, START + visual:, START:START + visual].mean(dim=0)  # text x image
        column_sum, column_max = block.sum(dim=0), block.max(dim=0).values
        decided(column_sum, column_sum.sum() * global_thr, "column sum")
        decided(column_max, individual_thr, "column maximum")
        dropped = (column_sum < column_sum.sum() * global_thr) & (column_max < individual_thr)
        kept = sorted({i for i in range(visual) if not dropped[i]} | {i for i, r in enumerate(ranks) if r in key_set})
        ranks = [ranks[i] for i in kept]
        assert record.kept[0].tolist() == ranks, f"layer {step}"
        # The next layer runs on the pruning layer's output cut to the kept rows, at compacted positions.
        received = seen[step].received[0]
        assert torch.equal(seen[step].ran_on[0, START:START + len(kept)], received[[START + i for i in kept]])
        assert seen[step].ran_on.shape[1] == length - visual + len(kept)
        compact, _ = rotary(model, received[None], torch.arange(seen[step].ran_on.shape[1]).unsqueeze(0))
        assert torch.equal(seen[step].rotary[0], compact)


FILTERS = [
    ({"global_thr": 1.0, "individual_thr": 1.0}, 0),  # every token below both: the key set alone stays
    ({"global_thr": 0.012, "individual_thr": 0.012, "layers": (1, 2)}, 0),  # two pruning layers
    ({"global_thr": 0.014, "individual_thr": 0.015, "layers": (1, 2)}, 1),
    ({"global_thr": 0.014, "individual_thr": 0.02}, 0),
    ({"preset": 64}, 0),  # TextVQA's 64-token row (0.011 / 0.01)
]


@pytest.mark.parametrize(("setting", "seed"), FILTERS)
def test_mustdrop_drops_the_visual_tokens_the_text_attends_to_little_in_sum_and_at_most_and_keeps_the_key_set(
        model: nn.Module, setting: dict, seed: int) -> None:
    check_filter(model, setting, seed)


def test_the_mustdrop_filter_check_fails_when_the_key_set_is_not_kept(
        model: nn.Module, monkeypatch: pytest.MonkeyPatch) -> None:
    original = mustdrop_ops.dual_attention_keep

    def without_key_set(*args: object, **kwargs: object) -> Tensor:
        return original(*args[:6])  # type: ignore[arg-type]

    fails_when(monkeypatch, mustdrop_ops, "dual_attention_keep", without_key_set,
               lambda: check_filter(model, *FILTERS[3]))


def test_the_mustdrop_filter_check_fails_when_the_key_set_is_rounded_down(
        model: nn.Module, monkeypatch: pytest.MonkeyPatch) -> None:
    fails_when(monkeypatch, mustdrop_ops, "key_set_size", lambda patches, ratio: int(ratio * patches),
               lambda: check_filter(model, *FILTERS[0]))


def test_the_mustdrop_filter_check_fails_when_either_threshold_drops(
        model: nn.Module, monkeypatch: pytest.MonkeyPatch) -> None:
    original = mustdrop_ops.dual_attention_keep

    def either(rows: Tensor, valid: Tensor, start: Tensor, count: int, global_thr: float, individual_thr: float,
               protected: Tensor | None = None) -> Tensor:
        by_sum = original(rows, valid, start, count, global_thr, 1e9, protected)
        by_max = original(rows, valid, start, count, 1e9, individual_thr, protected)
        return by_sum & by_max  # dropped by either test alone, where the official drops by both

    fails_when(monkeypatch, mustdrop_ops, "dual_attention_keep", either, lambda: check_filter(model, *FILTERS[2]))
