"""The `ficoco` command: wires options to the library and renders the results.

Commands must start fast: nothing here imports torch at module level; the commands that
run models import the model code inside their own bodies.
"""

from __future__ import annotations

import io
import sys
from typing import Annotated, Any

import click
import typer
from rich.console import Console

import ficoco
from ficoco.accounting.flops import CONVENTIONS, LM_HEAD_TOKENS, SCOPES
from ficoco.accounting.memory import QUANT_BITS
from ficoco.accounting.request import ScheduleRequest
from ficoco.accounting.schedule import SHAPES
from ficoco.errors import FicocoError
from ficoco.methods.registry import METHODS, PRESETS, VARIANTS
from ficoco.report.compare import JUDGE_CHOICES
from ficoco.sweep.executors import EXECUTORS
from ficoco.versions import package_versions, report_environment
from ficoco_cli import options as check
from ficoco_cli.calibrate_cmd import calibrate_app
from ficoco_cli.flags import FLAGS, cli_message, error_text
from ficoco_cli.options import parse_image_size, parse_image_sizes, split_list
from ficoco_cli.report_cmd import FORMATS, REPORT_FORMATS

app = typer.Typer(
    help="FiCoCo visual-token reduction for multimodal LLMs: analytic costs, patched models, measurements.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)
# Tables go to stderr when a report goes to stdout (--json -), so stdout stays valid JSON.
# Piped output (CI logs, files) gets a wide fixed width instead of rich's 80 columns, so
# tables are not truncated.
out = Console(width=None if sys.stdout.isatty() else 220)
err = Console(stderr=True, width=None if sys.stderr.isatty() else 220)


def _version(value: bool) -> None:
    if value:
        print(f"ficoco {ficoco.__version__}")
        for package in package_versions():
            print(f"  {package.describe()}")
        raise typer.Exit()


@app.callback()
def root(
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                          help="Print the version and exit.")] = False,
) -> None:
    """FiCoCo visual-token reduction for multimodal LLMs: analytic costs, patched models, measurements."""


def schedule_request(variants: list[str], *, keep: int | None, preset: int | None, tflops: float | None,
                     schedule: str | None, shape: str | None, first_layer: int | None,
                     hyperparameters: dict[str, object] | None = None) -> ScheduleRequest:
    """The command's schedule request (its constructor refuses several of --keep, --preset, --tflops and
    --schedule), checked against the variants: one source when a method without an official default
    setting runs (FiCoCo-V and -L, unless their `hyperparameters` choose the official code's rule, whose r per
    layer is its setting; the other methods fall back to theirs), none when nothing reduces (it would be
    ignored)."""
    request = ScheduleRequest(keep=keep, preset=preset, tflops=tflops, schedule=schedule, shape=shape,
                              first_layer=first_layer)
    given = [FLAGS[name.removesuffix("=")] for name in request.given()]
    reducing = [v for v in variants if v != "vanilla"]
    if given and not reducing:
        raise FicocoError(f"{given[0]} applies to the reducing methods ({', '.join(METHODS)}); add one with "
                          f"--variant (e.g. --variant {next(iter(METHODS))})")
    needs_schedule = [v for v in reducing if not METHODS[v].runs_without_schedule(hyperparameters)]
    if needs_schedule and not given:
        raise FicocoError(f"--variant {needs_schedule[0]} needs a schedule: give --keep, --preset, --tflops or "
                          "--schedule")
    return request


def check_wired(variants: list[str], where: str) -> None:
    """Refuse, in one line, a method the model adapters do not run yet (the accountant plans it)."""
    for name in variants:
        if name != "vanilla":
            METHODS[name].check_wired(where)


@app.command("methods")
def methods_command(
    json_path: Annotated[str | None, typer.Option(
        "--json", callback=check.output_file, help="Write the registry as JSON here (- for stdout).")] = None,
    matrix: Annotated[bool, typer.Option(
        "--matrix", help="Print methods x model families: yes, flops only, or refused, with the reason.")] = False,
    markdown: Annotated[bool, typer.Option(
        "--markdown", help="With --matrix: print it as a Markdown table, reasons below (for a README).")] = False,
) -> None:
    """List the reduction methods: where each acts, its defaults, the families it runs on."""
    from ficoco.methods.registry import method_matrix
    from ficoco.profiles import FAMILY_DEFAULTS
    from ficoco.report import METHODS_SCHEMA, write_json_atomic
    from ficoco_cli.render import matrix_markdown, matrix_table, methods_table

    if markdown and not matrix:
        raise FicocoError("--markdown prints the matrix: give --matrix with it")
    rows = [spec.to_json() for spec in METHODS.values()]
    cells = method_matrix(FAMILY_DEFAULTS)
    console = err if json_path == "-" else out
    if markdown:
        # Plain text, not rich markup: the table goes into a README as it is printed.
        console.print(matrix_markdown(cells), markup=False, highlight=False, soft_wrap=True)
    else:
        console.print(matrix_table(cells) if matrix else methods_table(rows))
    if json_path:
        write_json_atomic(json_path, {"schema": METHODS_SCHEMA, "ficoco_version": ficoco.__version__,
                                      "environment": report_environment(), "methods": rows, "matrix": cells})


@app.command("models")
def models_command() -> None:
    """List the model profiles: family, parameters, layers and widths, visual tokens per image."""
    from ficoco.accounting import architecture, parameter_counts
    from ficoco.profiles import list_profiles, load_profile
    from ficoco_cli.render import models_table, models_unverified

    rows = []
    for name in list_profiles():
        profile = load_profile(name)
        arch = architecture(profile)
        d = arch.decoder
        unverified = profile.defaults.get("unverified", [])
        rows.append({
            "name": name, "family": arch.family, "parameters": parameter_counts(arch).total,
            "vision_layers": arch.vision.layers, "vision_hidden": arch.vision.hidden,
            "llm_layers": d.layers, "llm_hidden": d.hidden,
            "llm_heads": d.heads, "llm_kv_heads": d.kv_heads,
            "visual_tokens_per_image": arch.visual_tokens,
            "full_attention_layers": d.full_attention_layers,
            "experts": None if d.moe is None else {"experts": d.moe.experts, "top_k": d.moe.top_k,
                                                   "sparse_layers": len(d.moe.layers)},
            "deepstack_layers": list(arch.deepstack_layers),
            "unverified": [str(item) for item in unverified] if isinstance(unverified, list) else [str(unverified)],
        })
    out.print(models_table(rows))
    notes = models_unverified(rows)
    if notes:
        out.print(notes)


# Every option's value is checked by its kind as it is parsed (ficoco_cli.options); the library
# checks what needs the model (reachable --keep, layers in range, budgets that fit).
ModelOpt = Annotated[str, typer.Option(
    "--model", "-m", help="Profile name, path to a config.json, or a checkout folder.")]
VariantOpt = Annotated[str, typer.Option(
    "--variant", callback=check.list_of(VARIANTS),
    help=f"{', '.join(VARIANTS)}, or several: vanilla,v,l (`ficoco methods` lists them).")]
PresetOpt = Annotated[int | None, typer.Option(
    "--preset", callback=check.one_of_numbers(PRESETS),
    help="The literature's 192, 128 or 64-token row: each method's published setting (same as --keep N).")]
KeepOpt = Annotated[int | None, typer.Option(
    "--keep", callback=check.whole_number(1), help="Visual tokens that reach (V) or leave (L) the LLM.")]
TflopsOpt = Annotated[float | None, typer.Option(
    "--tflops", callback=check.budget, help="Budget: keep the most tokens whose cost (convention, scope) fits it.")]
ScheduleOpt = Annotated[str | None, typer.Option(
    "--schedule", callback=check.non_empty_list, help="Explicit removals LAYER:REMOVED,...")]
ShapeOpt = Annotated[str | None, typer.Option(
    "--shape", callback=check.choice(SHAPES),
    help="uniform (same per reducing layer) or oneshot; default: uniform, for a --tflops budget over the longest "
         "run of layers from the first reducing one that fits.")]
FirstLayerOpt = Annotated[int | None, typer.Option(
    "--first-layer", callback=check.whole_number(0), help="First reducing layer (default: profile's).")]
KvBitsOpt = Annotated[int | None, typer.Option(
    "--kv-bits", callback=check.one_of_numbers((2, 4, 8, 16)), help="Override the KV-cache bit width.")]
SetOpt = Annotated[list[str] | None, typer.Option("--set", help="Config override KEY=VALUE (repeatable).")]
HpOpt = Annotated[list[str] | None, typer.Option(
    "--hp", callback=check.each(check.hyperparameter),
    help="Method hyperparameter NAME=VALUE (repeatable), to every --variant that has it; e.g. contextual_mode=mean, "
         "one of ficoco's corrections of the official code, which reports then name (`ficoco methods` lists them).")]
TextTokensOpt = Annotated[int | None, typer.Option(
    "--text-tokens", callback=check.whole_number(1), help="Text tokens per prompt (default 60).")]
BatchOpt = Annotated[int, typer.Option("--batch", callback=check.whole_number(1), help="Batch size.")]
ImageSizeOpt = Annotated[str | None, typer.Option(
    "--image-size", callback=check.image_size, help="WxH, for AnyRes (LLaVA-NeXT, LLaVA-OneVision) and Qwen2-VL.")]
FramesOpt = Annotated[int | None, typer.Option(
    "--frames", callback=check.whole_number(1),
    help="Video frames (Video-LLaVA; LLaVA-OneVision, Qwen2-VL, Qwen2.5-VL: a video instead of an image).")]
JsonOpt = Annotated[str | None, typer.Option(
    "--json", callback=check.output_file, help="Write the JSON report here (- for stdout).")]
WideOpt = Annotated[bool, typer.Option(
    "--wide", help="Show every column (the default table fits 80 columns; the JSON report has everything).")]
# The count of a sweep's or an evaluation's points (`ficoco sweep`, `ficoco eval`).
PointsConventionOpt = Annotated[str, typer.Option(
    "--convention", callback=check.choice(CONVENTIONS), help="flops, macs, llm-viewer, paper or visual-macs.")]
PointsScopeOpt = Annotated[str, typer.Option(
    "--scope", callback=check.choice(SCOPES), help="llm (decoder + LM head) or all.")]
DTYPES = ("auto", "bf16", "fp16", "fp32")
DeviceMapOpt = Annotated[str | None, typer.Option(
    "--device-map", help="Split the model through accelerate: auto (GPUs, then CPU memory, then disk), balanced "
                         "(even over the GPUs) or cpu-offload (weights in CPU memory and on disk, computed "
                         "on the GPU, else the CPU).")]
MaxMemoryOpt = Annotated[str | None, typer.Option(
    "--max-memory", help="Per-device limits for --device-map, e.g. cpu=200MiB,cuda:0=20GiB (what fits nowhere "
                         "goes to disk).")]
DtypeOpt = Annotated[str, typer.Option(
    "--dtype", callback=check.choice(DTYPES),
    help="auto (float16 on a GPU; on a CPU the fastest measured there, upcasting 16-bit weights when float32 "
         "does not fit), bf16, fp16 or fp32.")]


@app.command("flops")
def flops_command(
    model: ModelOpt,
    variant: VariantOpt = "vanilla",
    keep: KeepOpt = None,
    preset: PresetOpt = None,
    tflops: TflopsOpt = None,
    schedule: ScheduleOpt = None,
    shape: ShapeOpt = None,
    first_layer: FirstLayerOpt = None,
    convention: Annotated[str, typer.Option(
        "--convention", callback=check.choice(CONVENTIONS),
        help="flops, macs, llm-viewer, paper or visual-macs.")] = "flops",
    scope: Annotated[str, typer.Option(
        "--scope", callback=check.choice(SCOPES), help="llm (decoder + LM head) or all.")] = "llm",
    equivalent: Annotated[bool, typer.Option(
        "--equivalent", help="Count every layer at the final token count (papers' style).")] = False,
    quant: Annotated[str, typer.Option(
        "--quant", callback=check.list_of(tuple(QUANT_BITS)), help="fp16, int8, int4 or several (W/A/KV bits).")
    ] = "fp16",
    kv_bits: KvBitsOpt = None,
    gpu: Annotated[str | None, typer.Option(
        "--gpu", callback=check.gpu_name, help="Hardware profile for the roofline time.")] = None,
    text_tokens: TextTokensOpt = None,
    batch: BatchOpt = 1,
    lm_head: Annotated[str, typer.Option(
        "--lm-head", callback=check.choice(LM_HEAD_TOKENS),
        help="LM head over all tokens (plain forward) or the last (generate).")] = "all",
    image_size: ImageSizeOpt = None,
    frames: FramesOpt = None,
    per_layer: Annotated[bool, typer.Option("--per-layer", help="Add per-layer token counts and costs.")] = False,
    set_values: SetOpt = None,
    hp: HpOpt = None,
    json_path: JsonOpt = None,
    wide: WideOpt = False,
    verify: Annotated[bool, typer.Option(
        "--verify", help="Run the prefill (random weights, CPU) under fvcore and torch's counter and check "
                         "every stage against the analytic count; exit 1 if one differs beyond --tolerance.")] = False,
    tolerance: Annotated[float | None, typer.Option(
        "--tolerance", callback=check.tolerance,
        help="--verify: largest analytic vs fvcore difference per stage, in percent (0.5).")] = None,
    dtype: Annotated[str | None, typer.Option(
        "--dtype", callback=check.choice(DTYPES),
        help="--verify: auto (the fastest on this CPU that fits), bf16, fp16 or fp32.")] = None,
) -> None:
    """Analytic cost: TFLOPs by stage, KV cache, weights, memory access, roofline time."""
    from ficoco.accounting import UNITS
    from ficoco.report import write_json_atomic
    from ficoco_cli.render import compares_methods, flops_table, method_comparison_table, per_layer_table

    variants = split_list(variant, "--variant")
    hyperparameters = check.method_settings(hp, variants)
    request = schedule_request(variants, keep=keep, preset=preset, tflops=tflops, schedule=schedule, shape=shape,
                               first_layer=first_layer, hyperparameters=hyperparameters)
    if verify:
        check_wired(variants, "ficoco flops --verify")
    if tolerance is not None and not verify:
        raise FicocoError("--tolerance applies to --verify; add --verify")
    if dtype is not None and not verify:
        raise FicocoError("--dtype applies to --verify (the analytic count has no dtype; --quant sets its bit "
                          "widths); add --verify")
    if verify:
        _verify_flops(model, variants, request, convention=convention, scope=scope, equivalent=equivalent,
                      quant=quant, kv_bits=kv_bits, gpu=gpu, text_tokens=text_tokens, batch=batch, lm_head=lm_head,
                      image_size=image_size, frames=frames, per_layer=per_layer, set_values=set_values,
                      json_path=json_path, tolerance=tolerance, dtype=dtype, hyperparameters=hyperparameters)
        return
    quants = split_list(quant, "--quant")
    report = ficoco.flops(model, variants, request=request, convention=convention, scope=scope, equivalent=equivalent,
                          quants=quants, kv_bits=kv_bits, gpu=gpu, text_tokens=text_tokens, batch=batch,
                          lm_head=lm_head, image_size=parse_image_size(image_size), frames=frames,
                          per_layer=per_layer, overrides=set_values or (), hyperparameters=hyperparameters)
    unit = UNITS[convention]
    console = err if json_path == "-" else out
    if compares_methods(report) and not wide:
        # Several methods under one setting: one table, cheapest first (--wide: every column, as given).
        console.print(method_comparison_table(report, unit))
    else:
        console.print(flops_table(report, unit, report["gpu"] is not None, wide))
    for entry in report["skipped"]:
        console.print(f"left out {entry['variant']}: {cli_message(str(entry['reason']))}", markup=False,
                      highlight=False)
    if per_layer:
        for row in report["rows"][:: len(quants)]:
            console.print(per_layer_table(row, unit))
    if json_path:
        write_json_atomic(json_path, report)


def _verify_flops(model: str, variants: list[str], schedule_request: ScheduleRequest, *, convention: str, scope: str,
                  equivalent: bool, quant: str, kv_bits: int | None, gpu: str | None, text_tokens: int | None,
                  batch: int, lm_head: str, image_size: str | None, frames: int | None, per_layer: bool,
                  set_values: list[str] | None, json_path: str | None, tolerance: float | None,
                  dtype: str | None, hyperparameters: dict[str, Any] | None = None) -> None:
    """`ficoco flops --verify`: the prefill under fvcore and torch's counter against the analytic count, per stage."""
    from ficoco import accounting as acc
    from ficoco.profiles import load_profile, set_layout
    from ficoco.profiling.verify import check_supported
    from ficoco_cli.verify_cmd import check_verify_options, verify_command

    profile = load_profile(model, set_values or [])
    set_layout(profile, image_size=parse_image_size(image_size), frames=frames)
    check_supported(profile)
    check_verify_options(quant=quant, kv_bits=kv_bits, gpu=gpu)
    arch = acc.architecture(profile)
    opts = acc.CountOptions(convention=convention, scope=scope, equivalent=equivalent, batch=batch,
                            text_tokens=text_tokens, lm_head_tokens=lm_head)
    schedules, _ = acc.resolve_side_by_side(arch, variants, opts, schedule_request, strict=True,
                                            hyperparameters=hyperparameters)
    folded = schedule_request.folded()
    request = {"variants": variants, "keep": folded.keep, "tflops": folded.tflops, "schedule": folded.schedule,
               "shape": folded.shape, "first_layer": folded.first_layer, "convention": convention, "scope": scope,
               "equivalent": equivalent}
    code = verify_command(profile, schedules, text_tokens=text_tokens, batch=batch, lm_head=lm_head,
                          tolerance=tolerance, per_layer=per_layer, json_path=json_path,
                          console=err if json_path == "-" else out, request=request, dtype=dtype or "auto")
    if code:
        sys.exit(code)  # the verdict, after the tables (typer.Exit would not reach main's exit code)


@app.command("profile")
def profile_command(
    model: ModelOpt,
    variant: VariantOpt = "v",
    keep: KeepOpt = None,
    preset: PresetOpt = None,
    tflops: TflopsOpt = None,
    schedule: ScheduleOpt = None,
    shape: ShapeOpt = None,
    first_layer: FirstLayerOpt = None,
    convention: Annotated[str, typer.Option(
        "--convention", callback=check.choice(CONVENTIONS), help="Convention of a --tflops budget.")] = "flops",
    scope: Annotated[str, typer.Option(
        "--scope", callback=check.choice(SCOPES), help="Scope of a --tflops budget: llm or all.")] = "llm",
    no_reference: Annotated[bool, typer.Option(
        "--no-reference", help="Do not add the vanilla reference rows.")] = False,
    quant: Annotated[str, typer.Option(
        "--quant", callback=check.list_of(tuple(QUANT_BITS)), help="fp16, int8 (LLM.int8), int4 (NF4), or several.")
    ] = "fp16",
    kv_bits: Annotated[int | None, typer.Option(
        "--kv-bits", callback=check.one_of_numbers((16, 8, 4, 2)),
        help="KV cache bits: 8, 4, 2 (transformers' quantized cache, HQQ) or 16 (unquantized); default: the "
             "weights' (int8: 8, int4: 4).")] = None,
    batch: Annotated[str, typer.Option(
        "--batch", callback=check.whole_numbers(1), help="Batch sizes, e.g. 1,8.")] = "1",
    text_tokens: Annotated[int, typer.Option(
        "--text-tokens", callback=check.whole_number(1), help="Text tokens per prompt.")] = 60,
    new_tokens: Annotated[int, typer.Option(
        "--new-tokens", callback=check.whole_number(0), help="0: prefill only; N: also generate N.")] = 0,
    warmup: Annotated[int | None, typer.Option(
        "--warmup", callback=check.whole_number(0),
        help="Untimed runs before measuring (default: by time, up to 3 on a GPU, 1 on CPU; none when one run "
             "takes over a minute).")] = None,
    repeat: Annotated[int | None, typer.Option(
        "--repeat", callback=check.whole_number(1),
        help="Timed runs per row (default: as many as fit in 30 s, 1 to 10).")] = None,
    device: Annotated[str, typer.Option(
        "--device", callback=check.choice(("auto", "cuda", "cpu")), help="auto, cuda or cpu.")] = "auto",
    weights: Annotated[str, typer.Option(
        "--weights", callback=check.weights_source, help="random, a local checkpoint folder, or a cached HF id.")
                       ] = "random",
    image: Annotated[str | None, typer.Option(
        "--image", help="An image file instead of random pixels (random weights: one image, laid out as ficoco "
        "show lays it out).")] = None,
    prompt: Annotated[str | None, typer.Option(
        "--prompt", help="A question, laid out with the checkpoint's processor and chat template (needs --weights).")
                      ] = None,
    video: Annotated[str | None, typer.Option(
        "--video", help="Video-LLaVA: a video file (needs a decoder library such as av) or a folder of frame "
                        "images; --frames of them, evenly spaced.")] = None,
    fidelity: Annotated[bool, typer.Option(
        "--fidelity", help="Compare every reduced row with vanilla on the same inputs: KL divergence and top-1 "
                           "agreement of the next token, and with --new-tokens the greedy tokens.")] = False,
    set_values: SetOpt = None,
    hp: HpOpt = None,
    seed: Annotated[int, typer.Option(
        "--seed", callback=check.whole_number(0, check.MAX_SEED), help="Seed of the random weights and inputs.")] = 0,
    image_size: ImageSizeOpt = None,
    frames: FramesOpt = None,
    json_path: JsonOpt = None,
    wide: WideOpt = False,
    dtype: DtypeOpt = "auto",
    dry_run: Annotated[bool, typer.Option(
        "--dry-run", help="Print the plan and its time estimate, then exit without building a model.")] = False,
    device_map: DeviceMapOpt = None,
    max_memory: MaxMemoryOpt = None,
    distinct_layers: Annotated[int | None, typer.Option(
        "--distinct-layers", callback=check.whole_number(1),
        help="Random weights for this many decoder layers; deeper layers share layer i mod N's, so a decoder "
             "deeper than memory runs at its full depth and cost (the report says so).")] = None,
) -> None:
    """Measure prefill latency, throughput, peak memory and KV cache of vanilla and reduced models."""
    from ficoco.profiling.config import parse_batches
    from ficoco.report.profile import profile_config
    from ficoco_cli.profile_run import run_and_report

    variants = split_list(variant, "--variant")
    hyperparameters = check.method_settings(hp, variants)
    request = schedule_request(variants, keep=keep, preset=preset, tflops=tflops, schedule=schedule, shape=shape,
                               first_layer=first_layer, hyperparameters=hyperparameters)
    check_wired(variants, "ficoco profile")
    config = profile_config(
        model, variants, request=request, convention=convention, scope=scope, reference=not no_reference,
        quants=split_list(quant, "--quant"), batches=parse_batches(batch), text_tokens=text_tokens,
        new_tokens=new_tokens, warmup=warmup, repeat=repeat, device=device, weights=weights, image=image,
        prompt=prompt, overrides=set_values or (), seed=seed, kv_bits=kv_bits,
        image_size=parse_image_size(image_size), frames=frames, dtype=dtype, video=video,
        fidelity=fidelity, device_map=device_map, max_memory=max_memory,
        hyperparameters=hyperparameters, distinct_layers=distinct_layers,
    )
    console = out if json_path != "-" else err
    report = run_and_report(config, json_path, console, wide, dry_run=dry_run)
    if report is None:  # --dry-run: the plan and its estimate were printed
        return
    if not any(row.get("status") == "ok" for row in report["rows"]):
        reasons = sorted({f"{row.get('status')}: {cli_message(str(row.get('reason')))}" for row in report["rows"]})
        err.print(f"error: no row was measured ({'; '.join(reasons)[:400]})", markup=False, highlight=False,
                  soft_wrap=True)
        raise typer.Exit(1)


@app.command("compare")
def compare_command(
    base: Annotated[str, typer.Argument(help="The reference report (ficoco.report/1).")],
    new: Annotated[str, typer.Argument(help="The report to judge.")],
    tolerance: Annotated[float, typer.Option(
        "--tolerance", callback=check.tolerance, help="Percent a timed ratio may move before it is judged.")] = 10.0,
    absolute: Annotated[bool, typer.Option(
        "--absolute", help="Also judge absolute latency, throughput and memory.")] = False,
    judge: Annotated[str, typer.Option(
        "--judge", callback=check.choice(JUDGE_CHOICES),
        help="all, deterministic (tokens, TFLOPs, KV and weight bytes) or timed (measured ratios; "
             "with --absolute also absolute figures); the rest is shown, not judged.")] = "all",
    cross_machine: Annotated[bool, typer.Option(
        "--cross-machine", help="Judge timed metrics even when the reports name different or unknown "
                                "processors (CPU model and features, or GPU).")] = False,
    fmt: Annotated[str, typer.Option(
        "--format", callback=check.choice(FORMATS), help="table, markdown or json.")] = "table",
    output: Annotated[str | None, typer.Option(
        "--output", callback=check.output_file, help="Write the comparison to this file.")] = None,
) -> None:
    """Compare two profile (or two serving) reports: exit 1 on a regression, 0 otherwise."""
    from ficoco.report import write_text_atomic
    from ficoco.report.compare import compare
    from ficoco.report.schemas import SERVE_SCHEMA
    from ficoco.sweep import read_report_any
    from ficoco_cli.report_cmd import comparison_json, comparison_markdown, comparison_table

    # A profile report, or an evaluated sweep's report or store (compare judges its accuracy), or two serving reports.
    base_report, new_report = read_report_any(base), read_report_any(new)
    if SERVE_SCHEMA in (base_report["schema"], new_report["schema"]):
        from ficoco.report.serve import compare_serve

        result = compare_serve(base_report, new_report, tolerance_pct=tolerance, judge=judge,
                               cross_machine=cross_machine)
    else:
        result = compare(base_report, new_report, tolerance_pct=tolerance, absolute=absolute, judge=judge,
                         cross_machine=cross_machine)
    for warning in result.warnings:
        err.print(f"warning: {cli_message(warning)}", markup=False, highlight=False, soft_wrap=True)
    for side, rows in (("base", result.only_base), ("new", result.only_new)):
        if rows:
            err.print(f"only in {side}: {', '.join(rows)}", markup=False, highlight=False, soft_wrap=True)
    if fmt == "table" and not output or output == "-" and fmt == "table":
        out.print(comparison_table(result))
    else:
        if fmt == "table":
            buffer = Console(file=io.StringIO(), width=220)
            buffer.print(comparison_table(result))
            text = buffer.file.getvalue()  # type: ignore[attr-defined]
        else:
            text = comparison_markdown(result) if fmt == "markdown" else comparison_json(result)
        write_text_atomic(output or "-", text)
    if result.regressions:
        names = sorted({f"{v.metric} ({v.row})" for v in result.regressions})
        err.print(f"regression: {'; '.join(names)}", markup=False, highlight=False, soft_wrap=True)
        raise typer.Exit(1)


@app.command("report")
def report_command(
    path: Annotated[str, typer.Argument(
        help="A saved profile (ficoco.report/1), flops (ficoco.flops/1), sweep (ficoco.sweep/1) or serving "
             "(ficoco.serve/1) report.")],
    fmt: Annotated[str, typer.Option(
        "--format", callback=check.choice(REPORT_FORMATS), help="table, markdown or csv.")] = "table",
    wide: WideOpt = False,
    plot: Annotated[str | None, typer.Option(
        "--plot", callback=check.plot_folder, help="Draw the report's figures (PNG and SVG) into this folder.")
    ] = None,
) -> None:
    """Render a saved profile or flops report as a table, markdown or CSV (several methods: compared by cost);
    a sweep report as a table; --plot draws figures."""
    from ficoco.report import FLOPS_SCHEMA, SWEEP_SCHEMA
    from ficoco.report.schemas import SERVE_SCHEMA
    from ficoco.sweep import read_report_any
    from ficoco_cli.render import method_comparison_table, print_profile
    from ficoco_cli.report_cmd import flops_report_csv, report_csv, report_markdown
    from ficoco_cli.sweep_cmd import draw_report, sweep_table

    report = read_report_any(path)
    if report["schema"] == SERVE_SCHEMA:
        from ficoco_cli.serve_cmd import draw_serve, serve_csv, serve_markdown, serve_table

        if fmt == "table":
            out.print(serve_table(report))
        else:
            sys.stdout.write(serve_markdown(report) if fmt == "markdown" else serve_csv(report))
        if plot:
            for written in draw_serve(report, plot):
                (err if fmt != "table" else out).print(f"wrote {written}", markup=False, highlight=False)
        return
    if report["schema"] == FLOPS_SCHEMA and plot:
        raise FicocoError("--plot draws profile and sweep reports; a flops report has no measured points "
                          "(ficoco sweep --plot draws the accountant's costs)")
    if report["schema"] == SWEEP_SCHEMA:
        from ficoco_cli.render import print_evaluated_sweep

        if fmt == "table":
            out.print(sweep_table(report))
        if not print_evaluated_sweep(out, report, fmt) and fmt != "table":
            raise FicocoError(f"--format {fmt} renders profile and evaluated sweep reports; a sweep report is "
                              "shown as a table")
    elif report["schema"] == FLOPS_SCHEMA:
        from ficoco.accounting import UNITS
        from ficoco_cli.report_cmd import check_flops_rows

        check_flops_rows(report, path)
        unit = UNITS.get(str(report.get("convention")), "TFLOPs")
        if fmt == "table":
            out.print(method_comparison_table(report, unit))
        else:
            from ficoco_cli.render import method_comparison_markdown

            sys.stdout.write(method_comparison_markdown(report, unit) if fmt == "markdown"
                             else flops_report_csv(report))
        return
    elif fmt == "table":
        print_profile(out, report, wide)
    else:
        sys.stdout.write(report_markdown(report) if fmt == "markdown" else report_csv(report))
    if plot:
        draw_report(report, plot, err if fmt != "table" else out)


@app.command("sweep")
def sweep_command(
    model: ModelOpt,
    variant: Annotated[str, typer.Option(
        "--variant", callback=check.list_of(VARIANTS), help="Methods to sweep (vanilla is always the reference).")
    ] = ",".join(VARIANTS),
    keep: Annotated[str | None, typer.Option(
        "--keep", callback=check.whole_numbers(1), help="Points: visual tokens kept, e.g. 576,384,192,128,64.")
    ] = None,
    tflops: Annotated[str | None, typer.Option(
        "--tflops", callback=check.budgets, help="Points: budgets under --convention/--scope, e.g. 3.3,2.4,1.5.")
    ] = None,
    shape: ShapeOpt = None,
    first_layer: FirstLayerOpt = None,
    convention: PointsConventionOpt = "flops",
    scope: PointsScopeOpt = "llm",
    quant: Annotated[str, typer.Option(
        "--quant", callback=check.list_of(tuple(QUANT_BITS)), help="fp16, int8, int4 or several (one model each).")
    ] = "fp16",
    text_tokens: Annotated[int, typer.Option(
        "--text-tokens", callback=check.whole_number(1), help="Text tokens per prompt.")] = 60,
    image_size: ImageSizeOpt = None,
    frames: FramesOpt = None,
    set_values: SetOpt = None,
    measure: Annotated[bool, typer.Option(
        "--measure", help="Also measure every point with the profiler (one built model per quant).")] = False,
    fidelity: Annotated[bool, typer.Option(
        "--fidelity", help="Also compare every point's next-token distribution with vanilla's (KL, top-1).")
    ] = False,
    samples: Annotated[int, typer.Option(
        "--samples", callback=check.whole_number(1, 1000), help="--fidelity: seeded prompts to average over.")] = 4,
    warmup: Annotated[int | None, typer.Option(
        "--warmup", callback=check.whole_number(0), help="--measure: untimed runs per point (default: by time).")
    ] = None,
    repeat: Annotated[int | None, typer.Option(
        "--repeat", callback=check.whole_number(1), help="--measure: timed runs per point (default: by time).")
    ] = None,
    device: Annotated[str, typer.Option(
        "--device", callback=check.choice(("auto", "cuda", "cpu")), help="auto, cuda or cpu.")] = "auto",
    weights: Annotated[str, typer.Option(
        "--weights", callback=check.weights_source, help="random, a local checkpoint folder, or a cached HF id.")
    ] = "random",
    dtype: DtypeOpt = "auto",
    seed: Annotated[int, typer.Option(
        "--seed", callback=check.whole_number(0, check.MAX_SEED), help="Seed of the random weights and inputs.")] = 0,
    json_path: JsonOpt = None,
    plot: Annotated[str | None, typer.Option(
        "--plot", callback=check.plot_folder, help="Draw the figures (PNG and SVG) into this folder.")] = None,
    out_folder: Annotated[str | None, typer.Option(
        "--out", help="Models runs: the results store, one file per finished point; the same command resumes it "
                      "(default sweeps/<model>-<settings hash>).")] = None,
    executor: Annotated[str, typer.Option(
        "--executor", callback=check.choice(EXECUTORS),
        help="Models runs: local (worker processes here), ray or slurm (submitit).")] = "local",
    workers: Annotated[int | None, typer.Option(
        "--workers", callback=check.whole_number(1, 4096),
        help="Points at once (local default: one per GPU, else 1).")] = None,
    gpus_per_point: Annotated[float | None, typer.Option(
        "--gpus-per-point", min=0, help="ray/slurm: GPUs per point (default 1 where the sweep runs on CUDA).")] = None,
    cpus_per_point: Annotated[int | None, typer.Option(
        "--cpus-per-point", callback=check.whole_number(1, 4096), help="ray/slurm: CPUs per point (default 1).")
    ] = None,
    ray_address: Annotated[str | None, typer.Option(
        "--ray-address", help="ray: a running cluster (auto, ray://head:10001); default a local instance.")] = None,
    slurm_partition: Annotated[str | None, typer.Option(
        "--slurm-partition", help="slurm: the partition to submit to.")] = None,
    timeout_min: Annotated[int | None, typer.Option(
        "--timeout-min", callback=check.whole_number(1, 60 * 24 * 30),
        help="slurm: each point's time limit in minutes (default 120).")] = None,
    device_map: DeviceMapOpt = None,
    max_memory: MaxMemoryOpt = None,
    hp: HpOpt = None,
) -> None:
    """Cost (and with --measure/--fidelity measure) every method at every budget point; one report, figures.
    Measured points run each in its own process (--executor), stored as they finish in --out; a rerun resumes."""
    from ficoco.sweep import SweepConfig

    if keep is not None and tflops is not None:
        raise FicocoError("give the points as --keep or as --tflops, not both")
    if keep is None and tflops is None:
        raise FicocoError(f"--variant {variant} needs the sweep's points: give --keep 576,384,192,128,64 or "
                          "--tflops 3.3,2.4,1.5")
    models_run = measure or fidelity
    for name, given in (("--warmup", warmup), ("--repeat", repeat)):
        if given is not None and not measure:
            raise FicocoError(f"{name} applies to --measure; add --measure")
    if not models_run:
        for name, given, default in (("--device", device, "auto"), ("--weights", weights, "random"),
                                     ("--dtype", dtype, "auto"), ("--out", out_folder, None),
                                     ("--executor", executor, "local"), ("--workers", workers, None),
                                     ("--gpus-per-point", gpus_per_point, None),
                                     ("--cpus-per-point", cpus_per_point, None),
                                     ("--ray-address", ray_address, None), ("--slurm-partition", slurm_partition, None),
                                     ("--timeout-min", timeout_min, None), ("--device-map", device_map, None),
                                     ("--max-memory", max_memory, None)):
            if given != default:
                raise FicocoError(f"{name} applies when models run; add --measure or --fidelity")
    if out_folder is not None and not out_folder.strip():
        raise FicocoError("--out is empty; give a folder for the sweep's results store")
    from ficoco.sweep.executors import ExecutorOptions

    options = ExecutorOptions(name=executor, workers=workers, gpus_per_point=gpus_per_point,
                              cpus_per_point=cpus_per_point, ray_address=ray_address, slurm_partition=slurm_partition,
                              timeout_min=timeout_min, device=device, whole_machine=device_map is not None)
    config = SweepConfig(
        model=model, variants=tuple(split_list(variant, "--variant")),
        keep=tuple(int(x) for x in split_list(keep, "--keep")) if keep else (),
        tflops=tuple(float(x) for x in split_list(tflops, "--tflops")) if tflops else (),
        shape=shape, first_layer=first_layer, convention=convention, scope=scope,
        quants=tuple(split_list(quant, "--quant")), text_tokens=text_tokens, image_size=parse_image_size(image_size),
        frames=frames, overrides=tuple(set_values or ()), measure=measure, fidelity=fidelity, samples=samples,
        warmup=warmup, repeat=repeat, device=device, weights=weights, dtype=dtype, seed=seed,
        device_map=device_map, max_memory=max_memory,
        hyperparameters=check.method_settings(hp, split_list(variant, "--variant")))
    _run_sweep(config, json_path, plot, out_folder, options)


def _run_sweep(config: Any, json_path: str | None, plot: str | None, out_folder: str | None, options: Any) -> None:
    """A sweep or an evaluation run (ficoco_cli.sweep_cmd), exit 1 when a point failed."""
    from ficoco_cli.sweep_cmd import run_sweep

    report = run_sweep(config, json_path, plot, err if json_path == "-" else out, out=out_folder, executor=options)
    if report.get("failed"):
        raise typer.Exit(1)


@app.command("eval")
def eval_command(
    model: Annotated[str, typer.Option(
        "--model", "-m", help="A local checkpoint folder (weights, config.json, processor files), or a profile name "
                              "with --weights FOLDER.")],
    tasks: Annotated[str, typer.Option(
        "--tasks", callback=check.non_empty_list, help="lmms-eval tasks, e.g. gqa,mmbench_en_dev,scienceqa_img.")],
    variant: Annotated[str, typer.Option(
        "--variant", callback=check.list_of(VARIANTS), help="Methods to evaluate (vanilla is always the reference).")
    ] = "vanilla,v,l",
    keep: Annotated[str | None, typer.Option(
        "--keep", callback=check.whole_numbers(1), help="Points: visual tokens kept, e.g. 192,128,64.")] = None,
    tflops: Annotated[str | None, typer.Option(
        "--tflops", callback=check.budgets, help="Points: budgets under --convention/--scope, e.g. 3.3,2.4,1.5.")
    ] = None,
    weights: Annotated[str | None, typer.Option(
        "--weights", help="The checkpoint folder when --model names a profile (its defaults apply).")] = None,
    include_path: Annotated[list[str] | None, typer.Option(
        "--include-path", help="A folder of task YAML outside lmms-eval (repeatable).")] = None,
    limit: Annotated[int | None, typer.Option(
        "--limit", callback=check.whole_number(1), help="Documents per task (default: all).")] = None,
    batch_size: Annotated[int, typer.Option(
        "--batch-size", callback=check.whole_number(1, 4096), help="Requests per forward (of one layout).")] = 1,
    max_new_tokens: Annotated[int | None, typer.Option(
        "--max-new-tokens", callback=check.whole_number(1), help="Cap every task's new tokens.")] = None,
    shape: ShapeOpt = None,
    first_layer: FirstLayerOpt = None,
    convention: PointsConventionOpt = "flops",
    scope: PointsScopeOpt = "llm",
    quant: Annotated[str, typer.Option(
        "--quant", callback=check.list_of(tuple(QUANT_BITS)), help="fp16, int8, int4 or several.")] = "fp16",
    kv_bits: Annotated[int | None, typer.Option(
        "--kv-bits", callback=check.one_of_numbers((2, 4, 8)), help="A quantized KV cache of 8, 4 or 2 bits.")
    ] = None,
    text_tokens: Annotated[int | None, typer.Option(
        "--text-tokens", callback=check.whole_number(1),
        help="Text tokens the budget is planned for, as ficoco flops (default: the profile's); each sample is "
             "costed at its own.")] = None,
    frames: FramesOpt = None,
    device: Annotated[str, typer.Option(
        "--device", callback=check.choice(("auto", "cuda", "cpu")), help="auto, cuda or cpu.")] = "auto",
    dtype: DtypeOpt = "auto",
    json_path: JsonOpt = None,
    plot: Annotated[str | None, typer.Option(
        "--plot", callback=check.plot_folder, help="Draw score against TFLOPs (PNG and SVG) into this folder.")
    ] = None,
    out_folder: Annotated[str | None, typer.Option(
        "--out", help="The results store, one file per finished point; the same command resumes it.")] = None,
    executor: Annotated[str, typer.Option(
        "--executor", callback=check.choice(EXECUTORS), help="local (worker processes here), ray or slurm.")
    ] = "local",
    workers: Annotated[int | None, typer.Option(
        "--workers", callback=check.whole_number(1, 4096), help="Points at once (local default: one per GPU, else 1).")
    ] = None,
    gpus_per_point: Annotated[float | None, typer.Option(
        "--gpus-per-point", min=0, help="ray/slurm: GPUs per point.")] = None,
    cpus_per_point: Annotated[int | None, typer.Option(
        "--cpus-per-point", callback=check.whole_number(1, 4096), help="ray/slurm: CPUs per point.")] = None,
    ray_address: Annotated[str | None, typer.Option("--ray-address", help="ray: a running cluster.")] = None,
    slurm_partition: Annotated[str | None, typer.Option("--slurm-partition", help="slurm: the partition.")] = None,
    timeout_min: Annotated[int | None, typer.Option(
        "--timeout-min", callback=check.whole_number(1, 60 * 24 * 30), help="slurm: each point's limit in minutes.")
    ] = None,
    hp: HpOpt = None,
) -> None:
    """Accuracy beside cost: every method at every budget through lmms-eval on a local checkpoint, joined into
    one table (score, retention against vanilla, agreement with vanilla's answers, TFLOPs, visual tokens,
    prefill). Each point runs in its own process, stored as it finishes in --out; a rerun resumes."""
    from pathlib import Path

    from ficoco.accounting import architecture
    from ficoco.eval.run import check_tasks
    from ficoco.profiles import load_profile
    from ficoco.sweep import SweepConfig, plan_points, sweep_profile
    from ficoco.sweep.executors import ExecutorOptions

    if keep is not None and tflops is not None:
        raise FicocoError("give the points as --keep or as --tflops, not both")
    if keep is None and tflops is None:
        raise FicocoError(f"--variant {variant} needs the points to evaluate: give --tflops 3.3,2.4,1.5 or --keep "
                          "192,128,64")
    folder = weights if weights is not None else model
    if not Path(folder).expanduser().is_dir():
        raise FicocoError(f"{'--weights' if weights is not None else '--model'} {folder}: not a folder; an evaluation "
                          "runs a local checkpoint (weights, config.json, processor files); nothing is downloaded")
    if out_folder is not None and not out_folder.strip():
        raise FicocoError("--out is empty; give a folder for the results store")
    if text_tokens is None:  # the budget planned as `ficoco flops` plans it: at the profile's text tokens
        text_tokens = architecture(load_profile(model if weights is not None else folder)).text_tokens
    includes = tuple(str(Path(p).expanduser().resolve()) for p in include_path or ())
    options = ExecutorOptions(name=executor, workers=workers, gpus_per_point=gpus_per_point,
                              cpus_per_point=cpus_per_point, ray_address=ray_address, slurm_partition=slurm_partition,
                              timeout_min=timeout_min, device=device)
    config = SweepConfig(
        model=model, variants=tuple(split_list(variant, "--variant")),
        keep=tuple(int(x) for x in split_list(keep, "--keep")) if keep else (),
        tflops=tuple(float(x) for x in split_list(tflops, "--tflops")) if tflops else (),
        shape=shape, first_layer=first_layer, convention=convention, scope=scope,
        quants=tuple(split_list(quant, "--quant")), text_tokens=text_tokens, frames=frames, device=device,
        weights=str(Path(folder).expanduser().resolve()), dtype=dtype,
        eval_tasks=tuple(split_list(tasks, "--tasks")), eval_include=includes, eval_limit=limit,
        eval_batch_size=batch_size, eval_max_new_tokens=max_new_tokens, kv_bits=kv_bits,
        hyperparameters=check.method_settings(hp, split_list(variant, "--variant")))
    plan_points(config, sweep_profile(config))  # every budget and method checked first (the plan is cheap)
    # lmms-eval installed, every task known (its task index takes seconds): before any point starts.
    check_tasks(config.eval_tasks, includes, "ERROR")
    _run_sweep(config, json_path, plot, out_folder, options)


@app.command("serve-bench")
def serve_bench_command(
    model: Annotated[str, typer.Option("--model", "-m", help="A local checkpoint folder vLLM serves.")],
    variant: Annotated[str, typer.Option(
        "--variant", callback=check.list_of(("vanilla", "v", "visionzip", "divprune", "vispruner", "evs")),
        help="vanilla and the served methods (vanilla is always run first, as the reference); with --frames, evs is "
             "vLLM's own video pruning at the methods' token count.")
    ] = "vanilla,visionzip,divprune,vispruner",
    keep: KeepOpt = None,
    tflops: TflopsOpt = None,
    first_layer: FirstLayerOpt = None,
    hp: HpOpt = None,
    concurrency: Annotated[str, typer.Option(
        "--concurrency", callback=check.whole_numbers(1), help="Requests in flight at each level.")] = "1,4,16,32",
    requests: Annotated[int, typer.Option(
        "--requests", callback=check.whole_number(1), help="Requests per level (the same ones for every variant).")
    ] = 64,
    new_tokens: Annotated[int, typer.Option(
        "--new-tokens", callback=check.whole_number(1), help="Tokens each request generates (EOS ignored).")] = 16,
    image_size: Annotated[str, typer.Option(
        "--image-size", callback=check.image_sizes,
        help="WxH of every request's image (or video frame); several, comma-separated, mix within every level "
             "(request k takes the k-th in turn; images only).")
    ] = "448x448",
    frames: Annotated[int | None, typer.Option(
        "--frames", callback=check.whole_number(2),
        help="A video workload: every request one video of this many frames (Qwen2.5-VL; Qwen3-VL adds its timestamps "
             "to the text), the methods reducing "
             "every temporal slice; add evs to --variant for vLLM's own video pruning beside them.")] = None,
    dtype: Annotated[str, typer.Option(
        "--dtype", callback=check.choice(("float32", "bfloat16", "float16", "auto")),
        help="vLLM's dtype (float32 on a CPU; bfloat16 or auto on a GPU).")] = "float32",
    max_model_len: Annotated[int, typer.Option(
        "--max-model-len", callback=check.whole_number(64), help="vLLM's max_model_len.")] = 2048,
    json_path: JsonOpt = None,
    plot: Annotated[str | None, typer.Option(
        "--plot", callback=check.plot_folder, help="Draw throughput against concurrency into this folder.")] = None,
    server: Annotated[bool, typer.Option(
        "--server", help="Serve each variant with vLLM's OpenAI server (`vllm serve`, or its server module where the "
                         "CPU build's command fails) and send the requests with the openai client, images as data "
                         "URLs; without it, vLLM's AsyncLLM in this process.")] = False,
    server_logs: Annotated[str | None, typer.Option(
        "--server-logs", callback=check.output_folder,
        help="With --server: the folder each server's output goes to (a new temporary folder by default).")] = None,
) -> None:
    """Serve vanilla and each method with vLLM on the same requests at several concurrency levels: TTFT, requests/s,
    output tokens/s beside the accountant's TFLOPs and visual tokens per request (runs in vLLM's venv)."""
    from ficoco.report import write_json_atomic
    from ficoco.serving.vllm.bench import BenchConfig
    from ficoco_cli.serve_cmd import draw_serve, run_serve_bench, serve_table

    variants = split_list(variant, "--variant")
    methods = [v for v in variants if v != "vanilla"]
    if methods and keep is None and tflops is None:
        raise FicocoError(f"--variant {variant}: the methods need --keep N or --tflops X")
    sizes = parse_image_sizes(image_size)
    if frames is not None and len(sizes) > 1:
        raise FicocoError(f"--image-size {image_size}: a video workload takes one frame size; give one WxH with "
                          "--frames")
    if "evs" in variants and frames is None:
        raise FicocoError("--variant evs: vLLM's EVS prunes videos; give --frames N (a video workload)")
    methods = [v for v in methods if v != "evs"]
    hyperparameters = check.method_settings(hp, methods)
    chosen = ["vanilla", *methods, *(["evs"] if "evs" in variants else [])]
    config = BenchConfig(model=model, variants=tuple(dict.fromkeys(chosen)), keep=keep, tflops=tflops, frames=frames,
                         hp=tuple(sorted(hyperparameters.items())), first_layer=first_layer,
                         concurrency=tuple(int(c) for c in split_list(concurrency, "--concurrency")),
                         requests=requests, new_tokens=new_tokens, image_sizes=sizes,
                         dtype=dtype, max_model_len=max_model_len, server=server, log_folder=server_logs)
    console = err if json_path == "-" else out
    report = run_serve_bench(config, lambda line: err.print(line, markup=False, highlight=False))
    console.print(serve_table(report))
    if json_path:
        write_json_atomic(json_path, report)
    if plot:
        for path in draw_serve(report, plot):
            console.print(f"wrote {path}", markup=False, highlight=False)


@app.command("show")
def show_command(
    model: ModelOpt,
    out_path: Annotated[str, typer.Option(
        "--out", callback=check.output_file, help="The picture: a .png or .svg file.")],
    variant: Annotated[str, typer.Option(
        "--variant", callback=check.choice(tuple(v for v in VARIANTS if v != "vanilla")),
        help="The method whose tokens to draw.")] = "v",
    keep: KeepOpt = None,
    tflops: TflopsOpt = None,
    schedule: ScheduleOpt = None,
    shape: ShapeOpt = None,
    first_layer: FirstLayerOpt = None,
    image: Annotated[str | None, typer.Option(
        "--image", help="The image file (without it: random pixels on a plain background).")] = None,
    layer: Annotated[int | None, typer.Option(
        "--layer", callback=check.whole_number(0),
        help="Draw this reducing layer only (default: a contact sheet of all and the end state).")] = None,
    weights: Annotated[str, typer.Option(
        "--weights", callback=check.weights_source, help="random, a local checkpoint folder, or a cached HF id.")
    ] = "random",
    set_values: SetOpt = None,
    seed: Annotated[int, typer.Option(
        "--seed", callback=check.whole_number(0, check.MAX_SEED), help="Seed of the random weights and inputs.")] = 0,
    dtype: DtypeOpt = "auto",
    json_path: JsonOpt = None,
) -> None:
    """Draw the image with its patch grid: the tokens each reducing layer kept, discarded and merged."""
    from ficoco_cli.sweep_cmd import run_show

    request = schedule_request([variant], keep=keep, preset=None, tflops=tflops, schedule=schedule, shape=shape,
                               first_layer=first_layer)
    run_show(model=model, variant=variant, request=request, image=image, layer=layer, out=out_path,
             json_path=json_path, weights=weights, overrides=list(set_values or ()), seed=seed, dtype=dtype,
             console=err if json_path == "-" else out)


# `ficoco calibrate METHOD` (ficoco_cli.calibrate_cmd): the calibrations some official codes run before they reduce.
app.add_typer(calibrate_app, name="calibrate")


def _click_errors() -> tuple[tuple[type[BaseException], ...], tuple[type[BaseException], ...]]:
    """Usage errors and other click exceptions, from click and from the copy typer vendors
    (typer >= 0.2x raises its own classes, which are not click's subclasses)."""
    modules = [click.exceptions]
    try:
        from typer._click import exceptions as vendored

        modules.append(vendored)
    except ImportError:
        pass
    usage = tuple(m.UsageError for m in modules)
    other = tuple(m.ClickException for m in modules)
    return usage, other


def main() -> None:
    """Entry point: user mistakes end in one line and exit code 2, never a traceback."""
    usage_errors, click_errors = _click_errors()
    try:
        rc = app(standalone_mode=False)
    except FicocoError as exc:
        # One line even when the message quotes a value with a line break in it.
        message = " ".join(error_text(exc).replace("\r", "\n").split("\n"))
        err.print(f"error: {message}", markup=False, highlight=False, soft_wrap=True)
        sys.exit(2)
    except usage_errors as exc:
        if type(exc).__name__ == "NoArgsIsHelpError":  # bare `ficoco`: the help is the answer
            print(exc.format_message())  # type: ignore[attr-defined]
            sys.exit(0)
        ctx = getattr(exc, "ctx", None)
        hint = f" (see '{ctx.command_path} --help')" if ctx is not None else ""
        message = " ".join(exc.format_message().replace("\r", "\n").split("\n"))  # type: ignore[attr-defined]
        err.print(f"error: {message}{hint}", markup=False, highlight=False, soft_wrap=True)
        sys.exit(2)
    except click_errors as exc:
        message = exc.format_message().replace("\n", " ")  # type: ignore[attr-defined]
        err.print(f"error: {message}", markup=False, highlight=False, soft_wrap=True)
        sys.exit(getattr(exc, "exit_code", 1))
    except (click.exceptions.Abort, typer.Abort, KeyboardInterrupt):
        err.print("interrupted", markup=False)
        sys.exit(130)
    # Without standalone mode typer turns Ctrl-C into a returned 130 instead of raising.
    if rc == 130:
        err.print("interrupted", markup=False)
    if isinstance(rc, int) and rc:
        sys.exit(rc)
