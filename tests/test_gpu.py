"""CUDA paths, run only where a GPU is usable: `FICOCO_GPU_TESTS=1 python -m pytest -m gpu`
(benchmarks/gpu_run.sh runs them). Without a GPU every test here is skipped; on a GPU without bitsandbytes
or hqq (a bare machine), the int8/int4 tests are skipped with that reason."""

from __future__ import annotations

import pytest
import torch
from helpers import cuda_sync_warnings

import ficoco
from ficoco.accounting.memory import make_quant, weight_bytes
from ficoco.models import synthetic_inputs
from ficoco.models.attention import ProbeSlot, probe_attention
from ficoco.profiling.matrix import ProfileConfig, plan_run, run_profile
from ficoco.profiling.trackers import model_weight_bytes

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_weights_are_quantized_right_after_a_build_on_the_gpu(quant: str, arch_of) -> None:
    bnb = pytest.importorskip("bitsandbytes", reason="int8/int4 weights need bitsandbytes")

    model = ficoco.build_model("llava-tiny", device="cuda", quant=quant)
    kind = bnb.nn.Linear8bitLt if quant == "int8" else bnb.nn.Linear4bit
    weights = [m.weight for m in model.modules() if isinstance(m, kind)]
    assert weights and {w.dtype for w in weights} == {torch.int8 if quant == "int8" else torch.uint8}
    assert all(w.device.type == "cuda" for w in weights)
    analytic = weight_bytes(arch_of("llava-tiny"), "all", make_quant(quant))
    assert model_weight_bytes(model) == pytest.approx(analytic, rel=0.005)


def test_the_reads_equal_the_eager_probabilities_and_the_layer_runs_sdpa_on_the_gpu_in_fp16() -> None:
    from types import SimpleNamespace

    from ficoco.methods.reads.ops import DenseAttention

    generator = torch.Generator(device="cuda").manual_seed(0)
    shape = (2, 8, 300, 64)
    query, key, value = (torch.randn(shape, generator=generator, device="cuda", dtype=torch.float16)
                         for _ in range(3))
    module = torch.nn.Module()
    module.is_causal = True
    module._ficoco_original_config = SimpleNamespace(_attn_implementation="sdpa")
    module._ficoco_probe = ProbeSlot()
    output, _ = probe_attention(module, query, key, value, None, scaling=64**-0.5)
    reference = torch.nn.functional.scaled_dot_product_attention(query, key, value, is_causal=True)
    torch.testing.assert_close(output, reference.transpose(1, 2).contiguous(), atol=0, rtol=0)  # its own kernel
    reads, _ = module._ficoco_probe.take()
    # transformers' eager attention: the product and the scale in fp16, the mask, softmax in float32 cast back.
    scores = torch.matmul(query, key.transpose(-1, -2)) * 64**-0.5
    causal = torch.ones(300, 300, dtype=torch.bool, device="cuda").tril()
    eager = torch.softmax(scores.masked_fill(~causal, float("-inf")), -1, dtype=torch.float32).to(torch.float16)
    dense = DenseAttention(eager.float().mean(dim=1))
    rows = torch.tensor([[0, 150, 299], [7, 8, 9]], device="cuda")
    torch.testing.assert_close(reads.column_sum(), dense.column_sum(), atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(reads.rows(rows), dense.rows(rows), atol=1e-4, rtol=1e-3)
    # A read launches its blocks without asking the host anything.
    assert cuda_sync_warnings(lambda: (reads.column_sum(), reads.rows(rows))) == 0


@pytest.mark.parametrize(("variant", "few", "more"), [("v", "2:8", "1:4,2:4,3:4,4:4"), ("l", "1:8", "1:4,2:4,3:4")])
def test_no_host_sync_per_reducing_layer_on_the_gpu(variant: str, few: str, more: str) -> None:
    model = ficoco.build_model("llava-tiny", device="cuda")
    inputs = synthetic_inputs(model, batch=2, text_tokens=12, seed=3, device=torch.device("cuda"))
    with torch.inference_mode():
        model(**inputs)
        vanilla = cuda_sync_warnings(lambda: model(**inputs))
        counts = []
        for schedule in (few, more):
            with ficoco.apply(model, variant, schedule=schedule):
                model(**inputs)
                counts.append(cuda_sync_warnings(lambda: model(**inputs)))
    assert counts[0] == counts[1], counts
    assert counts[1] - vanilla <= 1


def test_a_cuda_profile_row_has_event_timing_nvml_peaks_and_exact_bytes() -> None:
    for package in ("bitsandbytes", "hqq"):  # int8 weights; their quantized KV cache
        pytest.importorskip(package, reason=f"the int8 rows need {package}")
    config = ProfileConfig(model="llava-tiny", variants=("vanilla", "v", "l"), keep=8, quants=("fp16", "int8"),
                           device="cuda", warmup=1, repeat=3)
    rows: list[dict] = []
    run_profile(config, plan_run(config), rows.append)
    assert [r["status"] for r in rows] == ["ok"] * 6, [r.get("reason") for r in rows]
    for row in rows:
        assert row["latency"]["timer"] == "cuda-events"
        assert row["memory"]["cuda_max_allocated_bytes"] > 0
        assert row["memory"]["nvml_peak_used_bytes"] >= row["memory"]["nvml_used_before_bytes"] > 0
        assert row["kv_cache_bytes"] == row["analytic"]["kv_cache_bytes"]
        assert row["weight_bytes"] == pytest.approx(row["analytic"]["weight_bytes"], rel=0.005)
        assert row["backend"]["compute_dtype"] == "float16"
        if row["variant"] != "vanilla":
            assert row["reduction_stages_ms"] > 0 and row["probe_ms"] > 0
