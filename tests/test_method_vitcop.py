"""ViTCoP (docs/methods/vitcop.md): its tensor functions against per-item / per-sample references written in plain
loops, its plan (the paper's rows, the counts, its extra work), its refusals, and the method inside the tiny
LLaVA-1.5 and Video-LLaVA (seeded random weights, fp32): the tokens every layer receives, batches, generate, the
positions of its two decoder stages, --verify, and the CLI (flops, profile, sweep, show). The official rule itself
is tests/test_rule_vitcop.py."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers import assert_one_error_line, prefill_and_decode
from torch import Tensor, nn

import ficoco
from ficoco import accounting as acc
from ficoco.accounting import architecture
from ficoco.accounting.methods import extra_macs
from ficoco.accounting.schedule import plan_tokens
from ficoco.api import profile_of
from ficoco.errors import FicocoError
from ficoco.methods import vitcop
from ficoco.methods.vitcop import ops
from ficoco.models import synthetic_inputs

TINY_PROFILE = "llava-tiny"  # built as this module's `model` (conftest.py): 8 x 8 patches, 4 decoder layers
TEXT, START, KEEP = 12, 5, 16
# keep=16 on llava-tiny: ratio 0.25, vision_ratio 0.425 (27 of 64 patches), cluster_share 0.1575; the official
# layers 2 and 22 lie beyond its 4 layers: at 1 and 3 (the same fractions of the depth); 17 then 3 tokens.
CUT, SHALLOW, DEEP = 27, 17, 3


# ---- the tensor functions against plain references ------------------------------------------------------------

def reference_vic(x: Tensor, pos: Tensor, share: float, cutoff: float, radius: float) -> list[int]:
    """VIC of one item, pair by pair (ties: the lower index, as ficoco takes them)."""
    n = x.shape[0]
    dist = [[0.0 if i == j else math.sqrt(float(((x[i] - x[j]) ** 2).sum()) + 1e-8) for j in range(n)]
            for i in range(n)]
    rho = [sum(math.exp(-(d / cutoff) ** 2) for d in row) for row in dist]
    near = [[math.dist(pos[i].tolist(), pos[j].tolist()) <= radius for j in range(n)] for i in range(n)]
    parent, gamma = [], []
    for i in range(n):
        candidates = [(dist[i][j], j) for j in range(n) if j != i and rho[j] >= rho[i] and near[i][j]]
        delta, j = min(candidates) if candidates else (math.inf, 0)
        parent.append(j)
        gamma.append(delta * rho[i])
    order = sorted(range(n), key=lambda i: (-gamma[i], i))
    labels = [-1] * n
    for label, i in enumerate(order[:max(1, int(share * n))]):
        labels[i] = label
    while True:  # synchronous rounds, as the official loop
        update = [i for i in range(n) if labels[i] == -1 and labels[parent[i]] != -1]
        if not update:
            return labels
        for i in update:
            labels[i] = labels[parent[i]]


@pytest.mark.parametrize("share,radius", [(0.2, 0.6), (0.1, 0.2), (0.5, 0.35)])
def test_vic_labels_equal_a_per_item_reference_unassigned_chains_included(share: float, radius: float) -> None:
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(3, 24, 8, generator=generator) * 3
    patches = torch.stack([torch.randperm(64, generator=generator)[:24].sort().values for _ in range(3)])
    positions = ops.grid_positions(patches, (8, 8))
    labels = ops.vic_labels(features, positions, share, 8.0, radius)
    found = [reference_vic(features[i], positions[i], share, 8.0, radius) for i in range(3)]
    assert labels.tolist() == found
    if radius < 0.3:  # many tokens without a denser spatial neighbour: chains that reach no centre
        assert (labels == -1).any()


def reference_shallow(visual: Tensor, labels: list[int], norms: list[float], keep: int) -> tuple[list[int], Tensor]:
    """The shallow stage of one sample in loops (ties: the lower index); a negative label a cluster of its own."""
    count = len(labels)
    top = max([label for label in labels if label >= 0], default=-1) + 1
    labels = [label if label >= 0 else top + i for i, label in enumerate(labels)]
    clusters = sorted(set(labels))
    members = {c: [i for i in range(count) if labels[i] == c] for c in clusters}
    sums = {c: float(torch.tensor([norms[i] for i in members[c]]).sum()) for c in clusters}
    k = len(clusters)
    kept: list[int] = []
    groups: list[list[int]] = []
    if k > keep:
        apart = sorted(clusters, key=lambda c: (sums[c], clusters.index(c)))[:keep - 1]
        groups = [members[c] for c in apart] + [[i for i in range(count) if labels[i] not in apart]]
    else:
        quota = {c: min(round(float((len(members[c]) - 1) / (count - k) * (keep - k))) if count > k else 0,
                        len(members[c]) - 1) for c in clusters}
        diff = (keep - k) - sum(quota.values())
        by_sum = sorted(clusters, key=lambda c: (sums[c] if diff > 0 else -sums[c], clusters.index(c)))
        for c in by_sum:
            if diff > 0 and quota[c] < len(members[c]) - 1:
                quota[c], diff = quota[c] + 1, diff - 1
            elif diff < 0 and quota[c] > 0:
                quota[c], diff = quota[c] - 1, diff + 1
        for c in clusters:
            ranked = sorted(members[c], key=lambda i: (norms[i], i))
            kept += ranked[:quota[c]]
            groups.append(sorted(ranked[quota[c]:]))
    tokens = visual.clone()
    for group in groups:
        median = sorted(group)[len(group) // 2]
        tokens[median] = visual[median] + visual[group].mean(dim=0)
        kept.append(median)
    kept.sort()
    return kept, tokens[kept]


def test_the_shallow_stage_equals_a_per_sample_reference_in_both_branches_and_batches_as_samples_alone() -> None:
    generator = torch.Generator().manual_seed(3)
    count, keep = 20, 9
    visual = torch.randn(4, count, 6, generator=generator)
    norms = torch.rand(4, count, generator=generator)
    labels = torch.stack([torch.randint(0, 4, (count,), generator=generator),  # 4 clusters: quotas
                          torch.randint(0, 15, (count,), generator=generator) * 3,  # more clusters than `keep`
                          torch.arange(count) % 2 * 7 - 1,  # -1 (each its own cluster) and one cluster of 10
                          torch.randint(0, 9, (count,), generator=generator)])  # about `keep` clusters
    kept, tokens = ops.cluster_merge(visual, labels, norms, keep)
    branches = set()
    for b in range(4):
        expected_kept, expected = reference_shallow(visual[b], labels[b].tolist(), norms[b].tolist(), keep)
        assert kept[b].tolist() == expected_kept
        torch.testing.assert_close(tokens[b], expected, rtol=1e-5, atol=1e-6)
        alone = ops.cluster_merge(visual[b:b + 1], labels[b:b + 1], norms[b:b + 1], keep)
        assert torch.equal(alone[0][0], kept[b]) and torch.allclose(alone[1][0], tokens[b])
        clusters = len(set(labels[b].tolist()) - {-1}) + int((labels[b] < 0).sum())
        branches.add(clusters > keep)
    assert branches == {True, False}


def test_the_deep_stage_keeps_the_smallest_norms_lowest_index_first() -> None:
    norms = torch.tensor([[0.5, 0.1, 0.3, 0.1, 0.9], [0.2, 0.2, 0.2, 0.0, 0.7]])
    assert ops.deep_keep(norms, 2).tolist() == [[1, 3], [0, 3]]


# ---- the plan ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("preset,counts,average", [(192, (288, 253, 51), 192.1), (128, (230, 165, 33), 127.8),
                                                    (64, (172, 77, 15), 63.6)])
def test_the_presets_are_the_papers_rows_on_llava_1_5_7b(arch_of, preset: int, counts: tuple[int, int, int],
                                                         average: float) -> None:
    arch = arch_of("llava-1.5-7b")
    schedule = acc.resolve_schedule(arch, "vitcop", acc.CountOptions(), preset=preset)
    settings = schedule.settings_dict()
    assert (settings["ratio"], settings["vision_ratio"], settings["cluster_share"]) == vitcop.OFFICIAL_ROWS[preset]
    cut, shallow, deep = schedule.removals
    assert (cut.stage, cut.layer, cut.where) == ("vision", 22, "tower_output")
    assert (shallow.layer, deep.layer) == (2, 22)
    assert (576 - cut.remove, 576 - cut.remove - shallow.remove, 576 - cut.remove - shallow.remove - deep.remove) == \
        counts
    plan = plan_tokens(arch, schedule)
    assert round(sum(v for _, v in plan.llm_visual) / len(plan.llm_visual), 1) == average
    # The extra work, per sample: the [CLS] row and VIC's distances of the cut, key norms at both stages (head dim
    # 128) and the shallow stage's product (its tokens x the span x the width).
    n, r, d = counts
    rows = {(layer, term): macs for layer, term, macs in extra_macs(arch, schedule, plan, batch=2)}
    assert rows == {(22, "vitcop_vision_cls_row"): 2 * 16 * 64 * 577, (22, "vitcop_vic_distances"): 2 * n * n * 1024,
                    (2, "vitcop_key_norms"): 2 * n * 128, (2, "vitcop_cluster_merge"): 2 * r * n * 4096,
                    (22, "vitcop_key_norms"): 2 * r * 128}


def test_the_default_is_the_official_codes_and_keep_follows_the_line_through_the_rows(arch_of) -> None:
    arch = arch_of("llava-1.5-7b")
    settings = acc.method_schedule(arch, "vitcop").settings_dict()
    assert (settings["ratio"], settings["vision_ratio"], settings["cluster_share"]) == (0.25, 0.5, 0.18)
    assert vitcop.line_setting(96, 576) == (0.1667, 0.35, 0.135)
    # 13B's 40 layers: the formula counts them, so a layer average stays the keep.
    plan = plan_tokens(arch_of("llava-1.5-13b"), acc.method_schedule(arch_of("llava-1.5-13b"), "vitcop", 128))
    assert round(sum(v for _, v in plan.llm_visual) / 40) == 128


def test_impossible_settings_and_the_short_quota_are_one_line(arch_of) -> None:
    arch = arch_of("llava-1.5-7b")
    with pytest.raises(FicocoError, match="deep_span='real'") as caught:
        acc.method_schedule(arch, "vitcop", 300)  # the line asks the shallow layer for more than the cut kept
    assert "\n" not in str(caught.value)
    # ficoco's correction: the deep stage reads the tokens the shallow one really left (all of them).
    cut, shallow, deep = acc.method_schedule(arch, "vitcop", 300, deep_span="real").removals
    assert shallow.remove == 0 and 576 - cut.remove - deep.remove == round(round(
        (32 * 0.5208 / 0.6688 - 2) / (20 + 10 / 5) * int(0.6688 * 576)) / 5)
    for keep, words in ((5, "at least 1"), (600, "outside 1..576")):
        with pytest.raises(FicocoError, match=words):
            acc.method_schedule(arch, "vitcop", keep)
    with pytest.raises(FicocoError, match="must come after"):
        acc.method_schedule(arch, "vitcop", 64, shallow_layer=10, deep_layer=5)


@pytest.mark.parametrize("profile", ["llava-next-tiny", "llava-onevision-tiny", "qwen2-vl-tiny", "qwen2.5-vl-tiny",
                                     "qwen3-vl-tiny", "qwen3.5-tiny", "internvl3-tiny"])
def test_the_families_without_its_cls_cut_are_refused_in_one_line(cli, profile: str) -> None:
    line = assert_one_error_line(cli("flops", "--model", profile, "--variant", "vitcop", "--keep", "16"))
    assert "ViTCoP is defined on llava, video_llava" in line and ("[CLS]" in line or "AnyRes" in line)


def test_flops_plans_the_presets_and_a_budget(flops_report) -> None:
    report = flops_report("--model", "llava-1.5-7b", "--variant", "vitcop", "--preset", "128")
    row = report["rows"][0]
    assert (row["visual_tokens"], round(row["layer_average_visual_tokens"], 1)) == (33, 127.8)
    budget = flops_report("--model", "llava-1.5-7b", "--variant", "vitcop", "--tflops", "2.5")["rows"][0]
    assert budget["tflops"] <= 2.5 and budget["layer_average_visual_tokens"] > 127.8


# ---- inside the tiny LLaVA-1.5 -----------------------------------------------------------------------------------

def layer_lengths(model: nn.Module, call: Any) -> list[int]:
    """The sequence length every decoder layer's attention ran on during `call()`."""
    seen: list[int] = []
    hooks = [layer.self_attn.register_forward_pre_hook(
        lambda m, a, k: seen.append(k["hidden_states"].shape[1]), with_kwargs=True)
        for layer in model.model.language_model.layers]
    try:
        call()
    finally:
        for hook in hooks:
            hook.remove()
    return seen


def test_the_llm_sees_the_planned_tokens_and_a_batch_equals_its_samples_alone(model: nn.Module) -> None:
    inp = synthetic_inputs(model, batch=2, text_tokens=TEXT, seed=7)
    arch = architecture(profile_of(model))
    with torch.no_grad(), ficoco.apply(model, "vitcop", keep=KEEP) as handle:
        out: dict[str, Tensor] = {}
        seen = layer_lengths(model, lambda: out.setdefault("logits", model(**inp).logits))
        plan = plan_tokens(arch, handle.schedule, text_tokens=TEXT)
        assert seen == [n for n, _ in plan.llm] == [TEXT + CUT, TEXT + SHALLOW, TEXT + SHALLOW, TEXT + DEEP]
        assert [(r.stage, r.layer, r.kept.shape[1]) for r in handle.records] == \
            [("vision", 4, CUT), ("llm", 1, SHALLOW), ("llm", 3, DEEP)]
        for i in range(2):
            alone = model(**{k: v[i:i + 1] for k, v in inp.items()}).logits
            torch.testing.assert_close(out["logits"][i:i + 1], alone, atol=1e-5, rtol=0)


def test_a_left_padded_batch_equals_its_samples_alone(model: nn.Module) -> None:
    short = synthetic_inputs(model, batch=1, text_tokens=TEXT, seed=1)
    long = synthetic_inputs(model, batch=1, text_tokens=TEXT + 3, seed=2)
    zeros = torch.zeros(1, 3, dtype=torch.long)
    batch = {"input_ids": torch.cat([torch.cat([zeros, short["input_ids"]], 1), long["input_ids"]]),
             "attention_mask": torch.cat([torch.cat([zeros, short["attention_mask"]], 1), long["attention_mask"]]),
             "pixel_values": torch.cat([short["pixel_values"], long["pixel_values"]])}
    with torch.no_grad(), ficoco.apply(model, "vitcop", keep=KEEP):
        together = model(**batch).logits[:, -1]
        for i, sample in enumerate((short, long)):
            torch.testing.assert_close(together[i:i + 1], model(**sample).logits[:, -1], atol=1e-4, rtol=0)


def test_generate_matches_a_hand_written_loop_and_decodes_at_the_models_own_positions(model: nn.Module) -> None:
    inp = synthetic_inputs(model, batch=2, text_tokens=TEXT, seed=3)
    prompt = inp["input_ids"].shape[1]
    layers = model.model.language_model.layers
    tables: dict[int, list[Tensor]] = {0: [], 3: []}
    hooks = [layers[i].self_attn.register_forward_pre_hook(
        lambda m, a, k, i=i: tables[i].append(k["position_embeddings"][0]), with_kwargs=True) for i in tables]
    try:
        with torch.no_grad(), ficoco.apply(model, "vitcop", keep=KEEP) as handle:
            generated = model.generate(**inp, max_new_tokens=4, min_new_tokens=4, do_sample=False)
            out, positions, decoded, cache = prefill_and_decode(model, inp, 4, handle)
    finally:
        for hook in hooks:
            hook.remove()
    assert torch.equal(generated[:, :prompt], inp["input_ids"]) and torch.equal(generated[:, prompt:], decoded)
    assert out.logits.shape[1] == TEXT + DEEP and cache.get_seq_length() == TEXT + CUT + 3
    assert torch.equal(positions[:, -1], torch.full((2,), prompt - 1))
    # Prefill: the deep layer runs at the rows its input held (the shallow stage's gaps closed); decode steps at
    # the model's own positions in every layer (no shift: the official code's), the same as layer 0's.
    assert tables[3][0].shape[1] == TEXT + DEEP
    steps = [(first, deep) for first, deep in zip(tables[0], tables[3], strict=True) if first.shape[1] == 1]
    assert len(steps) == 2 * 3 and all(torch.equal(first, deep) for first, deep in steps)


def test_flops_verify_counts_the_methods_work_as_the_counters_see_it(flops_verify) -> None:
    run = flops_verify("--model", TINY_PROFILE, "--variant", "vitcop", "--keep", str(KEEP))["runs"][0]
    stages = {s["stage"]: s for s in run["stages"]}
    assert stages["method"]["analytic_flops"] > 0 and all(s["within_tolerance"] for s in stages.values())


# ---- inside the tiny Video-LLaVA: a frame is an item, its [CLS] rides in the LLM's span --------------------------

@pytest.fixture(scope="module")
def video_model() -> nn.Module:
    return ficoco.build_model("video-llava-tiny", dtype="fp32")


def test_video_llava_runs_the_plan_every_frames_cls_its_own_cluster(video_model: nn.Module,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    model = video_model
    inp = synthetic_inputs(model, batch=2, text_tokens=TEXT, seed=4)
    arch = architecture(profile_of(model))
    handed: list[Tensor] = []
    original = ops.cluster_merge

    def spy(visual: Tensor, labels: Tensor, norms: Tensor, keep: int) -> tuple[Tensor, Tensor]:
        handed.append(labels)
        return original(visual, labels, norms, keep)

    monkeypatch.setattr(ops, "cluster_merge", spy)
    with torch.no_grad(), ficoco.apply(model, "vitcop", keep=4) as handle:
        out: dict[str, Tensor] = {}
        seen = layer_lengths(model, lambda: out.setdefault("logits", model(**inp).logits))
        plan = plan_tokens(arch, handle.schedule, text_tokens=TEXT)
        assert seen == [n for n, _ in plan.llm]
        for i in range(2):
            alone = model(**{k: v[i:i + 1] for k, v in inp.items()}).logits
            torch.testing.assert_close(out["logits"][i:i + 1], alone, atol=1e-5, rtol=0)
    frames, per_frame = 4, 16 - handle.schedule.removals[0].remove + 1
    labels = handed[0].view(2, frames, per_frame)
    assert (labels[:, :, 0] == -1).all() and (labels[:, :, 1:] >= 0).all()  # [CLS] unlabelled, patches labelled
    assert len({int(x) for x in labels[0, :, 1:].flatten()} & {int(x) for x in labels[0, 0, 1:]}) == \
        len(set(labels[0, 0, 1:].tolist()))  # the frames' labels apart


# ---- the CLI on llava-tiny ----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def picture(tmp_path_factory: pytest.TempPathFactory) -> str:
    from PIL import Image

    path = tmp_path_factory.mktemp("vitcop_show") / "picture.png"
    Image.fromarray(np.linspace(0, 255, 90 * 120 * 3).reshape(90, 120, 3).astype(np.uint8)).save(path)
    return str(path)


def test_show_places_the_decoder_stages_through_the_cut(cli, picture: str, tmp_path: Path) -> None:
    report = tmp_path / "show.json"
    code, _, err = cli("show", "--model", TINY_PROFILE, "--variant", "vitcop", "--keep", str(KEEP), "--image",
                       picture, "--out", str(tmp_path / "show.png"), "--json", str(report), "--dtype", "fp32")
    assert code == 0, err
    steps = json.loads(report.read_text())["steps"]
    assert [(s["stage"], s["layer"], len(s["kept"])) for s in steps] == \
        [("vision", 4, CUT), ("llm", 1, SHALLOW), ("llm", 3, DEEP)]
    cut = steps[0]["records"]["kept"][0]
    # A decoder record's offsets into the shortened span name the cut's patches.
    assert [c[1] * 8 + c[2] for c in steps[1]["kept"]] == [cut[i] for i in steps[1]["records"]["kept"][0]]


def test_profile_and_sweep_run_it(cli, tmp_path: Path) -> None:
    path = tmp_path / "profile.json"
    result = cli("profile", "--model", TINY_PROFILE, "--variant", "vitcop", "--keep", str(KEEP), "--warmup", "0",
                 "--repeat", "1", "--no-reference", "--text-tokens", str(TEXT), "--dtype", "fp32", "--json", str(path))
    assert result.code == 0, result.err[-2000:]
    row = json.loads(path.read_text())["rows"][0]
    assert row["variant"] == "vitcop" and row["status"] == "ok"
    sweep = tmp_path / "sweep.json"
    result = cli("sweep", "--model", TINY_PROFILE, "--variant", "vitcop", "--keep", "16,24", "--json", str(sweep))
    assert result.code == 0, result.err[-2000:]
    points = [p for p in json.loads(sweep.read_text())["points"] if p["variant"] == "vitcop"]
    assert len(points) == 2


def test_two_images_per_prompt_keep_their_clusters_apart_and_batch_as_prompts_alone(
        model: nn.Module, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two image spans with text between them: one set of visual tokens (each step removes twice one image's
    count), each image's clusters its own, the deep stage's positions numbered in reading order."""
    alone = []
    for seed in (0, 1):
        first, second = (synthetic_inputs(model, batch=1, text_tokens=TEXT, seed=s) for s in (seed, seed + 10))
        ids = torch.cat([first["input_ids"], second["input_ids"][:, 1:]], 1)
        alone.append({"input_ids": ids, "attention_mask": torch.ones_like(ids),
                      "pixel_values": torch.cat([first["pixel_values"], second["pixel_values"]])})
    batch = {key: torch.cat([a[key] for a in alone]) for key in alone[0]}
    handed: list[Tensor] = []
    original = ops.cluster_merge

    def spy(visual: Tensor, labels: Tensor, norms: Tensor, keep: int) -> tuple[Tensor, Tensor]:
        handed.append(labels)
        return original(visual, labels, norms, keep)

    monkeypatch.setattr(ops, "cluster_merge", spy)
    with torch.no_grad(), ficoco.apply(model, "vitcop", keep=KEEP) as handle:
        seen = layer_lengths(model, lambda: model(**batch))
        together = model(**batch).logits[:, -1]
        labels, records = handed[-1], list(handle.records)
        generated = model.generate(**batch, max_new_tokens=3, min_new_tokens=3, do_sample=False)
        for i, sample in enumerate(alone):
            torch.testing.assert_close(together[i:i + 1], model(**sample).logits[:, -1], atol=1e-5, rtol=0)
            assert torch.equal(generated[i:i + 1], model.generate(**sample, max_new_tokens=3, min_new_tokens=3,
                                                                 do_sample=False))
    length = batch["input_ids"].shape[1] - 2 * (64 - CUT)
    assert seen == [length, length - 2 * (CUT - SHALLOW), length - 2 * (CUT - SHALLOW), length - 2 * (CUT - DEEP)]
    assert [tuple(r.kept.shape) for r in records] == [(4, CUT), (2, 2 * SHALLOW), (2, 2 * DEEP)]
    assert not set(labels[0, :CUT].tolist()) & set(labels[0, CUT:].tolist())


def test_the_short_quota_is_refused_by_default_and_runs_its_real_span_under_the_correction(model: nn.Module) -> None:
    """ratio = vision_ratio asks the shallow layer (1 of 4) for more tokens than the cut kept: the official code keeps
    them all and its deep stage reads the larger count into the text; ficoco refuses it unless deep_span='real'."""
    from ficoco.methods.registry import method_label

    setting = {"ratio": 0.5, "vision_ratio": 0.5}
    with pytest.raises(FicocoError, match="deep_span='real'"):
        ficoco.apply(model, "vitcop", **setting)
    inp = synthetic_inputs(model, batch=1, text_tokens=TEXT, seed=5)
    with torch.no_grad(), ficoco.apply(model, "vitcop", deep_span="real", **setting) as handle:
        seen = layer_lengths(model, lambda: model(**inp))
        settings = handle.schedule.settings_dict()
    cut, shallow, deep = handle.schedule.removals
    kept = 64 - cut.remove
    assert kept == 32 and shallow.remove == 0 and seen[:3] == [TEXT + kept] * 3
    # The deep stage keeps round(R / 5) of the R the formula asks (here 43 > 32): 9 of the 32 really left.
    assert seen[3] == TEXT + round(round((4 * 0.5 / 0.5 - 1) / (2 + 1 / 5) * kept) / 5) == TEXT + 9
    assert method_label("vitcop", settings) == "ViTCoP (ficoco: deep span of the real count)"


def test_its_stages_ask_the_host_nothing(model: nn.Module) -> None:
    """The cut, VIC and both decoder stages are batched without host synchronisation: a prefill adds the entry's,
    the decoder state's and the cut record's few questions to vanilla's, and decode steps none."""
    from ficoco.profiling.host_sync import count_host_syncs

    inp = synthetic_inputs(model, batch=2, text_tokens=TEXT, seed=3)

    def syncs(call: Any) -> int:
        with torch.no_grad(), count_host_syncs() as counts:
            call()
        return sum(counts.values())

    vanilla = (syncs(lambda: model(**inp)), syncs(lambda: model.generate(**inp, max_new_tokens=4, do_sample=False)))
    with ficoco.apply(model, "vitcop", keep=KEEP):
        prefill = syncs(lambda: model(**inp))
        generate = syncs(lambda: model.generate(**inp, max_new_tokens=4, do_sample=False))
    assert prefill - vanilla[0] <= 3 and generate - vanilla[1] == prefill - vanilla[0]
