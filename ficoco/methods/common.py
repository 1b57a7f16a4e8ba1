"""Torch-free pieces several method specs share: the family tuples their entries name, the checks of a
layer and a kept count, the one-cut steps of the methods that cut once before the LLM, and the
sentences their entries repeat. A method folder's spec (``ficoco/methods/<name>/__init__.py``)
imports what it uses from here; nothing here knows a method.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from ficoco.errors import FicocoError
from ficoco.methods.base import Step

LLAVA_FAMILIES = ("llava", "llava_next", "video_llava")
ALL_FAMILIES = ("llava", "llava_next", "qwen2_vl", "video_llava", "llava_onevision")
# Qwen2.5-VL runs every method Qwen2-VL runs (its adapter maps its tower's window order to grid order).
ALL_FAMILIES += ("qwen2_5_vl",)
# The families the entries that name this tuple are tested on (issue 25's matrix): written out, so that a
# family added to ALL_FAMILIES shows as refused ("not wired") for them until their tests run there.
TESTED_FAMILIES = ("llava", "llava_next", "qwen2_vl", "video_llava", "llava_onevision")
# PDrop and SparseVLM act in Qwen2-VL's decoder (3-D positions kept, no compaction), ToMe merges groups in its
# windowed tower in grid order: tested on Qwen2.5-VL too (issue 25).
TESTED_FAMILIES += ("qwen2_5_vl",)
# Qwen3-VL (dense and MoE): Qwen2-VL's parts with DeepStack's features following every method (issue 34).
QWEN3_VL_FAMILIES = ("qwen3_vl", "qwen3_vl_moe")
ALL_FAMILIES += QWEN3_VL_FAMILIES
TESTED_FAMILIES += QWEN3_VL_FAMILIES
# Qwen3.5 (issue 34): the methods before the LLM run as on Qwen2-VL; those in its hybrid decoder run where the
# layer they read or reduce is full attention, and refuse a Gated DeltaNet layer in one line
# (ficoco.models.qwen3_5.hybrid).
ALL_FAMILIES += ("qwen3_5",)
TESTED_FAMILIES += ("qwen3_5",)
# InternVL3 (issue 34): InternViT's [CLS] and pixel-shuffle groups; the methods keep or merge whole groups.
ALL_FAMILIES += ("internvl",)
TESTED_FAMILIES += ("internvl",)

# What `--keep N` counts for the methods that cut every tower item before the LLM.
PER_ITEM = "visual tokens per image, crop or frame that reach the LLM"
# What a method that scores by [CLS] attention uses on towers without [CLS] (MethodSpec.cls_note).
EQUIVALENT = ("towers without [CLS] (Qwen2-VL): FiCoCo's equivalent token (-cos of each patch's head-mean key to "
              "their mean) scores the patches in place of the [CLS] attention, averaged over each 2x2 merge group")
# The row FastV, HoliTom's inner merge (and PDrop, from its own projections) read.
LAST_ROW = "the last prompt token (left padding puts it at T - 1 in every sample)"

StepsFunction = Callable[[Mapping[str, Any], int, int], tuple[Step, ...]]
ForKeepFunction = Callable[[int | None, int, int, Mapping[str, Any]], dict[str, Any]]


def check_layer(name: str, layer: int, n_layers: int, low: int = 1) -> None:
    """Refuse a decoder (or tower) layer outside ``low..n_layers - 1``."""
    if not low <= layer < n_layers:
        raise FicocoError(f"{name}: layer {layer} is outside the decoder's layers {low}..{n_layers - 1}")


def check_keep(name: str, keep: int, n_visual: int) -> None:
    """Refuse a kept count outside ``1..n_visual``."""
    if not 1 <= keep <= n_visual:
        raise FicocoError(f"{name}: keep {keep} is outside 1..{n_visual}, the visual tokens the LLM receives")


def cut_steps(title: str, where: str) -> StepsFunction:
    """The steps of a method that cuts every item once before the LLM, at `where` ("tower_output" or
    "after_projector"), to its settings' ``keep`` units."""
    def steps(settings: Mapping[str, Any], n_visual: int, n_layers: int) -> tuple[Step, ...]:
        keep = settings["keep"]
        check_keep(title, keep, n_visual)
        return (Step(n_layers - 1, n_visual - keep, 0, where, "vision"),) if keep < n_visual else ()
    return steps


def ratio_for_keep(title: str, ratio_name: str, **fixed: Any) -> ForKeepFunction:
    """`settings_for_keep` of a one-cut method: `keep`, or without it the share `ratio_name` of the item's
    units (the official default row, scaled to the item); the other hyperparameters and `fixed` ride along, but
    the rule attention is read by, which joins the settings where a run corrects it (accounting's `plan`)."""
    def for_keep(keep: int | None, n_visual: int, n_layers: int, hp: Mapping[str, Any]) -> dict[str, Any]:
        if keep is None:  # the official default row, scaled to the item's tokens
            keep = max(1, round(n_visual * hp[ratio_name]))
        check_keep(title, keep, n_visual)
        riding = {name: hp[name] for name in hp if name not in (ratio_name, "attention_scores")}
        return {"keep": keep, **riding, **fixed}
    return for_keep
