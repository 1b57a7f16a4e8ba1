"""Figures with matplotlib (Agg canvases: headless, no display needed), from report data only.

Sweep figures (from a `ficoco.sweep/1` report, or a profile report's rows):
  cost      TFLOPs by stage against visual tokens, one panel per method;
  latency   measured prefill latency against analytic TFLOPs, with the ideal line through
            vanilla (latency proportional to FLOPs) and, on a known GPU, the roofline;
  fidelity  top-1 agreement and KL divergence with vanilla against TFLOPs;
  accuracy  an evaluated sweep's mean score (lmms-eval) against TFLOPs per sample, a line per method.
Token figures (from `ficoco show`'s data): the image with its patch grid, per reducing layer
or as a contact sheet of all of them and the end state.

Every artist that carries data has a `gid` (e.g. "total:v", "kept", "links") so that tests can
read the plotted values back from the figure objects. Nothing here imports torch, or pyplot: every
figure is a plain `Figure` on its own Agg canvas, so none stays open in pyplot's registry after
it is saved (a caller that made 20 of them saw matplotlib warn about open figures).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.collections import LineCollection, PatchCollection
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from ficoco.errors import FicocoError
from ficoco.report import shareable
from ficoco.sweep.plan import VANILLA, finite, points_of

# Every sweep figure is this size: 1000 x 600 px as PNG, 720 x 432 pt as SVG.
FIGURE_SIZE_IN = (10.0, 6.0)
DPI = 100
STAGE_COLOURS = {"vision": "tab:blue", "projector": "tab:purple", "llm": "tab:orange", "lm_head": "tab:green"}
METHOD_MARKERS = "osD^vP*X"


def _subtitle(report: dict[str, Any]) -> str:
    """Model, device, dtype and date: every figure says what made it."""
    created = str(report.get("created") or "")[:10] or "undated"
    device = report.get("device") or _profile_device(report) or "analytic"
    dtype = report.get("compute_dtype") or _profile_dtype(report) or "no dtype (analytic)"
    model = report.get("model") or _profile_model(report)
    if device == "analytic":
        return f"{model} | analytic: the accountant's counts, no model run | {created}"
    weights = "random weights" if report.get("random_weights", (report.get("config") or {}).get("weights")
                                               in (None, "random")) else "checkpoint weights"
    return f"{model} | {device} | {dtype} | {weights} | {created}"


def _profile_device(report: dict[str, Any]) -> str | None:
    env = report.get("environment") or {}
    if env.get("device_kind") == "cuda":
        return env.get("device")
    return f"cpu: {env['cpu']}" if env.get("cpu") else None


def _profile_dtype(report: dict[str, Any]) -> str | None:
    for row in report.get("rows", []):
        backend = row.get("backend") or {}
        if backend.get("compute_dtype"):
            return str(backend["compute_dtype"])
    return None


def _profile_model(report: dict[str, Any]) -> str:
    rows = report.get("rows") or [{}]
    return str(rows[0].get("model") or (report.get("config") or {}).get("model") or "model")


def _figure(size_in: tuple[float, float]) -> Figure:
    """A figure on its own Agg canvas, never registered with pyplot: nothing here opens a window or
    a figure that stays open (pyplot keeps every figure it made until closed; these are freed with
    their last reference, after saving)."""
    figure = Figure(figsize=size_in, dpi=DPI)
    FigureCanvasAgg(figure)
    return figure


def _new_figure(columns: int, rows: int = 1, *, sharey: bool = False) -> tuple[Figure, list[Any]]:
    figure = _figure(FIGURE_SIZE_IN)
    axes = figure.subplots(rows, columns, squeeze=False, sharey=sharey)
    return figure, [ax for line in axes for ax in line]


def _methods(points: list[dict[str, Any]]) -> list[str]:
    return list(dict.fromkeys(p["variant"] for p in points if p.get("variant") != VANILLA))


def _label(points: list[dict[str, Any]], method: str) -> str:
    """What a legend or a panel calls `method`: its variant, with ficoco's corrections of the official code when
    its points' settings turn one on ("visionzip (ficoco: mean contextual token)")."""
    from ficoco.methods.registry import variant_label

    settings = next((p["analytic"].get("settings") for p in points
                     if p.get("variant") == method and isinstance(p.get("analytic"), dict)), None)
    return variant_label(method, settings if isinstance(settings, dict) else None)


def _first_quant(points: list[dict[str, Any]]) -> str | None:
    return points[0].get("quant") if points else None


def _count_label(report: dict[str, Any]) -> str:
    units = report.get("units") or "TFLOPs"
    convention = report.get("convention") or "flops"
    scope = report.get("scope") or "all"
    return f"{units} ({convention} convention, scope {scope}, layer-exact)"


def cost_tokens(point: dict[str, Any]) -> float:
    """The x of a cost point: visual tokens in the LLM averaged over its layers, as papers quote
    a method's budget (for FiCoCo-V the tokens that reach the LLM; for a method that prunes inside
    the LLM the final count would hide where the cost goes); the final count for plans without one."""
    analytic = point["analytic"]
    average = analytic.get("layer_average_visual_tokens")
    return float(average) if average is not None else float(analytic["visual_tokens"])


def cost_figure(report: dict[str, Any]) -> Figure:
    """(a) TFLOPs by stage against visual tokens, one panel per method; vanilla's total as a
    dashed line in each. Counts are the accountant's, in the report's convention and scope."""
    points = points_of(report)
    quant = _first_quant(points)
    points = [p for p in points if p.get("quant") == quant]
    if report.get("schema") != "ficoco.sweep/1":  # a profile report: its rows' whole-model counts
        report = {**report, "units": "TFLOPs", "convention": "flops", "scope": "all"}
    stages = list(report.get("scope_stages") or STAGE_COLOURS)
    methods = _methods(points) or [VANILLA]
    # Up to four panels side by side; more methods wrap onto a second row, so panels stay readable.
    columns = min(len(methods), 4)
    rows = -(-len(methods) // columns)
    figure, axes = _new_figure(columns, rows, sharey=True)
    vanilla = next((p for p in points if p["variant"] == VANILLA), None)
    for ax, method in zip(axes, methods, strict=False):
        mine = sorted((p for p in points if p["variant"] == method), key=cost_tokens)
        tokens = [cost_tokens(p) for p in mine]
        for stage in stages:
            values = [p["analytic"]["tflops_by_stage"].get(stage, 0.0) for p in mine]
            if any(values):
                ax.plot(tokens, values, marker=".", color=STAGE_COLOURS.get(stage), label=stage, gid=f"stage:{stage}")
        ax.plot(tokens, [p["analytic"]["tflops"] for p in mine], marker="o", color="black", linewidth=2,
                label="total", gid="total")
        if vanilla is not None:
            ax.axhline(vanilla["analytic"]["tflops"], color="grey", linestyle="--", gid="vanilla",
                       label=f"vanilla ({vanilla['analytic']['visual_tokens']} tokens)")
        ax.set_title(_label(points, method))
        ax.grid(alpha=0.3)
        ax.set_ylim(bottom=0)
    for ax in axes[len(methods):]:
        ax.set_visible(False)
    figure.supylabel(_count_label(report), fontsize="medium")
    # The x label above the legend, both below the panels.
    figure.supxlabel("visual tokens in the LLM, average over its layers (V: the tokens that reach it)",
                     fontsize="medium", y=0.055)
    handles, labels = axes[0].get_legend_handles_labels()
    figure.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize="small",
                  bbox_to_anchor=(0.5, 0.0), frameon=False)
    figure.suptitle(f"Analytic cost by stage ({quant})\n{_subtitle(report)}", fontsize="medium")
    figure.tight_layout(rect=(0, 0.08, 1, 1))
    return figure


def _measured_ok(point: dict[str, Any]) -> bool:
    measured = point.get("measured") or {}
    return measured.get("status") == "ok" and finite((measured.get("latency") or {}).get("median_ms"))


def latency_figure(report: dict[str, Any]) -> Figure:
    """(b) Measured median prefill latency against the measured run's analytic TFLOPs (flops
    convention, whole model, LM head on the last token), per method; the ideal line is vanilla's
    latency scaled by the FLOPs ratio; the roofline where the report has it (a known GPU)."""
    points = [p for p in points_of(report) if _measured_ok(p)]
    if not points:
        raise FicocoError("the report has no measured points: run the sweep with measure=True (or a profile)")
    quants = list(dict.fromkeys(p["quant"] for p in points))
    figure, axes = _new_figure(len(quants), sharey=False)
    for ax, quant in zip(axes, quants, strict=True):
        mine = [p for p in points if p["quant"] == quant]
        vanilla = next((p for p in mine if p["variant"] == VANILLA), None)
        xmax = max(p["measured"]["analytic"]["tflops"] for p in mine)
        for k, method in enumerate([VANILLA, *_methods(mine)]):
            rows = sorted((p["measured"] for p in mine if p["variant"] == method),
                          key=lambda r: r["analytic"]["tflops"])
            if not rows:
                continue
            ax.plot([r["analytic"]["tflops"] for r in rows], [r["latency"]["median_ms"] for r in rows],
                    marker=METHOD_MARKERS[k % len(METHOD_MARKERS)], label=f"{_label(mine, method)} measured",
                    gid=f"measured:{method}", linestyle="none" if method == VANILLA else "-")
            roof = [(r["analytic"]["tflops"], r["analytic"]["roofline_ms"]) for r in rows
                    if finite(r["analytic"].get("roofline_ms"))]
            if roof:
                ax.plot(*zip(*roof, strict=True), linestyle=":", marker="x", label=f"{_label(mine, method)} roofline",
                        gid=f"roofline:{method}")
        if vanilla is not None:
            slope = vanilla["measured"]["latency"]["median_ms"] / vanilla["measured"]["analytic"]["tflops"]
            ax.plot([0.0, xmax], [0.0, slope * xmax], color="grey", linestyle="--", gid="ideal",
                    label="ideal: vanilla x FLOPs ratio")
        ax.set_xlabel("analytic TFLOPs (flops convention: 2 per MAC; whole model, LM head on last token)",
                      fontsize="small")
        ax.set_ylabel("prefill latency, median (ms)")
        ax.set_title(quant)
        ax.set_xlim(left=0)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    figure.suptitle(f"Measured prefill latency against analytic cost\n{_subtitle(report)}", fontsize="medium")
    figure.tight_layout()
    return figure


def fidelity_figure(report: dict[str, Any]) -> Figure:
    """(c) Top-1 agreement and KL divergence with vanilla's next-token distribution against the
    accountant's TFLOPs, per method."""
    points = [p for p in points_of(report) if isinstance(p.get("fidelity"), dict)
              and finite(p["fidelity"].get("kl_divergence"))]
    if not points:
        raise FicocoError("the report has no fidelity figures: run the sweep with fidelity=True")
    quant = _first_quant(points)
    points = [p for p in points if p["quant"] == quant]
    figure, (agreement_ax, kl_ax) = _new_figure(2)
    for k, method in enumerate([VANILLA, *_methods(points)]):
        mine = sorted((p for p in points if p["variant"] == method), key=lambda p: p["analytic"]["tflops"])
        if not mine:
            continue
        x = [p["analytic"]["tflops"] for p in mine]
        style = {"marker": METHOD_MARKERS[k % len(METHOD_MARKERS)], "label": _label(points, method),
                 "linestyle": "none" if method == VANILLA else "-"}
        agreement_ax.plot(x, [p["fidelity"]["top1_agreement"] for p in mine], gid=f"agreement:{method}", **style)
        kl_ax.plot(x, [p["fidelity"]["kl_divergence"] for p in mine], gid=f"kl:{method}", **style)
    samples = points[0]["fidelity"].get("samples")
    agreement_ax.set_ylabel(f"top-1 agreement with vanilla (share of {samples} prompts)")
    agreement_ax.set_ylim(-0.05, 1.05)
    kl_ax.set_ylabel("KL(vanilla || method), next token, nats")
    for ax in (agreement_ax, kl_ax):
        ax.set_xlabel(_count_label(report), fontsize="small")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    note = " (random weights: the figures describe random weights)" if report.get("random_weights") else ""
    figure.suptitle(f"Fidelity against vanilla{note}\n{_subtitle(report)}", fontsize="medium")
    figure.tight_layout()
    return figure


def _accuracy_points(report: dict[str, Any], relative: bool) -> list[dict[str, Any]]:
    """The evaluated rows (ficoco.eval.join.eval_rows) that can be drawn: evaluated, with a cost and a
    score (with `relative`, a retention against vanilla)."""
    from ficoco.eval.join import eval_rows

    key = "relative_score" if relative else "score"
    return [r for r in eval_rows(report) if r["status"] == "ok" and finite(r["tflops_mean"]) and finite(r[key])]


def accuracy_figure(report: dict[str, Any], relative: bool = False) -> Figure:
    """(d) Accuracy against cost, as the FiCoCo paper's Figure 1 draws it: each point's score (the mean
    of its tasks' scores, on lmms-eval's scale; with `relative`, the share of vanilla's score it keeps,
    in %) against its mean TFLOPs per evaluated sample (the eval's convention and scope), one line
    per method (its display label), vanilla as a star and a dashed horizontal line; a panel per quant."""
    from ficoco.eval.join import eval_cost, eval_tasks, evaluated

    if not evaluated(report):
        raise FicocoError("the report was not evaluated (its config names no eval_tasks): run the sweep with "
                          "eval tasks")
    points = _accuracy_points(report, relative)
    if not points:
        raise FicocoError("the report has no evaluated point with a score and a cost yet"
                          + (" and a vanilla to compare with" if relative else ""))
    tasks = eval_tasks(report)
    key = "relative_score" if relative else "score"
    scale = 100.0 if relative else 1.0
    quants = list(dict.fromkeys(p["quant"] for p in points))
    figure, axes = _new_figure(len(quants))
    units, convention, scope = eval_cost(report, points)
    for ax, quant in zip(axes, quants, strict=True):
        mine = [p for p in points if p["quant"] == quant]
        methods = list(dict.fromkeys(p["method_label"] for p in mine if p["variant"] != VANILLA))
        for k, label in enumerate(methods):
            line = sorted((p for p in mine if p["method_label"] == label and p["variant"] != VANILLA),
                          key=lambda p: p["tflops_mean"])
            ax.plot([p["tflops_mean"] for p in line], [p[key] * scale for p in line], label=label,
                    marker=METHOD_MARKERS[(k + 1) % len(METHOD_MARKERS)], gid=f"score:{label}")
            for p in line:  # each point's budget beside it, as the papers mark their token counts
                ax.annotate(p["budget_label"], (p["tflops_mean"], p[key] * scale), textcoords="offset points",
                            xytext=(4, 4), fontsize="x-small", color="dimgrey")
        vanilla = next((p for p in mine if p["variant"] == VANILLA), None)
        if vanilla is not None:
            tokens = vanilla["visual_tokens_mean"]
            ax.axhline(vanilla[key] * scale, color="grey", linestyle="--", linewidth=1, gid="vanilla")
            ax.plot([vanilla["tflops_mean"]], [vanilla[key] * scale], marker="*", markersize=14, color="black",
                    linestyle="none", gid="vanilla:point",
                    label=f"{vanilla['method_label']}" + (f" ({tokens:.0f} visual tokens)" if finite(tokens) else ""))
        ax.set_xlabel(f"{units} per sample, mean over the evaluated samples ({convention} convention, scope {scope})",
                      fontsize="small")
        ax.set_ylabel(f"score retained against vanilla, mean over {len(tasks)} task(s) (%)" if relative else
                      f"score, mean over {len(tasks)} task(s) (lmms-eval's scale)")
        if len(quants) > 1:
            ax.set_title(str(quant))
        ax.set_xlim(left=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small", loc="best")
    note = " (RANDOM WEIGHTS: these scores mean nothing)" if report.get("random_weights") else ""
    what = "Accuracy retained" if relative else "Accuracy"
    figure.suptitle(f"{what} against cost: {', '.join(tasks)}{note}\n{_subtitle(report)}", fontsize="medium")
    figure.tight_layout()
    return figure


def sweep_figures(report: dict[str, Any]) -> dict[str, Figure]:
    """Every figure the report has data for: cost always, latency with measurements, fidelity
    with fidelity figures, accuracy with evaluated points (a sweep with eval tasks)."""
    figures = {"cost": cost_figure(report)}
    points = points_of(report)
    if any(_measured_ok(p) for p in points):
        figures["latency"] = latency_figure(report)
    if any(isinstance(p.get("fidelity"), dict) for p in points):
        figures["fidelity"] = fidelity_figure(report)
    from ficoco.eval.join import evaluated

    if evaluated(report) and _accuracy_points(report, relative=False):
        figures["accuracy"] = accuracy_figure(report)
    return figures


def save_figure(figure: Figure, folder: str | Path, name: str, formats: tuple[str, ...] = ("png", "svg")) -> list[str]:
    """`name`.png and `name`.svg (or `formats`) in `folder`, each written through a temporary file
    and a rename. The figure is pyplot's nowhere (`_figure`): nothing to close."""
    import os
    import tempfile

    folder = Path(folder).expanduser()
    written = []
    for fmt in formats:
        target = folder / f"{name}.{fmt}"
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=folder)
        try:
            with os.fdopen(fd, "wb") as handle:
                figure.savefig(handle, format=fmt, dpi=DPI)
            shareable(tmp)
            os.replace(tmp, target)
        except BaseException as exc:
            Path(tmp).unlink(missing_ok=True)
            if isinstance(exc, OSError):
                raise FicocoError(f"cannot write {target}: {exc.strerror or exc}") from None
            raise
        written.append(str(target))
    return written


def check_plot_folder(path: str, option: str = "the figures' folder", holds: str = "the figures") -> None:
    """A folder `holds` (the figures, by default) can be written into (created if its parent exists), checked before
    any work."""
    folder = Path(path).expanduser()
    if not path.strip():
        raise FicocoError(f"{option} is empty; give a folder for {holds}")
    if folder.exists() and not folder.is_dir():
        raise FicocoError(f"{option} {path} is a file; give a folder for {holds}")
    if not folder.exists():
        if not folder.parent.is_dir():
            raise FicocoError(f"{option} {path}: folder {folder.parent} does not exist; create it first")
        try:
            folder.mkdir()
        except OSError as exc:
            raise FicocoError(f"{option} {path}: cannot create it ({exc.strerror or exc})") from None
    import tempfile

    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as exc:
        raise FicocoError(f"{option} {path}: cannot write in it ({exc.strerror or exc})") from None


# ---- tokens on the image -------------------------------------------------------------------------------------

KEPT_EDGE = "white"
GREY = (0.5, 0.5, 0.5)


def _colour(index: int) -> tuple[float, float, float, float]:
    return matplotlib.colormaps["tab20"](index % 20)


def _rect(cell: list[int], **style: Any) -> Rectangle:
    _, row, col, height, width = cell
    return Rectangle((col, row), width, height, **style)


def _centre(cell: list[int]) -> tuple[float, float]:
    _, row, col, height, width = cell
    return col + width / 2, row + height / 2


def _draw_panel(ax: Any, show: dict[str, Any], panel_index: int, state: dict[str, Any], title: str) -> None:
    """One panel (image, base view, crops or frame) in one state: greyed removed tokens, outlined
    kept ones, tokens merged at this step tinted in their target's colour and linked to it."""
    panel = show["panels"][panel_index]
    rows, cols = panel["rows"], panel["cols"]
    picture = panel.get("picture")
    if picture is not None:
        ax.imshow(picture, extent=(0, cols, rows, 0), interpolation="nearest")
    else:
        ax.add_patch(Rectangle((0, 0), cols, rows, facecolor=(0.85, 0.85, 0.8), edgecolor="none"))
    ax.set_xlim(0, cols)
    ax.set_ylim(rows, 0)
    ax.set_aspect("equal")
    ax.set_xticks([])
    ax.set_yticks([])
    thin = [[(c, 0), (c, rows)] for c in range(cols + 1)] + [[(0, r), (cols, r)] for r in range(rows + 1)]
    ax.add_collection(LineCollection(thin, colors="white", linewidths=0.3, alpha=0.5))
    for step, gid in ((panel.get("group") or 1, "groups"), (panel.get("crop_side") or 0, "crops")):
        if step and step > 1:
            thick = [[(c, 0), (c, rows)] for c in range(0, cols + 1, step)] + \
                    [[(0, r), (cols, r)] for r in range(0, rows + 1, step)]
            ax.add_collection(LineCollection(thick, colors="white" if gid == "groups" else "yellow",
                                             linewidths=0.9 if gid == "groups" else 2.0, gid=gid))

    def mine(cells: list[Any]) -> list[Any]:
        return [c for c in cells if c is not None and c[0] == panel_index]

    colours = {tuple(c): _colour(k) for k, c in enumerate(state["kept"])}
    before = mine(state["removed_before"])
    if before:
        ax.add_collection(PatchCollection([_rect(c) for c in before], facecolor=GREY, alpha=0.8, edgecolor="none",
                                          gid="removed_before"))
    now = [(c, t) for c, t in zip(state["discarded"], state["merged_into"] or [None] * len(state["discarded"]),
                                  strict=True) if c is not None and c[0] == panel_index]
    if now:
        faces = [(*colours[tuple(t)][:3], 1.0) if t is not None and tuple(t) in colours else GREY for _, t in now]
        ax.add_collection(PatchCollection([_rect(c) for c, _ in now], facecolor=GREY, alpha=0.75, edgecolor="none",
                                          gid="discarded"))
        ax.add_collection(PatchCollection([_rect(c) for c, _ in now], facecolor=faces, alpha=0.45,
                                          edgecolor="none", gid="merged_tint"))
        links = [(_centre(c), _centre(t)) for c, t in now if t is not None and t[0] == panel_index]
        if links:
            link_colours = [colours.get(tuple(t), GREY) for c, t in now if t is not None and t[0] == panel_index]
            ax.add_collection(LineCollection(links, colors=link_colours, linewidths=0.9, gid="links"))
    kept = mine(state["kept"])
    if kept:
        received = {tuple(t) for _, t in now if t is not None}
        edges = [colours[tuple(c)] if tuple(c) in received else KEPT_EDGE for c in kept]
        ax.add_collection(PatchCollection([_rect(c) for c in kept], facecolor="none", edgecolor=edges,
                                          linewidths=1.0, gid="kept"))
    ax.set_title(title, fontsize="small")


def token_figure(show: dict[str, Any], layer: int | None = None) -> Figure:
    """The image with its patch grid and the tokens of `show` (ficoco show's data): one reducing
    layer (`layer`), or a contact sheet of every reducing layer and the end state (each panel
    of a row is one image part: the image, LLaVA-NeXT's base view and crops, a video frame)."""
    steps = show["steps"]
    if layer is not None:
        chosen = [s for s in steps if s["layer"] == layer]
        if not chosen:
            layers = ", ".join(str(s["layer"]) for s in steps) or "none"
            raise FicocoError(f"layer={layer} does not reduce in this schedule; reducing layers: {layers}")
        rows = chosen
    else:
        rows = [*steps, show["end"]]
    panels = len(show["panels"])
    # One image part: the states side by side, four to a row; several parts: a row per state.
    per_row = min(4, len(rows)) if panels == 1 else panels
    grid_rows = -(-len(rows) // per_row) if panels == 1 else len(rows)
    figure = _figure((max(3.0 * per_row, 7.0), 3.0 * grid_rows + 1.0))
    grid = figure.subplots(grid_rows, per_row, squeeze=False)
    axes = [ax for line in grid for ax in line]
    for r, state in enumerate(rows):
        for p in range(panels):
            ax = axes[r * panels + p]
            label = state.get("label") or f"{state['stage']} layer {state['layer']}"
            counts = f"kept {sum(1 for c in state['kept'] if c is not None and c[0] == p)}"
            _draw_panel(ax, show, p, state, f"{show['panels'][p]['name']}: {label}, {counts}")
            ax.set_gid(f"panel:{r}:{p}")
    for ax in axes[len(rows) * panels:]:
        ax.set_axis_off()
    weights = "RANDOM WEIGHTS (tokens chosen by an untrained model)" if show.get("random_weights") else \
        f"weights {show.get('weights')}"
    picture = show.get("image") or "synthetic pixels"
    figure.suptitle(f"{show['model']} {show['variant']} ({show['budget']}): {weights}\n"
                    f"image {Path(str(picture)).name if show.get('image') else picture} | {show.get('device', 'cpu')}"
                    f" | {show.get('compute_dtype')} | {str(show.get('created'))[:10]}\n"
                    "grey: discarded; outlined: kept; tint and line: merged into that kept token", fontsize="small")
    figure.tight_layout()
    return figure


def serve_figure(report: dict[str, Any]) -> Figure:
    """A serving report (`ficoco serve-bench`): requests/s and time to first token (p50) against the requests in
    flight, one line per variant (its visual tokens and the accountant's TFLOPs per request in the legend)."""
    figure, (throughput, ttft) = _new_figure(2)
    variants = list(dict.fromkeys(row["variant"] for row in report["rows"]))
    for index, variant in enumerate(variants):
        rows = sorted((r for r in report["rows"] if r["variant"] == variant), key=lambda r: r["concurrency"])
        levels = [r["concurrency"] for r in rows]
        tflops = rows[0]["tflops_per_request"]  # None: not counted (vLLM's EVS)
        cost = "TFLOPs not counted" if tflops is None else f"{tflops:.3g} TFLOPs"
        label = f"{variant} ({rows[0]['visual_tokens_per_request']:.4g} tokens, {cost})"
        style = {"color": "black" if variant == VANILLA else _colour(index), "marker": "o"}
        throughput.plot(levels, [r["requests_per_s"] for r in rows], label=label, **style)
        ttft.plot(levels, [r["ttft_p50_s"] * 1000 for r in rows], label=label, **style)
    for axis, name in ((throughput, "requests/s"), (ttft, "time to first token, p50 (ms)")):
        axis.set_xscale("log", base=2)
        axis.set_xlabel("concurrent requests")
        axis.set_ylabel(name)
        axis.grid(True, alpha=0.3)
    throughput.legend(fontsize="small")
    env = report.get("environment") or {}
    model = Path(str((report.get("config") or {}).get("model", ""))).name
    figure.suptitle(f"vLLM {env.get('vllm', '')} serving {model} on {env.get('device', 'an unrecorded device')}"
                    f" ({report.get('note', '')})", fontsize="small")
    return figure
