"""The one-call public API: `build_model()` and `apply()`.

    model = ficoco.build_model("llava-1.5-7b", dtype="bf16")
    with ficoco.apply(model, variant="v", tflops=1.5) as handle:
        logits = model(**inputs).logits
        handle.records            # kept / discarded indices per reducing layer
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor, nn

from ficoco import testing_hooks
from ficoco.accounting import CountOptions, architecture, resolve_schedule
from ficoco.accounting.schedule import Schedule, plan_tokens
from ficoco.errors import FicocoError
from ficoco.methods.hyperparameters import Hyperparameters
from ficoco.methods.registry import METHODS, method
from ficoco.models import adapter_for, hf_compat
from ficoco.models.attention import SUPPORTED_ATTENTION, check_attention_implementation  # noqa: F401
from ficoco.models.build import build_model
from ficoco.models.patching import LanguageState, Patches
from ficoco.profiles import FAMILY_DEFAULTS, Profile
from ficoco.profiling.stage_timer import StageTimer

__all__ = ["Handle", "Hyperparameters", "LayerRecord", "apply", "build_model", "profile_of"]


@dataclass(frozen=True)
class LayerRecord:
    """One reducing layer of the last forward: kept and discarded token indices.

    For V they are flat indices on the original patch grid (row-major), per vision item; for L
    they are offsets inside the original image span, per sample. `merged_into`, for a method
    that merges, holds for every discarded token (in `discarded`'s order and index space) the
    kept token that received the largest share of it; None for a method that only drops.
    """

    stage: str
    layer: int
    kept: Tensor
    discarded: Tensor
    merged_into: Tensor | None = None


@dataclass
class Handle:
    """A model patched with FiCoCo; `remove()` (or leaving a `with` block) restores it.

    The patched model stays a Hugging Face model; where its outputs differ in shape from the
    unpatched model's, this is what they mean:

    - **Output positions.** FiCoCo-V runs the LLM on a prompt whose image spans are shortened,
      FiCoCo-L drops visual tokens inside the decoder: logits and the last hidden states of a
      prefill hold fewer positions than `input_ids`. After every forward, `output_positions`
      ``(B, T_out)`` gives the position in that call's `input_ids` of every output position
      (inside `generate`: in the prompt the caller gave `generate`); a call that removed nothing
      gives ``0..T-1``. `torch.gather(input_ids, 1, handle.output_positions)` lines the inputs up
      with the logits.
    - **Labels.** `model(**inputs, labels=labels)` with `labels` shaped like `input_ids` returns
      the model's own causal-LM loss over the positions that remain: the labels are taken at
      `output_positions`, so the logits at each remaining position are scored against the next
      remaining token. Image placeholders carry -100 in every family's label convention, so the
      terms are the same text tokens as the unpatched model's; only the token before the first
      text token after an image may be a different (kept, merged) visual token. With an empty
      schedule the loss is the unpatched model's.
    - **generate** returns the caller's own prompt followed by the new tokens (tensor and
      `.sequences`), whatever the variant; scores and logits are one per new token.
    - `output_hidden_states=True` gives one tensor per layer, each as long as the sequence that
      layer really ran on; `output_attentions=True` (attn_implementation='eager') one matrix per
      layer, the one that layer really computed.
    """

    model: nn.Module
    variant: str
    schedule: Schedule
    hyperparameters: Hyperparameters
    keep_per_image: int | None = None
    # Spans "reduction" (the reduction stages) and "probe" (reducing layers' attention, which
    # also yields the probabilities), timed without host synchronisation.
    timer: StageTimer = field(default_factory=StageTimer, repr=False)
    vision_state: Tensor | None = None
    # A method acting before the LLM: its current tower forward (ficoco.models.vision_steps), and the
    # visual tokens every item of the last image call handed the LLM, as measured (PruMerge+'s
    # adaptive count, or the planned count of any other method; a Video-LLaVA frame's [CLS] apart).
    tower_state: Any = None
    measured_tokens_per_item: int | None = None
    # The prompt (input_ids, attention_mask) of the image call in progress, as the entry received it:
    # a method before the LLM that reads the instruction (CDPruner) embeds its text tokens from it.
    prompt_ids: tuple[Tensor, Tensor | None] | None = field(default=None, repr=False)
    # Qwen2.5-VL under FiCoCo-V: the query-key pairs every vision layer of the last tower pass ran
    # (its windows, as the reduction left them), for flops --verify's accountant.
    vision_attention_pairs: dict[int, int] = field(default_factory=dict, repr=False)
    language_state: LanguageState | None = None
    # (B, T_out) position in the last forward's input_ids of every output position (see above).
    output_positions: Tensor | None = None
    # FiCoCo-L: the state that filled each cache the handle has seen (decode steps and later
    # turns follow the cache they are given); weak, so caches are freed as usual.
    cache_states: weakref.WeakKeyDictionary = field(default_factory=weakref.WeakKeyDictionary, repr=False)
    # FiCoCo-V: the last shortened prompt (kept positions, caller's length), so that decode
    # steps whose attention mask grew from the caller's prompt line up with the cache.
    prompt_map: tuple[Tensor, int] | None = field(default=None, repr=False)
    # flops --verify: runs a method's own work at a layer through a counter's module (see run_method).
    method_runner: Callable[..., Any] | None = field(default=None, repr=False)
    _patches: Patches = field(default_factory=Patches, repr=False)
    # Records stay on the model's device until read: copying them to the host per layer would
    # synchronise the device inside the forward.
    _pending: list[LayerRecord] = field(default_factory=list, repr=False)
    _records: list[LayerRecord] = field(default_factory=list, repr=False)

    @property
    def records(self) -> list[LayerRecord]:
        """Per reducing layer of the last forward: kept and discarded indices (on the CPU)."""
        if self._pending:
            self._records += [LayerRecord(r.stage, r.layer, r.kept.cpu(), r.discarded.cpu(),
                                          None if r.merged_into is None else r.merged_into.cpu())
                              for r in self._pending]
            self._pending = []
        return self._records

    def run_method(self, layer: int | tuple[str, int | None], function: Callable[..., Any], *args: Any,
                   **kwargs: Any) -> Any:
        """Run a method's own work at decoder layer `layer` (its steps and probes), or where a
        vision-side method runs it (``("vision", tower layer)`` or ``("projector", None)``), inside
        the "reduction" span; `method_runner`, when set (flops --verify), runs it instead, so that
        counters can attribute it to the method."""
        device = next((t.device for a in (*args, *kwargs.values())
                       for t in (a, getattr(a, "hidden", None)) if isinstance(t, Tensor)), None)
        with self.timer.span("reduction", device) if device is not None else contextlib.nullcontext():
            if testing_hooks.REDUCTION_DELAY_S:  # test-only slowdown (FICOCO_TEST_DELAY_REDUCTION_MS), off unless set
                testing_hooks.delay_reduction()
            if self.method_runner is not None:
                return self.method_runner(layer, function, *args, **kwargs)
            return function(*args, **kwargs)

    @property
    def reduction_seconds(self) -> float:
        """Seconds in the reduction stages since the timer's last reset (waits for the device)."""
        return self.timer.total_ms("reduction") / 1e3

    def begin_forward(self) -> None:
        """A new image forward: forget the previous one's records and vision state. FiCoCo-L's
        state stays until the entry replaces it: a new turn on its cache needs what each layer
        cached."""
        self._pending, self._records = [], []
        self.vision_state = None
        self.output_positions = None

    def record(self, stage: str, layer: int, *, kept: Tensor, discarded: Tensor,
               merged_into: Tensor | None = None) -> None:
        self._pending.append(LayerRecord(stage, layer, kept.detach(), discarded.detach(),
                                         None if merged_into is None else merged_into.detach()))

    def remove(self) -> None:
        """Restore the model exactly as it was before `apply`."""
        self._patches.undo()
        self.language_state = self.vision_state = self.output_positions = self.prompt_map = None
        self.prompt_ids = None
        self.tower_state = None
        self.cache_states.clear()
        if self.model.__dict__.get("_ficoco_handle") is self:
            del self.model.__dict__["_ficoco_handle"]

    def __enter__(self) -> Handle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


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


def apply(model: nn.Module, variant: str, *, schedule: Schedule | str | dict[int, int] | None = None,
          keep: int | None = None, tflops: float | None = None, count: CountOptions | None = None,
          first_layer: int | None = None, shape: str | None = None, image_size: tuple[int, int] | None = None,
          frames: int | None = None, preset: int | None = None, **hyperparameters: Any) -> Handle:
    """Patch `model` with a reduction method (`ficoco methods` lists them) and return the handle.

    The schedule comes from the accountant: an explicit `schedule` (a Schedule, `"12:40,..."`
    or {layer: removed}), `keep` visual tokens (each method's `--keep` meaning), a `preset`
    (the literature's 192/128/64 row), or a `tflops` budget under `count`'s convention and scope;
    methods other than FiCoCo-V and -L fall back to their official default setting. `image_size`
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
    fields = {f.name for f in dataclasses.fields(Hyperparameters)}
    if isinstance(schedule, Schedule):
        sched = schedule
        unknown = sorted(set(hyperparameters) - set(spec.hyperparameters) - fields)
        if unknown:
            raise FicocoError(f"unknown hyperparameter {', '.join(unknown)} for {spec.title}: choose from "
                              f"{', '.join(dict.fromkeys([*spec.hyperparameters, *fields]))}")
    else:
        # The entry's planner plans every method: the request's keep / preset / budget / schedule, and the
        # hyperparameters (checked against the entry's).
        sched = resolve_schedule(arch, variant, opts, keep=keep, tflops=tflops, schedule=schedule, shape=shape,
                                 first_layer=first_layer, preset=preset, hyperparameters=hyperparameters)
    # FiCoCo's hyperparameters live on the handle (set per handle); the others in the schedule's settings.
    params = Hyperparameters(**{name: value for name, value in hyperparameters.items() if name in fields})
    if sched.variant != variant:
        raise FicocoError(f"the schedule is for variant '{sched.variant}', not '{variant}'")
    adapter = adapter_for(model)
    handle = Handle(model=model, variant=variant, schedule=sched, hyperparameters=params)
    removed = sched.removed_at()
    # The wrappers go in even for an empty schedule, so that "nothing removed" runs through
    # the patched path and can be checked against the unpatched model. A refusal on the way
    # leaves the model as it was.
    try:
        _install(adapter, handle, spec, sched, arch, removed, first_layer)
    except BaseException:
        handle._patches.undo()
        raise
    model.__dict__["_ficoco_handle"] = handle
    return handle


def _install(adapter: Any, handle: Handle, spec: Any, sched: Schedule, arch: Any, removed: dict[int, int],
             first_layer: int | None) -> None:
    """Put the method's hook points into the model (`apply`'s second half)."""
    variant = handle.variant
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
        start = min(removed) if removed else (arch.first_reducing_layer(spec.name) if first_layer is None
                                              else first_layer)
        adapter.patch_in_layer(handle, handle._patches, spec, sched, start)
    adapter.patch_entry(handle, handle._patches, variant, handle.keep_per_image)
