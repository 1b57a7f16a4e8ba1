"""The profile records: a model's (a Hugging Face config dict and the toolkit's defaults) and a GPU's.

The accountant reads it (ficoco.accounting.architecture); the loader that builds and checks one
(ficoco.profiles) reads the accountant in turn, to refuse an override that leaves a config it cannot
read. The record lives below both, so neither imports the other back. No torch here.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

# The largest count (layers, widths, tokens, frames) a config or an option may give: far above any
# real model, and small enough that every analytic cost stays a finite float.
MAX_COUNT = 2**31 - 1


@dataclass
class Profile:
    """A model profile: the Hugging Face config dict and the toolkit's defaults."""

    name: str
    config: dict[str, Any]
    defaults: dict[str, Any]
    source: str = ""
    overrides: dict[str, Any] = field(default_factory=dict)

    @property
    def family(self) -> str:
        return self.defaults["family"]

    def hf_config_dict(self) -> dict[str, Any]:
        """The config as Hugging Face reads it (the ficoco section removed)."""
        return copy.deepcopy(self.config)


@dataclass(frozen=True)
class Hardware:
    """A GPU's peak figures as LLM-Viewer's roofline uses them."""

    key: str
    name: str
    bandwidth_bytes_per_s: float
    fp16_ops_per_s: float
    int8_ops_per_s: float
    memory_bytes: float
