"""A plain reference of docs/semantics.md section 6 (LLM.int8()), written from the docs/semantics.md text alone.

Exact integer maths in numpy int64; every `fl32(.)` step of the docs/semantics.md as one numpy float32
operation (numpy rounds each float32 operation once, to nearest even); conversions to fp16 / bf16
by torch (round to nearest even). Inputs and outputs are torch CPU tensors.

Where docs/semantics.md is silent, this module states what the kernels do, so that tests can pin it:
- NaN elements are left out of the row maxima (like fmaxf) and quantize to 0; a NaN makes its
  column's maximum NaN (torch's amax) and every code of that column 0; an infinite element makes its
  row's (column's) max infinite, and then quantizes to 0 (inf * 0 and inf / inf are NaN);
- a column whose max is 0 quantizes to 0s in CAt (0 / 0 is NaN), as docs/semantics.md says for rows;
- a threshold is compared with |A| exactly (|A| >= threshold over the reals).

Apple GPUs flush float32 subnormals (docs/semantics.md section 7). With `flush=True` (the default,
tests/spec_reference.py's `FLUSH`: what the kernels compute on a Mac and under the emulator's
default "apple" float mode) float32 / bfloat16 elements below 2^-126 count as zeros (of their
sign): they are never outliers, the maxima leave them out (a row of zeros and subnormals has
row_stats 0 and codes 0) and they quantize to 0; and every float32 operation of the dequantizers
(products, the bias sum, the outlier part of int8_mixed_scaled_mm) takes its operands and gives its
result below 2^-126 as signed zeros. `flush=False` is plain IEEE float32 (the emulator's "ieee"
mode, and CUDA). The int32 products are integers either way.
"""

from __future__ import annotations

import numpy as np
import torch

import spec_reference as sref

F32 = np.float32
INV127 = F32(1) / F32(127)  # fl32(1/127)
INV16129 = F32(1) / F32(16129)  # fl32(1/16129)
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _z(flush: bool | None):
    """z(x): float32 values as Apple's float32 arithmetic takes or gives them (flush: below 2^-126 as
    zeros of their sign) or as IEEE does."""
    if sref._flush(flush):
        return sref.flush_subnormals
    return lambda x: np.asarray(x, dtype=F32)


def _f32(t: torch.Tensor, flush: bool | None = False) -> np.ndarray:
    """float32 values (exact widening); with flush, those below 2^-126 as signed zeros."""
    return _z(flush)(t.detach().cpu().contiguous().float().numpy())


def _as_rows(A: torch.Tensor, flush: bool | None = False) -> np.ndarray:
    cols = A.shape[-1]
    rows = A.numel() // cols if cols else 0
    return _f32(A, flush).reshape(rows, cols)


def _outlier_mask(a: np.ndarray, threshold: float) -> np.ndarray:
    if threshold <= 0.0:
        return np.zeros(a.shape, dtype=bool)
    with np.errstate(invalid="ignore"):
        return np.abs(a).astype(np.float64) >= threshold  # exact: float32 values, a float64 threshold


def _round(v: np.ndarray) -> np.ndarray:
    """round_half_even(v) clamped to [-127, 127]; NaN gives 0."""
    with np.errstate(invalid="ignore"):
        q = np.clip(np.rint(v), -127, 127)
    return np.where(np.isnan(v), 0, q).astype(np.int8)


def _quantize_rows(a: np.ndarray, maxima: np.ndarray, flush: bool | None = None) -> np.ndarray:
    """round_half_even(a * fl32(127 * fl32(1 / max))) per row; fl32(127 / max) for max above 2^126."""
    z = _z(flush)
    m = maxima.astype(F32)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        scale = np.where(m > F32(2.0**126), z(F32(127) / m), z(F32(127) * z(F32(1) / m)))
        return _round(z(a * scale[:, None]))


def _quantize_columns(a: np.ndarray, maxima: np.ndarray, dtype: torch.dtype, flush: bool | None = None) -> np.ndarray:
    """round_half_even(float(T(a * 127)) / max) per column, T = A's dtype: torch's `A.mul(127.0) / col_stats`."""
    z = _z(flush)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        times127 = torch.from_numpy(z(a * F32(127))).to(dtype).float().numpy()
        return _round(z(times127 / maxima.astype(F32)[None, :]))


def _kept_abs(a: np.ndarray, outliers: np.ndarray) -> np.ndarray:
    """|a| with outliers and NaN as 0 (what counts toward a maximum)."""
    absa = np.abs(a)
    return np.where(outliers | np.isnan(a), F32(0), absa).astype(F32)


def _max(x: np.ndarray, axis: int) -> np.ndarray:
    if x.shape[axis] == 0:
        return np.zeros(x.shape[1 - axis], dtype=F32)
    return x.max(axis=axis).astype(F32)


def int8_vectorwise_quant(A: torch.Tensor, threshold: float = 0.0, flush: bool | None = None):
    """(CA int8 like A, row_stats float32 [rows], outlier_cols int64 or None)."""
    a = _as_rows(A, flush)
    outliers = _outlier_mask(a, threshold)
    row_stats = _max(_kept_abs(a, outliers), axis=1)
    q = _quantize_rows(a, row_stats, flush=flush)
    q[outliers] = 0
    cols = None
    if threshold > 0.0:
        cols = np.nonzero(outliers.any(axis=0))[0].astype(np.int64)
        if a.shape[0] > 1:
            q[:, cols] = 0
    return (torch.from_numpy(q).reshape(A.shape), torch.from_numpy(row_stats),
            None if cols is None else torch.from_numpy(cols))  # fmt: skip


def int8_double_quant(A: torch.Tensor, threshold: float = 0.0, flush: bool | None = None):
    """(CA, CAt, row_stats, col_stats, outlier_cols); CAt has A's shape (not transposed)."""
    CA, row_stats, cols = int8_vectorwise_quant(A, threshold, flush)
    a = _as_rows(A, flush)
    outliers = _outlier_mask(a, threshold)
    absa = np.where(outliers, F32(0), np.abs(a)).astype(F32)  # NaN kept: a NaN column's maximum is NaN
    col_stats = np.full(a.shape[1], np.nan, dtype=F32)
    has_nan = np.isnan(absa).any(axis=0)
    col_stats[~has_nan] = _max(absa[:, ~has_nan], axis=0)
    masked = np.where(outliers, F32(0), a).astype(F32)
    qt = _quantize_columns(masked, col_stats, A.dtype, flush=flush)
    return CA, torch.from_numpy(qt).reshape(A.shape), row_stats, torch.from_numpy(col_stats), cols


def int8_vectorwise_dequant(A: torch.Tensor, stats: torch.Tensor, flush: bool | None = None) -> torch.Tensor:
    """fl32(fl32(float(A) * stats[row]) * fl32(1/127)), float32."""
    z = _z(flush)
    a = _as_rows(A)
    s = _f32(stats, flush).reshape(-1)
    with np.errstate(over="ignore", invalid="ignore"):
        return torch.from_numpy(z(z(a * s[:, None]) * INV127)).reshape(A.shape)


def int8_linear_matmul(A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    """The exact integer A @ B^T (int64 arithmetic), as int32 [..., N]."""
    a = A.detach().cpu().reshape(-1, A.shape[-1]).numpy().astype(np.int64)
    b = B.detach().cpu().numpy().astype(np.int64)
    exact = a @ b.T
    assert np.abs(exact).max(initial=0) < 2**31, "the exact product does not fit int32"
    return torch.from_numpy(exact.astype(np.int32)).reshape(*A.shape[:-1], B.shape[0])


def _dequant_f32(acc: np.ndarray, row_stats, col_stats, bias, flush: bool | None = None) -> np.ndarray:
    z = _z(flush)
    rs = _f32(row_stats, flush).reshape(-1)
    cs = _f32(col_stats, flush).reshape(-1)
    with np.errstate(over="ignore", invalid="ignore"):
        v = z(z(z(acc.astype(F32) * rs[:, None]) * cs[None, :]) * INV16129)
        if bias is not None:
            v = z(v + _f32(bias, flush).reshape(-1)[None, :])
    return v


def int8_mm_dequant(A: torch.Tensor, row_stats, col_stats, dtype=None, bias=None,
                    flush: bool | None = None) -> torch.Tensor:  # fmt: skip
    """fl32(float(A) * row_stats * col_stats * fl32(1/16129)) (products left to right), + bias in
    float32, rounded once to dtype (fp16 when None)."""
    acc = A.detach().cpu().reshape(-1, A.shape[-1]).numpy()
    v = _dequant_f32(acc, row_stats, col_stats, bias, flush)
    return torch.from_numpy(v).to(dtype or torch.float16).reshape(A.shape)


def int8_scaled_mm(A, B, row_stats, col_stats, bias=None, dtype=None, flush: bool | None = None) -> torch.Tensor:
    return int8_mm_dequant(int8_linear_matmul(A, B), row_stats, col_stats, dtype or torch.float16, bias, flush)


def int8_mixed_scaled_mm(A, CA, CB, SCA, SCB, outlier_cols=None, bias=None, flush: bool | None = None):
    """(out, subA, ref64): out = int8_scaled_mm(..., A.dtype) + subA @ W.T with
    W = int8_vectorwise_dequant(CB[:, outlier_cols], SCB).to(A.dtype); `ref64` is that sum in
    float64 (the two terms are exact A.dtype values), and `out` it rounded once to A.dtype.
    subA holds A's elements as they are (a copy); with flush, their float32 / bfloat16 values below
    2^-126 count as 0 in the product (the float32 rounding and flushing of the outlier sum itself are
    `mixed_allowance`'s)."""
    scaled = int8_scaled_mm(CA, CB, SCA, SCB, bias, A.dtype, flush)
    if outlier_cols is None or outlier_cols.numel() == 0:
        return scaled, torch.empty(0, dtype=A.dtype), scaled.double()
    cols = outlier_cols.long()
    subA = A.detach().cpu()[:, cols].contiguous()
    W = int8_vectorwise_dequant(CB[:, cols].contiguous(), SCB, flush).to(A.dtype)
    a = torch.from_numpy(_f32(subA, flush)).double()
    ref64 = scaled.double() + a @ W.double().T
    return ref64.to(A.dtype), subA, ref64


def mixed_allowance(got, exact, A, CA, CB, SCA, SCB, outlier_cols, bias=None, flush: bool | None = None) -> torch.Tensor:
    """How far a float32 evaluation of int8_mixed_scaled_mm may be from `exact` (its float64 sum):
    one spacing of A's dtype (the final rounding, at either value), plus float32's rounding of
    the n_out products and additions (2^-24 relative each, of the magnitudes involved); with flush,
    plus 2^-126 for each of them (a product or partial sum below 2^-126 is 0 on Apple GPUs)."""
    cols = outlier_cols.long()
    W = int8_vectorwise_dequant(CB[:, cols].contiguous(), SCB, flush).to(A.dtype)
    terms = torch.from_numpy(_f32(A.detach().cpu()[:, cols], flush)).double().abs() @ W.double().abs().T
    terms = terms + int8_scaled_mm(CA, CB, SCA, SCB, bias, A.dtype, flush).double().abs()
    final = torch.maximum(spacing(exact, A.dtype), spacing(got, A.dtype))
    allowed = final + (cols.numel() + 1) * 2.0**-24 * terms
    if sref._flush(flush):
        allowed = allowed + 2 * (cols.numel() + 1) * 2.0**-126
    return allowed


_MANT = {torch.float16: 10, torch.bfloat16: 7, torch.float32: 23}


def spacing(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The distance between neighbouring `dtype` values at |x| (float64; subnormal spacing below
    the smallest normal)."""
    ax = x.double().abs().clamp(min=torch.finfo(dtype).tiny)
    return torch.pow(2.0, torch.floor(torch.log2(ax)) - _MANT[dtype])


def ulps_apart(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """|got - want| in units of the last place of got's dtype at want (float64)."""
    return (got.double() - want.double()).abs() / spacing(want, got.dtype)

