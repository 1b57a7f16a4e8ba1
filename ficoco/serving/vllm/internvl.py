"""InternVL3 (Hugging Face's format) in vLLM with a method after pixel shuffle or after the projector (knows vLLM's
InternVL classes; calls ficoco's ops).

vLLM serves `InternVLForConditionalGeneration` checkpoints with its InternS1 classes: the processor cuts an image
into tower tiles (and a thumbnail when there is more than one) and writes `<img>`, every tile's placeholders,
`</img>`; the model runs InternViT on every tile, pixel shuffle and the projector, one row per placeholder. As
ficoco's transformers adapter does (ficoco.models.internvl), every tile keeps the same count, planned by the
accountant for an image of that many tiles (`Planner.plan_tiles`): the processor writes the tiles' kept
placeholders, and `_process_vision_input` runs the method's step on every tile's tokens, handing on the rows it
kept in the method's order. The positions are one-dimensional, so vLLM's own hold for the shortened prompt.

Served here: DivPrune on the projector's output; VisionZip and VisPruner on the pixel-shuffle groups the projector
reads, scored by the probed tower layer's [CLS] query and keys (a group's score its patches' mean, its key their
mean key), the projector mapping the tokens they hand on. FiCoCo-V acts inside InternViT's layers and PixelPrune
needs a tower without fixed absolute positions: neither is served here.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
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
from vllm.multimodal.processing import PromptUpdateDetails

from ficoco.errors import FicocoError
from ficoco.methods.inputs import TowerInput
from ficoco.methods.ops import pixel_shuffle_order
from ficoco.serving.vllm.common import Planner, ReducingInfo, ReducingProcessor, record_kept, served_method

SERVED = ("divprune", "visionzip", "vispruner")  # after the projector, or after pixel shuffle by [CLS] attention


class InternVLReducingInfo(ReducingInfo, InternS1ProcessingInfo):
    """InternVL's processing info; a reducing engine refuses videos per request."""


class InternVLReducingProcessor(ReducingProcessor, InternS1MultiModalProcessor):
    """InternVL's processor with each image's placeholders cut to its tiles' kept tokens, `<img>` and `</img>`
    kept around them."""

    def _ficoco_placeholders(self, planner: Planner, item: Any, modality: str = "image") -> int:
        return planner.plan_tiles(int(item["image_num_patches"].data)).tokens

    def _ficoco_shorten(self, tokens: Any, count: int, hf_processor_mm_kwargs: Mapping[str, Any]) -> Any:
        context = self.info.get_hf_processor(**hf_processor_mm_kwargs).image_token_id
        full = tokens.full if isinstance(tokens, PromptUpdateDetails) else list(tokens)
        spots = [i for i, token in enumerate(full) if token == context]
        if not spots:
            raise FicocoError("ficoco.vllm: this InternVL image has no <IMG_CONTEXT> placeholders to reduce")
        return PromptUpdateDetails.select_token_id(full[:spots[0]] + [context] * count + full[spots[-1] + 1:], context)


@MULTIMODAL_REGISTRY.register_processor(InternVLReducingProcessor, info=InternVLReducingInfo,
                                        dummy_inputs=InternS1DummyInputsBuilder)
class ReducingInternVL(InternS1ForConditionalGeneration):
    """vLLM's InternVL (its InternS1 classes) with ficoco's method after pixel shuffle or after the projector."""

    def __init__(self, *, vllm_config: Any, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self.ficoco = Planner(self.config)
        self.ficoco_reduces_images = False  # one-dimensional positions: vLLM's own hold for the shortened prompt
        spec = served_method(self.ficoco, SERVED, "InternVL3", self.config.model_type)
        if spec is None:
            return
        self.ficoco_spec = spec
        self.ficoco_module = spec.load()
        vision = self.config.vision_config
        size = vision.image_size
        side = int(size[0] if isinstance(size, (list, tuple)) else size) // self.ficoco.patch
        self.ficoco_factor = round(1 / self.config.downsample_ratio)
        self.ficoco_grid_hw = (side // self.ficoco_factor, side // self.ficoco_factor)
        # [CLS], then every patch in pixel-shuffle group order: how a cut reads a probed layer's keys.
        self.ficoco_key_order = torch.cat([torch.zeros(1, dtype=torch.long),
                                           pixel_shuffle_order(side, self.ficoco_factor) + 1])
        self.ficoco_probe_layer: int | None = None
        self.ficoco_probed: tuple[Tensor, Tensor, Any] | None = None
        if spec.placement == "tower_output":  # scored by a tower layer's [CLS] query and keys
            for index, layer in enumerate(self.vision_tower.encoder.layer):
                layer.attention.attn.register_forward_pre_hook(functools.partial(self._ficoco_probe, index))

    def _ficoco_probe(self, index: int, module: Any, args: tuple) -> None:
        if index == self.ficoco_probe_layer:
            query, key = args[0], args[1]
            self.ficoco_probed = (query, key, module)

    def _ficoco_layer_reads(self, start: int, count: int) -> dict[str, Any]:
        """The probed layer's keys (tiles, H, 1 + patches, d) in group order, [CLS]'s query and the scale, for the
        `count` tiles from `start`."""
        assert self.ficoco_probed is not None
        query, key, module = self.ficoco_probed
        heads, size = int(module.num_heads), int(module.head_size)
        tiles = slice(start, start + count)
        keys = key[tiles].reshape(count, -1, heads, size).transpose(1, 2)
        keys = keys[:, :, self.ficoco_key_order.to(keys.device)]
        cls_query = query[tiles, 0].reshape(count, heads, size)
        return {"keys": keys, "cls_query": cls_query, "scale": float(module.scale)}

    def _ficoco_shuffled(self, pixel_values: Tensor) -> Tensor:
        """(tiles, units, 4C) every tile's pixel-shuffle groups, what the projector reads (vLLM's extract_feature
        without the projector)."""
        vit_embeds = self.vision_tower(pixel_values=pixel_values)[:, 1:, :]
        h = w = int(vit_embeds.shape[1] ** 0.5)
        vit_embeds = self.pixel_shuffle(vit_embeds.reshape(vit_embeds.shape[0], h, w, -1),
                                        scale_factor=self.downsample_ratio)
        return vit_embeds.reshape(vit_embeds.shape[0], -1, vit_embeds.shape[-1])

    def _process_vision_input(self, image_input: Any) -> tuple[Tensor, ...]:
        if self.ficoco.settings is None or image_input["type"] == "pixel_values_videos":
            return super()._process_vision_input(image_input)  # videos reach here only in vLLM's start-up profiling
        if image_input["type"] != "pixel_values":
            raise FicocoError("ficoco.vllm: image embeddings given directly cannot be reduced; give the images")
        tiles = [int(n) for n in image_input["num_patches"].tolist()]
        plans = [self.ficoco.plan_if_fits(tiles=count) for count in tiles]
        removals = [None if plan is None else next((r for r in plan.removals if r.stage == "vision"), None)
                    for plan in plans]
        at_tower = self.ficoco_spec.placement == "tower_output"
        if at_tower:  # the layer every image's cut reads ([CLS] attention), probed while the tower runs
            layers = {r.layer for r in removals if r is not None}
            if len(layers) > 1:
                raise RuntimeError(f"ficoco.vllm: the plans of one batch read tower layers {sorted(layers)}")
            self.ficoco_probe_layer = next(iter(layers), None)
            try:
                features = self._ficoco_shuffled(image_input["pixel_values"])
            finally:
                self.ficoco_probe_layer = None
        else:
            features = self.extract_feature(image_input["pixel_values"])  # (tiles, units, D): every tile's tokens
        factor = self.ficoco_factor
        out, kept = [], []
        start = 0
        # Every tile of an image keeps the count its plan gives (a TFLOPs budget counts the image's tiles).
        for image, count, plan, removal in zip(torch.split(features, tiles), tiles, plans, removals, strict=True):
            if removal is None:  # a budget that leaves an image of this many tiles whole (or no plan fits it)
                rows = self.multi_modal_projector(image) if at_tower else image
                out.append(rows.reshape(-1, rows.shape[-1]))
                kept.append([torch.arange(image.shape[1])] * count)
                start += count
                continue
            reads = self._ficoco_layer_reads(start, count) if at_tower else {}
            step = self.ficoco_module.tower_step(
                TowerInput(hidden=image, has_cls=True, remove=removal.remove, added=removal.added,
                           grid_hw=self.ficoco_grid_hw, merge=factor * factor, **reads), plan.settings_dict())
            hidden = self.multi_modal_projector(step.hidden) if at_tower else step.hidden
            rows = hidden.reshape(-1, hidden.shape[-1])
            if rows.shape[0] != plan.tokens:
                raise RuntimeError(f"ficoco.vllm: {self.ficoco_spec.title} kept {rows.shape[0]} tokens of an image "
                                   f"of {count} tiles, its placeholders {plan.tokens}")
            out.append(rows)
            # Recorded: every tile's kept groups, ascending; a merged (contextual) token stands at none.
            kept.append([torch.unique(tile[tile >= 0]) for tile in step.kept[:, :step.hidden.shape[1]]])
            start += count
        self.ficoco_probed = None
        record_kept([None] * len(tiles), kept)
        return tuple(out)
