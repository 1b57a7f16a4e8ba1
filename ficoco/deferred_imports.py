"""hqq's quantizer, imported where a quantized KV cache first uses it rather than wherever transformers is.

transformers' `cache_utils` runs `from hqq.core.quantize import Quantizer` at its own import whenever hqq is
installed (hqq is a ficoco dependency: the quantized KV cache of `--kv-bits`), and hqq's module applies
`torch.compile` decorators at its import, which load torch._dynamo and the inductor: 2.5 s of every process
that builds a model on an idle 2-core machine (5 s beside other work), used only by a run with a quantized cache.

`defer_hqq()` puts a stand-in for `hqq.core.quantize` in `sys.modules` until then: `Quantizer` is a handle
that imports the real module at its first attribute (transformers calls `Quantizer.quantize` and `.dequantize`
as static methods), and any other name imports it at once (transformers' `HQQLinear` and
`BaseQuantizeConfig`). Once imported, the real module replaces the stand-in. Nothing here imports torch.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from typing import Any

HQQ_QUANTIZE = "hqq.core.quantize"


class _DeferredModule(types.ModuleType):
    """A module imported at the first use of one of its names (but those in `handles`, given as handles)."""

    def __init__(self, name: str, handles: tuple[str, ...]) -> None:
        super().__init__(name)
        self.__dict__["_handles"] = {attribute: _Handle(self, attribute) for attribute in handles}

    def load(self) -> types.ModuleType:
        """The real module, imported now if it was not."""
        module = sys.modules.get(self.__name__)
        if module is None or module is self:
            sys.modules.pop(self.__name__, None)
            try:
                module = importlib.import_module(self.__name__)
            except BaseException:
                sys.modules.setdefault(self.__name__, self)
                raise
        return module

    def __getattr__(self, attribute: str) -> Any:
        handles = self.__dict__["_handles"]
        if attribute in handles:
            return handles[attribute]
        if attribute.startswith("__") and attribute.endswith("__"):
            # What walks sys.modules for a module's __file__ (inspect.getmodule) does not import it.
            raise AttributeError(attribute)
        return getattr(self.load(), attribute)


class _Handle:
    """One name of a deferred module: the module is imported at the handle's first attribute or call."""

    def __init__(self, module: _DeferredModule, name: str) -> None:
        self._module, self._name = module, name

    def _target(self) -> Any:
        return getattr(self._module.load(), self._name)

    def __getattr__(self, attribute: str) -> Any:
        return getattr(self._target(), attribute)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._target()(*args, **kwargs)

    def __repr__(self) -> str:
        return f"<deferred {self._module.__name__}.{self._name}>"


def defer_hqq() -> bool:
    """Put the stand-in for `hqq.core.quantize` in place, where hqq is installed and neither it nor transformers'
    cache module is imported yet. Returns whether it did."""
    if HQQ_QUANTIZE in sys.modules or "transformers.cache_utils" in sys.modules:
        return False
    if importlib.util.find_spec("hqq") is None:
        return False
    sys.modules[HQQ_QUANTIZE] = _DeferredModule(HQQ_QUANTIZE, handles=("Quantizer",))
    return True
