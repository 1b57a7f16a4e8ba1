"""LLaVA-1.5's shapes (`LlavaForConditionalGeneration`): a CLIP ViT-L/14-336 tower whose
penultimate layer's patches ([CLS] dropped) a two-layer MLP projects, one LLM token per patch, into
a LLaMA decoder. No torch."""

from __future__ import annotations

from typing import Any

from ficoco.accounting.families.parts import clip_tower, llama_decoder
from ficoco.accounting.shapes import Architecture, Family, Layout, Projector

# LlamaConfig's defaults (LlavaConfig's default text model) for the fields the accountant reads.
LLAMA_DEFAULTS = {
    "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32,
    "vocab_size": 32000, "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
}
# LlavaConfig's default vision tower is CLIP ViT-L/14-336 (what LLaVA-1.5 uses).
LLAVA_CLIP_DEFAULTS = {
    "hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 24, "num_attention_heads": 16,
    "patch_size": 14, "image_size": 336, "num_channels": 3,
}
# LlamaConfig refuses a hidden size that is not a multiple of the heads (validate_architecture).
LLAMA_REFUSER = "transformers' LlamaConfig"


def llava_decoder(cfg: dict[str, Any]) -> Any:
    """The LLaMA decoder of a LLaVA-family config (LLaVA-1.5, LLaVA-NeXT, Video-LLaVA)."""
    return llama_decoder(cfg.get("text_config") or {}, LLAMA_DEFAULTS, heads_refuser=LLAMA_REFUSER)


def mlp_projector(vision_hidden: int, llm_hidden: int) -> Projector:
    """LLaVA's two-layer MLP projector (vision width -> LLM width -> LLM width)."""
    return Projector(((vision_hidden, llm_hidden), (llm_hidden, llm_hidden)), 0)


def shape(cfg: dict[str, Any], layout: Layout) -> Architecture:
    """One image: the tower's patches, one LLM token each."""
    decoder = llava_decoder(cfg)
    vision = clip_tower(cfg.get("vision_config") or {}, LLAVA_CLIP_DEFAULTS, cfg.get("vision_feature_layer", -2),
                        image_px=None, items=1, towers=1)
    return Architecture(
        name=layout.name, family=layout.family, vision=vision, projector=mlp_projector(vision.hidden, decoder.hidden),
        decoder=decoder, visual_tokens=vision.patches, newline_tokens=0, cls_in_llm=False, unpadding_drops=0,
        image_newline_param=False, text_tokens=layout.text_tokens,
        first_reducing_layers=layout.first_reducing_layers, image_size=layout.image_size,
    )


FAMILY = Family(name="llava", defaults={"text_tokens": 60}, shape=shape, prefix_tokens=5)
