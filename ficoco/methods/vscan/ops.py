"""VScan (Tencent/SelfEvolvingAgent a82450e, VScan/): complementary global and local scans before the LLM, with
merging, and a rank-and-drop at the decoder's middle layer.

**Stage 1**, per item (an image, a crop, a frame), after the projector (`tower_step`, `vscan_select`,
`merge_into_kept`). The item keeps T units, ``int(T * (1 - global_ratio))`` of them from the local scan, the rest
from the global scan:

- *Scores* of two tower layers: the local layer (LLaVA: ``attentions[5]``, llava_arch.py:267; Qwen2.5-VL: the first
  full-attention block, qwen2_5_vl_custom.py:342) and the layer the projector reads (LLaVA: ``attentions[-2]``,
  CLIP layer 22, :268; Qwen: the last block, :343). The LLaVA code scores a patch by [CLS]'s softmax row, heads
  averaged (clip_encoder.py:40-44, llava_arch.py:256); the Qwen code by what it receives: the probabilities summed
  over heads, averaged over every query (the window mask as the block ran), averaged over each 2 x 2 merge unit
  (qwen2_5_vl_custom.py:363-377).
- *Local scan* on the local layer's scores, windows of ``window`` x ``window`` units (`window_ids`): the LLaVA code
  takes the top ``k = local // windows`` of every window (window_cls_selection, llava_arch.py:199-252), so the local
  picks fall short of ``local`` when the windows do not divide it; the Qwen code walks the units in descending score
  and takes one while its window holds fewer than ``ceil(local / windows)`` picks, until ``local`` are taken
  (window_selection, qwen2_5_vl_utils.py:136-193). Edge rows and columns that fill no window join the last one.
- *Global scan*: the ``T - local`` highest scores of the layer the projector reads among the units the local scan
  left (the official code zeroes the local picks' scores, llava_arch.py:277-279, custom:152-153).
- The picks in image order (a mask, llava_arch.py:284-285; a sort, custom:156). Every unit was projected; every other
  one is merged into the kept unit of highest cosine similarity (the first on a tie: ``argmax``), and a kept unit
  becomes the mean of itself and the units merged into it (token_merging, llava_arch.py:142-197,
  qwen2_5_vl_utils.py:97-134).

**Stage 2** at the input of the rank layer (`step`): that layer's own input norm and q / k projections on the
sequence entering it, the last prompt token's row softmaxed over every key, heads averaged, the image columns, the
top ``keep`` in order (modeling_llama_x.py:1351-1451; qwen2_5_vl_custom.py:705-766). The LLaVA code applies the
layer's RoPE and compacts the positions (:1374, :1490); the Qwen code applies no RoPE (:723-726, commented out) and
keeps the kept tokens' original 3-D positions (:775). The adapters compute the row (the spec's ``query_key`` need,
``rope="1d"``); here the rank and the rebuild.

Departures, none a setting: the items are batched (the official loops run batch 1); ties among equal scores go to the
lowest index (``topk`` and ``argsort`` leave them open); the Qwen code's windows count at least one per side (it
divides by zero on a merged grid narrower than a window, utils:150-169), and where its capped greedy cannot take
``local`` units (windows smaller than the cap; the official code asserts) the global scan takes the rest, so an item
always keeps T; the merge's similarities and means are computed in float32 (the official code in the model's dtype).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ficoco.errors import FicocoError
from ficoco.methods.inputs import Reduced, StepInput, TowerInput, TowerOutput
from ficoco.methods.ops import check_span, compute_dtype, gather_tokens, last_row_scores, rebuild, top_indices
from ficoco.methods.reads.ops import AttentionReads, as_reads
from ficoco.methods.vscan import GLOBAL_RATIO, llava_local_per_window, local_count, window_grid

__all__ = ["merge_into_kept", "rank_in_window", "scan_scores", "step", "tower_step", "vscan_select", "window_ids"]


def scan_scores(attention: Tensor | AttentionReads, scan: str, has_cls: bool, merge: int = 1,
                device: torch.device | None = None) -> Tensor:
    """``(items, N)`` the units' scores in one tower layer's head-mean probabilities ``(items, T, T)`` (or reads of
    them): ``"cls"``, [CLS]'s row (the LLaVA code); ``"columns"``, what every unit receives averaged over every query
    row (the Qwen code). [CLS]'s column dropped where the tower has one, a merge unit's ``merge`` consecutive
    patches averaged (Qwen's 2 x 2 groups, InternVL's pixel-shuffle groups). `device`: where the reads' row index
    goes (the probed layer's, where the reader does not say)."""
    reads = as_reads(attention)
    items = reads.shape[0]
    if scan == "cls":
        if not has_cls:
            raise FicocoError("VScan's LLaVA code scores by [CLS]'s attention row, and this tower has no [CLS]")
        held = getattr(reads, "query", getattr(reads, "matrix", None))
        first = torch.zeros(items, 1, dtype=torch.long, device=held.device if isinstance(held, Tensor) else device)
        scores = reads.rows(first)[:, 0]
    elif scan == "columns":
        scores = reads.column_mean()
    else:
        raise FicocoError(f"VScan scan={scan!r}: the scores are 'cls' (LLaVA code) or 'columns' (Qwen code)")
    scores = scores[:, int(has_cls):]
    patches = scores.shape[1]
    if patches % merge:
        raise ValueError(f"{patches} patches are not whole merge units of {merge}")
    return scores.view(items, patches // merge, merge).mean(dim=-1)


def window_ids(rows: int, cols: int, window: int, device: torch.device | None = None) -> tuple[Tensor, int]:
    """``(rows * cols,)`` the window of every unit of a row-major grid (windows row-major, `window_grid`'s: the edge
    rows and columns that fill no window join the last one) and the number of windows."""
    down, across, _ = window_grid(rows, cols, window)
    row = (torch.arange(rows, device=device) // window).clamp(max=down - 1)
    col = (torch.arange(cols, device=device) // window).clamp(max=across - 1)
    return (row.unsqueeze(1) * across + col.unsqueeze(0)).flatten(), down * across


def rank_in_window(scores: Tensor, windows: Tensor, count: int) -> tuple[Tensor, Tensor]:
    """``(order, rank)``: ``order`` ``(items, N)`` the units by descending score (ties: the lower index first), and
    ``rank`` ``(items, N)`` every unit's place among its window's units in that order (0: its window's best)."""
    items, units = scores.shape
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices
    window = windows.to(order.device)[order]  # the window of every place of `order`
    by_window = torch.sort(window, dim=1, stable=True).indices  # places of `order`, window by window, in order
    sizes = torch.bincount(windows.to(order.device), minlength=count)
    starts = (sizes.cumsum(0) - sizes)[torch.gather(window, 1, by_window)]
    places = torch.arange(units, device=order.device).expand(items, -1)
    rank_of_place = torch.empty_like(order).scatter_(1, by_window, places - starts)
    return order, torch.empty_like(order).scatter_(1, order, rank_of_place)


def vscan_select(local_scores: Tensor, global_scores: Tensor, keep: int, grid_hw: tuple[int, int], window: int,
                 scan: str, global_ratio: float = GLOBAL_RATIO) -> Tensor:
    """``(items, K)`` the units stage 1 keeps, ascending (image order): the local scan's and the global scan's.

    Args:
        local_scores: ``(items, N)`` the local layer's scores (`scan_scores`).
        global_scores: ``(items, N)`` the scores of the layer the projector reads.
        keep: T, the units the item keeps (the LLaVA code's local scan may take fewer: K <= T).
        grid_hw: the item's grid of units (rows, cols), row-major.
        window: the local scan's window side in units.
        scan: ``"cls"`` (the LLaVA code: the top ``local // windows`` of every window) or ``"columns"`` (the Qwen
            code: the greedy over the ranking, ``ceil(local / windows)`` at most per window).
        global_ratio: the global scan's share of T.
    """
    items, units = global_scores.shape
    if local_scores.shape != global_scores.shape:
        raise ValueError(f"local {tuple(local_scores.shape)} and global {tuple(global_scores.shape)} scores must agree")
    rows, cols = grid_hw
    if rows * cols != units:
        raise RuntimeError(f"VScan scores {units} units on a {rows} x {cols} grid")
    if not 1 <= keep <= units:
        raise FicocoError(f"VScan keeps 1..{units} units of an item, got {keep}")
    device = global_scores.device
    local = local_count(keep, global_ratio)
    windows, count = window_ids(rows, cols, window, device)
    order, rank = rank_in_window(local_scores, windows, count)
    if scan == "cls":
        per_window = llava_local_per_window(local, count, window_grid(rows, cols, window)[2])
        taken = rank < per_window
        wanted = keep - local  # the official global count, whatever the local scan fell short by
        kept = wanted + count * per_window
    else:
        cap = -(-local // count)  # ceil(local / windows)
        eligible = torch.gather(rank < cap, 1, order)  # in descending order of score
        accepted = eligible & (eligible.cumsum(dim=1) <= local)
        taken = torch.zeros_like(accepted).scatter(1, order, accepted)
        wanted = keep - taken.sum(dim=1, keepdim=True)  # per item: T in all (the greedy's shortfall filled)
        kept = keep
    priority = torch.where(taken, torch.full_like(global_scores, float("-inf")), global_scores)
    global_order = torch.sort(priority, dim=1, descending=True, stable=True).indices
    places = torch.arange(units, device=device).expand(items, -1)
    picked = torch.zeros_like(taken).scatter(1, global_order, places < wanted)
    chosen = taken | picked
    return torch.sort((~chosen).to(torch.int8), dim=1, stable=True).indices[:, :kept].sort(dim=1).values


def merge_into_kept(hidden: Tensor, kept: Tensor, riding: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    """``(merged, discarded, target)``: every unit of `hidden` ``(items, N, D)`` outside `kept` ``(items, K)``
    (ascending) goes into the kept unit of highest cosine similarity (the first on a tie), and every kept unit becomes
    the mean of itself and the units merged into it; ``merged`` ``(items, K, D)``, ``discarded`` ``(items, N - K)``
    the other units ascending, ``target`` ``(items, N - K)`` the place in `kept` each went into. The last `riding`
    channels (Qwen3-VL's DeepStack features) are merged alike but left out of the similarities."""
    items, units, width = hidden.shape
    count = kept.shape[1]
    dtype = compute_dtype(hidden.dtype)
    flags = torch.ones(items, units, dtype=torch.int8, device=hidden.device).scatter(
        1, kept, torch.zeros_like(kept, dtype=torch.int8))
    discarded = torch.sort(torch.sort(flags, dim=1, descending=True, stable=True).indices[:, :units - count],
                           dim=1).values
    kept_hidden = gather_tokens(hidden, kept).to(dtype)
    if count == units:
        return kept_hidden.to(hidden.dtype), discarded, discarded
    rest = gather_tokens(hidden, discarded).to(dtype)
    own = width - riding
    similarity = F.normalize(rest[..., :own], dim=-1) @ F.normalize(kept_hidden[..., :own], dim=-1).transpose(1, 2)
    target = similarity.argmax(dim=-1)  # (items, N - K): the first maximum, as the official argmax
    sums = kept_hidden.scatter_add(1, target.unsqueeze(-1).expand(-1, -1, width), rest)
    counts = torch.ones(items, count, dtype=dtype, device=hidden.device).scatter_add(
        1, target, torch.ones_like(target, dtype=dtype))
    return (sums / counts.unsqueeze(-1)).to(hidden.dtype), discarded, target


def tower_step(inputs: TowerInput, settings: Mapping[str, Any]) -> TowerOutput:
    """The adapters' call after the projector: ``inputs.hidden`` the projector's output of every unit,
    ``inputs.attention`` the reads of the layer the projector reads, ``inputs.named["local_layer"]`` those of the
    local layer; the local and global scans' units stay in image order, every other unit merged into one of them."""
    probe = (inputs.named or {}).get("local_layer")
    if inputs.attention is None or probe is None or probe.attention is None:
        raise RuntimeError("VScan needs the attention of the layer the projector reads and of the local layer from "
                           "the adapter's probes")
    if inputs.grid_hw is None:
        raise RuntimeError("VScan needs the item's grid (its local scan's windows) from the adapter")
    scan = settings["scan"]
    device = inputs.hidden.device
    global_scores = scan_scores(inputs.attention, scan, inputs.has_cls, inputs.merge, device).to(device)
    local_scores = scan_scores(probe.attention, scan, inputs.has_cls, inputs.merge, device).to(device)
    units = int(inputs.hidden.shape[1])  # a plain int under torch.jit's trace too (flops --verify)
    if global_scores.shape[1] != units:
        raise RuntimeError(f"VScan scores {global_scores.shape[1]} units; the cut holds {units}")
    kept = vscan_select(local_scores, global_scores, settings["keep"], inputs.grid_hw, settings["window_size"], scan,
                        float(settings.get("global_ratio", GLOBAL_RATIO)))
    if kept.shape[1] != units - inputs.remove:
        raise RuntimeError(f"VScan kept {kept.shape[1]} of {units} units where its schedule plans "
                           f"{units - inputs.remove}")
    merged, discarded, target = merge_into_kept(inputs.hidden, kept, inputs.riding)
    return TowerOutput(hidden=merged, kept=kept, discarded=discarded, merged_into=torch.gather(kept, 1, target))


def step(inputs: StepInput, settings: Mapping[str, Any]) -> Reduced:
    """Stage 2, the adapters' call at the rank layer's input: its own last row ranks (``inputs.query_key_row``), the
    top ``inputs.keep`` stay in order; the positions compacted (a decoder of 3-D positions keeps the originals, the
    adapter's choice)."""
    if inputs.query_key_row is None:
        raise RuntimeError("VScan's stage 2 needs the rank layer's recomputed last row from the adapter")
    check_span(inputs.hidden, inputs.visual_start, inputs.num_visual)
    if not 1 <= inputs.keep <= inputs.num_visual:
        raise FicocoError(f"VScan keeps 1..{inputs.num_visual} visual tokens at its rank layer, got {inputs.keep}")
    scores = last_row_scores(inputs.query_key_row, inputs.visual_start, inputs.num_visual)
    kept = top_indices(scores, inputs.keep)
    return rebuild(inputs.hidden, kept, inputs.visual_start.to(inputs.hidden.device), inputs.num_visual,
                   inputs.position_ids, "compact", inputs.attention_mask)
