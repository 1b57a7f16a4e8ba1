"""The model families the accountant knows: one torch-free shape module each (LLM-Viewer's one config
per model), collected here by `model_type`.

A shape module reads its family's Hugging Face config dict with the config classes' defaults, turns
it into an `Architecture` for one input layout, and refuses, in one line, a geometry its transformers
classes refuse. Adding a family is one shape module here (its `FAMILY` in `FAMILIES`), one adapter in
ficoco.models and one profile.
"""

from __future__ import annotations

from ficoco.accounting.families import (
    internvl,
    llava,
    llava_next,
    llava_onevision,
    qwen2_5_vl,
    qwen2_vl,
    qwen3_5,
    qwen3_vl,
    qwen3_vl_moe,
    video_llava,
)
from ficoco.accounting.shapes import Family

# model_type -> the family's shape module's record, in the order supported families are listed.
FAMILIES: dict[str, Family] = {
    module.FAMILY.name: module.FAMILY
    for module in (llava, llava_next, video_llava, qwen2_vl, qwen2_5_vl, llava_onevision, qwen3_vl, qwen3_vl_moe,
                   qwen3_5)
}
FAMILIES[internvl.FAMILY.name] = internvl.FAMILY

__all__ = ["FAMILIES", "Family"]
