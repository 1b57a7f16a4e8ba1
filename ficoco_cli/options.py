"""Option values checked where they enter: one validator per kind of value, shared by every command.

Each validator is a Typer callback: it runs while the command line is parsed, before the
command does any work, and refuses a value that is wrong by its kind alone (a budget that is
not a finite number above 0, a negative count, an unknown choice, an output file that cannot
be written) with a `FicocoError` whose one line starts with the option's name. Checks that
need the model (is this --keep reachable, is this layer in the tower) stay with the code that
knows the model.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

import typer

from ficoco.errors import FicocoError
from ficoco.profiles import MAX_COUNT
from ficoco.report import check_output_path

# torch.manual_seed takes up to 2**64 - 1; a 32-bit seed is what numpy and most scripts use.
MAX_SEED = 2**32 - 1

T = TypeVar("T")


def option_name(param: typer.CallbackParam) -> str:
    """The option's long name as the user reads it in --help (`--model`, not `-m`)."""
    names = [name for name in param.opts if name.startswith("--")]
    return names[0] if names else param.opts[0]


def _when_given(check: Callable[[str, T], None]) -> Callable[[typer.CallbackParam, T | None], T | None]:
    """A Typer callback that runs `check(option, value)` unless the option was left out (None).

    Every validator below is one: `callback=image_size` in an option's declaration."""

    def callback(param: typer.CallbackParam, value: T | None) -> T | None:
        if value is not None:
            check(option_name(param), value)
        return value

    return callback


def whole_number(low: int, high: int = MAX_COUNT) -> Callable[[typer.CallbackParam, int | None], int | None]:
    """A whole number in [low, high]."""

    def check(option: str, value: int) -> None:
        if not low <= value <= high:
            raise FicocoError(f"{option} {value}: give a whole number from {low} to {high}")

    return _when_given(check)


def one_of_numbers(choices: Sequence[int]) -> Callable[[typer.CallbackParam, int | None], int | None]:
    """A whole number from a fixed set (bit widths)."""

    def check(option: str, value: int) -> None:
        if value not in choices:
            raise FicocoError(f"{option} {value}: choose {', '.join(map(str, choices))}")

    return _when_given(check)


def finite_above_zero(option: str, value: float) -> None:
    """A budget: a finite number above 0 (nan and inf would plan nonsense or nothing)."""
    if not (math.isfinite(value) and value > 0):
        raise FicocoError(f"{option} {value:g}: give a finite number above 0")


def finite_percent(option: str, value: float) -> None:
    """A tolerance in percent: a finite number of at least 0."""
    if not (math.isfinite(value) and value >= 0):
        raise FicocoError(f"{option} {value:g}: give a finite percentage of at least 0")


budget = _when_given(finite_above_zero)
tolerance = _when_given(finite_percent)


def choice(choices: Sequence[str]) -> Callable[[typer.CallbackParam, str | None], str | None]:
    """One of a fixed set of names."""

    def check(option: str, value: str) -> None:
        if value not in choices:
            raise FicocoError(f"unknown {option} '{value}': choose from {', '.join(choices)}")

    return _when_given(check)


def split_list(text: str, option: str) -> list[str]:
    """`a, b,,a` -> [a, b]: items stripped, empty ones skipped, repeats dropped; an empty list is an error."""
    items = [x.strip() for x in text.split(",") if x.strip()]
    if not items:
        raise FicocoError(f"{option} is empty; give a comma-separated list")
    return list(dict.fromkeys(items))


def list_of(choices: Sequence[str]) -> Callable[[typer.CallbackParam, str | None], str | None]:
    """A comma-separated list of names from a fixed set."""

    def check(option: str, value: str) -> None:
        for item in split_list(value, option):
            if item not in choices:
                raise FicocoError(f"unknown {option} '{item}': choose from {', '.join(choices)}")

    return _when_given(check)


@_when_given
def non_empty_list(option: str, value: str) -> None:
    """A comma-separated list with at least one item (its items are checked where they are parsed)."""
    split_list(value, option)


def whole_numbers(low: int, high: int = MAX_COUNT) -> Callable[[typer.CallbackParam, str | None], str | None]:
    """A comma-separated list of whole numbers in [low, high] (`--batch 1,8`)."""

    def check(option: str, value: str) -> None:
        for item in split_list(value, option):
            if not (item.isascii() and item.isdigit() and low <= int(item) <= high):
                raise FicocoError(f"{option} '{value}': '{item}' is not a whole number from {low} to {high}")

    return _when_given(check)


@_when_given
def image_size(option: str, value: str) -> None:
    """`WxH`: two whole numbers above 0."""
    parse_image_size(value, option)


@_when_given
def image_sizes(option: str, value: str) -> None:
    """`WxH[,WxH...]`: one or more image sizes."""
    parse_image_sizes(value, option)


def parse_image_sizes(text: str, option: str = "--image-size") -> tuple[tuple[int, int], ...]:
    """`WxH,WxH,...` -> ((H, W), ...), in the order given."""
    sizes = tuple(parse_image_size(part, option) for part in text.split(","))
    return tuple(size for size in sizes if size is not None)


def parse_image_size(text: str | None, option: str = "--image-size") -> tuple[int, int] | None:
    """`WxH` -> (H, W)."""
    if text is None:
        return None
    match = re.fullmatch(r"([0-9]+)[xX]([0-9]+)", text.strip())
    if not match or not all(1 <= int(side) <= MAX_COUNT for side in match.groups()):
        raise FicocoError(f"{option} '{text}' is not WIDTHxHEIGHT in pixels (e.g. 672x672)")
    return int(match[2]), int(match[1])


@_when_given
def output_file(option: str, value: str) -> None:
    """A file the command can write (`-` for stdout): checked before any work is done."""
    check_output_path(value, option)


@_when_given
def gpu_name(option: str, value: str) -> None:
    """A hardware profile's name, spelled as `load_gpu` reads it (case, spaces and _ do not matter)."""
    from ficoco.profiles import gpu_key, list_gpus

    if gpu_key(value) not in list_gpus():
        raise FicocoError(f"unknown {option} '{value}': choose from {', '.join(list_gpus())}")


@_when_given
def weights_source(option: str, value: str) -> None:
    """`random`, a checkpoint folder, or the id of a model in the local Hugging Face cache (ficoco
    loads weights offline, so an id that is not cached can only fail later)."""
    if value == "random":
        return
    path = Path(value).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FicocoError(f"{option} {value} is a folder without a config.json; give a checkpoint folder")
        return
    hint = "give random, a checkpoint folder or the id of a model in the local Hugging Face cache"
    if path.exists():
        raise FicocoError(f"{option} {value} is a file; {hint}")
    from huggingface_hub import try_to_load_from_cache

    try:
        cached = try_to_load_from_cache(value, "config.json")
    except ValueError:  # not a valid repository id either (huggingface_hub's HFValidationError)
        cached = None
    if not isinstance(cached, str):
        raise FicocoError(f"{option} '{value}': no such folder, and no cached Hugging Face model of that id; {hint}")



@_when_given
def budgets(option: str, value: str) -> None:
    """A comma-separated list of budgets, each a finite number above 0 (`--tflops 3.3,2.4,1.5`)."""
    for item in split_list(value, option):
        try:
            number = float(item)
        except ValueError:
            raise FicocoError(f"{option} '{value}': '{item}' is not a number") from None
        finite_above_zero(option, number)


@_when_given
def plot_folder(option: str, value: str) -> None:
    """A folder for figures: created when its parent exists, checked writable before any work."""
    from ficoco.sweep.figures import check_plot_folder

    check_plot_folder(value, option)


@_when_given
def output_folder(option: str, value: str) -> None:
    """A folder for a command's logs or other output: created when its parent exists, checked writable first."""
    from ficoco.sweep.figures import check_plot_folder

    check_plot_folder(value, option, holds="the output")


def each(check: Callable[[str, str], None]) -> Callable[[typer.CallbackParam, list[str] | None], list[str] | None]:
    """A repeatable option whose every value `check` checks."""

    def callback(param: typer.CallbackParam, values: list[str] | None) -> list[str] | None:
        for value in values or ():
            check(option_name(param), value)
        return values

    return callback


def hyperparameter(option: str, value: str) -> None:
    """`NAME=VALUE` (a method hyperparameter: `contextual_mode=mean`); its value is read by `method_settings`."""
    if not re.fullmatch(r"[A-Za-z_]\w*=.+", value.strip()):
        raise FicocoError(f"{option} '{value}' is not NAME=VALUE (e.g. {option} contextual_mode=mean; `ficoco methods` "
                          "lists each method's)")


_TRUE, _FALSE = ("true", "yes", "on", "1"), ("false", "no", "off", "0")


def method_settings(values: Sequence[str] | None, variants: Sequence[str], option: str = "--hp") -> dict[str, object]:
    """`--hp NAME=VALUE ...` as the library's hyperparameters: each value read as the type of that hyperparameter's
    default in the first of `variants` whose method has it (true/false for a switch, a number for a number); a name
    none of them has is left for the library to refuse, by name."""
    from ficoco.methods.registry import METHODS

    out: dict[str, object] = {}
    for text in values or ():
        name, _, raw = text.strip().partition("=")
        default = next((METHODS[v].hyperparameters[name] for v in variants
                        if v in METHODS and name in METHODS[v].hyperparameters), raw)
        if isinstance(default, bool):
            if raw.lower() not in (*_TRUE, *_FALSE):
                raise FicocoError(f"{option} {text}: {name} is a switch: give true or false")
            out[name] = raw.lower() in _TRUE
        elif isinstance(default, (int, float)):
            try:
                out[name] = type(default)(raw)
            except ValueError:
                raise FicocoError(f"{option} {text}: {name} is a {type(default).__name__}") from None
        else:
            out[name] = raw
    return out
