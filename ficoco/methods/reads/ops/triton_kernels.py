"""The reads of ficoco.methods.reads as Triton kernels, for a GPU: column sums and rows of a layer's head-mean
attention probabilities, computed from its queries and keys by the two-loop (log-sum-exp) scheme of the fused
attention kernels that return statistics, never holding more than a (rows x keys) tile of scores:

1. `_lse_kernel`: per head and block of query rows, a loop over the keys by tiles keeps the running maximum and the
   running sum of exponentials (the online softmax); it leaves each row's log-sum-exp, (B, H, R) float32.
2. `_columns_kernel` (what every key receives) and `_rows_kernel` (the probabilities of some rows): a second loop
   recomputes each tile's scores and takes p = exp(s - lse) directly, normalised already, summing over the query
   rows (columns: per head and block of keys, heads added in torch after) or over the heads (rows: per block of rows
   and of keys, every head in the loop).

The read then costs at most one more q . k^T and one exp per score beyond the pass that found the log-sum-exp; no
(heads x queries x keys) tensor is made, and nothing asks the host anything (every shape is known before the data).
The scores follow the rule (ficoco.methods.reads): under the model rule in half precision each score is rounded to the
model's dtype after the product and after the scale, and each probability after the softmax, as eager attention rounds
them (the normaliser is the log-sum-exp's, within a float32 rounding of eager's sum); under the float32 rule all of it
is float32. Rows are given by position
((B, R) indices), so a causal layer's read sees, for each row, the keys up to ``position + Tk - Tq``.

Tested on the CPU under Triton's interpreter (TRITON_INTERPRET=1, tests/test_triton_reads.py) and on CUDA under the
``gpu`` marker; `benchmarks/gpu_run.sh` times them beside the model's SDPA (benchmarks/time_reads.py).
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

try:  # Triton is a GPU extra; without it the reads run in torch (ficoco.methods.reads.ops)
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is absent
    triton = None
    tl = None

# Tiles: query rows and keys per program (at least 16 each: tl.dot's smallest operand).
BLOCK_ROWS = 32
BLOCK_KEYS = 64


def available(device: torch.device | str | None = None) -> bool:
    """Whether the kernels run for tensors on `device`: Triton importable, and a CUDA device, or any device under
    Triton's interpreter (TRITON_INTERPRET=1, the CPU tests)."""
    if triton is None:
        return False
    kind = torch.device(device).type if device is not None else "cuda"
    return kind == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


if triton is not None:

    @triton.jit
    def _scores(q, k_ptr, kv_base, cols, Tk, stride_kt, dims, DIM: tl.constexpr, scale, ROUND: tl.constexpr):
        """A tile's scores: the (rows, DIM) queries `q` against keys `cols`, times `scale`, in float32; with ROUND
        (the model rule in half precision) rounded to the model's dtype after the product and after the scale, as
        eager attention's ``(q @ k^T) * scaling`` is."""
        k = tl.load(k_ptr + kv_base + cols[None, :] * stride_kt + dims[:, None],
                    mask=(cols[None, :] < Tk) & (dims[:, None] < DIM), other=0.0)
        s = tl.dot(q, k, out_dtype=tl.float32)
        if ROUND:
            s = s.to(q.dtype).to(tl.float32)
            return (s * scale).to(q.dtype).to(tl.float32)
        return s * scale

    @triton.jit
    def _probabilities(s, lse, visible, dtype, ROUND: tl.constexpr):
        """exp(s - lse) where visible, else 0; with ROUND rounded to the model's dtype, as eager's softmax output is."""
        p = tl.where(visible, tl.exp(s - lse[:, None]), 0.0)
        if ROUND:
            p = p.to(dtype).to(tl.float32)
        return p

    @triton.jit
    def _queries(q_ptr, base, rows, stride_qr, dims, row_valid, DIM: tl.constexpr):
        """One head's query rows `rows` (rows, DIM_P), zero past the head width and on rows past the end."""
        return tl.load(q_ptr + base + rows[:, None] * stride_qr + dims[None, :],
                       mask=row_valid[:, None] & (dims[None, :] < DIM), other=0.0)

    @triton.jit
    def _visible(positions, cols, Tk, offset, row_valid, CAUSAL: tl.constexpr):
        valid = row_valid[:, None] & (cols[None, :] < Tk)
        if CAUSAL:
            valid = valid & (cols[None, :] <= positions[:, None] + offset)
        return valid

    @triton.jit
    def _lse_kernel(q_ptr, pos_ptr, k_ptr, lse_ptr, scale, H, groups, R, Tk, offset,
                    stride_qb, stride_qh, stride_qr, stride_kb, stride_kh, stride_kt,
                    DIM: tl.constexpr, DIM_P: tl.constexpr, BR: tl.constexpr, BN: tl.constexpr,
                    CAUSAL: tl.constexpr, ROUND: tl.constexpr):
        block = tl.program_id(0)
        bh = tl.program_id(1)
        b, h = bh // H, bh % H
        rows = block * BR + tl.arange(0, BR)
        dims = tl.arange(0, DIM_P)
        row_valid = rows < R
        q = _queries(q_ptr, b * stride_qb + h * stride_qh, rows, stride_qr, dims, row_valid, DIM)
        positions = tl.load(pos_ptr + b * R + rows, mask=row_valid, other=0)
        kv_base = b * stride_kb + (h // groups) * stride_kh
        top = tl.full([BR], -1.0e30, tl.float32)
        total = tl.zeros([BR], tl.float32)
        for start in range(0, Tk, BN):
            cols = start + tl.arange(0, BN)
            s = _scores(q, k_ptr, kv_base, cols, Tk, stride_kt, dims, DIM, scale, ROUND)
            s = tl.where(_visible(positions, cols, Tk, offset, row_valid, CAUSAL), s, float("-inf"))
            new_top = tl.maximum(top, tl.max(s, 1))
            total = total * tl.exp(top - new_top) + tl.sum(tl.exp(s - new_top[:, None]), 1)
            top = new_top
        tl.store(lse_ptr + (b * H + h) * R + rows, top + tl.log(tl.where(row_valid, total, 1.0)), mask=row_valid)

    @triton.jit
    def _columns_kernel(q_ptr, pos_ptr, k_ptr, lse_ptr, out_ptr, scale, H, groups, R, Tk, offset,
                        stride_qb, stride_qh, stride_qr, stride_kb, stride_kh, stride_kt,
                        DIM: tl.constexpr, DIM_P: tl.constexpr, BR: tl.constexpr, BN: tl.constexpr,
                        CAUSAL: tl.constexpr, ROUND: tl.constexpr):
        block = tl.program_id(0)
        bh = tl.program_id(1)
        b, h = bh // H, bh % H
        cols = block * BN + tl.arange(0, BN)
        dims = tl.arange(0, DIM_P)
        kv_base = b * stride_kb + (h // groups) * stride_kh
        received = tl.zeros([BN], tl.float32)
        for start in range(0, R, BR):
            rows = start + tl.arange(0, BR)
            row_valid = rows < R
            q = _queries(q_ptr, b * stride_qb + h * stride_qh, rows, stride_qr, dims, row_valid, DIM)
            positions = tl.load(pos_ptr + b * R + rows, mask=row_valid, other=0)
            lse = tl.load(lse_ptr + (b * H + h) * R + rows, mask=row_valid, other=0.0)
            s = _scores(q, k_ptr, kv_base, cols, Tk, stride_kt, dims, DIM, scale, ROUND)
            visible = _visible(positions, cols, Tk, offset, row_valid, CAUSAL)
            received += tl.sum(_probabilities(s, lse, visible, q.dtype, ROUND), 0)
        tl.store(out_ptr + (b * H + h) * Tk + cols, received, mask=cols < Tk)

    @triton.jit
    def _rows_kernel(q_ptr, pos_ptr, k_ptr, lse_ptr, out_ptr, scale, H, groups, R, Tk, offset,
                     stride_qb, stride_qh, stride_qr, stride_kb, stride_kh, stride_kt,
                     DIM: tl.constexpr, DIM_P: tl.constexpr, BR: tl.constexpr, BN: tl.constexpr,
                     CAUSAL: tl.constexpr, ROUND: tl.constexpr):
        block_rows = tl.program_id(0)
        block_keys = tl.program_id(1)
        b = tl.program_id(2)
        rows = block_rows * BR + tl.arange(0, BR)
        cols = block_keys * BN + tl.arange(0, BN)
        dims = tl.arange(0, DIM_P)
        row_valid = rows < R
        positions = tl.load(pos_ptr + b * R + rows, mask=row_valid, other=0)
        visible = _visible(positions, cols, Tk, offset, row_valid, CAUSAL)
        summed = tl.zeros([BR, BN], tl.float32)
        for h in range(0, H):
            q = _queries(q_ptr, b * stride_qb + h * stride_qh, rows, stride_qr, dims, row_valid, DIM)
            lse = tl.load(lse_ptr + (b * H + h) * R + rows, mask=row_valid, other=0.0)
            s = _scores(q, k_ptr, b * stride_kb + (h // groups) * stride_kh, cols, Tk, stride_kt, dims, DIM, scale,
                        ROUND)
            summed += _probabilities(s, lse, visible, q.dtype, ROUND)
        tl.store(out_ptr + (b * R + rows[:, None]) * Tk + cols[None, :], summed / H,
                 mask=row_valid[:, None] & (cols[None, :] < Tk))


def _prepared(query: Tensor, key: Tensor, positions: Tensor, scores: str) -> tuple[Tensor, Tensor, Tensor, dict]:
    """Contiguous queries (B, H, R, d), keys (B, H_kv, Tk, d), positions (B, R) int64, and the launch's shapes;
    `scores` the rule (ficoco.methods.reads): the model's roundings in half precision, else float32 throughout."""
    batch, heads, count, dim = query.shape
    query, key = query.contiguous(), key.contiguous()
    rounded = scores == "model" and query.dtype in (torch.float16, torch.bfloat16)
    if scores != "model":
        query, key = query.float(), key.float()
    positions = positions.to(device=query.device, dtype=torch.int64).expand(batch, count).contiguous()
    shapes = {"H": heads, "groups": heads // key.shape[1], "R": count, "Tk": key.shape[2],
              "strides": (*query.stride()[:3], *key.stride()[:3]),
              "DIM": dim, "DIM_P": max(16, triton.next_power_of_2(dim)), "ROUND": rounded}
    return query, key, positions, shapes


def _lse(query: Tensor, key: Tensor, positions: Tensor, scale: float, offset: int, causal: bool,
         shapes: dict) -> Tensor:
    batch = query.shape[0]
    out = torch.empty(batch, shapes["H"], shapes["R"], dtype=torch.float32, device=query.device)
    grid = (triton.cdiv(shapes["R"], BLOCK_ROWS), batch * shapes["H"])
    _lse_kernel[grid](query, positions, key, out, scale, shapes["H"], shapes["groups"], shapes["R"], shapes["Tk"],
                      offset, *shapes["strides"], DIM=shapes["DIM"], DIM_P=shapes["DIM_P"], BR=BLOCK_ROWS,
                      BN=BLOCK_KEYS, CAUSAL=causal, ROUND=shapes["ROUND"])
    return out


def column_sum(query: Tensor, key: Tensor, positions: Tensor, scale: float | None = None, *, causal: bool = False,
               q_len: int | None = None, scores: str = "model") -> Tensor:
    """(B, Tk) float32: what every key receives from the query rows `query` (B, H, R, d) at `positions` ((R,) or
    (B, R) among the layer's `q_len` queries, default R), summed over those rows, head-mean. Keys (B, H_kv, Tk, d)."""
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    query, key, positions, shapes = _prepared(query, key, positions, scores)
    offset = shapes["Tk"] - (q_len if q_len is not None else shapes["R"])
    lse = _lse(query, key, positions, scale, offset, causal, shapes)
    batch = query.shape[0]
    per_head = torch.empty(batch, shapes["H"], shapes["Tk"], dtype=torch.float32, device=query.device)
    grid = (triton.cdiv(shapes["Tk"], BLOCK_KEYS), batch * shapes["H"])
    _columns_kernel[grid](query, positions, key, lse, per_head, scale, shapes["H"], shapes["groups"], shapes["R"],
                          shapes["Tk"], offset, *shapes["strides"], DIM=shapes["DIM"], DIM_P=shapes["DIM_P"],
                          BR=BLOCK_ROWS, BN=BLOCK_KEYS, CAUSAL=causal, ROUND=shapes["ROUND"])
    return per_head.mean(dim=1)


def rows(query: Tensor, key: Tensor, positions: Tensor, scale: float | None = None, *, causal: bool = False,
         q_len: int | None = None, scores: str = "model") -> Tensor:
    """(B, R, Tk) float32: the head-mean probabilities of the query rows `query` (B, H, R, d) at `positions` over
    every key (as `column_sum`)."""
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    query, key, positions, shapes = _prepared(query, key, positions, scores)
    offset = shapes["Tk"] - (q_len if q_len is not None else shapes["R"])
    lse = _lse(query, key, positions, scale, offset, causal, shapes)
    batch = query.shape[0]
    out = torch.empty(batch, shapes["R"], shapes["Tk"], dtype=torch.float32, device=query.device)
    grid = (triton.cdiv(shapes["R"], BLOCK_ROWS), triton.cdiv(shapes["Tk"], BLOCK_KEYS), batch)
    _rows_kernel[grid](query, positions, key, lse, out, scale, shapes["H"], shapes["groups"], shapes["R"],
                       shapes["Tk"], offset, *shapes["strides"], DIM=shapes["DIM"], DIM_P=shapes["DIM_P"],
                       BR=BLOCK_ROWS, BN=BLOCK_KEYS, CAUSAL=causal, ROUND=shapes["ROUND"])
    return out
