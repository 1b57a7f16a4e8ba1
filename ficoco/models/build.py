"""Build a Hugging Face model from a profile: random weights at the exact architecture, or a
local checkpoint with the hub offline."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ficoco.errors import FicocoError
from ficoco.profiles import Profile, load_profile

# Size of the random pool that parameters are filled from: large enough that neighbouring
# rows differ, small enough to draw in milliseconds. Filling 7 B parameters with normal_()
# takes over a minute on two cores; copying pool slices takes seconds.
_POOL_SIZE = 1 << 22


def _is_norm(name: str, module: nn.Module) -> bool:
    return isinstance(module, nn.LayerNorm) or "norm" in type(module).__name__.lower() or "norm" in name


def fill_random_(model: nn.Module, *, seed: int = 0, std: float = 0.02) -> None:
    """Seeded, fast random fill: weights from slices of one normal pool, norms 1, biases 0."""
    generator = torch.Generator().manual_seed(seed)
    pools: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}
    offset = 0
    with torch.no_grad():
        for module_name, module in model.named_modules():
            for name, param in module.named_parameters(recurse=False):
                if param.device.type == "meta":
                    raise FicocoError("the model still has meta tensors; build it with real storage first")
                if name == "bias":
                    param.zero_()
                    continue
                if _is_norm(module_name, module) and param.dim() == 1:
                    param.fill_(1.0)
                    continue
                key = (param.dtype, param.device)
                if key not in pools:
                    values = torch.randn(_POOL_SIZE, generator=generator) * std
                    pools[key] = values.to(dtype=param.dtype, device=param.device)
                pool = pools[key]
                flat = param.view(-1)
                # Each parameter starts at a different place of the pool (a prime stride), so
                # layers are not copies of each other.
                start = offset % _POOL_SIZE
                offset += 1_000_003
                done = 0
                while done < flat.numel():
                    take = min(flat.numel() - done, _POOL_SIZE - start)
                    flat[done:done + take].copy_(pool[start:start + take])
                    done += take
                    start = 0


def _hf_config(profile: Profile) -> Any:
    from transformers import AutoConfig

    data = profile.hf_config_dict()
    model_type = data.pop("model_type")
    return AutoConfig.for_model(model_type, **data)


def resolve_dtype(dtype: str | torch.dtype | None, device: str, native: torch.dtype | None = None) -> torch.dtype:
    """The dtype a model is built in. `fp16` on CPU computes in bf16 (fp16 matrix work is ~15x
    slower there). With no dtype given, a checkpoint stored in bf16 stays bf16 (Qwen2-VL's
    activations overflow fp16); otherwise fp16 on a GPU, bf16 on CPU."""
    if isinstance(dtype, torch.dtype):
        return dtype
    names = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
             "fp16": torch.float16, "float16": torch.float16}
    if dtype is None:
        if native == torch.bfloat16 or device == "cpu":
            return torch.bfloat16
        return torch.float16
    if dtype not in names:
        raise FicocoError(f"unknown dtype '{dtype}': choose from {', '.join(names)}")
    resolved = names[dtype]
    if resolved == torch.float16 and device == "cpu":
        return torch.bfloat16
    return resolved


def checkpoint_dtype(path: Path) -> torch.dtype | None:
    """The dtype a local checkpoint's config.json says its weights are stored in."""
    import json

    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return None
    text = config.get("dtype") or config.get("torch_dtype") or (config.get("text_config") or {}).get("torch_dtype")
    return {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}.get(str(text))


def release_device_cache(device: str | torch.device) -> None:
    """Collect garbage and return cached blocks to the GPU, so the next peak starts clean."""
    import gc

    gc.collect()
    if torch.device(device).type == "cuda" and torch.cuda.is_available():
        torch.cuda.empty_cache()


def build_model(profile: Profile | str, weights: str = "random", *, dtype: str | torch.dtype | None = None,
                device: str = "cpu", overrides: list[str] | dict[str, Any] | None = None, seed: int = 0,
                attn_implementation: str = "sdpa", quant: str = "fp16", **load_kwargs: Any) -> nn.Module:
    """Build the profile's model.

    `weights="random"` builds the exact architecture with a seeded fast fill (real buffers);
    a local folder loads the checkpoint with `from_pretrained` and the hub offline; any other
    string is taken as a Hugging Face id that must already be in the local cache.
    `quant` is fp16 (16-bit weights), int8 (LLM.int8) or int4 (NF4 with 16-bit compute), all
    through bitsandbytes. `trust_remote_code` stays off.
    """
    from ficoco.models.quantize import QUANTS, bitsandbytes_config, check_quantized, quantize_linears_

    if quant not in QUANTS:
        raise FicocoError(f"unknown quant '{quant}': choose from {', '.join(QUANTS)}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForImageTextToText
    from transformers.initialization import no_init_weights

    if isinstance(profile, str):
        profile = load_profile(profile, overrides)
    elif overrides:
        from ficoco.profiles import apply_overrides

        apply_overrides(profile, overrides)
    path = Path(weights).expanduser()
    native = checkpoint_dtype(path) if weights != "random" and path.is_dir() else None
    torch_dtype = resolve_dtype(dtype, device, native)
    if weights == "random":
        config = _hf_config(profile)
        config._attn_implementation = attn_implementation
        # Parameters are allocated uninitialised (no init functions run) and filled below;
        # buffers such as rotary frequencies are computed by the constructors as usual.
        with torch.device(device), no_init_weights():
            model = AutoModelForImageTextToText.from_config(config, dtype=torch_dtype)
        fill_random_(model, seed=seed)
        if getattr(model.config, "tie_word_embeddings", False) or getattr(
                model.config.get_text_config(), "tie_word_embeddings", False):
            model.tie_weights()
        info = {"backend": "torch", "scheme": str(torch_dtype)}
        if quant != "fp16":
            info = quantize_linears_(model, quant, compute_dtype=torch_dtype)
        model.__dict__["_ficoco_quant"] = {"quant": quant, **info}
        release_device_cache(device)
        return _remember_profile(model.eval(), profile)
    source = str(path) if path.exists() else weights
    if path.exists() and not (path / "config.json").is_file():
        raise FicocoError(f"{weights} has no config.json; give a model checkout folder")
    try:
        model = AutoModelForImageTextToText.from_pretrained(
            source, dtype=torch_dtype, local_files_only=True, trust_remote_code=False,
            attn_implementation=attn_implementation, device_map=device if device != "cpu" else None,
            quantization_config=bitsandbytes_config(quant, torch_dtype), **load_kwargs,
        )
    except (OSError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise FicocoError(f"cannot load '{weights}' offline: {first}") from None
    check_quantized(model, quant)
    model.__dict__["_ficoco_quant"] = {"quant": quant, "backend": "transformers + bitsandbytes" if quant != "fp16"
                                       else "torch", "scheme": quant}
    release_device_cache(device)
    return _remember_profile(model.eval(), profile)


def _remember_profile(model: nn.Module, profile: Profile) -> nn.Module:
    """Keep the profile's toolkit defaults (first reducing layers, text tokens) on the model,
    so `apply` plans with the same defaults the accountant used."""
    model.__dict__["_ficoco_defaults"] = dict(profile.defaults)
    model.__dict__["_ficoco_profile_name"] = profile.name
    return model
