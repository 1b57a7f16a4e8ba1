"""The flops report (`ficoco.flops/1`): the accountant's costs of every method under one setting,
each row's saving against vanilla. `ficoco.flops(...)` returns it; `ficoco flops --json` writes the
same dict. No torch here or below: the accounting path starts in well under a second."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import ficoco
from ficoco.methods.registry import method_label
from ficoco.report.schemas import FLOPS_SCHEMA

if TYPE_CHECKING:
    from ficoco.accounting.request import ScheduleRequest


def names(value: str | Sequence[str]) -> list[str]:
    """`"vanilla, v"` or `["vanilla", "v"]` -> ["vanilla", "v"]: stripped, empty ones skipped, repeats dropped."""
    items = value.split(",") if isinstance(value, str) else list(value)
    return list(dict.fromkeys(item.strip() for item in items if item.strip()))


def flops_report(model: str, variants: str | Sequence[str] = "vanilla", *, keep: int | None = None,
                 preset: int | None = None, tflops: float | None = None, schedule: str | None = None,
                 shape: str | None = None, first_layer: int | None = None, convention: str = "flops",
                 scope: str = "llm", equivalent: bool = False, quants: str | Sequence[str] = "fp16",
                 kv_bits: int | None = None, gpu: str | None = None, text_tokens: int | None = None,
                 batch: int = 1, lm_head: str = "all", image_size: tuple[int, int] | None = None,
                 frames: int | None = None, per_layer: bool = False,
                 overrides: Sequence[str] = (), request: ScheduleRequest | None = None,
                 hyperparameters: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The analytic cost of `variants` on `model` (a profile name, a config.json or a checkout
    folder): TFLOPs by stage, KV cache, weights, memory access and, with a `gpu` hardware profile,
    the roofline time, one row per variant and quant (W/A/KV bits: fp16, int8, int4), as the
    `ficoco.flops/1` report `ficoco flops --json` writes.

    The schedule of the reducing methods is one of `keep` (visual tokens), `preset` (the
    literature's 192/128/64 row), a `tflops` budget under `convention`/`scope`, or an explicit
    `schedule` ("LAYER:REMOVED,..."); `shape` and `first_layer` refine a budget. Those six keywords
    spell one `ficoco.accounting.ScheduleRequest`, which may be given whole as `request=` instead
    (not both). `image_size`
    (H, W) and `frames` describe the input; `overrides` are "KEY=VALUE" config settings. A
    method that cannot run under the setting is left out with its reason (`skipped`).
    `hyperparameters` (`{"contextual_mode": "mean"}`) go to every variant whose method has them; each
    row's `method_label` names the method as run: its title, with ficoco's corrections of the official
    code when one is on ("VisionZip (ficoco: mean contextual token)")."""
    from ficoco import accounting as acc
    from ficoco.accounting.flops import SCOPE_STAGES, STAGES, convention_notes
    from ficoco.accounting.request import ScheduleRequest
    from ficoco.profiles import load_gpu, load_profile, set_layout
    from ficoco.versions import report_environment

    request = ScheduleRequest.of(request, keep=keep, preset=preset, tflops=tflops, schedule=schedule, shape=shape,
                                 first_layer=first_layer)
    variants = names(variants)
    profile = load_profile(model, list(overrides))
    set_layout(profile, image_size=image_size, frames=frames)
    arch = acc.architecture(profile)
    opts = acc.CountOptions(convention=convention, scope=scope, equivalent=equivalent, batch=batch,
                            text_tokens=text_tokens, lm_head_tokens=lm_head)
    quant_list = [acc.make_quant(q, kv_bits) for q in names(quants)]
    hardware = load_gpu(gpu) if gpu else None
    schedules, skipped = acc.resolve_side_by_side(arch, variants, opts, request, strict=False,
                                                  hyperparameters=hyperparameters)
    vanilla = acc.account(arch, acc.Schedule("vanilla"), quant_list[0], opts)
    rows: list[dict[str, Any]] = []
    for sched in schedules:
        layers = acc.per_layer(arch, sched, opts) if per_layer else None
        for q in quant_list:
            row = acc.account(arch, sched, q, opts, gpu=hardware).to_json()
            row = {"variant": row.pop("variant"), "method_label": method_label(sched.variant, row["settings"]), **row}
            row["reduction_vs_vanilla"] = None if sched.variant == "vanilla" else 1 - row["tflops"] / vanilla.tflops
            if layers is not None:
                row["per_layer"] = layers
            rows.append(row)
    return {
        "schema": FLOPS_SCHEMA, "ficoco_version": ficoco.__version__, "model": arch.name,
        "convention": opts.convention, "units": acc.UNITS[opts.convention], "scope": opts.scope,
        "scope_stages": list(SCOPE_STAGES[opts.scope]), "stages": list(STAGES), "equivalent": opts.equivalent,
        "text_tokens": text_tokens if text_tokens is not None else arch.text_tokens, "batch": batch,
        "lm_head_tokens": lm_head, "image_size": arch.image_size, "vision_items": arch.vision.items,
        "overrides": profile.overrides, "gpu": hardware.name if hardware else None,
        "budget_tflops": request.tflops, "keep": request.keep, "preset": request.preset,
        "environment": report_environment(), "rows": rows,
        "skipped": skipped,
        # How the convention counts sparse experts, Gated DeltaNet layers and DeepStack, where the model has them.
        **({"convention_notes": notes} if (notes := convention_notes(arch, opts.convention)) else {}),
    }
