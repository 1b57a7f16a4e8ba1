"""Analytic cost accounting (no torch): FLOPs, KV cache, weights, memory access, roofline.

`resolve_schedule` turns a `ScheduleRequest` (keep / preset / tflops / schedule) into a schedule; `account` costs one
(variant, schedule, quant) row under a named convention and scope.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ficoco.accounting.architecture import Architecture, architecture, parameter_counts
from ficoco.accounting.flops import (
    CONVENTIONS,
    SCOPES,
    check_scope,
    count_by_layer,
    count_by_stage,
    model_ops,
    scope_total,
)
from ficoco.accounting.memory import (
    KV_FIGURES,
    LinearState,
    Quant,
    activation_peak_bytes,
    linear_state,
    llm_viewer_kv_cache_bytes,
    make_quant,
    memory_access_bytes,
    roofline_seconds,
    stored_kv_cache_bytes,
    weight_bytes,
)
from ficoco.accounting.methods import extra_macs, method_schedule
from ficoco.accounting.planners import plan
from ficoco.accounting.request import ScheduleRequest
from ficoco.accounting.schedule import (
    VARIANTS,
    BudgetError,
    PlanRequest,
    Schedule,
    TokenPlan,
    plan_tokens,
    preset_message,
)
from ficoco.errors import FicocoError
from ficoco.methods.registry import METHODS, method
from ficoco.profile_records import Hardware

__all__ = [
    "CONVENTIONS", "KV_FIGURES", "SCOPES", "VARIANTS", "Architecture", "BudgetError", "CostRow", "CountOptions",
    "Quant", "Schedule", "TokenPlan", "account", "architecture", "make_quant", "parameter_counts", "per_layer",
    "PlanRequest", "ScheduleRequest", "preset_message", "resolve_schedule", "resolve_side_by_side", "method_schedule",
    "method_hyperparameters",
]

# The unit each convention's totals are in, for labels ("TFLOPs", "TMACs", ...).
UNITS = {"flops": "TFLOPs", "macs": "TMACs", "llm-viewer": "TOPs (LLM-Viewer)", "paper": "TFLOPs (paper)",
         "visual-macs": "TMACs (visual tokens)"}
# Per multiply-accumulate of a method's extra matrix work, in each convention's unit.
_EXTRA_PER_MAC = {"flops": 2, "macs": 1, "llm-viewer": 2, "paper": 1, "visual-macs": 1}


@dataclass(frozen=True)
class CountOptions:
    """How to count: convention, scope, layer-exact or equivalent, the input's shape."""

    convention: str = "flops"
    scope: str = "llm"
    equivalent: bool = False
    batch: int = 1
    text_tokens: int | None = None
    lm_head_tokens: str = "all"

    def __post_init__(self) -> None:
        if self.convention not in CONVENTIONS:
            raise FicocoError(f"unknown convention '{self.convention}': choose from {', '.join(CONVENTIONS)}")
        check_scope(self.convention, self.scope)
        if self.batch < 1:
            raise FicocoError(f"batch={self.batch} must be at least 1")
        if self.text_tokens is not None and self.text_tokens < 1:
            raise FicocoError(f"text_tokens={self.text_tokens} must be at least 1")


def compute_tera(arch: Architecture, schedule: Schedule, opts: CountOptions) -> float:
    """The schedule's cost in the options' convention and scope, in tera-units."""
    plan = plan_tokens(arch, schedule, text_tokens=opts.text_tokens, equivalent=opts.equivalent)
    ops = model_ops(arch, plan, batch=opts.batch, lm_head_tokens=opts.lm_head_tokens)
    return scope_total(count_by_stage(arch, plan, ops, opts.convention, batch=opts.batch), opts.scope) / 1e12


def _budget_label(opts: CountOptions) -> str:
    return f"{UNITS[opts.convention]} ({opts.convention}, scope {opts.scope}, " + (
        "equivalent)" if opts.equivalent else "layer-exact)")


def resolve_schedule(arch: Architecture, variant: str, opts: CountOptions, request: ScheduleRequest | None = None,
                     *, keep: int | None = None, tflops: float | None = None,
                     schedule: str | Mapping[int, int] | None = None, shape: str | None = None,
                     first_layer: int | None = None, preset: int | None = None,
                     hyperparameters: Mapping[str, Any] | None = None) -> Schedule:
    """The schedule of `variant` for `request` (a `ScheduleRequest`: at most one of keep / preset /
    tflops / schedule, with shape and first_layer), planned by the planner the method's registry entry
    names (ficoco.accounting.planners.plan). The keywords are the request's own spelling, for a caller
    without one (`resolve_schedule(arch, "v", opts, keep=192)`); give one or the other.

    `preset` N is the literature's "N tokens" row and means the same as `keep` N (each method's
    `--keep` counts what its papers count). A method without an official default setting
    (`MethodSpec.default_setting`: FiCoCo-V and -L) needs one of them; every other method falls
    back to its official default setting.
    """
    request = ScheduleRequest.of(request, keep=keep, preset=preset, tflops=tflops, schedule=schedule, shape=shape,
                                 first_layer=first_layer)
    if variant != "vanilla" and variant not in METHODS:  # the registry as it is now (entries may be added)
        raise FicocoError(f"unknown variant '{variant}': choose from vanilla, {', '.join(METHODS)}")
    if variant == "vanilla":
        return Schedule("vanilla")
    spec = method(variant)
    if arch.video_frames is not None and not spec.pooled_grid and not spec.video_slices:
        # A Qwen video layout (issue 25): a method before the LLM reduces every temporal slice as one item
        # (`MethodSpec.video_slices`: the tower's items are the slices, planned with keep per item); HoliTom and
        # FlashVID cut the slices together; a method in the decoder reduces image placeholders only.
        raise FicocoError(f"variant={variant}: {spec.title} on {arch.name} reduces images, and a video here "
                          "passes it unreduced: give an image (no frames=), or variant=holitom for a video")
    return plan(arch, spec, plan_request(request, opts, lambda s: compute_tera(arch, s, opts), hyperparameters))


def plan_request(request: ScheduleRequest, opts: CountOptions, cost: Any,
                 hyperparameters: Mapping[str, Any] | None = None) -> PlanRequest:
    """What a method's planner reads (`PlanRequest`): the request, the caller's hyperparameters and
    how a `tflops` budget is counted (`cost`: a schedule -> tera-units under `opts`)."""
    return PlanRequest(**request.fields(), hyperparameters=dict(hyperparameters or {}), cost=cost,
                       label=_budget_label(opts), equivalent=opts.equivalent, scope=opts.scope)


@dataclass(frozen=True)
class CostRow:
    """The analytic cost of one (variant, schedule, quant) under one set of count options.

    `kv_cache_bytes` is the KV cache after the prefill in the figure of the convention's source,
    and `kv_cache_figure` names it (`KV_FIGURES`):
    - llm-viewer: "llm-viewer", LLM-Viewer's own figure, values x kv_bits / 8 (no scales or zero
      points), so that a quantized row is the tool's (LLaVA-1.5-7B int8: 166.7 MB);
    - flops, macs, paper, visual-macs: "stored". Their sources (torch's counter, fvcore, the FiCoCo
      appendix, PDrop's and SparseVLM's tables) count operations and define no KV figure, so the
      row reports the cache as transformers stores it (177.1 MB for the same cache).
    `kv_cache_stored_bytes` is always the stored cache (16-bit compute; quantized: codes and a 16-bit
    scale and zero point per group), what `ficoco profile` measures and what the footprint holds.
    Unquantized, the two are equal.
    """

    variant: str
    quant: Quant
    schedule: Schedule
    plan: TokenPlan
    tflops: float
    tflops_by_stage: dict[str, float]
    kv_cache_bytes: float
    kv_cache_stored_bytes: float
    kv_cache_figure: str
    weight_bytes: float
    memory_access_bytes: float
    footprint_bytes: float
    roofline_s: float | None
    # The method's own matrix work beyond the model's layers (score rows, recomputed projections,
    # similarity matrices), in the convention's unit and not in `tflops`: (layer, term, tera-units).
    method_terms: tuple[tuple[int | None, str, float], ...] = ()
    # A hybrid decoder's linear-attention layers (Qwen3.5): their fixed recurrent and convolution state,
    # held beside the KV cache of the full-attention layers (whatever the tokens: fewer save none of it).
    linear_state: LinearState = LinearState(0, 0.0, 0.0)

    @property
    def method_tflops(self) -> float:
        return sum(t for _, _, t in self.method_terms)

    def to_json(self) -> dict[str, Any]:
        row: dict[str, Any] = {
            "variant": self.variant, "quant": self.quant.name, "bits": self.quant.label,
            "visual_tokens": self.plan.visual_tokens, "llm_visual_tokens": self.plan.llm_visual_tokens,
            "layer_average_visual_tokens": self.plan.layer_average_visual_tokens,
            "settings": self.schedule.settings_dict(),
            "method_tflops": self.method_tflops,
            "method_terms": [{"layer": layer, "term": term, "tera": t} for layer, term, t in self.method_terms],
            "tflops": self.tflops, "tflops_by_stage": self.tflops_by_stage,
            "kv_cache_bytes": self.kv_cache_bytes, "kv_cache_figure": self.kv_cache_figure,
            "kv_cache_stored_bytes": self.kv_cache_stored_bytes, "weight_bytes": self.weight_bytes,
            "memory_access_bytes": self.memory_access_bytes, "footprint_estimate_bytes": self.footprint_bytes,
            "schedule": self.schedule.to_json(),
        }
        if self.roofline_s is not None:
            row["roofline_ms"] = self.roofline_s * 1e3
        if self.linear_state.layers:
            row["linear_state"] = {"layers": self.linear_state.layers,
                                   "recurrent_bytes": self.linear_state.recurrent_bytes,
                                   "conv_bytes": self.linear_state.conv_bytes,
                                   "total_bytes": self.linear_state.total_bytes}
        return row


def method_hyperparameters(variants: Sequence[str], hyperparameters: Mapping[str, Any] | None
                           ) -> dict[str, dict[str, Any]]:
    """`hyperparameters` given once for several `variants` (`ficoco flops --hp contextual_mode=mean`), split per
    variant: each gets those its registry entry has. One that none of the variants has is refused in one line."""
    given = dict(hyperparameters or {})
    specs = {v: METHODS[v] for v in variants if v in METHODS}
    known = dict.fromkeys(name for spec in specs.values() for name in spec.hyperparameters)
    unknown = [name for name in given if name not in known]
    if unknown:
        raise FicocoError(f"hyperparameter {', '.join(unknown)} is none of {', '.join(variants)}'s"
                          + (f": choose from {', '.join(known)}" if known else " (vanilla has none)"))
    return {v: {k: given[k] for k in given if k in spec.hyperparameters} for v, spec in specs.items()}


def resolve_side_by_side(arch: Architecture, variants: list[str], opts: CountOptions,
                         request: ScheduleRequest | None = None, *, strict: bool,
                         hyperparameters: Mapping[str, Any] | None = None,
                         **budget: Any) -> tuple[list[Schedule], list[dict[str, str]]]:
    """The schedules of `variants` at one setting (`request`, or its keywords in `budget`), and the
    methods left out. Several methods side by side
    run on any family, as a sweep does: one the family refuses (`ficoco methods --matrix`) or that
    cannot reach the setting where others can is left out with its one-line reason; one method alone,
    --verify, or a setting no method reaches is refused with that reason. `hyperparameters` go to each
    variant whose entry has them (`method_hyperparameters`)."""
    request = ScheduleRequest.of(request, **budget)
    per_variant = method_hyperparameters(variants, hyperparameters)
    reducing = [v for v in variants if v != "vanilla"]
    schedules: list[Schedule] = []
    skipped: list[dict[str, str]] = []
    first_error: FicocoError | None = None
    for v in variants:
        try:
            if v in METHODS and METHODS[v].family_status(arch.family)[0] == "refused":
                METHODS[v].check_family(arch.family, arch.name)  # raises the refusal's line
            schedules.append(resolve_schedule(arch, v, opts, request, hyperparameters=per_variant.get(v)))
        except FicocoError as exc:
            if strict or v == "vanilla" or len(reducing) < 2:
                raise
            first_error = first_error or exc
            skipped.append({"variant": v, "reason": str(exc)})
    if reducing and len(skipped) == len(reducing):
        raise first_error  # type: ignore[misc]
    return schedules, skipped


def account(arch: Architecture, schedule: Schedule, quant: Quant, opts: CountOptions, *,
            gpu: Hardware | None = None) -> CostRow:
    """Cost one row: counts by stage, KV cache, weights, memory access, footprint, roofline."""
    plan = plan_tokens(arch, schedule, text_tokens=opts.text_tokens, equivalent=opts.equivalent)
    ops = model_ops(arch, plan, batch=opts.batch, lm_head_tokens=opts.lm_head_tokens)
    by_stage = count_by_stage(arch, plan, ops, opts.convention, batch=opts.batch)
    stored_kv = stored_kv_cache_bytes(arch, plan, batch=opts.batch, kv_bits=quant.kv_bits)
    figure = KV_FIGURES[opts.convention]
    kv = llm_viewer_kv_cache_bytes(ops, quant) if figure == "llm-viewer" else stored_kv
    weights = weight_bytes(arch, opts.scope, quant)
    activations = activation_peak_bytes(arch, plan, batch=opts.batch, quant=quant,
                                        lm_head_tokens=opts.lm_head_tokens)
    # The state is kept at the compute width (16 bits, as the stored cache assumes), the recurrence in float32.
    state = linear_state(arch, batch=opts.batch)
    return CostRow(
        variant=schedule.variant, quant=quant, schedule=schedule, plan=plan,
        tflops=scope_total(by_stage, opts.scope) / 1e12,
        tflops_by_stage={k: v / 1e12 for k, v in by_stage.items()},
        kv_cache_bytes=kv, kv_cache_stored_bytes=stored_kv, kv_cache_figure=figure, weight_bytes=weights,
        memory_access_bytes=memory_access_bytes(ops, opts.scope, quant),
        # A footprint is what memory holds: the stored cache, whatever the convention.
        footprint_bytes=weight_bytes(arch, "all", quant) + stored_kv + state.total_bytes + activations,
        roofline_s=roofline_seconds(ops, opts.scope, quant, gpu) if gpu else None,
        method_terms=tuple((layer, term, _EXTRA_PER_MAC[opts.convention] * macs / 1e12)
                           for layer, term, macs in extra_macs(arch, schedule, plan, batch=opts.batch)),
        linear_state=state,
    )


def per_layer(arch: Architecture, schedule: Schedule, opts: CountOptions) -> list[dict[str, Any]]:
    """Per layer: tokens in and out (per item in the vision tower) and the count in tera-units."""
    plan = plan_tokens(arch, schedule, text_tokens=opts.text_tokens, equivalent=opts.equivalent)
    ops = model_ops(arch, plan, batch=opts.batch, lm_head_tokens=opts.lm_head_tokens)
    tokens = {"vision": plan.vision, "llm": plan.llm}
    rows = []
    for stage, layer, count in count_by_layer(arch, plan, ops, opts.convention, batch=opts.batch):
        n_in, n_out = tokens[stage][layer] if layer is not None else (None, None)
        rows.append({"stage": stage, "layer": layer, "tokens_in": n_in, "tokens_out": n_out, "tera": count / 1e12})
    return rows
