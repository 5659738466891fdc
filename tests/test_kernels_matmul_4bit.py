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


def run_gemm(executor, case: Case) -> dict:
    A, args, W, bias = gemm_args(case)
    y = call(OPS["gemm_4bit"], tuple(args), {}, executor)
    assert y.shape == (*A.shape[:-1], case.N) and y.dtype == case.dtype and y.is_contiguous()
    return R.check_accuracy(y.reshape(-1, case.N), A.reshape(-1, case.K), W, bias)


def path_of(case: Case) -> str:
    return matmul_4bit.choose_path(case.M, case.N, case.K)


# -- every kernel variant under every lane order, race checking, poisoned threadgroup memory --------

# One shape per path, with a K tail (K not a multiple of the simdgroup step, of 32, or of 16) and
# an N tail (N not a multiple of the rows per threadgroup).
PATH_SHAPES = {
    "gemv": (1, 21, 1056),  # 1056 = 1024 + 32: the second step has a single active lane
    "batch": (5, 13, 176),
    "mma": (37, 70, 72),  # two M tiles, two N tiles, 3 K steps (the last a half)
    "mma-any-K": (3, 11, 45),
}


@pytest.mark.parametrize("nested", [False, True], ids=["absmax", "nested"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("path", list(PATH_SHAPES))
def test_all_orders(library, path, dtype, nested):
    M, N, K = PATH_SHAPES[path]
    case = Case(M, N, K, dtype=dtype, nested=nested, bias=nested, blocksize=32 if nested else 128,
                quant_type="fp4" if dtype == torch.bfloat16 else "nf4", seed=M + N + K)  # fmt: skip
    ex = EmulatedExecutor(library, checked=True)
    run_gemm(ex, case)
    want = path.split("-")[0]
    assert ex.launched == [f"bnb_{'gemv' if want == 'gemv' else 'gemm'}_4bit_{'' if want == 'gemv' else want + '_'}"
                           f"{'nested' if nested else 'absmax'}_{DT[dtype]}"]  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_threadgroup_table_variant_all_orders(library, dtype, monkeypatch):
    monkeypatch.setattr(matmul_4bit, "GEMV_TABLE", "threadgroup")
    for nested in (False, True):
        ex = EmulatedExecutor(library, checked=True)
        run_gemm(ex, Case(1, 19, 96, dtype=dtype, nested=nested, bias=True, quant_type="fp4", seed=4))
        assert ex.launched == [f"bnb_gemv_4bit_tglut_{'nested' if nested else 'absmax'}_{DT[dtype]}"]


# -- every blocksize and quant type on every path (blocks straddling rows) ------------------------

# K = 96 is below every blocksize from 128 (blocks span several rows and start mid-row) and not a
# multiple of 64 (blocks of 64 straddle rows); N*K >= 3 blocks of 4096 for the largest blocksize.
@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("blocksize", ref.BLOCKSIZES_4BIT)
def test_every_blocksize(library, blocksize, quant_type):
    ex = EmulatedExecutor(library)
    N = max(8, math.ceil(3 * blocksize / 96) + 3)
    for i, M in enumerate((1, 6, 11)):
        dtype = DTYPES[(i + blocksize.bit_length()) % 3]
        run_gemm(ex, Case(M, N, 96, dtype=dtype, blocksize=blocksize, quant_type=quant_type, nested=i == 1,
                          seed=blocksize + i))  # fmt: skip
    assert {k.split("_")[2] for k in ex.launched} == {"4bit"} and len(ex.launched) == 3
    assert [path_of(Case(M, N, 96)) for M in (1, 6, 11)] == ["gemv", "batch", "mma"]


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


@pytest.mark.parametrize("M", [1, 4, 10])
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
    path = {1: "gemv_4bit", 4: "gemm_4bit_batch", 10: "gemm_4bit_mma"}[M]
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


def test_switch_points_are_shape_constants():
    assert (matmul_4bit.GEMV_MAX_M, matmul_4bit.SMALL_BATCH_MAX_M) == (1, 8)
    paths = [matmul_4bit.choose_path(M, 4096, 4096) for M in (1, 2, 8, 9, 512)]
    assert paths == ["gemv", "batch", "batch", "mma", "mma"]
    assert matmul_4bit.choose_path(1, 4096, 4128) == "gemv"  # K % 32 == 0
    assert matmul_4bit.choose_path(1, 4096, 4112) == "batch"  # K % 32 == 16
    assert matmul_4bit.choose_path(8, 4096, 4112) == "batch"
    assert matmul_4bit.choose_path(1, 4096, 4100) == "mma"  # K % 16 != 0


@pytest.mark.parametrize("M,kernel,grid,threads", [
    (1, "bnb_gemv_4bit_nested_bf16", (512, 1, 1), (64, 1, 1)),
    (8, "bnb_gemm_4bit_batch_nested_bf16", (512, 1, 1), (128, 1, 1)),
    (512, "bnb_gemm_4bit_mma_nested_bf16", (16, 64, 1), (128, 1, 1)),
])  # fmt: skip
def test_launch_geometry(M, kernel, grid, threads):
    N = K = 4096
    meta = {"device": "meta"}
    args = (torch.empty(M, K, dtype=torch.bfloat16, **meta), torch.empty(N * K // 2, 1, dtype=torch.uint8, **meta),
            [N, K], torch.empty(N * K // 64 // 256, **meta), 64, "nf4", None,
            torch.empty(N * K // 64, dtype=torch.uint8, **meta), torch.empty(256, **meta),
            torch.empty((), **meta))  # fmt: skip
    rec = RecordingExecutor()
    call(OPS["gemm_4bit"], args, {}, rec)
    assert [(k, g, t) for k, g, t, _ in rec.launches] == [(kernel, grid, threads)]
