"""Qwen2.5-VL and Qwen3-VL in vLLM with a method before the LLM (knows vLLM's classes; calls ficoco's ops).

Each family is vLLM's own model class with three additions, and its own multimodal processor with one:

- the processor writes, for every image, the placeholders of the tokens the accountant's plan keeps for the
  image's grid (`settings.plan_image`), not the grid's product, or (PixelPrune) of the groups the image's
  pixels keep (`tokens.pixel_kept_groups`): the count is fixed before the encoder runs;
- `_process_image_input` runs vLLM's tower with two probes (the last block's keys; Qwen3-VL's DeepStack taps)
  and the cut in its merger (`tokens.cut_units`), or the cut on the tower's output (`tokens.cut_projected`), or
  FiCoCo-V's steps in its blocks and PixelPrune's cut at its first (`blocks.TowerBlocks`), then
  hands on each image's kept rows (DeepStack channels included) with their grid positions appended;
- `_process_video_input` runs a video's temporal slices through the image path as images of the slice's grid (the
  tower attends within a slice alone) under the video's plan, every slice the same share, and joins each video's
  kept rows with the slice's temporal position (Qwen3-VL: 0, every slice its own span after its timestamp);
- `get_mrope_input_positions` lays the shortened prompt out in the unreduced prompt's positions, and
  `recompute_mrope_positions` (which the runner calls once the encoder ran, `runner.enable_positions`) gives
  the kept tokens their own.

Without `ficoco_vllm` settings (or `FICOCO_VLLM`) the classes are vLLM's, unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor
from vllm.model_executor.models.qwen2_5_vl import (
    Qwen2_5_VLDummyInputsBuilder,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2_5_VLMultiModalProcessor,
    Qwen2_5_VLProcessingInfo,
)
from vllm.model_executor.models.qwen3_vl import (
    Qwen3VLDummyInputsBuilder,
    Qwen3VLForConditionalGeneration,
    Qwen3VLMultiModalProcessor,
    Qwen3VLProcessingInfo,
)
from vllm.multimodal import MULTIMODAL_REGISTRY
from vllm.multimodal.processing import PromptUpdateDetails

from ficoco.errors import FicocoError
from ficoco.methods.registry import method
from ficoco.serving.vllm.blocks import TowerBlocks
from ficoco.serving.vllm.common import Planner, ReducingInfo, ReducingProcessor, record_kept
from ficoco.serving.vllm.tokens import (
    TowerPass,
    cut_projected,
    cut_units,
    grid_positions,
    place_positions,
    prompt_positions,
)


class Qwen2_5_VLReducingInfo(ReducingInfo, Qwen2_5_VLProcessingInfo):
    """Qwen2.5-VL's processing info: a video is one span, reduced slice by slice."""

    video_reason = None


class Qwen3VLReducingInfo(ReducingInfo, Qwen3VLProcessingInfo):
    """Qwen3-VL's processing info: a video is one span per temporal slice (timestamps between), each reduced."""

    video_reason = None


class Qwen2_5_VLReducingProcessor(ReducingProcessor, Qwen2_5_VLMultiModalProcessor):
    """Qwen2.5-VL's processor with each image's placeholders cut to the plan's count."""


class Qwen3VLReducingProcessor(ReducingProcessor, Qwen3VLMultiModalProcessor):
    """Qwen3-VL's processor with each image's placeholders cut to the plan's count, and each temporal slice's span of
    a video (`<t seconds><|vision_start|>` placeholders `<|vision_end|>`, slice by slice) to the slice's share."""

    def _ficoco_shorten(self, tokens: Any, count: int, hf_processor_mm_kwargs: Mapping[str, Any]) -> Any:
        if isinstance(tokens, list):
            return super()._ficoco_shorten(tokens, count, hf_processor_mm_kwargs)
        video = int(self.info.get_hf_config().video_token_id)
        full = list(tokens.full)
        runs = sum(1 for i, token in enumerate(full) if token == video and (i == 0 or full[i - 1] != video))
        if not runs or count % runs:
            raise FicocoError(f"ficoco.vllm: {count} placeholders do not share out over a video's {runs} slice spans")
        out: list[int] = []
        for i, token in enumerate(full):
            if token != video:
                out.append(token)
            elif i == 0 or full[i - 1] != video:  # a slice's span begins: its share of the count
                out.extend([video] * (count // runs))
        return PromptUpdateDetails.select_token_id(out, video)


class _ReducingQwen:
    """What a Qwen model class of vLLM gains (see the module's docstring)."""

    windowed = False  # Qwen2.5-VL's tower runs in window order
    timed_slices = False  # Qwen2.5-VL: a video slice's temporal position steps by its seconds x tokens_per_second
    slice_spans = False  # Qwen3-VL: every temporal slice of a video is a span of its own (timestamps between)

    def _ficoco_setup(self) -> None:
        self.ficoco = Planner(self.config)  # type: ignore[attr-defined]
        self.ficoco_pass: TowerPass | None = None
        # The runner gives the kept tokens their positions once the encoder ran (ficoco.serving.vllm.runner).
        self.ficoco_reduces_images = self.ficoco.settings is not None
        if self.ficoco.settings is None:
            return
        spec = method(self.ficoco.settings.method)
        self.ficoco_spec = spec
        self.ficoco_module = spec.load()
        visual = self.visual  # type: ignore[attr-defined]
        if spec.placement == "tower_output" or (spec.placement == "after_projector" and spec.probes.reads_tower):
            visual.blocks[-1].attn.attn.register_forward_pre_hook(self._ficoco_keys, with_kwargs=True)
            for tap in getattr(visual, "deepstack_merger_list", []):
                tap.register_forward_hook(self._ficoco_tap)
            merger = visual.merger
            original = merger.forward

            def merger_forward(x: Tensor, _original: Any = original) -> Tensor:
                return self._ficoco_merger(x, _original)

            merger.forward = merger_forward
        elif spec.placement in ("in_layer", "tower_input"):  # inside the blocks, or a cut at the first (PixelPrune)
            self.ficoco_blocks = TowerBlocks(self)
        elif spec.placement != "after_projector":
            raise FicocoError(f"ficoco.vllm: {spec.title} is not wired into vLLM's {type(self).__name__}")

    # -- the probes ------------------------------------------------------------------------------------------
    def _ficoco_keys(self, module: Any, args: tuple, kwargs: dict) -> None:
        if self.ficoco_pass is not None:
            key = kwargs.get("key")
            self.ficoco_pass.keys = key if key is not None else args[1]

    def _ficoco_tap(self, module: Any, args: tuple, output: Tensor) -> None:
        if self.ficoco_pass is not None:
            self.ficoco_pass.taps.append(output)

    def _ficoco_merger(self, x: Tensor, original: Any) -> Tensor:
        tower = self.ficoco_pass
        if tower is None:
            return original(x)
        width = x.shape[-1] * tower.merge
        units = x.reshape(-1, width)
        kept_units = cut_units(tower, units, self.ficoco_module.tower_step, self._ficoco_step, self.ficoco_spec.title,
                               self.ficoco_spec.merges_by_keys)
        merged = original(torch.cat(kept_units).reshape(-1, x.shape[-1]))
        # Every group's row of the tower's order, the removed ones zero: the tower's own reordering and DeepStack's
        # concatenation expect them all; `_process_image_input` keeps the kept rows.
        full = merged.new_zeros(units.shape[0], merged.shape[-1])
        starts = tower.starts()
        rows = torch.cat([starts[i] + tower.rows[i].to(merged.device)[kept.to(merged.device)]
                          for i, kept in enumerate(tower.kept)])
        return full.index_copy(0, rows, merged)

    def _ficoco_step(self, grid: tuple[int, int, int]) -> tuple[dict[str, Any], int, int]:
        """The settings, removed and added units of the cut the plan for `grid` makes (none where a budget leaves
        the image whole)."""
        plan = self.ficoco.plan_if_fits(grid)
        removal = None if plan is None else next((r for r in plan.removals if r.stage == "vision"), None)
        if removal is None:
            return {} if plan is None else plan.settings_dict(), 0, 0
        return plan.settings_dict(), removal.remove, removal.added  # type: ignore[union-attr]


    # -- the encoder -----------------------------------------------------------------------------------------
    def _tower_rows(self, grid: tuple[int, int, int]) -> Tensor:
        t, h, w = grid
        groups = t * h * w // self.visual.spatial_merge_size**2  # type: ignore[attr-defined]
        if not self.windowed:
            return torch.arange(groups)
        order = self.visual.get_window_index_thw(t, h, w)[0]  # type: ignore[attr-defined]
        rows = torch.empty_like(order)
        rows[order] = torch.arange(groups)
        return rows

    def _process_image_input(self, image_input: Any) -> tuple[Tensor, ...]:
        if self.ficoco.settings is None:
            return super()._process_image_input(image_input)  # type: ignore[misc]
        if image_input["type"] == "image_embeds":
            raise FicocoError("ficoco.vllm: image embeddings given directly cannot be reduced; give the images")
        grids = [tuple(int(x) for x in g) for g in image_input["image_grid_thw"].tolist()]
        # One plan per image grid (a tflops budget keeps different counts on images of different sizes); the steps
        # run one batch per image size, as the transformers adapters batch them.
        plans = [self.ficoco.plan_if_fits(g) for g in grids]
        merge_size = self.visual.spatial_merge_size  # type: ignore[attr-defined]
        tower = TowerPass(grids=grids, merge_size=merge_size, rows=[self._tower_rows(g) for g in grids])
        spec = self.ficoco_spec
        expected = [t * h * w // merge_size**2 if plan is None else plan.tokens
                    for plan, (t, h, w) in zip(plans, grids, strict=True)]
        if spec.placement in ("in_layer", "tower_input"):
            tower = self.ficoco_blocks.start(grids, {g: p for g, p in zip(grids, plans, strict=True)})
            if spec.placement == "tower_input":  # each image's own count, from its pixels as the processor read them
                kept = self.ficoco.pixel_kept(image_input["pixel_values"], grids)
                self.ficoco_blocks.keep_at_input(tower, kept)
                expected = [int(k.numel()) for k in kept]
            self.ficoco_pass = tower
        if spec.placement == "tower_output":
            self.ficoco_pass = tower
        try:
            embeds = super()._process_image_input(image_input)  # type: ignore[misc]
        finally:
            self.ficoco_pass = None
        if spec.placement == "after_projector" and not spec.probes.reads_tower:
            kept_rows = cut_projected(tower, list(embeds), self.ficoco_module.tower_step, self._ficoco_step, spec.title,
                                      int(self.config.vision_config.out_hidden_size))
        else:
            kept_rows = [e[k.to(e.device)] for e, k in zip(embeds, tower.kept, strict=True)]
        record_kept(grids, tower.kept)
        out = []
        for rows, kept, grid, tokens in zip(kept_rows, tower.kept, grids, expected, strict=True):
            if rows.shape[0] != tokens:
                raise RuntimeError(f"ficoco.vllm: {spec.title} kept {rows.shape[0]} tokens of an image, its "
                                   f"placeholders {tokens}")
            out.append(grid_positions(rows, kept, grid, merge_size))
        return tuple(out)

    # -- videos: every temporal slice one image of its grid ---------------------------------------------------
    def _process_video_input(self, video_input: Any) -> tuple[Tensor, ...]:
        """A video's temporal slices through the image path, each an image of its (1, h, w) grid (the tower
        attends within a slice alone, so its states are the slices' as images), the kept rows put back per video
        with their (t, row, column) places: t the slice's temporal position (Qwen2.5-VL's seconds x
        tokens_per_second, as vLLM's positions count it)."""
        if self.ficoco.settings is None:
            return super()._process_video_input(video_input)  # type: ignore[misc]
        if video_input["type"] == "video_embeds":
            raise FicocoError("ficoco.vllm: video embeddings given directly cannot be reduced; give the video")
        grids = [tuple(int(x) for x in g) for g in video_input["video_grid_thw"].tolist()]
        seconds = video_input.get("second_per_grid_ts")
        factors = [self._ficoco_t_factor(None if seconds is None else float(seconds[v])) for v in range(len(grids))]
        merge = self.visual.spatial_merge_size  # type: ignore[attr-defined]
        try:
            plans = {grid: self.ficoco.slice_plan(grid) for grid in grids}
        except FicocoError:
            # Only vLLM's start-up video reaches here (the processor refuses a request's such video, and gave the
            # start-up one its unreduced placeholders): served whole, with its places.
            whole = super()._process_video_input(video_input)  # type: ignore[misc]
            return tuple(_timed(grid_positions(e, torch.arange(e.shape[0]), g, merge), 0.0 if self.slice_spans else f)
                         for e, g, f in zip(whole, grids, factors, strict=True))
        pixels = video_input["pixel_values_videos"]
        rows_per_video = [t * h * w for t, h, w in grids]
        starts = [0, *torch.tensor(rows_per_video).cumsum(0).tolist()[:-1]]
        out: list[Tensor | None] = [None] * len(grids)
        # The videos of one grid together (one plan per slice grid: videos of another length may keep another count
        # per slice under a TFLOPs budget), their slices as images of the slice's grid.
        for grid in dict.fromkeys(grids):
            t, h, w = grid
            videos = [v for v, g in enumerate(grids) if g == grid]
            self.ficoco.slices = {(1, h, w): plans[grid]}
            try:
                per_slice = self._process_image_input({
                    "type": "pixel_values",
                    "pixel_values": torch.cat([pixels[starts[v]:starts[v] + rows_per_video[v]] for v in videos]),
                    "image_grid_thw": torch.tensor([(1, h, w)] * (t * len(videos)), dtype=torch.long)})
            finally:
                self.ficoco.slices = {}
            for n, v in enumerate(videos):
                rows = [piece.clone() for piece in per_slice[n * t:(n + 1) * t]]
                for s, piece in enumerate(rows):
                    # The slice's temporal position (an integer, as vLLM's); Qwen3-VL: 0, every slice its own span.
                    piece[:, -3] = 0 if self.slice_spans else int(s * factors[v])
                out[v] = torch.cat(rows)
        return tuple(out)  # type: ignore[arg-type]

    def _ficoco_t_factor(self, seconds: float | None) -> float:
        """A video slice's step in the temporal M-RoPE position: Qwen2.5-VL's seconds per slice x tokens_per_second
        (vLLM's `iter_mm_grid_thw`); 1 on a family whose positions count slices."""
        if not self.timed_slices:
            return 1.0
        per_second = float(getattr(self.config.vision_config, "tokens_per_second", 1.0))  # type: ignore[attr-defined]
        return (1.0 if seconds is None else seconds) * per_second

    # -- positions -------------------------------------------------------------------------------------------
    def get_mrope_input_positions(self, input_tokens: list[int], mm_features: list[Any]) -> tuple[Tensor, int]:
        if self.ficoco.settings is None:
            return super().get_mrope_input_positions(input_tokens, mm_features)  # type: ignore[misc]
        merge = self.config.vision_config.spatial_merge_size  # type: ignore[attr-defined]
        spans = []
        for feature in mm_features:
            factor = 1.0
            if feature.modality == "video" and self.timed_slices:
                t, h, w = feature.data["video_grid_thw"].data.tolist()
                seconds = feature.data.get("second_per_grid_ts")
                factor = self._ficoco_t_factor(None if seconds is None else float(seconds.data.item()))
            elif feature.modality == "image":
                t, h, w = feature.data["image_grid_thw"].data.tolist()
            elif self.slice_spans:  # Qwen3-VL: every slice's run of placeholders a span of a (1, h, w) grid
                t, h, w = feature.data["video_grid_thw"].data.tolist()
                spans.extend((start, length, 1, h // merge, w // merge, 1.0) for start, length in _runs(
                    input_tokens, feature.mm_position.offset, feature.mm_position.length,
                    self.config.video_token_id))  # type: ignore[attr-defined]
                continue
            else:
                raise FicocoError(f"ficoco.vllm: a video's positions on {type(self).__name__} are not laid out")
            spans.append((feature.mm_position.offset, feature.mm_position.length, t, h // merge, w // merge, factor))
        return prompt_positions(len(input_tokens), spans)

    def recompute_mrope_positions(self, input_ids: Any, multimodal_embeddings: Sequence[Tensor],
                                  mrope_positions: Tensor, num_computed_tokens: int) -> tuple[Any, Tensor, int]:
        if self.ficoco.settings is None:
            return super().recompute_mrope_positions(  # type: ignore[misc]
                input_ids, multimodal_embeddings, mrope_positions, num_computed_tokens)
        media = (self.config.image_token_id, self.config.video_token_id)  # type: ignore[attr-defined]
        return place_positions(input_ids, multimodal_embeddings, mrope_positions, num_computed_tokens, media)


def _runs(tokens: Sequence[int], offset: int, length: int, token: int) -> list[tuple[int, int]]:
    """(start, length) of every run of `token` in tokens[offset:offset + length]."""
    runs: list[tuple[int, int]] = []
    for i in range(offset, offset + length):
        if tokens[i] == token:
            if runs and runs[-1][0] + runs[-1][1] == i:
                runs[-1] = (runs[-1][0], runs[-1][1] + 1)
            else:
                runs.append((i, 1))
    return runs


def _timed(rows: Tensor, factor: float) -> Tensor:
    """`rows` with their temporal place channel (a slice index) scaled to the slice's temporal position."""
    if factor != 1.0:
        rows = rows.clone()
        rows[:, -3] = (rows[:, -3] * factor).floor()
    return rows


@MULTIMODAL_REGISTRY.register_processor(Qwen2_5_VLReducingProcessor, info=Qwen2_5_VLReducingInfo,
                                        dummy_inputs=Qwen2_5_VLDummyInputsBuilder)
class ReducingQwen2_5_VL(_ReducingQwen, Qwen2_5_VLForConditionalGeneration):
    """vLLM's Qwen2.5-VL with ficoco's method before the LLM (the window order mapped to grid order)."""

    windowed = True
    timed_slices = True

    def __init__(self, *, vllm_config: Any, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self._ficoco_setup()


@MULTIMODAL_REGISTRY.register_processor(Qwen3VLReducingProcessor, info=Qwen3VLReducingInfo,
                                        dummy_inputs=Qwen3VLDummyInputsBuilder)
class ReducingQwen3VL(_ReducingQwen, Qwen3VLForConditionalGeneration):
    """vLLM's Qwen3-VL with ficoco's method before the LLM; DeepStack's features follow the kept tokens."""

    slice_spans = True

    def __init__(self, *, vllm_config: Any, prefix: str = "model") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self._ficoco_setup()
