"""4-bit NF4/FP4 matrix products, gemv_4bit and gemm_4bit (SPEC.md section 4): argument checks."""

from __future__ import annotations

import torch

from . import validation as v
from .fourbit import packed_bytes
from .registry import checks

# What bitsandbytes' gemv/gemm schemas accept for B (read as bytes).
GEMM_STORAGE_DTYPES = (torch.uint8, torch.bfloat16, torch.float16, torch.float32)


def _check_matmul(op, A, B, shapeB, absmax, blocksize) -> None:
    v.tensor(op, "A", A, dtypes=v.FLOATS, min_ndim=1)
    v.tensor(op, "B", B, dtypes=GEMM_STORAGE_DTYPES)
    v.int_list(op, "shapeB", shapeB)
    if len(shapeB) != 2:
        raise ValueError(f"{op}: shapeB must be [N, K] (2 sizes), got {list(shapeB)}")
    if A.shape[-1] != shapeB[1]:
        raise ValueError(f"{op}: A's last dimension ({A.shape[-1]}) must equal shapeB[1] = K ({shapeB[1]})")
    v.blocksize(op, blocksize, v.BLOCKSIZES_4BIT)
    v.tensor(op, "absmax", absmax, dtypes=(torch.float32,))
    packed_bytes(op, "B", B, shapeB[0] * shapeB[1])


@checks("gemv_4bit")
def check_gemv_4bit(A, B, shapeB, absmax, code, blocksize) -> None:
    _check_gemv("gemv_4bit", A, B, shapeB, absmax, code, blocksize)


@checks("gemv_4bit.out")
def check_gemv_4bit_out(A, B, shapeB, absmax, code, blocksize, out) -> None:
    op = "gemv_4bit.out"
    _check_gemv(op, A, B, shapeB, absmax, code, blocksize)
    v.tensor(op, "out", out, dtypes=(A.dtype,))
    v.shape(op, "out", out, (*A.shape[:-1], shapeB[0]))
    v.same_device(op, A=A, out=out)


def _check_gemv(op, A, B, shapeB, absmax, code, blocksize) -> None:
    _check_matmul(op, A, B, shapeB, absmax, blocksize)
    v.tensor(op, "code", code, dtypes=(torch.float32,))
    v.numel(op, "code", code, 16)
    v.numel(op, "absmax", absmax, v.blocks(shapeB[0] * shapeB[1], blocksize), at_least=True)
    v.same_device(op, A=A, B=B, absmax=absmax, code=code)


@checks("gemm_4bit")
def check_gemm_4bit(
    A, B, shapeB, absmax, blocksize, quant_type, bias=None, absmax_8bit=None, absmax_code=None, absmax_offset=None
) -> None:
    op = "gemm_4bit"
    _check_matmul(op, A, B, shapeB, absmax, blocksize)
    v.quant_type(op, quant_type)
    nblocks = v.blocks(shapeB[0] * shapeB[1], blocksize)
    if absmax_8bit is None:
        if absmax_code is not None or absmax_offset is not None:
            raise ValueError(f"{op}: absmax_code and absmax_offset are only used together with absmax_8bit")
        v.numel(op, "absmax", absmax, nblocks, at_least=True)
    else:
        # Nested (double) quantization: absmax holds the per-256-block scales of absmax_8bit.
        v.tensor(op, "absmax_8bit", absmax_8bit, dtypes=(torch.uint8,), ndim=1)
        v.numel(op, "absmax_8bit", absmax_8bit, nblocks, at_least=True)
        v.tensor(op, "absmax_code", absmax_code, dtypes=(torch.float32,), ndim=1)
        v.numel(op, "absmax_code", absmax_code, 256)
        v.tensor(op, "absmax_offset", absmax_offset, dtypes=v.FLOATS)
        v.numel(op, "absmax_offset", absmax_offset, 1)
        v.numel(op, "absmax", absmax, v.blocks(nblocks, 256), at_least=True)
    if bias is not None:
        v.tensor(op, "bias", bias, dtypes=(A.dtype,), ndim=1)
        v.numel(op, "bias", bias, shapeB[0])
    v.same_device(
        op, A=A, B=B, absmax=absmax, bias=bias, absmax_8bit=absmax_8bit, absmax_code=absmax_code,
        absmax_offset=absmax_offset,
    )  # fmt: skip
