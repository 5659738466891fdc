"""Valid inputs for every bitsandbytes op schema, built from a seed (shared by the op tests).

`cases(name)` yields (label, args) pairs: positional arguments in schema order, CPU tensors.
"""

from __future__ import annotations


import torch
from bitsandbytes.functional import create_dynamic_map, get_4bit_type

FLOATS = (torch.float16, torch.bfloat16, torch.float32)
OPTIMIZERS = ("adam", "lamb", "ademamix", "momentum", "lars", "rmsprop", "adagrad", "lion")
TWO_STATE = ("adam", "lamb", "ademamix")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(*shape, dtype=torch.float32, seed=0, scale=1.0):
    return (torch.randn(*shape, generator=_gen(seed)) * scale).to(dtype)


def signed_code():
    return create_dynamic_map(signed=True)


def unsigned_code():
    return create_dynamic_map(signed=False)


def quantized_blockwise(n_shape, blocksize, seed=0):
    A = randn(*n_shape, seed=seed)
    return torch.ops.bitsandbytes.quantize_blockwise(A, signed_code(), blocksize)


def quantized_4bit(shape, blocksize, quant_type, dtype=torch.float32, storage=torch.uint8, seed=0):
    A = randn(*shape, dtype=dtype, seed=seed)
    packed, absmax = torch.ops.bitsandbytes.quantize_4bit(A, blocksize, quant_type, storage)
    return packed, absmax


def int8_rows(shape, seed=0):
    return torch.randint(-127, 128, shape, generator=_gen(seed), dtype=torch.int8)


def cases(name: str):
    """Representative valid calls of schema `name`."""
    yield from _CASES[name]()


def _quantize_blockwise():
    for dtype in FLOATS:
        for shape, bs in (((1000,), 256), ((33, 65), 64), ((4096 + 5,), 4096), ((2, 3, 128), 128)):
            yield f"{dtype}-{shape}-{bs}", [randn(*shape, dtype=dtype, seed=bs), signed_code(), bs]
    yield "unsigned-code", [randn(300, seed=3).abs(), unsigned_code(), 64]
    yield "empty", [torch.empty(0), signed_code(), 256]


def _dequantize_blockwise(out: bool = False):
    for dtype in FLOATS:
        for shape, bs in (((1000,), 256), ((33, 65), 64), ((130,), 128)):
            q, absmax = quantized_blockwise(shape, bs, seed=bs)
            args = [q, absmax, signed_code(), bs, dtype]
            if out:
                args.append(torch.full(shape, 7.0, dtype=dtype))
            yield f"{dtype}-{shape}-{bs}", args


def _quantize_4bit():
    for dtype in FLOATS:
        for qt in ("nf4", "fp4"):
            for shape, bs in (((64, 64), 64), ((7, 9), 32), ((1001,), 128), ((3, 4096), 4096)):
                yield f"{dtype}-{qt}-{shape}-{bs}", [randn(*shape, dtype=dtype, seed=bs), bs, qt, torch.uint8]
    for storage in (torch.bfloat16, torch.float16, torch.float32, torch.int8):
        yield f"storage-{storage}", [randn(32, 64, seed=1), 64, "nf4", storage]


def _dequantize_4bit(out: bool = False):
    for dtype in FLOATS:
        for qt in ("nf4", "fp4"):
            for shape, bs in (((64, 64), 64), ((16, 40), 32), ((8, 256), 256)):
                packed, absmax = quantized_4bit(shape, bs, qt, seed=bs)
                args = [packed, absmax, bs, qt, list(shape), dtype]
                if out:
                    args.append(torch.full(shape, 3.0, dtype=dtype))
                yield f"{dtype}-{qt}-{shape}-{bs}", args
    packed, absmax = quantized_4bit((32, 64), 64, "nf4", storage=torch.bfloat16)
    yield "bf16-storage", [packed, absmax, 64, "nf4", [32, 64], torch.float32] + ([torch.zeros(32, 64)] if out else [])
    # rows of 96 in blocks of 64: blocks straddle rows (bitsandbytes' AVX-512 CPU kernel misreads them)
    packed, absmax = quantized_4bit((6, 96), 64, "fp4", seed=3)
    yield "blocks-across-rows", [packed, absmax, 64, "fp4", [6, 96], torch.float16] + (
        [torch.zeros(6, 96, dtype=torch.float16)] if out else [])


def _gemv_4bit(out: bool = False):
    # N % 32 == 0 throughout, as bitsandbytes 0.50.2's AVX512-BF16 CPU gemv needs (tests/stock_cpu_paths.py).
    # Besides M = 1 (the gemv kernel), one case each for the op layer's batch (M <= 8) and mma paths.
    shapes = [(f"{dtype}-{qt}", dtype, qt, 64, 128, 64, (1, 1)) for dtype in FLOATS for qt in ("nf4", "fp4")]
    shapes += [("M4", torch.float16, "fp4", 32, 96, 32, (4,)), ("M10", torch.bfloat16, "nf4", 64, 64, 128, (2, 5))]
    for label, dtype, qt, N, K, bs, lead in shapes:
        packed, absmax = quantized_4bit((N, K), bs, qt, seed=5)
        A = randn(*lead, K, dtype=dtype, seed=6)
        args = [A, packed, [N, K], absmax, get_4bit_type(qt, device="cpu"), bs]
        if out:
            args.append(torch.zeros(*lead, N, dtype=dtype))
        yield label, args
    packed, absmax = quantized_4bit((32, 64), 64, "nf4", storage=torch.bfloat16, seed=5)
    args = [randn(64, dtype=torch.bfloat16, seed=6), packed, [32, 64], absmax, get_4bit_type("nf4", device="cpu"), 64]
    yield "bf16-storage-1d-A", args + ([torch.zeros(32, dtype=torch.bfloat16)] if out else [])


def _gemm_4bit():
    def nested(absmax):
        offset = absmax.mean()
        q8, nested_absmax = torch.ops.bitsandbytes.quantize_blockwise(absmax - offset, signed_code(), 256)
        return nested_absmax, q8, offset

    N, K, bs = 40, 96, 32
    for dtype in FLOATS:
        for qt in ("nf4", "fp4"):
            packed, absmax = quantized_4bit((N, K), bs, qt, seed=7)
            A = randn(3, 5, K, dtype=dtype, seed=8)
            yield f"{dtype}-{qt}", [A, packed, [N, K], absmax, bs, qt, None, None, None, None]
            bias = randn(N, dtype=dtype, seed=9)
            nested_absmax, q8, offset = nested(absmax)
            yield f"{dtype}-{qt}-nested-bias", [A, packed, [N, K], nested_absmax, bs, qt, bias, q8, signed_code(),
                                                offset]  # fmt: skip
    # M = 1 and M = 6 (the op layer's gemv and batch kernels; 15 rows above take the mma one), blocks
    # of 64 on rows of 96 (blocks straddle rows), K % 16 != 0 (blocks start mid-row), a strided A and
    # a bf16-stored weight.
    packed, absmax = quantized_4bit((N, K), bs, "nf4", seed=7)
    nested_absmax, q8, offset = nested(absmax)
    yield "M1-bias", [randn(1, K, dtype=torch.float16, seed=10), packed, [N, K], absmax, bs, "nf4",
                      randn(N, dtype=torch.float16, seed=9), None, None, None]  # fmt: skip
    yield "M6-nested", [randn(2, 3, K, dtype=torch.bfloat16, seed=11), packed, [N, K], nested_absmax, bs, "nf4", None,
                        q8, signed_code(), offset]  # fmt: skip
    packed, absmax = quantized_4bit((N, K), 64, "fp4", seed=7)
    yield "blocks-across-rows", [randn(2, K, seed=16), packed, [N, K], absmax, 64, "fp4", None, None, None, None]
    packed33, absmax33 = quantized_4bit((7, 33), 64, "fp4", seed=12)
    yield "K33", [randn(4, 33, seed=13), packed33, [7, 33], absmax33, 64, "fp4", None, None, None, None]
    packed, absmax = quantized_4bit((64, 128), 64, "nf4", storage=torch.bfloat16, seed=14)
    wide = randn(9, 160, dtype=torch.float16, seed=15)
    yield "bf16-storage-strided-A", [wide[:, 16:144], packed, [64, 128], absmax, 64, "nf4", None, None, None, None]


def _int8_vectorwise_quant():
    for dtype in FLOATS:
        for threshold in (0.0, 2.0):
            yield f"{dtype}-{threshold}", [randn(17, 33, dtype=dtype, seed=11, scale=1.5), threshold]
    yield "one-row-outliers", [randn(1, 40, dtype=torch.float16, seed=12, scale=3), 2.0]
    yield "wide", [randn(4, 4100, dtype=torch.float16, seed=13, scale=2), 6.0]


def _int8_vectorwise_dequant():
    A = int8_rows((9, 31))
    yield "basic", [A, randn(9, seed=12).abs() + 0.1]
    yield "aligned-rows", [int8_rows((6, 64), seed=3), randn(6, seed=13).abs() + 0.1]


def _int8_linear_matmul(out: bool = False):
    # every kernel path: gemv1 (M = 1), gemv4 (M <= 8), tile32, tile64; K % 16 == 0 or not
    for shape, N in (((5, 64), 24), ((2, 3, 64), 24), ((1, 64), 24), ((20, 33), 40), ((40, 48), 70)):
        A, B = int8_rows(shape, seed=13), int8_rows((N, shape[-1]), seed=14)
        args = [A, B]
        if out:
            args.append(torch.zeros(*shape[:-1], N, dtype=torch.int32))
        yield f"{shape}x{N}", args


def _int8_mm_dequant():
    A = torch.randint(-50000, 50000, (7, 12), generator=_gen(15), dtype=torch.int32)
    rs, cs = randn(7, seed=16).abs() + 1, randn(12, seed=17).abs() + 1
    for dtype in (None, torch.float16, torch.bfloat16, torch.float32):
        yield f"{dtype}", [A, rs, cs, dtype, None]
    yield "bias", [A, rs, cs, torch.float16, randn(12, dtype=torch.float16, seed=18)]
    yield "f32-bias-bf16-out", [A, rs, cs, torch.bfloat16, randn(12, seed=19)]


def _int8_scaled_mm():
    A, B = int8_rows((6, 32), seed=19), int8_rows((10, 32), seed=20)
    rs, cs = randn(6, seed=21).abs() + 1, randn(10, seed=22).abs() + 1
    yield "plain", [A, B, rs, cs, None, None]
    yield "bias-bf16", [A, B, rs, cs, randn(10, dtype=torch.bfloat16, seed=23), torch.bfloat16]
    yield "f32-bias-f16-out", [A, B, rs, cs, randn(10, seed=24), torch.float16]
    A, B = int8_rows((40, 48), seed=25), int8_rows((70, 48), seed=26)
    yield "tiled-f32", [A, B, randn(40, seed=27).abs() + 1, randn(70, seed=28).abs() + 1, None, torch.float32]


def _int8_mixed_scaled_mm():
    A = randn(6, 32, dtype=torch.float16, seed=24, scale=2)
    CA, SCA, cols = torch.ops.bitsandbytes.int8_vectorwise_quant(A, 3.0)
    W = randn(10, 32, dtype=torch.float16, seed=25)
    CB, SCB, _ = torch.ops.bitsandbytes.int8_vectorwise_quant(W, 0.0)
    yield "outliers", [A, CA, CB, SCA, SCB, cols, None]
    yield "none", [A, CA, CB, SCA, SCB, None, randn(10, dtype=torch.float16, seed=26)]
    A = randn(40, 32, dtype=torch.float16, seed=27, scale=2)
    CA, SCA, cols = torch.ops.bitsandbytes.int8_vectorwise_quant(A, 3.0)
    yield "tiled-outliers-bias", [A, CA, CB, SCA, SCB, cols, randn(10, dtype=torch.float16, seed=28)]


def _int8_double_quant():
    for threshold in (0.0, 2.5):
        yield f"{threshold}", [randn(12, 20, dtype=torch.float16, seed=27, scale=1.5), threshold]
    yield "f32-64", [randn(40, 64, seed=29, scale=1.5), 0.0]


def _optimizer_32bit():
    n = 1000
    for name in OPTIMIZERS:
        for dtype in FLOATS:
            p = randn(n, dtype=dtype, seed=30)
            g = randn(n, dtype=dtype, seed=31, scale=0.1)
            s1 = randn(*((2, n) if name == "ademamix" else (n,)), seed=32, scale=0.01)
            if name in ("adam", "lamb", "ademamix", "rmsprop", "adagrad"):
                s1 = s1.abs() if name in ("rmsprop", "adagrad") else s1
            s2 = randn(n, seed=33, scale=0.01).abs() if name in TWO_STATE else None
            max_unorm = 1.0 if name in ("lamb", "lars") else 0.0
            unorm = torch.zeros(1) if max_unorm > 0 else None
            wd = 0.01
            yield f"{name}-{dtype}", [name, g, p, s1, s2, unorm, max_unorm, 2.0, 0.9, 0.999, 0.9999, 5.0, 1e-8, wd,
                                      3, 1e-3, 1.0, False]  # fmt: skip


def _optimizer_8bit():
    n = 700
    for name in OPTIMIZERS:
        if name in ("lamb", "lars"):  # 32-bit only (the 8-bit op refuses them, as CUDA does)
            continue
        for dtype in FLOATS:
            p = randn(n, dtype=dtype, seed=40)
            g = randn(n, dtype=dtype, seed=41, scale=0.1)
            copies = 2 if name == "ademamix" else 1
            s1f = randn(copies * n, seed=42, scale=0.01)
            if name in ("rmsprop", "adagrad"):
                s1f = s1f.abs()
            q1, a1 = [], []
            for c in range(copies):
                q, a = torch.ops.bitsandbytes.quantize_blockwise(s1f[c * n : (c + 1) * n], signed_code(), 256)
                q1.append(q)
                a1.append(a)
            state1 = torch.stack(q1) if copies == 2 else q1[0]
            absmax1 = torch.stack(a1) if copies == 2 else a1[0]
            if name in TWO_STATE:
                s2, a2 = torch.ops.bitsandbytes.quantize_blockwise(randn(n, seed=43, scale=0.01).abs(),
                                                                    unsigned_code(), 256)  # fmt: skip
                q2 = unsigned_code()
            else:
                s2 = a2 = q2 = None
            yield f"{name}-{dtype}", [name, g, p, state1, s2, 0.9, 0.995, 0.9999, 5.0, 1e-8, 4, 1e-3, signed_code(),
                                      q2, absmax1, a2, 0.01, 1.0, False]  # fmt: skip


_CASES = {
    "quantize_blockwise": _quantize_blockwise,
    "dequantize_blockwise": _dequantize_blockwise,
    "dequantize_blockwise.out": lambda: _dequantize_blockwise(out=True),
    "quantize_4bit": _quantize_4bit,
    "dequantize_4bit": _dequantize_4bit,
    "dequantize_4bit.out": lambda: _dequantize_4bit(out=True),
    "gemv_4bit": _gemv_4bit,
    "gemv_4bit.out": lambda: _gemv_4bit(out=True),
    "gemm_4bit": _gemm_4bit,
    "int8_vectorwise_quant": _int8_vectorwise_quant,
    "int8_vectorwise_dequant": _int8_vectorwise_dequant,
    "int8_linear_matmul": _int8_linear_matmul,
    "int8_linear_matmul.out": lambda: _int8_linear_matmul(out=True),
    "int8_mm_dequant": _int8_mm_dequant,
    "int8_scaled_mm": _int8_scaled_mm,
    "int8_mixed_scaled_mm": _int8_mixed_scaled_mm,
    "int8_double_quant": _int8_double_quant,
    "optimizer_update_32bit": _optimizer_32bit,
    "optimizer_update_8bit_blockwise": _optimizer_8bit,
}
