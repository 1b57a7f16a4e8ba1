"""FiCoCo-L (docs/methods/ficoco.md): filter the visual tokens by vision- and task-redundancy inside
decoder layers, correlate them with the kept ones (directly and through the text after the image),
and fold them in (compress); kept tokens stay at their original positions.

It acts inside decoder layers (after attention, before the MLP) from layer 4 on, and removes any
count at any of them: the accountant's per-layer planner plans it (`planner="per_layer"`; no
`steps` of its own). This module is its spec, its defaults (the paper's) and its own cost formulas;
no torch. Its tensor functions are in `ops` (``reduce_l``, ``layer_step``).

FiCoCo is ficoco's own method and its paper is its definition: the default rule (``rule="paper"``) is the
paper's text. ``rule="official"`` runs the rule of the authors' code instead (kawhiiiileo/FiCoCo at
8995e93bf5c62435979f500e9d335e4810301656, llava/model/language_model/llava_llama.py and FiCoCo_L.py; ficoco's
tensor functions for it: `ops.reduce_l_official` and its helpers), and every report names it ("FiCoCo-L (official
code's rule)"). docs/methods/ficoco.md lists every departure between the two.
"""

from __future__ import annotations

from ficoco.methods.base import RULE, LayerWork, MethodSpec, Need, Rule
from ficoco.methods.common import ALL_FAMILIES
from ficoco.methods.reads import DEFAULT_ATTENTION_SCORES, SCORES_CORRECTION, ReadContext, ReadShape, causal_tiles

# The paper's hyperparameters (docs/methods/ficoco.md): every one can be set per handle
# (`ficoco.apply(model, "l", beta=0.5)`).
BETA = 0.6  # filter: weight of the vision-aware term against the task-aware one
GAMMA = 0.6  # correlate: weight of the direct term against the indirect (text-guided) one
EPS = 0.998  # quantile level of the token-adaptive K
FIRST_LAYER = 4  # the first decoder layer that reduces by default

# The rules: the paper's (the default: FiCoCo's definition) and the official code's, by name.
PAPER_RULE = "paper"
OFFICIAL_RULE = "official"
RULES = (PAPER_RULE, OFFICIAL_RULE)
# The official code's setting (llava_llama.py at 8995e93): r = 14 tokens (line 39) at every layer with
# layer_idx > control_encoding_layer = 4 (lines 50, 242, 440): from one layer after the paper's first, layer 5.
OFFICIAL_REMOVED_PER_LAYER = 14
OFFICIAL_FIRST_LAYER_OFFSET = 1
# It compacts the positions of the kept tokens (llava_llama.py:138-141), which ficoco does on decoders with 1-D
# rotary positions; the Qwen families' 3-D positions (and Qwen3.5's) have no compacted form.
OFFICIAL_FAMILIES = ("llava", "llava_next", "video_llava", "llava_onevision", "internvl")
OFFICIAL = Rule(label="official code's rule", first_layer_offset=OFFICIAL_FIRST_LAYER_OFFSET,
                removed_per_layer=OFFICIAL_REMOVED_PER_LAYER, families=OFFICIAL_FAMILIES, positions="compact",
                images=1,
                refusal="it re-compacts the kept tokens' positions, which a decoder of 3-D (multimodal rotary) "
                        "positions has no form for")


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
    if work.settings.get(RULE, PAPER_RULE) == OFFICIAL_RULE:
        # The official code's rule: the indirect term of the removed tokens' rows over every visual token (its
        # fold is a scatter-add, no product).
        return work.items * work.removed * work.suffix_tokens * work.visual_before
    return work.items * (kept * work.removed * work.dim + work.removed * work.suffix_tokens * kept)


def reads(ctx: ReadContext) -> tuple[ReadShape, ...]:
    """What one reducing decoder layer reads of its attention (ficoco.methods.ficoco_l.ops): the visual rows and
    the text rows after the visual span, over the keys each tile of them can see under the causal mask (the
    method keeps the visual columns). The official code's rule reads the same rows' raw scores over every key,
    before the mask (ficoco.methods.ficoco_l.ops, `reduce_l_official`)."""
    if ctx.settings.get(RULE, PAPER_RULE) == OFFICIAL_RULE:
        return (("logits", ctx.visual_before + ctx.suffix_tokens, ctx.tokens),)
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
                     "attention_scores": DEFAULT_ATTENTION_SCORES, RULE: PAPER_RULE},
    corrections=SCORES_CORRECTION,
    rules={OFFICIAL_RULE: OFFICIAL},
    default_sources={
        "beta": "paper = official code",
        "gamma": "paper = official code",
        "eps": "paper = official code",
        "first_layer": "paper; official code: 5",
        "attention_scores": "paper: probabilities; official code: raw scores",
        RULE: "paper",
    },
    families=ALL_FAMILIES, module=f"{__name__}.ops", function="reduce",
    source="FiCoCo paper (docs/methods/ficoco.md)",
    summary="filter by vision- and task-redundancy, fold into kept tokens",
    keep_means="visual tokens that leave the LLM", wired=True, merges_by_keys=True,
    planner="per_layer", default_setting=False,
    paper_overhead=paper_overhead, layer_macs=layer_macs, reads=reads,
)
