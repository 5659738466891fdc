"""Tuning (bnb_mps.ops.tuning): an op with several routes takes the fastest verified one per shape key,
measured at first use, kept per machine.

No machine here has a GPU clock, so the decisions are driven by bnb_mps.testing.fixed_timings on the
emulated tier (the kernels run under the emulator; each candidate still runs once), as the issue's
checks do; the test of the `always` switch times the emulated kernels on the host's clock. The
reference for what serves a call is always that route computed directly: the kernel path through its
planner's route argument, dequantize+linear from bitsandbytes ops and torch's linear, bitsandbytes'
own implementation with bnb-mps not registered.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import bitsandbytes.functional as F
import extras
import pytest
import torch
from torch._C import DispatchKey, DispatchKeySet

import bnb_mps
from bnb_mps import executors, ops
from bnb_mps.executors import clocks
from bnb_mps.ops import candidates, tuning, verify
from bnb_mps.testing import RecordingExecutor, fixed_timings, use_emulated_kernels

pytest.importorskip("bnb_mps._emu")
MPS = DispatchKeySet(DispatchKey.MPS)
pytestmark = [pytest.mark.filterwarnings("ignore::bnb_mps.executors.SlowTierWarning"),
              pytest.mark.filterwarnings("ignore::bnb_mps.ops.verify.VerificationWarning")]
REPO = Path(__file__).resolve().parents[1]
bnb = torch.ops.bitsandbytes
ALL_ROUTES = ("gemv", "gemv/tglut", "batch", "small", "small/wide", "mma", "kernel", "dequantize+linear",
              "bitsandbytes")


@pytest.fixture(autouse=True)
def _fresh_choices(monkeypatch, tmp_path):
    """Each test decides its keys afresh, in a cache file of its own, with tuning switched by the test alone."""
    for var in (tuning.ENV_VAR, tuning.EXCLUDE_ENV_VAR):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv(tuning.CACHE_ENV_VAR, str(tmp_path / "tune.json"))
    tuning.reset()
    yield
    tuning.reset()


def gemm_args(M, N=48, K=256, dtype=torch.float32, nested=True, bias=False, blocksize=64, quant_type="nf4", seed=0):
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(N, K, generator=g)
    packed, state = F.quantize_4bit(W, blocksize=blocksize, quant_type=quant_type, compress_statistics=nested)
    A = torch.randn(M, K, generator=g).to(dtype)
    b = torch.randn(N, generator=g).to(dtype) if bias else None
    if nested:
        return [A, packed, [N, K], state.state2.absmax, blocksize, quant_type, b, state.absmax, state.state2.code,
                state.offset.reshape(1)]  # fmt: skip
    return [A, packed, [N, K], state.absmax, blocksize, quant_type, b, None, None, None]


def times_favouring(route: str) -> dict:
    """Every route at 1 ms, `route` ten times faster."""
    return {**dict.fromkeys(ALL_ROUTES, 1e-3), route: 1e-4}


def row_of(op: str, **fields) -> dict:
    rows = [r for r in bnb_mps.tuning_table() if r["op"] == op and all(r[k] == v for k, v in fields.items())]
    assert len(rows) == 1, (op, fields, bnb_mps.tuning_table())
    return rows[0]


def same_bits(got, want) -> bool:
    if isinstance(want, (tuple, list)):
        return len(got) == len(want) and all(same_bits(g, w) for g, w in zip(got, want))
    if isinstance(want, torch.Tensor):
        return (got.dtype == want.dtype and got.shape == want.shape
                and torch.equal(got.contiguous().view(torch.uint8), want.contiguous().view(torch.uint8)))  # fmt: skip
    return got == want


def gemm_by_hand(route: str, args: list, metal_version: str = "3.1"):
    """gemm_4bit computed on `route` directly (tuning off: nothing here goes through a choice), with the
    kernels compiled at `metal_version`."""
    args = copy.deepcopy(args)
    if route == "bitsandbytes":  # bitsandbytes alone (bnb-mps is not registered for the cpu key here)
        return bnb.gemm_4bit.default(*args)
    with use_emulated_kernels(metal_version=metal_version) as kernels:
        if route == "dequantize+linear":  # bitsandbytes' ops (served by bnb-mps' kernels here), then linear
            A, B, shapeB, absmax, blocksize, quant_type, bias, q8, code8, offset = args
            if q8 is not None:
                absmax = bnb.dequantize_blockwise.default(q8, absmax, code8, 256, torch.float32) + offset
            W = bnb.dequantize_4bit.default(B, absmax, blocksize, quant_type, shapeB, A.dtype)
            return torch.nn.functional.linear(A, W, bias)
        return ops.OPS["gemm_4bit"].kernel(kernels, *args, route=route)


# -- the choice serves, bit for bit --------------------------------------------------------------------------

GEMM_ROUTES = [(1, "gemv"), (1, "gemv/tglut"), (1, "batch"), (1, "small"), (1, "mma"), (1, "dequantize+linear"),
               (3, "small"), (3, "small/wide"), (3, "batch"), (3, "gemv"), (3, "mma"), (3, "dequantize+linear"),
               (3, "bitsandbytes"),
               (40, "mma"), (40, "dequantize+linear"), (40, "bitsandbytes")]  # fmt: skip


@pytest.mark.parametrize("nested", [True, False], ids=["nested", "plain"])
@pytest.mark.parametrize("M,route", GEMM_ROUTES, ids=[f"M{m}-{r}" for m, r in GEMM_ROUTES])
def test_the_fastest_route_serves_the_result_of_that_route(M, route, nested):
    args = gemm_args(M, nested=nested, bias=not nested, dtype=torch.float16 if nested else torch.float32)
    want = gemm_by_hand(route, args)
    with use_emulated_kernels() as kernels, fixed_timings(times_favouring(route)):
        got = bnb.gemm_4bit.default(*copy.deepcopy(args))
        kernels.clear()
        again = bnb.gemm_4bit.default(*copy.deepcopy(args))  # the kept choice: no measuring, the route alone
    row = row_of("gemm_4bit")
    assert row["choice"] == route and row["clock"] == "fixed" and not row["cached"], row
    assert set(row["times"]) == set(candidates_of(M)), row
    assert same_bits(got, want) and same_bits(again, want)
    assert kernels.launched == launched_by(route, nested), kernels.launched


SPLITK_ROUTES = [("3.2", "splitk"), ("3.2", "splitk/two"), ("3.2", "small"), ("3.1", "splitk/two"), ("3.1", "small")]


@pytest.mark.parametrize("metal_version,route", SPLITK_ROUTES, ids=[f"metal{v}-{r}" for v, r in SPLITK_ROUTES])
def test_from_k_512_the_split_k_kernel_is_the_built_in_route_and_a_candidate(metal_version, route):
    """K = 512 (two slices of 256): the split-K kernel serves the first call (one dispatch from Metal 3.2,
    two below) and is measured beside the small kernel and the others (the two-dispatch split-K at 3.2
    too; the one-dispatch kernel never below 3.2); whichever the timings favour then serves, bit for bit."""
    args = gemm_args(3, K=512, dtype=torch.float16, bias=True)
    want = gemm_by_hand(route, args, metal_version)
    with use_emulated_kernels(metal_version=metal_version) as kernels, fixed_timings(times_favouring(route)):
        got = bnb.gemm_4bit.default(*copy.deepcopy(args))
        kernels.clear()
        again = bnb.gemm_4bit.default(*copy.deepcopy(args))
    row = row_of("gemm_4bit")
    default = "splitk" if metal_version == "3.2" else "splitk/two"
    assert row["default"] == default and row["choice"] == route, row
    splitk = {"splitk", "splitk/two"} if metal_version == "3.2" else {"splitk/two"}
    assert set(row["times"]) == set(candidates_of(3)) | splitk, row
    assert same_bits(got, want) and same_bits(again, want)
    assert kernels.launched == launched_by(route, True), kernels.launched


def candidates_of(M):
    return {1: ("gemv", "gemv/tglut", "batch", "small", "small/wide", "mma", "dequantize+linear", "bitsandbytes"),
            3: ("gemv", "gemv/tglut", "batch", "small", "small/wide", "mma", "dequantize+linear", "bitsandbytes"),
            40: ("mma", "dequantize+linear", "bitsandbytes")}[M]  # fmt: skip


def launched_by(route: str, nested: bool) -> list:
    sc, dt = ("nested", "f16") if nested else ("absmax", "f32")
    scales = ["bnb_dequantize_blockwise_f32"] if nested else []
    return {"gemv": [f"bnb_gemv_4bit_{sc}_{dt}"], "gemv/tglut": [f"bnb_gemv_4bit_tglut_{sc}_{dt}"],
            "batch": [f"bnb_gemm_4bit_batch_{sc}_{dt}"], "mma": [f"bnb_gemm_4bit_mma_{sc}_{dt}"],
            "small": [f"bnb_gemm_4bit_small_{sc}_{dt}"], "small/wide": [f"bnb_gemm_4bit_small_wide_{sc}_{dt}"],
            "splitk": [f"bnb_gemm_4bit_splitk_{sc}_{dt}"],
            "splitk/two": [f"bnb_gemm_4bit_splitk_partial_{sc}_{dt}", f"bnb_gemm_4bit_splitk_sum_{dt}"],
            "dequantize+linear": scales + [f"bnb_dequantize_4bit_nf4_{dt}"],
            # (bitsandbytes' gemm_4bit calls the dequantize ops through the dispatcher, where the same timings
            # make bitsandbytes' own CPU dequantize_blockwise serve; its CPU dequantize_4bit is no route here)
            "bitsandbytes": [f"bnb_dequantize_4bit_nf4_{dt}"]}[route]  # fmt: skip


OTHER_OPS = {
    "quantize_4bit": lambda: [torch.randn(64, 96, generator=torch.Generator().manual_seed(1)), 64, "nf4", torch.uint8],
    "quantize_blockwise": lambda: [torch.randn(5000, generator=torch.Generator().manual_seed(2)),
                                   F.create_dynamic_map(signed=True), 256],
    "optimizer_update_32bit": lambda: ["adam", *(torch.randn(3000, generator=torch.Generator().manual_seed(s))
                                                 for s in (3, 4)), torch.zeros(3000), torch.zeros(3000), None, 0.0, 0.0,
                                       0.9, 0.999, 0.0, 0.0, 1e-8, 0.01, 3, 1e-3, 1.0, False],
}  # fmt: skip


@pytest.mark.parametrize("route", ["kernel", "bitsandbytes"])
@pytest.mark.parametrize("name", sorted(OTHER_OPS))
def test_quantize_and_optimizer_ops_take_the_fastest_of_kernel_and_bitsandbytes(name, route):
    """In-place updates too: the caller's tensors are updated once, by the chosen route alone."""
    args = OTHER_OPS[name]()
    want_args = copy.deepcopy(args)
    if route == "bitsandbytes":
        want = ops.op_packet(name)(*want_args)  # bitsandbytes' own CPU implementation
    else:
        with use_emulated_kernels() as kernels:
            want = ops.OPS[name].kernel(kernels, *want_args)
    got_args = copy.deepcopy(args)
    with use_emulated_kernels(), fixed_timings(times_favouring(route)):
        got = ops.op_packet(name)(*got_args)
    row = row_of(name)
    assert row["choice"] == route and set(row["times"]) == {"kernel", "bitsandbytes"}, row
    assert same_bits(got, want) and same_bits(got_args, want_args)


def test_a_route_faster_by_less_than_the_margin_does_not_replace_the_built_in_one():
    args = gemm_args(40)  # built-in: mma
    for ratio, choice in ((1.04, "mma"), (1.06, "dequantize+linear")):
        tuning.reset()
        with use_emulated_kernels(), fixed_timings({"mma": 1e-3 * ratio, "dequantize+linear": 1e-3,
                                                    "bitsandbytes": 2e-3}):  # fmt: skip
            bnb.gemm_4bit.default(*copy.deepcopy(args))
        row = row_of("gemm_4bit", default="mma")
        assert row["choice"] == choice, (ratio, row)
    assert tuning.decide({"mma": 1.05e-3, "gemv": 1e-3}, "mma") == "mma"
    assert tuning.decide({"mma": 1.051e-3, "gemv": 1e-3}, "mma") == "gemv"
    assert tuning.decide({"gemv": 1e-3, "batch": 0.5e-3}, "mma") == "batch"  # (the default raised)
    assert tuning.decide({}, "mma") == "mma"


def test_the_shape_key_rounds_rows_up_to_a_power_of_two_and_reads_no_data():
    calls = [gemm_args(M) for M in (3, 4, 5, 8)]
    calls.append(gemm_args(4))
    calls[-1][0] = torch.full_like(calls[-1][0], float("nan"))
    with use_emulated_kernels(), fixed_timings(times_favouring("mma")):
        for args in calls:
            bnb.gemm_4bit.default(*args)
    keys = sorted(r["key"] for r in bnb_mps.tuning_table() if r["op"] == "gemm_4bit")
    assert keys == ["gemm_4bit float32 M<=4 N=48 K=256 blocksize=64 nf4 nested",
                    "gemm_4bit float32 M<=8 N=48 K=256 blocksize=64 nf4 nested"]  # fmt: skip
    assert [candidates.m_bucket(M) for M in (1, 2, 3, 4096, 4097, 10**6)] == [1, 2, 4, 4096, 4097, 4097]


def test_measuring_leaves_the_callers_random_numbers_alone():
    """Fresh inputs come from a generator of their own: a first call changes no later random draw."""
    args = gemm_args(40)
    torch.manual_seed(123)
    want = torch.rand(4)
    torch.manual_seed(123)
    with use_emulated_kernels(), fixed_timings(times_favouring("mma")):
        bnb.gemm_4bit.default(*args)
    assert row_of("gemm_4bit")["times"]["mma"] == 1e-4 and torch.equal(torch.rand(4), want)


def test_a_candidate_that_raises_is_dropped_with_its_error():
    """A GPU tier whose dequantize kernel fails at launch (a stand-in for a fault): dequantize+linear,
    measured fastest, raises there and is no candidate; the next fastest serves."""

    class Faulty(RecordingExecutor):
        def launch(self, kernel, *, grid, threadgroup, args):
            if kernel.startswith("bnb_dequantize_4bit_"):
                raise RuntimeError(f"{kernel}: command buffer error")
            super().launch(kernel, grid=grid, threadgroup=threadgroup, args=args)

    faulty = Faulty(executors.load_tier("emulated"))
    entry = ops.dispatcher_entry("gemm_4bit", faulty, None, lambda *a: bnb.gemm_4bit.default(*a))
    args = gemm_args(40)
    with fixed_timings({"dequantize+linear": 1e-4, "bitsandbytes": 5e-4, "mma": 1e-3}):
        got = entry(tuple(copy.deepcopy(args)), {})
    row = row_of("gemm_4bit")
    assert row["choice"] == "bitsandbytes" and "dequantize+linear" not in row["times"], row
    assert row["errors"] == {"dequantize+linear": "RuntimeError: bnb_dequantize_4bit_nf4_f32: command buffer error"}
    assert same_bits(got, gemm_by_hand("bitsandbytes", args))


def test_a_candidate_that_raises_while_timed_is_dropped_and_the_others_timed(monkeypatch):
    """As above, on a real clock (the host's: the emulated kernels timed), with a route that runs once
    (the warm-up) and raises in a timed batch: a route's own error while it is timed drops that route,
    never the measurement (which a clock's trouble, timing.TimingFailed, would: it keeps nothing)."""

    class Faulty(RecordingExecutor):
        dequantized = 0

        def launch(self, kernel, *, grid, threadgroup, args):
            if kernel.startswith("bnb_dequantize_4bit_"):
                self.dequantized += 1
                if self.dequantized > 1:
                    raise RuntimeError(f"{kernel}: command buffer error")
            super().launch(kernel, grid=grid, threadgroup=threadgroup, args=args)

    monkeypatch.setenv(tuning.ENV_VAR, "1")
    faulty = Faulty(executors.load_tier("emulated"))
    entry = ops.dispatcher_entry("gemm_4bit", faulty, None, lambda *a: bnb.gemm_4bit.default(*a))
    args = small_gemm()
    got = entry(tuple(copy.deepcopy(args)), {})
    row = row_of("gemm_4bit")
    assert row["clock"] == "host" and set(row["times"]) == set(candidates_of(3)) - {"dequantize+linear"}, row
    assert row["errors"] == {"dequantize+linear": "RuntimeError: bnb_dequantize_4bit_nf4_f32: command buffer error"}
    assert same_bits(got, gemm_by_hand(row["choice"], args))



@pytest.mark.parametrize("error", [ValueError, OSError, MemoryError, KeyError])
def test_whatever_first_use_raises_the_built_in_route_serves_and_nothing_is_kept(monkeypatch, error):
    """Making the tuning inputs fails (any exception, not only torch's RuntimeError): the user's call is
    served by its built-in route, nothing is kept in the table or the cache."""
    monkeypatch.setenv(tuning.ENV_VAR, "1")
    real_init = candidates.Candidates.__init__

    def failing_fresh(self, *a, **k):
        real_init(self, *a, **k)

        def fresh():
            raise error("no memory for the tuning inputs")

        self.fresh = fresh

    monkeypatch.setattr(candidates.Candidates, "__init__", failing_fresh)
    args = small_gemm()
    with use_emulated_kernels() as kernels:
        got = bnb.gemm_4bit.default(*copy.deepcopy(args))
    assert kernels.launched == ["bnb_gemm_4bit_small_nested_f32"] and bnb_mps.tuning_table() == []
    assert same_bits(got, gemm_by_hand("small", args)) and not tuning.cache_path().exists()

def test_switch_0_keeps_the_built_in_order_and_excluded_routes_are_no_candidates(monkeypatch):
    args = gemm_args(40)
    monkeypatch.setenv(tuning.ENV_VAR, "0")
    with use_emulated_kernels() as kernels, fixed_timings(times_favouring("dequantize+linear")):
        bnb.gemm_4bit.default(*copy.deepcopy(args))
    assert kernels.launched == ["bnb_gemm_4bit_mma_nested_f32"] and bnb_mps.tuning_table() == []
    monkeypatch.setenv(tuning.ENV_VAR, "1")
    monkeypatch.setenv(tuning.EXCLUDE_ENV_VAR, "dequantize+linear, bitsandbytes")
    with use_emulated_kernels() as kernels, fixed_timings(times_favouring("dequantize+linear")):
        bnb.gemm_4bit.default(*copy.deepcopy(args))
    row = row_of("gemm_4bit")
    assert row["choice"] == "mma" and list(row["times"]) == ["mma"], row
    assert row["left_out"] == dict.fromkeys(["dequantize+linear", "bitsandbytes"],
                                            "excluded by BNB_MPS_TUNE_EXCLUDE")  # fmt: skip


def test_tuning_is_off_on_the_emulated_tier_unless_asked_for(monkeypatch):
    assert tuning.mode("emulated", False) == "0" and tuning.mode("shader", False) == "0"
    assert tuning.mode("native", True) == "1" and tuning.mode("shader", True) == "1"
    monkeypatch.setenv(tuning.ENV_VAR, "always")
    assert tuning.mode("emulated", False) == "always"
    monkeypatch.setenv(tuning.ENV_VAR, "sometimes")
    assert tuning.mode("emulated", False) == "0" and tuning.mode("native", True) == "1"
    monkeypatch.delenv(tuning.ENV_VAR)
    args = gemm_args(40)
    with use_emulated_kernels() as kernels:
        bnb.gemm_4bit.default(*args)
    assert kernels.launched == ["bnb_gemm_4bit_mma_nested_f32"] and bnb_mps.tuning_table() == []
    # A GPU tier's calls are on its GPU only with tensors of its own device (else: tuning off, the host's clock).
    gpu = type("GPU", (), {"device_type": "mps"})()
    assert tuning.on_gpu("shader", gpu, torch.device("mps")) and tuning.on_gpu("native", gpu, torch.device("mps"))
    assert not tuning.on_gpu("shader", gpu, torch.device("cpu")) and not tuning.on_gpu("emulated", gpu, torch.device("mps"))
    assert isinstance(tuning.clock_for("shader", gpu, torch.device("cpu")), clocks.HostClock)


def test_always_measures_each_key_again_once_per_process_and_rewrites_it(monkeypatch):
    """Timed for real here: the emulated kernels on the host's clock (figures that mean nothing for a GPU)."""
    args = gemm_args(3, N=24, K=128)
    with use_emulated_kernels(), fixed_timings(times_favouring("dequantize+linear")):
        bnb.gemm_4bit.default(*copy.deepcopy(args))
    measured = []
    real = tuning.measure
    monkeypatch.setattr(tuning, "measure", lambda c, *a, **k: measured.append(c.op) or real(c, *a, **k))
    monkeypatch.setenv(tuning.ENV_VAR, "1")
    with use_emulated_kernels() as kernels:
        bnb.gemm_4bit.default(*copy.deepcopy(args))  # the cached choice, not measured
    assert measured == [] and row_of("gemm_4bit")["choice"] == "dequantize+linear"
    assert kernels.launched == ["bnb_dequantize_blockwise_f32", "bnb_dequantize_4bit_nf4_f32"]
    # Always, from here on in this process, which read the key's choice from the cache: a new signature of
    # the key (M rounds up to 4) measures it, and the calls after take that measurement.
    monkeypatch.setenv(tuning.ENV_VAR, "always")
    four = gemm_args(4, N=24, K=128)
    with use_emulated_kernels():
        bnb.gemm_4bit.default(*copy.deepcopy(four))
        for _ in range(2):
            bnb.gemm_4bit.default(*copy.deepcopy(args))
        bnb.gemm_4bit.default(*four)
    # (measuring bitsandbytes' gemm_4bit calls dequantize_blockwise, whose new key is measured too)
    assert measured.count("gemm_4bit") == 1, measured
    row = row_of("gemm_4bit")
    assert row["clock"] == "host" and not row["cached"] and row["times"]["small"] > 0
    assert set(row["times"]) == {"gemv", "gemv/tglut", "batch", "small", "small/wide", "mma", "dequantize+linear",
                                 "bitsandbytes"}, row
    (stored,) = [e for entries in json.loads(tuning.cache_path().read_text()).values() for k, e in entries.items()
                 if k == row["key"]]  # fmt: skip
    assert stored["clock"] == "host" and stored["times"] == row["times"] and stored["choice"] == row["choice"]


# -- verification decides the candidates ---------------------------------------------------------------------


def stand_in_for_shader(mp, tmp_path, stand_in):
    """`stand_in` (an executor running the emulated tier's kernels) as the shader tier, the only GPU tier,
    with its verification verdicts in a cache of the test's own and none in memory."""
    stand_in.name = "shader"

    def load(name):
        if name == "shader":
            return stand_in
        raise executors.ExecutorUnavailable(f"{name} stands in as unavailable")

    mp.setattr(executors, "load_tier", load)
    mp.setenv(verify.CACHE_ENV_VAR, str(tmp_path / "verify.json"))  # (its failures stay here)
    verify.reset()
    executors.reset()
    return stand_in


def test_routes_of_an_unverified_family_are_never_candidates(fresh_tier_selection, tmp_path):
    """A GPU tier (the emulated executor standing in as "shader", mps calls through the MPS key) whose
    threadgroup-table gemv kernels and NF4 dequantize kernel fault: their families fail first-use
    verification, so gemv/tglut and dequantize+linear are no candidates of gemm_4bit, however fast."""
    class Faulty(RecordingExecutor):
        def launch(self, kernel, *, grid, threadgroup, args):
            if "_tglut_" in kernel or kernel.startswith("bnb_dequantize_4bit_nf4_"):
                raise RuntimeError(f"{kernel}: the GPU faulted")
            super().launch(kernel, grid=grid, threadgroup=threadgroup, args=args)

    args = gemm_args(1, nested=False)
    want = gemm_by_hand("batch", args)
    stand_in_for_shader(fresh_tier_selection, tmp_path, Faulty(executors.load_tier("emulated")))
    try:
        with fixed_timings({"gemv/tglut": 1e-5, "dequantize+linear": 2e-5, "batch": 1e-4, "gemv": 1e-3}):
            got = ops.op_packet("gemm_4bit").redispatch(MPS, *copy.deepcopy(args))
        row = row_of("gemm_4bit")
        assert row["tier"] == "shader" and row["choice"] == "batch", row
        assert "gemv/tglut" not in row["times"] and "dequantize+linear" not in row["times"]
        assert "matmul_4bit_tglut did not pass" in row["left_out"]["gemv/tglut"]
        assert "nf4_fp4 did not pass" in row["left_out"]["dequantize+linear"]
        assert ops.route("gemm_4bit").tier == "shader"  # (a variant's family takes no op off the tier)
        assert same_bits(got, want)
    finally:
        verify.reset()


@pytest.mark.parametrize("metal_version,route,families", [
    ("3.2", "splitk", ("matmul_4bit_splitk", "matmul_4bit_splitk_two")), ("3.1", "splitk/two", ("matmul_4bit_splitk_two",))])
def test_a_split_k_kernel_that_fails_verification_gives_way_to_the_small_kernel(fresh_tier_selection, tmp_path,
                                                                                metal_version, route, families):
    """A GPU tier (the emulated executor standing in as "shader", its kernels compiled at `metal_version`)
    on which the split-K kernels' partial sums never reach the output (their launches dropped, as if the
    threadgroups' hand-over did not hold on this GPU): the families of the tier's split-K paths (one
    dispatch from Metal 3.2, and two; two only below) fail first-use verification, and the calls they
    would serve (2 <= M <= 32, K >= 512) take the small kernel, with tuning off and on, the ops staying on
    the tier; the split-K kernels never run for the user."""
    from bnb_mps.executors import emulated

    with emulated.settings(metal_version=metal_version):
        _split_k_gives_way(fresh_tier_selection, tmp_path, route, families, tuple(map(int, metal_version.split("."))))


def _split_k_gives_way(fresh_tier_selection, tmp_path, route, families, version):
    class Dropping(RecordingExecutor):
        def launch(self, kernel, *, grid, threadgroup, args):
            if "_splitk_" in kernel:
                self.launches.append((kernel, tuple(grid), tuple(threadgroup), []))
                return
            super().launch(kernel, grid=grid, threadgroup=threadgroup, args=args)

    calls = {M: gemm_args(M, N=40, K=1024, dtype=torch.float16, bias=True, seed=M) for M in (3, 8)}
    assert all(ops.matmul_4bit.choose_path(M, 40, 1024, language_version=version) == route for M in calls)
    wants = {M: gemm_by_hand("small", args, "{}.{}".format(*version)) for M, args in calls.items()}
    stand_in = stand_in_for_shader(fresh_tier_selection, tmp_path, Dropping(executors.load_tier("emulated")))
    try:
        assert not any(verify.verdict(family, "shader", stand_in).passed for family in families)
        family = families[0]  # (the built-in split-K path's)
        stand_in.clear()
        for M, how in ((3, "0"), (8, "1")):  # tuning off, then on
            fresh_tier_selection.setenv(tuning.ENV_VAR, how)
            with fixed_timings(times_favouring(route)), warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                got = ops.op_packet("gemm_4bit").redispatch(MPS, *copy.deepcopy(calls[M]))
            assert same_bits(got, wants[M]), M
            said = [str(w.message) for w in caught if issubclass(w.category, verify.VerificationWarning)]
            if M == 3:  # (the user is told once, and asked for the acceptance run's report)
                assert len(said) == 1 and f"{family} kernels failed verification" in said[0], said
                assert "other kernel paths serve their calls" in said[0] and "mac_acceptance.sh" in said[0]
            else:
                assert said == [], said
        assert ops.route("gemm_4bit").tier == "shader"  # (the family takes no op off the tier)
        assert not [k for k in stand_in.launched if "_splitk_" in k] and any("_small_" in k for k in stand_in.launched)
        row = row_of("gemm_4bit", key=candidates._matmul_key("gemm_4bit", calls[8]))
        assert row["default"] == "small" and row["choice"] != route, row
        assert f"{family} did not pass" in row["left_out"][route]
    finally:
        verify.reset()


# -- the cache ------------------------------------------------------------------------------------------------


def run_python(code: str, **env) -> str:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                         env={**os.environ, **env}, timeout=600)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


HEADER = """
    import copy, json, sys
    import torch, bitsandbytes, bnb_mps
    from bnb_mps.ops import tuning
    from bnb_mps.testing import fixed_timings, use_emulated_kernels
    sys.path.insert(0, {tests!r})
    from test_tuning import gemm_args
    args = gemm_args(40)
"""


@pytest.mark.model  # (a subprocess: tests/tiers.py)
def test_the_cache_is_read_by_a_new_process_and_invalidated_by_a_source_change(tmp_path):
    cache = tmp_path / "tune.json"
    env = {tuning.CACHE_ENV_VAR: str(cache), tuning.ENV_VAR: "1"}
    head = HEADER.format(tests=str(REPO / "tests"))
    run_python(head + """
    with use_emulated_kernels(), fixed_timings({"mma": 1e-3, "dequantize+linear": 5e-4}):
        torch.ops.bitsandbytes.gemm_4bit(*args)
    """, **env)  # fmt: skip
    data = json.loads(cache.read_text())
    ((machine, entries),) = data.items()
    key = "gemm_4bit float32 M<=64 N=48 K=256 blocksize=64 nf4 nested"
    assert machine.startswith("emulated | ") and entries[key]["choice"] == "dequantize+linear"
    # a new process: the choice from the cache, nothing measured
    out = run_python(head + """
    tuning.measure = None  # (measuring would raise)
    with use_emulated_kernels() as kernels:
        y = torch.ops.bitsandbytes.gemm_4bit(*args)
    print(json.dumps([kernels.launched, bnb_mps.tuning_table()]))
    """, **env)  # fmt: skip
    launched, table = json.loads(out.splitlines()[-1])
    assert launched == ["bnb_dequantize_blockwise_f32", "bnb_dequantize_4bit_nf4_f32"]
    ((row,),) = [[r for r in table if r["op"] == "gemm_4bit"]]
    assert row["cached"] and row["choice"] == "dequantize+linear" and row["times"] == {
        "mma": 1e-3, "dequantize+linear": 5e-4, "bitsandbytes": float("inf")}, row  # fmt: skip
    # another kernel source (BNB_MPS_KERNEL_DIR, a comment added): another key, measured again
    kernels = tmp_path / "kernels"
    kernels.mkdir()
    from bnb_mps.msl import source

    for f in source.kernel_dir().iterdir():
        text = f.read_text() + ("\n// changed\n" if f.name == "gemm_4bit.h" else "")
        (kernels / f.name).write_text(text)
    out = run_python(head + """
    from bnb_mps.ops import candidates
    measured = []
    def measure(c, tier, executor, verified=True):
        measured.append(c.key)
        return tuning.Decision(c.op, c.key, "mma", c.default, {"mma": 1.0}, tier)
    tuning.measure = measure
    op = bnb_mps.ops.OPS["gemm_4bit"]
    c = candidates.of(op, args, None, "emulated", None)
    print(json.dumps([tuning.choose(c, "emulated", None, verified=False), measured, bnb_mps.tuning_table()]))
    """, **env, BNB_MPS_KERNEL_DIR=str(kernels))  # fmt: skip
    choice, measured, table = json.loads(out.splitlines()[-1])
    assert choice == "mma" and measured == [key]
    assert len(json.loads(cache.read_text())) == 2  # (both sources' entries kept)
    assert [r["cached"] for r in table if r["op"] == "gemm_4bit"] == [False]


def test_a_stored_choice_keeps_every_other_entry_of_the_file():
    """(Processes that store at once: tests/test_json_cache.py.)"""
    for machine, key in (("m0", "k0"), ("m0", "k1"), ("m1", "k0")):
        tuning._store(machine, tuning.Decision("gemm_4bit", key, "mma", "mma", {"mma": 1e-3}, "native"))
    data = json.loads(tuning.cache_path().read_text())
    assert {m: sorted(e) for m, e in data.items()} == {"m0": ["k0", "k1"], "m1": ["k0"]}


def test_a_malformed_cache_counts_as_empty(monkeypatch):
    tuning.cache_path().write_text("{not json")
    monkeypatch.setenv(tuning.ENV_VAR, "1")
    args = gemm_args(40)
    with use_emulated_kernels(), fixed_timings(times_favouring("dequantize+linear")):
        bnb.gemm_4bit.default(*args)
    assert row_of("gemm_4bit")["choice"] == "dequantize+linear"
    assert list(json.loads(tuning.cache_path().read_text()).values())[0]
    assert tuning._from_entry({"op": "gemm_4bit", "choice": 1}, "k", "native") is None
    wrong_time = {"op": "x", "choice": "mma", "default": "mma", "times": {"mma": "fast"}}
    assert tuning._from_entry(wrong_time, "k", "t") is None


def test_fixed_timings_checks_its_argument():
    with pytest.raises(TypeError, match="dict of route name"):
        with fixed_timings([("mma", 1.0)]):
            pass
    with pytest.raises(ValueError, match="route 'mma' must be a number of seconds"):
        with fixed_timings({"mma": -1.0}):
            pass


# -- on a Mac -------------------------------------------------------------------------------------------------


@pytest.mark.mps
def test_mps_a_real_shape_is_measured_on_the_gpu_clock(monkeypatch):
    """A decode and a prefill shape of a 7B model's projection, on the tier that serves mps: every
    candidate timed on the GPU's clock, the choice serves, within docs/semantics.md section 4."""
    import reference_matmul_4bit as R

    monkeypatch.setenv(tuning.ENV_VAR, "always")
    for M in (1, 512):
        args = gemm_args(M, N=4096, K=4096, dtype=torch.float16, seed=M)
        A, packed, shapeB, absmax, blocksize, _, _, q8, code8, offset = args
        W = R.dequantized_weight(packed, shapeB, blocksize, "nf4", absmax, q8, code8, offset)
        y = bnb.gemm_4bit.default(*[a.to("mps") if isinstance(a, torch.Tensor) else a for a in args])
        row = row_of("gemm_4bit", key=f"gemm_4bit float16 M<={M} N=4096 K=4096 blocksize=64 nf4 nested")
        assert row["clock"] == "gpu" and row["tier"] in ("native", "shader") and not row["errors"], row
        assert row["choice"] in row["times"] and all(0 < t < 1 for t in row["times"].values()), row
        assert len(row["times"]) >= (6 if M == 1 else 3), row  # (the paths, dequantize+linear, bitsandbytes)
        R.check_accuracy(y.cpu(), A, W, linear_device="mps")


# -- python -m bnb_mps tune ----------------------------------------------------------------------------------


@pytest.mark.model  # (a subprocess: tests/tiers.py)
def test_the_tune_command_measures_every_candidate_on_the_emulated_tier_and_says_the_times_mean_nothing(tmp_path):
    extras.require("matplotlib")  # (for the chart; a test extra: under CI its absence fails this test)
    out_json, chart = tmp_path / "tune.json", tmp_path / "tune.png"
    env = {**os.environ, tuning.CACHE_ENV_VAR: str(tmp_path / "cache.json")}
    env.pop("BNB_MPS_EXECUTOR", None)
    run = subprocess.run([sys.executable, "-m", "bnb_mps", "tune", "--tier", "emulated", "--shapes", "40x128,24x96",
                          "--m", "1,3,33", "--json", str(out_json), "--chart", str(chart)], capture_output=True,
                         text=True, env=env, timeout=900)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert "these timings mean nothing for a GPU" in run.stdout
    assert "40x128, ms per call" in run.stdout and "24x96, ms per call" in run.stdout
    report = json.loads(out_json.read_text())
    assert report["tier"] == "emulated" and report["clock"] == "host" and report["meaningful"] is False
    rows = {(r["shape"], r["M"]): r for r in report["rows"]}
    assert sorted(rows) == sorted((s, M) for s in ("40x128", "24x96") for M in (1, 3, 33))
    for (shape, M), r in rows.items():
        K = int(shape.split("x")[1])
        want = {"mma", "dequantize+linear"} | ({"gemv", "gemv/tglut"} if M <= 4 and K % 32 == 0 else set()) | (
            {"batch", "small", "small/wide"} if M <= 32 else set())
        if K % 64 == 0:  # (on CPU tensors bitsandbytes' route only where no block straddles a row: candidates.py)
            want.add("bitsandbytes")
        assert set(r["times"]) == want and not r["errors"], r
        assert all(t > 0 for t in r["times"].values()) and r["choice"] in want and r["dense_fp16_linear"] > 0
        assert (r["gbps"] is not None) == (M == 1) and r["share_of_peak"] is None
    assert f"chart: {chart}" in run.stdout and chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # (matplotlib: above)
    cached = json.loads((tmp_path / "cache.json").read_text())
    assert sorted(k for entries in cached.values() for k in entries if k.startswith("gemm_4bit")) == sorted(
        r["key"] for r in report["rows"])  # fmt: skip
    info = subprocess.run([sys.executable, "-m", "bnb_mps"], capture_output=True, text=True, env=env, timeout=600)
    assert info.returncode == 0 and "emulated: gemm_4bit float16 M<=1 N=40 K=128 blocksize=64 nf4 nested" in info.stdout


def test_the_tune_chart_is_drawn_where_matplotlib_is_and_said_to_be_missing_where_it_is_not(tmp_path, monkeypatch):
    """The chart test's fault: it read the chart before checking for "no chart", so it failed wherever
    matplotlib was missing. The chart of two rows is a PNG; without matplotlib there is none, and
    no file."""
    from bnb_mps import tune_command

    rows = [{"shape": "40x128", "M": M, "times": {"mma": 1e-3 * M, "dequantize+linear": 2e-3}, "dense_fp16_linear": 5e-4,
             "mlx_quantized_matmul": None} for M in (1, 3)]  # fmt: skip
    extras.require("matplotlib")
    drawn = tmp_path / "drawn.png"
    assert tune_command.chart(rows, str(drawn), "emulated", False) == str(drawn)
    assert drawn.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # (its import raises ImportError)
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)
    assert tune_command.chart(rows, str(tmp_path / "none.png"), "emulated", False) is None
    assert not (tmp_path / "none.png").exists()


@pytest.mark.parametrize("argv, message", [
    (["--shapes", "4096"], "--shapes takes NxK"), (["--shapes", "0x64"], "positive sizes"),
    (["--m", "1,x"], "--m takes comma-separated"), (["--m", "0"], "--m takes comma-separated"),
    (["--model", "GPT-5"], "unknown model 'GPT-5'; choose from Llama-3-8B"),
])  # fmt: skip
def test_the_tune_command_rejects_bad_arguments(argv, message, capsys, fresh_tier_selection):
    from bnb_mps.__main__ import main

    assert main(["tune", "--tier", "emulated", *argv]) == 2
    assert message in capsys.readouterr().err


def test_model_shapes():
    from bnb_mps import model_shapes

    assert model_shapes.layers("llama-3-8b") == [("q_proj, o_proj", 4096, 4096), ("k_proj, v_proj", 1024, 4096),
                                                 ("gate_proj, up_proj", 14336, 4096), ("down_proj", 4096, 14336)]
    assert [(N, K) for _, N, K in model_shapes.layers("Qwen2.5-7B")] == [(3584, 3584), (512, 3584), (18944, 3584),
                                                                         (3584, 18944)]  # fmt: skip
    assert len(model_shapes.layers("Flux-block")) == 6  # (proj_mlp has the feed-forward's shape)


# -- faults these tests guard against (docs/tests.md, scripts/mutation_check.py) -----------------------------


def small_gemm(M=3):
    return gemm_args(M, N=24, K=128)


@pytest.mark.parametrize("content", ["{not json", "[1, 2]", "machines of lists", "a directory"])
def test_a_malformed_or_unreadable_cache_counts_as_empty_and_the_call_is_measured(monkeypatch, content):
    """Fault T15: the cache read with a plain json.loads (or an entry of the wrong kind followed blindly)
    makes the user's call raise. Nothing here fixes the timings: the cache is read, as on a Mac, and
    the call is measured (the emulated kernels on the host's clock) and served by its choice."""
    path = tuning.cache_path()
    args = small_gemm()
    if content == "a directory":
        path.mkdir()
    elif content == "machines of lists":  # (every machine's entries, this one's too, not an object)
        with use_emulated_kernels(), fixed_timings(times_favouring("mma")):
            bnb.gemm_4bit.default(*copy.deepcopy(args))
        path.write_text(json.dumps({machine: [1, 2] for machine in json.loads(path.read_text())}))
        tuning.reset()
    else:
        path.write_text(content)
    monkeypatch.setenv(tuning.ENV_VAR, "1")
    with use_emulated_kernels():
        got = bnb.gemm_4bit.default(*copy.deepcopy(args))
    row = row_of("gemm_4bit")
    assert not row["cached"] and row["clock"] == "host", row
    assert set(row["times"]) == set(candidates_of(3)) and not row["errors"], row
    assert same_bits(got, gemm_by_hand(row["choice"], args)), row["choice"]


@pytest.mark.parametrize("kept_by", ["the cache", "this process"])
def test_a_cached_choice_is_checked_against_todays_candidates(monkeypatch, kept_by):
    """Fault T9: a choice read back from the cache served without being checked against today's
    candidates: a route excluded since (BNB_MPS_TUNE_EXCLUDE), or whose family failed verification
    since, still served. The cached dequantize+linear is excluded now: the key is measured again."""
    args = small_gemm()
    if kept_by == "the cache":
        with use_emulated_kernels(), fixed_timings(times_favouring("dequantize+linear")):
            bnb.gemm_4bit.default(*copy.deepcopy(args))
        assert row_of("gemm_4bit")["choice"] == "dequantize+linear"
        tuning.reset()  # (a new process: what this one decided is forgotten, the cache stays)
        monkeypatch.setenv(tuning.ENV_VAR, "1")
        monkeypatch.setenv(tuning.EXCLUDE_ENV_VAR, "dequantize+linear,bitsandbytes")
        with use_emulated_kernels() as kernels:
            bnb.gemm_4bit.default(*copy.deepcopy(args))
            kernels.clear()
            got = bnb.gemm_4bit.default(*copy.deepcopy(args))
    else:  # (decided, then excluded, within one setting of the timings: the choice is in this process alone)
        with use_emulated_kernels() as kernels, fixed_timings(times_favouring("dequantize+linear")):
            bnb.gemm_4bit.default(*copy.deepcopy(args))
            assert row_of("gemm_4bit")["choice"] == "dequantize+linear"
            monkeypatch.setenv(tuning.EXCLUDE_ENV_VAR, "dequantize+linear,bitsandbytes")
            args = small_gemm(M=4)  # (another call signature of the same shape key: M rounds up to 4)
            bnb.gemm_4bit.default(*copy.deepcopy(args))
            kernels.clear()
            got = bnb.gemm_4bit.default(*copy.deepcopy(args))
    (row,) = [r for r in bnb_mps.tuning_table() if r["op"] == "gemm_4bit" and r["choice"] != "dequantize+linear"]
    assert not row["cached"] and row["choice"] in ("gemv", "gemv/tglut", "batch", "small", "small/wide", "mma"), row
    assert row["left_out"] == dict.fromkeys(["dequantize+linear", "bitsandbytes"], "excluded by BNB_MPS_TUNE_EXCLUDE")
    assert len(kernels.launched) == 1 and kernels.launched[0].startswith("bnb_g"), kernels.launched  # (one product)
    assert same_bits(got, gemm_by_hand(row["choice"], args))


STRIDED = {"every second column of a wider A": lambda A: torch.cat([A, A], 1).reshape(A.shape[0], 2, -1)
           .transpose(1, 2).reshape(A.shape[0], -1)[:, ::2],  # fmt: skip
           "A transposed": lambda A: A.t().contiguous().t(),
           "a row offset": lambda A: torch.cat([torch.zeros(1, A.shape[1], dtype=A.dtype), A])[1:]}


@pytest.mark.parametrize("layout", sorted(STRIDED))
@pytest.mark.parametrize("M,route", [(3, "gemv"), (3, "batch"), (3, "dequantize+linear"), (3, "bitsandbytes"),
                                     (40, "mma")])  # fmt: skip
def test_a_choice_made_for_a_contiguous_A_serves_another_layout_of_its_key_correctly(M, route, layout):
    """Fault R3b: a choice built for a contiguous A kept for a strided signature of the same shape key
    gave wrong results. Tuned on a contiguous A, the same rows laid out otherwise give the route's
    result for that layout (the route computed directly), bit for bit."""
    args = gemm_args(M, bias=True)
    strided = copy.deepcopy(args)
    strided[0] = STRIDED[layout](args[0])
    assert torch.equal(strided[0], args[0]) and not strided[0].is_contiguous() or layout == "a row offset"
    assert strided[0].storage_offset() > 0 or layout != "a row offset"
    want = gemm_by_hand(route, strided)
    with use_emulated_kernels(), fixed_timings(times_favouring(route)):
        bnb.gemm_4bit.default(*copy.deepcopy(args))  # (the choice, made for a contiguous A)
        got = bnb.gemm_4bit.default(*strided)
    assert [r["choice"] for r in bnb_mps.tuning_table() if r["op"] == "gemm_4bit"] == [route]
    assert same_bits(got, want)


GEMM_KEY_FIELDS = {"bias": dict(bias=True), "dtype": dict(dtype=torch.float16), "nested": dict(nested=False),
                   "quant_type": dict(quant_type="fp4"), "blocksize": dict(blocksize=128), "N": dict(N=40),
                   "K": dict(K=192), "M bucket": dict(M=9)}  # fmt: skip


def test_the_gemm_shape_key_tells_apart_every_field_a_route_depends_on():
    """Faults T3 (bias dropped from the matmul shape key) and kin: a call that differs from another in
    one field only (bias or not, A's dtype, nested scales, quant_type, blocksize, N, K, M's bucket) is
    decided on its own, never served by the other's choice."""
    base = dict(M=3, N=24, K=128)
    times = dict.fromkeys(ALL_ROUTES, 1e-3)
    with use_emulated_kernels():
        with fixed_timings({**times, "gemv": 1e-4}):
            bnb.gemm_4bit.default(*gemm_args(**base))
        for field, change in GEMM_KEY_FIELDS.items():
            route = "mma" if change.get("M", 3) > 4 else "batch"
            with fixed_timings({**times, route: 1e-4}):
                bnb.gemm_4bit.default(*gemm_args(**{**base, **change}))
            assert row_of("gemm_4bit", key=gemm_key(**{**base, **change}))["choice"] == route, field
    rows = [r for r in bnb_mps.tuning_table() if r["op"] == "gemm_4bit"]
    assert len(rows) == 1 + len(GEMM_KEY_FIELDS) and row_of("gemm_4bit", key=gemm_key(**base))["choice"] == "gemv"


def gemm_key(M, N, K, dtype=torch.float32, nested=True, bias=False, blocksize=64, quant_type="nf4"):
    """The key of a gemm_4bit call, as bnb_mps.ops.candidates' docstring describes it."""
    rows = f"M<={candidates.m_bucket(M)}"
    return (f"gemm_4bit {str(dtype)[6:]} {rows} N={N} K={K} blocksize={blocksize} {quant_type}"
            f"{' nested' if nested else ''}{' bias' if bias else ''}")


GENERIC_VARIANTS = {
    "quantize_blockwise": [lambda dt: [torch.randn(3000, generator=torch.Generator().manual_seed(2)).to(dt),
                                       F.create_dynamic_map(signed=True), 256]],
    "quantize_4bit": [lambda dt: [torch.randn(64, 96, generator=torch.Generator().manual_seed(1)).to(dt), 64, "nf4",
                                  torch.uint8]],
    "dequantize_blockwise": [lambda dt: [torch.randint(0, 256, (3000,), dtype=torch.uint8,
                                                       generator=torch.Generator().manual_seed(5)),
                                         torch.rand(12, generator=torch.Generator().manual_seed(6)) + 0.5,
                                         F.create_dynamic_map(signed=True), 256, dt]],
    "optimizer_update_32bit": [lambda dt: ["adam", *(torch.randn(3000, generator=torch.Generator().manual_seed(s))
                                                     .to(dt) for s in (3, 4)), torch.zeros(3000), torch.zeros(3000),
                                           None, 0.0, 0.0, 0.9, 0.999, 0.0, 0.0, 1e-8, 0.01, 3, 1e-3, 1.0, False]],
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(GENERIC_VARIANTS))
def test_the_shape_key_of_quantize_dequantize_and_optimizer_ops_tells_dtypes_apart(name):
    """Fault T4: the dtype dropped from the generic shape key, so that a float16 call took the choice
    measured for float32 (quantize, dequantize, the optimizers). Each dtype is decided on its own and
    served by its own choice."""
    (make,) = GENERIC_VARIANTS[name]
    for dtype, route in ((torch.float32, "kernel"), (torch.float16, "bitsandbytes")):
        args = make(dtype)
        if route == "bitsandbytes":
            want_args = copy.deepcopy(args)
            want = ops.op_packet(name)(*want_args)  # bitsandbytes' own CPU implementation
        with use_emulated_kernels(), fixed_timings(times_favouring(route)):
            got = ops.op_packet(name)(*args)
        if route == "bitsandbytes":
            assert same_bits(got, want) and same_bits(args, want_args)
    choices = sorted((r["choice"], r["key"]) for r in bnb_mps.tuning_table() if r["op"] == name)
    assert [c for c, _ in choices] == ["bitsandbytes", "kernel"], choices
    assert "float16" in choices[0][1] and "float16" not in choices[1][1], choices


def test_timing_reports_seconds_per_call():
    """Fault T12: timing reported the time of a batch of calls instead of one call. On a clock where
    each call takes 0.1 ms, batches of ten such calls make the 1 ms a batch lasts at least, and the
    time per call is 0.1 ms (time per batch would read ten times as much); on the host's clock a call
    that takes 0.1 ms (a busy wait) is reported at no less than that."""
    import time

    from bnb_mps.executors import clocks
    from bnb_mps.ops import timing

    class Steady:
        name = "steady"
        batches: list = []

        def batch(self, call, n):
            for _ in range(n):
                call()
            self.batches.append(n)
            return n * 1e-4

    calls = []
    clock = Steady()
    assert timing.seconds(lambda: calls.append(1), clock) == pytest.approx(1e-4, rel=1e-12)
    assert max(clock.batches) == 10 and len(calls) == 1 + sum(clock.batches)  # (a warm-up, then the batches)

    def busy(duration=1e-4):
        end = time.perf_counter() + duration
        while time.perf_counter() < end:
            pass

    assert 1e-4 <= timing.seconds(busy, clocks.HostClock())  # (a loaded machine may stretch it, never shorten it)



def test_timing_takes_the_median_batch_per_call():
    """Five batches of ten calls that took 9, 1, 3, 2 and 4 tenths of a millisecond per call: the median,
    0.3 ms (not the fastest, the slowest, the mean or the last)."""
    from bnb_mps.ops import timing

    class Scripted:
        name = "scripted"
        per_call = iter([1e-4, 9e-4, 1e-4, 3e-4, 2e-4, 4e-4])  # (the first batch: one call, which sets n = 10)

        def batch(self, call, n):
            for _ in range(n):
                call()
            return n * next(self.per_call)

    assert timing.seconds(lambda: None, Scripted()) == pytest.approx(3e-4, rel=1e-12)

def test_an_empty_product_is_served_by_its_built_in_route_without_measuring():
    """No rows (or N or K of 0): nothing to time, nothing to choose; the built-in route serves."""
    args = gemm_args(3)
    args[0] = args[0][:0]
    with use_emulated_kernels(), fixed_timings(times_favouring("dequantize+linear")):
        got = bnb.gemm_4bit.default(*args)
    assert got.shape == (0, 48) and [r for r in bnb_mps.tuning_table() if r["op"] == "gemm_4bit"] == []


def test_per_call_hyperparameters_are_no_part_of_the_optimizers_shape_key():
    """The optimizers' step, learning rate and the other per-call values change every call: one shape
    key (one measurement) for all of them, else every step would be measured anew."""
    name = "optimizer_update_32bit"
    with use_emulated_kernels(), fixed_timings(times_favouring("kernel")):
        for step, lr in ((1, 1e-3), (2, 5e-4), (3, 1e-4)):
            args = OTHER_OPS[name]()
            args[14], args[15] = step, lr
            ops.op_packet(name)(*args)
            tuning.reset()  # (as a new process: its call signature is resolved, and its key looked up, again)
    stored = [k for entries in json.loads(tuning.cache_path().read_text()).values() for k in entries
              if k.startswith(name)]  # fmt: skip
    assert len(stored) == 1, stored


def test_the_built_in_route_is_a_candidate_whatever_the_exclusion_says(monkeypatch):
    """BNB_MPS_TUNE_EXCLUDE takes routes out of the candidates, never the built-in one (something must serve)."""
    monkeypatch.setenv(tuning.EXCLUDE_ENV_VAR, "mma,bitsandbytes")
    args = gemm_args(40)
    with use_emulated_kernels(), fixed_timings(times_favouring("mma")):
        got = bnb.gemm_4bit.default(*copy.deepcopy(args))
    row = row_of("gemm_4bit")
    assert row["choice"] == "mma" and set(row["times"]) == {"mma", "dequantize+linear"}, row
    assert row["left_out"] == {"bitsandbytes": "excluded by BNB_MPS_TUNE_EXCLUDE"}, row
    assert same_bits(got, gemm_by_hand("mma", args))


@pytest.mark.parametrize("nested", [True, False], ids=["nested", "plain"])
def test_dequantize_linear_of_nested_scales_needs_the_8bit_family_verified(monkeypatch, nested):
    """dequantize+linear runs the 8-bit dequantize kernel on nested block scales: where that family
    (blockwise_8bit) did not pass verification, it is no candidate of a nested call; a plain call does
    not run it and keeps the route."""
    from bnb_mps.ops.verify.verdicts import Verdict

    monkeypatch.setenv(verify.ENV_VAR, "1")
    monkeypatch.setattr(verify, "verdict", lambda family, tier, executor, **k: Verdict(
        family, family != "blockwise_8bit", 0.0, *(("case", "wrong") if family == "blockwise_8bit" else ())))
    args = gemm_args(40, nested=nested)
    executor = executors.load_tier("emulated")
    c = candidates.of(ops.OPS["gemm_4bit"], args, executor, "emulated", None)
    with fixed_timings(times_favouring("dequantize+linear")):
        choice = tuning.choose(c, "emulated", executor, verified=True)
    assert choice == ("mma" if nested else "dequantize+linear")


@pytest.mark.parametrize("name", ["gemv_4bit", "dequantize_4bit"])
def test_bitsandbytes_cpu_code_that_depends_on_the_instruction_set_is_no_route(name):
    """On CPU tensors, bitsandbytes' gemv_4bit and dequantize_4bit read or write another layout on some
    CPUs (bnb_mps.ops.candidates): however fast, they are no candidate there."""
    W = torch.randn(24, 64, generator=torch.Generator().manual_seed(3))
    packed, absmax = bnb.quantize_4bit.default(W, 64, "nf4", torch.uint8)
    if name == "gemv_4bit":
        args = [torch.randn(1, 64), packed, [24, 64], absmax, F.get_4bit_type("nf4", device="cpu"), 64]
    else:
        args = [packed, absmax, 64, "nf4", [24, 64], torch.float32]
    ops.reset_call_counts()
    with use_emulated_kernels(), fixed_timings(times_favouring("bitsandbytes")):
        ops.op_packet(name)(*args)
    assert ops.call_counts()[name] == {"emulated": 1}
    rows = [r for r in bnb_mps.tuning_table() if r["op"] == name]  # (none where the kernel is the only route)
    assert all("bitsandbytes" not in r["times"] for r in rows), rows


def test_a_one_dispatch_split_k_that_fails_verification_gives_way_to_two_dispatches(fresh_tier_selection, tmp_path):
    """A tier compiling Metal 3.2 whose one-dispatch split-K hand-over does not hold (its launches
    dropped): matmul_4bit_splitk fails, the two-dispatch family passes, and the calls take the built-in
    path of a tier without the hand-over (the cost model's choice: the two dispatches at M = 8, K = 1024),
    bit for bit the two-dispatch result, tuning off."""
    from bnb_mps.executors import emulated

    class DroppingOneDispatch(RecordingExecutor):
        def launch(self, kernel, *, grid, threadgroup, args):
            if kernel.startswith("bnb_gemm_4bit_splitk_") and "_partial_" not in kernel and "_sum_" not in kernel:
                self.launches.append((kernel, tuple(grid), tuple(threadgroup), []))
                return
            super().launch(kernel, grid=grid, threadgroup=threadgroup, args=args)

    args = gemm_args(8, N=40, K=1024, dtype=torch.float16, bias=True, seed=8)
    with emulated.settings(metal_version="3.2"):
        assert ops.matmul_4bit.choose_path(8, 40, 1024, language_version=(3, 2)) == "splitk"
        assert ops.matmul_4bit.choose_path(8, 40, 1024, language_version=None) == "splitk/two"
        want = gemm_by_hand("splitk/two", args, "3.2")
        stand_in = stand_in_for_shader(fresh_tier_selection, tmp_path, DroppingOneDispatch(executors.load_tier("emulated")))
        try:
            assert not verify.verdict("matmul_4bit_splitk", "shader", stand_in).passed
            assert verify.verdict("matmul_4bit_splitk_two", "shader", stand_in).passed
            stand_in.clear()
            fresh_tier_selection.setenv(tuning.ENV_VAR, "0")
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", verify.VerificationWarning)
                got = ops.op_packet("gemm_4bit").redispatch(MPS, *copy.deepcopy(args))
            assert same_bits(got, want)
            # (besides the first-use verification of the op's other families)
            assert [k for k in stand_in.launched if "_splitk_" in k] == ["bnb_gemm_4bit_splitk_partial_nested_f16",
                                                                        "bnb_gemm_4bit_splitk_sum_f16"]
        finally:
            verify.reset()
