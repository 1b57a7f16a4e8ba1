"""The test-only slowdown of the reduction stages (issue 19): off unless set, honest when set.

The CI gate is shown to catch a slower reduction by setting FICOCO_TEST_DELAY_REDUCTION_MS
(benchmarks/gate_noise.py). Here: the delay lands inside every timed reduction span, and a
report made with it says so. No timing is judged; a sleep of D ms lasts at least D ms.
"""

from __future__ import annotations

import json
import os

import pytest

from ficoco import testing_hooks
from ficoco.testing_hooks import DELAY_REDUCTION_VARIABLE

DELAY_MS = 40.0


def test_the_hook_is_off_in_an_ordinary_run():
    assert DELAY_REDUCTION_VARIABLE not in os.environ  # the suite itself never runs with it
    assert testing_hooks.REDUCTION_DELAY_S == 0 and testing_hooks.active() == {}


@pytest.mark.parametrize("text, words", [("slow", "not a number"), ("-5", "must not be negative")])
def test_a_bad_delay_is_refused_with_its_name(monkeypatch, text, words):
    monkeypatch.setenv(DELAY_REDUCTION_VARIABLE, text)
    with pytest.raises(ValueError, match=f"{DELAY_REDUCTION_VARIABLE}.*{words}"):
        testing_hooks._milliseconds(DELAY_REDUCTION_VARIABLE)


def test_the_delay_lands_in_every_reduction_span_and_the_report_says_so(tmp_path, cli):
    path = tmp_path / "delayed.json"
    env = {"OMP_NUM_THREADS": "1", DELAY_REDUCTION_VARIABLE: str(DELAY_MS)}
    result = cli("profile", "--device", "cpu", "--model", "llava-tiny", "--variant", "vanilla,v,l", "--keep", "8",
                 "--warmup", "0", "--repeat", "1", "--json", path, in_subprocess=True, timeout=300, env=env)
    assert result.code == 0, result.err[-3000:]
    report = json.loads(path.read_text())
    assert report["environment"]["test_hooks"] == {DELAY_REDUCTION_VARIABLE: DELAY_MS}
    rows = {r["variant"]: r for r in report["rows"]}
    assert rows["vanilla"]["reduction_stages_ms"] == 0  # nothing to reduce, nothing delayed
    for variant in ("v", "l"):
        spans = len(rows[variant]["schedule"])  # one reduction span per reducing layer
        assert spans >= 2
        assert rows[variant]["reduction_stages_ms"] >= spans * DELAY_MS
        assert rows[variant]["latency"]["median_ms"] >= spans * DELAY_MS
