"""bitsandbytes' own Python API running bnb_mps' quantization kernels (under the emulator).

Inside `use_emulated_kernels()` the emulated tier serves the `cpu` dispatch key, so
`bitsandbytes.functional` and `bitsandbytes.nn` on CPU tensors launch the Metal kernels of
csrc/kernels. Results must be the docs/semantics.md results (tests/spec_reference.py), bit for bit.
"""

from __future__ import annotations

import bitsandbytes as bnb
import bitsandbytes.functional as F
import pytest
import torch

import spec_reference as ref
from bnb_mps import registration
from bnb_mps.ops import OPS
from bnb_mps.testing import use_emulated_kernels

pytest.importorskip("bnb_mps._emu")

CODE = F.create_dynamic_map(signed=True)


def rand(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * 3).to(dtype)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN == NaN, -0.0 != +0.0)."""
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
    )


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("blocksize", [4096, 256, 64])
def test_functional_quantize_blockwise(dtype, blocksize):
    A = rand(37, 129, dtype=dtype, seed=blocksize)
    with use_emulated_kernels() as kernels:
        q, state = F.quantize_blockwise(A, blocksize=blocksize)
        out = F.dequantize_blockwise(q, state)
    assert kernels.launched == [f"bnb_quantize_blockwise_{ref_name(dtype)}_{blocksize}",
                                f"bnb_dequantize_blockwise_{ref_name(dtype)}"]  # fmt: skip
    want_q, want_absmax = ref.quantize_blockwise(A, state.code, blocksize)
    assert same(q, want_q) and same(state.absmax, want_absmax)
    assert same(out, ref.dequantize_blockwise(want_q, want_absmax, state.code, blocksize, dtype))


def ref_name(dtype):
    return {torch.float16: "f16", torch.bfloat16: "bf16", torch.float32: "f32"}[dtype]


@pytest.mark.parametrize("compress_statistics", [False, True])
@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_functional_4bit_round_trip(dtype, quant_type, compress_statistics):
    A = rand(48, 100, dtype=dtype, seed=3)  # rows of 100: blocks of 64 straddle rows
    with use_emulated_kernels() as kernels:
        packed, state = F.quantize_4bit(A, blocksize=64, quant_type=quant_type,
                                        compress_statistics=compress_statistics)  # fmt: skip
        out = F.dequantize_4bit(packed, state)
    assert any(k.startswith(f"bnb_quantize_4bit_{quant_type}") for k in kernels.launched)
    assert any(k.startswith(f"bnb_dequantize_4bit_{quant_type}") for k in kernels.launched)
    want_packed, want_absmax = ref.quantize_4bit(A, 64, quant_type)
    assert same(packed, want_packed)
    if compress_statistics:
        assert "bnb_quantize_blockwise_f32_256" in kernels.launched
        q8, nested, offset = ref.double_quantize(want_absmax, CODE)
        assert same(state.absmax, q8) and same(state.state2.absmax, nested)
        scales = ref.nested_scales(q8, CODE, nested, offset)
    else:
        assert same(state.absmax, want_absmax)
        scales = want_absmax
    assert same(out, ref.dequantize_4bit(want_packed, scales, 64, quant_type, A.shape, dtype))


@pytest.mark.parametrize("quant_storage", [torch.uint8, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
def test_linear4bit_weight_quantization_and_forward(quant_type, quant_storage):
    torch.manual_seed(0)
    layer = bnb.nn.Linear4bit(96, 40, bias=True, compute_dtype=torch.float32, quant_type=quant_type,
                              compress_statistics=False, quant_storage=quant_storage)  # fmt: skip
    W = layer.weight.data.clone()
    with use_emulated_kernels() as kernels:
        layer = layer.to("cpu")  # Params4bit quantizes on the move to a device
        x = rand(3, 96, seed=5)
        y = layer(x)
    assert f"bnb_quantize_4bit_{quant_type}_f32_64" in kernels.launched
    assert layer.weight.dtype == quant_storage
    want_packed, want_absmax = ref.quantize_4bit(W, 64, quant_type, quant_storage)
    assert same(layer.weight.data.reshape(-1, 1), want_packed)
    assert same(layer.weight.quant_state.absmax, want_absmax)
    W_dq = ref.dequantize_4bit(want_packed, want_absmax, 64, quant_type, W.shape, torch.float32)
    torch.testing.assert_close(y, torch.nn.functional.linear(x, W_dq, layer.bias), rtol=1e-5, atol=1e-5)


def test_params4bit_with_double_quant():
    W = rand(64, 256, seed=9)
    p = bnb.nn.Params4bit(W.clone(), requires_grad=False, blocksize=128, compress_statistics=True, quant_type="nf4")
    with use_emulated_kernels() as kernels:
        p = p.to("cpu")
    assert "bnb_quantize_4bit_nf4_f32_128" in kernels.launched and "bnb_quantize_blockwise_f32_256" in kernels.launched
    want_packed, want_absmax = ref.quantize_4bit(W, 128, "nf4")
    q8, nested, _ = ref.double_quantize(want_absmax, CODE)
    assert same(p.data, want_packed) and same(p.quant_state.absmax, q8) and same(p.quant_state.state2.absmax, nested)


def test_agrees_with_stock_bitsandbytes_where_spec_says_it_does():
    """absmax and dequantized values are the same as bitsandbytes' CPU path; 8-bit codes differ
    only where docs/semantics.md documents the CPU quantizer's lookup table (at most 3 codes, rarely)."""
    A = rand(64, 256, seed=11)
    stock_q, stock_absmax = torch.ops.bitsandbytes.quantize_blockwise(A, CODE, 256)
    stock_4, stock_absmax4 = torch.ops.bitsandbytes.quantize_4bit(A, 64, "nf4", torch.uint8)
    with use_emulated_kernels():
        q, absmax = torch.ops.bitsandbytes.quantize_blockwise(A, CODE, 256)
        deq = torch.ops.bitsandbytes.dequantize_blockwise(stock_q, stock_absmax, CODE, 256, torch.float32)
        deq4 = torch.ops.bitsandbytes.dequantize_4bit(stock_4, stock_absmax4, 64, "nf4", [64, 256], torch.bfloat16)
        _, absmax4 = torch.ops.bitsandbytes.quantize_4bit(A, 64, "nf4", torch.uint8)
    assert same(absmax, stock_absmax) and same(absmax4, stock_absmax4)
    diff = (q.int() - stock_q.int()).abs()
    assert diff.max() <= 3 and (diff > 0).float().mean() <= 0.003
    assert same(deq, torch.ops.bitsandbytes.dequantize_blockwise(stock_q, stock_absmax, CODE, 256, torch.float32))
    assert same(deq4, torch.ops.bitsandbytes.dequantize_4bit(stock_4, stock_absmax4, 64, "nf4", [64, 256],
                                                             torch.bfloat16))  # fmt: skip


def test_ops_without_kernels_stay_with_bitsandbytes_and_exit_restores():
    A = rand(8, 64, seed=2)
    before = torch.ops.bitsandbytes.quantize_blockwise(A, CODE, 64)
    with use_emulated_kernels():
        assert "quantize_blockwise" in registration.registered("CPU")
        # exactly the ops that have a Metal kernel (the others stay with bitsandbytes' CPU code)
        assert set(registration.registered("CPU")) == {name for name, op in OPS.items() if op.kernel is not None}
        with pytest.raises(RuntimeError, match="already active"):
            with use_emulated_kernels():
                pass
    assert registration.registered("CPU") == []
    after = torch.ops.bitsandbytes.quantize_blockwise(A, CODE, 64)
    assert same(before[0], after[0])  # bitsandbytes' own CPU kernel again (its LUT codes)


def test_detection_settings_apply(monkeypatch):
    from bnb_mps.executors import emulated

    seen = []
    real = emulated.EmulatedExecutor.launch

    def spy(self, kernel, **kw):
        seen.append((self.order, self.race_check, self.poison))
        return real(self, kernel, **kw)

    monkeypatch.setattr(emulated.EmulatedExecutor, "launch", spy)
    with use_emulated_kernels(order="reverse", race_check=True, poison=0x00):
        F.quantize_blockwise(rand(300, seed=1), blocksize=256)
    assert seen == [("reverse", True, 0x00)]


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_views_that_start_mid_storage(dtype):
    """Inputs and `out` that are views one element into their storage (not vector-aligned)."""
    base = rand(1 + 40 * 33, dtype=dtype, seed=21)
    A = base[1:].view(40, 33)
    packed, absmax = ref.quantize_4bit(A, 64, "nf4")
    packed_view = torch.cat([torch.zeros(1, 1, dtype=torch.uint8), packed])[1:]
    out = torch.full((1 + 40 * 33,), 7.0, dtype=dtype)[1:].view(40, 33)
    with use_emulated_kernels(race_check=True):
        got_packed, got_absmax = torch.ops.bitsandbytes.quantize_4bit(A, 64, "nf4", torch.uint8)
        torch.ops.bitsandbytes.dequantize_4bit.out(packed_view, absmax, 64, "nf4", [40, 33], dtype, out)
        q, am = torch.ops.bitsandbytes.quantize_blockwise(A, CODE, 64)
    assert same(got_packed, packed) and same(got_absmax, absmax)
    assert same(out, ref.dequantize_4bit(packed, absmax, 64, "nf4", (40, 33), dtype))
    want_q, want_am = ref.quantize_blockwise(A, CODE, 64)
    assert same(q, want_q) and same(am, want_am)
