"""Which attention kernel every layer ran, recorded in one untimed prefill of a profile row.

For that one forward the recorder watches transformers' attention lookup and torch's SDPA
(`hf_compat.watched_attention_lookups`, `watched_sdpa_calls`) and gives every attention call to the
layer, of the vision tower or the decoder as the family adapter lists them, whose module made it:

- a module that runs one of transformers' implementations ran that one: "sdpa", "eager" (the model
  file's own function, the registry's default), "flash" (a flash-attention implementation, its
  registered name as the backend), "flex", or another registered kernel under its own name;
- a module routed through a function ficoco registered (`hf_compat.ficoco_attention_names`, whatever
  it is called) ran what that function called: the module's own implementation, or torch's SDPA
  directly, "with reads" (`reads`, `via` naming the function); a routed call that called no kernel
  computed the layer's output itself: "probe";
- an SDPA call's backend is what torch's dispatcher picks for those exact arguments
  (`torch._fused_sdp_choice`): flash, efficient, cudnn or math; None where torch does not say.
  An SDPA kernel called at the aten level, not through `torch.nn.functional` (a routed function
  that asks a fused kernel for its softmax normaliser, say), is seen by a dispatch mode and named by
  its op.

Nothing here reads a tensor's values, so nothing synchronises the device; the timed runs are not
recorded (the row's first warm-up is, or one extra forward after the timed runs where none ran).
Measurement only: no method is named here.
"""

from __future__ import annotations

import contextlib
import functools
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from ficoco.models import hf_compat as hf

# torch's SDPBackend names, in the report's words.
SDPA_BACKENDS = {"MATH": "math", "FLASH_ATTENTION": "flash", "EFFICIENT_ATTENTION": "efficient",
                 "CUDNN_ATTENTION": "cudnn", "OVERRIDEABLE": "overrideable"}
# scaled_dot_product_attention's parameters, in order (its positional arguments are bound by them).
SDPA_PARAMETERS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
STAGE_LAYERS = (("vision", "vision_layers"), ("llm", "decoder_layers"))
# The aten ops of SDPA's kernels, called directly (not through torch.nn.functional), and the backend each
# is: by the prefix of the op's name (the CPU flash kernel is `..._flash_attention_for_cpu`).
ATEN_SDPA = "scaled_dot_product_attention"  # the dispatcher's entry: its backend is asked of torch
ATEN_KERNELS = (("_scaled_dot_product_flash_attention", "flash"), ("_flash_attention_forward", "flash"),
                ("_scaled_dot_product_efficient_attention", "efficient"), ("_efficient_attention_forward", "efficient"),
                ("_scaled_dot_product_cudnn_attention", "cudnn"), ("_cudnn_attention_forward", "cudnn"),
                ("_scaled_dot_product_fused_attention_overrideable", "overrideable"),
                ("_scaled_dot_product_attention_math", "math"))

Place = tuple[str, int]  # (stage, layer)


def sdpa_backend(args: Sequence[Any], kwargs: Mapping[str, Any]) -> str | None:
    """The backend torch's dispatcher picks for one `scaled_dot_product_attention(*args, **kwargs)` call
    (flash, efficient, cudnn, math), or None where torch does not say. Reads shapes, dtypes, devices and
    flags, never values."""
    choose = getattr(torch, "_fused_sdp_choice", None)
    if choose is None:
        return None
    call = dict(zip(SDPA_PARAMETERS, args, strict=False)) | dict(kwargs)
    try:
        choice = choose(call["query"], call["key"], call["value"], call.get("attn_mask"), call.get("dropout_p", 0.0),
                        call.get("is_causal", False), scale=call.get("scale"), enable_gqa=call.get("enable_gqa", False))
        from torch.nn.attention import SDPBackend

        return SDPA_BACKENDS.get(SDPBackend(int(choice)).name)
    except (TypeError, ValueError, RuntimeError, KeyError):
        return None


def aten_kernel(op: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> tuple[bool, str | None]:
    """(whether aten op `op` is an SDPA kernel, its backend)."""
    if op == ATEN_SDPA:
        return True, sdpa_backend(args, kwargs)
    backend = next((backend for prefix, backend in ATEN_KERNELS if op.startswith(prefix)), None)
    return backend is not None, backend


class _AtenKernels(TorchDispatchMode):
    """Tells `seen(op, args, kwargs)` of every SDPA kernel that reaches the dispatcher (each op once: the
    mode is off while an op runs, so a kernel's own ops are not seen). It counts nothing (`counts_ops`): a read layer
    runs its fused pass under it as in a timed forward (ficoco.methods.ops.watched)."""

    counts_ops = False

    def __init__(self, seen: Callable[[str, tuple[Any, ...], dict[str, Any]], None]) -> None:
        super().__init__()
        self.seen = seen

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        namespace, _, rest = str(func).partition(".")
        if namespace == "aten" and not hf.unobserved_now():
            self.seen(rest.partition(".")[0], args, kwargs)
        return func(*args, **kwargs)


def implementation_label(name: str | None, is_default: bool) -> str:
    """What a transformers implementation name ran, in the report's words."""
    if is_default or name in (None, "eager", "paged|eager"):
        return "eager"
    if name == "sdpa":
        return "sdpa"
    if name.startswith("flex"):
        return "flex"
    return "flash" if "flash" in name else name


@dataclass(frozen=True)
class KernelCall:
    """One attention call as it ran: the implementation, its backend, and whether the module was routed
    through a function of ficoco's (`via`) that reads beside the kernel."""

    implementation: str
    backend: str | None
    reads: bool
    via: str | None

    def sort_key(self) -> tuple[str, str, bool, str]:
        return self.implementation, self.backend or "", self.reads, self.via or ""


@dataclass
class _Frame:
    """An attention function under way."""

    implementation: str  # implementation_label's word; a routed function's is "probe" until it calls a kernel
    backend: str | None  # a flash implementation's registered name; an SDPA call's backend once it is made
    via: str | None  # the ficoco function's name, when routed
    place: Place | None
    kernels: int = 0  # kernels called inside it


class KernelRecorder:
    """Records, while `recording()` is open, every attention call of the layers `stages` lists
    ({"vision": [layer, ...], "llm": [...]}) by layer; `to_json` gives them joined over consecutive layers."""

    def __init__(self, stages: Mapping[str, Sequence[nn.Module]]) -> None:
        self.stages = {stage: list(layers) for stage, layers in stages.items()}
        # Every module inside a layer belongs to it: the attention module is one of them, whatever its name.
        self._places: dict[int, Place] = {}
        for stage, layers in self.stages.items():
            for index, layer in enumerate(layers):
                for module in layer.modules():
                    self._places.setdefault(id(module), (stage, index))
        self._frames: list[_Frame] = []
        self._running: list[Place] = []  # the layers whose forward is under way (hooks), innermost last
        self._routed: frozenset[str] = frozenset()
        self._inside_sdpa = 0  # torch.nn.functional's SDPA calls under way: their kernels are theirs
        self.calls: Counter[tuple[Place, KernelCall]] = Counter()
        self.recorded = False

    @classmethod
    def for_model(cls, model: nn.Module) -> KernelRecorder:
        """A recorder of `model`'s vision tower and decoder layers, as its family adapter lists them."""
        from ficoco.models import adapter_for

        adapter = adapter_for(model)
        return cls({stage: list(getattr(adapter, attribute, None) or ()) for stage, attribute in STAGE_LAYERS})

    @contextlib.contextmanager
    def recording(self) -> Iterator[KernelRecorder]:
        """Record the attention calls of whatever runs inside (one forward); `recorded` once it ended."""
        self.calls.clear()
        self._frames.clear()
        self._running.clear()
        self._inside_sdpa = 0
        self._routed = hf.ficoco_attention_names()
        hooks = []
        for stage, layers in self.stages.items():
            for index, layer in enumerate(layers):
                place = (stage, index)
                hooks.append(layer.register_forward_pre_hook(functools.partial(self._enter_layer, place)))
                hooks.append(layer.register_forward_hook(functools.partial(self._leave_layer, place), always_call=True))
        try:
            with hf.watched_attention_lookups(self._wrap), hf.watched_sdpa_calls(self._sdpa_call), \
                    _AtenKernels(self._aten_op):
                yield self
            self.recorded = True
        finally:
            for hook in hooks:
                hook.remove()

    # -- while recording ------------------------------------------------------------------------------

    def _enter_layer(self, place: Place, _module: nn.Module, _args: Any) -> None:
        self._running.append(place)

    def _leave_layer(self, place: Place, _module: nn.Module, _args: Any, _output: Any) -> None:
        if self._running and self._running[-1] == place:
            self._running.pop()

    def _place(self, module: Any) -> Place | None:
        """The layer of the module that made a call: its own, else the innermost layer under way."""
        place = self._places.get(id(module))
        if place is None and self._frames:
            place = self._frames[-1].place
        if place is None and self._running:
            place = self._running[-1]
        return place

    def _wrap(self, name: str | None, function: Callable[..., Any], is_default: bool) -> Callable[..., Any]:
        routed = name in self._routed
        label = "probe" if routed else implementation_label(name, is_default)
        backend = name if label not in ("sdpa", "eager", "probe") and name != label else None

        def observed(*args: Any, **kwargs: Any) -> Any:
            module = args[0] if args else kwargs.get("module")
            frame = _Frame(label, backend, name if routed else None, self._place(module))
            self._frames.append(frame)
            try:
                return function(*args, **kwargs)
            finally:
                self._frames.pop()
                self._close(frame)

        return observed

    def _close(self, frame: _Frame) -> None:
        """An attention function returned: it was the kernel itself, unless it called one."""
        if frame.kernels == 0:
            self._count(frame.place, frame.implementation, frame.backend, frame.via)
        if self._frames:
            self._frames[-1].kernels += 1

    @contextlib.contextmanager
    def _sdpa_call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Iterator[None]:
        """One torch.nn.functional SDPA call: its kernel, with the backend torch picks for its arguments."""
        self._sdpa_kernel(sdpa_backend(args, kwargs))
        self._inside_sdpa += 1
        try:
            yield
        finally:
            self._inside_sdpa -= 1

    def _aten_op(self, op: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self._inside_sdpa:
            return  # the kernel of a torch.nn.functional call, counted with it
        is_kernel, backend = aten_kernel(op, args, kwargs)
        if is_kernel:
            self._sdpa_kernel(backend)

    def _sdpa_kernel(self, backend: str | None) -> None:
        top = self._frames[-1] if self._frames else None
        if top is not None and top.implementation == "sdpa" and top.kernels == 0:
            top.backend = top.backend or backend  # transformers' sdpa function: this call is its kernel
            return
        # Called directly: by a routed function, or by a module's own code outside the registry.
        self._count(top.place if top is not None else self._place(None), "sdpa", backend, None)
        if top is not None:
            top.kernels += 1

    def _count(self, place: Place | None, implementation: str, backend: str | None, via: str | None) -> None:
        if place is None:
            return  # outside the tower's and the decoder's layers (a pooling head): not a layer's kernel
        via = via or next((frame.via for frame in reversed(self._frames) if frame.via), None)
        self.calls[(place, KernelCall(implementation, backend, via is not None, via))] += 1

    # -- the record ---------------------------------------------------------------------------------------------

    def per_layer(self) -> dict[Place, Counter[KernelCall]]:
        """Every layer's kernel calls, by kind."""
        layers: dict[Place, Counter[KernelCall]] = {}
        for (place, call), count in self.calls.items():
            layers.setdefault(place, Counter())[call] += count
        return layers

    def to_json(self) -> dict[str, list[dict[str, Any]]]:
        """Per stage, runs of consecutive layers that ran the same kernels the same number of times: one entry
        per kind of call, {"layers": [first, last], "implementation", "backend", "calls_per_layer", "reads",
        "via"}. A layer that called no attention function (a linear-attention layer) has none."""
        per_layer = self.per_layer()
        record: dict[str, list[dict[str, Any]]] = {}
        for stage, layers in self.stages.items():
            runs: list[tuple[int, int, tuple[tuple[KernelCall, int], ...]]] = []
            for index in range(len(layers)):
                calls = per_layer.get((stage, index))
                if not calls:
                    continue
                kinds = tuple(sorted(calls.items(), key=lambda item: item[0].sort_key()))
                if runs and runs[-1][1] == index - 1 and runs[-1][2] == kinds:
                    runs[-1] = (runs[-1][0], index, kinds)
                else:
                    runs.append((index, index, kinds))
            record[stage] = [{"layers": [first, last], "implementation": call.implementation, "backend": call.backend,
                              "calls_per_layer": count, "reads": call.reads, "via": call.via}
                             for first, last, kinds in runs for call, count in kinds]
        return record
