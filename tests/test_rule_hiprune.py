"""HiPrune's official rule, re-stated here in plain torch from its official code, against ficoco's run.

Official code: Danielement321/HiPrune @ 6e83a12.

- LLaVA (LLaVA/llava/model/llava_arch.py:140-184, LLaVA/llava/model/multimodal_encoder/clip_encoder.py:35-62): the
  CLIP tower runs with ``output_attentions=True``; per image (or LLaVA-NeXT crop) of the B in the call, the budget
  is ``int(HIPRUNE_RETENTION / B)`` (:144); the deep score is ``attentions[mm_vision_select_layer]`` (-2) averaged over
  heads, then over every query row, the [CLS] column dropped (:146-148); the object score the same of
  ``attentions[HIPRUNE_OBJECT_LAYER - 1]`` (:150-152); ``round(budget * HIPRUNE_ALPHA / 5)`` anchors by topk of the
  object score (:153, :157), their -1, +1, -24, +24 neighbours clamped to [0, 575] and deduplicated (:158-164); the
  deep score minus 1 on those, topk of the rest of the budget (:165-172); the union sorted into a boolean mask
  (:173-182).
- Qwen2.5-VL (Qwen2_5_VL/qwen2_5_vl_HiPrune.py): every vision block's softmax(q k^T / sqrt(d)) recomputed from its
  post-rotary queries and keys over the whole sequence, no window mask (:196-211); mean over heads, sum over the
  query rows, mean over each merge unit's 4 patches, window order undone (:570-576); object = ``attn_list[l - 1]``
  (l = HIPRUNE_OBJECT_LAYER), deep = ``attn_list[-1]`` (:1856-1857); budget ``round(n_image_tokens *
  HIPRUNE_QWEN_RETENTION)`` (:1860); buffers +-1 and +-the merged width, clamped to the image's tokens
  (:1863-1871); registers as on LLaVA (:1873-1881).

The quantities the official code reads are recomputed here from the unpatched model's own q/k projections (forward
hooks on the tiny models, fp32, seeded random weights, so no two scores tie), and ficoco's kept sets
(`handle.records`) must equal the official ones exactly, at several budgets. One test breaks a piece of ficoco's
method and expects the check to fail; one runs ficoco's named correction (``buffers="grid"``) against its own
plain re-statement.
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import forward_with_hooks
from torch import Tensor, nn

import ficoco
from ficoco.methods.hiprune import ops as hiprune_ops
from ficoco.models import synthetic_inputs

TEXT = 12


@pytest.fixture(scope="module")
def llava() -> nn.Module:
    return ficoco.build_model("llava-tiny", dtype="fp32")


@pytest.fixture(scope="module")
def llava_next() -> nn.Module:
    return ficoco.build_model("llava-next-tiny", dtype="fp32")


@pytest.fixture(scope="module")
def qwen25() -> nn.Module:
    return ficoco.build_model("qwen2.5-vl-tiny", dtype="fp32")


# ---- the official rule, written from the official code ---------------------------------------------------------

def clip_attentions(model: nn.Module, inputs: dict[str, Tensor]) -> list[Tensor]:
    """Every CLIP layer's (items, heads, T, T) softmax attention, as ``output_attentions=True`` gives it, recomputed
    in float64 from the layer's own q_proj and k_proj outputs on the unpatched model."""
    layers = model.model.vision_tower.encoder.layers
    seen: dict[tuple[int, str], Tensor] = {}
    hooks = []
    for i, layer in enumerate(layers):
        for name in ("q_proj", "k_proj"):
            hooks.append(getattr(layer.self_attn, name).register_forward_hook(
                lambda m, a, o, key=(i, name): seen.__setitem__(key, o)))
    forward_with_hooks(model, inputs, hooks)
    out = []
    for i, layer in enumerate(layers):
        heads = layer.self_attn.num_heads
        q, k = seen[(i, "q_proj")].double(), seen[(i, "k_proj")].double()
        items, tokens, width = q.shape
        d = width // heads
        q = q.view(items, tokens, heads, d).transpose(1, 2)
        k = k.view(items, tokens, heads, d).transpose(1, 2)
        out.append(torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(d), dim=-1))
    return out


def official_select(shallow: Tensor, deep: Tensor, budget: int, alpha: float, width: int) -> list[list[int]]:
    """llava_arch.py:153-174 (and qwen2_5_vl_HiPrune.py:1861-1881) per item: the kept indices, ascending."""
    n = deep.shape[1]
    deep = deep.clone()
    shallow_token_num = round(budget * alpha / 5)
    kept = []
    for i in range(deep.shape[0]):
        shallow_token_indices = torch.topk(shallow[i].unsqueeze(0), k=shallow_token_num, dim=1)[1]
        shallow_token_indices = torch.cat([shallow_token_indices, shallow_token_indices - 1,
                                           shallow_token_indices + 1, shallow_token_indices - width,
                                           shallow_token_indices + width], dim=1)
        shallow_token_indices = shallow_token_indices.clamp(0, n - 1)
        shallow_token_indices = torch.unique(shallow_token_indices, sorted=False).unsqueeze(0)
        deep_token_num = budget - shallow_token_indices.shape[1]
        available_index_mask = torch.zeros(1, n, dtype=torch.bool)
        available_index_mask.scatter_(1, shallow_token_indices, 1)
        deep[i] -= available_index_mask.int().squeeze()
        deep_token_indices = torch.topk(deep[i].unsqueeze(0), k=deep_token_num, dim=1)[1]
        token_indices = torch.sort(torch.cat([shallow_token_indices, deep_token_indices], dim=1), dim=1)[0]
        assert token_indices.unique().numel() == budget  # the rule is decided: no unit picked twice
        kept.append(token_indices[0].tolist())
    return kept


def official_llava(model: nn.Module, inputs: dict[str, Tensor], retention: int, items_per_image: int,
                   object_layer: int, alpha: float) -> list[list[int]]:
    """encode_images of one sample's B = `items_per_image` images or crops, every sample as the official code runs
    it (batch 1): the kept patch indices per item."""
    attentions = clip_attentions(model, inputs)
    select_layer = model.config.vision_feature_layer  # -2
    deep = attentions[select_layer].mean(dim=1).mean(dim=1)[:, 1:]
    shallow = attentions[object_layer - 1].mean(dim=1).mean(dim=1)[:, 1:]
    side = int(math.isqrt(deep.shape[1]))
    return official_select(shallow, deep, int(retention / items_per_image), alpha, side)


def kept_sets(record_kept: Tensor) -> list[list[int]]:
    return [sorted(row[row >= 0].tolist()) for row in record_kept]


@pytest.mark.parametrize("keep,alpha,object_layer", [
    (32, 0.1, None),  # one anchor, the object layer ficoco picks for a 6-layer CLIP tower (l = 2)
    (20, 0.5, None),  # two anchors
    (48, 0.5, 4),  # five anchors, HIPRUNE_OBJECT_LAYER = 4 (object_layer=3)
])
def test_llava_keeps_the_official_anchors_buffers_and_registers(llava: nn.Module, keep: int, alpha: float,
                                                                object_layer: int | None) -> None:
    inputs = synthetic_inputs(llava, batch=2, text_tokens=TEXT, seed=7)
    setting = {} if object_layer is None else {"object_layer": object_layer - 1}
    with torch.no_grad(), ficoco.apply(llava, "hiprune", keep=keep, alpha=alpha, **setting) as handle:
        llava(**inputs)
        (record,) = handle.records
    official_l = handle.schedule.settings_dict()["object_layer"] + 1
    assert official_l == (object_layer or 2)
    # One sample's one image: B = 1, so the official budget is HIPRUNE_RETENTION itself.
    expected = [official_llava(llava, {k: v[b:b + 1] for k, v in inputs.items()}, keep, 1, official_l, alpha)[0]
                for b in range(2)]
    assert kept_sets(record.kept) == expected


@pytest.mark.parametrize("retention,alpha", [(40, 0.5), (60, 0.5)])
def test_llava_next_divides_the_official_retention_over_the_crops(llava_next: nn.Module, retention: int,
                                                                   alpha: float) -> None:
    inputs = synthetic_inputs(llava_next, batch=1, text_tokens=TEXT, seed=3)
    crops = inputs["pixel_values"].shape[1]  # the base view and the crops: B of llava_arch.py:144
    with torch.no_grad(), ficoco.apply(llava_next, "hiprune", keep=retention // crops, alpha=alpha) as handle:
        llava_next(**inputs)
        (record,) = handle.records
    flat = {**inputs, "pixel_values": inputs["pixel_values"]}
    expected = official_llava(llava_next, flat, retention, crops, handle.schedule.settings_dict()["object_layer"] + 1,
                              alpha)
    assert len(expected) == crops and kept_sets(record.kept) == expected


# ---- Qwen2.5-VL ------------------------------------------------------------------------------------------------

def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def window_index(visual: nn.Module, grid_thw: Tensor) -> Tensor:
    """qwen2_5_vl_HiPrune.py:477-514 (the tower's get_window_index): the merge units in window order."""
    out = []
    merger_window = visual.window_size // visual.spatial_merge_size // visual.patch_size
    offset = 0
    for grid_t, grid_h, grid_w in grid_thw.tolist():
        llm_h, llm_w = grid_h // visual.spatial_merge_size, grid_w // visual.spatial_merge_size
        index = torch.arange(grid_t * llm_h * llm_w).reshape(grid_t, llm_h, llm_w)
        pad_h, pad_w = merger_window - llm_h % merger_window, merger_window - llm_w % merger_window
        windows_h, windows_w = (llm_h + pad_h) // merger_window, (llm_w + pad_w) // merger_window
        padded = torch.nn.functional.pad(index, (0, pad_w, 0, pad_h), "constant", -100)
        padded = padded.reshape(grid_t, windows_h, merger_window, windows_w, merger_window).permute(0, 1, 3, 2, 4)
        padded = padded.reshape(-1)
        out.append(padded[padded != -100] + offset)
        offset += grid_t * llm_h * llm_w
    return torch.cat(out)


def qwen_attention_list(model: nn.Module, inputs: dict[str, Tensor]) -> list[Tensor]:
    """Per vision block, qwen2_5_vl_HiPrune.py:201-211 and :570-576 for one image: the post-rotary q k^T / sqrt(d)
    softmax over the whole sequence (no window mask), mean over heads, sum over queries, mean per merge unit of 4,
    window order undone; recomputed in float64 from each block's own qkv projection and rotary table."""
    visual = model.model.visual
    seen: dict[int, tuple[Tensor, Tensor, Tensor]] = {}
    hooks = []
    for i, block in enumerate(visual.blocks):
        def capture(module: nn.Module, args: tuple, kwargs: dict, i: int = i) -> None:
            hidden = args[0] if args else kwargs["hidden_states"]
            cos, sin = kwargs["position_embeddings"]
            seen[i] = (hidden, cos, sin)
        hooks.append(block.attn.register_forward_pre_hook(capture, with_kwargs=True))
    forward_with_hooks(model, inputs, hooks)
    reverse_indices = torch.argsort(window_index(visual, inputs["image_grid_thw"]))
    out = []
    for i, block in enumerate(visual.blocks):
        hidden, cos, sin = seen[i]
        tokens = hidden.shape[0]
        heads = block.attn.num_heads
        q, k, _ = block.attn.qkv(hidden).double().reshape(tokens, 3, heads, -1).permute(1, 0, 2, 3).unbind(0)
        cos, sin = cos.double().unsqueeze(-2), sin.double().unsqueeze(-2)
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        q, k = q.permute(1, 0, 2), k.permute(1, 0, 2)  # [H, T, D]
        attn_logits = torch.softmax(torch.matmul(q, k.transpose(-1, -2)) / (q.shape[-1] ** 0.5), dim=-1)
        attn_weights = attn_logits.mean(dim=0).sum(dim=0)
        attn_weights = attn_weights.view(attn_weights.shape[0] // 4, -1).mean(dim=-1)
        out.append(attn_weights[reverse_indices])
    return out


def group_patch_set(groups: list[int], cols: int) -> list[int]:
    """The row-major patch indices of merge groups `groups` (a group's 2x2 patches) on a grid `cols` patches wide."""
    width = cols // 2
    return sorted((2 * (g // width) + a) * cols + 2 * (g % width) + b for g in groups for a in (0, 1) for b in (0, 1))


@pytest.mark.parametrize("retain,alpha", [(0.5, 0.5), (0.75, 0.4), (0.35, 0.1)])
def test_qwen2_5_vl_keeps_the_official_groups(qwen25: nn.Module, retain: float, alpha: float) -> None:
    inputs = synthetic_inputs(qwen25, batch=1, text_tokens=TEXT, seed=11)
    _, rows, cols = inputs["image_grid_thw"][0].tolist()
    n_image_tokens = rows * cols // 4
    with torch.no_grad(), ficoco.apply(qwen25, "hiprune", retention=retain, alpha=alpha) as handle:
        qwen25(**inputs)
        (record,) = handle.records
    settings = handle.schedule.settings_dict()
    assert settings["keep"] == round(n_image_tokens * retain)
    attn_list = qwen_attention_list(qwen25, inputs)
    object_layer = settings["object_layer"] + 1  # HIPRUNE_OBJECT_LAYER
    assert object_layer - 1 in qwen25.config.vision_config.fullatt_block_indexes
    width = int(cols / qwen25.config.vision_config.spatial_merge_size)
    (groups,) = official_select(attn_list[object_layer - 1][None], attn_list[-1][None],
                                round(n_image_tokens * retain), alpha, width)
    assert kept_sets(record.kept) == [group_patch_set(groups, cols)]


# ---- a deliberate break, and ficoco's correction -----------------------------------------------------------------

def test_the_check_fails_when_a_piece_of_the_method_is_broken(llava: nn.Module,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    real = hiprune_ops.buffered_anchors

    def off_by_one_row(object_scores: Tensor, anchors: int, width: int, buffers: str = "official") -> Tensor:
        return real(object_scores, anchors, width + 1, buffers)  # the +-W buffers one column off

    monkeypatch.setattr(hiprune_ops, "buffered_anchors", off_by_one_row)
    with pytest.raises(AssertionError):
        test_llava_keeps_the_official_anchors_buffers_and_registers(llava, 20, 0.5, None)


def grid_select(shallow: Tensor, deep: Tensor, budget: int, alpha: float, width: int) -> list[list[int]]:
    """ficoco's correction ``buffers="grid"``, written plainly: an anchor's neighbours only inside the grid (no
    wrap across a row's end, none past an edge), then the registers among the rest."""
    n = deep.shape[1]
    kept = []
    for i in range(deep.shape[0]):
        anchors = sorted(range(n), key=lambda u: -float(shallow[i, u]))[:round(budget * alpha / 5)]
        chosen = set()
        for a in anchors:
            row, col = divmod(a, width)
            chosen |= {a} | {r * width + c for r, c in ((row, col - 1), (row, col + 1), (row - 1, col), (row + 1, col))
                             if 0 <= c < width and 0 <= r < n // width}
        rest = sorted((u for u in range(n) if u not in chosen), key=lambda u: -float(deep[i, u]))
        kept.append(sorted(chosen | set(rest[:budget - len(chosen)])))
    return kept


def test_the_grid_buffers_correction_takes_no_neighbour_across_a_row(llava: nn.Module) -> None:
    inputs = synthetic_inputs(llava, batch=2, text_tokens=TEXT, seed=7)
    with torch.no_grad(), ficoco.apply(llava, "hiprune", keep=48, alpha=0.5, buffers="grid") as handle:
        llava(**inputs)
        (record,) = handle.records
    attentions = clip_attentions(llava, inputs)
    deep = attentions[llava.config.vision_feature_layer].mean(dim=1).mean(dim=1)[:, 1:]
    shallow = attentions[handle.schedule.settings_dict()["object_layer"]].mean(dim=1).mean(dim=1)[:, 1:]
    assert kept_sets(record.kept) == grid_select(shallow, deep, 48, 0.5, 8)
    # The official buffers differ on these images (an anchor at a row's end or the grid's edge).
    assert kept_sets(record.kept) != official_select(shallow, deep, 48, 0.5, 8)
