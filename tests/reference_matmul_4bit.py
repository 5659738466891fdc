"""A float64 reference of docs/semantics.md section 4 (gemv_4bit / gemm_4bit), and the error measures the
matmul tests use.

Written from docs/semantics.md alone (sections 3 and 4), independent of any kernel:
- the weight is dequantized exactly as docs/semantics.md section 3 says, in float32:
  `w[n, k] = fl32(table[nibble(n*K + k)] * scale[(n*K + k) // blocksize])`, nibble 2j the high
  nibble of byte j, blocks flat (straddling rows); with double quantization
  `scale_b = fl32(fl32(absmax_code[absmax_8bit[b]] * nested_absmax[b // 256]) + offset)` where an
  fp16/bf16 offset is upcast exactly;
- the product is taken in float64: `y = A @ w.T + bias` (float64 products and sums of the exact
  float32 / fp16 / bf16 inputs and of those float32 weights), i.e. the value the float32-accumulated
  kernel approximates before its one rounding to the output dtype: every kernel forms each term as
  `a * w` of that rounded weight, as dequantize_4bit followed by linear does, so only the order and
  the float32 rounding of the sums differ from it.

Apple GPUs flush float32 subnormals (docs/semantics.md section 7). With `flush=True` (the default,
tests/spec_reference.py's `FLUSH`: what the kernels compute on a Mac and under the emulator's
default "apple" float mode) the block scales, the nested decode's product and sum, the dequantized
weights, the activations and the bias count as zero (of their sign) below 2^-126 (float16 values
never are), and `check_accuracy` allows, on top of section 4's rounding, for the float32 products
and partial sums below 2^-126 that the kernels' arithmetic flushes (`subnormal_slack`). `flush=False` is
plain IEEE float32 (the emulator's "ieee" mode, CUDA, and the CPU).
"""

from __future__ import annotations

import math

import numpy as np
import torch

import spec_reference as ref

F32 = np.float32


def table(quant_type_or_code) -> np.ndarray:
    """The 16 nibble values: docs/semantics.md's NF4 / FP4 table, or a given 16-entry code (gemv_4bit's input)."""
    if isinstance(quant_type_or_code, str):
        return ref.table_4bit(quant_type_or_code)
    c = quant_type_or_code.detach().reshape(-1).to(torch.float32).numpy()
    assert c.size == 16, c.size
    return c


def _z(flush: bool | None):
    """z(x): float32 values as Apple's float32 arithmetic takes or gives them (flush: below 2^-126 as
    zeros of their sign) or as IEEE does."""
    if ref._flush(flush):
        return ref.flush_subnormals
    return lambda x: np.asarray(x, dtype=F32)


def block_scales(absmax, absmax_8bit=None, absmax_code=None, absmax_offset=None, *,
                 flush: bool | None = None) -> np.ndarray:  # fmt: skip
    """Per-block float32 scales: plain absmax, or the nested decode of docs/semantics.md section 3 (with
    flush: operands and results below 2^-126 as signed zeros, docs/semantics.md section 7)."""
    z = _z(flush)
    if absmax_8bit is None:
        return z(absmax.detach().reshape(-1).to(torch.float32).numpy())
    q = absmax_8bit.detach().reshape(-1).numpy().astype(np.int64)
    code = z(absmax_code.detach().reshape(-1).to(torch.float32).numpy())
    nested = z(absmax.detach().reshape(-1).to(torch.float32).numpy())
    offset = z(F32(absmax_offset.detach().to(torch.float32).reshape(-1)[0].item()))
    with np.errstate(over="ignore", invalid="ignore"):
        prod = z(code[q] * np.repeat(nested, 256)[: q.size])  # float32 products: fl32(code * nested)
        return z(prod + offset).astype(F32)  # fl32(. + offset)


def weight_parts(B: torch.Tensor, shapeB, blocksize: int, quant_type_or_code, absmax, absmax_8bit=None,
                 absmax_code=None, absmax_offset=None, *, flush: bool | None = None):  # fmt: skip
    """(table values, block scales) of every weight element, two float32 [N, K] arrays: the factors of
    docs/semantics.md section 3's w = fl32(table[nibble] * scale) (the scales as block_scales gives them)."""
    N, K = shapeB
    n = N * K
    nib = ref.unpack_nibbles(B, n).astype(np.int64)
    scales = block_scales(absmax, absmax_8bit, absmax_code, absmax_offset, flush=flush)
    t = table(quant_type_or_code).astype(F32)[nib]
    return t.reshape(N, K), np.repeat(scales, blocksize)[:n].astype(F32).reshape(N, K)


def dequantized_weight(B: torch.Tensor, shapeB, blocksize: int, quant_type_or_code, absmax, absmax_8bit=None,
                       absmax_code=None, absmax_offset=None, *, flush: bool | None = None) -> np.ndarray:  # fmt: skip
    """dequant(W) as a float32 [N, K] array (docs/semantics.md section 3, any storage dtype of B read as bytes;
    with flush, a weight below 2^-126 is a signed zero, docs/semantics.md section 7)."""
    t, scales = weight_parts(B, shapeB, blocksize, quant_type_or_code, absmax, absmax_8bit, absmax_code,
                             absmax_offset, flush=flush)  # fmt: skip
    with np.errstate(over="ignore", invalid="ignore"):
        return _z(flush)(t * scales).astype(F32)  # float32 * float32 -> float32


def flushed(t: torch.Tensor | None, flush: bool | None = None) -> torch.Tensor | None:
    """A float tensor as Apple's float32 arithmetic takes it (flush: float32 / bfloat16 values below
    2^-126 as zeros of their sign; float16 values are never that small) or unchanged."""
    if t is None or not ref._flush(flush):
        return t
    t = t.detach()
    return torch.where(t.abs() < 2.0**-126, t * 0, t)


#: a product or partial sum whose operands are all of at least this magnitude (or zero) is never a
#: float32 subnormal: float32 values above 2^-102 are multiples of 2^-125, and so are their sums.
#: Terms below it are the ones a flushing float32 accumulation may drop (see subnormal_slack).
_AT_RISK = 2.0**-96
_TINY = 2.0**-126


def subnormal_slack(A: torch.Tensor, W: np.ndarray, flush: bool | None = None) -> np.ndarray:
    """How far the kernels may be from the float64 y = A @ W.T because of float32 values below 2^-126,
    per output element ([M, N], float64), beyond section 4's rounding. A and W as the reference
    takes them (flushed with `flush`; W is the dequantized weight, fl32(table * scale), that every
    kernel multiplies by).

    Every kernel forms each term as a * w of the activation and that weight (docs/semantics.md
    section 4), so only the products and the sums can be affected:
    - flush (docs/semantics.md section 7): a term a * w below 2^-96 is at risk: it may be kept or
      lost, and the partial sums it brings below 2^-126 may be flushed (each losing less than
      2^-126): |a * w| + 2^-124 per at-risk term, plus 2^-125 for the final sum and bias.
    - IEEE: a product a * w below 2^-126 is rounded to a multiple of 2^-149 (off by up to 2^-150).
    Where no term is at risk (ordinary data, and the tests' special values, whose flushed inputs are
    exact zeros) the slack is 2^-125 with flush and 0 without."""
    fl = ref._flush(flush)
    a = np.abs(A.detach().to(torch.float64).numpy())
    w = np.abs(W).astype(np.float64)
    M, N = a.shape[0], W.shape[0]
    slack = np.full((M, N), 2.0**-125 if fl else 0.0)
    a_nz, w_nz = a[a > 0], w[w > 0]
    if not (a_nz.size and w_nz.size):
        return slack
    low = _AT_RISK if fl else _TINY
    if a_nz.min() * w_nz.min() >= low:
        return slack  # no term at risk anywhere
    for m in range(M):
        term = a[m][None, :] * w
        risky = (term > 0) & (term < low)
        slack[m] += np.where(risky, term + 2.0**-124 if fl else 2.0**-150, 0.0).sum(axis=1)
    return slack


def matmul(A: torch.Tensor, W: np.ndarray, bias=None) -> np.ndarray:
    """float64 `A @ W.T (+ bias)` with A's leading shape kept."""
    A64 = A.detach().to(torch.float64).numpy()
    y = A64 @ W.astype(np.float64).T
    if bias is not None:
        y = y + bias.detach().to(torch.float64).numpy()
    return y


def magnitude(A: torch.Tensor, W: np.ndarray, bias=None) -> np.ndarray:
    """S = |A| @ |W|.T (+ |bias|): the size of the sum each output element is, the scale any
    floating-point summation error of that element is measured against."""
    S = np.abs(A.detach().to(torch.float64).numpy()) @ np.abs(W.astype(np.float64)).T
    if bias is not None:
        S = S + np.abs(bias.detach().to(torch.float64).numpy())
    return S


def ulp32(x: np.ndarray) -> np.ndarray:
    """The float32 unit in the last place of |x| (2^-149 below the smallest normal)."""
    return ulp(x, torch.float32)


def as_f64(t: torch.Tensor) -> np.ndarray:
    return t.detach().to(torch.float64).numpy()


def dequantize_then_linear(A: torch.Tensor, W: np.ndarray, bias=None, device="cpu") -> torch.Tensor:
    """The path bitsandbytes takes without a fused kernel: the weight dequantized to A's dtype, then
    torch's linear in that dtype (on `device`; the result comes back to the CPU)."""
    Wt = torch.from_numpy(W).to(A.dtype).to(device)
    b = bias.to(device) if bias is not None else None
    return torch.nn.functional.linear(A.to(device), Wt, b).cpu()


def max_abs(x) -> float:
    x = np.asarray(x)
    return float(np.max(np.abs(x))) if x.size else 0.0


def blocks(n: int, size: int) -> int:
    return math.ceil(n / size)


# (mantissa bits, smallest normal exponent) of the output dtypes
_FORMATS = {torch.float16: (10, -14), torch.bfloat16: (7, -126), torch.float32: (23, -126)}


def ulp(x, dtype: torch.dtype) -> np.ndarray:
    """The unit in the last place of |x| in `dtype` (subnormal spacing below the smallest normal)."""
    mant, emin = _FORMATS[dtype]
    x = np.abs(np.asarray(x, dtype=np.float64))
    e = np.floor(np.log2(np.maximum(x, 2.0**emin)))
    return np.exp2(e - mant)


#: The unit of docs/semantics.md section 4's float32 accuracy: 2^-24 * S, S = sum |a*w| (+ |bias|).
UNIT = 2.0**-24


def fp32_units(K: int) -> float:
    """docs/semantics.md section 4's float32 accuracy target: |y - y64| per output element, in units of
    2^-24 * S against the exact (float64) product of the same weights, on any data: 5 units up to
    K = 4096 terms, growing like sqrt(K) beyond (the typical growth of the kernels' rounding error when
    every term has the same sign; section 4's bound for every input, gamma_D, is larger)."""
    return 5.0 * max(1.0, math.sqrt(K / 4096))


#: docs/semantics.md section 4, on data whose terms have random signs (as real activations and weights
#: do): the kernels stay below 1 unit; this is the bound the tests hold them to there.
SIGNED_UNITS = 1.5


#: outputs with at least this many elements are also compared in aggregate with the
#: dequantize-then-linear path (max and mean error); a handful of elements says nothing statistically.
AGGREGATE_MIN = 256


def in_dtype(W: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """The float32 dequantized weight W as `dequantize_4bit` gives it in `dtype` (rounded to nearest
    even, beyond float16's range infinite), as float64 values: what the kernels multiply activations
    of that dtype by (docs/semantics.md section 4)."""
    if dtype == torch.float32:
        return W.astype(np.float64)
    return torch.from_numpy(np.asarray(W, dtype=F32)).to(dtype).to(torch.float64).numpy()


def check_accuracy(y: torch.Tensor, A: torch.Tensor, W: np.ndarray, bias=None, linear_device="cpu", *,
                   flush: bool | None = None) -> dict:  # fmt: skip
    """Asserts docs/semantics.md section 4's accuracy target for y ~ A @ W.T (+ bias) and returns the figures.
    W is the float32 dequantized weight; the product is taken with it in A's dtype (`in_dtype`), as
    the kernels take it, and y64 below is that product in float64.

    - float32: |y - y64| <= fp32_units(K) * 2^-24 * S per element.
    - float16 / bfloat16, per element: |y - y64| <= 0.5 ulp_T(y64) + fp32_units(K) * 2^-24 * S
      (rounded once to T, up to float32 accumulation error); and, for outputs of at least
      AGGREGATE_MIN elements, max and mean |y - y64| no larger than those of the
      dequantize-then-linear path in T (slack: one float32 ulp of max S on the max, 1% on the mean).
    `linear_device` is where torch's fp16/bf16 linear of the comparison runs. y, A, bias: CPU tensors.

    With `flush` (default `spec_reference.FLUSH`), W must be the flushed weight (dequantized_weight's
    default), and A and bias count as flushed. Every bound grows by `subnormal_slack`, which is
    nothing or next to nothing unless products fall near or below 2^-126. The comparison
    in aggregate leaves out the elements where the dequantize-then-linear path is not finite (a
    weight beyond the range of A's dtype).
    """
    K = A.shape[-1]
    fl = ref._flush(flush)
    A, bias = flushed(A, fl), flushed(bias, fl)
    W = in_dtype(W, y.dtype)  # the weight the kernels multiply by (exact as float64)
    slack = subnormal_slack(A.reshape(-1, K), W, fl)
    want = matmul(A, W, bias)
    S = magnitude(A, W, bias)
    got = as_f64(y)
    assert got.shape == want.shape, (got.shape, want.shape)
    # Where the reference is not finite (a weight beyond float16's range, an overflowing sum), y must be too.
    inf = ~np.isfinite(want)
    assert ((got[inf] == want[inf]) | (np.isnan(got[inf]) & np.isnan(want[inf]))).all(), "non-finite outputs differ"
    if inf.any():
        got, want, S, slack = (np.where(inf, 0.0, x) for x in (got, want, S, slack))
    if got.size == 0:
        return {}
    tol = fp32_units(K) * UNIT * S
    e = np.abs(got - want)
    if y.dtype == torch.float32:
        bad = e > tol + slack
        units = np.maximum(e - slack, 0) / np.maximum(UNIT * S, 2.0**-149)
        assert not bad.any(), f"float32 error {units.max():.2f} units of 2^-24 * S > {fp32_units(K):.2f}"
        return {"units_vs_f64": float(units.max())}
    lin = as_f64(dequantize_then_linear(A, W, bias, linear_device))
    bound = 0.5 * ulp(np.maximum(np.abs(want), np.abs(got)), y.dtype) + tol + slack
    bad = e > bound
    assert not bad.any(), f"{int(bad.sum())} elements off by more than half an ulp (max excess {(e - bound).max():.3g})"
    e_lin = np.abs(lin - want)
    figures = {"max_err": float(e.max()), "max_err_dequant_linear": float(e_lin.max()),
               "mean_err": float(e.mean()), "mean_err_dequant_linear": float(e_lin.mean())}  # fmt: skip
    finite = np.isfinite(e_lin)
    if finite.sum() >= AGGREGATE_MIN:
        e, e_lin, S, slack = e[finite], e_lin[finite], S[finite], slack[finite]
        assert e.max() <= e_lin.max() + ulp32(S).max() + slack.max(), figures
        assert e.mean() <= 1.01 * e_lin.mean() + slack.mean(), figures
    return figures
