"""4-bit NF4/FP4 matrix products, gemv_4bit and gemm_4bit (docs/semantics.md section 4): argument checks and
kernel launchers (csrc/kernels/gemm_4bit.metal).
"""

from __future__ import annotations

import math

import torch

from ..kernel_args import uint32
from . import validation as v
from .fourbit import dequantize_4bit_cpu, packed_bytes
from .launch import DTYPE_NAMES, VECTOR_ALIGN, aligned, check_size, flat, into, is_aligned
from .registry import checks, composite, kernel

# What bitsandbytes' gemv/gemm schemas accept for B (read as bytes).
GEMM_STORAGE_DTYPES = (torch.uint8, torch.bfloat16, torch.float16, torch.float32)


def _check_matmul(op, A, B, shapeB, absmax, blocksize) -> None:
    v.tensor(op, "A", A, dtypes=v.FLOATS, min_ndim=1)
    v.tensor(op, "B", B, dtypes=GEMM_STORAGE_DTYPES)
    v.int_list(op, "shapeB", shapeB)
    if len(shapeB) != 2:
        raise ValueError(f"{op}: shapeB must be [N, K] (2 sizes), got {list(shapeB)}")
    if A.shape[-1] != shapeB[1]:
        raise ValueError(f"{op}: A's last dimension ({A.shape[-1]}) must equal shapeB[1] = K ({shapeB[1]})")
    v.blocksize(op, blocksize, v.BLOCKSIZES_4BIT)
    v.tensor(op, "absmax", absmax, dtypes=(torch.float32,))
    packed_bytes(op, "B", B, shapeB[0] * shapeB[1])


@checks("gemv_4bit")
def check_gemv_4bit(A, B, shapeB, absmax, code, blocksize) -> None:
    _check_gemv("gemv_4bit", A, B, shapeB, absmax, code, blocksize)


@checks("gemv_4bit.out")
def check_gemv_4bit_out(A, B, shapeB, absmax, code, blocksize, out) -> None:
    op = "gemv_4bit.out"
    _check_gemv(op, A, B, shapeB, absmax, code, blocksize)
    v.tensor(op, "out", out, dtypes=(A.dtype,))
    v.shape(op, "out", out, (*A.shape[:-1], shapeB[0]))
    v.same_device(op, A=A, out=out)


def _check_gemv(op, A, B, shapeB, absmax, code, blocksize) -> None:
    _check_matmul(op, A, B, shapeB, absmax, blocksize)
    v.tensor(op, "code", code, dtypes=(torch.float32,))
    v.numel(op, "code", code, 16)
    v.numel(op, "absmax", absmax, v.blocks(shapeB[0] * shapeB[1], blocksize), at_least=True)
    v.same_device(op, A=A, B=B, absmax=absmax, code=code)


@checks("gemm_4bit")
def check_gemm_4bit(
    A, B, shapeB, absmax, blocksize, quant_type, bias=None, absmax_8bit=None, absmax_code=None, absmax_offset=None
) -> None:
    op = "gemm_4bit"
    _check_matmul(op, A, B, shapeB, absmax, blocksize)
    v.quant_type(op, quant_type)
    nblocks = v.blocks(shapeB[0] * shapeB[1], blocksize)
    if absmax_8bit is None:
        if absmax_code is not None or absmax_offset is not None:
            raise ValueError(f"{op}: absmax_code and absmax_offset are only used together with absmax_8bit")
        v.numel(op, "absmax", absmax, nblocks, at_least=True)
    else:
        # Nested (double) quantization: absmax holds the per-256-block scales of absmax_8bit.
        v.tensor(op, "absmax_8bit", absmax_8bit, dtypes=(torch.uint8,), ndim=1)
        v.numel(op, "absmax_8bit", absmax_8bit, nblocks, at_least=True)
        v.tensor(op, "absmax_code", absmax_code, dtypes=(torch.float32,), ndim=1)
        v.numel(op, "absmax_code", absmax_code, 256)
        v.tensor(op, "absmax_offset", absmax_offset, dtypes=v.FLOATS)
        v.numel(op, "absmax_offset", absmax_offset, 1)
        v.numel(op, "absmax", absmax, v.blocks(nblocks, 256), at_least=True)
    if bias is not None:
        v.tensor(op, "bias", bias, dtypes=(A.dtype,), ndim=1)
        v.numel(op, "bias", bias, shapeB[0])
    v.same_device(
        op, A=A, B=B, absmax=absmax, bias=bias, absmax_8bit=absmax_8bit, absmax_code=absmax_code,
        absmax_offset=absmax_offset,
    )  # fmt: skip


# -- kernels --------------------------------------------------------------------------------------
#
# One launch per call, of one of three kernels of csrc/kernels/gemm_4bit.metal, chosen from the
# shapes alone (M = rows of A, N = rows of the weight, K = its columns):
#
#   gemv   M <= GEMV_MAX_M            decode: bandwidth-bound, one pass over the weight with the
#                                     activations in registers (the MLX qmv_fast design)
#   batch  M <= SMALL_BATCH_MAX_M     a few rows of A: the same single pass over the weight, each
#                                     weight chunk decoded once and used for every row of A (up to 8
#                                     per threadgroup; rows past M cost nothing but registers)
#   mma    larger M                   prefill / training: simdgroup_matrix tiles, the weight tile
#                                     dequantized into threadgroup memory once per 32 rows of A
#
# Why these switch points: at M = 1 the product is a pure stream over the weight (2 flops per 4-bit
# weight); the gemv kernel keeps the activations in registers and issues 16-byte weight loads with
# no barrier. Up to 8 rows the batch kernel still reads the weight once (the extra rows only add
# arithmetic on values already in registers, and rows past M are skipped), while the mma kernel
# would spend 32-row tiles on at most 8 rows and pay two threadgroup barriers per K step. Above 8
# rows the arithmetic (2*M*N*K) outgrows what scalar FMAs keep up with and the 8x8 matrix units
# take over. The gemv kernel needs K % 32 == 0 and the batch kernel K % 16 == 0 (chunks of 32 / 16
# nibbles per lane): M = 1 with K % 32 == 16 takes the batch kernel, and K % 16 != 0 (no real
# model has it) the mma kernel, the only one that addresses nibbles one by one. The constants are
# module attributes so that a benchmark on a Mac can move them; nothing here looks at tensor data.
GEMV_MAX_M = 1
SMALL_BATCH_MAX_M = 8

#: where the gemv kernel reads the 16-entry table: "constant" (constant memory, the default) or
#: "threadgroup" (copied into threadgroup memory first); both are kept for measuring on a Mac.
GEMV_TABLE = "constant"

# Nibbles per lane per step of the gemv and batch kernels: they need K to be a multiple of it.
_GEMV_CHUNK, _BATCH_CHUNK = 32, 16
_ROWS_PER_TG = 8  # weight rows per threadgroup in the gemv / batch kernels
_BATCH_M = 8  # rows of A per threadgroup in the batch kernel
_MMA_BM, _MMA_BN = 32, 64  # output tile of the mma kernel (rows of A x rows of W)

_TABLES = {"code": 0, "nf4": 1, "fp4": 2}
_OFFSET_KINDS = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
_FLAG_BIAS, _FLAG_AVEC = 1, 2


def choose_path(M: int, N: int, K: int) -> str:
    """The kernel for an [M, K] x [N, K]^T product: "gemv", "batch" or "mma" (shapes only)."""
    if M <= GEMV_MAX_M and K % _GEMV_CHUNK == 0:
        return "gemv"
    if M <= SMALL_BATCH_MAX_M and K % _BATCH_CHUNK == 0:
        return "batch"
    return "mma"


def _rows(A: torch.Tensor) -> torch.Tensor:
    """A as an [M, K] view with unit column stride (copied only when no such view exists)."""
    K = A.shape[-1]
    try:
        A2 = A.view(-1, K)
    except RuntimeError:  # leading dimensions that do not collapse into one stride
        A2 = A.reshape(-1, K).contiguous()
    if K > 1 and A2.stride(1) != 1:
        A2 = A2.contiguous()
    return A2


def _bind_rows(A2: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(tensor to bind, row stride in elements) for an [M, K] view with unit column stride.

    A strided view is bound as the one-dimensional span of storage its rows cover, so that every
    executor (including one that stages tensors through another device) sees exactly the bytes
    the kernel indexes."""
    M, K = A2.shape
    if M <= 1 or A2.is_contiguous():
        return A2.reshape(-1), K
    lda = A2.stride(0)
    return A2.as_strided(((M - 1) * lda + K,), (1,)), lda


def _matmul_into(executor, op, out, A, B, shapeB, absmax, blocksize, table, code, bias, absmax_8bit,
                 absmax_code, absmax_offset) -> None:  # fmt: skip
    """out[..., N] = A @ dequant(B).T (+ bias): one kernel launch (none for empty products)."""
    N, K = shapeB
    M = math.prod(A.shape[:-1])
    if M == 0 or N == 0:
        return
    if K == 0:  # an empty sum: only the bias (never the case for a real layer)
        out.copy_(bias.expand_as(out) if bias is not None else torch.zeros_like(out))
        return
    A2 = _rows(A)
    A_bound, lda = _bind_rows(A2)
    check_size(op, "A", A_bound.numel())
    A_aligned = is_aligned(A_bound) and (lda * A.element_size()) % VECTOR_ALIGN == 0
    flags = (_FLAG_BIAS if bias is not None else 0) | (_FLAG_AVEC if A_aligned else 0)

    scales = flat(absmax)
    nested = absmax_8bit is not None
    if nested:
        q8, code8 = flat(absmax_8bit), flat(absmax_code)
        offset = absmax_offset.reshape(1).view(torch.uint8)
        offset_kind = _OFFSET_KINDS[absmax_offset.dtype]
    else:
        q8 = code8 = offset = scales  # bound, never read
        offset_kind = 0
    path = choose_path(M, N, K)
    dt = DTYPE_NAMES[A.dtype]
    sc = "nested" if nested else "absmax"
    if path == "gemv":
        variant = "_tglut" if GEMV_TABLE == "threadgroup" else ""
        name = f"bnb_gemv_4bit{variant}_{sc}_{dt}"
        grid, threads = (math.ceil(N / _ROWS_PER_TG), M, 1), (64, 1, 1)
    elif path == "batch":
        name = f"bnb_gemm_4bit_batch_{sc}_{dt}"
        grid, threads = (math.ceil(N / _ROWS_PER_TG), math.ceil(M / _BATCH_M), 1), (128, 1, 1)
    else:
        name = f"bnb_gemm_4bit_mma_{sc}_{dt}"
        grid, threads = (math.ceil(M / _MMA_BM), math.ceil(N / _MMA_BN), 1), (128, 1, 1)
    executor.launch(
        name,
        grid=grid,
        threadgroup=threads,
        args=[
            A_bound, aligned(B).view(torch.uint8), scales, q8, code8, offset,
            _constant_buffer(code) if code is not None else scales,
            flat(bias) if bias is not None else scales,
            out,
            uint32(M), uint32(N), uint32(K), uint32(lda), uint32(blocksize.bit_length() - 1),
            uint32(_TABLES[table]), uint32(offset_kind), uint32(flags),
        ],
    )  # fmt: skip


# Metal wants buffers of the constant address space at offsets aligned to the GPU family's minimum
# (4 bytes on Apple GPUs, 256 on the Mac2 family): a 16-entry table at another offset is copied.
_CONSTANT_ALIGN = 256


def _constant_buffer(code: torch.Tensor) -> torch.Tensor:
    code = flat(code)
    return code if (code.storage_offset() * code.element_size()) % _CONSTANT_ALIGN == 0 else code.clone()


def _output(op: str, A: torch.Tensor, shapeB) -> torch.Tensor:
    """The output [*A.shape[:-1], N], allocated once the sizes are known to fit 32-bit indexing."""
    N, K = shapeB
    check_size(op, "shapeB", N * K)
    check_size(op, "the output", math.prod(A.shape[:-1]) * N)
    check_size(op, "A", A.numel())
    return torch.empty((*A.shape[:-1], N), dtype=A.dtype, device=A.device)


@kernel("gemm_4bit")
def gemm_4bit(executor, A, B, shapeB, absmax, blocksize, quant_type, bias=None, absmax_8bit=None, absmax_code=None,
              absmax_offset=None):  # fmt: skip
    out = _output("gemm_4bit", A, shapeB)
    _matmul_into(executor, "gemm_4bit", out, A, B, shapeB, absmax, blocksize, quant_type, None, bias, absmax_8bit,
                 absmax_code, absmax_offset)  # fmt: skip
    return out


@kernel("gemv_4bit")
def gemv_4bit(executor, A, B, shapeB, absmax, code, blocksize):
    out = _output("gemv_4bit", A, shapeB)
    _matmul_into(executor, "gemv_4bit", out, A, B, shapeB, absmax, blocksize, "code", code, None, None, None, None)
    return out


@kernel("gemv_4bit.out")
def gemv_4bit_out(executor, A, B, shapeB, absmax, code, blocksize, out) -> None:
    def fill(target):
        _matmul_into(executor, "gemv_4bit.out", target, A, B, shapeB, absmax, blocksize, "code", code, None, None,
                     None, None)  # fmt: skip

    N, K = shapeB
    check_size("gemv_4bit.out", "shapeB", N * K)
    check_size("gemv_4bit.out", "out", out.numel())
    # The kernels store the output element by element: any contiguous `out` is written in place
    # (whatever its alignment); other layouts go through a contiguous temporary.
    if out.is_contiguous():
        fill(out)
    else:
        into(out, fill)


# -- the CPU fallback's composition ------------------------------------------------------------------
#
# docs/semantics.md section 4 on the CPU: the weight dequantized to float32, a float32 product (bias
# added in float32), rounded once to A's dtype. Not bitsandbytes' CPU kernels: on CPUs with
# AVX512-BF16, bitsandbytes 0.50.2 registers a CPU gemv_4bit that reads the weight in its own packed
# CPU layout (the one Linear4bit converts weights to on such CPUs), so it returns wrong values for the
# standard layout these ops take; its CPU gemm_4bit dequantizes through the path dequantize_4bit_cpu
# avoids; and its pure-PyTorch path multiplies in A's dtype, whose accumulation on the CPU depends on
# the CPU's kernels.


def _linear_float32(A, W, bias):
    out = torch.nn.functional.linear(A.float(), W, None if bias is None else bias.float())
    return out.to(A.dtype)


@composite("gemv_4bit")
def gemv_4bit_cpu(A, B, shapeB, absmax, code, blocksize):
    quant_type = "fp4" if code[1] > 0 else "nf4"  # as bitsandbytes' default kernel tells them apart
    return _linear_float32(A, dequantize_4bit_cpu(B, absmax, blocksize, quant_type, shapeB, torch.float32), None)


@composite("gemm_4bit")
def gemm_4bit_cpu(A, B, shapeB, absmax, blocksize, quant_type, bias=None, absmax_8bit=None, absmax_code=None,
                  absmax_offset=None):  # fmt: skip
    if absmax_8bit is not None:  # nested: scale_b = absmax_code[absmax_8bit[b]] * absmax[b // 256] + offset
        codes = torch.ops.bitsandbytes.dequantize_blockwise.default
        absmax = codes(absmax_8bit, absmax, absmax_code, 256, torch.float32) + absmax_offset.float()
    W = dequantize_4bit_cpu(B, absmax, blocksize, quant_type, shapeB, torch.float32)
    return _linear_float32(A, W, bias)
