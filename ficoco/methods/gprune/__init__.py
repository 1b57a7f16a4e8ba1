"""G-Prune (docs/methods/gprune.md): after the projector, keep the projected tokens that the most
information flows to on a similarity graph of the image's tokens, at their original position ids.

This module is its spec, its defaults (the official code's, hard-coded at llava_arch.py:239-243 of
jytmelon/G-Prune 762c637, LLaVA-NeXT/) and its schedule arithmetic; no torch. Its tensor functions
are in `ops`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ficoco.methods.base import ExtraMacs, MethodSpec, Need, StepContext
from ficoco.methods.common import ALL_FAMILIES, PER_ITEM, check_keep, cut_steps

# The official defaults (llava_arch.py:240-243), edited in place there ("modify line 239", README).
KEEP_RATIO = 0.5  # keep_ratio: the share of every part's tokens kept, int(keep_ratio * N)
SIMILARITY = 0.5  # similarity: cosine similarities below it leave the graph (set to 0)
TEMPERATURE = 0.03  # temperature: the graph's logits are the similarities divided by it
ITERATIONS = 5  # iterate_num: the propagation is the iterate_num-th power of the row-softmaxed graph

steps = cut_steps("G-Prune", "after_projector")


def settings_for_keep(keep: int | None, n_visual: int, n_layers: int, hp: Mapping[str, Any]) -> dict[str, Any]:
    """`keep` tokens per item; None: the official ``int(keep_ratio * N)`` (llava_arch.py:281), 288 of 576.
    The graph's settings ride along."""
    if keep is None:
        keep = max(1, int(hp["keep_ratio"] * n_visual))
    check_keep("G-Prune", keep, n_visual)
    return {"keep": keep, "similarity": hp["similarity"], "temperature": hp["temperature"],
            "iterations": hp["iterations"]}


def power_products(iterations: int) -> int:
    """Matrix products `torch.matrix_power(A, n)` runs (ATen's `linalg_matrix_power`, which ops mirrors):
    none for n <= 1, A @ A for 2, (A @ A) @ A for 3, then one squaring per further bit of n and one product
    per further set bit (n = 5: A^2, A^4, A @ A^4)."""
    if iterations <= 1:
        return 0
    if iterations <= 3:
        return iterations - 1
    return (iterations.bit_length() - 1) + (bin(iterations).count("1") - 1)


def part_macs(tokens: int, width: int, iterations: int) -> tuple[int, int, int]:
    """(similarity, propagation, score) multiply-accumulates of the graph of one part of `tokens` tokens of
    `width` channels: the N^2 D cosine matrix, the powers' N^3 products, the norms' row times A^n."""
    return tokens * tokens * width, power_products(iterations) * tokens**3, tokens * tokens


def extra_macs(ctx: StepContext) -> ExtraMacs:
    """Per sample (``extra_per_sample``): one graph per part. An AnyRes image (LLaVA-NeXT, LLaVA-OneVision:
    ``anyres_crops`` > 0) has two parts, its base view and its whole crop grid (``crops`` times the tokens);
    every other item (an image, a tile, a frame) is a part of its own."""
    tokens, layer, iterations = ctx.visual_before, ctx.step.layer, ctx.settings["iterations"]
    parts = [(tokens, 1), (tokens * ctx.anyres_crops, 1)] if ctx.anyres_crops else [(tokens, ctx.items)]
    totals = [0, 0, 0]
    for size, count in parts:
        for i, macs in enumerate(part_macs(size, ctx.projected_width, iterations)):
            totals[i] += count * macs
    names = ("gprune_projected_similarity", "gprune_graph_propagation", "gprune_flow_scores")
    return [(layer, name, macs) for name, macs in zip(names, totals, strict=True) if macs]


SPEC = MethodSpec(
    name="gprune", title="G-Prune", acts_at="after_projector", placement="after_projector",
    positions="original",
    needs=(Need("hidden", "projector", "all", "the projector's output, every patch"),),
    hyperparameters={"keep_ratio": KEEP_RATIO, "similarity": SIMILARITY, "temperature": TEMPERATURE,
                     "iterations": ITERATIONS},
    families=ALL_FAMILIES, module=f"{__name__}.ops", function="gprune_reduce",
    source="jytmelon/G-Prune 762c637 (LLaVA-NeXT/llava/model/llava_arch.py:239-290)",
    summary="keep the projected tokens the most information flows to on a thresholded cosine graph "
            "(row softmax, 5th power, norm-weighted, over the node's degree), at their original position ids",
    keep_means=PER_ITEM + " (default: keep_ratio 0.5, 288 of 576); an AnyRes image's crop grid is one part, "
                          "keeping N per crop in all",
    steps=steps, settings_for_keep=settings_for_keep, extra_macs=extra_macs, wired=True,
    extra_per_sample=True, anyres_grid=True,
)
