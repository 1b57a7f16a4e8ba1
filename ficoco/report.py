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
