"""MustDrop (docs/methods/mustdrop.md): merge the spatially uniform 3 x 3 windows of CLIP layer 0's output, keep
the patches CLIP's last layer's [CLS] attends to most as a key set, and inside the LLM drop, after layers 2, 6,
10 and 14, the visual tokens the text attends to little, by a global and an individual threshold.

This module is its two specs (the part in the tower, and its `inner` part in the decoder), its defaults (the
official code's) and its schedule arithmetic; no torch. Its tensor functions are in `ops`.

Official code: liuting20/MustDrop @ 909afa5 (SparseVLM-derived):
llava/model/multimodal_encoder/clip_encoder.py:86-112 (where the tower acts), multimodal_encoder/local_merge.py:30-146
(the window merge), language_model/modelling_sparse_llama.py:103 (the layers), :235-266 (the LLM step), :336-350
(the dual-attention filter); scripts/v1_5/eval/textvqa_{192,128,64}.sh and vizwiz_64.sh (the thresholds).

Every count is the input's own: how many windows are uniform enough to merge, how many visual tokens the text
attends to too little. There is no token budget. ``--preset 192|128|64`` (and ``--keep`` of those rows) names the
thresholds the official TextVQA scripts give those rows; the plan then assumes counts (no window merged, the row's
count after the first pruning layer), which a run replaces with what it measured (`content_counts`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from ficoco.errors import FicocoError
from ficoco.methods.base import ExtraMacs, MethodSpec, Need, Step, StepContext
from ficoco.methods.reads import DEFAULT_ATTENTION_SCORES, SCORES_CORRECTION

WINDOW = 3  # conditional_pooling(hidden_states, 0.8, (3, 3)): the windows' side in patches (clip_encoder.py:111)
WINDOW_THRESHOLD = 0.8  # ... a window merges when its mean pairwise cosine is at least this
MERGE_LAYER = 1  # the merge acts on tower layer 0's output (`idx == 0`, clip_encoder.py:110): layer 1's input
KEY_RATIO = 0.08  # self.keep_rate (clip_encoder.py:102): ceil(0.08 (N - 1)) patches form the key set
LAYERS = (2, 6, 10, 14)  # self.pruning_layers (modelling_sparse_llama.py:103): their output is filtered
# model_vqa_loader.py:157-158's defaults: with them the filter drops nothing (max < 0 never holds).
GLOBAL_THR = 1.0
INDIVIDUAL_THR = 0.0
# scripts/v1_5/eval/textvqa_{192,128,64}.sh: (global_thr, individual_thr) of the TextVQA rows. Other benchmarks
# have their own (vizwiz_64.sh: 0.005 / 0.001), given as hyperparameters.
TEXTVQA_THRESHOLDS = {192: (0.001, 0.001), 128: (0.0012, 0.001), 64: (0.011, 0.01)}
# How many windows each item merges: "batch", the official `.min()` over the tower call's items
# (local_merge.py:79), which couples the images of a batch; "item" (ficoco's correction): each item its own
# count, a call whose items differ refused in one line (their tokens stay one rectangular batch).
WINDOW_COUNT = "batch"
WINDOW_COUNTS = ("batch", "item")
CORRECTIONS = {"window_count": {"item": "per-image window count"}, **SCORES_CORRECTION}

FAMILIES = ("llava",)
# Why the other families do not run it (MethodSpec.refusals; `ficoco methods --matrix` prints them).
NEXT_REFUSAL = ("not wired: the official code lays a LLaVA-NeXT image's crops out flat (llava_arch.py:347 forces "
                "mm_patch_merge_type='flat': no unpadding, no newline tokens) with one window count for all crops, "
                "while ficoco's LLaVA-NeXT adapter packs the crops by grid place, which merged windows do not have")
VIDEO_LLAVA_REFUSAL = ("LanguageBind's 224-pixel towers give every image and frame a 16 x 16 patch grid, which "
                       "3 x 3 windows do not tile (the official conditional_pooling asserts a side divisible by 3)")
NO_CLS_REFUSAL = ("its tower has no [CLS], whose attention row at the last tower layer chooses MustDrop's key set; "
                  "a key set by another score would be another method")
QWEN_REFUSAL = ("Qwen's packed tower has no [CLS] (the key set's score) and is read by 2 x 2 merge groups, "
                "which 3 x 3 patch windows split; MustDrop would need a redesign of its tower stage there")
INTERNVL_REFUSAL = ("InternViT's 32 x 32 tile grid does not split into 3 x 3 windows, and its pixel shuffle folds "
                    "2 x 2 patches into one LLM token after the tower, which merged windows would not keep")
REFUSALS = {"llava_next": NEXT_REFUSAL, "video_llava": VIDEO_LLAVA_REFUSAL, "llava_onevision": NO_CLS_REFUSAL,
            **dict.fromkeys(("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5"), QWEN_REFUSAL),
            "internvl": INTERNVL_REFUSAL}


def window_grid(n_visual: int, window: int = WINDOW) -> int:
    """The side of an item's square patch grid that `window` x `window` windows tile; refused in one line where
    the grid is not square or its side not a multiple of `window` (local_merge.py:47 asserts both)."""
    side = math.isqrt(n_visual)
    if side * side != n_visual or side % window:
        raise FicocoError(f"MustDrop merges {window} x {window} windows of a square patch grid whose side {window} "
                          f"divides (local_merge.py:47); this tower's items have {n_visual} patches"
                          + (f" ({side} x {side})" if side * side == n_visual else ""))
    return side


def key_set_size(patches: int, ratio: float = KEY_RATIO) -> int:
    """Patches of the key set: ``ceil(ratio (N - 1))`` of the last tower layer's N tokens ([CLS] and the
    ``patches`` the merge left; clip_encoder.py:104), at most every patch."""
    return min(patches, math.ceil(ratio * patches))


def check_settings(hp: Mapping[str, Any]) -> None:
    """Refuse thresholds, ratios, layers or a window count the official code does not take, in one line."""
    for name in ("global_thr", "individual_thr"):
        value = hp[name]
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
            raise FicocoError(f"MustDrop {name}={value!r}: give a number >= 0 (a share of the text's attention)")
    threshold = hp["window_threshold"]
    if isinstance(threshold, bool) or not isinstance(threshold, int | float) or not -1 <= threshold <= 1:
        raise FicocoError(f"MustDrop window_threshold={threshold!r}: give a cosine in [-1, 1]")
    ratio = hp["key_ratio"]
    if isinstance(ratio, bool) or not isinstance(ratio, int | float) or not 0 <= ratio <= 1:
        raise FicocoError(f"MustDrop key_ratio={ratio!r}: give a share of the patches in [0, 1]")
    layers = hp["layers"]
    if not isinstance(layers, list | tuple) or any(isinstance(v, bool) or not isinstance(v, int) or v < 0
                                                  for v in layers) or list(layers) != sorted(set(layers)):
        raise FicocoError(f"MustDrop layers={layers!r}: give increasing decoder layers, e.g. 2,6,10,14")
    if hp["window_count"] not in WINDOW_COUNTS:
        raise FicocoError(f"MustDrop window_count={hp['window_count']!r}: give 'batch' (the official code's) or "
                          "'item' (ficoco: per-image window count)")


def settings_for_keep(keep: int | None, n_visual: int, n_layers: int, hp: Mapping[str, Any]) -> dict[str, Any]:
    """The thresholds of the literature's `keep` row as the official TextVQA scripts give them (192, 128, 64);
    None: the hyperparameters' (the official defaults drop nothing in the LLM). The counts are the input's own:
    the plan assumes no window merged and, for a row, its count of visual tokens after the first pruning layer
    (the run measures them)."""
    window_grid(n_visual)
    check_settings(hp)
    if n_layers <= MERGE_LAYER:
        raise FicocoError(f"MustDrop merges at tower layer {MERGE_LAYER}'s input; this tower's projector reads "
                          f"layer {n_layers - 1}")
    thresholds = (hp["global_thr"], hp["individual_thr"])
    assumed = None
    if keep is not None:
        if keep not in TEXTVQA_THRESHOLDS:
            rows = ", ".join(map(str, TEXTVQA_THRESHOLDS))
            raise FicocoError(f"MustDrop's thresholds are published for TextVQA's {rows}-token rows; keep={keep} "
                              "has none (its counts follow the thresholds: give global_thr= and "
                              "individual_thr= for another setting)")
        if thresholds != (GLOBAL_THR, INDIVIDUAL_THR):
            raise FicocoError(f"keep={keep} sets MustDrop's thresholds (TextVQA's row); give either the row or "
                              "global_thr= and individual_thr=, not both")
        thresholds, assumed = TEXTVQA_THRESHOLDS[keep], min(keep, n_visual)
    return {"adaptive": True, "window_threshold": hp["window_threshold"], "key_ratio": hp["key_ratio"],
            "layers": list(hp["layers"]), "global_thr": thresholds[0], "individual_thr": thresholds[1],
            "window_count": hp["window_count"], "assumed_kept": assumed}


def steps(settings: Mapping[str, Any], n_visual: int, n_layers: int) -> tuple[Step, ...]:
    """The window merge at tower layer 1's input (planned at no window merged: the count is the image's) and the
    key set's cut at the tower's output, which removes nothing and hands the key set to the decoder's part."""
    window_grid(n_visual)
    return (Step(MERGE_LAYER, 0, 0, "layer_input", "vision"), Step(n_layers - 1, 0, 0, "tower_output", "vision"))


def inner_steps(settings: Mapping[str, Any], n_visual: int, n_layers: int) -> tuple[Step, ...]:
    """One step at the input of the layer after every pruning layer the decoder has (the output of its last layer
    changes nothing); planned at the settings' assumed count after the first (None: nothing dropped)."""
    found = []
    assumed = settings.get("assumed_kept")
    for layer in settings["layers"]:
        if layer + 1 >= n_layers:
            break
        remove = n_visual - assumed if assumed is not None and not found and assumed < n_visual else 0
        found.append(Step(layer + 1, remove))
    return tuple(found)


def extra_macs(ctx: StepContext) -> ExtraMacs:
    """The windows' pairwise cosines (every window's 9 x 9 dot products of its normalised tokens, tower-wide), and
    the last tower layer's [CLS] row (its query against every key of every head)."""
    d = ctx.dims
    if ctx.step.where == "layer_input":
        area = WINDOW * WINDOW
        windows = ctx.visual_before // area
        return [(ctx.step.layer, "mustdrop_window_cosines", windows * area * area * d.hidden)]
    return [(ctx.step.layer, "mustdrop_key_set_cls_row", d.heads * d.head_dim * ctx.seq_before)]


def inner_extra_macs(ctx: StepContext) -> ExtraMacs:
    """The pruning layer's text rows: every token after the visual span against every key, every head (the
    softmax's normaliser needs all keys; the filter reads their visual columns)."""
    d = ctx.dims
    return [(ctx.step.layer - 1, "mustdrop_text_rows", ctx.suffix_tokens * ctx.seq_before * d.heads * d.head_dim)]


INNER = MethodSpec(
    name="mustdrop", title="MustDrop", acts_at="llm_layer", placement="layer_input", positions="compact",
    needs=(Need("attention_rows", "L-1", "suffix", "softmax over all keys of the pruning layer, head mean, for every "
                "text token after the visual span (its visual columns are the filter's attention)"),
           Need("hidden", "L", "all", "the output of the pruning layer (the input of the next)")),
    hyperparameters={"layers": LAYERS, "global_thr": GLOBAL_THR, "individual_thr": INDIVIDUAL_THR},
    families=FAMILIES, module=f"{__name__}.ops", function="step",
    source="liuting20/MustDrop 909afa5 (llava/model/language_model/modelling_sparse_llama.py)",
    summary="drop the visual tokens whose text attention is small in sum and in every row, the key set kept",
    keep_means="the TextVQA thresholds of the literature's row (192, 128, 64); counts measured at run time",
    steps=inner_steps, extra_macs=inner_extra_macs, wired=True, content_counts=True,
)

SPEC = MethodSpec(
    name="mustdrop", title="MustDrop", acts_at="vision_layer", placement="tower_output", positions="grid",
    needs=(Need("hidden", "vision L", "all", "tower layer 0's output (layer 1's input): the window merge; the "
                "projector's input at the key set's cut"),
           Need("query_key", "vision last", "cls", "the last tower layer's keys and [CLS] query: its [CLS] row, head "
                "mean, chooses the key set")),
    hyperparameters={"window_threshold": WINDOW_THRESHOLD, "key_ratio": KEY_RATIO, "layers": LAYERS,
                     "global_thr": GLOBAL_THR, "individual_thr": INDIVIDUAL_THR, "window_count": WINDOW_COUNT,
                     "attention_scores": DEFAULT_ATTENTION_SCORES},
    corrections=CORRECTIONS,
    families=FAMILIES, module=f"{__name__}.ops", function="tower_step", refusals=REFUSALS,
    source="liuting20/MustDrop 909afa5 (llava/model/multimodal_encoder/clip_encoder.py, local_merge.py, "
           "language_model/modelling_sparse_llama.py; scripts/v1_5/eval)",
    summary="merge the uniform 3x3 windows of CLIP layer 0, keep a key set by the last layer's [CLS] row, and "
            "drop the visual tokens the text attends to little after decoder layers 2/6/10/14",
    keep_means="the thresholds the official TextVQA scripts give the literature's row (192, 128, 64); every count "
               "is the input's own: planned at an assumption (no window merged, the row's count after the first "
               "pruning layer), measured at run time",
    keep_choices=tuple(sorted(TEXTVQA_THRESHOLDS)),
    steps=steps, settings_for_keep=settings_for_keep, extra_macs=extra_macs, wired=True, inner=INNER,
    content_counts=True,
)
