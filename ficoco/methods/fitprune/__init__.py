"""FitPrune (docs/methods/fitprune.md; arXiv 2409.10197): inside many decoder layers, prefill only, delete the
visual tokens whose product of cross-attention (from the text after the image) and self-attention (from the
visual tokens), both of the layer's head-max attention, is lowest; how many at each layer is a per-layer
count fitted offline to a FLOPs target.

Official code: ywh187/FitPrune at d28e418, LLaVA_1.5/llava/model/language_model/modeling_llama.py: the rule
at :392-405 (attention output rows cut before o_proj) and :495-499 (the residual cut), position ids sliced
at :812; the per-layer counts ("delete schemes") hard-coded per ``reduction_ratio`` at :357-391, fitted by
llava/eval/statistical_analysis.py for LLaVA-1.5-7B (32 layers, 576 visual tokens).

This module is its spec, the published schemes (the documented table of its calibration) and the rule ficoco
uses to scale them to other decoders; no torch. Its tensor functions are in `ops`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ficoco.errors import FicocoError
from ficoco.methods.base import FULL_ATTENTION_LAYERS, MethodSpec, Need, Step
from ficoco.methods.common import ALL_FAMILIES
from ficoco.methods.reads import DEFAULT_ATTENTION_SCORES, SCORES_CORRECTION, ReadContext, ReadShape, causal_tiles

SOURCE = "ywh187/FitPrune d28e418 (LLaVA_1.5/)"

# modeling_llama.py:357-391: `delete_scheme` per `--reduction_ratio`, the visual tokens deleted inside each of the 32
# decoder layers of LLaVA-1.5-7B (576 visual tokens), layer 0 first. The ratio is the share of the visual tokens'
# FLOPs the scheme saves (statistical_analysis.py:141 fits it so), in per cent.
PUBLISHED_SCHEMES: dict[int, tuple[int, ...]] = {
    0: (0,) * 32,
    10: (0, 0, 1, 2, 1, 0, 1, 4, 5, 5, 11, 4, 2, 2, 0, 0, 1, 1, 2, 4, 2, 10, 1, 1, 1, 2, 1, 1, 0, 1, 0, 0),
    20: (0, 0, 3, 3, 1, 1, 4, 16, 14, 15, 24, 4, 2, 3, 2, 0, 6, 0, 5, 13, 4, 19, 2, 1, 1, 1, 1, 1, 2, 1, 0, 0),
    30: (0, 0, 7, 6, 4, 5, 16, 40, 24, 21, 24, 4, 2, 3, 4, 0, 16, 0, 11, 26, 6, 32, 3, 1, 0, 1, 2, 2, 4, 0, 0, 0),
    40: (0, 1, 21, 13, 14, 11, 41, 53, 29, 15, 14, 5, 1, 4, 5, 1, 26, 1, 13, 28, 6, 27, 2, 1, 0, 0, 1, 1, 2, 0, 0,
         0),
    50: (3, 7, 49, 24, 29, 17, 59, 41, 26, 8, 10, 6, 2, 5, 7, 2, 30, 3, 13, 27, 5, 23, 2, 1, 0, 0, 1, 1, 2, 0, 0,
         0),
    55: (6, 17, 69, 31, 34, 19, 59, 30, 23, 6, 8, 7, 2, 5, 8, 2, 29, 4, 12, 25, 4, 19, 2, 1, 0, 0, 1, 0, 1, 0, 0,
         0),
    60: (14, 33, 89, 36, 36, 20, 55, 21, 18, 4, 7, 5, 2, 5, 7, 4, 26, 5, 11, 24, 4, 18, 2, 1, 0, 0, 1, 0, 1, 0, 0,
         0),
    70: (48, 79, 118, 41, 33, 17, 36, 9, 9, 2, 3, 2, 1, 3, 4, 8, 18, 7, 8, 20, 4, 13, 2, 1, 0, 0, 1, 0, 1, 0, 0,
         0),
    80: (128, 127, 118, 35, 26, 8, 13, 3, 2, 1, 0, 0, 0, 2, 1, 8, 7, 8, 5, 11, 2, 6, 1, 1, 0, 0, 0, 1, 0, 0, 0,
         0),
    90: (262, 153, 80, 19, 13, 1, 2, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 2, 1, 2, 0, 1, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0),
}
# The shape the published schemes were fitted on: LLaVA-1.5-7B's 576 visual tokens and 32 decoder layers.
PUBLISHED_VISUAL, PUBLISHED_LAYERS = 576, 32
# The official scripts' setting (scripts/v1_5/eval/textvqa.sh:10, the README's example; model_vqa_loader.py:145's
# argument default 0 deletes nothing).
REDUCTION_RATIO = 60
# Which per-layer counts run: "published" (the official dict of the ratio; on LLaVA-1.5-7B's shape only) or
# "scaled" (ficoco's: the published scheme's cumulative deletions scaled to another decoder's layers and visual
# tokens, `scaled_scheme`; labelled wherever it runs, and what runs on every other shape).
SCHEME = "published"
SCHEMES = ("published", "scaled")
SCHEME_CORRECTION = {"scheme": {"scaled": "scheme scaled from LLaVA-1.5-7B's"}}

# `--keep N` / `--preset N`: the row of a published scheme. The literature's 192 / 128 / 64 rows are the ratios 70 /
# 80 / 90 (their layer-average visual tokens on LLaVA-1.5-7B: 187.9 / 130.6 / 72.8, their visual-token MACs 1.156 /
# 0.775 / 0.394 T against 1.25 / 0.83 / 0.42 T of 192 / 128 / 64 tokens in every layer); every other published ratio
# by its layer average there, rounded (244.97, 274.38, 301.81, 362.47, 423.53, 492.53, 541.16, 576).
KEEP_ROWS: dict[int, int] = {64: 90, 128: 80, 192: 70, 245: 60, 274: 55, 302: 50, 362: 40, 424: 30, 493: 20,
                             541: 10, 576: 0}


def layer_average(counts: Sequence[int], n_visual: int) -> float:
    """The visual tokens each layer attends over (before its own deletion), averaged over the layers."""
    total, current = 0, n_visual
    for count in counts:
        total += current
        current -= count
    return total / len(counts)


def _round_half_up(numerator: int, denominator: int) -> int:
    return (2 * numerator + denominator) // (2 * denominator)


def scaled_scheme(ratio: int, n_visual: int, n_layers: int,
                  full_layers: Sequence[int] | None = None) -> tuple[int, ...]:
    """ficoco's scheme of `ratio` on a decoder of `n_layers` layers and `n_visual` visual tokens per image: the
    published scheme's cumulative deletions as a function of depth (0 before layer 0, its total after layer 31,
    linear within a layer), read at the end of every layer's share of the depth and scaled to `n_visual`, rounded
    half up; a layer's count is the difference. On LLaVA-1.5-7B's shape this is the published scheme itself.
    `full_layers`: a hybrid decoder's full-attention layers (Qwen3.5), the only ones that may delete: each takes
    the deletions of the layers since the previous one (counts after the last are dropped)."""
    published = PUBLISHED_SCHEMES[ratio]
    cumulative = [0]
    for count in published:
        cumulative.append(cumulative[-1] + count)

    def removed_after(layer: int) -> int:
        # Depth at the end of `layer`, in published layers: (layer + 1) * 32 / n_layers, as a fraction.
        numerator, denominator = (layer + 1) * PUBLISHED_LAYERS, n_layers
        whole, part = divmod(numerator, denominator)
        if whole >= PUBLISHED_LAYERS:
            value_num, value_den = cumulative[-1], 1
        else:
            step = cumulative[whole + 1] - cumulative[whole]
            value_num, value_den = cumulative[whole] * denominator + step * part, denominator
        return _round_half_up(value_num * n_visual, value_den * PUBLISHED_VISUAL)

    allowed = set(range(n_layers)) if full_layers is None else set(full_layers)
    counts, done = [], 0
    for layer in range(n_layers):
        if layer not in allowed:
            counts.append(0)
            continue
        target = removed_after(layer)
        counts.append(target - done)
        done = target
    return tuple(counts)


def scheme_counts(settings: Mapping[str, Any], n_visual: int, n_layers: int) -> tuple[int, ...]:
    """The per-layer counts the settings name: the published scheme of their ``reduction_ratio`` on LLaVA-1.5-7B's
    shape, or ``scheme="scaled"`` (ficoco's) on any."""
    ratio, scheme = settings["reduction_ratio"], settings["scheme"]
    check_ratio(ratio)
    full = settings.get(FULL_ATTENTION_LAYERS)
    if scheme == "published":
        if (n_visual, n_layers) != (PUBLISHED_VISUAL, PUBLISHED_LAYERS) or full is not None:
            shape = "a hybrid decoder, which deletes in its full-attention layers only" if full is not None else \
                f"{n_layers} layers and {n_visual} visual tokens"
            raise FicocoError(f"FitPrune's published schemes are LLaVA-1.5-7B's ({PUBLISHED_LAYERS} layers, "
                              f"{PUBLISHED_VISUAL} visual tokens), not {shape}'s: give scheme='scaled' (ficoco's) "
                              "or schedule=")
        return PUBLISHED_SCHEMES[ratio]
    if scheme != "scaled":
        raise FicocoError(f"FitPrune scheme={scheme!r}: choose from {', '.join(SCHEMES)}")
    return scaled_scheme(ratio, n_visual, n_layers, full)


def check_ratio(ratio: object) -> None:
    """Refuse a reduction ratio with no published scheme."""
    if not isinstance(ratio, int) or isinstance(ratio, bool) or ratio not in PUBLISHED_SCHEMES:
        raise FicocoError(f"FitPrune reduction_ratio={ratio!r}: its schemes are published for "
                          f"{', '.join(map(str, PUBLISHED_SCHEMES))} (per cent of the visual tokens' FLOPs); "
                          "schedule= gives any per-layer counts")


def steps(settings: Mapping[str, Any], n_visual: int, n_layers: int) -> tuple[Step, ...]:
    """One in-layer step at every layer whose count is not 0 (a layer that deletes nothing reads nothing)."""
    counts = scheme_counts(settings, n_visual, n_layers)
    left = n_visual
    found = []
    for layer, count in enumerate(counts):
        if not count:
            continue
        if count >= left:
            raise FicocoError(f"FitPrune's scheme deletes {count} of the {left} visual tokens left at layer {layer}; "
                              "at least one must stay")
        found.append(Step(layer, count, 0, "in_layer", "llm"))
        left -= count
    return tuple(found)


def settings_for_keep(keep: int | None, n_visual: int, n_layers: int, hp: Mapping[str, Any]) -> dict[str, Any]:
    """The scheme of the row `keep` (KEEP_ROWS; None: the `reduction_ratio` hyperparameter, the scripts' 60): the
    published one on LLaVA-1.5-7B's shape, ficoco's scaled one on any other (labelled: scheme="scaled")."""
    if keep is None:
        ratio = hp["reduction_ratio"]
    elif keep in KEEP_ROWS:
        ratio = KEEP_ROWS[keep]
    else:
        raise FicocoError(f"FitPrune's published schemes are the rows {', '.join(map(str, sorted(KEEP_ROWS)))} "
                          f"(reduction_ratio {', '.join(str(KEEP_ROWS[k]) for k in sorted(KEEP_ROWS))}); keep={keep} "
                          "is none of them (schedule= gives any per-layer counts)")
    check_ratio(ratio)
    scheme = hp["scheme"]
    if scheme not in SCHEMES:
        raise FicocoError(f"FitPrune scheme={scheme!r}: choose from {', '.join(SCHEMES)}")
    if (n_visual, n_layers) != (PUBLISHED_VISUAL, PUBLISHED_LAYERS):
        # No published scheme exists for this decoder: ficoco's, whatever `scheme` asked, and labelled so.
        scheme = "scaled"
    return {"reduction_ratio": ratio, "scheme": scheme}


def reads(ctx: ReadContext) -> tuple[ReadShape, ...]:
    """What one deleting layer reads of its attention (ficoco.methods.fitprune.ops): the head-max of the visual
    rows and of the text rows after the image, over the keys each tile of them can see under the causal mask
    (the method keeps the visual columns)."""
    prefix = ctx.tokens - ctx.visual_before - ctx.suffix_tokens
    visual = causal_tiles(ctx.visual_before, prefix + ctx.visual_before - 1, ctx.tokens, ctx.tokens)
    text = causal_tiles(ctx.suffix_tokens, ctx.tokens - 1, ctx.tokens, ctx.tokens)
    return tuple(("rows", r1 - r0, keys) for r0, r1, keys in visual + text)


SPEC = MethodSpec(
    name="fitprune", title="FitPrune", acts_at="llm_layer", placement="in_layer", positions="original",
    needs=(Need("attention_rows", "L", "visual+suffix", "the deleting layer's own probabilities, max over heads, "
                "of the visual rows and the text rows after the image, at the visual columns", heads="max"),
           Need("hidden", "L", "all", "after the attention residual, before the MLP (the official cut of the "
                "attention output before o_proj and of the residual, o_proj being row-wise)")),
    hyperparameters={"reduction_ratio": REDUCTION_RATIO, "scheme": SCHEME,
                     "attention_scores": DEFAULT_ATTENTION_SCORES},
    corrections={**SCORES_CORRECTION, **SCHEME_CORRECTION},
    families=ALL_FAMILIES, module=f"{__name__}.ops", function="fitprune_reduce",
    source=SOURCE,
    summary="delete the visual tokens of lowest text x visual head-max attention, per-layer counts fitted offline",
    keep_means="a published scheme's row: 192/128/64 -> reduction_ratio 70/80/90; 245..576 -> 60..0 (their "
               "layer-average visual tokens on LLaVA-1.5-7B)",
    keep_choices=tuple(sorted(KEEP_ROWS)),
    # No `extra_macs`: its own work adds no matrix product (the head-max, the sums of the head-max block over the
    # visual and text rows, their product, the sort of the visual tokens' scores and the gather of the kept rows are
    # elementwise), which `flops --verify` checks as a "method" stage of zero; the score products it reads are its
    # `reads`, priced and verified apart.
    steps=steps, settings_for_keep=settings_for_keep, reads=reads, wired=True,
)
