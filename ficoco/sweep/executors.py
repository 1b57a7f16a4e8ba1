"""Where a sweep's points run: a local pool of worker processes, a Ray cluster, or Slurm through
submitit. Every executor runs `ficoco.sweep.worker.run_stored_point` once per point, in its own
process, and the worker writes the point's record into the store itself; an executor only starts
points and, when a worker dies without a word (killed, out of memory, a lost node), records the
point as failed with what the engine said. Scheduling, retries of the engine and RPC are the
engines' own: ficoco adds none.

`run_points` is the driver's loop: it runs every point that is not done, waits for points that
live workers of an earlier driver still run, and tells the caller how the sweep stands.
"""

from __future__ import annotations

import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, Protocol

from ficoco.errors import FicocoError
from ficoco.sweep.store import HEARTBEAT_S, SweepStore, claim_is_live

EXECUTORS = ("local", "ray", "slurm")
POLL_S = 0.5


@dataclass(frozen=True)
class ExecutorOptions:
    """How and where the points run (not part of the sweep's identity: a sweep stopped on one
    executor resumes on another)."""

    name: str = "local"
    workers: int | None = None  # points at once: local default one per visible GPU, else 1
    gpus_per_point: float | None = None  # ray/slurm: default 1 where the sweep runs on CUDA, else 0
    cpus_per_point: int | None = None  # ray/slurm (local: the cores split between the workers)
    ray_address: str | None = None  # a running cluster ("auto", "ray://host:10001"); None starts a local one
    slurm_partition: str | None = None
    timeout_min: int | None = None  # slurm: a point's time limit (default 120)
    device: str = "auto"  # the sweep's --device: whether points want a GPU
    whole_machine: bool = False  # each point's model is split over every GPU (--device-map): one at a time

    def __post_init__(self) -> None:
        if self.name not in EXECUTORS:
            raise FicocoError(f"unknown executor '{self.name}': choose from {', '.join(EXECUTORS)}")
        if self.name != "ray" and self.ray_address is not None:
            raise FicocoError("ray_address= applies to the ray executor")
        if self.name != "slurm" and (self.slurm_partition is not None or self.timeout_min is not None):
            raise FicocoError("slurm_partition= and timeout_min= apply to the slurm executor")
        if self.name == "local" and (self.gpus_per_point is not None or self.cpus_per_point is not None):
            raise FicocoError("gpus_per_point= and cpus_per_point= apply to the ray or slurm executor (the local "
                              "pool gives each worker one GPU, or its share of the cores)")


Tick = Callable[[], None]


class Executor(Protocol):
    """Runs each key's point to a record (done or failed) and returns when all have one; calls
    `tick` often so the driver can report progress."""

    parallel: int
    shares_cpu: bool  # several points at once on CPUs: their timings contend

    def describe(self) -> str: ...

    def run(self, store: SweepStore, keys: list[str], tick: Tick) -> None: ...


def _visible_gpus() -> int:
    try:
        import torch

        return torch.cuda.device_count()  # counts through NVML: no CUDA context in the driver
    except Exception:  # noqa: BLE001 - no torch or no driver: no GPU to hand out
        return 0


def _first_line(exc: BaseException, empty: str | None = None) -> str:
    """An engine's exception in one line: its message's first line, else `empty` (its type by default)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__ if empty is None else empty


def _exit_reason(code: int, log_path: Any) -> str:
    """Why a worker process ended without a record, in one line."""
    if code < 0:
        name = signal.Signals(-code).name
        why = " (out of memory?)" if name == "SIGKILL" else ""
        text = f"the worker process was killed by {name}{why}"
    else:
        text = f"the worker process exited with code {code}"
    try:
        lines = [x for x in log_path.read_text(errors="replace").splitlines() if x.strip()]
    except OSError:
        lines = []
    return f"{text}; its last line: {lines[-1][:300]}" if lines else text


class LocalExecutor:
    """A pool of worker processes on this machine, one point per process (a crash or an
    out-of-memory of one point takes no other down). With GPUs, one worker per GPU, each seeing
    only its own (CUDA_VISIBLE_DEVICES); on a CPU the workers share the cores (OMP_NUM_THREADS),
    one by default so that timings do not contend."""

    def __init__(self, options: ExecutorOptions) -> None:
        self.gpus = _visible_gpus() if options.device in ("auto", "cuda") else 0
        self.whole_machine = options.whole_machine
        if self.whole_machine and (options.workers or 1) > 1:
            raise FicocoError("device_map= splits each point's model over all of this machine's devices: the local "
                              "pool runs one point at a time (drop workers=, or run on Ray or Slurm)")
        self.parallel = 1 if self.whole_machine else options.workers or max(1, self.gpus)
        self.threads = max(1, (os.cpu_count() or 1) // self.parallel)
        self.shares_cpu = not self.gpus and self.parallel > 1
        self._procs: dict[str, subprocess.Popen] = {}
        self._stopping = threading.Event()

    def describe(self) -> str:
        where = f"{self.gpus} GPU(s), one each" if self.gpus else f"{self.threads} CPU thread(s) each"
        if self.whole_machine:
            where = "each point's model split over this machine's devices (device_map=), one point at a time"
        return f"local pool: {self.parallel} worker process(es), {where}"

    def _run_one(self, store: SweepStore, key: str, lanes: queue.Queue) -> None:
        lane = lanes.get()
        try:
            if self._stopping.is_set():
                return
            env = dict(os.environ)
            if self.gpus and not self.whole_machine:
                env["CUDA_VISIBLE_DEVICES"] = env.get("CUDA_VISIBLE_DEVICES", ",".join(map(str, range(self.gpus)))) \
                    .split(",")[lane % self.gpus]
            else:
                env["OMP_NUM_THREADS"] = str(self.threads)
            launched = time.time()
            with open(store.log_path(key), "w") as log:
                proc = subprocess.Popen([sys.executable, "-m", "ficoco.sweep.worker", str(store.folder), key, "local"],
                                        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
                self._procs[key] = proc
                code = proc.wait()
                self._procs.pop(key, None)
            record = store.record(key)
            stopped = self._stopping.is_set() and code in (130, -signal.SIGINT, -signal.SIGTERM)
            if code != 0 and not stopped and (record is None or record.get("finished_unix", 0) < launched):
                store.fail_unfinished(key, _exit_reason(code, store.log_path(key)))
        finally:
            lanes.put(lane)

    def run(self, store: SweepStore, keys: list[str], tick: Tick) -> None:
        lanes: queue.Queue = queue.Queue()
        for lane in range(self.parallel):
            lanes.put(lane)
        pool = ThreadPoolExecutor(max_workers=self.parallel, thread_name_prefix="ficoco-point")
        futures = {pool.submit(self._run_one, store, key, lanes) for key in keys}
        try:
            while futures:
                done, futures = wait(futures, timeout=POLL_S, return_when=FIRST_COMPLETED)
                for future in done:
                    future.result()
                tick()
        except BaseException:
            # Ctrl-C (or the driver failing): no new point starts, the running ones are stopped
            # (a worker stopped so keeps its point pending: no record), and their threads end.
            self._stopping.set()
            for proc in list(self._procs.values()):
                proc.send_signal(signal.SIGINT)
            pool.shutdown(wait=True, cancel_futures=True)
            raise
        pool.shutdown(wait=True)


class RayExecutor:
    """Ray tasks, one per point (`max_calls=1`: a fresh worker process per point, its GPU memory
    freed when it ends), with `num_gpus`/`num_cpus` per point, on a running cluster (`address`) or a
    local instance started for the sweep. The store must be on a filesystem every node sees."""

    def __init__(self, options: ExecutorOptions) -> None:
        try:
            import ray  # noqa: F401
        except ImportError:
            raise FicocoError("the ray executor needs Ray: pip install 'ficoco[ray]'") from None
        self.options = options
        self.parallel = options.workers or 1
        self.shares_cpu = False  # known once connected: CPU tasks, several at once

    def describe(self) -> str:
        where = self.options.ray_address or "a local Ray instance"
        gpus = "a GPU where the cluster has one" if self.options.gpus_per_point is None else \
            f"{self.options.gpus_per_point:g} GPU(s)"
        return f"Ray on {where}: one task per point, {gpus} and {self.options.cpus_per_point or 1} CPU(s) each"

    def _connect(self) -> bool:
        import ray

        if ray.is_initialized():
            return False
        _check_reachable(self.options.ray_address)
        kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False, "logging_level": "ERROR"}
        if self.options.ray_address is None and self.options.workers:
            kwargs["num_cpus"] = self.options.workers * (self.options.cpus_per_point or 1)
        try:
            ray.init(address=self.options.ray_address, **kwargs)
        except (ConnectionError, RuntimeError, ValueError) as exc:
            raise FicocoError(f"ray_address={self.options.ray_address}: cannot connect ({_first_line(exc)}); start "
                              "the cluster (ray start --head) or leave ray_address= out for a local one") from None
        return True

    def _resources(self) -> tuple[float, int]:
        import ray

        gpus = self.options.gpus_per_point
        if gpus is None:
            wants_gpu = self.options.device == "cuda" or (self.options.device == "auto"
                                                          and ray.cluster_resources().get("GPU", 0) > 0)
            gpus = 1.0 if wants_gpu else 0.0
        return gpus, self.options.cpus_per_point or 1

    def run(self, store: SweepStore, keys: list[str], tick: Tick) -> None:
        import ray

        from ficoco.sweep.worker import run_stored_point

        started_here = self._connect()
        try:
            self._gpus, self._cpus = self._resources()
            if not self.options.workers:
                slots = ray.cluster_resources().get("GPU" if self._gpus else "CPU", 1)
                self.parallel = max(1, int(slots // (self._gpus or self._cpus)))
            self.shares_cpu = not self._gpus and self.parallel > 1
            task = ray.remote(num_gpus=self._gpus, num_cpus=self._cpus, max_retries=0, max_calls=1)(run_stored_point)
            waiting = list(keys)
            running: dict[Any, str] = {}
            while waiting or running:
                while waiting and len(running) < self.parallel:  # at most `parallel` points queued at once
                    key = waiting.pop(0)
                    running[task.remote(str(store.folder), key, "ray")] = key
                done, _ = ray.wait(list(running), num_returns=1, timeout=POLL_S)
                for ref in done:
                    key = running.pop(ref)
                    try:
                        ray.get(ref)
                    except ray.exceptions.RayError as exc:  # the worker crashed, was killed, or its node was lost
                        why = f"{type(exc).__name__}: {_first_line(exc, empty='')}"
                        store.fail_unfinished(key, f"the Ray task ended: {why}"[:400])
                tick()
        finally:
            if started_here:
                ray.shutdown()


def _check_reachable(address: str | None, timeout_s: float = 5.0) -> None:
    """A cluster address that nothing answers is refused in one line before Ray is asked: ray.init
    retries an unreachable head for minutes, printing its own warnings meanwhile."""
    if address in (None, "auto", "local"):
        return
    import socket

    where = address.removeprefix("ray://")
    host, _, port = where.rpartition(":")
    if not host or not port.isdigit():
        raise FicocoError(f"ray_address={address}: give HOST:PORT (the head's GCS port, 6379 by default), "
                          "ray://HOST:10001 or auto")
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as exc:
        raise FicocoError(f"ray_address={address}: nothing answers there ({exc.strerror or exc}); start the "
                          "cluster (ray start --head) or leave ray_address= out for a local one") from None


class SlurmExecutor:
    """A Slurm job array through submitit (`map_array`: one task per point, GPUs per task, at most
    `workers` at once), its logs in <store>/slurm. Where there is no Slurm, submitit's local
    executor runs the same array as processes on this machine (said in the first line). A driver
    stopped while the array runs leaves it running: its points land in the store, and a rerun
    waits for them."""

    def __init__(self, options: ExecutorOptions) -> None:
        try:
            import submitit
        except ImportError:
            raise FicocoError("the slurm executor needs submitit: pip install 'ficoco[slurm]'") from None
        self.options = options
        self.cluster = submitit.AutoExecutor.which()
        self.parallel = options.workers or 1
        self.shares_cpu = self.cluster != "slurm" and self.parallel > 1 and not options.gpus_per_point
        self.jobs: list[str] = []

    def describe(self) -> str:
        if self.cluster == "slurm":
            part = f" partition {self.options.slurm_partition}," if self.options.slurm_partition else ""
            return f"Slurm job array through submitit:{part} {self.parallel} task(s) at once"
        why = "sbatch not found" if shutil.which("sbatch") is None else "no Slurm job environment"
        return (f"no Slurm here ({why}): submitit's {self.cluster} executor runs the job array on this machine, "
                f"{self.parallel} at once")

    def run(self, store: SweepStore, keys: list[str], tick: Tick) -> None:
        import submitit

        from ficoco.sweep.worker import run_stored_point

        gpus = self.options.gpus_per_point
        if gpus is None:
            gpus = 1 if self.options.device == "cuda" or (self.options.device == "auto" and self.cluster == "slurm"
                                                          and _visible_gpus()) else 0
        executor = submitit.AutoExecutor(folder=store.slurm_folder, cluster=self.cluster)
        executor.update_parameters(
            name="ficoco-sweep", timeout_min=self.options.timeout_min or 120, nodes=1, tasks_per_node=1,
            gpus_per_node=int(gpus), cpus_per_task=self.options.cpus_per_point or 1,
            slurm_partition=self.options.slurm_partition, slurm_array_parallelism=self.parallel)
        # Submitted in slices of `parallel` where submitit's own executor has no array limit.
        step = len(keys) if self.cluster == "slurm" else self.parallel
        for start in range(0, len(keys), step):
            batch = keys[start:start + step]
            jobs = executor.map_array(run_stored_point, [str(store.folder)] * len(batch), batch, ["slurm"] * len(batch))
            self.jobs += [job.job_id for job in jobs]
            pending = dict(zip(batch, jobs, strict=True))
            while pending:
                for key, job in list(pending.items()):
                    if not job.done():
                        continue
                    del pending[key]
                    try:
                        job.result()
                    except Exception as exc:  # noqa: BLE001 - submitit's failure of this task (killed, timed out, ...)
                        store.fail_unfinished(key, f"the Slurm task {job.job_id} ended: {_first_line(exc)}"[:400])
                tick()
                if pending:
                    time.sleep(POLL_S)


def make_executor(options: ExecutorOptions) -> Executor:
    """The executor the options name (an engine that is not installed is refused in one line)."""
    return {"local": LocalExecutor, "ray": RayExecutor, "slurm": SlurmExecutor}[options.name](options)


def run_points(store: SweepStore, executor: Executor, keys: list[str],
               on_tick: Callable[[], None] | None = None) -> list[str]:
    """Run every point of `keys` that is not done, until each is done or has failed in this run;
    points that live workers of an earlier driver run are waited for, not run twice. Returns the
    keys that failed in this run."""
    failed: set[str] = set()
    last_beat = [0.0]
    run_started = time.time()

    def tick() -> None:
        if time.time() - last_beat[0] >= HEARTBEAT_S / 2:
            store.beat_driver()
            last_beat[0] = time.time()
        if on_tick:
            on_tick()

    while True:
        left = [k for k in keys if k not in failed and not store.is_done(k)]
        if not left:
            break
        elsewhere = {k for k in left if claim_is_live(store.claim(k))}
        runnable = [k for k in left if k not in elsewhere]
        if runnable:
            executor.run(store, runnable, tick)
            for key in runnable:  # failed in this run (an older failed record is what this run redid)
                record = store.record(key)
                if record is not None and record.get("status") == "failed" \
                        and record.get("finished_unix", 0) >= run_started and not claim_is_live(store.claim(key)):
                    failed.add(key)
        else:
            time.sleep(POLL_S)
            tick()
    return sorted(failed)
