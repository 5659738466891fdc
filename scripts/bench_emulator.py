#!/usr/bin/env python3
"""Emulator speed: simulated threads per second on a 1024 x 1024 4-bit GEMV-shaped kernel
(32,768 threads: one 32-thread simdgroup per row, 16 weights per thread per step, a simd_sum
at the end), the time `Library.profile` takes on the same dispatch, and the cost of one
threadgroup_barrier in a 256-thread threadgroup.

    python scripts/bench_emulator.py [--repeat 20]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from bnb_mps import emulator
from bnb_mps.kernel_args import uint32

KERNELS = Path(__file__).resolve().parents[1] / "tests" / "emulator" / "kernels" / "bench.metal"


def best_of(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times), statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=20)
    args = ap.parse_args()
    lib = emulator.load(KERNELS)

    rows = k = 1024
    g = torch.Generator().manual_seed(0)
    w = torch.randint(0, 2**31 - 1, (rows * k // 8,), dtype=torch.int32, generator=g)
    absmax = torch.rand(rows * k // 64, generator=g)
    code = torch.linspace(-1, 1, 16)
    x = torch.randn(k, generator=g)
    y = torch.zeros(rows)
    tg = 64  # two simdgroups = two rows per threadgroup
    threads = rows * 32
    run = lambda: lib.launch("gemv_4bit", grid=rows // 2, threadgroup=tg, args=[w, absmax, code, x, y, uint32(k)])
    run()
    best, med = best_of(run, args.repeat)
    print(f"gemv 1024x1024 4-bit: {threads} threads, best {best * 1e3:.2f} ms, median {med * 1e3:.2f} ms, "
          f"{threads / best / 1e6:.2f} M simulated threads/s (best), {threads / med / 1e6:.2f} M/s (median)")

    # The profiler (Library.profile) runs an instrumented build of the same kernel.
    profile = lambda: lib.profile("gemv_4bit", grid=rows // 2, threadgroup=tg, args=[w, absmax, code, x, y, uint32(k)])
    try:
        profile()
    except emulator.CompileError as e:
        print(f"profile: not measured ({str(e).splitlines()[0]})")
    else:
        pbest, pmed = best_of(profile, max(3, args.repeat // 4))
        print(f"profile of the same gemv: best {pbest * 1e3:.2f} ms, median {pmed * 1e3:.2f} ms "
              f"({pbest / best:.1f}x the launch, best to best)")

    out = torch.zeros(256)
    n_bar = 2000
    t0, _ = best_of(lambda: lib.launch("barriers", grid=1, threadgroup=256, args=[out, uint32(0)]), args.repeat)
    t1, _ = best_of(lambda: lib.launch("barriers", grid=1, threadgroup=256, args=[out, uint32(n_bar)]), max(3, args.repeat // 4))
    print(f"threadgroup_barrier, 256 threads: {(t1 - t0) / n_bar * 1e6:.2f} us per barrier")
    print(f"worker threads: {emulator.library._runtime().worker_count()}")


if __name__ == "__main__":
    main()
