"""The accountant's planner table: the name a `MethodSpec` gives as its `planner` -> the function that
plans it. No torch.

A spec names its planner by a word (ficoco.methods.base.PlannerName), never by an import path: the
methods package knows nothing of the accountant, and the accountant (which reads the registry) holds
the functions. `plan` is the one call that turns a spec and a request into a `Schedule`.
"""

from __future__ import annotations

from collections.abc import Mapping

from ficoco.accounting.architecture import Architecture
from ficoco.accounting.methods import check_corrections, check_placement, plan_by_steps
from ficoco.accounting.schedule import PlanRequest, Schedule, plan_per_layer
from ficoco.errors import FicocoError
from ficoco.methods.base import PLANNER_NAMES, RULE, MethodSpec, Planner

# Every name of PLANNER_NAMES, and only those (tests/test_methods_spec.py checks both ways).
PLANNERS: Mapping[str, Planner] = {
    "by_steps": plan_by_steps,  # the spec's steps, settings_for_keep and extra_macs (most methods)
    "per_layer": plan_per_layer,  # any count at any reducing layer from first_layer (FiCoCo-V and -L)
}


def plan(arch: Architecture, spec: MethodSpec, request: PlanRequest) -> Schedule:
    """The `Schedule` of `spec` on `arch` for `request`, through the planner its entry names; a schedule the
    model refuses where the method acts (a hybrid decoder's Gated DeltaNet layer) is refused in the adapter's
    words (`check_placement`), so that no cost is given for a run that cannot happen."""
    planner = PLANNERS.get(spec.planner)
    if planner is None:  # a spec made outside the package with a name no planner has (MethodSpec refuses it)
        raise FicocoError(f"variant={spec.name}: no planner '{spec.planner}'; choose from {', '.join(PLANNER_NAMES)}")
    schedule = planner(arch, spec, request)
    check_placement(arch, spec, schedule)
    # A correction of the official code (MethodSpec.corrections), and a named rule (MethodSpec.rules: FiCoCo's
    # rule="official"), goes with any plan and joins its settings, so that the run and every label of it agree (a
    # planner whose settings carry it already keeps its own).
    corrections = {name: value for name, value in request.hyperparameters.items()
                   if (name in spec.corrections or (name == RULE and spec.rules))
                   and name not in schedule.settings_dict()}
    if not corrections:
        return schedule
    spec.rule(corrections)  # a rule no entry names: refused in one line
    check_corrections(spec, corrections)
    settings = {**schedule.settings_dict(), **corrections}
    return Schedule(schedule.variant, schedule.removals, tuple(settings.items()))
