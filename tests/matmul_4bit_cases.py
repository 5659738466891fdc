"""Shared inputs of the 4-bit matmul tests (emulator and mps): a case description and the
gemm_4bit arguments it stands for, with the dequantized float32 weight from the docs/semantics.md reference."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from bitsandbytes.functional import create_dynamic_map

import reference_matmul_4bit as R
import spec_reference as ref

CODE8 = create_dynamic_map(signed=True)
DT = {torch.float16: "f16", torch.bfloat16: "bf16", torch.float32: "f32"}


@dataclass(frozen=True)
class Case:
    M: int
    N: int
    K: int
    dtype: torch.dtype = torch.float16
    blocksize: int = 64
    quant_type: str = "nf4"
    nested: bool = False
    bias: bool = False
    storage: torch.dtype = torch.uint8
    layout: str = "contiguous"  # of A: contiguous | batched | strided | transposed | misaligned | broadcast
    offset_dtype: torch.dtype = torch.float32
    seed: int = 0

    def __str__(self):
        parts = [f"{self.M}x{self.N}x{self.K}", DT[self.dtype], self.quant_type, f"bs{self.blocksize}"]
        parts += ["nested"] if self.nested else []
        parts += ["bias"] if self.bias else []
        parts += [str(self.storage).removeprefix("torch.")] if self.storage != torch.uint8 else []
        parts += [self.layout] if self.layout != "contiguous" else []
        return "-".join(parts)


def gen(seed):
    return torch.Generator().manual_seed(seed)


def make_A(case: Case, device="cpu") -> torch.Tensor:
    """A on `device` with M rows of K values in the requested memory layout (its values do not
    depend on the layout or the device)."""
    M, K = case.M, case.K
    values = torch.randn(M, K, generator=gen(case.seed + 1)).to(case.dtype).to(device)
    if case.layout == "contiguous":
        return values
    if case.layout == "batched":  # leading dims (batch, seq)
        return values.reshape(3, M // 3, K) if M % 3 == 0 else values.reshape(1, M, K)
    if case.layout == "strided":  # rows of a wider tensor, 16-byte aligned row stride
        wide = torch.zeros(M, K + 24, dtype=case.dtype, device=device)
        wide[:, 8 : 8 + K] = values
        return wide[:, 8 : 8 + K]
    if case.layout == "transposed":  # column stride != 1
        return values.t().contiguous().t()
    if case.layout == "misaligned":  # starts one element into its storage
        base = torch.zeros(M * K + 1, dtype=case.dtype, device=device)
        base[1:] = values.reshape(-1)
        return base[1:].view(M, K)
    if case.layout == "broadcast":  # every row the same storage (row stride 0)
        return values[:1].expand(M, K)
    raise ValueError(case.layout)


def make_weight(case: Case):
    """(W float32 [N, K] with an all-zero row run, packed bytes as `storage`, absmax)."""
    N, K = case.N, case.K
    W = torch.randn(N, K, generator=gen(case.seed + 2)) * 0.5
    if N * K >= 4 * case.blocksize:
        W.view(-1)[case.blocksize : 2 * case.blocksize] = 0  # an all-zero block
    nib, absmax = ref.quantize_4bit_nibbles(W, case.blocksize, case.quant_type)
    packed = torch.from_numpy(ref.pack_nibbles(nib))
    itemsize = torch.empty((), dtype=case.storage).element_size()
    pad = (-packed.numel()) % itemsize
    packed = torch.cat([packed, torch.zeros(pad, dtype=torch.uint8)]).view(case.storage).reshape(-1, 1)
    return packed, torch.from_numpy(absmax)


def gemm_args(case: Case, device="cpu"):
    """(A, positional gemm_4bit args, dequantized float32 weight, bias), A and the args on `device`
    (the weight and bias as CPU tensors for the reference)."""
    A = make_A(case, device)
    packed, absmax = make_weight(case)
    bias = torch.randn(case.N, generator=gen(case.seed + 3)).to(case.dtype) if case.bias else None
    if case.nested:
        q8, nested, offset = ref.double_quantize(absmax, CODE8)
        offset = offset.to(case.offset_dtype)
        nested_args = (q8, CODE8, offset)
        W = R.dequantized_weight(packed, (case.N, case.K), case.blocksize, case.quant_type, nested, *nested_args)
        args = [A, packed, [case.N, case.K], nested, case.blocksize, case.quant_type, bias, *nested_args]
    else:
        W = R.dequantized_weight(packed, (case.N, case.K), case.blocksize, case.quant_type, absmax)
        args = [A, packed, [case.N, case.K], absmax, case.blocksize, case.quant_type, bias, None, None, None]
    args = [a.to(device) if isinstance(a, torch.Tensor) and a is not A else a for a in args]
    return A, args, W, bias


def splitk_slices_per_tile(N: int, S: int) -> list[int]:
    """The split-K kernel's threadgroups for each tile of 16 S of N columns, as gemm_4bit_splitk.h says
    ("The last tile"): S, and for a last tile of g groups of 16 columns the least power of two not below g."""
    tiles = -(-N // (16 * S))
    groups = -(-(N - (tiles - 1) * 16 * S) // 16)
    last = next(s for s in (1, 2, 4, 8, 16) if s >= groups)
    return [S] * (tiles - 1) + [last]
