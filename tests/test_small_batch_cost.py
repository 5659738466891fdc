"""Small batches (M = 2..32) of the 4-bit products under the cost model (bnb_mps.emulator.profile), on the
built-in routes (docs/small-batch.md): one launch, at least half the threadgroups of the M = 1 call, each
weight byte read once, and the issue's traffic targets: within 1.25x of the M = 1 call's up to M = 8 on every
shape and dtype, and within 1.6x up to M = 13 (beyond, where K is small, the split-K kernel's partial sums and
the re-read of A by each tile outgrow it; docs/small-batch.md shows where the bound leaves no kernel room).
The bound itself (scripts/cost_model_matmul_4bit.py, `lower_bound`) is checked against every kernel measured:
none is charged less. And the float32 products' error against float64, in issue 33's units.

The figures come from scripts/cost_model_matmul_4bit.py (what docs/small-batch.md's table prints); the
reference for the error is a float64 product of the dequantized weight written from docs/semantics.md
(tests/reference_matmul_4bit.py)."""

from __future__ import annotations

import math

import pytest

from extras import profile_compiler
import torch

from matmul_4bit_cases import DT
from script_loader import load_script

pytest.importorskip("bitsandbytes")
cm = load_script("cost_model_matmul_4bit.py")

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
WHOLE_TARGET_M = 13  # the 1.6x target holds up to this M on every shape from K = 1024 (docs/small-batch.md)


@pytest.fixture(scope="module")
def profiler():
    profile_compiler()
    return cm


def check_targets(N: int, K: int, dtype: torch.dtype, ms) -> list[str]:
    """The targets on every M of `ms`; returns one line of figures per M (for the log)."""
    one = cm.profile(N, K, 1, dtype)
    assert one.path == "gemv" and one.kernels == (f"bnb_gemv_4bit_nested_{DT[dtype]}",)
    half = math.ceil(one.threadgroups / 2)
    lines = []
    for M in ms:
        f = cm.profile(N, K, M, dtype)
        what = f"{N}x{K} M={M} {dtype}"
        assert f.kernels == (f"bnb_gemm_4bit_splitk_nested_{DT[dtype]}",), what  # one launch
        assert f.threadgroups >= half, what
        # each weight byte once: the weight's traffic is its own lines, no threadgroup re-reads another's
        assert f.b_traffic == f.b_lines * 128 <= one.b_traffic, what
        ratio = f.traffic / one.traffic
        if M <= 8:
            assert ratio <= 1.25, (what, ratio)
        elif M <= WHOLE_TARGET_M:
            assert ratio <= 1.6, (what, ratio)
        assert f.traffic >= cm.lower_bound(N, K, M, dtype, f.threadgroups, partial_bytes=cm.SPLIT_K_PARTIAL_BYTES), what
        lines.append(f"{what}: traffic {ratio:.2f}x, threadgroups {f.threadgroups}/{one.threadgroups}")
    return lines


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_small_batch_targets(profiler, dtype):
    print("\n".join(check_targets(1024, 1024, dtype, (2, 5, 8, 9, 13, 32))))


@pytest.mark.parametrize("shape", [(1024, 2880), (1024, 1408)], ids=str)
def test_small_batch_targets_where_rows_are_not_whole_lines(profiler, shape):
    """K % 256 != 0 (gpt-oss' 2880: rows 4 phases apart in their lines; Qwen's MoE experts' 1408: 2): each
    row is cut where its own lines begin (docs/small-batch.md), so the weight's traffic is its lines and,
    of each pair of rows, the line one ends and the next starts in, and both targets hold at M = 8 and 13
    (one cut for all rows gave 1.34x and 1.29x at M = 8)."""
    N, K = shape
    one = cm.profile(N, K, 1, torch.float16)
    period = 256 // ((K % 256) & -(K % 256))
    for M, target in ((8, 1.25), (13, 1.6)):
        f = cm.profile(N, K, M, torch.float16)
        assert f.kernels == ("bnb_gemm_4bit_splitk_nested_f16",) and 2 * f.threadgroups >= one.threadgroups
        assert f.b_lines == N * K // 256 and f.b_traffic <= (f.b_lines + N * (1 - 1 / period)) * 128, (M, f.b_traffic)
        assert f.traffic <= target * one.traffic, (M, f.traffic / one.traffic)


@pytest.mark.parametrize("N", [1040, 1296])
def test_small_batch_targets_where_the_last_tile_is_a_group(profiler, N):
    """N = 64 t + 16 (at K = 1024, S = 4: tiles of 64 columns): the last tile holds one group of 16 rows and
    takes one slice of all of K (gemm_4bit_splitk.h, "The last tile"), so the grid has ceil(N / 16)
    threadgroups, exactly half the gemv kernel's, and both targets hold at M = 8 and 13 (four slices
    there, each reading all of A's slice for 16 rows, gave 1.25x and more at M = 8)."""
    one = cm.profile(N, 1024, 1, torch.float16)
    for M, target in ((8, 1.25), (13, 1.6)):
        f = cm.profile(N, 1024, M, torch.float16)
        assert f.kernels == ("bnb_gemm_4bit_splitk_nested_f16",) and f.threadgroups == -(-N // 16) == -(-one.threadgroups // 2)
        assert f.b_traffic == f.b_lines * 128 and f.traffic <= target * one.traffic, (M, f.traffic / one.traffic)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(3072, 1024), (1024, 3072), (1024, 11008), (11008, 1024), (4096, 4096)], ids=str)
def test_small_batch_targets_every_m(profiler, shape, dtype):
    print("\n".join(check_targets(*shape, dtype, range(2, 33))))


def test_the_built_in_route_models_the_least_traffic(profiler):
    """Why the built-in route for 2 <= M <= 32 is the split-K kernel from K = 512 where rows are whole lines
    and the scales nested (docs/tuning.md): of the routes with at least half the M = 1 call's threadgroups it
    models the least traffic; the mma kernel,
    which models less at large M, has an eighth of them. Below K = 512 the small kernel, as before."""
    one = cm.profile(1024, 1024, 1, torch.float16)
    for M in (2, 8, 32):
        splitk = cm.profile(1024, 1024, M, torch.float16)
        others = {p: cm.profile(1024, 1024, M, torch.float16, p) for p in ("small", "small/wide", "batch", "mma")}
        assert splitk.path == "splitk" and splitk.threadgroups >= one.threadgroups / 2, M
        assert splitk.traffic < min(others[p].traffic for p in ("small", "small/wide", "batch")), M
        assert others["mma"].threadgroups < one.threadgroups / 2, M
        for f in (splitk, *others.values()):  # (the bound holds for every kernel, whatever its grid)
            assert f.traffic >= cm.lower_bound(1024, 1024, M, torch.float16, f.threadgroups), (M, f.path)
    small = cm.profile(1024, 256, 8, torch.float16)
    assert small.path == "small" and small.kernels == ("bnb_gemm_4bit_small_nested_f16",)


# (N, K, nested, buckets of M): 1040 = 4 x 256 + 16, rows 16 phases apart in their lines, so the split-K kernel's
# cuts share lines; 1152 with float32 absmax, which every slice reads again; 1024, rows of whole lines
ROUTE_CASES = [(1024, 1040, True, ((2,), (3, 4), (5, 6, 7, 8))), (1024, 1152, False, ((2,), (3, 4))),
               (1024, 1024, False, ((2,),))]


def test_the_built_in_route_is_the_small_or_split_k_kernel_whichever_models_less_over_the_bucket(profiler):
    """`choose_path` for 2 <= M <= 32 from K = 512: of the split-K and small kernels (both half the gemv
    kernel's threadgroups), the one whose modelled traffic, summed over the M of the tuning bucket, is
    less; every M of a bucket has that route. The small kernel where the split-K kernel's cuts share weight
    lines or its slices re-read float32 absmax, at M = 2 to 4; the split-K kernel beyond, and wherever
    rows are whole lines with nested scales (test_small_batch_targets)."""
    from bnb_mps.ops import candidates

    seen = set()
    for N, K, nested, buckets in ROUTE_CASES:
        for bucket in buckets:
            assert {candidates.m_bucket(M) for M in bucket} == {candidates.m_bucket(bucket[-1])}
            charged = {route: sum(cm.profile(N, K, M, torch.float16, route, nested).traffic for M in bucket)
                       for route in ("small", "splitk")}  # fmt: skip
            built_in = [cm.profile(N, K, M, torch.float16, nested=nested) for M in bucket]
            want = min(charged, key=charged.get)
            kernel = f"bnb_gemm_4bit_{want}_{'nested' if nested else 'absmax'}_f16"
            assert {f.path for f in built_in} == {want} and {f.kernels for f in built_in} == {(kernel,)}, \
                (N, K, nested, bucket, charged)
            assert sum(f.traffic for f in built_in) == charged[want]
            seen.add(want)
    assert seen == {"small", "splitk"}


def test_below_metal_3_2_the_built_in_route_is_two_dispatches_or_the_small_kernel_whichever_models_less(profiler):
    """Below Metal 3.2 (no one-dispatch kernel) `choose_path` takes, for 2 <= M <= 32 from K = 512, the
    two-dispatch split-K path or the small kernel, whichever the profile charges less over the bucket;
    the model charges the second dispatch honestly: the two dispatches' traffic exceeds the one
    dispatch's (at 3.2, the same S) by what `splitk_cost` says, 4 M - 8 bytes a column (every partial sum
    read back, no counter line)."""
    from bnb_mps.ops import candidates, matmul_4bit, small_batch

    seen = set()
    for N, K, nested, buckets in ROUTE_CASES:
        for bucket in buckets:
            assert {candidates.m_bucket(M) for M in bucket} == {candidates.m_bucket(bucket[-1])}
            charged = {route: sum(cm.profile(N, K, M, torch.float16, route, nested, "3.1").traffic for M in bucket)
                       for route in ("small", "splitk/two")}  # fmt: skip
            built_in = [cm.profile(N, K, M, torch.float16, nested=nested, metal_version="3.1") for M in bucket]
            want = min(charged, key=charged.get)
            assert {f.path for f in built_in} == {want}, (N, K, nested, bucket, charged)
            assert sum(f.traffic for f in built_in) == charged[want]
            seen.add(want)
            for M in bucket:
                one = cm.profile(N, K, M, torch.float16, "splitk", nested, "3.2")
                two = cm.profile(N, K, M, torch.float16, "splitk/two", nested, "3.1")
                S = matmul_4bit.splitk_splits(M, K, 2, cm.scale_bytes(nested), cm.BLOCKSIZE)
                model = [small_batch.splitk_cost(M, K, 2, S, cm.scale_bytes(nested), cm.BLOCKSIZE, d) for d in (1, 2)]
                assert N % (16 * S) == 0 and two.traffic - one.traffic == N * (model[1] - model[0]) == N * (4 * M - 8)
    assert seen == {"small", "splitk/two"}


def test_the_bound_charges_each_threadgroup_a_scale_line_share_per_weight_row(profiler, monkeypatch):
    """K = 4096: a weight row's 64 scale bytes are half a 128-byte line, so a threadgroup that touches a
    row reads at least 64 bytes of scales for it (`scale_line_share`), whatever slice of K it takes. The
    bound that counts this is above the one that counts the scales once, and still below every kernel
    measured (the split-K kernel's own bound, too)."""
    N, K = 128, 4096
    assert cm.scale_line_share(K) == K / 64 and cm.scale_line_share(8192) == 128
    assert cm.scale_line_share(3072) == 128 / 4  # 48 bytes a row: a line meets up to 4 rows' scales
    for M in (1, 4, 32):
        built_in, *others = cm.routes(M, N, K)
        for path in (built_in, *others):
            f = cm.profile(N, K, M, torch.float16, None if path == built_in else path)
            assert f.traffic >= cm.lower_bound(N, K, M, torch.float16, f.threadgroups), (M, path)
            if path == "splitk":
                split_k = cm.lower_bound(N, K, M, torch.float16, f.threadgroups, cm.SPLIT_K_PARTIAL_BYTES)
                assert f.traffic >= split_k, (M, path)
    splitk = cm.profile(N, K, 32, torch.float16)
    with_lines = cm.lower_bound(N, K, 32, torch.float16, splitk.threadgroups, cm.SPLIT_K_PARTIAL_BYTES)
    monkeypatch.setattr(cm, "scale_line_share", lambda K, scale_bytes=1: 0.0)
    assert cm.lower_bound(N, K, 32, torch.float16, splitk.threadgroups, cm.SPLIT_K_PARTIAL_BYTES) < 0.95 * with_lines


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_the_split_k_kernel_pays_its_shapes_count_and_the_code_tables_lines_and_little_more(profiler, dtype):
    """docs/small-batch.md, "Nor can any kernel of its shape": the split-K kernel is charged at least what
    any kernel of its shape must move at its S (`shape_count`), and within 4 % of that count with the
    nested code table's lines (K a multiple of 256: no line of the weight cut by two slices)."""
    from bnb_mps.ops import matmul_4bit

    for N, K in ((1024, 1024), (128, 4096)):
        for M in (2, 8, 32):
            f = cm.profile(N, K, M, dtype)
            S = matmul_4bit.splitk_splits(M, K, dtype.itemsize)
            assert f.path == "splitk", (N, K, M)
            assert cm.shape_count(N, K, M, dtype, S) <= f.traffic <= 1.04 * cm.shape_count(N, K, M, dtype, S, True), \
                (N, K, M, S, f.traffic, cm.shape_count(N, K, M, dtype, S, True))


# (N, K, dtype, M): where a count of the scales as one byte a block, or without the output's lines, picks another S
SLICE_CASES = {
    True: [(1024, 1024, torch.float16, 8), (1024, 3072, torch.float16, 13), (1024, 3072, torch.float32, 4),
           (2048, 2048, torch.float16, 2)],
    False: [(1024, 1024, torch.float16, 4), (1024, 1024, torch.float16, 8), (1024, 3072, torch.float16, 2),
            (2048, 2048, torch.float32, 8), (1024, 4096, torch.float32, 4)],
}


@pytest.mark.parametrize("nested", [True, False], ids=["nested", "float32-absmax"])
def test_the_split_k_kernel_takes_the_slices_the_model_charges_least(profiler, monkeypatch, nested):
    """`splitk_splits` counts A, the partial sums, the scale lines each slice touches (float32 absmax:
    4 bytes a block, a row's 16 of them in half a line at K = 1024, read again by every slice) and the
    output's lines; of the S the kernel can take, the built-in call is charged at most 1 % more than the
    least the profile charges any of them."""
    from bnb_mps.ops import matmul_4bit

    for N, K, dtype, M in SLICE_CASES[nested]:
        built_in = cm.profile(N, K, M, dtype, nested=nested)
        charged = {}
        for S in (2, 4, 8, 16):
            if K >= S * matmul_4bit._SPLITK_ALIGN:
                monkeypatch.setattr(matmul_4bit, "splitk_splits", lambda *args, S=S: S)
                charged[S] = cm.profile(N, K, M, dtype, "splitk", nested).traffic
        monkeypatch.undo()
        assert built_in.path == "splitk" and built_in.traffic <= 1.01 * min(charged.values()), (N, K, dtype, M, charged)


def test_float32_absmax_targets_and_the_bound_where_they_fail(profiler):
    """A weight without double quantization (float32 absmax, transformers' default) pays 4 bytes of scales a
    block, and every slice of K reads the lines of its rows' scales (docs/small-batch.md, "Float32
    absmax"). At K = 4096 both targets hold up to M = 8 and 13; at K = 1024 the bound of deterministic
    split-K kernels with half the M = 1 call's threadgroups is above 1.25x at M = 8 (the kernel is above
    its bound, and at or above its shape's count, within 4 % of it)."""
    from bnb_mps.ops import matmul_4bit

    for N, K, dtype in ((1024, 4096, torch.float16), (1024, 4096, torch.float32), (1024, 1024, torch.float16)):
        one = cm.profile(N, K, 1, dtype, nested=False)
        assert one.kernels == (f"bnb_gemv_4bit_absmax_{DT[dtype]}",)
        for M in (2, 8, 13):
            f = cm.profile(N, K, M, dtype, nested=False)
            assert f.kernels == (f"bnb_gemm_4bit_splitk_absmax_{DT[dtype]}",) and 2 * f.threadgroups >= one.threadgroups
            bound = cm.lower_bound(N, K, M, dtype, f.threadgroups, cm.SPLIT_K_PARTIAL_BYTES, nested=False)
            S = matmul_4bit.splitk_splits(M, K, dtype.itemsize, 4)
            count = cm.shape_count(N, K, M, dtype, S, nested=False)
            assert bound <= count <= f.traffic <= 1.04 * count, (N, K, M, bound, count, f.traffic)
            if K == 4096:
                assert f.traffic <= (1.25 if M <= 8 else 1.6) * one.traffic, (N, K, dtype, M)
    one = cm.profile(1024, 1024, 1, torch.float16, nested=False)
    half = math.ceil(one.threadgroups / 2)
    assert cm.lower_bound(1024, 1024, 8, torch.float16, half, cm.SPLIT_K_PARTIAL_BYTES, nested=False) > 1.25 * one.traffic
    # (nested, the same bound leaves room: 8-bit codes, 16 bytes a row at K = 1024)
    nested = cm.profile(1024, 1024, 1, torch.float16)
    assert cm.lower_bound(1024, 1024, 8, torch.float16, half, cm.SPLIT_K_PARTIAL_BYTES) < 1.25 * nested.traffic


def test_the_bound_leaves_no_kernel_the_whole_target_at_32_rows(profiler):
    """float32, 1024x1024, M = 32: even the bound of every kernel with half the M = 1 call's threadgroups
    (and the bound grows with more) is above 1.6x the M = 1 call's traffic."""
    one = cm.profile(1024, 1024, 1, torch.float32)
    bound = cm.lower_bound(1024, 1024, 32, torch.float32, math.ceil(one.threadgroups / 2))
    assert bound > 1.6 * one.traffic, bound / one.traffic
    assert cm.lower_bound(1024, 1024, 32, torch.float32, one.threadgroups) > bound


def test_as_many_threadgroups_as_gemv_leave_deterministic_split_k_no_room_at_8_rows(profiler):
    """Why the split-K kernel takes half the gemv kernel's threadgroups (docs/small-batch.md): with as
    many, the bound of deterministic split-K kernels is above 1.25x the M = 1 call's traffic at M = 8
    (float16, K = 1024), while with half it leaves room (the kernel meets it: test_small_batch_targets)."""
    one = cm.profile(1024, 1024, 1, torch.float16)
    split_k = cm.SPLIT_K_PARTIAL_BYTES
    assert cm.lower_bound(1024, 1024, 8, torch.float16, one.threadgroups, split_k) > 1.25 * one.traffic
    assert cm.lower_bound(1024, 1024, 8, torch.float16, math.ceil(one.threadgroups / 2), split_k) < 1.25 * one.traffic


# -- float32 accuracy: error against float64 in units of 2^-24 * sum|a * w| (issue 33) --------------------------

# bitsandbytes' CUDA kernels on an H100 (issue 33): 1.6 to 2.6 units at M = 16 to 128. The rule: no more than
# 1.5 x CUDA's + 1; against the lowest CUDA figure, 3.4 units.
CUDA_UNITS = 1.6


@pytest.mark.parametrize("route", ["small", "small/wide", "splitk", "splitk/two"])
@pytest.mark.parametrize("M,K", [(2, 4096), (16, 4096), (32, 11008)])
def test_float32_error_against_float64(library, library32, route, M, K):
    import reference_matmul_4bit as R
    from matmul_4bit_cases import Case, gemm_args

    from bnb_mps.ops import matmul_4bit
    from kernel_harness import EmulatedExecutor

    case = Case(M, 24, K, dtype=torch.float32, nested=True, bias=True, seed=M + K)
    A, args, W, bias = gemm_args(case)
    # (the one-dispatch split-K kernel exists from Metal 3.2: the split-K unit compiled there)
    ex = EmulatedExecutor(library32, language_version=(3, 2)) if route == "splitk" else EmulatedExecutor(library)
    y = matmul_4bit.gemm_4bit(ex, *args, route=route).double()
    Wd = torch.as_tensor(W, dtype=torch.float64)
    Ad = A.double().reshape(M, K)
    exact = Ad @ Wd.T + bias.double()
    unit = 2.0**-24 * (Ad.abs() @ Wd.abs().T + bias.double().abs())
    units = ((y - exact).abs() / unit).max().item()
    print(f"{route} M={M} K={K}: {units:.3f} units")
    assert units <= 1.5 * CUDA_UNITS + 1, units
    if route == "splitk/two":
        assert ex.launched == ["bnb_gemm_4bit_splitk_partial_nested_f32", "bnb_gemm_4bit_splitk_sum_f32"]
    else:
        assert ex.launched == [f"bnb_gemm_4bit_{route.replace('/', '_')}_nested_f32"]


def test_the_table_marks_the_built_in_route_of_each_m(profiler):
    import io

    buf = io.StringIO()
    rows = cm.table([(64, 512)], [1, 2, 40], torch.bfloat16, out=buf)
    text = buf.getvalue()
    assert [(f.M, f.path) for f in rows] == [
        (1, "gemv"), (1, "batch"), (1, "small"), (1, "small/wide"), (1, "splitk"), (1, "splitk/two"), (1, "mma"),
        (2, "splitk"), (2, "gemv"), (2, "batch"), (2, "small"), (2, "small/wide"), (2, "splitk/two"), (2, "mma"),
        (40, "mma")]
    assert "1 | gemv * |" in text and "2 | splitk * |" in text and "40 | mma * |" in text and "2 | batch |" in text
    # the bound of every kernel with half the M = 1 call's threadgroups, above the table's routes of each M
    one = rows[0]
    for M in (1, 2, 40):
        bound = next(line for line in text.splitlines() if line.startswith(f"{M} | bound |")).split(" | ")
        want = cm.lower_bound(64, 512, M, torch.bfloat16, math.ceil(one.threadgroups / 2))
        assert float(bound[2]) == pytest.approx(want / 1e6, abs=1e-3)
        assert f"{M} | bound, f32 partials |" in text and f"{M} | bound, split K |" in text
    for chip in cm.CHIPS:
        assert f"{chip} us" in text
    m1 = next(line for line in text.splitlines() if line.startswith("2 | splitk *")).split(" | ")
    f = rows[7]
    assert float(m1[2]) == pytest.approx(f.traffic / 1e6, abs=1e-3)
    assert float(m1[8]) == pytest.approx(f.traffic / 68.25e9 * 1e6, abs=0.05)  # M1: 68.25 GB/s (bnb_mps.chips)
