"""The 4-bit products' figures under the cost model (bnb_mps.emulator.profile), per kernel path and row
count M: the table of docs/small-batch.md, and what tests/test_small_batch_cost.py asserts; with, per M,
the least traffic the model can charge any kernel with half the M = 1 call's threadgroups (`lower_bound`).

    python scripts/cost_model_matmul_4bit.py [--shapes 3072x1024,1024x3072] [--m 1,2,...] [--dtype float16]
        [--counts] [--float32-absmax] [--metal 3.1]

One call = one gemm_4bit call on a nested NF4 weight (blocksize 64, as QLoRA loads a model; with
`--float32-absmax` one without double quantization, as transformers loads it by default), profiled by
the emulator (`use_emulated_kernels(profile=True)`, at Metal 3.2 or `--metal`): its launches, the
threadgroups that form the products (the two-dispatch split-K's sum kernel forms none), modelled DRAM traffic
(the profile's largest traffic term, `traffic_bytes`: lines each threadgroup touches, summed), the part
of it that is A's, and the unique bytes (lines touched at all). Modelled time on a chip = traffic /
its peak bandwidth (bnb_mps.chips): a figure of the model, not of hardware.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

import torch

BLOCKSIZE = 64
A_ARG, B_ARG = 0, 1  # buffer indices of A and the packed weight (csrc/kernels/gemm_4bit.metal)
#: the Metal language version the kernels are profiled at: 3.2, where the split-K product is one dispatch
#: (`--metal 3.1`: two, its partial sums and their sum)
METAL_VERSION = "3.2"


@dataclass(frozen=True)
class Figures:
    path: str
    M: int
    kernels: tuple[str, ...]
    threadgroups: int  # of the launch that forms the products (the first: a split-K sum kernel forms none)
    traffic: int  # modelled DRAM traffic, bytes
    a_traffic: int  # the part of it in A's buffer
    b_traffic: int  # the part of the traffic in the packed weight's buffer
    b_lines: int  # lines of the packed weight touched at all
    unique: int  # bytes of the lines touched at all

    def seconds(self, gbps: float) -> float:
        return self.traffic / (gbps * 1e9)


@lru_cache(maxsize=8)
def weight(N: int, K: int, nested: bool = True) -> tuple:
    """An NF4 weight of [N, K] on the CPU, as gemm_4bit's arguments after shapeB up to the bias' place:
    (packed, absmax) with float32 absmax (`nested` False: bitsandbytes' quantize_4bit, and transformers'
    default without double quantization), else (packed, nested absmax, 8-bit codes, code, offset)."""
    from bitsandbytes.functional import create_dynamic_map

    W = torch.randn(N, K, generator=torch.Generator().manual_seed(N * 7 + K))
    packed, absmax = torch.ops.bitsandbytes.quantize_4bit(W, BLOCKSIZE, "nf4", torch.uint8)
    if not nested:
        return packed, absmax
    code = create_dynamic_map(signed=True)
    offset = absmax.mean()
    q8, absmax2 = torch.ops.bitsandbytes.quantize_blockwise(absmax - offset, code, 256)
    return packed, absmax2, q8, code, offset.reshape(1)


def scale_bytes(nested: bool) -> int:
    """Bytes of a block's scale: an 8-bit code where the absmax is nested, else a float32."""
    return 1 if nested else 4


def profile(N: int, K: int, M: int, dtype: torch.dtype, path: Optional[str] = None, nested: bool = True,
            metal_version: Optional[str] = None) -> Figures:  # fmt: skip
    """One gemm_4bit call of M rows on the built-in route (path None) or the kernel path `path`, on the
    nested weight (`nested`) or the one with float32 absmax (`weight`), with the kernels compiled at
    `metal_version` (default METAL_VERSION). Its figures are the sums over the call's launches."""
    from bnb_mps.ops import OPS, call, matmul_4bit
    from bnb_mps.testing import use_emulated_kernels

    version = metal_version or METAL_VERSION
    packed, absmax, *codes = weight(N, K, nested)
    A = torch.randn(M, K, generator=torch.Generator().manual_seed(M)).to(dtype)
    args = (A, packed, [N, K], absmax, BLOCKSIZE, "nf4", None, *codes)
    with use_emulated_kernels(profile=True, metal_version=version) as rec:
        if path is None:
            call(OPS["gemm_4bit"], args, {}, rec)
        else:
            matmul_4bit.gemm_4bit(rec, *args, route=path)
    ps = rec.profiles
    built_in = matmul_4bit.choose_path(M, N, K, dtype.itemsize, scale_bytes(nested), BLOCKSIZE,
                                       tuple(int(v) for v in version.split(".")))  # fmt: skip
    return Figures(path or built_in, M, tuple(rec.launched),
                   ps[0].threadgroups, sum(p.traffic_bytes for p in ps),
                   sum(p.buffers[A_ARG].lines_summed_over_threadgroups * p.line_bytes for p in ps),
                   sum(p.buffers[B_ARG].lines_summed_over_threadgroups * p.line_bytes for p in ps),
                   max(p.buffers[B_ARG].lines for p in ps), sum(p.lines * p.line_bytes for p in ps))  # fmt: skip


#: `lower_bound`'s bytes per output and threadgroup for deterministic split-K kernels: (2 S - 1) / S x 4 >= 6
SPLIT_K_PARTIAL_BYTES = 6


def lower_bound(N: int, K: int, M: int, dtype: torch.dtype, threadgroups: int,
                partial_bytes: Optional[int] = None, nested: bool = True) -> float:
    """The least traffic (bytes) the cost model can charge any kernel that shares the M x N x K products
    equally among `threadgroups` threadgroups (docs/small-batch.md, "The bound"). A threadgroup that
    forms v products a[m, k] * w[n, k] touches the a elements (m, k), the w weights (n, k) and the y
    outputs (m, n) they project to, and v <= sqrt(a w y) (the Loomis-Whitney inequality); it reads
    itemsize bytes per element of A and half a byte per weight, and writes at least itemsize bytes per
    output it contributes to (a sum or a partial sum: less precision than the output's would round
    otherwise than dequantize + linear, docs/semantics.md section 4). Its lines cover those bytes, so by
    the inequality of arithmetic and geometric means it is charged at least
    3 (itemsize x 1/2 x p)^(1/3) v^(2/3), v = M N K / threadgroups, p = itemsize; the block scales
    (N K / 64 bytes of 8-bit codes where `nested`, 4 N K / 64 of float32 absmax otherwise) are read at
    least once. Or, counting the scales another way: a threadgroup
    reads at least a share of a scale line for each weight row it forms products with
    (`scale_line_share`: a row's scale bytes where a line holds whole rows' scales), so each of its outputs
    costs it scale_line_share / M bytes more, p + scale_line_share / M in all. And whatever the shares, every weight byte, scale,
    element of A and output is moved at least once. The bound is the larger of the two; everything
    else (scale tables, re-reads of a line by another threadgroup, partial sums read back) only adds to
    it. `partial_bytes` = p = 4: the bound of kernels whose threadgroups write float32 partial sums (a
    split of K that rounds once, as dequantize + linear does, needs them). p = 6 (SPLIT_K_PARTIAL_BYTES):
    kernels that split the K of every output among S >= 2 threadgroups and add the S float32 partial
    sums in a fixed order, none waiting for another (Metal promises no progress between
    threadgroups): all S are written and S - 1 read back by the one that adds them, at least
    1.5 x 4 bytes per output and contributing threadgroup."""
    s, b = dtype.itemsize, scale_bytes(nested)
    p = s if partial_bytes is None else partial_bytes
    v = M * N * K / threadgroups

    def shares(per_output: float) -> float:
        return threadgroups * 3 * (s * 0.5 * per_output) ** (1 / 3) * v ** (2 / 3)

    # the scales once in all, or a share of a line per weight row each threadgroup touches
    balanced = max(shares(p) + b * N * K / BLOCKSIZE, shares(p + scale_line_share(K, b) / M))
    once = N * K / 2 + b * N * K / BLOCKSIZE + M * K * s + M * N * s
    return max(balanced, once)


def scale_line_share(K: int, scale_bytes: int = 1, line: int = 128) -> float:
    """The least part of a `line`-byte line a threadgroup reads per weight row it forms products with,
    for the block scales (`scale_bytes` per block of 64: 1 for nested 8-bit codes, 4 for float32
    absmax; rows of K / 64 x scale_bytes bytes, one after another): a line meets at most r rows'
    scales, so a threadgroup touching R rows reads at least R / r lines, line / r bytes per row.
    r = line / row bytes where that divides; else the most rows any line meets (K = 3072, nested:
    48 bytes per row, up to 4 rows in a line)."""
    row = K // BLOCKSIZE * scale_bytes
    if row == 0 or K % BLOCKSIZE:
        return 0.0  # (blocks that straddle rows: no share claimed)
    most = max(len({b // row for b in range(start, start + line)}) for start in range(0, math.lcm(row, line), line))
    return line / most


#: bytes of the nested code table (256 float32 values), whose lines each threadgroup touches
NESTED_CODE_BYTES = 256 * 4


def shape_count(N: int, K: int, M: int, dtype: torch.dtype, splits: int, tables: bool = False,
                rows: int = 16, nested: bool = True) -> float:
    """What no kernel of the split-K kernel's shape can go below (docs/small-batch.md, "Nor can any
    kernel of its shape"): tiles of 16 S weight rows by S slices of K (S = `splits`), each threadgroup
    reading one slice of its tile for all M rows of A, each weight byte read once. Counted, in bytes:
    A once per tile; S float32 partial sums written and S - 1 read back per output; the lines of scales
    each threadgroup's rows and slice meet (`slice_scale_lines`); the weight and the output once.
    `tables`: and the nested code table's lines by every threadgroup (what the split-K kernel also pays,
    whatever its shape, with random codes; none without `nested`, float32 absmax). `rows` x S weight
    rows a tile: 16 (half the gemv kernel's threadgroups), 8 (as many)."""
    s = dtype.itemsize
    tiles = -(-N // (rows * splits))
    scales = slice_scale_lines(N, K, splits, scale_bytes(nested), rows) * 128
    count = tiles * M * K * s + (2 * splits - 1) * 4 * M * N + scales + N * K / 2 + M * N * s
    return count + (tiles * splits * NESTED_CODE_BYTES if tables and nested else 0)


def slice_scale_lines(N: int, K: int, splits: int, scale_bytes: int, rows: int = 16) -> int:
    """The 128-byte lines of block scales that the threadgroups of the split-K shape touch, summed over
    threadgroups: threadgroup (tile t, slice j) takes rows t x rows x S up to the next tile and, of each,
    K from j x span to (j + 1) x span (span = ceil(K / (256 S)) x 256, the kernel's slices); element k of
    row n is in block (n K + k) / 64, whose scale is `scale_bytes` bytes at scale_bytes x block."""
    from bnb_mps.ops.small_batch import _SPLITK_ALIGN as align  # (slices start at multiples of it in K)

    span = -(-K // (align * splits)) * align
    n = torch.arange(N, dtype=torch.int64)
    total = 0
    for k0 in range(0, K, span):
        first = (n * K + k0) // BLOCKSIZE * scale_bytes // 128
        last = ((n * K + min(k0 + span, K) - 1) // BLOCKSIZE * scale_bytes + scale_bytes - 1) // 128
        # each line from first to last of each row, tagged with its row's tile: distinct (tile, line) pairs
        width = int((last - first).max()) + 1
        lines = first[:, None] + torch.arange(width)[None, :]
        tile = (n // (rows * splits))[:, None].expand_as(lines)
        keep = lines <= last[:, None]
        total += torch.unique(tile[keep] * (1 << 40) + lines[keep]).numel()
    return total


def counts(shapes: list[tuple[int, int]], ms: list[int], dtype: torch.dtype, out=sys.stdout,
           nested: bool = True) -> None:
    """Prints, per shape and M, `shape_count` for each S (with and without the code table's lines) against
    the M = 1 call's traffic, beside the split-K kernel's own figure (its S: splitk_splits)."""
    from bnb_mps.ops import small_batch

    for N, K in shapes:
        base = profile(N, K, 1, dtype, nested=nested)
        choices = small_batch.splits(K)
        print(f"\n{N}x{K}, {str(dtype).removeprefix('torch.')}: the split-K shape's count against the M = 1 call's "
              f"traffic ({base.traffic / 1e6:.3f} MB), without / with the code table's lines", file=out)
        head = ["M", *(f"S = {S}" for S in choices), "split-K kernel (S)"]
        print(" | ".join(head), file=out)
        print(" | ".join("---" for _ in head), file=out)
        for M in ms:
            cells = [str(M)]
            for S in choices:
                a, b = (shape_count(N, K, M, dtype, S, tables, nested=nested) / base.traffic for tables in (False, True))
                cells.append(f"{a:.3f} / {b:.3f}")
            f = profile(N, K, M, dtype, "splitk", nested)
            S = small_batch.splitk_splits(M, K, dtype.itemsize, scale_bytes(nested), BLOCKSIZE)
            cells.append(f"{f.traffic / base.traffic:.3f} ({S})")
            print(" | ".join(cells), file=out, flush=True)


#: the chips of the table (bnb_mps.chips): the oldest base chip, a Max, a Pro, the newest base chip
CHIPS = ("M1", "M3 Max", "M4 Pro", "M5")
DEFAULT_SHAPES = "3072x1024,1024x3072,4096x4096"
DEFAULT_M = "1,2,3,4,5,6,8,12,16,24,32,48,64"


def routes(M: int, N: int, K: int, dtype: torch.dtype = torch.float16, nested: bool = True,
           metal_version: Optional[str] = None) -> list[str]:  # fmt: skip
    """The kernel routes of a call (bnb_mps.ops.matmul_4bit.paths) at `metal_version` (default
    METAL_VERSION), the built-in one first, without gemv/tglut (the gemv kernel's traffic: only the
    table's address space differs)."""
    from bnb_mps.ops import matmul_4bit

    version = tuple(int(v) for v in (metal_version or METAL_VERSION).split("."))
    return [p for p in matmul_4bit.paths(M, N, K, dtype.itemsize, scale_bytes(nested), BLOCKSIZE, version)
            if p != "gemv/tglut"]  # fmt: skip


def table(shapes: list[tuple[int, int]], ms: list[int], dtype: torch.dtype, out=sys.stdout,
          nested: bool = True) -> list[Figures]:
    """Prints, per shape and M, each route's figures; returns them all."""
    from bnb_mps import chips

    gbps = {c: chips.bandwidth(c) for c in CHIPS}
    rows: list[Figures] = []
    for N, K in shapes:
        base = profile(N, K, 1, dtype, nested=nested)
        print(f"\n{N}x{K} (N x K), {'nested' if nested else 'float32 absmax'} NF4, blocksize {BLOCKSIZE}, {str(dtype).removeprefix('torch.')}; "
              f"M = 1 built-in ({base.path}): {base.traffic / 1e6:.3f} MB, {base.threadgroups} threadgroups", file=out)
        head = ["M", "path", "traffic MB", "vs M=1", "A MB", "unique MB", "threadgroups", "vs M=1"]
        head += [f"{c} us" for c in CHIPS]
        print(" | ".join(head), file=out)
        print(" | ".join("---" for _ in head), file=out)
        half = math.ceil(base.threadgroups / 2)
        for M in ms:
            # the least traffic of any kernel with half the M = 1 call's threadgroups (`lower_bound`), with
            # partial sums of the output's size, of float32, and of float32 read back in a fixed order
            for label, p in (("bound", None), ("bound, f32 partials", 4), ("bound, split K", SPLIT_K_PARTIAL_BYTES)):
                b = lower_bound(N, K, M, dtype, half, partial_bytes=p, nested=nested)
                cells = [str(M), label, f"{b / 1e6:.3f}", f"{b / base.traffic:.2f}", "", "", str(half),
                         f"{half / base.threadgroups:.2f}"]  # fmt: skip
                cells += [f"{b / (gbps[c] * 1e9) * 1e6:.1f}" for c in CHIPS]
                print(" | ".join(cells), file=out)
            for i, path in enumerate(routes(M, N, K, dtype, nested)):
                f = profile(N, K, M, dtype, None if i == 0 else path, nested)
                rows.append(f)
                cells = [str(M), path + (" *" if i == 0 else ""), f"{f.traffic / 1e6:.3f}",
                         f"{f.traffic / base.traffic:.2f}", f"{f.a_traffic / 1e6:.3f}", f"{f.unique / 1e6:.3f}",
                         str(f.threadgroups), f"{f.threadgroups / base.threadgroups:.2f}"]  # fmt: skip
                cells += [f"{f.seconds(gbps[c]) * 1e6:.1f}" for c in CHIPS]
                print(" | ".join(cells), file=out, flush=True)
    return rows


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=DEFAULT_SHAPES, help=f"NxK,... (default {DEFAULT_SHAPES})")
    parser.add_argument("--m", default=DEFAULT_M, help=f"rows of A (default {DEFAULT_M})")
    parser.add_argument("--dtype", default="float16", choices=("float16", "bfloat16", "float32"))
    parser.add_argument("--counts", action="store_true",
                        help="print the split-K shape's count per S (`shape_count`) instead of the routes' table")
    parser.add_argument("--float32-absmax", action="store_true",
                        help="a weight with float32 absmax (no double quantization) instead of the nested one")
    parser.add_argument("--metal", default=METAL_VERSION, choices=("3.1", "3.2", "4.0"),
                        help=f"the Metal language version of the kernels (default {METAL_VERSION}; below 3.2 the "
                             "split-K product is two dispatches)")
    args = parser.parse_args(argv)
    globals()["METAL_VERSION"] = args.metal
    shapes = [tuple(int(x) for x in s.lower().split("x")) for s in args.shapes.split(",")]
    ms = [int(m) for m in args.m.split(",")]
    start = time.perf_counter()
    print("Figures of the cost model (bnb_mps.emulator.profile under the emulator), not of hardware: modelled DRAM "
          "traffic = lines each threadgroup touches, summed; unique = lines touched at all; time = traffic / the chip's "
          "peak bandwidth (bnb_mps.chips). * = the built-in route (bnb_mps.ops.matmul_4bit.choose_path).")
    if args.counts:
        counts(shapes, ms, getattr(torch, args.dtype), nested=not args.float32_absmax)
    else:
        table(shapes, ms, getattr(torch, args.dtype), nested=not args.float32_absmax)
    print(f"\n({time.perf_counter() - start:.0f} s under the emulator)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
