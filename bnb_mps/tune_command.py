"""`python -m bnb_mps tune`: the speed table of this machine for 4-bit linear layers.

For each weight shape (N out x K in features) and each row count M, it measures every candidate route
of `gemm_4bit` (what bitsandbytes' `matmul_4bit` calls: NF4, blocksize 64, nested block scales, as
QLoRA loads a model) on the tier that serves mps, exactly as tuning does at first use
(bnb_mps.ops.tuning), keeps the choices in the tuning cache, and prints per shape and M each route's
time, the choice and the built-in route; at M = 1 the GB/s the choice reaches and its share of the
chip's bandwidth (bnb_mps.chips), at M >= 64 its TFLOPS. Reference rows, measured in the same run:
dense `torch.nn.functional.linear` in float16 on the same shape, and where mlx is installed MLX's
`quantized_matmul` (4 bits, group size 64): what Mac users take instead.

On the emulated tier the kernels run on the CPU under the emulator, timed on the host's clock: the
figures say nothing about speed on a GPU, and the table says so.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

DEFAULT_M = {"gpu": "1,8,512,2048", "emulated": "1,8,40"}
DEFAULT_SHAPES = {"gpu": "4096x4096", "emulated": "96x256"}
BLOCKSIZE = 64
_DTYPES = ("float16", "bfloat16", "float32")
#: route columns, in this order (those a shape has)
_ORDER = ("gemv", "gemv/tglut", "batch", "small", "small/wide", "splitk", "splitk/two", "mma", "kernel",
          "dequantize+linear", "bitsandbytes")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from .model_shapes import MODELS

    parser.add_argument("--tier", choices=("native", "shader", "emulated"),
                        help="the tier to measure (default: the one serving mps here, else emulated)")
    parser.add_argument("--shapes", metavar="NxK,...", help=f"weight shapes, out x in features (default "
                        f"{DEFAULT_SHAPES['gpu']}; emulated: {DEFAULT_SHAPES['emulated']}, unless --model)")
    parser.add_argument("--model", metavar="NAME", action="append",
                        help=f"the 4-bit layers of a model, shapes only: {', '.join(MODELS)} (may repeat)")
    parser.add_argument("--m", metavar="M,...", help=f"rows of the activations (default {DEFAULT_M['gpu']}; "
                        f"emulated: {DEFAULT_M['emulated']})")
    parser.add_argument("--dtype", choices=_DTYPES, default="float16", help="activations' dtype (default float16)")
    parser.add_argument("--json", metavar="PATH", help="also write every candidate's time and the choices as JSON")
    parser.add_argument("--chart", metavar="PATH", help="also draw the times as a PNG chart (needs matplotlib)")


def _numbers(text: str, what: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--{what} takes comma-separated positive integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise ValueError(f"--{what} takes comma-separated positive integers, got {text!r}")
    return values


def _shapes(text: str) -> list[tuple[str, int, int]]:
    out = []
    for part in text.split(","):
        try:
            N, K = (int(x) for x in part.strip().lower().split("x"))
        except ValueError:
            raise ValueError(f"--shapes takes NxK,... (out x in features), got {part.strip()!r}") from None
        if N < 1 or K < 1:
            raise ValueError(f"--shapes takes positive sizes, got {part.strip()!r}")
        out.append((f"{N}x{K}", N, K))
    return out


def main(args: argparse.Namespace) -> int:
    import os

    import torch

    import bitsandbytes  # noqa: F401  (defines the schemas, registers bnb_mps for mps)
    from . import chips, executors, model_shapes, registration
    from .ops import OPS, candidates, timing, tuning, verify
    from .ops.resolve import REFUSALS

    if args.tier is not None:
        os.environ["BNB_MPS_EXECUTOR"] = args.tier  # (the tier to measure serves this process)
        executors.reset()
    sel = executors.selection()
    tier = args.tier or (sel.tier if sel.executor is not None else "emulated")
    if args.tier is None and sel.executor is None:
        print(f"No GPU tier serves mps here ({sel.reason}); measuring the emulated tier.\n")
        os.environ["BNB_MPS_EXECUTOR"] = "emulated"
        executors.reset()
        sel = executors.selection()
    if sel.tier != tier or sel.executor is None:
        print(f"cannot measure the {tier} tier: {executors.load_errors().get(tier, sel.reason)}")
        return 1
    gpu_tier = tier in executors.GPU_TIERS
    mode = "gpu" if gpu_tier else "emulated"
    try:
        rows_of = _numbers(args.m or DEFAULT_M[mode], "m")
        shapes = [s for model in args.model or () for s in model_shapes.layers(model)]
        if args.shapes or not shapes:
            shapes += _shapes(args.shapes or DEFAULT_SHAPES[mode])
    except ValueError as e:
        print(f"tune: {e}", file=sys.stderr)
        return 2
    dtype = getattr(torch, args.dtype)
    executor = executors.executor_for("mps" if gpu_tier else "cpu")
    device = torch.device(getattr(executor, "device_type", "cpu"))
    try:
        clock = tuning.clock_for(tier, executor, device)
    except tuning.ClockUnavailable as e:
        print(f"cannot measure the {tier} tier now: {e}")
        return 1
    gpu = clock.name == "gpu"
    # bitsandbytes' own implementation for the device the calls run on: on mps the one the MPS
    # registration captured; on CPU tensors (the emulated tier, the model of torch's MPS runtime) the
    # CPU key's where bnb-mps serves it, else the MPS capture (bitsandbytes' pure-PyTorch kernel)
    stock = registration.stock_kernel("MPS", "gemm_4bit") if device.type == "mps" else (
        registration.stock_kernel("CPU", "gemm_4bit") or registration.stock_kernel("MPS", "gemm_4bit"))
    chip = chips.detect()
    machine = verify.machine()
    print(f"Tuning gemm_4bit (NF4, blocksize {BLOCKSIZE}, nested block scales, {args.dtype} activations) on the "
          f"{tier} tier: {machine['gpu']}, {machine['os']}, torch {machine['torch']}, bitsandbytes "
          f"{machine['bitsandbytes']}")  # fmt: skip
    if not gpu:
        print("NOTE: these timings mean nothing for a GPU: the emulated tier runs the kernels on the CPU, under the "
              "emulator, timed on the host's clock. Only a Mac measures speed.")  # fmt: skip
    print()
    mlx = _mlx()
    results = []
    total = len(shapes) * len(rows_of)
    start = time.perf_counter()
    for s, (name, N, K) in enumerate(shapes):
        for r, M in enumerate(rows_of):
            i = s * len(rows_of) + r + 1
            print(f"  [{i}/{total}] {N}x{K} M={M} ...", file=sys.stderr, flush=True)
            args_meta = _gemm_call(M, N, K, dtype, device)
            c = candidates.of(OPS["gemm_4bit"], args_meta, executor, tier, stock)
            try:
                d = tuning.retune(c, tier, executor)
            except REFUSALS as e:  # (the built-in route's launch refused: the op leaves the tier on a call)
                print(f"    {N}x{K} M={M}: {type(e).__name__}: {e}", file=sys.stderr)
                continue
            row = _row(name, N, K, M, dtype, d, chip, gpu)
            row["dense_fp16_linear"] = _dense(M, N, K, device, clock)
            row["mlx_quantized_matmul"] = _mlx_time(mlx, M, N, K) if mlx is not None and gpu_tier else None
            results.append(row)
    seconds = time.perf_counter() - start
    print("\n".join(table(results, chip, gpu)))
    print(f"\n{len(results)} shape keys measured in {seconds:.1f} s; choices cached in {tuning.cache_path()}")
    if mlx is None:
        print("(MLX is not installed here: no quantized_matmul reference row)")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "tier": tier, "machine": machine, "kernels": _source_hash(), "dtype": args.dtype, "clock":
            "gpu" if gpu else "host", "meaningful": gpu, "chip": None if chip is None else {
                "name": chip.name, "gpu_cores": chip.gpu_cores, "bandwidth_gbps": chip.bandwidth_gbps},
            "seconds": seconds, "rows": _finite(results),
        }, indent=1) + "\n")  # fmt: skip
        print(f"JSON: {args.json}")
    if args.chart:
        drawn = chart(results, args.chart, tier, gpu)
        print(f"chart: {drawn}" if drawn else "(no chart: matplotlib is not installed)")
    return 0


def _gemm_call(M: int, N: int, K: int, dtype, device) -> list:
    """The arguments of bitsandbytes' gemm_4bit for a nested NF4 layer (metadata only: tuning measures on
    fresh inputs of the shape)."""
    import torch

    nblocks = math.ceil(N * K / BLOCKSIZE)
    empty = lambda n, dt: torch.empty(n, dtype=dt, device=device)  # noqa: E731
    return [empty((M, K), dtype), empty(((N * K + 1) // 2, 1), torch.uint8), [N, K], empty(math.ceil(nblocks / 256),
            torch.float32), BLOCKSIZE, "nf4", None, empty(nblocks, torch.uint8), empty(256, torch.float32),
            empty(1, torch.float32)]  # fmt: skip


def _required_bytes(M: int, N: int, K: int, dtype) -> int:
    """What a product must move at least: the packed weight, its nested scales, A and the output."""
    nblocks = math.ceil(N * K / BLOCKSIZE)
    return (N * K + 1) // 2 + nblocks + 4 * math.ceil(nblocks / 256) + (M * K + M * N) * dtype.itemsize


def _row(name: str, N: int, K: int, M: int, dtype, d, chip, gpu: bool) -> dict:
    t = d.times.get(d.choice, math.inf)
    row = {"shape": f"{N}x{K}", "layers": name, "N": N, "K": K, "M": M, "key": d.key, "times": d.times,
           "choice": d.choice, "default": d.default, "errors": d.errors, "left_out": d.left_out,
           "measure_seconds": d.seconds, "gbps": None, "share_of_peak": None, "tflops": None}  # fmt: skip
    if math.isfinite(t) and t > 0:
        if M == 1:
            row["gbps"] = _required_bytes(M, N, K, dtype) / t / 1e9
            if gpu and chip is not None and chip.bandwidth_gbps:
                row["share_of_peak"] = row["gbps"] / chip.bandwidth_gbps
        if M >= 64:
            row["tflops"] = 2 * M * N * K / t / 1e12
    return row


def _dense(M: int, N: int, K: int, device, clock) -> Optional[float]:
    """Dense float16 linear on the same shape: the reference row."""
    import torch

    from .ops import timing

    try:
        A = torch.randn(M, K, device=device).half()
        W = torch.randn(N, K, device=device).half()
        return timing.seconds(lambda: torch.nn.functional.linear(A, W), clock)
    except Exception:  # noqa: BLE001  (e.g. no float16 matmul on this CPU build)
        return None


def _mlx():
    try:
        import mlx.core as mx
    except ImportError:
        return None
    return mx


def _mlx_time(mx, M: int, N: int, K: int) -> Optional[float]:
    """MLX's quantized_matmul (4 bits, group size 64) on the same shape, float16, on the host's clock
    around mx.eval (MLX runs on its own Metal queue, which torch's events do not see)."""
    try:
        w = mx.random.normal((N, K)).astype(mx.float16)
        wq, scales, biases = mx.quantize(w, group_size=64, bits=4)
        x = mx.random.normal((M, K)).astype(mx.float16)

        def call():
            mx.eval(mx.quantized_matmul(x, wq, scales, biases, transpose=True, group_size=64, bits=4))

        call()
        first = _host(call, 1)
        n = max(1, math.ceil(1e-3 / max(first, 1e-7)))
        return statistics.median(_host(call, n) / n for _ in range(5))
    except Exception:  # noqa: BLE001  (an MLX without this API)
        return None


def _host(call, n: int) -> float:
    start = time.perf_counter()
    for _ in range(n):
        call()
    return time.perf_counter() - start


def _source_hash() -> str:
    from .msl import source

    try:
        return source.source_hash()
    except (OSError, ValueError) as e:
        return f"unreadable: {e}"


def _finite(x):
    """`x` with every infinite time as None (a route testing.fixed_timings left out; JSON has no infinity)."""
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_finite(v) for v in x]
    return None if isinstance(x, float) and not math.isfinite(x) else x


def _ms(t: Optional[float]) -> str:
    if t is None:
        return "-"
    return "slower" if not math.isfinite(t) else f"{t * 1e3:.4f}" if t < 1e-2 else f"{t * 1e3:.2f}"


def table(rows: list[dict], chip, gpu: bool) -> list[str]:
    """One table per shape: a line per M with each route's time in ms (the choice marked *), the
    built-in route, GB/s and share of peak at M = 1, TFLOPS at M >= 64, and the reference rows."""
    out = []
    for shape in dict.fromkeys(r["shape"] for r in rows):
        group = [r for r in rows if r["shape"] == shape]
        routes = [n for n in _ORDER if any(n in r["times"] or n in r["errors"] for r in group)]
        head = (["M"] + routes + ["choice", "built-in", "GB/s", "% peak", "TFLOPS", "fp16 linear"]
                + (["MLX q4"] if any(r["mlx_quantized_matmul"] is not None for r in group) else []))  # fmt: skip
        lines = []
        for r in group:
            cells = [str(r["M"])]
            for n in routes:
                cell = _ms(r["times"][n]) if n in r["times"] else "error" if n in r["errors"] else "-"
                cells.append(cell + ("*" if n == r["choice"] else ""))
            cells += [r["choice"], r["default"], f"{r['gbps']:.1f}" if r["gbps"] else "-",
                      f"{100 * r['share_of_peak']:.0f}%" if r["share_of_peak"] else "-",
                      f"{r['tflops']:.2f}" if r["tflops"] else "-", _ms(r["dense_fp16_linear"])]  # fmt: skip
            if len(head) > len(cells):
                cells.append(_ms(r["mlx_quantized_matmul"]))
            lines.append(cells)
        widths = [max(len(h), *(len(c[i]) for c in lines)) for i, h in enumerate(head)]
        out += [f"{shape} ({group[0]['layers']}), ms per call (* the choice):" if group[0]["layers"] != shape
                else f"{shape}, ms per call (* the choice):",
                "  ".join(h.rjust(w) for h, w in zip(head, widths)),
                "  ".join("-" * w for w in widths)]  # fmt: skip
        out += ["  ".join(c.rjust(w) for c, w in zip(cells, widths)) for cells in lines]
        for r in group:
            for n, e in r["errors"].items():
                out.append(f"  M={r['M']} {n}: {e}")
            for n, why in r["left_out"].items():
                out.append(f"  M={r['M']} {n} not measured: {why}")
        out.append("")
    if chip is not None and chip.bandwidth_gbps and gpu:
        out.append(f"% peak: of the {chip.name}'s {chip.bandwidth_gbps:g} GB/s (bnb_mps.chips)")
    if not gpu:
        out.append("Host-clock timings of emulated kernels: they mean nothing for a GPU.")
    return out


def chart(rows: list[dict], path: str, tier: str, gpu: bool) -> Optional[str]:
    """Each route's time relative to dense float16 linear, per shape and M (log scale); None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    labels = [f"{r['shape']} M={r['M']}" for r in rows]
    routes = [n for n in _ORDER if any(n in r["times"] for r in rows)]
    refs = [("dense_fp16_linear", "fp16 linear (dense)"), ("mlx_quantized_matmul", "MLX quantized_matmul")]
    series = [(n, [r["times"].get(n) for r in rows]) for n in routes]
    series += [(label, [r[k] for r in rows]) for k, label in refs if any(r[k] is not None for r in rows)]
    fig, ax = plt.subplots(figsize=(10, 0.45 * len(rows) * max(1, len(series)) / 3 + 2))
    height = 0.8 / max(1, len(series))
    for j, (name, values) in enumerate(series):
        ys = [i + j * height for i in range(len(rows))]
        xs = [v * 1e3 if v is not None and math.isfinite(v) else 0 for v in values]
        ax.barh(ys, xs, height=height, label=name)
    ax.set_yticks([i + 0.4 - height / 2 for i in range(len(rows))], labels, fontsize=7)
    ax.set_xscale("log")
    ax.set_xlabel("ms per call (log scale)" + ("" if gpu else " - host clock, emulated: meaningless for a GPU"))
    ax.set_title(f"gemm_4bit routes on the {tier} tier")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
