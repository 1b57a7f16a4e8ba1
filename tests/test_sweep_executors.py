"""`ficoco sweep --measure` on its executors, as separate processes the test can kill: the local pool
(a worker killed, then the driver killed, then Ctrl-C, and the reruns finish with every point exactly
once and no finished point run again), a local Ray instance, and submitit's local executor."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from helpers import COMMAND

from ficoco.sweep.store import SweepStore

# float32 named: "auto" on a CPU times a few matmuls per dtype in every worker process (a second each).
SWEEP = ["sweep", "--model", "llava-tiny", "--variant", "v,l", "--keep", "32,16", "--measure", "--warmup", "0",
         "--repeat", "1", "--device", "cpu", "--dtype", "fp32"]
KEYS = ["vanilla-fp16-reference", "v-fp16-keep32", "v-fp16-keep16", "l-fp16-keep32", "l-fp16-keep16"]


def _default_sigint() -> None:
    # Background jobs of a shell without job control start with SIGINT ignored; the driver under
    # test gets the default disposition, as one started from a terminal has (test_cli_profile.py).
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def start(store: Path, *extra: str, delay_ms: int = 0) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1", FICOCO_TEST_SWEEP_POINT_DELAY_MS=str(delay_ms))
    return subprocess.Popen([*COMMAND, *SWEEP, "--out", str(store), *extra], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env, preexec_fn=_default_sigint)


def wait_for(condition, what: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def done_keys(store: SweepStore) -> set[str]:
    return {k for k in KEYS if store.is_done(k)}


def claims(store: SweepStore) -> list[dict]:
    found = []
    for path in (store.folder / "running").glob("*.json"):
        try:
            found.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            pass
    return found


def check_complete(store: SweepStore) -> dict:
    """Every point done, exactly once, and the report holds each once with its measurement."""
    assert sorted(p.stem for p in (store.folder / "points").glob("*.json")) == sorted(KEYS)
    report = json.loads(store.report_path.read_text())
    assert [(p["variant"], (p["budget"] or {}).get("keep")) for p in report["points"]] == \
        [("vanilla", None), ("v", 32), ("v", 16), ("l", 32), ("l", 16)]
    assert all(p["measured"]["status"] == "ok" for p in report["points"])
    assert all(p["measured"]["speedup_vs_vanilla"] > 0 for p in report["points"])
    assert report["failed"] == [] and report["progress"]["done"] == len(KEYS)
    return report


def test_a_killed_worker_a_killed_driver_and_ctrl_c_lose_no_point(tmp_path: Path, cli: Any) -> None:
    folder = tmp_path / "store"
    store = SweepStore(folder)
    # 1. Two workers; one is killed while it runs its point, then the driver is killed.
    driver = start(folder, "--workers", "2", delay_ms=3000)
    try:
        wait_for(lambda: claims(store), "a worker to claim a point")
        victim = claims(store)[0]
        os.kill(victim["pid"], signal.SIGKILL)
        wait_for(lambda: store.record(victim["key"]) is not None, "the killed worker's point to be recorded")
        killed = store.record(victim["key"])
        assert killed["status"] == "failed" and "SIGKILL" in killed["error"]
        wait_for(lambda: done_keys(store), "a point to finish")
        driver.send_signal(signal.SIGKILL)
        driver.wait()
    finally:
        if driver.poll() is None:
            driver.kill()
    finished_before = {k: store.record(k)["finished_unix"] for k in done_keys(store)}
    assert finished_before and len(finished_before) < len(KEYS)

    # 2. The rerun (its workers left alone by the killed driver may still run theirs) is stopped
    # with Ctrl-C once another point has finished: it says where its points are and exits 130.
    driver = start(folder, "--workers", "1", delay_ms=1500)
    try:
        def driving() -> bool:
            try:
                return json.loads((folder / "driver.json").read_text())["pid"] == driver.pid
            except (OSError, ValueError, KeyError):
                return False

        wait_for(lambda: driving() or driver.poll() is not None, "the rerun to take the store")
        before = len(done_keys(store))
        wait_for(lambda: len(done_keys(store)) > before or driver.poll() is not None, "the rerun to finish a point")
        if driver.poll() is None:
            driver.send_signal(signal.SIGINT)
        out, _ = driver.communicate(timeout=120)
    finally:
        if driver.poll() is None:
            driver.kill()
    assert "resuming" in out
    if len(done_keys(store)) < len(KEYS):  # stopped before the end (it might have finished first)
        assert driver.returncode == 130 and "stopped:" in out and "rerun the same command" in out, out
    for key, finished in finished_before.items():
        assert store.record(key)["finished_unix"] == finished  # never run again

    # 3. The last rerun finishes: every point exactly once, the killed one redone.
    final = cli(*SWEEP, "--out", folder, "--workers", "2", in_subprocess=True, env={"OMP_NUM_THREADS": "1"},
                timeout=300)
    assert final.code == 0, final.out + final.err
    check_complete(store)
    assert store.record(victim["key"])["attempt"] >= 2  # failed once (killed), then done
    for key, finished in finished_before.items():
        assert store.record(key)["finished_unix"] == finished
    assert not claims(store) and not (folder / "driver.json").exists()


@pytest.mark.parametrize("executor", ["ray", "slurm"])
def test_an_engine_runs_each_point_in_its_own_process(tmp_path: Path, executor: str, cli: Any) -> None:
    pytest.importorskip({"ray": "ray", "slurm": "submitit"}[executor])
    folder = tmp_path / "store"
    # On the Slurm array, each point's model split by accelerate: weights past 900 KiB on disk.
    split = ["--device-map", "cpu-offload", "--max-memory", "cpu=900KiB"] if executor == "slurm" else []
    run = cli("sweep", "--model", "llava-tiny", "--variant", "v", "--keep", "16", "--measure", "--fidelity",
              "--samples", "1", "--warmup", "0", "--repeat", "1", "--device", "cpu", "--dtype", "fp32", "--out", folder,
              "--executor", executor, "--workers", "2", "--cpus-per-point", "1", *split,
              in_subprocess=True, env={"OMP_NUM_THREADS": "1"}, timeout=300)
    assert run.code == 0, run.out + run.err
    store = SweepStore(folder)
    records = [store.record(k) for k in ("vanilla-fp16-reference", "v-fp16-keep16")]
    assert all(r["status"] == "done" and r["worker"]["executor"] == executor for r in records)
    assert len({r["worker"]["pid"] for r in records}) == 2 and os.getpid() not in {r["worker"]["pid"] for r in records}
    report = json.loads(store.report_path.read_text())
    assert report["points"][1]["fidelity"]["samples"] == 1 and report["points"][1]["measured"]["status"] == "ok"
    assert report["runs"][-1]["executor"] == executor and report["concurrency_note"]  # 2 CPU points at once
    if executor == "slurm":
        assert any(store.slurm_folder.glob("*_log.out"))  # submitit's log folder, in the store
        for point in report["points"]:
            assert point["measured"]["device_map"]["policy"] == "cpu-offload"
            assert point["measured"]["device_map"]["weight_bytes_per_device"]["disk"] > 0
