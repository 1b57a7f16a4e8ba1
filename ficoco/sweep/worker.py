"""One sweep point in this process: what every executor runs (`python -m ficoco.sweep.worker STORE KEY`
for the local pool, the same function as a Ray task or a submitit job).

The worker reads the sweep from the store's manifest, plans it again (the accountant is
deterministic: the same settings give the same schedules), claims the point, keeps the claim's
heartbeat fresh, runs the point and writes its record. A point that another live worker runs, or
that is done already, is left alone: a rerun, or a queued Slurm job of a driver that was stopped,
never runs a point twice.
"""

from __future__ import annotations

import sys
import threading
import time
import traceback
from typing import Any

from ficoco.errors import FicocoError
from ficoco.sweep.store import HEARTBEAT_S, SweepStore, claim_is_live


def run_stored_point(folder: str, key: str, executor: str = "local") -> dict[str, Any]:
    """Run the point `key` of the store in `folder` and store how it ended; returns the record (or
    {"status": "skipped"} when it was done already or runs elsewhere)."""
    import os
    import socket

    from ficoco.sweep.plan import SweepConfig, plan_points, run_point, sweep_profile

    store = SweepStore(folder)
    if store.is_done(key):
        return {"key": key, "status": "skipped", "reason": "done already"}
    claim = store.claim(key)
    if claim_is_live(claim) and claim.get("pid") != os.getpid():
        return {"key": key, "status": "skipped", "reason": f"running in pid {claim.get('pid')} on {claim.get('host')}"}
    started = time.time()
    store.write_claim(key, executor, started)
    stop = threading.Event()

    def beat() -> None:  # the claim stays live while this process runs the point
        while not stop.wait(HEARTBEAT_S):
            store.write_claim(key, executor, started)

    threading.Thread(target=beat, name="ficoco-heartbeat", daemon=True).start()
    worker = {"host": socket.gethostname(), "pid": os.getpid(), "executor": executor}
    try:
        from ficoco import testing_hooks

        if testing_hooks.SWEEP_POINT_DELAY_S:
            time.sleep(testing_hooks.SWEEP_POINT_DELAY_S)
        config = SweepConfig.from_json(store.manifest()["config"])
        profile = sweep_profile(config)
        points = {p.key: p for p in plan_points(config, profile)}
        if key not in points:
            raise FicocoError(f"the sweep has no point '{key}' (its plan changed since the store was made)")
        result = run_point(config, profile, points[key], eval_out=str(store.folder / "eval" / f"{key}.json"))
        point = result.pop("point")
        return store.write_record(key, "done", point=point, started_unix=started, worker=worker, extra=result)
    except KeyboardInterrupt:
        raise  # stopped, not failed: the point stays pending (the claim goes below)
    except FicocoError as exc:
        return store.write_record(key, "failed", error=str(exc), started_unix=started, worker=worker)
    except Exception as exc:  # noqa: BLE001 - any failure of this point is this point's record, not the sweep's end
        last = traceback.format_exception_only(type(exc), exc)[-1].strip()
        return store.write_record(key, "failed", error=last[:500], started_unix=started, worker=worker)
    finally:
        stop.set()
        store.release(key)


def main(argv: list[str] | None = None) -> int:
    """`python -m ficoco.sweep.worker STORE KEY [EXECUTOR]`: exit 0 when the point is done (or was),
    1 when it failed (the record says why), 130 when interrupted."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) not in (2, 3):
        print("usage: python -m ficoco.sweep.worker STORE KEY [EXECUTOR]", file=sys.stderr)
        return 2
    try:
        record = run_stored_point(*args)
    except KeyboardInterrupt:
        return 130
    if record.get("status") == "failed":
        print(f"point {args[1]} failed: {record.get('error')}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
