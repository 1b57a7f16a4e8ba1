"""VScan (docs/methods/vscan.md): before the LLM, keep every item's tokens of a local scan (the most attended
patches of a shallow tower layer, window by window) and a global scan (the most attended of the rest in the layer
the projector reads), in image order, and merge every other token into its most similar kept one; inside the LLM,
at the middle layer, keep the visual tokens the last prompt token attends to most.

This module is its two specs (the cut after the projector, and its `inner` part in the decoder), its defaults (the
official scripts') and its schedule arithmetic; no torch. Its tensor functions are in `ops`.

The official code has two paths, and each family runs one (`code_of`):

- the **LLaVA code** (llava/model/llava_arch.py, modeling_llama_x.py): the scores are [CLS]'s attention row; the
  local scan takes the top ``k`` of every window; stage 2 ranks with RoPE and compacts the positions;
- the **Qwen code** (qwen/model/qwen2_5_vl_custom.py, qwen2_5_vl_utils.py): the scores are what every unit receives
  over every query (column means, the window mask as the layer ran); the local scan is a greedy over the ranking with
  a cap per window; stage 2 ranks without RoPE and keeps the original positions.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from ficoco.errors import FicocoError
from ficoco.methods.base import FULL_ATTENTION_LAYERS, ExtraMacs, MethodSpec, Need, Step, StepContext, TowerLayout
from ficoco.methods.common import ALL_FAMILIES, LAST_ROW, LLAVA_FAMILIES, check_keep
from ficoco.methods.reads import DEFAULT_ATTENTION_SCORES, SCORES_CORRECTION, ReadContext, ReadShape

# ---- the official settings ---------------------------------------------------------------------------------------

# LLaVA-1.5 and LLaVA-NeXT, every released script (scripts/llava1_5/*.sh, scripts/llava1_6/*.sh): --visual_token_num
# 96 of CLIP's 576 patches per image (per crop on NeXT), --layer_list [16] --image_token_list [32] of a 32-layer
# decoder: 96 tokens in layers 0-15, 32 in 16-31, a layer average of 64.
LLAVA_VISUAL_TOKENS, LLAVA_PATCHES = 96, 576
LLAVA_LLM_TOKENS = 32
# Qwen2.5-VL (scripts/qwen2_5_vl/*.sh): --image-token-ratio 0.167 of the image's merged tokens (int()), --layer-list
# [14] --image-token-ratio-list [0.333] of those (int()) in a 28-layer decoder.
QWEN_RATIO = 0.167
QWEN_LLM_RATIO = 0.333
# The rank layer: 16 of LLaVA's 32 decoder layers, 14 of Qwen2.5-VL-7B's 28: the middle layer of both ("auto": the
# decoder's layers // 2; on a hybrid decoder the nearest full-attention layer after its first).
LLM_LAYER = "auto"
# The local scan's layer: attentions[5] of CLIP's 24 layers (llava_arch.py:267), fullatt_block_indexes[0] = 7 of
# Qwen2.5-VL's 32 blocks (qwen2_5_vl_custom.py:342): a quarter of the tower's depth both ("auto", `local_layer_for`).
LOCAL_LAYER = "auto"
# global_ratio (llava_arch.py:270; the Qwen code's num_keep // 2): the local scan takes int(T * (1 - 0.5)).
GLOBAL_RATIO = 0.5
# The local scan's windows: 6 x 6 patches on LLaVA (window_cls_selection, llava_arch.py:274), 4 x 4 merged tokens on
# Qwen (window_selection, qwen2_5_vl_utils.py:136), both the official `window_size`; "auto": the family's code's.
WINDOW_SIZE = "auto"
LLAVA_WINDOW, QWEN_WINDOW = 6, 4
CODES = ("llava", "qwen")
# The families the official LLaVA code's rule runs on: a CLIP-style tower with [CLS] and a projector of single
# patches. Every other family runs the Qwen code (no [CLS], or InternVL's pixel-shuffle groups).
LLAVA_CODE_FAMILIES = LLAVA_FAMILIES

KEEP_MEANS = ("layer-average visual tokens per image, crop or frame: stage 1 keeps T = round(3N/2) per item, stage 2 "
              "at the decoder's middle layer a third of them (keep 64: LLaVA's released 96 / 32); where 3N/2 "
              "exceeds the item's units stage 1 keeps them all and stage 2 keeps 2N - units")


def code_of(family: str) -> str:
    """The official code path `family` runs: ``"llava"`` (the [CLS] row, per-window top-k, RoPE and compacted
    positions in stage 2) on LLaVA-1.5, LLaVA-NeXT and Video-LLaVA, ``"qwen"`` (column means, the capped greedy,
    no RoPE and original positions in stage 2) elsewhere."""
    return "llava" if family in LLAVA_CODE_FAMILIES else "qwen"


# ---- the local scan's windows ------------------------------------------------------------------------------------

def window_grid(rows: int, cols: int, window: int) -> tuple[int, int, int]:
    """(windows down, windows across, units of the smallest window) of the local scan on a grid of `rows` x `cols`
    units with square windows of `window`: ``rows // window`` down (at least one: a grid smaller than a window is one
    window; the official Qwen code divides by zero there), the edge rows and columns that do not fill a window
    joining the last one (qwen2_5_vl_utils.py:174-179; on LLaVA's 24 x 24 grid the 6 x 6 windows tile it exactly)."""
    if window < 1:
        raise FicocoError(f"VScan window_size={window}: give a window side of at least 1 unit")
    down, across = max(1, rows // window), max(1, cols // window)
    low_rows = rows if down == 1 else window
    low_cols = cols if across == 1 else window
    return down, across, low_rows * low_cols


def square_side(units: int) -> int:
    """The side of a square grid of `units` (LLaVA's CLIP and LanguageBind grids), or one line why not."""
    side = math.isqrt(units)
    if side * side != units:
        raise FicocoError(f"VScan's LLaVA code scans a square grid of patches; an item of {units} is not one")
    return side


def local_count(keep: int, global_ratio: float) -> int:
    """The local scan's share of a stage-1 count `keep`: ``int(keep * (1 - global_ratio))`` (llava_arch.py:274;
    the Qwen code's ``num_keep // 2``)."""
    return int(keep * (1 - global_ratio))


def llava_local_per_window(local: int, windows: int, smallest: int) -> int:
    """The LLaVA code's picks per window: ``local // windows`` (k of window_cls_selection, llava_arch.py:225), at most
    the smallest window's units (a window holds no more)."""
    return min(local // windows, smallest)


def reaching(settings: Mapping[str, Any], units: int) -> int:
    """Units an item hands the LLM after stage 1: the LLaVA code's local scan takes ``k`` per window, which falls short
    of its half when the windows do not divide it (``T - int(T/2) + windows * k``, exact at the released 96, 192 and
    288 on 24 x 24); the Qwen code's greedy takes its half exactly."""
    keep = settings["keep"]
    if settings["scan"] != "cls" or keep >= units:
        return min(keep, units)
    side = square_side(units)
    down, across, smallest = window_grid(side, side, settings["window_size"])
    local = local_count(keep, settings["global_ratio"])
    return keep - local + down * across * llava_local_per_window(local, down * across, smallest)


# ---- the layers ------------------------------------------------------------------------------------------------

def whole_layer(name: str, value: Any, what: str) -> int:
    """`value` of setting `name` as a whole number (`--hp llm_layer=12` arrives as text), or one line asking for
    `what` or auto."""
    try:
        if isinstance(value, bool) or float(value) != int(value):
            raise ValueError
        return int(value)
    except (TypeError, ValueError):
        raise FicocoError(f"VScan {name}={value!r}: give {what}, or auto") from None


def local_layer_for(tower: TowerLayout) -> int:
    """The local scan's layer, 0-based: a quarter of the tower's depth (1-based ``round(layers / 4)``, at least 1):
    attentions[5] of CLIP's 24 layers, the LLaVA code's; on a tower whose layers attend within windows, its first
    full-attention block (fullatt_block_indexes[0], the Qwen code's: block 7 of Qwen2.5-VL's 32, a quarter too)."""
    if tower.full_attention and len(tower.full_attention) < tower.layers:
        return tower.full_attention[0]
    return min(tower.layers, max(1, round(tower.layers / 4))) - 1


def llm_layer_for(value: Any, n_layers: int, full: tuple[int, ...] | None = None) -> int:
    """Stage 2's decoder layer: a number as given; ``"auto"`` the middle layer (``n_layers // 2``: 16 of LLaVA's 32,
    14 of Qwen2.5-VL-7B's 28), on a hybrid decoder (`full`: its full-attention layers) the nearest full-attention
    layer after its first (the lower on a tie), whose own q and k rank."""
    if value != LLM_LAYER:
        return whole_layer("llm_layer", value, "a decoder layer (0-based)")
    middle = max(1, n_layers // 2)
    if full:
        later = [layer for layer in full if layer != full[0]]
        if later:
            return min(later, key=lambda layer: (abs(layer - middle), layer))
    return middle


# ---- the schedule ------------------------------------------------------------------------------------------------

def official_counts(code: str, units: int) -> tuple[int, int]:
    """(stage-1 units per item, stage-2 units per item) of the official scripts, on an item of `units`: the LLaVA
    code's 96 and 32 of 576 (on another grid the same shares, rounded), the Qwen code's ``int(0.167 * n)`` and
    ``int(0.333 * T)`` (qwen2_5_vl_custom.py:147, :635)."""
    if code == "llava":
        keep = max(1, (units * LLAVA_VISUAL_TOKENS * 2 + LLAVA_PATCHES) // (2 * LLAVA_PATCHES))
        return keep, max(1, (keep * LLAVA_LLM_TOKENS * 2 + LLAVA_VISUAL_TOKENS) // (2 * LLAVA_VISUAL_TOKENS))
    keep = max(1, int(QWEN_RATIO * units))
    return keep, max(1, int(QWEN_LLM_RATIO * keep))


def counts_for_keep(keep: int, units: int) -> tuple[int, int]:
    """(stage 1, stage 2) units per item for the layer average `keep` (the rule `--keep` states): stage 1 keeps
    ``round(3 keep / 2)``, stage 2 at the middle layer a third of that, rounded (64: 96 and 32, LLaVA's released
    setting; 128: 192 and 64; 192: 288 and 96); where ``3 keep / 2`` exceeds the item's units, stage 1 keeps them all
    and stage 2 ``2 keep - units`` (the middle layer's average is then `keep` again)."""
    check_keep("VScan", keep, units)
    first = (3 * keep + 1) // 2
    if first <= units:
        return first, max(1, (first + 1) // 3)
    return units, 2 * keep - units


def settings_for_keep(keep: int | None, n_visual: int, n_layers: int, hp: Mapping[str, Any]) -> dict[str, Any]:
    """The settings of the layer average `keep` (`counts_for_keep`); None: the official scripts' counts, which differ
    per code and are resolved on the tower (`tower_layers`, where the family is known)."""
    ratio = float(hp["global_ratio"])
    if not 0 <= ratio <= 1:
        raise FicocoError(f"VScan global_ratio={ratio:g} is outside 0..1 (the global scan's share of stage 1)")
    riding = {name: hp[name] for name in ("local_layer", "llm_layer", "window_size")}
    if keep is None:
        return {"keep": None, "llm_keep": None, "global_ratio": ratio, **riding}
    first, second = counts_for_keep(keep, n_visual)
    return {"keep": first, "llm_keep": second, "global_ratio": ratio, **riding}


def tower_layers(tower: TowerLayout, settings: Mapping[str, Any]) -> dict[str, Any]:
    """What follows the tower a run plans: the code the family runs (``scan``: ``"cls"`` on the LLaVA code,
    ``"columns"`` on the Qwen code), its window, the local scan's layer, and without keep= the official counts of an
    item's units (`official_counts`)."""
    code = code_of(tower.family)
    out: dict[str, Any] = {"scan": "cls" if code == "llava" else "columns"}
    window = settings.get("window_size", WINDOW_SIZE)
    if window == WINDOW_SIZE:
        window = LLAVA_WINDOW if code == "llava" else QWEN_WINDOW
    window = whole_layer("window_size", window, "a window side of at least 1 unit")
    if window < 1:
        raise FicocoError(f"VScan window_size={window}: give a window side of at least 1 unit, or auto")
    out["window_size"] = window
    layer = settings.get("local_layer", LOCAL_LAYER)
    out["local_layer"] = local_layer_for(tower) if layer == LOCAL_LAYER else \
        whole_layer("local_layer", layer, "a 0-based tower layer (the official attentions[5] is local_layer=5)")
    if tower.units < 1:
        raise FicocoError("VScan's counts are counts of an item's units, which this plan does not give")
    if settings.get("keep") is None:
        out["keep"], out["llm_keep"] = official_counts(code, tower.units)
    # What stage 1 hands the LLM per item (`reaching`), the count stage 2's share is of.
    out["handed"] = reaching({**settings, **out}, tower.units)
    return out


def steps(settings: Mapping[str, Any], n_visual: int, n_layers: int) -> tuple[Step, ...]:
    """One cut after the projector: every item hands the LLM `reaching` of its `n_visual` units."""
    keep = settings["keep"]
    check_keep("VScan", keep, n_visual)
    left = reaching(settings, n_visual)
    return (Step(n_layers - 1, n_visual - left, 0, "after_projector", "vision"),) if left < n_visual else ()


def stage_two_keep(n_visual: int, handed: int, llm_keep: int) -> int:
    """Visual tokens stage 2 keeps of the `n_visual` the LLM received, where stage 1 hands it `handed` per item: the
    share ``llm_keep / handed`` of them, rounded (one item: `llm_keep` itself, LLaVA's ``min(32, image tokens)``;
    LLaVA-NeXT's crops and newlines, a video's frames: the same share of the whole span, the per-crop budget the
    official NeXT run means)."""
    return max(1, min(n_visual, (2 * n_visual * llm_keep + handed) // (2 * handed)))


def inner_steps(settings: Mapping[str, Any], n_visual: int, n_layers: int) -> tuple[Step, ...]:
    """Stage 2: at the input of the rank layer, the visual tokens the last prompt token attends to most stay."""
    layer = llm_layer_for(settings.get("llm_layer", LLM_LAYER), n_layers, settings.get(FULL_ATTENTION_LAYERS))
    kept = stage_two_keep(n_visual, settings["handed"], settings["llm_keep"])
    return (Step(layer, n_visual - kept),) if kept < n_visual else ()


# ---- the cost ----------------------------------------------------------------------------------------------------

def extra_macs(ctx: StepContext) -> ExtraMacs:
    """The merge's cosine similarities of every removed unit with every kept one, at the projector's width. The scans
    read [CLS]'s row or the column means of two tower layers: its `reads`."""
    kept = ctx.visual_before - ctx.step.remove
    return [(ctx.step.layer, "vscan_merge_similarity", ctx.step.remove * kept * ctx.projected_width)]


def inner_extra_macs(ctx: StepContext) -> ExtraMacs:
    """Stage 2's rank layer: its own k over the entering sequence, q of the last prompt token (the official code
    projects q, k and v for every row; one row is all the score reads), and that row's scores."""
    d, layer, n = ctx.dims, ctx.step.layer, ctx.seq_before
    return [(layer, "vscan_k_proj", n * d.hidden * d.kv_heads * d.head_dim),
            (layer, "vscan_q_proj_last_row", d.hidden * d.heads * d.head_dim),
            (layer, "vscan_last_row_scores", d.heads * d.head_dim * n)]


def reads(ctx: ReadContext) -> tuple[ReadShape, ...]:
    """The two scans' reads per item: on the LLaVA code [CLS]'s row of the layer the projector reads and of the
    local layer; on the Qwen code what every unit receives over every query of each (column sums)."""
    if ctx.stage != "vision":
        return ()
    if ctx.settings.get("scan") == "cls":
        return (("rows", 1, ctx.tokens), ("rows", 1, ctx.tokens, "local_layer"))
    return (("columns", ctx.tokens, ctx.tokens), ("columns", ctx.tokens, ctx.tokens, "local_layer"))


INNER = MethodSpec(
    name="vscan", title="VScan", acts_at="llm_layer", placement="layer_input", positions="compact",
    needs=(Need("query_key", "L", "last", "the rank layer's own input_layernorm, q_proj (last row) and k_proj (all "
                "rows), softmax over all keys, head mean: " + LAST_ROW + "; RoPE on a 1-D decoder (LLaVA code), none "
                "on an M-RoPE one (Qwen code)", rope="1d"),
           Need("hidden", "L", "all", "the input of the rank layer")),
    hyperparameters={"llm_layer": LLM_LAYER}, families=ALL_FAMILIES, module=f"{__name__}.ops", function="step",
    source="Tencent/SelfEvolvingAgent a82450e (VScan/llava/model/modeling_llama_x.py:1320-1509, "
           "VScan/qwen/model/qwen2_5_vl_custom.py:691-785)",
    summary="keep the visual tokens the last prompt token attends to most in the rank layer's own q and k",
    keep_means="the share llm_keep / handed of the visual tokens the LLM received",
    steps=inner_steps, extra_macs=inner_extra_macs, wired=True,
)

SPEC = MethodSpec(
    name="vscan", title="VScan", acts_at="after_projector", placement="after_projector", positions="grid",
    needs=(Need("attention_rows", "vision L", "all", "head-mean probabilities of the layer the projector reads "
                "(LLaVA: CLIP layer 22; Qwen: the last block), as the layer ran (a window block: within its windows): "
                "the global scan's scores, [CLS]'s row (LLaVA code) or what every unit receives (Qwen code)"),
           Need("attention_rows", "vision named", "all", "the same of the local layer (LLaVA: attentions[5]; Qwen: "
                "the first full-attention block): the local scan's scores", at="local_layer"),
           Need("hidden", "projector", "all", "the projector's output, every unit (projected, then merged)")),
    hyperparameters={"global_ratio": GLOBAL_RATIO, "local_layer": LOCAL_LAYER, "window_size": WINDOW_SIZE,
                     "llm_layer": LLM_LAYER, "attention_scores": DEFAULT_ATTENTION_SCORES},
    corrections=SCORES_CORRECTION,
    families=ALL_FAMILIES, module=f"{__name__}.ops", function="vscan_select",
    source="Tencent/SelfEvolvingAgent a82450e (VScan/llava/model/llava_arch.py:142-290, "
           "VScan/qwen/model/qwen2_5_vl_custom.py:127-174, :338-391, VScan/qwen/model/qwen2_5_vl_utils.py:97-193)",
    summary="keep a local scan (the most attended units of a shallow tower layer, window by window) and a global "
            "scan (the most attended of the rest in the layer the projector reads), merge every other unit into its "
            "most similar kept one; at the decoder's middle layer keep the tokens the last prompt token attends to "
            "most",
    keep_means=KEEP_MEANS,
    steps=steps, settings_for_keep=settings_for_keep, extra_macs=extra_macs, reads=reads,
    tower_layers=tower_layers, wired=True, merges_by_keys=True, inner=INNER,
)
