"""VTW's offline search for K (`ficoco calibrate vtw`), as lzhxmu/VTW @ a3d8cfc runs it with `--findk`.

The official search (llava/model/language_model/VTW.py:234-265 and :102-107, lmms_eval/__main__.py:388-400): per
sample, the forward with every token gives the last token's next-token distribution p_full; for every candidate
layer K in 5..L-1, the whole forward is run again withdrawing every visual token at K's input, giving p_K; the
sample's KL(p_K || p_full) is kept per K. Over the samples (`--limit 20` of ScienceQA-IMG in the README) the mean
KL per K is taken, and K is the first candidate whose mean is at most eta (0.003 for LLaVA-1.5-7B, 0.0005 for
13B, 0.0001 for LLaVA-NeXT-vicuna-7B, 0.003 otherwise).

Here each withdrawal runs through ficoco's own VTW (`ficoco.apply(model, "vtw", layer=K)`): the run the found K
will be used in, on every family. The samples are the user's: images (or Video-LLaVA videos) with prompts, laid
out by a local checkpoint's own processor and chat template, or, on random weights, synthetic prompts (the result
says so: such a K describes a randomly initialised model). The KL is computed in float64 from the logits (the
official code takes it in the model's dtype). On a hybrid decoder (Qwen3.5) the candidates are its
full-attention layers after the first, where VTW may withdraw (ficoco.methods.hybrid).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ficoco.errors import FicocoError
from ficoco.methods.vtw import FIRST_SEARCHED_LAYER, SEARCH_SAMPLES, default_eta, first_layer_within, layer_average
from ficoco.methods.vtw.ops import withdrawal_kl

RANDOM_WEIGHTS_NOTE = ("random weights and synthetic prompts: the K found describes a randomly initialised model, not "
                       "a checkpoint; give weights= (a local checkpoint folder) and image= for a trained one")


@dataclass
class Sample:
    """One calibration prompt: the model's inputs (batch 1) and the layout `apply` plans it with."""

    inputs: dict[str, Any]
    label: str
    image_size: tuple[int, int] | None = None
    frames: int | None = None
    text_tokens: int | None = None


@dataclass
class VtwCalibration:
    """What the search found: the mean KL per searched layer and the first within eta (None: none is).

    Attributes:
        model: the model argument; weights: "random" or the checkpoint.
        decoder_layers: L; layers: the searched candidates (5..L-1, a hybrid decoder's full-attention ones).
        eta, eta_source: the threshold and where it came from (given, or the official value for the checkpoint).
        mean_kl: per searched layer, KL(p_K || p_full) in nats averaged over the samples.
        per_sample: per sample, its KL per layer (the same order as `samples`).
        samples: a label per sample (the image and prompt, or the synthetic seed).
        layer: the K found, or None.
        visual_tokens: visual tokens of the first sample's prompt (the layer average of K is K * N / L).
        forwards: the model's forwards the search ran (per sample: one with every token, one per layer).
        search_tflops: their analytic cost (flops convention, scope all, the whole model: tower, decoder, LM head).
        notes: what the reader must know (random weights, fewer samples than asked, ...).
    """

    model: str
    weights: str
    decoder_layers: int
    layers: list[int]
    eta: float
    eta_source: str
    mean_kl: dict[int, float]
    per_sample: list[dict[int, float]]
    samples: list[str]
    layer: int | None
    visual_tokens: int
    forwards: int
    search_tflops: float
    notes: list[str] = field(default_factory=list)

    @property
    def layer_average(self) -> float | None:
        """Visual tokens per decoder layer, averaged, of a run at the K found (K * N / L)."""
        return None if self.layer is None else layer_average(self.layer, self.visual_tokens, self.decoder_layers)

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": "ficoco.calibration/vtw", "method": "vtw", "model": self.model, "weights": self.weights,
            "decoder_layers": self.decoder_layers, "searched_layers": self.layers, "eta": self.eta,
            "eta_source": self.eta_source, "layer": self.layer,
            "mean_kl": {str(k): v for k, v in self.mean_kl.items()},
            "samples": [{"sample": label, "kl": {str(k): v for k, v in kl.items()}}
                        for label, kl in zip(self.samples, self.per_sample, strict=True)],
            "visual_tokens": self.visual_tokens, "layer_average_visual_tokens": self.layer_average,
            "forwards": self.forwards, "search_tflops": self.search_tflops,
            "hyperparameters": None if self.layer is None else {"layer": self.layer}, "notes": self.notes,
        }


def searched_layers(arch: Any, first_layer: int) -> list[int]:
    """The candidates: layers `first_layer`..L-1 (the official `range(5, len(self.layers))`), on a hybrid decoder
    those VTW may withdraw at (full attention, after the first); one line when none is left."""
    from ficoco.accounting.methods import hybrid_layers

    n_layers = arch.decoder.layers
    if first_layer < 1:
        raise FicocoError(f"first_layer={first_layer}: the search starts at a decoder layer from 1 on (official: "
                          f"{FIRST_SEARCHED_LAYER})")
    hybrid = hybrid_layers(arch)
    layers = [k for k in range(first_layer, n_layers) if hybrid is None or k in hybrid.withdrawal_layers()]
    if not layers:
        where = "" if hybrid is None else " full-attention (after the first)"
        raise FicocoError(f"first_layer={first_layer}: {arch.name}'s decoder has layers 0..{n_layers - 1}, and "
                          f"no{where} layer from {first_layer} on is left to search; give a lower first_layer=")
    return layers


def _media(paths: Sequence[str], option: str) -> list[str]:
    """Files in the given order, a folder's images (or, for videos, its frame folders are the videos themselves)."""
    from ficoco.models.prompt import IMAGE_SUFFIXES

    found: list[str] = []
    for given in paths:
        path = Path(given).expanduser()
        if option == "image" and path.is_dir():
            files = sorted(p for p in path.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)
            if not files:
                raise FicocoError(f"image={given}: the folder holds no images ({', '.join(IMAGE_SUFFIXES)})")
            found += [str(p) for p in files]
        else:
            found.append(str(path))
    return found


def _checkpoint_samples(model: Any, profile: Any, folder: str, images: list[str], videos: list[str],
                        prompts: Sequence[str], limit: int, notes: list[str]) -> Iterator[Sample]:
    """The user's images (or videos) and prompts, laid out one per sample by the checkpoint's processor."""
    from ficoco.models.prompt import encode_prompt

    media = [("image", path) for path in images] + [("video", path) for path in videos]
    if not media:
        raise FicocoError("weights= with no image= or video=: the search compares the model with and without its "
                          "visual tokens, so every sample needs an image (or a video)")
    if len(prompts) > 1 and len(prompts) != len(media):
        raise FicocoError(f"prompt= given {len(prompts)} times for {len(media)} images or videos: give one prompt for "
                          "all, or one per image in the same order")
    if len(media) < limit:
        notes.append(f"{len(media)} sample(s) given, fewer than limit={limit}: all are used")
    param = next(model.parameters())
    dtype = param.dtype if param.is_floating_point() else torch.float16
    device = _device_of(model)
    for index, (kind, path) in enumerate(media[:limit]):
        question = prompts[index] if len(prompts) > 1 else (prompts[0] if prompts else None)
        encoded = encode_prompt(folder, profile.config, prompt=question, **{kind: path},
                                default_frames=int(profile.defaults.get("frames", 8)))
        notes.extend(note for note in encoded.notes if note not in notes)
        label = f"{kind}={path}" + (f" prompt={question!r}" if question is not None else "")
        yield Sample(encoded.batch(1, device=device, dtype=dtype), label, encoded.image_size, encoded.frames,
                     encoded.text_tokens)


def _device_of(model: Any) -> torch.device:
    from ficoco.models.inputs import input_device

    return input_device(model)


def _synthetic_samples(model: Any, limit: int, seed: int, text_tokens: int) -> Iterator[Sample]:
    from ficoco.models import synthetic_inputs

    for index in range(limit):
        inputs = synthetic_inputs(model, batch=1, text_tokens=text_tokens, seed=seed + index, device=_device_of(model))
        yield Sample(inputs, f"synthetic prompt, seed {seed + index}", text_tokens=text_tokens)


def last_logits(model: Any, inputs: dict[str, Any]) -> torch.Tensor:
    """(1, vocab) the next-token logits at the prompt's last position."""
    with torch.no_grad():
        return model(**inputs).logits[:, -1].float()


def sample_kl(model: Any, sample: Sample, layers: Sequence[int]) -> dict[int, float]:
    """One sample's KL(p_K || p_full) per layer K: the model as it is, then withdrawing at each K (VTW.py:234-265)."""
    import ficoco

    full = last_logits(model, sample.inputs)
    kl = {}
    for layer in layers:
        with ficoco.apply(model, "vtw", layer=layer, image_size=sample.image_size, frames=sample.frames):
            kl[layer] = float(withdrawal_kl(full, last_logits(model, sample.inputs))[0])
    return kl


def _search_cost(profile: Any, samples: Sequence[Sample], layers: Sequence[int]) -> tuple[float, int]:
    """(analytic TFLOPs of the search, visual tokens of the first sample): per sample the forward with every token
    and one withdrawing at each searched layer (flops convention, scope all)."""
    from ficoco.accounting import CountOptions, architecture, compute_tera, resolve_schedule
    from ficoco.accounting.schedule import Schedule

    total, visual = 0.0, 0
    for index, sample in enumerate(samples):
        arch = architecture(profile, image_size=sample.image_size, frames=sample.frames)
        opts = CountOptions(convention="flops", scope="all", text_tokens=sample.text_tokens)
        visual = arch.visual_tokens if index == 0 else visual
        total += compute_tera(arch, Schedule("vanilla"), opts)
        for layer in layers:
            total += compute_tera(arch, resolve_schedule(arch, "vtw", opts, hyperparameters={"layer": layer}), opts)
    return total, visual


def calibrate_vtw(model: str, *, weights: str = "random", image: Sequence[str] = (), video: Sequence[str] = (),
                  prompt: Sequence[str] = (), eta: float | None = None, limit: int = SEARCH_SAMPLES,
                  first_layer: int = FIRST_SEARCHED_LAYER, overrides: Sequence[str] = (), seed: int = 0,
                  text_tokens: int = 60, device: str = "auto", dtype: str = "auto",
                  progress: Callable[[str], None] | None = None) -> VtwCalibration:
    """VTW's K for `model` (a profile name, a config.json or a checkpoint folder): the official search on the user's
    samples (`weights` a local checkpoint folder, `image`/`video` files or image folders, `prompt` one for all or
    one per image), or on `limit` synthetic prompts of random weights; at most `limit` samples, candidates
    `first_layer`..L-1, K the first whose mean KL(p_K || p_full) is at most `eta` (None: the official value for the
    checkpoint). Every mistake is one FicocoError line, found before the model is built where it can be."""
    from ficoco.accounting import architecture
    from ficoco.api import build_model
    from ficoco.profiles import load_profile
    from ficoco.profiling.matrix import resolve_device

    if limit < 1:
        raise FicocoError(f"limit={limit}: give the number of samples to average over (official: {SEARCH_SAMPLES})")
    if eta is not None and not (math.isfinite(eta) and eta > 0):
        raise FicocoError(f"eta={eta}: give the largest mean KL a withdrawal may cost, above 0 (official: 0.003 for "
                          "LLaVA-1.5-7B)")
    random_weights = weights == "random"
    if random_weights and (image or video or prompt):
        raise FicocoError("image=, video= and prompt= are laid out by a checkpoint's own processor: give weights= (a "
                          "local checkpoint folder), or none of them for synthetic prompts on random weights")
    folder = None if random_weights else str(Path(weights).expanduser())
    source = folder if folder is not None and Path(folder).is_dir() else model
    profile = load_profile(source, list(overrides))
    layers = searched_layers(architecture(profile), first_layer)
    images, videos = _media(image, "image"), _media(video, "video")
    notes: list[str] = []
    if random_weights:
        notes.append(RANDOM_WEIGHTS_NOTE)
    if eta is None:
        eta, eta_source = default_eta(model, weights if not random_weights else "",
                                      str(profile.defaults.get("source", "")))
    else:
        eta_source = "given"
    built = build_model(profile, weights, dtype=dtype, device=str(resolve_device(device, notes)), seed=seed)
    samples = list(_synthetic_samples(built, limit, seed, text_tokens) if random_weights else
                   _checkpoint_samples(built, profile, folder or model, images, videos, prompt, limit, notes))
    per_sample = []
    for index, sample in enumerate(samples):
        if progress is not None:
            progress(f"sample {index + 1}/{len(samples)}: {sample.label}: {len(layers) + 1} forwards")
        per_sample.append(sample_kl(built, sample, layers))
    mean_kl = {layer: sum(kl[layer] for kl in per_sample) / len(per_sample) for layer in layers}
    tflops, visual = _search_cost(profile, samples, layers)
    return VtwCalibration(
        model=model, weights=weights, decoder_layers=architecture(profile).decoder.layers, layers=layers, eta=eta,
        eta_source=eta_source, mean_kl=mean_kl, per_sample=per_sample, samples=[s.label for s in samples],
        layer=first_layer_within(mean_kl, eta), visual_tokens=visual, forwards=len(samples) * (len(layers) + 1),
        search_tflops=tflops, notes=notes)
