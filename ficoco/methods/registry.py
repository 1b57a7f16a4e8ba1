"""The method registry: it collects one `MethodSpec` per method, and nothing else.

A method is one folder, ``ficoco/methods/<name>/``: its ``__init__.py`` holds the spec (where it
acts, what it needs, its defaults as constants, its schedule arithmetic and cost terms; no torch),
its ``ops.py`` its tensor functions. Adding one to the package is adding its folder and one line to
`_BUILT_IN_SPECS` below; from outside the package, `register_method(spec)`. The CLI, the accountant
and the report read the registry and name no method themselves. No torch is imported here (the
accountant reads this module).

Settings follow each method's official code (docs/methods/<name>.md); where a paper's table has no
published setting, the rule used instead is stated in the method's folder.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from ficoco.errors import FicocoError
from ficoco.methods import (
    cdpruner,
    dart,
    divprune,
    fastervlm,
    fastv,
    ficoco_l,
    ficoco_v,
    fitprune,
    flashvid,
    gprune,
    hiprune,
    holitom,
    mustdrop,
    pdrop,
    pixelprune,
    prumerge,
    sparsevlm,
    tome,
    visionzip,
    vispruner,
    vitcop,
    vlmpruner,
    vscan,
    vtw,
)
from ficoco.methods.base import RULE, MethodSpec

# The rows the literature reports: "192 / 128 / 64 tokens" on LLaVA-1.5-7B.
PRESETS = (192, 128, 64)

# The package's own methods, in the order `ficoco methods` lists them: FiCoCo, the baselines of 2024-2025, then the
# methods the 2025-2026 literature compares against.
_BUILT_IN_SPECS = (ficoco_v.SPEC, ficoco_l.SPEC, fastv.SPEC, pdrop.SPEC, sparsevlm.SPEC, dart.SPEC, tome.SPEC,
                   visionzip.SPEC, fastervlm.SPEC, prumerge.SPEC, divprune.SPEC, vispruner.SPEC, cdpruner.SPEC,
                   holitom.SPEC, fitprune.SPEC, hiprune.SPEC, vlmpruner.SPEC, gprune.SPEC, vtw.SPEC,
                   pixelprune.SPEC, vitcop.SPEC, vscan.SPEC, flashvid.SPEC, mustdrop.SPEC)

METHODS: dict[str, MethodSpec] = {spec.name: spec for spec in _BUILT_IN_SPECS}


class _Variants(Sequence[str]):
    """"vanilla" and every registered method, as the registry holds them now (a method registered later,
    `register_method`, is a variant as soon as it is registered, wherever VARIANTS was imported)."""

    def _names(self) -> tuple[str, ...]:
        return ("vanilla", *METHODS)

    def __getitem__(self, index: Any) -> Any:
        return self._names()[index]

    def __len__(self) -> int:
        return 1 + len(METHODS)

    def __contains__(self, name: object) -> bool:
        return name == "vanilla" or name in METHODS

    def __iter__(self) -> Iterator[str]:
        return iter(self._names())

    def __eq__(self, other: object) -> bool:
        return tuple(self) == (tuple(other) if isinstance(other, Sequence) else other)

    def __hash__(self) -> int:
        return hash(self._names())

    def __repr__(self) -> str:
        return repr(self._names())


VARIANTS: Sequence[str] = _Variants()


def method(name: str) -> MethodSpec:
    """The spec of `name`, or one line naming the registered methods."""
    if name not in METHODS:
        raise FicocoError(f"unknown method '{name}': choose from {', '.join(METHODS)}")
    return METHODS[name]


def method_matrix(families: Iterable[str]) -> list[dict[str, Any]]:
    """Methods x `families` (ficoco.profiles.FAMILY_DEFAULTS, so a new family shows up as soon as it has
    defaults): per method and family, "yes", "flops only" or "refused", and the one-line reason."""
    families = tuple(families)
    rows = []
    for spec in METHODS.values():
        cells = {}
        for family in families:
            status, reason = spec.family_status(family)
            if status == "yes" and not spec.wired:
                status, reason = "flops only", "not wired into the models yet"
            cells[family] = {"status": status, "reason": reason}
        rows.append({"name": spec.name, "title": spec.title, "families": cells})
    return rows



# ---- what a report calls a method: the official code's name, or the name and ficoco's corrections ----------------

def corrections_on(variant: str, settings: Mapping[str, Any] | None) -> list[str]:
    """The words of every correction of the official code that `settings` turn on for `variant` (its entry's
    `corrections`), in the entry's order; empty when it runs as its official code. A setting the settings do not
    name is its default, the official behaviour; settings unknown (None) name no correction."""
    spec = METHODS.get(variant)
    if spec is None or not settings:
        return []
    notes = []
    for name, values in spec.corrections.items():
        if name in settings:
            value = settings[name]
            # A JSON report holds a tuple as a list, and True/False as themselves (never 1/0: bools match bools).
            for known, means in values.items():
                if type(known) is type(value) and known == value:
                    notes.append(means)
    return notes


def rule_on(variant: str, settings: Mapping[str, Any] | None) -> str:
    """The label of the named rule `settings` choose for `variant` (its entry's `rules`: FiCoCo's "official code's
    rule"), or "" for its default rule (FiCoCo's: the paper's)."""
    spec = METHODS.get(variant)
    if spec is None or not settings or not spec.rules:
        return ""
    rule = spec.rules.get(settings.get(RULE))  # type: ignore[arg-type]
    return rule.label if rule is not None else ""


def _notes(variant: str, settings: Mapping[str, Any] | None) -> str:
    """" (official code's rule; ficoco: float32 attention scores)": the rule and the corrections a label adds."""
    parts = [rule_on(variant, settings)]
    notes = corrections_on(variant, settings)
    if notes:
        parts.append(f"ficoco: {', '.join(notes)}")
    words = "; ".join(part for part in parts if part)
    return f" ({words})" if words else ""


def method_label(variant: str, settings: Mapping[str, Any] | None) -> str:
    """What a report, table or figure calls a run of `variant` under `settings` (a schedule's settings, as a
    report's row holds them): the method's title when every correction setting has its official default
    ("VisionZip"), else the title and the corrections ("VisionZip (ficoco: mean contextual token)"), so a score
    of ficoco's corrected method is never read as the literature's; a named rule comes first ("FiCoCo-L
    (official code's rule)": FiCoCo's title alone is its paper's rule). "vanilla" and names the registry does not
    hold come back as they are. No torch."""
    spec = METHODS.get(variant)
    if spec is None:
        return variant
    return spec.title + _notes(variant, settings)


def variant_label(variant: str, settings: Mapping[str, Any] | None) -> str:
    """The short form the CLI's tables and the figures use: the variant's name as `--variant` spells it, with
    its named rule and ficoco's corrections when any are on ("visionzip (ficoco: mean contextual token)",
    "l (official code's rule)")."""
    return variant + _notes(variant, settings)


# ---- methods registered from outside the package (a plugin, a test's toy method) -------------------------------

def register_method(spec: MethodSpec) -> MethodSpec:
    """Add `spec` to the registry: the CLI, the accountant, `apply` and `ficoco methods` see it at once.
    Its module is imported on use; the planner it names plans it ("by_steps" by default). Refuses a name
    that is taken."""
    if spec.name == "vanilla" or spec.name in METHODS:
        raise FicocoError(f"method '{spec.name}' is registered already; choose another name")
    METHODS[spec.name] = spec
    return spec


def unregister_method(name: str) -> None:
    """Remove a method `register_method` added (one of the package's own entries is refused)."""
    if name not in METHODS:
        raise FicocoError(f"unknown method '{name}': choose from {', '.join(METHODS)}")
    if name in _BUILT_IN:
        raise FicocoError(f"method '{name}' is one of the package's own entries; it cannot be unregistered")
    del METHODS[name]


@contextmanager
def registered(spec: MethodSpec) -> Iterator[MethodSpec]:
    """`register_method(spec)` for the block, `unregister_method` after it (even on an error)."""
    register_method(spec)
    try:
        yield spec
    finally:
        unregister_method(spec.name)


_BUILT_IN = frozenset(METHODS)
