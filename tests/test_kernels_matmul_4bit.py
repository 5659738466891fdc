"""The 4-bit GEMV / GEMM kernels under the emulator, against the float64 reference of docs/semantics.md section 4
(tests/reference_matmul_4bit.py).

Calls go through the op layer (bnb_mps.ops.matmul_4bit) to an executor that forwards to the
emulator, so each case checks the launcher's choice of kernel and geometry together with the
kernel. Weights are quantized by the docs/semantics.md reference quantizer (tests/spec_reference.py), not by
the kernels.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
import torch

import reference_matmul_4bit as R
import spec_reference as ref
from matmul_4bit_cases import DT, Case, gemm_args, gen, make_weight
from kernel_harness import EmulatedExecutor
from bnb_mps.ops import OPS, call, matmul_4bit
from bnb_mps.testing import RecordingExecutor

emulator = pytest.importorskip("bnb_mps.emulator")
bnb_functional = pytest.importorskip("bitsandbytes.functional")

DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def run_gemm(executor, case: Case, route=None) -> dict:
    """The product through the op layer (its built-in kernel path, or the kernel path `route`)."""
    A, args, W, bias = gemm_args(case)
    y = call(OPS["gemm_4bit"], tuple(args), {}, executor) if route is None else matmul_4bit.gemm_4bit(
        executor, *args, route=route)
    assert y.shape == (*A.shape[:-1], case.N) and y.dtype == case.dtype and y.is_contiguous()
    return R.check_accuracy(y.reshape(-1, case.N), A.reshape(-1, case.K), W, bias)


def path_of(case: Case) -> str:
    return matmul_4bit.choose_path(case.M, case.N, case.K)


# -- every kernel variant under every lane order, race checking, poisoned threadgroup memory --------

# One shape per path, with a K tail (K not a multiple of the simdgroup step, of 32, or of 16) and
# an N tail (N not a multiple of the rows per threadgroup); the kernel it launches. The batch kernel and
# the small kernel's wide variant are routes (tuning's candidates), not the built-in path of their shape.
# The split-K paths: "splitk" (one dispatch) runs on the split-K unit compiled at Metal 3.2 (`library32`),
# the built-in path there; "splitk/two" (the partial sums, then the sum kernel) on the session's library,
# at 3.1, the built-in path there.
PATH_SHAPES = {
    "gemv": ((1, 21, 1056), "bnb_gemv_4bit"),  # 1056 = 1024 + 32: the second step has a single active lane
    "batch": ((5, 13, 176), "bnb_gemm_4bit_batch"),
    "small": ((20, 21, 400), "bnb_gemm_4bit_small"),  # 400 = 3 * 128 + 16: a last step of 2 active lanes
    "small/wide": ((3, 13, 176), "bnb_gemm_4bit_small_wide"),
    # 1040 = 4 * 256 + 16: S = 4 slices of 512, 512, 16 and none (an empty slice adds zeros); 70 columns:
    # two tiles of 64, the second of 6 columns, one threadgroup over all of K
    "splitk": ((13, 70, 1040), "bnb_gemm_4bit_splitk"),
    "splitk/two": ((13, 70, 1040), "bnb_gemm_4bit_splitk_partial"),
    # S = 8 in float32 (eight groups of 16 columns per tile), 4 otherwise; a last tile of 8 columns
    "splitk/two-S8": ((16, 136, 4096), "bnb_gemm_4bit_splitk_partial"),
    # 1984 = 7 * 256 + 192: rows 4 phases apart in their lines, each cut where its own lines begin, a
    # group per phase (S = 4), the last slice longer than the others; 50 columns: padding rows of each phase
    "splitk/two-phases": ((12, 50, 1984), "bnb_gemm_4bit_splitk_partial"),
    "mma": ((37, 70, 72), "bnb_gemm_4bit_mma"),  # two M tiles, two N tiles, 3 K steps (the last a half)
    "mma-any-K": ((3, 11, 45), "bnb_gemm_4bit_mma"),
}


def version_of(path: str) -> tuple:
    """The Metal language version a path's kernels run at here: 3.2 for the one-dispatch split-K kernel
    (it exists from 3.2 only), the emulator's default 3.1 for every other."""
    return (3, 2) if path.split("-")[0] == "splitk" else (3, 1)


def executor_of(path: str, library, library32, **kw) -> EmulatedExecutor:
    """An executor of the kernels of `path` (the session's library; the split-K unit at 3.2 for "splitk")."""
    version = version_of(path)
    return EmulatedExecutor(library32 if version >= (3, 2) else library, language_version=version, **kw)


def launches_of(kernel: str, sc: str, dt: str) -> list[str]:
    """The kernels one call launches where the first is `kernel`: the two-dispatch split-K adds its sum kernel."""
    return [f"{kernel}_{sc}_{dt}"] + ([f"bnb_gemm_4bit_splitk_sum_{dt}"] if kernel.endswith("_partial") else [])


def route_of(path: str, M: int, N: int, K: int):
    """The route that runs `path` on the shape: None where it is the built-in path (at its version)."""
    version = version_of(path)
    path = path.split("-")[0]
    return None if path == matmul_4bit.choose_path(M, N, K, language_version=version) else path


@pytest.mark.parametrize("nested", [False, True], ids=["absmax", "nested"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("path", list(PATH_SHAPES))
def test_all_orders(library, library32, path, dtype, nested):
    (M, N, K), kernel = PATH_SHAPES[path]
    case = Case(M, N, K, dtype=dtype, nested=nested, bias=nested, blocksize=32 if nested else 128,
                quant_type="fp4" if dtype == torch.bfloat16 else "nf4", seed=M + N + K)  # fmt: skip
    ex = executor_of(path, library, library32, checked=True)
    run_gemm(ex, case, route_of(path, M, N, K))
    assert ex.launched == launches_of(kernel, "nested" if nested else "absmax", DT[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_threadgroup_table_variant_all_orders(library, dtype):
    for nested in (False, True):
        ex = EmulatedExecutor(library, checked=True)
        run_gemm(ex, Case(1, 19, 96, dtype=dtype, nested=nested, bias=True, quant_type="fp4", seed=4), "gemv/tglut")
        assert ex.launched == [f"bnb_gemv_4bit_tglut_{'nested' if nested else 'absmax'}_{DT[dtype]}"]


# -- every blocksize and quant type on every path (blocks straddling rows) ------------------------

# K = 96 is below every blocksize from 128 (blocks span several rows and start mid-row) and not a
# multiple of 64 (blocks of 64 straddle rows); N*K >= 3 blocks of 4096 for the largest blocksize.
@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("blocksize", ref.BLOCKSIZES_4BIT)
def test_every_blocksize(library, blocksize, quant_type):
    ex = EmulatedExecutor(library)
    N = max(8, math.ceil(3 * blocksize / 96) + 3)
    for i, M in enumerate((1, 6, 40)):
        dtype = DTYPES[(i + blocksize.bit_length()) % 3]
        run_gemm(ex, Case(M, N, 96, dtype=dtype, blocksize=blocksize, quant_type=quant_type, nested=i == 1,
                          seed=blocksize + i))  # fmt: skip
    assert {k.split("_")[2] for k in ex.launched} == {"4bit"} and len(ex.launched) == 3
    assert [path_of(Case(M, N, 96)) for M in (1, 6, 40)] == ["gemv", "small", "mma"]


# -- odd shapes -------------------------------------------------------------------------------------

ODD = [
    Case(1, 1, 1), Case(3, 1, 1), Case(1, 5, 1), Case(100, 3, 1),  # K = 1
    Case(1, 7, 16), Case(9, 1, 16), Case(3, 9, 80),  # K a multiple of 16, not of 32 (M = 1: batch)
    Case(1, 2, 32), Case(1, 3, 1088),  # gemv with one lane active, 2 + 2 lanes in the last step
    Case(1, 9, 33), Case(33, 10, 100), Case(9, 66, 31),  # K not a multiple of 16: the mma kernel
    Case(1, 1, 64), Case(2, 1, 64), Case(33, 1, 64),  # N = 1
    Case(100, 65, 64, bias=True), Case(9, 8, 512), Case(33, 17, 16),
    Case(8, 9, 32, bias=True), Case(1, 2, 1040),
]  # fmt: skip


@pytest.mark.parametrize("case", ODD, ids=str)
def test_odd_shapes(library, case):
    ex = EmulatedExecutor(library, order="random", seed=case.M)
    for dtype in DTYPES:
        run_gemm(ex, replace(case, dtype=dtype, seed=case.N))


# -- layouts of A and B, nested absmax offsets ------------------------------------------------------


@pytest.mark.parametrize("layout", ["batched", "strided", "transposed", "misaligned", "broadcast"])
@pytest.mark.parametrize("M", [1, 6, 12])
def test_layouts_of_A(library, layout, M):
    ex = EmulatedExecutor(library)
    for dtype in DTYPES:
        run_gemm(ex, Case(M, 24, 64, dtype=dtype, layout=layout, bias=M == 6, seed=M))
    assert len(ex.launched) == 3  # no extra launch for any layout


def test_strided_A_is_bound_without_a_copy():
    case = Case(6, 24, 64, layout="strided")
    A, args, _, _ = gemm_args(case)
    rec = RecordingExecutor()
    call(OPS["gemm_4bit"], tuple(args), {}, rec)
    ((_, _, _, bound),) = rec.launches
    assert bound[0].byte_offset == A.storage_offset() * A.element_size()  # the caller's storage
    assert bound[12].value == A.stride(0) and bound[16].value & 2  # lda, and vector loads allowed


@pytest.mark.parametrize("storage", [torch.uint8, torch.float16, torch.bfloat16, torch.float32])
def test_quant_storage_is_read_as_bytes(library, storage):
    ex = EmulatedExecutor(library)
    for M in (1, 4, 20):
        run_gemm(ex, Case(M, 40, 96, storage=storage, dtype=torch.float32, nested=M == 4, seed=M))


@pytest.mark.parametrize("offset_dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_nested_offset_dtypes(library, offset_dtype):
    ex = EmulatedExecutor(library, order="reverse")
    for M, dtype in ((1, torch.float16), (7, torch.bfloat16), (40, torch.float32)):
        run_gemm(ex, Case(M, 48, 256, dtype=dtype, nested=True, offset_dtype=offset_dtype, blocksize=32, seed=M))


def test_nested_with_many_blocks(library):
    """More than 256 blocks: several nested scales (b // 256), on all three paths."""
    ex = EmulatedExecutor(library)
    for M in (1, 3, 17):
        run_gemm(ex, Case(M, 40, 480, dtype=torch.float32, nested=True, blocksize=32, bias=True, seed=M))


def test_weight_views_and_mid_storage_packed_bytes(library):
    """B as a [bytes, 1] view, a flat view, and a view that starts mid-storage (not 16-byte aligned)."""
    case = Case(5, 24, 64, dtype=torch.float32)
    A, args, W, _ = gemm_args(case)
    packed = args[1]
    shifted = torch.cat([torch.zeros(3, 1, dtype=torch.uint8), packed])[3:]
    for B in (packed, packed.reshape(-1), packed.view(-1, 2), shifted):
        args[1] = B
        y = call(OPS["gemm_4bit"], tuple(args), {}, EmulatedExecutor(library))
        R.check_accuracy(y, A, W)


# -- identity weights ---------------------------------------------------------------------------------


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("M", [1, 5, 40])
def test_identity_weight_reproduces_A(library, M, quant_type):
    """W = I: every block without a diagonal element is all zero (absmax 0) and must dequantize to
    exactly 0, so y == A bit for bit, on every path and for K % 16 != 0."""
    ex = EmulatedExecutor(library)
    for K in (64, 33):
        W = torch.eye(K)
        for dtype in DTYPES:
            nib, absmax = ref.quantize_4bit_nibbles(W, 32, quant_type)
            packed = torch.from_numpy(ref.pack_nibbles(nib)).reshape(-1, 1)
            A = torch.randn(M, K, generator=gen(M + K)).to(dtype)
            y = call(OPS["gemm_4bit"], (A, packed, [K, K], torch.from_numpy(absmax), 32, quant_type), {}, ex)
            assert torch.equal(y, A), (K, dtype)
    assert len(ex.launched) == 6


# -- gemv_4bit: the table is an input --------------------------------------------------------------


@pytest.mark.parametrize("M", [1, 4, 40])
def test_gemv_reads_the_code_table(library, M):
    """gemv_4bit's code is data: bitsandbytes' NF4 / FP4 codes and an arbitrary table give the
    docs/semantics.md result with that table (no quant type is inferred from it)."""
    ex = EmulatedExecutor(library, order="random", seed=M)
    N, K, bs = 24, 96, 64
    nib, absmax = ref.quantize_4bit_nibbles(torch.randn(N, K, generator=gen(5)), bs, "nf4")
    packed = torch.from_numpy(ref.pack_nibbles(nib)).reshape(-1, 1)
    absmax = torch.from_numpy(absmax)
    odd_table = torch.linspace(-3, 5, 16) ** 3  # neither NF4 nor FP4, code[1] < 0
    codes = [bnb_functional.get_4bit_type(qt, device="cpu") for qt in ("nf4", "fp4")] + [odd_table]
    for code in codes:
        for dtype in DTYPES:
            A = torch.randn(1, M, K, generator=gen(M)).to(dtype)
            y = call(OPS["gemv_4bit"], (A, packed, [N, K], absmax, code, bs), {}, ex)
            assert y.shape == (1, M, N)
            R.check_accuracy(y.reshape(M, N), A.reshape(M, K), R.dequantized_weight(packed, (N, K), bs, code, absmax))
    path = {1: "gemv_4bit", 4: "gemm_4bit_small", 40: "gemm_4bit_mma"}[M]
    assert ex.launched == [f"bnb_{path}_absmax_{DT[dtype]}" for _ in range(3) for dtype in DTYPES]


def test_gemv_out_overload(library):
    ex = EmulatedExecutor(library)
    N, K, bs = 40, 64, 32
    nib, absmax = ref.quantize_4bit_nibbles(torch.randn(N, K, generator=gen(8)), bs, "fp4")
    packed, absmax = torch.from_numpy(ref.pack_nibbles(nib)).reshape(-1, 1), torch.from_numpy(absmax)
    code = bnb_functional.get_4bit_type("fp4", device="cpu")
    W = R.dequantized_weight(packed, (N, K), bs, "fp4", absmax)
    A = torch.randn(2, K, generator=gen(9), dtype=torch.float32)
    out = torch.full((2, N), 7.0)
    assert call(OPS["gemv_4bit.out"], (A, packed, [N, K], absmax, code, bs, out), {}, ex) is None
    R.check_accuracy(out, A, W)
    strided = torch.full((N, 2), 7.0).t()  # a non-contiguous out
    call(OPS["gemv_4bit.out"], (A, packed, [N, K], absmax, code, bs, strided), {}, ex)
    assert torch.equal(strided, out)
    base = torch.full((2 * N + 1,), 7.0)
    shifted = base[1:].view(2, N)  # contiguous, not 16-byte aligned: written in place
    rec = RecordingExecutor(ex)
    call(OPS["gemv_4bit.out"], (A, packed, [N, K], absmax, code, bs, shifted), {}, rec)
    assert torch.equal(shifted, out) and base[0] == 7.0
    assert rec.launches[0][3][8].byte_offset == 4  # bound at the caller's view


# -- accuracy figures on larger shapes ------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("M", [1, 8, 40])
def test_accuracy_against_float64(library, M, dtype):
    figures = run_gemm(EmulatedExecutor(library), Case(M, 64, 1024, dtype=dtype, nested=True, bias=True, seed=M))
    print(f"M={M} {dtype}: {figures}")


# -- each term is a * fl32(table[q] * scale), as dequantize_4bit + linear forms it -------------------
#
# docs/semantics.md section 4: every kernel multiplies each activation by the weight dequantize_4bit
# gives, rounded to float32 first; factoring the block scale out of a chunk's sum
# (scale * sum(a * table[q])) rounds differently. With rows of A that hold exactly two non-zero
# activations, powers of two in one 16-element chunk (so in one block), every product a * w is exact
# and every addition but one adds a zero: a kernel that forms its terms as a * w returns the float64
# reference rounded once to float32, whatever its order of summation; scale * fl32(a1 * t1 + a2 * t2)
# is another number for many weight rows.

ROUNDING_SHAPES = {  # path -> (M, N, K), kernel (the built-in path of that shape, or the route `path`)
    "gemv": ((1, 48, 256), "bnb_gemv_4bit"),
    "gemv/tglut": ((1, 48, 256), "bnb_gemv_4bit_tglut"),
    "batch": ((5, 48, 176), "bnb_gemm_4bit_batch"),
    "batch-M1": ((1, 48, 48), "bnb_gemm_4bit_batch"),  # K % 32 == 16
    "small": ((5, 48, 176), "bnb_gemm_4bit_small"),
    "small/wide": ((5, 48, 176), "bnb_gemm_4bit_small_wide"),
    "splitk": ((5, 48, 1024), "bnb_gemm_4bit_splitk"),
    "splitk/two": ((5, 48, 1024), "bnb_gemm_4bit_splitk_partial"),
    "mma": ((40, 48, 128), "bnb_gemm_4bit_mma"),
    "mma-any-K": ((3, 48, 45), "bnb_gemm_4bit_mma"),
}


def gemm_on(path: str, executor, args: tuple) -> torch.Tensor:
    """gemm_4bit through the op layer: its built-in path, or the route `path` where that is another."""
    A, (N, K) = args[0], args[2]
    route = route_of(path, math.prod(A.shape[:-1]), N, K)
    if route is not None:
        return matmul_4bit.gemm_4bit(executor, *args, route=route)
    return call(OPS["gemm_4bit"], args, {}, executor)


def two_term_rows(M: int, K: int, seed: int) -> torch.Tensor:
    """[M, K] float32 rows with two non-zero entries each, +-2^-3 .. 2^3, in one 16-aligned run of 16."""
    r = np.random.default_rng(seed)
    A = np.zeros((M, K), np.float32)
    for m in range(M):
        c = 16 * int(r.integers(0, K // 16))
        for k in r.choice(16, 2, replace=False):
            A[m, c + k] = r.choice([-1.0, 1.0]) * 2.0 ** int(r.integers(-3, 4))
    return torch.from_numpy(A)


def scale_factored(A: torch.Tensor, t: np.ndarray, s: np.ndarray) -> np.ndarray:
    """What y would be with the block scale factored out of each chunk: fl32(s * fl32(a1*t1 + a2*t2))
    for two_term_rows' A (t, s: the weight's table values and block scales, [N, K] float32)."""
    a = A.numpy()
    y = np.zeros((a.shape[0], t.shape[0]), np.float32)
    for m in range(a.shape[0]):
        k1, k2 = np.flatnonzero(a[m])
        y[m] = s[:, k1] * (a[m, k1] * t[:, k1] + a[m, k2] * t[:, k2])  # float32 arithmetic, rounded per step
    return y


@pytest.mark.parametrize("nested", [False, True], ids=["absmax", "nested"])
@pytest.mark.parametrize("path", list(ROUNDING_SHAPES))
def test_terms_are_products_of_the_dequantized_weights(library, library32, path, nested):
    (M, N, K), kernel = ROUNDING_SHAPES[path]
    r = np.random.default_rng(K + nested)
    bs = 32 if K % 32 == 0 else 64
    nblocks = math.ceil(N * K / bs)
    packed = torch.from_numpy(ref.pack_nibbles(r.integers(0, 16, N * K).astype(np.uint8))).reshape(-1, 1)
    if nested:
        nested_args = (torch.from_numpy(r.integers(0, 256, nblocks).astype(np.uint8)), CODE8.clone(),
                       torch.tensor(0.75, dtype=torch.float32))  # fmt: skip
        absmax = torch.from_numpy(r.uniform(0.3, 3.0, math.ceil(nblocks / 256)).astype(np.float32))
    else:
        nested_args = ()
        absmax = torch.from_numpy(r.uniform(0.3, 3.0, nblocks).astype(np.float32))  # not powers of two
    A = two_term_rows(M, K, seed=M + K)
    ex = executor_of(path, library, library32, order="random", seed=K)
    for quant_type in ("nf4", "fp4"):
        y = gemm_on(path, ex, (A, packed, [N, K], absmax, bs, quant_type, None, *nested_args))
        weight = (packed, (N, K), bs, quant_type, absmax, *nested_args)
        want = R.matmul(A, R.dequantized_weight(*weight)).astype(np.float32)  # float64 sum, rounded once
        assert torch.equal(y, torch.from_numpy(want)), f"{quant_type}: {(y.numpy() != want).sum()} outputs differ"
        # The case tells the two formations apart.
        factored = scale_factored(A, *R.weight_parts(*weight))
        assert (factored != want).mean() > 0.1, quant_type
    assert set(ex.launched) == set(launches_of(kernel, "nested" if nested else "absmax", "f32"))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("path", ["gemv", "gemv/tglut", "batch", "small", "small/wide", "splitk", "splitk/two", "mma"])
def test_half_activations_take_the_weight_in_their_dtype(library, library32, path, dtype):
    """float16 / bfloat16 activations multiply the weight as dequantize_4bit gives it in their dtype,
    T(fl32(table[q] * scale)), as bitsandbytes' dequantize-then-linear path does: with two_term_rows'
    activations (exact in T) the result is that product in float64, rounded to float32 and then to T,
    which the float32 weight fl32(table[q] * scale) gives for many fewer outputs."""
    (M, N, K), kernel = ROUNDING_SHAPES[path]
    r = np.random.default_rng(K + 7)
    packed = torch.from_numpy(ref.pack_nibbles(r.integers(0, 16, N * K).astype(np.uint8))).reshape(-1, 1)
    absmax = torch.from_numpy(r.uniform(0.3, 3.0, N * K // 32).astype(np.float32))
    A = two_term_rows(M, K, seed=M + K + 1).to(dtype)
    ex = executor_of(path, library, library32, order="random", seed=K)
    for quant_type in ("nf4", "fp4"):
        y = gemm_on(path, ex, (A, packed, [N, K], absmax, 32, quant_type))
        W = R.dequantized_weight(packed, (N, K), 32, quant_type, absmax)
        want = torch.from_numpy(R.matmul(A, R.in_dtype(W, dtype)).astype(np.float32)).to(dtype)
        assert torch.equal(y, want), f"{quant_type}: {(y != want).sum()} outputs differ"
        with_float32_weights = torch.from_numpy(R.matmul(A, W).astype(np.float32)).to(dtype)
        assert (with_float32_weights != want).float().mean() > 0.05, quant_type
    assert set(ex.launched) == set(launches_of(kernel, "absmax", DT[dtype]))


# -- empty products, bad input ------------------------------------------------------------------------


class NoLaunch:
    name = "emulated"

    def launch(self, kernel, **_):
        raise AssertionError(f"launched {kernel} for an empty product")


def test_empty_products():
    packed, absmax = make_weight(Case(1, 8, 64))
    y = call(OPS["gemm_4bit"], (torch.empty(0, 64), packed, [8, 64], absmax, 64, "nf4"), {}, NoLaunch())
    assert y.shape == (0, 8)
    y = call(OPS["gemm_4bit"], (torch.empty(2, 0, 64), packed, [8, 64], absmax, 64, "nf4"), {}, NoLaunch())
    assert y.shape == (2, 0, 8)
    code = bnb_functional.get_4bit_type("nf4", device="cpu")
    y = call(OPS["gemv_4bit"], (torch.ones(3, 0), packed, [5, 0], absmax, code, 64), {}, NoLaunch())
    assert torch.equal(y, torch.zeros(3, 5))
    bias = torch.arange(5.0)
    y = call(OPS["gemm_4bit"], (torch.ones(3, 0), packed, [5, 0], absmax, 64, "fp4", bias), {}, NoLaunch())
    assert torch.equal(y, bias.expand(3, 5))


def test_inner_dimension_is_checked():
    packed, absmax = make_weight(Case(1, 8, 64))
    with pytest.raises(ValueError, match="gemm_4bit: A's last dimension .63. must equal shapeB.1. = K .64."):
        call(OPS["gemm_4bit"], (torch.ones(2, 63), packed, [8, 64], absmax, 64, "nf4"), {}, NoLaunch())
    with pytest.raises(ValueError, match="gemv_4bit"):
        call(OPS["gemv_4bit"], (torch.ones(65), packed, [8, 64], absmax, torch.zeros(16), 64), {}, NoLaunch())


# -- the switch points ------------------------------------------------------------------------------


@pytest.mark.parametrize("version,splitk", [((3, 2), "splitk"), ((4, 0), "splitk"), ((3, 1), "splitk/two"),
                                            (None, "splitk/two")])  # fmt: skip
def test_switch_points_are_shape_constants(version, splitk):
    """The same switch points at every Metal language version; the split-K path is the one-dispatch
    kernel from 3.2, the two-dispatch one below (and where the version is not known)."""
    assert (matmul_4bit.GEMV_MAX_M, matmul_4bit.SMALL_MAX_M) == (1, 32)

    def choose(M, N, K):
        return matmul_4bit.choose_path(M, N, K, language_version=version)

    paths = [choose(M, 4096, 4096) for M in (1, 2, 8, 9, 32, 33, 512)]
    assert paths == ["gemv", splitk, splitk, splitk, splitk, "mma", "mma"]
    assert choose(1, 4096, 4128) == "gemv"  # K % 32 == 0
    assert choose(1, 4096, 4112) == "batch"  # K % 32 == 16
    assert choose(8, 4096, 4112) == splitk
    # below two slices of 256 the small kernel (and no split-K route)
    assert [choose(8, 4096, K) for K in (496, 512)] == ["small", splitk]
    below = matmul_4bit.paths(8, 4096, 496, language_version=version)
    assert not {"splitk", "splitk/two"} & set(below) and "small" in matmul_4bit.paths(8, 4096, 512,
                                                                                     language_version=version)
    assert choose(1, 4096, 4100) == "mma"  # K % 16 != 0
    assert choose(8, 4096, 4100) == "mma"


def test_small_routes_refuse_more_rows_than_they_hold():
    packed, absmax = make_weight(Case(1, 8, 64))
    at_3_2 = NoLaunch()
    at_3_2.language_version = (3, 2)  # (where the one-dispatch split-K kernel exists)
    for route in ("small", "small/wide", "splitk", "splitk/two"):
        with pytest.raises(ValueError, match=f"gemm_4bit: route '{route}' computes at most 32 rows of A, got M = 33"):
            matmul_4bit.gemm_4bit(at_3_2, torch.ones(33, 64), packed, [8, 64], absmax, 64, "nf4", route=route)


@pytest.mark.parametrize("version,M,launches", [
    (None, 1, [("bnb_gemv_4bit_nested_bf16", (512, 1, 1), (64, 1, 1))]),
    ((3, 2), 8, [("bnb_gemm_4bit_splitk_nested_bf16", (256, 1, 1), (128, 1, 1))]),  # S = 4: 64 tiles of 64 columns
    ((3, 2), 32, [("bnb_gemm_4bit_splitk_nested_bf16", (256, 1, 1), (128, 1, 1))]),  # S = 8: 32 tiles of 128
    # below 3.2 the same threadgroups of partial sums, then a threadgroup per tile and 128 of its M x 16 S outputs
    ((3, 1), 8, [("bnb_gemm_4bit_splitk_partial_nested_bf16", (256, 1, 1), (128, 1, 1)),
                 ("bnb_gemm_4bit_splitk_sum_bf16", (64, 4, 1), (128, 1, 1))]),
    ((3, 1), 32, [("bnb_gemm_4bit_splitk_partial_nested_bf16", (256, 1, 1), (128, 1, 1)),
                  ("bnb_gemm_4bit_splitk_sum_bf16", (32, 32, 1), (128, 1, 1))]),
    (None, 512, [("bnb_gemm_4bit_mma_nested_bf16", (16, 64, 1), (128, 1, 1))]),
])  # fmt: skip
def test_launch_geometry(version, M, launches):
    N = K = 4096
    meta = {"device": "meta"}
    args = (torch.empty(M, K, dtype=torch.bfloat16, **meta), torch.empty(N * K // 2, 1, dtype=torch.uint8, **meta),
            [N, K], torch.empty(N * K // 64 // 256, **meta), 64, "nf4", None,
            torch.empty(N * K // 64, dtype=torch.uint8, **meta), torch.empty(256, **meta),
            torch.empty((), **meta))  # fmt: skip
    rec = RecordingExecutor()
    rec.language_version = version
    call(OPS["gemm_4bit"], args, {}, rec)
    assert [(k, g, t) for k, g, t, _ in rec.launches] == launches


# -- Apple float semantics: huge and subnormal block scales and activations (docs/semantics.md section 7) --
#
# Every case runs on the three paths, in the emulator's "apple" float mode (float32 subnormals
# flushed, as on Apple GPUs) against the flushed reference, and in its "ieee" mode against the IEEE
# one. Where the two answers differ, the Apple result is also shown not to be the IEEE answer (the
# case is exercised) and its flushed contributions to be exact zeros; where they agree (no float32
# value below 2^-126 anywhere), the two modes give the same bits.

TINY = 2.0**-126  # the smallest normal float32
FMAX = float(torch.finfo(torch.float32).max)
APPLE_PATHS = {"gemv": 1, "small": 5, "mma": 40}  # M of each built-in path at K = 128 (and 256)
HUGE_SCALES = [1.5 * 2.0**126, 2.0**126 * (1 + 2.0**-23), 2.0**127, 1e38, 3e38, FMAX]


def huge_scales(dtype: torch.dtype) -> list[float]:
    """HUGE_SCALES up to the largest value of the activations' dtype, in which the kernels take the
    weights (docs/semantics.md section 4): for bfloat16, all but the float32 maximum, whose weights
    of magnitude near 1 round to infinity in bfloat16 (as dequantize_4bit to bfloat16 gives them)."""
    return [s for s in HUGE_SCALES if s <= torch.finfo(dtype).max]


def unit_blocks(N: int, K: int, blocksize: int, quant_type: str, seed: int) -> torch.Tensor:
    """Nibbles of a random weight whose every block has absmax 1, packed: with a block scale s the
    weight is table[nibble] * s (the scales are set by the test, not by the quantizer)."""
    W = torch.randn(N * K, generator=gen(seed), dtype=torch.float64).reshape(-1, blocksize)
    W = (W / W.abs().amax(1, keepdim=True)).float().reshape(N, K)
    nib, absmax = ref.quantize_4bit_nibbles(W, blocksize, quant_type, flush=False)
    assert (absmax == 1).all()
    return torch.from_numpy(ref.pack_nibbles(nib)).reshape(-1, 1)


def product_in_both_modes(library, A, args: list, shapeB, blocksize, quant_type, nested_args=()):
    """gemm_4bit in the "apple" and "ieee" float modes, each checked against its reference; returns
    (y_apple, y_ieee, references) with references[flush] = W (the dequantized weight)."""
    N = shapeB[0]
    refs = {}
    ys = {}
    for mode, flush in (("apple", True), ("ieee", False)):
        ex = EmulatedExecutor(library, float_mode=mode, order="random", seed=A.shape[0])
        y = call(OPS["gemm_4bit"], tuple(args), {}, ex)
        W = R.dequantized_weight(args[1], shapeB, blocksize, quant_type, args[3], *nested_args, flush=flush)
        R.check_accuracy(y.reshape(-1, N), A.reshape(-1, A.shape[-1]), W, flush=flush)
        refs[flush], ys[mode] = W, y
    return ys["apple"], ys["ieee"], refs


def is_not_the_ieee_answer(y, A, refs) -> bool:
    W = refs[False]
    try:
        R.check_accuracy(y.reshape(-1, W.shape[0]), A.reshape(-1, A.shape[-1]), W, flush=False)
    except AssertionError:
        return True
    return False


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
@pytest.mark.parametrize("path", list(APPLE_PATHS))
def test_huge_block_scales(library, path, dtype):
    """Block scales above 2^126 up to the float32 maximum (bfloat16: its maximum, huge_scales): the
    products are those of the IEEE reference, in both float modes, bit for bit the same (no float32
    value below 2^-126 arises)."""
    M, N, K, bs = APPLE_PATHS[path], 9, 128, 64
    for quant_type in ("nf4", "fp4"):
        packed = unit_blocks(N, K, bs, quant_type, seed=M)
        scales = huge_scales(dtype)
        absmax = torch.tensor([scales[b % len(scales)] for b in range(N * K // bs)], dtype=torch.float32)
        A = (torch.randn(M, K, generator=gen(M + 1)) * 2.0**-24).to(dtype)  # |y| stays below the maximum
        y, y_ieee, _ = product_in_both_modes(library, A, [A, packed, [N, K], absmax, bs, quant_type], (N, K), bs,
                                             quant_type)  # fmt: skip
        assert torch.equal(y, y_ieee) and y.float().abs().max() > 2.0**100 and torch.isfinite(y).all()
    assert path_of(Case(M, N, K)) == path


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
@pytest.mark.parametrize("path", list(APPLE_PATHS))
def test_subnormal_activations_count_as_zero(library, path, dtype):
    """Activations below 2^-126 (float32, bfloat16) count as zero: here they meet weights above
    2^100, where IEEE's products (about 0.01 to 1 each) would change the result."""
    M, N, K, bs = APPLE_PATHS[path], 9, 128, 64
    r = gen(M + 2)
    A = torch.randn(M, K, generator=r)
    A[:, : K // 2] = (torch.rand(M, K // 2, generator=r) - 0.5) * 2 * TINY  # subnormals, both signs
    A[:, : K // 2 : 7] = 0.0
    A = A.to(dtype)
    sub = (A.float().abs() < TINY) & (A != 0)
    assert sub.sum() > M * K // 3
    for quant_type in ("nf4", "fp4"):
        packed = unit_blocks(N, K, bs, quant_type, seed=M)
        # Each weight row: block 0 (columns 0..63, the subnormal activations) huge, block 1 ordinary.
        scales = huge_scales(dtype)
        absmax = torch.tensor([scales[b // 2 % len(scales)] if b % 2 == 0 else 1.0 for b in range(2 * N)])
        y, y_ieee, refs = product_in_both_modes(library, A, [A, packed, [N, K], absmax, bs, quant_type], (N, K), bs,
                                                quant_type)  # fmt: skip
        assert is_not_the_ieee_answer(y, A, refs)
        # The same bits as with those activations replaced by zeros.
        A0 = torch.where(sub, A * 0, A)
        y0 = call(OPS["gemm_4bit"], (A0, packed, [N, K], absmax, bs, quant_type), {},
                  EmulatedExecutor(library, float_mode="apple"))  # fmt: skip
        assert torch.equal(y, y0)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
@pytest.mark.parametrize("path", list(APPLE_PATHS))
def test_subnormal_block_scales_count_as_zero(library, path, dtype):
    """Block scales below 2^-126 count as zero: weight rows whose blocks all have such scales give
    exactly 0, where IEEE's products with activations near 1e30 are about 1e-9 each; rows with
    ordinary scales are unaffected."""
    M, N, K, bs = APPLE_PATHS[path], 10, 128, 64
    subnormal_scales = [1e-39, -5e-40, 2.0**-149, TINY * (1 - 2.0**-23), 3e-39]
    absmax = torch.tensor([subnormal_scales[b // 2 % 5] if b // 2 % 2 == 0 else 2.0**-100 for b in range(2 * N)])
    A = (torch.randn(M, K, generator=gen(M + 3)) * 1e30).to(dtype)
    for quant_type in ("nf4", "fp4"):
        packed = unit_blocks(N, K, bs, quant_type, seed=M + 1)
        y, y_ieee, refs = product_in_both_modes(library, A, [A, packed, [N, K], absmax, bs, quant_type], (N, K), bs,
                                                quant_type)  # fmt: skip
        assert torch.equal(y[:, 0::2], torch.zeros_like(y[:, 0::2]))  # rows of subnormal scales
        assert (y_ieee[:, 0::2] != 0).any() and (y[:, 1::2] != 0).all()
        assert is_not_the_ieee_answer(y, A, refs)


@pytest.mark.parametrize("path", list(APPLE_PATHS))
def test_float16_subnormal_activations_are_kept(library, path):
    """float16 subnormals (2^-24 to 2^-14) are normal floats once widened: the product is the IEEE
    one in both modes."""
    M, N, K, bs = APPLE_PATHS[path], 9, 128, 64
    A = ((torch.rand(M, K, generator=gen(M + 4)) - 0.5) * 2 * 6e-5).half()
    assert (A.abs() < torch.finfo(torch.float16).tiny).float().mean() > 0.9
    for quant_type in ("nf4", "fp4"):
        packed = unit_blocks(N, K, bs, quant_type, seed=M + 2)
        absmax = torch.full((2 * N,), 2.0**10)
        y, y_ieee, _ = product_in_both_modes(library, A, [A, packed, [N, K], absmax, bs, quant_type], (N, K), bs,
                                             quant_type)  # fmt: skip
        assert torch.equal(y, y_ieee) and (y != 0).float().mean() > 0.5


@pytest.mark.parametrize("path", list(APPLE_PATHS))
def test_tiny_activations_meet_huge_block_scales(library, path):
    """Normal activations of 2^-126 to 2^-116 times weights above 2^100 (block scales up to the float32
    maximum) give terms a * w of ordinary size, which every path keeps (docs/semantics.md section 7),
    although many a * table[q] are float32 subnormals (what a kernel that applied the scale after
    multiplying by the table would lose)."""
    M, N, K, bs = APPLE_PATHS[path], 9, 128, 64
    r = gen(M + 7)
    A = (1 + torch.rand(M, K, generator=r)) * 2.0 ** torch.randint(-126, -116, (M, K), generator=r).float()
    A = torch.where(torch.rand(M, K, generator=r) < 0.5, -A, A)
    assert (A.abs() >= TINY).all()
    for quant_type in ("nf4", "fp4"):
        packed = unit_blocks(N, K, bs, quant_type, seed=M + 3)
        absmax = torch.tensor([HUGE_SCALES[b % len(HUGE_SCALES)] for b in range(N * K // bs)], dtype=torch.float32)
        ex = EmulatedExecutor(library, float_mode="apple", order="random", seed=M)
        y = call(OPS["gemm_4bit"], (A, packed, [N, K], absmax, bs, quant_type), {}, ex)
        weight = (packed, (N, K), bs, quant_type, absmax)
        W = R.dequantized_weight(*weight)
        R.check_accuracy(y, A, W)  # (no term is at risk: the bound is section 4's)
        # The case is exercised: the terms whose a * table[q] is a float32 subnormal weigh in the result.
        t, _ = R.weight_parts(*weight)
        at = A.double().numpy()[:, None, :] * t.astype(np.float64)[None, :, :]
        lost = (np.abs(at) < TINY) & (at != 0)
        share = np.abs(np.where(lost, A.double().numpy()[:, None, :] * W.astype(np.float64)[None], 0)).sum(2)
        assert lost.any() and (share / R.magnitude(A, W)).max() > 1e-3, quant_type


CODE8 = bnb_functional.create_dynamic_map(signed=True)
_C = CODE8.numpy()
#: codes of the dynamic map whose product with 2^-120 is a float32 subnormal, and those near 0.5
_SMALL_CODES = [int(i) for i in np.flatnonzero((np.abs(_C) < 2.0**-6) & (_C != 0))]
_HALF = int(np.argmin(np.abs(_C - 0.5)))


def nested_weight(N, K, bs, quant_type, q_of_block, nested, offset, seed):
    """gemm_4bit's nested arguments for a weight of unit blocks: absmax_8bit from `q_of_block(b)`,
    `nested` (one value per 256 blocks), a float32 offset."""
    packed = unit_blocks(N, K, bs, quant_type, seed=seed)
    q8 = torch.tensor([q_of_block(b) for b in range(N * K // bs)], dtype=torch.uint8)
    offset = torch.tensor(offset, dtype=torch.float32)
    return packed, torch.tensor(nested, dtype=torch.float32), (q8, CODE8.clone(), offset)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
@pytest.mark.parametrize("path", list(APPLE_PATHS))
def test_nested_block_scales_huge_and_subnormal(library, path, dtype):
    """Double-quantized scales scale_b = fl32(fl32(code[q_b] * nested[b // 256]) + offset) (N = 64,
    K = 256, blocksize 32: two nested groups of 256 blocks, rows 0..31 and 32..63):
    - huge: nested scales 3e38 and 2^127, codes of magnitude 0.5 to 1, offset 1e37: scales up to
      3.1e38, the IEEE answer in both modes;
    - products below 2^-126: nested 2^-120 with codes below 2^-6 (rows 0..15), nested 1e-39 (rows
      32..63): those scales are 0, so are their rows' outputs, while codes from 0.25 up give ordinary
      scales (rows 16..31);
    - sums below 2^-126: nested 2^-120, offset -fl32(code[q] * 2^-120) for the code q nearest 0.5,
      and its neighbours q - 1, q, q + 1 in rows 0..15 (scales 0 on the GPU, +-0.9 * 2^-126 or 0 in
      IEEE), codes far from q in rows 16..31, nested 1 in rows 32..63."""
    M, N, K, bs = APPLE_PATHS[path], 64, 256, 32
    blocks_per_row = K // bs
    big = [i for i in range(256) if abs(_C[i]) >= 0.25]
    # (scales within a factor of 3 of each other: with a few dominant terms a float32 sum of 256
    # terms may be more than section 4's 4 ulps of the magnitude away, whatever the float mode)
    half_up = [i for i in range(256) if abs(_C[i]) >= 0.5]
    far = [i for i in range(256) if abs(_C[i] - _C[_HALF]) > 0.05]
    r = np.random.default_rng(M)
    row = lambda b: b // blocks_per_row  # noqa: E731
    minus_half = -float(np.float32(_C[_HALF]) * np.float32(2.0**-120))
    cases = {
        "huge": (lambda b: int(r.choice(half_up)), [3e38, 2.0**127], 1e37, 2.0**-30),
        "products": (lambda b: int(r.choice(_SMALL_CODES)) if row(b) < 16 else int(r.choice(big)), [2.0**-120, 1e-39],
                     0.0, 1e30),
        "sums": (lambda b: _HALF + int(r.integers(-1, 2)) if row(b) < 16 else int(r.choice(far)), [2.0**-120, 1.0],
                 minus_half, 1e30),
    }  # fmt: skip
    for label, (q_of_block, nested, offset, a_scale) in cases.items():
        quant_type = "fp4" if label == "sums" else "nf4"
        packed, nested_t, nested_args = nested_weight(N, K, bs, quant_type, q_of_block, nested, offset, seed=M + 5)
        A = (torch.randn(M, K, generator=gen(M + 6)) * a_scale).to(dtype)
        args = [A, packed, [N, K], nested_t, bs, quant_type, None, *nested_args]
        y, y_ieee, refs = product_in_both_modes(library, A, args, (N, K), bs, quant_type, nested_args)
        if label == "huge":
            assert torch.equal(y, y_ieee) and y.float().abs().max() > 2.0**100, label
            continue
        zero_rows = list(range(16)) + (list(range(32, 64)) if label == "products" else [])
        assert torch.equal(y[:, zero_rows], torch.zeros_like(y[:, zero_rows])), label
        assert (y[:, 16:32] != 0).all() and (y_ieee[:, :16] != 0).any(), label
        assert is_not_the_ieee_answer(y, A, refs), label
