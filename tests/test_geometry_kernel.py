"""The GPU executors' geometry test kernel, run under the emulator: what the Mac-only tests
expect of it is what the kernel computes (so a failure on a Mac points at the executor)."""

import pytest
import torch

from geometry_kernel import (
    GEOMETRY_GRID, GEOMETRY_GROUP, GEOMETRY_KERNEL, GEOMETRY_SCALARS, GEOMETRY_THREADS, expected_geometry_output,
)  # fmt: skip

emulator = pytest.importorskip("bnb_mps.emulator")


@pytest.mark.parametrize("order", ["forward", "reverse", "random"])
def test_geometry_kernel_under_the_emulator(order):
    storage = torch.full((7 + 5 * GEOMETRY_THREADS,), -1, dtype=torch.int32)
    emulator.load(GEOMETRY_KERNEL).launch(
        "bnb_test_geometry", grid=GEOMETRY_GRID, threadgroup=GEOMETRY_GROUP,
        args=[storage[7:], *GEOMETRY_SCALARS], order=order,
    )  # fmt: skip
    got = storage.to(torch.int64) & 0xFFFFFFFF
    assert torch.equal(got[:7], torch.full((7,), 0xFFFFFFFF, dtype=torch.int64))
    assert torch.equal(got[7:], expected_geometry_output(GEOMETRY_THREADS))
