"""FiCoCo-V (docs/methods/ficoco.md): filter the patches by vision- and [CLS]-redundancy inside
vision-tower layers, correlate them with the kept ones, and fold them in (compress).

It acts inside tower layers (after attention, before the MLP) from layer 12 up to the layer the
projector reads, and removes any count at any of them: the accountant's per-layer planner plans it
(`planner="per_layer"`; no `steps` of its own). This module is its spec, its defaults (the paper's)
and its own cost formulas; no torch. Its tensor functions are in `ops` (``reduce_v``, ``tower_step``,
``reduce_groups`` for Qwen2-VL's merge groups).
"""

from __future__ import annotations

from ficoco.methods.base import LayerWork, MethodSpec, Need
from ficoco.methods.common import ALL_FAMILIES
from ficoco.methods.reads import DEFAULT_ATTENTION_SCORES, SCORES_CORRECTION, ReadContext, ReadShape

# The paper's hyperparameters (docs/methods/ficoco.md): every one can be set per handle
# (`ficoco.apply(model, "v", lam=0.5)`).
LAM = 0.35  # filter: weight of the vision-aware term against the semantic ([CLS]) one
EPS = 0.998  # quantile level of the token-adaptive K
WINDOW = 2  # local penalty: window side on the original patch grid
COEFFICIENT = 2.0  # local penalty: factor on each window's top score
FIRST_LAYER = 12  # the first tower layer that reduces by default
EQUIVALENT_TOKEN = False  # score with the equivalent token in place of [CLS] even where [CLS] exists


def paper_overhead(stage: str, visual: int, removed: int, dim: int) -> int:
    """The appendix's cost of one reducing tower layer that removes `removed` of `visual` patches of width
    `dim` (MAC-style units, elementwise terms included): N^2 + 2N + N_S(N_T + 2D + 1) + D. The `paper`
    convention adds it at every in-layer reduction."""
    kept = visual - removed
    return visual * visual + 2 * visual + removed * (kept + 2 * dim + 1) + dim


def layer_macs(work: LayerWork) -> int:
    """The compress step's matrix products at one reducing tower layer, over all its items: kept x removed
    similarities of width D (Qwen2-VL folds merge groups: (kept / m) * (removed / m) * (m * D)). What
    `--verify` checks per layer against the counters."""
    kept = work.visual_before - work.removed
    return work.items * kept * work.removed * work.dim // work.merge


def reads(ctx: ReadContext) -> tuple[ReadShape, ...]:
    """What one reducing tower layer reads of its attention (ficoco.methods.ficoco_v.ops): the column means
    over the patch rows, the [CLS] row (where the tower has one and [CLS] scores), and once the filter chose
    the patches to remove, their rows (the correlate step; a merge group's: its members' rows)."""
    shapes = [("columns", ctx.tokens - int(ctx.has_cls), ctx.tokens)]
    if ctx.has_cls and not ctx.settings.get("equivalent_token", EQUIVALENT_TOKEN):
        shapes.append(("rows", 1, ctx.tokens))
    if ctx.removed:
        shapes.append(("rows", ctx.removed, ctx.tokens))
    return tuple(shapes)


SPEC = MethodSpec(
    name="v", title="FiCoCo-V", acts_at="vision_layer", placement="in_layer", positions="grid",
    needs=(Need("attention_rows", "vision L", "all", "head-mean probabilities of every query over every key "
                "of the reducing vision layer (B, T, T)"),
           Need("keys", "vision L", "all", "head-mean keys, only for towers without [CLS] (equivalent token)"),
           Need("hidden", "vision L", "all", "after the attention residual, before the MLP")),
    hyperparameters={"lam": LAM, "eps": EPS, "window": WINDOW, "coefficient": COEFFICIENT, "first_layer": FIRST_LAYER,
                     "equivalent_token": EQUIVALENT_TOKEN,
                     "attention_scores": DEFAULT_ATTENTION_SCORES},
    corrections=SCORES_CORRECTION,
    families=ALL_FAMILIES, module=f"{__name__}.ops", function="reduce",
    source="FiCoCo paper (docs/methods/ficoco.md)",
    summary="filter by vision- and [CLS]-redundancy, fold into kept patches",
    keep_means="visual tokens that reach the LLM", wired=True, merges_by_keys=True,
    planner="per_layer", default_setting=False,
    paper_overhead=paper_overhead, layer_macs=layer_macs, reads=reads,
)
