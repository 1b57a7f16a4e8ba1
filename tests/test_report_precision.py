"""Every place a user reads a profile row names the dtype that ran: an unquantized row (ficoco's quant "fp16")
that computed in bfloat16 is "bf16", in float32 "fp32"; quantized rows keep int8 / int4."""

from __future__ import annotations

import pytest

from ficoco.report.precision import precision, precision_of


@pytest.mark.parametrize(("quant", "compute", "shown"), [
    ("fp16", "bfloat16", "bf16"), ("fp16", "torch.bfloat16", "bf16"), ("fp16", "float32", "fp32"),
    ("fp16", "float16", "fp16"), ("int8", "bfloat16", "int8"), ("int4", "float32", "int4"),
    ("fp16", None, "fp16"),  # a report that does not say which dtype ran keeps its quant's name
])
def test_a_rows_precision_is_the_dtype_that_ran(quant: str, compute: str | None, shown: str) -> None:
    assert precision_of(quant, compute) == shown
    row = {"quant": quant, "backend": {"compute_dtype": compute} if compute else None}
    assert precision(row) == shown


def test_a_bf16_cpu_row_is_shown_as_bf16_in_the_table_verdicts_and_check_lines(tmp_path, cli) -> None:
    import json
    import subprocess
    import sys
    from pathlib import Path

    path = "reports/archive/cpu-2026-xeon/qwen3-vl-8b.json"  # AMX, bfloat16
    report = json.loads(Path(path).read_text())
    assert report["rows"][0]["backend"]["compute_dtype"] == "bfloat16" and report["rows"][0]["quant"] == "fp16"
    shown = cli("report", path)
    assert shown.code == 0 and "prefill, bf16, batch 1" in " ".join(shown.out.split())
    assert "fp16" not in shown.out
    checked = subprocess.run([sys.executable, "benchmarks/check_report.py", path, "cpu"],
                             capture_output=True, text=True)
    tags = [line.split()[:2] for line in checked.stdout.splitlines() if line.startswith("  ")]
    assert tags and all(tag[1] == "bf16" for tag in tags)
