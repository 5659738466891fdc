"""What every family's kernel launchers share: kernel names per dtype, the 32-bit index limit,
and how tensors are bound (flat, contiguous, 16-byte aligned for vector accesses).

Nothing here reads tensor data on the host.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .validation import NotCovered

# Kernel index arithmetic is 32-bit and a block start plus one block must not wrap around.
MAX_ELEMENTS = 2**32 - 8192

#: dtype -> the <dt> part of a kernel's host name
DTYPE_NAMES = {torch.float16: "f16", torch.bfloat16: "bf16", torch.float32: "f32"}

# Kernels access tensors with vector loads and stores, which need their natural alignment (up to
# 16 bytes). Storages start aligned; a view may not.
VECTOR_ALIGN = 16


def check_size(op: str, name: str, n: int) -> None:
    """NotCovered, before anything is allocated or launched, when `n` elements exceed the kernels'
    32-bit indexing (bitsandbytes takes such tensors: the op layer serves the call by the next route)."""
    if n >= MAX_ELEMENTS:
        raise NotCovered(f"{name} of {n} elements (the kernels take fewer than {MAX_ELEMENTS})")


def flat(t: torch.Tensor) -> torch.Tensor:
    """`t` as a flat contiguous tensor (a view when it already is contiguous)."""
    return t.contiguous().reshape(-1)


def is_aligned(t: torch.Tensor) -> bool:
    return (t.storage_offset() * t.element_size()) % VECTOR_ALIGN == 0


def aligned(t: torch.Tensor) -> torch.Tensor:
    """`t` flat and contiguous at a 16-byte aligned offset (copied only when it is not)."""
    t = flat(t)
    return t if is_aligned(t) else t.clone()


def into(out: torch.Tensor, fill: Callable[[torch.Tensor], None]) -> None:
    """Runs `fill(target)` with a contiguous, aligned target: `out` itself when it is one, else a
    temporary of out's size that is then copied into `out` (for `.out` overloads given views; the
    planned ops do the same with `out_arg`)."""
    if out.is_contiguous() and is_aligned(out):
        fill(out)
    else:
        tmp = _temporary(out)
        fill(tmp)
        out.copy_(tmp)


def _temporary(out: torch.Tensor) -> torch.Tensor:
    return torch.empty(out.shape, dtype=out.dtype, device=out.device)


def _contiguous(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous()


# -- binding a call's tensors in a plan (bnb_mps.ops.plan.PlanBuilder) -------------------------------
#
# Every executor binds a tensor at its storage offset and reads the bytes the kernel indexes, so a
# contiguous argument is bound as it is (no flat view: a view costs as much as a small kernel launch on
# the host). Others get a per-call replacement the plan makes.


def flat_arg(b, i: int, t: torch.Tensor):
    """Argument `i` read element by element: itself when contiguous, else a contiguous copy."""
    return b.arg(i) if t.is_contiguous() else b.arg(i, flat)


def aligned_arg(b, i: int, t: torch.Tensor):
    """Argument `i` read with vector loads: itself when contiguous at a 16-byte aligned offset, else
    an aligned contiguous copy."""
    return b.arg(i) if t.is_contiguous() and is_aligned(t) else b.arg(i, aligned)


def out_arg(b, i: int, out: torch.Tensor, *, any_alignment: bool = False):
    """An `out=` argument `i` the kernels write: itself when contiguous (and 16-byte aligned unless
    `any_alignment`), else a contiguous temporary copied into `out` after the launches."""
    if out.is_contiguous() and (any_alignment or is_aligned(out)):
        return b.arg(i)
    return b.arg(i, _temporary, write_back=True)


def inplace_arg(b, i: int, t: torch.Tensor):
    """A tensor argument `i` the kernels update in place: itself when contiguous, else a contiguous
    copy written back after the launches."""
    return b.arg(i) if t.is_contiguous() else b.arg(i, _contiguous, write_back=True)
