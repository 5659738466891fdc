"""Outputs a kernel never wrote: told apart from wrong values.

While a case's launches are encoded (`fresh_outputs()`), every tensor the op allocates with
torch.empty (and its kin) is filled with a sentinel, and the `.out` cases start from one
(`filled`). A GPU fault (a watchdog timeout, a page fault) that stops a command buffer leaves its
outputs unwritten; a comparison that fails where the result still holds the sentinel says so
(`unwritten`), instead of reporting the sentinel as a wrong value.

The sentinel is a byte pattern per element size, a large negative finite number in every float
dtype (float16 -62624, bfloat16 -1.7e36, float32 -3.3e38), so that it is never NaN (which the
comparisons take as equal to a NaN result) and is no value the cases expect.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

#: element size -> (the integer dtype of that size, the sentinel as its signed value)
PATTERNS = {1: (torch.int8, -0x5B), 2: (torch.int16, -0x045B), 4: (torch.int32, -0x0085A5A6),
            8: (torch.int64, -0x0015A5A5A5A5A5A6)}  # fmt: skip  (0xA5, 0xFBA5, 0xFF7A5A5A, 0xFFEA5A5A5A5A5A5A)

_aten = torch.ops.aten
_ALLOCATIONS = {_aten.empty.memory_format, _aten.empty_strided.default, _aten.empty_like.default,
                _aten.new_empty.default, _aten.new_empty_strided.default}  # fmt: skip


def _as_ints(t: torch.Tensor) -> Optional[torch.Tensor]:
    """t's elements as the integers of their bits (a view), or None for a dtype without a sentinel."""
    if t.dtype.is_complex or t.dtype == torch.bool or t.element_size() not in PATTERNS:
        return None
    return t.view(PATTERNS[t.element_size()][0])


def fill(t: torch.Tensor) -> torch.Tensor:
    """Fills `t` with the sentinel (in place) and returns it."""
    ints = _as_ints(t)
    if ints is not None and t.numel():
        ints.fill_(PATTERNS[t.element_size()][1])
    return t


def filled(shape, dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of the sentinel (the initial content of a `.out` case's output)."""
    return fill(torch.empty(shape, dtype=dtype))


class _FillFresh(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in _ALLOCATIONS and isinstance(out, torch.Tensor):
            fill(out)  # (inside the mode's handler the mode is off: this fill is not intercepted)
        return out


def fresh_outputs() -> TorchDispatchMode:
    """A context in which every tensor torch.empty (empty_like, empty_strided, new_empty) allocates
    starts as the sentinel. Dispatch modes are per thread: other threads are not affected."""
    return _FillFresh()


def unwritten(got: Any, want: Any, what: str = "result") -> Optional[str]:
    """Where `got` (tensors, or tuples of them) still holds the sentinel and `want` does not: how
    many elements of which output were never written, or None."""
    if isinstance(want, (tuple, list)) and isinstance(got, (tuple, list)):
        for i, (g, w) in enumerate(zip(got, want)):
            found = unwritten(g, w, f"{what}[{i}]")
            if found:
                return found
        return None
    if not (isinstance(got, torch.Tensor) and isinstance(want, torch.Tensor)) or got.dtype != want.dtype \
            or got.shape != want.shape or _as_ints(got) is None:  # fmt: skip
        return None
    sentinel = PATTERNS[got.element_size()][1]
    g, w = _as_ints(got.contiguous()).reshape(-1), _as_ints(want.contiguous()).reshape(-1)
    left = (g == sentinel) & (w != sentinel)
    if not bool(left.any()):
        return None
    return (f"{what}: {int(left.sum())} of {left.numel()} elements were never written (they still hold the "
            "sentinel verification filled the output with before the launches)")
