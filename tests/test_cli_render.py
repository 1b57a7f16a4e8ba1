"""The first screen of the main job (issue 17): the profile and flops tables fit 80 columns without
cutting a figure, and a verdict line per reduced row says the result in words.

Renderers are checked in-process on report dicts (a hand-made report shaped like the README's main
job, whose every figure is known here, and the reference report in `reports/`), then as a person
sees them: `ficoco report` and `ficoco flops` in a pseudo-terminal (always), in real tmux panes
of 80, 120 and 200 columns (skipped only without tmux), and in a pipe.
"""

from __future__ import annotations

import copy
import fcntl
import io
import json
import os
import pty
import re
import shlex
import shutil
import struct
import subprocess
import termios
import time
from pathlib import Path
from typing import Any

import pytest
from helpers import COMMAND
from rich.console import Console

from ficoco.report.precision import precision
from ficoco_cli.render import (
    fmt_num,
    pick_unit,
    profile_table,
    verdict_lines,
)

REFERENCE = Path(__file__).resolve().parents[1] / "reports" / "llava-tiny-cpu.json"
ELLIPSIS = "\u2026"


# ---- a report shaped like the main job: LLaVA-1.5-7B, vanilla and FiCoCo-V, bf16 on CPU ----------------------

def _row(variant: str, tokens: int, tflops: float, samples_ms: list[float], peak_bytes: int, kv_bytes: int
         ) -> dict[str, Any]:
    ordered = sorted(samples_ms)
    median = ordered[len(ordered) // 2]
    return {
        "model": "llava-1.5-7b", "variant": variant, "quant": "fp16", "batch": 1, "text_tokens": 60,
        "new_tokens": 0, "device_kind": "cpu", "schedule": [],
        "backend": {"compute_dtype": "bfloat16", "quant": "fp16", "backend": "torch", "scheme": "torch.bfloat16"},
        "note": "16-bit on CPU computes in bfloat16 (fp16 matrix work is ~15x slower there)",
        "analytic": {"tflops": tflops, "kv_cache_bytes": kv_bytes, "weight_bytes": 14.1e9, "visual_tokens": tokens,
                     "roofline_ms": None},
        "threads": 2, "status": "ok",
        "latency": {"median_ms": median, "p90_ms": ordered[-1], "min_ms": ordered[0], "stdev_ms": 100.0,
                    "samples_ms": samples_ms, "timer": "perf_counter"},
        "images_per_s": 1e3 / median,
        "memory": {"method": "process peak RSS (VmHWM)", "peak_rss_bytes": peak_bytes, "peak_bytes": peak_bytes},
        "kv_cache_bytes": kv_bytes, "reduction_ms": 40.0, "reduction_share": 40.0 / median, "generation": None,
        "achieved_tflops_per_s": tflops / (median / 1e3), "measured_over_roofline": None,
    }


def _compare(rows: list[dict[str, Any]]) -> None:
    """The comparisons `ficoco profile` adds (ficoco.report.add_comparisons)."""
    base = rows[0]
    for row in rows:
        row["speedup_vs_vanilla"] = base["latency"]["median_ms"] / row["latency"]["median_ms"]
        row["flops_ratio_vs_vanilla"] = base["analytic"]["tflops"] / row["analytic"]["tflops"]
        row["memory_saving_vs_vanilla"] = 1 - row["memory"]["peak_bytes"] / base["memory"]["peak_bytes"]


def main_job() -> dict[str, Any]:
    rows = [_row("vanilla", 576, 9.005, [19300.0, 19400.0, 19700.0], 16_020_000_000, 333_447_168),
            _row("v", 53, 1.801, [3500.0, 3527.0, 3560.0], 15_780_000_000, 59_010_000)]
    _compare(rows)
    return {
        "schema": "ficoco.report/1", "created": "2026-01-01T00:00:00+00:00",
        "environment": {"device_kind": "cpu", "device": "Intel(R) Xeon(R) Processor", "threads": 2},
        "config": {"model": "llava-1.5-7b", "variants": ["vanilla", "v"], "repeat": 3, "warmup": 1,
                   "new_tokens": 0, "device": "auto", "quants": ["fp16"], "batches": [1]},
        "rows": rows,
    }


# Every figure of the default table, per row, in column order (hand-checked against the rows above).
MAIN_JOB_CELLS = {
    "vanilla": ["576", "9.005", "19.40", "1.00x", "(1.00x)", "16.02", "333.4", "ok"],
    "v": ["53", "1.801", "3.527", "5.50x", "(5.00x)", "15.78", "59.01", "ok"],
}
MAIN_JOB_UNITS = ["TFLOPs", "s", "GB", "MB"]
MAIN_JOB_VERDICT = ("v: 53 visual tokens, prefill 5.5x faster (FLOPs 5.0x fewer), KV cache 59.01 MB instead of "
                    "333.4 MB, peak memory -1.5 %; caution: CPU fallback (--device auto found no GPU); computed in "
                    "bfloat16, not float16, for speed on CPU")

# `ficoco flops --model llava-1.5-7b --variant vanilla,v,l --keep 64 --quant fp16,int4 --gpu a100-80gb`: its
# widest default table (a quant column and the roofline). Figures: total TFLOPs, KV cache, roofline ms.
FLOPS_ARGS = ["flops", "--model", "llava-1.5-7b", "--variant", "vanilla,v,l", "--keep", "64", "--quant",
              "fp16,int4", "--gpu", "a100-80gb"]
FLOPS_CELLS = {
    ("vanilla", "fp16"): ["576", "8.617", "333.4", "29.38"], ("vanilla", "int4"): ["576", "8.617", "93.78", "14.00"],
    ("v", "fp16"): ["64", "1.647", "-80.9", "65.01", "7.086"], ("v", "int4"): ["64", "1.647", "-80.9", "18.28"],
    ("l", "fp16"): ["64", "5.406", "-37.3", "218.9", "18.67"], ("l", "int4"): ["64", "5.406", "-37.3", "61.56"],
}


def rendered(renderable: Any, width: int) -> str:
    console = Console(width=width, file=io.StringIO(), record=True)
    console.print(renderable)
    return console.export_text()


def row_line(text: str, *first: str) -> str:
    """The one line whose first words are `first` (a table row)."""
    (line,) = [line for line in text.splitlines() if line.split()[: len(first)] == list(first)]
    return line


def assert_cells(line: str, cells: list[str]) -> None:
    """Every figure is in the row as a whole word, in column order: none cut, none missing."""
    words = line.split()
    at = 0
    for cell in cells:
        assert cell in words[at:], (cell, line)
        at = words.index(cell, at) + 1


def assert_main_job_table(text: str) -> None:
    """No cell cut, every figure there, every column's unit in the header."""
    assert ELLIPSIS not in text
    for variant, cells in MAIN_JOB_CELLS.items():
        assert_cells(row_line(text, variant), cells)
    header = text.splitlines()[:8]
    for unit in MAIN_JOB_UNITS:
        assert any(unit in line.split() for line in header), unit


def assert_main_job_screen(text: str) -> None:
    """The table, then the verdict as one (logical) line."""
    assert_main_job_table(text)
    assert MAIN_JOB_VERDICT in [line.rstrip() for line in text.splitlines()]


# ---- formatting ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("value, text", [
    (8.6172, "8.617"), (19.4, "19.40"), (333.46, "333.5"), (1234.6, "1,235"), (0.0326, "0.0326"),
    (0.00268, "0.00268"), (0, "0"), (None, "-"), (float("nan"), "nan"), ("12", "-"),
])
def test_figures_have_about_four_significant_digits_and_no_exponent(value, text):
    assert fmt_num(value) == text


def test_a_column_takes_the_largest_unit_its_largest_figure_reads_at_least_1_in():
    units = (("GB", 1e9), ("MB", 1e6), ("kB", 1e3), ("B", 1.0))
    assert pick_unit([333e6, 59e6, None], units) == ("MB", 1e6)
    assert pick_unit([16e9, 333e6], units) == ("GB", 1e9)
    assert pick_unit([None, float("nan")], units) == ("B", 1.0)
    assert pick_unit([19_400.0, 3527.0], (("s", 1e3), ("ms", 1.0))) == ("s", 1e3)


# ---- the tables in a console of a given width ---------------------------------------------------------------

def test_main_job_table_is_at_most_80_columns_even_in_a_wide_console():
    text = rendered(profile_table(main_job()), 200)
    assert max(len(line.rstrip()) for line in text.splitlines()) <= 80  # title and caption wrap to the table
    assert_main_job_table(text)


@pytest.mark.parametrize("predicted", [True, False], ids=["predicted", "made-before-the-prediction"])
@pytest.mark.parametrize("width", [80, 120])
def test_reference_report_table_fits_with_every_figure(width, predicted):
    report = json.loads(REFERENCE.read_text())
    assert all("predicted_speedup_vs_vanilla" in row for row in report["rows"])
    if not predicted:  # a report from before the prediction: the speedup and the FLOPs ratio alone
        for row in report["rows"]:
            row.pop("predicted_speedup_vs_vanilla")
    text = rendered(profile_table(report), width)
    assert ELLIPSIS not in text
    assert max(len(line.rstrip()) for line in text.splitlines()) <= min(width, 80)
    for quant in ("fp16", "int8", "int4"):  # each group under its precision (the unquantized rows' dtype)
        label = precision(next(r for r in report["rows"] if r["quant"] == quant))
        start = [line.rstrip() for line in text.splitlines()].index(label)
        for offset, row in enumerate(r for r in report["rows"] if r["quant"] == quant):
            line = text.splitlines()[start + 1 + offset]
            speedup, ratio = row["speedup_vs_vanilla"], row["flops_ratio_vs_vanilla"]
            if predicted:
                figures = [f"{speedup:.2f}x", f"({row['predicted_speedup_vs_vanilla']:.2f},", f"{ratio:.2f})"]
            else:
                figures = [f"{speedup:.2f}x", f"({ratio:.2f}x)"]
            assert_cells(line, [row["variant"], str(row["analytic"]["visual_tokens"]), *figures, "ok"])


def test_wide_table_shows_every_column():
    report = json.loads(REFERENCE.read_text())
    text = rendered(profile_table(report, wide=True), 220)
    assert ELLIPSIS not in text
    for header in ("quant", "dtype", "batch", "p90", "min", "stdev", "timed", "img/s", "achieved", "method",
                   "speedup", "ratio", "saving %", "KV measured", "KV analytic"):
        assert header in text, header
    vanilla = report["rows"][0]
    latency = vanilla["latency"]
    assert_cells(row_line(text, "vanilla", "fp16"),
                 ["bfloat16", "1", "64", "ok", fmt_num(latency["median_ms"]), fmt_num(latency["p90_ms"]), "7"])


def test_a_console_narrower_than_the_wide_table_folds_figures_instead_of_cutting_them():
    text = rendered(profile_table(json.loads(REFERENCE.read_text()), wide=True), 80)
    assert ELLIPSIS not in text
    assert max(len(line) for line in text.splitlines()) <= 80


# ---- verdict lines ------------------------------------------------------------------------------------------

def test_main_job_verdict_says_the_result_and_its_caveats_in_words():
    assert verdict_lines(main_job()) == [MAIN_JOB_VERDICT]


def test_an_explicit_cpu_run_is_not_called_a_fallback():
    report = main_job()
    report["config"]["device"] = "cpu"
    (line,) = verdict_lines(report)
    assert "fallback" not in line and "bfloat16" in line


def test_a_row_with_its_dtypes_names_them_and_why():
    report = main_job()
    reason = "auto: float32 is the fastest on this CPU (AVX2; matmul GFLOP/s float32 103, float16 25, bfloat16 20)"
    for row in report["rows"]:
        row["note"] = None
        row["backend"].update(compute_dtype="float32", storage_dtype="bfloat16 (upcast linears), float32 rest",
                              dtype_reason=reason)
    (line,) = verdict_lines(report)
    assert line.endswith(f"computed in float32, weights stored as bfloat16 (upcast linears), float32 rest: {reason}")


def test_a_plain_float16_row_has_no_dtype_caveat():
    report = main_job()
    for row in report["rows"]:
        row["note"] = None
        row["backend"].update(compute_dtype="float16", storage_dtype="float16", dtype_reason="auto on CUDA: float16")
    (line,) = verdict_lines(report)
    assert "computed in" not in line and "float16" not in line


def test_few_and_noisy_timed_runs_are_named_for_the_row_and_its_vanilla():
    report = main_job()
    vanilla, v = report["rows"]
    v["latency"].update(samples_ms=[3000.0, 4000.0], median_ms=3500.0, p90_ms=4000.0, stdev_ms=707.0)
    vanilla["latency"].update(stdev_ms=2500.0)
    (line,) = verdict_lines(report)
    assert "only 2 timed runs" in line
    assert "noisy timing (stdev/median 20 %)" in line  # p90/median 1.14 is under its threshold
    assert "noisy vanilla timing (stdev/median 13 %)" in line


def test_a_slower_row_says_slower():
    report = main_job()
    report["rows"][1]["speedup_vs_vanilla"] = 0.78
    assert "prefill 1.28x slower (FLOPs 5.0x fewer)" in verdict_lines(report)[0]


def test_a_row_not_measured_is_named_with_its_reason_and_shows_dashes():
    report = main_job()
    v = report["rows"][1]
    for key in ("latency", "memory", "kv_cache_bytes", "images_per_s", "speedup_vs_vanilla"):
        v.pop(key)
    v.update(status="oom", reason="OutOfMemoryError: CUDA out of memory")
    (line,) = verdict_lines(report)
    assert line == ("v: not measured (oom: OutOfMemoryError: CUDA out of memory); by the accountant: 53 visual tokens, "
                    "1.801 TFLOPs, KV cache 59.01 MB")
    text = rendered(profile_table(report), 80)
    assert row_line(text, "v").split() == ["v", "53", "1.801", "-", "-", "-", "-", "oom"]


def test_a_vanilla_row_not_measured_leaves_the_others_without_a_speedup():
    report = main_job()
    vanilla, v = report["rows"]
    vanilla.update(status="oom", reason="out of memory")
    for key in ("speedup_vs_vanilla", "flops_ratio_vs_vanilla", "memory_saving_vs_vanilla"):
        v[key] = None
    lines = verdict_lines(report)
    assert lines[0] == "vanilla: not measured (oom: out of memory); the rows of its quant and batch have no speedup"
    assert lines[1].startswith("v: 53 visual tokens, prefill 3.527 s, KV cache 59.01 MB, peak memory 15.78 GB, "
                               "no measured vanilla row of its quant and batch to compare with")


def test_rows_of_an_older_report_without_newer_fields_render_dashes():
    report = main_job()
    for row in report["rows"]:
        for key in ("backend", "memory", "flops_ratio_vs_vanilla", "note", "kv_cache_bytes", "device_kind"):
            row.pop(key)
        row["latency"].pop("samples_ms")
    del report["environment"], report["config"]
    text = rendered(profile_table(report), 80)
    assert row_line(text, "v").split() == ["v", "53", "1.801", "3.527", "5.50x", "(-)", "-", "-", "ok"]
    (line,) = verdict_lines(report)
    assert line == "v: 53 visual tokens, prefill 5.5x faster"


def test_several_quants_name_the_row_in_its_verdict():
    report = main_job()
    int8 = copy.deepcopy(report["rows"])
    for row in int8:
        row["quant"] = "int8"
    report["rows"] += int8
    # The unquantized row ran in bfloat16: named bf16, not by its quant's name.
    assert report["rows"][0]["backend"]["compute_dtype"] == "bfloat16"
    assert [line.split(":")[0] for line in verdict_lines(report)] == ["v bf16 batch 1", "v int8 batch 1"]


# ---- as a person sees it: a pseudo-terminal (always), tmux panes, a pipe ---------------------------------------

@pytest.fixture(scope="module")
def main_job_path(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("screen") / "main-job.json"
    path.write_text(json.dumps(main_job()))
    return path


def terminal_env() -> dict[str, str]:
    # rich takes COLUMNS / LINES over the terminal's real size: the terminal must decide here.
    return {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")} | {"TERM": "xterm-256color"}


def in_pty(args: list[str], columns: int) -> str:
    """The command's output in a pseudo-terminal of `columns` columns, escape sequences removed."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, columns, 0, 0))
    proc = subprocess.Popen([*COMMAND, *args], stdin=slave, stdout=slave, stderr=slave, env=terminal_env())
    os.close(slave)
    chunks = []
    try:
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: the child closed the terminal
                break
            if not data:
                break
            chunks.append(data)
    finally:
        os.close(master)
        proc.wait(timeout=60)
    assert proc.returncode == 0
    text = b"".join(chunks).decode().replace("\r\n", "\n")
    return re.sub(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07\x1b]*(\x07|\x1b\\)", "", text)


def test_main_job_in_an_80_column_terminal(main_job_path):
    text = in_pty(["report", str(main_job_path)], 80)
    assert max(len(line) for line in text.splitlines() if line != MAIN_JOB_VERDICT) <= 80
    assert_main_job_screen(text)


def test_flops_in_an_80_column_terminal():
    text = in_pty(FLOPS_ARGS, 80)
    assert ELLIPSIS not in text and max(len(line) for line in text.splitlines()) <= 80
    for (variant, quant), cells in FLOPS_CELLS.items():
        assert_cells(row_line(text, variant, quant), cells)


# The same table under --convention llm-viewer with all three quants: the KV column is LLM-Viewer's figure (values x
# bits / 8), the stored one is named under the table. Figures: total TOPs, KV viewer, roofline ms.
VIEWER_ARGS = ["flops", "--model", "llava-1.5-7b", "--variant", "vanilla,v,l", "--keep", "64", "--quant",
               "fp16,int8,int4", "--gpu", "a100-80gb", "--convention", "llm-viewer"]
VIEWER_CELLS = {
    ("vanilla", "fp16"): ["576", "8.453", "333.4", "29.38"], ("vanilla", "int8"): ["576", "8.453", "166.7", "14.69"],
    ("vanilla", "int4"): ["576", "8.453", "83.36", "14.00"], ("v", "int8"): ["64", "1.615", "-80.9", "32.51"],
    ("l", "int4"): ["64", "357.5", "5.376", "-36.4", "54.72"],
}


def test_llm_viewer_flops_table_names_its_kv_figure_in_an_80_column_terminal():
    text = in_pty(VIEWER_ARGS, 80)
    assert ELLIPSIS not in text and max(len(line) for line in text.splitlines()) <= 80
    for (variant, quant), cells in VIEWER_CELLS.items():
        assert_cells(row_line(text, variant, quant), cells)
    lines = text.splitlines()
    (at,) = [i for i, line in enumerate(lines) if line.split()[-4:] == ["viewer", "weights", "access", "roofline"]]
    assert lines[at - 1].split()[-2:] == ["KV", "mem"]  # the header reads "KV viewer"
    words = " ".join(text.split())
    assert "KV viewer: LLM-Viewer's KV cache, values x KV bits / 8 (no scales or zero points)" in words
    assert ("KV stored (kv_cache_stored_bytes: codes and a 16-bit scale and zero point per group, as ficoco profile "
            "measures it): vanilla int8 177.1 MB, vanilla int4 93.78 MB, v int8 34.54 MB") in words
    assert "vanilla fp16 333.4" not in words  # unquantized, the two figures are one


def test_widest_llm_viewer_table_fits_80_columns_unsqueezed(flops_report):
    """In a wide console a table takes its natural width: within 80 columns nothing needs folding in a terminal."""
    from ficoco_cli.render import flops_table

    report = flops_report(*VIEWER_ARGS[1:])
    text = rendered(flops_table(report, report["units"], True), 200)
    assert max(len(line.rstrip()) for line in text.splitlines()) <= 80
    assert any(line.split()[-4:] == ["viewer", "weights", "access", "roofline"] for line in text.splitlines())


def test_wide_llm_viewer_table_has_a_stored_kv_column(flops_report):
    from ficoco_cli.render import flops_table

    report = flops_report(*VIEWER_ARGS[1:])
    text = rendered(flops_table(report, report["units"], True, wide=True), 220)
    assert_cells(row_line(text, "vanilla", "int8"), ["576", "8.453", "166.7", "177.1", "7.007"])
    assert_cells(row_line(text, "vanilla", "fp16"), ["576", "8.453", "333.4", "333.4", "13.48"])
    assert "KV stored: the KV cache as transformers holds it" in " ".join(text.split())


def test_main_job_in_a_pipe_keeps_the_table_and_one_line_per_verdict(main_job_path, cli):
    result = cli("report", main_job_path, in_subprocess=True, timeout=60)
    assert result.code == 0 and result.err == ""
    assert_main_job_screen(result.out)


def test_wide_in_a_pipe_is_not_cut(cli):
    result = cli("report", REFERENCE, "--wide", in_subprocess=True, timeout=60)
    assert result.code == 0
    assert ELLIPSIS not in result.out
    assert "KV analytic" in result.out and "stdev" in result.out


def tmux_capture(args: list[str], columns: int) -> str:
    """Run the command in a detached tmux pane of `columns` columns (a private server) and capture what the
    pane shows, history included, with wrapped lines joined (-J) as a person would copy them."""
    socket = f"ficoco-test-{os.getpid()}-{columns}"
    sentinel = "__ficoco_screen_done__"
    shell = f"{shlex.join([*COMMAND, *args])}; echo {sentinel}; sleep 120"
    tmux = ["tmux", "-L", socket, "-f", "/dev/null"]
    env = terminal_env()
    subprocess.run([*tmux, "new-session", "-d", "-x", str(columns), "-y", "50", shell], check=True, env=env,
                   timeout=30)
    try:
        deadline = time.monotonic() + 60
        while True:
            shown = subprocess.run([*tmux, "capture-pane", "-p", "-J", "-S", "-"], capture_output=True, text=True,
                                   env=env, timeout=30).stdout
            if sentinel in shown or time.monotonic() > deadline:
                break
            time.sleep(0.1)
    finally:
        subprocess.run([*tmux, "kill-server"], capture_output=True, env=env, timeout=30)
    assert sentinel in shown, shown
    return shown.split(sentinel)[0]


needs_tmux = pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed (the pty tests still "
                                                                      "check an 80-column terminal)")


@needs_tmux
@pytest.mark.parametrize("columns", [80, 120, 200])
def test_main_job_in_tmux(main_job_path, columns):
    text = tmux_capture(["report", str(main_job_path)], columns)
    assert_main_job_screen(text)


@needs_tmux
@pytest.mark.parametrize("columns", [80, 120, 200])
def test_flops_in_tmux(columns):
    text = tmux_capture(FLOPS_ARGS, columns)
    assert ELLIPSIS not in text
    for (variant, quant), cells in FLOPS_CELLS.items():
        assert_cells(row_line(text, variant, quant), cells)


@needs_tmux
def test_reference_report_in_an_80_column_tmux_pane():
    report = json.loads(REFERENCE.read_text())
    text = tmux_capture(["report", str(REFERENCE)], 80)
    assert ELLIPSIS not in text
    lines = [line.rstrip() for line in text.splitlines()]
    for quant in ("fp16", "int8", "int4"):
        start = lines.index(precision(next(r for r in report["rows"] if r["quant"] == quant)))
        rows = [r for r in report["rows"] if r["quant"] == quant]
        for offset, row in enumerate(rows):
            assert_cells(lines[start + 1 + offset], [row["variant"], str(row["analytic"]["visual_tokens"]),
                                                     f"{row['speedup_vs_vanilla']:.2f}x", "ok"])
    verdicts = [line for line in lines if re.match(r"[vl] int[48] batch 1: |[vl] (bf16|fp16|fp32) batch 1: ", line)]
    assert len(verdicts) == 6 and all("visual tokens, prefill" in line for line in verdicts)


@pytest.mark.parametrize(("row_ms", "own_ms", "words"), [
    # Vanilla 19400 ms; the row's model time without its work is row_ms - own_ms.
    (19500.0, 500.0, "its own work (500.0 ms) eats what its fewer tokens save (400.0 ms)"),
    (3527.0, 1747.0, "its own work (1,747 ms) takes 9.9 % of the 17,620 ms its fewer tokens save"),
    (19500.0, 50.0, "its fewer tokens save no measurable time and its own work adds 50.00 ms"),
])
def test_verdict_says_when_the_methods_own_work_eats_its_savings(row_ms: float, own_ms: float, words: str) -> None:
    from ficoco.report import own_work_vs_savings

    report = main_job()
    vanilla, row = report["rows"]
    row["latency"]["median_ms"], row["reduction_ms"] = row_ms, own_ms
    row["own_work_vs_savings"] = own_work_vs_savings(row, vanilla)
    saved = vanilla["latency"]["median_ms"] - (row_ms - own_ms)
    assert row["own_work_vs_savings"] == {"own_ms": own_ms, "saved_ms": saved, "eats_savings": own_ms >= saved,
                                          "reads_share_predicted": None}
    assert own_work_vs_savings(vanilla, vanilla) is None
    (line,) = [line for line in verdict_lines(report) if line.startswith("v:")]
    assert words in line, line


# ---- the predicted speedup beside the measured one and the FLOPs ratio (profiling/predict.py) -----------------

def predicted_main_job() -> dict[str, Any]:
    """The main job with each row's prefill predicted at this machine's rates (ficoco.report.add_comparisons)."""
    report = main_job()
    vanilla, v = report["rows"]
    vanilla["predicted_ms"], v["predicted_ms"] = 19000.0, 5000.0
    for row in (vanilla, v):
        row["predicted_speedup_vs_vanilla"] = vanilla["predicted_ms"] / row["predicted_ms"]
        row["measured_over_predicted"] = row["latency"]["median_ms"] / row["predicted_ms"]
    return report


def test_the_table_shows_the_predicted_speedup_beside_the_measured_one_within_80_columns():
    text = rendered(profile_table(predicted_main_job()), 200)
    assert max(len(line.rstrip()) for line in text.splitlines()) <= 80
    assert ELLIPSIS not in text
    assert_cells(row_line(text, "v"), ["53", "1.801", "3.527", "5.50x", "(3.80,", "5.00)", "15.78", "59.01", "ok"])
    assert "(pred.," in text and "speedup (pred., FLOPs)" in " ".join(text.split())


def test_the_wide_table_shows_the_predicted_time_and_speedup():
    text = rendered(profile_table(predicted_main_job(), wide=True), 260)
    assert "pred." in text
    # speedup, predicted speedup, FLOPs ratio (the predicted time and measured / predicted are in the JSON)
    assert_cells(row_line(text, "v", "fp16"), ["5.50x", "3.80x", "5.00x"])


def test_the_verdict_says_the_predicted_speedup_beside_the_flops_ratio():
    (line,) = verdict_lines(predicted_main_job())
    assert line.startswith("v: 53 visual tokens, prefill 5.5x faster (predicted 3.8x at this machine's rates; "
                           "FLOPs 5.0x fewer), ")
    report = predicted_main_job()
    report["rows"][1]["predicted_speedup_vs_vanilla"] = 0.8
    assert "(predicted 1.25x slower at this machine's rates; FLOPs 5.0x fewer)" in verdict_lines(report)[0]


def test_the_verdict_says_when_the_machines_speed_moved_while_a_row_ran():
    report = predicted_main_job()
    vanilla, v = report["rows"]
    v["predicted"] = {"spread": 0.45}
    vanilla["predicted"] = {"spread": 0.1}
    (line,) = verdict_lines(report)
    assert "this machine's speed moved while this row ran (the prediction at each pass of its rate probe spread " \
           "by 45 %)" in line
    assert "while the vanilla row ran" not in line
    vanilla["predicted"] = {"spread": 0.3}
    assert "while the vanilla row ran" in verdict_lines(report)[0]


def test_own_work_says_what_the_methods_reads_alone_take_at_the_machines_rates() -> None:
    """The floor under a method's own work: its predicted reads against its predicted savings (FiCoCo-L's reads
    of every decoder layer from the fourth, on a model whose layers cost little per token, take more of what it
    saves than any faster step could give back)."""
    from ficoco.report import own_work_vs_savings

    report = main_job()
    vanilla, row = report["rows"]
    vanilla["predicted"] = {"prefill_ms": 10_000.0, "probe_ms": 0.0, "method_ms": 0.0}
    # Predicted 8,000 ms with 300 ms of reads and 100 of steps priced: its fewer tokens save 2,400 ms.
    row["predicted"] = {"prefill_ms": 8_000.0, "probe_ms": 300.0, "method_ms": 100.0}
    row["latency"]["median_ms"], row["reduction_ms"] = 8_500.0, 450.0
    row["own_work_vs_savings"] = own_work_vs_savings(row, vanilla)
    assert row["own_work_vs_savings"]["reads_share_predicted"] == pytest.approx(300 / 2_400)
    (line,) = [line for line in verdict_lines(report) if line.startswith("v:")]
    assert "its reads of attention alone 12 % of its savings, predicted" in line, line
    # A method that reads nothing has no floor; nor has a row without a prediction.
    row["predicted"]["probe_ms"] = 0.0
    assert own_work_vs_savings(row, vanilla)["reads_share_predicted"] is None
    del vanilla["predicted"]
    row["predicted"]["probe_ms"] = 300.0
    assert own_work_vs_savings(row, vanilla)["reads_share_predicted"] is None
