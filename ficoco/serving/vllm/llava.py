"""LLaVA-1.5 in vLLM with a method after the projector (knows vLLM's LLaVA classes; calls ficoco's ops).

Every LLaVA-1.5 image has the same layout (one square, 576 patches at 336 px), so the accountant plans one count
for all of them, which the processor writes as the image's placeholders; `_process_image_input` runs vLLM's tower
and projector, then the method's step on every image's projected patches, and hands on the rows it kept. The
positions are one-dimensional: the shortened prompt's consecutive positions are the ones ficoco's transformers
adapter gives it (the image span shortened to the kept tokens), so vLLM's own positions hold.

Served here: DivPrune (it reads the projector's output alone). The methods that read the tower's [CLS] attention
(VisionZip, VisPruner) or act inside its layers (FiCoCo-V) are not wired into vLLM's CLIP tower by the plugin.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from vllm.model_executor.models.llava import (
    LlavaDummyInputsBuilder,
    LlavaForConditionalGeneration,
    LlavaMultiModalProcessor,
    LlavaProcessingInfo,
    _build_llava_or_pixtral_hf_info,
)
from vllm.multimodal import MULTIMODAL_REGISTRY

from ficoco.errors import FicocoError
from ficoco.methods.inputs import TowerInput
from ficoco.serving.vllm.common import Planner, ReducingProcessor, record_kept, served_method

SERVED = ("divprune",)  # the methods the plugin runs on LLaVA-1.5 (after the projector, reading its output alone)


class LlavaReducingProcessor(ReducingProcessor, LlavaMultiModalProcessor):
    """LLaVA-1.5's processor with each image's placeholders cut to the plan's count."""


def _processor(info: Any, dummy_inputs: Any) -> Any:
    if not isinstance(info, LlavaProcessingInfo):  # Pixtral's layout: vLLM's own processor, no reduction
        raise FicocoError("ficoco.vllm: the plugin reduces LLaVA-1.5's images, not Pixtral's")
    return LlavaReducingProcessor(info, dummy_inputs)


@MULTIMODAL_REGISTRY.register_processor(_processor, info=_build_llava_or_pixtral_hf_info,
                                        dummy_inputs=LlavaDummyInputsBuilder)
class ReducingLlava(LlavaForConditionalGeneration):
    """vLLM's LLaVA-1.5 with ficoco's method after the projector."""

    def __init__(self, *, vllm_config: Any, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self.ficoco = Planner(self.config)
        self.ficoco_reduces_images = False  # one-dimensional positions: vLLM's own hold for the shortened prompt
        spec = served_method(self.ficoco, SERVED, "LLaVA-1.5", self.config.model_type)
        if spec is not None:
            self.ficoco_spec = spec
            self.ficoco_module = spec.load()

    def _process_image_input(self, image_input: Any) -> Tensor | tuple[Tensor, ...]:
        embeds = super()._process_image_input(image_input)
        if self.ficoco.settings is None:
            return embeds
        if image_input.get("type") == "image_embeds":
            raise FicocoError("ficoco.vllm: image embeddings given directly cannot be reduced; give the images")
        items = torch.stack(list(embeds)) if not isinstance(embeds, Tensor) else embeds
        plan = self.ficoco.plan(None)
        removal = next((r for r in plan.removals if r.stage == "vision"), None)
        if removal is None:  # a budget every image fits whole
            return embeds
        out = self.ficoco_module.tower_step(TowerInput(hidden=items, has_cls=False, remove=removal.remove),
                                            plan.settings_dict())
        kept = torch.sort(out.kept, dim=1)
        hidden = torch.gather(out.hidden, 1, kept.indices.unsqueeze(-1).expand(-1, -1, out.hidden.shape[-1]))
        record_kept([None] * items.shape[0], list(kept.values))
        if hidden.shape[1] != plan.tokens:
            raise RuntimeError(f"ficoco.vllm: {self.ficoco_spec.title} kept {hidden.shape[1]} tokens of an image, "
                               f"the plan {plan.tokens}")
        return tuple(hidden)
