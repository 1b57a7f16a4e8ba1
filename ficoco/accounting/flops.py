"""Operation records and the counting conventions built on them.

Every op of a prefill is one `Op` record (LLM-Viewer's habit: one record shape for all ops):
its matrix multiply-accumulates, its LLM-Viewer OPs, and the elements it loads and stores.
The conventions of docs/accounting.md are sums over these records, except `paper`, which is the
FiCoCo appendix's closed formula per layer.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass

from ficoco.accounting.architecture import Architecture
from ficoco.accounting.schedule import TokenPlan
from ficoco.errors import FicocoError
from ficoco.methods.registry import METHODS

CONVENTIONS = ("flops", "macs", "llm-viewer", "paper", "visual-macs")
# Conventions that define the decoder only.
LLM_ONLY_CONVENTIONS = ("llm-viewer", "visual-macs")
SCOPES = ("llm", "all")
STAGES = ("vision", "projector", "llm", "lm_head")
SCOPE_STAGES = {"llm": ("llm", "lm_head"), "all": STAGES}
LM_HEAD_TOKENS = ("all", "last")


@dataclass(frozen=True)
class Op:
    """One operation of the prefill.

    `macs` counts matrix-type multiply-accumulates (0 for elementwise ops); `viewer_ops`
    is what LLM-Viewer counts; the element counts turn into bytes once bit widths are known.
    """

    stage: str
    layer: int | None
    name: str
    macs: int = 0
    viewer_ops: int = 0
    weight_elems: int = 0
    act_load: int = 0
    act_store: int = 0
    kv_load: int = 0
    kv_store: int = 0


def _linear(stage: str, layer: int | None, name: str, b: int, n: int, ic: int, oc: int, *,
            to_kv: bool = False) -> Op:
    macs = b * n * ic * oc
    return Op(stage, layer, name, macs=macs, viewer_ops=2 * macs, weight_elems=ic * oc, act_load=ic * b * n,
              act_store=0 if to_kv else oc * b * n, kv_store=oc * b * n if to_kv else 0)


def _elementwise(stage: str, layer: int | None, name: str, ops: int, load: int, store: int) -> Op:
    return Op(stage, layer, name, viewer_ops=ops, act_load=load, act_store=store)


def _attention_ops(stage: str, layer: int, b: int, n: int, heads: int, kv_heads: int, head_dim: int,
                   cached: bool, pairs: int | None = None) -> Iterator[Op]:
    """Scores, softmax and weighted values over n tokens (full square, as every counter does).

    In the decoder keys and values come from the KV cache; in the vision tower they are
    plain activations. `pairs`: the query-key pairs of all `b` items where attention runs
    in windows (Qwen2.5-VL), instead of b * n * n.
    """
    pairs = b * n * n if pairs is None else pairs
    macs = heads * pairs * head_dim
    kv = n * head_dim * b * kv_heads
    probs = heads * pairs
    # LLM-Viewer sizes the query load by the KV heads (a quirk kept for compatibility).
    keys = {"act_load": kv, "kv_load": kv} if cached else {"act_load": 2 * kv}
    values = {"act_load": probs, "kv_load": kv} if cached else {"act_load": probs + kv}
    yield Op(stage, layer, "qk", macs=macs, viewer_ops=2 * macs, act_store=probs, **keys)
    yield _elementwise(stage, layer, "softmax", 5 * probs, probs, probs)
    yield Op(stage, layer, "sv", macs=macs, viewer_ops=2 * macs, act_store=n * head_dim * b * heads, **values)


def decoder_layer_ops(arch: Architecture, layer: int, b: int, n_in: int, n_out: int) -> Iterator[Op]:
    """A LLaMA-style decoder layer: attention over n_in tokens, the FFN over n_out. A Gated DeltaNet
    layer (Qwen3.5's linear attention) replaces the attention with its own mixer, a sparse layer
    (Qwen3-VL-MoE's) the FFN with its router and the experts each token is routed to."""
    d = arch.decoder
    h = d.hidden
    s = "llm"
    yield _elementwise(s, layer, "input_norm", 7 * b * h * n_in, b * h * n_in, b * h * n_in)
    if d.full_attention(layer):
        yield from _self_attention_ops(arch, layer, b, n_in)
    else:
        yield from _delta_net_ops(arch, layer, b, n_in)
    yield _elementwise(s, layer, "attn_add", b * h * n_in, b * h * n_in, b * h * n_in)
    yield _elementwise(s, layer, "post_attn_norm", 7 * b * h * n_out, b * h * n_out, b * h * n_out)
    if d.sparse(layer):
        yield from _experts_ops(arch, layer, b, n_out)
    else:
        yield _linear(s, layer, "gate_proj", b, n_out, h, d.ffn)
        yield _linear(s, layer, "up_proj", b, n_out, h, d.ffn)
        # LLM-Viewer sizes the activation by h, not the FFN width (a known quirk, kept).
        yield _elementwise(s, layer, "mlp_act", 2 * b * h * n_out, 2 * b * h * n_out, b * h * n_out)
        yield _linear(s, layer, "down_proj", b, n_out, d.ffn, h)
    yield _elementwise(s, layer, "mlp_add", b * h * n_out, b * h * n_out, b * h * n_out)


def _self_attention_ops(arch: Architecture, layer: int, b: int, n: int) -> Iterator[Op]:
    """Grouped-query softmax attention over n tokens and the KV cache. Qwen3's per-head RMSNorms on q and k
    and Qwen3.5's output gate (q_proj gives the query and a gate of the same width; the attention output is
    multiplied by its sigmoid) are elementwise; rotary (partial or not) is too, and counted by none."""
    d = arch.decoder
    h, q_out, kv_out = d.hidden, d.heads * d.head_dim, d.kv_heads * d.head_dim
    s = "llm"
    yield _linear(s, layer, "q_proj", b, n, h, 2 * q_out if d.attn_output_gate else q_out)
    yield _linear(s, layer, "k_proj", b, n, h, kv_out, to_kv=True)
    yield _linear(s, layer, "v_proj", b, n, h, kv_out, to_kv=True)
    if d.qk_norm:
        yield _elementwise(s, layer, "q_norm", 7 * b * q_out * n, b * q_out * n, b * q_out * n)
        yield _elementwise(s, layer, "k_norm", 7 * b * kv_out * n, b * kv_out * n, b * kv_out * n)
    yield from _attention_ops(s, layer, b, n, d.heads, d.kv_heads, d.head_dim, cached=True)
    if d.attn_output_gate:
        yield _elementwise(s, layer, "attn_gate", 2 * b * q_out * n, 2 * b * q_out * n, b * q_out * n)
    yield _linear(s, layer, "o_proj", b, n, q_out, h)


# transformers' torch_chunk_gated_delta_rule (the prefill's delta rule) splits the sequence, padded to a
# multiple of it, into chunks of this many tokens.
DELTA_RULE_CHUNK = 64


def delta_rule_macs(arch: Architecture, b: int, n: int) -> int:
    """Multiply-accumulates of the chunked gated delta rule over n tokens (transformers'
    torch_chunk_gated_delta_rule), per value head, with the sequence padded to L tokens in chunks of C
    and key/value head widths dk/dv: inside every chunk k_beta.k^T and q.k^T (C x dk x C each), the two
    unit-lower triangular solves of the UT transform (C(C-1)/2 x (dv + dk)), then the scan over chunks
    reading and writing the fixed dk x dv state (three C x dk x dv products) and the chunk's own values
    (C x C x dv). Linear in tokens: no product grows with the sequence beyond its chunk."""
    linear = arch.decoder.linear
    assert linear is not None
    chunk, dk, dv = DELTA_RULE_CHUNK, linear.key_head_dim, linear.value_head_dim
    chunks = -(-n // chunk)
    padded = chunks * chunk
    per_head = padded * (2 * chunk * dk + 3 * dk * dv + chunk * dv) + chunks * chunk * (chunk - 1) // 2 * (dk + dv)
    return b * linear.value_heads * per_head


def _delta_net_ops(arch: Architecture, layer: int, b: int, n: int) -> Iterator[Op]:
    """A Gated DeltaNet layer (Qwen3.5's linear attention) over n tokens: q, k and v from one projection
    through a depthwise causal convolution (padded by kernel - 1 on both sides, the tail dropped: n + kernel - 1
    outputs computed), z, a and b projections, the chunked delta rule over a fixed state per value head,
    the RMSNorm gated by z, and out_proj. Nothing here is cached per token: the state replaces the KV cache."""
    d = arch.decoder
    linear = d.linear
    assert linear is not None
    h, s = d.hidden, "llm"
    conv, value = linear.conv_dim, linear.value_dim
    yield _linear(s, layer, "in_proj_qkv", b, n, h, conv)
    yield _linear(s, layer, "in_proj_z", b, n, h, value)
    yield _linear(s, layer, "in_proj_b", b, n, h, linear.value_heads)
    yield _linear(s, layer, "in_proj_a", b, n, h, linear.value_heads)
    conv_macs = b * (n + linear.conv_kernel - 1) * conv * linear.conv_kernel
    # A depthwise convolution: its few weights are loaded like activations (no linear shape to price).
    yield Op(s, layer, "conv1d", macs=conv_macs, viewer_ops=2 * conv_macs,
             act_load=b * n * conv + conv * linear.conv_kernel, act_store=b * n * conv)
    yield _elementwise(s, layer, "conv_act", 2 * b * n * conv, b * n * conv, b * n * conv)
    rule = delta_rule_macs(arch, b, n)
    state = b * linear.state_elems
    yield Op(s, layer, "delta_rule", macs=rule, viewer_ops=2 * rule,
             act_load=b * n * (conv + 2 * linear.value_heads), act_store=b * n * value + state)
    yield _elementwise(s, layer, "gated_norm", 9 * b * n * value, 2 * b * n * value, b * n * value)
    yield _linear(s, layer, "out_proj", b, n, value, h)


def _experts_ops(arch: Architecture, layer: int, b: int, n: int) -> Iterator[Op]:
    """A sparse FFN over n tokens: the router (hidden x experts), then every token through its top-k experts
    (gate and up fused, SiLU, down), weighted and summed. The matrix work follows the active experts
    (n x top_k token rows), whichever experts they are; the weights loaded are those of the experts the
    rows can reach (all of them once n x top_k reaches the expert count)."""
    d = arch.decoder
    moe = d.moe
    assert moe is not None
    h, s = d.hidden, "llm"
    rows = b * n * moe.top_k
    yield _linear(s, layer, "router", b, n, h, moe.experts)
    yield _elementwise(s, layer, "router_softmax", 5 * b * n * moe.experts, b * n * moe.experts, b * n * moe.top_k)
    # One expert's matrices carry the rows (a linear of rows x in x out, as a grouped matmul runs them); the
    # other reachable experts' weights are loaded beside them.
    yield _linear(s, layer, "experts_gate_up", 1, rows, h, 2 * moe.ffn)
    yield _elementwise(s, layer, "experts_act", 2 * rows * moe.ffn, 2 * rows * moe.ffn, rows * moe.ffn)
    yield _linear(s, layer, "experts_down", 1, rows, moe.ffn, h)
    reached = min(moe.experts, rows)
    yield Op(s, layer, "experts_weights", weight_elems=(reached - 1) * 3 * h * moe.ffn)
    yield _elementwise(s, layer, "experts_combine", 2 * rows * h, rows * h, b * n * h)


def deepstack_merger_ops(arch: Architecture, plan: TokenPlan, batch: int) -> list[Op]:
    """Qwen3-VL's DeepStack mergers: one per tapped tower layer (LayerNorm over the merged width, then the
    projector's two linears) over the merge groups present at that layer (a method in the tower removes
    groups before the later taps)."""
    v = arch.vision
    merged = v.hidden * v.merge
    ops: list[Op] = []
    for k, tap in enumerate(arch.deepstack_layers):
        groups = batch * plan.vision_items * ((plan.vision[tap][1] - int(v.has_cls)) // v.merge)
        ops.append(_elementwise("projector", None, f"deepstack_{k}_norm", 7 * groups * merged, groups * merged,
                                groups * merged))
        for j, (ic, oc) in enumerate(arch.projector.linears):
            ops.append(_linear("projector", None, f"deepstack_{k}_linear_{j + 1}", 1, groups, ic, oc))
    return ops


def deepstack_add_op(arch: Architecture, plan: TokenPlan, layer: int, batch: int) -> Op:
    """The k-th DeepStack merger's features added to the visual positions of decoder layer k's output
    (elementwise: no MACs), at the visual tokens that layer hands on."""
    visual = batch * (plan.llm_visual[layer][1] if plan.llm_visual else plan.llm_visual_tokens)
    width = arch.decoder.hidden
    return _elementwise("llm", layer, "deepstack_add", visual * width, 2 * visual * width, visual * width)


def vision_layer_ops(arch: Architecture, layer: int, b: int, n_in: int, n_out: int,
                     pairs: int | None = None) -> Iterator[Op]:
    """A pre-norm ViT layer (CLIP or Qwen2-VL's), biased linears and a 2-matrix GELU MLP; Qwen2.5-VL's
    has a gated 3-matrix SiLU MLP, and `pairs` query-key pairs where it attends within windows."""
    v = arch.vision
    h, s = v.hidden, "vision"
    yield _elementwise(s, layer, "norm1", 7 * b * h * n_in, b * h * n_in, b * h * n_in)
    for name in ("q_proj", "k_proj", "v_proj"):
        yield _linear(s, layer, name, b, n_in, h, h)
    yield from _attention_ops(s, layer, b, n_in, v.heads, v.heads, h // v.heads, cached=False, pairs=pairs)
    yield _linear(s, layer, "o_proj", b, n_in, h, h)
    if v.kind == "internvl":  # InternViT's layer scale (lambda_1) before the residual
        yield _elementwise(s, layer, "layer_scale_1", b * h * n_in, b * h * n_in, b * h * n_in)
    yield _elementwise(s, layer, "attn_add", b * h * n_in, b * h * n_in, b * h * n_in)
    yield _elementwise(s, layer, "norm2", 7 * b * h * n_out, b * h * n_out, b * h * n_out)
    if v.gated_mlp:  # SwiGLU (Qwen2.5-VL's tower)
        yield _linear(s, layer, "gate_proj", b, n_out, h, v.ffn)
        yield _linear(s, layer, "up_proj", b, n_out, h, v.ffn)
        yield _elementwise(s, layer, "mlp_act", 2 * b * v.ffn * n_out, 2 * b * v.ffn * n_out, b * v.ffn * n_out)
        yield _linear(s, layer, "down_proj", b, n_out, v.ffn, h)
        yield _elementwise(s, layer, "mlp_add", b * h * n_out, b * h * n_out, b * h * n_out)
        return
    yield _linear(s, layer, "fc1", b, n_out, h, v.ffn)
    yield _elementwise(s, layer, "mlp_act", 2 * b * v.ffn * n_out, b * v.ffn * n_out, b * v.ffn * n_out)
    yield _linear(s, layer, "fc2", b, n_out, v.ffn, h)
    if v.kind == "internvl":  # and lambda_2 before the second residual
        yield _elementwise(s, layer, "layer_scale_2", b * h * n_out, b * h * n_out, b * h * n_out)
    yield _elementwise(s, layer, "mlp_add", b * h * n_out, b * h * n_out, b * h * n_out)


# Bilinear interpolation: every output value weighs 4 inputs (fvcore's own upsample handle counts 4 per
# output element). Not matrix work, so the flops and macs conventions count none of it.
BILINEAR_OPS_PER_OUTPUT = 4


def resampling_ops(arch: Architecture, batch: int) -> list[Op]:
    """LLaVA-OneVision's bilinear resampling of the projected features (elementwise: no MACs, counted in
    ops and memory traffic): every video frame's 2x2 pooling, or an image's anyres_max_N downscale."""
    width = arch.decoder.hidden
    if arch.pooled_frames is not None:
        frames, pooled = arch.pooled_frames
        inputs, outputs = frames * arch.vision.patches, frames * pooled
        name = "video_pooling"
    elif arch.post_projector_drops:
        outputs = arch.visual_tokens - arch.vision.patches - arch.newline_tokens
        inputs, name = outputs + arch.post_projector_drops, "anyres_downscale"
    else:
        return []
    outputs, inputs = batch * outputs * width, batch * inputs * width
    return [_elementwise("projector", None, name, BILINEAR_OPS_PER_OUTPUT * outputs, inputs, outputs)]


# A budget search or a table of many rows asks for the same layers at the same token counts again and again
# (about 30 us each); the ops are frozen records, so one tuple serves every plan that asks.
@functools.lru_cache(maxsize=1 << 16)
def _decoder_layer(arch: Architecture, layer: int, b: int, n_in: int, n_out: int) -> tuple[Op, ...]:
    return tuple(decoder_layer_ops(arch, layer, b, n_in, n_out))


@functools.lru_cache(maxsize=1 << 16)
def _vision_layer(arch: Architecture, layer: int, b: int, n_in: int, n_out: int,
                  pairs: int | None) -> tuple[Op, ...]:
    return tuple(vision_layer_ops(arch, layer, b, n_in, n_out, pairs))


def model_ops(arch: Architecture, plan: TokenPlan, *, batch: int = 1, lm_head_tokens: str = "all") -> list[Op]:
    """Every op of one prefill of `batch` samples (one image or video each) under `plan`."""
    if lm_head_tokens not in LM_HEAD_TOKENS:
        raise FicocoError(f"unknown LM-head mode '{lm_head_tokens}': choose from {', '.join(LM_HEAD_TOKENS)}")
    v, d = arch.vision, arch.decoder
    items = batch * plan.vision_items
    ops: list[Op] = []
    patch_in = v.channels * v.temporal_patch * v.patch_size**2
    ops.append(_linear("vision", None, "patch_embed", items, v.patches, patch_in, v.hidden))
    if v.kind == "qwen3_vl":
        # The learned position grid resampled bilinearly to every item's grid and added (elementwise).
        elems = items * v.patches * v.hidden
        ops.append(_elementwise("vision", None, "position_interpolation", (BILINEAR_OPS_PER_OUTPUT + 1) * elems,
                                (BILINEAR_OPS_PER_OUTPUT + 1) * elems, elems))
    for layer, (n_in, n_out) in enumerate(plan.vision):
        ops.extend(_vision_layer(arch, layer, items, n_in, n_out, vision_attention_pairs(arch, plan, layer, items)))
    # The projector sees the visual tokens that reach the LLM, without LLaVA-NeXT's newlines
    # (those are a learned vector, not projected) and before Qwen2-VL's merge is undone. It runs
    # before LLaVA-NeXT's unpadding, so it also projects the tokens unpadding drops (FiCoCo-V,
    # whose kept counts would depend on them, is refused where unpadding drops any).
    projected = batch * (plan.projector_tokens - arch.newline_tokens + arch.unpadding_drops
                         + arch.post_projector_drops)
    if v.kind == "internvl":
        # InternVL's pixel shuffle: a reshape of every tile's whole patch grid into tokens of merge x the width
        # (no multiply-accumulates; one copy, counted in memory traffic). It runs on the whole grid whatever a
        # method keeps: the adapter puts FiCoCo-V's kept groups back on it, and the cuts act after it.
        moved = items * v.patches * v.hidden
        ops.append(_elementwise("projector", None, "pixel_shuffle", 0, moved, moved))
    if arch.projector.norm_dim:
        dim = arch.projector.norm_dim
        ops.append(_elementwise("projector", None, "norm", 7 * projected * v.merge * dim,
                                projected * v.merge * dim, projected * v.merge * dim))
    for k, (ic, oc) in enumerate(arch.projector.linears):
        ops.append(_linear("projector", None, f"linear_{k + 1}", 1, projected, ic, oc))
    ops.extend(resampling_ops(arch, batch))
    ops.extend(deepstack_merger_ops(arch, plan, batch))
    for layer, (n_in, n_out) in enumerate(plan.llm):
        ops.extend(_decoder_layer(arch, layer, batch, n_in, n_out))
        if layer < len(arch.deepstack_layers):
            ops.append(deepstack_add_op(arch, plan, layer, batch))
    final_tokens = plan.llm[-1][1] if plan.llm else plan.text_tokens + plan.llm_visual_tokens
    head_tokens = batch * (final_tokens if lm_head_tokens == "all" else 1)
    # LLM-Viewer adds the head once for one token at one op per MAC, and loads without batch.
    ops.append(Op("lm_head", None, "lm_head", macs=head_tokens * d.hidden * d.vocab,
                  viewer_ops=batch * d.hidden * d.vocab, weight_elems=d.hidden * d.vocab,
                  act_load=d.hidden, act_store=d.vocab))
    return ops


def vision_attention_pairs(arch: Architecture, plan: TokenPlan, layer: int, items: int) -> int | None:
    """Query-key pairs of all `items` in vision layer `layer` where the tower attends within windows
    (Qwen2.5-VL): what a run measured when the plan carries it, else the windows' estimate; None
    (a full square per item) elsewhere."""
    v = arch.vision
    if not v.windowed(layer):
        return None
    if plan.vision_attention_pairs:
        return plan.vision_attention_pairs[layer]
    units = (plan.vision[layer][0] - int(v.has_cls)) // v.merge
    return items * v.attention_pairs(layer, units)


def _paper_layer(n_in: int, n_out: int, dim: int, ffn: int, quadratic: bool = True) -> int:
    # 4nD^2 + 2n^2D + 2nDH, with the FFN on the tokens the layer keeps (reduction sits before it); a
    # linear-attention layer has no n^2 term.
    return 4 * n_in * dim * dim + (2 * n_in * n_in * dim if quadratic else 0) + 2 * n_out * dim * ffn


def formula_ffn(arch: Architecture, layer: int) -> int:
    """The FFN width the closed formulas (paper, visual-macs) use at decoder layer `layer`: the dense FFN, or
    at a sparse layer the active experts' (top-k x their width; the router has no term)."""
    d = arch.decoder
    return d.moe.top_k * d.moe.ffn if d.moe is not None and d.sparse(layer) else d.ffn


def paper_by_layer(arch: Architecture, plan: TokenPlan, *, batch: int = 1) -> list[tuple[str, int, int]]:
    """The `paper` convention per layer: (stage, layer, count), the appendix formula plus the
    method's overhead (its entry's `paper_overhead`) at reducing layers. It defines transformer layers only."""
    v, d = arch.vision, arch.decoder
    items = batch * plan.vision_items
    # The entry's overhead formula at its in-layer reductions (FiCoCo's appendix); methods without one
    # (ToMe reduces in-layer too) add none here: their own work is the accountant's method terms.
    spec = METHODS.get(plan.variant)
    overhead_of = spec.paper_overhead if spec is not None else None
    overhead = {(red.stage, red.layer): red for red in plan.reductions
                if red.where == "in_layer" and overhead_of is not None}
    rows: list[tuple[str, int, int]] = []
    for stage, layers, mult, dim in (("vision", plan.vision, items, v.hidden), ("llm", plan.llm, batch, d.hidden)):
        for layer, (n_in, n_out) in enumerate(layers):
            if stage == "vision":
                count = _paper_layer(n_in, n_out, dim, v.ffn)
            else:
                count = _paper_layer(n_in, n_out, dim, formula_ffn(arch, layer), d.full_attention(layer))
            red = overhead.get((stage, layer))
            if red:
                count += overhead_of(stage, red.visual_before, red.removed, dim)
            rows.append((stage, layer, mult * count))
    return rows


def visual_macs_by_layer(arch: Architecture, plan: TokenPlan, *, batch: int = 1) -> list[tuple[str, int, int]]:
    """The `visual-macs` convention per decoder layer: PDrop's and SparseVLM's tables count only
    the visual tokens n of every layer, `4nd^2 + 2n^2d + 3ndm` multiply-accumulates (SwiGLU: three
    FFN matrices); text tokens and the LM head are not counted. A layer that reduces inside
    (FiCoCo-L) runs its FFN on the tokens it keeps."""
    d = arch.decoder
    rows = []
    for layer, (n_in, n_out) in enumerate(plan.llm_visual):
        quadratic = 2 * n_in * n_in * d.hidden if d.full_attention(layer) else 0
        count = 4 * n_in * d.hidden**2 + quadratic + 3 * n_out * d.hidden * formula_ffn(arch, layer)
        rows.append(("llm", layer, batch * count))
    return rows


# How each convention counts the parts a LLaMA layer lacks (docs/accounting.md has the formulas): a sparse
# layer's experts, a Gated DeltaNet layer, Qwen3-VL's DeepStack. LLM-Viewer knows neither experts nor linear
# attention: its replay is named.
PART_TREATMENT: dict[str, dict[str, str]] = {
    "experts": {
        "flops": "sparse layers: the router and every token's top-k experts (the active ones), 2 FLOPs per MAC",
        "macs": "sparse layers: the router and every token's top-k experts (the active ones)",
        "llm-viewer": "sparse layers: LLM-Viewer has no MoE; the replay counts the router as a linear and the "
                      "active experts as FFNs over the n x top-k token rows, loading the experts those rows reach",
        "paper": "sparse layers: the formula's FFN term at the active experts' width (top-k x their width); the "
                 "router has no term",
        "visual-macs": "sparse layers: the FFN term at the active experts' width (top-k x their width); the "
                       "router has no term",
    },
    "linear_attention": {
        "flops": "Gated DeltaNet layers: projections, causal convolution and the chunked delta rule, linear in "
                 "tokens, 2 FLOPs per MAC",
        "macs": "Gated DeltaNet layers: projections, causal convolution and the chunked delta rule, linear in tokens",
        "llm-viewer": "Gated DeltaNet layers: LLM-Viewer has no linear attention; the replay counts the layer's "
                      "linears, convolution and delta rule at 2 ops per MAC and stores no KV cache there",
        "paper": "Gated DeltaNet layers: the formula without its n^2 attention term (4nD^2 + 2nDH)",
        "visual-macs": "Gated DeltaNet layers: no n^2 term (4nd^2 + 3ndm)",
    },
    "deepstack": {
        "flops": "DeepStack: every tap's merger in the projector stage; its additions elementwise (no FLOPs)",
        "macs": "DeepStack: every tap's merger in the projector stage; its additions elementwise (no MACs)",
        "llm-viewer": "DeepStack: the additions replayed as residual adds in the first decoder layers",
        "paper": "DeepStack: not in the formula (its mergers are outside the decoder's layers)",
        "visual-macs": "DeepStack: not counted (its mergers are outside the decoder's layers)",
    },
}


def convention_notes(arch: Architecture, convention: str) -> list[str]:
    """How `convention` counts the parts of `arch` a LLaMA layer lacks (none: an empty list)."""
    d = arch.decoder
    present = [("experts", d.moe is not None), ("linear_attention", d.full_attention_layers < d.layers),
               ("deepstack", bool(arch.deepstack_layers))]
    return [PART_TREATMENT[part][convention] for part, found in present if found]


def _op_count(op: Op, convention: str) -> int:
    if convention == "flops":
        return 2 * op.macs
    if convention == "macs":
        return op.macs
    # llm-viewer replays the decoder only
    return op.viewer_ops if op.stage in SCOPE_STAGES["llm"] else 0


def count_by_layer(arch: Architecture, plan: TokenPlan, ops: list[Op], convention: str, *,
                   batch: int = 1) -> list[tuple[str, int | None, int]]:
    """(stage, layer, count) for every layer and the layer-less parts (patch embedding,
    projector, LM head: layer None), in order of execution."""
    if convention == "paper":
        return [(s, layer, c) for s, layer, c in paper_by_layer(arch, plan, batch=batch)]
    if convention == "visual-macs":
        return [(s, layer, c) for s, layer, c in visual_macs_by_layer(arch, plan, batch=batch)]
    rows: dict[tuple[str, int | None], int] = {}
    for op in ops:
        key = (op.stage, op.layer)
        rows[key] = rows.get(key, 0) + _op_count(op, convention)
    return [(stage, layer, count) for (stage, layer), count in rows.items()]


def count_by_stage(arch: Architecture, plan: TokenPlan, ops: list[Op], convention: str, *,
                   batch: int = 1) -> dict[str, int]:
    """Counts per stage in `convention` (units: FLOPs, MACs, LLM-Viewer OPs, paper MACs)."""
    if convention not in CONVENTIONS:
        raise FicocoError(f"unknown convention '{convention}': choose from {', '.join(CONVENTIONS)}")
    totals = dict.fromkeys(STAGES, 0)
    for stage, _, count in count_by_layer(arch, plan, ops, convention, batch=batch):
        totals[stage] += count
    return totals


def check_scope(convention: str, scope: str) -> None:
    """Reject scopes a convention does not define."""
    if scope not in SCOPES:
        raise FicocoError(f"unknown scope '{scope}': choose from {', '.join(SCOPES)}")
    if convention in LLM_ONLY_CONVENTIONS and scope == "all":
        what = "replays" if convention == "llm-viewer" else "counts"
        raise FicocoError(f"the {convention} convention {what} the decoder only; use scope=llm with it")


def scope_total(by_stage: dict[str, int], scope: str) -> int:
    """The sum of the stages in `scope`."""
    return sum(by_stage[s] for s in SCOPE_STAGES[scope])
