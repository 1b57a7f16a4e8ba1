"""A hand-written greedy decode, the reference that `generate` of a patched model is checked against."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from ficoco.models.hf_compat import cache_argument, output_cache


def prefill_and_decode(model: nn.Module, inputs: dict[str, Any], new: int, handle: Any = None
                       ) -> tuple[Any, Tensor | None, Tensor, Any]:
    """The prefill of `inputs`, then `new - 1` greedy steps on its cache, the attention mask grown from
    the caller's prompt as a hand-written loop grows it. Returns the prefill's output, the handle's
    `output_positions` right after the prefill (None without a handle), the `new` tokens ``(B, new)``
    and the cache after the last step."""
    out = model(**inputs, use_cache=True)
    positions = handle.output_positions if handle is not None else None
    cache, mask = output_cache(out), inputs["attention_mask"]
    tokens = [out.logits[:, -1].argmax(-1)]
    for _ in range(new - 1):
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        step = model(input_ids=tokens[-1][:, None], attention_mask=mask, **cache_argument(cache), use_cache=True)
        cache = output_cache(step)
        tokens.append(step.logits[:, -1].argmax(-1))
    return out, positions, torch.stack(tokens, dim=1), cache
