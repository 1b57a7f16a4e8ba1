"""`ficoco methods`, the method comparison on the accountant's path, --preset, and the one-line refusal
of methods the models do not run yet (real subprocesses, as a user runs them)."""

from __future__ import annotations

import dataclasses
import itertools
import json
from pathlib import Path

import pytest
from helpers import assert_one_error_line

from ficoco.errors import FicocoError
from ficoco.methods import METHODS
from ficoco.methods.base import NOT_WIRED
from ficoco.methods.registry import method_matrix
from ficoco.profiles import FAMILY_DEFAULTS

ALL = "vanilla,v,l,fastv,pdrop,sparsevlm,dart"


def test_methods_lists_every_registry_entry_with_where_it_acts(tmp_path: Path, cli):
    result = cli("methods", "--json", str(tmp_path / "m.json"), in_subprocess=True)
    assert result.code == 0, result.err
    for name, spec in METHODS.items():
        assert name in result.out and spec.title in result.out
    report = json.loads((tmp_path / "m.json").read_text())
    by_name = {m["name"]: m for m in report["methods"]}
    assert set(by_name) == set(METHODS)
    assert by_name["fastv"]["acts_at"] == "llm_layer" and by_name["fastv"]["placement"] == "layer_input"
    assert by_name["fastv"]["hyperparameters"] == {"layer": 2, "ratio": 0.5, "attention_scores": "model"}
    assert by_name["v"]["acts_at"] == "vision_layer" and by_name["v"]["wired"]
    assert by_name["pdrop"]["families"] == ["llava", "llava_next", "qwen2_vl", "video_llava", "llava_onevision",
                                            "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "internvl"]
    assert set(by_name["prumerge"]["refusals"]) == {"qwen2_vl", "qwen2_5_vl", "llava_onevision", "qwen3_vl",
                                                    "qwen3_vl_moe", "qwen3_5"}
    cells = {row["name"]: row["families"] for row in report["matrix"]}
    assert list(cells) == list(METHODS) and list(cells["v"]) == list(FAMILY_DEFAULTS)
    assert cells["pdrop"]["qwen2_vl"] == {"status": "yes", "reason": ""}
    assert cells["prumerge"]["qwen2_vl"] == {"status": "refused", "reason": METHODS["prumerge"].refusals["qwen2_vl"]}
    issue_25 = ("v", "l", "fastv", "pdrop", "sparsevlm", "dart", "tome", "visionzip", "fastervlm")
    assert all(cells[name]["qwen2_vl"]["status"] == "yes" for name in issue_25)
    assert cells["visionzip"]["qwen2_vl"]["status"] == "yes"
    # The OneVision column: HoliTom runs on its videos; PruMerge+ and HoliTom's image families say why not.
    assert cells["holitom"]["llava_onevision"] == {"status": "yes", "reason": ""}
    assert cells["prumerge"]["llava_onevision"]["reason"].startswith("not wired: PruMerge+ picks IQR outliers")
    assert all(cells["holitom"][f]["reason"].startswith("a video method") for f in ("llava", "llava_next"))
    # Qwen2.5-VL runs every method Qwen2-VL runs (HoliTom on their videos); PruMerge+ says why not, in one line.
    qwen2_vl_runs = [name for name in cells if cells[name]["qwen2_vl"]["status"] == "yes"]
    assert all(cells[name]["qwen2_5_vl"]["status"] == "yes" for name in qwen2_vl_runs) and len(qwen2_vl_runs) >= 14
    assert cells["holitom"]["qwen2_vl"] == cells["holitom"]["qwen2_5_vl"] == {"status": "yes", "reason": ""}
    for name in ("prumerge",):
        cell = cells[name]["qwen2_5_vl"]
        assert cell["status"] == "refused" and cell["reason"] == METHODS[name].refusals["qwen2_5_vl"]
        assert "the Qwen families" in cell["reason"] and "\n" not in cell["reason"]


def test_methods_matrix_prints_methods_by_families_with_each_refusals_reason(monkeypatch: pytest.MonkeyPatch, cli):
    result = cli("methods", "--matrix", in_subprocess=True, env={"COLUMNS": "1000"})
    assert result.code == 0, result.err
    lines = result.out.splitlines()
    header = next(line for line in lines if "method" in line and "qwen2_vl" in line)
    assert [f for f in FAMILY_DEFAULTS if f in header] == list(FAMILY_DEFAULTS)
    at = next(i for i, line in enumerate(lines) if "prumerge (PruMerge+)" in line)
    prumerge = lines[at]
    # A refusal's reason wraps inside its cell: the row's cells, read down its continuation lines.
    block = [prumerge] + list(itertools.takewhile(lambda line: line.startswith("│       "), lines[at + 1:]))
    columns = zip(*(line.split("│")[2:-1] for line in block), strict=False)
    cells = [" ".join(" ".join(parts).split()) for parts in columns]
    assert prumerge.count("yes") == 4 and cells[3].startswith("refused: not wired: PruMerge+'s extra token")
    assert "yes" in next(line for line in lines if "pdrop (PDrop)" in line)
    # A family no entry names yet (one more in FAMILY_DEFAULTS) is refused by every method, with the default line.
    monkeypatch.setitem(FAMILY_DEFAULTS, "new_family", {})
    cells = {row["name"]: row["families"]["new_family"] for row in method_matrix(FAMILY_DEFAULTS)}
    assert set(cells) == set(METHODS) and all(c == {"status": "refused", "reason": NOT_WIRED} for c in cells.values())
    # A family an entry plans but whose models it does not run yet: "flops only", and apply's line says why.
    planned = dataclasses.replace(METHODS["fastv"], refusals={"llava": "no hook point yet"})
    assert planned.family_status("llava") == ("flops only", "no hook point yet")
    with pytest.raises(FicocoError, match="counted by `ficoco flops` but the models do not run it: no hook"):
        planned.check_runs("llava", "llava-tiny")


def test_the_comparison_line_costs_every_method_under_one_budget(tmp_path: Path, cli):
    # FiCoCo-L cannot reach 3.3 TFLOPs layer-exact from layer 4 with the uniform shape; one-shot can.
    result = cli("flops", "--model", "llava-1.5-7b", "--variant", ALL, "--tflops", "3.3", "--shape", "oneshot",
                 "--json", str(tmp_path / "r.json"), in_subprocess=True)
    assert result.code == 0, result.err
    rows = {r["variant"]: r for r in json.loads((tmp_path / "r.json").read_text())["rows"]}
    assert list(rows) == ALL.split(",")
    for name, row in rows.items():
        if name != "vanilla":
            assert row["tflops"] <= 3.3, name
            assert row["tflops"] > 2.5, name  # the most tokens that fit, not any setting that fits
    assert rows["fastv"]["settings"]["layer"] == 2
    assert rows["sparsevlm"]["settings"]["keeps"] == [303, 110, 36]
    assert rows["pdrop"]["method_tflops"] > 0  # its recomputed k projections are counted, apart from the total
    assert "avg" in result.out  # the layer-average column


def test_preset_gives_the_literature_rows_in_visual_macs(tmp_path: Path, cli):
    result = cli("flops", "--model", "llava-1.5-7b", "--variant", "vanilla,fastv,sparsevlm,dart", "--preset",
                 "128", "--convention", "visual-macs", "--json", str(tmp_path / "r.json"), in_subprocess=True)
    assert result.code == 0, result.err
    report = json.loads((tmp_path / "r.json").read_text())
    rows = {r["variant"]: r for r in report["rows"]}
    assert report["preset"] == 128 and report["units"] == "TMACs (visual tokens)"
    assert round(rows["vanilla"]["tflops"], 2) == 3.82
    assert (rows["fastv"]["visual_tokens"], round(rows["fastv"]["layer_average_visual_tokens"], 1)) == (98, 127.9)
    sparse = rows["sparsevlm"]
    assert (sparse["visual_tokens"], round(sparse["layer_average_visual_tokens"], 1)) == (39, 145.4)
    assert (rows["dart"]["visual_tokens"], rows["dart"]["layer_average_visual_tokens"]) == (132, 159.75)
    assert [r["where"] for r in rows["sparsevlm"]["schedule"]] == ["layer_input"] * 3
    assert [r["added"] for r in rows["sparsevlm"]["schedule"]] == [9, 7, 3]


@pytest.mark.parametrize("argv", [
    ["profile", "--model", "llava-tiny", "--variant", "fastv", "--dry-run"],
    ["flops", "--verify", "--model", "llava-tiny", "--variant", "v,pdrop", "--keep", "8"],
])
def test_an_unwired_method_is_refused_in_one_line(argv, cli):
    # Every shipped method is wired now: one marked unwired stands for a method the accountant plans
    # before its model hooks exist.
    unwired = ("import dataclasses, ficoco.methods.registry as r; "
               "r.METHODS['fastv'] = dataclasses.replace(r.METHODS['fastv'], wired=False); "
               "r.METHODS['pdrop'] = dataclasses.replace(r.METHODS['pdrop'], wired=False)")
    line = assert_one_error_line(cli(*argv, prelude=unwired))
    assert "is not wired into the models yet" in line and "--variant" in line


def test_a_family_the_method_is_not_defined_on_is_named(cli):
    line = assert_one_error_line(cli("flops", "--model", "qwen2-vl-7b", "--variant", "prumerge", in_subprocess=True))
    assert "PruMerge+ is defined on llava, llava_next, video_llava" in line and "not wired" in line


def test_visual_macs_refuses_scope_all(cli):
    line = assert_one_error_line(cli("flops", "--model", "llava-1.5-7b", "--convention", "visual-macs",
                                     "--scope", "all", in_subprocess=True))
    assert "decoder only" in line


VISION = "vanilla,tome,visionzip,fastervlm,prumerge"


def test_methods_lists_the_vision_side_methods_with_their_cls_note(tmp_path: Path, cli):
    result = cli("methods", "--json", str(tmp_path / "m.json"), in_subprocess=True)
    assert result.code == 0, result.err
    by_name = {m["name"]: m for m in json.loads((tmp_path / "m.json").read_text())["methods"]}
    assert by_name["tome"]["acts_at"] == "vision_layer" and by_name["tome"]["placement"] == "in_layer"
    assert by_name["visionzip"]["placement"] == "tower_output"
    assert by_name["fastervlm"]["acts_at"] == "after_projector"
    assert "equivalent token" in by_name["visionzip"]["cls_note"]
    assert all(by_name[n]["wired"] for n in ("tome", "visionzip", "fastervlm", "prumerge"))


def test_one_budget_prints_one_table_sorted_by_cost(tmp_path: Path, cli):
    result = cli("flops", "--model", "llava-1.5-7b", "--variant", VISION, "--tflops", "3.3", "--scope", "all",
                 "--json", str(tmp_path / "r.json"), in_subprocess=True)
    assert result.code == 0, result.err
    rows = json.loads((tmp_path / "r.json").read_text())["rows"]
    order = [line.split()[0] for line in result.out.splitlines() if line.split() and line.split()[0] in VISION]
    assert order == [r["variant"] for r in sorted(rows, key=lambda r: r["tflops"])]
    assert "methods by cost" in result.out and "to LLM" in result.out and "KV cache" in result.out
    for row in rows:
        assert row["tflops"] <= 3.3 or row["variant"] == "vanilla"
    assert "prumerge: adaptive" not in result.out  # a budget plans a fixed count


def test_report_renders_a_flops_comparison_as_markdown_and_csv(tmp_path: Path, cli):
    path = tmp_path / "r.json"
    result = cli("flops", "--model", "qwen2-vl-7b", "--variant", "vanilla,visionzip,fastervlm,l", "--preset",
                 "64", "--json", str(path), in_subprocess=True)
    assert result.code == 0, result.err
    markdown = cli("report", str(path), "--format", "markdown", in_subprocess=True)
    assert markdown.code == 0, markdown.err
    lines = markdown.out.splitlines()
    table = [line for line in lines if line.startswith("| ") and not line.startswith("| method")]
    costs = [float(line.split("|")[-4]) for line in table]  # the total column
    assert costs == sorted(costs) and len(table) == 4
    assert "visionzip: scored by the equivalent token (no [CLS])" in markdown.out
    csv_text = cli("report", str(path), "--format", "csv", in_subprocess=True).out
    assert csv_text.splitlines()[0].startswith("model,variant,quant,visual_tokens,layer_average_visual_tokens")
    assert len(csv_text.splitlines()) == 5


def test_prumerge_default_is_adaptive_and_says_so(cli):
    result = cli("flops", "--model", "llava-1.5-7b", "--variant", "vanilla,prumerge", in_subprocess=True)
    assert result.code == 0, result.err
    assert "prumerge: adaptive count, planned at 144 tokens per item" in " ".join(result.out.split())


@pytest.mark.parametrize("argv", [
    ["flops", "--verify", "--model", "qwen2-vl-tiny", "--variant", "prumerge", "--keep", "8"],
])
def test_vision_methods_on_families_not_wired_yet_are_refused_in_one_line(argv, cli):
    line = assert_one_error_line(cli(*argv, in_subprocess=True))
    assert "not wired: " in line and "is defined on llava, llava_next, video_llava" in line


@pytest.mark.parametrize(("argv", "words"), [
    (["flops", "--model", "qwen2-vl-7b", "--variant", "prumerge"], "PruMerge+ is defined on llava"),
    (["flops", "--model", "llava-1.5-7b", "--variant", "visionzip", "--schedule", "3:10"], "cuts once"),
    (["flops", "--model", "llava-1.5-7b", "--variant", "tome", "--schedule", "0:400"], "at most half"),
    (["flops", "--model", "llava-next-7b", "--image-size", "700x500", "--variant", "fastervlm"], "unpadding"),
])
def test_vision_method_mistakes_end_in_one_line(argv, words, cli):
    assert words in assert_one_error_line(cli(*argv, in_subprocess=True))


def test_measured_rows_add_latency_speedup_and_agreement_columns():
    import io

    from rich.console import Console

    from ficoco_cli.render import compares_methods, method_comparison_markdown, method_comparison_table

    def row(variant: str, tflops: float, median: float, agreement: float | None) -> dict:
        measured = {"status": "ok", "latency": {"median_ms": median}, "kv_cache_bytes": 1e6,
                    "speedup_vs_vanilla": 1000.0 / median}
        if agreement is not None:
            measured["fidelity"] = {"top1_agreement": agreement}
        return {"variant": variant, "quant": "fp16", "batch": 1, **measured,
                "analytic": {"visual_tokens": 8, "layer_average_visual_tokens": 8.0, "tflops": tflops,
                             "tflops_by_stage": {"vision": 0.1, "projector": 0.01, "llm": tflops, "lm_head": 0.0},
                             "kv_cache_bytes": 1e6}}

    report = {"schema": "ficoco.report/1", "config": {"model": "llava-tiny"},
              "rows": [row("vanilla", 3.0, 1000.0, None), row("v", 1.0, 400.0, 0.9), row("l", 2.0, 700.0, 0.95)]}
    assert compares_methods(report)
    console = Console(width=200, file=io.StringIO())
    console.print(method_comparison_table(report))
    text = console.file.getvalue()
    assert "median" in text and "speedup" in text and "agree" in text
    assert [line.split()[0] for line in text.splitlines() if line.split()[:1] in (["v"], ["l"], ["vanilla"])] == [
        "v", "l", "vanilla"]
    assert "| v | 8 | 8.0 |" in method_comparison_markdown(report) and "2.50x" in text and "90.0" in text


def test_a_sweep_of_every_method_leaves_out_refused_and_unreachable_points_with_their_reason():
    from ficoco.sweep import SweepConfig, new_report, plan_points, sweep_profile

    config = SweepConfig(model="qwen2-vl-tiny", variants=tuple(METHODS), keep=(12,), text_tokens=12)
    profile = sweep_profile(config)
    skipped: list[dict] = []
    points = plan_points(config, profile, skipped)
    reasons = {entry["variant"]: entry["reason"] for entry in skipped}
    assert reasons["prumerge"] == f"refused on qwen2_vl: {METHODS['prumerge'].refusals['qwen2_vl']}"
    assert "v1.5 schedules exist" in reasons["sparsevlm"]  # a budget one method cannot reach
    assert {p.variant for p in points} == {"vanilla", *METHODS} - set(reasons)
    assert new_report(config, profile, points, skipped)["skipped"] == skipped


@pytest.mark.parametrize("page", ["README.md", "docs/methods/index.md"])
def test_readme_matrix_is_the_registrys(page: str) -> None:
    """The method x family table of the README and of the methods' documentation page is what
    `ficoco methods --matrix --markdown` prints today: a method or family added, wired or refused shows
    up there (regenerate it with that command)."""
    from ficoco_cli.render import matrix_markdown

    readme = (Path(__file__).resolve().parents[1] / page).read_text()
    start, end = "<!-- methods --matrix --markdown: start -->\n", "\n<!-- methods --matrix --markdown: end -->"
    assert start in readme and end in readme, f"{page} lacks the matrix markers"
    table = readme[readme.index(start) + len(start):readme.index(end)]
    assert table.strip() == matrix_markdown(method_matrix(FAMILY_DEFAULTS)).strip()
    assert table.count("\n| ") == len(METHODS) + 1  # a row per method below the header and its rule


# ---- issue 35: the official code by default, ficoco's corrections by name --------------------------------------

def test_methods_lists_the_official_defaults_beside_the_named_corrections(tmp_path: Path, cli):
    result = cli("methods", "--json", str(tmp_path / "m.json"))
    assert result.code == 0, result.err
    by_name = {m["name"]: m for m in json.loads((tmp_path / "m.json").read_text())["methods"]}
    assert by_name["visionzip"]["hyperparameters"]["contextual_mode"] == "official"
    assert by_name["visionzip"]["corrections"] == {
        "contextual_mode": [{"value": "mean", "means": "mean contextual token"}],
        "include_cls": [{"value": False, "means": "[CLS] dropped"}],
        "attention_scores": [{"value": "float32", "means": "float32 attention scores"}]}
    assert by_name["tome"]["corrections"] == {"order": [{"value": "spatial", "means": "spatial order"}]}
    # Every method that reads attention probabilities reads them by the model's rule; float32 is a correction.
    assert by_name["fastv"]["corrections"] == {
        "attention_scores": [{"value": "float32", "means": "float32 attention scores"}]}
    assert by_name["dart"]["corrections"] == {}
    text = " ".join(result.out.split())
    assert "spatial = spatial order" in text and "--hp NAME=VALUE" in text


def test_flops_hp_turns_a_correction_on_and_every_table_and_row_names_it(tmp_path: Path, cli):
    out = tmp_path / "r.json"
    result = cli("flops", "--model", "llava-1.5-7b", "--variant", "vanilla,visionzip,tome,prumerge", "--preset", "64",
                 "--hp", "contextual_mode=mean", "--hp", "order=spatial", "--json", str(out))
    assert result.code == 0, result.err
    rows = {r["variant"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["visionzip"]["method_label"] == "VisionZip (ficoco: mean contextual token)"
    assert rows["tome"]["method_label"] == "ToMe (ficoco: spatial order)"
    assert rows["prumerge"]["method_label"] == "PruMerge+ (ficoco: spatial order)"
    assert rows["vanilla"]["method_label"] == "vanilla"
    assert rows["visionzip"]["settings"]["contextual_mode"] == "mean"
    assert "visionzip (ficoco: mean contextual token)" in result.out and "tome (ficoco: spatial order)" in result.out
    # Without --hp: the official methods, named plainly, at the same cost (a correction moves no figure here).
    plain = cli("flops", "--model", "llava-1.5-7b", "--variant", "vanilla,visionzip,tome", "--preset", "64",
                "--json", str(tmp_path / "plain.json"))
    assert plain.code == 0 and "ficoco:" not in plain.out
    official = {r["variant"]: r for r in json.loads((tmp_path / "plain.json").read_text())["rows"]}
    assert official["visionzip"]["method_label"] == "VisionZip" and official["tome"]["method_label"] == "ToMe"
    for name in ("visionzip", "tome"):
        assert official[name]["tflops"] == rows[name]["tflops"]
        assert official[name]["tflops_by_stage"] == rows[name]["tflops_by_stage"]


def test_a_correction_goes_with_a_budget_and_a_schedule_and_a_wrong_value_is_refused(cli):
    budget = cli("flops", "--model", "llava-1.5-7b", "--variant", "tome", "--tflops", "3", "--hp", "order=spatial")
    assert budget.code == 0 and "tome (ficoco: spatial order)" in budget.out, budget.err
    schedule = cli("flops", "--model", "llava-1.5-7b", "--variant", "tome", "--schedule", "1:100",
                   "--hp", "order=spatial")
    assert schedule.code == 0 and "tome (ficoco: spatial order)" in schedule.out, schedule.err
    line = assert_one_error_line(cli("flops", "--model", "llava-1.5-7b", "--variant", "visionzip",
                                     "--hp", "contextual_mode=median"))
    assert "contextual_mode='median'" in line and "'mean' (ficoco: mean contextual token)" in line
    line = assert_one_error_line(cli("flops", "--model", "llava-1.5-7b", "--variant", "fastv", "--hp", "order=spatial"))
    assert "order" in line and "none of fastv's" in line
    line = assert_one_error_line(cli("flops", "--model", "llava-1.5-7b", "--variant", "visionzip",
                                     "--hp", "include_cls=maybe"))
    assert "include_cls is a switch" in line


# ---- issue 53: FiCoCo's defaults are its paper's, each labelled by its source; its official code's rule by name ----

def test_methods_labels_every_ficoco_default_by_its_source_and_names_the_official_rule(tmp_path: Path, cli):
    result = cli("methods", "--json", str(tmp_path / "m.json"))
    assert result.code == 0, result.err
    by_name = {m["name"]: m for m in json.loads((tmp_path / "m.json").read_text())["methods"]}
    for name in ("v", "l"):
        assert set(by_name[name]["default_sources"]) == set(by_name[name]["hyperparameters"])
        assert by_name[name]["hyperparameters"]["rule"] == "paper"
        assert by_name[name]["rules"] == {"official": "official code's rule"}
    # The first reducing layer is the paper's 4; the official code's is 5 (llava_llama.py: layer_idx > 4).
    assert by_name["l"]["hyperparameters"]["first_layer"] == 4
    assert by_name["l"]["default_sources"]["first_layer"] == "paper; official code: 5"
    assert by_name["fastv"]["default_sources"] == {} and by_name["fastv"]["rules"] == {}
    assert "defaults: the official code's, or where [marked] their source" in " ".join(result.out.split())
    # The table as a terminal wide enough shows each default with its source in brackets (not taken for markup).
    from rich.console import Console

    from ficoco_cli.render import methods_table

    console = Console(width=1000, record=True)
    console.print(methods_table(list(by_name.values())))
    text = " ".join(console.export_text().split())
    assert "first_layer=4 [paper; official code: 5]" in text
    assert "rule=paper [paper] (official = official code's rule)" in text


# ---- issue 53: what each method reads of attention ------------------------------------------------------------------

def test_the_methods_page_says_what_each_method_reads_of_attention_as_the_registry_does() -> None:
    """docs/methods/index.md's "reads attention" column is each entry's `attention_reads`: a method whose needs read
    whole rows or columns of a layer's softmax says `probabilities` (FiCoCo, HoliTom, FitPrune, HiPrune), one that
    recomputes a few rows says `rows` (FastV, VisionZip), one that reads no attention `none` (DART, ToMe)."""
    page = (Path(__file__).resolve().parents[1] / "docs" / "methods" / "index.md").read_text()
    said = {}
    for line in page.splitlines():
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        if len(cells) == 6 and cells[1].strip("`") in METHODS:
            said[cells[1].strip("`")] = cells[3]
    assert said == {name: spec.attention_reads for name, spec in METHODS.items()}
    assert said["v"] == said["hiprune"] == "probabilities" and said["fastv"] == "rows" and said["dart"] == "none"


def test_methods_lists_what_each_method_reads_of_attention(tmp_path: Path, cli) -> None:
    result = cli("methods", "--json", str(tmp_path / "m.json"))
    assert result.code == 0, result.err
    by_name = {m["name"]: m for m in json.loads((tmp_path / "m.json").read_text())["methods"]}
    assert by_name["fitprune"]["attention_reads"] == "probabilities"
    assert by_name["vlmpruner"]["attention_reads"] == "none" and by_name["pdrop"]["attention_reads"] == "rows"
    assert "probabilities (whole rows or columns" in " ".join(cli("methods").out.split())
