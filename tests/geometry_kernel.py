"""A small kernel that exercises launch geometry and scalar binding, shared by the GPU executor
tests (run on a Mac) and checked here under the emulator, so the test kernel itself is known good."""

from __future__ import annotations

import struct

import torch

from bnb_mps.kernel_args import Scalar, float16, int64, uint32

# Every thread writes its global linear index and the four scalars it received.
GEOMETRY_KERNEL = r"""
#include <metal_stdlib>
using namespace metal;

kernel void bnb_test_geometry(device uint* out [[buffer(0)]],
                              constant uint& a [[buffer(1)]],
                              constant half& h [[buffer(2)]],
                              constant long& l [[buffer(3)]],
                              constant uchar& c [[buffer(4)]],
                              uint3 group [[threadgroup_position_in_grid]],
                              uint3 groups [[threadgroups_per_grid]],
                              uint3 lane [[thread_position_in_threadgroup]],
                              uint3 size [[threads_per_threadgroup]]) {
    uint3 pos = group * size + lane;
    uint3 extent = groups * size;
    uint i = (pos.z * extent.y + pos.y) * extent.x + pos.x;
    out[5 * i + 0] = i;
    out[5 * i + 1] = a;
    out[5 * i + 2] = as_type<ushort>(h);
    out[5 * i + 3] = uint(l + 4000000000L);
    out[5 * i + 4] = c;
}
"""


def expected_geometry_output(n_threads: int) -> torch.Tensor:
    """Row i: i, the uint, the half's bits, (long)-1 + 4e9 as uint, the uchar."""
    half_bits = struct.unpack("<H", struct.pack("<e", -1.5))[0]
    rows = [[i, 4000000000, half_bits, 3999999999, 200] for i in range(n_threads)]
    return torch.tensor(rows, dtype=torch.int64).flatten()


# The scalars the tests bind to buffers 1-4, matching expected_geometry_output().
GEOMETRY_SCALARS = [uint32(4000000000), float16(-1.5), int64(-1), Scalar(200, "uchar")]
GEOMETRY_GRID, GEOMETRY_GROUP = (3, 2, 2), (4, 2, 1)
GEOMETRY_THREADS = 3 * 2 * 2 * 4 * 2
