"""The schedule request: what a caller asks the accountant to plan, as one frozen record.

`ficoco.flops`, `ficoco.apply`, `ficoco.profile`, the CLI's commands and the sweep build one
`ScheduleRequest` at their edge and hand it down whole (to `accounting.resolve_schedule`,
`resolve_side_by_side`, `ProfileConfig`); it is checked once, when it is made. No torch here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from ficoco.errors import FicocoError

# The keywords that choose the schedule, in the order messages name them.
SOURCES = ("keep", "preset", "tflops", "schedule")


@dataclass(frozen=True)
class ScheduleRequest:
    """At most one of `keep`, `preset`, `tflops` and `schedule` (none: each method's official default
    setting, where it has one; FiCoCo-V and -L have none and refuse an empty request), with the
    per-layer planner's `shape` and `first_layer`.

    Attributes:
        keep: visual tokens to keep, in each method's `--keep` meaning (docs/accounting.md).
        preset: the literature's "N tokens" row (192/128/64): the same as `keep` N, kept apart so that
            an error names the option given (`keep_or_preset` folds it into keep).
        tflops: a budget in the count options' convention and scope (`accounting.CountOptions`).
        schedule: explicit removals, ``"LAYER:REMOVED,..."`` or {layer: removed}.
        shape: "uniform" (the same count per reducing layer) or "oneshot" (all at the first one).
        first_layer: the first reducing layer of a per-layer planner (None: the profile's).

    Raises FicocoError (one line) when more than one of keep / preset / tflops / schedule is given.
    """

    keep: int | None = None
    preset: int | None = None
    tflops: float | None = None
    schedule: str | Mapping[int, int] | None = None
    shape: str | None = None
    first_layer: int | None = None

    def __post_init__(self) -> None:
        given = self.given()
        if len(given) > 1:
            raise FicocoError(f"give one of keep=, preset=, tflops= and schedule=, not {' and '.join(given)}")
        if isinstance(self.schedule, Mapping):
            # A copy: the request is frozen, the caller's dict is not.
            object.__setattr__(self, "schedule", {int(layer): int(n) for layer, n in self.schedule.items()})

    @classmethod
    def of(cls, request: ScheduleRequest | None = None, **keywords: Any) -> ScheduleRequest:
        """`request` as given, or one made of the keyword spelling (`keep=`, `preset=`, `tflops=`,
        `schedule=`, `shape=`, `first_layer=`; None values are not given): the public functions
        take either, never both."""
        given = {name: value for name, value in keywords.items() if value is not None}
        if request is None:
            return cls(**given)
        if given:
            raise FicocoError(f"give request= or {', '.join(f'{name}=' for name in given)}, not both")
        return request

    def given(self) -> list[str]:
        """The keywords of the schedule sources given, as `name=` (["keep="], [] for the default setting)."""
        return [f"{name}=" for name in SOURCES if getattr(self, name) is not None]

    @property
    def keep_or_preset(self) -> int | None:
        """The visual tokens asked for: `preset` N means `keep` N."""
        return self.preset if self.preset is not None else self.keep

    def folded(self) -> ScheduleRequest:
        """This request with the preset folded into keep (a profile's rows are labelled by the visual
        tokens that stay: keep N)."""
        return self if self.preset is None else replace(self, keep=self.preset, preset=None)

    def fields(self) -> dict[str, Any]:
        """The request's own fields as keywords (a record that extends it is made from them)."""
        return {name: getattr(self, name) for name in ("keep", "preset", "tflops", "schedule", "shape", "first_layer")}

    def to_json(self) -> dict[str, Any]:
        """The request as a report's config holds it (a mapping schedule as "LAYER:REMOVED,...")."""
        schedule = self.schedule
        if isinstance(schedule, Mapping):
            schedule = ",".join(f"{layer}:{n}" for layer, n in sorted(schedule.items()))
        return {"keep": self.keep, "preset": self.preset, "tflops": self.tflops, "schedule": schedule,
                "shape": self.shape, "first_layer": self.first_layer}
