"""The results docs/semantics.md defines where bitsandbytes' CPU code computes others, in exact
arithmetic: the special-value reference of the quantization cases (float32 rounding, the
quantizers' decision points and indices, dequantized values)."""

from __future__ import annotations

import bisect
import functools
import math
import struct
from collections.abc import Callable
from fractions import Fraction

import torch


NF4 = (-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
        -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
        0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941, 0.7229568362236023,
        1.0)  # fmt: skip
FP4_MAGNITUDES = (0.0, 0.0625 / 12, 8 / 12, 12 / 12, 4 / 12, 6 / 12, 2 / 12, 3 / 12)


def dequantize_4bit_expected(packed: torch.Tensor, absmax: torch.Tensor, blocksize: int, quant_type: str,
                              shape) -> Callable[[torch.dtype], torch.Tensor]:  # fmt: skip
    """dtype -> docs/semantics.md section 3's dequantized values of `packed` (absmax normal floats)."""
    n = math.prod(shape)
    table = (torch.tensor(NF4) if quant_type == "nf4" else fp4_table()).double().tolist()
    nibbles = [b >> 4 if j % 2 == 0 else b & 15 for j, b in enumerate(packed.reshape(-1).repeat_interleave(2).tolist())]
    values = [table[c] for c in nibbles[:n]]
    return lambda dtype: spec_dequantize(values, absmax, blocksize, dtype, tuple(shape))


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

F32_MAX = float(torch.finfo(torch.float32).max)
F32_MIN_NORMAL = 2.0**-126


def f32(v: Fraction) -> float:
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
    r = math.inf if r > F32_MAX else r
    return -r if v < 0 else r


def round32(d: float) -> float:
    """The Python float d (a correctly rounded double) rounded to float32: by the C conversion where
    the result is a normal float32 (no flush-to-zero setting applies there), else exactly. (Rounding
    the double of an exact product, quotient or sum of two float32 values to float32 gives the
    correctly rounded float32 result: 53 >= 2 * 24 + 2.)"""
    if F32_MIN_NORMAL <= abs(d) <= F32_MAX:
        return struct.unpack("<f", struct.pack("<f", d))[0]
    if d != d or d == 0.0 or math.isinf(d):
        return d
    return f32(Fraction(d))


def mul32(x: float, y: float) -> float:
    """fl32(x * y) of two float32 values (IEEE: subnormal results kept), NaN and infinities as IEEE."""
    return round32(x * y)  # (the double product of two float32 values is exact)


def _floats(t: torch.Tensor) -> list[float]:
    """t's elements in flat order as Python floats (exact for float16/bfloat16/float32), float32 and
    bfloat16 subnormals as zeros of their sign (section 7: such an input counts as zero)."""
    xs = t.reshape(-1).double().tolist()
    if t.dtype == torch.float16:
        return xs
    return [math.copysign(0.0, x) if 0.0 < abs(x) < F32_MIN_NORMAL else x for x in xs]


def _block_scales(xs: list[float], blocksize: int) -> tuple[list[float], list[float]]:
    """(absmax, r) per block: the largest |x| (NaN ignored), and fl32(1 / absmax) (inf for 0, 0 for inf)."""
    absmax, recip = [], []
    for b in range(0, len(xs), blocksize):
        m = max((abs(x) for x in xs[b : b + blocksize] if x == x), default=0.0)
        absmax.append(m)
        recip.append(math.inf if m == 0.0 else 0.0 if math.isinf(m) else round32(1.0 / m))
    return absmax, recip


def thresholds(table: torch.Tensor) -> list[float]:
    """t_k = fl32(table[k] + table[k+1]) / 2 (float32 sums of normal values: exact on any CPU)."""
    t = table.float()
    return ((t[:-1] + t[1:]) * 0.5).double().tolist()


def _index_8bit(s: float, t: list[float]) -> int:
    if s != s:
        return 0
    q = bisect.bisect_left(t, s)  # #{k : t_k < s}
    return q + 1 if q < len(t) and t[q] == s and q % 2 == 1 else q


FP4_TREE = torch.tensor([0.29166667, 0.583333, 0.8333333, 0.4166667, 0.0859375, 0.20833333, 0.00260417],
                         dtype=torch.float32).double().tolist()  # fmt: skip


@functools.cache
def _nf4_thresholds() -> tuple[float, ...]:
    return tuple(thresholds(torch.tensor(NF4)))


def _index_4bit(s: float, quant_type: str) -> int:
    if s != s:
        return 0
    if quant_type == "nf4":
        return bisect.bisect_left(_nf4_thresholds(), s)
    c = FP4_TREE
    m = abs(s)
    if m > c[0]:
        code = (3 if m > c[2] else 2) if m > c[1] else (5 if m > c[3] else 4)
    else:
        code = (7 if m > c[5] else 6) if m > c[4] else (1 if m > c[6] else 0)
    return code | (8 if s < 0 else 0)


def spec_quantize_blockwise(A: torch.Tensor, code: torch.Tensor, blocksize: int):
    """docs/semantics.md section 2 (with section 7): (codes shaped like A, absmax)."""
    xs = _floats(A)
    absmax, recip = _block_scales(xs, blocksize)
    t = thresholds(code)
    q = [_index_8bit(mul32(x, recip[i // blocksize]), t) for i, x in enumerate(xs)]
    return (torch.tensor(q, dtype=torch.uint8).reshape(A.shape), torch.tensor(absmax, dtype=torch.float64).float())


def spec_quantize_4bit(A: torch.Tensor, blocksize: int, quant_type: str):
    """docs/semantics.md section 3 (with section 7): (packed uint8 [ceil(n / 2), 1], absmax)."""
    xs = _floats(A)
    absmax, recip = _block_scales(xs, blocksize)
    nib = [_index_4bit(mul32(x, recip[i // blocksize]), quant_type) for i, x in enumerate(xs)]
    if len(nib) % 2:  # the code of the value 0 in the last block
        nib.append(_index_4bit(mul32(0.0, recip[-1]), quant_type))
    packed = [(hi << 4) | lo for hi, lo in zip(nib[0::2], nib[1::2])]
    return (torch.tensor(packed, dtype=torch.uint8).reshape(-1, 1), torch.tensor(absmax, dtype=torch.float64).float())


def spec_dequantize(values: list[float], absmax: torch.Tensor, blocksize: int, dtype: torch.dtype,
                     shape) -> torch.Tensor:  # fmt: skip
    """out_i = T(fl32(values_i * absmax[i // blocksize])), a float32 product below 2^-126 zero
    (section 7). (The conversion to T is the CPU's: right where no float16 subnormal arises, which
    the cases keep to.)"""
    scales = absmax.double().tolist()
    out = []
    for i, v in enumerate(values):
        p = mul32(v, scales[i // blocksize])
        out.append(math.copysign(0.0, p) if abs(p) < F32_MIN_NORMAL else p)
    return torch.tensor(out, dtype=torch.float64).float().to(dtype).reshape(shape)


def _f32_step(x: float, up: bool) -> float:
    """The float32 neighbour of the float32 value x (x normal, not zero)."""
    bits = struct.unpack("<i", struct.pack("<f", x))[0]
    bits += 1 if (up == (x > 0)) else -1
    return struct.unpack("<f", struct.pack("<i", bits))[0]


def near(t: float, r: float, above: bool) -> float:
    """The float32 x whose scaled value fl32(x * r) lies just above decision point t (the smallest
    such x), or just below it (the largest): a wrong reciprocal r moves it to the other side."""
    x = f32(Fraction(t) / Fraction(r))
    if above:
        while mul32(x, r) <= t:
            x = _f32_step(x, True)
        while mul32(_f32_step(x, False), r) > t:
            x = _f32_step(x, False)
    else:
        while mul32(x, r) >= t:
            x = _f32_step(x, False)
        while mul32(_f32_step(x, True), r) < t:
            x = _f32_step(x, True)
    return x


def recip_rounds_up(m: float) -> bool:
    """Whether fl32(1 / m) is above 1 / m (m a float32 value above 2^126: the subnormal reciprocal)."""
    return f32(1 / Fraction(m)) > 1 / Fraction(m)


def fp4_table() -> torch.Tensor:
    """FP4's 16 values as float32 (nibble 8 is -0.0)."""
    mags = torch.tensor(FP4_MAGNITUDES, dtype=torch.float32)
    return torch.cat([mags, -mags])


# -- int8 (section 6, with section 7): NaN and infinities ----------------------------------------------------
#
# NaN is left out of the row maxima, is never an outlier and quantizes to 0; in int8_double_quant's
# columns it makes the column's maximum NaN and every code of that column 0 (torch's amax, as
# bitsandbytes' CUDA backend takes it). An infinity counts in its row's (column's) maximum, whose row
# scale fl32(127 * fl32(1 / inf)) is 0, so that every code of that row (column) is 0 (inf * 0 and
# inf / inf are NaN, which quantizes to 0), or, at a threshold, is an outlier. A maximum of 0 gives
# codes 0. bitsandbytes' CPU code lets NaN into its row maxima.


def _int8_round(v: float) -> int:
    return 0 if v != v else max(-127, min(127, round(v)))  # (round: half to even; inf is clamped)


def _int8_code(x: float, maximum: float) -> int:
    """A row code: round_half_even(fl32(x * fl32(127 * fl32(1 / maximum)))) clamped, with fl32(127 / maximum)
    as the scale for a maximum above 2^126; NaN gives 0."""
    if maximum == 0.0:
        scale = 0.0
    elif maximum > 2.0**126:
        scale = round32(127.0 / maximum)  # (127 / inf is 0)
    else:
        scale = round32(127.0 * round32(1.0 / maximum))
    return _int8_round(mul32(x, scale))


def _int8_column_code(x: float, maximum: float, dtype: torch.dtype) -> int:
    """A column code: round_half_even(fl32(float(T(x * 127)) / maximum)), T = A's dtype, clamped;
    0 / 0, x / NaN and inf / inf give 0."""
    times127 = torch.tensor(x * 127.0, dtype=torch.float64).to(dtype).item()  # (x * 127 is exact in a double)
    if maximum == 0.0:
        return 0
    return _int8_round(round32(times127 / maximum))  # (x / NaN and inf / inf are NaN, coded 0)


def _int8_outliers(rows: list[list[float]], threshold: float) -> list[list[bool]]:
    return [[threshold > 0.0 and x == x and abs(x) >= threshold for x in row] for row in rows]


def _int8_max(values) -> float:
    return max((abs(x) for x in values if x == x), default=0.0)


def spec_int8_vectorwise_quant(A: torch.Tensor, threshold: float):
    """(CA, row_stats, outlier_cols) of a 2-D A: docs/semantics.md section 6."""
    rows = [_floats(r) for r in A]
    out = _int8_outliers(rows, threshold)
    stats = [_int8_max(0.0 if o else x for x, o in zip(r, ro)) for r, ro in zip(rows, out)]
    cols = sorted({c for ro in out for c, o in enumerate(ro) if o})
    zeroed = set(cols) if len(rows) > 1 else set()
    CA = [[0 if o or c in zeroed else _int8_code(x, m) for c, (x, o) in enumerate(zip(r, ro))]
          for r, ro, m in zip(rows, out, stats)]  # fmt: skip
    return (torch.tensor(CA, dtype=torch.int8).reshape(A.shape), torch.tensor(stats, dtype=torch.float32),
            torch.tensor(cols, dtype=torch.int64) if threshold > 0.0 else None)  # fmt: skip


def spec_int8_double_quant(A: torch.Tensor, threshold: float):
    """(CA, CAt, row_stats, col_stats, outlier_cols) of a 2-D A: docs/semantics.md section 6 (CAt
    has A's shape: each column quantized by its maximum, outliers as 0)."""
    CA, row_stats, cols = spec_int8_vectorwise_quant(A, threshold)
    rows = [_floats(r) for r in A]
    out = _int8_outliers(rows, threshold)
    masked = [[0.0 if o else x for x, o in zip(r, ro)] for r, ro in zip(rows, out)]
    col_stats = [math.nan if any(x != x for x in column) else _int8_max(column) for column in zip(*masked)]
    CAt = [[_int8_column_code(x, m, A.dtype) for x, m in zip(r, col_stats)] for r in masked]
    return (CA, torch.tensor(CAt, dtype=torch.int8).reshape(A.shape), row_stats,
            torch.tensor(col_stats, dtype=torch.float32), cols)  # fmt: skip
