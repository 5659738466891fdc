"""What a family is made of: cases (one call of an op with its comparison), and the inputs they share."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Optional

import torch


@dataclass
class Case:
    """One call of op `op` with `args` (CPU tensors, `Unaligned` tensors and plain values, schema order).

    `compare(got, want, got_args, want_args)` returns None or what is wrong; `got` is the kernel
    tier's result and `got_args` its arguments after the call (in-place outputs), both on the CPU;
    `want`/`want_args` are the CPU round trip's, or, where `expected` is given, `expected(want_args)`
    is `want`: the result docs/semantics.md defines where bitsandbytes' CPU code computes another."""

    label: str
    op: str
    args: tuple
    compare: Callable[[Any, Any, list, list], Optional[str]]
    expected: Optional[Callable[[list], Any]] = None
    route: Optional[str] = None  # a kernel path of the op other than the built-in one (bnb_mps.ops.candidates)


@dataclass(frozen=True)
class Family:
    name: str
    ops: tuple[str, ...]  # the ops that leave the kernel tier when the family fails
    cases: Callable[[], Iterator[Case]]
    #: ops whose calls a built-in path of the family serves while it passes, and another path when it
    #: fails (bnb_mps.ops.candidates.FALLBACK): they stay on the tier
    serves: tuple[str, ...] = ()
    #: the Metal language version from which the family's kernels are compiled ((major, minor); None:
    #: every version): on a tier below it the family has nothing to run, and no route takes its kernels
    language_version: Optional[tuple[int, int]] = None
    #: the compile unit (bnb_mps.msl.source.units()) of the family's kernels, where it is one: its text's
    #: digest is part of the family's verdict key (bnb_mps.ops.verify.first_use)
    unit: Optional[str] = None


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def signed_code() -> torch.Tensor:
    from bitsandbytes.functional import create_dynamic_map

    return create_dynamic_map(signed=True)


def unsigned_code() -> torch.Tensor:
    from bitsandbytes.functional import create_dynamic_map

    return create_dynamic_map(signed=False)


@dataclass(frozen=True)
class Unaligned:
    """A case argument that the kernel tier receives as a view at an awkward address: `offset`
    elements into its storage, rows `pad` elements apart beyond their length (a 2-D tensor), so
    that neither its start nor its row starts are 16-byte aligned. The CPU side gets `tensor`."""

    tensor: torch.Tensor
    offset: int = 1
    pad: int = 0

    def on(self, device: str) -> torch.Tensor:
        t = self.tensor
        rows, cols = (t.shape[0], t.shape[1]) if t.dim() == 2 else (1, t.numel())
        ld = cols + self.pad
        storage = torch.zeros(self.offset + rows * ld, dtype=t.dtype, device=device)
        view = storage[self.offset:].view(rows, ld)[:, :cols]
        view.copy_(t.reshape(rows, cols).to(device))
        return view if t.dim() == 2 else view.reshape(t.shape)
