"""ficoco as an lmms-eval model: `lmms-eval --model ficoco --model_args pretrained=PATH,method=v,tflops=1.5`.

lmms-eval finds this class through the entry point `lmms_eval.models: ficoco` (ficoco.eval.plugin). It
turns lmms-eval's requests into ficoco's (`ficoco.eval.session.Request`), lets the session answer them,
and reports what each run cost in lmms-eval's own results: every sample's `token_counts` carries its
visual tokens and TFLOPs beside the input and output tokens, and the run's prefill (time to first
token) and decode time per token are logged as lmms-eval's throughput metrics. The `ficoco.eval/1`
record of the run is rewritten after every call, so it is whole when lmms-eval ends.

A mistake in `--model_args` is one line on stderr and exit code 2: lmms-eval would print a traceback
and carry on with the next run.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

from lmms_eval.api.instance import GenerationResult, TokenCounts
from lmms_eval.api.model import lmms

from ficoco.errors import FicocoError
from ficoco.eval.session import EvalSession, Request
from ficoco.eval.settings import parse_model_args


@dataclass
class FicocoTokenCounts(TokenCounts):
    """lmms-eval's per-request token counts, with the sample's cost as ficoco's accountant counts it: the
    visual tokens that reach the LLM and the TFLOPs (convention and scope in the run's record)."""

    visual_tokens: int | None = None
    tflops: float | None = None

    def to_dict(self) -> dict[str, Any]:
        counts: dict[str, Any] = super().to_dict()
        counts["visual_tokens"] = self.visual_tokens
        counts["tflops"] = self.tflops
        return counts


class FicocoLMM(lmms):
    """A local checkpoint with a ficoco method applied, answering lmms-eval's requests."""

    is_simple = True

    def __init__(self, **model_args: Any) -> None:
        super().__init__()
        self.settings = parse_model_args(model_args)
        self.session = EvalSession(self.settings)
        print(f"ficoco: {self.settings.method} on {self.session.profile.name} ({self.session.family}); the cost "
              f"record goes to {self.session.out}", file=sys.stderr)

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None) -> FicocoLMM:
        """lmms-eval's constructor from `--model_args`: a user's mistake is one line and exit code 2."""
        try:
            return super().create_from_arg_string(arg_string, additional_config)
        except FicocoError as exc:
            print(f"ficoco: error: {exc}", file=sys.stderr)
            raise SystemExit(2) from None

    # lmms-eval reads these of every model.
    @property
    def batch_size(self) -> int:
        return self.settings.batch_size

    @property
    def device(self) -> Any:
        return self.session.device

    @property
    def tokenizer(self) -> Any:
        return self.session.tokenizer

    @property
    def model(self) -> Any:
        return self.session.model

    def _doc(self, task: str, split: str, doc_id: Any) -> Any:
        return self.task_dict[task][split][doc_id]

    def _visuals(self, doc_to_visual: Any, task: str, split: str, doc_id: Any) -> list[Any]:
        if doc_to_visual is None:
            return []
        found = doc_to_visual(self._doc(task, split, doc_id))
        if found is None:
            return []
        return list(found) if isinstance(found, (list, tuple)) else [found]

    def generate_until(self, requests: list[Any]) -> list[GenerationResult]:
        ours = []
        for instance in requests:
            context, generation, doc_to_visual, doc_id, task, split = instance.args
            ours.append(Request(text=context, visuals=self._visuals(doc_to_visual, task, split, doc_id), task=task,
                                doc_id=doc_id, generation=dict(generation or {})))
        first = len(self.session.samples)
        answers = self._run(lambda: self.session.generate(ours))
        # The session records samples in the order it ran them (batched by layout): matched back by request.
        recorded = {(s["task"], s["doc_id"]): s for s in self.session.samples[first:]}
        results = []
        for request, answer in zip(ours, answers, strict=True):
            sample = recorded.get((request.task, request.doc_id), {})
            counts = FicocoTokenCounts(input_tokens=sample.get("prompt_tokens"),
                                       output_tokens=sample.get("output_tokens"),
                                       visual_tokens=sample.get("visual_tokens"), tflops=sample.get("tflops"))
            results.append(GenerationResult(text=answer, token_counts=counts))
        self._log(first)
        return results

    def loglikelihood(self, requests: list[Any]) -> list[tuple[float, bool]]:
        ours = []
        for instance in requests:
            context, doc_to_target, doc_to_visual, doc_id, task, split = instance.args
            target = doc_to_target if isinstance(doc_to_target, str) else doc_to_target(self._doc(task, split, doc_id))
            ours.append(Request(text=context, visuals=self._visuals(doc_to_visual, task, split, doc_id), task=task,
                                doc_id=doc_id, continuation=str(target)))
        first = len(self.session.samples)
        results = self._run(lambda: self.session.loglikelihood(ours))
        self._log(first)
        return results

    def generate_until_multi_round(self, requests: list[Any]) -> list[str]:
        print("ficoco: error: multi-round tasks are not supported by the ficoco model yet; choose single-round "
              "tasks", file=sys.stderr)
        raise SystemExit(2)

    def _run(self, work: Any) -> Any:
        """A request's mistake (an unreadable video, a family that takes no video) is one line and exit 2,
        with the record of what was answered so far written first."""
        try:
            return work()
        except FicocoError as exc:
            self.session.write()
            print(f"ficoco: error: {exc}", file=sys.stderr)
            raise SystemExit(2) from None

    def _log(self, first: int) -> None:
        """This call's timing and cost as lmms-eval's throughput metrics, and the run's record rewritten."""
        from lmms_eval.models.model_utils.gen_metrics import log_metrics

        samples = self.session.samples[first:]
        batches = [b for b in self.session.batches if b["kind"] == "generate"]
        elapsed_s = sum(b["total_ms"] for b in batches) / 1e3
        tokens = sum(int(s.get("output_tokens") or 0) for s in samples if "answer" in s)
        timing = self.session.timing()
        costed = [s for s in samples if s.get("tflops") is not None]
        extra: dict[str, Any] = {"ttft": (timing["ttft_ms_mean"] or 0.0) / 1e3,
                                 "tpot": (timing["decode_ms_per_token_mean"] or 0.0) / 1e3,
                                 "ficoco_prefill_ms": timing["prefill_ms_mean"] or 0.0}
        if costed:
            extra["ficoco_visual_tokens"] = sum(s["visual_tokens"] for s in costed) / len(costed)
            extra["ficoco_tflops"] = sum(s["tflops"] for s in costed) / len(costed)
        log_metrics(total_elapsed_time=elapsed_s, total_gen_tokens=tokens,
                    avg_speed=tokens / elapsed_s if elapsed_s > 0 else 0.0, additional_metrics=extra)
        self.session.write()
