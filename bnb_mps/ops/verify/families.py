"""Every kernel family, its ops and its cases: the table verification runs."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import replace

from .cases import Case, Family
from .cases_int8 import int8_product_cases, int8_quant_cases
from .cases_matmul import matmul_cases, repeated_cases
from .cases_optim import optimizer_32bit_cases, optimizer_8bit_cases, optimizer_8bit_non_finite_cases
from .cases_quant import blockwise_8bit_cases, fourbit_cases
from .cases_special import special_4bit_cases, special_8bit_cases

_MATMUL_OPS = ("gemm_4bit", "gemv_4bit", "gemv_4bit.out")


def _routed(cases: Iterator[Case], route: str) -> Iterator[Case]:
    for case in cases:
        yield replace(case, label=f"{case.label} ({route})", route=route)


#: Every kernel family, in the order they are verified.
FAMILIES: dict[str, Family] = {f.name: f for f in [
    Family("blockwise_8bit", ("quantize_blockwise", "dequantize_blockwise", "dequantize_blockwise.out"),
           lambda: itertools.chain(blockwise_8bit_cases(), special_8bit_cases())),
    Family("nf4_fp4", ("quantize_4bit", "dequantize_4bit", "dequantize_4bit.out"),
           lambda: itertools.chain(fourbit_cases(), special_4bit_cases())),
    # The five kernel paths of the 4-bit products (bnb_mps.ops.matmul_4bit.choose_path): M = 1 with
    # K % 32 == 0; 2 <= M <= 32 with K % 16 == 0 (split-K from K = 512, small below); M = 1 with
    # K % 32 == 16 (batch, verified on
    # several rows of A, as tuning may route them there); larger M, or K % 16 != 0. A failing path takes
    # all three ops (split-K: below). K spans more than one step of every lane in the gemv (1024 per
    # step), batch (512) and small (128; 400 = 3 x 128 + 16, a last step of 2 active lanes) kernels; N leaves a partial group
    # of 8 / 16 weight rows there, a partial tile of 64 in mma; M = 12 in small: the 8 lanes of a row store
    # rows q and q + 8. Split-K: K = 1040 = 4 x 256 + 16 cuts into slices of 512, 512, 16 and none
    # (S = 4), N = 40 leaves a partial tile of 64 columns, and the last threadgroup of each tile adds
    # the tile's partial sums; K = 1984 = 7 x 256 + 192 cuts each row where its own lines begin (rows
    # 4 phases apart, a group of the tile per phase), the last slice longer than the others, and N = 72
    # leaves a last tile of 8 columns, which one threadgroup takes over all of K; then four calls of one
    # shape of 9 tiles of 4 slices, with A and -A in turn, so that a partial sum of the call before, read
    # where a hand-over between threadgroups did not hold, shows.
    Family("matmul_4bit_gemv", _MATMUL_OPS, lambda: matmul_cases(1, 20, 1280, seed=900)),
    Family("matmul_4bit_small", _MATMUL_OPS, lambda: matmul_cases(12, 20, 400, seed=940)),
    Family("matmul_4bit_batch", _MATMUL_OPS, lambda: _routed(matmul_cases(5, 20, 560, seed=910), "batch")),
    Family("matmul_4bit_mma", _MATMUL_OPS, lambda: matmul_cases(37, 40, 200, seed=920)),
    # A kernel variant of a path (its 16-entry table in threadgroup memory): no op leaves the tier when
    # it fails, only the variant is then no candidate for tuning (bnb_mps.ops.tuning).
    Family("matmul_4bit_tglut", (), lambda: _routed(matmul_cases(1, 20, 1280, seed=930), "gemv/tglut")),
    Family("matmul_4bit_small_wide", (), lambda: _routed(matmul_cases(12, 12, 400, seed=950), "small/wide")),
    # Built-in paths with a fallback: when one fails, no op leaves the tier; another path serves its calls
    # instead (bnb_mps.ops.candidates.FALLBACK: one dispatch gives way to two or to the small kernel, two
    # to the small kernel). Their threadgroups meet through device memory
    # (gemm_4bit_splitk.h), what only the user's GPU can show to hold: in one dispatch (Metal >= 3.2
    # only), or in two.
    Family("matmul_4bit_splitk", (), lambda: _routed(_splitk_cases(), "splitk"), serves=_MATMUL_OPS,
           language_version=(3, 2), unit="gemm_4bit_splitk"),
    Family("matmul_4bit_splitk_two", (), lambda: _routed(_splitk_cases(), "splitk/two"), serves=_MATMUL_OPS,
           unit="gemm_4bit_splitk"),
    Family("int8_quant", ("int8_vectorwise_quant", "int8_double_quant", "int8_vectorwise_dequant", "int8_mm_dequant"),
           int8_quant_cases),
    Family("int8_products", ("int8_linear_matmul", "int8_linear_matmul.out", "int8_scaled_mm", "int8_mixed_scaled_mm"),
           int8_product_cases),
    Family("optimizer_8bit", ("optimizer_update_8bit_blockwise",),
           lambda: itertools.chain(optimizer_8bit_cases(), optimizer_8bit_non_finite_cases())),
    Family("optimizer_32bit", ("optimizer_update_32bit",), optimizer_32bit_cases),
]}  # fmt: skip

def _splitk_cases() -> Iterator[Case]:
    return itertools.chain(matmul_cases(12, 40, 1040, seed=960, gemv=False), matmul_cases(5, 72, 1984, seed=961, gemv=False),
                           repeated_cases(2, 520, 1024, seed=962))  # fmt: skip


_FAMILY_OF_OP: dict[str, list[str]] = {}
for _f in FAMILIES.values():
    for _op in _f.ops:
        _FAMILY_OF_OP.setdefault(_op, []).append(_f.name)


def families_of(op: str) -> list[str]:
    """The families whose verification decides whether `op` may run on a kernel tier."""
    return list(_FAMILY_OF_OP.get(op, ()))


def families_behind(op: str, executor=None) -> list[str]:
    """The families whose kernels serve `op`'s calls with tuning off: `families_of(op)` and those of
    built-in paths with a fallback (`Family.serves`), in verification order; with `executor`, only those
    whose kernels exist at the Metal language version of its kernels (`Family.language_version`)."""
    from ..plan import language_version_of

    version = language_version_of(executor) if executor is not None else None

    def exists(f: Family) -> bool:
        return executor is None or f.language_version is None or (version is not None and version >= f.language_version)

    return [f.name for f in FAMILIES.values() if (op in f.ops or op in f.serves) and exists(f)]
