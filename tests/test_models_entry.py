"""The one entry wrapper (ficoco.models.entry): every family's adapter offers its hooks, and an object
without them is refused when the wrapper is made, not inside a forward. The wrapper's behaviour is
what every family's model tests run (generate, labels, caches, several images, later turns)."""

from __future__ import annotations

import importlib
import types

import pytest

from ficoco.models import FAMILIES
from ficoco.models.entry import Entry, EntryHooks

HOOKS = ("entry_keep", "call_scope", "enter_forward", "enter_generate", "after_forward", "patch_encoders",
         "language_state", "step_state", "turn_on_cache")


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_adapter_offers_the_entry_hooks(family: str) -> None:
    module, name = FAMILIES[family]
    adapter = getattr(importlib.import_module(module), name)
    missing = [hook for hook in HOOKS if not callable(getattr(adapter, hook, None))]
    assert missing == []
    assert set(HOOKS) <= {name for name in dir(EntryHooks) if not name.startswith("_")}


def test_an_adapter_without_the_hooks_is_refused_when_the_wrapper_is_made() -> None:
    handle = types.SimpleNamespace()
    spec = types.SimpleNamespace(per_item=True, inner=None, placement="in_layer", title="toy")
    with pytest.raises(TypeError, match="EntryHooks"):
        Entry(types.SimpleNamespace(model=None, pixel_inputs=()), handle, spec, 4)
