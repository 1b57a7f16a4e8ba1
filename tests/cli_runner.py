"""`ficoco ARGS...` run in-process through `ficoco_cli.app.main`, as the console script runs it: the
exit code and what it printed. One runner for the test files (usable in module-scoped fixtures too,
where pytest's capsys is not)."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from unittest import mock

from typer.testing import CliRunner

from ficoco_cli.app import main


def run_cli(argv: Sequence[str]) -> tuple[int, str, str]:
    """Exit code, stdout and stderr of `ficoco ARGV`."""
    with CliRunner().isolation() as (out, err, _), mock.patch.object(sys, "argv", ["ficoco", *map(str, argv)]):
        try:
            main()
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        sys.stdout.flush()  # what a command wrote with sys.stdout.write (--json -) is buffered until now
        sys.stderr.flush()
        return code, out.getvalue().decode(), err.getvalue().decode()
