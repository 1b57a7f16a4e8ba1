"""What a visual-token reduction method declares about itself: the `MethodSpec`.

Nothing here imports torch: the accountant (`ficoco flops`) reads specs to plan tokens and
costs without loading any tensor code. A spec names the module that holds the method's
tensor functions; `MethodSpec.load()` imports it only when a model actually runs.

A method is described by

- **where it acts** (`acts_at`): inside a vision-tower layer, after the projector, or in the
  LLM decoder; and **how** (`placement`): inside a layer after its attention block and before
  its MLP (FiCoCo), or at the input of a decoder layer, before the layer runs (FastV, PDrop,
  SparseVLM, DART: the reduced set is what every later layer sees);
- **what it needs from the model** (`needs`, typed `Need`s, ficoco.methods.needs): which
  attention-probability rows (of which layer, which query rows, over which keys), key states, or
  hidden states; the spec turns them into one `ProbePlan` (`MethodSpec.probes`) that the model
  adapters read, so that they offer one set of hook points and probes for every method;
- **its hyperparameters** with the defaults of its official code (where ficoco corrects that code,
  the correction is a named value of a hyperparameter, `corrections`, never its default; FiCoCo, which its
  paper defines, has the paper's defaults, each with its source, `default_sources`, and its official code's
  rule by name, `rules`), its **position scheme** (original position ids kept, or compacted), and the
  families it is defined on;
- **its schedule**: the plain token-count steps (`Step`) a setting produces, how a budget
  maps to a setting (`settings_for_keep`: the literature's "N tokens" rows; `presets`), and
- **its extra cost terms** (`extra_macs`): the matrix work the method adds beyond the model's
  own layers (score rows, projections it recomputes, similarity matrices), per step.

All arithmetic here is on plain ints (no Architecture, no torch), so the registry depends on
nothing above it and the accountant can import it. A spec names its planner by a word
(`PlannerName`); the planners themselves are functions of the accountant
(ficoco.accounting.planners.PLANNERS), which the methods package never imports.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Literal, Protocol, get_args

from ficoco.errors import FicocoError
from ficoco.methods.needs import NEED_KINDS, Need, ProbePlan, attention_reads, probe_plan
from ficoco.methods.reads import ReadShapes

__all__ = ["ACTING_LAYERS", "ACTS_AT", "CLS_TO_PROJECTOR", "FAMILY_STATUSES", "FULL_ATTENTION_LAYERS",
           "NEED_KINDS", "NOT_WIRED", "PLACEMENTS", "PLANNER_NAMES", "POSITION_SCHEMES", "RULE", "STAGES", "Dims",
           "ExtraMacs", "LayerWork", "MethodSpec", "Need", "Planner", "PlannerName", "Rule", "Step", "StepContext",
           "TowerLayout"]

ACTS_AT = ("vision_layer", "after_projector", "llm_layer")
PLACEMENTS = ("in_layer", "layer_input", "tower_output", "after_projector", "tower_input")
STAGES = ("vision", "llm")
# The position ids the layers after a step use: "original" (every token keeps its own, gaps included), "compact"
# (renumbered without gaps; decode steps continue from the last), "grid" (a cut before the LLM: the model's own
# layout), "reindexed" (each token's row index in the sequence entering the step, from the first visual token's
# id on: the gaps earlier steps left close, this step's own stay; decode steps keep the model's own ids:
# ViTCoP's deep stage).
POSITION_SCHEMES = ("original", "compact", "grid", "reindexed")
# How a spec is planned, by name (the accountant's table ficoco.accounting.planners.PLANNERS maps each to its
# function): "by_steps" reads the spec's `steps`, `settings_for_keep` and `extra_macs`; "per_layer" plans any
# count at any reducing layer from `first_layer` (FiCoCo-V and -L).
PlannerName = Literal["by_steps", "per_layer"]
PLANNER_NAMES: tuple[str, ...] = get_args(PlannerName)
# The key under which the accountant hands the `steps` of a method acting before the LLM what they cannot read from
# their settings: whether the item's [CLS] can reach the projector among the cut's tokens (as
# `StepContext.cls_to_projector`; VisionZip's official dominant tokens hold it). The schedule's settings never keep it.
CLS_TO_PROJECTOR = "cls_to_projector"
# The key under which the accountant hands the `steps` of a decoder method a hybrid decoder's full-attention layers
# (Qwen3.5's; absent on a decoder whose every layer is full attention), for a method whose steps spread over the
# layers (FitPrune's scaled scheme): only those may reduce inside them. Not a setting: the schedule never keeps it.
FULL_ATTENTION_LAYERS = "full_attention_layers"
# The key under which the accountant hands the `settings_for_keep` of a method whose steps withdraw every visual token
# (`removes_all`: VTW, whose `--keep` picks its layer) the decoder layers it may act at, where not every layer may (a
# hybrid decoder: ficoco.methods.hybrid.HybridLayers.withdrawal_layers); absent: every layer. Never a setting.
ACTING_LAYERS = "acting_layers"
# A family's cell in the method matrix (`ficoco methods --matrix`): the models run the method there;
# `ficoco flops` plans it but the models refuse it; or it is refused outright (a stated reason, or
# NOT_WIRED for a family no entry names yet: a new family shows up refused until an entry lists it).
FAMILY_STATUSES = ("yes", "flops only", "refused")
NOT_WIRED = "not wired: the registry entry names no hook points for this family yet"
# The hyperparameter that names a method's rule where it has more than one (`MethodSpec.rules`).
RULE = "rule"



@dataclass(frozen=True)
class Step:
    """One change of the visual-token count, in the LLM or (``stage="vision"``) per tower item.

    ``where="layer_input"``: before decoder layer ``layer`` runs, ``remove`` visual tokens
    leave and ``added`` new ones (SparseVLM's recycled clusters) join, so layer ``layer`` and
    every later one see the new count. ``where="in_layer"``: inside layer ``layer``, after its
    attention and before its MLP (FiCoCo-L; ToMe and FiCoCo-V in a vision layer).

    Vision steps count patches (units) of one item - an image, a crop, a frame - and ``layer``
    is a tower layer: ``"in_layer"`` (ToMe), ``"tower_output"`` (after the layer the projector
    reads, before the projector: VisionZip, PruMerge+; ``added`` are their merged tokens),
    ``"after_projector"`` (the projector maps every patch, then ``remove`` leave: FasterVLM) or
    ``"tower_input"`` (layer 0: before the tower's first layer, decided from the pixels, so every
    tower layer, the projector and the LLM see the reduced count: PixelPrune).
    """

    layer: int
    remove: int
    added: int = 0
    where: str = "layer_input"
    stage: str = "llm"

    def __post_init__(self) -> None:
        if self.where not in PLACEMENTS:
            raise ValueError(f"unknown step placement {self.where!r}")
        if self.stage not in STAGES:
            raise ValueError(f"unknown step stage {self.stage!r}")
        if self.remove < 0 or self.added < 0 or self.layer < 0:
            raise ValueError(f"a step's layer and counts are not negative: {self}")


@dataclass(frozen=True)
class Dims:
    """The decoder widths the extra cost terms need."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int


@dataclass(frozen=True)
class StepContext:
    """What one step's extra cost depends on (per sample, or per tower item for a vision step;
    the accountant multiplies by batch, and by the items of a sample).

    Attributes:
        step: the step.
        index: its 0-based order among the method's steps.
        seq_before: sequence length entering the step's layer before the step (a vision step:
            the item's tower tokens, [CLS] included, entering the step).
        visual_before: visual tokens (a vision step: patches of the item) before the step.
        visual_initial: visual tokens the LLM received (a vision step: the item's patches).
        suffix_tokens: text tokens after the visual span.
        dims: decoder widths (a vision step: the tower's, ``kv_heads == heads``).
        settings: the method's settings (as `steps` received them).
        items: tower items per sample (a video's frames), for a method whose terms are per sample.
        projected_width: the width of the projector's output (the LLM's hidden size): what an
            ``after_projector`` step's tokens have (``dims`` are the tower's for a vision step).
        has_cls: a vision step's tower has [CLS] (False: Qwen2-VL, whose methods score by the
            equivalent token, elementwise work no counter counts, in place of a [CLS] row).
        unit_width: the width of a vision step's units before the projector: the tower's hidden size
            times the patches of a unit (Qwen2-VL's merge groups, their patches side by side); 0: unknown
            (the tower's hidden size).
        cls_to_projector: a cut before the projector could hand the item's [CLS] on among its tokens (VisionZip's
            official layout): the tower has [CLS], the projector maps single patches (no merge groups: not
            InternVL's pixel shuffle) and the model does not hand [CLS] to the LLM itself (Video-LLaVA does).
        anyres_crops: the crops of an AnyRes image laid out on one grid (LLaVA-NeXT, LLaVA-OneVision: the items
            after the base view), for a method that cuts that grid whole (`MethodSpec.anyres_grid`); 0 elsewhere.
    """

    step: Step
    index: int
    seq_before: int
    visual_before: int
    visual_initial: int
    suffix_tokens: int
    dims: Dims
    settings: Mapping[str, Any]
    items: int = 1
    projected_width: int = 0
    has_cls: bool = True
    unit_width: int = 0
    cls_to_projector: bool = False
    anyres_crops: int = 0


# (layer the work runs at, what it is, multiply-accumulates per sample); layer None: before layer 0.
ExtraMacs = list[tuple[int | None, str, int]]


@dataclass(frozen=True)
class TowerLayout:
    """The vision tower a run plans, as a method's `tower_layers` reads it to pick the tower layers its
    ``vision named`` needs read (ficoco.methods.needs): the official layer where the tower has the official
    depth, else the method's stated rule; and any other setting that follows the tower (VScan's scan, which
    its official codes run per family, and their default counts of an item's units).

    Attributes:
        family: the model family ("llava", "qwen2_5_vl", ...).
        layers: the tower's layers (all of them run).
        feature_layer: the 0-based layer whose output the projector reads.
        full_attention: the layers that attend over the whole item (every layer where the tower has no
            windows; Qwen2.5-VL: its fullatt_block_indexes).
        units: the units (patches, or merge groups) of one tower item a cut counts; 0: not given.
    """

    family: str
    layers: int
    feature_layer: int
    full_attention: tuple[int, ...]
    units: int = 0


@dataclass(frozen=True)
class LayerWork:
    """One in-layer reduction, as a method's `layer_macs` formula reads it.

    Attributes:
        stage: "vision" (a tower layer) or "llm" (a decoder layer).
        items: the sequences the layer runs on (tower items of all samples, or samples).
        visual_before: visual tokens entering the layer, per item (merge units' tokens in a packed tower).
        removed: of those, the tokens the layer removes.
        dim: the layer's hidden width.
        merge: tokens per merge group (Qwen2-VL's packed tower: 4; 1 elsewhere).
        suffix_tokens: the prompt's tokens after the visual span (the decoder's task rows).
    """

    stage: str
    items: int
    visual_before: int
    removed: int
    dim: int
    merge: int = 1
    suffix_tokens: int = 0
    # The method's settings as the run has them (its defaults, then the schedule's): a rule changes its products.
    settings: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Rule:
    """A named rule of a method beside its default one, chosen with the method's `rule` hyperparameter (`RULE`).

    FiCoCo is ficoco's own method: its paper defines it, and its default rule is the paper's text; its authors'
    code departs from that text, and ``rule="official"`` runs the code's rule. Such a rule is no correction of an
    official code (`MethodSpec.corrections`): every report names it beside the title (`label`), so that a score of
    one rule is never read as the other's. The per-layer planner reads the rest.

    Attributes:
        label: what a report adds to the method's title ("official code's rule").
        first_layer_offset: the rule's first reducing layer, this many layers after the profile's (the default
            rule's) when none is given.
        removed_per_layer: the rule's own setting: this many units at every reducing layer from its first (a run
            without --keep, --tflops or --schedule); None: it has none.
        families: the families it runs on (None: every family of the method); `refusal`: why not on the others.
        positions: its position scheme (POSITION_SCHEMES) where it differs from the method's ("": the same).
        images: the most image spans a prompt may hold under it (None: any).
    """

    label: str
    first_layer_offset: int = 0
    removed_per_layer: int | None = None
    families: tuple[str, ...] | None = None
    refusal: str = ""
    positions: str = ""
    images: int | None = None

    def __post_init__(self) -> None:
        if self.positions and self.positions not in POSITION_SCHEMES:
            raise ValueError(f"rule '{self.label}': unknown position scheme {self.positions!r}")


class Planner(Protocol):
    """A planner of the accountant's table (`MethodSpec.planner` names one): the schedule of `spec` on
    `arch` (an Architecture) for `request` (a ficoco.accounting.schedule.PlanRequest). It raises
    FicocoError with one line when the request does not fit."""

    def __call__(self, arch: Any, spec: MethodSpec, request: Any) -> Any: ...


@dataclass(frozen=True)
class MethodSpec:
    """A reduction method, as the registry, the accountant, the CLI and the adapters see it.

    Every method is planned through the planner its entry names (`planner`, a `PlannerName`): the
    accountant (ficoco.accounting.planners.plan) turns a request (--keep, --preset, --tflops,
    --schedule, hyperparameters) into a `Schedule` with it. The default, "by_steps", reads `steps`,
    `settings_for_keep` and `extra_macs`; FiCoCo-V and -L name "per_layer" (any count at any
    reducing layer from `first_layer`, uniform or one-shot, budgets by bisection), and have no `steps`.

    `module` names the module of the method's tensor functions (a method folder's spec writes
    ``f"{__name__}.ops"``: its own ``ops.py``); `load()` imports it only when a model runs.

    A method that acts before the LLM (`acts_at` ``vision_layer`` or ``after_projector``)
    counts per tower item: its `steps` and `settings_for_keep` receive the patches (units) of
    one item and the tower layers up to the one the projector reads, and return vision steps.
    `cls_note` says what such a method uses in place of [CLS] attention on towers without one.
    """

    name: str
    title: str
    acts_at: str
    placement: str
    positions: str
    needs: tuple[Need, ...]
    hyperparameters: Mapping[str, Any]
    families: tuple[str, ...]
    module: str
    function: str
    source: str
    summary: str
    keep_means: str  # what `--keep N` (and `--preset N`) counts for this method
    steps: Callable[[Mapping[str, Any], int, int], tuple[Step, ...]] | None = None
    # (keep or None for the official default, visual tokens, decoder layers, hyperparameters) -> settings
    settings_for_keep: Callable[[int | None, int, int, Mapping[str, Any]], dict[str, Any]] | None = None
    keep_choices: tuple[int, ...] | None = None  # keeps a budget search may pick (None: any)
    extra_macs: Callable[[StepContext], ExtraMacs] | None = None
    wired: bool = False  # whether the model adapters run it yet
    # Its merges are decided from the keys and the attention alone, never from the hidden states it merges, or from
    # those hidden states' own channels only, the riding ones left out (`TowerInput.riding`: VScan's cosine merge):
    # features that ride with the hidden states through its step (Qwen3-VL's DeepStack features) merge with its own
    # weights. False: such features follow its kept tokens only, and a family that has them refuses its merges.
    merges_by_keys: bool = False
    # A method at a decoder layer's input that folds the tokens it removes into those it keeps, weighted by their
    # hidden states (VLM-Pruner's SWA): features a family still adds to the visual tokens after the step (Qwen3-VL's
    # DeepStack) cannot be folded alike, and that family refuses such a step before its last addition.
    folds_removed: bool = False
    # A cut of a video's frames whose every token stands at one place of the video (`TowerOutput.positions`: a merged
    # token, its representative's), whose official code hands the decoder the DeepStack features of those places
    # (FlashVID on Qwen3-VL): such features follow the places, merged tokens included. False: a family with such
    # features refuses a video cut that merges (HoliTom).
    features_follow_places: bool = False
    cls_note: str = ""  # towers without [CLS] (Qwen2-VL): what replaces the [CLS] attention
    # A vision method whose extra_macs are per sample (work across a video's frames), not per item.
    extra_per_sample: bool = False
    # A method acting before the LLM and again inside it (HoliTom): the part in the decoder, a
    # layer-input spec whose `steps` count the visual tokens the outer part handed the LLM.
    inner: MethodSpec | None = None
    # Per family, one line on why the models do not run the method there. A family of `families`
    # listed here is planned by `ficoco flops` but refused by the models ("flops only"); a family
    # outside `families` is refused everywhere, with this reason or NOT_WIRED's.
    refusals: Mapping[str, str] = field(default_factory=dict)
    # A cut after the projector that acts on LLaVA-OneVision's pooled video frames (the official code's
    # place for HoliTom: after the 2x2 pooling); the other cuts before the LLM are refused on a pooled grid.
    pooled_grid: bool = False
    # A cut after the projector that acts, on an AnyRes image (LLaVA-NeXT, LLaVA-OneVision), on the base view and on
    # the whole unpadded crop grid as packed (row-major, the newline tokens left out and kept) as two items, where
    # its official code cuts them so (G-Prune); False: on every crop apart. Either way the grid keeps the schedule's
    # count per crop in all.
    anyres_grid: bool = False
    # How the entry is planned: a name of the accountant's planner table (see above).
    planner: PlannerName = "by_steps"
    # Per step, in the order of the method's steps, the position scheme of that step where the steps differ
    # (ViTCoP's part in the decoder: "original" at its shallow stage, "reindexed" at its deep one); empty:
    # `positions` at every step (`step_positions_at`).
    step_positions: tuple[str, ...] = ()
    # Per family, the values the official scripts give some hyperparameters on that family's backbone, where they
    # differ from `hyperparameters` (FlashVID: Qwen2.5-VL's ADTS v1 and 4 segments); a request's own values win.
    family_hyperparameters: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    # Where ficoco corrects the official code, the correction is a named value of a hyperparameter whose default
    # stays the official behaviour: per hyperparameter, each such value with the few words a label shows
    # (`registry.method_label`: "VisionZip (ficoco: mean contextual token)"), so that a report never names the
    # corrected method as the official one. Empty: the method runs as its official code only.
    corrections: Mapping[str, Mapping[Any, str]] = field(default_factory=dict)
    # A method with more than one rule (FiCoCo: the paper's by default, the official code's by name): per value of its
    # `rule` hyperparameter other than the default, the `Rule` (what reports call it, how it is planned).
    rules: Mapping[str, Rule] = field(default_factory=dict)
    # Where a default comes from when not from the method's official code (FiCoCo: its paper), per hyperparameter,
    # in a few words `ficoco methods` shows beside it ("paper; the official code's: 5"). Empty: every default is
    # the official code's.
    default_sources: Mapping[str, str] = field(default_factory=dict)
    # False: the method has no official default setting, so a run needs --keep, --preset, --tflops or
    # --schedule (FiCoCo-V and -L).
    default_setting: bool = True
    # The method's own work at each in-layer reduction, as formulas (FiCoCo-V and -L:
    # their folders). `paper_overhead(stage, visual, removed, dim)`: what the `paper`
    # convention adds at the layer; `layer_macs(LayerWork)`: the matrix products --verify checks per
    # layer against the counters. None: the method's own work is its `extra_macs`, checked as one stage.
    paper_overhead: Callable[[str, int, int, int], int] | None = None
    layer_macs: Callable[[LayerWork], int] | None = None
    # What the method reads of a layer's attention beside the layer's own kernel (ficoco.methods.reads), per
    # reducing layer: (kind, rows, keys) per sequence, and (kind, rows, keys, setting) for a tower layer a setting
    # names. None: it reads no whole layer (a few rows at most, which are its `extra_macs`). The prediction prices
    # them at their shapes; --verify checks them.
    reads: ReadShapes | None = None
    # A method before the LLM whose needs read tower layers its settings name (``vision named``): those settings
    # resolved on the tower a run plans, (TowerLayout, settings) -> {setting: 0-based tower layer}, with any other
    # setting that follows the tower (VScan's scan per family); the accountant writes them into the schedule's
    # settings, which the adapters read. None: the settings hold the layers as given.
    tower_layers: Callable[[TowerLayout, Mapping[str, Any]], Mapping[str, Any]] | None = None
    # Its step removes every visual token (VTW's withdrawal): the planner refuses a step that leaves any, the decoder's
    # later layers run and cache the text alone, and on a hybrid decoder the step sits at a full-attention layer
    # (ficoco.methods.hybrid). False: at least one visual token stays after every step.
    removes_all: bool = False
    # --schedule LAYER:REMOVED of a layer-input method: the tokens that join at the same step, from the removed
    # count and the default settings (SparseVLM's recycled clusters); None: none join.
    added_for_removed: Callable[[int, Mapping[str, Any]], int] | None = None
    # A method that takes no token budget (PixelPrune: every image keeps its own count, set by its content): the
    # one line that refuses --keep, --preset, --tflops and --schedule. Empty: the method takes budgets.
    budget_refusal: str = ""
    # Every count of its steps is decided by the input's content as it runs (MustDrop's thresholds): the planned
    # counts are an assumption; the models accept whatever count a step leaves (the same in every item, or every
    # sample), record it per step (`Handle.measured_steps`), and the accountant re-plans a run at those
    # (ficoco.accounting.methods.at_measured_steps). False: a step leaves the count its schedule plans (or, with an
    # ``adaptive`` setting, the count the adapters measure).
    content_counts: bool = False
    # What the model adapters capture for this method, at which layer, which rows: built from `needs` when
    # the spec is made (ficoco.methods.needs.probe_plan); the tower-side and decoder-side patches read it.
    probes: ProbePlan = field(init=False, repr=False, compare=False)

    def rule(self, settings: Mapping[str, Any] | None) -> Rule | None:
        """The named rule `settings` choose (`rules`), or None for the method's default rule; a value that names
        neither is refused in one line."""
        if not self.rules or not settings or RULE not in settings:
            return None
        value = settings[RULE]
        if value == self.hyperparameters[RULE]:
            return None
        if value not in self.rules:
            raise FicocoError(f"{self.title} rule={value!r}: give {self.hyperparameters[RULE]!r} (the default) or "
                              + ", ".join(f"{name!r} ({rule.label})" for name, rule in self.rules.items()))
        return self.rules[value]

    def check_rule_runs(self, family: str, model: str, settings: Mapping[str, Any] | None) -> Rule | None:
        """The rule `settings` choose (None: the default), refused in one line on a family it does not run on."""
        rule = self.rule(settings)
        if rule is not None and rule.families is not None and family not in rule.families:
            name = next(key for key, value in self.rules.items() if value is rule)
            raise FicocoError(f"{self.title} {RULE}={name} runs on {', '.join(rule.families)} models; {model} is a "
                              f"'{family}' model ({rule.refusal})")
        return rule

    def runs_without_schedule(self, settings: Mapping[str, Any] | None = None) -> bool:
        """Whether a run needs no --keep, --preset, --tflops or --schedule: the method has an official default
        setting, or the rule `settings` choose has a setting of its own (FiCoCo's official code's r per layer)."""
        rule = self.rule(settings)
        return self.default_setting or (rule is not None and rule.removed_per_layer is not None)

    def position_scheme(self, settings: Mapping[str, Any] | None) -> str:
        """The position scheme a run under `settings` follows: its rule's, else the method's."""
        rule = self.rule(settings)
        return rule.positions if rule is not None and rule.positions else self.positions

    @property
    def attention_reads(self) -> str:
        """What the method (its inner part's too) reads of attention: "probabilities" (whole rows or columns of a
        layer's softmax, read beside the layer's kernel), "rows" (a few rows recomputed from q and k), or "none"
        (ficoco.methods.needs.ATTENTION_READS)."""
        return attention_reads(tuple(self.needs) + (tuple(self.inner.needs) if self.inner is not None else ()))

    @property
    def per_item(self) -> bool:
        """True for methods that count patches of one tower item (they act before the LLM)."""
        return self.acts_at != "llm_layer"

    @property
    def video_slices(self) -> bool:
        """True for a method before the LLM that Qwen's adapters (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) run on a video
        with every temporal slice as one item, exactly as on an image of that slice's grid (the tower attends within
        a slice only), so that a video of t slices keeps t x the per-item count, fixed before the prefill: every
        method before the LLM but a video method's cut of the slices together (`pooled_grid`: HoliTom, FlashVID,
        which reduce videos as videos), one that takes no budget (`budget_refusal`: PixelPrune, each image its own
        count) and one whose counts its input decides (`content_counts`)."""
        return self.per_item and not self.pooled_grid and not self.budget_refusal and not self.content_counts

    def __post_init__(self) -> None:
        if self.acts_at not in ACTS_AT:
            raise ValueError(f"{self.name}: unknown acts_at {self.acts_at!r}")
        if self.placement not in PLACEMENTS:
            raise ValueError(f"{self.name}: unknown placement {self.placement!r}")
        if self.positions not in POSITION_SCHEMES:
            raise ValueError(f"{self.name}: unknown position scheme {self.positions!r}")
        for scheme in self.step_positions:
            if scheme not in POSITION_SCHEMES:
                raise ValueError(f"{self.name}: unknown position scheme {scheme!r} of a step")
        if self.planner not in PLANNER_NAMES:
            raise ValueError(f"{self.name}: unknown planner {self.planner!r}: choose from {', '.join(PLANNER_NAMES)}")
        if self.rules and (RULE not in self.hyperparameters or self.hyperparameters[RULE] in self.rules):
            raise ValueError(f"{self.name}: a method with rules has a '{RULE}' hyperparameter whose default is none "
                             f"of {', '.join(self.rules)}")
        unknown_sources = set(self.default_sources) - set(self.hyperparameters)
        if unknown_sources:
            raise ValueError(f"{self.name}: default_sources names {', '.join(sorted(unknown_sources))}, not "
                             "hyperparameters")
        for family, values in self.family_hyperparameters.items():
            unknown = set(values) - set(self.hyperparameters)
            if unknown:
                raise ValueError(f"{self.name}: family_hyperparameters of {family!r} name "
                                 f"{', '.join(sorted(unknown))}, not hyperparameters of the method")
        for name, values in self.corrections.items():
            if name not in self.hyperparameters:
                raise ValueError(f"{self.name}: correction {name!r} is not one of its hyperparameters")
            if self.hyperparameters[name] in values:
                raise ValueError(f"{self.name}: the default of {name!r} must be the official behaviour, not the "
                                 f"correction {self.hyperparameters[name]!r}")
        for need in self.needs:
            if getattr(need, "at", "") and need.at not in self.hyperparameters:
                raise ValueError(f"{self.name}: Need({need.kind!r}, {need.layer!r}, {need.rows!r}) reads the tower "
                                 f"layer setting {need.at!r}, which is not one of its hyperparameters")
        # Every need must be one a hook point of this placement reads (refused here, in one line, otherwise).
        object.__setattr__(self, "probes", probe_plan(self.name, tuple(self.needs), self.acts_at, self.placement))

    def step_positions_at(self, order: int) -> str:
        """The position scheme of the method's step `order` (0-based among its steps)."""
        return self.step_positions[order] if order < len(self.step_positions) else self.positions
    def defaults_on(self, family: str) -> dict[str, Any]:
        """The method's default hyperparameters on `family`: `hyperparameters`, with the values its official scripts
        give on that family's backbone (`family_hyperparameters`)."""
        return {**self.hyperparameters, **self.family_hyperparameters.get(family, {})}

    def load(self) -> ModuleType:
        """Import the module that holds the method's tensor functions (imports torch)."""
        return importlib.import_module(self.module)

    def entry_point(self) -> Callable[..., Any]:
        """The method's main tensor function."""
        return getattr(self.load(), self.function)

    def family_status(self, family: str) -> tuple[str, str]:
        """(one of FAMILY_STATUSES, the reason; empty for "yes") of the method on `family`."""
        if family in self.families:
            reason = self.refusals.get(family, "")
            return ("flops only", reason) if reason else ("yes", "")
        return "refused", self.refusals.get(family, NOT_WIRED)

    def check_family(self, family: str, model: str) -> None:
        """Refuse a family the method is not defined on, naming those it is and why not this one."""
        status, reason = self.family_status(family)
        if status == "refused":
            raise FicocoError(f"variant={self.name}: {self.title} is defined on {', '.join(self.families)} "
                              f"models; {model} is a '{family}' model ({reason})")

    def check_runs(self, family: str, model: str) -> None:
        """Refuse a family the models do not run the method on (`ficoco flops` may still plan it)."""
        self.check_family(family, model)
        status, reason = self.family_status(family)
        if status != "yes":
            raise FicocoError(f"variant={self.name}: {self.title} on '{family}' models ({model}) is planned and "
                              f"counted by `ficoco flops` but the models do not run it: {reason}")

    def check_wired(self, where: str) -> None:
        """Refuse running a method whose model hooks are not in place yet (the accountant plans it)."""
        if not self.wired:
            raise FicocoError(f"variant={self.name}: {self.title} is not wired into the models yet, so {where} "
                              "cannot run it; the analytic count (ficoco.flops) plans and counts it")

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name, "title": self.title, "acts_at": self.acts_at, "placement": self.placement,
            "positions": self.positions, "needs": [n.to_json() for n in self.needs],
            "attention_reads": self.attention_reads,
            "hyperparameters": dict(self.hyperparameters),
            **({"family_hyperparameters": {family: dict(values) for family, values in
                                           self.family_hyperparameters.items()}}
               if self.family_hyperparameters else {}),
            "corrections": {name: [{"value": value, "means": means} for value, means in values.items()]
                            for name, values in self.corrections.items()},
            "rules": {name: rule.label for name, rule in self.rules.items()},
            "default_sources": dict(self.default_sources),
            "families": list(self.families),
            "keep_means": self.keep_means, "cls_note": self.cls_note, "refusals": dict(self.refusals),
            "source": self.source, "summary": self.summary, "wired": self.wired,
        }
