"""Per-layer shapes of a multimodal model, read from its profile: the family's shape module
(ficoco.accounting.families) turns the Hugging Face config dict into an `Architecture`; the
parameter counts follow from the shapes.

No torch and no transformers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ficoco.accounting.families import FAMILIES
from ficoco.accounting.shapes import (  # noqa: F401  (their home before; read from here by the accountant)
    MAX_LAYERS,
    Architecture,
    Decoder,
    Layout,
    Projector,
    VisionTower,
    size,
    whole,
)
from ficoco.errors import FicocoError
from ficoco.methods.registry import METHODS
from ficoco.profile_records import Profile


def _first_reducing_layers(defaults: dict[str, Any]) -> tuple[tuple[str, int], ...]:
    """The first reducing layer of every registered method that has one (a `first_layer`
    hyperparameter): the profile's ficoco.first_reducing_layer.NAME, else the entry's default."""
    first = defaults.get("first_reducing_layer", {})
    starts = {name: spec.hyperparameters["first_layer"] for name, spec in METHODS.items()
              if "first_layer" in spec.hyperparameters}
    if not isinstance(first, dict):
        example = ", ".join(f'"{name}": {layer}' for name, layer in starts.items())
        raise FicocoError(f"ficoco.first_reducing_layer={first!r} must be a section such as {{{example}}}")
    return tuple((name, whole(f"ficoco.first_reducing_layer.{name}", first.get(name, layer), low=0))
                 for name, layer in starts.items())


def architecture(profile: Profile, *, image_size: tuple[int, int] | None = None,
                 frames: int | None = None) -> Architecture:
    """Shapes of `profile`'s model for one image of `image_size` (H, W) or one video of `frames`."""
    family = FAMILIES.get(profile.family)
    if family is None:  # profiles.load_profile admits only the families of the table
        raise FicocoError(f"family '{profile.family}' has no accounting")
    defaults = profile.defaults
    first_layers = _first_reducing_layers(defaults)
    text_tokens = whole("ficoco.text_tokens", defaults.get("text_tokens", 60))
    image = image_size or defaults.get("image_size") or None
    layout = Layout(name=profile.name, family=profile.family, defaults=defaults, text_tokens=text_tokens,
                    first_reducing_layers=first_layers,
                    image_size=size("ficoco.image_size", image) if image is not None else None, frames=frames)
    return family.shape(profile.config, layout)


@dataclass(frozen=True)
class ParameterCounts:
    """Parameters by part; `linear_*` are the weights bitsandbytes quantizes (nn.Linear layers: a sparse
    layer's router and experts are plain parameters it leaves unquantized)."""

    vision: int
    projector: int
    decoder: int  # embedding, layers, final norm
    lm_head: int
    linear_vision: int
    linear_projector: int
    linear_decoder: int
    linear_rows: dict[str, int]  # output rows of the quantizable linears, per part (INT8 scales)
    linear_modules: dict[str, int]  # quantizable linear layers, per part (one NF4 code book each)
    # The decoder's quantizable linear weights layer by layer (layers differ on a hybrid or sparse decoder).
    linear_decoder_layers: tuple[int, ...] = ()

    @property
    def total(self) -> int:
        return self.vision + self.projector + self.decoder + self.lm_head


@dataclass(frozen=True)
class LayerParameters:
    """One decoder layer's parameters: all of them, its nn.Linear weights, their output rows and count."""

    total: int
    linear: int
    rows: int
    modules: int


def decoder_layer_parameters(arch: Architecture, layer: int) -> LayerParameters:
    """Decoder layer `layer`'s parameters: its mixer (softmax attention, or a Gated DeltaNet), its FFN (dense
    or sparse) and its two RMSNorms."""
    dec = arch.decoder
    h = dec.hidden
    total = linear = rows = modules = 0
    if dec.full_attention(layer):
        q_out, kv_out = dec.heads * dec.head_dim, dec.kv_heads * dec.head_dim
        q_rows = 2 * q_out if dec.attn_output_gate else q_out
        linear += h * q_rows + 2 * h * kv_out + q_out * h
        rows += q_rows + 2 * kv_out + h
        modules += 4
        total += (q_rows + 2 * kv_out if dec.qkv_bias else 0) + (h if dec.o_bias else 0)
        total += 2 * dec.head_dim if dec.qk_norm else 0
    else:
        lin = dec.linear
        assert lin is not None
        outs = (lin.conv_dim, lin.value_dim, lin.value_heads, lin.value_heads)  # in_proj_qkv, _z, _b, _a
        linear += h * sum(outs) + lin.value_dim * h  # and out_proj
        rows += sum(outs) + h
        modules += 5
        # the depthwise convolution (no bias), dt_bias and A_log per value head, the gated norm's weight
        total += lin.conv_dim * lin.conv_kernel + 2 * lin.value_heads + lin.value_head_dim
    if dec.sparse(layer):
        moe = dec.moe
        assert moe is not None
        # the router and every expert's fused gate/up and down matrices: parameters, not nn.Linear layers
        total += moe.experts * h + moe.experts * 3 * h * moe.ffn
    else:
        linear += 3 * h * dec.ffn
        rows += 2 * dec.ffn + h
        modules += 3
    total += linear + 2 * h
    return LayerParameters(total=total, linear=linear, rows=rows, modules=modules)


def parameter_counts(arch: Architecture) -> ParameterCounts:
    """Parameter counts computed from the shapes (checked against Hugging Face in the tests)."""
    v, p, dec = arch.vision, arch.projector, arch.decoder
    h, i = v.hidden, v.ffn
    # A vision layer: q, k, v, o and two MLP linears, all with bias; two LayerNorms.
    v_linear_w = 4 * h * h + 2 * h * i
    v_layer = v_linear_w + 4 * h + i + h + 2 * 2 * h
    if v.gated_mlp:
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
    elif v.kind == "qwen3_vl":
        # the patch convolution's bias and the learned position grid (resampled to every image's grid)
        tower_extra = h + v.position_embeddings * h
    elif v.kind == "internvl":
        # InternViT: CLIP's layer plus the shape module's extras (layer scale, q/k norms, biases it lacks).
        tower_extra = v.extra_tower_params
        v_layer += v.extra_layer_params
    else:
        tower_extra = 0
    vision = v.towers * (patch_embed + tower_extra + v.layers * v_layer)
    linear_vision = v.towers * v.layers * v_linear_w
    # The merger, and Qwen3-VL's DeepStack mergers: the same linears, each with a LayerNorm over the merged width.
    mergers = 1 + len(arch.deepstack_layers)
    merged = h * v.merge
    proj_w = mergers * sum(a * b for a, b in p.linears)
    projector = (proj_w + mergers * sum(b for _, b in p.linears) + p.norm_params_per_dim * p.norm_dim
                 + len(arch.deepstack_layers) * 2 * merged)
    if arch.image_newline_param:
        projector += dec.hidden
    layers = [decoder_layer_parameters(arch, layer) for layer in range(dec.layers)]
    decoder = dec.vocab * dec.hidden + sum(layer.total for layer in layers) + dec.hidden
    lm_head = 0 if dec.tied_embeddings else dec.vocab * dec.hidden
    rows = {
        "vision": v.towers * v.layers * ((4 * h + 2 * i + h) if v.gated_mlp else (4 * h + i + h)),
        "projector": mergers * sum(b for _, b in p.linears),
        "decoder": sum(layer.rows for layer in layers),
    }
    # CLIP: q, k, v, out and two MLP linears; Qwen2-VL's vision blocks fuse q, k, v into one (and
    # Qwen2.5-VL's MLP is gated: three linears).
    vision_layer_linears = (2 + (3 if v.gated_mlp else 2)) if v.fused_qkv else 6
    modules = {"vision": v.towers * v.layers * vision_layer_linears, "projector": mergers * len(p.linears),
               "decoder": sum(layer.modules for layer in layers)}
    return ParameterCounts(
        vision=vision, projector=projector, decoder=decoder, lm_head=lm_head, linear_vision=linear_vision,
        linear_projector=proj_w, linear_decoder=sum(layer.linear for layer in layers), linear_rows=rows,
        linear_modules=modules, linear_decoder_layers=tuple(layer.linear for layer in layers),
    )
