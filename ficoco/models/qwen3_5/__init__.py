"""FiCoCo inside Hugging Face's Qwen3.5 (`Qwen3_5ForConditionalGeneration`): a Qwen3-VL-like ViT (16-pixel
patches, learned positions resampled to the image's grid, a 2 x 2 PatchMerger, no DeepStack) and a hybrid
decoder whose layers are Gated DeltaNet linear attention but every fourth, which is full gated attention
(`layer_types`), with 3-D (interleaved, partial) rotary positions.

- `hybrid.HybridDecoder`: what a method in the LLM may do at each kind of layer (refused in one line where it
  cannot), the cache's length on a later turn, PDrop's own row of a gated attention layer.
- `adapter.Qwen3_5Adapter`: the hybrid decoder's part over Qwen3-VL's adapter (ficoco.models.qwen3_vl: Qwen2-VL's
  tower blocks, cuts and shortened prompt) with no DeepStack tap.
- `inputs`: prompts laid out like the processor's (`synthetic_inputs`, `image_grid`, `PREFIX_TOKENS`, `PROMPT`).
"""

from ficoco.models.qwen3_5.adapter import Qwen3_5Adapter
from ficoco.models.qwen3_5.hybrid import HybridDecoder
from ficoco.models.qwen3_5.inputs import PREFIX_TOKENS, PROMPT, image_grid, synthetic_inputs

__all__ = ["PREFIX_TOKENS", "PROMPT", "HybridDecoder", "Qwen3_5Adapter", "image_grid", "synthetic_inputs"]
