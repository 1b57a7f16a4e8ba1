"""Schedules and extra cost terms of the methods that plan through their registry entry.

FiCoCo-V and -L are planned by ficoco.accounting.schedule (removals per reducing layer). Every
other method (FastV, PDrop, SparseVLM, DART, ...) declares in its `MethodSpec` how a setting
turns into token-count steps and how `--keep` maps to a setting; this module turns those
steps into a `Schedule` the accountant counts like any other, resolves `--keep`, `--preset`,
`--tflops` and `--schedule` for them, and sums their extra matrix work. No torch.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

from ficoco.accounting.architecture import Architecture
from ficoco.accounting.schedule import BudgetError, Removal, Schedule, TokenPlan
from ficoco.errors import FicocoError
from ficoco.methods.base import Dims, MethodSpec, Step, StepContext
from ficoco.methods.registry import method

# Text tokens before the visual span in the families' templates ("USER: <image>\n..."; Qwen2-VL's
# "<|im_start|>user\n<|vision_start|>"), the same the model adapters' synthetic inputs use.
PREFIX_TOKENS = {"llava": 5, "llava_next": 5, "video_llava": 5, "qwen2_vl": 4}


def _hashable(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


def dims(arch: Architecture) -> Dims:
    d = arch.decoder
    return Dims(hidden=d.hidden, heads=d.heads, kv_heads=d.kv_heads, head_dim=d.head_dim, ffn=d.ffn)


def suffix_tokens(arch: Architecture, text_tokens: int) -> int:
    """Text tokens after the visual span: the prompt's text minus the template's prefix."""
    return max(0, text_tokens - PREFIX_TOKENS.get(arch.family, 0))


def schedule_from_steps(arch: Architecture, spec: MethodSpec, steps: tuple[Step, ...],
                        settings: Mapping[str, Any]) -> Schedule:
    """A `Schedule` of `spec`'s steps, checked against the decoder's layers and visual tokens."""
    visual = arch.visual_tokens
    removals = []
    for step in sorted(steps, key=lambda s: s.layer):
        if not 1 <= step.layer < arch.decoder.layers:
            raise FicocoError(f"{spec.title}: layer {step.layer} is outside the decoder's layers "
                              f"1..{arch.decoder.layers - 1}")
        if step.remove >= visual:
            raise FicocoError(f"{spec.title}: layer {step.layer} removes {step.remove} of the {visual} visual tokens "
                              "left; at least one must stay")
        visual += step.added - step.remove
        removals.append(Removal("llm", step.layer, step.remove, step.where, step.added))
    return Schedule(spec.name, tuple(removals), tuple((k, _hashable(v)) for k, v in settings.items()))


def method_schedule(arch: Architecture, name: str, keep: int | None = None, **hyperparameters: Any) -> Schedule:
    """The schedule of method `name` for the literature's `keep` row (None: its official default)."""
    spec = method(name)
    spec.check_family(arch.family, arch.name)
    if not spec.plans_itself:
        raise FicocoError(f"{spec.title} is planned by ficoco.accounting.schedule, not here")
    unknown = set(hyperparameters) - set(spec.hyperparameters)
    if unknown:
        raise FicocoError(f"unknown {spec.title} hyperparameter(s) {', '.join(sorted(unknown))}: "
                          f"choose from {', '.join(spec.hyperparameters)}")
    hp = {**spec.hyperparameters, **hyperparameters}
    assert spec.settings_for_keep is not None and spec.steps is not None
    settings = spec.settings_for_keep(keep, arch.visual_tokens, arch.decoder.layers, hp)
    return schedule_from_steps(arch, spec, spec.steps(settings, arch.visual_tokens, arch.decoder.layers), settings)


def parse_method_schedule(arch: Architecture, name: str, text: str) -> Schedule:
    """`LAYER:REMOVED,...` for a method that acts at the input of decoder layers: REMOVED visual
    tokens leave before LAYER runs (SparseVLM adds its recycled clusters on top, by its rule)."""
    spec = method(name)
    spec.check_family(arch.family, arch.name)
    # The rest of the setting (SparseVLM's recycling rule) is the method's default hyperparameters.
    default = dict(spec.hyperparameters)
    removals: dict[int, int] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        match = re.fullmatch(r"(\d+):(\d+)", part)
        if not match:
            raise FicocoError(f"--schedule entry '{part}' is not LAYER:REMOVED (e.g. --schedule 2:288)")
        layer, remove = int(match[1]), int(match[2])
        if layer in removals:
            raise FicocoError(f"--schedule names layer {layer} twice; give each layer once")
        removals[layer] = remove
    steps = []
    for layer in sorted(removals):
        added = 0
        if spec.name == "sparsevlm" and removals[layer]:
            from ficoco.methods.registry import sparsevlm_recycled

            added = sparsevlm_recycled(removals[layer], default["recycle_ratio"], default["cluster_divisor"])[1]
        if removals[layer]:
            steps.append(Step(layer, removals[layer], added))
    return schedule_from_steps(arch, spec, tuple(steps), {"schedule": text})


def _feasible_keeps(arch: Architecture, spec: MethodSpec) -> list[int]:
    if spec.keep_choices is not None:
        return [k for k in spec.keep_choices if k <= arch.visual_tokens]
    return list(range(1, arch.visual_tokens + 1))


def schedule_for_method_budget(arch: Architecture, name: str, budget: float, cost: Callable[[Schedule], float], *,
                               label: str) -> Schedule:
    """The setting keeping the most tokens (by the method's `--keep` meaning) whose cost fits `budget`.

    Costs grow with `keep`; low keeps a method cannot reach (FastV's average never falls below
    K/L of the image) are skipped by a first bisection on feasibility.
    """
    spec = method(name)
    keeps = _feasible_keeps(arch, spec)

    def schedule(k: int) -> Schedule | None:
        try:
            return method_schedule(arch, name, keeps[k])
        except FicocoError:
            return None

    lo, hi = 0, len(keeps) - 1  # the lowest feasible index: infeasible keeps all lie below feasible ones
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if schedule(mid) is not None else (mid + 1, hi)
    first = schedule(lo)
    if first is None:
        raise BudgetError(f"no {spec.title} setting exists on {arch.name}")
    cheapest = cost(first)
    if cheapest > budget:
        raise BudgetError(f"no {spec.title} setting on {arch.name} fits --tflops {budget:g} {label}: the cheapest "
                          f"(--keep {keeps[lo]}) costs {cheapest:.3g}")
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
    """The method's own matrix work beyond the model's layers: (layer, term, multiply-accumulates)."""
    if schedule.variant == "vanilla":
        return []
    spec = method(schedule.variant)
    if spec.extra_macs is None:
        return []
    settings = schedule.settings_dict()
    if "schedule" in settings:  # an explicit --schedule: the default hyperparameters give the rest
        settings = {**spec.hyperparameters, **settings}
    rows: list[tuple[int | None, str, int]] = []
    steps = [r for r in schedule.removals if r.stage == "llm" and r.where == "layer_input"]
    suffix = suffix_tokens(arch, plan.text_tokens)
    for index, removal in enumerate(steps):
        layer_seq = plan.llm[removal.layer - 1][1]  # what layer L-1 hands on, before the step
        visual_before = plan.llm_visual[removal.layer - 1][1]
        ctx = StepContext(step=Step(removal.layer, removal.remove, removal.added), index=index, seq_before=layer_seq,
                          visual_before=visual_before, visual_initial=plan.llm_visual_tokens, suffix_tokens=suffix,
                          dims=dims(arch), settings=settings)
        rows += [(layer, term, batch * macs) for layer, term, macs in spec.extra_macs(ctx)]
    return rows
