"""InternVL3's shapes (`InternVLForConditionalGeneration`): InternViT ([CLS], learned absolute positions,
LayerNorm or RMSNorm, separate q/k/v (with bias under `attention_bias`), layer scale, a GELU MLP), whose
`vision_feature_layer` output, [CLS] dropped, pixel shuffle joins 2 x 2 patches into one token of 4x the
width (a reshape: no multiply-accumulates), a projector LayerNorm(4 x width) -> linear_1 -> GELU -> linear_2,
and a Qwen2 decoder.

An image is tiled as the processor tiles it (GotOcr2's `get_optimal_tiled_canvas` between the profile's
`min_tiles` and `max_tiles`, `crop_to_patches` on as InternVLProcessor sets it): a grid of tower-sized
tiles, plus a thumbnail of the whole image when there is more than one tile. Every tile is one tower item
and hands the LLM `image_seq_length` tokens, in the prompt `<img>` + tokens + `</img>`. The reducible unit
of a method before the LLM is a pixel-shuffle group (VisionTower.merge: the 4 patches of one LLM token),
as Qwen2-VL's merge group. No torch.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ficoco.accounting.families.parts import llama_decoder
from ficoco.accounting.shapes import (
    Architecture,
    Family,
    Layout,
    Projector,
    VisionTower,
    check_divisible,
    feature_layer,
    get,
    whole,
)
from ficoco.errors import FicocoError

# Qwen2Config's defaults (InternVLConfig's default text model) for the fields the accountant reads.
TEXT_DEFAULTS = {
    "hidden_size": 4096, "intermediate_size": 22016, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 32, "vocab_size": 151936,
}
# InternVLVisionConfig's defaults (InternViT-300M-448px).
VISION_DEFAULTS = {
    "hidden_size": 1024, "num_hidden_layers": 24, "num_attention_heads": 16, "intermediate_size": 4096,
    "num_channels": 3, "image_size": [448, 448], "patch_size": [14, 14], "attention_bias": False,
    "use_qk_norm": False, "norm_type": "layer_norm", "use_mask_token": False,
    "use_absolute_position_embeddings": True, "use_mean_pooling": True,
}
# InternVLConfig's top-level defaults.
TOP_DEFAULTS = {"image_seq_length": 256, "downsample_ratio": 0.5, "vision_feature_layer": -1,
                "vision_feature_select_strategy": "default", "tie_word_embeddings": True}
# The processor's tiling defaults (GotOcr2ImageProcessor: min_patches 1, max_patches 12).
MIN_TILES, MAX_TILES = 1, 12
NORM_TYPES = ("layer_norm", "rms_norm")


def supported_arrangements(min_tiles: int, max_tiles: int) -> list[tuple[int, int]]:
    """GotOcr2's `get_all_supported_aspect_ratios`: every (columns, rows) whose tile count is in
    [min_tiles, max_tiles], fewest tiles first (a stable sort, as Python's)."""
    grids = [(cols, rows) for cols in range(1, max_tiles + 1) for rows in range(1, max_tiles + 1)
             if min_tiles <= cols * rows <= max_tiles]
    return sorted(grids, key=lambda grid: grid[0] * grid[1])


def tiled_canvas(size_hw: tuple[int, int], tile_hw: tuple[int, int], min_tiles: int,
                 max_tiles: int) -> tuple[int, int]:
    """(columns, rows) of tiles GotOcr2's `get_optimal_tiled_canvas` picks for an image of `size_hw`:
    the closest aspect ratio, ties going to more tiles while they cover at most twice the image."""
    height, width = size_hw
    aspect, area = width / height, width * height
    best_diff, best = float("inf"), (1, 1)
    for cols, rows in supported_arrangements(min_tiles, max_tiles):
        diff = abs(aspect - cols / rows)
        if diff < best_diff:
            best_diff, best = diff, (cols, rows)
        elif diff == best_diff and area > 0.5 * tile_hw[0] * tile_hw[1] * cols * rows:
            best = (cols, rows)
    return best


def tower_items(size_hw: tuple[int, int], tile_hw: tuple[int, int], min_tiles: int, max_tiles: int) -> int:
    """Tower items of one image: its tiles, plus the thumbnail when there is more than one tile
    (GotOcr2's `crop_image_to_patches`; `max_tiles` 1 is the image alone)."""
    if max_tiles <= 1:
        return 1
    cols, rows = tiled_canvas(size_hw, tile_hw, min_tiles, max_tiles)
    return cols * rows + int(cols * rows > 1)


def _pair(key: str, value: Any) -> tuple[int, int]:
    """An InternVLVisionConfig size: one number or [height, width]."""
    values = list(value) if isinstance(value, (list, tuple)) else [value, value]
    if len(values) != 2:
        raise FicocoError(f"config value vision_config.{key}={value!r} must be a number or [height, width]")
    return whole(f"vision_config.{key}", values[0]), whole(f"vision_config.{key}", values[1])


def shuffle_factor(ratio: Any) -> int:
    """Patches per side that pixel shuffle joins: 1 / downsample_ratio, which must be a whole number
    (the projector's width int(1 / ratio)^2 x hidden and the shuffle's hidden / ratio^2 agree only then)."""
    if not isinstance(ratio, (int, float)) or isinstance(ratio, bool) or not 0 < ratio <= 1:
        raise FicocoError(f"config value downsample_ratio={ratio!r} must be a number in (0, 1]")
    factor = round(1 / ratio)
    if abs(factor * ratio - 1) > 1e-9:
        raise FicocoError(f"downsample_ratio={ratio}: transformers' InternVL projector expects int(1 / ratio)^2 x "
                          "the tower's width but pixel shuffle gives width / ratio^2; give 1 / a whole number (0.5)")
    return factor


def internvit(vcfg: dict[str, Any], cfg: dict[str, Any], items: int) -> VisionTower:
    """InternViT as transformers builds it from `vision_config`, for `items` tiles, its units the
    pixel-shuffle groups of the layer `vision_feature_layer` names."""
    d = VISION_DEFAULTS
    hidden, heads = get(vcfg, "hidden_size", d), get(vcfg, "num_attention_heads", d)
    check_divisible("vision_config", "hidden_size", hidden, "num_attention_heads", heads,
                    "transformers' InternVLVisionAttention")
    layers = get(vcfg, "num_hidden_layers", d)
    tile_h, tile_w = _pair("image_size", vcfg.get("image_size") or d["image_size"])
    patch_h, patch_w = _pair("patch_size", vcfg.get("patch_size") or d["patch_size"])
    grid_h, grid_w = tile_h // patch_h, tile_w // patch_w
    if not (grid_h and grid_w):
        raise FicocoError(f"vision_config.image_size={[tile_h, tile_w]} is smaller than patch_size="
                          f"{[patch_h, patch_w]}: no patch fits")
    if patch_h != patch_w:
        raise FicocoError(f"vision_config.patch_size={[patch_h, patch_w]}: ficoco counts square patches; give one size")
    if grid_h != grid_w:
        raise FicocoError(f"vision_config image_size / patch_size gives a {grid_h}x{grid_w} patch grid; transformers' "
                          "InternVL get_image_features reshapes every tile's patches into a square: give a square one")
    factor = shuffle_factor(cfg.get("downsample_ratio", TOP_DEFAULTS["downsample_ratio"]))
    if grid_h % factor:
        raise FicocoError(f"a tile's {grid_h}x{grid_w} patch grid does not split into {factor}x{factor} pixel-shuffle "
                          f"groups (downsample_ratio={cfg.get('downsample_ratio', 0.5)}); transformers' pixel_shuffle "
                          f"fails on it: give image_size / patch_size a multiple of {factor}")
    strategy = cfg.get("vision_feature_select_strategy", TOP_DEFAULTS["vision_feature_select_strategy"])
    if strategy != "default":
        raise FicocoError(f"vision_feature_select_strategy={strategy!r}: InternVL's pixel shuffle reshapes the patches "
                          "into a square, which [CLS] breaks; give 'default' ([CLS] dropped)")
    feature = cfg.get("vision_feature_layer", TOP_DEFAULTS["vision_feature_layer"])
    if not isinstance(feature, int) or isinstance(feature, bool):
        raise FicocoError(f"vision_feature_layer={feature!r}: InternVL reads one layer (an index), not a list")
    norm = vcfg.get("norm_type") or d["norm_type"]
    if norm not in NORM_TYPES:
        raise FicocoError(f"config value vision_config.norm_type={norm!r} must be one of {', '.join(NORM_TYPES)}")
    flag = {key: bool(vcfg.get(key, d[key])) for key in
            ("attention_bias", "use_qk_norm", "use_mask_token", "use_absolute_position_embeddings",
             "use_mean_pooling")}
    # A layer beyond CLIP's (ficoco.accounting.architecture's vision layer: q, k, v, out and two MLP linears with
    # biases, two LayerNorms): layer scale lambda_1 and lambda_2; q/k RMSNorms over the width; no q/k/v biases
    # without attention_bias; RMSNorms without bias.
    layer_extra = 2 * hidden + 2 * hidden * flag["use_qk_norm"] - 3 * hidden * (not flag["attention_bias"]) \
        - 2 * hidden * (norm == "rms_norm")
    positions = grid_h * grid_w + 1 if flag["use_absolute_position_embeddings"] else 0
    # The patch convolution's bias, [CLS], the mask token, the position table, the final LayerNorm (only
    # without mean pooling: nn.Identity otherwise).
    tower_extra = hidden + hidden + hidden * flag["use_mask_token"] + positions * hidden \
        + 2 * hidden * (not flag["use_mean_pooling"])
    return VisionTower(
        kind="internvl", layers=layers, hidden=hidden, ffn=get(vcfg, "intermediate_size", d), heads=heads,
        patch_size=patch_h, channels=get(vcfg, "num_channels", d), temporal_patch=1, grid_h=grid_h, grid_w=grid_w,
        items=items, has_cls=True, feature_layer=feature_layer(feature, layers), merge=factor * factor, towers=1,
        position_embeddings=positions, extra_layer_params=layer_extra, extra_tower_params=tower_extra,
    )


def shape(cfg: dict[str, Any], layout: Layout) -> Architecture:
    """One image of `layout.image_size` (H, W), tiled as the processor tiles it: every tile (and the
    thumbnail) a tower item of image_seq_length LLM tokens."""
    tcfg = cfg.get("text_config") or {}
    decoder = llama_decoder(tcfg, TEXT_DEFAULTS, qkv_bias=True, heads_refuser="transformers' Qwen2Attention")
    # InternVLForConditionalGeneration ties its LM head by the top-level config (InternVLConfig: True).
    tied = cfg.get("tie_word_embeddings", TOP_DEFAULTS["tie_word_embeddings"])
    decoder = replace(decoder, tied_embeddings=bool(tied))
    vcfg = cfg.get("vision_config") or {}
    tile_hw = _pair("image_size", vcfg.get("image_size") or VISION_DEFAULTS["image_size"])
    size_hw = layout.image_size or tile_hw
    low = whole("ficoco.min_tiles", layout.defaults.get("min_tiles", MIN_TILES))
    high = whole("ficoco.max_tiles", layout.defaults.get("max_tiles", MAX_TILES))
    vision = internvit(vcfg, cfg, tower_items(size_hw, tile_hw, low, high))
    seq = whole("image_seq_length", cfg.get("image_seq_length", TOP_DEFAULTS["image_seq_length"]))
    if seq != vision.units:
        raise FicocoError(f"image_seq_length={seq} but a tile's {vision.grid_h}x{vision.grid_w} patches shuffle into "
                          f"{vision.units} tokens; transformers' InternVL refuses the mismatch (image features and "
                          f"image tokens do not match): give image_seq_length={vision.units}")
    width = vision.hidden * vision.merge
    # LayerNorm(merge x width) on every shuffled token: norm_dim x merge elements, weight and bias each.
    projector = Projector(((width, decoder.hidden), (decoder.hidden, decoder.hidden)), vision.hidden,
                          norm_params_per_dim=2 * vision.merge)
    return Architecture(
        name=layout.name, family=layout.family, vision=vision, projector=projector, decoder=decoder,
        visual_tokens=vision.items * vision.units, newline_tokens=0, cls_in_llm=False, unpadding_drops=0,
        image_newline_param=False, text_tokens=layout.text_tokens,
        first_reducing_layers=layout.first_reducing_layers, image_size=size_hw,
    )


# "<|im_start|> user \n <img>" before the first tile's tokens.
FAMILY = Family(name="internvl", defaults={"text_tokens": 60, "image_size": [896, 448], "min_tiles": MIN_TILES,
                                           "max_tiles": MAX_TILES},
                shape=shape, prefix_tokens=4, takes_image_size=True)
