"""The installed versions of the packages whose internals ficoco touches, against the ranges it is
tested with.

The tested ranges are pyproject.toml's dependency specifiers, read back from the installed
package's metadata, so they are stated once: a lower bound that CI tests (.ci/run installs it) and
an upper bound just past the newest tested release. A version outside its range may still work,
but nothing here has seen it do so; `ficoco --version` and every report say which.

No torch and no transformers are imported: versions come from package metadata, so `ficoco flops`
stays fast and `ficoco --version` answers also where an import would fail.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from functools import cache
from importlib import metadata
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

# The packages whose internals ficoco relies on (transformers' model internals, accelerate's
# device hooks, hqq under transformers' quantized cache, bitsandbytes' linear layers) and torch.
TOUCHED_PACKAGES = ("torch", "transformers", "accelerate", "hqq", "bitsandbytes")

logger = logging.getLogger("ficoco")


@dataclass(frozen=True)
class PackageVersion:
    """One package: its installed version (None: not installed) and its tested range."""

    name: str
    installed: str | None
    tested: str  # a PEP 440 specifier, "" when pyproject states none

    @property
    def within(self) -> bool | None:
        """Whether the installed version is in the tested range (None: not installed, or no range)."""
        if self.installed is None or not self.tested:
            return None
        try:
            # A local build tag (torch's "+cpu", "+cu128") is the same release.
            return SpecifierSet(self.tested).contains(Version(self.installed).public, prereleases=True)
        except InvalidVersion:
            return False

    def describe(self) -> str:
        """'transformers 5.24.0 (tested >=5.10,<5.25)', with 'OUTSIDE the tested range' when it is."""
        installed = self.installed or "not installed"
        if not self.tested:
            return f"{self.name} {installed}"
        flag = " OUTSIDE the tested range" if self.within is False else ""
        return f"{self.name} {installed} (tested {self.tested}){flag}"


def _requirements_from_pyproject() -> list[str]:
    """pyproject.toml's dependencies, for a source checkout that was never installed."""
    path = Path(__file__).resolve().parent.parent / "pyproject.toml"
    try:
        text = path.read_text()
    except OSError:
        return []
    block = re.search(r"^dependencies\s*=\s*\[(.*?)^\]", text, re.S | re.M)
    return re.findall(r'^\s*"([^"]+)"', block.group(1), re.M) if block else []


@cache
def tested_ranges() -> dict[str, str]:
    """Package name -> the specifier ficoco's requirements give it (pyproject.toml's dependencies)."""
    try:
        requirements = metadata.requires("ficoco") or []
    except metadata.PackageNotFoundError:
        requirements = _requirements_from_pyproject()
    ranges: dict[str, str] = {}
    for line in requirements:
        try:
            requirement = Requirement(line)
        except InvalidRequirement:
            continue
        if requirement.marker is not None and "extra" in str(requirement.marker):
            continue  # optional extras (dev tools) are not what the library runs on
        # Lower bounds first: ">=5.10,<5.25" reads as a range.
        ranges[requirement.name.lower()] = ",".join(sorted((str(s) for s in requirement.specifier),
                                                           key=lambda s: (not s.startswith(">"), s)))
    return ranges


def installed_version(package: str) -> str | None:
    """The installed distribution's version, None when it is not installed."""
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def package_versions() -> list[PackageVersion]:
    """Every touched package: installed version and tested range, in TOUCHED_PACKAGES order."""
    ranges = tested_ranges()
    return [PackageVersion(name, installed_version(name), ranges.get(name, "")) for name in TOUCHED_PACKAGES]


def outside_tested_range() -> list[PackageVersion]:
    """The touched packages installed at a version outside their tested range."""
    return [package for package in package_versions() if package.within is False]


def environment_versions() -> dict[str, object]:
    """What every report's environment records of the touched packages: each one's installed version
    (a key per package, None when not installed), their tested ranges, and the names of those
    installed outside them."""
    packages = package_versions()
    return {**{p.name: p.installed for p in packages},
            "tested_ranges": {p.name: p.tested for p in packages},
            "outside_tested_range": [p.name for p in packages if p.within is False]}


def report_environment() -> dict[str, object]:
    """The environment of a report made without torch (the accountant's): Python, ficoco and the
    touched packages (`environment_versions`)."""
    import platform

    import ficoco

    return {"python": platform.python_version(), "ficoco": ficoco.__version__, **environment_versions()}


_warned: set[str] = set()


def warn_if_untested(package: str) -> None:
    """One warning line (once per process) when `package` is installed outside its tested range:
    what was found, what is tested, and how to get it. Through the `ficoco` logger, so that with no
    logging configured it is one line on stderr, and a user can silence or route it."""
    if package in _warned:
        return
    found = next((p for p in package_versions() if p.name == package), None)
    if found is None or found.within is not False:
        return
    _warned.add(package)
    logger.warning("ficoco: %s %s is outside the tested range %s; if anything fails, pip install '%s%s'",
                   package, found.installed, found.tested, package, found.tested)
