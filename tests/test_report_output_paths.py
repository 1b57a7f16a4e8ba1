"""Output paths (--json, --output): refused before any work when they cannot be written, and a
write that fails anyway is one user error, not a traceback (issue 18)."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

import pytest

import ficoco.report as report
from ficoco.errors import FicocoError
from ficoco.report import check_output_path, write_text_atomic


def unwritable_folder(tmp_path: Path) -> Path:
    """A folder this process cannot create files in: chmod 555, or /proc where that does not stop it (root)."""
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(stat.S_IRUSR | stat.S_IXUSR)
    return locked if not os.access(locked, os.W_OK) else Path("/proc")


def test_a_folder_that_takes_no_new_file_is_refused_before_any_work(tmp_path):
    folder = unwritable_folder(tmp_path)
    with pytest.raises(FicocoError, match=f"--json {folder}/r.json: cannot write in {folder}"):
        check_output_path(str(folder / "r.json"), "--json")


@pytest.mark.parametrize("path", ["", " "])
def test_a_blank_output_path_is_refused(path):
    with pytest.raises(FicocoError, match="--output is empty"):
        check_output_path(path, "--output")


def test_a_writable_path_and_stdout_pass_and_leave_nothing_behind(tmp_path):
    check_output_path(str(tmp_path / "r.json"), "--json")
    check_output_path("-", "--json")
    assert list(tmp_path.iterdir()) == []


def test_a_write_that_fails_midway_is_one_user_error_and_leaves_no_temporary_file(tmp_path, monkeypatch):
    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(report.os, "replace", full_disk)
    with pytest.raises(FicocoError, match="cannot write .*r.json: No space left on device"):
        write_text_atomic(str(tmp_path / "r.json"), "{}")
    assert list(tmp_path.iterdir()) == []


def test_a_written_report_is_readable_by_others_as_open_would_make_it(tmp_path: Path) -> None:
    umask = os.umask(0o022)
    try:
        target = tmp_path / "report.json"
        report.write_json_atomic(str(target), {"rows": []})
        assert stat.S_IMODE(target.stat().st_mode) == 0o644  # not mkstemp's private 0600
    finally:
        os.umask(umask)
