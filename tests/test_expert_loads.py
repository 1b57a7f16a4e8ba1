"""The rows each expert of a sparse decoder layer took in a row's forward (profiling/experts.py), kept in the
report and priced by the prediction (profiling/predict.py)."""

from __future__ import annotations

from typing import Any

import torch

from ficoco.accounting import architecture
from ficoco.models import synthetic_inputs
from ficoco.models.build import build_model
from ficoco.profiles import load_profile
from ficoco.profiling import predict
from ficoco.profiling.experts import ExpertLoads, loads_by_layer
from ficoco.profiling.matrix import ProfileConfig, plan_run, run_profile


def test_every_sparse_layers_experts_take_the_sequences_rows_times_top_k():
    model = build_model("qwen3-vl-moe-tiny", dtype="float32")
    moe = architecture(load_profile("qwen3-vl-moe-tiny")).decoder.moe
    inputs = synthetic_inputs(model)
    loads = ExpertLoads.for_model(model)
    assert set(loads.experts) == set(moe.layers)
    with torch.inference_mode(), loads.recording():
        model(**inputs)
    assert loads.recorded and set(loads.loads) == set(moe.layers)
    tokens = inputs["input_ids"].numel()
    assert all(len(found) == moe.experts and sum(found) == tokens * moe.top_k for found in loads.loads.values())
    record = loads.to_json()
    assert record["experts"] == moe.experts
    assert {int(layer) for layer in record["rows_by_layer"]} == set(moe.layers)
    for layer, rows in loads_by_layer(record).items():
        assert rows == sorted((n for n in loads.loads[layer] if n), reverse=True)
    assert record["active_min"] <= record["active_mean"] <= record["active_max"] <= moe.experts
    # Nothing stays hooked after the record.
    assert all(not module._forward_pre_hooks for module in loads.experts.values())


def test_a_dense_decoder_has_no_loads():
    loads = ExpertLoads.for_model(build_model("qwen3-vl-tiny", dtype="float32"))
    assert loads.experts == {} and loads.to_json() is None and loads_by_layer(None) is None


def test_a_profile_row_keeps_its_loads_and_its_prediction_prices_them(monkeypatch):
    seen: list[Any] = []
    original = predict.predict_prefill

    def spy(*args: Any, **kwargs: Any) -> Any:
        seen.append(kwargs.get("expert_loads"))
        return original(*args, **kwargs)

    monkeypatch.setattr(predict, "predict_prefill", spy)
    config = ProfileConfig(model="qwen3-vl-moe-tiny", variants=("vanilla",), warmup=1, repeat=1, device="cpu",
                           dtype="float32")
    rows: list[dict[str, Any]] = []
    run_profile(config, plan_run(config), rows.append)
    (row,) = rows
    assert row["status"] == "ok"
    loads = loads_by_layer(row["expert_loads"])
    moe = architecture(load_profile("qwen3-vl-moe-tiny")).decoder.moe
    assert set(loads) == set(moe.layers)
    # Before the runs the even split (no loads); after them, the loads the row ran.
    assert seen[0] is None and seen[-1] == loads
    assert row["predicted_ms"] > 0
