"""A method added from outside the package: the toy "stride" method below, a registry entry and its
tensor function defined in this file alone, registered for the module's tests (`registered`), runs
through `ficoco.apply`, `ficoco flops`, `flops --verify` and `ficoco profile` as the package's own
methods do, with no edit to the registry, the accountant, the adapters or the CLI."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator, Mapping
from typing import Any

import pytest
import torch

import ficoco
from ficoco.accounting.schedule import plan_tokens
from ficoco.api import profile_of
from ficoco.errors import FicocoError
from ficoco.methods import METHODS, VARIANTS, MethodSpec, Need, Step, registered
from ficoco.methods.contract import TowerModule, contract_of, load_module
from ficoco.methods.inputs import TowerInput, TowerOutput
from ficoco.methods.registry import register_method, unregister_method
from ficoco.models import synthetic_inputs

NAME = "stride"
MODEL = "llava-tiny"


# ---- the toy method: keep `keep` projected patches per item, evenly spaced in image order -----------------------

def tower_step(inputs: TowerInput, settings: Mapping[str, Any]) -> TowerOutput:
    """The adapters' call after the projector: keep every (N / keep)-th patch of every item."""
    items, patches = inputs.hidden.shape[:2]
    keep = patches - inputs.remove
    kept = (torch.arange(keep, device=inputs.hidden.device) * patches // keep).expand(items, -1)
    hidden = torch.gather(inputs.hidden, 1, kept.unsqueeze(-1).expand(-1, -1, inputs.hidden.shape[-1]))
    return TowerOutput(hidden=hidden, kept=kept)


def _steps(settings: Mapping[str, Any], n_visual: int, n_layers: int) -> tuple[Step, ...]:
    keep = settings["keep"]
    if not 1 <= keep <= n_visual:
        raise FicocoError(f"stride keeps 1..{n_visual} patches per item, got {keep}")
    return (Step(n_layers - 1, n_visual - keep, 0, "after_projector", "vision"),) if keep < n_visual else ()


def _for_keep(keep: int | None, n_visual: int, n_layers: int, hp: Mapping[str, Any]) -> dict[str, Any]:
    return {"keep": max(1, round(n_visual * hp["ratio"])) if keep is None else keep}


STRIDE = MethodSpec(
    name=NAME, title="Stride (toy)", acts_at="after_projector", placement="after_projector", positions="grid",
    needs=(Need("hidden", "projector", "all", "the projector's output, every patch"),),
    hyperparameters={"ratio": 0.5}, families=("llava",), module=__name__, function="tower_step",
    source="tests/test_methods_plugin.py", summary="keep evenly spaced projected patches",
    keep_means="visual tokens per image that reach the LLM", steps=_steps, settings_for_keep=_for_keep,
    wired=True,
)


@pytest.fixture(scope="module", autouse=True)
def _stride() -> Iterator[MethodSpec]:
    with registered(STRIDE) as spec:
        yield spec
    assert NAME not in METHODS and NAME not in VARIANTS  # cleaned up


TINY_PROFILE = MODEL  # built as this module's `model` (conftest.py)


def test_registered_method_is_a_variant_and_meets_its_module_contract() -> None:
    assert NAME in VARIANTS and METHODS[NAME] is STRIDE
    assert contract_of(STRIDE) == (TowerModule,)
    assert isinstance(STRIDE.load(), TowerModule)
    with pytest.raises(FicocoError, match="registered already"):
        register_method(STRIDE)
    with pytest.raises(FicocoError, match="package's own entries"):
        unregister_method("fastv")


@pytest.mark.parametrize("name", sorted(METHODS))
def test_every_entry_module_meets_the_contract_its_placement_asks(name: str) -> None:
    for spec in filter(None, (METHODS[name], METHODS[name].inner)):
        assert all(isinstance(spec.load(), protocol) for protocol in contract_of(spec)), spec.name


def test_a_module_without_the_contracted_function_is_refused_in_one_line() -> None:
    broken = dataclasses.replace(STRIDE, name="broken", module="ficoco.methods.base")
    with pytest.raises(FicocoError, match="offers no tower_step"):
        load_module(broken, TowerModule)


def test_apply_reduces_the_tokens_the_plan_counts(model: torch.nn.Module) -> None:
    inputs = synthetic_inputs(model, batch=2, text_tokens=12, seed=3)
    full = model(**inputs).logits.shape[1]
    arch = ficoco.api.architecture(profile_of(model))
    with ficoco.apply(model, NAME, keep=5) as handle:
        plan = plan_tokens(arch, handle.schedule, text_tokens=12)
        reduced = model(**inputs).logits
        measured = handle.measured_tokens_per_item
    assert plan.visual_tokens == 5 and measured == 5
    # The LLM ran on the planned count: every image span shortened from the full grid to 5 tokens.
    assert reduced.shape[1] == full - (arch.visual_tokens - plan.visual_tokens)
    assert handle.schedule.removed_at() == {arch.vision.feature_layer: arch.vision.units - 5}
    # The default setting (ratio 0.5) plans half the patches.
    with ficoco.apply(model, NAME) as handle:
        assert plan_tokens(arch, handle.schedule).visual_tokens == round(arch.vision.units * 0.5)


def test_flops_counts_it_and_verify_passes(cli, tmp_path) -> None:
    counted = tmp_path / "flops.json"
    code, out, err = cli(*["flops", "--model", MODEL, "--variant", f"vanilla,{NAME}", "--keep", "6",
                              "--json", str(counted)])
    assert code == 0, out + err
    rows = {r["variant"]: r for r in json.loads(counted.read_text())["rows"]}
    assert rows[NAME]["visual_tokens"] == 6 and rows[NAME]["tflops"] < rows["vanilla"]["tflops"]
    path = tmp_path / "verify.json"
    code, out, err = cli(*["flops", "--model", MODEL, "--variant", NAME, "--keep", "6", "--verify",
                              "--json", str(path)])
    assert code == 0, out + err
    report = json.loads(path.read_text())
    assert report["passed"] is True
    (run,) = report["runs"]
    assert run["variant"] == NAME and any(s["stage"] == "method" for s in run["stages"])


def test_profile_runs_it(cli, tmp_path, arch_of) -> None:
    path = tmp_path / "profile.json"
    code, out, err = cli(*["profile", "--model", MODEL, "--variant", f"vanilla,{NAME}", "--keep", "6",
                              "--repeat", "1", "--warmup", "0", "--json", str(path)])
    assert code == 0, out + err
    rows = {r["variant"]: r for r in json.loads(path.read_text())["rows"]}
    row = rows[NAME]
    assert row["status"] == "ok" and row["visual_tokens_per_item_measured"] == 6
    # The KV cache the run left holds the prompt's text and the 6 visual tokens, in every layer.
    assert set(row["kv_cache_tokens"]) == {row["text_tokens"] + 6}
    assert set(rows["vanilla"]["kv_cache_tokens"]) == {row["text_tokens"] + arch_of(MODEL).visual_tokens}
