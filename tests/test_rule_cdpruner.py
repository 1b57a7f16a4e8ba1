"""CDPruner's official rule, re-stated here and checked against ficoco on llava-tiny (issue 53).

Official code: Theia-4869/CDPruner at 9541616c40fcd5625de1cdb8ea6c33c129eb7864 (ficoco first read ed9c12d; the
rule's lines are the same there, only their comments changed).

- llava/model/llava_arch.py L141-187 (``encode_images``): the projector's output (L148) L2-normalised, its
  cosine similarity in float32 (L150-153); the relevance ``-cos(image_embeds, text_embeds)``, mean over the text
  embeddings, min-max normalised ``(r - min + 1e-6) / (max - min)`` (L155-160); the kernel
  ``r_i * S_ij * r_j`` (L167; the ``exp(theta ...)`` reweighting is commented out, L163-166); fast greedy MAP:
  ``j = argmax d^2``, ``e = (L_j - c_j . c) / sqrt(d_j^2)``, ``d^2 -= e^2``, ``d_j^2 = -inf`` (L169-181); the
  picks sorted into a boolean mask (L183-185), so the tokens stay in image order.
- llava/model/multimodal_encoder/clip_encoder.py L62-98: ``image_embeds`` are CLIP's ``post_layernorm`` and
  ``visual_projection`` of the selected layer's patches, ``text_embeds`` the CLIP text tower's pooled
  embedding of the instruction (``CLIPTextModelWithProjection``, one per 77-token segment), and
  llava/eval/model_vqa_loader.py L106-120: that instruction is the bare question (the answer-format line
  removed).

Hugging Face's LLaVA checkpoints carry no CLIP text tower or ``visual_projection``, so ficoco relates the
projected tokens themselves to the LLM's input embeddings of the prompt's text after the image, each token
one embedding (docs/methods/cdpruner.md, its first departure): the rule below takes those stand-ins and is the
official code's in everything else. ficoco's min-max runs per image where the official code's runs over the
whole batch of one call (its batch is one image in the evaluation scripts); the rule runs it per image. The
budgets stay below the kernel's rank (the projected width, 64), where the official greedy never repeats a pick.
"""

from __future__ import annotations

import pytest
import torch
from rule_support_vision import assert_decided, feature_layer, patched_run, unpatched_projector, unpatched_tower
from torch import Tensor, nn

import ficoco.methods.cdpruner.ops as cdpruner_ops
from ficoco.models import synthetic_inputs

TINY_PROFILE = "llava-tiny"  # built as this module's `model` (conftest.py): 64 patches, [CLS] first
SEED = 1


def official_cdpruner(image_features: Tensor, image_embeds: Tensor, text_embeds: Tensor, visual_token_num: int
                      ) -> list[int]:
    """One image's kept token indices (ascending): ``image_features`` ``(N, D)`` the projector's output,
    ``image_embeds`` ``(N, C)`` and ``text_embeds`` ``(M, C)`` the relevance's two sides."""
    image_normalized = (image_features / image_features.norm(dim=-1, keepdim=True)).float()
    similarity = image_normalized @ image_normalized.t()
    image_embeds = image_embeds / image_embeds.norm(dim=-1, keepdim=True)
    text_embeds = text_embeds / text_embeds.norm(dim=-1, keepdim=True)
    relevance = (-(image_embeds @ text_embeds.t())).mean(dim=-1)
    relevance = (relevance - relevance.min() + 1e-6) / (relevance.max() - relevance.min())
    kernel = relevance.unsqueeze(1) * similarity * relevance.unsqueeze(0)
    tokens = kernel.shape[0]
    cis = torch.zeros(visual_token_num, tokens)
    di2s = torch.diagonal(kernel).clone()
    selected = []
    for i in range(visual_token_num):
        assert_decided(di2s[None], 1)
        j = int(torch.argmax(di2s))
        selected.append(j)
        eis = (kernel[j] - cis[:i, j] @ cis[:i]) / torch.sqrt(di2s[j])
        cis[i] = eis
        di2s -= eis.square()
        di2s[j] = -float("inf")
    return sorted(selected)


def text_after_image(model: nn.Module, input_ids: Tensor) -> list[Tensor]:
    """Per sample, the LLM's input embeddings of the prompt's tokens after its last image placeholder (ficoco's
    stand-in for the CLIP text tower's embedding of the question)."""
    image = model.config.image_token_index
    embed = model.get_input_embeddings()
    with torch.no_grad():
        return [embed(ids[int((ids == image).nonzero().max()) + 1:]) for ids in input_ids]


def check_cdpruner(model: nn.Module, setting: dict, keep: int) -> None:
    inputs = synthetic_inputs(model, batch=2, text_tokens=12, seed=SEED)
    tower = unpatched_tower(model, inputs["pixel_values"])
    projected = unpatched_projector(model, tower.hidden_states[feature_layer(model) + 1][:, 1:])
    texts = text_after_image(model, inputs["input_ids"])
    kept = torch.tensor([official_cdpruner(item, item, text, keep)
                         for item, text in zip(projected, texts, strict=True)])
    run = patched_run(model, inputs, "cdpruner", **setting)
    (record,) = run.records
    assert torch.equal(record.kept, kept)
    torch.testing.assert_close(run.llm_visual, torch.stack([p[k] for p, k in zip(projected, kept, strict=True)]),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("setting,keep", [({}, 14), ({"keep": 8}, 8), ({"keep": 24}, 24)])
def test_cdpruner_keeps_the_official_conditional_dpp_greedy_picks(model: nn.Module, setting: dict,
                                                                  keep: int) -> None:
    # {}: the default, the README's 128 of 576 (ratio 0.2222): round(64 * 0.2222) = 14.
    check_cdpruner(model, setting, keep)


@pytest.mark.parametrize("broken", ["relevance_sign", "no_conditioning_on_earlier_picks"])
def test_cdpruner_rule_check_catches_a_broken_relevance_or_greedy(model: nn.Module, monkeypatch: pytest.MonkeyPatch,
                                                                  broken: str) -> None:
    if broken == "relevance_sign":  # +cos: the tokens least related to the instruction weighed up
        real_relevance = cdpruner_ops.relevance
        monkeypatch.setattr(cdpruner_ops, "relevance",
                            lambda image, text, text_mask=None: real_relevance(image, -text, text_mask))
    else:  # the greedy MAP without the earlier picks' projections: the kernel's largest diagonal entries
        monkeypatch.setattr(cdpruner_ops, "greedy_map",
                            lambda kernel, keep: torch.topk(torch.diagonal(kernel, dim1=1, dim2=2), keep).indices)
    with pytest.raises(AssertionError):
        check_cdpruner(model, {"keep": 8}, 8)
