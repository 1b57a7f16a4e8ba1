"""The prediction prices each method's own attention probe from its spec (profiling/predict.py): the reads of
a whole layer's attention a method makes beside the layer's kernel (ficoco.accounting.reads: FiCoCo-V's
column means and correlate rows, FiCoCo-L's visual and text rows) at their measured rates, the few rows a
method computes inside its steps (FastV's last row, [CLS] rows) in bytes, nothing for a method that reads no
attention probabilities, and a method registered from outside the package from its own needs.
Arithmetic only: nothing is timed."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import pytest

from ficoco.accounting import CountOptions, architecture, resolve_schedule
from ficoco.accounting.methods import suffix_tokens
from ficoco.accounting.schedule import plan_tokens
from ficoco.errors import FicocoError
from ficoco.methods import MethodSpec, Need, Step, registered
from ficoco.methods.reads import WHOLE_READ_SCORES
from ficoco.profiles import load_profile
from ficoco.profiling.predict import TableRates, method_probes, predict_prefill, probe_bytes, schedule_reads

TEXT = 60


@pytest.fixture(scope="module")
def arch7b():
    return architecture(load_profile("llava-1.5-7b"))


def _schedule(arch, variant: str, **budget: Any):
    return resolve_schedule(arch, variant, CountOptions(text_tokens=TEXT), **budget)


def test_fastv_probe_is_one_row_far_below_ficoco_l_reads_at_the_same_tokens(arch7b):
    fastv = _schedule(arch7b, "fastv", keep=192)
    (probe,) = method_probes(arch7b, fastv, TEXT, 1)
    entering = plan_tokens(arch7b, fastv, text_tokens=TEXT).llm[0][0]  # every token reaches layer K-1 = 1
    assert (probe.stage, probe.layer, probe.rows, probe.keys) == ("llm", 1, 1, entering)
    assert probe.scores == arch7b.decoder.heads * entering
    assert schedule_reads(arch7b, fastv, TEXT, 1) == []
    # FiCoCo-L's first reducing layer at the same tokens: the visual and text rows after the image, every key.
    ficoco_l = _schedule(arch7b, "l", keep=192)
    plan = plan_tokens(arch7b, ficoco_l, text_tokens=TEXT)
    layer = plan.reductions[0].layer
    first = [read for read in schedule_reads(arch7b, ficoco_l, TEXT, 1) if read.layer == layer]
    suffix = suffix_tokens(arch7b, plan.text_tokens)  # the text after the image
    prefix = entering - plan.reductions[0].visual_before - suffix
    # Its visual and text rows, tile by tile of 64 rows, each over the keys the causal mask lets it see.
    assert sum(read.rows for read in first) == plan.reductions[0].visual_before + suffix
    assert [read.keys for read in first[:2]] == [prefix + 64, prefix + 128] and first[-1].keys == entering
    assert sum(read.scores for read in first) < arch7b.decoder.heads * entering * entering * 0.6
    assert method_probes(arch7b, ficoco_l, TEXT, 1) == []
    assert probe_bytes(arch7b, fastv, TEXT, 1) < probe_bytes(arch7b, ficoco_l, TEXT, 1) / 20


def test_ficoco_v_reads_the_column_means_the_cls_row_and_the_discarded_rows(arch7b):
    v = _schedule(arch7b, "v", keep=192)
    plan = plan_tokens(arch7b, v, text_tokens=TEXT)
    reads = schedule_reads(arch7b, v, TEXT, 1)
    # Per reducing layer: the patches' column means, the [CLS] row, then the rows of the patches it removes; a
    # layer small enough is read whole, once (WHOLE_READ_SCORES).
    at = 0
    for red in plan.reductions:
        tokens = plan.vision[red.layer][0]
        if arch7b.vision.heads * tokens * tokens <= WHOLE_READ_SCORES:
            (whole,) = reads[at:at + 1]
            assert (whole.kind, whole.rows, whole.keys) == ("rows", tokens, tokens)
            at += 1
            continue
        columns, cls_row, discarded = reads[at:at + 3]
        at += 3
        assert (columns.kind, columns.rows, columns.keys) == ("columns", tokens - 1, tokens)
        assert (cls_row.rows, discarded.rows, discarded.keys) == (1, red.removed, tokens)
        assert columns.layer == red.layer and columns.heads == arch7b.vision.heads
    assert at == len(reads) and reads[0].kind == "columns"  # the first layers (577 tokens) are read by blocks
    # The equivalent token in place of [CLS] reads no [CLS] row.
    # Batch multiplies (at least: a layer too large to be read whole at batch 2 reads its discarded rows too).
    one, two = (sum(r.scores for r in schedule_reads(arch7b, v, TEXT, b)) for b in (1, 2))
    assert 2 * one <= two < 2.2 * one
    from ficoco.accounting.reads import method_reads

    equivalent = method_reads(arch7b, v, plan, settings={"equivalent_token": True})
    assert len(equivalent) < len(reads) and all(r.rows != 1 for r in equivalent)


@pytest.mark.parametrize("variant", ["dart", "divprune", "cdpruner", "tome"])
def test_a_method_reading_no_attention_rows_has_no_probe(arch7b, variant):
    schedule = _schedule(arch7b, variant, keep=192)
    assert schedule.removals and method_probes(arch7b, schedule, TEXT, 1) == []
    assert schedule_reads(arch7b, schedule, TEXT, 1) == []
    assert probe_bytes(arch7b, schedule, TEXT, 1) == 0
    rates = TableRates(dtype="bfloat16", flops_per_s_by_tokens={1: 1e12}, bandwidth_bytes_per_s=1e10)
    assert predict_prefill(arch7b, schedule, rates, text_tokens=TEXT).parts_s["probe"] == 0
    assert probe_bytes(arch7b, _schedule(arch7b, "vanilla"), TEXT, 1) == 0


def test_row_methods_price_their_rows(arch7b):
    sparse = _schedule(arch7b, "sparsevlm", keep=192)
    probes = method_probes(arch7b, sparse, TEXT, 1)
    # The suffix's rater rows at the layer before every step.
    assert [p.layer for p in probes] == [r.layer - 1 for r in sparse.removals]
    assert all(1 < p.rows < p.keys for p in probes)
    visionzip = method_probes(arch7b, _schedule(arch7b, "visionzip", keep=192), TEXT, 1)
    assert [(p.stage, p.rows, p.keys) for p in visionzip] == [("vision", 1, arch7b.vision.tokens(arch7b.vision.units))]


def test_the_prediction_charges_rows_at_the_bandwidth_and_reads_at_their_rate(arch7b):
    rates = TableRates(dtype="bfloat16", flops_per_s_by_tokens={1: 1e12}, bandwidth_bytes_per_s=1e10,
                       reads_by_tokens={1: 1e9})
    fastv = _schedule(arch7b, "fastv", keep=192)
    parts = predict_prefill(arch7b, fastv, rates, text_tokens=TEXT).parts_s
    assert parts["probe"] == pytest.approx(probe_bytes(arch7b, fastv, TEXT, 1, 2.0) / 1e10)
    ficoco_l = _schedule(arch7b, "l", keep=192)
    parts = predict_prefill(arch7b, ficoco_l, rates, text_tokens=TEXT).parts_s
    assert parts["probe"] == pytest.approx(sum(r.scores for r in schedule_reads(arch7b, ficoco_l, TEXT, 1)) / 1e9)
    # Without a reads table, a read is priced as its score products at the matmul rate.
    plain = TableRates(dtype="bfloat16", flops_per_s_by_tokens={1: 1e12}, bandwidth_bytes_per_s=1e10)
    parts = predict_prefill(arch7b, ficoco_l, plain, text_tokens=TEXT).parts_s
    assert parts["probe"] == pytest.approx(sum(2 * r.macs for r in schedule_reads(arch7b, ficoco_l, TEXT, 1)) / 1e12)


@dataclasses.dataclass(frozen=True)
class _FusedRates(TableRates):
    """A table whose fused pass ("fused") and the model's kernel beside it ("fused_reference") run at rates of
    their own (scores per second), every other read at `reads_by_tokens`'."""

    fused_scores_per_s: float = 1.0
    reference_scores_per_s: float = 1.0

    def read_scores_per_s(self, kind, heads, kv_heads, head_dim, rows, keys, causal, rule):
        if kind == "fused":
            return self.fused_scores_per_s
        if kind == "fused_reference":
            return self.reference_scores_per_s
        return super().read_scores_per_s(kind, heads, kv_heads, head_dim, rows, keys, causal, rule)


@pytest.mark.parametrize("variant", ["v", "l"])
def test_a_fused_layer_is_priced_as_its_pass_beyond_the_models_kernel_once(arch7b, variant):
    """A layer whose attention ficoco's fused pass computed costs the method (pass - kernel) over the layer's whole
    square of scores, once, whatever it reads there; never below zero; other layers keep their reads' rate."""
    schedule = _schedule(arch7b, variant, keep=192)
    reads = schedule_reads(arch7b, schedule, TEXT, 1)
    layers = sorted({(read.stage, read.layer) for read in reads})
    fused = layers[:1]
    square = {layer: max(r.keys for r in reads if (r.stage, r.layer) == layer) for layer in layers}
    stage, _ = fused[0]
    heads = arch7b.vision.heads if stage == "vision" else arch7b.decoder.heads
    sequences = next(r.sequences for r in reads if (r.stage, r.layer) == fused[0])
    scores = sequences * heads * square[fused[0]] ** 2
    rest = sum(r.scores for r in reads if (r.stage, r.layer) not in fused) / 1e9
    rates = _FusedRates(dtype="float32", flops_per_s_by_tokens={1: 1e12}, bandwidth_bytes_per_s=1e10,
                        reads_by_tokens={1: 1e9}, fused_scores_per_s=2e9, reference_scores_per_s=4e9)
    parts = predict_prefill(arch7b, schedule, rates, text_tokens=TEXT, fused_layers=fused).parts_s
    rows = sum(probe.bytes_moved(2.0) for probe in method_probes(arch7b, schedule, TEXT, 1)) / 1e10
    assert parts["probe"] == pytest.approx(rows + rest + scores / 2e9 - scores / 4e9)
    # A pass no slower than the kernel reads for free.
    free = dataclasses.replace(rates, fused_scores_per_s=8e9)
    parts = predict_prefill(arch7b, schedule, free, text_tokens=TEXT, fused_layers=fused).parts_s
    assert parts["probe"] == pytest.approx(rows + rest)
    # Without the record, every read is priced beside the kernel, as before.
    parts = predict_prefill(arch7b, schedule, rates, text_tokens=TEXT).parts_s
    assert parts["probe"] == pytest.approx(rows + sum(r.scores for r in reads) / 1e9)


def test_the_fused_layers_come_from_the_rows_kernel_record():
    from ficoco.profiling.predict import fused_layers

    record = {"vision": [{"layers": [0, 1], "implementation": "sdpa"}, {"layers": [2, 4], "implementation": "probe"}],
              "llm": [{"layers": [0, 2], "implementation": "sdpa"}, {"layers": [3, 3], "implementation": "probe"}]}
    assert fused_layers(record) == {("vision", 2), ("vision", 3), ("vision", 4), ("llm", 3)}
    assert fused_layers(None) == frozenset()


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
        # It reads every row and says no more: one column read over every score of the layer.
        (read,) = schedule_reads(arch7b, schedule, TEXT, 1)
        layer = schedule.removals[0].layer
        entering = plan_tokens(arch7b, schedule, text_tokens=TEXT).vision[layer][0]
        assert (read.method, read.stage, read.layer, read.kind) == ("toyprobe", "vision", layer, "columns")
        assert read.scores == arch7b.vision.heads * entering**2
        whole = probe_bytes(arch7b, schedule, TEXT, 1)
    # The same method reading the [CLS] row only: one row per item, far cheaper.
    cls_only = dataclasses.replace(TOY, needs=(Need("attention_rows", "vision L", "cls", "the [CLS] row"),))
    with registered(cls_only):
        (row,) = method_probes(arch7b, _schedule(arch7b, "toyprobe", keep=100), TEXT, 1)
        assert (row.rows, row.keys) == (1, entering)
        assert probe_bytes(arch7b, _schedule(arch7b, "toyprobe", keep=100), TEXT, 1) < whole / 5
    keys_only = dataclasses.replace(TOY, needs=(Need("keys", "vision L", "all", "key states"),))
    with registered(keys_only):
        assert probe_bytes(arch7b, _schedule(arch7b, "toyprobe", keep=100), TEXT, 1) == 0
