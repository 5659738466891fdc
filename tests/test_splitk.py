"""The split-K 4-bit product (csrc/kernels/gemm_4bit_splitk.h) as a protocol between threadgroups.

In one dispatch (Metal >= 3.2 only): the last threadgroup of a tile adds the tile's partial sums in slice
order, so the output has the same bits whichever threadgroup arrives last; a tile's counter holds the
call's tag and its count, so the per-device workspace (bnb_mps.ops.workspace) serves the next call of any
shape without being cleared, whatever counts a call that never finished left there. In two dispatches
(every version): the sum kernel adds the same slots in the same order, so the two paths give the same
bits. Both run under the emulator's memory model (docs/emulator.md, "Memory model") without a read the
language version does not make visible; a call allocates its output only. Values are checked against the
float64 reference of docs/semantics.md section 4 (tests/reference_matmul_4bit.py), and the two paths
against each other bit for bit."""

from __future__ import annotations

import pytest
import torch

import reference_matmul_4bit as R
from extras import profile_compiler
from kernel_harness import EmulatedExecutor
from matmul_4bit_cases import Case, gemm_args, splitk_slices_per_tile
from bnb_mps import emulator
from bnb_mps.msl import source
from bnb_mps.ops import OPS, matmul_4bit, workspace
from bnb_mps.ops.plan import BoundPlan

UNIT = "gemm_4bit_splitk"
ONE, TWO = (3, 2), (3, 1)  # language versions: the one-dispatch kernel from 3.2; below it, two dispatches


def at(version, library, library32, **kw) -> EmulatedExecutor:
    """An executor of the split-K kernels compiled at `version`."""
    return EmulatedExecutor(library32 if version >= (3, 2) else library, language_version=version, **kw)


@pytest.fixture(autouse=True)
def fresh_workspaces():
    workspace.release()
    yield
    workspace.release()


def _buffers_of(kind: str) -> list:
    return [buf for key, buf in workspace._buffers.items() if key[1] == kind]


def _counters() -> torch.Tensor:
    (t,) = _buffers_of("splitk counters")
    return t


COUNT_BITS = 5  # a counter: the call's tag above the count of its threadgroups (gemm_4bit_splitk.h)


def _counted(counters: torch.Tensor, N: int, S: int) -> int:
    """The one tag of the counters of the tiles of N columns, each of which counted its threadgroups
    (`splitk_slices_per_tile`) under it."""
    slices = splitk_slices_per_tile(N, S)
    c = counters[:len(slices)].view(torch.int32).long() & 0xFFFFFFFF
    assert (c & ((1 << COUNT_BITS) - 1)).tolist() == slices, (c, slices)
    tags = set((c >> COUNT_BITS).tolist())
    assert len(tags) == 1 and 0 not in tags, tags
    return tags.pop()


def _run(ex, case: Case, route=None):
    A, args, W, bias = gemm_args(case)
    y = matmul_4bit.gemm_4bit(ex, *args, route=route)
    return y, R.check_accuracy(y.reshape(-1, case.N), A.reshape(-1, case.K), W, bias)


# (2064: a short last slice; 11008 float32 at 16 rows: S = 16, and a last tile of 16 columns, one slice of
# all of K; 1984 and 2880: rows cut where their own lines begin, 4 phases, 1984's last slice longer than
# the others; the last tiles of 100, 40 and 70 columns have 3 to 7 groups of 16 columns, and take S slices)
SAME_BITS = [(Case(9, 100, 2064, dtype=torch.float16, nested=True, bias=True, seed=21), 4),
             (Case(10, 100, 2064, dtype=torch.float32, nested=True, bias=True, seed=21), 8),
             (Case(16, 272, 11008, dtype=torch.float32, nested=True, bias=True, seed=22), 16),
             (Case(12, 40, 1984, dtype=torch.float16, nested=True, bias=True, seed=23), 4),
             (Case(5, 70, 2880, dtype=torch.float32, nested=True, bias=True, seed=24), 8)]


@pytest.mark.parametrize("case,S", SAME_BITS, ids=lambda x: f"{x.M}x{x.N}x{x.K}-{x.dtype}" if isinstance(x, Case) else f"S{x}")  # fmt: skip
def test_same_bits_whichever_threadgroup_adds_the_tile(library32, case, S):
    """One dispatch (Metal 3.2): threadgroups run forward, backward and in three seeded orders (the
    emulator's threadgroup orders); a tile's sum is added by whichever of its S threadgroups counts
    last, yet every order gives the same bits, within the reference's bound, and leaves each tile's
    counter with its S counts under the call's tag, a new one each call."""
    dtype = case.dtype
    assert matmul_4bit.choose_path(case.M, case.N, case.K, language_version=ONE) == "splitk"
    assert matmul_4bit.splitk_splits(case.M, case.K, dtype.itemsize) == S
    results, tags = [], []
    for order, seed in (("forward", 0), ("reverse", 0), ("random", 1), ("random", 2), ("random", 3)):
        ex = EmulatedExecutor(library32, order=order, seed=seed, language_version=ONE)
        y, figures = _run(ex, case)
        assert ex.launched == [f"bnb_gemm_4bit_splitk_nested_{'f16' if dtype == torch.float16 else 'f32'}"]
        tags.append(_counted(_counters(), case.N, S))
        results.append((order, seed, y))
    assert all(a != b for a, b in zip(tags, tags[1:])), tags
    for order, seed, y in results[1:]:
        assert torch.equal(y.view(torch.uint8), results[0][2].view(torch.uint8)), (order, seed)


@pytest.mark.parametrize("case,S", SAME_BITS, ids=lambda x: f"{x.M}x{x.N}x{x.K}-{x.dtype}" if isinstance(x, Case) else f"S{x}")  # fmt: skip
def test_two_dispatches_give_the_one_dispatch_bits(library, library32, case, S):
    """Below Metal 3.2 the built-in split-K path is two dispatches (partial sums, then their sum, no
    counters): under every threadgroup order its output has the bits of the one-dispatch kernel at 3.2
    for the same S (the same float32 additions in slice order, the same rounding), within the float64
    reference's bound; and the two-dispatch route at 3.2 gives them too."""
    dt = {torch.float16: "f16", torch.float32: "f32"}[case.dtype]
    assert matmul_4bit.choose_path(case.M, case.N, case.K, language_version=TWO) == "splitk/two"
    assert matmul_4bit.choose_path(case.M, case.N, case.K) == "splitk/two"  # (an unknown version: not 3.2)
    one, _ = _run(EmulatedExecutor(library32, order="random", seed=9, language_version=ONE), case)
    for order, seed in (("forward", 0), ("reverse", 0), ("random", 4)):
        ex = EmulatedExecutor(library, order=order, seed=seed, language_version=TWO)
        y, _ = _run(ex, case)
        assert ex.launched == [f"bnb_gemm_4bit_splitk_partial_nested_{dt}", f"bnb_gemm_4bit_splitk_sum_{dt}"]
        assert torch.equal(y.view(torch.uint8), one.view(torch.uint8)), (order, seed)
    ex = EmulatedExecutor(library32, order="reverse", language_version=ONE)
    y, _ = _run(ex, case, route="splitk/two")
    assert ex.launched == [f"bnb_gemm_4bit_splitk_partial_nested_{dt}", f"bnb_gemm_4bit_splitk_sum_{dt}"]
    assert torch.equal(y.view(torch.uint8), one.view(torch.uint8))


@pytest.mark.parametrize("version", [TWO, ONE], ids=["metal3.1", "metal3.2"])
def test_no_read_the_memory_model_does_not_make_visible(library, library32, version):
    """Under the emulator's memory model (coherence_check): the two dispatches at 3.1, whose sum kernel
    reads only what an earlier dispatch wrote, and the one-dispatch hand-over at 3.2 (coherent(device)
    workspace, release fences in every writing thread, acquire fences in every reading one) read no
    partial sum another threadgroup of their dispatch wrote without Metal's guarantee, and give the
    bits of the unchecked run, within the reference's bound."""
    profile_compiler()  # (the check runs the emulator's instrumented build)
    for case in (Case(5, 200, 2048, dtype=torch.float16, nested=True, bias=True, seed=31),
                 Case(9, 100, 2064, dtype=torch.float32, bias=True, seed=32)):
        plain, _ = _run(at(version, library, library32), case)
        ex = at(version, library, library32, order="reverse", coherence_check=True)
        y, _ = _run(ex, case)
        assert len(ex.launched) == (1 if version >= (3, 2) else 2), ex.launched
        assert torch.equal(y.view(torch.uint8), plain.view(torch.uint8))


@pytest.mark.parametrize("fence", ["release", "acquire"])
def test_a_fence_in_thread_0_only_is_caught(library32, fence):
    """The one-dispatch kernel with its release (or acquire) fence issued by thread 0 alone, as a
    threadgroup barrier were cumulative at device scope (Metal says nothing of the kind): the memory
    model finds the partial sums another thread of the threadgroup wrote read unordered."""
    profile_compiler()
    text = source.units()[UNIT]
    line = f"    atomic_thread_fence(mem_flags::mem_device, memory_order_{fence}, thread_scope_device);\n"
    assert text.count(line) == 1
    lib = emulator.Library(text.replace(line, "    if (tid == 0u) {\n    " + line + "    }\n"), name=f"{UNIT}.metal",
                           metal_version="3.2")  # fmt: skip
    case = Case(5, 200, 2048, dtype=torch.float16, nested=True, bias=True, seed=31)
    with pytest.raises(emulator.CoherenceError, match=f"no device-scope {fence} fence"):
        _run(EmulatedExecutor(lib, language_version=ONE, coherence_check=True), case)


def test_the_one_dispatch_kernel_exists_from_metal_3_2_only(library, library32):
    """Below 3.2 the one-dispatch kernel is not compiled (nothing can route to it); its route is refused
    there with the reason, and the tier's paths offer the two dispatches instead."""
    assert not any(k.startswith("bnb_gemm_4bit_splitk_") and "partial" not in k and "sum" not in k
                   for k in library.kernels)  # fmt: skip
    assert {"bnb_gemm_4bit_splitk_nested_f16", "bnb_gemm_4bit_splitk_partial_nested_f16",
            "bnb_gemm_4bit_splitk_sum_f16"} <= set(library32.kernels)  # fmt: skip
    assert "bnb_gemm_4bit_splitk_partial_nested_f16" in library.kernels
    case = Case(4, 64, 1024, seed=3)
    with pytest.raises(ValueError, match=r"route 'splitk' needs kernels compiled at Metal >= 3.2 .*Metal 3.1"):
        _run(EmulatedExecutor(library, language_version=TWO), case, route="splitk")
    for version in (None, TWO):
        assert "splitk" not in matmul_4bit.paths(4, 64, 1024, language_version=version)
        assert "splitk/two" in matmul_4bit.paths(4, 64, 1024, language_version=version)
    assert {"splitk", "splitk/two"} <= set(matmul_4bit.paths(4, 64, 1024, language_version=ONE))
    assert {"splitk", "splitk/two"} <= set(matmul_4bit.paths(4, 64, 1024, language_version=(4, 0)))


def test_the_workspace_serves_calls_of_every_shape(library32):
    """Calls of different shapes, S and M share one workspace per device: a larger call grows it (to at
    least twice its size), a smaller one takes a view of it, and every call is right, whatever the
    counts the calls before left."""
    ex = EmulatedExecutor(library32, order="random", seed=5, language_version=ONE)
    _run(ex, Case(2, 40, 1024, seed=1))  # S = 2: 2 tiles of 32 columns
    small = _counters()
    _run(ex, Case(3, 300, 512, dtype=torch.float32, nested=True, seed=2))  # 10 tiles: the buffer grows
    big = _counters()
    assert small.numel() == 2 and big.numel() == 10
    for M, N, K in ((30, 300, 4096), (5, 17, 2048), (2, 40, 1024)):  # 3, 1 and 2 tiles
        _run(ex, Case(M, N, K, dtype=torch.bfloat16, bias=True, seed=M))
        assert _counters() is big
    assert ex.launched.count("bnb_gemm_4bit_splitk_absmax_bf16") == 3


def test_counts_a_call_that_never_finished_left_are_not_the_next_calls(library32):
    """A GPU fault in the middle of a call leaves some of its tiles counted part way (fewer than S of
    their threadgroups), under its tag or, where earlier calls faulted, older ones. The next call starts its own counts: its
    bits are those of a call on fresh counters, under every threadgroup order, and its counters hold S
    counts under its tag (a kernel that added to a stale count would take some tile as done before its
    slices had all written their partial sums, or never)."""
    case = Case(7, 200, 2048, dtype=torch.float16, nested=True, bias=True, seed=8)
    S = matmul_4bit.splitk_splits(case.M, case.K, 2)
    tiles = -(-case.N // (16 * S))
    clean, _ = _run(EmulatedExecutor(library32, order="forward", language_version=ONE), case)
    previous = _counted(_counters(), case.N, S)
    g = torch.Generator().manual_seed(4)
    for order, seed in (("forward", 0), ("reverse", 0), ("random", 6)):
        counters = _counters()
        # part-way counts under the tag of the call before (the one that faulted), and of an older one
        for tag in (previous, 12345):
            stale = torch.randint(1, S, (tiles,), generator=g) | (tag << COUNT_BITS)
            counters[:tiles] = stale.to(torch.int32)
            # (and partial sums that no sum may use: the last call's, of the same case, would hide a tile
            # added before its slices had all written)
            _buffers_of("splitk partial sums")[0].fill_(float("nan"))
            y, _ = _run(EmulatedExecutor(library32, order=order, seed=seed, language_version=ONE), case)
            assert torch.equal(y.view(torch.uint8), clean.view(torch.uint8)), (order, tag)
            previous = _counted(_counters(), case.N, S)


@pytest.mark.parametrize("version", [TWO, ONE], ids=["metal3.1", "metal3.2"])
def test_a_call_allocates_its_output_only(library, library32, version):
    """The plan of a split-K call has one output; the workspace (the partial sums, and the counters of the
    one-dispatch kernel) is taken when the plan is bound (views of the device's buffers, the same storage
    for every plan that fits), never per call."""
    case = Case(4, 64, 1024, seed=3)
    A, args, W, bias = gemm_args(case)
    plan = matmul_4bit.plan_gemm_4bit(*args, language_version=version)
    assert [d for _, d in plan.outputs] == [case.dtype] and len(plan.outputs) == 1
    counters = [("splitk counters", torch.int32, True)] if version >= (3, 2) else []
    assert [(kind, dtype, zeroed) for kind, _, dtype, zeroed in plan.workspaces] == [
        ("splitk partial sums", torch.float32, False), *counters]
    assert len(plan.launches) == (1 if version >= (3, 2) else 2)
    ex = at(version, library, library32)
    tag = OPS["gemm_4bit"].planned.dynamic  # (the call's tag)
    one, two = BoundPlan(plan, ex, dynamic=tag), BoundPlan(plan, ex, dynamic=tag)
    work = [t for t in one._constants if isinstance(t, torch.Tensor)]
    assert [t.untyped_storage().data_ptr() for t in work] == \
        [t.untyped_storage().data_ptr() for t in two._constants if isinstance(t, torch.Tensor)]
    y = one(tuple(args))
    assert y.shape == (case.M, case.N)
    R.check_accuracy(y, A.reshape(-1, case.K), W, bias)


def test_workspace_grows_and_refuses_negative_sizes():
    a = workspace.workspace("cpu", "test", 10, torch.int32, zeroed=True)
    assert a.numel() == 10 and torch.count_nonzero(a) == 0
    a.fill_(3)
    b = workspace.workspace("cpu", "test", 4, torch.int32, zeroed=True)
    assert b.untyped_storage().data_ptr() == a.untyped_storage().data_ptr() and torch.equal(b, a[:4])
    c = workspace.workspace("cpu", "test", 11, torch.int32, zeroed=True)
    assert c.numel() == 11 and _buffers_of("test")[0].numel() == 20
    assert torch.count_nonzero(c) == 0  # a new buffer, zeroed
    with pytest.raises(ValueError, match="numel must be >= 0, got -1"):
        workspace.workspace("cpu", "test", -1, torch.int32, zeroed=False)


def _lines(begin: int, end: int) -> range:
    """The 128-byte lines that bytes begin to end - 1 meet."""
    return range(begin // 128, (end - 1) // 128 + 1)


# (2880: rows 4 phases apart in their lines; 1152: 2, and 84 columns: a last tile of two groups, one per
# phase, with rows past N in each; 1040: 16 phases, more than S: one cut for all rows; 144 columns at
# S = 8: a last tile of 16 columns, one threadgroup over all of K)
@pytest.mark.parametrize("version", ["3.1", "3.2"], ids=["metal3.1", "metal3.2"])
@pytest.mark.parametrize("M,N,K,dtype", [(8, 128, 3072, torch.float32), (9, 128, 1040, torch.float16),
                                         (8, 128, 2880, torch.float16), (6, 84, 1152, torch.float32),
                                         (8, 144, 2880, torch.float16)])
def test_each_line_of_the_weight_and_of_the_output_is_moved_by_one_threadgroup(M, N, K, dtype, version):
    """Under the cost model (the emulator's profile): each weight row is cut where its own 128-byte lines
    begin, so where rows are whole lines (K % 256 == 0) no line of the packed weight is touched by two
    threadgroups, and where row n starts (n K) % 256 weights into a line, with P rows to a repeat of
    those phases dividing S, only the lines that hold one row's end and the next row's start are (the
    last slice of the one, the first of the other); and in one dispatch (Metal 3.2) only the last
    threadgroup of a tile writes the tile's outputs, so no output line is either (a kernel whose every
    threadgroup added and stored the sums it could see would write each line S times); in two (3.1),
    the partial-sum kernel stores no output, and the sum kernel each output once, reading each partial
    sum once."""
    from extras import profile_compiler

    from bnb_mps.ops import call
    from bnb_mps.testing import use_emulated_kernels

    profile_compiler()
    case = Case(M, N, K, dtype=dtype, nested=True, bias=True, seed=M + N)
    S = matmul_4bit.splitk_splits(M, K, dtype.itemsize)
    if K % 256 == 0:  # (cut at multiples of 128 instead, these slices would start mid-line: 3072 / 8 = 384)
        assert -(-K // (S * 128)) % 2 == 1, S
    A, args, W, bias = gemm_args(case)
    with use_emulated_kernels(profile=True, metal_version=version) as rec:
        y = call(OPS["gemm_4bit"], tuple(args), {}, rec)
    dt = "f16" if dtype == torch.float16 else "f32"
    slices = splitk_slices_per_tile(N, S)
    if version == "3.2":
        (p,) = rec.profiles
        assert p.kernel == f"bnb_gemm_4bit_splitk_nested_{dt}"
    else:
        p, total = rec.profiles
        assert (p.kernel, total.kernel) == (f"bnb_gemm_4bit_splitk_partial_nested_{dt}", f"bnb_gemm_4bit_splitk_sum_{dt}")
        assert p.buffers[8].store_bytes == 0 and total.buffers[2].store_bytes == M * N * dtype.itemsize
        width = 16 * S  # (each output's slots read once: S' of them in a tile of S' slices)
        assert total.buffers[0].load_bytes == sum(s * M * min(width, N - t * width) * 4 for t, s in enumerate(slices))
    assert S >= 4 and p.grid == (sum(slices), 1, 1), p.grid
    weight, out = p.buffers[1], p.buffers[8]
    rest = K % 256
    if rest == 0 or S % (256 // (rest & -rest)) == 0:
        # rows n that start inside a line row n - 1 ends in, read by another threadgroup: all from 1 to
        # N - 1, but in a last tile of one slice, whose threadgroup reads its rows whole (from its first)
        last = 16 * S * (len(slices) - 1) if slices[-1] == 1 else N - 1
        shared = sum(1 for n in range(1, last + 1) if n * K % 256)
        assert weight.lines_summed_over_threadgroups == weight.lines + shared and weight.lines == N * K // 256
        assert shared == (0 if rest == 0 else last - last // (256 // (rest & -rest))), shared
    if version != "3.2":
        R.check_accuracy(y.reshape(-1, N), A.reshape(-1, K), W, bias)
        return
    # one threadgroup of each tile writes the tile's columns of every row: the lines those bytes meet
    width, size = 16 * S, dtype.itemsize
    written = [{line for m in range(M) for line in _lines((m * N + c0) * size, (m * N + min(N, c0 + width)) * size)}
               for c0 in range(0, N, width)]  # fmt: skip
    assert out.lines_summed_over_threadgroups == sum(map(len, written)) and out.lines == len(set().union(*written))
    assert out.store_bytes == M * N * dtype.itemsize
    if N % width == 0 and N * size % 128 == 0:  # (whole tiles on whole lines: no line written twice)
        assert out.lines_summed_over_threadgroups == out.lines
    R.check_accuracy(y.reshape(-1, N), A.reshape(-1, K), W, bias)


# -- first-use verification: what can see a stale hand-over, and what its verdicts hold for --------------------


def test_the_split_k_families_call_one_shape_four_times_with_a_and_minus_a():
    """Both split-K families (one dispatch, from Metal 3.2; two) end with four calls of one shape of at
    least 8 tiles of several slices, A and -A in turn, each compared with the reference: the same slots
    of the workspace every call, so a partial sum of the call before, read where the hand-over did not
    hold, changes the sign of a result."""
    from bnb_mps.ops import verify

    for name, route in (("matmul_4bit_splitk", "splitk"), ("matmul_4bit_splitk_two", "splitk/two")):
        family = verify.FAMILIES[name]
        assert family.ops == () and "gemm_4bit" in family.serves and family.unit == UNIT
        assert family.language_version == (ONE if route == "splitk" else None)
        cases = list(family.cases())
        assert {c.route for c in cases} == {route}
        repeated = [c for c in cases if ", call " in c.label]
        assert len(repeated) == 4 and cases[-4:] == repeated
        A = repeated[0].args[0]
        M, K = A.shape
        N = repeated[0].args[2][0]
        S = matmul_4bit.splitk_splits(M, K, A.element_size())
        assert S >= 4 and -(-N // (16 * S)) >= 8, (N, S)
        for i, c in enumerate(repeated):
            assert c.op == "gemm_4bit" and c.args[2] == [N, K] and c.args[1] is repeated[0].args[1]
            assert torch.equal(c.args[0], A if i % 2 == 0 else -A), i


def test_a_stale_partial_sum_fails_the_two_dispatch_family(library):
    """The two-dispatch family run on a tier that drops the partial-sum launches of the repeated calls
    after the first (their sum kernel then adds the slots the call before wrote, as a hand-over that did
    not hold would): it fails on the second call, the first with -A."""
    from bnb_mps.ops import verify
    from bnb_mps.ops.verify import runner

    class StaleAfterFirst(EmulatedExecutor):
        seen = 0

        def launch(self, kernel, *, grid, threadgroup, args):
            if "_splitk_partial_" in kernel and grid[0] == 33:  # (9 tiles of 4 slices, the last of one)
                self.seen += 1
                if self.seen > 1:
                    return
            super().launch(kernel, grid=grid, threadgroup=threadgroup, args=args)

    ex = StaleAfterFirst(library, language_version=TWO)
    v = runner.run_family(verify.FAMILIES["matmul_4bit_splitk_two"], ex, "cpu")
    assert ex.seen == 4 and not v.passed and "call 2 of 4 (-A)" in v.case, v.describe()
    assert runner.run_family(verify.FAMILIES["matmul_4bit_splitk_two"], EmulatedExecutor(library), "cpu").passed


class _Tier:
    """An executor as the op layer and the verification key see it: a name and a language version."""

    def __init__(self, version):
        self.name, self.language_version = "emulated", version


def test_the_verdict_key_holds_the_language_version_and_the_units_text(monkeypatch, tmp_path):
    """A verdict holds for the Metal language version the kernels were compiled at and, for a family of
    one compile unit, for that unit's text: a 3.1 verdict never serves 3.2 kernels (nor the other way),
    and a change of the split-K unit's text is verified again, also where the cache has a verdict."""
    import shutil

    from bnb_mps.ops import verify
    from bnb_mps.ops.verify import Verdict, first_use, machine_key

    keys = {v: machine_key.cache_key("emulated", "h", _Tier(v)) for v in ((3, 1), (3, 2), None)}
    assert len(set(keys.values())) == 3
    assert " | Metal 3.1" in keys[(3, 1)]
    assert " | Metal 3.2" in keys[(3, 2)] and " | Metal default" in keys[None]
    assert " | Metal 3.1" in machine_key.cache_key("shader", "h")  # (off macOS torch asks for 3.1)

    monkeypatch.setenv(verify.CACHE_ENV_VAR, str(tmp_path / "verify.json"))
    monkeypatch.delenv(verify.ENV_VAR, raising=False)
    runs = []

    def counted(family, executor, device):
        runs.append((family.name, executor.language_version))
        return Verdict(family.name, True, 0.0)

    monkeypatch.setattr(verify, "run_family", counted)
    verify.reset()
    try:
        for version in ((3, 1), (3, 2), (3, 1), (3, 2)):
            assert verify.verdict("matmul_4bit_splitk_two", "emulated", _Tier(version)).passed
        assert runs == [("matmul_4bit_splitk_two", (3, 1)), ("matmul_4bit_splitk_two", (3, 2))]
        verify.reset()  # (a new process: the cache file alone)
        assert verify.verdict("matmul_4bit_splitk_two", "emulated", _Tier((3, 2))).cached and len(runs) == 2
        # the split-K unit's text changed (a copy of the kernels with one more line in its header): its
        # families' key part changes, the others' has none
        before = first_use._unit_key(verify.FAMILIES["matmul_4bit_splitk_two"])
        assert before.startswith(f" | unit {UNIT} ") and first_use._unit_key(verify.FAMILIES["matmul_4bit_small"]) == ""
        copy = tmp_path / "kernels"
        shutil.copytree(source.kernel_dir(), copy)
        header = copy / "gemm_4bit_splitk.h"
        header.write_text(header.read_text() + "// another line\n")
        monkeypatch.setenv(source.KERNEL_DIR_ENV, str(copy))
        verify.reset()
        assert first_use._unit_key(verify.FAMILIES["matmul_4bit_splitk_two"]) not in ("", before)
        assert not verify.verdict("matmul_4bit_splitk_two", "emulated", _Tier((3, 2))).cached and len(runs) == 3
    finally:
        verify.reset()


def test_the_op_layer_reads_the_tiers_language_version(monkeypatch):
    """`language_version_of`: the executor's `language_version` (a wrapper's inner executor's where it has
    none), the shader tier's from torch and macOS (bnb_mps.executors.shader.language_version), None where
    nothing says it; and a kept plan is not served once the executor's version changed (the emulated
    tier's is set in place)."""
    from bnb_mps.executors import shader
    from bnb_mps.ops import dispatcher_entry
    from bnb_mps.ops import plan as plan_module
    from bnb_mps.testing import RecordingExecutor

    assert plan_module.language_version_of(_Tier((3, 2))) == (3, 2)
    assert plan_module.language_version_of(_Tier("4.0")) == (4, 0)
    wrapper = RecordingExecutor(_Tier((3, 2)))
    assert plan_module.language_version_of(wrapper) == (3, 2)
    assert plan_module.language_version_of(RecordingExecutor()) is None

    class Shader:
        name = "shader"

    want = shader.language_version(None, shader.torch_version())
    assert plan_module.language_version_of(Shader()) == want == (3, 1)  # (off macOS)

    meta = torch.device("meta")
    N, K, M = 128, 1024, 4
    args = (torch.empty(M, K, dtype=torch.float16, device=meta), torch.empty(N * K // 2, 1, dtype=torch.uint8,
            device=meta), [N, K], torch.empty(N * K // 64, device=meta), 64, "nf4")  # fmt: skip
    for version, launched in (((3, 1), ["bnb_gemm_4bit_splitk_partial_absmax_f16", "bnb_gemm_4bit_splitk_sum_f16"]),
                              ((3, 2), ["bnb_gemm_4bit_splitk_absmax_f16"])):  # fmt: skip
        rec = RecordingExecutor()
        rec.language_version = version
        entry = dispatcher_entry("gemm_4bit", executor=rec)
        entry(args, {})
        assert rec.launched == launched
        rec.clear()
        entry(args, {})  # (kept)
        assert rec.launched == launched and len(entry.plans) == 1


def test_a_change_of_the_emulated_tiers_language_version_drops_what_was_kept(monkeypatch):
    """The emulated tier's Metal version is a setting changed in place: what the op layer kept for its
    kernels (bound to the kernels of the version it was planned at) is dropped on the way in and out."""
    from bnb_mps.executors import emulated
    from bnb_mps.ops import dispatcher_entry
    from bnb_mps.testing import RecordingExecutor

    monkeypatch.setenv("BNB_MPS_TUNE", "0")
    A, args, W, bias = gemm_args(Case(4, 128, 1024, torch.float16))
    rec = RecordingExecutor(emulated.load())
    entry = dispatcher_entry("gemm_4bit", executor=rec)
    for version, launched in (("3.1", ["bnb_gemm_4bit_splitk_partial_absmax_f16", "bnb_gemm_4bit_splitk_sum_f16"]),
                              ("3.2", ["bnb_gemm_4bit_splitk_absmax_f16"]),
                              ("3.1", ["bnb_gemm_4bit_splitk_partial_absmax_f16", "bnb_gemm_4bit_splitk_sum_f16"])):  # fmt: skip
        with emulated.settings(metal_version=version):
            rec.clear()
            y = entry(tuple(args), {})
            assert rec.launched == launched
            R.check_accuracy(y, A, W, bias)
