"""The CLI's spelling of the options the library names in its messages.

The library (ficoco/) names an option in an error, warning or note by its Python keyword, as its
API spells it, followed by `=`: `keep=9999 is outside 1..576`, `give one of keep=, tflops= or
schedule=`. It never spells a command-line flag: a user of `ficoco.apply(model, "v", keep=...)`
did not type `--keep`. The CLI owns the flags, so this table of keyword -> flag is the one place
that knows both; `cli_message` rewrites a library message for the terminal: `keep=9999` becomes
`--keep 9999`, a bare `keep=` becomes `--keep`, `fidelity=True` becomes `--fidelity` and
`reference=False` becomes `--no-reference`.
"""

from __future__ import annotations

import re
from pathlib import Path
from types import TracebackType

# Library keyword (a parameter of ficoco.apply, ficoco.flops, ficoco.profile, build_model,
# SweepConfig, ExecutorOptions, compare or verify) -> the flag that sets it on the command line.
# Several keywords may share one flag (`variant` for apply, `variants` for the reports).
FLAGS: dict[str, str] = {
    "model": "--model",
    "variant": "--variant",
    "variants": "--variant",
    "keep": "--keep",
    "preset": "--preset",
    "tflops": "--tflops",
    "schedule": "--schedule",
    "shape": "--shape",
    "first_layer": "--first-layer",
    "convention": "--convention",
    "scope": "--scope",
    "equivalent": "--equivalent",
    "quant": "--quant",
    "quants": "--quant",
    "kv_bits": "--kv-bits",
    "gpu": "--gpu",
    "text_tokens": "--text-tokens",
    "batch": "--batch",
    "batches": "--batch",
    "lm_head": "--lm-head",
    "image_size": "--image-size",
    "frames": "--frames",
    "per_layer": "--per-layer",
    "overrides": "--set",
    "hyperparameters": "--hp",
    "reference": "--no-reference",  # a switch the CLI has only in its negative form
    "new_tokens": "--new-tokens",
    "warmup": "--warmup",
    "repeat": "--repeat",
    "device": "--device",
    "weights": "--weights",
    "image": "--image",
    "prompt": "--prompt",
    "video": "--video",
    "fidelity": "--fidelity",
    "seed": "--seed",
    "dtype": "--dtype",
    "device_map": "--device-map",
    "max_memory": "--max-memory",
    "measure": "--measure",
    "samples": "--samples",
    "workers": "--workers",
    "gpus_per_point": "--gpus-per-point",
    "cpus_per_point": "--cpus-per-point",
    "ray_address": "--ray-address",
    "slurm_partition": "--slurm-partition",
    "timeout_min": "--timeout-min",
    "tolerance_pct": "--tolerance",
    "tolerance_percent": "--tolerance",
    "judge": "--judge",
    "cross_machine": "--cross-machine",
    "absolute": "--absolute",
    "layer": "--layer",
    # ficoco calibrate (ficoco.calibration)
    "eta": "--eta",
    "limit": "--limit",
    # ficoco eval (SweepConfig's evaluation fields)
    "eval_tasks": "--tasks",
    "eval_include": "--include-path",
    "eval_limit": "--limit",
    "eval_batch_size": "--batch-size",
    "eval_max_new_tokens": "--max-new-tokens",
}

# `name=` where name is a whole keyword: not the tail of a longer name (`foo_keep=`), of a dotted
# key (`--set text_config.keep=`) or of a flag. What follows decides the form: a value
# (`keep=64` -> `--keep 64`, an absolute path `image=/data/a.png` -> `--image /data/a.png`), True/False
# for a switch, or nothing (`keep=,` -> `--keep,`; `image=/video=` lists alternatives: `--image/--video`).
_KEYWORD = re.compile(r"(?<![\w.\-=])(" + "|".join(sorted(FLAGS, key=len, reverse=True)) + r")=(True|False)?"
                      r"(?=((?:[^\s,;:/)\]]|/(?![A-Za-z_]+=))?))")
_LIBRARY = Path(__file__).resolve().parent.parent / "ficoco"


# The library quotes a model config's own keys as `config value image_size=336`: a key, not an option.
_CONFIG_VALUE = "config value "


def _flag(match: re.Match[str]) -> str:
    if match.string.endswith(_CONFIG_VALUE, 0, match.start()):
        return match.group(0)
    flag = FLAGS[match.group(1)]
    switch, following = match.group(2), match.group(3)
    negative = flag.startswith("--no-")
    if switch == "True":
        return "--" + flag[len("--no-"):] if negative else flag
    if switch == "False":
        return flag if negative else "--no-" + flag[2:]
    return f"{flag} " if following else flag


def cli_message(message: str) -> str:
    """A library message as the command line reads it: each `keyword=` the table knows becomes its flag."""
    return _KEYWORD.sub(_flag, message)


def raised_in_library(exc: BaseException) -> bool:
    """Whether `exc` was raised by code in the library (ficoco/), not by the CLI's own checks
    (which already name their flags)."""
    tb: TracebackType | None = exc.__traceback__
    last = None
    while tb is not None:
        last = tb
        tb = tb.tb_next
    if last is None:
        return False
    return Path(last.tb_frame.f_code.co_filename).resolve().is_relative_to(_LIBRARY)


def error_text(exc: BaseException) -> str:
    """The message of an error the CLI prints: mapped to flags when the library raised it."""
    message = str(exc)
    return cli_message(message) if raised_in_library(exc) else message
