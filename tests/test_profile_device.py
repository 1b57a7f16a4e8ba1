"""The profiler's CUDA paths, checked without a GPU (mocked where they must be): clean memory
peaks, NVML read as a sampled peak through torch's index mapping, no stale KV cache in the next
run, the device said first and a silent CPU fallback warned about, failures classified and a
run with no measured row ending non-zero, defaults that fit the device, roofline profiles
matched by name, and attention implementations the patches cannot serve refused at apply()."""

from __future__ import annotations

import sys
import weakref
from typing import Any

import pytest
import torch

import ficoco
from ficoco.errors import FicocoError
from ficoco.models.hf_compat import output_cache
from ficoco.profiling import matrix, trackers
from ficoco.profiling.matrix import ProfileConfig, gpu_profile_for, plan_run, resolve_device, run_profile

# ---- memory on CUDA (mocked) --------------------------------------------------------------------------------

class FakeCuda:
    """Records the order of allocator calls and serves NVML readings from a script."""

    def __init__(self, nvml_readings: list[int]) -> None:
        self.calls: list[str] = []
        self.readings = list(nvml_readings)

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: self.calls.append("synchronize"))
        monkeypatch.setattr(torch.cuda, "empty_cache", lambda: self.calls.append("empty_cache"))
        monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *a: self.calls.append("reset_peak"))
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: 7_000)
        monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda *a: 8_000)
        monkeypatch.setattr(torch.cuda, "device_memory_used", self.used)

    def used(self, device: Any = None) -> int:
        self.calls.append(f"nvml {device}")
        return self.readings.pop(0) if len(self.readings) > 1 else self.readings[0]


def test_cuda_memory_peak_starts_from_an_emptied_cache_and_nvml_is_a_sampled_peak(monkeypatch) -> None:
    fake = FakeCuda([1_000, 5_000, 9_000, 3_000])  # before, then the sampler's readings
    fake.install(monkeypatch)
    device = torch.device("cuda", 0)
    with trackers.MemoryTracker(device).track() as reading:
        import time

        deadline = time.monotonic() + 5
        while fake.readings != [3_000] and time.monotonic() < deadline:
            time.sleep(0.01)  # let the sampler see every scripted reading
    values = reading.values
    assert fake.calls.index("empty_cache") < fake.calls.index("reset_peak")
    assert values["peak_bytes"] == values["cuda_max_allocated_bytes"] == 7_000
    assert values["nvml_used_before_bytes"] == 1_000
    assert values["nvml_peak_used_bytes"] == 9_000  # the highest reading, not the last one
    assert "device-wide" in reading.method


def test_nvml_reading_goes_through_torchs_index_mapping(monkeypatch) -> None:
    # torch's device 0 under CUDA_VISIBLE_DEVICES=3 is NVML's device 3: torch.cuda.device_memory_used
    # knows that mapping (and MIG's), nvmlDeviceGetHandleByIndex(0) does not.
    asked: list[Any] = []
    monkeypatch.setattr(torch.cuda, "device_memory_used", lambda device=None: asked.append(device) or 123)
    assert trackers.nvml_used_bytes(torch.device("cuda", 0)) == 123
    assert asked == [torch.device("cuda", 0)]


def test_nvml_absent_gives_no_figure_not_an_error(monkeypatch) -> None:
    def broken(device: Any = None) -> int:
        raise RuntimeError("NVML Shared Library Not Found")

    monkeypatch.setattr(torch.cuda, "device_memory_used", broken)
    assert trackers.nvml_used_bytes(torch.device("cuda", 0)) is None


# ---- the previous run's KV cache ------------------------------------------------------------------------------

def test_the_previous_runs_kv_cache_is_gone_before_the_next_forward() -> None:
    config = ProfileConfig(model="llava-tiny", variants=("vanilla",), warmup=1, repeat=3, device="cpu")
    plan = plan_run(config)
    model = matrix.build_for(config, plan, "fp16")
    previous: list[weakref.ref] = []
    alive_at_call: list[bool] = []
    original = model.forward

    def spy(*args: Any, **kwargs: Any) -> Any:
        alive_at_call.append(bool(previous) and previous[-1]() is not None)
        out = original(*args, **kwargs)
        previous.append(weakref.ref(output_cache(out)))
        return out

    model.__dict__["forward"] = spy
    matrix.measure_row(model, plan.rows[0], config, plan)
    assert len(alive_at_call) == 4 and not any(alive_at_call)


# ---- device resolution ------------------------------------------------------------------------------------------

def test_auto_falls_back_to_cpu_with_a_warning_when_the_driver_shows_a_gpu_torch_cannot_use(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(trackers, "nvml_visible_gpus", lambda: 2)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    notes: list[str] = []
    assert resolve_device("auto", notes) == torch.device("cpu")
    assert len(notes) == 1 and "2 NVIDIA GPU(s)" in notes[0] and "CUDA build of torch" in notes[0]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    notes.clear()
    resolve_device("auto", notes)
    assert "CUDA_VISIBLE_DEVICES is empty" in notes[0]
    monkeypatch.setattr(trackers, "nvml_visible_gpus", lambda: 0)
    notes.clear()
    assert resolve_device("auto", notes) == torch.device("cpu") and notes == []


def test_profile_says_the_resolved_device_and_the_runs_first(cli) -> None:
    result = cli("profile", "--model", "llava-tiny", "--variant", "vanilla", "--repeat", "1", "--warmup", "0")
    assert result.code == 0, result.err
    first = result.out.strip().splitlines()[0]
    assert first.startswith("device cpu: ") and "0 warm-up and 1 timed run(s)" in first


def test_warmup_and_repeat_are_left_to_the_time_rule_unless_given(monkeypatch) -> None:
    cpu = plan_run(ProfileConfig(model="llava-tiny", variants=("vanilla",), device="cpu"))
    assert (cpu.warmup, cpu.repeat) == (None, None)  # chosen per row from its time (profiling/runs.py)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")
    gpu = plan_run(ProfileConfig(model="llava-tiny", variants=("vanilla",), device="auto"))
    assert gpu.device.type == "cuda" and (gpu.warmup, gpu.repeat) == (None, None)
    assert gpu.gpu is not None and gpu.gpu.key == "h100-sxm"
    explicit = plan_run(ProfileConfig(model="llava-tiny", variants=("vanilla",), device="cuda", warmup=0, repeat=2))
    assert (explicit.warmup, explicit.repeat) == (0, 2)  # an explicit choice always wins


@pytest.mark.parametrize(("name", "key"), [
    ("NVIDIA H100 80GB HBM3", "h100-sxm"), ("NVIDIA H100 PCIe", "h100-pcie"), ("NVIDIA H200", "h200"),
    ("NVIDIA H100 NVL", None), ("NVIDIA GH200 480GB", None), ("NVIDIA A100-SXM4-80GB", "a100-80gb"),
    ("NVIDIA A100-SXM4-40GB", "a100-40gb"), ("NVIDIA GeForce RTX 4090", None)])
def test_gpu_names_map_to_their_own_roofline_profile_or_none(name: str, key: str | None) -> None:
    profile = gpu_profile_for(name)
    assert (profile.key if profile else None) == key


# ---- failures ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("error", "status"), [
    (RuntimeError("CUBLAS_STATUS_EXECUTION_FAILED"), "error"), (NotImplementedError("no int8 kernel"), "unsupported"),
    (torch.OutOfMemoryError("CUDA out of memory"), "oom")])
def test_build_failures_are_classified_and_no_row_ok_exits_non_zero(monkeypatch, error, status, cli) -> None:
    def failing_build(*args: Any, **kwargs: Any) -> Any:
        raise error

    monkeypatch.setattr(matrix, "build_for", failing_build)
    config = ProfileConfig(model="llava-tiny", variants=("vanilla", "v"), keep=8, device="cpu")
    rows: list[dict[str, Any]] = []
    run_profile(config, plan_run(config), rows.append)
    assert [r["status"] for r in rows] == [status, status]
    assert all(r["reason"].startswith("building the model: ") for r in rows)
    result = cli("profile", "--model", "llava-tiny", "--variant", "v", "--keep", "8", "--device", "cpu")
    assert result.code == 1
    assert result.err.strip().splitlines()[-1].startswith("error: no row was measured")


def test_cleanup_after_a_failed_row_runs_once_its_traceback_is_gone(monkeypatch) -> None:
    def failing_row(*args: Any, **kwargs: Any) -> Any:
        held = torch.zeros(1000)  # noqa: F841 - what the traceback would keep alive
        raise RuntimeError("kernel failed")

    in_except: list[bool] = []
    monkeypatch.setattr(matrix, "measure_row", failing_row)
    import ficoco.models.build as build

    monkeypatch.setattr(build, "release_device_cache", lambda device: in_except.append(sys.exc_info()[0] is not None))
    config = ProfileConfig(model="llava-tiny", variants=("vanilla",), device="cpu")
    rows: list[dict[str, Any]] = []
    run_profile(config, plan_run(config), rows.append)
    assert rows[0]["status"] == "error" and "kernel failed" in rows[0]["reason"]
    assert in_except and not any(in_except)


# ---- attention implementations ------------------------------------------------------------------------------

@pytest.mark.parametrize("implementation", ["flash_attention_2", "flex_attention"])
def test_attention_implementations_the_patches_cannot_serve_are_refused_at_apply(implementation: str) -> None:
    model = ficoco.build_model("llava-tiny")
    model.config.text_config._attn_implementation = implementation
    with pytest.raises(FicocoError, match="attn_implementation='sdpa'"):
        ficoco.apply(model, "v", keep=8)
    assert "_ficoco_handle" not in model.__dict__


def test_the_suite_runs_pinned_to_the_cpu() -> None:
    import os

    if os.environ.get("FICOCO_GPU_TESTS") == "1":
        pytest.skip("GPU tests requested")
    assert os.environ["CUDA_VISIBLE_DEVICES"] == ""
    assert resolve_device("auto") == torch.device("cpu")
