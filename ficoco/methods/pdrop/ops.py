"""PyramidDrop / PDrop (Cooperx521/PyramidDrop, CVPR'25): rank and drop image tokens at stages.

After layers 7, 15 and 23 (``layer_list=[8,16,24]``: rank & drop runs at the input of layers
8, 16, 24), PDrop keeps ``int(N * ratio_list[stage + 1])`` image tokens, counted from the
original ``N`` (``ratio_list = [1, l, l^2, l^3]``, lambda 0.5 by default: 288 / 144 / 72 of 576).

**Score** (``pdrop_rank_drop``): with the rank layer's *own* modules - ``input_layernorm``,
``q_proj``, ``k_proj``, RoPE at the current positions (post-RoPE) - the last instruction
token's query attends, softmaxed in float32 over all keys, head mean, image columns. The
last instruction token is the last prompt token at inference (``prompt_len + image_tokens - 1``),
the same query FastV uses. The score is recomputed at every stage on the already reduced
sequence. The adapters compute q for that one row only (the official code projects q for every
row and reads one) and k for all rows: `last_row_attention` does the rest.

**Removal**: the top-k, **sorted** (original order), rebuilt as [prefix, kept image, suffix];
position ids are **re-compacted** (``position_ids[i, :cur_len] = arange``). Each layer caches
its own reduced length; decode positions continue from the compacted length.

Departures, for batching only: spans per sample instead of ``prompt_len`` kept on the model;
left padding (the official loop raises on it), with padding keys masked; ties to the lowest
index. Compaction keeps the prefix's positions and renumbers from the span's first position,
which is ``arange`` for an unpadded sample and padding-invariant otherwise.
"""

from __future__ import annotations

from torch import Tensor

from ficoco.errors import FicocoError
from ficoco.methods.inputs import Reduced, StepInput
from ficoco.methods.ops import check_span, last_row_attention, rebuild, top_indices
from ficoco.methods.ops import last_row_scores as fastv_scores  # FastV's rule

__all__ = ["last_row_attention", "pdrop_keep", "pdrop_reduce", "pdrop_scores", "step"]


def pdrop_keep(num_visual_initial: int, ratio: float, stage: int) -> int:
    """Image tokens kept after stage ``stage`` (0-based): ``int(N * ratio ** (stage + 1))``, at least 1."""
    return max(1, int(num_visual_initial * ratio ** (stage + 1)))


def pdrop_scores(row_attention: Tensor, visual_start: Tensor, num_visual: int) -> Tensor:
    """``(B, N)`` head-mean attention of the last instruction token to each current image token,
    from the rank layer's recomputed row (``(B, H, T)`` or ``(B, T)``)."""
    return fastv_scores(row_attention, visual_start, num_visual)


def pdrop_reduce(hidden: Tensor, scores: Tensor, keep: int, visual_start: Tensor, num_visual: int,
                 position_ids: Tensor, attention_mask: Tensor | None = None) -> Reduced:
    """One stage: keep the ``keep`` best image tokens in order and compact the positions.

    Args:
        hidden: ``(B, T, D)`` the input of the rank layer.
        scores: ``(B, N)`` from :func:`pdrop_scores`.
        keep: from :func:`pdrop_keep`; ``1 <= keep <= N`` (``keep == N`` changes nothing).
        visual_start: ``(B,)``; num_visual: the current ``N``.
        position_ids: ``(B, T)`` current position ids; attention_mask: optional ``(B, T)``.

    Returns:
        A :class:`~ficoco.methods.inputs.Reduced` with compacted position ids.
    """
    check_span(hidden, visual_start, num_visual)
    if not 1 <= keep <= num_visual:
        raise FicocoError(f"PDrop keeps 1..{num_visual} image tokens at this stage, got {keep}")
    kept = top_indices(scores, keep)
    return rebuild(hidden, kept, visual_start.to(hidden.device), num_visual, position_ids, "compact",
                   attention_mask)


def step(inputs: StepInput, settings: dict) -> Reduced:
    """The model adapters' call at a rank layer's input: its own last row ranks, positions compact."""
    if inputs.query_key_row is None:
        raise RuntimeError("PDrop needs the rank layer's recomputed last row from the adapter")
    scores = pdrop_scores(inputs.query_key_row, inputs.visual_start, inputs.num_visual)
    return pdrop_reduce(inputs.hidden, scores, inputs.keep, inputs.visual_start, inputs.num_visual,
                        inputs.position_ids, inputs.attention_mask)
