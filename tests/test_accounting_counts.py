"""Hand-computed counts for every convention of docs/accounting.md.

Each expected value is written out from the formulas of docs/accounting.md with the profile's
literal numbers, as plain integer arithmetic that uses none of the library's helpers:

- llava-1.5-7b: text 60 + visual 576 = 636 tokens, h=4096, 32 q/kv heads of 128, I=11008,
  vocab 32064, 32 layers; CLIP ViT-L/14-336: 576 patches + [CLS] = 577 tokens, width 1024,
  MLP 4096, 24 layers, 16 heads; projector 1024 -> 4096 -> 4096.
- llava-tiny: text 12 + visual 64 = 76 tokens, h=64, 4 q/kv heads of 16, I=192, vocab 320,
  4 layers; CLIP 112/14 = 8x8 = 64 patches + [CLS] = 65 tokens, width 64, MLP 128, 6 layers;
  projector 64 -> 64 -> 64.
- llava-gqa-tiny: as llava-tiny with 2 KV heads of 16 (kv width 32).
"""

from __future__ import annotations

import pytest

from ficoco.accounting import KV_FIGURES, CountOptions, Schedule, account, make_quant, parameter_counts
from ficoco.accounting.flops import CONVENTIONS, count_by_layer, count_by_stage, model_ops
from ficoco.accounting.memory import memory_access_bytes, stored_kv_cache_bytes, weight_bytes
from ficoco.accounting.schedule import parse_schedule, plan_tokens
from ficoco.profiles import load_gpu

REL = 1e-12


def library_counts(arch, variant="vanilla", schedule=None, convention="flops", *, equivalent=False, batch=1,
                   lm_head_tokens="all"):
    """The library's counts: {(stage, layer): count} and {stage: count}, both exact integers."""
    sched = parse_schedule(schedule, arch, variant) if schedule else Schedule(variant)
    plan = plan_tokens(arch, sched, equivalent=equivalent)
    ops = model_ops(arch, plan, batch=batch, lm_head_tokens=lm_head_tokens)
    by_layer = {(stage, layer): c for stage, layer, c in count_by_layer(arch, plan, ops, convention, batch=batch)}
    return by_layer, count_by_stage(arch, plan, ops, convention, batch=batch)


def llm_layers(by_layer):
    return [by_layer[("llm", i)] for i in range(max(k[1] for k in by_layer if k[0] == "llm") + 1)]


def vision_layers(by_layer):
    return [by_layer[("vision", i)] for i in range(max(k[1] for k in by_layer if k[0] == "vision" and
                                                        k[1] is not None) + 1)]


# ---- hand formulas of docs/accounting.md (flops convention), plain integers -------------------------------------

def hand_llama_layer(n_in, n_out, h, kv_out, ffn):
    """q, o: 2*2nh^2; k, v: 2*2nh*kv_out; scores + values: 2*2*n^2*h over the entering tokens;
    gated FFN 3*2nhI over the kept tokens (the reduction sits between attention and MLP)."""
    return 2 * 2 * n_in * h * h + 2 * 2 * n_in * h * kv_out + 2 * 2 * n_in * n_in * h + 3 * 2 * n_out * h * ffn


def hand_clip_layer(n_in, n_out, h, ffn):
    """4 biased linears h->h, attention square, 2-matrix MLP on the kept tokens."""
    return 4 * 2 * n_in * h * h + 2 * 2 * n_in * n_in * h + 2 * 2 * n_out * h * ffn


def hand_paper_layer(n_in, n_out, d, ffn):
    """4nD^2 + 2n^2D + 2nDH; the FFN term runs on the kept tokens."""
    return 4 * n_in * d * d + 2 * n_in * n_in * d + 2 * n_out * d * ffn


# ---- flops: vanilla decoder, LM head, vision tower, projector ----------------------------------------------

def test_flops_vanilla_decoder_layer_llava7b_by_hand(arch_of):
    by_layer, by_stage = library_counts(arch_of("llava-1.5-7b"))
    layer = 2 * 636 * 4096 * 4096 * 2 + 2 * 636 * 4096 * (32 * 128) * 2 + 3 * 2 * 636 * 4096 * 11008 \
        + 2 * 2 * 636 * 636 * 4096
    assert layer == 264_048_476_160
    assert llm_layers(by_layer) == [layer] * 32
    assert by_stage["llm"] == 32 * layer == 8_449_551_237_120


def test_flops_vanilla_decoder_layer_tiny_by_hand(arch_of):
    by_layer, by_stage = library_counts(arch_of("llava-tiny"))
    layer = 2 * 76 * 64 * 64 * 2 + 2 * 76 * 64 * (4 * 16) * 2 + 3 * 2 * 76 * 64 * 192 + 2 * 2 * 76 * 76 * 64
    assert llm_layers(by_layer) == [layer] * 4
    assert by_stage["llm"] == 4 * layer


def test_flops_gqa_decoder_sizes_k_and_v_by_kv_heads(arch_of):
    by_layer, _ = library_counts(arch_of("llava-gqa-tiny"))
    # k and v project 64 -> 2 kv heads x 16 = 32, q and o stay 64 x 64
    layer = 2 * 76 * 64 * 64 * 2 + 2 * 76 * 64 * (2 * 16) * 2 + 3 * 2 * 76 * 64 * 192 + 2 * 2 * 76 * 76 * 64
    assert llm_layers(by_layer) == [layer] * 4
    full_mha = hand_llama_layer(76, 76, 64, 64, 192)
    assert layer < full_mha  # the GQA layer is cheaper than the MHA one


def test_flops_lm_head_all_tokens_vs_last_llava7b(arch_of):
    arch = arch_of("llava-1.5-7b")
    _, every = library_counts(arch)
    _, last = library_counts(arch, lm_head_tokens="last")
    assert every["lm_head"] == 2 * 636 * 4096 * 32064 == 167_057_031_168
    assert last["lm_head"] == 2 * 1 * 4096 * 32064
    assert last["llm"] == every["llm"]  # only the head changes
    _, last_b2 = library_counts(arch, lm_head_tokens="last", batch=2)
    assert last_b2["lm_head"] == 2 * 2 * 4096 * 32064


def test_flops_lm_head_all_tokens_vs_last_tiny(arch_of):
    arch = arch_of("llava-tiny")
    _, every = library_counts(arch, batch=3)
    _, last = library_counts(arch, batch=3, lm_head_tokens="last")
    assert every["lm_head"] == 2 * 3 * 76 * 64 * 320
    assert last["lm_head"] == 2 * 3 * 1 * 64 * 320


def test_flops_vision_tower_and_projector_scope_all_llava7b(arch_of):
    arch = arch_of("llava-1.5-7b")
    by_layer, by_stage = library_counts(arch)
    patch_embed = 2 * 576 * (3 * 14 * 14) * 1024  # conv 14x14 stride 14 over 3 channels, 576 patches
    layer = 4 * 2 * 577 * 1024 * 1024 + 2 * 2 * 577 * 577 * 1024 + 2 * 2 * 577 * 1024 * 4096
    projector = 2 * 576 * 1024 * 4096 + 2 * 576 * 4096 * 4096
    assert by_layer[("vision", None)] == patch_embed == 693_633_024
    assert vision_layers(by_layer) == [layer] * 24
    assert by_stage["vision"] == patch_embed + 24 * layer == 381_918_216_192
    assert by_stage["projector"] == projector == 24_159_191_040
    row = account(arch, Schedule("vanilla"), make_quant("fp16"), CountOptions(scope="all"))
    total = patch_embed + 24 * layer + projector + 32 * hand_llama_layer(636, 636, 4096, 4096, 11008) \
        + 2 * 636 * 4096 * 32064
    assert row.tflops == pytest.approx(total / 1e12, rel=REL)
    row_llm = account(arch, Schedule("vanilla"), make_quant("fp16"), CountOptions(scope="llm"))
    assert row_llm.tflops == pytest.approx((total - patch_embed - 24 * layer - projector) / 1e12, rel=REL)


def test_flops_vision_tower_and_projector_scope_all_tiny(arch_of):
    by_layer, by_stage = library_counts(arch_of("llava-tiny"))
    patch_embed = 2 * 64 * (3 * 14 * 14) * 64
    layer = 4 * 2 * 65 * 64 * 64 + 2 * 2 * 65 * 65 * 64 + 2 * 2 * 65 * 64 * 128
    assert by_layer[("vision", None)] == patch_embed
    assert vision_layers(by_layer) == [layer] * 6
    assert by_stage["projector"] == 2 * 64 * 64 * 64 + 2 * 64 * 64 * 64


def test_flops_ficoco_l_schedule_reducing_layer_attends_n_in_mlp_n_out_llava7b(arch_of):
    by_layer, by_stage = library_counts(arch_of("llava-1.5-7b"), "l", "4:100,8:200")
    h, kv, ffn = 4096, 4096, 11008
    expected = [hand_llama_layer(636, 636, h, kv, ffn)] * 4 \
        + [hand_llama_layer(636, 536, h, kv, ffn)] \
        + [hand_llama_layer(536, 536, h, kv, ffn)] * 3 \
        + [hand_llama_layer(536, 336, h, kv, ffn)] \
        + [hand_llama_layer(336, 336, h, kv, ffn)] * 23
    assert llm_layers(by_layer) == expected
    # layer 4 by hand: attention side over 636 tokens, FFN over the 536 it keeps
    assert by_layer[("llm", 4)] == 2 * 2 * 636 * 4096 * 4096 + 2 * 2 * 636 * 4096 * 4096 \
        + 2 * 2 * 636 * 636 * 4096 + 3 * 2 * 536 * 4096 * 11008
    assert by_stage["lm_head"] == 2 * 336 * 4096 * 32064  # the head sees the tokens that leave
    # the vision tower and projector are untouched by FiCoCo-L
    _, vanilla = library_counts(arch_of("llava-1.5-7b"))
    assert (by_stage["vision"], by_stage["projector"]) == (vanilla["vision"], vanilla["projector"])


def test_flops_ficoco_l_schedule_tiny(arch_of):
    by_layer, by_stage = library_counts(arch_of("llava-tiny"), "l", "1:20,2:10")
    expected = [hand_llama_layer(76, 76, 64, 64, 192), hand_llama_layer(76, 56, 64, 64, 192),
                hand_llama_layer(56, 46, 64, 64, 192), hand_llama_layer(46, 46, 64, 64, 192)]
    assert llm_layers(by_layer) == expected
    assert by_stage["lm_head"] == 2 * 46 * 64 * 320


def test_flops_ficoco_v_schedule_llava7b(arch_of):
    by_layer, by_stage = library_counts(arch_of("llava-1.5-7b"), "v", "12:100,16:200")
    expected = [hand_clip_layer(577, 577, 1024, 4096)] * 12 \
        + [hand_clip_layer(577, 477, 1024, 4096)] \
        + [hand_clip_layer(477, 477, 1024, 4096)] * 3 \
        + [hand_clip_layer(477, 277, 1024, 4096)] \
        + [hand_clip_layer(277, 277, 1024, 4096)] * 7
    assert vision_layers(by_layer) == expected
    assert by_layer[("vision", None)] == 2 * 576 * (3 * 14 * 14) * 1024  # the patch embedding sees every patch
    assert by_stage["projector"] == 2 * 276 * 1024 * 4096 + 2 * 276 * 4096 * 4096  # [CLS] dropped: 276 patches
    assert llm_layers(by_layer) == [hand_llama_layer(60 + 276, 60 + 276, 4096, 4096, 11008)] * 32
    assert by_stage["lm_head"] == 2 * 336 * 4096 * 32064


def test_flops_ficoco_v_schedule_tiny(arch_of):
    by_layer, by_stage = library_counts(arch_of("llava-tiny"), "v", "2:30,3:10")
    expected = [hand_clip_layer(65, 65, 64, 128)] * 2 + [hand_clip_layer(65, 35, 64, 128),
                                                          hand_clip_layer(35, 25, 64, 128)] \
        + [hand_clip_layer(25, 25, 64, 128)] * 2
    assert vision_layers(by_layer) == expected
    assert by_stage["projector"] == 2 * 24 * 64 * 64 * 2
    assert llm_layers(by_layer) == [hand_llama_layer(36, 36, 64, 64, 192)] * 4


# ---- macs ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name,variant,schedule", [
    ("llava-1.5-7b", "vanilla", None), ("llava-1.5-7b", "l", "4:100,8:200"), ("llava-1.5-7b", "v", "12:100,16:200"),
    ("llava-tiny", "l", "1:20,2:10"), ("llava-gqa-tiny", "v", "2:30,3:10"),
])
def test_macs_are_half_of_flops_in_every_layer(arch_of, name, variant, schedule):
    flops, _ = library_counts(arch_of(name), variant, schedule, "flops")
    macs, _ = library_counts(arch_of(name), variant, schedule, "macs")
    assert flops.keys() == macs.keys()
    assert all(flops[k] == 2 * macs[k] for k in flops)


def test_macs_vanilla_by_hand(arch_of):
    _, s7 = library_counts(arch_of("llava-1.5-7b"), convention="macs")
    assert s7["llm"] == 32 * (636 * 4096 * 4096 * 2 + 636 * 4096 * 4096 * 2 + 3 * 636 * 4096 * 11008
                              + 2 * 636 * 636 * 4096)
    assert s7["lm_head"] == 636 * 4096 * 32064
    _, tiny = library_counts(arch_of("llava-gqa-tiny"), convention="macs")
    assert tiny["llm"] == 4 * (76 * 64 * 64 * 2 + 76 * 64 * 32 * 2 + 3 * 76 * 64 * 192 + 2 * 76 * 76 * 64)
    assert tiny["vision"] == 64 * 588 * 64 + 6 * (4 * 65 * 64 * 64 + 2 * 65 * 65 * 64 + 2 * 65 * 64 * 128)


# ---- llm-viewer ----------------------------------------------------------------------------------------

def hand_viewer_layer(b, s_in, s_out, h, nh, nkv, hd, ffn):
    """LLM-Viewer's OPs of one prefill layer (docs/accounting.md), with the reduction between attention and MLP."""
    linears = 2 * b * s_in * (h * nh * hd + h * nkv * hd * 2 + nh * hd * h) + 2 * b * s_out * (2 * h * ffn + ffn * h)
    qk_sv = 2 * (s_in * s_in * hd * nh * b * 2)
    softmax = 5 * b * nh * s_in * s_in
    norms = 7 * b * h * s_in + 7 * b * h * s_out
    adds = b * h * s_in + b * h * s_out
    act = 2 * b * h * s_out  # sized by h, not I: LLM-Viewer's quirk
    return linears + qk_sv + softmax + norms + adds + act


def test_llm_viewer_vanilla_tiny_quirks_by_hand(arch_of):
    by_layer, by_stage = library_counts(arch_of("llava-tiny"), convention="llm-viewer")
    layer = (2 * 1 * 76 * (64 * 64 + 64 * 64 + 64 * 64 + 64 * 64 + 2 * 64 * 192 + 192 * 64)  # 7 linears
             + 2 * (76 * 76 * 16 * 4 * 1 * 2)  # qk and sv
             + 5 * 1 * 4 * 76 * 76  # softmax
             + 2 * 7 * 1 * 64 * 76  # two RMSNorms
             + 2 * 1 * 64 * 76  # two residual adds
             + 2 * 1 * 64 * 76)  # activation sized by h
    assert layer == hand_viewer_layer(1, 76, 76, 64, 4, 4, 16, 192)
    assert llm_layers(by_layer) == [layer] * 4
    assert by_stage["lm_head"] == 1 * 64 * 320  # one token, one op per MAC
    assert by_stage["vision"] == by_stage["projector"] == 0  # decoder only


def test_llm_viewer_batch_scales_layers_and_head_tiny(arch_of):
    _, by_stage = library_counts(arch_of("llava-tiny"), convention="llm-viewer", batch=2)
    assert by_stage["llm"] == 4 * hand_viewer_layer(2, 76, 76, 64, 4, 4, 16, 192)
    assert by_stage["lm_head"] == 2 * 64 * 320  # b * h * vocab


def test_llm_viewer_gqa_tiny_and_l_schedule(arch_of):
    by_layer, _ = library_counts(arch_of("llava-gqa-tiny"), convention="llm-viewer")
    assert llm_layers(by_layer) == [hand_viewer_layer(1, 76, 76, 64, 4, 2, 16, 192)] * 4
    by_layer, by_stage = library_counts(arch_of("llava-gqa-tiny"), "l", "1:20,2:10", convention="llm-viewer")
    assert llm_layers(by_layer) == [hand_viewer_layer(1, 76, 76, 64, 4, 2, 16, 192),
                                    hand_viewer_layer(1, 76, 56, 64, 4, 2, 16, 192),
                                    hand_viewer_layer(1, 56, 46, 64, 4, 2, 16, 192),
                                    hand_viewer_layer(1, 46, 46, 64, 4, 2, 16, 192)]
    assert by_stage["lm_head"] == 64 * 320  # the head stays one token whatever the schedule


def test_llm_viewer_vanilla_llava7b_by_hand(arch_of):
    _, by_stage = library_counts(arch_of("llava-1.5-7b"), convention="llm-viewer")
    layer = (2 * 636 * (4 * 4096 * 4096 + 3 * 4096 * 11008) + 2 * (636 * 636 * 128 * 32 * 2)
             + 5 * 32 * 636 * 636 + 2 * 7 * 4096 * 636 + 2 * 4096 * 636 + 2 * 4096 * 636)
    assert by_stage["llm"] == 32 * layer
    assert by_stage["lm_head"] == 4096 * 32064


# ---- paper ---------------------------------------------------------------------------------------------

def test_paper_vanilla_by_hand(arch_of):
    by_layer, by_stage = library_counts(arch_of("llava-1.5-7b"), convention="paper")
    layer = 4 * 636 * 4096**2 + 2 * 636**2 * 4096 + 2 * 636 * 4096 * 11008
    assert llm_layers(by_layer) == [layer] * 32
    assert vision_layers(by_layer) == [4 * 577 * 1024**2 + 2 * 577**2 * 1024 + 2 * 577 * 1024 * 4096] * 24
    assert by_stage["lm_head"] == by_stage["projector"] == 0  # the formula defines transformer layers only
    _, tiny = library_counts(arch_of("llava-tiny"), convention="paper")
    assert tiny["llm"] == 4 * (4 * 76 * 64**2 + 2 * 76**2 * 64 + 2 * 76 * 64 * 192)


def test_paper_ficoco_v_overhead_llava7b(arch_of):
    by_layer, by_stage = library_counts(arch_of("llava-1.5-7b"), "v", "12:100,16:200", "paper")
    d, ffn = 1024, 4096
    # V overhead N^2 + 2N + N_S(N_T + 2D + 1) + D, N = patches entering, N_S removed, N_T kept
    over12 = 576**2 + 2 * 576 + 100 * (476 + 2 * 1024 + 1) + 1024
    over16 = 476**2 + 2 * 476 + 200 * (276 + 2 * 1024 + 1) + 1024
    expected = [hand_paper_layer(577, 577, d, ffn)] * 12 + [hand_paper_layer(577, 477, d, ffn) + over12] \
        + [hand_paper_layer(477, 477, d, ffn)] * 3 + [hand_paper_layer(477, 277, d, ffn) + over16] \
        + [hand_paper_layer(277, 277, d, ffn)] * 7
    assert vision_layers(by_layer) == expected
    assert by_stage["llm"] == 32 * (4 * 336 * 4096**2 + 2 * 336**2 * 4096 + 2 * 336 * 4096 * 11008)


def test_paper_ficoco_l_overhead_llava7b(arch_of):
    by_layer, by_stage = library_counts(arch_of("llava-1.5-7b"), "l", "4:100,8:200", "paper")
    d, ffn = 4096, 11008
    # L overhead 2(N^2 + 2N) + N_S(N_T + 2D + 1) + D over the visual tokens of the span
    over4 = 2 * (576**2 + 2 * 576) + 100 * (476 + 2 * 4096 + 1) + 4096
    over8 = 2 * (476**2 + 2 * 476) + 200 * (276 + 2 * 4096 + 1) + 4096
    expected = [hand_paper_layer(636, 636, d, ffn)] * 4 + [hand_paper_layer(636, 536, d, ffn) + over4] \
        + [hand_paper_layer(536, 536, d, ffn)] * 3 + [hand_paper_layer(536, 336, d, ffn) + over8] \
        + [hand_paper_layer(336, 336, d, ffn)] * 23
    assert llm_layers(by_layer) == expected
    assert by_stage["vision"] == 24 * hand_paper_layer(577, 577, 1024, 4096)


def test_paper_overheads_tiny(arch_of):
    by_layer, _ = library_counts(arch_of("llava-tiny"), "l", "1:20,2:10", "paper")
    assert by_layer[("llm", 1)] == 4 * 76 * 64**2 + 2 * 76**2 * 64 + 2 * 56 * 64 * 192 \
        + 2 * (64**2 + 2 * 64) + 20 * (44 + 2 * 64 + 1) + 64
    assert by_layer[("llm", 2)] == 4 * 56 * 64**2 + 2 * 56**2 * 64 + 2 * 46 * 64 * 192 \
        + 2 * (44**2 + 2 * 44) + 10 * (34 + 2 * 64 + 1) + 64
    by_layer, _ = library_counts(arch_of("llava-tiny"), "v", "2:30,3:10", "paper")
    assert by_layer[("vision", 2)] == 4 * 65 * 64**2 + 2 * 65**2 * 64 + 2 * 35 * 64 * 128 \
        + 64**2 + 2 * 64 + 30 * (34 + 2 * 64 + 1) + 64
    assert by_layer[("vision", 3)] == 4 * 35 * 64**2 + 2 * 35**2 * 64 + 2 * 25 * 64 * 128 \
        + 34**2 + 2 * 34 + 10 * (24 + 2 * 64 + 1) + 64


# ---- KV cache ------------------------------------------------------------------------------------------

def kv_bytes(arch, variant="vanilla", schedule=None, *, batch=1, kv_bits=16, equivalent=False):
    sched = parse_schedule(schedule, arch, variant) if schedule else Schedule(variant)
    return stored_kv_cache_bytes(arch, plan_tokens(arch, sched, equivalent=equivalent), batch=batch, kv_bits=kv_bits)


def test_kv_cache_vanilla_llava7b_fp16(arch_of):
    assert kv_bytes(arch_of("llava-1.5-7b")) == 32 * 2 * 1 * 636 * 32 * 128 * 2 == 333_447_168


def test_kv_cache_l_schedule_llava7b_counts_what_each_layer_saw(arch_of):
    # layers 0-4 attend over 636 (layer 4 caches before reducing), 5-8 over 536, 9-31 over 336
    tokens = 5 * 636 + 4 * 536 + 23 * 336
    assert kv_bytes(arch_of("llava-1.5-7b"), "l", "4:100,8:200") == 2 * tokens * 32 * 128 * 2 == 213_843_968


def test_kv_cache_gqa_tiny(arch_of):
    arch = arch_of("llava-gqa-tiny")
    assert kv_bytes(arch) == 4 * 2 * 1 * 76 * 2 * 16 * 2 == 38_912  # 2 kv heads, not 4
    # A 4-bit cache stores its codes and, per group of gcd(64, head_dim) = 16 values, a 16-bit
    # scale and zero point (HQQ's layout in transformers' QuantizedCache).
    values = 4 * 2 * 3 * 76 * 2 * 16
    assert kv_bytes(arch, batch=3, kv_bits=4) == values * 0.5 + values / 16 * 2 * 2
    assert kv_bytes(arch, "l", "1:20,2:10") == 2 * (76 + 76 + 56 + 46) * 2 * 16 * 2
    assert kv_bytes(arch, "v", "2:30,3:10") == 4 * 2 * (12 + 24) * 2 * 16 * 2
    assert kv_bytes(arch, "l", "1:20,2:10", equivalent=True) == 4 * 2 * 46 * 2 * 16 * 2


# LLM-Viewer's own KV cache (its memory_consumption_kv_cache): the prefill's k_proj and v_proj each store
# oc * b * s * kv_bits / 8 bytes per layer, oc = kv heads * head dim; values times bits / 8, nothing more.
# The stored cache (HQQ in transformers' QuantizedCache) adds a 16-bit scale and zero point per group of
# gcd(64, head_dim) values. LLaVA-1.5-7B: 32 layers, 636 tokens, 32 kv heads of 128 (groups of 64).
LLAVA7B_KV_VALUES = 32 * 2 * 1 * 636 * 32 * 128


def kv_row(arch, convention, quant="int8", variant="vanilla", schedule=None, *, kv_bits=None, batch=1,
           equivalent=False):
    sched = parse_schedule(schedule, arch, variant) if schedule else Schedule(variant)
    return account(arch, sched, make_quant(quant, kv_bits),
                   CountOptions(convention=convention, batch=batch, equivalent=equivalent))


@pytest.mark.parametrize("quant,bits,viewer,stored", [("int8", 8, 166_723_584, 177_143_808),
                                                      ("int4", 4, 83_361_792, 93_782_016)])
def test_llm_viewer_kv_cache_is_llm_viewers_own_figure_llava7b(arch_of, quant, bits, viewer, stored):
    row = kv_row(arch_of("llava-1.5-7b"), "llm-viewer", quant)
    assert row.kv_cache_figure == "llm-viewer"
    assert row.kv_cache_bytes == LLAVA7B_KV_VALUES * bits / 8 == viewer  # 166.7 MB at int8
    assert row.kv_cache_stored_bytes == LLAVA7B_KV_VALUES * bits / 8 + LLAVA7B_KV_VALUES / 64 * 2 * 2 == stored
    data = row.to_json()
    assert (data["kv_cache_bytes"], data["kv_cache_stored_bytes"], data["kv_cache_figure"]) == (
        viewer, stored, "llm-viewer")


@pytest.mark.parametrize("convention", ["flops", "macs", "paper", "visual-macs"])
def test_conventions_without_a_kv_figure_of_their_own_report_the_stored_cache(arch_of, convention):
    row = kv_row(arch_of("llava-1.5-7b"), convention, "int4")
    assert row.kv_cache_figure == "stored"
    assert row.kv_cache_bytes == row.kv_cache_stored_bytes == LLAVA7B_KV_VALUES / 2 + LLAVA7B_KV_VALUES / 64 * 4


@pytest.mark.parametrize("convention", sorted(KV_FIGURES))
def test_every_convention_reports_two_bytes_per_value_unquantized(arch_of, convention):
    row = kv_row(arch_of("llava-1.5-7b"), convention, "fp16")
    assert row.kv_cache_bytes == row.kv_cache_stored_bytes == LLAVA7B_KV_VALUES * 2 == 333_447_168


def test_kv_figures_name_every_convention():
    assert set(KV_FIGURES) == set(CONVENTIONS) and set(KV_FIGURES.values()) == {"llm-viewer", "stored"}


def test_llm_viewer_kv_cache_counts_what_each_layer_saw_and_any_kv_bits(arch_of):
    arch = arch_of("llava-1.5-7b")
    tokens = 5 * 636 + 4 * 536 + 23 * 336  # FiCoCo-L 4:100,8:200, as the stored cache above
    assert kv_row(arch, "llm-viewer", "int4", "l", "4:100,8:200").kv_cache_bytes == 2 * tokens * 32 * 128 / 2
    assert kv_row(arch, "llm-viewer", "int4", "l", "4:100,8:200", equivalent=True).kv_cache_bytes == \
        32 * 2 * 336 * 32 * 128 / 2
    assert kv_row(arch, "llm-viewer", "fp16", kv_bits=2).kv_cache_bytes == LLAVA7B_KV_VALUES / 4
    gqa = arch_of("llava-gqa-tiny")  # 2 kv heads of 16, batch 3; stored groups of 16 values
    row = kv_row(gqa, "llm-viewer", "int4", batch=3)
    values = 4 * 2 * 3 * 76 * 2 * 16
    assert (row.kv_cache_bytes, row.kv_cache_stored_bytes) == (values / 2, values / 2 + values / 16 * 2 * 2)


def test_footprint_holds_the_stored_cache_whatever_the_convention(arch_of):
    arch = arch_of("llava-1.5-7b")
    viewer, flops = kv_row(arch, "llm-viewer", "int8"), kv_row(arch, "flops", "int8")
    assert viewer.kv_cache_bytes < flops.kv_cache_bytes
    assert viewer.footprint_bytes == flops.footprint_bytes


# ---- LLM-Viewer memory access ----------------------------------------------------------------------------

def test_memory_access_one_decoder_layer_gqa_tiny_by_hand(arch_of):
    arch = arch_of("llava-gqa-tiny")
    quant = make_quant("fp16", kv_bits=8)  # w = a = 2 bytes, kv = 1 byte
    plan = plan_tokens(arch, Schedule("vanilla"))
    ops = model_ops(arch, plan)
    s, h, kvo, ffn = 76, 64, 2 * 16, 192
    layer = (
        2 * h * s * 2  # input norm: load + store
        + (h * h * 2 + h * s * 2 + h * s * 2)  # q: weight, load, store
        + 2 * (h * kvo * 2 + h * s * 2 + kvo * s * 1)  # k, v: store into the KV cache
        + (s * 16 * 2 * 2 + s * 16 * 2 * 1 + s * s * 4 * 2)  # qk: query sized by kv heads, keys, probs
        + 2 * (4 * s * s * 2)  # softmax: load + store
        + (s * s * 4 * 2 + s * 16 * 2 * 1 + s * 16 * 4 * 2)  # sv: probs, values, output
        + (h * h * 2 + h * s * 2 + h * s * 2)  # o
        + 2 * h * s * 2  # attention residual add
        + 2 * h * s * 2  # post-attention norm
        + 2 * (h * ffn * 2 + h * s * 2 + ffn * s * 2)  # gate, up
        + (2 * h * s * 2 + h * s * 2)  # activation: loads 2bhs, stores bhs
        + (ffn * h * 2 + ffn * s * 2 + h * s * 2)  # down
        + 2 * h * s * 2  # MLP residual add
    )
    layer0 = [op for op in ops if op.stage == "llm" and op.layer == 0]
    assert memory_access_bytes(layer0, "llm", quant) == layer
    head = 64 * 320 * 2 + 64 * 2 + 320 * 2  # weights, one hidden vector, one row of logits
    assert memory_access_bytes(ops, "llm", quant) == 4 * layer + head


# ---- weights --------------------------------------------------------------------------------------------

def test_weight_bytes_fp16_is_two_bytes_per_parameter_llava7b(arch_of):
    arch = arch_of("llava-1.5-7b")
    decoder_and_head = 32064 * 4096 + 32 * (4 * 4096 * 4096 + 3 * 4096 * 11008 + 2 * 4096) + 4096 + 32064 * 4096
    vision = 1024 + 577 * 1024 + 3 * 14 * 14 * 1024 + 2 * 2 * 1024 \
        + 24 * (4 * (1024 * 1024 + 1024) + 1024 * 4096 + 4096 + 4096 * 1024 + 1024 + 2 * 2 * 1024)
    projector = 1024 * 4096 + 4096 + 4096 * 4096 + 4096
    assert vision + projector + decoder_and_head == parameter_counts(arch).total == 7_063_427_072
    fp16 = make_quant("fp16")
    assert weight_bytes(arch, "llm", fp16) == 2 * decoder_and_head == 13_477_879_808
    assert weight_bytes(arch, "all", fp16) == 2 * 7_063_427_072


def test_weight_bytes_int8_and_int4_keep_embeddings_norms_head_at_16_bits_tiny(arch_of):
    arch = arch_of("llava-tiny")
    linear = 4 * (4 * 64 * 64 + 3 * 64 * 192)
    rows = 4 * (64 + 64 + 64 + 64 + 192 + 192 + 64)  # output rows of q, k, v, o, gate, up, down
    params = 320 * 64 + 4 * (4 * 64 * 64 + 3 * 64 * 192 + 2 * 64) + 64 + 320 * 64
    assert weight_bytes(arch, "llm", make_quant("fp16")) == 2 * params
    # LLM.int8: 1 byte per linear weight and one fp32 scale per output row
    assert weight_bytes(arch, "llm", make_quant("int8")) == (params - linear) * 2 + linear * 1 + rows * 4
    # NF4: half a byte per linear weight, one fp32 absmax per 64-weight block and a 16-entry
    # fp32 code book per linear layer (7 per decoder layer)
    assert weight_bytes(arch, "llm", make_quant("int4")) == (
        (params - linear) * 2 + linear / 2 + linear / 64 * 4 + 4 * 7 * 16 * 4)


# ---- roofline ---------------------------------------------------------------------------------------------

def hand_viewer_records(b, s, h, nh, nkv, hd, ffn, vocab, layers, w, a, kv):
    """(ops, bytes) of every LLM-Viewer prefill record of an unreduced decoder and its LM head."""
    qo, kvo = nh * hd, nkv * hd

    def linear(ic, oc, to_kv=False):
        return ic * oc * b * s * 2, ic * oc * w + ic * b * s * a + oc * b * s * (kv if to_kv else a)

    layer = [
        (7 * b * h * s, 2 * b * h * s * a),  # input norm
        linear(h, qo), linear(h, kvo, True), linear(h, kvo, True),
        (s * s * hd * nh * b * 2, s * hd * b * nkv * a + s * hd * b * nkv * kv + s * s * b * nh * a),  # qk
        (5 * b * nh * s * s, 2 * b * nh * s * s * a),  # softmax
        (s * s * hd * nh * b * 2, s * s * b * nh * a + s * hd * b * nkv * kv + s * hd * b * nh * a),  # sv
        linear(qo, h),
        (b * h * s, 2 * b * h * s * a),  # residual add
        (7 * b * h * s, 2 * b * h * s * a),  # post-attention norm
        linear(h, ffn), linear(h, ffn),
        (2 * b * h * s, 3 * b * h * s * a),  # activation
        linear(ffn, h),
        (b * h * s, 2 * b * h * s * a),  # residual add
    ]
    return layer * layers + [(b * h * vocab, h * vocab * w + h * a + vocab * a)]


def hand_roofline(records, peak, bandwidth):
    return sum(max(ops / peak, nbytes / bandwidth) for ops, nbytes in records)


A100_80 = (2039e9, 312e12, 624e12)  # bandwidth, FP16 and INT8 peaks (docs/accounting.md table)


@pytest.mark.parametrize("quant,bytes_wakv", [("fp16", (2, 2, 2)), ("int8", (1, 1, 1))])
def test_roofline_a100_80gb_tiny_by_hand(arch_of, quant, bytes_wakv):
    arch = arch_of("llava-tiny")
    w, a, kv = bytes_wakv
    records = hand_viewer_records(1, 76, 64, 4, 4, 16, 192, 320, 4, w, a, kv)
    bw, fp16_peak, int8_peak = A100_80
    peak = fp16_peak if quant == "fp16" else int8_peak
    row = account(arch, Schedule("vanilla"), make_quant(quant), CountOptions(), gpu=load_gpu("a100-80gb"))
    assert row.roofline_s == pytest.approx(hand_roofline(records, peak, bw), rel=REL)
    assert row.memory_access_bytes == sum(nbytes for _, nbytes in records)


@pytest.mark.parametrize("quant,kv_bits,bytes_wakv,int8_peak", [
    ("fp16", None, (2, 2, 2), False),
    ("fp16", 8, (2, 2, 1), False),  # W16: FP16 peak even with an 8-bit cache
    ("int8", None, (1, 1, 1), True),
    ("int8", 16, (1, 1, 2), False),  # KV16: not all <= 8 bits
    ("int4", None, (0.5, 0.5, 0.5), True),
    ("int4", 8, (0.5, 0.5, 1), True),
])
def test_roofline_a100_80gb_peak_choice_llava7b(arch_of, quant, kv_bits, bytes_wakv, int8_peak):
    arch = arch_of("llava-1.5-7b")
    records = hand_viewer_records(1, 636, 4096, 32, 32, 128, 11008, 32064, 32, *bytes_wakv)
    bw, fp16_peak, int8 = A100_80
    expected = hand_roofline(records, int8 if int8_peak else fp16_peak, bw)
    other = hand_roofline(records, fp16_peak if int8_peak else int8, bw)
    assert expected != pytest.approx(other, rel=1e-6)  # the 7B prefill has compute-bound ops
    row = account(arch, Schedule("vanilla"), make_quant(quant, kv_bits), CountOptions(), gpu=load_gpu("a100-80gb"))
    assert row.roofline_s == pytest.approx(expected, rel=REL)
    assert row.memory_access_bytes == pytest.approx(sum(nbytes for _, nbytes in records), rel=REL)


def test_memory_access_vanilla_llava7b_fp16(arch_of):
    row = account(arch_of("llava-1.5-7b"), Schedule("vanilla"), make_quant("fp16"), CountOptions())
    records = hand_viewer_records(1, 636, 4096, 32, 32, 128, 11008, 32064, 32, 2, 2, 2)
    assert row.memory_access_bytes == sum(nbytes for _, nbytes in records) == 22_207_404_672


# ---- equivalent mode ------------------------------------------------------------------------------------

def test_equivalent_uses_final_token_count_in_every_layer_l_llava7b(arch_of):
    by_layer, by_stage = library_counts(arch_of("llava-1.5-7b"), "l", "4:100,8:200", equivalent=True)
    assert llm_layers(by_layer) == [hand_llama_layer(336, 336, 4096, 4096, 11008)] * 32
    assert by_stage["lm_head"] == 2 * 336 * 4096 * 32064
    exact, _ = library_counts(arch_of("llava-1.5-7b"), "l", "4:100,8:200")
    assert sum(llm_layers(by_layer)) < sum(llm_layers(exact))


def test_equivalent_vision_tower_uses_final_count_v_llava7b(arch_of):
    by_layer, _ = library_counts(arch_of("llava-1.5-7b"), "v", "12:100,16:200", equivalent=True)
    assert vision_layers(by_layer) == [hand_clip_layer(277, 277, 1024, 4096)] * 24


@pytest.mark.parametrize("convention", ["flops", "macs", "llm-viewer", "paper"])
@pytest.mark.parametrize("name,schedule", [("llava-1.5-7b", "12:100,16:200"), ("llava-tiny", "2:30,3:10"),
                                           ("llava-gqa-tiny", "3:50")])
def test_equivalent_equals_layer_exact_for_v_in_scope_llm(arch_of, convention, name, schedule):
    arch = arch_of(name)
    sched = parse_schedule(schedule, arch, "v")
    exact = account(arch, sched, make_quant("fp16"), CountOptions(convention=convention))
    equiv = account(arch, sched, make_quant("fp16"), CountOptions(convention=convention, equivalent=True))
    assert equiv.tflops == exact.tflops
    assert equiv.kv_cache_bytes == exact.kv_cache_bytes
