"""What one profile row measured, as typed records: the prefill, the memory and KV cache, the
generation (decode) and the fidelity, and the row that holds them (`MeasuredRow`). They become
JSON only at the report boundary (`to_json`), in the `ficoco.report/1` row fields, unchanged.
No torch here: the records hold numbers, the trackers' readings and their JSON."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Protocol


class _Json(Protocol):
    def to_json(self) -> dict[str, Any]: ...


class _Latency(_Json, Protocol):
    @property
    def median_ms(self) -> float: ...


@dataclass(frozen=True)
class PrefillRecord:
    """The timed prefill: its wall times, the runs and what chose them, the method's own time per
    run (its reduction stages and its attention probe: medians over the timed runs), what every
    image handed the LLM as it ran (an adaptive method's count; None where it does not count), and
    the attention kernel every layer ran."""

    latency: _Latency  # trackers.LatencyStats
    runs: dict[str, Any]  # {"warmup": n, "repeat": n, "chosen_by": "..."}
    batch: int
    reduction_stages_ms: float
    probe_ms: float
    # The read layers' attention (medians over the timed runs): "fused_ms", the passes that computed a layer's output
    # and its reads together (ficoco.methods.reads.ops.fused); "attention_ms", the model's own kernel where the reads
    # ran beside it; "fused_reference_ms", the model's own kernel timed on the fused layers' inputs in one untimed
    # forward (None where no such forward ran).
    fused_ms: float = 0.0
    attention_ms: float = 0.0
    fused_reference_ms: float | None = None
    visual_tokens_per_item_measured: int | None = None
    # A method whose counts are the input's own (MustDrop): what every step removed as it ran, [{"stage", "layer",
    # "where", "removed"}] (per item for a vision step, per sample for a decoder step); None: not such a method.
    measured_steps: list[dict[str, Any]] | None = None
    # Per stage, the attention kernel every layer ran (profiling/kernels.py's record); None: not recorded.
    attention_kernels: dict[str, Any] | None = None
    # Per sparse decoder layer, the rows its experts took (profiling/experts.py's record); None: a dense decoder.
    expert_loads: dict[str, Any] | None = None
    # The process's page faults in each timed run, in order ({"minor": [...], "major": [...]}); None where the
    # system does not count them.
    page_faults: dict[str, list[int]] | None = None

    @property
    def images_per_s(self) -> float:
        return self.batch / (self.latency.median_ms / 1e3)

    @property
    def reads_ms(self) -> float:
        """What the method's reads of attention cost: the reads run after the layer (the "probe" span) and what its
        fused passes took beyond the model's own kernel on the same inputs (never below zero: a fused pass no slower
        than the kernel reads for free)."""
        extra = max(self.fused_ms - self.fused_reference_ms, 0.0) if self.fused_reference_ms is not None else 0.0
        return self.probe_ms + extra

    @property
    def read_attention_ms(self) -> float | None:
        """The read layers' attention as the model's own kernel computes it: what the reads are priced against.
        None where a fused pass ran and its reference was not timed."""
        if self.fused_ms and self.fused_reference_ms is None:
            return None
        return self.attention_ms + (self.fused_reference_ms or 0.0)

    @property
    def reduction_ms(self) -> float:
        """The method's time: its stages and its reads."""
        return self.reduction_stages_ms + self.reads_ms

    @property
    def reduction_share(self) -> float:
        return self.reduction_ms / self.latency.median_ms if self.latency.median_ms else 0.0


@dataclass(frozen=True)
class MemoryRecord:
    """The prefill's peak memory and the KV cache after it; under a device map, the split and the
    memory of every device (accountant and measured)."""

    peak: _Json  # trackers.MemoryReading
    kv_cache_bytes: int
    kv_cache_tokens: int
    device_map: dict[str, Any] | None = None  # models.device_map.summary, its "map" apart
    device_map_entries: Any = None
    memory_per_device: dict[str, dict[str, Any]] | None = None


# What the decode figures mean, written into every report beside them.
DECODE_DEFINITION = ("ttft = first token - call; decode step = token k - token k-1; total = ttft + decode steps; "
                     "images/s = batch / total; tokens/s = batch * new tokens / total")


@dataclass(frozen=True)
class DecodeFigures:
    """The decode figures of the timed generate() runs (decode.decode_metrics): TTFT, per-token decode
    and total as {median_ms, p90_ms, min_ms, samples_ms}, and the throughputs that follow the median total."""

    new_tokens: int
    prefill_ms: float  # the row's prefill latency (a forward alone), shown beside TTFT
    ttft: dict[str, Any]
    decode_per_token: dict[str, Any] | None  # None with one new token (no decode step)
    total: dict[str, Any]
    generate_wall: dict[str, Any]
    images_per_s: float
    tokens_per_s: float
    decode_tokens_per_s: float | None  # one sample's new tokens per second while decoding, from the median step

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "definition": DECODE_DEFINITION}


@dataclass(frozen=True)
class GenerationRecord:
    """The timed generate() runs (--new-tokens): generate()'s wall time, the decode figures, the KV
    cache at the end, the generation's peak memory and its runs."""

    latency: _Json  # trackers.LatencyStats of generate(), output included
    decode: DecodeFigures
    kv_cache_bytes: int
    kv_cache_tokens: int
    memory: _Json  # trackers.MemoryReading
    runs: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        # The throughputs follow `total` (call to last token, decode.py), as the paper's table counts them.
        return {"latency": self.latency.to_json(), **self.decode.to_json(),
                "generated_tokens_per_s": self.decode.tokens_per_s,
                "kv_cache_bytes": self.kv_cache_bytes, "kv_cache_tokens": self.kv_cache_tokens,
                "memory": self.memory.to_json(), "runs": self.runs}


@dataclass(frozen=True)
class FidelityFigures:
    """How far a row's outputs moved from its vanilla row's on the same inputs (fidelity.compare):
    KL(vanilla || row) of the next-token distribution at the last prompt position (nats, mean and largest
    over the prompts), top-1 agreement, and with generation the greedy prefix that matches (tokens and
    share of the new tokens) and, with a tokenizer, both decoded continuations."""

    kl_divergence: float
    kl_divergence_max: float
    top1_agreement: float
    prompts: int
    new_tokens: int | None = None
    greedy_prefix_tokens: float | None = None
    greedy_prefix_share: float | None = None
    texts: dict[str, list[str]] | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class FidelityRecord:
    """The row against vanilla (--fidelity). The vanilla row is the reference itself (`is_reference`,
    JSON null); a reduced row names its reference and carries its figures, or only a note where no
    vanilla row of its quant and batch was measured."""

    reference: str | None = None  # "vanilla fp16 batch 1"
    figures: FidelityFigures | None = None
    note: str | None = None
    is_reference: bool = False

    def to_json(self) -> dict[str, Any] | None:
        if self.is_reference:
            return None
        figures = self.figures.to_json() if self.figures is not None else {}
        return {"reference": self.reference, **figures, "note": self.note}


def reads_record(prefill: PrefillRecord) -> dict[str, Any] | None:
    """The row's reads of attention priced against the attention they read: ``ms`` (`PrefillRecord.reads_ms`),
    ``attention_ms`` (the read layers' attention in the model's own kernel), ``x_attention`` (their ratio), how
    they ran (``fused_ms``, ``fused_reference_ms``, ``probe_ms``) and the method's steps apart (``steps_ms``).
    None where the method read no attention."""
    if not (prefill.probe_ms or prefill.fused_ms or prefill.attention_ms):
        return None
    attention = prefill.read_attention_ms
    return {"ms": prefill.reads_ms, "attention_ms": attention,
            "x_attention": prefill.reads_ms / attention if attention else None,
            "fused_ms": prefill.fused_ms, "fused_reference_ms": prefill.fused_reference_ms,
            "probe_ms": prefill.probe_ms, "steps_ms": prefill.reduction_stages_ms}


@dataclass(frozen=True)
class MeasuredRow:
    """Everything one row measured; `to_json` gives the report row's measured fields."""

    prefill: PrefillRecord
    memory: MemoryRecord
    generation: GenerationRecord | None = None
    fidelity: FidelityRecord | None = None  # None without --fidelity

    def to_json(self) -> dict[str, Any]:
        """The row's measured fields, as `ficoco.report/1` holds them (names and order unchanged)."""
        prefill, memory = self.prefill, self.memory
        row: dict[str, Any] = {
            "latency": prefill.latency.to_json(),
            "runs": prefill.runs,
            "images_per_s": prefill.images_per_s,
            "memory": memory.peak.to_json(),
            "kv_cache_bytes": memory.kv_cache_bytes,
            "kv_cache_tokens": memory.kv_cache_tokens,
            "reduction_ms": prefill.reduction_ms,
            "reduction_stages_ms": prefill.reduction_stages_ms,
            "probe_ms": prefill.probe_ms,
            "reads": reads_record(prefill),
            "reduction_share": prefill.reduction_share,
            "generation": self.generation.to_json() if self.generation is not None else None,
        }
        if self.fidelity is not None:
            row["fidelity"] = self.fidelity.to_json()
        if memory.device_map is not None:
            row |= {"device_map": memory.device_map, "device_map_entries": memory.device_map_entries,
                    "memory_per_device": memory.memory_per_device}
        if prefill.visual_tokens_per_item_measured:
            row["visual_tokens_per_item_measured"] = prefill.visual_tokens_per_item_measured
        if prefill.measured_steps is not None:
            row["measured_steps"] = prefill.measured_steps
        if prefill.attention_kernels is not None:
            row["attention_kernels"] = prefill.attention_kernels
        if prefill.expert_loads is not None:
            row["expert_loads"] = prefill.expert_loads
        if prefill.page_faults is not None:
            row["page_faults"] = prefill.page_faults
        return row
