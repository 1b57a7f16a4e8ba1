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
                  what a family runs beyond those (KERNELS: a sparse layer's experts, a Gated DeltaNet
                      layer's delta rule and convolution, a Qwen tower's patch Conv3d and per-image
                      attention, a decoder's norms and gated activation): its FLOPs or elements / the
                      rate of the call the model makes, timed at its shapes
                  elementwise (the other norms, activations, adds): bytes / memory bandwidth
              + upcast: the bytes an upcast layout converts per forward / the measured convert rate
              + the method's own work (the accountant's method terms) at the matmul rate of a
                similarity matrix of its tokens
              + the method's own probe: the float32 passes over the attention rows its spec's needs
                read (FastV's one row; none for a method that reads none), bytes / memory bandwidth
                (`method_probes`), and its reads of whole layers (FiCoCo's) at their rate timed here, or,
                where ficoco's fused pass computed the layer, that pass's time beyond the model's SDPA
              + dispatch: small ops per forward and per layer at the measured small-op time

Every rate a row needs is measured for that row (`MeasuredRates`: its shapes timed in round-robin
passes before its runs (dropped once its warm-up has run), between them and after them, at the mean time of
each), so that the prediction reads the machine over the same minutes as the measurement, and the row is priced
at each pass and predicted at their median, as its measured prefill is its runs' median; no model is built for
it. A test gives
`TableRates` instead, whose fixed rates make the time exact.
"""

from __future__ import annotations

import functools
import math
import statistics
import time
from collections import Counter
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from ficoco.accounting import CountOptions, Schedule, account, architecture
from ficoco.accounting.architecture import Architecture
from ficoco.accounting.flops import Op, model_ops
from ficoco.accounting.memory import QUANT_BITS, Quant
from ficoco.accounting.reads import Read, method_reads
from ficoco.accounting.schedule import plan_tokens
from ficoco.errors import FicocoError
from ficoco.machine.compute_rate import small_op_s, synchronize
from ficoco.methods.reads import DEFAULT_ATTENTION_SCORES

# bitsandbytes on CPU computes INT8 through float16 and dequantizes NF4 weights on every call: its
# matmuls run at these shares of the compute dtype's measured rate (estimate.MATMUL_EFFICIENCY's
# ratios to fp16, fitted on an AMX Xeon with 2 decoder layers; not refitted for this prediction).
QUANT_MATMUL_SHARE = {"fp16": 1.0, "int8": 0.4, "int4": 0.12}


class ShapeRates(Protocol):
    """The speeds a prediction needs: matmul and attention FLOP/s at a shape, the work per second of a
    family's own kernel at a key (`KERNELS`: what the model runs beyond nn.Linear and SDPA; work: the
    accountant's FLOPs of the op it computes, or an elementwise op's elements), memory bandwidth (bytes
    moved, read and written, per second), the convert rate of an upcast layout (bytes of the compute dtype
    written per second), the time of one small op."""

    dtype: str
    bandwidth_bytes_per_s: float
    convert_bytes_per_s: float
    small_op_s: float

    def measure(self, linear: Any = (), attention: Any = (), convert: bool = False,
                kernels: Mapping[Key, float] | None = None, reads: Any = ()) -> None: ...

    def linear_flops_per_s(self, tokens: int, inner: int, outer: int) -> float: ...

    def attention_flops_per_s(self, heads: int, tokens: int, head_dim: int, causal: bool) -> float: ...

    def read_scores_per_s(self, kind: str, heads: int, kv_heads: int, head_dim: int, rows: int, keys: int,
                          causal: bool, rule: str) -> float: ...

    def kernel_work_per_s(self, key: Key) -> float: ...

    def kernel_available(self, key: Key) -> bool: ...


@dataclass(frozen=True)
class TableRates:
    """Rates given, not measured: FLOP/s by token count (the nearest count given wins, ties to
    the smaller), the same table for matmuls, attention and kernels (work per second) unless
    `attention_by_tokens` or `kernels_by_tokens` (by kernel kind, "grouped_mm", "delta_rule", ...:
    `KERNELS`; by the key's token or row count) is given."""

    dtype: str
    flops_per_s_by_tokens: dict[int, float]
    bandwidth_bytes_per_s: float
    convert_bytes_per_s: float = 1.0
    small_op_s: float = 0.0
    attention_by_tokens: dict[int, float] | None = None
    kernels_by_tokens: dict[str, dict[int, float]] | None = None
    # Scores per second of a method's attention reads by key count; None: their score products at the matmul
    # table's rate (a read priced as its q . k^T FLOPs).
    reads_by_tokens: dict[int, float] | None = None

    def measure(self, linear: Any = (), attention: Any = (), convert: bool = False,
                kernels: Mapping[Key, float] | None = None, reads: Any = ()) -> None:
        """Nothing to measure: the rates are given."""

    @staticmethod
    def _nearest(table: dict[int, float], tokens: int) -> float:
        return table[min(table, key=lambda m: (abs(m - tokens), m))]

    def linear_flops_per_s(self, tokens: int, inner: int, outer: int) -> float:
        """The table's rate at the count nearest `tokens` (any width)."""
        return self._nearest(self.flops_per_s_by_tokens, tokens)

    def attention_flops_per_s(self, heads: int, tokens: int, head_dim: int, causal: bool) -> float:
        """The attention table's rate (else the matmul table's) at the count nearest `tokens`."""
        return self._nearest(self.attention_by_tokens or self.flops_per_s_by_tokens, tokens)

    def read_scores_per_s(self, kind: str, heads: int, kv_heads: int, head_dim: int, rows: int, keys: int,
                          causal: bool, rule: str) -> float:
        """The reads table's rate at the key count nearest `keys`, else the matmul table's FLOP/s over a
        score's 2 x head width FLOPs."""
        if self.reads_by_tokens is not None:
            return self._nearest(self.reads_by_tokens, keys)
        return self._nearest(self.flops_per_s_by_tokens, keys) / (2 * head_dim)

    def kernel_work_per_s(self, key: Key) -> float:
        """The kind's table (else the matmul table) at the count nearest the key's token count."""
        table = (self.kernels_by_tokens or {}).get(key[0], self.flops_per_s_by_tokens)
        return self._nearest(table, key[1])

    def kernel_available(self, key: Key) -> bool:
        """Every kernel has a rate here."""
        return True


# The rate probe's copies: 64 MiB of bfloat16 for the memory bandwidth, and for an upcast layout's
# convert rate a 7B MLP weight (4096 x 11008) read in bfloat16 and written in the compute dtype.
BANDWIDTH_VALUES = 1 << 25
CONVERT_VALUES = 4096 * 11008
# Passes of a probe of the rates before a row's runs, and again after them (one more between runs).
PASSES = 3

# ("linear", tokens, in, out), ("attention", heads, tokens, head width, causal), ("bandwidth",), ("convert",), and
# a kernel's (kind, tokens, *widths): KERNELS.
Key = tuple[Any, ...]
# A tensor of this many values of this dtype that already exists (a model's weight), or None.
WeightSource = Callable[[int, torch.dtype], "torch.Tensor | None"]


# ---- what a family runs beyond nn.Linear and SDPA, timed as the model runs it -------------------------------------
#
# On a CPU these ops run neither at a dense matmul's rate nor at the memory bandwidth their bytes suggest
# (measured on a 2-core AMX Xeon in bf16, transformers 5.24):
# - a sparse layer's experts (Qwen3-VL-MoE): transformers' default "grouped_mm" experts sort the n x top_k token
#   rows by expert and run torch's grouped_mm over every expert's weights, on CPU one small matmul per expert
#   (about n x top_k / experts rows each): about 7 times slower than one matmul of all the rows;
# - a Gated DeltaNet layer (Qwen3.5) without flash-linear-attention and causal-conv1d: transformers' PyTorch
#   chunked delta rule (q, k, v cast to float32, a triangular solve per chunk, then a Python loop over the
#   chunks of small float32 matmuls) and a depthwise conv1d: 15 GFLOP/s, where bytes over bandwidth say 1 ms;
# - the Qwen towers' patch embedding: a Conv3d whose kernel is its stride, one patch per batch row: oneDNN runs
#   it 30 times slower than the same product as a linear, which the accountant counts;
# - the Qwen towers' attention: rotary applied to q and k in float32 (casts and strided copies of every
#   token's states: as long as the SDPA call), then SDPA per image (cu_seqlens; one call per image, or frame);
# - a decoder's RMSNorms (every family's: float32 inside, 5 passes over the states, 10 times the bytes of
#   one) and its gated activation silu(gate) * up (over tokens x the FFN width, where the accountant's
#   LLM-Viewer record sizes it by the hidden width): together about a tenth of a 7B decoder layer.
# Each kind is timed by the call the model makes, at the row's shapes (transformers' own delta rule, convolution
# and rotary through models/hf_compat.py; the norms' and the activation's few torch calls as transformers
# writes them), and prices the op it computes: a matrix kernel at the accountant's FLOPs of that op over the
# call's time, an elementwise one at its elements, so that a count between the timed ones reads the rate
# between them.

@dataclass(frozen=True)
class Kernel:
    """One kind of call the rate probe times (a key: the kind, the token or row count, then its widths): the
    values of the weight it reads (borrowed from the model between runs; 0: none), the call, the prediction's
    part, and the work of the op it prices (the rate's unit): by default the accountant's FLOPs of the op."""

    weight_values: Callable[[tuple[int, ...]], int]
    call: Callable[[MeasuredRates, tuple[int, ...], torch.Tensor | None], Callable[[], Any]]
    part: str
    # What a large bf16 matmul does (FLOPs) in the time one unit of work takes here (the 2-core AMX Xeon, at the
    # 2026 backbones' shapes): what the time estimate counts a probe pass's kernels at, before anything is timed.
    matmul_flops_per_work: float
    work: Callable[[Key, Op], float] = lambda key, op: 2 * op.macs


def _elements(key: Key, op: Op) -> float:
    """An elementwise key's work: rows x width."""
    return key[1] * key[2]


# A grouped-matmul key times this many rows at most (the 2026 backbones' prefills route 1,000 to 5,000): at many
# rows an expert, fewer experts (each its own weight, read from memory as the layer reads it).
EXPERT_PROBE_ROWS = 4096


def expert_probe_groups(rows_per_expert: int, experts: int) -> int:
    """How many experts a grouped-matmul key's call runs, each at `rows_per_expert` rows."""
    return min(experts, max(1, EXPERT_PROBE_ROWS // max(rows_per_expert, 1)))


def _grouped_mm_call(rates: MeasuredRates, shape: tuple[int, ...], weight: torch.Tensor | None) -> Callable[[], Any]:
    per_expert, experts, inner, outer = shape
    assert weight is not None
    # transformers' grouped_mm experts: the rows sorted by expert, every expert's (out, in) weight transposed; on
    # a CPU one matmul per expert that took rows. A key times `groups` experts at `per_expert` rows each: the
    # rate of an expert's matmul at that count, which prices every expert of a layer at its own (expert_loads).
    groups = expert_probe_groups(per_expert, experts)
    offsets = torch.tensor([per_expert] * groups, device=rates.device).cumsum(0).to(torch.int32)
    weights = weight.view(experts, outer, inner)[:groups].transpose(-2, -1)
    return functools.partial(torch.nn.functional.grouped_mm, rates._tensor(per_expert * groups, inner), weights,
                             offs=offsets)


def _grouped_mm_work(key: Key, op: Op) -> float:
    """A grouped-matmul key's work: its call's FLOPs."""
    _, per_expert, experts, inner, outer = key
    return 2 * per_expert * expert_probe_groups(per_expert, experts) * inner * outer


def _delta_rule_call(rates: MeasuredRates, shape: tuple[int, ...], weight: torch.Tensor | None) -> Callable[[], Any]:
    from ficoco.models import hf_compat as hf

    tokens, batch, key_heads, value_heads, key_dim, value_dim = shape
    # q, k and v as the layer hands them: strided views of its convolution's (B, T, q | k | v) output.
    widths = [key_heads * key_dim, key_heads * key_dim, value_heads * value_dim]
    mixed = rates._tensor(batch, tokens, sum(widths))
    query, key, value = (part.reshape(batch, tokens, -1, width) for part, width in
                         zip(mixed.split(widths, dim=-1), (key_dim, key_dim, value_dim), strict=True))
    # As the layer makes them: beta a sigmoid in the compute dtype, the decay g <= 0 in float32.
    beta = torch.sigmoid(rates._tensor(batch, tokens, value_heads))
    decay = -torch.nn.functional.softplus(rates._tensor(batch, tokens, value_heads, kind=torch.float32))
    # A prefill with a cache keeps the final state.
    return functools.partial(hf.gated_delta_rule(), query, key, value, g=decay, beta=beta, initial_state=None,
                             output_final_state=True, use_qk_l2norm_in_kernel=True)


# Qwen3.5's DeltaNet activation (its configs' hidden_act), applied inside the convolution's call.
DELTANET_ACTIVATION = "silu"


def _causal_conv1d_call(rates: MeasuredRates, shape: tuple[int, ...], weight: torch.Tensor | None
                        ) -> Callable[[], Any]:
    from ficoco.models import hf_compat as hf

    tokens, batch, channels, kernel = shape
    assert weight is not None
    # The layer hands it its q/k/v projection's output transposed to (B, channels, T): a strided view.
    states = rates._tensor(batch, tokens, channels).transpose(1, 2)
    return functools.partial(hf.causal_conv1d(), states, weight.view(channels, kernel), None,
                             activation=DELTANET_ACTIVATION)


def _patch_conv3d_call(rates: MeasuredRates, shape: tuple[int, ...], weight: torch.Tensor | None
                       ) -> Callable[[], Any]:
    patches, channels, temporal, patch, hidden = shape
    assert weight is not None
    pixels = rates._tensor(patches, channels, temporal, patch, patch)
    kernel = weight.view(hidden, channels, temporal, patch, patch)
    return functools.partial(torch.nn.functional.conv3d, pixels, kernel, None, stride=(temporal, patch, patch))


def _tower_attention_call(rates: MeasuredRates, shape: tuple[int, ...], weight: torch.Tensor | None
                          ) -> Callable[[], Any]:
    from ficoco.models import hf_compat as hf

    tokens, items, heads, head_dim, tower = shape
    rotary = hf.vision_rotary(tower)
    # The layer's q, k and v: views of one (tokens, 3 x width) projection of every item's tokens; the rotary
    # tables in float32.
    q, k, v = rates._tensor(items * tokens, 3, heads, head_dim).permute(1, 0, 2, 3).unbind(0)
    cos, sin = (rates._tensor(items * tokens, head_dim, kind=torch.float32) for _ in range(2))
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def call() -> torch.Tensor:
        turned_q, turned_k = rotary(q, k, cos, sin)
        per_item = (state.transpose(0, 1).unsqueeze(0).split(tokens, dim=2) for state in (turned_q, turned_k, v))
        return torch.cat([sdpa(*one).transpose(1, 2).contiguous() for one in zip(*per_item, strict=True)], dim=1)

    return call


def _rms_norm_call(rates: MeasuredRates, shape: tuple[int, ...], weight: torch.Tensor | None) -> Callable[[], Any]:
    rows, width = shape
    assert weight is not None
    states = rates._tensor(rows, width)

    def call() -> torch.Tensor:  # LlamaRMSNorm.forward; Qwen2's, Qwen3's and Qwen3.5's make the same passes
        hidden = states.to(torch.float32)
        hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + 1e-6)
        return weight * hidden.to(states.dtype)

    return call


def _gated_rms_norm_call(rates: MeasuredRates, shape: tuple[int, ...], weight: torch.Tensor | None
                         ) -> Callable[[], Any]:
    rows, width = shape
    assert weight is not None
    states, gate = rates._tensor(rows, width), rates._tensor(rows, width)

    def call() -> torch.Tensor:  # Qwen3_5RMSNormGated.forward: the DeltaNet output normed, gated by silu(z)
        hidden = states.to(torch.float32)
        hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + 1e-6)
        hidden = weight * hidden.to(states.dtype)
        return (hidden * torch.nn.functional.silu(gate.to(torch.float32))).to(states.dtype)

    return call


def _gated_act_call(rates: MeasuredRates, shape: tuple[int, ...], weight: torch.Tensor | None) -> Callable[[], Any]:
    rows, width = shape
    gate, up = rates._tensor(rows, width), rates._tensor(rows, width)
    # The decoders' MLP (LLaMA's, Qwen's: silu) between gate_proj and up_proj, and a sparse layer's experts.
    return lambda: torch.nn.functional.silu(gate) * up


def _tower_act_call(rates: MeasuredRates, shape: tuple[int, ...], weight: torch.Tensor | None) -> Callable[[], Any]:
    from ficoco.models import hf_compat as hf

    rows, width, name = shape
    # A tower MLP's activation between fc1 and fc2 (Qwen3-VL's and Qwen3.5's: the tanh GELU), as transformers calls it.
    return functools.partial(hf.activation(str(name)), rates._tensor(rows, width))


# Keys: ("grouped_mm", rows an expert, experts, in, out), ("delta_rule", tokens, batch, key heads, value heads,
# key width, value width), ("causal_conv1d", tokens, batch, channels, kernel), ("patch_conv3d", patches, channels,
# temporal patch, patch, hidden), ("tower_attention", tokens per item, items, heads, head width, tower kind), and the
# elementwise ("rms_norm", rows, width), ("gated_rms_norm", rows, width), ("gated_act", rows, width),
# ("tower_act", rows, width, activation).
KERNELS: dict[str, Kernel] = {
    "grouped_mm": Kernel(lambda shape: shape[1] * shape[2] * shape[3], _grouped_mm_call, "linear",
                         matmul_flops_per_work=7, work=_grouped_mm_work),
    "delta_rule": Kernel(lambda shape: 0, _delta_rule_call, "linear_attention", matmul_flops_per_work=70),
    "causal_conv1d": Kernel(lambda shape: shape[2] * shape[3], _causal_conv1d_call, "linear_attention",
                            matmul_flops_per_work=500),
    "patch_conv3d": Kernel(lambda shape: shape[4] * shape[1] * shape[2] * shape[3] ** 2, _patch_conv3d_call, "linear",
                           matmul_flops_per_work=50),
    "tower_attention": Kernel(lambda shape: 0, _tower_attention_call, "attention", matmul_flops_per_work=5,
                              work=lambda key, op: 4 * op.macs),  # the qk op stands for qk and sv
    "rms_norm": Kernel(lambda shape: shape[1], _rms_norm_call, "elementwise", matmul_flops_per_work=2000,
                       work=_elements),
    "gated_rms_norm": Kernel(lambda shape: shape[1], _gated_rms_norm_call, "elementwise",
                             matmul_flops_per_work=3000, work=_elements),
    "gated_act": Kernel(lambda shape: 0, _gated_act_call, "elementwise", matmul_flops_per_work=2000, work=_elements),
    "tower_act": Kernel(lambda shape: 0, _tower_act_call, "elementwise", matmul_flops_per_work=2000, work=_elements),
}


# What a kernel's call raises where the model could not make it either (torch's errors, a changed transformers
# contact): the probe drops that key and the prediction prices its ops the plain way.
KERNEL_FAILURES = (RuntimeError, NotImplementedError, TypeError, ValueError, ImportError, AttributeError, KeyError,
                   FicocoError)


def _weight_values(key: Key) -> int:
    """Values of the weight a key's call reads (0: none, or activations only)."""
    if key[0] == "linear":
        return key[2] * key[3]
    return KERNELS[key[0]].weight_values(key[1:]) if key[0] in KERNELS else 0


@dataclass
class MeasuredRates:
    """This machine's rates in `dtype` on `device`, measured for the shapes a prediction asks for.

    A shared machine's speed is not steady: on a 2-core AMX VM a bf16 matmul ran at 600 GFLOP/s for
    tens of seconds, then at 1,700 for ten (a neighbour's idle spell), and back. A rate measured
    once, minutes before a row runs, can be off by that much; so the shapes are timed in passes,
    each pass timing every shape once (round robin: each shape's calls meet the same moments), a
    few passes before the row's runs (`measure`), one after each timed run (`sample`, on the
    model's own weights: no new memory beside the model while its peak is measured) and a few after
    the last (`sample(passes=...)`), and each shape's rate is its work over its mean time per pass:
    a run of seconds lasts as long as the time-average of the machine's states it meets, which the
    mean of point samples estimates and their median does not (with two states, the median sits in
    one of them). The prediction then reads the machine over the same minutes as the measurement,
    and each pass's total says how far the machine moved (`pass_rates`).

    A new object measures anew; nothing is shared between rows or processes."""

    dtype: str
    device: str = "cpu"
    passes: int = PASSES
    # Where `sample` takes a linear shape's weight from without allocating one (the model's own).
    weights: WeightSource | None = None
    _work: dict[Key, float] = field(default_factory=dict, repr=False)
    _passes: list[dict[Key, float]] = field(default_factory=list, repr=False)
    # Kernel keys whose call failed here (KERNELS), and why.
    _failed: dict[Key, str] = field(default_factory=dict, repr=False)

    @property
    def _torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    def _tensor(self, *shape: int, kind: torch.dtype | None = None) -> torch.Tensor:
        # Values of a real activation's size; randn for the small ones, a constant fill for large
        # buffers (randn of a 7B LM head's 130 M values takes a second).
        kind = kind or self._torch_dtype
        if math.prod(shape) > 1 << 22:
            return torch.full(shape, 0.01, dtype=kind, device=self.device)
        return torch.randn(*shape, generator=self._generator).to(device=self.device, dtype=kind)

    @functools.cached_property
    def _generator(self) -> torch.Generator:
        return torch.Generator().manual_seed(0)

    def _calls(self, keys: list[Key], allocate: bool) -> list[tuple[Key, Callable[[], Any]]]:
        """A call per key, with its tensors: linear weights from `weights`, else (with `allocate`) views of
        one buffer of the largest; a key that would need new weight memory without `allocate` is skipped."""
        calls: list[tuple[Key, Callable[[], Any]]] = []
        values = {key: _weight_values(key) for key in keys}
        borrowed = {key: self.weights(count, self._torch_dtype) if self.weights else None
                    for key, count in values.items() if count}
        need = max((count for key, count in values.items() if count and borrowed[key] is None), default=0)
        # One buffer for every weight not borrowed (its largest: an LM head's, 0.5 GB in float32; a sparse
        # layer's experts').
        buffer = self._tensor(need) if allocate and need else None
        for key in keys:
            kind, *shape = key
            weight = None
            if values[key]:
                weight = borrowed[key] if borrowed[key] is not None else buffer
                if weight is None:
                    continue
                weight = weight.reshape(-1)[:values[key]]
            if kind == "linear":
                tokens, inner, outer = shape
                assert weight is not None
                # nn.Linear's layout: the weight is (out, in), multiplied transposed.
                calls.append((key, functools.partial(torch.nn.functional.linear, self._tensor(tokens, inner),
                                                     weight.view(outer, inner))))
            elif kind in KERNELS:
                try:
                    calls.append((key, KERNELS[kind].call(self, tuple(shape), weight)))
                except KERNEL_FAILURES as exc:
                    self._fail(key, exc)
            elif kind == "attention":
                heads, tokens, head_dim, causal = shape
                q, k, v = (self._tensor(1, heads, tokens, head_dim) for _ in range(3))
                calls.append((key, functools.partial(torch.nn.functional.scaled_dot_product_attention, q, k, v,
                                                     is_causal=causal)))
            elif kind == "read":
                calls.append((key, self._read_call(*shape)))
            elif allocate and kind == "bandwidth":
                source = torch.ones(BANDWIDTH_VALUES, dtype=torch.bfloat16, device=self.device)
                calls.append((key, functools.partial(torch.empty_like(source).copy_, source)))
            elif allocate and kind == "convert":
                # The upcast layout's per-forward work: a 7B MLP weight's values written in the compute
                # dtype from its bfloat16 storage.
                stored = torch.ones(CONVERT_VALUES, dtype=torch.bfloat16, device=self.device)
                calls.append((key, functools.partial(torch.empty(stored.shape, dtype=self._torch_dtype,
                                                                 device=self.device).copy_, stored)))
        return calls

    def _read_call(self, kind: str, heads: int, kv_heads: int, head_dim: int, rows: int, keys: int, causal: bool,
                   rule: str) -> Callable[[], Any]:
        """A method's read of a layer's attention at its shape, as the model runs it (ficoco.methods.reads.ops):
        the column means over every query of `keys` tokens, or `rows` rows over them (their raw scores for a
        "logits" read). Of a layer whose attention ficoco's fused pass computes (FUSED_READS): the pass with a
        column read of the matrix it leaves ("fused"), or the model's SDPA on the same inputs ("fused_reference")."""
        from ficoco.methods.reads.ops import ProbedAttention
        from ficoco.methods.reads.ops.fused import fused_attention

        # As a transformers attention module hands them: (batch, tokens, heads, width) transposed to (batch,
        # heads, tokens, width), a strided view (its product runs ~10 % slower than on contiguous heads).
        query = self._tensor(1, keys, heads, head_dim).transpose(1, 2)
        key = self._tensor(1, keys, kv_heads, head_dim).transpose(1, 2)
        if kind in FUSED_READS:
            value = self._tensor(1, keys, kv_heads, head_dim).transpose(1, 2)
            if kind == "fused_reference":
                return functools.partial(torch.nn.functional.scaled_dot_product_attention, query, key, value,
                                         is_causal=causal, enable_gqa=kv_heads != heads)

            def fused() -> Any:
                _, reads = fused_attention(query, key, value, causal=causal, scores=rule)
                return reads.column_sum()

            return fused
        # (A width's rows, its most, may exceed the fewest keys its grid times: every row then.)
        index = torch.arange(max(0, keys - rows), keys, device=self.device).unsqueeze(0)

        def read() -> Any:
            # A new reader per call: a small layer's is read whole once and kept (WHOLE_READ_SCORES).
            reads = ProbedAttention(query, key, causal=causal, scores=rule)
            if kind == "logits":
                return reads.logits(index)
            return reads.column_sum() if kind == "columns" else reads.rows(index)

        return read

    def _run_passes(self, keys: list[Key], passes: int, *, allocate: bool, warm_up: bool) -> None:
        calls = self._calls(keys, allocate)
        device = torch.device(self.device)
        with torch.inference_mode():
            if warm_up:  # kernel choice, allocation
                for key, call in list(calls):
                    try:
                        call()
                    except KERNEL_FAILURES as exc:
                        if key[0] not in KERNELS:
                            raise
                        self._fail(key, exc)
                        calls.remove((key, call))
            for _ in range(passes):
                seconds: dict[Key, float] = {}
                for key, call in calls:
                    if key[0] == "read":
                        # In the model a read follows its layer's projections and attention, on queries and keys
                        # those just wrote: warm, where the pass's previous call (a decoder's experts, an LM
                        # head) left the caches full of its own weights. An untimed call first.
                        call()
                    synchronize(device)
                    begin = time.perf_counter()
                    call()
                    synchronize(device)
                    seconds[key] = time.perf_counter() - begin
                self._passes.append(seconds)

    def measure(self, linear: Any = (), attention: Any = (), convert: bool = False,
                kernels: Mapping[Key, float] | None = None, reads: Any = ()) -> None:
        """Time every linear (tokens, in, out), attention (heads, tokens, head width, causal) and attention
        read (kind, heads, key heads, head width, rows, keys, causal, rule) shape and every kernel key (KERNELS;
        each with the work it prices) not measured yet, with the memory bandwidth (and with `convert`, the
        upcast layout's convert rate): `passes` round-robin passes after an untimed one."""
        new = self._new_work(linear, attention, convert, kernels, reads)
        if new:
            self._work.update(new)
            self._run_passes(sorted(new, key=str), self.passes, allocate=True, warm_up=True)

    def expect(self, shapes: ProbeShapes) -> None:
        """Time `shapes` (a row's, at counts its input decided in its warm-up: MustDrop's) from the next pass on,
        among the shapes measured so far, rather than in a burst of their own when the prediction asks for them:
        a rate from passes that met the machine at one moment only is that moment's (a shared VM's speed moves by
        tens of percent within a row). A kernel key joins only where its kind's call has run here already: a pass
        between timed runs has no warm-up to find a call this device cannot make (`measure` times the rest)."""
        ran = {key[0] for key in self._work if key[0] in KERNELS}
        kernels = {key: work for key, work in shapes.kernels.items() if key[0] in ran}
        self._work.update(self._new_work(shapes.linear, shapes.attention, shapes.convert, kernels, shapes.reads))

    def _new_work(self, linear: Any, attention: Any, convert: bool, kernels: Mapping[Key, float] | None,
                  reads: Any) -> dict[Key, float]:
        """The work of every shape given (and the bandwidth copy's) not measured yet."""
        work: dict[Key, float] = {("bandwidth",): 2 * BANDWIDTH_VALUES * 2}  # a copy moves each byte twice
        work.update(kernels or {})
        if convert:
            work[("convert",)] = CONVERT_VALUES * self._torch_dtype.itemsize
        for tokens, inner, outer in linear:
            work[("linear", tokens, inner, outer)] = 2 * tokens * inner * outer
        for heads, tokens, head_dim, causal in attention:
            # The accountant's count: scores and weighted values over the full square, causal or not.
            work[("attention", heads, tokens, head_dim, causal)] = 4 * heads * tokens * tokens * head_dim
        for shape in reads:
            kind, heads, _, _, rows, keys = shape[:6]
            # A read's work: the scores it computes (every row of a column read and of a fused pass).
            work[("read", *shape)] = heads * (keys if kind in ("columns", *FUSED_READS) else rows) * keys
        return {key: value for key, value in work.items() if key not in self._work and key not in self._failed}

    def _fail(self, key: Key, exc: BaseException) -> None:
        # A call this device or release cannot make (grouped_mm below a GPU's SM80, a changed contact): the
        # prediction prices its ops as matmuls, SDPA and bytes instead (kernel_available).
        self._failed[key] = f"{type(exc).__name__}: {exc}"
        self._work.pop(key, None)

    def kernel_available(self, key: Key) -> bool:
        """Whether a kernel key's call ran here (measured, or not asked yet)."""
        return key not in self._failed

    def sample(self, passes: int = 1) -> None:
        """`passes` more passes over every shape measured so far. One pass (between a row's timed runs)
        times only what needs no new memory: linear shapes and kernels on the model's own weights, attention
        and the kernels that read none (activations no larger than the prefill's own); several (after the
        runs) time everything."""
        if self._work:
            allocate = passes > 1
            self._run_passes(sorted(self._work, key=str), passes, allocate=allocate, warm_up=allocate)

    def after_warm_up(self) -> None:
        """Drop the passes made before the row's warm-up and make one now (on the model's own weights: no new
        memory while the row's peak is measured). Those passes met the process before the row's first forward
        had run (its allocations, the pages it faults in): on the first row after a build their prefill came
        out 1.4-2x the later passes' (Qwen3-VL-8B's vanilla: 17.6, 12.4, 12.8 s, then 7.9-8.7 s, while its
        timed runs took 8.3-9.1 s). The shapes this pass cannot time take the passes after the runs."""
        if self._passes:
            self._passes.clear()
            self.sample()

    def _rate(self, key: Key, passes: list[dict[Key, float]] | None = None) -> float:
        times = [seconds[key] for seconds in (passes or self._passes) if key in seconds]
        if not times:
            times = [seconds[key] for seconds in self._passes if key in seconds]
        return self._work[key] / max(statistics.fmean(times), 1e-12)

    def pass_rates(self) -> list[PassRates]:
        """Each pass's rates (a shape the pass did not time at its mean over every pass): a
        prediction at each says how far the machine's speed moved while the row ran."""
        return [PassRates(self, index) for index in range(len(self._passes))]

    @property
    def bandwidth_bytes_per_s(self) -> float:
        """Bytes moved (read and written) per second."""
        self.measure()
        return self._rate(("bandwidth",))

    @property
    def convert_bytes_per_s(self) -> float:
        """bfloat16 to the compute dtype, written bytes per second, on a 7B MLP weight's size."""
        self.measure(convert=True)
        return self._rate(("convert",))

    @functools.cached_property
    def small_op_s(self) -> float:
        """The time of one small op (estimate.py's probe: dispatch and Python)."""
        return small_op_s(self._torch_dtype, self.device)

    def linear_flops_per_s(self, tokens: int, inner: int, outer: int) -> float:
        """FLOP/s of a linear layer of `inner` -> `outer` features on `tokens` rows, measured."""
        self.measure(linear=[(tokens, inner, outer)])
        return self._rate(("linear", tokens, inner, outer))

    def attention_flops_per_s(self, heads: int, tokens: int, head_dim: int, causal: bool) -> float:
        """FLOP/s (the accountant's full-square count) of SDPA over one sequence, measured."""
        self.measure(attention=[(heads, tokens, head_dim, causal)])
        return self._rate(("attention", heads, tokens, head_dim, causal))

    def read_scores_per_s(self, kind: str, heads: int, kv_heads: int, head_dim: int, rows: int, keys: int,
                          causal: bool, rule: str) -> float:
        """Scores per second of a method's read of a layer's attention at its shape, measured."""
        shape = (kind, heads, kv_heads, head_dim, rows, keys, causal, rule)
        self.measure(reads=[shape])
        return self._rate(("read", *shape))

    def kernel_work_per_s(self, key: Key) -> float:
        """Work per second (the accountant's FLOPs of the op it computes, or an elementwise op's elements) of
        a kernel key (KERNELS), measured with `measure` (which is told its work)."""
        return self._rate(key)


@dataclass(frozen=True)
class PassRates:
    """The rates of one of a MeasuredRates' passes (ShapeRates)."""

    rates: MeasuredRates
    index: int

    @property
    def dtype(self) -> str:
        return self.rates.dtype

    @property
    def small_op_s(self) -> float:
        return self.rates.small_op_s

    def _at(self, key: Key) -> float:
        return self.rates._rate(key, [self.rates._passes[self.index]])

    @property
    def bandwidth_bytes_per_s(self) -> float:
        return self._at(("bandwidth",))

    @property
    def convert_bytes_per_s(self) -> float:
        return self._at(("convert",))

    def measure(self, linear: Any = (), attention: Any = (), convert: bool = False,
                kernels: Mapping[Key, float] | None = None, reads: Any = ()) -> None:
        """Nothing new is measured at a past pass."""

    def linear_flops_per_s(self, tokens: int, inner: int, outer: int) -> float:
        return self._at(("linear", tokens, inner, outer))

    def attention_flops_per_s(self, heads: int, tokens: int, head_dim: int, causal: bool) -> float:
        return self._at(("attention", heads, tokens, head_dim, causal))

    def read_scores_per_s(self, kind: str, heads: int, kv_heads: int, head_dim: int, rows: int, keys: int,
                          causal: bool, rule: str) -> float:
        return self._at(("read", kind, heads, kv_heads, head_dim, rows, keys, causal, rule))

    def kernel_work_per_s(self, key: Key) -> float:
        return self._at(key)

    def kernel_available(self, key: Key) -> bool:
        return self.rates.kernel_available(key)


# Small ops dispatched per forward, per layer and per reducing layer: estimate.py's CALIBRATION.
FORWARD_OPS = {"fp16": 340.0, "int8": 1600.0, "int4": 760.0}
LAYER_OPS = {"fp16": 61.0, "int8": 155.0, "int4": 62.0}
REDUCING_LAYER_OPS = 150.0

# The read kinds that time a fused layer (MeasuredRates._read_call): ficoco's pass and the model's kernel beside it.
FUSED_READS = ("fused", "fused_reference")

# ---- a method's own probe, priced from its spec -------------------------------------------------------------------
#
# A method's probe has two parts.
#
# Its reads of a whole layer's attention (FiCoCo-V's column means and correlate rows, FiCoCo-L's visual and text
# rows, HoliTom's tower column sums: ficoco.accounting.reads, computed beside the layer's own kernel by
# ficoco.methods.reads.ops) are timed at their own shapes in the rate probe (`MeasuredRates.read_scores_per_s`:
# the same read on random queries and keys of the row's dtype and rule), and priced at that rate: scores and
# softmax by blocks, whatever their mix of matrix and elementwise work on this machine. A layer whose attention
# ficoco's fused pass computed in the row's forward (its kernel record says "probe": `fused_layers`) is priced
# once, as that pass (with a read of the matrix it leaves) beyond the model's SDPA on the same inputs, both timed
# at the layer's shape in the same passes (FUSED_READS); the layer's SDPA stays in the "attention" part.
#
# A few rows (FastV's and PDrop's last row, SparseVLM's text rows, the [CLS] row of VisionZip, VisPruner and
# FasterVLM) are computed inside the method's steps: their q.k products are the method's `extra_macs`, priced in
# the "method" part, and their passes over memory here, in bytes (per score, read and written: the logits' write
# 4; scaled 4 + 4; the padding or causal mask 4 + 4, not in a tower; the softmax 4 + 4; for several rows
# rows_attention's nan_to_num 4 + 4 and head mean 4 = 28 for one decoder row, 20 for a tower's [CLS] row, 40
# for text rows; per k value, grouped-query keys repeated: cast to float32 A + 4 when A < 4, repeated per query
# head 4 + 4, read by the product 4). Needs of other kinds (keys, hidden states, input embeddings: DART, ToMe,
# DivPrune, CDPruner) read tensors the layer made anyway: no probe.
ROW_SCORE_BYTES = {"last": 28, "cls": 20, "suffix": 40}
# A read's bytes per score for the run's time estimate (estimate.py, which has no read rates): the scores'
# write A, scaled A + A, the softmax read and write A + A (in float32 under the float32 rule), the sum's read A.
READ_PASSES_PER_SCORE = 6


@dataclass(frozen=True)
class Probe:
    """A few attention rows a method computes inside its steps: `rows` query rows of `heads` heads over `keys`
    keys, per each of `sequences` sequences (a tower's items times the batch, or the batch), at one layer."""

    method: str
    stage: str  # "vision" or "llm"
    layer: int
    rows: int
    keys: int
    heads: int
    head_dim: int
    sequences: int

    @property
    def scores(self) -> int:
        """Probabilities computed: heads x rows x keys per sequence."""
        return self.sequences * self.heads * self.rows * self.keys

    def bytes_moved(self, act_bytes: float) -> float:
        """Bytes read and written in its passes over its scores and its k values (see above)."""
        cast = act_bytes + 4 if act_bytes < 4 else 0.0  # a cast to float32 that is not a no-op
        states = self.sequences * self.heads * self.keys * self.head_dim
        kind = "suffix" if self.rows > 1 else ("cls" if self.stage == "vision" else "last")
        return self.scores * ROW_SCORE_BYTES[kind] + states * (cast + 8 + 4)


def method_probes(arch: Architecture, schedule: Schedule, text_tokens: int | None, batch: int) -> list[Probe]:
    """The attention rows `schedule`'s method computes inside its steps in one prefill, from its spec's probe
    plan (the one the adapters read, ficoco.methods.needs): one per layer whose rows it reads, at the tokens
    that layer attends over. Its reads of a whole layer are `method_reads`' (ficoco.accounting.reads)."""
    from ficoco.accounting.methods import suffix_tokens
    from ficoco.methods import METHODS

    spec = METHODS.get(schedule.variant)
    if spec is None or not schedule.removals:
        return []
    plan = plan_tokens(arch, schedule, text_tokens=text_tokens)
    suffix = suffix_tokens(arch, plan.text_tokens)
    v, d = arch.vision, arch.decoder
    probes: dict[tuple[str, int], Probe] = {}

    def add(stage: str, layer: int, rows: int, keys: int) -> None:
        if stage == "vision":
            sequences, heads, head_dim = batch * plan.vision_items, v.heads, v.hidden // v.heads
        else:
            sequences, heads, head_dim = batch, d.heads, d.head_dim
        probe = Probe(spec.name, stage, layer, rows, keys, heads, head_dim, sequences)
        # One probe per layer: the adapters probe a layer once for every need read there.
        if (stage, layer) not in probes or probes[(stage, layer)].rows < probe.rows:
            probes[(stage, layer)] = probe

    settings = {**spec.hyperparameters, **schedule.settings_dict()}
    for removal in schedule.removals:
        if removal.stage == "vision":
            # The step's layer, the tower's last, and the layers the method's settings name (``vision named``).
            named = tuple((int(settings[name]), probe) for name, probe in spec.probes.named_tower_layers)
            for layer, tower in ((removal.layer, spec.probes.step_tower_layers),
                                 (v.layers - 1, spec.probes.last_tower_layer), *named):
                # A read of every row is the method's reads'; no [CLS]: the equivalent token scores from the keys.
                if tower is not None and not tower.probabilities and tower.cls_query and v.has_cls:
                    add("vision", layer, 1, plan.vision[layer][0])
            continue
        # A method acting before the LLM with steps inside it (HoliTom) reads there as its inner spec says.
        probes_of = (spec.inner if spec.acts_at != "llm_layer" and spec.inner else spec).probes
        layer = removal.layer
        if probes_of.previous_layer_rows is not None:  # layer L-1's rows (FastV, SparseVLM)
            keys = plan.llm[layer - 1][0]
            add("llm", layer - 1, 1 if probes_of.previous_layer_rows == "last" else min(suffix, keys), keys)
        if probes_of.own_query_key_row:  # layer L's own last row, on what layer L-1 handed on (PDrop)
            add("llm", layer, 1, plan.llm[layer - 1][1])
    return list(probes.values())


def schedule_reads(arch: Architecture, schedule: Schedule, text_tokens: int | None, batch: int) -> list[Read]:
    """The reads of a whole layer's attention `schedule`'s method makes in one prefill (ficoco.accounting.reads)."""
    if not schedule.removals:
        return []
    return method_reads(arch, schedule, plan_tokens(arch, schedule, text_tokens=text_tokens), batch=batch)


def read_rule(schedule: Schedule) -> str:
    """The rule `schedule`'s method reads attention by (its ``attention_scores``; the model's by default)."""
    from ficoco.methods import METHODS

    spec = METHODS.get(schedule.variant)
    defaults = spec.hyperparameters if spec is not None else {}
    return str({**defaults, **schedule.settings_dict()}.get("attention_scores", DEFAULT_ATTENTION_SCORES))


def probe_bytes(arch: Architecture, schedule: Schedule, text_tokens: int | None, batch: int,
                act_bytes: float = 2.0) -> float:
    """Bytes the method's own probe moves in one prefill, in a compute dtype of `act_bytes` bytes: its rows'
    passes (`method_probes`) and its reads' (`READ_PASSES_PER_SCORE` passes over every score, in float32
    under the float32 rule); 0 for a method that reads no attention probabilities. The time estimate's
    yardstick: the prediction times the reads at their shapes instead."""
    rows = sum(probe.bytes_moved(act_bytes) for probe in method_probes(arch, schedule, text_tokens, batch))
    score_bytes = 4.0 if read_rule(schedule) == "float32" else act_bytes
    reads = sum(read.scores for read in schedule_reads(arch, schedule, text_tokens, batch))
    return rows + reads * READ_PASSES_PER_SCORE * score_bytes


def dispatch_s(layers: int, reducing_layers: int, quant: str, rates: Any) -> float:
    """The dispatch cost of one forward: small ops per forward, per layer, per reducing layer."""
    ops = (FORWARD_OPS.get(quant, FORWARD_OPS["fp16"]) + LAYER_OPS.get(quant, LAYER_OPS["fp16"]) * layers
           + REDUCING_LAYER_OPS * reducing_layers)
    return ops * rates.small_op_s


@dataclass
class Prediction:
    """One prefill's predicted time and its parts (seconds); `passes_s`: the same prefill priced at each pass
    of the rate probe (MeasuredRates.pass_rates), where there were passes, and `at_mean_rates_s` at each shape's
    mean rate over them. With passes, the prediction is their median (`at_median_pass`)."""

    total_s: float
    parts_s: dict[str, float]
    passes_s: list[float] = field(default_factory=list)
    at_mean_rates_s: float | None = None

    @classmethod
    def at_median_pass(cls, passes: list[Prediction], at_mean_rates: Prediction) -> Prediction:
        """The prediction at the median of `passes` (each the prefill priced at one pass of the rate probe):
        the pass in the middle by total, or the mean of the two in the middle, parts and all.

        The measured prefill is the median of the row's timed runs, which a run slowed by a neighbour's burst
        does not move; the prediction takes the same statistic over its passes, which are priced from the
        same minutes. At each shape's mean rate instead, one slow pass of nine moved Qwen3-VL-30B-A3B's
        vanilla prediction from 5,243 ms (its median pass) to 5,511, against 4,924 measured: a statistic the
        measurement does not use made the speedups of every method on that model look 5 % short."""
        ordered = sorted(passes, key=lambda one: one.total_s)
        middle = ordered[(len(ordered) - 1) // 2: len(ordered) // 2 + 1]
        parts = {name: statistics.fmean(one.parts_s[name] for one in middle) for name in middle[0].parts_s}
        return cls(sum(parts.values()), parts, [one.total_s for one in passes], at_mean_rates.total_s)

    @property
    def spread(self) -> float | None:
        """How far the passes' totals lie apart, over the prediction: how much this machine's speed
        moved while its rates were probed (a shared machine's neighbours come and go)."""
        if len(self.passes_s) < 2 or not self.total_s:
            return None
        return (max(self.passes_s) - min(self.passes_s)) / self.total_s

    def to_json(self) -> dict[str, Any]:
        passes = {"passes_ms": [s * 1e3 for s in self.passes_s], "spread": self.spread} if self.passes_s else {}
        if self.at_mean_rates_s is not None:
            passes["prefill_at_mean_rates_ms"] = self.at_mean_rates_s * 1e3
        return {"prefill_ms": self.total_s * 1e3, **{f"{k}_ms": v * 1e3 for k, v in self.parts_s.items()}, **passes,
                "method": "the accountant's ops at this machine's rates for their shapes, timed in passes "
                          "before, between and after the row's runs; with passes, the prefill priced at their "
                          "median, as the measured prefill is its runs' median (profiling/predict.py)"}


def _linear_shape(arch: Architecture, op: Op) -> tuple[int, int, int]:
    """(tokens, in, out) of a linear op, read back from its record (flops._linear's counts)."""
    tokens = op.macs // op.weight_elems
    inner = arch.decoder.hidden if op.name == "lm_head" else op.act_load // tokens
    return tokens, inner, op.weight_elems // inner


def _attention_shape(arch: Architecture, plan: Any, op: Op) -> tuple[int, int, int, bool]:
    """(heads, tokens, head width, causal) of a layer's attention, from its qk op: the decoder's is causal."""
    vision = op.stage == "vision"
    heads = arch.vision.heads if vision else arch.decoder.heads
    head_dim = arch.vision.hidden // heads if vision else arch.decoder.head_dim
    tokens = (plan.vision if vision else plan.llm)[op.layer][0]
    return heads, tokens, head_dim, not vision


# The Qwen towers: a Conv3d patch embedding over one patch per batch row, rotary in float32 and SDPA per image.
QWEN_TOWERS = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
# Ops whose work runs inside another op's timed kernel (by the kernel's kind): the reachable experts' weights are
# read by the grouped matmuls, the DeltaNet convolution's activation is applied inside its call.
INSIDE_KERNELS = {"experts_weights": "grouped_mm", "conv_act": "causal_conv1d"}


def _kernel_key(arch: Architecture, plan: Any, op: Op, batch: int) -> Key | None:
    """The kernel (KERNELS) that times `op` as the model runs it, or None (a linear, SDPA or bytes)."""
    v, d = arch.vision, arch.decoder
    if op.stage == "vision" and op.name == "mlp_act" and v.act and not v.gated_mlp:
        return ("tower_act", op.act_store // v.ffn, v.ffn, v.act)  # it stores tokens x the FFN width
    if op.stage == "vision" and v.kind in QWEN_TOWERS:
        if op.name == "patch_embed":
            return ("patch_conv3d", op.macs // op.weight_elems, v.channels, v.temporal_patch, v.patch_size, v.hidden)
        # A windowed layer (Qwen2.5-VL's) attends per window: its SDPA keeps the whole-sequence pricing.
        if op.name == "qk" and not v.windowed(op.layer):
            return ("tower_attention", plan.vision[op.layer][0], batch * plan.vision_items, v.heads,
                    v.hidden // v.heads, v.kind)
    if op.stage != "llm":
        return None
    if op.name in ("input_norm", "post_attn_norm"):
        return ("rms_norm", op.act_load // d.hidden, d.hidden)
    if op.name in ("q_norm", "k_norm"):  # per head
        return ("rms_norm", op.act_load // d.head_dim, d.head_dim)
    if op.name == "mlp_act":  # gate and up are tokens x the FFN width (the record sizes the load by the hidden)
        return ("gated_act", op.act_store // d.hidden, d.ffn)
    if op.name == "experts_act" and d.moe is not None:
        return ("gated_act", op.act_store // d.moe.ffn, d.moe.ffn)
    linear = d.linear
    if linear is not None and op.name == "delta_rule":
        return ("delta_rule", plan.llm[op.layer][0], batch, linear.key_heads, linear.value_heads,
                linear.key_head_dim, linear.value_head_dim)
    if linear is not None and op.name == "conv1d":
        return ("causal_conv1d", plan.llm[op.layer][0], batch, linear.conv_dim, linear.conv_kernel)
    if linear is not None and op.name == "gated_norm":  # per value head, gated by z
        return ("gated_rms_norm", op.act_store // linear.value_head_dim, linear.value_head_dim)
    return None


EXPERT_OPS = ("experts_gate_up", "experts_down")


def even_loads(rows: int, experts: int) -> list[int]:
    """`rows` split over `experts` as evenly as they go: what a trained router's load-balancing aims at, and what
    the prediction assumes before a row has run."""
    return [rows // experts + (expert < rows % experts) for expert in range(experts)]


def _expert_keys(arch: Architecture, op: Op, loads: dict[int, list[int]] | None) -> list[tuple[Key, int]]:
    """A sparse layer's experts op as grouped-matmul keys: (key at a row count, how many experts took that many),
    from the loads the row ran where they add up to the op's rows, else the even split."""
    moe = arch.decoder.moe
    assert moe is not None
    rows, inner, outer = _linear_shape(arch, op)
    found = (loads or {}).get(op.layer) if op.layer is not None else None
    counts = found if found is not None and sum(found) == rows else even_loads(rows, moe.experts)
    return sorted((("grouped_mm", per_expert, moe.experts, inner, outer), experts)
                  for per_expert, experts in Counter(n for n in counts if n).items())


def _kernel_work(key: Key, op: Op) -> float:
    """The work of the op a kernel key prices, in the unit of its rate (KERNELS)."""
    return KERNELS[key[0]].work(key, op)


def _op_bytes(op: Op, weight_bytes: float, act_bytes: float) -> float:
    return op.weight_elems * weight_bytes + (op.act_load + op.act_store + op.kv_load + op.kv_store) * act_bytes


# A schedule that shortens the sequence layer by layer (FiCoCo-L in the decoder; FiCoCo-V and ToMe in
# the tower) has a token count per layer, and timing each would cost a good part of a prefill per
# pass: per width, rates are timed at this many of its counts at most, spread evenly over them (the
# fewest and the most among them), and read in between by linear interpolation in the count.
GRID_COUNTS = 6


class _TokenGrid:
    """The shapes to time for a set of shapes that differ in their token count (at `position`)."""

    def __init__(self, shapes: list[tuple], position: int) -> None:
        self.position = position
        counts: dict[tuple, set[int]] = {}
        for shape in shapes:
            counts.setdefault(self._width(shape), set()).add(shape[position])
        self.counts = {width: self._spread(sorted(found)) for width, found in counts.items()}
        self.timed = [self._at(width, count) for width, grid in self.counts.items() for count in grid]

    def _width(self, shape: tuple) -> tuple:
        return shape[:self.position] + shape[self.position + 1:]

    def _at(self, width: tuple, count: int) -> tuple:
        return width[:self.position] + (count,) + width[self.position:]

    @staticmethod
    def _spread(counts: list[int]) -> list[int]:
        if len(counts) <= GRID_COUNTS:
            return counts
        step = (len(counts) - 1) / (GRID_COUNTS - 1)
        return sorted({counts[round(k * step)] for k in range(GRID_COUNTS)})

    def rate(self, rate_at: Callable[..., float], shape: tuple) -> float:
        """`rate_at(*shape)` where `shape` was timed, else between the timed counts around it."""
        width, count = self._width(shape), shape[self.position]
        grid = self.counts[width]
        if count in grid:
            return rate_at(*shape)
        above = next(k for k in grid if k > count)
        below = max(k for k in grid if k < count)
        low, high = rate_at(*self._at(width, below)), rate_at(*self._at(width, above))
        return low + (high - low) * (count - below) / (above - below)


def _fused_shape(arch: Architecture, read: Read, rule: str, kind: str) -> tuple:
    """The shape of a fused layer's pass ("fused") or of the model's kernel on its inputs ("fused_reference"):
    every row of the layer over its keys (`_read_shape`'s fields)."""
    kv_heads = arch.decoder.kv_heads if read.stage == "llm" else read.heads
    return (kind, read.heads, kv_heads, read.head_dim, read.keys, read.keys, read.stage == "llm", rule)


def _read_shape(arch: Architecture, read: Read, rule: str) -> tuple:
    """The shape a read is timed at: (kind, heads, key heads, head width, rows, keys, causal, rule)."""
    kv_heads = arch.decoder.kv_heads if read.stage == "llm" else read.heads
    return (read.kind, read.heads, kv_heads, read.head_dim, min(read.rows, read.keys), read.keys,
            read.stage == "llm", rule)


def predict_prefill(arch: Architecture, schedule: Schedule, rates: ShapeRates, *, quant: str = "fp16",
                    batch: int = 1, text_tokens: int | None = None, compute_bits: int = 16,
                    upcast_layers: int = 0, expert_loads: dict[int, list[int]] | None = None,
                    fused_layers: Collection[tuple[str, int]] = ()) -> Prediction:
    """One prefill of `schedule` on `arch` at `rates` (the LM head on the last token, as the
    profile's prefill computes it). `upcast_layers`: the first decoder layers whose linear weights
    are stored in 16 bits and converted to the compute dtype at every forward. `expert_loads`: per sparse
    decoder layer, the rows each expert took in the row's forward (profiling/experts.py); without them, the
    even split. `fused_layers`: the (stage, layer) pairs whose attention ficoco's fused pass computed in the
    row's forward (`fused_layers`; their reads are priced as that pass beyond the model's kernel)."""
    quant_spec = Quant(quant, QUANT_BITS[quant], compute_bits, compute_bits)
    opts = CountOptions(convention="flops", scope="all", batch=batch, text_tokens=text_tokens,
                        lm_head_tokens="last")
    cost = account(arch, schedule, quant_spec, opts)
    plan = cost.plan
    ops = model_ops(arch, plan, batch=batch, lm_head_tokens="last")
    act_bytes = compute_bits / 8
    parts = dict.fromkeys(("linear", "attention", "linear_attention", "elementwise", "memory", "upcast", "method",
                           "probe", "dispatch"), 0.0)
    share = QUANT_MATMUL_SHARE.get(quant, 1.0)
    method_flops = cost.method_tflops * 1e12
    # The method's similarity and scoring matrices: a (tokens x hidden) by (hidden x tokens) product.
    method_tokens = max(plan.llm_visual_tokens, 1)
    method_shape = (method_tokens, arch.decoder.hidden, method_tokens)
    # The method's reads of a whole layer, at their own shapes (timed per key count; a column read over every
    # row, a rows read at the most rows of its kind, since its rate per score hardly depends on how many).
    reads = method_reads(arch, schedule, plan, batch=batch) if schedule.removals else []
    # A layer whose attention the fused pass computed: its reads come from the matrix that pass leaves; priced
    # once per layer as the pass's time beyond the model's kernel on the same inputs (windowed reads never fuse).
    fused: dict[tuple[str, int], Read] = {}
    for read in reads:
        layer = (read.stage, read.layer)
        if layer in fused_layers and read.pairs is None and (layer not in fused or read.keys > fused[layer].keys):
            fused[layer] = read  # its widest read: the layer's every key (a decoder's rows come by causal tiles)
    reads = [read for read in reads if (read.stage, read.layer) not in fused]
    fused_shapes = {layer: [_fused_shape(arch, read, read_rule(schedule), kind) for kind in FUSED_READS]
                    for layer, read in fused.items()}
    read_shapes = {id(read): _read_shape(arch, read, read_rule(schedule)) for read in reads}
    most_rows: dict[tuple, int] = {}
    for shape in read_shapes.values():
        width = shape[:4] + shape[6:]
        most_rows[width] = max(most_rows.get(width, 0), shape[4])
    read_shapes = {key: shape[:4] + (most_rows[shape[:4] + shape[6:]],) + shape[5:]
                   for key, shape in read_shapes.items()}
    read_grid = _TokenGrid([*read_shapes.values(), *(s for pair in fused_shapes.values() for s in pair)], position=5)
    # The shapes first, so that every rate the row needs is measured in one probe (MeasuredRates.measure). A
    # call this device cannot make (KERNELS: nor can the model, or it makes another) leaves its ops to the
    # matmul, SDPA and bytes pricing, whose shapes are then measured too.
    unavailable: set[str] = set()
    while True:
        kernels = {id(op): key for op in ops
                   if (key := _kernel_key(arch, plan, op, batch)) is not None and key[0] not in unavailable}
        experts = {id(op): _expert_keys(arch, op, expert_loads) for op in ops
                   if op.name in EXPERT_OPS and arch.decoder.moe is not None and "grouped_mm" not in unavailable}
        linear = {id(op): _linear_shape(arch, op) for op in ops
                  if op.macs and op.weight_elems and id(op) not in kernels and id(op) not in experts}
        attention = {id(op): _attention_shape(arch, plan, op) for op in ops
                     if op.name == "qk" and op.macs and not op.weight_elems and id(op) not in kernels}
        kernel_work = {kernels[id(op)]: _kernel_work(kernels[id(op)], op) for op in ops if id(op) in kernels}
        kernel_work |= {key: _kernel_work(key, op) for op in ops for key, _ in experts.get(id(op), ())}
        linear_grid = _TokenGrid(list(linear.values()) + ([method_shape] if method_flops else []), position=0)
        attention_grid = _TokenGrid(list(attention.values()), position=1)
        kernel_grid = _TokenGrid(list(kernel_work), position=1)
        rates.measure(linear=linear_grid.timed, attention=attention_grid.timed, convert=bool(upcast_layers),
                      kernels={key: kernel_work[key] for key in kernel_grid.timed}, reads=read_grid.timed)
        failed = {key[0] for key in kernel_grid.timed if not rates.kernel_available(key)}
        if not failed:
            break
        unavailable |= failed
    kinds = {key[0] for key in kernels.values()} | ({"grouped_mm"} if experts else set())
    inside = {name for name, kind in INSIDE_KERNELS.items() if kind in kinds}
    linear_rate = functools.partial(linear_grid.rate, rates.linear_flops_per_s)
    attention_rate = functools.partial(attention_grid.rate, rates.attention_flops_per_s)
    kernel_rate = functools.partial(kernel_grid.rate, lambda *key: rates.kernel_work_per_s(key))
    upcast_elems = 0
    for op in ops:
        memory_s = _op_bytes(op, act_bytes, act_bytes) / rates.bandwidth_bytes_per_s
        if id(op) in kernels:
            # The call the model makes for this op, timed at its shapes (KERNELS).
            key = kernels[id(op)]
            parts[KERNELS[key[0]].part] += _kernel_work(key, op) / kernel_rate(key)
        elif id(op) in experts:
            # Every expert that took rows, at its count: one matmul each, at the rate of that many rows.
            _, inner, outer = _linear_shape(arch, op)
            parts["linear"] += sum(count * 2 * key[1] * inner * outer / kernel_rate(key)
                                   for key, count in experts[id(op)])
        elif op.name in inside:
            continue
        elif id(op) in linear:
            compute_s = 2 * op.macs / (linear_rate(linear[id(op)]) * share)
            parts["linear"] += max(compute_s, memory_s)
            if op.stage == "llm" and op.layer is not None and op.layer < upcast_layers:
                upcast_elems += op.weight_elems
        elif id(op) in attention:
            # The layer's SDPA call, priced as one: scores, softmax and weighted values (sv, softmax skipped).
            parts["attention"] += 4 * op.macs / attention_rate(attention[id(op)])
        elif op.name in ("qk", "sv", "softmax"):
            continue
        else:
            parts["memory"] += memory_s
    if upcast_layers:
        parts["upcast"] = upcast_elems * act_bytes / rates.convert_bytes_per_s
    if method_flops:
        parts["method"] = method_flops / linear_rate(method_shape)
    # The method's own probe: its reads of whole layers at their measured rates, its rows' passes over memory.
    rows = sum(probe.bytes_moved(act_bytes) for probe in method_probes(arch, schedule, text_tokens, batch))
    parts["probe"] = rows / rates.bandwidth_bytes_per_s + sum(
        read.scores / read_grid.rate(rates.read_scores_per_s, read_shapes[id(read)]) for read in reads)
    for layer, (pass_shape, reference_shape) in fused_shapes.items():
        read = fused[layer]
        scores = read.sequences * read.heads * read.keys * read.keys
        beyond_s = (scores / read_grid.rate(rates.read_scores_per_s, pass_shape)
                    - scores / read_grid.rate(rates.read_scores_per_s, reference_shape))
        parts["probe"] += max(beyond_s, 0.0)  # a pass no slower than the model's kernel reads for free
    layers = arch.vision.layers + arch.decoder.layers
    parts["dispatch"] = dispatch_s(layers, len(schedule.removals), quant, rates)  # type: ignore[arg-type]
    return Prediction(sum(parts.values()), parts)


@dataclass
class ProbeShapes:
    """What a row's rate probe (MeasuredRates) times in each pass: its linear (tokens, in, out),
    attention (heads, tokens, head width, causal) and attention-read shapes, its kernel keys (KERNELS) with
    the work each prices, the bandwidth copy, and the convert copy of an upcast layout."""

    linear: list[tuple[int, int, int]] = field(default_factory=list)
    attention: list[tuple[int, int, int, bool]] = field(default_factory=list)
    kernels: dict[Key, float] = field(default_factory=dict)
    reads: list[tuple] = field(default_factory=list)
    convert: bool = False
    # ShapeRates' fields, so that predict_prefill can run on a recorder: it prices nothing.
    dtype: str = "float32"
    bandwidth_bytes_per_s: float = 1.0
    convert_bytes_per_s: float = 1.0
    small_op_s: float = 0.0

    def measure(self, linear: Any = (), attention: Any = (), convert: bool = False,
                kernels: Mapping[Key, float] | None = None, reads: Any = ()) -> None:
        """Remember the shapes asked for (nothing is timed)."""
        self.linear += [shape for shape in linear if shape not in self.linear]
        self.attention += [shape for shape in attention if shape not in self.attention]
        self.kernels.update(kernels or {})
        self.reads += [shape for shape in reads if shape not in self.reads]
        self.convert = self.convert or convert

    def linear_flops_per_s(self, tokens: int, inner: int, outer: int) -> float:
        return 1.0

    def attention_flops_per_s(self, heads: int, tokens: int, head_dim: int, causal: bool) -> float:
        return 1.0

    def read_scores_per_s(self, kind: str, heads: int, kv_heads: int, head_dim: int, rows: int, keys: int,
                          causal: bool, rule: str) -> float:
        return 1.0

    def kernel_work_per_s(self, key: Key) -> float:
        return 1.0

    def kernel_available(self, key: Key) -> bool:
        return True

    @property
    def calls(self) -> int:
        """Timed calls per pass: every shape, kernel and read, the bandwidth copy and the convert copy."""
        return len(self.linear) + len(self.attention) + len(self.kernels) + len(self.reads) + 1 + int(self.convert)

    def pass_flops(self) -> float:
        """FLOPs of one pass at a matmul's rate: MeasuredRates.measure's count of each shape's work, a kernel's
        as the FLOPs a matmul does in its time (`Kernel.matmul_flops_per_work`), a read's as its score products,
        which its softmax passes roughly double on a CPU."""
        return (sum(2 * t * i * o for t, i, o in self.linear)
                + sum(4 * h * t * t * d for h, t, d, _ in self.attention)
                + sum(work * KERNELS[key[0]].matmul_flops_per_work for key, work in self.kernels.items())
                + sum(4 * h * (k if kind in ("columns", *FUSED_READS) else r) * k * d
                      for kind, h, _, d, r, k, *_ in self.reads))

    def pass_bytes(self, compute_bits: int = 16) -> float:
        """Bytes one pass moves in its copies: 64 MiB read and written, and an upcast layout's 7B MLP
        weight read in bfloat16 and written in the compute dtype."""
        convert = CONVERT_VALUES * (2 + compute_bits / 8) if self.convert else 0.0
        return 2 * BANDWIDTH_VALUES * 2 + convert


def rate_probe_shapes(arch: Architecture, schedule: Schedule, *, quant: str = "fp16", batch: int = 1,
                      text_tokens: int | None = None, compute_bits: int = 16, upcast_layers: int = 0,
                      fused_layers: Collection[tuple[str, int]] = ()) -> ProbeShapes:
    """The shapes a row's rate probe times in each pass (those `predict_prefill` asks for)."""
    shapes = ProbeShapes()
    predict_prefill(arch, schedule, shapes, quant=quant, batch=batch, text_tokens=text_tokens,
                    compute_bits=compute_bits, upcast_layers=upcast_layers, fused_layers=fused_layers)
    return shapes


def rate_probe_passes(repeat: int) -> int:
    """Passes a measured row's rate probe makes: an untimed one and PASSES before its runs, one after
    each of its `repeat` timed runs, an untimed one and PASSES after them (profiling/matrix.py)."""
    return 2 * (1 + PASSES) + repeat


def rates_for(dtype: Any, device: torch.device | str = "cpu", weights: WeightSource | None = None) -> MeasuredRates:
    """A new probe of this machine's rates in `dtype`'s compute dtype (a DtypeChoice or a torch dtype)
    on `device`, borrowing `weights` between a row's runs: nothing is measured until a prediction asks
    for its shapes."""
    compute = getattr(dtype, "compute", dtype)
    return MeasuredRates(str(compute).removeprefix("torch."), torch.device(device).type, weights=weights)


def model_weights(model: torch.nn.Module) -> WeightSource:
    """A model's floating-point parameters by value count: the weight a rate probe borrows for a linear
    shape of as many values (the model's own of that shape, or another's memory of that size)."""
    by_count: dict[tuple[int, torch.dtype], torch.Tensor] = {}
    for parameter in model.parameters():
        if parameter.is_floating_point() and parameter.is_contiguous() and parameter.device.type != "meta":
            by_count.setdefault((parameter.numel(), parameter.dtype), parameter.detach())

    def weight(count: int, dtype: torch.dtype) -> torch.Tensor | None:
        return by_count.get((count, dtype))

    return weight


def row_prediction(profile: Any, schedule: Schedule, *, quant: str, batch: int, text_tokens: int | None,
                   dtype: Any, device: torch.device | str = "cpu", rates: ShapeRates | None = None,
                   expert_loads: dict[int, list[int]] | None = None,
                   fused_layers: Collection[tuple[str, int]] = ()) -> Prediction:
    """A profile row's predicted prefill: `dtype` is the plan's DtypeChoice (or a torch dtype), its
    compute dtype's rates measured on `device` unless `rates` is given; a MeasuredRates' passes price
    the row once each besides (`Prediction.passes_s`). `expert_loads`: the rows each expert of a sparse
    layer took in the row's forward; `fused_layers`: the layers ficoco's fused pass computed there (predict_prefill)."""
    arch, compute_bits, upcast = _row_layout(profile, quant, dtype)
    rates = rates or rates_for(dtype, device)

    def at(priced: ShapeRates) -> Prediction:
        return predict_prefill(arch, schedule, priced, quant=quant, batch=batch, text_tokens=text_tokens,
                               compute_bits=compute_bits, upcast_layers=upcast, expert_loads=expert_loads,
                               fused_layers=fused_layers)

    prediction = at(rates)
    if isinstance(rates, MeasuredRates) and (passes := [at(one) for one in rates.pass_rates()]):
        return Prediction.at_median_pass(passes, prediction)
    return prediction


def row_probe_shapes(profile: Any, schedule: Schedule, *, quant: str, batch: int, text_tokens: int | None,
                     dtype: Any, fused_layers: Collection[tuple[str, int]] = ()) -> ProbeShapes:
    """The shapes `row_prediction` of the same row asks its rates for (`MeasuredRates.expect`)."""
    arch, compute_bits, upcast = _row_layout(profile, quant, dtype)
    return rate_probe_shapes(arch, schedule, quant=quant, batch=batch, text_tokens=text_tokens,
                             compute_bits=compute_bits, upcast_layers=upcast, fused_layers=fused_layers)


def fused_layers(attention_kernels: Mapping[str, Any] | None) -> frozenset[tuple[str, int]]:
    """The (stage, layer) pairs whose attention ficoco's fused pass computed, from a row's `attention_kernels`
    record (profiling/kernels.py: implementation "probe")."""
    return frozenset((stage, layer) for stage, entries in (attention_kernels or {}).items() for entry in entries
                     if entry["implementation"] == "probe"
                     for layer in range(entry["layers"][0], entry["layers"][1] + 1))


def _row_layout(profile: Any, quant: str, dtype: Any) -> tuple[Architecture, int, int]:
    """A profile row's architecture, compute bits and upcast layers (`dtype`: a DtypeChoice or a torch dtype)."""
    arch = architecture(profile)
    compute = getattr(dtype, "compute", dtype)
    upcast = dtype.upcast_layers(arch.decoder.layers, quant) if hasattr(dtype, "upcast_layers") else 0
    return arch, torch.finfo(compute).bits, upcast
