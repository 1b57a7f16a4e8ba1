"""Schedules and extra cost terms of the methods planned through their entry's steps.

`plan_by_steps` is the default planner ("by_steps" in ficoco.accounting.planners.PLANNERS): a
method (FastV, PDrop, SparseVLM, DART, ...) declares in its `MethodSpec` how a setting turns into
token-count steps and how `--keep` maps to a setting; this module turns those steps into a
`Schedule` the accountant counts like any other, resolves `--keep`, `--preset`, `--tflops` and
`--schedule` for them, and sums their extra matrix work. FiCoCo-V and -L name the per-layer
planner (ficoco.accounting.schedule.plan_per_layer). No torch.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

from ficoco.accounting.architecture import Architecture
from ficoco.accounting.families import FAMILIES
from ficoco.accounting.schedule import BudgetError, PlanRequest, Removal, Schedule, TokenPlan, plan_tokens
from ficoco.errors import FicocoError
from ficoco.methods import deepstack
from ficoco.methods.base import (
    ACTING_LAYERS,
    CLS_TO_PROJECTOR,
    FULL_ATTENTION_LAYERS,
    Dims,
    MethodSpec,
    Step,
    StepContext,
    TowerLayout,
)
from ficoco.methods.hybrid import HybridLayers
from ficoco.methods.registry import method

# What a method that scores by [CLS] attention uses on a tower without [CLS] (Qwen2-VL).
EQUIVALENT_SCORE = "equivalent token (no [CLS])"
# Steps at one layer run in this order (a vision layer's own merge, then the cuts after the tower).
PLACEMENT_ORDER = ("tower_input", "layer_input", "in_layer", "tower_output", "after_projector")


def _hashable(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


def _listed(value: Any) -> Any:
    """A setting as a method's hyperparameters give it (a schedule's settings hold lists as tuples)."""
    return list(value) if isinstance(value, tuple) else value


def dims(arch: Architecture) -> Dims:
    d = arch.decoder
    return Dims(hidden=d.hidden, heads=d.heads, kv_heads=d.kv_heads, head_dim=d.head_dim, ffn=d.ffn)


def suffix_tokens(arch: Architecture, text_tokens: int) -> int:
    """Text tokens after the visual span: the prompt's text minus the template's prefix."""
    return max(0, text_tokens - FAMILIES[arch.family].prefix_tokens)


def vision_dims(arch: Architecture) -> Dims:
    v = arch.vision
    return Dims(hidden=v.hidden, heads=v.heads, kv_heads=v.heads, head_dim=v.hidden // v.heads, ffn=v.ffn)


def tower_layout(arch: Architecture) -> TowerLayout:
    """The tower `arch` runs, as a method's `tower_layers` reads it."""
    v = arch.vision
    full = tuple(sorted(v.full_attention_layers)) if v.window_groups else tuple(range(v.layers))
    return TowerLayout(family=arch.family, layers=v.layers, feature_layer=v.feature_layer, full_attention=full,
                       units=v.units)


def counted_shape(arch: Architecture, spec: MethodSpec) -> tuple[int, int]:
    """(visual tokens, layers) a method's steps count: the LLM's span and decoder layers, or for a
    method acting before the LLM the patches (units) of one tower item and the tower layers up to
    the one the projector reads."""
    if spec.per_item:
        return pooled_units(arch, spec) or arch.vision.units, arch.vision.feature_layer + 1
    return arch.visual_tokens, arch.decoder.layers


def pooled_units(arch: Architecture, spec: MethodSpec) -> int | None:
    """Tokens per frame of LLaVA-OneVision's pooled video grid where `spec` cuts on it (HoliTom); else None."""
    if spec.pooled_grid and arch.pooled_frames is not None:
        return arch.pooled_frames[1]
    return None


def check_per_item(arch: Architecture, spec: MethodSpec) -> None:
    """A cut before the LLM changes every crop's count; LLaVA-NeXT's unpadding then drops tokens that
    depend on which patches stay (as for FiCoCo-V), so such layouts are refused."""
    if spec.per_item and arch.unpadding_drops:
        raise FicocoError(f"{spec.title} on {arch.name} at image size {arch.image_size}: AnyRes unpadding drops "
                          f"{arch.unpadding_drops} tokens, so the reduced count depends on which tokens stay; use a "
                          "square image_size= or a method inside the LLM")
    if spec.pooled_grid and arch.family == "llava_onevision" and arch.pooled_frames is None:
        raise FicocoError(f"{spec.title} on {arch.name}: a video method (it cuts a video's pooled frames together); "
                          "an image is one frame: give frames=N (a video), or a method that reduces images")
    # Qwen2-VL (issue 25): HoliTom cuts a video's temporal slices together (the other methods on its video
    # layout: accounting.resolve_schedule refuses them).
    if spec.pooled_grid and FAMILIES[arch.family].video_slices and arch.video_frames is None:
        raise FicocoError(f"{spec.title} on {arch.name}: a video method (it merges a video's frames together); "
                          "an image is one frame: give frames=N (a video), or a method that reduces images")
    if spec.per_item and arch.resampled and pooled_units(arch, spec) is None:
        instead = "a method" if arch.pooled_frames else "a smaller image_size= or a method"
        raise FicocoError(f"{spec.title} on {arch.name}: {arch.resampled}; use {instead} inside the LLM")


def hybrid_layers(arch: Architecture) -> HybridLayers | None:
    """A hybrid decoder's layers (Qwen3.5's `layer_types`) as the placement rule reads them (ficoco.methods.hybrid);
    None where every layer is full attention."""
    d = arch.decoder
    if not d.layer_types:
        return None
    family = FAMILIES[arch.family]
    return HybridLayers(family.title or family.name, d.layers,
                        tuple(layer for layer in range(d.layers) if d.full_attention(layer)))


def check_placement(arch: Architecture, spec: MethodSpec, schedule: Schedule) -> None:
    """Refuse, in the adapter's own words, a schedule the model cannot run where the method acts: on a hybrid
    decoder, a reduction that reads a Gated DeltaNet layer's attention, or one before the first full-attention
    layer's cache (ficoco.methods.hybrid); on a decoder DeepStack feeds, a layer-input step before its last
    addition that folds or adds tokens (ficoco.methods.deepstack). `ficoco flops` prices only what `ficoco profile`
    runs."""
    layers = hybrid_layers(arch)
    if layers is not None:
        layers.check(spec, schedule)
    if spec.placement == "layer_input":
        deepstack.check_layer_input(spec, schedule.removals, len(arch.deepstack_layers))


def schedule_from_steps(arch: Architecture, spec: MethodSpec, steps: tuple[Step, ...],
                        settings: Mapping[str, Any]) -> Schedule:
    """A `Schedule` of `spec`'s steps, checked against the layers and visual tokens they count."""
    visual, layers = counted_shape(arch, spec)
    # A decoder step inside a layer may be at layer 0: that layer's cache holds every token it received (its
    # attention ran on them before the cut), as transformers' length and masks need of it.
    low = 0 if spec.per_item or spec.placement == "in_layer" else 1
    where = "tower" if spec.per_item else "decoder"
    removals = []
    for step in sorted(steps, key=lambda s: (s.layer, PLACEMENT_ORDER.index(s.where))):
        if not low <= step.layer < layers:
            raise FicocoError(f"{spec.title}: layer {step.layer} is outside the {where}'s layers {low}..{layers - 1}")
        if spec.removes_all and step.remove != visual:  # a withdrawal (VTW): every visual token leaves
            raise FicocoError(f"{spec.title} withdraws every visual token at its layer: layer {step.layer} removes "
                              f"{step.remove} of the {visual} left; give {step.layer}:{visual}")
        if step.remove >= visual and not spec.removes_all:
            what = "patches per item" if spec.per_item else "visual tokens"
            raise FicocoError(f"{spec.title}: layer {step.layer} removes {step.remove} of the {visual} {what} "
                              "left; at least one must stay")
        visual += step.added - step.remove
        removals.append(Removal(step.stage, step.layer, step.remove, step.where, step.added))
    return Schedule(spec.name, tuple(removals), tuple((k, _hashable(v)) for k, v in settings.items()))


def check_corrections(spec: MethodSpec, hyperparameters: Mapping[str, Any]) -> None:
    """A hyperparameter that names ficoco's corrections of the official code (`MethodSpec.corrections`) takes its
    official default or one of those values, of the same type (a label names exactly what runs): else one line."""
    for name, value in hyperparameters.items():
        values = spec.corrections.get(name)
        if values is None:
            continue
        allowed = [spec.hyperparameters[name], *values]
        if not any(type(value) is type(a) and value == a for a in allowed):
            raise FicocoError(f"{spec.title} {name}={value!r}: give {allowed[0]!r} (the official code's) or "
                              + ", ".join(f"{a!r} (ficoco: {values[a]})" for a in values))


def method_schedule(arch: Architecture, name: str, keep: int | None = None, **hyperparameters: Any) -> Schedule:
    """The schedule of method `name` for the literature's `keep` row (None: its official default)."""
    spec = method(name)
    spec.check_family(arch.family, arch.name)
    check_per_item(arch, spec)
    if spec.steps is None or spec.settings_for_keep is None:
        raise FicocoError(f"{spec.title} has no steps of its own: its planner ({spec.planner}) plans it")
    unknown = set(hyperparameters) - set(spec.hyperparameters)
    if unknown:
        raise FicocoError(f"unknown {spec.title} hyperparameter(s) {', '.join(sorted(unknown))}: "
                          f"choose from {', '.join(spec.hyperparameters)}")
    check_corrections(spec, hyperparameters)
    hp = {**spec.defaults_on(arch.family), **hyperparameters}  # the official scripts' values on this family
    hybrid = hybrid_layers(arch) if spec.removes_all else None
    if hybrid is not None:  # a withdrawal whose keep= picks its layer picks among those it may act at
        hp[ACTING_LAYERS] = hybrid.withdrawal_layers()
    visual, layers = counted_shape(arch, spec)
    settings = spec.settings_for_keep(keep, visual, layers, hp)
    if spec.tower_layers is not None:  # the tower layers its settings name, picked on this tower
        settings.update(spec.tower_layers(tower_layout(arch), settings))
    if spec.probes.named_tower_layers:  # a named layer off this tower: one line
        spec.probes.named_layers(settings, arch.vision.layers)
    # A correction given goes into the settings whether the method's own rule carries it or not (a label and the
    # models read it there).
    settings.update({name: value for name, value in hyperparameters.items() if name in spec.corrections})
    if spec.cls_note and not arch.vision.has_cls:
        # Labelled wherever the row appears: the [CLS] attention this method scores by does not exist here.
        settings["score"] = EQUIVALENT_SCORE
    # A cut before the LLM also reads whether the item's [CLS] reaches the projector (not a setting: not kept).
    tower = {CLS_TO_PROJECTOR: arch.cls_to_projector} if spec.per_item else {}
    # A decoder method on a hybrid decoder also reads which layers are full attention (not a setting: not kept).
    hybrid = hybrid_layers(arch)
    decoder = {FULL_ATTENTION_LAYERS: hybrid.full} if hybrid is not None and not spec.per_item else {}
    schedule = schedule_from_steps(arch, spec, spec.steps({**settings, **tower, **decoder}, visual, layers), settings)
    return schedule if spec.inner is None else with_inner_steps(arch, spec, schedule)


def plan_by_steps(arch: Architecture, spec: MethodSpec, request: PlanRequest) -> Schedule:
    """The default planner ("by_steps"): the schedule of a method that declares its steps
    (`steps`, `settings_for_keep`): `--schedule` removals, the setting of the `--keep` (`--preset`) row,
    the setting keeping the most tokens within `--tflops`, or the official default setting; with
    hyperparameters, the setting of the `keep` row (or the default) under them."""
    spec.check_family(arch.family, arch.name)
    keep = request.keep if request.preset is None else request.preset
    schedule = request.schedule
    if isinstance(schedule, Mapping):
        schedule = ",".join(f"{layer}:{removed}" for layer, removed in sorted(schedule.items()))
    # A correction of the official code (MethodSpec.corrections: VisionZip's contextual_mode, ToMe's order) changes
    # how the method runs, not its count: it goes with any request. Other hyperparameters set a setting of their own.
    corrections = {k: v for k, v in request.hyperparameters.items() if k in spec.corrections}
    check_corrections(spec, corrections)
    if spec.budget_refusal and (keep is not None or schedule is not None or request.tflops is not None):
        given = "schedule=" if schedule is not None else "tflops=" if request.tflops is not None else \
            f"preset={request.preset}" if request.preset is not None else f"keep={request.keep}"
        raise FicocoError(f"{given}: {spec.budget_refusal}")  # its count is its input's own (PixelPrune)
    if request.hyperparameters.keys() - corrections.keys():
        if schedule is not None or request.tflops is not None:
            raise FicocoError(f"{spec.title} hyperparameters set a setting of their own; give them with keep= "
                              "or preset=, not with a schedule or a budget")
        return method_schedule(arch, spec.name, keep, **request.hyperparameters)
    # Name the option the setting came from, so that the one error line points at it.
    source = ("schedule=" if schedule is not None else f"preset={request.preset}" if request.preset is not None
              else f"keep={request.keep}" if request.keep is not None
              else "tflops=" if request.tflops is not None else f"variant={spec.name}")
    try:
        if schedule is not None:
            return parse_method_schedule(arch, spec.name, schedule, corrections)
        if request.tflops is not None:
            if request.cost is None:
                raise FicocoError(f"tflops= for {spec.title} needs a cost to plan against")
            return schedule_for_method_budget(arch, spec.name, request.tflops, request.cost, label=request.label,
                                              hyperparameters=corrections)
        return method_schedule(arch, spec.name, keep, **corrections)
    except FicocoError as exc:
        if str(exc).startswith("--"):
            raise
        raise type(exc)(f"{source}: {exc}") from None


def with_inner_steps(arch: Architecture, spec: MethodSpec, schedule: Schedule) -> Schedule:
    """`schedule` of a method acting before the LLM, with the steps of its part inside the LLM
    (`MethodSpec.inner`) on the visual tokens the outer part hands the LLM."""
    assert spec.inner is not None and spec.inner.steps is not None
    settings = schedule.settings_dict()
    visual, layers = plan_tokens(arch, schedule).llm_visual_tokens, arch.decoder.layers
    removals = list(schedule.removals)
    # A hybrid decoder's full-attention layers, for an inner part that picks its layer among them (not a setting).
    hybrid = hybrid_layers(arch)
    decoder = {FULL_ATTENTION_LAYERS: hybrid.full} if hybrid is not None else {}
    for step in spec.inner.steps({**settings, **decoder}, visual, layers):
        if not 1 <= step.layer < layers or step.remove >= visual:
            raise FicocoError(f"{spec.title}: the LLM step at layer {step.layer} removing {step.remove} of {visual} "
                              f"visual tokens does not fit the decoder's layers 1..{layers - 1}")
        visual += step.added - step.remove
        removals.append(Removal(step.stage, step.layer, step.remove, step.where, step.added))
    return Schedule(schedule.variant, tuple(removals), schedule.settings)


def parse_method_schedule(arch: Architecture, name: str, text: str,
                          corrections: Mapping[str, Any] | None = None) -> Schedule:
    """`LAYER:REMOVED,...` for a method that removes tokens layer by layer: REMOVED visual tokens
    leave before decoder layer LAYER runs (SparseVLM adds its recycled clusters on top, by its
    rule), or REMOVED patches per item merge inside tower layer LAYER (ToMe). `corrections`: settings
    of ficoco's corrections (`MethodSpec.corrections`) the schedule's settings carry beside it."""
    spec = method(name)
    spec.check_family(arch.family, arch.name)
    check_per_item(arch, spec)
    if spec.content_counts:
        raise FicocoError(f"schedule= gives removals per layer; {spec.title}'s counts are the input's own (its "
                          "thresholds decide them): give keep= or preset= (a row's thresholds), or its thresholds")
    if spec.per_item and spec.placement != "in_layer":
        raise FicocoError(f"schedule= gives removals per layer; {spec.title} cuts once, after the tower: give "
                          "keep= or preset=")
    visual, layers = counted_shape(arch, spec)
    # The rest of the setting: for a decoder method (SparseVLM's recycling rule) its default
    # hyperparameters; for a per-item method the default settings at its counted shape.
    if spec.per_item and spec.settings_for_keep:
        default = spec.settings_for_keep(None, visual, layers, spec.defaults_on(arch.family))
    else:
        default = spec.defaults_on(arch.family)
    removals: dict[int, int] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        match = re.fullmatch(r"(\d+):(\d+)", part)
        if not match:
            raise FicocoError(f"schedule= entry '{part}' is not LAYER:REMOVED (e.g. schedule=2:288)")
        layer, remove = int(match[1]), int(match[2])
        if layer in removals:
            raise FicocoError(f"schedule= names layer {layer} twice; give each layer once")
        removals[layer] = remove
    steps = []
    for layer in sorted(removals):
        added = 0
        if spec.added_for_removed is not None and removals[layer]:
            added = spec.added_for_removed(removals[layer], default)
        if removals[layer]:
            steps.append(Step(layer, removals[layer], added, spec.placement, "vision" if spec.per_item else "llm"))
    if spec.per_item:
        # A layer merges at most half of its tokens (ToMe's bipartite split); check as the plan runs.
        current = visual
        for step in steps:
            if step.remove > current // 2:
                raise FicocoError(f"schedule=: {spec.title} merges at most half of a layer's {current} patches "
                                  f"({current // 2}); layer {step.layer} asks {step.remove}")
            current -= step.remove
    return schedule_from_steps(arch, spec, tuple(steps), {"schedule": text, **(corrections or {})})


def _feasible_keeps(arch: Architecture, spec: MethodSpec) -> list[int]:
    visual, _ = counted_shape(arch, spec)
    if spec.keep_choices is not None:
        return [k for k in spec.keep_choices if k <= visual]
    return list(range(1, visual + 1))


def schedule_for_method_budget(arch: Architecture, name: str, budget: float, cost: Callable[[Schedule], float], *,
                               label: str, hyperparameters: Mapping[str, Any] | None = None) -> Schedule:
    """The setting keeping the most tokens (by the method's `--keep` meaning) whose cost fits `budget`
    (every setting under `hyperparameters`).

    Costs grow with `keep`; low keeps a method cannot reach (FastV's average never falls below
    K/L of the image) are skipped by a first bisection on feasibility.
    """
    spec = method(name)
    keeps = _feasible_keeps(arch, spec)
    if not keeps:  # published schedules only (SparseVLM), each keeping more than the image has
        raise BudgetError(f"no {spec.title} setting exists on {arch.name}: its settings keep "
                          f"{', '.join(map(str, spec.keep_choices or ()))} visual tokens, more than the "
                          f"{counted_shape(arch, spec)[0]} it receives (schedule= gives any)")

    def schedule(k: int) -> Schedule | None:
        try:
            return method_schedule(arch, name, keeps[k], **(hyperparameters or {}))
        except FicocoError:
            return None

    lo, hi = 0, len(keeps) - 1  # the lowest feasible index: infeasible keeps all lie below feasible ones
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if schedule(mid) is not None else (mid + 1, hi)
    first = schedule(lo)
    if first is None:
        # Feasible keeps may also end below the top (ViTCoP's cannot ask its shallow layer for more tokens than its
        # cut kept): the bisection then climbed past them; the lowest feasible keep by a scan (plain arithmetic).
        lo = next((k for k in range(len(keeps)) if schedule(k) is not None), lo)
        first = schedule(lo)
    if first is None:
        raise BudgetError(f"no {spec.title} setting exists on {arch.name}")
    cheapest = cost(first)
    if cheapest > budget:
        raise BudgetError(f"no {spec.title} setting on {arch.name} fits tflops={budget:g} {label}: the cheapest "
                          f"(keep={keeps[lo]}) costs {cheapest:.3g}")
    best, hi = lo, len(keeps) - 1
    while best < hi:
        mid = (best + hi + 1) // 2
        candidate = schedule(mid)
        if candidate is not None and cost(candidate) <= budget:
            best = mid
        else:
            hi = mid - 1
    result = schedule(best)
    assert result is not None
    return result


def extra_macs(arch: Architecture, schedule: Schedule, plan: TokenPlan, *, batch: int = 1
               ) -> list[tuple[int | None, str, int]]:
    """The method's own matrix work beyond the model's layers: (layer, term, multiply-accumulates).

    Vision steps are counted per item (image, crop, frame) and multiplied by the items of every
    sample; their layer is a tower layer (the term's name says so)."""
    if schedule.variant == "vanilla":
        return []
    spec = method(schedule.variant)
    if spec.extra_macs is None:
        return []
    settings = schedule.settings_dict()
    visual, layers = counted_shape(arch, spec)
    if "schedule" in settings:  # an explicit --schedule: the defaults give the rest, as parse_method_schedule
        if spec.per_item and spec.settings_for_keep:
            settings = {**spec.settings_for_keep(None, visual, layers, spec.defaults_on(arch.family)), **settings}
        else:
            settings = {**spec.defaults_on(arch.family), **settings}
    rows: list[tuple[int | None, str, int]] = []
    suffix = suffix_tokens(arch, plan.text_tokens)
    if spec.per_item:
        v = arch.vision
        units, index = v.units, 0
        for removal in sorted((r for r in schedule.removals if r.stage == "vision"),
                              key=lambda r: (r.layer, PLACEMENT_ORDER.index(r.where))):
            # Patches entering the step: after the in-layer merges of the layers before it (and the merges at the
            # input of those layers: MustDrop's).
            units = v.units - sum(r.remove for r in schedule.removals if r.stage == "vision"
                                  and r.where in ("in_layer", "layer_input") and r.layer < removal.layer)
            if removal.where == "after_projector":
                units += sum(r.added - r.remove for r in schedule.removals if r.where == "tower_output")
                units = pooled_units(arch, spec) or units  # OneVision's video: the cut sees the pooled frames
            ctx = StepContext(step=Step(removal.layer, removal.remove, removal.added, removal.where, "vision"),
                              index=index, seq_before=v.tokens(units), visual_before=units, visual_initial=v.units,
                              suffix_tokens=suffix, dims=vision_dims(arch), settings=settings,
                              items=plan.vision_items, projected_width=arch.decoder.hidden,
                              has_cls=v.has_cls, unit_width=v.hidden * v.merge,
                              cls_to_projector=arch.cls_to_projector, anyres_crops=arch.anyres_crops)
            per = batch if spec.extra_per_sample else batch * plan.vision_items
            # Qwen3-VL's DeepStack features ride through a merging step beside the hidden states (extra channels of
            # its gathers and scatter-adds, which no convention counts as matrix work): no second run to count.
            rows += [(layer, term, per * macs) for layer, term, macs in spec.extra_macs(ctx)]
            index += 1
        if spec.inner is None or spec.inner.extra_macs is None:
            return rows
        spec = spec.inner  # its steps inside the LLM follow
    steps = [r for r in schedule.removals if r.stage == "llm" and r.where == "layer_input"]
    for index, removal in enumerate(steps):
        layer_seq = plan.llm[removal.layer - 1][1]  # what layer L-1 hands on, before the step
        visual_before = plan.llm_visual[removal.layer - 1][1]
        ctx = StepContext(step=Step(removal.layer, removal.remove, removal.added), index=index, seq_before=layer_seq,
                          visual_before=visual_before, visual_initial=plan.llm_visual_tokens, suffix_tokens=suffix,
                          dims=dims(arch), settings=settings)
        rows += [(layer, term, batch * macs) for layer, term, macs in spec.extra_macs(ctx)]
    return rows


def at_measured_count(arch: Architecture, schedule: Schedule, tokens_per_item: int) -> Schedule:
    """An adaptive schedule (its settings say ``adaptive``: PruMerge+ without --keep, PixelPrune, VLM-Pruner's
    selection that may end early) re-planned at the count a run measured (per item, or kept by the decoder's step),
    the same for every item: the method's steps at its settings with their count set to it (``tokens``, the visual
    tokens per item that reach the LLM; VLM-Pruner's ``keep``, the tokens its decoder step keeps); the settings keep
    ``adaptive`` and the run's other settings (a correction, a layer included), and add ``measured``. Any other
    schedule is returned as it is."""
    settings = schedule.settings_dict()
    if not settings.get("adaptive"):
        return schedule
    spec = method(schedule.variant)
    assert spec.steps is not None
    visual, layers = counted_shape(arch, spec)
    count = "tokens" if "tokens" in settings else "keep"
    measured = {**settings, count: tokens_per_item, "adaptive": True, "measured": True}
    tower = {CLS_TO_PROJECTOR: arch.cls_to_projector} if spec.per_item else {}
    return schedule_from_steps(arch, spec, spec.steps({**measured, **tower}, visual, layers), measured)


# (stage, layer, where) of a step -> what it removed per item (a vision step) or per sample (a decoder step).
MeasuredSteps = Mapping[tuple[str, int, str], int]


def at_measured_steps(schedule: Schedule, measured: MeasuredSteps) -> Schedule:
    """A schedule whose counts are the input's own (`MethodSpec.content_counts`: MustDrop's) re-planned at what a
    run's steps removed (`Handle.measured_steps`): every step's planned count, an assumption, replaced by its
    measured one (a step the run did not measure keeps its planned count); the settings add ``measured``. Any other
    schedule, or an empty measurement, is returned as it is."""
    if not measured or not method(schedule.variant).content_counts:
        return schedule
    removals = tuple(Removal(r.stage, r.layer, measured.get((r.stage, r.layer, r.where), r.remove), r.where, r.added)
                     for r in schedule.removals)
    settings = {**schedule.settings_dict(), "measured": True}
    return Schedule(schedule.variant, removals, tuple((k, _hashable(v)) for k, v in settings.items()))
