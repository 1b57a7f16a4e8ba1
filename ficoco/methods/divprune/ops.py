"""DivPrune (CVPR'25, vbdi/divprune): Max-Min diversity selection of the projected visual tokens.

What the official code does (LLaVA-1.5 through lmms-eval; vbdi/divprune 799e2d9,
LLaVA/llava/model/llava_arch.py: ``DivPrune`` L152-172, its call L352-383; first read from verbatim
copies of that function in third-party code, ModelTC/llmc's token-reduction module among others):
distance ``1 - pairwise_cosine_similarity``, first ``topk(m, 2, dim=0, largest=False).values[1]``,
then ``min`` over the selected rows, ``argmax``, ``threshold_terms = int(round(ratio * N))``:

- It acts on the projector's output, before the LLM (the image features that the LLM's layer 0
  would receive), per image: ``N`` visual tokens ``x_i``.
- **Distance**: ``d(i, j) = 1 - cos(x_i, x_j)`` over every pair (``N x N``).
- **Greedy Max-Min** (MMDP): the first token is the one whose nearest other token is farthest
  (``max_i min_{j != i} d(i, j)``); then, ``keep - 1`` times, the token whose minimum distance
  to the selected set is largest.
- The kept tokens stay in **image order**; nothing is merged.
- **Count**: ``SUBSET_RATIO`` of the tokens, ``round(ratio * N)``; the README's script sets
  0.098 (56 of 576 tokens, "TFLOP 15 %"). `--keep N` keeps ``N`` per image (crop, frame); the
  192 / 128 / 64 rows of the literature are those counts (ratio 0.333 / 0.222 / 0.111).

Departures: a selected token is masked out explicitly instead of relying on its zero distance to
itself (floating-point ``1 - cos(x, x)`` can be a hair above 0); the first step excludes the
diagonal by masking it rather than by taking the second-smallest entry (the same on any input
without exact duplicates; with duplicates the official second-smallest is 0 as well). Ties go to
the lowest index (``argmax``). The matrix runs in float32 at least.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ficoco.errors import FicocoError
from ficoco.methods.inputs import TowerInput, TowerOutput
from ficoco.methods.ops import compute_dtype, gather_tokens

__all__ = ["cosine_distance", "divprune_reduce", "divprune_select", "max_min_select", "tower_step"]


def cosine_distance(features: Tensor) -> Tensor:
    """``(B, N, N)`` ``1 - cos`` between every pair of the ``(B, N, D)`` tokens (float32 at least)."""
    unit = F.normalize(features.to(compute_dtype(features.dtype)), dim=-1)
    return 1 - unit @ unit.transpose(1, 2)


def max_min_select(distance: Tensor, keep: int) -> Tensor:
    """``(B, keep)`` the greedy Max-Min selection on a ``(B, N, N)`` distance matrix, in the order
    chosen: first the token farthest from its nearest neighbour, then each time the token farthest
    from the selected set (its minimum distance to it). One loop over the ``keep`` picks, batched."""
    batch, tokens, _ = distance.shape
    rows = torch.arange(batch, device=distance.device)
    eye = torch.eye(tokens, dtype=torch.bool, device=distance.device)
    inf = torch.tensor(float("inf"), dtype=distance.dtype, device=distance.device)
    # Nearest-neighbour distance of every token, itself left out.
    nearest = torch.where(eye, inf, distance).min(dim=1).values
    chosen = torch.empty(batch, keep, dtype=torch.long, device=distance.device)
    selected = torch.zeros(batch, tokens, dtype=torch.bool, device=distance.device)
    first = nearest.argmax(dim=1)
    chosen[:, 0] = first
    selected[rows, first] = True
    to_set = distance[rows, first]  # (B, N) minimum distance to the selected set
    for step in range(1, keep):
        pick = torch.where(selected, -inf, to_set).argmax(dim=1)
        chosen[:, step] = pick
        selected[rows, pick] = True
        to_set = torch.minimum(to_set, distance[rows, pick])
    return chosen


def divprune_select(features: Tensor, keep: int) -> Tensor:
    """``(B, keep)`` indices (ascending: image order) of the tokens DivPrune keeps of ``(B, N, D)``."""
    if not 1 <= keep <= features.shape[1]:
        raise FicocoError(f"DivPrune keeps 1..{features.shape[1]} tokens per item, got {keep}")
    return max_min_select(cosine_distance(features), keep).sort(dim=1).values


def divprune_reduce(features: Tensor, keep: int) -> tuple[Tensor, Tensor]:
    """``(features (B, keep, D), kept (B, keep))``: the diverse subset, in image order; ``keep == N``
    returns the input unchanged (every token is selected)."""
    if keep == features.shape[1]:
        kept = torch.arange(keep, device=features.device).expand(features.shape[0], -1)
        return features, kept
    kept = divprune_select(features, keep)
    return gather_tokens(features, kept), kept


def tower_step(inputs: TowerInput, settings: Mapping[str, Any]) -> TowerOutput:
    """The adapters' call after the projector: ``inputs.hidden`` is the projector's output for every
    patch of every item; ``remove`` of them leave."""
    features, kept = divprune_reduce(inputs.hidden, inputs.hidden.shape[1] - inputs.remove)
    return TowerOutput(hidden=features, kept=kept)
