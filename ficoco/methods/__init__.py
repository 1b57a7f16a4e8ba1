"""Visual-token reduction methods: one folder per method, one registry.

``ficoco/methods/<name>/__init__.py`` is a method's spec (`MethodSpec`: where it acts, what it needs,
its defaults, its schedule arithmetic and cost terms) and ``ficoco/methods/<name>/ops.py`` its batched
tensor functions. Shared here: `base` (the spec's types), `needs` (typed `Need`s and the `ProbePlan`
the model adapters read), `common` (torch-free pieces several specs use), `inputs` (the records the
adapters hand a method), `contract` (what a method's ops module offers), `ops` (token operations
several methods share), and `registry` (it collects the specs).

Importing this package imports no torch: the specs are plain data and integer arithmetic that the
accountant reads; a method's ops module is imported on use (`MethodSpec.load()`).
"""

from ficoco.methods.base import Dims, MethodSpec, Need, Step, StepContext, TowerLayout
from ficoco.methods.needs import ProbePlan, TowerProbe
from ficoco.methods.registry import (
    METHODS,
    PRESETS,
    VARIANTS,
    method,
    method_label,
    register_method,
    registered,
    unregister_method,
    variant_label,
)

__all__ = ["METHODS", "PRESETS", "VARIANTS", "Dims", "MethodSpec", "Need", "ProbePlan", "Step", "StepContext",
           "TowerLayout", "TowerProbe", "method", "method_label", "register_method", "registered", "unregister_method",
           "variant_label"]
