"""The prediction's family kernels (profiling/predict.py, KERNELS): a sparse layer's experts, a Gated DeltaNet
layer's delta rule and convolution, the Qwen towers' patch embedding and per-image attention are priced at the
rate of the call the model makes, timed at the row's own shapes; the rate probe asks for those shapes. Exact
figures at given rates (TableRates); no test times anything it asserts on."""

from __future__ import annotations

import pytest
import torch

from ficoco.accounting import Schedule, architecture
from ficoco.accounting.flops import model_ops
from ficoco.accounting.schedule import plan_tokens
from ficoco.profiles import load_profile
from ficoco.profiling import predict
from ficoco.profiling.predict import KERNELS, MeasuredRates, TableRates, predict_prefill, rate_probe_shapes

TEXT = 12
VANILLA = Schedule("vanilla", ())
FREE = 1e30  # a rate so high that what it prices costs nothing


def _ops(arch, batch: int = 1):
    return model_ops(arch, plan_tokens(arch, VANILLA, text_tokens=TEXT), batch=batch, lm_head_tokens="last")


# The decoder's elementwise ops a kernel prices (its call timed), and those whose work runs inside another's call.
ELEMENTWISE_KERNEL_OPS = ("input_norm", "post_attn_norm", "q_norm", "k_norm", "mlp_act", "experts_act", "gated_norm")
INSIDE_OTHER_CALLS = ("experts_weights", "conv_act", "softmax")


def _memory_bytes(ops) -> float:
    """Bytes of the ops still priced at the memory bandwidth: elementwise, neither a kernel nor inside one (the
    Qwen3 towers' activation is a kernel too: every profile here has such a tower)."""
    return sum(predict._op_bytes(op, 2, 2) for op in ops if not op.macs and op.name not in INSIDE_OTHER_CALLS
               and not (op.stage == "llm" and op.name in ELEMENTWISE_KERNEL_OPS)
               and not (op.stage == "vision" and op.name == "mlp_act"))


def _rates(bandwidth: float = FREE, **kernels: float) -> TableRates:
    """Everything free but the kernels named (kind=FLOP/s) and memory at `bandwidth`."""
    return TableRates(dtype="bfloat16", flops_per_s_by_tokens={1: FREE}, bandwidth_bytes_per_s=bandwidth,
                      kernels_by_tokens={kind: {1: rate} for kind, rate in kernels.items()})


def test_a_sparse_layers_experts_are_priced_at_the_grouped_matmul_rate_of_their_rows():
    arch = architecture(load_profile("qwen3-vl-moe-tiny"))
    moe = arch.decoder.moe
    ops = _ops(arch)
    experts = [op for op in ops if op.name in ("experts_gate_up", "experts_down")]
    assert {op.layer for op in experts} == set(moe.layers) and 1 not in moe.layers  # layer 1 keeps a dense FFN
    prediction = predict_prefill(arch, VANILLA, _rates(grouped_mm=1e9), text_tokens=TEXT)
    assert prediction.parts_s["linear"] == pytest.approx(sum(2 * op.macs for op in experts) / 1e9, rel=1e-9)
    # The reachable experts' weights are read inside those calls: no bytes of their own.
    weights = sum(op.weight_elems for op in ops if op.name == "experts_weights")
    assert weights > 0
    memory = predict_prefill(arch, VANILLA, _rates(bandwidth=1e9), text_tokens=TEXT).parts_s["memory"]
    assert memory == pytest.approx(_memory_bytes(ops) / 1e9, rel=1e-9)


def test_the_probe_times_an_experts_matmul_at_each_row_count_the_even_split_gives_before_a_row_has_run():
    arch = architecture(load_profile("qwen3-vl-moe-tiny"))
    d, moe = arch.decoder, arch.decoder.moe
    tokens = plan_tokens(arch, VANILLA, text_tokens=TEXT).llm[0][0]
    rows = tokens * moe.top_k
    shapes = rate_probe_shapes(arch, VANILLA, text_tokens=TEXT)
    grouped = {key: flops for key, flops in shapes.kernels.items() if key[0] == "grouped_mm"}
    counts = set(predict.even_loads(rows, moe.experts))
    # One key per row count an expert takes, at each matrix; its work the call's: that many rows on every expert.
    groups = {n: predict.expert_probe_groups(n, moe.experts) for n in counts}
    assert grouped == {**{("grouped_mm", n, moe.experts, d.hidden, 2 * moe.ffn): 2 * n * groups[n] * d.hidden
                          * 2 * moe.ffn for n in counts},
                       **{("grouped_mm", n, moe.experts, moe.ffn, d.hidden): 2 * n * groups[n] * moe.ffn * d.hidden
                          for n in counts}}
    # Neither matrix is a plain linear shape any more; the dense layer's FFN still is.
    assert (rows, d.hidden, 2 * moe.ffn) not in shapes.linear and (tokens, d.hidden, d.ffn) in shapes.linear
    # The weight a probe borrows from the model between runs: all experts' (out, in) matrices.
    assert predict._weight_values(("grouped_mm", rows, moe.experts, d.hidden, 2 * moe.ffn)) == (
        moe.experts * 2 * moe.ffn * d.hidden)


def test_a_probe_call_runs_few_experts_at_many_rows_and_every_expert_at_few():
    assert predict.expert_probe_groups(1, 128) == 128
    assert predict.expert_probe_groups(37, 128) == 110  # 4,070 rows
    assert predict.expert_probe_groups(636, 128) == 6
    assert predict.expert_probe_groups(10_000, 128) == 1
    weight = torch.randn(8 * 16 * 4)
    rates = MeasuredRates("float32")
    call = predict._grouped_mm_call(rates, (3, 8, 4, 16), weight)
    assert call().shape == (3 * 8, 16)


def test_each_expert_is_priced_at_the_rows_it_took_in_the_row():
    """A layer whose experts took uneven rows costs each expert's matmul at its own count (the loads the row
    ran, profiling/experts.py); loads that do not add up to the layer's rows leave it at the even split."""
    arch = architecture(load_profile("qwen3-vl-moe-tiny"))
    moe = arch.decoder.moe
    ops = _ops(arch)
    experts = [op for op in ops if op.name in ("experts_gate_up", "experts_down")]
    rows = predict._linear_shape(arch, experts[0])[0]
    # Rates that depend on the rows an expert takes: 1 GFLOP/s at one row, 100 at 64 and more.
    table = TableRates(dtype="bfloat16", flops_per_s_by_tokens={1: FREE}, bandwidth_bytes_per_s=FREE,
                       kernels_by_tokens={"grouped_mm": {1: 1e9, 64: 1e11}})
    skewed = [rows - (moe.experts - 1)] + [1] * (moe.experts - 1)  # one expert takes nearly all
    loads = {layer: skewed for layer in moe.layers}
    priced = predict_prefill(arch, VANILLA, table, text_tokens=TEXT, expert_loads=loads).parts_s["linear"]
    expected = 0.0
    for op in experts:
        _, inner, outer = predict._linear_shape(arch, op)
        expected += sum(2 * n * inner * outer / (1e11 if n >= 33 else 1e9) for n in skewed)
    assert priced == pytest.approx(expected, rel=1e-9)
    even = predict_prefill(arch, VANILLA, table, text_tokens=TEXT).parts_s["linear"]
    assert even != pytest.approx(priced)
    wrong = {layer: [1] * moe.experts for layer in moe.layers}  # not the layer's rows
    assert predict_prefill(arch, VANILLA, table, text_tokens=TEXT, expert_loads=wrong).parts_s["linear"] == (
        pytest.approx(even, rel=1e-12))


def test_a_deltanet_layer_is_priced_at_its_delta_rule_and_convolution_rates():
    arch = architecture(load_profile("qwen3.5-tiny"))
    d, linear = arch.decoder, arch.decoder.linear
    ops = _ops(arch)
    rules = [op for op in ops if op.name == "delta_rule"]
    convolutions = [op for op in ops if op.name == "conv1d"]
    deltanet_layers = [layer for layer in range(d.layers) if not d.full_attention(layer)]
    assert [op.layer for op in rules] == [op.layer for op in convolutions] == deltanet_layers
    prediction = predict_prefill(arch, VANILLA, _rates(delta_rule=1e9, causal_conv1d=2e8), text_tokens=TEXT)
    expected_s = sum(2 * op.macs for op in rules) / 1e9 + sum(2 * op.macs for op in convolutions) / 2e8
    assert prediction.parts_s["linear_attention"] == pytest.approx(expected_s, rel=1e-9)
    # The convolution's activation runs inside its call.
    memory = predict_prefill(arch, VANILLA, _rates(bandwidth=1e9), text_tokens=TEXT).parts_s["memory"]
    assert memory == pytest.approx(_memory_bytes(ops) / 1e9, rel=1e-9)
    tokens = plan_tokens(arch, VANILLA, text_tokens=TEXT).llm[0][0]
    shapes = rate_probe_shapes(arch, VANILLA, text_tokens=TEXT)
    assert {key for key in shapes.kernels if key[0] in ("delta_rule", "causal_conv1d")} == {
        ("delta_rule", tokens, 1, linear.key_heads, linear.value_heads, linear.key_head_dim, linear.value_head_dim),
        ("causal_conv1d", tokens, 1, linear.conv_dim, linear.conv_kernel)}


def test_a_qwen_towers_attention_is_priced_per_image_at_its_own_rate_and_its_patch_embedding_as_a_conv3d():
    arch = architecture(load_profile("qwen3-vl-tiny"))
    v = arch.vision
    batch = 2  # two images: the tower attends within each, one SDPA call per image
    ops = _ops(arch, batch)
    tokens = plan_tokens(arch, VANILLA, text_tokens=TEXT).vision[0][0]
    shapes = rate_probe_shapes(arch, VANILLA, batch=batch, text_tokens=TEXT)
    assert ("tower_attention", tokens, batch, v.heads, v.hidden // v.heads, "qwen3_vl") in shapes.kernels
    assert ("patch_conv3d", batch * v.patches, v.channels, v.temporal_patch, v.patch_size, v.hidden) in shapes.kernels
    assert shapes.attention == [(arch.decoder.heads, plan_tokens(arch, VANILLA, text_tokens=TEXT).llm[0][0],
                                 arch.decoder.head_dim, True)]  # the decoder's SDPA alone
    prediction = predict_prefill(arch, VANILLA, _rates(tower_attention=1e9, patch_conv3d=5e8), batch=batch,
                                 text_tokens=TEXT)
    tower_qk = [op for op in ops if op.stage == "vision" and op.name == "qk"]
    # The accountant's per-image square (qk and sv): batch x tokens^2, not (batch x tokens)^2.
    assert sum(op.macs for op in tower_qk) == v.layers * batch * v.heads * tokens ** 2 * (v.hidden // v.heads)
    assert prediction.parts_s["attention"] == pytest.approx(sum(4 * op.macs for op in tower_qk) / 1e9, rel=1e-9)
    patch = next(op for op in ops if op.name == "patch_embed")
    assert prediction.parts_s["linear"] == pytest.approx(2 * patch.macs / 5e8, rel=1e-9)


def test_a_decoders_norms_and_gated_activation_are_priced_at_their_elements_rates():
    """Every family's: the RMSNorms (float32 inside) at tokens x hidden, the per-head q/k norms at their rows,
    silu(gate) * up at tokens x the FFN width (the accountant's record sizes its load by the hidden width)."""
    arch = architecture(load_profile("qwen3-vl-tiny"))
    d = arch.decoder
    tokens = plan_tokens(arch, VANILLA, text_tokens=TEXT).llm[0][0]
    shapes = rate_probe_shapes(arch, VANILLA, text_tokens=TEXT)
    assert {key for key in shapes.kernels if key[0] in ("rms_norm", "gated_act")} == {
        ("rms_norm", tokens, d.hidden), ("rms_norm", tokens * d.heads, d.head_dim),
        ("rms_norm", tokens * d.kv_heads, d.head_dim), ("gated_act", tokens, d.ffn)}
    prediction = predict_prefill(arch, VANILLA, _rates(rms_norm=1e9, gated_act=2e9), text_tokens=TEXT)
    norms = 2 * tokens * d.hidden + tokens * (d.heads + d.kv_heads) * d.head_dim  # per layer
    assert prediction.parts_s["elementwise"] == pytest.approx(
        d.layers * (norms / 1e9 + tokens * d.ffn / 2e9), rel=1e-9)
    deltanet = architecture(load_profile("qwen3.5-tiny"))
    linear = deltanet.decoder.linear
    kernels = rate_probe_shapes(deltanet, VANILLA, text_tokens=TEXT).kernels
    gated = {key for key in kernels if key[0] == "gated_rms_norm"}
    assert gated == {("gated_rms_norm", tokens * linear.value_heads, linear.value_head_dim)}


@pytest.mark.parametrize("profile", ["llava-tiny", "internvl3-tiny", "llava-onevision-tiny"])
def test_the_other_families_matmuls_and_attention_price_as_before(profile):
    """Beside the decoder's norms and activation, LLaVA's and InternVL's families ask for no kernel: every
    matmul and SDPA call at the rates of its shapes, as before."""
    arch = architecture(load_profile(profile))
    kinds = {key[0] for key in rate_probe_shapes(arch, VANILLA, text_tokens=TEXT).kernels}
    assert kinds == {"rms_norm", "gated_act"}
    rates = TableRates(dtype="float32", flops_per_s_by_tokens={2: 1e9}, bandwidth_bytes_per_s=1e30,
                       kernels_by_tokens={kind: {1: FREE} for kind in kinds})
    flops = sum(2 * op.macs for op in _ops(arch))
    assert predict_prefill(arch, VANILLA, rates, text_tokens=TEXT, compute_bits=32).total_s == pytest.approx(
        flops / 1e9, rel=1e-9)


def test_a_qwen3_towers_tanh_gelu_is_priced_at_its_own_elements_rate():
    """Qwen3-VL's and Qwen3.5's tower MLP: fc1, the tanh GELU over tokens x the FFN width, fc2; the activation
    costs several times its bytes on a CPU (12 layers of Qwen3.5's tower: 82 ms where its bytes said 14), so
    the probe times transformers' activation at its shape. Towers whose family names no activation keep the
    bytes (the other families' test above)."""
    arch = architecture(load_profile("qwen3-vl-tiny"))
    v = arch.vision
    assert v.act == "gelu_pytorch_tanh"
    tokens = plan_tokens(arch, VANILLA, text_tokens=TEXT).vision[0][0]
    shapes = rate_probe_shapes(arch, VANILLA, text_tokens=TEXT)
    assert {key for key in shapes.kernels if key[0] == "tower_act"} == {("tower_act", tokens, v.ffn, v.act)}
    priced = predict_prefill(arch, VANILLA, _rates(tower_act=1e9), text_tokens=TEXT)
    assert priced.parts_s["elementwise"] == pytest.approx(v.layers * tokens * v.ffn / 1e9, rel=1e-9)


def test_a_windowed_tower_layer_keeps_the_sequence_pricing_and_a_full_one_is_per_image():
    arch = architecture(load_profile("qwen2.5-vl-tiny"))
    v = arch.vision
    shapes = rate_probe_shapes(arch, VANILLA, text_tokens=TEXT)
    tower_keys = [key for key in shapes.kernels if key[0] == "tower_attention"]
    assert v.full_attention_layers and len(tower_keys) == 1 and tower_keys[0][-1] == "qwen2_5_vl"
    assert any(heads == v.heads for heads, *_ in shapes.attention)  # the windowed layers' SDPA rate


def test_the_time_estimate_counts_a_kernel_as_the_flops_a_matmul_does_in_its_time():
    arch = architecture(load_profile("qwen3.5-tiny"))
    shapes = rate_probe_shapes(arch, VANILLA, text_tokens=TEXT)
    plain = predict.ProbeShapes(linear=shapes.linear, attention=shapes.attention)
    kernels = sum(work * KERNELS[key[0]].matmul_flops_per_work for key, work in shapes.kernels.items())
    assert shapes.pass_flops() == pytest.approx(plain.pass_flops() + kernels)
    assert shapes.calls == plain.calls + len(shapes.kernels)


@pytest.mark.transformers
def test_every_kernel_runs_on_the_probe_and_a_pass_between_runs_borrows_its_weights(monkeypatch):
    """The calls run (transformers' own delta rule, convolution and rotary), each kernel gets a rate, and
    between a row's runs a kernel that reads a weight runs on the model's own memory: no weight-sized buffer."""
    experts = torch.nn.Parameter(torch.randn(2, 8, 8))  # 2 experts' (out 8, in 8) matrices
    conv = torch.nn.Parameter(torch.randn(12, 1, 4))
    patch = torch.nn.Parameter(torch.randn(8, 3, 2, 2, 2))
    norm = torch.nn.Parameter(torch.ones(16))
    model = torch.nn.ParameterList([experts, conv, patch, norm])
    keys = {("grouped_mm", 8, 2, 8, 8): 1024.0, ("delta_rule", 5, 1, 2, 2, 4, 4): 100.0,
            ("causal_conv1d", 5, 1, 12, 4): 50.0, ("patch_conv3d", 6, 3, 2, 2, 8): 1152.0,
            ("tower_attention", 4, 2, 2, 4, "qwen3_vl"): 512.0, ("rms_norm", 5, 16): 80.0,
            ("gated_rms_norm", 10, 16): 160.0, ("gated_act", 5, 24): 120.0,
            ("tower_act", 5, 24, "gelu_pytorch_tanh"): 120.0}
    assert set(keys) == {key for key in keys if key[0] in KERNELS} and {key[0] for key in keys} == set(KERNELS)
    rates = predict.MeasuredRates("float32", weights=predict.model_weights(model))
    rates.measure(kernels=keys)
    assert all(rates.kernel_work_per_s(key) > 0 for key in keys)
    requested: list[tuple[int, ...]] = []
    original = predict.MeasuredRates._tensor

    def tensor(self, *shape, kind=None):
        requested.append(shape)
        return original(self, *shape, kind=kind)

    monkeypatch.setattr(predict.MeasuredRates, "_tensor", tensor)
    rates.sample()
    assert set(rates._passes[-1]) == set(keys)  # every kernel borrowed its weight or reads none
    weight_sizes = {experts.numel(), conv.numel(), patch.numel(), norm.numel()}
    assert not any(len(shape) == 1 and shape[0] in weight_sizes for shape in requested)


def test_a_call_the_device_cannot_make_leaves_its_ops_to_the_plain_pricing(monkeypatch):
    """Where the model could not make a kernel's call either (grouped_mm below a GPU's SM80, a changed
    transformers contact), the probe drops that key and the prediction prices the ops as before: the experts as
    one matmul of their rows, the other reachable experts' weights as bytes."""
    arch = architecture(load_profile("qwen3-vl-moe-tiny"))

    def refuse(rates, shape, weight):
        raise RuntimeError("grouped_mm: not on this device")

    monkeypatch.setitem(KERNELS, "grouped_mm", predict.Kernel(
        KERNELS["grouped_mm"].weight_values, refuse, "linear", matmul_flops_per_work=1))
    rates = predict.MeasuredRates("float32")
    prediction = predict_prefill(arch, VANILLA, rates, text_tokens=TEXT)
    assert prediction.total_s > 0
    assert {key[0] for key in rates._failed} == {"grouped_mm"}
    assert not any(key[0] == "grouped_mm" for key in rates._work)
    d, moe = arch.decoder, arch.decoder.moe
    rows = plan_tokens(arch, VANILLA, text_tokens=TEXT).llm[0][0] * moe.top_k
    assert ("linear", rows, d.hidden, 2 * moe.ffn) in rates._work  # the experts priced as one matmul again
    memory = predict_prefill(arch, VANILLA, rates, text_tokens=TEXT).parts_s["memory"]
    assert memory > predict_prefill(arch, VANILLA, _rates(bandwidth=rates.bandwidth_bytes_per_s),
                                    text_tokens=TEXT).parts_s["memory"]  # the experts' weights as bytes
