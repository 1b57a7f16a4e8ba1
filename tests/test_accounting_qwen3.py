"""The accountant on Qwen3-VL, Qwen3-VL-MoE and Qwen3.5 (issue 34): shapes read from the configs, parameters
equal to the built models (the real profiles on the meta device), FLOPs equal to torch's counter on the tiny
models layer by layer (DeepStack mergers, the router and the active experts, Gated DeltaNet layers), the KV cache
of the full-attention layers with the linear layers' fixed state beside it, how each convention treats the new
parts, and `ficoco flops --verify` on the three tiny profiles."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from ficoco.accounting import CountOptions, account, architecture, make_quant, parameter_counts
from ficoco.accounting.families import FAMILIES
from ficoco.accounting.flops import (
    DELTA_RULE_CHUNK,
    count_by_layer,
    count_by_stage,
    delta_rule_macs,
    model_ops,
    paper_by_layer,
    visual_macs_by_layer,
)
from ficoco.accounting.memory import (
    RECURRENT_STATE_BYTES,
    cache_bytes,
    linear_state,
    linear_state_bytes_per_layer,
    stored_kv_cache_bytes,
    weight_bytes,
)
from ficoco.accounting.schedule import Removal, Schedule, plan_tokens
from ficoco.errors import FicocoError
from ficoco.profiles import load_profile

TINY = ("qwen3-vl-tiny", "qwen3-vl-moe-tiny", "qwen3.5-tiny")
REAL = ("qwen3-vl-8b", "qwen3-vl-30b-a3b", "qwen3.5-0.8b")


def arch(name, overrides=None):
    return architecture(load_profile(name, overrides))


# ---- shapes ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_vl_moe", "qwen3_5"])
def test_the_families_take_an_image_size_or_frames_with_qwen2_vls_prefix_and_video_slices(family):
    record = FAMILIES[family]
    assert record.prefix_tokens == 4 and record.video_slices
    assert record.takes_image_size and record.takes_frames
    assert record.profile_defaults["image_size"] == [768, 768]


@pytest.mark.parametrize("name", TINY + REAL)
def test_visual_tokens_per_image_equal_the_profiles(name):
    assert load_profile(name).defaults["visual_tokens_per_image"] == arch(name).visual_tokens


def test_the_processor_bounds_are_the_checkpoints_65536_to_16777216_pixels():
    small = arch("qwen3-vl-tiny", ["ficoco.image_size=[64,64]"])  # below 65536 pixels: scaled up to 256 x 256
    assert (small.vision.grid_h, small.vision.grid_w) == (16, 16)
    huge = arch("qwen3-vl-tiny", ["ficoco.image_size=[8192,8192]"])  # above: scaled down to 4096 x 4096
    assert (huge.vision.grid_h, huge.vision.grid_w) == (256, 256)
    assert arch("qwen3-vl-tiny").vision.patches == 16 * 20  # 256 x 320 px in 16 px patches


def test_decoder_records_read_the_configs():
    dense, moe, hybrid = (arch(name).decoder for name in REAL)
    assert dense.qk_norm and not dense.attn_output_gate and dense.moe is None and dense.full_attention_layers == 36
    assert moe.moe is not None and (moe.moe.experts, moe.moe.top_k, moe.moe.ffn) == (128, 8, 768)
    assert moe.moe.layers == frozenset(range(48)) and moe.head_dim == 128
    assert hybrid.attn_output_gate and hybrid.full_attention_layers == 6 and hybrid.tied_embeddings
    assert [layer for layer in range(24) if hybrid.full_attention(layer)] == [3, 7, 11, 15, 19, 23]
    lin = hybrid.linear
    assert (lin.key_dim, lin.value_dim, lin.conv_dim, lin.state_elems) == (2048, 2048, 6144, 16 * 128 * 128)
    assert arch("qwen3-vl-8b").deepstack_layers == (8, 16, 24) and arch("qwen3.5-0.8b").deepstack_layers == ()


def test_mlp_only_layers_and_the_sparse_step_choose_the_sparse_layers():
    assert arch("qwen3-vl-moe-tiny").decoder.moe.layers == frozenset({0, 2, 3})
    stepped = arch("qwen3-vl-moe-tiny", ["text_config.decoder_sparse_step=2", "text_config.mlp_only_layers=[]"])
    assert stepped.decoder.moe.layers == frozenset({1, 3})


def test_layer_types_default_to_every_full_attention_interval_th_layer():
    profile = load_profile("qwen3.5-tiny")
    del profile.config["text_config"]["layer_types"]
    kinds = architecture(profile).decoder.layer_types
    assert [k == "full_attention" for k in kinds] == [False, False, False, True] * 2
    profile.config["text_config"]["full_attention_interval"] = 2
    assert [k == "full_attention" for k in architecture(profile).decoder.layer_types] == [False, True] * 4


@pytest.mark.parametrize("override, match", [
    (["vision_config.deepstack_visual_indexes=[1,9]"], "outside the 4-layer tower"),
    (["vision_config.deepstack_visual_indexes=[1,1]"], "repeats a layer"),
    (["text_config.num_experts_per_tok=9"], "exceeds num_experts=8"),
])
def test_geometry_transformers_cannot_run_is_refused_in_one_line(override, match):
    name = "qwen3-vl-moe-tiny"
    with pytest.raises(FicocoError, match=match) as error:
        arch(name, override)
    assert "\n" not in str(error.value)


def test_qwen3_5_refuses_layer_types_of_the_wrong_length():
    with pytest.raises(FicocoError, match="layer_types lists 2 layers but num_hidden_layers=8"):
        arch("qwen3.5-tiny", ['text_config.layer_types=["full_attention","linear_attention"]'])


# ---- parameters --------------------------------------------------------------------------------------------------

def _built_parameters(name, device):
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText

    data = dict(load_profile(name).config)
    config = AutoConfig.for_model(data.pop("model_type"), **data)
    with torch.device(device):
        model = AutoModelForImageTextToText.from_config(config)
    linears = sum(m.weight.numel() for n, m in model.named_modules()
                  if type(m) is torch.nn.Linear and "language_model" in n)
    return sum(p.numel() for p in model.parameters()), linears


@pytest.mark.transformers
@pytest.mark.parametrize("name", TINY + REAL)
def test_parameter_counts_equal_the_built_model_experts_at_all_of_them(name):
    params, decoder_linears = _built_parameters(name, "meta")
    counts = parameter_counts(arch(name))
    assert counts.total == params
    assert counts.linear_decoder == decoder_linears  # bitsandbytes' share: no router, no experts
    assert weight_bytes(arch(name), "all", make_quant("fp16")) == 2 * params


def test_the_30b_a3b_holds_every_expert_but_runs_eight():
    a = arch("qwen3-vl-30b-a3b")
    counts = parameter_counts(a)
    d, moe = a.decoder, a.decoder.moe
    experts = d.layers * moe.experts * 3 * d.hidden * moe.ffn
    assert counts.decoder > experts > 0.9 * counts.decoder  # the experts are most of the weights
    plan = plan_tokens(a, Schedule("vanilla"))
    ops = model_ops(a, plan)
    tokens = plan.llm[0][0]
    ffn = [op.macs for op in ops if op.layer == 0 and op.stage == "llm" and op.name.startswith(("router", "experts"))]
    assert sum(ffn) == tokens * d.hidden * moe.experts + tokens * moe.top_k * 3 * d.hidden * moe.ffn


def test_int8_leaves_the_experts_and_router_at_sixteen_bits():
    a = arch("qwen3-vl-moe-tiny")
    counts = parameter_counts(a)
    int8 = weight_bytes(a, "llm", make_quant("int8"))
    linear = counts.linear_decoder
    assert int8 == (counts.decoder + counts.lm_head - linear) * 2 + linear + 4 * counts.linear_rows["decoder"]


# ---- FLOPs against torch's counter --------------------------------------------------------------------------------

def _counted(name, experts_implementation=None):
    """Per stage and per decoder layer: torch's counter on the built tiny model's plain forward (math SDPA),
    with verify's formulas for grouped_mm and the triangular solves."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import AutoConfig, AutoModelForImageTextToText

    from ficoco.profiling.verify import torch_custom_formulas

    a = arch(name)
    data = dict(load_profile(name).config)
    config = AutoConfig.for_model(data.pop("model_type"), **data)
    torch.manual_seed(0)
    kwargs = {"experts_implementation": experts_implementation} if experts_implementation else {}
    model = AutoModelForImageTextToText.from_config(config, **kwargs).eval()
    groups = a.vision.units
    ids = [5] * 4 + [config.image_token_id] * groups + [6] * (a.text_tokens - 4)
    input_ids = torch.tensor([ids])
    pixels = torch.randn(a.vision.patches, 3 * 2 * a.vision.patch_size**2)
    grid = torch.tensor([[1, a.vision.grid_h, a.vision.grid_w]])
    counter = FlopCounterMode(display=False, custom_mapping=torch_custom_formulas())
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), counter:
        model(input_ids=input_ids, pixel_values=pixels, image_grid_thw=grid,
              mm_token_type_ids=(input_ids == config.image_token_id).long())
    counts = counter.get_flop_counts()
    root = type(model).__name__

    def at(path):
        return sum(counts.get(f"{root}.{path}", {}).values())

    mergers = at("model.visual.merger") + sum(at(f"model.visual.deepstack_merger_list.{k}")
                                              for k in range(len(a.deepstack_layers)))
    stages = {"vision": at("model.visual") - mergers, "projector": mergers, "llm": at("model.language_model"),
              "lm_head": at("lm_head")}
    layers = [at(f"model.language_model.layers.{i}") for i in range(a.decoder.layers)]
    return stages, layers


@pytest.mark.transformers
@pytest.mark.parametrize("name, experts", [("qwen3-vl-tiny", None), ("qwen3-vl-moe-tiny", None),
                                           ("qwen3-vl-moe-tiny", "eager"), ("qwen3.5-tiny", None)])
def test_flops_equal_torchs_counter_stage_by_stage_and_layer_by_layer(name, experts):
    a = arch(name)
    plan = plan_tokens(a, Schedule("vanilla"))
    ops = model_ops(a, plan)
    stages, layers = _counted(name, experts)
    assert count_by_stage(a, plan, ops, "flops") == stages
    by_layer = {layer: count for stage, layer, count in count_by_layer(a, plan, ops, "flops") if stage == "llm"}
    assert [by_layer[i] for i in range(a.decoder.layers)] == layers


def test_the_delta_rule_is_linear_in_tokens_up_to_its_chunk_padding():
    a = arch("qwen3.5-0.8b")
    lin = a.decoder.linear
    chunk = DELTA_RULE_CHUNK
    one = delta_rule_macs(a, 1, chunk)
    assert delta_rule_macs(a, 1, 10 * chunk) == 10 * one
    assert delta_rule_macs(a, 1, chunk + 1) == 2 * one  # a partial chunk costs a whole one
    dk, dv = lin.key_head_dim, lin.value_head_dim
    assert one == lin.value_heads * (chunk * (2 * chunk * dk + 3 * dk * dv + chunk * dv)
                                     + chunk * (chunk - 1) // 2 * (dk + dv))


def test_fewer_visual_tokens_save_less_on_the_hybrid_decoder_than_on_a_dense_one():
    def llm_saving(name):
        a = arch(name)
        full = plan_tokens(a, Schedule("vanilla"))
        cut = plan_tokens(a, Schedule("fastv", (Removal("llm", 2, a.visual_tokens // 2, "layer_input"),)))
        counts = [count_by_stage(a, p, model_ops(a, p), "flops")["llm"] for p in (full, cut)]
        attention = [sum(op.macs for op in model_ops(a, p) if op.name in ("qk", "sv", "delta_rule"))
                     for p in (full, cut)]
        return 1 - counts[1] / counts[0], 1 - attention[1] / attention[0]

    dense_total, dense_attention = llm_saving("qwen3-vl-8b")
    hybrid_total, hybrid_attention = llm_saving("qwen3.5-0.8b")
    assert hybrid_attention < dense_attention  # 18 of 24 layers: linear, not quadratic, in the tokens
    assert 0 < hybrid_total and 0 < dense_total


# ---- DeepStack ---------------------------------------------------------------------------------------------------

def test_deepstack_mergers_follow_the_groups_present_at_their_tap_and_additions_the_decoders_tokens():
    a = arch("qwen3-vl-tiny")  # taps at tower layers 1 and 2, additions after decoder layers 0 and 1
    merged = a.vision.hidden * a.vision.merge
    out = a.projector.linears[1][1]
    # A tower method removing 20 of 80 groups inside layer 2: tap 1 sees 80 groups, tap 2 sees 60.
    plan = plan_tokens(a, Schedule("v", (Removal("vision", 2, 20),)))
    ops = {op.name: op for op in model_ops(a, plan) if op.name.startswith("deepstack_")}
    assert ops["deepstack_0_linear_1"].macs == 80 * merged * merged
    assert ops["deepstack_1_linear_1"].macs == 60 * merged * merged
    assert ops["deepstack_1_linear_2"].macs == 60 * merged * out
    # A decoder method cutting at layer 1's input: the addition after layer 1 covers the kept tokens only.
    plan = plan_tokens(a, Schedule("fastv", (Removal("llm", 1, 30, "layer_input"),)))
    adds = [op for op in model_ops(a, plan) if op.name == "deepstack_add"]
    assert [(op.layer, op.viewer_ops) for op in adds] == [(0, 80 * a.decoder.hidden), (1, 50 * a.decoder.hidden)]
    assert all(op.macs == 0 for op in adds)


# ---- KV cache and the linear-attention state ----------------------------------------------------------------------

def test_the_kv_cache_counts_full_attention_layers_and_the_state_sits_beside_it():
    a = arch("qwen3.5-0.8b")
    d, lin = a.decoder, a.decoder.linear
    plan = plan_tokens(a, Schedule("vanilla"))
    tokens = plan.llm[0][0]
    assert stored_kv_cache_bytes(a, plan, batch=1, kv_bits=16) == 6 * tokens * 2 * d.kv_heads * d.head_dim * 2
    state = linear_state(a, batch=2)
    assert state.layers == 18
    assert state.recurrent_bytes == 18 * 2 * 16 * 128 * 128 * RECURRENT_STATE_BYTES
    assert state.conv_bytes == 18 * 2 * lin.conv_dim * lin.conv_kernel * 2
    per_layer = linear_state_bytes_per_layer(a, batch=2)
    assert sum(per_layer) == state.total_bytes and per_layer[3] == 0


def test_fewer_visual_tokens_save_exactly_the_full_layers_cache_and_none_of_the_state():
    a = arch("qwen3.5-0.8b")
    opts = CountOptions(convention="flops")
    quant = make_quant("fp16")
    full = account(a, Schedule("vanilla"), quant, opts)
    cut = account(a, Schedule("fastv", (Removal("llm", 1, 400, "layer_input"),)), quant, opts)
    d = a.decoder
    per_token = 2 * d.kv_heads * d.head_dim * 2
    # Layers 3, 7, ... hold keys and values: every one of the six sees 400 tokens fewer.
    assert full.kv_cache_bytes - cut.kv_cache_bytes == 6 * 400 * per_token
    assert full.linear_state == cut.linear_state and full.linear_state.layers == 18
    row = full.to_json()
    assert row["linear_state"]["total_bytes"] == full.linear_state.total_bytes
    assert "linear_state" not in account(arch("qwen3-vl-tiny"), Schedule("vanilla"), quant, opts).to_json()


@pytest.mark.transformers
@pytest.mark.parametrize("name", ["qwen3.5-tiny", "qwen3-vl-moe-tiny"])
def test_the_cache_transformers_holds_is_the_kv_cache_plus_the_linear_state(name):
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText

    from ficoco.models import hf_compat as hf
    from ficoco.profiling.trackers import cache_bytes as measured_bytes

    a = arch(name)
    data = dict(load_profile(name).config)
    config = AutoConfig.for_model(data.pop("model_type"), **data)
    model = AutoModelForImageTextToText.from_config(config).eval()
    ids = [5] * 4 + [config.image_token_id] * a.vision.units + [6] * (a.text_tokens - 4)
    input_ids = torch.tensor([ids, ids])
    grid = torch.tensor([[1, a.vision.grid_h, a.vision.grid_w]] * 2)
    with torch.no_grad():
        out = model(input_ids=input_ids, pixel_values=torch.randn(2 * a.vision.patches, 3 * 2 * 16 * 16),
                    image_grid_thw=grid, mm_token_type_ids=(input_ids == config.image_token_id).long(), use_cache=True)
    plan = plan_tokens(a, Schedule("vanilla"))
    assert measured_bytes(hf.output_cache(out)) == cache_bytes(a, plan, batch=2, kv_bits=32, element_bytes=4.0)


def test_llm_viewer_kv_figure_holds_only_the_full_layers():
    a = arch("qwen3.5-tiny")
    quant = make_quant("fp16")
    viewer = account(a, Schedule("vanilla"), quant, CountOptions(convention="llm-viewer"))
    stored = account(a, Schedule("vanilla"), quant, CountOptions(convention="flops"))
    assert viewer.kv_cache_bytes == stored.kv_cache_bytes > 0


def test_the_upcast_layers_weigh_their_own_linears():
    a = arch("qwen3.5-tiny")  # layers 0-2 Gated DeltaNet, layer 3 full attention
    counts = parameter_counts(a)
    fp32 = make_quant("fp16")
    three = weight_bytes(a, "all", fp32, element_bytes=4.0, upcast_layers=3, upcast_element_bytes=2.0)
    four = weight_bytes(a, "all", fp32, element_bytes=4.0, upcast_layers=4, upcast_element_bytes=2.0)
    assert three - four == 2 * counts.linear_decoder_layers[3]
    assert counts.linear_decoder_layers[0] != counts.linear_decoder_layers[3]


# ---- conventions -------------------------------------------------------------------------------------------------

def test_paper_and_visual_macs_drop_the_quadratic_term_at_linear_layers_and_use_the_active_experts():
    a = arch("qwen3.5-tiny")
    plan = plan_tokens(a, Schedule("vanilla"))
    d = a.decoder
    n = plan.llm[0][0]
    paper = {layer: count for stage, layer, count in paper_by_layer(a, plan) if stage == "llm"}
    assert paper[0] == 4 * n * d.hidden**2 + 2 * n * d.hidden * d.ffn
    assert paper[3] == 4 * n * d.hidden**2 + 2 * n * n * d.hidden + 2 * n * d.hidden * d.ffn
    v = plan.llm_visual[0][0]
    visual = {layer: count for _, layer, count in visual_macs_by_layer(a, plan)}
    assert visual[0] == 4 * v * d.hidden**2 + 3 * v * d.hidden * d.ffn
    moe = arch("qwen3-vl-moe-tiny")
    plan = plan_tokens(moe, Schedule("vanilla"))
    dm = moe.decoder
    n = plan.llm[0][0]
    paper = {layer: count for stage, layer, count in paper_by_layer(moe, plan) if stage == "llm"}
    active = dm.moe.top_k * dm.moe.ffn
    assert paper[0] == 4 * n * dm.hidden**2 + 2 * n * n * dm.hidden + 2 * n * dm.hidden * active
    assert paper[1] == 4 * n * dm.hidden**2 + 2 * n * n * dm.hidden + 2 * n * dm.hidden * dm.ffn  # mlp_only


def test_llm_viewer_replays_experts_as_ffns_and_a_deltanet_layer_as_its_linears_at_two_ops_per_mac():
    for name in ("qwen3-vl-moe-tiny", "qwen3.5-tiny"):
        a = arch(name)
        plan = plan_tokens(a, Schedule("vanilla"))
        ops = model_ops(a, plan)
        matrix = [op for op in ops if op.stage == "llm" and op.macs]
        assert all(op.viewer_ops == 2 * op.macs for op in matrix)
        viewer = count_by_stage(a, plan, ops, "llm-viewer")["llm"]
        assert viewer == sum(op.viewer_ops for op in ops if op.stage == "llm")
        assert viewer > count_by_stage(a, plan, ops, "flops")["llm"]  # plus norms, gates, activations


def test_the_experts_weights_loaded_are_those_the_rows_reach():
    a = arch("qwen3-vl-moe-tiny")
    d, moe = a.decoder, a.decoder.moe
    plan = plan_tokens(a, Schedule("vanilla"))
    layer0 = [op for op in model_ops(a, plan) if op.stage == "llm" and op.layer == 0]
    loaded = sum(op.weight_elems for op in layer0 if op.name.startswith("experts"))
    assert loaded == moe.experts * 3 * d.hidden * moe.ffn  # 92 tokens x 2 reach all 8 experts


def test_a_single_token_loads_only_its_top_k_experts():
    a = arch("qwen3-vl-moe-tiny")
    d, moe = a.decoder, a.decoder.moe
    plan = replace(plan_tokens(a, Schedule("vanilla")), llm=((1, 1),) * d.layers, llm_visual=((0, 0),) * d.layers)
    layer0 = [op for op in model_ops(a, plan) if op.stage == "llm" and op.layer == 0]
    assert sum(op.weight_elems for op in layer0 if op.name.startswith("experts")) == moe.top_k * 3 * d.hidden * moe.ffn


# ---- `ficoco flops --verify` on the tiny models ----------------------------------------------------------------------

def _adapter_or_skip(family):
    from ficoco.models import supported_families

    if family not in supported_families():
        pytest.skip(f"the {family} adapter is not in this tree")


VERIFIED = [("qwen3-vl-tiny", "vanilla", None), ("qwen3-vl-tiny", "tome", None), ("qwen3-vl-tiny", "visionzip", None),
            ("qwen3-vl-moe-tiny", "vanilla", None), ("qwen3-vl-moe-tiny", "v", 48), ("qwen3.5-tiny", "vanilla", None),
            ("qwen3.5-tiny", "l", "3:20,7:10"), ("qwen3.5-tiny", "divprune", None)]


@pytest.mark.transformers
@pytest.mark.parametrize("name, variant, setting", VERIFIED)
def test_verify_every_stage_within_half_a_percent_of_both_counters(name, variant, setting):
    """DeepStack's mergers and additions (and a merging method's rerun on them), the router and the active
    experts, the Gated DeltaNet layers: each stage as fvcore and torch's counter see it."""
    from ficoco.accounting import resolve_schedule
    from ficoco.profiling.verify import verify

    profile = load_profile(name)
    _adapter_or_skip(profile.family)
    a = architecture(profile)
    budget = {"schedule": setting} if isinstance(setting, str) else {"keep": setting}
    schedule = resolve_schedule(a, variant, CountOptions(), **budget)
    result = verify(profile, [schedule], dtype="fp32")
    run = result.runs[0]
    assert result.passed
    for stage in run.stages:
        assert abs(stage.fvcore_diff) <= 0.005 and abs(stage.torch_diff) <= 0.005, stage
        assert stage.analytic > 0
    assert not run.skipped_matrix_ops
    assert math.isclose(run.total.fvcore, run.total.analytic, rel_tol=0.005)


@pytest.mark.parametrize("convention", ["flops", "macs", "llm-viewer", "paper", "visual-macs"])
def test_every_convention_says_how_it_counts_experts_deltanet_and_deepstack(convention, flops_report):
    from ficoco.accounting.flops import convention_notes

    scope = "all" if convention not in ("llm-viewer", "visual-macs") else "llm"
    moe = convention_notes(arch("qwen3-vl-30b-a3b"), convention)
    assert [note.split(":")[0] for note in moe] == ["sparse layers", "DeepStack"]
    assert [note.split(":")[0] for note in convention_notes(arch("qwen3.5-0.8b"), convention)] == [
        "Gated DeltaNet layers"]
    assert convention_notes(arch("qwen2-vl-7b"), convention) == []
    report = flops_report("--model", "qwen3.5-tiny", "--convention", convention, "--scope", scope)
    assert report["convention_notes"] == convention_notes(arch("qwen3.5-tiny"), convention)
    assert "convention_notes" not in flops_report("--model", "llava-tiny", "--convention", convention)
    if convention == "llm-viewer":
        assert "LLM-Viewer has no MoE" in moe[0]


@pytest.mark.transformers
@pytest.mark.parametrize("frames, size", [(2, (768, 768)), (8, (480, 854)), (64, (768, 768)), (768, (1080, 1920)),
                                          (5, (20, 30))])
def test_the_video_resize_is_the_video_processors(frames, size):
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize

    from ficoco.accounting.families.qwen3_vl import VIDEO_MAX_PIXELS, VIDEO_MIN_PIXELS, video_frame_pixels

    expected = smart_resize(frames, *size, temporal_factor=2, factor=32, min_pixels=VIDEO_MIN_PIXELS,
                            max_pixels=VIDEO_MAX_PIXELS)
    assert video_frame_pixels(frames, size, 32, 2) == expected
    a = architecture(load_profile("qwen3-vl-8b"), image_size=size, frames=frames)
    assert (a.vision.grid_h * 16, a.vision.grid_w * 16) == expected
    assert a.vision.items == -(-frames // 2) and a.visual_tokens == a.vision.items * a.vision.units


@pytest.mark.transformers
@pytest.mark.parametrize("size", [(768, 768), (64, 64), (8192, 8192), (333, 1000), (1080, 1920)])
def test_the_image_resize_is_the_image_processors_at_the_checkpoints_bounds(size):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    from ficoco.accounting.families.qwen3_vl import MAX_PIXELS, MIN_PIXELS

    expected = smart_resize(*size, factor=32, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
    a = architecture(load_profile("qwen3.5-0.8b"), image_size=size)
    assert (a.vision.grid_h * 16, a.vision.grid_w * 16) == expected


def test_a_video_of_one_frame_is_refused_in_one_line():
    with pytest.raises(FicocoError, match="at least temporal_patch_size=2 frames"):
        architecture(load_profile("qwen3-vl-tiny"), frames=1)


# ---- where a method acts in the hybrid decoder: only what the model runs is priced ----------------------------------

# Per decoder method, the layers of qwen3.5-tiny (Gated DeltaNet in 0-2 and 4-6, full attention in 3 and 7) where a
# one-step schedule runs: FastV, SparseVLM and DART read layer L-1 (full: 3, so L = 4); PDrop its own layer L (full,
# not the first: 7); FiCoCo-L reduces inside full layers (3, 7).
RUNS_AT = {"fastv": {4}, "sparsevlm": {4}, "dart": {4}, "pdrop": {7}, "l": {3, 7}}


@pytest.mark.parametrize("variant", sorted(RUNS_AT))
def test_the_accountant_plans_a_decoder_method_only_at_the_layers_the_hybrid_decoder_runs_it(variant):
    from ficoco.accounting import resolve_schedule

    a, allowed, refused = arch("qwen3.5-tiny"), set(), {}
    for layer in range(1, a.decoder.layers):
        try:
            resolve_schedule(a, variant, CountOptions(), schedule=f"{layer}:10")
            allowed.add(layer)
        except FicocoError as exc:
            refused[layer] = str(exc)
    assert allowed == RUNS_AT[variant]
    assert all("Qwen3.5 decoder" in line and "\n" not in line for line in refused.values()), refused


def test_the_rule_covers_holitoms_inner_merge_and_leaves_the_cuts_before_the_llm_alone():
    """HoliTom is refused on Qwen3.5 by family, so its inner merge (a layer-input step after its cut before the LLM)
    meets the placement rule only through `HybridLayers` itself: it reads layer K-1's rows like FastV."""
    from ficoco.methods import METHODS
    from ficoco.methods.hybrid import HybridLayers

    rule = HybridLayers("Qwen3.5", 8, (3, 7))
    cut = Removal("vision", 11, 30, "after_projector")
    with pytest.raises(FicocoError, match=r"^HoliTom at layer 2 reads layer 1's attention rows, .* full-attention "
                                          r"layer: 4$"):
        rule.check(METHODS["holitom"], Schedule("holitom", (cut, Removal("llm", 2, 10, "layer_input"))))
    rule.check(METHODS["holitom"], Schedule("holitom", (cut, Removal("llm", 4, 10, "layer_input"))))
    rule.check(METHODS["visionzip"], Schedule("visionzip", (Removal("vision", 11, 30, "tower_output", 5),)))
    with pytest.raises(FicocoError, match="has no full-attention layer"):
        HybridLayers("Qwen3.5", 8, ()).check(METHODS["visionzip"], Schedule("visionzip"))


def test_flops_refuses_fastv_at_its_default_layer_alone_and_prices_it_at_layer_4(cli, flops_report):
    """FastV's default layer 2 reads layer 1, Gated DeltaNet on Qwen3.5-0.8B: `ficoco flops` refuses it in the line
    `ficoco profile` would (exit 2, no traceback); at layer 4 (after full layer 3) it is priced."""
    from helpers import assert_one_error_line

    line = assert_one_error_line(cli("flops", "--model", "qwen3.5-0.8b", "--variant", "fastv", "--keep", "64",
                                     in_subprocess=True))
    assert line == ("error: FastV at layer 2 reads layer 1's attention rows, and layer 1 of this Qwen3.5 decoder is "
                    "Gated DeltaNet (linear attention: a recurrent state, no attention map); reduce at the input of a "
                    "layer after a full-attention layer: 4, 8, 12, 16, 20")
    report = flops_report("--model", "qwen3.5-0.8b", "--variant", "fastv", "--keep", "128", "--hp", "layer=4")
    (row,) = report["rows"]
    assert [step["layer"] for step in row["schedule"]] == [4] and row["visual_tokens"] < 128 < 576


def test_flops_leaves_the_refused_placements_out_of_a_table_with_their_reasons(cli, flops_report):
    """Side by side, the decoder methods whose default placement reads a Gated DeltaNet layer are left out under the
    table with the adapter's line, as an unreachable budget is; the others are priced."""
    report = flops_report("--model", "qwen3.5-0.8b", "--variant", "vanilla,v,fastv,pdrop,sparsevlm,dart,l",
                          "--keep", "64")
    assert sorted(r["variant"] for r in report["rows"]) == ["l", "v", "vanilla"]
    skipped = {entry["variant"]: entry["reason"] for entry in report["skipped"]}
    assert set(skipped) == {"fastv", "pdrop", "sparsevlm", "dart"}
    assert all("of this Qwen3.5 decoder is Gated DeltaNet" in reason for reason in skipped.values()), skipped
    printed = cli("flops", "--model", "qwen3.5-0.8b", "--variant", "vanilla,fastv,l", "--keep", "64")
    assert printed.code == 0 and "left out fastv: FastV at layer 2 reads layer 1's attention rows" in printed.out


def test_the_python_api_and_a_sweep_report_a_refused_placement_instead_of_pricing_it():
    import ficoco
    from ficoco.sweep import SweepConfig, plan_points, sweep_profile

    with pytest.raises(FicocoError, match="PDrop ranks with layer 3's own attention projections, and layer 3 of this "
                                          "Qwen3.5 decoder is the first full-attention layer"):
        ficoco.flops("qwen3.5-tiny", "pdrop", schedule="3:20")
    report = ficoco.flops("qwen3.5-tiny", "vanilla,fastv,pdrop", schedule="4:20")
    assert [r["variant"] for r in report["rows"]] == ["vanilla", "fastv"]
    assert "layer 4 of this Qwen3.5 decoder is Gated DeltaNet" in report["skipped"][0]["reason"]
    config = SweepConfig(model="qwen3.5-tiny", variants=("fastv", "l"), keep=(40,), text_tokens=12)
    skipped: list = []
    points = plan_points(config, sweep_profile(config), skipped)
    assert [p.variant for p in points] == ["vanilla", "l"]
    assert [entry["variant"] for entry in skipped] == ["fastv"]
    assert "layer 1 of this Qwen3.5 decoder is Gated DeltaNet" in skipped[0]["reason"]
