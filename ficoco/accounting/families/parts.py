"""The parts several families' shape modules are built from: a CLIP or SigLIP-like ViT with learned
positions, and a LLaMA-style decoder. Each reads its config section with the defaults its family's
config class gives, and refuses what that family's transformers classes refuse. No torch."""

from __future__ import annotations

from typing import Any

from ficoco.accounting.shapes import Decoder, VisionTower, check_divisible, feature_layer, get, whole
from ficoco.errors import FicocoError


def clip_tower(vcfg: dict[str, Any], defaults: dict[str, Any], feature: Any, *, image_px: int | None,
               items: int, towers: int) -> VisionTower:
    """CLIP's vision tower (a [CLS] and learned positions); `feature` is vision_feature_layer."""
    layers = get(vcfg, "num_hidden_layers", defaults)
    patch = get(vcfg, "patch_size", defaults)
    size = image_px or get(vcfg, "image_size", defaults)
    grid = size // patch
    if grid < 1:
        raise FicocoError(f"config value image_size={size} is smaller than patch_size={patch}: no patch fits")
    hidden, heads = get(vcfg, "hidden_size", defaults), get(vcfg, "num_attention_heads", defaults)
    check_divisible("vision_config", "hidden_size", hidden, "num_attention_heads", heads,
                    "transformers' CLIPVisionConfig")
    return VisionTower(
        kind="clip", layers=layers, hidden=hidden,
        ffn=get(vcfg, "intermediate_size", defaults), heads=heads,
        patch_size=patch, channels=get(vcfg, "num_channels", defaults), temporal_patch=1,
        grid_h=grid, grid_w=grid, items=items, has_cls=True,
        feature_layer=feature_layer(feature, layers), merge=1, towers=towers,
        position_embeddings=grid * grid + 1,
    )


def llama_decoder(tcfg: dict[str, Any], defaults: dict[str, Any], *, qkv_bias: bool | None = None,
                  section: str = "text_config", heads_refuser: str | None = None) -> Decoder:
    """A LLaMA-style decoder (grouped-query attention, gated FFN) read from `tcfg` (the config's
    `section`). `heads_refuser`: the transformers class that refuses a hidden size that is not a
    multiple of the heads (None where the family's classes take one, with head_dim = hidden // heads)."""
    hidden = get(tcfg, "hidden_size", defaults)
    heads = get(tcfg, "num_attention_heads", defaults)
    kv_heads = get(tcfg, "num_key_value_heads", {"num_key_value_heads": heads})
    if heads % kv_heads:
        raise FicocoError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
    if not tcfg.get("head_dim") and hidden < heads:
        raise FicocoError(f"config value hidden_size={hidden} is smaller than num_attention_heads={heads}")
    if heads_refuser is not None:
        check_divisible(section, "hidden_size", hidden, "num_attention_heads", heads, heads_refuser)
    head_dim = tcfg.get("head_dim") or hidden // heads  # unset (or 0): Hugging Face's hidden // heads
    return Decoder(
        layers=get(tcfg, "num_hidden_layers", defaults), hidden=hidden, heads=heads, kv_heads=kv_heads,
        head_dim=whole("head_dim", head_dim), ffn=get(tcfg, "intermediate_size", defaults),
        vocab=get(tcfg, "vocab_size", defaults),
        qkv_bias=bool(tcfg.get("attention_bias", False)) if qkv_bias is None else qkv_bias,
        tied_embeddings=bool(tcfg.get("tie_word_embeddings", False)),
    )
