"""Qwen3.5's shapes (`Qwen3_5ForConditionalGeneration`): Qwen3-VL's tower and merger without DeepStack
(ficoco.accounting.families.qwen3_vl) before a hybrid decoder. Its `layer_types` (by default every
`full_attention_interval`-th layer full attention) make most layers Gated DeltaNet linear attention (q, k
and v from one projection through a depthwise causal convolution, a gated delta-rule recurrence over a
fixed state per value head, a gated RMSNorm, out_proj) and the rest grouped-query softmax attention with
QK-norm, partial rotary and a sigmoid gate on its output (q_proj gives twice the query width). No torch.

The multi-token-prediction layer of the checkpoints (`mtp_num_hidden_layers`) is not built by transformers'
class, so it is not counted.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ficoco.accounting.families.qwen3_vl import DEFAULT_IMAGE, qwen3_decoder, qwen3_vl_architecture, text_section
from ficoco.accounting.shapes import (
    FULL_ATTENTION,
    LINEAR_ATTENTION,
    Architecture,
    Family,
    Layout,
    LinearAttention,
    get,
)
from ficoco.errors import FicocoError

TITLE = "Qwen3.5"  # as the adapter's refusals name it (ficoco.models.qwen3_5's family_title)
# Qwen3_5TextConfig's defaults.
TEXT_DEFAULTS = {
    "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 32, "num_attention_heads": 16,
    "num_key_value_heads": 4, "head_dim": 256, "vocab_size": 248320, "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_num_key_heads": 16,
    "linear_num_value_heads": 32, "full_attention_interval": 4,
}


def layer_types(tcfg: dict[str, Any], layers: int) -> tuple[str, ...]:
    """Every layer's kind: the config's layer_types, else Qwen3_5TextConfig's pattern (every
    full_attention_interval-th layer full attention)."""
    given = tcfg.get("layer_types")
    if given is None:
        interval = get(tcfg, "full_attention_interval", TEXT_DEFAULTS)
        return tuple(LINEAR_ATTENTION if (i + 1) % interval else FULL_ATTENTION for i in range(layers))
    kinds = (FULL_ATTENTION, LINEAR_ATTENTION)
    if not isinstance(given, list) or not all(kind in kinds for kind in given):
        raise FicocoError(f"config value layer_types={given!r} must list {kinds[0]} or {kinds[1]} for every layer")
    if len(given) != layers:
        raise FicocoError(f"layer_types lists {len(given)} layers but num_hidden_layers={layers}: transformers' "
                          "config refuses it; give one entry per layer")
    return tuple(given)


def shape(cfg: dict[str, Any], layout: Layout) -> Architecture:
    """One image of `layout.image_size` (a 768 px square by default), or a video of `layout.frames`."""
    tcfg, _ = text_section(cfg, TEXT_DEFAULTS)
    decoder = qwen3_decoder(cfg, TEXT_DEFAULTS)
    d = TEXT_DEFAULTS
    linear = LinearAttention(
        key_heads=get(tcfg, "linear_num_key_heads", d), value_heads=get(tcfg, "linear_num_value_heads", d),
        key_head_dim=get(tcfg, "linear_key_head_dim", d), value_head_dim=get(tcfg, "linear_value_head_dim", d),
        conv_kernel=get(tcfg, "linear_conv_kernel_dim", d))
    if linear.value_heads % linear.key_heads:
        raise FicocoError(f"linear_num_value_heads={linear.value_heads} is not a multiple of linear_num_key_heads="
                          f"{linear.key_heads}: the delta rule repeats the key heads to the value heads; give a "
                          "multiple")
    kinds = layer_types(tcfg, decoder.layers)
    # transformers' Qwen3_5Attention always gates its output (there is no switch in the config class).
    decoder = replace(decoder, attn_output_gate=True, layer_types=kinds,
                      linear=linear if LINEAR_ATTENTION in kinds else None)
    return qwen3_vl_architecture(cfg, layout, decoder, TITLE, deepstack=False)


FAMILY = Family(name="qwen3_5", defaults={"text_tokens": 60, "image_size": list(DEFAULT_IMAGE)}, shape=shape,
                prefix_tokens=4, video_slices=True, takes_image_size=True, takes_frames=True, title=TITLE)
