"""A method's reads of a layer's attention (ficoco.methods.reads): they equal the eager attention's own
probabilities (the model rule) or today's float32 ones, whatever the block size, the mask or the grouped
heads; no read ever holds a (heads x queries x keys) tensor; the probed layer's output is its own kernel's;
a read's time goes into the "probe" span and out of the step that asked for it."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from ficoco.methods.reads import ops as reads_ops
from ficoco.methods.reads.ops import (
    DenseAttention,
    GroupReads,
    ProbedAttention,
    SegmentedReads,
    StackedReads,
    stack_reads,
)
from ficoco.models.attention import ProbeSlot, probe_attention
from ficoco.models.stage_timer import StageTimer


def eager_probabilities(query, key, scale, mask=None, causal=False, rule="model") -> torch.Tensor:
    """(B, Tq, Tk) head-mean probabilities as transformers' eager attention computes them (the model rule:
    q @ k^T then the scale in the model's dtype, the mask added, softmax in float32 cast back), or in float32."""
    groups = query.shape[1] // key.shape[1]
    key = key.repeat_interleave(groups, dim=1)
    if rule == "model":
        scores = torch.matmul(query, key.transpose(-1, -2)) * scale
    else:
        scores = torch.matmul((query * scale).float(), key.float().transpose(-1, -2))
    q_len, k_len = query.shape[2], key.shape[2]
    if mask is None and causal:
        mask = torch.ones(q_len, k_len, dtype=torch.bool).tril(k_len - q_len)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    probabilities = torch.softmax(scores, dim=-1, dtype=torch.float32).to(scores.dtype)
    return torch.nan_to_num(probabilities.float()).mean(dim=1)


def qkv(batch=2, heads=4, kv_heads=2, q_len=9, k_len=9, dim=8, dtype=torch.float32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    query = (torch.randn(batch, heads, q_len, dim, generator=generator) * 2).to(dtype)
    key = (torch.randn(batch, kv_heads, k_len, dim, generator=generator) * 2).to(dtype)
    return query, key


def masks(kind: str, batch: int, length: int, dtype: torch.dtype):
    if kind == "causal":
        return None, True
    if kind == "bidirectional":
        return None, False
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    real = torch.ones(batch, length, dtype=torch.bool)
    real[-1, :2] = False  # two left pads in the last sample
    boolean = (causal & real[:, None, :])[:, None]
    if kind == "padding-bool":
        return boolean, False
    additive = torch.zeros(boolean.shape, dtype=dtype).masked_fill(~boolean, torch.finfo(dtype).min)
    return additive, False


@pytest.fixture(params=["by-blocks", "whole"])
def read_whole(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """Both ways a layer is read: by blocks of rows, or whole at the first read (a small layer)."""
    monkeypatch.setattr(reads_ops, "WHOLE_READ_SCORES", 1 << 20 if request.param == "whole" else 0)
    return request.param == "whole"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", ["causal", "bidirectional", "padding-bool", "padding-additive"])
@pytest.mark.parametrize("budget", [None, 64, 1], ids=["one-block", "blocks", "one-row"])
def test_every_read_equals_the_eager_probabilities(dtype, kind, budget, read_whole) -> None:
    query, key = qkv(dtype=dtype)
    mask, causal = masks(kind, query.shape[0], query.shape[2], dtype)
    scale = query.shape[-1] ** -0.5
    dense = DenseAttention(eager_probabilities(query, key, scale, mask, causal))
    reads = ProbedAttention(query, key, scale, mask=mask, causal=causal, budget=budget)
    rows = torch.tensor([[0, 8, 3], [5, 5, 1]])
    cols = torch.tensor([[2, 7], [0, 4]])
    close = {"atol": 1e-6, "rtol": 1e-5}
    torch.testing.assert_close(reads.column_sum(), dense.column_sum(), **close)
    torch.testing.assert_close(reads.column_sum(rows), dense.column_sum(rows), **close)
    torch.testing.assert_close(reads.column_mean(first_row=3), dense.column_mean(first_row=3), **close)
    torch.testing.assert_close(reads.rows(rows), dense.rows(rows), **close)
    torch.testing.assert_close(reads.block(rows, cols), dense.block(rows, cols), **close)


@pytest.mark.parametrize("rule", ["model", "float32"])
@pytest.mark.parametrize("budget", [None, 64, 1], ids=["one-block", "blocks", "one-row"])
def test_a_logits_read_is_the_head_mean_raw_scores_before_mask_and_softmax(rule, budget, read_whole) -> None:
    """FiCoCo's rule="official" reads the head-mean q . k^T * scale of some rows over every key, a causal layer's
    later keys included, never from the whole matrix of probabilities a small layer keeps (issue 53)."""
    query, key = qkv(dtype=torch.bfloat16)
    scale = query.shape[-1] ** -0.5
    groups = query.shape[1] // key.shape[1]
    if rule == "model":
        raw = torch.matmul(query, key.repeat_interleave(groups, 1).transpose(-1, -2)) * scale
    else:
        raw = torch.matmul((query * scale).float(), key.repeat_interleave(groups, 1).float().transpose(-1, -2))
    expected = raw.float().mean(dim=1)
    reads = ProbedAttention(query, key, scale, causal=True, scores=rule, budget=budget)
    reads.column_sum()  # a small layer's whole matrix read first: the logits are not taken from it
    rows = torch.tensor([[0, 8, 3], [5, 5, 1]])
    got = reads.logits(rows)
    torch.testing.assert_close(got, torch.stack([expected[b, rows[b]] for b in range(2)]), atol=1e-5, rtol=1e-5)
    assert got[0, 0, 1:].abs().sum() > 0  # row 0's later keys, which the mask hides from its probabilities


def test_a_causal_read_of_rows_in_order_below_a_bound_reads_only_the_keys_they_can_see(monkeypatch) -> None:
    """FiCoCo-L's visual rows: in order, none after `last`; each tile of CAUSAL_TILE_ROWS rows reads the keys up
    to its bound (the others are masked: exactly zero), the same probabilities as every key, fewer scores."""
    from ficoco.methods import reads as reads_spec

    monkeypatch.setattr(reads_ops, "WHOLE_READ_SCORES", 0)
    monkeypatch.setattr(reads_spec, "CAUSAL_TILE_ROWS", 4)
    query, key = qkv(batch=2, q_len=40, k_len=40, dtype=torch.bfloat16)
    scale = query.shape[-1] ** -0.5
    dense = DenseAttention(eager_probabilities(query, key, scale, causal=True))
    rows = torch.stack([torch.arange(5, 17), torch.arange(8, 20)])  # in order, the last at most at 19
    cols = torch.arange(0, 40, 3).expand(2, -1)
    seen: list[int] = []
    reads = ProbedAttention(query, key, scale, causal=True)
    original = torch.matmul

    def counting(a, b, **kwargs):
        seen.append(b.shape[-1])
        return original(a, b, **kwargs)

    monkeypatch.setattr(torch, "matmul", counting)
    got = reads.rows(rows, last=19)
    monkeypatch.setattr(torch, "matmul", original)
    torch.testing.assert_close(got, dense.rows(rows), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(reads.block(rows, cols, last=19), dense.block(rows, cols), atol=1e-6, rtol=1e-5)
    # Tiles of 4 rows: rows 0-3 lie at most at 19 - 8 = 11 (keys 0..11), then 15, 19.
    assert seen == [12, 16, 20]
    assert reads_spec.causal_tiles(12, 19, 40, 40) == [(0, 4, 12), (4, 8, 16), (8, 12, 20)]


def test_the_float32_rule_is_the_earlier_probes_float32_softmax(read_whole) -> None:
    query, key = qkv(dtype=torch.bfloat16)
    scale = query.shape[-1] ** -0.5
    float32 = ProbedAttention(query, key, scale, causal=True, scores="float32")
    model = ProbedAttention(query, key, scale, causal=True)
    torch.testing.assert_close(float32.column_sum(), eager_probabilities(query, key, scale, causal=True,
                                                                         rule="float32").sum(dim=1))
    # In bfloat16 the two rules differ (the model's rounding), by little.
    assert not torch.equal(float32.column_sum(), model.column_sum())
    torch.testing.assert_close(float32.column_sum(), model.column_sum(), atol=0.05, rtol=0.05)
    with pytest.raises(ValueError, match="attention_scores"):
        ProbedAttention(query, key, scale, scores="fp8")


class LargestTensor(TorchDispatchMode):
    """The most elements any op's new output holds (views of its inputs are not new memory)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        given = {a.untyped_storage().data_ptr() for a in [*args, *(kwargs or {}).values()]
                 if isinstance(a, torch.Tensor)}
        for tensor in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(tensor, torch.Tensor) and tensor.untyped_storage().data_ptr() not in given:
                self.largest = max(self.largest, tensor.numel())
        return out


@settings(max_examples=25, deadline=None)
@given(heads=st.sampled_from([1, 2, 4]), length=st.integers(8, 96), budget=st.integers(1, 4096))
def test_no_read_holds_more_scores_than_its_budget(heads: int, length: int, budget: int) -> None:
    query, key = qkv(batch=1, heads=heads, kv_heads=1, q_len=length, k_len=length)
    rows = torch.arange(length).unsqueeze(0)
    for whole in (0, 1 << 20):
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(reads_ops, "WHOLE_READ_SCORES", whole)
            for read in ("column_sum", "column_mean", "rows"):
                reads = ProbedAttention(query, key, causal=True, budget=budget)
                with LargestTensor() as seen:
                    reads.rows(rows[:, :3]) if read == "rows" else getattr(reads, read)()
                # Never the (heads x queries x keys) matrix: one block of the budget or one row of every head,
                # and for a layer read whole its head-mean (queries x keys) matrix.
                assert seen.largest <= max(budget, heads * length, length * 3, length * length if whole else 0)


def test_segments_read_as_their_block_diagonal_and_stacks_as_their_batch(read_whole) -> None:
    parts = [qkv(batch=1, q_len=n, k_len=n, seed=n) for n in (3, 5, 4)]
    segmented = SegmentedReads([ProbedAttention(q, k) for q, k in parts])
    dense = torch.block_diag(*[eager_probabilities(q, k, q.shape[-1] ** -0.5)[0] for q, k in parts]).unsqueeze(0)
    rows = torch.tensor([[0, 4, 11, 7]])
    torch.testing.assert_close(segmented.column_sum(), dense.sum(dim=1))
    torch.testing.assert_close(segmented.rows(rows), DenseAttention(dense).rows(rows))
    torch.testing.assert_close(segmented.column_mean(), dense.mean(dim=1))
    items = [qkv(batch=1, seed=s) for s in range(3)]
    stacked = stack_reads([ProbedAttention(q, k) for q, k in items])
    assert isinstance(stacked, ProbedAttention)  # alike items: one batched read
    separate = StackedReads([ProbedAttention(q, k) for q, k in items])
    rows = torch.tensor([[1, 2], [0, 8], [4, 4]])
    torch.testing.assert_close(stacked.column_sum(), separate.column_sum())
    torch.testing.assert_close(stacked.block(rows, rows), separate.block(rows, rows))


def test_group_reads_are_the_member_means_and_reorder_permutes_queries_and_keys(read_whole) -> None:
    query, key = qkv(batch=2, q_len=9, k_len=9)  # [CLS] and two groups of 4
    probabilities = eager_probabilities(query, key, query.shape[-1] ** -0.5)
    grouped = GroupReads(ProbedAttention(query, key), merge=4, offset=1)
    block = probabilities[:, 1:, 1:].reshape(2, 2, 4, 2, 4).mean(dim=(2, 4))
    torch.testing.assert_close(grouped.column_mean(), block.mean(dim=1))
    groups = torch.tensor([[1], [0]])
    torch.testing.assert_close(grouped.rows(groups), DenseAttention(block).rows(groups))
    order = torch.tensor([0, 5, 6, 7, 8, 1, 2, 3, 4])
    reordered = ProbedAttention(query, key).reordered(order)
    torch.testing.assert_close(reordered.column_sum(), DenseAttention(probabilities).reordered(order).column_sum())


class Module(torch.nn.Module):
    is_causal = True

    def __init__(self, implementation: str = "sdpa") -> None:
        super().__init__()
        from types import SimpleNamespace

        self._ficoco_original_config = SimpleNamespace(_attn_implementation=implementation)


def test_the_probed_layer_runs_its_own_kernel_and_leaves_its_reads(read_whole, monkeypatch) -> None:
    # Where ficoco's fused pass does not run (here: told not to; elsewhere a mask, a GPU) the layer's output is the
    # model's own kernel's and the reads are computed beside it (tests/test_fused_attention.py: the fused pass).
    monkeypatch.setenv("FICOCO_READ_KERNEL", "torch")
    query, key = qkv(batch=2, heads=4, kv_heads=4)
    value = torch.randn_like(key)
    module = Module()
    timer = StageTimer()

    def runner(device, function, *args):
        with timer.span("probe", device):
            return function(*args)

    module._ficoco_probe = ProbeSlot(want_keys=True, runner=runner)
    output, _ = probe_attention(module, query, key, value, None, scaling=query.shape[-1] ** -0.5)
    own = torch.nn.functional.scaled_dot_product_attention(query, key, value, is_causal=True)
    assert torch.equal(output, own.transpose(1, 2).contiguous())  # the model's own SDPA, bit for bit
    assert timer.total_ms("probe") == 0.0  # nothing read yet
    reads, keys = module._ficoco_probe.take()
    assert keys is key
    torch.testing.assert_close(reads.column_sum(), eager_probabilities(query, key, query.shape[-1] ** -0.5,
                                                                       causal=True).sum(dim=1))
    assert timer.total_ms("probe") > 0.0
    # Read whole, the layer's scores are computed once: a second read computes no products.
    if read_whole:
        reads._products = None  # any product now would fail
        reads.rows(torch.tensor([[1, 2], [3, 4]]))

def test_a_read_inside_a_step_counts_in_the_probe_span_only() -> None:
    timer = StageTimer()
    cpu = torch.device("cpu")
    with timer.span("reduction", cpu):
        with timer.span("probe", cpu):
            torch.randn(200, 200) @ torch.randn(200, 200)
    total = timer.total_ms()
    assert timer.total_ms("probe") > 0 and timer.total_ms("reduction") >= 0
    assert timer.total_ms("probe") + timer.total_ms("reduction") == pytest.approx(total)
    assert reads_ops.SCORE_BUDGET_ELEMENTS["cuda"] > reads_ops.SCORE_BUDGET_ELEMENTS["cpu"]


def test_reads_run_inside_and_outside_inference_mode_alike() -> None:
    """A CPU read keeps its buffers between reads: one made under inference mode serves a read outside it."""
    query, key = qkv(batch=1, q_len=300, k_len=300)
    with torch.inference_mode():
        inside = ProbedAttention(query, key, budget=64 * 300 * 4).column_sum()
    outside = ProbedAttention(query, key, budget=64 * 300 * 4).column_sum()
    torch.testing.assert_close(inside, outside)
