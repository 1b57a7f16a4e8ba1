"""The runner's half of the kept tokens' positions (knows vLLM's model runners).

vLLM recomputes a prompt's M-RoPE positions after the encoder ran (`recompute_mrope_positions`, the positions
carried in the embeddings' extra channels) only where its runner's `is_multimodal_pruning_enabled` is set: the
GPU runner sets it for its own video pruning alone, the CPU runner never. A model that reduces images says so
(`ficoco_reduces_images`), and the runner's `load_model` is wrapped to set the flag for it.
"""

from __future__ import annotations

import functools
from typing import Any

_WRAPPED = "_ficoco_positions"


def _wrap(cls: type) -> None:
    if "load_model" not in cls.__dict__ or getattr(cls.__dict__["load_model"], _WRAPPED, False):
        return
    original = cls.__dict__["load_model"]

    @functools.wraps(original)
    def load_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        if getattr(self.get_model(), "ficoco_reduces_images", False):
            self.is_multimodal_pruning_enabled = True
        return result

    setattr(load_model, _WRAPPED, True)
    cls.load_model = load_model


def enable_positions() -> None:
    """Wrap the GPU and CPU model runners' `load_model` (each defines its own); a runner vLLM lacks is skipped."""
    try:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    except ImportError:
        return
    _wrap(GPUModelRunner)
    try:
        from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    except ImportError:
        return
    _wrap(CPUModelRunner)
