"""Every detector catches its planted bug (kernels/bugs.metal), faults surface as Python
exceptions naming the kernel and the thread, and the process survives them."""

from __future__ import annotations

import pytest
import torch

from bnb_mps import emulator
from bnb_mps.kernel_args import uint32

from emu_support import ORDERS, load_kernels


@pytest.fixture(scope="module")
def lib(compiler):
    return load_kernels("bugs.metal", compiler)


def test_missing_barrier_changes_output_with_lane_order(lib):
    x = torch.arange(64, dtype=torch.float32)
    outs = {}
    for order in ORDERS:
        out = torch.zeros(64)
        lib.launch("missing_barrier", grid=1, threadgroup=64, args=[x, out], order=order, seed=3)
        outs[order] = out
    assert not torch.equal(outs["forward"], outs["reverse"])
    with pytest.raises(emulator.NondeterministicOutput, match="missing_barrier"):
        emulator.run_checked(lib, "missing_barrier", grid=1, threadgroup=64, args=[x, torch.zeros(64)], race_check=False)
    with pytest.raises(emulator.RaceDetected, match="missing_barrier.*'shared'"):
        lib.launch("missing_barrier", grid=1, threadgroup=64, args=[x, torch.zeros(64)], race_check=True)


def test_write_write_race(lib):
    with pytest.raises(emulator.RaceDetected, match="threadgroup_race.*'slot'") as e:
        lib.launch("threadgroup_race", grid=1, threadgroup=32, args=[torch.zeros(32)], race_check=True)
    assert "thread_position_in_threadgroup" in str(e.value)


def test_uninitialised_threadgroup_read(lib):
    a, b = torch.zeros(1), torch.zeros(1)
    lib.launch("uninitialised_read", grid=1, threadgroup=64, args=[a], poison=0x00)
    lib.launch("uninitialised_read", grid=1, threadgroup=64, args=[b], poison=0xFF)
    assert a.item() == 63.0 and b.isnan().item()
    with pytest.raises(emulator.NondeterministicOutput):
        emulator.run_checked(lib, "uninitialised_read", grid=1, threadgroup=64, args=[torch.zeros(1)])


@pytest.mark.parametrize("n", [64, 10, 7])
def test_out_of_bounds_read(lib, n):
    x, out = torch.ones(n), torch.zeros(n)
    with pytest.raises(emulator.OutOfBounds, match=r"oob_read.*read of buffer\(0\)") as e:
        lib.launch("oob_read", threads=n, threadgroup=32, args=[x, out, uint32(n)])
    msg = str(e.value)
    assert f"thread_position_in_grid ({n - 1}, 0, 0)" in msg
    assert "bugs.metal:" in msg  # the source line, from the module's line table


@pytest.mark.parametrize("n", [64, 10])
def test_out_of_bounds_write(lib, n):
    with pytest.raises(emulator.OutOfBounds, match=r"oob_write.*write of buffer\(0\)") as e:
        lib.launch("oob_write", grid=(n + 31) // 32 + 1, threadgroup=32, args=[torch.zeros(n), uint32(n)])
    assert f"thread_position_in_grid ({n}, 0, 0)" in str(e.value)


def test_threadgroup_subscript_out_of_bounds_with_race_checking(lib):
    with pytest.raises(emulator.OutOfBounds, match=r"threadgroup_subscript.*subscript 32 .*\[0, 32\)"):
        lib.launch("threadgroup_subscript", grid=1, threadgroup=64, args=[torch.zeros(64)], race_check=True)
    lib.launch("threadgroup_subscript", grid=1, threadgroup=32, args=[torch.zeros(64)], race_check=True)


def test_out_of_bounds_leaves_outputs_untouched(lib):
    out = torch.zeros(8)
    with pytest.raises(emulator.OutOfBounds):
        lib.launch("oob_write", grid=1, threadgroup=16, args=[out, uint32(8)])
    assert torch.equal(out, torch.zeros(8))


def test_barrier_divergence_early_return(lib):
    with pytest.raises(emulator.BarrierDivergence, match="barrier_divergence.*already returned"):
        lib.launch("barrier_divergence", grid=2, threadgroup=64, args=[torch.zeros(100), uint32(100)])
    # Correct when every thread of every group takes part.
    out = torch.zeros(128)
    lib.launch("barrier_divergence", grid=2, threadgroup=64, args=[out, uint32(128)])
    assert torch.equal(out, torch.arange(128.0).view(2, 64).flip(1).flatten())


def test_barrier_divergence_different_barriers(lib):
    with pytest.raises(emulator.BarrierDivergence, match="different"):
        lib.launch("different_barriers", grid=1, threadgroup=32, args=[torch.zeros(32)])


def test_divergent_simd_collectives(lib):
    with pytest.raises(emulator.DivergentCollective, match="divergent_simd.*simd_(max|sum)"):
        lib.launch("divergent_simd", grid=1, threadgroup=32, args=[torch.ones(32), torch.zeros(32)])
    with pytest.raises(emulator.DivergentCollective, match="threadgroup_barrier"):
        lib.launch("simd_vs_barrier", grid=1, threadgroup=32, args=[torch.zeros(32)])


@pytest.mark.parametrize("order", ORDERS)
def test_simd_collective_skipped_by_returning_lanes(lib, order):
    with pytest.raises(emulator.DivergentCollective, match="simd_in_a_branch.*simd_sum.*returned"):
        lib.launch("simd_in_a_branch", grid=1, threadgroup=64, args=[torch.zeros(64)], order=order)


def test_metal_limits(lib):
    with pytest.raises(emulator.LimitExceeded, match="32768"):
        lib.launch("too_much_threadgroup_memory", grid=1, threadgroup=32, args=[torch.zeros(32)])
    with pytest.raises(emulator.LimitExceeded, match="1024"):
        lib.launch("three_buffers", grid=1, threadgroup=(32, 33), args=[torch.zeros(1)] * 3)
    with pytest.raises(emulator.UnboundBuffer, match=r"three_buffers.*buffer\(2\)"):
        lib.launch("three_buffers", grid=1, threadgroup=4, args=[torch.zeros(4), torch.zeros(4)])


@pytest.mark.parametrize("n", [5, 7, 13, 16])
def test_vector_loads_near_the_end_are_not_false_positives(lib, n):
    x = torch.arange(1.0, n + 1)
    out = torch.zeros(1)
    lib.launch("vector_tail", grid=1, threadgroup=1, args=[x, out, uint32(n)])
    assert out.item() == x.sum().item()


def test_wild_pointer_is_a_memory_fault(lib):
    with pytest.raises(emulator.MemoryFault, match="wild_pointer"):
        lib.launch("wild_pointer", grid=1, threadgroup=4, args=[torch.zeros(4)])


def test_process_survives_many_faults(lib):
    for _ in range(20):
        with pytest.raises(emulator.OutOfBounds):
            lib.launch("oob_read", threads=8, threadgroup=8, args=[torch.ones(8), torch.zeros(8), uint32(8)])
    out = torch.zeros(1)
    lib.launch("vector_tail", grid=1, threadgroup=1, args=[torch.ones(9), out, uint32(9)])
    assert out.item() == 9.0


# simdgroup_matrix operations are not yield points (csrc/emu/include/bnb_emu/sync.h): what the SIMD
# collectives used to check for them, the runtime's per-simdgroup log checks.


# (kernel, sizes of its input and output buffers, what the error must say)
MATRIX_MISUSES = [
    ("matrix_in_a_branch", (64, 64), r"matrix_in_a_branch.*divergent control flow.*simdgroup_(load|store).*simdgroup_(load|store)"),
    ("matrix_lane_address", (72, 64), r"matrix_lane_address.*arguments that differ"),
    ("matrix_count_mismatch", (128, 96), r"matrix_count_mismatch.*simdgroup_load.*is at simd_sum .*without having reached it"),
    ("matrix_after_return", (64, 64), r"matrix_after_return.*simdgroup_load.*returned"),
]  # fmt: skip


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("kernel,sizes,message", MATRIX_MISUSES, ids=[m[0] for m in MATRIX_MISUSES])
def test_matrix_operations_the_simdgroup_does_not_agree_on_are_reported(lib, order, kernel, sizes, message):
    """In divergent control flow, with lane-dependent arguments, miscounted at the next collective,
    or skipped by lanes that returned."""
    with pytest.raises(emulator.DivergentCollective, match=message):
        lib.launch(kernel, grid=1, threadgroup=32, args=[torch.ones(sizes[0]), torch.zeros(sizes[1])], order=order)


def test_missing_barrier_before_a_matrix_load(lib):
    # The lanes' writes reach a simdgroup_load only through a barrier, as on Metal: without one the
    # result depends on the lane order, and the race checker names the tile.
    x = torch.arange(64, dtype=torch.float32)
    with pytest.raises(emulator.NondeterministicOutput, match="matrix_missing_barrier"):
        emulator.run_checked(lib, "matrix_missing_barrier", grid=1, threadgroup=32, args=[x, torch.zeros(64)],
                             race_check=False)  # fmt: skip
    with pytest.raises(emulator.RaceDetected, match="matrix_missing_barrier.*'tile'"):
        lib.launch("matrix_missing_barrier", grid=1, threadgroup=32, args=[x, torch.zeros(64)], race_check=True)
