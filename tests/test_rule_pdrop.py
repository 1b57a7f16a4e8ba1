"""PDrop's official rule, re-stated here, against ficoco's kept sets on llava-tiny.

The official code: Cooperx521/PyramidDrop at 6444f30, llava/model/modeling_llama_pdrop.py:

- after decoder layer ``layer_idx``, ``rank_layer = layer_idx + 1``; a stage runs where ``rank_layer`` is in
  ``layer_list`` (L1220-1237), ``stage = layer_list.index(rank_layer)``;
- `pdrop_rank_drop` (L1291-1446): the rank layer's *own* ``input_layernorm``, ``q_proj`` and ``k_proj`` on the
  sequence entering it (L1321-1342), RoPE at the current (compacted) positions; the last instruction token's
  row (``prompt_len + image_tokens - 1``: the last prompt token at inference, L1389-1392) softmaxed in float32
  over every key (causal), averaged over heads, image columns (L1394-1401);
- ``keep_length = int(N * image_token_ratio_list[stage + 1])`` of the original N (L1306-1307; the scripts'
  list gets 1.0 prepended, llava/eval/model_vqa_loader.py L94-96); ``topk(keep).sort()`` (L1405-1407); the
  sequence [prefix, kept, suffix] and ``position_ids = arange`` (L1446).

The first stage's input is the unpatched model's (its hidden states); a later stage's is what the patched
model's rank layer received, with the rule recomputed here from that layer's weights at ``arange`` positions.
ficoco runs its defaults (``attention_scores="model"``, the official rule). The tiny decoder has 4 layers: the
stages are set at layers 1, 2, 3 (``spacing=1``), the official ratios at two lambdas.
"""

from __future__ import annotations

import pytest
import torch
from rule_support import decoder, eager_run, fails_when, own_query_key, probabilities, rotary, top_set, watch_layers
from torch import Tensor, nn

import ficoco
import ficoco.methods.pdrop as pdrop_spec
from ficoco.models import llm_steps, synthetic_inputs

TINY_PROFILE = "llava-tiny"  # built as this module's `model` (conftest.py)
START, N = 5, 64
TEXT = 12
LAYERS = [1, 2, 3]


def official_stage(model: nn.Module, layer: int, entering: Tensor, visual: int, keep: int) -> list[int]:
    """One stage of the official rule: the `keep` image tokens (indices in the current span) the last
    token's attention in `layer`'s own q and k ranks highest, on the sequence `entering` it."""
    positions = torch.arange(entering.shape[1]).unsqueeze(0)  # compacted: arange
    cos, sin = rotary(model, entering, positions)
    query, key = own_query_key(decoder(model).layers[layer], entering, cos, sin)
    row = probabilities(query, key).mean(dim=1)[0, -1]
    return top_set(row[START:START + visual], keep)


def check_pdrop(model: nn.Module, ratio: float, seed: int) -> None:
    inputs = synthetic_inputs(model, batch=1, text_tokens=TEXT, seed=seed)
    first = eager_run(model, inputs).hidden_states[LAYERS[0]]  # the unpatched input of the first rank layer
    with torch.no_grad(), ficoco.apply(model, "pdrop", spacing=1, ratio=ratio) as handle, \
            watch_layers(model, LAYERS) as seen:
        model(**inputs)
    assert [r.layer for r in handle.records] == LAYERS
    visual, original = N, list(range(N))  # the current span, by original index
    for stage, (layer, record) in enumerate(zip(LAYERS, handle.records, strict=True)):
        entering = first if stage == 0 else seen[layer].received
        keep = int(N * ratio ** (stage + 1))
        kept = official_stage(model, layer, entering, visual, keep)
        original = [original[i] for i in kept]
        assert record.kept[0].tolist() == original, f"stage {stage}"
        # The rank layer runs on [prefix, kept, suffix] at compacted positions.
        rows = [*range(START), *(START + i for i in kept), *range(START + visual, entering.shape[1])]
        assert torch.equal(seen[layer].ran_on[0], seen[layer].received[0, rows])
        cos, _ = rotary(model, entering, torch.arange(len(rows)).unsqueeze(0))
        assert torch.equal(seen[layer].rotary[0], cos)
        visual = keep


@pytest.mark.parametrize("ratio,seed", [(0.5, 0), (0.75, 3)])
def test_pdrop_keeps_at_every_stage_what_the_rank_layers_own_last_row_attends_most(
        model: nn.Module, ratio: float, seed: int) -> None:
    check_pdrop(model, ratio, seed)


def test_the_pdrop_rule_check_fails_when_the_rank_layers_row_is_taken_before_rope(
        model: nn.Module, monkeypatch: pytest.MonkeyPatch) -> None:
    original = llm_steps.own_last_row

    def without_rope(layer: nn.Module, hidden: Tensor, cos: Tensor, sin: Tensor, visible: Tensor,
                     scores: str) -> Tensor:
        return original(layer, hidden, torch.ones_like(cos), torch.zeros_like(sin), visible, scores)

    fails_when(monkeypatch, llm_steps, "own_last_row", without_rope, lambda: check_pdrop(model, 0.5, 0))


def test_the_pdrop_rule_check_fails_when_the_pyramid_is_one_stage_late(
        model: nn.Module, monkeypatch: pytest.MonkeyPatch) -> None:
    def one_stage_late(n_visual: int, ratio: float, stages: int) -> tuple[int, ...]:
        return tuple(max(1, int(n_visual * ratio ** k)) for k in range(stages))  # ratio ** stage, not stage + 1

    fails_when(monkeypatch, pdrop_spec, "stage_keeps", one_stage_late, lambda: check_pdrop(model, 0.5, 0))
