"""The reads of ficoco.methods.reads in torch: a layer's head-mean (or head-max) attention probabilities,
read without the (heads x queries x keys) matrix.

`AttentionReads` is what a method is handed; it offers the three reads (`column_sum` / `column_mean`,
`rows`, `block`), each returning float32 probabilities combined over the heads by their mean (or, for a
reader made with ``heads="max"``, their largest), and `logits`, the head-mean raw scores of some rows before mask
and softmax (what FiCoCo's official code ranks by: its ``rule="official"``):

- `ProbedAttention` computes them from the layer's own queries and keys (post-rotary), its mask and scale,
  by blocks of query rows under a score budget (`SCORE_BUDGET_ELEMENTS`), in the rule the method's
  ``attention_scores`` names (ficoco.methods.reads); an adapter hands it a runner that times every read in
  its "probe" span (and routes it to a counter during ``flops --verify``);
- `DenseAttention` reads them from a (B, Tq, Tk) head-mean matrix a caller already has (the methods'
  tests, a pooled row); `DenseLogits` the raw scores from such a matrix of scores;
- `SegmentedReads` joins the readers of consecutive segments that attend only within themselves (a
  windowed tower layer: the block diagonal of its windows; `ReorderedReads` reads it in another token
  order), `StackedReads` the readers of several items
  of one size into a batch, `KeyTail` keeps only the last keys' columns (a call's keys after a cache's).

Nothing here synchronises the device with the host: every shape is known before the data, and rows are
chosen by index tensors.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from ficoco.methods.ops import pick_rows as gather_rows
from ficoco.methods.ops import watched
from ficoco.methods.reads import (
    DEFAULT_ATTENTION_SCORES,
    WHOLE_READ_SCORES,
    causal_tiles,
    check_attention_scores,
    check_head_statistic,
)

# Scores one block of a read may hold (every head of some query rows over every key). CPU: 4 M, whose
# scores and probabilities stay near the caches while the softmax and the sums pass over them (larger
# blocks ran slower on a 2-core Xeon: the passes then stream from memory); CUDA: 256 M, a few large
# launches for LLaVA-NeXT's ~2,900-token sequences.
SCORE_BUDGET_ELEMENTS = {"cpu": 1 << 22, "cuda": 1 << 28}

# The score dtypes ficoco's CPU read kernel computes with the rule's roundings (ficoco.methods.reads.native), and
# its blocks' scores. Timed as the model runs a read (its first call after the layer's own work), 4 M beat 8 M:
# FiCoCo-V's fifteen reads of Qwen3-VL-8B's tower took 329-338 ms against 377-380 (three alternated runs each on
# the 2-core AMX Xeon; 16 MB of bf16 scores per block spill what the product just wrote before the kernel reads
# it), though a read repeated at once is as fast either way (an 8 M block was 8 % faster there); FiCoCo-L's
# reads of its decoder (a few hundred rows a layer) took the same at both. With a column read's blocks taken one key
# head at a time (`_products`' by_head), 4 M still beat 8 M in the model (FiCoCo-V's reads of the 8B's tower: 318-323
# against 332-335 ms, two alternated runs each), though 8 M was faster read after read in a loop.
NATIVE_DTYPES = (torch.bfloat16, torch.float32)
NATIVE_SCORE_BUDGET = 1 << 22

# runner(device, function, *args) -> function(*args): how an adapter times (on `device`, in its "probe" span) and,
# during flops --verify, counts a read.
ReadRunner = Callable[..., Any]


def _direct(device: torch.device, function: Callable[..., Tensor], *args: Any) -> Tensor:
    return function(*args)


# A CPU's read buffers, kept between reads: a block's buffers are a few MB, and memory a process frees goes back
# to the system and faults in again page by page at the next read (a model's forward frees far more in between).
# On a GPU the caching allocator keeps freed blocks already, and a block there may hold a GB.
_SCRATCH: dict[tuple[str, torch.dtype], Tensor] = {}


def widened_products(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether products in `dtype` run in float32 and are rounded to `dtype`: bfloat16 on a CPU without bfloat16
    dot-product instructions (AVX512-BF16 or AMX), where torch's bfloat16 matmul takes a slow path (2-core AVX2 EPYC:
    0.2-0.9 GFLOP/s against 95-108 in float32, while SDPA computes bfloat16 attention at its float32 speed). Both
    sum the exact products in float32 and round once; only the order of the sums may differ."""
    if dtype != torch.bfloat16 or device.type != "cpu":
        return False
    native = [getattr(torch.cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    return not any(check() for check in native if check is not None)


def _scratch(name: str, size: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """A flat buffer of at least `size` values for a read, reused between reads on a CPU."""
    if device.type != "cpu" or size == 0:
        return torch.empty(size, dtype=dtype, device=device)
    kept = _SCRATCH.get((name, dtype))
    if kept is None or kept.numel() < size:
        # A plain tensor even when the first read runs under inference mode: a later read outside it may
        # write into it too.
        with torch.inference_mode(False):
            kept = _SCRATCH[(name, dtype)] = torch.empty(size, dtype=dtype)
    return kept


class AttentionReads:
    """A layer's head-mean (or head-max) attention probabilities, (B, Tq, Tk), as a method reads them.

    `shape` is the matrix's; every read returns float32 (or wider) probabilities, the heads combined as the
    reader was made to (a `ProbedAttention`'s `heads`; a `DenseAttention` returns what its matrix holds)."""

    shape: tuple[int, int, int]

    def column_sum(self, rows: Tensor | None = None) -> Tensor:
        """(B, Tk): what every key receives, summed over the query rows `rows` ((B, R) indices; None:
        every row)."""
        raise NotImplementedError

    def column_mean(self, first_row: int = 0) -> Tensor:
        """(B, Tk): what every key receives on average over the query rows ``first_row .. Tq - 1``."""
        raise NotImplementedError

    def rows(self, rows: Tensor, last: int | None = None) -> Tensor:
        """(B, R, Tk): the probabilities of the query rows `rows` ((B, R) indices) over every key. `last`: the rows
        are in order in every sample and none lies after query position `last` (a bound the caller knows on the
        host), so that a causal layer's read skips the keys no row can see."""
        raise NotImplementedError

    def block(self, rows: Tensor, cols: Tensor, last: int | None = None) -> Tensor:
        """(B, R, C): rows `rows` ((B, R)) at the key columns `cols` ((B, C)); `last` as for `rows`."""
        return torch.gather(self.rows(rows, last), 2, cols.unsqueeze(1).expand(-1, rows.shape[1], -1))

    def logits(self, rows: Tensor) -> Tensor:
        """(B, R, Tk): the head-mean raw scores (``q . k^T`` times the scale) of the query rows `rows` ((B, R)
        indices) over every key, before any mask and softmax: what FiCoCo's official code reads (its
        ``rule="official"``). A masked (future, padding) key's score is read like any other."""
        raise NotImplementedError(f"{type(self).__name__} holds no raw scores: read logits from a layer's queries "
                                  "and keys (ProbedAttention) or a matrix of them (DenseLogits)")

    def reordered(self, order: Tensor) -> AttentionReads:
        """The same layer with its tokens (queries and keys alike) in the order `order` ((T,) indices)."""
        raise NotImplementedError

    def last_keys(self, count: int) -> AttentionReads:
        """Reads over the last `count` keys' columns only (their probabilities as normalised over all keys)."""
        return KeyTail(self, count)


def as_reads(attention: Tensor | AttentionReads) -> AttentionReads:
    """`attention` as reads: a (B, Tq, Tk) head-mean matrix is read as it is."""
    return attention if isinstance(attention, AttentionReads) else DenseAttention(attention)


class DenseAttention(AttentionReads):
    """Reads of a (B, Tq, Tk) head-mean matrix held whole (its rows need not be normalised; a read returns
    what the matrix holds, in float32 or wider)."""

    def __init__(self, matrix: Tensor) -> None:
        if matrix.dim() != 3:
            raise ValueError(f"attention must be (B, Tq, Tk), got shape {tuple(matrix.shape)}")
        self.matrix = matrix
        self.shape = tuple(matrix.shape)  # type: ignore[assignment]

    def _wide(self, x: Tensor) -> Tensor:
        return x.to(torch.promote_types(x.dtype, torch.float32))

    def column_sum(self, rows: Tensor | None = None) -> Tensor:
        picked = self.matrix if rows is None else gather_rows(self.matrix, rows)
        return self._wide(picked).sum(dim=1)

    def column_mean(self, first_row: int = 0) -> Tensor:
        return self._wide(self.matrix[:, first_row:]).mean(dim=1)

    def rows(self, rows: Tensor, last: int | None = None) -> Tensor:
        return self._wide(gather_rows(self.matrix, rows))

    def block(self, rows: Tensor, cols: Tensor, last: int | None = None) -> Tensor:
        batch = torch.arange(self.matrix.shape[0], device=rows.device).view(-1, 1, 1)
        return self._wide(self.matrix[batch, rows.unsqueeze(2), cols.unsqueeze(1)])

    def reordered(self, order: Tensor) -> AttentionReads:
        return DenseAttention(self.matrix[:, order][:, :, order])


class DenseLogits(AttentionReads):
    """Reads of a (B, Tq, Tk) head-mean matrix of raw scores held whole (the methods' tests, a caller that has
    the scores): `logits` returns its rows; it holds no probabilities to read."""

    def __init__(self, matrix: Tensor) -> None:
        if matrix.dim() != 3:
            raise ValueError(f"scores must be (B, Tq, Tk), got shape {tuple(matrix.shape)}")
        self.matrix = matrix
        self.shape = tuple(matrix.shape)  # type: ignore[assignment]

    def logits(self, rows: Tensor) -> Tensor:
        picked = gather_rows(self.matrix, rows)
        return picked.to(torch.promote_types(picked.dtype, torch.float32))


class ProbedAttention(AttentionReads):
    """Reads computed from a layer's queries (B, H, Tq, d) and keys (B, H_kv, Tk, d) (post-rotary; grouped
    heads: H a multiple of H_kv), its `mask` ((B or 1, H or 1, Tq or 1, Tk): boolean, True = attend, or
    additive) or the causal rule (`causal`, with no mask; query i of the last Tq sees keys up to
    i + Tk - Tq), and its `scale`, in the rule `scores` names (ficoco.methods.reads). `heads`: every read
    combines the heads' probabilities by their ``"mean"`` or their ``"max"`` (ficoco.methods.reads.HEAD_STATISTICS).
    Nothing is computed until a read is asked for; every read runs through `runner`."""

    def __init__(self, query: Tensor, key: Tensor, scale: float | None = None, *, mask: Tensor | None = None,
                 causal: bool = False, scores: str = DEFAULT_ATTENTION_SCORES, runner: ReadRunner | None = None,
                 budget: int | None = None, heads: str = "mean") -> None:
        batch, query_heads, q_len, dim = query.shape
        if key.shape[0] != batch or query_heads % key.shape[1] or key.shape[-1] != dim:
            raise ValueError(f"queries {tuple(query.shape)} and keys {tuple(key.shape)} do not make one attention")
        self.query, self.key = query, key
        self.scale = dim ** -0.5 if scale is None else scale
        self.mask, self.causal = mask, causal
        self.scores = check_attention_scores(scores)
        self.heads = check_head_statistic(heads)
        self.runner = runner or _direct
        self.budget = budget
        self.shape = (batch, q_len, key.shape[2])
        self._whole: DenseAttention | None = None
        self.held = False  # every read of probabilities answered from a matrix a fused pass left (`hold`)

    # -- the reads --------------------------------------------------------------------------------------------
    @property
    def whole(self) -> DenseAttention | None:
        """The head-mean (head-max) matrix, computed at the first read, where every score of the layer fits
        `WHOLE_READ_SCORES` (every read is then answered from it); None for a larger layer."""
        if self._whole is not None:
            return self._whole
        batch, q_len, k_len = self.shape
        if batch * self.query.shape[1] * q_len * k_len > WHOLE_READ_SCORES:
            return None
        if self._whole is None:
            self._whole = DenseAttention(self.runner(self.query.device, self._matrix))
        return self._whole

    def hold(self, matrix: Tensor) -> None:
        """Answer every read of probabilities from `matrix`, the layer's (B, Tq, Tk) head-mean (head-max)
        probabilities a pass that computed the layer's output left (ficoco.methods.reads.ops.fused)."""
        if tuple(matrix.shape) != self.shape:
            raise ValueError(f"a matrix of {tuple(matrix.shape)} is not this layer's {self.shape}")
        self._whole = DenseAttention(matrix)
        self.held = True

    def column_sum(self, rows: Tensor | None = None) -> Tensor:
        if self.whole is not None:
            return self.runner(self.query.device, self.whole.column_sum, rows)
        self._kernel()  # built (once per process) before the read's span opens
        return self.runner(self.query.device, self._columns, rows, 0)

    def column_mean(self, first_row: int = 0) -> Tensor:
        if self.whole is not None:
            return self.runner(self.query.device, self.whole.column_mean, first_row)
        count = max(self.shape[1] - first_row, 1)
        self._kernel()
        return self.runner(self.query.device, self._columns, None, first_row) / count

    def rows(self, rows: Tensor, last: int | None = None) -> Tensor:
        if self.whole is not None:
            return self.runner(self.query.device, self.whole.rows, rows)
        self._kernel()
        return self.runner(self.query.device, self._rows, rows, last)

    def block(self, rows: Tensor, cols: Tensor, last: int | None = None) -> Tensor:
        if self.whole is not None:
            return self.runner(self.query.device, self.whole.block, rows, cols)
        self._kernel()
        return self.runner(self.query.device, self._block, rows, cols, last)

    def logits(self, rows: Tensor) -> Tensor:
        # Never from the whole matrix a small layer keeps: that one holds probabilities.
        return self.runner(self.query.device, self._logits, rows)

    def reordered(self, order: Tensor) -> AttentionReads:
        order = order.to(self.query.device)
        mask = self.mask
        if mask is not None:
            mask = mask[..., order, :] if mask.shape[-2] > 1 else mask
            mask = mask[..., order]
        reordered = ProbedAttention(self.query[:, :, order], self.key[:, :, order], self.scale, mask=mask,
                                    causal=self.causal, scores=self.scores, runner=self.runner, budget=self.budget,
                                    heads=self.heads)
        if self.held:
            reordered.hold(self._whole.matrix[:, order][:, :, order])
        return reordered

    # -- by blocks of query rows ------------------------------------------------------------------------------
    def _kernel(self) -> Any:
        """ficoco's fused CPU read kernel (ficoco.methods.reads.native) where it computes this layer's reads
        with the rule's roundings: a CPU, bfloat16 or float32 scores, no mask but the causal rule, nothing
        recording gradients or tracing; else None (the reads run in torch)."""
        # Not while something counts the ops (a tracer, a dispatch mode: a FLOP counter, fake tensors), which would
        # see none of the kernel's, nor where autograd records the reads.
        if self.query.device.type != "cpu" or self.mask is not None or watched() or not self._buffered():
            return None
        from ficoco.methods.reads import native

        if native.setting() == "triton":
            return None
        if (self.query.dtype if self.scores == "model" else torch.float32) not in NATIVE_DTYPES:
            return None
        return native.library()

    def _triton(self) -> bool:
        """Whether the reads run as ficoco's Triton kernels (ficoco.methods.reads.ops.triton_kernels): on a GPU with
        Triton installed (or, told so with FICOCO_READ_KERNEL=triton, under Triton's interpreter on the CPU: the
        tests), no mask but the causal rule, head-mean reads, nothing counting the ops or recording gradients."""
        from ficoco.methods.reads import native

        setting = native.setting()
        # Asked first, so that a CPU read never imports Triton.
        if self.query.device.type != "cuda" and setting != "triton":
            return False
        if setting == "torch" or self.mask is not None or self.heads != "mean" or watched() or not self._buffered():
            return False
        from ficoco.methods.reads.ops import triton_kernels

        return triton_kernels.available(self.query.device)

    def _picked(self, rows: Tensor | None, first_row: int) -> tuple[Tensor, Tensor]:
        """The query rows a read asks for, (B, H, R, d), and their positions (B, R) or (R,)."""
        if rows is None:
            positions = torch.arange(first_row, self.shape[1], device=self.query.device)
            return self.query[:, :, first_row:], positions
        index = rows.to(self.query.device)
        picked = torch.gather(self.query, 2, index[:, None, :, None].expand(-1, self.query.shape[1], -1,
                                                                             self.query.shape[-1]))
        return picked, index

    def _columns(self, rows: Tensor | None, first_row: int) -> Tensor:
        batch, _, k_len = self.shape
        if self._triton():
            from ficoco.methods.reads.ops import triton_kernels

            picked, positions = self._picked(rows, first_row)
            return triton_kernels.column_sum(picked, self.key, positions, self.scale, causal=self.causal,
                                           q_len=self.shape[1], scores=self.scores)
        # The kernel's column sums add every head's probabilities: a head-max column read sums its rows' maxima in
        # torch (no method reads one yet; FitPrune's reads are rows).
        kernel = self._kernel() if self.heads == "mean" else None
        if kernel is not None:
            return self._native_columns(kernel, rows, first_row)
        total = torch.zeros(batch, k_len, dtype=torch.float32, device=self.query.device)
        for b0, b1, _, _, probabilities in self._blocks(rows, first_row):
            if self.heads == "max":
                total[b0:b1, :probabilities.shape[-1]] += probabilities.amax(dim=(1, 2)).sum(dim=1)
                continue
            # Every head of every row of the block: (b, heads x rows, keys) summed over its middle axis.
            total[b0:b1, :probabilities.shape[-1]] += probabilities.flatten(1, 3).sum(dim=1)
        return total if self.heads == "max" else total.div_(self.query.shape[1])

    def _rows(self, rows: Tensor, last: int | None = None) -> Tensor:
        batch, _, k_len = self.shape
        if self._triton():
            from ficoco.methods.reads.ops import triton_kernels

            picked, positions = self._picked(rows, 0)
            return triton_kernels.rows(picked, self.key, positions, self.scale, causal=self.causal,
                                     q_len=self.shape[1], scores=self.scores)
        kernel = self._kernel()
        if kernel is not None:
            return self._native_rows(kernel, rows, last)
        out = torch.zeros(batch, rows.shape[1], k_len, dtype=torch.float32, device=self.query.device)
        for b0, b1, r0, r1, probabilities in self._blocks(rows, 0, last):
            out[b0:b1, r0:r1, :probabilities.shape[-1]] = self._over_heads(probabilities)
        return out

    def _over_heads(self, probabilities: Tensor) -> Tensor:
        """A block's (n, H_kv, g, rows, keys) probabilities combined over its heads: (n, rows, keys)."""
        if self.heads == "max":
            return probabilities.amax(dim=(1, 2))
        return probabilities.sum(dim=(1, 2)).div_(self.query.shape[1])

    def _logits(self, rows: Tensor) -> Tensor:
        """(B, R, Tk) head-mean raw scores of the rows `rows` over every key, by blocks of rows (`_products`: the
        rule's products; the model rule's scale applied in the model's dtype, as its eager attention scales them),
        summed over the heads in float32. No mask, no softmax; no causal tiling (a row's later keys are read too)."""
        batch, _, k_len = self.shape
        heads = self.query.shape[1]
        out = torch.zeros(batch, rows.shape[1], k_len, dtype=torch.float32, device=self.query.device)
        for b0, b1, r0, r1, scores, _, keys in self._products(rows, 0):
            if self.scores == "model":
                scores = scores * self.scale
            n, kv_heads = b1 - b0, scores.shape[1]
            summed = scores.view(n, kv_heads, -1, r1 - r0, keys).float().sum(dim=(1, 2))
            out[b0:b1, r0:r1, :keys] = summed.div_(heads)
        return out

    def _native_columns(self, kernel: Any, rows: Tensor | None, first_row: int) -> Tensor:
        batch, _, k_len = self.shape
        heads = self.query.shape[1]
        # The kernel adds each call's (each thread's) float32 sums into double accumulators, over the blocks too.
        total = torch.zeros(batch, k_len, dtype=torch.float64)
        threads = torch.get_num_threads()
        # A column sum takes its rows in any order: one key head at a time, whose products are one matrix product
        # of many rows (`_products`' by_head).
        for b0, _, _, _, scores, limits, scale in self._score_blocks(rows, first_row, by_head=True):
            n, block_heads, width, keys = scores.shape
            per_row = None if limits is None else limits.unsqueeze(1).expand(n, block_heads, width).contiguous()
            function = kernel.ficoco_colsum_bf16 if scores.dtype == torch.bfloat16 else kernel.ficoco_colsum_f32
            for b in range(n):
                function(scores[b].data_ptr(), block_heads * width, keys, scale,
                         None if per_row is None else per_row[b].data_ptr(), total[b0 + b].data_ptr(), threads)
        return total.div_(heads).to(torch.float32)

    def _native_rows(self, kernel: Any, rows: Tensor, last: int | None) -> Tensor:
        batch, _, k_len = self.shape
        heads = self.query.shape[1]
        out = torch.zeros(batch, rows.shape[1], k_len, dtype=torch.float32)
        threads = torch.get_num_threads()
        # Probabilities are never negative: a head-max starts from zero as a head sum does.
        bf16, f32 = ("ficoco_rowmax_bf16", "ficoco_rowmax_f32") if self.heads == "max" else \
            ("ficoco_rowsum_bf16", "ficoco_rowsum_f32")
        for b0, b1, r0, r1, scores, limits, scale in self._score_blocks(rows, 0, last):
            n, _, width, keys = scores.shape
            combined = torch.zeros(n, width, keys, dtype=torch.float32)
            function = getattr(kernel, bf16 if scores.dtype == torch.bfloat16 else f32)
            function(scores.data_ptr(), n, heads, width, keys, scale,
                     None if limits is None else limits.data_ptr(), combined.data_ptr(), threads)
            out[b0:b1, r0:r1, :keys] = combined if self.heads == "max" else combined.div_(heads)
        return out

    def _matrix(self) -> Tensor:
        """(B, Tq, Tk) every row's head-mean (head-max) probabilities."""
        batch, q_len, k_len = self.shape
        out = torch.zeros(batch, q_len, k_len, dtype=torch.float32, device=self.query.device)
        for b0, b1, r0, r1, probabilities in self._blocks(None, 0):
            out[b0:b1, r0:r1, :probabilities.shape[-1]] = self._over_heads(probabilities)
        return out

    def _block(self, rows: Tensor, cols: Tensor, last: int | None = None) -> Tensor:
        every = self._rows(rows, last)
        return torch.gather(every, 2, cols.unsqueeze(1).expand(-1, rows.shape[1], -1))

    def _row_steps(self, count: int, first_row: int, rows: Tensor | None, last: int | None, per_row: int,
                   budget: int, even: bool = False) -> list[tuple[int, int, int]]:
        """(r0, r1, keys) of every block of rows: at most `budget` scores each; in a causal layer whose rows are
        known to lie below a bound (a range, or `last`), tiles of CAUSAL_TILE_ROWS rows reading only the keys up
        to their bound (`causal_tiles`), each split further where it exceeds the budget; with `even`, a tile's
        blocks of equal size (no small last block, whose product runs slower)."""
        _, q_len, k_len = self.shape
        bound = first_row + count - 1 if rows is None else last
        if self.causal and bound is not None and q_len > 1:
            tiles = causal_tiles(count, bound, k_len, q_len)
        else:
            tiles = [(0, count, k_len)]
        steps = []
        for t0, t1, keys in tiles:
            step = max(1, min(t1 - t0, budget // max(1, per_row)))
            if even:
                step = -(-(t1 - t0) // -(-(t1 - t0) // step))
            steps += [(r0, min(t1, r0 + step), keys) for r0 in range(t0, t1, step)]
        return steps

    def _score_blocks(self, rows: Tensor | None, first_row: int, last: int | None = None,  # noqa: ANN202
                      by_head: bool = False):
        """For the native kernel: (b0, b1, r0, r1, scores (n, H, rows, keys) contiguous, limits, scale) over the
        requested rows (as `_blocks`): the products q . k^T as the rule computes them (the model rule's in the
        model's dtype, unscaled; the float32 rule's of the scaled queries in float32), the keys each row sees
        ((n, rows) int64, under the causal rule; else None) and the scale the kernel applies (1 where the
        queries carry it). With `by_head`, one key head's query heads per block ((n, H / H_kv, rows, keys)),
        heads in order."""
        heads = self.query.shape[1] // self.key.shape[1] if by_head else self.query.shape[1]
        for b0, b1, r0, r1, scores, row_index, keys in self._products(rows, first_row, last, NATIVE_SCORE_BUDGET,
                                                                      by_head=by_head):
            limits = None
            if self.causal and self.shape[1] > 1:
                _, q_len, k_len = self.shape
                limits = (row_index + (k_len - q_len) + 1).clamp(0, keys).to(torch.int64).contiguous()
            yield (b0, b1, r0, r1, scores.view(b1 - b0, heads, r1 - r0, keys), limits,
                   self.scale if self.scores == "model" else 1.0)

    def _products(self, rows: Tensor | None, first_row: int, last: int | None = None,  # noqa: ANN202
                  default_budget: int | None = None, by_head: bool = False):
        """(b0, b1, r0, r1, scores (n, H_kv, g x rows, keys), row_index (n, rows), keys) over the requested query
        rows: the index `rows` (B, R), or the range first_row .. Tq - 1, in blocks of at most the score budget;
        `keys` the leading keys a block reads (all, or in a causal layer those its rows can see). The scores are
        the rule's products (ficoco.methods.reads), before the model rule's scale, mask and softmax. The budget:
        the reader's own, else `default_budget`, else the device's (SCORE_BUDGET_ELEMENTS).

        With `by_head`, each block is one key head's (n, 1, g x rows, keys), the key heads in order, its rows
        blocked by that head's scores alone: a few products of many rows rather than one of every head over a
        few rows each (on a 2-core AMX Xeon a read of Qwen3-VL's 2,304-token tower layer took its products in
        11.6 ms by head against 16.1 by rows of every head)."""
        query, key = self.query, self.key
        batch, heads, q_len, dim = query.shape
        kv_heads, k_len = key.shape[1], key.shape[2]
        groups = heads // kv_heads
        count = q_len - first_row if rows is None else rows.shape[1]
        if count <= 0:
            return
        budget = self.budget or default_budget or SCORE_BUDGET_ELEMENTS.get(query.device.type,
                                                                            SCORE_BUDGET_ELEMENTS["cpu"])
        block_heads = groups if by_head else heads
        per_row = block_heads * k_len
        batch_step = max(1, min(batch, budget // max(1, per_row * count)))
        if batch_step > 1:
            steps = self._row_steps(count, first_row, rows, last, per_row * batch_step, budget * batch_step,
                                    even=by_head)
        else:
            steps = self._row_steps(count, first_row, rows, last, per_row, budget, even=by_head)
        row_step = max(r1 - r0 for r0, r1, _ in steps)
        model_rule = self.scores == "model"
        score_dtype = query.dtype if model_rule else torch.float32
        # The model rule's products in the model's dtype, or in float32 rounded to it where that dtype's own
        # products are slow (`widened_products`).
        widened = model_rule and widened_products(query.dtype, query.device)
        # Contiguous once per read: a layer's keys are often a view (Qwen's tower: heads and tokens transposed),
        # which every block's product would otherwise copy again.
        keys_t = (key if model_rule and not widened else key.float()).contiguous().transpose(-1, -2)
        # One buffer for the scores, reused by every block (a fresh large allocation per block costs page faults
        # on a CPU); not under torch.jit's tracer (flops --verify), which counts an op by its inputs and would take
        # the `out=` buffer for one, nor where autograd records the reads (a loss through the method's merge
        # weights), which `out=` does not support.
        size = batch_step * block_heads * row_step * k_len if self._buffered() else 0
        score_buffer = _scratch("scores", size, score_dtype, query.device)
        for b0 in range(0, batch, batch_step):
            b1 = min(batch, b0 + batch_step)
            for r0, r1, keys in steps:
                n, width = b1 - b0, r1 - r0
                if rows is None:
                    picked = query[b0:b1, :, first_row + r0:first_row + r1]
                    row_index = torch.arange(first_row + r0, first_row + r1, device=query.device).expand(n, -1)
                else:
                    row_index = rows[b0:b1, r0:r1]
                    if n == 1 and row_index.device == query.device:
                        # Picked in (1, H, rows, d) order, so the stacking below is a view, not a copy.
                        picked = query[b0:b1].index_select(2, row_index[0])
                    else:
                        picked = gather_rows(query[b0:b1].transpose(1, 2), row_index).transpose(1, 2)
                for h0 in range(0, kv_heads, 1 if by_head else kv_heads):
                    h1 = h0 + 1 if by_head else kv_heads
                    # (n, key heads, g x rows, d): a key head's query heads stacked, so no key is repeated.
                    stacked = picked[:, h0 * groups:h1 * groups].reshape(n, h1 - h0, groups * width, dim)
                    if not model_rule:
                        stacked = (stacked * self.scale).float()
                    shape = (n, h1 - h0, groups * width, keys)
                    if widened:
                        products = torch.matmul(stacked.float(), keys_t[b0:b1, h0:h1, :, :keys])
                        scores = score_buffer[:math.prod(shape)].view(shape) if size else torch.empty(
                            shape, dtype=score_dtype, device=query.device)
                        scores.copy_(products)  # rounded once to the model's dtype
                    elif not size:
                        scores = torch.matmul(stacked, keys_t[b0:b1, h0:h1, :, :keys])
                    elif shape[:2] == (1, 1):
                        # One matrix product: torch's batched product would copy the strided rows first.
                        scores = score_buffer[:math.prod(shape)].view(shape)
                        torch.mm(stacked[0, 0], keys_t[b0, h0, :, :keys], out=scores[0, 0])
                    else:
                        scores = score_buffer[:math.prod(shape)].view(shape)
                        torch.matmul(stacked, keys_t[b0:b1, h0:h1, :, :keys], out=scores)
                    yield b0, b1, r0, r1, scores, row_index, keys

    def _buffered(self) -> bool:
        recorded = torch.is_grad_enabled() and (self.query.requires_grad or self.key.requires_grad)
        return not torch.jit.is_tracing() and not recorded

    def _blocks(self, rows: Tensor | None, first_row: int, last: int | None = None):  # noqa: ANN202 (a generator)
        """(b0, b1, r0, r1, probabilities (b1-b0, H_kv, g, r1-r0, keys) in float32 or wider) over the requested
        query rows (`_products`), computed in torch with the rule's scale, mask and softmax."""
        query = self.query
        batch, heads, q_len, _ = query.shape
        kv_heads, k_len = self.key.shape[1], self.key.shape[2]
        groups = heads // kv_heads
        model_rule = self.scores == "model"
        score_dtype = query.dtype if model_rule else torch.float32
        buffered = self._buffered()
        positions = None
        if self.mask is None and self.causal and q_len > 1:
            positions = torch.arange(k_len, device=query.device)
        for b0, b1, r0, r1, scores, row_index, keys in self._products(rows, first_row, last):
            n, width = b1 - b0, r1 - r0
            shape = scores.shape
            if model_rule:
                scores.mul_(self.scale)  # in the model's dtype, as its eager attention scales them
            scores5 = scores.view(n, kv_heads, groups, width, keys)
            span = (first_row + r0, first_row + r1) if rows is None else None
            masked = self._mask_rows(b0, b1, row_index, span, positions, q_len, k_len, kv_heads, groups)
            if masked is not None:
                masked = masked[..., :keys]
                if masked.dtype == torch.bool:
                    scores5.masked_fill_(~masked, float("-inf"))
                else:
                    scores5.add_(masked.to(scores5.dtype))
            # The model rule's softmax runs in float32 and rounds to the model's dtype, as eager's does.
            # Buffers for the probabilities and (half precision) their float32 copy, reused by every block as the
            # scores' (a sum with dtype=float32 converts into a fresh tensor, pages and all, at every block).
            if buffered:
                probabilities = _scratch("probabilities", scores.numel(), score_dtype, query.device)
                probabilities = probabilities[:scores.numel()].view(shape)
                torch.softmax(scores, dim=-1, out=probabilities)
            else:
                probabilities = torch.softmax(scores, dim=-1)
            if masked is not None:
                # A row with no visible key (padding) gives NaN: zero it without asking the host.
                torch.nan_to_num_(probabilities, nan=0.0)
            if buffered and score_dtype != torch.float32:
                wide = _scratch("wide", probabilities.numel(), torch.float32, query.device)
                probabilities = wide[:probabilities.numel()].view(shape).copy_(probabilities)
            else:
                probabilities = probabilities.float()
            yield b0, b1, r0, r1, probabilities.view(n, kv_heads, groups, width, keys)

    def _mask_rows(self, b0: int, b1: int, row_index: Tensor, span: tuple[int, int] | None, positions: Tensor | None,
                   q_len: int, k_len: int, kv_heads: int, groups: int) -> Tensor | None:
        """The block's mask, broadcastable to (n, H_kv, g, rows, Tk), or None: the rows `row_index` ((n, rows)),
        which are the range `span` of every sample when it is given."""
        mask = self.mask
        if mask is not None:
            part = mask[b0:b1] if mask.shape[0] > 1 else mask
            part = part[..., :k_len]
            if part.shape[-2] > 1 and span is not None:
                part = part[..., span[0]:span[1], :]
            elif part.shape[-2] > 1:
                # Each sample's own rows (they may differ between samples).
                picked = part.expand(b1 - b0, -1, -1, -1).transpose(1, 2)  # (n, Tq, H or 1, Tk)
                part = gather_rows(picked, row_index).transpose(1, 2)  # (n, H or 1, rows, Tk)
            if part.shape[1] > 1:  # a mask per head
                return part.reshape(part.shape[0], kv_heads, groups, part.shape[-2], k_len)
            return part.unsqueeze(2)
        if positions is None:
            return None
        # Query i of the last q_len of the k_len keys sees keys j <= i + k_len - q_len.
        limit = row_index + (k_len - q_len)
        return (positions.view(1, 1, -1) <= limit.unsqueeze(-1))[:, None, None]


class SegmentedReads(AttentionReads):
    """The reads of consecutive segments that attend only within themselves (a windowed layer), as one
    block-diagonal (B, T, T) matrix: `parts` in order, each over its own queries and keys."""

    def __init__(self, parts: Sequence[AttentionReads]) -> None:
        self.parts = list(parts)
        self.lengths = [part.shape[1] for part in self.parts]
        total = sum(self.lengths)
        self.shape = (self.parts[0].shape[0], total, total)

    def column_sum(self, rows: Tensor | None = None) -> Tensor:
        if rows is None:
            return torch.cat([part.column_sum() for part in self.parts], dim=1)
        return self.rows(rows).sum(dim=1)

    def column_mean(self, first_row: int = 0) -> Tensor:
        if first_row:
            raise ValueError("a windowed layer's column mean is read over every row")
        return self.column_sum() / self.shape[1]

    def rows(self, rows: Tensor, last: int | None = None) -> Tensor:
        """Every part reads the rows that fall inside it (the others read nothing there): no host read of
        which rows fall where."""
        pieces, start = [], 0
        for part in self.parts:
            inside = (rows >= start) & (rows < start + part.shape[1])
            local = (rows - start).clamp(0, part.shape[1] - 1)
            pieces.append(torch.where(inside.unsqueeze(-1), part.rows(local), 0.0))
            start += part.shape[1]
        return torch.cat(pieces, dim=2)

    def reordered(self, order: Tensor) -> AttentionReads:
        """The block diagonal read in another token order (a windowed Qwen2.5-VL block's windows, read in the
        image's grid order): every read taken in the windows' own order and permuted (`ReorderedReads`)."""
        return ReorderedReads(self, order)


class ReorderedReads(AttentionReads):
    """The reads of a layer whose tokens (queries and keys alike) are put in the order `order` ((T,) indices into
    the layer's own order: new token i is the layer's token ``order[i]``), where the layer's reader cannot reorder
    its own queries and keys (a windowed layer's block diagonal, `SegmentedReads`): every read is taken in the
    layer's order, its rows picked through `order` and its columns permuted by it."""

    def __init__(self, reads: AttentionReads, order: Tensor) -> None:
        if order.dim() != 1 or order.numel() != reads.shape[1] or reads.shape[1] != reads.shape[2]:
            raise ValueError(f"an order of {tuple(order.shape)} does not reorder a layer of shape {reads.shape}")
        self.reads, self.order = reads, order
        self.shape = reads.shape

    def _rows(self, rows: Tensor) -> Tensor:
        return self.order.to(rows.device)[rows]

    def column_sum(self, rows: Tensor | None = None) -> Tensor:
        sums = self.reads.column_sum(None if rows is None else self._rows(rows))
        return sums[:, self.order.to(sums.device)]

    def column_mean(self, first_row: int = 0) -> Tensor:
        if first_row:
            batch, count = self.shape[0], self.shape[1] - first_row
            rows = torch.arange(first_row, self.shape[1], device=self.order.device).expand(batch, -1)
            return self.column_sum(rows) / max(count, 1)
        means = self.reads.column_mean()
        return means[:, self.order.to(means.device)]

    def rows(self, rows: Tensor, last: int | None = None) -> Tensor:
        # The rows are picked in the layer's order, where a causal bound on them means nothing: none is passed.
        probabilities = self.reads.rows(self._rows(rows))
        return probabilities[..., self.order.to(probabilities.device)]

    def block(self, rows: Tensor, cols: Tensor, last: int | None = None) -> Tensor:
        return self.reads.block(self._rows(rows), self._rows(cols))

    def reordered(self, order: Tensor) -> AttentionReads:
        return ReorderedReads(self.reads, self.order[order.to(self.order.device)])


class StackedReads(AttentionReads):
    """The reads of several items of one size, as one batch: each item's reader (batch 1) read in turn."""

    def __init__(self, items: Sequence[AttentionReads]) -> None:
        self.items = list(items)
        first = self.items[0].shape
        if any(item.shape[1:] != first[1:] for item in self.items):
            raise ValueError("stacked attention reads must be of one size")
        self.shape = (sum(item.shape[0] for item in self.items), first[1], first[2])

    def _split(self, index: Tensor | None) -> list[Tensor | None]:
        if index is None:
            return [None] * len(self.items)
        return list(index.split([item.shape[0] for item in self.items]))

    def column_sum(self, rows: Tensor | None = None) -> Tensor:
        return torch.cat([item.column_sum(r) for item, r in zip(self.items, self._split(rows), strict=True)])

    def column_mean(self, first_row: int = 0) -> Tensor:
        return torch.cat([item.column_mean(first_row) for item in self.items])

    def rows(self, rows: Tensor, last: int | None = None) -> Tensor:
        return torch.cat([item.rows(r, last) for item, r in zip(self.items, self._split(rows), strict=True)])

    def block(self, rows: Tensor, cols: Tensor, last: int | None = None) -> Tensor:
        return torch.cat([item.block(r, c, last) for item, r, c in
                          zip(self.items, self._split(rows), self._split(cols), strict=True)])

    def logits(self, rows: Tensor) -> Tensor:
        return torch.cat([item.logits(r) for item, r in zip(self.items, self._split(rows), strict=True)])

    def reordered(self, order: Tensor) -> AttentionReads:
        return StackedReads([item.reordered(order) for item in self.items])


def stack_reads(items: Sequence[AttentionReads]) -> AttentionReads:
    """Several items' reads as one batch: one `ProbedAttention` over their stacked queries and keys where they
    are alike (one batched read), else a `StackedReads`."""
    if len(items) == 1:
        return items[0]
    first = items[0]
    if all(isinstance(item, ProbedAttention) and item.mask is None and item.query.shape[1:] == first.query.shape[1:]
           and item.key.shape[1:] == first.key.shape[1:] and item.scale == first.scale and item.scores == first.scores
           and item.causal == first.causal and item.heads == first.heads for item in items) \
            and isinstance(first, ProbedAttention):
        return ProbedAttention(torch.cat([item.query for item in items]), torch.cat([item.key for item in items]),
                               first.scale, causal=first.causal, scores=first.scores, runner=first.runner,
                               budget=first.budget, heads=first.heads)
    return StackedReads(items)


class KeyTail(AttentionReads):
    """Reads restricted to the last `count` keys' columns (a call's own keys after a cache's earlier ones)."""

    def __init__(self, reads: AttentionReads, count: int) -> None:
        self.reads, self.count = reads, count
        batch, q_len, k_len = reads.shape
        self.offset = k_len - count
        self.shape = (batch, q_len, count)

    def column_sum(self, rows: Tensor | None = None) -> Tensor:
        return self.reads.column_sum(rows)[:, self.offset:]

    def column_mean(self, first_row: int = 0) -> Tensor:
        return self.reads.column_mean(first_row)[:, self.offset:]

    def rows(self, rows: Tensor, last: int | None = None) -> Tensor:
        return self.reads.rows(rows, last)[..., self.offset:]

    def block(self, rows: Tensor, cols: Tensor, last: int | None = None) -> Tensor:
        return self.reads.block(rows, cols + self.offset, last)

    def logits(self, rows: Tensor) -> Tensor:
        return self.reads.logits(rows)[..., self.offset:]

    def reordered(self, order: Tensor) -> AttentionReads:
        raise NotImplementedError("a read over a cache's keys is not reordered")


class GroupReads(AttentionReads):
    """Reads at the level of merge groups of `merge` consecutive tokens (Qwen2-VL's 2 x 2 groups,
    InternVL's pixel-shuffle groups) after the first `offset` tokens ([CLS]): a group's probability to
    another is the mean over their members' (every member row of the one, every member column of the
    other), as (B, G, G)."""

    def __init__(self, reads: AttentionReads, merge: int, offset: int = 0) -> None:
        batch, q_len, k_len = reads.shape
        if (q_len - offset) % merge or q_len != k_len:
            raise ValueError(f"{q_len - offset} tokens are not whole groups of {merge}")
        self.reads, self.merge, self.offset = reads, merge, offset
        groups = (q_len - offset) // merge
        self.shape = (batch, groups, groups)

    def _members(self, groups: Tensor) -> Tensor:
        """(B, R * merge) the token rows of the groups `groups` (B, R), member by member."""
        members = torch.arange(self.merge, device=groups.device)
        return (self.offset + groups.unsqueeze(-1) * self.merge + members).flatten(1)

    def column_sum(self, rows: Tensor | None = None) -> Tensor:
        if rows is None:
            return self.column_mean() * self.shape[1]
        return self.rows(rows).sum(dim=1)

    def column_mean(self, first_row: int = 0) -> Tensor:
        if first_row:
            raise ValueError("a merge group's column mean is read over every group")
        batch, groups, _ = self.shape
        received = self.reads.column_mean(first_row=self.offset)[:, self.offset:]
        return received.view(batch, groups, self.merge).mean(dim=2)

    def rows(self, rows: Tensor, last: int | None = None) -> Tensor:
        batch, groups, _ = self.shape
        every = self.reads.rows(self._members(rows))[..., self.offset:]
        return every.view(batch, rows.shape[1], self.merge, groups, self.merge).mean(dim=(2, 4))

    def reordered(self, order: Tensor) -> AttentionReads:
        raise NotImplementedError("merge groups are not reordered")
