"""VScan's official rule, re-stated here in plain torch from its official code, against ficoco's run.

Official code: Tencent/SelfEvolvingAgent @ a82450e, folder VScan/.

- LLaVA, stage 1 (llava/model/llava_arch.py:199-293, llava/model/multimodal_encoder/clip_encoder.py:38-44): CLIP runs
  with ``output_attentions=True``; every layer's [CLS] row over the patches (``attentions[:, :, :, 0, 1:]``), heads
  averaged (:256); the local scan on ``image_attentions[5]``, the global scan on ``image_attentions[-2]`` (:267-268);
  ``window_cls_selection`` (:199-252) takes the top ``k = int(T * 0.5) // windows`` of every ``window_size`` x
  ``window_size`` window (6 on the 24 x 24 grid); the global scan zeroes the local picks and takes ``topk(T -
  int(T * 0.5))`` (:277-279); a boolean mask of both (:284-285); every patch projected, every unkept one added to its
  most cosine-similar kept one, which becomes their mean (``token_merging``, :142-197, scaling 1).
- LLaVA, stage 2 (llava/model/modeling_llama_x.py:1228-1256, :1320-1509): after decoder layer ``rank_layer - 1``,
  the rank layer's own ``input_layernorm``, ``q_proj`` and ``k_proj`` on the sequence entering it, RoPE at its
  positions (:1372-1374), the causal mask (:1378), the last instruction token's row (``prompt_len + image_tokens -
  1``, :1422-1424: the last prompt token), softmax in float32, heads averaged, the image columns, ``topk(keep)``
  sorted (:1427-1451); the sequence [prefix, kept, suffix] at positions ``arange`` (:1490).
- Qwen2.5-VL, stage 1 (qwen/model/qwen2_5_vl_custom.py:127-174, :338-391, :465-517; qwen2_5_vl_utils.py:97-193):
  the tower's blocks in window order; the first full-attention block (``fullatt_block_indexes[0]``) and the last
  block return ``softmax(q k^T / sqrt(d))`` of their post-rotary q and k with the block's own segments as the mask
  (``cu_seqlens``: windows in a window block); summed over heads, averaged over every query, averaged over each merge
  unit's 4 patches, window order undone; ``num_keep = int(ratio * n)``; ``window_selection`` walks the units by
  descending local score and takes one while its 4 x 4 window (edge rows and columns joining the last) holds fewer
  than ``ceil(num_keep // 2 / windows)``; the global scan zeroes those and takes ``topk(num_keep - num_keep // 2)``;
  both sorted; ``token_merging`` on the merger's output in grid order.
- Qwen2.5-VL, stage 2 (qwen2_5_vl_custom.py:626-653, :691-785): the rank layer's own norm, q and k **without RoPE**
  (:723-726 commented out), key heads repeated, the last token's row, no mask, softmax, heads averaged, the image
  columns, ``topk(next)`` sorted; the kept tokens keep their position ids (:775).

The quantities are taken from the unpatched model (stage 1: eager attention with ``output_attentions=True`` on CLIP,
each block's own qkv and rotary table on Qwen) or, for stage 2, from what the patched model's rank layer received
(a hook), the rule recomputed from that layer's weights. Tiny profiles, fp32, seeded random weights; several budgets
and window sizes. Deliberate breaks of ficoco's method (a window count, a RoPE rule, the merge) must fail the checks.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from helpers import forward_with_hooks
from rule_support import decoder, fails_when, rotary, watch_layers
from rule_support_vision import patched_run, unpatched_projector, unpatched_tower
from torch import Tensor, nn

import ficoco
import ficoco.methods.vscan as vscan_spec
from ficoco.methods.vscan import ops as vscan_ops
from ficoco.models import llm_steps, synthetic_inputs
from ficoco.models.qwen2_vl.adapter import Qwen2VLAdapter

TEXT = 12


@pytest.fixture(scope="module")
def llava() -> nn.Module:
    return ficoco.build_model("llava-tiny", dtype="fp32")


@pytest.fixture(scope="module")
def qwen25() -> nn.Module:
    return ficoco.build_model("qwen2.5-vl-tiny", dtype="fp32")


def decided(scores: Tensor, k: int, gap: float = 1e-6) -> None:
    """The top `k` of `scores` ``(N,)`` stand apart from the rest (else the inputs do not decide the rule)."""
    if 0 < k < scores.numel():
        ranked = scores.sort(descending=True).values
        if not float(ranked[k - 1] - ranked[k]) > gap * float(ranked[0].abs()):
            raise RuntimeError(f"a near-tie at the top {k}: choose other inputs")


# ---- the official rule, written from the official code ---------------------------------------------------------

def window_cls_selection(image_attentions: Tensor, visual_token_num: int, side: int, window_size: int) -> Tensor:
    """llava_arch.py:199-252 on a `side` x `side` grid (the official code asserts 24 x 24)."""
    B, N = image_attentions.shape
    H = W = side
    attn_map = image_attentions.view(B, H, W)
    num_windows_h, num_windows_w = H // window_size, W // window_size
    k = visual_token_num // (num_windows_h * num_windows_w)
    token_indices = []
    for b in range(B):
        indices_b = []
        for i in range(num_windows_h):
            for j in range(num_windows_w):
                window = attn_map[b, i * window_size:(i + 1) * window_size, j * window_size:(j + 1) * window_size]
                window_flat = window.reshape(-1)
                decided(window_flat, k)
                for idx in torch.topk(window_flat, k)[1]:
                    dy, dx = divmod(idx.item(), window_size)
                    indices_b.append((i * window_size + dy) * W + j * window_size + dx)
        token_indices.append(indices_b)
    return torch.tensor(token_indices, dtype=torch.long)


def token_merging(image_features: Tensor, index_mask: Tensor) -> Tensor:
    """llava_arch.py:142-197 (scaling 1): the retained tokens, each the mean of itself and the tokens nearest it."""
    B, N, D = image_features.shape
    retained = torch.stack([image_features[b][index_mask[b]] for b in range(B)])
    non_retained = torch.stack([image_features[b][~index_mask[b]] for b in range(B)])
    if non_retained.shape[1] == 0:
        return retained
    cosine_sim = F.cosine_similarity(non_retained.unsqueeze(2), retained.unsqueeze(1), dim=3)
    nearest = cosine_sim.argmax(dim=2)
    merge_count = torch.zeros(B, retained.shape[1], dtype=torch.int)
    merged = retained.clone()
    merged.scatter_add_(1, nearest.unsqueeze(-1).expand(-1, -1, D), non_retained)
    merge_count.scatter_add_(1, nearest, torch.ones_like(nearest, dtype=torch.int))
    return merged / (1 + merge_count.unsqueeze(2))


@torch.no_grad()
def official_llava_stage_one(model: nn.Module, pixel_values: Tensor, visual_token_num: int, local_layer: int,
                             window_size: int) -> tuple[Tensor, Tensor]:
    """encode_images (llava_arch.py:254-293): the index mask ``(B, N)`` and the LLM's visual tokens ``(B, K, D)``."""
    tower = unpatched_tower(model, pixel_values)
    image_attentions = torch.stack(tower.attentions, dim=0)[:, :, :, 0, 1:].mean(dim=2)  # (layers, B, N)
    image_features = tower.hidden_states[model.config.vision_feature_layer][:, 1:]
    B, N = image_features.shape[:2]
    side = math.isqrt(N)
    shallow, deep = image_attentions[local_layer], image_attentions[-2].clone()
    local_indices = window_cls_selection(shallow, int(visual_token_num * 0.5), side, window_size)
    for b in range(B):
        deep[b, local_indices[b]] = 0
    global_count = visual_token_num - int(visual_token_num * 0.5)
    for b in range(B):
        decided(deep[b], global_count)
    global_indices = torch.topk(deep, k=global_count, dim=1)[1]
    index_mask = torch.zeros(B, N, dtype=torch.bool)
    index_mask.scatter_(1, torch.cat((local_indices, global_indices), dim=1), True)
    merged = token_merging(unpatched_projector(model, image_features), index_mask)
    return index_mask, merged


@torch.no_grad()
def last_row_attention(layer: nn.Module, entering: Tensor, cos: Tensor | None, sin: Tensor | None) -> Tensor:
    """modeling_llama_x.py:1351-1443 / qwen2_5_vl_custom.py:705-758: the rank layer's own norm, q and k (RoPE where
    tables are given), the last row softmaxed over every key, heads averaged: ``(B, T)``."""
    attention = layer.self_attn
    hidden = layer.input_layernorm(entering)
    bsz, q_len, _ = hidden.shape
    head_dim = attention.head_dim
    query = attention.q_proj(hidden).view(bsz, q_len, -1, head_dim).transpose(1, 2)
    key = attention.k_proj(hidden).view(bsz, q_len, -1, head_dim).transpose(1, 2)
    if cos is not None:
        def turn(x: Tensor) -> Tensor:
            half = x.shape[-1] // 2
            return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

        query = query * cos.unsqueeze(1) + turn(query) * sin.unsqueeze(1)
        key = key * cos.unsqueeze(1) + turn(key) * sin.unsqueeze(1)
    key = key.repeat_interleave(query.shape[1] // key.shape[1], dim=1)  # repeat_kv
    weights = torch.matmul(query[:, :, -1:], key.transpose(2, 3)) / math.sqrt(head_dim)
    return F.softmax(weights, dim=-1, dtype=torch.float32).mean(dim=1)[:, 0]


def official_rank(row: Tensor, start: int, image_tokens: int, keep: int) -> list[int]:
    """``topk(keep)`` of the image columns of a last row, sorted (modeling_llama_x.py:1441-1451)."""
    scores = row[start:start + image_tokens]
    decided(scores, keep)
    return sorted(scores.topk(keep).indices.tolist())


# ---- LLaVA ----------------------------------------------------------------------------------------------------

LLAVA_START = 5  # the tiny LLaVA prompt's image span starts here


def check_llava(model: nn.Module, keep: int, window_size: int, seed: int) -> None:
    inputs = synthetic_inputs(model, batch=2, text_tokens=TEXT, seed=seed)
    setting = {"keep": keep, "window_size": window_size, "local_layer": 2}
    run = patched_run(model, inputs, "vscan", **setting)
    visual_token_num = run.settings["keep"]
    assert visual_token_num == (3 * keep + 1) // 2  # the --keep rule: T = round(3N / 2)
    index_mask, merged = official_llava_stage_one(model, inputs["pixel_values"], visual_token_num, 2, window_size)
    vision = run.records[0]
    assert vision.stage == "vision"
    assert [row.tolist() for row in vision.kept] == [mask.nonzero()[:, 0].tolist() for mask in index_mask]
    torch.testing.assert_close(run.llm_visual, merged, rtol=1e-5, atol=1e-5)
    # Stage 2, at the middle layer, on what the patched rank layer received, sample by sample (the official batch 1).
    layer = len(decoder(model).layers) // 2  # 16 of LLaVA-1.5's 32
    reaching = int(index_mask[0].sum())
    llm_keep = min(run.settings["llm_keep"], reaching)  # keep_length = min(image_token_list[1], image tokens)
    assert llm_keep == (visual_token_num + 1) // 3  # the --keep rule: a third of T
    with torch.no_grad(), ficoco.apply(model, "vscan", **setting) as handle, watch_layers(model, [layer]) as seen:
        model(**inputs)
    entering = seen[layer].received
    positions = torch.arange(entering.shape[1]).unsqueeze(0)
    cos, sin = rotary(model, entering, positions)
    rows = last_row_attention(decoder(model).layers[layer], entering, cos, sin)
    stage_two = handle.records[1]
    assert stage_two.stage == "llm" and stage_two.layer == layer
    for b in range(2):
        assert stage_two.kept[b].tolist() == official_rank(rows[b], LLAVA_START, reaching, llm_keep), f"sample {b}"
    # The later layers run at compacted positions (modeling_llama_x.py:1490): arange over the shorter sequence.
    kept_length = entering.shape[1] - reaching + llm_keep
    compacted = rotary(model, entering, torch.arange(kept_length)[None])[0]
    torch.testing.assert_close(seen[layer].rotary[0], compacted.expand_as(seen[layer].rotary[0]))


@pytest.mark.parametrize("keep,window_size,seed", [
    (21, 2, 0),  # T = 32: 16 windows of 2 x 2, one pick each
    (32, 4, 1),  # T = 48: 4 windows of 4 x 4, six each
    (27, 2, 2),  # T = 41: int(41 / 2) = 20 over 16 windows: one each, the local scan four short
])
def test_llava_keeps_the_official_scans_and_merges(llava: nn.Module, keep: int, window_size: int, seed: int) -> None:
    check_llava(llava, keep, window_size, seed)


def test_the_llava_check_fails_when_the_windows_take_one_pick_more(llava: nn.Module,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    real = vscan_ops.llava_local_per_window
    # The plan (the spec's count) and the method alike, so that the run goes through and the rule check decides.
    monkeypatch.setattr(vscan_spec, "llava_local_per_window", lambda *args: real(*args) + 1)
    fails_when(monkeypatch, vscan_ops, "llava_local_per_window", lambda *args: real(*args) + 1,
               lambda: check_llava(llava, 21, 2, 0))


def test_the_llava_check_fails_when_the_merge_leaves_the_kept_token_out(llava: nn.Module,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    real = vscan_ops.merge_into_kept

    def members_only(hidden: Tensor, kept: Tensor, riding: int = 0) -> tuple[Tensor, Tensor, Tensor]:
        merged, discarded, target = real(hidden, kept, riding)
        # Drop the kept token's own share: the mean of its members alone where it has any.
        own = vscan_ops.gather_tokens(hidden, kept)
        ones = torch.ones_like(target, dtype=hidden.dtype)
        counts = torch.ones(kept.shape, dtype=hidden.dtype).scatter_add(1, target, ones)
        alone = counts.unsqueeze(-1) == 1
        return torch.where(alone, merged, (merged * counts.unsqueeze(-1) - own) / (counts.unsqueeze(-1) - 1)), \
            discarded, target

    fails_when(monkeypatch, vscan_ops, "merge_into_kept", members_only, lambda: check_llava(llava, 21, 2, 0))


def test_the_llava_check_fails_when_stage_two_ranks_without_rope(llava: nn.Module,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    original = llm_steps.own_last_row

    def without_rope(layer: nn.Module, hidden: Tensor, cos: Tensor, sin: Tensor, visible: Tensor,
                     scores: str) -> Tensor:
        return original(layer, hidden, None, None, visible, scores)

    fails_when(monkeypatch, llm_steps, "own_last_row", without_rope, lambda: check_llava(llava, 21, 2, 0))


# ---- Qwen2.5-VL --------------------------------------------------------------------------------------------------

def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def window_index(visual: nn.Module, grid_thw: Tensor) -> Tensor:
    """The tower's get_window_index: the merge units in window order (padded windows, padding dropped)."""
    out = []
    merger_window = visual.window_size // visual.spatial_merge_size // visual.patch_size
    for grid_t, grid_h, grid_w in grid_thw.tolist():
        llm_h, llm_w = grid_h // visual.spatial_merge_size, grid_w // visual.spatial_merge_size
        index = torch.arange(grid_t * llm_h * llm_w).reshape(grid_t, llm_h, llm_w)
        pad_h, pad_w = merger_window - llm_h % merger_window, merger_window - llm_w % merger_window
        windows_h, windows_w = (llm_h + pad_h) // merger_window, (llm_w + pad_w) // merger_window
        padded = F.pad(index, (0, pad_w, 0, pad_h), "constant", -100)
        padded = padded.reshape(grid_t, windows_h, merger_window, windows_w, merger_window).permute(0, 1, 3, 2, 4)
        padded = padded.reshape(-1)
        out.append(padded[padded != -100])
    return torch.cat(out)


@torch.no_grad()
def qwen_vision_scores(model: nn.Module, inputs: dict[str, Tensor]) -> dict[int, Tensor]:
    """qwen2_5_vl_custom.py:338-391 for one image, every block: the SDPA path's attention weights (:498-509), q and k
    rotated once, the block's own segments as the mask (windows in a window block); summed over heads, averaged over
    the queries, averaged per merge unit, window order undone."""
    visual = model.model.visual
    seen: dict[int, tuple[Tensor, Tensor, tuple[Tensor, Tensor]]] = {}
    hooks = []
    for i, block in enumerate(visual.blocks):
        def capture(module: nn.Module, args: tuple, kwargs: dict, i: int = i) -> None:
            seen[i] = (args[0] if args else kwargs["hidden_states"], kwargs["cu_seqlens"],
                       kwargs["position_embeddings"])
        hooks.append(block.attn.register_forward_pre_hook(capture, with_kwargs=True))
    forward_with_hooks(model, inputs, hooks)
    reverse_indices = torch.argsort(window_index(visual, inputs["image_grid_thw"]))
    out = {}
    for i, block in enumerate(visual.blocks):
        hidden, cu_seqlens, (cos, sin) = seen[i]
        seq_length = hidden.shape[0]
        q, k, _ = block.attn.qkv(hidden).reshape(seq_length, 3, block.attn.num_heads, -1).permute(1, 0, 2, 3).unbind(0)
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        q, k = q.transpose(0, 1), k.transpose(0, 1)
        mask = torch.full([1, seq_length, seq_length], torch.finfo(q.dtype).min)
        for j in range(1, len(cu_seqlens)):
            mask[..., cu_seqlens[j - 1]:cu_seqlens[j], cu_seqlens[j - 1]:cu_seqlens[j]] = 0
        attn_weights = torch.matmul(q, k.transpose(1, 2)) / math.sqrt(q.size(-1)) + mask
        attn_weights = F.softmax(attn_weights, dim=-1, dtype=torch.float32)
        scores = attn_weights.sum(dim=0).mean(dim=0).view(-1, 4).mean(dim=1)
        out[i] = scores[reverse_indices]
    return out


def window_selection(attn_weights: Tensor, num_keep_tokens: int, token_h: int, token_w: int,
                     window_size: int) -> list[int]:
    """qwen2_5_vl_utils.py:136-193."""
    num_windows_h, num_windows_w = token_h // window_size, token_w // window_size
    sorted_indices = torch.argsort(attn_weights, dim=0, descending=True)
    window_counter = torch.zeros(token_h, token_w, dtype=torch.int)
    limit = math.ceil(num_keep_tokens / (num_windows_h * num_windows_w))
    keep_indices = []
    for index in sorted_indices.tolist():
        x = min((index // token_w) // window_size, num_windows_h - 1)
        y = min((index % token_w) // window_size, num_windows_w - 1)
        if window_counter[x, y] < limit:
            window_counter[x, y] += 1
            keep_indices.append(index)
        if len(keep_indices) >= num_keep_tokens:
            break
    assert len(keep_indices) == num_keep_tokens
    return keep_indices


def official_qwen_stage_one(model: nn.Module, inputs: dict[str, Tensor], num_keep_tokens: int,
                            window_size: int) -> tuple[list[int], Tensor]:
    """qwen2_5_vl_custom.py:145-162: the kept units (grid order, ascending) and the merged tokens ``(K, D)``."""
    visual = model.model.visual
    scores = qwen_vision_scores(model, inputs)
    local, deep = scores[visual.fullatt_block_indexes[0]], scores[len(visual.blocks) - 1].clone()
    _, rows, cols = inputs["image_grid_thw"][0].tolist()
    keep_indices_local = window_selection(local, num_keep_tokens // 2, rows // 2, cols // 2, window_size)
    deep[keep_indices_local] = 0
    decided(deep, num_keep_tokens - num_keep_tokens // 2)
    keep_indices_global = torch.topk(deep, num_keep_tokens - num_keep_tokens // 2).indices.tolist()
    keep_indices = sorted(keep_indices_local + keep_indices_global)
    with torch.no_grad():
        image_embeds = visual(inputs["pixel_values"], grid_thw=inputs["image_grid_thw"]).pooler_output
    mask = torch.zeros(image_embeds.shape[0], dtype=torch.bool)
    mask[keep_indices] = True
    return keep_indices, token_merging(image_embeds[None], mask[None])[0]


def group_patch_set(groups: list[int], cols: int) -> list[int]:
    """The row-major patch indices of merge groups `groups` on a grid `cols` patches wide."""
    width = cols // 2
    return sorted((2 * (g // width) + a) * cols + 2 * (g % width) + b for g in groups for a in (0, 1) for b in (0, 1))


def check_qwen(model: nn.Module, keep: int, window_size: int, seed: int) -> None:
    inputs = synthetic_inputs(model, batch=1, text_tokens=TEXT, seed=seed)
    _, rows, cols = inputs["image_grid_thw"][0].tolist()
    start = int((inputs["input_ids"][0] == model.config.image_token_id).nonzero()[0])
    layer = len(decoder(model).layers) // 2  # 14 of Qwen2.5-VL-7B's 28
    with torch.no_grad(), ficoco.apply(model, "vscan", keep=keep, window_size=window_size) as handle, \
            watch_layers(model, [0, layer - 1, layer]) as seen:
        model(**inputs)
    settings = handle.schedule.settings_dict()
    num_keep = settings["keep"]
    kept, merged = official_qwen_stage_one(model, inputs, num_keep, window_size)
    vision, stage_two = handle.records
    assert vision.kept[0].tolist() == group_patch_set(kept, cols)
    # The LLM receives the merged tokens in grid order where the image's placeholders were.
    torch.testing.assert_close(seen[0].received[0, start:start + num_keep], merged, rtol=1e-5, atol=1e-5)
    # Stage 2: the rank layer's own q and k without RoPE, no mask, the last token's row.
    entering = seen[layer].received
    row = last_row_attention(decoder(model).layers[layer], entering, None, None)[0]
    next_tokens = settings["llm_keep"]
    top = official_rank(row, start, num_keep, next_tokens)
    assert stage_two.layer == layer and stage_two.kept[0].tolist() == top
    # The kept tokens keep their position ids (qwen2_5_vl_custom.py:775): the rank layer's rotary rows are the
    # entering sequence's at the kept rows.
    kept_rows = [*range(start), *(start + i for i in top), *range(start + num_keep, entering.shape[1])]
    before, after = seen[layer - 1].rotary[0], seen[layer].rotary[0]
    torch.testing.assert_close(after, before[..., kept_rows, :])


@pytest.mark.parametrize("keep,window_size,seed", [
    (8, 2, 5),  # T = 12 of 20 units: 2 x 2 windows of the 5 x 4 grid (its last row joins the last windows), cap 2
    (6, 4, 5),  # T = 9: one window of the whole grid, the greedy a plain top 4
    (10, 2, 6),  # T = 15: cap 2 of 7 local picks
])
def test_qwen2_5_vl_keeps_the_official_scans_merges_and_rank(qwen25: nn.Module, keep: int, window_size: int,
                                                             seed: int) -> None:
    # The tiny tower's last block attends within windows: the global scan reads it as it ran, the window mask applied.
    assert len(qwen25.model.visual.blocks) - 1 not in qwen25.config.vision_config.fullatt_block_indexes
    check_qwen(qwen25, keep, window_size, seed)


def test_the_qwen_check_fails_when_stage_two_ranks_with_rope(qwen25: nn.Module,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    fails_when(monkeypatch, Qwen2VLAdapter, "multimodal_rope", False, lambda: check_qwen(qwen25, 8, 2, 5))


def test_the_qwen_check_fails_when_the_edge_rows_join_the_first_window(qwen25: nn.Module,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    def edges_first(rows: int, cols: int, window: int, device: torch.device | None = None) -> tuple[Tensor, int]:
        down, across = max(1, rows // window), max(1, cols // window)
        row = ((torch.arange(rows, device=device) - rows % window) // window).clamp(0, down - 1)
        col = ((torch.arange(cols, device=device) - cols % window) // window).clamp(0, across - 1)
        return (row.unsqueeze(1) * across + col.unsqueeze(0)).flatten(), down * across

    fails_when(monkeypatch, vscan_ops, "window_ids", edges_first, lambda: check_qwen(qwen25, 8, 2, 5))
