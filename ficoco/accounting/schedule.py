"""Reduction schedules, the token counts they imply, and budgets turned into schedules.

A schedule lists, per reducing layer, how many visual units that layer removes. A unit is
what the method removes at once: a patch of one item (image, crop or frame) for FiCoCo-V,
or a 2 x 2 merge group on Qwen2-VL; a visual token of the LLM's image span for FiCoCo-L.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ficoco.accounting.architecture import Architecture
from ficoco.accounting.request import ScheduleRequest
from ficoco.errors import FicocoError
from ficoco.methods.base import MethodSpec
from ficoco.methods.registry import METHODS, VARIANTS

SHAPES = ("uniform", "oneshot")
# The planner name (MethodSpec.planner) of the entries this module plans: any count at any reducing layer.
PER_LAYER = "per_layer"


def planned_per_layer(variant: str) -> bool:
    """Whether this module plans the variant's schedules (layer:removed, uniform or one-shot): vanilla
    and every registry entry whose planner is `plan_per_layer` (FiCoCo-V and -L)."""
    return variant == "vanilla" or (variant in METHODS and METHODS[variant].planner == PER_LAYER)


def _in_tower(variant: str) -> bool:
    """A per-layer method that reduces inside vision-tower layers (its units: patches of one item)."""
    return variant in METHODS and METHODS[variant].acts_at == "vision_layer"


@dataclass(frozen=True)
class Removal:
    """`remove` units removed at decoder or vision layer `layer` (0-based).

    `where`: "in_layer" (FiCoCo, ToMe: after the layer's attention, before its MLP) or "layer_input"
    (FastV, PDrop, SparseVLM, DART: before the layer runs, so the whole layer sees the reduced
    set; in the tower, MustDrop's merge of layer 0's output at layer 1's input); `added` tokens join at the
    same point (SparseVLM's recycled clusters). Before the LLM:
    "tower_output" (after the tower layer the projector reads, before the projector: VisionZip,
    PruMerge+, whose merged tokens are `added`) and "after_projector" (FasterVLM: the projector
    maps every patch, then the cut); "tower_input" (before the tower's first layer, decided from the
    pixels: PixelPrune; every tower layer sees the reduced count). Vision removals count patches
    (units) per item.
    """

    stage: str  # "vision" (FiCoCo-V, ToMe, VisionZip, FasterVLM, PruMerge+) or "llm"
    layer: int
    remove: int
    where: str = "in_layer"
    added: int = 0


@dataclass(frozen=True)
class Schedule:
    """The removals of one variant, sorted by layer."""

    variant: str
    removals: tuple[Removal, ...] = ()
    # The method's settings as (name, value) pairs, values made hashable (lists become tuples).
    settings: tuple[tuple[str, object], ...] = ()

    @property
    def total_removed(self) -> int:
        return sum(r.remove for r in self.removals)

    def removed_at(self) -> dict[int, int]:
        return {r.layer: r.remove for r in self.removals}

    def settings_dict(self) -> dict[str, object]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in self.settings}

    def to_json(self) -> list[dict[str, int | str]]:
        rows: list[dict[str, int | str]] = []
        for r in self.removals:
            row: dict[str, int | str] = {"stage": r.stage, "layer": r.layer, "remove": r.remove}
            if r.where != "in_layer" or r.added:  # FiCoCo's rows keep their old shape
                row.update(where=r.where, added=r.added)
            rows.append(row)
        return rows


@dataclass(frozen=True)
class Reduction:
    """One reducing layer as the cost model sees it: visual tokens before and removed (per item)."""

    stage: str
    layer: int
    visual_before: int
    removed: int
    where: str = "in_layer"
    added: int = 0


@dataclass(frozen=True)
class TokenPlan:
    """Tokens every layer really processes: (entering, after its reduction) per layer.

    Vision counts are per item (the tower's batch element), LLM counts per sequence. A
    reducing layer attends over the entering tokens and runs its MLP on the kept ones.
    """

    vision: tuple[tuple[int, int], ...]
    llm: tuple[tuple[int, int], ...]
    vision_items: int
    llm_visual_tokens: int  # visual tokens entering the LLM
    visual_tokens: int  # visual tokens that reach (V) or leave (L) the LLM
    text_tokens: int
    reductions: tuple[Reduction, ...]
    equivalent: bool
    # Visual tokens per decoder layer: (entering its attention, entering its MLP).
    llm_visual: tuple[tuple[int, int], ...] = ()
    # Visual tokens the projector maps per sample (None: those the LLM receives). FasterVLM
    # projects every patch and cuts after the projector.
    projected_visual_tokens: int | None = None
    variant: str = ""
    # Qwen2.5-VL: query-key pairs of the whole run (every item) per vision layer, as a run measured
    # them (the windows a reduction leaves depend on which groups it removed); empty: estimated.
    vision_attention_pairs: tuple[int, ...] = ()

    @property
    def projector_tokens(self) -> int:
        """Visual tokens (per sample, LLaVA-NeXT's newlines included) the projector's input holds."""
        return self.llm_visual_tokens if self.projected_visual_tokens is None else self.projected_visual_tokens

    @property
    def layer_average_visual_tokens(self) -> float:
        """The literature's "retained tokens" for in-LLM methods: sum over layers of the visual
        tokens each layer attends over, divided by the layer count (SparseVLM issue #10)."""
        if not self.llm_visual:
            return float(self.llm_visual_tokens)
        return sum(n_in for n_in, _ in self.llm_visual) / len(self.llm_visual)


def stage_of(variant: str) -> str:
    return "vision" if _in_tower(variant) else "llm"


def first_layer(arch: Architecture, variant: str) -> int:
    """The variant's first reducing layer: its entry's `first_layer` hyperparameter, or the profile's."""
    return arch.first_reducing_layer(variant)


def layer_range(arch: Architecture, variant: str) -> range:
    """Layers that may reduce: V up to the layer the projector reads; L every decoder layer
    but the first, whose full cache transformers uses to size decode-time masks and positions."""
    if _in_tower(variant):
        return range(0, arch.vision.feature_layer + 1)
    return range(1, arch.decoder.layers)


def total_units(arch: Architecture, variant: str) -> int:
    """Units the variant can act on: per item for V, the LLM's visual span for L."""
    return arch.vision.units if _in_tower(variant) else arch.visual_tokens


def min_kept_units(arch: Architecture, variant: str) -> int:
    """A reducing layer needs at least one kept token to fold the discarded ones into."""
    return 1 if _in_tower(variant) else arch.newline_tokens + 1


def _check_variant(arch: Architecture, variant: str) -> None:
    if not planned_per_layer(variant):
        raise FicocoError(f"unknown variant '{variant}': choose from {', '.join(VARIANTS)}")
    if _in_tower(variant) and arch.unpadding_drops:
        raise FicocoError(
            f"FiCoCo-V on {arch.name} at image size {arch.image_size}: AnyRes unpadding drops "
            f"{arch.unpadding_drops} tokens, so the reduced count depends on which tokens stay; "
            "use a square image_size= (or image=) or FiCoCo-L"
        )
    if _in_tower(variant) and arch.resampled:
        instead = "FiCoCo-L" if arch.pooled_frames else "a smaller image_size= or FiCoCo-L"
        raise FicocoError(f"FiCoCo-V on {arch.name}: {arch.resampled}; use {instead}")


def parse_schedule(text: str, arch: Architecture, variant: str) -> Schedule:
    """Parse `layer:removed,layer:removed,...` into a validated schedule."""
    _check_variant(arch, variant)
    if variant == "vanilla":
        raise FicocoError("schedule= applies to the v and l variants; vanilla removes nothing")
    removals: dict[int, int] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        match = re.fullmatch(r"(\d+):(\d+)", part)
        if not match:
            raise FicocoError(f"schedule= entry '{part}' is not LAYER:REMOVED (e.g. schedule=12:40,13:40)")
        layer, remove = int(match[1]), int(match[2])
        if layer in removals:
            raise FicocoError(f"schedule= names layer {layer} twice; give each layer once")
        removals[layer] = remove
    return make_schedule(arch, variant, removals)


def make_schedule(arch: Architecture, variant: str, removals: dict[int, int]) -> Schedule:
    """A schedule from {layer: removed}, checked against the model's layers and token counts."""
    _check_variant(arch, variant)
    if variant == "vanilla":
        return Schedule("vanilla")
    valid = layer_range(arch, variant)
    stage = stage_of(variant)
    where = "vision tower" if _in_tower(variant) else "decoder"
    left = total_units(arch, variant)
    floor = min_kept_units(arch, variant)
    for layer in sorted(removals):
        if layer not in valid:
            extra = " (the last layer whose output the projector reads)" if _in_tower(variant) else ""
            raise FicocoError(
                f"schedule=: layer {layer} is outside the {where}'s reducing layers "
                f"{valid.start}..{valid.stop - 1}{extra}"
            )
        left -= removals[layer]
        if left < floor:
            raise FicocoError(
                f"schedule= removes more visual tokens than exist: by layer {layer} it removes "
                f"{total_units(arch, variant) - left} of {total_units(arch, variant)}; at least {floor} must stay"
            )
    kept = tuple(Removal(stage, layer, removals[layer]) for layer in sorted(removals) if removals[layer] > 0)
    return Schedule(variant, kept)


def uniform_schedule(arch: Architecture, variant: str, removed: int, *, shape: str | None = "uniform",
                     first: int | None = None, run: int | None = None) -> Schedule:
    """Remove `removed` units: the same number per reducing layer from `first` on (extra ones
    go to the earliest layers), or all at `first` with shape "oneshot". `run` limits the uniform
    shape to that many layers from `first` (the budget default's shortened run)."""
    shape = shape or "uniform"
    if variant == "vanilla" or removed == 0:
        return Schedule(variant)
    if shape not in SHAPES:
        raise FicocoError(f"unknown shape='{shape}': choose from {', '.join(SHAPES)}")
    start = first_layer(arch, variant) if first is None else first
    valid = layer_range(arch, variant)
    if start not in valid:
        given = f"first_layer={start}" if first is not None else (
            f"the profile's first reducing layer ({start}; overrides=ficoco.first_reducing_layer.{variant} moves it)")
        raise FicocoError(f"{given} is outside {valid.start}..{valid.stop - 1}, the layers that may reduce")
    if shape == "oneshot":
        return make_schedule(arch, variant, {start: removed})
    # On a hybrid decoder (Qwen3.5) a decoder method reduces inside its full-attention layers alone: a Gated
    # DeltaNet layer has no attention map to rank by, and its recurrent state no tokens to remove.
    layers = [layer for layer in range(start, valid.stop)
              if _in_tower(variant) or arch.decoder.full_attention(layer)][:run]
    if not layers:
        raise FicocoError(f"no full-attention layer from layer {start} on: {variant} reduces inside full-attention "
                          "layers only; give an earlier first_layer")
    per_layer, extra = divmod(removed, len(layers))
    schedule = make_schedule(arch, variant, {layer: per_layer + (k < extra) for k, layer in enumerate(layers)})
    if run is None or run >= valid.stop - start:
        return schedule
    # A shortened run says so in the row's settings (the full uniform run keeps no settings, as before).
    note = f"uniform over layers {layers[0]}..{layers[-1]} (the longest run from layer {start} that fits the budget)"
    return Schedule(schedule.variant, schedule.removals, (("shape", note),))


def keep_to_units(arch: Architecture, variant: str, keep: int) -> int:
    """Units kept per item (V) or in the span (L) so that `keep` visual tokens reach/leave the LLM."""
    _check_variant(arch, variant)
    if keep < 0:
        raise FicocoError(f"keep={keep} is negative; give the number of visual tokens to keep")
    if not _in_tower(variant):
        if not min_kept_units(arch, variant) <= keep <= arch.visual_tokens:
            raise FicocoError(
                f"keep={keep} is outside {min_kept_units(arch, variant)}..{arch.visual_tokens}, "
                f"the visual tokens {arch.name} can keep"
            )
        return keep
    v = arch.vision
    fixed = arch.newline_tokens + v.items * int(arch.cls_in_llm)
    units, rest = divmod(keep - fixed, v.items)
    if rest or not 1 <= units <= v.units:
        valid_low, valid_high = arch.llm_visual_tokens(1), arch.visual_tokens
        step = v.items
        raise FicocoError(
            f"keep={keep} is not reachable with FiCoCo-V on {arch.name}: the LLM receives "
            f"{fixed} fixed tokens plus the kept units of {v.items} item(s), so keep must be in "
            f"{valid_low}..{valid_high} in steps of {step}"
        )
    return units


def schedule_for_keep(arch: Architecture, variant: str, keep: int, *, shape: str | None = "uniform",
                      first: int | None = None) -> Schedule:
    """The default-shaped schedule that keeps `keep` visual tokens (reaching V / leaving L the LLM)."""
    if variant == "vanilla":
        return Schedule("vanilla")
    units = keep_to_units(arch, variant, keep)
    return uniform_schedule(arch, variant, total_units(arch, variant) - units, shape=shape, first=first)


def plan_tokens(arch: Architecture, schedule: Schedule, *, text_tokens: int | None = None,
                equivalent: bool = False) -> TokenPlan:
    """Per-layer token counts of a run of `schedule` (layer-exact, or every layer at the final
    count with `equivalent`)."""
    text = arch.text_tokens if text_tokens is None else text_tokens
    v = arch.vision
    vision_removed = {r.layer: r.remove for r in schedule.removals if r.stage == "vision" and r.where == "in_layer"}
    # A merge at a tower layer's input (MustDrop's, on layer 0's output): that layer and every later one see it.
    vision_at_input = {r.layer: r.remove for r in schedule.removals if r.stage == "vision" and r.where == "layer_input"}
    before_llm = {r.where: r for r in schedule.removals
                  if r.stage == "vision" and r.where not in ("in_layer", "layer_input")}
    # A cut at the tower's input (PixelPrune): every tower layer runs on the units it keeps (the patch embedding
    # and Qwen3-VL's position interpolation run on every patch before it, as the model's own forward runs them).
    tower_input = before_llm.get("tower_input")
    in_layer = {r.layer: r for r in schedule.removals if r.stage == "llm" and r.where == "in_layer"}
    at_input = {r.layer: r for r in schedule.removals if r.stage == "llm" and r.where == "layer_input"}
    reductions: list[Reduction] = []
    units = v.units
    if tower_input is not None and tower_input.remove:
        reductions.append(Reduction("vision", 0, units * v.merge, tower_input.remove * v.merge, "tower_input"))
        units -= tower_input.remove
    vision: list[tuple[int, int]] = []
    for layer in range(v.layers):
        entering = vision_at_input.get(layer, 0)
        if entering:
            reductions.append(Reduction("vision", layer, units * v.merge, entering * v.merge, "layer_input"))
            units -= entering
        r = vision_removed.get(layer, 0)
        if r:
            reductions.append(Reduction("vision", layer, units * v.merge, r * v.merge))
        vision.append((v.tokens(units), v.tokens(units - r)))
        units -= r
    # Cuts between the tower and the LLM: at the tower's output (before the projector), then after it.
    projected_visual: int | None = None
    for where in ("tower_output", "after_projector"):
        cut = before_llm.get(where)
        if cut is not None:
            if where == "after_projector" and arch.pooled_frames is not None:
                # LLaVA-OneVision's video (HoliTom, the one cut allowed there): the cut acts on every
                # frame's pooled grid.
                units = arch.pooled_frames[1]
            reductions.append(Reduction("vision", cut.layer, units * v.merge, cut.remove * v.merge, where, cut.added))
            if where == "after_projector":
                projected_visual = arch.llm_visual_tokens(units)
            units += cut.added - cut.remove
    llm_visual = arch.llm_visual_tokens(units)
    seq = text + llm_visual
    visual = llm_visual
    llm: list[tuple[int, int]] = []
    llm_vis: list[tuple[int, int]] = []
    for layer in range(arch.decoder.layers):
        step = at_input.get(layer)
        if step is not None:
            reductions.append(Reduction("llm", layer, visual, step.remove, "layer_input", step.added))
            seq += step.added - step.remove
            visual += step.added - step.remove
        inside = in_layer.get(layer)
        r = inside.remove if inside is not None else 0
        if r:
            reductions.append(Reduction("llm", layer, visual, r))
        llm.append((seq, seq - r))
        llm_vis.append((visual, visual - r))
        seq -= r
        visual -= r
    if equivalent:
        vision = [(vision[-1][1], vision[-1][1])] * len(vision)
        llm = [(seq, seq)] * len(llm)
        llm_vis = [(visual, visual)] * len(llm_vis)
    return TokenPlan(
        vision=tuple(vision), llm=tuple(llm), vision_items=v.items, llm_visual_tokens=llm_visual,
        visual_tokens=visual, text_tokens=text, reductions=tuple(reductions), equivalent=equivalent,
        llm_visual=tuple(llm_vis), projected_visual_tokens=projected_visual, variant=schedule.variant,
    )


class BudgetError(FicocoError):
    """No schedule of the requested shape meets the budget."""


def schedule_for_budget(arch: Architecture, variant: str, budget: float, cost: Callable[[Schedule], float], *,
                        label: str, shape: str | None = None, first: int | None = None,
                        equivalent: bool = False, equivalent_helps: bool = True) -> Schedule:
    """The schedule keeping the most visual tokens whose `cost` fits `budget`.

    `cost` maps a schedule to the budget's unit (e.g. TFLOPs in the active convention and
    scope); it must not decrease as fewer tokens are removed, which holds for every
    convention since each layer's count is monotone in the tokens it sees.

    Without an explicit `shape` the schedule is uniform over the longest run of layers from the
    first reducing layer whose cheapest schedule meets the budget: the whole range (today's
    uniform schedule) whenever that reaches it, down to one layer (oneshot) at the limit. A
    shorter run removes earlier, so its cost does not grow as the run shortens.
    """
    if not (math.isfinite(budget) and budget > 0):  # nan passes `budget <= 0` and plans 1 token
        raise FicocoError(f"tflops={budget:g}: give a finite number above 0")
    if variant == "vanilla":
        return Schedule("vanilla")
    _check_variant(arch, variant)
    units = total_units(arch, variant)
    low = min_kept_units(arch, variant)
    run: int | None = None

    def schedule_keeping(kept: int, start: int | None = first) -> Schedule:
        return uniform_schedule(arch, variant, units - kept, shape=shape, first=start, run=run)

    cheapest = cost(schedule_keeping(low))
    if cheapest > budget and shape is None:
        # The longest run that still fits: costs fall as the run shortens (removals come earlier).
        start = first_layer(arch, variant) if first is None else first
        lo, hi = 1, max(1, layer_range(arch, variant).stop - start - 1)
        while lo < hi:
            run = (lo + hi + 1) // 2
            lo, hi = (run, hi) if cost(schedule_keeping(low)) <= budget else (lo, run - 1)
        run = lo
        cheapest = cost(schedule_keeping(low))
    if cheapest > budget:
        raise BudgetError(_budget_miss(arch, variant, budget, cheapest, cost, label=label, shape=shape or "uniform",
                                       first=first, suggest_equivalent=equivalent_helps and not equivalent))
    # Largest kept count within budget: cost is monotone in the kept count.
    lo, hi = low, units
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if cost(schedule_keeping(mid)) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return schedule_keeping(lo)


def _budget_miss(arch: Architecture, variant: str, budget: float, cheapest: float,
                 cost: Callable[[Schedule], float], *, label: str, shape: str, first: int | None,
                 suggest_equivalent: bool) -> str:
    """One line: what the cheapest schedule costs and which change would reach lower."""
    start = first_layer(arch, variant) if first is None else first
    units, low = total_units(arch, variant), min_kept_units(arch, variant)
    name = METHODS[variant].title
    # Preference: the same shape starting later, then one-shot; the latest start that fits.
    options = [(s, layer) for s in dict.fromkeys((shape, "oneshot"))
               for layer in range(start, layer_range(arch, variant).start - 1, -1)]
    reach = {opt: cost(uniform_schedule(arch, variant, units - low, shape=opt[0], first=opt[1])) for opt in options}
    fitting = [opt for opt in options if reach[opt] <= budget and opt != (shape, start)]
    best = fitting[0] if fitting else min(reach, key=reach.__getitem__)
    flags = " ".join(f for f in (f"shape={best[0]}" if best[0] != shape else "",
                                 f"first_layer={best[1]}" if best[1] != start else "") if f)
    verdict = "fits" if best in fitting else "the lowest reachable"
    hint = f"; {flags} reaches {reach[best]:.3g} ({verdict})" if flags else ""
    if suggest_equivalent:
        hint += "; equivalent=True counts every layer at the final token count, as papers do"
    return (f"no {name} schedule on {arch.name} fits tflops={budget:g} {label}: the cheapest {shape} schedule "
            f"from layer {start}, keeping {low} visual token(s), costs {cheapest:.3g}{hint}")


@dataclass(frozen=True)
class PlanRequest(ScheduleRequest):
    """What a run asks a method's planner for (ficoco.accounting.planners.plan): the caller's
    `ScheduleRequest` (at most one of keep / preset / tflops / schedule, with shape and first layer;
    none: the method's official default setting, where it has one) and how to read it.

    Attributes beside the request's own:
        hyperparameters: the caller's hyperparameters (checked against the entry's).
        cost: a schedule -> its cost in the budget's unit; `label` names the unit.
        equivalent, scope: how `cost` counts (a budget miss says whether --equivalent would help).
    """

    hyperparameters: Mapping[str, Any] = field(default_factory=dict)
    cost: Callable[[Schedule], float] | None = None
    label: str = ""
    equivalent: bool = False
    scope: str = "llm"


def preset_message(message: str, preset: int) -> str:
    """An error about `--keep N` that came from `--preset N`, reworded to name the option given."""
    if f"keep={preset}" in message:
        return message.replace(f"keep={preset}", f"preset={preset} (keep={preset})", 1)
    return f"preset={preset}: {message}"


def plan_per_layer(arch: Architecture, spec: MethodSpec, request: PlanRequest) -> Schedule:
    """The planner of a method that removes any count at any of its reducing layers (FiCoCo-V and -L):
    explicit removals, `keep` (or `preset`) tokens uniformly from the first reducing layer (or all at it,
    "oneshot"), or the most tokens whose cost fits `tflops`. Hyperparameters do not change the schedule;
    they are checked against those of the entries this planner plans (FiCoCo-V's and -L's: one set,
    which the handle holds)."""
    variant = spec.name
    known = dict.fromkeys(name for other in METHODS.values() if other.planner == spec.planner
                          for name in other.hyperparameters)
    unknown = sorted(set(request.hyperparameters) - set(known))
    if unknown:
        raise FicocoError(f"unknown hyperparameter {', '.join(unknown)} for {spec.title}: choose from "
                          f"{', '.join(known)}")
    shape, first = request.shape, request.first_layer
    # A named rule (FiCoCo's rule="official") runs on the families it names, starts its own number of layers after
    # the profile's first reducing layer, and may have a setting of its own (its r per layer).
    rule = spec.check_rule_runs(arch.family, arch.name, request.hyperparameters)
    if rule is not None:
        if first is None and rule.first_layer_offset:
            _check_variant(arch, variant)
            first = first_layer(arch, variant) + rule.first_layer_offset
    if request.preset is not None:  # FiCoCo's rows are labelled by the visual tokens that stay: --keep N
        try:
            return schedule_for_keep(arch, variant, request.preset, shape=shape, first=first)
        except FicocoError as exc:
            raise type(exc)(preset_message(str(exc), request.preset)) from None
    if isinstance(request.schedule, Mapping):
        return make_schedule(arch, variant, dict(request.schedule))
    if request.schedule is not None:
        return parse_schedule(request.schedule, arch, variant)
    if request.keep is not None:
        return schedule_for_keep(arch, variant, request.keep, shape=shape, first=first)
    if request.tflops is not None:
        if request.cost is None:
            raise FicocoError(f"tflops= for {spec.title} needs a cost to plan against")
        return schedule_for_budget(
            arch, variant, request.tflops, request.cost, label=request.label, shape=shape, first=first,
            equivalent=request.equivalent,
            # V in scope llm: the LLM sees the final count in every layer already.
            equivalent_helps=spec.acts_at == "llm_layer" or request.scope == "all",
        )
    if rule is not None and rule.removed_per_layer is not None:
        return rule_schedule(arch, spec, rule.removed_per_layer, first, rule.label)
    raise FicocoError(f"variant '{variant}' needs a schedule: give keep=, tflops= or schedule=")


def rule_schedule(arch: Architecture, spec: MethodSpec, per_layer: int, first: int | None, label: str) -> Schedule:
    """A named rule's own setting (FiCoCo's official code's): `per_layer` units at every reducing layer from `first`
    on (the decoder's full-attention layers to the last, or the tower's up to the layer the projector reads)."""
    variant = spec.name
    _check_variant(arch, variant)
    start = first_layer(arch, variant) if first is None else first
    valid = layer_range(arch, variant)
    if start not in valid:
        raise FicocoError(f"{spec.title}'s {label} starts at layer {start}, outside {valid.start}..{valid.stop - 1}, "
                          "the layers that may reduce on this model; give first_layer=")
    layers = [layer for layer in range(start, valid.stop) if _in_tower(variant) or arch.decoder.full_attention(layer)]
    units, floor = total_units(arch, variant), min_kept_units(arch, variant)
    if per_layer * len(layers) > units - floor:
        raise FicocoError(f"{spec.title}'s {label} removes {per_layer} at each of the {len(layers)} layers from layer "
                          f"{start} ({per_layer * len(layers)} of {units} on {arch.name}), more than may go; give "
                          "keep=, tflops= or schedule= (or a later first_layer=)")
    return make_schedule(arch, variant, dict.fromkeys(layers, per_layer))
