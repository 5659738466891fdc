"""bitsandbytes' own 4-bit matmul API (Linear4bit, bnb.matmul_4bit, F.gemv_4bit) running bnb_mps'
GEMV / GEMM kernels under the emulator, against the float64 reference of docs/semantics.md section 4.

Inside `use_emulated_kernels()` the emulated tier serves the `cpu` dispatch key. Weights are
quantized by the kernels too; the reference re-derives the packed weight and its scales from
docs/semantics.md (tests/spec_reference.py) and checks them first, so every expected value is independent of
the code under test.
"""

from __future__ import annotations

import bitsandbytes as bnb
import bitsandbytes.functional as F
import numpy as np
import pytest
import torch

import reference_matmul_4bit as R
import spec_reference as ref
from bnb_mps.testing import use_emulated_kernels

pytest.importorskip("bnb_mps._emu")

CODE8 = F.create_dynamic_map(signed=True)
DT = {torch.float16: "f16", torch.bfloat16: "bf16", torch.float32: "f32"}
MATMUL_PREFIXES = ("bnb_gemv_4bit", "bnb_gemm_4bit")


def rand(*shape, dtype=torch.float32, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


def matmul_launches(kernels) -> list[str]:
    return [k for k in kernels.launched if k.startswith(MATMUL_PREFIXES)]


def reference_weight(W: torch.Tensor, packed, quant_state, quant_type, blocksize, nested) -> np.ndarray:
    """dequant(W) from docs/semantics.md, after checking that the kernels quantized W exactly as docs/semantics.md says."""
    want_packed, want_absmax = ref.quantize_4bit(W, blocksize, quant_type)
    assert torch.equal(packed.reshape(-1).view(torch.uint8), want_packed.reshape(-1))
    shape = tuple(W.shape)
    if not nested:
        assert torch.equal(quant_state.absmax, want_absmax)
        return R.dequantized_weight(want_packed, shape, blocksize, quant_type, want_absmax)
    q8, nested_absmax, offset = ref.double_quantize(want_absmax, CODE8)
    assert torch.equal(quant_state.absmax, q8) and torch.equal(quant_state.state2.absmax, nested_absmax)
    return R.dequantized_weight(want_packed, shape, blocksize, quant_type, nested_absmax, q8, CODE8, offset)


def make_layer(K, N, dtype, quant_type, nested, quant_storage=torch.uint8, seed=0):
    torch.manual_seed(seed)
    layer = bnb.nn.Linear4bit(K, N, bias=True, compute_dtype=dtype, quant_type=quant_type,
                              compress_statistics=nested, quant_storage=quant_storage)  # fmt: skip
    # Keep bitsandbytes' portable path on CPUs with AVX512-BF16 (it would repack the weight into its
    # own CPU layout at the first eval forward; mps has no such path).
    layer.support_avx512bf16_for_cpu = False
    with torch.no_grad():
        layer.bias.copy_(rand(N, seed=seed + 1, scale=0.5))
    W = layer.weight.data.clone()
    return layer, W


@pytest.mark.parametrize("nested", [False, True], ids=["absmax", "nested"])
@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_linear4bit_forward_every_path(dtype, quant_type, nested):
    K, N = 96, 40
    layer, W = make_layer(K, N, dtype, quant_type, nested, seed=3)
    with use_emulated_kernels() as kernels:
        layer = layer.to("cpu")  # Params4bit quantizes on the move
        Wq = reference_weight(W, layer.weight.data, layer.weight.quant_state, quant_type, 64, nested)
        bias = layer.bias.data.to(dtype)
        layer.eval()
        for seq, path in ((1, "gemv_4bit"), (3, "gemm_4bit_small"), (20, "gemm_4bit_mma")):
            x = rand(2 if seq > 1 else 1, seq, K, dtype=dtype, seed=seq)
            kernels.launches.clear()
            with torch.no_grad():
                y = layer(x)
            sc = "nested" if nested else "absmax"
            want = f"bnb_{path}_{sc}_{DT[dtype]}" if x.shape[0] * seq > 1 else f"bnb_gemv_4bit_{sc}_{DT[dtype]}"
            assert matmul_launches(kernels) == [want]
            assert not any(k.startswith("bnb_dequantize") for k in kernels.launched)  # nothing dequantized
            assert y.shape == (*x.shape[:-1], N) and y.dtype == dtype
            R.check_accuracy(y.reshape(-1, N), x.reshape(-1, K), Wq, bias)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_linear4bit_training_step(dtype):
    """Forward (gemm_4bit) and backward (dequantize_4bit + matmul) through MatMul4Bit, then an SGD
    step on the bias; input gradient and bias update against float64."""
    K, N = 80, 48
    layer, W = make_layer(K, N, dtype, "nf4", nested=True, quant_storage=torch.bfloat16, seed=5)
    with use_emulated_kernels(order="random", race_check=True, poison=0x00) as kernels:
        layer = layer.to("cpu")
        Wq = reference_weight(W, layer.weight.data, layer.weight.quant_state, "nf4", 64, True)
        layer.train()
        bias0 = layer.bias.data.to(dtype).clone()
        x = rand(2, 7, K, dtype=dtype, seed=6).requires_grad_(True)
        g = rand(2, 7, N, dtype=dtype, seed=7)
        kernels.launches.clear()
        y = layer(x)
        forward = list(kernels.launched)
        (y * g).sum().backward()
        backward = kernels.launched[len(forward):]
        opt = torch.optim.SGD([layer.bias], lr=0.5)
        opt.step()
    assert forward == [f"bnb_gemm_4bit_small_nested_{DT[dtype]}"]  # (M = 14 rows)
    # (bitsandbytes dequantizes to the weight's original dtype, float32 here, then casts)
    assert "bnb_dequantize_4bit_nf4_f32" in backward and not matmul_launches(kernels)[1:]
    R.check_accuracy(y.detach().reshape(-1, N), x.detach().reshape(-1, K), Wq, bias0)

    # dL/dx = g @ W: bitsandbytes multiplies in the compute dtype with W dequantized to it, so the
    # bound is that of a sum in T: one unit roundoff of T per term's magnitude plus the final rounding.
    g64 = R.as_f64(g.reshape(-1, N))
    want = g64 @ Wq.astype(np.float64)
    S = np.abs(g64) @ np.abs(Wq.astype(np.float64))
    eps = torch.finfo(dtype).eps
    err = np.abs(R.as_f64(x.grad.reshape(-1, K)) - want)
    assert (err <= eps * S + R.ulp(want, dtype)).all(), err.max()
    bias_grad = g64.sum(axis=0)
    assert np.allclose(R.as_f64(layer.bias.grad), bias_grad, rtol=2 * eps, atol=2 * eps * np.abs(g64).sum(0).max())


@pytest.mark.parametrize("M", [1, 5, 40])
@pytest.mark.parametrize("nested", [False, True], ids=["absmax", "nested"])
def test_matmul_4bit_api(M, nested):
    """bnb.matmul_4bit without grad (gemm_4bit directly) and with grad (MatMul4Bit)."""
    K, N = 128, 24
    W = rand(N, K, seed=M, scale=0.3)
    dtype = torch.bfloat16
    with use_emulated_kernels() as kernels:
        packed, state = F.quantize_4bit(W, blocksize=32, quant_type="fp4", compress_statistics=nested)
        Wq = reference_weight(W, packed, state, "fp4", 32, nested)
        A = rand(M, K, dtype=dtype, seed=M + 1)
        kernels.launches.clear()
        with torch.no_grad():
            y = bnb.matmul_4bit(A, packed.t(), state)
        y_grad = bnb.matmul_4bit(A.clone().requires_grad_(True), packed.t(), state)
    assert len(matmul_launches(kernels)) == 2
    R.check_accuracy(y, A, Wq)
    assert torch.equal(y, y_grad.detach())


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
def test_functional_gemv_4bit(quant_type):
    """F.gemv_4bit passes the quant state's 16-entry code; nested scales are dequantized by
    bitsandbytes (dequantize_blockwise kernel) first."""
    K, N = 256, 64
    W = rand(N, K, seed=11, scale=0.2)
    with use_emulated_kernels() as kernels:
        packed, state = F.quantize_4bit(W, blocksize=64, quant_type=quant_type, compress_statistics=True)
        Wq = reference_weight(W, packed, state, quant_type, 64, True)
        A = rand(1, 1, K, dtype=torch.float16, seed=12)
        kernels.launches.clear()
        y = F.gemv_4bit(A, packed.t(), state=state)
        out = torch.empty(1, 1, N, dtype=torch.float16)
        F.gemv_4bit(A, packed.t(), out=out, state=state)
    assert matmul_launches(kernels) == ["bnb_gemv_4bit_absmax_f16"] * 2
    assert "bnb_dequantize_blockwise_f32" in kernels.launched
    # bitsandbytes' own absmax dequantization (fl32(code * nested) + offset in torch) is docs/semantics.md's.
    R.check_accuracy(y.reshape(1, N), A.reshape(1, K), Wq)
    assert torch.equal(out, y)
