"""Qwen3-VL-MoE's shapes (`Qwen3VLMoeForConditionalGeneration`): Qwen3-VL's tower, merger and DeepStack
(ficoco.accounting.families.qwen3_vl) before a Qwen3 decoder whose FFNs are sparse mixtures of experts: a
router (hidden x experts, no bias) picks `num_experts_per_tok` of `num_experts` gated FFNs of
`moe_intermediate_size` for every token, in the layers with (layer + 1) a multiple of `decoder_sparse_step`
outside `mlp_only_layers` (those keep a dense FFN of `intermediate_size`). No shared expert. No torch."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ficoco.accounting.families.qwen3_vl import DEFAULT_IMAGE, qwen3_decoder, qwen3_vl_architecture, text_section
from ficoco.accounting.shapes import Architecture, Experts, Family, Layout, get, whole
from ficoco.errors import FicocoError

# Qwen3VLMoeTextConfig's defaults (its head_dim unset: hidden_size // num_attention_heads).
TEXT_DEFAULTS = {
    "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 24, "num_attention_heads": 16,
    "num_key_value_heads": 16, "vocab_size": 151936, "num_experts": 60, "num_experts_per_tok": 4,
    "moe_intermediate_size": 1408, "decoder_sparse_step": 1, "mlp_only_layers": [],
}


def experts(tcfg: dict[str, Any], layers: int) -> Experts | None:
    """The sparse layers and their experts, as Qwen3VLMoeTextDecoderLayer chooses them (None: no layer is sparse)."""
    d = TEXT_DEFAULTS
    # A checkpoint's config.json says num_experts; transformers' config class stores it as num_local_experts
    # (its attribute_map), so a config saved from a built model says that instead.
    given = tcfg.get("num_experts", tcfg.get("num_local_experts"))
    count = whole("num_experts", d["num_experts"] if given is None else given, low=0)
    step = get(tcfg, "decoder_sparse_step", d)
    dense = tcfg.get("mlp_only_layers", [])
    if not isinstance(dense, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in dense):
        raise FicocoError(f"config value mlp_only_layers={dense!r} must be a list of decoder layer indices")
    sparse = frozenset(layer for layer in range(layers)
                       if layer not in dense and count > 0 and (layer + 1) % step == 0)
    if not sparse:
        return None
    top_k = get(tcfg, "num_experts_per_tok", d)
    if top_k > count:
        raise FicocoError(f"config value num_experts_per_tok={top_k} exceeds num_experts={count}: torch.topk "
                          "refuses to pick more experts than there are; give at most num_experts")
    return Experts(experts=count, top_k=top_k, ffn=get(tcfg, "moe_intermediate_size", d), layers=sparse)


def shape(cfg: dict[str, Any], layout: Layout) -> Architecture:
    """One image of `layout.image_size` (a 768 px square by default), or a video of `layout.frames`."""
    decoder = qwen3_decoder(cfg, TEXT_DEFAULTS)
    tcfg, _ = text_section(cfg, TEXT_DEFAULTS)
    decoder = replace(decoder, moe=experts(tcfg, decoder.layers))
    return qwen3_vl_architecture(cfg, layout, decoder, "Qwen3-VL-MoE")


FAMILY = Family(name="qwen3_vl_moe", defaults={"text_tokens": 60, "image_size": list(DEFAULT_IMAGE)}, shape=shape,
                prefix_tokens=4, video_slices=True, takes_image_size=True, takes_frames=True)
