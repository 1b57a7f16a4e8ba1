"""What a method reads of a layer's attention, beside the layer's own attention.

Every layer a method does not read keeps the model's attention implementation (SDPA by default). A layer
whose attention a method reads has its attention module pointed at `ficoco_probe`, an attention function
registered with transformers' `AttentionInterface`: where ficoco's fused pass computes the layer (a CPU, no
mask but the causal rule: ficoco.methods.reads.ops.fused) it computes the layer's output and the head-mean
probabilities in one pass; elsewhere it runs the module's own implementation for the output and leaves the
reads of that attention (ficoco.methods.reads.ops.ProbedAttention over the call's queries, keys, mask and
scale: nothing is computed until the method reads rows, column sums or a block). Either way the module's
probe slot holds the reads and, when asked, the key states. Every later read runs through the slot's runner,
which times it in the handle's "probe" span; the layer's attention is timed in its "fused" or "attention" span.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn

from ficoco.errors import FicocoError
from ficoco.methods.reads import DEFAULT_ATTENTION_SCORES
from ficoco.methods.reads.ops import AttentionReads, ProbedAttention, ReadRunner
from ficoco.methods.reads.ops.fused import fusable, fused_attention
from ficoco.models import hf_compat as hf

PROBE_IMPLEMENTATION = "ficoco_probe"


# The patches slice 4-D masks and read a layer's attention from its queries and keys; flash and flex
# attention take other mask forms (none, or block masks) that the patches cannot slice.
SUPPORTED_ATTENTION = ("sdpa", "eager")


def check_attention_implementation(model: nn.Module) -> None:
    """Refuse, at apply(), attention implementations the patches cannot serve."""
    config = getattr(model, "config", None)
    configs = [config] + [getattr(config, key, None) for key in ("text_config", "vision_config")]
    for sub in filter(None, configs):
        implementation = hf.attention_implementation(sub)
        if implementation is not None and implementation not in SUPPORTED_ATTENTION:
            raise FicocoError(f"attn_implementation '{implementation}' is not supported by the FiCoCo patches; "
                              f"load the model with attn_implementation='sdpa' (or 'eager')")


@dataclass
class ProbeSlot:
    """What the probe leaves for one forward of one attention module."""

    want_keys: bool = False
    want_reads: bool = True  # False: the keys alone (a method that scores by keys)
    armed: bool = True  # when False the module runs its own implementation alone (e.g. decode steps)
    reads: AttentionReads | None = None  # the layer's attention, read on demand
    keys: Tensor | None = None  # (B, H, Tk, d) key states (after rotary), when want_keys
    # A module that calls its attention function once per segment (Qwen2-VL's vision attention:
    # once per image) leaves one (reads, keys) per call here; None: only the last call's, above.
    chunks: list[tuple[AttentionReads | None, Tensor | None]] | None = None
    runner: ReadRunner | None = None  # how a read runs (timed in the handle's "probe" span)
    scores: str = DEFAULT_ATTENTION_SCORES  # the rule the reads compute scores by (ficoco.methods.reads)
    heads: str = "mean"  # how the reads combine the heads: "mean", or "max" (FitPrune)

    def take(self) -> tuple[AttentionReads | None, Tensor | None]:
        if self.reads is None and self.keys is None:
            raise RuntimeError("the reducing layer's attention did not run through the FiCoCo probe")
        reads, keys = self.reads, self.keys
        self.reads = self.keys = None
        return reads, keys

    def take_chunks(self) -> list[tuple[AttentionReads | None, Tensor | None]]:
        """Every call's (reads, keys) since the last take, in call order (a chunked slot)."""
        if not self.chunks:
            raise RuntimeError("the reducing layer's attention did not run through the FiCoCo probe")
        chunks, self.chunks = self.chunks, []
        return chunks


def own_attention(module: nn.Module, own_config: Any, query: Tensor, key: Tensor, value: Tensor,
                  attention_mask: Tensor | None, **kwargs: Any) -> tuple[Tensor, Any]:
    """The module's own attention implementation (the one `own_config` names), for a routed module
    whose config copy points at one of ficoco's registered functions."""
    implementation = hf.attention_function(module, hf.attention_implementation(own_config))
    return implementation(module, query, key, value, attention_mask, **kwargs)


def route_attention(attention: nn.Module, implementation: str, patches: Any, config_attribute: str,
                    **attributes: Any) -> None:
    """Route one attention module through a registered `implementation` via its own config copy
    (the model's config stays): the original config is kept under `config_attribute`, with the
    other `attributes` (a slot), and `patches` undoes all of it."""
    original = attention.config
    config = copy.copy(original)
    hf.set_attention_implementation(config, implementation)
    patches.set(attention, config_attribute, original)
    for name, value in attributes.items():
        patches.set(attention, name, value)
    patches.set(attention, "config", config)


def probed_reads(module: nn.Module, query: Tensor, key: Tensor, attention_mask: Tensor | None,
                 scaling: float | None, is_causal: bool | None, scores: str, runner: ReadRunner | None,
                 heads: str = "mean") -> ProbedAttention:
    """The reads of one attention call from its own arguments: the queries and keys after rotary, the mask
    the layer's implementation received (or the module's causal rule where it received none), its scale;
    `heads` the statistic its reads combine the heads by."""
    causal = is_causal if is_causal is not None else bool(getattr(module, "is_causal", False))
    return ProbedAttention(query, key, scaling, mask=attention_mask, causal=causal, scores=scores, runner=runner,
                           heads=heads)


def attend(module: nn.Module, own_config: Any, query: Tensor, key: Tensor, value: Tensor,
           attention_mask: Tensor | None, dropout: float, scaling: float | None, is_causal: bool | None,
           scores: str, runner: ReadRunner | None, heads: str = "mean", **kwargs: Any
           ) -> tuple[tuple[Tensor, Any], ProbedAttention]:
    """A read layer's attention call: its output (as the module's own implementation returns it) and the reads of
    it. Where ficoco's fused pass computes the layer (ficoco.methods.reads.ops.fused: a CPU, no mask but the causal
    rule) the output and the head-mean probabilities come from one pass; else the module's own kernel runs and the reads
    are computed beside it when asked (`probed_reads`). Timed through the runner's ``attend`` where it has one
    (the handle's "fused" or "attention" span)."""
    timed = getattr(runner, "attend", None) or (lambda device, compute, reference=None: compute())

    def own() -> tuple[Tensor, Any]:
        return own_attention(module, own_config, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                             is_causal=is_causal, **kwargs)

    if fusable(query, key, value, attention_mask, scores, dropout, **kwargs):
        causal = is_causal if is_causal is not None else bool(getattr(module, "is_causal", False))

        def fused() -> tuple[Tensor, ProbedAttention]:
            return fused_attention(query, key, value, scaling, causal=causal, scores=scores, heads=heads,
                                   runner=runner)

        output, reads = timed(query.device, fused, own)
        # The layout every transformers attention function returns: (B, Tq, H, d), and no weights.
        return (output.transpose(1, 2).contiguous(), None), reads
    result = timed(query.device, own)
    return result, probed_reads(module, query, key, attention_mask, scaling, is_causal, scores, runner, heads)


def probe_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                    dropout: float = 0.0, scaling: float | None = None, is_causal: bool | None = None,
                    **kwargs: object) -> tuple[Tensor, Any]:
    """The module's own attention; when armed, the reads of it (and the keys) left in `module._ficoco_probe`."""
    slot: ProbeSlot = module._ficoco_probe  # type: ignore[assignment]
    if slot.armed and slot.want_reads:
        result, reads = attend(module, module._ficoco_original_config, query, key, value, attention_mask, dropout,
                               scaling, is_causal, slot.scores, slot.runner, slot.heads, **kwargs)
    else:
        result = own_attention(module, module._ficoco_original_config, query, key, value, attention_mask,
                               dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs)
        reads = None
    if slot.armed:
        keys = key if slot.want_keys else None
        if slot.chunks is not None:
            slot.chunks.append((reads, keys))
        else:
            slot.reads, slot.keys = reads, keys
    return result


hf.register_attention(PROBE_IMPLEMENTATION, probe_attention)


def install_probe(attention: nn.Module, *, want_keys: bool = False, want_reads: bool = True, armed: bool = True,
                  chunked: bool = False, runner: ReadRunner | None = None,
                  scores: str = DEFAULT_ATTENTION_SCORES, heads: str = "mean") -> ProbeSlot:
    """Route one attention module through the probe (its own config copy; the model's stays).
    `chunked` keeps every call's result (`ProbeSlot.take_chunks`), not the last call's alone; `want_reads`
    False keeps the keys alone; `runner` runs (and times) every read, whose scores follow `scores` and whose
    heads are combined by `heads`."""
    slot = ProbeSlot(want_keys=want_keys, want_reads=want_reads, armed=armed, chunks=[] if chunked else None,
                     runner=runner, scores=scores, heads=heads)
    attention._ficoco_original_config = attention.config  # type: ignore[assignment]
    probe_config = copy.copy(attention.config)
    hf.set_attention_implementation(probe_config, PROBE_IMPLEMENTATION)
    attention.config = probe_config
    attention._ficoco_probe = slot  # type: ignore[assignment]
    return slot


def remove_probe(attention: nn.Module) -> None:
    """Restore the module's own config and attention implementation."""
    attention.config = attention._ficoco_original_config
    del attention._ficoco_original_config
    del attention._ficoco_probe
