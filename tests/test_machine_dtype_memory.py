"""`--dtype` and the memory guard (issue 13): the dtype decided from the CPU's measured rates
(mocked here, so the decision does not depend on the machine the tests run on), float32
compute on upcast bfloat16 weights where float32 does not fit, rows that name their dtypes,
and a build that would not fit refused before it starts with one line naming what fits."""

from __future__ import annotations

import dataclasses
import json

import bitsandbytes as bnb
import pytest
import torch
from torch import nn

import ficoco
from ficoco.accounting import architecture, parameter_counts
from ficoco.accounting.memory import make_quant, weight_bytes
from ficoco.errors import FicocoError
from ficoco.machine import compute_rate, memory_guard
from ficoco.machine.dtype_choice import DtypeChoice, choose_dtype
from ficoco.machine.memory_guard import (
    LIMIT_ENV,
    VanillaRow,
    check_memory,
    free_memory_bytes,
    memory_need_bytes,
    with_fp32_layers,
)
from ficoco.models import build as build_module
from ficoco.models import synthetic_inputs as family_inputs
from ficoco.models.inputs import synthetic_inputs
from ficoco.models.upcast import UpcastLinear, upcast_layers
from ficoco.profiles import load_profile
from ficoco.profiling.matrix import ProfileConfig, plan_run
from ficoco.profiling.trackers import model_weight_bytes

CPU = torch.device("cpu")
F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
GB = 1e9
# Measured matmul rates (FLOP/s) of the two kinds of CPU in the issue.
AVX2_RATES = {F32: 103e9, F16: 25e9, BF16: 20e9}
AMX_RATES = {BF16: 650e9, F16: 150e9, F32: 120e9}


@pytest.fixture
def rates(monkeypatch):
    """Serve `matmul_flops_per_s` from a table; returns the list of dtypes asked for."""
    asked: list[torch.dtype] = []
    table: dict[torch.dtype, float] = {}

    def fake(dtype: torch.dtype, device: torch.device | str = "cpu") -> float:
        asked.append(dtype)
        return table[dtype]

    monkeypatch.setattr(compute_rate, "matmul_flops_per_s", fake)

    def use(values: dict[torch.dtype, float]) -> list[torch.dtype]:
        table.clear()
        table.update(values)
        return asked

    return use


# ---- the decision -----------------------------------------------------------------------------------------------

def test_auto_on_an_avx2_cpu_computes_in_float32(rates):
    rates(AVX2_RATES)
    choice = choose_dtype("auto", CPU)
    assert (choice.storage, choice.compute, choice.upcast) == (F32, F32, False)
    assert choice.reason.startswith("auto: float32 is the fastest on this CPU")
    assert "float32 103" in choice.reason and "bfloat16 20" in choice.reason


def test_auto_on_an_amx_cpu_computes_in_bfloat16(rates):
    rates(AMX_RATES)
    choice = choose_dtype("auto", CPU, need_bytes_by_dtype={F32: 30 * GB, BF16: 15 * GB, F16: 15 * GB},
                          free_bytes=20 * GB)
    assert (choice.storage, choice.compute, choice.upcast) == (BF16, BF16, False)
    assert "bfloat16 is the fastest" in choice.reason


def test_auto_on_avx2_upcasts_bfloat16_weights_when_float32_does_not_fit(rates):
    rates(AVX2_RATES)
    choice = choose_dtype("auto", CPU, need_bytes_by_dtype={F32: 30 * GB, BF16: 15 * GB, F16: 15 * GB},
                          free_bytes=22 * GB, upcast_need_bytes=17 * GB)
    assert (choice.storage, choice.compute, choice.upcast) == (BF16, F32, True)
    assert "30.0 GB" in choice.reason and "22.0 GB free" in choice.reason and "upcast" in choice.reason


def test_auto_falls_back_to_the_fastest_16_bit_dtype_when_nothing_in_float32_fits(rates):
    rates(AVX2_RATES)
    choice = choose_dtype("auto", CPU, need_bytes_by_dtype={F32: 30 * GB, BF16: 15 * GB, F16: 15 * GB},
                          free_bytes=16 * GB, upcast_need_bytes=17 * GB)
    assert (choice.storage, choice.compute, choice.upcast) == (F16, F16, False)  # float16 25 > bfloat16 20
    assert "fastest 16-bit" in choice.reason


def test_upcasting_is_not_worth_it_when_float32_is_barely_faster(rates):
    rates({F32: 110e9, F16: 100e9, BF16: 90e9})
    choice = choose_dtype("auto", CPU, need_bytes_by_dtype={F32: 30 * GB, BF16: 15 * GB, F16: 15 * GB},
                          free_bytes=22 * GB, upcast_need_bytes=17 * GB)
    assert (choice.compute, choice.upcast) == (F16, False)


def test_a_bfloat16_checkpoint_is_never_computed_in_float16_by_auto(rates):
    asked = rates({F32: 10e9, F16: 900e9, BF16: 100e9})
    choice = choose_dtype("auto", CPU, native=BF16)
    assert choice.compute == BF16 and F16 not in asked
    assert "float16 left out" in choice.reason


def test_auto_on_cuda_is_float16_or_a_checkpoints_bfloat16_without_calibration(rates):
    asked = rates({})
    cuda = torch.device("cuda")
    assert choose_dtype("auto", cuda).compute == F16
    assert choose_dtype("auto", cuda, native=BF16).compute == BF16
    assert asked == []


@pytest.mark.parametrize(("requested", "dtype"), [("fp16", F16), ("bf16", BF16), ("fp32", F32), ("float16", F16)])
def test_an_explicit_dtype_is_honoured_on_cpu(rates, requested, dtype):
    asked = rates({})
    choice = choose_dtype(requested, CPU)
    assert (choice.storage, choice.compute) == (dtype, dtype)  # fp16 on CPU is fp16, not bf16
    assert choice.reason.startswith("requested") and asked == []


def test_explicit_fp32_that_does_not_fit_computes_in_fp32_on_upcast_weights():
    choice = choose_dtype("fp32", CPU, need_bytes_by_dtype={F32: 30 * GB, BF16: 15 * GB}, free_bytes=20 * GB,
                          upcast_need_bytes=17 * GB)
    assert (choice.storage, choice.compute, choice.upcast) == (BF16, F32, True)


def test_an_unknown_dtype_is_a_user_error():
    with pytest.raises(FicocoError, match="fp8"):
        choose_dtype("fp8", CPU)


# ---- what is free ---------------------------------------------------------------------------------------------

def test_the_limit_knob_caps_free_memory(monkeypatch):
    monkeypatch.delenv("FICOCO_TEST_FREE_MEMORY_BYTES", raising=False)
    monkeypatch.setenv(LIMIT_ENV, "123e6")
    assert free_memory_bytes("cpu") == 123e6
    monkeypatch.setenv(LIMIT_ENV, "lots")
    with pytest.raises(FicocoError, match=LIMIT_ENV):
        free_memory_bytes("cpu")


def test_free_memory_is_mem_available_without_a_limit(monkeypatch):
    monkeypatch.delenv("FICOCO_TEST_FREE_MEMORY_BYTES", raising=False)
    monkeypatch.delenv(LIMIT_ENV, raising=False)
    monkeypatch.setattr(memory_guard, "_cgroup_free_bytes", lambda: None)
    monkeypatch.setattr(memory_guard, "_mem_available_bytes", lambda: 7_000_000_000)
    assert free_memory_bytes("cpu") == 7e9


def test_a_cgroup_v2_limit_lowers_free_memory_by_its_working_set(tmp_path, monkeypatch):
    (tmp_path / "memory.max").write_text("10000000000\n")
    (tmp_path / "memory.current").write_text("4000000000\n")
    (tmp_path / "memory.stat").write_text("anon 3000000000\ninactive_file 1000000000\n")
    assert memory_guard._cgroup_free_bytes(str(tmp_path)) == 10_000_000_000 - 3_000_000_000
    (tmp_path / "memory.max").write_text("max\n")
    assert memory_guard._cgroup_free_bytes(str(tmp_path)) is None


def test_a_cgroup_v1_limit_is_read_too(tmp_path):
    folder = tmp_path / "memory"
    folder.mkdir()
    (folder / "memory.limit_in_bytes").write_text("8000000000\n")
    (folder / "memory.usage_in_bytes").write_text("2000000000\n")
    (folder / "memory.stat").write_text("total_inactive_file 500000000\n")
    assert memory_guard._cgroup_free_bytes(str(tmp_path)) == 8_000_000_000 - 1_500_000_000
    (folder / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # v1's "no limit"
    assert memory_guard._cgroup_free_bytes(str(tmp_path)) is None


def test_free_gpu_memory_comes_from_the_device(monkeypatch):
    monkeypatch.delenv(LIMIT_ENV, raising=False)
    monkeypatch.delenv("FICOCO_TEST_FREE_MEMORY_BYTES", raising=False)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (5_000_000_000, 80_000_000_000))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100")
    assert memory_guard.free_memory("cuda") == (5e9, "free on NVIDIA H100")


# ---- what a build needs ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def seven_b():
    return load_profile("llava-1.5-7b")


def test_the_need_is_the_accountants_weights_at_the_stored_width_plus_the_rest(seven_b):
    arch = architecture(seven_b)
    for dtype, width in ((BF16, 2), (F32, 4)):
        need = memory_need_bytes(seven_b, [VanillaRow()], DtypeChoice(dtype, dtype, ""), "fp16")
        assert need["weights"] == weight_bytes(arch, "all", make_quant("fp16"), element_bytes=width)
        assert need["total"] == pytest.approx(sum(need[k] for k in ("weights", "activations", "kv_cache", "margin")))
        assert need["margin"] >= memory_guard.MARGIN_BYTES
    fp32 = memory_need_bytes(seven_b, [VanillaRow()], DtypeChoice(F32, F32, ""), "fp16")
    bf16 = memory_need_bytes(seven_b, [VanillaRow()], DtypeChoice(BF16, BF16, ""), "fp16")
    assert fp32["kv_cache"] == 2 * bf16["kv_cache"]  # the cache is kept in the compute dtype
    assert fp32["weights"] > 28e9 > 15e9 > bf16["weights"]


def test_an_upcast_layout_needs_16_bit_linears_and_float32_for_the_rest(seven_b):
    arch = architecture(seven_b)
    counts = parameter_counts(arch)
    upcast = DtypeChoice(BF16, F32, "", upcast=True, fp32_layers=12)
    need = memory_need_bytes(seven_b, [VanillaRow()], upcast, "fp16")
    upcast_linears = counts.linear_decoder // arch.decoder.layers * (arch.decoder.layers - 12)
    assert need["weights"] == counts.total * 4 - upcast_linears * 2


def test_an_upcast_layout_copies_the_upcast_layers_linears_per_forward(seven_b):
    from ficoco.machine.memory_guard import upcast_weights_per_forward

    per_layer = 4 * 4096 * 4096 + 3 * 4096 * 11008
    ten_kept = DtypeChoice(BF16, F32, "", upcast=True, fp32_layers=10)
    assert upcast_weights_per_forward(seven_b, ten_kept) == 22 * per_layer
    assert upcast_weights_per_forward(seven_b, DtypeChoice(BF16, F32, "", upcast=True), "int8") == 0
    assert upcast_weights_per_forward(seven_b, DtypeChoice(F32, F32, "")) == 0


def test_the_fp32_layers_of_an_upcast_layout_fill_the_free_memory_but_a_spare_share(seven_b):
    rows = [VanillaRow()]
    choice = with_fp32_layers(seven_b, rows, DtypeChoice(BF16, F32, "x", upcast=True), 22 * GB)
    usable = 22 * GB * (1 - memory_guard.UPCAST_SPARE_FRACTION)
    assert 0 < choice.fp32_layers < 32
    assert memory_need_bytes(seven_b, rows, choice, "fp16")["total"] <= usable
    one_more = dataclasses.replace(choice, fp32_layers=choice.fp32_layers + 1)
    assert memory_need_bytes(seven_b, rows, one_more, "fp16")["total"] > usable
    assert f"the last {choice.fp32_layers} kept in float32" in choice.reason


def test_a_build_that_does_not_fit_names_alternatives_that_do(seven_b):
    rows = [VanillaRow()]
    dtype = DtypeChoice(BF16, BF16, "")
    free = 10 * GB
    with pytest.raises(FicocoError) as exc:
        check_memory(seven_b, rows, dtype, ["fp16"], CPU, free_bytes=free, free_source="test")
    message = str(exc.value)
    assert "\n" not in message
    assert message.startswith("llava-1.5-7b at quant=fp16 in bfloat16 needs ")
    assert "10.0 GB is free (test)" in message
    assert "quant=int8" in message and "quant=int4" in message and "a GPU with" in message
    layers = int(message.split("text_config.num_hidden_layers=")[1].split()[0])
    # The suggested depth fits and one more layer would not.
    for count, fits in ((layers, True), (layers + 1, False)):
        smaller = load_profile("llava-1.5-7b", [f"text_config.num_hidden_layers={count}"])
        assert (memory_need_bytes(smaller, rows, dtype, "fp16")["total"] <= free) is fits
    assert memory_need_bytes(seven_b, rows, dtype, "int8")["total"] <= free


def test_a_build_that_fits_passes_with_its_breakdown(seven_b):
    memory = check_memory(seven_b, [VanillaRow()], DtypeChoice(BF16, BF16, ""), ["fp16", "int4"], CPU,
                          free_bytes=100 * GB)
    assert memory["quant"] == "fp16" and memory["free"] == 100 * GB
    assert memory["total"] == memory_need_bytes(seven_b, [VanillaRow()], DtypeChoice(BF16, BF16, ""), "fp16")["total"]


# ---- builds ---------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def same_values_in_fp32():
    """llava-tiny with bfloat16 values, everything computed in float32: what an upcast build
    must compute exactly."""
    model = ficoco.build_model("llava-tiny", dtype="bf16").float()
    inputs = synthetic_inputs(model, batch=2)
    with torch.no_grad():
        return inputs, model(**inputs).logits


@pytest.mark.parametrize("fp32_layers", [0, 1, 4])
def test_an_upcast_build_computes_exactly_what_float32_weights_would(same_values_in_fp32, fp32_layers, arch_of):
    inputs, expected = same_values_in_fp32
    choice = DtypeChoice(BF16, F32, "test", upcast=True, fp32_layers=fp32_layers)
    model = ficoco.build_model("llava-tiny", dtype=choice)
    assert len({name.split(".layers.")[1].split(".")[0] for name in upcast_layers(model)}) == 4 - fp32_layers
    upcast_weights = {id(m.weight) for m in model.modules() if isinstance(m, UpcastLinear)}
    assert {p.dtype for p in model.parameters() if id(p) in upcast_weights} <= {BF16}
    assert {p.dtype for p in model.parameters() if id(p) not in upcast_weights} == {F32}
    with torch.no_grad():
        assert torch.equal(model(**inputs).logits, expected)
    arch = arch_of("llava-tiny")
    analytic = weight_bytes(arch, "all", make_quant("fp16"), element_bytes=4, upcast_layers=4 - fp32_layers)
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    assert model_weight_bytes(model) - buffers == analytic


@pytest.mark.parametrize(("profile", "variant", "keep"), [("llava-tiny", "pdrop", 32), ("llava-tiny", "vscan", 8)])
def test_a_method_that_applies_a_layers_weights_itself_runs_on_an_upcast_build_as_on_float32(profile, variant, keep):
    """PDrop, VScan and MustDrop (the same code as these two) recompute a decoder layer's last row with its own
    q and k projections: on an upcast build those weights are stored in 16 bits and multiplied in float32 (a
    LLaVA-1.5-7B profile on an AVX2 CPU failed with "expected m1 and m2 to have the same dtype" before)."""
    reference = ficoco.build_model(profile, dtype="bf16").float()
    upcast = ficoco.build_model(profile, dtype=DtypeChoice(BF16, F32, "test", upcast=True, fp32_layers=0))
    assert upcast_layers(upcast)
    inputs = family_inputs(reference, batch=1)
    logits = []
    with torch.no_grad():
        for model in (reference, upcast):
            with ficoco.apply(model, variant, keep=keep) as handle:
                logits.append(model(**inputs).logits)
                assert handle.records
    assert torch.equal(logits[0], logits[1])


def test_a_quantized_build_holds_one_unquantized_linear_at_a_time(monkeypatch):
    real_linears: list[int] = []
    original = bnb.functional.int8_vectorwise_quant
    building: list[nn.Module] = []
    original_materialize = build_module._materialize_

    def spy_materialize(model, *args, **kwargs):
        building.append(model)
        return original_materialize(model, *args, **kwargs)

    def spy(*args, **kwargs):
        model = building[0]
        real_linears.append(sum(type(m) is nn.Linear and m.weight.device.type != "meta" for m in model.modules()))
        return original(*args, **kwargs)

    monkeypatch.setattr(build_module, "_materialize_", spy_materialize)
    monkeypatch.setattr(bnb.functional, "int8_vectorwise_quant", spy)
    model = ficoco.build_model("llava-tiny", quant="int8", dtype="fp32")
    assert len(real_linears) > 10 and max(real_linears) == 1
    assert not any(p.device.type == "meta" for p in model.parameters())


def test_a_build_that_does_not_fit_is_refused_before_anything_is_built(monkeypatch):
    monkeypatch.setenv(LIMIT_ENV, "1e8")
    built: list[str] = []
    monkeypatch.setattr(build_module, "_materialize_", lambda *a, **k: built.append("x"))
    with pytest.raises(FicocoError, match="needs .* but 0.1 GB is free"):
        ficoco.build_model("llava-tiny", dtype="bf16")
    assert built == []


def test_build_model_records_its_dtype_choice():
    model = ficoco.build_model("llava-tiny", dtype="fp16")
    choice = model._ficoco_dtype
    assert (choice.storage, choice.compute, choice.reason) == (F16, F16, "requested (dtype=fp16)")
    assert {p.dtype for p in model.parameters()} == {F16}


# ---- the commands ---------------------------------------------------------------------------------------------

TINY_ARGS = ["profile", "--model", "llava-tiny", "--variant", "vanilla,v", "--keep", "8", "--warmup", "0",
             "--repeat", "1"]


def _tiny_needs() -> tuple[float, float]:
    """The memory the CLI's llava-tiny run needs in float32 and in the upcast layout."""
    plan = plan_run(ProfileConfig(model="llava-tiny", variants=("vanilla", "v"), keep=8, device="cpu",
                                  dtype="bf16"))
    needs = [memory_need_bytes(plan.profile, plan.rows, choice, "fp16", text_tokens=60)["total"]
             for choice in (DtypeChoice(F32, F32, ""), DtypeChoice(BF16, F32, "", upcast=True))]
    return needs[0], needs[1]


def test_profile_rows_name_their_storage_and_compute_dtypes_and_why(tmp_path, cli):
    path = tmp_path / "r.json"
    result = cli(*TINY_ARGS, "--dtype", "fp32", "--quant", "fp16,int4", "--json", str(path))
    assert result.code == 0, result.err
    report = json.loads(path.read_text())
    assert report["config"]["dtype"] == "fp32"
    for row in report["rows"]:
        backend = row["backend"]
        assert backend["compute_dtype"] == "float32"
        assert backend["dtype_reason"].startswith("requested (dtype=fp32)")
        assert backend["storage_dtype"] == ("float32" if row["quant"] == "fp16" else "NF4 linears, float32 rest")
        assert row["weight_bytes"] == pytest.approx(row["analytic"]["weight_bytes"], rel=0.005)
        assert row["kv_cache_bytes"] == row["analytic"]["kv_cache_bytes"]  # a float32 cache, as counted


def test_profile_upcasts_when_float32_does_not_fit_and_says_so(tmp_path, monkeypatch, cli):
    fp32_need, upcast_need = _tiny_needs()
    assert upcast_need < fp32_need
    monkeypatch.setenv(LIMIT_ENV, str((fp32_need + upcast_need) / 2))
    path = tmp_path / "r.json"
    result = cli(*TINY_ARGS, "--dtype", "fp32", "--device", "cpu", "--json", str(path))
    assert result.code == 0, result.err
    for row in json.loads(path.read_text())["rows"]:
        backend = row["backend"]
        assert backend["storage_dtype"] == "bfloat16 (upcast linears), float32 rest"
        assert backend["compute_dtype"] == "float32"
        assert "upcast to float32 layer by layer" in backend["dtype_reason"]
        assert backend["upcast_layers"] >= 1
        assert backend["upcast_ms_per_forward"] > 0  # measured at build, the same for every row
        assert row["weight_bytes"] == pytest.approx(row["analytic"]["weight_bytes"], rel=0.005)
    assert "computed in float32, weights stored as bfloat16 (upcast linears)" in result.out + result.err


def test_profile_auto_names_the_measured_rates(tmp_path, rates, cli):
    rates(AVX2_RATES)
    path = tmp_path / "r.json"
    result = cli(*TINY_ARGS, "--json", str(path))
    assert result.code == 0, result.err
    for row in json.loads(path.read_text())["rows"]:
        assert row["backend"]["compute_dtype"] == "float32"
        assert row["backend"]["dtype_reason"].startswith("auto: float32 is the fastest on this CPU")


def test_the_guard_ends_an_in_process_run_with_one_error_line_and_exit_2(monkeypatch, tmp_path, cli):
    monkeypatch.setenv(LIMIT_ENV, "1e8")
    path = tmp_path / "r.json"
    result = cli(*TINY_ARGS, "--json", str(path))
    assert result.code == 2
    lines = [line for line in result.err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: llava-tiny at --quant fp16 in ")
    assert "0.1 GB is free (FICOCO_MEMORY_LIMIT_BYTES)" in lines[0]
    assert not path.exists()


def test_the_guard_in_a_real_process_names_what_fits(cli):
    # A cap well under what a shared machine has free, so the advice does not depend on it:
    # no quant of the 13B model fits in 6 GB, fewer layers do.
    result = cli("profile", "--model", "llava-1.5-13b", "--variant", "v", "--keep", "64", "--dtype", "fp16",
                 in_subprocess=True, env={LIMIT_ENV: "6e9"})
    assert result.code == 2
    lines = [line for line in result.err.splitlines() if line.strip()]
    assert len(lines) == 1, result.err
    line = lines[0]
    assert line.startswith("error: llava-1.5-13b at --quant fp16 in float16 needs ")
    assert "--quant" not in line.split("what fits:")[1]
    assert "--set text_config.num_hidden_layers=" in line and line.endswith("or a GPU with 29.2 GB free")
    assert "Traceback" not in result.out + result.err


def test_flops_verify_takes_a_dtype_and_refuses_what_does_not_fit(tmp_path, monkeypatch, cli):
    path = tmp_path / "v.json"
    result = cli("flops", "--verify", "--model", "llava-tiny", "--dtype", "fp16", "--json", str(path))
    assert result.code == 0, result.err
    report = json.loads(path.read_text())
    assert (report["dtype"], report["storage_dtype"], report["dtype_reason"]) == (
        "float16", "float16", "requested (dtype=fp16)")
    monkeypatch.setenv(LIMIT_ENV, "1e8")
    with pytest.raises(FicocoError) as raised:
        cli("flops", "--verify", "--model", "llava-tiny", standalone=False)
    message = str(raised.value)
    assert message.startswith("llava-tiny in ") and "0.1 GB is free" in message
    assert "quant=" not in message and "GPU" not in message  # --verify takes neither: not offered


def test_dtype_without_verify_is_refused(cli):
    with pytest.raises(FicocoError) as raised:
        cli("flops", "--model", "llava-tiny", "--dtype", "fp32", standalone=False)
    assert "--verify" in str(raised.value)


def test_compare_tells_upcast_layouts_apart_and_keeps_plain_rows_keys():
    from ficoco.report.compare import fingerprint

    def row(backend):
        return {"model": "llava-1.5-7b", "variant": "v", "quant": "fp16", "batch": 1, "backend": backend}

    plain = row({"compute_dtype": "float32", "storage_dtype": "float32"})
    old_report = row({"compute_dtype": "float32"})
    upcast = [row({"compute_dtype": "float32", "storage_dtype": "bfloat16 (upcast linears), float32 rest",
                   "upcast_layers": n}) for n in (24, 20)]
    assert fingerprint(plain) == fingerprint(old_report)
    assert len({fingerprint(plain), *map(fingerprint, upcast)}) == 3


def test_a_vm_whose_balloon_reports_free_pages_pays_the_hosts_first_touch(tmp_path, monkeypatch):
    from ficoco.machine import fresh_memory

    device = tmp_path / "virtio0"
    device.mkdir()
    # virtio feature bits as sysfs prints them, bit 0 first: bit 5 is VIRTIO_BALLOON_F_REPORTING.
    (device / "features").write_text("0110010100000000\n")
    pattern = str(tmp_path / "virtio*" / "features")
    assert fresh_memory.host_reclaims_free_memory(pattern)
    (device / "features").write_text("0110000100000000\n")  # a balloon without free page reporting
    assert not fresh_memory.host_reclaims_free_memory(pattern)
    assert not fresh_memory.host_reclaims_free_memory(str(tmp_path / "none*" / "features"))  # no balloon: bare metal
    monkeypatch.setattr(fresh_memory, "host_reclaims_free_memory", lambda: True)
    assert fresh_memory.host_first_touch_s_per_byte() == fresh_memory.HOST_FIRST_TOUCH_S_PER_BYTE > 0
    monkeypatch.setattr(fresh_memory, "host_reclaims_free_memory", lambda: False)
    assert fresh_memory.host_first_touch_s_per_byte() == 0
