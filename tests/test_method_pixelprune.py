"""PixelPrune (`--variant pixelprune`) in the models, the accountant and the CLI: every layer runs the tokens the
accountant plans at the count a run measured, samples of different counts batch as they run alone (left-padded),
generate equals a hand-written decode at the unreduced prompt's next positions, random pixels keep every group
and run bitwise vanilla, the refusals are one line, `ficoco flops` plans the worst case and refuses budgets,
`--verify` counts the smaller tower, and `ficoco profile`, `sweep` and `show` run it. Every Qwen family once.

The images repeat merge groups exactly (`blocks`), so that the rule (tests/test_rule_pixelprune.py) drops some.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import assert_one_error_line, qwen_patches
from torch import Tensor, nn

import ficoco
from ficoco.accounting import architecture
from ficoco.accounting.methods import at_measured_count, method_schedule
from ficoco.accounting.schedule import plan_tokens
from ficoco.api import profile_of
from ficoco.errors import FicocoError
from ficoco.methods.pixelprune import ops
from ficoco.models import adapter_for, synthetic_inputs
from ficoco.models.hf_compat import cache_argument, output_cache
from ficoco.profiles import load_profile

TINY_PROFILE = "qwen3-vl-tiny"  # 8 x 10 merge groups
TEXT = 12


def picture(rows: int, cols: int, seed: int, band: int, group: int = 32) -> Tensor:
    """(H, W, 3): rows x cols merge groups of `group` pixels, random but for the first `band` rows of groups, which
    repeat one texture (dropped but the first), and a flat bottom-left corner."""
    generator = torch.Generator().manual_seed(seed)
    image = torch.rand(rows * group, cols * group, 3, generator=generator)
    image[:band * group] = image[:group, :group].repeat(band, cols, 1)
    image[-2 * group:, :3 * group] = 0.75
    return image


def inputs(model: nn.Module, seed: int = 0, band: int = 2, text: int = TEXT) -> dict[str, Tensor]:
    """One prompt of one `picture` at the profile's grid, laid out as the family's processor lays it out."""
    out = synthetic_inputs(model, batch=1, text_tokens=text, seed=seed)
    _, rows, cols = (int(v) for v in out["image_grid_thw"][0])
    adapter = adapter_for(model)
    vision = model.config.vision_config
    out["pixel_values"] = qwen_patches(picture(rows // 2, cols // 2, seed, band, 2 * vision.patch_size), vision,
                                       adapter.pixel_mean, adapter.pixel_std)
    return out


def expected_groups(model: nn.Module, inp: dict[str, Tensor]) -> list[int]:
    """The groups the rule keeps, from ficoco's own ops on the adapter's units (the rule itself: test_rule_)."""
    _, rows, cols = (int(v) for v in inp["image_grid_thw"][0])
    units = adapter_for(model).group_pixels(inp["pixel_values"])
    keep = ops.keep_map(units.view(1, rows // 2, cols // 2, -1))
    return keep.flatten().nonzero()[:, 0].tolist()


def left_padded(sample: dict[str, Tensor], pad: int) -> dict[str, Tensor]:
    """`sample` with `pad` padding tokens before its prompt (mask 0)."""
    out = dict(sample)
    for key in ("input_ids", "attention_mask", "mm_token_type_ids"):
        out[key] = torch.cat([torch.zeros_like(sample[key][:, :1]).expand(-1, pad), sample[key]], dim=1)
    return out


def batched(samples: list[dict[str, Tensor]]) -> dict[str, Tensor]:
    return {k: torch.cat([s[k] for s in samples]) for k in samples[0]}


# ---- the plan, measured ------------------------------------------------------------------------------------------

def test_every_layer_runs_the_tokens_the_accountant_plans_at_the_measured_count(model: nn.Module) -> None:
    inp = inputs(model)
    arch = architecture(profile_of(model))
    seen: dict[str, list[int]] = {"vision": [], "llm": []}
    # Every block's attention: the first block's own input holds every patch until its forward cuts it.
    hooks = [block.attn.register_forward_pre_hook(lambda m, a, k: seen["vision"].append((a[0] if a else
                                                                                         k["hidden_states"]).shape[0]),
                                                  with_kwargs=True) for block in model.model.visual.blocks]
    hooks += [layer.register_forward_pre_hook(lambda m, a, k: seen["llm"].append((a[0] if a else
                                                                                 k["hidden_states"]).shape[1]),
                                              with_kwargs=True) for layer in model.model.language_model.layers]
    try:
        with torch.no_grad(), ficoco.apply(model, "pixelprune") as handle:
            model(**inp)
    finally:
        for hook in hooks:
            hook.remove()
    kept = len(expected_groups(model, inp))
    assert handle.measured_tokens_per_item == kept < arch.vision.units
    # Planned: the content-free worst case, every group kept; at the measured count: the run's own.
    assert plan_tokens(arch, handle.schedule, text_tokens=TEXT).llm_visual_tokens == arch.vision.units
    plan = plan_tokens(arch, at_measured_count(arch, handle.schedule, kept), text_tokens=TEXT)
    assert seen["vision"] == [n_in for n_in, _ in plan.vision] == [4 * kept] * len(plan.vision)
    assert seen["llm"] == [n_in for n_in, _ in plan.llm] == [TEXT + kept] * len(plan.llm)


def test_random_pixels_keep_every_group_and_run_bitwise_vanilla(model: nn.Module) -> None:
    inp = synthetic_inputs(model, batch=2, text_tokens=TEXT)
    with torch.no_grad():
        reference = model(**inp).logits
        with ficoco.apply(model, "pixelprune") as handle:
            logits = model(**inp).logits
    assert torch.equal(logits, reference)
    assert handle.measured_tokens_per_item == 80 and bool((handle.records[0].discarded == -1).all())


# ---- batches, generate ---------------------------------------------------------------------------------------

def test_samples_of_different_counts_batch_as_they_run_alone(model: nn.Module) -> None:
    """Two images of different counts, the second prompt one text token shorter and left-padded: each sample's
    logits, kept groups and generated tokens as alone; the shorter shortened prompt is left-padded (position -1)."""
    a, b = inputs(model, seed=1, band=1), left_padded(inputs(model, seed=2, band=4, text=TEXT - 1), 1)
    counts = [len(expected_groups(model, s)) for s in (a, b)]
    assert counts[0] > counts[1]
    batch = batched([a, b])
    with torch.no_grad(), ficoco.apply(model, "pixelprune") as handle:
        together = model(**batch).logits[:, -1]
        kept, positions = handle.records[0].kept, handle.output_positions
        assert handle.measured_tokens_per_item is None  # the images differ: no one count
        generated = model.generate(**batch, max_new_tokens=3, do_sample=False)
        for i, sample in enumerate((a, b)):
            alone = model(**sample).logits[:, -1]
            torch.testing.assert_close(together[i:i + 1], alone, atol=1e-5, rtol=0)
            assert kept[i][kept[i] >= 0].tolist() == handle.records[0].kept[0].tolist()
            assert torch.equal(generated[i], model.generate(**sample, max_new_tokens=3, do_sample=False)[0])
    assert positions.shape[1] == TEXT + counts[0]
    pads = TEXT + counts[0] - (TEXT + counts[1])
    assert (positions[1, :pads] == -1).all() and (positions[1, pads:] >= 0).all()
    assert torch.equal(generated[:, :batch["input_ids"].shape[1]], batch["input_ids"])


def test_generate_equals_a_hand_written_decode_at_the_unreduced_next_positions(model: nn.Module) -> None:
    """transformers' Qwen3-VL takes a decode step's 3-D positions from `position_ids` (its own fallback reads a 2-D
    mask as the whole sequence's), so the loop gives each sample its unreduced prompt's next position, and the
    attention mask grown from the caller's prompt (the entry lines it up with the cache)."""
    batch = batched([inputs(model, seed=3, band=1), left_padded(inputs(model, seed=4, band=3, text=TEXT - 2), 2)])
    ids, mask = batch["input_ids"], batch["attention_mask"]
    last = model.model.get_rope_index(ids, batch["mm_token_type_ids"], image_grid_thw=batch["image_grid_thw"],
                                      attention_mask=mask)[0].amax(dim=(0, 2))
    with torch.no_grad(), ficoco.apply(model, "pixelprune"):
        generated = model.generate(**batch, max_new_tokens=3, do_sample=False)[:, ids.shape[1]:]
        out = model(**batch, use_cache=True)
        tokens, cache = [out.logits[:, -1].argmax(-1)], output_cache(out)
        for k in range(2):
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            step = model(input_ids=tokens[-1][:, None], attention_mask=mask, **cache_argument(cache),
                         position_ids=(last + 1 + k).view(1, -1, 1).expand(3, -1, 1), use_cache=True)
            cache = output_cache(step)
            tokens.append(step.logits[:, -1].argmax(-1))
    assert torch.equal(generated, torch.stack(tokens, dim=1))


# ---- refusals ------------------------------------------------------------------------------------------------

def test_refusals_are_one_line(model: nn.Module, arch_of) -> None:
    from ficoco.accounting import CountOptions, resolve_schedule

    for name in ("llava-tiny", "llava-next-tiny", "video-llava-tiny", "llava-onevision-tiny", "internvl3-tiny"):
        with pytest.raises(FicocoError, match="fixed-grid encoder") as caught:
            resolve_schedule(arch_of(name), "pixelprune", CountOptions())
        assert "\n" not in str(caught.value)
    for option in ({"keep": 8}, {"preset": 64}, {"tflops": 1.0}, {"schedule": {0: 4}}):
        with pytest.raises(FicocoError, match="PixelPrune has no token budget") as caught:
            ficoco.apply(model, "pixelprune", **option)
        assert "\n" not in str(caught.value)
    with pytest.raises(FicocoError, match="threshold=-0.1: give a number >= 0"):
        ficoco.apply(model, "pixelprune", threshold=-0.1)
    inp = inputs(model)
    with torch.no_grad(), ficoco.apply(model, "pixelprune"):
        out = model(**inp, use_cache=True)
        later = torch.cat([inp["input_ids"], inp["input_ids"][:, -3:]], dim=1)
        with pytest.raises(FicocoError, match="kept its own count") as caught:
            model.generate(input_ids=later, **cache_argument(output_cache(out)), max_new_tokens=1)
    assert "\n" not in str(caught.value)


def test_a_video_is_refused_in_one_line() -> None:
    model = ficoco.build_model("qwen2-vl-tiny", dtype="fp32")
    video = synthetic_inputs(model, batch=1, text_tokens=TEXT, frames=2)
    with torch.no_grad(), ficoco.apply(model, "pixelprune"), pytest.raises(FicocoError, match="reduces images"):
        model(**video)


# ---- the accountant and the CLI ---------------------------------------------------------------------------------

def test_flops_plans_the_worst_case_and_refuses_budgets(flops_report, cli) -> None:
    rows = {r["variant"]: r for r in flops_report("--model", "qwen3-vl-8b", "--variant", "vanilla,pixelprune")["rows"]}
    assert rows["pixelprune"]["visual_tokens"] == rows["vanilla"]["visual_tokens"]
    assert rows["pixelprune"]["tflops"] == rows["vanilla"]["tflops"] and rows["pixelprune"]["settings"]["adaptive"]
    for option in (("--preset", "128"), ("--keep", "64"), ("--tflops", "3")):
        line = assert_one_error_line(cli("flops", "--model", "qwen3-vl-8b", "--variant", "pixelprune", *option))
        assert "PixelPrune has no token budget" in line


def test_verify_counts_the_tower_on_the_kept_groups(model: nn.Module) -> None:
    """`ficoco flops --verify`'s run (its synthetic random pixels keep every group, as planned) on an image of
    repeated groups: fvcore and torch's counter count the tower, DeepStack's mergers, the merger and the LLM on
    the kept groups, the accountant at the measured count."""
    from ficoco.profiling.verify import verify_run

    arch = architecture(load_profile(TINY_PROFILE))
    run = verify_run(model, arch, method_schedule(arch, "pixelprune"), text_tokens=TEXT, inputs=inputs(model))
    assert run.plan.llm_visual_tokens == len(expected_groups(model, inputs(model))) < arch.vision.units
    assert run.passed(0.5), [s for s in run.stages if not s.within(0.5)]
    method = next(s for s in run.stages if s.stage == "method")
    assert method.analytic == method.fvcore == method.torch == 0  # comparisons only: no matrix work


def test_profile_sweep_and_show_run_it(cli, tmp_path: Path) -> None:
    from PIL import Image

    path = tmp_path / "r.json"
    result = cli("profile", "--model", TINY_PROFILE, "--variant", "pixelprune", "--no-reference", "--warmup", "0",
                 "--repeat", "1", "--text-tokens", str(TEXT), "--dtype", "fp32", "--json", path)
    assert result.code == 0, result.err[-2000:]
    row = json.loads(path.read_text())["rows"][0]
    assert row["status"] == "ok" and row["visual_tokens_per_item_measured"] == 80
    assert "adaptive count: measured 80" in row["note"]
    result = cli("sweep", "--model", TINY_PROFILE, "--variant", "v,pixelprune", "--keep", "16")
    assert result.code == 0, result.err
    assert "skipped pixelprune" in " ".join(result.out.split()) and "no token budget" in " ".join(result.out.split())
    picture_path = tmp_path / "flat.png"
    array = (picture(8, 10, 5, 3) * 255).to(torch.uint8).numpy()
    Image.fromarray(array).save(picture_path)
    shown = tmp_path / "show.json"
    result = cli("show", "--model", TINY_PROFILE, "--variant", "pixelprune", "--image", picture_path, "--out",
                 tmp_path / "show.png", "--json", shown, "--dtype", "fp32")
    assert result.code == 0, result.err
    steps = json.loads(shown.read_text())["steps"]
    assert [(s["stage"], s["layer"]) for s in steps] == [("vision", 0)] and 4 <= len(steps[0]["kept"]) < 320


def test_profile_runs_it_on_a_picture_with_random_weights_as_show_lays_it_out(cli, tmp_path: Path) -> None:
    """`ficoco profile --image` on a Qwen family with random weights: the picture laid out as `ficoco show` lays it
    out (no processor), so PixelPrune's count is the picture's; one image only, refused in one line otherwise."""
    from PIL import Image

    picture_path = tmp_path / "flat.png"
    Image.fromarray((picture(8, 10, 5, 3) * 255).to(torch.uint8).numpy()).save(picture_path)
    path = tmp_path / "r.json"
    result = cli("profile", "--model", TINY_PROFILE, "--variant", "vanilla,pixelprune", "--image", picture_path,
                 "--warmup", "0", "--repeat", "1", "--text-tokens", str(TEXT), "--dtype", "fp32", "--json", path)
    assert result.code == 0, result.err[-2000:]
    rows = {row["variant"]: row for row in json.loads(path.read_text())["rows"]}
    assert rows["vanilla"]["status"] == rows["pixelprune"]["status"] == "ok"
    assert 4 <= rows["pixelprune"]["visual_tokens_per_item_measured"] < 80
    assert rows["pixelprune"]["analytic"]["tflops"] < rows["vanilla"]["analytic"]["tflops"]
    result = cli("profile", "--model", TINY_PROFILE, "--variant", "pixelprune", "--image", picture_path, "--batch",
                 "1,2")
    assert result.code == 2 and "lays out one image" in result.err and len(result.err.strip().splitlines()) == 1


# ---- every Qwen family ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["qwen2-vl-tiny", "qwen2.5-vl-tiny", "qwen3-vl-moe-tiny", "qwen3.5-tiny"])
def test_every_qwen_family_runs_it_on_the_kept_groups(name: str) -> None:
    model = ficoco.build_model(name, dtype="fp32")
    inp = inputs(model, band=2)
    kept = expected_groups(model, inp)
    _, rows, cols = (int(v) for v in inp["image_grid_thw"][0])
    assert 1 <= len(kept) < rows * cols // 4
    with torch.no_grad(), ficoco.apply(model, "pixelprune") as handle:
        logits = model(**inp).logits
        groups = sorted({(p // cols // 2) * (cols // 2) + p % cols // 2 for p in handle.records[0].kept[0].tolist()})
        generated = model.generate(**inp, max_new_tokens=2, do_sample=False)
    assert groups == kept and logits.shape[1] == TEXT + len(kept)
    assert generated.shape[1] == inp["input_ids"].shape[1] + 2
    if name == "qwen2.5-vl-tiny":  # the windows the kept groups form, as the tower ran them
        assert handle.vision_attention_pairs and sum(handle.vision_attention_pairs.values()) > 0

