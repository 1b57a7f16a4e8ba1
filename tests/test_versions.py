"""The touched packages' versions against their tested ranges (ficoco.versions): --version, every
report's environment, and one warning line when a patch runs on an untested transformers."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ficoco import versions
from ficoco.versions import PackageVersion

ROOT = Path(__file__).resolve().parent.parent


def test_tested_ranges_are_pyprojects_dependency_specifiers():
    """One source: the installed metadata's requirements are pyproject.toml's, and every touched
    package has a range with a lower and an upper bound (torch: lower only, see pyproject)."""
    from_source = {}
    for line in versions._requirements_from_pyproject():
        name = line.split(";")[0]
        for cut in "<>=!~ ":
            name = name.split(cut)[0]
        from_source[name.lower()] = line
    ranges = versions.tested_ranges()
    for package in ("transformers", "accelerate", "hqq", "bitsandbytes"):
        assert package in from_source, f"{package} is not a dependency in pyproject.toml"
        assert ">=" in ranges[package] and "<" in ranges[package].replace("<=", "<"), ranges[package]
    assert ranges["torch"].startswith(">=")
    assert "pytest" not in ranges  # extras are not what the library runs on


@pytest.mark.parametrize(("installed", "tested", "within"), [
    ("5.24.0", ">=5.10,<5.25", True), ("5.25.0", ">=5.10,<5.25", False), ("5.9.2", ">=5.10,<5.25", False),
    ("5.24.1", ">=5.10,<5.25", True), ("2.13.0+cpu", ">=2.13", True), ("2.12.1+cu128", ">=2.13", False),
    (None, ">=1", None), ("1.0", "", None), ("not-a-version", ">=1", False),
])
def test_within_the_tested_range(installed, tested, within):
    package = PackageVersion("x", installed, tested)
    assert package.within is within
    assert ("OUTSIDE the tested range" in package.describe()) is (within is False)


def test_the_environment_block_names_every_touched_package_and_flags_the_untested(monkeypatch):
    monkeypatch.setattr(versions, "installed_version", lambda name: "99.0" if name == "hqq" else "0.0.1")
    monkeypatch.setattr(versions, "tested_ranges", lambda: {"hqq": ">=0.2,<0.3", "torch": ">=0.0.1"})
    env = versions.environment_versions()
    assert set(versions.TOUCHED_PACKAGES) <= set(env)
    assert env["hqq"] == "99.0" and env["tested_ranges"]["hqq"] == ">=0.2,<0.3"
    assert env["outside_tested_range"] == ["hqq"]


def fake_transformers(version: str) -> str:
    """Python for `cli(..., prelude=...)`: the subprocess sees `version` as the installed transformers."""
    return ("import ficoco.versions as v; real = v.installed_version; "
            f"v.installed_version = lambda n: {version!r} if n == 'transformers' else real(n)")


def test_version_names_the_packages_and_their_ranges(cli):
    result = cli("--version", in_subprocess=True, cwd=ROOT)
    assert result.code == 0, result.err
    lines = result.out.splitlines()
    assert lines[0].startswith("ficoco ")
    for package in versions.TOUCHED_PACKAGES:
        assert any(line.strip().startswith(f"{package} ") for line in lines[1:]), result.out
    assert "OUTSIDE" not in result.out  # CI installs inside every range


def test_version_says_when_transformers_is_outside_its_range(cli):
    result = cli("--version", prelude=fake_transformers("99.0.0"), cwd=ROOT)
    assert "transformers 99.0.0 (tested " in result.out and "OUTSIDE the tested range" in result.out


def test_a_profile_on_an_untested_transformers_warns_in_one_line_and_runs(tmp_path, cli):
    """The warning is one line on stderr, before anything is built; the run goes on (the contacts
    hold on the real release underneath) and its report names the untested release."""
    report = tmp_path / "r.json"
    result = cli("profile", "--model", "llava-tiny", "--variant", "vanilla,l", "--keep", "8", "--warmup", "0",
                 "--repeat", "1", "--json", str(report), prelude=fake_transformers("99.0.0"), cwd=ROOT)
    assert result.code == 0, result.err
    warnings = [line for line in result.err.splitlines() if "outside the tested range" in line]
    assert len(warnings) == 1 and warnings[0].startswith("ficoco: transformers 99.0.0 is outside the tested range")
    assert "Traceback" not in result.err
    env = json.loads(report.read_text())["environment"]
    assert env["transformers"] == "99.0.0" and env["outside_tested_range"] == ["transformers"]


def test_the_flops_report_records_the_versions(tmp_path, cli):
    report = tmp_path / "f.json"
    result = cli("flops", "--model", "llava-tiny", "--json", str(report), in_subprocess=True, cwd=ROOT)
    assert result.code == 0, result.err
    env = json.loads(report.read_text())["environment"]
    assert env["transformers"] == versions.installed_version("transformers")
    assert env["tested_ranges"]["transformers"] == versions.tested_ranges()["transformers"]
    assert env["outside_tested_range"] == []


def test_the_oldest_release_run_pins_every_touched_package_but_torch_to_its_lower_bound():
    """CI's oldest-release run (.ci/oldest_constraints.py) pins transformers, accelerate, hqq and bitsandbytes to
    their lower bounds, never torch: its bound (2.11) is the lent GPU machine's build, below the 2.13 CI installs."""
    done = subprocess.run([sys.executable, str(ROOT / ".ci" / "oldest_constraints.py")], capture_output=True,
                          text=True, check=True)
    pins = dict(line.split("==") for line in done.stdout.split())
    assert set(pins) == {"transformers", "accelerate", "hqq", "bitsandbytes"}
    for name, version in pins.items():
        assert versions.tested_ranges()[name].startswith(f">={version},"), name
    assert set(re.findall(r"torch==([0-9.]+)", (ROOT / ".ci" / "run").read_text())) == {"2.13.0"}
