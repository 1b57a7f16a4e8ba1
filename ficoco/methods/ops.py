"""Token operations several methods share, on whole batches (``(B, N, ...)`` tensors, ``long``
``(B, K)`` indices into dimension 1): gather and select tokens, the token-adaptive weighted merge
(FiCoCo's compress), top-k with a fixed tie rule, attention rows recomputed from q and k, a sequence
rebuilt around its kept visual tokens, and the scores the methods before the LLM read from a tower
layer ([CLS] attention, or FiCoCo's equivalent token on towers without [CLS]).

A method's own tensor functions live in its folder (``ficoco/methods/<name>/ops.py``); what two or
more of them use lives here. ``r`` (how many tokens leave) is the same for every sample so that all
shapes stay rectangular. A sample's visual span is ``[visual_start[b], visual_start[b] + N)``: it may
start anywhere (left padding, different prompts) but holds the same ``N`` tokens in every sample,
and with left padding the last prompt token is position ``T - 1`` in every sample.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ficoco.errors import FicocoError
from ficoco.methods.inputs import Reduced, TowerInput
from ficoco.methods.reads import DEFAULT_ATTENTION_SCORES, check_attention_scores


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype to do score, quantile and merge arithmetic in for inputs of ``dtype``.

    Half-precision inputs are promoted to float32 (bf16 has 8 bits of mantissa, too few for
    quantiles over near-equal attention values); float64 inputs stay float64.
    """
    return torch.promote_types(dtype, torch.float32)


def gather_tokens(x: Tensor, index: Tensor) -> Tensor:
    """Pick tokens along dimension 1 of ``x`` for every sample.

    Args:
        x: ``(B, N, ...)``; any number of trailing dimensions.
        index: ``(B, K)`` long indices into dimension 1 of ``x``.

    Returns:
        ``(B, K, ...)`` where ``out[b, k] = x[b, index[b, k]]``.
    """
    if index.dim() != 2 or index.shape[0] != x.shape[0]:
        raise ValueError(f"index must be (B, K) with B = {x.shape[0]}, got shape {tuple(index.shape)}")
    return pick_rows(x, index)


def pick_rows(x: Tensor, index: Tensor) -> Tensor:
    """``x[b, index[b]]`` for every sample: (B, N, ...) and (B, K) -> (B, K, ...), copying whole rows.

    One sample (a prefill's usual batch) takes index_select, which copies rows by their strides: 2-3 times
    faster than advanced indexing on a CPU (576 of 640 bf16 rows of 4,096: 0.24 against 0.54 ms), also on a
    strided view such as (B, T, heads, d) queries. torch.gather with an expanded index walks every element
    and is several times slower still."""
    if x.shape[0] == 1 and index.device == x.device:
        return x[0].index_select(0, index[0]).unsqueeze(0)
    batch = torch.arange(x.shape[0], device=index.device).unsqueeze(1)
    return x[batch, index]


def visual_positions(visual_start: Tensor, num_visual: int) -> Tensor:
    """``(B, N)`` sequence positions of every sample's contiguous visual span."""
    return visual_start.to(torch.long).unsqueeze(1) + torch.arange(num_visual, device=visual_start.device)


def gather_block(matrix: Tensor, rows: Tensor, cols: Tensor) -> Tensor:
    """Pick a sub-matrix ``matrix[b, rows[b]][:, cols[b]]`` for every sample.

    Args:
        matrix: ``(B, X, Y)``.
        rows: ``(B, R)`` long indices into dimension 1.
        cols: ``(B, C)`` long indices into dimension 2.

    Returns:
        ``(B, R, C)``. Only the selected rows are read, so rows the caller never asks for
        may hold anything.
    """
    batch = torch.arange(matrix.shape[0], device=rows.device).view(-1, 1, 1)
    return matrix[batch, rows.unsqueeze(2), cols.unsqueeze(1)]


def select(scores: Tensor, r: int) -> tuple[Tensor, Tensor]:
    """Split tokens into the ``r`` most redundant (source) and the rest (target).

    Args:
        scores: ``(B, N)`` redundancy scores; higher means more redundant.
        r: how many tokens to discard, ``0 <= r <= N``.

    Returns:
        ``(source, target)``: long tensors ``(B, r)`` and ``(B, N - r)``, each sorted
        ascending so that kept tokens stay in their original order. Equal scores are
        broken lowest index first (a stable descending sort, unlike ``topk``, whose order
        among ties is unspecified).
    """
    if scores.dim() != 2:
        raise ValueError(f"scores must be (B, N), got shape {tuple(scores.shape)}")
    num_tokens = scores.shape[1]
    if not 0 <= r <= num_tokens:
        raise FicocoError(f"r must be between 0 and the token count {num_tokens}, got {r}")
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices
    source = torch.sort(order[:, :r], dim=1).values
    target = torch.sort(order[:, r:], dim=1).values
    return source, target


def adaptive_weights(correlation: Tensor, eps: float) -> Tensor:
    """Token-adaptive K: each discarded token spreads its weight over its top kept tokens.

    For row ``i`` (a discarded token) ``tau_i = quantile(C[i, :], eps)`` with linear
    interpolation; ``J_i = {j : C[i, j] >= tau_i}`` and
    ``alpha[i, j] = C[i, j] / sum_{j' in J_i} C[i, j']`` on ``J_i``, 0 elsewhere.

    The row maximum is always in ``J_i`` (added explicitly, so that rounding in the
    interpolation can never empty the set). When the selected sum of a row is not positive
    (an all-zero row, e.g. a discarded token whose every kept partner lies after it under a
    causal mask and no text token looks at it), the row falls back to uniform weights over
    ``J_i`` instead of dividing by zero; every row of the result therefore sums to 1.

    Args:
        correlation: ``(B, r, Nt)`` non-negative correlations, ``Nt >= 1``.
        eps: quantile level in ``[0, 1]``; higher keeps fewer partners.

    Returns:
        ``(B, r, Nt)`` weights in the compute dtype (float32 for half inputs).
    """
    if correlation.dim() != 3:
        raise ValueError(f"correlation must be (B, r, Nt), got shape {tuple(correlation.shape)}")
    if not 0.0 <= eps <= 1.0:
        raise FicocoError(f"eps is a quantile level and must lie in [0, 1], got {eps}")
    if correlation.shape[2] == 0:
        raise ValueError("correlation has no kept tokens to merge into (Nt = 0)")
    c = correlation.to(compute_dtype(correlation.dtype))
    if c.shape[1] == 0:
        return c.clone()
    tau = torch.quantile(c, eps, dim=2, keepdim=True, interpolation="linear")
    row_max = c.amax(dim=2, keepdim=True)
    chosen = (c >= tau) | (c == row_max)
    chosen_c = torch.where(chosen, c, torch.zeros_like(c))
    chosen_sum = chosen_c.sum(dim=2, keepdim=True)
    uniform = chosen.to(c.dtype) / chosen.sum(dim=2, keepdim=True).to(c.dtype)
    degenerate = chosen_sum <= 0
    proportional = chosen_c / torch.where(degenerate, torch.ones_like(chosen_sum), chosen_sum)
    return torch.where(degenerate, uniform, proportional)


def main_targets(alpha: Tensor) -> Tensor:
    """For every discarded token, the column of the kept token that receives its largest weight.

    With the default quantile (eps = 0.998) a discarded token feeds exactly one kept token below
    ~500 kept tokens, so this is where it went; beyond that it names the largest of its few
    partners. Pictures and reports use it (it costs one argmax, no host synchronisation).

    Args:
        alpha: ``(B, r, N - r)`` weights from :func:`adaptive_weights`.

    Returns:
        ``(B, r)`` long column indices into the kept tokens (ties: the lowest column).
    """
    return alpha.argmax(dim=2)


def compress(tokens: Tensor, source: Tensor, target: Tensor, alpha: Tensor) -> Tensor:
    """Self-preserving compress: fold the source tokens into the targets, keep the targets.

    ``X_j <- (X_j + sum_i alpha[i, j] X_i) / (1 + sum_i alpha[i, j])`` for every target
    ``j``: a weighted mean in which the kept token's own weight (1) is at least any single
    source's weight (``alpha <= 1``). A target that receives nothing is returned bit for bit
    unchanged.

    Args:
        tokens: ``(B, N, D)`` hidden states of the tokens being reduced.
        source: ``(B, r)`` indices of the discarded tokens.
        target: ``(B, N - r)`` indices of the kept tokens, in output order.
        alpha: ``(B, r, N - r)`` weights; row ``i`` belongs to ``source[:, i]``, column ``j``
            to ``target[:, j]``.

    Returns:
        ``(B, N - r, D)`` merged kept tokens in ``target`` order, in the dtype of ``tokens``
        (accumulated in float32 or wider).
    """
    expected = (tokens.shape[0], source.shape[1], target.shape[1])
    if tuple(alpha.shape) != expected:
        raise ValueError(f"alpha must be (B, r, N - r) = {expected}, got {tuple(alpha.shape)}")
    work_dtype = compute_dtype(tokens.dtype)
    discarded = gather_tokens(tokens, source).to(work_dtype)
    kept = gather_tokens(tokens, target)
    weights = alpha.to(work_dtype)
    recorded = torch.is_grad_enabled() and (tokens.requires_grad or alpha.requires_grad)
    if SPARSE_MERGES_ON_CPU and tokens.device.type == "cpu" and not recorded and not watched():
        return _compress_receivers(kept, discarded, weights)
    # (kept + received) / (1 + weight) in the work dtype, in place on the product and rounded once into the
    # tokens' dtype: the same values as converting the kept tokens first, with two passes fewer over them
    # (they are most of the tensor, and wide where other features ride with them).
    merged = weights.transpose(1, 2) @ discarded
    merged.add_(kept)
    denominator = 1.0 + weights.sum(dim=1).unsqueeze(-1)
    if torch.is_grad_enabled() and (merged.requires_grad or denominator.requires_grad):
        # Autograd records no `out=` op (a loss through the merge, or a model whose weights require grad).
        return (merged / denominator).to(tokens.dtype)
    return torch.div(merged, denominator, out=torch.empty_like(kept))


def official_targets(correlation: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """FiCoCo's official codes' token-adaptive K (kawhiiiileo/FiCoCo at 8995e93, FiCoCo_L.py:106-116 and
    FiCoCo_V.py:131-141), the targets of ``rule="official"``: each discarded token's row of the correlation over
    every candidate target; ``tau = quantile(row, eps)``; ``K`` is the most entries strictly above ``tau`` of any
    row of the sample; a row's targets are the ``K`` largest of ``softmax(row)``, weighted by those probabilities
    over their sum. The paper's rule (`adaptive_weights`) weighs the correlations themselves, over the kept tokens
    alone and each row by its own count.

    Args:
        correlation: ``(B, r, C)`` rows of the discarded tokens over the ``C`` candidates (an entry that may not be
            chosen, a token's own, is -inf).
        eps: quantile level in ``[0, 1]``.

    Returns:
        ``(targets, weights)``: ``(B, r, K)`` candidate indices, largest probability first, and their weights in
        float32 (zero beyond a sample's own ``K``; ``K`` is the most of any sample: one host synchronisation, as
        the official code's ``.item()``). A sample whose ``K`` is 0 (every row's top tied) merges nothing.
    """
    if correlation.dim() != 3:
        raise ValueError(f"correlation must be (B, r, C), got shape {tuple(correlation.shape)}")
    if not 0.0 <= eps <= 1.0:
        raise FicocoError(f"eps is a quantile level and must lie in [0, 1], got {eps}")
    rows = correlation.float()
    batch, count, _ = rows.shape
    if count == 0:
        empty = torch.zeros(batch, 0, 0, device=rows.device)
        return empty.long(), empty
    tau = torch.quantile(rows, eps, dim=2, keepdim=True, interpolation="linear")
    per_sample = (rows > tau).sum(dim=2).amax(dim=1)  # (B,) the sample's K
    most = int(per_sample.max())
    values, targets = torch.softmax(rows, dim=2).topk(most, dim=2)
    live = torch.arange(most, device=rows.device).view(1, 1, -1) < per_sample.view(-1, 1, 1)
    values = torch.where(live, values, torch.zeros_like(values))
    total = values.sum(dim=2, keepdim=True)
    weights = values / torch.where(total > 0, total, torch.ones_like(total))
    return targets, weights


# On a CPU, `compress` (and ToMe's merge) computes only the kept tokens that receive something
# (`_compress_receivers`), which asks the host which ones; on other devices it stays dense and never asks.
# False: dense everywhere.
SPARSE_MERGES_ON_CPU = True


def watched() -> bool:
    """Whether something counts the ops: torch.jit's tracer (fvcore), or a dispatch mode (torch's FLOP counter in
    `flops --verify`, the host-question counter of the tests). They count the dense form, the one the accountant
    prices and every device runs, so it runs then. A mode that says it counts nothing (``counts_ops = False``: a
    profile's record of which kernels ran) does not count."""
    if torch.jit.is_tracing():
        return True
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    return any(getattr(mode, "counts_ops", True) for mode in _get_current_dispatch_mode_stack())


def _compress_receivers(kept: Tensor, discarded: Tensor, weights: Tensor) -> Tensor:
    """`compress` computed only at the kept tokens that receive anything (any sample's weight above zero): the
    others are their own value over 1, bit for bit. With FiCoCo's quantile a discarded token feeds one or a few
    kept tokens, so this is a few rows where the dense form makes four passes over every kept token (the
    product, the sum, the division, the rounding). It asks the host which tokens receive: on a CPU only."""
    receivers = torch.nonzero(weights.sum(dim=(0, 1)) > 0).squeeze(1)
    if receivers.numel() == 0:
        return kept
    part = weights[:, :, receivers]
    received = part.transpose(1, 2) @ discarded
    received.add_(kept[:, receivers])
    received.div_(1.0 + part.sum(dim=1).unsqueeze(-1))
    kept[:, receivers] = received.to(kept.dtype)  # kept is the gather's own copy: written in place
    return kept


# ---- in the LLM: a span of visual tokens, attention rows, the rebuilt sequence ----------------------------

def check_span(hidden: Tensor, visual_start: Tensor, num_visual: int) -> None:
    """Shapes of a batched call: hidden ``(B, T, D)``, ``visual_start`` ``(B,)``, ``0 < N <= T``."""
    if hidden.dim() != 3:
        raise ValueError(f"hidden must be (B, T, D), got shape {tuple(hidden.shape)}")
    if tuple(visual_start.shape) != (hidden.shape[0],):
        raise ValueError(f"visual_start must be (B,) = ({hidden.shape[0]},), got {tuple(visual_start.shape)}")
    if not 0 < num_visual <= hidden.shape[1]:
        raise ValueError(f"num_visual must be between 1 and the sequence length {hidden.shape[1]}, got {num_visual}")


def top_indices(scores: Tensor, k: int) -> Tensor:
    """``(B, k)`` indices of the ``k`` highest scores, returned ascending (original order).

    Equal scores are taken lowest index first (a stable descending sort): ``torch.topk``, which
    the official codes call, leaves the order among ties unspecified, so the two agree wherever
    the scores differ.
    """
    if not 0 <= k <= scores.shape[1]:
        raise FicocoError(f"cannot keep {k} of {scores.shape[1]} tokens")
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :k]
    return torch.sort(order, dim=1).values


def _logits(query_rows: Tensor, keys: Tensor, scale: float, scores: str) -> Tensor:
    """(B, H, M, T) the scores of query rows (B, H, M, d) over keys (B, H_kv, T, d) (grouped heads shared),
    in the rule `scores` names (ficoco.methods.reads): ``"model"``, as the model's eager attention computes
    them (the product, then the scale, in the model's dtype); ``"float32"``, in float32."""
    heads, kv_heads = query_rows.shape[1], keys.shape[1]
    if heads % kv_heads:
        raise ValueError(f"query heads {heads} are not a multiple of key heads {kv_heads}")
    check_attention_scores(scores)
    if scores == "model":
        k = keys.repeat_interleave(heads // kv_heads, dim=1)
        return torch.matmul(query_rows, k.transpose(-1, -2)) * scale
    dtype = compute_dtype(query_rows.dtype)
    k = keys.to(dtype).repeat_interleave(heads // kv_heads, dim=1)
    return torch.matmul(query_rows.to(dtype), k.transpose(-1, -2)) * scale


def _probabilities(logits: Tensor) -> Tensor:
    """The softmax over the keys, computed in float32 (as eager does; a half-precision rule's result rounded
    to its dtype, as eager returns it), in float32 or wider."""
    return torch.softmax(logits, dim=-1).to(compute_dtype(logits.dtype))


def last_row_attention(query: Tensor, keys: Tensor, key_mask: Tensor | None = None,
                       scale: float | None = None, scores: str = DEFAULT_ATTENTION_SCORES) -> Tensor:
    """Softmax probabilities of one query row per sample over all keys, per head.

    This is the probe FastV and PDrop need (the last prompt token's attention row), computed
    from post-RoPE q and k so that the layer itself keeps running SDPA. The causal mask hides
    nothing from the last row; padding keys are masked.

    Args:
        query: ``(B, H, d)`` the row's query, post-RoPE.
        keys: ``(B, H_kv, T, d)`` post-RoPE keys; ``H`` must be a multiple of ``H_kv`` (GQA).
        key_mask: ``(B, T)`` bool or 0/1, True on real tokens; None: all real.
        scale: logit scale, ``1 / sqrt(d)`` by default.
        scores: the rule the scores are computed by (ficoco.methods.reads): the model's eager rule, or float32.

    Returns:
        ``(B, H, T)`` probabilities in float32 (or wider).
    """
    dim = query.shape[-1]
    logits = _logits(query.unsqueeze(2), keys, dim**-0.5 if scale is None else scale, scores).squeeze(2)
    if key_mask is not None:
        logits = logits.masked_fill(~key_mask.to(torch.bool).unsqueeze(1), float("-inf"))
    return _probabilities(logits)


def rows_attention(query_rows: Tensor, keys: Tensor, visible: Tensor, scale: float | None = None,
                   scores: str = DEFAULT_ATTENTION_SCORES) -> Tensor:
    """Head-mean softmax probabilities of some query rows over all keys (SparseVLM's rater rows).

    Args:
        query_rows: ``(B, H, M, d)`` the rows' queries, post-RoPE.
        keys: ``(B, H_kv, T, d)`` post-RoPE keys (GQA: ``H`` a multiple of ``H_kv``).
        visible: ``(B, M, T)`` bool, True where row ``m`` may attend key ``t`` (causal and padding).
        scale: logit scale, ``1 / sqrt(d)`` by default.
        scores: the rule the scores are computed by (ficoco.methods.reads).

    Returns:
        ``(B, M, T)`` float32 (or wider) probabilities averaged over heads; a row with no
        visible key (a padding row) is all zeros.
    """
    dim = query_rows.shape[-1]
    logits = _logits(query_rows, keys, dim**-0.5 if scale is None else scale, scores)
    logits = logits.masked_fill(~visible.unsqueeze(1), float("-inf"))
    return torch.nan_to_num(_probabilities(logits)).mean(dim=1)


def rebuild(hidden: Tensor, kept_visual: Tensor, visual_start: Tensor, num_visual: int, position_ids: Tensor,
            positions: str, attention_mask: Tensor | None = None, added: Tensor | None = None) -> Reduced:
    """The sequence ``[prefix, kept visual (original order), added, suffix]`` of every sample.

    Args:
        hidden: ``(B, T, D)``.
        kept_visual: ``(B, k)`` ascending indices within the span of the tokens that stay.
        visual_start: ``(B,)``; num_visual: ``N``.
        position_ids: ``(B, T)`` the input's position ids.
        positions: ``"original"`` (FastV, DART) or ``"compact"`` (PDrop, SparseVLM).
        attention_mask: optional ``(B, T)`` 2-D padding mask.
        added: optional ``(B, C, D)`` tokens placed right after the kept visual tokens.

    Returns:
        A :class:`Reduced`. Kept tokens are copied bit for bit.
    """
    if positions not in ("original", "compact"):
        raise ValueError(f"unknown position scheme {positions!r}")
    batch, seq_len, _ = hidden.shape
    device = hidden.device
    kept = kept_visual.shape[1]
    extra = 0 if added is None else added.shape[1]
    start = visual_start.to(device=device, dtype=torch.long).unsqueeze(1)
    removed = num_visual - kept
    out_len = seq_len - removed + extra
    slot = torch.arange(out_len, device=device).unsqueeze(0)
    # Output slot -> input position: prefix as is; kept visual via kept_visual; added: -1; suffix shifted.
    in_prefix = slot < start
    in_kept = (slot >= start) & (slot < start + kept)
    in_added = (slot >= start + kept) & (slot < start + kept + extra)
    kept_index = (slot - start).clamp(0, max(kept - 1, 0))
    from_kept = start + torch.gather(kept_visual.to(torch.long), 1, kept_index) if kept else slot
    from_suffix = (slot + removed - extra).expand(batch, -1)
    source = torch.where(in_prefix, slot, torch.where(in_kept, from_kept, from_suffix))
    source = torch.where(in_added, torch.full_like(source, -1), source)
    gathered = gather_tokens(hidden, source.clamp(min=0))
    if extra:
        added_index = (slot - start - kept).clamp(0, extra - 1)
        placed = gather_tokens(added.to(hidden.dtype), added_index)
        gathered = torch.where(in_added.unsqueeze(-1), placed, gathered)
    if positions == "original":
        if extra:
            raise ValueError("added tokens have no original position; use the compact scheme")
        new_positions = torch.gather(position_ids, 1, source)
    else:
        first = torch.gather(position_ids, 1, start)
        span_positions = first + (slot - start)
        suffix_positions = torch.gather(position_ids, 1, from_suffix.clamp(max=seq_len - 1)) - (removed - extra)
        prefix_positions = torch.gather(position_ids, 1, slot.clamp(max=seq_len - 1).expand(batch, -1))
        new_positions = torch.where(in_prefix, prefix_positions,
                                    torch.where(in_kept | in_added, span_positions, suffix_positions))
    mask = None
    if attention_mask is not None:
        mask = torch.gather(attention_mask, 1, source.clamp(min=0))
        mask = torch.where(in_added, torch.ones_like(mask), mask)
    return Reduced(hidden=gathered, kept_positions=source, position_ids=new_positions, attention_mask=mask,
                   kept_visual=kept_visual, num_visual=kept + extra)


def last_row_scores(row_attention: Tensor, visual_start: Tensor, num_visual: int) -> Tensor:
    """Each image token's score: the head-mean attention the last prompt token gives it (FastV's
    rule, which PDrop and HoliTom use too).

    Args:
        row_attention: ``(B, H, T)`` per-head probabilities of the last row (from
            `last_row_attention`), or ``(B, T)`` already averaged over heads.
        visual_start: ``(B,)`` first image position of every sample.
        num_visual: ``N`` image tokens per sample.

    Returns:
        ``(B, N)``; higher means more important (kept first).
    """
    row = row_attention.mean(dim=1) if row_attention.dim() == 3 else row_attention
    columns = visual_positions(visual_start.to(row.device), num_visual)
    return gather_tokens(row.unsqueeze(-1), columns).squeeze(-1)


# ---- before the LLM: [CLS] attention of a tower layer, its stand-in, merge groups ------------------------

def equivalent_token_redundancy(keys: Tensor, has_cls: bool = False) -> Tensor:
    """Semantic redundancy from the equivalent token, for encoders without ``[CLS]``.

    ``M = keys.mean(heads)`` over the patches, ``mu = mean_patches M`` and
    ``a_j = -cos(mu, M_j)``: a patch close to the global mean says little of its own.

    Args:
        keys: ``(B, H, T, d)`` key states of the layer.
        has_cls: whether position 0 is ``[CLS]`` (then it is left out of ``M`` and ``mu``).

    Returns:
        ``(B, N)`` values ``a_j`` in the compute dtype, to use in place of ``A[0, j]``.
    """
    if keys.dim() != 4:
        raise ValueError(f"keys must be (B, H, T, d), got shape {tuple(keys.shape)}")
    offset = int(has_cls)
    mean_keys = keys[:, :, offset:].to(compute_dtype(keys.dtype)).mean(dim=1)
    global_mean = mean_keys.mean(dim=1, keepdim=True)
    return -F.cosine_similarity(global_mean, mean_keys, dim=-1)


def cls_attention(query: Tensor, keys: Tensor, scale: float | None = None,
                  scores: str = DEFAULT_ATTENTION_SCORES) -> Tensor:
    """``(B, H, T)`` the [CLS] query's softmax over every key of a tower layer, per head.

    Args:
        query: ``(B, H, d)`` q of position 0 (``q_proj`` output, heads split; a tower applies no rotary).
        keys: ``(B, H, T, d)`` k of every position.
        scale: logit scale, ``1 / sqrt(d)`` (the layer's own) by default.
        scores: the rule the scores are computed by (ficoco.methods.reads).

    A tower attends without a mask, so the row is exact whether the layer ran eager or SDPA.
    """
    return last_row_attention(query, keys, None, scale, scores)


def equivalent_token_scores(keys: Tensor) -> Tensor:
    """``(B, N)`` importance of every patch on a tower without [CLS]: FiCoCo's equivalent token.

    ``-cos(mu, M_j)``, with ``M`` the head-mean keys ``(B, H, N, d) -> (B, N, d)`` and ``mu`` their
    mean over the patches (docs/methods/ficoco.md): a patch far from the global mean says more of its own, as a
    patch that [CLS] attends to does. Used in place of the [CLS] attention, and labelled so."""
    return equivalent_token_redundancy(keys, has_cls=False)


def pixel_shuffle_order(side: int, factor: int) -> Tensor:
    """(side * side,) a square tile's patch indices (row-major) in pixel-shuffle order: group after group in
    row-major order, each group's factor x factor members row-major (what InternVL's `pixel_shuffle` packs into
    one token). Both the transformers adapter and the vLLM plugin bring a probed layer's keys into this order, so
    that a group's members are consecutive (`TowerInput.merge`)."""
    groups = side // factor
    g_row, g_col, a, b = torch.meshgrid(torch.arange(groups), torch.arange(groups), torch.arange(factor),
                                        torch.arange(factor), indexing="ij")
    return ((g_row * factor + a) * side + g_col * factor + b).flatten()


def merge_group_scores(scores: Tensor, merge: int) -> Tensor:
    """``(B, N / merge)`` mean score of every merge group (Qwen2-VL's PatchMerger joins ``merge``
    consecutive patches - a 2 x 2 group, as its processor orders them - into one LLM token)."""
    batch, patches = scores.shape
    if patches % merge:
        raise ValueError(f"{patches} patches do not split into groups of {merge}")
    return scores.reshape(batch, patches // merge, merge).mean(dim=-1)


def patch_scores_from_cls(inputs: TowerInput, reduce_heads: str = "mean",
                          scores: str = DEFAULT_ATTENTION_SCORES) -> Tensor:
    """``(items, N)`` the [CLS] query's attention over the patches of the probed layer (its scores by the rule
    `scores` names), heads reduced by ``mean`` or ``sum``; on a tower without [CLS], the equivalent token's
    scores."""
    if inputs.keys is None:
        raise RuntimeError("the method needs the probed layer's keys from the adapter")
    if not inputs.has_cls:
        scores = equivalent_token_scores(inputs.keys)
        return merge_group_scores(scores, inputs.merge) if inputs.merge > 1 else scores
    if inputs.cls_query is None:
        raise RuntimeError("the method needs the [CLS] query of the probed layer from the adapter")
    row = cls_attention(inputs.cls_query, inputs.keys, inputs.scale, scores)[:, :, 1:]
    scores = row.sum(dim=1) if reduce_heads == "sum" else row.mean(dim=1)
    # Units of merge groups under a [CLS] (InternVL's pixel-shuffle groups): a group's mean, as without [CLS].
    return merge_group_scores(scores, inputs.merge) if inputs.merge > 1 else scores


def unit_keys(inputs: TowerInput) -> Tensor:
    """``(items, units, d)`` the head-mean keys of every unit's patches ([CLS] dropped), averaged over a
    merge group's patches when units are groups (a merge metric for whole groups)."""
    if inputs.keys is None:
        raise RuntimeError("the method needs the probed layer's keys from the adapter")
    keys = inputs.keys.mean(dim=1)[:, int(inputs.has_cls):]
    if inputs.merge > 1:
        items, patches, dim = keys.shape
        keys = keys.reshape(items, patches // inputs.merge, inputs.merge, dim).mean(dim=2)
    return keys


# ---- DPC-kNN (HoliTom's and FlashVID's clustering of video tokens) ------------------------------------------------

def dpc_knn_scores(x: Tensor, valid: Tensor, clusters: Tensor, neighbours: int) -> tuple[Tensor, Tensor]:
    """DPC-kNN's distances and centre scores of the valid tokens of every group, batched (the official codes'
    ``cluster_dpc_knn``): how each method picks its centres and joins the rest to them is its own.

    Args:
        x: ``(G, N, D)`` tokens.
        valid: ``(G, N)`` the tokens of each group that take part.
        clusters: ``(G,)`` centres per group (0: the group is unused).
        neighbours: the density's k (``min(k, clusters)`` per group, as the official codes).

    Returns ``distance`` ``(G, N, N)`` (Euclidean over sqrt(D), 0 on the diagonal) and ``score`` ``(G, N)``
    (density x distance to the nearest denser token; -inf where not valid).
    """
    _, tokens, width = x.shape
    squared = (x * x).sum(dim=-1)
    gram = x @ x.transpose(1, 2)
    distance = (squared.unsqueeze(2) + squared.unsqueeze(1) - 2 * gram).clamp(min=0).sqrt() / width ** 0.5
    eye = torch.eye(tokens, dtype=torch.bool, device=x.device)
    distance = distance.masked_fill(eye, 0.0)
    inf = torch.tensor(float("inf"), dtype=x.dtype, device=x.device)
    k = clusters.clamp(max=neighbours, min=1)
    widest = min(neighbours, tokens)
    nearest = torch.topk(torch.where(valid.unsqueeze(1), distance, inf), widest, dim=-1, largest=False).values
    used = torch.arange(widest, device=x.device) < k.view(-1, 1, 1)
    density = torch.exp(-torch.where(used, nearest ** 2, torch.zeros_like(nearest)).sum(-1) / k.view(-1, 1))
    index = torch.arange(tokens, device=x.device)
    # j ranks above i: a higher density, or an equal one and a lower index (in place of the noise).
    above = (density.unsqueeze(1) > density.unsqueeze(2)) | \
        ((density.unsqueeze(1) == density.unsqueeze(2)) & (index.view(1, 1, -1) < index.view(1, -1, 1)))
    above = above & valid.unsqueeze(1)
    pair = valid.unsqueeze(2) & valid.unsqueeze(1)
    largest = torch.where(pair, distance, torch.zeros_like(distance)).flatten(1).max(dim=1).values
    parent = torch.where(above, distance, largest.view(-1, 1, 1)).min(dim=-1).values
    return distance, torch.where(valid, parent * density, -inf)
