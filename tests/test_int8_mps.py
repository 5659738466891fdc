"""On Apple hardware: the LLM.int8() kernels on the native and shader tiers, at model sizes, against
tests/reference_int8.py (docs/semantics.md section 6), and bitsandbytes' Linear8bitLt on `mps` tensors
served by them. Skipped elsewhere.

Codes, statistics, outlier columns and int32 products must be bit-exact on the GPU. Dequantized
outputs are allowed what a GPU compiler may do to float32 maths beyond the emulator's IEEE order
(re-association, fused multiply-adds): one spacing of the output dtype plus a few float32
roundings of the magnitudes involved.
"""

from __future__ import annotations

import bitsandbytes as bnb
import pytest
import torch

import reference_int8 as ref
from bnb_mps import backend_info, executors, ops

pytestmark = pytest.mark.mps

TIERS = ["native", "shader"]


def run(executor, name, *args):
    return ops.call(ops.OPS[name], args, {}, executor)


def mps(*tensors):
    return [t.to("mps") if isinstance(t, torch.Tensor) else t for t in tensors]


def same(a, b):
    a, b = a.cpu(), b.cpu()
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)
    )


def gen(seed):
    return torch.Generator().manual_seed(seed)


def activations(shape, dtype, seed, outlier_features=()):
    x = torch.randn(*shape, generator=gen(seed)) * 1.5
    for i, f in enumerate(outlier_features):
        x[..., f] = 7.0 + 3 * i
    return x.to(dtype)


def close_to_dequant(got, want, acc, row_stats, col_stats, bias=None):
    """|got - want| <= one spacing of got's dtype + 8 float32 roundings of |acc * scales| + |bias|."""
    dtype = got.dtype
    got, want = got.cpu().double(), want.double()
    mag = acc.double().abs() * row_stats.double()[:, None] * col_stats.double()[None, :] / 16129
    if bias is not None:
        mag = mag + bias.double().abs()[None, :]
    return bool(((got - want).abs() <= ref.spacing(want, dtype) + 8 * 2.0**-24 * mag).all())


# -- ops --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ref.DTYPES, ids=str)
@pytest.mark.parametrize("threshold", [0.0, 6.0])
def test_quantization(executor, dtype, threshold):
    for shape in [(1, 4096), (512, 4096), (4, 8, 11008), (333, 77)]:
        A = activations(shape, dtype, seed=shape[0], outlier_features=(17, shape[-1] - 1))
        got = run(executor, "int8_vectorwise_quant", *mps(A, threshold))
        want = ref.int8_vectorwise_quant(A, threshold)
        assert same(got[0], want[0]) and same(got[1], want[1]), shape
        assert (got[2] is None) if threshold == 0 else torch.equal(got[2].cpu(), want[2])
        got = run(executor, "int8_double_quant", *mps(A.reshape(-1, shape[-1]), threshold))
        want = ref.int8_double_quant(A.reshape(-1, shape[-1]), threshold)
        for g, w in zip(got[:4], want[:4]):
            assert same(g, w), shape
        assert (got[4] is None) if threshold == 0 else torch.equal(got[4].cpu(), want[4])


@pytest.mark.parametrize("M", [1, 7, 32, 512])
def test_int32_products_exact(executor, M):
    for N, K in [(1024, 4096), (96, 4100), (64, 8192)]:
        A = torch.randint(-128, 128, (M, K), generator=gen(M), dtype=torch.int8)
        B = torch.randint(-128, 128, (N, K), generator=gen(N), dtype=torch.int8)
        if K == 8192:  # the worst case: every product +16129 in row 0 x column 0
            A[0], B[0] = 127, 127
        got = run(executor, "int8_linear_matmul", *mps(A, B))
        assert torch.equal(got.cpu(), ref.int8_linear_matmul(A, B)), (M, N, K)


@pytest.mark.parametrize("dtype", ref.DTYPES, ids=str)
@pytest.mark.parametrize("M", [1, 5, 32, 512])
def test_scaled_and_mixed_products(executor, M, dtype):
    N, K = 1024, 4096
    X = activations((M, K), dtype, seed=M, outlier_features=(5, 1000, 4000))
    W = activations((N, K), torch.float16, seed=99) * 0.05
    CA, SCA, cols = ref.int8_vectorwise_quant(X, 6.0)
    CB, SCB, _ = ref.int8_vectorwise_quant(W, 0.0)
    bias = torch.randn(N, generator=gen(1)).to(dtype)
    acc = ref.int8_linear_matmul(CA, CB)
    got = run(executor, "int8_scaled_mm", *mps(CA, CB, SCA, SCB, bias, dtype))
    assert close_to_dequant(got, ref.int8_scaled_mm(CA, CB, SCA, SCB, bias, dtype), acc, SCA, SCB, bias)
    got = run(executor, "int8_mm_dequant", *mps(acc, SCA, SCB, dtype, bias))
    assert close_to_dequant(got, ref.int8_mm_dequant(acc, SCA, SCB, dtype, bias), acc, SCA, SCB, bias)
    out, subA = run(executor, "int8_mixed_scaled_mm", *mps(X, CA, CB, SCA, SCB, cols, bias))
    want, want_sub, exact = ref.int8_mixed_scaled_mm(X, CA, CB, SCA, SCB, cols, bias)
    assert same(subA, want_sub)
    allowed = ref.mixed_allowance(out.cpu(), exact, X, CA, CB, SCA, SCB, cols, bias) * 2
    assert ((out.cpu().double() - exact).abs() <= allowed).all()
    deq = run(executor, "int8_vectorwise_dequant", *mps(CB, SCB))
    want = ref.int8_vectorwise_dequant(CB, SCB)
    assert ((deq.cpu() - want).abs() <= ref.spacing(want, torch.float32) * 2).all()


# -- bitsandbytes on mps ----------------------------------------------------------------------------


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("threshold", [0.0, 6.0])
def test_linear8bitlt_on_mps(fresh_tier_selection, tier, threshold):
    fresh_tier_selection.setenv("BNB_MPS_EXECUTOR", tier)
    executors.reset()
    if executors.selection().tier != tier:
        pytest.skip(f"{tier} tier unavailable: {executors.selection().reason}")
    for name in ("int8_vectorwise_quant", "int8_mixed_scaled_mm", "int8_scaled_mm"):
        assert backend_info()[name]["tier"] == tier, backend_info()[name]
    torch.manual_seed(0)
    fp = torch.nn.Linear(4096, 1024).half()
    layer = bnb.nn.Linear8bitLt(4096, 1024, has_fp16_weights=False, threshold=threshold)
    layer.load_state_dict(fp.state_dict())
    layer = layer.to("mps").eval()
    x = activations((4, 32, 4096), torch.float16, seed=3, outlier_features=(11, 2048) if threshold else ())
    with torch.no_grad():
        y = layer(x.to("mps")).cpu()
    CB, SCB, _ = ref.int8_vectorwise_quant(fp.weight.detach(), 0.0)
    assert same(layer.state.CB, CB) and same(layer.state.SCB, SCB)
    x2 = x.reshape(-1, 4096)
    CA, SCA, cols = ref.int8_vectorwise_quant(x2, threshold)
    bias = fp.bias.detach()
    want, _, exact = ref.int8_mixed_scaled_mm(x2, CA, CB, SCA, SCB, cols, bias)
    if threshold:
        allowed = ref.mixed_allowance(y.reshape(-1, 1024), exact, x2, CA, CB, SCA, SCB, cols, bias) * 2
        assert ((y.reshape(-1, 1024).double() - exact).abs() <= allowed).all()
    else:
        acc = ref.int8_linear_matmul(CA, CB)
        assert close_to_dequant(y.reshape(-1, 1024), want, acc, SCA, SCB, bias)
