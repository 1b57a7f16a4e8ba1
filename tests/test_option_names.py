"""Library messages name options by their Python keyword (`keep=`); the CLI maps them to its flags.

A user of `ficoco.flops(..., keep=9999)` never typed `--keep`: every error, warning and note the
library (ficoco/) writes names an option as its API spells it, `keep=9999` or a bare `keep=`.
`ficoco_cli.flags` is the one table of keyword -> flag; the CLI rewrites the library's messages
with it where it prints them, so the same mistake reads `--keep 9999` on the command line.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
from pathlib import Path
from typing import Any

import pytest

import ficoco
from ficoco_cli.flags import FLAGS, cli_message

ROOT = Path(__file__).resolve().parent.parent
FLAG = re.compile(r"(?<![\w-])--[a-z]")
# Command lines of other programs the library runs or tells the user to run: their flags are theirs.
OTHER_PROGRAMS = ("--porcelain", "--untracked-files=no", "ray start --head")
def _docstrings(tree: ast.AST) -> set[int]:
    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    return {id(node.body[0].value) for node in ast.walk(tree)
            if isinstance(node, kinds) and node.body and isinstance(node.body[0], ast.Expr)
            and isinstance(node.body[0].value, ast.Constant) and isinstance(node.body[0].value.value, str)}


def flags_in_library_strings(root: Path = ROOT) -> dict[str, list[str]]:
    """Every string the library's code holds (f-string parts included; docstrings and comments,
    which may explain the CLI, left out) that spells a command-line flag, by file."""
    found: dict[str, list[str]] = {}
    for path in sorted((root / "ficoco").rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        docstrings = _docstrings(tree)
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Constant) and isinstance(node.value, str)) or id(node) in docstrings:
                continue
            text = node.value
            for other in OTHER_PROGRAMS:
                text = text.replace(other, "")
            if FLAG.search(text):
                found.setdefault(path.relative_to(root).as_posix(), []).append(f"line {node.lineno}: {node.value!r}")
    return found


def test_no_library_string_spells_a_cli_flag():
    found = flags_in_library_strings()
    offending = found
    assert not offending, "name the option by its keyword (keep=), not its flag:\n" + "\n".join(
        f"{path} {line}" for path, lines in offending.items() for line in lines)


def test_the_scan_sees_messages_and_skips_docstrings(tmp_path):
    """The check itself: a flag in a raise's f-string part is found, one in a docstring is not."""
    module = tmp_path / "ficoco" / "m.py"
    module.parent.mkdir()
    module.write_text('"""Run with --keep."""\n\ndef f(n):\n    """--keep N."""\n'
                      '    raise ValueError(f"--keep {n} is too big")  # --keep\n')
    assert flags_in_library_strings(tmp_path) == {"ficoco/m.py": ["line 5: '--keep '"]}


def _library_keywords() -> set[str]:
    """The keywords of the library's entry points: what a library user passes."""
    from ficoco.api import apply
    from ficoco.calibration.vtw import calibrate_vtw
    from ficoco.models.build import build_model
    from ficoco.profiling.verify import verify
    from ficoco.report.compare import compare
    from ficoco.report.flops import flops_report
    from ficoco.report.profile import profile_config as plan_profile
    from ficoco.sweep import SweepConfig
    from ficoco.sweep.executors import ExecutorOptions
    from ficoco.sweep.figures import token_figure

    names = {f.name for cls in (SweepConfig, ExecutorOptions) for f in dataclasses.fields(cls)}
    for function in (apply, build_model, flops_report, plan_profile, compare, verify, token_figure, calibrate_vtw):
        names |= set(inspect.signature(function).parameters)
    return names


def _cli_flags() -> set[str]:
    import typer.main

    from ficoco_cli.app import app

    def commands(group: Any) -> list[Any]:  # a command group's commands, those of its sub-groups too (calibrate)
        return [c for command in group.commands.values()
                for c in ([command] if not hasattr(command, "commands") else commands(command))]

    return {opt for command in commands(typer.main.get_command(app)) for param in command.params for opt in param.opts}


def test_every_keyword_in_the_table_is_a_library_parameter_and_every_flag_a_cli_option():
    assert set(FLAGS) - _library_keywords() == set()
    assert set(FLAGS.values()) - _cli_flags() == set()


@pytest.mark.parametrize("library,command_line", [
    ("keep=9999 is outside 1..576", "--keep 9999 is outside 1..576"),
    ("give one of keep=, preset=, tflops= and schedule=, not several",
     "give one of --keep, --preset, --tflops and --schedule, not several"),
    ("unknown shape='zig': choose", "unknown --shape 'zig': choose"),
    ("schedule=: layer 3 is outside", "--schedule: layer 3 is outside"),
    ("text_tokens= must exceed 5; first_layer=2", "--text-tokens must exceed 5; --first-layer 2"),
    ("overrides=text_config.num_hidden_layers=4", "--set text_config.num_hidden_layers=4"),
    ("device_map=cpu-offload max_memory=cpu=7152MiB", "--device-map cpu-offload --max-memory cpu=7152MiB"),
    ("fidelity=True compares rows; drop reference=False", "--fidelity compares rows; drop --no-reference"),
    ("chosen by warmup=/repeat=", "chosen by --warmup/--repeat"),
    # Only whole keywords: not the tail of another name, a dotted key, a value or a config's own key.
    *[(text, text) for text in ("foo_keep=3, text_config.keep=2, x=keep=1, hidden_size=0",
                                "config value image_size='a' must be a whole number")],
])
def test_cli_message_maps_whole_keywords_to_flags(library, command_line):
    assert cli_message(library) == command_line


def _library_error(call) -> str:
    with pytest.raises(ficoco.FicocoError) as info:
        call()
    return str(info.value)


def _cli_error(cli, *args: str) -> str:
    code, _, err = cli(*args)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), (code, err)
    return lines[0]


def test_a_reach_mistake_reads_keep_in_the_library_and_dash_dash_keep_in_the_cli(cli):
    library = _library_error(lambda: ficoco.flops("llava-tiny", "v", keep=9999))
    assert library.startswith("keep=9999 is not reachable") and "--" not in library
    line = _cli_error(cli, "flops", "--model", "llava-tiny", "--variant", "v", "--keep", "9999")
    assert line.startswith("error: --keep 9999 is not reachable") and "keep=" not in line


def test_a_malformed_override_reads_overrides_in_the_library_and_set_in_the_cli(cli):
    library = _library_error(lambda: ficoco.flops("llava-tiny", overrides=["nonsense"]))
    assert library == "overrides='nonsense' is not KEY=VALUE (e.g. overrides=text_config.num_hidden_layers=4)"
    line = _cli_error(cli, "flops", "--model", "llava-tiny", "--set", "nonsense")
    assert line == "error: --set 'nonsense' is not KEY=VALUE (e.g. --set text_config.num_hidden_layers=4)"


def test_a_memory_limit_without_a_map_names_device_map_in_both_spellings(cli):
    library = _library_error(lambda: ficoco.profile("llava-tiny", "v", keep=64, max_memory="cpu=1GiB", dry_run=True))
    assert library == "max_memory= sets the limits of a device map; give device_map= too"
    line = _cli_error(cli, "profile", "--model", "llava-tiny", "--variant", "v", "--keep", "64",
                      "--max-memory", "cpu=1GiB", "--dry-run")
    assert line == "error: --max-memory sets the limits of a device map; give --device-map too"


def test_an_executor_option_for_another_executor_names_it_in_both_spellings(cli, tmp_path):
    from ficoco.sweep.executors import ExecutorOptions

    library = _library_error(lambda: ExecutorOptions(ray_address="127.0.0.1:1"))
    assert library == "ray_address= applies to the ray executor"
    line = _cli_error(cli, "sweep", "--model", "llava-tiny", "--variant", "v", "--keep", "64", "--measure",
                      "--ray-address", "127.0.0.1:1", "--out", str(tmp_path / "store"))
    assert line == "error: --ray-address applies to the ray executor"


def test_only_what_the_library_raised_is_rewritten():
    """The CLI's own checks already name flags, and may quote a value as typed (`--set keep=3`):
    an error raised outside ficoco/ is printed as it is."""
    from ficoco_cli.flags import error_text

    try:
        raise ficoco.FicocoError("--set keep=3: as typed")
    except ficoco.FicocoError as exc:
        assert error_text(exc) == "--set keep=3: as typed"
    try:
        ficoco.flops("llava-tiny", "v", keep=9999)
    except ficoco.FicocoError as exc:
        assert error_text(exc).startswith("--keep 9999 is not reachable")
