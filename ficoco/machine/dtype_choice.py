"""Which dtype stores the weights and which computes: `--dtype auto|bf16|fp16|fp32`.

On CUDA, auto is float16 (bfloat16 for a checkpoint stored in bfloat16, whose activations
can overflow float16). On a CPU, auto is decided from this CPU's measured matmul throughput
(`compute_rate.matmul_flops_per_s`), not assumed: with AMX bfloat16 is several times faster
than float32; with AVX2 alone float32 is four to five times faster than either 16-bit type.

Where the fastest dtype is float32 and float32 weights do not fit in memory, the weights are
stored in 16 bits (bfloat16: every value is exactly a float32 value) and upcast layer by
layer for float32 compute (`upcast=True`), when that is still clearly faster than computing
in 16 bits; otherwise the fastest 16-bit dtype. An explicit dtype is honoured as asked:
float16 on a CPU computes in float16, however slow.

    choose_dtype(requested, device, *, need_bytes_by_dtype, free_bytes, native, upcast_need_bytes)
        -> DtypeChoice (storage, compute, reason, upcast, fp32_layers)
    row_dtypes(choice, quant) -> the storage_dtype, compute_dtype and dtype_reason of a report row
    parse_dtype(text), dtype_name(torch_dtype): the names used on the command line and in reports
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ficoco.errors import FicocoError

DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
REQUESTS = ("auto", *DTYPES)
# fp32 compute on upcast 16-bit weights pays a copy of every upcast weight per forward; it is
# chosen over 16-bit compute only when fp32 matmuls are at least this much faster.
UPCAST_WORTH = 1.5


@dataclass(frozen=True)
class DtypeChoice:
    """The dtypes of a build and why.

    `storage`: the floating-point weights' dtype (with `upcast`, that of the decoder's linear
    weights; everything else is stored in `compute`). `compute`: the dtype of activations and
    matrix work. `upcast`: 16-bit linear weights copied to `compute` layer by layer at every
    forward. `fp32_layers` (with `upcast`): the last decoder layers whose linear weights
    memory allows to keep in `compute` already, so they are not upcast.
    """

    storage: torch.dtype
    compute: torch.dtype
    reason: str
    upcast: bool = False
    fp32_layers: int = 0

    def upcast_layers(self, decoder_layers: int, quant: str = "fp16") -> int:
        """The decoder layers whose linear weights are upcast at every forward: with `upcast` and
        unquantized weights, all but the `fp32_layers` kept in the compute dtype; else none."""
        return decoder_layers - min(self.fp32_layers, decoder_layers) if self.upcast and quant == "fp16" else 0


def dtype_name(dtype: torch.dtype) -> str:
    """`torch.bfloat16` -> `bfloat16`."""
    return str(dtype).removeprefix("torch.")


def parse_dtype(requested: str | torch.dtype) -> str:
    """A `--dtype` value (auto, bf16, fp16, fp32; long names and torch dtypes accepted)."""
    if isinstance(requested, torch.dtype):
        for short, dtype in DTYPES.items():
            if dtype == requested:
                return short
        raise FicocoError(f"unsupported dtype {requested}: choose from {', '.join(REQUESTS)}")
    aliases = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32", "float": "fp32"}
    name = aliases.get(str(requested).lower(), str(requested).lower())
    if name not in REQUESTS:
        raise FicocoError(f"unknown dtype '{requested}': choose from {', '.join(REQUESTS)}")
    return name


def _gflops(rate: float) -> str:
    return f"{rate / 1e9:.0f}" if rate >= 1e9 else f"{rate / 1e9:.2f}"


def _fits(need_bytes_by_dtype: dict[torch.dtype, float] | None, free_bytes: float | None,
          dtype: torch.dtype) -> bool:
    if need_bytes_by_dtype is None or free_bytes is None or dtype not in need_bytes_by_dtype:
        return True  # nothing known about memory: the guard decides later
    return need_bytes_by_dtype[dtype] <= free_bytes


def choose_dtype(requested: str, device: torch.device, *, need_bytes_by_dtype: dict[torch.dtype, float] | None = None,
                 free_bytes: float | None = None, native: torch.dtype | None = None,
                 upcast_need_bytes: float | None = None) -> DtypeChoice:
    """The dtypes to build in for `requested` (auto, bf16, fp16, fp32) on `device`.

    `need_bytes_by_dtype`: the memory a build needs with every weight in that dtype;
    `free_bytes`: what is free; `upcast_need_bytes`: the need of the upcast layout (16-bit
    linear weights, float32 everything else; taken as the bfloat16 need when not given).
    Without them the choice ignores memory. `native`: the dtype a checkpoint is stored in.
    An explicit dtype is kept; only float32 that does not fit becomes float32 compute on
    upcast bfloat16 weights. Memory that nothing fits in is the guard's to report.
    """
    requested = parse_dtype(requested)
    device = torch.device(device)
    upcast_need = upcast_need_bytes
    if upcast_need is None and need_bytes_by_dtype is not None:
        upcast_need = need_bytes_by_dtype.get(torch.bfloat16)
    upcast_fits = free_bytes is None or upcast_need is None or upcast_need <= free_bytes

    def no_fp32_room() -> str:
        assert need_bytes_by_dtype is not None and free_bytes is not None
        return (f"float32 weights need {need_bytes_by_dtype[torch.float32] / 1e9:.1f} GB with "
                f"{free_bytes / 1e9:.1f} GB free")

    def fp32_or_upcast(reason: str) -> DtypeChoice | None:
        if _fits(need_bytes_by_dtype, free_bytes, torch.float32):
            return DtypeChoice(torch.float32, torch.float32, reason)
        if not upcast_fits:
            return None
        return DtypeChoice(torch.bfloat16, torch.float32, upcast=True, reason=(
            f"{reason}; {no_fp32_room()}, so linear weights are stored in bfloat16 and upcast to float32 "
            "layer by layer (exact)"))

    if requested != "auto":
        dtype = DTYPES[requested]
        reason = f"requested (dtype={requested})"
        if dtype == torch.float32:
            choice = fp32_or_upcast(reason)
            if choice is not None:
                return choice
        return DtypeChoice(dtype, dtype, reason)
    if device.type == "cuda":
        if native == torch.bfloat16:
            return DtypeChoice(torch.bfloat16, torch.bfloat16, "auto on CUDA: bfloat16, the checkpoint's own dtype "
                               "(float16 may overflow its activations)")
        return DtypeChoice(torch.float16, torch.float16, "auto on CUDA: float16")
    from ficoco.machine.compute_rate import matmul_flops_per_s

    candidates = [torch.float32, torch.bfloat16] + ([] if native == torch.bfloat16 else [torch.float16])
    rates = {dtype: matmul_flops_per_s(dtype, device) for dtype in candidates}
    ranked = sorted(candidates, key=lambda d: rates[d], reverse=True)
    measured = ", ".join(f"{dtype_name(d)} {_gflops(rates[d])}" for d in ranked)
    where = f"on this CPU ({torch.backends.cpu.get_cpu_capability()}; matmul GFLOP/s {measured})"
    if native == torch.bfloat16:
        where += ", float16 left out: the checkpoint is stored in bfloat16"
    sixteen = [d for d in ranked if d != torch.float32]
    if ranked[0] != torch.float32:
        return DtypeChoice(ranked[0], ranked[0], f"auto: {dtype_name(ranked[0])} is the fastest {where}")
    fastest = f"auto: float32 is the fastest {where}"
    if _fits(need_bytes_by_dtype, free_bytes, torch.float32):
        return DtypeChoice(torch.float32, torch.float32, fastest)
    if rates[torch.float32] >= UPCAST_WORTH * rates[sixteen[0]]:
        choice = fp32_or_upcast(fastest)
        if choice is not None:
            return choice
    best = sixteen[0]
    return DtypeChoice(best, best, f"{fastest} but {no_fp32_room()}; {dtype_name(best)} is the fastest 16-bit dtype")


def row_dtypes(dtype: DtypeChoice, quant: str) -> dict[str, str]:
    """What a row of `quant` built in `dtype` says about its dtypes: storage, compute, why."""
    storage, reason = dtype_name(dtype.storage), dtype.reason
    if quant == "int8":
        storage = f"int8 linears, {dtype_name(dtype.compute)} rest"
        reason += "; bitsandbytes LLM.int8 casts activations to float16 for its int8 matmuls"
    elif quant == "int4":
        storage = f"NF4 linears, {dtype_name(dtype.compute)} rest"
        reason += f"; bitsandbytes NF4 dequantizes to {dtype_name(dtype.compute)} for its matmuls"
    elif dtype.upcast:
        storage = f"{dtype_name(dtype.storage)} (upcast linears), {dtype_name(dtype.compute)} rest"
    return {"storage_dtype": storage, "compute_dtype": dtype_name(dtype.compute), "dtype_reason": reason}
