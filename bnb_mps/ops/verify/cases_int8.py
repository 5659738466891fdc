"""The int8 families' cases (LLM.int8()): quantization and dequantization, and the products."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from . import sentinel
from .cases import DTYPES, Case, gen
from .compare import eps, same, same_arg, close, exact
from .spec import F32_MIN_NORMAL, spec_int8_double_quant, spec_int8_vectorwise_quant


def _int8_activations(M: int, K: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """N(0, 1.5^2) values with outlier columns (|x| >= 6), a row of exact rounding ties (row max
    127, so that x * 127 / max = x: halves round to even) and a zero row."""
    g = gen(seed)
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
        return close(got, want, (4e-5 + 8 * 2.0**-24 + eps(want.dtype)) * mag + 1e-30)

    return compare


def int8_quant_cases() -> Iterator[Case]:
    for i, dtype in enumerate(DTYPES):
        A = _int8_activations(8, 72 + 8 * i, dtype, seed=500 + i)
        for threshold in (0.0, 6.0):
            tag = f"{tuple(A.shape)} {dtype} threshold={threshold}"
            yield Case(f"int8_vectorwise_quant {tag}", "int8_vectorwise_quant", (A, threshold), same)
            yield Case(f"int8_double_quant {tag}", "int8_double_quant", (A, threshold), same)
    CA, stats, _ = torch.ops.bitsandbytes.int8_vectorwise_quant.default(_int8_activations(6, 40, torch.float16, 510),
                                                                         0.0)  # fmt: skip
    yield Case("int8_vectorwise_dequant (6, 40)", "int8_vectorwise_dequant", (CA, stats), _int8_dequant_compare())
    g = gen(520)
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
        yield Case(f"{op} {tuple(A.shape)} {dtype} threshold={threshold} subnormals", op, (A, threshold), same,
                   expected=lambda args, op=op: cpu_round_trip_call(op, [_flushed(args[0]), args[1]]))  # fmt: skip
    # NaN and infinities (docs/semantics.md section 6): NaN left out of the row and column maxima (a
    # row of NaN, a column of NaN, NaN next to a row's maximum) and quantized to 0; an infinity is its
    # row's and column's maximum (their codes 0), or an outlier at a threshold. bitsandbytes' CPU code
    # lets NaN into its maxima: these cases carry the page's result (`spec`).
    for i, (dtype, op, threshold) in enumerate(((torch.float16, "int8_vectorwise_quant", 0.0),
                                                (torch.float32, "int8_vectorwise_quant", 6.0),
                                                (torch.bfloat16, "int8_double_quant", 0.0),
                                                (torch.float16, "int8_double_quant", 6.0))):  # fmt: skip
        A = _int8_nan_inf(_int8_activations(8, 48, torch.float32, seed=540 + i)).to(dtype)
        expected = spec_int8_vectorwise_quant if op == "int8_vectorwise_quant" else spec_int8_double_quant
        yield Case(f"{op} special values {tuple(A.shape)} {dtype} threshold={threshold} (nan, inf)", op, (A, threshold), same,
                   expected=lambda args, f=expected: f(args[0], args[1]))  # fmt: skip


def _int8_nan_inf(x: torch.Tensor) -> torch.Tensor:
    """x (8 rows) with NaN and infinities where section 6 says what becomes of them."""
    x = x.clone()
    nan, inf = float("nan"), float("inf")
    top = int(x[0].abs().argmax())
    x[0, (top + 1) % x.shape[1]] = nan  # next to the row's maximum
    x[0, 17] = nan
    x[1, 9] = inf  # threshold 0: the row's maximum (its codes 0); threshold 6: an outlier column
    x[4, 3], x[4, 20] = -inf, nan
    x[5] = nan  # a row of NaN: maximum 0, codes 0
    x[:, 11] = nan  # a column of NaN
    return x


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
    tiny = (t.float().abs() < F32_MIN_NORMAL) & (t != 0)
    return torch.where(tiny, t * 0, t)


def cpu_round_trip_call(op: str, args: list):
    from ..cpu_round_trip import cpu_call

    return cpu_call(op, args)


def int8_product_cases() -> Iterator[Case]:
    # The exact int32 product on every kernel path (bnb_mps.ops.int8.matmul_path: gemv1, gemv4,
    # tile32, tile64, each with 16-byte loads when K % 16 == 0 and without otherwise). The rows of
    # +-127 reach a float32 sum beyond 2^24 (no longer exact) where K > 1040: 127 * 127 * 1088 =
    # 17,548,352; the kernels keep their float partial sums below that (the gemv paths with and
    # without 16-byte loads, and the tiled paths, which share that code, at M = 12).
    g = gen(600)
    for M, K, ops_ in ((1, 1088, "fo"), (5, 1088, "fo"), (33, 96, "f"), (12, 1088, "o"), (1, 1090, "f"),
                       (5, 100, "o"), (12, 100, "f"), (33, 40, "f")):  # fmt: skip
        A, B = _int8_codes(M, K, g)
        if "f" in ops_:
            yield Case(f"int8_linear_matmul {M}x24x{K}", "int8_linear_matmul", (A, B), same)
        if "o" in ops_:
            yield Case(f"int8_linear_matmul.out {M}x24x{K}", "int8_linear_matmul.out",
                       (A, B, sentinel.filled((M, 24), torch.int32)), same_arg(2))  # fmt: skip
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
        return close(got[0], want[0], 8 * eps(X.dtype) * mag + 1e-30, "out")

    return compare
