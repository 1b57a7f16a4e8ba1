"""HoliTom's official rule, re-stated here, against ficoco on video-llava-tiny: its cut after the projector on a
video's frames, and its inner merge in the decoder.

The official code: cokeshao/HoliTom at b1d1412 (the inner merge unchanged since e5f7da2):

- **the cut** (holitom/llava_arch.py): every frame's projected tokens and the attention each receives in the
  tower's last layer - the one whose output the projector reads - heads and queries averaged
  (LLaVA-NeXT/llava/model/multimodal_encoder/siglip_encoder.py L614-617); consecutive frames' cosine similarity
  per position (L377-380); `select_static_windows` (L53-98): a position is static over a window when every
  consecutive pair is above ``T = 0.8``, a window saves its static count times its length - 1, a dynamic
  programme keeps the best saving (strict improvement); the retain ratio grows to ``r / ((total - saved) /
  total)`` (L388-390); per window (`get_static_dynamic_features` L278-311, `holitom` L234-276): the static
  tokens' mean over the window is clustered (`merge_tokens_by_density` L199-214: ``round(n * r)`` clusters,
  `cluster_dpc_knn` L29-51 with ``k = min(7, clusters)``, centres sorted, every other token to its nearest centre,
  a cluster token ``0.6 * centre + 0.4 * mean(members)``, L100-150), every frame's dynamic tokens keep their
  ``ceil(n * r)`` most attended (`merge_tokens_by_attention_density` L152-197, ``D = 0``); each frame's tokens in
  position order, a window's clusters with its first frame (L254-272, the "grid" order without its newline
  tokens).
- **the inner merge** (holitom/modeling_qwen2.py L146-206): at ``layer_idx == HOLITOM_k``, layer K-1's attention
  (``output_attentions`` at K-1, L210-211) averaged over heads, the last row, the visual span;
  ``topk(round(n * (1 - r)))`` stay (L158-160); every other visual token, in ascending order, is averaged into the
  kept token of highest cosine similarity, ``h_t = (h_t + h_j) / 2`` (similarities of layer K's input, L166-181);
  ``keep_indexs`` sorted, ``position_ids = keep_indexs`` (L185-204).

ficoco's departures (docs/methods/holitom.md), none with a setting that restores the official code: a video hands
on exactly ``frames x keep`` tokens (the official per-part ``round``/``ceil`` counts vary around it: the inputs
here make them meet it exactly, which the test asserts), DPC-kNN's density noise becomes the lowest index (the
inputs have no density tie: every cluster count is at least 3), and on Video-LLaVA a frame's [CLS] rides along
(the tokens are compared without it). The video's first two frames are one picture (a window of 2 frames, every
position static), the others differ. The 4-layer decoder merges at its last layer (``HOLITOM_k = 18`` lies beyond
it). ficoco runs its defaults (``attention_scores="model"``).
"""

from __future__ import annotations

import math

import pytest
import torch
from rule_support import (
    assert_decided,
    decoder,
    eager,
    fails_when,
    own_query_key,
    probabilities,
    rotary,
    top_set,
    watch_layers,
)
from torch import Tensor, nn

import ficoco
from ficoco.methods.holitom import ops as holitom_ops
from ficoco.models import synthetic_inputs

TINY_PROFILE = "video-llava-tiny"  # built as this module's `model` (conftest.py)
TEXT = 12
START, FRAMES, PATCHES = 5, 4, 16
TAU, BETA, NEIGHBOURS = 0.8, 0.6, 7


def video(model: nn.Module, seed: int) -> dict[str, Tensor]:
    """One synthetic video prompt whose frames 0 and 1 are the same picture."""
    inputs = synthetic_inputs(model, batch=1, text_tokens=TEXT, seed=seed)
    pixels = inputs["pixel_values_videos"].clone()
    pixels[:, 1] = pixels[:, 0]
    return {**inputs, "pixel_values_videos": pixels}


def tower_reads(model: nn.Module, inputs: dict[str, Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    """The unpatched tower with eager attention: every frame's projected patches ``(F, N, D)``, its projected
    [CLS] ``(F, D)``, and the attention every patch receives in the layer the projector reads ``(F, N)``."""
    with eager(model):
        out = model.model.video_tower(inputs["pixel_values_videos"].flatten(0, 1), output_attentions=True,
                                      output_hidden_states=True)
        projected = model.model.multi_modal_projector(out.hidden_states[-2])
    attention = out.attentions[len(out.attentions) - 2]  # the layer whose output is hidden_states[-2]
    received = attention.mean(dim=1).mean(dim=1)[:, 1:]  # heads, then queries; [CLS]'s column dropped
    return projected[:, 1:], projected[:, 0], received


def official_dpc(x: Tensor, clusters: int) -> list[tuple[int, Tensor]]:
    """`cluster_dpc_knn` then `merge_tokens_by_clustering` on ``(P, D)``: (centre index, cluster token), centres
    ascending. No density tie may occur (the official noise decides one)."""
    count, width = x.shape
    dist = (x.unsqueeze(1) - x.unsqueeze(0)).norm(dim=-1) / width ** 0.5
    k = min(NEIGHBOURS, clusters)
    density = (-(torch.topk(dist, k, dim=-1, largest=False).values ** 2).mean(dim=-1)).exp()
    assert density.unique().numel() == count, "a density tie: the official noise would decide it"
    denser = density.view(1, -1) > density.view(-1, 1)
    parent = torch.where(denser, dist, dist.max()).min(dim=-1).values
    score = parent * density
    assert_decided(score, clusters)
    centres = sorted(score.topk(clusters).indices.tolist())
    others = [i for i in range(count) if i not in centres]
    nearest = dist[others][:, centres].argmin(dim=-1).tolist() if others else []
    out = []
    for c, centre in enumerate(centres):
        members = [o for o, n in zip(others, nearest, strict=True) if n == c]
        token = x[centre] if not members else BETA * x[centre] + (1 - BETA) * x[members].mean(dim=0)
        out.append((centre, token))
    return out


def official_cut(features: Tensor, received: Tensor, retain_ratio: float) -> list[tuple[int, int, bool, Tensor]]:
    """The tokens HoliTom hands on for one video: (frame, position, dominant, token), in the official order."""
    frames, tokens, _ = features.shape
    unit = torch.nn.functional.normalize(features, dim=-1)
    static_pair = (unit[:-1] * unit[1:]).sum(dim=-1) > TAU  # (F - 1, N)

    def static(s: int, e: int) -> Tensor:  # static over frames s..e (every pair inside)
        return static_pair[s:e].all(dim=0)

    best, first = [0.0] * frames, list(range(frames))
    for i in range(frames):
        best[i] = best[i - 1] if i else 0.0
        for size in range(2, i + 2):
            j = i - size
            gain = (best[j] if j >= 0 else 0.0) + int(static(j + 1, i).sum()) * (size - 1)
            if gain > best[i]:
                best[i], first[i] = gain, j + 1
    windows, i = [], frames - 1
    while i >= 0:
        windows.append((first[i], i))
        i = first[i] - 1
    windows.reverse()
    total = frames * tokens
    ratio = min(retain_ratio / ((total - best[-1]) / total), 1)
    out = []
    for s, e in windows:
        mask = static(s, e) if e > s else torch.zeros(tokens, dtype=torch.bool)
        positions = torch.nonzero(mask).flatten().tolist()
        clusters = official_dpc(features[s:e + 1, mask].mean(dim=0), round(len(positions) * ratio)) \
            if positions and round(len(positions) * ratio) else []
        for f in range(s, e + 1):
            dynamic = torch.nonzero(~mask).flatten().tolist()
            dominant = math.ceil(len(dynamic) * ratio)
            picked = [dynamic[i] for i in top_set(received[f, dynamic], dominant)] if dominant else []
            frame = [(p, True, features[f, p]) for p in picked]
            if f == s:
                frame += [(positions[c], False, token) for c, token in clusters]
            out += [(f, p, dominant_, token) for p, dominant_, token in sorted(frame, key=lambda t: t[0])]
    return out


def official_inner_merge(visual: Tensor, scores: Tensor, keep: int) -> tuple[list[int], Tensor]:
    """The inner merge of one span ``(n, D)``: the kept indices (ascending) and their tokens after the merge."""
    kept = top_set(scores, keep)
    states = visual.clone()
    kept_unit = torch.nn.functional.normalize(visual[kept], dim=-1)
    for j in (j for j in range(visual.shape[0]) if j not in kept):  # ascending; similarities of the input
        target = kept[int((torch.nn.functional.normalize(visual[j], dim=-1) @ kept_unit.T).argmax())]
        states[target] = (states[target] + states[j]) / 2
    return kept, states[kept]


def check_holitom(model: nn.Module, keep: int, seed: int) -> None:
    inputs = video(model, seed)
    features, cls, received = tower_reads(model, inputs)
    expected = official_cut(features, received, keep / PATCHES)
    assert len(expected) == FRAMES * keep, "the official counts must meet ficoco's fixed count on these inputs"
    assert not all(dominant for _, _, dominant, _ in expected), "the inputs must give static clusters"
    merge_layer = len(decoder(model).layers) - 1
    with torch.no_grad(), ficoco.apply(model, "holitom", keep=keep) as handle, \
            watch_layers(model, [0, merge_layer - 1, merge_layer]) as seen:
        model(**inputs)
    # The cut: frame by frame, [CLS] then `keep` tokens of HoliTom's order (its rows of the prompt's span).
    span = FRAMES * (keep + 1)
    rows = seen[0].received[0, START:START + span].view(FRAMES, keep + 1, -1)
    torch.testing.assert_close(rows[:, 0], cls, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(rows[:, 1:].flatten(0, 1), torch.stack([t for *_, t in expected]), rtol=1e-5,
                               atol=1e-6)
    # The record names, per frame's row, the patch a token continues when it is its own frame's dominant token.
    vision = [r for r in handle.records if r.stage == "vision"][0]
    own = [[p if dominant and f == row else -1 for f, p, dominant, _ in expected[row * keep:(row + 1) * keep]]
           for row in range(FRAMES)]
    assert vision.kept.tolist() == own
    # The inner merge at the last layer: layer K-1's last row over the visual span, on what that layer ran on.
    ran_on = seen[merge_layer - 1].ran_on
    length = ran_on.shape[1]
    cos, sin = rotary(model, ran_on, torch.arange(length).unsqueeze(0))
    query, key = own_query_key(decoder(model).layers[merge_layer - 1], ran_on, cos, sin)
    scores = probabilities(query, key).mean(dim=1)[0, -1, START:START + span]
    entering = seen[merge_layer].received[0]
    kept, merged = official_inner_merge(entering[START:START + span], scores, round(span * (1 - 0.5)))
    inner = [r for r in handle.records if r.stage == "llm"][0]
    assert inner.layer == merge_layer and inner.kept[0].tolist() == kept
    keep_indexs = [*range(START), *(START + i for i in kept), *range(START + span, length)]
    after = seen[merge_layer].ran_on[0]
    torch.testing.assert_close(after[START:START + len(kept)], merged, rtol=1e-5, atol=1e-6)
    assert torch.equal(after[START + len(kept):], entering[START + span:])
    cos, _ = rotary(model, ran_on, torch.tensor([keep_indexs]))  # original positions
    assert torch.equal(seen[merge_layer].rotary[0], cos)


@pytest.mark.parametrize("keep,seed", [(3, 0), (6, 1)])
def test_holitom_cuts_a_video_and_merges_inside_the_decoder_as_the_official_code(
        model: nn.Module, keep: int, seed: int) -> None:
    check_holitom(model, keep, seed)


def test_the_holitom_rule_check_fails_when_a_cluster_token_is_the_plain_mean(
        model: nn.Module, monkeypatch: pytest.MonkeyPatch) -> None:
    original = holitom_ops.dpc_knn_merge

    def no_beta(x: Tensor, valid: Tensor, clusters: Tensor, neighbours: int, beta: float) -> tuple[Tensor, Tensor]:
        return original(x, valid, clusters, neighbours, 0.5)  # BETA=0.6 is the official default

    fails_when(monkeypatch, holitom_ops, "dpc_knn_merge", no_beta, lambda: check_holitom(model, 3, 0))


def test_the_holitom_rule_check_fails_when_the_inner_merge_keeps_the_least_attended(
        model: nn.Module, monkeypatch: pytest.MonkeyPatch) -> None:
    original = holitom_ops.inner_merge

    def least_attended(visual: Tensor, scores: Tensor, keep: int) -> tuple[Tensor, Tensor]:
        return original(visual, -scores, keep)

    fails_when(monkeypatch, holitom_ops, "inner_merge", least_attended, lambda: check_holitom(model, 3, 0))
