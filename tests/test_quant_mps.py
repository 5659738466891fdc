"""On Apple hardware: the quantization kernels on the native and shader tiers give the SPEC
results bit for bit, and bitsandbytes' API on `mps` tensors uses them. Skipped elsewhere."""

from __future__ import annotations

import bitsandbytes.functional as F
import pytest
import torch

import spec_reference as ref
from bnb_mps import backend_info, executors, ops
from bnb_mps.executors.base import ExecutorUnavailable

pytestmark = pytest.mark.mps

CODE = F.create_dynamic_map(signed=True)
SHAPES = [(1,), (3, 5), (1000,), (33, 129), (4096 + 7,)]


@pytest.fixture(params=["native", "shader"])
def executor(request):
    try:
        return executors.load_tier(request.param)
    except ExecutorUnavailable as e:
        pytest.skip(f"{request.param} tier unavailable: {e}")


def run(executor, name, *args):
    op = ops.OPS[name]
    return ops.call(op, args, {}, executor)


def same(a, b):
    a, b = a.cpu(), b.cpu()
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def data(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    A = torch.randn(*shape, generator=g) * 4
    A.view(-1)[: min(3, A.numel())] = torch.tensor([0.0, float("nan"), float("inf")])[: min(3, A.numel())]
    return A.to(dtype)


@pytest.mark.parametrize("dtype", ref.DTYPES, ids=str)
@pytest.mark.parametrize("blocksize", ref.BLOCKSIZES_8BIT)
def test_8bit(executor, dtype, blocksize):
    for i, shape in enumerate(SHAPES):
        A = data(shape, dtype, i)
        q, absmax = run(executor, "quantize_blockwise", A.to("mps"), CODE.to("mps"), blocksize)
        want_q, want_absmax = ref.quantize_blockwise(A, CODE, blocksize)
        assert same(q, want_q) and same(absmax, want_absmax), shape
        out = run(executor, "dequantize_blockwise", q, absmax, CODE.to("mps"), blocksize, dtype)
        assert same(out, ref.dequantize_blockwise(want_q, want_absmax, CODE, blocksize, dtype)), shape


@pytest.mark.parametrize("dtype", ref.DTYPES, ids=str)
@pytest.mark.parametrize("blocksize", ref.BLOCKSIZES_4BIT)
@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
def test_4bit(executor, quant_type, blocksize, dtype):
    for i, shape in enumerate(SHAPES):
        A = data(shape, dtype, i)
        packed, absmax = run(executor, "quantize_4bit", A.to("mps"), blocksize, quant_type, torch.uint8)
        want_packed, want_absmax = ref.quantize_4bit(A, blocksize, quant_type)
        assert same(packed, want_packed) and same(absmax, want_absmax), shape
        out = run(executor, "dequantize_4bit", packed, absmax, blocksize, quant_type, list(shape), dtype)
        assert same(out, ref.dequantize_4bit(want_packed, want_absmax, blocksize, quant_type, shape, dtype)), shape


def test_bitsandbytes_api_on_mps_uses_a_gpu_tier():
    info = backend_info()
    for name in ("quantize_blockwise", "dequantize_blockwise", "quantize_4bit", "dequantize_4bit"):
        assert info[name]["tier"] in executors.GPU_TIERS, info[name]
    A = data((64, 96), torch.float16, 7)
    packed, state = F.quantize_4bit(A.to("mps"), blocksize=64, quant_type="nf4")
    want_packed, want_absmax = ref.quantize_4bit(A, 64, "nf4")
    assert same(packed, want_packed) and same(state.absmax, want_absmax)
