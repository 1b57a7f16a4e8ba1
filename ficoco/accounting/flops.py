"""Operation records and the counting conventions built on them.

Every op of a prefill is one `Op` record (LLM-Viewer's habit: one record shape for all ops):
its matrix multiply-accumulates, its LLM-Viewer OPs, and the elements it loads and stores.
The conventions of docs/accounting.md are sums over these records, except `paper`, which is the
FiCoCo appendix's closed formula per layer.
"""

from __future__ import annotations

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
    """A LLaMA-style decoder layer: attention over n_in tokens, the FFN over n_out."""
    d = arch.decoder
    h, q_out, kv_out = d.hidden, d.heads * d.head_dim, d.kv_heads * d.head_dim
    s = "llm"
    yield _elementwise(s, layer, "input_norm", 7 * b * h * n_in, b * h * n_in, b * h * n_in)
    yield _linear(s, layer, "q_proj", b, n_in, h, q_out)
    yield _linear(s, layer, "k_proj", b, n_in, h, kv_out, to_kv=True)
    yield _linear(s, layer, "v_proj", b, n_in, h, kv_out, to_kv=True)
    yield from _attention_ops(s, layer, b, n_in, d.heads, d.kv_heads, d.head_dim, cached=True)
    yield _linear(s, layer, "o_proj", b, n_in, q_out, h)
    yield _elementwise(s, layer, "attn_add", b * h * n_in, b * h * n_in, b * h * n_in)
    yield _elementwise(s, layer, "post_attn_norm", 7 * b * h * n_out, b * h * n_out, b * h * n_out)
    yield _linear(s, layer, "gate_proj", b, n_out, h, d.ffn)
    yield _linear(s, layer, "up_proj", b, n_out, h, d.ffn)
    # LLM-Viewer sizes the activation by h, not the FFN width (a known quirk, kept).
    yield _elementwise(s, layer, "mlp_act", 2 * b * h * n_out, 2 * b * h * n_out, b * h * n_out)
    yield _linear(s, layer, "down_proj", b, n_out, d.ffn, h)
    yield _elementwise(s, layer, "mlp_add", b * h * n_out, b * h * n_out, b * h * n_out)


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


def model_ops(arch: Architecture, plan: TokenPlan, *, batch: int = 1, lm_head_tokens: str = "all") -> list[Op]:
    """Every op of one prefill of `batch` samples (one image or video each) under `plan`."""
    if lm_head_tokens not in LM_HEAD_TOKENS:
        raise FicocoError(f"unknown LM-head mode '{lm_head_tokens}': choose from {', '.join(LM_HEAD_TOKENS)}")
    v, d = arch.vision, arch.decoder
    items = batch * plan.vision_items
    ops: list[Op] = []
    patch_in = v.channels * v.temporal_patch * v.patch_size**2
    ops.append(_linear("vision", None, "patch_embed", items, v.patches, patch_in, v.hidden))
    for layer, (n_in, n_out) in enumerate(plan.vision):
        ops.extend(vision_layer_ops(arch, layer, items, n_in, n_out, vision_attention_pairs(arch, plan, layer, items)))
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
    for layer, (n_in, n_out) in enumerate(plan.llm):
        ops.extend(decoder_layer_ops(arch, layer, batch, n_in, n_out))
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


def _paper_layer(n_in: int, n_out: int, dim: int, ffn: int) -> int:
    # 4nD^2 + 2n^2D + 2nDH, with the FFN on the tokens the layer keeps (reduction sits before it).
    return 4 * n_in * dim * dim + 2 * n_in * n_in * dim + 2 * n_out * dim * ffn


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
    for stage, layers, mult, dim, ffn in (("vision", plan.vision, items, v.hidden, v.ffn),
                                          ("llm", plan.llm, batch, d.hidden, d.ffn)):
        for layer, (n_in, n_out) in enumerate(layers):
            count = _paper_layer(n_in, n_out, dim, ffn)
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
        count = 4 * n_in * d.hidden**2 + 2 * n_in * n_in * d.hidden + 3 * n_out * d.hidden * d.ffn
        rows.append(("llm", layer, batch * count))
    return rows


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
