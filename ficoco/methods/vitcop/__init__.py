"""ViTCoP (docs/methods/vitcop.md): at the tower's output keep the patches [CLS] attends to most and cluster
them (VIC); inside the LLM, at a shallow layer keep and merge each cluster's tokens by their key norms, at a deep
layer keep the tokens of smallest key norm.

This module is its two specs (the cut at the tower's output, and its `inner` part in the decoder), its defaults
(the official code's) and its schedule arithmetic; no torch. Its tensor functions are in `ops`.

Official code: chaser682/ViTCoP 627f632, LLaVA/llava/model/multimodal_encoder/clip_encoder.py (the cut, L187-274),
multimodal_encoder/utils.py (VIC, L56-150) and language_model/vitcop_modeling_llama.py (the decoder, L1188-1413;
its counts L1295-1296); eval/llava/vitcop_llava_1_5.sh (the paper's three rows, L13-18).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ficoco.errors import FicocoError
from ficoco.methods.base import ExtraMacs, MethodSpec, Need, Step, StepContext
from ficoco.methods.common import check_keep, check_layer
from ficoco.methods.reads import DEFAULT_ATTENTION_SCORES, SCORES_CORRECTION

# The official code's defaults (its environment variables unset): vitcop_modeling_llama.py L1045-1048,
# clip_encoder.py L50-51.
RATIO = 0.25  # VITCOP_PRUNED_RARIO: the layer-average share of the image's tokens
VISION_RATIO = 0.5  # VISION_PRUNE_RARIO: the share of the patches the cut keeps
CLUSTER_SHARE = 0.18  # CLUSTER_PERCENTAGE: the share of the kept patches that become cluster centres
SHALLOW_LAYER = 2  # SHALLOW_PRUNED_LAYER
DEEP_LAYER = 22  # DEEP_PRUNED_LAYER
OFFICIAL_LAYERS = 32  # LLaVA-1.5-7B's decoder, which the official formula writes as 32
# VIC's constants (clip_encoder.py L233-235): the Gaussian density's cutoff distance and the spatial radius (on
# positions normalised by the grid's side) within which a denser token may be a token's parent.
DENSITY_CUTOFF = 8.0
SPATIAL_RADIUS = 0.6
# The deep stage keeps a fifth of the shallow stage's tokens (vitcop_modeling_llama.py L1295-1296: a constant).
DEEP_DIVISOR = 5
# Where the shallow stage leaves fewer tokens than its count (more asked than the cut kept), the official deep
# stage still reads a span of that count, into the text after the image (L1364): refused by default, counted from
# the tokens really left with "real" (ficoco's correction).
DEEP_SPAN = "official"
CORRECTIONS = {"deep_span": {"real": "deep span of the real count"}, **SCORES_CORRECTION}
# The paper's rows (eval/llava/vitcop_llava_1_5.sh L13-16): (ratio, vision_ratio, cluster_share) of "192", "128",
# "64" tokens on LLaVA-1.5-7B. They lie on one line in the ratio (`line_setting`), which --keep follows.
OFFICIAL_ROWS = {192: (0.3333, 0.5, 0.18), 128: (0.2222, 0.4, 0.15), 64: (0.1111, 0.3, 0.12)}
VISION_LINE = (0.2, 0.9)  # vision_ratio = 0.2 + 0.9 x ratio through the three rows
CLUSTER_LINE = (0.09, 0.27)  # cluster_share = 0.09 + 0.27 x ratio through the three rows
FAMILIES = ("llava", "video_llava")


# One line for every family whose tower has no [CLS] (SigLIP, the Qwen towers).
NO_CLS = ("the tower has no [CLS] (SigLIP, the Qwen towers), and ViTCoP's cut keeps the patches by the [CLS] row of "
          "the layer the projector reads (a stand-in score would not be ViTCoP)")


REFUSALS = {
    "llava_next": "the official code's AnyRes path (a list of crops) never runs ViTCoP (clip_encoder.py L250-255 "
                  "leaves its cluster labels undefined), so no rule says how crops and their packing are reduced",
    **dict.fromkeys(("llava_onevision", "qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5"), NO_CLS),
    "internvl": "InternVL's pixel shuffle hands the LLM 2x2 groups of patches, not the single patches ViTCoP's "
                "[CLS] top-k keeps and its VIC clustering labels by their k_proj (group scores and group keys "
                "would be a stand-in, not ViTCoP)",
}


def line_setting(keep: int, patches: int) -> tuple[float, float, float]:
    """(ratio, vision_ratio, cluster_share) of a layer average of `keep` tokens of an item of `patches`: ratio =
    keep / patches and the two shares on the line through the paper's rows, each rounded to 4 decimals as the
    script writes them (192, 128, 64 of 576 give its rows exactly)."""
    ratio = keep / patches
    return (round(ratio, 4), round(VISION_LINE[0] + VISION_LINE[1] * ratio, 4),
            round(CLUSTER_LINE[0] + CLUSTER_LINE[1] * ratio, 4))


def settings_for_keep(keep: int | None, n_visual: int, n_layers: int, hp: Mapping[str, Any]) -> dict[str, Any]:
    """A layer average of `keep` visual tokens per item of `n_visual` patches (`line_setting`); None: the
    official code's defaults (or the ratios given as hyperparameters)."""
    if keep is None:
        ratio, vision_ratio, share = hp["ratio"], hp["vision_ratio"], hp["cluster_share"]
    else:
        check_keep("ViTCoP", keep, n_visual)
        ratio, vision_ratio, share = line_setting(keep, n_visual)
    if not 0 < ratio <= 1:
        raise FicocoError(f"ViTCoP: ratio {ratio} is outside (0, 1] (the layer-average share of the image's tokens)")
    if not 0 < vision_ratio <= 1:
        raise FicocoError(f"ViTCoP: vision_ratio {vision_ratio} is outside (0, 1] (the share of the patches its cut "
                          "keeps); give a smaller keep=")
    if not 0 < share <= 1:
        raise FicocoError(f"ViTCoP: cluster_share {share} is outside (0, 1] (the share of the kept patches that "
                          "become cluster centres)")
    vision_keep = int(vision_ratio * n_visual)  # clip_encoder.py L217
    if vision_keep < 1:
        raise FicocoError(f"ViTCoP: vision_ratio {vision_ratio} keeps no patch of {n_visual}; give a larger keep=")
    return {"ratio": ratio, "vision_ratio": vision_ratio, "cluster_share": share, "vision_keep": vision_keep,
            **{name: hp[name] for name in ("shallow_layer", "deep_layer", "density_cutoff", "spatial_radius")}}


def steps(settings: Mapping[str, Any], n_visual: int, n_layers: int) -> tuple[Step, ...]:
    """The cut at the tower's output: `vision_keep` patches of every item stay (in image order). It runs even
    when it keeps every patch: its clustering is what the LLM stages read."""
    keep = settings["vision_keep"]
    check_keep("ViTCoP", keep, n_visual)
    return (Step(n_layers - 1, n_visual - keep, 0, "tower_output", "vision"),)


def stage_layers(settings: Mapping[str, Any], n_layers: int) -> tuple[int, int]:
    """(shallow, deep) decoder layers of the two stages: the settings'; on a decoder without the official deep
    layer (fewer than 23 layers: the tiny profiles) and the official layers asked, the same fractions of its
    depth, ``max(1, round(2 L / 32))`` and ``max(shallow + 1, min(L - 1, round(22 L / 32)))``."""
    shallow_layer, deep_layer = settings["shallow_layer"], settings["deep_layer"]
    if (shallow_layer, deep_layer) == (SHALLOW_LAYER, DEEP_LAYER) and n_layers <= DEEP_LAYER:
        shallow_layer = max(1, round(SHALLOW_LAYER * n_layers / OFFICIAL_LAYERS))
        deep_layer = max(shallow_layer + 1, min(n_layers - 1, round(DEEP_LAYER * n_layers / OFFICIAL_LAYERS)))
    check_layer("ViTCoP", shallow_layer, n_layers)
    check_layer("ViTCoP", deep_layer, n_layers)
    if deep_layer <= shallow_layer:
        raise FicocoError(f"ViTCoP: deep_layer {deep_layer} must come after shallow_layer {shallow_layer}")
    return shallow_layer, deep_layer


def llm_counts(settings: Mapping[str, Any], n_visual: int, n_layers: int) -> tuple[int, int]:
    """(shallow, deep): the visual tokens from the shallow and from the deep layer on (`stage_layers`), of the
    `n_visual` the LLM receives, by the official formula (vitcop_modeling_llama.py L1295-1296), with the decoder's
    `n_layers` in place of its 32 (LLaVA-1.5-7B's): the layer average is then ``ratio`` x the image's tokens."""
    shallow_layer, deep_layer = stage_layers(settings, n_layers)
    layers, ratio, vision = n_layers, settings["ratio"], settings["vision_ratio"]
    shallow = round((layers * ratio / vision - shallow_layer)
                    / (deep_layer - shallow_layer + (layers - deep_layer) / DEEP_DIVISOR) * n_visual)
    return shallow, round(shallow / DEEP_DIVISOR)


def inner_steps(settings: Mapping[str, Any], n_visual: int, n_layers: int) -> tuple[Step, ...]:
    """The two stages in the decoder on the `n_visual` tokens the cut handed the LLM: the shallow stage keeps
    and merges them into `shallow` (a step even when it keeps the count: its merges change every cluster), the
    deep stage keeps `deep`."""
    shallow_layer, deep_layer = stage_layers(settings, n_layers)
    shallow, deep = llm_counts(settings, n_visual, n_layers)
    if shallow < 1 or deep < 1:
        raise FicocoError(f"ViTCoP: ratio {settings['ratio']} with vision_ratio {settings['vision_ratio']} leaves "
                          f"{shallow} tokens at the shallow layer and {deep} at the deep one (at least 1 each); "
                          "give a larger keep=")
    span = shallow
    if shallow > n_visual:
        if settings.get("deep_span", DEEP_SPAN) == DEEP_SPAN:
            raise FicocoError(f"ViTCoP: ratio {settings['ratio']} with vision_ratio {settings['vision_ratio']} asks "
                              f"the shallow layer for {shallow} of the {n_visual} tokens the cut left; the official "
                              "code keeps them all and its deep stage then reads a span of that count into the text: "
                              "give a smaller keep=, a larger vision_ratio, or deep_span='real' (ficoco: the real "
                              "count)")
        span = n_visual
    if deep >= span:
        raise FicocoError(f"ViTCoP: the deep layer would keep {deep} of the {span} tokens the shallow layer left; "
                          "give a smaller keep=")
    return (Step(shallow_layer, n_visual - span), Step(deep_layer, span - deep))


def extra_macs(ctx: StepContext) -> ExtraMacs:
    """Per item: the [CLS] row of the layer the projector reads, and VIC's feature distances (the Gram matrix of
    the kept patches' k_proj outputs); the spatial distances (two coordinates) are elementwise work."""
    d, kept = ctx.dims, ctx.visual_before - ctx.step.remove
    return [(ctx.step.layer, "vitcop_vision_cls_row", d.heads * d.head_dim * ctx.seq_before),
            (ctx.step.layer, "vitcop_vic_distances", kept * kept * d.hidden)]


def inner_extra_macs(ctx: StepContext) -> ExtraMacs:
    """Per sample, at each stage: the norms of the head-mean keys of layer L-1 over the visual span (squared by a
    dot product each); at the shallow stage also the product that makes its tokens (every output token a
    weighted row over the span: a kept token one-hot, a merged one its median member plus its group's mean)."""
    d, layer, visual = ctx.dims, ctx.step.layer, ctx.visual_before
    rows = [(layer, "vitcop_key_norms", visual * d.head_dim)]
    if ctx.index == 0:
        rows.append((layer, "vitcop_cluster_merge", (visual - ctx.step.remove) * visual * d.hidden))
    return rows


INNER = MethodSpec(
    name="vitcop", title="ViTCoP", acts_at="llm_layer", placement="layer_input", positions="original",
    step_positions=("original", "reindexed"),
    needs=(Need("keys", "L-1", "visual+suffix", "post-RoPE key states of layer L-1 (the KV cache's), heads "
                "concatenated: the norm of their head mean ranks the visual tokens"),
           Need("hidden", "L", "all", "the input of layer L (the shallow stage's merges)")),
    hyperparameters={"shallow_layer": SHALLOW_LAYER, "deep_layer": DEEP_LAYER, "deep_span": DEEP_SPAN},
    corrections={"deep_span": CORRECTIONS["deep_span"]},
    families=FAMILIES, module=f"{__name__}.ops", function="step",
    source="chaser682/ViTCoP 627f632 (LLaVA/llava/model/language_model/vitcop_modeling_llama.py)",
    summary="at the shallow layer keep each cluster's smallest-key-norm tokens and merge the rest of it into one; "
            "at the deep layer keep the smallest key norms",
    keep_means="the counts of the official formula at shallow_layer and deep_layer",
    steps=inner_steps, extra_macs=inner_extra_macs, wired=True, refusals=REFUSALS,
)


SPEC = MethodSpec(
    name="vitcop", title="ViTCoP", acts_at="vision_layer", placement="tower_output", positions="grid",
    needs=(Need("attention_rows", "vision L", "cls", "the [CLS] query's softmax over every key of the layer the "
                "projector reads, summed over heads (the official attentions[-2])"),
           Need("keys", "vision L", "all", "that layer's k_proj output, heads concatenated, bias included: VIC's "
                "features"),
           Need("hidden", "vision L", "all", "that layer's output, the projector's input")),
    hyperparameters={"ratio": RATIO, "vision_ratio": VISION_RATIO, "cluster_share": CLUSTER_SHARE,
                     "shallow_layer": SHALLOW_LAYER, "deep_layer": DEEP_LAYER, "density_cutoff": DENSITY_CUTOFF,
                     "spatial_radius": SPATIAL_RADIUS, "deep_span": DEEP_SPAN,
                     "attention_scores": DEFAULT_ATTENTION_SCORES},
    corrections=CORRECTIONS,
    families=FAMILIES, module=f"{__name__}.ops", function="tower_step", refusals=REFUSALS,
    source="chaser682/ViTCoP 627f632 (LLaVA/llava/model/multimodal_encoder/clip_encoder.py, "
           "multimodal_encoder/utils.py, language_model/vitcop_modeling_llama.py; eval/llava/vitcop_llava_1_5.sh)",
    summary="keep the patches [CLS] attends to most and cluster them (VIC: density peaks within a spatial radius); "
            "in the LLM keep and merge each cluster's tokens by key norm at layer 2, keep the smallest key norms at "
            "layer 22",
    keep_means="layer-average visual tokens per image (per frame on Video-LLaVA, its [CLS] apart) over the "
               "decoder's layers, as the official formula aims them (ratio x patches; the cut's and the cluster "
               "shares on the line through the paper's rows)",
    steps=steps, settings_for_keep=settings_for_keep, extra_macs=extra_macs, wired=True, inner=INNER,
)
