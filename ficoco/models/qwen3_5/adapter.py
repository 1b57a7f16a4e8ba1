"""The Qwen3.5 adapter (`Qwen3_5ForConditionalGeneration`): Qwen3-VL's adapter and parts (ficoco.models.qwen3_vl:
Qwen2-VL's packed-tower blocks, cuts and prompt shortening on the grid order) with a tower that names no DeepStack
tap (one merger, nothing added to the decoder's hidden states), and the hybrid decoder's part
(ficoco.models.qwen3_5.hybrid) for every method in the LLM.
"""

from __future__ import annotations

from torch import nn

from ficoco.models.qwen3_5.hybrid import HybridDecoder
from ficoco.models.qwen3_vl.adapter import Qwen3VLAdapter


class Qwen3_5Adapter(HybridDecoder, Qwen3VLAdapter):
    """Where a method goes in a Qwen3.5 model: the hybrid decoder's rules first (the refusals at Gated DeltaNet
    layers, the cache's length from the full layers, PDrop's own row of a gated layer), then Qwen3-VL's parts
    without DeepStack."""

    family_title = "Qwen3.5"

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        self.init_hybrid()

    def deepstack_mergers(self) -> list[tuple[int, nn.Module]]:
        """None: Qwen3.5's tower has no DeepStack taps (its vision model holds no deepstack mergers)."""
        return []
