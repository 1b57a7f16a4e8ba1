"""DART (ZichenWen1/DART, EMNLP'25): keep pivots and the image tokens least duplicated by them.

At the input of decoder layer K (default 2; ``--pruned_layer 2``), from layer K-1:

1. **Pivots**: the 4 image tokens and the 4 text tokens after the image with the largest L1
   norm of their key states (heads concatenated).
2. ``TOKEN_TOPK = max_num_trunction // (4 + 4)``.
3. For each pivot in turn, the ``TOKEN_TOPK`` remaining image candidates with the **lowest**
   cosine similarity to the pivot - on layer K-1's output passed through the model's final
   norm - join the retained set and leave the candidates.
4. The text pivots are dropped: ``4 + 8 * TOKEN_TOPK`` image tokens stay (132 for 128), in
   original order, with their **original position ids**; the mask is sliced. No merging.

The official code iterates the pivots in **Python-set order** (``for item in list(set(...))``)
over absolute sequence positions, so the greedy result depends on CPython's set layout. This
is reproduced (``pivot_order="set"``, `cpython_set_order`) on each token's position id, which
is its absolute position in an unpadded sample and does not move with left padding;
``pivot_order="score"`` takes image pivots then text pivots by descending norm instead.

Keys: the official code (its history public in the fork xqy1111111/DART; at 5a19452,
llava/model/language_model/modeling_llama_self.py) reads ``layer_outputs[-2]`` of layer K-1 (L342,
"HACK"), the key states its attention returns after ``apply_rotary_pos_emb`` (SDPA L875/L912, eager
L572/L621, FlashAttention-2 L678/L728): post-RoPE, as here. RoPE keeps each
pair's L2 norm but not the L1 norm, so the pivots depend on absolute positions: a left-padded
batch equals its samples run alone when its position ids come from the padding mask (as
``generate`` gives them), not from plain ``arange``. Other
departures: batched with spans per sample (the official code is batch 1, ``[0]``); a suffix
with fewer than 4 tokens uses those it has; a pivot with fewer candidates left than
``TOKEN_TOPK`` takes them all; ties go to the lowest index.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ficoco.errors import FicocoError
from ficoco.methods.dart import MAX_NUM_TRUNCTION, PIVOT_IMAGE, PIVOT_TEXT
from ficoco.methods.inputs import Reduced, StepInput
from ficoco.methods.ops import check_span, compute_dtype, gather_tokens, rebuild, visual_positions

__all__ = ["cpython_set_order", "dart_pivots", "dart_reduce", "dart_select", "several_images", "step"]

# CPython's set: a table of 8 slots, linear probing of up to 9 neighbours, growth to a quarter-full table.
_SET_MINSIZE = 8
_LINEAR_PROBES = 9
_PERTURB_SHIFT = 5


def _set_insert(table: list[int | None], value: int) -> None:
    mask = len(table) - 1
    perturb = value
    i = value & mask
    while True:
        probes = range(i, i + _LINEAR_PROBES + 1) if i + _LINEAR_PROBES <= mask else range(i, i + 1)
        for j in probes:
            if table[j] is None:
                table[j] = value
                return
            if table[j] == value:
                return
        perturb >>= _PERTURB_SHIFT
        i = (i * 5 + 1 + perturb) & mask


def cpython_set_order(values: list[int]) -> list[int]:
    """The iteration order of ``set(values)`` in CPython 3 for non-negative ints (hash = value).

    Values are inserted in order into an 8-slot table; when it is 3/5 full it is rebuilt at the
    smallest power of two above four times its size, re-inserting in slot order.
    """
    table: list[int | None] = [None] * _SET_MINSIZE
    fill = 0
    for value in values:
        if value < 0:
            raise ValueError("cpython_set_order emulates non-negative ints only")
        if value in table:
            continue
        _set_insert(table, value)
        fill += 1
        if fill * 5 >= (len(table) - 1) * 3:
            size = _SET_MINSIZE
            while size <= fill * 4:
                size <<= 1
            old, table = [v for v in table if v is not None], [None] * size
            for v in old:
                _set_insert(table, v)
    return [v for v in table if v is not None]


def dart_pivots(keys: Tensor, visual_start: Tensor, num_visual: int, pivot_image: int = PIVOT_IMAGE,
                pivot_text: int = PIVOT_TEXT) -> tuple[Tensor, Tensor, Tensor]:
    """Pivots by the L1 norm of the keys: ``(image (B, pi), text (B, pt), text_valid (B, pt))``.

    Image pivots are indices within the span, text pivots sequence positions after it (each in
    descending norm order); ``text_valid`` is False where a sample's suffix had too few tokens.
    """
    check_span(keys, visual_start, num_visual)
    batch, seq_len, _ = keys.shape
    norms = keys.to(compute_dtype(keys.dtype)).abs().sum(dim=-1)  # (B, T)
    start = visual_start.to(device=keys.device, dtype=torch.long)
    image_norms = gather_tokens(norms.unsqueeze(-1), visual_positions(start, num_visual)).squeeze(-1)
    image = torch.sort(image_norms, dim=1, descending=True, stable=True).indices[:, :pivot_image]
    after = torch.arange(seq_len, device=keys.device).unsqueeze(0) >= (start + num_visual).unsqueeze(1)
    text_norms = norms.masked_fill(~after, float("-inf"))
    text = torch.sort(text_norms, dim=1, descending=True, stable=True).indices[:, :pivot_text]
    text_valid = torch.gather(after, 1, text)
    return image, text, text_valid


def dart_select(keys: Tensor, hidden_normed: Tensor, visual_start: Tensor, num_visual: int, position_ids: Tensor,
                max_num_trunction: int, pivot_image: int = PIVOT_IMAGE, pivot_text: int = PIVOT_TEXT,
                pivot_order: str = "set") -> Tensor:
    """``(B, k)`` ascending indices within the span of the image tokens DART keeps.

    Args:
        keys: ``(B, T, H_kv * d)`` layer K-1's post-RoPE keys, heads concatenated.
        hidden_normed: ``(B, T, D)`` layer K-1's output through the final norm.
        visual_start: ``(B,)``; num_visual: ``N``.
        position_ids: ``(B, T)`` the input's position ids (the set order's values).
        max_num_trunction: the target; ``TOKEN_TOPK = max_num_trunction // (pi + pt)``.
        pivot_image, pivot_text: pivot counts (4 and 4).
        pivot_order: ``"set"`` (the official Python-set order) or ``"score"``.
    """
    if pivot_order not in ("set", "score"):
        raise FicocoError(f"pivot_order must be 'set' or 'score', got {pivot_order!r}")
    if not 1 <= pivot_image <= num_visual:
        raise FicocoError(f"DART needs 1..{num_visual} image pivots, got {pivot_image}")
    batch = keys.shape[0]
    device = keys.device
    start = visual_start.to(device=device, dtype=torch.long)
    image, text, text_valid = dart_pivots(keys, start, num_visual, pivot_image, pivot_text)
    per_pivot = max_num_trunction // (pivot_image + pivot_text)
    pivots = torch.cat([image + start.unsqueeze(1), text], dim=1)  # sequence positions, official insertion order
    valid = torch.cat([torch.ones_like(image, dtype=torch.bool), text_valid], dim=1)
    if pivot_order == "set":
        # One host round trip of 8 ints per sample, as the official code's .tolist().
        values = torch.gather(position_ids.to(device), 1, pivots).tolist()
        flags = valid.tolist()
        orders = []
        for row, ok in zip(values, flags, strict=True):
            kept_values = [v for v, f in zip(row, ok, strict=True) if f]
            rank = {v: i for i, v in enumerate(cpython_set_order(kept_values))}
            orders.append(sorted(range(len(row)), key=lambda i: (not ok[i], rank.get(row[i], 0))))
        permutation = torch.tensor(orders, device=device, dtype=torch.long)
        pivots, valid = torch.gather(pivots, 1, permutation), torch.gather(valid, 1, permutation)

    dtype = compute_dtype(hidden_normed.dtype)
    image_states = gather_tokens(hidden_normed, visual_positions(start, num_visual)).to(dtype)
    pivot_states = gather_tokens(hidden_normed, pivots).to(dtype)
    # Cosine similarity as one product of unit vectors: matrix work that counters see.
    unit = torch.nn.functional.normalize
    similarity = unit(pivot_states, dim=-1, eps=1e-8) @ unit(image_states, dim=-1, eps=1e-8).transpose(1, 2)
    # A tensor source (a Python bool value does not trace for fvcore's torch.jit counter).
    retained = torch.zeros(batch, num_visual, dtype=torch.bool, device=device)
    retained = retained.scatter(1, image, torch.ones_like(image, dtype=torch.bool))
    candidate = ~retained
    order_index = torch.arange(num_visual, device=device)
    for p in range(pivots.shape[1]):
        # Least similar first; candidates only; equal values lowest index first.
        dissimilar = (-similarity[:, p]).masked_fill(~candidate, float("-inf"))
        ranked = torch.sort(dissimilar, dim=1, descending=True, stable=True).indices[:, :per_pivot]
        take = torch.gather(candidate, 1, ranked) & valid[:, p:p + 1]
        picked = torch.zeros_like(candidate).scatter(1, ranked, take)
        retained |= picked
        candidate &= ~picked
    counts = retained.sum(dim=1)
    if batch and bool((counts != counts[0]).any()):
        raise FicocoError("DART retained different counts per sample (a suffix shorter than its text pivots); "
                          "give every prompt at least as many text tokens after the image as pivot_text")
    kept = int(counts[0]) if batch else 0
    return torch.sort(torch.where(retained, order_index, num_visual), dim=1).values[:, :kept]


def dart_reduce(hidden: Tensor, keys: Tensor, hidden_normed: Tensor, visual_start: Tensor, num_visual: int,
                position_ids: Tensor, max_num_trunction: int = MAX_NUM_TRUNCTION,
                pivot_image: int = PIVOT_IMAGE, pivot_text: int = PIVOT_TEXT,
                attention_mask: Tensor | None = None, pivot_order: str = "set") -> Reduced:
    """Prune the input of layer K to DART's retained image tokens (original positions).

    Args:
        hidden: ``(B, T, D)`` the input of layer K (the output of layer K-1).
        keys, hidden_normed: as in :func:`dart_select`.
        visual_start, num_visual, position_ids, max_num_trunction, pivot_image, pivot_text,
        pivot_order: as in :func:`dart_select`; attention_mask: optional ``(B, T)``.
    """
    check_span(hidden, visual_start, num_visual)
    kept = dart_select(keys, hidden_normed, visual_start, num_visual, position_ids, max_num_trunction,
                       pivot_image, pivot_text, pivot_order)
    return rebuild(hidden, kept, visual_start.to(hidden.device), num_visual, position_ids, "original",
                   attention_mask)


def several_images(settings: dict, images: int) -> dict:
    """DART's settings for a prompt of `images` images when the schedule counts one image's tokens:
    image pivots, text pivots and the target each `images` times, which retains exactly `images`
    times one image's tokens (4 + 8 x (N // 8) per image), chosen among all the images together."""
    scaled = dict(settings)
    for key, default in (("pivot_image", 4), ("pivot_text", 4)):
        scaled[key] = settings.get(key, default) * images
    if settings.get("max_num_trunction") is not None:
        scaled["max_num_trunction"] = settings["max_num_trunction"] * images
    return scaled


def step(inputs: StepInput, settings: dict) -> Reduced:
    """The model adapters' call at the input of layer K: pivots from layer K-1's keys, picks from its
    output through the final norm; the set order follows positions that do not move with padding."""
    if inputs.keys is None or inputs.final_norm is None:
        raise RuntimeError("DART needs layer K-1's keys and the final norm from the adapter")
    normed = inputs.final_norm(inputs.hidden)
    truncation = settings.get("max_num_trunction")
    if truncation is None:  # an explicit --schedule: the target whose picks leave `keep` tokens
        truncation = inputs.keep - settings.get("pivot_image", 4)
    return dart_reduce(inputs.hidden, inputs.keys, normed, inputs.visual_start, inputs.num_visual,
                      inputs.text_positions, truncation, settings.get("pivot_image", 4), settings.get("pivot_text", 4),
                      attention_mask=inputs.attention_mask)
