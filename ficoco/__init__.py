"""ficoco: FiCoCo visual-token reduction for multimodal LLMs, made measurable.

Importing the package is cheap and never imports torch: the accounting path
(`ficoco flops`) must start in well under a second. The model-facing API
(`build_model`, `apply`) is loaded on first use.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

__all__ = ["__version__", "FicocoError", "apply", "build_model", "quantized_cache"]

from ficoco.errors import FicocoError

_LAZY = {"build_model": "ficoco.api", "apply": "ficoco.api", "quantized_cache": "ficoco.models.kv_cache"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'ficoco' has no attribute {name!r}")
