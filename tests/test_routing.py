"""Never slower than stock bitsandbytes: per op on the MPS key, bnb_mps' Metal kernel on a GPU
tier; else bitsandbytes' own implementation that runs on mps (the op is handed back to it); else
the CPU round trip, only for ops bitsandbytes cannot run on mps.

On Linux no GPU tier loads (the truth here); a stand-in GPU tier (the emulated executor under the
name "shader", optionally with a pipeline that refuses a kernel's threadgroup) and a stand-in for
bitsandbytes' own mps kernel cover the other cases. Calls go
through `op.redispatch(DispatchKeySet(MPS), ...)` on CPU tensors, which is what a Mac's mps
tensors reach.
"""

from __future__ import annotations

import copy
import importlib.util
import math

import pytest
import torch
from torch._C import DispatchKey, DispatchKeySet

import bnb_mps
import op_inputs
from bnb_mps import executors, ops, registration
from bnb_mps.executors import ExecutorUnavailable, PipelineLimitError
from bnb_mps.ops import cpu_round_trip as cpu_fallback
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


# -- pipeline limits: a kernel tier that refuses a launch ---------------------------------------------


class LimitedExecutor:
    """A GPU tier whose pipelines of the kernels `refused(kernel)` picks allow only `maximum`
    threads per threadgroup: their launches above it raise PipelineLimitError before running, as
    the native and shader tiers do. Only that limit is faked; every other launch runs on `inner`."""

    name = "shader"

    def __init__(self, inner, refused, maximum: int) -> None:
        self.inner, self.refused, self.maximum = inner, refused, maximum
        self.refusals: list[str] = []

    def launch(self, kernel, *, grid, threadgroup, args) -> None:
        threads = math.prod(threadgroup)
        if self.refused(kernel) and threads > self.maximum:
            self.refusals.append(kernel)
            raise PipelineLimitError(kernel, threads, self.maximum)
        self.inner.launch(kernel, grid=grid, threadgroup=threadgroup, args=args)


@pytest.fixture
def limited_gpu_tier(stand_in_gpu_tier, fresh_tier_selection):
    """`limit(refused, maximum)`: the stand-in GPU tier (whose `launched` lists the launches that
    ran), with the pipeline limit of LimitedExecutor."""

    def limit(refused, maximum: int) -> LimitedExecutor:
        limited = LimitedExecutor(stand_in_gpu_tier, refused, maximum)

        def load(name):
            if name == "shader":
                return limited
            raise ExecutorUnavailable(f"{name} stands in as unavailable")

        fresh_tier_selection.setattr(executors, "load_tier", load)
        executors.reset()
        return limited

    return limit


def case(name, label):
    return copy.deepcopy(dict(op_inputs.cases(name))[label])


def verified(limited: LimitedExecutor, *names: str) -> None:
    """Verifies every kernel family on the limited tier (or reads the verdicts from the cache), as
    the first calls of a user's process do: a launch that verification's cases make above the limit
    is skipped, not a failure, so ops `names` stay on the tier. Then forgets the launches and
    refusals so far: what the test checks next are the user's calls."""
    verdicts = bnb_mps.verify("shader")
    assert all(v.passed for v in verdicts.values()), {n: v.describe() for n, v in verdicts.items()}
    for name in names:
        assert ops.route(name).tier == "shader", (name, bnb_mps.backend_info()[name])
    limited.refusals.clear()
    limited.inner.clear()


def test_a_refused_kernel_sends_the_op_to_bitsandbytes_and_the_call_still_returns(limited_gpu_tier, fallback_calls):
    name, kernel = "quantize_blockwise", "bnb_quantize_blockwise_f32_4096"  # blocksize 4096: 512 threads
    limited = limited_gpu_tier(lambda k: k == kernel, 256)
    args = case(name, "torch.float32-(4101,)-4096")
    want = stock_mps_result(name, copy.deepcopy(args))
    verified(limited, name)
    got = ops.op_packet(name).redispatch(MPS, *copy.deepcopy(args))
    assert_same(got, want)
    assert limited.refusals == [kernel] and fallback_calls == []
    info = bnb_mps.backend_info()[name]
    assert info["tier"] == "bitsandbytes"
    assert f"kernel {kernel}: its pipeline allows at most 256 threads per threadgroup, the op launches 512" in (
        info["reason"])
    assert "default kernel" in info["reason"]
    # later calls go to bitsandbytes directly, whatever their blocksize (the whole op left the tier)
    assert not has_mps_kernel_of_ours(name)
    small = case(name, "torch.float32-(1000,)-256")
    assert_same(ops.op_packet(name).redispatch(MPS, *copy.deepcopy(small)), stock_mps_result(name, small))
    assert limited.refusals == [kernel] and limited.inner.launched == [], limited.inner.launched
    # another op keeps its kernel tier
    verified(limited, "quantize_4bit")
    ops.op_packet("quantize_4bit").redispatch(MPS, *first_case("quantize_4bit"))
    assert limited.inner.launched and limited.inner.launched[0].startswith("bnb_quantize_4bit_")
    assert bnb_mps.backend_info()["quantize_4bit"]["tier"] == "shader"


def test_a_refused_kernel_sends_the_op_to_bitsandbytes_own_mps_kernel(limited_gpu_tier, fallback_calls):
    """A stand-in for bitsandbytes' mps backend kernel (the test above has its default kernel)."""
    name = "dequantize_blockwise.out"
    limited = limited_gpu_tier(lambda k: k.startswith("bnb_dequantize_blockwise_"), 128)  # they launch 256
    args = first_case(name)
    want = copy.deepcopy(args)
    cpu_fallback.cpu_call(name, want)
    theirs = torch.library.Library("bitsandbytes", "IMPL")
    calls = []
    theirs.impl(name, lambda *a: calls.append(name) or cpu_fallback.cpu_call(name, list(a)), "MPS")
    bnb_mps.unregister()
    bnb_mps.register()  # ours on top again, theirs inactive below
    try:
        verified(limited, name)
        got = copy.deepcopy(args)
        assert ops.op_packet(name).redispatch(MPS, *got) is None
        assert calls == [name] and fallback_calls == [] and len(limited.refusals) == 1
        assert torch.equal(got[-1], want[-1])  # `out`, written by their kernel alone
        info = bnb_mps.backend_info()[name]
        assert info["tier"] == "bitsandbytes" and "own mps kernel" in info["reason"]
        assert f"kernel {limited.refusals[0]}: its pipeline allows at most 128" in info["reason"]
    finally:
        registration.reinstate()
        theirs._destroy()


def test_a_refused_kernel_of_an_op_bitsandbytes_cannot_run_on_mps_takes_the_round_trip(limited_gpu_tier,
                                                                                         fallback_calls):
    """int8_double_quant, refused at its second launch (the stats pass ran)."""
    name = "int8_double_quant"
    limited = limited_gpu_tier(lambda k: k.startswith("bnb_int8_double_quant_apply_"), 64)  # 2048 columns: 128
    A = op_inputs.randn(8, 2048, dtype=torch.float16, seed=5, scale=1.5)
    want = cpu_fallback.cpu_call(name, [A.clone(), 0.0])
    verified(limited, name, "int8_vectorwise_quant")
    for calls in (1, 2):
        got = ops.op_packet(name).redispatch(MPS, A.clone(), 0.0)
        assert_same(got, want)
        assert fallback_calls == [name] * calls
    assert limited.refusals == ["bnb_int8_double_quant_apply_f16"]  # the second call went to the round trip directly
    assert limited.inner.launched == ["bnb_int8_double_quant_stats_f16"]
    assert has_mps_kernel_of_ours(name)
    info = bnb_mps.backend_info()[name]
    assert info["tier"] == "cpu" and "bitsandbytes cannot run it on mps" in info["reason"]
    assert "kernel bnb_int8_double_quant_apply_f16: its pipeline allows at most 64" in info["reason"]
    assert ops.route("int8_vectorwise_quant").tier == "shader"


@pytest.mark.parametrize("name, label, refused, first", [
    ("optimizer_update_32bit", "lamb-torch.float32", "bnb_optimizer_32bit_adam_f32",
     "bnb_optimizer_32bit_unorm_adam_f32"),
    ("optimizer_update_32bit", "lars-torch.float16", "bnb_optimizer_32bit_momentum_f16",
     "bnb_optimizer_32bit_unorm_momentum_f16"),
    ("int8_vectorwise_quant", "torch.float32-2.0", "bnb_int8_outlier_finish", "bnb_int8_vectorwise_quant_outliers_f32"),
])  # fmt: skip
def test_an_op_refused_at_its_second_launch_is_served_whole_from_its_untouched_arguments(
    limited_gpu_tier, fallback_calls, name, label, refused, first
):  # fmt: skip
    """The first launch ran (on the stand-in GPU tier); bitsandbytes then serves the call from the
    caller's arguments, which that launch left alone: in-place updates (parameters, optimizer
    states, unorm_vec) and outputs equal stock's exactly."""
    limited = limited_gpu_tier(lambda k: k == refused, 128)  # both launch 256 threads per threadgroup
    args = case(name, label)
    want_args = copy.deepcopy(args)
    want = stock_mps_result(name, want_args)
    verified(limited, name)
    got_args = copy.deepcopy(args)
    got = ops.op_packet(name).redispatch(MPS, *got_args)
    assert limited.inner.launched == [first] and limited.refusals == [refused]
    assert fallback_calls == []
    assert_same(got, want)
    for g, w in zip(got_args, want_args):
        if isinstance(w, torch.Tensor):
            assert_same(g, w)
    assert bnb_mps.backend_info()[name]["tier"] == "bitsandbytes"


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
