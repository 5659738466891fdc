"""tests/stock_cpu_paths.py's models of bitsandbytes' AVX-512 / AVX512-BF16 CPU kernels, compared with
the real kernels where this CPU takes those paths (skipped elsewhere, with the reason): so that the
models the fallback tests put in place on other CPUs keep modelling what bitsandbytes does."""

from __future__ import annotations

import copy

import pytest
import torch

import op_inputs
import stock_cpu_paths

MISSING = stock_cpu_paths.missing_paths()


def needs(schema: str):
    return pytest.mark.skipif(schema in MISSING, reason=MISSING.get(schema, ""))


def real(name: str):
    """bitsandbytes' own CPU kernel of `name` (what a CPU tensor reaches without bnb_mps' emulated tier)."""
    return getattr(torch.ops.bitsandbytes, name).default


@needs("dequantize_4bit")
@pytest.mark.parametrize("shape,blocksize,quant_type", [
    ((6, 96), 64, "nf4"),  # rows of 96 in blocks of 64: the vectorised path's per-row scales (misread)
    ((6, 96), 32, "fp4"),  # whole blocks per row: the vectorised path, right
    ((8, 48), 16, "nf4"),
    ((5, 40), 64, "nf4"),  # rows not a multiple of 16: the scalar path, flat blocks
    ((3, 4096), 4096, "fp4"),  # blocksize 4096: bitsandbytes' PyTorch path
    ((1001,), 128, "nf4"),  # an odd length: the PyTorch path
], ids=str)  # fmt: skip
def test_the_dequantize_4bit_model_is_bitsandbytes_avx512_kernel(shape, blocksize, quant_type):
    packed, absmax = op_inputs.quantized_4bit(shape, blocksize, quant_type)
    # (one output dtype on the PyTorch path, whose torch.compile'd function compiles once per dtype)
    dtypes = (torch.float32,) if blocksize >= 2048 or shape[-1] % 2 else (torch.float32, torch.bfloat16, torch.float16)
    for dtype in dtypes:
        want = real("dequantize_4bit")(packed, absmax, blocksize, quant_type, list(shape), dtype)
        got = stock_cpu_paths.dequantize_4bit_avx512(packed, absmax, blocksize, quant_type, list(shape), dtype)
        assert got.shape == want.shape and torch.equal(got, want), (dtype, (got - want).abs().max())


@needs("gemv_4bit")
@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("layout", ["bitsandbytes' CPU layout", "the standard layout"])
def test_the_gemv_4bit_model_is_bitsandbytes_avx512bf16_kernel(quant_type, layout):
    """Up to the order of the float32 sums (the model: per block, then over blocks): at most one
    rounding of the output apart, here none, in either weight layout."""
    from bitsandbytes.functional import _convert_weight_packed_for_cpu, quantize_4bit

    N, K, bs = 64, 256, 64
    W = op_inputs.randn(N, K, seed=11)
    packed, state = quantize_4bit(W, blocksize=bs, quant_type=quant_type, compress_statistics=False)
    if layout == "bitsandbytes' CPU layout":
        packed, cpu_state = _convert_weight_packed_for_cpu(packed.clone(), copy.deepcopy(state))
        absmax = cpu_state.absmax
    else:
        absmax = state.absmax
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        A = op_inputs.randn(3, K, dtype=dtype, seed=12)
        want = real("gemv_4bit")(A, packed, [N, K], absmax, state.code, bs)
        got = stock_cpu_paths.gemv_4bit_avx512bf16(A, packed, [N, K], absmax, state.code, bs)
        assert got.dtype == want.dtype == dtype and got.shape == want.shape
        spacing = torch.finfo(torch.bfloat16).eps * want.float().abs().clamp_min(1e-30)
        assert ((got.float() - want.float()).abs() <= spacing).all(), dtype
        assert (got == want).float().mean() >= 0.95, dtype


@needs("int8_linear_matmul")
def test_the_int8_linear_matmul_model_is_bitsandbytes_avx512_path():
    """torch._int_mm on both sides: exact, also where a float32 sum would not be (rows of 127, K = 1088)."""
    g = torch.Generator().manual_seed(13)
    A = torch.randint(-127, 128, (5, 1088), generator=g, dtype=torch.int8)
    B = torch.randint(-127, 128, (24, 1088), generator=g, dtype=torch.int8)
    A[0], B[0] = 127, 127
    want = real("int8_linear_matmul")(A, B)
    assert int(want[0, 0]) == 127 * 127 * 1088  # (exact: above 2^24)
    assert torch.equal(stock_cpu_paths.int8_linear_matmul_avx512(A, B), want)


def test_every_model_is_compared_or_skipped_with_its_reason():
    assert set(stock_cpu_paths.MODELS) == {"gemv_4bit", "dequantize_4bit", "int8_linear_matmul"}
    assert set(MISSING) <= set(stock_cpu_paths.MODELS) and all(MISSING.values())
    print("modelled paths this CPU takes:", sorted(set(stock_cpu_paths.MODELS) - set(MISSING)) or "none")
