"""Parsing of profile options that are lists of numbers."""

from __future__ import annotations

from ficoco.errors import FicocoError


def parse_batches(text: str) -> tuple[int, ...]:
    """`1,8` -> (1, 8)."""
    values = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        if not part.isdigit() or int(part) < 1:
            raise FicocoError(f"batches='{text}' must list positive whole numbers, e.g. 1,8")
        values.append(int(part))
    if not values:
        raise FicocoError("batches= is empty; give batch sizes such as 1,8")
    return tuple(dict.fromkeys(values))
