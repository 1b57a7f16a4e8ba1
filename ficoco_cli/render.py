"""Rich tables for the commands. Rendering only: every figure arrives computed."""

from __future__ import annotations

from typing import Any

from rich.table import Table


def fmt_bytes(n: float | None) -> str:
    """Decimal units (1e6 / 1e9), as the reports use."""
    if n is None:
        return "-"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def fmt_count(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(n)


def fmt_tera(x: float) -> str:
    return f"{x:.4f}" if x < 0.1 else f"{x:.3f}"


def models_table(rows: list[dict[str, Any]]) -> Table:
    table = Table(title="Model profiles", title_justify="left")
    for col, justify in (("profile", "left"), ("family", "left"), ("parameters", "right"),
                         ("vision layers x width", "right"), ("LLM layers x width", "right"),
                         ("heads / kv", "right"), ("visual tokens / image", "right")):
        table.add_column(col, justify=justify)  # type: ignore[arg-type]
    for r in rows:
        table.add_row(r["name"], r["family"], fmt_count(r["parameters"]),
                      f"{r['vision_layers']} x {r['vision_hidden']}", f"{r['llm_layers']} x {r['llm_hidden']}",
                      f"{r['llm_heads']} / {r['llm_kv_heads']}", str(r["visual_tokens_per_image"]))
    return table


def flops_table(report: dict[str, Any], unit: str, show_roofline: bool) -> Table:
    mode = "equivalent: final token count in every layer" if report["equivalent"] else "layer-exact"
    title = (f"{report['model']}: {unit}, convention {report['convention']}, scope {report['scope']} "
             f"({mode}); batch {report['batch']}, {report['text_tokens']} text tokens")
    in_scope = set(report["scope_stages"])
    caption = ("stages marked * are outside the scope and not in the total; "
               "memory access is LLM-Viewer traffic, not a footprint; bytes in decimal units")
    table = Table(title=title, title_justify="left", caption=caption, caption_justify="left")
    short = {"vision": "vision", "projector": "proj", "llm": "llm", "lm_head": "head"}
    cols = ["variant", "quant", "visual"]
    cols += [short[s] + ("" if s in in_scope else "*") for s in report["stages"]]
    cols += ["total", "vs vanilla", "KV cache", "weights", "mem access"]
    if show_roofline:
        cols.append("roofline ms")
    for col in cols:
        table.add_column(col, justify="left" if col in ("variant", "quant") else "right")
    for row in report["rows"]:
        cells = [row["variant"], row["quant"], str(row["visual_tokens"])]
        cells += [fmt_tera(row["tflops_by_stage"][s]) for s in report["stages"]]
        reduction = row.get("reduction_vs_vanilla")
        cells += [fmt_tera(row["tflops"]), "-" if reduction is None else f"-{reduction * 100:.1f}%",
                  fmt_bytes(row["kv_cache_bytes"]), fmt_bytes(row["weight_bytes"]),
                  fmt_bytes(row["memory_access_bytes"])]
        if show_roofline:
            cells.append(f"{row['roofline_ms']:.2f}")
        table.add_row(*cells)
    return table


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


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def _ratio(x: float | None, suffix: str = "x") -> str:
    return "-" if x is None else f"{x:.2f}{suffix}"


def profile_table(report: dict[str, Any]) -> Table:
    env = report["environment"]
    title = (f"{report['config']['model']} on {env.get('device')} ({env['device_kind']}, {env['threads']} threads): "
             f"prefill, {report['config']['repeat']} runs after {report['config']['warmup']} warm-up")
    caption = ("TFLOPs: analytic, flops convention, whole model (scope all), LM head on the last token; "
               "speedup and memory saving against the vanilla row of the same quant and batch; "
               "peak memory: " + (report["rows"][0]["memory"].get("method", "") if report["rows"]
                                  and report["rows"][0].get("memory") else ""))
    table = Table(title=title, title_justify="left", caption=caption, caption_justify="left")
    cols = ["variant", "quant", "dtype", "batch", "visual", "status", "median ms", "p90 ms", "img/s", "TFLOPs",
            "TFLOP/s", "method %", "speedup", "FLOPs ratio", "peak mem", "mem saving", "KV measured",
            "KV analytic"]
    if any(r.get("analytic", {}).get("roofline_ms") for r in report["rows"]):
        cols += ["roofline ms", "measured/roofline"]
    if report["config"]["new_tokens"]:
        cols += ["e2e img/s", "gen tok/s"]
    for col in cols:
        table.add_column(col, justify="left" if col in ("variant", "quant", "dtype", "status") else "right")
    for r in report["rows"]:
        a = r["analytic"]
        dtype = (r.get("backend") or {}).get("compute_dtype", "-")
        cells = [r["variant"], r["quant"], dtype, str(r["batch"]), str(a["visual_tokens"]), r["status"]]
        if r["status"] != "ok":
            cells += [r.get("reason", "")[:50]] + [""] * (len(cols) - len(cells) - 1)
            table.add_row(*cells)
            continue
        lat = r["latency"]
        cells += [_ms(lat["median_ms"]), _ms(lat["p90_ms"]), f"{r['images_per_s']:.2f}", fmt_tera(a["tflops"]),
                  f"{r['achieved_tflops_per_s']:.3f}", f"{r['reduction_share'] * 100:.2f}%",
                  _ratio(r.get("speedup_vs_vanilla")),
                  _ratio(r.get("flops_ratio_vs_vanilla")), fmt_bytes(r["memory"].get("peak_bytes")),
                  "-" if r.get("memory_saving_vs_vanilla") is None else f"{r['memory_saving_vs_vanilla'] * 100:.1f}%",
                  fmt_bytes(r["kv_cache_bytes"]), fmt_bytes(a["kv_cache_bytes"])]
        if "roofline ms" in cols:
            cells += [_ms(a.get("roofline_ms")), _ratio(r.get("measured_over_roofline"))]
        if report["config"]["new_tokens"]:
            g = r.get("generation") or {}
            cells += [f"{g.get('images_per_s', 0):.2f}", f"{g.get('generated_tokens_per_s', 0):.1f}"]
        table.add_row(*cells)
    return table
