"""How long `ficoco profile` will take, said before any model is built, and the time left as
it runs.

One prefill is predicted from the accountant's ops and token counts and three rates measured
on this machine (cached per process; well under a second):

    prefill_s = roofline(ops; peak = matmul_flops_per_s * MATMUL_EFFICIENCY[quant],
                              bandwidth = copy_bytes_per_s * BANDWIDTH_EFFICIENCY)
                + small_op_s * (FORWARD_OPS[quant] + LAYER_OPS[quant] * layers + REDUCING_LAYER_OPS * reducing layers)
                + the method's own probe: the bytes its float32 passes over the attention rows its spec
                  reads move (predict.method_probes) / copy_bytes_per_s

The roofline is the accountant's (docs/accounting.md: every op takes max(ops / peak, bytes /
bandwidth)) with this machine's measured figures in place of a GPU's: `matmul_flops_per_s` is
compute_rate's matmul throughput in the compute dtype, `copy_bytes_per_s` a memory copy's. A
prefill of many tokens is bound by its FLOPs; one of few tokens (FiCoCo-V's decoder) by reading
the weights. `small_op_s` is the measured time of one small op: a tiny model's prefill is all
dispatch and Python, counted in small ops per layer. A method's probe is priced from its
spec: FastV's one row, FiCoCo's whole layers in float32 (heads x tokens^2), none for DART.
A row adds a fixed cost (inputs, patching, garbage collection), its first run's extra dispatch
and its rate probe's passes (predict.MeasuredRates: every shape the prediction prices, timed
2 x (PASSES + 1) + repeat times); a generation adds a decode step per new token. A build
(`predict_build_s`) writes every weight into new memory as a fresh process does: the bytes it
fills (and an upcast layout converts) at the measured fill rate of new memory, the bytes that
stay at the host's first-touch cost on a VM that hands free memory back to its host
(ficoco.machine.fresh_memory), and bitsandbytes' quantization. The constants are CALIBRATION's.
"""

from __future__ import annotations

import statistics
import sys
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from ficoco.accounting import architecture
from ficoco.accounting.memory import QUANT_BITS, Quant, weight_bytes
from ficoco.machine.compute_rate import copy_bytes_per_s, matmul_flops_per_s, small_op_s
from ficoco.machine.fresh_memory import fill_bytes_per_s, host_first_touch_s_per_byte
from ficoco.profiles import Hardware
from ficoco.profiling.matrix import Plan, ProfileConfig, analytic, compute_dtype
from ficoco.profiling.predict import dispatch_s, probe_bytes, rate_probe_passes, rate_probe_shapes
from ficoco.profiling.runs import choose_runs, rule_text

CALIBRATION = ("fitted on a 2-core Xeon with AMX, bf16, 2 threads, torch 2.13, at moments when no other process "
               "used the CPU: the dispatch constants by least squares over llava-tiny prefills (vanilla, v, l at "
               "fp16, int8, int4, with 4 or 8 decoder and 6 or 12 vision layers: 27 rows, each within 21 %); the "
               "efficiencies on llava-1.5-7b with 2 and 8 decoder layers and the whole model (vanilla and v); "
               "the row cost on the tiny CLI run; a method's probe bytes counted from its tensor code, not fitted; "
               "a build's fill rate measured per run, the host's first-touch cost on llava-1.5-7b's bf16 build in "
               "fresh processes on a firecracker VM (ficoco/machine/fresh_memory.py); not calibrated on a GPU")
# Shares of the measured matmul and copy rates that a prefill's ops reach: with these the roofline
# is within 16 % of llava-1.5-7b's measured prefill with 2, 8 and 32 decoder layers, vanilla and v.
# bitsandbytes on CPU computes INT8 through float16 and dequantizes NF4 weights on every call:
# its efficiencies were measured with 2 decoder layers only.
MATMUL_EFFICIENCY = {"fp16": 0.75, "int8": 0.3, "int4": 0.09}
BANDWIDTH_EFFICIENCY = 0.9
# Small ops per forward, per layer (vision and decoder) and per reducing layer (FiCoCo's stages
# and its probe): the dispatch cost of a forward. bitsandbytes layers add Python of their own.
FIRST_RUN_DISPATCH = 1.5  # a row's first run adds this many times its dispatch cost (kernel and shape setup)
DECODE_STEP_OPS = 200.0  # generate's own work per new token (logits processing, cache update)
ROW_OVERHEAD_S = 0.3  # per row outside its runs: inputs, patching, garbage collection before and after
QUANTIZE_PASSES = {"fp16": 0.0, "int8": 39.0, "int4": 74.0}  # bitsandbytes' quantization, in copies of the weights
BUILD_OVERHEAD_S = 0.25  # per build: constructing the modules
IMPORT_S = 1.8  # the first build imports the model code (transformers, once per process)
BITSANDBYTES_IMPORT_S = 0.6


# ---- rates measured on this machine ----------------------------------------------------------------------------

@dataclass(frozen=True)
class Rates:
    """This machine's measured speeds, the inputs of every estimate."""

    device: str
    dtype: str
    matmul_flops_per_s: float
    small_op_s: float
    copy_bytes_per_s: float
    threads: int
    # Bytes per second a build writes into new memory (ficoco.machine.fresh_memory.fill_bytes_per_s),
    # and the host's share of a first touch, seconds per byte (0 off a VM that reclaims free memory).
    fill_bytes_per_s: float = 0.0
    host_touch_s_per_byte: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def measure_rates(dtype: torch.dtype, device: torch.device) -> Rates:
    """Matmul throughput in `dtype`, the time of one small op and the memory copy rate (cached
    per process and thread count)."""
    threads = torch.get_num_threads()
    return Rates(device=device.type, dtype=str(dtype).removeprefix("torch."),
                 matmul_flops_per_s=matmul_flops_per_s(dtype, device),
                 small_op_s=small_op_s(dtype, device.type),
                 copy_bytes_per_s=copy_bytes_per_s(device.type, threads), threads=threads,
                 fill_bytes_per_s=fill_bytes_per_s(device.type),
                 host_touch_s_per_byte=host_first_touch_s_per_byte() if device.type == "cpu" else 0.0)


# ---- the model of a run's time ------------------------------------------------------------------------------------

def machine(rates: Rates, quant: str) -> Hardware:
    """This machine as the accountant's roofline sees a GPU: its measured rates, at the shares of
    them that a prefill reaches."""
    peak = rates.matmul_flops_per_s * MATMUL_EFFICIENCY.get(quant, MATMUL_EFFICIENCY["fp16"])
    return Hardware(key="measured", name=f"this {rates.device} as measured", memory_bytes=0,
                    bandwidth_bytes_per_s=rates.copy_bytes_per_s * BANDWIDTH_EFFICIENCY, fp16_ops_per_s=peak,
                    int8_ops_per_s=peak)


def predict_prefill_s(roofline_s: float, layers: int, reducing_layers: int, quant: str, rates: Rates,
                      probe_bytes: float = 0.0) -> float:
    """One prefill: the accountant's roofline time at this machine's rates (`machine`), the
    dispatch cost of its ops, and the method's probe moving `probe_bytes` (predict.probe_bytes)."""
    return roofline_s + dispatch_s(layers, reducing_layers, quant, rates) + probe_bytes / rates.copy_bytes_per_s


def rate_probe_s(flops_per_pass: float, bytes_per_pass: float, calls_per_pass: int, passes: int, quant: str,
                 rates: Rates) -> float:
    """A row's rate probe: `passes` passes, each of `flops_per_pass` at the prefill's matmul share,
    `bytes_per_pass` copied and `calls_per_pass` timed calls (a synchronise and a small op each)."""
    peak = rates.matmul_flops_per_s * MATMUL_EFFICIENCY.get(quant, MATMUL_EFFICIENCY["fp16"])
    one = flops_per_pass / peak + bytes_per_pass / rates.copy_bytes_per_s + calls_per_pass * rates.small_op_s
    return passes * one


def predict_decode_step_s(weight_bytes_read: float, decoder_layers: int, quant: str, rates: Rates) -> float:
    """One new token: every weight read once, the decoder's and generate's dispatch cost."""
    return (weight_bytes_read / rates.copy_bytes_per_s + dispatch_s(decoder_layers, 0, quant, rates)
            + DECODE_STEP_OPS * rates.small_op_s)


@dataclass(frozen=True)
class BuildBytes:
    """What a build with random weights writes (ficoco.models.build): `filled`, every weight written
    into new memory as it is materialised (and, in an upcast layout, written again in the compute
    dtype: the weights it converts); `resident`, what stays (the model in its final dtypes, with an
    upcast layout's scratch); `weights_16bit`, the model's weights in 16 bits (what bitsandbytes reads)."""

    filled: float
    resident: float
    weights_16bit: float


def build_bytes(arch: Any, quant: str, compute_bits: int, *, storage_bits: int | None = None,
                upcast_layers: int = 0) -> BuildBytes:
    """The bytes a build of `quant` computing in `compute_bits` writes and keeps. `storage_bits`: the
    dtype the weights are built in (the compute dtype's unless an upcast layout stores them in 16 bits);
    `upcast_layers`: the decoder layers whose linear weights stay in storage and are upcast per forward
    (the rest is converted to the compute dtype after the build)."""
    storage_bits = storage_bits or compute_bits
    sixteen = Quant("fp16", 16, 16, 16)
    weights_16bit = weight_bytes(arch, "all", sixteen)
    if quant != "fp16":
        # Materialised in the compute dtype one module at a time, quantized and the original freed: what
        # is filled is every weight once; what stays, the quantized model.
        filled = weight_bytes(arch, "all", sixteen, element_bytes=compute_bits / 8)
        resident = weight_bytes(arch, "all", Quant(quant, QUANT_BITS[quant], compute_bits, compute_bits),
                                element_bytes=compute_bits / 8)
        return BuildBytes(filled, resident, weights_16bit)
    built = weight_bytes(arch, "all", sixteen, element_bytes=storage_bits / 8)
    if storage_bits == compute_bits:
        return BuildBytes(built, built, weights_16bit)
    # An upcast layout: built in storage, then every weight not upcast converted to the compute dtype
    # (a new tensor each, the stored one freed), and one scratch buffer the size of the largest upcast weight.
    converted = weight_bytes(arch, "all", sixteen, element_bytes=compute_bits / 8, upcast_layers=upcast_layers,
                             upcast_element_bytes=0.0)
    d = arch.decoder
    scratch = max(d.hidden * d.ffn, d.hidden * d.heads * d.head_dim) * compute_bits / 8 if upcast_layers else 0.0
    resident = weight_bytes(arch, "all", sixteen, element_bytes=compute_bits / 8, upcast_layers=upcast_layers,
                            upcast_element_bytes=storage_bits / 8) + scratch
    return BuildBytes(built + converted + scratch, resident, weights_16bit)


def predict_build_s(size: BuildBytes, quant: str, rates: Rates, *, imports_s: float = 0.0) -> float:
    """A model with random weights, as a fresh process builds it: its modules constructed, every byte
    it fills written into new memory at the measured fill rate, every byte it keeps first touched at
    the host's cost (a VM that hands free memory back to its host; 0 elsewhere), bitsandbytes'
    quantization, and the model code's import when it is the first build of the process."""
    fill_rate = rates.fill_bytes_per_s or rates.copy_bytes_per_s
    quantize_s = QUANTIZE_PASSES.get(quant, 0.0) * size.weights_16bit / rates.copy_bytes_per_s
    return (imports_s + BUILD_OVERHEAD_S + size.filled / fill_rate + size.resident * rates.host_touch_s_per_byte
            + quantize_s)


def row_runs_s(prefill_s: float, runs: tuple[int, int], first_extra_s: float = 0.0, generation_s: float | None = None,
               generation_runs: tuple[int, int] = (0, 0)) -> float:
    """The runs of a row: (warm-up, timed) prefills, the first one `first_extra_s` slower, and with
    --new-tokens the (warm-up, timed) generations. A row without warm-up runs one more prefill, untimed,
    that records its attention kernels (profiling/kernels.py); a warm-up records them otherwise."""
    total = (sum(runs) + (runs[0] == 0)) * prefill_s + first_extra_s
    if generation_s is not None:
        total += sum(generation_runs) * generation_s
    return total


@dataclass
class RowEstimate:
    """One row's predicted times."""

    variant: str
    quant: str
    batch: int
    tflops: float
    prefill_s: float
    warmup: int
    repeat: int
    first_extra_s: float  # what the row's first run costs more than the others
    generation_s: float | None
    generation_runs: tuple[int, int]
    wall_s: float  # the row without its model's build: fixed cost, rate probe and runs
    rate_probe_s: float = 0.0  # its rate probe's passes (predict.MeasuredRates), in wall_s

    def to_json(self) -> dict[str, Any]:
        return {"prefill_ms": self.prefill_s * 1e3, "warmup": self.warmup, "repeat": self.repeat,
                "first_extra_ms": self.first_extra_s * 1e3, "rate_probe_s": self.rate_probe_s,
                "generation_ms": None if self.generation_s is None else self.generation_s * 1e3,
                "generation_runs": list(self.generation_runs) if self.generation_s is not None else None,
                "wall_s": self.wall_s, "method": "FLOPs at the measured matmul rate, dispatch at the measured "
                                                 "small-op time, the method's probe bytes at the measured copy rate"}


@dataclass
class RunEstimate:
    """The plan's predicted times: every row, every model build, the total."""

    rates: Rates
    dtype: str  # the compute dtype and why
    memory: str  # need vs free, or "-"
    rows: list[RowEstimate] = field(default_factory=list)
    build_s: dict[str, float] = field(default_factory=dict)  # per quant
    runs_rule: str = ""

    @property
    def total_s(self) -> float:
        return sum(self.build_s.values()) + sum(r.wall_s for r in self.rows)

    def to_json(self) -> dict[str, Any]:
        return {"total_s": self.total_s, "rows": len(self.rows), "build_s": self.build_s, "dtype": self.dtype,
                "memory": self.memory, "rates": self.rates.to_json(), "runs_rule": self.runs_rule,
                "calibration": CALIBRATION}


def memory_text(plan: Plan) -> str:
    """The plan's memory need against the free memory, "-" where the plan does not say."""
    memory = getattr(plan, "memory", None)
    if not isinstance(memory, dict):
        return "-"
    # The memory guard's breakdown (ficoco.machine.memory_guard.check_memory): "total" is the
    # need of the largest build, "free" what the device has.
    need, free = memory.get("total"), memory.get("free")
    if not isinstance(need, int | float):
        return "-"
    text = f"need {need / 1e9:.2f} GB"
    return text + (f" vs {free / 1e9:.2f} GB free" if isinstance(free, int | float) else "")


def estimate_run(config: ProfileConfig, plan: Plan, rates: Rates | None = None) -> RunEstimate:
    """Predicted time of every row and build of `plan` (nothing is built; the rates are measured
    unless given). Rows whose --warmup/--repeat are not given get the time rule's counts."""
    dtype, dtype_text = compute_dtype(plan, config)
    rates = rates or measure_rates(dtype, plan.device)
    arch = architecture(plan.profile)
    layers = arch.vision.layers + arch.decoder.layers
    estimate = RunEstimate(rates=rates, dtype=dtype_text, memory=memory_text(plan),
                           runs_rule="warmup=/repeat=" if plan.warmup is not None and plan.repeat is not None
                           else rule_text(plan.device.type))
    compute_bits = torch.finfo(dtype).bits
    choice = getattr(plan, "dtype", None)
    storage = getattr(choice, "storage", None)
    storage_bits = torch.finfo(storage).bits if isinstance(storage, torch.dtype) else compute_bits
    upcast = getattr(choice, "upcast", False)
    imports_s = 0.0 if "transformers.models.llava.modeling_llava" in sys.modules else IMPORT_S
    for quant in dict.fromkeys(r.quant for r in plan.rows):
        bitsandbytes_s = BITSANDBYTES_IMPORT_S if quant != "fp16" and "bitsandbytes" not in sys.modules else 0.0
        upcast_layers = choice.upcast_layers(arch.decoder.layers, quant) if upcast else 0
        size = build_bytes(arch, quant, compute_bits, storage_bits=storage_bits if upcast else compute_bits,
                           upcast_layers=upcast_layers)
        estimate.build_s[quant] = predict_build_s(size, quant, rates, imports_s=imports_s + bitsandbytes_s)
        imports_s = 0.0
    for row in plan.rows:
        cost = analytic(plan.profile, row, config, machine(rates, row.quant))
        reducing = len(row.schedule.removals)
        probe = probe_bytes(arch, row.schedule, config.text_tokens, row.batch, compute_bits / 8)
        prefill_s = predict_prefill_s(cost["roofline_ms"] / 1e3, layers, reducing, row.quant, rates, probe)
        first_extra_s = FIRST_RUN_DISPATCH * dispatch_s(layers, reducing, row.quant, rates)
        runs = choose_runs(prefill_s, plan.device.type, plan.warmup, plan.repeat)
        generation_s, generation_runs = None, (0, 0)
        if config.new_tokens:
            # Every new token reads the decoder's and the LM head's weights (the vision tower ran once).
            decoder_bytes = weight_bytes(arch, "llm", Quant(row.quant, QUANT_BITS[row.quant], 16, 16))
            step_s = predict_decode_step_s(decoder_bytes, arch.decoder.layers, row.quant, rates)
            generation_s = prefill_s + config.new_tokens * step_s
            generation_warmup, generation_repeat = choose_runs(generation_s, plan.device.type, plan.warmup,
                                                               plan.repeat)
            generation_runs = (min(generation_warmup, 1), generation_repeat)
        probe_s = 0.0
        if not config.device_map:  # a device map's rows are not predicted, so their rates are not probed
            upcast_layers = choice.upcast_layers(arch.decoder.layers, row.quant) if upcast else 0
            shapes = rate_probe_shapes(arch, row.schedule, quant=row.quant, batch=row.batch,
                                       text_tokens=config.text_tokens, compute_bits=compute_bits,
                                       upcast_layers=upcast_layers)
            probe_s = rate_probe_s(shapes.pass_flops(), shapes.pass_bytes(compute_bits), shapes.calls,
                                   rate_probe_passes(runs[1]), row.quant, rates)
        wall_s = ROW_OVERHEAD_S + probe_s + row_runs_s(prefill_s, runs, first_extra_s, generation_s, generation_runs)
        estimate.rows.append(RowEstimate(row.variant, row.quant, row.batch, cost["tflops"], prefill_s, *runs,
                                         first_extra_s, generation_s, generation_runs, wall_s, probe_s))
    return estimate


def plan_runs(plan: Plan, estimate: RunEstimate) -> None:
    """Give every row the counts the time rule chose from its estimate (its first measured run
    may still revise them)."""
    for spec, row in zip(plan.rows, estimate.rows, strict=True):
        spec.warmup, spec.repeat = row.warmup, row.repeat



# ---- the time left, as the run goes ---------------------------------------------------------------------------------

class Eta:
    """Time left: the plan's estimate, corrected by what has been measured so far.

    The caller reports steps (model builds, runs) as they start and end, as `run_profile`'s
    phases do. A row's remaining runs take the median of its own runs measured so far (its first,
    slower run left out); rows not started take their estimate scaled by measured / estimated over
    every run so far; builds likewise by the builds so far. No clock is read here: the caller
    passes durations."""

    def __init__(self, estimate: RunEstimate) -> None:
        self.rows = estimate.rows
        self.builds_left = dict(estimate.build_s)
        self.build_measured_s = self.build_estimated_s = 0.0
        self.run_measured_s = self.run_estimated_s = 0.0
        self.rows_done: set[int] = set()
        self.current: int | None = None
        self.finished_runs: dict[str, int] = {}  # the current row's finished runs by kind: prefill, generation
        self.measured: dict[str, list[float]] = {}  # their durations, the first prefill left out
        self.left: dict[str, int] = {}  # the current row's runs still to come (the one under way included)
        self.step_estimate_s = 0.0  # the step under way

    def _run_ratio(self) -> float:
        return self.run_measured_s / self.run_estimated_s if self.run_estimated_s > 0 else 1.0

    def _build_ratio(self) -> float:
        return self.build_measured_s / self.build_estimated_s if self.build_estimated_s > 0 else 1.0

    def _estimated_run_s(self, kind: str, first: bool) -> float:
        row = self.rows[self.current] if self.current is not None else None
        if row is None:
            return 0.0
        if kind == "prefill":
            return row.prefill_s + (row.first_extra_s if first else 0.0)
        return row.generation_s or 0.0

    def _run_s(self, kind: str, first: bool = False) -> float:
        """One more run of the current row: the median of its runs so far, else its estimate scaled."""
        if self.measured.get(kind) and not first:
            return statistics.median(self.measured[kind])
        return self._estimated_run_s(kind, first) * self._run_ratio()

    def _start_row(self, index: int) -> None:
        if self.current == index:
            return
        if self.current is not None:
            self.rows_done.add(self.current)
        row = self.rows[index]
        self.current, self.measured, self.finished_runs = index, {}, {}
        self.left = {"prefill": row.warmup + row.repeat, "generation": sum(row.generation_runs)}

    @staticmethod
    def _kind(step: str) -> str:
        return "generation" if step.startswith("generation") else "prefill"

    def started(self, row: int, step: str, k: int = 1, n: int = 1) -> None:
        """A step starts: a build (`step` "building the model"), or run k of n of a kind."""
        if step == "building the model":
            self.step_estimate_s = self.builds_left.get(self.rows[row].quant, 0.0) * self._build_ratio()
            return
        self._start_row(row)
        kind, estimate = self._kind(step), self.rows[row]
        # The runs left of this kind: this one and the rest of its phase, and after warm-ups the
        # timed runs as planned (their count is final once they start).
        timed_after = {"warm-up": estimate.repeat, "generation warm-up": estimate.generation_runs[1]}.get(step, 0)
        self.left[kind] = n - k + 1 + timed_after
        self.step_estimate_s = self._run_s(kind, first=not self.finished_runs.get(kind))

    def finished(self, row: int, step: str, seconds: float) -> None:
        """A step ended after `seconds`."""
        if step == "building the model":
            self.build_estimated_s += self.builds_left.pop(self.rows[row].quant, 0.0)
            self.build_measured_s += seconds
            return
        self._start_row(row)
        kind = self._kind(step)
        first = not self.finished_runs.get(kind)
        self.run_estimated_s += self._estimated_run_s(kind, first)
        self.run_measured_s += seconds
        if not (first and kind == "prefill"):
            self.measured.setdefault(kind, []).append(seconds)
        self.finished_runs[kind] = self.finished_runs.get(kind, 0) + 1
        self.left[kind] = max(0, self.left.get(kind, 0) - 1)
        self.step_estimate_s = 0.0

    def row_done(self, row: int) -> None:
        """A row has ended (measured or failed)."""
        self.rows_done.add(row)
        if self.current == row:
            self.current, self.measured, self.finished_runs, self.left = None, {}, {}, {}
        self.step_estimate_s = 0.0

    def remaining_s(self, step_elapsed_s: float = 0.0) -> float:
        """Seconds left; `step_elapsed_s`: how long the step under way has been running."""
        total = sum(self.builds_left.values()) * self._build_ratio()
        ratio = self._run_ratio()
        for index, row in enumerate(self.rows):
            if index not in self.rows_done and index != self.current:
                total += ROW_OVERHEAD_S + (row.wall_s - ROW_OVERHEAD_S) * ratio
        if self.current is not None:
            for kind, left in self.left.items():
                if left:
                    first = not self.finished_runs.get(kind)
                    total += self._run_s(kind, first) + (left - 1) * self._run_s(kind)
        # The step under way counts down, and no lower than nothing.
        return max(0.0, total - min(step_elapsed_s, self.step_estimate_s))
