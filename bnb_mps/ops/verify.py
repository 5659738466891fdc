"""First-use verification: every kernel family proves itself on this machine's GPU before it serves.

bnb-mps compiles its kernels at run time, with the user's Metal compiler, for the user's GPU: a
combination the project has not run. So when a kernel tier first serves an op of a family in a
process, the family runs once on small fixed inputs (`FAMILIES`), on that tier, and its results
are compared on the CPU, after one synchronisation, with the CPU round trip of the same ops
(bitsandbytes' CPU implementation and the project's compositions, as the `cpu` route runs them).
A family that fails never serves: routing sends its ops to the next route, with the reason
(`bnb_mps.ops.routing`). Verdicts are cached on disk per machine (`VerdictCache`).

The cases keep to inputs where bitsandbytes' CPU code computes docs/semantics.md exactly, so
that the comparison can be bit-exact where the page is exact: its 8-bit CPU quantizer is a
lookup table that differs from the nearest-code rule next to decision points and among the
smallest codes, so those cases take values that are code values away from both; its FP4
quantizer uses exact midpoints, so FP4 values keep clear of every decision point; its pure-PyTorch
NF4 quantizer stores 0x77 for an all-zero block, so there is none. Ties are placed where the rule
is defined and shared (NF4 to the lower nibble, int8's round half to even). Float results
(products, optimizer steps) are compared within tolerances derived from their magnitudes.

    BNB_MPS_VERIFY=1       verify at first use, reading and writing the cache (the default)
    BNB_MPS_VERIFY=always  verify at first use in every process (ignore the cache)
    BNB_MPS_VERIFY=0       never verify (at the user's risk)
"""

from __future__ import annotations

import json
import logging
import math
import os
import platform
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from .registry import OPS, bind

logger = logging.getLogger("bnb_mps")

ENV_VAR = "BNB_MPS_VERIFY"
MODES = ("0", "1", "always")

# -- verdicts -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Verdict:
    """The outcome of one family's verification on one tier."""

    family: str
    passed: bool
    seconds: float  # wall time of the run (of the run that made it, when read from the cache)
    case: Optional[str] = None  # the first case that failed
    error: Optional[str] = None  # what was wrong in it, and by how much
    launches: int = 0  # kernel launches the verification made
    bytes: int = 0  # bytes of the buffers those launches bound
    cached: bool = False  # read from the on-disk cache instead of run in this process

    def describe(self) -> str:
        if self.passed:
            return "passed"
        return f"failed in case {self.case!r}: {self.error}"


class VerificationWarning(UserWarning):
    """A kernel family failed its first-use verification on this machine and does not serve."""


# -- comparisons ----------------------------------------------------------------------------------------


def _bits(t: torch.Tensor) -> torch.Tensor:
    if not t.is_floating_point():
        return t
    nan = torch.isnan(t)
    as_int = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.masked_fill(nan, 0).view(as_int).masked_fill(nan, 1)


def exact(got: Any, want: Any, what: str = "result") -> Optional[str]:
    """None when `got` equals `want` bit for bit (NaN equal to any NaN; tuples element-wise), else why not."""
    if isinstance(want, (tuple, list)):
        for i, (g, w) in enumerate(zip(got, want)):
            err = exact(g, w, f"{what}[{i}]")
            if err:
                return err
        return None
    if want is None or got is None:
        return None if got is want else f"{what}: {type(got).__name__} where {type(want).__name__} was expected"
    if got.dtype != want.dtype or tuple(got.shape) != tuple(want.shape):
        return f"{what}: {got.dtype} {tuple(got.shape)} where {want.dtype} {tuple(want.shape)} was expected"
    g, w = _bits(got.reshape(-1)), _bits(want.reshape(-1))
    bad = g != w
    if bad.any():
        i = int(bad.nonzero()[0])
        return (f"{what}: {int(bad.sum())} of {bad.numel()} elements differ, e.g. element {i}: "
                f"{got.reshape(-1)[i].item()!r} where the CPU gives {want.reshape(-1)[i].item()!r}")
    return None


def close(got: torch.Tensor, want: torch.Tensor, allowed: torch.Tensor | float, what: str = "result") -> Optional[str]:
    """None when |got - want| <= allowed everywhere (NaN where want is NaN), else the worst element."""
    if got.dtype != want.dtype or tuple(got.shape) != tuple(want.shape):
        return f"{what}: {got.dtype} {tuple(got.shape)} where {want.dtype} {tuple(want.shape)} was expected"
    g, w = got.double().reshape(-1), want.double().reshape(-1)
    allowed = torch.as_tensor(allowed, dtype=torch.float64).expand_as(want).reshape(-1)
    err = (g - w).abs()
    nan = torch.isnan(w)
    bad = torch.where(nan, ~torch.isnan(g), ~(err <= allowed))
    if bad.any():
        excess = torch.where(bad, err / allowed.clamp_min(1e-300), torch.zeros_like(err)).nan_to_num(posinf=1e300)
        i = int(excess.argmax())
        return (f"{what}: {int(bad.sum())} of {bad.numel()} elements beyond the tolerance; worst, element {i}: "
                f"{g[i].item()!r} where the CPU gives {w[i].item()!r} (off by {err[i].item():.3g}, "
                f"tolerance {allowed[i].item():.3g})")
    return None


def _eps(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).eps)


# -- the cases ------------------------------------------------------------------------------------------


@dataclass
class Case:
    """One call of op `op` with `args` (CPU tensors and plain values, schema order).

    `compare(got, want, got_args, want_args)` returns None or what is wrong; `got` is the kernel
    tier's result and `got_args` its arguments after the call (in-place outputs), both on the CPU;
    `want`/`want_args` are the CPU round trip's."""

    label: str
    op: str
    args: tuple
    compare: Callable[[Any, Any, list, list], Optional[str]]


@dataclass(frozen=True)
class Family:
    name: str
    ops: tuple[str, ...]  # the ops that leave the kernel tier when the family fails
    cases: Callable[[], Iterator[Case]]


def _same(got, want, got_args, want_args) -> Optional[str]:
    return exact(got, want)


def _same_arg(index: int) -> Callable:
    def compare(got, want, got_args, want_args):
        return exact(got_args[index], want_args[index], f"argument {index} after the call")

    return compare


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _signed_code() -> torch.Tensor:
    from bitsandbytes.functional import create_dynamic_map

    return create_dynamic_map(signed=True)


def _unsigned_code() -> torch.Tensor:
    from bitsandbytes.functional import create_dynamic_map

    return create_dynamic_map(signed=False)


# Block scales 2^e that keep every scaled value of magnitude 2^-9 .. 1 normal in the dtype (so
# that dtype(s * 2^e) / 2^e == dtype(s): the scaled value survives the cast exactly).
_EXPONENTS = {torch.float16: (-5, 15), torch.bfloat16: (-60, 60), torch.float32: (-60, 60)}


def _scaled_blocks(values: torch.Tensor, blocksize: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """`values` (scaled values, 2^-9 <= |v| <= 1, already representable in `dtype`) times a power of
    two per block, with the block's absmax element set to +-1 times that power, so that every
    scaled value is exactly `values`' (the reciprocal of a power of two is exact)."""
    n = values.numel()
    g = _gen(seed)
    blocks = -(-n // blocksize)
    lo, hi = _EXPONENTS[dtype]
    exps = torch.randint(lo, hi, (blocks,), generator=g).double()
    scale = torch.repeat_interleave(2.0**exps, blocksize)[:n]
    x = values.double() * scale
    for b in range(blocks):
        i = b * blocksize + (b * 7 + 1) % min(blocksize, n - b * blocksize)
        x[i] = (-1.0 if b % 2 else 1.0) * 2.0 ** exps[b].item()
    return x.to(dtype)


def _clear_of(values: torch.Tensor, points: torch.Tensor, dtype: torch.dtype, gap: float, n: int) -> torch.Tensor:
    """The first `n` of `values`, rounded to `dtype`, that lie more than `gap` from every decision
    point and have magnitude >= 2^-9 (values in float64)."""
    v = values.to(dtype).double()
    keep = ((v[:, None] - points.double()[None, :]).abs().min(dim=1).values > gap) & (v.abs() >= 2.0**-9)
    v = v[keep]
    if v.numel() < n:  # (the pools are sized for this)
        raise RuntimeError(f"verification inputs: {v.numel()} usable values where {n} are needed")
    return v[:n]


def _blockwise_8bit_cases() -> Iterator[Case]:
    code = _signed_code()
    points = (code[:-1] + code[1:]) / 2  # the decision points (fl32 sum, exact halving)
    for i, (dtype, blocksize, n) in enumerate([(torch.float16, 64, 2 * 64 + 37), (torch.bfloat16, 256, 3 * 256 + 5),
                                               (torch.float32, 4096, 4096 + 129), (torch.float32, 128, 1)]):  # fmt: skip
        g = _gen(100 + i)
        # Code values and random values, clear of the decision points and of the smallest codes,
        # where the CPU's lookup table departs from the nearest code.
        pool = torch.cat([code[torch.randint(0, 256, (2 * n + 64,), generator=g)].double(),
                          torch.rand(2 * n + 64, generator=g, dtype=torch.float64) * 2 - 1])  # fmt: skip
        pool = pool[torch.randperm(pool.numel(), generator=g)]
        # (No NaN: where bitsandbytes has no CPU library, its pure-PyTorch quantizer lets NaN into
        # the block max; the mps suite checks NaN against docs/semantics.md instead.)
        A = _scaled_blocks(_clear_of(pool, points, dtype, 1e-4, n), blocksize, dtype, seed=200 + i)
        tag = f"{dtype} blocksize={blocksize} n={n}"
        yield Case(f"quantize_blockwise {tag}", "quantize_blockwise", (A, code, blocksize), _same)
        q, absmax = torch.ops.bitsandbytes.quantize_blockwise.default(A.float(), code, blocksize)
        for out_dtype in DTYPES:
            yield Case(f"dequantize_blockwise {tag} -> {out_dtype}", "dequantize_blockwise",
                       (q, absmax, code, blocksize, out_dtype), _same)  # fmt: skip
        out = torch.full((n,), 7.0, dtype=dtype)
        yield Case(f"dequantize_blockwise.out {tag}", "dequantize_blockwise.out", (q, absmax, code, blocksize, dtype, out),
                   _same_arg(5))  # fmt: skip


_NF4 = (-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
        -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
        0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941, 0.7229568362236023,
        1.0)  # fmt: skip
_FP4_MAGNITUDES = (0.0, 0.0625 / 12, 8 / 12, 12 / 12, 4 / 12, 6 / 12, 2 / 12, 3 / 12)


def _fourbit_values(quant_type: str, n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Scaled values for the 4-bit quantizers: every table value and random values, all clear of
    every decision point (bitsandbytes' CPU path, its pure-PyTorch kernel, compares with its own
    midpoints), and for float32 NF4's exact ties as well (to the lower nibble in both)."""
    g = _gen(seed)
    if quant_type == "nf4":
        table = torch.tensor(_NF4, dtype=torch.float32)
        points = (table[:-1] + table[1:]) / 2  # float32 midpoints: the decision points
    else:
        mags = torch.tensor(_FP4_MAGNITUDES, dtype=torch.float32)
        table = torch.cat([mags, -mags[1:]])
        tree = torch.tensor([0.29166667, 0.583333, 0.8333333, 0.4166667, 0.0859375, 0.20833333, 0.00260417])
        sm = mags.sort().values
        points = torch.cat([tree, (sm[:-1] + sm[1:]) / 2])  # the CUDA tree's constants and exact midpoints
        points = torch.cat([points, -points])
    pool = torch.cat([table.double().repeat(4), torch.rand(4 * n, generator=g, dtype=torch.float64) * 2 - 1])
    pool = pool[torch.randperm(pool.numel(), generator=g)]
    values = _clear_of(pool, points, dtype, 1e-3, n)
    if quant_type == "nf4" and dtype == torch.float32:  # exact ties, at every decision point
        values[: points.numel()] = points.double()
    return values


def _fourbit_cases() -> Iterator[Case]:
    shapes = [(torch.float16, 64, "nf4", (6, 128)), (torch.bfloat16, 32, "fp4", (4, 96)),
              (torch.float32, 256, "nf4", (2, 512)), (torch.float32, 64, "fp4", (3, 64)),
              (torch.float16, 128, "fp4", (1, 515))]  # fmt: skip
    for i, (dtype, blocksize, qt, shape) in enumerate(shapes):
        n = math.prod(shape)
        A = _scaled_blocks(_fourbit_values(qt, n, dtype, seed=300 + i), blocksize, dtype, seed=400 + i).reshape(shape)
        tag = f"{qt} {dtype} blocksize={blocksize} {list(shape)}"
        yield Case(f"quantize_4bit {tag}", "quantize_4bit", (A, blocksize, qt, torch.uint8), _same)
        packed, absmax = torch.ops.bitsandbytes.quantize_4bit.default(A.float(), blocksize, qt, torch.uint8)
        for out_dtype in DTYPES:
            yield Case(f"dequantize_4bit {tag} -> {out_dtype}", "dequantize_4bit",
                       (packed, absmax, blocksize, qt, list(shape), out_dtype), _same)  # fmt: skip
        out = torch.full(shape, 3.0, dtype=dtype)
        yield Case(f"dequantize_4bit.out {tag}", "dequantize_4bit.out",
                   (packed, absmax, blocksize, qt, list(shape), dtype, out), _same_arg(6))  # fmt: skip


# -- 4-bit matrix products: one family per kernel path ---------------------------------------------------


def _matmul_tolerance(A: torch.Tensor, W: torch.Tensor, out_dtype: torch.dtype, bias=None) -> torch.Tensor:
    """|got - want| allowed between two float32-accumulated products of the same dequantized weight
    (docs/semantics.md section 4), one of which (bitsandbytes' CPU path) may round the weight to the
    activation dtype first: that rounding, a few float32 roundings of the sum of |a * w|, and one
    rounding of each result to `out_dtype`."""
    mag = A.double().abs() @ W.double().abs().T
    if bias is not None:
        mag = mag + bias.double().abs()
    wround = _eps(A.dtype) if A.dtype != torch.float32 else 0.0
    return (wround + 64 * 2.0**-24) * mag + 2 * _eps(out_dtype) * mag + 1e-30


def _matmul_compare(A, W, bias, index: Optional[int] = None) -> Callable:
    def compare(got, want, got_args, want_args):
        if index is not None:
            got, want = got_args[index], want_args[index]
        allowed = _matmul_tolerance(A.reshape(-1, A.shape[-1]), W, A.dtype, bias).reshape(want.shape)
        return close(got, want, allowed)

    return compare


def _matmul_cases(M: int, K: int, seed: int) -> Iterator[Case]:
    import bitsandbytes.functional as F

    N = 40
    for i, (dtype, qt, blocksize, nested, with_bias) in enumerate([(torch.float16, "nf4", 64, True, True),
                                                                   (torch.bfloat16, "fp4", 32, False, True),
                                                                   (torch.float32, "nf4", 128, True, False)]):  # fmt: skip
        g = _gen(seed + i)
        W = torch.randn(N, K, generator=g).to(dtype)
        A = torch.randn(M, K, generator=g).to(dtype)
        bias = (torch.randn(N, generator=g) * 4).to(dtype) if with_bias else None
        packed, state = F.quantize_4bit(W, blocksize=blocksize, quant_type=qt, compress_statistics=nested)
        Wq = F.dequantize_4bit(packed, state).float()  # the weight both sides multiply by
        tag = f"M={M} N={N} K={K} {qt} {dtype} blocksize={blocksize}{' nested' if nested else ''}"
        if nested:
            args = (A, packed, [N, K], state.state2.absmax, blocksize, qt, bias, state.absmax, state.state2.code,
                    state.offset.reshape(1))  # fmt: skip
        else:
            args = (A, packed, [N, K], state.absmax, blocksize, qt, bias, None, None, None)
        yield Case(f"gemm_4bit {tag}{' bias' if with_bias else ''}", "gemm_4bit", args, _matmul_compare(A, Wq, bias))
        if not nested:
            table = torch.tensor(_NF4) if qt == "nf4" else torch.tensor(
                list(_FP4_MAGNITUDES) + [-m for m in _FP4_MAGNITUDES])  # fmt: skip
            gargs = (A, packed, [N, K], state.absmax, table.float(), blocksize)
            yield Case(f"gemv_4bit {tag}", "gemv_4bit", gargs, _matmul_compare(A, Wq, None))
            out = torch.full((M, N), float("nan"), dtype=dtype)
            yield Case(f"gemv_4bit.out {tag}", "gemv_4bit.out", gargs + (out,), _matmul_compare(A, Wq, None, index=6))


# -- int8 --------------------------------------------------------------------------------------------------


def _int8_activations(M: int, K: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """N(0, 1.5^2) values with outlier columns (|x| >= 6), a row of exact rounding ties (row max
    127, so that x * 127 / max = x: halves round to even) and a zero row."""
    g = _gen(seed)
    x = torch.randn(M, K, generator=g) * 1.5
    x[:, 1] = 7.0
    x[:, K - 2] = -9.5
    x[2] = torch.arange(K) % 21 - 10.5  # ties: -10.5 .. 9.5
    x[2, 0] = 127.0
    x[3] = 0.0
    return x.to(dtype)


def _int8_dequant_compare() -> Callable:
    """Float results of the int8 dequantizers within a few float32 roundings and one rounding to the
    output dtype of the magnitudes involved (|result| + |bias|), plus 4e-5 of them: bitsandbytes'
    CPU path scales by 6.200124e-05, not by 1/16129 (1.8e-5 relative)."""

    def compare(got, want, got_args, want_args):
        bias = want_args[4] if len(want_args) > 4 and isinstance(want_args[4], torch.Tensor) else None
        mag = want.double().abs() + (bias.double().abs() if bias is not None else 0.0)
        return close(got, want, (4e-5 + 8 * 2.0**-24 + _eps(want.dtype)) * mag + 1e-30)

    return compare


def _int8_quant_cases() -> Iterator[Case]:
    for i, dtype in enumerate(DTYPES):
        A = _int8_activations(8, 72 + 8 * i, dtype, seed=500 + i)
        for threshold in (0.0, 6.0):
            tag = f"{tuple(A.shape)} {dtype} threshold={threshold}"
            yield Case(f"int8_vectorwise_quant {tag}", "int8_vectorwise_quant", (A, threshold), _same)
            yield Case(f"int8_double_quant {tag}", "int8_double_quant", (A, threshold), _same)
    CA, stats, _ = torch.ops.bitsandbytes.int8_vectorwise_quant.default(_int8_activations(6, 40, torch.float16, 510),
                                                                         0.0)  # fmt: skip
    yield Case("int8_vectorwise_dequant (6, 40)", "int8_vectorwise_dequant", (CA, stats), _int8_dequant_compare())
    g = _gen(520)
    acc = torch.randint(-200000, 200000, (6, 24), generator=g, dtype=torch.int32)
    row, col = torch.rand(6, generator=g) * 10, torch.rand(24, generator=g) * 3
    for dtype in DTYPES:
        bias = (torch.randn(24, generator=g) * 50).to(dtype)
        yield Case(f"int8_mm_dequant (6, 24) -> {dtype} bias", "int8_mm_dequant", (acc, row, col, dtype, bias),
                   _int8_dequant_compare())  # fmt: skip


def _int8_product_cases() -> Iterator[Case]:
    # The exact int32 product: rows of 127 at K = 1088, where a float32 sum passes 2^24 and is no
    # longer exact (127 * 127 * 1088 = 17,548,352), and random codes.
    g = _gen(600)
    for M, K in ((1, 1088), (5, 1088), (33, 96)):
        A = torch.randint(-127, 128, (M, K), generator=g, dtype=torch.int8)
        B = torch.randint(-127, 128, (24, K), generator=g, dtype=torch.int8)
        A[0] = 127
        B[0] = 127
        B[1] = -127
        yield Case(f"int8_linear_matmul {M}x24x{K}", "int8_linear_matmul", (A, B), _same)
        yield Case(f"int8_linear_matmul.out {M}x24x{K}", "int8_linear_matmul.out",
                   (A, B, torch.full((M, 24), -1, dtype=torch.int32)), _same_arg(2))  # fmt: skip
    X = _int8_activations(12, 64, torch.float16, seed=610)
    W = _int8_activations(24, 64, torch.float16, seed=611) * 0.05
    CA, SCA, cols = torch.ops.bitsandbytes.int8_vectorwise_quant.default(X, 6.0)
    CB, SCB, _ = torch.ops.bitsandbytes.int8_vectorwise_quant.default(W, 0.0)
    for dtype in DTYPES:
        bias = (torch.randn(24, generator=g) * 3).to(dtype)
        yield Case(f"int8_scaled_mm 12x24x64 -> {dtype} bias", "int8_scaled_mm", (CA, CB, SCA, SCB, bias, dtype),
                   _int8_dequant_compare())  # fmt: skip
    yield Case("int8_scaled_mm 1x24x64 -> float16", "int8_scaled_mm", (CA[:1], CB, SCA[:1], SCB, None, None),
               _int8_dequant_compare())  # fmt: skip
    yield Case(f"int8_mixed_scaled_mm 12x24x64 outliers={cols.numel()}", "int8_mixed_scaled_mm",
               (X, CA, CB, SCA, SCB, cols, bias.half()), _mixed_compare(X, CB, SCB, cols))  # fmt: skip


def _mixed_compare(X, CB, SCB, cols) -> Callable:
    def compare(got, want, got_args, want_args):
        err = exact(got[1], want[1], "subA")
        if err:
            return err
        # The fp16 outlier product on top of the int8 one: an fp16 rounding of each of its terms.
        Wout = CB[:, cols].double() * SCB.double()[:, None] / 127
        mag = want[0].double().abs() + X[:, cols].double().abs() @ Wout.abs().T
        return close(got[0], want[0], 8 * _eps(torch.float16) * mag + 1e-30, "out")

    return compare


# -- optimizers ------------------------------------------------------------------------------------------


def _ulp(t: torch.Tensor) -> torch.Tensor:
    """The spacing of t's dtype at |t| (float64)."""
    info = torch.finfo(t.dtype)
    mag = t.double().abs().clamp_min(float(info.tiny))
    return 2.0 ** torch.floor(torch.log2(mag)) * info.eps


def _optimizer_p_tolerance(p_before: torch.Tensor, p_want: torch.Tensor) -> torch.Tensor:
    """Both sides compute one float32 step in different operation orders, then round p once."""
    step = (p_want.double() - p_before.double()).abs()
    return 2 * _ulp(p_want) + 2 * _ulp(p_before) + 64 * 2.0**-24 * step + 1e-30


def _optimizer_8bit_compare(p_before: torch.Tensor) -> Callable:
    """p within a few roundings; each state's absmax within 1e-5 relative and its codes equal but for
    a few, which may differ by at most 3 steps: bitsandbytes' CPU re-quantizes with its lookup
    table (1-3 codes off next to decision points and among the smallest codes) and without the
    sign fix of docs/semantics.md 5.1."""

    def compare(got, want, got_args, want_args):
        err = close(got_args[2], want_args[2], _optimizer_p_tolerance(p_before, want_args[2]), "p")
        if err:
            return err
        for si, ai in ((3, 14), (4, 15)):
            if want_args[si] is None:
                continue
            err = close(got_args[ai], want_args[ai], 1e-5 * want_args[ai].double().abs() + 1e-30, f"absmax of state {si - 2}")
            if err:
                return err
            q, w = got_args[si].int(), want_args[si].int()
            off = (q - w).abs()
            if int(off.max()) > 3 or float((off > 0).float().mean()) > 0.02:
                return (f"state{si - 2}: {int((off > 0).sum())} of {off.numel()} codes differ from the CPU's, by up to "
                        f"{int(off.max())}")
        return None

    return compare


def _optimizer_32bit_compare(args: tuple) -> Callable:
    """p as for the 8-bit op; the float32 states within 2e-6 of the magnitudes of their terms
    (old state, gradient, its square): the two sides round a few operations differently, and a
    state that is a small difference of large terms carries their rounding."""
    p_before, g = args[2].clone(), args[1].double().abs() * args[16]
    before = [None if a is None else a.clone() for a in args[3:5]]

    def compare(got, want, got_args, want_args):
        err = close(got_args[2], want_args[2], _optimizer_p_tolerance(p_before, want_args[2]), "p")
        if err:
            return err
        for si in (3, 4):
            if want_args[si] is not None:
                terms = before[si - 3].double().abs() + want_args[si].double().abs() + g + g * g
                err = close(got_args[si], want_args[si], 2e-6 * terms + 1e-30, f"state{si - 2}")
                if err:
                    return err
        return None

    return compare


def _quantized_state(values: torch.Tensor, code: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    q, a = torch.ops.bitsandbytes.quantize_blockwise.default(values.reshape(-1).float().contiguous(), code, 256)
    return q.reshape(values.shape), a


# (name, dtype, weight decay): weight decay only where bitsandbytes' CPU code applies it as
# docs/semantics.md does (coupled for momentum/rmsprop/adagrad; decoupled-before for lion), none for
# adam/ademamix (the CPU code decays before the step, the page after it).
_OPT8 = [("adam", torch.float32, 0.0), ("ademamix", torch.float16, 0.0), ("momentum", torch.bfloat16, 0.01),
         ("rmsprop", torch.float32, 0.01), ("adagrad", torch.float16, 0.0), ("lion", torch.float32, 0.01)]
# Update-norm clipping only for lars: bitsandbytes' CPU lamb takes the norm of m / (sqrt(v) + eps*bc2),
# without docs/semantics.md's bias corrections, so its trust ratio differs by bc2 / bc1.
_OPT32 = [("adam", torch.float16, 0.0, 0.0), ("lamb", torch.float32, 0.0, 0.0), ("ademamix", torch.float32, 0.0, 0.0),
          ("momentum", torch.float32, 0.01, 0.0), ("lars", torch.bfloat16, 0.0, 0.002),
          ("rmsprop", torch.float32, 0.01, 0.0), ("adagrad", torch.float32, 0.01, 0.0), ("lion", torch.bfloat16, 0.01, 0.0)]  # fmt: skip
_TWO_STATE = ("adam", "lamb", "ademamix")


def _optimizer_8bit_cases() -> Iterator[Case]:
    code, ucode = _signed_code(), _unsigned_code()
    n = 700  # two full 256-blocks and a partial one
    for i, (name, dtype, wd) in enumerate(_OPT8):
        g = _gen(700 + i)
        p = (torch.randn(n, generator=g) * 0.1).to(dtype)
        grad = (torch.randn(n, generator=g) * 0.01).to(dtype)
        m = torch.randn(2 if name == "ademamix" else 1, n, generator=g) * 0.01
        if name in ("rmsprop", "adagrad"):
            m = m.square() * 10
        q1, a1 = zip(*(_quantized_state(m[c], code) for c in range(m.shape[0])))
        state1, absmax1 = (torch.stack(q1), torch.stack(a1)) if name == "ademamix" else (q1[0], a1[0])
        if name in _TWO_STATE:
            state2, absmax2 = _quantized_state(torch.randn(n, generator=g).square() * 1e-4, ucode)
            qmap2 = ucode
        else:
            state2 = absmax2 = qmap2 = None
        args = (name, grad, p, state1, state2, 0.9, 0.995, 0.999, 5.0, 1e-8, 3, 1e-3, code, qmap2, absmax1, absmax2,
                wd, 0.7, False)  # fmt: skip
        yield Case(f"optimizer_update_8bit_blockwise {name} {dtype} n={n}", "optimizer_update_8bit_blockwise", args,
                   _optimizer_8bit_compare(p.clone()))  # fmt: skip


def _optimizer_32bit_cases() -> Iterator[Case]:
    n = 1100
    for i, (name, dtype, wd, max_unorm) in enumerate(_OPT32):
        g = _gen(800 + i)
        p = (torch.randn(n, generator=g) * 0.1).to(dtype)
        grad = (torch.randn(n, generator=g) * 0.01).to(dtype)
        s1 = torch.randn(*((2, n) if name == "ademamix" else (n,)), generator=g) * 0.01
        if name in ("rmsprop", "adagrad"):
            s1 = s1.square() * 10
        s2 = torch.randn(n, generator=g).square() * 1e-4 if name in _TWO_STATE else None
        unorm = torch.zeros(1) if max_unorm > 0 else None
        param_norm = float(p.float().norm()) if max_unorm > 0 else 0.0
        args = (name, grad, p, s1, s2, unorm, max_unorm, param_norm, 0.9, 0.995, 0.999, 5.0, 1e-8, wd, 3, 1e-3, 0.7,
                False)  # fmt: skip
        yield Case(f"optimizer_update_32bit {name} {dtype} clip={max_unorm} n={n}", "optimizer_update_32bit", args,
                   _optimizer_32bit_compare(args))  # fmt: skip


_MATMUL_OPS = ("gemm_4bit", "gemv_4bit", "gemv_4bit.out")

#: Every kernel family, in the order they are verified.
FAMILIES: dict[str, Family] = {f.name: f for f in [
    Family("blockwise_8bit", ("quantize_blockwise", "dequantize_blockwise", "dequantize_blockwise.out"),
           _blockwise_8bit_cases),
    Family("nf4_fp4", ("quantize_4bit", "dequantize_4bit", "dequantize_4bit.out"), _fourbit_cases),
    # The three kernel paths of the 4-bit products (bnb_mps.ops.matmul_4bit.choose_path): M = 1 with
    # K % 32 == 0; M <= 8 with K % 16 == 0; larger M, or K % 16 != 0. A failing path takes all three ops.
    Family("matmul_4bit_gemv", _MATMUL_OPS, lambda: _matmul_cases(1, 256, seed=900)),
    Family("matmul_4bit_batch", _MATMUL_OPS, lambda: _matmul_cases(5, 144, seed=910)),
    Family("matmul_4bit_mma", _MATMUL_OPS, lambda: _matmul_cases(37, 200, seed=920)),
    Family("int8_quant", ("int8_vectorwise_quant", "int8_double_quant", "int8_vectorwise_dequant", "int8_mm_dequant"),
           _int8_quant_cases),
    Family("int8_products", ("int8_linear_matmul", "int8_linear_matmul.out", "int8_scaled_mm", "int8_mixed_scaled_mm"),
           _int8_product_cases),
    Family("optimizer_8bit", ("optimizer_update_8bit_blockwise",), _optimizer_8bit_cases),
    Family("optimizer_32bit", ("optimizer_update_32bit",), _optimizer_32bit_cases),
]}  # fmt: skip

_FAMILY_OF_OP: dict[str, list[str]] = {}
for _f in FAMILIES.values():
    for _op in _f.ops:
        _FAMILY_OF_OP.setdefault(_op, []).append(_f.name)


def families_of(op: str) -> list[str]:
    """The families whose verification decides whether `op` may run on a kernel tier."""
    return list(_FAMILY_OF_OP.get(op, ()))


# -- running a family ------------------------------------------------------------------------------------


def _to(x: Any, device: str) -> Any:
    if isinstance(x, torch.Tensor):
        return x.to(device) if device != "cpu" else x.clone()
    if isinstance(x, list):
        return list(x)
    return x


def _cpu(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.detach().cpu()
    if isinstance(x, (tuple, list)):
        return type(x)(_cpu(v) for v in x)
    return x


def _synchronize(device: str) -> None:
    module = getattr(torch, device, None)
    if device != "cpu" and module is not None and hasattr(module, "synchronize"):
        module.synchronize()


class _Counting:
    """Forwards launches to an executor, counting them and the bytes of the tensors they bind."""

    def __init__(self, inner) -> None:
        self.inner, self.name = inner, inner.name
        self.launches = self.bytes = 0

    def launch(self, kernel, *, grid, threadgroup, args) -> None:
        self.launches += 1
        self.bytes += sum(a.numel() * a.element_size() for a in args if isinstance(a, torch.Tensor))
        self.inner.launch(kernel, grid=grid, threadgroup=threadgroup, args=args)


def run_family(family: Family, executor, device: str) -> Verdict:
    """Runs `family`'s cases with `executor` on `device` tensors (every launch first, then one
    synchronisation), then compares each with the CPU round trip. Never raises: a case that
    cannot run fails the family."""
    from .cpu_round_trip import cpu_call

    start = time.perf_counter()
    recorder = _Counting(executor)
    label = None

    def verdict(passed: bool, error: Optional[str] = None) -> Verdict:
        return Verdict(family.name, passed, time.perf_counter() - start, None if passed else label, error,
                       recorder.launches, recorder.bytes)  # fmt: skip

    try:
        pending = []
        for case in family.cases():
            label = case.label
            op = OPS[case.op]
            bound = bind(case.op, tuple(_to(a, device) for a in case.args), {})
            op.check(*bound)
            pending.append((case, op.kernel(recorder, *bound), bound))
        label = None
        _synchronize(device)
        for case, got, bound in pending:
            label = case.label
            want_args = [_to(a, "cpu") for a in case.args]
            want = cpu_call(case.op, want_args)
            error = case.compare(_cpu(got), want, _cpu(bound), want_args)
            if error is not None:
                return verdict(False, error)
    except Exception as e:  # a family whose verification cannot run (e.g. a kernel that does not compile) fails
        return verdict(False, f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}")
    return verdict(True)


# -- the machine, the cache ---------------------------------------------------------------------------------


def machine() -> dict[str, str]:
    """What a verdict holds for: GPU (the Apple chip on a Mac), OS, torch, bitsandbytes, bnb-mps."""
    from .. import __version__, chips

    chip = chips.detect()
    mac = platform.mac_ver()[0]
    try:
        import bitsandbytes

        bnb_version = bitsandbytes.__version__
    except ImportError:  # pragma: no cover
        bnb_version = "none"
    return {
        "gpu": f"Apple {chip.name}" if chip is not None else f"no Apple GPU ({platform.machine()})",
        "os": f"macOS {mac}" if mac else f"{platform.system()} {platform.release()}",
        "torch": torch.__version__,
        "bitsandbytes": bnb_version,
        "bnb_mps": __version__,
    }


def cache_key(tier: str, source_hash: str) -> str:
    m = machine()
    return " | ".join([tier, m["gpu"], m["os"], f"torch {m['torch']}", f"bitsandbytes {m['bitsandbytes']}",
                       f"bnb-mps {m['bnb_mps']}", f"kernels {source_hash}"])  # fmt: skip


def cache_path() -> Path:
    """$BNB_MPS_CACHE_DIR/verify.json (default ~/.cache/bnb_mps/verify.json)."""
    root = os.environ.get("BNB_MPS_CACHE_DIR")
    return (Path(root) if root else Path.home() / ".cache" / "bnb_mps") / "verify.json"


_read_memo: dict[Path, dict] = {}  # cache file -> its content, read once per process


def _read_cache(fresh: bool = False) -> dict:
    path = cache_path()
    if not fresh and path in _read_memo:
        return _read_memo[path]
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        data = data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        data = {}
    _read_memo[path] = data
    return data


def _write_cache(key: str, verdicts: dict[str, Verdict]) -> None:
    """Adds `verdicts` under `key` (atomically: a temporary file renamed into place)."""
    path = cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = dict(_read_cache(fresh=True))  # (another process may have added verdicts meanwhile)
        entry = data.setdefault(key, {})
        for name, v in verdicts.items():
            entry[name] = {k: val for k, val in asdict(v).items() if k != "cached"}
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".verify-", suffix=".json")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
        _read_memo[path] = data
    except OSError as e:  # a read-only home: verify again next time
        logger.info("bnb_mps: cannot write the verification cache %s: %s", path, e)


def _cached(key: str, family: str) -> Optional[Verdict]:
    entry = _read_cache().get(key, {}).get(family)
    if not isinstance(entry, dict):
        return None
    try:
        return Verdict(**{**entry, "cached": True})
    except TypeError:
        return None


# -- the process's verdicts ---------------------------------------------------------------------------------


def mode() -> str:
    value = os.environ.get(ENV_VAR, "1").strip().lower() or "1"
    if value not in MODES:
        logger.warning("bnb_mps: ignoring %s=%r; expected 0, 1 or always", ENV_VAR, value)
        return "1"
    return value


_lock = threading.Lock()
_verdicts: dict[tuple[str, int, str, str], Verdict] = {}  # (tier, executor id, source hash, family) -> verdict
_warned = False


def verdict(family: str, tier: str, executor, *, refresh: bool = False) -> Verdict:
    """`family`'s verdict on `tier` (run with `executor`): from this process, else the disk cache
    (unless BNB_MPS_VERIFY=always or `refresh`), else by running it now."""
    from ..msl import source

    source_hash = source.source_hash()
    memo = (tier, id(executor), source_hash, family)
    with _lock:
        found = None if refresh else _verdicts.get(memo)
        if found is not None:
            return found
        key = cache_key(tier, source_hash)
        use_cache = not refresh and mode() != "always"
        found = _cached(key, family) if use_cache else None
        if found is None:
            found = run_family(FAMILIES[family], executor, getattr(executor, "device_type", "cpu"))
            _write_cache(key, {family: found})
        _verdicts[memo] = found
        return found


def failure(op: str, tier: str, executor) -> Optional[str]:
    """Why `op` must not run on `tier` (a family of it failed verification on this machine), or None.
    Verifies the op's families on first use (BNB_MPS_VERIFY=0: never)."""
    if mode() == "0":
        return None
    for family in families_of(op):
        v = verdict(family, tier, executor)
        if not v.passed:
            m = machine()
            reason = (f"the {tier} tier's {family} kernels failed verification on this machine ({m['gpu']}, {m['os']}, "
                      f"torch {m['torch']}): {v.describe()}")  # fmt: skip
            _warn_once(reason)
            return reason
    return None


def _warn_once(reason: str) -> None:
    global _warned
    if _warned:
        return
    _warned = True
    warnings.warn(
        f"bnb_mps: {reason}. Its ops are served by the next route instead (see `python -m bnb_mps`). Please run "
        "`bash scripts/mac_acceptance.sh` from a bnb-mps checkout and attach its report to an issue.",
        VerificationWarning,
        stacklevel=4,
    )


def reset() -> None:
    """Forget this process's verdicts (tests; after changing kernels or tiers)."""
    global _warned
    with _lock:
        _verdicts.clear()
        _read_memo.clear()
        _warned = False
