"""The memory guard: what a build and its runs need, against what is free, before any model
is built, so a run that cannot fit ends with one line of advice instead of the OOM killer.

    free_memory_bytes(device) -> float
        CPU: MemAvailable, lowered to a cgroup's memory limit minus its working set (v2
        memory.max, v1 memory.limit_in_bytes) where one applies; CUDA: the device's free
        memory (torch.cuda.mem_get_info). FICOCO_MEMORY_LIMIT_BYTES (a number of bytes, e.g.
        24e9) caps the figure: a testing knob, and a way to keep a run smaller than the machine.
    memory_need_bytes(profile, rows, dtype, quant, *, text_tokens, new_tokens, kv_bits,
                      lm_head_tokens, margin_fraction) -> dict
        {"weights", "activations", "kv_cache", "margin", "total"} in bytes, for one build of
        `quant` in `dtype` (a DtypeChoice) running `rows` one at a time (objects with
        `.schedule` and `.batch`, such as the profile plan's RowSpec).
    check_memory(profile, rows, dtype, quants, device, *, free_bytes, ...) -> dict
        The need of the largest build plus "free" and "quant"; raises FicocoError naming what
        would fit (int8/int4, another dtype, fewer layers with --set, a GPU) when it does not.
    resolve_dtype_and_memory(profile, rows, requested, device, quants, *, native, ...)
        choose_dtype with these needs, the fp32 layers an upcast layout has room for, then
        check_memory: what `plan_run`, `build_model` and `flops --verify` call.
    upcast_weights_per_forward(profile, dtype, quant) -> int
        The weights an upcast layout copies at every forward (for a time estimate).

Weights, KV cache and activations come from the accountant (ficoco.accounting) at the bytes
of the chosen dtypes; the margin covers what it does not count (the interpreter and
libraries, allocator slack, buffers such as rotary tables): MARGIN_BYTES plus
MARGIN_FRACTION of the rest.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from ficoco.accounting import architecture
from ficoco.accounting.memory import QUANT_BITS, Quant, activation_peak_bytes, stored_kv_cache_bytes, weight_bytes
from ficoco.accounting.schedule import Schedule, plan_tokens
from ficoco.errors import FicocoError
from ficoco.machine.dtype_choice import DtypeChoice, choose_dtype, dtype_name
from ficoco.profiles import Profile, apply_overrides

LIMIT_ENV = "FICOCO_MEMORY_LIMIT_BYTES"
# Testing only: the free memory to assume, whatever the machine has (a cap would still depend on
# what else runs there).
FAKE_FREE_ENV = "FICOCO_TEST_FREE_MEMORY_BYTES"
MARGIN_BYTES = 0.5e9
MARGIN_FRACTION = 0.05
# The share of free memory that an upcast layout leaves unused rather than spend on float32
# layers: those only save time, and the machine may be shared with processes that grow.
UPCAST_SPARE_FRACTION = 0.1
# The kinds of alternative a failed check may name: --quant int8/int4, --dtype bf16, fewer
# decoder layers with --set, a GPU.
ADVICE = ("quant", "dtype", "layers", "gpu", "offload")
# A cgroup limit at or above this is "no limit" (v1 writes 2**63 rounded down to a page).
_NO_LIMIT = 1 << 60


class RowShape(Protocol):
    """What the guard reads of a row: its schedule and batch."""

    schedule: Schedule
    batch: int


@dataclasses.dataclass(frozen=True)
class VanillaRow:
    """A row for a build with no run plan (build_model, verify): vanilla at one batch."""

    schedule: Schedule = dataclasses.field(default_factory=lambda: Schedule("vanilla"))
    batch: int = 1


# ---- what is free ---------------------------------------------------------------------------------------------

def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _mem_available_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _stat_value(path: str, key: str) -> int:
    try:
        with open(path) as f:
            for line in f:
                name, _, value = line.partition(" ")
                if name == key:
                    return int(value)
    except (OSError, ValueError):
        pass
    return 0


def _cgroup_free_bytes(root: str = "/sys/fs/cgroup") -> int | None:
    """The cgroup limit minus its working set (usage less inactive page cache, which the kernel
    reclaims before it kills), or None without a limit."""
    candidates = [  # (limit, usage, stat, inactive-file key): v2, then v1
        (f"{root}/memory.max", f"{root}/memory.current", f"{root}/memory.stat", "inactive_file"),
        (f"{root}/memory/memory.limit_in_bytes", f"{root}/memory/memory.usage_in_bytes",
         f"{root}/memory/memory.stat", "total_inactive_file"),
    ]
    for limit_path, usage_path, stat_path, inactive_key in candidates:
        limit = _read_int(limit_path)
        if limit is None or limit >= _NO_LIMIT:
            continue
        usage = _read_int(usage_path) or 0
        working_set = max(0, usage - _stat_value(stat_path, inactive_key))
        return max(0, limit - working_set)
    return None


def _limit_from_env() -> float | None:
    text = os.environ.get(LIMIT_ENV)
    if not text:
        return None
    try:
        value = float(text)
    except ValueError:
        raise FicocoError(f"{LIMIT_ENV}='{text}' is not a number of bytes (e.g. 24e9)") from None
    if value < 0:
        raise FicocoError(f"{LIMIT_ENV}={text} must not be negative")
    return value


def free_memory(device: torch.device | str) -> tuple[float | None, str]:
    """The memory free for a build on `device` and where the figure comes from (None: unknown)."""
    device = torch.device(device)
    found: list[tuple[float, str]] = []
    fake = os.environ.get(FAKE_FREE_ENV)
    if fake:
        # Tests: the machine's own reading is replaced (what else runs there must not decide a
        # test); the limit knob below still caps it.
        try:
            found.append((float(fake), FAKE_FREE_ENV))
        except ValueError:
            raise FicocoError(f"{FAKE_FREE_ENV}='{fake}' is not a number of bytes (e.g. 12e9)") from None
    elif device.type == "cuda":
        try:
            free, _ = torch.cuda.mem_get_info(device)
            found.append((float(free), f"free on {torch.cuda.get_device_name(device)}"))
        except (RuntimeError, AssertionError):
            # No reading (a driver or runtime refusing the query): the GPU's own allocator
            # still fails cleanly (a row marked oom), unlike the kernel's OOM killer on the host.
            pass
    else:
        available = _mem_available_bytes()
        if available is not None:
            found.append((float(available), "MemAvailable"))
        cgroup = _cgroup_free_bytes()
        if cgroup is not None:
            found.append((float(cgroup), "cgroup memory limit"))
    limit = _limit_from_env()
    if limit is not None:
        found.append((limit, LIMIT_ENV))
    if not found:
        return None, "unknown"
    return min(found)


def free_memory_bytes(device: torch.device | str) -> float:
    """Bytes free for a build on `device` (infinity where nothing can be read)."""
    free, _ = free_memory(device)
    return float("inf") if free is None else free


# ---- what a build needs -----------------------------------------------------------------------------------------

def _bits(dtype: torch.dtype) -> int:
    return torch.finfo(dtype).bits


def shared_weight_bytes(arch: Any, distinct_layers: int | None, element_bytes: float) -> float:
    """Bytes of weights the decoder layers past the first `distinct_layers` do not hold when they share those
    layers' (unquantized, `element_bytes` each); 0 without sharing."""
    if not distinct_layers or distinct_layers >= arch.decoder.layers:
        return 0.0
    from ficoco.accounting.architecture import decoder_layer_parameters

    return element_bytes * sum(decoder_layer_parameters(arch, layer).total
                               for layer in range(distinct_layers, arch.decoder.layers))


def check_distinct_layers(arch: Any, distinct: int, *, weights: str = "random", quants: Sequence[str] = ("fp16",),
                          device_map: str | None = None) -> None:
    """Refuse a `distinct_layers` the build cannot honour, before anything is built: another source than random
    weights, quantized weights, a device map, a count outside 1..layers, or one that would make layers of
    different kinds share weights (a hybrid decoder's pattern)."""
    if weights != "random" or device_map or any(quant != "fp16" for quant in quants):
        raise FicocoError("distinct_layers= shares random weights between decoder layers of an unquantized model "
                          "in one device's memory; drop weights=, quants= or device_map=, or distinct_layers=")
    from ficoco.accounting.architecture import decoder_layer_parameters

    layers = arch.decoder.layers
    if not 1 <= distinct <= layers:
        raise FicocoError(f"distinct_layers={distinct}: the decoder has {layers} layers; give 1 to {layers}")
    for layer in range(distinct, layers):
        if decoder_layer_parameters(arch, layer) != decoder_layer_parameters(arch, layer % distinct):
            raise FicocoError(f"distinct_layers={distinct}: decoder layer {layer} is not shaped like layer "
                              f"{layer % distinct}, whose weights it would share; give a multiple of the decoder's "
                              "pattern of layer kinds")


def memory_need_bytes(profile: Profile, rows: Sequence[RowShape], dtype: DtypeChoice, quant: str, *,
                      text_tokens: int | None = None, new_tokens: int = 0, kv_bits: int | None = None,
                      lm_head_tokens: str = "last", margin_fraction: float = MARGIN_FRACTION,
                      distinct_layers: int | None = None) -> dict[str, float]:
    """Bytes one build of `quant` in `dtype` needs while it runs `rows` one after another:
    weights as stored, the largest row's activations and KV cache, and the margin. With `distinct_layers`,
    the decoder layers past them share their weights (models/build.py's share_decoder_layers_) and hold none."""
    if quant not in QUANT_BITS:
        raise FicocoError(f"unknown quant '{quant}': choose from {', '.join(QUANT_BITS)}")
    arch = architecture(profile)
    compute_bits = _bits(dtype.compute)
    upcast = dtype.upcast and quant == "fp16"
    q = Quant(quant, QUANT_BITS[quant], compute_bits, kv_bits or compute_bits)
    upcast_layers = dtype.upcast_layers(arch.decoder.layers, quant)
    # Unquantized weights are stored in the compute dtype, except an upcast layout's linears.
    weights = weight_bytes(arch, "all", q, element_bytes=compute_bits / 8, upcast_layers=upcast_layers,
                           upcast_element_bytes=_bits(dtype.storage) / 8)
    weights -= shared_weight_bytes(arch, distinct_layers, compute_bits / 8)
    d = arch.decoder
    # A build that converts weights (quantizing, or keeping fp32 copies) holds one linear's
    # weight at compute precision beside the model; so does the upcast scratch buffer.
    largest_linear = max(d.hidden * d.ffn, d.hidden * d.heads * d.head_dim, arch.vision.hidden * arch.vision.ffn)
    working = largest_linear * compute_bits / 8 if upcast or quant != "fp16" else 0.0
    activations = kv = 0.0
    for row in rows:
        plan = plan_tokens(arch, row.schedule, text_tokens=text_tokens)
        row_kv = stored_kv_cache_bytes(arch, plan, batch=row.batch, kv_bits=q.kv_bits)  # what memory holds
        # Decoded tokens wait unquantized in a quantized cache's residual window: the compute width.
        row_kv += 2 * row.batch * new_tokens * d.kv_heads * d.head_dim * d.layers * max(q.kv_bits, compute_bits) / 8
        row_act = activation_peak_bytes(arch, plan, batch=row.batch, quant=q, lm_head_tokens=lm_head_tokens)
        if plan.reductions:
            # Reducing layers materialise their attention probabilities (float32) for the scores.
            widest = max(max(d.heads * n_in * n_in for n_in, _ in plan.llm),
                         max(arch.vision.heads * n_in * n_in * plan.vision_items for n_in, _ in plan.vision))
            row_act += widest * row.batch * 4
        activations, kv = max(activations, row_act), max(kv, row_kv)
    activations += working
    margin = MARGIN_BYTES + margin_fraction * (weights + activations + kv)
    return {"weights": weights, "activations": activations, "kv_cache": kv, "margin": margin,
            "total": weights + activations + kv + margin}


def upcast_weights_per_forward(profile: Profile, dtype: DtypeChoice, quant: str = "fp16") -> int:
    """Linear weights an upcast layout copies to the compute dtype at every forward (0 for
    any other layout): the fixed cost per forward that a time estimate adds."""
    if not dtype.upcast or quant != "fp16":
        return 0
    arch = architecture(profile)
    from ficoco.accounting import parameter_counts

    per_layer = parameter_counts(arch).linear_decoder // arch.decoder.layers
    return per_layer * (arch.decoder.layers - min(dtype.fp32_layers, arch.decoder.layers))


def _upcast_layer_cost_bytes(profile: Profile, dtype: DtypeChoice, margin_fraction: float) -> float:
    """What keeping one more decoder layer's linear weights in fp32 adds to the need."""
    arch = architecture(profile)
    from ficoco.accounting import parameter_counts

    per_layer = parameter_counts(arch).linear_decoder // arch.decoder.layers
    return per_layer * (_bits(dtype.compute) - _bits(dtype.storage)) / 8 * (1 + margin_fraction)


def with_fp32_layers(profile: Profile, rows: Sequence[RowShape], dtype: DtypeChoice, free_bytes: float, *,
                     margin_fraction: float = MARGIN_FRACTION, **need_options: Any) -> DtypeChoice:
    """An upcast choice with as many decoder layers kept in fp32 as `free_bytes` (less
    UPCAST_SPARE_FRACTION of it) allows: each one kept is a layer whose weights are not copied
    at every forward."""
    if not dtype.upcast:
        return dtype
    layers = architecture(profile).decoder.layers
    base = memory_need_bytes(profile, rows, dataclasses.replace(dtype, fp32_layers=0), "fp16",
                             margin_fraction=margin_fraction, **need_options)["total"]
    free_bytes = min(free_bytes, max(base, free_bytes * (1 - UPCAST_SPARE_FRACTION)))
    room = free_bytes - base
    kept = 0 if room <= 0 else min(layers, int(room // _upcast_layer_cost_bytes(profile, dtype, margin_fraction)))
    while kept > 0 and memory_need_bytes(profile, rows, dataclasses.replace(dtype, fp32_layers=kept), "fp16",
                                         margin_fraction=margin_fraction, **need_options)["total"] > free_bytes:
        kept -= 1  # rounding of the per-layer estimate: never more than the memory holds
    reason = (f"{dtype.reason}; {layers - kept} of {layers} decoder layers upcast per forward, "
              f"the last {kept} kept in {dtype_name(dtype.compute)}")
    return dataclasses.replace(dtype, fp32_layers=kept, reason=reason)


# ---- the check ----------------------------------------------------------------------------------------------

def _gb(value: float) -> str:
    return f"{value / 1e9:.1f} GB"


def _layers_key(profile: Profile) -> str:
    return "text_config.num_hidden_layers" if isinstance(profile.config.get("text_config"), dict) \
        else "num_hidden_layers"


def _fewer_layers(profile: Profile, rows: Sequence[RowShape], dtype: DtypeChoice, quant: str, free_bytes: float,
                  **need_options: Any) -> tuple[int, float] | None:
    """The most decoder layers whose build fits, and its need (vanilla rows: reduced rows
    need no more)."""
    layers = architecture(profile).decoder.layers
    vanilla = [VanillaRow(batch=row.batch) for row in rows] or [VanillaRow()]
    low, high, best = 1, layers - 1, None
    while low <= high:  # the need grows with the layer count
        middle = (low + high) // 2
        smaller = copy.deepcopy(profile)
        apply_overrides(smaller, {_layers_key(profile): middle})
        choice = dataclasses.replace(dtype, fp32_layers=min(dtype.fp32_layers, middle))
        total = memory_need_bytes(smaller, vanilla, choice, quant, **need_options)["total"]
        if total <= free_bytes:
            best, low = (middle, total), middle + 1
        else:
            high = middle - 1
    return best


def check_memory(profile: Profile, rows: Sequence[RowShape], dtype: DtypeChoice, quants: Sequence[str],
                 device: torch.device | str, *, free_bytes: float | None = None, free_source: str | None = None,
                 advice: Sequence[str] = ADVICE, **need_options: Any) -> dict[str, Any]:
    """The need of the largest of the `quants` builds, with "free" and "quant"; raises
    FicocoError with one line naming what would fit when it does not.

    `free_bytes` defaults to what `free_memory(device)` reads; `advice` picks the kinds of
    alternative the command can take (quant, dtype, layers, gpu); `need_options` go to
    memory_need_bytes (text_tokens, new_tokens, kv_bits, lm_head_tokens, margin_fraction)."""
    device = torch.device(device)
    if free_bytes is None:
        free_bytes, free_source = free_memory(device)
    needs = {q: memory_need_bytes(profile, rows, dtype, q, **need_options) for q in quants}
    worst = max(needs, key=lambda q: needs[q]["total"])
    need = needs[worst]
    result: dict[str, Any] = {**need, "free": free_bytes, "quant": worst}
    if free_bytes is None or need["total"] <= free_bytes:
        return result
    fits: list[str] = []
    for quant in ("int8", "int4") if "quant" in advice else ():
        if QUANT_BITS[quant] < QUANT_BITS[worst]:
            total = memory_need_bytes(profile, rows, dtype, quant, **need_options)["total"]
            if total <= free_bytes:
                fits.append(f"quant={quant} ({_gb(total)})")
    if "dtype" in advice and dtype.compute == torch.float32 and not dtype.upcast:
        sixteen = DtypeChoice(torch.bfloat16, torch.bfloat16, "")
        total = max(memory_need_bytes(profile, rows, sixteen, q, **need_options)["total"] for q in quants)
        if total <= free_bytes:
            fits.append(f"dtype=bf16 ({_gb(total)})")
    fewer = _fewer_layers(profile, rows, dtype, worst, free_bytes, **need_options) if "layers" in advice else None
    if fewer is not None:
        fits.append(f"overrides={_layers_key(profile)}={fewer[0]} ({_gb(fewer[1])})")
    offload = offload_fit(profile, need, dtype, free_bytes, device) if "offload" in advice else None
    if offload is not None:
        fits.append(offload)
    if "gpu" in advice and device.type != "cuda":
        fits.append(f"a GPU with {_gb(need['total'])} free")
    stored = dtype_name(dtype.storage) + (f" upcast to {dtype_name(dtype.compute)}" if dtype.upcast else "")
    parts = ", ".join(f"{label} {_gb(need[name])}" for name, label in (
        ("weights", "weights"), ("activations", "activations"), ("kv_cache", "KV cache"), ("margin", "margin")))
    what = f"{profile.name} at quant={worst} in {stored}" if "quant" in advice else f"{profile.name} in {stored}"
    raise FicocoError(f"{what} needs {_gb(need['total'])} ({parts}) but {_gb(free_bytes)} is free "
                      f"({free_source or 'given'}); what fits: {', or '.join(fits) if fits else 'nothing smaller'}")


def offload_fit(profile: Profile, need: dict[str, float], dtype: DtypeChoice, free_bytes: float,
                device: torch.device) -> str | None:
    """The advice to offload weights (`--device-map cpu-offload`), when it fits: the computing device
    then holds the activations, the KV cache, the margin and one decoder layer's weights at a time
    (accelerate brings each layer's weights in for its forward); the weights wait in CPU memory, and on
    disk past `--max-memory cpu=...`. None when even that does not fit."""
    d = architecture(profile).decoder
    # One decoder layer's weights, an upper bound (as many key/value heads as query heads).
    layer_bytes = (4 * d.hidden * d.heads * d.head_dim + 3 * d.hidden * d.ffn) * _bits(dtype.compute) / 8
    running = need["activations"] + need["kv_cache"] + MARGIN_BYTES + MARGIN_FRACTION * (
        need["activations"] + need["kv_cache"] + layer_bytes) + layer_bytes
    if running > free_bytes:
        return None
    if device.type == "cuda":
        host_free, _ = free_memory("cpu")
        if host_free is not None and need["weights"] + MARGIN_BYTES > host_free:
            host_limit_mib = int(max(host_free - MARGIN_BYTES, 0) / 2**20)
            return (f"device_map=cpu-offload max_memory=cpu={host_limit_mib}MiB (weights past it on disk; "
                    f"{_gb(running)} on the GPU, one layer's weights at a time)")
        return (f"device_map=cpu-offload (weights {_gb(need['weights'])} in CPU memory; {_gb(running)} "
                f"on the GPU, one layer's weights at a time)")
    cpu_limit_mib = int((free_bytes - running) / 2**20)
    if cpu_limit_mib < 1:
        return None
    return (f"device_map=cpu-offload max_memory=cpu={cpu_limit_mib}MiB (weights past it on disk, read per "
            f"layer; {_gb(running)} for the run)")


def resolve_dtype_and_memory(profile: Profile, rows: Sequence[RowShape], requested: str, device: torch.device | str,
                             quants: Sequence[str], *, native: torch.dtype | None = None,
                             advice: Sequence[str] = ADVICE, **need_options: Any) -> tuple[DtypeChoice, dict[str, Any]]:
    """The dtype choice for `requested` on `device`, with memory taken into account, and the
    checked memory breakdown (FicocoError when nothing that was asked for fits)."""
    device = torch.device(device)
    free_bytes, source = free_memory(device)

    def need(choice: DtypeChoice) -> float:
        return max(memory_need_bytes(profile, rows, choice, q, **need_options)["total"] for q in quants)

    needs = {dt: need(DtypeChoice(dt, dt, "")) for dt in (torch.float32, torch.bfloat16, torch.float16)}
    upcast_need = need(DtypeChoice(torch.bfloat16, torch.float32, "", upcast=True))
    choice = choose_dtype(requested, device, need_bytes_by_dtype=needs, free_bytes=free_bytes, native=native,
                          upcast_need_bytes=upcast_need)
    if choice.upcast and free_bytes is not None:
        choice = with_fp32_layers(profile, rows, choice, free_bytes, **need_options)
    memory = check_memory(profile, rows, choice, quants, device, free_bytes=free_bytes, free_source=source,
                          advice=advice, **need_options)
    return choice, memory
