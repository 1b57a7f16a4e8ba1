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
    """A measured sweep with fidelity on llava-tiny, through the command line: seven points, each in its
    own worker process (float32 named: "auto" would time matmuls per dtype in each)."""
    folder = tmp_path_factory.mktemp("sweep")
    code, _, err = cli(*["sweep", "--model", "llava-tiny", "--variant", "v,l", "--keep", "64,32,16", "--scope", "all",
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
