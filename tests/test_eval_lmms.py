"""ficoco through the real `lmms-eval` command, end to end with no network: a tiny local checkpoint (its
tokenizer, processor and chat template) of LLaVA-1.5 and of Qwen2.5-VL, a small task made here (generated
images, questions and known answers, read from disk by a task YAML), vanilla and two methods.

The answers a random model gives are noise, so on LLaVA the known answers are made from them: vanilla runs
the task once, and a second task takes vanilla's answers as the targets of its first two documents and a
word no answer holds for the other two. Vanilla must then score exactly 0.5 on it; on both families every
run's score is what its own answers earn (Qwen2.5-VL's targets are the colours' names). Each sample's visual
tokens and TFLOPs in lmms-eval's samples equal what `ficoco flops` says for the same settings and that
sample's prompt, and the run's timing is in lmms-eval's throughput and in the ficoco.eval/1 record.
"""

from __future__ import annotations

import json
import string
from pathlib import Path
from typing import Any

import pytest
from helpers import make_checkpoint, make_eval_task, run_cli, run_lmms_eval

pytest.importorskip("lmms_eval", reason="the README's test command installs lmms-eval")

FAMILIES = {
    # family: (profile, (method, budget) x 2, placeholders per image for the task's 112 x 112 images,
    # whether the targets are made from vanilla's answers)
    "llava": ("llava-tiny", (("v", "keep=16"), ("fastv", "keep=40")), 64, True),
    # One method on Qwen2.5-VL: each lmms-eval run is a process that indexes lmms-eval's own tasks (~25 s on 2
    # cores); LLaVA's two cover a vision-side and a decoder-side method.
    "qwen2_5_vl": ("qwen2.5-vl-tiny", (("v", "keep=8"),), 16, False),
}
TASK = "colours_known"
NO_ANSWER = "zzzqqq"


def _normalise(text: str) -> str:
    """lmms-eval's exact_match with ignore_case and ignore_punctuation, as the task asks."""
    return text.lower().translate(str.maketrans("", "", string.punctuation))


def _method(runs: Runs, which: int) -> tuple[str, str]:
    """The family's method number `which`; a family with fewer methods skips (Qwen2.5-VL runs one)."""
    if which >= len(runs.methods):
        pytest.skip(f"{runs.profile} evaluates {len(runs.methods)} method(s) (each lmms-eval run costs ~25 s)")
    return runs.methods[which]


class Runs:
    """The lmms-eval runs of one family, made once for the module's tests."""

    def __init__(self, root: Path, family: str) -> None:
        self.profile, self.methods, self.placeholders, self.from_vanilla = FAMILIES[family]
        self.checkpoint = make_checkpoint(family, root / "checkpoint")
        tasks = root / "tasks"
        self.first_answers: list[str] = []
        self.targets = ["red", "green", "blue", "white"]  # helpers.EVAL_COLOURS
        if self.from_vanilla:
            make_eval_task(tasks, "colours_free", size=(112, 112))
            first = self.run(root / "first", "vanilla", None, "colours_free")
            self.first_answers = [s["filtered_resps"] for s in sorted(first[2], key=lambda s: s["doc_id"])]
            self.targets = [*self.first_answers[:2], NO_ANSWER, NO_ANSWER]
        make_eval_task(tasks, TASK, answers=self.targets, size=(112, 112))
        self.known = {name: self.run(root / name, name, budget, TASK)
                      for name, budget in (("vanilla", None), *self.methods)}

    def run(self, out: Path, method: str, budget: str | None, task: str) -> tuple[Any, ...]:
        args = f"pretrained={self.checkpoint},method={method},profile={self.profile},out={out / 'ficoco.json'}"
        args += f",{budget}" if budget else ""
        result, results, samples = run_lmms_eval(out, args, task, self.checkpoint.parent / "tasks", batch_size=2)
        assert result.code == 0 and results is not None, result.err[-3000:]
        assert "Traceback" not in result.err, result.err[-3000:]
        record = json.loads((out / "ficoco.json").read_text())
        return result, results, samples, record


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Runs:
    return Runs(tmp_path_factory.mktemp(f"lmms-{request.param}"), request.param)


@pytest.mark.parametrize("runs", ["llava"], indirect=True)
def test_vanilla_scores_exactly_the_known_answers_it_gave(runs: Runs) -> None:
    _, results, samples, record = runs.known["vanilla"]
    assert results["results"][TASK]["exact_match,none"] == pytest.approx(0.5)
    by_doc = {s["doc_id"]: s for s in samples}
    assert [by_doc[i]["filtered_resps"] for i in range(2)] == runs.first_answers[:2]
    answers = [s["answer"].strip() for s in sorted(record["samples"], key=lambda s: s["doc_id"])]
    assert answers[:2] == runs.first_answers[:2]


@pytest.mark.parametrize("which", ["vanilla", 0, 1])
def test_a_runs_score_is_what_its_own_answers_earn(runs: Runs, which: str | int) -> None:
    method = which if isinstance(which, str) else _method(runs, which)[0]
    _, results, samples, record = runs.known[method]
    answers = {s["doc_id"]: s["answer"] for s in record["samples"]}
    expected = sum(_normalise(answers[i].strip()) == _normalise(runs.targets[i].strip()) for i in range(4)) / 4
    assert results["results"][TASK]["exact_match,none"] == pytest.approx(expected)
    # lmms-eval strips the answer it scores (its filtered response); the record keeps the text as generated.
    assert {s["doc_id"]: s["filtered_resps"] for s in samples} == {i: a.strip() for i, a in answers.items()}


@pytest.mark.parametrize("which", [0, 1])
def test_each_samples_tokens_and_tflops_are_what_ficoco_flops_says(runs: Runs, which: int) -> None:
    method, budget = _method(runs, which)
    _, _, samples, record = runs.known[method]
    name, value = budget.split("=")
    assert len(samples) == 4
    for sample in samples:
        [counts] = sample["token_counts"]
        text_tokens = counts["input_tokens"] - runs.placeholders
        layout = ["--image-size", "112x112"] if runs.profile.startswith("qwen") else []
        flops = run_cli("flops", "--model", runs.profile, "--variant", method, f"--{name}", value, "--text-tokens",
                        text_tokens, *layout, "--json", "-")
        assert flops.code == 0, flops.err
        [row] = json.loads(flops.out)["rows"]
        assert counts["visual_tokens"] == row["llm_visual_tokens"]
        assert counts["tflops"] == pytest.approx(row["tflops"], rel=1e-12)
    assert record["convention"] == "flops" and record["scope"] == "llm" and record["variant"] == method


def test_the_runs_timing_is_in_lmms_evals_throughput_and_the_record(runs: Runs) -> None:
    for method in ("vanilla", *(m for m, _ in runs.methods)):
        _, results, _, record = runs.known[method]
        throughput = results["throughput"]
        assert throughput["avg_ttft"] > 0 and throughput["avg_tpot"] > 0
        assert throughput["avg_ficoco_visual_tokens"] == pytest.approx(record["visual_tokens_mean"])
        assert throughput["avg_ficoco_tflops"] == pytest.approx(record["tflops_mean"])
        assert record["timing"]["prefill_ms_mean"] == pytest.approx(throughput["avg_ficoco_prefill_ms"])
        assert record["timing"]["batches"] == 2  # four documents, batch_size 2, one layout


def test_a_method_costs_less_than_vanilla_and_hands_the_llm_no_more_tokens(runs: Runs) -> None:
    """A method inside the decoder (FastV) hands the LLM every visual token and cuts them at its layer."""
    vanilla = runs.known["vanilla"][3]
    for method, _ in runs.methods:
        record = runs.known[method][3]
        assert record["visual_tokens_mean"] <= vanilla["visual_tokens_mean"]
        assert record["tflops_mean"] < vanilla["tflops_mean"]
        assert all(s["layer_average_visual_tokens"] < vanilla["visual_tokens_mean"] for s in record["samples"])


@pytest.mark.parametrize("runs", ["llava"], indirect=True)
def test_a_bad_model_arg_is_one_line_and_exit_2(runs: Runs, capsys: pytest.CaptureFixture[str]) -> None:
    """lmms-eval builds its model with `create_from_arg_string` and prints a traceback for any exception and
    goes on: ficoco's mistake is one line and exit 2 there (the real command is run on good arguments above)."""
    from ficoco.eval.lmms_model import FicocoLMM

    with pytest.raises(SystemExit) as exited:
        FicocoLMM.create_from_arg_string(f"pretrained={runs.checkpoint},method=fastvv", {"batch_size": 1})
    assert exited.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert errors == [errors[0]] and errors[0].startswith("ficoco: error: model_args: method=fastvv is not a method")
