"""DivPrune, VisPruner and CDPruner: diversity-based selection before the LLM.

Each batched tensor function is checked against a small independent re-implementation written from
the papers (per sample, plain loops; CDPruner's greedy MAP by the determinant it maximises, not by
its incremental Cholesky rows), a batch against its items alone, a full keep against the identity,
and the counts against the accountant's plan. On the tiny LLaVA: a full keep is vanilla, a left-padded
batch equals its samples alone, generate equals a hand-written decode, CDPruner's picks equal the
selection on the projected features and the suffix's own input embeddings, and flops --verify passes.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import prefill_and_decode
from torch import Tensor, nn

import ficoco
from ficoco import accounting as acc
from ficoco.accounting.schedule import plan_tokens
from ficoco.api import profile_of
from ficoco.errors import FicocoError
from ficoco.methods.cdpruner.ops import cdpruner_reduce, cdpruner_select
from ficoco.methods.divprune.ops import divprune_reduce
from ficoco.methods.registry import method
from ficoco.methods.vispruner.ops import vispruner_reduce
from ficoco.models import synthetic_inputs

METHODS = ("divprune", "vispruner", "cdpruner")
N, D, KEEP = 20, 6, 7
TEXT, PATCHES, NEW, MODEL_KEEP = 12, 64, 4, 16


def _random(batch: int = 3, tokens: int = N, width: int = D, seed: int = 0) -> Tensor:
    return torch.randn(batch, tokens, width, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _cos(x: np.ndarray, y: np.ndarray) -> float:
    return float(x @ y / (np.linalg.norm(x) * np.linalg.norm(y)))


# ---- independent references (one sample, plain loops, from the papers) -------------------------------------------

def _reference_divprune(x: np.ndarray, keep: int) -> list[int]:
    """Max-Min diversity (MMDP) greedy on d = 1 - cos."""
    n = len(x)
    dist = [[1 - _cos(x[i], x[j]) for j in range(n)] for i in range(n)]
    nearest = [min(dist[i][j] for j in range(n) if j != i) for i in range(n)]
    picked = [max(range(n), key=lambda i: (nearest[i], -i))]
    while len(picked) < keep:
        rest = [i for i in range(n) if i not in picked]
        picked.append(max(rest, key=lambda i: (min(dist[i][j] for j in picked), -i)))
    return sorted(picked)


def _reference_vispruner(x: np.ndarray, score: np.ndarray, keep: int) -> list[int]:
    """Half by importance; duplicates removed from the rest, at most 8 per round, by a/b bipartite similarity."""
    important = int(keep * 0.5)
    order = sorted(range(len(x)), key=lambda i: (-score[i], i))
    residual = order[important:]
    while True:
        r = min(8, len(residual) - (keep - important))
        if r <= 0:
            break
        a, b = residual[0::2], residual[1::2]
        best = [max(_cos(x[i], x[j]) for j in b) for i in a]
        ranked = sorted(range(len(a)), key=lambda k: (-best[k], k))
        residual = [a[k] for k in ranked[r:]] + b
    return sorted(order[:important] + residual)


def _reference_cdpruner(x: np.ndarray, text: np.ndarray, keep: int) -> list[int]:
    """Greedy MAP of the DPP with L = diag(q) S diag(q): each pick maximises det(L_S)."""
    n = len(x)
    rel = [-np.mean([_cos(x[i], t) for t in text]) for i in range(n)]
    low, high = min(rel), max(rel)
    q = [(r - low + 1e-6) / (high - low) for r in rel]
    kernel = np.array([[q[i] * _cos(x[i], x[j]) * q[j] for j in range(n)] for i in range(n)])
    picked: list[int] = []
    while len(picked) < keep:
        rest = [i for i in range(n) if i not in picked]
        picked.append(max(rest, key=lambda i: np.linalg.det(kernel[np.ix_(picked + [i], picked + [i])])))
    return sorted(picked)


def test_divprune_matches_the_max_min_reference_batch_equals_items_and_full_keep_is_identity() -> None:
    x = _random()
    features, kept = divprune_reduce(x, KEEP)
    for b in range(3):
        assert kept[b].tolist() == _reference_divprune(x[b].numpy(), KEEP)
        assert torch.equal(divprune_reduce(x[b:b + 1], KEEP)[1][0], kept[b])
    assert torch.equal(features, x.gather(1, kept.unsqueeze(-1).expand(-1, -1, D)))
    assert torch.equal(divprune_reduce(x, N)[0], x)


def test_vispruner_matches_the_official_loop_batch_equals_items_and_full_keep_is_identity() -> None:
    x = _random(tokens=40, seed=1)  # 40 tokens: several rounds of 8, then a shorter one
    scores = torch.rand(3, 40, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    for keep in (KEEP, 11):
        _, kept = vispruner_reduce(x, scores, keep)
        for b in range(3):
            assert kept[b].tolist() == _reference_vispruner(x[b].numpy(), scores[b].numpy(), keep)
            assert torch.equal(vispruner_reduce(x[b:b + 1], scores[b:b + 1], keep)[1][0], kept[b])
    assert torch.equal(vispruner_reduce(x, scores, 40)[0], x)


def test_cdpruner_greedy_map_maximises_the_determinant_and_batch_equals_items() -> None:
    # Wider than the tokens: a cosine kernel of rank < keep leaves the later picks to rounding noise.
    x, text = _random(width=N + 4, seed=3), _random(tokens=5, width=N + 4, seed=4)
    mask = torch.ones(3, 5, dtype=torch.bool)
    mask[1, 3:] = False  # a shorter instruction, padded
    _, kept = cdpruner_reduce(x, text, KEEP, mask)
    for b in range(3):
        real = text[b][mask[b]]
        assert kept[b].tolist() == _reference_cdpruner(x[b].numpy(), real.numpy(), KEEP)
        assert torch.equal(cdpruner_select(x[b:b + 1], x[b:b + 1], real[None], KEEP)[0], kept[b])
    assert torch.equal(cdpruner_reduce(x, text, N, mask)[0], x)
    # More picks than the features' width (the kernel's rank): still distinct tokens, in image order.
    narrow = cdpruner_reduce(_random(width=4, seed=5), _random(tokens=5, width=4, seed=6), N - 1)[1]
    assert all(len(set(row.tolist())) == N - 1 for row in narrow) and bool((narrow.diff(dim=1) > 0).all())


def test_counts_and_cost_terms_equal_the_plan_on_the_literature_rows(arch_of) -> None:
    arch = arch_of("llava-1.5-7b")
    terms = {"divprune": {"divprune_projected_cosine_distance": 576 * 576 * 4096},
             "vispruner": {"vispruner_vision_cls_row", "vispruner_vision_duplicate_similarity"},
             "cdpruner": {"cdpruner_projected_similarity", "cdpruner_text_relevance", "cdpruner_greedy_map"}}
    for name in METHODS:
        for keep in (192, 128, 64):
            schedule = acc.resolve_schedule(arch, name, acc.CountOptions(), preset=keep)
            plan = plan_tokens(arch, schedule)
            assert plan.llm_visual_tokens == keep and plan.llm[0][0] == plan.text_tokens + keep
            rows = acc.extra_macs(arch, schedule, plan)
            assert {term for _, term, _ in rows} == set(terms[name]) and all(macs > 0 for _, _, macs in rows)
        assert method(name).wired and "qwen2_vl" in method(name).families
    # DivPrune's script default (SUBSET_RATIO 0.098) and its one term; VisPruner projects only the kept.
    default = acc.resolve_schedule(arch, "divprune", acc.CountOptions())
    assert plan_tokens(arch, default).llm_visual_tokens == 56
    assert dict((t, m) for _, t, m in acc.extra_macs(arch, default, plan_tokens(arch, default))) == terms["divprune"]
    vis = plan_tokens(arch, acc.resolve_schedule(arch, "vispruner", acc.CountOptions(), preset=64))
    full = plan_tokens(arch, acc.resolve_schedule(arch, "cdpruner", acc.CountOptions(), preset=64))
    assert vis.llm == full.llm
    assert acc.resolve_schedule(arch, "cdpruner", acc.CountOptions()).settings_dict()["relevance"].startswith("LLM")
    with pytest.raises(FicocoError, match="outside 1..576"):
        acc.resolve_schedule(arch, "divprune", acc.CountOptions(), preset=577)


# ---- in the tiny LLaVA ---------------------------------------------------------------------------------------------

TINY_PROFILE = "llava-tiny"  # built as this module's `model` (conftest.py)


def _inputs(model: nn.Module, batch: int = 1, seed: int = 0, text: int = TEXT) -> dict[str, Tensor]:
    return synthetic_inputs(model, batch=batch, text_tokens=text, seed=seed)


def _greedy(model: nn.Module, inp: dict[str, Tensor]) -> Tensor:
    return model.generate(**inp, max_new_tokens=NEW, do_sample=False, min_new_tokens=NEW)


@pytest.mark.parametrize("name", METHODS)
def test_full_keep_is_bitwise_vanilla(model: nn.Module, name: str) -> None:
    inp = _inputs(model, batch=2)
    with torch.no_grad():
        reference = model(**inp).logits
        with ficoco.apply(model, name, keep=PATCHES) as handle:
            logits = model(**inp).logits
    assert not handle.schedule.removals and torch.equal(logits, reference)


def _left_padded(model: nn.Module) -> tuple[dict[str, Tensor], list[dict[str, Tensor]]]:
    short, long = _inputs(model, seed=1), _inputs(model, seed=2, text=TEXT + 3)
    zeros = torch.zeros(1, long["input_ids"].shape[1] - short["input_ids"].shape[1], dtype=torch.long)
    batch = {"input_ids": torch.cat([torch.cat([zeros, short["input_ids"]], 1), long["input_ids"]]),
             "attention_mask": torch.cat([torch.cat([zeros, short["attention_mask"]], 1), long["attention_mask"]]),
             "pixel_values": torch.cat([short["pixel_values"], long["pixel_values"]])}
    return batch, [short, long]


@pytest.mark.parametrize("name", METHODS)
def test_batch_equals_samples_alone_and_generate_equals_a_hand_written_decode(model: nn.Module, name: str) -> None:
    batch, alone = _left_padded(model)
    with torch.no_grad(), ficoco.apply(model, name, keep=MODEL_KEEP) as handle:
        together = model(**batch).logits[:, -1]
        (record,) = handle.records
        for i, sample in enumerate(alone):
            torch.testing.assert_close(together[i:i + 1], model(**sample).logits[:, -1], atol=1e-4, rtol=0)
            assert torch.equal(handle.records[0].kept[0], record.kept[i])
        inp = _inputs(model, batch=2, seed=3)
        generated = _greedy(model, inp)
        out, positions, decoded, cache = prefill_and_decode(model, inp, NEW, handle)
    prompt = inp["input_ids"].shape[1]
    assert torch.equal(generated[:, :prompt], inp["input_ids"]) and torch.equal(generated[:, prompt:], decoded)
    assert handle.measured_tokens_per_item == MODEL_KEEP
    assert out.logits.shape[1] == prompt - PATCHES + MODEL_KEEP == cache.get_seq_length() - NEW + 1


def test_cdpruner_in_the_model_reads_the_suffix_embeddings_and_the_projected_patches(model: nn.Module) -> None:
    batch, _ = _left_padded(model)
    with torch.no_grad():
        features = model.model.get_image_features(batch["pixel_values"], vision_feature_layer=-2,
                                                  vision_feature_select_strategy="default", return_dict=True)
        projected = torch.stack(list(features.pooler_output))
        with ficoco.apply(model, "cdpruner", keep=MODEL_KEEP) as handle:
            model(**batch)
            (record,) = handle.records
        table = model.get_input_embeddings().weight.detach()
    for b in range(2):
        ids, mask = batch["input_ids"][b], batch["attention_mask"][b].bool()
        last = max(i for i in range(len(ids)) if int(ids[i]) == model.config.image_token_id)
        suffix = table[ids[last + 1:][mask[last + 1:]]]
        expected = _reference_cdpruner(projected[b].double().numpy(), suffix.double().numpy(), MODEL_KEEP)
        assert record.kept[b].tolist() == expected


@pytest.mark.parametrize("profile,name", [("video-llava-tiny", "cdpruner"), ("llava-next-tiny", "vispruner")])
def test_frames_and_crops_are_items_of_their_sample(profile: str, name: str) -> None:
    other = ficoco.build_model(profile, dtype="fp32")
    inp = synthetic_inputs(other, batch=2, text_tokens=TEXT)
    seen: list[int] = []
    layer = other.model.language_model.layers[0].self_attn
    with torch.no_grad(), ficoco.apply(other, name, keep=8) as handle:
        hook = layer.register_forward_pre_hook(lambda m, args, kwargs: seen.append(kwargs["hidden_states"].shape[1]),
                                               with_kwargs=True)
        try:
            other(**inp)
        finally:
            hook.remove()
        tokens = other.generate(**inp, max_new_tokens=2, do_sample=False)
        plan = plan_tokens(acc.architecture(profile_of(other)), handle.schedule, text_tokens=TEXT)
    assert handle.measured_tokens_per_item == 8 and seen == [plan.llm[0][0]]
    assert torch.equal(tokens[:, :inp["input_ids"].shape[1]], inp["input_ids"])


def test_qwen2_vl_cuts_whole_merge_groups_after_the_merger() -> None:
    """DivPrune and CDPruner on the PatchMerger's output (one LLM token per 2 x 2 group); VisPruner,
    which reads the tower's [CLS] attention, cuts whole groups before the merger, scored by the
    equivalent token (Qwen2-VL's tower has no [CLS])."""
    from ficoco.models.qwen2_vl import group_patches

    qwen = ficoco.build_model("qwen2-vl-tiny", dtype="fp32")
    batch = synthetic_inputs(qwen, batch=2, text_tokens=TEXT, seed=9)
    length, images = batch["input_ids"].shape[1], batch["image_grid_thw"]
    rows, cols = (int(v) for v in images[0, 1:])
    per_image = batch["pixel_values"].shape[0] // 2
    alone = [{k: v[i * per_image:(i + 1) * per_image] if k == "pixel_values" else v[i:i + 1]
              for k, v in batch.items()} for i in range(2)]
    with torch.no_grad():
        merged = qwen.model.get_image_features(batch["pixel_values"], image_grid_thw=images, return_dict=True)
        features = torch.stack(list(merged.pooler_output))  # (2, groups, D)
        for name in ("divprune", "cdpruner"):
            with ficoco.apply(qwen, name, keep=4) as handle:
                out = qwen(**batch)
                (record,) = handle.records
                together = qwen.generate(**batch, max_new_tokens=2, min_new_tokens=2, do_sample=False)
                singles = [qwen.generate(**a, max_new_tokens=2, min_new_tokens=2, do_sample=False) for a in alone]
            assert out.logits.shape[1] == length - features.shape[1] + 4
            assert torch.equal(together[:, :length], batch["input_ids"])
            assert torch.equal(together[:, length], out.logits[:, -1].argmax(-1))
            assert all(torch.equal(together[i:i + 1], singles[i]) for i in range(2))
            if name == "divprune":
                expected = [_reference_divprune(features[b].double().numpy(), 4) for b in range(2)]
                assert torch.equal(record.kept, group_patches(torch.tensor(expected), cols))
        with ficoco.apply(qwen, "vispruner", keep=4) as handle:
            out = qwen(**batch)
            (record,) = handle.records
            singles = [qwen(**a).logits for a in alone]
    assert out.logits.shape[1] == length - features.shape[1] + 4 and rows * cols == 4 * features.shape[1]
    assert record.kept.shape == (2, 4 * 4)  # 4 whole groups of 4 patches per image
    assert (record.kept.view(2, 4, 4) // cols // 2 == record.kept.view(2, 4, 4)[..., :1] // cols // 2).all()
    assert all(torch.allclose(out.logits[i:i + 1], singles[i], atol=1e-5) for i in range(2))


@pytest.mark.parametrize("name", METHODS)
def test_flops_verify_passes_with_the_methods_work_as_its_own_stage(model: nn.Module, name: str) -> None:
    """What `ficoco flops --model llava-tiny --variant NAME --keep 16 --verify` checks, in process."""
    from ficoco.accounting.methods import method_schedule
    from ficoco.profiling.verify import verify_run

    arch = acc.architecture(profile_of(model))
    run = verify_run(model, arch, method_schedule(arch, name, MODEL_KEEP), text_tokens=TEXT)
    stages = {s.stage: s for s in run.stages}
    assert stages["method"].analytic > 0 and stages["method"].fvcore == stages["method"].analytic
    assert run.passed(0.5) and not run.skipped_matrix_ops
