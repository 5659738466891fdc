"""Apple GPU float semantics (docs/semantics.md, "Apple GPUs") through bitsandbytes' own API, with
bnb-mps' kernels under the emulator in its default "apple" float mode (float32 subnormal inputs and
results flush to zero, as on the hardware).

- Blocks whose absmax lies above 2^126 (1 / absmax is a float32 subnormal, which the GPU flushes)
  quantize to exactly the codes and absmax of the IEEE reference (what CUDA computes), up to the
  float32 maximum, FP4's sign of tiny values included.
- Blocks of tiny normal magnitudes quantize as IEEE does.
- Blocks of zeros and float32 subnormals quantize like an all-zero block (absmax 0, every code 0);
  fp16 subnormals are kept and quantize as IEEE does.
- Int8: rows of subnormals are zero rows. 8-bit optimizer states above 2^126 re-quantize exactly.
- 4-bit products (bnb.matmul_4bit: gemv, batch and mma kernels) of weights with blocks above 2^126,
  plain and double-quantized, with float32 / bfloat16 subnormal activations, which count as zero.
The IEEE references are the reference modules with flush=False; the Apple ones with flush=True
(their default).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import spec_reference as ref
from mps_families import assert_same_bits

F = pytest.importorskip("bitsandbytes.functional")
pytest.importorskip("bnb_mps.emulator")

from bnb_mps.testing import use_emulated_kernels  # noqa: E402

TINY = float(torch.finfo(torch.float32).tiny)  # 2^-126
FMAX = float(torch.finfo(torch.float32).max)


def huge_blocks(n_blocks: int, blocksize: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Blocks whose absmax lies in (2^126, the dtype's maximum]: one huge element per block; half
    of the others uniform in (-absmax, absmax) (ordinary scaled values), half spread over every
    magnitude from 2^-120 up, both signs, so that some scaled values are float32 subnormals (tiny
    elements: the FP4 sign case)."""
    g = torch.Generator().manual_seed(seed)
    n = n_blocks * blocksize
    info = torch.finfo(dtype)
    top = float(info.max)
    absmaxes = [1.5 * 2.0**126, 2.0**126 * (1 + float(info.eps)), 1e38, 2.0**127, 3e38, top]
    sign = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0).double()
    spread = (1 + torch.rand(n, generator=g, dtype=torch.float64)) * 2.0 ** torch.randint(-120, 126, (n,), generator=g)
    x = torch.where(torch.rand(n, generator=g) < 0.5, torch.rand(n, generator=g, dtype=torch.float64), spread / top)
    x = (sign * x).reshape(n_blocks, blocksize)
    for b in range(n_blocks):
        a = absmaxes[b % len(absmaxes)]
        x[b] *= a
        x[b, (7 * b + 1) % blocksize] = -a if b % 3 == 0 else a
    out = x.reshape(-1).to(dtype)
    assert out.float().abs().reshape(n_blocks, blocksize).amax(1).min() > 2.0**126
    assert not torch.isinf(out).any()
    return out


def tiny_blocks(n_blocks: int, blocksize: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Normal float32 magnitudes between 2^-126 and 2^-90 (reciprocals near the float32 maximum)."""
    g = torch.Generator().manual_seed(seed)
    exponents = torch.randint(-126, -90, (n_blocks * blocksize,), generator=g).double()
    mant = 1 + torch.rand(n_blocks * blocksize, generator=g, dtype=torch.float64)
    sign = torch.where(torch.rand(n_blocks * blocksize, generator=g) < 0.5, -1.0, 1.0).double()
    out = (sign * mant * 2.0**exponents).to(dtype)
    assert (out.float().abs() >= TINY).all()
    return out


def subnormal_blocks(n_blocks: int, blocksize: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Zeros and subnormals of `dtype` (float32 subnormals for bfloat16 and float32)."""
    g = torch.Generator().manual_seed(seed)
    tiny = float(torch.finfo(dtype).tiny)
    x = (torch.rand(n_blocks * blocksize, generator=g, dtype=torch.float64) * 2 - 1) * tiny * 0.99
    x[:: 5] = 0
    out = x.to(dtype)
    assert (out.abs() < tiny).all() and (out != 0).sum() > blocksize
    return out


def quantize_8bit(A, blocksize):
    with use_emulated_kernels() as kernels:
        q, state = F.quantize_blockwise(A, blocksize=blocksize)
        out = F.dequantize_blockwise(q, state)
    assert any(k.startswith("bnb_quantize_blockwise") for k in kernels.launched)
    return q, state.absmax, out


def quantize_4bit(A, blocksize, quant_type):
    with use_emulated_kernels() as kernels:
        packed, state = F.quantize_4bit(A, blocksize=blocksize, quant_type=quant_type)
        out = F.dequantize_4bit(packed, state)
    assert any(k.startswith("bnb_quantize_4bit") for k in kernels.launched)
    return packed, state.absmax, out


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
@pytest.mark.parametrize("blocksize", (64, 256, 4096))
def test_huge_blocks_8bit_equal_ieee(dtype, blocksize):
    A = huge_blocks(6, blocksize, dtype, seed=blocksize)
    q, absmax, out = quantize_8bit(A, blocksize)
    code = F.create_dynamic_map(signed=True)
    rq, rabsmax = ref.quantize_blockwise(A, code, blocksize, flush=False)
    assert_same_bits((q, absmax), (rq, rabsmax), "codes and absmax")
    # Every code is used that IEEE uses: the block is spread over the code book, not collapsed to
    # the zero code (what a flushed reciprocal would give).
    assert len(torch.unique(q)) > 40
    assert_same_bits(out, ref.dequantize_blockwise(rq, rabsmax, code, blocksize, dtype, flush=True), "dequantized")


@pytest.mark.parametrize("quant_type", ("nf4", "fp4"))
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
@pytest.mark.parametrize("blocksize", (32, 64, 512))
def test_huge_blocks_4bit_equal_ieee(quant_type, dtype, blocksize):
    A = huge_blocks(6, blocksize, dtype, seed=blocksize + 1)
    packed, absmax, out = quantize_4bit(A, blocksize, quant_type)
    rpacked, rabsmax = ref.quantize_4bit(A, blocksize, quant_type, flush=False)
    assert_same_bits((packed, absmax), (rpacked, rabsmax), "packed and absmax")
    assert_same_bits(out, ref.dequantize_4bit(rpacked, rabsmax, blocksize, quant_type, A.shape, dtype, flush=True),
                     "dequantized")  # fmt: skip
    if quant_type == "fp4":
        # The case that needs the IEEE sign: negative elements whose scaled value is a non-zero
        # float32 subnormal (flushed to -0.0 on the GPU) carry FP4's sign bit, as on CUDA.
        x = A.float().numpy().astype(np.float64).reshape(-1, blocksize)
        s = x / rabsmax.numpy().astype(np.float64)[:, None]
        assert ((s < -(2.0**-149)) & (s > -TINY)).any()


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
def test_tiny_blocks_equal_ieee(dtype):
    A = tiny_blocks(8, 64, dtype, seed=3)
    code = F.create_dynamic_map(signed=True)
    q, absmax, _ = quantize_8bit(A, 64)
    assert_same_bits((q, absmax), ref.quantize_blockwise(A, code, 64, flush=False), "8-bit")
    for qt in ("nf4", "fp4"):
        packed, absmax4, _ = quantize_4bit(A, 64, qt)
        assert_same_bits((packed, absmax4), ref.quantize_4bit(A, 64, qt, flush=False), qt)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
def test_all_subnormal_blocks_quantize_like_all_zero_blocks(dtype):
    A = subnormal_blocks(4, 64, dtype, seed=5)
    q, absmax, out = quantize_8bit(A, 64)
    assert torch.equal(q, torch.zeros_like(q)) and torch.equal(absmax, torch.zeros_like(absmax))
    assert (out == 0).all()
    for qt in ("nf4", "fp4"):
        packed, absmax4, out4 = quantize_4bit(A, 64, qt)
        assert torch.equal(packed, torch.zeros_like(packed)) and torch.equal(absmax4, torch.zeros_like(absmax4))
        assert (out4 == 0).all()
    # The same as zeros, in bitsandbytes' own words (the reference of an all-zero input).
    zeros = torch.zeros_like(A)
    assert_same_bits((q, absmax), ref.quantize_blockwise(zeros, F.create_dynamic_map(signed=True), 64, flush=False))


def test_subnormal_elements_of_a_normal_block_count_as_zero():
    A = torch.randn(256, generator=torch.Generator().manual_seed(9))
    A[3::7] = torch.tensor([1e-39, -3e-40, 1e-45, -1e-45]).repeat(10)[: A[3::7].numel()]
    code = F.create_dynamic_map(signed=True)
    q, absmax, _ = quantize_8bit(A, 64)
    assert_same_bits((q, absmax), ref.quantize_blockwise(A, code, 64, flush=True))
    assert_same_bits((q, absmax), ref.quantize_blockwise(torch.where(A.abs() < TINY, 0.0 * A, A), code, 64, flush=False))
    packed, absmax4, _ = quantize_4bit(A, 64, "fp4")
    assert_same_bits((packed, absmax4), ref.quantize_4bit(A, 64, "fp4", flush=True))


def test_fp16_subnormals_are_kept():
    A = (torch.rand(256, generator=torch.Generator().manual_seed(2)) * 2 - 1) * 6e-5  # mostly fp16 subnormals
    A = A.half()
    assert (A.abs() < torch.finfo(torch.float16).tiny).float().mean() > 0.5
    q, absmax, _ = quantize_8bit(A, 64)
    assert_same_bits((q, absmax), ref.quantize_blockwise(A, F.create_dynamic_map(signed=True), 64, flush=False))
    assert (absmax > 0).all()
    packed, absmax4, out = quantize_4bit(A, 64, "nf4")
    assert_same_bits((packed, absmax4), ref.quantize_4bit(A, 64, "nf4", flush=False))
    assert_same_bits(out, ref.dequantize_4bit(packed, absmax4, 64, "nf4", A.shape, torch.float16, flush=False))


def test_dequantized_float32_subnormal_results_flush():
    """Codes quantized by IEEE arithmetic (e.g. on CUDA) from inputs that are float32 subnormals
    dequantize to products below 2^-126: 0 on the GPU (and here), kept by IEEE."""
    from bitsandbytes.functional import QuantState

    code = F.create_dynamic_map(signed=True)
    A = torch.full((64,), 2.0**-120)
    A[1::2] = 2.0**-120 * torch.logspace(-1, -7, 32) * torch.tensor([1.0, -1.0]).repeat(16)
    q, absmax = ref.quantize_blockwise(A, code, 64, flush=False)
    with use_emulated_kernels():
        out = F.dequantize_blockwise(q, QuantState(absmax=absmax, code=code, blocksize=64, dtype=torch.float32))
    want_apple = ref.dequantize_blockwise(q, absmax, code, 64, torch.float32, flush=True)
    want_ieee = ref.dequantize_blockwise(q, absmax, code, 64, torch.float32, flush=False)
    assert_same_bits(out, want_apple)
    assert ((want_ieee != 0) & (want_apple == 0)).sum() >= 8  # the case is exercised


def test_ieee_mode_gives_the_ieee_answer_on_huge_blocks_too():
    A = huge_blocks(4, 64, torch.float32, seed=11)
    with use_emulated_kernels(float_mode="ieee"):
        q, state = F.quantize_blockwise(A, blocksize=64)
        packed, state4 = F.quantize_4bit(A, blocksize=64, quant_type="fp4")
    assert_same_bits((q, state.absmax), ref.quantize_blockwise(A, F.create_dynamic_map(signed=True), 64, flush=False))
    assert_same_bits((packed, state4.absmax), ref.quantize_4bit(A, 64, "fp4", flush=False))


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
def test_int8_rows_of_subnormals_are_zero_rows(dtype):
    """Row and column maxima ignore float32 subnormals (an all-subnormal row has row_stats 0 and
    codes 0, like a zero row); a subnormal element's code is 0: the flushed reference, which is the
    IEEE reference of the input with its subnormals replaced by zeros."""
    import reference_int8 as R8

    g = torch.Generator().manual_seed(4)
    A = torch.randn(6, 96, generator=g)
    A[1] = (torch.rand(96, generator=g) * 2 - 1) * TINY * 0.9  # all subnormal
    A[3, ::3] = 3e-39  # subnormal elements in an ordinary row
    A[4] = (torch.rand(96, generator=g) * 2 - 1) * TINY * 8  # tiny normal row with subnormals
    A = A.to(dtype)
    with use_emulated_kernels():
        got = F.int8_vectorwise_quant(A, threshold=0.0)
        got_double = torch.ops.bitsandbytes.int8_double_quant(A, 6.0)
    want = R8.int8_vectorwise_quant(A, 0.0)
    assert_same_bits(got[:2], want[:2], "int8_vectorwise_quant")
    assert float(got[1][1]) == 0 and not got[0][1].any()
    want_double = R8.int8_double_quant(A, 6.0)
    assert_same_bits(got_double[:4], want_double[:4], "int8_double_quant")
    assert_same_bits(got_double[4], want_double[4], "outlier columns")
    flushed = torch.where(A.abs() < TINY, 0.0 * A, A)
    assert_same_bits(want[:2], R8.int8_vectorwise_quant(flushed, 0.0, flush=False)[:2])
    assert R8.int8_vectorwise_quant(A, 0.0, flush=False)[1][1] > 0  # IEEE: a subnormal statistic


def test_8bit_optimizer_state_above_2_to_126_requantizes_exactly():
    """A momentum state above 2^126 (the reciprocal of its block maximum is a float32 subnormal)
    re-quantizes to the IEEE reference's codes and absmax."""
    import optim_inputs as oi
    import reference_optim as R

    n = 1000
    g = torch.randn(n, generator=torch.Generator().manual_seed(8)) * 1e38
    g[::97] = 3.3e38  # every block's maximum above 2^126
    args = oi.args_8bit("momentum", n, torch.float32, step=1, weight_decay=0.0, gnorm_scale=1.0, g=g)
    want = R.optimizer_8bit(*oi.clone(args))
    assert (want.absmax1 > 2.0**126).all()
    got = oi.clone(args)
    with use_emulated_kernels():
        torch.ops.bitsandbytes.optimizer_update_8bit_blockwise(*got)
    dev = oi.compare_8bit(got, want, p_before=args[2])
    assert torch.equal(got[3], want.state1) and torch.equal(got[14], want.absmax1), dev


def test_8bit_adam_second_moment_above_2_to_126_requantizes_exactly():
    """Adam's second moment v = (1 - beta2) * g * g above 2^126 in every block (the unsigned state)
    re-quantizes to the reference's codes and absmax, as does the first moment; nothing there is a
    float32 subnormal, so the Apple and IEEE references agree."""
    import optim_inputs as oi
    import reference_optim as R

    n = 700
    g = torch.randn(n, generator=torch.Generator().manual_seed(12)) * 1e19
    g[::89] = 1.7e20  # (1 - 0.995) * g * g = 1.4e38 > 2^126, without overflowing g * g's float32 steps
    args = oi.args_8bit("adam", n, torch.float32, step=1, weight_decay=0.0, gnorm_scale=1.0, g=g)
    want = R.optimizer_8bit(*oi.clone(args))
    assert (want.absmax2 > 2.0**126).all() and torch.isfinite(want.absmax2).all()
    ieee = R.optimizer_8bit(*oi.clone(args), flush=False)
    assert torch.equal(want.state2, ieee.state2) and torch.equal(want.absmax2, ieee.absmax2)
    got = oi.clone(args)
    with use_emulated_kernels():
        torch.ops.bitsandbytes.optimizer_update_8bit_blockwise(*got)
    dev = oi.compare_8bit(got, want, p_before=args[2])
    assert torch.equal(got[4], want.state2) and torch.equal(got[15], want.absmax2), dev
    assert torch.equal(got[3], want.state1) and torch.equal(got[14], want.absmax1), dev
    assert len(torch.unique(got[4])) > 20  # spread over the code book, not collapsed to code 0


#: the kernels of each path of the 4-bit products, by the M that takes it here (K = 128)
PATH_KERNEL = {1: "bnb_gemv_4bit_", 5: "bnb_gemm_4bit_batch_", 40: "bnb_gemm_4bit_mma_"}


@pytest.mark.parametrize("nested", [False, True], ids=["absmax", "nested"])
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
def test_4bit_matmul_huge_blocks_and_subnormal_activations(dtype, nested):
    """bnb.matmul_4bit (gemv at M = 1, the batch kernel at M = 5, mma at M = 40) of a weight whose
    first block of every row (columns 0..63; of two rows with double quantization) has its absmax
    above 2^126, quantized by the kernels (checked against the IEEE reference quantizer), with and
    without double quantization of the block scales (whose nested block is then above 2^126 too).
    The activations in those columns are float32 / bfloat16 subnormals, which count as zero: the
    result is the flushed reference's, and (with plain scales, where the rest of the sum is of
    ordinary size) not the IEEE answer, in which those products add about 0.1 each."""
    import reference_matmul_4bit as R
    import bitsandbytes as bnb

    N, K, bs = 8, 128, 64
    W = torch.randn(N, K, generator=torch.Generator().manual_seed(13))
    rows = N if not nested else 2  # rows whose first block is huge
    # (double quantization's offset is the mean of the absmax vector, whose float32 sum overflows
    # beyond 3.4e38: with nested scales, two huge blocks, 1.5 * 2^126 and just above 2^126)
    # (up to the activations' maximum: the products take the weights in that dtype, docs/semantics.md section 4)
    W[:rows, : K // 2] = huge_blocks(rows, K // 2, dtype, seed=14).float().reshape(rows, K // 2)
    quant_type = "fp4" if nested else "nf4"
    code8 = F.create_dynamic_map(signed=True)
    with use_emulated_kernels() as kernels:
        packed, state = F.quantize_4bit(W, blocksize=bs, quant_type=quant_type, compress_statistics=nested)
        want_packed, want_absmax = ref.quantize_4bit(W, bs, quant_type, flush=False)
        assert torch.equal(packed.reshape(-1), want_packed.reshape(-1))
        if nested:
            q8, nested_absmax, offset = ref.double_quantize(want_absmax, code8)
            assert torch.equal(state.absmax, q8) and torch.equal(state.state2.absmax, nested_absmax)
            assert nested_absmax.max() > 2.0**126
            weight = (want_packed, (N, K), bs, quant_type, nested_absmax, q8, code8, offset)
        else:
            assert torch.equal(state.absmax, want_absmax)
            weight = (want_packed, (N, K), bs, quant_type, want_absmax)
        for M in (1, 5, 40):
            g = torch.Generator().manual_seed(M)
            A = torch.randn(M, K, generator=g)
            A[:, : K // 2] = (torch.rand(M, K // 2, generator=g) - 0.5) * 2 * TINY
            A = A.to(dtype)
            assert ((A[:, : K // 2].float().abs() < TINY) & (A[:, : K // 2] != 0)).float().mean() > 0.9
            kernels.launches.clear()
            with torch.no_grad():
                y = bnb.matmul_4bit(A, packed.t(), state)
            products = [k for k in kernels.launched if k.startswith(("bnb_gemv", "bnb_gemm"))]
            assert products and all(k.startswith(PATH_KERNEL[M]) for k in products), (M, products)
            assert torch.isfinite(y).all()
            R.check_accuracy(y, A, R.dequantized_weight(*weight))
            if not nested:
                with pytest.raises(AssertionError):
                    R.check_accuracy(y, A, R.dequantized_weight(*weight, flush=False), flush=False)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
def test_int8_rows_with_maxima_above_2_126_keep_their_codes(dtype):
    """An int8 row whose maximum lies above 2^126: 1 / max would be a float32 subnormal (0 on an Apple
    GPU), so the row scale is fl32(127 / max) there (docs/semantics.md section 6), and the row keeps
    its codes: the maximum at +-127, the rest spread, as reference_int8 (IEEE, no flush) gives."""
    import reference_int8 as R8

    A = huge_blocks(6, 64, dtype, seed=7).reshape(6, 64)
    with use_emulated_kernels():
        CA, stats, _ = torch.ops.bitsandbytes.int8_vectorwise_quant(A, 0.0)
        CA2, CAt, stats2, col_stats, _ = torch.ops.bitsandbytes.int8_double_quant(A, 0.0)
    want = R8.int8_vectorwise_quant(A, 0.0, flush=False)
    assert_same_bits((CA, stats), want[:2], "row codes and statistics")
    assert torch.equal(CA.abs().amax(1), torch.full((6,), 127, dtype=torch.int8))
    want_dq = R8.int8_double_quant(A, 0.0, flush=False)
    assert_same_bits((CA2, CAt, col_stats), (want[0], want_dq[1], want_dq[3]), "double quant")
