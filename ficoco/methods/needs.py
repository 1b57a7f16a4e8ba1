"""What a method reads from the model (`Need`, typed), and the one probe plan the model adapters
build from it (`ProbePlan`). No torch.

A spec lists its needs in words a reader can check against the paper (``Need("attention_rows",
"L-1", "last", ...)``); the adapters never parse those words. `probe_plan` turns a spec's needs
into a `ProbePlan` once, when the spec is made, and both the tower-side patches
(ficoco.models.vision_steps) and the decoder-side patches (ficoco.models.llm_steps) read that
plan. A need that no hook point of the method's placement reads is refused there, in one line: a
typo or a need the adapters do not serve cannot silently mean "not probed".

What each placement reads (`probe_plan`):

- before the LLM (``acts_at`` ``vision_layer`` or ``after_projector``): ``keys``,
  ``attention_rows`` or ``query_key`` of ``vision L`` (the tower layer of each step), ``vision last``
  (the tower's last layer) or ``vision named`` (the tower layer a setting of the method names: the
  need's ``at``, e.g. HiPrune's ``object_layer``), rows ``cls`` (the [CLS] query is kept as well),
  ``all`` (``attention_rows`` of every row: the layer's head-mean probabilities, as the layer ran; a
  Qwen2.5-VL window block's every window's own, in the image's grid order) or
  ``item`` (every row over every key of the tower item, the layer's window mask left out: a
  Qwen2.5-VL window block read as if it attended over the whole image; elsewhere the same as
  ``all``); ``hidden`` of
  ``vision L`` (a step in a tower layer or at the tower's output) or ``projector`` (a cut after
  the projector); ``input_embeddings`` of the prompt's ``suffix`` (the instruction); ``pixels`` of
  ``tower input``, rows ``all`` (a cut at the tower's input, ``tower_input``: every unit's pixels);

  A ``vision named`` need is probed at the layer its setting holds once the schedule is made: the
  accountant resolves the setting on the tower a run plans (`MethodSpec.tower_layers`, a 0-based
  tower layer in the schedule's settings), and every family's tower pass probes that layer too and
  hands what it kept to the method as ``TowerInput.named[at]`` (ficoco.methods.inputs.TowerLayerProbe),
  in the layout of the step's own keys and attention ([CLS] first where the tower has one, a merge
  unit's patches consecutive, the units in grid order);
- at the input of a decoder layer L (``layer_input``): ``attention_rows`` of ``L-1``, rows
  ``last`` or ``suffix``; ``keys`` of ``L-1``; ``query_key`` of ``L``, row ``last`` (the layer's
  own projections, with its RoPE, or, with ``rope="1d"``, with it only where the decoder's positions
  are 1-D: VScan's official Qwen2.5-VL code ranks by its M-RoPE decoder's q and k without it);
  ``input_embeddings`` (once per prefill); ``hidden`` of ``L`` or ``L-1`` (the step's input, which is
  layer L-1's output); ``grid`` of the ``embeddings``, rows ``all`` (where every visual token stands on
  the grid of its image, crop grid, tile or frame, as the LLM received the span: `StepInput.images`,
  from the adapter that knows the call's images);
- inside a decoder layer L (``in_layer``, FiCoCo-L, FitPrune): ``attention_rows`` of ``L``, rows
  ``visual+suffix`` (the layer's own head-mean probabilities, or with ``heads="max"`` its head-max ones:
  FitPrune); ``hidden`` of ``L``.

A need's ``heads`` other than ``"mean"`` is read by that hook point alone; elsewhere it is refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal, get_args

from ficoco.errors import FicocoError
from ficoco.methods.reads import HEAD_STATISTICS

NeedKind = Literal["attention_rows", "query_key", "keys", "hidden", "input_embeddings", "grid", "pixels"]
NeedLayer = Literal["L-1", "L", "embeddings", "vision L", "vision last", "vision named", "projector",
                    "tower input"]
NeedRows = Literal["last", "suffix", "visual+suffix", "cls", "all", "item"]
NEED_KINDS: tuple[str, ...] = get_args(NeedKind)
NEED_LAYERS: tuple[str, ...] = get_args(NeedLayer)
NEED_ROWS: tuple[str, ...] = get_args(NeedRows)
# How a ``query_key`` need's recomputed row treats the layer's rotary embedding: ``"always"`` applies it at the
# current positions (PDrop); ``"1d"`` applies it where the decoder's positions are 1-D (LLaMA's RoPE) and leaves it
# out where they are 3-D (Qwen2-VL's M-RoPE): VScan's official LLaVA code rotates its rank row, its Qwen2.5-VL code
# does not (qwen2_5_vl_custom.py:723-726, commented out).
RopeRule = Literal["always", "1d"]
ROPE_RULES: tuple[str, ...] = get_args(RopeRule)
# The layer of a need whose tower layer a setting of the method names (`Need.at`).
NAMED_LAYER = "vision named"


@dataclass(frozen=True)
class Need:
    """One thing a method reads from the model at one point of the forward.

    Attributes:
        kind: ``attention_rows`` (softmaxed, head-mean probabilities of some query rows over
            all keys, post-RoPE, causal and padding masked), ``query_key`` (the method
            recomputes rows itself from a layer's own q/k projections), ``keys`` (post-RoPE
            key states, heads concatenated), ``hidden`` (hidden states),
            ``input_embeddings`` (the LLM's input embeddings, before layer 0), ``grid`` (where every
            visual token stands on its image's grid, as the LLM received the span), or ``pixels`` (the
            image's pixels, before the tower's first layer).
        layer: where, relative to the step's layer L: ``"L-1"`` (the layer before the step),
            ``"L"`` (the step's own layer), ``"embeddings"``, ``"vision L"`` (the tower layer of
            the step), ``"vision last"`` (the tower's last layer), ``"vision named"`` (the tower
            layer the setting `at` holds), ``"projector"`` (its output), ``"tower input"`` (what the
            tower receives, before its first layer).
        rows: which query rows or tokens: ``last`` (the last prompt token), ``suffix`` (every
            text token after the visual span), ``visual+suffix``, ``cls``, ``all``, ``item`` (every
            row over the whole tower item, a window mask left out).
        detail: one sentence on why and in what form.
        heads: how ``attention_rows`` combine the heads: ``"mean"`` (every method but one), or ``"max"``,
            the largest probability any head gives a query and key (FitPrune's head-max map).
        at: for ``"vision named"`` only, the name of the method's setting (a hyperparameter) that holds
            the tower layer read: a 0-based tower layer once the schedule is made.
        rope: for ``query_key`` only, how the recomputed row treats the layer's rotary embedding (`ROPE_RULES`):
            ``"always"`` (at the current positions), or ``"1d"`` (only on a decoder of 1-D positions).

    Each field is checked when the need is made: a value outside its `Literal` is refused in one
    line naming the values allowed, and so is an `at` missing from a ``vision named`` need or given
    to another.
    """

    kind: NeedKind
    layer: NeedLayer
    rows: NeedRows
    detail: str
    heads: str = "mean"
    at: str = ""
    rope: RopeRule = "always"

    def __post_init__(self) -> None:
        for field_name, allowed in (("kind", NEED_KINDS), ("layer", NEED_LAYERS), ("rows", NEED_ROWS),
                                    ("heads", HEAD_STATISTICS), ("rope", ROPE_RULES)):
            value = getattr(self, field_name)
            if value not in allowed:
                raise ValueError(f"Need({self.kind!r}, {self.layer!r}, {self.rows!r}): {field_name} {value!r} is not "
                                 f"one of {', '.join(allowed)}")
        if (self.layer == NAMED_LAYER) != bool(self.at):
            raise ValueError(f"Need({self.kind!r}, {self.layer!r}, {self.rows!r}): a {NAMED_LAYER!r} need names the "
                             "setting that holds its tower layer (at=...), and only such a need does")
        if self.rope != "always" and self.kind != "query_key":
            raise ValueError(f"Need({self.kind!r}, {self.layer!r}, {self.rows!r}): rope={self.rope!r} is a rule of a "
                             "query_key need's recomputed row only")

    def to_json(self) -> dict[str, str]:
        out = {"kind": self.kind, "layer": self.layer, "rows": self.rows, "detail": self.detail}
        if self.heads != "mean":
            out["heads"] = self.heads
        if self.rope != "always":
            out["rope"] = self.rope
        return {**out, "at": self.at} if self.at else out


@dataclass(frozen=True)
class TowerProbe:
    """What one tower layer's attention module keeps in a forward: its key states (always), the
    query of [CLS] (`cls_query`, on towers that have one) and the reads of the head-mean probabilities
    of every query over every key (`probabilities`), as the layer ran or, with `whole_item`, over the
    whole tower item with the layer's window mask left out (Qwen2.5-VL's window blocks; elsewhere the
    same)."""

    cls_query: bool = False
    probabilities: bool = False
    whole_item: bool = False

    def merged(self, other: TowerProbe | None) -> TowerProbe | None:
        """The probe that serves both this one's needs and `other`'s; None where they ask one layer's
        probabilities both as it ran and over the whole item (two reads of it, which no probe keeps)."""
        if other is None:
            return self
        if self.probabilities and other.probabilities and self.whole_item != other.whole_item:
            return None
        return TowerProbe(self.cls_query or other.cls_query, self.probabilities or other.probabilities,
                          self.whole_item or other.whole_item)


@dataclass(frozen=True)
class ProbePlan:
    """What the model adapters capture for one method, at which layer, which rows (`probe_plan`).

    Attributes:
        step_tower_layers: the probe at every tower layer a vision step acts at (``vision L``), or None.
        last_tower_layer: the probe at the tower's last layer (``vision last``), or None.
        named_tower_layers: (setting, probe) of every tower layer a setting names (``vision named``):
            the layer is the setting's value in the schedule (`named_layers`).
        previous_layer_rows: the attention rows of decoder layer L-1 a step at L reads: ``"last"``
            (the last prompt token's row per head), ``"suffix"`` (head-mean rows of the text after
            the visual span), or None.
        previous_layer_keys: the post-RoPE keys of layer L-1.
        own_query_key_row: layer L's own last-row query and keys, recomputed from its projections.
        own_row_rope: how that row treats the layer's rotary embedding (`ROPE_RULES`).
        layer_probabilities: inside decoder layer L, the layer's own probabilities, their heads combined by
            `layer_heads` (``"mean"``; ``"max"``: FitPrune's head-max).
        input_embeddings: the prompt's input embeddings (decoder: once per prefill, for `prepare`;
            before the LLM: the instruction's, handed to the cut).
        image_grids: every image's grids in the decoder (`StepInput.images`), from the call's images.
        pixels: every unit's pixels, handed to a cut at the tower's input (``tower_input``: PixelPrune).
    """

    step_tower_layers: TowerProbe | None = None
    last_tower_layer: TowerProbe | None = None
    named_tower_layers: tuple[tuple[str, TowerProbe], ...] = ()
    previous_layer_rows: Literal["last", "suffix"] | None = None
    previous_layer_keys: bool = False
    own_query_key_row: bool = False
    own_row_rope: str = "always"
    layer_probabilities: bool = False
    layer_heads: str = "mean"
    input_embeddings: bool = False
    image_grids: bool = False
    pixels: bool = False

    @property
    def reads_tower(self) -> bool:
        """Whether any tower layer is probed (a cut after the projector may read nothing of the tower)."""
        return self.step_tower_layers is not None or self.last_tower_layer is not None or bool(self.named_tower_layers)

    @property
    def tower_probes(self) -> tuple[TowerProbe, ...]:
        """Every tower probe of the plan (the step's, the last layer's, the named layers')."""
        fixed = (self.step_tower_layers, self.last_tower_layer)
        return tuple(probe for probe in fixed if probe is not None) + tuple(p for _, p in self.named_tower_layers)

    def named_layers(self, settings: Mapping[str, Any], layers: int) -> dict[str, int]:
        """Per ``vision named`` setting, the 0-based tower layer `settings` give it, checked against a tower of
        `layers` layers; a setting the schedule did not resolve to such a layer is refused in one line."""
        out = {}
        for name, _ in self.named_tower_layers:
            value = settings.get(name)
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < layers:
                raise FicocoError(f"{name}={value!r} names no layer of this {layers}-layer vision tower: give a layer "
                                  f"0..{layers - 1}")
            out[name] = value
        return out


_TOWER_PROBED = ("keys", "attention_rows", "query_key")


def _read(plan: ProbePlan, need: Need, acts_at: str, placement: str) -> ProbePlan | None:
    """`plan` with what `need` asks captured, or None when no hook point of the placement reads it."""
    kind, layer, rows = need.kind, need.layer, need.rows
    if need.heads != "mean" and not (placement == "in_layer" and acts_at == "llm_layer" and kind == "attention_rows"):
        return None  # only the decoder's in-layer probe combines the heads otherwise
    if acts_at != "llm_layer":  # before the LLM
        if kind in _TOWER_PROBED and layer in ("vision L", "vision last", NAMED_LAYER) and rows in ("cls", "all",
                                                                                                 "item"):
            whole = kind == "attention_rows" and rows in ("all", "item")
            probe = TowerProbe(cls_query=rows == "cls", probabilities=whole, whole_item=whole and rows == "item")
            if layer == NAMED_LAYER:
                named = dict(plan.named_tower_layers)
                merged = probe.merged(named.get(need.at))
                if merged is None:
                    return None
                named[need.at] = merged
                return replace(plan, named_tower_layers=tuple(named.items()))
            merged = probe.merged(plan.step_tower_layers if layer == "vision L" else plan.last_tower_layer)
            if merged is None:
                return None
            if layer == "vision L":
                return replace(plan, step_tower_layers=merged)
            return replace(plan, last_tower_layer=merged)
        if kind == "hidden" and rows == "all":
            # The step receives the tower layer's tokens, or the projector's output for a cut after it.
            handed = "projector" if placement == "after_projector" else "vision L"
            return plan if layer == handed else None
        if kind == "input_embeddings" and layer == "embeddings" and rows == "suffix":
            return replace(plan, input_embeddings=True)
        if kind == "pixels" and layer == "tower input" and rows == "all" and placement == "tower_input":
            return replace(plan, pixels=True)
        return None
    if placement == "in_layer":
        if kind == "attention_rows" and layer == "L" and rows == "visual+suffix":
            if plan.layer_probabilities and plan.layer_heads != need.heads:
                return None  # one statistic per probed layer
            return replace(plan, layer_probabilities=True, layer_heads=need.heads)
        return plan if (kind, layer, rows) == ("hidden", "L", "all") else None
    # At the input of decoder layer L.
    if kind == "attention_rows" and layer == "L-1" and rows in ("last", "suffix"):
        if plan.previous_layer_rows not in (None, rows):
            return None  # one set of rows per probed layer
        return replace(plan, previous_layer_rows=rows)
    if kind == "keys" and layer == "L-1" and rows in ("visual+suffix", "all"):
        return replace(plan, previous_layer_keys=True)
    if kind == "query_key" and layer == "L" and rows == "last":
        if plan.own_query_key_row and plan.own_row_rope != need.rope:
            return None  # one recomputed row per step
        return replace(plan, own_query_key_row=True, own_row_rope=need.rope)
    if kind == "input_embeddings" and layer == "embeddings" and rows in ("visual+suffix", "suffix"):
        return replace(plan, input_embeddings=True)
    if kind == "hidden" and layer in ("L", "L-1") and rows == "all":
        return plan  # the step's input: layer L's input is layer L-1's output
    if kind == "grid" and layer == "embeddings" and rows == "all":
        return replace(plan, image_grids=True)  # the span as the LLM received it
    return None


# What a method reads of attention, in one word (`attention_reads`), for a user choosing how to run it:
# - "probabilities": whole rows or columns of a layer's softmax (every query of a tower layer, or the visual and text
#   rows of a decoder layer); no fused kernel returns them, so ficoco computes them beside the layer's own kernel
#   (ficoco.methods.reads), at about the cost of the layer's attention;
# - "rows": a few rows (the last prompt token's, [CLS]'s, the text's), recomputed from the layer's queries and keys
#   beside any fused kernel at the cost of those rows;
# - "none": no attention at all (keys, hidden states, embeddings, grids, pixels): beside any fused kernel.
ATTENTION_READS = ("probabilities", "rows", "none")
_WHOLE_LAYER_ROWS = ("all", "item", "visual+suffix")


def attention_reads(needs: tuple[Need, ...]) -> str:
    """One of ATTENTION_READS: the most `needs` (a method's, its inner part's included) read of attention."""
    if any(n.kind == "attention_rows" and n.rows in _WHOLE_LAYER_ROWS for n in needs):
        return "probabilities"
    if any(n.kind in ("attention_rows", "query_key") for n in needs):
        return "rows"
    return "none"


def probe_plan(name: str, needs: tuple[Need, ...], acts_at: str, placement: str) -> ProbePlan:
    """The `ProbePlan` of a method `name` acting at `acts_at` / `placement` with `needs`; a need that
    no hook point of that placement reads is refused (ValueError, one line)."""
    plan = ProbePlan()
    for need in needs:
        if not isinstance(need, Need):
            raise ValueError(f"{name}: needs holds {need!r}, not a Need")
        read = _read(plan, need, acts_at, placement)
        if read is None:
            raise ValueError(f"{name}: Need({need.kind!r}, {need.layer!r}, {need.rows!r}) is read by no hook point of "
                             f"a method at {acts_at} ({placement}); ficoco.methods.needs says what each reads")
        plan = read
    return plan
