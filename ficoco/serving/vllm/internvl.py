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
mean key), the projector mapping the tokens they hand on; and FiCoCo-V inside InternViT's layers, as ficoco's
transformers adapter runs it (ficoco.models.internvl): a reducing layer's attention is read from its own queries
and keys, the first reducing layer puts every tile's patches in pixel-shuffle group order (a group's members
consecutive), `reduce_groups` removes whole groups after the attention residual and before the MLP, and the layers
after it run on the kept groups' patches (InternViT's layers hold no positions). The tower's output goes back on
the whole patch grid (removed groups zero) so that pixel shuffle runs as vLLM wrote it, and the projector maps the
kept groups only. Images whose plans differ (a TFLOPs budget resolved per tile count) run the tower apart, group by
group of the same schedule; a tile never attends to another. PixelPrune needs a tower without fixed absolute
positions: it is not served here.
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
from ficoco.methods.reads import DEFAULT_ATTENTION_SCORES
from ficoco.methods.reads.ops import ProbedAttention
from ficoco.serving.vllm.common import Planner, ReducingInfo, ReducingProcessor, record_kept, served_method

# After the projector, after pixel shuffle by [CLS] attention, or inside the tower's layers (FiCoCo-V).
SERVED = ("divprune", "visionzip", "vispruner", "v")


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
        self.ficoco_units = self.ficoco_grid_hw[0] * self.ficoco_grid_hw[1]  # pixel-shuffle groups of a tile
        # [CLS], then every patch in pixel-shuffle group order: how a cut reads a probed layer's keys.
        self.ficoco_key_order = torch.cat([torch.zeros(1, dtype=torch.long),
                                           pixel_shuffle_order(side, self.ficoco_factor) + 1])
        self.ficoco_probe_layer: int | None = None
        self.ficoco_probed: tuple[Tensor, Tensor, Any] | None = None
        self.ficoco_in_layers = spec.placement == "in_layer"
        self.ficoco_pass: dict[str, Any] | None = None  # a tower pass under FiCoCo-V: its removals and kept groups
        for index, layer in enumerate(self.vision_tower.encoder.layer):
            # Scored by a tower layer's [CLS] query and keys, or (FiCoCo-V) reduced by its attention; DivPrune reads
            # the projector's output alone, so its tower runs unprobed.
            if self.ficoco_in_layers or spec.placement == "tower_output":
                layer.attention.attn.register_forward_pre_hook(functools.partial(self._ficoco_probe, index))
            if self.ficoco_in_layers:
                layer.forward = functools.partial(self._ficoco_layer, index, layer, layer.forward)

    def _ficoco_probe(self, index: int, module: Any, args: tuple) -> None:
        if index == self.ficoco_probe_layer:
            query, key = args[0], args[1]
            self.ficoco_probed = (query, key, module)

    def _ficoco_layer(self, index: int, layer: Any, original: Any, hidden_states: Tensor) -> Tensor:
        """One InternViT layer; where the pass's schedule removes groups at it, FiCoCo-V's `reduce_groups` runs
        between the attention residual and the MLP on the layer's own attention (vLLM's layer, recomposed)."""
        tower = self.ficoco_pass
        remove = 0 if tower is None else tower["removed"].get(index, 0)
        if not remove:
            return original(hidden_states)
        self.ficoco_probe_layer = index
        try:
            attended = layer.attention(layer.layernorm_before(hidden_states))
        finally:
            self.ficoco_probe_layer = None
        assert self.ficoco_probed is not None
        query, key, module = self.ficoco_probed
        self.ficoco_probed = None
        hidden = hidden_states + attended * layer.lambda_1
        tiles, heads, size = hidden.shape[0], int(module.num_heads), int(module.head_size)
        query = query.reshape(tiles, -1, heads, size).transpose(1, 2)
        key = key.reshape(tiles, -1, heads, size).transpose(1, 2)
        groups = tower["groups"]
        if groups is None:  # the pass's first reducing layer: [CLS], then the patches in group order
            order = self.ficoco_key_order.to(hidden.device)
            hidden, query, key = hidden[:, order], query[:, :, order], key[:, :, order]
            groups = torch.arange(self.ficoco_units, device=hidden.device).expand(tiles, -1)
        if not 0 <= remove < groups.shape[1]:
            raise FicocoError(f"ficoco.vllm: vision layer {index} would remove {remove} of the {groups.shape[1]} "
                              "pixel-shuffle groups left in a tile; at least one must stay")
        settings = tower["settings"]
        reads = ProbedAttention(query, key, float(module.scale),
                                scores=settings.get("attention_scores", DEFAULT_ATTENTION_SCORES))
        red = self.ficoco_module.reduce_groups(
            hidden[:, 1:], reads, key, remove, groups, self.ficoco_grid_hw, merge=self.ficoco_factor ** 2,
            lam=settings["lam"], eps=settings["eps"], window=settings["window"],
            coefficient=settings["coefficient"], has_cls=True, equivalent=settings["equivalent_token"])
        tower["groups"] = red.kept_groups
        hidden = torch.cat([hidden[:, :1], red.hidden], dim=1)
        return hidden + layer.mlp(layer.layernorm_after(hidden)) * layer.lambda_2

    def _ficoco_reduced_tiles(self, pixel_values: Tensor, removal_layers: dict[int, int],
                              settings: dict[str, Any]) -> tuple[Tensor, Tensor | None]:
        """The projected tokens of tiles whose plan removes `removal_layers` ({layer: groups}) inside the tower
        ((tiles, kept groups, D), in the order the last reduction left them), and their kept groups (None where
        nothing was removed)."""
        self.ficoco_pass = {"removed": removal_layers, "groups": None, "settings": settings}
        try:
            out = self.vision_tower(pixel_values=pixel_values)
            groups = self.ficoco_pass["groups"]
        finally:
            self.ficoco_pass = None
        if groups is not None:  # back on the whole grid: [CLS], then every kept patch at its row-major place
            width = out.shape[-1]
            # Every group's patches' rows in the tower's output ([CLS] at 0: the key order already counts it).
            members = self.ficoco_key_order[1:].to(out.device).view(self.ficoco_units, -1)
            places = members[groups].flatten(1)
            full = out.new_zeros(out.shape[0], 1 + members.numel(), width)
            full[:, 0] = out[:, 0]
            out = full.scatter(1, places.unsqueeze(-1).expand(-1, -1, width), out[:, 1:])
        side = int((out.shape[1] - 1) ** 0.5)
        shuffled = self.pixel_shuffle(out[:, 1:].reshape(out.shape[0], side, side, -1),
                                      scale_factor=self.downsample_ratio)
        shuffled = shuffled.reshape(shuffled.shape[0], -1, shuffled.shape[-1])
        if groups is not None:  # the kept groups' shuffled tokens, in the order the reduction left them
            shuffled = torch.gather(shuffled, 1, groups.unsqueeze(-1).expand(-1, -1, shuffled.shape[-1]))
        return self.multi_modal_projector(shuffled), groups

    def _ficoco_in_layers(self, image_input: Any, tiles: list[int], plans: list[Any]) -> tuple[Tensor, ...]:
        """FiCoCo-V on every image: the tower run once per schedule among the batch's plans (on the tiles of the
        images with that schedule), every tile keeping its plan's count."""
        schedules = [tuple(sorted((r.layer, r.remove) for r in plan.removals if r.stage == "vision" and r.remove))
                     if plan is not None else () for plan in plans]
        pixels = torch.split(image_input["pixel_values"], tiles)
        out: list[Tensor | None] = [None] * len(tiles)
        kept: list[Any] = [None] * len(tiles)
        for schedule in dict.fromkeys(schedules):
            images = [i for i, s in enumerate(schedules) if s == schedule]
            settings = next((plans[i].settings_dict() for i in images if plans[i] is not None), {})
            rows, groups = self._ficoco_reduced_tiles(torch.cat([pixels[i] for i in images]), dict(schedule),
                                                      settings)
            for image, image_rows, image_groups in zip(
                    images, torch.split(rows, [tiles[i] for i in images]),
                    [None] * len(images) if groups is None else torch.split(groups, [tiles[i] for i in images]),
                    strict=True):
                out[image] = image_rows.reshape(-1, image_rows.shape[-1])
                plan = plans[image]
                if plan is not None and out[image].shape[0] != plan.tokens:
                    raise RuntimeError(f"ficoco.vllm: FiCoCo-V kept {out[image].shape[0]} tokens of an image of "
                                       f"{tiles[image]} tiles, its placeholders {plan.tokens}")
                # Recorded: every tile's kept groups, ascending.
                kept[image] = ([torch.arange(self.ficoco_units)] * tiles[image] if image_groups is None else
                               [torch.sort(tile).values for tile in image_groups])
        record_kept([None] * len(tiles), kept)
        return tuple(out)  # type: ignore[arg-type]

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
        if self.ficoco_in_layers:
            return self._ficoco_in_layers(image_input, tiles, plans)
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
