"""4-bit NF4/FP4 matrix products, gemv_4bit and gemm_4bit (docs/semantics.md section 4): argument checks and
kernel launchers (csrc/kernels/gemm_4bit.metal).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Optional

import torch

from ..kernel_args import uint32
from . import small_batch
from . import validation as v
from . import workspace
from .fourbit import dequantize_4bit_cpu, packed_bytes
from .launch import DTYPE_NAMES, VECTOR_ALIGN, aligned_arg, check_size, flat_arg, is_aligned, out_arg
from .plan import Plan, PlanBuilder
from .registry import checks, composite, kernel_of, planner
from .small_batch import _SMALL_ROWS_PER_TG, _SPLITK_ALIGN, splitk_splits, splitk_threadgroups

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
    packed_bytes(op, "B", B, shapeB[0] * shapeB[1])


@checks("gemv_4bit")
def check_gemv_4bit(A, B, shapeB, absmax, code, blocksize) -> None:
    _check_gemv("gemv_4bit", A, B, shapeB, absmax, code, blocksize)
    _covered_gemv(absmax, code)


@checks("gemv_4bit.out")
def check_gemv_4bit_out(A, B, shapeB, absmax, code, blocksize, out) -> None:
    op = "gemv_4bit.out"
    _check_gemv(op, A, B, shapeB, absmax, code, blocksize)
    v.tensor(op, "out", out, dtypes=(A.dtype,))
    v.shape(op, "out", out, (*A.shape[:-1], shapeB[0]))
    v.same_device(op, A=A, out=out)
    _covered_gemv(absmax, code)


def _check_gemv(op, A, B, shapeB, absmax, code, blocksize) -> None:
    # bitsandbytes' pure-PyTorch gemv (what serves mps without bnb_mps) takes absmax and code of any
    # float dtype and reads only code[1] (its sign tells FP4 from NF4): the kernels take float32 and
    # the 16 values (_covered_gemv)
    _check_matmul(op, A, B, shapeB, absmax, blocksize)
    v.tensor(op, "absmax", absmax, dtypes=v.FLOATS)
    v.tensor(op, "code", code, dtypes=v.FLOATS)
    v.numel(op, "code", code, 2, at_least=True)
    v.numel(op, "absmax", absmax, v.blocks(shapeB[0] * shapeB[1], blocksize), at_least=True)
    v.same_device(op, A=A, B=B, absmax=absmax, code=code)


def _covered_gemv(absmax, code) -> None:
    v.covered_dtype("absmax", absmax, (torch.float32,), v.FLOATS)
    v.covered_dtype("code", code, (torch.float32,), v.FLOATS)
    if code.numel() != 16:
        raise v.NotCovered(f"code of {code.numel()} values (the kernels take the 16 of a 4-bit table)")


@checks("gemm_4bit")
def check_gemm_4bit(
    A, B, shapeB, absmax, blocksize, quant_type, bias=None, absmax_8bit=None, absmax_code=None, absmax_offset=None
) -> None:
    op = "gemm_4bit"
    _check_matmul(op, A, B, shapeB, absmax, blocksize)
    v.tensor(op, "absmax", absmax, dtypes=(torch.float32,))
    v.quant_type(op, quant_type)
    nblocks = v.blocks(shapeB[0] * shapeB[1], blocksize)
    if absmax_8bit is None:  # (absmax_code and absmax_offset are then ignored, as bitsandbytes does)
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
    nested = {} if absmax_8bit is None else dict(absmax_8bit=absmax_8bit, absmax_code=absmax_code,
                                                  absmax_offset=absmax_offset)  # fmt: skip
    v.same_device(op, A=A, B=B, absmax=absmax, bias=bias, **nested)


# -- kernels --------------------------------------------------------------------------------------
#
# One launch per call (two on the two-dispatch split-K path), of one of five kernels of
# csrc/kernels/gemm_4bit.metal and gemm_4bit_splitk.metal, chosen from the shapes and the tier's Metal
# language version alone (M = rows of A, N = rows of the weight, K = its columns):
#
#   gemv    M <= GEMV_MAX_M           decode: bandwidth-bound, one pass over the weight with the
#                                     activations in registers (the MLX qmv_fast design)
#   splitk  M <= SMALL_MAX_M,         a few rows of A (speculative decoding, batched serving, short
#           K >= SPLITK_MIN_K         prompts): one pass over the weight for all M rows; tiles of 16 S
#                                     columns, K cut into S slices, one threadgroup per tile and slice,
#                                     the partial sums added in slice order by the tile's last
#                                     threadgroup (a per-device workspace, not a per-call allocation);
#                                     only where the kernels are compiled at Metal >= 3.2, the first
#                                     version that makes one threadgroup's writes visible to another
#                                     of the same dispatch. "splitk/two": the same partial sums in one
#                                     dispatch, added in a second (every version)
#   small   M <= SMALL_MAX_M          the same below K = 512: 16 weight rows per threadgroup over the
#                                     whole of K, the rows of A staged in threadgroup memory
#   mma     larger M                  prefill / training: simdgroup_matrix tiles, the weight tile
#                                     dequantized into threadgroup memory once per 32 rows of A
#
# and the batch kernel (up to 8 rows of A per threadgroup, 8 weight rows; the weight read once per 8
# rows of A), a tuning candidate for M <= BATCH_CANDIDATE_MAX_M, and the built-in path where the
# others cannot run (M = 1 with K % 32 == 16).
#
# Why these switch points (docs/small-batch.md has the figures): at M = 1 the product is a pure stream
# over the weight (2 flops per 4-bit weight); the gemv kernel keeps the activations in registers and
# issues 16-byte weight loads with no barrier. For 2 <= M <= 32 the built-in path is the one the cost
# model (bnb_mps.emulator.profile: modelled DRAM traffic at the chip's bandwidth) gives the least
# traffic among the paths that spread the work over at least half the gemv kernel's threadgroups (the
# parallelism that keeps a Mac's memory system busy at decode sizes, which the bandwidth model does not
# see): that is the split-K kernel from K = 512 at every such M, dtype and shape measured (the small
# kernel's threadgroups each read all of A; the batch kernel re-reads A per 8 weight rows and the
# weight per 8 rows of A; the mma kernel reads less at large M but over an eighth of the gemv kernel's
# threadgroups), and the small kernel below. Above 32 rows the arithmetic (2*M*N*K) outgrows what
# scalar FMAs keep up with and the 8x8 matrix units take over. The gemv kernel needs K % 32 == 0 and
# the batch, small and split-K kernels K % 16 == 0 (chunks of 32 / 16 nibbles per lane): M = 1 with
# K % 32 == 16 takes the batch kernel, and K % 16 != 0 (no real model has it) the mma kernel, the only
# one that addresses nibbles one by one. Nothing here looks at tensor data.
#
# These switch points are the built-in order (`choose_path`): reasoning under the cost model, not a
# measurement on a Mac. Each path, and each kernel variant of a path (`<path>/<variant>`: "gemv/tglut",
# the gemv kernel with its 16-entry table copied to threadgroup memory instead of read from constant
# memory; "small/wide", the small kernel with 8 weight rows per threadgroup, as many threadgroups as the
# gemv kernel's), is a route that the planners take as an argument (`route=`), so that tuning
# (bnb_mps.ops.tuning) can measure every route `paths` offers for a shape on the user's GPU and plan
# the fastest.
GEMV_MAX_M = 1
SMALL_MAX_M = 32

#: route names of the kernel paths and variants -> the multiple of K their kernel needs (nibbles per
#: lane per step of the gemv, batch, small and split-K kernels; the mma kernel addresses nibbles one by
#: one)
PATH_K_MULTIPLE = {"gemv": 32, "gemv/tglut": 32, "batch": 16, "small": 16, "small/wide": 16, "splitk": 16,
                   "splitk/two": 16, "mma": 1}

#: the one-dispatch split-K kernel's hand-over between threadgroups needs this Metal language version
#: (coherent(device) and device-scope fences); below it the kernel is not compiled and the two-dispatch
#: split-K path takes its place
HANDOVER_LANGUAGE_VERSION = (3, 2)
SPLITK_PATHS = ("splitk", "splitk/two")


def handover(language_version: Optional[tuple]) -> bool:
    """Whether kernels compiled at `language_version` ((major, minor); None: unknown) have the one-dispatch
    split-K kernel."""
    return language_version is not None and tuple(language_version) >= HANDOVER_LANGUAGE_VERSION

# Rows of A up to which the gemv and batch kernels are worth measuring against the others: the gemv
# kernel reads the whole weight once per row of A, the batch kernel once per 8 rows, the small and
# mma kernels once per 32; with more rows than these, they read it more often than the mma kernel does.
# These and the switch points above are powers of two, as tuning's buckets of M are (every M of a
# bucket has the same paths and the same built-in one).
GEMV_CANDIDATE_MAX_M = 4
BATCH_CANDIDATE_MAX_M = 32

_ROWS_PER_TG = 8  # weight rows per threadgroup in the gemv / batch kernels
_BATCH_M = 8  # rows of A per threadgroup in the batch kernel
# The split-K kernel is a route for 2 <= M <= 32 from this K on (two slices of 256 at least), and the
# built-in path there where it models less traffic than the small kernel (`choose_path`:
# docs/small-batch.md).
SPLITK_MIN_K = 2 * _SPLITK_ALIGN
_MMA_BM, _MMA_BN = 32, 64  # output tile of the mma kernel (rows of A x rows of W)

_TABLES = {"code": 0, "nf4": 1, "fp4": 2}
_OFFSET_KINDS = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
_FLAG_BIAS, _FLAG_AVEC = 1, 2


def choose_path(M: int, N: int, K: int, itemsize: int = 2, scale_bytes: int = 1, blocksize: int = 64,
                language_version: Optional[tuple] = None) -> str:  # fmt: skip
    """The built-in kernel for an [M, K] x [N, K]^T product: "gemv", "splitk", "splitk/two", "small",
    "batch" or "mma" (from the shapes, A's element size, the weight's scales: `scale_bytes` a block of
    `blocksize`, 1 for nested 8-bit codes, 4 for float32 absmax, and the Metal language version of the
    tier's kernels). For 2 <= M <= 32 from K = 512, the one of the split-K paths the tier has (the
    one-dispatch kernel from Metal 3.2: `handover`) and the small kernel that the cost model charges
    least, summed over the M of M's tuning bucket (powers of two: every M of a bucket has the same
    built-in route): a split-K path but where a row's cuts share lines (K % 256 != 0 with phases that
    do not divide S) or float32 absmax is read by every slice, at M = 2 to 4 (docs/small-batch.md)."""
    if M <= GEMV_MAX_M and K % PATH_K_MULTIPLE["gemv"] == 0:
        return "gemv"
    if M <= SMALL_MAX_M and K % PATH_K_MULTIPLE["small"] == 0:
        if M == 1:
            return "batch"  # (M = 1 with K % 32 == 16: the gemv kernel's walk, 8 rows)
        if K < SPLITK_MIN_K:
            return "small"
        return small_batch.built_in(M, K, itemsize, scale_bytes, blocksize, handover(language_version))
    return "mma"


def paths(M: int, N: int, K: int, itemsize: int = 2, scale_bytes: int = 1, blocksize: int = 64,
          language_version: Optional[tuple] = None) -> tuple[str, ...]:  # fmt: skip
    """The kernel routes worth measuring for an [M, K] x [N, K]^T product, the built-in one
    (`choose_path`, which also takes A's element size, the weight's scales and the language version)
    first. The one-dispatch split-K kernel only from Metal 3.2 (`handover`). An empty product has only
    the built-in one."""
    default = choose_path(M, N, K, itemsize, scale_bytes, blocksize, language_version)
    if M == 0 or N == 0 or K == 0:
        return (default,)
    valid = [p for p, limit in (("gemv", GEMV_CANDIDATE_MAX_M), ("gemv/tglut", GEMV_CANDIDATE_MAX_M),
                                ("batch", BATCH_CANDIDATE_MAX_M), ("small", SMALL_MAX_M),
                                ("small/wide", SMALL_MAX_M), ("splitk", SMALL_MAX_M), ("splitk/two", SMALL_MAX_M),
                                ("mma", None))
             if (limit is None or M <= limit) and K % PATH_K_MULTIPLE[p] == 0
             and (p not in SPLITK_PATHS or K >= SPLITK_MIN_K) and (p != "splitk" or handover(language_version))]  # fmt: skip
    return (default, *(p for p in valid if p != default))


def _gemm_paths(A, B, shapeB, absmax, blocksize, quant_type, bias=None, absmax_8bit=None, *rest,
                language_version: Optional[tuple] = None) -> tuple[str, ...]:  # fmt: skip
    """`paths` of a gemm_4bit call (its arguments in schema order)."""
    scales = 1 if absmax_8bit is not None else absmax.element_size()
    return paths(math.prod(A.shape[:-1]), shapeB[0], shapeB[1], A.element_size(), scales, blocksize, language_version)


def _gemv_paths(A, B, shapeB, absmax, code, blocksize, *rest, language_version: Optional[tuple] = None) -> tuple[str, ...]:
    """`paths` of a gemv_4bit call (float32 absmax, no nested scales)."""
    return paths(math.prod(A.shape[:-1]), shapeB[0], shapeB[1], A.element_size(), absmax.element_size(), blocksize,
                 language_version)  # fmt: skip


def _rows_copy(A: torch.Tensor) -> torch.Tensor:
    """A as a contiguous [M, K] copy (for layouts whose rows cannot be bound as a strided span)."""
    return A.reshape(-1, A.shape[-1]).contiguous()


def _bind_A(b: PlanBuilder, A: torch.Tensor) -> tuple:
    """(reference, row stride in elements, start 16-byte aligned) for A, bound as [M, K] rows with
    unit column stride: A itself when contiguous; a strided view as the one-dimensional span of
    storage its rows cover (so that every executor, including one that stages tensors through another
    device, sees exactly the bytes the kernel indexes); otherwise a contiguous copy."""
    K = A.shape[-1]
    if A.is_contiguous():
        return b.arg(0), K, is_aligned(A)
    try:
        A2 = A.view(-1, K)
    except RuntimeError:  # leading dimensions that do not collapse into one stride
        A2 = None
    if A2 is None or (K > 1 and A2.stride(1) != 1):
        return b.arg(0, _rows_copy), K, True
    M, lda = A2.shape[0], A2.stride(0)
    span = ((M - 1) * lda + K,)
    return b.arg(0, lambda A: A.view(-1, K).as_strided(span, (1,))), lda, is_aligned(A)


def _constant_copy(code: torch.Tensor) -> torch.Tensor:
    return code.clone(memory_format=torch.contiguous_format)


def _matmul_launch(b: PlanBuilder, out, A, B, shapeB, absmax, blocksize, table, code, bias,
                   nested: Optional[tuple], route: Optional[str], language_version: Optional[tuple]) -> None:  # fmt: skip
    """out[..., N] = A @ dequant(B).T (+ bias): one kernel launch (two on "splitk/two"; none for empty
    products), of the kernel path `route` (a name of PATH_K_MULTIPLE; None: the built-in one,
    `choose_path`) among the kernels compiled at `language_version`.

    Arguments are at the schema positions A = 0, B = 1, absmax = 3; `code` and `bias` are
    (position, tensor) or None; `nested` is ((position, tensor) of absmax_8bit, absmax_code,
    absmax_offset) or None."""
    N, K = shapeB
    M = math.prod(A.shape[:-1])
    scale_bytes = 1 if nested is not None else absmax.element_size()  # (a block's scale: a code, or a float32)
    path = choose_path(M, N, K, A.element_size(), scale_bytes, blocksize, language_version) if route is None else route
    if path not in PATH_K_MULTIPLE or K % PATH_K_MULTIPLE[path]:
        raise ValueError(f"{b.op}: route {path!r} cannot compute a product with K = {K} (routes: "
                         f"{', '.join(f'{p} (K % {k} == 0)' for p, k in PATH_K_MULTIPLE.items())})")
    if path == "splitk" and not handover(language_version):
        have = "an unknown version" if language_version is None else "Metal {}.{}".format(*language_version)
        raise ValueError(f"{b.op}: route 'splitk' needs kernels compiled at Metal >= 3.2 (this tier's are "
                         f"{have}); 'splitk/two' computes the same at every version")
    if (path.startswith("small") or path in SPLITK_PATHS) and M > SMALL_MAX_M:
        raise ValueError(f"{b.op}: route {path!r} computes at most {SMALL_MAX_M} rows of A, got M = {M}")
    if M == 0 or N == 0 or K == 0:  # K == 0: an empty sum, only the bias (see _empty_sum)
        return
    A_ref, lda, A_start_aligned = _bind_A(b, A)
    check_size(b.op, "A", (M - 1) * lda + K)
    A_aligned = A_start_aligned and (lda * A.element_size()) % VECTOR_ALIGN == 0
    flags = (_FLAG_BIAS if bias is not None else 0) | (_FLAG_AVEC if A_aligned else 0)

    scales = flat_arg(b, 3, absmax)
    if nested is not None:
        (i8, q8), (ic, code8), (io, offset) = nested
        nested_refs = (flat_arg(b, i8, q8), flat_arg(b, ic, code8), flat_arg(b, io, offset))
        offset_kind = _OFFSET_KINDS[offset.dtype]
    else:
        nested_refs = (scales, scales, scales)  # bound, never read
        offset_kind = 0
    if code is not None:
        i, t = code
        aligned256 = t.is_contiguous() and (t.storage_offset() * t.element_size()) % _CONSTANT_ALIGN == 0
        code_ref = b.arg(i) if aligned256 else b.arg(i, _constant_copy)
    else:
        code_ref = scales
    bias_ref = flat_arg(b, bias[0], bias[1]) if bias is not None else scales
    dt = DTYPE_NAMES[A.dtype]
    sc = "nested" if nested is not None else "absmax"
    extra: list = []  # the split-K kernel's arguments after the common ones
    if path in ("gemv", "gemv/tglut"):
        variant = "_tglut" if path == "gemv/tglut" else ""
        name = f"bnb_gemv_4bit{variant}_{sc}_{dt}"
        grid, threads = (math.ceil(N / _ROWS_PER_TG), M, 1), (64, 1, 1)
    elif path == "batch":
        name = f"bnb_gemm_4bit_batch_{sc}_{dt}"
        grid, threads = (math.ceil(N / _ROWS_PER_TG), math.ceil(M / _BATCH_M), 1), (128, 1, 1)
    elif path in ("small", "small/wide"):
        variant, rows = ("_wide", _ROWS_PER_TG) if path == "small/wide" else ("", _SMALL_ROWS_PER_TG)
        name = f"bnb_gemm_4bit_small{variant}_{sc}_{dt}"
        grid, threads = (math.ceil(N / rows), 1, 1), (8 * rows, 1, 1)
    elif path in SPLITK_PATHS:
        S = splitk_splits(M, K, A.element_size(), scale_bytes, blocksize)
        tiles = math.ceil(N / (_SMALL_ROWS_PER_TG * S))
        grid, threads = (splitk_threadgroups(N, S), 1, 1), (128, 1, 1)
        partials = tiles * S * M * _SMALL_ROWS_PER_TG * S
        check_size(b.op, "the split-K workspace", partials)
        work = b.workspace("splitk partial sums", partials, torch.float32)
        if path == "splitk":
            name = f"bnb_gemm_4bit_splitk_{sc}_{dt}"
            counters = b.workspace("splitk counters", tiles, torch.int32, zeroed=True)
            b.n_dynamic = 1  # (the call's tag, `_call_tag`)
            extra = [uint32(S), work, counters, b.dynamic(0)]
        else:
            name = f"bnb_gemm_4bit_splitk_partial_{sc}_{dt}"
            extra = [uint32(S), work]
    else:
        name = f"bnb_gemm_4bit_mma_{sc}_{dt}"
        grid, threads = (math.ceil(M / _MMA_BM), math.ceil(N / _MMA_BN), 1), (128, 1, 1)
    b.launch(
        name, grid, threads,
        [
            A_ref, aligned_arg(b, 1, B), scales, *nested_refs, code_ref, bias_ref, out,
            uint32(M), uint32(N), uint32(K), uint32(lda), uint32(blocksize.bit_length() - 1),
            uint32(_TABLES[table]), uint32(offset_kind), uint32(flags), *extra,
        ],
    )  # fmt: skip
    if path == "splitk/two":  # (encoded after the partial sums on the same stream: Metal orders the two)
        chunks = math.ceil(M * _SMALL_ROWS_PER_TG * S / _SPLITK_SUM_THREADS)
        b.launch(f"bnb_gemm_4bit_splitk_sum_{dt}", (tiles, chunks, 1), (_SPLITK_SUM_THREADS, 1, 1),
                 [work, bias_ref, out, uint32(M), uint32(N), uint32(flags), uint32(S)])


_SPLITK_SUM_THREADS = 128  # threads per threadgroup of the split-K sum kernel, an output each


# Metal wants buffers of the constant address space at offsets aligned to the GPU family's minimum
# (4 bytes on Apple GPUs, 256 on the Mac2 family): a 16-entry table at another offset is copied.
_CONSTANT_ALIGN = 256


def _empty_sum(target: Callable[[list, tuple], torch.Tensor], bias_position: Optional[int]):
    """The `finish` of a product with K = 0 (never the case for a real layer): only the bias."""

    def finish(args: list, outs: tuple) -> None:
        out = target(args, outs)
        out.copy_(args[bias_position].expand_as(out)) if bias_position is not None else out.zero_()

    return finish


def _output(b: PlanBuilder, A: torch.Tensor, shapeB):
    """The output [*A.shape[:-1], N], once the sizes are known to fit 32-bit indexing."""
    N, K = shapeB
    check_size(b.op, "shapeB", N * K)
    check_size(b.op, "the output", math.prod(A.shape[:-1]) * N)
    check_size(b.op, "A", A.numel())
    return b.output((*A.shape[:-1], N), A.dtype)


def _first_output(args: list, outs: tuple) -> torch.Tensor:
    return outs[0]


def _call_tag(args, base) -> tuple:
    """The per-call scalar of a split-K plan (the other paths have none): the call's tag in the tile
    counters (bnb_mps.ops.workspace.next_tag)."""
    return (uint32(workspace.next_tag()),)


@planner("gemm_4bit", paths=_gemm_paths, dynamic=_call_tag, versioned=True)
def plan_gemm_4bit(A, B, shapeB, absmax, blocksize, quant_type, bias=None, absmax_8bit=None, absmax_code=None,
                   absmax_offset=None, *, route: Optional[str] = None,
                   language_version: Optional[tuple] = None) -> Plan:  # fmt: skip
    b = PlanBuilder(A.device, "gemm_4bit")
    out = _output(b, A, shapeB)
    nested = None if absmax_8bit is None else ((7, absmax_8bit), (8, absmax_code), (9, absmax_offset))
    _matmul_launch(b, out, A, B, shapeB, absmax, blocksize, quant_type, None,
                   (6, bias) if bias is not None else None, nested, route, language_version)  # fmt: skip
    finish = _empty_sum(_first_output, 6 if bias is not None else None) if shapeB[1] == 0 else None
    return b.build(result=out, finish=finish)


@planner("gemv_4bit", paths=_gemv_paths, dynamic=_call_tag, versioned=True)
def plan_gemv_4bit(A, B, shapeB, absmax, code, blocksize, *, route: Optional[str] = None,
                   language_version: Optional[tuple] = None) -> Plan:  # fmt: skip
    b = PlanBuilder(A.device, "gemv_4bit")
    out = _output(b, A, shapeB)
    _matmul_launch(b, out, A, B, shapeB, absmax, blocksize, "code", (4, code), None, None, route, language_version)
    return b.build(result=out, finish=_empty_sum(_first_output, None) if shapeB[1] == 0 else None)


@planner("gemv_4bit.out", paths=_gemv_paths, dynamic=_call_tag, versioned=True)
def plan_gemv_4bit_out(A, B, shapeB, absmax, code, blocksize, out, *, route: Optional[str] = None,
                       language_version: Optional[tuple] = None) -> Plan:  # fmt: skip
    b = PlanBuilder(A.device, "gemv_4bit.out")
    N, K = shapeB
    check_size(b.op, "shapeB", N * K)
    check_size(b.op, "out", out.numel())
    # The kernels store the output element by element: any contiguous `out` is written in place
    # (whatever its alignment); other layouts go through a contiguous temporary.
    target = out_arg(b, 6, out, any_alignment=True)
    _matmul_launch(b, target, A, B, shapeB, absmax, blocksize, "code", (4, code), None, None, route, language_version)
    return b.build(finish=_empty_sum(lambda args, outs: args[6], None) if K == 0 else None)


gemm_4bit = kernel_of("gemm_4bit")
gemv_4bit = kernel_of("gemv_4bit")
gemv_4bit_out = kernel_of("gemv_4bit.out")


# -- the CPU fallback's composition ------------------------------------------------------------------
#
# docs/semantics.md section 4 on the CPU: the weight dequantized to float32 and rounded to A's dtype (as
# dequantize_4bit gives it in that dtype), a float32 product (bias added in float32), rounded once to A's
# dtype. Not bitsandbytes' CPU kernels: on CPUs with
# AVX512-BF16, bitsandbytes 0.50.2 registers a CPU gemv_4bit that reads the weight in its own packed
# CPU layout (the one Linear4bit converts weights to on such CPUs), so it returns wrong values for the
# standard layout these ops take; its CPU gemm_4bit dequantizes through the path dequantize_4bit_cpu
# avoids; and its pure-PyTorch path multiplies in A's dtype, whose accumulation on the CPU depends on
# the CPU's kernels.


def _linear_float32(A, W, bias):
    W = W.to(A.dtype).float()  # (a no-op for float32 A)
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
