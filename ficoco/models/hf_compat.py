"""Every contact ficoco has with transformers' internals, in one place.

ficoco patches Hugging Face models from the outside: it wraps forwards and reads their keyword
arguments, reaches submodules by attribute, calls functions of the model files and registers
attention functions. None of that is transformers' public API, and it moves between releases
(5.24 renamed the cache argument `past_key_values` to `cache`, in every model, layer and
output). So every such name, path and call shape lives here and nowhere else: the adapters
(llava.py, qwen2_vl/, ...), the hook points (llm_steps.py, vision_steps.py, attention.py), the
builder and the profiler read them through this module.

Each contact is registered with a check (`@contact`) that looks at the installed release (a
signature, an attribute, a function's presence) and raises `ContactChanged`: one line that names
the contact and what changed. `check_contacts()` runs them all; `check_model(model)` also checks
the attribute paths of one built model. tests/test_transformers_contract.py runs both for every
family before any behavioural test, and `ficoco.build_model` and `ficoco.apply` run them (once) on
a release outside the tested range, after one warning line, so a renamed internal is named instead
of crashing deep in a build or a forward (`apply` checks the model's paths on every release).
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import inspect
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, fields
from functools import cache
from typing import Any

import torch
from torch import nn

from ficoco.errors import FicocoError

# -- the registry ---------------------------------------------------------------------------


class ContactChanged(FicocoError):
    """The installed transformers no longer offers something ficoco's patches rely on."""

    def __init__(self, contact: str, detail: str) -> None:
        from ficoco.versions import installed_version, tested_ranges

        tested = tested_ranges().get("transformers", "")
        super().__init__(f"transformers {installed_version('transformers')} changed a contact ficoco patches "
                         f"({contact}: {detail}); install a tested release: pip install 'transformers{tested}'")
        self.contact = contact


@dataclass(frozen=True)
class Contact:
    """One thing ficoco relies on, and how to check it against the installed release."""

    name: str
    check: Callable[[], None]


CONTACTS: dict[str, Contact] = {}


def contact(name: str) -> Callable[[Callable[[], None]], Callable[[], None]]:
    """Register a check of the installed release under `name` (its failure names it)."""

    def register(check: Callable[[], None]) -> Callable[[], None]:
        CONTACTS[name] = Contact(name, check)
        return check

    return register


def check_contacts() -> list[str]:
    """Every registered contact checked against the installed release: the one-line message of each
    that changed (empty: all hold)."""
    problems = []
    for entry in CONTACTS.values():
        try:
            entry.check()
        except ContactChanged as exc:
            problems.append(str(exc))
        except (ImportError, AttributeError, TypeError, ValueError) as exc:
            problems.append(str(ContactChanged(entry.name, f"{type(exc).__name__}: {exc}")))
    return problems


def _module(name: str) -> Any:
    return importlib.import_module(f"transformers.{name}")


def _parameters(function: Callable[..., Any]) -> list[str]:
    # inspect.signature follows functools.wraps (transformers' deprecation decorators) to the
    # function's own parameters.
    return list(inspect.signature(function).parameters)


def _require_parameters(contact_name: str, function: Callable[..., Any], *names: str) -> None:
    present = _parameters(function)
    missing = [name for name in names if name not in present]
    if missing:
        raise ContactChanged(contact_name, f"{function.__qualname__} takes no {', '.join(missing)} "
                                           f"(it takes {', '.join(p for p in present if p != 'self')})")


def _require_attribute(contact_name: str, owner: Any, name: str) -> Any:
    if not hasattr(owner, name):
        label = getattr(owner, "__name__", type(owner).__name__)
        raise ContactChanged(contact_name, f"{label} has no '{name}'")
    return getattr(owner, name)


# -- the cache keyword ----------------------------------------------------------------------
# transformers 5.24 calls the cache `cache` in every forward (model, decoder layer, attention),
# in generate's keyword arguments and in the outputs; earlier 5.x releases call it
# `past_key_values`. 5.24 still accepts the old name with a deprecation warning, so a caller may
# use either: `cache_in` reads both, and ficoco itself passes the installed release's name.
CACHE_NAMES = ("cache", "past_key_values")


@cache
def cache_keyword() -> str:
    """The installed release's name for the cache argument of forward and generate."""
    from transformers.models.llama.modeling_llama import LlamaModel

    present = _parameters(LlamaModel.forward)
    found = next((name for name in CACHE_NAMES if name in present), None)
    if found is None:
        raise ContactChanged("cache keyword", f"LlamaModel.forward takes none of {', '.join(CACHE_NAMES)}")
    return found


@cache
def output_cache_field() -> str:
    """The installed release's name for the cache field of a model's output."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    present = [f.name for f in fields(CausalLMOutputWithPast)]
    found = next((name for name in CACHE_NAMES if name in present), None)
    if found is None:
        raise ContactChanged("output cache field", f"CausalLMOutputWithPast has none of {', '.join(CACHE_NAMES)}")
    return found


def cache_in(call: Mapping[str, Any]) -> Any:
    """The cache a forward or generate call was given, under either name (None: none)."""
    for name in CACHE_NAMES:
        value = call.get(name)
        if value is not None:
            return value
    return None


def cache_argument(cache_object: Any) -> dict[str, Any]:
    """Keyword arguments that hand `cache_object` to the installed release's forward or generate."""
    return {cache_keyword(): cache_object}


def output_cache(output: Any) -> Any:
    """The cache a forward or generate output holds (None: none)."""
    return getattr(output, output_cache_field(), None)


@contact("cache keyword")
def _check_cache_keyword() -> None:
    from transformers.models.llama import modeling_llama as llama
    from transformers.models.llava import modeling_llava as llava
    from transformers.models.qwen2_vl import modeling_qwen2_vl as qwen2_vl

    name = cache_keyword()
    for function in (llama.LlamaModel.forward, llama.LlamaDecoderLayer.forward, llama.LlamaAttention.forward,
                     llava.LlavaForConditionalGeneration.forward, qwen2_vl.Qwen2VLForConditionalGeneration.forward,
                     qwen2_vl.Qwen2VLDecoderLayer.forward, qwen2_vl.Qwen2VLAttention.forward):
        _require_parameters("cache keyword", function, name)
    if output_cache_field() != name:
        raise ContactChanged("cache keyword", f"forward takes '{name}' but outputs hold '{output_cache_field()}'")


# -- decoder layers, attention and their call shapes ----------------------------------------
# The patched decoder layers take these by keyword (the model calls its layers with them as
# keywords; tests/test_transformers_contract.py checks the call) and pass everything else on.
DECODER_LAYER_KEYWORDS = ("attention_mask", "position_ids", "position_embeddings")


@contact("decoder layer call")
def _check_decoder_layers() -> None:
    from transformers.models.llama import modeling_llama as llama
    from transformers.models.qwen2_vl import modeling_qwen2_vl as qwen2_vl

    for layer in (llama.LlamaDecoderLayer, qwen2_vl.Qwen2VLDecoderLayer):
        _require_parameters("decoder layer call", layer.forward, "hidden_states", *DECODER_LAYER_KEYWORDS)
        if _parameters(layer.forward)[1] != "hidden_states":
            raise ContactChanged("decoder layer call", f"{layer.__name__}.forward's first input is not hidden_states")
    for attention in (llama.LlamaAttention, qwen2_vl.Qwen2VLAttention):
        _require_parameters("decoder layer call", attention.forward, "hidden_states", "attention_mask",
                            "position_embeddings")


@dataclass(frozen=True)
class LayerParts:
    """A layer's submodules, by the attribute names its model file gives them: the patches
    re-compose a reducing layer from them (norm, attention, residual, norm, MLP)."""

    attention: str
    input_norm: str
    post_norm: str
    mlp: str


# LLaMA and Qwen2 decoder layers, CLIP encoder layers, Qwen2-VL vision blocks.
DECODER_LAYER = LayerParts("self_attn", "input_layernorm", "post_attention_layernorm", "mlp")
CLIP_LAYER = LayerParts("self_attn", "layer_norm1", "layer_norm2", "mlp")
QWEN2_VL_VISION_BLOCK = LayerParts("attn", "norm1", "norm2", "mlp")


@dataclass(frozen=True)
class Parts:
    """One layer's submodules (see LayerParts)."""

    attention: nn.Module
    input_norm: nn.Module
    post_norm: nn.Module
    mlp: nn.Module


def layer_parts(layer: nn.Module, names: LayerParts) -> Parts:
    """`layer`'s attention, norms and MLP, found by `names`."""
    found = {f.name: _require_attribute(f"{type(layer).__name__} parts", layer, getattr(names, f.name))
             for f in fields(names)}
    return Parts(**found)


# The attention modules' attributes PDrop's own-row recomputation reads (decoder attention).
ATTENTION_ATTRIBUTES = ("q_proj", "k_proj", "head_dim", "scaling")


def attention_projections(attention: nn.Module) -> tuple[nn.Module, nn.Module, int, float]:
    """(q_proj, k_proj, head_dim, scaling) of a decoder attention module."""
    q_proj, k_proj, head_dim, scaling = (_require_attribute(f"{type(attention).__name__} attributes", attention, name)
                                         for name in ATTENTION_ATTRIBUTES)
    return q_proj, k_proj, head_dim, scaling


# -- attribute paths of the families ---------------------------------------------------------
# From the top-level ...ForConditionalGeneration model; checked per built model (`check_model`).


def inner_model(model: nn.Module) -> nn.Module:
    """The base model under the generation head (`model.model`)."""
    return _require_attribute("model layout", model, "model")


def language_model(model: nn.Module) -> nn.Module:
    """The decoder (`model.model.language_model`)."""
    return _require_attribute("model layout", inner_model(model), "language_model")


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    return _require_attribute("model layout", language_model(model), "layers")


def decoder_rotary(model: nn.Module) -> nn.Module:
    """The decoder's rotary module: `rotary(hidden, position_ids)` -> (cos, sin)."""
    return _require_attribute("model layout", language_model(model), "rotary_emb")


def decoder_norm(model: nn.Module) -> nn.Module:
    return _require_attribute("model layout", language_model(model), "norm")


def lm_head(model: nn.Module) -> nn.Module:
    return _require_attribute("model layout", model, "lm_head")


def projector(model: nn.Module) -> nn.Module:
    """LLaVA's projector (`multi_modal_projector`)."""
    return _require_attribute("model layout", inner_model(model), "multi_modal_projector")


def clip_tower(model: nn.Module, attribute: str) -> nn.Module:
    """A LLaVA-style family's CLIP tower (`vision_tower`, Video-LLaVA's `video_tower`)."""
    return _require_attribute("model layout", inner_model(model), attribute)


def clip_layers(tower: nn.Module) -> nn.ModuleList:
    """A CLIP tower's encoder layers (transformers 5 flattens CLIPVisionModel; a nested
    `vision_model` is followed where a checkpoint's class keeps one)."""
    tower = getattr(tower, "vision_model", tower)
    encoder = _require_attribute("model layout", tower, "encoder")
    return _require_attribute("model layout", encoder, "layers")


def qwen2_vl_tower(model: nn.Module) -> nn.Module:
    """Qwen2-VL's vision transformer (`model.model.visual`)."""
    return _require_attribute("model layout", inner_model(model), "visual")


def qwen2_vl_blocks(tower: nn.Module) -> nn.ModuleList:
    return _require_attribute("model layout", tower, "blocks")


def qwen2_vl_merger(tower: nn.Module) -> nn.Module:
    """The PatchMerger (the projector, inside the tower)."""
    return _require_attribute("model layout", tower, "merger")


# The families whose paths `check_model` knows (model_type -> the tower the methods act in).
FAMILY_TOWERS = {"llava": "vision_tower", "llava_next": "vision_tower", "video_llava": "video_tower",
                 "qwen2_vl": "visual"}
FAMILY_TOWERS["qwen2_5_vl"] = "visual"
FAMILY_TOWERS["llava_onevision"] = "vision_tower"  # SigLIP: the same encoder layer parts as CLIP's
# Qwen3-VL (dense and MoE): Qwen2-VL's packed tower layout (visual.blocks, visual.merger) plus DeepStack's mergers.
QWEN3_VL_TYPES = ("qwen3_vl", "qwen3_vl_moe")
FAMILY_TOWERS.update(dict.fromkeys(QWEN3_VL_TYPES, "visual"))
FAMILY_TOWERS["internvl"] = "vision_tower"  # InternViT: its own layer parts (INTERNVL_LAYER)


def check_model(model: nn.Module) -> None:
    """Every attribute path ficoco reaches in `model` (its family's), and the parts of its layers:
    a ContactChanged naming the first that is missing."""
    model_type = getattr(getattr(model, "config", None), "model_type", "")
    if model_type not in FAMILY_TOWERS:
        return  # not a family ficoco patches: adapter_for says so in its own words
    if model_type in HYBRID_DECODERS:
        check_hybrid_decoder(model)
    else:
        for layer in decoder_layers(model):
            attention_projections(layer_parts(layer, DECODER_LAYER).attention)
    for path in (decoder_rotary, decoder_norm, lm_head):
        path(model)
    if model_type in ("qwen2_vl", "qwen2_5_vl", *QWEN3_VL_TYPES) or model_type in HYBRID_DECODERS:
        tower = qwen2_vl_tower(model)
        for block in qwen2_vl_blocks(tower):
            layer_parts(block, QWEN2_VL_VISION_BLOCK)
        qwen2_vl_merger(tower)
        if model_type in QWEN3_VL_TYPES:
            qwen3_vl_deepstack_mergers(tower)
            _require_attribute("Qwen3-VL DeepStack in the decoder", language_model(model), DEEPSTACK_ADD)
        _require_attribute("model layout", inner_model(model), "rope_deltas")
        return
    if model_type == "internvl":
        projector(model)
        for layer in internvl_layers(clip_tower(model, FAMILY_TOWERS[model_type])):
            internvl_layer_parts(layer)
        return
    projector(model)
    for layer in clip_layers(clip_tower(model, FAMILY_TOWERS[model_type])):
        layer_parts(layer, CLIP_LAYER)


# -- Qwen3.5's hybrid decoder ------------------------------------------------------------------
# A Qwen3_5DecoderLayer holds `linear_attn` (Gated DeltaNet) or `self_attn` (gated full attention, its
# q_proj giving every head's query and then its output gate, q_norm and k_norm per head) as the text
# config's `layer_types` says. The text model hands a DeltaNet layer the 2-D padding mask
# (`create_recurrent_attention_mask`: this call's columns, None for one token or no padding) and a full
# layer the 4-D causal mask built to the first full layer's cache length; the cache
# (DynamicCache(config=...)) keeps a conv and a recurrent state for a DeltaNet layer and answers
# `get_seq_length()` from the first full layer (it refuses the question at a DeltaNet layer).
FULL_ATTENTION, LINEAR_ATTENTION = "full_attention", "linear_attention"
DELTANET_LAYER = LayerParts("linear_attn", "input_layernorm", "post_attention_layernorm", "mlp")
GATED_ATTENTION_NORMS = ("q_norm", "k_norm")
HYBRID_DECODERS = ("qwen3_5",)
FAMILY_TOWERS["qwen3_5"] = "visual"


def decoder_layer_types(model: nn.Module) -> tuple[str, ...]:
    """Every decoder layer's kind ("full_attention", "linear_attention"), from the text config's `layer_types`."""
    text = model.config.get_text_config(decoder=True)
    return tuple(_require_attribute("Qwen3.5 hybrid decoder", text, "layer_types"))


def gated_attention_norms(attention: nn.Module) -> tuple[nn.Module, nn.Module]:
    """(q_norm, k_norm): the per-head norms of a Qwen3.5 full-attention module."""
    q_norm, k_norm = (_require_attribute(f"{type(attention).__name__} attributes", attention, name)
                      for name in GATED_ATTENTION_NORMS)
    return q_norm, k_norm


def check_hybrid_decoder(model: nn.Module) -> None:
    """The parts of every layer of a hybrid decoder, by its kind."""
    kinds = decoder_layer_types(model)
    layers = decoder_layers(model)
    if len(kinds) < len(layers):
        raise ContactChanged("Qwen3.5 hybrid decoder", f"layer_types names {len(kinds)} of {len(layers)} layers")
    for kind, layer in zip(kinds, layers, strict=False):
        if kind == FULL_ATTENTION:
            attention = layer_parts(layer, DECODER_LAYER).attention
            attention_projections(attention)
            gated_attention_norms(attention)
        else:
            layer_parts(layer, DELTANET_LAYER)


@contact("Qwen3.5 hybrid decoder")
def _check_qwen3_5_decoder() -> None:
    import torch
    from transformers import DynamicCache
    from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen3_5

    name = "Qwen3.5 hybrid decoder"
    _require_parameters(name, qwen3_5.Qwen3_5DecoderLayer.forward, "hidden_states", *DECODER_LAYER_KEYWORDS)
    if _parameters(qwen3_5.Qwen3_5DecoderLayer.forward)[1] != "hidden_states":
        raise ContactChanged(name, "Qwen3_5DecoderLayer.forward's first input is not hidden_states")
    _require_parameters(name, qwen3_5.Qwen3_5Attention.forward, "hidden_states", "attention_mask",
                        "position_embeddings")
    _require_parameters(name, qwen3_5.Qwen3_5ForConditionalGeneration.forward, ENCODED_FEATURES_KEYWORD,
                        "image_grid_thw", "mm_token_type_ids")
    recurrent_mask = _require_attribute(name, _module("masking_utils"), "create_recurrent_attention_mask")
    text = _module("models.qwen3_5.configuration_qwen3_5").Qwen3_5TextConfig(
        vocab_size=8, hidden_size=16, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, linear_num_key_heads=1, linear_num_value_heads=1, linear_key_head_dim=4,
        linear_value_head_dim=4, layer_types=[LINEAR_ATTENTION, FULL_ATTENTION])
    mask = torch.tensor([[0, 1, 1, 1]])
    padding = recurrent_mask(config=text, inputs_embeds=torch.zeros(1, 3, 1), attention_mask=mask)
    if padding is None or padding.tolist() != [[1, 1, 1]]:
        raise ContactChanged(name, "create_recurrent_attention_mask no longer gives the call's columns of a 2-D mask")
    with no_init_weights():
        linear, full = (qwen3_5.Qwen3_5DecoderLayer(text, index) for index in (0, 1))
    layer_parts(linear, DELTANET_LAYER)
    attention = layer_parts(full, DECODER_LAYER).attention
    q_proj, _, head_dim, _ = attention_projections(attention)
    gated_attention_norms(attention)
    if q_proj.out_features != 2 * text.num_attention_heads * head_dim:
        raise ContactChanged(name, "Qwen3_5Attention's q_proj no longer gives a query and a gate per head")
    cache_object = DynamicCache(config=text)
    cache_object.update(torch.zeros(1, 1, 3, 8), torch.zeros(1, 1, 3, 8), 1)
    if cache_object.get_seq_length() != 3:
        raise ContactChanged(name, "a hybrid DynamicCache no longer reads its length from the first full layer")
    # The partial rotary embedding the own-row recomputation (PDrop) applies: rotate-half RoPE on the first
    # cos.shape[-1] channels of every head, the others passed through.
    states, cos, sin = torch.randn(1, 1, 2, 8), torch.randn(1, 2, 4), torch.randn(1, 2, 4)
    rotated, _ = qwen3_5.apply_rotary_pos_emb(states, states, cos, sin)
    turned = states[..., :4]
    half = torch.cat((-turned[..., 2:], turned[..., :2]), dim=-1)
    expected = torch.cat([turned * cos[:, None] + half * sin[:, None], states[..., 4:]], dim=-1)
    if not torch.allclose(rotated, expected):
        raise ContactChanged(name, "apply_rotary_pos_emb no longer rotates the first cos.shape[-1] channels alone")


# -- the towers' call shapes ------------------------------------------------------------------


@contact("CLIP encoder layer call")
def _check_clip_layers() -> None:
    from transformers.models.clip import modeling_clip as clip

    for function in (clip.CLIPEncoderLayer.forward, clip.CLIPAttention.forward):
        _require_parameters("CLIP encoder layer call", function, "hidden_states", "attention_mask")


# Qwen2-VL's vision blocks: the packed sequence, its image boundaries and its rotary table; the
# tower's forward takes the patches and every image's grid.
QWEN2_VL_BLOCK_KEYWORDS = ("cu_seqlens", "position_embeddings")


@contact("Qwen2-VL vision tower call")
def _check_qwen2_vl_tower() -> None:
    from transformers.models.qwen2_vl import modeling_qwen2_vl as qwen2_vl

    name = "Qwen2-VL vision tower call"
    _require_parameters(name, qwen2_vl.Qwen2VLVisionBlock.forward, "hidden_states", *QWEN2_VL_BLOCK_KEYWORDS)
    _require_parameters(name, qwen2_vl.VisionAttention.forward, "hidden_states", *QWEN2_VL_BLOCK_KEYWORDS)
    _require_parameters(name, qwen2_vl.Qwen2VisionTransformerPretrainedModel.forward, "hidden_states", "grid_thw")


# Qwen3-VL's tower (dense and MoE): Qwen2-VL's block call and packed sequence; DeepStack runs the outputs of the
# `deepstack_visual_indexes` blocks through their own mergers (`deepstack_merger_list`), hands them out in the
# tower output's `deepstack_features` (per tap, all images), and the decoder (`Qwen3VLTextModel.forward`, keywords
# `visual_pos_masks` and `deepstack_visual_embeds`) adds tap i at the visual positions after decoder layer i
# through `_deepstack_process(hidden_states, visual_pos_masks, visual_embeds)`.
DEEPSTACK_FEATURES_FIELD = "deepstack_features"
DEEPSTACK_MASK_KEYWORD, DEEPSTACK_EMBEDS_KEYWORD = "visual_pos_masks", "deepstack_visual_embeds"
DEEPSTACK_ADD = "_deepstack_process"


def qwen3_vl_deepstack_mergers(tower: nn.Module) -> list[tuple[int, nn.Module]]:
    """(tower layer, its merger) of every DeepStack tap, in the order the decoder adds them."""
    name = "Qwen3-VL DeepStack taps"
    layers = list(_require_attribute(name, tower, "deepstack_visual_indexes"))
    mergers = list(_require_attribute(name, tower, "deepstack_merger_list"))
    if len(layers) != len(mergers):
        raise ContactChanged(name, f"{len(layers)} deepstack_visual_indexes for {len(mergers)} mergers")
    return list(zip(layers, mergers, strict=True))


@contact("Qwen3-VL DeepStack taps")
def _check_qwen3_vl_tower() -> None:
    from transformers.models.qwen3_vl import modeling_qwen3_vl as qwen3_vl
    from transformers.models.qwen3_vl_moe import modeling_qwen3_vl_moe as qwen3_vl_moe

    name = "Qwen3-VL DeepStack taps"
    for module in (qwen3_vl, qwen3_vl_moe):
        prefix = "Qwen3VLMoe" if module is qwen3_vl_moe else "Qwen3VL"
        _require_parameters(name, getattr(module, f"{prefix}VisionBlock").forward, "hidden_states",
                            *QWEN2_VL_BLOCK_KEYWORDS)
        _require_parameters(name, getattr(module, f"{prefix}VisionAttention").forward, "hidden_states",
                            *QWEN2_VL_BLOCK_KEYWORDS)
        _require_parameters(name, getattr(module, f"{prefix}VisionModel").forward, "hidden_states", "grid_thw")
        _require_parameters(name, getattr(module, f"{prefix}Model").get_image_features, "pixel_values",
                            "image_grid_thw")
        _require_parameters(name, getattr(module, f"{prefix}ForConditionalGeneration").forward,
                            ENCODED_FEATURES_KEYWORD)
    output = qwen3_vl.BaseModelOutputWithDeepstackFeatures
    if DEEPSTACK_FEATURES_FIELD not in {f.name for f in fields(output)}:
        raise ContactChanged(name, f"BaseModelOutputWithDeepstackFeatures has no {DEEPSTACK_FEATURES_FIELD}")
    # Both tower classes build their taps' mergers under these names.
    config = qwen3_vl.Qwen3VLVisionConfig(depth=2, hidden_size=8, intermediate_size=8, num_heads=2,
                                          out_hidden_size=8, num_position_embeddings=4,
                                          deepstack_visual_indexes=[0])
    qwen3_vl_deepstack_mergers(qwen3_vl.Qwen3VLVisionModel(config))


@contact("Qwen3-VL DeepStack in the decoder")
def _check_qwen3_vl_decoder() -> None:
    from transformers.models.qwen3_vl import modeling_qwen3_vl as qwen3_vl
    from transformers.models.qwen3_vl_moe import modeling_qwen3_vl_moe as qwen3_vl_moe

    name = "Qwen3-VL DeepStack in the decoder"
    for text in (qwen3_vl.Qwen3VLTextModel, qwen3_vl_moe.Qwen3VLMoeTextModel):
        _require_parameters(name, text.forward, DEEPSTACK_MASK_KEYWORD, DEEPSTACK_EMBEDS_KEYWORD)
        _require_parameters(name, _require_attribute(name, text, DEEPSTACK_ADD), "hidden_states",
                            "visual_pos_masks", "visual_embeds")
    for model in (qwen3_vl.Qwen3VLModel, qwen3_vl_moe.Qwen3VLMoeModel):
        _require_parameters(name, model.get_rope_index, "input_ids", "mm_token_type_ids", "image_grid_thw",
                            "attention_mask", "video_grid_thw")
    for layer in (qwen3_vl.Qwen3VLTextDecoderLayer, qwen3_vl_moe.Qwen3VLMoeTextDecoderLayer):
        _require_parameters(name, layer.forward, "hidden_states", *DECODER_LAYER_KEYWORDS)


# Qwen2.5-VL's windowed tower: the layers that attend over the whole image (the others within windows),
# and transformers' own window order and boundaries of a batch of images (what the tower computes).
QWEN2_5_VL_FULL_LAYERS = "fullatt_block_indexes"


def qwen2_5_vl_full_attention_layers(tower: nn.Module) -> list[int]:
    """The tower layers that attend over the whole image (`fullatt_block_indexes`)."""
    return list(_require_attribute("Qwen2.5-VL window attention", tower, QWEN2_5_VL_FULL_LAYERS))


def qwen2_5_vl_window_index(tower: nn.Module, grid_thw: Any) -> tuple[Any, Any]:
    """(window_index, cu_window_seqlens) of `grid_thw` as the tower computes them: the merge groups'
    window order and the window boundaries in patches."""
    name = "Qwen2.5-VL window attention"
    function = _require_attribute(name, _module("vision_utils"), "get_vision_window_index")
    return function(grid_thw, spatial_merge_size=_require_attribute(name, tower, "spatial_merge_size"),
                    window_size=_require_attribute(name, tower, "window_size"),
                    patch_size=_require_attribute(name, tower, "patch_size"))


@contact("Qwen2.5-VL window attention")
def _check_qwen2_5_vl_windows() -> None:
    import torch
    from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as qwen2_5_vl

    name = "Qwen2.5-VL window attention"
    _require_parameters(name, _require_attribute(name, _module("vision_utils"), "get_vision_window_index"),
                        "grid_thw", "spatial_merge_size", "window_size", "patch_size")
    _require_parameters(name, qwen2_5_vl.Qwen2_5_VLVisionBlock.forward, "hidden_states", *QWEN2_VL_BLOCK_KEYWORDS)
    _require_parameters(name, qwen2_5_vl.Qwen2_5_VLVisionAttention.forward, "hidden_states",
                        *QWEN2_VL_BLOCK_KEYWORDS)
    _require_parameters(name, qwen2_5_vl.Qwen2_5_VisionTransformerPretrainedModel.forward, "hidden_states",
                        "grid_thw")
    _require_parameters(name, qwen2_5_vl.Qwen2_5_VLModel.get_rope_index, "input_ids", "mm_token_type_ids",
                        "image_grid_thw", "attention_mask", "video_grid_thw", "second_per_grid_ts")
    _require_parameters(name, qwen2_5_vl.Qwen2_5_VLForConditionalGeneration.forward, ENCODED_FEATURES_KEYWORD)
    config = _module("models.qwen2_5_vl.configuration_qwen2_5_vl").Qwen2_5_VLVisionConfig()
    if not hasattr(config, QWEN2_5_VL_FULL_LAYERS) or not hasattr(config, "window_size"):
        raise ContactChanged(name, f"Qwen2_5_VLVisionConfig has no {QWEN2_5_VL_FULL_LAYERS} or window_size")
    # A 3 x 3-group image in windows of 2 x 2 groups: 4 windows (2 partial), groups in window order.
    tower = type("Tower", (), {"spatial_merge_size": 2, "window_size": 56, "patch_size": 14})()
    index, cu = qwen2_5_vl_window_index(tower, torch.tensor([[1, 6, 6]]))
    if index.tolist() != [0, 1, 3, 4, 2, 5, 6, 7, 8] or cu.tolist() != [0, 16, 24, 32, 36]:
        raise ContactChanged(name, f"get_vision_window_index gives {index.tolist()} / {cu.tolist()} for a 3 x 3 "
                                   "group grid in 2 x 2 windows")


# -- InternVL (InternViT, pixel shuffle, tiles) ---------------------------------------------------
# InternViT's layers (`vision_tower.encoder.layer`): pre-norm attention and MLP, each scaled by a learned
# per-channel vector (layer scale) before its residual; the layer's forward takes no attention mask, so a
# method that needs one re-composes the layer from these parts. Pixel shuffle (InternVLModel.pixel_shuffle,
# inside get_image_features) joins every 2 x 2 group of a tile's patches into one token, its members'
# channels side by side in row-major order: the group order the adapter hands the methods.
INTERNVL_LAYER = LayerParts("attention", "layernorm_before", "layernorm_after", "mlp")
INTERNVL_LAYER_EXTRAS = ("lambda_1", "lambda_2", "dropout")


def internvl_layers(tower: nn.Module) -> nn.ModuleList:
    """InternViT's encoder layers (`encoder.layer`)."""
    encoder = _require_attribute("model layout", tower, "encoder")
    return _require_attribute("model layout", encoder, "layer")


def internvl_layer_parts(layer: nn.Module) -> tuple[Parts, Any, Any, nn.Module]:
    """One InternViT layer's parts, its two layer-scale vectors (lambda_1, lambda_2) and the dropout after its
    MLP."""
    parts = layer_parts(layer, INTERNVL_LAYER)
    extras = tuple(_require_attribute(f"{type(layer).__name__} parts", layer, name) for name in INTERNVL_LAYER_EXTRAS)
    return parts, extras[0], extras[1], extras[2]


@contact("InternVL tower and pixel shuffle")
def _check_internvl() -> None:
    from transformers.models.internvl import modeling_internvl as internvl

    name = "InternVL tower and pixel shuffle"
    _require_parameters(name, internvl.InternVLVisionAttention.forward, "hidden_states", "attention_mask")
    _require_parameters(name, internvl.InternVLVisionLayer.forward, "hidden_states")
    _require_parameters(name, getattr(internvl.InternVLModel, IMAGE_ENCODER), "pixel_values", "vision_feature_layer",
                        "vision_feature_select_strategy")
    _require_parameters(name, internvl.InternVLForConditionalGeneration.forward, ENCODED_FEATURES_KEYWORD)
    params = _parameters(_require_attribute(name, internvl, "eager_attention_forward"))
    if tuple(params[:len(ATTENTION_FUNCTION_SIGNATURE)]) != ATTENTION_FUNCTION_SIGNATURE:
        raise ContactChanged(name, f"InternVL's eager_attention_forward takes ({', '.join(params)})")
    # A 4 x 4 grid of patches whose channel is the patch's index: the first token must be patches 0, 1, 4, 5.
    grid = torch.arange(16.0).view(1, 4, 4, 1)
    shuffled = internvl.InternVLModel.pixel_shuffle(None, grid, scale_factor=0.5).reshape(4, 4)
    if shuffled[0].tolist() != [0.0, 1.0, 4.0, 5.0] or shuffled[1].tolist() != [2.0, 3.0, 6.0, 7.0]:
        raise ContactChanged(name, f"pixel_shuffle packs a 4x4 grid as {shuffled.tolist()}, not 2x2 groups in "
                                   "row-major order")


@contact("InternVL tiling")
def _check_internvl_tiling() -> None:
    from transformers.models.got_ocr2 import image_processing_pil_got_ocr2 as got_ocr2

    from ficoco.accounting.families.internvl import tiled_canvas

    name = "InternVL tiling"
    function = _require_attribute(name, got_ocr2, "get_optimal_tiled_canvas")
    for size in ((896, 448), (448, 896), (448, 448), (900, 1600), (300, 2000), (1000, 1000)):
        theirs = tuple(function(size, (448, 448), 1, 12))
        if theirs != tiled_canvas(size, (448, 448), 1, 12):
            raise ContactChanged(name, f"get_optimal_tiled_canvas tiles a {size} image as {theirs}, ficoco's "
                                       f"accountant as {tiled_canvas(size, (448, 448), 1, 12)}")


def internvl_tiles(size_hw: tuple[int, int], tile_hw: tuple[int, int], min_tiles: int, max_tiles: int) -> int:
    """Tiles (thumbnail included) the GotOcr2 image processor cuts an image of `size_hw` into, as
    InternVLProcessor calls it (crop_to_patches on)."""
    from transformers.models.got_ocr2 import image_processing_pil_got_ocr2 as got_ocr2

    if max_tiles <= 1:
        return 1
    cols, rows = got_ocr2.get_optimal_tiled_canvas(tuple(size_hw), tuple(tile_hw), min_tiles, max_tiles)
    return cols * rows + int(cols * rows > 1)


# -- model functions ficoco calls or replaces ----------------------------------------------
# The forward keyword that hands generate/forward visual features encoded beforehand
# ({"image": ..., "video": ...}, each a BaseModelOutputWithPooling whose pooler_output is the
# features): how FiCoCo-V and the adaptive methods encode first and shorten the prompt.
ENCODED_FEATURES_KEYWORD = "mm_encoder_outputs"
FEATURES_FIELD = "pooler_output"
# The base models' own encoders, which ficoco calls (and on Qwen2-VL replaces, under FiCoCo-V).
IMAGE_ENCODER, VIDEO_ENCODER = "get_image_features", "get_video_features"


@contact("encoded features keyword")
def _check_encoded_features() -> None:
    from transformers.models.llava import modeling_llava as llava
    from transformers.models.llava_next import modeling_llava_next as llava_next
    from transformers.models.qwen2_vl import modeling_qwen2_vl as qwen2_vl
    from transformers.models.video_llava import modeling_video_llava as video_llava

    for model in (llava.LlavaForConditionalGeneration, llava_next.LlavaNextForConditionalGeneration,
                  video_llava.VideoLlavaForConditionalGeneration, qwen2_vl.Qwen2VLForConditionalGeneration):
        _require_parameters("encoded features keyword", model.forward, ENCODED_FEATURES_KEYWORD)
    if FEATURES_FIELD not in {f.name for f in fields(_module("modeling_outputs").BaseModelOutputWithPooling)}:
        raise ContactChanged("encoded features keyword", f"BaseModelOutputWithPooling has no {FEATURES_FIELD}")


@contact("image features functions")
def _check_image_features() -> None:
    from transformers.models.llava import modeling_llava as llava
    from transformers.models.llava_next import modeling_llava_next as llava_next
    from transformers.models.qwen2_vl import modeling_qwen2_vl as qwen2_vl
    from transformers.models.video_llava import modeling_video_llava as video_llava

    name = "image features functions"
    _require_parameters(name, getattr(llava.LlavaModel, IMAGE_ENCODER), "pixel_values", "vision_feature_layer",
                        "vision_feature_select_strategy", "image_sizes")
    _require_parameters(name, getattr(llava_next.LlavaNextModel, IMAGE_ENCODER), "pixel_values", "image_sizes")
    _require_parameters(name, getattr(video_llava.VideoLlavaModel, VIDEO_ENCODER), "pixel_values_videos")
    _require_parameters(name, getattr(qwen2_vl.Qwen2VLModel, IMAGE_ENCODER), "pixel_values", "image_grid_thw")


def encode_features(model: nn.Module, encoder: str, pixels: Any, *args: Any, **options: Any) -> Any:
    """The base model's own encoder (`get_image_features`, `get_video_features`) on `pixels`, as the
    output object whose `pooler_output` the forward takes through ENCODED_FEATURES_KEYWORD."""
    function = _require_attribute("image features functions", inner_model(model), encoder)
    return function(pixels, *args, return_dict=True, **options)


@contact("Qwen2-VL rope index")
def _check_rope_index() -> None:
    from transformers.models.qwen2_vl import modeling_qwen2_vl as qwen2_vl

    _require_parameters("Qwen2-VL rope index", qwen2_vl.Qwen2VLModel.get_rope_index, "input_ids",
                        "mm_token_type_ids", "image_grid_thw", "attention_mask", "video_grid_thw")


def rope_index(model: nn.Module, input_ids: Any, mm_token_type_ids: Any, image_grid_thw: Any,
               attention_mask: Any, video_grid_thw: Any = None, second_per_grid_ts: Any = None) -> tuple[Any, Any]:
    """Qwen2-VL's 3-D position ids of a prompt and its rope_deltas (`get_rope_index`); a video's grids
    through `video_grid_thw` (HoliTom's video cut) and, on Qwen2.5-VL, its `second_per_grid_ts`."""
    options = {name: value for name, value in (("video_grid_thw", video_grid_thw),
                                               ("second_per_grid_ts", second_per_grid_ts)) if value is not None}
    return inner_model(model).get_rope_index(input_ids, mm_token_type_ids, image_grid_thw=image_grid_thw,
                                             attention_mask=attention_mask, **options)


def rope_deltas(model: nn.Module) -> Any:
    """Qwen2-VL's rope_deltas of the last prefill, which its decode steps read."""
    return _require_attribute("model layout", inner_model(model), "rope_deltas")


def set_rope_deltas(model: nn.Module, deltas: Any) -> None:
    inner_model(model).rope_deltas = deltas


# LLaVA-NeXT's AnyRes: the model's packing method (replaced by ficoco's for reduced items) and the
# model file's grid arithmetic (called, so the layout is the model's own).
PACK_FEATURES = "pack_image_features"


@contact("LLaVA-NeXT AnyRes packing")
def _check_anyres() -> None:
    from transformers.models.llava_next import modeling_llava_next as llava_next

    name = "LLaVA-NeXT AnyRes packing"
    _require_parameters(name, getattr(llava_next.LlavaNextModel, PACK_FEATURES), "image_features", "image_sizes",
                        "vision_feature_select_strategy", "image_newline")
    for function in ("get_anyres_image_grid_shape", "image_size_to_num_patches"):
        _require_parameters(name, _require_attribute(name, llava_next, function), "image_size", "grid_pinpoints",
                            "patch_size")


def anyres_grid(size: list[int], pinpoints: Any, image_size: int) -> tuple[int, int] | None:
    """(crops high, crops wide) transformers' AnyRes picks for an image of `size` (H, W), or None
    when the image is its base view alone."""
    from transformers.models.llava_next import modeling_llava_next as llava_next

    if llava_next.image_size_to_num_patches(size, pinpoints, image_size) == 1:
        return None
    crops_h, crops_w = llava_next.get_anyres_image_grid_shape(size, pinpoints, image_size)
    return int(crops_h), int(crops_w)


# LLaVA-OneVision: LLaVA-NeXT's AnyRes with its own packing method (no select strategy; an anyres_max_N
# budget over which the unpadded crop grid is resized bilinearly), the model file's grid arithmetic, and
# the 2x2 pooling of video frames (`apply_pooling`).
ONEVISION_POOLING = "apply_pooling"


@contact("LLaVA-OneVision AnyRes packing")
def _check_onevision_anyres() -> None:
    import torch
    from transformers.models.llava_onevision import modeling_llava_onevision as onevision

    name = "LLaVA-OneVision AnyRes packing"
    model = onevision.LlavaOnevisionModel
    _require_parameters(name, getattr(model, PACK_FEATURES), "image_features", "image_sizes", "image_newline",
                        "vision_aspect_ratio")
    _require_parameters(name, getattr(model, IMAGE_ENCODER), "pixel_values", "image_sizes", "batch_num_images")
    _require_parameters(name, getattr(model, VIDEO_ENCODER), "pixel_values_videos")
    _require_parameters(name, _require_attribute(name, model, ONEVISION_POOLING), "image_features")
    for function in ("get_anyres_image_grid_shape", "image_size_to_num_patches"):
        _require_parameters(name, _require_attribute(name, onevision, function), "image_size", "grid_pinpoints",
                            "patch_size")
    # The downscale is arithmetic inside the packing, not a function of its own: run the packing on a
    # 3 x 3 grid of 2 x 2-patch crops at anyres_max_1 (a 6 x 6 grid resized to 4 x 4) and compare.
    from ficoco.accounting.families.llava_onevision import onevision_downscaled

    config = _SimpleConfig(image_grid_pinpoints=[[2, 2], [6, 6]],
                           vision_config=_SimpleConfig(image_size=2, patch_size=1))
    features = [torch.zeros(10, 4, 1)]
    packed, _ = getattr(model, PACK_FEATURES)(_SimpleConfig(config=config), features, torch.tensor([[6, 6]]),
                                               image_newline=torch.zeros(1), vision_aspect_ratio="anyres_max_1")
    rows, cols = onevision_downscaled(6, 6, 2, 1)
    if packed[0].shape[0] != 4 + rows * cols + rows:
        raise ContactChanged(name, f"the packing of a 6x6 crop grid at anyres_max_1 gave {packed[0].shape[0]} "
                                   f"tokens, not the {4 + rows * cols + rows} of ficoco's arithmetic")


class _SimpleConfig:
    """Attribute access to keyword values (a stand-in config for a contact check)."""

    def __init__(self, **values: Any) -> None:
        self.__dict__.update(values)


def onevision_anyres_grid(size: list[int], pinpoints: Any, image_size: int) -> tuple[int, int] | None:
    """(crops high, crops wide) LLaVA-OneVision's AnyRes picks for an image of `size` (H, W), or None
    when the image is its base view alone."""
    from transformers.models.llava_onevision import modeling_llava_onevision as onevision

    if onevision.image_size_to_num_patches(size, pinpoints, image_size) == 1:
        return None
    crops_h, crops_w = onevision.get_anyres_image_grid_shape(size, pinpoints, image_size)
    return int(crops_h), int(crops_w)


# -- attention functions ------------------------------------------------------------------------
# ficoco routes one attention module through a function of its own by registering it with
# transformers' AttentionInterface and pointing a copy of the module's config at it (the model's
# config stays); the function then calls the module's own implementation, looked up in the
# registry (eager is each model file's `eager_attention_forward`, not in the registry).
ATTENTION_FUNCTION_SIGNATURE = ("module", "query", "key", "value", "attention_mask")


@contact("attention interface")
def _check_attention_interface() -> None:
    name = "attention interface"
    interface = _require_attribute(name, importlib.import_module("transformers"), "AttentionInterface")
    _require_attribute(name, interface, "register")
    functions = _require_attribute(name, _module("modeling_utils"), "ALL_ATTENTION_FUNCTIONS")
    _require_attribute(name, functions, "get_interface")
    for family in ("llama", "clip", "qwen2_vl"):
        eager = _require_attribute(name, _module(f"models.{family}.modeling_{family}"), "eager_attention_forward")
        params = _parameters(eager)[:len(ATTENTION_FUNCTION_SIGNATURE)]
        if tuple(params) != ATTENTION_FUNCTION_SIGNATURE:
            raise ContactChanged(name, f"{family}'s eager_attention_forward takes ({', '.join(params)}, ...)")
    config = copy.copy(_module("models.llama.configuration_llama").LlamaConfig())
    set_attention_implementation(config, "sdpa")
    if attention_implementation(config) != "sdpa":
        raise ContactChanged(name, "a config's _attn_implementation does not follow _attn_implementation_internal")


# The names ficoco registered (its routed functions, whatever they are called): the profiler's kernel
# record tells a module routed through one of them from one running a kernel of transformers' own.
_REGISTERED_BY_FICOCO: set[str] = set()


def register_attention(name: str, function: Callable[..., Any]) -> None:
    """Register `function` as attention implementation `name`."""
    from transformers import AttentionInterface

    AttentionInterface.register(name, function)
    _REGISTERED_BY_FICOCO.add(name)


def ficoco_attention_names() -> frozenset[str]:
    """The attention implementations ficoco registered (`register_attention`) so far."""
    return frozenset(_REGISTERED_BY_FICOCO)


def attention_implementation(config: Any) -> str | None:
    """The attention implementation a (sub)config names ("sdpa", "eager", ...)."""
    return getattr(config, "_attn_implementation", None)


def set_attention_implementation(config: Any, name: str) -> None:
    """Point `config` (a module's own copy) at the registered implementation `name`, alone (its
    sub-configs keep theirs)."""
    config._attn_implementation_internal = name


def configure_attention(config: Any, name: str) -> None:
    """The attention implementation a model is built with (`attn_implementation`), set on a config
    before the build: the config's own setter, which sub-configs (text, vision) follow."""
    config._attn_implementation = name


def attention_function(module: nn.Module, implementation: str | None) -> Callable[..., Any]:
    """The attention function `implementation` names, for `module` (eager: its model file's own)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    return ALL_ATTENTION_FUNCTIONS.get_interface(implementation, eager)


# -- watching the attention functions that run (the profiler's kernel record) -------------------------------
# Every attention module of the families looks its function up when it is called,
# `ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager_attention_forward)`, and
# ficoco's routed functions look the module's own up the same way (`attention_function`); transformers'
# sdpa function calls `torch.nn.functional.scaled_dot_product_attention` by attribute. So wrapping the
# lookup and that attribute for one forward sees every attention call, with the implementation's name,
# without touching a module. The modeling files whose attention classes are checked to look up so:
ATTENTION_LOOKUP_FAMILIES = ("llama", "qwen2", "clip", "siglip", "qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe",
                             "qwen3_5", "internvl")
ATTENTION_LOOKUP = "ALL_ATTENTION_FUNCTIONS.get_interface("
SDPA_CALL = "torch.nn.functional.scaled_dot_product_attention("


@contact("attention lookup at call time")
def _check_attention_lookup() -> None:
    from transformers.models.llama import configuration_llama, modeling_llama

    name = "attention lookup at call time"
    for family in ATTENTION_LOOKUP_FAMILIES:
        source = inspect.getsource(_module(f"models.{family}.modeling_{family}"))
        if ATTENTION_LOOKUP not in source:
            raise ContactChanged(name, f"modeling_{family} no longer calls {ATTENTION_LOOKUP}...)")
    if SDPA_CALL not in inspect.getsource(_module("integrations.sdpa_attention")):
        raise ContactChanged(name, f"the sdpa attention function no longer calls {SDPA_CALL}...)")
    # One LLaMA attention call under both watches: one lookup by name (sdpa: the registry's, with
    # one SDPA call; eager: the caller's default) per forward.
    config = configuration_llama.LlamaConfig(hidden_size=8, num_attention_heads=2, num_key_value_heads=2,
                                             intermediate_size=8, num_hidden_layers=1, vocab_size=8)
    attention = modeling_llama.LlamaAttention(config, layer_idx=0)
    hidden, rotary = torch.randn(1, 3, 8), (torch.ones(1, 3, 4), torch.zeros(1, 3, 4))
    for implementation, sdpa_calls in (("sdpa", 1), ("eager", 0)):
        set_attention_implementation(config, implementation)
        looked_up, called = _watch_one_call(attention, hidden, rotary)
        if looked_up != [(implementation, implementation == "eager")] or called != sdpa_calls:
            raise ContactChanged(name, f"a LlamaAttention forward under {implementation} looked up {looked_up} and "
                                       f"called SDPA {called} times")


def _watch_one_call(attention: nn.Module, *args: Any) -> tuple[list[tuple[str | None, bool]], int]:
    """(name, is_default) of every lookup one call of `attention` made, and its SDPA calls."""
    looked_up: list[tuple[str | None, bool]] = []
    called: list[int] = []

    def wrap(looked: str | None, function: Callable[..., Any], is_default: bool) -> Callable[..., Any]:
        looked_up.append((looked, is_default))
        return function

    def count(*_: Any) -> contextlib.AbstractContextManager[Any]:
        called.append(1)
        return contextlib.nullcontext()

    with torch.no_grad(), watched_attention_lookups(wrap), watched_sdpa_calls(count):
        attention(*args, None)
    return looked_up, len(called)


AttentionWrap = Callable[[str | None, Callable[..., Any], bool], Callable[..., Any]]


@contextlib.contextmanager
def watched_attention_lookups(wrap: AttentionWrap) -> Iterator[None]:
    """While open, every attention function looked up in transformers' registry at call time (by a module, or
    by ficoco's `attention_function`) is `wrap(name, function, is_default)` instead: `name` the implementation
    asked for, `is_default` when the registry has no such entry and handed back the caller's default (the
    model file's eager function). The class's method is wrapped, so every registry instance is watched."""
    from transformers.modeling_utils import AttentionInterface

    own = vars(AttentionInterface).get("get_interface")
    original = AttentionInterface.get_interface

    def get_interface(self: Any, *args: Any, **kwargs: Any) -> Callable[..., Any]:
        function = original(self, *args, **kwargs)
        if unobserved_now():
            return function
        looked = args[0] if args else kwargs.get("attn_implementation")
        default = args[1] if len(args) > 1 else kwargs.get("default")
        return wrap(looked, function, function is default)

    AttentionInterface.get_interface = get_interface
    try:
        yield
    finally:
        if own is not None:
            AttentionInterface.get_interface = own
        else:
            del AttentionInterface.get_interface


_UNOBSERVED = [0]


@contextlib.contextmanager
def unobserved() -> Iterator[None]:
    """Inside, the watchers above see nothing: a call made only to be timed beside the forward's own (the model's
    kernel on a fused layer's inputs, ficoco.models.handle) is not a call the forward made."""
    _UNOBSERVED[0] += 1
    try:
        yield
    finally:
        _UNOBSERVED[0] -= 1


def unobserved_now() -> bool:
    return _UNOBSERVED[0] > 0


@contextlib.contextmanager
def watched_sdpa_calls(observe: Callable[[tuple[Any, ...], dict[str, Any]], contextlib.AbstractContextManager[Any]]
                       ) -> Iterator[None]:
    """While open, every call of torch's `scaled_dot_product_attention` made through `torch.nn.functional`
    (transformers' sdpa function calls it so) runs inside `observe(args, kwargs)`, a context manager."""
    functional = torch.nn.functional
    original = functional.scaled_dot_product_attention

    def scaled_dot_product_attention(*args: Any, **kwargs: Any) -> Any:
        if unobserved_now():
            return original(*args, **kwargs)
        with observe(args, kwargs):
            return original(*args, **kwargs)

    functional.scaled_dot_product_attention = scaled_dot_product_attention
    try:
        yield
    finally:
        functional.scaled_dot_product_attention = original


# -- the cache object -----------------------------------------------------------------------------


@contact("cache object")
def _check_cache() -> None:
    from transformers import DynamicCache, QuantizedCache

    name = "cache object"
    _require_parameters(name, QuantizedCache.__init__, "backend", "config", "nbits", "axis_key", "axis_value",
                        "q_group_size", "residual_length")
    cache_object = DynamicCache()
    cache_object.update(torch.zeros(1, 1, 3, 2), torch.zeros(1, 1, 3, 2), 0)
    layers = _require_attribute(name, cache_object, "layers")
    if cache_layer_tokens(layers[0]) != 3 or cache_object.get_seq_length(0) != 3:
        raise ContactChanged(name, "a DynamicCache layer does not hold its keys as (B, H, T, d) `keys`")


def cache_layers(cache_object: Any) -> list[Any]:
    """The per-layer objects of a cache (each holds its own tensors)."""
    return list(getattr(cache_object, "layers", None) or [])


def cache_layer_tokens(layer: Any) -> int:
    """Tokens one cache layer holds (a quantized layer counts its quantized and residual tokens)."""
    length = getattr(layer, "cumulative_length", None)
    if length is None:
        keys = getattr(layer, "keys", None)
        length = keys.shape[-2] if isinstance(keys, torch.Tensor) and keys.dim() == 4 else 0
    return int(length)


def new_quantized_cache(config: Any, **options: Any) -> Any:
    """transformers' QuantizedCache for a model of `config` (options: backend, nbits, ...)."""
    from transformers import QuantizedCache

    return QuantizedCache(config=config, **options)


# -- building and quantizing -------------------------------------------------------------------


@contact("model building")
def _check_building() -> None:
    name = "model building"
    _require_attribute(name, _module("initialization"), "no_init_weights")
    base = _require_attribute(name, _module("quantizers.base"), "get_keys_to_not_convert")
    if len(_parameters(base)) < 1:
        raise ContactChanged(name, "get_keys_to_not_convert takes no model")


def no_init_weights() -> contextlib.AbstractContextManager[Any]:
    """transformers' context in which constructors skip weight initialisation."""
    return _module("initialization").no_init_weights()


def keys_to_not_convert(model: nn.Module) -> list[str]:
    """The module names transformers leaves unquantized (the LM head, tied weights)."""
    return list(_module("quantizers.base").get_keys_to_not_convert(model))


# -- video decoding ---------------------------------------------------------------------------
VIDEO_BACKENDS = (("pyav", "is_av_available"), ("decord", "is_decord_available"), ("opencv", "is_cv2_available"))


@contact("video decoding")
def _check_video() -> None:
    _require_parameters("video decoding", _module("video_utils").load_video, "video", "backend")


def video_backend() -> str | None:
    """A video decoder transformers can use here, or None."""
    import_utils = _module("utils.import_utils")
    for backend, available in VIDEO_BACKENDS:
        check = getattr(import_utils, available, None)
        if check is not None and check():
            return backend
    return None


def load_video(path: str, **options: Any) -> Any:
    return _module("video_utils").load_video(path, **options)


# -- the release as a whole -----------------------------------------------------------------------
_contacts_checked: list[str] | None = None


def check_release() -> None:
    """Before building or patching: on a transformers release outside the tested range, one warning
    line, then every contact checked (once per process), so that what changed is named in one line
    (a FicocoError) instead of failing later inside a build or a forward. Nothing on a tested release."""
    global _contacts_checked
    from ficoco.versions import outside_tested_range, warn_if_untested

    if not any(p.name == "transformers" for p in outside_tested_range()):
        return
    warn_if_untested("transformers")
    if _contacts_checked is None:
        _contacts_checked = check_contacts()
    if _contacts_checked:
        raise FicocoError(_contacts_checked[0])


def ensure_supported(model: nn.Module) -> None:
    """At apply(): `check_release`, then this model's attribute paths (cheap attribute reads, on any
    release)."""
    check_release()
    check_model(model)


# -- the LLM's input embedding table (CDPruner's instruction embeddings) ---------------------------------------


@contact("input embeddings")
def _check_input_embeddings() -> None:
    _require_attribute("input embeddings", _module("modeling_utils").PreTrainedModel, "get_input_embeddings")


def embed_tokens(model: nn.Module, input_ids: Any) -> Any:
    """The LLM's input embeddings of `input_ids`, from the model's own table (`get_input_embeddings()`)."""
    return _require_attribute("input embeddings", model, "get_input_embeddings")()(input_ids)


# -- device maps (ficoco.models.device_map): the layers accelerate must keep whole ---------------------------------


@contact("no-split modules")
def _check_no_split_modules() -> None:
    from transformers.models.llama import modeling_llama as llama

    _require_attribute("no-split modules", _module("modeling_utils").PreTrainedModel, "_no_split_modules")
    if "LlamaDecoderLayer" not in (llama.LlamaPreTrainedModel._no_split_modules or ()):
        raise ContactChanged("no-split modules", "LlamaPreTrainedModel._no_split_modules no longer names its layer")


def no_split_modules(model: nn.Module) -> list[str]:
    """The module classes a device map must keep whole on one device (the model's decoder and vision
    layers, gathered from its parts at construction), as from_pretrained(device_map=...) uses them."""
    return sorted(_require_attribute("no-split modules", model, "_no_split_modules") or [])


# -- what the rate probe times as the models run it (ficoco.profiling.predict) ------------------------------------
# A prediction prices a layer at the rate of the call the model makes, timed at the layer's shapes: for Qwen3.5's
# Gated DeltaNet the module-level chunked delta rule and causal convolution its layers call in a prefill
# (transformers' PyTorch fallbacks, or flash-linear-attention's and causal-conv1d's kernels where those are
# installed: the module resolves them on import), and for the Qwen towers the rotary embedding their attention
# applies (in float32) before SDPA.
VISION_ROTARY_MODULES = {"qwen2_vl": "qwen2_vl", "qwen2_5_vl": "qwen2_5_vl", "qwen3_vl": "qwen3_vl"}
PROBE_KERNELS = "kernels the rate probe times"


def gated_delta_rule() -> Callable[..., Any]:
    """The chunked gated delta rule Qwen3.5's DeltaNet layers call over a prompt: `(query, key, value, g=, beta=,
    initial_state=, output_final_state=, use_qk_l2norm_in_kernel=)`."""
    return _require_attribute(PROBE_KERNELS, _module("models.qwen3_5.modeling_qwen3_5"), "torch_chunk_gated_delta_rule")


def causal_conv1d() -> Callable[..., Any]:
    """The depthwise causal convolution Qwen3.5's DeltaNet layers call over a prompt: `(hidden_states (B, C, T),
    weight (C, kernel), bias, activation=)`."""
    return _require_attribute(PROBE_KERNELS, _module("models.qwen3_5.modeling_qwen3_5"), "causal_conv1d_fn")


def activation(name: str) -> Callable[..., Any]:
    """The activation a config's `hidden_act` names, as transformers' layers build it (ACT2FN)."""
    return _require_attribute(PROBE_KERNELS, _module("activations"), "ACT2FN")[name]


def vision_rotary(kind: str) -> Callable[..., Any]:
    """The rotary embedding a Qwen tower of `kind` (the accountant's tower kind) applies to q and k: `(q, k, cos,
    sin)` on (tokens, heads, head width) states."""
    family = VISION_ROTARY_MODULES[kind]
    return _require_attribute(PROBE_KERNELS, _module(f"models.{family}.modeling_{family}"),
                              "apply_rotary_pos_emb_vision")


@contact(PROBE_KERNELS)
def _check_probe_kernels() -> None:
    _require_parameters(PROBE_KERNELS, gated_delta_rule(), "query", "key", "value", "g", "beta", "initial_state",
                        "output_final_state", "use_qk_l2norm_in_kernel")
    _require_parameters(PROBE_KERNELS, causal_conv1d(), "hidden_states", "weight", "bias", "activation")
    for kind in VISION_ROTARY_MODULES:
        _require_parameters(PROBE_KERNELS, vision_rotary(kind), "q", "k", "cos", "sin")
    # The shapes the probe hands them: what the layers hand them.
    states = torch.randn(1, 3, 2, 4)
    out, state = gated_delta_rule()(states, states, states, g=-torch.ones(1, 3, 2), beta=torch.ones(1, 3, 2),
                                    initial_state=None, output_final_state=True, use_qk_l2norm_in_kernel=True)
    if tuple(out.shape) != (1, 3, 2, 4) or state is None or tuple(state.shape) != (1, 2, 4, 4):
        raise ContactChanged(PROBE_KERNELS, "the chunked delta rule no longer returns (B, T, H, dv) and its state")
    if tuple(causal_conv1d()(torch.randn(1, 5, 3), torch.randn(5, 4), None, activation="silu").shape) != (1, 5, 3):
        raise ContactChanged(PROBE_KERNELS, "causal_conv1d_fn no longer returns (B, C, T)")
