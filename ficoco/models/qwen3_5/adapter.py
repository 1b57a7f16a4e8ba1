"""The Qwen3.5 adapter (`Qwen3_5ForConditionalGeneration`): the Qwen-VL parts for the tower, the cuts and
the shortened prompt (the tower is Qwen3-VL's without DeepStack: one merger, nothing added to the
decoder's hidden states), and the hybrid decoder's part (ficoco.models.qwen3_5.hybrid) for every method
in the LLM.
"""

from __future__ import annotations

from torch import nn

from ficoco.models.qwen2_vl.adapter import Qwen2VLAdapter
from ficoco.models.qwen3_5.hybrid import HybridDecoder


class Qwen3_5Adapter(HybridDecoder, Qwen2VLAdapter):
    """Where a method goes in a Qwen3.5 model: the hybrid decoder's rules first (the refusals, the cache's
    length, PDrop's own row), then the Qwen-VL parts."""

    family_title = "Qwen3.5"

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        self.init_hybrid()
