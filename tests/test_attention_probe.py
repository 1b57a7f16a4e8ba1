"""The attention probe: bounded chunks at any batch size, the same output and probabilities
whatever the chunking, and its time in the handle's "probe" span."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ficoco.models import attention
from ficoco.models.attention import ProbeSlot, probe_attention, probe_chunks
from ficoco.models.stage_timer import StageTimer


@settings(max_examples=200, deadline=None)
@given(batch=st.integers(1, 16), heads=st.integers(1, 64), q_len=st.integers(1, 3000),
       k_len=st.integers(1, 3000), budget=st.integers(1, 1 << 24))
def test_a_chunk_never_exceeds_the_budget_at_any_batch_size(batch, heads, q_len, k_len, budget) -> None:
    batch_step, head_step, query_step = probe_chunks(batch, heads, q_len, k_len, budget)
    assert 1 <= batch_step <= batch and 1 <= head_step <= heads and 1 <= query_step <= q_len
    # Within budget, or a single query row of a single head when even that is larger.
    assert batch_step * head_step * query_step * k_len <= max(budget, k_len)
    # Chunks only shrink where they must: a whole sample's scores in one chunk when they fit.
    if heads * q_len * k_len <= budget:
        assert head_step == heads and query_step == q_len


class Module(torch.nn.Module):
    is_causal = True


def run_probe(query, key, value, mask, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    module = Module()
    module.is_causal = causal
    module._ficoco_probe = ProbeSlot(timer=StageTimer())
    output, _ = probe_attention(module, query, key, value, mask)
    attn, _ = module._ficoco_probe.take()
    assert module._ficoco_probe.timer.total_ms("probe") > 0
    return output, attn


@pytest.mark.parametrize("budget", [1 << 24, 500, 40, 1], ids=["one-chunk", "heads", "rows", "tiny"])
@pytest.mark.parametrize("kind", ["causal", "padding-mask", "bidirectional"])
def test_chunked_probe_equals_sdpa_and_unchunked_probabilities(monkeypatch, budget: int, kind: str) -> None:
    generator = torch.Generator().manual_seed(0)
    batch, heads, kv_heads, length, dim = 3, 4, 2, 9, 8  # grouped-query attention
    query = torch.randn(batch, heads, length, dim, generator=generator)
    key = torch.randn(batch, kv_heads, length, dim, generator=generator)
    value = torch.randn(batch, kv_heads, length, dim, generator=generator)
    mask = None
    if kind == "padding-mask":  # sample 1 has two left pads: boolean, True = attend
        causal = torch.ones(length, length, dtype=torch.bool).tril()
        real = torch.ones(batch, length, dtype=torch.bool)
        real[1, :2] = False
        mask = (causal & real[:, None, :])[:, None]
    reference_output, reference_attn = run_probe(query, key, value, mask, kind == "causal")
    monkeypatch.setitem(attention.SCORE_BUDGET_ELEMENTS, "cpu", budget)
    output, attn = run_probe(query, key, value, mask, kind == "causal")
    torch.testing.assert_close(output, reference_output)
    torch.testing.assert_close(attn, reference_attn)
    expanded_k, expanded_v = key.repeat_interleave(2, dim=1), value.repeat_interleave(2, dim=1)
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        query, expanded_k, expanded_v, attn_mask=mask, is_causal=kind == "causal")
    if kind == "padding-mask":  # fully masked rows: SDPA gives NaN, the probe zeros
        sdpa = torch.nan_to_num(sdpa)
    torch.testing.assert_close(output, sdpa.transpose(1, 2), atol=1e-5, rtol=1e-4)
    assert torch.isfinite(attn).all()
