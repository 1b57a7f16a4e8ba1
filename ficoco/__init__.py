"""ficoco: FiCoCo visual-token reduction for multimodal LLMs, made measurable.

Importing the package is cheap and never imports torch: the accounting path
(`ficoco flops`, `ficoco.flops(...)`) must start in well under a second. The model-facing API
(`build_model`, `apply`, `profile`) is loaded on first use. `flops` and `profile` return the
reports the CLI writes (`ficoco.report`).

The typed requests: `ScheduleRequest` (at most one of keep / preset / tflops / schedule, with shape
and first layer), taken whole by `flops`, `apply` and `profile` as `request=` (their keywords of the
same names spell one), and `ProfileConfig`, the one record of a profile run:
`ficoco.profile(ficoco.ProfileConfig(model="llava-tiny", variants=("vanilla", "v"), keep=8))`
or `ficoco.profile("llava-tiny", "v", keep=8)`.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

__all__ = ["__version__", "FicocoError", "ProfileConfig", "ScheduleRequest", "apply", "build_model", "flops", "profile",
           "quantized_cache"]

from ficoco.deferred_imports import defer_hqq
from ficoco.errors import FicocoError

# Before transformers is imported through ficoco: hqq's quantizer loads at a quantized cache's first use, not at
# every model build (ficoco.deferred_imports says why).
defer_hqq()

_LAZY = {"build_model": "ficoco.api", "apply": "ficoco.api", "quantized_cache": "ficoco.models.kv_cache",
         "ScheduleRequest": "ficoco.accounting.request", "ProfileConfig": "ficoco.profiling.config"}
# The report builders, under the names a user calls: ficoco.flops(...), ficoco.profile(...).
_LAZY_AS = {"flops": ("ficoco.report.flops", "flops_report"), "profile": ("ficoco.report.profile", "profile_report")}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    if name in _LAZY_AS:
        import importlib

        module, attribute = _LAZY_AS[name]
        return getattr(importlib.import_module(module), attribute)
    raise AttributeError(f"module 'ficoco' has no attribute {name!r}")
