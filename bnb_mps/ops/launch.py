"""What every family's kernel launchers share: kernel names per dtype, the 32-bit index limit,
and how tensors are bound (flat, contiguous, 16-byte aligned for vector accesses).

Nothing here reads tensor data on the host.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# Kernel index arithmetic is 32-bit and a block start plus one block must not wrap around.
MAX_ELEMENTS = 2**32 - 8192

#: dtype -> the <dt> part of a kernel's host name
DTYPE_NAMES = {torch.float16: "f16", torch.bfloat16: "bf16", torch.float32: "f32"}

# Kernels access tensors with vector loads and stores, which need their natural alignment (up to
# 16 bytes). Storages start aligned; a view may not.
VECTOR_ALIGN = 16


def check_size(op: str, name: str, n: int) -> None:
    """Raise before anything is allocated when `n` elements exceed the kernels' 32-bit indexing."""
    if n >= MAX_ELEMENTS:
        raise ValueError(f"{op}: {name} has {n} elements; the Metal kernels take fewer than {MAX_ELEMENTS}")


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
    temporary of out's size that is then copied into `out` (for `.out` overloads given views)."""
    if out.is_contiguous() and is_aligned(out):
        fill(out)
    else:
        tmp = torch.empty(out.shape, dtype=out.dtype, device=out.device)
        fill(tmp)
        out.copy_(tmp)
