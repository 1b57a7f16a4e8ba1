"""Which attention kernel every layer ran (issue 41): `ficoco profile` records it per row and stage
(ficoco.profiling.kernels), pairs a reduced row with vanilla in the layers it does not reduce
(ficoco.report.kernels), says it under the table and in the verdict, and `ficoco report` and `ficoco
compare` read reports with and without it.

The profile runs happen once per module fixture, in process, on tiny models in float32. No timing is
compared: the tests check what ran where."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import cuda_sync_warnings

import ficoco
from ficoco.methods.reads import native
from ficoco.models import hf_compat as hf
from ficoco.models import synthetic_inputs
from ficoco.profiling.host_sync import count_host_syncs
from ficoco.profiling.kernels import SDPA_BACKENDS, KernelRecorder, implementation_label, sdpa_backend
from ficoco.profiling.rows import MeasuredRow, MemoryRecord, PrefillRecord
from ficoco.profiling.trackers import LatencyStats, MemoryReading
from ficoco.report.kernels import is_fused, ranges, slower_kernels

MODEL = "llava-tiny"  # CLIP tower of 6 layers, LLaMA decoder of 4
VISION_LAYERS, DECODER_LAYERS = 6, 4
KEEP = 40  # both FiCoCo-V and FastV reach it on llava-tiny


def _profile(cli, path: Path, *args: str) -> tuple[dict[str, Any], Any]:
    result = cli("profile", "--model", MODEL, "--dtype", "fp32", "--repeat", "1", "--json", str(path), *args)
    assert result.code == 0, result.err[-3000:]
    return json.loads(path.read_text()), result


def _rows(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {row["variant"]: row for row in report["rows"]}


def _per_layer(record: dict[str, Any], stage: str) -> dict[int, list[dict[str, Any]]]:
    layers: dict[int, list[dict[str, Any]]] = {}
    for entry in record[stage]:
        first, last = entry["layers"]
        for layer in range(first, last + 1):
            layers.setdefault(layer, []).append(entry)
    return layers


def _torch_backend(heads: int, tokens: int, head_dim: int, causal: bool) -> str | None:
    """What torch's dispatcher picks for an unmasked float32 CPU call of the model's head shape."""
    query = torch.randn(1, heads, tokens, head_dim)
    return sdpa_backend((query, query, query), {"is_causal": causal})


# The profile runs on the CPU: a read layer fuses where ficoco's native kernel builds.
FUSED = native.library() is not None


@pytest.fixture(scope="module")
def llava(tmp_path_factory, cli) -> dict[str, Any]:
    """vanilla, FiCoCo-V and FastV with one warm-up (where the record is made)."""
    path = tmp_path_factory.mktemp("kernels") / "r.json"
    report, result = _profile(cli, path, "--variant", "vanilla,v,fastv", "--keep", str(KEEP), "--warmup", "1")
    return {"report": report, "rows": _rows(report), "out": result.out, "path": path}


# ---- what each row recorded ----------------------------------------------------------------------------------------

def test_vanilla_records_sdpa_with_the_backend_torch_picks_in_every_layer_of_both_stages(llava):
    record = llava["rows"]["vanilla"]["attention_kernels"]
    # CLIP's tower attends without a mask and not causally; the decoder causally without a mask (no padding).
    expected = {"vision": _torch_backend(4, 17, 16, causal=False), "llm": _torch_backend(4, 80, 16, causal=True)}
    for stage, layers in (("vision", VISION_LAYERS), ("llm", DECODER_LAYERS)):
        per_layer = _per_layer(record, stage)
        assert sorted(per_layer) == list(range(layers))
        for entries in per_layer.values():
            assert [(e["implementation"], e["backend"], e["calls_per_layer"], e["reads"], e["via"]) for e in entries] \
                == [("sdpa", expected[stage], 1, False, None)]
        assert expected[stage] in SDPA_BACKENDS.values()
        assert len(record[stage]) == 1  # consecutive layers of one kernel are one entry


def test_ficoco_v_reads_beside_sdpa_in_its_reducing_tower_layers_and_runs_vanillas_sdpa_elsewhere(llava):
    row, vanilla = llava["rows"]["v"], llava["rows"]["vanilla"]
    reducing = {entry["layer"] for entry in row["schedule"] if entry["stage"] == "vision"}
    assert reducing
    tower = _per_layer(row["attention_kernels"], "vision")
    for layer, entries in tower.items():
        (entry,) = entries
        if layer in reducing and FUSED:
            # On a CPU with ficoco's kernel the reducing layers' output and FiCoCo-V's reads come from one fused pass
            # (ficoco.methods.reads.ops.fused): no kernel of the model's is called there.
            assert entry["implementation"] == "probe" and entry["via"] in hf.ficoco_attention_names()
        elif layer in reducing:
            # Elsewhere the output comes from the model's own SDPA; FiCoCo-V's reads are computed beside it.
            assert (entry["implementation"], entry["reads"]) == ("sdpa", True)
            assert entry["backend"] == tower[min(set(tower) - reducing)][0]["backend"]
            assert entry["via"] in hf.ficoco_attention_names()
        else:
            assert (entry["implementation"], entry["reads"], entry["via"]) == ("sdpa", False, None)
    assert sorted(tower) == list(range(VISION_LAYERS))
    assert row["attention_kernels"]["llm"] == vanilla["attention_kernels"]["llm"]


def test_fastv_reads_beside_sdpa_in_the_layer_before_its_cut_and_nowhere_else(llava):
    row = llava["rows"]["fastv"]
    (cut,) = [entry["layer"] for entry in row["schedule"] if entry["stage"] == "llm"]
    decoder = _per_layer(row["attention_kernels"], "llm")
    assert sorted(decoder) == list(range(DECODER_LAYERS))
    for layer, entries in decoder.items():
        (entry,) = entries
        assert entry["implementation"] == "sdpa" and entry["backend"] is not None
        assert entry["reads"] is (layer == cut - 1)
        assert (entry["via"] in hf.ficoco_attention_names()) if entry["reads"] else entry["via"] is None
    assert row["attention_kernels"]["vision"] == llava["rows"]["vanilla"]["attention_kernels"]["vision"]


def test_rows_that_run_vanillas_kernels_where_they_do_not_reduce_get_no_kernel_verdict(llava):
    rows = llava["rows"]
    assert rows["vanilla"]["slower_kernels_vs_vanilla"] is None
    # FiCoCo-V's probe runs only in the layers its schedule reduces at.
    assert rows["v"]["slower_kernels_vs_vanilla"] == [] and rows["fastv"]["slower_kernels_vs_vanilla"] == []
    assert "where vanilla runs" not in llava["out"]


def test_the_profile_output_names_every_rows_kernels_per_stage(llava):
    out = llava["out"]
    backend = llava["rows"]["vanilla"]["attention_kernels"]["llm"][0]["backend"]
    assert "attention kernels by layer" in out
    assert f"  vanilla: vision 0-5 sdpa({backend}); llm 0-3 sdpa({backend})" in out
    reducing = "probe" if FUSED else f"sdpa({backend})+reads"
    assert f"  v: vision 0-1,5 sdpa({backend}), 2-4 {reducing}; llm 0-3 sdpa({backend})" in out
    assert f"  fastv: vision 0-5 sdpa({backend}); llm 0,2-3 sdpa({backend}), 1 sdpa({backend})+reads" in out


# ---- a row that runs a slower kernel than vanilla where it does not reduce -----------------------------------------

@pytest.fixture(scope="module")
def eager_decoder(tmp_path_factory, cli) -> dict[str, Any]:
    """vanilla and FiCoCo-V, the V row's decoder attention turned to eager after apply() (a test-only
    config copy per module: the slower kernel in layers V does not reduce); no warm-up, so the record is
    the extra forward after the timed run."""
    original_apply = ficoco.apply
    patch = pytest.MonkeyPatch()

    def apply_then_eager(model: Any, *args: Any, **kwargs: Any) -> Any:
        handle = original_apply(model, *args, **kwargs)
        for layer in hf.decoder_layers(model):
            attention = hf.layer_parts(layer, hf.DECODER_LAYER).attention
            eager = copy.copy(attention.config)
            hf.set_attention_implementation(eager, "eager")
            patch.setattr(attention, "config", eager)
        return handle

    patch.setattr(ficoco, "apply", apply_then_eager)
    try:
        path = tmp_path_factory.mktemp("eager") / "r.json"
        report, result = _profile(cli, path, "--variant", "vanilla,v", "--keep", str(KEEP), "--warmup", "0")
    finally:
        patch.undo()
    return {"report": report, "rows": _rows(report), "out": result.out, "err": result.err, "path": path}


def test_a_row_running_eager_where_vanilla_runs_sdpa_gets_a_verdict_naming_the_layers(eager_decoder):
    rows = eager_decoder["rows"]
    backend = rows["vanilla"]["attention_kernels"]["llm"][0]["backend"]
    assert rows["v"]["attention_kernels"]["llm"] == [{"layers": [0, 3], "implementation": "eager", "backend": None,
                                                      "calls_per_layer": 1, "reads": False, "via": None}]
    assert rows["v"]["slower_kernels_vs_vanilla"] == [
        {"stage": "llm", "layers": [[0, 3]], "ran": {"implementation": "eager", "backend": None},
         "vanilla": {"implementation": "sdpa", "backend": backend}}]
    verdict = next(line for line in eager_decoder["out"].splitlines() if line.startswith("v: "))
    assert f"runs eager attention in decoder layers 0-3, where vanilla runs SDPA ({backend})" in verdict


def test_a_row_without_warm_up_is_recorded_in_one_extra_forward_after_its_timed_runs(eager_decoder):
    for row in eager_decoder["rows"].values():
        assert row["runs"]["warmup"] == 0 and row["attention_kernels"]["vision"]
    # The progress names the extra step (rows 1 and 2), after each row's timed run.
    progress = eager_decoder["out"] + eager_decoder["err"]
    assert progress.count("kernel record 1/1") >= 2
    assert progress.index("timed run 1/1") < progress.index("kernel record 1/1")


# ---- ficoco report and ficoco compare ------------------------------------------------------------------------------

def _without_kernels(report: dict[str, Any]) -> dict[str, Any]:
    old = copy.deepcopy(report)
    for row in old["rows"]:
        row.pop("attention_kernels", None)
        row.pop("slower_kernels_vs_vanilla", None)
    return old


def test_ficoco_report_shows_the_kernels_and_the_kernel_verdict_from_the_json_alone(eager_decoder, cli):
    result = cli("report", str(eager_decoder["path"]))
    assert result.code == 0, result.err
    assert "attention kernels by layer" in result.out and "  v: vision " in result.out
    assert "runs eager attention in decoder layers 0-3, where vanilla runs SDPA" in result.out


def test_a_report_made_before_the_kernel_record_still_renders_and_compares(eager_decoder, cli, tmp_path):
    old = tmp_path / "old.json"
    old.write_text(json.dumps(_without_kernels(eager_decoder["report"])))
    for args in ((), ("--wide",), ("--format", "markdown"), ("--format", "csv")):
        result = cli("report", str(old), *args)
        assert result.code == 0, result.err
        assert "attention kernels" not in result.out and "where vanilla runs" not in result.out
    compared = cli("compare", str(old), str(eager_decoder["path"]), "--format", "json")
    assert compared.code in (0, 1), compared.err
    metrics = {verdict["metric"] for verdict in json.loads(compared.out)["verdicts"]}
    assert metrics and not any("kernel" in metric or "attention" in metric for metric in metrics)


# ---- Qwen2.5-VL's packed, windowed tower ---------------------------------------------------------------------------

def test_qwen_window_layers_record_one_call_per_window_and_full_layers_one(cli, tmp_path):
    result = cli("profile", "--model", "qwen2.5-vl-tiny", "--variant", "vanilla", "--dtype", "fp32", "--warmup",
                 "0", "--repeat", "1", "--json", str(tmp_path / "q.json"))
    assert result.code == 0, result.err[-3000:]
    (row,) = json.loads((tmp_path / "q.json").read_text())["rows"]
    profile = json.loads((Path(__file__).resolve().parents[1] / "profiles" / "qwen2.5-vl-tiny.json").read_text())
    full = set(profile["vision_config"]["fullatt_block_indexes"])
    tower = _per_layer(row["attention_kernels"], "vision")
    assert sorted(tower) == list(range(profile["vision_config"]["depth"]))
    calls = {layer: entries[0]["calls_per_layer"] for layer, entries in tower.items()}
    assert {calls[layer] for layer in full} == {1}
    windows = {calls[layer] for layer in tower if layer not in full}
    assert len(windows) == 1 and windows.pop() > 1
    assert all(entries[0]["implementation"] == "sdpa" for entries in tower.values())


# ---- the recorder on its own ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny() -> Any:
    return ficoco.build_model(MODEL, dtype="fp32")


def test_recording_adds_no_host_synchronisation_to_a_forward(tiny):
    inputs = synthetic_inputs(tiny, text_tokens=12, seed=1)
    counts = []
    for recorded in (False, True):
        recorder = KernelRecorder.for_model(tiny)
        with torch.no_grad(), count_host_syncs() as syncs:
            if recorded:
                with recorder.recording():
                    tiny(**inputs)
            else:
                tiny(**inputs)
        counts.append(dict(syncs))
    assert counts[0] == counts[1]


def test_recording_leaves_transformers_and_torch_as_they_were_even_when_the_forward_fails(tiny):
    from transformers.modeling_utils import AttentionInterface

    lookup, sdpa = AttentionInterface.get_interface, torch.nn.functional.scaled_dot_product_attention
    recorder = KernelRecorder.for_model(tiny)
    hooks = sum(len(layer._forward_pre_hooks) for layer in hf.decoder_layers(tiny))
    with pytest.raises(RuntimeError, match="stop"), recorder.recording():
        assert AttentionInterface.get_interface is not lookup
        raise RuntimeError("stop")
    assert AttentionInterface.get_interface is lookup
    assert torch.nn.functional.scaled_dot_product_attention is sdpa
    assert sum(len(layer._forward_pre_hooks) for layer in hf.decoder_layers(tiny)) == hooks
    assert not recorder.recorded


def test_sdpa_backend_is_what_torch_would_dispatch_to():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    query = torch.randn(1, 2, 5, 8)
    with sdpa_kernel(SDPBackend.MATH):
        assert sdpa_backend((query, query, query), {}) == "math"
    assert sdpa_backend((query, query, query), {"dropout_p": 0.5}) == "math"  # no fused CPU kernel drops out
    assert sdpa_backend((query,), {}) is None  # a call torch would refuse names nothing


def test_implementation_names_become_the_reports_words():
    assert implementation_label("sdpa", False) == "sdpa"
    assert implementation_label("sdpa", True) == "eager"  # the registry handed back the model file's default
    assert implementation_label("eager", True) == implementation_label("paged|eager", False) == "eager"
    assert implementation_label("flash_attention_2", False) == "flash"
    assert implementation_label("flex_attention", False) == "flex"
    assert implementation_label("kernels-community/sage", False) == "kernels-community/sage"


def test_a_rows_record_is_its_last_measured_field():
    latency = LatencyStats(samples_ms=(20.0,), timer="perf_counter")
    record = {"vision": [], "llm": [{"layers": [0, 1], "implementation": "sdpa", "backend": "math",
                                     "calls_per_layer": 1, "reads": False, "via": None}]}
    prefill = PrefillRecord(latency=latency, runs={}, batch=1, reduction_stages_ms=0.0, probe_ms=0.0,
                            attention_kernels=record)
    row = MeasuredRow(prefill, MemoryRecord(peak=MemoryReading("cpu", {}, "rss"), kv_cache_bytes=1,
                                            kv_cache_tokens=1)).to_json()
    assert list(row)[-1] == "attention_kernels" and row["attention_kernels"] == record


def test_a_row_without_warm_up_is_estimated_with_its_kernel_record_forward():
    from ficoco.profiling.estimate import row_runs_s

    assert row_runs_s(2.0, (0, 3)) == pytest.approx(4 * 2.0)
    assert row_runs_s(2.0, (1, 3)) == pytest.approx(4 * 2.0)


# ---- the pairing with vanilla, on records alone ---------------------------------------------------------------------

def _entry(first: int, last: int, implementation: str, backend: str | None = None, reads: bool = False
           ) -> dict[str, Any]:
    return {"layers": [first, last], "implementation": implementation, "backend": backend, "calls_per_layer": 1,
            "reads": reads, "via": "ficoco_x" if reads else None}


def _pair(row_llm: list[dict[str, Any]], vanilla_llm: list[dict[str, Any]], schedule=()) -> Any:
    row = {"variant": "m", "schedule": list(schedule), "attention_kernels": {"vision": [], "llm": row_llm}}
    base = {"variant": "vanilla", "attention_kernels": {"vision": [], "llm": vanilla_llm}}
    return slower_kernels(row, base)


def test_materialising_kernels_are_slower_than_fused_ones():
    assert not is_fused("eager", None) and not is_fused("probe", None) and not is_fused("sdpa", "math")
    assert is_fused("sdpa", "flash") and is_fused("sdpa", "cudnn") and is_fused("sdpa", None)
    assert is_fused("flash", "flash_attention_2")


def test_math_sdpa_where_vanilla_runs_flash_is_slower_outside_the_reducing_layers_only():
    found = _pair([_entry(0, 7, "sdpa", "math")], [_entry(0, 7, "sdpa", "flash")],
                  schedule=[{"stage": "llm", "layer": 3, "remove": 9}])
    assert found == [{"stage": "llm", "layers": [[0, 2], [4, 7]], "ran": {"implementation": "sdpa", "backend": "math"},
                      "vanilla": {"implementation": "sdpa", "backend": "flash"}}]


def test_the_same_kernel_a_probe_in_a_reducing_layer_or_reads_beside_sdpa_are_not_slower():
    vanilla = [_entry(0, 3, "sdpa", "flash")]
    assert _pair([_entry(0, 3, "sdpa", "flash")], vanilla) == []
    assert _pair([_entry(0, 0, "sdpa", "flash"), _entry(1, 1, "sdpa", "flash", reads=True),
                  _entry(2, 3, "sdpa", "flash")], vanilla) == []
    assert _pair([_entry(0, 1, "sdpa", "flash"), _entry(2, 2, "probe", reads=True), _entry(3, 3, "sdpa", "flash")],
                 vanilla, schedule=[{"stage": "llm", "layer": 2, "remove": 4}]) == []
    # Eager where vanilla runs eager too (a model loaded with it): nothing to say.
    assert _pair([_entry(0, 3, "eager")], [_entry(0, 3, "eager")]) == []


def test_a_probe_outside_the_schedule_is_named_against_vanillas_kernel():
    found = _pair([_entry(0, 0, "sdpa", "flash"), _entry(1, 1, "probe", reads=True), _entry(2, 3, "sdpa", "flash")],
                  [_entry(0, 3, "sdpa", "flash")], schedule=[{"stage": "llm", "layer": 2, "remove": 4,
                                                             "where": "layer_input"}])
    assert found == [{"stage": "llm", "layers": [[1, 1]], "ran": {"implementation": "probe", "backend": None},
                      "vanilla": {"implementation": "sdpa", "backend": "flash"}}]


def test_no_kernel_pairing_for_vanilla_or_where_a_row_has_no_record():
    vanilla = {"variant": "vanilla", "attention_kernels": {"llm": [_entry(0, 1, "sdpa", "flash")]}}
    assert slower_kernels(vanilla, vanilla) is None
    assert slower_kernels({"variant": "v", "schedule": []}, vanilla) is None
    assert slower_kernels({"variant": "v", "attention_kernels": {"llm": [_entry(0, 1, "eager")]}},
                          {"variant": "vanilla"}) is None


def test_layer_ranges_join_consecutive_layers():
    assert ranges([5, 0, 1, 2, 7, 8]) == [[0, 2], [5, 5], [7, 8]]
    assert ranges([]) == []


# ---- on a GPU (FICOCO_GPU_TESTS=1) ---------------------------------------------------------------------------------

@pytest.mark.gpu
def test_on_cuda_vanilla_names_a_fused_sdpa_backend_and_recording_adds_no_host_sync():
    model = ficoco.build_model(MODEL, device="cuda", dtype="fp16")
    inputs = synthetic_inputs(model, batch=2, text_tokens=12, seed=3, device=torch.device("cuda"))
    recorder = KernelRecorder.for_model(model)

    def recorded() -> None:
        with recorder.recording():
            model(**inputs)

    with torch.inference_mode():
        model(**inputs)
        assert cuda_sync_warnings(recorded) == cuda_sync_warnings(lambda: model(**inputs))
    record = recorder.to_json()
    for stage, layers in (("vision", VISION_LAYERS), ("llm", DECODER_LAYERS)):
        per_layer = _per_layer(record, stage)
        assert sorted(per_layer) == list(range(layers))
        assert {(e["implementation"], e["backend"] in ("flash", "efficient", "cudnn"))
                for entries in per_layer.values() for e in entries} == {("sdpa", True)}


def test_a_routed_function_calling_a_fused_kernel_at_the_aten_level_is_named_by_that_kernel(tiny):
    """A routed function that asks SDPA's CPU flash kernel for its output and softmax normaliser directly (not
    through torch.nn.functional) ran that kernel with reads, not a probe."""
    name = "ficoco_test_direct_flash"

    def direct_flash(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
                     **kwargs: Any) -> tuple[torch.Tensor, None]:
        assert attention_mask is None  # no padding: the causal pattern alone
        output, _normaliser = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(query, key, value,
                                                                                          is_causal=True)
        return output.transpose(1, 2).contiguous(), None

    hf.register_attention(name, direct_flash)
    attention = hf.layer_parts(hf.decoder_layers(tiny)[2], hf.DECODER_LAYER).attention
    routed = copy.copy(attention.config)
    hf.set_attention_implementation(routed, name)
    recorder = KernelRecorder.for_model(tiny)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(attention, "config", routed)
        with torch.inference_mode(), recorder.recording():
            tiny(**synthetic_inputs(tiny, text_tokens=12, seed=1))
    decoder = _per_layer(recorder.to_json(), "llm")
    assert decoder[2] == [{"layers": [2, 2], "implementation": "sdpa", "backend": "flash", "calls_per_layer": 1,
                           "reads": True, "via": name}]
    assert all(entries[0]["reads"] is False for layer, entries in decoder.items() if layer != 2)


def test_every_timed_run_records_its_page_faults_and_the_warm_up_none(llava):
    """Faults counted around each timed forward alone (a slow run that faulted says so; the rate probe never
    sees it), as many as the row's timed runs."""
    for row in llava["rows"].values():
        faults = row["page_faults"]
        assert len(faults["minor"]) == len(faults["major"]) == len(row["latency"]["samples_ms"]) == 1
        assert all(isinstance(count, int) and count >= 0 for count in faults["minor"] + faults["major"])
