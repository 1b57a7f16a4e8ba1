"""What every served family shares (knows vLLM's processors): the engine's settings and plans, the processor
that writes each image's planned placeholders, and the record of what was kept."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

from torch import Tensor
from vllm.multimodal.processing import PromptReplacement

from ficoco.errors import FicocoError
from ficoco.serving.vllm.settings import SETTINGS_KEY, ImagePlan, Settings, plan_image, settings_from


def _config_json(config: Any) -> str:
    """The served model's config as the accountant reads a profile's (the plugin's own key left out)."""
    data = config.to_dict()
    data.pop(SETTINGS_KEY, None)
    return json.dumps(data, sort_keys=True, default=str)


RECORD = "FICOCO_VLLM_RECORD"  # a file each reduced image's kept groups are appended to (JSON lines), if set


def record_kept(grids: Sequence[tuple[int, int, int] | None], kept: Sequence[Tensor | None]) -> None:
    """Append every image's grid and kept groups (grid indices) to the file `FICOCO_VLLM_RECORD` names: the
    engine's processes are not the caller's, and a test or a user reads what the method kept from there."""
    path = os.environ.get(RECORD)
    if not path:
        return
    with open(path, "a") as out:
        for grid, groups in zip(grids, kept, strict=True):
            line = {"grid_thw": None if grid is None else list(grid), "kept": [] if groups is None else groups.tolist()}
            out.write(json.dumps(line) + "\n")


class Planner:
    """An engine's settings and the accountant's plan for every image grid it sees (cached by grid)."""

    def __init__(self, config: Any) -> None:
        self.settings: Settings | None = settings_from(config)
        self.config_json = _config_json(config) if self.settings is not None else ""
        self.patch = int(config.vision_config.patch_size)

    def plan(self, grid_thw: Sequence[int] | None) -> ImagePlan:
        """The plan for an image of `grid_thw` (None: the family's one fixed layout, LLaVA-1.5's)."""
        assert self.settings is not None
        grid = None if grid_thw is None else tuple(int(x) for x in grid_thw)
        return plan_image(self.config_json, self.settings, grid, self.patch)  # type: ignore[arg-type]


class ReducingProcessor:
    """The placeholders of an image: the tokens the plan keeps for its grid (the first of vLLM's own)."""

    def _ficoco_planner(self) -> Planner:
        """The engine's settings, read once per processor (a mistake in them is one FicocoError line)."""
        planner = self.__dict__.get("_ficoco")
        if planner is None:
            planner = self.__dict__["_ficoco"] = Planner(self.info.get_hf_config())  # type: ignore[attr-defined]
        return planner

    def _get_prompt_updates(self, mm_items: Any, hf_processor_mm_kwargs: Mapping[str, Any],
                            out_mm_kwargs: Any) -> Sequence[Any]:
        updates = super()._get_prompt_updates(mm_items, hf_processor_mm_kwargs, out_mm_kwargs)  # type: ignore[misc]
        planner = self._ficoco_planner()
        if planner.settings is None:
            return updates
        out = []
        for update in updates:
            if update.modality != "image":
                out.append(update)
                continue

            def replacement(item_idx: int, _original: Any = update.replacement) -> list[int]:
                tokens = _original(item_idx) if callable(_original) else _original
                if not isinstance(tokens, list):
                    raise FicocoError("ficoco.vllm: this model's image placeholders are not a plain token list")
                item = out_mm_kwargs["image"][item_idx]
                grid = item["image_grid_thw"].data.tolist() if "image_grid_thw" in item else None
                return tokens[:planner.plan(grid).tokens]

            out.append(PromptReplacement(modality="image", target=update.target, replacement=replacement))
        return out
