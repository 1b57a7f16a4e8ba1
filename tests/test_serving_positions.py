"""The vLLM plugin's M-RoPE positions for a reduced Qwen2.5-VL video, engine-free (torch, no vLLM): the prompt's
positions are the unreduced prompt's (the text after the video where its whole grid ends, the temporal axis
stepping by seconds per slice x tokens_per_second), and once the encoder ran every kept token takes the position of
its own group: base + (slice's temporal position, row, column), in a whole prefill or a chunk that starts inside
the span (`ficoco.serving.vllm.tokens`)."""

from __future__ import annotations

import torch

from ficoco.serving.vllm.tokens import POSITION_CHANNELS, grid_positions, place_positions, prompt_positions

IMAGE, VIDEO, START, END = 90, 91, 92, 93
FACTOR = 2.0  # 1 s per temporal slice x 2 tokens per second
# A video of 2 temporal slices of 2x3 merge groups; every slice keeps 3 groups (grid indices within the slice).
KEPT = [[0, 4, 5], [1, 2, 3]]


def _prompt() -> list[int]:
    return [1, 2, 3, START, *[VIDEO] * 6, END, 4, 5]


def _rows() -> torch.Tensor:
    """The video's kept rows as the model hands them on: a feature, then (t, row, column) with t the slice's
    temporal position, slice by slice (what `ReducingQwen2_5_VL._process_video_input` builds)."""
    rows = []
    for s, kept in enumerate(KEPT):
        piece = grid_positions(torch.full((3, 1), float(s)), torch.tensor(kept), (1, 4, 6), 2)
        piece[:, -POSITION_CHANNELS] = int(s * FACTOR)
        rows.append(piece)
    return torch.cat(rows)


def _expected_places() -> list[list[int]]:
    base = 4  # after the three text tokens and the vision start
    return [[base + int(s * FACTOR), base + g // 3, base + g % 3] for s, kept in enumerate(KEPT) for g in kept]


def test_the_text_after_a_reduced_video_starts_where_the_whole_grid_ends() -> None:
    ids = _prompt()
    positions, delta = prompt_positions(len(ids), [(4, 6, 2, 2, 3, FACTOR)])
    assert positions[:, :4].tolist() == [[0, 1, 2, 3]] * 3
    # The whole grid's largest position: base 4 + (temporal 2, row 1, column 2) -> the text after starts at 7.
    assert positions[:, 10:].tolist() == [[7, 8, 9]] * 3
    assert delta == 10 - len(ids)


def test_every_kept_token_takes_its_groups_position_in_a_prefill_or_a_chunk_inside_the_span() -> None:
    ids = _prompt()
    positions, _ = prompt_positions(len(ids), [(4, 6, 2, 2, 3, FACTOR)])
    stripped, placed, delta = place_positions(ids, [_rows()], positions, 0, (IMAGE, VIDEO))
    assert placed[:3, 4:10].T.tolist() == _expected_places()
    assert placed[:, 10:].tolist() == positions[:, 10:].tolist()
    assert stripped[0].shape == (6, 1) and delta == 10 - len(ids)
    # A chunk that starts at the span's fourth token is fed the last three rows: they land on tokens 7 to 9.
    _, chunked, _ = place_positions(ids, [_rows()[3:]], positions, 7, (IMAGE, VIDEO))
    assert chunked[:3, 7:10].T.tolist() == _expected_places()[3:]
    # Image spans are not video spans: with the image token alone, no placeholder takes these rows.
    try:
        place_positions(ids, [_rows()], positions, 0, IMAGE)
    except RuntimeError as exc:
        assert "placeholders" in str(exc)
    else:
        raise AssertionError("video rows were placed on no video placeholder")
