"""The shapes the accountant counts (one `Architecture` per model and input layout), the record of a
family's shape module, and the readers of config values every shape module shares.

No torch and no transformers: a family's shape module (ficoco.accounting.families) reads a Hugging Face
config dict with its config classes' defaults, so that a bare config gives the shapes `from_config`
builds, and refuses a geometry its transformers classes refuse.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ficoco.errors import FicocoError
from ficoco.profile_records import MAX_COUNT

# The accountant counts layer by layer (and a budget search counts a model many times): a config
# with millions of layers would run for hours. No released model has more than a few hundred.
MAX_LAYERS = 1000


@dataclass(frozen=True)
class VisionTower:
    """The vision encoder: per-item token grid and per-layer widths.

    An item is what the tower sees as one batch element: the single image of LLaVA-1.5,
    a crop of LLaVA-NeXT's AnyRes, a frame of Video-LLaVA, one image of Qwen2-VL.
    """

    kind: str  # the tower's kind, as its family's shape module names it ("clip", "siglip", ...)
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
    # A layer's linears: q, k and v fused into one (Qwen2-VL's towers), and a gated MLP of three linears with
    # biases and RMSNorms (Qwen2.5-VL's); else q, k, v, out and two MLP linears, and LayerNorms (CLIP, SigLIP).
    fused_qkv: bool = False
    gated_mlp: bool = False
    # Parameters beyond what the kind's layout gives, computed by the family's shape module (InternViT: layer
    # scale, q/k norms and absent biases per layer; [CLS], positions, mask token and final norm per tower).
    extra_layer_params: int = 0
    extra_tower_params: int = 0
    # The MLP's activation as transformers names it (the config's hidden_act), where the family reads it: the rate
    # probe times it (a tanh GELU over tokens x the FFN width costs several times its bytes); "" elsewhere.
    act: str = ""

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


FULL_ATTENTION = "full_attention"
LINEAR_ATTENTION = "linear_attention"


@dataclass(frozen=True)
class LinearAttention:
    """A Gated DeltaNet layer's widths (Qwen3.5's `linear_*` config keys): q and k of `key_heads` heads of
    `key_head_dim`, v of `value_heads` heads of `value_head_dim`, a depthwise causal convolution of
    `conv_kernel` taps over q, k and v, and per value head a recurrent state of key_head_dim x value_head_dim
    (the heads of q and k repeated to the value heads)."""

    key_heads: int
    value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int

    @property
    def key_dim(self) -> int:
        return self.key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.value_heads * self.value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the causal convolution: q, k and v."""
        return 2 * self.key_dim + self.value_dim

    @property
    def state_elems(self) -> int:
        """The recurrent state of one sequence: value_heads x key_head_dim x value_head_dim."""
        return self.value_heads * self.key_head_dim * self.value_head_dim

    @property
    def conv_state_elems(self) -> int:
        """The convolution's state of one sequence: the last conv_kernel inputs of every channel (transformers
        keeps the kernel's width, one tap more than the convolution needs)."""
        return self.conv_dim * self.conv_kernel


@dataclass(frozen=True)
class Experts:
    """A sparse mixture-of-experts FFN (Qwen3-VL-MoE's): a router (hidden x experts) picks `top_k` of `experts`
    gated FFNs of width `ffn` for every token, in the decoder layers `layers` (the others keep the dense FFN)."""

    experts: int
    top_k: int
    ffn: int
    layers: frozenset[int]


@dataclass(frozen=True)
class Decoder:
    """The LLM decoder: LLaMA-style layers with grouped-query attention and a gated FFN; Qwen3's add a per-head
    RMSNorm on q and k (`qk_norm`), Qwen3.5's a sigmoid gate on the attention output (`attn_output_gate`: q_proj
    gives twice the query width) and Gated DeltaNet layers (`layer_types`, `linear`), Qwen3-VL-MoE's sparse
    expert FFNs (`moe`)."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    qkv_bias: bool
    tied_embeddings: bool
    o_bias: bool = False  # Qwen3's attention_bias gives o_proj a bias too (Qwen2's: q, k and v only)
    qk_norm: bool = False
    attn_output_gate: bool = False
    # One entry per layer, FULL_ATTENTION or LINEAR_ATTENTION; empty: every layer full attention.
    layer_types: tuple[str, ...] = ()
    linear: LinearAttention | None = None
    moe: Experts | None = None

    def full_attention(self, layer: int) -> bool:
        """Whether `layer` is softmax attention over a KV cache (not a Gated DeltaNet layer)."""
        return not self.layer_types or self.layer_types[layer] == FULL_ATTENTION

    @property
    def full_attention_layers(self) -> int:
        return sum(self.full_attention(layer) for layer in range(self.layers))

    def sparse(self, layer: int) -> bool:
        """Whether `layer`'s FFN is the mixture of experts."""
        return self.moe is not None and layer in self.moe.layers


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
    # Qwen3-VL's DeepStack: the tower layers (0-based) whose output goes through a merger of its own (the
    # projector's linears, LayerNorm over the merged width); the k-th one's features are added to the visual
    # positions of the hidden states after decoder layer k.
    deepstack_layers: tuple[int, ...] = ()

    def first_reducing_layer(self, method: str) -> int:
        """The first layer method `method` reduces at by default (its entry's `first_layer`, or the profile's)."""
        layers = dict(self.first_reducing_layers)
        if method not in layers:
            raise FicocoError(f"{method} has no first reducing layer (its registry entry has no first_layer)")
        return layers[method]

    @property
    def cls_to_projector(self) -> bool:
        """Whether a cut before the projector could hand an item's [CLS] on among its tokens (VisionZip's official
        layout): the tower has [CLS], the projector maps single patches (not InternVL's pixel-shuffle groups) and
        the model does not hand [CLS] to the LLM itself (Video-LLaVA does)."""
        return self.vision.has_cls and self.vision.merge == 1 and not self.cls_in_llm

    @property
    def anyres_crops(self) -> int:
        """The crops of an AnyRes image laid out on one grid after its base view (LLaVA-NeXT, LLaVA-OneVision: every
        tower item but the first; 0 for an image without crops, a video, and every other family)."""
        return self.vision.items - 1 if self.image_newline_param and self.pooled_frames is None else 0

    def llm_visual_tokens(self, units_per_item: int) -> int:
        """Visual tokens in the LLM when every item keeps `units_per_item` units."""
        if units_per_item == self.vision.units:
            return self.visual_tokens
        per_item = units_per_item + int(self.cls_in_llm)
        return self.vision.items * per_item + self.newline_tokens


def whole(key: str, value: Any, low: int = 1, high: int = MAX_COUNT) -> int:
    """A config count: a whole number in [low, high] (JSON's 4.0 and true are not)."""
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise FicocoError(f"config value {key}={value!r} must be a whole number from {low} to {high}")
    return value


def get(cfg: dict[str, Any], key: str, defaults: dict[str, Any]) -> Any:
    value = cfg.get(key)
    value = defaults[key] if value is None else value
    if isinstance(defaults[key], int) and not isinstance(defaults[key], bool):
        high = MAX_LAYERS if key in ("num_hidden_layers", "depth") else MAX_COUNT
        return whole(key, value, high=high)
    return value


def size(key: str, value: Any) -> tuple[int, int]:
    """An image size in pixels: [height, width]."""
    if not (isinstance(value, (list, tuple)) and len(value) == 2
            and all(isinstance(x, int) and not isinstance(x, bool) and 1 <= x <= MAX_COUNT for x in value)):
        shown = list(value) if isinstance(value, tuple) else value
        raise FicocoError(f"config value {key}={shown!r} must be [height, width] in whole pixels from 1 to {MAX_COUNT}")
    return value[0], value[1]


def feature_layer(value: Any, layers: int) -> int:
    """0-based layer whose output hidden_states[value] is (hidden_states[0] is the embedding)."""
    indices = value if isinstance(value, list) else [value]
    if not indices or not all(isinstance(i, int) and not isinstance(i, bool) for i in indices):
        raise FicocoError(f"config value vision_feature_layer={value!r} must be a layer index or a list of them")
    index = max(indices)
    index = index + layers + 1 if index < 0 else index
    if not 1 <= index <= layers:
        raise FicocoError(f"vision_feature_layer {value} is outside a {layers}-layer tower")
    return index - 1


@dataclass(frozen=True)
class Layout:
    """What a family's shape module plans for, besides the config: the profile's name and toolkit
    defaults, and the input (an image of `image_size` (H, W), or the `frames` asked for; None: the
    profile's default)."""

    name: str
    family: str
    defaults: dict[str, Any]
    text_tokens: int
    first_reducing_layers: tuple[tuple[str, int], ...]
    image_size: tuple[int, int] | None
    frames: int | None


@dataclass(frozen=True)
class Family:
    """One model family as the accountant knows it: its `model_type`, the toolkit's defaults for a
    bare config.json of it (`ficoco` section), the inputs it takes, and its shape function
    (config dict, layout) -> Architecture."""

    name: str
    defaults: dict[str, Any]
    shape: Callable[[dict[str, Any], Layout], Architecture]
    # Text tokens before the visual span in the family's template ("USER: <image>\n..." is 5), the same
    # the model adapters' synthetic inputs use: the prompt's text after the visual span is the rest.
    prefix_tokens: int
    takes_image_size: bool = False
    takes_frames: bool = False
    # The input is an image or a video, not both (frames= makes it a video of frames at the tower's own
    # size); else frames= and image_size= together give a video of frames of that size.
    image_or_video: bool = False
    # A video reaches the LLM as temporal slices of merge groups (Qwen2-VL): a video method merges those
    # slices, and an image is a single slice it cannot run on.
    video_slices: bool = False
    # The family's name in a sentence ("Qwen3.5"), where the accountant refuses in its adapter's words (a hybrid
    # decoder's placement rule, ficoco.methods.hybrid); empty: its model_type.
    title: str = ""
    # The profile defaults, with the family named first (as a profile's ficoco section has it).
    profile_defaults: dict[str, Any] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "profile_defaults", {"family": self.name, **self.defaults})


def check_divisible(section: str, key: str, value: int, by_key: str, by: int, refuser: str) -> None:
    """Refuse `section.key=value` when it is not a multiple of `section.by_key=by`, as transformers'
    `refuser` does (a config class's validator, or a module's constructor or reshape)."""
    if by and value % by:
        prefix = f"{section}." if section else ""
        raise FicocoError(f"{prefix}{key}={value} is not divisible by {prefix}{by_key}={by}; {refuser} refuses "
                          f"it: give a {key} that is a multiple of {by_key}")
