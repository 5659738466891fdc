"""The quantization families' ordinary cases: blockwise 8-bit and NF4/FP4, quantize and dequantize,
on inputs where bitsandbytes' CPU code computes docs/semantics.md exactly."""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch

from . import sentinel
from .cases import DTYPES, Case, gen, signed_code
from .compare import arg_as_expected, same, same_arg
from .spec import FP4_MAGNITUDES, NF4, dequantize_4bit_expected


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
    g = gen(seed)
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


def blockwise_8bit_cases() -> Iterator[Case]:
    code = signed_code()
    points = (code[:-1] + code[1:]) / 2  # the decision points (fl32 sum, exact halving)
    # (dtype, blocksize, n, whether to dequantize too): every dtype, blocksizes up to 256 (one
    # simdgroup a block) and above (simdgroups that meet in threadgroup memory), partial last blocks.
    shapes = [(torch.float16, 64, 2 * 64 + 37, True), (torch.bfloat16, 256, 3 * 256 + 5, True),
              (torch.float32, 4096, 4096 + 129, True), (torch.float32, 128, 1, True),
              (torch.float16, 512, 3 * 512 + 99, False), (torch.bfloat16, 1024, 2 * 1024 + 300, False),
              (torch.float32, 2048, 2048 + 1500, False)]  # fmt: skip
    for i, (dtype, blocksize, n, dequantize) in enumerate(shapes):
        g = gen(100 + i)
        # Code values and random values, clear of the decision points and of the smallest codes,
        # where the CPU's lookup table departs from the nearest code.
        pool = torch.cat([code[torch.randint(0, 256, (2 * n + 64,), generator=g)].double(),
                          torch.rand(2 * n + 64, generator=g, dtype=torch.float64) * 2 - 1])  # fmt: skip
        pool = pool[torch.randperm(pool.numel(), generator=g)]
        # (No NaN: where bitsandbytes has no CPU library, its pure-PyTorch quantizer lets NaN into
        # the block max; the mps suite checks NaN against docs/semantics.md instead.)
        A = _scaled_blocks(_clear_of(pool, points, dtype, 1e-4, n), blocksize, dtype, seed=200 + i)
        tag = f"{dtype} blocksize={blocksize} n={n}"
        yield Case(f"quantize_blockwise {tag}", "quantize_blockwise", (A, code, blocksize), same)
        if not dequantize:
            continue
        q, absmax = torch.ops.bitsandbytes.quantize_blockwise.default(A.float(), code, blocksize)
        for out_dtype in DTYPES:
            yield Case(f"dequantize_blockwise {tag} -> {out_dtype}", "dequantize_blockwise",
                       (q, absmax, code, blocksize, out_dtype), same)  # fmt: skip
        out = sentinel.filled((n,), dtype)
        yield Case(f"dequantize_blockwise.out {tag}", "dequantize_blockwise.out", (q, absmax, code, blocksize, dtype, out),
                   same_arg(5))  # fmt: skip


def _fourbit_values(quant_type: str, n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Scaled values for the 4-bit quantizers: every table value and random values, all clear of
    every decision point (bitsandbytes' CPU path, its pure-PyTorch kernel, compares with its own
    midpoints), and for float32 NF4's exact ties as well (to the lower nibble in both)."""
    g = gen(seed)
    if quant_type == "nf4":
        table = torch.tensor(NF4, dtype=torch.float32)
        points = (table[:-1] + table[1:]) / 2  # float32 midpoints: the decision points
    else:
        mags = torch.tensor(FP4_MAGNITUDES, dtype=torch.float32)
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


def fourbit_cases() -> Iterator[Case]:
    # (dtype, blocksize, quant type, shape, whether to dequantize too); blocksizes above 256 as in
    # blockwise_8bit_cases.
    shapes = [(torch.float16, 64, "nf4", (6, 128), True), (torch.bfloat16, 32, "fp4", (4, 96), True),
              (torch.float32, 256, "nf4", (2, 512), True), (torch.float32, 64, "fp4", (3, 64), True),
              (torch.float16, 128, "fp4", (1, 515), True), (torch.bfloat16, 512, "nf4", (3, 400), False),
              (torch.float32, 2048, "fp4", (2, 1500), False)]  # fmt: skip
    for i, (dtype, blocksize, qt, shape, dequantize) in enumerate(shapes):
        n = math.prod(shape)
        A = _scaled_blocks(_fourbit_values(qt, n, dtype, seed=300 + i), blocksize, dtype, seed=400 + i).reshape(shape)
        tag = f"{qt} {dtype} blocksize={blocksize} {list(shape)}"
        yield Case(f"quantize_4bit {tag}", "quantize_4bit", (A, blocksize, qt, torch.uint8), same)
        if not dequantize:
            continue
        packed, absmax = torch.ops.bitsandbytes.quantize_4bit.default(A.float(), blocksize, qt, torch.uint8)
        # An odd element count takes bitsandbytes' CPU dequantizer to its torch.compile'd path (seconds
        # to compile, once a process): the result docs/semantics.md defines is computed here instead.
        expected = None if n % 2 == 0 else dequantize_4bit_expected(packed, absmax, blocksize, qt, shape)
        for out_dtype in DTYPES:
            yield Case(f"dequantize_4bit {tag} -> {out_dtype}", "dequantize_4bit",
                       (packed, absmax, blocksize, qt, list(shape), out_dtype), same,
                       expected=expected and (lambda args: expected(args[5])))  # fmt: skip
        out = sentinel.filled(shape, dtype)
        yield Case(f"dequantize_4bit.out {tag}", "dequantize_4bit.out",
                   (packed, absmax, blocksize, qt, list(shape), dtype, out),
                   same_arg(6) if expected is None else arg_as_expected(6),
                   expected=expected and (lambda args: expected(args[5])))  # fmt: skip
