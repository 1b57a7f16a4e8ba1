"""`ficoco calibrate METHOD`: the offline calibrations of the methods whose official code picks a setting from the
model's own outputs (the work is in ficoco.calibration; this module wires the options and renders the result)."""

from __future__ import annotations

import sys
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from ficoco.methods.vtw import FIRST_SEARCHED_LAYER, SEARCH_SAMPLES
from ficoco_cli import options as check
from ficoco_cli.flags import cli_message

calibrate_app = typer.Typer(
    help="Offline calibrations: the setting a method's official code searches for on the model's own outputs.",
    no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False, rich_markup_mode=None)
out = Console(width=None if sys.stdout.isatty() else 220)
err = Console(stderr=True, width=None if sys.stderr.isatty() else 220)


@calibrate_app.command("vtw")
def vtw_command(
    model: Annotated[str, typer.Option(
        "--model", "-m", help="Profile name, path to a config.json, or a checkout folder.")],
    weights: Annotated[str, typer.Option(
        "--weights", callback=check.weights_source,
        help="random (synthetic prompts, said so in the result), or a local checkpoint folder whose processor lays "
             "out --image/--video and --prompt.")] = "random",
    image: Annotated[list[str] | None, typer.Option(
        "--image", help="An image file or a folder of images, one sample each (repeatable; needs --weights).")
                     ] = None,
    video: Annotated[list[str] | None, typer.Option(
        "--video", help="Video-LLaVA: a video file or a folder of frames, one sample each (repeatable).")] = None,
    prompt: Annotated[list[str] | None, typer.Option(
        "--prompt", help="The question: once for every sample, or once per image in order (repeatable).")] = None,
    eta: Annotated[float | None, typer.Option(
        "--eta", callback=check.budget,
        help="The largest mean KL(p_K || p_full) a withdrawal may cost; default: the official value for the "
             "checkpoint (LLaVA-1.5-7B 0.003, 13B 0.0005, LLaVA-NeXT-vicuna-7B 0.0001, else 0.003).")] = None,
    limit: Annotated[int, typer.Option(
        "--limit", callback=check.whole_number(1),
        help=f"Samples to average over (official: {SEARCH_SAMPLES}); with random weights, the synthetic prompts.")
                     ] = SEARCH_SAMPLES,
    first_layer: Annotated[int, typer.Option(
        "--first-layer", callback=check.whole_number(1),
        help=f"The first layer searched (official: {FIRST_SEARCHED_LAYER}); every later one is searched too.")
                           ] = FIRST_SEARCHED_LAYER,
    set_values: Annotated[list[str] | None, typer.Option(
        "--set", help="Config override KEY=VALUE (repeatable).")] = None,
    text_tokens: Annotated[int, typer.Option(
        "--text-tokens", callback=check.whole_number(1), help="Text tokens of a synthetic prompt.")] = 60,
    seed: Annotated[int, typer.Option(
        "--seed", callback=check.whole_number(0, check.MAX_SEED), help="Seed of the random weights and prompts.")] = 0,
    device: Annotated[str, typer.Option(
        "--device", callback=check.choice(("auto", "cuda", "cpu")), help="auto, cuda or cpu.")] = "auto",
    dtype: Annotated[str, typer.Option(
        "--dtype", callback=check.choice(("auto", "bf16", "fp16", "fp32")), help="auto, bf16, fp16 or fp32.")
                     ] = "auto",
    json_path: Annotated[str | None, typer.Option(
        "--json", callback=check.output_file, help="Write the result as JSON here (- for stdout).")] = None,
) -> None:
    """VTW's layer K: per sample, the last token's KL(p_K || p_full) of a withdrawal at every layer K from
    --first-layer on; K is the first whose mean is within --eta (lzhxmu/VTW's --findk)."""
    from ficoco.calibration.vtw import calibrate_vtw
    from ficoco.report import write_json_atomic

    console = err if json_path == "-" else out
    result = calibrate_vtw(model, weights=weights, image=image or (), video=video or (), prompt=prompt or (), eta=eta,
                           limit=limit, first_layer=first_layer, overrides=set_values or (), seed=seed,
                           text_tokens=text_tokens, device=device, dtype=dtype,
                           progress=lambda line: err.print(line, markup=False, highlight=False))
    data = result.to_json()
    console.print(vtw_table(data))
    for line in vtw_lines(data):
        console.print(line, markup=False, highlight=False, soft_wrap=True)
    if json_path:
        write_json_atomic(json_path, data)
    if data["layer"] is None:
        raise typer.Exit(1)


def vtw_table(data: dict[str, Any]) -> Table:
    """One row per searched layer: the mean KL, whether it is within eta, the layer average of a run there."""
    table = Table(title=f"{data['model']}: VTW's search for K ({len(data['samples'])} sample(s), eta {data['eta']:g})",
                  title_justify="left")
    for name in ("K", "mean KL", "<= eta", "visual tokens (layer average)"):
        table.add_column(name, justify="right")
    layers, visual = data["decoder_layers"], data["visual_tokens"]
    for layer in data["searched_layers"]:
        kl = data["mean_kl"][str(layer)]
        mark = "K" if layer == data["layer"] else ("yes" if kl <= data["eta"] else "")
        table.add_row(str(layer), f"{kl:.4g}", mark, f"{layer * visual / layers:g}")
    return table


def vtw_lines(data: dict[str, Any]) -> list[str]:
    """What the search found and how to run with it, its cost, and the notes."""
    lines = [f"eta {data['eta']:g}: {data['eta_source']}"]
    layer = data["layer"]
    weights = "" if data["weights"] == "random" else f" --weights {data['weights']}"
    if layer is None:
        lines.append(f"no searched layer's mean KL is within eta {data['eta']:g} (the official search ends in an "
                     "error here): give a larger --eta, or --hp layer=K with a K of your choice")
    else:
        lines += [f"K = {layer}: the first searched layer whose mean KL is within eta; a run there averages "
                  f"{data['layer_average_visual_tokens']:g} of {data['visual_tokens']} visual tokens per decoder layer",
                  f"run with it: ficoco profile --model {data['model']}{weights} --variant vtw --hp layer={layer} "
                  f"(Python: ficoco.apply(model, 'vtw', layer={layer}))"]
    lines.append(f"cost of the search: {data['forwards']} forwards ({len(data['searched_layers'])} withdrawals and one "
                 f"with every token per sample), {data['search_tflops']:.4g} TFLOPs (flops, scope all)")
    lines += [cli_message(f"note: {note}") for note in data["notes"]]
    return lines
