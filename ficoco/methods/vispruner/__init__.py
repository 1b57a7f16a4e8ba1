"""VisPruner (docs/methods/vispruner.md): at the tower's output, keep half the budget by [CLS] attention
and the rest by removing duplicates among the other patches, then project.

This module is its spec, its defaults (the official code's) and its schedule arithmetic; no torch.
Its tensor functions are in `ops`.
"""

from __future__ import annotations

from ficoco.methods.base import ExtraMacs, MethodSpec, Need, StepContext
from ficoco.methods.common import ALL_FAMILIES, EQUIVALENT, PER_ITEM, cut_steps, ratio_for_keep
from ficoco.methods.reads import DEFAULT_ATTENTION_SCORES, SCORES_CORRECTION

IMPORTANT_RATIO = 0.5  # the share of the kept tokens chosen by [CLS] attention
DEFAULT_KEEP_RATIO = 0.2222  # the share of the patches kept without keep= (the README's 128 of 576)

steps = cut_steps("VisPruner", "tower_output")
settings_for_keep = ratio_for_keep("VisPruner", "default_keep_ratio")


def duplicate_rounds(residual: int, diverse: int) -> list[tuple[int, int, int]]:
    """The duplicate-removal rounds (a, b, removed) from `residual` patches down to `diverse`;
    ficoco.methods.vispruner.ops runs the same plan."""
    rounds = []
    while (r := min(8, residual - diverse)) > 0:
        a = (residual + 1) // 2
        rounds.append((a, residual // 2, min(r, a)))
        residual -= min(r, a)
    return rounds


def extra_macs(ctx: StepContext) -> ExtraMacs:
    """The [CLS] row (where the tower has one) and the duplicate rounds' similarities."""
    d, s = ctx.dims, ctx.settings
    important = int(s["keep"] * s["important_ratio"])
    rounds = duplicate_rounds(ctx.visual_before - important, s["keep"] - important)
    # No [CLS] row on a tower without one: the equivalent token is elementwise work no convention counts.
    cls_row = [(ctx.step.layer, "vispruner_vision_cls_row", d.heads * d.head_dim * ctx.seq_before)] if ctx.has_cls \
        else []
    return [*cls_row,
            # Each round: cosine of every even-place residual token with every odd-place one, at the units' width
            # (Qwen2-VL: a merge group's patches side by side).
            (ctx.step.layer, "vispruner_vision_duplicate_similarity",
             sum(a * b for a, b, _ in rounds) * (ctx.unit_width or d.hidden))]


SPEC = MethodSpec(
    name="vispruner", title="VisPruner", acts_at="vision_layer", placement="tower_output", positions="grid",
    needs=(Need("attention_rows", "vision L", "cls", "the [CLS] query's softmax over every key of the layer the "
                "projector reads, head mean"),
           Need("hidden", "vision L", "all", "that layer's output, the projector's input (the duplicate "
                "similarity's features)")),
    hyperparameters={"important_ratio": IMPORTANT_RATIO, "default_keep_ratio": DEFAULT_KEEP_RATIO,
                     "attention_scores": DEFAULT_ATTENTION_SCORES},
    corrections=SCORES_CORRECTION,
    families=ALL_FAMILIES, module=f"{__name__}.ops", function="vispruner_reduce",
    source="Theia-4869/VisPruner aefa01a (first read from its copy anonymous-4869/VisPruner d01c757)",
    summary="keep half by [CLS] attention, the rest by removing duplicates among the others, then project",
    keep_means=PER_ITEM + " (default: the README's 128 of 576)", cls_note=EQUIVALENT,
    steps=steps, settings_for_keep=settings_for_keep, extra_macs=extra_macs, wired=True,
)
