"""Model and hardware profiles: read `profiles/`, a `config.json`, or a local checkout.

A model profile is a Hugging Face `config.json` content plus a `ficoco` section of toolkit
defaults (text tokens, first reducing layers, visual tokens per image). No torch here: the
accountant runs on these dicts alone.
"""

from __future__ import annotations

import copy
import json
import math
import os
import re
from pathlib import Path
from typing import Any

from ficoco.accounting.architecture import architecture
from ficoco.accounting.families import FAMILIES
from ficoco.errors import FicocoError
from ficoco.profile_records import MAX_COUNT, Hardware, Profile  # noqa: F401  (their home before)

# profiles/ sits at the repository root beside the package (editable install);
# FICOCO_PROFILES points elsewhere when the package is installed on its own.
PROFILES_DIR = Path(os.environ.get("FICOCO_PROFILES", Path(__file__).resolve().parent.parent / "profiles"))
HARDWARE_DIR = PROFILES_DIR / "hardware"

# Families the toolkit knows, by the config's model_type, with the defaults used when a plain
# config.json (no ficoco section) is given: each family's shape module's (ficoco.accounting.families).
# First reducing layers (ficoco.first_reducing_layer.NAME) default to each method's registry entry
# (its `first_layer` hyperparameter).
FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {name: family.profile_defaults for name, family in FAMILIES.items()}


def list_profiles() -> list[str]:
    """Names of the model profiles shipped in `profiles/`."""
    return sorted(p.stem for p in PROFILES_DIR.glob("*.json"))


def list_gpus() -> list[str]:
    """Names of the hardware profiles in `profiles/hardware/`."""
    return sorted(p.stem for p in HARDWARE_DIR.glob("*.json"))


def _read_json(path: Path) -> dict[str, Any]:
    try:
        with open(path) as f:
            data = json.load(f)
    except json.JSONDecodeError as exc:
        raise FicocoError(f"{path} is not valid JSON ({exc.msg} at line {exc.lineno}); fix or replace it") from None
    except UnicodeDecodeError:
        raise FicocoError(f"{path} is not a text file (a binary or compressed file?); give a config.json") from None
    except OSError as exc:
        raise FicocoError(f"cannot read {path}: {exc.strerror}") from None
    if not isinstance(data, dict):
        raise FicocoError(f"{path} does not hold a JSON object; expected a Hugging Face config.json")
    return data


# The families whose image processor resizes within pixel bounds (Qwen2-VL's smart resize), and the files a
# checkpoint keeps its processor's settings in (transformers 5 may nest them in processor_config.json).
_PIXEL_BOUNDED = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5")
_PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")


def processor_pixel_bounds(folder: Path, model_type: str | None) -> dict[str, int]:
    """The checkpoint's own image processor bounds in `folder` as profile defaults (`min_pixels`, `max_pixels`),
    so that the accountant resizes an image as the checkpoint's processor does (Qwen2.5-VL's checkpoints allow
    12,845,056 pixels where the family's default processor stops at 1,003,520); {} where the folder says nothing.
    Legacy `min_pixels` / `max_pixels` keys win over `size`, as in transformers' processor."""
    if model_type not in _PIXEL_BOUNDED:
        return {}
    for file in _PROCESSOR_FILES:
        path = folder / file
        if not path.is_file():
            continue
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(data.get("image_processor"), dict):
            data = data["image_processor"]
        size = data.get("size") if isinstance(data.get("size"), dict) else {}
        bounds = {"min_pixels": data.get("min_pixels", size.get("shortest_edge")),
                  "max_pixels": data.get("max_pixels", size.get("longest_edge"))}
        if all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in bounds.values()):
            return bounds
    return {}


def load_profile(model: str, overrides: list[str] | dict[str, Any] | None = None) -> Profile:
    """Load a profile by name, by a path to a `config.json`, or by a local checkout folder.

    `overrides` are `KEY=VALUE` strings (or a dict) applied to the Hugging Face config with
    dotted keys, e.g. `text_config.num_hidden_layers=4`.
    """
    path = Path(model).expanduser()
    hint = f"give a profile name ({', '.join(list_profiles())}), a config.json or a checkout folder"
    if not model.strip():
        raise FicocoError(f"model= is empty; {hint}")
    if (PROFILES_DIR / f"{model}.json").is_file() and os.sep not in model:
        path, name = PROFILES_DIR / f"{model}.json", model
    elif path.is_dir():
        if not (path / "config.json").is_file():
            raise FicocoError(f"model={model} is a folder without a config.json; give a model checkout folder")
        path, name = path / "config.json", path.name
    elif path.is_file():
        name = path.parent.name if path.name == "config.json" else path.stem
    else:
        raise FicocoError(f"unknown model='{model}': {hint}")
    data = _read_json(path)
    defaults = data.pop("ficoco", None)
    model_type = data.get("model_type")
    if model_type not in FAMILY_DEFAULTS:
        supported = ", ".join(FAMILY_DEFAULTS)
        raise FicocoError(f"{path}: model_type '{model_type}' is not a supported family ({supported})")
    merged = copy.deepcopy(FAMILY_DEFAULTS[model_type])
    merged.update(processor_pixel_bounds(path.parent, model_type))
    merged.update(defaults or {})
    profile = Profile(name=name, config=data, defaults=merged, source=str(path))
    if overrides:
        apply_overrides(profile, overrides)
    return profile


# An override's key is a dotted path of config names: text_config.num_hidden_layers.
_KEY_PART = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# Keys that choose the family: the rest of the config and the toolkit's defaults follow from them.
_FIXED_KEYS = ("model_type", "ficoco.family")


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """Parse `KEY=VALUE` strings; VALUE is read as JSON when it parses, else as a string.

    Each item is checked as it is read (a later item with the same key must not hide a bad one):
    KEY is dotted config names, and a number in VALUE is finite.
    """
    parsed: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise FicocoError(f"overrides='{item}' is not KEY=VALUE (e.g. overrides=text_config.num_hidden_layers=4)")
        try:
            value = json.loads(raw)
        except ValueError:  # not JSON (or an integer too long for Python to read): the text itself
            value = raw
        _check_override(key.strip(), value)
        parsed[key.strip()] = value
    return parsed


def _shown(key: str, value: Any) -> str:
    return f"overrides={key}={value if isinstance(value, str) else json.dumps(value)}"


def _check_override(key: str, value: Any) -> None:
    """A key of config names that the toolkit lets change, and a finite value."""
    parts = key.split(".")
    if not all(_KEY_PART.fullmatch(part) for part in parts):
        raise FicocoError(f"{_shown(key, value)}: KEY must be dotted config names (e.g. text_config.hidden_size)")
    if key in _FIXED_KEYS:
        raise FicocoError(f"{_shown(key, value)}: {key} chooses the model family; give a config of that family "
                          "with model= instead")
    if parts == ["ficoco"]:
        raise FicocoError(f"{_shown(key, value)}: set a key inside the ficoco section (e.g. ficoco.text_tokens=32)")
    if not _finite(value):
        raise FicocoError(f"{_shown(key, value)}: give a finite number")


def _finite(value: Any) -> bool:
    """False when a number in VALUE is NaN or infinite (JSON's NaN, Infinity and 1e400 read as such)."""
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, list):
        return all(_finite(v) for v in value)
    if isinstance(value, dict):
        return all(_finite(v) for v in value.values())
    return True


def _kind(value: Any) -> str | None:
    """What a config value is, in words (None: unset, any value may replace it)."""
    if value is None:
        return None
    for kind, name in ((bool, "true or false"), (int, "a whole number"), (float, "a number"), (str, "a string"),
                       (list, "a list"), (dict, "a section")):
        if isinstance(value, kind):
            return name
    return type(value).__name__


def _check_same_kind(key: str, value: Any, current: Any) -> None:
    """A value of the kind the config holds there (a whole number may stand for a number)."""
    have, given = _kind(current), _kind(value)
    if have is None or have == given or (have == "a number" and given == "a whole number"):
        return
    if have == "a section":
        raise FicocoError(f"{_shown(key, value)}: {key} is a section of the config; set a key inside it "
                          f"({key}.KEY=VALUE)")
    raise FicocoError(f"{_shown(key, value)}: the config holds {have} there ({json.dumps(current)}); give {have}")


def _unreadable(profile: Profile) -> str | None:
    """Why the accountant cannot read the profile, or None when it can."""
    try:
        architecture(profile)
    except FicocoError as exc:
        return str(exc)
    return None


def apply_overrides(profile: Profile, overrides: list[str] | dict[str, Any]) -> None:
    """Set dotted keys in the profile's config; `ficoco.KEY` sets a toolkit default.

    Each value is checked where it enters: a key of config names, a finite value of the kind the
    config holds there, and a config that still reads as a model (an override that makes it
    unreadable is named in the error; a config that was unreadable before is left to report itself).
    """
    values = parse_overrides(overrides) if isinstance(overrides, list) else dict(overrides)
    readable_before = _unreadable(profile) is None
    for key, value in values.items():
        _check_override(key, value)
        parts = key.split(".")
        target: dict[str, Any] = profile.defaults if parts[0] == "ficoco" else profile.config
        if parts[0] == "ficoco":
            parts = parts[1:]
        for part in parts[:-1]:
            node = target.get(part)
            if node is None:
                node = target[part] = {}
            if not isinstance(node, dict):
                raise FicocoError(f"{_shown(key, value)}: '{part}' is not a section of the config")
            target = node
        _check_same_kind(key, value, target.get(parts[-1]))
        target[parts[-1]] = value
        profile.overrides[key] = value
    problem = _unreadable(profile) if readable_before else None
    if problem is not None:
        shown = " ".join(_shown(key, value) for key, value in values.items())
        raise FicocoError(f"{shown}: {problem}")


def set_layout(profile: Profile, *, image_size: tuple[int, int] | None = None, frames: int | None = None) -> None:
    """Record the input layout (image size (H, W), video frames) in the profile's defaults, so
    that the accountant, the built model and `apply` all plan for the same input."""
    family = FAMILIES.get(profile.family)
    if image_size is not None:
        if family is None or not family.takes_image_size:
            raise FicocoError(f"image_size= applies to {_families_that('takes_image_size')} models, "
                              f"not {profile.family}")
        if frames is not None and family.image_or_video:
            raise FicocoError(f"give image_size= (an image) or frames= (a video) for {profile.family}, not both")
        profile.defaults["image_size"] = [int(image_size[0]), int(image_size[1])]
        if family.image_or_video:
            profile.defaults.pop("frames", None)  # an image now, not the video an earlier layout set
    if frames is not None:
        if family is None or not family.takes_frames:
            raise FicocoError(f"frames= applies to {_families_that('takes_frames')} models, not {profile.family}")
        if frames < 1:
            raise FicocoError(f"frames={frames} must be at least 1")
        profile.defaults["frames"] = int(frames)


def _families_that(takes: str) -> str:
    """The families whose shape module takes an input (`takes_image_size`, `takes_frames`), in words."""
    names = [name for name, family in FAMILIES.items() if getattr(family, takes)]
    return f"{', '.join(names[:-1])} and {names[-1]}" if len(names) > 1 else names[0]


def gpu_key(name: str) -> str:
    """A GPU's name as its hardware profile is named: `A100 80GB` -> `a100-80gb`."""
    return name.lower().replace(" ", "-").replace("_", "-")


def load_gpu(name: str) -> Hardware:
    """Load a hardware profile by its name (e.g. `a100-80gb`, `h100-sxm`)."""
    key = gpu_key(name)
    path = HARDWARE_DIR / f"{key}.json"
    if not path.is_file():
        raise FicocoError(f"unknown GPU '{name}': choose one of {', '.join(list_gpus())}")
    data = _read_json(path)
    return Hardware(
        key=key,
        name=data["name"],
        bandwidth_bytes_per_s=float(data["bandwidth_bytes_per_s"]),
        fp16_ops_per_s=float(data["fp16_ops_per_s"]),
        int8_ops_per_s=float(data["int8_ops_per_s"]),
        memory_bytes=float(data["memory_bytes"]),
    )
