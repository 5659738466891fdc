"""The 4-bit matmul launchers on `meta` tensors at real model sizes: no host reads (meta tensors
hold no data), one launch per call (two on the split-K path below Metal 3.2: the partial sums, then
their sum), and nothing allocated per call beyond the output (no dequantized copy of the weight, no
float copy of the nested absmax, no copy of a strided A). The split-K kernels' workspace
(bnb_mps.ops.workspace) is allocated once per device, by the first call that needs it; the calls
counted here come after such a call."""

from __future__ import annotations

import pytest
import torch

from bnb_mps.ops import OPS, call, workspace
from bnb_mps.testing import AllocationCounter, RecordingExecutor

pytest.importorskip("bitsandbytes")

META = torch.device("meta")
VERSIONS = [(3, 1), (3, 2)]  # the tier's Metal language version: two-dispatch split-K below 3.2, one from it


def splitk_launches(version, sc="nested", dt="f16") -> list[str]:
    """The kernels of one split-K call at `version`."""
    if version >= (3, 2):
        return [f"bnb_gemm_4bit_splitk_{sc}_{dt}"]
    return [f"bnb_gemm_4bit_splitk_partial_{sc}_{dt}", f"bnb_gemm_4bit_splitk_sum_{dt}"]


def recorder(version=None) -> RecordingExecutor:
    rec = RecordingExecutor()
    rec.language_version = version  # (what the op layer reads of a tier: bnb_mps.ops.plan.language_version_of)
    return rec


def nested_nf4_args(M, N, K, dtype=torch.bfloat16, blocksize=64, A=None, bias=False, offset_dtype=torch.float32):
    nblocks = N * K // blocksize
    A = torch.empty(M, K, dtype=dtype, device=META) if A is None else A
    return (A, torch.empty(N * K // 2, 1, dtype=torch.uint8, device=META), [N, K],
            torch.empty(-(-nblocks // 256), device=META), blocksize, "nf4",
            torch.empty(N, dtype=dtype, device=META) if bias else None,
            torch.empty(nblocks, dtype=torch.uint8, device=META), torch.empty(256, device=META),
            torch.empty((), dtype=offset_dtype, device=META))  # fmt: skip


def run(name, args, warm=True, version=None):
    """(output, the launches, the allocations) of one call on a tier of Metal `version`, after a first
    call of the same arguments (`warm`: the workspace, if the call needs one, is there)."""
    if warm:
        call(OPS[name], args, {}, recorder(version))
    rec = recorder(version)
    with AllocationCounter() as alloc:
        out = call(OPS[name], args, {}, rec)
    return out, rec, alloc


@pytest.mark.parametrize("version", VERSIONS, ids=lambda v: f"metal{v[0]}.{v[1]}")
@pytest.mark.parametrize("M", [1, 8, 512])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_gemm_4096x4096_nested_nf4_allocates_only_the_output(M, dtype, version):
    args = nested_nf4_args(M, 4096, 4096, dtype, bias=True, offset_dtype=torch.float16)
    out, rec, alloc = run("gemm_4bit", args, version=version)
    assert out.shape == (M, 4096) and out.dtype == dtype
    dt = {torch.float16: "f16", torch.bfloat16: "bf16", torch.float32: "f32"}[dtype]
    assert len(rec.launches) == 1 or (M == 8 and rec.launched == splitk_launches(version, dt=dt)), rec.launched
    assert alloc.allocations == [(alloc.allocations[0][0], M * 4096 * dtype.itemsize)], alloc.allocations


@pytest.mark.parametrize("version", VERSIONS, ids=lambda v: f"metal{v[0]}.{v[1]}")
def test_the_goal_case_m8(version):
    """The issue's figure: M = 8 on a 4096x4096 nested NF4 weight costs the 64 KiB output per call,
    nothing else; the first call on a device also allocates the split-K workspace, once: the partial
    sums of M x 16 S columns per threadgroup (tiles x S x M x 16 S floats) and, for the one-dispatch
    kernel (Metal >= 3.2), a counter per tile, with S = 4 slices (docs/small-batch.md: 4096 / 64 = 64
    tiles of 64 columns). Below 3.2 the sum kernel's grid is a threadgroup per tile and 128 of its
    8 x 64 outputs."""
    workspace.release()
    try:
        args = nested_nf4_args(8, 4096, 4096, torch.float16)
        _, rec, first = run("gemm_4bit", args, warm=False, version=version)
        out, rec, alloc = run("gemm_4bit", args, warm=False, version=version)
        assert alloc.bytes == 8 * 4096 * 2 == out.numel() * out.element_size()
        assert rec.launched == splitk_launches(version)
        S, tiles = 4, 64
        assert rec.launches[0][1] == (tiles * S, 1, 1)
        counters = 4 * tiles if version >= (3, 2) else 0
        assert first.bytes == alloc.bytes + 4 * tiles * S * 8 * 16 * S + counters
        if version < (3, 2):
            assert rec.launches[1][1:3] == ((tiles, 8 * 16 * S // 128, 1), (128, 1, 1))
        _, _, third = run("gemm_4bit", nested_nf4_args(8, 2048, 4096, torch.float16), warm=False,
                          version=version)  # (fewer tiles)
        assert third.bytes == 8 * 2048 * 2
    finally:
        workspace.release()


@pytest.mark.parametrize("version", VERSIONS, ids=lambda v: f"metal{v[0]}.{v[1]}")
@pytest.mark.parametrize("shape", [(4096, 14336), (14336, 4096), (11008, 4096)])
def test_llama_shapes(shape, version):
    N, K = shape
    for M in (1, 8, 32):
        A = torch.empty(2, M, K, dtype=torch.float16, device=META)  # (batch, seq, K)
        out, rec, alloc = run("gemm_4bit", nested_nf4_args(2 * M, N, K, A=A), version=version)
        assert out.shape == (2, M, N)
        assert len(rec.launches) == 1 or rec.launched == splitk_launches(version), rec.launched
        assert alloc.bytes == out.numel() * 2


def test_strided_A_and_gemv_allocate_only_the_output():
    wide = torch.empty(8, 4096 + 64, dtype=torch.float16, device=META)
    A = wide[:, 32 : 32 + 4096]  # rows of a wider tensor, as a fused-projection slice gives
    out, rec, alloc = run("gemm_4bit", nested_nf4_args(8, 4096, 4096, A=A))
    assert alloc.bytes == out.numel() * 2 and rec.launched == splitk_launches((3, 1))
    (_, _, _, bound) = rec.launches[0]
    assert bound[0].byte_offset == 64 and bound[12].value == 4096 + 64  # A's own storage, its row stride

    code = torch.empty(16, device=META)
    args = (torch.empty(1, 1, 4096, dtype=torch.bfloat16, device=META), torch.empty(4096 * 2048, 1, dtype=torch.uint8,
            device=META), [4096, 4096], torch.empty(4096 * 64, device=META), code, 64)  # fmt: skip
    out, rec, alloc = run("gemv_4bit", args)
    assert out.shape == (1, 1, 4096) and alloc.bytes == 4096 * 2 and rec.launched == ["bnb_gemv_4bit_absmax_bf16"]
    target = torch.empty(1, 1, 4096, dtype=torch.bfloat16, device=META)
    _, rec, alloc = run("gemv_4bit.out", args + (target,))
    assert alloc.bytes == 0 and len(rec.launches) == 1


@pytest.mark.parametrize("layout", ["contiguous", "strided", "misaligned"])
def test_vector_loads_of_A_only_when_aligned(layout):
    """The A-alignment flag (bit 2 of buffer 16) is set exactly when A's start and row stride
    are 16-byte aligned; otherwise the kernels read A element by element."""
    K = 64
    if layout == "contiguous":
        A = torch.empty(8, K, dtype=torch.float16, device=META)
    elif layout == "strided":
        A = torch.empty(8, K + 4, dtype=torch.float16, device=META)[:, :K]  # row stride 136 bytes
    else:
        A = torch.empty(8 * K + 1, dtype=torch.float16, device=META)[1:].view(8, K)
    _, rec, _ = run("gemm_4bit", nested_nf4_args(8, 64, K, A=A))
    ((_, _, _, bound),) = rec.launches
    vec = bool(bound[16].value & 2)
    assert vec == (bound[0].byte_offset % 16 == 0 and bound[12].value * 2 % 16 == 0)
    assert vec == (layout == "contiguous")
