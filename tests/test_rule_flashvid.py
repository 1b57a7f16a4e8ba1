"""FlashVID's official rule, re-stated here, against ficoco: its cut after the projector of a video's frames on the
tiny LLaVA-OneVision (ADTS v2, the official LLaVA-OneVision setting) and the tiny Qwen2.5-VL (ADTS v1, the
official Qwen2.5-VL setting), and its step inside the decoder on Qwen2.5-VL.

The official code: Fanziyang-v/FlashVID at 1d37422.

- **the scores** (flashvid/siglip_encoder.py L17-23, L71; flashvid/llava_arch.py L77-78): the last SigLIP layer's
  eager attention, heads then queries averaged, pooled 2x2 bilinearly as the frame (`get_2dPool`); on Qwen2.5-VL
  (flashvid/modeling_qwen2_5_vl.py L574-584, L257-263) the last vision block's queries and keys, a softmax over
  every patch of a temporal slice, heads then queries averaged, every 4 consecutive patches (a merge group in the
  tower's window order) averaged, put back in grid order by the merger's `reverse_indices`.
- **the cut** (flashvid/utils.py `flashvid_compression` L23-78): DySeg (L168-226: the cosine of consecutive frame
  means, a cut below 0.9, the lowest transitions cut too until `min_segment_num` segments); per segment
  (`segment_compression` L81-165): ADTS (flashvid/token_selection.py L28-130: ``ceil(0.7 b)`` tokens, cosine
  distances times attention x 1e6, times v2's event relevance, greedy max-min, v1 excluding the chosen); TSTM
  (utils.py L283-349: links above 0.8 to the previous frame's most similar free token, the soft threshold when
  fewer than ``(a + s) F`` stay, subtrees summed backwards, roots divided by 1 + their direct children); DPC-kNN
  (L115-165, L229-280: ``ceil(n_f s F / C)`` clusters per frame, ``k = min(clusters, 7)``, cdist / sqrt(D), centres
  by distance x density, members to the nearest centre, the mean at the centre's index; a one-frame segment
  clusters all its tokens); everything sorted by global index (L73-78).
- **inside the LLM** (utils.py `fastv_prune` L352-405, modeling_qwen2_5_vl.py L129-156, L344-350): at the input of
  `pruning_layer`, layer K-1's last query row (post-RoPE, recomputed, head mean) over the visual span;
  ``topk(ceil(0.3 n))`` stay, sorted, every position kept as it was.

ficoco's departures (docs/methods/flashvid.md), none with a setting that restores the official code: a segment
hands on exactly ``s x frames`` clusters (the official ``ceil`` per frame may hand on more: these inputs make the
official counts meet ficoco's fixed count, which the test asserts), DPC-kNN's density noise becomes the lowest
index (the inputs have no density tie, which the re-statement asserts), and LLaVA-OneVision's newline ranks with
the video's tokens inside the LLM (the step inside the LLM is checked on Qwen2.5-VL, whose span is the official
one). The tiny Qwen2.5-VL is built with its last vision block attending over whole slices, as every released
Qwen2.5-VL's does (the official code recomputes that block's attention over the slice whatever its windows). The
first two frames (slices) are one picture, so that TSTM links and merges them, and DySeg's segments mix one-frame
and two-frame segments; every budget gives each frame at least 3 clusters (fewer tie every density). The 4-layer
decoders prune at their last layer (``pruning_layer = 20`` lies beyond). The tiny projectors' last layers are
scaled up (`louder`): their seeded outputs are too small for DPC-kNN's densities in float32.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from rule_support import decoder, eager, fails_when, own_query_key, probabilities, top_set, watch_layers
from torch import Tensor, nn

import ficoco
from ficoco.methods.flashvid import ops as flashvid_ops
from ficoco.models import synthetic_inputs
from ficoco.models.llava_onevision import PREFIX_TOKENS
from ficoco.profiles import load_profile, set_layout

TINY_PROFILE = "llava-onevision-tiny"  # the conftest's model fixture is unused: the tests build wider frames
TEXT = 12
ALPHA, TAU, SEGMENT_THRESHOLD = 0.7, 0.8, 0.9


# ---- the official rule, re-stated -------------------------------------------------------------------------------

def official_segments(frame_means: Tensor, min_segments: int) -> list[int]:
    """DySeg: the segment lengths."""
    unit = frame_means / frame_means.norm(dim=-1, keepdim=True)
    similarity = (unit[:-1] * unit[1:]).sum(dim=-1)
    cuts = torch.where(similarity < SEGMENT_THRESHOLD)[0].tolist()
    if len(cuts) + 1 < min_segments:
        marked = similarity.clone()
        marked[marked < SEGMENT_THRESHOLD] = 1.0
        extra = torch.topk(marked, min(min_segments - len(cuts) - 1, marked.numel()), largest=False).indices
        cuts = sorted(cuts + extra.tolist())
    bounds = [-1, *cuts, len(frame_means) - 1]
    return [b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


def official_adts(features: Tensor, attention: Tensor, count: int, v2: bool) -> Tensor:
    """ADTS on one segment ``(F, N, D)``: ``(F, count)`` ascending indices."""
    frames, tokens, _ = features.shape
    unit = features / features.norm(dim=-1, keepdim=True)
    distance = (1 - unit @ unit.transpose(1, 2)) * (attention * 1e6).unsqueeze(1)
    if v2:
        relevance = torch.einsum("bnd,cd->bcn", features, features.mean(dim=1)).mean(dim=1)
        distance = distance * relevance.unsqueeze(1)
    keep = torch.zeros(frames, count, dtype=torch.long)
    keep[:, 0] = torch.topk(distance, 2, dim=1, largest=False).values[:, 1].argmax(dim=-1)
    for i in range(1, count):
        nearest = torch.gather(distance, 1, keep[:, :i].unsqueeze(-1).expand(-1, -1, tokens)).min(dim=1).values
        if not v2:
            nearest.scatter_(1, keep[:, :i], -1)
        keep[:, i] = nearest.argmax(dim=-1)
    return keep.sort(dim=1).values


def official_tstm(features: Tensor, free: Tensor, floor: int) -> tuple[Tensor, Tensor, Tensor]:
    """TSTM on one segment of several frames: (the tokens' values after the trees are summed, the roots, the roots
    that received others)."""
    frames, tokens, _ = features.shape
    values = features.clone()
    unit = features / features.norm(dim=-1, keepdim=True)
    similarity = torch.einsum("fnd,fmd->fnm", unit[1:], unit[:-1])
    similarity[~free[1:].unsqueeze(-1).expand(-1, -1, tokens)] = -1.0
    similarity[~free[:-1].unsqueeze(1).expand(-1, tokens, -1)] = -1.0
    best, anchor = similarity.max(dim=-1)
    best = torch.cat([torch.full((1, tokens), -1.0), best])
    anchor = torch.cat([torch.zeros(1, tokens, dtype=torch.long), anchor])
    linked = best > TAU
    if int((~linked).sum()) < floor * frames:
        soft = max(best.flatten().topk(frames * tokens - floor * frames).values[-1], -1.0 + 1e-6)
        linked = best > soft
    counts = torch.ones(frames, tokens)
    received = torch.zeros(frames, tokens, dtype=torch.bool)
    for f in range(frames - 1, -1, -1):
        received[f] = counts[f] > 1
        roots = ~linked[f]
        values[f][roots] = values[f][roots] / counts[f][roots].unsqueeze(-1)
        for n in torch.where(linked[f])[0].tolist():
            values[f - 1][anchor[f, n]] += values[f][n]
            counts[f - 1][anchor[f, n]] += 1
    return values, ~linked, received & ~linked


def official_dpc(x: Tensor, clusters: int) -> list[tuple[int, Tensor, int]]:
    """DPC-kNN on ``(n, D)``: (centre index, cluster mean, members). No density tie may occur (the official noise
    decides)."""
    dist = torch.cdist(x, x) / math.sqrt(x.shape[-1])
    density = (-(torch.topk(dist, min(clusters, 7), dim=-1, largest=False).values ** 2).mean(dim=-1)).exp()
    assert density.unique().numel() == density.numel(), "a density tie: the official noise would decide it"
    denser = density.view(1, -1) > density.view(-1, 1)
    parent = torch.where(denser, dist, dist.max()).min(dim=-1).values
    score = parent * density
    ranked = score.sort(descending=True).values
    assert clusters == len(x) or float(ranked[clusters - 1] - ranked[clusters]) > 1e-6 * float(ranked.abs().max())
    centres = score.topk(clusters).indices
    nearest = dist[:, centres].argmin(dim=-1)
    nearest[centres] = torch.arange(clusters)
    return [(int(centres[c]), x[nearest == c].mean(dim=0), int((nearest == c).sum())) for c in range(clusters)]


def official_cut(features: Tensor, attention: Tensor, keep: int, v2: bool, min_segments: int
                 ) -> list[tuple[int, Tensor, bool]]:
    """The tokens FlashVID hands on for one video ``(F, N, D)``: (global index, token, whether it is that place's own
    features: an ADTS token, or a cluster of one that received no other token), sorted by index."""
    frames, tokens, _ = features.shape
    adts = math.ceil(keep * ALPHA)
    rest = keep - adts
    out: list[tuple[int, Tensor, bool]] = []
    start = 0
    for length in official_segments(features.mean(dim=1), min_segments):
        segment, scores = features[start:start + length], attention[start:start + length]
        chosen = official_adts(segment, scores, adts, v2)
        out += [((start + f) * tokens + n, segment[f, n], True) for f in range(length) for n in chosen[f].tolist()]
        free = torch.ones(length, tokens, dtype=torch.bool).scatter(1, chosen, False)
        if length > 1:
            values, roots, received = official_tstm(segment, free, keep)
            pools = [(values[f][roots[f] & free[f]], torch.where(roots[f] & free[f])[0],
                      received[f][roots[f] & free[f]]) for f in range(length)]
        else:  # a frame alone: all its tokens
            pools = [(segment[0], torch.arange(tokens), torch.zeros(tokens, dtype=torch.bool))]
        ratio = rest * length / sum(len(index) for _, index, _ in pools)
        for f, (pool, index, merged) in enumerate(pools):
            clusters = math.ceil(len(index) * ratio)
            if ratio >= 1:
                out += [((start + f) * tokens + int(i), t, not bool(m)) for i, t, m in zip(index, pool, merged,
                                                                                          strict=True)]
            elif clusters:
                out += [((start + f) * tokens + int(index[c]), token, size == 1 and not bool(merged[c]))
                        for c, token, size in official_dpc(pool, clusters)]
        start += length
    return sorted(out, key=lambda item: item[0])


def louder(linear: nn.Module, model: nn.Module, scale: float = 100.0) -> nn.Module:
    """`model` with its projector's last linear layer scaled: the seeded tiny projectors hand on features of a few
    thousandths, whose DPC-kNN densities ``exp(-d^2)`` all round to 1 in float32; a real projector's are of order
    one."""
    with torch.no_grad():
        linear.weight.mul_(scale)
        linear.bias.mul_(scale)
    return model


# ---- LLaVA-OneVision (ADTS v2): its frames wider than the shipped tiny's, for clusters of several tokens ----------

OV_FRAMES, OV_POOLED = 6, 16  # 6 frames of 8 x 8 SigLIP patches, pooled to 4 x 4


@pytest.fixture(scope="module")
def onevision() -> nn.Module:
    profile = load_profile("llava-onevision-tiny")
    profile.config["vision_config"]["image_size"] = 112
    set_layout(profile, frames=OV_FRAMES)
    model = ficoco.build_model(profile, dtype="fp32")
    return louder(model.model.multi_modal_projector.linear_2, model)


def one_picture_first(inputs: dict[str, Tensor], frames: int, copies: int = 2) -> dict[str, Tensor]:
    """The first `copies` frames (LLaVA-OneVision's ``(1, F, C, H, W)``) or temporal slices (Qwen's patch rows,
    slice after slice) of a one-video prompt made one picture."""
    pixels = inputs["pixel_values_videos"].clone()
    view = pixels if pixels.dim() == 5 else pixels.view(1, frames, -1)
    for f in range(1, copies):
        view[:, f] = view[:, 0]
    return {**inputs, "pixel_values_videos": pixels}


def onevision_reads(model: nn.Module, inputs: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
    """The unpatched model: every frame's pooled projected tokens ``(F, 16, D)`` and the pooled attention each
    receives in the last SigLIP layer ``(F, 16)``."""
    with eager(model):
        out = model.model.vision_tower(inputs["pixel_values_videos"].flatten(0, 1), output_attentions=True,
                                       output_hidden_states=True)
        pool = model.model.apply_pooling
        features = pool(model.model.multi_modal_projector(out.hidden_states[-1]))
        received = out.attentions[-1].mean(dim=1).mean(dim=1)  # heads, then queries (siglip_encoder.py L71)
        scores = pool(received.unsqueeze(-1)).squeeze(-1)
    return features, scores


def check_onevision(model: nn.Module, keep: int, min_segments: int, seed: int) -> None:
    inputs = one_picture_first(synthetic_inputs(model, batch=1, text_tokens=TEXT, seed=seed), OV_FRAMES)
    features, scores = onevision_reads(model, inputs)
    expected = official_cut(features, scores, keep, v2=True, min_segments=min_segments)
    assert len(expected) == OV_FRAMES * keep, "the official counts must meet ficoco's fixed count on these inputs"
    lengths = official_segments(features.mean(dim=1), min_segments)
    assert 1 in lengths and max(lengths) > 1, "the inputs must give one-frame and several-frame segments"
    seen: list[Tensor] = []
    hook = decoder(model).layers[0].register_forward_pre_hook(
        lambda m, a, k: seen.append(a[0] if a else k["hidden_states"]), with_kwargs=True)
    try:
        with torch.no_grad(), ficoco.apply(model, "flashvid", keep=keep, min_segment_num=min_segments) as handle:
            model(**inputs)
    finally:
        hook.remove()
    span = seen[0][0, PREFIX_TOKENS:PREFIX_TOKENS + OV_FRAMES * keep]
    torch.testing.assert_close(span, torch.stack([token for _, token, _ in expected]), rtol=1e-5, atol=1e-5)
    # The record names, per frame's row of the span, the patch a token continues where it is its own frame's place
    # unchanged (an ADTS token, a cluster of one that received no other token); every other token -1.
    own = [place % OV_POOLED if place // OV_POOLED == row and alone else -1
           for row in range(OV_FRAMES) for place, _, alone in expected[row * keep:(row + 1) * keep]]
    vision = [r for r in handle.records if r.stage == "vision"][0]
    assert vision.kept.flatten().tolist() == own


@pytest.mark.parametrize("keep,min_segments,seed", [(10, 3, 1), (12, 4, 2)])
def test_flashvid_cuts_a_onevision_video_as_the_official_code(onevision: nn.Module, keep: int, min_segments: int,
                                                              seed: int) -> None:
    check_onevision(onevision, keep, min_segments, seed)


def test_the_onevision_rule_check_fails_when_adts_drops_the_event_relevance(
        onevision: nn.Module, monkeypatch: pytest.MonkeyPatch) -> None:
    original = flashvid_ops.adts_select

    def v1(features: Tensor, attention: Tensor, count: int, relevance: Tensor | None = None) -> Tensor:
        return original(features, attention, count, None)  # ADTS v1 where OneVision's official run takes v2

    fails_when(monkeypatch, flashvid_ops, "adts_select", v1, lambda: check_onevision(onevision, 10, 3, 1))


def test_the_onevision_rule_check_fails_when_a_root_is_divided_by_its_tree(
        onevision: nn.Module, monkeypatch: pytest.MonkeyPatch) -> None:
    """The official root divides by 1 + its direct children; dividing by the tree's size is another rule."""
    original = flashvid_ops.temporal_merge

    def tree_mean(x: Tensor, free: Tensor, starts: Tensor, segment: Tensor, threshold: float, floor: int
                  ) -> tuple[Tensor, Tensor, Tensor]:
        value, root, absorbed = original(x, free, starts, segment, threshold, floor)
        return torch.where(absorbed.unsqueeze(-1), value * 0.9, value), root, absorbed

    fails_when(monkeypatch, flashvid_ops, "temporal_merge", tree_mean, lambda: check_onevision(onevision, 10, 3, 1))


# ---- Qwen2.5-VL (ADTS v1, 4 segments): its slices, and the step inside the decoder -------------------------------

Q_FRAMES, Q_SLICES, Q_GROUPS = 12, 6, 20  # 12 frames of 10 x 8 patches: 6 slices of 20 merge groups


@pytest.fixture(scope="module")
def qwen25() -> nn.Module:
    profile = load_profile("qwen2.5-vl-tiny")
    profile.config["vision_config"]["fullatt_block_indexes"] = [2, 3]  # the last block over whole slices, as released
    set_layout(profile, frames=Q_FRAMES)
    model = ficoco.build_model(profile, dtype="fp32")
    return louder(model.model.visual.merger.mlp[2], model)


def qwen_reads(model: nn.Module, inputs: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
    """The unpatched model: the merger's output ``(slices, groups, D)`` (grid order) and the attention every group
    receives in the last vision block ``(slices, groups)``, recomputed from its queries and keys per slice."""
    from ficoco.models import hf_compat as hf

    visual, block = model.model.visual, model.model.visual.blocks[-1]
    module = __import__(type(model).__module__, fromlist=["apply_rotary_pos_emb_vision"])
    captured: dict[str, Any] = {}
    hook = block.register_forward_pre_hook(lambda m, a, k: captured.update(x=a[0] if a else k["hidden_states"], **k),
                                           with_kwargs=True)
    try:
        with torch.no_grad():
            features = visual(inputs["pixel_values_videos"], grid_thw=inputs["video_grid_thw"]).pooler_output
    finally:
        hook.remove()
    x, (cos, sin) = captured["x"], captured["position_embeddings"]
    heads = block.attn.num_heads
    with torch.no_grad():
        q, k, _ = block.attn.qkv(block.norm1(x)).reshape(x.shape[0], 3, heads, -1).permute(1, 0, 2, 3).unbind(0)
        q, k = module.apply_rotary_pos_emb_vision(q, k, cos, sin)
        q = q.reshape(Q_SLICES, -1, heads, q.shape[-1]).permute(0, 2, 1, 3)
        k = k.reshape(Q_SLICES, -1, heads, k.shape[-1]).permute(0, 2, 1, 3)
        received = torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, dim=-1).mean(dim=1).mean(dim=1)
        per_group = received.view(Q_SLICES, Q_GROUPS, 4).mean(dim=-1).flatten()  # window order
        window_index = hf.qwen2_5_vl_window_index(visual, inputs["video_grid_thw"])[0]
        scores = per_group[window_index.argsort()].view(Q_SLICES, Q_GROUPS)  # the merger's reverse_indices
    return features.view(Q_SLICES, Q_GROUPS, -1), scores


def check_qwen25(model: nn.Module, keep: int, seed: int) -> None:
    inputs = synthetic_inputs(model, batch=1, text_tokens=TEXT, seed=seed)
    inputs = one_picture_first(inputs, Q_SLICES)
    features, scores = qwen_reads(model, inputs)
    expected = official_cut(features, scores, keep, v2=False, min_segments=4)
    assert len(expected) == Q_SLICES * keep, "the official counts must meet ficoco's fixed count on these inputs"
    lengths = official_segments(features.mean(dim=1), 4)
    assert 1 in lengths and max(lengths) > 1, "the inputs must give one-slice and several-slice segments"
    layers = decoder(model).layers
    last = len(layers) - 1  # pruning_layer 20 lies beyond the 4-layer decoder: its last layer
    embeds: list[Tensor] = []
    hook = decoder(model).register_forward_pre_hook(lambda m, a, k: embeds.append(k["inputs_embeds"]),
                                                    with_kwargs=True)
    try:
        with torch.no_grad(), ficoco.apply(model, "flashvid", keep=keep) as handle, \
                watch_layers(model, [last - 1, last]) as seen:
            model(**inputs)
            kept_in_prompt = handle.prompt_map[0][0]
    finally:
        hook.remove()
    assert handle.schedule.settings_dict()["token_selection_method"] == "attn_div"  # the Qwen scripts' ADTS v1
    video = inputs["input_ids"][0, kept_in_prompt] == model.config.video_token_id
    torch.testing.assert_close(embeds[0][0, video], torch.stack([token for _, token, _ in expected]), rtol=1e-5,
                               atol=1e-5)
    span_start = int((inputs["input_ids"][0] == model.config.video_token_id).nonzero()[0])
    assert (kept_in_prompt[video] - span_start).tolist() == [place for place, _, _ in expected]
    # Inside the LLM: layer K-1's last row over the video span, recomputed from what that layer ran on.
    ran_on, (cos, sin) = seen[last - 1].ran_on, seen[last - 1].rotary
    query, key = own_query_key(layers[last - 1], ran_on, cos, sin)
    first = int(video.nonzero()[0])
    count = Q_SLICES * keep
    row = probabilities(query, key).mean(dim=1)[0, -1, first:first + count]
    kept = top_set(row, math.ceil(count * 0.3))
    inner = [r for r in handle.records if r.stage == "llm"][0]
    assert inner.layer == last and inner.kept[0].tolist() == kept
    after = seen[last].ran_on[0]
    torch.testing.assert_close(after[first:first + len(kept)], seen[last].received[0, [first + i for i in kept]])
    # The kept tokens keep their positions: the rotary rows the last layer ran with are layer K-1's, indexed.
    keep_index = [*range(first), *(first + i for i in kept), *range(first + count, ran_on.shape[1])]
    assert torch.equal(seen[last].rotary[0][0], cos[0, keep_index])


@pytest.mark.parametrize("keep,seed", [(10, 1), (14, 2)])
def test_flashvid_cuts_a_qwen2_5_vl_video_and_prunes_inside_the_decoder_as_the_official_code(
        qwen25: nn.Module, keep: int, seed: int) -> None:
    check_qwen25(qwen25, keep, seed)


def test_the_qwen_rule_check_fails_when_the_segments_are_one(qwen25: nn.Module,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    def one_segment(features: Tensor, threshold: float = 0.9, min_segments: int = 8) -> Tensor:
        return torch.zeros(features.shape[:2], dtype=torch.long, device=features.device)

    fails_when(monkeypatch, flashvid_ops, "segment_frames", one_segment, lambda: check_qwen25(qwen25, 10, 1))


def test_the_qwen_rule_check_fails_when_the_decoder_keeps_the_least_attended(
        qwen25: nn.Module, monkeypatch: pytest.MonkeyPatch) -> None:
    from ficoco.methods.inputs import StepInput

    original = flashvid_ops.step

    def least_attended(inputs: StepInput, settings: Any) -> Any:
        if inputs.row_attention is None:
            return original(inputs, settings)
        import dataclasses

        return original(dataclasses.replace(inputs, row_attention=-inputs.row_attention), settings)

    fails_when(monkeypatch, flashvid_ops, "step", least_attended, lambda: check_qwen25(qwen25, 10, 1))


def test_the_official_distances_and_ficocos_agree_off_the_tie_rule() -> None:
    """A check of the re-statement itself on plain tensors: its ADTS v1 and v2 and DPC-kNN pick what ficoco's
    functions pick where nothing ties (the model tests above compare the whole cut)."""
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(2, 16, 12, generator=generator)
    attention = torch.rand(2, 16, generator=generator) / 16
    assert official_adts(x, attention, 5, v2=False).tolist() == flashvid_ops.adts_select(x, attention, 5).tolist()
    relevance = (x @ x.mean(dim=(0, 1)).unsqueeze(-1)).squeeze(-1)
    assert official_adts(x, attention, 5, v2=True).tolist() == \
        flashvid_ops.adts_select(x, attention, 5, relevance).tolist()
    centres = sorted(c for c, _, _ in official_dpc(x[0], 4))
    mine, _ = flashvid_ops.dpc_knn(x[:1], torch.ones(1, 16, dtype=torch.bool), torch.tensor([4]))
    assert torch.where(mine[0])[0].tolist() == centres
