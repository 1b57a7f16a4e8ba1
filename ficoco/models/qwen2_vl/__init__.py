"""FiCoCo inside Hugging Face's Qwen2-VL (`Qwen2VLForConditionalGeneration`): a ViT without
[CLS] over native-resolution patches, a PatchMerger that joins every 2 x 2 group of patches
into one LLM token, and a Qwen2 decoder with multimodal (3-D) rotary positions.

FiCoCo-L is the base adapter's (`FamilyAdapter`, as LLaVA's): the decoder layers have the same parts and signature,
the 3-D positions arrive as one (B, T, head_dim) rotary table per sequence, which the wrapped
layers slice with the kept tokens like LLaVA's, and decoding needs nothing more because layer
0 (never reduced) keeps the full prompt, so transformers' `rope_deltas` and the cache length
are the unreduced layout's.

FiCoCo-V is this package's:

- The ViT runs every image of a batch as one flat sequence, `cu_seqlens` cutting it into
  images and a (tokens, head_dim) rotary table giving each patch its 2-D place. Its tokens
  come in merge-group order (the 4 patches of a 2 x 2 group are consecutive), so V removes
  whole groups: a group's score and correlation are its members' means, the semantic term
  is the equivalent token's (no [CLS]), the local penalty works on the grid of groups, and
  compressing folds a group into another member by member. Every image loses the same number
  of groups; images of different sizes are reduced in one batch per size. After a reducing
  layer the later blocks get the rotary table sliced to the kept patches and `cu_seqlens`
  of the shorter images, and the merger reads whole groups as before.
- The entry (forward and generate) encodes the images first, so that it knows which groups
  every image kept, then shortens each image's placeholder span to its kept groups and
  passes the 3-D position ids the unreduced prompt gives the kept tokens (computed with
  transformers' `get_rope_index` on the unreduced prompt), and the `rope_deltas` that put
  the next token where the unreduced model would.

The family is composed of parts, each with one job, that Qwen2.5-VL (ficoco.models.qwen2_5_vl) reuses
with its window order in place of the grid order:

- `order.GridOrder`: the tower's token order (the window strategy), asked by every part below where the
  order matters: which segments a block runs on, how a pass starts, what the merger and the encoder hand out.
- `tower_pass`: the `TowerPass` record of what every image still holds, and `TowerBlocks`, which runs the
  tower's blocks with a method inside them (FiCoCo-V's reduction, ToMe's merges).
- `cut.TowerCuts`: the cuts of whole merge groups at the tower's output or after the merger.
- `prompt.PromptShortener`: the prompt once visual tokens are gone (input_ids, 3-D positions, rope_deltas).
- `adapter.Qwen2VLAdapter`: finds the model's modules, composes the parts, answers the entry's hooks.
- `inputs`: prompts laid out like the processor's (`synthetic_inputs`, `image_grid`).
"""

from ficoco.models.qwen2_vl.adapter import Qwen2VLAdapter
from ficoco.models.qwen2_vl.inputs import PREFIX_TOKENS, PROMPT, image_grid, synthetic_inputs
from ficoco.models.qwen2_vl.order import GridOrder
from ficoco.models.qwen2_vl.tower_pass import TowerPass, group_patch_targets, group_patches

__all__ = ["PREFIX_TOKENS", "PROMPT", "GridOrder", "Qwen2VLAdapter", "TowerPass", "group_patch_targets",
           "group_patches", "image_grid", "synthetic_inputs"]
