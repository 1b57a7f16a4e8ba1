"""FiCoCo-V: vision scores, equivalent token, local penalty and the one-call reduction."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ficoco.errors import FicocoError
from ficoco.methods.ficoco_v.ops import local_penalty, reduce_v, vision_scores
from ficoco.methods.ops import equivalent_token_redundancy, select

FAST = settings(max_examples=30, deadline=None, derandomize=True, database=None)


@dataclass
class VCase:
    hidden: torch.Tensor
    attn: torch.Tensor
    keys: torch.Tensor
    grid_index: torch.Tensor
    grid_hw: tuple[int, int]
    has_cls: bool
    r: int
    window: int
    eps: float


def _softmax_attention(gen: torch.Generator, batch: int, seq_len: int) -> torch.Tensor:
    logits = 2.0 * torch.randn(batch, seq_len, seq_len, generator=gen)
    return logits.softmax(dim=-1)


@st.composite
def v_cases(draw: st.DrawFn, has_cls: bool | None = None) -> VCase:
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    batch = draw(st.integers(1, 3))
    grid_hw = (draw(st.integers(1, 5)), draw(st.integers(2, 5)))
    cells = grid_hw[0] * grid_hw[1]
    # Fewer patches than grid cells stands for a later layer after earlier removals.
    num_patches = draw(st.integers(2, cells))
    r = draw(st.integers(0, num_patches - 1))
    cls = draw(st.booleans()) if has_cls is None else has_cls
    seq_len = num_patches + int(cls)
    grid_index = torch.stack([torch.randperm(cells, generator=gen)[:num_patches].sort().values for _ in range(batch)])
    return VCase(
        hidden=torch.randn(batch, seq_len, draw(st.integers(1, 4)), generator=gen),
        attn=_softmax_attention(gen, batch, seq_len),
        keys=torch.randn(batch, draw(st.integers(1, 3)), seq_len, 3, generator=gen),
        grid_index=grid_index,
        grid_hw=grid_hw,
        has_cls=cls,
        r=r,
        window=draw(st.sampled_from([2, 2, 1, 3])),
        eps=draw(st.sampled_from([0.998, 0.5])),
    )


def _run(case: VCase, **overrides: object):
    arguments = dict(
        hidden=case.hidden,
        attn=case.attn,
        r=case.r,
        grid_index=case.grid_index,
        grid_hw=case.grid_hw,
        has_cls=case.has_cls,
        keys=case.keys,
        eps=case.eps,
        window=case.window,
    )
    arguments.update(overrides)
    return reduce_v(**arguments)


def _reference_one_sample(case: VCase, b: int, lam: float = 0.35, coefficient: float = 2.0):
    """FiCoCo-V for one sample written token by token from docs/methods/ficoco.md, in float64."""
    offset = int(case.has_cls)
    attn = case.attn[b].double().tolist()
    hidden = case.hidden[b].double()
    grid = case.grid_index[b].tolist()
    n = len(grid)
    received = [sum(attn[offset + i][offset + j] for i in range(n)) / n for j in range(n)]
    if case.has_cls:
        semantic = [attn[0][offset + j] for j in range(n)]
    else:
        mean_keys = case.keys[b].double().mean(dim=0)
        mu = mean_keys.mean(dim=0)
        semantic = [-float(mu @ mean_keys[j] / (mu.norm() * mean_keys[j].norm())) for j in range(n)]
    scores = [lam * received[j] - (1 - lam) * semantic[j] for j in range(n)]
    windows: dict[tuple[int, int], list[int]] = {}
    width = case.grid_hw[1]
    for j, g in enumerate(grid):
        windows.setdefault((g // width // case.window, g % width // case.window), []).append(j)
    penalised = list(scores)
    for members in windows.values():
        best = max(members, key=lambda j: (scores[j], -grid[j]))
        if scores[best] > 0:
            penalised[best] = scores[best] * coefficient
        elif scores[best] < 0:
            penalised[best] = scores[best] / coefficient
    order = sorted(range(n), key=lambda j: (-penalised[j], j))
    source, target = sorted(order[: case.r]), sorted(order[case.r :])
    merged = {j: hidden[offset + j].clone() for j in target}
    weight = dict.fromkeys(target, 1.0)
    for i in source:
        row = torch.tensor([attn[offset + i][offset + j] for j in target], dtype=torch.float64)
        tau = torch.quantile(row, case.eps)
        chosen = [k for k in range(len(target)) if row[k] >= tau]
        total = sum(float(row[k]) for k in chosen)
        for k in chosen:
            alpha = float(row[k]) / total if total > 0 else 1.0 / len(chosen)
            merged[target[k]] += alpha * hidden[offset + i]
            weight[target[k]] += alpha
    out = [hidden[0]] if case.has_cls else []
    out += [merged[j] / weight[j] for j in target]
    return source, target, torch.stack(out)


# ----- the one-call reduction -----


@FAST
@given(v_cases())
def test_reduce_v_matches_token_by_token_reference(case: VCase) -> None:
    result = _run(case)
    offset = int(case.has_cls)
    for b in range(case.hidden.shape[0]):
        source, target, hidden = _reference_one_sample(case, b)
        grid = case.grid_index[b]
        assert result.grid_index[b].tolist() == grid[target].tolist()
        assert result.discarded_grid[b].tolist() == grid[source].tolist()
        assert result.kept_positions[b].tolist() == [0] * offset + [j + offset for j in target]
        torch.testing.assert_close(result.hidden[b].double(), hidden, rtol=1e-5, atol=1e-5)


@FAST
@given(v_cases(), st.integers(1, 5))
def test_reduce_v_folds_riding_features_as_extra_channels_of_the_hidden_states(case: VCase, width: int) -> None:
    """Features that ride with the patches (Qwen3-VL's DeepStack taps) come out as they would in extra channels of
    the hidden states: folded with the patches' weights, and the hidden states as without them."""
    batch, _, dim = case.hidden.shape
    offset = int(case.has_cls)
    riding = torch.randn(batch, case.grid_index.shape[1], width, generator=torch.Generator().manual_seed(case.r))
    extended = torch.cat([case.hidden, torch.cat([torch.zeros(batch, offset, width), riding], dim=1)], dim=-1)
    together, apart = _run(case, hidden=extended), _run(case, riding=riding)
    assert apart.riding is not None and apart.riding.shape == (batch, case.grid_index.shape[1] - case.r, width)
    torch.testing.assert_close(apart.hidden, together.hidden[..., :dim], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(apart.riding, together.hidden[:, offset:, dim:], rtol=1e-6, atol=1e-6)
    assert _run(case).riding is None


@FAST
@given(v_cases())
def test_reduce_v_output_token_count_and_shapes(case: VCase) -> None:
    result = _run(case)
    batch, seq_len, dim = case.hidden.shape
    num_patches = case.grid_index.shape[1]
    assert result.hidden.shape == (batch, seq_len - case.r, dim)
    assert result.grid_index.shape == (batch, num_patches - case.r)
    assert result.kept_grid is result.grid_index
    assert result.discarded_grid.shape == (batch, case.r)
    assert result.kept_positions.shape == (batch, seq_len - case.r)


@FAST
@given(v_cases())
def test_reduce_v_keeps_original_order_and_partitions_the_grid(case: VCase) -> None:
    result = _run(case)
    assert bool((result.kept_positions[:, 1:] > result.kept_positions[:, :-1]).all())
    assert bool((result.grid_index[:, 1:] > result.grid_index[:, :-1]).all())
    union = torch.cat([result.grid_index, result.discarded_grid], dim=1).sort(dim=1).values
    assert torch.equal(union, case.grid_index)


@FAST
@given(v_cases(has_cls=True))
def test_reduce_v_leaves_cls_untouched_at_position_zero(case: VCase) -> None:
    result = _run(case)
    assert torch.equal(result.hidden[:, 0], case.hidden[:, 0])
    assert bool((result.kept_positions[:, 0] == 0).all())


@FAST
@given(v_cases())
def test_reduce_v_batch_equals_stacked_batch_of_one_runs(case: VCase) -> None:
    batched = _run(case)
    for b in range(case.hidden.shape[0]):
        single = _run(
            case,
            hidden=case.hidden[b : b + 1],
            attn=case.attn[b : b + 1],
            keys=case.keys[b : b + 1],
            grid_index=case.grid_index[b : b + 1],
        )
        assert torch.equal(single.kept_positions[0], batched.kept_positions[b])
        assert torch.equal(single.discarded_grid[0], batched.discarded_grid[b])
        torch.testing.assert_close(single.hidden[0], batched.hidden[b], rtol=1e-6, atol=1e-6)


@FAST
@given(v_cases())
def test_reduce_v_mixing_weights_are_self_preserving(case: VCase) -> None:
    """One-hot hidden states turn the output into the mixing weights of every kept token."""
    batch, seq_len, _ = case.hidden.shape
    one_hot = torch.eye(seq_len).expand(batch, -1, -1)
    result = _run(case, hidden=one_hot)
    mixing = result.hidden
    own = torch.gather(mixing, 2, result.kept_positions.unsqueeze(2)).squeeze(2)
    torch.testing.assert_close(mixing.sum(dim=2), torch.ones(batch, seq_len - case.r))
    # Own weight is the largest single weight and at least 1 / (1 + r) ...
    assert bool((own >= mixing.amax(dim=2) - 1e-6).all())
    assert bool((own >= 1.0 / (1.0 + case.r) - 1e-6).all())
    # ... and nothing flows between kept tokens: only discarded tokens are mixed in.
    kept_mask = torch.zeros(batch, seq_len, dtype=torch.bool).scatter(1, result.kept_positions, True)
    foreign_kept = mixing * kept_mask.unsqueeze(1)
    foreign_kept = foreign_kept.scatter(2, result.kept_positions.unsqueeze(2), 0.0)
    assert bool((foreign_kept == 0).all())


@FAST
@given(v_cases())
def test_reduce_v_token_receiving_nothing_is_bitwise_unchanged(case: VCase) -> None:
    batch, seq_len, _ = case.hidden.shape
    mixing = _run(case, hidden=torch.eye(seq_len).expand(batch, -1, -1)).hidden
    result = _run(case)
    own = torch.gather(mixing, 2, result.kept_positions.unsqueeze(2)).squeeze(2)
    received_nothing = own == 1.0
    original = torch.gather(case.hidden, 1, result.kept_positions.unsqueeze(2).expand(-1, -1, case.hidden.shape[2]))
    assert torch.equal(result.hidden[received_nothing], original[received_nothing])


@FAST
@given(v_cases())
def test_reduce_v_r_zero_returns_input_unchanged(case: VCase) -> None:
    result = _run(case, r=0)
    assert torch.equal(result.hidden, case.hidden)
    assert torch.equal(result.grid_index, case.grid_index)
    assert result.discarded_grid.shape == (case.hidden.shape[0], 0)
    assert result.kept_positions.tolist() == [list(range(case.hidden.shape[1]))] * case.hidden.shape[0]


@FAST
@given(v_cases())
def test_reduce_v_bfloat16_matches_float32_on_the_same_values(case: VCase) -> None:
    low = _run(case, hidden=case.hidden.bfloat16(), attn=case.attn.bfloat16(), keys=case.keys.bfloat16())
    high = _run(
        case,
        hidden=case.hidden.bfloat16().float(),
        attn=case.attn.bfloat16().float(),
        keys=case.keys.bfloat16().float(),
    )
    assert low.hidden.dtype == torch.bfloat16
    assert torch.equal(low.kept_positions, high.kept_positions)
    assert torch.equal(low.hidden, high.hidden.bfloat16())


def test_reduce_v_repeated_layers_track_the_original_grid() -> None:
    gen = torch.Generator().manual_seed(7)
    hidden = torch.randn(2, 17, 3, generator=gen)
    grid_index = torch.arange(16).expand(2, -1)
    for r in (5, 4, 3):
        attn = _softmax_attention(gen, 2, hidden.shape[1])
        before = grid_index
        result = reduce_v(hidden, attn, r, grid_index, (4, 4))
        assert torch.equal(result.grid_index, torch.gather(before, 1, result.kept_positions[:, 1:] - 1))
        hidden, grid_index = result.hidden, result.grid_index
    assert hidden.shape == (2, 17 - 12, 3)


def test_reduce_v_hand_example_with_cls() -> None:
    attn = torch.tensor(
        [
            [0.2, 0.1, 0.4, 0.1, 0.2],  # [CLS]: a = [0.1, 0.4, 0.1, 0.2]
            [0.1, 0.3, 0.1, 0.4, 0.1],
            [0.1, 0.1, 0.5, 0.2, 0.1],
            [0.1, 0.5, 0.1, 0.2, 0.1],
            [0.2, 0.1, 0.1, 0.3, 0.3],
        ]
    ).unsqueeze(0)
    hidden = torch.tensor([[9.0, 9.0], [1.0, 0.0], [0.0, 1.0], [3.0, 4.0], [5.0, 5.0]]).unsqueeze(0)
    grid_index = torch.arange(4).unsqueeze(0)
    # v = column means over patch rows = [0.25, 0.2, 0.275, 0.15];
    # s = 0.35 v - 0.65 a = [0.0225, -0.19, 0.03125, -0.0775].
    scores = vision_scores(attn, has_cls=True)
    torch.testing.assert_close(scores, torch.tensor([[0.0225, -0.19, 0.03125, -0.0775]]))
    # One 2x2 window: its maximum (patch 2) doubles.
    penalised = local_penalty(scores, grid_index, (2, 2))
    torch.testing.assert_close(penalised, torch.tensor([[0.0225, -0.19, 0.0625, -0.0775]]))
    result = reduce_v(hidden, attn, 1, grid_index, (2, 2))
    # Patch 2 goes; its row over the kept patches 0, 1, 3 is [0.5, 0.1, 0.1], so
    # J = {patch 0} with alpha 1: patch 0 becomes (x_p0 + x_p2) / 2.
    assert result.discarded_grid.tolist() == [[2]]
    assert result.kept_grid.tolist() == [[0, 1, 3]]
    assert result.kept_positions.tolist() == [[0, 1, 2, 4]]
    expected = torch.tensor([[9.0, 9.0], [2.0, 2.0], [0.0, 1.0], [5.0, 5.0]]).unsqueeze(0)
    torch.testing.assert_close(result.hidden, expected)


def test_reduce_v_can_leave_a_kept_token_less_than_half_its_own_content() -> None:
    """Counterexample to docs/methods/ficoco.md's "keeps at least half": 3 patches, r = 2, one target."""
    gen = torch.Generator().manual_seed(1)
    attn = _softmax_attention(gen, 1, 4)
    result = reduce_v(torch.eye(4).unsqueeze(0), attn, 2, torch.arange(3).unsqueeze(0), (1, 3))
    kept_patch = int(result.kept_positions[0, 1])
    torch.testing.assert_close(result.hidden[0, 1, kept_patch], torch.tensor(1.0 / 3.0))


def test_reduce_v_rejects_removing_every_patch() -> None:
    attn = torch.full((1, 4, 4), 0.25)
    with pytest.raises(FicocoError):
        reduce_v(torch.zeros(1, 4, 2), attn, 3, torch.arange(3).unsqueeze(0), (1, 3))


# ----- equivalent token (no [CLS]) -----


def test_equivalent_token_is_negative_cosine_to_the_mean_key() -> None:
    gen = torch.Generator().manual_seed(2)
    keys = torch.randn(2, 3, 5, 4, generator=gen)
    values = equivalent_token_redundancy(keys)
    for b in range(2):
        mean_keys = keys[b].mean(dim=0)
        mu = mean_keys.mean(dim=0)
        for j in range(5):
            expected = -(mu @ mean_keys[j]) / (mu.norm() * mean_keys[j].norm())
            torch.testing.assert_close(values[b, j], expected)


def test_equivalent_token_path_scores_tokens_near_the_mean_as_redundant() -> None:
    # Uniform attention makes v equal for all; patch 1's key equals the mean direction.
    keys = torch.tensor([[[[1.0, 0.0], [1.0, 1.0], [0.0, 1.0], [1.0, 1.0]]]])
    attn = torch.full((1, 4, 4), 0.25)
    scores = vision_scores(attn, has_cls=False, keys=keys)
    assert int(scores.argmax()) in (1, 3)
    result = reduce_v(
        torch.eye(4).unsqueeze(0), attn, 1, torch.arange(4).unsqueeze(0), (2, 2), has_cls=False, keys=keys
    )
    # One 2x2 window: patch 1 and 3 tie as the maximum, the penalty and the tie go to patch 1.
    assert result.discarded_grid.tolist() == [[1]]
    assert result.kept_positions.tolist() == [[0, 2, 3]]


def test_equivalent_token_path_requires_keys() -> None:
    with pytest.raises(FicocoError):
        vision_scores(torch.full((1, 3, 3), 1.0 / 3.0), has_cls=False)


# ----- local penalty -----


@st.composite
def penalty_cases(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int], int]:
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    grid_hw = (draw(st.integers(1, 7)), draw(st.integers(1, 7)))
    cells = grid_hw[0] * grid_hw[1]
    batch = draw(st.integers(1, 3))
    num_tokens = draw(st.integers(1, cells))
    grid_index = torch.stack([torch.randperm(cells, generator=gen)[:num_tokens].sort().values for _ in range(batch)])
    # Integer levels in [-2, 2] make zeros and ties common.
    scores = torch.randint(-2, 3, (batch, num_tokens), generator=gen).float()
    if draw(st.booleans()):
        scores = scores + 0.01 * torch.randn(batch, num_tokens, generator=gen)
    return scores, grid_index, grid_hw, draw(st.integers(1, 4))


@settings(max_examples=60, deadline=None, derandomize=True, database=None)
@given(penalty_cases())
def test_local_penalty_raises_exactly_the_max_of_each_nonempty_window(
    case: tuple[torch.Tensor, torch.Tensor, tuple[int, int], int],
) -> None:
    scores, grid_index, grid_hw, window = case
    penalised = local_penalty(scores, grid_index, grid_hw, window=window, coefficient=2.0)
    for b in range(scores.shape[0]):
        windows: dict[tuple[int, int], list[int]] = {}
        for j, g in enumerate(grid_index[b].tolist()):
            windows.setdefault((g // grid_hw[1] // window, g % grid_hw[1] // window), []).append(j)
        expected = scores[b].clone()
        for members in windows.values():
            # Sequence order is grid order, so the first maximum has the lowest grid index.
            best = max(members, key=lambda j: (float(scores[b, j]), -j))
            value = float(scores[b, best])
            expected[best] = value * 2.0 if value > 0 else value / 2.0 if value < 0 else 0.0
        assert torch.equal(penalised[b], expected)
        changed = int((penalised[b] != scores[b]).sum())
        nonzero_maxima = sum(1 for members in windows.values() if max(float(scores[b, j]) for j in members) != 0)
        assert changed == nonzero_maxima


def test_local_penalty_spreads_discards_over_windows() -> None:
    scores = torch.tensor([[0.3, 0.25, 0.2, -0.4]])
    grid_index = torch.arange(4).unsqueeze(0)
    penalised = local_penalty(scores, grid_index, (1, 4))
    torch.testing.assert_close(penalised, torch.tensor([[0.6, 0.25, 0.4, -0.4]]))
    assert select(scores, 2)[0].tolist() == [[0, 1]]
    assert select(penalised, 2)[0].tolist() == [[0, 2]]


def test_local_penalty_partial_edge_windows_and_negative_maxima() -> None:
    # 3x3 grid, window 2: windows {0,1,3,4}, {2,5}, {6,7}, {8}; position 4 was removed earlier.
    grid_index = torch.tensor([[0, 1, 2, 3, 5, 6, 7, 8]])
    scores = torch.tensor([[-0.4, -0.2, 0.0, -0.2, 0.0, -0.6, -0.6, -0.8]])
    penalised = local_penalty(scores, grid_index, (3, 3))
    expected = torch.tensor([[-0.4, -0.1, 0.0, -0.2, 0.0, -0.3, -0.6, -0.4]])
    torch.testing.assert_close(penalised, expected)
