"""JSON reports: written atomically so that a reader never sees half a file."""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from ficoco.errors import FicocoError


def check_output_path(path: str | None, option: str) -> None:
    """Refuse an output path that cannot be written (no folder, a folder, no permission) before any work is done."""
    if path is None or path == "-":
        return
    if not path.strip():
        raise FicocoError(f"{option} is empty; give a file path (or - for stdout)")
    folder = Path(path).expanduser().parent
    if not folder.is_dir():
        raise FicocoError(f"{option} {path}: folder {folder} does not exist; create it or choose another path")
    if Path(path).expanduser().is_dir():
        raise FicocoError(f"{option} {path} is a folder; give a file path")
    # The report is written through a temporary file beside it: try one. Permission bits alone do
    # not say it (root ignores them; /proc refuses new files whatever they say).
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as exc:
        raise FicocoError(f"{option} {path}: cannot write in {folder} ({exc.strerror or exc})") from None


def write_json_atomic(path: str, data: dict[str, Any]) -> None:
    """Write `data` as JSON to `path` (`-` for stdout) through a temporary file and a rename."""
    write_text_atomic(path, json.dumps(data, indent=2) + "\n")


def write_text_atomic(path: str, text: str) -> None:
    """Write `text` to `path` (`-` for stdout) through a temporary file and a rename."""
    if path == "-":
        sys.stdout.write(text)
        return
    target = Path(path).expanduser()  # as check_output_path reads it
    folder = target.parent if str(target.parent) else Path(".")
    if not folder.is_dir():
        raise FicocoError(f"cannot write {path}: folder {folder} does not exist")
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=folder)
    except OSError as exc:
        raise FicocoError(f"cannot write {path}: {exc.strerror or exc}") from None
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException as exc:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(exc, OSError):  # a full disk, a folder that became a file: one line, not a traceback
            raise FicocoError(f"cannot write {path}: {exc.strerror or exc}") from None
        raise


# ---- pairing each row with its vanilla row (no torch: read back by `ficoco report` and a sweep's store) ----

def own_work_vs_savings(row: dict[str, Any], base: dict[str, Any]) -> dict[str, Any] | None:
    """What the method's own work (its reduction stages and probes, `reduction_ms`) costs against
    what its fewer tokens save: ``saved_ms`` is vanilla's median less this row's model time
    without the method's work. ``eats_savings`` when the work costs at least that (DivPrune's
    search on a short prompt, say): the row would be faster without its own overhead than it is
    faster than vanilla. None for vanilla and for rows whose method ran no timed work."""
    own_ms = row.get("reduction_ms") or 0.0
    if row["variant"] == "vanilla" or own_ms <= 0:
        return None
    saved_ms = base["latency"]["median_ms"] - (row["latency"]["median_ms"] - own_ms)
    return {"own_ms": own_ms, "saved_ms": saved_ms, "eats_savings": own_ms >= saved_ms}


def add_comparisons(rows: list[dict[str, Any]]) -> None:
    """Speedup, memory saving and roofline ratio of every row against its vanilla row (same
    quant and batch) of the same run."""
    reference = {(r["quant"], r["batch"]): r for r in rows if r["variant"] == "vanilla" and r.get("status") == "ok"}
    for row in rows:
        if row.get("status") != "ok":
            continue
        latency = row["latency"]["median_ms"]
        row["achieved_tflops_per_s"] = row["analytic"]["tflops"] / (latency / 1e3)
        roofline = row["analytic"].get("roofline_ms")
        row["measured_over_roofline"] = latency / roofline if roofline else None
        predicted = row.get("predicted_ms")
        row["measured_over_predicted"] = latency / predicted if predicted else None
        base = reference.get((row["quant"], row["batch"]))
        if base is None:
            row["speedup_vs_vanilla"] = row["memory_saving_vs_vanilla"] = row["flops_ratio_vs_vanilla"] = None
            row["predicted_speedup_vs_vanilla"] = None
            continue
        row["speedup_vs_vanilla"] = base["latency"]["median_ms"] / latency
        row["flops_ratio_vs_vanilla"] = base["analytic"]["tflops"] / row["analytic"]["tflops"]
        # What this machine's rates predict for the pair (profiling/predict.py): the yardstick of the speedup.
        base_predicted = base.get("predicted_ms")
        row["predicted_speedup_vs_vanilla"] = base_predicted / predicted if base_predicted and predicted else None
        row["own_work_vs_savings"] = own_work_vs_savings(row, base)
        peak, base_peak = row["memory"].get("peak_bytes"), base["memory"].get("peak_bytes")
        row["memory_saving_vs_vanilla"] = 1 - peak / base_peak if peak and base_peak else None
        # Answering end to end (decode.py's total), when both rows generated.
        total, base_total = ((r.get("generation") or {}).get("total", {}).get("median_ms") for r in (row, base))
        if total and base_total:
            row["generation_speedup_vs_vanilla"] = base_total / total
