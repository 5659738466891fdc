"""The host path only a Mac runs, executed through the model of torch's MPS runtime
(bnb_mps.testing.use_modelled_mps; bnb_mps/modelled_mps, written from torch's MPSEvent.mm,
MPSStream.mm, MPSHooks.mm and torch/mps/).

Under the model, bitsandbytes ops on CPU tensors take the route a Mac gives them on mps: first-use
verification on the shader tier, tuning on the GPU clock with torch's timing events, launch plans;
torch.mps.compile_shader's kernels run under the emulator. The references: the emulated tier's
results (the same kernels, launched by bnb_mps' own emulated executor) for bits, torch's own source
for what the events do.
"""

from __future__ import annotations

import contextlib

import json
import logging

import pytest
import torch

import bnb_mps
from bnb_mps import ops
from bnb_mps.executors import clocks
from bnb_mps.modelled_mps import VERSIONS
from bnb_mps.ops import routing, timing, tuning
from bnb_mps.testing import ModelledDeadlock, use_emulated_kernels, use_modelled_mps
from op_inputs import cases
from optim_inputs import args_8bit, clone

pytest.importorskip("bnb_mps._emu")
pytestmark = [pytest.mark.filterwarnings("ignore::bnb_mps.executors.SlowTierWarning"),
              pytest.mark.filterwarnings("ignore::bnb_mps.ops.verify.VerificationWarning")]
bnb = torch.ops.bitsandbytes


@pytest.fixture(autouse=True)
def _own_tuning(monkeypatch, tmp_path):
    """Tuning off unless a test turns it on, in a cache file of the test's own."""
    monkeypatch.setenv(tuning.ENV_VAR, "0")
    monkeypatch.setenv(tuning.CACHE_ENV_VAR, str(tmp_path / "tune.json"))
    tuning.reset()
    yield tmp_path / "tune.json"
    tuning.reset()


def gemm_args(M, N=64, K=256, dtype=torch.float16, seed=0):
    """gemm_4bit arguments as QLoRA makes them: nf4, blocksize 64, nested absmax, bias."""
    import bitsandbytes.functional as F

    g = torch.Generator().manual_seed(seed)
    packed, state = F.quantize_4bit(torch.randn(N, K, generator=g), blocksize=64, quant_type="nf4",
                                    compress_statistics=True)  # fmt: skip
    A = torch.randn(M, K, generator=g).to(dtype)
    bias = torch.randn(N, generator=g).to(dtype)
    return [A, packed, [N, K], state.state2.absmax, 64, "nf4", bias, state.absmax, state.state2.code,
            state.offset.reshape(1)]  # fmt: skip


def run(op: str, args: list):
    """(the op's result, its arguments after the call): both, since some ops write into arguments."""
    args = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    base, _, overload = op.partition(".")
    return getattr(getattr(bnb, base), overload or "default")(*args), args


def path_of(kernel: str) -> str:
    """The 4-bit product path a kernel belongs to (bnb_gemv_4bit_..., bnb_gemm_4bit_<path>_...)."""
    return "gemv" if kernel.startswith("bnb_gemv") else kernel.split("_")[3]


def bits(t: torch.Tensor) -> torch.Tensor:
    """The bytes of `t` (NaN payloads and signed zeros compare as bits)."""
    flat = t.detach().contiguous().reshape(-1)
    return flat.view(torch.uint8) if flat.numel() and flat.element_size() else flat


def identical(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and \
            torch.equal(bits(a), bits(b))
    if isinstance(a, (tuple, list)):
        return isinstance(b, (tuple, list)) and len(a) == len(b) and all(identical(x, y) for x, y in zip(a, b))
    return a == b


# -- torch's events, as each version has them -----------------------------------------------------------------


@pytest.mark.parametrize("version", sorted(VERSIONS))
def test_synchronizing_a_timing_event_before_elapsed_time_deadlocks_where_torch_does(version):
    """pytorch#162872: on torch 2.13 and 2.14 record(), then synchronize() before the GPU is done, then
    elapsed_time() waits forever; the model raises ModelledDeadlock there every time (the modelled GPU
    is never done by the host's next step). Fixed in 2.15."""
    with use_modelled_mps(version) as mps:
        start, end = torch.mps.Event(enable_timing=True), torch.mps.Event(enable_timing=True)
        start.record()
        end.record()
        assert not end.query()  # (the GPU is not done yet)
        end.synchronize()
        assert end.query()
        if version in ("2.13", "2.14"):  # (pytorch#162872, fixed in 2.15: not the model's own table)
            with pytest.raises(ModelledDeadlock, match="pytorch#162872"):
                start.elapsed_time(end)
        else:
            assert start.elapsed_time(end) > 0
        assert mps.runtime.counts["event_synchronize"] == 1


@pytest.mark.parametrize("version", sorted(VERSIONS))
def test_recording_both_events_then_synchronizing_the_device_times_the_batch(version):
    """The sequence bnb-mps' EventClock uses: no version deadlocks on it, and the time is positive."""
    with use_modelled_mps(version):
        start, end = torch.mps.Event(enable_timing=True), torch.mps.Event(enable_timing=True)
        start.record()
        end.record()
        torch.mps.synchronize()
        assert start.elapsed_time(end) > 0
        assert clocks.EventClock().batch(lambda: None, 3) > 0


def test_elapsed_time_of_events_recorded_in_reverse_raises_as_torch_does():
    with use_modelled_mps("2.13"):
        first, second = torch.mps.Event(enable_timing=True), torch.mps.Event(enable_timing=True)
        first.record()
        second.record()
        torch.mps.synchronize()
        with pytest.raises(RuntimeError, match="was not recorded after start event"):
            second.elapsed_time(first)


def test_the_model_is_not_reentrant_and_restores_torch():
    had = hasattr(torch._C, "_mps_compileShader")
    version = torch.__version__
    with use_modelled_mps("2.15"):
        assert torch.backends.mps.is_available() and str(torch.__version__) == "2.15.0"
        assert hasattr(torch.mps, "current_stream")
        with pytest.raises(RuntimeError, match="already active"):
            with use_modelled_mps("2.13"):
                pass
    assert str(torch.__version__) == str(version) and not torch.backends.mps.is_available()
    assert hasattr(torch._C, "_mps_compileShader") == had
    with pytest.raises(ValueError, match="torch_version"):
        with use_modelled_mps("2.12"):
            pass


# -- a command buffer that fails; the modelled GPU clock -------------------------------------------------------

FAULT_SOURCE = (__import__("pathlib").Path(__file__).with_name("fault_kernels") / "address_fault.metal").read_text()


def address_fault():
    """A call that makes the GPU fail its command buffer (tests/fault_kernels/address_fault.metal: a write
    2^36 uints past a 32-element buffer), through torch.mps.compile_shader."""
    fn = getattr(torch.mps.compile_shader(FAULT_SOURCE), "bnb_test_address_fault")
    target = torch.zeros(32, dtype=torch.int32)
    return lambda: fn(target, 1 << 36, threads=[32], group_size=[32])


@pytest.mark.parametrize("version", sorted(VERSIONS))
def test_a_memory_fault_fails_its_command_buffer_and_its_events_never_complete(version):
    """Metal ends a command buffer at a GPU address fault and runs nothing of it after the fault, so an
    event recorded after the faulting kernel is never signalled: query() stays False after
    torch.mps.synchronize(). torch 2.15's synchronize() raises that buffer's error, once (MPSStream.mm:
    the completed handler keeps the error, the next synchronize raises it); 2.13 and 2.14 say nothing."""
    with use_modelled_mps(version):
        fault = address_fault()
        event = torch.mps.Event(enable_timing=True)
        fault()
        event.record()
        if version >= "2.15":
            with pytest.raises(RuntimeError, match="Command buffer execution failed"):
                torch.mps.synchronize()
        else:
            torch.mps.synchronize()
        torch.mps.synchronize()  # (raised once, not again)
        assert not event.query()
        later = torch.mps.Event(enable_timing=True)
        later.record()
        torch.mps.synchronize()
        assert later.query()  # (the next command buffer runs)


@pytest.mark.parametrize("version", sorted(VERSIONS))
def test_the_event_clock_fails_where_a_batch_faults_and_never_waits_for_its_events(version):
    """A batch whose command buffer fails: its end event never completes, and elapsed_time on torch 2.13
    and 2.14 would wait for it forever (ModelledDeadlock here); the clock asks query() first and fails
    (ClockFailed: the batch is timed again, then the shape key is left untuned)."""
    with use_modelled_mps(version):
        with pytest.raises(clocks.ClockFailed):
            clocks.EventClock().batch(address_fault(), 2)
        assert clocks.EventClock().batch(lambda: None, 2) > 0  # (the next batch is timed)


@pytest.mark.parametrize("version", sorted(VERSIONS))
def test_the_event_clock_gives_seconds_of_modelled_gpu_time(version):
    """The modelled GPU runs each command buffer in runtime.BUFFER_NS plus the cost of each kernel in it (set
    here: 250 us per kernel). A batch of n kernel calls between two recorded events is one command buffer
    (the first record() committed the one before): n * 250 us + BUFFER_NS, in seconds."""
    from bnb_mps.modelled_mps import runtime

    with use_modelled_mps(version) as mps:
        mps.runtime.kernel_ns = lambda name: 250_000
        fn = getattr(torch.mps.compile_shader(FAULT_SOURCE), "bnb_test_address_fault")
        target = torch.zeros(32, dtype=torch.int32)
        call = lambda: fn(target, 1, threads=[32], group_size=[32])  # noqa: E731  (in bounds: no fault)
        for n in (1, 3):
            assert clocks.EventClock().batch(call, n) == pytest.approx((n * 250_000 + runtime.BUFFER_NS) * 1e-9)


def test_timing_on_the_event_clock_takes_batches_of_several_calls_and_gives_the_time_per_call():
    """timing.seconds on the modelled GPU clock: a call of one 100 us kernel is below the 1 ms minimum, so
    each batch holds several calls (kernels encoded per elapsed_time above 1), and the time per call is
    the kernel's 100 us plus a share of one command buffer's BUFFER_NS."""
    from bnb_mps.modelled_mps import runtime

    with use_modelled_mps("2.13") as mps:
        mps.runtime.kernel_ns = lambda name: 100_000
        fn = getattr(torch.mps.compile_shader(FAULT_SOURCE), "bnb_test_address_fault")
        target = torch.zeros(32, dtype=torch.int32)
        per_call = timing.seconds(lambda: fn(target, 1, threads=[32], group_size=[32]), clocks.EventClock())
        kernels, batches = mps.runtime.counts["kernels"], mps.runtime.counts["elapsed_time"]
    assert batches == timing.SAMPLES + 1 and kernels - 1 > 2 * batches  # (a warm-up, then several per batch)
    assert 100e-6 < per_call <= (100_000 + runtime.BUFFER_NS / 2) * 1e-9


def test_the_gpu_clock_serves_the_default_stream_and_refuses_others_by_stream_id():
    """torch 2.15 (torch/mps/streams.py): current_stream() and default_stream() make a new Stream wrapper
    at each call, whose equality is not modelled; the default stream's id is 0. So the calls on the
    default stream are timed on the GPU clock and those inside torch.mps.stream(other) are not."""
    with use_modelled_mps("2.15"):
        assert torch.mps.current_stream() is not torch.mps.current_stream()
        assert torch.mps.current_stream().stream_id == torch.mps.default_stream().stream_id == 0
        assert clocks.gpu_clock_refusal() is None
        with torch.mps.stream(torch.mps.Stream()):
            assert "other than the default" in clocks.gpu_clock_refusal()
        assert clocks.gpu_clock_refusal() is None


def test_a_register_heavy_kernels_pipeline_allows_fewer_threads_and_the_shader_tier_refuses_more():
    """Metal's maxTotalThreadsPerThreadgroup depends on a kernel's register use: the model of
    compile_shader gives 512 to the kernels of a unit that uses simdgroup matrices (the 4-bit product's
    mma kernels), 1024 to others. The shader tier reads each pipeline's maximum and refuses a launch
    above it (PipelineLimitError) before anything is encoded."""
    from bnb_mps import executors
    from bnb_mps.modelled_mps.library import REGISTER_HEAVY_MAX_THREADS

    with use_modelled_mps("2.13") as mps:
        ex = executors.load_tier("shader")
        mma = next(k for k in ex._units.kernels() if k.startswith("bnb_gemm_4bit_mma_"))
        plain = next(k for k in ex._units.kernels() if k.startswith("bnb_quantize_4bit"))
        assert getattr(ex._units.library_of(mma), mma).max_threads_per_threadgroup == REGISTER_HEAVY_MAX_THREADS < 1024
        assert getattr(ex._units.library_of(plain), plain).max_threads_per_threadgroup == 1024
        kernels = mps.runtime.counts["kernels"]
        with pytest.raises(executors.PipelineLimitError) as refused:
            ex.prepare(mma, (1, 1, 1), (1024, 1, 1))
        assert (refused.value.threads, refused.value.maximum) == (1024, REGISTER_HEAVY_MAX_THREADS)
        assert mps.runtime.counts["kernels"] == kernels
        ex.prepare(plain, (1, 1, 1), (1024, 1, 1))  # (allowed: no error)


# -- every op family on the shader tier, bit for bit ---------------------------------------------------------

OPS_WITH_KERNELS = sorted(name for name, op in ops.OPS.items() if op.kernel is not None)


@pytest.mark.parametrize("op", OPS_WITH_KERNELS)
def test_every_op_on_the_shader_tier_equals_the_emulated_tier_with_tuning_off(op):
    """Each op's representative calls (tests/op_inputs.py) through the model (the shader tier, its
    first-use verification, launch plans) give the same bits as the emulated tier, outputs and
    updated arguments alike, and are served by the shader tier."""
    calls = list(cases(op))  # (made before either registration: their inputs come from bitsandbytes' CPU code)
    with use_emulated_kernels():
        want = [run(op, args) for _, args in calls]
    with use_modelled_mps("2.13") as mps:
        ops.reset_call_counts()
        got = [run(op, args) for _, args in calls]
        counts = ops.call_counts().get(op, {})
        route = routing.route(op)
    assert route.tier == "shader", route
    for (label, _), g, w in zip(calls, got, want):
        assert identical(g, w), f"{op} {label}: the shader tier differs from the emulated tier"
    assert counts.get("shader", 0) >= 1 and set(counts) == {"shader"}, counts
    assert mps.runtime.counts["kernels"] > 0


# -- the check: quantize, dequantize, gemm_4bit at M = 1, 5, 40, an 8-bit optimizer step --------------

PATHS = {1: "gemv", 5: "small", 40: "mma"}


def qlora_calls():
    W = torch.randn(64, 256, generator=torch.Generator().manual_seed(3))
    calls = [("quantize_4bit", [W, 64, "nf4", torch.uint8])]
    packed, absmax = bnb.quantize_4bit.default(W, 64, "nf4", torch.uint8)
    calls.append(("dequantize_4bit", [packed, absmax, 64, "nf4", [64, 256], torch.float16]))
    calls += [("gemm_4bit", gemm_args(M)) for M in PATHS]
    calls.append(("optimizer_update_8bit_blockwise", args_8bit("adam", 700, torch.float16, seed=5)))
    return calls


@pytest.mark.parametrize("version", sorted(VERSIONS))
def test_the_qlora_ops_on_the_shader_tier_equal_the_emulated_tier_then_tune_without_hanging(version, monkeypatch):
    calls = qlora_calls()
    with use_emulated_kernels() as emulated:
        want = [run(op, clone(args)) for op, args in calls]
    gemm_kernels = [k for k in emulated.launched if k.startswith("bnb_gemm") or k.startswith("bnb_gemv")]
    assert [path_of(k) for k in gemm_kernels] == list(PATHS.values())  # (each built-in path of the products)
    with use_modelled_mps(version) as mps:
        got = [run(op, clone(args)) for op, args in calls]
        assert mps.runtime.counts["elapsed_time"] == 0  # (tuning off: nothing timed)
    for (op, _), g, w in zip(calls, got, want):
        assert identical(g, w), f"{op} on torch {version}'s model differs from the emulated tier"

    monkeypatch.setenv(tuning.ENV_VAR, "1")
    with use_modelled_mps(version) as mps:  # (a Mac's default: tuning on for mps tensors)
        tuned = [run(op, clone(args)) for op, args in calls]
        rows = bnb_mps.tuning_table()
        assert mps.runtime.counts["elapsed_time"] > 0 and mps.runtime.counts["event_synchronize"] == 0
    gemm_rows = [r for r in rows if r["op"] == "gemm_4bit"]
    assert len(gemm_rows) == len(PATHS) and all(r["tier"] == "shader" and r["clock"] == "gpu" for r in rows), rows
    for r in gemm_rows:
        assert r["choice"] in r["times"] and not r["errors"], r
    for (op, _), t, w in zip(calls, tuned, want):  # (another route may round differently: section 4's bound)
        out_t, out_w = (t[0][0], w[0][0]) if isinstance(t[0], tuple) else (t[0], w[0])
        if out_t is not None and out_t.is_floating_point():
            assert torch.allclose(out_t.float(), out_w.float(), rtol=2e-2, atol=2e-2), op


def test_first_use_timing_that_synchronizes_a_timing_event_fails_and_does_not_hang(monkeypatch):
    """The sequence the review found (end.record(); end.synchronize(); start.elapsed_time(end)), planted
    back into the event clock, makes the first tuned call raise ModelledDeadlock on torch 2.13: no
    guard of first use can hide it (a BaseException), so any test that tunes under the model fails."""

    def deadlocking(self, call, n):
        start, end = torch.mps.Event(enable_timing=True), torch.mps.Event(enable_timing=True)
        start.record()
        for _ in range(n):
            call()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    monkeypatch.setattr(clocks.EventClock, "batch", deadlocking)
    monkeypatch.setenv(tuning.ENV_VAR, "1")
    args = gemm_args(5)
    with use_modelled_mps("2.13"):
        with pytest.raises(ModelledDeadlock):
            bnb.gemm_4bit.default(*args)


# -- what first use does when timing fails ---------------------------------------------------------------------


def test_a_reversed_timing_is_retried_once_and_the_route_kept(monkeypatch, _own_tuning):
    """torch raises for a pair of timestamps that comes out reversed; the batch is timed again, and the
    decision (with every route measured) is kept and cached as usual."""
    monkeypatch.setenv(tuning.ENV_VAR, "1")
    args = gemm_args(5)
    with use_modelled_mps("2.13") as mps:
        real = mps.runtime.elapsed_time
        failed = []

        def once_reversed(start_id, end_id):
            if not failed:
                failed.append(1)
                real(start_id, end_id)
                raise RuntimeError(f"End event {end_id} was not recorded after start event {start_id}")
            return real(start_id, end_id)

        monkeypatch.setattr(torch._C, "_mps_elapsedTimeOfEvents", once_reversed)
        bnb.gemm_4bit.default(*args)
        rows = [r for r in bnb_mps.tuning_table() if r["op"] == "gemm_4bit"]
    assert failed and len(rows) == 1 and not rows[0]["errors"], rows
    assert set(rows[0]["times"]) >= {PATHS[5], "mma", "dequantize+linear"}, rows
    assert rows[0]["key"] in json.dumps(json.loads(_own_tuning.read_text()))


def test_a_timing_that_fails_twice_serves_the_built_in_route_and_caches_nothing(monkeypatch, _own_tuning, caplog):
    args = gemm_args(5)
    with use_emulated_kernels():
        want, _ = run("gemm_4bit", args)
    monkeypatch.setenv(tuning.ENV_VAR, "1")
    with use_modelled_mps("2.13") as mps:

        def always_reversed(start_id, end_id):
            raise RuntimeError(f"End event {end_id} was not recorded after start event {start_id}")

        monkeypatch.setattr(torch._C, "_mps_elapsedTimeOfEvents", always_reversed)
        with caplog.at_level(logging.WARNING, logger="bnb_mps"):
            got, _ = run("gemm_4bit", args)
        assert path_of([k for k in mps.launched if "gemm" in k or "gemv" in k][-1]) == PATHS[5]
        rows = bnb_mps.tuning_table()
    assert identical(got, want)  # (the built-in route at M = 5)
    assert rows == [] and not (_own_tuning.exists() and json.loads(_own_tuning.read_text()))
    assert "not tuned" in caplog.text and "twice" in caplog.text


def test_timing_retries_a_failed_batch_once_then_gives_up():
    class Flaky:
        name = "gpu"

        def __init__(self, failures):
            self.failures, self.batches = failures, 0

        def batch(self, call, n):
            self.batches += 1
            if self.failures:
                self.failures -= 1
                raise clocks.ClockFailed("reversed")
            for _ in range(n):
                call()
            return 2e-3 * n

    flaky = Flaky(1)
    assert timing.seconds(lambda: None, flaky) == pytest.approx(2e-3)
    assert flaky.batches == timing.SAMPLES + 1
    with pytest.raises(timing.TimingFailed):
        timing.seconds(lambda: None, Flaky(2))


@pytest.mark.parametrize("failure", ["fresh", "read"])
def test_an_error_anywhere_in_first_use_serves_the_built_in_route(monkeypatch, _own_tuning, failure):
    """Out of memory while making the tuning inputs, or a cache that cannot be read: the user's call is
    served (by its built-in route), and nothing is kept or cached."""
    args = gemm_args(40)
    with use_emulated_kernels():
        want, _ = run("gemm_4bit", args)
    monkeypatch.setenv(tuning.ENV_VAR, "1")

    def fail(*a, **k):
        raise RuntimeError("MPS backend out of memory")

    if failure == "fresh":
        real_of = tuning.Candidates.__init__

        def no_fresh(self, *a, **k):
            real_of(self, *a, **k)
            self.fresh = fail

        monkeypatch.setattr(tuning.Candidates, "__init__", no_fresh)
    else:
        monkeypatch.setattr(tuning, "_read", fail)
    with use_modelled_mps("2.13"):
        got, _ = run("gemm_4bit", args)
        rows = bnb_mps.tuning_table() if failure == "fresh" else []
    assert identical(got, want) and rows == []
    assert not (_own_tuning.exists() and json.loads(_own_tuning.read_text()))


def test_calls_on_another_stream_are_not_tuned_and_nothing_is_cached(monkeypatch, _own_tuning):
    """torch 2.15's public streams: Event.record() raises off the default stream; tuning skips those
    calls (the built-in route serves) without trying to time them, and caches nothing, then tunes on the
    default stream."""
    monkeypatch.setenv(tuning.ENV_VAR, "1")
    args = gemm_args(5)
    with use_modelled_mps("2.15") as mps:
        with torch.mps.stream(torch.mps.Stream()):
            with pytest.raises(NotImplementedError):
                torch.mps.Event(enable_timing=True).record()
            bnb.gemm_4bit.default(*clone(args))
        assert mps.runtime.counts["elapsed_time"] == 0 and bnb_mps.tuning_table() == []
        assert mps.runtime.counts["events"] == 1  # (the test's own: no timing tried)
        assert not (_own_tuning.exists() and json.loads(_own_tuning.read_text()))
        tuning.reset()
        bnb.gemm_4bit.default(*clone(args))
        rows = bnb_mps.tuning_table()
        assert "gemm_4bit" in {r["op"] for r in rows} and {r["clock"] for r in rows} == {"gpu"}, rows


@pytest.mark.parametrize("version", ["2.13", "2.15"])
def test_each_stream_has_its_own_split_k_workspace(version):
    """The split-K kernels' partial sums (and the one-dispatch kernel's counters, bnb_mps.ops.workspace):
    one set per device for the default stream, and, where torch has other streams (2.15), one per
    stream, since two streams' kernels may run at the same time. Every call gives the emulated tier's
    bits. (The modelled shader tier compiles Metal 3.1 off macOS: the two-dispatch split-K, no counters.)"""
    from bnb_mps.ops import matmul_4bit, workspace

    args = gemm_args(5, K=512)
    with use_emulated_kernels():
        want, _ = run("gemm_4bit", args)
    with use_modelled_mps(version) as mps:
        got, _ = run("gemm_4bit", args)
        assert mps.launched[-2:] == ["bnb_gemm_4bit_splitk_partial_nested_f16", "bnb_gemm_4bit_splitk_sum_f16"]
        assert identical(got, want)
        side = torch.mps.Stream() if version == "2.15" else None
        with torch.mps.stream(side) if side is not None else contextlib.nullcontext():
            again, _ = run("gemm_4bit", args)
        torch.mps.synchronize()
        assert identical(again, want)
        streams = {key[5] for key in workspace._buffers if key[1] == "splitk partial sums"}
        assert streams == ({0, side._stream.number} if side is not None else {0}), streams
        S = matmul_4bit.splitk_splits(5, 512, args[0].element_size())
        tiles = -(-args[2][0] // (16 * S))
        for key, buf in workspace._buffers.items():
            if key[1] == "splitk partial sums":
                assert buf.numel() >= tiles * S * 5 * 16 * S, buf.numel()
        assert not [key for key in workspace._buffers if key[1] == "splitk counters"]


def test_a_plan_first_called_on_another_stream_takes_no_workspace_of_the_default_one():
    """torch 2.15: a split-K plan bound by a call on another stream takes that stream's workspace only;
    the default stream's is made (allocated and zeroed) by the first call on the default stream, so
    its zeroing is ordered before that stream's kernels (made on the other stream, it would not be)."""
    from bnb_mps.ops import workspace

    workspace.release()
    args = gemm_args(5, K=512)
    with use_emulated_kernels():
        want, _ = run("gemm_4bit", args)
    with use_modelled_mps("2.15"):
        side = torch.mps.Stream()
        with torch.mps.stream(side):
            first, _ = run("gemm_4bit", args)
        # (the modelled shader tier compiles Metal 3.1: the two-dispatch split-K, its partial sums alone)
        streams = {key[5] for key in workspace._buffers if key[1] == "splitk partial sums"}
        assert streams == {side._stream.number}, streams
        again, _ = run("gemm_4bit", args)
        torch.mps.synchronize()
        streams = {key[5] for key in workspace._buffers if key[1] == "splitk partial sums"}
        assert streams == {0, side._stream.number}, streams
        assert identical(first, want) and identical(again, want)


def test_deterministic_algorithms_take_the_built_in_route(monkeypatch):
    """Under torch.use_deterministic_algorithms(True) nothing is tuned, even with BNB_MPS_TUNE=1: two
    Macs compute the same bits (the emulated tier's built-in route)."""
    args = gemm_args(5)
    with use_emulated_kernels():
        want, _ = run("gemm_4bit", args)
    monkeypatch.setenv(tuning.ENV_VAR, "1")
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        with use_modelled_mps("2.13") as mps:
            got, _ = run("gemm_4bit", args)
            assert mps.runtime.counts["elapsed_time"] == 0 and bnb_mps.tuning_table() == []
    finally:
        torch.use_deterministic_algorithms(before)
    assert identical(got, want)


def test_an_earlier_command_buffer_error_does_not_fail_verification_on_2_15(monkeypatch, tmp_path):
    """torch 2.15's synchronize() raises an earlier command buffer's error, once: verification takes it
    before its own launches (it is not the family's), so each family of the op runs once and passes, and
    what is cached records no failed first run."""
    from bnb_mps.ops import verify

    monkeypatch.setenv(verify.CACHE_ENV_VAR, str(tmp_path / "verify.json"))
    verify.reset()
    runs = []
    real = verify.run_family
    monkeypatch.setattr(verify, "run_family", lambda family, *a: runs.append(family.name) or real(family, *a))
    try:
        with use_modelled_mps("2.15") as mps:
            mps.runtime.current_stream.command_buffer().error = "planted: an earlier GPU address fault"
            torch.mps.Event().record()  # (commits that buffer)
            x = torch.randn(300, generator=torch.Generator().manual_seed(1))
            code = torch.linspace(-1, 1, 256)
            bnb.quantize_blockwise.default(x, code, 64)
            assert routing.route("quantize_blockwise").tier == "shader"
            torch.mps.synchronize()  # (raised once already, not again)
        cached = json.loads((tmp_path / "verify.json").read_text())
    finally:
        verify.reset()
    families = verify.families_of("quantize_blockwise")
    assert sorted(runs) == sorted(families), runs  # (each once: no second run)
    entries = [entry for by_family in cached.values() for name, entry in by_family.items() if name in families]
    assert len(entries) == len(families) and all(e["passed"] and not e.get("first_failure") for e in entries), entries


# -- the commands a Mac user runs ------------------------------------------------------------------------------


def test_the_verify_command_on_the_shader_tier(monkeypatch, tmp_path, capsys):
    from bnb_mps.__main__ import main
    from bnb_mps.ops import verify

    monkeypatch.setenv(verify.CACHE_ENV_VAR, str(tmp_path / "verify.json"))
    verify.reset()
    try:
        with use_modelled_mps("2.13") as mps:
            status = main(["verify", "--tier", "shader", "--json", str(tmp_path / "verdicts.json")])
    finally:
        verify.reset()
    out = capsys.readouterr().out
    report = json.loads((tmp_path / "verdicts.json").read_text())
    assert status == 0, out
    assert "shader" in out and mps.runtime.counts["kernels"] > 0 and mps.runtime.counts["synchronize"] > 0
    assert json.dumps(report).count('"passed": true') >= len(verify.FAMILIES), report


def test_the_tune_command_on_the_shader_tier_measures_on_the_gpu_clock(monkeypatch, _own_tuning, capsys):
    """`python -m bnb_mps tune --m 1,2,4,8,16,32` as on a Mac (issue 34): every row measured on the GPU
    clock, the split-K path a measured candidate of every row, and the built-in route of M = 2..32 (the
    two-dispatch split-K: the modelled shader tier compiles Metal 3.1 off macOS)."""
    from bnb_mps.__main__ import main

    ms = (1, 2, 4, 8, 16, 32)
    with use_modelled_mps("2.13") as mps:
        status = main(["tune", "--tier", "shader", "--shapes", "64x512", "--m", ",".join(map(str, ms))])
        rows = bnb_mps.tuning_table()
    out = capsys.readouterr().out
    assert status == 0, out
    assert "timings mean nothing" not in out  # (the GPU clock, not the host's)
    gemm = [r for r in rows if r["op"] == "gemm_4bit"]
    assert len(gemm) == len(ms) and {r["tier"] for r in gemm} == {"shader"} and {r["clock"] for r in gemm} == {"gpu"}, rows
    header = next(line for line in out.splitlines() if line.split()[:2] == ["M", "gemv"])
    assert "splitk/two" in header.split() and "splitk" not in header.split(), header
    for r in gemm:
        assert r["times"].get("splitk/two", 0) > 0 and "splitk" not in r["times"] and not r["errors"], r
        assert r["default"] == ("gemv" if "M<=1 " in r["key"] else "splitk/two"), r
    assert mps.runtime.counts["elapsed_time"] > 0 and mps.runtime.counts["event_synchronize"] == 0
    cached = json.loads(_own_tuning.read_text())
    assert any(k.startswith("shader |") for k in cached), list(cached)


@pytest.mark.parametrize("version", sorted(VERSIONS))
def test_torch_int_mm_is_a_route_of_the_int8_product_where_torch_runs_it_on_mps(version, monkeypatch):
    """torch 2.15 runs torch._int_mm on mps: a tuning candidate of int8_linear_matmul there, which serves
    where it measures faster (fixed timings) and gives the kernel's exact int32 products; before 2.15 it
    is no candidate."""
    from bnb_mps.testing import fixed_timings

    g = torch.Generator().manual_seed(2)
    A = torch.randint(-128, 128, (2, 5, 96), dtype=torch.int8, generator=g)
    B = torch.randint(-128, 128, (40, 96), dtype=torch.int8, generator=g)
    want = (A.reshape(-1, 96).double() @ B.double().t()).reshape(2, 5, 40)
    monkeypatch.setenv(tuning.ENV_VAR, "1")
    with use_modelled_mps(version):
        with fixed_timings({"torch._int_mm": 1e-3, "kernel": 2e-3}):
            got = bnb.int8_linear_matmul.default(A, B)
            rows = [r for r in bnb_mps.tuning_table() if r["key"] == "int8_linear_matmul A=int8[2, 5, 96] B=int8[40, 96]"]
    assert got.dtype == torch.int32 and torch.equal(got.double(), want)
    if version >= "2.15":  # (torch._int_mm on mps from 2.15, read in its release's binaries: not the model's table)
        assert len(rows) == 1 and rows[0]["choice"] == "torch._int_mm", rows
        assert set(rows[0]["times"]) == {"kernel", "torch._int_mm"}, rows
    else:
        assert rows == []  # (the kernel alone: nothing to choose from)
