"""bitsandbytes 0.50.2's CPU code paths that depend on the CPU's instruction set, modelled in PyTorch
so that the suite can put them in place on any CPU.

On x86-64, bitsandbytes' CPU backend (bitsandbytes/backends/cpu/ops.py over csrc/cpu_ops.cpp) picks
its kernels by what the CPU has:

- AVX512-BF16 (`bitsandbytes.functional.has_avx512bf16()`, read once at import): a CPU kernel for
  `gemv_4bit` is registered; elsewhere bitsandbytes' pure-PyTorch default kernel serves it
  (dequantize_4bit to A's dtype, then torch's linear). That kernel reads the weight in bitsandbytes'
  own packed CPU layout (`bitsandbytes.functional._convert_weight_packed_for_cpu`, which Linear4bit
  applies on such CPUs at its first eval forward) and the block scales as a [K / blocksize, N]
  bfloat16 matrix. Given the standard layout it returns wrong values; when K is not a multiple of
  the block size its loop reads past A, B and absmax; when N is not a multiple of 32 it aborts the
  process.
- AVX-512F (the library's own cpuid check, at run time): `dequantize_4bit` takes a vectorised path
  when the last dimension of `shape` is a multiple of 16 and the block size below 2048 (from 2048 on,
  on CPUs that torch rates "AVX512", bitsandbytes takes its PyTorch path). The vectorised path takes
  row r's scales from absmax[r * (n // blocksize) + column // blocksize] (n the row length): wrong
  when n is not a multiple of the block size, since blocks are flat runs (docs/semantics.md
  section 3). bitsandbytes' CPU gemm_4bit dequantizes through it.
- AVX512 (torch's CPU capability): `int8_linear_matmul` is torch._int_mm (exact int32 sums) instead
  of bitsandbytes' default float32 matmul (exact only while the sums stay below 2^24).

None of these paths can be taken on a CPU without the instructions: the gemv kernel is compiled
for AVX512-BF16 (elsewhere it dies of an illegal instruction) and the library itself chooses the
dequantize path. `avx512_cpu()` therefore registers these models where bitsandbytes registers its
CPU kernels (each op's CPU dispatch key) for the duration of a `with` block. Where this CPU does
take a path (`missing_paths()` says which it does not), tests/test_stock_cpu_paths.py compares the
model with bitsandbytes' real kernel, so that the models cannot drift from what they model.
"""

from __future__ import annotations

import contextlib
import math
import warnings

import torch
from bitsandbytes.functional import get_4bit_type


def _nibbles(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The first n 4-bit codes of the standard layout (high nibble first), as int64."""
    b = packed.contiguous().view(torch.uint8).reshape(-1)
    return torch.stack([b >> 4, b & 15], dim=1).reshape(-1)[:n].long()


def gemv_4bit_avx512bf16(A, B, shapeB, absmax, code, blocksize):
    """What bitsandbytes' AVX512-BF16 gemv_4bit returns (its Python wrapper and csrc/cpu_ops.cpp's
    gemv_4bit_inference), up to the order of its float32 sums; NaN where it reads past its buffers."""
    N, K = shapeB
    if N % 32:
        raise RuntimeError("bitsandbytes' AVX512-BF16 gemv_4bit aborts the process when N % 32 != 0")
    lead = A.shape[:-1]
    if K % blocksize:
        return torch.full((*lead, N), float("nan"), dtype=A.dtype)
    groups = K // blocksize
    # The wrapper converts A and absmax to bfloat16; the kernel's table holds the 16 values in bfloat16.
    a = A.reshape(-1, K).to(torch.bfloat16).float()
    table = get_4bit_type("fp4" if code[1] > 0 else "nf4", device="cpu").to(torch.bfloat16).float()
    # Per 32 rows of the weight, 32 bytes per pair of columns (2p, 2p + 1): byte 2j + t holds column
    # 2p + t of row j in its low nibble and of row 16 + j in its high nibble.
    b = B.contiguous().view(torch.uint8).reshape(N // 32, K // 2, 16, 2)
    nib = torch.cat([b & 15, b >> 4], dim=2)  # [N / 32, K / 2, 32 rows, 2]
    w = table[nib.permute(0, 2, 1, 3).reshape(N, K).long()]
    scales = absmax.to(torch.bfloat16).float().reshape(-1)[: groups * N].reshape(groups, N)
    # bfloat16 products summed in float32 per block, each block's sum scaled and added up
    per_block = a.reshape(-1, groups, blocksize).transpose(0, 1) @ w.reshape(N, groups, blocksize).permute(1, 2, 0)
    y = (per_block * scales[:, None, :]).sum(dim=0)
    return y.to(torch.bfloat16).to(A.dtype).reshape(*lead, N)


def dequantize_4bit_avx512(A, absmax, blocksize, quant_type, shape, dtype):
    """What bitsandbytes' CPU dequantize_4bit returns on a CPU with AVX-512F (values and shape)."""
    n = shape[-1]
    total = math.prod(shape)
    i = torch.arange(total)
    pytorch_path = blocksize >= 2048 or n % 2 == 1
    if not pytorch_path and n % 16 == 0:  # the vectorised path: scales looked up per row
        block = (i // n) * (n // blocksize) + (i % n) // blocksize
    else:  # the scalar path, or bitsandbytes' PyTorch one: flat blocks
        block = i // blocksize
    values = get_4bit_type(quant_type, device="cpu")[_nibbles(A, total)] * absmax[block]
    out_shape = tuple(shape) if len(shape) > 1 or pytorch_path else (1, n)
    return values.to(dtype).reshape(out_shape)


def int8_linear_matmul_avx512(A, B):
    """bitsandbytes' own CPU int8_linear_matmul for CPUs torch rates "AVX512" (pure PyTorch)."""
    return torch._int_mm(A.reshape(-1, A.shape[-1]), B.t()).reshape(*A.shape[:-1], B.shape[0])


def _cpu_flags() -> set[str]:
    """The x86 feature flags of this CPU (Linux: /proc/cpuinfo), or none elsewhere."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def missing_paths() -> dict[str, str]:
    """schema -> why bitsandbytes does not take the modelled path on this CPU (empty where it takes
    every one): what bitsandbytes' own checks read, as its CPU backend (bitsandbytes/backends/cpu/ops.py)
    reads them when it registers its kernels."""
    import bitsandbytes.backends.cpu.ops as cpu_ops
    from bitsandbytes.functional import has_avx512bf16

    avx512 = torch.backends.cpu.get_cpu_capability() == "AVX512"
    missing = {}
    if not has_avx512bf16():
        missing["gemv_4bit"] = "no AVX512-BF16: bitsandbytes registers no CPU gemv_4bit kernel"
    elif getattr(cpu_ops, "gemm_4bit_forward_kernel", None) is not None:
        missing["gemv_4bit"] = "the kernels package's gemm_4bit_forward serves gemv_4bit instead of the modelled one"
    if not (avx512 and "avx512f" in _cpu_flags()):
        missing["dequantize_4bit"] = "not a CPU with AVX-512F that torch rates AVX512"
    if not avx512:
        missing["int8_linear_matmul"] = f"torch rates this CPU {torch.backends.cpu.get_cpu_capability()}, not AVX512"
    return missing


#: schema -> the model of its CPU kernel on an AVX-512 (with BF16) CPU
MODELS = {
    "gemv_4bit": gemv_4bit_avx512bf16,
    "dequantize_4bit": dequantize_4bit_avx512,
    "int8_linear_matmul": int8_linear_matmul_avx512,
}


@contextlib.contextmanager
def avx512_cpu():
    """bitsandbytes' CPU kernels as a CPU with AVX-512 and AVX512-BF16 has them (MODELS), undone at exit."""
    lib = torch.library.Library("bitsandbytes", "IMPL")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # replacing bitsandbytes' CPU kernels is the point
            for name, fn in MODELS.items():
                lib.impl(name, fn, "CPU")
        yield
    finally:
        lib._destroy()
