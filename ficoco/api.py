"""The one-call public API: `build_model()` and `apply()`.

    model = ficoco.build_model("llava-1.5-7b", dtype="bf16")
    with ficoco.apply(model, variant="v", tflops=1.5) as handle:
        logits = model(**inputs).logits
        handle.records            # kept / discarded indices per reducing layer
"""

from __future__ import annotations

import dataclasses
from typing import Any

from torch import nn

from ficoco.accounting import CountOptions, ScheduleRequest, architecture, resolve_schedule
from ficoco.accounting.schedule import Schedule, plan_tokens
from ficoco.errors import FicocoError
from ficoco.methods.base import RULE
from ficoco.methods.registry import METHODS, method
from ficoco.models import adapter_for, hf_compat
from ficoco.models.attention import SUPPORTED_ATTENTION, check_attention_implementation  # noqa: F401
from ficoco.models.build import build_model
from ficoco.models.entry import Entry
from ficoco.models.handle import Handle, Hyperparameters, LayerRecord
from ficoco.models.patching import method_settings
from ficoco.profiles import FAMILY_DEFAULTS, Profile

__all__ = ["Handle", "Hyperparameters", "LayerRecord", "ScheduleRequest", "apply", "build_model", "profile_of"]


def profile_of(model: nn.Module, name: str | None = None) -> Profile:
    """A profile for a built model, from its own config (so accounting matches what runs)."""
    if not hasattr(model, "config") or not hasattr(model.config, "to_dict"):
        raise FicocoError(f"{type(model).__name__} is not a Hugging Face model (no config); build one with "
                          "ficoco.build_model or transformers")
    config = model.config.to_dict()
    model_type = config.get("model_type")
    if model_type not in FAMILY_DEFAULTS:
        raise FicocoError(f"model_type '{model_type}' is not supported; supported: {', '.join(FAMILY_DEFAULTS)}")
    defaults = dict(FAMILY_DEFAULTS[model_type])
    defaults.update(getattr(model, "_ficoco_defaults", {}) or {})
    return Profile(name=name or getattr(model, "name_or_path", "") or model_type, config=config, defaults=defaults)


def check_cache_implementation(model: nn.Module) -> None:
    """Refuse, at apply(), a generation config that asks for a cache the patches cannot serve:
    a pre-allocated (static, offloaded, sliding-window...) cache holds the same length in every
    layer, while FiCoCo-L's reduced layers cache fewer tokens than the others."""
    generation = getattr(model, "generation_config", None)
    implementation = getattr(generation, "cache_implementation", None)
    if implementation not in (None, "dynamic"):
        raise FicocoError(f"cache_implementation '{implementation}' is not supported by the FiCoCo patches; "
                          "set model.generation_config.cache_implementation = None (the default dynamic cache)")


def _with_corrections(spec: Any, schedule: Schedule, given: dict[str, Any]) -> Schedule:
    """A resolved `schedule` with the method hyperparameters given beside it: ficoco's corrections of the official
    code (`MethodSpec.corrections`, which change how it runs, not its count) join its settings, so the run and its
    label agree; any other was planned into the schedule already and is refused rather than dropped."""
    if not given:
        return schedule
    from ficoco.accounting.methods import check_corrections

    # A named rule (FiCoCo's rule="official") goes with a resolved schedule as a correction does: it changes how
    # the method runs, not the schedule given.
    planned = sorted(set(given) - set(spec.corrections) - ({RULE} if spec.rules else set()))
    if planned:
        raise FicocoError(f"{spec.title} hyperparameter(s) {', '.join(planned)} set the schedule: give them with "
                          "keep= or preset= instead of a resolved schedule= (or plan the schedule with them)")
    spec.rule(given)
    check_corrections(spec, given)
    settings = {**schedule.settings_dict(), **given}
    return Schedule(schedule.variant, schedule.removals,
                    tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in settings.items()))


def apply(model: nn.Module, variant: str, *, schedule: Schedule | str | dict[int, int] | None = None,
          keep: int | None = None, tflops: float | None = None, count: CountOptions | None = None,
          first_layer: int | None = None, shape: str | None = None, image_size: tuple[int, int] | None = None,
          frames: int | None = None, preset: int | None = None, request: ScheduleRequest | None = None,
          **hyperparameters: Any) -> Handle:
    """Patch `model` with a reduction method (`ficoco methods` lists them) and return the handle.

    The schedule comes from the accountant: an explicit `schedule` (a Schedule, `"12:40,..."`
    or {layer: removed}), `keep` visual tokens (each method's `--keep` meaning), a `preset`
    (the literature's 192/128/64 row), or a `tflops` budget under `count`'s convention and scope;
    methods other than FiCoCo-V and -L fall back to their official default setting. Those keywords
    (with `shape` and `first_layer`) are the spelling of one `ficoco.accounting.ScheduleRequest`,
    which may be given whole as `request=` instead (not both); a resolved `Schedule` is used as it
    is. `image_size`
    (H, W) and `frames` describe the input where the token count depends on them (LLaVA-NeXT,
    Qwen2-VL, Video-LLaVA); the profile's defaults otherwise. Hyperparameters default to the
    paper's: FiCoCo's (see `Hyperparameters`), or the method's registry entry's.
    """
    spec = method(variant) if variant in METHODS else None
    if spec is None:
        raise FicocoError(f"variant must be one of {', '.join(METHODS)} (`ficoco methods` lists them), "
                          f"got '{variant}'")
    spec.check_wired("ficoco.apply")
    if "_ficoco_handle" in model.__dict__:
        raise FicocoError("this model is already patched; call handle.remove() first")
    # On a transformers release outside the tested range: one warning line, then what changed named
    # in one line (never a crash inside a forward first); on every release, the model's paths.
    hf_compat.ensure_supported(model)
    check_attention_implementation(model)
    check_cache_implementation(model)
    profile = profile_of(model, getattr(model, "_ficoco_profile_name", None))
    arch = architecture(profile, image_size=image_size, frames=frames)
    spec.check_runs(arch.family, arch.name)  # before anything is planned or patched: one line on why not
    opts = count or CountOptions()
    if not isinstance(schedule, Schedule):  # the request, checked once, before anything is planned
        request = ScheduleRequest.of(request, keep=keep, preset=preset, tflops=tflops, schedule=schedule, shape=shape,
                                     first_layer=first_layer)
    elif request is not None:
        raise FicocoError("give request= or a resolved schedule=, not both")
    fields = {f.name for f in dataclasses.fields(Hyperparameters)}
    if isinstance(schedule, Schedule):
        sched = schedule
        unknown = sorted(set(hyperparameters) - set(spec.hyperparameters) - fields)
        if unknown:
            raise FicocoError(f"unknown hyperparameter {', '.join(unknown)} for {spec.title}: choose from "
                              f"{', '.join(dict.fromkeys([*spec.hyperparameters, *fields]))}")
        sched = _with_corrections(spec, sched, {k: v for k, v in hyperparameters.items() if k not in fields})
    else:
        # The entry's planner plans every method: the request's keep / preset / budget / schedule, and the
        # hyperparameters (checked against the entry's).
        sched = resolve_schedule(arch, variant, opts, request, hyperparameters=hyperparameters)
    # FiCoCo's hyperparameters live on the handle (set per handle); the others in the schedule's settings.
    params = Hyperparameters(**{name: value for name, value in hyperparameters.items() if name in fields})
    if sched.variant != variant:
        raise FicocoError(f"the schedule is for variant '{sched.variant}', not '{variant}'")
    spec.check_rule_runs(arch.family, arch.name, sched.settings_dict())  # a resolved schedule's rule too
    adapter = adapter_for(model)
    handle = Handle(model=model, variant=variant, schedule=sched, hyperparameters=params)
    # How the method's attention reads compute their scores (the official rule unless a correction says float32).
    handle.attention_scores = method_settings(handle, spec, sched).get("attention_scores", handle.attention_scores)
    removed = sched.removed_at()
    # The wrappers go in even for an empty schedule, so that "nothing removed" runs through
    # the patched path and can be checked against the unpatched model. A refusal on the way
    # leaves the model as it was.
    try:
        _install(adapter, handle, spec, sched, arch, removed, request.first_layer if request else first_layer)
    except BaseException:
        handle._patches.undo()
        raise
    model.__dict__["_ficoco_handle"] = handle
    return handle


def _install(adapter: Any, handle: Handle, spec: Any, sched: Schedule, arch: Any, removed: dict[int, int],
             first_layer: int | None) -> None:
    """Put the method's hook points into the model (`apply`'s second half)."""
    if spec.placement == "layer_input":
        adapter.patch_layer_input(handle, handle._patches, spec, sched)
    elif spec.per_item:
        # Before the LLM (in tower layers, at the tower's output or after the projector): the prompt's
        # image spans are shortened to the planned count, or to the measured one for an adaptive count.
        adaptive = bool(sched.settings_dict().get("adaptive"))
        reaching = plan_tokens(arch, sched).llm_visual_tokens
        if reaching > arch.visual_tokens:
            # The prompt's placeholders are shortened, never lengthened.
            raise FicocoError(f"{spec.title} with this setting hands the LLM {reaching} visual tokens, more than the "
                              f"{arch.visual_tokens} placeholders of the prompt; keep at most {arch.visual_tokens}")
        handle.keep_per_image = None if adaptive else reaching
        adapter.patch_tower(handle, handle._patches, spec, sched)
        inner = tuple(r for r in sched.removals if r.stage == "llm")
        if spec.inner is not None and inner:  # the method's part inside the LLM (HoliTom's merge)
            adapter.patch_layer_input(handle, handle._patches, spec.inner, Schedule(sched.variant, inner,
                                                                                    sched.settings))
    else:
        if removed:
            start = min(removed)
        elif first_layer is not None:
            start = first_layer
        else:  # nothing removed: from the entry's first reducing layer (FiCoCo-L), else every layer (FitPrune)
            start = arch.first_reducing_layer(spec.name) if "first_layer" in spec.hyperparameters else 0
        adapter.patch_in_layer(handle, handle._patches, spec, sched, start)
    Entry(adapter, handle, spec, handle.keep_per_image).install(handle._patches)
