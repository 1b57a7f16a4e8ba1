"""The fused pass (ficoco.methods.reads.ops.fused): a reducing layer's output and its reads from one pass on a CPU.

- at the kernel: the output equals SDPA's within the dtype's tolerance and eager attention's (the rule it follows)
  more closely; the head-mean (head-max) matrix it leaves equals the probabilities eager attention computes, so
  every read answered from it equals the read computed beside SDPA;
- in every family: with a method that reads the attention, the fused pass runs at the read layers and nowhere
  else (every other layer keeps SDPA), each fused output equals SDPA's on the same queries, keys and values, and
  the tokens kept are the ones the reads beside SDPA keep (FICOCO_READ_KERNEL=torch).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_attention_reads import eager_probabilities

import ficoco
from ficoco.methods.reads import native
from ficoco.methods.reads.ops import ProbedAttention
from ficoco.methods.reads.ops import fused as fused_module
from ficoco.methods.reads.ops.fused import fusable, fused_attention
from ficoco.models import attention as attention_module
from ficoco.models import synthetic_inputs

pytestmark = pytest.mark.skipif(native.library() is None, reason=f"no native read kernel: {native.status().reason}")

def eager_output(query, key, value, scale, causal):
    """The model's eager attention: scores in the model's dtype, scaled there, softmax in float32 rounded back."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    scores = torch.matmul(query, key.transpose(-1, -2)) * scale
    if causal:
        q_len, k_len = query.shape[2], key.shape[2]
        scores = scores.masked_fill(~torch.ones(q_len, k_len, dtype=torch.bool).tril(k_len - q_len), float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype), value)


def tensors(batch, heads, kv_heads, length, dim, dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, h, length, dim, generator=generator) * 1.5).to(dtype)
            for h in (heads, kv_heads, kv_heads)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("causal", [False, True], ids=["tower", "decoder"])
@pytest.mark.parametrize("shape", [(1, 4, 4, 37, 16), (2, 6, 2, 130, 32), (1, 8, 1, 300, 8)],
                         ids=["mha", "gqa", "mqa-long"])
def test_the_fused_output_equals_sdpa_and_its_matrix_the_eager_probabilities(dtype, causal, shape,
                                                                             monkeypatch) -> None:
    # A small score budget: many blocks (and causal tiles) per call.
    monkeypatch.setattr(fused_module, "FUSED_SCORE_BUDGET", 4096)
    batch, heads, kv_heads, length, dim = shape
    query, key, value = tensors(batch, heads, kv_heads, length, dim, dtype)
    scale = dim ** -0.5
    assert fusable(query, key, value, None)
    output, reads = fused_attention(query, key, value, scale, causal=causal)
    sdpa = F.scaled_dot_product_attention(query, key, value, is_causal=causal, enable_gqa=True, scale=scale)
    eager = eager_output(query, key, value, scale, causal)
    if dtype == torch.float32:
        torch.testing.assert_close(output, sdpa, atol=2e-6, rtol=1e-5)
    else:
        # bfloat16: as far from float32's exact attention as the model's own kernels are (SDPA's fused one, or eager,
        # which rounds the probabilities before P . V, as the fused pass does), within one rounding.
        exact = F.scaled_dot_product_attention(query.float(), key.float(), value.float(), is_causal=causal,
                                               enable_gqa=True, scale=scale)
        kernels = max(float((sdpa.float() - exact).abs().max()), float((eager.float() - exact).abs().max()))
        assert float((output.float() - exact).abs().max()) <= kernels + 2 ** -8
        typical = max(float((sdpa.float() - exact).abs().mean()), float((eager.float() - exact).abs().mean()))
        assert float((output.float() - exact).abs().mean()) <= 1.25 * typical
    # The rule it computes is eager attention's: within a rounding of the last P . V sum.
    assert (output.float() - eager.float()).abs().max() <= (2 ** -7 if dtype == torch.bfloat16 else 4e-6)
    # Its matrix is the head-mean of eager's probabilities (bfloat16: about one in 10^5 rounds to its neighbour).
    expected = eager_probabilities(query, key, scale, causal=causal)
    torch.testing.assert_close(reads.column_sum(), expected.sum(dim=1), atol=1e-4, rtol=1e-4)
    rows = torch.tensor([[0, length - 1, 3]]).expand(batch, -1)
    torch.testing.assert_close(reads.rows(rows), ProbedAttention(query, key, scale, causal=causal).rows(rows),
                               atol=1e-5, rtol=1e-4)


def test_the_head_max_matrix_is_each_pairs_largest_probability() -> None:
    query, key, value = tensors(1, 4, 2, 50, 8, torch.float32)
    _, reads = fused_attention(query, key, value, causal=True, heads="max")
    expected = ProbedAttention(query, key, causal=True, heads="max").rows(torch.arange(50).unsqueeze(0))
    torch.testing.assert_close(reads.rows(torch.arange(50).unsqueeze(0)), expected)


def test_the_float32_rule_computes_in_float32_and_rounds_the_output_to_the_models_dtype() -> None:
    query, key, value = tensors(1, 4, 4, 40, 16, torch.bfloat16)
    output, reads = fused_attention(query, key, value, causal=False, scores="float32")
    assert output.dtype == torch.bfloat16
    reference = F.scaled_dot_product_attention(query.float(), key.float(), value.float())
    assert (output.float() - reference).abs().max() <= 2 ** -7  # one rounding to bfloat16
    expected = eager_probabilities(query, key, 16 ** -0.5, rule="float32")
    torch.testing.assert_close(reads.column_sum(), expected.sum(dim=1), atol=1e-5, rtol=1e-5)


def test_what_is_not_fused_runs_the_models_kernel() -> None:
    query, key, value = tensors(1, 4, 4, 12, 8, torch.float32)
    assert fusable(query, key, value, None)
    assert not fusable(query, key, value, torch.zeros(1, 1, 12, 12))  # a mask: the model's kernel
    assert not fusable(query[:, :, :1], key, value, None)  # a decode step
    assert not fusable(query.half(), key.half(), value.half(), None)  # float16 scores: no native rule
    assert not fusable(query, key, value, None, sliding_window=4)
    assert not fusable(query, key, value, None, dropout=0.1)
    with torch.enable_grad():
        assert not fusable(query.requires_grad_(), key, value, None)


FAMILIES = [("llava-tiny", "v"), ("llava-tiny", "l"), ("llava-next-tiny", "v"), ("llava-onevision-tiny", "v"),
            ("video-llava-tiny", "v"), ("qwen2-vl-tiny", "v"), ("qwen2.5-vl-tiny", "v"), ("qwen3-vl-tiny", "v"),
            ("qwen3-vl-tiny", "l"), ("qwen3-vl-moe-tiny", "v"), ("qwen3.5-tiny", "v"), ("internvl3-tiny", "v"),
            ("internvl3-tiny", "l")]


@pytest.mark.transformers
@pytest.mark.parametrize("profile,variant", FAMILIES, ids=[f"{p}-{v}" for p, v in FAMILIES])
def test_in_every_family_the_read_layers_fuse_match_sdpa_and_keep_the_same_tokens(profile, variant,
                                                                                   monkeypatch) -> None:
    model = ficoco.build_model(profile, dtype="fp32")
    inputs = synthetic_inputs(model, batch=1, text_tokens=12, seed=1)
    # A keep each family reaches (LLaVA-NeXT, OneVision: 8 fixed tokens and 5 items; InternVL3: 3 tiles).
    keep = {"llava-next-tiny": 18, "llava-onevision-tiny": 18, "internvl3-tiny": 9}.get(profile)
    keep = keep or (8 if variant == "v" else 16)
    calls: list[float] = []
    original = attention_module.fused_attention

    def checked(query, key, value, scale=None, **kwargs):
        output, reads = original(query, key, value, scale, **kwargs)
        sdpa = F.scaled_dot_product_attention(query, key, value, is_causal=kwargs["causal"], enable_gqa=True,
                                              scale=scale)
        calls.append(float((output - sdpa).abs().max()))
        return output, reads

    def run():
        with ficoco.apply(model, variant, keep=keep) as handle, torch.no_grad():
            logits = model(**inputs).logits
            kept = [(r.stage, r.layer, r.kept.tolist()) for r in handle.records]
            read_layers = {(r.stage, r.layer) for r in handle.records}
        return logits, kept, read_layers

    monkeypatch.setattr(attention_module, "fused_attention", checked)
    fused_logits, fused_kept, read_layers = run()
    assert calls, "no layer ran the fused pass"
    assert max(calls) <= 2e-6  # every fused output is SDPA's (float32)
    fused_calls = len(calls)
    monkeypatch.setenv("FICOCO_READ_KERNEL", "torch")
    calls.clear()
    beside: list[int] = []
    probed = attention_module.probed_reads
    monkeypatch.setattr(attention_module, "probed_reads", lambda *a, **k: beside.append(1) or probed(*a, **k))
    plain_logits, plain_kept, _ = run()
    assert not calls  # the model's kernel everywhere, the reads beside it
    assert fused_kept == plain_kept  # the same tokens
    torch.testing.assert_close(fused_logits, plain_logits, atol=1e-4, rtol=1e-4)
    # The calls that fused are exactly those whose attention the method reads (one per read layer and image or
    # window); every other call ran the model's kernel.
    assert fused_calls == len(beside) and read_layers
