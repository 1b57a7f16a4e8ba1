"""How many rows each expert of a sparse decoder layer took, recorded in one untimed prefill of a row.

A sparse layer's experts cost what their routing makes of them: transformers' grouped matmul runs one matmul per
expert that was picked, at its row count, and reads only those experts' weights. A trained router spreads its
rows (its load-balancing loss); a router with random weights does not, and less so the deeper the layer: on
Qwen3-VL-30B-A3B's random build (vanilla, 636 tokens, top 8 of 128) 100 to 110 experts took rows in the first
layers, 25 to 40 in the last, one of them nearly every token. The prediction prices each layer's experts at
the loads the row ran (profiling/predict.py), and the report keeps them, as a row run on random weights reads
fewer expert weights than a checkpoint would.

Values are read after the forward (one count per layer, kept on the device until then): nothing here
synchronises while the model runs. Measurement only: no method is named here.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn


def _experts_module(layer: nn.Module) -> nn.Module | None:
    """A decoder layer's experts (transformers' fused experts: `num_experts` and their stacked weights)."""
    return next((module for module in layer.modules()
                 if isinstance(getattr(module, "num_experts", None), int) and hasattr(module, "gate_up_proj")), None)


class ExpertLoads:
    """Per sparse decoder layer (by index), the rows every expert took in the forward recorded."""

    def __init__(self, layers: list[nn.Module]) -> None:
        self.experts = {index: module for index, layer in enumerate(layers)
                        if (module := _experts_module(layer)) is not None}
        self.loads: dict[int, list[int]] = {}
        self.recorded = False

    @classmethod
    def for_model(cls, model: nn.Module) -> ExpertLoads:
        """A recorder of `model`'s decoder layers, as its family adapter lists them."""
        from ficoco.models import adapter_for

        return cls(list(getattr(adapter_for(model), "decoder_layers", None) or ()))

    @contextlib.contextmanager
    def recording(self) -> Iterator[ExpertLoads]:
        """Record the routing of whatever runs inside (one forward); `loads` once it ended."""
        counts: dict[int, torch.Tensor] = {}

        def hook(index: int, module: nn.Module, args: tuple, kwargs: dict) -> None:
            chosen = kwargs.get("top_k_index", args[1] if len(args) > 1 else None)
            if isinstance(chosen, torch.Tensor):
                chosen = chosen.reshape(-1)
                # A sum by index, not bincount (which reads the largest index back to size its result). One more
                # slot for the index transformers gives a row no expert takes (the expert count), dropped.
                found = torch.zeros(module.num_experts + 1, dtype=torch.long, device=chosen.device).index_add_(
                    0, chosen.long(), torch.ones_like(chosen, dtype=torch.long))[:module.num_experts]
                counts[index] = counts[index] + found if index in counts else found

        hooks = [module.register_forward_pre_hook(functools.partial(hook, index), with_kwargs=True)
                 for index, module in self.experts.items()]
        try:
            yield self
            self.loads = {index: [int(n) for n in found.tolist()] for index, found in sorted(counts.items())}
            self.recorded = True
        finally:
            for handle in hooks:
                handle.remove()

    def to_json(self) -> dict[str, Any] | None:
        """The report's `expert_loads`: per sparse layer, the rows of each expert that took any, most first
        (which expert took them does not change the cost); None for a dense decoder."""
        if not self.loads:
            return None
        active = [sum(1 for n in found if n) for found in self.loads.values()]
        return {"experts": len(next(iter(self.loads.values()))),
                "active_mean": sum(active) / len(active), "active_min": min(active), "active_max": max(active),
                "rows_by_layer": {str(index): sorted((n for n in found if n), reverse=True)
                                  for index, found in self.loads.items()}}


def loads_by_layer(expert_loads: dict[str, Any] | None) -> dict[int, list[int]] | None:
    """`ExpertLoads.to_json`'s rows per layer, as the prediction takes them."""
    if not expert_loads:
        return None
    return {int(index): list(rows) for index, rows in expert_loads["rows_by_layer"].items()}
