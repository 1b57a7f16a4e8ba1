"""The handle of a patched model and its records: what `ficoco.apply` returns and every adapter
fills (the patching code's own state: per-forward bookkeeping, the method's timed spans, the
records of kept and discarded tokens), and FiCoCo's hyperparameters on it. `ficoco.api` re-exports them."""

from __future__ import annotations

import contextlib
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from ficoco import testing_hooks
from ficoco.accounting.schedule import Schedule
from ficoco.methods import ficoco_l, ficoco_v
from ficoco.methods.reads import DEFAULT_ATTENTION_SCORES
from ficoco.methods.reads.ops import ReadRunner
from ficoco.models import hf_compat
from ficoco.models.patching import LanguageState, Patches
from ficoco.models.stage_timer import StageTimer


@dataclass(frozen=True)
class Hyperparameters:
    """FiCoCo's hyperparameters on a handle (`ficoco.apply(model, "v", lam=0.5)`), set per handle; the
    defaults are FiCoCo-V's and FiCoCo-L's own constants (ficoco.methods.ficoco_v, ficoco_l: the paper's)."""

    lam: float = ficoco_v.LAM  # V filter: vision-aware vs semantic term
    beta: float = ficoco_l.BETA  # L filter: vision-aware vs task-aware term
    gamma: float = ficoco_l.GAMMA  # L correlate: direct vs indirect term
    eps: float = ficoco_v.EPS  # quantile of the token-adaptive K (FiCoCo-L's EPS is the same)
    window: int = ficoco_v.WINDOW  # V local penalty window
    coefficient: float = ficoco_v.COEFFICIENT  # V local penalty factor
    equivalent_token: bool = ficoco_v.EQUIVALENT_TOKEN  # V: score with the equivalent token instead of [CLS]


@dataclass(frozen=True)
class LayerRecord:
    """One reducing layer of the last forward: kept and discarded token indices.

    For V they are flat indices on the original patch grid (row-major), per vision item; for L
    they are offsets inside the original image span, per sample. `merged_into`, for a method
    that merges, holds for every discarded token (in `discarded`'s order and index space) the
    kept token that received the largest share of it; None for a method that only drops.
    """

    stage: str
    layer: int
    kept: Tensor
    discarded: Tensor
    merged_into: Tensor | None = None


@dataclass
class Handle:
    """A model patched with FiCoCo; `remove()` (or leaving a `with` block) restores it.

    The patched model stays a Hugging Face model; where its outputs differ in shape from the
    unpatched model's, this is what they mean:

    - **Output positions.** FiCoCo-V runs the LLM on a prompt whose image spans are shortened,
      FiCoCo-L drops visual tokens inside the decoder: logits and the last hidden states of a
      prefill hold fewer positions than `input_ids`. After every forward, `output_positions`
      ``(B, T_out)`` gives the position in that call's `input_ids` of every output position
      (inside `generate`: in the prompt the caller gave `generate`); a call that removed nothing
      gives ``0..T-1``. `torch.gather(input_ids, 1, handle.output_positions)` lines the inputs up
      with the logits.
    - **Labels.** `model(**inputs, labels=labels)` with `labels` shaped like `input_ids` returns
      the model's own causal-LM loss over the positions that remain: the labels are taken at
      `output_positions`, so the logits at each remaining position are scored against the next
      remaining token. Image placeholders carry -100 in every family's label convention, so the
      terms are the same text tokens as the unpatched model's; only the token before the first
      text token after an image may be a different (kept, merged) visual token. With an empty
      schedule the loss is the unpatched model's.
    - **generate** returns the caller's own prompt followed by the new tokens (tensor and
      `.sequences`), whatever the variant; scores and logits are one per new token.
    - `output_hidden_states=True` gives one tensor per layer, each as long as the sequence that
      layer really ran on; `output_attentions=True` (attn_implementation='eager') one matrix per
      layer, the one that layer really computed.
    """

    model: nn.Module
    variant: str
    schedule: Schedule
    hyperparameters: Hyperparameters
    keep_per_image: int | None = None
    # Spans "reduction" (the method's own steps) and "probe" (its reads of a layer's attention, computed
    # beside the layer's own kernel), exclusive of each other, timed without host synchronisation.
    timer: StageTimer = field(default_factory=StageTimer, repr=False)
    # The rule the method's attention reads compute scores by (ficoco.methods.reads: its `attention_scores`).
    attention_scores: str = DEFAULT_ATTENTION_SCORES
    vision_state: Tensor | None = None
    # A method acting before the LLM: its current tower forward (ficoco.models.vision_steps), and the
    # visual tokens every item of the last image call handed the LLM, as measured (PruMerge+'s
    # adaptive count, or the planned count of any other method; a Video-LLaVA frame's [CLS] apart). A decoder
    # method whose count is adaptive (VLM-Pruner) leaves here the visual tokens its step kept in the last
    # one-image prefill (None with several images: the prompt's count is not one image's).
    tower_state: Any = None
    measured_tokens_per_item: int | None = None
    # A method whose counts are the input's own (`MethodSpec.content_counts`: MustDrop): per step of the last image
    # call, (stage, layer, where) -> what it removed per item (a vision step) or per sample (a decoder step; none
    # with several images per prompt), the same in every item or sample, for the accountant's re-plan.
    measured_steps: dict[tuple[str, int, str], int] = field(default_factory=dict)
    # A method acting before the LLM and again inside it: what its cut handed on per token for its part in the
    # decoder (`TowerOutput.carry`: ViTCoP's cluster labels, MustDrop's key set), (items, tokens) of the last image
    # call, -1 on a token the cut did not see; the decoder's state takes it at the prefill's first layer.
    vision_carry: Tensor | None = None
    # The prompt (input_ids, attention_mask) of the image call in progress, as the entry received it:
    # a method before the LLM that reads the instruction (CDPruner) embeds its text tokens from it.
    prompt_ids: tuple[Tensor, Tensor | None] | None = field(default=None, repr=False)
    # Qwen2.5-VL under FiCoCo-V: the query-key pairs every vision layer of the last tower pass ran
    # (its windows, as the reduction left them), for flops --verify's accountant.
    vision_attention_pairs: dict[int, int] = field(default_factory=dict, repr=False)
    language_state: LanguageState | None = None
    # (B, T_out) position in the last forward's input_ids of every output position (see above).
    output_positions: Tensor | None = None
    # FiCoCo-L: the state that filled each cache the handle has seen (decode steps and later
    # turns follow the cache they are given); weak, so caches are freed as usual.
    cache_states: weakref.WeakKeyDictionary = field(default_factory=weakref.WeakKeyDictionary, repr=False)
    # FiCoCo-V: the last shortened prompt (kept positions, caller's length), so that decode
    # steps whose attention mask grew from the caller's prompt line up with the cache.
    prompt_map: tuple[Tensor, int] | None = field(default=None, repr=False)
    # flops --verify: runs a method's own work at a layer through a counter's module (see run_method), and its
    # reads of a layer's attention through another (see read_runner).
    method_runner: Callable[..., Any] | None = field(default=None, repr=False)
    probe_runner: Callable[..., Any] | None = field(default=None, repr=False)
    # A profile's untimed forward sets `reference_attention`: a layer whose attention and reads ran fused
    # (ficoco.methods.reads.ops.fused) then runs the model's own kernel once more, timed, into `reference_attention_ms`.
    reference_attention: bool = field(default=False, repr=False)
    reference_attention_ms: float = field(default=0.0, repr=False)
    _patches: Patches = field(default_factory=Patches, repr=False)
    # Records stay on the model's device until read: copying them to the host per layer would
    # synchronise the device inside the forward.
    _pending: list[LayerRecord] = field(default_factory=list, repr=False)
    _records: list[LayerRecord] = field(default_factory=list, repr=False)

    @property
    def records(self) -> list[LayerRecord]:
        """Per reducing layer of the last forward: kept and discarded indices (on the CPU)."""
        if self._pending:
            self._records += [LayerRecord(r.stage, r.layer, r.kept.cpu(), r.discarded.cpu(),
                                          None if r.merged_into is None else r.merged_into.cpu())
                              for r in self._pending]
            self._pending = []
        return self._records

    def run_method(self, layer: int | tuple[str, int | None], function: Callable[..., Any], *args: Any,
                   **kwargs: Any) -> Any:
        """Run a method's own work at decoder layer `layer` (its steps and probes), or where a
        vision-side method runs it (``("vision", tower layer)`` or ``("projector", None)``), inside
        the "reduction" span; `method_runner`, when set (flops --verify), runs it instead, so that
        counters can attribute it to the method."""
        device = next((t.device for a in (*args, *kwargs.values())
                       for t in (a, getattr(a, "hidden", None)) if isinstance(t, Tensor)), None)
        with self.timer.span("reduction", device) if device is not None else contextlib.nullcontext():
            if testing_hooks.REDUCTION_DELAY_S:  # test-only slowdown (FICOCO_TEST_DELAY_REDUCTION_MS), off unless set
                testing_hooks.delay_reduction()
            if self.method_runner is not None:
                return self.method_runner(layer, function, *args, **kwargs)
            return function(*args, **kwargs)

    def read_runner(self, place: int | tuple[str, int | None]) -> ReadRunner:
        """How the method's reads of the attention at `place` (a decoder layer, or ``("vision", layer)``) run:
        in the "probe" span, and through `probe_runner` when set (flops --verify), so that counters see a read
        apart from the layer and from the method's steps, wherever the step that asks for it runs."""

        def run(device: Any, function: Callable[..., Any], *args: Any) -> Any:
            with self.timer.span("probe", device):
                if self.probe_runner is not None:
                    return self.probe_runner(place, function, *args)
                return function(*args)

        run.attend = self._attention_runner()  # type: ignore[attr-defined]
        return run

    def _attention_runner(self) -> Callable[..., Any]:
        """How a read layer's attention runs (`ficoco.models.attention.attend`): ``attend(device, compute,
        reference)``. `compute` (the layer's output, and its reads where they are fused) runs in the "fused" span
        when `reference` (the model's own kernel on the same inputs) is given, else in "attention" (the model's
        kernel, reads beside it). With `reference_attention` on (one untimed forward of a profile), the model's
        kernel is timed once more on the same inputs after a fused pass, synchronised, into
        `reference_attention_ms`: what the fused layers' attention costs without the reads."""

        def attend(device: Any, compute: Callable[[], Any], reference: Callable[[], Any] | None = None) -> Any:
            with self.timer.span("attention" if reference is None else "fused", device):
                result = compute()
            if reference is not None and self.reference_attention:
                synchronize = torch.cuda.synchronize if getattr(device, "type", "cpu") == "cuda" else (lambda: None)
                synchronize()
                start = time.perf_counter()
                with hf_compat.unobserved():  # not a call of the forward's: a profile's kernel record skips it
                    reference()
                synchronize()
                self.reference_attention_ms += (time.perf_counter() - start) * 1e3
            return result

        return attend

    @property
    def reduction_seconds(self) -> float:
        """Seconds in the reduction stages since the timer's last reset (waits for the device)."""
        return self.timer.total_ms("reduction") / 1e3

    def begin_forward(self) -> None:
        """A new image forward: forget the previous one's records and vision state. FiCoCo-L's
        state stays until the entry replaces it: a new turn on its cache needs what each layer
        cached."""
        self._pending, self._records = [], []
        self.vision_state = None
        self.vision_carry = None
        self.measured_steps = {}
        self.output_positions = None

    def record(self, stage: str, layer: int, *, kept: Tensor, discarded: Tensor,
               merged_into: Tensor | None = None) -> None:
        self._pending.append(LayerRecord(stage, layer, kept.detach(), discarded.detach(),
                                         None if merged_into is None else merged_into.detach()))

    def remove(self) -> None:
        """Restore the model exactly as it was before `apply`."""
        self._patches.undo()
        self.language_state = self.vision_state = self.output_positions = self.prompt_map = None
        self.prompt_ids = None
        self.tower_state = self.vision_carry = None
        self.cache_states.clear()
        if self.model.__dict__.get("_ficoco_handle") is self:
            del self.model.__dict__["_ficoco_handle"]

    def __enter__(self) -> Handle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()
