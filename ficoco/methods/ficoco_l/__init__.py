"""FiCoCo-L (docs/methods/ficoco.md): filter the visual tokens by vision- and task-redundancy inside
decoder layers, correlate them with the kept ones (directly and through the text after the image),
and fold them in (compress); kept tokens stay at their original positions.

It acts inside decoder layers (after attention, before the MLP) from layer 4 on, and removes any
count at any of them: the accountant's per-layer planner plans it (`planner="per_layer"`; no
`steps` of its own). This module is its spec, its defaults (the paper's) and its own cost formulas;
no torch. Its tensor functions are in `ops` (``reduce_l``, ``layer_step``).
"""

from __future__ import annotations

from ficoco.methods.base import LayerWork, MethodSpec, Need
from ficoco.methods.common import ALL_FAMILIES
from ficoco.methods.reads import DEFAULT_ATTENTION_SCORES, SCORES_CORRECTION, ReadContext, ReadShape, causal_tiles

# The paper's hyperparameters (docs/methods/ficoco.md): every one can be set per handle
# (`ficoco.apply(model, "l", beta=0.5)`).
BETA = 0.6  # filter: weight of the vision-aware term against the task-aware one
GAMMA = 0.6  # correlate: weight of the direct term against the indirect (text-guided) one
EPS = 0.998  # quantile level of the token-adaptive K
FIRST_LAYER = 4  # the first decoder layer that reduces by default


def paper_overhead(stage: str, visual: int, removed: int, dim: int) -> int:
    """The appendix's cost of one reducing decoder layer that removes `removed` of `visual` tokens of width
    `dim` (MAC-style units, elementwise terms included): 2(N^2 + 2N) + N_S(N_T + 2D + 1) + D, the first
    term doubled for the indirect, task-guided correlation. The `paper` convention adds it at every
    in-layer reduction."""
    kept = visual - removed
    return 2 * (visual * visual + 2 * visual) + removed * (kept + 2 * dim + 1) + dim


def layer_macs(work: LayerWork) -> int:
    """The compress step's matrix products at one reducing decoder layer, over all its samples: kept x
    removed similarities of width D, and the indirect correlation through the suffix tokens, removed x
    suffix x kept. What `--verify` checks per layer against the counters."""
    kept = work.visual_before - work.removed
    return work.items * (kept * work.removed * work.dim + work.removed * work.suffix_tokens * kept)


def reads(ctx: ReadContext) -> tuple[ReadShape, ...]:
    """What one reducing decoder layer reads of its attention (ficoco.methods.ficoco_l.ops): the visual rows and
    the text rows after the visual span, over the keys each tile of them can see under the causal mask (the
    method keeps the visual columns)."""
    prefix = ctx.tokens - ctx.visual_before - ctx.suffix_tokens
    visual = causal_tiles(ctx.visual_before, prefix + ctx.visual_before - 1, ctx.tokens, ctx.tokens)
    text = causal_tiles(ctx.suffix_tokens, ctx.tokens - 1, ctx.tokens, ctx.tokens)
    return tuple(("rows", r1 - r0, keys) for r0, r1, keys in visual + text)


SPEC = MethodSpec(
    name="l", title="FiCoCo-L", acts_at="llm_layer", placement="in_layer", positions="original",
    needs=(Need("attention_rows", "L", "visual+suffix", "head-mean probabilities of the visual and suffix "
                "queries over every key of the reducing layer"),
           Need("hidden", "L", "all", "after the attention residual, before the MLP")),
    hyperparameters={"beta": BETA, "gamma": GAMMA, "eps": EPS, "first_layer": FIRST_LAYER,
                     "attention_scores": DEFAULT_ATTENTION_SCORES},
    corrections=SCORES_CORRECTION,
    families=ALL_FAMILIES, module=f"{__name__}.ops", function="reduce",
    source="FiCoCo paper (docs/methods/ficoco.md)",
    summary="filter by vision- and task-redundancy, fold into kept tokens",
    keep_means="visual tokens that leave the LLM", wired=True, merges_by_keys=True,
    planner="per_layer", default_setting=False,
    paper_overhead=paper_overhead, layer_macs=layer_macs, reads=reads,
)
