"""How FiCoCo gets into Hugging Face models: one module per model family.

A family module provides an adapter class (where the vision and decoder layers are, how the
image span is found and shortened) and a `synthetic_inputs` function laid out like the
family's chat template. The registry maps a config's `model_type` to them; a family whose
module is not there yet ends in one clear error.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

from torch import nn

from ficoco.errors import FicocoError

# model_type -> (module, adapter class)
FAMILIES: dict[str, tuple[str, str]] = {
    "llava": ("ficoco.models.llava", "LlavaAdapter"),
    "video_llava": ("ficoco.models.video_llava", "VideoLlavaAdapter"),
    "llava_next": ("ficoco.models.llava_next", "LlavaNextAdapter"),
    "qwen2_vl": ("ficoco.models.qwen2_vl", "Qwen2VLAdapter"),
}
FAMILIES["qwen2_5_vl"] = ("ficoco.models.qwen2_5_vl", "Qwen2_5_VLAdapter")
FAMILIES["llava_onevision"] = ("ficoco.models.llava_onevision", "LlavaOnevisionAdapter")
# Qwen3-VL-MoE is Qwen3-VL with a sparse-expert decoder: the same adapter.
FAMILIES["qwen3_vl"] = ("ficoco.models.qwen3_vl", "Qwen3VLAdapter")
FAMILIES["qwen3_vl_moe"] = ("ficoco.models.qwen3_vl", "Qwen3VLAdapter")
FAMILIES["qwen3_5"] = ("ficoco.models.qwen3_5", "Qwen3_5Adapter")
FAMILIES["internvl"] = ("ficoco.models.internvl", "InternVLAdapter")


def family_module(model_type: str | None) -> Any:
    """The family module of `model_type`, or a FicocoError saying what is supported."""
    entry = FAMILIES.get(model_type or "")
    wired = [name for name, (module, _) in FAMILIES.items() if importlib.util.find_spec(module) is not None]
    if entry is None or importlib.util.find_spec(entry[0]) is None:
        raise FicocoError(f"FiCoCo is not wired into '{model_type}' models yet (supported: {', '.join(wired)})")
    return importlib.import_module(entry[0])


def adapter_for(model: nn.Module) -> Any:
    """The family adapter of a built model."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    module = family_module(model_type)
    return getattr(module, FAMILIES[model_type][1])(model)


def synthetic_inputs(model: nn.Module, **kwargs: Any) -> dict[str, Any]:
    """Random-token inputs laid out like the model family's chat template."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    return family_module(model_type).synthetic_inputs(model, **kwargs)


def supported_families() -> list[str]:
    return [name for name, (module, _) in FAMILIES.items() if importlib.util.find_spec(module) is not None]
