"""What a method reads of a layer's attention, and what each read costs. No torch.

A method that ranks tokens by attention does not need the layer's (heads x queries x keys)
probabilities: it needs a few rows of them, a statistic over all of them, or a block. The layer's
output always comes from the model's own attention kernel (SDPA where the model runs SDPA); the read
is computed beside it from the layer's own queries and keys (`ficoco.methods.reads.ops`), at the cost
of what it reads, and never holds more than a bounded block of scores:

- **rows** (`rows`): the head-mean probabilities of some query rows over every key: [CLS], the last
  prompt token, the instruction, the tokens a method discards (FiCoCo's correlate step reads only the
  rows of the tokens its filter chose to remove, after it chose them);
- **columns** (`column_sum`): what every key receives, summed over a set of query rows (every row, or
  the patches, or the visual tokens) and averaged over heads: FiCoCo-V's filter, HoliTom's tower score;
- **block** (`block`): rows x a set of key columns (FiCoCo's correlation of discarded with kept tokens);
- **logits** (`logits`): some rows over every key as raw head-mean scores, before the mask and the softmax
  (FiCoCo's official code ranks by them: its ``rule="official"``). A read of probabilities computes no logits
  read's shape and a logits read no softmax; both cost the same products.

Each is computed by blocks of query rows: a block's scores are the rows x keys product, then the
softmax over the whole key axis (its normaliser is exact within the block, since every key of a row is
in it), then the statistic, so that no (heads x queries x keys) tensor is ever made.

The heads are combined by their mean, or (``heads="max"``, a `Need`'s ``heads``: FitPrune) by the largest
probability any head gives a query and key; a read of the head-max is priced as the head-mean read of its
shape, which runs the same products, softmax and passes.

How the scores are computed (`ATTENTION_SCORES`, the methods' ``attention_scores`` hyperparameter):

- ``"model"`` (the default, the official codes' rule): as the model's own eager attention computes its
  probabilities, and what ``output_attentions`` returns: ``q @ k^T`` in the model's dtype, times the
  scale in that dtype, the mask added, the softmax computed in float32 and its result in the model's
  dtype; the statistics a method takes of them are then summed in float32.
- ``"float32"`` (a named correction): the scores and the probabilities in float32 (``(q * scale)`` cast
  to float32, ``@ k^T`` in float32), as ficoco's earlier probe computed them. On a float32 model the two
  differ only in rounding.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, get_args

# How a read combines the heads of a layer (`ProbedAttention`'s `heads`): their mean (every method but one), or
# their largest probability at each query and key (FitPrune's `attn_weights.max(dim=1)`). Both cost the same: the
# same products and softmax, one add or one comparison per probability.
HeadStatistic = Literal["mean", "max"]
HEAD_STATISTICS: tuple[str, ...] = get_args(HeadStatistic)

AttentionScores = Literal["model", "float32"]
ATTENTION_SCORES: tuple[str, ...] = get_args(AttentionScores)
# The rule a method reads attention by unless told otherwise: the official codes' (eager attention).
DEFAULT_ATTENTION_SCORES = "model"
# What a report calls the correction (MethodSpec.corrections of every method that reads attention rows).
SCORES_CORRECTION = {"attention_scores": {"float32": "float32 attention scores"}}

# A layer whose every score fits this many (all its sequences, heads, queries and keys: a small tower, a tiny
# model, a window of Qwen2.5-VL's tower) is read whole at its first read, once, and every read is answered from
# the head-mean matrix: one block where several reads would each pay their small ops.
WHOLE_READ_SCORES = 1 << 20

# Under a causal mask a query row sees no key after its own position: a read of rows whose positions are known
# to lie below a bound (the rows in order, the last at most `last`) computes, tile of this many rows by tile,
# only the keys up to the tile's bound; the rest are zero, as the masked softmax would give them.
CAUSAL_TILE_ROWS = 64

ReadKind = Literal["rows", "columns", "block", "logits"]
READ_KINDS: tuple[str, ...] = get_args(ReadKind)


def read_macs(heads: int, rows: int, keys: int, head_dim: int, sequences: int = 1) -> int:
    """Multiply-accumulates of one read of `rows` query rows over `keys` keys, per each of `sequences`
    sequences: the scores q . k^T of every head (rows x keys x head width). A read computes no weighted
    values: the layer's output comes from its own kernel."""
    return sequences * heads * rows * keys * head_dim


def read_scores(heads: int, rows: int, keys: int, sequences: int = 1) -> int:
    """Scores (and probabilities) one read computes: heads x rows x keys per sequence, by blocks."""
    return sequences * heads * rows * keys


def causal_tiles(rows: int, last: int, keys: int, queries: int) -> list[tuple[int, int, int]]:
    """(first row, end row, keys read) of every tile of a causal read of `rows` rows in order, the last at most
    at query position `last` of `queries`, over `keys` keys (the first `keys - queries` from a cache): tile
    [r0, r1)'s rows lie at most at ``last - (rows - r1)``, so it reads the keys up to there."""
    tiles = []
    for r0 in range(0, rows, CAUSAL_TILE_ROWS):
        r1 = min(rows, r0 + CAUSAL_TILE_ROWS)
        tiles.append((r0, r1, max(1, min(keys, last - (rows - r1) + 1 + keys - queries))))
    return tiles


def check_head_statistic(value: object) -> str:
    """`value` as a head statistic, or a ValueError naming them."""
    if value not in HEAD_STATISTICS:
        raise ValueError(f"heads must be one of {', '.join(HEAD_STATISTICS)}, got {value!r}")
    return str(value)


def check_attention_scores(value: object) -> str:
    """`value` as a rule name, or a ValueError naming the rules."""
    if value not in ATTENTION_SCORES:
        raise ValueError(f"attention_scores must be one of {', '.join(ATTENTION_SCORES)}, got {value!r}")
    return str(value)


# ---- which reads a method makes, per reducing layer (its spec's `reads`) ---------------------------------------

@dataclass(frozen=True)
class ReadContext:
    """What a method's reads at one reducing layer depend on, per sequence (a tower item, or a sample).

    Attributes:
        stage: ``"vision"`` or ``"llm"``.
        tokens: the tokens the read layer attends over ([CLS] and text included).
        visual_before: visual tokens (a vision step: patches of the item) before the step.
        removed: visual tokens (patches) the step removes.
        has_cls: the tower has [CLS] at position 0 (a vision read).
        suffix_tokens: text tokens after the visual span (a decoder read).
        settings: the method's hyperparameters as the run has them.
    """

    stage: str
    tokens: int
    visual_before: int
    removed: int
    has_cls: bool
    suffix_tokens: int
    settings: Mapping[str, Any]


# (kind, rows, keys) of one read: `rows` query rows over `keys` keys, per sequence, of the reducing layer; or
# (kind, rows, keys, setting) of a read of the tower layer a setting names (a ``vision named`` need,
# ficoco.methods.needs), at that layer.
ReadShape = tuple[str, int, int] | tuple[str, int, int, str]
ReadShapes = Callable[[ReadContext], tuple[ReadShape, ...]]
