"""8-bit blockwise quantization (docs/semantics.md section 2): argument checks and kernel launchers.

Planners (bnb_mps.ops.plan) allocate outputs once on the input's device and launch one kernel of
`csrc/kernels/quantize_8bit.metal` by host name, with the geometry documented there.
"""

from __future__ import annotations

import math

import torch

from ..kernel_args import uint32
from . import validation as v
from .launch import DTYPE_NAMES, aligned_arg, check_size, flat_arg, out_arg
from .plan import Plan, PlanBuilder
from .registry import checks, kernel_of, planner

# -- checks ---------------------------------------------------------------------------------------


def _covered_code(code) -> None:
    """The 8-bit code: the kernels take 256 float32 values; bitsandbytes' pure-PyTorch code (what
    serves these ops on mps without bnb_mps) takes a float code of any dtype and length."""
    v.covered_dtype("code", code, (torch.float32,), v.FLOATS)
    if code.numel() != 256:
        raise v.NotCovered(f"code of {code.numel()} values (the kernels take 256)")


@checks("quantize_blockwise")
def check_quantize_blockwise(A, code, blocksize) -> None:
    op = "quantize_blockwise"
    v.tensor(op, "A", A, dtypes=v.FLOATS)
    v.tensor(op, "code", code, dtypes=v.FLOATS)
    v.numel(op, "code", code, 1, at_least=True)
    v.blocksize(op, blocksize, None)
    v.same_device(op, A=A, code=code)
    v.covered_blocksize(blocksize, v.BLOCKSIZES_8BIT)
    _covered_code(code)


@checks("dequantize_blockwise")
def check_dequantize_blockwise(A, absmax, code, blocksize, dtype) -> None:
    op = "dequantize_blockwise"
    _check_dequantize(op, A, absmax, code, blocksize, dtype)
    _covered_dequantize(op, absmax, code, blocksize)


@checks("dequantize_blockwise.out")
def check_dequantize_blockwise_out(A, absmax, code, blocksize, dtype, out) -> None:
    op = "dequantize_blockwise.out"
    _check_dequantize(op, A, absmax, code, blocksize, dtype)
    v.tensor(op, "out", out, dtypes=(dtype,))
    v.shape(op, "out", out, A.shape)
    v.same_device(op, A=A, out=out)
    _covered_dequantize(op, absmax, code, blocksize)


def _check_dequantize(op, A, absmax, code, blocksize, dtype) -> None:
    v.tensor(op, "A", A, dtypes=(torch.uint8,))
    v.tensor(op, "absmax", absmax, dtypes=v.FLOATS)
    v.tensor(op, "code", code, dtypes=v.FLOATS)
    v.numel(op, "code", code, 1, at_least=True)
    v.blocksize(op, blocksize, None)
    v.dtype_arg(op, "dtype", dtype)
    v.numel(op, "absmax", absmax, v.blocks(A.numel(), blocksize), at_least=True)
    v.same_device(op, A=A, absmax=absmax, code=code)


def _covered_dequantize(op, absmax, code, blocksize) -> None:
    """After every check of a dequantize call: what the kernels do not cover (NotCovered)."""
    v.covered_blocksize(blocksize, v.BLOCKSIZES_8BIT)
    v.covered_dtype("absmax", absmax, (torch.float32,), v.FLOATS)
    _covered_code(code)


# -- kernels --------------------------------------------------------------------------------------

# Dequantize: threads per threadgroup and elements per threadgroup (8 per thread).
_DEQUANT_THREADS = 256
_DEQUANT_ELEMS_PER_TG = 256 * 8


# The 8-bit quantize kernel builds its 255 thresholds in threadgroup memory once per threadgroup;
# its grid is capped so that large tensors do not rebuild them per chunk: each threadgroup then
# loops over several chunks. 1024 threadgroups of 64-512 threads exceed what the largest Apple
# GPU keeps resident, so the cap costs no parallelism.
MAX_QUANTIZE8_THREADGROUPS = 1024


def quantize_geometry(n: int, blocksize: int, max_groups: int | None = None) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """(grid, threadgroup) of the blockwise quantize kernels (8-bit and 4-bit): 4 simdgroups of
    independent blocks (or of pairs of 32-element blocks) per threadgroup up to blocksize 256, one
    block per threadgroup of blocksize / 8 threads above; at most `max_groups` threadgroups."""
    if blocksize <= 256:
        threads, elems = 128, 4 * max(blocksize, 64)
    else:
        threads, elems = blocksize // 8, blocksize
    groups = math.ceil(n / elems)
    if max_groups is not None:
        groups = min(groups, max_groups)
    return (groups, 1, 1), (threads, 1, 1)


@planner("quantize_blockwise")
def plan_quantize_blockwise(A: torch.Tensor, code: torch.Tensor, blocksize: int) -> Plan:
    n = A.numel()
    check_size("quantize_blockwise", "A", n)
    b = PlanBuilder(A.device)
    out = b.output(A.shape, torch.uint8)
    absmax = b.output((math.ceil(n / blocksize),), torch.float32)
    if n > 0:
        grid, threadgroup = quantize_geometry(n, blocksize, MAX_QUANTIZE8_THREADGROUPS)
        b.launch(f"bnb_quantize_blockwise_{DTYPE_NAMES[A.dtype]}_{blocksize}", grid, threadgroup,
                 [aligned_arg(b, 0, A), flat_arg(b, 1, code), out, absmax, uint32(n)])  # fmt: skip
    return b.build(result=(out, absmax))


def _dequantize_launch(b: PlanBuilder, out, A, absmax, code, blocksize, dtype) -> None:
    n = A.numel()
    check_size(b.op, "A", n)
    if n == 0:
        return
    b.launch(
        f"bnb_dequantize_blockwise_{DTYPE_NAMES[dtype]}",
        (math.ceil(n / _DEQUANT_ELEMS_PER_TG), 1, 1),
        (_DEQUANT_THREADS, 1, 1),
        [aligned_arg(b, 0, A), flat_arg(b, 2, code), flat_arg(b, 1, absmax), out, uint32(n),
         uint32(blocksize.bit_length() - 1)],
    )  # fmt: skip


@planner("dequantize_blockwise")
def plan_dequantize_blockwise(A, absmax, code, blocksize, dtype) -> Plan:
    b = PlanBuilder(A.device, "dequantize_blockwise")
    out = b.output(A.shape, dtype)
    _dequantize_launch(b, out, A, absmax, code, blocksize, dtype)
    return b.build(result=out)


@planner("dequantize_blockwise.out")
def plan_dequantize_blockwise_out(A, absmax, code, blocksize, dtype, out) -> Plan:
    b = PlanBuilder(A.device, "dequantize_blockwise.out")
    _dequantize_launch(b, out_arg(b, 5, out), A, absmax, code, blocksize, dtype)
    return b.build()


quantize_blockwise = kernel_of("quantize_blockwise")
dequantize_blockwise = kernel_of("dequantize_blockwise")
dequantize_blockwise_out = kernel_of("dequantize_blockwise.out")
