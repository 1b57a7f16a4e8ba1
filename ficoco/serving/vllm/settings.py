"""The plugin's settings and budgets, torch-free: which method an engine runs, and how many tokens every image
keeps, fixed from the budget and the image's grid before the encoder runs.

An engine chooses its method through vLLM's own configuration, `hf_overrides={"ficoco_vllm": {...}}` (the
model config's attribute `ficoco_vllm`, which vLLM hands the processor and the model in every process), or the
environment variable `FICOCO_VLLM` (the same JSON) where no override is given:

    {"method": "visionzip", "keep": 64}                       # keep N tokens per image (each method's --keep)
    {"method": "divprune", "tflops": 1.5, "text_tokens": 60}  # a budget, resolved by the accountant per grid
    {"method": "visionzip", "keep": 64, "hp": {"contextual_mode": "mean"}}

The budget is resolved as `ficoco flops` resolves it for the image's layout: the profile is the served model's
own config with its family's defaults, the architecture is the one of an image of the grid's size, and the
accountant plans the method's schedule for the request (`resolve_schedule`), whose visual tokens reaching the
LLM are the placeholders the processor writes.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from ficoco.errors import FicocoError

SETTINGS_KEY = "ficoco_vllm"  # the hf_overrides key (the config attribute) the plugin reads
ENVIRONMENT = "FICOCO_VLLM"  # the same settings as JSON, where the config carries none
SETTING_NAMES = ("method", "keep", "preset", "tflops", "convention", "scope", "text_tokens", "first_layer", "hp")

# The methods the plugin runs: each reduces every image to a count fixed before the encoder runs, from the image
# alone (no text), by ops ficoco's transformers adapters call too: by the budget and the grid, or (PixelPrune,
# `PIXEL_COUNTED`) by the image's pixels, which the processor holds when it writes the placeholders.
SUPPORTED = ("v", "visionzip", "divprune", "vispruner", "pixelprune")
PIXEL_COUNTED = ("pixelprune",)

# Every other method, with the one-line reason it cannot run in a serving engine's plugin (or is not wired here).
_INSIDE_LLM = ("acts inside the LLM's layers; vLLM fixes a prompt's KV-cache slots before its prefill, so tokens "
               "dropped from hidden states there have no path (issue threads: outputs garbled)")
REFUSED = {
    "l": _INSIDE_LLM,
    "fastv": _INSIDE_LLM,
    "pdrop": _INSIDE_LLM,
    "dart": _INSIDE_LLM,
    "sparsevlm": _INSIDE_LLM + ", and it selects with the prompt's text",
    "cdpruner": "selects with the instruction's text embeddings, and vLLM's encoder sees the image alone",
    "prumerge": "its count is set by the image's content (adaptive outliers), and vLLM writes each image's "
                "placeholders before the encoder runs",
    "holitom": "cuts a video's frames together; the plugin reduces every slice of a video as an image, not frames "
               "together",
    "tome": "merges inside every tower block (segments and rotary rows change block by block); not wired into "
            "vLLM's tower by the plugin",
    "fastervlm": "not wired into vLLM's tower by the plugin yet (VisionZip and VisPruner read the same keys)",
}


# The served methods that do not reduce a video (an engine running them refuses a video per request); the others
# reduce every temporal slice of a Qwen video as one image of the slice's grid.
VIDEO_REFUSED = {"pixelprune": "its pixel grid of merge groups is an image's; a video's temporal slices pair frames"}


def refusal(method: str) -> str | None:
    """The one line that says why `method` does not run in the vLLM plugin, or None where it does."""
    from ficoco.methods.registry import METHODS

    if method in SUPPORTED:
        return None
    if method in REFUSED:
        return f"ficoco.vllm: {method} is not served: {REFUSED[method]}; served: {', '.join(SUPPORTED)}"
    if method not in METHODS:
        return f"ficoco.vllm: unknown method '{method}': choose from {', '.join(SUPPORTED)}"
    return f"ficoco.vllm: {method} is not served by the plugin; served: {', '.join(SUPPORTED)}"


def unserved_reason(method_name: str, model_type: str) -> str:
    """Why a family that serves some of the plugin's methods does not serve `method_name`: the method's own refusal
    for the family where it has one, else what its placement needs of the family's tower."""
    from ficoco.methods.registry import method

    spec = method(method_name)
    return spec.refusals.get(model_type) or (
        "it acts inside the tower's layers, which the plugin does not wire in this family's tower"
        if spec.placement == "in_layer" else
        "it reads the tower's [CLS] attention, which the plugin does not probe in this family's tower")


@dataclass(frozen=True)
class Settings:
    """One engine's reduction: the method, at most one of keep / preset / tflops, how a budget is counted
    (convention, scope, the text tokens of the layout), and the method's hyperparameters."""

    method: str
    keep: int | None = None
    preset: int | None = None
    tflops: float | None = None
    convention: str = "flops"
    scope: str = "llm"
    text_tokens: int | None = None
    first_layer: int | None = None  # FiCoCo-V: the first reducing tower block (None: the family's default)
    hp: tuple[tuple[str, Any], ...] = field(default_factory=tuple)

    @classmethod
    def parse(cls, raw: Mapping[str, Any]) -> Settings:
        """Settings from the user's mapping; a mistake (an unknown key or method, two budgets) is one FicocoError."""
        unknown = sorted(set(raw) - set(SETTING_NAMES))
        if unknown:
            raise FicocoError(f"ficoco.vllm: unknown setting {', '.join(unknown)}: choose from "
                              f"{', '.join(SETTING_NAMES)}")
        method = raw.get("method")
        if not isinstance(method, str):
            raise FicocoError(f"ficoco.vllm: give a method, one of {', '.join(SUPPORTED)}")
        why = refusal(method)
        if why:
            raise FicocoError(why)
        budgets = [name for name in ("keep", "preset", "tflops") if raw.get(name) is not None]
        if len(budgets) > 1:
            raise FicocoError(f"ficoco.vllm: give one of keep, preset and tflops, not {' and '.join(budgets)}")
        if method in PIXEL_COUNTED and budgets:
            from ficoco.methods.registry import method as spec_of

            raise FicocoError(f"ficoco.vllm: {spec_of(method).budget_refusal}")
        if method == "v" and not budgets:
            raise FicocoError("ficoco.vllm: FiCoCo-V has no official default setting: give keep or tflops")
        hp = raw.get("hp") or {}
        if not isinstance(hp, Mapping):
            raise FicocoError("ficoco.vllm: hp must be a mapping of the method's hyperparameters")

        def number(name: str, kind: type) -> Any:
            value = raw.get(name)
            if value is None:
                return None
            if isinstance(value, bool) or (kind is int and isinstance(value, float) and not value.is_integer()):
                raise FicocoError(f"ficoco.vllm: {name} must be a whole number, got {value!r}")
            try:
                return kind(value)
            except (TypeError, ValueError, OverflowError):
                raise FicocoError(f"ficoco.vllm: {name} must be a number, got {value!r}") from None

        parsed = cls(method=method, keep=number("keep", int), preset=number("preset", int),
                     tflops=number("tflops", float), convention=str(raw.get("convention", "flops")),
                     scope=str(raw.get("scope", "llm")), text_tokens=number("text_tokens", int),
                     first_layer=number("first_layer", int), hp=tuple(sorted(hp.items())))
        # Settings no image can be served with are refused here, where vLLM makes the engine's config
        # (runner.check_settings), not at the first request.
        for name in ("keep", "preset"):
            value = getattr(parsed, name)
            if value is not None and value < 1:
                raise FicocoError(f"ficoco.vllm: {name}={value} keeps no visual token; give {name} >= 1")
        if parsed.tflops is not None and not (math.isfinite(parsed.tflops) and parsed.tflops > 0):
            raise FicocoError(f"ficoco.vllm: tflops={raw.get('tflops')!r} is no budget; give a positive number of "
                              "TFLOPs")
        for name in ("text_tokens", "first_layer"):
            value = getattr(parsed, name)
            if value is not None and value < 0:
                raise FicocoError(f"ficoco.vllm: {name}={value} is negative; give {name} >= 0")
        return parsed

    def to_json(self) -> dict[str, Any]:
        """The settings as the user spells them (reports record them)."""
        out: dict[str, Any] = {"method": self.method}
        for name in ("keep", "preset", "tflops", "text_tokens", "first_layer"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        if self.tflops is not None:
            out.update(convention=self.convention, scope=self.scope)
        if self.hp:
            out["hp"] = dict(self.hp)
        return out


def settings_from(config: Any) -> Settings | None:
    """The engine's settings from the served model's config (`hf_overrides`' ``ficoco_vllm``), else from the
    environment variable `FICOCO_VLLM`; None: no reduction (the engine runs the model as vLLM does)."""
    raw = getattr(config, SETTINGS_KEY, None)
    if raw is None:
        text = os.environ.get(ENVIRONMENT, "").strip()
        if not text:
            return None
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise FicocoError(f"ficoco.vllm: {ENVIRONMENT} is not JSON ({exc.msg})") from None
    if not isinstance(raw, Mapping):
        raise FicocoError(f"ficoco.vllm: the settings must be a mapping, got {type(raw).__name__}")
    return Settings.parse(raw)


@dataclass(frozen=True)
class ImagePlan:
    """What the accountant planned for one image grid: the tokens that reach the LLM (the placeholders), the
    removals of the schedule, and the settings the method's ops run with (its defaults, then the schedule's)."""

    grid_thw: tuple[int, int, int] | None
    tokens: int
    removals: tuple[Any, ...]
    settings: tuple[tuple[str, Any], ...]
    tflops: float
    vanilla_tokens: int
    vanilla_tflops: float

    def settings_dict(self) -> dict[str, Any]:
        return {name: list(value) if isinstance(value, tuple) else value for name, value in self.settings}


def _profile(config: Mapping[str, Any], name: str, defaults: Mapping[str, Any] | None = None) -> Any:
    from ficoco.profiles import FAMILY_DEFAULTS, Profile

    model_type = config.get("model_type")
    if model_type not in FAMILY_DEFAULTS:
        raise FicocoError(f"ficoco.vllm: model_type '{model_type}' has no accounting; supported: "
                          f"{', '.join(FAMILY_DEFAULTS)}")
    return Profile(name=name, config=dict(config), defaults={**FAMILY_DEFAULTS[model_type], **(defaults or {})})


def plan_image(config_json: str, settings: Settings | None, grid_thw: tuple[int, int, int] | None, patch: int,
               name: str = "served", text_tokens: int | None = None, tiles: int | None = None,
               image_size: tuple[int, int] | None = None) -> ImagePlan:
    """The accountant's plan for one image of `grid_thw` (patches) under `settings` (None: vanilla, counted
    with `text_tokens`), for the model whose config is `config_json` (a string so that plans are cached by
    value). `grid_thw` None: a family whose every image has the same layout (LLaVA-1.5's fixed square), or
    (`tiles`) InternVL's image of that many tower tiles, the thumbnail included, as the served processor cut it, or
    (`image_size`, (H, W)) LLaVA-OneVision's AnyRes image of that size (its crop grid, unpadding and newlines)."""
    if settings is None:
        settings = Settings(method="vanilla", text_tokens=text_tokens)
    grid = None if grid_thw is None else tuple(int(x) for x in grid_thw)
    size = None if image_size is None else (int(image_size[0]), int(image_size[1]))
    try:
        return _plan(config_json, settings, grid, int(patch), name, tiles, size)  # type: ignore[arg-type]
    except FicocoError as exc:
        if str(exc).startswith("ficoco.vllm"):
            raise
        if tiles is not None:  # InternVL: the request's image as the processor tiled it
            raise FicocoError(f"ficoco.vllm: this request's image (as processed, {tiles} tiles of the tower's size) "
                              f"cannot be reduced with {settings.method} here: {exc}") from None
        if size is not None:  # LLaVA-OneVision: the request's image at its own size
            # The accountant's advice names ficoco.apply's arguments; a client can only change the image.
            why = str(exc).rsplit("; use ", 1)[0]
            raise FicocoError(f"ficoco.vllm: this request's {size[1]}x{size[0]} image cannot be reduced with "
                              f"{settings.method} here: {why}; send an image whose crop grid neither unpadding "
                              "cuts nor anyres_max downscales (a square one within the largest grid), or send it "
                              "to an engine without ficoco_vllm settings") from None
        if grid is None:
            raise
        # A setting no image of this grid can take (keep past its tokens, a budget below its floor): the request's
        # one line, which names its image (the server answers it with a 400 and serves the others).
        t, h, w = grid
        raise FicocoError(f"ficoco.vllm: this request's {w * patch}x{h * patch} image (as processed, a {h}x{w} "
                          f"patch grid) cannot be reduced with {settings.method} here: {exc}") from None


def plan_video(config_json: str, settings: Settings | None, grid_thw: tuple[int, int, int], patch: int,
               name: str = "served", text_tokens: int | None = None) -> ImagePlan:
    """The accountant's plan for one video of `grid_thw` (temporal slices, patches) under `settings` (None:
    vanilla, counted with `text_tokens`): the architecture of a video of t x temporal_patch frames of the slice's
    size, every temporal slice an item of it, reduced as an image of its (1, h, w) grid."""
    if settings is None:
        settings = Settings(method="vanilla", text_tokens=text_tokens)
    grid = tuple(int(x) for x in grid_thw)
    try:
        return _plan(config_json, settings, grid, int(patch), name)  # type: ignore[arg-type]
    except FicocoError as exc:
        if str(exc).startswith("ficoco.vllm"):
            raise
        t, h, w = grid
        raise FicocoError(f"ficoco.vllm: this request's video (as processed, {t} temporal slices of {h}x{w} "
                          f"patches) cannot be reduced with {settings.method} here: {exc}") from None


def _video_architecture(config: dict[str, Any], name: str, grid_thw: tuple[int, int, int], patch: int) -> Any:
    """The accountant's architecture of a video the served processor made `grid_thw` of (its frames resized to the
    grid, as the processor did under its own pixel bounds)."""
    from ficoco.accounting import architecture

    t, h, w = grid_thw
    temporal = int(config.get("vision_config", {}).get("temporal_patch_size", 2))
    pixels = h * w * patch * patch
    profile = _profile(config, name, {"min_pixels": pixels, "max_pixels": pixels,
                                      "video_min_pixels": pixels, "video_max_pixels": pixels})
    arch = architecture(profile, image_size=(h * patch, w * patch), frames=t * temporal)
    if arch.vision.items != t or arch.vision.units * arch.vision.merge != h * w:
        raise FicocoError(f"ficoco.vllm: the accountant's layout for a video of {t * temporal} {w * patch}x"
                          f"{h * patch} frames is not the served grid {t}x{h}x{w}")
    return arch


def _tiled_architecture(config: dict[str, Any], name: str, tiles: int) -> Any:
    """The accountant's architecture of an InternVL image of `tiles` tower items as the served processor cut it
    (a grid of tiles, and a thumbnail when there is more than one): every item costs a tile's work, so the image
    whose canvas is exactly (tiles - 1) tiles in a row, with the tiling bounded to them, has the same layout."""
    from ficoco.accounting import architecture

    if tiles < 1 or tiles == 2:  # one tile is the image alone; two or more tiles come with the thumbnail
        raise FicocoError(f"ficoco.vllm: an InternVL image of {tiles} tower items is no tiling the processor makes")
    vision = config.get("vision_config", {})
    size = vision.get("image_size", 448)
    tile_h, tile_w = (size, size) if isinstance(size, int) else (int(size[0]), int(size[1]))
    row = max(tiles - 1, 1)
    # The tiling bounds are this image's (a profile's own `ficoco` bounds, where the config carries them, set aside).
    own = {k: v for k, v in (config.get("ficoco") or {}).items() if k not in ("min_tiles", "max_tiles")}
    profile = _profile({**config, "ficoco": own}, name, {"min_tiles": row, "max_tiles": row})
    arch = architecture(profile, image_size=(tile_h, tile_w * row))
    if arch.vision.items != tiles:
        raise FicocoError(f"ficoco.vllm: the accountant's layout of an image of {tiles} tiles has "
                          f"{arch.vision.items}")
    return arch


@lru_cache(maxsize=256)
def _plan(config_json: str, settings: Settings, grid_thw: tuple[int, int, int] | None, patch: int, name: str,
          tiles: int | None = None, image_size: tuple[int, int] | None = None) -> ImagePlan:
    from ficoco.accounting import CountOptions, ScheduleRequest, architecture, compute_tera, resolve_schedule
    from ficoco.accounting.schedule import plan_tokens
    from ficoco.methods.registry import method

    if tiles is not None:
        arch = _tiled_architecture(json.loads(config_json), name, tiles)
    elif image_size is not None:
        arch = architecture(_profile(json.loads(config_json), name), image_size=image_size)
    elif grid_thw is None:
        arch = architecture(_profile(json.loads(config_json), name))
    elif grid_thw[0] != 1:  # a video: its temporal slices
        arch = _video_architecture(json.loads(config_json), name, grid_thw, patch)
    else:
        t, h, w = grid_thw
        # The grid is what the served processor made of the image under its own pixel bounds (the checkpoint's
        # preprocessor_config.json, or an engine's mm_processor_kwargs): the accountant plans that grid as it is,
        # with bounds that admit it, never its own family defaults (which cap Qwen2.5-VL at 1,003,520 pixels where
        # the checkpoints allow 12,845,056).
        pixels = h * w * patch * patch
        profile = _profile(json.loads(config_json), name, {"min_pixels": pixels, "max_pixels": pixels})
        arch = architecture(profile, image_size=(h * patch, w * patch))
        if arch.vision.units * arch.vision.merge != h * w:  # the accountant's resize must give the served grid
            raise FicocoError(f"ficoco.vllm: the accountant's layout for a {w * patch}x{h * patch} image is not the "
                              f"served grid {h}x{w}")
    opts = CountOptions(convention=settings.convention, scope=settings.scope, text_tokens=settings.text_tokens)
    vanilla = resolve_schedule(arch, "vanilla", opts)
    if settings.method == "vanilla":
        cost = compute_tera(arch, vanilla, opts)
        return ImagePlan(grid_thw=grid_thw, tokens=arch.visual_tokens, removals=(), settings=(), tflops=cost,
                         vanilla_tokens=arch.visual_tokens, vanilla_tflops=cost)
    request = ScheduleRequest(keep=settings.keep, preset=settings.preset, tflops=settings.tflops,
                              first_layer=settings.first_layer)
    spec = method(settings.method)
    hp = dict(settings.hp)
    schedule = resolve_schedule(arch, settings.method, opts, request, hyperparameters=hp)
    tokens = plan_tokens(arch, schedule).llm_visual_tokens
    if tokens > arch.visual_tokens:
        raise FicocoError(f"ficoco.vllm: {spec.title} with these settings hands the LLM {tokens} visual tokens, "
                          f"more than the {arch.visual_tokens} of an image")
    merged = dict(spec.hyperparameters)
    merged.update(schedule.settings_dict())
    merged.update({k: v for k, v in hp.items() if k in spec.hyperparameters})
    return ImagePlan(grid_thw=grid_thw, tokens=tokens, removals=schedule.removals,
                     settings=tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in merged.items()),
                     tflops=compute_tera(arch, schedule, opts), vanilla_tokens=arch.visual_tokens,
                     vanilla_tflops=compute_tera(arch, vanilla, opts))
