"""FastV's official rule, re-stated here, against ficoco's kept set on llava-tiny.

The official code: pkunlp-icler/FastV at d165972, the HF fork's `fastv_forward`
(src/FastV/llava-hf/transformers/src/transformers/models/llama/modeling_llama.py L1037-1058; layer K-1 runs
with ``output_attentions=True``, L1105-1106), the same rule as the 4.31 fork (src/transformers/src/transformers/
models/llama/modeling_llama.py L736-756):

- at ``layer_idx == K``, the attention probabilities of layer K-1 (eager, softmax over all keys, causal),
  averaged over heads (``torch.mean(attn, dim=1)[0]``), last query row (``[-1]``), image columns;
- ``topk(round(N * (1 - R)))`` of them stay, sorted back into order (``keep_indexs.sort()``), with their
  original position ids (``position_ids = keep_indexs``); nothing is merged.

The test takes layer K-1's probabilities from the unpatched model run with eager attention and
``output_attentions=True``, as the official code reads them. ficoco runs its defaults (``attention_scores="model"``,
the official rule). The tiny decoder has 4 layers: FastV's official K=2 exists in it, and K=1 is checked too.
"""

from __future__ import annotations

import pytest
import torch
from rule_support import decoder, eager_run, fails_when, top_set, watch_layers
from torch import Tensor, nn

import ficoco
from ficoco.methods.fastv import ops as fastv_ops
from ficoco.methods.ops import last_row_scores
from ficoco.models import synthetic_inputs

TINY_PROFILE = "llava-tiny"  # built as this module's `model` (conftest.py)
START, N = 5, 64  # the image span of llava-tiny's synthetic prompt
TEXT = 12


def official_fastv(model: nn.Module, inputs: dict[str, Tensor], layer: int, ratio: float) -> list[int]:
    """The kept image tokens (indices in the span) of the official rule, from the unpatched model."""
    attention = eager_run(model, inputs).attentions[layer - 1]  # (1, H, T, T) of layer K-1
    row = attention.mean(dim=1)[0][-1]  # heads averaged, the last prompt token's row
    scores = row[START:START + N]
    return top_set(scores, round(N * (1 - ratio)))


def check_fastv(model: nn.Module, layer: int, ratio: float, seed: int) -> None:
    """ficoco's FastV keeps the official set at `layer` for ratio R, with the original positions."""
    inputs = synthetic_inputs(model, batch=1, text_tokens=TEXT, seed=seed)
    expected = official_fastv(model, inputs, layer, ratio)
    with torch.no_grad(), ficoco.apply(model, "fastv", layer=layer, ratio=ratio) as handle, \
            watch_layers(model, [layer]) as seen:
        model(**inputs)
    (record,) = handle.records
    assert record.layer == layer and record.kept[0].tolist() == expected
    # The sequence layer K ran on: prefix, the kept image tokens in order, the text; original positions.
    length = inputs["input_ids"].shape[1]
    keep = [*range(START), *(START + i for i in expected), *range(START + N, length)]
    received = seen[layer].received[0]
    assert torch.equal(seen[layer].ran_on[0], received[keep])
    cos, _ = decoder(model).rotary_emb(received[None], torch.tensor([keep]))
    assert torch.equal(seen[layer].rotary[0], cos)


@pytest.mark.parametrize("layer,ratio,seed", [(2, 0.5, 0), (2, 0.75, 1), (1, 0.25, 2)])
def test_fastv_keeps_the_tokens_the_last_prompt_token_attended_most_in_layer_k_minus_1(
        model: nn.Module, layer: int, ratio: float, seed: int) -> None:
    check_fastv(model, layer, ratio, seed)


def test_the_fastv_rule_check_fails_when_the_heads_are_reduced_by_their_max(
        model: nn.Module, monkeypatch: pytest.MonkeyPatch) -> None:
    def head_max(row_attention: Tensor, visual_start: Tensor, num_visual: int) -> Tensor:
        return last_row_scores(row_attention.amax(dim=1), visual_start, num_visual)

    fails_when(monkeypatch, fastv_ops, "fastv_scores", head_max, lambda: check_fastv(model, 2, 0.5, 0))
