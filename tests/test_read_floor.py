"""benchmarks/read_floor.py on the committed tiny reference: every reducing row's reads priced at its
layers' SDPA rate, and a user's mistake in one line with exit code 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "read_floor.py"
REFERENCE = ROOT / "reports" / "llava-tiny-cpu.json"


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=300)


def test_every_reducing_row_is_priced() -> None:
    done = _run(str(REFERENCE), "--variant", "v,l", "--repeat", "1")
    assert done.returncode == 0, done.stderr
    # Three quantizations x two methods, each with its reads at three layers of the tiny profile.
    assert done.stdout.count("reads at 3 layers") == 6, done.stdout
    assert done.stdout.count("measured in the row; at the layers' SDPA rate") == 6


def test_mistakes_end_in_one_line() -> None:
    for args in (["/nonexistent/report.json"], [str(REFERENCE), "--variant", "tome"]):
        done = _run(*args)
        assert done.returncode == 2
        assert "Traceback" not in done.stderr
        assert len(done.stderr.strip().splitlines()) == 1, done.stderr
