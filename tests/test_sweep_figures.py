"""Sweep figures (issue 16): drawn headless, valid PNG/SVG of the stated size, and what they plot
is the report's data, read back from the figure objects."""

from __future__ import annotations

import copy
import json
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import pytest

from ficoco.sweep import SweepConfig, new_report, plan_points, sweep_profile
from ficoco.sweep.figures import (
    DPI,
    FIGURE_SIZE_IN,
    cost_figure,
    fidelity_figure,
    latency_figure,
    save_figure,
    sweep_figures,
)


def lines_by_gid(axes) -> dict[str, tuple[list[float], list[float]]]:
    return {line.get_gid(): (list(line.get_xdata()), list(line.get_ydata())) for line in axes.get_lines()
            if line.get_gid()}


@pytest.fixture(scope="module")
def analytic_report() -> dict:
    config = SweepConfig(model="llava-1.5-7b", variants=("vanilla", "v", "l"), keep=(576, 384, 192, 128, 64),
                         scope="all")
    profile = sweep_profile(config)
    return new_report(config, profile, plan_points(config, profile))


@pytest.fixture(scope="module")
def measured(cli, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    """A measured sweep with fidelity on llava-tiny, through the command line: five points, each in its
    own worker process (float32 named: "auto" would time matmuls per dtype in each)."""
    folder = tmp_path_factory.mktemp("sweep")
    code, _, err = cli(*["sweep", "--model", "llava-tiny", "--variant", "v,l", "--keep", "64,16", "--scope", "all",
                        "--measure", "--fidelity", "--samples", "2", "--warmup", "0", "--repeat", "1",
                        "--device", "cpu", "--dtype", "fp32", "--json", str(folder / "sweep.json"),
                        "--plot", str(folder / "figures"),
                        "--out", str(folder / "store"), "--workers", "2"])
    assert code == 0, err
    return json.loads((folder / "sweep.json").read_text()), folder


def test_figures_are_drawn_on_headless_agg_canvases(analytic_report: dict) -> None:
    figure = cost_figure(analytic_report)
    assert type(figure.canvas).__name__ == "FigureCanvasAgg"


def test_figures_leave_no_figure_open_in_pyplot(analytic_report: dict, tmp_path: Path) -> None:
    """Drawing and saving many figures opens none in pyplot's registry (it warned past 20 open figures)."""
    import matplotlib.pyplot as plt

    before = plt.get_fignums()
    for _ in range(25):
        for name, figure in sweep_figures(analytic_report).items():
            save_figure(figure, tmp_path, name, formats=("png",))
    assert plt.get_fignums() == before


def test_cost_figure_plots_the_accountants_stage_counts_against_visual_tokens(analytic_report: dict) -> None:
    figure = cost_figure(analytic_report)
    axes = [ax for ax in figure.axes if ax.get_title() and ax.get_visible()]
    assert [ax.get_title() for ax in axes] == ["v", "l"]
    vanilla = next(p for p in analytic_report["points"] if p["variant"] == "vanilla")
    for ax in axes:
        points = sorted((p for p in analytic_report["points"] if p["variant"] == ax.get_title()),
                        key=lambda p: p["analytic"]["layer_average_visual_tokens"])
        lines = lines_by_gid(ax)
        tokens = [p["analytic"]["layer_average_visual_tokens"] for p in points]
        assert lines["total"] == (tokens, [p["analytic"]["tflops"] for p in points])
        for stage in ("vision", "projector", "llm", "lm_head"):
            assert lines[f"stage:{stage}"] == (tokens, [p["analytic"]["tflops_by_stage"][stage] for p in points])
        assert lines["vanilla"][1] == [vanilla["analytic"]["tflops"]] * 2
    # V saves in the vision tower too, L does not: the plotted vision stage says so.
    v_vision = lines_by_gid(axes[0])["stage:vision"][1]
    l_vision = lines_by_gid(axes[1])["stage:vision"][1]
    assert v_vision[0] < v_vision[-1] and len(set(l_vision)) == 1
    ylabel = figure._supylabel.get_text()
    assert "scope all" in ylabel and "flops convention" in ylabel
    assert "llava-1.5-7b" in figure._suptitle.get_text() and "analytic" in figure._suptitle.get_text()


def test_latency_figure_plots_the_measured_medians_the_ideal_line_and_the_roofline(measured: tuple) -> None:
    report, _ = measured
    figure = latency_figure(report)
    lines = lines_by_gid(figure.axes[0])
    for method in ("vanilla", "v", "l"):
        rows = sorted((p["measured"] for p in report["points"] if p["variant"] == method),
                      key=lambda r: r["analytic"]["tflops"])
        assert lines[f"measured:{method}"] == ([r["analytic"]["tflops"] for r in rows],
                                               [r["latency"]["median_ms"] for r in rows])
    vanilla = next(p["measured"] for p in report["points"] if p["variant"] == "vanilla")
    (x0, x1), (y0, y1) = lines["ideal"]
    assert (x0, y0) == (0.0, 0.0)
    assert y1 / x1 == pytest.approx(vanilla["latency"]["median_ms"] / vanilla["analytic"]["tflops"])
    assert not any(gid.startswith("roofline") for gid in lines)  # a CPU: no roofline
    title = figure._suptitle.get_text()
    assert "llava-tiny" in title and "cpu" in title
    assert report["compute_dtype"] in title and report["created"][:10] in title
    # On a known GPU the report carries the roofline per point; the figure draws it.
    gpu = copy.deepcopy(report)
    for k, point in enumerate(gpu["points"]):
        point["measured"]["analytic"]["roofline_ms"] = 0.5 + k
    roofline = lines_by_gid(latency_figure(gpu).axes[0])["roofline:v"]
    rows = sorted((p["measured"] for p in gpu["points"] if p["variant"] == "v"), key=lambda r: r["analytic"]["tflops"])
    assert roofline == ([r["analytic"]["tflops"] for r in rows], [r["analytic"]["roofline_ms"] for r in rows])


def test_fidelity_figure_plots_agreement_and_kl_against_tflops(measured: tuple) -> None:
    report, _ = measured
    figure = fidelity_figure(report)
    agreement, kl = (lines_by_gid(ax) for ax in figure.axes[:2])
    for method in ("v", "l"):
        points = sorted((p for p in report["points"] if p["variant"] == method), key=lambda p: p["analytic"]["tflops"])
        x = [p["analytic"]["tflops"] for p in points]
        assert agreement[f"agreement:{method}"] == (x, [p["fidelity"]["top1_agreement"] for p in points])
        assert kl[f"kl:{method}"] == (x, [p["fidelity"]["kl_divergence"] for p in points])
    vanilla = next(p for p in report["points"] if p["variant"] == "vanilla")
    assert vanilla["fidelity"]["kl_divergence"] == 0 and vanilla["fidelity"]["top1_agreement"] == 1
    # Keeping every token (keep 64 of 64) is vanilla's forward: the same distribution.
    full = [p for p in report["points"] if p["budget"] == {"keep": 64}]
    assert all(p["fidelity"]["kl_divergence"] == pytest.approx(0, abs=1e-9) for p in full)
    assert "random weights" in figure._suptitle.get_text()


def test_sweep_writes_png_and_svg_of_the_stated_size(measured: tuple) -> None:
    from PIL import Image

    _, folder = measured
    width_px, height_px = (round(side * DPI) for side in FIGURE_SIZE_IN)
    for name in ("cost", "latency", "fidelity"):
        with Image.open(folder / "figures" / f"{name}.png") as png:
            png.verify()
            assert png.format == "PNG" and png.size == (width_px, height_px)
        root = ElementTree.parse(folder / "figures" / f"{name}.svg").getroot()
        assert root.tag.endswith("svg")
        stated = (f"{FIGURE_SIZE_IN[0] * 72:g}pt", f"{FIGURE_SIZE_IN[1] * 72:g}pt")
        assert (root.get("width"), root.get("height")) == stated


def test_report_plot_draws_the_same_figures_from_the_saved_report(cli, measured: tuple, tmp_path: Path) -> None:
    report, folder = measured
    code, _, err = cli(*["report", str(folder / "sweep.json"), "--plot", str(tmp_path)])
    assert code == 0, err
    for name in ("cost", "latency", "fidelity"):
        assert (tmp_path / f"{name}.png").read_bytes() == (folder / "figures" / f"{name}.png").read_bytes()
    assert set(sweep_figures(report)) == {"cost", "latency", "fidelity"}


def test_report_plot_draws_a_profile_reports_rows(cli, tmp_path: Path) -> None:
    reference = Path(__file__).resolve().parent.parent / "reports" / "llava-tiny-cpu.json"
    code, _, err = cli(*["report", str(reference), "--plot", str(tmp_path)])
    assert code == 0, err
    assert (tmp_path / "latency.png").is_file() and (tmp_path / "cost.svg").is_file()


def test_sweep_refuses_mistakes_in_one_line(cli, tmp_path: Path) -> None:
    cases = [
        (["sweep", "--model", "llava-tiny"], "--keep"),
        (["sweep", "--model", "llava-tiny", "--keep", "8", "--tflops", "1"], "--tflops"),
        (["sweep", "--model", "llava-tiny", "--keep", "8,0"], "--keep"),
        (["sweep", "--model", "llava-tiny", "--tflops", "1,nan"], "--tflops"),
        (["sweep", "--model", "llava-tiny", "--keep", "8", "--repeat", "2"], "--measure"),
        (["sweep", "--model", "llava-tiny", "--keep", "8", "--plot", str(tmp_path / "a" / "b")], "--plot"),
        (["sweep", "--model", "llava-tiny", "--variant", "v", "--keep", "9999"], "9999"),
    ]
    for argv, named in cases:
        code, _, err = cli(*argv)
        lines = [x for x in err.splitlines() if x.strip()]
        assert code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and named in lines[0], (argv, err)


# ---- the accuracy figure of an evaluated sweep (synthetic reports: tests/eval_reports.py) --------------------------

def test_accuracy_figure_draws_a_line_per_method_and_vanilla_as_the_reference(tmp_path: Path) -> None:
    from eval_reports import standard_report

    from ficoco.eval.join import eval_rows
    from ficoco.sweep.figures import accuracy_figure

    report = standard_report(random_weights=True)
    figure = accuracy_figure(report)
    assert type(figure.canvas).__name__ == "FigureCanvasAgg"
    (ax,) = figure.axes
    lines = lines_by_gid(ax)
    # One line per method with an evaluated point (FiCoCo-L's points failed or did not run): VisionZip's.
    assert sorted(gid for gid in lines if gid.startswith("score:")) == ["score:VisionZip"]
    rows = [r for r in eval_rows(report) if r["method_label"] == "VisionZip"]
    ordered = sorted(rows, key=lambda r: r["tflops_mean"])
    assert lines["score:VisionZip"] == ([r["tflops_mean"] for r in ordered], [r["score"] for r in ordered])
    assert lines["vanilla:point"] == ([8.0], [pytest.approx(30.4)])
    assert lines["vanilla"][1] == [pytest.approx(30.4)] * 2  # the horizontal reference
    assert "TFLOPs per sample" in ax.get_xlabel() and "flops convention, scope all" in ax.get_xlabel()
    assert "score" in ax.get_ylabel() and "2 task(s)" in ax.get_ylabel()
    title = figure._suptitle.get_text()
    assert "task_a, task_b" in title and "llava-tiny" in title and "RANDOM WEIGHTS" in title
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["VisionZip", "Vanilla (576 visual tokens)"]
    save_figure(figure, tmp_path, "accuracy", formats=("png",))
    assert (tmp_path / "accuracy.png").stat().st_size > 0


def test_accuracy_figure_relative_draws_the_retention_in_percent() -> None:
    from eval_reports import answers, eval_block, evaluated_report, point, standard_points

    from ficoco.sweep.figures import accuracy_figure

    points = standard_points()[:3] + [
        point("l", {"keep": 64}, eval_block("FiCoCo-L", {"task_a": 0.7, "task_b": 60.0}, answers(2), tflops=2.5,
                                            tokens=64)),
        point("fastv", {"keep": 64}, eval_block("FastV", {"task_a": 0.4, "task_b": 30.0}, answers(5), tflops=2.2,
                                                tokens=64))]
    figure = accuracy_figure(evaluated_report(points), relative=True)
    lines = lines_by_gid(figure.axes[0])
    assert sorted(gid for gid in lines if gid.startswith("score:")) == ["score:FastV", "score:FiCoCo-L",
                                                                         "score:VisionZip"]
    assert lines["score:FiCoCo-L"][1] == [pytest.approx(100 * (0.7 / 0.8 + 1) / 2)]
    assert lines["vanilla"][1] == [100.0, 100.0]
    assert "%" in figure.axes[0].get_ylabel() and "RANDOM" not in figure._suptitle.get_text()


def test_sweep_figures_add_the_accuracy_figure_when_the_sweep_was_evaluated() -> None:
    from eval_reports import failed_block, standard_report

    report = standard_report()
    assert set(sweep_figures(report)) == {"cost", "accuracy"}
    not_evaluated = copy.deepcopy(report)
    not_evaluated["config"]["eval_tasks"] = []
    assert set(sweep_figures(not_evaluated)) == {"cost"}
    not_run = copy.deepcopy(report)
    for point in not_run["points"]:
        point["eval"] = None if point["variant"] != "l" else failed_block()
    assert set(sweep_figures(not_run)) == {"cost"}  # evaluated, but nothing to draw yet


def test_accuracy_figure_refuses_a_report_without_scores_in_one_line() -> None:
    from eval_reports import standard_report

    from ficoco.errors import FicocoError
    from ficoco.sweep.figures import accuracy_figure

    report = standard_report()
    report["config"]["eval_tasks"] = []
    with pytest.raises(FicocoError, match="not evaluated"):
        accuracy_figure(report)
    report = standard_report()
    for point in report["points"]:
        point["eval"] = None
    with pytest.raises(FicocoError, match="no evaluated point"):
        accuracy_figure(report)


def test_a_method_run_with_a_correction_of_its_official_code_is_named_so_in_the_figures() -> None:
    # Issue 35: a sweep's points carry their settings (the accountant's row); a panel whose method ran with one of
    # ficoco's corrections names it, the official method keeps its plain name.
    config = SweepConfig(model="llava-1.5-7b", variants=("vanilla", "tome", "visionzip"), keep=(192, 64),
                         scope="all")
    report = new_report(config, sweep_profile(config), plan_points(config, sweep_profile(config)))
    report = copy.deepcopy(report)
    for point in report["points"]:
        if point["variant"] == "tome":
            point["analytic"]["settings"]["order"] = "spatial"
    titles = [ax.get_title() for ax in cost_figure(report).axes if ax.get_title() and ax.get_visible()]
    assert titles == ["tome (ficoco: spatial order)", "visionzip"]
