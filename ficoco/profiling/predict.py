"""The prefill time a row should take on this machine, from the accountant's ops at rates measured
here for the row's own shapes: the honest yardstick of a measured speedup.

A FLOPs ratio says how much less work a reduced row does; it does not say how much less time that
work takes, because a matmul of few tokens runs at a lower rate than one of many (on a 2-core AVX2
EPYC, float32 [4096 x 4096] at 16 tokens: 57 GFLOP/s, at 636: 163), a row of few tokens reads the
same weights, and an upcast layout converts the same weights whatever the tokens. So:

    prefill_s = sum over the accountant's ops (ficoco.accounting.flops.model_ops) of
                  linear (q/k/v/o, MLP, projector, patch embedding, LM head):
                      max(FLOPs / matmul rate measured at its (tokens, in, out), weight and
                          activation bytes / memory bandwidth)
                  attention (qk, sv of a layer): its FLOPs / the rate of this machine's SDPA
                      (causal in the decoder) measured at its heads, tokens and head width
                  elementwise (norms, activations, adds): bytes / memory bandwidth
              + upcast: the bytes an upcast layout converts per forward / the measured convert rate
              + the method's own work (the accountant's method terms) at the matmul rate of a
                similarity matrix of its tokens, and FiCoCo's probe passes over its attention scores
              + dispatch: small ops per forward and per layer at the measured small-op time

Every rate is measured once per process, dtype, device and thread count (`MeasuredRates`); no
model is built. A test gives `TableRates` instead, whose fixed rates make the time exact.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from ficoco.accounting import CountOptions, Schedule, account, architecture
from ficoco.accounting.architecture import Architecture
from ficoco.accounting.flops import Op, model_ops
from ficoco.accounting.memory import QUANT_BITS, Quant
from ficoco.accounting.schedule import plan_tokens
from ficoco.machine.compute_rate import copy_bytes_per_s, small_op_s, synchronize

# bitsandbytes on CPU computes INT8 through float16 and dequantizes NF4 weights on every call: its
# matmuls run at these shares of the compute dtype's measured rate (estimate.MATMUL_EFFICIENCY's
# ratios to fp16, fitted on an AMX Xeon with 2 decoder layers; not refitted for this prediction).
QUANT_MATMUL_SHARE = {"fp16": 1.0, "int8": 0.4, "int4": 0.12}
# A first call shorter than this is a warm-up only (kernel choice and allocation weigh in it).
_REPEAT_BELOW_S = 0.05


class ShapeRates(Protocol):
    """The speeds a prediction needs: matmul and attention FLOP/s at a shape, memory bandwidth
    (bytes moved, read and written, per second), the convert rate of an upcast layout (bytes of
    the compute dtype written per second), the time of one small op."""

    dtype: str
    bandwidth_bytes_per_s: float
    convert_bytes_per_s: float
    small_op_s: float

    def linear_flops_per_s(self, tokens: int, inner: int, outer: int) -> float: ...

    def attention_flops_per_s(self, heads: int, tokens: int, head_dim: int, causal: bool) -> float: ...


@dataclass(frozen=True)
class TableRates:
    """Rates given, not measured: FLOP/s by token count (the nearest count given wins, ties to
    the smaller), the same table for matmuls and attention unless `attention_by_tokens` is given."""

    dtype: str
    flops_per_s_by_tokens: dict[int, float]
    bandwidth_bytes_per_s: float
    convert_bytes_per_s: float = 1.0
    small_op_s: float = 0.0
    attention_by_tokens: dict[int, float] | None = None

    @staticmethod
    def _nearest(table: dict[int, float], tokens: int) -> float:
        return table[min(table, key=lambda m: (abs(m - tokens), m))]

    def linear_flops_per_s(self, tokens: int, inner: int, outer: int) -> float:
        """The table's rate at the count nearest `tokens` (any width)."""
        return self._nearest(self.flops_per_s_by_tokens, tokens)

    def attention_flops_per_s(self, heads: int, tokens: int, head_dim: int, causal: bool) -> float:
        """The attention table's rate (else the matmul table's) at the count nearest `tokens`."""
        return self._nearest(self.attention_by_tokens or self.flops_per_s_by_tokens, tokens)


def _time_s(call: Any, device: torch.device) -> float:
    """The best of 3 calls (a short call after a warm-up call): on a machine shared with other
    processes, one call of a third of a second can meet another's burst and read half the rate,
    where a prefill of many seconds averages such bursts out."""
    times: list[float] = []
    first = True
    while len(times) < 3:
        synchronize(device)
        begin = time.perf_counter()
        call()
        synchronize(device)
        seconds = time.perf_counter() - begin
        # The first call chooses kernels and allocates: it counts only when it is long enough
        # that neither weighs in it.
        if not first or seconds >= _REPEAT_BELOW_S:
            times.append(seconds)
        first = False
    return min(times)


@functools.cache
def _linear_flops_per_s(dtype: torch.dtype, device_type: str, threads: int, tokens: int, inner: int,
                        outer: int) -> float:
    device = torch.device(device_type)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, inner, generator=generator).to(device=device, dtype=dtype)
    # nn.Linear's layout: the weight is (out, in), multiplied transposed.
    w = torch.randn(outer, inner, generator=generator).to(device=device, dtype=dtype)
    with torch.inference_mode():
        seconds = _time_s(lambda: torch.nn.functional.linear(x, w), device)
    return 2 * tokens * inner * outer / seconds


@functools.cache
def _attention_flops_per_s(dtype: torch.dtype, device_type: str, threads: int, heads: int, tokens: int,
                           head_dim: int, causal: bool) -> float:
    device = torch.device(device_type)
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, heads, tokens, head_dim, generator=generator).to(device=device, dtype=dtype)
               for _ in range(3))
    with torch.inference_mode():
        seconds = _time_s(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal),
                          device)
    # The accountant's count: scores and weighted values over the full square, causal or not.
    return 4 * heads * tokens * tokens * head_dim / seconds


@functools.cache
def _convert_bytes_per_s(storage: torch.dtype, compute: torch.dtype, device_type: str, threads: int,
                         numel: int) -> float:
    device = torch.device(device_type)
    source = torch.ones(numel, dtype=storage, device=device)
    target = torch.empty(numel, dtype=compute, device=device)
    seconds = _time_s(lambda: target.copy_(source), device)
    return numel * target.element_size() / seconds


@dataclass(frozen=True)
class MeasuredRates:
    """This machine's rates in `dtype` on `device`, each measured when first asked for (cached per
    process and thread count): a 7B row's shapes take a few seconds, a tiny model's well under one."""

    dtype: str
    device: str = "cpu"
    threads: int = field(default_factory=torch.get_num_threads)

    @property
    def _torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @functools.cached_property
    def bandwidth_bytes_per_s(self) -> float:
        """Bytes moved (read and written) per second: a copy's rate counts each byte twice."""
        return 2 * copy_bytes_per_s(self.device, self.threads)

    @functools.cached_property
    def small_op_s(self) -> float:
        """The time of one small op (estimate.py's probe: dispatch and Python)."""
        return small_op_s(self._torch_dtype, self.device)

    @property
    def convert_bytes_per_s(self) -> float:
        """bfloat16 to the compute dtype, written bytes per second, on a 7B MLP weight's size."""
        return self.convert_rate(torch.bfloat16, 4096 * 11008)

    def convert_rate(self, storage: torch.dtype, numel: int) -> float:
        """`storage` to the compute dtype over `numel` values: written bytes per second."""
        return _convert_bytes_per_s(storage, self._torch_dtype, self.device, self.threads, numel)

    def linear_flops_per_s(self, tokens: int, inner: int, outer: int) -> float:
        """FLOP/s of a linear layer of `inner` -> `outer` features on `tokens` rows, measured."""
        return _linear_flops_per_s(self._torch_dtype, self.device, self.threads, tokens, inner, outer)

    def attention_flops_per_s(self, heads: int, tokens: int, head_dim: int, causal: bool) -> float:
        """FLOP/s (the accountant's full-square count) of SDPA over one sequence, measured."""
        return _attention_flops_per_s(self._torch_dtype, self.device, self.threads, heads, tokens, head_dim, causal)

    def to_json(self) -> dict[str, Any]:
        return {"dtype": self.dtype, "device": self.device, "threads": self.threads,
                "bandwidth_bytes_per_s": self.bandwidth_bytes_per_s, "small_op_s": self.small_op_s}


# Small ops dispatched per forward, per layer and per reducing layer, and FiCoCo's probe passes
# (float32 passes over every attention score of a reducing layer): estimate.py's CALIBRATION.
FORWARD_OPS = {"fp16": 340.0, "int8": 1600.0, "int4": 760.0}
LAYER_OPS = {"fp16": 61.0, "int8": 155.0, "int4": 62.0}
REDUCING_LAYER_OPS = 150.0
PROBE_PASSES = 8.0


def probe_scores(arch: Architecture, schedule: Schedule, text_tokens: int, batch: int) -> int:
    """Attention scores (heads x tokens^2 per sequence) that FiCoCo's probe computes in a prefill:
    one set per reducing layer, at the tokens entering it."""
    tokens = plan_tokens(arch, schedule, text_tokens=text_tokens)
    scores = 0
    for removal in schedule.removals:
        if removal.stage == "vision":
            entering = tokens.vision[removal.layer][0]
            scores += tokens.vision_items * arch.vision.heads * entering**2
        else:
            entering = tokens.llm[removal.layer][0]
            scores += arch.decoder.heads * entering**2
    return batch * scores


def dispatch_s(layers: int, reducing_layers: int, quant: str, rates: Any) -> float:
    """The dispatch cost of one forward: small ops per forward, per layer, per reducing layer."""
    ops = (FORWARD_OPS.get(quant, FORWARD_OPS["fp16"]) + LAYER_OPS.get(quant, LAYER_OPS["fp16"]) * layers
           + REDUCING_LAYER_OPS * reducing_layers)
    return ops * rates.small_op_s


@dataclass
class Prediction:
    """One prefill's predicted time and its parts (seconds)."""

    total_s: float
    parts_s: dict[str, float]

    def to_json(self) -> dict[str, Any]:
        return {"prefill_ms": self.total_s * 1e3, **{f"{k}_ms": v * 1e3 for k, v in self.parts_s.items()},
                "method": "the accountant's ops at this machine's rates for their shapes (profiling/predict.py)"}


def _linear_shape(arch: Architecture, op: Op) -> tuple[int, int, int]:
    """(tokens, in, out) of a linear op, read back from its record (flops._linear's counts)."""
    tokens = op.macs // op.weight_elems
    inner = arch.decoder.hidden if op.name == "lm_head" else op.act_load // tokens
    return tokens, inner, op.weight_elems // inner


def _op_bytes(op: Op, weight_bytes: float, act_bytes: float) -> float:
    return op.weight_elems * weight_bytes + (op.act_load + op.act_store + op.kv_load + op.kv_store) * act_bytes


def predict_prefill(arch: Architecture, schedule: Schedule, rates: ShapeRates, *, quant: str = "fp16",
                    batch: int = 1, text_tokens: int | None = None, compute_bits: int = 16,
                    upcast_layers: int = 0) -> Prediction:
    """One prefill of `schedule` on `arch` at `rates` (the LM head on the last token, as the
    profile's prefill computes it). `upcast_layers`: the first decoder layers whose linear weights
    are stored in 16 bits and converted to the compute dtype at every forward."""
    quant_spec = Quant(quant, QUANT_BITS[quant], compute_bits, compute_bits)
    opts = CountOptions(convention="flops", scope="all", batch=batch, text_tokens=text_tokens,
                        lm_head_tokens="last")
    cost = account(arch, schedule, quant_spec, opts)
    plan = cost.plan
    ops = model_ops(arch, plan, batch=batch, lm_head_tokens="last")
    act_bytes = compute_bits / 8
    parts = dict.fromkeys(("linear", "attention", "memory", "upcast", "method", "probe", "dispatch"), 0.0)
    share = QUANT_MATMUL_SHARE.get(quant, 1.0)
    upcast_elems = 0
    for op in ops:
        memory_s = _op_bytes(op, act_bytes, act_bytes) / rates.bandwidth_bytes_per_s
        if op.macs and op.weight_elems:
            tokens, inner, outer = _linear_shape(arch, op)
            compute_s = 2 * op.macs / (rates.linear_flops_per_s(tokens, inner, outer) * share)
            parts["linear"] += max(compute_s, memory_s)
            if op.stage == "llm" and op.layer is not None and op.layer < upcast_layers:
                upcast_elems += op.weight_elems
        elif op.name == "qk" and op.macs:
            # The layer's SDPA call, priced as one: scores, softmax and weighted values (sv, softmax skipped).
            vision = op.stage == "vision"
            heads = arch.vision.heads if vision else arch.decoder.heads
            head_dim = arch.vision.hidden // heads if vision else arch.decoder.head_dim
            tokens = (plan.vision if vision else plan.llm)[op.layer][0]
            rate = rates.attention_flops_per_s(heads, tokens, head_dim, causal=not vision)
            parts["attention"] += 4 * op.macs / rate  # qk and sv: 2 FLOPs per MAC each
        elif op.name in ("qk", "sv", "softmax"):
            continue
        else:
            parts["memory"] += memory_s
    if upcast_layers:
        parts["upcast"] = upcast_elems * act_bytes / rates.convert_bytes_per_s
    method_flops = cost.method_tflops * 1e12
    if method_flops:
        # The method's similarity and scoring matrices: a (tokens x hidden) by (hidden x tokens) product.
        tokens = max(plan.llm_visual_tokens, 1)
        parts["method"] = method_flops / rates.linear_flops_per_s(tokens, arch.decoder.hidden, tokens)
    # float32 passes over the reducing layers' scores, each a read and a write (estimate.py's term).
    scores = probe_scores(arch, schedule, text_tokens, batch)  # type: ignore[arg-type]
    parts["probe"] = PROBE_PASSES * 4 * scores * 2 / rates.bandwidth_bytes_per_s
    layers = arch.vision.layers + arch.decoder.layers
    parts["dispatch"] = dispatch_s(layers, len(schedule.removals), quant, rates)  # type: ignore[arg-type]
    return Prediction(sum(parts.values()), parts)


def row_prediction(profile: Any, schedule: Schedule, *, quant: str, batch: int, text_tokens: int | None,
                   dtype: Any, device: torch.device | str = "cpu", rates: ShapeRates | None = None) -> Prediction:
    """A profile row's predicted prefill: `dtype` is the plan's DtypeChoice (or a torch dtype), its
    compute dtype's rates measured on `device` unless `rates` is given."""
    arch = architecture(profile)
    compute = getattr(dtype, "compute", dtype)
    upcast = 0
    if getattr(dtype, "upcast", False) and quant == "fp16":
        upcast = arch.decoder.layers - min(dtype.fp32_layers, arch.decoder.layers)
    rates = rates or MeasuredRates(str(compute).removeprefix("torch."), torch.device(device).type)
    return predict_prefill(arch, schedule, rates, quant=quant, batch=batch, text_tokens=text_tokens,
                           compute_bits=torch.finfo(compute).bits, upcast_layers=upcast)
