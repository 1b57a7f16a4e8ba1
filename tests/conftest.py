"""Shared fixtures: profile architectures, built once per session (they are frozen)."""

from __future__ import annotations

import functools

import pytest

from ficoco.accounting import Architecture, architecture
from ficoco.profiles import load_profile


@functools.cache
def _architecture(name: str) -> Architecture:
    return architecture(load_profile(name))


@pytest.fixture(scope="session")
def arch_of():
    """`arch_of("llava-tiny")`: the architecture of a shipped profile at its default input."""
    return _architecture
