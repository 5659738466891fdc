"""The LLM.int8() kernels under the emulator, against tests/reference_int8.py (docs/semantics.md section 6).

Every op runs through the op layer's launchers (bnb_mps.ops.int8) on an executor that forwards to
the emulator with a chosen lane order, race checking and poison byte. Quantized codes, statistics
and int32 products must equal the reference bit for bit; dequantized outputs too (the kernels
round the way docs/semantics.md writes it), except int8_mixed_scaled_mm's fp outlier part, whose float32 sum
is compared with the exact sum within the rounding it allows. The emulator's default float mode
flushes float32 subnormals as Apple GPUs do, and the reference models it (docs/semantics.md section 7,
tests/reference_int8.py's flush mode, its default); the Apple float tests at the end also run the
dequantizers in the "ieee" mode against the IEEE reference.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import bitsandbytes  # noqa: F401  (defines the torch.ops.bitsandbytes schemas)
import op_inputs
import reference_int8 as ref
from kernel_harness import EmulatedExecutor, NoLaunch
from bnb_mps.ops import call, int8 as int8_ops
from bnb_mps.ops.registry import OPS

emulator = pytest.importorskip("bnb_mps.emulator")

ORDERS = ("forward", "reverse", "random")
POISONS = (0x00, 0xFF)
DTYPES = ref.DTYPES


def run(name: str, executor, *args):
    return call(OPS[name], args, {}, executor)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality of two tensors of one dtype and shape."""
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def activations(shape, dtype, seed, scale=1.5, outliers=()) -> torch.Tensor:
    """Normal values times `scale`, with given (flat index, value) outliers."""
    x = torch.randn(*shape, generator=gen(seed)) * scale
    flat = x.view(-1)
    for i, value in outliers:
        flat[i % flat.numel()] = value
    return x.to(dtype)


def int8s(shape, seed, low=-128, high=128) -> torch.Tensor:
    return torch.randint(low, high, shape, generator=gen(seed), dtype=torch.int8)


def stats(n, seed) -> torch.Tensor:
    return torch.rand(n, generator=gen(seed)) * 4 + 0.01


# -- checks against the reference ---------------------------------------------------------------------


def check_vectorwise_quant(ex, A, threshold):
    CA, row_stats, cols = run("int8_vectorwise_quant", ex, A, threshold)
    want = ref.int8_vectorwise_quant(A, threshold)
    assert torch.equal(CA, want[0]), f"CA differs at {(CA != want[0]).nonzero()[:8].tolist()}"
    assert same_bits(row_stats, want[1])
    if threshold == 0.0:
        assert cols is None
    else:
        assert cols.dtype == torch.int64 and torch.equal(cols, want[2]), (cols, want[2])
    return CA, row_stats, cols


def check_double_quant(ex, A, threshold):
    got = run("int8_double_quant", ex, A, threshold)
    want = ref.int8_double_quant(A, threshold)
    for name, g, w in zip(("CA", "CAt", "row_stats", "col_stats"), got[:4], want[:4]):
        assert same_bits(g, w), f"{name} differs"
    if threshold == 0.0:
        assert got[4] is None
    else:
        assert torch.equal(got[4], want[4])
    return got


def check_products(ex, A, B, row_stats, col_stats, bias=None, dtype=None):
    out = run("int8_linear_matmul", ex, A, B)
    want = ref.int8_linear_matmul(A, B)
    assert torch.equal(out, want), f"int32 products differ at {(out != want).nonzero()[:8].tolist()}"
    scaled = run("int8_scaled_mm", ex, A, B, row_stats, col_stats, bias, dtype)
    assert same_bits(scaled, ref.int8_scaled_mm(A, B, row_stats, col_stats, bias, dtype))
    deq = run("int8_mm_dequant", ex, out, row_stats, col_stats, dtype, bias)
    assert same_bits(deq, ref.int8_mm_dequant(want, row_stats, col_stats, dtype, bias))


def check_mixed(ex, A, CA, CB, SCA, SCB, outlier_cols, bias=None):
    out, subA = run("int8_mixed_scaled_mm", ex, A, CA, CB, SCA, SCB, outlier_cols, bias)
    want, want_sub, exact = ref.int8_mixed_scaled_mm(A, CA, CB, SCA, SCB, outlier_cols, bias)
    assert same_bits(subA, want_sub)
    assert out.dtype == A.dtype and out.shape == want.shape
    if outlier_cols is None or outlier_cols.numel() == 0:
        assert same_bits(out, want)
        return out
    # float32 sums of the outlier products, rounded once: see ref.mixed_allowance
    allowed = ref.mixed_allowance(out, exact, A, CA, CB, SCA, SCB, outlier_cols, bias)
    err = (out.double() - exact).abs()
    assert (err <= allowed).all(), f"max excess {(err - allowed).max().item()}"
    return out


# -- every lane order, race checking, both poison bytes -----------------------------------------------

ALL_ORDER_QUANT = [((9, 64), 0), ((17, 33), 1), ((2, 3, 20), 2), ((1, 40), 3)]
# Every product kernel: gemv1, gemv4, tile32, tile64, each with K % 16 == 0 (_k16) and without.
ALL_ORDER_PRODUCTS = [(1, 20, 48), (1, 9, 33), (5, 18, 33), (3, 20, 64), (20, 70, 80), (12, 40, 40),
                      (70, 65, 40), (40, 64, 32)]  # fmt: skip


@pytest.mark.parametrize("poison", POISONS)
@pytest.mark.parametrize("order", ORDERS)
def test_all_orders(library, order, poison):
    ex = EmulatedExecutor(library, order=order, race_check=True, poison=poison, seed=7,
                          coherence_check=order == "random" and poison == 0x00)
    for dtype in DTYPES:
        for shape, seed in ALL_ORDER_QUANT:
            A = activations(shape, dtype, seed, outliers=((3, 9.0), (5 * shape[-1] + 7, -7.5)))
            for threshold in (0.0, 6.0):
                check_vectorwise_quant(ex, A, threshold)
                check_double_quant(ex, A, threshold)
    A8 = int8s((7, 37), seed=4)
    assert same_bits(run("int8_vectorwise_dequant", ex, A8, stats(7, 5)), ref.int8_vectorwise_dequant(A8, stats(7, 5)))
    for M, N, K in ALL_ORDER_PRODUCTS:
        A, B = int8s((M, K), seed=M), int8s((N, K), seed=N)
        dtype = DTYPES[M % 3]
        check_products(ex, A, B, stats(M, 1), stats(N, 2), torch.randn(N, generator=gen(3)).to(dtype), dtype)
        Afp = activations((M, K), dtype, seed=K, outliers=((1, 8.0), (2 * K + 5, -9.0)))
        CA, SCA, cols = run("int8_vectorwise_quant", ex, Afp, 6.0)
        assert cols.numel() >= 2
        CB, SCB, _ = ref.int8_vectorwise_quant(activations((N, K), dtype, seed=N + 1), 0.0)
        check_mixed(ex, Afp, CA, CB, SCA, SCB, cols, torch.randn(N, generator=gen(4)).to(dtype))


# -- exactness of the int32 products -----------------------------------------------------------------


def worst_case(M, N, K, seed):
    """Rows of A all +127 (even rows) or all -128 (odd rows); B's row 0 all +127 (every product
    +16129: the largest sums), row 1 the same but for a last 2 (a sum that is no float32 value),
    the other rows +-127 with random signs."""
    A = torch.full((M, K), 127, dtype=torch.int8)
    A[1::2] = -128
    B = (torch.randint(0, 2, (N, K), generator=gen(seed)) * 254 - 127).to(torch.int8)
    B[:2] = 127
    B[1, -1] = 2
    return A, B


# K = 8192 on every path (the tiled 64-row one, ~20 s under the emulator, in the slow set; the
# default set covers it at K = 2080, past two exact chunks and 2^24 too). A gemv lane sums K / 32
# products, so its float accumulator is flushed (every 1024 products) only for K > 32768.
EXACT_CASES = [
    pytest.param(1, 8192, id="gemv1"), pytest.param(3, 8192, id="gemv4"), pytest.param(20, 8192, id="tile32"),
    pytest.param(1, 40960, id="gemv1-flush"), pytest.param(2, 40001, id="gemv4-bytes-flush"),
    pytest.param(33, 2080, id="tile64"), pytest.param(2, 8191, id="gemv4-bytes"),
    pytest.param(40, 2085, id="tile64-bytes"), pytest.param(9, 4099, id="tile32-bytes"),
    pytest.param(33, 8192, id="tile64-8192", marks=pytest.mark.slow),
]  # fmt: skip


@pytest.mark.parametrize(("M", "K"), EXACT_CASES)
def test_int32_products_exact_past_float32(library, M, K):
    N = 8
    A, B = worst_case(M, N, K, seed=K + M)
    want = ref.int8_linear_matmul(A, B)
    assert want.abs().max() > 2**24 * (K // 1040)  # far outside what float32 sums hold exactly
    got = run("int8_linear_matmul", EmulatedExecutor(library), A, B)
    assert torch.equal(got, want)
    # The test can tell: some of these sums are no float32 value, so a float32 accumulation (stock
    # bitsandbytes' default path) cannot return them, in any order of addition.
    not_float = want.double() != want.float().double()
    assert not_float.any()
    floats = torch.matmul(A.float(), B.float().t())
    assert not torch.equal(floats.to(torch.int32), want)


def test_float32_accumulation_is_inexact_for_these_inputs():
    """Evidence that the exactness test above has teeth: sequential float32 sums of the worst-case
    products lose integers (what an fp32 matmul, and a kernel without chunking, would return)."""
    products = np.full(8192, 127 * 127, dtype=np.float32)
    acc = np.float32(0)
    for p in products:
        acc = np.float32(acc + p)
    assert int(acc) != 8192 * 127 * 127


# -- shapes, layouts, dtypes -------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_quant_shapes(library, dtype):
    ex = EmulatedExecutor(library, order="random", seed=3)
    for shape in ((1, 1), (1, 7), (3, 1), (4, 5000), (2, 2, 3, 12), (300, 8), (33, 129)):
        A = activations(shape, dtype, seed=sum(shape), outliers=((0, 20.0), (shape[-1] + 1, -6.0)))
        for threshold in (0.0, 6.0, 0.5):
            check_vectorwise_quant(ex, A, threshold)
            check_double_quant(ex, A, threshold)


def test_quant_special_values(library):
    ex = EmulatedExecutor(library, order="reverse")
    A = torch.tensor([
        [0.0, 0.0, -0.0, 0.0],  # a zero row gives 0s, stats 0
        [float("nan"), 1.0, -2.0, 0.5],  # NaN left out of the max, quantizes to 0
        [float("inf"), 1.0, 0.0, -3.0],  # inf: max inf, every element 0
        [1e-30, -1e-30, 5e-31, 0.0],  # tiny values
        [3.0, -3.0, 1.5, 0.75],  # ties: 127 * 0.5 = 63.5 -> 64, 127 * 0.25 = 31.75 -> 32
    ], dtype=torch.float32)  # fmt: skip
    for dtype in DTYPES:
        for threshold in (0.0, 2.5):
            check_vectorwise_quant(ex, A.to(dtype), threshold)
            check_double_quant(ex, A.to(dtype), threshold)


def test_threshold_is_compared_exactly(library):
    """|A| >= threshold over the reals, also for thresholds float32 cannot represent."""
    ex = EmulatedExecutor(library)
    one_up = float(np.nextafter(np.float32(1), np.float32(2)))
    A = torch.tensor([[1.0, one_up, 0.5], [0.25, 0.5, 0.125]], dtype=torch.float32)
    _, _, cols = run("int8_vectorwise_quant", ex, A, 1.0 + 1e-12)  # above 1.0, below its float32 neighbour
    assert cols.tolist() == [1]
    _, _, cols = run("int8_vectorwise_quant", ex, A, 1.0)
    assert cols.tolist() == [0, 1]
    _, _, cols = run("int8_vectorwise_quant", ex, A, 1e300)  # beyond float32: nothing finite is an outlier
    assert cols.tolist() == []
    assert int8_ops._threshold_bits(6.0) == np.float32(6.0).view(np.uint32)


def test_outlier_list_many_columns(library):
    """More flagged columns than threads in the list's threadgroup, with several words per thread."""
    ex = EmulatedExecutor(library, order="random", race_check=True, seed=2)
    K = 20000
    A = activations((3, K), torch.float16, seed=11, scale=1.0)
    A[1, ::7] = 50.0
    A[2, 13::29] = -80.0
    check_vectorwise_quant(ex, A, 6.0)


@pytest.mark.parametrize(("M", "N", "K"), [(1, 1, 1), (1, 17, 16), (2, 3, 1), (8, 33, 200), (9, 64, 32),
                                           (32, 1, 17), (33, 70, 48), (64, 64, 64), (100, 7, 3)])  # fmt: skip
def test_product_shapes(library, M, N, K):
    ex = EmulatedExecutor(library, order="random", seed=M * N)
    A, B = int8s((M, K), seed=M + K), int8s((N, K), seed=N + K)
    for dtype in (None, torch.bfloat16, torch.float32):
        check_products(ex, A, B, stats(M, 5), stats(N, 6), None, dtype)


@pytest.mark.parametrize("out_dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bias_dtype", DTYPES + (None,), ids=str)
def test_bias_dtypes(library, out_dtype, bias_dtype):
    ex = EmulatedExecutor(library)
    A, B = int8s((6, 32), seed=1), int8s((10, 32), seed=2)
    bias = None if bias_dtype is None else (torch.randn(10, generator=gen(3)) * 10).to(bias_dtype)
    check_products(ex, A, B, stats(6, 4), stats(10, 5), bias, out_dtype)


PATH_SHAPES = [(1, 31), (1, 32), (3, 33), (3, 48), (20, 33), (20, 32), (40, 33), (40, 64)]  # (M, K), every path


@pytest.mark.parametrize("out_dtype", (torch.float16, torch.bfloat16), ids=str)
def test_float32_bias_on_every_path(library, out_dtype):
    """A float32 bias with a 16-bit output (the `_f32bias` kernels: bias added in float32, one
    rounding) on every product path, with and without the K % 16 fast loads."""
    ex = EmulatedExecutor(library, order="random", seed=7)
    N = 12
    bias = torch.randn(N, generator=gen(9)) * 10
    paths = set()
    for M, K in PATH_SHAPES:
        paths.add(int8_ops.matmul_path(M, K)[0])
        A, B = int8s((M, K), seed=M + K), int8s((N, K), seed=N + K)
        scaled = run("int8_scaled_mm", ex, A, B, stats(M, 4), stats(N, 5), bias, out_dtype)
        assert same_bits(scaled, ref.int8_scaled_mm(A, B, stats(M, 4), stats(N, 5), bias, out_dtype)), (M, K)
    assert len(paths) == len(PATH_SHAPES)  # the shapes do reach every path


def test_scaled_dequant_rounds_once(library):
    """bf16 / fp32 outputs are not routed through fp16 (CUDA's int8_mm_dequant does that)."""
    ex = EmulatedExecutor(library)
    acc = torch.tensor([[100000, -99999, 7, 1 << 26]], dtype=torch.int32)
    rs, cs = torch.tensor([3e6]), torch.tensor([1.0, 1.5, 1e-3, 2.0])
    out = run("int8_mm_dequant", ex, acc, rs, cs, torch.float32, None)
    assert same_bits(out, ref.int8_mm_dequant(acc, rs, cs, torch.float32))
    assert out[0, 0] > 65504  # would be inf through fp16


def test_batched_and_non_contiguous(library):
    ex = EmulatedExecutor(library, order="reverse")
    A = int8s((2, 3, 40), seed=1)
    Bt = int8s((40, 24), seed=2).t()  # non-contiguous B [24, 40] (as MatMul8bitLt's backward passes)
    rs, cs = stats(6, 3), stats(24, 4)
    out = run("int8_linear_matmul", ex, A, Bt)
    assert out.shape == (2, 3, 24) and torch.equal(out, ref.int8_linear_matmul(A, Bt.contiguous()))
    scaled = run("int8_scaled_mm", ex, A.transpose(0, 1), Bt, rs, cs, None, torch.bfloat16)
    want = ref.int8_scaled_mm(A.transpose(0, 1).contiguous(), Bt.contiguous(), rs, cs, None, torch.bfloat16)
    assert same_bits(scaled, want)
    X = activations((30, 20), torch.float16, seed=5, outliers=((4, 12.0),)).t()  # [20, 30] view
    check_vectorwise_quant(ex, X, 6.0)
    check_double_quant(ex, X, 6.0)
    q = int8s((40, 9), seed=6).t()
    assert same_bits(run("int8_vectorwise_dequant", ex, q, stats(9, 7)), ref.int8_vectorwise_dequant(q.contiguous(), stats(9, 7)))


def test_views_at_storage_offsets_and_strided_out(library):
    ex = EmulatedExecutor(library, order="random", seed=9)
    base_a, base_b = int8s((1, 3 + 5 * 64), seed=1), int8s((1, 1 + 12 * 64), seed=2)
    A = base_a.view(-1)[3:].view(5, 64)  # storage offsets that break 16-byte alignment
    B = base_b.view(-1)[1:].view(12, 64)
    out = torch.full((12, 5), 7, dtype=torch.int32).t()  # strided `out` of shape (5, 12)
    assert run("int8_linear_matmul.out", ex, A, B, out) is None
    assert torch.equal(out, ref.int8_linear_matmul(A, B))
    Afp = activations((1, 1 + 5 * 64), torch.float16, seed=3).view(-1)[1:].view(5, 64)
    check_vectorwise_quant(ex, Afp, 0.0)


def test_mixed_paths_and_index_forms(library):
    ex = EmulatedExecutor(library, order="reverse")
    for M in (1, 4, 20, 40):  # every product path
        A = activations((M, 48), torch.float16, seed=M, outliers=((5, 10.0), (47, -8.0)))
        CA, SCA, cols = run("int8_vectorwise_quant", ex, A, 6.0)
        CB, SCB, _ = ref.int8_vectorwise_quant(activations((24, 48), torch.float16, seed=99), 0.0)
        check_mixed(ex, A, CA, CB, SCA, SCB, cols)
        check_mixed(ex, A, CA, CB, SCA, SCB, cols.to(torch.int32))  # int32 indices
        check_mixed(ex, A, CA, CB, SCA, SCB, None, torch.randn(24, generator=gen(1)).half())
        check_mixed(ex, A, CA, CB, SCA, SCB, torch.empty(0, dtype=torch.int64))
    # torch-style negative indices count from the end
    out_neg, sub_neg = run("int8_mixed_scaled_mm", ex, A, CA, CB, SCA, SCB, torch.tensor([-1, 5]), None)
    out_pos, sub_pos = run("int8_mixed_scaled_mm", ex, A, CA, CB, SCA, SCB, torch.tensor([47, 5]), None)
    assert same_bits(out_neg, out_pos) and same_bits(sub_neg, sub_pos)


def test_empty_tensors_launch_nothing():
    for threshold in (0.0, 6.0):
        CA, rs, cols = run("int8_vectorwise_quant", NoLaunch(), torch.empty(0, 16, dtype=torch.float16), threshold)
        assert CA.shape == (0, 16) and rs.shape == (0,) and (cols is None if threshold == 0 else cols.shape == (0,))
        got = run("int8_double_quant", NoLaunch(), torch.empty(0, 16, dtype=torch.float16), threshold)
        assert got[1].shape == (0, 16) and got[3].shape == (16,)
    A, B = torch.empty(0, 8, dtype=torch.int8), torch.empty(5, 8, dtype=torch.int8)
    assert run("int8_linear_matmul", NoLaunch(), A, B).shape == (0, 5)
    assert run("int8_scaled_mm", NoLaunch(), A, B, torch.empty(0), torch.ones(5), None, None).shape == (0, 5)
    out = run("int8_linear_matmul", NoLaunch(), torch.empty(3, 0, dtype=torch.int8), torch.empty(4, 0, dtype=torch.int8))
    assert torch.equal(out, torch.zeros(3, 4, dtype=torch.int32))  # K = 0: an empty sum


def test_k_zero_scaled(library):
    out = run("int8_scaled_mm", EmulatedExecutor(library), torch.empty(3, 0, dtype=torch.int8),
              torch.empty(4, 0, dtype=torch.int8), stats(3, 1), stats(4, 2), torch.arange(4.0), torch.float32)  # fmt: skip
    assert torch.equal(out, torch.arange(4.0).expand(3, 4))


def test_launches_per_op(library):
    ex = EmulatedExecutor(library)
    A = activations((8, 40), torch.float16, seed=1, outliers=((2, 9.0),))
    run("int8_vectorwise_quant", ex, A, 0.0)
    run("int8_vectorwise_quant", ex, A, 6.0)
    run("int8_double_quant", ex, A, 0.0)
    run("int8_double_quant", ex, A, 6.0)
    A8, B8 = int8s((8, 40), 1), int8s((16, 40), 2)
    run("int8_scaled_mm", ex, A8, B8, stats(8, 1), stats(16, 2), None, None)
    run("int8_mixed_scaled_mm", ex, A, A8, B8, stats(8, 1), stats(16, 2), torch.tensor([2]), None)
    assert ex.launches == [
        "bnb_int8_vectorwise_quant_f16",
        "bnb_int8_vectorwise_quant_outliers_f16", "bnb_int8_outlier_finish",
        "bnb_int8_double_quant_stats_f16", "bnb_int8_double_quant_apply_f16",
        "bnb_int8_double_quant_stats_outliers_f16", "bnb_int8_double_quant_apply_outliers_f16",
        "bnb_int8_outlier_finish",
        "bnb_int8_scaled_mm_f16_gemv4", "bnb_int8_scaled_mm_f16_gemv4",
    ]  # fmt: skip


# -- the op layer reads the device once, only for the outlier count ----------------------------------


@pytest.mark.parametrize(("name", "args", "reads"), [
    ("int8_vectorwise_quant", lambda: (torch.empty(17, 33, dtype=torch.float16), 2.0), 1),
    ("int8_vectorwise_quant", lambda: (torch.empty(17, 33, dtype=torch.float16), 0.0), 0),
    ("int8_double_quant", lambda: (torch.empty(5, 64, dtype=torch.bfloat16), 6.0), 1),
    ("int8_double_quant", lambda: (torch.empty(5, 64, dtype=torch.bfloat16), 0.0), 0),
    ("int8_mixed_scaled_mm", lambda: (torch.empty(6, 32, dtype=torch.float16), torch.empty(6, 32, dtype=torch.int8),
                                      torch.empty(10, 32, dtype=torch.int8), torch.empty(6), torch.empty(10),
                                      torch.empty(3, dtype=torch.int64), None), 0),
])  # fmt: skip
def test_host_reads_under_fake_tensors(name, args, reads):
    """Under FakeTensorMode a host read of device data becomes a fresh unbacked symbol: count them."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from bnb_mps.testing import RecordingExecutor

    env = ShapeEnv()
    with FakeTensorMode(shape_env=env):
        inputs = args()
        recorder = RecordingExecutor()
        before = env.unbacked_symint_counter
        result = call(OPS[name], inputs, {}, recorder)
        assert env.unbacked_symint_counter - before == reads
    assert recorder.launched
    if name == "int8_mixed_scaled_mm":
        out, subA = result
        assert out.shape == (6, 10) and subA.shape == (6, 3) and subA.dtype == torch.float16
    elif reads:
        assert result[-1].dtype == torch.int64 and result[-1].dim() == 1


# -- the shared op inputs (tests/op_inputs.py) --------------------------------------------------------

INT8_CASES = [(n, label) for n in sorted(OPS) if n.startswith("int8_") for label, _ in op_inputs.cases(n)]


@pytest.mark.parametrize(("name", "label"), INT8_CASES, ids=[f"{n}-{lb}" for n, lb in INT8_CASES])
def test_op_inputs_against_reference(library, name, label):
    args = copy.deepcopy(dict(op_inputs.cases(name))[label])
    ex = EmulatedExecutor(library, order="random", seed=len(label))
    if name == "int8_vectorwise_quant":
        check_vectorwise_quant(ex, *args)
    elif name == "int8_double_quant":
        check_double_quant(ex, *args)
    elif name == "int8_vectorwise_dequant":
        assert same_bits(run(name, ex, *args), ref.int8_vectorwise_dequant(*args))
    elif name == "int8_linear_matmul":
        assert torch.equal(run(name, ex, *args), ref.int8_linear_matmul(*args))
    elif name == "int8_linear_matmul.out":
        *inputs, out = args
        assert run(name, ex, *args) is None and torch.equal(out, ref.int8_linear_matmul(*inputs))
    elif name == "int8_mm_dequant":
        assert same_bits(run(name, ex, *args), ref.int8_mm_dequant(*args))
    elif name == "int8_scaled_mm":
        assert same_bits(run(name, ex, *args), ref.int8_scaled_mm(*args))
    else:
        assert name == "int8_mixed_scaled_mm"
        check_mixed(ex, *args)


# -- random inputs ----------------------------------------------------------------------------------


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    M=st.integers(1, 70), N=st.integers(1, 70), K=st.integers(1, 90),
    dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**16),
)  # fmt: skip
def test_random_products(library, M, N, K, dtype, seed):
    ex = EmulatedExecutor(library, order="random", seed=seed)
    A, B = int8s((M, K), seed), int8s((N, K), seed + 1)
    check_products(ex, A, B, stats(M, seed + 2), stats(N, seed + 3), torch.randn(N, generator=gen(seed)).to(dtype), dtype)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    rows=st.integers(1, 12), cols=st.integers(1, 300), dtype=st.sampled_from(DTYPES),
    threshold=st.sampled_from((0.0, 1.0, 3.0, 6.0)), scale=st.sampled_from((0.5, 2.0, 1000.0)),
    seed=st.integers(0, 2**16),
)  # fmt: skip
def test_random_quant(library, rows, cols, dtype, threshold, scale, seed):
    ex = EmulatedExecutor(library, order="random", seed=seed)
    A = activations((rows, cols), dtype, seed, scale=scale)
    check_vectorwise_quant(ex, A, threshold)
    check_double_quant(ex, A, threshold)


def test_quant_matches_stock_bitsandbytes_on_finite_data(library):
    """An independent cross-check: bitsandbytes' own (pure PyTorch) int8_vectorwise_quant gives the
    kernels' codes on ordinary fp16 data, outliers included: it scales by torch's `127.0 / t`, which is
    fl32(fl32(1 / max) * 127), the scale of docs/semantics.md section 6."""
    from bitsandbytes.backends.default import ops as default_ops  # noqa: F401  (registers "default")

    ex = EmulatedExecutor(library)
    A = activations((64, 96), torch.float16, seed=21, outliers=((7, 11.0), (100, -6.5), (400, 6.0)))
    got = run("int8_vectorwise_quant", ex, A, 6.0)
    want = torch.ops.bitsandbytes.int8_vectorwise_quant.default(A.clone(), 6.0)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert torch.equal(g, w)


# -- Apple float semantics: float32 subnormals (docs/semantics.md section 7) ----------------------------------

TINY = 2.0**-126  # the smallest normal float32


def with_subnormals(rows: int, cols: int, dtype, seed: int) -> torch.Tensor:
    """Activations with a row of zeros and subnormals, a column of them, subnormal elements in
    ordinary rows, a row of tiny normal values with subnormals among them, and outliers."""
    r = gen(seed)
    sub = lambda *shape: (torch.rand(*shape, generator=r) - 0.5) * 2 * TINY  # noqa: E731
    A = torch.randn(rows, cols, generator=r) * 1.5
    A[1] = sub(cols)
    A[1, ::5] = 0.0
    A[:, 2] = sub(rows)
    A[3, ::3] = sub(A[3, ::3].numel())
    A[4] = torch.randn(cols, generator=r) * TINY * 4
    A[0, 5], A[5, 7] = 9.0, -8.0  # outliers at threshold 6
    return A.to(dtype)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
def test_subnormal_activations_quantize_as_zeros(library, dtype):
    """float32 / bfloat16 elements below 2^-126 count as zero: a row (column) of zeros and
    subnormals has statistic 0 and codes 0, a subnormal element gets code 0 and is never an
    outlier; the tiny normal row quantizes as usual. Also under random lane orders with race
    checking."""
    A = with_subnormals(7, 40, dtype, seed=1)
    for order in ("forward", "random"):
        ex = EmulatedExecutor(library, float_mode="apple", order=order, race_check=order == "random", seed=2)
        for threshold in (0.0, 6.0):
            CA, row_stats, _ = check_vectorwise_quant(ex, A, threshold)
            assert row_stats[1] == 0 and not CA[1].any()
            assert row_stats[4] > 0 and CA[4].abs().max() == 127
            got = check_double_quant(ex, A, threshold)
            assert got[3][2] == 0 and not got[1][:, 2].any()  # the subnormal column: stat 0, codes 0
    # The IEEE reference differs here (subnormal maxima): the case is exercised.
    assert ref.int8_vectorwise_quant(A, 0.0, flush=False)[1][1] > 0
    # A float16 input has no float32 subnormal: its subnormals (2^-24 and up) are ordinary values.
    h = (torch.rand(3, 64, generator=gen(3)) * 6e-5).half()
    CA, row_stats, _ = check_vectorwise_quant(EmulatedExecutor(library, float_mode="apple"), h, 0.0)
    assert (row_stats > 0).all() and (CA.abs().amax(1) == 127).all()


@pytest.mark.parametrize("M", (1, 3, 20, 40), ids=lambda m: int8_ops.matmul_path(m, 48)[0])
def test_dequantized_outputs_below_2_to_126_flush(library, M):
    """int8_vectorwise_dequant, int8_mm_dequant and int8_scaled_mm (every product path) with
    statistics near 2^-60, so that float32 products and results fall below 2^-126, and subnormal
    float32 / bfloat16 biases: zeros (of their sign) in the "apple" float mode, as the flushed
    reference has them, IEEE's subnormals in the "ieee" mode; float16 outputs are the same in
    both."""
    N, K = 24, 48
    A8, B8 = int8s((M, K), seed=M), int8s((N, K), seed=M + 1)
    rs = torch.rand(M, generator=gen(M + 2)) * 2.0**-60 + 2.0**-62
    cs = torch.rand(N, generator=gen(M + 3)) * 2.0**-60 + 2.0**-62
    apple, ieee = EmulatedExecutor(library, float_mode="apple"), EmulatedExecutor(library, float_mode="ieee")
    tiny_stats = rs * 2.0**-64  # codes * stats near 2^-120, times 1/127
    got = run("int8_vectorwise_dequant", apple, A8, tiny_stats)
    assert same_bits(got, ref.int8_vectorwise_dequant(A8, tiny_stats))
    got_ieee = run("int8_vectorwise_dequant", ieee, A8, tiny_stats)
    assert same_bits(got_ieee, ref.int8_vectorwise_dequant(A8, tiny_stats, flush=False))
    differ = int((got != got_ieee).sum())
    acc = ref.int8_linear_matmul(A8, B8)
    for dtype in DTYPES:
        for bias in (None, (torch.rand(N, generator=gen(M + 4)) - 0.5).mul(2 * TINY).to(dtype) if dtype != torch.float16
                     else torch.randn(N, generator=gen(M + 4)).mul(1e-5).half()):  # fmt: skip
            for flush, ex in ((True, apple), (False, ieee)):
                deq = run("int8_mm_dequant", ex, acc, rs, cs, dtype, bias)
                assert same_bits(deq, ref.int8_mm_dequant(acc, rs, cs, dtype, bias, flush=flush)), (dtype, flush)
                scaled = run("int8_scaled_mm", ex, A8, B8, rs, cs, bias, dtype)
                assert same_bits(scaled, ref.int8_scaled_mm(A8, B8, rs, cs, bias, dtype, flush=flush)), (dtype, flush)
                if flush:
                    apple_out = scaled
            if dtype == torch.float16:
                assert same_bits(apple_out, scaled)  # float16 outputs: the same in both modes
            else:
                differ += int((apple_out != scaled).sum())
    assert differ > 0  # subnormal results arise, and the two modes differ on them


def test_mixed_product_with_subnormal_activations(library):
    """int8_mixed_scaled_mm: subA copies A's elements as they are (subnormals included), and the
    outlier part counts the float32 / bfloat16 subnormal activations as zero (within the float32
    allowance of the flushed reference)."""
    ex = EmulatedExecutor(library, float_mode="apple", order="reverse")
    for dtype in (torch.float32, torch.bfloat16):
        for M in (1, 4, 20, 40):
            A = with_subnormals(max(M, 6), 48, dtype, seed=M)[:M].contiguous()
            A[0, 9] = 7.5  # an outlier column in every case, subnormals below the outlier
            A[1:, 9] = ((torch.rand(M - 1, generator=gen(M)) - 0.5) * 2 * TINY).to(dtype)
            CA, SCA, cols = run("int8_vectorwise_quant", ex, A, 6.0)
            CB, SCB, _ = ref.int8_vectorwise_quant(activations((24, 48), dtype, seed=M + 9), 0.0)
            out = check_mixed(ex, A, CA, CB, SCA, SCB, cols, None)
            assert torch.isfinite(out).all()
