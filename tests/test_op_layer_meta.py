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


def data_dependent(name, args) -> bool:
    """Calls with an outlier-column list: its length is the one count the op reads on the host,
    which meta tensors cannot give (tests/test_kernels_int8.py checks them under FakeTensorMode)."""
    return name in ("int8_vectorwise_quant", "int8_double_quant") and args[1] > 0


CASES = [(name, label) for name in WITH_KERNELS for label, args in op_inputs.cases(name)
         if not data_dependent(name, args)]  # fmt: skip
# Ops with more than one launch: the two passes (row and column statistics, then both quantizations).
LAUNCHES = {"int8_double_quant": 2}
# bitsandbytes' fakes that cannot run on meta (int8_double_quant's always asks for a dynamic size)
# or declare other outputs (int8_mixed_scaled_mm's subA: int64 of dynamic size): compared with the
# shapes and dtypes of the CPU fallback's results instead.
NO_META_FAKE = {"int8_double_quant", "int8_mixed_scaled_mm"}


def to_meta(args):
    return [a.to("meta") if isinstance(a, torch.Tensor) else a for a in args]


def describe(result, device=None):
    if isinstance(result, (tuple, list)):
        return [describe(r, device) for r in result]
    if isinstance(result, torch.Tensor):
        return (tuple(result.shape), result.dtype, device or result.device.type)
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
    if name in NO_META_FAKE:
        from bnb_mps.ops import cpu_round_trip as cpu

        want = cpu.run(name, copy.deepcopy(dict(op_inputs.cases(name))[label]))
        assert describe(got) == describe(want, device="meta")
        return
    want = ops.op_packet(name)(*to_meta(args))  # bitsandbytes' fake implementation
    assert describe(got) == describe(want)


def expected_launches(name, label, args) -> int:
    """One launch per op; the 32-bit optimizer with update-norm clipping (max_unorm > 0) takes two
    (the norm pass, then the update), and those in LAUNCHES their listed count."""
    if label == "empty":
        return 0
    if name == "optimizer_update_32bit" and args[6] > 0:
        return 2
    return LAUNCHES.get(name, 1)


def misaligned(t: torch.Tensor) -> torch.Tensor:
    """The same values in a view that starts one element into its storage."""
    base = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
    view = base[1:].view(t.shape)
    view.copy_(t)
    return view


# Buffers each kernel reads or writes with vector accesses (csrc/kernels/quantize_*.h, int8*.h,
# gemm_4bit.h; the matmul kernels read A, buffer 0, with vectors only when their flags say it is
# aligned: tests/test_kernels_matmul_4bit.py checks that flag).
VECTOR_BUFFERS = {
    "bnb_quantize_blockwise_": (0, 2), "bnb_dequantize_blockwise_": (0, 3),
    "bnb_quantize_4bit_": (0, 1), "bnb_dequantize_4bit_": (0, 2),
    "bnb_gemv_4bit_": (1,), "bnb_gemm_4bit_": (1,),
    "bnb_int8_vectorwise_quant_": (0, 1), "bnb_int8_double_quant_stats_": (0,),
    "bnb_int8_double_quant_apply_": (0, 3, 4), "bnb_int8_vectorwise_dequant": (0, 2),
    "bnb_int8_mm_dequant_": (0, 4), "bnb_int8_linear_matmul_": (0, 1), "bnb_int8_scaled_mm_": (0, 1),
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
