"""bnb-mps' 4-bit products against bitsandbytes' CUDA kernels on the same inputs (tests/data/cuda_golden/),
on the emulated tier: gemm_4bit (and gemv_4bit at M = 1) on random packed weights and scales, and
bitsandbytes.matmul_4bit on the QLoRA path (NF4, block size 64, nested absmax or not, bias or not).

The products are not bit-exact (docs/semantics.md section 4: the order of the float32 additions is
each kernel's own). The rule, per case: the error against the float64 product of the same dequantized
weights, in units of 2^-24 * sum|a * w| (+ |bias|) and taken as the largest over the output, is at most
1.5 times CUDA's error on that case plus one unit.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import cuda_golden as golden
from cuda_golden import DT
from cuda_golden_inputs import cases

RATIO, PLUS = 1.5, 1.0  # ours <= RATIO * CUDA's + PLUS, in units of 2^-24 * sum|a * w|


def product_error(out: torch.Tensor, A: torch.Tensor, W: torch.Tensor, bias: torch.Tensor | None = None) -> float:
    """The largest |out - A @ W.T (+ bias)| over the output, the product in float64 of A and W as given
    (A in its dtype, W the dequantized weight in A's dtype), in units of 2^-24 * (|A| @ |W|.T + |bias|)."""
    return _error(out, *_reference(A, W, bias))


def _reference(A: torch.Tensor, W: torch.Tensor, bias=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(A @ W.T + bias, |A| @ |W|.T + |bias|) in float64."""
    a, w = A.double().reshape(-1, A.shape[-1]), W.double()
    ref, mag = a @ w.T, a.abs() @ w.abs_().T
    if bias is not None:
        ref, mag = ref + bias.double(), mag + bias.double().abs()
    return ref, mag


def _error(out: torch.Tensor, ref: torch.Tensor, mag: torch.Tensor) -> float:
    return float(((out.double().reshape(ref.shape) - ref).abs() / (mag * 2.0**-24)).max())


def both_errors(ours: torch.Tensor, cuda: torch.Tensor, A, W_ours, W_cuda, bias=None) -> tuple[float, float]:
    """(our error, CUDA's error), each against the float64 product of the weight that side multiplied."""
    return product_error(ours, A, W_ours, bias), product_error(cuda, A, W_cuda, bias)


def _dequantized(packed: np.ndarray, absmax: np.ndarray, N: int, K: int, blocksize: int, quant_type: str, dt: str):
    """The weight as dequantize_4bit gives it in A's dtype (docs/semantics.md section 3), from the table."""
    import spec_reference as sref

    table = sref.table_4bit(quant_type)
    q = packed.reshape(-1)
    nib = np.stack([q >> 4, q & 15], 1).reshape(-1)
    w = (table[nib] * np.repeat(absmax, blocksize)).astype(np.float32)
    return torch.from_numpy(w).to(DT[dt]).reshape(N, K)


@pytest.fixture(scope="module")
def emulated():
    import bitsandbytes.functional as F
    import bitsandbytes.nn.modules as M
    from bnb_mps.testing import use_emulated_kernels

    mp = pytest.MonkeyPatch()
    mp.setattr(F, "has_avx512bf16", lambda: False)  # (as in test_cuda_golden.py)
    mp.setattr(M, "has_avx512bf16", lambda: False)
    try:
        with use_emulated_kernels():
            yield
    finally:
        mp.undo()


def _check(errors: dict) -> None:
    bad = {k: (round(o, 2), round(c, 2)) for k, (o, c) in errors.items() if o > RATIO * c + PLUS}
    assert not bad, f"{len(bad)} of {len(errors)} products break ours <= {RATIO} x CUDA's + {PLUS} (ours, CUDA's): {bad}"


@pytest.fixture(scope="module")
def mm_errors(emulated):
    """case name (+ op) -> (our error, CUDA's error), every stored gemm_4bit / gemv_4bit case; the
    float64 references are formed once per weight (a weight serves M = 1 and 16)."""
    stored, _ = golden.load("main")
    by_weight: dict = {}
    for case in cases("main"):
        if case.family == "mm":
            a = case.args
            by_weight.setdefault((a["N"], a["K"], a["blocksize"], a["quant_type"], case.dtype), []).append(case)
    errors = {}
    for (N, K, bs, qt, dt), group in by_weight.items():
        a = group[0].args
        W = _dequantized(a["packed"], a["absmax"], N, K, bs, qt, dt).double()
        absW = W.abs()
        for case in group:
            got, cuda = golden.run(case), stored[case.name]
            A = golden.tensor(case.args["A"], dt, "cpu").double().reshape(-1, K)
            ref, mag = A @ W.T, A.abs() @ absW.T
            for name, o, c in zip(("gemm_4bit", "gemv_4bit"), got, cuda):
                errors[f"{case.name} {name}"] = (_error(o, ref, mag), _error(c, ref, mag))
    return errors


@pytest.mark.parametrize("dt", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("m", [1, 16])
def test_gemm_4bit_error_within_cudas(mm_errors, m, dt):
    errors = {k: v for k, v in mm_errors.items() if f"/{dt}/M{m} " in k}
    assert len(errors) == 6 * (2 if m == 1 else 1)
    _check(errors)


@pytest.mark.parametrize("dt", ["fp32", "fp16", "bf16"])
def test_qlora_matmul_4bit_error_within_cudas(emulated, dt):
    import bitsandbytes as bnb
    import bitsandbytes.functional as F

    ops = torch.ops.bitsandbytes
    stored, _ = golden.load("mmq")
    code8 = F.create_dynamic_map().float()
    errors = {}
    for case in cases("mmq"):
        if case.family != "mmq" or case.dtype != dt:
            continue
        a = case.args
        W0 = golden.tensor(a["W"], dt, "cpu")
        N, K = W0.shape
        qB, state = F.quantize_4bit(W0, blocksize=64, quant_type="nf4", compress_statistics=bool(a["nested"]))
        A = golden.tensor(a["A"], dt, "cpu")
        bias = golden.tensor(a["bias"], dt, "cpu") if a["bias"] is not None else None
        with torch.no_grad():
            got = bnb.matmul_4bit(A, qB.t(), state, bias=bias)
        W_ours = F.dequantize_4bit(qB, state)
        w_key = case.name.split("/M")[0].replace("mmq/", "mmq-w/")  # the weight's stored state
        st = stored[w_key]
        packed = st[0] if not a["nested"] else stored[w_key[:-1] + "0"][0]
        scales = st[2] if not a["nested"] else ops.dequantize_blockwise(st[2], st[4], code8, 256, torch.float32) + st[3]
        W_cuda = ops.dequantize_4bit(packed, scales, 64, "nf4", [N, K], DT[dt])
        errors[case.name] = both_errors(got, stored[case.name][0], A, W_ours, W_cuda, bias)
    assert len(errors) == 16
    _check(errors)
