"""Rich tables and verdict lines for the commands. Rendering only: every figure arrives computed.

The default tables of `ficoco flops` and `ficoco profile` fit an 80-column terminal: they carry
the columns a user reads first, with the unit of each column in its header, and every figure
scaled to a readable unit (the largest in which the column's largest figure reads at least 1).
`--wide` shows every column; the JSON report always holds everything. Renderers read the report
dict only (what `--json` writes), so `ficoco report` shows the same table as the run did, and
they tolerate rows of older reports that lack a field ("-").
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from rich import box
from rich.console import Console, ConsoleOptions, RenderableType, RenderResult
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from ficoco.report.precision import precision
from ficoco.report.schemas import FLOPS_SCHEMA
from ficoco_cli.flags import cli_message

BYTE_UNITS = (("GB", 1e9), ("MB", 1e6), ("kB", 1e3), ("B", 1.0))
TIME_UNITS_MS = (("s", 1e3), ("ms", 1.0))
TERA_PREFIXES = (("T", 1.0), ("G", 1e-3), ("M", 1e-6), ("k", 1e-9))

# What makes a timed figure less trustworthy (named in the verdict lines).
NOISY_P90_OVER_MEDIAN = 1.2
NOISY_STDEV_OVER_MEDIAN = 0.1
FEW_TIMED_RUNS = 3  # below this, p90 and stdev say nothing about the spread
# The row's prefill priced at each pass of its rate probe (before, between and after its runs) spread
# by this share of the prediction or more: the machine's speed moved while the row ran.
UNSTEADY_PASS_SPREAD = 0.3


def fmt_bytes(n: float | None) -> str:
    """Decimal units (1e6 / 1e9), as the reports use."""
    if n is None:
        return "-"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def fmt_duration(seconds: float) -> str:
    """A duration as a person reads it: 12 ms, 3.4 s, 1:42, 2:05:07."""
    if seconds < 1:
        return f"{seconds * 1e3:.0f} ms"
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def fmt_count(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(n)


def fmt_tera(x: float) -> str:
    return f"{x:.4f}" if x < 0.1 else f"{x:.3f}"


def fmt_num(x: Any) -> str:
    """A figure at about four significant digits and never in exponent notation; "-" when missing."""
    if not isinstance(x, int | float) or isinstance(x, bool):
        return "-"
    if not math.isfinite(x):
        return str(x)
    size = abs(x)
    if size >= 1000:
        return f"{x:,.0f}"
    for floor, decimals in ((100, 1), (10, 2), (1, 3)):
        if size >= floor:
            return f"{x:.{decimals}f}"
    if size < 1e-9:
        return "0"
    return f"{x:.{min(9, 2 - math.floor(math.log10(size)))}f}"  # three significant digits below 1


def pick_unit(values: Sequence[Any], units: Sequence[tuple[str, float]]) -> tuple[str, float]:
    """The largest unit in which the largest present value reads at least 1 (the smallest unit otherwise)."""
    largest = max((abs(v) for v in values if _is_number(v) and math.isfinite(v)), default=0.0)
    for name, scale in units:
        if largest >= scale:
            return name, scale
    return units[-1]


def tera_units(unit: str) -> tuple[tuple[str, float], ...]:
    """`TFLOPs` -> TFLOPs, GFLOPs, MFLOPs, kFLOPs with their scales to tera."""
    base = unit.split()[0]
    base = base[1:] if base.startswith("T") else base
    return tuple((prefix + base, scale) for prefix, scale in TERA_PREFIXES)


def _is_number(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


def _get(row: Any, *path: str) -> Any:
    """row[path[0]][path[1]]..., or None where a level is missing (rows of older reports)."""
    for key in path:
        if not isinstance(row, dict):
            return None
        row = row.get(key)
    return row


def _ratio(x: Any) -> str:
    return f"{x:.2f}x" if _is_number(x) and math.isfinite(x) else "-"


def _percent(x: Any, signed: bool = False) -> str:
    if not _is_number(x) or not math.isfinite(x):
        return "-"
    return f"{x * 100:+.1f}" if signed else f"{x * 100:.1f}"


def _text(x: Any) -> str:
    return "-" if x is None or x == "" else str(x)


def _named(row: Any) -> str:
    """A row's method as the tables name it: its variant, with ficoco's corrections of the official code when its
    settings turn one on ("visionzip (ficoco: mean contextual token)"; a flops row's settings, a profile row's
    analytic settings)."""
    from ficoco.methods.registry import variant_label

    settings = _get(row, "settings") or _get(row, "analytic", "settings")
    return variant_label(_text(_get(row, "variant")), settings if isinstance(settings, dict) else None)


# ---- table assembly -------------------------------------------------------------------------------------------

@dataclass
class _Column:
    """A column: its header (a second line holds the unit) and its cells, one per row."""

    header: str
    cells: list[str] = field(default_factory=list)
    left: bool = False

    @property
    def width(self) -> int:
        return max(len(line) for text in (self.header, *self.cells) for line in text.split("\n"))


def _scaled(header: str, values: Sequence[Any], units: Sequence[tuple[str, float]],
            unit: tuple[str, float] | None = None) -> _Column:
    """A column of figures in one unit (the readable one for these values unless given), named in its header."""
    name, scale = unit or pick_unit(values, units)
    return _Column(f"{header}\n{name}", [fmt_num(v / scale) if _is_number(v) else "-" for v in values])


def _table(columns: list[_Column], rows: Sequence[int], *, title: str | None = None, caption: str | None = None,
           show_header: bool = True, aligned: bool = False) -> Table:
    # A compact box (a rule under the header, two spaces between columns) keeps the default tables
    # within 80 columns; "fold" rather than rich's ellipsis, so a console narrower than a table wraps
    # a figure instead of cutting it. `aligned` gives every column its widest cell's width (tables
    # stacked under one header), which only fits a console wide enough for it.
    table = Table(title=title, caption=caption, title_justify="left", caption_justify="left", box=box.SIMPLE_HEAD,
                  show_edge=False, pad_edge=False, collapse_padding=True, show_header=show_header)
    for column in columns:
        table.add_column(column.header, justify="left" if column.left else "right", overflow="fold",
                         min_width=column.width if aligned else None)
    for i in rows:
        table.add_row(*(column.cells[i] for column in columns))
    return table


class _Grouped:
    """Rows in groups, each under a label line. Where the console is wide enough the groups' tables share
    the first one's header and its column widths, so they read as one table; where it is not, each group
    is a table of its own that rich may narrow (so nothing is cropped)."""

    def __init__(self, columns: list[_Column], groups: list[tuple[str, list[int]]], title: str,
                 caption: str) -> None:
        self.columns, self.groups, self.title, self.caption = columns, groups, title, caption

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        columns = self.columns
        aligned = sum(c.width for c in columns) + 2 * (len(columns) - 1) <= options.max_width
        if aligned:
            yield _table(columns, [], title=self.title, aligned=True)
        else:
            yield Text(self.title)
        for n, (label, indices) in enumerate(self.groups):
            yield Text(label, style="bold")
            yield _table(columns, indices, show_header=not aligned, aligned=aligned,
                         caption=self.caption if n == len(self.groups) - 1 else None)


def _grouped(columns: list[_Column], groups: list[tuple[str, list[int]]], title: str, caption: str) -> RenderableType:
    """One table, or with several groups of rows one table per group under a label line (`_Grouped`)."""
    if len(groups) == 1:
        return _table(columns, range(len(columns[0].cells)), title=title, caption=caption)
    return _Grouped(columns, groups, title, caption)


# ---- ficoco models ---------------------------------------------------------------------------------------------

def _decoder_words(row: dict[str, Any]) -> str:
    """The decoder's kind in words: dense, sparse experts (top-k of n), hybrid attention; DeepStack's taps."""
    layers = row["llm_layers"]
    full = row.get("full_attention_layers", layers)
    experts = row.get("experts")
    words = []
    if experts:
        dense = layers - experts["sparse_layers"]
        words.append(f"MoE {experts['top_k']} of {experts['experts']}" + (f" ({dense} dense)" if dense else ""))
    if full < layers:
        words.append(f"{layers - full} DeltaNet + {full} full")
    if not words:
        words.append("dense")
    if row.get("deepstack_layers"):
        words.append(f"DeepStack {len(row['deepstack_layers'])}")
    return ", ".join(words)


def models_table(rows: list[dict[str, Any]]) -> Table:
    table = Table(title="Model profiles", title_justify="left")
    for col, justify in (("profile", "left"), ("family", "left"), ("parameters", "right"),
                         ("vision layers x width", "right"), ("LLM layers x width", "right"),
                         ("heads / kv", "right"), ("decoder", "left"), ("visual tokens / image", "right")):
        table.add_column(col, justify=justify)  # type: ignore[arg-type]
    for r in rows:
        table.add_row(r["name"], r["family"], fmt_count(r["parameters"]),
                      f"{r['vision_layers']} x {r['vision_hidden']}", f"{r['llm_layers']} x {r['llm_hidden']}",
                      f"{r['llm_heads']} / {r['llm_kv_heads']}", _decoder_words(r), str(r["visual_tokens_per_image"]))
    return table


def models_unverified(rows: list[dict[str, Any]]) -> Text | None:
    """What each profile could not establish (its ficoco section's `unverified` list), under the table."""
    listed = [r for r in rows if r.get("unverified")]
    if not listed:
        return None
    text = Text("Not established here (each profile's ficoco.unverified):\n")
    for r in listed:
        for item in r["unverified"]:
            text.append(f"  {r['name']}: {item}\n")
    return text


# ---- ficoco flops ----------------------------------------------------------------------------------------------

# Which KV-cache figure a flops row's `kv_cache_bytes` is (its `kv_cache_figure`, set by the convention), named in
# the column's header and defined under the table, so that LLM-Viewer's figure never passes for the stored one.
KV_HEADERS = {"llm-viewer": "KV\nviewer", "stored": "KV\nstored"}
KV_NOTES = {
    "llm-viewer": "KV viewer: LLM-Viewer's KV cache, values x KV bits / 8 (no scales or zero points)",
    "stored": "KV stored: the KV cache as transformers holds it (quantized: codes and a 16-bit scale and zero point "
              "per group), as ficoco profile measures it",
}
STORED_KV_NOTE = ("KV stored (kv_cache_stored_bytes: codes and a 16-bit scale and zero point per group, as ficoco "
                  "profile measures it)")


def _kv_figure(rows: Sequence[dict[str, Any]]) -> str | None:
    """The KV figure the rows' `kv_cache_bytes` share (a flops report's); None for older reports and measured rows."""
    figures = {r.get("kv_cache_figure") for r in rows}
    figure = figures.pop() if len(figures) == 1 else None
    return figure if figure in KV_HEADERS else None


def _stored_kv_differs(row: dict[str, Any]) -> bool:
    stored = row.get("kv_cache_stored_bytes")
    return _is_number(stored) and stored != row.get("kv_cache_bytes")


def _kv_column(rows: Sequence[dict[str, Any]]) -> tuple[_Column, list[str]]:
    """The KV cache column of accountant rows, its header naming the figure, and the note that defines it."""
    figure = _kv_figure(rows)
    column = _scaled(KV_HEADERS[figure] if figure else "KV cache", [r.get("kv_cache_bytes") for r in rows],
                     BYTE_UNITS)
    return column, [KV_NOTES[figure]] if figure else []


def _stored_kv_note(rows: Sequence[dict[str, Any]], labels: Sequence[str]) -> str | None:
    differing = [f"{label} {_bytes_words(r['kv_cache_stored_bytes'])}"
                 for r, label in zip(rows, labels, strict=True) if _stored_kv_differs(r)]
    return f"{STORED_KV_NOTE}: " + ", ".join(differing) if differing else None


def flops_table(report: dict[str, Any], unit: str, show_roofline: bool, wide: bool = False) -> Table:
    """The accountant's rows: visual tokens, cost in scope and its reduction, KV cache, weights, memory access
    (and the roofline time with a GPU); `wide` adds the cost of every stage."""
    rows = report["rows"]
    quants = list(dict.fromkeys(r["quant"] for r in rows))
    mode = "equivalent: final token count in every layer" if report["equivalent"] else "layer-exact"
    title = (f"{report['model']}: {unit}, convention {report['convention']}, scope {report['scope']} ({mode}); "
             f"batch {report['batch']}, {report['text_tokens']} text tokens"
             + (f", {quants[0]}" if len(quants) == 1 else ""))
    tera_unit = pick_unit([r["tflops"] for r in rows], tera_units(unit))
    columns = [_Column("variant", [_named(r) for r in rows], left=True)]
    if wide or len(quants) > 1:
        columns.append(_Column("quant", [r["quant"] for r in rows], left=True))
    columns.append(_Column("visual\ntokens", [str(r["visual_tokens"]) for r in rows]))
    # Methods that prune inside the LLM are quoted by the layer average (sum_l n_l / L); show it where it differs.
    averages = [r.get("layer_average_visual_tokens") for r in rows]
    if any(a is not None and abs(a - r["visual_tokens"]) > 1e-9 for a, r in zip(averages, rows, strict=True)):
        columns.append(_Column("layer\navg", ["-" if a is None else f"{a:.1f}" for a in averages]))
    if wide:
        in_scope = set(report["scope_stages"])
        short = {"vision": "vision", "projector": "proj", "llm": "llm", "lm_head": "head"}
        for stage in report["stages"]:
            header = short.get(stage, stage) + ("" if stage in in_scope else "*")
            columns.append(_scaled(header, [r["tflops_by_stage"][stage] for r in rows], (), tera_unit))
    columns.append(_scaled("total", [r["tflops"] for r in rows], (), tera_unit))
    if wide and any(r.get("method_tflops") for r in rows):
        columns.append(_scaled("method", [r.get("method_tflops") or 0.0 for r in rows], (), tera_unit))
    # Names on two lines above their unit: with a quant column and a roofline the table still fits 80 columns.
    columns.append(_Column("vs\nvanilla\n%", [_percent(-r["reduction_vs_vanilla"], signed=True)
                                             if r.get("reduction_vs_vanilla") is not None else "-" for r in rows]))
    kv_column, kv_notes = _kv_column(rows)
    columns.append(kv_column)
    # LLM-Viewer's quantized cache beside the stored one: a column of its own in --wide, else named under the table.
    if stored_note := _stored_kv_note(rows, [f"{r['variant']} {r['quant']}" for r in rows]):
        if wide:
            columns.append(_scaled("KV\nstored", [r.get("kv_cache_stored_bytes") for r in rows], BYTE_UNITS))
        kv_notes.append(KV_NOTES["stored"] if wide else stored_note)
    columns.append(_scaled("weights", [r["weight_bytes"] for r in rows], BYTE_UNITS))
    columns.append(_scaled("mem\naccess", [r["memory_access_bytes"] for r in rows], BYTE_UNITS))
    if show_roofline:
        columns.append(_scaled("roofline", [r.get("roofline_ms") for r in rows], (), ("ms", 1.0)))
    caption = (("stages marked * are outside the scope and not in the total; " if wide else
                f"total: the cost in scope {report['scope']} (--wide: by stage); ")
               + "memory access is LLM-Viewer traffic, not a footprint; bytes in decimal units")
    caption += "".join(f"; {note}" for note in kv_notes)
    # How the convention counts a sparse, hybrid or DeepStack model's own parts.
    caption += "".join(f"; {note}" for note in report.get("convention_notes", ()))
    # A hybrid decoder's linear-attention layers hold a fixed state beside the KV cache (fewer tokens save none).
    states = {json.dumps(r["linear_state"], sort_keys=True): r["linear_state"] for r in rows if r.get("linear_state")}
    for state in states.values():
        caption += (f"; linear-attention state beside the KV cache: {fmt_bytes(state['total_bytes'])} "
                    f"(recurrent {fmt_bytes(state['recurrent_bytes'])}, convolution {fmt_bytes(state['conv_bytes'])}) "
                    f"in {state['layers']} Gated DeltaNet layers, whatever the visual tokens")
    # A budget's default shape that had to shorten its run of layers says which layers it used.
    for variant, note in dict.fromkeys((r["variant"], r.get("settings", {}).get("shape")) for r in rows):
        if isinstance(note, str):
            caption += f"; {variant}: {note}"
    return _table(columns, range(len(rows)), title=title, caption=caption)


def methods_table(rows: list[dict[str, Any]]) -> Table:
    """The method registry: name, where it acts, its defaults, the families it runs on."""
    table = Table(title="reduction methods (ficoco flops --variant NAME; --keep/--preset N: see 'keep')",
                  title_justify="left",
                  caption=escape("defaults: the official code's, or where [marked] their source (FiCoCo's: its "
                                 "paper, which defines it); (ficoco: VALUE = what it does) names ficoco's corrections "
                                 "of the official code, set with --hp NAME=VALUE and named in every report, as is a "
                                 "rule named with --hp rule=VALUE; reads: what a method reads of attention, "
                                 "probabilities (whole rows or columns of a layer's softmax, read beside its kernel), "
                                 "rows (a few, recomputed from q and k beside any kernel) or none"),
                  caption_justify="left")
    for col in ("name", "method", "acts at", "reads", "positions", "defaults", "keep N means", "families", "runs"):
        table.add_column(col, justify="left", overflow="fold")
    for r in rows:
        corrections = r.get("corrections") or {}
        sources = r.get("default_sources") or {}
        rules = r.get("rules") or {}
        defaults = escape(", ".join(
            f"{k}={list(v) if isinstance(v, tuple) else v}"
            + (f" [{sources[k]}]" if k in sources else "")
            + (" (ficoco: " + "; ".join(f"{c['value']} = {c['means']}" for c in corrections[k]) + ")"
               if corrections.get(k) else "")
            + (" (" + "; ".join(f"{name} = {label}" for name, label in rules.items()) + ")"
               if k == "rule" and rules else "")
            for k, v in r["hyperparameters"].items()))
        where = f"{r['acts_at'].replace('_', ' ')} ({r['placement'].replace('_', ' ')})"
        table.add_row(r["name"], r["title"], where, r.get("attention_reads", ""), r["positions"],
                      defaults, cli_message(r["keep_means"]),
                      ", ".join(r["families"]), "yes" if r["wired"] else "flops only")
    return table


def matrix_table(rows: list[dict[str, Any]]) -> Table:
    """Methods x model families (`ficoco methods --matrix`): yes, or why not, in one line per cell."""
    families = list(rows[0]["families"]) if rows else []
    table = Table(title="methods x families (yes: the models run it; flops only: `ficoco flops` plans it; "
                        "refused: neither)", title_justify="left")
    table.add_column("method", justify="left", no_wrap=True)
    for family in families:
        table.add_column(family, justify="left", overflow="fold")
    for r in rows:
        cells = []
        for family in families:
            cell = r["families"][family]
            cells.append(cell["status"] + (f": {cell['reason']}" if cell["reason"] else ""))
        table.add_row(f"{r['name']} ({r['title']})", *cells)
    return table


def matrix_markdown(rows: list[dict[str, Any]]) -> str:
    """The matrix as a Markdown table (`methods --matrix --markdown`): a cell says yes, flops only or
    refused with a footnote number; the numbered reasons follow the table, each reason once."""
    families = list(rows[0]["families"]) if rows else []
    reasons: list[str] = []
    lines = ["| method | " + " | ".join(families) + " |", "| --- |" + " --- |" * len(families)]
    for r in rows:
        cells = []
        for family in families:
            cell = r["families"][family]
            if not cell["reason"]:
                cells.append(cell["status"])
                continue
            if cell["reason"] not in reasons:
                reasons.append(cell["reason"])
            cells.append(f"{cell['status']} ({reasons.index(cell['reason']) + 1})")
        lines.append(f"| {r['name']} ({r['title']}) | " + " | ".join(cells) + " |")
    return "\n".join([*lines, "", *(f"({i}) {reason}" for i, reason in enumerate(reasons, 1))]).rstrip()


def per_layer_table(row: dict[str, Any], unit: str) -> Table:
    table = Table(title=f"{row['variant']} per layer ({unit})", title_justify="left")
    for col in ("stage", "layer", "tokens in", "tokens out", "removed", unit):
        table.add_column(col, justify="left" if col == "stage" else "right")
    for layer in row["per_layer"]:
        removed = layer["tokens_in"] - layer["tokens_out"] if layer["tokens_in"] is not None else 0
        table.add_row(layer["stage"], "-" if layer["layer"] is None else str(layer["layer"]),
                      "-" if layer["tokens_in"] is None else str(layer["tokens_in"]),
                      "-" if layer["tokens_out"] is None else str(layer["tokens_out"]),
                      str(removed) if removed else "", fmt_tera(layer["tera"]))
    return table


# ---- ficoco profile / ficoco report ------------------------------------------------------------------------------

def _measured(row: dict[str, Any], *path: str) -> Any:
    """A measured figure; none for a row that was not measured (its stale fields are not shown)."""
    return _get(row, *path) if row.get("status") == "ok" else None


def _groups(rows: list[dict[str, Any]]) -> list[tuple[str, list[int]]]:
    """Rows by (quant, batch), in report order, each with its label: speedups compare within a group."""
    keys = [(r.get("quant"), r.get("batch")) for r in rows]
    indices: dict[tuple[Any, Any], list[int]] = {}
    for i, key in enumerate(keys):
        indices.setdefault(key, []).append(i)
    quant_varies = len({q for q, _ in keys}) > 1
    batch_varies = len({b for _, b in keys}) > 1

    def label(first: dict[str, Any], batch: Any) -> str:
        parts = ([precision(first)] if quant_varies else []) + ([f"batch {_text(batch)}"] if batch_varies else [])
        return ", ".join(parts)

    return [(label(rows[idx[0]], key[1]), idx) for key, idx in indices.items()]


def _profile_title(report: dict[str, Any], rows: list[dict[str, Any]], wide: bool) -> str:
    env, config = report.get("environment") or {}, report.get("config") or {}
    setting = ""
    if not wide and len(_groups(rows)) == 1 and rows:
        setting = f", {precision(rows[0])}, batch {_text(rows[0].get('batch'))}"
    return (f"{_text(config.get('model'))} on {_text(env.get('device'))} ({_text(env.get('device_kind'))}, "
            f"{_text(env.get('threads'))} threads): prefill{setting}, {_runs_count(rows, config, 'repeat')} runs after "
            f"{_runs_count(rows, config, 'warmup')} warm-up")


def _runs_count(rows: list[dict[str, Any]], config: dict[str, Any], key: str) -> str:
    """What ran: the rows' own counts (a range where the time rule gave rows different counts), else the
    configuration's (reports made before the rule)."""
    counts = sorted({n for r in rows if isinstance(n := _get(r, "runs", key), int)})
    if not counts:
        return _text(config.get(key))
    return str(counts[0]) if len(counts) == 1 else f"{counts[0]}-{counts[-1]}"


def _profile_caption(rows: list[dict[str, Any]], wide: bool) -> str:
    method = next((m for r in rows if (m := _get(r, "memory", "method"))), None)
    text = "FLOPs: analytic, whole model, LM head on the last token. "
    if any(_is_number(_measured(r, "predicted_speedup_vs_vanilla")) for r in rows):
        text += (("speedup, predicted, FLOPs ratio" if wide else "speedup (pred., FLOPs)")
                 + ": vanilla's median latency (its prefill predicted from the accountant's ops at this machine's "
                   "measured rates; its FLOPs) over this row's, same precision and batch.")
    else:
        text += (("speedup, FLOPs ratio" if wide else "speedup (FLOPs)")
                 + ": vanilla's median latency (FLOPs) over this row's, same precision and batch.")
    if method:
        text += f" peak mem: {method}."
    if not wide:
        text += " Every column: --wide."
    return text


def _flops_values(rows: list[dict[str, Any]]) -> tuple[list[Any], tuple[str, float]]:
    values = [_get(r, "analytic", "tflops") for r in rows]
    return values, pick_unit(values, tera_units("TFLOPs"))


def _profile_columns(rows: list[dict[str, Any]]) -> list[_Column]:
    """The columns a user reads first."""
    tflops, tera_unit = _flops_values(rows)
    speedups = []
    predicting = any(_is_number(_measured(r, "predicted_speedup_vs_vanilla")) for r in rows)
    for r in rows:
        speedup, ratio = _measured(r, "speedup_vs_vanilla"), _measured(r, "flops_ratio_vs_vanilla")
        if speedup is None and ratio is None:
            speedups.append("-")
        elif predicting:
            # The yardstick (profiling/predict.py) beside the measured speedup, then the FLOPs ratio;
            # no "x" inside the brackets, so that the default table stays within 80 columns.
            predicted = _measured(r, "predicted_speedup_vs_vanilla")
            speedups.append(f"{_ratio(speedup)} ({_ratio(predicted).removesuffix('x')}, "
                            f"{_ratio(ratio).removesuffix('x')})")
        else:  # a report made before the prediction
            speedups.append(f"{_ratio(speedup)} ({_ratio(ratio)})")
    return [
        _Column("variant", [_named(r) for r in rows], left=True),
        _Column("visual\ntokens", [_text(_get(r, "analytic", "visual_tokens")) for r in rows]),
        _scaled("", tflops, (), tera_unit),
        _scaled("median", [_measured(r, "latency", "median_ms") for r in rows], TIME_UNITS_MS),
        _Column("speedup\n(pred., FLOPs)" if predicting else "speedup\n(FLOPs)", speedups),
        _scaled("peak mem", [_measured(r, "memory", "peak_bytes") for r in rows], BYTE_UNITS),
        _scaled("KV cache", [_measured(r, "kv_cache_bytes") for r in rows], BYTE_UNITS),
        _Column("status", [_text(r.get("status")) for r in rows], left=True),
    ]


def _profile_wide_columns(report: dict[str, Any], rows: list[dict[str, Any]]) -> list[_Column]:
    """Every figure of a row."""
    tflops, tera_unit = _flops_values(rows)
    medians = [_measured(r, "latency", "median_ms") for r in rows]
    time_unit = pick_unit(medians, TIME_UNITS_MS)  # one unit for every latency column, to compare them
    kv_measured = [_measured(r, "kv_cache_bytes") for r in rows]
    kv_analytic = [_get(r, "analytic", "kv_cache_bytes") for r in rows]
    kv_unit = pick_unit(kv_measured + kv_analytic, BYTE_UNITS)
    per_s_unit = pick_unit([_measured(r, "achieved_tflops_per_s") for r in rows], tera_units("TFLOPs"))
    columns = [
        _Column("variant", [_named(r) for r in rows], left=True),
        _Column("quant", [_text(r.get("quant")) for r in rows], left=True),
        _Column("dtype", [_text(_get(r, "backend", "compute_dtype")) for r in rows], left=True),
        _Column("batch", [_text(r.get("batch")) for r in rows]),
        _Column("visual\ntokens", [_text(_get(r, "analytic", "visual_tokens")) for r in rows]),
        _Column("status", [_text(r.get("status")) for r in rows], left=True),
        _scaled("median", medians, (), time_unit),
        _scaled("p90", [_measured(r, "latency", "p90_ms") for r in rows], (), time_unit),
        _scaled("min", [_measured(r, "latency", "min_ms") for r in rows], (), time_unit),
        _scaled("stdev", [_measured(r, "latency", "stdev_ms") for r in rows], (), time_unit),
        _Column("timed\nruns", [_text(len(s)) if isinstance(s := _measured(r, "latency", "samples_ms"), list)
                                else "-" for r in rows]),
        _Column("img/s", [fmt_num(_measured(r, "images_per_s")) for r in rows]),
        _scaled("", tflops, (), tera_unit),
        _scaled("achieved", [_measured(r, "achieved_tflops_per_s") for r in rows], (),
                (per_s_unit[0] + "/s", per_s_unit[1])),
        _scaled("method", [_measured(r, "reduction_ms") for r in rows], (), ("ms", 1.0)),
        _Column("method\n%", [_percent(_measured(r, "reduction_share")) for r in rows]),
        _Column("speedup", [_ratio(_measured(r, "speedup_vs_vanilla")) for r in rows]),
        _Column("pred.\nspeedup", [_ratio(_measured(r, "predicted_speedup_vs_vanilla")) for r in rows]),
        _Column("FLOPs\nratio", [_ratio(_measured(r, "flops_ratio_vs_vanilla")) for r in rows]),
        _scaled("peak mem", [_measured(r, "memory", "peak_bytes") for r in rows], BYTE_UNITS),
        _Column("mem\nsaving %", [_percent(_measured(r, "memory_saving_vs_vanilla")) for r in rows]),
        _scaled("KV measured", kv_measured, (), kv_unit),
        _scaled("KV analytic", kv_analytic, (), kv_unit),
    ]
    if any(_get(r, "analytic", "roofline_ms") for r in rows):
        columns.append(_scaled("roofline", [_get(r, "analytic", "roofline_ms") for r in rows], (), ("ms", 1.0)))
        columns.append(_Column("measured /\nroofline", [_ratio(_measured(r, "measured_over_roofline"))
                                                          for r in rows]))
    if (report.get("config") or {}).get("new_tokens"):
        columns.append(_Column("e2e\nimg/s", [fmt_num(_measured(r, "generation", "images_per_s")) for r in rows]))
        columns.append(_Column("gen\ntok/s", [fmt_num(_measured(r, "generation", "generated_tokens_per_s"))
                                              for r in rows]))
        # profiling/decode.py: time to first token, and the median and p90 decode step.
        columns.append(_Column("TTFT\nms", [fmt_num(_measured(r, "generation", "ttft", "median_ms")) for r in rows]))
        columns.append(_Column("decode\nms/tok", [fmt_num(_measured(r, "generation", "decode_per_token", "median_ms"))
                                                  for r in rows]))
        columns.append(_Column("decode p90\nms/tok", [fmt_num(_measured(r, "generation", "decode_per_token",
                                                                         "p90_ms")) for r in rows]))
        columns.append(_scaled("KV after\ndecode", [_measured(r, "generation", "kv_cache_bytes") for r in rows],
                               BYTE_UNITS))
    return columns


def profile_table(report: dict[str, Any], wide: bool = False) -> RenderableType:
    """The measured rows: by default the columns a user reads first, within 80 columns (rows of several quants
    or batches under a label line per group); `wide`: every column, one row per line."""
    rows = report.get("rows") or []
    title, caption = _profile_title(report, rows, wide), _profile_caption(rows, wide)
    if wide:
        return _table(_profile_wide_columns(report, rows), range(len(rows)), title=title, caption=caption)
    return _grouped(_profile_columns(rows), _groups(rows), title, caption)


# ---- the verdict under the profile table ---------------------------------------------------------------------------

def _bytes_words(n: Any) -> str:
    if not _is_number(n):
        return "-"
    unit, scale = pick_unit([n], BYTE_UNITS)
    return f"{fmt_num(n / scale)} {unit}"


def _times(x: float) -> str:
    """A ratio in words: two decimals near 1, where they tell 1.04x from 0.96x; one above 2."""
    return f"{x:.1f}x" if x >= 2 else f"{x:.2f}x"


def _faster(ratio: float, what: str) -> str:
    if ratio >= 1:
        return f"{what} {_times(ratio)} faster"
    return f"{what} {_times(1 / ratio)} slower" if ratio > 0 else f"{what} speed ratio {ratio}"


def _spread(row: dict[str, Any]) -> str | None:
    """The spread of a row's timed runs, when it is large enough to doubt the median."""
    median, p90, stdev = (_get(row, "latency", key) for key in ("median_ms", "p90_ms", "stdev_ms"))
    if not _is_number(median) or median <= 0:
        return None
    spread = []
    if _is_number(p90) and p90 / median >= NOISY_P90_OVER_MEDIAN:
        spread.append(f"p90/median {p90 / median:.2f}")
    if _is_number(stdev) and stdev / median >= NOISY_STDEV_OVER_MEDIAN:
        spread.append(f"stdev/median {stdev / median * 100:.0f} %")
    return ", ".join(spread) or None


def _caveats(row: dict[str, Any], base: dict[str, Any] | None, config: dict[str, Any]) -> list[str]:
    """What makes this row's figures less trustworthy (a speedup also inherits its vanilla row's timing)."""
    caveats = []
    timed = [row] + ([base] if base is not None else [])
    counts = [len(s) for r in timed if isinstance(s := _get(r, "latency", "samples_ms"), list)]
    if counts and min(counts) < FEW_TIMED_RUNS:
        caveats.append(f"only {min(counts)} timed run{'' if min(counts) == 1 else 's'}")
    for whose, timed_row in (("", row), ("vanilla ", base)):
        if timed_row is not None and (spread := _spread(timed_row)):
            caveats.append(f"noisy {whose}timing ({spread})")
    for which, timed_row in (("this", row), ("the vanilla", base)):
        spread = _get(timed_row, "predicted", "spread") if timed_row is not None else None
        if _is_number(spread) and spread >= UNSTEADY_PASS_SPREAD:
            caveats.append(f"this machine's speed moved while {which} row ran (the prediction at each pass of "
                           f"its rate probe spread by {spread * 100:.0f} %)")
    if config.get("device") == "auto" and row.get("device_kind") == "cpu":
        caveats.append("CPU fallback (--device auto found no GPU)")
    dtype = _get(row, "backend", "compute_dtype")
    reason, storage = _get(row, "backend", "dtype_reason"), _get(row, "backend", "storage_dtype")
    if isinstance(reason, str):
        # Said whenever the dtypes are not the plain float16 that an fp16 row's name suggests.
        if row.get("quant") != "fp16" or dtype != "float16" or storage != "float16":
            stored = f", weights stored as {storage}" if storage and storage != dtype else ""
            caveats.append(f"computed in {dtype}{stored}: {cli_message(reason)}")
    elif row.get("quant") == "fp16" and dtype not in (None, "float16"):
        caveats.append(f"computed in {dtype}, not float16, for speed"
                       + (" on CPU" if row.get("device_kind") == "cpu" else ""))
    elif row.get("note"):
        caveats.append(str(row["note"]))
    return caveats


def _row_verdict(row: dict[str, Any], base: dict[str, Any] | None, config: dict[str, Any]) -> str:
    tokens = _get(row, "analytic", "visual_tokens")
    tflops = _get(row, "analytic", "tflops")
    facts = [f"{_text(tokens)} visual tokens"]
    if row.get("status") != "ok":
        reason = cli_message(str(row.get("reason"))) if row.get("reason") else "no reason recorded"
        analytic = [f"{fmt_num(tflops)} TFLOPs"] if _is_number(tflops) else []
        if _is_number(kv := _get(row, "analytic", "kv_cache_bytes")):
            analytic.append(f"KV cache {_bytes_words(kv)}")
        text = f"not measured ({_text(row.get('status'))}: {reason})"
        if row.get("variant") == "vanilla":
            return text + "; the rows of its quant and batch have no speedup"
        return text + "; by the accountant: " + ", ".join(facts + analytic)
    compared = base is not None and base.get("status") == "ok"
    speedup, flops_ratio = row.get("speedup_vs_vanilla"), row.get("flops_ratio_vs_vanilla")
    if _is_number(speedup):
        facts.append(_faster(speedup, "prefill"))
        said = []
        predicted = row.get("predicted_speedup_vs_vanilla")
        if _is_number(predicted) and predicted > 0:
            # The honest yardstick: what this machine's rates predict for the pair (profiling/predict.py).
            pace = _times(predicted) if predicted >= 1 else f"{_times(1 / predicted)} slower"
            said.append(f"predicted {pace} at this machine's rates")
        if _is_number(flops_ratio) and flops_ratio > 0:
            fewer = f"{_times(flops_ratio)} fewer" if flops_ratio >= 1 else f"{_times(1 / flops_ratio)} more"
            said.append(f"FLOPs {fewer}")
        if said:
            facts[-1] += f" ({'; '.join(said)})"
        work = row.get("own_work_vs_savings")
        if work and work["saved_ms"] <= 0:
            facts.append(f"its fewer tokens save no measurable time and its own work adds {fmt_num(work['own_ms'])} ms")
        elif work and work["eats_savings"]:
            facts.append(f"its own work ({fmt_num(work['own_ms'])} ms) eats what its fewer tokens save "
                         f"({fmt_num(work['saved_ms'])} ms)")
        elif work:
            share = work["own_ms"] / work["saved_ms"] * 100
            facts.append(f"its own work ({fmt_num(work['own_ms'])} ms) takes {share:.2g} "
                         f"% of the {fmt_num(work['saved_ms'])} ms its fewer tokens save")
        if work and _is_number(floor := work.get("reads_share_predicted")):
            # What no faster step can lower: the reads the method's rule asks for, at this machine's rates.
            facts[-1] += f" (its reads of attention alone {floor * 100:.2g} % of its savings, predicted)"
    else:
        median = _get(row, "latency", "median_ms")
        unit, scale = pick_unit([median], TIME_UNITS_MS)
        facts.append(f"prefill {fmt_num(median / scale) if _is_number(median) else '-'} {unit}")
    if compared and (slower := _slower_kernels_words(row)):
        facts.append(slower)
    kv, base_kv = row.get("kv_cache_bytes"), _get(base, "kv_cache_bytes") if compared else None
    if _is_number(kv):
        facts.append(f"KV cache {_bytes_words(kv)}" + (f" instead of {_bytes_words(base_kv)}"
                                                       if _is_number(base_kv) else ""))
    peak, base_peak = _get(row, "memory", "peak_bytes"), _get(base, "memory", "peak_bytes") if compared else None
    if _is_number(peak) and _is_number(base_peak) and base_peak > 0:
        facts.append(f"peak memory {(peak / base_peak - 1) * 100:+.1f} %")
    elif _is_number(peak):
        facts.append(f"peak memory {_bytes_words(peak)}")
    # Answering end to end: decode.py's total (call to last token); older reports: generate()'s wall time.
    generated = _get(row, "generation", "total", "median_ms") or _get(row, "generation", "latency", "median_ms")
    base_generated = (_get(base, "generation", "total", "median_ms") or _get(base, "generation", "latency",
                                                                               "median_ms")) if compared else None
    if _is_number(generated) and _is_number(base_generated) and generated > 0:
        words = _faster(base_generated / generated, f"generating {_text(_get(row, 'generation', 'new_tokens'))} "
                                                    "tokens end to end")
        facts.append(f"{words} ({fmt_num(_get(row, 'generation', 'generated_tokens_per_s'))} tok/s)")
    if not compared:
        facts.append("no measured vanilla row of its quant and batch to compare with")
    text = ", ".join(facts)
    caveats = _caveats(row, base if compared else None, config)
    return text + ("; caution: " + "; ".join(caveats) if caveats else "")


# ---- the attention kernels every layer ran (profiling/kernels.py, report/kernels.py) --------------------------------

STAGE_LAYER_WORDS = {"vision": "vision tower layer", "llm": "decoder layer"}


def _layer_ranges(runs: Sequence[Sequence[int]], joiner: str = ", ") -> str:
    return joiner.join(f"{first}" if first == last else f"{first}-{last}" for first, last in runs)


def _kernel_words(kernel: dict[str, Any]) -> str:
    """A kernel in words: "SDPA (flash)", "eager attention", "ficoco's probe", ..."""
    implementation, backend = kernel.get("implementation"), kernel.get("backend")
    if implementation == "sdpa":
        return f"SDPA ({backend})" if backend else "SDPA"
    if implementation in ("eager", "flex"):
        return f"{implementation} attention"
    if implementation == "probe":
        return "ficoco's probe"
    if implementation == "flash":
        return f"flash attention ({backend})" if backend else "flash attention"
    return _text(implementation)


def _slower_kernels_words(row: dict[str, Any]) -> str | None:
    """Where the row runs a slower attention kernel than vanilla in layers it does not reduce (report/kernels.py)."""
    slower = row.get("slower_kernels_vs_vanilla")
    if not isinstance(slower, list) or not slower:
        return None
    said = []
    for entry in slower:
        runs = entry.get("layers") or []
        several = len(runs) > 1 or any(first != last for first, last in runs)
        where = STAGE_LAYER_WORDS.get(entry.get("stage"), f"{_text(entry.get('stage'))} layer")
        where += "s" if several else ""
        said.append(f"runs {_kernel_words(entry.get('ran') or {})} in {where} {_layer_ranges(runs)}, where vanilla "
                    f"runs {_kernel_words(entry.get('vanilla') or {})}")
    return " and ".join(said)


def _kernel_cell(entry: dict[str, Any]) -> str:
    """One kind of call, short: implementation(backend), +reads where routed through ficoco beside the kernel,
    xN for N calls per layer."""
    text = _text(entry.get("implementation")) + (f"({entry['backend']})" if entry.get("backend") else "")
    if entry.get("reads") and entry.get("implementation") != "probe":
        text += "+reads"
    calls = entry.get("calls_per_layer")
    return text + (f" x{calls}" if isinstance(calls, int) and calls > 1 else "")


def kernel_lines(report: dict[str, Any]) -> list[str]:
    """Per row that recorded them, the attention kernel every layer ran, per stage (layers first-last); none for
    a report made before the record."""
    rows = [r for r in report.get("rows") or [] if isinstance(r.get("attention_kernels"), dict)]
    if not rows:
        return []
    several = len(_groups(report.get("rows") or [])) > 1
    lines = ["attention kernels by layer (implementation(backend): SDPA's backend as torch picks it; +reads: routed "
             "through ficoco, reading beside the kernel; probe: ficoco computes the output; xN: calls per layer):"]
    for row in rows:
        stages = []
        for stage, entries in row["attention_kernels"].items():
            kinds: dict[str, list[list[int]]] = {}
            for entry in entries if isinstance(entries, list) else []:
                if isinstance(entry, dict) and isinstance(entry.get("layers"), list):
                    kinds.setdefault(_kernel_cell(entry), []).append(entry["layers"])
            if kinds:
                said = ", ".join(f"{_layer_ranges(runs, ',')} {cell}" for cell, runs in kinds.items())
                stages.append(f"{stage} {said}")
        name = _named(row) + (f" {precision(row)} batch {_text(row.get('batch'))}" if several else "")
        lines.append(f"  {name}: " + ("; ".join(stages) or "no attention call recorded"))
    return lines


def verdict_lines(report: dict[str, Any]) -> list[str]:
    """One line per reduced row (and per vanilla row that was not measured): the result in words against the
    vanilla row of the same quant and batch, and anything that makes its figures less trustworthy."""
    rows = report.get("rows") or []
    config = report.get("config") or {}
    vanilla = {(r.get("quant"), r.get("batch")): r for r in rows if r.get("variant") == "vanilla"}
    several = len(_groups(rows)) > 1
    lines = []
    for row in rows:
        if row.get("variant") == "vanilla" and row.get("status") == "ok":
            continue
        name = _named(row)
        if several:
            name += f" {precision(row)} batch {_text(row.get('batch'))}"
        lines.append(f"{name}: {_row_verdict(row, vanilla.get((row.get('quant'), row.get('batch'))), config)}")
    return lines


def time_line(report: dict[str, Any]) -> str | None:
    """The run's measured wall time beside the estimate made before it, and how far each row's estimate
    was from its measured wall time (reports without an estimate: None)."""
    estimate = report.get("estimate")
    if not isinstance(estimate, dict) or not _is_number(estimate.get("total_s")):
        return None
    rows = report.get("rows") or []
    measured = report.get("wall_s")
    text = f"time: estimated {fmt_duration(estimate['total_s'])} before the run"
    if _is_number(measured) and len(rows) == estimate.get("rows"):
        text += f", measured {fmt_duration(measured)} ({(estimate['total_s'] / measured - 1) * 100:+.0f} %)"
    elif _is_number(measured):
        text += f", measured {fmt_duration(measured)} for {len(rows)} of {_text(estimate.get('rows'))} rows"
    errors = [_get(r, "estimate", "wall_s") / r["wall_s"] - 1 for r in rows
              if _is_number(_get(r, "estimate", "wall_s")) and _is_number(r.get("wall_s")) and r["wall_s"] > 0]
    if errors:
        text += (f"; rows (builds apart): estimate {min(errors) * 100:+.0f} % to {max(errors) * 100:+.0f} % of the "
                 "measured")
    return text


# ---- fidelity against vanilla (--fidelity) -------------------------------------------------------------------------

def _fidelity_rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for r in report.get("rows") or [] if isinstance(r.get("fidelity"), dict)]


def _share(x: Any) -> str:
    return f"{x * 100:.0f} %" if _is_number(x) and math.isfinite(x) else "-"


def fidelity_table(report: dict[str, Any]) -> Table | None:
    """Per reduced row, its outputs against vanilla's on the same inputs (None without --fidelity)."""
    rows = _fidelity_rows(report)
    if not rows:
        return None
    several = len(_groups(report.get("rows") or [])) > 1
    names = [_named(r) + (f" {precision(r)} b{_text(r.get('batch'))}" if several else "")
             for r in rows]
    greedy = []
    for r in rows:
        prefix, count = _get(r, "fidelity", "greedy_prefix_tokens"), _get(r, "fidelity", "new_tokens")
        greedy.append(f"{prefix:.3g}/{count} ({_share(_get(r, 'fidelity', 'greedy_prefix_share'))})"
                      if _is_number(prefix) and _is_number(count) else "-")
    columns = [
        _Column("variant", names, left=True),
        _Column("KL\nnats", [fmt_num(_get(r, "fidelity", "kl_divergence")) for r in rows]),
        _Column("KL max\nnats", [fmt_num(_get(r, "fidelity", "kl_divergence_max")) for r in rows]),
        _Column("top-1\nagrees", [_share(_get(r, "fidelity", "top1_agreement")) for r in rows]),
        _Column("greedy tokens\nmatching prefix", greedy),
    ]
    caption = ("KL(vanilla || row) of the next token at the last prompt position; top-1: share of prompts whose "
               "most likely next token is vanilla's; greedy: leading new tokens equal to vanilla's (mean).")
    return _table(columns, range(len(rows)), title="fidelity against vanilla, same inputs", caption=caption)


def fidelity_lines(report: dict[str, Any]) -> list[str]:
    """The decoded continuations (first prompt) and the notes of the fidelity rows."""
    lines, notes = [], set()
    for row in _fidelity_rows(report):
        fidelity = row["fidelity"]
        texts = fidelity.get("texts")
        if isinstance(texts, dict) and texts.get("vanilla") and texts.get("reduced"):
            lines.append(f"{_text(row.get('variant'))}: vanilla {texts['vanilla'][0]!r} vs reduced "
                         f"{texts['reduced'][0]!r}")
        if fidelity.get("note"):
            notes.add(f"fidelity: {cli_message(fidelity['note'])}")
    return lines + sorted(notes)


def print_profile(console: Console, report: dict[str, Any], wide: bool = False) -> None:
    """The profile table (and with several reducing methods of one quant and batch, the method comparison),
    then the verdict lines (one logical line each: a terminal wraps them, a pipe or a file keeps them whole),
    the attention kernels of every row,
    the fidelity table with --fidelity, and the run's time against its estimate."""
    console.print(profile_table(report, wide))
    if compares_methods(report) and len({r.get("variant") for r in report["rows"]} - {"vanilla"}) > 1:
        console.print(method_comparison_table(report))
    for line in verdict_lines(report) + kernel_lines(report):
        console.print(line, markup=False, highlight=False, soft_wrap=True)
    if (table := fidelity_table(report)) is not None:
        console.print(table)
        for line in fidelity_lines(report):
            console.print(line, markup=False, highlight=False, soft_wrap=True)
    for line in device_map_lines(report):
        console.print(line, markup=False, highlight=False, soft_wrap=True)
    if line := time_line(report):
        console.print(line, markup=False, highlight=False, soft_wrap=True)


def device_map_lines(report: dict[str, Any]) -> list[str]:
    """Under --device-map: the map in one line, then per row the memory of every device (the accountant's
    weights and KV cache there, the measured peak); none for a model on one device."""
    rows = [row for row in report.get("rows", []) if row.get("memory_per_device")]
    if not rows:
        return []
    summary = rows[0].get("device_map") or {}
    per_device = summary.get("weight_bytes_per_device") or {}
    weights = ", ".join(f"{device} {fmt_bytes(n)}" for device, n in per_device.items())
    lines = [f"device map {summary.get('policy')}: computing on {summary.get('main_device') or 'its devices'}; "
             f"weights {weights}"]
    for row in rows:
        parts = []
        for device, entry in row["memory_per_device"].items():
            text = (f"{device}: weights {fmt_bytes(entry.get('weights_bytes'))}, "
                    f"KV {fmt_bytes(entry.get('kv_cache_bytes'))}")
            if entry.get("peak_bytes") is not None:
                text += f", peak {fmt_bytes(entry['peak_bytes'])}"
            parts.append(text)
        label = f"{row.get('variant')} {precision(row)} b{row.get('batch')}"
        lines.append(f"memory per device, {label}: " + "; ".join(parts))
    return lines


# ---- the method comparison (ficoco flops / profile / report with several methods) --------------------------------

COMPARISON_STAGES = (("vision", "vision"), ("projector", "proj"), ("llm", "llm"), ("lm_head", "head"))


def _adaptive_note(row: dict[str, Any]) -> str | None:
    settings = row.get("settings") or {}
    if settings.get("adaptive"):
        return (f"{row['variant']}: adaptive count, planned at {settings.get('tokens')} tokens per item; "
                "ficoco profile measures it")
    return None


def comparison_rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The rows of a flops report (ficoco.flops/1) or a profile report (ficoco.report/1) in one shape:
    variant, quant, batch, visual tokens reaching the LLM, layer average, TFLOPs by stage and in total,
    the method's own work, KV cache, and - from measured rows - latency, speedup and agreement."""
    measured = report.get("schema") != FLOPS_SCHEMA
    rows = []
    for r in report.get("rows") or []:
        source = (r.get("analytic") or {}) if measured else r
        ok = r.get("status") == "ok"
        rows.append({
            "variant": _text(r.get("variant")), "label": _named(r), "quant": r.get("quant"),
            "batch": r.get("batch", report.get("batch")),
            "visual_tokens": source.get("visual_tokens"),
            "layer_average": source.get("layer_average_visual_tokens"),
            "by_stage": source.get("tflops_by_stage") or {}, "tflops": source.get("tflops"),
            "method_tflops": source.get("method_tflops"),
            # A measured row shows the measured cache; an unmeasured one the accountant's.
            "kv_cache_bytes": r.get("kv_cache_bytes") if measured and ok else source.get("kv_cache_bytes"),
            # A flops report's rows name their KV figure and carry the stored one beside it.
            "kv_cache_figure": None if measured else r.get("kv_cache_figure"),
            "kv_cache_stored_bytes": None if measured else r.get("kv_cache_stored_bytes"),
            "median_ms": _get(r, "latency", "median_ms") if ok else None,
            "speedup": r.get("speedup_vs_vanilla") if ok else None,
            "agreement": (_get(r, "fidelity", "top1_agreement") if ok else None),
            "roofline_ms": source.get("roofline_ms"),
            "settings": (r.get("settings") if not measured else None) or {},
            "status": r.get("status") if measured else None,
        })
    return rows


def _comparison_order(rows: list[dict[str, Any]]) -> list[int]:
    """Rows by (quant, batch) in report order, and by total cost within each, cheapest first."""
    groups = list(dict.fromkeys((r["quant"], r["batch"]) for r in rows))

    def key(i: int) -> tuple[int, float]:
        cost = rows[i]["tflops"]
        return groups.index((rows[i]["quant"], rows[i]["batch"])), cost if _is_number(cost) else math.inf

    return sorted(range(len(rows)), key=key)


def comparison_cells(report: dict[str, Any], unit: str = "TFLOPs") -> tuple[list[_Column], list[int], list[str]]:
    """Columns, the row order (cheapest first) and the notes under the method comparison."""
    rows = comparison_rows(report)
    order = _comparison_order(rows)
    vanilla = {(r["quant"], r["batch"]): r["tflops"] for r in rows if r["variant"] == "vanilla"}
    tera = pick_unit([r["tflops"] for r in rows] + [v for r in rows for v in r["by_stage"].values()], tera_units(unit))
    columns = [_Column("method", [r["label"] for r in rows], left=True)]
    if len({r["quant"] for r in rows}) > 1:
        columns.append(_Column("quant", [_text(r["quant"]) for r in rows], left=True))
    if len({r["batch"] for r in rows}) > 1:
        columns.append(_Column("batch", [_text(r["batch"]) for r in rows]))
    columns.append(_Column("visual\ntokens\nto LLM", [_text(r["visual_tokens"]) for r in rows]))
    columns.append(_Column("layer\navg", [f"{a:.1f}" if _is_number(a := r["layer_average"]) else "-" for r in rows]))
    in_scope = set(report.get("scope_stages") or [s for s, _ in COMPARISON_STAGES])
    for stage, short in COMPARISON_STAGES:
        columns.append(_scaled(short + ("" if stage in in_scope else "*"), [r["by_stage"].get(stage) for r in rows],
                               (), tera))
    if any(r["method_tflops"] for r in rows):
        columns.append(_scaled("method+", [r["method_tflops"] for r in rows], (), tera))
    columns.append(_scaled("total", [r["tflops"] for r in rows], (), tera))
    ratios = []
    for r in rows:
        base = vanilla.get((r["quant"], r["batch"]))
        ratios.append(_percent(r["tflops"] / base - 1, signed=True)
                      if r["variant"] != "vanilla" and _is_number(base) and base and _is_number(r["tflops"]) else "-")
    columns.append(_Column("vs\nvanilla\n%", ratios))
    kv_column, kv_notes = _kv_column(rows)
    columns.append(kv_column)
    if stored := _stored_kv_note(rows, [f"{r['variant']} {_text(r['quant'])}" for r in rows]):
        kv_notes.append(stored)
    if any(_is_number(r["roofline_ms"]) for r in rows):
        columns.append(_scaled("roofline", [r["roofline_ms"] for r in rows], (), ("ms", 1.0)))
    if any(r["median_ms"] is not None for r in rows):
        columns.append(_scaled("median", [r["median_ms"] for r in rows], TIME_UNITS_MS))
        columns.append(_Column("speedup", [_ratio(r["speedup"]) for r in rows]))
    if any(r["agreement"] is not None for r in rows):
        columns.append(_Column("top-1\nagrees %", [_percent(r["agreement"]) for r in rows]))
    if any(r["status"] not in (None, "ok") for r in rows):
        columns.append(_Column("status", [_text(r["status"]) for r in rows], left=True))
    notes = ["cheapest first; method+: the method's own matrix work (scores, similarities), not in the total"
             if any(r["method_tflops"] for r in rows) else "cheapest first"]
    if in_scope != {s for s, _ in COMPARISON_STAGES}:
        notes.append("stages marked * are outside the scope and not in the total")
    for r in rows:
        if r["settings"].get("score"):
            notes.append(f"{r['variant']}: scored by the {r['settings']['score']}")
        if note := _adaptive_note(r):
            notes.append(note)
        if isinstance(shape := r["settings"].get("shape"), str):  # a budget's shortened default run
            notes.append(f"{r['variant']}: {shape}")
    return columns, order, list(dict.fromkeys(notes + kv_notes))


def _comparison_title(report: dict[str, Any], unit: str) -> str:
    if report.get("schema") == FLOPS_SCHEMA:
        budget = (f"budget {report['budget_tflops']:g}" if report.get("budget_tflops") is not None
                  else f"preset {report['preset']}" if report.get("preset") is not None
                  else f"keep {report['keep']}" if report.get("keep") is not None else "default settings")
        mode = "equivalent" if report.get("equivalent") else "layer-exact"
        return (f"{report.get('model')}: methods by cost, {budget}; {unit}, convention {report.get('convention')}, "
                f"scope {report.get('scope')} ({mode}), batch {report.get('batch')}, {report.get('text_tokens')} "
                "text tokens")
    config = report.get("config") or {}
    return (f"{_text(config.get('model'))}: methods by cost; analytic TFLOPs (whole model, LM head on the last "
            "token) beside the measured prefill")


def method_comparison_table(report: dict[str, Any], unit: str = "TFLOPs") -> Table:
    """One table of every method, cheapest first: tokens reaching the LLM, the layer average, the cost by
    stage and in total, KV cache, and where the rows were measured, latency, speedup and agreement."""
    columns, order, notes = comparison_cells(report, unit)
    return _table(columns, order, title=_comparison_title(report, unit), caption="; ".join(notes))


def method_comparison_markdown(report: dict[str, Any], unit: str = "TFLOPs") -> str:
    """The method comparison as a markdown table, for a pull request."""
    columns, order, notes = comparison_cells(report, unit)
    header = [" ".join(c.header.split("\n")) for c in columns]
    rows = [[c.cells[i] for c in columns] for i in order]
    return (f"### {_comparison_title(report, unit)}\n\n" + markdown_table(header, rows) + "\n"
            + "".join(f"- {note}\n" for note in notes))


def compares_methods(report: dict[str, Any]) -> bool:
    """Whether a report holds several methods of one quant and batch (what the comparison is for)."""
    rows = report.get("rows") or []
    variants = {r.get("variant") for r in rows}
    return len(variants) > 1 and len({(r.get("quant"), r.get("batch", report.get("batch"))) for r in rows}) == 1


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    """A GitHub markdown table (pipes in cells escaped, one line per row)."""
    def esc(cell: str) -> str:
        return str(cell).replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(esc(h) for h in header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(esc(c) for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


# ---- an evaluated sweep: accuracy against cost (ficoco report / ficoco sweep with eval_tasks) --------------------

RANDOM_WEIGHTS_NOTE = ("RANDOM WEIGHTS: the scores of an untrained model mean nothing (they check the code path, "
                       "not the method's accuracy)")


def _eval_rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    from ficoco.eval.join import eval_rows

    return eval_rows(report)


def _status_cell(row: dict[str, Any]) -> str:
    return {"ok": "ok", "failed": "failed", "missing": "not run"}.get(row["status"], _text(row["status"]))


def eval_cells(report: dict[str, Any]) -> tuple[list[_Column], str, list[str]]:
    """Columns (one row per point, vanilla first in each quant), the title and the notes of the
    accuracy table of an evaluated sweep report (ficoco.eval.join.eval_rows)."""
    from ficoco.eval.join import eval_cost, eval_cost_words, eval_tasks

    rows = _eval_rows(report)
    tasks = eval_tasks(report)
    columns = [_Column("method", [r["method_label"] for r in rows], left=True)]
    if len({r["quant"] for r in rows}) > 1:
        columns.append(_Column("quant", [_text(r["quant"]) for r in rows], left=True))
    columns.append(_Column("budget", [r["budget_label"] for r in rows], left=True))
    for task in tasks:
        columns.append(_Column(f"{task}\nscore", [fmt_num(r["scores"][task]) for r in rows]))
    if len(tasks) > 1:
        columns.append(_Column("mean\nscore", [fmt_num(r["score"]) for r in rows]))
    columns.append(_Column("retained\n% vanilla", [_percent(r["relative_score"]) for r in rows]))
    columns.append(_Column("agrees\n% vanilla", [_percent(r["agreement"]) for r in rows]))
    units = eval_cost(report, rows)[0]
    columns.append(_scaled("cost per\nsample", [r["tflops_mean"] for r in rows], tera_units(units)))
    columns.append(_Column("visual\ntokens", [f"{v:.1f}" if _is_number(v := r["visual_tokens_mean"]) else "-"
                                              for r in rows]))
    columns.append(_scaled("prefill", [r["prefill_ms_mean"] for r in rows], TIME_UNITS_MS))
    if any(r["status"] != "ok" for r in rows):
        columns.append(_Column("status", [_status_cell(r) for r in rows], left=True))
    title = (f"{_text(report.get('model'))}: accuracy (lmms-eval: {', '.join(tasks)}) against cost, "
             f"{eval_cost_words(report, rows)}")
    compared = sorted({r["agreement_samples"] for r in rows if r["status"] == "ok" and r["variant"] != "vanilla"})
    documents = "/".join(str(n) for n in compared) if compared else "-"
    machines = ", ".join(sorted({str(r["timed_on"]) for r in rows if r["timed_on"]}))
    notes = []
    if report.get("random_weights"):
        notes.append(RANDOM_WEIGHTS_NOTE)
    notes += [
        "score: each task's main metric as lmms-eval reports it, on the task's own scale (0-1 or 0-100)"
        + (f"; mean score: over the {len(tasks)} tasks, each on its own scale (a 0-100 task weighs more than a "
           "0-1 one; retained does not depend on the scales)" if len(tasks) > 1 else ""),
        "retained: the score as a share of vanilla's score (same task and quant), mean over the tasks: the "
        "papers' performance retention",
        f"agrees: share of documents whose answer is vanilla's (exact match after stripping white space; "
        f"{documents} documents compared)",
        f"cost per sample: the mean over the evaluated samples ({eval_cost_words(report, rows)}); visual tokens: "
        "mean reaching the LLM; prefill: mean over the evaluation's batches" + (f" on {machines}" if machines else ""),
    ]
    for r in rows:
        if r["status"] == "failed":
            notes.append(f"failed {r['method_label']} {_text(r['quant'])} {r['budget_label']}: "
                         f"{cli_message(r['reason'])}")
    missing = sum(r["status"] == "missing" for r in rows)
    if missing:
        notes.append(f"{missing} of {len(rows)} point(s) not evaluated yet")
    return columns, title, notes


def eval_table(report: dict[str, Any]) -> Table | None:
    """The accuracy of an evaluated sweep against its cost, one line per point (None for a report that
    was not evaluated): method (label), budget, every task's score, the mean score, the retention and
    the answer agreement against vanilla, the cost per sample, visual tokens and prefill time."""
    from ficoco.eval.join import evaluated

    if not evaluated(report):
        return None
    columns, title, notes = eval_cells(report)
    return _table(columns, range(len(columns[0].cells)), title=title, caption="\n".join(notes))


def eval_markdown(report: dict[str, Any]) -> str:
    """The accuracy table of an evaluated sweep as markdown (for a pull request), its notes below."""
    columns, title, notes = eval_cells(report)
    header = [" ".join(c.header.split("\n")) for c in columns]
    rows = [[c.cells[i] for c in columns] for i in range(len(columns[0].cells))]
    return f"### {title}\n\n" + markdown_table(header, rows) + "\n" + "".join(f"- {note}\n" for note in notes)


EVAL_CSV_FIGURES = ("score", "relative_score", "agreement", "agreement_samples", "tflops_mean", "visual_tokens_mean",
                    "prefill_ms_mean", "ttft_ms_mean", "decode_ms_per_token_mean")


def eval_csv(report: dict[str, Any]) -> str:
    """The accuracy table of an evaluated sweep as CSV, every figure at full precision (empty where
    missing): one line per point, a score and a retention column per task."""
    import csv
    import io

    from ficoco.eval.join import eval_tasks

    tasks = eval_tasks(report)
    buffer = io.StringIO()
    writer = csv.writer(buffer)
    writer.writerow(["model", "variant", "method_label", "quant", "budget", "status",
                     *(f"score_{t}" for t in tasks), *(f"retention_{t}" for t in tasks), *EVAL_CSV_FIGURES,
                     "convention", "scope", "units", "timed_on", "reason"])

    def cell(x: Any) -> str:
        return "" if x is None else repr(x) if isinstance(x, float) else str(x)

    for r in _eval_rows(report):
        writer.writerow([cell(report.get("model")), cell(r["variant"]), r["method_label"], cell(r["quant"]),
                         r["budget_label"], r["status"], *(cell(r["scores"][t]) for t in tasks),
                         *(cell(r["retention"][t]) for t in tasks), *(cell(r[k]) for k in EVAL_CSV_FIGURES),
                         cell(r["convention"]), cell(r["scope"]), cell(r["units"]), cell(r["timed_on"]),
                         r["reason"]])
    return buffer.getvalue()


def print_evaluated_sweep(console: Console, report: dict[str, Any], fmt: str = "table") -> bool:
    """An evaluated sweep's accuracy table on `console`: as a table (under the sweep's own table), or as
    markdown or CSV (plain text, nothing else printed with it: `ficoco report --format`). False, and
    nothing printed, for a report that was not evaluated (its config names no eval_tasks)."""
    table = eval_table(report)
    if table is None:
        return False
    if fmt == "table":
        console.print(table)
    else:  # the text as it is (CSV's line ends included), as `ficoco report --format` writes a profile's
        console.file.write(eval_markdown(report) if fmt == "markdown" else eval_csv(report))
    return True
