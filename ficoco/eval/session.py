"""One evaluated run on a local checkpoint: the model built once, every request laid out by the
checkpoint's own processor and chat template, the method applied with the budget resolved by the
accountant for the request's layout, generation timed, and each sample's cost recorded.

This module knows lmms-eval's request fields but not its classes (`ficoco.eval.lmms_model` adapts
them), so it runs and is tested without lmms-eval.

What is recorded, per sample: the visual tokens the accountant plans to reach the LLM and the
TFLOPs of the sample's own prompt (its text tokens, its image's layout) under the run's
convention and scope, with the schedule the model ran; per batch: the prefill (the time to the
first new token, TTFT) and the decode time per new token, measured around `generate` with a
device synchronisation at each step. A batch's times are the batch's, not a sample's: a sample's
share is the batch's time over its samples.
"""

from __future__ import annotations

import datetime as dt
import json
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

import ficoco
from ficoco import accounting as acc
from ficoco.errors import FicocoError
from ficoco.eval.settings import VANILLA, EvalSettings
from ficoco.report.schemas import EVAL_SCHEMA

# Inputs laid out along the prompt's tokens: left-padded when prompts of different lengths share a batch.
TOKEN_INPUTS = {"input_ids": None, "attention_mask": 0, "mm_token_type_ids": 0, "token_type_ids": 0}
# Requests laid out before they are batched: a window of this many batches at a time (their pixels in memory).
WINDOW_BATCHES = 8


@dataclass
class Request:
    """One lmms-eval request in ficoco's words: the prompt text, its images (PIL) or one video (a path),
    and where it comes from."""

    text: str
    visuals: list[Any]
    task: str
    doc_id: Any
    generation: dict[str, Any] = field(default_factory=dict)
    continuation: str | None = None  # a loglikelihood request's target


@dataclass
class Laid:
    """A request laid out by the processor: its encoding and the layout its schedule is planned for."""

    index: int
    request: Request
    prompt: Any  # ficoco.models.prompt.PromptInputs, or None for a text-only request
    encoded: dict[str, Tensor]
    media: str  # "image", "video" or "text"
    items: int  # images (a video is one)

    @property
    def layout(self) -> tuple[Any, ...]:
        """What must be equal for two requests to share a forward: media, items, the planned layout and
        every non-token input's shape past its first dimension."""
        shapes = tuple(sorted((name, tuple(value.shape[1:])) for name, value in self.encoded.items()
                              if name not in TOKEN_INPUTS))
        prompt = self.prompt
        return (self.media, self.items, getattr(prompt, "image_size", None), getattr(prompt, "frames", None), shapes)


class StepClock:
    """A logits processor that stamps the time of every generation step (after a device sync): the first
    stamp ends the prefill, the others are decode steps. Ties nothing to a method."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stamps: list[float] = []

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        self.sync()
        self.stamps.append(time.perf_counter())
        return scores


class ForcedTokens:
    """A logits processor that makes step k pick `target[:, k]` (a loglikelihood's continuation, fed on the
    cache as generated tokens are); the raw logits are what `output_logits` returns."""

    def __init__(self, target: Tensor) -> None:
        self.target = target
        self.step = 0

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        column = self.target[:, min(self.step, self.target.shape[1] - 1)]
        self.step += 1
        forced = torch.full_like(scores, float("-inf"))
        return forced.scatter(1, column.unsqueeze(1), 0.0)


def left_pad(encodings: list[dict[str, Tensor]], pad_id: int) -> dict[str, Tensor]:
    """One batch of single-prompt encodings, as a processor batches them: token inputs left-padded to the
    longest prompt (padding masked), every other input concatenated along its first dimension."""
    longest = max(int(e["input_ids"].shape[1]) for e in encodings)
    batch: dict[str, Tensor] = {}
    for name in encodings[0]:
        values = [e[name] for e in encodings]
        if name in TOKEN_INPUTS:
            fill = pad_id if name == "input_ids" else TOKEN_INPUTS[name]
            values = [torch.cat([v.new_full((v.shape[0], longest - v.shape[1]), fill), v], dim=1) for v in values]
        batch[name] = torch.cat(values, dim=0)
    if "attention_mask" not in batch:
        rows = [torch.cat([torch.zeros(longest - e["input_ids"].shape[1], dtype=torch.long),
                           torch.ones(e["input_ids"].shape[1], dtype=torch.long)]) for e in encodings]
        batch["attention_mask"] = torch.stack(rows)
    return batch


def stop_at(text: str, until: Iterable[str]) -> str:
    """`text` up to the first of the stop strings (lmms-eval's `until`)."""
    cut = len(text)
    for stop in until:
        if stop and (found := text.find(stop)) >= 0:
            cut = min(cut, found)
    return text[:cut]


class EvalSession:
    """The model of a run and everything recorded while it answers requests."""

    def __init__(self, settings: EvalSettings) -> None:
        from ficoco.methods.registry import METHODS
        from ficoco.models.prompt import load_processor
        from ficoco.profiles import load_profile

        self.settings = settings
        folder = Path(settings.pretrained).expanduser()
        if not folder.is_dir():
            raise FicocoError(f"model_args: pretrained={settings.pretrained} is not a folder; give a local checkpoint "
                              "(its config.json, weights and processor files); nothing is downloaded")
        if not (folder / "config.json").is_file():
            raise FicocoError(f"model_args: pretrained={settings.pretrained} has no config.json; is it a checkpoint "
                              "folder?")
        self.folder = str(folder)
        self.profile = load_profile(self.folder)
        if settings.profile is not None:  # the named profile's defaults, the checkpoint's shapes
            named = load_profile(settings.profile)
            if named.family != self.profile.family:
                raise FicocoError(f"model_args: profile={settings.profile} is a {named.family} profile but "
                                  f"{settings.pretrained} holds a {self.profile.family} model")
            self.profile.defaults.update(named.defaults)
        self.config = self.profile.config
        self.family = self.profile.family
        self.opts = acc.CountOptions(convention=settings.convention, scope=settings.scope,
                                     text_tokens=settings.text_tokens)
        self.quant = acc.make_quant(settings.quant, settings.kv_bits)
        spec = METHODS.get(settings.method)
        if spec is not None:
            spec.check_wired("model_args: method=")
            spec.check_runs(self.family, self.profile.name)
        # The budget resolved once at the profile's own layout before anything is built: a budget the method
        # cannot reach, or a bad hyperparameter, is one line now rather than at the first request.
        self.default_schedule = self._schedule_for(None, None)
        self.processor = load_processor(self.folder)
        self.tokenizer = self.processor.tokenizer
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None \
            else self.tokenizer.eos_token_id
        self.device = self._device(settings.device)
        self.model = ficoco.build_model(self.profile, weights=self.folder, dtype=settings.dtype,
                                        device=str(self.device),
                                        quant=settings.quant, attn_implementation=settings.attn_implementation)
        self.model.eval()
        self.dtype = next(p for p in self.model.parameters() if p.is_floating_point()).dtype
        self.samples: list[dict[str, Any]] = []
        self.batches: list[dict[str, Any]] = []
        self.warmed_up = False  # one untimed generate on the first batch before anything is timed
        self.notes: list[str] = []
        self.started = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
        self.out = settings.out or str(Path("ficoco-eval") / self._run_name())

    # ---- planning ---------------------------------------------------------------------------------------------

    @staticmethod
    def _device(name: str) -> torch.device:
        if name == "cpu":
            return torch.device("cpu")
        if torch.cuda.is_available():
            return torch.device(name if name.startswith("cuda") else "cuda")
        if name.startswith("cuda"):
            raise FicocoError(f"model_args: device={name}: no CUDA GPU is visible to torch here; use device=cpu "
                              "or auto")
        return torch.device("cpu")

    def _run_name(self) -> str:
        budget = "-".join(f"{k}{v}" for k, v in self.settings.budget().items() if k in ("keep", "preset", "tflops"))
        stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
        return f"{Path(self.folder).name}-{self.settings.method}{'-' + budget if budget else ''}-{stamp}.json"

    def _architecture(self, image_size: tuple[int, int] | None, frames: int | None) -> acc.Architecture:
        return acc.architecture(self.profile, image_size=image_size, frames=frames)

    def _schedule_for(self, image_size: tuple[int, int] | None, frames: int | None) -> acc.Schedule:
        """The schedule of the run's budget at a layout, as `ficoco flops` resolves it there."""
        if self.settings.method == VANILLA:
            return acc.Schedule(VANILLA)
        arch = self._architecture(image_size, frames)
        return acc.resolve_schedule(arch, self.settings.method, self.opts, self.settings.request,
                                    hyperparameters=dict(self.settings.hyperparameters))

    def cost(self, laid: Laid, schedule: acc.Schedule) -> dict[str, Any]:
        """The accountant's figures for one sample's prompt under `schedule`: the visual tokens that reach
        the LLM and the TFLOPs at the sample's own text tokens. A prompt of several images or of text
        only is not planned by the accountant (one image or one video per prompt): its cost is None, and
        says so."""
        prompt = laid.prompt
        if prompt is None or laid.items != 1:
            why = "a text-only prompt" if prompt is None else f"{laid.items} images in one prompt"
            return {"visual_tokens": None, "tflops": None, "layer_average_visual_tokens": None,
                    "cost_note": f"not costed: {why} (the accountant plans "
                    "one image or one video per prompt)"}
        arch = self._architecture(prompt.image_size, prompt.frames)
        opts = acc.CountOptions(convention=self.opts.convention, scope=self.opts.scope, text_tokens=prompt.text_tokens)
        row = acc.account(arch, schedule, self.quant, opts)
        return {"visual_tokens": row.plan.llm_visual_tokens, "tflops": row.tflops,
                # What the papers quote for a method inside the decoder: visual tokens averaged over its layers.
                "layer_average_visual_tokens": row.plan.layer_average_visual_tokens,
                "planned_visual_tokens": prompt.visual_tokens, "text_tokens": prompt.text_tokens}

    # ---- laying requests out ----------------------------------------------------------------------------------

    def lay_out(self, index: int, request: Request) -> Laid:
        """The request as the checkpoint's processor lays it out (one FicocoError line for a mistake)."""
        from ficoco.models import family_module
        from ficoco.models.prompt import encode_request, read_video

        visuals = [v for v in request.visuals if v is not None]
        if not visuals:
            text = self._chat(request.text)
            encoded = dict(self.tokenizer([text], return_tensors="pt", add_special_tokens=False))
            return Laid(index, request, None, {k: v for k, v in encoded.items() if isinstance(v, Tensor)}, "text", 0)
        form = family_module(self.family).PROMPT
        videos = [v for v in visuals if isinstance(v, (str, Path))]
        if videos:
            if "video" not in form.media:
                raise FicocoError(f"task {request.task}: a video request, but {self.family} models take "
                                  f"{' and '.join(form.media)}s here")
            if len(visuals) != 1:
                raise FicocoError(f"task {request.task}: {len(visuals)} videos or a video beside images in one "
                                  "request; ficoco lays out one video per prompt")
            frames, _ = read_video(str(videos[0]), self.settings.frames, int(self.profile.defaults.get("frames", 8)))
            prompt = encode_request(self.processor, self.config, question=request.text, pictures=frames,
                                    media="video", source=str(videos[0]), folder=self.folder)
            return Laid(index, request, prompt, prompt.encoded, "video", 1)
        if "image" not in form.media:
            raise FicocoError(f"task {request.task}: an image request, but {self.family} models take videos here")
        pictures = [self._rgb(v, request.task) for v in visuals]
        prompt = encode_request(self.processor, self.config, question=request.text, pictures=pictures, media="image",
                                source=f"task {request.task} doc {request.doc_id}", folder=self.folder)
        return Laid(index, request, prompt, prompt.encoded, "image", len(pictures))

    @staticmethod
    def _rgb(visual: Any, task: str) -> Any:
        if hasattr(visual, "convert"):
            return visual.convert("RGB")
        raise FicocoError(f"task {task}: a visual of type {type(visual).__name__}; ficoco takes PIL images and video "
                          "paths")

    def _chat(self, text: str) -> str:
        template = self.processor.chat_template
        if not template:
            return text
        return self.tokenizer.apply_chat_template([{"role": "user", "content": [{"type": "text", "text": text}]}],
                                                  chat_template=template, tokenize=False, add_generation_prompt=True)

    def batches_of(self, requests: list[Request]) -> Iterable[list[Laid]]:
        """The requests laid out a window at a time and grouped into batches of one layout and one set of
        generation settings, at most `batch_size` each."""
        size = self.settings.batch_size
        window = size * WINDOW_BATCHES
        for start in range(0, len(requests), window):
            groups: dict[Any, list[Laid]] = {}
            for index in range(start, min(start + window, len(requests))):
                laid = self.lay_out(index, requests[index])
                key = (laid.layout, json.dumps(laid.request.generation, sort_keys=True, default=str))
                groups.setdefault(key, []).append(laid)
            for group in groups.values():
                for first in range(0, len(group), size):
                    yield group[first:first + size]

    # ---- running ----------------------------------------------------------------------------------------------

    def _inputs(self, batch: list[Laid]) -> dict[str, Tensor]:
        from ficoco.models.prompt import PIXEL_INPUTS

        inputs = left_pad([laid.encoded for laid in batch], self.pad_id)
        return {name: value.to(self.device, dtype=self.dtype if name in PIXEL_INPUTS else None)
                for name, value in inputs.items()}

    def _applied(self, batch: list[Laid]) -> Any:
        """The method on the model for the batch's layout (None for vanilla): a context manager."""
        prompt = batch[0].prompt
        image_size = getattr(prompt, "image_size", None)
        frames = getattr(prompt, "frames", None)
        if self.settings.method == VANILLA:
            return None
        return ficoco.apply(self.model, self.settings.method, request=self.settings.request, count=self.opts,
                            image_size=image_size, frames=frames, **dict(self.settings.hyperparameters))

    def _cache(self) -> dict[str, Any]:
        if self.settings.kv_bits is None:
            return {}
        from ficoco.models import hf_compat as hf

        return hf.cache_argument(ficoco.quantized_cache(self.model, self.settings.kv_bits))

    def generate(self, requests: list[Request], on_batch: Callable[[int], None] | None = None) -> list[str]:
        """The answer to every request, in order: greedy unless the task asks for sampling, stopped at the
        task's `until` strings, at most the task's (or the run's) new tokens."""
        answers: list[str | None] = [None] * len(requests)
        for batch in self.batches_of(requests):
            texts = self._generate_batch(batch)
            for laid, text in zip(batch, texts, strict=True):
                answers[laid.index] = text
            if on_batch is not None:
                on_batch(len(batch))
        return [a if a is not None else "" for a in answers]

    def _generation_kwargs(self, generation: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
        gen = dict(generation)
        until = gen.pop("until", None) or []
        until = [until] if isinstance(until, str) else list(until)
        new = int(gen.pop("max_new_tokens", 128) or 128)
        if self.settings.max_new_tokens is not None:
            new = min(new, self.settings.max_new_tokens)
        temperature = float(gen.pop("temperature", 0) or 0)
        kwargs: dict[str, Any] = {"max_new_tokens": new, "do_sample": temperature > 0,
                                  "num_beams": int(gen.pop("num_beams", 1) or 1)}
        if temperature > 0:
            kwargs["temperature"] = temperature
            if gen.get("top_p") is not None:
                kwargs["top_p"] = float(gen["top_p"])
        return kwargs, until

    def _generate_batch(self, batch: list[Laid]) -> list[str]:
        from transformers import LogitsProcessorList

        kwargs, until = self._generation_kwargs(batch[0].request.generation)
        inputs = self._inputs(batch)
        clock = StepClock(self.device)
        eos = self.tokenizer.eos_token_id
        applied = self._applied(batch)
        handle = applied.__enter__() if applied is not None else None
        try:
            schedule = handle.schedule if handle is not None else acc.Schedule(VANILLA)
            with torch.inference_mode():
                if not self.warmed_up:  # the first call's one-time costs (kernels, allocations) are not a prefill
                    self.model.generate(**inputs, **{**kwargs, "max_new_tokens": 2}, **self._cache(),
                                        pad_token_id=self.pad_id, eos_token_id=eos)
                    self.warmed_up = True
                clock.sync()
                start = time.perf_counter()
                output = self.model.generate(**inputs, **kwargs, **self._cache(), logits_processor=LogitsProcessorList(
                    [clock]), pad_token_id=self.pad_id, eos_token_id=eos)
                clock.sync()
                end = time.perf_counter()
        finally:
            if applied is not None:
                applied.__exit__(None, None, None)
        new_ids = output[:, inputs["input_ids"].shape[1]:]
        texts = [stop_at(t, until) for t in self.tokenizer.batch_decode(new_ids, skip_special_tokens=True)]
        stamps = clock.stamps
        prefill_ms = (stamps[0] - start) * 1e3 if stamps else (end - start) * 1e3
        decode_ms = (stamps[-1] - stamps[0]) * 1e3 / (len(stamps) - 1) if len(stamps) > 1 else None
        self.batches.append({"kind": "generate", "size": len(batch), "prefill_ms": prefill_ms,
                             "decode_ms_per_token": decode_ms, "new_tokens": len(stamps),
                             "total_ms": (end - start) * 1e3})
        for row, (laid, text) in enumerate(zip(batch, texts, strict=True)):
            produced = new_ids[row]
            output_tokens = int((produced != self.pad_id).sum()) if self.pad_id is not None else int(produced.numel())
            self._record(laid, schedule, answer=text, prompt_tokens=int(laid.encoded["input_ids"].shape[1]),
                         output_tokens=output_tokens)
        return texts

    def loglikelihood(self, requests: list[Request]) -> list[tuple[float, bool]]:
        """log P(continuation | prompt) and whether it is the greedy continuation, for each request: the prompt
        is prefilled with the method applied (as before an answer), then the continuation is run on its cache."""
        results = []
        for index, request in enumerate(requests):
            laid = self.lay_out(index, request)
            results.append(self._loglikelihood_one(laid))
        return results

    def _loglikelihood_one(self, laid: Laid) -> tuple[float, bool]:
        """The continuation scored through `generate` with its tokens forced: the prompt is prefilled with the
        method applied and each continuation token is fed on the cache, as an answer would be, in every family
        (generate lays out each family's positions on the cache); the raw logits of each step give its log
        probability and whether it was the greedy token."""
        from transformers import LogitsProcessorList

        continuation = laid.request.continuation or ""
        target = self.tokenizer([continuation], return_tensors="pt", add_special_tokens=False)["input_ids"]
        if target.shape[1] == 0:
            raise FicocoError(f"task {laid.request.task}: an empty continuation has no likelihood")
        target = target.to(self.device)
        inputs = self._inputs([laid])
        clock = StepClock(self.device)
        applied = self._applied([laid])
        handle = applied.__enter__() if applied is not None else None
        try:
            schedule = handle.schedule if handle is not None else acc.Schedule(VANILLA)
            with torch.inference_mode():
                if not self.warmed_up:
                    self.model(**inputs, use_cache=False, logits_to_keep=1)
                    self.warmed_up = True
                clock.sync()
                start = time.perf_counter()
                output = self.model.generate(**inputs, **self._cache(), max_new_tokens=int(target.shape[1]),
                                             do_sample=False, num_beams=1, output_logits=True,
                                             return_dict_in_generate=True, pad_token_id=self.pad_id,
                                             logits_processor=LogitsProcessorList([clock, ForcedTokens(target)]))
        finally:
            if applied is not None:
                applied.__exit__(None, None, None)
        logits = torch.stack(list(output.logits), dim=1)[:, :target.shape[1]].float()  # raw: before the forcing
        steps = target[:, :logits.shape[1]]
        picked = torch.log_softmax(logits, dim=-1).gather(-1, steps.unsqueeze(-1)).squeeze(-1)
        greedy = bool((logits.argmax(-1) == steps).all()) and steps.shape[1] == target.shape[1]
        prefill_ms = (clock.stamps[0] - start) * 1e3 if clock.stamps else None
        self.batches.append({"kind": "loglikelihood", "size": 1, "prefill_ms": prefill_ms, "decode_ms_per_token": None,
                             "new_tokens": int(steps.shape[1]), "total_ms": (clock.stamps[-1] - start) * 1e3
                             if clock.stamps else None})
        self._record(laid, schedule, answer=continuation, prompt_tokens=int(laid.encoded["input_ids"].shape[1]),
                     output_tokens=int(target.shape[1]))
        return float(picked.sum()), greedy

    def _record(self, laid: Laid, schedule: acc.Schedule, **figures: Any) -> None:
        self.samples.append({"task": laid.request.task, "doc_id": laid.request.doc_id, **figures,
                             "media": laid.media, "items": laid.items,
                             "image_size": list(laid.prompt.image_size) if getattr(laid.prompt, "image_size", None)
                             else None, "frames": getattr(laid.prompt, "frames", None),
                             **self.cost(laid, schedule), "schedule": schedule.to_json()})

    # ---- the record -------------------------------------------------------------------------------------------

    def timing(self) -> dict[str, Any]:
        """The run's measured times: prefill (TTFT) per batch and decode per new token, means over batches."""
        timed = [b for b in self.batches if b["kind"] == "generate"] or self.batches
        decode = [b["decode_ms_per_token"] for b in timed if b["decode_ms_per_token"] is not None]
        prefill = [b["prefill_ms"] for b in timed if b["prefill_ms"] is not None]
        return {"prefill_ms_mean": sum(prefill) / len(prefill) if prefill else None,
                "ttft_ms_mean": sum(prefill) / len(prefill) if prefill else None,
                "decode_ms_per_token_mean": sum(decode) / len(decode) if decode else None,
                "batches": len(self.batches), "batch_size": self.settings.batch_size,
                "warmup": "one untimed generate of 2 new tokens on the first batch",
                "timed_on": self._device_name(), "per_batch": list(self.batches)}

    def _device_name(self) -> str:
        """The device timed, as a measured sweep names it: the GPU's name, or "cpu: MODEL"."""
        env = self.environment()
        return env["device"] if self.device.type == "cuda" else f"cpu: {env.get('cpu')}"

    def environment(self) -> dict[str, Any]:
        """Versions, device, CPU model and features, threads: what makes a timing comparable."""
        from ficoco.profiling.environment import environment

        return environment(self.device)

    def record(self) -> dict[str, Any]:
        """The run's `ficoco.eval/1` record: settings, the schedule at the profile's layout, every sample's
        answer and cost, the timing. Scores are lmms-eval's (`ficoco eval` adds them as `tasks`)."""
        from ficoco.methods.registry import method_label

        costed = [s for s in self.samples if s.get("tflops") is not None]
        mean = (lambda key: sum(s[key] for s in costed) / len(costed) if costed else None)  # noqa: E731
        schedule = self.default_schedule
        return {
            "schema": EVAL_SCHEMA, "status": "ok", "created": self.started, "ficoco_version": ficoco.__version__,
            "checkpoint": self.folder, "model": self.profile.name, "family": self.family,
            "variant": self.settings.method,
            "method_label": method_label(self.settings.method, schedule.settings_dict()),
            "budget": self.settings.budget(), "hyperparameters": dict(self.settings.hyperparameters),
            "schedule": schedule.to_json(), "settings": self.settings.to_json(),
            "quant": self.settings.quant, "kv_bits": self.settings.kv_bits, "device": str(self.device),
            "compute_dtype": str(self.dtype).removeprefix("torch."),
            "convention": self.opts.convention, "units": acc.UNITS[self.opts.convention], "scope": self.opts.scope,
            "environment": self.environment(),
            "visual_tokens_mean": mean("visual_tokens"), "tflops_mean": mean("tflops"),
            "samples_costed": len(costed), "timing": self.timing(), "samples": list(self.samples),
            "notes": list(dict.fromkeys(self.notes)),
        }

    def write(self) -> str:
        """Write the record (atomically) to the run's `out`; returns the path."""
        from ficoco.report import write_json_atomic

        Path(self.out).expanduser().parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(self.out, self.record())
        return self.out
