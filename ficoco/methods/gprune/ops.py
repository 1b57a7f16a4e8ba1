"""G-Prune (AAAI 2025, jytmelon/G-Prune 762c637, LLaVA-NeXT/llava/model/llava_arch.py:239-290): information
flow on a similarity graph of the projected visual tokens.

What the official code does, per part (LLaVA-NeXT's base view, 576 tokens, and its unpadded crop grid
without the newline tokens, each a graph of its own; :246-260):

1. **Graph** (:259-270): ``A = x̂ x̂ᵀ`` the cosine similarity of the L2-normalised projected features;
   entries ``< similarity`` (0.5) set to 0; ``A / temperature`` (0.03); entries whose magnitude is below
   ``1e-6`` (those set to 0) set to -5000; a softmax over every row.
2. **Degree** (:271-272): the entries of each row of the softmaxed graph that are ``> 0``.
3. **Propagation** (:273-274): ``torch.matrix_power(A, iterate_num)``, ``iterate_num`` 5.
4. **Score** (:275-280): the features' L2 norms as a row vector times ``A^n``, each column divided by the
   degree of the row of the same index (the column's node): ``s_j = Σ_i ‖x_i‖ (A^n)_ij / deg_j``.
5. **Keep** (:281-288): the ``int(keep_ratio * N)`` highest scores (``topk``) of every part; the newline
   tokens always; the union sorted into the span's order.

The adapters hand each part as one item (an image, a crop grid, a tile, a frame; ficoco.models), so the
functions here see one graph per batch row and return its kept tokens in order.

Departures: the graph runs in float32 at least (the official code in the model's dtype, float16 on
its GPU); ties among equal scores go to the lowest index (``topk`` leaves them open); ``keep == N``
returns the input. The power is computed by the products ``torch.matrix_power`` itself runs
(ATen's ``linalg_matrix_power``: ``A @ A`` for 2, ``(A @ A) @ A`` for 3, then squarings and one
product per set bit, ``A @ A^4`` for 5), written out so that every product is a matrix product the
counters of ``flops --verify`` see; the result is the same computation.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ficoco.errors import FicocoError
from ficoco.methods.gprune import ITERATIONS, SIMILARITY, TEMPERATURE
from ficoco.methods.inputs import TowerInput, TowerOutput
from ficoco.methods.ops import compute_dtype, gather_tokens, top_indices

__all__ = ["flow_scores", "gprune_reduce", "gprune_select", "matrix_power", "similarity_graph", "tower_step"]

# The official code's stand-in for "no edge" after the temperature (:267-268): exp() of it is 0.
NO_EDGE = -5000.0
# Entries the official code takes for zero after the temperature (:267-268).
ZERO = 1e-6


def similarity_graph(features: Tensor, similarity: float = SIMILARITY, temperature: float = TEMPERATURE
                     ) -> tuple[Tensor, Tensor]:
    """``(B, N, N)`` the row-softmaxed similarity graph of the ``(B, N, D)`` tokens and ``(B, N)`` the degree
    of every node (its row's entries above zero), as the official code builds them (float32 at least)."""
    unit = F.normalize(features.to(compute_dtype(features.dtype)), p=2, dim=-1)
    graph = unit @ unit.transpose(1, 2)
    graph = torch.where(graph < similarity, torch.zeros_like(graph), graph) / temperature
    graph = torch.where(graph.abs() < ZERO, torch.full_like(graph, NO_EDGE), graph)
    graph = torch.softmax(graph, dim=-1)
    return graph, (graph > 0).sum(dim=-1)


def matrix_power(matrix: Tensor, n: int) -> Tensor:
    """``matrix ** n`` (batched) by the products ATen's ``linalg_matrix_power`` runs, in its order."""
    if n < 0:
        raise FicocoError(f"G-Prune's iterations must be 0 or more, not {n}")
    if n == 0:
        return torch.eye(matrix.shape[-1], dtype=matrix.dtype, device=matrix.device).expand_as(matrix)
    if n == 1:
        return matrix
    if n == 2:
        return matrix @ matrix
    if n == 3:
        return (matrix @ matrix) @ matrix
    # From the least significant bit: square the running power, multiply it in where the bit is set.
    power: Tensor | None = None
    result: Tensor | None = None
    while n > 0:
        bit, n = n % 2, n // 2
        power = matrix if power is None else power @ power
        if bit:
            result = power if result is None else result @ power
    assert result is not None
    return result


def flow_scores(features: Tensor, similarity: float = SIMILARITY, temperature: float = TEMPERATURE,
                iterations: int = ITERATIONS) -> Tensor:
    """``(B, N)`` every token's information flow: the norms' row vector times the graph's power, over the
    degree of the token's own node."""
    graph, degree = similarity_graph(features, similarity, temperature)
    flow = matrix_power(graph, iterations)
    norms = torch.linalg.vector_norm(features.to(flow.dtype), dim=-1).unsqueeze(1)  # (B, 1, N)
    return (norms @ flow).squeeze(1) / degree


def gprune_select(features: Tensor, keep: int, similarity: float = SIMILARITY, temperature: float = TEMPERATURE,
                  iterations: int = ITERATIONS) -> Tensor:
    """``(B, keep)`` indices, ascending (the span's order), of the tokens G-Prune keeps of ``(B, N, D)``."""
    if not 1 <= keep <= features.shape[1]:
        raise FicocoError(f"G-Prune keeps 1..{features.shape[1]} tokens per part, got {keep}")
    return top_indices(flow_scores(features, similarity, temperature, iterations), keep)


def gprune_reduce(features: Tensor, keep: int, similarity: float = SIMILARITY, temperature: float = TEMPERATURE,
                  iterations: int = ITERATIONS) -> tuple[Tensor, Tensor]:
    """``(features (B, keep, D), kept (B, keep))``: the kept tokens in their order; ``keep == N`` returns
    the input unchanged."""
    if keep == features.shape[1]:
        return features, torch.arange(keep, device=features.device).expand(features.shape[0], -1)
    kept = gprune_select(features, keep, similarity, temperature, iterations)
    return gather_tokens(features, kept), kept


def tower_step(inputs: TowerInput, settings: Mapping[str, Any]) -> TowerOutput:
    """The adapters' call after the projector: ``inputs.hidden`` is one part per row (an image's, a crop
    grid's, a tile's or a frame's projected tokens); ``remove`` of them leave."""
    features, kept = gprune_reduce(inputs.hidden, inputs.hidden.shape[1] - inputs.remove,
                                   settings.get("similarity", SIMILARITY), settings.get("temperature", TEMPERATURE),
                                   settings.get("iterations", ITERATIONS))
    return TowerOutput(hidden=features, kept=kept)
