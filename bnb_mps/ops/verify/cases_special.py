"""The quantization families' special values (NaN, infinities, all-zero blocks, subnormals, block maxima
above 2^126), each case with the result docs/semantics.md defines (`spec`)."""

from __future__ import annotations

import math
from collections.abc import Iterator
from fractions import Fraction

import torch

from .cases import Case, gen, signed_code
from .compare import same
from .spec import (F32_MAX, FP4_TREE, NF4, dequantize_4bit_expected, f32, near, recip_rounds_up, round32,
                   spec_dequantize, spec_quantize_4bit, spec_quantize_blockwise, thresholds)


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
        m = F32_MAX
    else:
        e = 127 if kind == "up" else 126  # (both exponents above 2^126)
        m = next(v for v in (torch.rand(64, generator=g, dtype=torch.float64) + 1).float().double().tolist()
                 if recip_rounds_up(v * 2.0**e) == (kind == "up")) * 2.0**e  # fmt: skip
    r = f32(1 / Fraction(m))
    xs = [round32(v * m * 0.98) for v in rand]
    k = 0
    for t in points:
        if k + 2 > n - 1:
            break
        if abs(t) < 0.98:
            xs[k], xs[k + 1] = near(t, r, True), near(t, r, False)
            k += 2
    xs[n - 1] = -m if kind == "down" else m
    return xs


def _special_tensor(kinds: list[str], blocksize: int, dtype: torch.dtype, points: list[float], seed: int,
                    negative_subnormals: bool = True, tail: int = 0) -> torch.Tensor:  # fmt: skip
    """Blocks of the given kinds, then `tail` elements of a partial last block (NaN, values, -inf)."""
    g = gen(seed)
    xs: list[float] = []
    for kind in kinds:
        xs += _special_block_values(kind, blocksize, points, g, negative_subnormals, dtype)
    if tail:
        xs += [math.nan] + [(-1.0) ** i * (i + 1) / 8 for i in range(tail - 2)] + [-math.inf]
    return torch.tensor(xs, dtype=torch.float64).to(dtype)


def special_8bit_cases() -> Iterator[Case]:
    code = signed_code()
    points = thresholds(code)[8::16]  # every 16th decision point
    specs = [(torch.float32, 64, ["zeros", "subnormals", "nan", "inf", "up", "down", "max"], 37),
             (torch.bfloat16, 128, ["subnormals", "nan", "inf", "up"], 0)]  # fmt: skip
    for i, (dtype, blocksize, kinds, tail) in enumerate(specs):
        A = _special_tensor(kinds, blocksize, dtype, points, seed=1000 + i, tail=tail)
        tag = f"{dtype} blocksize={blocksize} n={A.numel()} ({', '.join(kinds)})"
        yield Case(f"quantize_blockwise special values {tag}", "quantize_blockwise", (A, code, blocksize), same,
                   expected=lambda args: spec_quantize_blockwise(args[0], args[1], args[2]))  # fmt: skip
        q, absmax = spec_quantize_blockwise(A, code, blocksize)
        table = code.double().tolist()
        values = [table[c] for c in q.reshape(-1).tolist()]
        # (float32 out: the block maxima near the float32 maximum would overflow a narrower dtype,
        # where a GPU's conversion may saturate instead of giving inf; narrower outputs are verified
        # with ordinary values above.)
        yield Case(f"dequantize_blockwise special values {tag} -> float32", "dequantize_blockwise",
                   (q, absmax, code, blocksize, torch.float32), same,
                   expected=lambda args, v=values, a=absmax, bs=blocksize, sh=A.shape:
                   spec_dequantize(v, a, bs, torch.float32, sh))  # fmt: skip


def special_4bit_cases() -> Iterator[Case]:
    nf4_points = thresholds(torch.tensor(NF4))
    fp4_points = sorted(FP4_TREE + [-c for c in FP4_TREE])
    specs = [("nf4", torch.float32, 64, ["zeros", "subnormals", "nan", "inf", "up", "down", "max"], nf4_points, 21),
             ("fp4", torch.float32, 32, ["subnormals", "nan", "inf", "up", "down", "max"], fp4_points, 9),
             ("nf4", torch.bfloat16, 64, ["subnormals", "nan", "inf", "up"], nf4_points, 0)]  # fmt: skip
    for i, (qt, dtype, blocksize, kinds, points, tail) in enumerate(specs):
        A = _special_tensor(kinds, blocksize, dtype, points, seed=1100 + i, negative_subnormals=qt == "nf4", tail=tail)
        tag = f"{qt} {dtype} blocksize={blocksize} n={A.numel()} ({', '.join(kinds)})"
        yield Case(f"quantize_4bit special values {tag}", "quantize_4bit", (A, blocksize, qt, torch.uint8), same,
                   expected=lambda args: spec_quantize_4bit(args[0], args[1], args[2]))  # fmt: skip
        if dtype != torch.float32:
            continue
        packed, absmax = spec_quantize_4bit(A, blocksize, qt)
        expected = dequantize_4bit_expected(packed, absmax, blocksize, qt, [A.numel()])
        yield Case(f"dequantize_4bit special values {tag} -> float32", "dequantize_4bit",
                   (packed, absmax, blocksize, qt, [A.numel()], torch.float32), same,
                   expected=lambda args, e=expected: e(args[5]))  # fmt: skip
