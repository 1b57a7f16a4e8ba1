"""The head-max read (ficoco.methods.reads, ``heads="max"``: FitPrune's statistic): every read of it equals the
largest of the heads' eager probabilities (the model rule: scores and scale in the model's dtype, softmax in
float32 rounded back), whatever the block size, the mask, the grouped heads or whether the layer is read whole;
ficoco's CPU kernel (softmax_sums.c's rowmax) gives the torch reads' values; a head-mean reader is unchanged."""

from __future__ import annotations

import pytest
import torch

from ficoco.methods.reads import native
from ficoco.methods.reads import ops as reads_ops
from ficoco.methods.reads.ops import ProbedAttention, stack_reads


def eager_head_max(query: torch.Tensor, key: torch.Tensor, scale: float, mask: torch.Tensor | None = None,
                   causal: bool = False) -> torch.Tensor:
    """(B, Tq, Tk) the largest probability any head gives a query and key, as transformers' eager attention
    computes the probabilities and FitPrune takes ``attn_weights.max(dim=1)`` of them."""
    groups = query.shape[1] // key.shape[1]
    key = key.repeat_interleave(groups, dim=1)
    scores = torch.matmul(query, key.transpose(-1, -2)) * scale
    q_len, k_len = query.shape[2], key.shape[2]
    if mask is None and causal:
        mask = torch.ones(q_len, k_len, dtype=torch.bool).tril(k_len - q_len)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probabilities = torch.softmax(scores, dim=-1, dtype=torch.float32).to(scores.dtype)
    return torch.nan_to_num(probabilities.float()).amax(dim=1)


def qk(batch: int = 2, heads: int = 4, kv_heads: int = 2, tokens: int = 11, dim: int = 8,
       dtype: torch.dtype = torch.float32, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    query = (torch.randn(batch, heads, tokens, dim, generator=generator) * 2).to(dtype)
    key = (torch.randn(batch, kv_heads, tokens, dim, generator=generator) * 2).to(dtype)
    return query, key


@pytest.mark.parametrize("whole", [False, True], ids=["by-blocks", "whole"])
@pytest.mark.parametrize("mask_kind", ["causal", "padding"])
@pytest.mark.parametrize("budget", [None, 1], ids=["one-block", "one-row"])
def test_head_max_reads_equal_the_largest_eager_probability(monkeypatch: pytest.MonkeyPatch, whole: bool,
                                                            mask_kind: str, budget: int | None) -> None:
    monkeypatch.setattr(reads_ops, "WHOLE_READ_SCORES", 1 << 20 if whole else 0)
    monkeypatch.setenv(native.ENV, "torch")  # the torch reference; the kernel is held against it below
    query, key = qk()
    scale = query.shape[-1] ** -0.5
    mask = None
    if mask_kind == "padding":
        real = torch.ones(2, 11, dtype=torch.bool)
        real[1, :3] = False  # three left pads in the second sample
        mask = (torch.ones(11, 11, dtype=torch.bool).tril() & real[:, None, :])[:, None]
    reads = ProbedAttention(query, key, scale, mask=mask, causal=mask is None, budget=budget, heads="max")
    expected = eager_head_max(query, key, scale, mask, causal=mask is None)
    rows = torch.tensor([[3, 5, 10], [4, 6, 9]])
    cols = torch.tensor([[0, 2], [1, 3]])
    torch.testing.assert_close(reads.rows(rows, last=10), torch.stack([expected[b, rows[b]] for b in range(2)]))
    torch.testing.assert_close(reads.block(rows, cols, last=10),
                               torch.stack([expected[b, rows[b]][:, cols[b]] for b in range(2)]))
    torch.testing.assert_close(reads.column_sum(), expected.sum(dim=1))
    # The head-max is not the head-mean (the test would pass a reader that ignored `heads` otherwise).
    mean = ProbedAttention(query, key, scale, mask=mask, causal=mask is None, budget=budget)
    assert (mean.rows(rows, last=10) < reads.rows(rows, last=10) - 1e-3).any()


def test_a_head_max_reader_keeps_its_statistic_when_reordered_or_stacked() -> None:
    query, key = qk(batch=1)
    reads = ProbedAttention(query, key, causal=True, heads="max")
    order = torch.arange(10, -1, -1)
    assert reads.reordered(order).heads == "max"
    stacked = stack_reads([reads, ProbedAttention(query, key, causal=True, heads="max")])
    assert isinstance(stacked, ProbedAttention) and stacked.heads == "max"
    # Readers of different statistics are never one batched read.
    assert not isinstance(stack_reads([reads, ProbedAttention(query, key, causal=True)]), ProbedAttention)


def test_an_unknown_head_statistic_is_refused() -> None:
    query, key = qk(batch=1)
    with pytest.raises(ValueError, match="heads must be one of mean, max"):
        ProbedAttention(query, key, heads="median")


@pytest.mark.skipif(native.status().kernel != "native", reason=f"no native read kernel: {native.status().reason}")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("causal", [False, True])
def test_the_native_kernels_head_max_rows_match_torch(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype,
                                                       causal: bool) -> None:
    monkeypatch.setattr(reads_ops, "WHOLE_READ_SCORES", 0)
    query, key = qk(batch=2, heads=8, kv_heads=2, tokens=300, dim=24, dtype=dtype)
    reads = ProbedAttention(query, key, causal=causal, budget=8 * 300 * 37, heads="max")
    rows = torch.stack([torch.arange(10, 290, 7), torch.arange(3, 283, 7)])
    assert reads._kernel() is not None
    fused = reads.rows(rows, last=289)
    monkeypatch.setenv(native.ENV, "torch")
    plain = reads.rows(rows, last=289)
    assert fused.dtype == plain.dtype == torch.float32
    # The kernel's float32 steps (exp, the sum's order) are its own: float32 probabilities a few ulps from torch's,
    # and rarely a bfloat16 one a step (2^-8 of it) away; a bfloat16 maximum is otherwise the same value.
    torch.testing.assert_close(fused, plain, rtol=4e-3, atol=1e-6)
    if dtype == torch.bfloat16:
        assert (fused == plain).float().mean() > 0.99
