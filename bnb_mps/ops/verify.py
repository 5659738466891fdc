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

Where docs/semantics.md defines results that bitsandbytes' CPU code does not compute (NaN,
infinities, all-zero blocks, float32 subnormals, block maxima above 2^126: sections 2, 3 and 7), a
case carries its expected result, computed here from the page (`_spec_quantize_blockwise`,
`_spec_quantize_4bit`, `_spec_dequantize`), and is compared bit for bit, NaN as NaN.

A launch the GPU tier refuses because the kernel's pipeline allows fewer threads per threadgroup
than the op launches (PipelineLimitError) skips that case: it is recorded in the verdict
(`Verdict.skipped`) and is no failure, since the op itself then leaves the tier when a user's call
meets the limit (`bnb_mps.ops.routing.refuse`). A family whose verification could not run at all
(no C++ compiler for the emulated tier, a CPU reference that raised) fails in this process only:
that verdict is never cached.

    BNB_MPS_VERIFY=1       verify at first use, reading and writing the cache (the default)
    BNB_MPS_VERIFY=always  verify at first use in every process (ignore the cache)
    BNB_MPS_VERIFY=0       never verify (at the user's risk)
    BNB_MPS_VERIFY_CACHE   the cache file (default $BNB_MPS_CACHE_DIR/verify.json, else
                           ~/.cache/bnb_mps/verify.json)
"""

from __future__ import annotations

import bisect
import functools
import itertools
import json
import logging
import math
import os
import platform
import struct
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, replace
from fractions import Fraction
from pathlib import Path
from typing import Any, Optional

import torch

from .registry import OPS, bind

logger = logging.getLogger("bnb_mps")

ENV_VAR = "BNB_MPS_VERIFY"
CACHE_ENV_VAR = "BNB_MPS_VERIFY_CACHE"
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
    # Cases not run because the tier refused a launch (PipelineLimitError): "case: why".
    skipped: tuple[str, ...] = ()
    # The verification could not run (not a wrong result): failed in this process, never cached.
    could_not_run: bool = False

    def describe(self) -> str:
        if self.passed:
            if not self.skipped:
                return "passed"
            return f"passed ({len(self.skipped)} case(s) skipped: " + "; ".join(self.skipped) + ")"
        if self.could_not_run:
            return f"could not be verified (case {self.case!r}): {self.error}"
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
    """One call of op `op` with `args` (CPU tensors, `Unaligned` tensors and plain values, schema order).

    `compare(got, want, got_args, want_args)` returns None or what is wrong; `got` is the kernel
    tier's result and `got_args` its arguments after the call (in-place outputs), both on the CPU;
    `want`/`want_args` are the CPU round trip's, or, where `expected` is given, `expected(want_args)`
    is `want`: the result docs/semantics.md defines where bitsandbytes' CPU code computes another."""

    label: str
    op: str
    args: tuple
    compare: Callable[[Any, Any, list, list], Optional[str]]
    expected: Optional[Callable[[list], Any]] = None
    route: Optional[str] = None  # a kernel path of the op other than the built-in one (bnb_mps.ops.candidates)


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


# Where a block's maximum sits, as a fraction of the block (cycled over the blocks): every part of
# a block, so that a block of more than 256 elements has its maximum in the first, a middle and
# the last simdgroup's slice (the kernels reduce those slices' maxima in threadgroup memory).
_MAX_AT = (0.93, 0.41, 0.02, 0.66, 0.28, 0.81)


def _scaled_blocks(values: torch.Tensor, blocksize: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """`values` (scaled values, 2^-9 <= |v| < 0.99, already representable in `dtype`) times a power
    of two per block, with one element of each block (at _MAX_AT of it) set to +-1 times that power,
    so that every scaled value is exactly `values`' (the reciprocal of a power of two is exact) and
    the block's maximum is that one element."""
    n = values.numel()
    g = _gen(seed)
    blocks = -(-n // blocksize)
    lo, hi = _EXPONENTS[dtype]
    exps = torch.randint(lo, hi, (blocks,), generator=g).double()
    scale = torch.repeat_interleave(2.0**exps, blocksize)[:n]
    x = values.double() * scale
    for b in range(blocks):
        i = b * blocksize + int(_MAX_AT[b % len(_MAX_AT)] * min(blocksize, n - b * blocksize))
        x[i] = (-1.0 if b % 2 else 1.0) * 2.0 ** exps[b].item()
    return x.to(dtype)


def _clear_of(values: torch.Tensor, points: torch.Tensor, dtype: torch.dtype, gap: float, n: int) -> torch.Tensor:
    """The first `n` of `values`, rounded to `dtype`, that lie more than `gap` from every decision
    point and have magnitude 2^-9 <= |v| < 0.99 (values in float64)."""
    v = values.to(dtype).double()
    pts = points.double().sort().values
    at = torch.searchsorted(pts, v).clamp(1, pts.numel() - 1)  # the nearest point is at `at` or before it
    nearest = torch.minimum((v - pts[at - 1]).abs(), (v - pts[at]).abs())
    keep = (nearest > gap) & (v.abs() >= 2.0**-9) & (v.abs() < 0.99)
    v = v[keep]
    if v.numel() < n:  # (the pools are sized for this)
        raise RuntimeError(f"verification inputs: {v.numel()} usable values where {n} are needed")
    return v[:n]


def _blockwise_8bit_cases() -> Iterator[Case]:
    code = _signed_code()
    points = (code[:-1] + code[1:]) / 2  # the decision points (fl32 sum, exact halving)
    # (dtype, blocksize, n, whether to dequantize too): every dtype, blocksizes up to 256 (one
    # simdgroup a block) and above (simdgroups that meet in threadgroup memory), partial last blocks.
    shapes = [(torch.float16, 64, 2 * 64 + 37, True), (torch.bfloat16, 256, 3 * 256 + 5, True),
              (torch.float32, 4096, 4096 + 129, True), (torch.float32, 128, 1, True),
              (torch.float16, 512, 3 * 512 + 99, False), (torch.bfloat16, 1024, 2 * 1024 + 300, False),
              (torch.float32, 2048, 2048 + 1500, False)]  # fmt: skip
    for i, (dtype, blocksize, n, dequantize) in enumerate(shapes):
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
        if not dequantize:
            continue
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
    # (dtype, blocksize, quant type, shape, whether to dequantize too); blocksizes above 256 as in
    # _blockwise_8bit_cases.
    shapes = [(torch.float16, 64, "nf4", (6, 128), True), (torch.bfloat16, 32, "fp4", (4, 96), True),
              (torch.float32, 256, "nf4", (2, 512), True), (torch.float32, 64, "fp4", (3, 64), True),
              (torch.float16, 128, "fp4", (1, 515), True), (torch.bfloat16, 512, "nf4", (3, 400), False),
              (torch.float32, 2048, "fp4", (2, 1500), False)]  # fmt: skip
    for i, (dtype, blocksize, qt, shape, dequantize) in enumerate(shapes):
        n = math.prod(shape)
        A = _scaled_blocks(_fourbit_values(qt, n, dtype, seed=300 + i), blocksize, dtype, seed=400 + i).reshape(shape)
        tag = f"{qt} {dtype} blocksize={blocksize} {list(shape)}"
        yield Case(f"quantize_4bit {tag}", "quantize_4bit", (A, blocksize, qt, torch.uint8), _same)
        if not dequantize:
            continue
        packed, absmax = torch.ops.bitsandbytes.quantize_4bit.default(A.float(), blocksize, qt, torch.uint8)
        # An odd element count takes bitsandbytes' CPU dequantizer to its torch.compile'd path (seconds
        # to compile, once a process): the result docs/semantics.md defines is computed here instead.
        expected = None if n % 2 == 0 else _dequantize_4bit_expected(packed, absmax, blocksize, qt, shape)
        for out_dtype in DTYPES:
            yield Case(f"dequantize_4bit {tag} -> {out_dtype}", "dequantize_4bit",
                       (packed, absmax, blocksize, qt, list(shape), out_dtype), _same,
                       expected=expected and (lambda args: expected(args[5])))  # fmt: skip
        out = torch.full(shape, 3.0, dtype=dtype)
        yield Case(f"dequantize_4bit.out {tag}", "dequantize_4bit.out",
                   (packed, absmax, blocksize, qt, list(shape), dtype, out),
                   _same_arg(6) if expected is None else _arg_as_expected(6),
                   expected=expected and (lambda args: expected(args[5])))  # fmt: skip


def _arg_as_expected(index: int) -> Callable:
    """Compares argument `index` after the call with the expected result."""

    def compare(got, want, got_args, want_args):
        return exact(got_args[index], want, f"argument {index} after the call")

    return compare


def _dequantize_4bit_expected(packed: torch.Tensor, absmax: torch.Tensor, blocksize: int, quant_type: str,
                              shape) -> Callable[[torch.dtype], torch.Tensor]:  # fmt: skip
    """dtype -> docs/semantics.md section 3's dequantized values of `packed` (absmax normal floats)."""
    n = math.prod(shape)
    table = (torch.tensor(_NF4) if quant_type == "nf4" else _fp4_table()).double().tolist()
    nibbles = [b >> 4 if j % 2 == 0 else b & 15 for j, b in enumerate(packed.reshape(-1).repeat_interleave(2).tolist())]
    values = [table[c] for c in nibbles[:n]]
    return lambda dtype: _spec_dequantize(values, absmax, blocksize, dtype, tuple(shape))


# -- special values: the results docs/semantics.md defines where bitsandbytes' CPU code departs --------------
#
# NaN (ignored by the block maximum, code 0), infinities (an infinite maximum scales every finite
# element to zero), all-zero blocks (absmax 0, every code 0), float32 and bfloat16 subnormals (zero
# on Apple GPUs: section 7) and block maxima above 2^126 (whose reciprocal is a float32 subnormal,
# which the kernels form exactly). bitsandbytes' CPU quantizers compute other things there, so these
# cases carry their expected results, computed below element by element in exact arithmetic
# (Fractions; no float32 arithmetic of this CPU, whose flush-to-zero setting is not known).
# Inputs keep to what an IEEE and an Apple GPU agree on: no negative subnormal in an FP4 block (its
# sign bit is the one place the two differ), no dequantized value below 2^-126.

_F32_MAX = float(torch.finfo(torch.float32).max)
_F32_MIN_NORMAL = 2.0**-126


def _f32(v: Fraction) -> float:
    """v rounded to float32 (ties to even; subnormals kept, overflow to inf), as a Python float.
    A zero result has v's sign."""
    if v == 0:
        return 0.0
    a = abs(v)
    e = a.numerator.bit_length() - a.denominator.bit_length()  # 2^(e-1) < a < 2^(e+1)
    if a < Fraction(2) ** e:
        e -= 1
    q = max(e - 23, -149)  # the spacing of float32 values at a: 2^q
    units = round(a / Fraction(2) ** q)  # (round half to even)
    r = math.ldexp(units, q)
    r = math.inf if r > _F32_MAX else r
    return -r if v < 0 else r


def _round32(d: float) -> float:
    """The Python float d (a correctly rounded double) rounded to float32: by the C conversion where
    the result is a normal float32 (no flush-to-zero setting applies there), else exactly. (Rounding
    the double of an exact product, quotient or sum of two float32 values to float32 gives the
    correctly rounded float32 result: 53 >= 2 * 24 + 2.)"""
    if _F32_MIN_NORMAL <= abs(d) <= _F32_MAX:
        return struct.unpack("<f", struct.pack("<f", d))[0]
    if d != d or d == 0.0 or math.isinf(d):
        return d
    return _f32(Fraction(d))


def _mul32(x: float, y: float) -> float:
    """fl32(x * y) of two float32 values (IEEE: subnormal results kept), NaN and infinities as IEEE."""
    return _round32(x * y)  # (the double product of two float32 values is exact)


def _floats(t: torch.Tensor) -> list[float]:
    """t's elements in flat order as Python floats (exact for float16/bfloat16/float32), float32 and
    bfloat16 subnormals as zeros of their sign (section 7: such an input counts as zero)."""
    xs = t.reshape(-1).double().tolist()
    if t.dtype == torch.float16:
        return xs
    return [math.copysign(0.0, x) if 0.0 < abs(x) < _F32_MIN_NORMAL else x for x in xs]


def _block_scales(xs: list[float], blocksize: int) -> tuple[list[float], list[float]]:
    """(absmax, r) per block: the largest |x| (NaN ignored), and fl32(1 / absmax) (inf for 0, 0 for inf)."""
    absmax, recip = [], []
    for b in range(0, len(xs), blocksize):
        m = max((abs(x) for x in xs[b : b + blocksize] if x == x), default=0.0)
        absmax.append(m)
        recip.append(math.inf if m == 0.0 else 0.0 if math.isinf(m) else _round32(1.0 / m))
    return absmax, recip


def _thresholds(table: torch.Tensor) -> list[float]:
    """t_k = fl32(table[k] + table[k+1]) / 2 (float32 sums of normal values: exact on any CPU)."""
    t = table.float()
    return ((t[:-1] + t[1:]) * 0.5).double().tolist()


def _index_8bit(s: float, t: list[float]) -> int:
    if s != s:
        return 0
    q = bisect.bisect_left(t, s)  # #{k : t_k < s}
    return q + 1 if q < len(t) and t[q] == s and q % 2 == 1 else q


_FP4_TREE = torch.tensor([0.29166667, 0.583333, 0.8333333, 0.4166667, 0.0859375, 0.20833333, 0.00260417],
                         dtype=torch.float32).double().tolist()  # fmt: skip


@functools.cache
def _nf4_thresholds() -> tuple[float, ...]:
    return tuple(_thresholds(torch.tensor(_NF4)))


def _index_4bit(s: float, quant_type: str) -> int:
    if s != s:
        return 0
    if quant_type == "nf4":
        return bisect.bisect_left(_nf4_thresholds(), s)
    c = _FP4_TREE
    m = abs(s)
    if m > c[0]:
        code = (3 if m > c[2] else 2) if m > c[1] else (5 if m > c[3] else 4)
    else:
        code = (7 if m > c[5] else 6) if m > c[4] else (1 if m > c[6] else 0)
    return code | (8 if s < 0 else 0)


def _spec_quantize_blockwise(A: torch.Tensor, code: torch.Tensor, blocksize: int):
    """docs/semantics.md section 2 (with section 7): (codes shaped like A, absmax)."""
    xs = _floats(A)
    absmax, recip = _block_scales(xs, blocksize)
    t = _thresholds(code)
    q = [_index_8bit(_mul32(x, recip[i // blocksize]), t) for i, x in enumerate(xs)]
    return (torch.tensor(q, dtype=torch.uint8).reshape(A.shape), torch.tensor(absmax, dtype=torch.float64).float())


def _spec_quantize_4bit(A: torch.Tensor, blocksize: int, quant_type: str):
    """docs/semantics.md section 3 (with section 7): (packed uint8 [ceil(n / 2), 1], absmax)."""
    xs = _floats(A)
    absmax, recip = _block_scales(xs, blocksize)
    nib = [_index_4bit(_mul32(x, recip[i // blocksize]), quant_type) for i, x in enumerate(xs)]
    if len(nib) % 2:  # the code of the value 0 in the last block
        nib.append(_index_4bit(_mul32(0.0, recip[-1]), quant_type))
    packed = [(hi << 4) | lo for hi, lo in zip(nib[0::2], nib[1::2])]
    return (torch.tensor(packed, dtype=torch.uint8).reshape(-1, 1), torch.tensor(absmax, dtype=torch.float64).float())


def _spec_dequantize(values: list[float], absmax: torch.Tensor, blocksize: int, dtype: torch.dtype,
                     shape) -> torch.Tensor:  # fmt: skip
    """out_i = T(fl32(values_i * absmax[i // blocksize])), a float32 product below 2^-126 zero
    (section 7). (The conversion to T is the CPU's: right where no float16 subnormal arises, which
    the cases keep to.)"""
    scales = absmax.double().tolist()
    out = []
    for i, v in enumerate(values):
        p = _mul32(v, scales[i // blocksize])
        out.append(math.copysign(0.0, p) if abs(p) < _F32_MIN_NORMAL else p)
    return torch.tensor(out, dtype=torch.float64).float().to(dtype).reshape(shape)


def _f32_step(x: float, up: bool) -> float:
    """The float32 neighbour of the float32 value x (x normal, not zero)."""
    bits = struct.unpack("<i", struct.pack("<f", x))[0]
    bits += 1 if (up == (x > 0)) else -1
    return struct.unpack("<f", struct.pack("<i", bits))[0]


def _near(t: float, r: float, above: bool) -> float:
    """The float32 x whose scaled value fl32(x * r) lies just above decision point t (the smallest
    such x), or just below it (the largest): a wrong reciprocal r moves it to the other side."""
    x = _f32(Fraction(t) / Fraction(r))
    if above:
        while _mul32(x, r) <= t:
            x = _f32_step(x, True)
        while _mul32(_f32_step(x, False), r) > t:
            x = _f32_step(x, False)
    else:
        while _mul32(x, r) >= t:
            x = _f32_step(x, False)
        while _mul32(_f32_step(x, True), r) < t:
            x = _f32_step(x, True)
    return x


def _recip_rounds_up(m: float) -> bool:
    """Whether fl32(1 / m) is above 1 / m (m a float32 value above 2^126: the subnormal reciprocal)."""
    return _f32(1 / Fraction(m)) > 1 / Fraction(m)


def _special_block_values(kind: str, n: int, points: list[float], g: torch.Generator, negative_subnormals: bool,
                          dtype: torch.dtype) -> list[float]:  # fmt: skip
    """One block of special values (Python floats, which the caller rounds to `dtype`)."""
    sub = [2.0**-130, 2.0**-127 * 1.5, 2.0**-133 * 1.25, 2.0**-128]  # float32 and bfloat16 subnormals
    rand = (torch.rand(n, generator=g, dtype=torch.float64) * 2 - 1).to(dtype).double().tolist()
    if kind == "zeros":
        return [0.0 if i % 3 else -0.0 for i in range(n)]
    if kind == "subnormals":  # all zeros and subnormals: an all-zero block
        return [(sub[i % 4] if i % 5 else 0.0) * (-1.0 if negative_subnormals and i % 2 else 1.0) for i in range(n)]
    if kind == "nan":  # NaN ignored by the maximum; subnormals code as zeros
        xs = [v * 8.0 for v in rand]
        for i in range(0, n, 7):
            xs[i] = math.nan
        for k, i in enumerate(range(3, n, 11)):
            xs[i] = sub[k % 4] * (-1.0 if negative_subnormals and k % 2 else 1.0)
        xs[n // 2] = -8.0
        return xs
    if kind == "inf":  # an infinite maximum: finite elements scale to zeros, infinities to NaN
        xs = [v * 2.0**-20 for v in rand]
        xs[1], xs[n - 3], xs[n // 2] = math.inf, -math.inf, math.nan
        return xs
    # Above 2^126: a maximum whose reciprocal rounds up ("up") or down ("down"), or the float32
    # maximum; elements just either side of decision points, the rest random.
    if kind == "max":
        m = _F32_MAX
    else:
        e = 127 if kind == "up" else 126  # (both exponents above 2^126)
        m = next(v for v in (torch.rand(64, generator=g, dtype=torch.float64) + 1).float().double().tolist()
                 if _recip_rounds_up(v * 2.0**e) == (kind == "up")) * 2.0**e  # fmt: skip
    r = _f32(1 / Fraction(m))
    xs = [_round32(v * m * 0.98) for v in rand]
    k = 0
    for t in points:
        if k + 2 > n - 1:
            break
        if abs(t) < 0.98:
            xs[k], xs[k + 1] = _near(t, r, True), _near(t, r, False)
            k += 2
    xs[n - 1] = -m if kind == "down" else m
    return xs


def _special_tensor(kinds: list[str], blocksize: int, dtype: torch.dtype, points: list[float], seed: int,
                    negative_subnormals: bool = True, tail: int = 0) -> torch.Tensor:  # fmt: skip
    """Blocks of the given kinds, then `tail` elements of a partial last block (NaN, values, -inf)."""
    g = _gen(seed)
    xs: list[float] = []
    for kind in kinds:
        xs += _special_block_values(kind, blocksize, points, g, negative_subnormals, dtype)
    if tail:
        xs += [math.nan] + [(-1.0) ** i * (i + 1) / 8 for i in range(tail - 2)] + [-math.inf]
    return torch.tensor(xs, dtype=torch.float64).to(dtype)


def _special_8bit_cases() -> Iterator[Case]:
    code = _signed_code()
    points = _thresholds(code)[8::16]  # every 16th decision point
    specs = [(torch.float32, 64, ["zeros", "subnormals", "nan", "inf", "up", "down", "max"], 37),
             (torch.bfloat16, 128, ["subnormals", "nan", "inf", "up"], 0)]  # fmt: skip
    for i, (dtype, blocksize, kinds, tail) in enumerate(specs):
        A = _special_tensor(kinds, blocksize, dtype, points, seed=1000 + i, tail=tail)
        tag = f"{dtype} blocksize={blocksize} n={A.numel()} ({', '.join(kinds)})"
        yield Case(f"quantize_blockwise special values {tag}", "quantize_blockwise", (A, code, blocksize), _same,
                   expected=lambda args: _spec_quantize_blockwise(args[0], args[1], args[2]))  # fmt: skip
        q, absmax = _spec_quantize_blockwise(A, code, blocksize)
        table = code.double().tolist()
        values = [table[c] for c in q.reshape(-1).tolist()]
        # (float32 out: the block maxima near the float32 maximum would overflow a narrower dtype,
        # where a GPU's conversion may saturate instead of giving inf; narrower outputs are verified
        # with ordinary values above.)
        yield Case(f"dequantize_blockwise special values {tag} -> float32", "dequantize_blockwise",
                   (q, absmax, code, blocksize, torch.float32), _same,
                   expected=lambda args, v=values, a=absmax, bs=blocksize, sh=A.shape:
                   _spec_dequantize(v, a, bs, torch.float32, sh))  # fmt: skip


def _special_4bit_cases() -> Iterator[Case]:
    nf4_points = _thresholds(torch.tensor(_NF4))
    fp4_points = sorted(_FP4_TREE + [-c for c in _FP4_TREE])
    specs = [("nf4", torch.float32, 64, ["zeros", "subnormals", "nan", "inf", "up", "down", "max"], nf4_points, 21),
             ("fp4", torch.float32, 32, ["subnormals", "nan", "inf", "up", "down", "max"], fp4_points, 9),
             ("nf4", torch.bfloat16, 64, ["subnormals", "nan", "inf", "up"], nf4_points, 0)]  # fmt: skip
    for i, (qt, dtype, blocksize, kinds, points, tail) in enumerate(specs):
        A = _special_tensor(kinds, blocksize, dtype, points, seed=1100 + i, negative_subnormals=qt == "nf4", tail=tail)
        tag = f"{qt} {dtype} blocksize={blocksize} n={A.numel()} ({', '.join(kinds)})"
        yield Case(f"quantize_4bit special values {tag}", "quantize_4bit", (A, blocksize, qt, torch.uint8), _same,
                   expected=lambda args: _spec_quantize_4bit(args[0], args[1], args[2]))  # fmt: skip
        if dtype != torch.float32:
            continue
        packed, absmax = _spec_quantize_4bit(A, blocksize, qt)
        expected = _dequantize_4bit_expected(packed, absmax, blocksize, qt, [A.numel()])
        yield Case(f"dequantize_4bit special values {tag} -> float32", "dequantize_4bit",
                   (packed, absmax, blocksize, qt, [A.numel()], torch.float32), _same,
                   expected=lambda args, e=expected: e(args[5]))  # fmt: skip


def _fp4_table() -> torch.Tensor:
    """FP4's 16 values as float32 (nibble 8 is -0.0)."""
    mags = torch.tensor(_FP4_MAGNITUDES, dtype=torch.float32)
    return torch.cat([mags, -mags])


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


def _matmul_cases(M: int, N: int, K: int, seed: int) -> Iterator[Case]:
    """Products of one kernel path: every activation dtype with plain and nested block scales, NF4
    and FP4, with and without bias; A aligned (vector loads) and not (`Unaligned`: its start, and
    for M > 1 its row starts, off the 16-byte grid, which the kernels read with scalar loads)."""
    import bitsandbytes.functional as F

    configs = [(torch.float16, "nf4", 64, True, True, False), (torch.bfloat16, "fp4", 32, False, True, False),
               (torch.float32, "nf4", 128, True, False, False), (torch.float16, "fp4", 256, False, False, True),
               (torch.bfloat16, "nf4", 64, True, True, True), (torch.float32, "fp4", 128, False, True, True)]  # fmt: skip
    for i, (dtype, qt, blocksize, nested, with_bias, unaligned) in enumerate(configs):
        g = _gen(seed + i)
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
        if not nested and (i == 1 or unaligned and dtype == torch.float16):
            table = torch.tensor(_NF4) if qt == "nf4" else _fp4_table()
            gargs = (a, packed, [N, K], state.absmax, table.float(), blocksize)
            yield Case(f"gemv_4bit {tag}", "gemv_4bit", gargs, _matmul_compare(A, Wq, None))
            if not unaligned:
                out = torch.full((M, N), float("nan"), dtype=dtype)
                yield Case(f"gemv_4bit.out {tag}", "gemv_4bit.out", gargs + (out,),
                           _matmul_compare(A, Wq, None, index=6))  # fmt: skip


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
    for dtype, bias_dtype in ((torch.float16, torch.float16), (torch.bfloat16, torch.bfloat16),
                              (torch.float32, torch.float32), (torch.float16, torch.float32),
                              (torch.bfloat16, torch.float32)):  # fmt: skip
        bias = (torch.randn(24, generator=g) * 50).to(bias_dtype)
        yield Case(f"int8_mm_dequant (6, 24) -> {dtype} {bias_dtype} bias", "int8_mm_dequant",
                   (acc, row, col, dtype, bias), _int8_dequant_compare())  # fmt: skip
    # docs/semantics.md section 7: float32 and bfloat16 subnormals count as zeros (a row of them is a
    # zero row); the CPU computes that from the same input with the subnormals zeroed.
    for i, (dtype, op, threshold) in enumerate(((torch.float32, "int8_vectorwise_quant", 0.0),
                                                (torch.bfloat16, "int8_double_quant", 6.0))):  # fmt: skip
        A = _int8_activations(8, 40, torch.float32, seed=530 + i)
        A[4] = torch.tensor([2.0**-130, -(2.0**-127) * 1.5, 2.0**-128, -(2.0**-133)] * 10)
        A[5, ::3] = 2.0**-129
        A = A.to(dtype)
        yield Case(f"{op} {tuple(A.shape)} {dtype} threshold={threshold} subnormals", op, (A, threshold), _same,
                   expected=lambda args, op=op: cpu_round_trip_call(op, [_flushed(args[0]), args[1]]))  # fmt: skip


def _int8_codes(M: int, K: int, g: torch.Generator, N: int = 24) -> tuple[torch.Tensor, torch.Tensor]:
    """Random int8 codes with extreme rows: A's first row all 127 (and its last all -127), B's
    first rows all 127 and all -127, so that their products are +-127 * 127 * K."""
    A = torch.randint(-127, 128, (M, K), generator=g, dtype=torch.int8)
    B = torch.randint(-127, 128, (N, K), generator=g, dtype=torch.int8)
    A[0] = 127
    if M > 1:
        A[-1] = -127
    B[0] = 127
    B[1] = -127
    return A, B


def _flushed(t: torch.Tensor) -> torch.Tensor:
    """t with its float32 and bfloat16 subnormals zeroed (their sign kept)."""
    if t.dtype == torch.float16:
        return t.clone()
    tiny = (t.float().abs() < _F32_MIN_NORMAL) & (t != 0)
    return torch.where(tiny, t * 0, t)


def cpu_round_trip_call(op: str, args: list):
    from .cpu_round_trip import cpu_call

    return cpu_call(op, args)


def _int8_product_cases() -> Iterator[Case]:
    # The exact int32 product on every kernel path (bnb_mps.ops.int8.matmul_path: gemv1, gemv4,
    # tile32, tile64, each with 16-byte loads when K % 16 == 0 and without otherwise). The rows of
    # +-127 reach a float32 sum beyond 2^24 (no longer exact) where K > 1040: 127 * 127 * 1088 =
    # 17,548,352; the kernels keep their float partial sums below that (the gemv paths with and
    # without 16-byte loads, and the tiled paths, which share that code, at M = 12).
    g = _gen(600)
    for M, K, ops_ in ((1, 1088, "fo"), (5, 1088, "fo"), (33, 96, "f"), (12, 1088, "o"), (1, 1090, "f"),
                       (5, 100, "o"), (12, 100, "f"), (33, 40, "f")):  # fmt: skip
        A, B = _int8_codes(M, K, g)
        if "f" in ops_:
            yield Case(f"int8_linear_matmul {M}x24x{K}", "int8_linear_matmul", (A, B), _same)
        if "o" in ops_:
            yield Case(f"int8_linear_matmul.out {M}x24x{K}", "int8_linear_matmul.out",
                       (A, B, torch.full((M, 24), -1, dtype=torch.int32)), _same_arg(2))  # fmt: skip
    # The dequantizing products: every output dtype, a bias of the output dtype and a float32 one
    # (the _f32bias kernels), every path with and without 16-byte loads between them.
    X = _int8_activations(40, 64, torch.float16, seed=610)
    W = _int8_activations(24, 64, torch.float16, seed=611) * 0.05
    CA, SCA, cols = torch.ops.bitsandbytes.int8_vectorwise_quant.default(X, 6.0)
    CB, SCB, _ = torch.ops.bitsandbytes.int8_vectorwise_quant.default(W, 0.0)
    for M, dtype in ((12, torch.float16), (5, torch.bfloat16), (1, torch.float32)):
        bias = (torch.randn(24, generator=g) * 3).to(dtype)
        yield Case(f"int8_scaled_mm {M}x24x64 -> {dtype} bias", "int8_scaled_mm",
                   (CA[:M], CB, SCA[:M], SCB, bias, dtype), _int8_dequant_compare())  # fmt: skip
    yield Case("int8_scaled_mm 1x24x64 -> float16", "int8_scaled_mm", (CA[:1], CB, SCA[:1], SCB, None, None),
               _int8_dequant_compare())  # fmt: skip
    bias = (torch.randn(24, generator=g) * 3).half()
    yield Case(f"int8_mixed_scaled_mm 40x24x64 outliers={cols.numel()}", "int8_mixed_scaled_mm",
               (X, CA, CB, SCA, SCB, cols, bias), _mixed_compare(X, CB, SCB, cols))  # fmt: skip
    X2 = _int8_activations(40, 72, torch.float32, seed=612)
    W2 = _int8_activations(24, 72, torch.float32, seed=613) * 0.05
    CA2, SCA2, _ = torch.ops.bitsandbytes.int8_vectorwise_quant.default(X2, 0.0)
    CB2, SCB2, _ = torch.ops.bitsandbytes.int8_vectorwise_quant.default(W2, 0.0)
    bias32 = torch.randn(24, generator=g) * 3
    for M, dtype, bias in ((5, torch.bfloat16, bias32), (33, torch.float16, bias32), (1, torch.float32, bias32),
                           (12, torch.float32, None)):  # fmt: skip
        yield Case(f"int8_scaled_mm {M}x24x72 -> {dtype}{' float32 bias' if bias is not None else ''}", "int8_scaled_mm",
                   (CA2[:M], CB2, SCA2[:M], SCB2, bias, dtype), _int8_dequant_compare())  # fmt: skip
    Xb = _int8_activations(5, 64, torch.bfloat16, seed=614)
    CAb, SCAb, colsb = torch.ops.bitsandbytes.int8_vectorwise_quant.default(Xb, 6.0)
    yield Case(f"int8_mixed_scaled_mm 5x24x64 bfloat16 outliers={colsb.numel()}", "int8_mixed_scaled_mm",
               (Xb, CAb, CB, SCAb, SCB, colsb, (torch.randn(24, generator=g) * 3).to(torch.bfloat16)),
               _mixed_compare(Xb, CB, SCB, colsb))  # fmt: skip


def _mixed_compare(X, CB, SCB, cols) -> Callable:
    def compare(got, want, got_args, want_args):
        err = exact(got[1], want[1], "subA")
        if err:
            return err
        # The outlier product (in A's dtype) on top of the int8 one: a rounding of each of its terms.
        Wout = CB[:, cols].double() * SCB.double()[:, None] / 127
        mag = want[0].double().abs() + X[:, cols].double().abs() @ Wout.abs().T
        return close(got[0], want[0], 8 * _eps(X.dtype) * mag + 1e-30, "out")

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
# (name, dtype, weight decay, max_unorm). Update-norm clipping that acts only for lars: bitsandbytes'
# CPU lamb takes the norm of m / (sqrt(v) + eps*bc2), without docs/semantics.md's bias corrections,
# so its trust ratio differs by bc2 / bc1. The others with max_unorm 1e4 clip with a bound their
# update norm stays far below: the norm pass of every optimizer runs (a wrong norm far above the
# bound would clip), the update is unchanged.
_OPT32 = [("adam", torch.float16, 0.0, 0.0), ("lamb", torch.float32, 0.0, 1e4), ("ademamix", torch.float32, 0.0, 1e4),
          ("momentum", torch.float32, 0.01, 0.0), ("lars", torch.bfloat16, 0.0, 0.002),
          ("rmsprop", torch.float32, 0.01, 1e4), ("adagrad", torch.float16, 0.01, 1e4), ("lion", torch.bfloat16, 0.01, 1e4)]  # fmt: skip
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


def _routed(cases: Iterator[Case], route: str) -> Iterator[Case]:
    for case in cases:
        yield replace(case, label=f"{case.label} ({route})", route=route)


#: Every kernel family, in the order they are verified.
FAMILIES: dict[str, Family] = {f.name: f for f in [
    Family("blockwise_8bit", ("quantize_blockwise", "dequantize_blockwise", "dequantize_blockwise.out"),
           lambda: itertools.chain(_blockwise_8bit_cases(), _special_8bit_cases())),
    Family("nf4_fp4", ("quantize_4bit", "dequantize_4bit", "dequantize_4bit.out"),
           lambda: itertools.chain(_fourbit_cases(), _special_4bit_cases())),
    # The three kernel paths of the 4-bit products (bnb_mps.ops.matmul_4bit.choose_path): M = 1 with
    # K % 32 == 0; M <= 8 with K % 16 == 0; larger M, or K % 16 != 0. A failing path takes all three ops.
    # K spans more than one step of every lane in the gemv (1024 per step) and batch (512) kernels;
    # N leaves a partial group of 8 weight rows there, a partial tile of 64 in mma.
    Family("matmul_4bit_gemv", _MATMUL_OPS, lambda: _matmul_cases(1, 20, 1280, seed=900)),
    Family("matmul_4bit_batch", _MATMUL_OPS, lambda: _matmul_cases(5, 20, 560, seed=910)),
    Family("matmul_4bit_mma", _MATMUL_OPS, lambda: _matmul_cases(37, 40, 200, seed=920)),
    # A kernel variant of a path (its 16-entry table in threadgroup memory): no op leaves the tier when
    # it fails, only the variant is then no candidate for tuning (bnb_mps.ops.tuning).
    Family("matmul_4bit_tglut", (), lambda: _routed(_matmul_cases(1, 20, 1280, seed=930), "gemv/tglut")),
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


@dataclass(frozen=True)
class Unaligned:
    """A case argument that the kernel tier receives as a view at an awkward address: `offset`
    elements into its storage, rows `pad` elements apart beyond their length (a 2-D tensor), so
    that neither its start nor its row starts are 16-byte aligned. The CPU side gets `tensor`."""

    tensor: torch.Tensor
    offset: int = 1
    pad: int = 0

    def on(self, device: str) -> torch.Tensor:
        t = self.tensor
        rows, cols = (t.shape[0], t.shape[1]) if t.dim() == 2 else (1, t.numel())
        ld = cols + self.pad
        storage = torch.zeros(self.offset + rows * ld, dtype=t.dtype, device=device)
        view = storage[self.offset:].view(rows, ld)[:, :cols]
        view.copy_(t.reshape(rows, cols).to(device))
        return view if t.dim() == 2 else view.reshape(t.shape)


def _to(x: Any, device: str) -> Any:
    """A case argument for the kernel tier, on `device` (a copy: the case keeps its own)."""
    if isinstance(x, Unaligned):
        return x.on(device)
    if isinstance(x, torch.Tensor):
        return x.to(device) if device != "cpu" else x.clone()
    if isinstance(x, list):
        return list(x)
    return x


def _plain(x: Any) -> Any:
    """A case argument for the CPU side (a copy)."""
    if isinstance(x, Unaligned):
        return x.tensor.clone()
    return _to(x, "cpu")


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


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"


class _LaunchFailed(Exception):
    """The executor raised in a launch (carries what it raised)."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error


class _Counting:
    """Forwards launches to an executor, counting them and the bytes of the tensors they bind; what
    the executor raises comes out wrapped (_LaunchFailed), to tell it from the op layer's errors."""

    def __init__(self, inner) -> None:
        self.inner, self.name = inner, inner.name
        self.launches = self.bytes = 0

    def launch(self, kernel, *, grid, threadgroup, args) -> None:
        from ..executors import PipelineLimitError

        try:
            self.inner.launch(kernel, grid=grid, threadgroup=threadgroup, args=args)
        except Exception as e:
            if not isinstance(e, PipelineLimitError):  # (a refused launch did not run)
                self._count(args)
            raise _LaunchFailed(e) from e
        self._count(args)

    def _count(self, args) -> None:
        self.launches += 1
        self.bytes += sum(a.numel() * a.element_size() for a in args if isinstance(a, torch.Tensor))


def _cannot_run(e: BaseException) -> bool:
    """Whether a launch error says the tier cannot run kernels here at all (no C++ compiler for the
    emulator, the emulator runtime or the tier missing, out of memory), as opposed to a fault of
    the kernels (an emulator fault, kernel source that does not compile, a GPU tier's error), which
    fails the family for good."""
    from .. import emulator
    from ..emulator import build
    from ..executors import ExecutorUnavailable, KernelUnavailable

    if isinstance(e, KernelUnavailable) and e.__cause__ is not None:  # its compile unit's own error
        e = e.__cause__
    if isinstance(e, emulator.CompileError):
        try:
            build.compiler_identity(build.find_compiler())
        except emulator.CompileError:
            return True  # no compiler that runs: nothing was compiled
        return False
    return isinstance(e, (ExecutorUnavailable, ImportError, OSError, MemoryError))


def run_family(family: Family, executor, device: str) -> Verdict:
    """Runs `family`'s cases with `executor` on `device` tensors (every launch first, then one
    synchronisation), then compares each with its reference (the CPU round trip, or the result
    docs/semantics.md defines). Never raises: a case that cannot run fails the family, a refused
    launch skips its case (see the module docstring)."""
    from ..executors import PipelineLimitError
    from .cpu_round_trip import cpu_call

    start = time.perf_counter()
    recorder = _Counting(executor)
    label = None
    skipped: list[str] = []

    def verdict(passed: bool, error: Optional[str] = None, could_not_run: bool = False) -> Verdict:
        return Verdict(family.name, passed, time.perf_counter() - start, None if passed else label, error,
                       recorder.launches, recorder.bytes, skipped=tuple(skipped),
                       could_not_run=could_not_run and not passed)  # fmt: skip

    try:
        pending = []
        for case in family.cases():
            label = case.label
            op = OPS[case.op]
            bound = bind(case.op, tuple(_to(a, device) for a in case.args), {})
            op.check(*bound)
            try:
                routed = {"route": case.route} if case.route is not None else {}
                pending.append((case, op.kernel(recorder, *bound, **routed), bound))
            except _LaunchFailed as e:
                if isinstance(e.error, PipelineLimitError):  # the op leaves the tier when a user's call meets it
                    skipped.append(f"{case.label}: {e.error}")
                    continue
                return verdict(False, _first_line(e.error), could_not_run=_cannot_run(e.error))
        label = None
        try:
            _synchronize(device)
        except Exception as e:  # (an error of the device, not of one case: verified again next time)
            return verdict(False, f"synchronising after the launches: {_first_line(e)}", could_not_run=True)
        for case, got, bound in pending:
            label = case.label
            want_args = [_plain(a) for a in case.args]
            want = case.expected(want_args) if case.expected is not None else cpu_call(case.op, want_args)
            error = case.compare(_cpu(got), want, _cpu(bound), want_args)
            if error is not None:
                if case.expected is not None:
                    error = error.replace("the CPU gives", "docs/semantics.md gives")
                return verdict(False, error)
    except Exception as e:  # the verification itself could not run (its inputs, the CPU reference)
        return verdict(False, _first_line(e), could_not_run=True)
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


def math_mode(tier: str, executor=None) -> Optional[str]:
    """The float arithmetic the tier's kernels run with, where it can change their results: the
    shader tier's math (PYTORCH_MPS_FAST_MATH reaches its kernels where torch compiles Metal below
    3.2), the emulated tier's float mode (BNB_MPS_EMU_FLOAT, or the executor's own setting)."""
    if tier == "shader":
        from ..executors import shader

        if not shader.fast_math_requested():
            return "safe math"
        mac = platform.mac_ver()[0]
        try:
            macos = tuple(int(p) for p in mac.split(".")[:2]) if mac else None
        except ValueError:
            macos = None
        return "safe math" if shader.math_mode_pinned(macos, shader.torch_version()) else "fast math"
    if tier == "emulated":
        from ..emulator.library import default_float_mode

        mode = getattr(executor, "float_mode", None)
        try:
            return f"float {mode or default_float_mode()}"
        except ValueError as e:  # an unknown BNB_MPS_EMU_FLOAT: launches fail the same way
            return f"float {e}"
    return None


def cache_key(tier: str, source_hash: str, executor=None) -> str:
    """The key of a tier's verdicts: every input that can change a kernel's results."""
    m = machine()
    parts = [tier, m["gpu"], m["os"], f"torch {m['torch']}", f"bitsandbytes {m['bitsandbytes']}",
             f"bnb-mps {m['bnb_mps']}", f"kernels {source_hash}"]  # fmt: skip
    mode_ = math_mode(tier, executor)
    if mode_ is not None:
        parts.append(mode_)
    return " | ".join(parts)


def cache_path() -> Path:
    """$BNB_MPS_VERIFY_CACHE, else $BNB_MPS_CACHE_DIR/verify.json, else ~/.cache/bnb_mps/verify.json."""
    file = os.environ.get(CACHE_ENV_VAR)
    if file:
        return Path(file).expanduser()
    root = os.environ.get("BNB_MPS_CACHE_DIR")
    return (Path(root) if root else Path.home() / ".cache" / "bnb_mps") / "verify.json"


_read_memo: dict[Path, dict] = {}  # cache file -> its content, read once per process


def _read_cache(fresh: bool = False) -> dict:
    """The cache file's content, {key: {family: entry}}; what is not of that shape counts as missing."""
    path = cache_path()
    if not fresh and path in _read_memo:
        return _read_memo[path]
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except Exception:  # missing, unreadable, not JSON (any malformed content counts as missing)
        data = {}
    if not isinstance(data, dict):
        data = {}
    data = {k: v for k, v in data.items() if isinstance(v, dict)}
    _read_memo[path] = data
    return data


def _write_cache(key: str, verdicts: dict[str, Verdict]) -> None:
    """Adds `verdicts` under `key` (atomically: a temporary file renamed into place). Never raises:
    a cache that cannot be written means verifying again next time."""
    path = cache_path()
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = {k: dict(v) for k, v in _read_cache(fresh=True).items()}  # (another process may have added some)
        entry = data.setdefault(key, {})
        for name, v in verdicts.items():
            entry[name] = {k: (list(val) if isinstance(val, tuple) else val) for k, val in asdict(v).items()
                           if k not in ("cached", "could_not_run")}  # fmt: skip
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".verify-", suffix=".json")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
        tmp = None
        _read_memo[path] = data
    except Exception as e:  # a read-only home, a full disk, a cache we cannot parse back
        logger.info("bnb_mps: cannot write the verification cache %s: %s", path, e)
    finally:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass


# The type of each field of a cached entry (bool is not an int here).
_ENTRY_FIELDS = {"family": str, "passed": bool, "seconds": float, "case": (str, type(None)),
                 "error": (str, type(None)), "launches": int, "bytes": int}  # fmt: skip


def _from_entry(family: str, entry: Any) -> Optional[Verdict]:
    """The Verdict a cache entry holds, or None where it is not exactly of the shape _write_cache writes."""
    if not isinstance(entry, dict) or set(entry) - set(_ENTRY_FIELDS) - {"skipped"}:
        return None
    for field_name, kind in _ENTRY_FIELDS.items():
        value = entry.get(field_name)
        if field_name == "seconds" and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if field_name not in entry or isinstance(value, bool) != (kind is bool) or not isinstance(value, kind):
            return None
    skipped = entry.get("skipped", [])
    if entry["family"] != family or not isinstance(skipped, list) or not all(isinstance(x, str) for x in skipped):
        return None
    if entry["launches"] < 0 or entry["bytes"] < 0 or not math.isfinite(entry["seconds"]):
        return None
    if not entry["passed"] and not (entry["case"] and entry["error"]):
        return None
    fields = {k: entry[k] for k in _ENTRY_FIELDS}
    fields["seconds"] = float(fields["seconds"])
    return Verdict(**fields, cached=True, skipped=tuple(skipped))


def _cached(key: str, family: str) -> Optional[Verdict]:
    entry = _read_cache().get(key)
    return _from_entry(family, entry.get(family)) if isinstance(entry, dict) else None


# -- the process's verdicts ---------------------------------------------------------------------------------


def mode() -> str:
    value = os.environ.get(ENV_VAR, "1").strip().lower() or "1"
    if value not in MODES:
        logger.warning("bnb_mps: ignoring %s=%r; expected 0, 1 or always", ENV_VAR, value)
        return "1"
    return value


_lock = threading.Lock()
_verdicts: dict[tuple[str, int, str, str], Verdict] = {}  # (tier, executor id, cache key, family) -> verdict
_warned = False


def verdict(family: str, tier: str, executor, *, refresh: bool = False) -> Verdict:
    """`family`'s verdict on `tier` (run with `executor`): from this process, else the disk cache
    (unless BNB_MPS_VERIFY=always or `refresh`), else by running it now. Never raises."""
    from ..msl import source

    try:
        key = cache_key(tier, source.source_hash(), executor)
    except Exception as e:  # no kernel source to hash, no machine to name: the kernels cannot run either
        return Verdict(family, False, 0.0, "(before the first case)", f"cannot key the verification: "
                       f"{_first_line(e)}", could_not_run=True)  # fmt: skip
    memo = (tier, id(executor), key, family)
    with _lock:
        found = None if refresh else _verdicts.get(memo)
        if found is not None:
            return found
        use_cache = not refresh and mode() != "always"
        found = _cached(key, family) if use_cache else None
        if found is None:
            found = run_family(FAMILIES[family], executor, getattr(executor, "device_type", "cpu"))
            if not found.could_not_run:  # (a verification that could not run is tried again next process)
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
            try:
                m = machine()
                where = f"{m['gpu']}, {m['os']}, torch {m['torch']}"
            except Exception:  # pragma: no cover
                where = "this machine"
            did = "could not be verified" if v.could_not_run else "failed verification"
            reason = f"the {tier} tier's {family} kernels {did} on this machine ({where}): {v.describe()}"
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
