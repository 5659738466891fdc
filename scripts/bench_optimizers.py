"""Optimizer step benchmark: bitsandbytes' 8-bit optimizers on bnb_mps' kernels vs torch.optim.

On a Mac with a working mps device: milliseconds per optimizer step (wall clock over many steps,
the device synchronised once at the end, so it is what a training loop sees), the bandwidth that
implies (the bytes a step must move: parameters, gradients and states, read and written, over the
time), its share of the chip's peak bandwidth (bnb_mps.chips), and the memory the optimizer
states take, for bitsandbytes' AdamW8bit and Lion8bit (on bnb_mps), bitsandbytes' 32-bit AdamW
(on bnb_mps) and torch.optim.AdamW (foreach, and fused where this torch has it on mps), on
10 M to 1 B parameters (as far as the device's recommended memory allows). Parameters are split
into tensors of at most 16 M elements (a 4096 x 4096 layer), one kernel launch each per step.
Writes a table, and a PNG chart (ms per step and state memory against parameter count).

Elsewhere: no GPU time can be measured, and the script says so. It runs the same optimizers on
the emulated tier with small tensors and reports kernel launches per step, bytes allocated per
step, and whether the op layer reads device data on the host (checked on `meta` tensors).

    python scripts/bench_optimizers.py [--sizes 10M,100M,1B] [--dtype fp32|bf16] [--steps N] [--short]
                                       [--json PATH] [--chart PATH] [--no-chart]
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Optional

import torch

CHUNK = 1 << 24  # elements per parameter tensor (16 M: a 4096 x 4096 layer)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class Config:
    """One optimizer to measure: `make(params)` builds it; `step_bytes(n, itemsize)` is what one step
    must move for n parameters of `itemsize` bytes (read + write)."""

    name: str
    make: Callable[[list], torch.optim.Optimizer]
    step_bytes: Callable[[int, int], int]
    ours: bool  # runs bnb_mps' kernels
    results: dict = field(default_factory=dict)


def _blocks(n: int) -> int:
    return -(-n // 256)


def configs() -> list[Config]:
    import bitsandbytes as bnb

    out = [
        # g read, p read + write, two 1-byte states read + write, two absmax read + write
        Config("bnb AdamW8bit (bnb-mps)", lambda ps: bnb.optim.AdamW8bit(ps),
               lambda n, b: 3 * n * b + 4 * n + 16 * _blocks(n), True),
        # g, p r/w, one state r/w, one absmax r/w
        Config("bnb Lion8bit (bnb-mps)", lambda ps: bnb.optim.Lion8bit(ps),
               lambda n, b: 3 * n * b + 2 * n + 8 * _blocks(n), True),
        # g, p r/w, two float32 states r/w
        Config("bnb AdamW 32-bit (bnb-mps)", lambda ps: bnb.optim.AdamW(ps), lambda n, b: 3 * n * b + 16 * n, True),
        Config("torch AdamW (foreach)", lambda ps: torch.optim.AdamW(ps, foreach=True),
               lambda n, b: 3 * n * b + 4 * n * b, False),
        Config("torch AdamW (fused)", lambda ps: torch.optim.AdamW(ps, fused=True),
               lambda n, b: 3 * n * b + 4 * n * b, False),
    ]  # fmt: skip
    return out


def parse_size(s: str) -> int:
    s = s.strip().upper()
    mult = {"K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9}.get(s[-1], 1)
    return int(float(s[:-1] if s[-1] in "KMBG" else s) * mult)


def make_params(n: int, dtype: torch.dtype, device) -> list[torch.nn.Parameter]:
    sizes = [CHUNK] * (n // CHUNK) + ([n % CHUNK] if n % CHUNK else [])
    params = []
    for k in sizes:
        p = torch.nn.Parameter(torch.randn(k, dtype=dtype, device=device) * 0.02)
        p.grad = torch.randn(k, dtype=dtype, device=device) * 1e-3
        params.append(p)
    return params


def state_bytes(opt: torch.optim.Optimizer) -> int:
    seen, total = set(), 0
    for st in opt.state.values():
        for v in st.values():
            if torch.is_tensor(v) and v.untyped_storage().data_ptr() not in seen:
                seen.add(v.untyped_storage().data_ptr())
                total += v.untyped_storage().nbytes()
    return total


def fits(n: int, itemsize: int, budget: Optional[int]) -> bool:
    """p, g and the largest states (two float32 per parameter, torch AdamW's) within the budget."""
    return budget is None or n * (2 * itemsize + 8) * 1.1 < budget


# -- on a Mac -------------------------------------------------------------------------------------------


def measure_gpu(sizes: list[int], dtype: torch.dtype, steps: int, warmup: int) -> list[dict]:
    from bnb_mps import chips

    chip = chips.detect()
    budget = torch.mps.recommended_max_memory() if hasattr(torch.mps, "recommended_max_memory") else None
    rows = []
    itemsize = torch.tensor([], dtype=dtype).element_size()
    for n in sizes:
        if not fits(n, itemsize, budget):
            print(f"skipping {n / 1e6:.0f} M parameters: more than the device's recommended memory")
            continue
        for cfg in configs():
            row = {"config": cfg.name, "params": n, "dtype": str(dtype).removeprefix("torch.")}
            params = None
            try:
                params = make_params(n, dtype, "mps")
                opt = cfg.make(params)
                for _ in range(warmup):
                    opt.step()
                torch.mps.synchronize()
                t0 = time.perf_counter()
                for _ in range(steps):
                    opt.step()
                torch.mps.synchronize()
                ms = (time.perf_counter() - t0) / steps * 1e3
                row.update(ms=ms, state_bytes=state_bytes(opt))
                row["gbps"] = cfg.step_bytes(n, itemsize) / (ms * 1e-3) / 1e9
                if chip is not None and chip.bandwidth_gbps:
                    row["pct_of_peak"] = 100 * row["gbps"] / chip.bandwidth_gbps
            except Exception as e:  # e.g. fused AdamW not available on mps in this torch
                row["error"] = f"{type(e).__name__}: {e}"[:120]
            finally:
                del params
                opt = None  # noqa: F841
                gc.collect()
                torch.mps.empty_cache()
            rows.append(row)
            print(_row_text(row), flush=True)
    return rows


def _row_text(r: dict) -> str:
    if "error" in r:
        return f"| {r['config']} | {r['params'] / 1e6:.0f} M | {r['error']} | | | |"
    pct = f"{r['pct_of_peak']:.0f}%" if "pct_of_peak" in r else "?"
    return (f"| {r['config']} | {r['params'] / 1e6:.0f} M | {r['ms']:.2f} | {r['gbps']:.0f} | {pct} | "
            f"{r['state_bytes'] / 2**30:.2f} GiB |")  # fmt: skip


def gpu_table(rows: list[dict]) -> str:
    head = "| optimizer | parameters | ms / step | GB/s | % peak | state memory |\n|---|---|---|---|---|---|"
    return "\n".join([head] + [_row_text(r) for r in rows])


def chart(rows: list[dict], path: str) -> Optional[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name in dict.fromkeys(r["config"] for r in rows):
        pts = [(r["params"], r["ms"], r["state_bytes"]) for r in rows if r["config"] == name and "ms" in r]
        if not pts:
            continue
        x = [p[0] / 1e6 for p in pts]
        ax1.plot(x, [p[1] for p in pts], marker="o", label=name)
        ax2.plot(x, [p[2] / 2**30 for p in pts], marker="o", label=name)
    for ax, label in ((ax1, "ms per step"), (ax2, "optimizer state memory (GiB)")):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("parameters (M)")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
    ax1.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# -- elsewhere: the emulated tier -----------------------------------------------------------------------


def measure_emulated(dtype: torch.dtype) -> list[dict]:
    """Launches and allocations per step on the emulated tier (small tensors, no timing)."""
    from bnb_mps.testing import AllocationCounter, use_emulated_kernels

    shapes = [(256, 256), (300, 70), (4099,)]  # three tensors, two with tails
    rows = []
    for cfg in configs():
        if not cfg.ours:
            continue
        params = [torch.nn.Parameter(torch.randn(*s, dtype=dtype) * 0.02) for s in shapes]
        for p in params:
            p.grad = torch.randn_like(p) * 1e-3
        opt = cfg.make(params)
        with use_emulated_kernels() as kernels:
            opt.step()  # creates the states and compiles the kernel library once
            kernels.launches.clear()
            with AllocationCounter() as alloc:
                opt.step()
        rows.append({"config": cfg.name, "tensors": len(params), "launches": len(kernels.launches),
                     "kernels": sorted(set(kernels.launched)), "alloc_bytes": alloc.bytes,
                     "host_reads": _host_reads_on_meta(cfg, dtype, shapes)})  # fmt: skip
    return rows


def _host_reads_on_meta(cfg: Config, dtype: torch.dtype, shapes) -> str:
    """'none' when the optimizer's steps run through the op layer on meta tensors (no data)."""
    from bnb_mps import ops, registration
    from bnb_mps.testing import RecordingExecutor

    recorder = RecordingExecutor()
    params = [torch.nn.Parameter(torch.empty(*s, dtype=dtype, device="meta")) for s in shapes]
    for p in params:
        p.grad = torch.empty_like(p)
    registration.register("Meta", executor=recorder, names=[n for n, op in ops.OPS.items() if op.kernel is not None])
    try:
        opt = cfg.make(params)
        opt.step()
        opt.step()
    except Exception as e:
        return f"yes ({type(e).__name__}: {str(e)[:60]})"
    finally:
        registration.unregister("Meta")
    return "none" if len(recorder.launches) == 2 * len(params) else f"? ({len(recorder.launches)} launches)"


def emulated_table(rows: list[dict]) -> str:
    head = "| optimizer | tensors | launches per step | bytes allocated per step | host reads | kernels |"
    out = [head, "|" + "---|" * 6]
    for r in rows:
        out.append(f"| {r['config']} | {r['tensors']} | {r['launches']} | {r['alloc_bytes']} | {r['host_reads']} | "
                   f"{', '.join(r['kernels'])} |")  # fmt: skip
    return "\n".join(out)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10M,30M,100M,300M,1B", help="parameter counts (K, M, B suffixes)")
    parser.add_argument("--dtype", default="fp32", choices=sorted(DTYPES), help="parameter and gradient dtype")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per configuration")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--chart", metavar="PATH", default="bench_optimizers.png", help="PNG chart (Mac only)")
    parser.add_argument("--no-chart", action="store_true")
    parser.add_argument("--short", action="store_true", help="a quick look: 10M and 100M parameters, 5 timed steps")
    ns = parser.parse_args(argv)
    if ns.short:
        ns.sizes, ns.steps, ns.warmup = "10M,100M", 5, 2
    try:
        sizes = [parse_size(s) for s in ns.sizes.split(",")]
    except ValueError:
        parser.error(f"--sizes: expected numbers like 10M,1B, got {ns.sizes!r}")
    dtype = DTYPES[ns.dtype]

    import bitsandbytes  # noqa: F401  (defines the ops and registers bnb_mps)

    mode = "gpu" if torch.backends.mps.is_available() else "emulated"
    if mode == "gpu":
        import bnb_mps

        info = bnb_mps.backend_info()
        print("optimizer ops served by: " + ", ".join(
            f"{op} -> {info[op]['tier']}" for op in ("optimizer_update_8bit_blockwise", "optimizer_update_32bit")))
        rows = measure_gpu(sizes, dtype, ns.steps, ns.warmup)
        print()
        print(gpu_table(rows))
    else:
        print("No mps device: no GPU time was measured. The optimizers ran on the emulated tier (small tensors);")
        print("the table shows kernel launches, allocations and host reads per step, not speed.\n")
        rows = measure_emulated(dtype)
        print(emulated_table(rows))
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump({"mode": mode, "rows": rows}, f, indent=2)
    if mode == "gpu" and not ns.no_chart:
        written = chart(rows, ns.chart)
        print(f"\nchart: {written}" if written else "\n(no chart: matplotlib is not installed)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
