"""`ficoco serve-bench`'s measurement (knows vLLM): vanilla and every method on the same requests, each in its
own vLLM engine (`AsyncLLM`), at every concurrency level; per level time to first token (p50, p90),
requests/s and output tokens/s, beside the accountant's TFLOPs and visual tokens per request.

A level runs `requests` requests with at most `concurrency` of them in flight (a new one starts when one
ends), after one warm-up request; time to first token is from a request's submission to its first output
token, throughputs are over the level's wall time. Every request holds one image of `image_size` (a different
one per request, the same grid) and the same question, and generates exactly `new_tokens` tokens (EOS ignored),
so that every variant decodes the same amount.
"""

from __future__ import annotations

import asyncio
import gc
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ficoco.errors import FicocoError
from ficoco.serving.vllm.settings import PIXEL_COUNTED, SETTINGS_KEY, Settings, plan_image

DEFAULT_CONCURRENCY = (1, 4, 16, 32)
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
    image_size: tuple[int, int] = (448, 448)  # (H, W)
    question: str = QUESTION
    dtype: str = "float32"
    max_model_len: int = 2048
    seed: int = 0
    engine_args: tuple[tuple[str, Any], ...] = field(default_factory=tuple)

    def settings(self, variant: str, text_tokens: int) -> Settings | None:
        from ficoco.methods.registry import METHODS

        if variant == "vanilla":
            return None
        own = METHODS[variant].hyperparameters if variant in METHODS else {}
        # A pixel-counted method has no budget: every image keeps its own count (the report's prompt tokens).
        budget = {} if variant in PIXEL_COUNTED else {"keep": self.keep, "tflops": self.tflops}
        return Settings.parse({"method": variant, **budget, "text_tokens": text_tokens,
                               "first_layer": self.first_layer if variant == "v" else None,
                               "hp": {name: value for name, value in self.hp if name in own}})


def _images(config: BenchConfig) -> list[Any]:
    """One deterministic image per request (different content, the same size)."""
    import numpy as np
    from PIL import Image

    height, width = config.image_size
    rng = np.random.default_rng(config.seed)
    images = []
    for _ in range(config.requests + WARM_UP):  # the last ones warm the engine up
        coarse = rng.random((height // 16 + 1, width // 16 + 1, 3))
        big = np.kron(coarse, np.ones((16, 16, 1)))[:height, :width]
        noise = rng.random((height, width, 3))
        images.append(Image.fromarray(((0.8 * big + 0.2 * noise) * 255).astype(np.uint8)))
    return images


def _prompt(model: str, question: str) -> tuple[str, int, Any]:
    """The question with one image placeholder in the checkpoint's chat template, its text tokens, and the
    checkpoint's config."""
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(model, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(model, local_files_only=True)
    template = getattr(tokenizer, "chat_template", None)
    chat = Path(model) / "chat_template.jinja"
    if template is None and chat.is_file():
        template = chat.read_text()
    if template is None:
        raise FicocoError(f"model={model}: the checkpoint has no chat template to lay the request out with")
    text = tokenizer.apply_chat_template([{"role": "user", "content": [{"type": "image"},
                                                                      {"type": "text", "text": question}]}],
                                         chat_template=template, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    image_id = config.image_token_id
    return text, sum(1 for token in ids if token != image_id), config


def _grid(model: str, image: Any) -> tuple[int, int, int]:
    """The patch grid the checkpoint's image processor makes of `image` (what vLLM's processor makes of it)."""
    from transformers import AutoImageProcessor

    processor = AutoImageProcessor.from_pretrained(model, local_files_only=True)
    t, h, w = (int(x) for x in processor(images=[image], return_tensors="pt")["image_grid_thw"][0])
    return t, h, w


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
    wall = time.perf_counter() - start
    return {"concurrency": concurrency, "requests": len(prompts), "wall_s": wall,
            "ttft_p50_s": _percentile(ttft, 50), "ttft_p90_s": _percentile(ttft, 90),
            "requests_per_s": len(prompts) / wall, "output_tokens_per_s": sum(tokens) / wall,
            "output_tokens": sum(tokens), "prompt_tokens_per_request": statistics.mean(prompt_tokens)
            if prompt_tokens else None, "ttft_s": ttft}


def _engine(config: BenchConfig, settings: Settings | None) -> Any:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    extra = dict(config.engine_args)
    args = AsyncEngineArgs(model=config.model, dtype=config.dtype, enforce_eager=True,
                           max_model_len=config.max_model_len, max_num_seqs=max(config.concurrency),
                           limit_mm_per_prompt={"image": 1, "video": 0}, seed=config.seed,
                           hf_overrides={} if settings is None else {SETTINGS_KEY: _settings_json(settings)},
                           **extra)
    return AsyncLLM.from_engine_args(args)


async def _serve(config: BenchConfig, settings: Settings | None, prompts: list[dict[str, Any]]
                 ) -> tuple[list[dict[str, Any]], float]:
    """One engine for one variant: started, warmed up (the warm-up requests at up to 4 in flight, so that the
    first level is not the one that pays for first allocations), run at every level, shut down; the levels' figures
    and the engine's start time."""
    began = time.perf_counter()
    engine = _engine(config, settings)
    started = time.perf_counter() - began
    try:
        warm = prompts[-WARM_UP:]
        await _level(engine, warm, min(4, len(warm)), config.new_tokens)
        await _level(engine, warm[:1], 1, config.new_tokens)
        return [await _level(engine, prompts[:-WARM_UP], level, config.new_tokens) for level in config.concurrency], \
            started
    finally:
        engine.shutdown()


def _settings_json(settings: Settings) -> dict[str, Any]:
    out = settings.to_json()
    if settings.text_tokens is not None:
        out["text_tokens"] = settings.text_tokens
    return out


def run_bench(config: BenchConfig, progress: Callable[[str], None] = lambda line: None) -> dict[str, Any]:
    """Run every variant at every level: the body of a `ficoco.serve/1` report (config, rows per variant and
    level, engine start times, vLLM's version); the caller adds the schema and the machine's environment
    (`ficoco serve-bench` does), which this room does not know."""
    if not Path(config.model).is_dir():
        raise FicocoError(f"model={config.model}: give a local checkpoint folder (vLLM loads its weights)")
    text, text_tokens, hf_config = _prompt(config.model, config.question)
    images = _images(config)
    grid = _grid(config.model, images[0])
    prompts = [{"prompt": text, "multi_modal_data": {"image": image}} for image in images]
    config_json = json.dumps({k: v for k, v in hf_config.to_dict().items() if k != SETTINGS_KEY}, sort_keys=True,
                             default=str)
    patch = int(hf_config.vision_config.patch_size)
    rows: list[dict[str, Any]] = []
    starts: dict[str, float] = {}
    for variant in config.variants:
        settings = config.settings(variant, text_tokens)
        plan = plan_image(config_json, settings, grid, patch, text_tokens=text_tokens)
        tokens, tflops = plan.tokens, plan.tflops
        counted = "at most " if variant in PIXEL_COUNTED else ""  # planned at every group; each image its own
        progress(f"{variant}: starting an engine ({counted}{tokens} visual tokens per request, {tflops:.4g} TFLOPs)")
        measured_levels, starts[variant] = asyncio.run(_serve(config, settings, prompts))
        gc.collect()  # the engine's last references, while vLLM's modules are still there to shut it down
        for measured in measured_levels:
            rows.append({"variant": variant, "settings": None if settings is None else settings.to_json(),
                         "visual_tokens_per_request": tokens, "tflops_per_request": tflops, **measured})
            progress(f"{variant} x{measured['concurrency']}: {measured['requests_per_s']:.2f} requests/s, "
                     f"TTFT p50 {measured['ttft_p50_s'] * 1000:.0f} ms")
    import vllm

    return {"config": {**asdict(config), "text_tokens": text_tokens, "grid_thw": list(grid)},
            "vllm": vllm.__version__, "engine_start_s": starts, "rows": rows,
            "note": "random weights: the figures measure the engine and the reduction, never accuracy"}
