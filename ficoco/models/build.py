"""Build a Hugging Face model from a profile: random weights at the exact architecture, or a
local checkpoint with the hub offline."""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ficoco.errors import FicocoError
from ficoco.machine.dtype_choice import DtypeChoice, choose_dtype, dtype_name, parse_dtype
from ficoco.profiles import Profile, load_profile

# Size of the random pool that parameters are filled from: large enough that neighbouring
# rows differ, small enough to draw in milliseconds. Filling 7 B parameters with normal_()
# takes over a minute on two cores; copying pool slices takes seconds.
_POOL_SIZE = 1 << 22


def _is_norm(name: str, module: nn.Module) -> bool:
    return isinstance(module, nn.LayerNorm) or "norm" in type(module).__name__.lower() or "norm" in name


class _Filler:
    """Seeded, fast random values: weights from slices of one normal pool, norms 1, biases 0.

    Parameters must be filled in one fixed order (the model's `named_modules()`, then each
    module's own parameters): each takes the next start in the pool, so the same order gives
    the same weights whether the model is filled at once or materialised module by module.
    """

    def __init__(self, seed: int, std: float) -> None:
        self.generator = torch.Generator().manual_seed(seed)
        self.std = std
        self.pools: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}
        self.offset = 0

    def fill(self, module_name: str, module: nn.Module, name: str, param: torch.Tensor) -> None:
        if param.device.type == "meta":
            raise FicocoError("the model still has meta tensors; build it with real storage first")
        if name == "bias":
            param.zero_()
            return
        if _is_norm(module_name, module) and param.dim() == 1:
            param.fill_(1.0)
            return
        key = (param.dtype, param.device)
        if key not in self.pools:
            values = torch.randn(_POOL_SIZE, generator=self.generator) * self.std
            self.pools[key] = values.to(dtype=param.dtype, device=param.device)
        pool = self.pools[key]
        flat = param.view(-1)
        # Each parameter starts at a different place of the pool (a prime stride), so
        # layers are not copies of each other.
        start = self.offset % _POOL_SIZE
        self.offset += 1_000_003
        done = 0
        while done < flat.numel():
            take = min(flat.numel() - done, _POOL_SIZE - start)
            flat[done:done + take].copy_(pool[start:start + take])
            done += take
            start = 0


def fill_random_(model: nn.Module, *, seed: int = 0, std: float = 0.02) -> None:
    """Seeded, fast random fill: weights from slices of one normal pool, norms 1, biases 0."""
    filler = _Filler(seed, std)
    with torch.no_grad():
        for module_name, module in model.named_modules():
            for name, param in module.named_parameters(recurse=False):
                filler.fill(module_name, module, name, param)


@contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Constructors put their parameters on the meta device (no memory) and compute their
    buffers (rotary tables, position ids) for real, so parameters can be materialised one
    module at a time: a quantized or upcast build then never holds the whole model at the
    width it was constructed in."""
    original = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        original(module, name, param)

    nn.Module.register_parameter = register  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def _materialize_(model: nn.Module, device: str, filler: _Filler,
                  after_module: Callable[[str, nn.Module], None]) -> None:
    """Give every meta parameter real storage (its own dtype) on `device`, filled in the fixed
    order; `after_module(name, module)` runs once a module's own parameters are real."""
    uses = Counter(id(param) for _, param in model.named_parameters(remove_duplicate=False))
    # A tied parameter is materialised once, then shared; only those are remembered, so a
    # quantized layer's unquantized weight is released as soon as it is replaced.
    shared: dict[int, nn.Parameter] = {}
    names = [name for name, _ in model.named_modules()]
    with torch.no_grad():
        for module_name in names:
            module = model.get_submodule(module_name) if module_name else model
            for name, param in list(module.named_parameters(recurse=False)):
                if param.device.type == "meta":
                    key = id(param)
                    if key in shared:
                        param = shared[key]
                    else:
                        storage = torch.empty(param.shape, dtype=param.dtype, device=device)
                        param = nn.Parameter(storage, requires_grad=param.requires_grad)
                        if uses[key] > 1:
                            shared[key] = param
                    module._parameters[name] = param
                # Filled again where it is shared, as fill_random_ does, so both give one model.
                filler.fill(module_name, module, name, param)
            after_module(module_name, module)


def share_decoder_layers_(model: nn.Module, distinct: int) -> None:
    """Give decoder layer i the parameters of layer i mod `distinct` (before they have storage): a decoder deeper
    than memory holds runs at its full depth, every layer at its exact shapes and cost, with `distinct` layers'
    weights in memory. Each layer keeps its own modules (its index in the KV cache, its hooks). A layer whose
    parameters differ in name or shape from the one it would share with (a hybrid decoder's other kind) is
    refused: give a multiple of the decoder's pattern."""
    layers = model.get_decoder().layers
    for index in range(distinct, len(layers)):
        own, source = layers[index], layers[index % distinct]
        theirs = dict(source.named_parameters())
        if {name: p.shape for name, p in own.named_parameters()} != {name: p.shape for name, p in theirs.items()}:
            raise FicocoError(f"distinct_layers={distinct}: decoder layer {index} is not shaped like layer "
                              f"{index % distinct}, whose weights it would share; give a multiple of the decoder's "
                              "pattern of layer kinds")
        for name, param in theirs.items():
            module_name, _, attribute = name.rpartition(".")
            (own.get_submodule(module_name) if module_name else own)._parameters[attribute] = param


def _decoder_linears(model: nn.Module) -> list[list[str]]:
    """Per decoder layer, the names of its plain linear layers."""
    decoder = model.get_decoder()
    prefix = next(name for name, module in model.named_modules() if module is decoder)
    return [[f"{prefix}.layers.{i}.{name}" for name, module in layer.named_modules() if type(module) is nn.Linear]
            for i, layer in enumerate(decoder.layers)]


def apply_upcast_layout_(model: nn.Module, choice: DtypeChoice) -> int:
    """Store the first decoder layers' linear weights in `choice.storage` and compute them in
    `choice.compute` (upcast at every forward); everything else is converted to
    `choice.compute`, one tensor at a time. Returns the number of upcast layers."""
    from ficoco.models.upcast import UpcastScratch, upcast_linear_

    layers = _decoder_linears(model)
    upcast_count = max(0, len(layers) - choice.fp32_layers)
    upcast_names = {name for layer in layers[:upcast_count] for name in layer}
    upcast_weights = {id(model.get_submodule(name).weight) for name in upcast_names}
    converted: dict[int, nn.Parameter] = {}  # a tied parameter stays one parameter
    with torch.no_grad():
        for module in model.modules():
            for name, param in list(module.named_parameters(recurse=False)):
                if param.is_floating_point() and id(param) not in upcast_weights and param.dtype != choice.compute:
                    if id(param) not in converted:
                        converted[id(param)] = nn.Parameter(param.to(choice.compute), requires_grad=False)
                    module._parameters[name] = converted[id(param)]
        for module in model.modules():
            for name, buffer in list(module.named_buffers(recurse=False)):
                if buffer.is_floating_point() and buffer.dtype != choice.compute:
                    module._buffers[name] = buffer.to(choice.compute)
        for name in upcast_names:
            linear = model.get_submodule(name)
            if linear.weight.dtype != choice.storage:
                linear.weight = nn.Parameter(linear.weight.to(choice.storage), requires_grad=False)
    if upcast_names:
        largest = max(model.get_submodule(name).weight.numel() for name in upcast_names)
        scratch = UpcastScratch(choice.compute, largest)
        for name in upcast_names:
            upcast_linear_(model.get_submodule(name), scratch)
    return upcast_count


def time_upcast_ms(model: nn.Module) -> float:
    """The measured time of one forward's weight copies in an upcast layout (0 without one):
    the fixed cost every row pays, vanilla and reduced alike, reported beside them."""
    import time

    from ficoco.models.upcast import UpcastLinear

    layers = [m for m in model.modules() if isinstance(m, UpcastLinear)]
    if not layers:
        return 0.0
    with torch.no_grad():
        layers[0]._ficoco_scratch.weight(max((m.weight for m in layers), key=lambda w: w.numel()))  # first touch
        if layers[0].weight.device.type == "cuda":
            torch.cuda.synchronize(layers[0].weight.device)
        begin = time.perf_counter()
        for layer in layers:
            layer._ficoco_scratch.weight(layer.weight)
        if layers[0].weight.device.type == "cuda":
            torch.cuda.synchronize(layers[0].weight.device)
    return (time.perf_counter() - begin) * 1e3


def _hf_config(profile: Profile) -> Any:
    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoConfig

    data = profile.hf_config_dict()
    model_type = data.pop("model_type")
    try:
        return AutoConfig.for_model(model_type, **data)
    except (StrictDataclassError, ValueError, TypeError) as exc:  # a config class's validators
        raise FicocoError(_refusal(profile, exc)) from None


def _refusal(profile: Profile, exc: Exception) -> str:
    """One line for a config transformers refuses: its config classes' validators, or a model class's
    constructor, name the fault on the last line of a message of several (a strict dataclass's
    "Class validation error for validator ...:" comes first)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    reason = lines[-1] if lines else type(exc).__name__
    for prefix in ("ValueError: ", "TypeError: "):
        reason = reason.removeprefix(prefix)
    return f"transformers refuses the config of {profile.name}: {reason.rstrip('.')}; fix the config (or the override)"


def resolve_dtype(dtype: str | torch.dtype | None, device: str, native: torch.dtype | None = None) -> torch.dtype:
    """The dtype a model computes in, memory aside: an explicit dtype as given; `auto` (or
    None) as `choose_dtype` decides (float16 on a GPU, a checkpoint's own bfloat16, on a CPU
    the fastest measured)."""
    return choose_dtype("auto" if dtype is None else parse_dtype(dtype), torch.device(device), native=native).compute


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
    """Collect garbage and return cached blocks to the GPU and the host heap's free pages to the system
    (machine/host_runtime.py keeps them within a row), so the next peak starts clean."""
    import gc

    from ficoco.machine.host_runtime import release_host_memory

    gc.collect()
    release_host_memory()
    if torch.device(device).type == "cuda" and torch.cuda.is_available():
        torch.cuda.empty_cache()


def _choose(profile: Profile, dtype: str | torch.dtype | DtypeChoice | None, device: str, quant: str,
            native: torch.dtype | None, check_memory: bool, distinct_layers: int | None = None) -> DtypeChoice:
    if isinstance(dtype, DtypeChoice):
        return dtype
    requested = "auto" if dtype is None else parse_dtype(dtype)
    if not check_memory:
        return choose_dtype(requested, torch.device(device), native=native)
    from ficoco.machine.memory_guard import VanillaRow, resolve_dtype_and_memory

    choice, _ = resolve_dtype_and_memory(profile, [VanillaRow()], requested, device, [quant], native=native,
                                         distinct_layers=distinct_layers)
    return choice


def build_model(profile: Profile | str, weights: str = "random", *,
                dtype: str | torch.dtype | DtypeChoice | None = "auto", device: str = "cpu",
                overrides: list[str] | dict[str, Any] | None = None, seed: int = 0,
                attn_implementation: str = "sdpa", quant: str = "fp16", check_memory: bool = True,
                device_map: str | None = None, max_memory: str | dict | None = None, offload_dir: str | None = None,
                distinct_layers: int | None = None, **load_kwargs: Any) -> nn.Module:
    """Build the profile's model.

    `weights="random"` builds the exact architecture with a seeded fast fill (real buffers);
    a local folder loads the checkpoint with `from_pretrained` and the hub offline; any other
    string is taken as a Hugging Face id that must already be in the local cache.
    `dtype` is auto (the default: float16 on a GPU, on a CPU the fastest for it, see
    `choose_dtype`), bf16, fp16, fp32, or a DtypeChoice; with float32 compute on weights that
    do not fit, the decoder's linear weights are stored in bfloat16 and upcast per forward.
    `quant` is fp16 (unquantized weights in `dtype`), int8 (LLM.int8) or int4 (NF4 computing
    in `dtype`), both through bitsandbytes. With `check_memory` the build is refused with a
    FicocoError (and advice) when it would not fit in free memory. The choice is kept on the
    model as `_ficoco_dtype`. `trust_remote_code` stays off.
    `device_map` (auto, balanced, cpu-offload; see ficoco.models.device_map) splits the model across
    devices, CPU memory and disk through accelerate, within `max_memory` ("cpu=200MiB,cuda:0=20GiB" or
    {"cpu": "200MiB", 0: "20GiB"}); disk entries go to `offload_dir` (a temporary folder by default).
    Random weights are built in host memory, then dispatched; a checkpoint is loaded into the map by
    from_pretrained (auto, balanced) or loaded in host memory, then dispatched (cpu-offload). The
    memory guard is then skipped: the map is what fits.
    `distinct_layers` (random weights, unquantized, no map) builds that many decoder layers' weights and lets
    every deeper layer share those of layer i mod N (`share_decoder_layers_`): a decoder deeper than memory at
    its full depth and cost.
    """
    from ficoco.models.quantize import QUANTS, bitsandbytes_config, check_quantized, quantizer

    if quant not in QUANTS:
        raise FicocoError(f"unknown quant '{quant}': choose from {', '.join(QUANTS)}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForImageTextToText

    from ficoco.models import hf_compat as hf

    hf.check_release()  # an untested transformers: one warning line, and a changed contact named

    if isinstance(profile, str):
        profile = load_profile(profile, overrides)
    elif overrides:
        from ficoco.profiles import apply_overrides

        apply_overrides(profile, overrides)
    from ficoco.models import device_map as maps

    policy = maps.check_policy(device_map)
    limits = maps.parse_max_memory(max_memory)
    if policy is not None:
        if quant != "fp16":
            raise FicocoError("device_map= works with unquantized weights (quant fp16); drop quant= or the map")
        device = maps.main_device(policy)
        check_memory = False
    path = Path(weights).expanduser()
    native = checkpoint_dtype(path) if weights != "random" and path.is_dir() else None
    if distinct_layers is not None:
        from ficoco.accounting import architecture
        from ficoco.machine.memory_guard import check_distinct_layers

        check_distinct_layers(architecture(profile), distinct_layers, weights=weights, quants=(quant,),
                              device_map=policy)
    choice = _choose(profile, dtype, device, quant, native, check_memory, distinct_layers)
    if distinct_layers is not None and choice.upcast:
        raise FicocoError("distinct_layers= and an upcast layout do not mix; give dtype=bf16 or fp16")
    if policy is not None and choice.upcast:
        raise FicocoError("device_map= and an upcast layout do not mix; give dtype=bf16, fp16 or fp32")
    upcast = choice.upcast and quant == "fp16"
    # Built in the storage dtype (an upcast layout converts all but its upcast weights after);
    # bitsandbytes replaces the linears, and the rest computes in the compute dtype.
    build_dtype = choice.storage if quant == "fp16" else choice.compute
    if weights == "random":
        config = _hf_config(profile)
        hf.configure_attention(config, attn_implementation)
        # Parameters start on the meta device (no init functions run) and are materialised,
        # filled and (for int8/int4) quantized module by module; buffers such as rotary
        # frequencies are computed by the constructors as usual.
        # Under a device map the weights are made in host memory, then dispatched.
        build_device = "cpu" if policy is not None else device
        with torch.device(build_device), hf.no_init_weights(), _parameters_on_meta():
            try:
                model = AutoModelForImageTextToText.from_config(config, dtype=build_dtype)
            except ValueError as exc:  # a module's constructor refuses the geometry (SiglipAttention's heads)
                raise FicocoError(_refusal(profile, exc)) from None
        if distinct_layers is not None:
            share_decoder_layers_(model, distinct_layers)  # on meta: the shared weights get storage once
        quantize = quantizer(model, quant, compute_dtype=choice.compute)
        _materialize_(model, build_device, _Filler(seed, 0.02), quantize)
        if getattr(model.config, "tie_word_embeddings", False) or getattr(
                model.config.get_text_config(), "tie_word_embeddings", False):
            model.tie_weights()
        info = quantize.info() if quant != "fp16" else {"backend": "torch", "scheme": str(build_dtype)}
        check_quantized(model, quant)
        if policy is not None:
            maps.dispatch(model, policy, limits, offload_dir)
    else:
        source = str(path) if path.exists() else weights
        if path.exists() and not (path / "config.json").is_file():
            raise FicocoError(f"{weights} has no config.json; give a model checkout folder")
        placement: dict[str, Any] = {"device_map": device if device != "cpu" else None}
        if policy in ("auto", "balanced"):
            # Loaded straight into transformers' map of the same name (never whole in host memory).
            placement = {"device_map": policy, "max_memory": limits,
                         "offload_folder": offload_dir or maps.temporary_offload_dir()}
        elif policy == "cpu-offload":
            placement = {"device_map": None}  # whole in host memory, then dispatched below
        try:
            model = AutoModelForImageTextToText.from_pretrained(
                source, dtype=build_dtype, local_files_only=True, trust_remote_code=False,
                attn_implementation=attn_implementation,
                quantization_config=bitsandbytes_config(quant, choice.compute), **placement, **load_kwargs,
            )
        except (OSError, ValueError) as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise FicocoError(f"cannot load '{weights}' offline: {first}") from None
        check_quantized(model, quant)
        info = {"backend": "transformers + bitsandbytes" if quant != "fp16" else "torch", "scheme": quant}
        if policy == "cpu-offload":
            maps.dispatch(model, policy, limits, offload_dir)
        elif policy is not None and getattr(model, "hf_device_map", None):
            hf_map = dict(model.hf_device_map)
            maps.remember_device_map(model, policy, hf_map, maps.weight_bytes_per_device(model, hf_map), device,
                                     limits, placement["offload_folder"])
    if upcast:
        info["upcast_layers"] = apply_upcast_layout_(model, choice)
        info["upcast_ms_per_forward"] = time_upcast_ms(model)
        info["scheme"] = (f"{info['upcast_layers']} decoder layers' linear weights in {dtype_name(choice.storage)}, "
                          f"upcast per forward; the rest in {dtype_name(choice.compute)}")
    model.__dict__["_ficoco_quant"] = {"quant": quant, **info}
    model.__dict__["_ficoco_dtype"] = choice
    release_device_cache(device)
    return _remember_profile(model.eval(), profile)


def _remember_profile(model: nn.Module, profile: Profile) -> nn.Module:
    """Keep the profile's toolkit defaults (first reducing layers, text tokens) on the model,
    so `apply` plans with the same defaults the accountant used."""
    model.__dict__["_ficoco_defaults"] = dict(profile.defaults)
    model.__dict__["_ficoco_profile_name"] = profile.name
    return model
