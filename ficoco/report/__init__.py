"""Reports: built here, for the library and the CLI alike, and written atomically so that a reader
never sees half a file.

- the schema names (`ficoco.report.schemas`);
- `flops_report` (`ficoco.flops`): the accountant's costs of every method, as `ficoco flops --json` writes;
- `profile_report` (`ficoco.profile`): measured rows, each paired with its vanilla row, as
  `ficoco profile --json` writes (it imports torch on first use; the rest of this package does not);
- `add_comparisons` / `own_work_vs_savings`: the pairing of each row with its vanilla row (its attention
  kernels against vanilla's: `ficoco.report.kernels`);
- `write_json_atomic` / `write_text_atomic` / `check_output_path`: the files.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from ficoco.errors import FicocoError
from ficoco.report.pairing import add_comparisons, own_work_vs_savings
from ficoco.report.schemas import FLOPS_SCHEMA, METHODS_SCHEMA, REPORT_SCHEMA, SWEEP_SCHEMA

__all__ = ["FLOPS_SCHEMA", "METHODS_SCHEMA", "REPORT_SCHEMA", "SWEEP_SCHEMA", "ProfilePlan", "add_comparisons",
           "check_output_path", "flops_report", "own_work_vs_savings", "profile_report", "write_json_atomic",
           "write_text_atomic"]

# The report builders load the accountant (and, for a profile, torch) on first use: the CLI's
# option checks and a sweep's store import this package for its writers alone.
_LAZY = {"flops_report": "ficoco.report.flops", "profile_report": "ficoco.report.profile",
         "ProfilePlan": "ficoco.report.profile"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'ficoco.report' has no attribute {name!r}")


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


def shareable(path: str | os.PathLike) -> None:
    """Give a file made by `tempfile.mkstemp` (private: 0600) the permissions `open()` would have given it (0666
    less the umask): reports and figures are made to be shared."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


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
        shareable(tmp)
        os.replace(tmp, target)
    except BaseException as exc:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(exc, OSError):  # a full disk, a folder that became a file: one line, not a traceback
            raise FicocoError(f"cannot write {path}: {exc.strerror or exc}") from None
        raise

