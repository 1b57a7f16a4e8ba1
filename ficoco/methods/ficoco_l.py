"""FiCoCo-L as a registry entry: the algorithm lives in ficoco.reduction.ficoco_l (SPEC.md).

It acts inside decoder layers (after attention, before the MLP) from layer 4 on; `reduce` is
`reduce_l`: filter, correlate and compress ``r`` visual tokens of one layer, batched, kept
tokens at their original positions.
"""

from ficoco.reduction.ficoco_l import language_correlation, language_scores
from ficoco.reduction.ficoco_l import reduce_l as reduce

__all__ = ["language_correlation", "language_scores", "reduce"]
