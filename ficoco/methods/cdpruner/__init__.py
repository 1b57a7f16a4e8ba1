"""CDPruner (docs/methods/cdpruner.md): after the projector, keep the projected patches a conditional DPP
picks (cosine kernel weighted by relevance to the instruction), by fast greedy MAP.

This module is its spec, its defaults (the official code's) and its schedule arithmetic; no torch.
Its tensor functions are in `ops`.
"""

from __future__ import annotations

from ficoco.methods.base import ExtraMacs, MethodSpec, Need, StepContext
from ficoco.methods.common import ALL_FAMILIES, PER_ITEM, cut_steps, ratio_for_keep

DEFAULT_KEEP_RATIO = 0.2222  # the share of the patches kept without keep= (the README's 128 of 576)
# Where the relevance comes from here (the checkpoints carry no CLIP text tower); a row's settings say so.
RELEVANCE = "LLM input embeddings of the prompt text (no CLIP text tower)"

steps = cut_steps("CDPruner", "after_projector")
settings_for_keep = ratio_for_keep("CDPruner", "default_keep_ratio", relevance=RELEVANCE)


def extra_macs(ctx: StepContext) -> ExtraMacs:
    """The kernel's similarities, the instruction relevance and the greedy MAP's projections."""
    tokens, keep, width = ctx.visual_before, ctx.settings["keep"], ctx.projected_width
    return [(ctx.step.layer, "cdpruner_projected_similarity", tokens * tokens * width),
            (ctx.step.layer, "cdpruner_text_relevance", tokens * ctx.suffix_tokens * width),
            # Fast greedy MAP: pick t projects the kernel row on the t earlier factor rows.
            (ctx.step.layer, "cdpruner_greedy_map", tokens * keep * (keep - 1) // 2)]


SPEC = MethodSpec(
    name="cdpruner", title="CDPruner", acts_at="after_projector", placement="after_projector",
    positions="grid",
    needs=(Need("hidden", "projector", "all", "the projector's output, every patch"),
           Need("input_embeddings", "embeddings", "suffix", "the LLM's input embeddings of the prompt's text "
                "after the visual span: the instruction, in place of the CLIP text tower")),
    hyperparameters={"default_keep_ratio": DEFAULT_KEEP_RATIO},
    families=(*ALL_FAMILIES, "internvl"), module=f"{__name__}.ops", function="cdpruner_reduce",
    source="Theia-4869/CDPruner ed9c12d",
    summary="conditional DPP (cosine kernel weighted by instruction relevance), fast greedy MAP; relevance "
            "from the LLM's input embeddings of the instruction (the checkpoints carry no CLIP text tower)",
    keep_means=PER_ITEM + " (default: the README's 128 of 576)",
    steps=steps, settings_for_keep=settings_for_keep, extra_macs=extra_macs, wired=True,
)
