"""Bytes: KV cache, weights, LLM-Viewer memory access, footprint estimate, roofline time."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ficoco.accounting.architecture import Architecture, parameter_counts
from ficoco.accounting.flops import SCOPE_STAGES, Op
from ficoco.accounting.schedule import TokenPlan
from ficoco.errors import FicocoError
from ficoco.profile_records import Hardware

QUANT_BITS = {"fp16": 16, "int8": 8, "int4": 4}
# bitsandbytes' per-weight metadata: LLM.int8 keeps one fp32 scale per output row; NF4 one
# fp32 absmax per 64-weight block (no double quantization) and a 16-entry fp32 code book per layer.
_NF4_BLOCK = 64
_NF4_CODE_BOOK_BYTES = 16 * 4


@dataclass(frozen=True)
class Quant:
    """Bit widths of weights, activations and KV cache (LLM-Viewer's W/A/KV setting)."""

    name: str
    w_bits: int
    a_bits: int
    kv_bits: int

    @property
    def label(self) -> str:
        return f"W{self.w_bits}A{self.a_bits}KV{self.kv_bits}"


def make_quant(name: str, kv_bits: int | None = None) -> Quant:
    """`fp16`, `int8` or `int4` sets W, A and KV to 16, 8 or 4 bits; `kv_bits` overrides KV."""
    if name not in QUANT_BITS:
        raise FicocoError(f"unknown quant '{name}': choose from {', '.join(QUANT_BITS)}")
    if kv_bits is not None and kv_bits not in (2, 4, 8, 16):
        raise FicocoError(f"kv_bits={kv_bits} is not one of 2, 4, 8, 16")
    bits = QUANT_BITS[name]
    return Quant(name, bits, bits, bits if kv_bits is None else kv_bits)


# The KV-cache figure each convention reports as a row's `kv_cache_bytes` (every row also carries
# the stored one as `kv_cache_stored_bytes`). A convention replays its own source:
# - llm-viewer: LLM-Viewer's own figure (`llm_viewer_kv_cache_bytes`), the values times
#   kv_bits / 8 and nothing more, so that its quantized rows are the tool's.
# - flops (torch's counter), macs (fvcore), paper (the FiCoCo appendix's formulas) and
#   visual-macs (PDrop's and SparseVLM's tables) count operations and define no KV-cache figure,
#   quantized or not. For them ficoco reports the cache as transformers stores it
#   (`stored_kv_cache_bytes`): the figure `ficoco profile` measures to the byte, and the one a
#   footprint holds. (The FiCoCo paper's efficiency tables were made with LLM-Viewer:
#   `--convention llm-viewer` replays its figures.)
# Unquantized (kv_bits 16), both figures are the same: two bytes per value.
KV_FIGURES = {"flops": "stored", "macs": "stored", "llm-viewer": "llm-viewer", "paper": "stored",
              "visual-macs": "stored"}


def llm_viewer_kv_cache_bytes(ops: list[Op], quant: Quant) -> float:
    """LLM-Viewer's KV cache (its `memory_consumption_kv_cache`): what the prefill's k and v
    projections store into the cache (`store_kv_cache`: oc * b * s * kv_bits / 8 each, per
    layer), summed over the decoder's layers. Values times kv_bits / 8, nothing more: no scales,
    no zero points, whatever the bit width. The replay's projections run over the tokens each
    layer attends over (layer-exact; the final count with --equivalent), as its OPs do."""
    return sum(op.kv_store for op in ops if op.stage == "llm") * quant.kv_bits / 8


# transformers' quantized KV cache (QuantizedCache, HQQ backend; ficoco/models/kv_cache.py
# builds it with these). A layer's first update (the prefill) is quantized whole; decoded
# tokens wait in an unquantized residual window that is quantized together with everything
# before it when it reaches KV_RESIDUAL_TOKENS (transformers' default), so after k decode
# steps k % KV_RESIDUAL_TOKENS tokens are unquantized. HQQ groups KV_GROUP_ELEMENTS values
# (fewer when the head dimension is not a multiple: a group must divide every tensor's size)
# and stores one scale and one zero point per group in the compute dtype; 8, 4 and 2-bit codes
# are packed into uint8.
KV_RESIDUAL_TOKENS = 128
KV_GROUP_ELEMENTS = 64
KV_QUANT_BITS = (8, 4, 2)


def kv_group_size(head_dim: int) -> int:
    """Values per quantization group of the quantized KV cache for this head dimension."""
    return math.gcd(KV_GROUP_ELEMENTS, head_dim)


def kv_layer_bytes(tokens: int, *, batch: int, kv_heads: int, head_dim: int, kv_bits: int, element_bytes: float,
                   decode_steps: int = 0) -> float:
    """Keys and values of one decoder layer holding `tokens` (`decode_steps` of them appended
    one at a time after the prefill). At `kv_bits` equal to the compute width (8 * element_bytes)
    the cache is plain; below it, the quantized layout above: codes, per-group scale and zero
    point, and the residual window at the compute width."""
    per_token = 2 * batch * kv_heads * head_dim  # keys and values
    if kv_bits >= element_bytes * 8:
        return tokens * per_token * element_bytes
    residual = decode_steps % KV_RESIDUAL_TOKENS
    quantized = (tokens - residual) * per_token
    groups = quantized / kv_group_size(head_dim)
    return quantized * kv_bits / 8 + 2 * groups * element_bytes + residual * per_token * element_bytes


def stored_kv_cache_bytes(arch: Architecture, plan: TokenPlan, *, batch: int, kv_bits: int,
                          element_bytes: float | None = None, decode_steps: int = 0) -> float:
    """The KV cache as transformers stores it after the prefill and `decode_steps` decode steps
    (generate() feeds back all but the last new token): every layer holds the tokens it attended
    over in the prefill plus the decoded ones, in the layout of `kv_layer_bytes` (below the
    compute width: codes, a scale and a zero point per group, the residual window). This is the
    figure the profiler's measured cache equals. `element_bytes` is the compute dtype's width;
    by default 16 bits, or kv_bits where wider: what `ficoco flops` assumes."""
    if element_bytes is None:
        element_bytes = max(2.0, kv_bits / 8)
    d = arch.decoder
    return sum(kv_layer_bytes(n_in + decode_steps, batch=batch, kv_heads=d.kv_heads, head_dim=d.head_dim,
                              kv_bits=kv_bits, element_bytes=element_bytes, decode_steps=decode_steps)
               for layer, (n_in, _) in enumerate(plan.llm) if d.full_attention(layer))


# transformers' gated delta rule computes in float32 and returns its state in float32, and the cache keeps
# it so (Qwen3.5's config names it: mamba_ssm_dtype float32), whatever the compute dtype.
RECURRENT_STATE_BYTES = 4


@dataclass(frozen=True)
class LinearState:
    """What the linear-attention (Gated DeltaNet) layers hold beside the KV cache after the prefill, in bytes:
    per layer a recurrent state of value_heads x key_head_dim x value_head_dim (float32) and the causal
    convolution's last `kernel` inputs of every channel (compute dtype). Neither grows with the tokens."""

    layers: int
    recurrent_bytes: float
    conv_bytes: float

    @property
    def total_bytes(self) -> float:
        return self.recurrent_bytes + self.conv_bytes


def linear_state(arch: Architecture, *, batch: int, element_bytes: float = 2.0) -> LinearState:
    """The fixed state of `arch`'s linear-attention layers for `batch` sequences (zero without any)."""
    d = arch.decoder
    layers = d.layers - d.full_attention_layers
    if d.linear is None or not layers:
        return LinearState(0, 0.0, 0.0)
    return LinearState(layers, layers * batch * d.linear.state_elems * RECURRENT_STATE_BYTES,
                       layers * batch * d.linear.conv_state_elems * element_bytes)


def linear_state_bytes_per_layer(arch: Architecture, *, batch: int, element_bytes: float = 2.0) -> list[float]:
    """`linear_state`'s bytes layer by layer (0 at a full-attention layer)."""
    d = arch.decoder
    state = linear_state(arch, batch=batch, element_bytes=element_bytes)
    per_layer = state.total_bytes / state.layers if state.layers else 0.0
    return [0.0 if d.full_attention(layer) else per_layer for layer in range(d.layers)]


def weight_bytes(arch: Architecture, scope: str, quant: Quant, *, element_bytes: float = 2.0,
                 upcast_layers: int = 0, upcast_element_bytes: float = 2.0) -> float:
    """Weights resident for `scope`: linear layers at W bits (with bitsandbytes' scales and
    code books), the embedding, LM head, norms, biases and patch embedding at `element_bytes`
    (2 for 16-bit storage, 4 for fp32; bitsandbytes leaves them unquantized).

    `upcast_layers` decoder layers (unquantized models only) store their linear weights at
    `upcast_element_bytes` instead and upcast them per forward: fp32 compute on 16-bit storage.
    """
    counts = parameter_counts(arch)
    parts = ["decoder", "lm_head"] if scope == "llm" else ["vision", "projector", "decoder", "lm_head"]
    total = sum(getattr(counts, p) for p in parts)
    linear = sum(getattr(counts, f"linear_{p}") for p in parts if p != "lm_head")
    rows = sum(counts.linear_rows[p] for p in parts if p != "lm_head")
    layers = sum(counts.linear_modules[p] for p in parts if p != "lm_head")
    if quant.w_bits >= 16:
        if not 0 <= upcast_layers <= arch.decoder.layers:
            raise FicocoError(f"{upcast_layers} upcast layers: the decoder has {arch.decoder.layers}")
        # The first decoder layers' linears (a hybrid or sparse decoder's layers differ).
        upcast = sum(counts.linear_decoder_layers[:upcast_layers])
        return (total - upcast) * element_bytes + upcast * upcast_element_bytes
    if upcast_layers:
        raise FicocoError("upcast layers apply to unquantized weights only")
    other = (total - linear) * element_bytes
    if quant.w_bits == 8:
        return other + linear * 1.0 + rows * 4.0
    return other + linear * quant.w_bits / 8 + linear / _NF4_BLOCK * 4.0 + layers * _NF4_CODE_BOOK_BYTES


def memory_access_bytes(ops: list[Op], scope: str, quant: Quant) -> float:
    """LLM-Viewer's memory access: traffic (loads + stores), not a footprint."""
    w, a, kv = quant.w_bits / 8, quant.a_bits / 8, quant.kv_bits / 8
    return sum(_op_bytes(op, w, a, kv) for op in ops if op.stage in SCOPE_STAGES[scope])


def _op_bytes(op: Op, w: float, a: float, kv: float) -> float:
    return op.weight_elems * w + (op.act_load + op.act_store) * a + (op.kv_load + op.kv_store) * kv


def activation_peak_bytes(arch: Architecture, plan: TokenPlan, *, batch: int, quant: Quant,
                          lm_head_tokens: str) -> float:
    """Estimated peak of live activations: the largest layer's working set plus the logits.

    An estimate (tensors alive at once in an eager LLaMA layer without materialised attention
    probabilities), labelled as such wherever it shows.
    """
    d, v = arch.decoder, arch.vision
    a = quant.a_bits / 8
    q_out, kv_out = d.heads * d.head_dim, d.kv_heads * d.head_dim
    attention_width = 2 * d.hidden + q_out * (3 if d.attn_output_gate else 2) + 2 * kv_out
    if d.linear is not None:  # a Gated DeltaNet's q, k, v (before and after its convolution), z and output
        attention_width = max(attention_width, 2 * d.hidden + 2 * d.linear.conv_dim + 2 * d.linear.value_dim)
    # A sparse layer's expert rows (top-k per token: gate and up, then the activation) and its router logits.
    ffn_width = max(3 * d.ffn, 3 * d.moe.top_k * d.moe.ffn + d.moe.experts) if d.moe is not None else 3 * d.ffn
    llm = max((max(n_in * attention_width, n_out * (2 * d.hidden + ffn_width))
               for n_in, n_out in plan.llm), default=0) * batch
    vision = max((max(n_in * 6 * v.hidden, n_out * (2 * v.hidden + 2 * v.ffn)) for n_in, n_out in plan.vision),
                 default=0) * batch * plan.vision_items
    final = plan.llm[-1][1] if plan.llm else 0
    logits = batch * (final if lm_head_tokens == "all" else 1) * d.vocab
    return (max(llm, vision) + logits) * a


def roofline_seconds(ops: list[Op], scope: str, quant: Quant, gpu: Hardware) -> float:
    """Sum over ops of max(ops / peak, bytes / bandwidth); LLM-Viewer's INT8 peak applies
    when weights, activations and KV cache are all 8-bit or less."""
    peak = gpu.int8_ops_per_s if max(quant.w_bits, quant.a_bits, quant.kv_bits) <= 8 else gpu.fp16_ops_per_s
    w, a, kv = quant.w_bits / 8, quant.a_bits / 8, quant.kv_bits / 8
    return sum(
        max(op.viewer_ops / peak, _op_bytes(op, w, a, kv) / gpu.bandwidth_bytes_per_s)
        for op in ops
        if op.stage in SCOPE_STAGES[scope]
    )


def memory_per_device(weight_bytes_per_device: dict[str, float], kv_bytes_per_layer: list[float],
                      layer_devices: list[str]) -> dict[str, dict[str, float]]:
    """Under a device map: per device, the weights the map puts there and the KV cache of the decoder
    layers that run there (layer k's cache lives where layer k computes). Devices are names such as
    "cuda:0", "cpu", "disk"; a device with weights but no layer holds no cache."""
    if len(kv_bytes_per_layer) != len(layer_devices):
        raise ValueError(f"{len(kv_bytes_per_layer)} layers' KV bytes for {len(layer_devices)} layer devices")
    devices = list(dict.fromkeys([*weight_bytes_per_device, *layer_devices]))
    table = {device: {"weights_bytes": float(weight_bytes_per_device.get(device, 0)), "kv_cache_bytes": 0.0}
             for device in devices}
    for kv, device in zip(kv_bytes_per_layer, layer_devices, strict=True):
        table[device]["kv_cache_bytes"] += kv
    return table


def kv_cache_bytes_per_layer(arch: Architecture, plan: TokenPlan, *, batch: int, kv_bits: int,
                             element_bytes: float | None = None) -> list[float]:
    """`stored_kv_cache_bytes` after the prefill, layer by layer (its terms, in layer order)."""
    if element_bytes is None:
        element_bytes = max(2.0, kv_bits / 8)
    d = arch.decoder
    return [kv_layer_bytes(n_in, batch=batch, kv_heads=d.kv_heads, head_dim=d.head_dim, kv_bits=kv_bits,
                           element_bytes=element_bytes, decode_steps=0) if d.full_attention(layer) else 0.0
            for layer, (n_in, _) in enumerate(plan.llm)]
