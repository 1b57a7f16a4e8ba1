"""Small synthetic evaluated sweep reports (a `ficoco.sweep/1` report with `eval_tasks` and `ficoco.eval/1`
blocks on its points), every figure known here, for the tests of the join, the table, the accuracy figure
and `ficoco compare`. Test files import them as `from eval_reports import ...` (tests/ is on sys.path,
as for helpers.py); nothing here imports torch.

`standard_report()`: LLaVA-tiny, two tasks on the two scales lmms-eval reports (task_a 0..1, task_b
0..100), five documents each, and these points (fp16):

    vanilla            task_a 0.8  task_b 60   answers: VANILLA_ANSWERS
    v (VisionZip) k64  task_a 0.8  task_b 50   1 of 10 answers differ
    v (VisionZip) k32  task_a 0.6  task_b 40   3 of 10 answers differ
    l (FiCoCo-L) k64   eval failed
    l (FiCoCo-L) k32   not evaluated (no eval block)
"""

from __future__ import annotations

import copy
from typing import Any

TASKS = ("task_a", "task_b")
DOCS = 5
VANILLA_ANSWERS = {"task_a": ["red", "blue", "cat", "4", "yes"], "task_b": ["A", "B", "C", "D", "A"]}


def answers(changed: int = 0, pad: bool = True) -> dict[str, list[str]]:
    """Vanilla's answers with the first `changed` documents (task_a's first, then task_b's) answered
    otherwise, and (`pad`) the others padded with white space, which the agreement ignores."""
    out = {}
    k = 0
    for task in TASKS:
        out[task] = []
        for answer in VANILLA_ANSWERS[task]:
            out[task].append("something else" if k < changed else f" {answer}\n" if pad else answer)
            k += 1
    return out


def eval_block(label: str, scores: dict[str, float], answer_lists: dict[str, list[str]], *, tflops: float,
               tokens: float, prefill_ms: float = 10.0, decode_ms: float | None = 2.0, stderr: float | None = 0.1,
               timed_on: str = "cpu: Test CPU", convention: str = "flops", scope: str = "all") -> dict[str, Any]:
    """An ok `ficoco.eval/1` block in the format the lmms-eval run writes."""
    samples = [{"task": task, "doc_id": doc, "answer": answer, "visual_tokens": tokens, "tflops": tflops,
                "prompt_tokens": 600 + int(tokens), "output_tokens": 3}
               for task, answers_ in answer_lists.items() for doc, answer in enumerate(answers_)]
    return {
        "schema": "ficoco.eval/1", "status": "ok", "method_label": label,
        "tasks": {task: {"metric": "exact_match", "score": score, "stderr": stderr, "samples": DOCS,
                         "higher_is_better": True, "metrics": {"exact_match": score}}
                  for task, score in scores.items()},
        "score": sum(scores.values()) / len(scores),
        "samples": samples, "visual_tokens_mean": tokens, "tflops_mean": tflops,
        "convention": convention, "scope": scope, "units": "TFLOPs",
        "timing": {"prefill_ms_mean": prefill_ms, "ttft_ms_mean": prefill_ms + 0.5,
                   "decode_ms_per_token_mean": decode_ms, "batches": 3, "timed_on": timed_on},
    }


def failed_block(reason: str = "lmms-eval: CUDA out of memory") -> dict[str, Any]:
    return {"status": "failed", "reason": reason}


def point(variant: str, budget: dict[str, float] | None, block: dict[str, Any] | None, *, quant: str = "fp16",
          tokens: int = 576, tflops: float = 8.0) -> dict[str, Any]:
    """A sweep point as `Point.to_json` writes it (the accountant's figures plausible, not computed)."""
    stages = {"vision": tflops * 0.1, "projector": tflops * 0.01, "llm": tflops * 0.85, "lm_head": tflops * 0.04}
    return {"variant": variant, "quant": quant, "budget": budget, "schedule": [],
            "analytic": {"visual_tokens": tokens, "layer_average_visual_tokens": float(tokens), "tflops": tflops,
                         "tflops_by_stage": stages},
            "measured": None, "fidelity": None, "eval": block}


def evaluated_report(points: list[dict[str, Any]], *, tasks: tuple[str, ...] = TASKS, model: str = "llava-tiny",
                     random_weights: bool = False, convention: str = "flops", scope: str = "all") -> dict[str, Any]:
    """A `ficoco.sweep/1` report of `points` whose config names `tasks` as its eval tasks."""
    variants = tuple(dict.fromkeys(p["variant"] for p in points))
    keeps = tuple(dict.fromkeys(int(p["budget"]["keep"]) for p in points if p["budget"]))
    return {
        "schema": "ficoco.sweep/1", "created": "2026-01-02T03:04:05+00:00", "ficoco_version": "0.0.test",
        "model": model,
        "config": {"model": model, "variants": list(variants), "keep": list(keeps), "tflops": [],
                   "convention": convention, "scope": scope, "quants": ["fp16"],
                   "weights": "random" if random_weights else "/checkpoints/llava-tiny", "eval_tasks": list(tasks)},
        "convention": convention, "units": "TFLOPs", "scope": scope,
        "scope_stages": ["vision", "projector", "llm", "lm_head"], "image_size": [336, 336],
        "environment": {"device_kind": "cpu", "cpu": "Test CPU", "cpu_flags": {"avx2": True},
                        "cpu_capability": "AVX2", "python": "3.12", "torch": "2.5"},
        "device": "cpu: Test CPU", "compute_dtype": "float32", "random_weights": random_weights,
        "points": points, "skipped": [],
    }


def standard_points() -> list[dict[str, Any]]:
    return [
        point("vanilla", None, eval_block("Vanilla", {"task_a": 0.8, "task_b": 60.0}, answers(0, pad=False), tflops=8.0,
                                          tokens=576, prefill_ms=20.0)),
        point("v", {"keep": 64}, eval_block("VisionZip", {"task_a": 0.8, "task_b": 50.0}, answers(1), tflops=2.0,
                                            tokens=64, prefill_ms=8.0), tokens=64, tflops=2.0),
        point("v", {"keep": 32}, eval_block("VisionZip", {"task_a": 0.6, "task_b": 40.0}, answers(3), tflops=1.5,
                                            tokens=32, prefill_ms=6.0), tokens=32, tflops=1.5),
        point("l", {"keep": 64}, failed_block(), tokens=64, tflops=3.0),
        point("l", {"keep": 32}, None, tokens=32, tflops=2.5),
    ]


def standard_report(**kwargs: Any) -> dict[str, Any]:
    return evaluated_report(standard_points(), **kwargs)


def find(report: dict[str, Any], variant: str, keep: int | None = None, quant: str = "fp16") -> dict[str, Any]:
    """The point of `report` at (variant, keep, quant), to edit a copy."""
    budget = None if keep is None else {"keep": keep}
    (found,) = [p for p in report["points"] if p["variant"] == variant and p["budget"] == budget
                and p["quant"] == quant]
    return found


def edited(report: dict[str, Any]) -> dict[str, Any]:
    return copy.deepcopy(report)


def set_score(report: dict[str, Any], variant: str, keep: int | None, task: str, score: float) -> None:
    """Give a point's task another score, and its block's mean score with it (as the run writes it)."""
    block = find(report, variant, keep)["eval"]
    block["tasks"][task]["score"] = score
    block["tasks"][task]["metrics"]["exact_match"] = score
    block["score"] = sum(t["score"] for t in block["tasks"].values()) / len(block["tasks"])
