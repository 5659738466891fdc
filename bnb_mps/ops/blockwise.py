"""8-bit blockwise quantization (SPEC.md section 2): argument checks."""

from __future__ import annotations

import torch

from . import validation as v
from .registry import checks


def _code(op: str, code) -> None:
    v.tensor(op, "code", code, dtypes=(torch.float32,))
    v.numel(op, "code", code, 256)


@checks("quantize_blockwise")
def quantize_blockwise(A, code, blocksize) -> None:
    op = "quantize_blockwise"
    v.tensor(op, "A", A, dtypes=v.FLOATS)
    _code(op, code)
    v.blocksize(op, blocksize, v.BLOCKSIZES_8BIT)
    v.same_device(op, A=A, code=code)


@checks("dequantize_blockwise")
def dequantize_blockwise(A, absmax, code, blocksize, dtype) -> None:
    _check_dequantize("dequantize_blockwise", A, absmax, code, blocksize, dtype)


@checks("dequantize_blockwise.out")
def dequantize_blockwise_out(A, absmax, code, blocksize, dtype, out) -> None:
    op = "dequantize_blockwise.out"
    _check_dequantize(op, A, absmax, code, blocksize, dtype)
    v.tensor(op, "out", out, dtypes=(dtype,))
    v.shape(op, "out", out, A.shape)
    v.same_device(op, A=A, out=out)


def _check_dequantize(op, A, absmax, code, blocksize, dtype) -> None:
    v.tensor(op, "A", A, dtypes=(torch.uint8,))
    v.tensor(op, "absmax", absmax, dtypes=(torch.float32,))
    _code(op, code)
    v.blocksize(op, blocksize, v.BLOCKSIZES_8BIT)
    v.dtype_arg(op, "dtype", dtype)
    v.numel(op, "absmax", absmax, v.blocks(A.numel(), blocksize), at_least=True)
    v.same_device(op, A=A, absmax=absmax, code=code)
