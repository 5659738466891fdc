"""The test helpers of bnb_mps.testing count what they claim to."""

from __future__ import annotations

import pytest
import torch

from bnb_mps.testing import AllocationCounter, RecordingExecutor


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_allocation_counter_counts_new_storages_only(device):
    a = torch.ones(100, device=device)
    with AllocationCounter() as alloc:
        b = torch.empty(10, 10, dtype=torch.float16, device=device)  # 200 bytes
        a.reshape(10, 10).t()  # views: nothing
        a.view(torch.int32)
        a.add_(1)  # in place: nothing
        c = a[1:].clone()  # 396 bytes
        b.t().contiguous()  # a copy: 200 bytes
        b.contiguous()  # already contiguous: nothing
    assert alloc.bytes == 200 + 396 + 200, alloc.allocations
    assert alloc.count == 3
    assert c.numel() == 99


def test_recorder_describes_bound_tensors():
    base = torch.zeros(64, dtype=torch.float16)
    rec = RecordingExecutor()
    rec.launch("k", grid=(1, 1, 1), threadgroup=(32, 1, 1), args=[base[3:], base.view(8, 8).t()])
    (_, grid, tg, (first, second)), = rec.launches
    assert (grid, tg) == ((1, 1, 1), (32, 1, 1))
    assert first.byte_offset == 6 and first.nbytes == 122 and first.contiguous
    assert second.shape == (8, 8) and not second.contiguous and second.dtype == torch.float16
