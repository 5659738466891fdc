"""The routes that can serve a call of an op on a kernel tier, named, for tuning to choose from.

Route names (what `bnb_mps.tuning_table()` and the `tune` command show):

    gemv, batch, mma      the kernel paths of the 4-bit products (bnb_mps.ops.matmul_4bit)
    <path>/<variant>      a kernel variant of a path: gemv/tglut, the gemv kernel with its 16-entry
                          table in threadgroup memory instead of constant memory; splitk/two, the
                          split-K product in two dispatches (every Metal version; "splitk", one
                          dispatch, only where the tier compiles Metal >= 3.2)
    kernel                bnb-mps' kernel of an op that has one path
    torch._int_mm         int8_linear_matmul as torch._int_mm, where torch runs it on the device (mps:
                          torch >= 2.15)
    dequantize+linear     gemm_4bit as bnb-mps' dequantize kernels into a temporary weight, then
                          torch's linear (bnb_mps.ops.dequantize_linear)
    bitsandbytes          bitsandbytes' own implementation of the op for this dispatch key, called
                          for this shape only (bnb-mps stays registered for the others)

Tuned ops: gemm_4bit, gemv_4bit and gemv_4bit.out (their paths, variants, dequantize+linear for
gemm_4bit, bitsandbytes); the 4-bit and 8-bit blockwise quantize and dequantize ops and the 32-bit
optimizer (kernel, bitsandbytes); int8_linear_matmul (kernel, torch._int_mm). Every other op has its
kernel alone. A route other than the
built-in one is a candidate only where the kernel families it runs passed first-use verification
(`Candidate.families`; bnb_mps.ops.tuning asks bnb_mps.ops.verify). The built-in split-K paths
give way where their family did not pass (FALLBACK): the one-dispatch kernel to the two-dispatch one or
`small` (the cost model's choice without it), the two-dispatch one to `small`. Which paths a call has depends on the
Metal language version of the tier's kernels (bnb_mps.ops.plan.language_version_of), which the cache
key of tuning's choices holds (bnb_mps.ops.verify.cache_key).

The shape key says what a choice holds for: the op, the activations' dtype, N, K, blocksize,
quant_type, nested block scales or not, bias or not, and M (rows of A) rounded up to a power of two
(1, 2, 4, ..., 4096, then one bucket above); for the other ops, the dtypes and shapes of the
tensor arguments and the other arguments but the optimizers' per-call hyperparameters. Shapes are
metadata: nothing here reads tensor data. A route is measured on fresh inputs of the key's shape
(`Candidates.fresh`), never on the caller's tensors.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch

from ..executors import GPU_TIERS, shader
from . import verify
from .dequantize_linear import DequantizeLinear
from .plan import BoundPlan, language_version_of
from .registry import OpDef, argument_spec
from .served import IntMM, Stock, Unplanned

#: ops with more than one route; every other op has its kernel alone
TUNED = ("gemm_4bit", "gemv_4bit", "gemv_4bit.out", "quantize_4bit", "dequantize_4bit", "dequantize_4bit.out",
         "quantize_blockwise", "dequantize_blockwise", "dequantize_blockwise.out",
         "optimizer_update_32bit")  # fmt: skip
_MATMUL = ("gemm_4bit", "gemv_4bit", "gemv_4bit.out")

#: the kernel families (bnb_mps.ops.verify) each kernel path of the 4-bit products runs
PATH_FAMILIES = {"gemv": ("matmul_4bit_gemv",), "gemv/tglut": ("matmul_4bit_tglut",),
                 "batch": ("matmul_4bit_batch",), "small": ("matmul_4bit_small",),
                 "small/wide": ("matmul_4bit_small_wide",), "splitk": ("matmul_4bit_splitk",),
                 "splitk/two": ("matmul_4bit_splitk_two",), "mma": ("matmul_4bit_mma",)}  # fmt: skip

#: a built-in path whose kernel family is not one of its ops' gate (bnb_mps.ops.verify.families) -> the
#: path that serves its calls where that family did not pass first-use verification (and, where that
#: one did not either, its own fallback): the split-K kernels' threadgroups meet through device memory,
#: which only the user's GPU can show to hold. The one-dispatch split-K gives way to the built-in path of
#: a tier without its hand-over (`WITHOUT_HANDOVER`: the cost model's cheaper of the two-dispatch split-K
#: and the small kernel), the two-dispatch split-K to the small kernel.
WITHOUT_HANDOVER = "(the built-in path without the hand-over)"
FALLBACK = {"splitk": WITHOUT_HANDOVER, "splitk/two": "small"}

#: rows of A are rounded up to a power of two up to this; more rows make one bucket above it,
#: measured at this many rows (the routes are throughput-bound there and rank alike)
MAX_M_BUCKET = 4096


@dataclass(frozen=True)
class Candidate:
    """A route of one call: its name, what it runs, and how to build it for a call signature."""

    name: str
    #: the kernel families that must have passed first-use verification for it to be a candidate
    families: tuple[str, ...]
    #: build(args) -> what serves calls with the metadata of `args` (schema order) on this route
    build: Callable[[Sequence], Any]


@dataclass
class Candidates:
    """The routes of one call's shape key, the built-in one (`default`) first."""

    op: str
    key: str
    default: str
    routes: dict[str, Candidate]
    device: torch.device
    #: fresh(): new arguments of the key's shape on the call's device (schema order), to measure on
    fresh: Callable[[], list]


def m_bucket(M: int) -> int:
    """M rounded up to a power of two; MAX_M_BUCKET + 1 for more rows than MAX_M_BUCKET."""
    if M > MAX_M_BUCKET:
        return MAX_M_BUCKET + 1
    return 1 << max(M - 1, 0).bit_length()


def of(op: OpDef, args: Sequence, executor, tier: str, stock: Optional[Callable], verified: bool = True) -> Candidates:
    """The routes for a call of planned op `op` (arguments in schema order, checked) on `tier`,
    whose kernels run on `executor`; `stock` is bitsandbytes' own implementation, or None.
    `verified` (as for tuning.choose): a built-in path of FALLBACK whose family did not pass first-use
    verification on `tier` gives way to its fallback, which becomes the built-in route."""
    planned = op.planned
    version = language_version_of(executor) if planned is not None and planned.versioned else None
    paths = planned.path_names(args, version) if planned is not None else ("kernel",)
    builtin = serving = paths[0]  # (what the planner plans without a route)
    while verified and serving in FALLBACK and verify.unverified(PATH_FAMILIES[serving], tier, executor):
        serving = FALLBACK[serving] if FALLBACK[serving] != WITHOUT_HANDOVER else planned.path_names(args, None)[0]
    if serving != builtin:
        paths = (serving, *(p for p in paths if p != serving))
    counted = (op.name, tier)

    def kernel(path: str) -> Candidate:
        route = None if path == builtin else path

        def build(a: Sequence):
            if planned is None:  # (an op without a planner: its kernel function)
                return Unplanned(op.name, op.kernel, executor, tier)
            return BoundPlan(planned.plan(a, route, version), executor, counted, planned.dynamic)

        return Candidate(path, PATH_FAMILIES.get(path, ()), build)

    device = _device(args)
    routes = {path: kernel(path) for path in paths[: 1 if op.name not in TUNED else None]}
    if op.name in _MATMUL:
        key, fresh = _matmul_key(op.name, args), lambda: _matmul_fresh(op.name, args)
        A, (N, K) = args[0], args[2]
        worth = math.prod(A.shape[:-1]) * N * K > 0  # (an empty product has its built-in route alone)
        if op.name == "gemm_4bit" and worth:
            families = ("nf4_fp4", "blockwise_8bit") if args[7] is not None else ("nf4_fp4",)
            routes["dequantize+linear"] = Candidate("dequantize+linear", families,
                                                    lambda a: DequantizeLinear(a, executor, tier))
    else:
        key, fresh = _generic_key(op, args), lambda: _generic_fresh(op.name, args)
        worth = op.name in TUNED and _size(args) > 0
    if worth and stock is not None and _stock_computes_the_spec(op.name, args, device):
        routes["bitsandbytes"] = Candidate("bitsandbytes", (), lambda a: Stock(op.name, stock))
    if op.name == "int8_linear_matmul" and _size(args) > 0 and int_mm_runs(tier):
        routes["torch._int_mm"] = Candidate("torch._int_mm", (), lambda a: IntMM(op.name, tier))
    return Candidates(op.name, key, paths[0], routes, device, fresh)


def has_other_routes(op: OpDef, tier: str) -> bool:
    """Whether an op without a planner has routes besides its kernel on `tier` (torch._int_mm)."""
    return op.name == "int8_linear_matmul" and int_mm_runs(tier)


#: the first torch whose torch._int_mm runs on mps (read in its release's binaries)
INT_MM_ON_MPS = (2, 15)


def int_mm_runs(tier: str) -> bool:
    """Whether torch._int_mm (int8 x int8 -> int32, exact) runs where `tier`'s tensors live: on mps from
    torch 2.15; on the CPU (the emulated tier) wherever torch has it."""
    if not hasattr(torch, "_int_mm"):
        return False
    if tier not in GPU_TIERS:
        return True
    return shader.torch_version() >= INT_MM_ON_MPS


def _stock_computes_the_spec(name: str, args: Sequence, device: torch.device) -> bool:
    """Whether bitsandbytes' own implementation computes docs/semantics.md for this call, so that it
    may be a route. On a GPU it does. On CPU tensors (the emulated tier of tests and debugging) its
    CPU kernels of gemv_4bit and dequantize_4bit depend on the instruction set (on CPUs with
    AVX512-BF16 its gemv reads another weight layout; on CPUs with AVX-512F its dequantize misplaces
    blocks that straddle rows, see bnb_mps.ops.cpu_round_trip), and its gemm_4bit dequantizes through
    the latter: there it is a route only where no block straddles a row (K % blocksize == 0)."""
    if device.type != "cpu":
        return True
    if name in ("gemv_4bit", "gemv_4bit.out", "dequantize_4bit", "dequantize_4bit.out"):
        return False
    return name != "gemm_4bit" or args[2][1] % args[4] == 0


def _device(args: Sequence) -> torch.device:
    for a in args:
        if isinstance(a, torch.Tensor):
            return a.device
    return torch.device("cpu")


def _size(args: Sequence) -> int:
    return sum(a.numel() for a in args if isinstance(a, torch.Tensor))


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# -- the 4-bit products -------------------------------------------------------------------------------------


def _matmul_key(name: str, args: Sequence) -> str:
    A, shapeB, blocksize = args[0], args[2], args[5] if name != "gemm_4bit" else args[4]
    M = math.prod(A.shape[:-1])
    bucket = m_bucket(M)
    rows = f"M>{MAX_M_BUCKET}" if bucket > MAX_M_BUCKET else f"M<={bucket}"
    if name == "gemm_4bit":
        table = f"{args[5]}{' nested' if args[7] is not None else ''}{' bias' if args[6] is not None else ''}"
    else:
        table = "code"  # (the 16-entry table is data: the kernels read it whichever it is)
    return f"{name} {_dtype(A.dtype)} {rows} N={shapeB[0]} K={shapeB[1]} blocksize={blocksize} {table}"


def _matmul_fresh(name: str, args: Sequence) -> list:
    """New arguments for the key of a call of `name`: A of the bucket's rows (MAX_M_BUCKET above it),
    a random packed weight, block scales and tables of the call's kinds; `out` for gemv_4bit.out."""
    A, B, shapeB = args[0], args[1], args[2]
    N, K = shapeB
    device = A.device
    M = min(m_bucket(math.prod(A.shape[:-1])), MAX_M_BUCKET)
    rng = _Random(device)
    fresh_A = rng.normal((M, K)).to(A.dtype)
    fresh_B = rng.bytes(B.numel() * B.element_size()).view(B.dtype).reshape(B.shape)
    blocksize = args[4] if name == "gemm_4bit" else args[5]
    nblocks = math.ceil(N * K / blocksize)
    if name != "gemm_4bit":
        code = torch.linspace(-1, 1, 16, device=device)
        out = [torch.empty(M, N, dtype=A.dtype, device=device)] if name == "gemv_4bit.out" else []
        return [fresh_A, fresh_B, list(shapeB), rng.scales(nblocks), code, blocksize, *out]
    quant_type, bias, absmax_8bit, absmax_code, offset = args[5], args[6], args[7], args[8], args[9]
    fresh_bias = None if bias is None else rng.normal((N,)).to(bias.dtype)
    if absmax_8bit is None:
        return [fresh_A, fresh_B, list(shapeB), rng.scales(nblocks), blocksize, quant_type, fresh_bias,
                None, None, None]  # fmt: skip
    return [fresh_A, fresh_B, list(shapeB), rng.scales(math.ceil(nblocks / 256)), blocksize, quant_type,
            fresh_bias, rng.bytes(nblocks), torch.linspace(-1, 1, 256, device=device),
            torch.full(tuple(offset.shape), 0.5, dtype=offset.dtype, device=device)]  # fmt: skip


class _Random:
    """Random inputs on `device` from a generator of their own (seeded), so that measuring leaves the
    caller's random number streams as they were: a first call of a shape must not change the results
    of later calls (dropout, sampling) either. Drawn on the CPU and copied where the device has no
    generator of its own."""

    def __init__(self, device) -> None:
        self.device = torch.device(device)
        try:
            self.gen, self.on = torch.Generator(device=self.device).manual_seed(0), self.device
        except RuntimeError:
            self.gen, self.on = torch.Generator().manual_seed(0), torch.device("cpu")

    def normal(self, shape) -> torch.Tensor:
        return torch.randn(shape, generator=self.gen, device=self.on).to(self.device)

    def bytes(self, n: int) -> torch.Tensor:
        return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=self.gen, device=self.on).to(self.device)

    def scales(self, n: int) -> torch.Tensor:
        """Positive block scales."""
        return (torch.rand(n, generator=self.gen, device=self.on) + 0.5).to(self.device)


# -- the other tuned ops: quantize / dequantize, the 32-bit optimizer -----------------------------------------

# Tensor arguments that hold tables (sorted, in [-1, 1]), block scales (positive), or optimizer states
# and norms (zero at the start), by schema name.
_TABLES = ("code", "qmap1", "qmap2", "absmax_code")
_SCALES = ("absmax", "absmax1", "absmax2")
_STATES = ("state1", "state2", "unorm_vec")


def _generic_key(op: OpDef, args: Sequence) -> str:
    skip = op.planned.dynamic_positions if op.planned is not None else 0
    parts = [op.name]
    for i, ((name, _), a) in enumerate(zip(argument_spec(op.name), args)):
        if (skip >> i) & 1:
            continue
        if isinstance(a, torch.Tensor):
            parts.append(f"{name}={_dtype(a.dtype)}{list(a.shape)}")
        elif a is not None:
            parts.append(f"{name}={_dtype(a) if isinstance(a, torch.dtype) else a}")
    return " ".join(parts)


def _generic_fresh(name: str, args: Sequence) -> list:
    """A new tensor of the same dtype, shape and device for each tensor argument (contiguous), with
    values of its kind; the other arguments as they are."""
    out = []
    rng = _Random(_device(args))
    for (arg, _), a in zip(argument_spec(name), args):
        if not isinstance(a, torch.Tensor):
            out.append(a)
            continue
        if arg in _STATES:
            t = torch.zeros(a.shape, dtype=a.dtype, device=a.device)
        elif not a.dtype.is_floating_point:
            t = rng.bytes(a.numel() * a.element_size()).view(a.dtype).reshape(a.shape)
        elif arg in _TABLES:
            t = torch.linspace(-1, 1, a.numel(), device=a.device).to(a.dtype).reshape(a.shape)
        elif arg in _SCALES:
            t = rng.scales(a.numel()).to(a.dtype).reshape(a.shape)
        else:
            t = rng.normal(a.shape).to(a.dtype)
        out.append(t)
    return out
