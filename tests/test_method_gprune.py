"""G-Prune (`--variant gprune`) as ficoco runs it: the accountant's plans and cost terms, every family's run
against the plan, the batch and decoding contracts, the whole-grid cut of an AnyRes image, the original position
ids across a conversation on its cache, the refusals, `flops --verify`, and the CLI's profile, sweep and show.
The official rule itself is tests/test_rule_gprune.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import assert_batch_equals_samples_alone, prefill_and_decode
from torch import Tensor, nn

import ficoco
from ficoco import accounting as acc
from ficoco.accounting.schedule import plan_tokens
from ficoco.api import profile_of
from ficoco.errors import FicocoError
from ficoco.methods.gprune import power_products
from ficoco.models import hf_compat as hf
from ficoco.models import synthetic_inputs
from ficoco.models.hf_compat import cache_argument, output_cache

TEXT, NEW, KEEP = 12, 3, 4
SQUARE, WIDE = (112, 112), (56, 112)  # the tiny LLaVA-NeXT's 2 x 2 and 1 x 2 crop grids, no unpadding
FAMILIES = ("llava-tiny", "llava-next-tiny", "video-llava-tiny", "llava-onevision-tiny", "internvl3-tiny",
            "qwen2-vl-tiny", "qwen2.5-vl-tiny", "qwen3-vl-tiny", "qwen3-vl-moe-tiny", "qwen3.5-tiny")


@pytest.fixture(scope="module")
def models() -> Any:
    built: dict[str, nn.Module] = {}

    def get(name: str) -> nn.Module:
        if name not in built:
            built[name] = ficoco.build_model(name, dtype="fp32")
        return built[name]

    return get


def _inputs(model: nn.Module, batch: int = 1, seed: int = 0, text: int = TEXT, **options: Any) -> dict[str, Tensor]:
    return synthetic_inputs(model, batch=batch, text_tokens=text, seed=seed, **options)


def _greedy(model: nn.Module, inp: dict[str, Tensor], **options: Any) -> Any:
    return model.generate(**inp, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, **options)


# ---- the accountant --------------------------------------------------------------------------------------------

def test_matrix_power_products_are_the_ones_torch_runs() -> None:
    """`extra_macs` counts torch.matrix_power's products (ATen's binary decomposition), read off torch's own
    counter: 3 for the official 5 (A^2, A^4, A @ A^4)."""
    from torch.utils.flop_counter import FlopCounterMode

    a = torch.rand(8, 8)
    for n in range(9):
        with FlopCounterMode(display=False) as counter:
            torch.matrix_power(a, n)
        assert counter.get_total_flops() == power_products(n) * 2 * 8**3, n
    assert power_products(5) == 3


def test_presets_default_and_budgets_plan_and_each_parts_graph_is_counted(arch_of: Any) -> None:
    arch = arch_of("llava-1.5-7b")
    d = arch.decoder.hidden

    def terms(schedule: Any) -> dict[str, int]:
        return {term: macs for _, term, macs in acc.extra_macs(arch_, schedule, plan_tokens(arch_, schedule))}

    def graph(n: int) -> dict[str, int]:
        return {"gprune_projected_similarity": n * n * d, "gprune_graph_propagation": 3 * n**3,
                "gprune_flow_scores": n * n}

    arch_ = arch
    for keep in (192, 128, 64):
        schedule = acc.resolve_schedule(arch, "gprune", acc.CountOptions(), preset=keep)
        assert plan_tokens(arch, schedule).llm_visual_tokens == keep and terms(schedule) == graph(576)
    default = acc.resolve_schedule(arch, "gprune", acc.CountOptions())
    assert plan_tokens(arch, default).llm_visual_tokens == 288  # int(0.5 * 576), llava_arch.py:281
    # LLaVA-NeXT's image: the base view and the whole 2 x 2 crop grid are two graphs (576 and 2304 tokens).
    arch_ = arch_of("llava-next-7b")
    schedule = acc.resolve_schedule(arch_, "gprune", acc.CountOptions())
    assert plan_tokens(arch_, schedule).llm_visual_tokens == 5 * 288 + arch_.newline_tokens
    base, grid = graph(576), graph(2304)
    assert terms(schedule) == {term: base[term] + grid[term] for term in base}
    # A budget plans, the keep it picks within it; one below the cheapest setting is one line.
    arch_ = arch
    cost = acc.compute_tera(arch, acc.resolve_schedule(arch, "gprune", acc.CountOptions(), keep=100),
                            acc.CountOptions())
    fitted = acc.resolve_schedule(arch, "gprune", acc.CountOptions(), tflops=cost)
    assert plan_tokens(arch, fitted).llm_visual_tokens >= 100
    for request in ({"tflops": 1e-3}, {"keep": 577}):
        with pytest.raises(FicocoError) as info:
            acc.resolve_schedule(arch, "gprune", acc.CountOptions(), **request)
        assert "\n" not in str(info.value)


# ---- every family ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", FAMILIES)
def test_every_family_hands_the_decoder_the_planned_tokens(models: Any, name: str) -> None:
    model = models(name)
    inp = _inputs(model, batch=2)
    seen: list[int] = []
    layer = hf.decoder_layers(model)[0]
    hook = layer.register_forward_pre_hook(
        lambda m, args, kwargs: seen.append((args[0] if args else kwargs["hidden_states"]).shape[1]), with_kwargs=True)
    try:
        with torch.no_grad(), ficoco.apply(model, "gprune", keep=KEEP) as handle:
            model(**inp)
            records = handle.records
            arch = acc.architecture(profile_of(model))
            plan = plan_tokens(arch, handle.schedule, text_tokens=TEXT)
    finally:
        hook.remove()
    assert seen == [plan.llm[0][0]] and plan.llm_visual_tokens < arch.visual_tokens
    assert records and all(record.stage == "vision" for record in records)


def test_qwen_kept_groups_keep_the_unreduced_prompts_3d_positions(models: Any) -> None:
    """Qwen's multimodal RoPE: the kept tokens run at the 3-D position ids the unreduced prompt gives them (the
    official original ids, in three dimensions)."""
    model = models("qwen2-vl-tiny")
    inp = _inputs(model, batch=1, seed=3)
    seen: list[Tensor] = []
    hook = hf.language_model(model).register_forward_pre_hook(
        lambda m, args, kwargs: seen.append(kwargs["position_ids"]), with_kwargs=True)
    try:
        with torch.no_grad():
            model(**inp)
            with ficoco.apply(model, "gprune", keep=KEEP) as handle:
                model(**inp)
                kept = handle.output_positions
    finally:
        hook.remove()
    full, short = seen
    index = kept.unsqueeze(0).expand(full.shape[0], -1, -1)
    assert torch.equal(short[-3:], torch.gather(full[-3:], 2, index))


# ---- batches and decoding on the 1-D families ------------------------------------------------------------------

def _left_padded(model: nn.Module) -> tuple[dict[str, Tensor], list[dict[str, Tensor]]]:
    short, long = _inputs(model, seed=1), _inputs(model, seed=2, text=TEXT + 3)
    zeros = torch.zeros(1, long["input_ids"].shape[1] - short["input_ids"].shape[1], dtype=torch.long)
    batch = {key: torch.cat([torch.cat([zeros, short[key]], 1), long[key]]) for key in ("input_ids", "attention_mask")}
    for key in ("pixel_values", "image_sizes"):
        if key in short:
            batch[key] = torch.cat([short[key], long[key]])
    return batch, [short, long]


@pytest.mark.parametrize("name", ["llava-tiny", "llava-next-tiny"])
def test_batch_equals_samples_alone_generate_equals_a_hand_written_decode_and_full_keep_is_vanilla(
        models: Any, name: str) -> None:
    model = models(name)
    batch, alone = _left_padded(model)
    items = 5 if name == "llava-next-tiny" else None  # a record row per item: the base view, then 4 crops
    inp = _inputs(model, batch=2, seed=3)
    prompt = inp["input_ids"].shape[1]
    with torch.no_grad():
        reference = model(**inp).logits
        with ficoco.apply(model, "gprune", keep=KEEP) as handle:
            assert_batch_equals_samples_alone(model, handle, batch, alone, items_per_sample=items)
            generated = _greedy(model, inp)
            out, positions, decoded, cache = prefill_and_decode(model, inp, NEW, handle)
        with ficoco.apply(model, "gprune", keep=16 if items else 64) as handle:
            full = model(**inp).logits
    assert torch.equal(generated[:, :prompt], inp["input_ids"]) and torch.equal(generated[:, prompt:], decoded)
    assert cache.get_seq_length() == out.logits.shape[1] + NEW - 1 and torch.equal(positions[:, -1], torch.full(
        (2,), prompt - 1))
    assert not handle.schedule.removals and torch.equal(full, reference)


def test_next_cuts_each_grid_whole_and_two_grids_in_one_prompt_as_if_alone(models: Any) -> None:
    """Two images of different crop grids (2 x 2, 1 x 2) in every prompt: each grid is one part (its crops keep
    uneven shares of 4 x crops), and each image's span holds what it holds as the prompt's only image."""
    model = models("llava-next-tiny")
    single = [_inputs(model, batch=1, seed=6, image_size=SQUARE), _inputs(model, batch=1, seed=7, image_size=WIDE)]
    spans = [int((s["input_ids"] == model.config.image_token_id).sum()) for s in single]
    # The first image's prompt up to its span's end, then the second's from two text tokens before its span.
    ids = torch.cat([single[0]["input_ids"][:, :5 + spans[0]], single[1]["input_ids"][:, 3:]], dim=1)
    pixels = torch.cat([single[1]["pixel_values"], torch.zeros_like(single[1]["pixel_values"][:, :2])], dim=1)
    inp = {"input_ids": ids, "attention_mask": torch.ones_like(ids),
           "pixel_values": torch.cat([single[0]["pixel_values"], pixels]),
           "image_sizes": torch.cat([single[0]["image_sizes"], single[1]["image_sizes"]])}
    with torch.no_grad(), ficoco.apply(model, "gprune", keep=KEEP) as handle:
        model(**inp)
        (together,) = handle.records
        alone = []
        for sample in single:
            model(**sample)
            alone.append(handle.records[0].kept)
    assert torch.equal(together.kept, torch.cat(alone))
    counts = (together.kept[1:5] >= 0).sum(dim=1)
    assert int(counts.sum()) == 4 * KEEP and int((together.kept[6:] >= 0).sum()) == 2 * KEEP


def test_a_new_image_and_a_text_turn_on_the_cache_equal_the_whole_conversation(models: Any) -> None:
    """The original position ids continue across turns: a later turn on the cache (generate, or a forward) runs
    where the one prompt of the whole conversation runs it."""
    model = models("llava-next-tiny")
    options = {"return_dict_in_generate": True}
    first = _inputs(model, batch=2, seed=10)
    with torch.no_grad(), ficoco.apply(model, "gprune", keep=KEEP):
        turn1 = _greedy(model, first, **options)
        new = _inputs(model, batch=2, seed=12, image_size=WIDE)
        ids = torch.cat([turn1.sequences, new["input_ids"][:, 1:]], dim=1)
        turn = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "pixel_values": new["pixel_values"],
                "image_sizes": new["image_sizes"]}
        later = _greedy(model, turn, **cache_argument(output_cache(turn1)), **options)
        pixels = []
        for b in range(2):
            pixels += [first["pixel_values"][b], torch.cat([new["pixel_values"][b],
                                                            torch.zeros_like(new["pixel_values"][b][:2])])]
        whole = {**turn, "pixel_values": torch.stack(pixels),
                 "image_sizes": torch.stack([first["image_sizes"], new["image_sizes"]], dim=1).flatten(0, 1)}
        one = _greedy(model, whole, **options)
        length = ids.shape[1]
        assert torch.equal(later.sequences[:, length:], one.sequences[:, length:])
        # A forward of what follows the first turn's cache gives the one prompt's logits there.
        turn1 = _greedy(model, first, **options)
        logits = model(**whole).logits
        after = length - (turn1.sequences.shape[1] - 1)
        out = model(input_ids=ids[:, -after:], pixel_values=new["pixel_values"], image_sizes=new["image_sizes"],
                    **cache_argument(output_cache(turn1)), use_cache=True)
        torch.testing.assert_close(out.logits, logits[:, -out.logits.shape[1]:], atol=1e-5, rtol=1e-5)
        # A text turn on the first turn's cache (a fresh one: the forward above went on on the other).
        turn1 = _greedy(model, first, **options)
        question = _inputs(model, seed=11)["input_ids"][:, -4:].expand(2, -1)
        ids = torch.cat([turn1.sequences, question], dim=1)
        text = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        on_cache = _greedy(model, text, **cache_argument(output_cache(turn1)), **options)
        one = _greedy(model, {**text, "pixel_values": first["pixel_values"], "image_sizes": first["image_sizes"]},
                      **options)
    assert torch.equal(on_cache.sequences, one.sequences)


# ---- refusals ----------------------------------------------------------------------------------------------------

def test_refusals_are_one_line(models: Any) -> None:
    model = models("llava-next-tiny")
    size = (60, 100)  # its AnyRes unpadding drops crop tokens: refused, as for every cut before the LLM
    with ficoco.apply(model, "gprune", keep=KEEP), pytest.raises(FicocoError, match="unpadding") as info:
        model(**_inputs(model, seed=14, image_size=size))
    assert "\n" not in str(info.value) and "G-Prune" in str(info.value)
    for options in ({"keep": KEEP, "image_size": size}, {"keep": 17}):
        with pytest.raises(FicocoError) as info:
            ficoco.apply(model, "gprune", **options)
        assert "\n" not in str(info.value)
    assert "_ficoco_handle" not in model.__dict__


# ---- flops --verify and the CLI ----------------------------------------------------------------------------------

def test_flops_verify_passes_with_each_graph_as_the_methods_own_stage(flops_verify: Any) -> None:
    """`ficoco flops --verify --model llava-next-tiny --variant gprune --keep 4 --image-size 112x56`: the base
    view (16 tokens) and the whole 1 x 2 crop grid (32) are two graphs of width 64, counted as fvcore counts them."""
    run = flops_verify("--model", "llava-next-tiny", "--variant", "gprune", "--keep", str(KEEP),
                       "--image-size", f"{WIDE[1]}x{WIDE[0]}")["runs"][0]
    stages = {s["stage"]: s for s in run["stages"]}
    assert all(s["within_tolerance"] for s in stages.values()) and run["visual_tokens"] == 3 * KEEP + 4
    assert stages["method"]["analytic_flops"] == 2 * sum(n * n * 64 + 3 * n**3 + n * n for n in (16, 32))


def test_profile_sweep_and_show_run_the_method(cli: Any, tmp_path: Path) -> None:
    report = tmp_path / "profile.json"
    result = cli("profile", "--model", "llava-tiny", "--variant", "gprune", "--keep", "16", "--repeat", "1",
                 "--warmup", "0", "--device", "cpu", "--dtype", "fp32", "--no-reference", "--json", report)
    assert result.code == 0, result.err[-2000:]
    (row,) = json.loads(report.read_text())["rows"]
    assert row["status"] == "ok" and row["method_label"] == "G-Prune" and row["analytic"]["visual_tokens"] == 16
    assert row["visual_tokens_per_item_measured"] == 16 and row["analytic"]["method_tflops"] > 0
    result = cli("sweep", "--model", "llava-tiny", "--variant", "gprune", "--keep", "32,16")
    assert result.code == 0 and result.out.count("gprune") >= 2, result.err
    picture = tmp_path / "tokens.png"
    result = cli("show", "--model", "llava-next-tiny", "--variant", "gprune", "--keep", "4", "--out", picture,
                 "--json", tmp_path / "tokens.json", "--dtype", "fp32")
    assert result.code == 0 and picture.stat().st_size > 0, result.err
    (step,) = json.loads((tmp_path / "tokens.json").read_text())["steps"]
    assert len(step["kept"]) == 5 * KEEP  # the base view's 4 and the grid's 16, each a cell of its panel
