"""`ficoco sweep`: every method at every budget point, costed by the accountant and, on request,
measured by the profiler and compared with vanilla's outputs (fidelity).

A point is one (method, budget, quant): `--keep 576,384,192` or `--tflops 3.3,2.4` gives one
point per value and reducing method, and vanilla one point per quant. The accountant costs each
point without torch. `--measure` builds the point's model (in the profiler's dtypes, checked
against free memory first) and measures the point on it with the profiler's `measure_row`;
`--fidelity` runs the same model on a few seeded prompts and compares the point's next-token
distribution with vanilla's. Each such point runs in its own process on an executor
(ficoco.sweep.executors: a local pool, Ray, or Slurm through submitit) and is stored as it finishes
(ficoco.sweep.store), so a stopped sweep resumes where it stopped. Methods come from the accountant's list of variants
(`ficoco.accounting.VARIANTS`), so a method added there is swept without a change here.
"""

from __future__ import annotations

import datetime as dt
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import ficoco
from ficoco import accounting as acc
from ficoco.accounting.flops import SCOPE_STAGES
from ficoco.errors import FicocoError
from ficoco.profiles import Profile, load_profile, set_layout
from ficoco.report.schemas import SWEEP_SCHEMA
from ficoco.sweep.store import SweepStore, point_key
from ficoco.versions import report_environment

VANILLA = "vanilla"


@dataclass(frozen=True)
class SweepConfig:
    """Everything that defines a sweep (written into its report)."""

    model: str
    variants: tuple[str, ...]
    keep: tuple[int, ...] = ()
    tflops: tuple[float, ...] = ()
    shape: str | None = None
    first_layer: int | None = None
    convention: str = "flops"
    scope: str = "llm"
    quants: tuple[str, ...] = ("fp16",)
    text_tokens: int = 60
    image_size: tuple[int, int] | None = None  # (H, W)
    frames: int | None = None
    overrides: tuple[str, ...] = ()
    measure: bool = False
    fidelity: bool = False
    samples: int = 4  # prompts the fidelity is averaged over
    warmup: int | None = None
    repeat: int | None = None
    device: str = "auto"
    weights: str = "random"
    dtype: str = "auto"
    seed: int = 0
    device_map: str | None = None  # auto, balanced, cpu-offload: each point's model split by accelerate
    max_memory: str | None = None  # the map's per-device limits, "cpu=200MiB,cuda:0=20GiB"
    # Accuracy through lmms-eval (`ficoco eval`, `ficoco sweep --eval`): the tasks, the folders of task YAML
    # outside lmms-eval, documents per task (None: all), requests per forward, a cap on new tokens.
    eval_tasks: tuple[str, ...] = ()
    eval_include: tuple[str, ...] = ()
    eval_limit: int | None = None
    eval_batch_size: int = 1
    eval_max_new_tokens: int | None = None
    kv_bits: int | None = None  # the evaluated model's quantized KV cache (8, 4, 2 bits)
    # Methods' hyperparameters (`--hp contextual_mode=mean`), each to the variants whose method has it: a
    # correction of a method's official code runs, and is labelled, at every point of that method.
    hyperparameters: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if bool(self.keep) == bool(self.tflops):
            raise FicocoError("give the points as keep=N,N,... or tflops=X,X,... (one of them)")
        for variant in self.variants:
            if variant not in acc.VARIANTS:
                raise FicocoError(f"unknown variant '{variant}' in variants=: choose from {', '.join(acc.VARIANTS)}")
        if self.eval_tasks and not Path(self.weights).expanduser().is_dir():
            raise FicocoError(f"weights={self.weights}: an evaluation runs a local checkpoint, the folder with its "
                              "weights, config.json and processor files; accuracy on random weights means nothing")

    @property
    def evaluates(self) -> bool:
        """Whether each point is evaluated through lmms-eval (scores beside the cost)."""
        return bool(self.eval_tasks)

    @property
    def budgets(self) -> list[dict[str, float]]:
        """The budget of every point, in the order given: {"keep": N} or {"tflops": X}."""
        if self.keep:
            return [{"keep": n} for n in self.keep]
        return [{"tflops": x} for x in self.tflops]

    def request(self, budget: dict[str, float] | None) -> acc.ScheduleRequest:
        """The schedule request of a point at `budget` (one of `budgets`; None: the method's default)."""
        return acc.ScheduleRequest(shape=self.shape, first_layer=self.first_layer, **(budget or {}))

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> SweepConfig:
        """The config `to_json` wrote (a store's manifest): lists back to tuples."""
        values = {k: tuple(v) if isinstance(v, list) else v for k, v in data.items() if k in cls.__dataclass_fields__}
        return cls(**values)


@dataclass
class Point:
    """One point of the sweep: its schedule and what the accountant, the profiler and the
    fidelity check said about it."""

    variant: str
    quant: str
    budget: dict[str, float] | None  # None for vanilla
    schedule: acc.Schedule
    analytic: dict[str, Any] = field(default_factory=dict)
    measured: dict[str, Any] | None = None
    fidelity: dict[str, Any] | None = None
    eval: dict[str, Any] | None = None  # the point's evaluation through lmms-eval (ficoco.eval/1)

    @property
    def key(self) -> str:
        """The point's name in a results store (ficoco.sweep.store)."""
        return point_key(self.variant, self.quant, self.budget)

    def to_json(self) -> dict[str, Any]:
        return {"variant": self.variant, "quant": self.quant, "budget": self.budget,
                "schedule": self.schedule.to_json(), "analytic": self.analytic, "measured": self.measured,
                "fidelity": self.fidelity, **({"eval": self.eval} if self.eval is not None else {})}


def default_store(config: SweepConfig) -> str:
    """Where a sweep that runs models keeps its points when --out is not given: one folder per set
    of settings, so the same command finds its own store again."""
    import hashlib

    digest = hashlib.sha1(json.dumps(config.to_json(), sort_keys=True).encode()).hexdigest()[:8]
    return str(Path("sweeps") / f"{Path(config.model).name}-{digest}")


def sweep_profile(config: SweepConfig) -> Profile:
    """The profile the sweep costs (a checkpoint folder's own config when --weights names one)."""
    source = config.weights if config.weights != "random" and Path(config.weights).expanduser().is_dir() else None
    profile = load_profile(source or config.model, list(config.overrides))
    named = _named_profile(config)
    if source and named is not None:  # a profile's defaults (first reducing layers, text tokens) for its checkpoint
        profile.defaults.update(named.defaults)
    set_layout(profile, image_size=config.image_size, frames=config.frames)
    return profile


def _named_profile(config: SweepConfig) -> Profile | None:
    """The profile `--model` names when it is a profile name beside a checkpoint folder (`--weights`), of
    the checkpoint's family; None otherwise."""
    from ficoco.profiles import list_profiles

    if config.model not in list_profiles() or config.weights == config.model:
        return None
    return load_profile(config.model)


def plan_points(config: SweepConfig, profile: Profile, skipped: list[dict[str, Any]] | None = None) -> list[Point]:
    """Every point, its schedule resolved and costed (every user mistake is found here, before
    any model is built). Vanilla comes first in every quant.

    A sweep runs every method on any family: a method the family refuses (the registry's
    reason, `ficoco methods --matrix`), or a budget one method cannot reach where others can
    (FastV's layer average, SparseVLM's published schedules, ...), is a point left out with its
    one-line reason, appended to `skipped`; a sweep of which no reducing point is left is refused
    with the first reason."""
    from ficoco.methods.registry import METHODS

    arch = acc.architecture(profile)
    opts = acc.CountOptions(convention=config.convention, scope=config.scope, text_tokens=config.text_tokens)
    variants = [VANILLA, *(v for v in config.variants if v != VANILLA)]
    per_variant = acc.method_hyperparameters(variants, config.hyperparameters)
    points: list[Point] = []
    left_out: list[tuple[dict[str, Any], FicocoError]] = []
    for quant_name in config.quants:
        quant = acc.make_quant(quant_name, None)
        for variant in variants:
            budgets: list[dict[str, float] | None] = [None] if variant == VANILLA else list(config.budgets)
            for budget in budgets:
                what = next(iter(budget)) if budget else "schedule"
                where = f"sweep point {variant} at --{what} {budget[what] if budget else ''}"
                status, reason = METHODS[variant].family_status(arch.family) if variant in METHODS else ("yes", "")
                if status == "refused":
                    error = FicocoError(f"{where}: {METHODS[variant].title} does not run on '{arch.family}' models: "
                                        f"{reason}")
                    left_out.append(({"variant": variant, "quant": quant_name, "budget": budget,
                                      "reason": f"refused on {arch.family}: {reason}"}, error))
                    continue
                try:
                    schedule = acc.resolve_schedule(arch, variant, opts, config.request(budget),
                                                    hyperparameters=per_variant.get(variant))
                except FicocoError as exc:
                    if variant == VANILLA:
                        raise FicocoError(f"{where}: {exc}") from None
                    left_out.append(({"variant": variant, "quant": quant_name, "budget": budget,
                                      "reason": str(exc)}, FicocoError(f"{where}: {exc}")))
                    continue
                cost = acc.account(arch, schedule, quant, opts).to_json()
                points.append(Point(variant, quant_name, budget, schedule, analytic=cost))
    if left_out and all(p.variant == VANILLA for p in points):
        raise left_out[0][1]
    if skipped is not None:
        skipped += [entry for entry, _ in left_out]
    return points


def new_report(config: SweepConfig, profile: Profile, points: list[Point],
               skipped: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The report of a sweep before anything is measured (the accountant's figures only), with the
    points `plan_points` left out and why."""
    arch = acc.architecture(profile)
    return {
        "schema": SWEEP_SCHEMA,
        "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "ficoco_version": ficoco.__version__,
        "model": arch.name,
        "config": config.to_json(),
        "convention": config.convention,
        "units": acc.UNITS[config.convention],
        "scope": config.scope,
        "scope_stages": list(SCOPE_STAGES[config.scope]),
        "image_size": arch.image_size,
        # The touched packages' versions; a measured sweep replaces it with the device's environment.
        "environment": report_environment(),
        "device": "analytic",
        "compute_dtype": None,
        "random_weights": config.weights == "random",
        "points": [p.to_json() for p in points],
        "skipped": list(skipped or []),
    }


# ---- measurement and fidelity ------------------------------------------------------------------------------

def fidelity_inputs(model: Any, config: SweepConfig, device: Any) -> list[dict[str, Any]]:
    """`samples` seeded prompts, one per forward (batch 1, as the memory guard planned)."""
    from ficoco.models import synthetic_inputs

    layout = {k: v for k, v in (("image_size", config.image_size), ("frames", config.frames)) if v is not None}
    return [synthetic_inputs(model, batch=1, text_tokens=config.text_tokens, seed=config.seed + k, device=device,
                             **layout) for k in range(config.samples)]


def next_token_logits(model: Any, inputs: list[dict[str, Any]]) -> list[Any]:
    """The logits at the last prompt position of every prompt (float64 on the host)."""
    import torch

    with torch.inference_mode():
        return [model(**x, use_cache=False, logits_to_keep=1).logits[0, -1].double().cpu() for x in inputs]


def compare_logits(reference: list[Any], reduced: list[Any]) -> dict[str, Any]:
    """KL(vanilla || reduced) of the next-token distribution, averaged over the prompts, and the
    share of prompts whose top-1 next token is vanilla's (profile --fidelity's own measures)."""
    import torch

    from ficoco.profiling.fidelity import kl_divergence

    kls = kl_divergence(torch.stack(reference), torch.stack(reduced)).tolist()
    agree = [float(int(p.argmax()) == int(q.argmax())) for p, q in zip(reference, reduced, strict=True)]
    return {"kl_divergence": sum(kls) / len(kls), "top1_agreement": sum(agree) / len(agree),
            "kl_per_sample": kls, "top1_per_sample": agree, "samples": len(kls),
            "position": "last prompt token", "reference": "vanilla, same model and inputs"}


def profile_config(config: SweepConfig, variants: tuple[str, ...], quants: tuple[str, ...]) -> Any:
    """The profiler's settings for points of this sweep (vanilla always among the variants: the
    memory check plans for its row, the largest)."""
    from ficoco.profiling.matrix import ProfileConfig

    return ProfileConfig.with_request(
        config.model, config.request(config.budgets[0]), variants=tuple(dict.fromkeys((VANILLA, *variants))),
        convention=config.convention, scope=config.scope, quants=quants, batches=(1,),
        text_tokens=config.text_tokens, warmup=config.warmup, repeat=config.repeat, device=config.device,
        weights=config.weights, overrides=config.overrides, seed=config.seed, image_size=config.image_size,
        frames=config.frames, dtype=config.dtype, device_map=config.device_map, max_memory=config.max_memory)


def check_run_here(config: SweepConfig, points: list[Point]) -> None:
    """Before any worker starts on this machine: the profiler's checks of the run (the device, the
    dtype, the weights, free memory for the largest row), so a user's mistake ends in one line
    instead of a failed record per point. Not for an engine's nodes: the driver may have no GPU."""
    from ficoco.profiling.matrix import plan_run

    plan_run(profile_config(config, tuple(dict.fromkeys(p.variant for p in points)), config.quants))


def run_point(config: SweepConfig, profile: Profile, point: Point, eval_out: str | None = None) -> dict[str, Any]:
    """Measure (`--measure`) and compare with vanilla (`--fidelity`) one point in this process, on a
    model built for it: what a sweep's worker runs, one point per process (ficoco.sweep.worker), so
    a crash or an out-of-memory of one point takes no other down. The fidelity's reference is
    vanilla on the same model and prompts, computed here. Returns the point's JSON with the
    environment it was measured in (speedups against vanilla are added when the store's report is
    assembled: vanilla is another point, another process)."""
    if config.evaluates:  # `eval_out`: where the point's ficoco.eval/1 record is written
        record = evaluate_point(config, point, eval_out).eval or {}
        return {"point": point.to_json(), "environment": record.get("environment"),
                "device": (record.get("timing") or {}).get("timed_on"), "compute_dtype": record.get("compute_dtype")}
    import torch

    from ficoco.profiling.environment import environment
    from ficoco.profiling.estimate import estimate_run, plan_runs
    from ficoco.profiling.matrix import RowSpec, _row_base, build_for, measured_row, new_rates, plan_run
    from ficoco.profiling.trackers import model_weight_bytes

    pconfig = profile_config(config, (point.variant,), (point.quant,))
    # plan_run checks the run (device, dtype, free memory for the largest row: vanilla's); the row
    # measured is the point's own schedule.
    plan = plan_run(pconfig)
    row = RowSpec(point.variant, point.quant, 1, point.schedule)
    plan.rows = [row]
    if config.measure:
        plan_runs(plan, estimate_run(pconfig, plan))
    env = environment(plan.device)
    torch.manual_seed(config.seed)
    model = build_for(pconfig, plan, point.quant)
    info = getattr(model, "_ficoco_quant", {})
    dtype = str(next(p for p in model.parameters() if p.is_floating_point()).dtype).removeprefix("torch.")
    if config.measure:
        rates = new_rates(plan, pconfig, model)
        measured = _row_base(plan, pconfig, row, {"compute_dtype": dtype, **info}, rates)
        measured["weight_bytes"] = model_weight_bytes(model)
        try:
            measured = measured_row(model, row, pconfig, plan, measured, rates)
        except FicocoError as exc:
            measured |= {"status": "unsupported", "reason": str(exc)}
        point.measured = measured
    if config.fidelity:
        inputs = fidelity_inputs(model, config, plan.device)
        reference = next_token_logits(model, inputs)
        try:
            point.fidelity = _fidelity_of(model, point, config, inputs, reference)
        except FicocoError as exc:  # planned by the accountant, not run by this family's model
            point.fidelity = {"status": "unsupported", "reason": str(exc)}
    device = env.get("device") if plan.device.type == "cuda" else f"cpu: {env.get('cpu')}"
    return {"point": point.to_json(), "environment": env, "device": device, "compute_dtype": dtype,
            "notes": list(plan.notes)}


def eval_model_args(config: SweepConfig, point: Point, out: str | None) -> dict[str, Any]:
    """The lmms-eval model_args of a point: the checkpoint, the method and its budget, the build, the
    count, and (for a profile named beside its checkpoint) the profile whose defaults it takes."""
    named = _named_profile(config)
    args: dict[str, Any] = {"pretrained": config.weights, "method": point.variant, "quant": point.quant,
                            "kv_bits": config.kv_bits, "device": config.device, "dtype": config.dtype,
                            "batch_size": config.eval_batch_size, "convention": config.convention,
                            "scope": config.scope, "text_tokens": config.text_tokens, "frames": config.frames,
                            "max_new_tokens": config.eval_max_new_tokens, "out": out,
                            "profile": named.name if named is not None else None,
                            "shape": config.shape if point.budget else None,
                            "first_layer": config.first_layer if point.budget else None}
    args.update(point.budget or {})
    args.update({k: v for k, v in config.hyperparameters.items() if k in _hyperparameters_of(point.variant)})
    return {key: value for key, value in args.items() if value is not None}


def _hyperparameters_of(variant: str) -> tuple[str, ...]:
    from ficoco.methods.registry import METHODS

    return tuple(METHODS[variant].hyperparameters) if variant in METHODS else ()


def evaluate_point(config: SweepConfig, point: Point, out: str | None) -> Point:
    """Evaluate one point through lmms-eval in this process (ficoco.eval.run): its `eval` block is the run's
    `ficoco.eval/1` record with the tasks' scores."""
    from ficoco.eval.run import evaluate

    point.eval = evaluate(eval_model_args(config, point, out), config.eval_tasks, include_paths=config.eval_include,
                          limit=config.eval_limit)
    return point


def _fidelity_of(model: Any, point: Point, config: SweepConfig, inputs: list[dict[str, Any]],
                 reference: list[Any]) -> dict[str, Any]:
    if point.variant == VANILLA:
        return compare_logits(reference, reference)
    with ficoco.apply(model, point.variant, schedule=point.schedule, image_size=config.image_size,
                      frames=config.frames):
        reduced = next_token_logits(model, inputs)
    return compare_logits(reference, reduced)


# ---- reading a saved report ----------------------------------------------------------------------------------

def read_report_any(path: str) -> dict[str, Any]:
    """A saved sweep (ficoco.sweep/1), profile (ficoco.report/1) or flops (ficoco.flops/1) report,
    or a sweep's results store (a folder: its report as the store holds it now, also while the
    sweep runs), validated enough to render or draw; one clear error otherwise."""
    from ficoco.report.compare import read_report
    from ficoco.report.schemas import FLOPS_SCHEMA, REPORT_SCHEMA, SERVE_SCHEMA
    if str(path).strip() and Path(path).expanduser().is_dir():
        if not SweepStore.is_store(path):
            raise FicocoError(f"{path} is a folder but not a sweep's results store (no manifest.json); give a "
                              "report file or a sweep's store folder")
        return SweepStore(path).report()

    try:
        text = Path(path).read_text() if str(path).strip() else ""
        data = json.loads(text) if text.strip() else None
    except (OSError, UnicodeDecodeError, ValueError):
        data = None
    if isinstance(data, dict) and data.get("schema") == SWEEP_SCHEMA:
        points = data.get("points")
        if not isinstance(points, list) or not all(isinstance(p, dict) and isinstance(p.get("analytic"), dict)
                                                   for p in points):
            raise FicocoError(f"{path} has no list of sweep points; give a report written by ficoco sweep")
        return data
    if isinstance(data, dict) and data.get("schema") == SERVE_SCHEMA:
        from ficoco.report.serve import check_serve_report

        return check_serve_report(data, str(path))
    if isinstance(data, dict) and data.get("schema") not in (None, REPORT_SCHEMA, FLOPS_SCHEMA):
        raise FicocoError(f"{path} has schema '{data.get('schema')}'; this ficoco reads '{REPORT_SCHEMA}', "
                          f"'{FLOPS_SCHEMA}', '{SWEEP_SCHEMA}' and '{SERVE_SCHEMA}'")
    return read_report(path, schemas=(REPORT_SCHEMA, FLOPS_SCHEMA))  # its own clear errors for anything else


def points_of(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The points of a sweep report, or a profile report's measured rows as points (one per row,
    its analytic figures the profiler's: flops convention, whole model)."""
    if report.get("schema") == SWEEP_SCHEMA:
        return list(report["points"])
    points = []
    for row in report.get("rows", []):
        analytic = row.get("analytic") or {}
        fidelity = row.get("fidelity") if isinstance(row.get("fidelity"), dict) else None
        points.append({"variant": row.get("variant"), "quant": row.get("quant"), "budget": None,
                       "schedule": row.get("schedule"), "analytic": analytic,
                       "measured": row, "fidelity": fidelity})
    return points


def finite(value: Any) -> bool:
    """A number that can be plotted."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
