"""The op layer's kernel path never reads device data on the host, and its outputs have the
shapes and dtypes bitsandbytes' own fake (meta) implementations declare.

Every op that has a Metal kernel runs through the full op layer (checks, allocation, launch) on
`meta` tensors, which have no data: any `.item()`, `.cpu()`, `.tolist()` or `bool(tensor)` on
device data raises there. The recording executor launches nothing.
"""

from __future__ import annotations

import copy

import pytest
import torch

import op_inputs
from bnb_mps import ops
from bnb_mps.testing import RecordingExecutor

WITH_KERNELS = sorted(name for name, op in ops.OPS.items() if op.kernel is not None)
CASES = [(name, label) for name in WITH_KERNELS for label, _ in op_inputs.cases(name)]


def to_meta(args):
    return [a.to("meta") if isinstance(a, torch.Tensor) else a for a in args]


def describe(result):
    if isinstance(result, (tuple, list)):
        return [describe(r) for r in result]
    if isinstance(result, torch.Tensor):
        return (tuple(result.shape), result.dtype, result.device.type)
    return result


def test_the_quantization_ops_have_kernels():
    assert {"quantize_blockwise", "dequantize_blockwise", "dequantize_blockwise.out", "quantize_4bit",
            "dequantize_4bit", "dequantize_4bit.out"} <= set(WITH_KERNELS)  # fmt: skip


@pytest.mark.parametrize("name,label", CASES, ids=[f"{n}-{l}" for n, l in CASES])
def test_kernel_path_on_meta(name, label):
    args = to_meta(copy.deepcopy(dict(op_inputs.cases(name))[label]))
    recorder = RecordingExecutor()
    got = ops.call(ops.OPS[name], tuple(args), {}, recorder)
    assert len(recorder.launches) == expected_launches(name, label, args), recorder.launched
    if name.endswith(".out"):  # (bitsandbytes' fake of dequantize_4bit.out always raises: Size != list)
        assert got is None
        return
    want = ops.op_packet(name)(*to_meta(args))  # bitsandbytes' fake implementation
    assert describe(got) == describe(want)


def expected_launches(name, label, args) -> int:
    """One launch per op; the 32-bit optimizer with update-norm clipping (max_unorm > 0) takes two
    (the norm pass, then the update)."""
    if label == "empty":
        return 0
    if name == "optimizer_update_32bit" and args[6] > 0:
        return 2
    return 1


def misaligned(t: torch.Tensor) -> torch.Tensor:
    """The same values in a view that starts one element into its storage."""
    base = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
    view = base[1:].view(t.shape)
    view.copy_(t)
    return view


# Buffers each kernel reads or writes with vector accesses (csrc/kernels/quantize_*.h).
VECTOR_BUFFERS = {
    "bnb_quantize_blockwise_": (0, 2), "bnb_dequantize_blockwise_": (0, 3),
    "bnb_quantize_4bit_": (0, 1), "bnb_dequantize_4bit_": (0, 2),
    # The optimizer kernels are told per buffer whether it is aligned (flags, bits checked in
    # tests/test_optimizer_kernels.py), so they take in-place views wherever they start.
    "bnb_optimizer_": (),
}  # fmt: skip


@pytest.mark.parametrize("name,label", CASES, ids=[f"{n}-{l}" for n, l in CASES])
def test_kernels_get_vector_aligned_buffers(name, label):
    """The kernels load and store with vectors: every tensor bound is 16-byte aligned, even when
    the caller's inputs and `out` are views that start mid-storage."""
    args = [misaligned(a) if isinstance(a, torch.Tensor) and a.dim() else a
            for a in to_meta(copy.deepcopy(dict(op_inputs.cases(name))[label]))]  # fmt: skip
    assert any(isinstance(a, torch.Tensor) and a.storage_offset() for a in args)
    recorder = RecordingExecutor()
    ops.call(ops.OPS[name], tuple(args), {}, recorder)
    for kernel, _, _, bound in recorder.launches:
        (vector_buffers,) = [v for prefix, v in VECTOR_BUFFERS.items() if kernel.startswith(prefix)]
        for i in vector_buffers:
            assert bound[i].byte_offset % 16 == 0, f"{kernel} buffer({i})"
