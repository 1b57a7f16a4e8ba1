"""ficoco's Triton reads (ficoco.methods.reads.ops.triton_kernels), on the CPU under Triton's interpreter
(TRITON_INTERPRET=1, small shapes) and on a GPU under the ``gpu`` marker: the two-loop (log-sum-exp) column sums and
rows equal the eager probabilities' (model rule and float32 rule, causal and not, grouped heads), and a layer's reads
route through them where FICOCO_READ_KERNEL says so (on a GPU: by default)."""

from __future__ import annotations

import os

import pytest
import torch
from test_attention_reads import eager_probabilities

pytest.importorskip("triton")

from ficoco.methods.reads import ops as reads_ops  # noqa: E402
from ficoco.methods.reads.ops import ProbedAttention  # noqa: E402
from ficoco.methods.reads.ops import triton_kernels as triton_reads  # noqa: E402


@pytest.fixture(params=["cpu-interpreter", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request, monkeypatch) -> str:
    if request.param == "cpu-interpreter":
        if os.environ.get("TRITON_INTERPRET") != "1":
            # The interpreter is chosen when a kernel is first built: a process of its own.
            pytest.skip("the interpreter runs in a process of its own (test_under_the_interpreter)")
        return "cpu"
    return "cuda"


def tensors(device, batch=2, heads=4, kv_heads=2, length=45, dim=24, dtype=torch.float32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    query = (torch.randn(batch, heads, length, dim, generator=generator) * 1.5).to(dtype)
    key = (torch.randn(batch, kv_heads, length, dim, generator=generator) * 1.5).to(dtype)
    return query.to(device), key.to(device)


@pytest.mark.parametrize("causal", [False, True], ids=["tower", "decoder"])
@pytest.mark.parametrize("rule", ["model", "float32"])
def test_column_sums_and_rows_equal_the_eager_probabilities(device, causal, rule) -> None:
    dtype = torch.float16 if rule == "model" else torch.float32  # the model rule's roundings, in half precision
    query, key = tensors(device, dtype=dtype)
    scale = query.shape[-1] ** -0.5
    expected = eager_probabilities(query.cpu(), key.cpu(), scale, causal=causal, rule=rule)
    length = query.shape[2]
    sums = triton_reads.column_sum(query, key, torch.arange(length), scale, causal=causal, scores=rule)
    torch.testing.assert_close(sums.cpu(), expected.sum(dim=1), atol=2e-5, rtol=1e-5)
    rows = torch.tensor([[0, 5, 44], [3, 3, 10]], device=device)
    picked = torch.gather(query, 2, rows[:, None, :, None].expand(-1, query.shape[1], -1, query.shape[-1]))
    read = triton_reads.rows(picked, key, rows, scale, causal=causal, q_len=length, scores=rule)
    torch.testing.assert_close(read.cpu(), torch.gather(expected, 1, rows.cpu()[:, :, None].expand(-1, -1, length)),
                               atol=2e-6, rtol=1e-5)
    # The model rule's roundings matter in half precision: the float32 rule's probabilities are not these.
    if rule == "model":
        plain = eager_probabilities(query.cpu(), key.cpu(), scale, causal=causal, rule="float32")
        assert (sums.cpu() - plain.sum(dim=1)).abs().max() > 1e-4


def test_a_layers_reads_route_through_the_triton_kernels(device, monkeypatch) -> None:
    monkeypatch.setenv("FICOCO_READ_KERNEL", "triton")
    monkeypatch.setattr(reads_ops, "WHOLE_READ_SCORES", 0)  # by blocks, as a real layer is read
    query, key = tensors(device, batch=1, length=40)
    reads = ProbedAttention(query, key, causal=True, budget=1 << 30)
    called = []
    original = triton_reads.column_sum
    monkeypatch.setattr(triton_reads, "column_sum", lambda *a, **k: called.append(1) or original(*a, **k))
    expected = eager_probabilities(query.cpu(), key.cpu(), query.shape[-1] ** -0.5, causal=True)
    torch.testing.assert_close(reads.column_mean(first_row=1).cpu(), expected[:, 1:].mean(dim=1), atol=1e-6,
                               rtol=1e-5)
    assert called


def test_under_the_interpreter() -> None:
    """The tests above under TRITON_INTERPRET=1 on the CPU, in a process of their own (the interpreter is chosen
    when Triton first builds a kernel), so that CI runs them without a GPU."""
    import subprocess
    import sys

    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("already under the interpreter")
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not gpu",
                           "-k", "not test_under_the_interpreter", __file__],
                          env={**os.environ, "TRITON_INTERPRET": "1", "PYTEST_XDIST_WORKER": ""},
                          capture_output=True, text=True, timeout=600, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "5 passed" in done.stdout.splitlines()[-1], done.stdout[-500:]
