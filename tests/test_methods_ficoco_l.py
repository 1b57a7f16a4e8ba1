"""FiCoCo-L: task-aware scores, indirect correlation and the one-call reduction."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ficoco.errors import FicocoError
from ficoco.methods.ficoco_l.ops import language_correlation, language_scores, reduce_l

FAST = settings(max_examples=30, deadline=None, derandomize=True, database=None)


@dataclass
class LCase:
    hidden: torch.Tensor
    attn: torch.Tensor
    visual_start: torch.Tensor
    num_visual: int
    suffix_mask: torch.Tensor
    r: int
    eps: float


def _causal_attention(gen: torch.Generator, batch: int, seq_len: int) -> torch.Tensor:
    logits = 2.0 * torch.randn(batch, seq_len, seq_len, generator=gen)
    future = torch.ones(seq_len, seq_len, dtype=torch.bool).triu(diagonal=1)
    return logits.masked_fill(future, float("-inf")).softmax(dim=-1)


@st.composite
def l_cases(draw: st.DrawFn) -> LCase:
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    batch = draw(st.integers(1, 3))
    num_visual = draw(st.integers(2, 7))
    seq_len = num_visual + draw(st.integers(1, 8))
    visual_start, suffix_mask = [], torch.zeros(batch, seq_len, dtype=torch.bool)
    for b in range(batch):
        start = draw(st.integers(0, seq_len - num_visual))
        real_suffix = draw(st.integers(0, seq_len - start - num_visual))
        suffix_mask[b, start + num_visual : start + num_visual + real_suffix] = True
        visual_start.append(start)
    starts = torch.tensor(visual_start)
    attn = _causal_attention(gen, batch, seq_len)
    # Rows the method must not read (prefix text, padding) hold NaN.
    positions = torch.arange(seq_len)
    in_span = (positions >= starts[:, None]) & (positions < starts[:, None] + num_visual)
    attn = attn.masked_fill(~(in_span | suffix_mask).unsqueeze(2), float("nan"))
    return LCase(
        hidden=torch.randn(batch, seq_len, draw(st.integers(1, 4)), generator=gen),
        attn=attn,
        visual_start=starts,
        num_visual=num_visual,
        suffix_mask=suffix_mask,
        r=draw(st.integers(0, num_visual - 1)),
        eps=draw(st.sampled_from([0.998, 0.5])),
    )


def _run(case: LCase, **overrides: object):
    arguments = dict(
        hidden=case.hidden,
        attn=case.attn,
        r=case.r,
        visual_start=case.visual_start,
        num_visual=case.num_visual,
        suffix_mask=case.suffix_mask,
        eps=case.eps,
    )
    arguments.update(overrides)
    return reduce_l(**arguments)


def _reference_one_sample(case: LCase, b: int, beta: float = 0.6, gamma: float = 0.6):
    """FiCoCo-L for one sample written token by token from docs/methods/ficoco.md, in float64."""
    attn = case.attn[b].double().tolist()
    hidden = case.hidden[b].double()
    start, n = int(case.visual_start[b]), case.num_visual
    suffix = [k for k in range(hidden.shape[0]) if case.suffix_mask[b, k]]

    def text_mean(values: list[float]) -> float:
        return sum(values) / len(values) if values else 0.0

    scores = []
    for j in range(n):
        vision = sum(attn[start + i][start + j] for i in range(j, n)) / (n - j)
        task = text_mean([attn[k][start + j] for k in suffix])
        scores.append(beta * vision - (1 - beta) * task)
    order = sorted(range(n), key=lambda j: (-scores[j], j))
    source, target = sorted(order[: case.r]), sorted(order[case.r :])
    merged = {j: hidden[start + j].clone() for j in target}
    weight = dict.fromkeys(target, 1.0)
    for i in source:
        row = torch.tensor(
            [
                gamma * attn[start + i][start + j]
                + (1 - gamma) * text_mean([attn[k][start + i] * attn[k][start + j] for k in suffix])
                for j in target
            ],
            dtype=torch.float64,
        )
        tau = torch.quantile(row, case.eps)
        chosen = [k for k in range(len(target)) if row[k] >= tau]
        total = sum(float(row[k]) for k in chosen)
        for k in chosen:
            alpha = float(row[k]) / total if total > 0 else 1.0 / len(chosen)
            merged[target[k]] += alpha * hidden[start + i]
            weight[target[k]] += alpha
    discarded_positions = {start + i for i in source}
    kept_positions = [p for p in range(hidden.shape[0]) if p not in discarded_positions]
    out = [merged[p - start] / weight[p - start] if start <= p < start + n else hidden[p] for p in kept_positions]
    return source, target, kept_positions, torch.stack(out)


@FAST
@given(l_cases())
def test_reduce_l_matches_token_by_token_reference(case: LCase) -> None:
    result = _run(case)
    assert torch.isfinite(result.hidden).all()
    for b in range(case.hidden.shape[0]):
        source, target, kept_positions, hidden = _reference_one_sample(case, b)
        assert result.discarded_visual[b].tolist() == source
        assert result.kept_visual[b].tolist() == target
        assert result.kept_positions[b].tolist() == kept_positions
        torch.testing.assert_close(result.hidden[b].double(), hidden, rtol=1e-5, atol=1e-5)


@FAST
@given(l_cases())
def test_reduce_l_output_token_count_and_kept_order(case: LCase) -> None:
    result = _run(case)
    batch, seq_len, dim = case.hidden.shape
    assert result.hidden.shape == (batch, seq_len - case.r, dim)
    assert result.kept_positions.shape == (batch, seq_len - case.r)
    assert result.kept_visual.shape == (batch, case.num_visual - case.r)
    assert result.discarded_visual.shape == (batch, case.r)
    assert bool((result.kept_positions[:, 1:] > result.kept_positions[:, :-1]).all())
    union = torch.cat([result.kept_visual, result.discarded_visual], dim=1).sort(dim=1).values
    assert torch.equal(union, torch.arange(case.num_visual).expand(batch, -1))


@FAST
@given(l_cases())
def test_reduce_l_never_changes_text_tokens_with_per_sample_visual_start(case: LCase) -> None:
    result = _run(case)
    batch, seq_len, _ = case.hidden.shape
    positions = torch.arange(seq_len)
    start = case.visual_start[:, None]
    is_text = (positions < start) | (positions >= start + case.num_visual)
    for b in range(batch):
        kept = result.kept_positions[b]
        text_positions = positions[is_text[b]]
        assert set(text_positions.tolist()) <= set(kept.tolist())
        text_out = result.hidden[b][is_text[b][kept]]
        assert torch.equal(text_out, case.hidden[b, text_positions])
        # The kept visual tokens stay one contiguous span at the same start.
        span = kept[~is_text[b][kept]]
        assert span.tolist() == (case.visual_start[b] + result.kept_visual[b]).tolist()


@FAST
@given(l_cases())
def test_reduce_l_batch_equals_stacked_batch_of_one_runs(case: LCase) -> None:
    batched = _run(case)
    for b in range(case.hidden.shape[0]):
        single = _run(
            case,
            hidden=case.hidden[b : b + 1],
            attn=case.attn[b : b + 1],
            visual_start=case.visual_start[b : b + 1],
            suffix_mask=case.suffix_mask[b : b + 1],
        )
        assert torch.equal(single.kept_positions[0], batched.kept_positions[b])
        assert torch.equal(single.discarded_visual[0], batched.discarded_visual[b])
        torch.testing.assert_close(single.hidden[0], batched.hidden[b], rtol=1e-6, atol=1e-6)


@FAST
@given(l_cases())
def test_reduce_l_r_zero_returns_input_unchanged(case: LCase) -> None:
    result = _run(case, r=0)
    batch, seq_len, _ = case.hidden.shape
    assert torch.equal(result.hidden, case.hidden)
    assert result.kept_positions.tolist() == [list(range(seq_len))] * batch
    assert result.kept_visual.tolist() == [list(range(case.num_visual))] * batch
    assert result.discarded_visual.shape == (batch, 0)


@FAST
@given(l_cases())
def test_reduce_l_mixing_weights_are_self_preserving(case: LCase) -> None:
    batch, seq_len, _ = case.hidden.shape
    mixing = _run(case, hidden=torch.eye(seq_len).expand(batch, -1, -1)).hidden
    result = _run(case)
    own = torch.gather(mixing, 2, result.kept_positions.unsqueeze(2)).squeeze(2)
    torch.testing.assert_close(mixing.sum(dim=2), torch.ones(batch, seq_len - case.r))
    assert bool((own >= mixing.amax(dim=2) - 1e-6).all())
    assert bool((own >= 1.0 / (1.0 + case.r) - 1e-6).all())
    # A visual token that received nothing is bitwise unchanged.
    original = torch.gather(case.hidden, 1, result.kept_positions.unsqueeze(2).expand(-1, -1, case.hidden.shape[2]))
    untouched = own == 1.0
    assert torch.equal(result.hidden[untouched], original[untouched])


@FAST
@given(l_cases())
def test_reduce_l_bfloat16_matches_float32_on_the_same_values(case: LCase) -> None:
    low = _run(case, hidden=case.hidden.bfloat16(), attn=case.attn.bfloat16())
    high = _run(case, hidden=case.hidden.bfloat16().float(), attn=case.attn.bfloat16().float())
    assert low.hidden.dtype == torch.bfloat16
    assert torch.equal(low.kept_positions, high.kept_positions)
    assert torch.equal(low.hidden, high.hidden.bfloat16())


def _hand_attention() -> torch.Tensor:
    # Sequence: prefix 0, visual 1-3, suffix 4-5; causal rows.
    return torch.tensor(
        [
            [1.0, 0.0, 0.0, 0.0, 0.0, 0.0],
            [0.5, 0.5, 0.0, 0.0, 0.0, 0.0],
            [0.2, 0.4, 0.4, 0.0, 0.0, 0.0],
            [0.1, 0.2, 0.3, 0.4, 0.0, 0.0],
            [0.1, 0.1, 0.2, 0.2, 0.4, 0.0],
            [0.1, 0.3, 0.1, 0.1, 0.2, 0.2],
        ]
    ).unsqueeze(0)


def test_reduce_l_hand_example() -> None:
    attn = _hand_attention()
    start, suffix = torch.tensor([1]), torch.tensor([[False, False, False, False, True, True]])
    # v = [(0.5+0.4+0.2)/3, (0.4+0.3)/2, 0.4/1]; t = [0.2, 0.15, 0.15]; s = 0.6 v - 0.4 t.
    scores = language_scores(attn, start, 3, suffix)
    torch.testing.assert_close(scores, torch.tensor([[0.14, 0.15, 0.18]]))
    # Visual 2 goes. C[2, 0] = 0.6*0.2 + 0.4*(0.2*0.1 + 0.1*0.3)/2 = 0.13,
    #               C[2, 1] = 0.6*0.3 + 0.4*(0.2*0.2 + 0.1*0.1)/2 = 0.19.
    correlation = language_correlation(attn, torch.tensor([[2]]), torch.tensor([[0, 1]]), start, 3, suffix)
    torch.testing.assert_close(correlation, torch.tensor([[[0.13, 0.19]]]))
    hidden = torch.tensor([[7.0, 7.0], [1.0, 0.0], [0.0, 1.0], [3.0, 5.0], [8.0, 8.0], [9.0, 9.0]]).unsqueeze(0)
    result = reduce_l(hidden, attn, 1, start, 3, suffix)
    assert result.discarded_visual.tolist() == [[2]]
    assert result.kept_visual.tolist() == [[0, 1]]
    assert result.kept_positions.tolist() == [[0, 1, 2, 4, 5]]
    # Only visual 1 is above the 0.998 quantile: it becomes (x_v1 + x_v2) / 2.
    expected = torch.tensor([[7.0, 7.0], [1.0, 0.0], [1.5, 3.0], [8.0, 8.0], [9.0, 9.0]]).unsqueeze(0)
    torch.testing.assert_close(result.hidden, expected)


def test_reduce_l_ignores_a_suffix_mask_that_also_marks_prefix_text() -> None:
    attn = _hand_attention()
    hidden = torch.randn(1, 6, 3, generator=torch.Generator().manual_seed(0))
    start = torch.tensor([1])
    exact_mask = torch.tensor([[False, False, False, False, True, True]])
    loose_mask = torch.ones(1, 6, dtype=torch.bool)
    assert torch.equal(language_scores(attn, start, 3, exact_mask), language_scores(attn, start, 3, loose_mask))
    exact = reduce_l(hidden, attn, 1, start, 3, exact_mask)
    loose = reduce_l(hidden, attn, 1, start, 3, loose_mask)
    assert torch.equal(exact.hidden, loose.hidden)
    assert torch.equal(exact.kept_positions, loose.kept_positions)


def test_reduce_l_without_suffix_text_uses_vision_term_only() -> None:
    attn = _hand_attention()
    no_suffix = torch.zeros(1, 6, dtype=torch.bool)
    scores = language_scores(attn, torch.tensor([1]), 3, no_suffix, beta=0.6)
    torch.testing.assert_close(scores, 0.6 * torch.tensor([[1.1 / 3.0, 0.35, 0.4]]))
    result = reduce_l(
        torch.randn(1, 6, 2, generator=torch.Generator().manual_seed(0)), attn, 2, torch.tensor([1]), 3, no_suffix
    )
    assert torch.isfinite(result.hidden).all()


def test_reduce_l_rejects_removing_every_visual_token() -> None:
    with pytest.raises(FicocoError):
        reduce_l(
            torch.zeros(1, 6, 2),
            _hand_attention(),
            3,
            torch.tensor([1]),
            3,
            torch.zeros(1, 6, dtype=torch.bool),
        )


# -- several image spans per sample (issue 11) ------------------------------------------------

@FAST
@given(l_cases())
def test_reduce_l_with_explicit_contiguous_positions_equals_the_span_form(case: LCase) -> None:
    positions = case.visual_start[:, None] + torch.arange(case.num_visual)
    span = _run(case)
    explicit = _run(case, visual_positions=positions)
    assert torch.equal(explicit.hidden, span.hidden)
    assert torch.equal(explicit.kept_positions, span.kept_positions)
    assert torch.equal(explicit.kept_visual, span.kept_visual)
    assert torch.equal(explicit.visual_positions, span.visual_positions)


def test_reduce_l_two_spans_are_one_set_text_between_them_stays_and_only_later_text_is_the_prior() -> None:
    gen = torch.Generator().manual_seed(3)
    batch, seq_len, dim = 2, 20, 8
    # [2 prefix] [5 visual] [3 text] [5 visual] [5 suffix]
    visual = torch.tensor([2, 3, 4, 5, 6, 10, 11, 12, 13, 14]).expand(batch, -1)
    hidden = torch.randn(batch, seq_len, dim, generator=gen)
    attn = _causal_attention(gen, batch, seq_len)
    suffix = torch.ones(batch, seq_len, dtype=torch.bool)  # the reduction keeps rows after the last span
    r = 6
    red = reduce_l(hidden, attn, r, visual[:, 0], 10, suffix, visual_positions=visual)
    assert red.hidden.shape == (batch, seq_len - r, dim)
    flat_kept = torch.gather(visual, 1, red.kept_visual)
    # Every text token stays unchanged, in order, wherever it is.
    is_text = torch.ones(seq_len, dtype=torch.bool)
    is_text[visual[0]] = False
    for b in range(batch):
        kept_rows = red.kept_positions[b]
        assert set(flat_kept[b].tolist()) | set(torch.arange(seq_len)[is_text].tolist()) == set(kept_rows.tolist())
        text_out = red.hidden[b][is_text[kept_rows]]
        assert torch.equal(text_out, hidden[b][is_text])
        # The kept visual tokens sit at the rows the result names.
        assert torch.equal(kept_rows[red.visual_positions[b]], flat_kept[b])
    # Text between the spans is no task prior: changing its attention rows changes nothing.
    other = attn.clone()
    other[:, 7:10] = torch.softmax(torch.randn(batch, 3, seq_len, generator=gen), -1)
    again = reduce_l(hidden, other, r, visual[:, 0], 10, suffix, visual_positions=visual)
    assert torch.equal(again.kept_visual, red.kept_visual)
