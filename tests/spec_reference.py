"""A plain reference of docs/semantics.md sections 1-3 (blockwise 8-bit and 4-bit NF4/FP4
quantization).

Written from docs/semantics.md alone, independent of any kernel: vectorised numpy in float32,
rounding to float32 after every operation exactly where that page does (`fl32(1 / absmax)`, then
`fl32(x * r)`, thresholds `fl32(c_k + c_{k+1}) / 2`). Tensors in and out are torch tensors on the CPU.

A block whose elements are all NaN has absmax 0: the page's maximum ignores NaN and the maximum of
no elements is 0 (as bitsandbytes' CPU quantizer does).

Apple GPUs flush float32 subnormals (docs/semantics.md, "Apple GPUs"). With `flush=True` (the
default, `FLUSH`: what the kernels compute on a Mac and under the emulator's default "apple" float
mode) the reference follows that contract: float32/bfloat16 inputs below 2^-126 count as zero (so
a block of zeros and subnormals is an all-zero block), and float32 results below 2^-126 of the
dequantizers' products and sums are zero (with their sign). The quantizers' own arithmetic (the
reciprocal, the scaled values and their codes) stays IEEE: the kernels give that answer on the
hardware too. `flush=False` is plain IEEE float32 (the emulator's "ieee" mode, and CUDA).
"""

from __future__ import annotations

import math

import numpy as np
import torch

F32 = np.float32

#: Apple-GPU float semantics by default (see the module docstring); False for plain IEEE.
FLUSH = True
_TINY = F32(2.0**-126)  # the smallest normal float32

BLOCKSIZES_8BIT = (64, 128, 256, 512, 1024, 2048, 4096)
BLOCKSIZES_4BIT = (32, 64, 128, 256, 512, 1024, 2048, 4096)
DTYPES = (torch.float16, torch.bfloat16, torch.float32)

NF4_TABLE = np.array(
    [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
     -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
     0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
     0.7229568362236023, 1.0],
    dtype=F32,
)
_FP4_MAGNITUDES = np.array([0, 0.0625, 8, 12, 4, 6, 2, 3], dtype=F32) / F32(12)
#: nibble -> value; bit 3 is the sign, so nibble 8 is -0.0.
FP4_TABLE = np.concatenate([_FP4_MAGNITUDES, -_FP4_MAGNITUDES]).astype(F32)
# CUDA's FP4 decision tree constants (strict comparisons; not exact midpoints).
_FP4_T = {name: F32(v) for name, v in dict(
    root=0.29166667, hi=0.583333, hi_hi=0.8333333, hi_lo=0.4166667,
    lo=0.0859375, lo_hi=0.20833333, lo_lo=0.00260417).items()}


def table_4bit(quant_type: str) -> np.ndarray:
    if quant_type == "nf4":
        return NF4_TABLE
    if quant_type == "fp4":
        return FP4_TABLE
    raise ValueError(f"quant_type must be 'nf4' or 'fp4', got {quant_type!r}")


def flush_subnormals(x: np.ndarray) -> np.ndarray:
    """float32 values below 2^-126 in magnitude -> zero of the same sign (NaN, inf unchanged)."""
    x = np.asarray(x, dtype=F32)
    return np.where(np.abs(x) < _TINY, np.copysign(F32(0), x), x).astype(F32)


def _flush(flush: bool | None) -> bool:
    return FLUSH if flush is None else bool(flush)


def _maybe_flush(x: np.ndarray, flush: bool | None) -> np.ndarray:
    return flush_subnormals(x) if _flush(flush) else np.asarray(x, dtype=F32)


def _flat_f32(A: torch.Tensor, flush: bool | None = None) -> np.ndarray:
    """Elements in flat row-major order as float32 (exact for fp16/bf16/fp32); with `flush`, the
    float32 subnormals (only bfloat16/float32 inputs have them) as zeros."""
    if A.dtype not in DTYPES:
        raise TypeError(f"A must be float16, bfloat16 or float32, got {A.dtype}")
    return _maybe_flush(A.detach().contiguous().reshape(-1).to(torch.float32).numpy(), flush)


def _to_dtype(x: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """float32 -> T with round-to-nearest-even (torch's conversion)."""
    return torch.from_numpy(np.ascontiguousarray(x, dtype=F32)).to(dtype)


def blockwise_absmax(x: np.ndarray, blocksize: int) -> np.ndarray:
    """absmax[b] = max |x_i| over block b (NaN ignored; an empty / all-NaN / all-zero block gives 0)."""
    n = x.size
    blocks = -(-n // blocksize)
    padded = np.zeros(blocks * blocksize, dtype=F32)
    padded[:n] = np.abs(x)
    padded[np.isnan(padded)] = 0
    return padded.reshape(blocks, blocksize).max(axis=1) if blocks else np.zeros(0, F32)


def scaled_values(x: np.ndarray, absmax: np.ndarray, blocksize: int) -> np.ndarray:
    """s_i = fl32(x_i * fl32(1 / absmax[b])); 0 * inf (all-zero block) is NaN."""
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        r = F32(1) / absmax
        return x * np.repeat(r, blocksize)[: x.size]


def thresholds(code: np.ndarray) -> np.ndarray:
    """t_k = fl32(code[k] + code[k+1]) / 2, in float32."""
    code = np.asarray(code, dtype=F32)
    return (code[:-1] + code[1:]) / F32(2)


def index_8bit(s: np.ndarray, code: np.ndarray) -> np.ndarray:
    """q = #{k : s > t_k}; an exact tie s == t_k goes to the even one of {k, k+1}; NaN gives 0."""
    t = thresholds(code)
    q = np.searchsorted(t, s, side="left")  # number of thresholds strictly below s
    q[np.isnan(s)] = 0
    tie = (q < t.size) & (t[np.minimum(q, t.size - 1)] == s)
    q = q + (tie & (q % 2 == 1))
    return q.astype(np.uint8)


def index_nf4(s: np.ndarray) -> np.ndarray:
    """nibble = #{k : s > t_k} over NF4's 15 thresholds (ties to the lower nibble); NaN gives 0."""
    t = thresholds(NF4_TABLE)
    q = np.searchsorted(t, s, side="left")
    q[np.isnan(s)] = 0
    return q.astype(np.uint8)


def index_fp4(s: np.ndarray) -> np.ndarray:
    """CUDA's FP4 tree: sign bit iff s < 0, magnitude by strict comparisons (NaN -> 0)."""
    T = _FP4_T
    m = np.abs(s)
    code = np.where(
        m > T["root"],
        np.where(m > T["hi"], np.where(m > T["hi_hi"], 3, 2), np.where(m > T["hi_lo"], 5, 4)),
        np.where(m > T["lo"], np.where(m > T["lo_hi"], 7, 6), np.where(m > T["lo_lo"], 1, 0)),
    )
    return (code + np.where(s < 0, 8, 0)).astype(np.uint8)


def _check_blocksize(blocksize: int, allowed: tuple[int, ...]) -> None:
    if blocksize not in allowed:
        raise ValueError(f"blocksize must be one of {allowed}, got {blocksize}")


def _check_code(code: torch.Tensor) -> np.ndarray:
    c = code.detach().reshape(-1).to(torch.float32).numpy()
    if c.size != 256 or not np.all(np.diff(c) > 0):
        raise ValueError("code must hold 256 strictly increasing values")
    return c


# -- section 2: 8-bit blockwise ------------------------------------------------------------------


def quantize_blockwise(A: torch.Tensor, code: torch.Tensor, blocksize: int,
                       flush: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(uint8 codes shaped like A, float32 absmax [ceil(n / blocksize)])."""
    _check_blocksize(blocksize, BLOCKSIZES_8BIT)
    c = _check_code(code)
    x = _flat_f32(A, flush)
    absmax = blockwise_absmax(x, blocksize)
    q = index_8bit(scaled_values(x, absmax, blocksize), c)
    return torch.from_numpy(q).reshape(A.shape), torch.from_numpy(absmax)


def dequantize_blockwise(A: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor, blocksize: int,
                         dtype: torch.dtype, flush: bool | None = None) -> torch.Tensor:
    """out_i = T(fl32(code[q_i] * absmax[i // blocksize]))."""
    _check_blocksize(blocksize, BLOCKSIZES_8BIT)
    q = A.detach().contiguous().reshape(-1).numpy().astype(np.int64)
    c = _maybe_flush(code.detach().reshape(-1).to(torch.float32).numpy(), flush)
    am = _maybe_flush(absmax.detach().reshape(-1).to(torch.float32).numpy(), flush)
    scale = np.repeat(am, blocksize)[: q.size]
    return _to_dtype(_maybe_flush(c[q] * scale, flush), dtype).reshape(A.shape)


# -- section 3: 4-bit NF4 / FP4 ------------------------------------------------------------------


def quantize_4bit_nibbles(A: torch.Tensor, blocksize: int, quant_type: str,
                          flush: bool | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Per-element nibbles (with the odd-n padding nibble appended) and absmax."""
    _check_blocksize(blocksize, BLOCKSIZES_4BIT)
    table_4bit(quant_type)
    x = _flat_f32(A, flush)
    absmax = blockwise_absmax(x, blocksize)
    if x.size % 2:
        # The padding element is a 0 of the last block: the code of s = 0 (NaN, hence 0, if absmax is 0).
        x = np.concatenate([x, np.zeros(1, F32)])
    s = scaled_values(x, absmax, blocksize)
    nibbles = index_nf4(s) if quant_type == "nf4" else index_fp4(s)
    return nibbles, absmax


def pack_nibbles(nibbles: np.ndarray) -> np.ndarray:
    """Element 2j -> high nibble of byte j, element 2j+1 -> low nibble (len(nibbles) even)."""
    return ((nibbles[0::2] << 4) | nibbles[1::2]).astype(np.uint8)


def quantize_4bit(A: torch.Tensor, blocksize: int, quant_type: str, quant_storage: torch.dtype = torch.uint8,
                  flush: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed bytes viewed as `quant_storage`, shape (nbytes // itemsize, 1); float32 absmax)."""
    nibbles, absmax = quantize_4bit_nibbles(A, blocksize, quant_type, flush)
    packed = torch.from_numpy(pack_nibbles(nibbles))
    itemsize = torch.empty((), dtype=quant_storage).element_size()
    if packed.numel() % itemsize:
        raise ValueError(f"{packed.numel()} packed bytes cannot be viewed as {quant_storage} (itemsize {itemsize})")
    return packed.view(quant_storage).reshape(-1, 1), torch.from_numpy(absmax)


def unpack_nibbles(A: torch.Tensor, n: int) -> np.ndarray:
    """The first n nibbles of A's bytes (any storage dtype), high nibble first."""
    b = A.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
    nib = np.empty(b.size * 2, dtype=np.uint8)
    nib[0::2] = b >> 4
    nib[1::2] = b & 0xF
    if nib.size < n:
        raise ValueError(f"A holds {nib.size} nibbles, shape needs {n}")
    return nib[:n]


def dequantize_4bit(A: torch.Tensor, absmax: torch.Tensor, blocksize: int, quant_type: str,
                    shape, dtype: torch.dtype, flush: bool | None = None) -> torch.Tensor:
    """out_i = T(fl32(table[nibble_i] * absmax[i // blocksize])), shaped `shape`."""
    _check_blocksize(blocksize, BLOCKSIZES_4BIT)
    table = table_4bit(quant_type)
    n = math.prod(shape)
    nib = unpack_nibbles(A, n)
    am = _maybe_flush(absmax.detach().reshape(-1).to(torch.float32).numpy(), flush)
    scale = np.repeat(am, blocksize)[:n]
    return _to_dtype(_maybe_flush(table[nib] * scale, flush), dtype).reshape(tuple(shape))


# -- double quantization of the absmax vector ----------------------------------------------------


def double_quantize(absmax: torch.Tensor, code: torch.Tensor,
                    flush: bool | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(absmax_8bit uint8, nested_absmax float32, offset float32 0-dim): absmax - mean, 8-bit, blocksize 256."""
    offset = absmax.mean()
    q, nested = quantize_blockwise(absmax - offset, code, 256, flush)
    return q, nested, offset


def nested_scales(absmax_8bit: torch.Tensor, absmax_code: torch.Tensor, nested_absmax: torch.Tensor,
                  offset, flush: bool | None = None, blocksize: int = 256) -> torch.Tensor:
    """scale_b = fl32(fl32(absmax_code[absmax_8bit[b]] * nested_absmax[b // blocksize]) + offset)
    (blocksize 256 for 4-bit double quantization; the 8-bit API's nested=True uses its own)."""
    q = absmax_8bit.detach().reshape(-1).numpy().astype(np.int64)
    c = _maybe_flush(absmax_code.detach().reshape(-1).to(torch.float32).numpy(), flush)
    nested = _maybe_flush(nested_absmax.detach().reshape(-1).to(torch.float32).numpy(), flush)
    off = _maybe_flush(np.array([torch.as_tensor(offset).to(torch.float32).item()], F32), flush)[0]
    product = _maybe_flush(c[q] * np.repeat(nested, blocksize)[: q.size], flush)
    return torch.from_numpy(_maybe_flush(product + off, flush))
