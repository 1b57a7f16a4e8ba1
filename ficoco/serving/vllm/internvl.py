"""InternVL3 (Hugging Face's format) in vLLM with a method after the projector (knows vLLM's InternVL classes;
calls ficoco's ops).

vLLM serves `InternVLForConditionalGeneration` checkpoints with its InternS1 classes: the processor cuts an image
into tower tiles (and a thumbnail when there is more than one) and writes `<img>`, every tile's placeholders,
`</img>`; the model runs InternViT on every tile, pixel shuffle and the projector, one row per placeholder. As
ficoco's transformers adapter does (ficoco.models.internvl), every tile keeps the same count, planned by the
accountant for an image of that many tiles (`Planner.plan_tiles`): the processor writes the tiles' kept
placeholders, and `_process_vision_input` runs the method's step on every tile's projected tokens, handing on
the rows it kept in the method's order. The positions are one-dimensional, so vLLM's own hold for the shortened
prompt.

Served here: DivPrune (it reads the projector's output alone). The methods that read InternViT's [CLS] attention
(VisionZip, VisPruner) or act inside its layers (FiCoCo-V) are not wired into vLLM's InternViT by the plugin.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor
from vllm.model_executor.models.interns1 import (
    InternS1DummyInputsBuilder,
    InternS1ForConditionalGeneration,
    InternS1MultiModalProcessor,
    InternS1ProcessingInfo,
)
from vllm.multimodal import MULTIMODAL_REGISTRY
from vllm.multimodal.processing import PromptReplacement, PromptUpdateDetails

from ficoco.errors import FicocoError
from ficoco.methods.inputs import TowerInput
from ficoco.methods.registry import method
from ficoco.serving.vllm.common import Planner, ReducingInfo, record_kept

SERVED = ("divprune",)  # the methods the plugin runs on InternVL3 (after the projector, reading its output alone)


class InternVLReducingInfo(ReducingInfo, InternS1ProcessingInfo):
    """InternVL's processing info; a reducing engine refuses videos per request."""


class InternVLReducingProcessor(InternS1MultiModalProcessor):
    """InternVL's processor with each image's placeholders cut to its tiles' kept tokens, `<img>` and `</img>`
    kept around them."""

    def _ficoco_planner(self) -> Planner:
        planner = self.__dict__.get("_ficoco")
        if planner is None:
            planner = self.__dict__["_ficoco"] = Planner(self.info.get_hf_config())
        return planner

    def _get_prompt_updates(self, mm_items: Any, hf_processor_mm_kwargs: Mapping[str, Any],
                            out_mm_kwargs: Any) -> Sequence[Any]:
        updates = super()._get_prompt_updates(mm_items, hf_processor_mm_kwargs, out_mm_kwargs)
        planner = self._ficoco_planner()
        if planner.settings is None:
            return updates
        context = self.info.get_hf_processor(**hf_processor_mm_kwargs).image_token_id
        out = []
        for update in updates:
            if update.modality != "image":
                out.append(update)
                continue

            def replacement(item_idx: int, _original: Any = update.replacement) -> Any:
                details = _original(item_idx)
                full = details.full if isinstance(details, PromptUpdateDetails) else list(details)
                spots = [i for i, token in enumerate(full) if token == context]
                if not spots:
                    raise FicocoError("ficoco.vllm: this InternVL image has no <IMG_CONTEXT> placeholders to reduce")
                tiles = int(out_mm_kwargs["image"][item_idx]["image_num_patches"].data)
                tokens = planner.plan_tiles(tiles).tokens
                return PromptUpdateDetails.select_token_id(full[:spots[0]] + [context] * tokens + full[spots[-1] + 1:],
                                                           context)

            out.append(PromptReplacement(modality="image", target=update.target, replacement=replacement))
        return out


@MULTIMODAL_REGISTRY.register_processor(InternVLReducingProcessor, info=InternVLReducingInfo,
                                        dummy_inputs=InternS1DummyInputsBuilder)
class ReducingInternVL(InternS1ForConditionalGeneration):
    """vLLM's InternVL (its InternS1 classes) with ficoco's method after the projector."""

    def __init__(self, *, vllm_config: Any, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self.ficoco = Planner(self.config)
        self.ficoco_reduces_images = False  # one-dimensional positions: vLLM's own hold for the shortened prompt
        if self.ficoco.settings is not None:
            spec = method(self.ficoco.settings.method)
            if spec.name not in SERVED:
                raise FicocoError(f"ficoco.vllm: {spec.title} is not served on InternVL3 (it reads InternViT's [CLS] "
                                  f"attention or acts inside its layers); served there: {', '.join(SERVED)}")
            self.ficoco_spec = spec
            self.ficoco_module = spec.load()
            vision = self.config.vision_config
            size = vision.image_size
            side = int(size[0] if isinstance(size, (list, tuple)) else size) // self.ficoco.patch
            self.ficoco_factor = round(1 / self.config.downsample_ratio)
            self.ficoco_grid_hw = (side // self.ficoco_factor, side // self.ficoco_factor)

    def _process_vision_input(self, image_input: Any) -> tuple[Tensor, ...]:
        if self.ficoco.settings is None or image_input["type"] == "pixel_values_videos":
            return super()._process_vision_input(image_input)  # videos reach here only in vLLM's start-up profiling
        if image_input["type"] != "pixel_values":
            raise FicocoError("ficoco.vllm: image embeddings given directly cannot be reduced; give the images")
        features = self.extract_feature(image_input["pixel_values"])  # (tiles, units, D): every tile's tokens
        tiles = [int(n) for n in image_input["num_patches"].tolist()]
        factor = self.ficoco_factor
        out, kept = [], []
        # Every tile of an image keeps the count its plan gives (a TFLOPs budget counts the image's tiles).
        for image, count in zip(torch.split(features, tiles), tiles, strict=True):
            plan = self.ficoco.plan_tiles(count)
            removal = next(r for r in plan.removals if r.stage == "vision")
            step = self.ficoco_module.tower_step(
                TowerInput(hidden=image, has_cls=True, remove=removal.remove, added=removal.added,
                           grid_hw=self.ficoco_grid_hw, merge=factor * factor), plan.settings_dict())
            rows = step.hidden.reshape(-1, step.hidden.shape[-1])
            if rows.shape[0] != plan.tokens:
                raise RuntimeError(f"ficoco.vllm: {self.ficoco_spec.title} kept {rows.shape[0]} tokens of an image "
                                   f"of {count} tiles, its placeholders {plan.tokens}")
            out.append(rows)
            kept.append(step.kept[:, :step.hidden.shape[1]].sort(dim=1).values)  # recorded as grid indices, ascending
        record_kept([None] * len(tiles), kept)
        return tuple(out)
