#!/usr/bin/env python
"""Training-step throughput of a small model on every available device and dtype.

Trains a small MLP on a fixed synthetic batch (so data loading is not measured) and
reports, per device (cpu, and mps / cuda where available) and dtype (fp32, and bf16 /
fp16 through autocast with fp32 weights, where they run): milliseconds per step and
samples per second, the median of several repeats, warm-up steps excluded. Ends with
the best configuration's speed-up over the CPU and a recommendation; writes a PNG bar
chart when matplotlib is installed.

    python scripts/benchmark_training.py                     # defaults: well under a minute on a CPU
    python scripts/benchmark_training.py --hidden 1024 --batch-size 256 --steps 50 --repeats 5
    python scripts/benchmark_training.py --devices cpu,mps --dtypes fp32,bf16 --chart out.png

Low-precision rows use autocast without loss scaling: they measure speed only.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from bnb_mps.device import get_dtype_from_string, is_mps_available

DTYPE_NAMES = ("fp32", "bf16", "fp16")


@dataclass
class Result:
    device: str
    dtype: str
    ms_per_step: Optional[float] = None  # median over repeats
    samples_per_s: Optional[float] = None
    skipped: Optional[str] = None  # why this configuration did not run


def available_devices() -> list:
    devices = ["cpu"]
    if is_mps_available():
        devices.append("mps")
    if torch.cuda.is_available():
        devices.append("cuda")
    return devices


def synchronize(device: torch.device) -> None:
    """Wait for queued work, so that wall-clock time covers it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def build_step(device: torch.device, dtype: torch.dtype, hidden: int, layers: int, batch_size: int,
               classes: int = 10, seed: int = 0) -> Callable[[], torch.Tensor]:
    """One optimizer step of an MLP classifier (fp32 weights; autocast for bf16/fp16)."""
    gen = torch.Generator().manual_seed(seed)
    blocks = []
    for _ in range(layers):
        blocks += [torch.nn.Linear(hidden, hidden), torch.nn.GELU()]
    model = torch.nn.Sequential(*blocks, torch.nn.Linear(hidden, classes)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(batch_size, hidden, generator=gen).to(device)
    y = torch.randint(0, classes, (batch_size,), generator=gen).to(device)

    def step() -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        if dtype == torch.float32:
            cast = contextlib.nullcontext()
        else:
            cast = torch.autocast(device_type=device.type, dtype=dtype)
        with cast:
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        return loss.detach()

    return step


def time_steps(step: Callable[[], object], steps: int, warmup: int, repeats: int,
               sync: Callable[[], None] = lambda: None,
               clock: Callable[[], float] = time.perf_counter) -> list:
    """Seconds per step for each repeat of ``steps`` steps, after ``warmup`` untimed steps."""
    for _ in range(warmup):
        step()
    sync()
    per_step = []
    for _ in range(repeats):
        t0 = clock()
        for _ in range(steps):
            step()
        sync()
        per_step.append((clock() - t0) / steps)
    return per_step


def run_config(device_name: str, dtype_name: str, args: argparse.Namespace) -> Result:
    device = torch.device(device_name)
    dtype = get_dtype_from_string(dtype_name)
    result = Result(device=device_name, dtype=dtype_name)
    try:
        step = build_step(device, dtype, args.hidden, args.layers, args.batch_size)
        loss = float(step().float().cpu())  # also checks this dtype runs here at all
        if loss != loss:  # NaN
            raise RuntimeError("loss is NaN")
        seconds = time_steps(step, args.steps, args.warmup, args.repeats, sync=lambda: synchronize(device))
    except Exception as exc:  # a dtype or op this device/torch does not support
        result.skipped = f"{type(exc).__name__}: {str(exc).splitlines()[0][:100] if str(exc) else ''}"
        return result
    median = statistics.median(seconds)
    result.ms_per_step = median * 1e3
    result.samples_per_s = args.batch_size / median
    return result


def cpu_reference(results: list) -> Optional[Result]:
    for r in results:
        if r.device == "cpu" and r.dtype == "fp32" and r.samples_per_s:
            return r
    return None


def format_table(results: list) -> str:
    ref = cpu_reference(results)
    header = ("device", "dtype", "ms/step", "samples/s", "x CPU fp32")
    rows = []
    for r in results:
        if r.skipped:
            rows.append((r.device, r.dtype, "-", "-", f"skipped ({r.skipped})"))
            continue
        speedup = f"{r.samples_per_s / ref.samples_per_s:.2f}" if ref else "-"
        rows.append((r.device, r.dtype, f"{r.ms_per_step:.3f}", f"{r.samples_per_s:.1f}", speedup))
    widths = [max(len(str(row[i])) for row in [header] + rows) for i in range(len(header))]
    lines = ["  ".join(str(c).ljust(w) if i < 2 else str(c).rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
             for row in [header] + rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(line.rstrip() for line in lines)


# A lower precision is only worth its numerical caveats when it is clearly faster.
CLEARLY_FASTER = 1.10


def prefer_fp32(best: Result, ran: list) -> Result:
    """fp32 on the same device when ``best`` is a low precision less than 10% faster."""
    fp32 = [r for r in ran if r.device == best.device and r.dtype == "fp32"]
    if best.dtype != "fp32" and fp32 and best.samples_per_s < CLEARLY_FASTER * fp32[0].samples_per_s:
        return fp32[0]
    return best


def summarize(results: list) -> str:
    ran = [r for r in results if r.samples_per_s]
    if not ran:
        return "Nothing ran."
    best = max(ran, key=lambda r: r.samples_per_s)
    best = prefer_fp32(best, ran)
    cpu_runs = [r for r in ran if r.device == "cpu"]
    lines = [f"Best: {best.device} {best.dtype}, {best.samples_per_s:.1f} samples/s ({best.ms_per_step:.3f} ms/step)"
             " (a lower precision counts only when at least 10% faster than fp32)."]
    if cpu_runs and best.device != "cpu":
        best_cpu = max(cpu_runs, key=lambda r: r.samples_per_s)
        lines.append(
            f"Speed-up of {best.device} over the CPU: {best.samples_per_s / best_cpu.samples_per_s:.2f}x "
            f"(best CPU configuration: {best_cpu.dtype}, {best_cpu.samples_per_s:.1f} samples/s)."
        )
        advice = f"Recommendation: train on {best.device} in {best.dtype}"
        if best.dtype == "fp16":
            advice += " with loss scaling (torch.amp.GradScaler); bnb_mps.device.check_mps_limitations lists the caveats"
        lines.append(advice + ".")
    else:
        accelerators = sorted({r.device for r in results if r.device != "cpu"})
        if accelerators:
            lines.append(f"No accelerator ({', '.join(accelerators)}) beat the CPU for this model size.")
        else:
            lines.append("Only the CPU is available here: no accelerator to compare with.")
        lines.append(f"Recommendation: train on the CPU in {best.dtype} at this size; "
                     "larger models may favour an accelerator (try --hidden/--batch-size).")
    return "\n".join(lines)


def write_chart(results: list, path: str) -> Optional[str]:
    """Bar chart of samples/s; returns the path, or None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    ran = [r for r in results if r.samples_per_s]
    fig, ax = plt.subplots(figsize=(max(4, 1.2 * len(ran) + 1), 3.5))
    ax.bar([f"{r.device}\n{r.dtype}" for r in ran], [r.samples_per_s for r in ran], color="tab:blue")
    ax.set_ylabel("samples / s (median)")
    ax.set_title("Training-step throughput")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def parse_args(argv: Optional[list]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--devices", default="all", help="comma-separated cpu,mps,cuda or 'all' (default: all available)")
    p.add_argument("--dtypes", default=",".join(DTYPE_NAMES), help="comma-separated fp32,bf16,fp16")
    p.add_argument("--hidden", type=int, default=512, help="width of the MLP (default 512)")
    p.add_argument("--layers", type=int, default=3, help="hidden layers (default 3)")
    p.add_argument("--batch-size", type=int, default=128, help="samples per step (default 128)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per repeat (default 10)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    p.add_argument("--repeats", type=int, default=3, help="repeats; the median is reported (default 3)")
    p.add_argument("--chart", default="benchmark_training.png", help="PNG path (needs matplotlib)")
    p.add_argument("--no-chart", action="store_true", help="do not write the chart")
    args = p.parse_args(argv)
    for name in ("hidden", "layers", "batch_size", "steps", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.warmup < 0:
        p.error("--warmup must be >= 0")
    available = available_devices()
    if args.devices == "all":
        args.devices = available
    else:
        args.devices = [d.strip() for d in args.devices.split(",") if d.strip()]
        for d in args.devices:
            if d not in ("cpu", "mps", "cuda"):
                p.error(f"--devices: unknown device {d!r}; expected cpu, mps or cuda")
            if d not in available:
                p.error(f"--devices: {d} is not available here (available: {', '.join(available)})")
    args.dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    for d in args.dtypes:
        if d not in DTYPE_NAMES:
            p.error(f"--dtypes: unknown dtype {d!r}; expected {', '.join(DTYPE_NAMES)}")
    return args


def main(argv: Optional[list] = None) -> list:
    args = parse_args(argv)
    print(f"torch {torch.__version__}; MLP {args.layers}x{args.hidden}, batch {args.batch_size}, "
          f"{args.steps} steps x {args.repeats} repeats after {args.warmup} warm-up steps")
    results = [run_config(d, t, args) for d in args.devices for t in args.dtypes]
    print(format_table(results))
    print(summarize(results))
    if not args.no_chart:
        path = write_chart(results, args.chart)
        print(f"Chart: {path}" if path else "Chart: skipped (matplotlib is not installed)")
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
