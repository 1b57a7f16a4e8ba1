"""The plugin's hooks into vLLM's engine (knows vLLM's engine arguments and model runners).

- `check_settings`: an engine's `ficoco_vllm` settings are read where vLLM makes the engine's config, in the
  caller's process, so that a mistake (an unserved method, an unknown setting) or a model the plugin does not
  reduce is one FicocoError there, not a worker's traceback behind "Engine core initialization failed".

vLLM recomputes a prompt's M-RoPE positions after the encoder ran (`recompute_mrope_positions`, the positions
carried in the embeddings' extra channels) only where its runner's `is_multimodal_pruning_enabled` is set: the
GPU runner sets it for its own video pruning alone (EVS, `video_pruning_rate`), the CPU runner never, so that EVS
fails on vLLM's CPU build ("index put ... shape mismatch": the pruned embeddings against the unpruned positions).
The runner's `load_model` is wrapped to set the flag where the GPU runner would (a model that supports pruning, on an
engine with `video_pruning_rate`) and for a model that reduces images (`ficoco_reduces_images`): the plugin enables
EVS on the CPU, so that serve-bench sets it beside ficoco's methods there.
"""

from __future__ import annotations

import functools
from typing import Any

_WRAPPED = "_ficoco_positions"


def _runs_evs(runner: Any, model: Any) -> bool:
    """The GPU runner's own condition for vLLM's video pruning (EVS): a model that supports it, on an engine whose
    multimodal config enables it."""
    from vllm.model_executor.models.interfaces import supports_multimodal_pruning

    config = getattr(runner.model_config, "multimodal_config", None)
    return config is not None and config.is_multimodal_pruning_enabled() and supports_multimodal_pruning(model)


def _wrap(cls: type) -> None:
    if "load_model" not in cls.__dict__ or getattr(cls.__dict__["load_model"], _WRAPPED, False):
        return
    original = cls.__dict__["load_model"]

    @functools.wraps(original)
    def load_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        model = self.get_model()
        if getattr(model, "ficoco_reduces_images", False) or _runs_evs(self, model):
            self.is_multimodal_pruning_enabled = True
        return result

    setattr(load_model, _WRAPPED, True)
    cls.load_model = load_model


def check_settings() -> None:
    """Wrap `EngineArgs.create_engine_config`: the settings parsed, the architecture checked, before any engine
    process starts."""
    try:
        from vllm.engine.arg_utils import EngineArgs
    except ImportError:
        return
    original = EngineArgs.__dict__.get("create_engine_config")
    if original is None or getattr(original, _WRAPPED, False):
        return

    @functools.wraps(original)
    def create_engine_config(self: Any, *args: Any, **kwargs: Any) -> Any:
        from ficoco.errors import FicocoError
        from ficoco.serving.vllm import ARCHITECTURES, NOT_REDUCED, SERVED_ONLY
        from ficoco.serving.vllm.settings import SETTINGS_KEY, settings_from, unserved_reason

        overrides = self.hf_overrides if isinstance(self.hf_overrides, dict) else {}

        class _Config:  # what the model's config will carry
            pass

        config = _Config()
        if SETTINGS_KEY in overrides:
            setattr(config, SETTINGS_KEY, overrides[SETTINGS_KEY])
        settings = settings_from(config)
        made = original(self, *args, **kwargs)
        evs = getattr(made.model_config.multimodal_config, "video_pruning_rate", None)
        if settings is not None and evs:
            raise FicocoError(f"ficoco.vllm: give either ficoco_vllm settings or video_pruning_rate={evs} (vLLM's "
                              "EVS), not both: each lays a video's positions out its own way")
        if settings is not None:
            architectures = list(getattr(made.model_config, "architectures", None) or [])
            if not set(architectures) & set(ARCHITECTURES):
                why = next((NOT_REDUCED[a] for a in architectures if a in NOT_REDUCED), None)
                raise FicocoError(f"ficoco.vllm: {', '.join(architectures) or 'this model'} is not reduced by the "
                                  f"plugin{f' ({why})' if why else ''}; it reduces Qwen2.5-VL, Qwen3-VL, LLaVA-1.5, "
                                  "LLaVA-OneVision and InternVL3: drop the ficoco_vllm settings")
            for architecture in architectures:
                served = SERVED_ONLY.get(architecture)
                if served is not None and settings.method not in served:
                    why = unserved_reason(settings.method, getattr(made.model_config.hf_config, "model_type", ""))
                    raise FicocoError(f"ficoco.vllm: {settings.method} is not served on {architecture} ({why}); "
                                      f"served there: {', '.join(served)}")
        return made

    setattr(create_engine_config, _WRAPPED, True)
    EngineArgs.create_engine_config = create_engine_config


def enable_positions() -> None:
    """Wrap the GPU and CPU model runners' `load_model` (each defines its own); a runner vLLM lacks is skipped."""
    try:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    except ImportError:
        return
    _wrap(GPUModelRunner)
    try:
        from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    except ImportError:
        return
    _wrap(CPUModelRunner)
