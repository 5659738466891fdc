"""Kernel benchmarks, one family of ops at a time.

On a Mac with a working mps device: time per call of each op on the tier bnb_mps selected (the route
tuning chose for the shape, bnb_mps.ops.tuning: the warm-up calls measure it), side by side with stock
bitsandbytes' own mps path (bnb_mps unregistered for that measurement) and, where
there is one, a dense PyTorch baseline; bandwidth achieved (the bytes an op must move, over its
time) and the share of the chip's peak bandwidth (bnb_mps.chips). Weights larger than the chip's
system-level cache are rotated between copies so that every call reads memory, not cache.

Elsewhere: no GPU time can be measured, and the script says so. It runs each op's kernels on the
emulated tier on small shapes and reports launches per call, bytes allocated per call beyond the
outputs, and host reads (the op layer runs on `meta` tensors, where any read of data fails); and
the kernels' memory traffic measured by the emulator's profiler (bnb_mps.emulator.Library.profile:
lines touched, SIMD-group transactions against the ideal, coalescing efficiency) with the time it
implies at a few chips' peak bandwidth and the efficiency against the case's required bytes.

    python scripts/bench_kernels.py [--families quant,...] [--short] [--json PATH] [--chart PATH]

Families register in FAMILIES below: a function that yields Case objects for the given mode.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Optional

import torch

# -- cases --------------------------------------------------------------------------------------------


@dataclass
class Case:
    """One op call to measure.

    `make(device)` builds the arguments on `device` and returns a zero-argument function that calls
    the op; `required_bytes` is what the op must move at least (inputs read + outputs written).
    `stock` says whether stock bitsandbytes can run it on mps (for the side-by-side column), and
    `baseline` optionally gives a dense PyTorch equivalent (`make`-style) for comparison.
    """

    family: str
    name: str
    make: Callable[[torch.device], Callable[[], object]]
    required_bytes: int
    stock: bool = True
    baseline: Optional[Callable[[torch.device], Callable[[], object]]] = None
    baseline_name: str = ""
    results: dict = field(default_factory=dict)


def _quant_cases(mode: str) -> Iterator[Case]:
    """Blockwise 8-bit and NF4/FP4 quantize / dequantize (fp16, blocksize 64)."""
    from bitsandbytes.functional import create_dynamic_map

    rows, cols = (4096, 4096) if mode == "gpu" else (256, 256)
    n = rows * cols
    code = create_dynamic_map(signed=True)
    blocks = math.ceil(n / 64)

    def quant4(device):
        A = torch.randn(rows, cols, dtype=torch.float16, device=device)
        return lambda: torch.ops.bitsandbytes.quantize_4bit(A, 64, "nf4", torch.uint8)

    def dequant4(device):
        A = torch.randn(rows, cols, dtype=torch.float16)
        packed, absmax = torch.ops.bitsandbytes.quantize_4bit(A, 64, "nf4", torch.uint8)
        packed, absmax = packed.to(device), absmax.to(device)
        return lambda: torch.ops.bitsandbytes.dequantize_4bit(packed, absmax, 64, "nf4", [rows, cols], torch.float16)

    def quant8(device):
        A = torch.randn(rows, cols, dtype=torch.float16, device=device)
        c = code.to(device)
        return lambda: torch.ops.bitsandbytes.quantize_blockwise(A, c, 64)

    def dequant8(device):
        A = torch.randn(rows, cols, dtype=torch.float16)
        q, absmax = torch.ops.bitsandbytes.quantize_blockwise(A, code, 64)
        q, absmax, c = q.to(device), absmax.to(device), code.to(device)
        return lambda: torch.ops.bitsandbytes.dequantize_blockwise(q, absmax, c, 64, torch.float16)

    shape = f"{rows}x{cols} f16 bs64"
    yield Case("quant", f"quantize_4bit nf4 {shape}", quant4, 2 * n + n // 2 + 4 * blocks)
    yield Case("quant", f"dequantize_4bit nf4 {shape}", dequant4, n // 2 + 4 * blocks + 2 * n)
    yield Case("quant", f"quantize_blockwise {shape}", quant8, 2 * n + n + 4 * blocks)
    # stock bitsandbytes has no mps kernel for dequantize_blockwise (its default one serves mps)
    yield Case("quant", f"dequantize_blockwise {shape}", dequant8, n + 4 * blocks + 2 * n)


def _gemm4bit_cases(mode: str) -> Iterator[Case]:
    """gemm_4bit (bnb.matmul_4bit's op) on double-quantized NF4 weights, blocksize 64, fp16 and bf16.

    On a Mac: the shapes of 7B-class models (N x K = out x in features) at M = 1, 8, 32 and 512
    rows, side by side with stock bitsandbytes' mps path and a dense fp16 `linear`. (Each route of a
    shape, the kernel variants among them, is measured by `python -m bnb_mps tune`.)
    Required bytes: packed weight + 8-bit absmax + nested absmax + A + output.
    Emulated: small shapes, one per built-in kernel path (gemv, small, mma), plain and nested absmax.
    """
    from bitsandbytes.functional import create_dynamic_map

    if mode == "gpu":
        shapes, rows = [(4096, 4096), (4096, 14336), (14336, 4096), (11008, 4096)], (1, 8, 32, 512)
        dtypes, nested_options = (torch.float16, torch.bfloat16), (True,)
    else:
        shapes, rows = [(96, 256)], (1, 8, 40)
        dtypes, nested_options = (torch.float16,), (False, True)
    code = create_dynamic_map(signed=True)
    blocksize = 64
    quantized: dict = {}  # (N, K, nested) -> CPU tensors, quantized once; every copy is a `.to(device)`
    dense_weights: dict = {}

    def weight(N, K, nested, device):
        key = (N, K, nested)
        if key not in quantized:
            W = torch.randn(N, K, dtype=torch.float16)
            packed, absmax = torch.ops.bitsandbytes.quantize_4bit(W, blocksize, "nf4", torch.uint8)
            if nested:
                offset = absmax.mean()
                q8, nested_absmax = torch.ops.bitsandbytes.quantize_blockwise(absmax - offset, code, 256)
                quantized[key] = [packed, nested_absmax, q8, code, offset]
            else:
                quantized[key] = [packed, absmax, None, None, None]
        packed, *scales = [t.to(device) if t is not None else None for t in quantized[key]]
        return packed, scales

    def case(N, K, M, dtype, nested):
        def make(device):
            packed, (absmax, q8, code8, offset) = weight(N, K, nested, device)
            A = torch.randn(M, K, dtype=dtype).to(device)
            return lambda: torch.ops.bitsandbytes.gemm_4bit(A, packed, [N, K], absmax, blocksize, "nf4", None, q8,
                                                            code8, offset)  # fmt: skip

        def dense(device):
            A = torch.randn(M, K, dtype=torch.float16, device=device)
            # A dense weight of 64 MB or more is beyond every system-level cache: one copy serves all
            # rotations (the rotation count follows the 4-bit case's bytes, 4x fewer).
            if 2 * N * K >= 64 << 20:
                W = dense_weights.setdefault((N, K, device.type), torch.randn(N, K, dtype=torch.float16, device=device))
            else:
                W = torch.randn(N, K, dtype=torch.float16, device=device)
            return lambda: torch.nn.functional.linear(A, W)

        nblocks = math.ceil(N * K / blocksize)
        scale_bytes = nblocks + 4 * math.ceil(nblocks / 256) if nested else 4 * nblocks
        required = (N * K + 1) // 2 + scale_bytes + M * K * dtype.itemsize + M * N * dtype.itemsize
        name = f"gemm_4bit nf4{' nested' if nested else ''} {str(dtype).removeprefix('torch.')} {N}x{K} M={M}"
        return Case("gemm4bit", name, make, required, baseline=dense if mode == "gpu" else None,
                    baseline_name="fp16 linear, dense weight")  # fmt: skip

    for dtype in dtypes:
        for N, K in shapes:
            for nested in nested_options:
                for M in rows:
                    yield case(N, K, M, dtype, nested)


def _int8_cases(mode: str) -> Iterator[Case]:
    """LLM.int8() linear layers, fp16 activations: the fused int8_scaled_mm on pre-quantized
    operands (weight [N, K] int8), and the whole inference step of a Linear8bitLt (row-quantize
    the activations with outlier threshold 6.0, then int8_mixed_scaled_mm). Baseline: fp16 linear
    (F.linear) on the same shapes; stock bitsandbytes' mps path is its default one (fp32 matmul of
    the int8 operands, then dequantization)."""
    import torch.nn.functional as F

    if mode == "gpu":
        shapes = [(m, n, k) for n, k in ((4096, 4096), (4096, 11008)) for m in (1, 32, 512)]
    else:
        shapes = [(m, 128, 256) for m in (1, 32, 64)]

    def quantized(M, N, K, device, outliers=False):
        g = torch.Generator().manual_seed(M + N + K)
        x = torch.randn(M, K, generator=g).half()
        if outliers:
            x[:, :: max(1, K // 8)] = 8.0  # a few outlier feature columns
        w = (torch.randn(N, K, generator=g) * 0.02).half()
        CA, SCA, _ = torch.ops.bitsandbytes.int8_vectorwise_quant(x, 0.0)
        CB, SCB, _ = torch.ops.bitsandbytes.int8_vectorwise_quant(w, 0.0)
        return [t.to(device) for t in (x, w, CA, SCA, CB, SCB)]

    for M, N, K in shapes:

        def scaled(device, M=M, N=N, K=K):
            _, _, CA, SCA, CB, SCB = quantized(M, N, K, device)
            return lambda: torch.ops.bitsandbytes.int8_scaled_mm(CA, CB, SCA, SCB, None, torch.float16)

        def step(device, M=M, N=N, K=K):
            x, _, _, _, CB, SCB = quantized(M, N, K, device, outliers=True)

            def call():
                CA, SCA, cols = torch.ops.bitsandbytes.int8_vectorwise_quant(x, 6.0)
                return torch.ops.bitsandbytes.int8_mixed_scaled_mm(x, CA, CB, SCA, SCB, cols, None)

            return call

        def fp16(device, M=M, N=N, K=K):
            x, w, *_ = quantized(M, N, K, device)
            return lambda: F.linear(x, w)

        shape = f"M={M} {N}x{K}"
        # bytes: the int8 weight, the int8 activations and their stats, the fp16 output
        moved = N * K + M * K + 4 * (M + N) + 2 * M * N
        yield Case("int8", f"int8_scaled_mm {shape}", scaled, moved, baseline=fp16, baseline_name="fp16 linear")
        yield Case("int8", f"Linear8bitLt step (t=6.0) {shape}", step, moved + 2 * M * K, baseline=fp16,
                   baseline_name="fp16 linear")  # fmt: skip


#: family name -> function(mode) yielding its cases; mode is "gpu" (a Mac) or "emulated".
FAMILIES: dict[str, Callable[[str], Iterator[Case]]] = {
    "quant": _quant_cases,
    "gemm4bit": _gemm4bit_cases,
    "int8": _int8_cases,
}

# -- measuring on a Mac -------------------------------------------------------------------------------


def time_mps(fn: Callable[[], object], *, warmup: int, iters: int, repeats: int) -> float:
    """Median over `repeats` of the mean GPU time per call in milliseconds (mps events)."""
    for _ in range(warmup):
        fn()
    torch.mps.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.mps.Event(enable_timing=True), torch.mps.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.mps.synchronize()
        times.append(start.elapsed_time(end) / iters)
    return statistics.median(times)


# Bytes of working set above which the system-level cache (at most 96 MB on current chips) cannot
# hold the data: cases below it are rotated over enough copies to reach it.
ROTATE_BYTES = 512 << 20


def rotated(make: Callable[[torch.device], Callable[[], object]], device, required_bytes: int):
    """A call function that cycles over enough independent copies of the case's data."""
    copies = max(1, math.ceil(ROTATE_BYTES / max(required_bytes, 1)))
    calls = [make(device) for _ in range(min(copies, 64))]
    state = {"i": 0}

    def call():
        state["i"] = (state["i"] + 1) % len(calls)
        return calls[state["i"]]()

    return call


def measure_gpu(cases: list[Case], short: bool) -> None:
    import bnb_mps
    from bnb_mps import chips

    chip = chips.detect()
    device = torch.device("mps")
    iters, repeats = (5, 3) if short else (20, 5)
    for case in cases:
        ours = rotated(case.make, device, case.required_bytes)
        case.results["ms"] = time_mps(ours, warmup=3, iters=iters, repeats=repeats)
        if case.stock:
            bnb_mps.unregister()
            try:
                stock = rotated(case.make, device, case.required_bytes)
                case.results["stock_ms"] = time_mps(stock, warmup=3, iters=iters, repeats=repeats)
            except Exception as e:  # stock bitsandbytes cannot run this op on mps
                case.results["stock_error"] = f"{type(e).__name__}: {e}"[:120]
            finally:
                bnb_mps.register()
        if case.baseline is not None:
            base = rotated(case.baseline, device, case.required_bytes)
            case.results["baseline_ms"] = time_mps(base, warmup=3, iters=iters, repeats=repeats)
        gbps = case.required_bytes / (case.results["ms"] * 1e-3) / 1e9
        case.results["gbps"] = gbps
        if chip is not None and chip.bandwidth_gbps:
            case.results["pct_of_peak"] = 100 * gbps / chip.bandwidth_gbps


# -- elsewhere: the emulated tier ---------------------------------------------------------------------


def measure_emulated(cases: list[Case]) -> None:
    from bnb_mps.testing import AllocationCounter, use_emulated_kernels

    cpu, meta = torch.device("cpu"), torch.device("meta")
    for case in cases:
        call = case.make(cpu)
        with use_emulated_kernels() as kernels:
            call()  # warm-up: compiles the kernel library once
            kernels.launches.clear()
            with AllocationCounter() as alloc:
                out = call()
        outputs = sum(t.untyped_storage().nbytes() for t in torch.utils._pytree.tree_leaves(out)
                      if isinstance(t, torch.Tensor))  # fmt: skip
        case.results["launches"] = len(kernels.launches)
        case.results["kernels"] = sorted(set(kernels.launched))
        case.results["extra_alloc_bytes"] = alloc.bytes - outputs
        case.results["host_reads"] = _host_reads_on_meta(case, meta)
        case.results["profile"] = profile_case(case, call)


def profile_case(case: Case, call: Callable[[], object]) -> dict:
    """The memory traffic of one call's kernels (bnb_mps.emulator.summarize), or why there is none."""
    from bnb_mps.emulator import EmulatorError, summarize
    from bnb_mps.testing import use_emulated_kernels

    try:
        with use_emulated_kernels(profile=True) as kernels:
            call()
    except EmulatorError as e:  # e.g. no clang to build the instrumented kernels
        return {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"}
    summary = summarize(kernels.profiles, case.required_bytes)
    summary["launches"] = [p.to_dict() for p in kernels.profiles]
    return summary


def _host_reads_on_meta(case: Case, meta: torch.device) -> str:
    """'none' when the op layer serves the call on meta tensors (which hold no data to read)."""
    from bnb_mps import ops, registration
    from bnb_mps.testing import RecordingExecutor

    call = case.make(meta)
    recorder = RecordingExecutor()
    registration.register("Meta", executor=recorder, names=[n for n, op in ops.OPS.items() if op.kernel is not None])
    try:
        call()
    except Exception as e:
        return f"yes ({type(e).__name__}: {str(e)[:60]})"
    finally:
        registration.unregister("Meta")
    return "none" if recorder.launches else "not checked (no kernel launched)"


# -- output -------------------------------------------------------------------------------------------


def table(cases: list[Case], mode: str) -> str:
    if mode == "gpu":
        head = "| op | ours ms | GB/s | % peak | stock bnb ms | speed-up vs stock | baseline ms |"
        rows = [head, "|" + "---|" * 7]
        for c in cases:
            r = c.results
            stock = f"{r['stock_ms']:.3f}" if "stock_ms" in r else r.get("stock_error", "n/a")
            speedup = f"{r['stock_ms'] / r['ms']:.2f}x" if "stock_ms" in r else ""
            base = f"{r['baseline_ms']:.3f} ({c.baseline_name})" if "baseline_ms" in r else ""
            pct = f"{r['pct_of_peak']:.0f}%" if "pct_of_peak" in r else "?"
            rows.append(f"| {c.name} | {r['ms']:.3f} | {r['gbps']:.1f} | {pct} | {stock} | {speedup} | {base} |")
        return "\n".join(rows)
    head = "| op | launches | bytes allocated beyond outputs | host reads | kernels |"
    rows = [head, "|" + "---|" * 5]
    for c in cases:
        r = c.results
        rows.append(f"| {c.name} | {r['launches']} | {r['extra_alloc_bytes']} | {r['host_reads']} | "
                    f"{', '.join(r['kernels'])} |")  # fmt: skip
    return "\n".join(rows) + "\n\n" + traffic_table(cases)


def traffic_table(cases: list[Case]) -> str:
    """The emulator's memory-traffic figures per case (see bnb_mps.emulator.profile)."""
    from bnb_mps.emulator.profile import SHOWN_CHIPS

    head = ("| op | required | lines (unique / summed over threadgroups) | traffic | SIMD transactions / ideal | "
            "coalescing | traffic efficiency | " + " | ".join(f"est. {c}" for c in SHOWN_CHIPS) + " |")  # fmt: skip
    rows = ["Memory traffic measured by the emulator (128-byte lines; estimated time = traffic / peak bandwidth, "
            "traffic efficiency = required / traffic):", "", head, "|" + "---|" * (7 + len(SHOWN_CHIPS))]
    for c in cases:
        p = c.results.get("profile") or {"error": "not profiled"}
        if "error" in p:
            rows.append(f"| {c.name} | {c.required_bytes} | {p['error']} |" + " |" * (5 + len(SHOWN_CHIPS)))
            continue
        coal = "n/a" if p["coalescing_efficiency"] is None else f"{p['coalescing_efficiency']:.3f}"
        eff = "n/a" if p["traffic_efficiency"] is None else f"{p['traffic_efficiency']:.3f}"
        times = " | ".join(f"{p['estimated_time_s'][chip] * 1e6:.2f} us" for chip in SHOWN_CHIPS)
        rows.append(f"| {c.name} | {c.required_bytes} | {p['lines']} / {p['lines_summed_over_threadgroups']} | "
                    f"{p['traffic_bytes']} | {p['simd_transactions']} / {p['simd_transactions_ideal']:g} | {coal} | "
                    f"{eff} | {times} |")  # fmt: skip
    return "\n".join(rows)


def chart(cases: list[Case], path: str) -> Optional[str]:
    """Bar chart of GB/s (ours vs stock) per op; None if matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    names = [c.name for c in cases]
    ours = [c.results["gbps"] for c in cases]
    stock = [c.required_bytes / (c.results["stock_ms"] * 1e-3) / 1e9 if "stock_ms" in c.results else 0 for c in cases]
    fig, ax = plt.subplots(figsize=(10, 0.5 * len(cases) + 1.5))
    y = range(len(cases))
    ax.barh([i + 0.2 for i in y], ours, height=0.4, label="bnb-mps")
    ax.barh([i - 0.2 for i in y], stock, height=0.4, label="stock bitsandbytes (mps)")
    ax.set_yticks(list(y), names, fontsize=7)
    ax.set_xlabel("GB/s (required bytes / time)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default=",".join(FAMILIES),
                        help=f"comma-separated families (default: all of {', '.join(FAMILIES)})")
    parser.add_argument("--short", action="store_true", help="fewer repetitions (a quick look)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--chart", metavar="PATH", default="bench_kernels.png", help="PNG chart (Mac only)")
    parser.add_argument("--no-chart", action="store_true")
    ns = parser.parse_args(argv)
    unknown = [f for f in ns.families.split(",") if f not in FAMILIES]
    if unknown:
        parser.error(f"unknown families {unknown}; choose from {', '.join(FAMILIES)}")

    import bitsandbytes  # noqa: F401  (defines the ops and registers bnb_mps)

    mode = "gpu" if torch.backends.mps.is_available() else "emulated"
    cases = [c for f in ns.families.split(",") for c in FAMILIES[f](mode)]
    if mode == "gpu":
        import bnb_mps

        tiers = {row["tier"] for row in bnb_mps.backend_info().values()}
        print(f"tiers serving bitsandbytes ops here: {', '.join(sorted(tiers))}")
        measure_gpu(cases, ns.short)
    else:
        print("No mps device: no GPU time was measured. The kernels ran on the emulated tier (small shapes);")
        print("the tables show launches, allocations and host reads per call, and the memory traffic the")
        print("emulator measured with the time it implies at peak bandwidth: estimates, not speed.\n")
        measure_emulated(cases)
    print(table(cases, mode))
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump({"mode": mode, "cases": [{"family": c.family, "name": c.name, "required_bytes": c.required_bytes,
                                                 **c.results} for c in cases]}, f, indent=2)  # fmt: skip
    if mode == "gpu" and not ns.no_chart:
        written = chart(cases, ns.chart)
        print(f"\nchart: {written}" if written else "\n(no chart: matplotlib is not installed)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
