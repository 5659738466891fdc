"""The inputs of the CUDA reference outputs in tests/data/cuda_golden/, drawn again.

The reference outputs (bitsandbytes 0.50.2's CUDA kernels on an H100; tests/data/cuda_golden/README.md)
store no inputs: every input is drawn from numpy's RandomState(seed) (whose streams numpy keeps stable)
in one fixed order, so any machine draws the same bits. This module draws them in that order and
yields one `Case` per stored case, named as the stored case is. A case whose draws were made but whose
outputs were not stored (the M = 128 products of the main set) is drawn and skipped, so that
everything after it stays the same.

Three case sets: "main" (cuda_h100.pt), "edge" (cuda_h100_edge.pt: NaN, infinities, subnormals,
extremes) and "mmq" (the QLoRA path through bitsandbytes' Python API).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator

import numpy as np

DTYPES = ("fp32", "fp16", "bf16")
KINDS = ("normal", "wide", "ints", "spiky", "zeroblock", "tiny")
QUANT_BLOCKSIZES = (32, 64, 128, 256, 512, 1024, 2048, 4096)

SETS = {
    "main": dict(seed=20261127, n=(2, 37), mm=[(4096, 4096, 64), (1000, 4096, 128), (4096, 1024, 256)],
                 mm_m=(1, 16, 128), skip_m=(128,), int8=[(17, 4099, 33), (128, 1024, 256)], opt_n=8292,
                 opt_scale=(0.1, 1.0, 0.01), edge=False, mmq=[]),
    "edge": dict(seed=31337, n=(1, 3), mm=[], mm_m=(1,), skip_m=(), int8=[], opt_n=300,
                 opt_scale=(1.0, 1.0, 1.0), edge=True, mmq=[]),
    "mmq": dict(seed=4711, n=(1, 1), mm=[], mm_m=(1,), skip_m=(), int8=[], opt_n=300,
                opt_scale=(1.0, 1.0, 1.0), edge=False, mmq=[(512, 1024), (256, 2048)]),
}  # fmt: skip

# The optimizers of the "opt/" cases, in the order they were run (each over fp32, fp16, bf16).
OPTIMIZERS = ("adam8", "adamw8", "momentum8", "rmsprop8", "lion8", "adagrad8", "ademamix8", "adam32",
              "momentum32", "lion32", "rmsprop32", "adagrad32", "ademamix32", "lamb32", "lars32")  # fmt: skip
EDGE_OPTIMIZERS = ("adam8", "momentum8", "rmsprop8", "lion8", "adagrad8", "ademamix8", "adam32", "lion32",
                   "momentum32")  # fmt: skip


@dataclass
class Case:
    name: str  # the stored case's key, e.g. "q8/fp16/wide/256"
    family: str  # the part before the first "/"
    dtype: str  # "fp32" | "fp16" | "bf16"
    args: dict = field(default_factory=dict)  # numpy arrays and plain parameters


def _values(rs: np.random.RandomState, n: int, kind: str) -> np.ndarray:
    x = rs.standard_normal(n).astype(np.float32)
    if kind == "wide":  # magnitudes over many octaves, some beyond float16
        x = x * np.exp(rs.standard_normal(n) * 4).astype(np.float32)
    if kind == "ints":  # small integers: exact ties
        x = rs.randint(-3, 4, n).astype(np.float32)
    if kind == "spiky":
        x[rs.randint(0, n, 3)] = 1e4
    if kind == "zeroblock":
        x[: n // 2] = 0
    if kind == "tiny":
        x = x * np.float32(1e-20)
    return x


def _edge_values(n: int, dtype_max: float, seed: int) -> np.ndarray:
    """Normal values with NaN, infinities, signed zeros, subnormals and the dtype's extremes planted
    (a RandomState of its own, seeded with the block size)."""
    r = np.random.RandomState(seed)
    x = r.standard_normal(n).astype(np.float32)
    picks = [np.nan, np.inf, -np.inf, -0.0, 0.0, 1e-40, -1e-39, dtype_max, -dtype_max, 1e-45]
    idx = r.choice(n, size=min(n, 3 * len(picks)), replace=False)
    for j, i in enumerate(idx):
        x[i] = picks[j % len(picks)]
    return x


DTYPE_MAX = {"fp32": 3.4028234663852886e38, "fp16": 65504.0, "bf16": 3.3895313892515355e38}


def cases(set_name: str) -> Iterator[Case]:
    """Every case of the set, in the stored order, with its inputs."""
    C = SETS[set_name]
    rs = np.random.RandomState(C["seed"])
    # 8-bit blockwise (block sizes from 64) and 4-bit quantize / dequantize
    for dt in DTYPES:
        for kind in KINDS:
            for bs in QUANT_BLOCKSIZES:
                n = C["n"][0] * bs + C["n"][1]
                x = _values(rs, n, kind)
                if bs >= 64:
                    yield Case(f"q8/{dt}/{kind}/{bs}", "q8", dt, dict(x=x, blocksize=bs))
                for qt in ("nf4", "fp4"):
                    yield Case(f"q4/{qt}/{dt}/{kind}/{bs}", "q4", dt, dict(x=x, blocksize=bs, quant_type=qt))
    # 4-bit products on random packed weights and scales (no quantization step)
    for N, K, bs in C["mm"]:
        packed = rs.randint(0, 256, (N * K // 2, 1)).astype(np.uint8)
        absmax = (np.abs(rs.standard_normal(N * K // bs)) * 0.05 + 0.01).astype(np.float32)
        for qt in ("nf4", "fp4"):
            for dt in DTYPES:
                for m in C["mm_m"]:
                    A = (rs.standard_normal((1, m, K)) * 1.0).astype(np.float32)
                    if m in C["skip_m"]:
                        continue
                    args = dict(A=A, packed=packed, absmax=absmax, N=N, K=K, blocksize=bs, quant_type=qt, M=m)
                    yield Case(f"mm/{N}x{K}/bs{bs}/{qt}/{dt}/M{m}", "mm", dt, args)
    # LLM.int8(): A with outlier columns, W
    for m, K, N in C["int8"]:
        A = rs.standard_normal((m, K)).astype(np.float32)
        A[:, 5] *= 40
        A[3, 7] = 90
        W = rs.standard_normal((N, K)).astype(np.float32)
        for dt in ("fp16", "bf16", "fp32"):
            for th in (0.0, 6.0):
                yield Case(f"int8/{m}x{K}x{N}/{dt}/th{th}", "int8", dt, dict(A=A, W=W, threshold=th))
                yield Case(f"int8dq/{m}x{K}x{N}/{dt}/th{th}", "int8dq", dt, dict(A=A, threshold=th))
    # optimizers: three steps on fixed gradients
    n = C["opt_n"]
    p0 = rs.standard_normal(n).astype(np.float32)
    grads = [rs.standard_normal(n).astype(np.float32) * s for s in C["opt_scale"]]
    grads[1][:50] = 0
    for name in OPTIMIZERS:
        for dt in DTYPES:
            yield Case(f"opt/{name}/{dt}", "opt", dt, dict(optimizer=name, p=p0, grads=grads))
    if C["edge"]:
        yield from _edge_cases(rs)
    for N, K in C["mmq"]:
        W0 = (rs.standard_normal((N, K)) / np.sqrt(K)).astype(np.float32)
        bias0 = rs.standard_normal(N).astype(np.float32)
        for dt in DTYPES:
            for nested in (0, 1):
                yield Case(f"mmq-w/{N}x{K}/{dt}/nested{nested}", "mmq-w", dt, dict(W=W0, nested=nested))
                for m in (1, 16):
                    A0 = rs.standard_normal((m, K)).astype(np.float32)
                    for with_bias in (0, 1):
                        args = dict(W=W0, nested=nested, A=A0, bias=bias0 if with_bias else None)
                        yield Case(f"mmq/{N}x{K}/{dt}/nested{nested}/M{m}/bias{with_bias}", "mmq", dt, args)


def _edge_cases(rs: np.random.RandomState) -> Iterator[Case]:
    for dt in DTYPES:
        for bs in (64, 256, 4096):
            x = _edge_values(3 * bs + 5, DTYPE_MAX[dt], bs)
            yield Case(f"edge-q8/{dt}/{bs}", "edge-q8", dt, dict(x=x, blocksize=bs))
            for qt in ("nf4", "fp4"):
                yield Case(f"edge-q4/{qt}/{dt}/{bs}", "edge-q4", dt, dict(x=x, blocksize=bs, quant_type=qt))
        # a block of zeros, one of subnormals, one of ones with a value near the float32 maximum
        blocks = np.concatenate([np.zeros(256), np.full(256, 1e-40), np.r_[np.full(255, 1.0), 3e38]]).astype(np.float32)
        yield Case(f"edge-blocks-q8/{dt}", "edge-blocks-q8", dt, dict(x=blocks, blocksize=256))
        yield Case(f"edge-blocks-q4/{dt}", "edge-blocks-q4", dt, dict(x=blocks, blocksize=256, quant_type="nf4"))
    # optimizers whose second step has a NaN, a +inf and a -inf gradient
    n = 4096
    p0 = rs.standard_normal(n).astype(np.float32)
    g1 = rs.standard_normal(n).astype(np.float32) * 0.1
    g2 = rs.standard_normal(n).astype(np.float32) * 0.1
    g2[[3, 700, 2000]] = [np.nan, np.inf, -np.inf]
    for name in EDGE_OPTIMIZERS:
        for dt in ("fp32", "fp16"):
            yield Case(f"edge-opt/{name}/{dt}", "edge-opt", dt, dict(optimizer=name, p=p0, grads=[g1, g2, g1]))
    # int8 row quantization (float16) with infinities, NaN and a zero row
    A = rs.standard_normal((16, 512)).astype(np.float32)
    A[2, 5], A[4, 9], A[6, 1] = np.inf, -np.inf, np.nan
    A[8, :] = 0
    for th in (0.0, 6.0):
        yield Case(f"edge-int8/th{th}", "edge-int8", "fp16", dict(A=A, threshold=th))
