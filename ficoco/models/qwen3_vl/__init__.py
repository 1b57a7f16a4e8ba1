"""FiCoCo inside Hugging Face's Qwen3-VL (`Qwen3VLForConditionalGeneration`) and Qwen3-VL-MoE
(`Qwen3VLMoeForConditionalGeneration`): a ViT without [CLS] over native-resolution 16 px patches (learned
position embeddings resampled to each image's grid, 2-D rotary), a merger joining every 2 x 2 group into one
LLM token, DeepStack (the outputs of the `deepstack_visual_indexes` tower blocks, each through its own merger,
added to the visual positions after the first decoder layers), and a Qwen3 decoder (dense, or sparse experts)
with 3-D rotary positions.

The family is Qwen2-VL's parts (ficoco.models.qwen2_vl: the tower blocks, the cuts, the prompt shortening, the
entry) composed with DeepStack's (`deepstack`):

- `deepstack.TowerTaps`: every tap's features per image, following the steps of a method before the LLM (kept
  rows where it keeps, riding through the method's one step where it merges by the keys alone);
- `deepstack.DeepStackOrder`: Qwen2-VL's grid order whose encoder hands the decoder the kept features per tap;
- `deepstack.DecoderTaps`: DeepStack's additions sliced (and, under FiCoCo-L, merged) to the visual tokens a
  method in the decoder leaves;
- `adapter.Qwen3VLAdapter`: composes them; `inputs`: prompts laid out as the processor lays them out.
"""

from ficoco.models.qwen3_vl.adapter import Qwen3VLAdapter
from ficoco.models.qwen3_vl.inputs import PREFIX_TOKENS, PROMPT, image_grid, synthetic_inputs

__all__ = ["PREFIX_TOKENS", "PROMPT", "Qwen3VLAdapter", "image_grid", "synthetic_inputs"]
