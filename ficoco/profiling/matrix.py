"""The run matrix of `ficoco profile`: model x quant x batch x variant, measured row by row.

Every schedule is resolved (and every user mistake reported) before any model is built.
Each finished row is handed to `on_row` at once, so the caller can rewrite its report
atomically after every row and an interrupted run keeps what it measured.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ficoco.accounting import CountOptions, Schedule, account, architecture, resolve_side_by_side
from ficoco.accounting.memory import KV_QUANT_BITS, QUANT_BITS, Quant, linear_state, weight_bytes
from ficoco.accounting.memory import cache_bytes as analytic_cache_bytes
from ficoco.errors import FicocoError
from ficoco.machine.dtype_choice import DtypeChoice, row_dtypes
from ficoco.machine.host_runtime import page_faults, steady_host_runtime
from ficoco.methods.registry import method_label
from ficoco.models import hf_compat as hf
from ficoco.profiles import Hardware, Profile, list_gpus, load_gpu, load_profile, set_layout
from ficoco.profiling.config import ProfileConfig
from ficoco.profiling.decode import DecodeRun, decode_metrics, timed_generate
from ficoco.profiling.experts import loads_by_layer
from ficoco.profiling.predict import PASSES, fused_layers, model_weights, rates_for, row_prediction, row_probe_shapes
from ficoco.profiling.rows import FidelityRecord, GenerationRecord, MeasuredRow, MemoryRecord, PrefillRecord
from ficoco.profiling.runs import choose_runs, max_runs
from ficoco.profiling.trackers import LatencyStats, LatencyTracker, MemoryTracker, RunHook, cache_bytes, cache_tokens

# NVIDIA device names -> hardware profiles of the roofline, first match wins. GH200 (an H100
# or H200-class die with its own memory) and H100 NVL (94 GB, other clocks) have no profile:
# None keeps them from borrowing the H200's or the H100 SXM's figures.
_GPU_NAMES: tuple[tuple[str, str | None], ...] = (
    ("gh200", None), ("h100 nvl", None), ("h200", "h200"), ("h100 pcie", "h100-pcie"), ("h100", "h100-sxm"),
    ("a800", "a800-80gb"), ("a100-sxm4-80gb", "a100-80gb"), ("a100 80gb", "a100-80gb"),
    ("a100-pcie-80gb", "a100-80gb"), ("a100", "a100-40gb"))
BUILD_STEP = "building the model"


@dataclass
class RowSpec:
    """One row to measure."""

    variant: str
    quant: str
    batch: int
    schedule: Schedule
    # The counts the time rule chose from this row's estimated run (estimate.plan_runs), until
    # its first run is measured; None: the device's most (profiling/runs.py).
    warmup: int | None = None
    repeat: int | None = None


@dataclass
class Plan:
    """The resolved run: device, profile, architecture and the rows in order."""

    device: torch.device
    profile: Profile
    rows: list[RowSpec] = field(default_factory=list)
    gpu: Hardware | None = None
    warmup: int | None = None  # --warmup / --repeat; None: chosen per row by the time rule
    repeat: int | None = None
    notes: list[str] = field(default_factory=list)  # said before the run (device fallback, ...)
    # Set by plan_run: the dtypes every build uses, and the memory guard's breakdown of the
    # largest build (weights, activations, kv_cache, margin, total, free: bytes; quant).
    dtype: DtypeChoice | None = None
    memory: dict[str, Any] = field(default_factory=dict)
    prompt: Any = None  # models.prompt.PromptInputs: a real prompt laid out by the checkpoint's processor
    fidelity: Any = None  # profiling.fidelity.FidelityTracker with --fidelity


def check_image(path: str) -> None:
    """A readable image file, checked before any model is built."""
    from PIL import Image, UnidentifiedImageError

    if not Path(path).is_file():
        raise FicocoError(f"image={path}: no such file")
    try:
        with Image.open(path) as picture:
            picture.verify()
    except (OSError, UnidentifiedImageError, SyntaxError) as exc:
        raise FicocoError(f"image={path}: not a readable image ({exc})") from None


def row_kv_bits(config: ProfileConfig, quant: str) -> int | None:
    """The bits of a row's quantized KV cache: --kv-bits, else the weights' (int8: 8, int4: 4);
    None for the unquantized cache in the compute dtype (fp16 weights, or --kv-bits 16)."""
    bits = config.kv_bits if config.kv_bits is not None else QUANT_BITS[quant]
    return bits if bits in KV_QUANT_BITS else None


def resolve_device(name: str, notes: list[str] | None = None) -> torch.device:
    """`auto` is CUDA when torch can use a GPU, else the CPU; a GPU that the driver shows but
    torch cannot use (a CPU build of torch, a driver too old for it) is said in `notes`."""
    if name not in ("auto", "cpu", "cuda"):
        raise FicocoError(f"unknown device='{name}': choose auto, cuda or cpu")
    if name == "cpu":
        return torch.device("cpu")
    if torch.cuda.is_available():
        return torch.device("cuda")
    if name == "cuda":
        raise FicocoError("device=cuda: no CUDA GPU is visible to torch here; use device=cpu or auto")
    from ficoco.profiling.trackers import nvml_visible_gpus

    gpus = nvml_visible_gpus()
    if gpus and notes is not None:
        if os.environ.get("CUDA_VISIBLE_DEVICES", None) == "":
            why = "CUDA_VISIBLE_DEVICES is empty"
        else:
            build = f"torch {torch.__version__} (CUDA {torch.version.cuda or 'none: a CPU build'})"
            why = f"{build} cannot use them (install a CUDA build of torch: README, Install)"
        notes.append(f"warning: the driver shows {gpus} NVIDIA GPU(s) but {why}; running on the CPU")
    return torch.device("cpu")


def known_gpu(device: torch.device) -> Hardware | None:
    """The hardware profile of the GPU in use, when the roofline knows it."""
    if device.type != "cuda":
        return None
    return gpu_profile_for(torch.cuda.get_device_name(device))


def gpu_profile_for(device_name: str) -> Hardware | None:
    """The roofline profile of an NVIDIA device name (None for GPUs without one)."""
    name = device_name.lower()
    for needle, key in _GPU_NAMES:
        if needle in name:
            return load_gpu(key) if key is not None and key in list_gpus() else None
    return None


def plan_run(config: ProfileConfig, prompt: Any = None) -> Plan:
    """Validate the configuration and resolve every row's schedule (no model is built). `prompt`
    is the real prompt `real_inputs.resolve_prompt` laid out (its layout is already in `config`)."""
    # Before the process's first matmul (the dtype choice's below): oneDNN reads its cache size once.
    steady_host_runtime()
    if config.repeat is not None and config.repeat < 1:
        raise FicocoError(f"repeat={config.repeat}: at least one measured run is needed")
    if config.warmup is not None and config.warmup < 0:
        raise FicocoError(f"warmup={config.warmup} must not be negative")
    if config.new_tokens < 0:
        raise FicocoError(f"new_tokens={config.new_tokens} must not be negative")
    for quant in config.quants:
        if quant not in QUANT_BITS:
            raise FicocoError(f"unknown quant '{quant}': choose from {', '.join(QUANT_BITS)}")
    for batch in config.batches:
        if batch < 1:
            raise FicocoError(f"batch size {batch} in batches= must be at least 1")
    if config.image is not None:
        check_image(config.image)
    if config.prompt is not None and config.weights == "random":
        raise FicocoError("prompt= needs a tokenizer: give weights= with a local checkpoint folder")
    if config.video is not None and config.weights == "random":
        raise FicocoError("video= needs a checkpoint's processor: give weights= with a local Video-LLaVA "
                          "checkpoint folder")
    if config.fidelity and "vanilla" not in config.variants:
        raise FicocoError("fidelity=True compares every reduced row with vanilla on the same inputs; drop "
                          "reference=False")
    if config.kv_bits is not None and config.kv_bits not in (16, *KV_QUANT_BITS):
        raise FicocoError(f"kv_bits={config.kv_bits}: choose 16 (unquantized), 8, 4 or 2")
    if any(row_kv_bits(config, quant) for quant in config.quants):
        from ficoco.models.kv_cache import check_backend

        check_backend()
    from ficoco.models import device_map as maps

    if maps.check_policy(config.device_map) is None and config.max_memory:
        raise FicocoError("max_memory= sets the limits of a device map; give device_map= too")
    maps.check_limits(maps.parse_max_memory(config.max_memory))  # refused before anything is planned
    if config.device_map and any(quant != "fp16" for quant in config.quants):
        raise FicocoError("device_map= works with unquantized weights; drop quants= or device_map=")
    notes: list[str] = []
    device = resolve_device(config.device, notes)
    if config.device_map:
        device = torch.device(maps.main_device(config.device_map))
    source = config.weights if config.weights != "random" and Path(config.weights).expanduser().is_dir() else None
    profile = load_profile(source or config.model, list(config.overrides))
    from ficoco.models import supported_families

    if profile.family not in supported_families():
        raise FicocoError(f"{source or config.model} is a '{profile.family}' model; ficoco profile runs "
                          f"{', '.join(supported_families())} models so far")
    if config.image is not None and prompt is None and profile.family != "llava":
        # Random weights have no processor: the picture is laid out as `ficoco show` lays it out (one image, the
        # family's default grid); a checkpoint's processor lays out anything else.
        from ficoco.profiling.show import LAID_OUT_FAMILIES

        if profile.family not in LAID_OUT_FAMILIES or config.video is not None:
            raise FicocoError(f"image= with random weights lays out the images of {', '.join(LAID_OUT_FAMILIES)}; "
                              f"for {profile.family} give weights= with a local checkpoint folder (its processor "
                              "lays out the image)")
        if config.batches != (1,) or config.image_size is not None or config.frames is not None:
            raise FicocoError(f"image= with random weights on {profile.family} lays out one image at the family's "
                              "default size: drop batches=, image_size= and frames= (or give weights= with a local "
                              "checkpoint folder)")
    set_layout(profile, image_size=config.image_size, frames=config.frames)
    arch = architecture(profile)
    if config.distinct_layers is not None:
        from ficoco.machine.memory_guard import check_distinct_layers

        check_distinct_layers(arch, config.distinct_layers, weights=config.weights, quants=config.quants,
                              device_map=config.device_map)
    opts = CountOptions(convention=config.convention, scope=config.scope, equivalent=config.equivalent,
                        text_tokens=config.text_tokens)
    resolved, skipped = resolve_side_by_side(arch, list(config.variants), opts, config.request, strict=False,
                                             hyperparameters=config.hyperparameters)
    schedules = {schedule.variant: schedule for schedule in resolved}
    # Several methods side by side run on any family: one it refuses, or one that cannot reach the
    # setting, is left out with its reason (said before the run, and kept in the report's notes).
    notes.extend(f"left out {entry['variant']}: {entry['reason']}" for entry in skipped)
    plan = Plan(device=device, profile=profile, gpu=known_gpu(device), notes=notes, warmup=config.warmup,
                repeat=config.repeat, prompt=prompt)
    if prompt is not None:
        notes.extend(prompt.notes)
    if config.fidelity:
        from ficoco.profiling.fidelity import FidelityTracker

        plan.fidelity = FidelityTracker(random_weights=config.weights == "random",
                                        tokenizer=prompt.tokenizer if prompt is not None else None)
    for quant in config.quants:
        for batch in config.batches:
            for variant in config.variants:
                if variant in schedules:
                    plan.rows.append(RowSpec(variant, quant, batch, schedules[variant]))
    # The dtypes and the memory check come last: every other mistake is cheaper to report,
    # and nothing is built before the plan says it fits.
    from ficoco.machine.memory_guard import resolve_dtype_and_memory
    from ficoco.models.build import checkpoint_dtype

    native = checkpoint_dtype(Path(source).expanduser()) if source else None
    if config.device_map:
        # The map is the fit: accelerate places what the limits leave out in CPU memory or on disk.
        from ficoco.machine.dtype_choice import choose_dtype
        from ficoco.machine.memory_guard import memory_need_bytes

        plan.dtype = choose_dtype(config.dtype, device, native=native)
        if plan.dtype.upcast:
            raise FicocoError("device_map= and an upcast layout do not mix; give dtype=bf16, fp16 or fp32")
        # What the run needs, for the report; nothing is refused (free None).
        plan.memory = {**memory_need_bytes(profile, plan.rows, plan.dtype, "fp16", text_tokens=config.text_tokens,
                                           new_tokens=config.new_tokens, kv_bits=config.kv_bits),
                       "free": None, "quant": "fp16"}
        notes.append(f"device map {config.device_map}" + (f" within {config.max_memory}" if config.max_memory else "")
                     + f": accelerate places the weights, computing on {device}")
        return plan
    plan.dtype, plan.memory = resolve_dtype_and_memory(
        profile, plan.rows, config.dtype, device, config.quants, native=native,
        text_tokens=config.text_tokens, new_tokens=config.new_tokens, kv_bits=config.kv_bits,
        distinct_layers=config.distinct_layers)
    if config.distinct_layers is not None:
        if plan.dtype.upcast:
            raise FicocoError("distinct_layers= and an upcast layout do not mix; give dtype=bf16 or fp16")
        distinct = config.distinct_layers
        notes.append(f"decoder weights shared: {distinct} distinct layer{'s' if distinct != 1 else ''} "
                     f"over its {arch.decoder.layers} (layer i uses layer i mod {config.distinct_layers}'s), every "
                     "layer computing at its full shapes; the measured weights are the distinct layers'")
    return plan


def weights_shared(plan: Plan, distinct: int) -> dict[str, Any]:
    """What a row built with `distinct` weighted decoder layers holds less than the analytic weights (the
    deeper layers share theirs): the report's measured weights are the analytic ones less `shared_bytes`."""
    from ficoco.machine.memory_guard import shared_weight_bytes

    arch = architecture(plan.profile)
    compute_bits = torch.finfo(plan.dtype.compute).bits if plan.dtype is not None else 16
    return {"distinct_layers": distinct, "layers": arch.decoder.layers,
            "shared_bytes": shared_weight_bytes(arch, distinct, compute_bits / 8)}


def analytic(profile: Profile, row: RowSpec, config: ProfileConfig, gpu: Hardware | None,
             dtype: DtypeChoice | None = None) -> dict[str, Any]:
    """What the accountant predicts for the row: whole-model TFLOPs (scope all, the LM head
    on the last token as a prefill for generation computes it), KV cache, weights as `dtype`
    stores them (16 bits when not given), roofline."""
    arch = architecture(profile)
    # Weights at the quant's width; activations and the KV cache in the compute dtype
    # (bitsandbytes computes in it too) unless the row quantizes the cache (row_kv_bits).
    compute_bits = torch.finfo(dtype.compute).bits if dtype is not None else 16
    kv_bits = row_kv_bits(config, row.quant) or compute_bits
    quant = Quant(row.quant, QUANT_BITS[row.quant], compute_bits, kv_bits)
    opts = CountOptions(convention="flops", scope="all", batch=row.batch, text_tokens=config.text_tokens,
                        lm_head_tokens="last")
    cost = account(arch, row.schedule, quant, opts, gpu=gpu)
    weights = cost.weight_bytes
    if dtype is not None:
        upcast = dtype.upcast_layers(arch.decoder.layers, row.quant)
        weights = weight_bytes(arch, "all", quant, element_bytes=compute_bits / 8, upcast_layers=upcast,
                               upcast_element_bytes=torch.finfo(dtype.storage).bits / 8)
    # The cache as transformers stores it (a quantized one with its scales, zero points and
    # residual window), after the prefill and, with --new-tokens, after decoding.
    # On a hybrid decoder (Qwen3.5) the cache also holds the linear-attention layers' fixed state, which the
    # measured figure counts too: the analytic one is everything the cache holds, its state named beside it.
    kv_stored = {f"kv_cache_bytes{suffix}": round(analytic_cache_bytes(
        arch, cost.plan, batch=row.batch, kv_bits=kv_bits, element_bytes=compute_bits / 8, decode_steps=steps))
        for suffix, steps in (("", 0), ("_after_decode", config.new_tokens - 1)) if steps >= 0}
    state = linear_state(arch, batch=row.batch, element_bytes=compute_bits / 8)
    if state.layers:
        kv_stored["linear_state_bytes"] = round(state.total_bytes)
    return {"tflops": cost.tflops, "tflops_by_stage": cost.tflops_by_stage, **kv_stored,
            "weight_bytes": weights, "visual_tokens": cost.plan.visual_tokens,
            "llm_visual_tokens": cost.plan.llm_visual_tokens,
            "layer_average_visual_tokens": cost.plan.layer_average_visual_tokens,
            "method_tflops": cost.method_tflops, "settings": row.schedule.settings_dict(),
            "roofline_ms": cost.roofline_s * 1e3 if cost.roofline_s is not None else None,
            "convention": "flops", "scope": "all", "lm_head_tokens": "last"}


def _is_oom(exc: BaseException) -> bool:
    return isinstance(exc, (torch.OutOfMemoryError, MemoryError)) or "out of memory" in str(exc).lower()


def _inputs(model: Any, config: ProfileConfig, batch: int, device: torch.device,
            prompt: Any = None) -> dict[str, torch.Tensor]:
    from ficoco.models import synthetic_inputs
    from ficoco.models.inputs import real_inputs

    if prompt is None and config.weights != "random" and (config.image, config.prompt, config.video) != (None,) * 3:
        from ficoco.profiling.real_inputs import resolve_prompt  # a caller that planned without it

        prompt = resolve_prompt(config)[1]
    if prompt is not None:
        param = next(model.parameters())
        return prompt.batch(batch, device=device, dtype=param.dtype if param.is_floating_point() else torch.float16)
    if config.image is not None and config.weights == "random" and model.config.model_type != "llava":
        from ficoco.profiling.show import Layout, picture_inputs

        inputs, _ = picture_inputs(model, Layout(model), config.image, text_tokens=config.text_tokens,
                                   seed=config.seed)
        return {name: value.to(device) if isinstance(value, torch.Tensor) else value for name, value in inputs.items()}
    if config.image is not None or config.prompt is not None:
        return real_inputs(model, config.weights, image=config.image, prompt=config.prompt, batch=batch,
                           device=device)
    layout = {k: v for k, v in (("image_size", config.image_size), ("frames", config.frames)) if v is not None}
    return synthetic_inputs(model, batch=batch, text_tokens=config.text_tokens, seed=config.seed, device=device,
                            **layout)


def _planned_runs(row: RowSpec, plan: Plan) -> tuple[tuple[int, int], Callable[[float], tuple[int, int]] | None]:
    """The (warm-up, timed) counts to start with, and the time rule that revises them after the
    first run (None when --warmup and --repeat were both given: they always win)."""
    most_warmup, most_repeat = max_runs(plan.device.type)
    warmup = next(n for n in (plan.warmup, row.warmup, most_warmup) if n is not None)
    repeat = next(n for n in (plan.repeat, row.repeat, most_repeat) if n is not None)
    if plan.warmup is not None and plan.repeat is not None:
        return (warmup, repeat), None
    return (warmup, repeat), lambda run_s: choose_runs(run_s, plan.device.type, plan.warmup, plan.repeat)


def _runs_json(latency: LatencyStats, plan: Plan) -> dict[str, Any]:
    """What ran, and what chose it."""
    given = [name for name, n in (("warmup=", plan.warmup), ("repeat=", plan.repeat)) if n is not None]
    if len(given) == 2:
        chosen_by = "warmup=/repeat="
    else:
        first_s = (latency.warmup_ms or latency.samples_ms)[0] / 1e3
        chosen_by = f"time budget, from the first run ({first_s:.3g} s)" + (f"; {given[0]} as given" if given else "")
    return {"warmup": len(latency.warmup_ms), "repeat": len(latency.samples_ms), "chosen_by": chosen_by}


class _RowRun:
    """One row's model, inputs and patches while it is measured: what the prefill, the generation and
    the fidelity share. `last` holds the latest run's cache and outputs, read after its timing."""

    def __init__(self, model: Any, row: RowSpec, config: ProfileConfig, plan: Plan) -> None:
        import ficoco
        from ficoco.models import device_map as maps

        self.model, self.row, self.config, self.plan = model, row, config, plan
        self.inputs = _inputs(model, config, row.batch, plan.device, plan.prompt)
        self.handle = None
        if row.variant != "vanilla":
            self.handle = ficoco.apply(model, row.variant, schedule=row.schedule, image_size=config.image_size,
                                       frames=config.frames)
        self.split = maps.summary(model)
        self.latency = LatencyTracker(plan.device)
        self.memory = MemoryTracker(plan.device, per_device=self.split is not None)
        self.kv_bits = row_kv_bits(config, row.quant)
        self.last: dict[str, Any] = {}

    def new_cache(self) -> dict[str, Any]:
        # A fresh quantized cache per call (transformers' own QuantizedCache, ficoco.models.kv_cache).
        from ficoco.models.kv_cache import quantized_cache

        return hf.cache_argument(quantized_cache(self.model, self.kv_bits)) if self.kv_bits else {}

    def close(self) -> None:
        self.last.clear()
        if self.handle is not None:
            self.handle.remove()


def measure(model: Any, row: RowSpec, config: ProfileConfig, plan: Plan, on_run: RunHook | None = None,
            rates: Any = None) -> MeasuredRow:
    """Prefill latency, memory, KV cache and (with --new-tokens) generation of one row, and with
    --fidelity its agreement with vanilla, as typed records; `on_run` is told when every run starts
    and ends (generation runs as "generation warm-up" and "generation"); `rates`
    (profiling/predict.py's MeasuredRates) take a pass after each timed prefill."""
    run = _RowRun(model, row, config, plan)
    try:
        with torch.inference_mode():
            prefill, memory, choose = measure_prefill(run, on_run, rates)
            generation = measure_generation(run, prefill, choose, on_run) if config.new_tokens else None
            fidelity = measure_fidelity(run) if plan.fidelity is not None else None
    finally:
        run.close()
    return MeasuredRow(prefill, memory, generation, fidelity)


def measure_row(model: Any, row: RowSpec, config: ProfileConfig, plan: Plan,
                on_run: RunHook | None = None, rates: Any = None) -> dict[str, Any]:
    """`measure`'s row as the report holds it (its measured fields, `MeasuredRow.to_json`)."""
    return measure(model, row, config, plan, on_run=on_run, rates=rates).to_json()


def measure_prefill(run: _RowRun, on_run: RunHook | None = None, rates: Any = None
                    ) -> tuple[PrefillRecord, MemoryRecord, Callable[[float], tuple[int, int]] | None]:
    """The timed prefill of `run`'s row and its memory: peak, KV cache after it, per device under a
    map. Returns the records and the time rule that chose the runs (the generation reuses it)."""
    from ficoco.profiling.experts import ExpertLoads
    from ficoco.profiling.kernels import KernelRecorder

    handle, last, model = run.handle, run.last, run.model
    reduction_ms: list[float] = []
    probe_ms: list[float] = []
    fused_ms: list[float] = []
    attention_ms: list[float] = []
    # The model's own kernel on the fused layers' inputs, timed in the forward that records the kernels (untimed).
    reference: dict[str, float] = {}
    # Which attention kernel every layer runs: recorded in the row's first warm-up, never in a timed run.
    kernels = KernelRecorder.for_model(model)
    # And how many rows each expert of a sparse layer took, in the same forward (the prediction prices them).
    loads = ExpertLoads.for_model(model)
    step: dict[str, str] = {}
    # Page faults of every timed run (minor, major), counted around its forward alone.
    faults: list[tuple[int, int]] = []

    def forward() -> Any:
        if handle is not None:
            handle.timer.reset()
        return model(**run.inputs, use_cache=True, logits_to_keep=1, **run.new_cache())

    def prefill() -> None:
        # The previous run's KV cache goes before this run allocates its own: alive, it would
        # sit in this run's peak memory.
        last.pop("cache", None)
        if step.get("now") == "warm-up" and not kernels.recorded:
            with kernels.recording(), loads.recording(), _reference_attention(handle, reference):
                out = forward()
        elif step.get("now") == "timed run" and (before := page_faults()) is not None:
            out = forward()
            after = page_faults() or before
            faults.append((after[0] - before[0], after[1] - before[1]))
        else:
            out = forward()
        last["cache"] = hf.output_cache(out)
        last["logits"] = out.logits  # a reference, read after the timing (--fidelity)

    def on_prefill_run(phase: str, k: int, n: int, seconds: float | None) -> None:
        if seconds is None:
            if phase == "timed run" and k == 1 and step.get("now") == "warm-up" and rates is not None:
                # Counts the input decided (MustDrop's, PruMerge+'s) are known now, from the warm-up: their shapes
                # join the passes between the timed runs and after them, as the planned shapes do.
                ran = ran_row(run.row, run.plan, measured_steps(handle), _measured_tokens(handle))
                # And the layers ficoco's fused pass computed (recorded in the warm-up): priced as that pass.
                fused = fused_layers(kernels.to_json()) if kernels.recorded else frozenset()
                if ran is not run.row or fused:
                    rates.expect(row_probe_shapes(run.plan.profile, ran.schedule, quant=ran.quant, batch=ran.batch,
                                                  text_tokens=run.config.text_tokens,
                                                  dtype=_plan_dtype(run.plan, run.config), fused_layers=fused))
                # The rates from here on meet the process as the timed runs do, after the warm-up.
                rates.after_warm_up()
            step["now"] = phase
        if on_run:
            on_run(phase, k, n, seconds)

    def after_each(_: int) -> None:
        # Read after the tracker's final synchronise: the stage events are complete by now.
        reduction_ms.append(handle.timer.total_ms("reduction") if handle is not None else 0.0)
        probe_ms.append(handle.timer.total_ms("probe") if handle is not None else 0.0)
        fused_ms.append(handle.timer.total_ms("fused") if handle is not None else 0.0)
        attention_ms.append(handle.timer.total_ms("attention") if handle is not None else 0.0)
        if rates is not None:
            # The machine's rates at this moment, between timed runs (outside their timing).
            rates.sample()

    with run.memory.track() as peak:
        (warmup, repeat), choose = _planned_runs(run.row, run.plan)
        latency = run.latency.measure(prefill, warmup=warmup, repeat=repeat, after_each=after_each,
                                      on_run=on_prefill_run, choose=choose)
    cache = last.pop("cache")
    split = run.split
    memory = MemoryRecord(
        peak=peak, kv_cache_bytes=cache_bytes(cache), kv_cache_tokens=cache_tokens(cache),
        device_map={k: v for k, v in split.items() if k != "map"} if split else None,
        device_map_entries=split["map"] if split else None,
        memory_per_device=_memory_per_device(model, run.row, run.config, run.plan, split, cache, peak)
        if split else None)
    del cache
    # Read before the kernel record's extra forward (where it runs), which measures nothing.
    measured_tokens = _measured_tokens(handle)
    steps = measured_steps(handle)
    with _reference_attention(handle, reference):
        attention_kernels = _recorded_kernels(kernels, loads, forward, on_run)
    fused_median = statistics.median(fused_ms) if fused_ms else 0.0
    prefill_record = PrefillRecord(
        latency=latency, runs=_runs_json(latency, run.plan), batch=run.row.batch,
        reduction_stages_ms=statistics.median(reduction_ms) if reduction_ms else 0.0,
        probe_ms=statistics.median(probe_ms) if probe_ms else 0.0,
        fused_ms=fused_median, attention_ms=statistics.median(attention_ms) if attention_ms else 0.0,
        fused_reference_ms=reference.get("ms") if fused_median else None,
        # What every image (crop, frame) handed the LLM in the prefill, as it ran: a method acting
        # before the LLM with an adaptive count (PruMerge+) plans an assumed count, this is the real one.
        visual_tokens_per_item_measured=measured_tokens, measured_steps=steps, attention_kernels=attention_kernels,
        expert_loads=loads.to_json(),
        page_faults={"minor": [f[0] for f in faults], "major": [f[1] for f in faults]} if faults else None)
    return prefill_record, memory, choose


@contextlib.contextmanager
def _reference_attention(handle: Any, into: dict[str, float]) -> Iterator[None]:
    """Inside, every fused read layer also times the model's own kernel on its inputs (Handle.reference_attention):
    the first forward that does so leaves its total in ``into["ms"]``. Only in an untimed forward (the one that
    records the kernels)."""
    if handle is None or "ms" in into:
        yield
        return
    handle.reference_attention, handle.reference_attention_ms = True, 0.0
    try:
        yield
    finally:
        handle.reference_attention = False
        if handle.reference_attention_ms:
            into["ms"] = handle.reference_attention_ms


def measured_steps(handle: Any) -> list[dict[str, Any]] | None:
    """What each step of the last forward removed, where the counts are its input's own (MustDrop's); else None."""
    if handle is None or not handle.measured_steps:
        return None
    return [{"stage": stage, "layer": layer, "where": where, "removed": removed}
            for (stage, layer, where), removed in sorted(handle.measured_steps.items())]


def _measured_tokens(handle: Any) -> int | None:
    return handle.measured_tokens_per_item if handle is not None else None


def ran_row(row: RowSpec, plan: Plan, steps: list[dict[str, Any]] | None, measured_tokens: int | None) -> RowSpec:
    """`row` at the counts its input decided as it ran: per step (MustDrop's thresholds) or per item (an adaptive
    method's: PruMerge+ without --keep); `row` itself where it planned them."""
    from dataclasses import replace

    from ficoco.accounting.methods import at_measured_count, at_measured_steps

    if steps:
        return replace(row, schedule=at_measured_steps(
            row.schedule, {(s["stage"], s["layer"], s["where"]): s["removed"] for s in steps}))
    if measured_tokens and row.schedule.settings_dict().get("adaptive"):
        return replace(row, schedule=at_measured_count(architecture(plan.profile), row.schedule, measured_tokens))
    return row


KERNEL_RECORD_STEP = "kernel record"


def _recorded_kernels(kernels: Any, loads: Any, forward: Callable[[], Any], on_run: RunHook | None
                      ) -> dict[str, Any]:
    """The row's attention kernels per stage (profiling/kernels.py) and its experts' loads
    (profiling/experts.py): from its first warm-up, else from one extra forward now, after its timed runs and
    outside its memory reading (a row without warm-up keeps its timed runs as they were asked for: the first
    one cold)."""
    if not kernels.recorded:
        if on_run:
            on_run(KERNEL_RECORD_STEP, 1, 1, None)
        begin = time.perf_counter()
        with kernels.recording(), loads.recording():
            forward()
        if on_run:
            on_run(KERNEL_RECORD_STEP, 1, 1, time.perf_counter() - begin)
    return kernels.to_json()


def measure_generation(run: _RowRun, prefill: PrefillRecord, choose: Callable[[float], tuple[int, int]] | None,
                       on_run: RunHook | None = None) -> GenerationRecord:
    """The timed generate() runs of `run`'s row (--new-tokens), after its prefill: the decode figures,
    the KV cache at the end and the generation's peak memory."""
    config, last = run.config, run.last
    decode_runs: list[DecodeRun] = []

    def generate() -> None:
        last.pop("cache", None)  # the previous generation's cache, as for the prefill
        out, timed = timed_generate(run.model.generate, run.plan.device, **run.inputs,
                                    max_new_tokens=config.new_tokens, min_new_tokens=config.new_tokens,
                                    do_sample=False, return_dict_in_generate=True, **run.new_cache())
        last["cache"], last["run"] = hf.output_cache(out), timed
        last["sequences"] = out.sequences  # read after the timing (--fidelity)

    def on_generation_run(phase: str, k: int, n: int, seconds: float | None) -> None:
        if on_run:
            on_run("generation " + phase if phase == "warm-up" else "generation", k, n, seconds)

    def choose_generation(run_s: float) -> tuple[int, int]:
        # At most one warm-up: the prefill's runs have warmed the kernels up.
        generation_warmup, generation_repeat = choose(run_s)  # type: ignore[misc]
        return min(generation_warmup, 1), generation_repeat

    # The counts the prefill started from (its time rule then chose its own).
    planned_warmup, planned_repeat = _planned_runs(run.row, run.plan)[0]
    with run.memory.track() as memory:
        # A generation costs more than its prefill: the time rule counts its own runs.
        e2e = run.latency.measure(generate, warmup=min(planned_warmup, 1), repeat=planned_repeat,
                                  on_run=on_generation_run, after_each=lambda _: decode_runs.append(last["run"]),
                                  choose=choose_generation if choose is not None else None)
    end_cache = last.pop("cache")
    record = GenerationRecord(latency=e2e, decode=decode_metrics(decode_runs, run.row.batch, prefill.latency.median_ms),
                              kv_cache_bytes=cache_bytes(end_cache), kv_cache_tokens=cache_tokens(end_cache),
                              memory=memory, runs=_runs_json(e2e, run.plan))
    del end_cache
    return record


def measure_fidelity(run: _RowRun) -> FidelityRecord:
    """The row's next token (and with --new-tokens its greedy tokens) against vanilla's on the same inputs."""
    from ficoco.profiling.fidelity import observe

    observation = observe(run.last.pop("logits"), run.last.get("sequences"), run.config.new_tokens)
    row = run.row
    return run.plan.fidelity.row(row.variant, row.quant, row.batch, observation)


def build_for(config: ProfileConfig, plan: Plan, quant: str) -> Any:
    """The model of one quant, in the plan's dtypes (plan_run has checked that it fits)."""
    from ficoco.models.build import build_model

    return build_model(plan.profile if config.weights == "random" else config.model, config.weights,
                       dtype=plan.dtype if plan.dtype is not None else config.dtype, device=str(plan.device),
                       seed=config.seed, quant=quant, check_memory=plan.dtype is None,
                       device_map=config.device_map, max_memory=config.max_memory,
                       distinct_layers=config.distinct_layers)


def _failure_status(exc: BaseException) -> str:
    """oom, unsupported (the backend says it cannot do this here) or error (a fault)."""
    if _is_oom(exc):
        return "oom"
    if isinstance(exc, (NotImplementedError, ImportError)):
        return "unsupported"
    return "error"


@dataclass(frozen=True)
class Phase:
    """What a profile run is doing, for a progress display: a step starts (`seconds` None) or
    ends (`seconds`: how long it took)."""

    row: int  # index in plan.rows; while building, the first row of the model's quant
    step: str  # BUILD_STEP, "warm-up", "timed run", "generation warm-up", "generation"
    k: int = 1  # this step is the k-th of n (warm-ups and timed runs are counted)
    n: int = 1
    seconds: float | None = None


def run_profile(config: ProfileConfig, plan: Plan, on_row: Callable[[dict[str, Any]], None],
                on_start: Callable[[RowSpec], None] | None = None,
                on_phase: Callable[[Phase], None] | None = None) -> None:
    """Measure every row of `plan`; each finished (or failed) row goes to `on_row`, with its wall
    time (`wall_s`, the build not included) and its model's build time (`build_s`). `on_phase`
    is told when every step starts and ends: building a model, each warm-up and timed run."""
    from ficoco.models.build import release_device_cache
    from ficoco.profiling.trackers import model_weight_bytes

    def tell(phase: Phase) -> None:
        if on_phase:
            on_phase(phase)

    torch.manual_seed(config.seed)
    for quant in config.quants:
        rows = [(index, r) for index, r in enumerate(plan.rows) if r.quant == quant]
        if not rows:
            continue
        failure: dict[str, Any] | None = None
        tell(Phase(rows[0][0], BUILD_STEP))
        begin = time.perf_counter()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                model = build_for(config, plan, quant)
        except FicocoError:
            raise
        except Exception as exc:  # one quant failing must not lose the others' rows
            failure = {"status": _failure_status(exc), "reason": f"building the model: {_reason(exc)}"}
        build_s = time.perf_counter() - begin
        tell(Phase(rows[0][0], BUILD_STEP, seconds=build_s))
        if failure is not None:
            # Outside the except block: its traceback would keep the half-built model alive.
            release_device_cache(plan.device)
            for _, row in rows:
                on_row(_row_base(plan, config, row, None) | failure | {"build_s": build_s})
            continue
        info = getattr(model, "_ficoco_quant", {})
        dtype = str(next(p for p in model.parameters() if p.is_floating_point()).dtype).removeprefix("torch.")
        weights_measured = model_weight_bytes(model)
        shared = weights_shared(plan, config.distinct_layers) if config.distinct_layers is not None else None
        for index, row in rows:
            begin = time.perf_counter()
            if on_start:
                on_start(row)
            # The machine's rates for the row's shapes: probed now, between its runs and after them.
            rates = new_rates(plan, config, model)
            base = _row_base(plan, config, row, {"compute_dtype": dtype, **info}, rates)
            base["weight_bytes"] = weights_measured
            if shared is not None:
                base["weights_shared"] = shared

            def on_run(step: str, k: int, n: int, seconds: float | None, index: int = index) -> None:
                tell(Phase(index, step, k, n, seconds))

            try:
                with warnings.catch_warnings():
                    # bitsandbytes warns on every INT8 matmul that it casts bf16 inputs to fp16.
                    warnings.simplefilter("ignore")
                    result = measured_row(model, row, config, plan, base, rates, on_run=on_run)
            except FicocoError as exc:
                result = base | {"status": "unsupported", "reason": str(exc)}
            except Exception as exc:
                result = base | {"status": _failure_status(exc), "reason": _reason(exc)}
            # After the except block has dropped the traceback that held the row's tensors.
            release_device_cache(plan.device)
            on_row(result | {"wall_s": time.perf_counter() - begin, "build_s": build_s})
        del model
        release_device_cache(plan.device)


def measured_row(model: Any, row: RowSpec, config: ProfileConfig, plan: Plan, base: dict[str, Any], rates: Any,
                 on_run: RunHook | None = None) -> dict[str, Any]:
    """`base` (the row's planned figures, its prediction at `rates` probed before its runs) with the row
    measured, `rates` probed again between its runs and after them, and the row predicted at the
    mean over every pass, at the count it ran (an adaptive method's)."""
    result = base | {"status": "ok", **measure_row(model, row, config, plan, on_run=on_run, rates=rates)}
    result, ran = _at_measured_count(result, row, config, plan)
    if rates is not None:
        rates.sample(passes=PASSES)
        # Its sparse layers' experts at the loads the row ran (profiling/experts.py), its fused layers as they ran.
        result |= predicted(plan, config, ran, rates, expert_loads=loads_by_layer(result.get("expert_loads")),
                            fused=fused_layers(result.get("attention_kernels")))
    return result


def _memory_per_device(model: Any, row: RowSpec, config: ProfileConfig, plan: Plan, split: dict[str, Any],
                       cache: Any, memory: Any) -> dict[str, dict[str, Any]]:
    """Per device of a split model: the accountant's weights (the map's) and KV cache (the layers that run
    there), the measured KV cache of those layers, and the measured peak (a GPU's allocator peak, the
    process's peak resident set for "cpu"; "disk" has none)."""
    from ficoco.accounting.memory import kv_cache_bytes_per_layer, linear_state_bytes_per_layer, memory_per_device
    from ficoco.accounting.schedule import plan_tokens
    from ficoco.models import device_map as maps
    from ficoco.profiling.trackers import cache_bytes_per_layer

    layers = maps.decoder_layer_devices(model)
    arch = architecture(plan.profile)
    tokens = plan_tokens(arch, row.schedule, text_tokens=config.text_tokens)
    compute_bits = torch.finfo(plan.dtype.compute).bits if plan.dtype is not None else 16
    kv_bits = row_kv_bits(config, row.quant) or compute_bits
    analytic_kv = kv_cache_bytes_per_layer(arch, tokens, batch=row.batch, kv_bits=kv_bits,
                                           element_bytes=compute_bits / 8)
    # What the measured per-layer cache holds at a linear-attention layer: its fixed state.
    state = linear_state_bytes_per_layer(arch, batch=row.batch, element_bytes=compute_bits / 8)
    analytic_kv = [kv + st for kv, st in zip(analytic_kv, state, strict=True)]
    table: dict[str, dict[str, Any]] = memory_per_device(split["weight_bytes_per_device"], analytic_kv, layers)
    measured = cache_bytes_per_layer(cache)
    peaks = memory.values.get("peak_bytes_per_device", {})
    for device, entry in table.items():
        entry["kv_cache_measured_bytes"] = sum(b for b, d in zip(measured, layers, strict=False) if d == device)
        entry["peak_bytes"] = peaks.get(device)
    return table


def _at_measured_count(result: dict[str, Any], row: RowSpec, config: ProfileConfig,
                       plan: Plan) -> tuple[dict[str, Any], RowSpec]:
    """A row whose method counts adaptively (PruMerge+ without --keep) planned an assumed count; once
    measured, its analytic columns and schedule are those of the measured count, and its note says so.
    Returns the row's result and the row as it ran."""
    from ficoco.accounting.schedule import plan_tokens

    steps = result.get("measured_steps")
    ran = ran_row(row, plan, steps, result.get("visual_tokens_per_item_measured"))
    if ran is row:
        return result, row
    measured_analytic = analytic(plan.profile, ran, config, plan.gpu, plan.dtype)
    if steps:  # counts the input decided as it ran (MustDrop's thresholds): the run's own, step by step
        tokens = plan_tokens(architecture(plan.profile), ran.schedule, text_tokens=config.text_tokens)
        # The count every decoder layer hands on, averaged over the layers: what MustDrop's official code prints
        # (modelling_sparse_llama.py:276-285); the analytic average counts what each layer receives.
        handed = [entering for entering, _ in tokens.llm_visual[1:]] + [tokens.visual_tokens]
        printed = sum(handed) / len(handed)
        removed = ", ".join(f"{step['stage']} {step['layer']}: -{step['removed']}" for step in steps)
        note = (f"counts decided by the input: measured per step ({removed}), planned at an assumption "
                f"({result['analytic']['visual_tokens']} visual tokens); the analytic columns count the measured "
                f"run, whose layer average is "
                f"{measured_analytic['layer_average_visual_tokens']:.1f} visual tokens entering each decoder layer "
                f"({printed:.1f} handed on by each, as the official code prints it)")
        return result | {"schedule": ran.schedule.to_json(), "note": note, "analytic": measured_analytic,
                         "layer_average_visual_tokens_printed": printed}, ran
    note = (f"adaptive count: measured {result['visual_tokens_per_item_measured']} visual tokens per item (planned "
            f"at {result['analytic']['visual_tokens']}); the analytic columns count the measured run")
    return result | {"schedule": ran.schedule.to_json(), "note": note, "analytic": measured_analytic}, ran


def _reason(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


def _row_base(plan: Plan, config: ProfileConfig, row: RowSpec, backend: dict[str, Any] | None,
              rates: Any = None) -> dict[str, Any]:
    if plan.dtype is not None:
        # Every row names its dtypes, also a row whose build failed (backend None).
        backend = (backend or {}) | row_dtypes(plan.dtype, row.quant)
    return {
        "model": plan.profile.name, "variant": row.variant,
        # What the row ran, by name: the official method, or it with ficoco's corrections (its settings say which).
        "method_label": method_label(row.variant, row.schedule.settings_dict()), "quant": row.quant,
        "batch": row.batch,
        "text_tokens": config.text_tokens, "new_tokens": config.new_tokens, "device_kind": plan.device.type,
        "kv_bits": row_kv_bits(config, row.quant),
        "schedule": row.schedule.to_json(), "backend": backend, "note": None,
        "analytic": analytic(plan.profile, row, config, plan.gpu, plan.dtype), "threads": torch.get_num_threads(),
        **predicted(plan, config, row, rates),
    }


_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
           "fp32": torch.float32, "float32": torch.float32}


def _name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def compute_dtype(plan: Plan, config: ProfileConfig) -> tuple[torch.dtype, str]:
    """The dtype the models will compute in, and a word on why: the plan's choice where it makes one
    (--dtype), else the one build_model picks (bf16 on CPU, fp16 on a GPU, a checkpoint's bf16)."""
    choice = getattr(plan, "dtype", None)
    compute = getattr(choice, "compute", None)
    if compute is not None:
        dtype = compute if isinstance(compute, torch.dtype) else _DTYPES[_name(compute)]
        reason = getattr(choice, "reason", None)
        return dtype, _name(dtype) + (f" ({reason})" if reason else "")
    from pathlib import Path

    from ficoco.models.build import checkpoint_dtype, resolve_dtype

    path = Path(config.weights).expanduser()
    native = checkpoint_dtype(path) if config.weights != "random" and path.is_dir() else None
    dtype = resolve_dtype(None, plan.device.type, native)
    why = "a checkpoint stored in bf16" if native == torch.bfloat16 else (
        "16-bit on CPU computes in bf16" if plan.device.type == "cpu" else "16-bit on a GPU")
    return dtype, f"{_name(dtype)} ({why})"


def new_rates(plan: Plan, config: ProfileConfig, model: Any = None) -> Any:
    """A new probe of this machine's rates for the plan's compute dtype and device (measured when a
    prediction first asks for its shapes; between a row's runs on `model`'s own weights); None under
    a device map, whose transfers the prediction does not price."""
    if config.device_map:
        return None
    return rates_for(_plan_dtype(plan, config), plan.device, model_weights(model) if model is not None else None)


def _plan_dtype(plan: Plan, config: ProfileConfig) -> Any:
    """The plan's DtypeChoice where it made one, else the torch dtype the models will compute in."""
    return plan.dtype if plan.dtype is not None else compute_dtype(plan, config)[0]


def predicted(plan: Plan, config: ProfileConfig, row: RowSpec, rates: Any = None,
              expert_loads: dict[int, list[int]] | None = None,
              fused: frozenset[tuple[str, int]] = frozenset()) -> dict[str, Any]:
    """The row's prefill as this machine's rates predict it (profiling/predict.py): `predicted_ms`
    and its parts, at `rates` (a measured row's: probed before its runs, between them and after
    them; a new probe where none is given). None under a device map."""
    rates = rates if rates is not None else new_rates(plan, config)
    if rates is None:
        return {"predicted_ms": None}
    prediction = row_prediction(plan.profile, row.schedule, quant=row.quant, batch=row.batch,
                                text_tokens=config.text_tokens, dtype=_plan_dtype(plan, config), device=plan.device,
                                rates=rates, expert_loads=expert_loads, fused_layers=fused)
    return {"predicted_ms": prediction.total_s * 1e3, "predicted": prediction.to_json()}
