"""The shared token operations (ficoco.methods.ops) FiCoCo-V and -L build on: select, token-adaptive
weights, self-preserving compress."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ficoco.errors import FicocoError
from ficoco.methods.ficoco_v import EPS
from ficoco.methods.ops import adaptive_weights, compress, gather_block, gather_tokens, select

FAST = settings(max_examples=40, deadline=None, derandomize=True, database=None)


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@st.composite
def scores_and_r(draw: st.DrawFn) -> tuple[torch.Tensor, int]:
    batch = draw(st.integers(1, 3))
    num_tokens = draw(st.integers(1, 12))
    r = draw(st.integers(0, num_tokens))
    # Few distinct levels so that ties are frequent.
    levels = draw(st.sampled_from([2, 3, 1000]))
    scores = torch.randint(0, levels, (batch, num_tokens), generator=_generator(draw(st.integers(0, 2**31))))
    return scores.to(torch.float32), r


@st.composite
def correlations(draw: st.DrawFn) -> tuple[torch.Tensor, float]:
    batch = draw(st.integers(1, 3))
    rows = draw(st.integers(1, 6))
    cols = draw(st.integers(1, 10))
    gen = _generator(draw(st.integers(0, 2**31)))
    corr = torch.rand(batch, rows, cols, generator=gen)
    if draw(st.booleans()):
        # Sparse rows (many exact zeros, some all-zero) like causal attention produces.
        corr = corr * (torch.rand(batch, rows, cols, generator=gen) < 0.3)
    # Dyadic levels and 0.998 keep the interpolation rank away from rounding-sensitive integers.
    eps = draw(st.sampled_from([0.998, 0.0, 0.5, 0.75, 1.0]))
    return corr, eps


def _reference_weights(row: list[float], eps: float) -> list[float]:
    """The weight rule written out for one row, with the quantile done by hand."""
    ordered = sorted(row)
    rank = eps * (len(row) - 1)
    low = int(rank)
    high = min(low + 1, len(row) - 1)
    tau = ordered[low] + (rank - low) * (ordered[high] - ordered[low])
    chosen = [c >= tau or c == max(row) for c in row]
    total = sum(c for c, keep in zip(row, chosen, strict=True) if keep)
    if total <= 0:
        return [1.0 / sum(chosen) if keep else 0.0 for keep in chosen]
    return [c / total if keep else 0.0 for c, keep in zip(row, chosen, strict=True)]


# ----- select -----


@FAST
@given(scores_and_r())
def test_select_partitions_tokens_into_r_sources_and_sorted_targets(case: tuple[torch.Tensor, int]) -> None:
    scores, r = case
    source, target = select(scores, r)
    batch, num_tokens = scores.shape
    assert source.shape == (batch, r) and target.shape == (batch, num_tokens - r)
    assert source.dtype == torch.long and target.dtype == torch.long
    union = torch.sort(torch.cat([source, target], dim=1), dim=1).values
    assert torch.equal(union, torch.arange(num_tokens).expand(batch, -1))
    assert bool((source[:, 1:] > source[:, :-1]).all())
    assert bool((target[:, 1:] > target[:, :-1]).all())


@FAST
@given(scores_and_r())
def test_select_discards_highest_scores_ties_lowest_index_first(case: tuple[torch.Tensor, int]) -> None:
    scores, r = case
    source, _ = select(scores, r)
    for b in range(scores.shape[0]):
        values = scores[b].tolist()
        expected = sorted(sorted(range(len(values)), key=lambda j: (-values[j], j))[:r])
        assert source[b].tolist() == expected


def test_select_breaks_ties_at_the_boundary_lowest_index_first() -> None:
    scores = torch.tensor([[1.0, 2.0, 2.0, 2.0, 0.0], [5.0, 5.0, 5.0, 5.0, 5.0]])
    source, target = select(scores, 2)
    assert source.tolist() == [[1, 2], [0, 1]]
    assert target.tolist() == [[0, 3, 4], [2, 3, 4]]


def test_select_rejects_r_larger_than_token_count() -> None:
    with pytest.raises(FicocoError):
        select(torch.zeros(1, 3), 4)


# ----- adaptive weights -----


@FAST
@given(correlations())
def test_adaptive_weights_match_the_quantile_rule_row_by_row(case: tuple[torch.Tensor, float]) -> None:
    corr, eps = case
    alpha = adaptive_weights(corr, eps=eps)
    for b in range(corr.shape[0]):
        for i in range(corr.shape[1]):
            expected = _reference_weights(corr[b, i].double().tolist(), eps)
            torch.testing.assert_close(alpha[b, i].double(), torch.tensor(expected, dtype=torch.float64))


@FAST
@given(correlations())
def test_adaptive_weights_rows_sum_to_one_and_always_include_the_row_max(
    case: tuple[torch.Tensor, float],
) -> None:
    corr, eps = case
    alpha = adaptive_weights(corr, eps=eps)
    assert bool((alpha >= 0).all())
    torch.testing.assert_close(alpha.sum(dim=2), torch.ones(corr.shape[:2]))
    at_max = torch.gather(alpha, 2, corr.argmax(dim=2, keepdim=True))
    assert bool((at_max > 0).all())


def test_adaptive_weights_hand_example() -> None:
    corr = torch.tensor([[[0.2, 0.6, 0.2, 0.0], [0.1, 0.3, 0.3, 0.2], [0.1, 0.5, 0.3, 0.2]]])
    # eps 0.5 over 4 values: rank 1.5, tau = mean of 2nd and 3rd smallest.
    # row 0: tau 0.2 -> {0.2, 0.6, 0.2}; row 1: tau 0.25 -> {0.3, 0.3}; row 2: tau 0.25 -> {0.5, 0.3}.
    expected = torch.tensor([[[0.2, 0.6, 0.2, 0.0], [0.0, 0.5, 0.5, 0.0], [0.0, 0.625, 0.375, 0.0]]])
    torch.testing.assert_close(adaptive_weights(corr, eps=0.5), expected)
    # At FiCoCo's 0.998 only the row maximum survives (both tied maxima in row 1).
    expected_default = torch.tensor([[[0.0, 1.0, 0.0, 0.0], [0.0, 0.5, 0.5, 0.0], [0.0, 1.0, 0.0, 0.0]]])
    torch.testing.assert_close(adaptive_weights(corr, EPS), expected_default)


def test_adaptive_weights_all_zero_row_falls_back_to_uniform_without_nan() -> None:
    corr = torch.zeros(1, 2, 4)
    corr[0, 1, 2] = 0.5
    alpha = adaptive_weights(corr, EPS)
    assert torch.isfinite(alpha).all()
    torch.testing.assert_close(alpha[0, 0], torch.full((4,), 0.25))
    torch.testing.assert_close(alpha[0, 1], torch.tensor([0.0, 0.0, 1.0, 0.0]))


def test_adaptive_weights_compute_in_float32_for_bfloat16_input() -> None:
    corr = torch.rand(2, 3, 5, generator=_generator(0))
    alpha = adaptive_weights(corr.to(torch.bfloat16), EPS)
    assert alpha.dtype == torch.float32
    torch.testing.assert_close(alpha, adaptive_weights(corr.to(torch.bfloat16).float(), EPS), rtol=0, atol=0)


# ----- compress -----


def test_compress_hand_example() -> None:
    tokens = torch.tensor([[[1.0, 0.0], [0.0, 1.0], [2.0, 2.0], [4.0, 0.0]]])
    source = torch.tensor([[1, 3]])
    target = torch.tensor([[0, 2]])
    alpha = torch.tensor([[[0.5, 0.5], [0.0, 1.0]]])
    merged = compress(tokens, source, target, alpha)
    # token 0: (x0 + 0.5 x1) / 1.5; token 2: (x2 + 0.5 x1 + x3) / 2.5
    expected = torch.tensor([[[1.0 / 1.5, 0.5 / 1.5], [6.0 / 2.5, 2.5 / 2.5]]])
    torch.testing.assert_close(merged, expected)


@st.composite
def compress_cases(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    batch = draw(st.integers(1, 3))
    num_tokens = draw(st.integers(2, 10))
    r = draw(st.integers(0, num_tokens - 1))
    gen = _generator(draw(st.integers(0, 2**31)))
    source, target = select(torch.rand(batch, num_tokens, generator=gen), r)
    corr = torch.rand(batch, r, num_tokens - r, generator=gen)
    eps = draw(st.sampled_from([0.998, 0.5, 0.0]))
    return source, target, adaptive_weights(corr, eps=eps), torch.randn(batch, num_tokens, 3, generator=gen)


@FAST
@given(compress_cases())
def test_compress_is_a_convex_mix_whose_own_weight_dominates_every_single_source(
    case: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
) -> None:
    """What "self-preserving" guarantees in general.

    One-hot tokens make the output rows the mixing weights themselves. The kept token's own
    weight is 1 / (1 + sum_i alpha_ij): at least every single source's weight and at least
    1 / (1 + |I_j|), but NOT always 1/2 (see the counterexample test below).
    """
    source, target, alpha, _ = case
    batch, num_tokens = source.shape[0], source.shape[1] + target.shape[1]
    one_hot = torch.eye(num_tokens, dtype=torch.float64).expand(batch, -1, -1)
    mixing = compress(one_hot, source, target, alpha)
    torch.testing.assert_close(mixing.sum(dim=2), torch.ones(batch, target.shape[1], dtype=torch.float64))
    assert bool((mixing >= 0).all())
    own = torch.gather(mixing, 2, target.unsqueeze(2)).squeeze(2)
    torch.testing.assert_close(own, 1.0 / (1.0 + alpha.double().sum(dim=1)))
    from_sources = gather_tokens(mixing.transpose(1, 2), source).transpose(1, 2)
    if source.shape[1] > 0:
        assert bool((own.unsqueeze(2) >= from_sources - 1e-12).all())
    senders = (alpha > 0).sum(dim=1).double()
    assert bool((own >= 1.0 / (1.0 + senders) - 1e-12).all())
    # Nothing leaks to tokens that are neither the target itself nor a source.
    assert torch.allclose(own + from_sources.sum(dim=2), torch.ones_like(own))


@FAST
@given(compress_cases())
def test_compress_leaves_a_token_that_receives_nothing_bitwise_unchanged(
    case: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
) -> None:
    source, target, alpha, tokens = case
    for dtype in (torch.float32, torch.bfloat16):
        typed = tokens.to(dtype)
        merged = compress(typed, source, target, alpha)
        assert merged.dtype == dtype
        untouched = alpha.sum(dim=1) == 0
        kept = gather_tokens(typed, target)
        assert torch.equal(merged[untouched], kept[untouched])


@FAST
@given(compress_cases())
def test_compress_at_its_receivers_only_equals_the_dense_form(
    case: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
) -> None:
    # The CPU computes only the kept tokens that receive something; the dense form (any other device) every one.
    import ficoco.methods.ops as method_ops

    source, target, alpha, tokens = case
    for dtype in (torch.float32, torch.bfloat16):
        typed = tokens.to(dtype)
        sparse = compress(typed, source, target, alpha)
        try:
            method_ops.SPARSE_MERGES_ON_CPU = False
            dense = compress(typed, source, target, alpha)
        finally:
            method_ops.SPARSE_MERGES_ON_CPU = True
        assert sparse.dtype == dense.dtype == dtype
        # The receivers' float32 sums in another order at most: one rounding step of the tokens' dtype.
        torch.testing.assert_close(sparse, dense, rtol=1e-6 if dtype == torch.float32 else 8e-3, atol=1e-6)


def test_compress_own_weight_falls_below_half_when_two_sources_share_a_target() -> None:
    """Counterexample to docs/methods/ficoco.md's "keeps at least half of its own content".

    Both discarded tokens put all their weight on the single kept token, so it keeps 1/3.
    """
    tokens = torch.eye(3).unsqueeze(0)
    source = torch.tensor([[0, 2]])
    target = torch.tensor([[1]])
    alpha = adaptive_weights(torch.tensor([[[0.7], [0.4]]]), EPS)
    merged = compress(tokens, source, target, alpha)
    torch.testing.assert_close(merged, torch.full((1, 1, 3), 1.0 / 3.0))
    assert merged[0, 0, 1] < 0.5


# ----- gathers -----


def test_gather_tokens_and_gather_block_match_advanced_indexing() -> None:
    gen = _generator(3)
    x = torch.randn(2, 6, 4, 5, generator=gen)
    index = torch.tensor([[5, 0, 2], [1, 1, 3]])
    picked = gather_tokens(x, index)
    for b in range(2):
        assert torch.equal(picked[b], x[b, index[b]])
    matrix = torch.randn(2, 6, 7, generator=gen)
    cols = torch.tensor([[6, 0], [2, 3]])
    block = gather_block(matrix, index, cols)
    for b in range(2):
        assert torch.equal(block[b], matrix[b][index[b]][:, cols[b]])


def test_one_samples_gathers_take_index_select_and_give_the_same_rows() -> None:
    """A batch of one copies rows with index_select (faster than advanced indexing on a CPU), also from a strided
    view (a layer's (B, T, heads, d) queries) and along another dimension (the adapters' masks and rotary)."""
    from ficoco.models.patching import gather_rows

    gen = _generator(4)
    queries = torch.randn(1, 3, 9, 4, generator=gen).transpose(1, 2)  # (1, T, heads, d), strided
    index = torch.tensor([[8, 0, 3, 3]])
    assert torch.equal(gather_tokens(queries, index), queries[torch.arange(1).unsqueeze(1), index])
    assert torch.equal(gather_tokens(queries, index)[0], queries[0][index[0]])
    mask = torch.randn(1, 1, 9, 9, generator=gen)
    for dim in (2, 3):
        expected = torch.gather(mask, dim, index.view([1, 1, 1, 1][:dim] + [4] + [1] * (3 - dim))
                                .expand([1, 1, 9, 9][:dim] + [4] + [9] * (3 - dim)))
        assert torch.equal(gather_rows(mask, index, dim), expected)
    # Two samples keep the general path; a batch-1 mask broadcast over them too.
    two = torch.tensor([[1, 2], [4, 0]])
    assert torch.equal(gather_rows(mask, two, 2)[1, 0], mask[0, 0][two[1]])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compress_under_autograd_gives_the_same_tokens_and_a_gradient(dtype: torch.dtype) -> None:
    # A loss through the merge (labels on a patched model whose weights require grad) records the op.
    torch.manual_seed(0)
    tokens = torch.randn(2, 6, 4, dtype=dtype)
    source, target = torch.tensor([[0, 3], [1, 5]]), torch.tensor([[1, 2, 4, 5], [0, 2, 3, 4]])
    alpha = torch.rand(2, 2, 4)
    with torch.no_grad():
        plain = compress(tokens, source, target, alpha)
    leaf = tokens.clone().requires_grad_(True)
    recorded = compress(leaf, source, target, alpha)
    assert recorded.dtype == dtype and torch.equal(recorded.detach(), plain)
    recorded.float().sum().backward()
    assert leaf.grad is not None and leaf.grad.abs().sum() > 0
