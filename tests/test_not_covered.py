"""Calls whose arguments bitsandbytes accepts but bnb_mps' kernels do not cover (an 8-bit blocksize
outside 64..4096, a code of another dtype or length, absmax or states in another float dtype, a
step below 1, an infinite learning rate, a tensor beyond 32-bit indexing) are served by the next
route, bitsandbytes' own implementation, and give exactly what stock bitsandbytes gives; they never
raise an error stock would not raise. What stock rejects too still raises bnb_mps' clearer error.

The reference is always stock bitsandbytes itself, run with bnb_mps out of the way: on the `cpu`
key (bnb_mps' emulated kernels registered there by `use_emulated_kernels`) bitsandbytes' CPU
kernels, and on the `mps` key (reached with `redispatch` on CPU tensors, the emulated tier serving
mps) bitsandbytes' own mps implementation with bnb_mps unregistered.
"""

from __future__ import annotations

import copy

import bitsandbytes.functional as F
import pytest
import torch
from torch._C import DispatchKey, DispatchKeySet

import bnb_mps
import op_inputs
from bnb_mps import executors, ops, registration
from bnb_mps.ops import launch
from bnb_mps.ops.validation import NotCovered
from bnb_mps.testing import RecordingExecutor, use_emulated_kernels

pytest.importorskip("bnb_mps._emu")
MPS = DispatchKeySet(DispatchKey.MPS)
bnb = torch.ops.bitsandbytes


def same(got, want) -> bool:
    if isinstance(want, (tuple, list)):
        return len(got) == len(want) and all(same(g, w) for g, w in zip(got, want))
    if isinstance(want, torch.Tensor):
        return got.dtype == want.dtype and got.shape == want.shape and torch.equal(got.view(-1).view(torch.uint8),
                                                                                want.view(-1).view(torch.uint8))
    return got == want


def first_case(name):
    return copy.deepcopy(next(op_inputs.cases(name))[1])


def randn(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def codes(n, seed=0):
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


CODE = F.create_dynamic_map(signed=True)


# -- the cpu key: bnb_mps' emulated kernels against bitsandbytes' CPU kernels ----------------------------

# (name, a function of nothing that makes the call's arguments, what bnb_mps' kernels do not cover)
CASES = [
    *[(f"quantize_blockwise-bs{bs}", "quantize_blockwise", lambda bs=bs: [randn(5000, seed=bs), CODE, bs])
      for bs in (16, 32, 100, 8192, 16384)],
    ("quantize_blockwise-fp16", "quantize_blockwise", lambda: [randn(3000, dtype=torch.float16), CODE, 16384]),
    *[(f"dequantize_blockwise-bs{bs}", "dequantize_blockwise",
       lambda bs=bs: [codes(5000), randn(-(-5000 // bs)).abs(), CODE, bs,
                      torch.float32]) for bs in (16, 100, 8192, 16384)],
]  # fmt: skip


@pytest.mark.parametrize("label,name,make", CASES, ids=[c[0] for c in CASES])
def test_cpu_key_call_equals_stock(label, name, make):
    packet = ops.op_packet(name)
    want = packet(*make())  # bitsandbytes' CPU kernel, bnb_mps not registered for cpu
    ops.reset_call_counts()
    with use_emulated_kernels() as kernels:
        got = packet(*make())
    assert same(got, want)
    assert kernels.launched == []  # no kernel of ours ran for it
    assert ops.call_counts()[name] == {"bitsandbytes": 1}


def test_blockwise_round_trip_at_blocksizes_bitsandbytes_takes():
    """bitsandbytes' own test_blockwise_cpu_large: blocksize 16384 round-trips through its API."""
    A = randn(2**15 + 17)
    want_q, want_state = F.quantize_blockwise(A, blocksize=16384)
    want = F.dequantize_blockwise(want_q, want_state)
    with use_emulated_kernels():
        q, state = F.quantize_blockwise(A, blocksize=16384)
        got = F.dequantize_blockwise(q, state)
    assert torch.equal(q, want_q) and torch.equal(state.absmax, want_state.absmax) and torch.equal(got, want)
    assert (got - A).abs().mean() < 0.02


def test_a_repeated_uncovered_call_is_kept_with_the_plans():
    """The second call of an uncovered signature is one lookup of what served the first."""
    entry = ops.dispatcher_entry("quantize_blockwise", RecordingExecutor(), None,
                                 registration.stock_kernel("CPU", "quantize_blockwise"))  # fmt: skip
    args = (randn(3000), CODE, 16384)
    first = entry(args, {})
    assert len(entry.plans) == 1
    (kept,) = entry.plans.values()
    assert kept.counted == ("quantize_blockwise", "bitsandbytes")
    assert same(entry(args, {}), first) and same(first, ops.op_packet("quantize_blockwise")(*args))


# -- the mps key: the emulated tier serves mps, bitsandbytes' own mps implementation is the next route --


@pytest.fixture
def emulated_mps(fresh_tier_selection):
    fresh_tier_selection.setenv("BNB_MPS_EXECUTOR", "emulated")
    fresh_tier_selection.setenv("BNB_MPS_VERIFY", "0")
    ops.routing.forget()
    ops.reset_call_counts()
    yield
    ops.routing.forget()


def stock_mps(name, args):
    """bitsandbytes' own mps implementation of `name` (its mps kernel, else its default kernel), with
    bnb_mps unregistered: the reference."""
    bnb_mps.unregister()
    try:
        return ops.op_packet(name).redispatch(MPS, *args)
    finally:
        bnb_mps.register()


MPS_CASES = [
    ("quantize_blockwise", lambda: [randn(5000), CODE, 16384], "blocksize 16384"),
    ("quantize_blockwise", lambda: [randn(700, dtype=torch.bfloat16), CODE, 100], "blocksize 100"),
    # (bitsandbytes' CPU kernel reads 256 float32 values whatever the code: only its mps code takes these)
    ("quantize_blockwise", lambda: [randn(3000), CODE.half(), 256], "code of dtype torch.float16"),
    ("quantize_blockwise", lambda: [randn(3000), torch.linspace(-1, 1, 16), 256], "code of 16 values"),
    ("dequantize_blockwise", lambda: [codes(5000), randn(1).abs(), CODE, 8192,
                                      torch.float16], "blocksize 8192"),  # fmt: skip
    ("dequantize_blockwise", lambda: [codes(3000), randn(12).abs().half(), CODE, 256, torch.float16],
     "absmax of dtype torch.float16"),
    ("gemv_4bit", lambda: _gemv(absmax_dtype=torch.float16), "absmax of dtype torch.float16"),
    ("gemv_4bit", lambda: _gemv(code_dtype=torch.bfloat16), "code of dtype torch.bfloat16"),
    ("quantize_4bit", lambda: [randn(64, 64), 64, "nf4", torch.uint16], "quant_storage torch.uint16"),
]


def _gemv(absmax_dtype=torch.float32, code_dtype=torch.float32):
    W = randn(24, 64, seed=3)
    packed, absmax = bnb.quantize_4bit.default(W, 64, "nf4", torch.uint8)
    code = F.get_4bit_type("nf4", device="cpu")
    return [randn(1, 64, seed=4), packed, [24, 64], absmax.to(absmax_dtype), code.to(code_dtype), 64]


@pytest.mark.parametrize("name,make,what", MPS_CASES, ids=[c[2] for c in MPS_CASES])
def test_mps_key_call_equals_bitsandbytes_own_mps_implementation(emulated_mps, name, make, what):
    want = stock_mps(name, make())
    got = ops.op_packet(name).redispatch(MPS, *make())
    assert same(got, want)
    assert ops.call_counts()[name] == {"bitsandbytes": 1}
    note = bnb_mps.backend_info()[name]["note"]
    assert what in note and "bitsandbytes' own implementation" in note


def test_covered_calls_of_the_same_op_still_run_the_kernels(emulated_mps):
    A = randn(5000)
    ops.op_packet("quantize_blockwise").redispatch(MPS, A, CODE, 16384)
    ops.op_packet("quantize_blockwise").redispatch(MPS, A, CODE, 256)
    assert ops.call_counts()["quantize_blockwise"] == {"bitsandbytes": 1, "emulated": 1}
    assert ops.route("quantize_blockwise").tier == "emulated"  # the op keeps its route


def test_optimizer_step_zero_and_infinite_lr_take_bitsandbytes_update(emulated_mps):
    """The kernels count steps from 1 and take finite hyperparameters; bitsandbytes computes the
    others (or raises, as its adam does for step 0: a division by zero), and so does bnb_mps."""
    name = "optimizer_update_32bit"
    for optimizer, index, value in (("momentum", 14, 0), ("adam", 14, 0), ("adam", 15, float("inf"))):
        mine = first_case(name)
        mine[0], mine[index] = optimizer, value
        theirs = copy.deepcopy(mine)
        try:
            stock_mps(name, theirs)
        except Exception as e:
            with pytest.raises(type(e)):
                ops.op_packet(name).redispatch(MPS, *mine)
            continue
        ops.op_packet(name).redispatch(MPS, *mine)
        for got, want in zip(mine[1:5], theirs[1:5]):
            assert got is None or same(got, want)
    assert ops.call_counts()[name] == {"bitsandbytes": 3}


@pytest.mark.parametrize("uncovered,index,value", [("step 0", 14, 0), ("an infinite lr", 15, float("inf")),
                                                   ("an lr beyond float32", 15, 1e39), ("a NaN lr", 15, float("nan"))])  # fmt: skip
def test_an_uncovered_optimizer_call_leaves_later_covered_calls_of_its_signature_on_the_kernels(
        emulated_mps, uncovered, index, value):  # fmt: skip
    """Fault R2: an uncovered optimizer call (step 0, an infinite lr: per-call values, left out of the
    call signature) made every later, covered call of the same signature go to bitsandbytes' own code.
    Uncovered and covered calls of one signature alternate, the uncovered one first (found when the
    signature is resolved) and again after a covered one (found when the kept kernel plan runs): each
    covered call runs the kernel and updates the states as the kernel does on its own."""
    name = "optimizer_update_32bit"
    uncovered_call = first_case(name)
    uncovered_call[0] = "momentum"  # (bitsandbytes' momentum takes step 0; its adam divides by zero there)
    uncovered_call[index] = value
    covered = first_case(name)
    covered[0] = "momentum"
    want = copy.deepcopy(covered)
    ops.OPS[name].kernel(executors.load_tier("emulated"), *want)  # the kernel, called directly
    for _ in range(2):
        ops.op_packet(name).redispatch(MPS, *copy.deepcopy(uncovered_call))
        got = copy.deepcopy(covered)
        ops.op_packet(name).redispatch(MPS, *got)
        assert all(g is None or same(g, w) for g, w in zip(got[1:5], want[1:5]))
    assert ops.call_counts()[name] == {"bitsandbytes": 2, "emulated": 2}


@pytest.mark.parametrize("threshold", [-1.0, -0.0, float("nan"), float("-inf")])
@pytest.mark.parametrize("name", ["int8_vectorwise_quant", "int8_double_quant"])
def test_int8_threshold_that_is_not_positive_means_no_outliers(emulated_mps, name, threshold):
    """Fault N1: a negative or NaN threshold took the outlier path. Through the mps key (bnb-mps'
    emulated kernels serve it), against no threshold at all: bitsandbytes' own CPU code (bnb-mps is not
    registered for cpu) where it has one, else the SPEC reference (tests/reference_int8.py)."""
    import reference_int8

    A = randn(6, 40, dtype=torch.float16) * 3
    A[2, 5] = 100.0  # (an outlier, were any threshold taken)
    if name == "int8_vectorwise_quant":
        want = ops.op_packet(name)(A.clone(), 0.0)
    else:  # (bitsandbytes has no CPU int8_double_quant)
        want = reference_int8.int8_double_quant(A, 0.0, flush=True)
    got = ops.op_packet(name).redispatch(MPS, A.clone(), threshold)
    assert ops.call_counts()[name] == {"emulated": 1}
    assert got[-1] is None and same(tuple(got[:-1]), tuple(want[:-1])), got


def test_gemm_4bit_ignores_absmax_code_without_absmax_8bit(emulated_mps):
    """bitsandbytes reads absmax_code and absmax_offset only with absmax_8bit: so does bnb_mps."""
    args = first_case("gemm_4bit")
    plain = ops.op_packet("gemm_4bit").redispatch(MPS, *args[:6])
    ignored = ops.op_packet("gemm_4bit").redispatch(MPS, *args[:6], None, None, torch.zeros(3), torch.tensor(5.0))
    assert same(ignored, plain)


# -- what stock rejects too is still an error, and before anything runs --------------------------------


@pytest.mark.parametrize("blocksize", [0, -64])
def test_blocksizes_no_implementation_takes_are_errors(emulated_mps, blocksize):
    with pytest.raises(ValueError, match="blocksize must be a positive int"):
        ops.op_packet("quantize_blockwise").redispatch(MPS, randn(64), CODE, blocksize)


@pytest.mark.parametrize("blocksize", [16, 100, 8192])
def test_4bit_blocksizes_stay_bitsandbytes_contract(emulated_mps, blocksize):
    """bitsandbytes' 4-bit ops take blocksizes 32..4096 only (its op contract, _ops.py)."""
    with pytest.raises(ValueError, match="blocksize must be one of 32, "):
        ops.op_packet("quantize_4bit").redispatch(MPS, randn(64, 64), blocksize, "nf4", torch.uint8)


def test_an_error_beats_what_is_not_covered(emulated_mps):
    """A call with an uncovered blocksize and a wrong argument raises the error (stock rejects it)."""
    with pytest.raises(ValueError, match="code"):
        ops.op_packet("quantize_blockwise").redispatch(MPS, randn(64), CODE.to(torch.int32), 16384)


HUGE_CASES = [
    ("quantize_blockwise", lambda: [torch.empty(5000, device="meta"), torch.empty(256, device="meta"), 256]),
    ("quantize_4bit", lambda: [torch.empty(5000, dtype=torch.float16, device="meta"), 64, "nf4", torch.uint8]),
    ("dequantize_4bit", lambda: [torch.empty(2500, dtype=torch.uint8, device="meta"),
                                 torch.empty(79, device="meta"), 64, "nf4", [5000], torch.float16]),
    ("gemv_4bit", lambda: [torch.empty(1, 100, device="meta"), torch.empty(2500, dtype=torch.uint8, device="meta"),
                           [50, 100], torch.empty(79, device="meta"), torch.empty(16, device="meta"), 64]),
]  # fmt: skip


@pytest.mark.parametrize("name,make", HUGE_CASES, ids=[n for n, _ in HUGE_CASES])
def test_beyond_32bit_indexing_is_not_covered_before_anything_is_allocated(monkeypatch, name, make):
    """(The limit lowered to 4096 elements so that the test needs no 4 GB tensor.)"""
    from bnb_mps.testing import AllocationCounter

    monkeypatch.setattr(launch, "MAX_ELEMENTS", 4096)
    recorder = RecordingExecutor()
    op = ops.OPS[name]
    args = make()
    op.check(*args)
    with AllocationCounter() as alloc, pytest.raises(NotCovered, match="the kernels take fewer than 4096"):
        op.kernel(recorder, *args)
    assert alloc.count == 0 and recorder.launches == []
