"""Models larger than one device: a device-map policy turned into accelerate's device map, and the
model dispatched by accelerate (layers on several GPUs, weights in CPU memory or on disk).

Nothing here places a module by hand: the map is accelerate's `infer_auto_device_map` (after
`get_balanced_memory` for "balanced"), never splitting the model's `_no_split_modules` (its decoder
and vision layers), and `dispatch_model` attaches the alignment and offload hooks. The reduction's
patches then wrap each hooked module's inner forward (`ficoco.models.patching.forward_of`), so a
patched layer runs on its own device with its weights loaded.
"""

from __future__ import annotations

import re
import shutil
import tempfile
import weakref
from typing import Any

import torch
from torch import nn

from ficoco.errors import FicocoError

POLICIES = ("auto", "balanced", "cpu-offload")

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size_bytes(text: str) -> int:
    """`200MiB`, `1.5GB`, `4096` (bytes) as a number of bytes."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not match or match.group(2).lower() not in _UNITS:
        raise FicocoError(f"memory size '{text}' is not a size; write e.g. 200MiB, 20GiB or 1.5GB")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def parse_max_memory(text: str | dict | None) -> dict[int | str, int] | None:
    """`cpu=200MiB,cuda:0=20GiB` (or a dict) as accelerate's max_memory: {"cpu": bytes, 0: bytes}.
    The disk is unlimited (what does not fit in the devices named goes there)."""
    if text is None or text == "" or text == {}:
        return None
    items = text.items() if isinstance(text, dict) else (
        part.split("=", 1) if "=" in part else (part, None) for part in str(text).split(",") if part.strip())
    limits: dict[int | str, int] = {}
    for device, size in items:
        if size is None:
            raise FicocoError(f"max_memory= entry '{device}' has no size; write DEVICE=SIZE, "
                              "e.g. cpu=200MiB,cuda:0=20GiB")
        limits[_device_key(device)] = size if isinstance(size, int) else parse_size_bytes(size)
    return limits


def _device_key(device: Any) -> int | str:
    """accelerate's key for a device: "cpu", or a GPU's index."""
    if isinstance(device, int):
        return device
    name = str(device).strip().lower()
    if name == "cpu":
        return "cpu"
    match = re.fullmatch(r"(?:cuda:)?([0-9]+)", name)
    if match:
        return int(match.group(1))
    raise FicocoError(f"max_memory= device '{device}' is not one; name cpu or a GPU (cuda:0, cuda:1, ...)")


def check_limits(max_memory: dict[int | str, int] | None) -> None:
    """Refuse limits for a GPU torch does not see (one line)."""
    gpus = _gpu_indices()
    for key in (max_memory or {}):
        if key != "cpu" and key not in gpus:
            raise FicocoError(f"max_memory= names cuda:{key}, but torch sees {len(gpus)} GPU(s)")


def check_policy(policy: str | None) -> str | None:
    """The policy name, or a one-line refusal naming the choices."""
    if policy in (None, "", "none"):
        return None
    if policy not in POLICIES:
        raise FicocoError(f"unknown device_map='{policy}': choose from {', '.join(POLICIES)}")
    return policy


def _gpu_indices() -> list[int]:
    return list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []


def main_device(policy: str) -> str:
    """Where the model computes: the first GPU where there is one, else the CPU (for cpu-offload, the
    weights live in CPU memory or on disk and are brought there per layer)."""
    return "cuda:0" if _gpu_indices() else "cpu"


def no_split_classes(model: nn.Module) -> list[str]:
    """The module classes accelerate must keep whole on one device: the model's own `_no_split_modules`
    (its decoder and vision layers), as transformers' from_pretrained(device_map=...) uses them."""
    from ficoco.models import hf_compat as hf

    return hf.no_split_modules(model)


def device_map_for(model: nn.Module, policy: str, max_memory: dict[int | str, int] | None = None
                   ) -> dict[str, int | str]:
    """accelerate's device map for `model` under `policy` and the limits in `max_memory` (bytes per
    device; devices not named get what accelerate measures free; the disk takes what fits nowhere)."""
    from accelerate.utils import get_balanced_memory, get_max_memory, infer_auto_device_map

    policy = check_policy(policy) or "auto"
    classes = no_split_classes(model)
    gpus = _gpu_indices()
    check_limits(max_memory)
    if policy == "cpu-offload":
        # Weights in CPU memory (and on disk past its limit); the GPUs hold none, they compute.
        limits = {"cpu": (max_memory or {}).get("cpu", get_max_memory()["cpu"])}
    else:
        limits = get_max_memory(dict(max_memory)) if max_memory else get_max_memory()
        if policy == "balanced" and len(gpus) > 1:
            limits = get_balanced_memory(model, max_memory=limits, no_split_module_classes=classes)
    device_map = infer_auto_device_map(model, max_memory=limits, no_split_module_classes=classes)
    if set(device_map) == {""} and device_map[""] == "disk":
        # The whole model on disk: dispatch_model saves disk entries by module name, and the model's
        # own (empty) name saves nothing; the uncleaned map names every module.
        device_map = infer_auto_device_map(model, max_memory=limits, no_split_module_classes=classes,
                                           clean_result=False)
    return dict(device_map)


def weight_bytes_per_device(model: nn.Module, device_map: dict[str, int | str]) -> dict[str, int]:
    """Bytes of parameters and buffers each device of the map holds ("cpu", "disk", "cuda:0", ...)."""
    from accelerate.utils import compute_module_sizes

    sizes = compute_module_sizes(model)
    per_device: dict[str, int] = {}
    for name, device in device_map.items():
        key = device_name(device)
        per_device[key] = per_device.get(key, 0) + int(sizes.get(name, 0))
    return per_device


def device_name(device: int | str | torch.device) -> str:
    """A map entry's device as one name: 0 -> "cuda:0", "cpu", "disk"."""
    return f"cuda:{device}" if isinstance(device, int) else str(device)


def temporary_offload_dir() -> str:
    """A fresh folder for disk-offloaded weights (removed when the process ends)."""
    import atexit

    folder = tempfile.mkdtemp(prefix="ficoco-offload-")
    atexit.register(shutil.rmtree, folder, True)
    return folder


def dispatch(model: nn.Module, policy: str, max_memory: str | dict | None = None,
             offload_dir: str | None = None) -> nn.Module:
    """Dispatch a built model with accelerate under `policy`: the map from `device_map_for`, the hooks
    from `dispatch_model` (disk entries saved under `offload_dir`, a temporary folder removed with the
    model when not given). The decoder and vision layers load all their weights at their own forward
    (preload), so a method reading a layer's weights inside its patched forward sees them. The map is
    kept as `model.hf_device_map` (as accelerate and from_pretrained keep it) and summarised in
    `model._ficoco_device_map`."""
    from accelerate import dispatch_model

    policy = check_policy(policy) or "auto"
    limits = parse_max_memory(max_memory)
    device_map = device_map_for(model, policy, limits)
    weights = weight_bytes_per_device(model, device_map)
    if "disk" in device_map.values() and offload_dir is None:
        offload_dir = tempfile.mkdtemp(prefix="ficoco-offload-")
        weakref.finalize(model, shutil.rmtree, offload_dir, True)  # with the model, or at exit
    compute = main_device(policy)
    dispatch_model(model, device_map=device_map, main_device=compute, offload_dir=offload_dir,
                   preload_module_classes=no_split_classes(model))
    remember_device_map(model, policy, device_map, weights, compute, limits, offload_dir)
    return model


def remember_device_map(model: nn.Module, policy: str, device_map: dict[str, int | str], weights: dict[str, int],
                        compute: str, limits: dict[int | str, int] | None, offload_dir: str | None) -> None:
    """Keep the map and its weights per device on the model (`_ficoco_device_map`), for the report."""
    model.__dict__["_ficoco_device_map"] = {
        "policy": policy, "main_device": compute, "offload_dir": offload_dir,
        "max_memory_bytes": {device_name(k): v for k, v in (limits or {}).items()},
        "modules_per_device": _count(device_map), "weight_bytes_per_device": weights,
        "map": {name: device_name(device) for name, device in device_map.items()},
    }


def _count(device_map: dict[str, int | str]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for device in device_map.values():
        counts[device_name(device)] = counts.get(device_name(device), 0) + 1
    return counts


def summary(model: nn.Module) -> dict[str, Any] | None:
    """The model's device-map summary: ficoco's own (after `dispatch` or build_model(device_map=...)),
    or one made from the `hf_device_map` of a model the user dispatched; None for a model on one
    device."""
    own = model.__dict__.get("_ficoco_device_map")
    if own is not None:
        return own
    device_map = getattr(model, "hf_device_map", None)
    if not device_map or len(set(device_map.values())) < 2 and "disk" not in device_map.values():
        return None
    return {"policy": "user", "main_device": None, "offload_dir": None, "max_memory_bytes": {},
            "modules_per_device": _count(device_map),
            "weight_bytes_per_device": weight_bytes_per_device(model, device_map),
            "map": {name: device_name(device) for name, device in device_map.items()}}


def main_device_of(model: nn.Module) -> torch.device | None:
    """The device a dispatched model computes on first (where its inputs go): ficoco's map's main
    device, or for a map the user made, its first GPU entry (the CPU when it has none), as
    dispatch_model chooses; None for a model on one device."""
    own = model.__dict__.get("_ficoco_device_map")
    if own is not None and own.get("main_device"):
        return torch.device(own["main_device"])
    device_map = getattr(model, "hf_device_map", None)
    if not device_map:
        return None
    gpus = [device for device in device_map.values() if device not in ("cpu", "disk")]
    return torch.device(device_name(gpus[0]) if gpus else "cpu")


def decoder_layer_devices(model: nn.Module) -> list[str]:
    """The device each decoder layer computes on (where its KV cache lives): its map entry's GPU, or
    for a layer whose weights wait in CPU memory or on disk, the device they are brought to (the main
    device: the first GPU in the map, else the CPU, as dispatch_model chooses)."""
    device_map = getattr(model, "hf_device_map", None) or {}
    decoder = model.get_decoder()
    prefix = next(name for name, module in model.named_modules() if module is decoder) + ".layers"
    summary_ = model.__dict__.get("_ficoco_device_map") or {}
    gpus = sorted({device for device in device_map.values() if isinstance(device, int)})
    compute = summary_.get("main_device") or (f"cuda:{gpus[0]}" if gpus else "cpu")
    devices = []
    for index in range(len(decoder.layers)):
        name = f"{prefix}.{index}"
        owner = next((key for key in sorted(device_map, key=len, reverse=True)
                      if key == "" or name == key or name.startswith(key + ".")), None)
        where = device_name(device_map[owner]) if owner is not None else compute
        devices.append(compute if where in ("cpu", "disk") else where)
    return devices
