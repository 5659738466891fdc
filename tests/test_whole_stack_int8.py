"""bitsandbytes' own LLM.int8() API running bnb_mps' int8 kernels (under the emulator).

Inside `use_emulated_kernels()` the emulated tier serves the `cpu` dispatch key, so
`bitsandbytes.functional`, `bnb.nn.Linear8bitLt` and `Int8Params` on CPU tensors launch the
Metal kernels of csrc/kernels/int8*.metal. Results are checked against tests/reference_int8.py
(docs/semantics.md section 6, composed the way bitsandbytes composes the ops) and against float64 maths.
"""

from __future__ import annotations

import bitsandbytes as bnb
import bitsandbytes.functional as F
import pytest
import torch

import reference_int8 as ref
from bnb_mps.testing import use_emulated_kernels

pytest.importorskip("bnb_mps._emu")


def gen(seed):
    return torch.Generator().manual_seed(seed)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality."""
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)
    )


def activations(shape, dtype=torch.float16, seed=0, outlier_features=()):
    """Normal activations with a few feature columns carrying large values (LLM.int8()'s outliers)."""
    x = torch.randn(*shape, generator=gen(seed)) * 1.5
    for i, f in enumerate(outlier_features):
        x[..., f] = (8.0 + 4 * i) * torch.sign(torch.randn(x[..., f].shape, generator=gen(seed + i + 1)))
    return x.to(dtype)


def int8_error_bound(x: torch.Tensor, W: torch.Tensor, SCA: torch.Tensor, SCB: torch.Tensor) -> torch.Tensor:
    """A rigorous bound on |int8 product - x @ W^T| per output (float64): rounding x and W to
    their int8 grids moves each by at most half a step (SCA / 254 per row of x, SCB / 254 per row
    of W), so a product term moves by at most |x| eW + |W| eX + eX eW; W's cast to fp16 adds
    2^-11 |x| |W|, and the float32 scalings a few 2^-24."""
    x, W = x.double().reshape(-1, x.shape[-1]), W.double()
    eX, eW = SCA.double()[:, None] / 254, SCB.double()[:, None] / 254
    quant = x.abs() @ eW.expand_as(W).T + eX.expand_as(x) @ W.abs().T + eX * eW.T * x.shape[-1]
    return quant + x.abs() @ W.abs().T * (2.0**-11 + 2.0**-20)


# -- functional API ----------------------------------------------------------------------------------


def test_functional_int8_ops_match_the_reference():
    """bitsandbytes.functional on K = 1056 with +-127 data (one product sum is 1056 * 16129, past
    2^24, where float32 accumulation is inexact), a 3-D activation, `out=`."""
    A = torch.randint(-127, 128, (2, 5, 1056), generator=gen(1), dtype=torch.int8)
    B = torch.randint(-127, 128, (40, 1056), generator=gen(2), dtype=torch.int8)
    A[0, 0], B[0] = 127, 127
    B[0, -1] = 2  # 1055 * 16129 + 254: odd, no float32 value
    out = torch.empty(2, 5, 40, dtype=torch.int32)
    with use_emulated_kernels() as kernels:
        C = F.int8_linear_matmul(A, B)
        F.int8_linear_matmul(A, B, out=out)
    want = ref.int8_linear_matmul(A, B)
    assert want.abs().max() > 2**24 and (want.double() != want.float().double()).any()
    assert torch.equal(C, want) and torch.equal(out, want)
    assert kernels.launched == ["bnb_int8_linear_matmul_tile32_k16"] * 2

    rs, cs = torch.rand(10, generator=gen(3)) * 5, torch.rand(40, generator=gen(4)) * 5
    bias = torch.randn(40, generator=gen(5)).half()
    with use_emulated_kernels() as kernels:
        deq = F.int8_mm_dequant(C.reshape(10, 40), rs, cs, bias=bias)
        scaled = torch.ops.bitsandbytes.int8_scaled_mm(A, B, rs, cs, bias)
        vdeq = F.int8_vectorwise_dequant(B, cs)
    assert same(deq, ref.int8_mm_dequant(want.reshape(10, 40), rs, cs, torch.float16, bias))
    assert same(scaled, ref.int8_scaled_mm(A, B, rs, cs, bias))
    assert same(vdeq, ref.int8_vectorwise_dequant(B, cs))
    assert kernels.launched == ["bnb_int8_mm_dequant_f16", "bnb_int8_scaled_mm_f16_tile32_k16",
                                "bnb_int8_vectorwise_dequant"]  # fmt: skip  (no int32 matrix in between)


@pytest.mark.parametrize("threshold", [0.0, 6.0])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_functional_quantization(dtype, threshold):
    X = activations((3, 7, 96), dtype, seed=2, outlier_features=(4, 50))
    with use_emulated_kernels() as kernels:
        CA, SCA, cols = F.int8_vectorwise_quant(X, threshold)
        dq = F.int8_double_quant(X.reshape(-1, 96), threshold=threshold)
    want = ref.int8_vectorwise_quant(X, threshold)
    assert torch.equal(CA, want[0]) and same(SCA, want[1])
    want_dq = ref.int8_double_quant(X.reshape(-1, 96), threshold)
    for got, w in zip(dq[:4], want_dq[:4]):
        assert same(got, w)
    if threshold:
        assert cols.tolist() == [4, 50] and dq[4].tolist() == [4, 50]
        assert len(kernels.launched) == 2 + 3
    else:
        assert cols is None and dq[4] is None
        assert len(kernels.launched) == 1 + 2


# -- Linear8bitLt and Int8Params ----------------------------------------------------------------------


def make_linear(K, N, threshold, has_fp16_weights=False, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    fp = torch.nn.Linear(K, N).to(dtype)
    layer = bnb.nn.Linear8bitLt(K, N, has_fp16_weights=has_fp16_weights, threshold=threshold).to(dtype)
    layer.load_state_dict(fp.state_dict())
    return fp, layer


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("threshold", [0.0, 6.0])
def test_linear8bitlt_forward(threshold, dtype):
    fp, layer = make_linear(96, 40, threshold, dtype=dtype)
    x = activations((3, 7, 96), dtype, seed=3, outlier_features=(10, 90) if threshold else ())
    with use_emulated_kernels() as kernels:
        layer = layer.to("cpu").eval()  # Int8Params quantizes its weight here
        load = list(kernels.launched)
        with torch.no_grad():
            y = layer(x)
    assert load == ["bnb_int8_vectorwise_quant_f16"]  # the weight, as fp16 (as bitsandbytes does)
    CB, SCB, _ = ref.int8_vectorwise_quant(fp.weight.detach().half(), 0.0)
    assert torch.equal(layer.state.CB, CB) and same(layer.state.SCB, SCB)

    forward = kernels.launched[len(load):]
    x2 = x.reshape(-1, 96)
    CA, SCA, cols = ref.int8_vectorwise_quant(x2.half(), threshold)
    bias = layer.bias.detach()
    if threshold:
        assert forward == ["bnb_int8_vectorwise_quant_outliers_f16", "bnb_int8_outlier_finish",
                           f"bnb_int8_scaled_mm_{ref_name(dtype)}_tile32_k16"]  # fmt: skip
        assert cols.tolist() == [10, 90]
        want, _, exact = ref.int8_mixed_scaled_mm(x2, CA, CB, SCA, SCB, cols, bias)
        err = (y.reshape(-1, 40).double() - exact).abs()
        assert (err <= ref.mixed_allowance(y.reshape(-1, 40), exact, x2, CA, CB, SCA, SCB, cols, bias)).all()
    else:
        assert forward == ["bnb_int8_vectorwise_quant_f16", f"bnb_int8_scaled_mm_{ref_name(dtype)}_tile32_k16"]
        assert same(y.reshape(-1, 40), ref.int8_scaled_mm(CA, CB, SCA, SCB, bias, dtype))
    # Against float64: within the int8 quantization error (and the output's rounding).
    true = x2.double() @ fp.weight.double().T + fp.bias.double()
    bound = int8_error_bound(x2, fp.weight.detach(), SCA, SCB) + ref.spacing(true, dtype)
    err = (y.reshape(-1, 40).double() - true).abs()
    assert (err <= bound).all()
    assert err.max() > 1e-3  # quantization is visible: the bound is what is being tested


def ref_name(dtype):
    return {torch.float16: "f16", torch.bfloat16: "bf16", torch.float32: "f32"}[dtype]


@pytest.mark.parametrize("threshold", [0.0, 6.0])
def test_linear8bitlt_backward(threshold):
    """One backward step of MatMul8bitLt (the path bitsandbytes takes on a GPU; on CPU tensors it
    needs eval mode, as training mode picks MatMul8bitFp there) with fp16 weights that get grads."""
    K, N = 64, 48
    fp, layer = make_linear(K, N, threshold, has_fp16_weights=True, dtype=torch.float16, seed=1)
    x = activations((2, 5, K), torch.float16, seed=4, outlier_features=(3,) if threshold else ())
    x.requires_grad_(True)
    g = (torch.randn(2, 5, N, generator=gen(6))).half()
    with use_emulated_kernels() as kernels:
        layer = layer.to("cpu").eval()
        y = layer(x)
        n_forward = len(kernels.launched)
        y.backward(g)
    backward = kernels.launched[n_forward:]
    assert backward == ["bnb_int8_double_quant_stats_f16", "bnb_int8_double_quant_apply_f16",
                        "bnb_int8_scaled_mm_f16_tile64"]  # fmt: skip  (K_grad = 10 tokens: not % 16)

    x2, g2 = x.detach().reshape(-1, K), g.reshape(-1, N)
    W = fp.weight.detach()
    CB, SCB, _ = ref.int8_vectorwise_quant(W, 0.0)
    # grad_x = g @ (CB * SCB / 127) (bitsandbytes dequantizes CB in fp16 and multiplies in fp16):
    # within fp16's rounding of those steps of the float64 value, and within the int8 weight error
    # of g @ W.
    Wdq = CB.double() * (SCB.double()[:, None] / 127)
    gx64 = g2.double() @ Wdq
    mags = g2.double().abs() @ Wdq.abs()
    gx = x.grad.reshape(-1, K).double()
    assert ((gx - gx64).abs() <= mags * 2.0**-9 + ref.spacing(gx64, torch.float16)).all()
    assert ((gx - g2.double() @ W.double()).abs() <= g2.double().abs() @ (SCB.double()[:, None] / 254).expand_as(W)
            + mags * 2.0**-9 + ref.spacing(gx64, torch.float16)).all()  # fmt: skip
    # grad_W: bitsandbytes' formula, int8_scaled_mm(Cgrad^T, CAt^T, SCgradt, SCAt) [+ g^T @ subA on
    # the outlier columns], from docs/semantics.md's quantizations: bit for bit for the int8 part, and within
    # fp16 rounding of its float64 value.
    _, CAt, _, SCAt, cols = ref.int8_double_quant(x2, threshold)
    Cgrad, _, _, SCgradt, _ = ref.int8_double_quant(g2, 0.0)
    gw_int8 = ref.int8_scaled_mm(Cgrad.t().contiguous(), CAt.t().contiguous(), SCgradt, SCAt, None, torch.float16)
    acc = Cgrad.t().double() @ CAt.double()
    gw64 = acc * SCgradt.double()[:, None] * SCAt.double()[None, :] / 16129
    gw = layer.weight.grad.double()
    if threshold:
        assert cols.tolist() == [3]
        outlier = g2.t().double() @ x2[:, cols].double()
        gw_int8 = gw_int8.double()
        gw_int8[:, cols] += outlier
        gw64[:, cols] += outlier
        keep = torch.ones(K, dtype=torch.bool)
        keep[cols] = False
        assert same(layer.weight.grad[:, keep], ref.int8_scaled_mm(
            Cgrad.t().contiguous(), CAt.t().contiguous(), SCgradt, SCAt, None, torch.float16)[:, keep])
    else:
        assert same(layer.weight.grad, gw_int8)
    assert ((gw - gw64).abs() <= 2 * ref.spacing(gw64, torch.float16) + gw64.abs() * 2.0**-20).all()
    assert torch.allclose(layer.bias.grad.double(), g2.double().sum(0), rtol=2e-3, atol=1e-2)


def test_int8params_quantize_on_move():
    W = torch.randn(40, 72, generator=gen(9)) * 0.1
    p = bnb.nn.Int8Params(W.clone(), requires_grad=False, has_fp16_weights=False)
    with use_emulated_kernels() as kernels:
        q = p.to("cpu")
    assert kernels.launched == ["bnb_int8_vectorwise_quant_f16"]
    CB, SCB, _ = ref.int8_vectorwise_quant(W.half(), 0.0)
    assert torch.equal(q.data, CB) and torch.equal(q.CB, CB) and same(q.SCB, SCB)
