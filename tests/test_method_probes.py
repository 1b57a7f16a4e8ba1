"""The prediction prices each method's own attention probe from its spec's needs (profiling/predict.py:
`method_probes`, `probe_bytes`): FastV's one row, FiCoCo's whole layers, nothing for a method that reads
no attention probabilities, and a method registered from outside the package from its own needs.
Arithmetic only: nothing is timed."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import pytest

from ficoco.accounting import CountOptions, architecture, resolve_schedule
from ficoco.accounting.schedule import plan_tokens
from ficoco.errors import FicocoError
from ficoco.methods import MethodSpec, Need, Step, registered
from ficoco.profiles import load_profile
from ficoco.profiling.predict import TableRates, method_probes, predict_prefill, probe_bytes

TEXT = 60


@pytest.fixture(scope="module")
def arch7b():
    return architecture(load_profile("llava-1.5-7b"))


def _schedule(arch, variant: str, **budget: Any):
    return resolve_schedule(arch, variant, CountOptions(text_tokens=TEXT), **budget)


def test_fastv_probe_is_one_row_far_below_ficoco_l_at_the_same_tokens(arch7b):
    fastv = _schedule(arch7b, "fastv", keep=192)
    (probe,) = method_probes(arch7b, fastv, TEXT, 1)
    entering = plan_tokens(arch7b, fastv, text_tokens=TEXT).llm[0][0]  # every token reaches layer K-1 = 1
    assert (probe.stage, probe.layer, probe.rows, probe.keys, probe.whole_layer) == ("llm", 1, 1, entering, False)
    assert probe.scores == arch7b.decoder.heads * entering
    # FiCoCo-L's first reducing layer at the same tokens: every row of the layer, heads x tokens^2.
    ficoco_l = _schedule(arch7b, "l", keep=192)
    first = method_probes(arch7b, ficoco_l, TEXT, 1)[0]
    assert first.whole_layer and first.rows == first.keys == entering
    assert first.scores == arch7b.decoder.heads * entering**2
    assert probe.bytes_moved(2) < first.bytes_moved(2) / 5
    assert probe_bytes(arch7b, fastv, TEXT, 1) < probe_bytes(arch7b, ficoco_l, TEXT, 1) / 50


def test_ficoco_probe_is_its_float32_passes_over_every_score(arch7b):
    """attention_with_probabilities: 4 float32 passes (a 4-byte read and write each) per decoder score in
    16-bit compute (scores written, causal mask, softmax, cast for the output and its read, head sum), 3 in
    a tower (no mask); 3.5 and 2.5 in fp32, whose cast is a no-op; plus the q and k casts."""
    l_probe = method_probes(arch7b, _schedule(arch7b, "l", keep=192), TEXT, 1)[0]
    v_probe = method_probes(arch7b, _schedule(arch7b, "v", keep=192), TEXT, 1)[0]
    for probe, passes_16, passes_32 in ((l_probe, 4.0, 3.5), (v_probe, 3.0, 2.5)):
        states = probe.sequences * probe.heads * probe.keys * probe.head_dim
        assert probe.bytes_moved(2) == pytest.approx(8 * passes_16 * probe.scores + (16 + 4 * 2) * states)
        assert probe.bytes_moved(4) == pytest.approx(8 * passes_32 * probe.scores + 16 * states)
    # Every reducing layer probes once, at the tokens entering it; batch multiplies.
    v = _schedule(arch7b, "v", keep=192)
    assert len(method_probes(arch7b, v, TEXT, 1)) == len({r.layer for r in v.removals})
    assert probe_bytes(arch7b, v, TEXT, 2) == pytest.approx(2 * probe_bytes(arch7b, v, TEXT, 1))


@pytest.mark.parametrize("variant", ["dart", "divprune", "cdpruner", "tome"])
def test_a_method_reading_no_attention_rows_has_no_probe(arch7b, variant):
    schedule = _schedule(arch7b, variant, keep=192)
    assert schedule.removals and method_probes(arch7b, schedule, TEXT, 1) == []
    assert probe_bytes(arch7b, schedule, TEXT, 1) == 0
    rates = TableRates(dtype="bfloat16", flops_per_s_by_tokens={1: 1e12}, bandwidth_bytes_per_s=1e10)
    assert predict_prefill(arch7b, schedule, rates, text_tokens=TEXT).parts_s["probe"] == 0
    assert probe_bytes(arch7b, _schedule(arch7b, "vanilla"), TEXT, 1) == 0


def test_row_methods_price_their_rows(arch7b):
    sparse = _schedule(arch7b, "sparsevlm", keep=192)
    probes = method_probes(arch7b, sparse, TEXT, 1)
    # The suffix's rater rows at the layer before every step.
    assert [p.layer for p in probes] == [r.layer - 1 for r in sparse.removals]
    assert all(1 < p.rows < p.keys and not p.whole_layer for p in probes)
    visionzip = method_probes(arch7b, _schedule(arch7b, "visionzip", keep=192), TEXT, 1)
    assert [(p.stage, p.rows, p.keys) for p in visionzip] == [("vision", 1, arch7b.vision.tokens(arch7b.vision.units))]


def test_the_prediction_charges_the_probe_at_the_bandwidth(arch7b):
    rates = TableRates(dtype="bfloat16", flops_per_s_by_tokens={1: 1e12}, bandwidth_bytes_per_s=1e10)
    for variant in ("fastv", "l"):
        schedule = _schedule(arch7b, variant, keep=192)
        parts = predict_prefill(arch7b, schedule, rates, text_tokens=TEXT).parts_s
        assert parts["probe"] == pytest.approx(probe_bytes(arch7b, schedule, TEXT, 1, 2.0) / 1e10)


# ---- a method registered from outside the package is priced from its own needs -------------------------------------

def _steps(settings: Mapping[str, Any], n_visual: int, n_layers: int) -> tuple[Step, ...]:
    keep = settings["keep"]
    if not 1 <= keep <= n_visual:
        raise FicocoError(f"keep 1..{n_visual}, got {keep}")
    return (Step(n_layers - 1, n_visual - keep, 0, "tower_output", "vision"),) if keep < n_visual else ()


def _for_keep(keep: int | None, n_visual: int, n_layers: int, hp: Mapping[str, Any]) -> dict[str, Any]:
    return {"keep": n_visual // 2 if keep is None else keep}


TOY = MethodSpec(
    name="toyprobe", title="Toy probe", acts_at="vision_layer", placement="tower_output", positions="grid",
    needs=(Need("attention_rows", "vision L", "all", "every query's probabilities of the layer the projector reads"),
           Need("hidden", "vision L", "all", "that layer's output")),
    hyperparameters={}, families=("llava",), module=__name__, function="unused",
    source="tests/test_method_probes.py", summary="a toy", keep_means="visual tokens per image",
    steps=_steps, settings_for_keep=_for_keep, wired=True,
)


def test_a_registered_method_is_priced_from_its_own_needs(arch7b):
    with registered(TOY):
        schedule = _schedule(arch7b, "toyprobe", keep=100)
        (probe,) = method_probes(arch7b, schedule, TEXT, 1)
        layer = schedule.removals[0].layer
        entering = plan_tokens(arch7b, schedule, text_tokens=TEXT).vision[layer][0]
        assert (probe.method, probe.stage, probe.layer, probe.whole_layer) == ("toyprobe", "vision", layer, True)
        assert probe.scores == arch7b.vision.heads * entering**2
        whole = probe_bytes(arch7b, schedule, TEXT, 1)
    # The same method reading the [CLS] row only: one row per item, far cheaper.
    cls_only = dataclasses.replace(TOY, needs=(Need("attention_rows", "vision L", "cls", "the [CLS] row"),))
    with registered(cls_only):
        (row,) = method_probes(arch7b, _schedule(arch7b, "toyprobe", keep=100), TEXT, 1)
        assert (row.rows, row.keys, row.whole_layer) == (1, entering, False)
        assert probe_bytes(arch7b, _schedule(arch7b, "toyprobe", keep=100), TEXT, 1) < whole / 10
    keys_only = dataclasses.replace(TOY, needs=(Need("keys", "vision L", "all", "key states"),))
    with registered(keys_only):
        assert probe_bytes(arch7b, _schedule(arch7b, "toyprobe", keep=100), TEXT, 1) == 0
