"""`ficoco serve-bench`'s measurement (knows vLLM): vanilla and every method on the same requests, each in its
own vLLM engine (`AsyncLLM`), at every concurrency level; per level time to first token (p50, p90),
requests/s and output tokens/s, beside the accountant's TFLOPs and visual tokens per request.

A level runs `requests` requests with at most `concurrency` of them in flight (a new one starts when one
ends), after one warm-up request; time to first token is from a request's submission to its first output
token, throughputs are over the level's wall time. Every request holds one image (a different one per request of
the whole run: no level is served from vLLM's prefix or encoder cache of an earlier one; request k's size is
`image_sizes[k % len(image_sizes)]`, so that several sizes mix within every level) and the same question, and
generates exactly `new_tokens` tokens (EOS ignored), so that every variant decodes the same amount; every variant
sees the same images.

With `frames`, every request holds one video of that many frames of the one size in `image_sizes` instead
(Qwen2.5-VL: every temporal slice reduced as an image of its grid), and the variant `evs` is vLLM's own video
pruning (EVS, `video_pruning_rate`) at the rate that keeps the methods' token count (`evs_rate`), so that the two
are side by side; the accountant has no EVS entry (its tower runs whole, its LLM on the kept tokens): its TFLOPs
are left out.

With `server`, each variant runs as users deploy it: vLLM's OpenAI server (`ficoco.serving.vllm.server`: `vllm
serve`, or its server module where the CPU build's command fails) started with the method in `--hf-overrides`, and
the `openai` client sending streamed chat completions with each image as a data URL; time to first token is then
from sending a request to its first streamed chunk (vLLM streams the first one when the first token exists).
"""

from __future__ import annotations

import asyncio
import gc
import json
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ficoco.errors import FicocoError
from ficoco.serving.vllm.settings import PIXEL_COUNTED, SETTINGS_KEY, Settings, plan_image, plan_video

DEFAULT_CONCURRENCY = (1, 4, 16, 32)
EVS = "evs"  # vLLM's own video pruning, a variant beside the methods on a video workload
FPS = 2.0  # the benchmark videos' frame rate (their metadata: every frame given, none resampled)
QUESTION = "Describe the image."
WARM_UP = 4  # requests that warm every engine up before its first level (images of their own)


@dataclass(frozen=True)
class BenchConfig:
    """One serve-bench run: the checkpoint folder, the variants (vanilla first), one budget for every method,
    the concurrency levels, the requests per level and what each request is."""

    model: str
    variants: tuple[str, ...]
    keep: int | None = None
    tflops: float | None = None
    hp: tuple[tuple[str, Any], ...] = ()
    first_layer: int | None = None  # FiCoCo-V's first reducing tower block (None: the family's default)
    concurrency: tuple[int, ...] = DEFAULT_CONCURRENCY
    requests: int = 64
    new_tokens: int = 16
    image_sizes: tuple[tuple[int, int], ...] = ((448, 448),)  # (H, W) each; request k takes size k % len
    question: str = QUESTION
    dtype: str = "float32"
    max_model_len: int = 2048
    seed: int = 0
    engine_args: tuple[tuple[str, Any], ...] = field(default_factory=tuple)
    server: bool = False  # through vLLM's OpenAI server and the openai client, not AsyncLLM in this process
    frames: int | None = None  # every request one video of that many frames of the one size (None: an image)
    log_folder: str | None = None  # where each server's output goes (a new temporary folder by default)

    def settings(self, variant: str, text_tokens: int) -> Settings | None:
        from ficoco.methods.registry import METHODS

        if variant in ("vanilla", EVS):
            return None
        own = METHODS[variant].hyperparameters if variant in METHODS else {}
        # A pixel-counted method has no budget: every image keeps its own count (the report's prompt tokens).
        budget = {} if variant in PIXEL_COUNTED else {"keep": self.keep, "tflops": self.tflops}
        return Settings.parse({"method": variant, **budget, "text_tokens": text_tokens,
                               "first_layer": self.first_layer if variant == "v" else None,
                               "hp": {name: value for name, value in self.hp if name in own}})


def _size(config: BenchConfig, index: int) -> tuple[int, int]:
    """Request `index`'s image (or frame) size, (H, W): the sizes in turn."""
    return config.image_sizes[index % len(config.image_sizes)]


def _images(config: BenchConfig) -> list[Any]:
    """One deterministic image per request of the whole run (different content; the sizes in turn): every level's
    requests are new to the engine, so that no level is served from vLLM's prefix or encoder cache of an earlier
    one (the same image and prompt again would skip its prefill)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(config.seed)
    images = []
    for index in range(config.requests * len(config.concurrency) + WARM_UP):  # the last ones warm the engine up
        height, width = _size(config, index)
        coarse = rng.random((height // 16 + 1, width // 16 + 1, 3))
        big = np.kron(coarse, np.ones((16, 16, 1)))[:height, :width]
        noise = rng.random((height, width, 3))
        images.append(Image.fromarray(((0.8 * big + 0.2 * noise) * 255).astype(np.uint8)))
    return images


def _videos(config: BenchConfig) -> list[Any]:
    """One video per request of the whole run, as vLLM takes a decoded one: `frames` frames of `_images`' kind (a
    different picture each, slightly moved frame to frame) and their metadata."""
    import numpy as np

    assert config.frames is not None and len(config.image_sizes) == 1
    height, width = config.image_sizes[0]
    rng = np.random.default_rng(config.seed)
    videos = []
    for _ in range(config.requests * len(config.concurrency) + WARM_UP):
        coarse = rng.random((height // 16 + 2, width // 16 + 2, 3))
        big = np.kron(coarse, np.ones((16, 16, 1)))
        frames = []
        for index in range(config.frames):
            shift = index * 2  # the scene pans two pixels a frame: neighbouring slices alike, as in a video
            noise = rng.random((height, width, 3))
            frames.append(((0.8 * big[shift // 16:][:height, shift:][:, :width] + 0.2 * noise) * 255).astype(np.uint8))
        metadata = {"fps": FPS, "duration": config.frames / FPS, "total_num_frames": config.frames,
                    "frames_indices": list(range(config.frames)), "video_backend": "opencv", "do_sample_frames": False}
        videos.append((np.stack(frames), metadata))
    return videos


def evs_rate(tokens_per_slice: int, slices: int, kept: int) -> tuple[float, int]:
    """vLLM's EVS `video_pruning_rate` that keeps `kept` of a video's `slices` x `tokens_per_slice` tokens, and the
    count EVS then keeps: at least a slice's tokens (EVS keeps the first slice whole), else int(total x (1 - q))
    (vLLM's `compute_retained_tokens_count`; q set half a token high so that the int lands on `kept`)."""
    total = tokens_per_slice * slices
    if kept >= total:
        return 0.0, total
    rate = 1.0 - (kept + 0.5) / total
    return rate, max(tokens_per_slice, int(total * (1.0 - rate)))


def _prompt(model: str, question: str, media: str = "image") -> tuple[str, int, Any]:
    """The question with one image (or video) placeholder in the checkpoint's chat template, its text tokens, and
    the checkpoint's config."""
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(model, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(model, local_files_only=True)
    template = getattr(tokenizer, "chat_template", None)
    chat = Path(model) / "chat_template.jinja"
    if template is None and chat.is_file():
        template = chat.read_text()
    if template is None:
        raise FicocoError(f"model={model}: the checkpoint has no chat template to lay the request out with")
    text = tokenizer.apply_chat_template([{"role": "user", "content": [{"type": media},
                                                                      {"type": "text", "text": question}]}],
                                         chat_template=template, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    placeholder = config.video_token_id if media == "video" else config.image_token_id
    if media == "video" and placeholder not in ids:
        raise FicocoError(f"model={model}: the checkpoint's chat template writes no video placeholder; give a "
                          "checkpoint whose template lays a video out")
    return text, sum(1 for token in ids if token != placeholder), config


def image_backend(processor: Any) -> str:
    """What resizes and normalises an image processor's pixels: transformers 5's processors inherit a backend
    (torchvision's tensors or PIL's images), and the two resize a picture differently (up to 0.29 in a normalised
    pixel at 410x230), which moves log-probabilities and kept groups; the class name where neither is found."""
    for cls in type(processor).__mro__:
        if cls.__name__ == "TorchvisionBackend":
            return "torchvision"
        if cls.__name__ == "PilBackend":
            return "PIL"
    return type(processor).__name__


def _layout(model: str, image: Any, config: Any) -> tuple[dict[str, Any], dict[str, str]]:
    """How the checkpoint's processor lays `image` out (what vLLM's processor makes of it: the same classes, loaded
    the same way, in the same environment): a Qwen family's patch grid (`grid_thw`), InternVL's tower tiles
    (`tiles`, the thumbnail included: vLLM hands the whole processor the image token alone and counts the
    placeholders it writes), LLaVA-OneVision's image size (`image_size`, (H, W): its AnyRes grid, unpadding and
    downscale follow from it), or nothing (LLaVA-1.5's one fixed square); and that image processor's class and
    backend."""
    from transformers import AutoImageProcessor, AutoProcessor

    if config.model_type == "internvl":
        whole = AutoProcessor.from_pretrained(model, local_files_only=True)
        ids = whole(text=whole.image_token, images=[image], return_tensors="pt")["input_ids"][0]
        layout: dict[str, Any] = {"tiles": int((ids == whole.image_token_id).sum()) // int(whole.image_seq_length)}
        processor = whole.image_processor
    else:
        processor = AutoImageProcessor.from_pretrained(model, local_files_only=True)
        made = processor(images=[image], return_tensors="pt")
        layout = {"grid_thw": [int(x) for x in made["image_grid_thw"][0]]} if "image_grid_thw" in made else {}
        if config.model_type == "llava_onevision":
            layout = {"image_size": [int(x) for x in made["image_sizes"][0]]}
    return layout, {"class": type(processor).__name__, "backend": image_backend(processor)}


def _video_layout(model: str, video: Any) -> tuple[dict[str, Any], dict[str, str]]:
    """How the checkpoint's video processor lays a benchmark video out (its `grid_thw`: temporal slices, patch
    rows and columns), and that processor's class and backend."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(model, local_files_only=True).video_processor
    frames, _ = video
    made = processor(videos=[frames], return_tensors="pt", do_sample_frames=False)
    return ({"grid_thw": [int(x) for x in made["video_grid_thw"][0]]},
            {"class": type(processor).__name__, "backend": image_backend(processor)})


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if len(ordered) == 1:
        return ordered[0]
    return float(statistics.quantiles(ordered, n=100, method="inclusive")[round(q) - 1])


async def _level(engine: Any, prompts: list[dict[str, Any]], concurrency: int, new_tokens: int) -> dict[str, Any]:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)
    gate = asyncio.Semaphore(concurrency)
    ttft: list[float] = []
    tokens: list[int] = []
    prompt_tokens: list[int] = []

    async def one(index: int, prompt: dict[str, Any]) -> None:
        async with gate:
            start = time.perf_counter()
            first = None
            count = 0
            async for output in engine.generate(prompt, params, request_id=f"r{concurrency}-{index}-{time.time_ns()}"):
                if first is None and output.outputs and output.outputs[0].token_ids:
                    first = time.perf_counter() - start
                    prompt_tokens.append(len(output.prompt_token_ids or []))
                count += len(output.outputs[0].token_ids) if output.outputs else 0
            ttft.append(first if first is not None else time.perf_counter() - start)
            tokens.append(count)

    start = time.perf_counter()
    await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    return _summary(concurrency, len(prompts), time.perf_counter() - start, ttft, tokens, prompt_tokens)


def _summary(concurrency: int, requests: int, wall: float, ttft: list[float], tokens: list[int],
             prompt_tokens: list[int]) -> dict[str, Any]:
    """A level's figures from its requests' times to first token, output and prompt tokens, and its wall time."""
    return {"concurrency": concurrency, "requests": requests, "wall_s": wall,
            "ttft_p50_s": _percentile(ttft, 50), "ttft_p90_s": _percentile(ttft, 90),
            "requests_per_s": requests / wall, "output_tokens_per_s": sum(tokens) / wall,
            "output_tokens": sum(tokens), "prompt_tokens_per_request": statistics.mean(prompt_tokens)
            if prompt_tokens else None, "ttft_s": ttft}


async def _level_http(client: Any, model: str, requests: list[list[dict[str, Any]]], concurrency: int,
                      new_tokens: int) -> dict[str, Any]:
    """One level through the OpenAI server: streamed chat completions, at most `concurrency` in flight."""
    gate = asyncio.Semaphore(concurrency)
    ttft: list[float] = []
    tokens: list[int] = []
    prompt_tokens: list[int] = []

    async def one(messages: list[dict[str, Any]]) -> None:
        async with gate:
            start = time.perf_counter()
            first = None
            stream = await client.chat.completions.create(
                model=model, messages=messages, max_tokens=new_tokens, temperature=0, stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
            async for chunk in stream:
                if first is None and chunk.choices:
                    first = time.perf_counter() - start
                if chunk.usage is not None:
                    tokens.append(int(chunk.usage.completion_tokens))
                    prompt_tokens.append(int(chunk.usage.prompt_tokens))
            ttft.append(first if first is not None else time.perf_counter() - start)

    start = time.perf_counter()
    await asyncio.gather(*(one(messages) for messages in requests))
    return _summary(concurrency, len(requests), time.perf_counter() - start, ttft, tokens, prompt_tokens)


def _engine(config: BenchConfig, settings: Settings | None, flags: dict[str, Any]) -> Any:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    args = AsyncEngineArgs(model=config.model, **flags,
                           hf_overrides={} if settings is None else {SETTINGS_KEY: settings.to_json()})
    return AsyncLLM.from_engine_args(args)


async def _levels(config: BenchConfig, requests: list[Any], level: Callable[..., Any]) -> list[dict[str, Any]]:
    """Every level of one variant, after its warm-up: the warm-up requests at up to 4 in flight, so that the first
    level is not the one that pays for first allocations, then one alone; `level(requests, concurrency)` runs one,
    each level on requests of its own (`_images`)."""
    warm = requests[-WARM_UP:]
    await level(warm, min(4, len(warm)))
    await level(warm[:1], 1)
    n = config.requests
    return [await level(requests[i * n:(i + 1) * n], concurrency) for i, concurrency in enumerate(config.concurrency)]


async def _serve(config: BenchConfig, settings: Settings | None, prompts: list[dict[str, Any]],
                 flags: dict[str, Any]) -> tuple[list[dict[str, Any]], float]:
    """One engine for one variant: started, warmed up, run at every level (`_levels`), shut down; the levels'
    figures and the engine's start time."""
    began = time.perf_counter()
    engine = _engine(config, settings, flags)
    started = time.perf_counter() - began
    try:
        return await _levels(config, prompts, lambda requests, concurrency: _level(
            engine, requests, concurrency, config.new_tokens)), started
    finally:
        engine.shutdown()


def _engine_flags(config: BenchConfig, evs: float | None = None) -> dict[str, Any]:
    """The engine arguments a variant's engine or server starts with (vLLM's Python names; the server takes them as
    flags): every variant's, and EVS's pruning rate for its own."""
    media = {"image": 0, "video": 1} if config.frames else {"image": 1, "video": 0}
    own = {} if evs is None else {"video_pruning_rate": evs}
    return {"dtype": config.dtype, "enforce_eager": True, "max_model_len": config.max_model_len,
            "max_num_seqs": max(config.concurrency), "limit_mm_per_prompt": media,
            "seed": config.seed, **dict(config.engine_args), **own}


async def _serve_http(config: BenchConfig, settings: Settings | None, requests: list[list[dict[str, Any]]],
                      log_path: Path, flags: dict[str, Any]) -> tuple[list[dict[str, Any]], float, str]:
    """One variant through vLLM's OpenAI server: started with the method in `--hf-overrides`, warmed up and run at
    every level (`_levels`), stopped; the levels' figures, its start time and its launcher."""
    from openai import AsyncOpenAI

    from ficoco.serving.vllm.server import start_server

    server = start_server(config.model, log_path, settings=None if settings is None else settings.to_json(),
                          engine=flags)
    try:
        async with AsyncOpenAI(base_url=server.url, api_key="ficoco", max_retries=0, timeout=3600.0) as client:
            levels = await _levels(config, requests, lambda chats, concurrency: _level_http(
                client, config.model, chats, concurrency, config.new_tokens))
        return levels, server.started_s, server.launcher
    finally:
        server.stop()


def server_command_line(config: BenchConfig, settings: Settings | None, flags: dict[str, Any] | None = None
                        ) -> list[str]:
    """The command a variant's server runs, as a user would type it (the port is chosen when it starts)."""
    from ficoco.serving.vllm.server import flag_name, server_command

    command, _ = server_command(config.model, port=0, settings=None if settings is None else settings.to_json(),
                                engine=_engine_flags(config) if flags is None else flags)
    at = command.index(flag_name("port")) + 1  # the port is a free one, chosen when the server starts
    return ["python" if part == sys.executable else part for part in command[:at]] + ["PORT"] + command[at + 1:]


def _variant_plan(config: BenchConfig, variant: str, settings: Settings | None, grid: tuple[int, ...] | None,
                  config_json: str, patch: int, text_tokens: int, layout: dict[str, Any], evs: dict[str, Any]
                  ) -> tuple[int, float | None, dict[str, Any]]:
    """A variant's visual tokens and TFLOPs per request (the accountant's plan; EVS's count is vLLM's, its TFLOPs
    not counted) and its engine's flags; EVS's rate and count go into `evs` for the report."""
    if not config.frames:
        plan = plan_image(config_json, settings, grid, patch, text_tokens=text_tokens, tiles=layout.get("tiles"),
                          image_size=layout.get("image_size"))
        return plan.tokens, plan.tflops, _engine_flags(config)
    assert grid is not None
    t, h, w = grid
    merge = int(json.loads(config_json).get("vision_config", {}).get("spatial_merge_size", 2))
    per_slice = h * w // merge**2
    if variant != EVS:
        plan = plan_video(config_json, settings, (t, h, w), patch, text_tokens=text_tokens)
        return plan.tokens, plan.tflops, _engine_flags(config)
    # EVS at the methods' count: keep per slice (the count every method keeps), else a slice's tokens.
    wanted = t * min(config.keep or per_slice, per_slice)
    rate, kept = evs_rate(per_slice, t, wanted)
    evs.update({"video_pruning_rate": rate, "tokens": kept, "wanted_tokens": wanted,
                "note": "EVS keeps the first temporal slice whole: fewer tokens than one slice's are not reachable"
                        if kept != wanted else "the methods' count"})
    return kept, None, _engine_flags(config, evs=rate)


def _size_name(size: tuple[int, int]) -> str:
    return f"{size[1]}x{size[0]}"  # WxH, as --image-size takes it


def _level_plan(config: BenchConfig, plans: dict[tuple[int, int], tuple[int, float | None]], level: int
                ) -> dict[str, Any]:
    """A level's visual tokens and TFLOPs per request: the plan of its one size, or with several sizes the mean over
    the level's own requests (each size's plan beside it)."""
    if len(plans) == 1:
        tokens, tflops = next(iter(plans.values()))
        return {"visual_tokens_per_request": tokens, "tflops_per_request": tflops}
    n = config.requests
    chosen = [plans[_size(config, k)] for k in range(level * n, (level + 1) * n)]
    return {"visual_tokens_per_request": statistics.mean(plan[0] for plan in chosen),
            "tflops_per_request": None if chosen[0][1] is None else statistics.mean(plan[1] for plan in chosen),
            "per_size": {_size_name(size): {"visual_tokens": plan[0], "tflops": plan[1]}
                         for size, plan in plans.items()}}


def run_bench(config: BenchConfig, progress: Callable[[str], None] = lambda line: None) -> dict[str, Any]:
    """Run every variant at every level: the body of a `ficoco.serve/1` report (config, rows per variant and
    level, engine start times, vLLM's version); the caller adds the schema and the machine's environment
    (`ficoco serve-bench` does), which this room does not know."""
    if not Path(config.model).is_dir():
        raise FicocoError(f"model={config.model}: give a local checkpoint folder (vLLM loads its weights)")
    if EVS in config.variants and not config.frames:
        raise FicocoError("variant=evs: vLLM's EVS prunes videos; give frames= (a video workload) or drop evs")
    if config.frames and len(config.image_sizes) > 1:
        raise FicocoError("image_sizes: a video workload takes one frame size; give one size with frames=")
    media = "video" if config.frames else "image"
    items = _videos(config) if config.frames else _images(config)
    text, text_tokens, hf_config = _prompt(config.model, config.question, media)
    sizes = list(dict.fromkeys(config.image_sizes))
    layouts = {}  # (H, W) -> (the processor's layout of that size, the processor)
    for size in sizes:
        first = items[config.image_sizes.index(size)]  # request k has size k % len: the first of each size
        layouts[size] = (_video_layout(config.model, first) if config.frames else
                         _layout(config.model, first, hf_config))
    processor = layouts[sizes[0]][1]
    prompts = [{"prompt": text, "multi_modal_data": {media: item}} for item in items]
    if config.server:
        from ficoco.serving.vllm.server import chat_messages, data_url, video_data_url

        chats = [chat_messages([video_data_url(*item) if config.frames else data_url(item)], config.question, media)
                 for item in items]
        logs = Path(config.log_folder) if config.log_folder else Path(tempfile.mkdtemp(prefix="ficoco-serve-"))
    launcher = None
    config_json = json.dumps({k: v for k, v in hf_config.to_dict().items() if k != SETTINGS_KEY}, sort_keys=True,
                             default=str)
    patch = hf_config.vision_config.patch_size  # InternVL's config gives (height, width)
    patch = int(patch[0] if isinstance(patch, (list, tuple)) else patch)
    rows: list[dict[str, Any]] = []
    starts: dict[str, float] = {}
    evs: dict[str, Any] = {}
    for variant in config.variants:
        settings = config.settings(variant, text_tokens)
        plans = {}  # (H, W) -> (visual tokens, TFLOPs) per request of that size
        for size in sizes:
            layout = layouts[size][0]
            grid = tuple(layout["grid_thw"]) if "grid_thw" in layout else None
            tokens, tflops, flags = _variant_plan(config, variant, settings, grid, config_json, patch, text_tokens,
                                                  layout, evs)
            plans[size] = (tokens, tflops)  # every size's engine flags are the same
        counted = "at most " if variant in PIXEL_COUNTED else ""  # planned at every group; each image its own
        counts = sorted({plan[0] for plan in plans.values()})
        costs = sorted({plan[1] for plan in plans.values() if plan[1] is not None})
        span = str(counts[0]) if len(counts) == 1 else f"{counts[0]}-{counts[-1]}"
        cost = ("TFLOPs not counted" if not costs else f"{costs[0]:.4g} TFLOPs" if len(costs) == 1 else
                f"{costs[0]:.4g}-{costs[-1]:.4g} TFLOPs")
        progress(f"{variant}: starting an engine ({counted}{span} visual tokens per request, {cost})")
        if config.server:
            log = logs / f"server-{variant}.log"
            progress(f"{variant}: {shlex.join(server_command_line(config, settings, flags))} (output in {log})")
            measured_levels, starts[variant], launcher = asyncio.run(
                _serve_http(config, settings, chats, log, flags))
        else:
            measured_levels, starts[variant] = asyncio.run(_serve(config, settings, prompts, flags))
        gc.collect()  # the engine's last references, while vLLM's modules are still there to shut it down
        for index, measured in enumerate(measured_levels):
            rows.append({"variant": variant, "settings": None if settings is None else settings.to_json(),
                         **_level_plan(config, plans, index), **measured})
            progress(f"{variant} x{measured['concurrency']}: {measured['requests_per_s']:.2f} requests/s, "
                     f"TTFT p50 {measured['ttft_p50_s'] * 1000:.0f} ms")
    layout_report = (layouts[sizes[0]][0] if len(sizes) == 1 else
                     {"layouts": {_size_name(size): layouts[size][0] for size in sizes}})
    import vllm

    served = {"launcher": launcher} if launcher else {}
    if evs:
        served["evs"] = evs
    return {"config": {**asdict(config), "text_tokens": text_tokens, **layout_report,
                       ("video_processor" if config.frames else "image_processor"): processor}, **served,
            "vllm": vllm.__version__, "engine_start_s": starts, "rows": rows,
            "note": "random weights: the figures measure the engine and the reduction, never accuracy"}
