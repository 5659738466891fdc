"""Never slower than stock bitsandbytes: per op on the MPS key, bnb_mps' Metal kernel on a GPU
tier; else bitsandbytes' own implementation that runs on mps (the op is handed back to it); else
the CPU round trip, only for ops bitsandbytes cannot run on mps.

On Linux no GPU tier loads (the truth here); a stand-in GPU tier (the emulated executor under the
name "shader") and a stand-in for bitsandbytes' own mps kernel cover the other cases. Calls go
through `op.redispatch(DispatchKeySet(MPS), ...)` on CPU tensors, which is what a Mac's mps
tensors reach.
"""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch
from torch._C import DispatchKey, DispatchKeySet

import bnb_mps
import op_inputs
from bnb_mps import executors, ops, registration
from bnb_mps.executors import ExecutorUnavailable
from bnb_mps.executors import cpu as cpu_fallback
from bnb_mps.testing import RecordingExecutor

MPS = DispatchKeySet(DispatchKey.MPS)
pytestmark = pytest.mark.filterwarnings("ignore::bnb_mps.executors.SlowTierWarning")

# bitsandbytes 0.50.2 has no implementation of these that runs on mps (nor a default kernel).
NOT_ON_MPS = {"optimizer_update_8bit_blockwise", "int8_double_quant", "dequantize_blockwise.out"}


def has_mps_kernel_of_ours(name: str) -> bool:
    return name in registration.registered("MPS")


@pytest.fixture
def fallback_calls(monkeypatch):
    calls = []
    real = cpu_fallback.run
    monkeypatch.setattr(cpu_fallback, "run", lambda name, args: calls.append(name) or real(name, args))
    return calls


@pytest.fixture
def no_gpu_tier(fresh_tier_selection):
    """The truth on Linux, and a stand-in for it on a Mac: neither GPU tier loads."""

    def unavailable(name):
        raise ExecutorUnavailable(f"{name} stands in as unavailable")

    fresh_tier_selection.setattr(executors, "load_tier", unavailable)
    return fresh_tier_selection


@pytest.fixture
def stand_in_gpu_tier(fresh_tier_selection):
    """A GPU tier that loads: the emulated executor, recorded, under the name "shader"."""
    if importlib.util.find_spec("bnb_mps._emu") is None:
        pytest.skip("the emulator runtime is not built")
    from bnb_mps.executors import emulated

    recorder = RecordingExecutor(emulated.load())
    recorder.name = "shader"

    def load(name):
        if name == "shader":
            return recorder
        raise ExecutorUnavailable(f"{name} stands in as unavailable")

    fresh_tier_selection.setattr(executors, "load_tier", load)
    return recorder


def first_case(name):
    label, args = next(iter(op_inputs.cases(name)))
    return args


def stock_mps_result(name, args):
    """What the MPS key gives with bnb_mps unregistered (bitsandbytes alone)."""
    bnb_mps.unregister()
    try:
        return ops.op_packet(name).redispatch(MPS, *args)
    finally:
        bnb_mps.register()


def assert_same(got, want):
    if isinstance(want, (tuple, list)):
        assert len(got) == len(want)
        for g, w in zip(got, want):
            assert_same(g, w)
    elif isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got.nan_to_num(), want.nan_to_num())
    else:
        assert got == want


HANDED_BACK = sorted(set(registration.SCHEMAS) - NOT_ON_MPS - {"dequantize_4bit.out", "gemv_4bit.out"})


@pytest.mark.parametrize("name", HANDED_BACK)
def test_without_a_gpu_tier_bitsandbytes_serves_what_it_can_run_on_mps(no_gpu_tier, fallback_calls, name):
    """Its pure-PyTorch default kernel serves (on a Mac: on the GPU), not the CPU round trip;
    bnb_mps steps aside for the op after its first call, and the result is stock's."""
    args = first_case(name)
    want = stock_mps_result(name, copy.deepcopy(args))
    assert ops.route(name).tier == "bitsandbytes"
    assert "default kernel" in ops.route(name).reason
    got = ops.op_packet(name).redispatch(MPS, *copy.deepcopy(args))
    assert fallback_calls == []
    assert not has_mps_kernel_of_ours(name)  # later calls go to bitsandbytes directly
    assert_same(got, want)
    info = bnb_mps.backend_info()[name]
    assert info["tier"] == "bitsandbytes" and "default kernel" in info["reason"]


@pytest.mark.parametrize("name", sorted(NOT_ON_MPS))
def test_without_a_gpu_tier_the_cpu_round_trip_serves_what_bitsandbytes_cannot(no_gpu_tier, fallback_calls, name):
    args = first_case(name)
    assert ops.route(name).tier == "cpu"
    ops.op_packet(name).redispatch(MPS, *copy.deepcopy(args))
    assert fallback_calls == [name]
    assert has_mps_kernel_of_ours(name)
    assert bnb_mps.backend_info()[name]["tier"] == "cpu"


def test_bitsandbytes_own_mps_kernel_is_preferred_to_the_round_trip(no_gpu_tier, fallback_calls):
    """A stand-in for bitsandbytes' mps backend kernel (registered on a Mac) of an op that has no
    default kernel: it is found under ours and serves."""
    name = "dequantize_blockwise.out"
    theirs = torch.library.Library("bitsandbytes", "IMPL")
    calls = []
    theirs.impl(name, lambda *args: calls.append(name), "MPS")
    bnb_mps.unregister()
    bnb_mps.register()  # ours on top again, theirs inactive below
    try:
        r = ops.route(name)
        assert r.tier == "bitsandbytes" and "own mps kernel" in r.reason
        ops.op_packet(name).redispatch(MPS, *first_case(name))
        assert calls == [name] and fallback_calls == []
        ops.op_packet(name).redispatch(MPS, *first_case(name))
        assert calls == [name, name]  # directly, bnb_mps no longer in the way
    finally:
        registration.reinstate()
        theirs._destroy()


def test_hand_back_happens_once_and_keeps_other_ops(no_gpu_tier):
    name = "quantize_4bit"
    before = set(registration.registered("MPS"))
    for _ in range(3):
        ops.op_packet(name).redispatch(MPS, *first_case(name))
    assert set(registration.registered("MPS")) == before - {name}
    assert registration.skipped()[name] == ops.route(name).reason
    assert registration.reinstate() == [name]
    assert set(registration.registered("MPS")) == before


@pytest.mark.parametrize("name", sorted(n for n, op in ops.OPS.items() if op.kernel is not None))
def test_with_a_gpu_tier_our_kernel_serves(stand_in_gpu_tier, fallback_calls, name):
    args = first_case(name)
    assert ops.route(name).tier == "shader"
    ops.op_packet(name).redispatch(MPS, *copy.deepcopy(args))
    assert stand_in_gpu_tier.launched and fallback_calls == []
    assert has_mps_kernel_of_ours(name)


@pytest.mark.parametrize("name", ["gemm_4bit", "int8_scaled_mm", "dequantize_blockwise.out",
                                  "optimizer_update_8bit_blockwise"])  # fmt: skip
def test_with_a_gpu_tier_ops_without_kernels_still_avoid_the_round_trip(stand_in_gpu_tier, fallback_calls, monkeypatch,
                                                                        name):  # fmt: skip
    """An op whose Metal kernel is missing (every op has one now: taken away for the test)."""
    monkeypatch.setattr(ops.OPS[name], "kernel", None)
    args = first_case(name)
    r = ops.route(name)
    assert r.tier == ("cpu" if name in NOT_ON_MPS | {"dequantize_4bit.out", "gemv_4bit.out"} else "bitsandbytes")
    assert "no Metal kernel" in r.reason
    ops.op_packet(name).redispatch(MPS, *copy.deepcopy(args))
    assert stand_in_gpu_tier.launched == []
    assert fallback_calls == ([name] if r.tier == "cpu" else [])


def test_forcing_the_cpu_tier_forces_the_round_trip(fresh_tier_selection, fallback_calls):
    fresh_tier_selection.setenv("BNB_MPS_EXECUTOR", "cpu")
    for name in ("quantize_4bit", "gemm_4bit", "int8_vectorwise_quant"):
        assert ops.route(name).tier == "cpu"
        ops.op_packet(name).redispatch(MPS, *first_case(name))
    assert fallback_calls == ["quantize_4bit", "gemm_4bit", "int8_vectorwise_quant"]


def test_routes_follow_the_selection(no_gpu_tier):
    assert ops.route("quantize_4bit").tier == "bitsandbytes"
    no_gpu_tier.setenv("BNB_MPS_EXECUTOR", "cpu")
    executors.reset()
    assert ops.route("quantize_4bit").tier == "cpu"


# -- on a Mac -----------------------------------------------------------------------------------------


@pytest.mark.mps
@pytest.mark.parametrize("name", ["quantize_4bit", "dequantize_4bit", "quantize_blockwise", "gemm_4bit",
                                  "int8_vectorwise_quant", "optimizer_update_32bit", "dequantize_4bit.out"])
def test_mps_without_a_gpu_tier_hands_back_to_bitsandbytes(no_gpu_tier, fallback_calls, name):
    """On real mps tensors with both GPU tiers standing in as unavailable: bitsandbytes' own mps
    path serves (its mps backend kernel or its default kernel on the GPU), never the round trip,
    and gives what bitsandbytes alone gives."""
    args = [a.to("mps") if isinstance(a, torch.Tensor) else a for a in first_case(name)]
    want = stock_mps_result(name, copy.deepcopy(args))
    got = ops.op_packet(name)(*copy.deepcopy(args))
    assert fallback_calls == []
    assert ops.route(name).tier == "bitsandbytes"
    want_cpu = [w.cpu() if isinstance(w, torch.Tensor) else w for w in (want if isinstance(want, tuple) else [want])]
    got_cpu = [g.cpu() if isinstance(g, torch.Tensor) else g for g in (got if isinstance(got, tuple) else [got])]
    assert_same(got_cpu, want_cpu)


@pytest.mark.mps
def test_mps_round_trip_for_what_bitsandbytes_cannot_run(no_gpu_tier, fallback_calls):
    name = "int8_double_quant"
    A = torch.randn(64, 128, dtype=torch.float16)
    got = ops.op_packet(name)(A.to("mps"), 0.0)
    assert fallback_calls == [name]
    want = ops.OPS[name].composite(A, 0.0)
    for g, w in zip(got, want):
        if isinstance(w, torch.Tensor):
            assert g.device.type == "mps" and torch.equal(g.cpu(), w)
