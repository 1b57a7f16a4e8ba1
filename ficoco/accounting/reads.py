"""The reads of a layer's attention a schedule's method makes in one prefill, at their shapes. No torch.

A method that ranks by a whole layer's attention (FiCoCo-V, FiCoCo-L, HoliTom's tower score) reads it beside
the layer's own kernel (ficoco.methods.reads): column sums over some query rows, or some rows over every key.
Each spec says what it reads at one reducing layer (`MethodSpec.reads`); `method_reads` lays that over the
schedule's token plan. The prediction prices every read at this machine's measured rate for its shape
(ficoco.profiling.predict), and `flops --verify` checks the reads' score products against the counters.

A read's products (``q . k^T`` of every head over its rows and keys) are neither the layer's attention nor
the method's own matrix work (its `extra_macs`, `layer_macs`): no figure of `ficoco flops` counts them, as
the literature's conventions do not.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ficoco.accounting.architecture import Architecture
from ficoco.accounting.flops import vision_attention_pairs
from ficoco.accounting.methods import suffix_tokens
from ficoco.accounting.schedule import Schedule, TokenPlan
from ficoco.methods.reads import WHOLE_READ_SCORES, ReadContext, causal_tiles, read_macs, read_scores
from ficoco.methods.registry import METHODS


@dataclass(frozen=True)
class Read:
    """One read of one layer's attention: `rows` query rows over `keys` keys for each of `sequences` sequences
    (a tower's items times the batch, or the batch), every one of `heads` heads of width `head_dim`. `pairs`:
    the query-key pairs per sequence where the layer attends within windows (Qwen2.5-VL; column reads only),
    which replace rows x keys."""

    method: str
    stage: str
    layer: int
    kind: str
    rows: int
    keys: int
    heads: int
    head_dim: int
    sequences: int
    pairs: int | None = None

    @property
    def scores(self) -> int:
        """Scores (and probabilities) the read computes."""
        if self.pairs is not None:
            return self.sequences * self.heads * self.pairs
        return read_scores(self.heads, self.rows, self.keys, self.sequences)

    @property
    def macs(self) -> int:
        """Multiply-accumulates of its score products."""
        if self.pairs is not None:
            return self.scores * self.head_dim
        return read_macs(self.heads, self.rows, self.keys, self.head_dim, self.sequences)

    def to_json(self) -> dict[str, Any]:
        return {"stage": self.stage, "layer": self.layer, "kind": self.kind, "rows": self.rows, "keys": self.keys,
                "heads": self.heads, "head_dim": self.head_dim, "sequences": self.sequences, "pairs": self.pairs,
                "scores": self.scores}


def whole_layer(ctx: ReadContext) -> tuple[tuple[str, int, int], ...]:
    """The reads of a method that reads a whole layer's attention and says no more (no `MethodSpec.reads`):
    one column read over every query."""
    return (("columns", ctx.tokens, ctx.tokens),)


def method_reads(arch: Architecture, schedule: Schedule, plan: TokenPlan, *, batch: int = 1,
                 settings: Mapping[str, Any] | None = None) -> list[Read]:
    """Every read `schedule`'s method makes of a layer's attention in one prefill of `batch` samples: at each
    reducing layer, the layer its spec reads (a tower step's own layer, or the layer a cut's projector reads), at
    the tokens that layer attends over, and the tower layers its settings name (``vision named`` needs: a read
    shape that names the setting). `settings`: the method's hyperparameters where they differ from the
    schedule's."""
    spec = METHODS.get(schedule.variant)
    if spec is None:
        return []
    reads_of = spec.reads
    if reads_of is None and (spec.probes.layer_probabilities or any(
            probe.probabilities for probe in spec.probes.tower_probes)):
        reads_of = whole_layer  # a spec that reads whole layers without saying what: every score once
    if reads_of is None:
        return []
    hp = {**spec.hyperparameters, **schedule.settings_dict(), **(settings or {})}
    named_probes = dict(spec.probes.named_tower_layers)
    step_probe = spec.probes.step_tower_layers or spec.probes.last_tower_layer
    v, d = arch.vision, arch.decoder
    suffix = suffix_tokens(arch, plan.text_tokens)
    reads: list[Read] = []
    for red in plan.reductions:
        if red.stage == "vision":
            tokens = plan.vision[red.layer][0]
            sequences, heads, head_dim = batch * plan.vision_items, v.heads, v.hidden // v.heads
        else:
            tokens = plan.llm[red.layer][0]
            sequences, heads, head_dim = batch, d.heads, d.head_dim
        context = ReadContext(red.stage, tokens, red.visual_before, red.removed, v.has_cls and red.stage == "vision",
                              suffix, hp)
        # The shapes by the layer they read: the reducing layer's, then every named tower layer's in turn.
        by_layer: dict[int, tuple[bool, list[tuple[str, int, int]]]] = {}
        for shape in reads_of(context):
            kind, rows, keys, *named = shape
            if named and red.stage == "vision":
                layer, probe = int(hp[named[0]]), named_probes.get(named[0])
            else:
                layer, probe = red.layer, step_probe if red.stage == "vision" else None
            whole_item = probe is not None and probe.whole_item
            by_layer.setdefault(layer, (whole_item, []))[1].append((kind, rows, keys))
        for layer, (whole_item, shapes) in by_layer.items():
            if red.stage == "vision":
                tokens = plan.vision[layer][0]
                # A layer that attends within windows (Qwen2.5-VL) reads each window's own: the pairs a run measured,
                # else the windows' estimate; a read over the whole item (`whole_item`) reads every pair.
                windowed = None if whole_item else vision_attention_pairs(arch, plan, layer, sequences)
                pairs = None if windowed is None else windowed // sequences
            else:
                pairs = None
            reads += _layer_reads(spec.name, red.stage, layer, tokens, shapes, heads, head_dim, sequences, pairs,
                                  arch)
    return reads


def _layer_reads(name: str, stage: str, layer: int, tokens: int, shapes: list[tuple[str, int, int]], heads: int,
                 head_dim: int, sequences: int, pairs: int | None, arch: Architecture) -> list[Read]:
    """The reads of one layer, `shapes` as the method asks them, made as the reads make them: a layer small enough
    read whole once, a windowed layer's columns over its windows' pairs."""
    v = arch.vision
    # Raw scores (FiCoCo's rule="official") are read as asked, never from the whole matrix of probabilities a
    # small layer keeps (ficoco.methods.reads.ops.ProbedAttention.logits).
    logits = [Read(name, stage, layer, kind, rows, keys, heads, head_dim, sequences)
              for kind, rows, keys in shapes if kind == "logits"]
    shapes = [shape for shape in shapes if shape[0] != "logits"]
    if not shapes:
        return logits
    windows = pairs is not None and pairs != tokens * tokens
    if windows and heads * max(v.window_groups) ** 2 * v.merge ** 2 <= WHOLE_READ_SCORES:
        # Every window is small enough to be read whole, once: its column sums and rows come from it.
        return [*logits, Read(name, stage, layer, "columns", tokens, tokens, heads, head_dim, sequences, pairs)]
    if not windows and sequences * heads * tokens * tokens <= WHOLE_READ_SCORES:
        # The layer is read whole at its first read, once (ficoco.methods.reads.WHOLE_READ_SCORES); a decoder
        # layer's rows each over the keys the causal mask lets them see.
        tiles = causal_tiles(tokens, tokens - 1, tokens, tokens) if stage == "llm" else [(0, tokens, tokens)]
        return [*logits, *(Read(name, stage, layer, "rows", r1 - r0, keys, heads, head_dim, sequences)
                           for r0, r1, keys in tiles)]
    return [*logits, *(Read(name, stage, layer, kind, rows, keys, heads, head_dim, sequences,
                            pairs if kind == "columns" and windows else None) for kind, rows, keys in shapes)]
