"""Kernel launchers for blockwise 8-bit and 4-bit NF4/FP4 quantization (SPEC.md sections 2-3).

Each function receives an executor and the op's arguments (already checked by `blockwise` /
`fourbit`), allocates the outputs once on the input's device, and launches one kernel of
`csrc/kernels/quantize_8bit.metal` / `quantize_4bit.metal` by host name. The geometry below is
the one documented at the top of those files. Nothing here reads tensor data on the host.
"""

from __future__ import annotations

import math

import torch

from ..kernel_args import uint32
from . import blockwise, fourbit  # noqa: F401  (the ops' checks are declared there)
from .registry import kernel

# Kernel index arithmetic is 32-bit and a block start plus one block must not wrap around.
MAX_ELEMENTS = 2**32 - 8192

DTYPE_NAMES = {torch.float16: "f16", torch.bfloat16: "bf16", torch.float32: "f32"}

# Dequantize kernels: threads per threadgroup and elements (8-bit) / bytes (4-bit) per threadgroup.
_DEQUANT_THREADS = 256
_DEQUANT8_ELEMS_PER_TG = 256 * 8
_DEQUANT4_BYTES_PER_TG = 256 * 4


def _check_size(op: str, name: str, n: int) -> None:
    if n >= MAX_ELEMENTS:
        raise ValueError(f"{op}: {name} has {n} elements; the Metal kernels take fewer than {MAX_ELEMENTS}")


def quantize_geometry(n: int, blocksize: int) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """(grid, threadgroup) of the quantize kernels: 4 simdgroups of independent blocks (or of
    pairs of 32-element blocks) per threadgroup up to blocksize 256, one block per threadgroup
    of blocksize / 8 threads above."""
    if blocksize <= 256:
        threads, elems = 128, 4 * max(blocksize, 64)
    else:
        threads, elems = blocksize // 8, blocksize
    return (math.ceil(n / elems), 1, 1), (threads, 1, 1)


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1)


# The kernels access A, packed data and outputs with vector loads and stores, which need their
# natural alignment (up to 16 bytes). Storages start aligned; a view may not.
_VECTOR_ALIGN = 16


def _is_aligned(t: torch.Tensor) -> bool:
    return (t.storage_offset() * t.element_size()) % _VECTOR_ALIGN == 0


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """`t` flat and contiguous at a 16-byte aligned offset (copied only when it is not)."""
    t = _flat(t)
    return t if _is_aligned(t) else t.clone()


# -- 8-bit ----------------------------------------------------------------------------------------


@kernel("quantize_blockwise")
def quantize_blockwise(executor, A: torch.Tensor, code: torch.Tensor, blocksize: int):
    n = A.numel()
    _check_size("quantize_blockwise", "A", n)
    out = torch.empty(A.shape, dtype=torch.uint8, device=A.device)
    absmax = torch.empty(math.ceil(n / blocksize), dtype=torch.float32, device=A.device)
    if n == 0:
        return out, absmax
    grid, threadgroup = quantize_geometry(n, blocksize)
    executor.launch(
        f"bnb_quantize_blockwise_{DTYPE_NAMES[A.dtype]}_{blocksize}",
        grid=grid,
        threadgroup=threadgroup,
        args=[_aligned(A), _flat(code), out, absmax, uint32(n)],
    )
    return out, absmax


def _dequantize_blockwise_into(executor, out, A, absmax, code, blocksize) -> None:
    n = A.numel()
    _check_size("dequantize_blockwise", "A", n)
    if n == 0:
        return
    executor.launch(
        f"bnb_dequantize_blockwise_{DTYPE_NAMES[out.dtype]}",
        grid=(math.ceil(n / _DEQUANT8_ELEMS_PER_TG), 1, 1),
        threadgroup=(_DEQUANT_THREADS, 1, 1),
        args=[_aligned(A), _flat(code), _flat(absmax), out, uint32(n), uint32(blocksize)],
    )


@kernel("dequantize_blockwise")
def dequantize_blockwise(executor, A, absmax, code, blocksize, dtype):
    out = torch.empty(A.shape, dtype=dtype, device=A.device)
    _dequantize_blockwise_into(executor, out, A, absmax, code, blocksize)
    return out


@kernel("dequantize_blockwise.out")
def dequantize_blockwise_out(executor, A, absmax, code, blocksize, dtype, out) -> None:
    _into(out, lambda target: _dequantize_blockwise_into(executor, target, A, absmax, code, blocksize))


def _into(out: torch.Tensor, fill) -> None:
    """Runs `fill(target)` with a contiguous, aligned target: `out` itself when it is one."""
    if out.is_contiguous() and _is_aligned(out):
        fill(out)
    else:
        tmp = torch.empty(out.shape, dtype=out.dtype, device=out.device)
        fill(tmp)
        out.copy_(tmp)


# -- 4-bit ----------------------------------------------------------------------------------------


def packed_shape(n: int, quant_storage: torch.dtype) -> tuple[int, int]:
    """bitsandbytes' shape of the packed tensor: ((n + 1) // (2 * itemsize), 1)."""
    return ((n + 1) // (2 * quant_storage.itemsize), 1)


@kernel("quantize_4bit")
def quantize_4bit(executor, A, blocksize, quant_type, quant_storage):
    n = A.numel()
    _check_size("quantize_4bit", "A", n)
    nbytes = (n + 1) // 2
    rows, _ = packed_shape(n, quant_storage)
    itemsize = quant_storage.itemsize
    # The kernel writes all ceil(n / 2) bytes; when that is not a multiple of the storage item
    # size, bitsandbytes' shape drops the last partial item, so the buffer is rounded up and the
    # result is a view of its first rows items.
    storage = torch.empty(nbytes + (-nbytes) % itemsize, dtype=torch.uint8, device=A.device)
    absmax = torch.empty(math.ceil(n / blocksize), dtype=torch.float32, device=A.device)
    if n > 0:
        grid, threadgroup = quantize_geometry(n, blocksize)
        executor.launch(
            f"bnb_quantize_4bit_{quant_type}_{DTYPE_NAMES[A.dtype]}_{blocksize}",
            grid=grid,
            threadgroup=threadgroup,
            args=[_aligned(A), storage, absmax, uint32(n)],
        )
    packed = storage.view(quant_storage)[:rows].reshape(rows, 1)
    return packed, absmax


def _dequantize_4bit_into(executor, out, A, absmax, blocksize, quant_type) -> None:
    n = out.numel()
    _check_size("dequantize_4bit", "shape", n)
    if n == 0:
        return
    nbytes = (n + 1) // 2
    executor.launch(
        f"bnb_dequantize_4bit_{quant_type}_{DTYPE_NAMES[out.dtype]}",
        grid=(math.ceil(nbytes / _DEQUANT4_BYTES_PER_TG), 1, 1),
        threadgroup=(_DEQUANT_THREADS, 1, 1),
        args=[_aligned(A).view(torch.uint8), _flat(absmax), out, uint32(n), uint32(blocksize)],
    )


@kernel("dequantize_4bit")
def dequantize_4bit(executor, A, absmax, blocksize, quant_type, shape, dtype):
    out = torch.empty(tuple(shape), dtype=dtype, device=A.device)
    _dequantize_4bit_into(executor, out, A, absmax, blocksize, quant_type)
    return out


@kernel("dequantize_4bit.out")
def dequantize_4bit_out(executor, A, absmax, blocksize, quant_type, shape, dtype, out) -> None:
    _into(out, lambda target: _dequantize_4bit_into(executor, target, A, absmax, blocksize, quant_type))
