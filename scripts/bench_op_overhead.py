"""Host cost per call of bnb-mps' hot ops, against a tiny torch.add measured in the same run.

Decoding a small 4-bit model makes a few hundred bitsandbytes op calls per token, each cheap on the
GPU, so the host time of a call decides the speed. For each hot op this script times a call as a user
makes it (`bnb.matmul_4bit`, `torch.ops.bitsandbytes.*`) in two ways, alternating in short batches in
the same run:

- total: the op served by bnb-mps with a kernel launch that does nothing (the op layer's whole path:
  argument checks or the launch plan, output allocation, the launch call);
- floor: the op served by a trivial kernel that only allocates the outputs (PyTorch's dispatcher and
  bitsandbytes' own Python, which any backend pays).

bnb-mps' share = total - floor, also given as a multiple of one tiny `torch.add` call. Times are the
minimum over rounds of the mean per call in a batch, on this thread's CPU clock (time.thread_time),
so that other processes on the machine disturb them as little as possible.

    python scripts/bench_op_overhead.py [--calls 2000] [--rounds 15] [--json PATH] [--ops NAME ...]
    python scripts/bench_op_overhead.py --native     # on a Mac: also the native tier's real launches

`--native` (a Mac with the native tier) also times each op on mps tensors through the native tier with
its real launch (the pybind11 call and the encoding on PyTorch's MPS stream; the GPU work itself is
waited for between batches, outside the timed part), against the same trivial kernel on the MPS key.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import statistics
import sys
import time
import warnings

import torch

#: the ops of the table, with the bitsandbytes schemas each one calls
OPS = {
    "matmul_4bit M=1 (gemm_4bit, nested NF4)": "gemm_4bit",
    "matmul_4bit M=8 (gemm_4bit, nested NF4)": "gemm_4bit",
    "gemv_4bit": "gemv_4bit",
    "dequantize_4bit": "dequantize_4bit",
    "quantize_4bit": "quantize_4bit",
    "optimizer_update_8bit_blockwise (AdamW8bit)": "optimizer_update_8bit_blockwise",
    "optimizer_update_32bit (AdamW)": "optimizer_update_32bit",
}
SCHEMAS = sorted(set(OPS.values()))


class NoLaunch:
    """An executor whose launch does nothing: what is left of a call is the op layer's host work."""

    name = "native"

    def launch(self, kernel, *, grid, threadgroup, args) -> None:
        pass


def trivial_kernels() -> dict:
    """For each schema, a kernel that only allocates what the op returns (the floor)."""

    def gemm_4bit(A, B, shapeB, absmax, blocksize, quant_type, bias=None, absmax_8bit=None, absmax_code=None,
                  absmax_offset=None):  # fmt: skip
        return torch.empty((*A.shape[:-1], shapeB[0]), dtype=A.dtype, device=A.device)

    def gemv_4bit(A, B, shapeB, absmax, code, blocksize):
        return torch.empty((*A.shape[:-1], shapeB[0]), dtype=A.dtype, device=A.device)

    def dequantize_4bit(A, absmax, blocksize, quant_type, shape, dtype):
        return torch.empty(shape, dtype=dtype, device=A.device)

    def quantize_4bit(A, blocksize, quant_type, quant_storage):
        n = A.numel()
        return (torch.empty(((n + 1) // (2 * quant_storage.itemsize), 1), dtype=quant_storage, device=A.device),
                torch.empty(-(-n // blocksize), dtype=torch.float32, device=A.device))  # fmt: skip

    def optimizer_update(*args, **kwargs) -> None:  # in place: nothing to allocate
        return None

    return {"gemm_4bit": gemm_4bit, "gemv_4bit": gemv_4bit, "dequantize_4bit": dequantize_4bit,
            "quantize_4bit": quantize_4bit, "optimizer_update_8bit_blockwise": optimizer_update,
            "optimizer_update_32bit": optimizer_update}  # fmt: skip


@contextlib.contextmanager
def floor_kernels(dispatch_key: str):
    lib = torch.library.Library("bitsandbytes", "IMPL")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (overriding a registered kernel is the point)
            for name, fn in trivial_kernels().items():
                lib.impl(name, fn, dispatch_key)
        yield
    finally:
        lib._destroy()


@contextlib.contextmanager
def bnb_mps_kernels(dispatch_key: str, executor):
    """bnb-mps serves the hot ops for `dispatch_key`: on `executor` when given (the CPU key), else
    through its routing (the MPS key, as installed)."""
    from bnb_mps import registration

    if executor is None:  # the MPS key: bnb-mps' own registration, as `import bitsandbytes` made it
        yield
        return
    registration.register(dispatch_key, executor=executor, names=SCHEMAS)
    try:
        yield
    finally:
        registration.unregister(dispatch_key)


def make_calls(device: torch.device) -> dict:
    """For each row of the table, a function that makes one call as a user does, on `device`."""
    import bitsandbytes as bnb
    import bitsandbytes.functional as F

    g = torch.Generator().manual_seed(0)
    N = K = 4096
    W = torch.randn(N, K, generator=g).to(torch.float16)
    # Quantized by bitsandbytes' own CPU code (before bnb-mps serves anything on the CPU key).
    Wq, nested = F.quantize_4bit(W, blocksize=64, quant_type="nf4", compress_statistics=True)
    Wp, plain = F.quantize_4bit(W, blocksize=64, quant_type="nf4")
    Wq, Wp = Wq.to(device), Wp.to(device)
    nested.to(device)
    plain.to(device)
    A1 = torch.randn(1, K, generator=g).to(device, torch.float16)
    A8 = torch.randn(8, K, generator=g).to(device, torch.float16)
    small = torch.randn(1024, 1024, generator=g).to(device, torch.float16)
    small_q, small_state = F.quantize_4bit(small.cpu(), blocksize=64, quant_type="nf4")
    small_q, small_absmax = small_q.to(device), small_state.absmax.to(device)

    n = 4096 * 1024
    p32, g32 = torch.randn(n, generator=g).to(device), torch.randn(n, generator=g).to(device)
    s8 = [torch.zeros(n, dtype=torch.uint8, device=device) for _ in range(2)]
    am = [torch.ones(n // 256, device=device) for _ in range(2)]
    qmap1, qmap2 = F.create_dynamic_map(signed=True).to(device), F.create_dynamic_map(signed=False).to(device)
    f1, f2 = torch.zeros(n, device=device), torch.zeros(n, device=device)
    ops = torch.ops.bitsandbytes
    return {
        "matmul_4bit M=1 (gemm_4bit, nested NF4)": lambda: bnb.matmul_4bit(A1, Wq.t(), nested),
        "matmul_4bit M=8 (gemm_4bit, nested NF4)": lambda: bnb.matmul_4bit(A8, Wq.t(), nested),
        "gemv_4bit": lambda: ops.gemv_4bit(A1, Wp, [N, K], plain.absmax, plain.code, 64),
        "dequantize_4bit": lambda: ops.dequantize_4bit(small_q, small_absmax, 64, "nf4", [1024, 1024], torch.float16),
        "quantize_4bit": lambda: ops.quantize_4bit(small, 64, "nf4", torch.uint8),
        "optimizer_update_8bit_blockwise (AdamW8bit)": lambda: ops.optimizer_update_8bit_blockwise(
            "adam", g32, p32, s8[0], s8[1], 0.9, 0.999, 0.0, 0.0, 1e-8, 10, 1e-3, qmap1, qmap2, am[0], am[1], 1e-2,
            1.0, False),
        "optimizer_update_32bit (AdamW)": lambda: ops.optimizer_update_32bit(
            "adam", g32, p32, f1, f2, None, 0.0, 0.0, 0.9, 0.999, 0.0, 0.0, 1e-8, 1e-2, 10, 1e-3, 1.0, False),
    }


def _batch_us(fn, calls: int, clock, sync=None) -> float:
    fn()  # (a first call plans; it is not what a repeated call costs)
    if sync is not None:
        sync()
    t = clock()
    for _ in range(calls):
        fn()
    elapsed = clock() - t
    if sync is not None:
        sync()
    return elapsed / calls * 1e6


def measure(names, calls: int, rounds: int, device: torch.device, dispatch_key: str, executor, clock,
            sync=None, progress=None) -> dict:  # fmt: skip
    """{row: {total_us, floor_us, share_us}} and the torch.add time, all from the same rounds."""
    fns = make_calls(device)
    x = torch.ones(4, device=device)
    add = []
    got = {name: {"total": [], "floor": []} for name in names}
    for r in range(rounds):
        with bnb_mps_kernels(dispatch_key, executor):
            for name in names:
                got[name]["total"].append(_batch_us(fns[name], calls, clock, sync))
        with floor_kernels(dispatch_key):
            for name in names:
                got[name]["floor"].append(_batch_us(fns[name], calls, clock, sync))
        add.append(_batch_us(lambda: torch.add(x, x), calls * 5, clock, sync))
        if progress is not None:
            progress(r + 1)
    add_us = min(add)
    rows = {}
    for name in names:
        total, floor = min(got[name]["total"]), min(got[name]["floor"])
        rows[name] = {"total_us": total, "floor_us": floor, "share_us": total - floor,
                      "share_per_add": (total - floor) / add_us,
                      "total_median_us": statistics.median(got[name]["total"]),
                      "floor_median_us": statistics.median(got[name]["floor"])}  # fmt: skip
    return {"torch_add_us": add_us, "rows": rows}


def table(result: dict, title: str) -> str:
    head = f"{'call':<46} {'total us':>9} {'floor us':>9} {'share us':>9} {'share / add':>12}"
    lines = [title, f"torch.add on tiny tensors: {result['torch_add_us']:.2f} us per call", head, "-" * len(head)]
    for name, r in result["rows"].items():
        lines.append(f"{name:<46} {r['total_us']:9.2f} {r['floor_us']:9.2f} {r['share_us']:9.2f} "
                     f"{r['share_per_add']:11.1f}x")  # fmt: skip
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000, help="calls per batch (default 2000)")
    parser.add_argument("--rounds", type=int, default=15, help="batches per op and way, alternating (default 15)")
    parser.add_argument("--ops", nargs="+", choices=list(OPS), metavar="NAME", help="rows to measure (default all)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--native", action="store_true",
                        help="also measure the native tier's real launches on mps (a Mac with the native tier)")
    args = parser.parse_args(argv)
    if args.calls < 1 or args.rounds < 1:
        parser.error("--calls and --rounds must be at least 1")

    import bitsandbytes  # noqa: F401  (defines the schemas, registers bnb-mps for mps)
    from bnb_mps.ops import plan

    names = args.ops or list(OPS)
    key = "C++ (bnb_mps._opkey)" if plan.key is not plan.metadata_key else "Python (bnb_mps._opkey not built)"
    out = {"mode": "host", "machine": f"{platform.system()} {platform.machine()}, Python {platform.python_version()}",
           "torch": torch.__version__, "calls": args.calls, "rounds": args.rounds, "metadata_key": key}  # fmt: skip

    def progress(label):
        return lambda r: print(f"  {label}: round {r}/{args.rounds}", file=sys.stderr, flush=True)

    cpu = measure(names, args.calls, args.rounds, torch.device("cpu"), "CPU", NoLaunch(), time.thread_time,
                  progress=progress("no-op launch"))  # fmt: skip
    print(table(cpu, f"bnb-mps' host cost per call, kernel launch replaced by a no-op (CPU tensors; op keys in {key})"))
    out["no_op_launch"] = cpu
    out["cases"] = [{"name": n, **{k: round(v, 3) for k, v in r.items()}} for n, r in cpu["rows"].items()]

    if args.native:
        from bnb_mps import executors

        sel = executors.selection()
        if sel.tier != "native" or not torch.backends.mps.is_available():
            print(f"\n--native: not measured: the native tier does not serve here ({sel.tier}: {sel.reason})")
            out["native"] = {"error": f"the native tier does not serve here ({sel.tier}: {sel.reason})"}
        else:
            native = measure(names, args.calls, args.rounds, torch.device("mps"), "MPS", None, time.perf_counter,
                             sync=torch.mps.synchronize, progress=progress("native"))  # fmt: skip
            print()
            print(table(native, "bnb-mps' host cost per call on the native tier (mps tensors, real launches)"))
            out["native"] = native
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
