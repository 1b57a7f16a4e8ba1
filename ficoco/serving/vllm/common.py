"""What every served family shares (knows vLLM's processors): the engine's settings and plans, the processor
that writes each image's planned placeholders, and the record of what was kept."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from torch import Tensor
from vllm.multimodal.processing import PromptReplacement

from ficoco.errors import FicocoError
from ficoco.serving.vllm.settings import (
    PIXEL_COUNTED,
    SETTINGS_KEY,
    VIDEO_REFUSED,
    ImagePlan,
    Settings,
    plan_image,
    plan_video,
    settings_from,
    unserved_reason,
)
from ficoco.serving.vllm.tokens import PatchLayout, pixel_kept_groups


def _config_json(config: Any) -> str:
    """The served model's config as the accountant reads a profile's (the plugin's own key left out)."""
    data = config.to_dict()
    data.pop(SETTINGS_KEY, None)
    return json.dumps(data, sort_keys=True, default=str)


RECORD = "FICOCO_VLLM_RECORD"  # a file each reduced image's kept groups are appended to (JSON lines), if set


def record_kept(grids: Sequence[tuple[int, int, int] | None], kept: Sequence[Tensor | list[Tensor] | None]) -> None:
    """Append every image's grid and kept groups (grid indices; per tile, a list of them) to the file
    `FICOCO_VLLM_RECORD` names: the engine's processes are not the caller's, and a test or a user reads what the
    method kept from there."""
    path = os.environ.get(RECORD)
    if not path:
        return
    with open(path, "a") as out:
        for grid, groups in zip(grids, kept, strict=True):
            listed = [] if groups is None else groups.tolist() if isinstance(groups, Tensor) else \
                [tile.tolist() for tile in groups]
            line = {"grid_thw": None if grid is None else list(grid), "kept": listed}
            out.write(json.dumps(line) + "\n")


class Planner:
    """An engine's settings and the accountant's plan for every image grid it sees (cached by grid)."""

    def __init__(self, config: Any) -> None:
        self.settings: Settings | None = settings_from(config)
        self.config_json = _config_json(config) if self.settings is not None else ""
        vision = config.vision_config
        patch = vision.patch_size  # InternVL's config gives (height, width)
        self.patch = int(patch[0] if isinstance(patch, (list, tuple)) else patch)
        # A method whose count is each image's own, read from its pixels (PixelPrune): the processor and the model
        # run its selector on the same pixels, so the placeholders and the tower's kept groups agree.
        self.pixel_counted = self.settings is not None and self.settings.method in PIXEL_COUNTED
        self.layout: PatchLayout | None = None
        # While a video's temporal slices run through the image path: the slice grid's plan, the video's per slice.
        self.slices: dict[tuple[int, ...], ImagePlan] = {}
        if self.pixel_counted:
            from ficoco.methods.pixelprune import NORMALISATION

            mean, std = NORMALISATION[config.model_type]
            self.layout = PatchLayout(channels=int(vision.in_channels),
                                      temporal_patch_size=int(vision.temporal_patch_size), patch_size=self.patch,
                                      merge_size=int(vision.spatial_merge_size), mean=mean, std=std)

    def plan(self, grid_thw: Sequence[int] | None) -> ImagePlan:
        """The plan for an image of `grid_thw` (None: the family's one fixed layout, LLaVA-1.5's); while a video's
        slices run as images (`slices`), its slice plan."""
        assert self.settings is not None
        grid = None if grid_thw is None else tuple(int(x) for x in grid_thw)
        if grid in self.slices:
            return self.slices[grid]
        return plan_image(self.config_json, self.settings, grid, self.patch)  # type: ignore[arg-type]

    def plan_tiles(self, tiles: int) -> ImagePlan:
        """The plan for an InternVL image the processor cut into `tiles` tower items (the thumbnail included)."""
        assert self.settings is not None
        return plan_image(self.config_json, self.settings, None, self.patch, tiles=int(tiles))

    def plan_sized(self, size_hw: Sequence[int]) -> ImagePlan:
        """The plan for a LLaVA-OneVision image of `size_hw` (H, W), laid out by its AnyRes grid."""
        assert self.settings is not None
        return plan_image(self.config_json, self.settings, None, self.patch,
                          image_size=(int(size_hw[0]), int(size_hw[1])))

    def plan_if_fits(self, grid_thw: Sequence[int] | None = None, tiles: int | None = None,
                     image_size: Sequence[int] | None = None) -> ImagePlan | None:
        """The plan of an image of `grid_thw` (or of `tiles` tiles, or of `image_size`); None where no plan fits it,
        which only vLLM's start-up inputs bring to a model (the processor refuses a request's such image, and gave
        the start-up image its unreduced placeholders: `ReducingProcessor.get_dummy_mm_inputs`)."""
        try:
            if image_size is not None:
                return self.plan_sized(image_size)
            return self.plan_tiles(tiles) if tiles is not None else self.plan(grid_thw)
        except FicocoError:
            return None

    def video_plan(self, grid_thw: Sequence[int]) -> ImagePlan:
        """The accountant's plan of a video of `grid_thw`: every temporal slice an item (Qwen's tower attends within a
        slice alone), reduced as an image of its (1, h, w) grid; its tokens are the video's placeholders, fixed
        before the encoder runs."""
        assert self.settings is not None
        grid = tuple(int(x) for x in grid_thw)
        if self.settings.method in VIDEO_REFUSED:
            raise FicocoError(f"ficoco.vllm: {self.settings.method} does not reduce videos "
                              f"({VIDEO_REFUSED[self.settings.method]}); send videos to an engine without it")
        return plan_video(self.config_json, self.settings, grid, self.patch)  # type: ignore[arg-type]

    def slice_plan(self, grid_thw: Sequence[int]) -> ImagePlan:
        """One temporal slice's share of the video's plan (its removals are per item, every slice the same), as the
        plan of an image of the slice's grid: what the model runs on each slice."""
        t, h, w = (int(x) for x in grid_thw)
        video = self.video_plan((t, h, w))
        if video.tokens % t:
            raise FicocoError(f"ficoco.vllm: the plan keeps {video.tokens} tokens of a video of {t} temporal slices, "
                              "not the same count on each")
        return replace(video, grid_thw=(1, h, w), tokens=video.tokens // t, vanilla_tokens=video.vanilla_tokens // t)

    def video_tokens(self, item: Any) -> int:
        """The placeholders of one processed video (vLLM's kwargs item): the video plan's count."""
        return self.video_plan(item["video_grid_thw"].data.tolist()).tokens

    def pixel_kept(self, pixels: Tensor, grids: Sequence[tuple[int, int, int]]) -> list[Tensor]:
        """Every image's kept merge groups (grid indices, ascending) under a pixel-counted method, from the packed
        patches `pixels` of the images of `grids`."""
        from ficoco.methods.registry import method

        assert self.settings is not None and self.layout is not None
        step = method(self.settings.method).load().tower_step
        return pixel_kept_groups(pixels, grids, self.layout, step, lambda grid: (self.plan(grid).settings_dict(), 0, 0))

    def image_tokens(self, item: Any) -> int:
        """The placeholders of one processed image (vLLM's kwargs item): the plan's count for its grid, or the
        groups its pixels keep under a pixel-counted method."""
        grid = item["image_grid_thw"].data.tolist() if "image_grid_thw" in item else None
        if not self.pixel_counted:
            return self.plan(grid).tokens
        (kept,) = self.pixel_kept(item["pixel_values"].data, [tuple(int(x) for x in grid)])
        return int(kept.numel())


def served_method(planner: Planner, served: Sequence[str], family: str, model_type: str) -> Any:
    """The method the engine's settings name (None without settings), refused in one line where `family` does not
    serve it; the engine's config check refuses it first (runner.check_settings), before any process."""
    if planner.settings is None:
        return None
    from ficoco.methods.registry import method

    spec = method(planner.settings.method)
    if spec.name not in served:
        raise FicocoError(f"ficoco.vllm: {spec.title} is not served on {family} "
                          f"({unserved_reason(spec.name, model_type)}); served there: {', '.join(served)}")
    return spec


class ReducingInfo:
    """A family's processing info that refuses a video to a reducing engine in one line, for that request alone
    (vLLM turns the error into its 400 and serves the others), where the family's plugin reduces images only
    (`video_reason`) or the engine's method does not reduce videos: a video's tokens would reach a model whose
    positions are laid out for reduced media. vLLM's own dummy inputs (its start-up profiling) skip this
    validation."""

    video_reason: str | None = "the plugin reduces this family's images only"  # None: videos are reduced

    def validate_num_items(self, modality: str, num_items: int) -> None:
        if modality == "video" and num_items:
            settings = settings_from(self.get_hf_config())  # type: ignore[attr-defined]
            why = None if settings is None else self.video_reason or VIDEO_REFUSED.get(settings.method)
            if settings is not None and why:
                raise FicocoError(f"ficoco.vllm: this engine reduces images with {settings.method} and serves no "
                                  f"video ({why}); send videos to an engine without ficoco_vllm settings")
        super().validate_num_items(modality, num_items)  # type: ignore[misc]


class ReducingProcessor:
    """The placeholders of an image: the tokens the plan keeps for its grid, or its pixels keep (the first of
    vLLM's own)."""

    def _ficoco_planner(self) -> Planner:
        """The engine's settings, read once per processor (a mistake in them is one FicocoError line)."""
        planner = self.__dict__.get("_ficoco")
        if planner is None:
            planner = self.__dict__["_ficoco"] = Planner(self.info.get_hf_config())  # type: ignore[attr-defined]
        return planner

    def get_dummy_mm_inputs(self, *args: Any, **kwargs: Any) -> Any:
        """vLLM's start-up inputs (the largest image, for its encoder budget and memory profile): an image no plan
        fits there (a TFLOPs budget the largest image cannot meet) keeps its unreduced placeholders, and the model its
        unreduced tokens, so that the engine starts; a request's such image is refused alone."""
        self.__dict__["_ficoco_dummy"] = True
        try:
            return super().get_dummy_mm_inputs(*args, **kwargs)  # type: ignore[misc]
        finally:
            self.__dict__["_ficoco_dummy"] = False

    def _ficoco_placeholders(self, planner: Planner, item: Any, modality: str = "image") -> int:
        """The placeholders the plan keeps for one processed image or video (vLLM's kwargs item)."""
        return planner.video_tokens(item) if modality == "video" else planner.image_tokens(item)

    def _ficoco_shorten(self, tokens: Any, count: int, hf_processor_mm_kwargs: Mapping[str, Any]) -> Any:
        """vLLM's replacement of one image with `count` placeholders: the first of a plain token list."""
        if not isinstance(tokens, list):
            raise FicocoError("ficoco.vllm: this model's image placeholders are not a plain token list")
        return tokens[:count]

    def _get_prompt_updates(self, mm_items: Any, hf_processor_mm_kwargs: Mapping[str, Any],
                            out_mm_kwargs: Any) -> Sequence[Any]:
        updates = super()._get_prompt_updates(mm_items, hf_processor_mm_kwargs, out_mm_kwargs)  # type: ignore[misc]
        planner = self._ficoco_planner()
        if planner.settings is None:
            return updates
        reduced = ("image",) if getattr(self.info, "video_reason", "images") else ("image", "video")  # type: ignore[attr-defined]
        out = []
        for update in updates:
            if update.modality not in reduced:
                out.append(update)
                continue

            def replacement(item_idx: int, _original: Any = update.replacement, _modality: str = update.modality
                            ) -> Any:
                tokens = _original(item_idx) if callable(_original) else _original
                try:
                    count = self._ficoco_placeholders(planner, out_mm_kwargs[_modality][item_idx], _modality)
                except FicocoError:
                    if not self.__dict__.get("_ficoco_dummy"):
                        raise
                    return tokens
                return self._ficoco_shorten(tokens, count, hf_processor_mm_kwargs)

            out.append(PromptReplacement(modality=update.modality, target=update.target, replacement=replacement))
        return out
