"""Per-layer shapes of a multimodal model, read from its Hugging Face config dict.

No torch and no transformers: the defaults below are the Hugging Face config classes'
defaults for the fields a config.json may leave out, so that a bare config gives the same
shapes that `from_config` would build.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from ficoco.errors import FicocoError
from ficoco.methods.registry import METHODS
from ficoco.profile_records import MAX_COUNT, Profile

# The accountant counts layer by layer (and a budget search counts a model many times): a config
# with millions of layers would run for hours. No released model has more than a few hundred.
MAX_LAYERS = 1000

# Hugging Face config-class defaults for the fields the accountant reads.
_LLAMA_DEFAULTS = {
    "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32,
    "vocab_size": 32000, "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
}
_QWEN2_VL_TEXT_DEFAULTS = {
    "hidden_size": 8192, "intermediate_size": 29568, "num_hidden_layers": 80, "num_attention_heads": 64,
    "num_key_value_heads": 8, "vocab_size": 152064, "tie_word_embeddings": False,
}
# LlavaConfig's default vision tower is CLIP ViT-L/14-336 (what LLaVA-1.5 uses).
_LLAVA_CLIP_DEFAULTS = {
    "hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 24, "num_attention_heads": 16,
    "patch_size": 14, "image_size": 336, "num_channels": 3,
}
_CLIP_DEFAULTS = {
    "hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12,
    "patch_size": 32, "image_size": 224, "num_channels": 3,
}
# Qwen2Config's defaults (LLaVA-OneVision's text model) and SiglipVisionConfig's as
# LlavaOnevisionConfig overrides them (so400m at 384 px, 26 layers, no pooling head).
_QWEN2_TEXT_DEFAULTS = {
    "hidden_size": 4096, "intermediate_size": 22016, "num_hidden_layers": 32, "num_attention_heads": 32,
    "vocab_size": 151936, "tie_word_embeddings": False,
}
_ONEVISION_SIGLIP_DEFAULTS = {
    "hidden_size": 1152, "intermediate_size": 4304, "num_hidden_layers": 26, "num_attention_heads": 16,
    "patch_size": 14, "image_size": 384, "num_channels": 3,
}
_QWEN2_VL_VISION_DEFAULTS = {
    "depth": 32, "embed_dim": 1280, "hidden_size": 3584, "mlp_ratio": 4, "num_heads": 16, "in_channels": 3,
    "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2,
}
# Qwen2_5_VLVisionConfig's defaults (its hidden_size is the tower width, out_hidden_size the LLM's).
_QWEN2_5_VL_VISION_DEFAULTS = {
    "depth": 32, "hidden_size": 3584, "intermediate_size": 3420, "num_heads": 16, "in_channels": 3,
    "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 112,
    "out_hidden_size": 3584, "fullatt_block_indexes": [7, 15, 23, 31],
}
# Qwen2-VL's image processor bounds (min_pixels, max_pixels).
_QWEN2_VL_MIN_PIXELS = 56 * 56
_QWEN2_VL_MAX_PIXELS = 28 * 28 * 1280
_QWEN2_VL_MAX_ASPECT = 200  # smart_resize refuses a longer side over 200 x the shorter


@dataclass(frozen=True)
class VisionTower:
    """The vision encoder: per-item token grid and per-layer widths.

    An item is what the tower sees as one batch element: the single image of LLaVA-1.5,
    a crop of LLaVA-NeXT's AnyRes, a frame of Video-LLaVA, one image of Qwen2-VL.
    """

    kind: str  # "clip", "siglip", "qwen2_vl" or "qwen2_5_vl"
    layers: int  # layers that run (Hugging Face runs the whole tower)
    hidden: int
    ffn: int
    heads: int
    patch_size: int
    channels: int
    temporal_patch: int  # 2 for Qwen2-VL's Conv3d, else 1
    grid_h: int  # patches per item along each axis
    grid_w: int
    items: int  # items per image (crops, frames)
    has_cls: bool
    feature_layer: int  # 0-based layer whose output the projector reads
    merge: int  # patches joined into one LLM token (Qwen2-VL's PatchMerger: 4)
    towers: int  # parameter copies (Video-LLaVA has an image and a video tower)
    position_embeddings: int  # learned position rows (CLIP), 0 for rotary
    # Qwen2.5-VL: merge groups in every attention window of an item, in the tower's window order
    # (windows at the right and bottom edge partial), and the layers that attend over the whole item
    # (fullatt_block_indexes); every other layer attends within windows. Empty: full attention everywhere.
    window_groups: tuple[int, ...] = ()
    full_attention_layers: frozenset[int] = frozenset()

    @property
    def patches(self) -> int:
        return self.grid_h * self.grid_w

    @property
    def units(self) -> int:
        """Reducible units per item: a patch, or a merge group for Qwen2-VL."""
        return self.patches // self.merge

    def tokens(self, units: int) -> int:
        """Tower tokens of an item that holds `units` reducible units."""
        return units * self.merge + int(self.has_cls)

    def windowed(self, layer: int) -> bool:
        """Whether `layer` attends within windows (Qwen2.5-VL's layers outside fullatt_block_indexes)."""
        return bool(self.window_groups) and layer not in self.full_attention_layers

    def attention_pairs(self, layer: int, units: int) -> int:
        """Query-key pairs of one item's attention in `layer` when it holds `units` units: tokens^2
        under full attention, the sum over windows of (tokens in the window)^2 in a window layer.
        Below the full count the kept units are spread over the windows in proportion to their size
        (largest remainder): the estimate of an analytic count, since which windows lose groups is
        known only once the method ran (a verification counts the windows the run measured)."""
        tokens = self.tokens(units)
        if not self.windowed(layer):
            return tokens * tokens
        total = sum(self.window_groups)
        if units >= total:
            kept = list(self.window_groups)
        else:
            shares = [units * w / total for w in self.window_groups]
            kept = [int(share) for share in shares]
            order = sorted(range(len(shares)), key=lambda k: kept[k] - shares[k])
            for k in order[:units - sum(kept)]:
                kept[k] += 1
        return sum((k * self.merge) ** 2 for k in kept)


@dataclass(frozen=True)
class Projector:
    """The multimodal projector: linears applied to every visual token that reaches the LLM."""

    linears: tuple[tuple[int, int], ...]
    norm_dim: int  # Qwen2-VL's merger normalises the patches first; 0 when absent
    norm_params_per_dim: int = 2  # LayerNorm: weight and bias; Qwen2.5-VL's RMSNorm: weight only


@dataclass(frozen=True)
class Decoder:
    """The LLM decoder: LLaMA-style layers with grouped-query attention and a gated FFN."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    qkv_bias: bool
    tied_embeddings: bool


@dataclass(frozen=True)
class Architecture:
    """Everything the accountant needs about one model and one input layout."""

    name: str
    family: str
    vision: VisionTower
    projector: Projector
    decoder: Decoder
    visual_tokens: int  # visual tokens per image in the LLM, unreduced
    newline_tokens: int  # LLaVA-NeXT's row separators inside the visual span (never removed)
    cls_in_llm: bool  # Video-LLaVA passes each frame's [CLS] to the LLM
    unpadding_drops: int  # LLaVA-NeXT tokens removed by unpadding (depends on the aspect ratio)
    image_newline_param: bool
    text_tokens: int
    # Per method with a `first_layer` hyperparameter: the profile's first reducing layer (its
    # ficoco.first_reducing_layer section), else the registry entry's default.
    first_reducing_layers: tuple[tuple[str, int], ...]
    image_size: tuple[int, int] | None
    # Visual tokens the projector maps that the LLM never receives, beyond unpadding's: LLaVA-OneVision's
    # bilinear downscale of a packed image over its anyres_max_N budget, and its 2x2 pooling of every
    # video frame (both resample the projected grid).
    post_projector_drops: int = 0
    # Why a method that cuts every item before the LLM cannot run on this layout ("" when it can): a
    # resampled grid needs every patch in place.
    resampled: str = ""
    # LLaVA-OneVision's video: frames pooled 2x2 after the projector, (frames, pooled tokens per frame).
    pooled_frames: tuple[int, int] | None = None
    # Qwen2-VL's (Qwen2.5-VL's) video: the frames given (--frames); its tower items are the temporal slices of
    # temporal_patch frames each (the last padded by repetition, as the processor does). None: an image.
    video_frames: int | None = None

    def first_reducing_layer(self, method: str) -> int:
        """The first layer method `method` reduces at by default (its entry's `first_layer`, or the profile's)."""
        layers = dict(self.first_reducing_layers)
        if method not in layers:
            raise FicocoError(f"{method} has no first reducing layer (its registry entry has no first_layer)")
        return layers[method]

    def llm_visual_tokens(self, units_per_item: int) -> int:
        """Visual tokens in the LLM when every item keeps `units_per_item` units."""
        if units_per_item == self.vision.units:
            return self.visual_tokens
        per_item = units_per_item + int(self.cls_in_llm)
        return self.vision.items * per_item + self.newline_tokens


def _whole(key: str, value: Any, low: int = 1, high: int = MAX_COUNT) -> int:
    """A config count: a whole number in [low, high] (JSON's 4.0 and true are not)."""
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise FicocoError(f"config value {key}={value!r} must be a whole number from {low} to {high}")
    return value


def _get(cfg: dict[str, Any], key: str, defaults: dict[str, Any]) -> Any:
    value = cfg.get(key)
    value = defaults[key] if value is None else value
    if isinstance(defaults[key], int) and not isinstance(defaults[key], bool):
        high = MAX_LAYERS if key in ("num_hidden_layers", "depth") else MAX_COUNT
        return _whole(key, value, high=high)
    return value


def _size(key: str, value: Any) -> tuple[int, int]:
    """An image size in pixels: [height, width]."""
    if not (isinstance(value, (list, tuple)) and len(value) == 2
            and all(isinstance(x, int) and not isinstance(x, bool) and 1 <= x <= MAX_COUNT for x in value)):
        shown = list(value) if isinstance(value, tuple) else value
        raise FicocoError(f"config value {key}={shown!r} must be [height, width] in whole pixels from 1 to {MAX_COUNT}")
    return value[0], value[1]


def _feature_layer(value: Any, layers: int) -> int:
    """0-based layer whose output hidden_states[value] is (hidden_states[0] is the embedding)."""
    indices = value if isinstance(value, list) else [value]
    if not indices or not all(isinstance(i, int) and not isinstance(i, bool) for i in indices):
        raise FicocoError(f"config value vision_feature_layer={value!r} must be a layer index or a list of them")
    index = max(indices)
    index = index + layers + 1 if index < 0 else index
    if not 1 <= index <= layers:
        raise FicocoError(f"vision_feature_layer {value} is outside a {layers}-layer tower")
    return index - 1


def _clip_tower(vcfg: dict[str, Any], defaults: dict[str, Any], feature_layer: Any, *, image_px: int | None,
                items: int, towers: int) -> VisionTower:
    layers = _get(vcfg, "num_hidden_layers", defaults)
    patch = _get(vcfg, "patch_size", defaults)
    size = image_px or _get(vcfg, "image_size", defaults)
    grid = size // patch
    if grid < 1:
        raise FicocoError(f"config value image_size={size} is smaller than patch_size={patch}: no patch fits")
    return VisionTower(
        kind="clip", layers=layers, hidden=_get(vcfg, "hidden_size", defaults),
        ffn=_get(vcfg, "intermediate_size", defaults), heads=_get(vcfg, "num_attention_heads", defaults),
        patch_size=patch, channels=_get(vcfg, "num_channels", defaults), temporal_patch=1,
        grid_h=grid, grid_w=grid, items=items, has_cls=True,
        feature_layer=_feature_layer(feature_layer, layers), merge=1, towers=towers,
        position_embeddings=grid * grid + 1,
    )


def _siglip_tower(vcfg: dict[str, Any], feature_layer: Any, *, items: int) -> VisionTower:
    """SigLIP as LLaVA-OneVision builds it: no [CLS], learned positions for the patches alone, a
    post-LayerNorm (run, its output unread at vision_feature_layer -1) and no pooling head."""
    d = _ONEVISION_SIGLIP_DEFAULTS
    layers = _get(vcfg, "num_hidden_layers", d)
    patch, size = _get(vcfg, "patch_size", d), _get(vcfg, "image_size", d)
    grid = size // patch
    if grid < 1:
        raise FicocoError(f"config value image_size={size} is smaller than patch_size={patch}: no patch fits")
    if vcfg.get("vision_use_head"):
        raise FicocoError("vision_config.vision_use_head=true: LLaVA-OneVision's SigLIP runs without the pooling "
                          "head (its output is never read); set it to false")
    return VisionTower(
        kind="siglip", layers=layers, hidden=_get(vcfg, "hidden_size", d), ffn=_get(vcfg, "intermediate_size", d),
        heads=_get(vcfg, "num_attention_heads", d), patch_size=patch, channels=_get(vcfg, "num_channels", d),
        temporal_patch=1, grid_h=grid, grid_w=grid, items=items, has_cls=False,
        feature_layer=_feature_layer(feature_layer, layers), merge=1, towers=1, position_embeddings=grid * grid,
    )


def anyres_max_patches(value: Any) -> int:
    """N of LLaVA-OneVision's `vision_aspect_ratio` "anyres_max_N": the packed crop grid's budget, in
    crops' worth of patches."""
    text = str(value)
    digits = text.strip("anyres_max_")  # noqa: B005 - transformers' own parsing (a character strip)
    if not text.startswith("anyres_max_") or not digits.isdigit() or int(digits) < 1:
        raise FicocoError(f"config value vision_aspect_ratio={value!r} must be 'anyres_max_N' with N >= 1")
    return int(digits)


def onevision_downscaled(rows: int, cols: int, side: int, max_patches: int) -> tuple[int, int]:
    """The crop grid LLaVA-OneVision packs after unpadding: `rows x cols` as it is, or, when it holds
    more than 1.1^2 x `max_patches` crops' worth (`side`^2 each), bilinearly resized to
    (rows // ratio, cols // ratio), ratio = sqrt(rows * cols / (max_patches * side^2))."""
    ratio = math.sqrt(rows * cols / (max_patches * side**2))
    if ratio > 1.1:
        return int(rows // ratio), int(cols // ratio)
    return rows, cols


def pooled_side(side: int) -> int:
    """Patches per axis of a LLaVA-OneVision video frame after its 2x2 bilinear pooling (ceil)."""
    return -(-side // 2)


def onevision_image_tokens(cfg: dict[str, Any], size_hw: tuple[int, int]) -> int:
    """Visual tokens LLaVA-OneVision's processor gives one image of `size_hw` (H, W) of a config dict:
    the base view, the unpadded (and, over anyres_max_N, downscaled) crop grid, a newline per row."""
    vcfg = cfg.get("vision_config") or {}
    crop = _get(vcfg, "image_size", _ONEVISION_SIGLIP_DEFAULTS)
    side = crop // _get(vcfg, "patch_size", _ONEVISION_SIGLIP_DEFAULTS)
    pinpoints = [_size("image_grid_pinpoints", p) for p in cfg.get("image_grid_pinpoints") or [[crop, crop]]]
    best_h, best_w = select_best_resolution(size_hw, pinpoints)
    rows, cols = unpadded_grid(best_h // crop * side, best_w // crop * side, size_hw)
    rows, cols = onevision_downscaled(rows, cols, side, anyres_max_patches(cfg.get("vision_aspect_ratio",
                                                                                  "anyres_max_9")))
    return side * side + rows * cols + rows


def _llama_decoder(tcfg: dict[str, Any], defaults: dict[str, Any], *, qkv_bias: bool | None = None) -> Decoder:
    hidden = _get(tcfg, "hidden_size", defaults)
    heads = _get(tcfg, "num_attention_heads", defaults)
    kv_heads = _get(tcfg, "num_key_value_heads", {"num_key_value_heads": heads})
    if heads % kv_heads:
        raise FicocoError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
    if not tcfg.get("head_dim") and hidden < heads:
        raise FicocoError(f"config value hidden_size={hidden} is smaller than num_attention_heads={heads}")
    head_dim = tcfg.get("head_dim") or hidden // heads  # unset (or 0): Hugging Face's hidden // heads
    return Decoder(
        layers=_get(tcfg, "num_hidden_layers", defaults), hidden=hidden, heads=heads, kv_heads=kv_heads,
        head_dim=_whole("head_dim", head_dim), ffn=_get(tcfg, "intermediate_size", defaults),
        vocab=_get(tcfg, "vocab_size", defaults),
        qkv_bias=bool(tcfg.get("attention_bias", False)) if qkv_bias is None else qkv_bias,
        tied_embeddings=bool(tcfg.get("tie_word_embeddings", False)),
    )


def select_best_resolution(size_hw: tuple[int, int], pinpoints: list[list[int]]) -> tuple[int, int]:
    """LLaVA-NeXT's AnyRes choice: the pinpoint with the most effective pixels, then least waste."""
    height, width = size_hw
    best, best_effective, best_wasted = None, -1, math.inf
    for ph, pw in pinpoints:
        scale = min(pw / width, ph / height)
        down_w, down_h = int(width * scale), int(height * scale)
        effective = min(down_w * down_h, width * height)
        wasted = pw * ph - effective
        if effective > best_effective or (effective == best_effective and wasted < best_wasted):
            best, best_effective, best_wasted = (ph, pw), effective, wasted
    assert best is not None
    return best


def unpadded_grid(rows: int, cols: int, size_hw: tuple[int, int]) -> tuple[int, int]:
    """Rows and columns left after LLaVA-NeXT removes the padding of the resized image."""
    orig_h, orig_w = size_hw
    if orig_w / orig_h > cols / rows:
        new_h = int(round(orig_h * (cols / orig_w), 7))
        pad = (rows - new_h) // 2
        return rows - 2 * pad, cols
    new_w = int(round(orig_w * (rows / orig_h), 7))
    pad = (cols - new_w) // 2
    return rows, cols - 2 * pad


def qwen2_vl_resize(size_hw: tuple[int, int], factor: int) -> tuple[int, int]:
    """Qwen2-VL's smart resize: multiples of patch x merge within the pixel bounds."""
    height, width = size_hw
    h = max(factor, round(height / factor) * factor)
    w = max(factor, round(width / factor) * factor)
    if h * w > _QWEN2_VL_MAX_PIXELS:
        beta = math.sqrt(height * width / _QWEN2_VL_MAX_PIXELS)
        h = math.floor(height / beta / factor) * factor
        w = math.floor(width / beta / factor) * factor
    elif h * w < _QWEN2_VL_MIN_PIXELS:
        beta = math.sqrt(_QWEN2_VL_MIN_PIXELS / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w


def qwen2_5_vl_windows(group_rows: int, group_cols: int, window_groups: int) -> tuple[int, ...]:
    """Merge groups in every attention window of a Qwen2.5-VL image of `group_rows` x `group_cols`
    groups, in the tower's window order (row-major over windows): transformers' window index pads the
    group grid to whole windows of `window_groups` per side and drops the padding, so the windows of
    the last row and column are partial."""
    sizes = []
    for top in range(0, group_rows, window_groups):
        for left in range(0, group_cols, window_groups):
            sizes.append(min(window_groups, group_rows - top) * min(window_groups, group_cols - left))
    return tuple(sizes)


def _anyres_crops(cfg: dict[str, Any], size: tuple[int, int], crop_px: int) -> tuple[int, int]:
    """(rows, cols) of crops AnyRes (LLaVA-NeXT, LLaVA-OneVision) cuts an image of `size` into: the
    config's grid pinpoint that best fits it, in whole `crop_px` crops."""
    pinpoints = cfg.get("image_grid_pinpoints") or [[crop_px, crop_px]]
    if not isinstance(pinpoints, list):
        raise FicocoError(f"config value image_grid_pinpoints={pinpoints!r} must be a list of [height, width]")
    pinpoints = [_size("image_grid_pinpoints", p) for p in pinpoints]
    best_h, best_w = select_best_resolution(size, pinpoints)
    crops_h, crops_w = best_h // crop_px, best_w // crop_px
    if not (crops_h and crops_w):
        raise FicocoError(f"image_grid_pinpoints: the chosen [{best_h}, {best_w}] is smaller than one "
                          f"{crop_px}-pixel crop (vision_config.image_size)")
    return crops_h, crops_w


def _qwen_image_pixels(size: tuple[int, int], patch: int, merge: int, title: str) -> tuple[int, int]:
    """(height, width) in pixels Qwen2-VL's and Qwen2.5-VL's processor resizes `size` to, or one line
    on why no image of that shape fits."""
    if max(size) / min(size) > _QWEN2_VL_MAX_ASPECT:
        raise FicocoError(f"image size {size[1]}x{size[0]} (image_size=): {title}'s processor takes aspect "
                          f"ratios up to {_QWEN2_VL_MAX_ASPECT}")
    h_px, w_px = qwen2_vl_resize(size, patch * merge)
    if not (h_px and w_px):
        raise FicocoError(f"config values patch_size={patch} x spatial_merge_size={merge} exceed {title}'s "
                          f"largest image ({_QWEN2_VL_MAX_PIXELS} pixels): no visual token fits")
    return h_px, w_px


def _first_reducing_layers(defaults: dict[str, Any]) -> tuple[tuple[str, int], ...]:
    """The first reducing layer of every registered method that has one (a `first_layer`
    hyperparameter): the profile's ficoco.first_reducing_layer.NAME, else the entry's default."""
    first = defaults.get("first_reducing_layer", {})
    starts = {name: spec.hyperparameters["first_layer"] for name, spec in METHODS.items()
              if "first_layer" in spec.hyperparameters}
    if not isinstance(first, dict):
        example = ", ".join(f'"{name}": {layer}' for name, layer in starts.items())
        raise FicocoError(f"ficoco.first_reducing_layer={first!r} must be a section such as {{{example}}}")
    return tuple((name, _whole(f"ficoco.first_reducing_layer.{name}", first.get(name, layer), low=0))
                 for name, layer in starts.items())


def architecture(profile: Profile, *, image_size: tuple[int, int] | None = None,
                 frames: int | None = None) -> Architecture:
    """Shapes of `profile`'s model for one image of `image_size` (H, W) or one video of `frames`."""
    cfg, defaults = profile.config, profile.defaults
    family = profile.family
    tcfg = cfg.get("text_config") or {}
    vcfg = cfg.get("vision_config") or {}
    first_layers = _first_reducing_layers(defaults)
    text_tokens = _whole("ficoco.text_tokens", defaults.get("text_tokens", 60))
    size = image_size or defaults.get("image_size") or None
    size = _size("ficoco.image_size", size) if size is not None else None
    newline_tokens = unpadding_drops = 0
    qwen_frames = None  # Qwen2-VL's and Qwen2.5-VL's video frames (Architecture.video_frames)
    cls_in_llm = image_newline = False
    if family in ("llava", "llava_next", "video_llava"):
        decoder = _llama_decoder(tcfg, _LLAMA_DEFAULTS)
        clip_defaults = _CLIP_DEFAULTS if family == "video_llava" else _LLAVA_CLIP_DEFAULTS
        feature = cfg.get("vision_feature_layer", -2)
        if family == "video_llava":
            items = _whole("ficoco.frames", defaults.get("frames", 8)) if frames is None else frames
            if items < 1:
                raise FicocoError(f"frames={items} must be at least 1")
            vision = _clip_tower(vcfg, clip_defaults, feature, image_px=None, items=items, towers=2)
            cls_in_llm = True
            visual = items * (vision.patches + 1)
        elif family == "llava":
            vision = _clip_tower(vcfg, clip_defaults, feature, image_px=None, items=1, towers=1)
            visual = vision.patches
        else:
            crop_px = _get(vcfg, "image_size", clip_defaults)
            size = size or (crop_px * 2, crop_px * 2)
            crops_h, crops_w = _anyres_crops(cfg, size, crop_px)
            vision = _clip_tower(vcfg, clip_defaults, feature, image_px=None, items=1 + crops_h * crops_w, towers=1)
            rows, cols = crops_h * vision.grid_h, crops_w * vision.grid_w
            kept_rows, kept_cols = unpadded_grid(rows, cols, size)
            newline_tokens = kept_rows
            unpadding_drops = rows * cols - kept_rows * kept_cols
            visual = vision.patches + kept_rows * kept_cols + newline_tokens
            image_newline = True
        projector = Projector(((vision.hidden, decoder.hidden), (decoder.hidden, decoder.hidden)), 0)
    elif family == "llava_onevision":
        decoder = _llama_decoder(tcfg, _QWEN2_TEXT_DEFAULTS, qkv_bias=True)
        feature = cfg.get("vision_feature_layer", -1)
        if cfg.get("vision_feature_select_strategy", "full") != "full":
            raise FicocoError("vision_feature_select_strategy must be 'full' for LLaVA-OneVision: SigLIP has no "
                              "[CLS] to drop")
        video_frames = frames if frames is not None else defaults.get("frames")
        image_newline = True
        if video_frames is not None:
            items = _whole("ficoco.frames", video_frames)
            vision = _siglip_tower(vcfg, feature, items=items)
            pooled = pooled_side(vision.grid_h) * pooled_side(vision.grid_w)
            # Every frame pooled 2x2, then one image_newline after the whole video (transformers' order).
            newline_tokens = 1
            visual = items * pooled + newline_tokens
            post_drops = items * (vision.patches - pooled)
            resampled = "every video frame is pooled 2x2 (bilinear) after the projector, which needs its whole grid"
            pooled_frames = (items, pooled)
            size = None
        else:
            crop_px = _get(vcfg, "image_size", _ONEVISION_SIGLIP_DEFAULTS)
            size = size or (crop_px * 2, crop_px * 2)
            crops_h, crops_w = _anyres_crops(cfg, size, crop_px)
            vision = _siglip_tower(vcfg, feature, items=1 + crops_h * crops_w)
            rows, cols = crops_h * vision.grid_h, crops_w * vision.grid_w
            kept_rows, kept_cols = unpadded_grid(rows, cols, size)
            budget = anyres_max_patches(cfg.get("vision_aspect_ratio", "anyres_max_9"))
            packed_rows, packed_cols = onevision_downscaled(kept_rows, kept_cols, vision.grid_h, budget)
            newline_tokens = packed_rows
            unpadding_drops = rows * cols - kept_rows * kept_cols
            post_drops = kept_rows * kept_cols - packed_rows * packed_cols
            resampled = "" if not post_drops else (
                f"the packed crop grid ({kept_rows}x{kept_cols}) exceeds anyres_max_{budget} and is downscaled "
                f"bilinearly to {packed_rows}x{packed_cols}, which needs the whole grid")
            pooled_frames = None
            visual = vision.patches + packed_rows * packed_cols + newline_tokens
        projector = Projector(((vision.hidden, decoder.hidden), (decoder.hidden, decoder.hidden)), 0)
        return Architecture(
            name=profile.name, family=family, vision=vision, projector=projector, decoder=decoder,
            visual_tokens=visual, newline_tokens=newline_tokens, cls_in_llm=False,
            unpadding_drops=unpadding_drops, image_newline_param=image_newline,
            text_tokens=text_tokens, first_reducing_layers=first_layers, image_size=size,
            post_projector_drops=post_drops, resampled=resampled, pooled_frames=pooled_frames,
        )
    elif family == "qwen2_vl":
        decoder = _llama_decoder(tcfg or cfg, _QWEN2_VL_TEXT_DEFAULTS, qkv_bias=True)
        d = _QWEN2_VL_VISION_DEFAULTS
        patch, merge = _get(vcfg, "patch_size", d), _get(vcfg, "spatial_merge_size", d)
        size = size or (672, 672)
        h_px, w_px = _qwen_image_pixels(size, patch, merge, "Qwen2-VL")
        embed = _get(vcfg, "embed_dim", d)
        layers = _get(vcfg, "depth", d)
        vision = VisionTower(
            kind="qwen2_vl", layers=layers, hidden=embed, ffn=embed * _get(vcfg, "mlp_ratio", d),
            heads=_get(vcfg, "num_heads", d), patch_size=patch, channels=_get(vcfg, "in_channels", d),
            temporal_patch=_get(vcfg, "temporal_patch_size", d), grid_h=h_px // patch, grid_w=w_px // patch,
            items=1, has_cls=False, feature_layer=layers - 1, merge=merge * merge, towers=1,
            position_embeddings=0,
        )
        merged = embed * merge * merge
        projector = Projector(((merged, merged), (merged, _get(vcfg, "hidden_size", d))), embed)
        qwen_frames = frames if frames is not None else defaults.get("frames")
        if qwen_frames is not None:  # a video: one tower item (attention segment) per temporal slice
            qwen_frames = _whole("ficoco.frames", qwen_frames)
            vision = replace(vision, items=-(-qwen_frames // vision.temporal_patch))
        visual = vision.items * vision.units
    elif family == "qwen2_5_vl":
        decoder = _llama_decoder(tcfg or cfg, _QWEN2_VL_TEXT_DEFAULTS, qkv_bias=True)
        d = _QWEN2_5_VL_VISION_DEFAULTS
        patch, merge = _get(vcfg, "patch_size", d), _get(vcfg, "spatial_merge_size", d)
        size = size or (672, 672)
        h_px, w_px = _qwen_image_pixels(size, patch, merge, "Qwen2.5-VL")
        embed = _get(vcfg, "hidden_size", d)
        layers = _get(vcfg, "depth", d)
        window_px = _get(vcfg, "window_size", d)
        window_groups = window_px // merge // patch
        if window_groups < 1:
            raise FicocoError(f"config value window_size={window_px} is smaller than one merge group "
                              f"({patch * merge} pixels); give a window of at least one group")
        full = vcfg.get("fullatt_block_indexes", d["fullatt_block_indexes"])
        if not isinstance(full, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in full):
            raise FicocoError(f"config value fullatt_block_indexes={full!r} must be a list of layer indices")
        grid_h, grid_w = h_px // patch, w_px // patch
        vision = VisionTower(
            kind="qwen2_5_vl", layers=layers, hidden=embed, ffn=_get(vcfg, "intermediate_size", d),
            heads=_get(vcfg, "num_heads", d), patch_size=patch, channels=_get(vcfg, "in_channels", d),
            temporal_patch=_get(vcfg, "temporal_patch_size", d), grid_h=grid_h, grid_w=grid_w,
            items=1, has_cls=False, feature_layer=layers - 1, merge=merge * merge, towers=1,
            position_embeddings=0,
            window_groups=qwen2_5_vl_windows(grid_h // merge, grid_w // merge, window_groups),
            full_attention_layers=frozenset(full),
        )
        merged = embed * merge * merge
        projector = Projector(((merged, merged), (merged, _get(vcfg, "out_hidden_size", d))), embed, 1)
        qwen_frames = frames if frames is not None else defaults.get("frames")
        if qwen_frames is not None:  # a video: every temporal slice an item, in its own windows (as Qwen2-VL)
            qwen_frames = _whole("ficoco.frames", qwen_frames)
            vision = replace(vision, items=-(-qwen_frames // vision.temporal_patch))
        visual = vision.items * vision.units
    else:  # profiles.load_profile admits only the families above
        raise FicocoError(f"family '{family}' has no accounting")
    return Architecture(
        name=profile.name, family=family, vision=vision, projector=projector, decoder=decoder,
        visual_tokens=visual, newline_tokens=newline_tokens, cls_in_llm=cls_in_llm,
        unpadding_drops=unpadding_drops, image_newline_param=image_newline,
        text_tokens=text_tokens, first_reducing_layers=first_layers, image_size=size,
        video_frames=qwen_frames,
    )


@dataclass(frozen=True)
class ParameterCounts:
    """Parameters by part; `linear_*` are the weights bitsandbytes quantizes."""

    vision: int
    projector: int
    decoder: int  # embedding, layers, final norm
    lm_head: int
    linear_vision: int
    linear_projector: int
    linear_decoder: int
    linear_rows: dict[str, int]  # output rows of the quantizable linears, per part (INT8 scales)
    linear_modules: dict[str, int]  # quantizable linear layers, per part (one NF4 code book each)

    @property
    def total(self) -> int:
        return self.vision + self.projector + self.decoder + self.lm_head


def parameter_counts(arch: Architecture) -> ParameterCounts:
    """Parameter counts computed from the shapes (checked against Hugging Face in the tests)."""
    v, p, dec = arch.vision, arch.projector, arch.decoder
    h, i = v.hidden, v.ffn
    # A vision layer: q, k, v, o and two MLP linears, all with bias; two LayerNorms.
    v_linear_w = 4 * h * h + 2 * h * i
    v_layer = v_linear_w + 4 * h + i + h + 2 * 2 * h
    if v.kind == "qwen2_5_vl":
        # q, k, v (one fused linear) and proj with bias; gate, up and down with bias; two RMSNorms.
        v_linear_w = 4 * h * h + 3 * h * i
        v_layer = v_linear_w + 4 * h + 2 * i + h + 2 * h
    patch_embed = v.channels * v.temporal_patch * v.patch_size**2 * h
    if v.kind == "clip":
        # class embedding, position embedding, pre- and post-LayerNorm
        tower_extra = h + v.position_embeddings * h + 2 * 2 * h
    elif v.kind == "siglip":
        # the patch convolution's bias, position embedding, post-LayerNorm
        tower_extra = h + v.position_embeddings * h + 2 * h
    else:
        tower_extra = 0
    vision = v.towers * (patch_embed + tower_extra + v.layers * v_layer)
    linear_vision = v.towers * v.layers * v_linear_w
    proj_w = sum(a * b for a, b in p.linears)
    projector = proj_w + sum(b for _, b in p.linears) + p.norm_params_per_dim * p.norm_dim
    if arch.image_newline_param:
        projector += dec.hidden
    q_out, kv_out = dec.heads * dec.head_dim, dec.kv_heads * dec.head_dim
    d_linear_w = dec.hidden * q_out * 2 + dec.hidden * kv_out * 2 + 3 * dec.hidden * dec.ffn
    d_layer = d_linear_w + 2 * dec.hidden + ((q_out + 2 * kv_out) if dec.qkv_bias else 0)
    decoder = dec.vocab * dec.hidden + dec.layers * d_layer + dec.hidden
    lm_head = 0 if dec.tied_embeddings else dec.vocab * dec.hidden
    rows = {
        "vision": v.towers * v.layers * ((4 * h + 2 * i + h) if v.kind == "qwen2_5_vl" else (4 * h + i + h)),
        "projector": sum(b for _, b in p.linears),
        "decoder": dec.layers * (q_out + 2 * kv_out + dec.hidden + 2 * dec.ffn + dec.hidden),
    }
    # CLIP: q, k, v, out and two MLP linears; Qwen2-VL's vision blocks fuse q, k, v into one.
    vision_layer_linears = {"clip": 6, "siglip": 6, "qwen2_vl": 4, "qwen2_5_vl": 5}[v.kind]
    modules = {"vision": v.towers * v.layers * vision_layer_linears, "projector": len(p.linears),
               "decoder": dec.layers * 7}
    return ParameterCounts(
        vision=vision, projector=projector, decoder=decoder, lm_head=lm_head, linear_vision=linear_vision,
        linear_projector=proj_w, linear_decoder=dec.layers * d_linear_w, linear_rows=rows, linear_modules=modules,
    )
