"""ficoco's fused CPU read kernel (ficoco.methods.reads.native) against the reads in torch: the same rule's
probabilities (on bfloat16 scores all but about one in 10^5 bit for bit, those one bfloat16 step apart), the
same sums, the same kept tokens."""

from __future__ import annotations

import pytest
import torch

from ficoco.methods.reads import native
from ficoco.methods.reads import ops as reads_ops
from ficoco.methods.reads.ops import ProbedAttention, widened_products

pytestmark = pytest.mark.skipif(native.status().kernel != "native",
                                reason=f"the native read kernel is not built here: {native.status().reason}")


def _qk(batch: int, heads: int, kv_heads: int, tokens: int, dim: int, dtype: torch.dtype, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    query = (torch.randn(batch, heads, tokens, dim, generator=generator) * 1.5).to(dtype)
    key = (torch.randn(batch, kv_heads, tokens, dim, generator=generator) * 1.5).to(dtype)
    return query, key


def _both(monkeypatch: pytest.MonkeyPatch, read):  # noqa: ANN001, ANN202
    """`read()` with the kernel, then in torch."""
    assert native.library() is not None
    fused = read()
    monkeypatch.setenv(native.ENV, "torch")
    assert native.library() is None and native.status().reason.startswith(native.ENV)
    plain = read()
    monkeypatch.delenv(native.ENV)
    return fused, plain


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("scores", ["model", "float32"])
@pytest.mark.parametrize("causal", [False, True])
def test_column_sums_and_rows_match_torch(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, scores: str,
                                          causal: bool) -> None:
    # Grouped heads, two samples, blocks smaller than the layer (a budget of a few rows), causal tiles.
    query, key = _qk(2, 8, 2, 300, 24, dtype)
    reads = ProbedAttention(query, key, causal=causal, scores=scores, budget=8 * 300 * 37)
    rows = torch.stack([torch.arange(10, 290, 7), torch.arange(3, 283, 7)])
    for read in (lambda: reads.column_sum(), lambda: reads.column_mean(first_row=1),
                 lambda: reads.rows(rows, last=289), lambda: reads.block(rows, rows[:, :20], last=289)):
        fused, plain = _both(monkeypatch, read)
        assert fused.dtype == plain.dtype == torch.float32 and fused.shape == plain.shape
        # A sum may hold a probability one bfloat16 step (2^-8) from torch's: its share of the sum off by that.
        torch.testing.assert_close(fused, plain, rtol=4e-3, atol=1e-6)


def test_bfloat16_probabilities_are_the_rules(monkeypatch: pytest.MonkeyPatch) -> None:
    # One head: a row read returns the row's probabilities themselves. Scores rounded to bfloat16, scaled and
    # rounded, softmax in float32 and rounded, as the model's eager attention computes them; the float32 steps
    # (exp, the sum's order) are the kernel's own, so a probability whose float32 value lies within its last bit
    # of a bfloat16 rounding boundary may round the other way: one in about 10^5 (63 of 5.3 M measured).
    query, key = _qk(1, 1, 1, 1000, 72, torch.bfloat16, seed=3)
    reads = ProbedAttention(query, key)
    rows = torch.arange(0, 1000, 3).unsqueeze(0)
    fused, plain = _both(monkeypatch, lambda: reads.rows(rows))
    # transformers' eager attention itself (its softmax from a float32 copy: its float32 steps differ from
    # torch's bfloat16 softmax's as well), its products as the reads take them on this CPU: in bfloat16, or in
    # float32 rounded once where bfloat16's own are slow (widened_products).
    products = ((query.float() @ key.float().transpose(-1, -2)).to(torch.bfloat16)
                if widened_products(torch.bfloat16, query.device) else query @ key.transpose(-1, -2))
    eager = torch.softmax(products * 72 ** -0.5, dim=-1, dtype=torch.float32).to(torch.bfloat16)
    eager = eager[0, 0, rows[0]].float().unsqueeze(0)
    for read in (fused, plain):
        differing = read != eager
        assert differing.sum() <= 1e-4 * read.numel()
        step = eager.abs() * 2.0 ** -7  # one bfloat16 step, at most
        assert bool(((read - eager).abs() <= step)[differing].all())


def test_widened_products_are_as_close_to_exact_as_bfloat16s_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where bfloat16 products run in float32 and are rounded once (a CPU without bfloat16 dot-product
    instructions), the scores are those products rounded, no farther from exact products than torch's bfloat16
    matmul; float32, another device and a CPU with those instructions never widen."""
    query, key = _qk(1, 1, 1, 600, 72, torch.bfloat16, seed=7)
    monkeypatch.setattr(reads_ops, "widened_products", lambda dtype, device: dtype == torch.bfloat16)
    reads = ProbedAttention(query, key, budget=1 << 30)
    (*_, scores, _, keys), = list(reads._products(None, 0))
    widened = scores.clone()[0, 0]
    exact = query[0, 0].double() @ key[0, 0].double().T
    own = query[0, 0] @ key[0, 0].T
    assert widened.dtype == torch.bfloat16 and keys == 600
    assert torch.equal(widened, (query[0, 0].float() @ key[0, 0].float().T).to(torch.bfloat16))
    assert (widened.double() - exact).abs().max() <= (own.double() - exact).abs().max()
    monkeypatch.undo()
    assert not widened_products(torch.float32, torch.device("cpu"))
    assert not widened_products(torch.bfloat16, torch.device("meta"))
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    assert not widened_products(torch.bfloat16, torch.device("cpu"))


def test_kept_tokens_are_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    # What a filter keeps from the column means (FiCoCo-V's, HoliTom's): the same tokens either way.
    query, key = _qk(1, 16, 16, 1200, 72, torch.bfloat16, seed=5)
    reads = ProbedAttention(query, key)
    fused, plain = _both(monkeypatch, lambda: reads.column_mean(first_row=1))
    assert torch.equal(fused.topk(300).indices.sort().values, plain.topk(300).indices.sort().values)


def test_masked_and_recorded_reads_stay_in_torch() -> None:
    query, key = _qk(1, 2, 2, 40, 8, torch.bfloat16)
    assert ProbedAttention(query, key, mask=torch.ones(1, 1, 40, 40, dtype=torch.bool))._kernel() is None
    assert ProbedAttention(query.half(), key.half())._kernel() is None
    wanting = query.float().requires_grad_()
    assert ProbedAttention(wanting, key.float())._kernel() is None
    assert ProbedAttention(query, key)._kernel() is not None


def test_a_missing_compiler_falls_back_with_a_reason(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:  # noqa: ANN001
    monkeypatch.setenv("FICOCO_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    library, status = native._load()
    assert library is None and status.kernel == "torch" and "did not build" in status.reason
