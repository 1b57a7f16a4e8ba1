"""One evaluated run on a local checkpoint (ficoco.eval.session), without lmms-eval: requests laid out by the
checkpoint's processor and chat template, batched by layout with left padding, answered with the method
applied at the budget the accountant resolves, each sample's cost equal to `ficoco flops` for its prompt,
loglikelihoods equal to a plain forward's, and the ficoco.eval/1 record written atomically."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import make_checkpoint
from PIL import Image

import ficoco
from ficoco.errors import FicocoError
from ficoco.eval.session import EvalSession, Request, left_pad, stop_at
from ficoco.eval.settings import parse_model_args

GREEDY = {"max_new_tokens": 3, "temperature": 0, "until": ["\n\n"]}
PROFILES = {"llava": "llava-tiny", "qwen2_5_vl": "qwen2.5-vl-tiny"}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("eval-checkpoints")
    return {family: make_checkpoint(family, root / family) for family in PROFILES}


def pictures(size: tuple[int, int] = (112, 112)) -> list[Image.Image]:
    return [Image.new("RGB", size, colour) for colour in ((200, 30, 30), (30, 200, 30), (30, 30, 200))]


def session(checkpoints: dict[str, Path], family: str, tmp_path: Path, **args: Any) -> EvalSession:
    given = {"pretrained": str(checkpoints[family]), "profile": PROFILES[family], "out": str(tmp_path / "run.json"),
             **args}
    return EvalSession(parse_model_args(given))


def test_left_pad_pads_token_inputs_on_the_left_and_stacks_the_rest() -> None:
    short = {"input_ids": torch.tensor([[5, 6]]), "attention_mask": torch.ones(1, 2, dtype=torch.long),
             "pixel_values": torch.zeros(1, 3, 2, 2)}
    long = {"input_ids": torch.tensor([[7, 8, 9]]), "attention_mask": torch.ones(1, 3, dtype=torch.long),
            "pixel_values": torch.ones(1, 3, 2, 2)}
    batch = left_pad([short, long], pad_id=0)
    assert batch["input_ids"].tolist() == [[0, 5, 6], [7, 8, 9]]
    assert batch["attention_mask"].tolist() == [[0, 1, 1], [1, 1, 1]]
    assert batch["pixel_values"].shape == (2, 3, 2, 2)
    assert stop_at("red\n\nblue", ["\n\n", "."]) == "red"


@pytest.mark.parametrize(("family", "method", "budget"), [("llava", "v", {"keep": 16}), ("llava", "l", {"keep": 16}),
                                                          ("qwen2_5_vl", "v", {"keep": 8}),
                                                          ("qwen2_5_vl", "fastv", {"keep": 15})])
def test_each_sample_costs_what_ficoco_flops_says_for_its_prompt(checkpoints, tmp_path, family, method,
                                                                  budget) -> None:
    run = session(checkpoints, family, tmp_path, method=method, **budget)
    requests = [Request("What colour is it?", [p], "colours", i, dict(GREEDY)) for i, p in enumerate(pictures())]
    answers = run.generate(requests)
    assert len(answers) == 3 and all(isinstance(a, str) for a in answers)
    flops_budget = dict(budget)
    for sample in run.samples:
        size = sample["image_size"]
        report = ficoco.flops(PROFILES[family], method, text_tokens=sample["text_tokens"],
                              image_size=tuple(size) if size else None, **flops_budget)
        row = report["rows"][0]
        assert sample["visual_tokens"] == row["llm_visual_tokens"]
        assert sample["tflops"] == pytest.approx(row["tflops"], rel=1e-12)
        assert sample["schedule"] == row["schedule"]
    # The budget is resolved as `ficoco flops` resolves it at the profile's own layout (its text tokens).
    default = ficoco.flops(PROFILES[family], method, **flops_budget)["rows"][0]
    assert run.record()["schedule"] == default["schedule"]


def test_a_tflops_budget_is_resolved_at_the_profiles_text_tokens_and_each_sample_costed_at_its_own(checkpoints,
                                                                                                   tmp_path) -> None:
    vanilla = ficoco.flops("llava-tiny", "vanilla")["rows"][0]["tflops"]
    budget = round(vanilla * 0.6, 12)
    run = session(checkpoints, "llava", tmp_path, method="v", tflops=budget)
    planned = ficoco.flops("llava-tiny", "v", tflops=budget)["rows"][0]
    assert planned["tflops"] <= budget and run.record()["schedule"] == planned["schedule"]
    run.generate([Request("Colour?", [pictures()[0]], "colours", 0, dict(GREEDY))])
    sample = run.samples[0]
    assert sample["schedule"] == planned["schedule"]
    explicit = ",".join(f"{step['layer']}:{step['remove']}" for step in planned["schedule"])
    at_its_prompt = ficoco.flops("llava-tiny", "v", schedule=explicit, text_tokens=sample["text_tokens"])
    assert sample["tflops"] == pytest.approx(at_its_prompt["rows"][0]["tflops"], rel=1e-12)


@pytest.mark.parametrize("family", sorted(PROFILES))
def test_a_batch_answers_as_its_requests_alone_with_left_padding(checkpoints, tmp_path, family) -> None:
    """Prompts of different lengths in one batch (left-padded) give the answers each gives alone."""
    questions = ["Colour?", "What is the main colour of this picture, in one word?", "Name it."]
    requests = [Request(q, [p], "colours", i, dict(GREEDY))
                for i, (q, p) in enumerate(zip(questions, pictures(), strict=True))]
    budget = {"keep": 16} if family == "llava" else {"keep": 8}
    together = session(checkpoints, family, tmp_path, method="v", batch_size=3, **budget)
    alone = session(checkpoints, family, tmp_path, method="v", batch_size=1, **budget)
    assert together.generate(requests) == alone.generate(requests)
    assert [b["size"] for b in together.batches if b["kind"] == "generate"] == [3]
    timing = together.timing()
    assert timing["prefill_ms_mean"] > 0 and timing["decode_ms_per_token_mean"] > 0


def test_requests_of_other_layouts_are_batched_apart_and_answered_in_order(checkpoints, tmp_path) -> None:
    """Qwen2.5-VL's token count follows the image's size: two sizes, two batches, answers in request order."""
    run = session(checkpoints, "qwen2_5_vl", tmp_path, batch_size=4)
    small, large = pictures((112, 112)), pictures((168, 224))
    requests = [Request("Colour?", [p], "colours", i, dict(GREEDY)) for i, p in enumerate([small[0], large[0],
                                                                                              small[1]])]
    answers = run.generate(requests)
    sizes = sorted(b["size"] for b in run.batches if b["kind"] == "generate")
    assert sizes == [1, 2]
    alone = session(checkpoints, "qwen2_5_vl", tmp_path).generate(requests)
    assert answers == alone
    assert {tuple(s["image_size"]) for s in run.samples} == {(112, 112), (224, 168)}


@pytest.mark.parametrize("family", sorted(PROFILES))
def test_several_images_in_one_request_run_and_are_not_costed_as_one(checkpoints, tmp_path, family) -> None:
    run = session(checkpoints, family, tmp_path, method="v", **({"keep": 16} if family == "llava" else {"keep": 8}))
    [answer] = run.generate([Request("Compare the two images.", pictures()[:2], "pairs", 0, dict(GREEDY))])
    assert isinstance(answer, str)
    sample = run.samples[0]
    assert sample["items"] == 2 and sample["tflops"] is None
    assert "2 images in one prompt" in sample["cost_note"]


@pytest.mark.parametrize("family", sorted(PROFILES))
def test_a_loglikelihood_on_the_cache_equals_one_forward_over_prompt_and_continuation(checkpoints, tmp_path,
                                                                                      family) -> None:
    # In float32: equal up to rounding on every CPU (in bfloat16, which dtype=auto picks on an AMX CPU, a cached
    # continuation and one forward round differently, by more than the tolerance).
    run = session(checkpoints, family, tmp_path, dtype="fp32")
    request = Request("What colour is it?", [pictures()[0]], "colours", 0, continuation=" red and blue")
    [(logprob, greedy)] = run.loglikelihood([request])
    laid = run.lay_out(0, request)
    inputs = run._inputs([laid])
    target = run.tokenizer([" red and blue"], return_tensors="pt", add_special_tokens=False)["input_ids"]
    whole = dict(inputs, input_ids=torch.cat([inputs["input_ids"], target], 1),
                 attention_mask=torch.ones(1, inputs["input_ids"].shape[1] + target.shape[1], dtype=torch.long))
    if "mm_token_type_ids" in inputs:
        whole["mm_token_type_ids"] = torch.cat([inputs["mm_token_type_ids"], torch.zeros_like(target)], 1)
    with torch.inference_mode():
        logits = run.model(**whole).logits[0, inputs["input_ids"].shape[1] - 1:-1].float()
    expected = torch.log_softmax(logits, -1).gather(-1, target[0].unsqueeze(-1)).sum()
    assert logprob == pytest.approx(float(expected), abs=1e-4)
    assert greedy == bool((logits.argmax(-1) == target[0]).all())


def test_the_record_is_written_atomically_with_every_sample_and_the_timing(checkpoints, tmp_path) -> None:
    run = session(checkpoints, "llava", tmp_path, method="v", keep=16)
    run.generate([Request("Colour?", [p], "colours", i, dict(GREEDY)) for i, p in enumerate(pictures())])
    path = run.write()
    record = json.loads(Path(path).read_text())
    assert record["schema"] == "ficoco.eval/1" and record["variant"] == "v"
    assert [s["doc_id"] for s in record["samples"]] == [0, 1, 2]
    assert record["visual_tokens_mean"] == 16 and record["samples_costed"] == 3
    assert record["convention"] == "flops" and record["scope"] == "llm"
    assert record["timing"]["timed_on"].startswith("cpu: ")
    assert not list(tmp_path.glob(".run.json.*"))  # no temporary file left behind


@pytest.mark.parametrize(("args", "says"), [
    ({"pretrained": "/no/such/folder"}, "is not a folder"),
    ({"method": "prumerge", "keep": 8}, "PruMerge+ is defined on llava"),
    ({"method": "v", "keep": 999}, "keep"),
    ({"method": "fastv", "keep": 15, "ratio": "high"}, "ratio"),
])
def test_a_mistake_is_one_line_before_the_model_is_built(checkpoints, tmp_path, args, says) -> None:
    with pytest.raises(FicocoError) as caught:
        session(checkpoints, "qwen2_5_vl", tmp_path, **args)
    assert says in str(caught.value) and "\n" not in str(caught.value)


def test_a_video_for_a_family_that_takes_images_is_one_line(checkpoints, tmp_path) -> None:
    run = session(checkpoints, "llava", tmp_path)
    with pytest.raises(FicocoError, match="a video request, but llava models take images"):
        run.generate([Request("What happens?", ["/clips/a.mp4"], "videos", 0, dict(GREEDY))])


def test_a_video_request_is_laid_out_from_its_frames_and_costed_at_its_frames(tmp_path) -> None:
    """Video-LLaVA takes a video: lmms-eval hands a path (here a folder of frames), sampled to the run's frames."""
    checkpoint = make_checkpoint("video_llava", tmp_path / "video-llava")
    clip = tmp_path / "clip"
    clip.mkdir()
    for index in range(6):
        Image.new("RGB", (64, 64), (40 * index, 100, 200 - 30 * index)).save(clip / f"{index:02d}.png")
    run = EvalSession(parse_model_args({"pretrained": str(checkpoint), "profile": "video-llava-tiny", "method": "v",
                                        "keep": 24, "frames": 4, "out": str(tmp_path / "run.json")}))
    [answer] = run.generate([Request("What happens?", [str(clip)], "clips", 0, dict(GREEDY))])
    sample = run.samples[0]
    assert isinstance(answer, str) and sample["media"] == "video" and sample["frames"] == 4
    row = ficoco.flops("video-llava-tiny", "v", keep=24, frames=4, text_tokens=sample["text_tokens"])["rows"][0]
    assert (sample["visual_tokens"], sample["tflops"]) == (row["llm_visual_tokens"], pytest.approx(row["tflops"]))


def test_quantized_weights_and_kv_cache_run_and_are_recorded(checkpoints, tmp_path) -> None:
    run = session(checkpoints, "llava", tmp_path, method="v", keep=16, quant="int8", kv_bits=4)
    answers = run.generate([Request("Colour?", [p], "colours", i, dict(GREEDY)) for i, p in enumerate(pictures())])
    assert len(answers) == 3
    record = run.record()
    assert (record["quant"], record["kv_bits"]) == ("int8", 4)
    assert record["tflops_mean"] == pytest.approx(ficoco.flops("llava-tiny", "v", keep=16,
                                                               text_tokens=run.samples[0]["text_tokens"])
                                                  ["rows"][0]["tflops"])
