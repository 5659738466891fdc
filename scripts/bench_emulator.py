#!/usr/bin/env python3
"""Emulator speed: the project's product kernels under the emulator next to torch.matmul, in one run.

For each shape M x K x N (A [M, K] times a weight [N, K], M*K*N multiply-accumulates) the script
times every product kernel launched straight on the emulated tier, whatever kernel the op layer
would pick for that shape:

    gemv_4bit    bnb_gemv_4bit_absmax_f16         NF4, fp16 A, blocksize 64 (needs K % 32 == 0)
    batch_4bit   bnb_gemm_4bit_batch_absmax_f16   the same (needs K % 16 == 0)
    mma_4bit     bnb_gemm_4bit_mma_absmax_f16     the same, simdgroup_matrix tiles (any K)
    int8_gemv    bnb_int8_linear_matmul_gemv1/4   int8 A and B, int32 out (_k16 when K % 16 == 0)
    int8_tiled   bnb_int8_linear_matmul_tile32/64 the same, simdgroup_matrix tiles (_k16 likewise)

and torch.matmul in float32 on as many threads as the emulator has workers (BNB_MPS_EMU_THREADS,
default: the CPU's hardware threads), before and after the kernels of each shape (the faster of
the two is the reference, so that a busy machine does not flatter the emulator). A kernel's time
is its best launch (repeats until --min-time seconds or --repeat launches), torch.matmul's its best
call (at least 50 calls). Reported: the times, million multiply-accumulates per second, and each
kernel's rate as a fraction of torch.matmul's. The machine's load average is printed with the
figures: other work slows both sides, torch.matmul's two threads (which meet at every call) more
than the emulator's, so compare ratios from one run, on a machine as quiet as can be had.

    python scripts/bench_emulator.py [--shapes 256x512x512,1024x1024x1024] [--kernels int8_tiled,mma_4bit]
                                     [--repeat 3] [--min-time 1.0] [--check] [--json PATH] [--micro]

--check compares each kernel's output with a plain PyTorch product (exact for int8, a tolerance
for the 4-bit kernels): slow for large shapes. --micro adds the emulator's own figures: simulated
threads per second on a 1024 x 1024 GEMV-shaped test kernel (tests/emulator/kernels/bench.metal),
the time Library.profile takes on it, and the cost of a threadgroup_barrier of 256 threads.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

from bnb_mps.kernel_args import uint32

BENCH_KERNELS = Path(__file__).resolve().parents[1] / "tests" / "emulator" / "kernels" / "bench.metal"
DEFAULT_SHAPES = "256x512x512,1024x1024x1024"

# --- the product kernels ------------------------------------------------------------------------
# Geometry and buffers as csrc/kernels/gemm_4bit.metal and int8.metal document them (and the op
# layer launches them: bnb_mps/ops/matmul_4bit.py, int8.py).

NF4 = 1  # `table` of the 4-bit kernels
BLOCKSIZE = 64
AVEC = 2  # `flags`: A 16-byte aligned at every row start


@dataclass
class Launch:
    kernel: str  # host name
    grid: tuple
    threadgroup: tuple
    args: list
    out: torch.Tensor


@dataclass
class Inputs:
    M: int
    K: int
    N: int
    a_half: torch.Tensor
    packed: torch.Tensor
    absmax: torch.Tensor
    a_int8: torch.Tensor
    b_int8: torch.Tensor


def make_inputs(M: int, K: int, N: int, seed: int = 0) -> Inputs:
    g = torch.Generator().manual_seed(seed)
    return Inputs(
        M, K, N,
        a_half=torch.randn(M, K, generator=g).half(),
        packed=torch.randint(0, 256, ((N * K + 1) // 2,), dtype=torch.uint8, generator=g),
        absmax=torch.rand(-(-N * K // BLOCKSIZE), generator=g) + 0.5,
        a_int8=torch.randint(-127, 128, (M, K), dtype=torch.int8, generator=g),
        b_int8=torch.randint(-127, 128, (N, K), dtype=torch.int8, generator=g),
    )  # fmt: skip


def _fourbit(name: str, grid: tuple, threadgroup: tuple, x: Inputs) -> Launch:
    out = torch.zeros(x.M, x.N, dtype=torch.float16)
    unused = torch.zeros(16, dtype=torch.uint8)  # nested-absmax buffers, the code table, bias
    flags = AVEC if x.K % 8 == 0 else 0  # (torch's allocations are 64-byte aligned)
    args = [x.a_half, x.packed, x.absmax, unused, unused.view(torch.float32), unused, unused.view(torch.float32),
            x.a_half, out, uint32(x.M), uint32(x.N), uint32(x.K), uint32(x.K), uint32(BLOCKSIZE.bit_length() - 1),
            uint32(NF4), uint32(0), uint32(flags)]  # fmt: skip
    return Launch(name, grid, threadgroup, args, out)


def gemv_4bit(x: Inputs) -> Launch:
    return _fourbit("bnb_gemv_4bit_absmax_f16", (-(-x.N // 8), x.M, 1), (64, 1, 1), x)


def batch_4bit(x: Inputs) -> Launch:
    return _fourbit("bnb_gemm_4bit_batch_absmax_f16", (-(-x.N // 8), -(-x.M // 8), 1), (128, 1, 1), x)


def mma_4bit(x: Inputs) -> Launch:
    return _fourbit("bnb_gemm_4bit_mma_absmax_f16", (-(-x.M // 32), -(-x.N // 64), 1), (128, 1, 1), x)


def _int8(path: str, tile: tuple, x: Inputs) -> Launch:
    out = torch.zeros(x.M, x.N, dtype=torch.int32)
    name = f"bnb_int8_linear_matmul_{path}" + ("_k16" if x.K % 16 == 0 else "")
    grid = (-(-x.N // tile[1]), -(-x.M // tile[0]), 1)
    return Launch(name, grid, (128, 1, 1), [x.a_int8, x.b_int8, out, uint32(x.M), uint32(x.N), uint32(x.K)], out)


def int8_gemv(x: Inputs) -> Launch:
    return _int8("gemv1", (1, 16), x) if x.M == 1 else _int8("gemv4", (4, 16), x)


def int8_tiled(x: Inputs) -> Launch:
    return _int8("tile32", (32, 64), x) if x.M <= 32 else _int8("tile64", (64, 64), x)


@dataclass
class Product:
    make: Callable[[Inputs], Launch]
    requires: Optional[Callable[[Inputs], Optional[str]]] = None  # why a shape cannot run, or None


KERNELS: dict[str, Product] = {
    "gemv_4bit": Product(gemv_4bit, lambda x: None if x.K % 32 == 0 else "needs K % 32 == 0"),
    "batch_4bit": Product(batch_4bit, lambda x: None if x.K % 16 == 0 else "needs K % 16 == 0"),
    "mma_4bit": Product(mma_4bit),
    "int8_gemv": Product(int8_gemv),
    "int8_tiled": Product(int8_tiled),
}


# --- references (--check) ---------------------------------------------------------------------

NF4_TABLE = torch.tensor([-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
                          -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
                          0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
                          0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0])  # fmt: skip


def check(name: str, launch: Launch, x: Inputs) -> None:
    """Raises AssertionError unless the kernel's output is the product (a plain PyTorch reference)."""
    if name.startswith("int8"):
        want = (x.a_int8.double() @ x.b_int8.double().T).to(torch.int32)
        assert torch.equal(launch.out, want), f"{name}: int32 products differ from the reference"
        return
    nibbles = torch.stack([x.packed >> 4, x.packed & 15], dim=1).reshape(-1)[: x.N * x.K].long()
    scale = x.absmax.repeat_interleave(BLOCKSIZE)[: x.N * x.K]
    w = (NF4_TABLE[nibbles] * scale).view(x.N, x.K)
    want = x.a_half.float() @ w.T
    got = launch.out.float()
    tol = 2e-3 * want.abs().max().item() + 1e-2
    err = (got - want).abs().max().item()
    assert err <= tol, f"{name}: max error {err:.3g} against the reference (tolerance {tol:.3g})"


# --- timing -----------------------------------------------------------------------------------


def best_time(fn: Callable[[], object], repeat: int, min_time: float) -> float:
    """The best of up to `repeat` runs, stopping once `min_time` seconds have been spent."""
    best, spent, runs = float("inf"), 0.0, 0
    while runs < max(1, repeat) and (runs == 0 or spent < min_time):
        t = time.perf_counter()
        fn()
        dt = time.perf_counter() - t
        best, spent, runs = min(best, dt), spent + dt, runs + 1
    return best


def torch_matmul_time(M: int, K: int, N: int, repeat: int, min_time: float) -> float:
    """Seconds per torch.matmul call: its best call (at least 50 calls, or --min-time seconds)."""
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(M, K, generator=g), torch.randn(K, N, generator=g)
    torch.matmul(a, b)  # warm-up
    return best_time(lambda: torch.matmul(a, b), max(repeat, 50), min_time)


def parse_shape(text: str) -> tuple[int, int, int]:
    try:
        M, K, N = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a shape is MxKxN, e.g. 256x512x512, got {text!r}") from None
    if min(M, K, N) < 1:
        raise argparse.ArgumentTypeError(f"shape {text!r}: every dimension must be at least 1")
    return M, K, N


def ratio_text(ratio: float) -> str:
    return f"1/{1 / ratio:.0f}" if 0 < ratio < 1 else f"{ratio:.2f}x"


def measure(shapes, names, repeat: int, min_time: float, do_check: bool, threads: int) -> list[dict]:
    from bnb_mps.executors import emulated

    executor = emulated.load()

    def launcher(launch: Launch) -> Callable[[], None]:
        return lambda: executor.launch(launch.kernel, grid=launch.grid, threadgroup=launch.threadgroup,
                                       args=launch.args)  # fmt: skip

    # Warm-up on a small shape: the kernels' compile units load on their first launch.
    for name in names:
        for K in (32, 48):
            tiny = make_inputs(8, K, 8)
            if not (KERNELS[name].requires and KERNELS[name].requires(tiny)):
                launcher(KERNELS[name].make(tiny))()
    results = []
    header = f"{'shape':<18} {'kernel':<13} {'launched':<36} {'seconds':>10} {'M MAC/s':>11} {'vs torch':>9}"
    print(header)
    print("-" * len(header), flush=True)
    for M, K, N in shapes:
        macs = M * K * N
        shape = f"{M}x{K}x{N}"
        x = make_inputs(M, K, N)
        print(f"  ({shape}: torch.matmul)", file=sys.stderr, flush=True)
        t_torch = torch_matmul_time(M, K, N, repeat, min_time)
        kernels = []
        for name in names:
            product = KERNELS[name]
            why = product.requires(x) if product.requires else None
            if why:
                kernels.append({"name": name, "skipped": why})
                continue
            launch = product.make(x)
            run = launcher(launch)
            print(f"  ({shape}: {name}, {launch.kernel})", file=sys.stderr, flush=True)
            seconds = best_time(run, repeat, min_time)
            if do_check:
                check(name, launch, x)
            kernels.append({"name": name, "kernel": launch.kernel, "seconds": seconds,
                            "mmacs_per_s": macs / seconds / 1e6})
        t_torch = min(t_torch, torch_matmul_time(M, K, N, repeat, min_time))
        torch_rate = macs / t_torch / 1e6
        print(f"{shape:<18} {'torch.matmul':<13} {f'float32, {threads} threads':<36} {t_torch:>10.5f} {torch_rate:>11.1f}")
        for k in kernels:
            if "skipped" in k:
                print(f"{'':<18} {k['name']:<13} {'(' + k['skipped'] + ')':<36}")
                continue
            k["ratio"] = k["mmacs_per_s"] / torch_rate
            print(f"{'':<18} {k['name']:<13} {k['kernel']:<36} {k['seconds']:>10.4f} {k['mmacs_per_s']:>11.1f} "
                  f"{ratio_text(k['ratio']):>9}")  # fmt: skip
        sys.stdout.flush()
        results.append({"M": M, "K": K, "N": N, "macs": macs,
                        "torch_matmul": {"seconds": t_torch, "mmacs_per_s": torch_rate}, "kernels": kernels})
    return results


# --- the emulator's own figures (--micro) ------------------------------------------------------


def micro(repeat: int) -> dict:
    from bnb_mps import emulator

    lib = emulator.load(BENCH_KERNELS)
    rows = k = 1024
    g = torch.Generator().manual_seed(0)
    w = torch.randint(0, 2**31 - 1, (rows * k // 8,), dtype=torch.int32, generator=g)
    absmax = torch.rand(rows * k // 64, generator=g)
    code = torch.linspace(-1, 1, 16)
    x = torch.randn(k, generator=g)
    y = torch.zeros(rows)
    tg = 64  # two simdgroups = two rows per threadgroup
    threads = rows * 32
    args = [w, absmax, code, x, y, uint32(k)]
    run = lambda: lib.launch("gemv_4bit", grid=rows // 2, threadgroup=tg, args=args)
    run()
    times = [best_time(run, 1, 0) for _ in range(repeat)]
    best, med = min(times), statistics.median(times)
    out = {"gemv_threads": threads, "gemv_best_s": best, "gemv_median_s": med, "threads_per_s": threads / best}
    print(f"gemv 1024x1024 4-bit (bench.metal): {threads} threads, best {best * 1e3:.2f} ms, median {med * 1e3:.2f} ms, "
          f"{threads / best / 1e6:.2f} M simulated threads/s")  # fmt: skip
    profile = lambda: lib.profile("gemv_4bit", grid=rows // 2, threadgroup=tg, args=args)
    try:
        profile()
    except emulator.CompileError as e:
        print(f"profile: not measured ({str(e).splitlines()[0]})")
    else:
        pbest = min(best_time(profile, 1, 0) for _ in range(max(3, repeat // 4)))
        out["profile_best_s"] = pbest
        print(f"profile of the same gemv: best {pbest * 1e3:.2f} ms ({pbest / best:.1f}x the launch)")
    bar = torch.zeros(256)
    n_bar = 2000
    t0 = min(best_time(lambda: lib.launch("barriers", grid=1, threadgroup=256, args=[bar, uint32(0)]), 1, 0)
             for _ in range(repeat))  # fmt: skip
    t1 = min(best_time(lambda: lib.launch("barriers", grid=1, threadgroup=256, args=[bar, uint32(n_bar)]), 1, 0)
             for _ in range(max(3, repeat // 4)))  # fmt: skip
    out["barrier_us"] = (t1 - t0) / n_bar * 1e6
    print(f"threadgroup_barrier, 256 threads: {out['barrier_us']:.2f} us per barrier")
    return out


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=DEFAULT_SHAPES,
                    help=f"comma-separated MxKxN shapes (default {DEFAULT_SHAPES})")
    ap.add_argument("--kernels", default=",".join(KERNELS), help=f"comma-separated, of {', '.join(KERNELS)}")
    ap.add_argument("--repeat", type=int, default=3, help="at most this many runs of each (the best counts)")
    ap.add_argument("--min-time", type=float, default=1.0, help="stop repeating once this many seconds are spent")
    ap.add_argument("--check", action="store_true", help="compare every output with a PyTorch reference")
    ap.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    ap.add_argument("--micro", action="store_true", help="also measure the emulator's own figures (see above)")
    args = ap.parse_args(argv)
    try:
        shapes = [parse_shape(s) for s in args.shapes.split(",") if s.strip()]
    except argparse.ArgumentTypeError as e:
        ap.error(f"--shapes: {e}")
    names = [n.strip() for n in args.kernels.split(",") if n.strip()]
    unknown = [n for n in names if n not in KERNELS]
    if unknown:
        ap.error(f"unknown kernels {', '.join(unknown)}; choose from {', '.join(KERNELS)}")
    if args.repeat < 1:
        ap.error("--repeat must be at least 1")
    if args.min_time < 0:
        ap.error("--min-time must not be negative")

    from bnb_mps.emulator.library import _runtime

    threads = int(_runtime().worker_count())
    torch.set_num_threads(threads)
    load_start = os.getloadavg()
    print(f"emulator: {threads} worker threads; torch.matmul: float32, {torch.get_num_threads()} threads; "
          f"load average {load_start[0]:.2f} on {os.cpu_count()} CPUs")  # fmt: skip
    report = {"machine": {"platform": platform.platform(), "processor": platform.processor(), "cpus": os.cpu_count()},
              "threads": threads, "loadavg_start": list(load_start)}  # fmt: skip
    report["shapes"] = measure(shapes, names, args.repeat, args.min_time, args.check, threads)
    if args.micro:
        report["micro"] = micro(max(args.repeat, 3))
    report["loadavg_end"] = list(os.getloadavg())
    print(f"load average at the end: {report['loadavg_end'][0]:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
