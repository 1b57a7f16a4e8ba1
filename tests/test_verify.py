"""`ficoco flops --verify`: the analytic FLOPs against fvcore and torch's counter (issue 5).

Random seeded tiny LLaVA-1.5 models in fp32 on CPU: llava-tiny (4 KV heads of 4) and
llava-gqa-tiny (2 KV heads of 4, grouped-query attention). Every variant runs under three
schedules: --keep 8 (uniform from the profile's first reducing layer), an explicit one-shot
schedule and an explicit multi-layer one.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from helpers import assert_one_error_line
from torch import nn

import ficoco
import ficoco.profiling.verify as verify_module
from ficoco.accounting import Architecture, architecture
from ficoco.accounting.schedule import Schedule, make_schedule, schedule_for_keep
from ficoco.errors import FicocoError
from ficoco.models import FAMILIES
from ficoco.profiles import load_profile
from ficoco.profiling.verify import Prefill, RunCheck, sdpa_flop_jit, verify_run

TOLERANCE_PERCENT = 0.1
TEXT = 12  # the tiny profiles' text tokens
TINY = ("llava-tiny", "llava-gqa-tiny")


def schedules(arch: Architecture) -> dict[str, Schedule]:
    """Vanilla, and three schedules per variant: keep 8, one-shot, several layers (64 visual tokens)."""
    return {
        "vanilla": Schedule("vanilla"),
        "v-keep8": schedule_for_keep(arch, "v", 8),
        "v-oneshot": make_schedule(arch, "v", {arch.first_reducing_layer("v"): 40}),
        "v-multi": make_schedule(arch, "v", {0: 6, 3: 20, 4: 10}),
        "l-keep8": schedule_for_keep(arch, "l", 8),
        "l-oneshot": make_schedule(arch, "l", {2: 50}),
        "l-multi": make_schedule(arch, "l", {1: 10, 2: 5, 3: 30}),
    }


CASES = ("vanilla", "v-keep8", "v-oneshot", "v-multi", "l-keep8", "l-oneshot", "l-multi")


@pytest.fixture(scope="module", params=TINY)
def tiny(request: pytest.FixtureRequest) -> tuple[Architecture, nn.Module]:
    profile = load_profile(request.param)
    return architecture(profile), ficoco.build_model(profile, dtype="fp32")


@pytest.fixture(scope="module")
def runs(tiny: tuple[Architecture, nn.Module]) -> dict[str, RunCheck]:
    arch, model = tiny
    return {case: verify_run(model, arch, schedule, text_tokens=TEXT) for case, schedule in schedules(arch).items()}


def within(measured: int, analytic: int) -> bool:
    return abs(measured - analytic) <= analytic * TOLERANCE_PERCENT / 100


# ---- every stage of every run --------------------------------------------------------------------------------

@pytest.mark.parametrize("case", CASES)
def test_every_stage_matches_fvcore_and_torch_within_0_1_percent(runs: dict[str, RunCheck], case: str):
    run = runs[case]
    # FiCoCo-V and -L read their layers' attention beside the kernel: their reads are a stage of their own.
    reads = ["probe"] if case != "vanilla" else []
    assert [s.stage for s in run.stages] == ["vision", "projector", "llm", "lm_head", *reads]
    for stage in [*run.stages, run.total]:
        assert stage.analytic > 0
        assert within(stage.fvcore, stage.analytic), (case, stage)
        assert within(stage.torch, stage.analytic), (case, stage)
    assert run.passed(TOLERANCE_PERCENT)


@pytest.mark.parametrize("case", CASES)
def test_every_layer_matches_both_counters(runs: dict[str, RunCheck], case: str):
    for layer in runs[case].layers:
        assert within(layer.fvcore, layer.analytic), (case, layer)
        assert within(layer.torch, layer.analytic), (case, layer)


def test_schedules_really_reduce(runs: dict[str, RunCheck], tiny: tuple[Architecture, nn.Module]):
    arch, _ = tiny
    assert runs["v-keep8"].plan.llm_visual_tokens == 8
    assert runs["l-keep8"].plan.visual_tokens == 8
    assert len({tuple(r.schedule.removals) for r in runs.values()}) == len(CASES)
    vanilla = runs["vanilla"].total.analytic
    assert all(runs[c].total.analytic < vanilla for c in CASES if c != "vanilla")


def test_fvcore_skips_no_matrix_work_and_sees_every_module(runs: dict[str, RunCheck]):
    for case, run in runs.items():
        assert run.skipped_matrix_ops == [], case
        assert run.uncalled_modules == [], case
        # What it skips is listed: LLaVA's norms and activations at least.
        assert {"aten::layer_norm", "aten::add"} <= set(run.skipped_ops), case


def test_the_vision_towers_last_layer_is_counted_because_it_runs(runs: dict[str, RunCheck],
                                                                 tiny: tuple[Architecture, nn.Module]):
    arch, _ = tiny
    # LLaVA reads hidden_states[-2] but runs the whole tower; torch.jit drops the unused layer
    # from its graph unless its output is kept.
    assert arch.vision.feature_layer == arch.vision.layers - 2
    last = next(layer for layer in runs["vanilla"].layers if layer.stage == "vision" and layer.layer ==
                arch.vision.layers - 1)
    assert last.analytic > 0
    assert last.fvcore == last.analytic == last.torch


def test_lm_head_covers_every_token_of_a_plain_forward(runs: dict[str, RunCheck], tiny: tuple[Architecture, nn.Module]):
    arch, _ = tiny
    d = arch.decoder
    for run in runs.values():
        final_tokens = run.plan.llm[-1][1]
        head = next(s for s in run.stages if s.stage == "lm_head")
        assert head.analytic == head.fvcore == head.torch == 2 * final_tokens * d.hidden * d.vocab


# ---- the method stage -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", [c for c in CASES if c != "vanilla"])
def test_method_stage_is_measured_per_reducing_layer_outside_the_stages(runs: dict[str, RunCheck], case: str):
    run = runs[case]
    reductions = run.plan.reductions
    assert [(m.stage, m.layer) for m in run.method] == [(r.stage, r.layer) for r in reductions]
    for m in run.method:
        assert m.fvcore > 0
        assert m.fvcore == m.torch == m.matmul_formula, m
        assert m.paper_overhead > 0
    # The method's work is reported beside the stages, not inside them: the stages still
    # match the accountant, which has no method term.
    stage = "vision" if run.variant == "v" else "llm"
    assert next(s for s in run.stages if s.stage == stage).fvcore == next(
        s for s in run.stages if s.stage == stage).analytic


def test_vanilla_has_no_method_stage(runs: dict[str, RunCheck]):
    assert runs["vanilla"].method == []


# ---- options of the run ----------------------------------------------------------------------------------------

def test_lm_head_last_runs_the_head_on_one_token_per_sample_and_batches_count(
        tiny: tuple[Architecture, nn.Module]):
    arch, model = tiny
    run = verify_run(model, arch, make_schedule(arch, "l", {1: 20}), text_tokens=TEXT, batch=2,
                     lm_head_tokens="last")
    head = next(s for s in run.stages if s.stage == "lm_head")
    assert head.analytic == head.fvcore == head.torch == 2 * 2 * arch.decoder.hidden * arch.decoder.vocab
    assert run.passed(TOLERANCE_PERCENT)
    assert all(within(s.torch, s.analytic) for s in run.stages)


def test_the_model_is_left_unpatched(tiny: tuple[Architecture, nn.Module]):
    _, model = tiny
    assert "_ficoco_handle" not in model.__dict__
    # No patched forward stays on any module (the handle's patches are instance attributes).
    assert not [name for name, m in model.named_modules() if "forward" in m.__dict__]
    # transformers installs its own output-capturing hooks; none of the verification's stay.
    hooks = [h for m in model.modules() for h in [*m._forward_hooks.values(), *m._forward_pre_hooks.values()]]
    assert hooks, "expected transformers' own hooks after a forward"
    assert not any(isinstance(getattr(h, "__self__", None), Prefill) or "Scope" in type(h).__name__ for h in hooks)


class _Value:
    """A stand-in for a torch._C.Value of a complete tensor type."""

    def __init__(self, *sizes: int) -> None:
        self._sizes = list(sizes)

    def isCompleteTensor(self) -> bool:  # noqa: N802 - torch's name
        return True

    def type(self) -> SimpleNamespace:
        return SimpleNamespace(sizes=lambda: self._sizes)


def test_sdpa_handle_counts_query_heads_under_grouped_query_attention():
    # q: 2 x 8 heads x 10 queries x 16; k, v: 2 KV heads x 12 keys; both products, in MACs.
    q, k, v = _Value(2, 8, 10, 16), _Value(2, 2, 12, 16), _Value(2, 2, 12, 16)
    assert sdpa_flop_jit([q, k, v], [_Value(2, 8, 10, 16)]) == 2 * (2 * 8 * 10 * 12 * 16)


# ---- the command ------------------------------------------------------------------------------------------------

def test_cli_verify_keep_8_passes_and_writes_the_report(tmp_path: Path, cli: Any):
    path = tmp_path / "verify.json"
    result = cli("flops", "--verify", "--model", "llava-tiny", "--variant", "vanilla,v,l", "--keep", "8",
                 "--json", path, standalone=False)  # exit code 1 would raise SystemExit
    report = json.loads(path.read_text())
    assert report["schema"] == "ficoco.verify/1"
    assert report["passed"] is True
    assert [run["variant"] for run in report["runs"]] == ["vanilla", "v", "l"]
    for run in report["runs"]:
        reads = ["probe"] if run["variant"] != "vanilla" else []
        assert [s["stage"] for s in run["stages"]] == ["vision", "projector", "llm", "lm_head", *reads]
        for stage in run["stages"]:
            assert abs(stage["fvcore_rel_diff"]) * 100 <= TOLERANCE_PERCENT
            assert abs(stage["torch_rel_diff"]) * 100 <= TOLERANCE_PERCENT
            assert stage["fvcore_flops"] == 2 * stage["fvcore_macs"]
        assert run["skipped_matrix_ops"] == []
        assert (run["method"] == []) == (run["variant"] == "vanilla")
    shown = result.out
    assert "verdict: pass" in shown and "skipped ops that carry matrix work: none" in shown


def test_cli_verify_exits_1_when_a_stage_differs_beyond_the_tolerance(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cli: Any):
    original = verify_module.analytic_counts

    def one_percent_more_llm(*args, **kwargs):
        by_stage, by_layer = original(*args, **kwargs)
        return {**by_stage, "llm": round(by_stage["llm"] * 1.01)}, by_layer

    monkeypatch.setattr(verify_module, "analytic_counts", one_percent_more_llm)
    args = ["flops", "--verify", "--model", "llava-tiny", "--json", str(tmp_path / "v.json")]
    result = cli(*args)
    assert result.code == 1
    report = json.loads((tmp_path / "v.json").read_text())
    assert report["passed"] is False
    assert [s["stage"] for s in report["runs"][0]["stages"] if not s["within_tolerance"]] == ["llm"]
    shown = result.out
    assert "FAIL" in shown and "llm" in shown
    # The table is printed before the verdict; a wider tolerance accepts the same difference.
    assert shown.index("verdict: FAIL") > shown.index("lm_head")
    cli(*args, "--tolerance", "2", standalone=False)
    assert json.loads((tmp_path / "v.json").read_text())["passed"] is True


def test_cli_verify_refuses_families_not_wired_yet(monkeypatch: pytest.MonkeyPatch, cli: Any):
    # Every shipped family is wired now: one taken out of the registry stands for a new family.
    monkeypatch.delitem(FAMILIES, "qwen2_vl")
    with pytest.raises(FicocoError, match="not supported yet"):
        cli("flops", "--verify", "--model", "qwen2-vl-tiny", standalone=False)


def test_cli_verify_unsupported_family_ends_with_exit_2_and_one_error_line(cli: Any):
    # Every shipped family is wired now: qwen2_vl taken out of the registry stands for a new family.
    result = cli("flops", "--verify", "--model", "qwen2-vl-tiny", prelude="import ficoco.models as m; "
                 "m.FAMILIES.pop('qwen2_vl')", timeout=120)
    assert "not supported yet" in assert_one_error_line(result)


@pytest.mark.parametrize(("args", "message"), [
    (["--tolerance", "1"], "--tolerance applies to --verify"),
    (["--verify", "--tolerance", "-1"], "--tolerance -1: give a finite percentage of at least 0"),
    (["--verify", "--quant", "int8"], "drop --quant"),
    (["--verify", "--gpu", "a100-80gb"], "drop it with --verify"),
])
def test_cli_verify_option_mistakes_are_user_errors(args: list[str], message: str, cli: Any):
    with pytest.raises(FicocoError, match=message):
        cli("flops", "--model", "llava-tiny", *args, standalone=False)
