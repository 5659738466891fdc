"""Bad input to any op on mps raises ValueError/TypeError naming the argument, before any copy.

The op layer serves these calls through the forced CPU round trip (on Linux, without it, ops that
bitsandbytes can run on mps are handed back to bitsandbytes, whose own checks then apply)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch._C import DispatchKey, DispatchKeySet

import op_inputs
from bnb_mps.ops import cpu_round_trip as cpu
from bnb_mps.ops.validation import DtypeError

MPS = DispatchKeySet(DispatchKey.MPS)


def packet(name):
    base, _, overload = name.partition(".")
    return getattr(getattr(torch.ops.bitsandbytes, base), overload or "default")


@pytest.fixture(autouse=True)
def cpu_round_trip(fresh_tier_selection):
    fresh_tier_selection.setenv("BNB_MPS_EXECUTOR", "cpu")


@pytest.fixture(autouse=True)
def no_fallback_on_bad_input(monkeypatch):
    """Fail loudly if anything reaches the CPU transfer (checks must come first)."""
    state = {"armed": True}
    real = cpu.run

    def guarded(name, args):
        if state["armed"]:
            raise AssertionError(f"{name}: bad input reached the CPU fallback")
        return real(name, args)

    monkeypatch.setattr(cpu, "run", guarded)
    return state


def first(name):
    return copy.deepcopy(next(op_inputs.cases(name))[1])


def find(name, pred):
    for _, args in op_inputs.cases(name):
        if pred(args):
            return copy.deepcopy(args)
    raise LookupError(name)


def expect(exc, name, args, *words):
    with pytest.raises(exc) as info:
        packet(name).redispatch(MPS, *args)
    msg = str(info.value)
    assert name.split(".")[0] in msg, msg
    for w in words:
        assert w in msg, f"{w!r} not in {msg!r}"


# (schema, argument index, replacement, argument name in the message)
WRONG_DTYPES = [
    ("quantize_blockwise", 0, lambda a: a.to(torch.int32), "A"),
    ("quantize_blockwise", 1, lambda c: c.to(torch.int32), "code"),
    ("dequantize_blockwise", 0, lambda a: a.to(torch.int8), "A"),
    ("dequantize_blockwise", 1, lambda a: a.to(torch.int32), "absmax"),
    ("dequantize_blockwise", 4, lambda d: torch.int32, "dtype"),
    ("dequantize_blockwise.out", 5, lambda o: o.double(), "out"),
    ("quantize_4bit", 0, lambda a: a.double(), "A"),
    ("dequantize_4bit", 1, lambda a: a.half(), "absmax"),
    ("dequantize_4bit", 5, lambda d: torch.int8, "dtype"),
    ("dequantize_4bit.out", 6, lambda o: o.to(torch.float64), "out"),
    ("gemv_4bit", 0, lambda a: a.to(torch.int32), "A"),
    ("gemv_4bit", 1, lambda b: b.to(torch.int32), "B"),
    ("gemv_4bit", 4, lambda c: c.to(torch.int32), "code"),
    ("gemv_4bit.out", 6, lambda o: o.to(torch.float64), "out"),
    ("gemm_4bit", 3, lambda a: a.half(), "absmax"),
    ("int8_vectorwise_quant", 0, lambda a: a.to(torch.int32), "A"),
    ("int8_vectorwise_dequant", 0, lambda a: a.to(torch.int32), "A"),
    ("int8_vectorwise_dequant", 1, lambda s: s.to(torch.int32), "stats"),
    ("int8_linear_matmul", 0, lambda a: a.to(torch.int32), "A"),
    ("int8_linear_matmul", 1, lambda b: b.float(), "B"),
    ("int8_linear_matmul.out", 2, lambda o: o.float(), "out"),
    ("int8_mm_dequant", 0, lambda a: a.float(), "A"),
    ("int8_mm_dequant", 1, lambda r: r.half(), "row_stats"),
    ("int8_mm_dequant", 3, lambda d: torch.int64, "dtype"),
    ("int8_scaled_mm", 3, lambda c: c.double(), "col_stats"),
    ("int8_mixed_scaled_mm", 1, lambda c: c.to(torch.int32), "CA"),
    ("int8_double_quant", 0, lambda a: a.to(torch.int8), "A"),
    ("optimizer_update_32bit", 1, lambda g: g.double(), "g"),
    ("optimizer_update_32bit", 3, lambda s: s.to(torch.int32), "state1"),
    ("optimizer_update_8bit_blockwise", 3, lambda s: s.float(), "state1"),
    ("optimizer_update_8bit_blockwise", 12, lambda q: q.half(), "qmap1"),
]


@pytest.mark.parametrize("name,index,change,arg", WRONG_DTYPES, ids=[f"{n}-{a}" for n, _, _, a in WRONG_DTYPES])
def test_wrong_dtype(name, index, change, arg):
    args = first(name)
    args[index] = change(args[index])
    expect(DtypeError, name, args, arg)
    # a DtypeError is both kinds, as users may catch either
    assert issubclass(DtypeError, TypeError) and issubclass(DtypeError, ValueError)


MISMATCHED = [
    ("quantize_blockwise", 1, lambda c: c[:0], "code"),
    ("dequantize_blockwise", 1, lambda a: a[:-1], "absmax"),
    ("dequantize_blockwise.out", 5, lambda o: o.reshape(-1)[:-1], "out"),
    ("dequantize_4bit", 0, lambda a: a[:-1], "A"),
    ("dequantize_4bit", 1, lambda a: a[:-1], "absmax"),
    ("dequantize_4bit.out", 6, lambda o: o[:-1], "out"),
    ("gemv_4bit", 2, lambda s: [s[0], s[1] + 1], "shapeB"),
    ("gemv_4bit", 2, lambda s: [s[0]], "shapeB"),
    ("gemv_4bit", 4, lambda c: c[:1], "code"),
    ("gemv_4bit", 1, lambda b: b[: b.numel() // 2], "B"),
    ("gemv_4bit.out", 6, lambda o: o[..., :-1], "out"),
    ("gemm_4bit", 0, lambda a: a[..., :-1], "shapeB"),
    ("int8_vectorwise_dequant", 1, lambda s: s[:-1], "stats"),
    ("int8_linear_matmul", 1, lambda b: b[:, :-1], "B"),
    ("int8_linear_matmul.out", 2, lambda o: o[:-1], "out"),
    ("int8_mm_dequant", 2, lambda c: c[:-1], "col_stats"),
    ("int8_scaled_mm", 2, lambda r: r[:-1], "row_stats"),
    ("int8_mixed_scaled_mm", 1, lambda c: c[:-1], "CA"),
    ("optimizer_update_32bit", 1, lambda g: g[:-1], "g"),
    ("optimizer_update_32bit", 3, lambda s: s[:-1], "state1"),
    ("optimizer_update_8bit_blockwise", 3, lambda s: s[:-1], "state1"),
    ("optimizer_update_8bit_blockwise", 14, lambda a: a[:-1], "absmax1"),
]


@pytest.mark.parametrize("name,index,change,arg", MISMATCHED, ids=[f"{n}-{a}-{i}" for i, (n, _, _, a) in enumerate(MISMATCHED)])
def test_mismatched_shape(name, index, change, arg):
    args = first(name)
    args[index] = change(args[index])
    expect(ValueError, name, args, arg)


@pytest.mark.parametrize("name,index", [
    ("quantize_4bit", 1), ("dequantize_4bit", 2), ("dequantize_4bit.out", 2), ("gemv_4bit", 5),
    ("gemv_4bit.out", 5), ("gemm_4bit", 4),
])  # fmt: skip
@pytest.mark.parametrize("blocksize", [0, 16, 100, 8192, -64])
def test_unsupported_4bit_blocksize(name, index, blocksize):
    """bitsandbytes' 4-bit ops take blocksizes 32..4096 (its op contract)."""
    args = first(name)
    args[index] = blocksize
    expect(ValueError, name, args, "blocksize", str(blocksize))


@pytest.mark.parametrize("name,index", [("quantize_blockwise", 2), ("dequantize_blockwise", 3),
                                        ("dequantize_blockwise.out", 3)])  # fmt: skip
@pytest.mark.parametrize("blocksize", [0, -64])
def test_8bit_blocksize_must_be_positive(name, index, blocksize):
    """bitsandbytes' 8-bit blockwise ops take any positive blocksize (those outside 64..4096 are served
    by bitsandbytes' own code: tests/test_not_covered.py); others are errors."""
    args = first(name)
    args[index] = blocksize
    expect(ValueError, name, args, "blocksize", str(blocksize))


@pytest.mark.parametrize("name,index", [("quantize_4bit", 2), ("dequantize_4bit", 3), ("dequantize_4bit.out", 3),
                                        ("gemm_4bit", 5)])  # fmt: skip
@pytest.mark.parametrize("quant_type", ["int4", "NF4", ""])
def test_unsupported_quant_type(name, index, quant_type):
    args = first(name)
    args[index] = quant_type
    expect(ValueError, name, args, "quant_type", repr(quant_type))


@pytest.mark.parametrize("name,index,arg", [
    ("quantize_blockwise", 1, "code"), ("dequantize_blockwise", 1, "absmax"), ("dequantize_blockwise.out", 5, "out"),
    ("dequantize_4bit", 1, "absmax"), ("gemv_4bit", 3, "absmax"), ("gemv_4bit.out", 6, "out"), ("gemm_4bit", 1, "B"),
    ("int8_vectorwise_dequant", 1, "stats"), ("int8_linear_matmul", 1, "B"), ("int8_mm_dequant", 2, "col_stats"),
    ("int8_scaled_mm", 1, "B"), ("int8_mixed_scaled_mm", 4, "SCB"), ("optimizer_update_32bit", 3, "state1"),
    ("optimizer_update_8bit_blockwise", 12, "qmap1"),
])  # fmt: skip
def test_tensors_on_different_devices(name, index, arg):
    args = first(name)
    args[index] = args[index].to("meta")
    expect(ValueError, name, args, arg, "device")


@pytest.mark.parametrize("name", ["optimizer_update_32bit", "optimizer_update_8bit_blockwise"])
def test_unknown_optimizer_name(name):
    args = first(name)
    args[0] = "adamw"
    expect(ValueError, name, args, "optimizer_name", "'adamw'")


@pytest.mark.parametrize("name,state2_index", [("optimizer_update_32bit", 4), ("optimizer_update_8bit_blockwise", 4)])
def test_two_state_optimizer_needs_state2(name, state2_index):
    args = find(name, lambda a: a[0] == "adam")
    args[state2_index] = None
    expect(ValueError, name, args, "state2")


def test_missing_tensor_is_a_type_error():
    args = first("gemm_4bit")
    args[3] = None
    with pytest.raises(TypeError, match="absmax"):
        packet("gemm_4bit").redispatch(MPS, *args)


def test_good_input_still_reaches_the_fallback(no_fallback_on_bad_input):
    no_fallback_on_bad_input["armed"] = False
    packet("quantize_blockwise").redispatch(MPS, *first("quantize_blockwise"))


# -- the checks the robustness review asked for ---------------------------------------------------
# Some of these only reach the op layer when called from Python directly: through the dispatcher
# a str is refused by PyTorch itself (RuntimeError) and a bool becomes 1.0 for a float argument.


def expect_op_layer(exc, name, args, *words):
    from bnb_mps import ops
    from bnb_mps.testing import RecordingExecutor

    recorder = RecordingExecutor()
    with pytest.raises(exc) as info:
        ops.call(ops.OPS[name], tuple(args), {}, recorder)
    msg = str(info.value)
    assert name.split(".")[0] in msg, msg
    for w in words:
        assert w in msg, f"{w!r} not in {msg!r}"
    assert recorder.launches == []


@pytest.mark.parametrize("name", ["int8_vectorwise_quant", "int8_double_quant"])
@pytest.mark.parametrize("threshold", [True, "6.0"])
def test_threshold_must_be_a_number(name, threshold):
    """(A number that is not > 0, NaN included, means no outliers, as in bitsandbytes.)"""
    expect_op_layer(TypeError, name, [torch.randn(4, 8, dtype=torch.float16), threshold], "threshold")


@pytest.mark.parametrize("name,index,arg", [("dequantize_4bit", 4, "shape"), ("dequantize_4bit.out", 4, "shape"),
                                            ("gemv_4bit", 2, "shapeB"), ("gemm_4bit", 2, "shapeB")])  # fmt: skip
def test_negative_sizes(name, index, arg):
    args = first(name)
    args[index] = [-s for s in args[index]]
    expect(ValueError, name, args, arg, "negative")


@pytest.mark.parametrize("name,index", [("optimizer_update_32bit", 14), ("optimizer_update_8bit_blockwise", 10)])
@pytest.mark.parametrize("step", [1.0, "2", None])
def test_step_must_be_an_int(name, index, step):
    """(A step below 1 is bitsandbytes' to compute: tests/test_not_covered.py.)"""
    args = first(name)
    args[index] = step
    expect_op_layer(TypeError, name, args, "step", "int")


@pytest.mark.parametrize("name,index,arg", [("optimizer_update_32bit", 15, "lr"), ("optimizer_update_32bit", 8, "beta1"),
                                            ("optimizer_update_8bit_blockwise", 11, "lr"),
                                            ("optimizer_update_8bit_blockwise", 9, "eps")])  # fmt: skip
@pytest.mark.parametrize("value", ["0.001", None, True, torch.tensor(0.1)])
def test_hyperparameters_must_be_numbers(name, index, arg, value):
    args = first(name)
    args[index] = value
    expect_op_layer(TypeError, name, args, arg, "number")


@pytest.mark.parametrize("name,index", [("quantize_blockwise", 2), ("quantize_4bit", 1), ("gemm_4bit", 4)])
def test_blocksize_true_is_not_an_int(name, index):
    args = first(name)
    args[index] = True
    expect_op_layer(TypeError, name, args, "blocksize", "int")


# Every op with a Metal kernel, as (name, arguments on meta) with more elements than its 32-bit
# indexing takes (meta tensors cost nothing).
HUGE = 2**32
HUGE_CASES = [
    ("quantize_blockwise", lambda: [torch.empty(HUGE, dtype=torch.float16, device="meta"),
                                    torch.empty(256, device="meta"), 256]),
    ("dequantize_blockwise", lambda: [torch.empty(HUGE, dtype=torch.uint8, device="meta"),
                                      torch.empty(HUGE // 256, device="meta"), torch.empty(256, device="meta"), 256,
                                      torch.float16]),
    ("dequantize_blockwise.out", lambda: [torch.empty(HUGE, dtype=torch.uint8, device="meta"),
                                          torch.empty(HUGE // 256, device="meta"), torch.empty(256, device="meta"),
                                          256, torch.float16, torch.empty(HUGE, dtype=torch.float16, device="meta")]),
    ("quantize_4bit", lambda: [torch.empty(HUGE, dtype=torch.float16, device="meta"), 64, "nf4", torch.uint8]),
    ("dequantize_4bit", lambda: [torch.empty(HUGE // 2, dtype=torch.uint8, device="meta"),
                                 torch.empty(HUGE // 64, device="meta"), 64, "nf4", [HUGE], torch.float16]),
    ("dequantize_4bit.out", lambda: [torch.empty(HUGE // 2, dtype=torch.uint8, device="meta"),
                                     torch.empty(HUGE // 64, device="meta"), 64, "nf4", [HUGE], torch.float16,
                                     torch.empty(HUGE, dtype=torch.float16, device="meta")]),
    ("gemm_4bit", lambda: [torch.empty(1, 2**16, dtype=torch.float16, device="meta"),
                           torch.empty(HUGE // 2, dtype=torch.uint8, device="meta"),
                           [HUGE // 2**16, 2**16], torch.empty(HUGE // 64, device="meta"), 64, "nf4"]),
    ("gemv_4bit", lambda: [torch.empty(1, 2**16, dtype=torch.float16, device="meta"),
                           torch.empty(HUGE // 2, dtype=torch.uint8, device="meta"),
                           [HUGE // 2**16, 2**16], torch.empty(HUGE // 64, device="meta"),
                           torch.empty(16, device="meta"), 64]),
]  # fmt: skip


@pytest.mark.parametrize("name,make", HUGE_CASES, ids=[n for n, _ in HUGE_CASES])
def test_element_count_guard_fires_before_any_allocation(name, make):
    """Beyond 32-bit indexing the kernels do not cover a call (the op layer then serves it by the next
    route, tests/test_not_covered.py): said before anything is allocated or launched."""
    from bnb_mps import ops
    from bnb_mps.ops.validation import NotCovered
    from bnb_mps.testing import AllocationCounter, RecordingExecutor

    args = make()
    recorder = RecordingExecutor()
    op = ops.OPS[name]
    op.check(*args)
    with AllocationCounter() as alloc, pytest.raises(NotCovered, match="the kernels take fewer than"):
        op.kernel(recorder, *args)
    assert alloc.count == 0 and recorder.launches == []
