"""The profile report (`ficoco.report/1`): the run's header (environment, config, time estimate),
then every measured row with its estimate, each paired with its vanilla row. `ficoco.profile(...)`
returns it; `ficoco profile --json` writes the same dict, rewritten after every row through the
`on_row` callback. torch is imported on first call, not with this module."""

from __future__ import annotations

import dataclasses
import datetime as dt
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ficoco.errors import FicocoError
from ficoco.report.flops import names
from ficoco.report.pairing import add_comparisons
from ficoco.report.schemas import REPORT_SCHEMA

if TYPE_CHECKING:
    from ficoco.accounting.request import ScheduleRequest
    from ficoco.profiling.config import ProfileConfig


@dataclasses.dataclass
class ProfilePlan:
    """A profile run planned, before any model is built: the config, the plan (device, rows,
    notes), its time estimate, and the report that the rows will be appended to (its header
    filled: environment, config, estimate)."""

    config: ProfileConfig
    plan: Any  # ficoco.profiling.matrix.Plan
    estimate: Any  # ficoco.profiling.estimate.RunEstimate
    report: dict[str, Any]


def profile_header(config: Any, plan: Any, estimate: Any, env: dict[str, Any]) -> dict[str, Any]:
    """The report before its first row: schema, time, environment, config with the runs' rule, estimate, notes."""
    auto = "auto"
    return {
        "schema": REPORT_SCHEMA,
        "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "environment": env,
        "config": config.to_json() | {"gpu_profile": plan.gpu.key if plan.gpu else None,
                                      "warmup": auto if plan.warmup is None else plan.warmup,
                                      "repeat": auto if plan.repeat is None else plan.repeat,
                                      "runs_rule": estimate.runs_rule},
        "estimate": estimate.to_json(),
        # What was said before the run (a device fallback, a method left out with its reason): a
        # library caller sees it here, where the CLI prints it.
        "notes": list(plan.notes),
        "wall_s": 0.0,
        "rows": [],
    }


def add_row(report: dict[str, Any], row: dict[str, Any], estimate: Any, wall_s: float) -> None:
    """Append a finished (or failed) row with its estimate, and pair every row with its vanilla row again."""
    index = len(report["rows"])
    row["estimate"] = estimate.rows[index].to_json() | {"build_s": estimate.build_s.get(row["quant"])}
    report["rows"].append(row)
    report["wall_s"] = wall_s
    add_comparisons(report["rows"])


def profile_config(model: str, variants: str | Sequence[str] = "v", *, request: ScheduleRequest | None = None,
                   keep: int | None = None, preset: int | None = None, tflops: float | None = None,
                   schedule: str | None = None, shape: str | None = None, first_layer: int | None = None,
                   convention: str = "flops", scope: str = "llm", reference: bool = True,
                   quants: str | Sequence[str] = "fp16", kv_bits: int | None = None,
                   batches: int | Sequence[int] = 1, text_tokens: int = 60, new_tokens: int = 0,
                   warmup: int | None = None, repeat: int | None = None, device: str = "auto",
                   weights: str = "random", image: str | None = None, prompt: str | None = None,
                   video: str | None = None, fidelity: bool = False, overrides: Sequence[str] = (), seed: int = 0,
                   image_size: tuple[int, int] | None = None, frames: int | None = None, dtype: Any = "auto",
                   device_map: str | None = None, max_memory: str | None = None,
                   hyperparameters: Mapping[str, Any] | None = None, distinct_layers: int | None = None
                   ) -> ProfileConfig:
    """The `ProfileConfig` of a run from its keyword spelling (what `ficoco.profile(model, ...)` and
    `ficoco profile` take): `variants` and `quants` as "a,b" or a list, `batches` as one size or
    several, `reference` adds the vanilla rows (default True), `dtype` as a name or a torch dtype.
    The schedule is `request` (a `ScheduleRequest`) or its keywords `keep`, `preset`, `tflops`,
    `schedule`, `shape`, `first_layer` (not both). `hyperparameters` go to every variant whose method
    has them ({"contextual_mode": "mean"}: one of ficoco's corrections, which each row's method_label names).
    `distinct_layers`: that many decoder layers hold weights, the deeper ones share layer i mod N's (a decoder
    deeper than memory at its full depth and cost)."""
    from ficoco.accounting.request import ScheduleRequest
    from ficoco.machine.dtype_choice import parse_dtype
    from ficoco.profiling.config import ProfileConfig

    request = ScheduleRequest.of(request, keep=keep, preset=preset, tflops=tflops, schedule=schedule, shape=shape,
                                 first_layer=first_layer)
    variants = names(variants)
    if reference and "vanilla" not in variants:
        variants = ["vanilla", *variants]
    batch_sizes = (batches,) if isinstance(batches, int) else tuple(dict.fromkeys(batches))
    return ProfileConfig.with_request(
        model, request, variants=tuple(variants), convention=convention, scope=scope,
        quants=tuple(names(quants)), batches=batch_sizes, text_tokens=text_tokens,
        new_tokens=new_tokens, warmup=warmup, repeat=repeat, device=device, weights=weights, image=image,
        prompt=prompt, overrides=tuple(overrides), seed=seed, kv_bits=kv_bits,
        image_size=image_size, frames=frames, dtype=parse_dtype(dtype), video=video,
        fidelity=fidelity, device_map=device_map, max_memory=max_memory,
        hyperparameters=dict(hyperparameters or {}), distinct_layers=distinct_layers,
    )


def plan_profile(config: ProfileConfig) -> ProfilePlan:
    """Plan the profile run `config` and estimate its time; builds no model."""
    from ficoco.methods.registry import METHODS
    from ficoco.profiling.environment import environment
    from ficoco.profiling.estimate import estimate_run, plan_runs
    from ficoco.profiling.matrix import plan_run
    from ficoco.profiling.real_inputs import resolve_prompt

    for name in config.variants:  # a method the model adapters do not run yet: refused before anything is planned
        if name != "vanilla" and name in METHODS:
            METHODS[name].check_wired("ficoco.profile")
    # A real prompt is laid out by the checkpoint's processor first: its mistakes are the user's,
    # and the run is planned for the layout it made.
    config, prompt_inputs = resolve_prompt(config)
    try:
        plan = plan_run(config, prompt_inputs)
    except FicocoError as exc:
        if config.preset is None:
            raise
        from ficoco.accounting import preset_message

        raise FicocoError(preset_message(str(exc), config.preset)) from None
    estimate = estimate_run(config, plan)
    plan_runs(plan, estimate)
    planned = ProfilePlan(config, plan, estimate, {})
    planned.report = profile_header(config, plan, estimate, environment(plan.device))
    return planned


def run_planned(planned: ProfilePlan, on_row: Callable[[dict[str, Any]], None] | None = None,
                on_phase: Callable[[Any], None] | None = None) -> dict[str, Any]:
    """Measure every row of a planned run into `planned.report` and return it. `on_row(report)`
    is called after each row (appended, paired with vanilla): write it there, and an interrupted
    run keeps what it measured. `on_phase(phase)` is told when each step starts and ends."""
    from ficoco.profiling.matrix import run_profile

    report, estimate = planned.report, planned.estimate
    begin = time.perf_counter()

    def row_done(row: dict[str, Any]) -> None:
        add_row(report, row, estimate, time.perf_counter() - begin)
        if on_row is not None:
            on_row(report)

    run_profile(planned.config, planned.plan, row_done, on_phase=on_phase)
    return report


def profile_report(config: ProfileConfig | str | None = None, variants: str | Sequence[str] | None = None, *,
                   on_plan: Callable[[ProfilePlan], None] | None = None,
                   on_phase: Callable[[Any], None] | None = None,
                   on_row: Callable[[dict[str, Any]], None] | None = None,
                   dry_run: bool = False, **settings: Any) -> dict[str, Any]:
    """Measure the run `config` (a `ficoco.profiling.config.ProfileConfig`) and return the
    `ficoco.report/1` report `ficoco profile --json` writes: prefill latency, throughput, peak
    memory and KV cache per row, each row beside its vanilla row (speedup, FLOPs ratio, memory
    saving) and its time estimate.

    `ficoco.profile(model, variants, **settings)` is the keyword spelling of the same config
    (`profile_config`): `model` a profile name, a config.json or a checkout folder; `variants`
    ("v" when not given); the schedule (`request`, or `keep`, `preset`, `tflops` under
    `convention`/`scope`, `schedule`, `shape`, `first_layer`), `reference` (add the vanilla rows,
    default True), `quants`, `kv_bits`, `batches`, `text_tokens`, `new_tokens`, `warmup` and
    `repeat` (None: by time), `device`, `weights` ("random", a checkpoint folder or a cached HF
    id), `image`/`prompt`/`video`, `fidelity`, `overrides`, `seed`, `image_size` (H, W), `frames`,
    `dtype`, `device_map`, `max_memory`, `hyperparameters`.

    `on_plan(planned)` is called once the run is planned, before any model is built (the CLI
    prints the plan and starts its progress display there); with `dry_run` nothing is measured and
    the report comes back with its header and no rows. `on_phase(phase)` is told when every step
    starts and ends; `on_row(report)` after every row."""
    if config is None and "model" in settings:  # ficoco.profile(model=..., ...)
        config = settings.pop("model")
    if config is None:
        raise FicocoError("give a ProfileConfig, or the model to profile (model=)")
    if isinstance(config, str):
        config = profile_config(config, "v" if variants is None else variants, **settings)
    elif variants is not None or settings:
        given = ["variants", *settings] if variants is not None else list(settings)
        raise FicocoError(f"give a ProfileConfig or its settings ({', '.join(f'{k}=' for k in given)}), not both")
    planned = plan_profile(config)
    if on_plan is not None:
        on_plan(planned)
    if dry_run:
        return planned.report
    return run_planned(planned, on_row=on_row, on_phase=on_phase)
