"""FiCoCo-V (docs/methods/ficoco.md): filter the patches by vision- and [CLS]-redundancy inside
vision-tower layers, correlate them with the kept ones, and fold them in (compress).

It acts inside tower layers (after attention, before the MLP) from layer 12 up to the layer the
projector reads, and removes any count at any of them: the accountant's per-layer planner plans it
(`planner="per_layer"`; no `steps` of its own). This module is its spec, its defaults (the paper's)
and its own cost formulas; no torch. Its tensor functions are in `ops` (``reduce_v``, ``tower_step``,
``reduce_groups`` for Qwen2-VL's merge groups).

FiCoCo is ficoco's own method and its paper is its definition: the default rule (``rule="paper"``) is the
paper's text. ``rule="official"`` runs the vision rule of the authors' code instead (kawhiiiileo/FiCoCo at
8995e93bf5c62435979f500e9d335e4810301656, llava/model/multimodal_encoder/FiCoCo_V.py and clip_encoder.py;
ficoco's tensor functions for it: `ops.reduce_v_official` and its helpers), and every report names it
("FiCoCo-V (official code's rule)"). docs/methods/ficoco.md lists every departure between the two.
"""

from __future__ import annotations

from ficoco.methods.base import RULE, LayerWork, MethodSpec, Need, Rule
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

# The rules: the paper's (the default: FiCoCo's definition) and the official code's, by name.
PAPER_RULE = "paper"
OFFICIAL_RULE = "official"
RULES = (PAPER_RULE, OFFICIAL_RULE)
# The official code's setting (clip_encoder.py at 8995e93): r = 42 patches (line 18) at every tower layer with
# idx_now > control_encoding_layer = 11 (lines 24, 121): from layer 12, the paper's first too.
OFFICIAL_REMOVED_PER_LAYER = 42
# It reads the [CLS] row of a tower of single patches (CLIP): the towers without [CLS] (SigLIP, Qwen's) and of
# merge groups (Qwen's, InternVL's pixel shuffle) have none to read.
OFFICIAL_FAMILIES = ("llava", "llava_next", "video_llava")
OFFICIAL = Rule(label="official code's rule", removed_per_layer=OFFICIAL_REMOVED_PER_LAYER,
                families=OFFICIAL_FAMILIES,
                refusal="its vision rule reads the [CLS] row of a tower of single patches (CLIP)")


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
    if work.settings.get(RULE, PAPER_RULE) == OFFICIAL_RULE:
        return 0  # the official code's rule folds by a scatter-add: no product
    kept = work.visual_before - work.removed
    return work.items * kept * work.removed * work.dim // work.merge


def reads(ctx: ReadContext) -> tuple[ReadShape, ...]:
    """What one reducing tower layer reads of its attention (ficoco.methods.ficoco_v.ops): the column means
    over the patch rows, the [CLS] row (where the tower has one and [CLS] scores), and once the filter chose
    the patches to remove, their rows (the correlate step; a merge group's: its members' rows). The official code's
    rule reads every row's raw scores over every key (ficoco.methods.ficoco_v.ops, `reduce_v_official`)."""
    if ctx.settings.get(RULE, PAPER_RULE) == OFFICIAL_RULE:
        return (("logits", ctx.tokens, ctx.tokens),)
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
                     "attention_scores": DEFAULT_ATTENTION_SCORES, RULE: PAPER_RULE},
    corrections=SCORES_CORRECTION,
    rules={OFFICIAL_RULE: OFFICIAL},
    default_sources={
        "lam": "paper, on the vision term; official code: on the [CLS] term",
        "eps": "paper = official code",
        "window": "paper = official code",
        "coefficient": "paper = official code",
        "first_layer": "paper = official code",
        "equivalent_token": "ficoco: the official code has none",
        "attention_scores": "paper: probabilities; official code: raw scores",
        RULE: "paper",
    },
    families=ALL_FAMILIES, module=f"{__name__}.ops", function="reduce",
    source="FiCoCo paper (docs/methods/ficoco.md)",
    summary="filter by vision- and [CLS]-redundancy, fold into kept patches",
    keep_means="visual tokens that reach the LLM", wired=True, merges_by_keys=True,
    planner="per_layer", default_setting=False,
    paper_overhead=paper_overhead, layer_macs=layer_macs, reads=reads,
)
