"""The `dequantize+linear` route of gemm_4bit: the weight dequantized by bnb-mps' kernels into a
temporary in A's dtype, then `torch.nn.functional.linear` (on mps: Apple's tuned MPS matmul).

What stock bitsandbytes runs on mps for every gemm_4bit, computed with bnb-mps' verified kernels:
nested block scales are first dequantized (`dequantize_blockwise`, blocks of 256) and the offset
added in float32, as bitsandbytes does; the weight is dequantized (`dequantize_4bit`) to A's dtype
and the bias goes to `linear`. Its result is docs/semantics.md section 4's reference product itself
(dequantize, then a matmul), computed by torch's matmul.

It allocates a temporary as large as the weight in A's dtype (4 times the packed weight in float16)
on every call, which the project's rules allow only where the user's GPU measured it faster: it is
a tuning candidate (bnb_mps.ops.tuning), never the built-in route, and BNB_MPS_TUNE_EXCLUDE=
dequantize+linear takes it out. gemv_4bit has no such route: its 16-entry table arrives as data,
which bnb-mps' dequantize kernel (NF4 or FP4 by name) could only follow by reading it on the host.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

from .plan import BoundPlan
from .registry import OPS

_NESTED_BLOCKSIZE = 256  # bitsandbytes' nested quantization: 8-bit block scales in blocks of 256


class DequantizeLinear:
    """gemm_4bit's dequantize+linear for one call signature (arguments in schema order, as planned)."""

    __slots__ = ("counted", "_scales", "_weight", "_nblocks", "_trim", "_weight_args")

    def __init__(self, bound: Sequence, executor, tier: str) -> None:
        A, B, shapeB, absmax, blocksize, quant_type, _bias, absmax_8bit, absmax_code, _offset = bound
        N, K = shapeB
        self.counted = ("gemm_4bit", tier)
        self._nblocks = nblocks = math.ceil(N * K / blocksize)
        self._scales: Optional[BoundPlan] = None
        self._trim = False
        scales = absmax
        if absmax_8bit is not None:
            codes = absmax_8bit
            self._trim = absmax_8bit.numel() != nblocks  # (it may hold more: the kernel reads n of them)
            if self._trim:
                codes = absmax_8bit[:nblocks]
            args = (codes, absmax, absmax_code, _NESTED_BLOCKSIZE, torch.float32)
            self._scales = BoundPlan(OPS["dequantize_blockwise"].planned.plan(args), executor, self.counted)
            scales = torch.empty(codes.shape, dtype=torch.float32, device="meta")  # (its metadata, for planning)
        self._weight_args = (blocksize, quant_type, list(shapeB), A.dtype)
        args = (B, scales, *self._weight_args)
        self._weight = BoundPlan(OPS["dequantize_4bit"].planned.plan(args), executor, self.counted)

    def __call__(self, args: tuple):
        A, B, absmax = args[0], args[1], args[3]
        bias = args[6] if len(args) > 6 else None
        if self._scales is not None:
            codes = args[7][: self._nblocks] if self._trim else args[7]
            absmax = self._scales((codes, absmax, args[8], _NESTED_BLOCKSIZE, torch.float32))
            absmax += args[9]  # the offset, in float32 (a float16 / bfloat16 one converted first)
        weight = self._weight((B, absmax, *self._weight_args))
        return torch.nn.functional.linear(A, weight, bias)
