"""ficoco's vLLM plugin: the methods that act before the LLM (FiCoCo-V, VisionZip, DivPrune, VisPruner,
PixelPrune) on Qwen2.5-VL and Qwen3-VL served by vLLM (DivPrune and FiCoCo-V on LLaVA-1.5, LLaVA-OneVision and
InternVL3; VisionZip and VisPruner on LLaVA-1.5 and InternVL3), each image (and every temporal slice of
a Qwen video) reduced to a count fixed before the encoder runs (from the budget and its grid, tiles or size, or
PixelPrune's from its pixels), its tokens at their original M-RoPE positions (docs/serving.md); and vLLM's own
video pruning (EVS) enabled on its CPU runner.

vLLM loads `register` through the `vllm.general_plugins` entry point (pyproject.toml) in every process it
starts; it replaces the five architectures by ficoco's subclasses (`ficoco.serving.vllm.qwen`, `.llava`, `.internvl`),
which are vLLM's classes unchanged unless the engine's config carries `ficoco_vllm` settings
(`hf_overrides={"ficoco_vllm": {"method": "visionzip", "keep": 64}}`, or the environment's `FICOCO_VLLM`).

This room knows vLLM and calls ficoco's method ops and its torch-free accountant; it never imports
`ficoco.models` (transformers' adapters), which never import it.
"""

from __future__ import annotations

ARCHITECTURES = {
    "Qwen2_5_VLForConditionalGeneration": "ficoco.serving.vllm.qwen:ReducingQwen2_5_VL",
    "Qwen3VLForConditionalGeneration": "ficoco.serving.vllm.qwen:ReducingQwen3VL",
    "LlavaForConditionalGeneration": "ficoco.serving.vllm.llava:ReducingLlava",
    "LlavaOnevisionForConditionalGeneration": "ficoco.serving.vllm.llava:ReducingLlavaOnevision",
    # InternVL3 in Hugging Face's format, which vLLM serves with its InternS1 classes.
    "InternVLForConditionalGeneration": "ficoco.serving.vllm.internvl:ReducingInternVL",
}

# Where the plugin serves fewer than its methods (the rest refused where the engine's config is made).
SERVED_ONLY = {"LlavaForConditionalGeneration": ("divprune", "v", "visionzip", "vispruner"),
               "LlavaOnevisionForConditionalGeneration": ("divprune", "v"),
               "InternVLForConditionalGeneration": ("divprune", "visionzip", "vispruner", "v")}

# Architectures vLLM serves that the plugin does not reduce, with the reason (refused where the engine's config is
# made, before an engine starts).
NOT_REDUCED = {
    "InternVLChatModel":
        "this is InternVL's original remote-code format; serve its Hugging Face format (the '-hf' checkpoints, "
        "InternVLForConditionalGeneration), which the plugin reduces",
}


def register() -> None:
    """The plugin's entry point (vLLM calls it in every process, possibly more than once)."""
    from vllm import ModelRegistry

    from ficoco.serving.vllm.runner import check_settings, enable_positions

    for architecture, target in ARCHITECTURES.items():
        ModelRegistry.register_model(architecture, target)
    check_settings()
    enable_positions()
