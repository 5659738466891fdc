"""4-bit NF4/FP4 quantization (docs/semantics.md section 3): argument checks and kernel launchers.

Planners (bnb_mps.ops.plan) allocate outputs once on the input's device and launch one kernel of
`csrc/kernels/quantize_4bit.metal` by host name, with the geometry documented there.
"""

from __future__ import annotations

import math

import torch

from ..kernel_args import uint32
from . import validation as v
from .blockwise import quantize_geometry
from .launch import DTYPE_NAMES, aligned_arg, check_size, flat_arg, out_arg
from .plan import Plan, PlanBuilder
from .registry import checks, composite, kernel_of, planner

# Packed 4-bit data may be stored in any of these dtypes (Params4bit's quant_storage); it is read as bytes.
STORAGE_DTYPES = (
    torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
    torch.float16, torch.bfloat16, torch.float32, torch.float64,
)  # fmt: skip

# bitsandbytes reads packed data of any dtype as its bytes (`A.view(torch.uint8)`), and its pure-PyTorch
# quantize (what serves mps without bnb_mps) views the packed bytes as any quant_storage.
ALL_DTYPES = tuple(d for d in vars(torch).values() if isinstance(d, torch.dtype))


def covered_storage(name: str, dtype: torch.dtype) -> None:
    if dtype not in STORAGE_DTYPES:
        raise v.NotCovered(f"{name} {dtype} (the kernels take {', '.join(str(d) for d in STORAGE_DTYPES)})")


# -- checks ---------------------------------------------------------------------------------------


@checks("quantize_4bit")
def check_quantize_4bit(A, blocksize, quant_type, quant_storage) -> None:
    op = "quantize_4bit"
    v.tensor(op, "A", A, dtypes=v.FLOATS)
    v.blocksize(op, blocksize, v.BLOCKSIZES_4BIT)
    v.quant_type(op, quant_type)
    v.dtype_arg(op, "quant_storage", quant_storage, ALL_DTYPES)
    covered_storage("quant_storage", quant_storage)


@checks("dequantize_4bit")
def check_dequantize_4bit(A, absmax, blocksize, quant_type, shape, dtype) -> None:
    _check_dequantize("dequantize_4bit", A, absmax, blocksize, quant_type, shape, dtype)
    covered_storage("A", A.dtype)


@checks("dequantize_4bit.out")
def check_dequantize_4bit_out(A, absmax, blocksize, quant_type, shape, dtype, out) -> None:
    op = "dequantize_4bit.out"
    _check_dequantize(op, A, absmax, blocksize, quant_type, shape, dtype)
    v.tensor(op, "out", out, dtypes=(dtype,))
    v.shape(op, "out", out, shape)
    v.same_device(op, A=A, out=out)
    covered_storage("A", A.dtype)


def _check_dequantize(op, A, absmax, blocksize, quant_type, shape, dtype) -> None:
    v.tensor(op, "A", A)
    v.tensor(op, "absmax", absmax, dtypes=(torch.float32,))
    v.blocksize(op, blocksize, v.BLOCKSIZES_4BIT)
    v.quant_type(op, quant_type)
    v.int_list(op, "shape", shape)
    v.dtype_arg(op, "dtype", dtype)
    n = math.prod(shape)
    packed_bytes(op, "A", A, n)
    v.numel(op, "absmax", absmax, v.blocks(n, blocksize), at_least=True)
    v.same_device(op, A=A, absmax=absmax)


def packed_bytes(op, name, packed, n) -> None:
    """`packed` holds at least the ceil(n / 2) bytes of n packed 4-bit values."""
    need = (n + 1) // 2
    if v.nbytes(packed) < need:
        raise ValueError(
            f"{op}: {name} holds {v.nbytes(packed)} bytes of packed 4-bit data, but {n} elements need {need}"
        )


# -- kernels --------------------------------------------------------------------------------------

# Dequantize: threads per threadgroup and packed bytes per threadgroup (4 per thread).
_DEQUANT_THREADS = 256
_DEQUANT_BYTES_PER_TG = 256 * 4


def packed_shape(n: int, quant_storage: torch.dtype) -> tuple[int, int]:
    """bitsandbytes' shape of the packed tensor: ((n + 1) // (2 * itemsize), 1)."""
    return ((n + 1) // (2 * quant_storage.itemsize), 1)


@planner("quantize_4bit")
def plan_quantize_4bit(A, blocksize, quant_type, quant_storage) -> Plan:
    n = A.numel()
    check_size("quantize_4bit", "A", n)
    nbytes = (n + 1) // 2
    rows, _ = packed_shape(n, quant_storage)
    # The kernel writes all ceil(n / 2) bytes; when that is not a multiple of the storage item
    # size, bitsandbytes' shape drops the last partial item, so the buffer is rounded up and the
    # result is a view of its first rows items.
    stored = -(-nbytes // quant_storage.itemsize)
    b = PlanBuilder(A.device, "quantize_4bit")
    packed = b.output((stored, 1), quant_storage)
    absmax = b.output((math.ceil(n / blocksize),), torch.float32)
    if n > 0:
        grid, threadgroup = quantize_geometry(n, blocksize)
        b.launch(f"bnb_quantize_4bit_{quant_type}_{DTYPE_NAMES[A.dtype]}_{blocksize}", grid, threadgroup,
                 [aligned_arg(b, 0, A), packed, absmax, uint32(n)])  # fmt: skip
    if stored == rows:
        return b.build(result=(packed, absmax))
    return b.build(result=lambda outs: (outs[0][:rows], outs[1]))


def _dequantize_launch(b: PlanBuilder, out, A, absmax, blocksize, quant_type, shape, dtype) -> None:
    n = math.prod(shape)
    check_size(b.op, "shape", n)
    if n == 0:
        return
    nbytes = (n + 1) // 2
    b.launch(
        f"bnb_dequantize_4bit_{quant_type}_{DTYPE_NAMES[dtype]}",
        (math.ceil(nbytes / _DEQUANT_BYTES_PER_TG), 1, 1),
        (_DEQUANT_THREADS, 1, 1),
        [aligned_arg(b, 0, A), flat_arg(b, 1, absmax), out, uint32(n), uint32(blocksize.bit_length() - 1)],
    )


@planner("dequantize_4bit")
def plan_dequantize_4bit(A, absmax, blocksize, quant_type, shape, dtype) -> Plan:
    b = PlanBuilder(A.device, "dequantize_4bit")
    check_size(b.op, "shape", math.prod(shape))
    out = b.output(shape, dtype)
    _dequantize_launch(b, out, A, absmax, blocksize, quant_type, shape, dtype)
    return b.build(result=out)


@planner("dequantize_4bit.out")
def plan_dequantize_4bit_out(A, absmax, blocksize, quant_type, shape, dtype, out) -> Plan:
    b = PlanBuilder(A.device, "dequantize_4bit.out")
    _dequantize_launch(b, out_arg(b, 6, out), A, absmax, blocksize, quant_type, shape, dtype)
    return b.build()


quantize_4bit = kernel_of("quantize_4bit")
dequantize_4bit = kernel_of("dequantize_4bit")
dequantize_4bit_out = kernel_of("dequantize_4bit.out")


# -- the CPU fallback's composition ------------------------------------------------------------------


@composite("dequantize_4bit")
def dequantize_4bit_cpu(A, absmax, blocksize, quant_type, shape, dtype):
    """bitsandbytes' CPU dequantize_4bit, asked for one flat run of prod(shape) values, then reshaped.

    Asked for `shape` itself, bitsandbytes 0.50.2 takes a vectorised path on CPUs with AVX-512F
    when the last dimension is a multiple of 16, and that path looks up each row's block scales as
    if rows started new blocks: wrong when a row's length is not a multiple of the block size
    (blocks are flat runs, docs/semantics.md section 3). With a single row its every path indexes
    the blocks as docs/semantics.md does, so the result is the same on every CPU.
    """
    out = torch.ops.bitsandbytes.dequantize_4bit.default(A, absmax, blocksize, quant_type, [math.prod(shape)], dtype)
    return out.reshape(tuple(shape))
