"""Fidelity against vanilla (`ficoco profile --fidelity`): how far a reduced row's outputs move
from its vanilla row's, measured on the same inputs in the same run.

Per reduced row, against the vanilla row of its quant and batch:
- KL(vanilla || reduced) of the next-token distribution at the last prompt position, in nats
  (mean and largest over the batch's prompts);
- top-1 agreement: the share of prompts whose most likely next token is the same;
- with `--new-tokens N`, greedy-token agreement: per prompt, the length of the prefix of the N
  greedy tokens that matches vanilla's, as tokens (mean) and as a share of N (mean);
- where a tokenizer exists (a checkpoint's processor), both decoded continuations.

The figures come from the row's last timed prefill (its logits at the last position) and its
last generation (its last N tokens: right whether generate returns the caller's prompt or a
shortened one), so they cost no extra forward.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from ficoco.profiling.rows import FidelityFigures, FidelityRecord

RANDOM_WEIGHTS_NOTE = ("random weights: these figures describe a randomly initialised model, not the checkpoint's "
                       "quality; give weights= for a trained one")


@dataclass
class Observation:
    """What a row produced: next-token logits (batch, vocab) at the last prompt position and, with
    generation, the greedy new tokens (batch, N)."""

    logits: Tensor
    tokens: Tensor | None = None


def observe(logits: Tensor, sequences: Tensor | None, new_tokens: int) -> Observation:
    """An observation from a prefill's logits (batch, positions, vocab) and generate's sequences."""
    last = logits[:, -1].detach().float().cpu()
    tokens = sequences[:, -new_tokens:].detach().cpu() if sequences is not None and new_tokens else None
    return Observation(last, tokens)


def kl_divergence(reference_logits: Tensor, logits: Tensor) -> Tensor:
    """KL(P || Q) per row, in nats, of the softmax distributions of two (batch, vocab) logits."""
    log_p = torch.log_softmax(reference_logits.double(), dim=-1)
    log_q = torch.log_softmax(logits.double(), dim=-1)
    # Clamped at 0: the sum of a distribution with itself can come out a rounding error below.
    return (log_p.exp() * (log_p - log_q)).sum(dim=-1).clamp_min(0.0)


def matching_prefix(reference: Tensor, tokens: Tensor) -> Tensor:
    """Per row, how many leading tokens agree before the first difference."""
    same = (reference == tokens).long()
    return same.cumprod(dim=-1).sum(dim=-1)


def compare(reference: Observation, row: Observation, tokenizer: Any = None) -> FidelityFigures:
    """The fidelity figures of `row` against `reference` (the vanilla row on the same inputs)."""
    kl = kl_divergence(reference.logits, row.logits)
    top1 = (reference.logits.argmax(dim=-1) == row.logits.argmax(dim=-1)).double()
    extra: dict[str, Any] = {}
    if reference.tokens is not None and row.tokens is not None:
        count = min(reference.tokens.shape[1], row.tokens.shape[1])
        prefix = matching_prefix(reference.tokens[:, :count], row.tokens[:, :count]).double()
        extra = {"new_tokens": count, "greedy_prefix_tokens": float(prefix.mean()),
                 "greedy_prefix_share": float((prefix / count).mean()) if count else 1.0}
        if tokenizer is not None:
            extra["texts"] = {"vanilla": tokenizer.batch_decode(reference.tokens, skip_special_tokens=True),
                              "reduced": tokenizer.batch_decode(row.tokens, skip_special_tokens=True)}
    return FidelityFigures(kl_divergence=float(kl.mean()), kl_divergence_max=float(kl.max()),
                           top1_agreement=float(top1.mean()), prompts=int(kl.numel()), **extra)


@dataclass
class FidelityTracker:
    """Keeps each vanilla row's observation (by quant and batch) and judges the reduced rows
    measured after it on the same model and inputs."""

    random_weights: bool
    tokenizer: Any = None
    references: dict[tuple[str, int], Observation] = field(default_factory=dict)

    def row(self, variant: str, quant: str, batch: int, observation: Observation) -> FidelityRecord:
        """The row's fidelity record (the vanilla row is the reference itself)."""
        key = (quant, batch)
        if variant == "vanilla":
            self.references[key] = observation
            return FidelityRecord(is_reference=True)
        reference = self.references.get(key)
        if reference is None:
            return FidelityRecord(note="no measured vanilla row of this quant and batch to compare with")
        return FidelityRecord(reference=f"vanilla {quant} batch {batch}",
                              figures=compare(reference, observation, self.tokenizer),
                              note=RANDOM_WEIGHTS_NOTE if self.random_weights else None)
