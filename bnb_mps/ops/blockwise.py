"""8-bit blockwise quantization (docs/semantics.md section 2): argument checks and kernel launchers.

Launchers allocate outputs once on the input's device and launch one kernel of
`csrc/kernels/quantize_8bit.metal` by host name, with the geometry documented there.
"""

from __future__ import annotations

import math

import torch

from ..kernel_args import uint32
from . import validation as v
from .launch import DTYPE_NAMES, aligned, check_size, flat, into
from .registry import checks, kernel

# -- checks ---------------------------------------------------------------------------------------


def _code(op: str, code) -> None:
    v.tensor(op, "code", code, dtypes=(torch.float32,))
    v.numel(op, "code", code, 256)


@checks("quantize_blockwise")
def check_quantize_blockwise(A, code, blocksize) -> None:
    op = "quantize_blockwise"
    v.tensor(op, "A", A, dtypes=v.FLOATS)
    _code(op, code)
    v.blocksize(op, blocksize, v.BLOCKSIZES_8BIT)
    v.same_device(op, A=A, code=code)


@checks("dequantize_blockwise")
def check_dequantize_blockwise(A, absmax, code, blocksize, dtype) -> None:
    _check_dequantize("dequantize_blockwise", A, absmax, code, blocksize, dtype)


@checks("dequantize_blockwise.out")
def check_dequantize_blockwise_out(A, absmax, code, blocksize, dtype, out) -> None:
    op = "dequantize_blockwise.out"
    _check_dequantize(op, A, absmax, code, blocksize, dtype)
    v.tensor(op, "out", out, dtypes=(dtype,))
    v.shape(op, "out", out, A.shape)
    v.same_device(op, A=A, out=out)


def _check_dequantize(op, A, absmax, code, blocksize, dtype) -> None:
    v.tensor(op, "A", A, dtypes=(torch.uint8,))
    v.tensor(op, "absmax", absmax, dtypes=(torch.float32,))
    _code(op, code)
    v.blocksize(op, blocksize, v.BLOCKSIZES_8BIT)
    v.dtype_arg(op, "dtype", dtype)
    v.numel(op, "absmax", absmax, v.blocks(A.numel(), blocksize), at_least=True)
    v.same_device(op, A=A, absmax=absmax, code=code)


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


@kernel("quantize_blockwise")
def quantize_blockwise(executor, A: torch.Tensor, code: torch.Tensor, blocksize: int):
    n = A.numel()
    check_size("quantize_blockwise", "A", n)
    out = torch.empty(A.shape, dtype=torch.uint8, device=A.device)
    absmax = torch.empty(math.ceil(n / blocksize), dtype=torch.float32, device=A.device)
    if n == 0:
        return out, absmax
    grid, threadgroup = quantize_geometry(n, blocksize, MAX_QUANTIZE8_THREADGROUPS)
    executor.launch(
        f"bnb_quantize_blockwise_{DTYPE_NAMES[A.dtype]}_{blocksize}",
        grid=grid,
        threadgroup=threadgroup,
        args=[aligned(A), flat(code), out, absmax, uint32(n)],
    )
    return out, absmax


def _dequantize_into(executor, out, A, absmax, code, blocksize) -> None:
    n = A.numel()
    if n == 0:
        return
    executor.launch(
        f"bnb_dequantize_blockwise_{DTYPE_NAMES[out.dtype]}",
        grid=(math.ceil(n / _DEQUANT_ELEMS_PER_TG), 1, 1),
        threadgroup=(_DEQUANT_THREADS, 1, 1),
        args=[aligned(A), flat(code), flat(absmax), out, uint32(n), uint32(blocksize.bit_length() - 1)],
    )


@kernel("dequantize_blockwise")
def dequantize_blockwise(executor, A, absmax, code, blocksize, dtype):
    check_size("dequantize_blockwise", "A", A.numel())
    out = torch.empty(A.shape, dtype=dtype, device=A.device)
    _dequantize_into(executor, out, A, absmax, code, blocksize)
    return out


@kernel("dequantize_blockwise.out")
def dequantize_blockwise_out(executor, A, absmax, code, blocksize, dtype, out) -> None:
    check_size("dequantize_blockwise.out", "A", A.numel())
    into(out, lambda target: _dequantize_into(executor, target, A, absmax, code, blocksize))
