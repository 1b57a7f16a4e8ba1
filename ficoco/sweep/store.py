"""The results store of a sweep that runs models: one folder, one file per point, every file
written atomically, so that a stopped sweep (Ctrl-C, a killed worker, a killed driver, a node
gone) keeps every point that finished and a rerun of the same command does only the rest.

    <store>/manifest.json         the sweep's settings and plan (the report before any point ran)
    <store>/points/<key>.json     one record per point that ended: "done" or "failed", with why
    <store>/running/<key>.json    a claim while a worker runs the point: host, pid, heartbeat
    <store>/driver.json           the claim of the driver that is running the sweep
    <store>/report.json           the sweep report (ficoco.sweep/1) assembled from the records
    <store>/logs/<key>.log        a local worker's output; submitit keeps its own in <store>/slurm

A point is "done" once its record says so and is never run again; a "failed" record is redone by
the next run. A claim is live while its heartbeat is fresh and, on this host, its process exists:
a rerun waits for points that live workers of an earlier driver are still running instead of
running them twice. Nothing here imports torch: the store is read by `ficoco report` and by the
driver of an engine that never builds a model itself.
"""

from __future__ import annotations

import copy
import json
import os
import re
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ficoco.errors import FicocoError
from ficoco.report import write_json_atomic

STORE_SCHEMA = "ficoco.sweep-store/1"
RECORD_SCHEMA = "ficoco.sweep-point/1"
HEARTBEAT_S = 10.0
# A claim whose heartbeat is older than this is stale whatever its host says (a node that died,
# a process that hung): three missed beats.
STALE_AFTER_S = 3 * HEARTBEAT_S


def point_key(variant: str, quant: str, budget: dict[str, float] | None) -> str:
    """The point's name in the store: readable, and one per (method, quant, budget) of a sweep."""
    what = "reference" if not budget else "-".join(f"{k}{v:g}" for k, v in budget.items())
    return re.sub(r"[^A-Za-z0-9_.+-]", "_", f"{variant}-{quant}-{what}")


def _now() -> float:
    return time.time()


def _iso(unix_s: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(unix_s))


def _read_json(path: Path) -> dict[str, Any] | None:
    """A JSON object from `path`, or None when it is missing or not one (a file being replaced is
    never half-read: every file here is written through a rename)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: it exists
        return True
    try:  # a zombie (ended, not yet reaped by its parent) runs nothing: on Linux its state says so
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def claim_is_live(claim: dict[str, Any] | None, now_s: float | None = None) -> bool:
    """A claim is live while its heartbeat is fresh and, when it was made on this host, its
    process still exists (a killed process is seen at once, not after the heartbeat times out)."""
    if not claim:
        return False
    beat = claim.get("heartbeat_unix")
    if not isinstance(beat, (int, float)) or (now_s or _now()) - beat > STALE_AFTER_S:
        return False
    if claim.get("host") == socket.gethostname() and isinstance(claim.get("pid"), int):
        return _pid_exists(claim["pid"])
    return True


@dataclass(frozen=True)
class Progress:
    """Where a sweep stands: points done, running (a live claim), failed (and not running again),
    pending; the mean time a point took and the time left at the current parallelism."""

    total: int
    done: int
    running: int
    failed: int
    pending: int
    mean_point_s: float | None
    eta_s: float | None

    def line(self) -> str:
        eta = f"ETA {_duration(self.eta_s)}" if self.eta_s is not None else "ETA -"
        return (f"{self.done}/{self.total} done, {self.running} running, {self.failed} failed, "
                f"{self.pending} pending, {eta}")

    def to_json(self) -> dict[str, Any]:
        return {"total": self.total, "done": self.done, "running": self.running, "failed": self.failed,
                "pending": self.pending, "mean_point_s": self.mean_point_s, "eta_s": self.eta_s}


def _duration(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def _add_point_comparisons(points: list[dict[str, Any]]) -> None:
    """Each measured point against the vanilla point of its quant (speedup, FLOPs ratio, memory
    saving, own work against savings), in place: the points were measured in separate processes."""
    from ficoco.report import add_comparisons

    rows = [p["measured"] for p in points if isinstance(p.get("measured"), dict) and "latency" in p["measured"]]
    if rows:
        add_comparisons(rows)


class SweepStore:
    """One sweep's results folder (see the module docstring for its layout)."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder).expanduser()

    # ---- layout --------------------------------------------------------------------------------------------
    @property
    def manifest_path(self) -> Path:
        return self.folder / "manifest.json"

    @property
    def report_path(self) -> Path:
        return self.folder / "report.json"

    @property
    def slurm_folder(self) -> Path:
        return self.folder / "slurm"

    def record_path(self, key: str) -> Path:
        return self.folder / "points" / f"{key}.json"

    def claim_path(self, key: str) -> Path:
        return self.folder / "running" / f"{key}.json"

    def log_path(self, key: str) -> Path:
        return self.folder / "logs" / f"{key}.log"

    @staticmethod
    def is_store(path: str | Path) -> bool:
        """Whether `path` is a store folder (has a manifest)."""
        return (Path(path).expanduser() / "manifest.json").is_file()

    # ---- creating and opening ------------------------------------------------------------------------------
    def create_or_resume(self, config_json: dict[str, Any], plan_report: dict[str, Any], keys: list[str]) -> bool:
        """Start the store for this sweep, or resume it when it holds the same sweep; True when it
        resumes. A folder holding another sweep, or something else, is refused in one line."""
        config_json = json.loads(json.dumps(config_json))  # as the manifest reads back: tuples become lists
        if self.folder.exists() and not self.folder.is_dir():
            raise FicocoError(f"the store folder {self.folder} is a file; give a folder for the sweep's results")
        manifest = _read_json(self.manifest_path)
        if manifest is not None:
            if manifest.get("schema") != STORE_SCHEMA:
                raise FicocoError(f"the store {self.folder} holds a store of schema '{manifest.get('schema')}'; this "
                                  f"ficoco writes '{STORE_SCHEMA}': give another store folder")
            if manifest.get("config") != config_json:
                changed = sorted(k for k in set(config_json) | set(manifest.get("config") or {})
                                 if (manifest.get("config") or {}).get(k) != config_json.get(k))
                raise FicocoError(f"the store {self.folder} holds another sweep (differs in {', '.join(changed)}); "
                                  "rerun that sweep's command to resume it, or give another store folder")
            return True
        if self.folder.is_dir() and any(self.folder.iterdir()):
            raise FicocoError(f"the store folder {self.folder} is not a sweep's store and is not empty; "
                              "give a new or empty folder")
        try:
            for sub in ("points", "running", "logs"):
                (self.folder / sub).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise FicocoError(f"the store folder {self.folder}: cannot create it ({exc.strerror or exc})") from None
        write_json_atomic(str(self.manifest_path), {"schema": STORE_SCHEMA, "config": config_json, "keys": keys,
                                                    "plan": plan_report})
        return False

    def manifest(self) -> dict[str, Any]:
        manifest = _read_json(self.manifest_path)
        if manifest is None or manifest.get("schema") != STORE_SCHEMA:
            raise FicocoError(f"{self.folder} is not a sweep's results store (no {STORE_SCHEMA} manifest.json)")
        return manifest

    def keys(self) -> list[str]:
        return list(self.manifest()["keys"])

    # ---- records -------------------------------------------------------------------------------------------
    def record(self, key: str) -> dict[str, Any] | None:
        record = _read_json(self.record_path(key))
        return record if record is not None and record.get("schema") == RECORD_SCHEMA else None

    def is_done(self, key: str) -> bool:
        record = self.record(key)
        return record is not None and record.get("status") == "done"

    def write_record(self, key: str, status: str, *, point: dict[str, Any] | None = None, error: str | None = None,
                     started_unix: float | None = None, worker: dict[str, Any] | None = None,
                     extra: dict[str, Any] | None = None) -> dict[str, Any]:
        """Store how the point ended ("done" with its point, or "failed" with why), atomically. The
        attempts count every end the point had, failures included."""
        previous = self.record(key)
        finished = _now()
        record = {"schema": RECORD_SCHEMA, "key": key, "status": status,
                  "attempt": (previous or {}).get("attempt", 0) + 1,
                  "started": _iso(started_unix) if started_unix else None, "finished": _iso(finished),
                  "finished_unix": finished,
                  "duration_s": finished - started_unix if started_unix else None,
                  "worker": worker or {}, "error": error, "point": point, **(extra or {})}
        write_json_atomic(str(self.record_path(key)), record)
        return record

    def fail_unfinished(self, key: str, reason: str) -> None:
        """A worker that died without a word (killed, out of memory, a lost node): the point is
        failed, unless it finished after all or another live worker runs it."""
        if self.is_done(key) or claim_is_live(self.claim(key)):
            return
        claim = self.claim(key) or {}
        self.write_record(key, "failed", error=reason, started_unix=claim.get("started_unix"),
                          worker={k: claim.get(k) for k in ("host", "pid", "executor")})
        self.release(key)

    # ---- claims --------------------------------------------------------------------------------------------
    def claim(self, key: str) -> dict[str, Any] | None:
        return _read_json(self.claim_path(key))

    def write_claim(self, key: str, executor: str, started_unix: float) -> None:
        write_json_atomic(str(self.claim_path(key)), {
            "key": key, "host": socket.gethostname(), "pid": os.getpid(), "executor": executor,
            "started_unix": started_unix, "heartbeat_unix": _now(),
            "job": os.environ.get("SLURM_ARRAY_JOB_ID") or os.environ.get("SLURM_JOB_ID")})

    def release(self, key: str) -> None:
        self.claim_path(key).unlink(missing_ok=True)

    def clear_stale_claims(self) -> None:
        for path in (self.folder / "running").glob("*.json"):
            if not claim_is_live(_read_json(path)):
                path.unlink(missing_ok=True)

    @contextmanager
    def driver_lock(self) -> Iterator[None]:
        """One driver per store at a time: a second one, while the first lives, is refused in one line."""
        path = self.folder / "driver.json"
        holder = _read_json(path)
        if claim_is_live(holder) and holder.get("pid") != os.getpid():
            raise FicocoError(f"another ficoco sweep (pid {holder.get('pid')} on {holder.get('host')}) is running "
                              f"the store {self.folder}; wait for it to end or stop it first")
        self.beat_driver()
        try:
            yield
        finally:
            path.unlink(missing_ok=True)

    def beat_driver(self) -> None:
        write_json_atomic(str(self.folder / "driver.json"), {"host": socket.gethostname(), "pid": os.getpid(),
                                                             "heartbeat_unix": _now()})

    # ---- the drivers' runs ----------------------------------------------------------------------------------
    def runs(self) -> list[dict[str, Any]]:
        return list((_read_json(self.folder / "runs.json") or {}).get("runs", []))

    def note_run(self, run: dict[str, Any]) -> None:
        """Append one driver run (its executor, parallelism, host) to runs.json: a report says where
        and how its points ran, and whether timed points shared a machine's cores."""
        runs = [*self.runs(), {"started": _iso(_now()), "host": socket.gethostname(), **run}]
        write_json_atomic(str(self.folder / "runs.json"), {"runs": runs})

    # ---- where the sweep stands ----------------------------------------------------------------------------
    def progress(self, parallel: int | None = None) -> Progress:
        """Counts over the planned points, and the time left: the mean time of the points done so far
        times the points left, over the points that run at once (`parallel`, else those running now)."""
        keys = self.keys()
        done = failed = running = 0
        durations: list[float] = []
        for key in keys:
            record = self.record(key)
            if record is not None and record.get("status") == "done":
                done += 1
                if isinstance(record.get("duration_s"), (int, float)):
                    durations.append(record["duration_s"])
            elif claim_is_live(self.claim(key)):
                running += 1
            elif record is not None:
                failed += 1
        pending = len(keys) - done - running - failed
        mean_s = sum(durations) / len(durations) if durations else None
        lanes = max(1, parallel or running or 1)
        eta_s = mean_s * (pending + running) / lanes if mean_s is not None else None
        return Progress(len(keys), done, running, failed, pending, mean_s, eta_s)

    def report(self) -> dict[str, Any]:
        """The sweep report (ficoco.sweep/1) of what the store holds now: the plan, each finished
        point's figures in place of its planned one, speedups against the vanilla point of its quant,
        and the progress (also while the sweep is still running)."""
        manifest = self.manifest()
        report = copy.deepcopy(manifest["plan"])
        failed: list[dict[str, Any]] = []
        workers: dict[str, Any] = {}
        for index, key in enumerate(manifest["keys"]):
            record = self.record(key)
            if record is None:
                continue
            if record.get("status") == "done" and isinstance(record.get("point"), dict):
                report["points"][index] = record["point"]
                for name in ("environment", "device", "compute_dtype", "notes"):
                    if name in record and name not in workers:
                        workers[name] = record[name]
            elif record.get("status") == "failed" and not claim_is_live(self.claim(key)):
                failed.append({"key": key, "attempt": record.get("attempt"), "error": record.get("error")})
        report.update(workers)
        runs = self.runs()
        report["runs"] = runs
        shared = [r for r in runs if r.get("shares_cpu")]
        if shared and report["config"].get("measure"):
            report["concurrency_note"] = (
                f"{shared[-1].get('parallel')} points ran at once on the CPU ({shared[-1].get('executor')} executor): "
                "their timings share cores and memory bandwidth; for timings to compare, run one point at a time "
                "(workers=1)")
        _add_point_comparisons(report["points"])
        report["store"] = str(self.folder)
        report["progress"] = self.progress().to_json()
        report["failed"] = failed
        return report
