"""VTW on every family but LLaVA-1.5 (tests/test_method_vtw.py), one light test each, on the tiny profiles (seeded
random weights, fp32, CPU): every decoder layer runs on the tokens the accountant plans (none visual from K on),
generate equals a hand-written greedy decode on the caches, whose layers from K on hold the text and the new tokens
alone, and a left-padded batch of two prompts of different lengths equals each run alone. Qwen's 3-D M-RoPE
positions, Qwen3-VL's DeepStack additions (a K within the layers DeepStack adds after) and Qwen3.5's hybrid decoder
(K at its second full-attention layer) are in there.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from helpers import assert_batch_equals_samples_alone, prefill_and_decode
from torch import Tensor, nn

import ficoco
from ficoco.accounting import architecture
from ficoco.accounting.schedule import plan_tokens
from ficoco.api import profile_of
from ficoco.models import hf_compat as hf
from ficoco.models import synthetic_inputs
from ficoco.models.hf_compat import cache_argument, output_cache
from ficoco.profiling.trackers import cache_tokens

TEXT = 12
NEW = 3
# Profile -> K: within the 4-layer decoders (Qwen3-VL's at 1, before DeepStack's second addition); Qwen3.5's 7, its
# full-attention layer after the first (3).
FAMILIES = {"llava-next-tiny": 2, "video-llava-tiny": 2, "llava-onevision-tiny": 3, "internvl3-tiny": 2,
            "qwen2-vl-tiny": 2, "qwen2.5-vl-tiny": 3, "qwen3-vl-tiny": 1, "qwen3-vl-moe-tiny": 2, "qwen3.5-tiny": 7}


def entering_tokens(model: nn.Module, inp: dict[str, Tensor]) -> list[int]:
    """The sequence every decoder layer's MLP ran on in one prefill (full attention or Gated DeltaNet alike)."""
    seen: list[int] = []
    hooks = [layer.post_attention_layernorm.register_forward_pre_hook(lambda m, args: seen.append(args[0].shape[-2]))
             for layer in hf.decoder_layers(model)]
    try:
        with torch.no_grad():
            model(**inp)
    finally:
        for hook in hooks:
            hook.remove()
    return seen


def qwen_decode(model: nn.Module, inp: dict[str, Tensor], new: int) -> tuple[Tensor, Any]:
    """The prefill, then `new - 1` greedy steps on its cache with their 3-D positions given (the mask's running count
    plus the prefill's rope deltas), as generate gives them: the tokens (B, new) and the cache."""
    out = model(**inp, use_cache=True)
    cache, mask = output_cache(out), inp["attention_mask"]
    tokens = [out.logits[:, -1].argmax(-1)]
    for _ in range(new - 1):
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        positions = ((mask.long().cumsum(-1) - 1)[:, -1:] + model.model.rope_deltas).unsqueeze(0).expand(3, -1, -1)
        step = model(input_ids=tokens[-1][:, None], attention_mask=mask, position_ids=positions,
                     **cache_argument(cache), use_cache=True)
        cache = output_cache(step)
        tokens.append(step.logits[:, -1].argmax(-1))
    return torch.stack(tokens, dim=1), cache


def left_padded(short: dict[str, Tensor], long: dict[str, Tensor]) -> dict[str, Tensor]:
    """Two prompts as one left-padded batch: every per-token input padded, the pixels (and grids, sizes) stacked."""
    length, pad = short["input_ids"].shape[1], long["input_ids"].shape[1] - short["input_ids"].shape[1]
    batch = {}
    for key, value in short.items():
        if value.dim() == 2 and value.shape[1] == length:  # ids, mask, Qwen's token types
            value = torch.cat([torch.zeros(1, pad, dtype=value.dtype), value], dim=1)
        batch[key] = torch.cat([value, long[key]])
    return batch


@pytest.mark.parametrize("name", FAMILIES)
def test_vtw_runs_the_planned_tokens_decodes_on_text_only_caches_and_batches_left_padded(
        name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    layer = FAMILIES[name]
    model = ficoco.build_model(name, dtype="fp32")
    inp = synthetic_inputs(model, batch=2, text_tokens=TEXT, seed=1)
    short, long = synthetic_inputs(model, text_tokens=TEXT, seed=2), synthetic_inputs(model, text_tokens=TEXT + 3,
                                                                                      seed=3)
    additions: list[int] = []
    if name.startswith("qwen3-vl"):  # the visual tokens DeepStack adds the tower's features to, per addition
        text_class = type(model.model.language_model)
        original = text_class._deepstack_process

        def spy(self: nn.Module, hidden: Tensor, masks: Tensor, embeds: Tensor) -> Tensor:
            additions.append(int(masks.sum()))
            return original(self, hidden, masks, embeds)

        monkeypatch.setattr(text_class, "_deepstack_process", spy)
    with torch.no_grad(), ficoco.apply(model, "vtw", layer=layer) as handle:
        seen = entering_tokens(model, inp)
        generated = model.generate(**inp, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
        if name.startswith("qwen"):
            decoded, cache = qwen_decode(model, inp, NEW)
        else:
            _, _, decoded, cache = prefill_and_decode(model, inp, NEW, handle)
        assert_batch_equals_samples_alone(model, handle, left_padded(short, long), [short, long])
    arch = architecture(profile_of(model))
    plan = plan_tokens(arch, handle.schedule, text_tokens=inp["input_ids"].shape[1] - arch.visual_tokens)
    assert seen == [entering for entering, _ in plan.llm]
    assert [visual for visual, _ in plan.llm_visual][layer:] == [0] * (arch.decoder.layers - layer)
    assert torch.equal(generated[:, -NEW:], decoded)
    held = cache_tokens(cache)
    text = inp["input_ids"].shape[1] - arch.visual_tokens + NEW - 1
    if name == "qwen3.5-tiny":  # Gated DeltaNet layers hold no tokens; full layer 3 every one, layer 7 the text
        assert held == [0, 0, 0, text + arch.visual_tokens, 0, 0, 0, text]
    else:
        assert held == [text + arch.visual_tokens] * layer + [text] * (arch.decoder.layers - layer)
    if name == "qwen3-vl-tiny":  # after layer 0 every visual token of both samples; after layer 1 (K) none is left
        assert additions[:2] == [2 * arch.visual_tokens, 0]
