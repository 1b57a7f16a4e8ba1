"""G-Prune's official rule, re-stated from jytmelon/G-Prune @ 762c637 (LLaVA-NeXT/llava/model/llava_arch.py:239-290,
language_model/llava_llama.py:85-90), checked against ficoco's run on the tiny LLaVA-NeXT and LLaVA-1.5.

The official code (llava_arch.py) takes the packed features of an image, `image_feature` (:259: the base view's
576 tokens, then the unpadded crop grid's rows, each ended by the `image_newline` token), and per part (the base
view; the grid without its newline tokens, :246-258) builds the cosine graph, thresholds it at `similarity`,
divides by `temperature`, sets the zeros to -5000, softmaxes every row (:259-270), counts each row's positive
entries as its degree (:271-272), raises the graph to the `iterate_num`-th power (:273-274), scores every column
by the norms' row vector times the power over the column's own degree (:275-280), keeps the `int(keep_ratio * N)`
best of each part and every newline token, sorted (:281-288); the LLM then runs the kept tokens at their
positions in the unreduced prompt (:290, :406) and decodes from the last kept id + 1 (llava_llama.py:86-90).

Here the rule is written again in plain torch (`official_keep`, `official_positions`) on the unpatched model's
packed projector output (`get_image_features`), independent of ficoco's ops; ficoco's kept tokens (its records)
and the position ids its LLM received (a hook on the decoder) must equal it, at two budgets. The image is the
one sample's (the official loop reads only the last image's features, a defect ficoco generalises per image).
A second test breaks one piece of ficoco's method (the ranking's sign; the positions' gaps) and checks that the
same comparison fails.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor, nn

import ficoco
from ficoco.models import hf_compat as hf
from ficoco.models import synthetic_inputs

TEXT = 12
PROFILES = {"llava-next-tiny": 16, "llava-tiny": 64}  # patches per item: the base view's tokens (NeXT) or an image's


@pytest.fixture(scope="module")
def models() -> dict[str, nn.Module]:
    return {name: ficoco.build_model(name, dtype="fp32") for name in PROFILES}


# ---- the official rule, re-stated (llava_arch.py:246-290) ----------------------------------------------------------

def official_keep(image_feature: Tensor, base_tokens: int, row_num: int, col_num: int, keep_ratio: float,
                  similarity: float = 0.5, temperature: float = 0.03, iterate_num: int = 5) -> Tensor:
    """The kept indices into the packed image span, sorted (:246-288); `row_num` 0: the base view alone
    (LLaVA-1.5's one image is the official base part)."""
    image1_token_length = base_tokens
    mask = torch.zeros(row_num, col_num + 1)
    mask[:, -1] = 1
    mask = mask.flatten()
    image_token_index1 = torch.arange(0, base_tokens)
    image_token_index2 = torch.where(mask == 0)[0] + image1_token_length
    row_end_token_index = torch.where(mask == 1)[0] + image1_token_length
    kept = []
    parts = [(image_token_index1, int(keep_ratio * base_tokens))]
    if row_num:
        parts.append((image_token_index2, int(keep_ratio * row_num * col_num)))
    for index, count in parts:
        normalized = torch.nn.functional.normalize(image_feature[index], p=2, dim=1)
        a = normalized @ normalized.t()
        a[a < similarity] = 0
        a = a / temperature
        a[abs(a) < 1e-6] = -5000
        a = torch.nn.functional.softmax(a, dim=1)
        degree = torch.sum(a > 0, dim=1)
        a = torch.matrix_power(a, iterate_num)
        w = torch.norm(image_feature[index], dim=-1).view(1, -1).to(dtype=a.dtype)
        result = (w @ a) / degree
        kept.append(index[result.topk(count).indices].flatten())
    return torch.sort(torch.cat([*kept, row_end_token_index]))[0]


def official_positions(image_keep_indices: Tensor, prefix: int, image_tokens: int, length: int) -> Tensor:
    """The position ids of the shortened prompt (:290): the text before the image, the kept image tokens at
    their places in the unreduced span, the text after it; `length` the unreduced prompt's."""
    return torch.cat([torch.arange(prefix), prefix + image_keep_indices,
                      torch.arange(prefix + image_tokens, length)])


def unpatched_features(model: nn.Module, inputs: dict[str, Tensor]) -> Tensor:
    """The packed projector output of the sample's one image, as the unpatched model computes it."""
    options = {"image_sizes": inputs["image_sizes"]} if "image_sizes" in inputs else {}
    out = model.model.get_image_features(inputs["pixel_values"], vision_feature_layer=-2,
                                         vision_feature_select_strategy="default", return_dict=True, **options)
    return out.pooler_output[0] if isinstance(out.pooler_output, (list, tuple)) else out.pooler_output[0]


# ---- the comparison -------------------------------------------------------------------------------------------------

def _decoder_position_ids(model: nn.Module, run: Any) -> list[Tensor]:
    seen: list[Tensor] = []
    hook = hf.language_model(model).register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(kwargs["position_ids"]), with_kwargs=True)
    try:
        run()
    finally:
        hook.remove()
    return seen


def check_official_rule(model: nn.Module, name: str, keep: int | None) -> None:
    """ficoco's kept tokens and its LLM's position ids (prefill and decode) equal the official rule's."""
    patches = PROFILES[name]
    inputs = synthetic_inputs(model, batch=1, text_tokens=TEXT, seed=5)
    ids = inputs["input_ids"][0]
    placeholders = torch.nonzero(ids == model.config.image_token_id).flatten()
    prefix, image_tokens, length = int(placeholders[0]), placeholders.numel(), ids.numel()
    with torch.no_grad():
        feature = unpatched_features(model, inputs)
    newline = getattr(model.model, "image_newline", None)
    row_num = int((feature == newline).all(-1).sum()) if newline is not None else 0
    col_num = (feature.shape[0] - patches) // row_num - 1 if row_num else 0
    ratio = 0.5 if keep is None else keep / patches  # the official default, or the ratio of ficoco's count
    expected = official_keep(feature, patches, row_num, col_num, ratio)
    settings = {} if keep is None else {"keep": keep}
    with torch.no_grad(), ficoco.apply(model, "gprune", **settings) as handle:
        prefill = _decoder_position_ids(model, lambda: model(**inputs))
        records = handle.records
        steps = _decoder_position_ids(model, lambda: model.generate(**inputs, max_new_tokens=3, min_new_tokens=3,
                                                                    do_sample=False))
    (record,) = records  # a row per item: the base view's (the image's), then every crop's; -1 pads a row
    rows = [row[row >= 0] for row in record.kept]
    assert rows[0].tolist() == expected[expected < patches].tolist()
    if row_num:  # the grid's kept tokens: crop by crop (2 x 2 crops of a square image), back on the whole grid
        side = int(patches**0.5)
        on_grid = [(c // 2 * side + p // side) * col_num + c % 2 * side + p % side
                   for c, row in enumerate(rows[1:]) for p in row.tolist()]
        grid = expected[expected >= patches] - patches
        grid = grid[grid % (col_num + 1) != col_num]
        assert sorted(on_grid) == (grid // (col_num + 1) * col_num + grid % (col_num + 1)).tolist()
    positions = official_positions(expected, prefix, image_tokens, length)
    assert prefill[0][0].tolist() == positions.tolist()
    # generate: the same prefill, then the last kept id + 1, + 2 (llava_llama.py:86-90).
    assert steps[0][0, -positions.numel():].tolist() == positions.tolist()
    assert [int(s[0, -1]) for s in steps[1:]] == [length, length + 1]


@pytest.mark.parametrize("name,keep", [("llava-next-tiny", None), ("llava-next-tiny", 4), ("llava-tiny", None),
                                       ("llava-tiny", 16)])
def test_kept_tokens_and_position_ids_follow_the_official_rule(models: dict[str, nn.Module], name: str,
                                                              keep: int | None) -> None:
    check_official_rule(models[name], name, keep)


@pytest.mark.parametrize("break_", ["ranking", "positions"])
def test_a_broken_piece_of_the_method_fails_the_rule(models: dict[str, nn.Module], break_: str,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from ficoco.methods.gprune import ops
    from ficoco.models.base import FamilyAdapter

    if break_ == "ranking":  # the lowest flow kept instead of the highest
        top = ops.top_indices
        monkeypatch.setattr(ops, "top_indices", lambda scores, k: top(-scores, k))
    else:  # the kept tokens at the first placeholders of the span (compacted), not where they came from
        monkeypatch.setattr(FamilyAdapter, "gapped_index", lambda self, input_ids, kept, flags: kept)
    with pytest.raises(AssertionError):
        check_official_rule(models["llava-next-tiny"], "llava-next-tiny", 4)
