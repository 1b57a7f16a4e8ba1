"""benchmarks/gpu_run.sh on a CPU (DEVICE=cpu SCOPE=smoke): the GPU run's steps, their `ficoco profile` flags and
the report fields their checks read, on the tiny profiles, so that a renamed flag, field or step fails here and
not on a lent GPU (15 minutes of device time, rarely). The steps that need CUDA say so and are SKIPPED."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "gpu_run.sh"
HELPER = ROOT / "benchmarks" / "gpu_run.py"
STEPS = ["environment", "gpu-tests", "tiny-methods", "tiny-quant", "main-job", "qwen3-vl-8b", "qwen3.5-0.8b",
         "internvl3-8b", "device-map", "lmms-eval", "qwen3-vl-30b-a3b"]
# What a smoke run on a CPU must run and pass (the rest say why not: CUDA, time, or the same command again).
PASSED_ON_A_CPU = {"environment", "tiny-methods", "tiny-quant", "main-job", "qwen3-vl-8b", "device-map"}
FILES = {"summary.json", "summary.txt", "gpu_run.log", "reports.tar.gz"}


def _run(out: Path, **settings: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "DEVICE": "cpu", "OUT": str(out), "INSTALL": "0", "PYTHON": sys.executable, **settings}
    return subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=900, cwd=ROOT)


@pytest.fixture(scope="module")
def smoke(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess, Path]:
    out = tmp_path_factory.mktemp("gpu-run-out")
    return _run(out, SCOPE="smoke", DEADLINE_S="600"), out


def test_every_step_is_in_the_summary_and_none_failed(smoke) -> None:
    done, out = smoke
    summary = json.loads((out / "summary.json").read_text())
    assert [step["name"] for step in summary["steps"]] == STEPS
    failed = [f"{s['name']}: {s['why']}" for s in summary["steps"] if s["status"] == "FAIL"]
    assert not failed, failed
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    passed = {s["name"] for s in summary["steps"] if s["status"] == "PASS"}
    assert passed >= PASSED_ON_A_CPU, summary["steps"]
    for step in summary["steps"]:
        assert step["status"] in ("PASS", "SKIPPED") and step["why"].strip(), step
        assert step["expect"] and step["estimate_s"] >= 0
    assert summary["counts"]["FAIL"] == 0 and summary["device"] == "cpu"


def test_everything_comes_back_in_at_most_eight_files_under_out(smoke) -> None:
    _, out = smoke
    files = {path.name for path in out.iterdir()}
    assert files == FILES and len(files) <= 8
    assert all(path.stat().st_size < 16 * 2**20 for path in out.iterdir())
    with tarfile.open(out / "reports.tar.gz") as bundle:
        names = bundle.getnames()
    for index, step in enumerate(STEPS, 1):
        assert f"reports/{index:02d}-{step}/why" in names, step
    # Each step that ran a profile brought back its JSON report and check_report's verdict on it.
    for step in ("tiny-methods", "tiny-quant", "main-job", "qwen3-vl-8b", "device-map"):
        index = STEPS.index(step) + 1
        mine = [n for n in names if n.startswith(f"reports/{index:02d}-{step}/")]
        assert any(n.endswith(".json") for n in mine) and any(n.endswith(".check.txt") for n in mine), (step, mine)
    text = (out / "summary.txt").read_text()
    assert all(step in text for step in STEPS) and "0 FAIL" in text
    log = (out / "gpu_run.log").read_text()
    assert log.count("--- expect: ") == len(STEPS) and all(f"] {step}: " in log for step in STEPS)


def test_the_refusal_of_a_family_is_in_the_report_not_a_failure(smoke) -> None:
    _, out = smoke
    steps = {s["name"]: s for s in json.loads((out / "summary.json").read_text())["steps"]}
    assert "qwen2-vl-tiny:prumerge" in steps["tiny-methods"]["why"]


@pytest.mark.parametrize(("settings", "names"), [
    ({"DEVICE": "tpu"}, "DEVICE=tpu"), ({"STEPS": "tiny-methods,nonsense"}, "nonsense"),
    ({"DEADLINE_S": "soon"}, "DEADLINE_S=soon"), ({"SCOPE": "most"}, "SCOPE=most"), ({"JOBS": "0"}, "JOBS=0"),
    ({"PYTHON": "/nonexistent/python"}, "PYTHON=/nonexistent/python"),
])
def test_a_users_mistake_ends_in_one_line_and_exit_2(tmp_path: Path, settings: dict, names: str) -> None:
    done = _run(tmp_path / "out", **settings)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.startswith("error: ") and done.stderr.count("\n") == 1 and names in done.stderr


def test_an_out_folder_holding_other_files_is_refused(tmp_path: Path) -> None:
    (tmp_path / "mine.txt").write_text("keep me")
    done = _run(tmp_path)
    assert done.returncode == 2 and "holds other files" in done.stderr
    assert (tmp_path / "mine.txt").read_text() == "keep me"


def test_the_planner_runs_every_method_a_family_runs_at_keeps_that_reduce() -> None:
    variants = "vanilla,v,l,fastv,pdrop,sparsevlm,dart,tome,visionzip,fastervlm,prumerge,divprune,vispruner,cdpruner"
    done = subprocess.run([sys.executable, str(HELPER), "plan", "--models", "llava-next-tiny,qwen2-vl-tiny",
                           "--variants", variants], capture_output=True, text=True, check=True, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    lines = [line.split("\t") for line in done.stdout.splitlines()]
    ran = {(m, v) for kind, m, keep, hp, names in (x for x in lines if x[0] == "run") for v in names.split(",")}
    refused = {(x[1], x[2]): x[3] for x in lines if x[0] == "refused"}
    for model in ("llava-next-tiny", "qwen2-vl-tiny"):
        for variant in variants.split(","):
            assert ((model, variant) in ran) != ((model, variant) in refused), (model, variant)
    # LLaVA-NeXT's per-crop and per-image methods count keep differently: two groups, both below 88 tokens.
    keeps = [int(x[2]) for x in lines if x[0] == "run" and x[1] == "llava-next-tiny"]
    assert len(keeps) == 2 and max(keeps) < 88
    assert "not wired" in refused[("qwen2-vl-tiny", "prumerge")]


def test_a_carried_wheel_is_installed_only_where_the_machine_lacks_it_or_has_an_older_one(tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "packaging-1.0-py3-none-any.whl").write_bytes(b"")  # older than what is installed: kept
    record = tmp_path / "install.json"
    subprocess.run([sys.executable, str(HELPER), "install", str(wheels), "--record", str(record), "--site",
                    str(tmp_path / "site")], check=True, capture_output=True, text=True)
    found = json.loads(record.read_text())
    assert found["installed"] == [] and found["kept"][0].startswith("packaging ")
    assert not (tmp_path / "site").exists()


def test_the_shell_scripts_parse_and_pass_shellcheck_where_it_is_installed() -> None:
    for script in ("gpu_run.sh", "gpu_wheels.sh"):
        subprocess.run(["bash", "-n", str(ROOT / "benchmarks" / script)], check=True)
        if shutil.which("shellcheck"):
            done = subprocess.run(["shellcheck", str(ROOT / "benchmarks" / script)], capture_output=True, text=True)
            assert done.returncode == 0, done.stdout
