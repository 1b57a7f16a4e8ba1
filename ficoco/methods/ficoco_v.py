"""FiCoCo-V as a registry entry: the algorithm lives in ficoco.reduction.ficoco_v (SPEC.md).

It acts inside vision-tower layers (after attention, before the MLP) from layer 12 up to the
layer the projector reads; `reduce` is `reduce_v`: filter, correlate and compress ``r``
patches of one layer, batched.
"""

from ficoco.reduction.ficoco_v import reduce_v as reduce
from ficoco.reduction.ficoco_v import vision_correlation, vision_scores

__all__ = ["reduce", "vision_correlation", "vision_scores"]
