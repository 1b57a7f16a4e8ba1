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
  ``attention_rows`` or ``query_key`` of ``vision L`` (the tower layer of each step) or
  ``vision last`` (the tower's last layer), rows ``cls`` (the [CLS] query is kept as well) or
  ``all`` (``attention_rows`` of every row: the layer's head-mean probabilities); ``hidden`` of
  ``vision L`` (a step in a tower layer or at the tower's output) or ``projector`` (a cut after
  the projector); ``input_embeddings`` of the prompt's ``suffix`` (the instruction); ``pixels`` of
  ``tower input``, rows ``all`` (a cut at the tower's input, ``tower_input``: every unit's pixels);
- at the input of a decoder layer L (``layer_input``): ``attention_rows`` of ``L-1``, rows
  ``last`` or ``suffix``; ``keys`` of ``L-1``; ``query_key`` of ``L``, row ``last`` (the layer's
  own projections); ``input_embeddings`` (once per prefill); ``hidden`` of ``L`` or ``L-1`` (the
  step's input, which is layer L-1's output);
- inside a decoder layer L (``in_layer``, FiCoCo-L): ``attention_rows`` of ``L``, rows
  ``visual+suffix`` (the layer's own head-mean probabilities); ``hidden`` of ``L``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal, get_args

NeedKind = Literal["attention_rows", "query_key", "keys", "hidden", "input_embeddings", "pixels"]
NeedLayer = Literal["L-1", "L", "embeddings", "vision L", "vision last", "projector", "tower input"]
NeedRows = Literal["last", "suffix", "visual+suffix", "cls", "all"]
NEED_KINDS: tuple[str, ...] = get_args(NeedKind)
NEED_LAYERS: tuple[str, ...] = get_args(NeedLayer)
NEED_ROWS: tuple[str, ...] = get_args(NeedRows)


@dataclass(frozen=True)
class Need:
    """One thing a method reads from the model at one point of the forward.

    Attributes:
        kind: ``attention_rows`` (softmaxed, head-mean probabilities of some query rows over
            all keys, post-RoPE, causal and padding masked), ``query_key`` (the method
            recomputes rows itself from a layer's own q/k projections), ``keys`` (post-RoPE
            key states, heads concatenated), ``hidden`` (hidden states),
            ``input_embeddings`` (the LLM's input embeddings, before layer 0), or ``pixels`` (the
            image's pixels, before the tower's first layer).
        layer: where, relative to the step's layer L: ``"L-1"`` (the layer before the step),
            ``"L"`` (the step's own layer), ``"embeddings"``, ``"vision L"`` (the tower layer of
            the step), ``"vision last"`` (the tower's last layer), ``"projector"`` (its output),
            ``"tower input"`` (what the tower receives, before its first layer).
        rows: which query rows or tokens: ``last`` (the last prompt token), ``suffix`` (every
            text token after the visual span), ``visual+suffix``, ``cls``, ``all``.
        detail: one sentence on why and in what form.

    Each field is checked when the need is made: a value outside its `Literal` is refused in one
    line naming the values allowed.
    """

    kind: NeedKind
    layer: NeedLayer
    rows: NeedRows
    detail: str

    def __post_init__(self) -> None:
        for field_name, allowed in (("kind", NEED_KINDS), ("layer", NEED_LAYERS), ("rows", NEED_ROWS)):
            value = getattr(self, field_name)
            if value not in allowed:
                raise ValueError(f"Need({self.kind!r}, {self.layer!r}, {self.rows!r}): {field_name} {value!r} is not "
                                 f"one of {', '.join(allowed)}")

    def to_json(self) -> dict[str, str]:
        return {"kind": self.kind, "layer": self.layer, "rows": self.rows, "detail": self.detail}


@dataclass(frozen=True)
class TowerProbe:
    """What one tower layer's attention module keeps in a forward: its key states (always), the
    query of [CLS] (`cls_query`, on towers that have one) and the head-mean probabilities of every
    query over every key (`probabilities`: the layer's output is then computed from them)."""

    cls_query: bool = False
    probabilities: bool = False

    def merged(self, other: TowerProbe | None) -> TowerProbe:
        """The probe that serves both this one's needs and `other`'s."""
        if other is None:
            return self
        return TowerProbe(self.cls_query or other.cls_query, self.probabilities or other.probabilities)


@dataclass(frozen=True)
class ProbePlan:
    """What the model adapters capture for one method, at which layer, which rows (`probe_plan`).

    Attributes:
        step_tower_layers: the probe at every tower layer a vision step acts at (``vision L``), or None.
        last_tower_layer: the probe at the tower's last layer (``vision last``), or None.
        previous_layer_rows: the attention rows of decoder layer L-1 a step at L reads: ``"last"``
            (the last prompt token's row per head), ``"suffix"`` (head-mean rows of the text after
            the visual span), or None.
        previous_layer_keys: the post-RoPE keys of layer L-1.
        own_query_key_row: layer L's own last-row query and keys, recomputed from its projections.
        layer_probabilities: inside decoder layer L, the layer's own head-mean probabilities.
        input_embeddings: the prompt's input embeddings (decoder: once per prefill, for `prepare`;
            before the LLM: the instruction's, handed to the cut).
        pixels: every unit's pixels, handed to a cut at the tower's input (``tower_input``: PixelPrune).
    """

    step_tower_layers: TowerProbe | None = None
    last_tower_layer: TowerProbe | None = None
    previous_layer_rows: Literal["last", "suffix"] | None = None
    previous_layer_keys: bool = False
    own_query_key_row: bool = False
    layer_probabilities: bool = False
    input_embeddings: bool = False
    pixels: bool = False

    @property
    def reads_tower(self) -> bool:
        """Whether any tower layer is probed (a cut after the projector may read nothing of the tower)."""
        return self.step_tower_layers is not None or self.last_tower_layer is not None


_TOWER_PROBED = ("keys", "attention_rows", "query_key")


def _read(plan: ProbePlan, need: Need, acts_at: str, placement: str) -> ProbePlan | None:
    """`plan` with what `need` asks captured, or None when no hook point of the placement reads it."""
    kind, layer, rows = need.kind, need.layer, need.rows
    if acts_at != "llm_layer":  # before the LLM
        if kind in _TOWER_PROBED and layer in ("vision L", "vision last") and rows in ("cls", "all"):
            probe = TowerProbe(cls_query=rows == "cls", probabilities=kind == "attention_rows" and rows == "all")
            if layer == "vision L":
                return replace(plan, step_tower_layers=probe.merged(plan.step_tower_layers))
            return replace(plan, last_tower_layer=probe.merged(plan.last_tower_layer))
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
            return replace(plan, layer_probabilities=True)
        return plan if (kind, layer, rows) == ("hidden", "L", "all") else None
    # At the input of decoder layer L.
    if kind == "attention_rows" and layer == "L-1" and rows in ("last", "suffix"):
        if plan.previous_layer_rows not in (None, rows):
            return None  # one set of rows per probed layer
        return replace(plan, previous_layer_rows=rows)
    if kind == "keys" and layer == "L-1" and rows in ("visual+suffix", "all"):
        return replace(plan, previous_layer_keys=True)
    if kind == "query_key" and layer == "L" and rows == "last":
        return replace(plan, own_query_key_row=True)
    if kind == "input_embeddings" and layer == "embeddings" and rows in ("visual+suffix", "suffix"):
        return replace(plan, input_embeddings=True)
    if kind == "hidden" and layer in ("L", "L-1") and rows == "all":
        return plan  # the step's input: layer L's input is layer L-1's output
    return None


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
