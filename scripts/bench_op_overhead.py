"""Python overhead of the op layer per call, with kernel launches recorded instead of run.

What a native-tier call of each quantization op costs on the host before the kernel is encoded:
argument binding and checks, output allocation, kernel choice and launch geometry. Measured on
`meta` tensors (no data, so nothing but that overhead is timed) with a launch that does nothing.
PyTorch's dispatcher adds its own cost on top (torch.ops.bitsandbytes.X -> bnb_mps' kernel).

    python scripts/bench_op_overhead.py [--calls 20000]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def per_call_us(fn, calls: int, repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t) / calls * 1e6)
    return statistics.median(times)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20000)
    args = parser.parse_args(argv)

    import bitsandbytes  # noqa: F401  (defines the schemas)
    from bitsandbytes.functional import create_dynamic_map

    from bnb_mps import ops
    from bnb_mps.testing import RecordingExecutor

    class Discard(RecordingExecutor):  # records nothing: keeps memory flat over many calls
        def launch(self, kernel, *, grid, threadgroup, args):
            pass

    ex = Discard(name="native")
    meta = torch.device("meta")
    W = torch.empty(4096, 4096, dtype=torch.float16, device=meta)
    code = create_dynamic_map(signed=True).to(meta)
    packed, absmax4 = torch.empty(4096 * 2048, 1, dtype=torch.uint8, device=meta), torch.empty(4096 * 4096 // 64, device=meta)
    q8, absmax8 = torch.empty(4096, 4096, dtype=torch.uint8, device=meta), torch.empty(4096 * 4096 // 256, device=meta)
    cases = {
        "quantize_4bit": (W, 64, "nf4", torch.uint8),
        "dequantize_4bit": (packed, absmax4, 64, "nf4", [4096, 4096], torch.float16),
        "quantize_blockwise": (W, code, 256),
        "dequantize_blockwise": (q8, absmax8, code, 256, torch.float16),
    }
    print(f"op layer on meta tensors, {args.calls} calls x 5, median (us per call):")
    for name, call_args in cases.items():
        op = ops.OPS[name]
        us = per_call_us(lambda: ops.call(op, call_args, {}, ex), args.calls)
        print(f"  {name:<22} {us:6.1f}")


if __name__ == "__main__":
    main()
