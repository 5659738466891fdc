"""LLM.int8() ops (SPEC.md section 6): argument checks."""

from __future__ import annotations

import torch

from . import validation as v
from .registry import checks, composite

INDEX_DTYPES = (torch.int64, torch.int32)


def _rows(A: torch.Tensor) -> int:
    return A.numel() // A.shape[-1] if A.dim() and A.shape[-1] else 0


def _check_quant(op, A, threshold) -> None:
    v.tensor(op, "A", A, dtypes=v.FLOATS, min_ndim=2)
    v.number(op, "threshold", threshold, minimum=0.0)


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
    v.tensor(op, "stats", stats, dtypes=(torch.float32,))
    v.numel(op, "stats", stats, _rows(A))
    v.same_device(op, A=A, stats=stats)


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


@composite("int8_double_quant")
def int8_double_quant_cpu(A: torch.Tensor, threshold: float = 0.0):
    """Row- and column-wise int8 quantization as bitsandbytes' CUDA backend composes it.

    Rows come from `int8_vectorwise_quant` (outlier columns zeroed); columns are scaled by their
    absmax over non-outlier elements (|A| >= threshold are outliers when threshold > 0), with
    outliers zeroed before rounding half to even.
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
    quant_col = torch.round(A.mul(127.0) / col_stats.unsqueeze(0)).to(torch.int8)
    return quant_row, quant_col, row_stats, col_stats, outlier_cols
