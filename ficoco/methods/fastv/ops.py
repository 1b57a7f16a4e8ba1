"""FastV (pkunlp-icler/FastV, ECCV'24): keep the image tokens the last prompt token attends to.

At the input of decoder layer K (default 2), FastV ranks the image tokens by the attention
layer K-1 gave them and keeps the top ``keep``; layers K and later run on the shorter
sequence. Nothing is merged, and the kept tokens keep their **original position ids**
(``position_ids = keep_idx``, gaps included).

**Where the code departs from the paper** (followed here, since the code produced the
published numbers): the paper describes the average attention an image token *receives from
all tokens*; the code (4.31 fork ``modeling_llama.py`` ~L737-746, HF fork ``fastv_forward``)
takes the **last query row only** - ``mean over heads of attn[..., -1, image]`` - i.e. the
last prompt token at prefill (FastV issue #14). The row is softmaxed over all keys; the
official code reads it from eager attention with ``output_attentions=True``; here it is
recomputed from layer K-1's post-RoPE q (last row) and k (`last_row_attention`), which is
exact because the causal mask hides nothing from the last row, so SDPA stays on. Padding keys
are masked, which the batch-1 official code never needs.

Other departures, all to make it batched and stateless: the image span comes per sample
(``visual_start``) instead of the hard-coded 35/36/5; ties among equal scores go to the lowest
index (``torch.topk`` leaves them unspecified). With the KV cache, layers < K cache every token
and layers >= K the kept ones, fixed for decoding (the HF fork's ``use_cache=True`` path);
decode positions continue from the full length, consistent with the original-position scheme.
"""

from __future__ import annotations

from torch import Tensor

from ficoco.errors import FicocoError
from ficoco.methods.inputs import Reduced, StepInput
from ficoco.methods.ops import check_span, last_row_attention, rebuild, top_indices
from ficoco.methods.ops import last_row_scores as fastv_scores  # FastV's rule, shared with PDrop and HoliTom

__all__ = ["fastv_reduce", "fastv_scores", "last_row_attention", "step"]



def fastv_reduce(hidden: Tensor, scores: Tensor, keep: int, visual_start: Tensor, num_visual: int,
                 position_ids: Tensor, attention_mask: Tensor | None = None) -> Reduced:
    """Keep the ``keep`` highest-scoring image tokens at the input of layer K.

    Args:
        hidden: ``(B, T, D)`` the input of layer K.
        scores: ``(B, N)`` from :func:`fastv_scores` (layer K-1's last row).
        keep: image tokens that stay, ``1 <= keep <= N``; the same for every sample.
        visual_start: ``(B,)``; num_visual: ``N``.
        position_ids: ``(B, T)`` the input's position ids (kept as they are: original scheme).
        attention_mask: optional ``(B, T)`` 2-D padding mask, sliced alike.

    Returns:
        A :class:`~ficoco.methods.inputs.Reduced`; ``keep == N`` returns the input unchanged.
    """
    check_span(hidden, visual_start, num_visual)
    if not 1 <= keep <= num_visual:
        raise FicocoError(f"FastV keeps 1..{num_visual} image tokens, got {keep}")
    kept = top_indices(scores, keep)
    return rebuild(hidden, kept, visual_start.to(hidden.device), num_visual, position_ids, "original",
                   attention_mask)


def step(inputs: StepInput, settings: dict) -> Reduced:
    """The model adapters' call at the input of layer K: score with layer K-1's last row, keep the best."""
    if inputs.row_attention is None:
        raise RuntimeError("FastV needs layer K-1's last-row attention from the adapter's probe")
    scores = fastv_scores(inputs.row_attention, inputs.visual_start, inputs.num_visual)
    return fastv_reduce(inputs.hidden, scores, inputs.keep, inputs.visual_start, inputs.num_visual,
                        inputs.position_ids, inputs.attention_mask)
