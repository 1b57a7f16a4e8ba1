"""fp32 compute on 16-bit weights: a linear layer that upcasts its weight at every forward.

On a CPU without native 16-bit matrix units (AVX2 alone) float32 matmuls run four to five
times faster than bfloat16 ones, but a 7B model's float32 weights need 28 GB. Storing the
decoder's linear weights in bfloat16 and copying each into a float32 scratch buffer just
before its matmul computes exactly what float32 weights of the same values would (every
bfloat16 value is a float32 value), at the cost of one copy per layer and forward.

The scratch buffer is one per model and device, sized to the largest upcast weight: layers
run one after another, so they take turns. Inference only: autograd would see the buffer
change under a saved tensor (and says so at backward time).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class UpcastScratch:
    """The float32 buffer that upcast layers share, allocated on first use per device."""

    def __init__(self, dtype: torch.dtype, numel: int) -> None:
        self.dtype = dtype
        self.numel = numel
        self._buffers: dict[torch.device, torch.Tensor] = {}

    def weight(self, stored: torch.Tensor) -> torch.Tensor:
        """`stored` copied into the buffer, in the compute dtype, with its shape."""
        buffer = self._buffers.get(stored.device)
        if buffer is None:
            buffer = self._buffers[stored.device] = torch.empty(self.numel, dtype=self.dtype, device=stored.device)
        return buffer[:stored.numel()].view(stored.shape).copy_(stored)

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=self.dtype).element_size()


class UpcastLinear(nn.Linear):
    """nn.Linear whose weight is stored in 16 bits and multiplied in the scratch's dtype."""

    _ficoco_scratch: UpcastScratch

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 - nn.Linear's own name
        return F.linear(input, self._ficoco_scratch.weight(self.weight), self.bias)


def compute_weight(linear: nn.Module) -> torch.Tensor:
    """`linear`'s weight in the dtype its forward multiplies in: an upcast layer's weight through the scratch, any
    other's as it is (for code that applies a layer's weight itself, such as a method's recomputed row)."""
    if isinstance(linear, UpcastLinear):
        return linear._ficoco_scratch.weight(linear.weight)
    return linear.weight


def upcast_linear_(linear: nn.Linear, scratch: UpcastScratch) -> None:
    """Turn `linear` (weight already in 16 bits, bias in the compute dtype) into an upcast layer."""
    if type(linear) is not nn.Linear:
        raise TypeError(f"only plain nn.Linear layers are upcast, not {type(linear).__name__}")
    if linear.weight.numel() > scratch.numel:
        raise ValueError(f"the scratch buffer holds {scratch.numel} values, the weight {linear.weight.numel()}")
    linear.__class__ = UpcastLinear
    # Not a buffer: it is working memory, not part of the model's weights or state dict.
    linear.__dict__["_ficoco_scratch"] = scratch


def upcast_layers(model: nn.Module) -> list[str]:
    """Names of the model's upcast linear layers."""
    return [name for name, module in model.named_modules() if isinstance(module, UpcastLinear)]
