"""Qwen3.5's hybrid decoder, as the methods in the LLM meet it: most layers are Gated DeltaNet (linear
attention: a causal convolution over the last few tokens and a fixed-size recurrent state, no attention
map, no per-token cache), every fourth is full (gated) attention with a KV cache (`layer_types`).

What each kind of method does there (`HybridDecoder`):

- before the LLM (FiCoCo-V, ToMe, VisionZip, ...): the decoder gets fewer tokens, every layer alike;
  nothing here.
- at a layer's input (FastV, PDrop, SparseVLM, DART, HoliTom's inner merge) and inside a layer (FiCoCo-L): where
  the method may act, and the one line that refuses it elsewhere, is the torch-free rule of
  ficoco.methods.hybrid (`HybridLayers`), which the accountant applies too: `ficoco flops` prices only a placement
  the adapter runs. Removing tokens before a DeltaNet layer is legitimate (its recurrence and convolution then run
  over the kept tokens, and the conv and recurrent states the cache keeps are those of the kept sequence); the
  patches slice the causal mask of the later full layers, which cache fewer tokens than the first.

A DeltaNet layer's mask is the 2-D padding mask (`create_recurrent_attention_mask`): the shared
patches keep its columns of the tokens still present (ficoco.models.patching.LanguageState.slice_mask).
Left padding is exact there: a padded token's input is zeroed, so it adds nothing to the convolution or
to the state.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ficoco.methods.hybrid import HybridLayers
from ficoco.methods.ops import last_row_attention
from ficoco.methods.reads import DEFAULT_ATTENTION_SCORES
from ficoco.models import hf_compat as hf
from ficoco.models.upcast import compute_weight

if TYPE_CHECKING:
    from ficoco.models.handle import Handle
    from ficoco.models.patching import Patches


class HybridDecoder:
    """The hybrid decoder's part of the Qwen3.5 adapter: which layers are full attention, what a method in
    the LLM may do where (refused in one line otherwise), the layers whose cache holds tokens, and PDrop's
    own row of a gated attention layer. Mixed into the adapter before the Qwen-VL parts."""

    model: nn.Module
    decoder_layers: Any
    family_title: str

    def init_hybrid(self) -> None:
        kinds = hf.decoder_layer_types(self.model)
        self.full_layers = tuple(i for i, kind in enumerate(kinds) if kind == hf.FULL_ATTENTION)
        self.linear_layers = tuple(i for i, kind in enumerate(kinds) if kind != hf.FULL_ATTENTION)
        # What a method in the LLM may do where: the accountant's rule too (ficoco.methods.hybrid).
        self.hybrid_layers = HybridLayers(self.family_title, len(self.decoder_layers), self.full_layers)
        self.hybrid_layers.check_has_full()

    # -- what a method in the LLM may do where --------------------------------------------------
    def patch_in_layer(self, handle: Handle, patches: Patches, spec: Any, schedule: Any, first: int) -> None:
        self.hybrid_layers.check(spec, schedule)
        super().patch_in_layer(handle, patches, spec, schedule, first)  # type: ignore[misc]

    def patch_layer_input(self, handle: Handle, patches: Patches, spec: Any, schedule: Any) -> None:
        self.hybrid_layers.check(spec, schedule)
        super().patch_layer_input(handle, patches, spec, schedule)  # type: ignore[misc]

    # -- the cache ----------------------------------------------------------------------------
    def token_cache_layers(self) -> tuple[int, ...]:
        """Only the full-attention layers cache tokens (a DeltaNet layer's cache holds states, and
        transformers refuses its length)."""
        return self.full_layers

    # -- PDrop's own row at a gated full-attention layer -----------------------------------------
    @staticmethod
    def own_last_row(layer: nn.Module, hidden: Tensor, cos: Tensor | None, sin: Tensor | None, visible: Tensor,
                     scores: str = DEFAULT_ATTENTION_SCORES) -> Tensor:
        """(B, H, T) the last row's attention recomputed with layer `layer`'s own input norm, query (the query
        half of the gated q_proj, last row only) and key projections, their per-head norms and the partial
        rotary embedding (the first cos.shape[-1] channels of every head), softmaxed in float32 over the
        visible keys, its scores by the rule `scores` names: what the layer's own attention computes for that
        row."""
        parts = hf.layer_parts(layer, hf.DECODER_LAYER)
        attention = parts.attention
        q_proj, k_proj, head_dim, scaling = hf.attention_projections(attention)
        q_norm, k_norm = hf.gated_attention_norms(attention)
        normed = parts.input_norm(hidden)
        batch, length, width = normed.shape
        last = normed[:, -1:]
        if "_hf_hook" in q_proj.__dict__:  # offloaded weights load on the call: project whole, keep the query half
            query = q_proj(last).view(batch, 1, -1, 2 * head_dim)[..., :head_dim]
        else:  # the query half of q_proj's rows alone (per head: head_dim query rows, then head_dim gate rows)
            # (an upcast layer's weight through its scratch buffer, used before k_proj's takes the buffer over)
            weight = compute_weight(q_proj).view(-1, 2, head_dim, width)[:, 0].reshape(-1, width)
            bias = None if q_proj.bias is None else q_proj.bias.view(-1, 2, head_dim)[:, 0].reshape(-1)
            query = F.linear(last, weight, bias).view(batch, 1, -1, head_dim)
        if "_hf_hook" in k_proj.__dict__:
            keys = k_proj(normed)
        else:
            keys = F.linear(normed, compute_weight(k_proj), k_proj.bias)
        query = q_norm(query).transpose(1, 2)
        keys = k_norm(keys.view(batch, length, -1, head_dim)).transpose(1, 2)
        if cos is not None and sin is not None:  # None: the row without its rotary embedding (VScan's Qwen code)
            query = partial_rope(query, cos[:, -1:].expand(batch, -1, -1), sin[:, -1:].expand(batch, -1, -1))
            keys = partial_rope(keys, cos.expand(batch, -1, -1), sin.expand(batch, -1, -1))
        return last_row_attention(query[:, :, 0], keys, visible, scaling, scores)


def partial_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """The rotary embedding of ``(B, H, T, d)`` states on their first ``cos.shape[-1]`` channels (Qwen3.5's
    partial rotary factor), the rest passed through, with ``(B, T, r)`` tables."""
    rotary = cos.shape[-1]
    turned, kept = x[..., :rotary], x[..., rotary:]
    half = rotary // 2
    rotated = torch.cat((-turned[..., half:], turned[..., :half]), dim=-1)
    return torch.cat([turned * cos.unsqueeze(1) + rotated * sin.unsqueeze(1), kept], dim=-1)
