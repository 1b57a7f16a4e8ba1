"""Where a method in the LLM may act on a hybrid decoder (Qwen3.5: Gated DeltaNet layers beside full attention):
the one rule the model adapter (ficoco.models.qwen3_5.hybrid) and the accountant (ficoco.accounting.methods.
check_placement) both apply, so that they refuse a placement in the same words and `ficoco flops` prices only what
`ficoco profile` can run. No torch.

Most layers of such a decoder are Gated DeltaNet (linear attention: a causal convolution over the last few tokens
and a fixed-size recurrent state, no attention map, no per-token cache); the others (`full`) are full attention with
a KV cache. What each kind of method may do there:

- before the LLM (FiCoCo-V, ToMe, VisionZip, ...): the decoder gets fewer tokens, every layer alike; nothing here.
- at a layer's input (FastV, PDrop, SparseVLM, DART, HoliTom's inner merge): removing tokens before a DeltaNet
  layer is legitimate (its recurrence and convolution then run over the kept tokens), but what the method ranks by
  must exist: attention rows or keys of layer L-1 exist only where L-1 is full attention, and PDrop's own query and
  keys only where L is. Every reduction comes after the first full-attention layer's attention, whose cache holds
  every token: transformers reads the conversation's length from that layer (`Cache.get_seq_length`), and the
  causal mask of every full layer is built to its length.
  A step that withdraws every visual token (VTW, `removes_all`) sits at a full-attention layer: its K names the
  first layer whose KV cache holds no visual token.
- inside a layer (FiCoCo-L): at full-attention layers only; at a DeltaNet layer there is no attention map to score
  by, and a recurrent state has no tokens to remove.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from ficoco.errors import FicocoError


def layer_list(layers: Iterable[int]) -> str:
    """``3, 7, 11``: layers as a refusal names them."""
    return ", ".join(str(layer) for layer in layers)


@dataclass(frozen=True)
class HybridLayers:
    """A hybrid decoder as the placement rule reads it: its family's name in a sentence (`title`, "Qwen3.5"), its
    number of `layers` and its full-attention layers (`full`, ascending; the rest are Gated DeltaNet)."""

    title: str
    layers: int
    full: tuple[int, ...]

    def check_has_full(self) -> None:
        """Refuse a decoder without a full-attention layer: nothing would hold the cache's length or rank tokens."""
        if not self.full:
            raise FicocoError(f"this {self.title} decoder has no full-attention layer (layer_types); ficoco needs one "
                              "to read the cache's length and to rank tokens by attention")

    def withdrawal_layers(self) -> tuple[int, ...]:
        """The layers a step that withdraws every visual token (VTW) may act at: the full-attention ones after the
        first (whose cache keeps every token)."""
        return self.full[1:]

    def check(self, spec: Any, schedule: Any) -> None:
        """Refuse, in one line, the first decoder reduction of `schedule` (its `removals` of stage "llm") that
        method `spec` (a MethodSpec) cannot make here: at a layer's input, inside a layer, or in the part a method
        acting before the LLM runs inside it (`spec.inner`, HoliTom's merge)."""
        self.check_has_full()
        layers = sorted({r.layer for r in schedule.removals if r.stage == "llm"})
        acting = spec if spec.acts_at == "llm_layer" else spec.inner
        if not layers or acting is None:
            return
        if acting.placement == "layer_input":
            self.check_layer_input(acting, layers)
        elif acting.placement == "in_layer":
            self.check_in_layer(acting, layers)

    def check_layer_input(self, spec: Any, layers: Iterable[int]) -> None:
        """A method at the input of decoder `layers`: every step after the first full layer, reading only what
        exists (attention rows or keys of a full layer L-1; PDrop: its own row of a full layer L)."""
        probes, title, full, first_full = spec.probes, spec.title, self.full, self.full[0]
        after = [layer + 1 for layer in full if layer + 1 < self.layers]
        for layer in sorted(set(layers)):
            if (probes.previous_layer_rows or probes.previous_layer_keys) and layer - 1 not in full:
                read = "attention rows" if probes.previous_layer_rows else "attention keys"
                raise FicocoError(
                    f"{title} at layer {layer} reads layer {layer - 1}'s {read}, and layer {layer - 1} of this "
                    f"{self.title} decoder is Gated DeltaNet (linear attention: a recurrent state, no attention "
                    f"map); reduce at the input of a layer after a full-attention layer: {layer_list(after)}")
            if probes.own_query_key_row and (layer not in full or layer == first_full):
                later = [f for f in full if f != first_full]
                what = ("is Gated DeltaNet (linear attention: no queries or keys)" if layer not in full
                        else "is the first full-attention layer, whose cache must keep every token")
                raise FicocoError(
                    f"{title} ranks with layer {layer}'s own attention projections, and layer {layer} of this "
                    f"{self.title} decoder {what}; rank at the full-attention layers {layer_list(later)}")
            if getattr(spec, "removes_all", False) and layer not in self.withdrawal_layers():
                later = self.withdrawal_layers()
                what = ("is Gated DeltaNet (a recurrent state, no KV cache)" if layer not in full else
                        "is the first full-attention layer, whose cache keeps every token")
                raise FicocoError(
                    f"{title} withdraws the visual tokens from the KV cache of layer {layer} and every later layer, "
                    f"and layer {layer} of this {self.title} decoder {what}; withdraw at a later full-attention "
                    f"layer: {layer_list(later)}")
            if layer <= first_full:
                raise FicocoError(
                    f"{title} at layer {layer}: on this {self.title} decoder every reduction comes after the "
                    f"first full-attention layer ({first_full}), whose cache keeps every token; reduce at the "
                    f"input of a later layer: {layer_list(a for a in after if a > first_full)}")

    def check_in_layer(self, spec: Any, layers: Iterable[int]) -> None:
        """A method inside decoder `layers` (FiCoCo-L): at full-attention layers only."""
        for layer in sorted(set(layers)):
            if layer not in self.full:
                raise FicocoError(
                    f"{spec.title} at layer {layer}: layer {layer} of this {self.title} decoder is Gated "
                    f"DeltaNet (linear attention): it has no attention map to rank by, and a recurrent state has no "
                    f"tokens to remove; reduce at the full-attention layers {layer_list(self.full)} "
                    f"(schedule={{{self.full[0]}: n, ...}}, or shape='oneshot')")
