"""LLaVA-1.5 and LLaVA-OneVision in vLLM with a method in the tower or after the projector (knows vLLM's LLaVA
classes; calls ficoco's ops).

Every LLaVA-1.5 image has the same layout (one square, 576 patches at 336 px), so the accountant plans one count
for all of them, which the processor writes as the image's placeholders; `_process_image_input` runs vLLM's tower
and projector, then the method's step on every image's projected patches, and hands on the rows it kept. The
positions are one-dimensional: the shortened prompt's consecutive positions are the ones ficoco's transformers
adapter gives it (the image span shortened to the kept tokens), so vLLM's own positions hold.

LLaVA-OneVision's AnyRes image is a base view and a grid of crops, every one a tower item; vLLM packs the crops'
patches on one grid, unpads it to the image's aspect ratio, downscales it past anyres_max_N and ends every row with
a newline token. The accountant plans an image by its size (`Planner.plan_sized`): every item keeps the same count,
one newline per row of the crop grid, which the processor writes as its placeholders; `_process_image_input` runs
the method's step on every item and packs what each kept as ficoco's transformers adapter does
(`ficoco.methods.anyres.ops`: the base view's tokens in the method's order, every crop's token at its grid place). An
image whose unpadding drops crop tokens, or whose grid is downscaled, cannot be planned before the encoder runs (the
count would depend on which tokens stay, or the downscale needs the whole grid): the request is refused in one line.

Served here, on both: DivPrune (it reads the projector's output alone), and FiCoCo-V inside the tower's layers
(CLIP's on LLaVA-1.5, with [CLS]; SigLIP's on OneVision, scored with FiCoCo's equivalent token), as ficoco's
transformers adapter runs it (ficoco.models.vision_steps; `_TowerLayers`). On LLaVA-1.5 vLLM then drops [CLS] and
the projector maps the rest in the method's order; on OneVision every item's handed-on patches are packed at their
grid places. The methods that read the tower's [CLS] attention at its output (VisionZip, VisPruner) are not wired
into either tower.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
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
from vllm.model_executor.models.llava_onevision import (
    LlavaOnevisionDummyInputsBuilder,
    LlavaOnevisionForConditionalGeneration,
    LlavaOnevisionMultiModalProcessor,
    LlavaOnevisionProcessingInfo,
    get_anyres_image_grid_shape,
)
from vllm.multimodal import MULTIMODAL_REGISTRY

from ficoco.accounting.families.llava_onevision import anyres_max_patches
from ficoco.errors import FicocoError
from ficoco.methods.anyres.ops import anyres_layout
from ficoco.methods.inputs import TowerInput
from ficoco.methods.reads import DEFAULT_ATTENTION_SCORES
from ficoco.methods.reads.ops import ProbedAttention
from ficoco.serving.vllm.common import Planner, ReducingInfo, ReducingProcessor, record_kept, served_method

# The methods the plugin runs on LLaVA-1.5: after the projector, reading its output alone; inside CLIP's layers; at
# the tower's output, by the [CLS] attention of the layer the projector reads.
SERVED = ("divprune", "v", "visionzip", "vispruner")
ONEVISION_SERVED = ("divprune", "v")  # and on LLaVA-OneVision, every AnyRes item alike


class LlavaReducingProcessor(ReducingProcessor, LlavaMultiModalProcessor):
    """LLaVA-1.5's processor with each image's placeholders cut to the plan's count."""


def _processor(info: Any, dummy_inputs: Any) -> Any:
    if not isinstance(info, LlavaProcessingInfo):  # Pixtral's layout: vLLM's own processor, no reduction
        raise FicocoError("ficoco.vllm: the plugin reduces LLaVA-1.5's images, not Pixtral's")
    return LlavaReducingProcessor(info, dummy_inputs)


@MULTIMODAL_REGISTRY.register_processor(_processor, info=_build_llava_or_pixtral_hf_info,
                                        dummy_inputs=LlavaDummyInputsBuilder)
class _TowerLayers:
    """FiCoCo-V inside vLLM's CLIP or SigLIP tower (what ReducingLlava and ReducingLlavaOnevision share): at every
    layer the pass's schedule names, the layer is recomposed as ficoco's transformers adapter runs it
    (ficoco.models.vision_steps): its attention read from its own queries and keys, the method's tower step between
    the attention residual and the MLP, the later layers on what it handed on (the towers' learned positions were
    added at the embedding, so their layers need none)."""

    ficoco_pass: dict[str, Any] | None = None  # a tower pass under the method: its removals, what it carries
    ficoco_probe_layer: int | None = None
    ficoco_probed: tuple[Tensor, Tensor, Any] | None = None

    def _ficoco_install_layers(self, tower: Any, has_cls: bool, tuple_out: bool, recompose: bool = True) -> None:
        """Probe every layer of `tower` and, with `recompose`, wrap it (its [CLS] first where `has_cls`; SigLIP's
        layers return a tuple); a cut at the tower's output only probes."""
        vision = self.config.vision_config  # type: ignore[attr-defined]
        side = int(vision.image_size) // int(vision.patch_size)
        self.ficoco_grid_hw = (side, side)
        self.ficoco_has_cls, self.ficoco_tuple_out = has_cls, tuple_out
        for index, layer in enumerate(tower.vision_model.encoder.layers):
            layer.self_attn.attn.register_forward_pre_hook(functools.partial(self._ficoco_probe, index))
            if recompose:
                layer.forward = functools.partial(self._ficoco_layer, index, layer, layer.forward)

    def _ficoco_probe(self, index: int, module: Any, args: tuple) -> None:
        if index == self.ficoco_probe_layer:
            self.ficoco_probed = (args[0], args[1], module)

    def _ficoco_layer(self, index: int, layer: Any, original: Any, hidden_states: Tensor) -> Any:
        """One tower layer; where the pass's schedule removes patches at it, the method's tower step runs between the
        attention residual and the MLP on the layer's own attention (vLLM's layer, recomposed)."""
        tower = self.ficoco_pass
        removal = None if tower is None else tower["removals"].get(index)
        if removal is None:
            return original(hidden_states)
        self.ficoco_probe_layer = index
        try:
            attended, _ = layer.self_attn(hidden_states=layer.layer_norm1(hidden_states))
        finally:
            self.ficoco_probe_layer = None
        assert self.ficoco_probed is not None and tower is not None
        query, key, module = self.ficoco_probed
        self.ficoco_probed = None
        hidden = hidden_states + attended
        items, heads, size, scale = hidden.shape[0], int(module.num_heads), int(module.head_size), float(module.scale)
        query = query.reshape(items, -1, heads, size).transpose(1, 2)
        key = key.reshape(items, -1, heads, size).transpose(1, 2)
        settings = tower["settings"]
        reads = ProbedAttention(query, key, scale, scores=settings.get("attention_scores", DEFAULT_ATTENTION_SCORES))
        has_cls = self.ficoco_has_cls
        out = self.ficoco_module.tower_step(  # type: ignore[attr-defined]
            TowerInput(hidden=hidden, has_cls=has_cls, remove=removal.remove, added=removal.added, keys=key,
                       cls_query=query[:, :, 0] if has_cls else None, scale=scale, size=tower["size"],
                       positions=tower["positions"], attention=reads, grid_hw=self.ficoco_grid_hw,
                       placement="in_layer"), settings)
        if out.attention_bias is not None:  # vLLM's tower attention takes no mask
            raise RuntimeError("ficoco.vllm: the method asks the tower's later layers for an attention bias")
        tower.update(size=out.size, positions=out.positions)
        hidden = out.hidden
        hidden = hidden + layer.mlp(layer.layer_norm2(hidden))
        return (hidden, None) if self.ficoco_tuple_out else hidden

    def _ficoco_tower_pass(self, removals: Sequence[Any], settings: dict[str, Any], run: Any) -> tuple[Any, Any]:
        """`run()` (a tower call) under the in-layer `removals`; its result and every item's positions after the
        last reduction ([CLS] at 0 where the tower has one; None where nothing was removed)."""
        self.ficoco_pass = {"removals": {r.layer: r for r in removals if r.stage == "vision" and
                                         r.where == "in_layer"},
                            "size": None, "positions": None, "settings": settings}
        try:
            result = run()
            positions = self.ficoco_pass["positions"]
        finally:
            self.ficoco_pass = None
        return result, positions


class ReducingLlava(_TowerLayers, LlavaForConditionalGeneration):
    """vLLM's LLaVA-1.5 with ficoco's method after the projector (DivPrune), inside CLIP's layers (FiCoCo-V) or at
    the tower's output (VisionZip, VisPruner)."""

    def __init__(self, *, vllm_config: Any, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self.ficoco = Planner(self.config)
        self.ficoco_reduces_images = False  # one-dimensional positions: vLLM's own hold for the shortened prompt
        spec = served_method(self.ficoco, SERVED, "LLaVA-1.5", self.config.model_type)
        self.ficoco_in_layers = self.ficoco_at_output = False
        if spec is None:
            return
        self.ficoco_spec = spec
        self.ficoco_module = spec.load()
        self.ficoco_in_layers = spec.placement == "in_layer"
        self.ficoco_at_output = spec.placement == "tower_output"
        if self.ficoco_in_layers or self.ficoco_at_output:
            # FiCoCo-V: CLIP's layers recomposed where the schedule reduces; a cut at the output: the layer it reads
            # probed.
            self._ficoco_install_layers(self.vision_tower, has_cls=True, tuple_out=False,
                                        recompose=self.ficoco_in_layers)

    def _ficoco_cut_at_output(self, image_input: Any) -> tuple[Tensor, ...]:
        """VisionZip or VisPruner on every image's patches at the tower's output, as ficoco's transformers adapter
        cuts them (ficoco.models.vision_steps, `TowerPatch._cut`): scored by the [CLS] query and keys of the layer
        the projector reads (the last one vLLM's tower runs), VisionZip's official layout handing on that layer's
        [CLS] first among its dominant tokens; the projector maps what the cut hands on, in its order."""
        plan = self.ficoco.plan(None)
        removal = next((r for r in plan.removals if r.stage == "vision"), None)
        if removal is None:  # a budget every image fits whole
            return LlavaForConditionalGeneration._process_image_input(self, image_input)
        self.ficoco_probe_layer = removal.layer
        try:
            full = self.vision_tower(image_input["pixel_values"], feature_select_strategy="full")
        finally:
            self.ficoco_probe_layer = None
        if self.ficoco_probed is None:
            raise RuntimeError(f"ficoco.vllm: {self.ficoco_spec.title} reads tower layer {removal.layer}, which "
                               "vLLM's tower did not run")
        query, key, module = self.ficoco_probed
        self.ficoco_probed = None
        full = full if isinstance(full, Tensor) else torch.stack(list(full))
        items, heads, size = full.shape[0], int(module.num_heads), int(module.head_size)
        query = query.reshape(items, -1, heads, size).transpose(1, 2)
        key = key.reshape(items, -1, heads, size).transpose(1, 2)
        step = self.ficoco_module.tower_step(
            TowerInput(hidden=full[:, 1:], has_cls=True, remove=removal.remove, added=removal.added, keys=key,
                       cls_query=query[:, :, 0], scale=float(module.scale), cls_hidden=full[:, :1],
                       grid_hw=self.ficoco_grid_hw, placement=removal.where), plan.settings_dict())
        hidden = self.multi_modal_projector(step.hidden)
        if hidden.shape[1] != plan.tokens:
            raise RuntimeError(f"ficoco.vllm: {self.ficoco_spec.title} handed on {hidden.shape[1]} tokens of an "
                               f"image, the plan {plan.tokens}")
        # Recorded: every image's kept patches, ascending ([CLS] and merged contextual tokens stand at none).
        record_kept([None] * items, [torch.unique(row[row >= 0]) for row in step.kept[:, :step.hidden.shape[1]]])
        return tuple(hidden)

    def _ficoco_reduced_in_layers(self, image_input: Any) -> tuple[Tensor, ...]:
        """FiCoCo-V on every image: the tower runs the plan's schedule (every LLaVA-1.5 image has the same), vLLM
        drops [CLS] and the projector maps the patches handed on, in the method's order."""
        plan = self.ficoco.plan(None)
        embeds, positions = self._ficoco_tower_pass(
            plan.removals, plan.settings_dict(), lambda: LlavaForConditionalGeneration._process_image_input(
                self, image_input))
        items = embeds if isinstance(embeds, Tensor) else torch.stack(list(embeds))
        if items.shape[1] != plan.tokens:
            raise RuntimeError(f"ficoco.vllm: {self.ficoco_spec.title} handed on {items.shape[1]} tokens of an "
                               f"image, the plan {plan.tokens}")
        patches = self.ficoco_grid_hw[0] * self.ficoco_grid_hw[1]
        # Recorded: every image's kept patches ([CLS] at position 0 aside), ascending.
        kept = (torch.arange(patches).expand(items.shape[0], -1) if positions is None else positions[:, 1:] - 1)
        record_kept([None] * items.shape[0], [torch.sort(row).values for row in kept])
        return tuple(items)

    def _process_image_input(self, image_input: Any) -> Tensor | tuple[Tensor, ...]:
        if self.ficoco.settings is not None and image_input.get("type") == "image_embeds":
            raise FicocoError("ficoco.vllm: image embeddings given directly cannot be reduced; give the images")
        if self.ficoco_in_layers:
            return self._ficoco_reduced_in_layers(image_input)
        if self.ficoco_at_output:
            return self._ficoco_cut_at_output(image_input)
        embeds = super()._process_image_input(image_input)
        if self.ficoco.settings is None:
            return embeds
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


class OnevisionReducingInfo(ReducingInfo, LlavaOnevisionProcessingInfo):
    """LLaVA-OneVision's processing info; a reducing engine refuses videos per request."""


class OnevisionReducingProcessor(ReducingProcessor, LlavaOnevisionMultiModalProcessor):
    """LLaVA-OneVision's processor with each image's placeholders cut to the plan for its size."""

    def _ficoco_placeholders(self, planner: Planner, item: Any, modality: str = "image") -> int:
        return planner.plan_sized(item["image_sizes"].data.tolist()).tokens


@MULTIMODAL_REGISTRY.register_processor(OnevisionReducingProcessor, info=OnevisionReducingInfo,
                                        dummy_inputs=LlavaOnevisionDummyInputsBuilder)
class ReducingLlavaOnevision(_TowerLayers, LlavaOnevisionForConditionalGeneration):
    """vLLM's LLaVA-OneVision with ficoco's method after the projector (DivPrune) or inside SigLIP's layers
    (FiCoCo-V), on every AnyRes item of an image."""

    def __init__(self, *, vllm_config: Any, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self.ficoco = Planner(self.config)
        self.ficoco_reduces_images = False  # one-dimensional positions: vLLM's own hold for the shortened prompt
        spec = served_method(self.ficoco, ONEVISION_SERVED, "LLaVA-OneVision", self.config.model_type)
        self.ficoco_in_layers = False
        if spec is not None:
            self.ficoco_spec = spec
            self.ficoco_module = spec.load()
            self.ficoco_in_layers = spec.placement == "in_layer"
            if self.ficoco_in_layers:  # FiCoCo-V: SigLIP's layers recomposed (no [CLS]: the equivalent token)
                self._ficoco_install_layers(self.vision_tower, has_cls=False, tuple_out=True)
        vision = self.config.vision_config
        self.ficoco_side = int(vision.image_size) // int(vision.patch_size)
        self.ficoco_budget = anyres_max_patches(getattr(self.config, "vision_aspect_ratio", "anyres_max_9"))

    def _ficoco_layout(self, size: list[int], items: int) -> tuple[Any, int]:
        """The AnyRes layout of an image of `size` (H, W) and how many of its `items` it holds (vLLM may pad an
        image's items for batching): the crop grid is vLLM's own choice for the image's size."""
        if items == 1:
            return anyres_layout(self.ficoco_side, None, size, self.ficoco_budget), 1
        crops_h, crops_w = get_anyres_image_grid_shape(tuple(size), self.config.image_grid_pinpoints,
                                                       self.config.vision_config.image_size)
        crops = (int(crops_h), int(crops_w))
        return anyres_layout(self.ficoco_side, crops, size, self.ficoco_budget), 1 + crops[0] * crops[1]

    def _ficoco_packed(self, size: list[int], hidden: Tensor, kept: Tensor, plan: Any) -> tuple[Tensor, list[Tensor]]:
        """One image's tokens packed from every item's reduced `hidden` (items, k, D) and their grid places `kept`
        (items, k; -1 without one), and every item's kept patches (ascending)."""
        layout, count = self._ficoco_layout(size, hidden.shape[0])
        hidden, kept = hidden[:count], kept[:count]
        packed = layout.pack(hidden, kept, self.image_newline)
        if packed.shape[0] != plan.tokens:
            raise RuntimeError(f"ficoco.vllm: {self.ficoco_spec.title} packed {packed.shape[0]} tokens of a "
                               f"{size[1]}x{size[0]} image, its placeholders {plan.tokens}")
        return packed, [torch.unique(item[item >= 0]) for item in kept]

    def _ficoco_pack(self, size: list[int], items: Tensor, plan: Any, removal: Any) -> tuple[Tensor, list[Tensor]]:
        """One image's packed tokens after the method's step on every item's projected tokens (base view and
        crops), and every item's kept patches."""
        _, count = self._ficoco_layout(size, items.shape[0])
        side = self.ficoco_side
        step = self.ficoco_module.tower_step(
            TowerInput(hidden=items[:count], has_cls=False, remove=removal.remove, added=removal.added,
                       grid_hw=(side, side), placement=removal.where), plan.settings_dict())
        return self._ficoco_packed(size, step.hidden, step.kept[:, :step.hidden.shape[1]], plan)

    def _ficoco_in_layers_images(self, image_input: Any, sizes: Tensor) -> list[Tensor]:
        """FiCoCo-V on every image's items inside SigLIP's layers: the tower run once per schedule among the batch's
        plans (a TFLOPs budget resolves per image size), on those images' items; every image packed from what its
        items handed on."""
        pixels = list(image_input["pixel_values"])  # per image: (items, C, H, W)
        plans = [self.ficoco.plan_if_fits(image_size=[int(v) for v in row.tolist()]) for row in sizes]
        schedules = [() if plan is None else tuple(sorted((r.layer, r.remove, r.added) for r in plan.removals
                                                          if r.stage == "vision" and r.remove))
                     for plan in plans]
        out: list[Any] = [None] * len(pixels)
        kept: list[Any] = [None] * len(pixels)
        for schedule in dict.fromkeys(schedules):
            images = [i for i, chosen in enumerate(schedules) if chosen == schedule]
            plan = plans[images[0]]
            stacked = torch.cat([pixels[i] for i in images])
            features, positions = self._ficoco_tower_pass(
                () if plan is None else plan.removals, {} if plan is None else plan.settings_dict(),
                lambda stacked=stacked: self._image_pixels_to_features(self.vision_tower, stacked))
            embeds = self.multi_modal_projector(features)
            counts = [pixels[i].shape[0] for i in images]
            places = [None] * len(images) if positions is None else torch.split(positions, counts)
            for image, rows, grid in zip(images, torch.split(embeds, counts), places, strict=True):
                size = [int(v) for v in sizes[image].tolist()]
                if grid is None:  # a plan that leaves the image whole, or vLLM's start-up image no plan fits
                    out[image] = self._merge_image_patch_embeddings(
                        sizes[image], rows, image_newline=self.image_newline, strategy="spatial_unpad")
                    continue
                out[image], kept[image] = self._ficoco_packed(size, rows, grid, plans[image])
        record_kept([None] * len(out), kept)
        return out

    def _process_image_input(self, image_input: Any) -> Any:
        if self.ficoco.settings is None:
            return super()._process_image_input(image_input)
        if image_input.get("type") != "pixel_values":
            raise FicocoError("ficoco.vllm: image embeddings given directly cannot be reduced; give the images")
        sizes = image_input.get("image_sizes")
        if sizes is None:  # vLLM's own default: the tower's square
            side = self.config.vision_config.image_size
            sizes = torch.as_tensor([[side, side]] * len(image_input["pixel_values"]))
        if self.ficoco_in_layers:
            return self._ficoco_in_layers_images(image_input, sizes)
        patch_embeddings = self._process_image_pixels(image_input)
        out, kept = [], []
        for size_row, items in zip(sizes, patch_embeddings, strict=True):
            size = [int(v) for v in size_row.tolist()]
            plan = self.ficoco.plan_if_fits(image_size=size)
            removal = None if plan is None else next((r for r in plan.removals if r.stage == "vision"), None)
            if removal is None:  # a budget that leaves the image whole, or vLLM's start-up image no plan fits
                out.append(self._merge_image_patch_embeddings(size_row, items, image_newline=self.image_newline,
                                                              strategy="spatial_unpad"))
                kept.append(None)
                continue
            packed, groups = self._ficoco_pack(size, items, plan, removal)
            out.append(packed)
            kept.append(groups)
        record_kept([None] * len(out), kept)
        return out
