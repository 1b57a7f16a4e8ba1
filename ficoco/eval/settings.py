"""The settings of one evaluated run: lmms-eval's `--model_args` for `--model ficoco`, read into one record.

    lmms-eval --model ficoco --model_args pretrained=PATH,method=v,tflops=1.5 --tasks gqa

Every key is checked here, before a model is built: a key that is not a setting, a method's
hyperparameter or a value of the wrong kind is one FicocoError line that names what to write. The
budget keys are the CLI's (`keep`, `preset`, `tflops`, `schedule`, `shape`, `first_layer`) and spell
one `ScheduleRequest`, resolved by the accountant exactly as `ficoco flops` and `ficoco profile`
resolve it. lmms-eval splits `--model_args` at commas, so a schedule's layers are written with `;`
(`schedule=12:48;20:30`) or quoted. No torch here.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ficoco.accounting.request import ScheduleRequest
from ficoco.errors import FicocoError

VANILLA = "vanilla"
QUANTS = ("fp16", "int8", "int4")  # ficoco.models.quantize.QUANTS, without importing torch
KV_BITS = (2, 4, 8)
# FiCoCo-V/L's hyperparameters (ficoco.models.handle.Hyperparameters' fields, named here without torch).
FICOCO_HYPERPARAMETERS = ("lam", "beta", "gamma", "eps", "window", "coefficient", "equivalent_token")


@dataclass(frozen=True)
class EvalSettings:
    """One evaluated run: the checkpoint, the method and its budget, how the model is built, and how
    its cost is counted and recorded.

    Attributes:
        pretrained: a local checkpoint folder (weights, config, processor files); read offline.
        method: a variant of `ficoco methods` (vanilla, v, l, fastv, ...).
        request: the budget (keep / preset / tflops / schedule, shape, first_layer).
        hyperparameters: the method's own settings (`ficoco methods` lists them with their defaults).
        quant: the weights: fp16 (the dtype's), int8 or int4 (bitsandbytes).
        kv_bits: a quantized KV cache (hqq) of 8, 4 or 2 bits; None: the dtype's.
        device: auto (CUDA when there is one), cpu, cuda, cuda:N.
        dtype: auto, bf16, fp16, fp32 (`ficoco profile --dtype`).
        batch_size: requests per forward, as lmms-eval's --batch_size (requests of one layout only).
        convention, scope, text_tokens: how the budget is resolved and the cost counted (`ficoco flops`).
        frames: the frames sampled from a video (None: the profile's).
        max_new_tokens: a cap on every request's generation (None: the task's own).
        out: where the `ficoco.eval/1` record is written (None: ficoco-eval/<run>.json).
        attn_implementation: sdpa (default) or eager.
        profile: a ficoco profile (`ficoco models`) whose defaults (first reducing layers, text tokens,
            frames) the checkpoint takes, as `ficoco profile --model NAME --weights PATH` does; None: the
            family's (the 7B checkpoints').
    """

    pretrained: str
    method: str = VANILLA
    request: ScheduleRequest = field(default_factory=ScheduleRequest)
    hyperparameters: Mapping[str, Any] = field(default_factory=dict)
    quant: str = "fp16"
    kv_bits: int | None = None
    device: str = "auto"
    dtype: str = "auto"
    batch_size: int = 1
    convention: str = "flops"
    scope: str = "llm"
    text_tokens: int | None = None
    frames: int | None = None
    max_new_tokens: int | None = None
    out: str | None = None
    attn_implementation: str = "sdpa"
    profile: str | None = None

    def budget(self) -> dict[str, Any]:
        """The budget as given ({} for a method's default setting, or vanilla)."""
        return {name: value for name, value in dataclasses.asdict(self.request).items() if value is not None}

    def to_json(self) -> dict[str, Any]:
        values = dataclasses.asdict(self)
        values["request"] = self.budget()
        values["hyperparameters"] = dict(self.hyperparameters)
        return values


def _text(key: str, value: Any) -> str:
    text = str(value).strip()
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "\"'":  # lmms-eval keeps a quoted value's quotes
        text = text[1:-1]
    if not text:
        raise FicocoError(f"model_args: {key}= is empty; give it a value or leave it out")
    return text


def _whole(key: str, value: Any, least: int = 1) -> int:
    try:
        number = int(value) if not isinstance(value, bool) and float(value) == int(float(value)) else None
    except (TypeError, ValueError):
        number = None
    if number is None or number < least:
        raise FicocoError(f"model_args: {key}={value} must be a whole number of at least {least}")
    return number


def _positive(key: str, value: Any) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = float("nan")
    if isinstance(value, bool) or not number > 0:
        raise FicocoError(f"model_args: {key}={value} must be a positive number (e.g. {key}=1.5)")
    return number


def _hyperparameter(value: Any) -> Any:
    """A hyperparameter's value as lmms-eval parsed it (bool, int, float), a JSON list, or the text."""
    if isinstance(value, str):
        text = value.strip().strip("\"'")
        try:
            return json.loads(text)
        except ValueError:
            return text
    return value


def parse_model_args(args: Mapping[str, Any]) -> EvalSettings:
    """The settings of `--model_args` as lmms-eval hands them to the model (a dict of parsed values),
    with its own --batch_size and --device; one FicocoError line for anything wrong."""
    from ficoco.accounting import VARIANTS
    from ficoco.accounting.flops import CONVENTIONS, SCOPES
    from ficoco.methods.registry import METHODS

    given = {str(k).strip(): v for k, v in args.items() if v is not None}
    if "pretrained" not in given:
        raise FicocoError("model_args: give pretrained=PATH, a local checkpoint folder (weights, config.json and "
                          "its processor files)")
    values: dict[str, Any] = {"pretrained": _text("pretrained", given.pop("pretrained"))}
    method = _text("method", given.pop("method", VANILLA)).lower()
    if method not in VARIANTS:
        raise FicocoError(f"model_args: method={method} is not a method; choose from {', '.join(VARIANTS)} "
                          "(`ficoco methods` lists them)")
    values["method"] = method
    budget: dict[str, Any] = {}
    for key in ("keep", "preset", "first_layer"):
        if key in given:
            budget[key] = _whole(key, given.pop(key), 0 if key == "first_layer" else 1)
    if "tflops" in given:
        budget["tflops"] = _positive("tflops", given.pop("tflops"))
    if "schedule" in given:
        budget["schedule"] = _text("schedule", given.pop("schedule")).replace(";", ",").replace(" ", "")
    if "shape" in given:
        budget["shape"] = _text("shape", given.pop("shape"))
    if method == VANILLA and any(k in budget for k in ("keep", "preset", "tflops", "schedule")):
        raise FicocoError("model_args: method=vanilla reduces nothing and takes no budget; drop "
                          f"{', '.join(k + '=' for k in budget)} or name a method")
    values["request"] = ScheduleRequest(**budget)
    quant = _text("quant", given.pop("quant", "fp16")).lower()
    if quant not in QUANTS:
        raise FicocoError(f"model_args: quant={quant}: choose from {', '.join(QUANTS)}")
    values["quant"] = quant
    if "kv_bits" in given:
        bits = _whole("kv_bits", given.pop("kv_bits"))
        if bits not in KV_BITS:
            raise FicocoError(f"model_args: kv_bits={bits}: choose from {', '.join(map(str, KV_BITS))} (a quantized "
                              "KV cache), or leave it out")
        values["kv_bits"] = bits
    device = _text("device", given.pop("device", "auto")).lower()
    if not (device in ("auto", "cpu", "cuda") or device.startswith("cuda:")):
        raise FicocoError(f"model_args: device={device}: choose auto, cpu, cuda or cuda:N")
    values["device"] = device
    values["dtype"] = _text("dtype", given.pop("dtype", "auto")).lower()
    if values["dtype"] not in ("auto", "bf16", "fp16", "fp32"):
        raise FicocoError(f"model_args: dtype={values['dtype']}: choose auto, bf16, fp16 or fp32")
    batch = given.pop("batch_size", 1)
    if str(batch).strip().lower().startswith("auto"):
        raise FicocoError("batch_size auto is not supported by ficoco (a reduced model's memory is not a vanilla "
                          "one's): give a number")
    values["batch_size"] = _whole("batch_size", batch)
    given.pop("max_batch_size", None)
    convention = _text("convention", given.pop("convention", "flops")).lower()
    if convention not in CONVENTIONS:
        raise FicocoError(f"model_args: convention={convention}: choose from {', '.join(CONVENTIONS)}")
    scope = _text("scope", given.pop("scope", "llm")).lower()
    if scope not in SCOPES:
        raise FicocoError(f"model_args: scope={scope}: choose from {', '.join(SCOPES)}")
    values.update(convention=convention, scope=scope)
    for key in ("text_tokens", "frames", "max_new_tokens"):
        if key in given:
            values[key] = _whole(key, given.pop(key))
    for key in ("out", "profile"):
        if key in given:
            values[key] = _text(key, given.pop(key))
    attention = _text("attn_implementation", given.pop("attn_implementation", "sdpa")).lower()
    if attention not in ("sdpa", "eager"):
        raise FicocoError(f"model_args: attn_implementation={attention}: choose sdpa or eager")
    values["attn_implementation"] = attention
    # Whatever is left is the method's own hyperparameters.
    allowed = tuple(METHODS[method].hyperparameters) if method in METHODS else ()
    if method in ("v", "l"):
        allowed = (*allowed, *FICOCO_HYPERPARAMETERS)
    unknown = [key for key in given if key not in allowed]
    if unknown:
        settings = ("pretrained, method, keep, preset, tflops, schedule, shape, first_layer, quant, kv_bits, device, "
                    "dtype, convention, scope, text_tokens, frames, max_new_tokens, out, attn_implementation, profile")
        extra = f"; {method}'s hyperparameters: {', '.join(dict.fromkeys(allowed))}" if allowed else ""
        raise FicocoError(f"model_args: unknown key {', '.join(k + '=' for k in unknown)}; the settings are "
                          f"{settings}{extra}")
    defaults = dict(METHODS[method].hyperparameters) if method in METHODS else {}
    if method in ("v", "l"):
        defaults = {**METHODS["l"].hyperparameters, **METHODS["v"].hyperparameters, **defaults}
    values["hyperparameters"] = {key: _of_kind(method, key, _hyperparameter(value), defaults.get(key))
                                 for key, value in given.items()}
    return EvalSettings(**values)


def _of_kind(method: str, key: str, value: Any, default: Any) -> Any:
    """`value` as the kind of the hyperparameter's default (a whole number where the default is one, a number,
    a flag, a list, a word), or one line naming the kind."""
    wrong = FicocoError(f"model_args: {key}={value!r} for {method}: give {_kind(default)} (the default is "
                        f"{key}={default!r})")
    if default is None:
        return value
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise wrong
        return value
    if isinstance(default, int) and not isinstance(value, bool) and isinstance(value, (int, float)):
        if float(value) != int(value):
            raise wrong
        return int(value)
    if isinstance(default, float) and not isinstance(value, bool) and isinstance(value, (int, float)):
        return float(value)
    if isinstance(default, (tuple, list)) and isinstance(value, list):
        return value
    if isinstance(default, str) and isinstance(value, str):
        return value
    raise wrong


def _kind(default: Any) -> str:
    if isinstance(default, bool):
        return "true or false"
    if isinstance(default, int):
        return "a whole number"
    if isinstance(default, float):
        return "a number"
    if isinstance(default, (tuple, list)):
        return "a list such as [2,6,15] (quoted)"
    return "a word"


def model_args_string(settings: Mapping[str, Any]) -> str:
    """`--model_args` for lmms-eval from settings (None values left out); a schedule's commas as `;`."""
    parts = []
    for key, value in settings.items():
        if value is None:
            continue
        text = str(value).replace(",", ";") if key == "schedule" else str(value)
        if "," in text or "=" in text:
            raise FicocoError(f"{key}={text}: a model_args value cannot hold ',' or '='")
        parts.append(f"{key}={text}")
    return ",".join(parts)


__all__ = ["EvalSettings", "model_args_string", "parse_model_args"]
