"""Visual-token reduction methods: one module of tensor functions per method, one registry.

Importing this package imports no torch: `registry` and `base` are plain data and integer
arithmetic that the accountant reads; each method's tensor module is imported on use
(`MethodSpec.load()`).
"""

from ficoco.methods.base import Dims, MethodSpec, Need, Step, StepContext
from ficoco.methods.registry import (
    METHODS,
    PRESETS,
    VARIANTS,
    method,
    register_method,
    registered,
    unregister_method,
)

__all__ = ["METHODS", "PRESETS", "VARIANTS", "Dims", "MethodSpec", "Need", "Step", "StepContext", "method",
           "register_method", "registered", "unregister_method"]
