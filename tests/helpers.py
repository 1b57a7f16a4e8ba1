"""Plain helpers the test files share (the fixtures are in conftest.py): the one CLI runner, a
hand-written greedy decode, the check that a batch equals its samples run alone, the per-video
HoliTom reference, and tiny local checkpoints.

Test files import them as `from helpers import ...` (tests/ is on sys.path under pytest's default
import mode, as for conftest.py); no test file imports from another test file. torch and
transformers are imported inside the helpers that need them, so the CLI tests stay light.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import traceback
from fractions import Fraction
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from torch import Tensor, nn


# ---- the CLI -----------------------------------------------------------------------------------------------------

SCRIPT = Path(sys.executable).parent / "ficoco"
# `ficoco` as a user types it: the console script beside this interpreter, else the same entry point.
COMMAND = [str(SCRIPT)] if SCRIPT.is_file() else [sys.executable, "-c", "from ficoco_cli.app import main; main()"]
TRACEBACK = "Traceback (most recent call last):"


class CliResult(NamedTuple):
    """What `ficoco ARGS...` did: its exit code and what it printed (unpacks as (code, out, err))."""

    code: int
    out: str
    err: str

    @property
    def crash(self) -> str:
        """The traceback of an exception the command let through (Python prints it and exits 1), else ""."""
        start = self.err.find(TRACEBACK)
        return self.err[start:] if start >= 0 else ""


def run_cli(*args: Any, standalone: bool = True, in_subprocess: bool = False, prelude: str = "",
            cwd: Path | None = None, env: dict[str, str] | None = None, timeout: float = 600) -> CliResult:
    """`ficoco ARGS...` -> CliResult(code, out, err), the suite's one way to run the command.

    In process (the default) through `ficoco_cli.app.main`, as the console script runs it, with the
    streams captured by Typer's runner: monkeypatches apply, and an exception `main()` lets through
    ends as it would for a user, exit 1 with its traceback on stderr (`result.crash`). With
    `standalone=False`, the Typer app without the entry point's error handling: a user's mistake
    raises its FicocoError (for `pytest.raises`) and an exit code other than 0 raises SystemExit. With
    `in_subprocess` (or a `prelude`, Python run before `main()` there) in a new interpreter, for what
    only a real process shows: its exit code and streams, the console script, `cwd`, `env` (added to
    this environment)."""
    argv = [str(arg) for arg in args]
    if in_subprocess or prelude:
        # A prelude runs before `main()`, which then reads argv as the console script does.
        script = f"import sys; sys.argv[0] = 'ficoco'; {prelude}; from ficoco_cli.app import main; main()"
        command = [sys.executable, "-c", script] if prelude else COMMAND
        done = subprocess.run([*command, *argv], capture_output=True, text=True, timeout=timeout, cwd=cwd,
                              env=None if env is None else {**os.environ, **env})
        return CliResult(done.returncode, done.stdout, done.stderr)
    from unittest import mock

    from typer.testing import CliRunner

    from ficoco_cli.app import app, main

    with CliRunner().isolation() as (out, err, _), mock.patch.object(sys, "argv", ["ficoco", *argv]):
        try:
            if standalone:
                main()
                code = 0
            else:
                returned = app(argv, standalone_mode=False)
                code = returned if isinstance(returned, int) else 0
        except SystemExit as exc:
            if not standalone:
                raise
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except Exception:
            if not standalone:
                raise
            code = 1
            sys.stderr.write(traceback.format_exc())
        sys.stdout.flush()  # what a command wrote with sys.stdout.write (--json -) is buffered until now
        sys.stderr.flush()
        return CliResult(code, out.getvalue().decode(errors="replace"), err.getvalue().decode(errors="replace"))


def assert_one_error_line(result: CliResult, code: int = 2) -> str:
    """`result` ended with `code` (2: a user's mistake) and one line on stderr, `error: ...`, and no
    traceback; returns that line."""
    assert result.code == code, (result.code, result.err)
    assert "Traceback" not in result.err + result.out
    lines = result.err.splitlines()
    assert len(lines) == 1, result.err
    assert lines[0].startswith("error: ") and len(lines[0]) > len("error: "), result.err
    return lines[0]


# ---- a hand-written greedy decode, the reference that `generate` of a patched model is checked against ----

def prefill_and_decode(model: nn.Module, inputs: dict[str, Any], new: int, handle: Any = None
                       ) -> tuple[Any, Tensor | None, Tensor, Any]:
    """The prefill of `inputs`, then `new - 1` greedy steps on its cache, the attention mask grown from
    the caller's prompt as a hand-written loop grows it. Returns the prefill's output, the handle's
    `output_positions` right after the prefill (None without a handle), the `new` tokens ``(B, new)``
    and the cache after the last step."""
    import torch

    from ficoco.models.hf_compat import cache_argument, output_cache

    out = model(**inputs, use_cache=True)
    positions = handle.output_positions if handle is not None else None
    cache, mask = output_cache(out), inputs["attention_mask"]
    tokens = [out.logits[:, -1].argmax(-1)]
    for _ in range(new - 1):
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        step = model(input_ids=tokens[-1][:, None], attention_mask=mask, **cache_argument(cache), use_cache=True)
        cache = output_cache(step)
        tokens.append(step.logits[:, -1].argmax(-1))
    return out, positions, torch.stack(tokens, dim=1), cache


# ---- HoliTom's reference: one video at a time, plain Python loops ---------------------------------------------

def cuda_sync_warnings(fn: Any) -> int:
    """How many host synchronisations CUDA's sync debug mode reports while `fn` runs."""
    import warnings

    import torch

    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fn()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return sum("synchroniz" in str(warning.message) for warning in caught)


def forward_with_hooks(model: nn.Module, inputs: dict[str, Any], hooks: list[Any]) -> None:
    """One no-grad forward of `model` on `inputs`, with `hooks` (handles of hooks registered to see it)
    removed after it, whatever happens."""
    import torch

    try:
        with torch.no_grad():
            model(**inputs)
    finally:
        for hook in hooks:
            hook.remove()


def assert_batch_equals_samples_alone(model: nn.Module, handle: Any, batch: dict[str, Any], alone: list[dict[str, Any]],
                                      items_per_sample: int | None = None) -> Tensor:
    """The patched `model` run on `batch` gives each sample's last logits and kept tokens as the sample
    run alone does (`items_per_sample`: a record's rows per sample, where a record holds a row per
    image or crop rather than per sample). Returns the batch's last logits."""
    import torch

    together = model(**batch).logits[:, -1]
    kept_together = [record.kept for record in handle.records]
    for i, sample in enumerate(alone):
        single = model(**sample).logits[:, -1]
        torch.testing.assert_close(together[i:i + 1], single, atol=1e-4, rtol=0)
        for record, kept in zip(handle.records, kept_together, strict=True):
            if items_per_sample is None:
                assert torch.equal(record.kept[0], kept[i])
            else:
                assert torch.equal(record.kept, kept[i * items_per_sample:(i + 1) * items_per_sample])
    return together


def _dpc(x: Tensor, clusters: int, neighbours: int, beta: float) -> list[tuple[int, Tensor]]:
    """(index, token) of every cluster of the rows of `x`, centres ascending (DPC-kNN, then merge)."""
    import torch

    if clusters == 0:
        return []
    count, width = x.shape
    dist = torch.cdist(x.double(), x.double(), compute_mode="donot_use_mm_for_euclid_dist") / math.sqrt(width)
    k = min(neighbours, clusters)
    density = [math.exp(-float((dist[i].sort().values[:k] ** 2).mean())) for i in range(count)]
    largest = float(dist.max())
    score = []
    for i in range(count):
        higher = [float(dist[i, j]) for j in range(count)
                  if density[j] > density[i] or (density[j] == density[i] and j < i)]
        score.append(min(higher, default=largest) * density[i])
    centres = sorted(sorted(range(count), key=lambda i: (-score[i], i))[:clusters])
    members: dict[int, list[int]] = {c: [] for c in centres}
    for i in range(count):
        if i not in members:
            members[min(centres, key=lambda c: (float(dist[i, c]), c))].append(i)
    out = []
    for c in centres:
        token = x[c] if not members[c] else beta * x[c] + (1 - beta) * x[members[c]].mean(dim=0)
        out.append((c, token))
    return out


def _quotas(sizes: list[int], budget: int) -> list[int]:
    total = sum(sizes)
    exact = [Fraction(s * budget, total) for s in sizes]
    floors = [math.floor(e) for e in exact]
    order = sorted(range(len(sizes)), key=lambda p: (-(exact[p] - floors[p]), p))
    for p in order[:budget - sum(floors)]:
        floors[p] += 1
    return floors


def holitom_reference(features: Tensor, scores: Tensor, budget: int, tau: float = 0.8, beta: float = 0.6,
                      neighbours: int = 7, share: float = 0.0) -> tuple[Tensor, list[int]]:
    """One video ``(F, N, D)``: the tokens HoliTom hands on and the unit (f * N + n) each stands at."""
    import torch

    frames, tokens, _ = features.shape
    unit = features / features.norm(dim=-1, keepdim=True)
    similar = (unit[:-1] * unit[1:]).sum(-1) > tau  # (F - 1, N)

    def static(s: int, e: int) -> Tensor:
        return similar[s:e].all(dim=0) if e > s else torch.zeros(tokens, dtype=torch.bool)

    best, first = [0] * (frames + 1), [0] * frames
    for i in range(frames):
        best[i + 1], first[i] = best[i], i
        for j in range(i - 1, -1, -1):  # windows [j, i] of 2, 3, ... frames; only a strict gain replaces
            gain = best[j] + (i - j) * int(static(j, i).sum())
            if gain > best[i + 1]:
                best[i + 1], first[i] = gain, j
    windows, i = [], frames - 1
    while i >= 0:
        windows.append((first[i], i))
        i = first[i] - 1
    windows.reverse()
    if frames * tokens - best[frames] < budget:
        windows = [(f, f) for f in range(frames)]
    parts = []  # (kind, frame, positions, features)
    for s, e in windows:
        mask = static(s, e)
        if e > s:
            parts.append(("static", s, mask.nonzero().flatten().tolist(), features[s:e + 1].mean(dim=0)))
        for f in range(s, e + 1):
            parts.append(("dynamic", f, (~mask).nonzero().flatten().tolist(), features[f]))
    quotas = _quotas([len(p[2]) for p in parts], budget)
    chosen: list[tuple[int, Tensor]] = []
    for (kind, f, positions, x), quota in zip(parts, quotas, strict=True):
        if kind == "static":
            chosen += [(f * tokens + positions[c], t) for c, t in _dpc(x[positions], quota, neighbours, beta)]
            continue
        dominant_count = round(quota * (1 - share))
        ranked = sorted(positions, key=lambda n: (-float(scores[f, n]), n))
        dominant = ranked[:dominant_count]
        chosen += [(f * tokens + n, x[n]) for n in dominant]
        rest = [n for n in positions if n not in dominant]
        chosen += [(f * tokens + rest[c], t) for c, t in _dpc(x[rest], quota - dominant_count, neighbours, beta)]
    chosen.sort(key=lambda item: item[0])
    return torch.stack([t for _, t in chosen]).float(), [u for u, _ in chosen]


# ---- Qwen's flattened patches of a picture (PixelPrune's images of repeated blocks) ------------------------------

def qwen_patches(picture: Tensor, vision: Any, mean: tuple[float, ...], std: tuple[float, ...]) -> Tensor:
    """The pixel_values Qwen's image processor makes of `picture` ``(H, W, 3)`` in [0, 1] (H and W multiples of
    2 x patch_size): normalised by `mean` / `std`, the still image repeated over the temporal patch, patches of
    C x T x P x P in merge-group order (a group's 2 x 2 patches consecutive). Equal pixels give bit-identical
    patches."""
    import torch

    patch, merge, temporal = vision.patch_size, vision.spatial_merge_size, vision.temporal_patch_size
    height, width, channels = picture.shape
    rows, cols = height // patch, width // patch
    frames = ((picture - torch.tensor(mean)) / torch.tensor(std)).permute(2, 0, 1)[None].expand(temporal, -1, -1, -1)
    blocks = frames.reshape(temporal, channels, rows // merge, merge, patch, cols // merge, merge, patch)
    return blocks.permute(2, 5, 3, 6, 1, 0, 4, 7).reshape(rows * cols, channels * temporal * patch * patch)


# ---- tiny local checkpoints, made offline --------------------------------------------------------------------
#
# A tiny profile's random model (save_pretrained), a
# byte-level tokenizer made here (the family's special tokens at the ids its config names) and
# the family's processor config with a chat template in the style of the real checkpoint's.
#
# Nothing is downloaded: the tokenizer is built with `tokenizers`, the processors from their
# classes, and the model from the profile with ficoco's seeded random fill.

# Chat templates written for these checkpoints in the form the real ones lay out: LLaVA-1.5 and
# Video-LLaVA "USER: <image>\n{text} ASSISTANT:", LLaVA-NeXT (vicuna) "USER: <image>\n{text}
# ASSISTANT:", Qwen2-VL ChatML with <|vision_start|><|image_pad|><|vision_end|> (<|video_pad|> for a video).
_USER_ASSISTANT = (
    "{% for message in messages %}{{ message['role'].upper() + ': ' }}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}{{ '<image>\n' }}"
    "{% elif part['type'] == 'video' %}{{ '<video>\n' }}{% endif %}{% endfor %}"
    "{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] + ' ' }}{% endif %}"
    "{% endfor %}{% endfor %}{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)
_CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}"
    "{{ '<|vision_start|><|image_pad|><|vision_end|>' }}{% elif part['type'] == 'video' %}"
    "{{ '<|vision_start|><|video_pad|><|vision_end|>' }}{% elif part['type'] == 'text' %}{{ part['text'] }}"
    "{% endif %}{% endfor %}{{ '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# LLaVA-OneVision (Qwen2's ChatML, "<image>\n" before the text, as llava-hf's template lays it out).
_ONEVISION_CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}{{ '<image>\n' }}"
    "{% elif part['type'] == 'video' %}{{ '<video>\n' }}{% endif %}{% endfor %}"
    "{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{{ '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Family -> (profile, special tokens by id).
FAMILIES = {
    "llava": ("llava-tiny", {300: "<image>", 301: "<pad>"}),
    "llava_next": ("llava-next-tiny", {300: "<image>", 301: "<pad>"}),
    "video_llava": ("video-llava-tiny", {300: "<image>", 301: "<video>", 302: "<pad>"}),
    "llava_onevision": ("llava-onevision-tiny", {300: "<image>", 301: "<video>", 302: "<|im_start|>",
                                                 303: "<|im_end|>", 304: "<pad>"}),
    "qwen2_vl": ("qwen2-vl-tiny", {300: "<|image_pad|>", 301: "<|video_pad|>", 302: "<|vision_start|>",
                                   303: "<|vision_end|>", 304: "<|im_start|>", 305: "<|im_end|>", 306: "<pad>"}),
}
FAMILIES["qwen2_5_vl"] = ("qwen2.5-vl-tiny", FAMILIES["qwen2_vl"][1])  # Qwen2-VL's tokens and processor
# Qwen3-VL: Qwen2-VL's tokens and image processor, with 16 px patches and its checkpoints' pixel bounds.
FAMILIES["qwen3_vl"] = ("qwen3-vl-tiny", FAMILIES["qwen2_vl"][1])
FAMILIES["qwen3_vl_moe"] = ("qwen3-vl-moe-tiny", FAMILIES["qwen2_vl"][1])
QWEN_FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")
# Qwen3.5: the same tokens, image processor and pixel bounds as Qwen3-VL.
FAMILIES["qwen3_5"] = ("qwen3.5-tiny", FAMILIES["qwen2_vl"][1])
QWEN_FAMILIES += ("qwen3_5",)
# InternVL3: <img> </img> <IMG_CONTEXT> at the placeholder id and the two before it, as InternVL3's tokenizer.
FAMILIES["internvl"] = ("internvl3-tiny", {277: "<|im_start|>", 278: "<|im_end|>", 297: "<video>", 298: "<img>",
                                           299: "</img>", 300: "<IMG_CONTEXT>", 301: "<pad>"})
# The tokens InternVLProcessor reads by name from its tokenizer (InternVL3-hf's tokenizer_config.json).
INTERNVL_NAMED = {"start_image_token": "<img>", "end_image_token": "</img>", "context_image_token": "<IMG_CONTEXT>",
                  "video_token": "<video>"}
# InternVL3's -hf template: ChatML, "<IMG_CONTEXT>\n" for an image before the text.
_INTERNVL_CHATML = _ONEVISION_CHATML.replace("<image>", "<IMG_CONTEXT>")


def make_tokenizer(specials: dict[int, str], vocab_size: int, *, add_bos: bool, named: dict[str, str] | None = None):
    """A byte-level tokenizer without merges: ids 0-2 <unk> <s> </s>, then the 256 byte symbols,
    the family's special tokens at their config ids, unused fillers up to `vocab_size`; `named`: special
    tokens the family's processor reads by name (InternVL3's `start_image_token`...)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for symbol in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[symbol] = len(vocab)
    for index in range(len(vocab), vocab_size):
        vocab[specials.get(index, f"<unused_{index}>")] = index
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    if add_bos:  # LLaMA's tokenizer starts every prompt with <s>
        backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    pad = specials.get(max(specials))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>",
                                        unk_token="<unk>", pad_token=pad, extra_special_tokens=named or {})
    tokenizer.add_special_tokens({"additional_special_tokens": list(specials.values())})
    return tokenizer


def make_processor(family: str, model):
    """The family's processor for `model`'s config with the PIL image processors (no torchvision):
    the whole processor for LLaVA-1.5 and LLaVA-NeXT; for Qwen2-VL and Video-LLaVA, whose
    processors transformers 5 builds only with torchvision (they hold a video processor), the
    pieces a checkpoint stores: (tokenizer, image processor, chat template)."""
    config = model.config
    _, specials = FAMILIES[family]
    tokenizer = make_tokenizer(specials, config.get_text_config().vocab_size,
                               add_bos=family not in (*QWEN_FAMILIES, "llava_onevision", "internvl"),
                               named=INTERNVL_NAMED if family == "internvl" else None)
    if family in QWEN_FAMILIES:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        vision = config.vision_config
        bounds = {}
        # The bounds Qwen3-VL's preprocessor_config.json gives (Qwen3.5's the same).
        if family in ("qwen3_vl", "qwen3_vl_moe", "qwen3_5"):
            from ficoco.accounting.families.qwen3_vl import MAX_PIXELS, MIN_PIXELS

            bounds = {"size": {"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS}}
        images = Qwen2VLImageProcessorPil(patch_size=vision.patch_size, merge_size=vision.spatial_merge_size,
                                          temporal_patch_size=vision.temporal_patch_size, **bounds)
        return tokenizer, images, _CHATML
    if family == "internvl":  # its whole processor needs torchvision (the video processor)
        from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil

        height, width = config.vision_config.image_size
        return tokenizer, GotOcr2ImageProcessorPil(size={"height": height, "width": width}, crop_to_patches=True), \
            _INTERNVL_CHATML
    side = config.vision_config.image_size
    if family == "llava_onevision":  # its whole processor needs torchvision (the video processor)
        from transformers.models.llava_onevision.image_processing_pil_llava_onevision import (
            LlavaOnevisionImageProcessorPil,
        )

        images = LlavaOnevisionImageProcessorPil(size={"height": side, "width": side},
                                                 crop_size={"height": side, "width": side},
                                                 image_grid_pinpoints=config.image_grid_pinpoints)
        return tokenizer, images, _ONEVISION_CHATML
    if family == "video_llava":
        from transformers import VideoLlavaImageProcessor

        images = VideoLlavaImageProcessor(size={"shortest_edge": side}, crop_size={"height": side, "width": side})
        return tokenizer, images, _USER_ASSISTANT
    common = {"patch_size": config.vision_config.patch_size, "chat_template": _USER_ASSISTANT,
              "vision_feature_select_strategy": config.vision_feature_select_strategy,
              "num_additional_image_tokens": 1}
    if family == "llava":
        from transformers import LlavaProcessor
        from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

        images = CLIPImageProcessorPil(size={"shortest_edge": side}, crop_size={"height": side, "width": side})
        return LlavaProcessor(image_processor=images, tokenizer=tokenizer, **common)
    from transformers import LlavaNextProcessor
    from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil

    images = LlavaNextImageProcessorPil(size={"shortest_edge": side}, crop_size={"height": side, "width": side},
                                        image_grid_pinpoints=config.image_grid_pinpoints)
    return LlavaNextProcessor(image_processor=images, tokenizer=tokenizer, **common)


def make_checkpoint(family: str, folder: Path, *, processor: bool = True, chat_template: bool = True,
                    overrides: dict[str, Any] | None = None) -> Path:
    """Save the tiny model of `family` (random weights, float32), with the profile's config `overrides`
    (`--set`'s keys) applied, and, unless `processor` is False, its tokenizer, image processor and chat
    template into `folder`."""
    import ficoco

    profile, _ = FAMILIES[family]
    model = ficoco.build_model(profile, dtype="fp32", check_memory=False, overrides=overrides)
    model.save_pretrained(folder)
    if processor:
        made = make_processor(family, model)
        if isinstance(made, tuple):
            tokenizer, images, template = made
            tokenizer.save_pretrained(folder)
            images.save_pretrained(folder)
            if chat_template:
                (Path(folder) / "chat_template.jinja").write_text(template)
        else:
            if not chat_template:
                made.chat_template = None
            made.save_pretrained(folder)
    return folder


# ---- a small local lmms-eval task, made offline --------------------------------------------------------------
#
# A few generated images with a question and a known answer each, in a JSON-lines file that lmms-eval
# reads with the `json` dataset builder (no hub), and the task's YAML and utils.py beside them, found
# with --include-path. `answers` sets the targets (default: the colour's name); `images` per document
# makes a task of several images per prompt.

EVAL_COLOURS = {"red": (220, 30, 30), "green": (30, 200, 30), "blue": (30, 30, 220), "white": (250, 250, 250)}


def make_eval_task(folder: Path, name: str = "ficoco_colours", *, answers: list[str] | None = None,
                   images: int = 1, max_new_tokens: int = 4, size: tuple[int, int] = (64, 48)) -> Path:
    """Write an lmms-eval task `name` into `folder` (created) and return the folder."""
    import json

    from PIL import Image

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    docs = []
    for index, (colour, rgb) in enumerate(EVAL_COLOURS.items()):
        files = []
        for k in range(images):
            shade = tuple(max(0, c - 40 * k) for c in rgb)
            file = f"{name}-{colour}-{k}.png"
            Image.new("RGB", size, shade).save(folder / file)
            files.append(file)
        docs.append({"id": index, "images": files, "question": "What colour is the image?",
                     "answer": answers[index] if answers is not None else colour})
    (folder / f"{name}.jsonl").write_text("".join(json.dumps(doc) + "\n" for doc in docs))
    (folder / f"{name}_utils.py").write_text(
        "from pathlib import Path\n\nfrom PIL import Image\n\nHERE = Path(__file__).parent\n\n\n"
        "def doc_to_visual(doc):\n    return [Image.open(HERE / f).convert('RGB') for f in doc['images']]\n\n\n"
        "def doc_to_text(doc):\n    return doc['question'] + ' Answer with one word.'\n")
    (folder / f"{name}.yaml").write_text(
        f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {folder / (name + '.jsonl')}\n"
        f"test_split: test\noutput_type: generate_until\ndoc_to_visual: !function {name}_utils.doc_to_visual\n"
        f"doc_to_text: !function {name}_utils.doc_to_text\ndoc_to_target: answer\n"
        f"generation_kwargs:\n  max_new_tokens: {max_new_tokens}\n  temperature: 0\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n    aggregation: mean\n    higher_is_better: true\n"
        "    ignore_case: true\n    ignore_punctuation: true\nmetadata:\n  version: 0.0\n")
    return folder


def run_lmms_eval(out: Path, model_args: str, tasks: str, include: Path, *, batch_size: int = 1,
                  timeout: float = 600) -> tuple[CliResult, dict[str, Any] | None, list[dict[str, Any]]]:
    """The real `lmms-eval` command (the console script beside this Python) with `--model ficoco`, the hub
    and datasets offline and their caches under `out`: (its result, its results JSON, its logged samples)."""
    import json

    out.mkdir(parents=True, exist_ok=True)
    script = Path(sys.executable).with_name("lmms-eval")
    command = [str(script), "--model", "ficoco", "--model_args", model_args, "--tasks", tasks, "--include_path",
               str(include), "--batch_size", str(batch_size), "--output_path", str(out / "lmms"), "--log_samples"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(out / "hf-home"),
           "TRANSFORMERS_OFFLINE": "1"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=out, env=env)
    result = CliResult(done.returncode, done.stdout, done.stderr)
    found = sorted((out / "lmms").rglob("*_results.json"))
    results = json.loads(found[-1].read_text()) if found else None
    samples = [json.loads(line) for path in sorted((out / "lmms").rglob("*_samples_*.jsonl"))
               for line in path.read_text().splitlines() if line.strip()]
    return result, results, samples
