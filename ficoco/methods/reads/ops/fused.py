"""A reducing layer's attention and the method's read of it in one pass, on a CPU.

A method that reads a layer's attention needs the probabilities the layer computes anyway. Run beside the model's
own kernel (SDPA), a read computes them a second time: the products q . k^T, the softmax's passes and the
statistic, about what the layer's attention itself costs. `fused_attention` computes the layer's output and the
read together, as FlashAttention-style kernels that return statistics do: by blocks of query rows whose scores stay
near the caches, each block's products once (torch's matrix product), then one native pass per row (scale, softmax
with the model rule's roundings, the probabilities written back for P . V and added over the heads into the head-mean
matrix; ficoco.methods.reads.native), then P . V (torch's matrix product). The read's own cost is one add per
probability; every later read of the layer (column sums, rows, blocks) is answered from the (B, Tq, Tk) head-mean
(head-max) matrix it leaves.

Its output is the model's eager attention, computed by blocks: the scores in the model's dtype, scaled in that
dtype, the softmax in float32 rounded to the model's dtype, P . V in it; it equals SDPA's within the dtype's
tolerance (tests/test_fused_attention.py). On a CPU without bfloat16 dot-product instructions (AVX2 alone) the two
bfloat16 products run in float32 and are rounded once (ficoco.methods.reads.ops.widened_products: torch's bfloat16
matmul is ~100x slower there, SDPA is not). Under the float32 rule (``attention_scores="float32"``) the scores,
probabilities and P . V run in float32 and the output is rounded to the model's dtype.

It runs where the native kernel computes the layer (`fusable`): a CPU, bfloat16 or float32 scores, no mask but the
causal rule, nothing recording gradients, tracing or counting, and a head-mean matrix of at most
`FUSED_MATRIX_ELEMENTS`; elsewhere the layer runs the model's kernel and the reads are computed beside it
(ficoco.methods.reads.ops.ProbedAttention). A layer no method reads always runs the model's kernel.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ficoco.methods.reads import DEFAULT_ATTENTION_SCORES
from ficoco.methods.reads.ops import ProbedAttention, ReadRunner, widened_products

# The largest head-mean matrix (all sequences x queries x keys, float32) a fused pass leaves: 64 M values, 256 MB
# (Qwen3-VL's 2,304-token tower layer for a batch of 8 is 42 M; LLaVA-NeXT's ~2,900-token decoder 8.4 M).
FUSED_MATRIX_ELEMENTS = 1 << 26

# Scores one block of a fused pass holds (every head of some query rows over every key): 8 M. Larger blocks than a
# read's (ficoco.methods.reads.ops.NATIVE_SCORE_BUDGET, 4 M): here the two products dominate, and torch's run faster
# on more rows (Qwen3-VL-8B's 2,304-token tower layer, float32, 2-core AVX2 EPYC: 412 ms a pass at 4 M, 330 at 8 M,
# 330 at 16 M, against SDPA's 249; LLaVA-1.5's 650-token decoder layer about SDPA's time at every size).
FUSED_SCORE_BUDGET = 1 << 23


def fusable(query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None, scores: str = DEFAULT_ATTENTION_SCORES,
            dropout: float = 0.0, **kwargs: Any) -> bool:
    """Whether `fused_attention` computes this attention call (see the module's docstring); `kwargs` the call's
    other arguments to the model's attention function (a soft cap, a sliding window or attention sinks: not fused)."""
    if mask is not None or dropout or query.device.type != "cpu" or query.shape[2] < 2:
        return False
    if any(kwargs.get(name) is not None for name in ("softcap", "sliding_window", "s_aux", "position_bias")):
        return False
    batch, heads, q_len, dim = query.shape
    if value.shape[:3] != key.shape[:3] or heads % key.shape[1] or key.shape[-1] != dim:
        return False
    if batch * q_len * key.shape[2] > FUSED_MATRIX_ELEMENTS:
        return False
    probe = ProbedAttention(query, key, scores=scores)
    return probe._kernel() is not None


def fused_attention(query: Tensor, key: Tensor, value: Tensor, scale: float | None = None, *, causal: bool = False,
                    scores: str = DEFAULT_ATTENTION_SCORES, heads: str = "mean",
                    runner: ReadRunner | None = None, budget: int | None = None) -> tuple[Tensor, ProbedAttention]:
    """The layer's output (B, H, Tq, d_v) in the value's dtype, and its reads (a `ProbedAttention` holding the
    head-mean, or with ``heads="max"`` head-max, probabilities of every row), from queries (B, H, Tq, d), keys and
    values (B, H_kv, Tk, d) in one pass. Call it where `fusable` says so. `runner` runs the reads later asked of the
    matrix (and of raw scores: ``logits`` is computed from the queries and keys)."""
    from ficoco.methods.reads import native

    kernel = native.library()
    reads = ProbedAttention(query, key, scale, causal=causal, scores=scores, runner=runner, heads=heads,
                            budget=budget or FUSED_SCORE_BUDGET)
    batch, query_heads, q_len, _ = query.shape
    kv_heads, k_len = key.shape[1], key.shape[2]
    model_rule = reads.scores == "model"
    # P . V in the probabilities' dtype: the model's under the model rule (in float32 rounded to it where its own
    # products are slow: widened_products), float32 under the float32 rule.
    widened = model_rule and widened_products(value.dtype, value.device)
    values = (value if model_rule and not widened else value.float()).contiguous()
    # In the model's dtype under the model rule (a widened P . V is rounded to it as it is written), else float32.
    output = torch.empty(batch, query_heads, q_len, value.shape[-1], dtype=value.dtype if model_rule else torch.float32)
    combined = torch.zeros(batch, q_len, k_len, dtype=torch.float32)
    threads = torch.get_num_threads()
    for b0, b1, r0, r1, block, limits, kernel_scale in reads._score_blocks(None, 0):
        n, _, width, keys = block.shape
        attend = kernel.ficoco_attend_bf16 if block.dtype == torch.bfloat16 else kernel.ficoco_attend_f32
        attend(block.data_ptr(), n, query_heads, width, keys, kernel_scale,
               None if limits is None else limits.data_ptr(), combined[b0, r0].data_ptr(), q_len * k_len, k_len,
               int(heads == "max"), threads)
        # (n, H_kv, g x rows, keys) @ (n, H_kv, keys, d): a key head's query heads stacked, as the products were.
        stacked = block.view(n, kv_heads, -1, keys)
        product = torch.matmul(stacked.float() if widened else stacked, values[b0:b1, :, :keys])
        output[b0:b1, :, r0:r1] = product.view(n, query_heads, width, -1)
    if heads == "mean":
        combined.div_(query_heads)
    reads.hold(combined)
    return output.to(value.dtype), reads
