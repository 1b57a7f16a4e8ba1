"""VTW's official rule, re-stated here and checked against ficoco's run (lzhxmu/VTW @ a3d8cfc).

The withdrawal (llava/model/language_model/VTW.py:308-314, `pe_type == "keep"`, prefill only): before decoder layer
K runs, `hidden_states = cat([h[:, :35], h[:, 35 + 576:]])` and `position_ids = cat([p[:, :35], p[:, 35 + 576:]])`;
layers K and later run on the text alone with its original (gapped) position ids. The other `pe_type` branch
(:322-328) re-packs the ids of layers >= K (`position_ids[:, :len]`) and decodes them from layer K's cache length.

The search for K (`--findk`, VTW.py:234-265 and :102-107, lmms_eval/__main__.py:388-400): per sample,
`nn.KLDivLoss(reduction='batchmean')(log_softmax(logits_full[:, -1]), softmax(logits_K))` for every K in 5..L-1,
the mean over the samples per K, and K = the first whose mean is at most eta.

The test's own code runs the rule on the unpatched llava-tiny (4 decoder layers, 64 visual tokens): the input of
layer K from the model's own hidden states, the span cut out as the official code cuts it (its start and length
read from the placeholders, where the official code hard-codes 35 and 576), then layers K.. with their own modules,
a causal mask and rotary tables at the kept ids, the final norm and the LM head. ficoco must give the same logits.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import ficoco
from ficoco.methods import registry
from ficoco.methods.base import Step
from ficoco.models import synthetic_inputs
from ficoco.models.hf_compat import cache_argument, output_cache

TINY_PROFILE = "llava-tiny"  # built as this module's `model` (conftest.py)
TEXT = 12
VISUAL = 64
LAYERS = 4


def official_withdrawal_logits(model: nn.Module, inputs: dict[str, Tensor], layer: int,
                               pe_type: str = "keep") -> Tensor:
    """(1, T', V) logits of the official withdrawal at `layer`, batch 1: layers before K as the model runs them,
    then `cat` out of the span, layers K.. by hand at the kept (or, `pe_type` other than "keep", re-packed) ids."""
    language = model.model.language_model
    ids = inputs["input_ids"]
    assert ids.shape[0] == 1
    placeholders = (ids[0] == model.config.image_token_id).nonzero().flatten()
    start, count = int(placeholders[0]), len(placeholders)
    with torch.no_grad():
        hidden = model(**inputs, output_hidden_states=True).hidden_states[layer]  # the input of layer K
        length = ids.shape[1]
        position_ids = torch.arange(length)[None]
        hidden = torch.cat([hidden[:, :start], hidden[:, start + count:]], dim=1)
        if pe_type == "keep":
            position_ids = torch.cat([position_ids[:, :start], position_ids[:, start + count:]], dim=1)
        else:  # VTW.py:328: position_ids[:, :hidden_states.shape[1]]
            position_ids = position_ids[:, :hidden.shape[1]]
        kept = hidden.shape[1]
        mask = torch.full((kept, kept), torch.finfo(hidden.dtype).min).triu(1)[None, None]
        cos, sin = language.rotary_emb(hidden, position_ids)
        for decoder_layer in language.layers[layer:]:
            hidden = decoder_layer(hidden, attention_mask=mask, position_ids=position_ids,
                                   position_embeddings=(cos, sin))
        return model.lm_head(language.norm(hidden))


def official_layer_for_keep(keep: int) -> int:
    """The test's own reading of `--keep N` (a layer average): the K in 1..L whose K * N_visual / L is nearest."""
    averages = {k: k * VISUAL / LAYERS for k in range(1, LAYERS + 1)}
    return min(averages, key=lambda k: (abs(averages[k] - keep), k))


def prompt(model: nn.Module, seed: int, extra: int | None = None) -> dict[str, Tensor]:
    inputs = synthetic_inputs(model, batch=1, text_tokens=TEXT, seed=seed)
    if extra is not None:  # one more text token: the prompt a decode step continues
        ids = torch.cat([inputs["input_ids"], torch.tensor([[extra]])], dim=1)
        inputs = {**inputs, "input_ids": ids, "attention_mask": torch.ones_like(ids)}
    return inputs


def check_withdrawal(model: nn.Module, setting: dict[str, Any], layer: int, pe_type: str = "keep") -> None:
    """ficoco at `setting` withdraws every visual token at `layer` (its records), and its prefill's and one decode
    step's logits are the official rule's, for two samples run as one batch."""
    samples = [prompt(model, seed) for seed in (3, 4)]
    batch = {key: torch.cat([s[key] for s in samples]) for key in samples[0]}
    next_token = 7
    with torch.no_grad(), ficoco.apply(model, "vtw", **setting) as handle:
        out = model(**batch, use_cache=True)
        (record,) = handle.records
        mask = torch.cat([batch["attention_mask"], torch.ones(2, 1, dtype=torch.long)], dim=1)
        step = model(input_ids=torch.full((2, 1), next_token), attention_mask=mask, **cache_argument(output_cache(out)),
                     use_cache=True)
    assert record.layer == layer
    assert tuple(record.kept.shape) == (2, 0)
    assert torch.equal(record.discarded, torch.arange(VISUAL).expand(2, -1))
    for i, sample in enumerate(samples):
        expected = official_withdrawal_logits(model, sample, layer, pe_type)
        torch.testing.assert_close(out.logits[i:i + 1], expected, atol=1e-5, rtol=1e-5)
        # A decode step against the caches equals the rule on the prompt with that token appended (causal).
        longer = official_withdrawal_logits(model, prompt(model, (3, 4)[i], extra=next_token), layer, pe_type)
        torch.testing.assert_close(step.logits[i:i + 1, -1], longer[:, -1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("setting,layer", [
    ({"layer": 1}, 1), ({"layer": 3}, 3),
    ({"keep": 32}, official_layer_for_keep(32)), ({"keep": 45}, official_layer_for_keep(45)),
])
def test_vtw_withdraws_every_visual_token_at_layer_k_as_the_official_rule(model: nn.Module, setting: dict,
                                                                          layer: int) -> None:
    assert layer in (1, 2, 3)
    check_withdrawal(model, setting, layer)


@pytest.mark.parametrize("layer", [1, 2])
def test_vtw_positions_compact_is_the_official_other_pe_type(model: nn.Module, layer: int) -> None:
    check_withdrawal(model, {"layer": layer, "positions": "compact"}, layer, pe_type="repack")


def test_a_broken_vtw_fails_the_rule_check(model: nn.Module, monkeypatch: pytest.MonkeyPatch) -> None:
    import ficoco.methods.vtw.ops as vtw_ops

    spec = registry.METHODS["vtw"]

    def one_layer_late(settings: Any, n_visual: int, n_layers: int) -> tuple[Step, ...]:
        return (Step(settings["layer"] + 1, n_visual),)

    with monkeypatch.context() as patch:  # an off-by-one layer
        patch.setitem(registry.METHODS, "vtw", dataclasses.replace(spec, steps=one_layer_late))
        with pytest.raises(AssertionError):
            check_withdrawal(model, {"layer": 1}, 1)
    with monkeypatch.context() as patch:  # the text's ids re-packed where the official default keeps them
        repacked = {**spec.hyperparameters, "positions": "compact"}
        patch.setitem(registry.METHODS, "vtw", dataclasses.replace(spec, hyperparameters=repacked))
        with pytest.raises(AssertionError):
            check_withdrawal(model, {"layer": 2}, 2)
    original = vtw_ops.rebuild
    with monkeypatch.context() as patch:  # the span cut out one token late
        patch.setattr(vtw_ops, "rebuild", lambda hidden, kept, start, *rest: original(hidden, kept, start + 1, *rest))
        with pytest.raises(AssertionError):
            check_withdrawal(model, {"layer": 2}, 2)
    check_withdrawal(model, {"layer": 2}, 2)  # unbroken again


# ---- the search for K ---------------------------------------------------------------------------------------------

SAMPLES = 2


def official_search(model: nn.Module, layers: list[int]) -> dict[int, float]:
    """The mean KL per K over the samples, as VTW.py:105-106 and lmms_eval/__main__.py:397 compute it."""
    kl_div = nn.KLDivLoss(reduction="batchmean")
    totals = []
    for seed in range(SAMPLES):  # the calibration's synthetic prompts: seeds 0.. with its text length
        inputs = synthetic_inputs(model, batch=1, text_tokens=60, seed=seed)
        with torch.no_grad():
            full = model(**inputs).logits[:, -1]
        # In float64 (the official code's is in the model's dtype, ficoco's in float64: docs/methods/vtw.md).
        totals.append([kl_div(F.log_softmax(full.double(), dim=1),
                              F.softmax(official_withdrawal_logits(model, inputs, k)[:, -1].double(), dim=1)).item()
                       for k in layers])
    means = torch.tensor(totals, dtype=torch.float64).mean(dim=0)
    return dict(zip(layers, means.tolist(), strict=True))


def first_within(mean_kl: dict[int, float], eta: float) -> int:
    return [k for k in mean_kl if mean_kl[k] <= eta][0]  # (kl_results <= eta).nonzero()[0]


def check_search(model: nn.Module) -> None:
    """ficoco's calibration (its library function, same seeded model and prompts) gives the official means and K,
    at two values of eta that pick different layers."""
    from ficoco.calibration.vtw import calibrate_vtw

    layers = [1, 2, 3]
    expected = official_search(model, layers)
    ordered = sorted(expected.values())
    assert len(set(ordered)) == 3 and all(b > a * 1.01 for a, b in zip(ordered, ordered[1:], strict=False))
    for eta in (ordered[0] * 1.005, ordered[-1] * 1.005):  # decided: no mean within 0.5 % of eta
        found = calibrate_vtw(TINY_PROFILE, limit=SAMPLES, first_layer=1, eta=eta, dtype="fp32", device="cpu")
        assert found.layers == layers
        torch.testing.assert_close(torch.tensor(list(found.mean_kl.values())),
                                   torch.tensor(list(expected.values())), atol=1e-9, rtol=1e-3)
        assert found.layer == first_within(expected, eta)


def test_the_search_finds_the_first_layer_whose_mean_kl_is_within_eta(model: nn.Module) -> None:
    check_search(model)


def test_a_kl_of_the_wrong_direction_fails_the_search_check(model: nn.Module, monkeypatch: pytest.MonkeyPatch) -> None:
    import ficoco.calibration.vtw as calibration

    original = calibration.withdrawal_kl
    monkeypatch.setattr(calibration, "withdrawal_kl", lambda full, withdrawn: original(withdrawn, full))
    with pytest.raises(AssertionError):
        check_search(model)
