"""The CPU-transfer fallback returns exactly what bitsandbytes' CPU ops return.

Every schema is called through `op.redispatch(DispatchKeySet(MPS), ...)` on CPU tensors, which
reaches bnb_mps' MPS kernel (the fallback tier, forced with BNB_MPS_EXECUTOR=cpu), and compared
with the stock op on copies of the same inputs, including every in-place update (parameters,
states, absmax, `out`).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch._C import DispatchKey, DispatchKeySet

import op_inputs
from bnb_mps import registration

pytestmark = pytest.mark.filterwarnings("ignore::bnb_mps.executors.SlowTierWarning")

MPS = DispatchKeySet(DispatchKey.MPS)


@pytest.fixture(autouse=True)
def cpu_round_trip(fresh_tier_selection):
    fresh_tier_selection.setenv("BNB_MPS_EXECUTOR", "cpu")
    yield
ALL = list(registration.SCHEMAS)
# bitsandbytes 0.50.2 has no CPU implementation of these; the fallback composes them (below).
NO_STOCK_CPU = {"dequantize_blockwise.out", "dequantize_4bit.out", "gemv_4bit.out", "int8_double_quant"}


def packet(name):
    base, _, overload = name.partition(".")
    return getattr(getattr(torch.ops.bitsandbytes, base), overload or "default")


def assert_identical(got, want, what):
    if isinstance(want, (tuple, list)):
        assert isinstance(got, (tuple, list)) and len(got) == len(want), what
        for i, (g, w) in enumerate(zip(got, want)):
            assert_identical(g, w, f"{what}[{i}]")
    elif isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), what
        assert got.dtype == want.dtype and got.shape == want.shape and got.device == want.device, what
        assert torch.equal(got, want) or (got.isnan() == want.isnan()).all() and torch.equal(
            got.nan_to_num(0), want.nan_to_num(0)
        ), what
    else:
        assert got == want, what


def stock(name, args):
    """What bitsandbytes' own CPU path gives (composed for the schemas it lacks)."""
    if name.endswith(".out"):
        *inputs, out = args
        if name in NO_STOCK_CPU:
            out.copy_(packet(name.removesuffix(".out"))(*inputs))
            return None
    if name == "int8_double_quant":
        return int8_double_quant_reference(*args)
    return packet(name)(*args)


def int8_double_quant_reference(A, threshold):
    """docs/semantics.md section 6, as CUDA computes it: rows like int8_vectorwise_quant; columns scaled by
    their absmax over non-outliers, outliers zeroed, rounded half to even."""
    rows = torch.ops.bitsandbytes.int8_vectorwise_quant(A.clone(), threshold)
    A32 = A.float()
    keep = (A32.abs() < threshold) if threshold > 0 else torch.ones_like(A32, dtype=torch.bool)
    kept = torch.where(keep, A32, torch.zeros_like(A32))
    col_stats = kept.abs().amax(dim=0)
    # fp16 A * 127 is formed in fp16 (as A.mul(127.0) does), then divided in fp32
    scaled = torch.where(keep, A, torch.zeros_like(A)).mul(127.0).float() / col_stats
    quant_col = torch.round(scaled).to(torch.int8)
    return rows[0], quant_col, rows[1], col_stats, rows[2]


CASES = [(name, label) for name in ALL for label, _ in op_inputs.cases(name)]


@pytest.mark.parametrize("name,label", CASES, ids=[f"{n}-{l}" for n, l in CASES])
def test_redispatch_matches_stock_cpu(name, label):
    args = dict(op_inputs.cases(name))[label]
    mine = copy.deepcopy(args)
    theirs = copy.deepcopy(args)
    got = packet(name).redispatch(MPS, *mine)
    want = stock(name, theirs)
    assert_identical(got, want, f"{name} result")
    for i, (m, t) in enumerate(zip(mine, theirs)):  # in-place updates and untouched inputs alike
        if isinstance(t, torch.Tensor):
            assert_identical(m, t, f"{name} argument {i} after the call")
    if name.startswith("optimizer_update"):  # the call did update the parameter
        assert not torch.equal(mine[2], args[2])


def test_every_schema_has_cases():
    assert {n for n, _ in CASES} == set(ALL) and len(ALL) == 19


def test_redispatch_reaches_bnb_mps(monkeypatch):
    """The redispatched call runs bnb_mps' glue, not some other kernel."""
    from bnb_mps.executors import cpu

    seen = []
    real = cpu.run
    monkeypatch.setattr(cpu, "run", lambda name, args: seen.append(name) or real(name, args))
    A = torch.randn(256)
    q, absmax = packet("quantize_blockwise").redispatch(MPS, A, op_inputs.signed_code(), 256)
    assert seen == ["quantize_blockwise"]
    assert torch.equal(q, torch.ops.bitsandbytes.quantize_blockwise(A, op_inputs.signed_code(), 256)[0])


def test_keyword_and_default_arguments():
    A = op_inputs.randn(8, 16, dtype=torch.float16, scale=3)
    got = packet("int8_vectorwise_quant").redispatch(MPS, A, threshold=2.0)
    want = torch.ops.bitsandbytes.int8_vectorwise_quant(A.clone(), 2.0)
    assert_identical(got, want, "threshold by keyword")
    got = packet("int8_vectorwise_quant").redispatch(MPS, A)
    assert_identical(got, torch.ops.bitsandbytes.int8_vectorwise_quant(A.clone()), "default threshold")


def test_non_contiguous_input_gives_its_contiguous_result():
    A = op_inputs.randn(64, 96).t()
    got = packet("quantize_4bit").redispatch(MPS, A, 64, "nf4", torch.uint8)
    want = torch.ops.bitsandbytes.quantize_4bit(A.contiguous(), 64, "nf4", torch.uint8)
    assert_identical(got, want, "transposed input")


def test_results_go_back_to_the_input_device(monkeypatch):
    """On mps the fallback returns results on mps; simulated with `meta` as the caller's device."""
    from bnb_mps.executors import cpu

    monkeypatch.setattr(cpu, "_device_of", lambda args: torch.device("meta"))
    q, absmax = cpu.run("quantize_blockwise", [torch.randn(300), op_inputs.signed_code(), 256])
    assert q.device.type == "meta" and absmax.device.type == "meta"


@pytest.mark.parametrize("name", ["optimizer_update_8bit_blockwise", "optimizer_update_32bit", "gemv_4bit.out"])
def test_in_place_updates_are_written_back(monkeypatch, name):
    """When the op runs on copies (as it does for mps tensors), the caller's tensors get the updates."""
    from bnb_mps.executors import cpu

    real = cpu._to
    monkeypatch.setattr(cpu, "_to", lambda x, d: x.clone() if isinstance(x, torch.Tensor) else real(x, d))
    label, args = next(op_inputs.cases(name))
    mine, theirs = copy.deepcopy(args), copy.deepcopy(args)
    cpu.run(name, mine)
    stock(name, theirs)
    for i, (m, t) in enumerate(zip(mine, theirs)):
        if isinstance(t, torch.Tensor):
            assert_identical(m, t, f"{name} argument {i}")
