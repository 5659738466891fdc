"""Library.profile: kernels whose memory traffic is known by construction (kernels/profile.metal),
profiled through the public API; every expected figure below is worked out from the kernel's
access pattern (128-byte lines, 32-lane simdgroups)."""

from __future__ import annotations

import json

import pytest
import torch

from bnb_mps import chips, emulator
from bnb_mps.emulator import build
from bnb_mps.kernel_args import uint32

from emu_support import KERNELS
from extras import profile_compiler

LINE = 128

profile_compiler()  # (a missing profiling clang++ skips here, and fails under CI: tests/extras.py)


@pytest.fixture(scope="module")
def lib():
    return emulator.load(KERNELS / "profile.metal")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def test_coalesced_copy(lib):
    n, tg = 8192, 256
    x, y = torch.randn(n), torch.zeros(n)
    p = lib.profile("copy_f32", grid=n // tg, threadgroup=tg, args=[x, y], required_bytes=8 * n)
    assert torch.equal(y, x)  # the kernel really ran
    lines = n * 4 // LINE
    bx, by = p.buffers
    assert (bx.load_bytes, bx.store_bytes, by.load_bytes, by.store_bytes) == (4 * n, 0, 0, 4 * n)
    for b in (bx, by):
        assert (b.unique_bytes, b.lines, b.lines_summed_over_threadgroups, b.transactions) == (4 * n, lines, lines, lines)
    assert p.simd_instructions == 2 * n // 32  # one load and one store per simdgroup
    assert p.simd_transactions == 2 * lines
    assert p.simd_transactions_ideal == 2 * lines
    assert p.coalescing_efficiency == 1.0
    assert (p.threads, p.threadgroups, p.barriers, p.simd_collectives, p.threadgroup_memory_bytes) == (n, n // tg, 0, 0, 0)
    assert p.traffic_efficiency == 1.0


def test_stride_32_floats_touches_32_lines_per_simdgroup_load(lib):
    n, tg = 8192, 256
    x, y = torch.randn(n), torch.zeros(n)
    p = lib.profile("copy_f32_stride32", grid=n // tg, threadgroup=tg, args=[x, y, uint32(n)])
    idx = (torch.arange(n) * 32) % n + (torch.arange(n) * 32) // n
    assert torch.equal(y, x[idx])
    bx, by, scalar = p.buffers
    assert scalar is None
    loads = n // 32  # simdgroup load instructions
    assert bx.transactions == 32 * loads
    assert bx.coalescing_efficiency == 1 / 32
    assert bx.lines == n * 4 // LINE  # every line is still read, once per ...
    assert bx.lines_summed_over_threadgroups == (n // tg) * (n * 4 // LINE)  # ... threadgroup: each touches them all
    assert by.transactions == n * 4 // LINE and by.coalescing_efficiency == 1.0
    assert p.simd_transactions == bx.transactions + by.transactions


def test_broadcast_read_is_one_line(lib):
    n, tg, k = 1024, 256, 5
    x, y = torch.randn(64), torch.zeros(n)
    p = lib.profile("broadcast_f32", grid=n // tg, threadgroup=tg, args=[x, y, uint32(k)])
    assert torch.equal(y, x[k] + torch.arange(n, dtype=torch.float32))
    bx = p.buffers[0]
    assert (bx.unique_bytes, bx.lines, bx.load_bytes) == (4, 1, 4 * n)
    assert bx.transactions == n // 32  # one line per simdgroup load
    assert bx.lines_summed_over_threadgroups == n // tg


def test_reread_per_threadgroup(lib):
    m, tg, groups = 1024, 256, 4
    x, y = torch.randn(m, generator=torch.Generator().manual_seed(0)), torch.zeros(groups * tg)
    p = lib.profile("reread_per_threadgroup", grid=groups, threadgroup=tg, args=[x, y, uint32(m)])
    ref = x.double().view(-1, tg).sum(0).repeat(groups)
    assert torch.allclose(y.double(), ref, rtol=0, atol=1e-5)
    bx = p.buffers[0]
    buffer_lines = m * 4 // LINE
    assert bx.lines == buffer_lines
    assert bx.lines_summed_over_threadgroups == groups * buffer_lines
    assert bx.load_bytes == groups * m * 4
    assert bx.transactions == groups * buffer_lines  # coalesced: one line per simdgroup load
    assert p.traffic_terms() == {"unique_lines": (buffer_lines + groups * tg * 4 // LINE) * LINE,
                                 "lines_summed_over_threadgroups": (groups * buffer_lines + groups * tg * 4 // LINE) * LINE}


@pytest.mark.parametrize("kernel,width,accesses_per_thread", [("read_uchar", 1, 1), ("read_uchar4", 4, 1),
                                                               ("read_uint4", 16, 1), ("read_4_uchars", 4, 4)])
def test_access_width(lib, kernel, width, accesses_per_thread):
    nbytes = 4096
    x = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    threads = nbytes // width
    out = torch.zeros(threads, dtype=torch.int32)
    p = lib.profile(kernel, threads=threads, threadgroup=256, args=[x, out])
    bx = p.buffers[0]
    assert (bx.load_bytes, bx.unique_bytes, bx.lines) == (nbytes, nbytes, nbytes // LINE)  # the same lines
    assert bx.accesses == threads * accesses_per_thread
    # A simdgroup instruction covers 32 lanes x (bytes per access): 32 B (uchar) -> one line and a
    # quarter of it used; 128 B (uchar4, or the k-th of four uchars) -> one line; 512 B (uint4) -> 4.
    per_access = width // accesses_per_thread
    lines_per_instruction = max(1, 32 * per_access // LINE)
    instructions = (threads // 32) * accesses_per_thread
    assert bx.transactions == instructions * lines_per_instruction
    assert bx.coalescing_efficiency == (nbytes / LINE) / (instructions * lines_per_instruction)


def test_transactions_uchar_vs_uchar4_vs_uint4(lib):
    x = torch.randint(0, 256, (4096,), dtype=torch.uint8)
    tr = {k: lib.profile(k, threads=4096 // w, threadgroup=256, args=[x, torch.zeros(4096 // w, dtype=torch.int32)])
          .buffers[0].transactions for k, w in (("read_uchar", 1), ("read_uchar4", 4), ("read_uint4", 16))}
    assert tr == {"read_uchar": 128, "read_uchar4": 32, "read_uint4": 32}


def test_vector_accesses_of_other_types_are_one_access_each(lib):
    n4 = 256
    x = torch.randn(n4 * 4, dtype=torch.float16)
    y = torch.zeros_like(x)
    p = lib.profile("half4_scale", threads=n4, threadgroup=64, args=[x, y])
    assert torch.equal(y, x * 2)
    for b in p.buffers:
        assert b.accesses == n4 and b.transactions == n4 * 8 // LINE and b.coalescing_efficiency == 1.0

    f = torch.randn(n4 * 4)
    d = torch.zeros(n4)
    p = lib.profile("float4_dot", threads=n4, threadgroup=64, args=[f, d])  # dot() of a device float4
    assert torch.allclose(d, (f.view(-1, 4) ** 2).sum(1))
    assert p.buffers[0].accesses == n4 and p.buffers[0].load_bytes == 16 * n4

    out = torch.zeros(4 * n4, dtype=torch.uint8)
    p = lib.profile("write_uchar4", threads=n4, threadgroup=64, args=[out])
    assert p.buffers[0].accesses == n4 and p.buffers[0].store_bytes == 4 * n4
    assert p.buffers[0].transactions == n4 // 32


def test_loops_of_scalar_stores_stay_scalar_stores(lib):
    y = torch.ones(8 * 64)
    p = lib.profile("zero8", threads=64, threadgroup=64, args=[y])
    assert not y.any()
    b = p.buffers[0]
    assert (b.accesses, b.store_bytes, b.unique_bytes) == (8 * 64, 4 * 8 * 64, 4 * 8 * 64)
    # The k-th store of the 32 lanes spans 32 x 32 bytes = 8 lines; 8 stores per simdgroup.
    assert b.transactions == 2 * 8 * 8


def test_view_off_a_line_boundary_spans_two_lines_per_load(lib):
    n, tg = 4096, 256
    base = torch.randn(n + 1)
    x, y = base[1:], torch.zeros(n)  # x starts 4 bytes into its storage
    p = lib.profile("copy_f32", grid=n // tg, threadgroup=tg, args=[x, y])
    assert torch.equal(y, x)
    bx = p.buffers[0]
    assert bx.lines == n * 4 // LINE + 1
    assert bx.transactions == 2 * (n // 32)
    assert bx.coalescing_efficiency == 0.5


def test_threadgroup_memory_barriers_and_collectives(lib):
    groups, tg = 4, 128
    x, y = torch.randn(groups * tg, generator=torch.Generator().manual_seed(0)), torch.zeros(groups)
    p = lib.profile("tg_reduce", grid=groups, threadgroup=tg, args=[x, y])
    # Simdgroup s sums stage[127 - 32s - l] over its lanes l: the reversed threadgroup's s-th run.
    sums = x.double().view(groups, tg).flip(-1).view(groups, 4, 32).sum(-1)
    assert torch.allclose(y.double(), sums.max(-1).values, rtol=0, atol=1e-5)
    assert p.threadgroup_memory_bytes == 128 * 4 + 4 * 4
    assert p.barriers == 2 and p.barriers_total == 2 * groups
    assert p.simd_collectives == 2 * 4 * groups  # simd_sum and simd_max in each of 4 simdgroups
    assert (p.threads, p.threadgroups) == (groups * tg, groups)
    # stage: 4 bytes written and read per thread; partial: 4 bytes written per simdgroup, read per thread.
    assert p.threadgroup_store_bytes == groups * (tg * 4 + 4 * 4)
    assert p.threadgroup_load_bytes == groups * (tg * 4 + tg * 4)
    assert p.buffers[1].store_bytes == 4 * groups


def test_instruction_count_restarts_at_synchronisation(lib):
    tg = 64
    x, y = torch.randn(tg), torch.zeros(tg)
    p = lib.profile("diverge_then_sync", grid=1, threadgroup=tg, args=[x, y])
    # Per simdgroup: the odd lanes' load (one line), then after simd_sum a load and a store (one
    # line each): the divergent extra load does not shift the later instructions.
    assert p.simd_instructions == 3 * 2
    assert p.simd_transactions == 3 * 2


def test_single_lane_access_is_its_own_instruction(lib):
    tg, groups = 128, 2
    sgs = tg * groups // 32
    head, y = torch.zeros(sgs), torch.zeros(tg * groups)
    p = lib.profile("lane0_then_all", grid=groups, threadgroup=tg, args=[head, y])
    assert torch.equal(head, torch.arange(0, tg * groups, 32, dtype=torch.float32))
    # Per simdgroup: lane 0's store into `head` (one line), then the 32 lanes' store into y (one
    # line); lane 0's extra store does not shift its y store into another instruction.
    assert p.simd_instructions == 2 * sgs
    assert p.buffers[0].transactions == sgs and p.buffers[1].transactions == sgs


def test_simdgroup_matrix_load_moves_the_tile_once(lib):
    cols, groups = 32, 4  # rows of 32 floats: each of the tile's 8 rows is in its own line
    a = torch.randn(8, cols)
    y = torch.zeros(groups * 32)
    p = lib.profile("matrix_load", grid=groups, threadgroup=32, args=[a, y, uint32(cols)])
    tiles = a.view(8, groups, 8).permute(1, 0, 2).reshape(groups, 32, 2).sum(-1)
    assert torch.allclose(y, tiles.reshape(-1))
    ba = p.buffers[0]
    assert ba.load_bytes == groups * 64 * 4 and ba.accesses == groups * 32
    assert ba.transactions == groups * 8  # 8 rows -> 8 lines per simdgroup_load
    assert ba.lines == 8 and ba.lines_summed_over_threadgroups == groups * 8
    assert p.threadgroup_store_bytes == groups * 64 * 4  # simdgroup_store into threadgroup memory


def test_atomics_are_one_access_each(lib):
    counter = torch.zeros(1, dtype=torch.int32)
    p = lib.profile("atomic_count", threads=256, threadgroup=64, args=[counter])
    assert int(counter) == 256
    b = p.buffers[0]
    assert (b.atomic_bytes, b.load_bytes, b.store_bytes, b.accesses) == (4 * 256, 0, 0, 256)
    assert (b.lines, b.unique_bytes, b.transactions) == (1, 4, 256 // 32)


def test_counts_do_not_depend_on_lane_order(lib):
    n = 4096
    x = torch.randn(n)
    runs = [lib.profile("copy_f32_stride32", grid=n // 256, threadgroup=256, args=[x, torch.zeros(n), uint32(n)],
                        order=order, seed=3).to_dict() for order in ("forward", "reverse", "random")]
    assert runs[0] == runs[1] == runs[2]


def test_race_checking_build_counts_the_same(lib):
    x = torch.randn(512)
    plain = lib.profile("tg_reduce", grid=4, threadgroup=128, args=[x, torch.zeros(4)])
    checked = lib.profile("tg_reduce", grid=4, threadgroup=128, args=[x, torch.zeros(4)], race_check=True,
                          order="reverse", poison=0)
    assert plain.to_dict() == checked.to_dict()


def test_partial_threadgroups_and_empty_grids(lib):
    x, y = torch.randn(100), torch.zeros(100)
    p = lib.profile("copy_f32", threads=100, threadgroup=64, args=[x, y])
    assert torch.equal(x, y)
    assert (p.threads, p.threadgroups) == (100, 2)
    assert p.buffers[0].transactions == 4  # simdgroups of 32, 32, 32 and 4 lanes, each within one line
    empty = lib.profile("copy_f32", grid=0, threadgroup=64, args=[x, y])
    assert empty.threads == 0 and empty.simd_transactions == 0 and empty.coalescing_efficiency is None


def test_faults_are_raised(lib):
    with pytest.raises(emulator.OutOfBounds):
        lib.profile("copy_f32", grid=2, threadgroup=64, args=[torch.randn(128), torch.zeros(100)])


def test_report_dict_text_and_estimate(lib):
    n = 2048
    x, y = torch.randn(n), torch.zeros(n)
    p = lib.profile("broadcast_f32", grid=n // 256, threadgroup=256, args=[x, y, uint32(0)], required_bytes=4 + 4 * n)
    d = p.to_dict()
    json.dumps(d)  # plain data
    for key in ("buffers", "simd_transactions", "simd_transactions_ideal", "threadgroup_memory_bytes", "barriers",
                "threads", "threadgroups"):
        assert key in d
    assert d["buffers"][2] is None
    for b in d["buffers"][:2]:
        assert {"load_bytes", "store_bytes", "unique_bytes", "lines", "lines_summed_over_threadgroups"} <= set(b)
    # traffic: x's one line per threadgroup (8 threadgroups), y's n*4 bytes.
    traffic = (n // 256) * LINE + 4 * n
    assert p.traffic_bytes == traffic
    e = p.estimate("M2 Max")
    assert e.time_s == traffic / 400e9 and e.efficiency == (4 + 4 * n) / traffic
    assert set(d["estimates"]) == set(chips.BANDWIDTH_GBPS)
    assert d["estimates"]["M4 Pro"]["time_s"] == traffic / 273e9
    text = str(p)
    assert "broadcast_f32" in text and "scalar" in text and "M1" in text and "coalescing efficiency" in text
    with pytest.raises(ValueError, match="unknown chip"):
        p.estimate("Z80")


def test_profile_validates_its_own_arguments(lib):
    x, y = torch.randn(64), torch.zeros(64)
    with pytest.raises(ValueError, match="line_bytes"):
        lib.profile("copy_f32", grid=1, threadgroup=64, args=[x, y], line_bytes=100)
    with pytest.raises(ValueError, match="required_bytes"):
        lib.profile("copy_f32", grid=1, threadgroup=64, args=[x, y], required_bytes=-1)


def test_other_line_sizes(lib):
    n = 1024
    x, y = torch.randn(n), torch.zeros(n)
    p = lib.profile("copy_f32", grid=n // 256, threadgroup=256, args=[x, y], line_bytes=64)
    assert p.buffers[0].lines == n * 4 // 64 and p.buffers[0].transactions == 2 * (n // 32)


def test_without_clang_profiling_says_what_is_missing(monkeypatch):
    monkeypatch.setenv("BNB_MPS_EMU_PROFILE_CXX", "g++")
    with pytest.raises(emulator.CompileError, match="BNB_MPS_EMU_PROFILE_CXX"):
        build.find_profile_compiler()
