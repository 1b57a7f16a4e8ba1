"""The analytic FLOPs checked against two counters: fvcore's `FlopCountAnalysis` and torch's
`FlopCounterMode`.

A verification builds the profile's model with random weights, runs the prefill of every
requested schedule (a plain forward: the LM head over every token unless asked for the last
one only) under both counters, and compares each stage with the accountant's count of the
same run in the `flops` convention, scope `all`, layer-exact.

How the counters are made to agree with the convention (docs/accounting.md, "Counters and their
blind spots"):

- fvcore traces with `torch.jit` and counts one multiply-add as one flop. Its handles are
  reduced to the matrix-type ops (its defaults for linear, matmul, bmm, addmm, mm, einsum and
  convolution, plus `aten::scaled_dot_product_attention`, `aten::baddbmm` and
  `aten::_convolution_mode` (a convolution with named padding: SigLIP's "valid" patch embedding)
  added here); its
  default norm and pooling handles are dropped because the convention counts matrix work only.
  Every op left without a handle is listed as skipped, and the ones that carry matrix work are
  named. fvcore's MACs are doubled explicitly (`FVCORE_FLOPS_PER_UNIT`).
- torch's counter gives CPU SDPA (the flash-CPU kernel) no formula and counts it as 0, so its
  run goes through the math attention backend, which decomposes into counted `bmm`s.

Attribution to stages is by module scope: the vision tower, the projector, the decoder (layers,
embedding, final norm) and the LM head of Hugging Face's LLaVA. FiCoCo's own matrix work (the
self-preserving compress `weights^T @ discarded`, FiCoCo-L's indirect correlation) runs inside
the reducing layer's forward. Every method's work (FiCoCo's and every other registered method's)
runs through `Handle.run_method`, keyed by where it runs; during a verification the handle's
`method_runner` sends each call through one small `nn.Module` per place (decoder layer i, tower
layer i, the projector), registered beside the model, so both counters see the method's work as
modules of their own. fvcore attributes an op to the innermost module and its owners, so the
method's work is outside the layer by construction; torch's counter attributes it to every module
running at the time, so the method's counts are subtracted from the stage that called it.

What ran is what is counted: LLaVA runs the whole vision tower and reads the second-to-last
layer, and torch.jit's trace drops the last layer as dead code, so the traced wrapper returns
every stage's and layer's output and fvcore sees the layer that ran (torch's counter sees it
anyway). The LM head covers every token of the plain forward, or one with `logits_to_keep=1`
when the last-token head is asked for.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from ficoco.accounting import architecture
from ficoco.accounting.architecture import Architecture
from ficoco.accounting.flops import STAGES, count_by_layer, count_by_stage, model_ops
from ficoco.accounting.reads import method_reads
from ficoco.accounting.schedule import Schedule, TokenPlan, plan_tokens
from ficoco.errors import FicocoError
from ficoco.methods.base import LayerWork, MethodSpec
from ficoco.methods.registry import METHODS
from ficoco.profiles import Profile
from ficoco.versions import report_environment

SCHEMA = "ficoco.verify/1"
# The memory guard's margin for --verify: fvcore's trace and the counters' records sit beside
# the model while it runs (the earlier fixed rule: a quarter of the weights).
VERIFY_MARGIN_FRACTION = 0.25
# fvcore counts one multiply-add as one "flop"; the flops convention counts it as two.
FVCORE_FLOPS_PER_UNIT = 2
# Families whose prefill the toolkit can run with FiCoCo (ficoco.apply).
# Stages compared with the accountant; "method" is FiCoCo's own work, reported beside them.
METHOD_STAGE = "method"
# The method's reads of a layer's attention (ficoco.methods.reads), reported and gated beside the stages.
PROBE_STAGE = "probe"
# ATen ops that carry matrix work: a skipped one would be a hole in the count.
MATRIX_OPS = frozenset({
    "aten::mm", "aten::bmm", "aten::addmm", "aten::baddbmm", "aten::addbmm", "aten::matmul", "aten::linear",
    "aten::einsum", "aten::_convolution", "aten::convolution", "aten::conv1d", "aten::conv2d", "aten::conv3d",
    "aten::conv_transpose1d", "aten::conv_transpose2d", "aten::conv_transpose3d", "aten::mv", "aten::addmv",
    "aten::dot", "aten::vdot", "aten::outer", "aten::ger", "aten::bilinear", "aten::tensordot",
    "aten::chain_matmul", "aten::linalg_multi_dot", "aten::scaled_dot_product_attention",
    "aten::_scaled_dot_product_attention_math", "aten::_scaled_dot_product_flash_attention_for_cpu",
    "aten::_native_multi_head_attention", "aten::_grouped_mm", "transformers::grouped_mm_fallback",
    "aten::linalg_solve_triangular", "aten::triangular_solve",
})


def is_matrix_op(name: str) -> bool:
    """Whether an ATen op (as fvcore names it) multiplies matrices."""
    return (name in MATRIX_OPS or "matmul" in name or "dot_product_attention" in name
            or name.startswith(("aten::conv", "aten::_conv")))


# ---- fvcore handles (MACs, fvcore's unit) -------------------------------------------------------------------

def _shape(value: Any) -> list[int]:
    from fvcore.nn.jit_handles import get_shape

    shape = get_shape(value)
    if shape is None:
        raise RuntimeError("fvcore's trace holds a tensor of unknown shape; cannot count its op")
    return list(shape)


def sdpa_flop_jit(inputs: list[Any], outputs: list[Any]) -> int:
    """`aten::scaled_dot_product_attention(q, k, v, ...)`: the score product q.k^T and the
    weighted values p.v, `B*H*Tq*Tk*d` MACs each (query heads: grouped KV heads are shared)."""
    query, key, value = (_shape(v) for v in inputs[:3])
    rows = math.prod(query[:-1])  # batch x heads x query tokens
    keys = key[-2]
    return rows * keys * query[-1] + rows * keys * value[-1]


def baddbmm_flop_jit(inputs: list[Any], outputs: list[Any]) -> int:
    """`aten::baddbmm(self, batch1, batch2, ...)`: the batched product's MACs."""
    batch, n, k = _shape(inputs[1])
    return batch * n * k * _shape(inputs[2])[-1]


def convolution_mode_flop_jit(inputs: list[Any], outputs: list[Any]) -> int:
    """`aten::_convolution_mode(input, weight, bias, stride, padding: str, ...)` (a convolution whose
    padding is named, SigLIP's "valid"): every output position of every output channel multiplies the
    weight's input channels x kernel, `N * prod(out spatial) * prod(weight shape)` MACs."""
    weight, output = _shape(inputs[1]), _shape(outputs[0])
    return output[0] * math.prod(output[2:]) * math.prod(weight)


def grouped_mm_macs(input_shape: list[int], weight_shape: list[int], out_shape: list[int]) -> int:
    """`_grouped_mm(input, weight, offs)` (a sparse layer's experts, transformers' grouped_mm path): every
    output element is an inner product over the input's last dimension, so `prod(out) * K` MACs whatever the
    grouping (2-D x 3-D: the token rows of every expert; 3-D x 3-D: a batch). Both operands 2-D (the weight's
    gradient) splits K among the groups instead: `M * N * K`."""
    inner = input_shape[-1]
    if len(input_shape) == 2 and len(weight_shape) == 2:
        return out_shape[-2] * out_shape[-1] * inner
    return math.prod(out_shape) * inner


def solve_triangular_macs(a_shape: list[int], b_shape: list[int], left: bool) -> int:
    """`linalg_solve_triangular(A, B, upper, left, unitriangular)` (the gated delta rule's UT transform):
    forward or back substitution with a C x C triangle over m right-hand sides, C(C-1)/2 x m MACs per matrix
    (the diagonal's divisions, absent when unitriangular, are not multiply-accumulates)."""
    size = a_shape[-1]
    rhs = b_shape[-1] if left else b_shape[-2]
    return math.prod(b_shape[:-2]) * size * (size - 1) // 2 * rhs


def grouped_mm_flop_jit(inputs: list[Any], outputs: list[Any]) -> int:
    """fvcore's handle for `aten::_grouped_mm` (MACs)."""
    return grouped_mm_macs(_shape(inputs[0]), _shape(inputs[1]), _shape(outputs[0]))


def solve_triangular_flop_jit(inputs: list[Any], outputs: list[Any]) -> int:
    """fvcore's handle for `aten::linalg_solve_triangular(A, B, upper, left, unitriangular)` (MACs)."""
    return solve_triangular_macs(_shape(inputs[0]), _shape(inputs[1]), bool(inputs[3].toIValue()))


def torch_custom_formulas() -> dict[Any, Callable[..., int]]:
    """Formulas torch's counter lacks (it counts their ops as 0), in FLOPs: the grouped matmul of sparse
    layers' experts (transformers' grouped_mm, and its fallback op where registered) and the triangular solves
    of Gated DeltaNet's chunked delta rule."""

    def grouped_mm(input_shape: Any, weight_shape: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
        return 2 * grouped_mm_macs(list(input_shape), list(weight_shape), list(out_shape))

    def solve_triangular(a_shape: Any, b_shape: Any, *args: Any, out_shape: Any = None, left: bool = True,
                         **kwargs: Any) -> int:
        if len(args) >= 2:  # upper, left given positionally
            left = bool(args[1])
        return 2 * solve_triangular_macs(list(a_shape), list(b_shape), left)

    formulas: dict[Any, Callable[..., int]] = {torch.ops.aten.linalg_solve_triangular: solve_triangular}
    if hasattr(torch.ops.aten, "_grouped_mm"):
        formulas[torch.ops.aten._grouped_mm] = grouped_mm
    fallback = getattr(getattr(torch.ops, "transformers", None), "grouped_mm_fallback", None)
    if fallback is not None:
        formulas[fallback] = grouped_mm
    return formulas


def fvcore_handles() -> dict[str, Callable[[list[Any], list[Any]], Any]]:
    """The matrix-type handles fvcore counts with (in MACs): its own and the added ones."""
    from fvcore.nn.jit_handles import (
        addmm_flop_jit,
        bmm_flop_jit,
        conv_flop_jit,
        einsum_flop_jit,
        linear_flop_jit,
        matmul_flop_jit,
    )

    return {
        "aten::addmm": addmm_flop_jit, "aten::bmm": bmm_flop_jit, "aten::_convolution": conv_flop_jit,
        "aten::einsum": einsum_flop_jit, "aten::matmul": matmul_flop_jit, "aten::mm": matmul_flop_jit,
        "aten::linear": linear_flop_jit,
        "aten::scaled_dot_product_attention": sdpa_flop_jit, "aten::baddbmm": baddbmm_flop_jit,
        "aten::_convolution_mode": convolution_mode_flop_jit,
        "aten::_grouped_mm": grouped_mm_flop_jit, "transformers::grouped_mm_fallback": grouped_mm_flop_jit,
        "aten::linalg_solve_triangular": solve_triangular_flop_jit,
    }


ADDED_FVCORE_HANDLES = ("aten::scaled_dot_product_attention", "aten::baddbmm", "aten::_convolution_mode",
                        "aten::_grouped_mm", "transformers::grouped_mm_fallback", "aten::linalg_solve_triangular")
DROPPED_FVCORE_HANDLES = ("aten::layer_norm", "aten::group_norm", "aten::batch_norm", "aten::instance_norm",
                          "aten::upsample_nearest2d", "aten::upsample_bilinear2d", "aten::adaptive_avg_pool2d",
                          "aten::grid_sampler")


# ---- results --------------------------------------------------------------------------------------------------

def relative_difference(measured: float, analytic: float) -> float:
    """(measured - analytic) / analytic; 0 when both are 0, infinite when only analytic is."""
    if analytic == 0:
        return 0.0 if measured == 0 else math.inf
    return (measured - analytic) / analytic


@dataclass(frozen=True)
class StageCheck:
    """One stage of one run: the accountant's count and the two counters', in FLOPs."""

    stage: str
    analytic: int
    fvcore: int
    torch: int

    @property
    def fvcore_diff(self) -> float:
        return relative_difference(self.fvcore, self.analytic)

    @property
    def torch_diff(self) -> float:
        return relative_difference(self.torch, self.analytic)

    def within(self, tolerance_percent: float) -> bool:
        """The gate: the analytic and fvcore counts agree within `tolerance_percent`."""
        return abs(self.fvcore_diff) * 100 <= tolerance_percent

    def to_json(self, tolerance_percent: float) -> dict[str, Any]:
        return {
            "stage": self.stage, "analytic_flops": self.analytic, "fvcore_flops": self.fvcore,
            "fvcore_macs": self.fvcore // FVCORE_FLOPS_PER_UNIT, "torch_flops": self.torch,
            "fvcore_rel_diff": _json_float(self.fvcore_diff), "torch_rel_diff": _json_float(self.torch_diff),
            "within_tolerance": self.within(tolerance_percent),
        }


@dataclass(frozen=True)
class LayerCheck:
    """One layer (or a layer-less part: layer None) of one run, in FLOPs."""

    stage: str
    layer: int | None
    tokens_in: int | None
    tokens_out: int | None
    analytic: int
    fvcore: int
    torch: int

    def to_json(self) -> dict[str, Any]:
        return {
            "stage": self.stage, "layer": self.layer, "tokens_in": self.tokens_in, "tokens_out": self.tokens_out,
            "analytic_flops": self.analytic, "fvcore_flops": self.fvcore, "torch_flops": self.torch,
            "fvcore_rel_diff": _json_float(relative_difference(self.fvcore, self.analytic)),
            "torch_rel_diff": _json_float(relative_difference(self.torch, self.analytic)),
        }


@dataclass(frozen=True)
class MethodCheck:
    """FiCoCo's own matrix work at one reducing layer, measured, beside two formulas.

    `matmul_formula` is the method's matrix products as the code computes them (FLOPs): the
    compress product `B * kept * removed * D`, and for FiCoCo-L the indirect correlation
    `B * removed * suffix * kept`. `paper_overhead` is the FiCoCo appendix's overhead formula
    as printed (MAC-style units, elementwise terms included); neither is gated.
    """

    stage: str
    layer: int
    visual_before: int
    removed: int
    fvcore: int
    torch: int
    matmul_formula: int
    paper_overhead: int

    def to_json(self) -> dict[str, Any]:
        return {
            "stage": self.stage, "layer": self.layer, "visual_before": self.visual_before, "removed": self.removed,
            "fvcore_flops": self.fvcore, "torch_flops": self.torch, "matmul_formula_flops": self.matmul_formula,
            "paper_overhead": self.paper_overhead,
        }


@dataclass
class RunCheck:
    """One variant and schedule: stages, layers, the method's work and what fvcore skipped."""

    schedule: Schedule
    plan: TokenPlan
    stages: list[StageCheck]
    layers: list[LayerCheck]
    method: list[MethodCheck]
    total: StageCheck
    skipped_ops: dict[str, int]
    uncalled_modules: list[str]

    @property
    def variant(self) -> str:
        return self.schedule.variant

    @property
    def skipped_matrix_ops(self) -> list[str]:
        return sorted(op for op in self.skipped_ops if is_matrix_op(op))

    def passed(self, tolerance_percent: float) -> bool:
        return all(s.within(tolerance_percent) for s in self.stages)

    def to_json(self, tolerance_percent: float) -> dict[str, Any]:
        return {
            "variant": self.variant, "schedule": self.schedule.to_json(),
            "visual_tokens": self.plan.visual_tokens, "llm_visual_tokens": self.plan.llm_visual_tokens,
            "passed": self.passed(tolerance_percent),
            "stages": [s.to_json(tolerance_percent) for s in self.stages],
            "total": self.total.to_json(tolerance_percent),
            "method": [m.to_json() for m in self.method],
            "skipped_ops": dict(sorted(self.skipped_ops.items())),
            "skipped_matrix_ops": self.skipped_matrix_ops,
            "uncalled_modules": self.uncalled_modules,
            "per_layer": [layer.to_json() for layer in self.layers],
        }


@dataclass
class Verification:
    """Every run of one verification, with what defines it."""

    model: str
    text_tokens: int
    batch: int
    lm_head_tokens: str
    tolerance_percent: float
    dtype: str
    runs: list[RunCheck] = field(default_factory=list)
    storage_dtype: str | None = None
    dtype_reason: str | None = None

    @property
    def passed(self) -> bool:
        return all(run.passed(self.tolerance_percent) for run in self.runs)

    @property
    def largest_fvcore_diff(self) -> float:
        return max((abs(s.fvcore_diff) for run in self.runs for s in run.stages), default=0.0)

    def to_json(self) -> dict[str, Any]:
        from importlib.metadata import PackageNotFoundError, version

        try:
            fvcore_version = version("fvcore")
        except PackageNotFoundError:
            fvcore_version = "unknown"
        return {
            "schema": SCHEMA, "model": self.model, "environment": report_environment(), "convention": "flops",
            "scope": "all", "layer_exact": True,
            "stages": list(STAGES), "text_tokens": self.text_tokens, "batch": self.batch,
            "lm_head_tokens": self.lm_head_tokens, "dtype": self.dtype, "storage_dtype": self.storage_dtype,
            "dtype_reason": self.dtype_reason,
            "tolerance_percent": self.tolerance_percent, "passed": self.passed,
            "gate": "analytic vs fvcore, every stage",
            "counters": {
                "fvcore": {"version": fvcore_version,
                           "unit": f"multiply-adds, x{FVCORE_FLOPS_PER_UNIT} = FLOPs",
                           "handles": sorted(fvcore_handles()), "handles_added": list(ADDED_FVCORE_HANDLES),
                           "handles_dropped": list(DROPPED_FVCORE_HANDLES)},
                "torch": {"version": torch.__version__, "unit": "FLOPs", "sdpa_backend": "math"},
            },
            "runs": [run.to_json(self.tolerance_percent) for run in self.runs],
        }


def _json_float(x: float) -> float | None:
    return None if math.isinf(x) or math.isnan(x) else x


# ---- the analytic side ----------------------------------------------------------------------------------------

def analytic_counts(arch: Architecture, plan: TokenPlan, *, batch: int, lm_head_tokens: str
                    ) -> tuple[dict[str, int], list[tuple[str, int | None, int]]]:
    """The accountant's count of the run in the flops convention: by stage and by layer."""
    ops = model_ops(arch, plan, batch=batch, lm_head_tokens=lm_head_tokens)
    return (count_by_stage(arch, plan, ops, "flops", batch=batch),
            count_by_layer(arch, plan, ops, "flops", batch=batch))


def method_formulas(spec: MethodSpec, arch: Architecture, plan: TokenPlan, *, batch: int, suffix_tokens: int,
                    settings: Mapping[str, Any] | None = None) -> list[tuple[int, int]]:
    """Per reducing layer: (the method's matrix products in FLOPs, its paper overhead), from the entry's
    `layer_macs` and `paper_overhead` formulas; `settings`: the schedule's (a rule changes the products)."""
    rows = []
    settings = {**spec.hyperparameters, **(settings or {})}
    taps = arch.deepstack_layers
    for red in plan.reductions:
        if red.stage == "vision":
            items, dim, merge = batch * plan.vision_items, arch.vision.hidden, arch.vision.merge
            # Qwen3-VL: the DeepStack features of the taps before this layer ride through the merge as extra
            # channels, each merge group's feature spread over its patches.
            riding = -(-sum(tap < red.layer for tap in taps) * arch.decoder.hidden // merge)
        else:
            items, dim, merge = batch, arch.decoder.hidden, 1
            # The features DeepStack still adds after this layer ride through FiCoCo-L's merge.
            riding = max(0, len(taps) - red.layer) * arch.decoder.hidden
        work = LayerWork(red.stage, items, red.visual_before, red.removed, dim + riding, merge, suffix_tokens,
                         settings)
        paper = spec.paper_overhead(red.stage, red.visual_before, red.removed, dim) if spec.paper_overhead else 0
        rows.append((2 * spec.layer_macs(work), items * paper))
    return rows


# ---- routing the method through modules -----------------------------------------------------------------------

class MethodWork(nn.Module):
    """A method's own work at one place of the forward (a decoder layer, a tower layer, the projector),
    as a module: `Handle.method_runner` sends every call made there here during a verification."""

    def __init__(self, running: set[str] | None = None) -> None:
        super().__init__()
        self.calls = 0
        # The stage modules running (by path) whenever this place's work ran: torch's counter gives them its
        # count too (a cut after Qwen2-VL's merger runs inside the merger and the tower, Qwen3-VL's only
        # inside the tower).
        self._running = running if running is not None else set()
        self.inside: set[str] = set()

    def forward(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        self.inside |= self._running
        return function(*args, **kwargs)


class ProbeWork(nn.Module):
    """A method's reads of a layer's attention at one place (ficoco.methods.reads), as a module:
    `Handle.probe_runner` sends every read made there here during a verification. A read may run inside
    the method's own step (FiCoCo's correlate rows), a layer or a stage: every module running when it ran
    (`inside`: stage and layer modules by path, method places by name) is recorded, so that torch's counter,
    which gives those modules its count too, can have it taken out of them."""

    def __init__(self, running: set[str], methods: list[str]) -> None:
        super().__init__()
        self.calls = 0
        self._running, self._methods = running, methods
        self.inside: set[str] = set()

    def forward(self, function: Callable[..., Any], *args: Any) -> Any:
        self.calls += 1
        self.inside |= self._running | set(self._methods)
        return function(*args)


class _Place:
    """Which method places are running their work now (a MethodWork call that a read may run inside)."""

    def __init__(self, method: nn.ModuleDict) -> None:
        self.active: list[str] = []
        self._hooks = []
        for name, module in method.items():
            path = f"ficoco_method.{name}"
            self._hooks.append(module.register_forward_pre_hook(lambda *_, p=path: self.active.append(p)))
            self._hooks.append(module.register_forward_hook(lambda *_, p=path: self.active.remove(p)))

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []


class _Running:
    """Which of the stage modules are running now (forward pre- and post-hooks), by path."""

    def __init__(self, modules: dict[str, nn.Module]) -> None:
        self.paths: set[str] = set()
        self._hooks = []
        for path, module in modules.items():
            self._hooks.append(module.register_forward_pre_hook(functools.partial(self._enter, path)))
            self._hooks.append(module.register_forward_hook(functools.partial(self._leave, path)))

    def _enter(self, path: str, *_: Any) -> None:
        self.paths.add(path)

    def _leave(self, path: str, *_: Any) -> None:
        self.paths.discard(path)

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []


def _method_key(stage: str, layer: int | None) -> int | tuple[str, int | None]:
    """`Handle.run_method`'s key of a place: a decoder layer's index, or (stage, layer)."""
    return layer if stage == "llm" and layer is not None else (stage, layer)


def _method_module_name(key: Any) -> str:
    """The method module of `Handle.run_method`'s key: a decoder layer (int), ("vision", layer) or
    ("projector", None)."""
    if isinstance(key, int):
        return f"llm_{key}"
    stage, layer = key
    return stage if layer is None else f"{stage}_{layer}"


def _tensors(output: Any) -> list[Tensor]:
    """Every tensor in a module's output (tensor, tuple, list, dict or ModelOutput)."""
    if isinstance(output, Tensor):
        return [output]
    if isinstance(output, dict):
        output = list(output.values())
    if isinstance(output, (tuple, list)):
        return [t for item in output for t in _tensors(item)]
    return []


class Prefill(nn.Module):
    """The model's plain forward on positional tensors, for torch.jit tracing.

    It returns the logits and the outputs of every stage and layer: the tracer drops work whose
    result nothing returns (LLaVA runs the vision tower's last layer but reads the one before),
    and the count must cover what ran.
    """

    def __init__(self, model: nn.Module, method: nn.ModuleDict, logits_to_keep: int, ran: list[nn.Module],
                 names: list[str], probe: nn.ModuleDict | None = None) -> None:
        super().__init__()
        self.model = model
        self._names = names
        self.ficoco_method = method
        self.ficoco_probe = probe if probe is not None else nn.ModuleDict()
        self._logits_to_keep = logits_to_keep
        self._outputs: list[Tensor] = []
        self._hooks = [module.register_forward_hook(self._keep) for module in ran]

    def _keep(self, module: nn.Module, args: Any, output: Any) -> None:
        self._outputs.extend(_tensors(output))

    def close(self) -> None:
        """Remove the hooks from the model's modules."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def forward(self, *tensors: Tensor) -> tuple[Tensor, ...]:
        self._outputs = []
        out = self.model(**dict(zip(self._names, tensors, strict=True)), logits_to_keep=self._logits_to_keep)
        ran, self._outputs = self._outputs, []
        return (out.logits, *ran, *_cache_tensors(out))


def _cache_tensors(output: Any) -> list[Tensor]:
    """Every tensor the output's cache holds: a Gated DeltaNet layer's last state update (its final chunk's
    product) only reaches the cache, and the trace would drop it as dead code."""
    from ficoco.models import hf_compat as hf

    cache = hf.output_cache(output)
    if cache is None:
        return []
    return [t for layer in hf.cache_layers(cache) for t in _tensors(list(vars(layer).values()))]


# ---- measuring ------------------------------------------------------------------------------------------------

@dataclass
class _Measured:
    counts: dict[str, int]  # module path (from Prefill) -> FLOPs
    total: int
    skipped: dict[str, int] = field(default_factory=dict)
    uncalled: list[str] = field(default_factory=list)


def _count_fvcore(prefill: Prefill, args: tuple[Tensor, ...]) -> _Measured:
    from fvcore.nn import FlopCountAnalysis

    analysis = FlopCountAnalysis(prefill, args)
    analysis.clear_op_handles()
    analysis.set_op_handle(**fvcore_handles())
    analysis.unsupported_ops_warnings(False).uncalled_modules_warnings(False).tracer_warnings("none")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        by_module = analysis.by_module()
    counts = {name: int(value) * FVCORE_FLOPS_PER_UNIT for name, value in by_module.items()}
    containers = (nn.ModuleList, nn.ModuleDict, nn.Sequential)
    modules = dict(prefill.named_modules())
    uncalled = sorted(name for name in analysis.uncalled_modules()
                      if name in modules and not isinstance(modules[name], containers)
                      and any(True for _ in modules[name].parameters(recurse=False)))
    return _Measured(counts=counts, total=counts[""], skipped=dict(analysis.unsupported_ops()), uncalled=uncalled)


def _count_torch(prefill: Prefill, args: tuple[Tensor, ...]) -> _Measured:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False, custom_mapping=torch_custom_formulas())
    # CPU SDPA's flash kernel has no flop formula (counted as 0); the math backend decomposes
    # into matmuls the counter sees.
    with sdpa_kernel(SDPBackend.MATH), counter:
        prefill(*args)
    root = type(prefill).__name__
    counts: dict[str, int] = {}
    for name, by_op in counter.get_flop_counts().items():
        if name == root:
            key = ""
        elif name.startswith(root + "."):
            key = name[len(root) + 1:]
        else:
            continue  # "Global" is the root's total
        counts[key] = int(sum(by_op.values()))
    return _Measured(counts=counts, total=int(counter.get_total_flops()))


@dataclass(frozen=True)
class _Paths:
    """Module paths (from Prefill) of the stages and layers, and the modules themselves. A stage may own
    modules besides its own (`extra`): Qwen3-VL's DeepStack mergers are the projector's."""

    stages: dict[str, str]
    vision_layers: list[str]
    decoder_layers: list[str]
    modules: list[nn.Module]
    extra: dict[str, list[str]] = field(default_factory=dict)
    # Per method module path: the stage module paths that were running when its work ran (set by _measure).
    running: dict[str, set[str]] = field(default_factory=dict)

    def of(self, stage: str) -> list[str]:
        """Every module path the stage counts."""
        return [self.stages[stage], *self.extra.get(stage, [])]


def _module_paths(model: nn.Module) -> _Paths:
    """Where the stages and layers sit in the model, found by identity (the adapter's modules; an adapter's
    `deepstack_mergers()`, where it has one, gives the projector's DeepStack mergers)."""
    from ficoco.models import adapter_for

    adapter = adapter_for(model)
    names = {id(module): f"model.{name}" for name, module in model.named_modules()}
    stage_modules = adapter.stage_modules()
    deepstack = [merger for _, merger in getattr(adapter, "deepstack_mergers", list)()]
    modules = [*stage_modules.values(), *deepstack, *adapter.vision_layers, *adapter.decoder_layers]
    return _Paths(
        stages={stage: names[id(module)] for stage, module in stage_modules.items()},
        vision_layers=[names[id(layer)] for layer in adapter.vision_layers],
        decoder_layers=[names[id(layer)] for layer in adapter.decoder_layers],
        modules=modules,
        extra={"projector": [names[id(merger)] for merger in deepstack]} if deepstack else {},
    )


def _attribute(measured: _Measured, paths: _Paths, method_paths: list[tuple[str, int | None, str]], *,
               method_inside: bool, running: dict[str, set[str]] | None = None
               ) -> tuple[dict[str, int], dict[tuple[str, int | None], int], list[int]]:
    """Stage and layer counts of one counter, the method's work taken out of the layer that ran it.

    `method_inside`: the counter also attributes the method's work to the modules that were
    running when it ran (torch's counter); fvcore's owner mode does not. `running`: per method
    path, the stage module paths that were running when its work ran (work outside the layers, around
    the projector, is taken out of each of them).
    """
    get = measured.counts.get
    method = [get(path, 0) for _, _, path in method_paths]
    inside: Counter[tuple[str, int | None]] = Counter()
    counts = dict(measured.counts)
    if method_inside:
        for (stage, layer, path), flops in zip(method_paths, method, strict=True):
            inside[(stage, layer)] += flops
            if layer is None:
                for owner in (running or {}).get(path, {paths.stages[stage]}):
                    counts[owner] = counts.get(owner, 0) - flops
    get = counts.get
    stages = {stage: sum(get(path, 0) for path in paths.of(stage)) for stage in paths.stages}
    # Qwen2-VL's projector (the PatchMerger) is a submodule of its vision tower (Qwen3-VL's DeepStack mergers
    # too), and both counters include a submodule's work in its owner's: count it in its own stage only.
    for outer, outer_path in paths.stages.items():
        stages[outer] -= sum(get(path, 0) for inner in paths.stages if inner != outer for path in paths.of(inner)
                             if path.startswith(outer_path + "."))
    layers: dict[tuple[str, int | None], int] = {}
    for stage, layer_paths in (("vision", paths.vision_layers), ("llm", paths.decoder_layers)):
        for layer, path in enumerate(layer_paths):
            layers[(stage, layer)] = get(path, 0) - inside[(stage, layer)]
        stages[stage] -= sum(inside[(stage, layer)] for layer in range(len(layer_paths)))
        # The parts outside the layers (patch embedding; token embedding and final norm).
        layers[(stage, None)] = stages[stage] - sum(layers[(stage, layer)] for layer in range(len(layer_paths)))
    layers[("projector", None)] = stages["projector"]
    layers[("lm_head", None)] = stages["lm_head"]
    return stages, layers, method


@dataclass(frozen=True)
class _Probes:
    """The method's reads of a layer's attention, by place: each place's module path, and the module paths
    that were running whenever a read ran there (stage and layer modules, method places)."""

    paths: list[str]
    inside: dict[str, set[str]]

    def counted(self, measured: _Measured) -> list[int]:
        return [measured.counts.get(path, 0) for path in self.paths]

    def taken_out(self, measured: _Measured) -> _Measured:
        """torch's counter's counts with every read's taken out of the modules that were running when it ran
        (that counter gives them its count as well; fvcore gives an op to its innermost module's owners only)."""
        counts = dict(measured.counts)
        for path in self.paths:
            flops = measured.counts.get(path, 0)
            for owner in self.inside.get(path, ()):
                counts[owner] = counts.get(owner, 0) - flops
        return dataclasses.replace(measured, counts=counts)


def _measure(model: nn.Module, inputs: dict[str, Tensor], schedule: Schedule, plan: TokenPlan,
             logits_to_keep: int) -> tuple[_Measured, _Measured, _Paths, list[tuple[str, int | None, str]], _Probes,
                                           int | None, tuple[int, ...], dict[tuple[str, int, str], int]]:
    """Run the prefill of `schedule` under fvcore and under torch's counter; the last items are the
    visual tokens per item the run handed the LLM, as measured (a method acting before the LLM), the
    query-key pairs every vision layer ran where the tower attends within windows (else empty), and what every
    step removed where the counts are the input's own (`Handle.measured_steps`; else empty)."""
    import ficoco.api
    from ficoco.models import adapter_for
    from ficoco.models.patching import Patches

    paths = _module_paths(model)
    # A method's work where it runs (a decoder method's probes and steps in decoder layer i, a vision
    # method's in tower layer i or around the projector) goes through its own module (llm_i, vision_i,
    # projector), so both counters see it apart from the layer or stage that called it.
    keys: list[tuple[str, int | None]] = [("llm", i) for i in range(len(paths.decoder_layers))]
    keys += [("vision", i) for i in range(len(paths.vision_layers))] + [("projector", None)]
    module_names = [_method_module_name(_method_key(*key)) for key in keys]
    # Prefill's module paths are the model's under "model."; the stage modules are watched while they run.
    owners = {path: module for path, module in _stage_module_items(model, paths)}
    running = _Running(owners)
    method = nn.ModuleDict({name: MethodWork(running.paths) for name in module_names})
    method_paths = [(stage, layer, f"ficoco_method.{name}")
                    for (stage, layer), name in zip(keys, module_names, strict=True)]
    # The method's reads of a layer's attention (ficoco.methods.reads) through modules of their own as well,
    # watching every stage and layer module and method place that runs when a read does.
    watched = {**owners, **{f"model.{name}": module for name, module in model.named_modules()
                            if f"model.{name}" in (*paths.vision_layers, *paths.decoder_layers)}}
    probe_running = _Running(watched)
    places = _Place(method)
    probe = nn.ModuleDict({name: ProbeWork(probe_running.paths, places.active) for name in module_names})
    names = [name for name, value in inputs.items() if isinstance(value, Tensor)]
    args = tuple(inputs[name] for name in names)
    handle = None
    if schedule.variant != "vanilla":
        handle = ficoco.api.apply(model, schedule.variant, schedule=schedule)
        handle.method_runner = lambda key, function, *a, **k: method[_method_module_name(key)](function, *a, **k)
        handle.probe_runner = lambda key, function, *a: probe[_method_module_name(key)](function, *a)
    prefill = Prefill(model, method, logits_to_keep, paths.modules, names, probe)
    traceable = Patches()
    try:
        # A family whose forward torch.jit cannot trace as is (LLaVA-NeXT's AnyRes unpadding rounds
        # traced sizes) puts in a stand-in that gives the same result.
        getattr(adapter_for(model), "patch_for_tracing", lambda _: None)(traceable)
        with torch.no_grad():
            fv = _count_fvcore(prefill, args)
            _check_calls(method, plan, "fvcore")
            tc = _count_torch(prefill, args)
            _check_calls(method, plan, "torch")
    finally:
        traceable.undo()
        prefill.close()
        running.close()
        probe_running.close()
        places.close()
        if handle is not None:
            handle.remove()
    # Windowed attention (Qwen2.5-VL under a reduction): the query-key pairs the run's windows held per layer.
    pairs = tuple(handle.vision_attention_pairs[layer] for layer in range(len(paths.vision_layers))) \
        if handle is not None and handle.vision_attention_pairs else ()
    paths = dataclasses.replace(paths, running={path: set(method[path.rpartition(".")[2]].inside)
                                                for _, _, path in method_paths})
    probes = _Probes([f"ficoco_probe.{name}" for name in module_names],
                     {f"ficoco_probe.{name}": set(probe[name].inside) for name in module_names})
    measured = handle.measured_tokens_per_item if handle is not None else None
    return fv, tc, paths, method_paths, probes, measured, pairs, dict(handle.measured_steps) if handle else {}


def _stage_module_items(model: nn.Module, paths: _Paths) -> list[tuple[str, nn.Module]]:
    """(Prefill path, module) of every stage module and a stage's extra modules."""
    modules = {f"model.{name}": module for name, module in model.named_modules()}
    wanted = [*paths.stages.values(), *(path for extra in paths.extra.values() for path in extra)]
    return [(path, modules[path]) for path in wanted]


def _check_calls(method: nn.ModuleDict, plan: TokenPlan, counter: str) -> None:
    """Every reducing layer of the plan ran its method's work under the counter (then reset the calls)."""
    for red in plan.reductions:
        if red.where != "in_layer" or red.stage not in ("vision", "llm"):
            continue
        work = method[_method_module_name(_method_key(red.stage, red.layer))]
        if not work.calls:
            raise RuntimeError(f"under {counter} the forward did not reduce at {red.stage} layer {red.layer}, "
                               "which the schedule plans")
    for work in method.values():
        work.calls = 0


# ---- the verification ---------------------------------------------------------------------------------------

def check_supported(profile: Profile) -> None:
    """Refuse families whose prefill the toolkit cannot run with FiCoCo yet (one-line error)."""
    from ficoco.models import supported_families

    if profile.family not in supported_families():
        raise FicocoError(
            f"the traced count (verify) is not supported yet for the {profile.family} family ({profile.name}): "
            f"FiCoCo runs inside {', '.join(supported_families())} models only so far; "
            "the analytic count (ficoco.flops) works for every family")


def verify_run(model: nn.Module, arch: Architecture, schedule: Schedule, *, text_tokens: int, batch: int = 1,
               lm_head_tokens: str = "all", seed: int = 0, inputs: dict[str, Tensor] | None = None) -> RunCheck:
    """Verify one schedule on a built model (patched for the run, restored after). `inputs`: the prefill's own
    (`batch` prompts of `text_tokens` text tokens, laid out as the synthetic ones: an image whose content sets a
    method's count, PixelPrune's); None: the synthetic inputs of `seed`."""
    from ficoco.models import family_module, synthetic_inputs

    if lm_head_tokens not in ("all", "last"):
        raise FicocoError(f"unknown LM-head mode '{lm_head_tokens}': choose from all, last")
    plan = plan_tokens(arch, schedule, text_tokens=text_tokens)
    if inputs is None:
        inputs = synthetic_inputs(model, batch=batch, text_tokens=text_tokens, seed=seed)
    fv, tc, paths, method_paths, probes, measured, pairs, steps = _measure(model, inputs, schedule, plan,
                                                                           1 if lm_head_tokens == "last" else 0)
    fv_probe, tc_probe = probes.counted(fv), probes.counted(tc)
    tc = probes.taken_out(tc)
    if steps:
        # Counts the input decided as it ran (MustDrop's thresholds): the accountant counts the run at them.
        from ficoco.accounting.methods import at_measured_steps

        schedule = at_measured_steps(schedule, steps)
        plan = plan_tokens(arch, schedule, text_tokens=text_tokens)
    elif schedule.settings_dict().get("adaptive") and measured is not None:
        # An adaptive count (PruMerge+ without --keep) is known only once the tower ran: the accountant
        # counts the run at the count it measured (the same for every item, or the run refused).
        from ficoco.accounting.methods import at_measured_count

        schedule = at_measured_count(arch, schedule, measured)
        plan = plan_tokens(arch, schedule, text_tokens=text_tokens)
    if pairs:
        plan = dataclasses.replace(plan, vision_attention_pairs=pairs)
    by_stage, by_layer = analytic_counts(arch, plan, batch=batch, lm_head_tokens=lm_head_tokens)
    fv_stages, fv_layers, fv_method = _attribute(fv, paths, method_paths, method_inside=False)
    tc_stages, tc_layers, tc_method = _attribute(tc, paths, method_paths, method_inside=True, running=paths.running)
    stages = [StageCheck(s, by_stage[s], fv_stages[s], tc_stages[s]) for s in STAGES]
    tokens = {"vision": plan.vision, "llm": plan.llm}
    layers = []
    for stage, layer, count in by_layer:
        n_in, n_out = tokens[stage][layer] if layer is not None else (None, None)
        layers.append(LayerCheck(stage, layer, n_in, n_out, count, fv_layers.get((stage, layer), 0),
                                 tc_layers.get((stage, layer), 0)))
    # Tokens after the image span: the rows FiCoCo-L's task prior and indirect product read.
    suffix = plan.text_tokens - family_module(model.config.model_type).PREFIX_TOKENS
    spec = METHODS.get(schedule.variant)  # None: vanilla, which adds no work of its own
    if spec is not None and spec.layer_macs is None:
        # The method's own matrix work is a stage of its own, gated like the others: the registry's
        # extra cost terms (multiply-accumulates) against what the counters saw in its modules.
        from ficoco.accounting.methods import extra_macs

        analytic = 2 * sum(macs for _, _, macs in extra_macs(arch, schedule, plan, batch=batch))
        stages.append(StageCheck(METHOD_STAGE, analytic, sum(fv_method), sum(tc_method)))
        method = []
    elif spec is not None:
        # Checked per reducing layer, against the entry's `layer_macs` formula (FiCoCo-V and -L).
        formulas = method_formulas(spec, arch, plan, batch=batch, suffix_tokens=suffix,
                                   settings=schedule.settings_dict())
        place = {(stage, layer): k for k, (stage, layer, _) in enumerate(method_paths)}
        method = [MethodCheck(red.stage, red.layer, red.visual_before, red.removed, fv_method[place[key]],
                              tc_method[place[key]], formula, paper)
                  for red, (formula, paper) in zip(plan.reductions, formulas, strict=True)
                  for key in [(red.stage, red.layer)]]
    else:
        method = []
    # The method's reads of a layer's attention beside its kernel: their score products against the reads' shapes
    # (ficoco.accounting.reads), which the prediction prices; no convention of `ficoco flops` counts them.
    reads = method_reads(arch, schedule, plan, batch=batch)
    if reads or any(fv_probe) or any(tc_probe):
        stages.append(StageCheck(PROBE_STAGE, 2 * sum(read.macs for read in reads), sum(fv_probe), sum(tc_probe)))
    total = StageCheck("total", sum(by_stage.values()), fv.total - sum(fv_method) - sum(fv_probe),
                       tc.total - sum(tc_method) - sum(tc_probe))
    return RunCheck(schedule=schedule, plan=plan, stages=stages, layers=layers, method=method, total=total,
                    skipped_ops=fv.skipped, uncalled_modules=fv.uncalled)


def verify(profile: Profile, schedules: list[Schedule], *, text_tokens: int | None = None, batch: int = 1,
           lm_head_tokens: str = "all", tolerance_percent: float = 0.5, seed: int = 0,
           model: nn.Module | None = None, dtype: str = "auto") -> Verification:
    """Build `profile`'s model (random weights on the CPU, in `dtype`: auto is the fastest
    that fits, see choose_dtype) and verify every schedule; a model that would not fit in
    memory is refused before it is built (FicocoError with what would fit).

    `model` reuses an already built model of the same profile (tests).
    """
    from ficoco.api import build_model
    from ficoco.machine.dtype_choice import dtype_name
    from ficoco.machine.memory_guard import VanillaRow, resolve_dtype_and_memory

    check_supported(profile)
    if tolerance_percent < 0:
        raise FicocoError(f"tolerance_percent={tolerance_percent:g} must not be negative")
    if batch < 1:
        raise FicocoError(f"batch={batch} must be at least 1")
    arch = architecture(profile)
    text = arch.text_tokens if text_tokens is None else text_tokens
    storage, reason = None, None
    if model is None:
        # The counters keep their own records beside the model: a quarter more margin.
        choice, _ = resolve_dtype_and_memory(profile, [VanillaRow(batch=batch)], dtype, "cpu", ["fp16"],
                                             text_tokens=text, lm_head_tokens=lm_head_tokens,
                                             margin_fraction=VERIFY_MARGIN_FRACTION, advice=("dtype", "layers"))
        model = build_model(profile, dtype=choice, seed=seed, check_memory=False)
        storage, reason = dtype_name(choice.storage), choice.reason
    compute = str(next(model.parameters()).dtype).removeprefix("torch.")
    result = Verification(model=arch.name, text_tokens=text, batch=batch, lm_head_tokens=lm_head_tokens,
                          tolerance_percent=tolerance_percent, dtype=compute, storage_dtype=storage,
                          dtype_reason=reason)
    for schedule in schedules:
        result.runs.append(verify_run(model, arch, schedule, text_tokens=text, batch=batch,
                                      lm_head_tokens=lm_head_tokens, seed=seed))
    return result
