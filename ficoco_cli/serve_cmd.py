"""`ficoco serve-bench` and the serving reports' rendering: wires options to `ficoco.serving.vllm.bench` (in vLLM's
own venv) and renders `ficoco.serve/1` reports as a table, markdown or CSV, and a figure."""

from __future__ import annotations

import csv
import io
from pathlib import Path
from typing import Any

from rich.table import Table

from ficoco.errors import FicocoError

COLUMNS = ("variant", "concurrency", "visual tokens", "TFLOPs", "TTFT p50 ms", "TTFT p90 ms", "requests/s",
           "output tok/s", "vs vanilla")


def _cells(row: dict[str, Any]) -> list[str]:
    ratio = row.get("vs_vanilla")
    return [str(row["variant"]), str(row["concurrency"]), str(row["visual_tokens_per_request"]),
            "-" if row["tflops_per_request"] is None else f"{row['tflops_per_request']:.4g}",
            f"{row['ttft_p50_s'] * 1000:.1f}", f"{row['ttft_p90_s'] * 1000:.1f}",
            f"{row['requests_per_s']:.2f}", f"{row['output_tokens_per_s']:.1f}",
            "-" if ratio is None else f"{ratio:.2f}x"]


def _title(report: dict[str, Any]) -> str:
    config, env = report.get("config") or {}, report.get("environment") or {}
    images = config.get("image_processor") or config.get("video_processor") or {}
    what = f"videos of {config['frames']} frames" if config.get("frames") else "images"
    resized = f", {what} resized by {images['class']} ({images['backend']})" if images else ""
    evs = report.get("evs")
    if evs:
        resized += f", EVS video_pruning_rate {evs['video_pruning_rate']:.4f}"
    served = f", through {report['launcher'].split(' (')[0]}" if report.get("launcher") else ""
    return (f"{Path(str(config.get('model', ''))).name}: vLLM {env.get('vllm', '?')} on {env.get('device', '?')}, "
            f"{config.get('requests')} requests per level, {config.get('new_tokens')} new tokens each, "
            f"{config.get('dtype')}{resized}{served}")


def serve_table(report: dict[str, Any]) -> Table:
    """One line per variant and concurrency level; throughput against vanilla's at the same level."""
    from ficoco.report.serve import table_rows

    table = Table(title=_title(report), title_justify="left", caption=report.get("note"), caption_justify="left")
    for name in COLUMNS:
        table.add_column(name, justify="left" if name == "variant" else "right")
    for row in table_rows(report):
        table.add_row(*_cells(row))
    return table


def serve_markdown(report: dict[str, Any]) -> str:
    from ficoco.report.serve import table_rows

    lines = [f"{_title(report)}", "", "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(_cells(row)) + " |" for row in table_rows(report)]
    return "\n".join(lines) + f"\n\n{report.get('note', '')}\n"


def serve_csv(report: dict[str, Any]) -> str:
    from ficoco.report.serve import ROW_FIELDS, table_rows

    buffer = io.StringIO()
    writer = csv.writer(buffer)
    writer.writerow([*ROW_FIELDS, "vs_vanilla"])
    for row in table_rows(report):
        writer.writerow([row[name] for name in (*ROW_FIELDS, "vs_vanilla")])
    return buffer.getvalue()


def draw_serve(report: dict[str, Any], folder: str) -> list[str]:
    """The throughput figure (requests/s and TTFT against concurrency, one line per variant)."""
    from ficoco.sweep.figures import save_figure, serve_figure

    return save_figure(serve_figure(report), folder, "serve_throughput")


def run_serve_bench(config: Any, progress: Any) -> dict[str, Any]:
    """The benchmark, in vLLM's venv; one line where the checkpoint is no folder or vLLM is not installed."""
    if not Path(config.model).is_dir():
        raise FicocoError(f"--model {config.model}: give a local checkpoint folder (vLLM loads its weights)")
    try:
        import vllm  # noqa: F401
    except ImportError:
        raise FicocoError(f"--model {config.model}: serve-bench runs in vLLM's own venv, where vllm is installed "
                          "(bash benchmarks/vllm_env.sh builds it; docs/serving.md)") from None
    import torch

    from ficoco.profiling.environment import environment
    from ficoco.report.schemas import SERVE_SCHEMA
    from ficoco.serving.vllm.bench import run_bench

    body = run_bench(config, progress)
    # vLLM picks its device by its platform; the environment names the GPU where torch sees one.
    env = environment(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    env["vllm"] = body.pop("vllm")
    return {"schema": SERVE_SCHEMA, **body, "environment": env}
