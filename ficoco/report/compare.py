"""Compare two `ficoco profile` reports and give a verdict per metric.

Rows are matched by a configuration fingerprint. Deterministic metrics (visual tokens,
analytic TFLOPs, KV and weight bytes) must not move by more than 0.1%. Timed metrics are
judged on in-run ratios that cancel the machine's speed (a variant's speedup over the vanilla
row of the same run), with a tolerance and, when both reports carry raw samples, a
one-sided Mann-Whitney test so that noise is not called a regression. Absolute latencies
and throughputs are shown, and judged only on request. Fidelity against vanilla (`--fidelity`:
top-1 and greedy-token agreement, KL divergence) is judged like a deterministic figure, with the
tolerance: an agreement that drops by more than `--tolerance` points, or a KL divergence that grows
by more than `--tolerance` percent (and more than 0.001 nats), is a regression.

Even an in-run ratio moves with the processor: bf16 matrix work is fast with AMX and slow with
AVX2 alone, so a variant's speedup says as much about the CPU as about the code. Measured
metrics (timed ratios, absolute figures) are therefore judged only between reports made on the
same processor (CPU model, features and ISA caps, or GPU name), unless the caller asks for it.

Two evaluated sweep reports (`ficoco.sweep/1` whose config names `eval_tasks`; `compare_eval`) are
compared point by point, a point being (method, method label, quant, budget; a failed evaluation
that names no label is its method's point of that quant and budget), on the accuracy the
lmms-eval run measured (ficoco.eval.join):

- every task's score and the mean score: a drop larger than `--tolerance` percent of vanilla's
  score (the base report's vanilla, same task and quant) is a regression. Scores come on the
  task's own scale (0..1 or 0..100, as lmms-eval reports it), so a tolerance in the score's units
  would mean one thing on one task and a hundred times more on another; relative to vanilla's
  score it means the same on both, and it is the papers' unit too: a 2 % drop is two points of
  "performance retention". Where vanilla's base score is 0 (or missing) the point's own base score
  is the unit, and where that is 0 too any change counts. A score of another number of documents
  (another `--limit`) is not the same test: shown, not judged;
- the agreement of the answers with vanilla's (a share) like the fidelity agreements above: a drop
  of more than `--tolerance` points is a regression;
- the mean visual tokens and TFLOPs per sample are deterministic: any move beyond 0.1 % counts;
- the eval's mean prefill, time to first token and decode time per token are absolute timings of
  one run: shown, and judged like the profile's absolute figures only with `absolute=True`, on
  the same processor;
- an evaluation that ran in base and failed in new is a regression.

Two sweep reports of different models, tasks, or cost conventions are not comparable (one error).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ficoco.errors import FicocoError
from ficoco.report.precision import precision_of
from ficoco.report.schemas import FLOPS_SCHEMA, REPORT_SCHEMA, SERVE_SCHEMA, SWEEP_SCHEMA

DETERMINISTIC_TOLERANCE = 0.001  # 0.1%
SIGNIFICANCE = 0.05

LOWER, HIGHER = "lower", "higher"
JUDGE_CHOICES = ("all", "deterministic", "timed")


@dataclass(frozen=True)
class Metric:
    """A metric of a report row: how to read it, which way is better, how to judge it."""

    name: str
    path: tuple[str, ...]
    better: str
    kind: str  # "deterministic", "ratio" (in-run, timed), "absolute" (judged only with --absolute), "fidelity"
    unit: str = ""
    # Per-run latencies behind a timed metric, for the significance test (None: none recorded).
    samples: tuple[str, ...] | None = None


METRICS = (
    Metric("visual_tokens", ("analytic", "visual_tokens"), HIGHER, "deterministic"),
    Metric("analytic_tflops", ("analytic", "tflops"), LOWER, "deterministic", "TFLOPs"),
    Metric("kv_cache_bytes", ("kv_cache_bytes",), LOWER, "deterministic", "B"),
    Metric("weight_bytes", ("analytic", "weight_bytes"), LOWER, "deterministic", "B"),
    # What the built model holds (parameters, buffers, quantization state): catches weights that
    # stayed 16-bit under int8/int4, which the analytic figure cannot.
    Metric("measured_weight_bytes", ("weight_bytes",), LOWER, "deterministic", "B"),
    Metric("speedup_vs_vanilla", ("speedup_vs_vanilla",), HIGHER, "ratio", "x"),
    Metric("memory_saving_vs_vanilla", ("memory_saving_vs_vanilla",), HIGHER, "ratio"),
    Metric("latency_median_ms", ("latency", "median_ms"), LOWER, "absolute", "ms"),
    Metric("images_per_s", ("images_per_s",), HIGHER, "absolute", "img/s"),
    Metric("peak_memory_bytes", ("memory", "peak_bytes"), LOWER, "absolute", "B"),
    # Outputs against vanilla on the same inputs (--fidelity); only reduced rows carry them.
    Metric("top1_agreement", ("fidelity", "top1_agreement"), HIGHER, "fidelity"),
    Metric("greedy_prefix_share", ("fidelity", "greedy_prefix_share"), HIGHER, "fidelity"),
    Metric("kl_divergence", ("fidelity", "kl_divergence"), LOWER, "fidelity", "nats"),
    # --new-tokens: decoding (profiling/decode.py), the cache at its end, answering end to end.
    Metric("decode_kv_cache_bytes", ("generation", "kv_cache_bytes"), LOWER, "deterministic", "B"),
    Metric("generation_speedup_vs_vanilla", ("generation_speedup_vs_vanilla",), HIGHER, "ratio", "x",
           ("generation", "total", "samples_ms")),
    Metric("ttft_ms", ("generation", "ttft", "median_ms"), LOWER, "absolute", "ms",
           ("generation", "ttft", "samples_ms")),
    Metric("decode_ms_per_token", ("generation", "decode_per_token", "median_ms"), LOWER, "absolute", "ms",
           ("generation", "decode_per_token", "samples_ms")),
    Metric("decode_p90_ms_per_token", ("generation", "decode_per_token", "p90_ms"), LOWER, "absolute", "ms"),
    Metric("generation_total_ms", ("generation", "total", "median_ms"), LOWER, "absolute", "ms",
           ("generation", "total", "samples_ms")),
    Metric("generation_images_per_s", ("generation", "images_per_s"), HIGHER, "absolute", "img/s",
           ("generation", "total", "samples_ms")),
    Metric("generation_tokens_per_s", ("generation", "tokens_per_s"), HIGHER, "absolute", "tok/s",
           ("generation", "total", "samples_ms")),
)
# A KL divergence this small is rounding, not a change in what the model says.
KL_FLOOR_NATS = 1e-3

FINGERPRINT_KEYS = ("model", "variant", "schedule", "quant", "dtype", "batch", "text_tokens", "new_tokens",
                    "device_kind", "kv_bits", "corrections")  # kv_bits: None (absent in older reports) is the
# unquantized cache; corrections: None is the method's official code (older reports hold no settings)
ENVIRONMENT_KEYS = ("device", "cpu", "threads", "python", "torch", "transformers", "accelerate", "hqq", "bitsandbytes",
                    "driver")


def read_report(path: str | Path, schemas: tuple[str, ...] = (REPORT_SCHEMA,)) -> dict[str, Any]:
    """A report of one of `schemas` (by default a `ficoco.report/1` file), validated enough to compare
    or render it."""
    if not str(path).strip():
        raise FicocoError("a report path is empty (''); give a ficoco.report/1 file")
    path = Path(path)
    try:
        text = path.read_text()
    except UnicodeDecodeError:
        raise FicocoError(f"{path} is not a text file (a compressed or binary file?); give a JSON report") from None
    except OSError as exc:
        raise FicocoError(f"cannot read {path}: {exc.strerror or exc}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise FicocoError(
            f"{path} is not valid JSON ({exc.msg} at line {exc.lineno}): truncated or not a report") from None
    if not isinstance(data, dict) or "schema" not in data:
        raise FicocoError(f"{path} is not a ficoco report (no schema field)")
    if data["schema"] not in schemas:
        raise FicocoError(f"{path} has schema '{data['schema']}'; this ficoco reads {' or '.join(map(repr, schemas))} "
                          "here")
    if not isinstance(data.get("rows"), list) or not all(isinstance(r, dict) for r in data["rows"]):
        raise FicocoError(f"{path} has no list of rows")
    return data


def _judge_by_kind(metric: Metric, change: float, worse: bool, judge: str,
                   timed_refused: str | None) -> tuple[str, str] | None:
    """The verdicts every report's metrics share: a deterministic figure may not move beyond 0.1 %, and a timed
    one is not judged where `judge` or the machines (`timed_refused`) say so; None: the caller judges the timed
    figure itself."""
    if metric.kind == "deterministic" and judge == "timed":
        return "not judged", "judge=timed: deterministic metrics not judged"
    if metric.kind == "deterministic":
        moved = abs(change) > DETERMINISTIC_TOLERANCE
        return ("ok" if not moved else ("regression" if worse else "improvement"),
                "deterministic: any change beyond 0.1% counts")
    if judge == "deterministic":
        return "not judged", "judge=deterministic: timed metrics not judged"
    if timed_refused:
        return "not judged", timed_refused
    return None


def fingerprint(row: dict[str, Any]) -> tuple[Any, ...]:
    """What makes two rows the same measurement."""
    values = dict(row)
    backend = row.get("backend") or {}
    values["dtype"] = backend.get("compute_dtype")
    # An upcast layout (16-bit weights computed in float32) is another measurement than float32
    # weights, and one with other upcast layers too: other bytes, other time.
    if backend.get("upcast_layers"):
        values["dtype"] += f" on {backend.get('storage_dtype')}, {backend['upcast_layers']} upcast layers"
    values["schedule"] = json.dumps(row.get("schedule"), sort_keys=True)
    # A run of ficoco's correction of a method is another measurement than the official method's, and a run of a
    # method's named rule (FiCoCo's official code's) another than its default rule's.
    from ficoco.methods.registry import corrections_on, rule_on

    settings = row.get("settings") or (row.get("analytic") or {}).get("settings")
    variant = str(row.get("variant"))
    notes = ", ".join(corrections_on(variant, settings))
    rule = rule_on(variant, settings)
    values["corrections"] = "; ".join(filter(None, (rule, notes and f"ficoco: {notes}"))) or None
    return tuple(values.get(k) for k in FINGERPRINT_KEYS)


def describe(key: tuple[Any, ...]) -> str:
    values = dict(zip(FINGERPRINT_KEYS, key, strict=True))
    removed = sum(e.get("remove", 0) for e in json.loads(values["schedule"] or "[]"))
    label = values["variant"] + (f" ({values['corrections']})" if values.get("corrections") else "")
    dtype = str(values.get("dtype") or "").split(" on ")[0] or None  # an upcast layout: "float32 on bfloat16, ..."
    return (f"{values['model']} {label} {precision_of(values['quant'], dtype)} batch {values['batch']}"
            + (f" kv{values['kv_bits']}" if values.get("kv_bits") else "")
            + (f" (removes {removed})" if removed else ""))


def processor(environment: dict[str, Any]) -> tuple[tuple[Any, ...] | None, str]:
    """What measured figures depend on besides the code: a key that is equal for reports made on
    the same processor (None when the report does not say enough), and the processor in words."""
    kind = environment.get("device_kind")
    if kind == "cuda":
        name = environment.get("device")
        return (("cuda", name) if name else None), name or "an unnamed GPU"
    if kind != "cpu":
        return None, "an unrecorded device"
    model, flags = environment.get("cpu"), environment.get("cpu_flags")
    if not model or not flags:  # reports made before the features were recorded, or off Linux
        return None, f"{model or 'a CPU'} (features not recorded)"
    have = [name for name, present in flags.items() if present]
    capability = environment.get("cpu_capability")
    caps = environment.get("cpu_isa_overrides") or {}
    words = f"{model} ({' '.join(have) or 'no ' + '/'.join(flags)}; torch {capability}"
    words += "".join(f"; {name}={value}" for name, value in sorted(caps.items())) + ")"
    return ("cpu", model, tuple(sorted(have)), capability, tuple(sorted(caps.items()))), words


def same_processor(base_env: dict[str, Any], new_env: dict[str, Any]) -> tuple[bool, str]:
    """Whether two reports' timings come from the same processor, and if not, why not in words."""
    (base_key, base_words), (new_key, new_words) = processor(base_env), processor(new_env)
    if base_key is None or new_key is None:
        unknown = [side for side, key in (("base", base_key), ("new", new_key)) if key is None]
        return False, (f"the processor of {' and '.join(unknown)} is unknown (base: {base_words}; new: {new_words})")
    if base_key != new_key:
        return False, f"different processors (base: {base_words}; new: {new_words})"
    return True, f"same processor: {new_words}"


def _get(row: dict[str, Any], path: tuple[str, ...]) -> float | None:
    node: Any = row
    for part in path:
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return float(node) if isinstance(node, (int, float)) and not isinstance(node, bool) else None


def mann_whitney_less(new: list[float], base: list[float]) -> float:
    """One-sided p-value that `new` tends to be smaller than `base` (normal approximation
    with tie correction; exact enough for the handful-of-runs samples reports carry)."""
    n1, n2 = len(new), len(base)
    if n1 == 0 or n2 == 0:
        return 1.0
    pooled = sorted((v, i) for i, v in enumerate(new + base))
    ranks = [0.0] * (n1 + n2)
    k = 0
    tie_term = 0.0
    while k < len(pooled):
        j = k
        while j + 1 < len(pooled) and pooled[j + 1][0] == pooled[k][0]:
            j += 1
        rank = (k + j) / 2 + 1
        for m in range(k, j + 1):
            ranks[pooled[m][1]] = rank
        t = j - k + 1
        tie_term += t**3 - t
        k = j + 1
    u_new = sum(ranks[:n1]) - n1 * (n1 + 1) / 2
    mean = n1 * n2 / 2
    n = n1 + n2
    variance = n1 * n2 / 12 * ((n + 1) - tie_term / (n * (n - 1)))
    if variance <= 0:
        return 1.0 if u_new >= mean else 0.0
    z = (u_new - mean + 0.5) / math.sqrt(variance)  # continuity correction
    return 0.5 * math.erfc(-z / math.sqrt(2))


def _samples(row: dict[str, Any], path: tuple[str, ...]) -> list[float]:
    node: Any = row
    for part in path:
        node = node.get(part) if isinstance(node, dict) else None
    return [float(x) for x in node] if isinstance(node, list) else []


def speedup_samples(row: dict[str, Any], reference: dict[str, Any] | None,
                    path: tuple[str, ...] = ("latency", "samples_ms")) -> list[float]:
    """Per-run speedups: the k-th vanilla sample over the row's k-th sample (same run). One
    value per run pair keeps the samples independent; all pairs would overstate significance."""
    if reference is None:
        return []
    own, base = _samples(row, path), _samples(reference, path)
    return [b / o for b, o in zip(base, own, strict=False) if o > 0]


@dataclass
class Verdict:
    row: str
    metric: str
    kind: str
    base: float | None
    new: float | None
    change: float | None  # relative, new vs base
    verdict: str  # ok, regression, improvement, noise, not judged, missing
    detail: str = ""


@dataclass
class Comparison:
    verdicts: list[Verdict] = field(default_factory=list)
    only_base: list[str] = field(default_factory=list)
    only_new: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def regressions(self) -> list[Verdict]:
        return [v for v in self.verdicts if v.verdict == "regression"]

    def to_json(self) -> dict[str, Any]:
        def finite(x: Any) -> Any:  # strict JSON has no Infinity or NaN
            return None if isinstance(x, float) and not math.isfinite(x) else x

        return {"schema": "ficoco.compare/1", "regressions": len(self.regressions), "warnings": self.warnings,
                "only_in_base": self.only_base, "only_in_new": self.only_new,
                "verdicts": [{k: finite(v) for k, v in vars(verdict).items()} for verdict in self.verdicts]}


def vanilla_of(rows: dict[tuple[Any, ...], dict[str, Any]], key: tuple[Any, ...]) -> dict[str, Any] | None:
    """The vanilla row measured with the row `key` (same quant, dtype, batch, tokens), if any."""
    values = dict(zip(FINGERPRINT_KEYS, key, strict=True))
    values["variant"], values["schedule"] = "vanilla", json.dumps([], sort_keys=True)
    return rows.get(tuple(values[k] for k in FINGERPRINT_KEYS))


def compare(base: dict[str, Any], new: dict[str, Any], *, tolerance_pct: float = 10.0,
            absolute: bool = False, judge: str = "all", cross_machine: bool = False) -> Comparison:
    """Judge every metric of every row the two reports share.

    `judge` picks what is judged ("deterministic" or "timed" metrics, or "all"); the others are
    shown as not judged. Measured metrics are judged only when both reports name the same
    processor, or with `cross_machine`; a failed row is judged in every case."""
    if not (math.isfinite(tolerance_pct) and tolerance_pct >= 0):  # nan judges every change, inf none
        raise FicocoError(f"tolerance_pct={tolerance_pct:g}: give a finite percentage of at least 0")
    if judge not in JUDGE_CHOICES:
        raise FicocoError(f"unknown judge='{judge}': choose from {', '.join(JUDGE_CHOICES)}")
    if SERVE_SCHEMA in (base.get("schema"), new.get("schema")):
        raise FicocoError(f"a serving report ({SERVE_SCHEMA}) is compared with another serving report only "
                          "(ficoco.report.serve.compare_serve; `ficoco compare` picks it)")
    if SWEEP_SCHEMA in (base.get("schema"), new.get("schema")):
        return compare_eval(base, new, tolerance_pct=tolerance_pct, absolute=absolute, judge=judge,
                            cross_machine=cross_machine)
    for side, report in (("base", base), ("new", new)):
        if report.get("schema") == FLOPS_SCHEMA:
            raise FicocoError(f"the {side} report has schema '{FLOPS_SCHEMA}' (the accountant's costs, nothing "
                              f"measured); compare judges '{REPORT_SCHEMA}' profile reports and evaluated "
                              f"'{SWEEP_SCHEMA}' sweep reports")
    result = Comparison()
    timed_refused = _environment_warnings(result, base.get("environment", {}), new.get("environment", {}), judge,
                                          cross_machine)
    base_all = {fingerprint(r): r for r in base["rows"]}
    new_all = {fingerprint(r): r for r in new["rows"]}
    base_rows = {k: r for k, r in base_all.items() if r.get("status") == "ok"}
    new_rows = {k: r for k, r in new_all.items() if r.get("status") == "ok"}
    # A row measured in base that fails in new (out of memory, unsupported) is a regression.
    for key in base_rows:
        failed = new_all.get(key)
        if failed is not None and failed.get("status") != "ok":
            result.verdicts.append(Verdict(describe(key), "status", "deterministic", None, None, None, "regression",
                                           f"new run: {failed.get('status')}: {failed.get('reason', '')}"))
    common = [k for k in base_rows if k in new_rows]
    result.only_base = [describe(k) for k in base_all if k not in new_all]
    result.only_new = [describe(k) for k in new_all if k not in base_all]
    if not common and not result.verdicts:
        raise FicocoError("the two reports have no measured row in common (model, variant, schedule, quant, dtype, "
                          "batch, text and new tokens, device kind must all match)")
    tolerance = tolerance_pct / 100
    for key in common:
        b_row, n_row = base_rows[key], new_rows[key]
        name = describe(key)
        for metric in METRICS:
            b, n = _get(b_row, metric.path), _get(n_row, metric.path)
            if b is None or n is None:
                if b is not None or n is not None:
                    result.verdicts.append(Verdict(name, metric.name, metric.kind, b, n, None, "missing",
                                                   "present in one report only"))
                continue
            if math.isnan(b) or math.isnan(n):
                invalid = math.isnan(n) and not math.isnan(b)
                result.verdicts.append(Verdict(name, metric.name, metric.kind, b, n, None,
                                               "regression" if invalid else "not judged",
                                               "new value is NaN" if invalid else "base value is NaN"))
                continue
            if metric.kind == "ratio" and b_row.get("variant") == "vanilla":
                continue  # the reference row's ratios to itself are 1 and 0 by construction
            if metric.name == "memory_saving_vs_vanilla" or metric.name.endswith(("_agreement", "_share")):
                change = n - b  # a share: judged in points, a relative change of a near-0 share is noise
            else:
                change = (n - b) / abs(b) if b else (0.0 if n == b else math.inf)
            worse = (n < b) if metric.better == HIGHER else (n > b)
            if metric.kind == "fidelity":
                verdict, detail = _judge_fidelity(metric, b, n, change, worse, tolerance, judge)
            elif (shared := _judge_by_kind(metric, change, worse, judge, timed_refused)) is not None:
                verdict, detail = shared
            elif metric.kind == "ratio" or absolute:
                verdict, detail = _judge_timed(metric, b_row, n_row, base_rows, new_rows, key, change, worse,
                                               tolerance)
            else:
                verdict, detail = "not judged", "absolute figure: judged only with absolute=True"
            result.verdicts.append(Verdict(name, metric.name, metric.kind, b, n, change, verdict, detail))
    return result


def _environment_warnings(result: Comparison, base_env: dict[str, Any], new_env: dict[str, Any], judge: str,
                          cross_machine: bool) -> str:
    """Warn of environments that differ and of timed metrics that are not judged across processors;
    the reason timed metrics are not judged ("" when they are)."""
    differs = [f"{k}: {base_env.get(k)} -> {new_env.get(k)}" for k in ENVIRONMENT_KEYS
               if base_env.get(k) != new_env.get(k)]
    if differs:
        result.warnings.append("the reports come from different environments (" + "; ".join(differs) + ")")
    same, processors = same_processor(base_env, new_env)
    if same or judge == "deterministic":
        return ""
    if cross_machine:
        result.warnings.append(f"timed metrics judged across processors, as asked (cross_machine=True): "
                               f"{processors}")
        return ""
    result.warnings.append(f"timed metrics not judged: {processors}; a speedup moves with the processor "
                           "(bf16 with AMX or AVX2 alone) as much as with the code; cross_machine=True judges "
                           "them anyway")
    return "processors differ or are unknown: see the warning"


def _judge_fidelity(metric: Metric, base: float, new: float, change: float, worse: bool, tolerance: float,
                    judge: str) -> tuple[str, str]:
    """Agreements move in points of a share; KL divergence relative to base, above a floor."""
    if judge == "timed":
        return "not judged", "judge=timed: fidelity not judged"
    if metric.better == HIGHER:
        moved, rule = abs(change) > tolerance, f"{tolerance * 100:g} points"
    else:
        moved = abs(new - base) > max(tolerance * abs(base), KL_FLOOR_NATS)
        rule = f"{tolerance * 100:g}% and {KL_FLOOR_NATS:g} nats"
    if not moved:
        return "ok", f"fidelity: within {rule}"
    return ("regression" if worse else "improvement"), f"fidelity: beyond {rule}"


def _judge_timed(metric: Metric, b_row: dict[str, Any], n_row: dict[str, Any], base_rows: dict, new_rows: dict,
                 key: tuple[Any, ...], change: float, worse: bool, tolerance: float) -> tuple[str, str]:
    if abs(change) <= tolerance:
        return "ok", f"within {tolerance * 100:g}%"
    if not worse:
        return "improvement", f"beyond {tolerance * 100:g}%, better"
    if metric.name == "speedup_vs_vanilla":
        new_samples = speedup_samples(n_row, vanilla_of(new_rows, key))
        base_samples = speedup_samples(b_row, vanilla_of(base_rows, key))
    elif metric.name == "generation_speedup_vs_vanilla" and metric.samples:
        new_samples = speedup_samples(n_row, vanilla_of(new_rows, key), metric.samples)
        base_samples = speedup_samples(b_row, vanilla_of(base_rows, key), metric.samples)
    elif metric.name == "latency_median_ms":
        # Larger latency is worse: test that base tends to be smaller than new.
        new_samples = [-x for x in n_row.get("latency", {}).get("samples_ms", [])]
        base_samples = [-x for x in b_row.get("latency", {}).get("samples_ms", [])]
    elif metric.samples:
        # Latency samples: a lower-is-better time negated, a higher-is-better rate as 1/time, so
        # that "new tends to be smaller" means "new is worse" for both.
        def oriented(row: dict[str, Any]) -> list[float]:
            values = _samples(row, metric.samples)  # type: ignore[arg-type]
            return [-x for x in values] if metric.better == LOWER else [1 / x for x in values if x > 0]

        new_samples, base_samples = oriented(n_row), oriented(b_row)
    else:
        new_samples = base_samples = []
    if len(new_samples) >= 2 and len(base_samples) >= 2:
        p = mann_whitney_less(new_samples, base_samples)
        if p >= SIGNIFICANCE:
            return "noise", f"beyond {tolerance * 100:g}% but not significant (Mann-Whitney p={p:.3f})"
        return "regression", f"beyond {tolerance * 100:g}% and significant (Mann-Whitney p={p:.3f})"
    return "regression", f"beyond {tolerance * 100:g}% (no raw samples to test significance)"


# ---- two evaluated sweep reports (lmms-eval accuracy; see the module docstring) ---------------------------------

EVAL_DETERMINISTIC = (Metric("visual_tokens_mean", ("visual_tokens_mean",), HIGHER, "deterministic"),
                      Metric("tflops_mean", ("tflops_mean",), LOWER, "deterministic", "TFLOPs"))
EVAL_TIMED = (Metric("prefill_ms_mean", ("prefill_ms_mean",), LOWER, "absolute", "ms"),
              Metric("ttft_ms_mean", ("ttft_ms_mean",), LOWER, "absolute", "ms"),
              Metric("decode_ms_per_token_mean", ("decode_ms_per_token_mean",), LOWER, "absolute", "ms"))
EVAL_AGREEMENT = Metric("agreement", ("agreement",), HIGHER, "fidelity")


def _check_evaluated_pair(base: dict[str, Any], new: dict[str, Any], base_rows: list[dict[str, Any]],
                          new_rows: list[dict[str, Any]]) -> None:
    """Refuse, in one line, a pair that is not two evaluated sweep reports of the same model, tasks and
    cost convention."""
    from ficoco.eval.join import eval_cost_words, eval_tasks, evaluated

    for side, report in (("base", base), ("new", new)):
        if report.get("schema") != SWEEP_SCHEMA:
            raise FicocoError(f"the {side} report has schema '{report.get('schema')}' and the other is a sweep "
                              f"report; compare judges two '{REPORT_SCHEMA}' profile reports or two evaluated "
                              f"'{SWEEP_SCHEMA}' sweep reports")
        if not evaluated(report):
            raise FicocoError(f"the {side} sweep report was not evaluated (its config names no eval_tasks); compare "
                              "judges the accuracy of two evaluated sweeps (profile reports for the timings)")
    differs = [f"{name} {b} vs {n}" for name, b, n in (
        ("model", base.get("model"), new.get("model")),
        ("eval tasks", ",".join(sorted(eval_tasks(base))), ",".join(sorted(eval_tasks(new)))),
        ("cost", eval_cost_words(base, base_rows), eval_cost_words(new, new_rows))) if b != n]
    if differs:
        raise FicocoError("the two sweep reports are not comparable: " + "; ".join(differs) + " (base vs new)")


def _eval_row_name(row: dict[str, Any]) -> str:
    label, variant = row["method_label"], row["variant"]
    name = variant if label == variant else f"{label} ({variant})"
    budget = row["budget_label"] if row["budget"] else "all tokens"
    return f"{name} {row['quant']} {budget}"


def _score_unit(base: float, reference: float | None) -> tuple[float | None, str]:
    """What a score's change is measured in: vanilla's base score, else the point's own base score;
    None where both are 0 (any change counts)."""
    if reference:
        return abs(reference), f"vanilla's base score {reference:.4g}"
    if base:
        return abs(base), f"the base score {base:.4g} (vanilla's is 0 or missing)"
    return None, "a base score of 0"


def _judge_score(base: float, new: float, reference: float | None, higher: bool, tolerance: float,
                 judge: str) -> tuple[str, float | None, str]:
    """A score against its base, the change in units of vanilla's base score (see `_score_unit`)."""
    unit, words = _score_unit(base, reference)
    change = (new - base) / unit if unit else None
    if judge == "timed":
        return "not judged", change, "judge=timed: accuracy not judged"
    moved = abs(change) > tolerance if change is not None else new != base
    worse = new < base if higher else new > base
    rule = f"{tolerance * 100:g}% of {words}" if unit else "any change from a base score of 0"
    if not moved:
        return "ok", change, f"accuracy: within {rule}"
    return ("regression" if worse else "improvement"), change, \
        f"accuracy: {'drop' if worse else 'gain'} of {abs(new - base):.4g} beyond {rule} (lmms-eval's scale)"


def compare_eval(base: dict[str, Any], new: dict[str, Any], *, tolerance_pct: float = 10.0, absolute: bool = False,
                 judge: str = "all", cross_machine: bool = False) -> Comparison:
    """Judge two evaluated sweep reports point by point (the module docstring says how): each task's
    score and the mean score against `tolerance_pct` percent of vanilla's base score, the answers'
    agreement with vanilla in points, the mean visual tokens and TFLOPs per sample as deterministic
    figures, the eval's timings as absolute figures (judged only with `absolute`, on the same
    processor). Points are matched by (variant, method label, quant, budget); a point evaluated in
    base whose evaluation failed in new is a regression. One error for reports that are not
    comparable (another model, other tasks, another cost convention) or share no evaluated point."""
    from ficoco.eval.join import VANILLA, eval_rows, eval_tasks, match_points

    if not (math.isfinite(tolerance_pct) and tolerance_pct >= 0):
        raise FicocoError(f"tolerance_pct={tolerance_pct:g}: give a finite percentage of at least 0")
    if judge not in JUDGE_CHOICES:
        raise FicocoError(f"unknown judge='{judge}': choose from {', '.join(JUDGE_CHOICES)}")
    base_list = eval_rows(base) if base.get("schema") == SWEEP_SCHEMA else []
    new_list = eval_rows(new) if new.get("schema") == SWEEP_SCHEMA else []
    _check_evaluated_pair(base, new, base_list, new_list)
    result = Comparison()
    timed_refused = _environment_warnings(result, base.get("environment") or {}, new.get("environment") or {},
                                          judge, cross_machine)
    if base.get("random_weights") or new.get("random_weights"):
        sides = " and ".join(s for s, r in (("base", base), ("new", new)) if r.get("random_weights"))
        result.warnings.append(f"{sides} evaluated random weights: their scores mean nothing; the comparison checks "
                               "that the code answers as before, not that the method is accurate")
    tasks = eval_tasks(base)
    tolerance = tolerance_pct / 100
    pairs, only_base, only_new = match_points(base_list, new_list)
    vanilla = {r["quant"]: r for r in base_list if r["variant"] == VANILLA and r["status"] == "ok"}
    result.only_base = [_eval_row_name(r) for r in only_base]
    result.only_new = [_eval_row_name(r) for r in only_new]
    judged = 0
    for b, n in pairs:
        name = _eval_row_name(b if b["labelled"] or not n["labelled"] else n)
        if b["status"] != "ok" or n["status"] != "ok":
            if b["status"] == "ok" and n["status"] == "failed":
                result.verdicts.append(Verdict(name, "status", "accuracy", None, None, None, "regression",
                                               f"new run: eval failed: {n['reason']}"))
            elif b["status"] == "ok":
                result.verdicts.append(Verdict(name, "status", "accuracy", None, None, None, "missing",
                                               "evaluated in base, not (yet) in new"))
            elif n["status"] == "ok":
                result.verdicts.append(Verdict(name, "status", "accuracy", None, None, None, "missing",
                                               f"evaluated in new only (base: {b['status']})"))
            continue
        judged += 1
        reference = vanilla.get(b["quant"])
        same_documents = True
        for task in tasks:
            bs, ns = b["scores"][task], n["scores"][task]
            metric = f"score:{task}"
            if bs is None or ns is None:
                if bs is not None:  # an evaluation that ran and lost a task's score (or scored NaN) is broken
                    result.verdicts.append(Verdict(name, metric, "accuracy", bs, None, None, "regression",
                                                   "new score missing or not a number"))
                elif ns is not None:
                    result.verdicts.append(Verdict(name, metric, "accuracy", None, ns, None, "missing",
                                                   "present in new only"))
                continue
            documents = (b["samples"][task], n["samples"][task])
            if None not in documents and documents[0] != documents[1]:
                same_documents = False
                result.verdicts.append(Verdict(name, metric, "accuracy", bs, ns, None, "not judged",
                                               f"scored on {documents[0]} documents in base and {documents[1]} in "
                                               "new: not the same test"))
                continue
            verdict, change, detail = _judge_score(bs, ns, reference["scores"][task] if reference else None,
                                                   b["higher_is_better"][task], tolerance, judge)
            result.verdicts.append(Verdict(name, metric, "accuracy", bs, ns, change, verdict, detail))
        if len(tasks) > 1 and b["score"] is not None and n["score"] is not None:
            higher = {b["higher_is_better"][t] for t in tasks}
            if not same_documents or len(higher) > 1:
                why = ("tasks scored on other documents: see their lines" if not same_documents else
                       "tasks better higher and tasks better lower: a mean has no direction")
                result.verdicts.append(Verdict(name, "score", "accuracy", b["score"], n["score"], None,
                                               "not judged", why))
            else:
                verdict, change, detail = _judge_score(b["score"], n["score"], reference["score"] if reference else
                                                       None, higher.pop(), tolerance, judge)
                result.verdicts.append(Verdict(name, "score", "accuracy", b["score"], n["score"], change, verdict,
                                               detail))
        _judge_eval_figures(result, name, b, n, tolerance, absolute, judge, timed_refused)
    if not judged and not result.regressions:  # nothing evaluated in new must not pass as a clean comparison
        raise FicocoError("the two sweep reports have no evaluated point in common (variant, method label, quant "
                          "and budget must match, and both evaluations must have run)")
    return result


def _judge_eval_figures(result: Comparison, name: str, b: dict[str, Any], n: dict[str, Any], tolerance: float,
                        absolute: bool, judge: str, timed_refused: str) -> None:
    """The agreement with vanilla (in points), the deterministic cost figures (0.1 %) and the timings
    (absolute figures) of one point evaluated in both reports."""
    for metric in (EVAL_AGREEMENT, *EVAL_DETERMINISTIC, *EVAL_TIMED):
        bv, nv = b[metric.name], n[metric.name]
        if metric is EVAL_AGREEMENT and b["variant"] == "vanilla":
            continue  # vanilla agrees with itself by construction
        if bv is None or nv is None:
            if bv is not None or nv is not None:
                result.verdicts.append(Verdict(name, metric.name, metric.kind, bv, nv, None, "missing",
                                               "present in one report only"))
            continue
        worse = (nv < bv) if metric.better == HIGHER else (nv > bv)
        if metric is EVAL_AGREEMENT:
            change = nv - bv
            verdict, detail = _judge_fidelity(metric, bv, nv, change, worse, tolerance, judge)
            detail += f" (answers equal to vanilla's, {n['agreement_samples']} documents)"
        else:
            change = (nv - bv) / abs(bv) if bv else (0.0 if nv == bv else math.inf)
            if (shared := _judge_by_kind(metric, change, worse, judge, timed_refused)) is not None:
                verdict, detail = shared
            elif absolute:
                verdict, detail = _judge_timed(metric, {}, {}, {}, {}, (), change, worse, tolerance)
            else:
                verdict, detail = "not judged", "absolute figure: judged only with absolute=True"
        result.verdicts.append(Verdict(name, metric.name, metric.kind, bv, nv, change, verdict, detail))
