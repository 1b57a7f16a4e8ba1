"""FiCoCo's hyperparameters on a handle (`ficoco.apply(model, "v", lam=0.5)`), set per handle.

Their defaults are the ones FiCoCo-V's and FiCoCo-L's registry entries state (SPEC.md); this
module only gives them names and types for the adapters that read them. No torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from ficoco.methods.registry import METHODS

_FICOCO = {**METHODS["v"].hyperparameters, **METHODS["l"].hyperparameters}


@dataclass(frozen=True)
class Hyperparameters:
    """FiCoCo's hyperparameters on a handle, defaulting to the paper's (the registry entries of FiCoCo-V
    and -L state them); every one can be set per handle."""

    lam: float = _FICOCO["lam"]  # V filter: vision-aware vs semantic term
    beta: float = _FICOCO["beta"]  # L filter: vision-aware vs task-aware term
    gamma: float = _FICOCO["gamma"]  # L correlate: direct vs indirect term
    eps: float = _FICOCO["eps"]  # quantile of the token-adaptive K
    window: int = _FICOCO["window"]  # V local penalty window
    coefficient: float = _FICOCO["coefficient"]  # V local penalty factor
    equivalent_token: bool = _FICOCO["equivalent_token"]  # V: score with the equivalent token instead of [CLS]


# The paper's values, as the defaults of the algorithm's functions (ficoco.reduction) read them.
PAPER = Hyperparameters()
