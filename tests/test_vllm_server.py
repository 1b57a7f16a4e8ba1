"""ficoco's vLLM plugin behind vLLM's OpenAI server, driven by the `openai` client as users deploy it: the server is
started as `ficoco serve-bench --server` starts it (`ficoco.serving.vllm.server`: `vllm serve`, or its server module
where the CPU build's `vllm` command fails) with VisionZip chosen in `--hf-overrides`, chunked prefill in 12-token
chunks (the first ends inside the image's span) and prefix caching on (32-token blocks); requests are chat
completions with images as data URLs.

Checked: a request's tokens and first-token log-probabilities are `ficoco.apply`'s on the transformers model (the
reference the `LLM` API's tokens equal in tests/test_vllm_plugin.py), streamed or not; a request the plugin cannot
reduce (an image too small for the keep, a video whose slices are, a broken image) fails alone with one line while the
server goes on;
the same image twice hits the prefix cache with the same tokens; 64 concurrent requests of two image sizes with one
broken image among them: that one fails, every other is served with its image's tokens.

Runs in vLLM's own venv (benchmarks/vllm_env.sh), in the lean set too; skipped elsewhere.
"""

from __future__ import annotations

import asyncio
import json
import os
import urllib.request
from pathlib import Path
from typing import Any

import pytest

vllm = pytest.importorskip("vllm", reason="the vLLM plugin's tests run in vLLM's venv (benchmarks/vllm_env.sh)")
openai = pytest.importorskip("openai", reason="the server is driven with the openai client (vLLM brings it)")

from helpers import make_checkpoint  # noqa: E402

pytestmark = pytest.mark.vllm

FAMILY, METHOD, KEEP = "qwen2_5_vl", "visionzip", 8
# The tiny Qwen2.5-VL vLLM's CPU attention serves (head_dim 32), as in tests/test_vllm_plugin.py.
OVERRIDES = {"text_config.num_attention_heads": 2, "text_config.num_key_value_heads": 1,
             "text_config.rope_scaling.mrope_section": [4, 6, 6]}
SIZES = ((112, 140), (168, 112))  # (width, height): 10x8 patches (20 groups) and 12x8 (24)
QUESTION = "What is shown here?"
# A prompt of several 32-token cache blocks (the server's block size), so that the image's blocks are whole and cached.
LONG_QUESTION = " ".join(["Describe every shape, colour and edge of the picture, and where each of them lies."] * 4)
NEW_TOKENS = 4
CHUNK = 12  # prefill chunks of 12 tokens: the first ends inside the image's span (tokens 7-14 of its prompt)
TOP = 5
BROKEN = "data:image/png;base64," + "bm90IGFuIGltYWdl"  # "not an image"


def picture(size: tuple[int, int], seed: int = 0) -> Any:
    """A deterministic image with structure at every scale (random weights separate its patches)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    width, height = size
    coarse = rng.random((height // 8 + 1, width // 8 + 1, 3))
    big = np.kron(coarse, np.ones((8, 8, 1)))[:height, :width]
    return Image.fromarray(((0.7 * big + 0.3 * rng.random((height, width, 3))) * 255).astype(np.uint8))


def reference(folder: Path, image: Any, question: str = QUESTION) -> dict[str, Any]:
    """ficoco.apply on the transformers model of `folder`: the first tokens and the first token's top
    log-probabilities."""
    import torch

    import ficoco
    from ficoco.models.prompt import encode_request, load_processor

    model = ficoco.build_model(str(folder), weights=str(folder), dtype="fp32", check_memory=False)
    prompt = encode_request(load_processor(str(folder)), model.config.to_dict(), question=question, pictures=[image],
                            media="image")
    with torch.inference_mode(), ficoco.apply(model, variant=METHOD, image_size=prompt.image_size, keep=KEEP):
        ids = model.generate(**prompt.encoded, max_new_tokens=NEW_TOKENS, do_sample=False)
        logits = model(**prompt.encoded).logits[0, -1]
    top = torch.log_softmax(logits.float(), dim=-1).topk(TOP)
    return {"tokens": ids[0, -NEW_TOKENS:].tolist(),
            "top": dict(zip(top.indices.tolist(), top.values.tolist(), strict=True))}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The tiny checkpoint and vLLM's OpenAI server on it with VisionZip (keep 8), as serve-bench starts it."""
    from ficoco.serving.vllm.server import start_server

    root = tmp_path_factory.mktemp("vllm-server")
    folder = make_checkpoint(FAMILY, root / FAMILY, overrides=OVERRIDES)
    server = start_server(str(folder), root / "server.log", settings={"method": METHOD, "keep": KEEP},
                          engine={"dtype": "float32", "enforce_eager": True, "max_model_len": 1024, "max_num_seqs": 8,
                                  "seed": 0, "limit_mm_per_prompt": {"image": 1, "video": 1},
                                  "enable_chunked_prefill": True, "max_num_batched_tokens": CHUNK,
                                  "enable_prefix_caching": True, "block_size": 32})
    yield folder, server
    server.stop()


def _request(image_url: str, question: str = QUESTION) -> dict[str, Any]:
    from ficoco.serving.vllm.server import chat_messages

    return {"messages": chat_messages([image_url], question), "max_tokens": NEW_TOKENS, "temperature": 0,
            "extra_body": {"ignore_eos": True, "return_token_ids": True}}


def _tokens(response: Any) -> list[int]:
    return list(response.model_dump()["choices"][0]["token_ids"])


def test_a_chat_request_gets_ficoco_applys_tokens_streamed_or_not(served: Any) -> None:
    from ficoco.serving.vllm.server import data_url

    folder, server = served
    image = picture(SIZES[0], 0)
    ref = reference(folder, image)
    client = openai.OpenAI(base_url=server.url, api_key="ficoco", max_retries=0)
    request = _request(data_url(image))
    request["extra_body"]["return_tokens_as_token_ids"] = True
    answer = client.chat.completions.create(model=str(folder), logprobs=True, top_logprobs=TOP, **request)
    assert _tokens(answer) == ref["tokens"]
    first = answer.choices[0].logprobs.content[0].top_logprobs
    top = {int(entry.token.split(":", 1)[1]): entry.logprob for entry in first}
    assert set(ref["top"]) <= set(top)
    assert all(abs(top[token] - value) < 5e-6 for token, value in ref["top"].items())
    # The prompt the server laid out from the chat: the image's 8 kept placeholders, not its 20 groups.
    prompt = answer.model_dump()["prompt_token_ids"]
    span = [index for index, token in enumerate(prompt) if token == folder_image_token(folder)]
    assert len(span) == KEEP
    # Its prefill ran in CHUNK-token chunks, one of which ended inside the image's span.
    assert any(span[0] < end <= span[-1] for end in range(CHUNK, len(prompt), CHUNK)), span
    # Streamed: the same text, chunk by chunk, and the usage of the same tokens.
    chunks = list(client.chat.completions.create(model=str(folder), stream=True,
                                                 stream_options={"include_usage": True}, **_request(data_url(image))))
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    assert text == answer.choices[0].message.content
    assert sum(1 for chunk in chunks if chunk.choices) >= 2
    assert chunks[-1].usage.completion_tokens == NEW_TOKENS and chunks[-1].usage.prompt_tokens == len(prompt)


def folder_image_token(folder: Path) -> int:
    return int(json.loads((folder / "config.json").read_text())["image_token_id"])


def _video_url(side: int) -> str:
    """A tiny mp4 (four side x side frames, 2 a second) as a data URL."""
    import numpy as np

    from ficoco.serving.vllm.server import video_data_url

    frames = np.stack([np.asarray(picture((side, side), 10 + index)) for index in range(4)])
    return video_data_url(frames, {"fps": 2.0})


def test_a_request_the_plugin_cannot_reduce_fails_alone_in_one_line(served: Any) -> None:
    from ficoco.serving.vllm.server import data_url

    folder, server = served
    client = openai.OpenAI(base_url=server.url, api_key="ficoco", max_retries=0)
    image = picture(SIZES[1], 5)
    ref = reference(folder, image)
    small = picture((28, 28), 3)  # one 56x56 processed image: 4 merge groups, fewer than the 8 kept
    # A video of 56x56 frames: temporal slices of 4 merge groups each, fewer than the 8 every slice keeps.
    clip = {"type": "video_url", "video_url": {"url": _video_url(56)}}
    video = {"messages": [{"role": "user", "content": [clip, {"type": "text", "text": QUESTION}]}],
             "max_tokens": NEW_TOKENS}
    cases = [(_request(data_url(small)), "cannot be reduced with visionzip"),
             (video, "this request's video (as processed, 2 temporal slices of 4x4 patches) cannot be reduced"),
             (_request(BROKEN), "")]
    for request, words in cases:
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model=str(folder), **request)
        message = caught.value.body.get("message", "") if isinstance(caught.value.body, dict) else str(caught.value)
        assert words in message and "\n" not in message.strip()
        # ... and the server goes on serving the others, unchanged.
        assert server.alive()
        assert _tokens(client.chat.completions.create(model=str(folder), **_request(data_url(image)))) == \
            ref["tokens"]


def _metric(server: Any, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=10) as answer:  # noqa: S310
        lines = answer.read().decode().splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(name + "{") or
               line.startswith(name + " "))


def test_the_same_image_twice_hits_the_prefix_cache_with_the_same_tokens(served: Any) -> None:
    from ficoco.serving.vllm.server import data_url

    folder, server = served
    image = picture(SIZES[0], 7)
    ref = reference(folder, image, LONG_QUESTION)
    client = openai.OpenAI(base_url=server.url, api_key="ficoco", max_retries=0)
    first = _tokens(client.chat.completions.create(model=str(folder), **_request(data_url(image), LONG_QUESTION)))
    hits = _metric(server, "vllm:prefix_cache_hits_total")
    second = _tokens(client.chat.completions.create(model=str(folder), **_request(data_url(image), LONG_QUESTION)))
    assert _metric(server, "vllm:prefix_cache_hits_total") > hits
    assert first == second == ref["tokens"]


def test_sixty_four_concurrent_requests_with_one_broken_image(served: Any) -> None:
    from ficoco.serving.vllm.server import data_url

    folder, server = served
    images = [picture(SIZES[index % 2], 20 + index) for index in range(4)]  # two sizes, four pictures
    refs = [reference(folder, image)["tokens"] for image in images]
    urls = [data_url(image) for image in images]
    broken_at = 37

    async def send_all() -> list[Any]:
        async with openai.AsyncOpenAI(base_url=server.url, api_key="ficoco", max_retries=0, timeout=600) as client:
            requests = [_request(BROKEN if index == broken_at else urls[index % 4]) for index in range(64)]
            return await asyncio.gather(*(client.chat.completions.create(model=str(folder), **request)
                                          for request in requests), return_exceptions=True)

    answers = asyncio.run(send_all())
    failed = [index for index, answer in enumerate(answers) if isinstance(answer, BaseException)]
    assert failed == [broken_at] and isinstance(answers[broken_at], openai.BadRequestError)
    for index, answer in enumerate(answers):
        if index != broken_at:
            assert _tokens(answer) == refs[index % 4], index
    assert server.alive()


@pytest.mark.skipif(os.environ.get("FICOCO_VLLM_TESTS") == "lean", reason="two more servers: the full set only")
def test_serve_bench_through_the_server_reports_every_level(served: Any, tmp_path: Path) -> None:
    """`ficoco serve-bench --server` end to end on the tiny checkpoint: vanilla's and VisionZip's servers start,
    stream every level and stop; the report names the launcher and the image backend, and each row's prompt tokens
    are the accountant's visual tokens plus the text."""
    from ficoco.serving.vllm.bench import BenchConfig, run_bench

    folder, _ = served
    config = BenchConfig(model=str(folder), variants=("vanilla", METHOD), keep=KEEP, concurrency=(1, 2), requests=2,
                         new_tokens=2, image_sizes=((112, 140),), server=True, log_folder=str(tmp_path))
    report = run_bench(config)
    assert report["launcher"].startswith(("vllm serve", "python -m vllm.entrypoints.openai.api_server"))
    assert report["config"]["image_processor"]["backend"] in ("torchvision", "PIL")
    assert [(row["variant"], row["concurrency"]) for row in report["rows"]] == \
        [("vanilla", 1), ("vanilla", 2), (METHOD, 1), (METHOD, 2)]
    text = report["config"]["text_tokens"]
    for row in report["rows"]:
        assert row["output_tokens"] == 2 * 2 and row["requests_per_s"] > 0
        assert row["prompt_tokens_per_request"] == text + row["visual_tokens_per_request"]
    assert {row["visual_tokens_per_request"] for row in report["rows"]} == {20, KEEP}
    assert sorted(path.name for path in tmp_path.glob("server-*.log")) == ["server-vanilla.log", f"server-{METHOD}.log"]


@pytest.mark.skipif(os.environ.get("FICOCO_VLLM_TESTS") == "lean", reason="three more servers: the full set only")
def test_serve_bench_runs_a_video_workload_with_evs_beside_the_method(served: Any, tmp_path: Path) -> None:
    """`ficoco serve-bench --server --frames 8` on the tiny checkpoint: every request one video of 8 frames of
    140x112 (4 temporal slices of 20 merge groups) as an mp4 data URL; VisionZip keeps 8 per slice, and vLLM's EVS
    runs at the rate that keeps the same 32 tokens (the plugin sets the CPU runner's pruning switch EVS needs).
    Each row's prompt tokens are its visual tokens plus the text: the server laid every video out as planned."""
    from ficoco.serving.vllm.bench import EVS, BenchConfig, run_bench

    folder, _ = served
    config = BenchConfig(model=str(folder), variants=("vanilla", METHOD, EVS), keep=KEEP, concurrency=(1, 2),
                         requests=2, new_tokens=2, image_sizes=((112, 140),), frames=8, server=True,
                         log_folder=str(tmp_path))
    report = run_bench(config)
    assert report["config"]["grid_thw"] == [4, 8, 10] and report["config"]["video_processor"]["backend"]
    assert report["evs"]["tokens"] == report["evs"]["wanted_tokens"] == 4 * KEEP
    tokens = {row["variant"]: row["visual_tokens_per_request"] for row in report["rows"]}
    assert tokens == {"vanilla": 80, METHOD: 4 * KEEP, EVS: 4 * KEEP}
    text = report["config"]["text_tokens"]
    for row in report["rows"]:
        assert row["output_tokens"] == 2 * 2 and row["prompt_tokens_per_request"] == text + tokens[row["variant"]]
    assert [row["tflops_per_request"] is None for row in report["rows"]] == [False, False, False, False, True, True]
