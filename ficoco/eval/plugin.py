"""The entry point lmms-eval loads (`[project.entry-points."lmms_eval.models"] ficoco`): the manifest that
names ficoco's model class, imported only when lmms-eval runs it."""

from __future__ import annotations

from typing import Any

MODEL_ID = "ficoco"
CLASS_PATH = "ficoco.eval.lmms_model.FicocoLMM"


def manifest() -> Any:
    """lmms-eval's ModelManifest for `--model ficoco`."""
    from lmms_eval.models.registry_v2 import ModelManifest

    return ModelManifest(model_id=MODEL_ID, simple_class_path=CLASS_PATH)
