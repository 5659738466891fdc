"""The memory-traffic regression gate's cases and table (tests/kernel_traffic.md).

Each case is one op call on fixed inputs, run through the project's kernels under the emulator's
profiler (`bnb_mps.testing.use_emulated_kernels(profile=True)`); its figures (lines touched,
lines summed over threadgroups, SIMD-group transactions, coalescing efficiency, traffic
efficiency against the bytes the op must move) are recorded in kernel_traffic.md, and
test_kernel_traffic.py fails when a kernel does worse than its row.

Adding a kernel: register a case below (a function returning the op call, and the bytes the op
must move), then print its row and paste it into the table, or rewrite the table:

    python tests/kernel_traffic.py            # prints the table as measured now
    python tests/kernel_traffic.py --write    # rewrites tests/kernel_traffic.md with it

When a kernel legitimately changes its traffic, refresh the table the same way and say why in the
commit message.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

TABLE = Path(__file__).resolve().with_name("kernel_traffic.md")


@dataclass(frozen=True)
class TrafficCase:
    name: str
    make: Callable[[], Callable[[], object]]  # builds the inputs (CPU), returns the op call
    required_bytes: int  # what the op must read and write at least
    metal_version: str = "3.1"  # the Metal language version the kernels are compiled at


CASES: dict[str, TrafficCase] = {}


def case(name: str, required_bytes: int, metal_version: str = "3.1"):
    """Registers `make` (a function returning the op call) as the case `name`, its kernels compiled at
    `metal_version`."""

    def register(make: Callable[[], Callable[[], object]]):
        if name in CASES:
            raise ValueError(f"duplicate traffic case {name!r}")
        CASES[name] = TrafficCase(name, make, required_bytes, metal_version)
        return make

    return register


def _randn(n: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)).to(dtype)


_DT = {"f16": torch.float16, "f32": torch.float32}

# -- blockwise 8-bit and 4-bit quantization (docs/semantics.md sections 2, 3) ----------------------------------------

QUANT_N = 256 * 256  # representative: many threadgroups, small enough for CI
TAIL_N = 10007  # not a multiple of any block or threadgroup: the tail paths


def _quant_cases() -> None:
    from bitsandbytes.functional import create_dynamic_map

    code = create_dynamic_map(signed=True)
    for dt, dtype in _DT.items():
        item = dtype.itemsize
        for n, bs in ((QUANT_N, 64), (QUANT_N, 4096), (TAIL_N, 64)):
            blocks = math.ceil(n / bs)
            size = f"n={n}"

            # 8-bit: reads A and the 256-entry code, writes one byte per element and the absmax.
            @case(f"quantize_blockwise {dt} bs{bs} {size}", item * n + 4 * 256 + n + 4 * blocks)
            def _(n=n, bs=bs, dtype=dtype):
                A = _randn(n, dtype)
                return lambda: torch.ops.bitsandbytes.quantize_blockwise(A, code, bs)

            @case(f"dequantize_blockwise {dt} bs{bs} {size}", n + 4 * 256 + 4 * blocks + item * n)
            def _(n=n, bs=bs, dtype=dtype):
                q, absmax = torch.ops.bitsandbytes.quantize_blockwise(_randn(n, torch.float32), code, bs)
                return lambda: torch.ops.bitsandbytes.dequantize_blockwise(q, absmax, code, bs, dtype)

        for n, bs, qt in ((QUANT_N, 64, "nf4"), (QUANT_N, 256, "nf4"), (QUANT_N, 64, "fp4"), (TAIL_N, 64, "nf4")):
            blocks = math.ceil(n / bs)
            packed = (n + 1) // 2
            size = f"n={n}"

            # 4-bit: reads A, writes half a byte per element and the absmax (the code is in the kernel).
            @case(f"quantize_4bit {qt} {dt} bs{bs} {size}", item * n + packed + 4 * blocks)
            def _(n=n, bs=bs, dtype=dtype, qt=qt):
                A = _randn(n, dtype)
                return lambda: torch.ops.bitsandbytes.quantize_4bit(A, bs, qt, torch.uint8)

            @case(f"dequantize_4bit {qt} {dt} bs{bs} {size}", packed + 4 * blocks + item * n)
            def _(n=n, bs=bs, dtype=dtype, qt=qt):
                q, absmax = torch.ops.bitsandbytes.quantize_4bit(_randn(n, torch.float32), bs, qt, torch.uint8)
                return lambda: torch.ops.bitsandbytes.dequantize_4bit(q, absmax, bs, qt, [n], dtype)


_quant_cases()

# -- 4-bit matrix products (docs/semantics.md section 4): one case per kernel path, nested NF4 weight, fp16 ------------

MATMUL_N, MATMUL_K = 128, 512


def _matmul_cases() -> None:
    from bitsandbytes.functional import create_dynamic_map

    code = create_dynamic_map(signed=True)
    N, bs = MATMUL_N, 64
    # (the built-in path of each shape: the small kernel below K = 512, the split-K kernel from there, in
    # one dispatch from Metal 3.2, in two below)
    for path, M, K, version in (("gemv", 1, MATMUL_K, "3.1"), ("splitk", 8, MATMUL_K, "3.2"),
                                ("splitk/two", 8, MATMUL_K, "3.1"), ("small", 8, MATMUL_K // 2, "3.1"),
                                ("mma", 64, MATMUL_K, "3.1")):  # fmt: skip
        nblocks = N * K // bs
        # the packed weight, its 8-bit scales, their 256-blocks' scales, A, the output
        required = N * K // 2 + nblocks + 4 * math.ceil(nblocks / 256) + 2 * M * K + 2 * M * N

        @case(f"gemm_4bit {path} nf4 nested f16 M={M} {N}x{K}", required, version)
        def _(M=M, K=K):
            W = _randn(N * K, torch.float32, seed=1).reshape(N, K)
            packed, absmax = torch.ops.bitsandbytes.quantize_4bit(W, bs, "nf4", torch.uint8)
            offset = absmax.mean()
            q8, nested = torch.ops.bitsandbytes.quantize_blockwise(absmax - offset, code, 256)
            A = _randn(M * K, torch.float16, seed=2).reshape(M, K)
            return lambda: torch.ops.bitsandbytes.gemm_4bit(A, packed, [N, K], nested, bs, "nf4", None, q8, code,
                                                            offset)  # fmt: skip


_matmul_cases()

# -- LLM.int8() (docs/semantics.md section 6) ----------------------------------------------------------------------


def _int8_cases() -> None:
    M, N, K = 64, 128, 512
    # row quantization: reads A (fp16), writes CA and the row statistics
    @case(f"int8_vectorwise_quant f16 {M}x{K}", 2 * M * K + M * K + 4 * M)
    def _():
        A = _randn(M * K, torch.float16, seed=3).reshape(M, K)
        return lambda: torch.ops.bitsandbytes.int8_vectorwise_quant(A, 0.0)

    for m in (1, M):
        # the fused product: reads both int8 operands and their statistics, writes the fp16 output
        @case(f"int8_scaled_mm f16 M={m} {N}x{K}", m * K + N * K + 4 * (m + N) + 2 * m * N)
        def _(m=m):
            g = torch.Generator().manual_seed(m)
            CA = torch.randint(-127, 128, (m, K), generator=g, dtype=torch.int8)
            CB = torch.randint(-127, 128, (N, K), generator=g, dtype=torch.int8)
            SCA, SCB = torch.rand(m, generator=g) + 0.5, torch.rand(N, generator=g) + 0.5
            return lambda: torch.ops.bitsandbytes.int8_scaled_mm(CA, CB, SCA, SCB, None, torch.float16)


_int8_cases()

# -- optimizers (docs/semantics.md section 5) -----------------------------------------------------------------------

OPTIM_N = 256 * 256


def _optimizer_cases() -> None:
    from bitsandbytes.functional import create_dynamic_map

    n, blocks = OPTIM_N, OPTIM_N // 256
    hyper = dict(beta1=0.9, beta2=0.999, beta3=0.0, alpha=0.0, eps=1e-8, step=3, lr=1e-3, weight_decay=0.01,
                 gnorm_scale=1.0, skip_zeros=False)  # fmt: skip

    def tensors(dtype: torch.dtype):
        p = _randn(n, torch.float32, seed=4).to(dtype)
        g = (0.1 * _randn(n, torch.float32, seed=5)).to(dtype)
        return p, g

    # The in-place buffers count once (their lines are read and written): the parameter, the gradient, the
    # states; for 8-bit also the two code tables and the per-block scales.
    for name, states, dt in (("adam", 2, "f32"), ("adam", 2, "f16"), ("lion", 1, "f16")):
        item = _DT[dt].itemsize

        @case(f"optimizer_update_8bit_blockwise {name} {dt} n={n}", 2 * item * n + states * (n + 4 * 256 + 4 * blocks))
        def _(name=name, states=states, dt=dt):
            p, g = tensors(_DT[dt])
            s1, s2 = torch.full((n,), 128, dtype=torch.uint8), torch.zeros(n, dtype=torch.uint8)
            a1, a2 = torch.full((blocks,), 0.05), torch.full((blocks,), 0.01)
            q1 = create_dynamic_map(signed=True)
            q2 = create_dynamic_map(signed=False)
            if states == 1:
                s2 = a2 = q2 = None
            return lambda: torch.ops.bitsandbytes.optimizer_update_8bit_blockwise(
                name, g, p, s1, s2, qmap1=q1, qmap2=q2, absmax1=a1, absmax2=a2, **hyper)

    for name, launches in (("adam", 1), ("lamb", 2)):
        # lamb: the update norm first (one more launch reading the gradient and the states), then the update

        @case(f"optimizer_update_32bit {name} f32 n={n}", 4 * 4 * n + (4 if launches == 2 else 0))
        def _(name=name, launches=launches):
            p, g = tensors(torch.float32)
            s1, s2 = torch.zeros(n), torch.full((n,), 1e-4)
            unorm = torch.zeros(1) if launches == 2 else None
            max_unorm = 1.0 if launches == 2 else 0.0
            return lambda: torch.ops.bitsandbytes.optimizer_update_32bit(
                name, g, p, s1, s2, unorm, max_unorm, float(p.norm()), **hyper)


_optimizer_cases()

# -- the measurement and the table ----------------------------------------------------------------------

COLUMNS = ("case", "kernels", "required bytes", "lines", "lines summed over threadgroups", "SIMD transactions",
           "ideal", "coalescing efficiency", "traffic efficiency")  # fmt: skip


@dataclass(frozen=True)
class Row:
    case: str
    kernels: str  # launched kernels, comma-separated
    required_bytes: int
    lines: int
    lines_summed: int
    transactions: int
    ideal: float
    coalescing: float  # ideal / transactions
    traffic: float  # required bytes / traffic bytes (largest traffic term, bnb_mps.emulator.profile)

    def cells(self) -> list[str]:
        return [self.case, self.kernels, str(self.required_bytes), str(self.lines), str(self.lines_summed),
                str(self.transactions), f"{self.ideal:.3f}".rstrip("0").rstrip("."), f"{self.coalescing:.3f}",
                f"{self.traffic:.3f}"]  # fmt: skip

    @classmethod
    def from_cells(cls, cells: list[str]) -> "Row":
        c = cells
        return cls(c[0], c[1], int(c[2]), int(c[3]), int(c[4]), int(c[5]), float(c[6]), float(c[7]), float(c[8]))


def measure(c: TrafficCase) -> Row:
    """Runs the case's op once under the profiler and returns its row."""
    from bnb_mps.emulator import summarize
    from bnb_mps.testing import use_emulated_kernels

    call = c.make()
    with use_emulated_kernels(profile=True, metal_version=c.metal_version) as kernels:
        call()
    if not kernels.profiles:
        raise AssertionError(f"{c.name}: the op launched no kernel")
    s = summarize(kernels.profiles, c.required_bytes)
    return Row(c.name, ", ".join(s["kernels"]), c.required_bytes, s["lines"], s["lines_summed_over_threadgroups"],
               s["simd_transactions"], s["simd_transactions_ideal"], s["coalescing_efficiency"] or 0.0,
               s["traffic_efficiency"] or 0.0)  # fmt: skip


def render(rows: list[Row]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(r.cells()) + " |" for r in rows]
    return "\n".join(lines)


def read_table(path: Path = TABLE) -> dict[str, Row]:
    """The recorded rows, by case name."""
    rows: dict[str, Row] = {}
    for line in path.read_text().splitlines():
        if not line.startswith("| ") or line.startswith("| case |"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != len(COLUMNS):
            raise ValueError(f"{path.name}: a row needs {len(COLUMNS)} cells: {line}")
        row = Row.from_cells(cells)
        if row.case in rows:
            raise ValueError(f"{path.name}: case {row.case!r} recorded twice")
        rows[row.case] = row
    return rows


def write_table(rows: list[Row], path: Path = TABLE) -> None:
    """Replaces the table in `path` (the text around it stays)."""
    text = path.read_text() if path.exists() else ""
    table = render(rows)
    block = re.compile(r"^\| case \|.*?(?=\n(?!\|)|\Z)", re.S | re.M)
    text = block.sub(lambda _: table, text, count=1) if block.search(text) else text.rstrip() + "\n\n" + table
    path.write_text(text.rstrip() + "\n")


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description="Measure the traffic gate's cases and print (or write) the table.")
    ap.add_argument("--write", action="store_true", help=f"rewrite {TABLE.name} with the measured rows")
    ap.add_argument("-k", metavar="TEXT", help="only cases whose name contains TEXT (print only)")
    ns = ap.parse_args(argv)
    import bitsandbytes  # noqa: F401  (defines the ops)

    names = [n for n in CASES if ns.k is None or ns.k in n]
    rows = [measure(CASES[n]) for n in names]
    if ns.write:
        if ns.k:
            ap.error("--write rewrites the whole table: do not combine it with -k")
        write_table(rows)
        print(f"wrote {len(rows)} rows to {TABLE}")
    else:
        print(render(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
