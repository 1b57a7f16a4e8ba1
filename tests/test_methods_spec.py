"""A method's spec as the rest of the package reads it: typed needs checked when the spec is made, the one
probe plan both the tower-side and the decoder-side patches read, the planner named by a word the
accountant's table knows, and defaults that are the method folder's own constants. No torch."""

from __future__ import annotations

import ast
import dataclasses
import itertools
from pathlib import Path

import pytest

from ficoco.accounting.planners import PLANNERS
from ficoco.methods import (
    METHODS,
    MethodSpec,
    Need,
    ProbePlan,
    TowerProbe,
    fastv,
    ficoco_l,
    ficoco_v,
    holitom,
    method_label,
    variant_label,
)
from ficoco.methods.base import ACTS_AT, PLACEMENTS, PLANNER_NAMES
from ficoco.methods.needs import NAMED_LAYER, NEED_KINDS, NEED_LAYERS, NEED_ROWS, probe_plan
from ficoco.methods.reads import DEFAULT_ATTENTION_SCORES

FASTV = METHODS["fastv"]
ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("field, value", [("kind", "attention_row"), ("layer", "L -1"), ("rows", "last row")])
def test_a_typo_in_a_need_is_refused_when_it_is_made(field: str, value: str) -> None:
    given = {"kind": "attention_rows", "layer": "L-1", "rows": "last", field: value}
    with pytest.raises(ValueError, match=f"{field} '{value}' is not one of"):
        Need(given["kind"], given["layer"], given["rows"], "a typo")  # type: ignore[arg-type]


def test_a_need_no_hook_point_reads_is_refused_when_the_spec_is_made() -> None:
    # FastV acts at a decoder layer's input: nothing there captures a tower layer's [CLS] row.
    tower_row = Need("attention_rows", "vision L", "cls", "a tower row a decoder method cannot get")
    with pytest.raises(ValueError, match=r"fastv: Need\('attention_rows', 'vision L', 'cls'\) is read by no hook"):
        dataclasses.replace(FASTV, needs=(*FASTV.needs, tower_row))
    # Two different row sets of layer L-1 in one spec: one probe serves one set.
    with pytest.raises(ValueError, match="read by no hook point"):
        dataclasses.replace(FASTV, needs=(*FASTV.needs, Need("attention_rows", "L-1", "suffix", "a second set")))


def test_every_need_value_is_read_by_some_placement() -> None:
    """No kind, layer or rows value exists that every hook point ignores (it would mean "not probed")."""
    read = set()
    for kind, layer, rows, acts_at, placement in itertools.product(NEED_KINDS, NEED_LAYERS, NEED_ROWS, ACTS_AT,
                                                                   PLACEMENTS):
        try:
            # A "vision named" need names the setting that holds its tower layer.
            need = Need(kind, layer, rows, "", at="layer" if layer == NAMED_LAYER else "")  # type: ignore[arg-type]
            probe_plan("probe", (need,), acts_at, placement)
        except ValueError:
            continue
        read.add(("kind", kind))
        read.add(("layer", layer))
        read.add(("rows", rows))
    assert {v for f, v in read if f == "kind"} == set(NEED_KINDS)
    assert {v for f, v in read if f == "layer"} == set(NEED_LAYERS)
    assert {v for f, v in read if f == "rows"} == set(NEED_ROWS)


def test_the_probe_plans_of_the_package_s_methods() -> None:
    """What the adapters capture, per method (both sides read these plans, not the needs' words)."""
    plans = {name: spec.probes for name, spec in METHODS.items()}
    assert plans["v"] == ProbePlan(step_tower_layers=TowerProbe(probabilities=True))
    assert plans["l"] == ProbePlan(layer_probabilities=True)
    assert plans["fastv"] == ProbePlan(previous_layer_rows="last")
    assert plans["pdrop"] == ProbePlan(own_query_key_row=True)
    assert plans["sparsevlm"] == ProbePlan(previous_layer_rows="suffix", input_embeddings=True)
    assert plans["dart"] == ProbePlan(previous_layer_keys=True)
    assert plans["tome"] == ProbePlan(step_tower_layers=TowerProbe())
    assert plans["visionzip"] == plans["fastervlm"] == plans["vispruner"] == \
        ProbePlan(step_tower_layers=TowerProbe(cls_query=True))
    assert plans["prumerge"] == ProbePlan(last_tower_layer=TowerProbe(cls_query=True))
    assert plans["divprune"] == ProbePlan() and not plans["divprune"].reads_tower
    assert plans["cdpruner"] == ProbePlan(input_embeddings=True)
    assert plans["holitom"] == ProbePlan(step_tower_layers=TowerProbe(probabilities=True))
    assert METHODS["holitom"].inner is not None and METHODS["holitom"].inner.probes == plans["fastv"]


def test_the_patches_read_the_probe_plan_not_the_needs_words() -> None:
    for path in ("ficoco/models/llm_steps.py", "ficoco/models/vision_steps.py"):
        attributes = {node.attr for node in ast.walk(ast.parse((ROOT / path).read_text()))
                      if isinstance(node, ast.Attribute)}
        assert "probes" in attributes and "needs" not in attributes, path
    # No adapter reads the needs' words either (Qwen2-VL's cuts read the same plan).
    for path in sorted((ROOT / "ficoco" / "models").rglob("*.py")):
        attributes = {node.attr for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.Attribute)}
        assert "needs" not in attributes, path


def test_planners_are_named_by_a_word_the_accountant_s_table_knows() -> None:
    assert set(PLANNERS) == set(PLANNER_NAMES)
    assert all(spec.planner in PLANNERS for spec in METHODS.values())
    assert METHODS["v"].planner == METHODS["l"].planner == "per_layer" and FASTV.planner == "by_steps"
    with pytest.raises(ValueError, match="unknown planner 'ficoco.accounting.schedule:plan_per_layer'"):
        dataclasses.replace(FASTV, planner="ficoco.accounting.schedule:plan_per_layer")  # type: ignore[arg-type]


def test_a_spec_names_its_own_ops_module() -> None:
    for spec in (*METHODS.values(), METHODS["holitom"].inner):
        assert isinstance(spec, MethodSpec)
        folder = spec.module.removesuffix(".ops")
        assert spec.module == folder + ".ops" and folder.startswith("ficoco.methods."), spec.name


def test_defaults_are_the_method_folders_constants() -> None:
    assert dict(METHODS["v"].hyperparameters) == {
        "lam": ficoco_v.LAM, "eps": ficoco_v.EPS, "window": ficoco_v.WINDOW, "coefficient": ficoco_v.COEFFICIENT,
        "first_layer": ficoco_v.FIRST_LAYER, "equivalent_token": ficoco_v.EQUIVALENT_TOKEN,
        "attention_scores": DEFAULT_ATTENTION_SCORES, "rule": ficoco_v.PAPER_RULE}
    assert dict(METHODS["l"].hyperparameters) == {"beta": ficoco_l.BETA, "gamma": ficoco_l.GAMMA,
                                                  "eps": ficoco_l.EPS, "first_layer": ficoco_l.FIRST_LAYER,
                                                  "attention_scores": DEFAULT_ATTENTION_SCORES,
                                                  "rule": ficoco_l.PAPER_RULE}
    assert dict(FASTV.hyperparameters) == {"layer": fastv.LAYER, "ratio": fastv.RATIO,
                                           "attention_scores": DEFAULT_ATTENTION_SCORES}
    assert METHODS["holitom"].hyperparameters["merge_layer"] == holitom.MERGE_LAYER


# ---- the official code's behaviour is the default; ficoco's corrections are named settings (issue 35) ------------

# Every method that reads attention probabilities reads them by the model's eager rule; float32 scores are
# ficoco's named correction (ficoco.methods.reads, issue 41).
OFFICIAL = {"visionzip": {"contextual_mode": "official", "include_cls": True, "attention_scores": "model"},
            "tome": {"order": "official"},
            "prumerge": {"attention": "official", "order": "official", "attention_scores": "model"},
            "fastv": {"attention_scores": "model"}, "pdrop": {"attention_scores": "model"},
            "sparsevlm": {"attention_scores": "model"}, "fastervlm": {"attention_scores": "model"},
            "vispruner": {"attention_scores": "model"}, "holitom": {"attention_scores": "model"}}
CORRECTED = {"visionzip": {"contextual_mode": "mean", "include_cls": False, "attention_scores": "float32"},
             "tome": {"order": "spatial"},
             "prumerge": {"attention": "heads", "order": "spatial", "attention_scores": "float32"},
             "fastv": {"attention_scores": "float32"}, "pdrop": {"attention_scores": "float32"},
             "sparsevlm": {"attention_scores": "float32"}, "fastervlm": {"attention_scores": "float32"},
             "vispruner": {"attention_scores": "float32"}, "holitom": {"attention_scores": "float32"}}


@pytest.mark.parametrize("name", sorted(OFFICIAL))
def test_a_methods_defaults_are_the_official_code_and_its_corrections_named_values(name: str) -> None:
    spec = METHODS[name]
    assert {k: spec.hyperparameters[k] for k in OFFICIAL[name]} == OFFICIAL[name]
    assert {k: next(iter(v)) for k, v in spec.corrections.items()} == CORRECTED[name]
    # The planned settings (what a report's row holds and the models read) carry them, official by default.
    from ficoco import accounting as acc
    from ficoco.profiles import load_profile

    arch = acc.architecture(load_profile("video-llava-7b" if name == "holitom" else "llava-1.5-7b"))
    planned = {**spec.hyperparameters, **acc.method_schedule(arch, name).settings_dict()}  # what the models read
    assert {k: planned[k] for k in OFFICIAL[name]} == OFFICIAL[name]
    corrected = acc.method_schedule(arch, name, 64, **CORRECTED[name]).settings_dict()
    assert {k: corrected[k] for k in CORRECTED[name]} == CORRECTED[name]


def test_a_correction_is_never_a_default_and_names_a_hyperparameter() -> None:
    spec = METHODS["tome"]
    with pytest.raises(ValueError, match="must be the official behaviour"):
        dataclasses.replace(spec, hyperparameters={**spec.hyperparameters, "order": "spatial"})
    with pytest.raises(ValueError, match="is not one of its hyperparameters"):
        dataclasses.replace(spec, corrections={"sorting": {"spatial": "spatial order"}})


def test_method_label_names_the_official_method_and_every_correction_apart() -> None:
    assert method_label("visionzip", {"dominant": 54, "contextual": 10, "contextual_mode": "official",
                                      "include_cls": True}) == "VisionZip"
    assert method_label("visionzip", {"contextual_mode": "mean"}) == "VisionZip (ficoco: mean contextual token)"
    assert method_label("visionzip", {"include_cls": False}) == "VisionZip (ficoco: [CLS] dropped)"
    assert method_label("visionzip", CORRECTED["visionzip"]) == \
        "VisionZip (ficoco: mean contextual token, [CLS] dropped, float32 attention scores)"
    assert method_label("fastv", {"attention_scores": "float32"}) == "FastV (ficoco: float32 attention scores)"
    assert method_label("v", {"attention_scores": "model"}) == "FiCoCo-V"
    assert method_label("tome", {"rates": [16] * 23, "order": "official"}) == "ToMe"
    assert method_label("tome", {"order": "spatial"}) == "ToMe (ficoco: spatial order)"
    assert method_label("prumerge", {"attention": "heads"}) == "PruMerge+ (ficoco: attention over heads)"
    assert method_label("prumerge", CORRECTED["prumerge"]) == \
        "PruMerge+ (ficoco: attention over heads, spatial order, float32 attention scores)"
    # Settings unknown or not naming a correction: the official default; vanilla and unknown names as they are.
    assert method_label("tome", None) == method_label("tome", {}) == method_label("tome", {"schedule": "1:6"}) == "ToMe"
    assert method_label("vanilla", None) == "vanilla" and method_label("fastv", {"layer": 2}) == "FastV"
    assert method_label("not-a-method", {"order": "spatial"}) == "not-a-method"
    # A JSON report's 0/1 is not a bool: only the declared value names a correction.
    assert method_label("visionzip", {"include_cls": 0}) == "VisionZip"
    assert variant_label("tome", {"order": "spatial"}) == "tome (ficoco: spatial order)"
    assert variant_label("tome", {"order": "official"}) == "tome"
    labels = {method_label(name, settings) for name in OFFICIAL for settings in (OFFICIAL[name], CORRECTED[name])}
    assert len(labels) == 2 * len(OFFICIAL)


def test_a_plugin_declares_its_corrections_and_is_labelled_by_them() -> None:
    from ficoco.methods import registered

    toy = dataclasses.replace(METHODS["fastervlm"], name="toy", title="Toy",
                              hyperparameters={"ratio": 0.25, "norm": "official"},
                              corrections={"norm": {"l2": "L2 norm", "none": "no norm"}})
    with registered(toy):
        assert method_label("toy", {"norm": "official"}) == "Toy"
        assert method_label("toy", {"norm": "none"}) == "Toy (ficoco: no norm)"
        assert toy.to_json()["corrections"] == {"norm": [{"value": "l2", "means": "L2 norm"},
                                                         {"value": "none", "means": "no norm"}]}
