"""Launch plans (bnb_mps.ops.plan): a call served from a kept plan does exactly what the full path does.

The op layer keeps the plan of each call of a planned op, keyed by the metadata of its arguments, and
runs a later call with the same key from that plan without binding, checking or planning it again.
Everything here compares that with the full path (`ops.call` with no plan kept: bind, check, plan,
run), which the kernel and validation tests check against the references:

- the same launches (kernel, geometry, every bound buffer and scalar) and the same results, for every
  case of tests/op_inputs.py, on the second and third call; and, for a call with the same metadata
  and other values in other buffers, the full path's results for those values;
- exactly the same errors for bad input after good calls were planned: every argument of a planned
  call changed in each way that matters to a check (dtype, shape, device, layout, offset, value,
  type), with the outcome of the full path as the reference;
- the per-call scalars of the optimizers (step, learning rate, ...) follow each call;
- the plans are dropped when the tier selection or a route changes, the cache is bounded, keeps no
  tensor alive, and a refused launch on the fast path moves the op on as on the full path;
- the C++ key (bnb_mps._opkey) tells exactly the calls apart that the Python key tells apart.
"""

from __future__ import annotations

import copy
import gc
import itertools
import weakref

import pytest
import torch

import op_inputs
from test_routing import limited_gpu_tier, stand_in_gpu_tier, stock_mps_result  # noqa: F401  (fixtures)
from bnb_mps import executors, ops
from bnb_mps.ops import plan, routing
from bnb_mps.testing import RecordingExecutor, describe_arg

PLANNED = sorted(name for name, op in ops.OPS.items() if op.planned is not None)
KEYS = {"python": plan.metadata_key}
if plan.key is not plan.metadata_key:
    KEYS["c++"] = plan.key


@pytest.fixture(params=sorted(KEYS))
def key_impl(request, monkeypatch):
    """Each test runs with the C++ key (where bnb_mps._opkey is built) and with the Python one."""
    monkeypatch.setattr(plan, "key", KEYS[request.param])
    return request.param


def test_the_planned_ops_are_the_hot_ones():
    assert {"gemm_4bit", "gemv_4bit", "gemv_4bit.out", "quantize_4bit", "dequantize_4bit", "dequantize_4bit.out",
            "quantize_blockwise", "dequantize_blockwise", "dequantize_blockwise.out",
            "optimizer_update_8bit_blockwise", "optimizer_update_32bit"} <= set(PLANNED)  # fmt: skip


class Counting:
    """Counts the planner's calls of one op (a kept plan is run without planning)."""

    def __init__(self, monkeypatch, name):
        planned = ops.OPS[name].planned
        self.calls = 0
        real = planned.planner

        def planner(*args, **kwargs):
            self.calls += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(planned, "planner", planner)


def outcome(fn):
    """What a call did: ("error", type, message) or ("ok", what it returned, described)."""
    try:
        result = fn()
    except Exception as e:  # noqa: BLE001  (the point is to compare any error)
        return ("error", type(e), str(e))
    return ("ok", describe(result))


def describe(x):
    if isinstance(x, torch.Tensor):
        return ("tensor", x.dtype, tuple(x.shape), tuple(x.stride()), x.device.type)
    if isinstance(x, (tuple, list)):
        return tuple(describe(v) for v in x)
    return x


def launches(recorder):
    return [(k, g, t, [describe_arg(a) if isinstance(a, torch.Tensor) else a for a in args])
            for k, g, t, args in recorder.launches]  # fmt: skip


# -- the same launches and results -------------------------------------------------------------------


@pytest.mark.parametrize("name", PLANNED)
def test_repeated_calls_launch_what_the_full_path_launches(key_impl, monkeypatch, name):
    counting = Counting(monkeypatch, name)
    for label, args in op_inputs.cases(name):
        full = RecordingExecutor(name="emulated")
        want = outcome(lambda: ops.call(ops.OPS[name], tuple(copy.deepcopy(args)), {}, full))
        assert want[0] == "ok", (label, want)
        fast = RecordingExecutor(name="emulated")
        entry = ops.dispatcher_entry(name, fast)
        before = counting.calls
        for _ in range(3):
            fast.clear()
            got = outcome(lambda: entry(tuple(copy.deepcopy(args)), {}))
            assert got == want, label
            assert launches(fast) == launches(full), label
        assert counting.calls == before + 1, f"{label}: planned once, then served from the plan"


@pytest.mark.parametrize("name", PLANNED)
def test_results_from_a_kept_plan_equal_the_full_path(key_impl, library, name):
    """With the kernels running (the emulator): same bits, in the outputs and in place."""
    from kernel_harness import EmulatedExecutor

    executor = EmulatedExecutor(library)
    entry = ops.dispatcher_entry(name, executor)
    for label, args in itertools.islice(op_inputs.cases(name), 4):
        want_args = copy.deepcopy(args)
        want = ops.call(ops.OPS[name], tuple(want_args), {}, executor)
        for _ in range(2):
            got_args = copy.deepcopy(args)
            got = entry(tuple(got_args), {})
            assert_same(got, want, label)
            assert_same(got_args, want_args, label)  # in-place updates and `out`


def other_values(args: list) -> list:
    """`args` with every tensor replaced by a new one (another buffer) of the same metadata (dtype,
    shape, strides, storage offset) holding other values: its elements rolled by one place, and a
    one-element float tensor scaled by 1.5. Plain values stay (they are part of the plan's key, or
    taken per call)."""
    out = []
    for a in args:
        if isinstance(a, torch.Tensor):
            new = copy.deepcopy(a)  # (a buffer of its own, the same metadata)
            values = a.reshape(-1).roll(1) if a.numel() > 1 else (a * 1.5 if a.is_floating_point() else a)
            new.copy_(values.reshape(a.shape))
            assert (new.stride(), new.storage_offset()) == (a.stride(), a.storage_offset())
            a = new
        out.append(a)
    return out


@pytest.mark.parametrize("name", PLANNED)
def test_a_kept_plan_computes_each_call_from_its_own_values(key_impl, monkeypatch, library, name):
    """A plan keeps what the arguments' metadata decide, nothing computed from their values: a later
    call with the same metadata and other values, in other buffers, served from the kept plan gives
    what the full path gives for those values (in the outputs and in place), which is not what the
    first call gave. A plan that kept a scale, a count or a buffer of the first call would fail here."""
    from kernel_harness import EmulatedExecutor

    counting = Counting(monkeypatch, name)
    executor = EmulatedExecutor(library)
    entry = ops.dispatcher_entry(name, executor)
    changed = 0
    for label, args in itertools.islice(op_inputs.cases(name), 4):
        first_args = copy.deepcopy(args)
        first = entry(tuple(first_args), {})  # planned and kept
        other = other_values(args)
        want_args = copy.deepcopy(other)
        want = ops.call(ops.OPS[name], tuple(want_args), {}, executor)  # the full path, for these values
        planned = counting.calls
        got_args = copy.deepcopy(other)
        got = entry(tuple(got_args), {})
        assert counting.calls == planned, f"{label}: served from the kept plan"
        assert_same(got, want, label)
        assert_same(got_args, want_args, label)  # in-place updates and `out`
        changed += not same_bits((first, first_args), (got, got_args))
    assert changed, "the other values changed no result: the test would not see a plan that kept them"


def same_bits(a, b) -> bool:
    try:
        assert_same(a, b, "")
    except AssertionError:
        return False
    return True


def assert_same(got, want, label):
    """Equal structure, dtypes, shapes and bits (NaN included)."""
    if isinstance(want, (tuple, list)):
        assert type(got) is type(want) and len(got) == len(want), label
        for g, w in zip(got, want):
            assert_same(g, w, label)
    elif isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and got.shape == want.shape, label
        assert torch.equal(bits(got), bits(want)), label
    else:
        assert got == want, label


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


# -- exactly as strict ------------------------------------------------------------------------------


def _moved(t: torch.Tensor) -> torch.Tensor:
    """The same values at storage offset 1 (a view into a larger tensor)."""
    base = torch.zeros(t.numel() + 1, dtype=t.dtype)
    base[1:] = t.reshape(-1)
    return base[1:].view(t.shape)


def _transposed(t: torch.Tensor) -> torch.Tensor:
    if t.dim() < 2:
        return t.unsqueeze(0).expand(2, *t.shape)[0]  # (contiguous after all: kept for the tally)
    return t.transpose(-1, -2).contiguous().transpose(-1, -2)


TENSOR_CHANGES = {
    "float16": lambda t: t.to(torch.float16),
    "float32": lambda t: t.to(torch.float32),
    "uint8": lambda t: t.to(torch.uint8),
    "int64": lambda t: t.to(torch.int64),
    "one more dimension": lambda t: t.unsqueeze(0),
    "one element less": lambda t: t.reshape(-1)[:-1] if t.numel() else t.reshape(1, 0),
    "one element more": lambda t: torch.cat([t.reshape(-1), t.reshape(-1)[:1]]) if t.numel() else torch.zeros(1),
    "on meta": lambda t: t.to("meta"),
    "transposed": _transposed,
    "at offset 1": _moved,
    "None": lambda t: None,
}
VALUE_CHANGES = {
    int: {"+1": lambda v: v + 1, "0": lambda v: 0, "-1": lambda v: -1, "as bool": lambda v: bool(v),
          "as float": lambda v: float(v)},
    float: {"nan": lambda v: float("nan"), "inf": lambda v: float("inf"), "-1": lambda v: -1.0, "0": lambda v: 0.0,
            "-0.0": lambda v: -0.0, "as int": lambda v: int(v)},
    str: {"other": lambda v: "int4", "empty": lambda v: ""},
    bool: {"flipped": lambda v: not v, "as int": lambda v: int(v)},
    list: {"first +1": lambda v: [v[0] + 1, *v[1:]], "one more": lambda v: [*v, 1],
           "as bools": lambda v: [True] * len(v)},
    torch.dtype: {"int8": lambda v: torch.int8, "float64": lambda v: torch.float64, "float16": lambda v: torch.float16},
    type(None): {"a tensor": lambda v: torch.zeros(4)},
}


def changes(args):
    """(label, changed args) for every argument changed in each way of the tables above."""
    for i, a in enumerate(args):
        table = TENSOR_CHANGES if isinstance(a, torch.Tensor) else VALUE_CHANGES.get(type(a), {})
        for how, change in table.items():
            changed = copy.deepcopy(args)
            try:
                changed[i] = change(changed[i])
            except RuntimeError:  # (a change that does not apply to this tensor)
                continue
            yield f"argument {i} {how}", changed


@pytest.mark.parametrize("name", PLANNED)
def test_bad_input_after_planned_calls_fails_as_on_the_full_path(key_impl, name):
    """Plans of good calls are kept first; then every changed call must do what the full path does
    with it (the same error, or the same launches), and the good calls still run their plans."""
    good = [args for _, args in itertools.islice(op_inputs.cases(name), 3)]
    fast = RecordingExecutor(name="emulated")
    entry = ops.dispatcher_entry(name, fast)
    for args in good:
        entry(tuple(copy.deepcopy(args)), {})
    compared = errors = 0
    for label, changed in changes(good[0]):
        full = RecordingExecutor(name="emulated")
        want = outcome(lambda: ops.call(ops.OPS[name], tuple(copy.deepcopy(changed)), {}, full))
        fast.clear()
        got = outcome(lambda: entry(tuple(copy.deepcopy(changed)), {}))
        assert got == want, label
        assert launches(fast) == launches(full), label
        compared += 1
        errors += want[0] == "error"
    assert compared >= 10 and errors >= 5, (compared, errors)
    for args in good:  # the good calls' plans are still there and right
        full = RecordingExecutor(name="emulated")
        ops.call(ops.OPS[name], tuple(copy.deepcopy(args)), {}, full)
        fast.clear()
        entry(tuple(copy.deepcopy(args)), {})
        assert launches(fast) == launches(full)


# -- the optimizers' per-call scalars -------------------------------------------------------------------


@pytest.mark.parametrize("name", ["optimizer_update_8bit_blockwise", "optimizer_update_32bit"])
def test_per_call_scalars_follow_each_call(key_impl, monkeypatch, name):
    """Step, learning rate, betas, ... are left out of the key: one plan serves every step, and each
    call's scalars (bias corrections, first-step and skip-zeros flags) are its own."""
    counting = Counting(monkeypatch, name)
    base = dict(op_inputs.cases(name))["adam-torch.float32"]
    positions = {
        "optimizer_update_8bit_blockwise": dict(step=10, lr=11, beta1=5, weight_decay=16, skip_zeros=18),
        "optimizer_update_32bit": dict(step=14, lr=15, beta1=8, weight_decay=13, skip_zeros=17),
    }[name]
    fast = RecordingExecutor(name="emulated")
    entry = ops.dispatcher_entry(name, fast)
    variants = [dict(step=1), dict(step=2), dict(step=7, lr=3e-4), dict(beta1=0.8), dict(weight_decay=0.0),
                dict(skip_zeros=True), dict(step=1, skip_zeros=True), dict(step=2)]  # fmt: skip
    planned = 0
    for variant in variants:
        args = copy.deepcopy(base)
        for arg, value in variant.items():
            args[positions[arg]] = value
        full = RecordingExecutor(name="emulated")
        ops.call(ops.OPS[name], tuple(copy.deepcopy(args)), {}, full)
        fast.clear()
        before = counting.calls
        entry(tuple(copy.deepcopy(args)), {})
        planned += counting.calls - before
        assert launches(fast) == launches(full), variant
    assert planned == 1
    # per-call values the kernels do not cover (bnb_mps.ops.validation.NotCovered) take the next route
    # as on the full path, after the plan exists, and launch nothing of ours; a value that is no
    # number fails as the checks say
    for arg, value in (("step", 0), ("lr", float("nan")), ("beta1", float("inf")), ("lr", "0.1")):
        args = copy.deepcopy(base)
        args[positions[arg]] = value
        full = RecordingExecutor()
        want = outcome(lambda: ops.call(ops.OPS[name], tuple(copy.deepcopy(args)), {}, full))
        fast.clear()
        got = outcome(lambda: entry(tuple(copy.deepcopy(args)), {}))
        assert got == want and launches(fast) == launches(full) == []
        if isinstance(value, str):
            assert want[0] == "error" and arg in want[2]


# -- when plans go -----------------------------------------------------------------------------------


def test_plans_go_when_the_tier_selection_or_a_route_changes(monkeypatch, fresh_tier_selection):
    name = "quantize_4bit"
    counting = Counting(monkeypatch, name)
    entry = ops.dispatcher_entry(name, RecordingExecutor(name="emulated"))
    args = next(op_inputs.cases(name))[1]
    entry(tuple(args), {})
    entry(tuple(args), {})
    assert counting.calls == 1
    executors.reset()
    entry(tuple(args), {})
    assert counting.calls == 2
    routing.forget()
    entry(tuple(args), {})
    entry(tuple(args), {})
    assert counting.calls == 3


def test_the_cache_is_bounded_and_keeps_no_tensor_alive(monkeypatch):
    name = "quantize_4bit"
    monkeypatch.setattr(ops._Plans, "LIMIT", 5)
    entry = ops.dispatcher_entry(name, RecordingExecutor(name="emulated"))
    plans = entry.plans
    refs = []
    for n in range(1, 30):
        A = torch.randn(n, 64)
        refs.append(weakref.ref(A))
        entry((A, 64, "nf4", torch.uint8), {})
        assert len(plans) <= 5
        del A
    gc.collect()
    assert all(r() is None for r in refs)


def test_a_refused_launch_on_the_fast_path_moves_the_op_on(limited_gpu_tier, monkeypatch):
    """The first calls are planned and kept on the (stand-in) GPU tier; when its pipeline then
    refuses the kernel, the kept plan's call moves the op to the next route, as the full path does,
    and still returns the result of that route."""
    from torch._C import DispatchKey, DispatchKeySet

    name = "quantize_blockwise"
    counting = Counting(monkeypatch, name)
    refusing = {"now": False}
    limited = limited_gpu_tier(lambda kernel: refusing["now"], 32)
    args = next(op_inputs.cases(name))[1]
    packet, mps = ops.op_packet(name), DispatchKeySet(DispatchKey.MPS)
    packet.redispatch(mps, *copy.deepcopy(args))  # (first-use verification runs the family here too)
    planned = counting.calls
    packet.redispatch(mps, *copy.deepcopy(args))
    assert ops.route(name).tier == "shader" and counting.calls == planned and limited.refusals == []
    refusing["now"] = True
    got = packet.redispatch(mps, *copy.deepcopy(args))
    assert counting.calls == planned and len(limited.refusals) == 1  # refused on the fast path
    assert ops.route(name).tier == "bitsandbytes" and "allows at most 32" in ops.route(name).reason
    assert_same(got, stock_mps_result(name, copy.deepcopy(args)), "served by bitsandbytes")


# -- the two keys ------------------------------------------------------------------------------------


@pytest.mark.skipif("c++" not in KEYS, reason="bnb_mps._opkey is not built against this torch")
def test_the_cpp_key_tells_apart_exactly_the_calls_the_python_key_tells_apart():
    corpus = []
    for name in PLANNED:
        skip = ops.OPS[name].planned.dynamic_positions
        for _, args in itertools.islice(op_inputs.cases(name), 3):
            corpus.append((tuple(args), skip))
            corpus += [(tuple(changed), skip) for _, changed in changes(args)]
    cpp = [KEYS["c++"](args, skip) for args, skip in corpus]
    py = [plan.metadata_key(args, skip) for args, skip in corpus]
    assert [c is None for c in cpp] == [p is None for p in py]
    assert sum(c is not None for c in cpp) > 100
    for (c1, p1), (c2, p2) in itertools.combinations(zip(cpp, py), 2):
        if c1 is not None and c2 is not None:
            assert (c1 == c2) == (p1 == p2)


def test_keys_leave_out_what_a_plan_takes_per_call_and_nothing_else():
    A = torch.randn(8, 8)
    args = ("adam", A, A, A, None, 0.9, 0.99)
    for key in KEYS.values():
        assert key(args, 0b1100000) == key(("adam", A, A, A, None, 0.5, 0.1), 0b1100000)
        assert key(args, 0b0100000) != key(("adam", A, A, A, None, 0.9, 0.1), 0b0100000)
        assert key(args, 0) != key(("adam", A, A, A.t(), None, 0.9, 0.99), 0)
        assert key(args, 0) != key(("adam", A, A, A[:, :4], None, 0.9, 0.99), 0)
        assert key((A.to_sparse(),), 0) is None
        assert key(({"a": 1},), 0) is None
