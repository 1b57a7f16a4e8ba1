"""What the official-rule tests (tests/test_rule_*.py) share: the quantities an official code reads, taken from a
model as the official code would take them, with no ficoco code in between.

- `eager`, `eager_run`: the unpatched model with eager attention, its forward with ``output_attentions=True``
  (every decoder layer's probabilities, as FastV's and HoliTom's official code read them) and
  ``output_hidden_states=True``;
- `watch_layers`: what decoder layers of a (patched) model really received: the input a layer was handed (before
  a step ficoco runs at its input), the residual stream it ran on (after that step), and the rotary tables and
  mask its attention was called with;
- `own_query_key`, `probabilities`, `rotary`: a layer's post-RoPE queries and keys recomputed from its own weights,
  and its softmaxed attention, for a stage whose input depends on earlier reductions;
- `assert_decided`: the precondition that a top-k is not decided by rounding (no near-tie at the cut);
- `fails_when`: a deliberate break of the method must make a rule check fail.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import Tensor, nn


def decoder(model: nn.Module) -> nn.Module:
    """The LLaMA-style language model of a LLaVA-type model (its `layers`, `norm` and `rotary_emb`)."""
    return model.model.language_model


@contextlib.contextmanager
def eager(model: nn.Module) -> Iterator[None]:
    """The unpatched `model` with eager attention (its towers' and its decoder's) inside the block, and no grad;
    its own implementation restored after it."""
    assert "_ficoco_handle" not in model.__dict__, "the official rules read the unpatched model"
    previous = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            yield
    finally:
        model.set_attn_implementation(previous)


def eager_run(model: nn.Module, inputs: dict[str, Tensor]) -> Any:
    """The unpatched model's forward with eager attention, every layer's probabilities and hidden states
    (``attentions[i]`` ``(B, H, T, T)``; ``hidden_states[i]`` the input of decoder layer i, the last one after
    the final norm)."""
    with eager(model):
        return model(**inputs, output_attentions=True, output_hidden_states=True)


@dataclass
class Seen:
    """One decoder layer in one prefill: ``received`` its input as the model handed it (before a step at
    its input), ``ran_on`` the residual stream its attention and MLP ran on (after that step),
    ``rotary`` the (cos, sin) its attention was called with, ``mask`` its attention mask."""

    received: Tensor | None = None
    ran_on: Tensor | None = None
    rotary: tuple[Tensor, Tensor] | None = None
    mask: Tensor | None = None


@contextlib.contextmanager
def watch_layers(model: nn.Module, indices: list[int]) -> Iterator[dict[int, Seen]]:
    """Record what decoder layers `indices` receive in the forwards run inside the block (the last one wins)."""
    layers = decoder(model).layers
    seen = {index: Seen() for index in indices}
    hooks = []

    def first(args: tuple, kwargs: dict, name: str) -> Tensor:
        return args[0] if args else kwargs[name]

    for index in indices:
        layer, slot = layers[index], seen[index]

        def on_layer(module: nn.Module, args: tuple, kwargs: dict, slot: Seen = slot) -> None:
            slot.received = first(args, kwargs, "hidden_states").detach().clone()

        def on_norm(module: nn.Module, args: tuple, slot: Seen = slot) -> None:
            slot.ran_on = args[0].detach().clone()

        def on_attention(module: nn.Module, args: tuple, kwargs: dict, slot: Seen = slot) -> None:
            slot.rotary = kwargs.get("position_embeddings")
            slot.mask = kwargs.get("attention_mask")

        hooks += [layer.register_forward_pre_hook(on_layer, with_kwargs=True),
                  layer.input_layernorm.register_forward_pre_hook(on_norm),
                  layer.self_attn.register_forward_pre_hook(on_attention, with_kwargs=True)]
    try:
        yield seen
    finally:
        for hook in hooks:
            hook.remove()


def rotary(model: nn.Module, hidden: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
    """The decoder's rotary tables ``(B, T, d)`` at `positions` ``(B, T)``."""
    return decoder(model).rotary_emb(hidden, positions)


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    turned = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos.unsqueeze(1) + turned * sin.unsqueeze(1)


@torch.no_grad()
def own_query_key(layer: nn.Module, hidden: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """Post-RoPE ``(B, H, T, d)`` queries and keys of decoder `layer` on its input `hidden` ``(B, T, D)``:
    its own input norm, q and k projections, and RoPE with the tables given."""
    attention = layer.self_attn
    normed = layer.input_layernorm(hidden)
    batch, length, _ = normed.shape
    dim = attention.head_dim
    query = attention.q_proj(normed).view(batch, length, -1, dim).transpose(1, 2)
    key = attention.k_proj(normed).view(batch, length, -1, dim).transpose(1, 2)
    return _rotate(query, cos, sin), _rotate(key, cos, sin)


def probabilities(query: Tensor, key: Tensor) -> Tensor:
    """``(B, H, T, T)`` causal softmax attention of post-RoPE queries and keys (grouped key heads shared), with
    the 1/sqrt(d) scale: the eager rule in float32."""
    heads, groups = query.shape[1], key.shape[1]
    key = key.repeat_interleave(heads // groups, dim=1)
    logits = query @ key.transpose(-1, -2) / query.shape[-1] ** 0.5
    length = query.shape[2]
    causal = torch.ones(length, length, dtype=torch.bool, device=query.device).tril()
    return torch.softmax(logits.masked_fill(~causal, float("-inf")), dim=-1)


def assert_decided(scores: Tensor, keep: int, relative: float = 1e-6) -> None:
    """The `keep` highest of `scores` ``(N,)`` are decided: the keep-th and the next differ by more than
    `relative` of the scores' scale, far above float32 rounding (else the test's inputs are unfit)."""
    if keep >= scores.numel():
        return
    ranked = scores.sort(descending=True).values
    gap = float(ranked[keep - 1] - ranked[keep])
    assert gap > relative * float(ranked.abs().max()), f"near-tie at the cut ({gap:.2e}): choose other inputs"


def top_set(scores: Tensor, keep: int) -> list[int]:
    """The indices of the `keep` highest `scores` ``(N,)``, ascending (a decided top-k, as `topk` takes it)."""
    assert_decided(scores, keep)
    return sorted(scores.topk(keep).indices.tolist())


def fails_when(monkeypatch: pytest.MonkeyPatch, target: Any, name: str, replacement: Callable[..., Any],
               check: Callable[[], None]) -> None:
    """With `target.name` replaced (a deliberate break of the method), `check` must raise AssertionError."""
    monkeypatch.setattr(target, name, replacement)
    with pytest.raises(AssertionError):
        check()
