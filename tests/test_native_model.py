"""The native executor (csrc/mps_ops.mm, the Objective-C++ only a Mac runs) executed in CI: built on
Linux against tests/metal_model (a model of Metal and of torch's MPS stream, kernels under the
emulator; its README says what is modelled), serving bitsandbytes ops through the op layer.

The ops' CPU tensors stand in for mps ones; results are read after `model.synchronize()` (torch's
synchronize), as on a Mac. Every test ends with no breach of Apple's documented rules recorded by the
model (a completed handler added to a committed buffer, dispatch_sync onto the queue it runs on, ...)."""

from __future__ import annotations

import json
import types

import pytest
import torch

import metal_model
import mps_families as fam
from bnb_mps.kernel_args import uint32

ADD_ONE = """#include <metal_stdlib>
using namespace metal;
kernel void add_one(device float* x [[buffer(0)]], constant uint& n [[buffer(1)]],
                    uint i [[thread_position_in_grid]]) {
    if (i < n) x[i] += 1.0f;
}
"""


@pytest.fixture(scope="module")
def built():
    try:
        return metal_model.load()
    except metal_model.ModelUnavailable as e:  # (setup_env.sh installs what it needs: CI fails here)
        from extras import missing

        missing("clang", f"the Metal model cannot be built here: {e}")


@pytest.fixture
def model(built):
    native, model = built
    model.misuses()  # (what earlier modules left)
    model.set_deferred(False)
    yield model
    model.set_deferred(False)
    model.set_gpu_clock(None)
    model.set_handler_delay(0.0)
    model.synchronize()
    assert model.misuses() == []


@pytest.fixture(scope="module")
def tier(built):
    return metal_model.executor(*built)


def run_case(case: fam.Case, model) -> None:
    """tests/mps_families.run_case on the model: the op on the stand-in tensors, then synchronize."""
    from bnb_mps.ops import op_packet

    args = [fam.to_device(a, "cpu") for a in case.args]
    got = case.run(args) if case.run is not None else op_packet(case.op)(*args)
    model.synchronize()
    case.compare(fam._to_cpu(got), case.want, f"{case.label}: result")
    for i, want in case.want_args.items():
        case.compare(fam._to_cpu(args[i]), want, f"{case.label}: argument {i} after the call")


def tuned_gemm_4bit(model, tier, W, X) -> list:
    """First-use tuning of one gemm_4bit call (X @ nf4(W).T) on the native tier, from a fresh tuning
    state: the tuning table's gemm_4bit rows it leaves."""
    import bnb_mps
    from bnb_mps.ops import tuning

    tuning.reset()
    try:
        with metal_model.serving_cpu_ops(tier):
            packed, absmax = torch.ops.bitsandbytes.quantize_4bit(W, 64, "nf4", torch.uint8)
            model.synchronize()
            torch.ops.bitsandbytes.gemm_4bit(X, packed, list(W.shape), absmax, 64, "nf4")
            model.synchronize()
            return [r for r in bnb_mps.tuning_table() if r["op"] == "gemm_4bit"]
    finally:
        tuning.reset()


CPU_RUNS = [(f, n) for f in fam.FAMILIES for n in f.cpu_sizes]


@pytest.mark.parametrize("family,n", CPU_RUNS, ids=[f"{f.name}-n{n}" for f, n in CPU_RUNS])
def test_the_mps_family_table_passes_on_the_native_tier(model, tier, family, n, monkeypatch):
    """The cases a Mac runs (tests/test_mps.py's table), through csrc/mps_ops.mm: compile units,
    pipelines, argument binding on the modelled stream, and the references the emulator tests use.
    Tuning off: on the stand-in CPU tensors bitsandbytes' route is its CPU code, which codes a zero
    of quantize_blockwise as 131 where the table expects the code of 0, 127."""
    monkeypatch.setenv("BNB_MPS_TUNE", "0")
    before = len(metal_model.MpsBindings.launched)
    count = 0
    with metal_model.serving_cpu_ops(tier):
        for case in family.cases(n):
            run_case(case, model)
            count += 1
    assert count > 0 and len(metal_model.MpsBindings.launched) > before, "no kernel ran on the native tier"


def _results(call, serve, sync) -> list[torch.Tensor]:
    with serve():
        out = call()
        sync()
    return [t.clone() for t in (out if isinstance(out, (list, tuple)) else [out]) if isinstance(t, torch.Tensor)]


def _calls():
    """quantize, dequantize, gemm_4bit at M = 1, 5 and 40 (and 6 with K = 1024: split-K), and an 8-bit
    optimizer step."""
    g = torch.Generator().manual_seed(7)
    A = torch.randn(4096, generator=g).to(torch.float16)
    W = torch.randn(256, 128, generator=g).to(torch.float16)
    ops = torch.ops.bitsandbytes
    calls = {
        "quantize_4bit": lambda: ops.quantize_4bit(A, 64, "nf4", torch.uint8),
        "dequantize_4bit": lambda: ops.dequantize_4bit(*ops.quantize_4bit(A, 64, "fp4", torch.uint8), 64, "fp4",
                                                       [4096], torch.float16),
        "quantize_blockwise": lambda: ops.quantize_blockwise(A, fam.signed_code(), 256),
    }
    for M in (1, 5, 40):
        X = torch.randn(M, 128, generator=g).to(torch.float16)

        def gemm(X=X):
            packed, absmax = ops.quantize_4bit(W, 64, "nf4", torch.uint8)
            return ops.gemm_4bit(X, packed, [256, 128], absmax, 64, "nf4")

        calls[f"gemm_4bit M={M}"] = gemm
    W2 = torch.randn(96, 1024, generator=g).to(torch.float16)
    X2 = torch.randn(6, 1024, generator=g).to(torch.float16)

    def splitk():  # (K = 1024: the split-K kernel, its workspace bound as buffers 18 and 19)
        packed, absmax = ops.quantize_4bit(W2, 64, "nf4", torch.uint8)
        return ops.gemm_4bit(X2, packed, [96, 1024], absmax, 64, "nf4")

    calls["gemm_4bit M=6 K=1024 (split-K)"] = splitk
    case = next(c for c in fam.optimizer_cases(4_173) if "8bit" in c.label)

    def step():
        args = [a.clone() if isinstance(a, torch.Tensor) else a for a in case.args]
        (case.run or (lambda a: getattr(torch.ops.bitsandbytes, case.op)(*a)))(args)
        return [a for a in args if isinstance(a, torch.Tensor)]

    calls[f"optimizer step ({case.label})"] = step
    return calls


def test_the_native_tier_computes_the_emulated_tiers_bits(model, tier, monkeypatch):
    """With tuning off, every call equals the emulated tier's, bit for bit."""
    from bnb_mps.testing import use_emulated_kernels

    monkeypatch.setenv("BNB_MPS_TUNE", "0")

    for name, call in _calls().items():
        before = len(metal_model.MpsBindings.launched)
        native = _results(call, lambda: metal_model.serving_cpu_ops(tier), model.synchronize)
        assert len(metal_model.MpsBindings.launched) > before, name
        if "split-K" in name:
            assert metal_model.MpsBindings.launched[-1] == "bnb_gemm_4bit_splitk_absmax_f16", name
        emulated = _results(call, use_emulated_kernels, lambda: None)
        assert len(native) == len(emulated) > 0, name
        for got, want in zip(native, emulated):
            fam.assert_same_bits(got, want, name)


def test_results_exist_only_after_the_synchronization_when_the_gpu_runs_late(model, tier, monkeypatch):
    """Deferred: nothing runs before its command buffer is committed, so an op that read one of its
    results on the host (a synchronization inside the op, which the native path must never do)
    would read what was there before; the 4-bit family's plain cases still pass, synchronized only
    at the end. (Not the cases where torch's own ops work on a kernel's output, a copy into a
    transposed `out=`: on a Mac they follow on the same stream, here they run on the host at once.)"""
    monkeypatch.setenv("BNB_MPS_TUNE", "0")  # (the built-in routes: tuning's routes include bitsandbytes' CPU code here)
    model.set_deferred(True)
    x = torch.zeros(64)
    add = metal_model.MpsBindings(built_native(model).compile_library(ADD_ONE), model)
    add.launch("add_one", (2, 1, 1), (32, 1, 1), [x, uint32(64).to_bytes()])
    assert not x.any()  # (encoded, not run)
    model.synchronize()
    assert torch.equal(x, torch.ones(64))
    plain = [c for c in fam.fourbit_cases(1_000) if "n=1000 " in c.label and "blocksize=" in c.label
             and "functional" not in c.label]  # fmt: skip
    assert len(plain) >= 4
    with metal_model.serving_cpu_ops(tier):
        for case in plain:
            run_case(case, model)


def built_native(model):
    native, loaded_model = metal_model.load()
    assert loaded_model is model
    return native


def test_a_watch_sees_each_command_buffer_and_its_gpu_times(model):
    """A watched launch's handler goes to the buffer that holds it (attached inside the launch's own
    dispatch block: the model records a handler added to a committed buffer as a misuse); after the
    synchronization, errors() is empty and gpu_times() has one (start, end) pair per watched launch,
    in the order the buffers ran, end >= start."""
    native = built_native(model)
    add = native.compile_library(ADD_ONE)
    watch = native.CommandBufferWatch()
    x = torch.zeros(96)
    for batch in range(3):
        for _ in range(2):
            add.launch("add_one", (3, 1, 1), (32, 1, 1), [model.as_mps(x), uint32(96).to_bytes()], watch)
        model.synchronize()
    assert watch.errors(5.0) == []
    times = watch.gpu_times()
    assert len(times) == 6 and all(end >= start > 0 for start, end in times)
    assert [times[i] for i in (0, 2, 4)] == [times[i] for i in (1, 3, 5)]  # (two launches, one buffer)
    assert times[0][1] <= times[2][0] and times[2][1] <= times[4][0]
    assert max(e for _, e in times) - min(s for s, _ in times) > 0
    assert torch.equal(x, torch.full((96,), 6.0))
    tracked = native.CommandBufferWatch()  # (after the fact: the stream's current buffer)
    add.launch("add_one", (3, 1, 1), (32, 1, 1), [model.as_mps(x), uint32(96).to_bytes()])
    tracked.track()
    model.synchronize()
    assert tracked.errors(5.0) == [] and len(tracked.gpu_times()) == 1
    unwatched = native.CommandBufferWatch()
    add.launch("add_one", (0, 1, 1), (32, 1, 1), [model.as_mps(x), uint32(96).to_bytes()], unwatched)
    assert unwatched.errors(0.5) == [] and unwatched.gpu_times() == []  # (an empty grid: no buffer to watch)


def test_a_command_buffer_error_makes_verification_could_not_run_and_uncached(model, tier):
    """tests/command_buffer_fault.py on the model: a kernel writing far outside its buffer after each
    launch of a family; the emulator's fault fails the command buffer, whose completed handler (the
    watch of csrc/mps_ops.mm) gives verification Metal's error text."""
    import command_buffer_fault as cbf
    from bnb_mps.msl import source
    from bnb_mps.ops import verify as verification

    native = built_native(model)
    fault = metal_model.MpsBindings(native.compile_library(cbf.FAULT_KERNEL.read_text()), model)
    faulting = cbf.FaultingExecutor(tier, fault, device="cpu")
    verification.reset()
    v = verification.verdict("int8_quant", "native", faulting, refresh=True)
    assert faulting.faults > 0
    assert not v.passed and v.could_not_run and v.device_error, v.describe()
    assert "Execution of the command buffer was aborted due to an error during execution" in v.describe()
    assert "GPU reported an error" in v.describe()
    key = verification.cache_key("native", source.source_hash(), faulting)

    def stored() -> dict:
        try:
            return json.loads(verification.cache_path().read_text()).get(key, {})
        except (OSError, ValueError):
            return {}

    assert "int8_quant" not in stored()  # (verified again by the next process)
    clean = verification.verdict("int8_quant", "native", tier, refresh=True)
    assert clean.passed, clean.describe()
    assert "int8_quant" in stored()


def test_launch_errors_are_python_errors(model, tier):
    from bnb_mps.executors import PipelineLimitError

    native = built_native(model)
    with pytest.raises(RuntimeError, match="the Metal compiler rejected the kernel source"):
        native.compile_library("kernel void broken(")
    add = native.compile_library(ADD_ONE)
    with pytest.raises(ValueError, match=r"argument 0 \(\[\[buffer\(0\)\]\]\) of kernel 'add_one' is a tensor on cpu"):
        add.launch("add_one", (1, 1, 1), (32, 1, 1), [torch.zeros(4), uint32(4).to_bytes()])
    with pytest.raises(ValueError, match="scalar of 0 bytes"):
        add.launch("add_one", (1, 1, 1), (32, 1, 1), [model.as_mps(torch.zeros(4)), b""])
    with pytest.raises(ValueError, match="is not in the bnb_mps kernel library"):
        add.launch("no_such_kernel", (1, 1, 1), (32, 1, 1), [])
    model.set_pipeline_limit("add_one", 256)
    limited = native.compile_library(ADD_ONE)  # (a new pipeline: the limit applies)
    with pytest.raises(PipelineLimitError) as e:
        limited.launch("add_one", (1, 1, 1), (512, 1, 1), [model.as_mps(torch.zeros(4)), uint32(4).to_bytes()])
    assert (e.value.kernel, e.value.threads, e.value.maximum) == ("add_one", 512, 256)
    assert limited.pipeline_info("add_one")["max_total_threads_per_threadgroup"] == 256
    # (built as with the macOS 15 SDK on macOS 15: the run-time compile asks for Metal 3.2)
    assert native.language_version() == (3, 2) and tier.language_version == (3, 2)


def test_a_register_heavy_kernels_pipeline_allows_fewer_threads_and_the_native_tier_refuses_more(model, tier):
    """The Metal model's pipelines report maxTotalThreadsPerThreadgroup by the kernel's register use
    (512 for a unit with simdgroup matrices, bnb_mps.modelled_mps.library.modelled_max_threads; 1024
    otherwise); csrc/mps_ops.mm checks a launch against its pipeline's and raises PipelineLimitError
    before encoding."""
    from bnb_mps.executors import PipelineLimitError
    from bnb_mps.modelled_mps.library import REGISTER_HEAVY_MAX_THREADS

    mma = next(k for k in tier._units.kernels() if k.startswith("bnb_gemm_4bit_mma_"))
    plain = next(k for k in tier._units.kernels() if k.startswith("bnb_quantize_4bit"))
    assert tier.pipeline_info(mma)["max_total_threads_per_threadgroup"] == REGISTER_HEAVY_MAX_THREADS < 1024
    assert tier.pipeline_info(plain)["max_total_threads_per_threadgroup"] == 1024
    before = len(metal_model.MpsBindings.launched)
    with pytest.raises(PipelineLimitError) as refused:
        tier.launch(mma, grid=(1, 1, 1), threadgroup=(1024, 1, 1), args=[])
    assert (refused.value.threads, refused.value.maximum) == (1024, REGISTER_HEAVY_MAX_THREADS)
    assert len(metal_model.MpsBindings.launched) == before


def test_without_a_metal_device_the_errors_leave_no_autorelease_pool_open(model):
    """Where Metal has no device, metal_device() throws: csrc/mps_ops.mm asks for it before each
    autorelease pool, since a C++ exception unwinding through @autoreleasepool skips the pool's pop
    (ARC does not clean up for exceptions), which would leave the pool open on the thread."""
    native = built_native(model)
    lib = native.compile_library(ADD_ONE)  # (its pipeline is made on first use, below)
    depth = model.autorelease_pool_depth()
    model.set_device_present(False)
    try:
        for call in (lambda: native.compile_library(ADD_ONE), lambda: native.load_metallib("/no/such.metallib"),
                     lambda: lib.pipeline_info("add_one")):  # fmt: skip
            with pytest.raises(RuntimeError, match=r"no Metal device \(torch.backends.mps.is_available\(\) is False\)"):
                call()
            assert model.autorelease_pool_depth() == depth
    finally:
        model.set_device_present(True)
    assert lib.pipeline_info("add_one")["thread_execution_width"] == 32


# -- the native tier's GPU clock on the modelled GPU clock --------------------------------------------------
#
# set_gpu_clock: the modelled GPU runs committed command buffers back to back, each taking BUFFER plus
# KERNEL per dispatch that ran (nothing after a fault) plus the modelled work of torch's own ops in it.
# The expected batch times below are sums of those costs.

KERNEL, BUFFER, TORCH_OP = 1e-4, 1e-5, 3e-4


def add_one_tier(model):
    """A NativeExecutor (csrc/mps_ops.mm on the model) whose library is ADD_ONE and the fault kernel."""
    import command_buffer_fault as cbf
    from bnb_mps.executors import native as native_tier
    from bnb_mps.executors.base import CompileUnits

    native = built_native(model)
    libs = {"add": metal_model.MpsBindings(native.compile_library(ADD_ONE), model),
            "fault": metal_model.MpsBindings(native.compile_library(cbf.FAULT_KERNEL.read_text()), model)}
    units = CompileUnits(libs, {"add_one": "add", cbf.FAULT_NAME: "fault"}, {})
    ex = native_tier.NativeExecutor(units, native.CommandBufferWatch)
    ex.device_type = "cpu"
    ex.synchronize = model.synchronize
    return ex


def add_one(ex, x):
    ex.prepare("add_one", (1, 1, 1), (32, 1, 1))([x, uint32(x.numel()).to_bytes()])


def test_the_native_clock_is_the_gpu_span_of_the_batch_not_a_sum_of_what_its_launches_report(model):
    """Calls of two launches each, with nothing committing between them: the batch is one command buffer,
    BUFFER + 2n * KERNEL of modelled GPU time, which every one of its 2n watched launches reports."""
    from bnb_mps.executors import clocks

    model.set_gpu_clock(lambda kernel: KERNEL, BUFFER)
    ex, x = add_one_tier(model), torch.zeros(32)
    for n in (1, 4):
        seconds = clocks.CommandBufferClock(ex).batch(lambda: (add_one(ex, x), add_one(ex, x)), n)
        assert seconds == pytest.approx(BUFFER + 2 * n * KERNEL, rel=1e-9)
    assert torch.equal(x, torch.full((32,), 10.0))


def test_the_native_clock_measures_torch_s_own_work_of_a_call(model):
    """A call whose route ends with torch's own op (e.g. dequantize+linear's linear, an MPSGraph op that
    commits what was encoded and goes on in a new command buffer): the op's work of the last call is in
    a buffer no launch of the batch is in, which the clock watches after each call (track()). n calls:
    n + 1 buffers, n kernels, n torch ops."""
    from bnb_mps.executors import clocks

    model.set_gpu_clock(lambda kernel: KERNEL, BUFFER)
    ex, x = add_one_tier(model), torch.zeros(32)
    n = 3
    seconds = clocks.CommandBufferClock(ex).batch(lambda: (add_one(ex, x), model.torch_op(TORCH_OP)), n)
    assert seconds == pytest.approx((n + 1) * BUFFER + n * (KERNEL + TORCH_OP), rel=1e-9)


def test_the_native_clock_watches_no_empty_buffer_after_a_call_that_synchronised(model):
    """A route that synchronises (commits and waits) at its end leaves the stream no command buffer:
    track() watches nothing then, and makes none (an empty buffer, committed by the clock's own
    synchronisation, would add its time to the batch's). n calls: n buffers of one kernel each."""
    from bnb_mps.executors import clocks

    model.set_gpu_clock(lambda kernel: KERNEL, BUFFER)
    ex, x = add_one_tier(model), torch.zeros(32)
    watch = built_native(model).CommandBufferWatch()
    add_one(ex, x)
    model.synchronize()
    assert watch.track() is False  # (the stream has no command buffer)
    add_one(ex, x)
    assert watch.track() is True
    model.synchronize()
    assert watch.errors(5.0) == [] and len(watch.gpu_times()) == 1
    n = 3
    seconds = clocks.CommandBufferClock(ex).batch(lambda: (add_one(ex, x), model.synchronize()), n)
    assert seconds == pytest.approx(n * (BUFFER + KERNEL), rel=1e-9)


def test_the_native_clock_fails_where_a_command_buffer_of_the_batch_failed(model):
    """A route whose command buffer the GPU aborts (a page fault here; a watchdog timeout alike) runs
    nothing after its fault, so it would look fastest: the clock refuses the batch (ClockFailed), and
    the next batch is timed again."""
    import command_buffer_fault as cbf
    from bnb_mps.executors import clocks
    from bnb_mps.kernel_args import uint64

    model.set_gpu_clock(lambda kernel: KERNEL, BUFFER)
    ex, x = add_one_tier(model), torch.zeros(32)
    target = torch.zeros(32, dtype=torch.int32)
    fault = ex.prepare(cbf.FAULT_NAME, (1, 1, 1), (32, 1, 1))

    def aborting():
        fault([target, uint64(cbf.FAR_ELEMENTS).to_bytes()])
        add_one(ex, x)

    with pytest.raises(clocks.ClockFailed, match="did not complete"):
        clocks.CommandBufferClock(ex).batch(aborting, 2)
    assert clocks.CommandBufferClock(ex).batch(lambda: add_one(ex, x), 2) == pytest.approx(BUFFER + 2 * KERNEL)


@pytest.mark.parametrize("where,allowed", [("queue", True), ("off-queue", False), ("committed", False)])
def test_the_model_allows_a_completed_handler_only_before_commit_on_the_streams_queue(model, where, allowed):
    """Apple: addCompletedHandler: is called before commit; torch's stream state (its current command
    buffer) is touched only on the stream's serial queue, where commits happen. The model records a
    misuse, and attaches nothing, otherwise."""
    ran = model.probe_completed_handler(where)
    misuses = model.misuses()
    assert ran == allowed and (misuses == []) == allowed, misuses
    if not allowed:
        assert len(misuses) == 1 and "addCompletedHandler:" in misuses[0], misuses


def test_a_watch_waits_for_handlers_that_run_after_the_waiters_woke(model):
    """Metal orders nothing between waitUntilCompleted returning and the completed handlers: the model
    wakes the waiters first and calls the handlers 0.3 s later. errors() waits for the handlers, so the
    GPU times are all there after it, whichever came first."""
    model.set_handler_delay(0.3)
    native = built_native(model)
    add = native.compile_library(ADD_ONE)
    watch = native.CommandBufferWatch()
    x = torch.zeros(32)
    for _ in range(2):
        add.launch("add_one", (1, 1, 1), (32, 1, 1), [model.as_mps(x), uint32(32).to_bytes()], watch)
        model.synchronize()
    assert watch.errors(10.0) == [] and len(watch.gpu_times()) == 2


def test_tuning_on_the_native_tier_times_batches_of_several_calls_by_their_command_buffers_gpu_times(
        model, tier, monkeypatch, tmp_path):  # fmt: skip
    """First-use tuning on the native tier on the modelled GPU clock (KERNEL per dispatch, a call of a
    kernel route well below timing's 1 ms minimum, so batches hold several calls): every launch of a
    timed batch is given a watch (NativeExecutor.watching) and torch's own work after it is tracked; a
    batch is max(GPUEndTime) - min(GPUStartTime). Each kernel route's call is one dispatch: KERNEL plus
    at most one BUFFER per call; dequantize+linear's is its dequantize kernel plus its linear (torch's
    op, modelled as TORCH_OP of GPU work in a command buffer of its own). The decision is kept with the
    GPU clock; no misuse of Metal recorded (the model's fixture checks). bitsandbytes' route on CPU
    tensors does no GPU work here, so it is excluded."""
    import bnb_mps
    from bnb_mps.executors import clocks
    from bnb_mps.ops import tuning

    monkeypatch.setenv(tuning.ENV_VAR, "1")
    monkeypatch.setenv(tuning.EXCLUDE_ENV_VAR, "bitsandbytes")
    for name in ("current_stream", "default_stream"):  # (torch >= 2.15's streams: a CPU build cannot make one)
        if hasattr(torch.mps, name):
            monkeypatch.setattr(torch.mps, name, lambda: types.SimpleNamespace(stream_id=0))
    monkeypatch.setenv(tuning.CACHE_ENV_VAR, str(tmp_path / "tune.json"))
    batches = []
    real = clocks.CommandBufferClock.batch
    monkeypatch.setattr(clocks.CommandBufferClock, "batch", lambda self, call, n: batches.append(n) or real(self, call, n))
    linear = torch.nn.functional.linear
    monkeypatch.setattr(torch.nn.functional, "linear", lambda *a, **k: (linear(*a, **k), model.torch_op(TORCH_OP))[0])
    model.set_gpu_clock(lambda kernel: KERNEL, BUFFER)
    g = torch.Generator().manual_seed(5)
    W = torch.randn(256, 128, generator=g)
    X = torch.randn(5, 128, generator=g).to(torch.float16)
    rows = tuned_gemm_4bit(model, tier, W, X)
    assert len(rows) == 1 and rows[0]["tier"] == "native" and rows[0]["clock"] == "gpu", rows
    times = rows[0]["times"]
    assert not rows[0]["errors"] and len(times) >= 3 and "dequantize+linear" in times, rows
    assert max(batches) > 1, batches  # (batches of several calls)
    for route, t in times.items():
        work = KERNEL + (TORCH_OP if route == "dequantize+linear" else 0.0)
        assert work < t <= work + 2 * BUFFER + 1e-12, (route, t, times)
    assert json.loads((tmp_path / "tune.json").read_text())


def test_a_route_whose_command_buffers_abort_while_timed_is_not_taken_for_the_fastest(model, tier, monkeypatch,
                                                                                    tmp_path):  # fmt: skip
    """First-use tuning where the mma route's command buffers fail while it is timed (a page fault before
    its kernel, which then never runs: on the modelled GPU clock the route costs next to nothing, so
    taken as a timing it would be the fastest and be cached). A batch with a failed buffer is no
    timing: twice, so nothing measured for the shape is kept or cached, and the built-in route serves."""
    import bnb_mps
    import command_buffer_fault as cbf
    from bnb_mps.kernel_args import uint64
    from bnb_mps.ops import tuning

    monkeypatch.setenv(tuning.ENV_VAR, "1")
    monkeypatch.setenv(tuning.EXCLUDE_ENV_VAR, "bitsandbytes")
    for name in ("current_stream", "default_stream"):
        if hasattr(torch.mps, name):
            monkeypatch.setattr(torch.mps, name, lambda: types.SimpleNamespace(stream_id=0))
    monkeypatch.setenv(tuning.CACHE_ENV_VAR, str(tmp_path / "tune.json"))
    model.set_gpu_clock(lambda kernel: 0.0 if kernel == cbf.FAULT_NAME else KERNEL, BUFFER)
    fault = metal_model.MpsBindings(built_native(model).compile_library(cbf.FAULT_KERNEL.read_text()), model)
    target, far = torch.zeros(32, dtype=torch.int32), uint64(cbf.FAR_ELEMENTS).to_bytes()
    real_prepare, faulted = tier.prepare, []

    def prepare(kernel, grid, threadgroup):
        launch = real_prepare(kernel, grid, threadgroup)
        if not kernel.startswith("bnb_gemm_4bit_mma_"):
            return launch

        def aborting(args):
            if getattr(tier._timing, "watch", None) is not None:  # (while timed only: verification passes)
                fault.launch(cbf.FAULT_NAME, (1, 1, 1), (32, 1, 1), [target, far])
                faulted.append(kernel)
            launch(args)

        return aborting

    monkeypatch.setattr(tier, "prepare", prepare)
    g = torch.Generator().manual_seed(9)
    W = torch.randn(192, 128, generator=g)
    X = torch.randn(3, 128, generator=g).to(torch.float16)
    rows = tuned_gemm_4bit(model, tier, W, X)
    assert faulted, "the mma route was not timed"
    assert rows == [], rows
    cache = tmp_path / "tune.json"
    assert not (cache.exists() and "gemm_4bit" in cache.read_text())
