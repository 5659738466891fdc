"""A plain reference of docs/semantics.md section 6 (LLM.int8()), written from the docs/semantics.md text alone.

Exact integer maths in numpy int64; every `fl32(.)` step of the docs/semantics.md as one numpy float32
operation (numpy rounds each float32 operation once, to nearest even); conversions to fp16 / bf16
by torch (round to nearest even). Inputs and outputs are torch CPU tensors.

Where docs/semantics.md is silent, this module states what the kernels do, so that tests can pin it:
- NaN elements are left out of the maxima (like fmaxf) and quantize to 0; an infinite element
  makes its row's (column's) max infinite, and then quantizes to 0 (inf * fl32(127 / inf) = NaN);
- a column whose max is 0 quantizes to 0s in CAt, as docs/semantics.md says for rows;
- a threshold is compared with |A| exactly (|A| >= threshold over the reals).
"""

from __future__ import annotations

import numpy as np
import torch

F32 = np.float32
INV127 = F32(1) / F32(127)  # fl32(1/127)
INV16129 = F32(1) / F32(16129)  # fl32(1/16129)
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _f32(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().contiguous().float().numpy()


def _as_rows(A: torch.Tensor) -> np.ndarray:
    cols = A.shape[-1]
    rows = A.numel() // cols if cols else 0
    return _f32(A).reshape(rows, cols)


def _outlier_mask(a: np.ndarray, threshold: float) -> np.ndarray:
    if threshold <= 0.0:
        return np.zeros(a.shape, dtype=bool)
    with np.errstate(invalid="ignore"):
        return np.abs(a).astype(np.float64) >= threshold  # exact: float32 values, a float64 threshold


def _quantize(a: np.ndarray, maxima: np.ndarray, axis: int) -> np.ndarray:
    """round_half_even(a * fl32(127 / max)) clamped to [-127, 127]; NaN products give 0."""
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        scale = F32(127) / maxima.astype(F32)
        v = a * (scale[:, None] if axis == 1 else scale[None, :])
        q = np.clip(np.rint(v), -127, 127)
    return np.where(np.isnan(v), 0, q).astype(np.int8)


def _kept_abs(a: np.ndarray, outliers: np.ndarray) -> np.ndarray:
    """|a| with outliers and NaN as 0 (what counts toward a maximum)."""
    absa = np.abs(a)
    return np.where(outliers | np.isnan(a), F32(0), absa).astype(F32)


def _max(x: np.ndarray, axis: int) -> np.ndarray:
    if x.shape[axis] == 0:
        return np.zeros(x.shape[1 - axis], dtype=F32)
    return x.max(axis=axis).astype(F32)


def int8_vectorwise_quant(A: torch.Tensor, threshold: float = 0.0):
    """(CA int8 like A, row_stats float32 [rows], outlier_cols int64 or None)."""
    a = _as_rows(A)
    outliers = _outlier_mask(a, threshold)
    row_stats = _max(_kept_abs(a, outliers), axis=1)
    q = _quantize(a, row_stats, axis=1)
    q[outliers] = 0
    cols = None
    if threshold > 0.0:
        cols = np.nonzero(outliers.any(axis=0))[0].astype(np.int64)
        if a.shape[0] > 1:
            q[:, cols] = 0
    return (torch.from_numpy(q).reshape(A.shape), torch.from_numpy(row_stats),
            None if cols is None else torch.from_numpy(cols))  # fmt: skip


def int8_double_quant(A: torch.Tensor, threshold: float = 0.0):
    """(CA, CAt, row_stats, col_stats, outlier_cols); CAt has A's shape (not transposed)."""
    CA, row_stats, cols = int8_vectorwise_quant(A, threshold)
    a = _as_rows(A)
    outliers = _outlier_mask(a, threshold)
    col_stats = _max(_kept_abs(a, outliers), axis=0)
    masked = np.where(outliers, F32(0), a).astype(F32)
    qt = _quantize(masked, col_stats, axis=0)
    return CA, torch.from_numpy(qt).reshape(A.shape), row_stats, torch.from_numpy(col_stats), cols


def int8_vectorwise_dequant(A: torch.Tensor, stats: torch.Tensor) -> torch.Tensor:
    """fl32(fl32(float(A) * stats[row]) * fl32(1/127)), float32."""
    a = _as_rows(A)
    s = _f32(stats).reshape(-1)
    return torch.from_numpy((a * s[:, None]) * INV127).reshape(A.shape)


def int8_linear_matmul(A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    """The exact integer A @ B^T (int64 arithmetic), as int32 [..., N]."""
    a = A.detach().cpu().reshape(-1, A.shape[-1]).numpy().astype(np.int64)
    b = B.detach().cpu().numpy().astype(np.int64)
    exact = a @ b.T
    assert np.abs(exact).max(initial=0) < 2**31, "the exact product does not fit int32"
    return torch.from_numpy(exact.astype(np.int32)).reshape(*A.shape[:-1], B.shape[0])


def _dequant_f32(acc: np.ndarray, row_stats, col_stats, bias) -> np.ndarray:
    rs = _f32(row_stats).reshape(-1)
    cs = _f32(col_stats).reshape(-1)
    v = ((acc.astype(F32) * rs[:, None]) * cs[None, :]) * INV16129
    if bias is not None:
        v = v + _f32(bias).reshape(-1)[None, :]
    return v


def int8_mm_dequant(A: torch.Tensor, row_stats, col_stats, dtype=None, bias=None) -> torch.Tensor:
    """fl32(float(A) * row_stats * col_stats * fl32(1/16129)) (products left to right), + bias in
    float32, rounded once to dtype (fp16 when None)."""
    acc = A.detach().cpu().reshape(-1, A.shape[-1]).numpy()
    v = _dequant_f32(acc, row_stats, col_stats, bias)
    return torch.from_numpy(v).to(dtype or torch.float16).reshape(A.shape)


def int8_scaled_mm(A, B, row_stats, col_stats, bias=None, dtype=None) -> torch.Tensor:
    return int8_mm_dequant(int8_linear_matmul(A, B), row_stats, col_stats, dtype or torch.float16, bias)


def int8_mixed_scaled_mm(A, CA, CB, SCA, SCB, outlier_cols=None, bias=None):
    """(out, subA, ref64): out = int8_scaled_mm(..., A.dtype) + subA @ W.T with
    W = int8_vectorwise_dequant(CB[:, outlier_cols], SCB).to(A.dtype); `ref64` is that sum in
    float64 (the two terms are exact A.dtype values), and `out` it rounded once to A.dtype."""
    scaled = int8_scaled_mm(CA, CB, SCA, SCB, bias, A.dtype)
    if outlier_cols is None or outlier_cols.numel() == 0:
        return scaled, torch.empty(0, dtype=A.dtype), scaled.double()
    cols = outlier_cols.long()
    subA = A.detach().cpu()[:, cols].contiguous()
    W = int8_vectorwise_dequant(CB[:, cols].contiguous(), SCB).to(A.dtype)
    ref64 = scaled.double() + subA.double() @ W.double().T
    return ref64.to(A.dtype), subA, ref64


def mixed_allowance(got, exact, A, CA, CB, SCA, SCB, outlier_cols, bias=None) -> torch.Tensor:
    """How far a float32 evaluation of int8_mixed_scaled_mm may be from `exact` (its float64 sum):
    one spacing of A's dtype (the final rounding, at either value), plus float32's rounding of
    the n_out products and additions (2^-24 relative each, of the magnitudes involved)."""
    cols = outlier_cols.long()
    W = int8_vectorwise_dequant(CB[:, cols].contiguous(), SCB).to(A.dtype)
    terms = A.detach().cpu()[:, cols].double().abs() @ W.double().abs().T
    terms = terms + int8_scaled_mm(CA, CB, SCA, SCB, bias, A.dtype).double().abs()
    final = torch.maximum(spacing(exact, A.dtype), spacing(got, A.dtype))
    return final + (cols.numel() + 1) * 2.0**-24 * terms


_MANT = {torch.float16: 10, torch.bfloat16: 7, torch.float32: 23}


def spacing(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The distance between neighbouring `dtype` values at |x| (float64; subnormal spacing below
    the smallest normal)."""
    ax = x.double().abs().clamp(min=torch.finfo(dtype).tiny)
    return torch.pow(2.0, torch.floor(torch.log2(ax)) - _MANT[dtype])


def ulps_apart(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """|got - want| in units of the last place of got's dtype at want (float64)."""
    return (got.double() - want.double()).abs() / spacing(want, got.dtype)

