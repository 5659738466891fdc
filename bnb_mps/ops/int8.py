"""LLM.int8() ops (docs/semantics.md section 6): argument checks and kernel launchers.

Launchers allocate outputs once on the input's device and launch kernels of
`csrc/kernels/int8.metal` by host name, with the geometry documented there:

- int8_vectorwise_quant: one launch; with a threshold two (rows + outlier flags, then the outlier
  list and the zeroing of outlier columns), followed by the one host read below.
- int8_double_quant: two launches (row and column statistics in one pass over A, then both
  quantizations in one pass); with a threshold a third for the outlier list, then the host read.
- int8_vectorwise_dequant, int8_mm_dequant, int8_linear_matmul(.out), int8_scaled_mm,
  int8_mixed_scaled_mm: one launch each; the scaled products never write the int32 matrix.

The outlier columns (threshold > 0) are the only output whose size depends on the data. The
kernels write them into a buffer with room for every column plus their count; after every
launch of the op is enqueued, the op reads that one count on the host and returns a view of the
first `count` entries. Reading the count last lets the GPU work through the whole op before the
host waits; a count read first (to size the output, then launch) would stall in mid-op. Either
way bitsandbytes' int64 index list needs its length on the host (its own CUDA path reads it
twice: `outliers.any()` and `argwhere`). Under torch's FakeTensorMode the read becomes an
unbacked symbolic size, as bitsandbytes' fake kernels declare. Nothing else reads the device.
"""

from __future__ import annotations

import math
import struct
from typing import Optional

import torch

from ..kernel_args import uint32
from . import validation as v
from .launch import DTYPE_NAMES, aligned, check_size, flat, into
from .registry import checks, composite, kernel

INDEX_DTYPES = (torch.int64, torch.int32)

# -- checks ---------------------------------------------------------------------------------------


def _rows(A: torch.Tensor) -> int:
    """numel / A.shape[-1] (docs/semantics.md), also when the last dimension is 0."""
    return math.prod(A.shape[:-1]) if A.dim() else 0


def _check_quant(op, A, threshold) -> None:
    v.tensor(op, "A", A, dtypes=v.FLOATS, min_ndim=2)
    # (a threshold that is not > 0, negative or NaN included, means no outliers, as in bitsandbytes)
    v.number(op, "threshold", threshold)


@checks("int8_vectorwise_quant")
def int8_vectorwise_quant(A, threshold=0.0) -> None:
    _check_quant("int8_vectorwise_quant", A, threshold)


@checks("int8_double_quant")
def int8_double_quant(A, threshold=0.0) -> None:
    _check_quant("int8_double_quant", A, threshold)


@checks("int8_vectorwise_dequant")
def int8_vectorwise_dequant(A, stats) -> None:
    op = "int8_vectorwise_dequant"
    v.tensor(op, "A", A, dtypes=(torch.int8,), min_ndim=1)
    v.tensor(op, "stats", stats, dtypes=v.FLOATS)
    v.numel(op, "stats", stats, _rows(A))
    v.same_device(op, A=A, stats=stats)
    # (bitsandbytes' pure-PyTorch dequantize, what serves mps without bnb_mps, takes stats of any float dtype)
    v.covered_dtype("stats", stats, (torch.float32,), v.FLOATS)


def _check_matmul(op, A, B) -> None:
    v.tensor(op, "A", A, dtypes=(torch.int8,), min_ndim=1)
    v.tensor(op, "B", B, dtypes=(torch.int8,), ndim=2)
    if A.shape[-1] != B.shape[-1]:
        raise ValueError(f"{op}: A's last dimension ({A.shape[-1]}) must equal B's ({B.shape[-1]}) (B is [N, K])")


@checks("int8_linear_matmul")
def int8_linear_matmul(A, B) -> None:
    op = "int8_linear_matmul"
    _check_matmul(op, A, B)
    v.same_device(op, A=A, B=B)


@checks("int8_linear_matmul.out")
def int8_linear_matmul_out(A, B, out) -> None:
    op = "int8_linear_matmul.out"
    _check_matmul(op, A, B)
    v.tensor(op, "out", out, dtypes=(torch.int32,))
    v.shape(op, "out", out, (*A.shape[:-1], B.shape[0]))
    v.same_device(op, A=A, B=B, out=out)


def _check_stats(op, rows: int, cols: int, row_stats, col_stats, bias) -> None:
    v.tensor(op, "row_stats", row_stats, dtypes=(torch.float32,))
    v.numel(op, "row_stats", row_stats, rows)
    v.tensor(op, "col_stats", col_stats, dtypes=(torch.float32,))
    v.numel(op, "col_stats", col_stats, cols)
    if bias is not None:
        v.tensor(op, "bias", bias, dtypes=v.FLOATS)
        v.numel(op, "bias", bias, cols)


@checks("int8_mm_dequant")
def int8_mm_dequant(A, row_stats, col_stats, dtype=None, bias=None) -> None:
    op = "int8_mm_dequant"
    v.tensor(op, "A", A, dtypes=(torch.int32,), min_ndim=2)
    _check_stats(op, _rows(A), A.shape[-1], row_stats, col_stats, bias)
    v.dtype_arg(op, "dtype", dtype, optional=True)
    v.same_device(op, A=A, row_stats=row_stats, col_stats=col_stats, bias=bias)


@checks("int8_scaled_mm")
def int8_scaled_mm(A, B, row_stats, col_stats, bias=None, dtype=None) -> None:
    op = "int8_scaled_mm"
    _check_matmul(op, A, B)
    _check_stats(op, _rows(A), B.shape[0], row_stats, col_stats, bias)
    v.dtype_arg(op, "dtype", dtype, optional=True)
    v.same_device(op, A=A, B=B, row_stats=row_stats, col_stats=col_stats, bias=bias)


@checks("int8_mixed_scaled_mm")
def int8_mixed_scaled_mm(A, CA, CB, SCA, SCB, outlier_cols=None, bias=None) -> None:
    op = "int8_mixed_scaled_mm"
    v.tensor(op, "A", A, dtypes=v.FLOATS, ndim=2)
    v.tensor(op, "CA", CA, dtypes=(torch.int8,))
    v.shape(op, "CA", CA, A.shape)
    _check_matmul(op, CA, CB)
    _check_stats(op, _rows(A), CB.shape[0], SCA, SCB, bias)
    v.tensor(op, "outlier_cols", outlier_cols, dtypes=INDEX_DTYPES, ndim=1, optional=True)
    v.same_device(op, A=A, CA=CA, CB=CB, SCA=SCA, SCB=SCB, outlier_cols=outlier_cols, bias=bias)


# -- kernels --------------------------------------------------------------------------------------

# Row kernels: threads per threadgroup (a multiple of 32, at most 256) for a row of `cols`
# elements, about 16 elements per thread.
def _row_threads(cols: int) -> int:
    threads = 32
    while threads < 256 and threads * 16 < cols:
        threads *= 2
    return threads


# Element-wise kernels: 256 threads of 4 elements.
_ELEMENTWISE_THREADS = 256
_ELEMENTS_PER_THREADGROUP = 4 * _ELEMENTWISE_THREADS
# bnb_int8_outlier_finish: threads per threadgroup.
_FINISH_THREADS = 256
# Rows per threadgroup of bnb_int8_double_quant_stats.
_STATS_ROWS = 32
_FLOAT32_INF_BITS = 0x7F800000


def _threshold_bits(threshold: float) -> int:
    """Bit pattern of the smallest float32 >= threshold (> 0): for every float32 x, |x| >= that
    float is exactly the real comparison |x| >= threshold (docs/semantics.md: outliers are |A| >= threshold)."""
    try:
        nearest = struct.unpack("<f", struct.pack("<f", threshold))[0]
    except OverflowError:  # beyond the float32 range: only infinities reach it
        return _FLOAT32_INF_BITS
    bits = struct.unpack("<I", struct.pack("<f", nearest))[0]
    return bits + 1 if nearest < threshold else bits


def _rows_cols(A: torch.Tensor) -> tuple[int, int]:
    return _rows(A), A.shape[-1]


def _outlier_workspace(cols: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(flags, count): zeroed flag words for `cols` columns and the slot for the outlier count, in
    one small allocation (proportional to the activation width, not to any weight)."""
    words = -(-cols // 32)
    work = torch.zeros(words + 1, dtype=torch.int32, device=device)
    return work[:words], work[words:]


def _finish_outliers(executor, flags, count, CA, rows_to_zero: int, cols: int) -> torch.Tensor:
    """Launches bnb_int8_outlier_finish (outlier list, and the zeroing of outlier columns in the
    first `rows_to_zero` rows of CA), then reads the count: the ops' one host read."""
    outlier_cols = torch.empty(cols, dtype=torch.int64, device=flags.device)
    words = flags.numel()
    executor.launch(
        "bnb_int8_outlier_finish",
        grid=(1 + -(-rows_to_zero * words // _FINISH_THREADS), 1, 1),
        threadgroup=(_FINISH_THREADS, 1, 1),
        args=[flags, CA, outlier_cols, count, uint32(cols), uint32(rows_to_zero)],
    )
    n = count[0].item()  # the one host read (see the module docstring)
    torch._check(n >= 0)
    torch._check(n <= cols)
    return outlier_cols.narrow(0, 0, n)


@kernel("int8_vectorwise_quant")
def int8_vectorwise_quant_kernel(executor, A: torch.Tensor, threshold=0.0):
    op = "int8_vectorwise_quant"
    check_size(op, "A", A.numel())
    rows, cols = _rows_cols(A)
    CA = torch.empty(A.shape, dtype=torch.int8, device=A.device)
    row_stats = torch.empty(rows, dtype=torch.float32, device=A.device)
    outliers = threshold > 0.0
    if A.numel() == 0:  # rows of no elements have max 0
        return CA, row_stats.zero_(), (torch.empty(0, dtype=torch.int64, device=A.device) if outliers else None)
    dt = DTYPE_NAMES[A.dtype]
    geometry = dict(grid=(rows, 1, 1), threadgroup=(_row_threads(cols), 1, 1))
    if not outliers:
        executor.launch(f"bnb_int8_vectorwise_quant_{dt}", **geometry,
                        args=[aligned(A), CA, row_stats, uint32(cols)])  # fmt: skip
        return CA, row_stats, None
    flags, count = _outlier_workspace(cols, A.device)
    executor.launch(f"bnb_int8_vectorwise_quant_outliers_{dt}", **geometry,
                    args=[aligned(A), CA, row_stats, uint32(cols), flags, uint32(_threshold_bits(threshold))])  # fmt: skip
    # One row: every element of an outlier column is an outlier, already 0 (docs/semantics.md: rows > 1 only).
    outlier_cols = _finish_outliers(executor, flags, count, CA, rows if rows > 1 else 0, cols)
    return CA, row_stats, outlier_cols


@kernel("int8_double_quant")
def int8_double_quant_kernel(executor, A: torch.Tensor, threshold=0.0):
    op = "int8_double_quant"
    check_size(op, "A", A.numel())
    rows, cols = _rows_cols(A)
    device = A.device
    CA = torch.empty(A.shape, dtype=torch.int8, device=device)
    CAt = torch.empty(A.shape, dtype=torch.int8, device=device)
    row_stats = torch.empty(rows, dtype=torch.float32, device=device)
    col_stats = torch.zeros(cols, dtype=torch.float32, device=device)  # pass 1 takes atomic maxima
    outliers = threshold > 0.0
    if A.numel() == 0:
        empty_cols = torch.empty(0, dtype=torch.int64, device=device) if outliers else None
        return CA, CAt, row_stats.zero_(), col_stats, empty_cols
    dt = DTYPE_NAMES[A.dtype]
    A = aligned(A)
    threads = _row_threads(cols)
    stats = dict(grid=(-(-rows // _STATS_ROWS), 1, 1), threadgroup=(threads, 1, 1))
    apply_threads = min(threads, max(32, 32 * -(-cols // 128)))
    apply = dict(grid=(-(-cols // (4 * apply_threads)), rows, 1), threadgroup=(apply_threads, 1, 1))
    if not outliers:
        executor.launch(f"bnb_int8_double_quant_stats_{dt}", **stats,
                        args=[A, row_stats, col_stats, uint32(rows), uint32(cols)])  # fmt: skip
        executor.launch(f"bnb_int8_double_quant_apply_{dt}", **apply,
                        args=[A, row_stats, col_stats, CA, CAt, uint32(cols)])  # fmt: skip
        return CA, CAt, row_stats, col_stats, None
    tb = uint32(_threshold_bits(threshold))
    flags, count = _outlier_workspace(cols, device)
    executor.launch(f"bnb_int8_double_quant_stats_outliers_{dt}", **stats,
                    args=[A, row_stats, col_stats, uint32(rows), uint32(cols), flags, tb])  # fmt: skip
    executor.launch(f"bnb_int8_double_quant_apply_outliers_{dt}", **apply,
                    args=[A, row_stats, col_stats, CA, CAt, uint32(cols), flags, tb, uint32(rows > 1)])  # fmt: skip
    outlier_cols = _finish_outliers(executor, flags, count, CA, 0, cols)  # CA's columns are zeroed already
    return CA, CAt, row_stats, col_stats, outlier_cols


@kernel("int8_vectorwise_dequant")
def int8_vectorwise_dequant_kernel(executor, A: torch.Tensor, stats: torch.Tensor):
    n = A.numel()
    check_size("int8_vectorwise_dequant", "A", n)
    out = torch.empty(A.shape, dtype=torch.float32, device=A.device)
    if n == 0:
        return out
    executor.launch(
        "bnb_int8_vectorwise_dequant",
        grid=(-(-n // _ELEMENTS_PER_THREADGROUP), 1, 1),
        threadgroup=(_ELEMENTWISE_THREADS, 1, 1),
        args=[aligned(A), flat(stats), out, uint32(n), uint32(A.shape[-1])],
    )
    return out


def _bias_binding(bias: Optional[torch.Tensor], out_dtype: torch.dtype, dummy: torch.Tensor):
    """(tensor to bind, host-name tag, has_bias) for a bias added in float32 before the single
    rounding to `out_dtype`: bound as is when it has the output's dtype or float32 (the `_f32bias`
    kernels), else widened to float32 (exact; N elements)."""
    if bias is None:
        return dummy, "", 0
    bias = flat(bias)
    if bias.dtype == out_dtype:
        return bias, "", 1
    if bias.dtype != torch.float32:
        bias = bias.float()
    return bias, ("" if out_dtype == torch.float32 else "_f32bias"), 1


@kernel("int8_mm_dequant")
def int8_mm_dequant_kernel(executor, A, row_stats, col_stats, dtype=None, bias=None):
    n = A.numel()
    check_size("int8_mm_dequant", "A", n)
    dtype = dtype or torch.float16
    out = torch.empty(A.shape, dtype=dtype, device=A.device)
    if n == 0:
        return out
    row_stats = flat(row_stats)
    bias_arg, tag, has_bias = _bias_binding(bias, dtype, row_stats)
    executor.launch(
        f"bnb_int8_mm_dequant_{DTYPE_NAMES[dtype]}{tag}",
        grid=(-(-n // _ELEMENTS_PER_THREADGROUP), 1, 1),
        threadgroup=(_ELEMENTWISE_THREADS, 1, 1),
        args=[aligned(A), row_stats, flat(col_stats), bias_arg, out, uint32(n), uint32(A.shape[-1]),
              uint32(has_bias)],
    )  # fmt: skip
    return out


# -- products ---------------------------------------------------------------------------------------

_MATMUL_THREADS = 128


def matmul_path(M: int, K: int) -> tuple[str, tuple[int, int]]:
    """(host-name suffix, (rows of A, outputs along N) per threadgroup) of the product kernels for
    M rows of A: gemv for M <= 8 (integer-exact per-lane sums), simdgroup_matrix tiles above."""
    if M == 1:
        path, tile = "gemv1", (1, 16)
    elif M <= 8:
        path, tile = "gemv4", (4, 16)
    elif M <= 32:
        path, tile = "tile32", (32, 64)
    else:
        path, tile = "tile64", (64, 64)
    return path + ("_k16" if K % 16 == 0 else ""), tile


def _matmul_launch(executor, name: str, M: int, N: int, K: int, args_before_dims: list, args_after_dims: list) -> None:
    path, (tm, tn) = matmul_path(M, K)
    executor.launch(
        f"{name}_{path}",
        grid=(-(-N // tn), -(-M // tm), 1),
        threadgroup=(_MATMUL_THREADS, 1, 1),
        args=[*args_before_dims, uint32(M), uint32(N), uint32(K), *args_after_dims],
    )


def _check_product_sizes(op: str, A: torch.Tensor, B: torch.Tensor, M: int, N: int) -> None:
    check_size(op, "A", A.numel())
    check_size(op, "B", B.numel())
    check_size(op, "out", M * N)


def _operands(A: torch.Tensor, B: torch.Tensor, K: int, dummy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A and B bound flat and 16-byte aligned; with K == 0 (nothing is read) any buffer."""
    if K == 0:
        return dummy, dummy
    return aligned(A), aligned(B)


def _linear_matmul_into(executor, out: torch.Tensor, A: torch.Tensor, B: torch.Tensor) -> None:
    K, N = A.shape[-1], B.shape[0]
    M = math.prod(A.shape[:-1])
    if M == 0 or N == 0:
        return
    if K == 0:
        out.zero_()
        return
    a, b = _operands(A, B, K, out)
    _matmul_launch(executor, "bnb_int8_linear_matmul", M, N, K, [a, b, out], [])


@kernel("int8_linear_matmul")
def int8_linear_matmul_kernel(executor, A, B):
    M, N = math.prod(A.shape[:-1]), B.shape[0]
    _check_product_sizes("int8_linear_matmul", A, B, M, N)
    out = torch.empty((*A.shape[:-1], N), dtype=torch.int32, device=A.device)
    _linear_matmul_into(executor, out, A, B)
    return out


@kernel("int8_linear_matmul.out")
def int8_linear_matmul_out_kernel(executor, A, B, out) -> None:
    _check_product_sizes("int8_linear_matmul.out", A, B, math.prod(A.shape[:-1]), B.shape[0])
    into(out, lambda target: _linear_matmul_into(executor, target, A, B))


def _scaled_mm(executor, A, B, row_stats, col_stats, bias, dtype, mixed=None) -> torch.Tensor:
    """int8_scaled_mm into a new [..., N] tensor of `dtype`; `mixed` = (Afp, outlier_cols int64,
    subA) adds the fp outlier columns (int8_mixed_scaled_mm) in the same launch."""
    K, N = A.shape[-1], B.shape[0]
    M = math.prod(A.shape[:-1])
    out = torch.empty((*A.shape[:-1], N), dtype=dtype, device=A.device)
    if M == 0 or N == 0:
        return out
    row_stats = flat(row_stats)
    a, b = _operands(A, B, K, row_stats)
    bias_arg, tag, has_bias = _bias_binding(bias, dtype, row_stats)
    if mixed is None:  # buffers 10-12 are not read when n_out == 0
        extra = [out, row_stats, out, uint32(0)]
    else:
        Afp, outlier_cols, subA = mixed
        extra = [Afp, outlier_cols, subA, uint32(outlier_cols.numel())]
    _matmul_launch(executor, f"bnb_int8_scaled_mm_{DTYPE_NAMES[dtype]}{tag}", M, N, K,
                   [a, b, row_stats, flat(col_stats), bias_arg, out], [uint32(has_bias), *extra])  # fmt: skip
    return out


@kernel("int8_scaled_mm")
def int8_scaled_mm_kernel(executor, A, B, row_stats, col_stats, bias=None, dtype=None):
    M, N = math.prod(A.shape[:-1]), B.shape[0]
    _check_product_sizes("int8_scaled_mm", A, B, M, N)
    return _scaled_mm(executor, A, B, row_stats, col_stats, bias, dtype or torch.float16)


@kernel("int8_mixed_scaled_mm")
def int8_mixed_scaled_mm_kernel(executor, A, CA, CB, SCA, SCB, outlier_cols=None, bias=None):
    op = "int8_mixed_scaled_mm"
    M, N = CA.shape[0], CB.shape[0]
    _check_product_sizes(op, CA, CB, M, N)
    if outlier_cols is None or outlier_cols.numel() == 0:
        subA = torch.empty(0, dtype=A.dtype, device=A.device)
        return _scaled_mm(executor, CA, CB, SCA, SCB, bias, A.dtype), subA
    n_out = outlier_cols.numel()
    check_size(op, "subA", M * n_out)
    subA = torch.empty((M, n_out), dtype=A.dtype, device=A.device)
    cols = flat(outlier_cols if outlier_cols.dtype == torch.int64 else outlier_cols.to(torch.int64))
    return _scaled_mm(executor, CA, CB, SCA, SCB, bias, A.dtype, mixed=(aligned(A), cols, subA)), subA


# -- the CPU fallback's compositions -----------------------------------------------------------------


@composite("int8_linear_matmul")
def int8_linear_matmul_cpu(A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    """The exact int32 product on every CPU. bitsandbytes 0.50.2's CPU path multiplies in float32
    where the CPU lacks AVX-512 (Macs included), which is not exact once partial sums pass 2^24
    (docs/semantics.md section 6); float64 products and sums of int8 values are exact (every
    partial sum is an integer below K * 127^2 < 2^53)."""
    K = A.shape[-1]
    out = torch.matmul(A.reshape(-1, K).double(), B.double().t())
    return out.to(torch.int32).reshape(*A.shape[:-1], B.shape[0])


@composite("int8_double_quant")
def int8_double_quant_cpu(A: torch.Tensor, threshold: float = 0.0):
    """Row- and column-wise int8 quantization as bitsandbytes' CUDA backend composes it.

    Rows come from `int8_vectorwise_quant` (outlier columns zeroed); columns are scaled by their
    absmax over non-outlier elements (|A| >= threshold are outliers when threshold > 0), with
    outliers zeroed before rounding half to even, in A's dtype as that backend computes them:
    col_stats = amax(|A|) (NaN propagates), CAt = round(float(T(A * 127)) / col_stats)
    (docs/semantics.md section 6, and the kernels); NaN codes (0 / 0, a NaN column) are 0, an infinite
    quotient (A * 127 beyond T's range) is clamped to +-127.
    """
    quant_row, row_stats, outlier_cols = torch.ops.bitsandbytes.int8_vectorwise_quant.default(A, threshold)
    absA = A.abs().reshape(-1, A.shape[-1])
    outliers = None
    if threshold > 0.0:
        outliers = absA >= threshold
        absA = absA.masked_fill(outliers, 0.0)
    col_stats = absA.amax(dim=0).float()
    if outliers is not None:
        A = A.masked_fill(outliers.reshape(A.shape), 0.0)
    scaled = A.reshape(-1, A.shape[-1]).mul(127.0) / col_stats.unsqueeze(0)  # T(A * 127), then float32
    quant_col = torch.round(scaled).nan_to_num(0.0).clamp(-127, 127).to(torch.int8).reshape(A.shape)
    return quant_row, quant_col, row_stats, col_stats, outlier_cols
