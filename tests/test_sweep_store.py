"""The results store of a sweep (ficoco.sweep.store) and the driver's loop (ficoco.sweep.executors.run_points),
without models: records written atomically and read back, claims live only while their process and
heartbeat are, a rerun refused on another sweep's store, progress and ETA, the report assembled from
the records (also mid-sweep), and a driver that waits for an earlier driver's live workers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ficoco.errors import FicocoError
from ficoco.sweep import SweepConfig, new_report, plan_points, sweep_profile
from ficoco.sweep.executors import ExecutorOptions, run_points
from ficoco.sweep.store import STALE_AFTER_S, SweepStore, claim_is_live, point_key

CONFIG = SweepConfig(model="llava-tiny", variants=("v", "l"), keep=(32, 16), measure=True, warmup=0, repeat=1,
                     device="cpu")


def new_store(folder: Path, config: SweepConfig = CONFIG) -> tuple[SweepStore, list]:
    profile = sweep_profile(config)
    points = plan_points(config, profile)
    store = SweepStore(folder)
    assert store.create_or_resume(config.to_json(), new_report(config, profile, points), [p.key for p in points]) \
        is False
    return store, points


def measured(variant: str, median_ms: float, tflops: float) -> dict:
    return {"variant": variant, "quant": "fp16", "batch": 1, "status": "ok", "latency": {"median_ms": median_ms},
            "analytic": {"tflops": tflops, "roofline_ms": None}, "memory": {"peak_bytes": 1000},
            "reduction_ms": 0.0}


def test_point_keys_are_readable_and_one_per_point() -> None:
    points = plan_points(CONFIG, sweep_profile(CONFIG))
    keys = [p.key for p in points]
    assert keys == ["vanilla-fp16-reference", "v-fp16-keep32", "v-fp16-keep16", "l-fp16-keep32", "l-fp16-keep16"]
    assert point_key("v", "int4", {"tflops": 1.5}) == "v-int4-tflops1.5"


def test_a_claim_is_live_only_while_its_process_and_heartbeat_are(tmp_path: Path) -> None:
    store, _ = new_store(tmp_path / "s")
    store.write_claim("v-fp16-keep32", "local", time.time())
    claim = store.claim("v-fp16-keep32")
    assert claim["pid"] == os.getpid() and claim_is_live(claim)
    assert not claim_is_live(claim, now_s=claim["heartbeat_unix"] + STALE_AFTER_S + 1)  # missed heartbeats
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    assert not claim_is_live({**claim, "pid": int(ended.stdout)})  # its process is gone: stale at once
    assert claim_is_live({**claim, "host": "another-node", "pid": 1})  # elsewhere: the heartbeat decides
    store.release("v-fp16-keep32")
    assert store.claim("v-fp16-keep32") is None


def test_a_rerun_resumes_its_own_store_and_refuses_anothers(tmp_path: Path) -> None:
    store, points = new_store(tmp_path / "s")
    report = new_report(CONFIG, sweep_profile(CONFIG), points)
    assert store.create_or_resume(CONFIG.to_json(), report, [p.key for p in points]) is True
    other = SweepConfig(**{**CONFIG.to_json(), "keep": (8,)})
    with pytest.raises(FicocoError, match=r"holds another sweep \(differs in keep\)"):
        store.create_or_resume(other.to_json(), report, [])
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x.txt").write_text("mine")
    with pytest.raises(FicocoError, match="not a sweep's store and is not empty"):
        SweepStore(tmp_path / "busy").create_or_resume(CONFIG.to_json(), report, [])
    (tmp_path / "file").write_text("")
    with pytest.raises(FicocoError, match="is a file"):
        SweepStore(tmp_path / "file").create_or_resume(CONFIG.to_json(), report, [])


def test_a_second_driver_on_a_live_store_is_refused(tmp_path: Path) -> None:
    store, _ = new_store(tmp_path / "s")
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        (store.folder / "driver.json").write_text(json.dumps({"host": os.uname().nodename, "pid": other.pid,
                                                              "heartbeat_unix": time.time()}))
        with pytest.raises(FicocoError, match=f"another ficoco sweep \\(pid {other.pid}"):
            with store.driver_lock():
                pass
    finally:
        other.kill()
        other.wait()
    with store.driver_lock():  # its process is gone: the store is free
        assert json.loads((store.folder / "driver.json").read_text())["pid"] == os.getpid()
    assert not (store.folder / "driver.json").exists()


def test_records_give_progress_eta_and_the_report_also_mid_sweep(cli, tmp_path: Path) -> None:
    store, points = new_store(tmp_path / "s")
    by_key = {p.key: p for p in points}
    now = time.time()
    vanilla = by_key["vanilla-fp16-reference"].to_json() | {"measured": measured("vanilla", 100.0, 2.0)}
    reduced = by_key["v-fp16-keep16"].to_json() | {"measured": measured("v", 25.0, 1.0)}
    store.write_record("vanilla-fp16-reference", "done", point=vanilla, started_unix=now - 10)
    store.write_record("v-fp16-keep16", "done", point=reduced, started_unix=now - 20)
    store.write_record("l-fp16-keep32", "failed", error="out of memory", started_unix=now - 5)
    store.write_claim("v-fp16-keep32", "local", now)
    progress = store.progress(parallel=2)
    assert (progress.total, progress.done, progress.running, progress.failed, progress.pending) == (5, 2, 1, 1, 1)
    assert progress.mean_point_s == pytest.approx(15, abs=0.5)
    assert progress.eta_s == pytest.approx(15 * 2 / 2, abs=0.5)  # (pending + running) x mean / lanes
    assert "2/5 done, 1 running, 1 failed, 1 pending" in progress.line()

    report = store.report()
    assert [p["variant"] for p in report["points"]] == [p.variant for p in points]  # planned order, each once
    point = report["points"][2]
    assert point["measured"]["speedup_vs_vanilla"] == pytest.approx(4.0)  # against the vanilla record
    assert point["measured"]["flops_ratio_vs_vanilla"] == pytest.approx(2.0)
    assert report["points"][1].get("measured") is None  # still running: the plan's row
    assert report["failed"] == [{"key": "l-fp16-keep32", "attempt": 1, "error": "out of memory"}]

    code, out, err = cli(*["report", str(store.folder)])  # the store read as it stands
    assert code == 0, err
    words = " ".join(out.split())  # the caption wraps at the terminal's width
    assert "4.00x" in words and "failed l-fp16-keep32 (attempt 1): out of memory" in words
    assert "2/5 done, 1 running, 1 failed, 1 pending" in words
    code, _, err = cli(*["report", str(store.folder), "--plot", str(tmp_path / "figs")])
    assert code == 0, err
    assert (tmp_path / "figs" / "latency.png").is_file() and (tmp_path / "figs" / "cost.svg").is_file()
    store.release("v-fp16-keep32")


def test_report_of_a_folder_that_is_no_store_is_one_line(cli, tmp_path: Path) -> None:
    code, _, err = cli(*["report", str(tmp_path)])
    assert code == 2 and err.count("\n") == 1 and "not a sweep's results store" in err


class FakeExecutor:
    """Runs points in this process: writes a done record for each (what a worker would)."""

    parallel, shares_cpu = 1, False

    def __init__(self, points: dict) -> None:
        self.points, self.ran = points, []

    def describe(self) -> str:
        return "fake"

    def run(self, store: SweepStore, keys: list[str], tick) -> None:
        for key in keys:
            self.ran.append(key)
            store.write_record(key, "done", point=self.points[key].to_json(), started_unix=time.time())
            tick()


def test_the_driver_waits_for_an_earlier_drivers_live_worker_and_redoes_failed_points(tmp_path: Path) -> None:
    store, points = new_store(tmp_path / "s")
    by_key = {p.key: p for p in points}
    keys = list(by_key)
    store.write_record(keys[0], "done", point=by_key[keys[0]].to_json(), started_unix=time.time())
    store.write_record(keys[1], "failed", error="killed", started_unix=time.time())
    # An orphan worker of a stopped driver: alive for two seconds, then gone without a record.
    orphan = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(2)"])
    store.write_claim(keys[2], "local", time.time())
    claim = json.loads(store.claim_path(keys[2]).read_text())
    store.claim_path(keys[2]).write_text(json.dumps({**claim, "pid": orphan.pid}))
    executor = FakeExecutor(by_key)
    first_done = store.record(keys[0])
    try:
        assert run_points(store, executor, keys) == []
    finally:
        orphan.wait()
    # The failed and the pending points first; the orphan's point only once its worker was gone;
    # each point that was not done, exactly once.
    assert executor.ran == [keys[1], keys[3], keys[4], keys[2]]
    assert store.record(keys[0]) == first_done  # a finished point is never run again
    assert store.record(keys[1])["attempt"] == 2  # the failed point, redone
    assert ExecutorOptions(name="local").name == "local"
    with pytest.raises(FicocoError, match="ray_address= applies to the ray executor"):
        ExecutorOptions(name="local", ray_address="auto")


def test_an_unreachable_ray_address_is_one_line_before_ray_is_asked() -> None:
    import socket

    from ficoco.sweep.executors import _check_reachable

    with socket.socket() as probe:  # a port nothing listens on: bound, then closed
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(FicocoError, match=f"ray_address=127.0.0.1:{port}: nothing answers there"):
        _check_reachable(f"127.0.0.1:{port}", timeout_s=2)
    with pytest.raises(FicocoError, match="give HOST:PORT"):
        _check_reachable("head-node")
    _check_reachable("auto")  # left to Ray: it finds a running cluster itself
