"""The 4-bit matrix products' cases: one family per kernel path (gemv, batch, small, split-K, mma)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Optional

import torch

from . import sentinel
from .cases import Case, Unaligned, gen
from .compare import eps, close
from .spec import NF4, fp4_table


def _matmul_tolerance(A: torch.Tensor, W: torch.Tensor, out_dtype: torch.dtype, bias=None) -> torch.Tensor:
    """|got - want| allowed between two float32-accumulated products of the same dequantized weight
    (docs/semantics.md section 4), one of which (bitsandbytes' CPU path) may round the weight to the
    activation dtype first: that rounding, the two float32 sums' errors, and one rounding of each
    result to `out_dtype`. The kernel's sum is within section 4's target of the exact product,
    5 * max(1, sqrt(K / 4096)) units of 2^-24 * S (S = sum |a * w| (+ |bias|)); the CPU's sum, in its
    own order on another machine, is allowed what section 4 allowed any float32 sum before it stated
    the kernels' order, twice 4 * max(1, sqrt(K / 1024)) units. On these cases under the emulator the
    kernels and the CPU differ by at most 3.34 units in float32 (the mma path at K = 200; the kernels
    alone are within 0.79 units of the exact product there, the CPU within 2.56)."""
    K = A.shape[-1]
    mag = A.double().abs() @ W.double().abs().T
    if bias is not None:
        mag = mag + bias.double().abs()
    wround = eps(A.dtype) if A.dtype != torch.float32 else 0.0
    sums = (5 * max(1.0, math.sqrt(K / 4096)) + 8 * max(1.0, math.sqrt(K / 1024))) * 2.0**-24
    return (wround + sums) * mag + 2 * eps(out_dtype) * mag + 1e-30


def _matmul_compare(A, W, bias, index: Optional[int] = None) -> Callable:
    def compare(got, want, got_args, want_args):
        if index is not None:
            got, want = got_args[index], want_args[index]
        allowed = _matmul_tolerance(A.reshape(-1, A.shape[-1]), W, A.dtype, bias).reshape(want.shape)
        return close(got, want, allowed)

    return compare


def matmul_cases(M: int, N: int, K: int, seed: int, gemv: bool = True) -> Iterator[Case]:
    """Products of one kernel path: every activation dtype with plain and nested block scales, NF4
    and FP4, with and without bias; A aligned (vector loads) and not (`Unaligned`: its start, and
    for M > 1 its row starts, off the 16-byte grid, which the kernels read with scalar loads); and
    (`gemv`) gemv_4bit and gemv_4bit.out calls of some of them."""
    import bitsandbytes.functional as F

    configs = [(torch.float16, "nf4", 64, True, True, False), (torch.bfloat16, "fp4", 32, False, True, False),
               (torch.float32, "nf4", 128, True, False, False), (torch.float16, "fp4", 256, False, False, True),
               (torch.bfloat16, "nf4", 64, True, True, True), (torch.float32, "fp4", 128, False, True, True)]  # fmt: skip
    for i, (dtype, qt, blocksize, nested, with_bias, unaligned) in enumerate(configs):
        g = gen(seed + i)
        W = torch.randn(N, K, generator=g).to(dtype)
        A = torch.randn(M, K, generator=g).to(dtype)
        bias = (torch.randn(N, generator=g) * 4).to(dtype) if with_bias else None
        packed, state = F.quantize_4bit(W, blocksize=blocksize, quant_type=qt, compress_statistics=nested)
        Wq = F.dequantize_4bit(packed, state).float()  # the weight both sides multiply by
        tag = (f"M={M} N={N} K={K} {qt} {dtype} blocksize={blocksize}{' nested' if nested else ''}"
               f"{' unaligned A' if unaligned else ''}")  # fmt: skip
        a = Unaligned(A, offset=1, pad=3 if M > 1 else 0) if unaligned else A
        if nested:
            args = (a, packed, [N, K], state.state2.absmax, blocksize, qt, bias, state.absmax, state.state2.code,
                    state.offset.reshape(1))  # fmt: skip
        else:
            args = (a, packed, [N, K], state.absmax, blocksize, qt, bias, None, None, None)
        yield Case(f"gemm_4bit {tag}{' bias' if with_bias else ''}", "gemm_4bit", args, _matmul_compare(A, Wq, bias))
        if gemv and not nested and (i == 1 or unaligned and dtype == torch.float16):
            table = torch.tensor(NF4) if qt == "nf4" else fp4_table()
            gargs = (a, packed, [N, K], state.absmax, table.float(), blocksize)
            yield Case(f"gemv_4bit {tag}", "gemv_4bit", gargs, _matmul_compare(A, Wq, None))
            if not unaligned:
                out = sentinel.filled((M, N), dtype)
                yield Case(f"gemv_4bit.out {tag}", "gemv_4bit.out", gargs + (out,),
                           _matmul_compare(A, Wq, None, index=6))  # fmt: skip


def repeated_cases(M: int, N: int, K: int, seed: int, calls: int = 4) -> Iterator[Case]:
    """`calls` products of one weight, one after the other, with A and -A in turn: the same shape, so
    every call takes the same slots of the split-K workspace, and a slot an earlier call wrote and a
    later call read before its own write (a hand-over between threadgroups that does not hold on this
    GPU) shows as a result of the wrong sign. float16 A, NF4 with nested scales and a bias."""
    import bitsandbytes.functional as F

    g = gen(seed)
    W = torch.randn(N, K, generator=g).to(torch.float16)
    A = torch.randn(M, K, generator=g).to(torch.float16)
    bias = torch.randn(N, generator=g).to(torch.float16)
    packed, state = F.quantize_4bit(W, blocksize=64, quant_type="nf4", compress_statistics=True)
    Wq = F.dequantize_4bit(packed, state).float()
    for call in range(calls):
        a = A if call % 2 == 0 else -A
        args = (a, packed, [N, K], state.state2.absmax, 64, "nf4", bias, state.absmax, state.state2.code,
                state.offset.reshape(1))  # fmt: skip
        label = f"gemm_4bit M={M} N={N} K={K} nf4 torch.float16 nested bias, call {call + 1} of {calls} " \
                f"({'A' if call % 2 == 0 else '-A'})"
        yield Case(label, "gemm_4bit", args, _matmul_compare(a, Wq, bias))
