"""Argument checks shared by the op families.

Every failure names the op, the argument and what was expected. Wrong tensor dtypes raise
`DtypeError`, which is both a TypeError (the Python convention for a wrong kind of value) and a
ValueError (what bitsandbytes raises for dtypes), so callers catching either see it.

A check tells two things apart:
- arguments bitsandbytes rejects too (its op contract, the fake kernels of bitsandbytes/_ops.py, or
  every implementation it has): an error, raised here with a message that names the argument;
- arguments bitsandbytes accepts but bnb_mps' kernels do not cover (an 8-bit blocksize outside
  64..4096, a code of another dtype or length, a tensor beyond 32-bit indexing, ...): `NotCovered`,
  which is no error: the op layer serves that call with bitsandbytes' own implementation (or the
  CPU round trip), so installing bnb_mps never makes a call fail that stock bitsandbytes accepts.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Optional

import torch

FLOATS = (torch.float16, torch.bfloat16, torch.float32)
BLOCKSIZES_8BIT = (64, 128, 256, 512, 1024, 2048, 4096)
BLOCKSIZES_4BIT = (32, 64, 128, 256, 512, 1024, 2048, 4096)
QUANT_TYPES = ("nf4", "fp4")


class DtypeError(TypeError, ValueError):
    """A tensor argument has a dtype the op does not take."""


class NotCovered(Exception):
    """A call whose arguments bitsandbytes accepts but no bnb_mps kernel covers. Not an error: the
    op layer serves it by the next route. The message says what is not covered, without the op's
    name (the op layer adds it), e.g. "blocksize 16384 (the kernels take 64, 128, ..., 4096)"."""


def _names(dtypes: Iterable[torch.dtype]) -> str:
    names = [str(d).removeprefix("torch.") for d in dtypes]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]


def tensor(
    op: str,
    name: str,
    value,
    *,
    dtypes: Optional[Sequence[torch.dtype]] = None,
    ndim: Optional[int] = None,
    min_ndim: Optional[int] = None,
    optional: bool = False,
) -> None:
    if value is None:
        if optional:
            return
        raise TypeError(f"{op}: {name} must be a tensor, got None")
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a tensor, got {type(value).__name__}")
    if dtypes is not None and value.dtype not in dtypes:
        raise DtypeError(f"{op}: {name} must be a {_names(dtypes)} tensor, got {value.dtype}")
    if ndim is not None and value.dim() != ndim:
        raise ValueError(f"{op}: {name} must have {ndim} dimension(s), got shape {tuple(value.shape)}")
    if min_ndim is not None and value.dim() < min_ndim:
        raise ValueError(f"{op}: {name} must have at least {min_ndim} dimension(s), got shape {tuple(value.shape)}")


def same_device(op: str, **tensors) -> None:
    """All given tensors (None ignored) live on one device."""
    first_name, first = None, None
    for name, t in tensors.items():
        if t is None:
            continue
        if first is None:
            first_name, first = name, t
        elif t.device != first.device:
            raise ValueError(
                f"{op}: all tensors must be on one device, but {first_name} is on {first.device} "
                f"and {name} is on {t.device}"
            )


def dtype_arg(op: str, name: str, value, allowed: Sequence[torch.dtype] = FLOATS, optional: bool = False) -> None:
    if value is None and optional:
        return
    if not isinstance(value, torch.dtype):
        raise TypeError(f"{op}: {name} must be a torch.dtype, got {type(value).__name__}")
    if value not in allowed:
        raise DtypeError(f"{op}: {name} must be {_names(allowed)}, got {value}")


def integer(op: str, name: str, value, *, minimum: Optional[int] = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{op}: {name} must be an int, got {type(value).__name__}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{op}: {name} must be >= {minimum}, got {value}")


def number(op: str, name: str, value, *, minimum: Optional[float] = None) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{op}: {name} must be a number, got {type(value).__name__}")
    if minimum is not None and not value >= minimum:  # also rejects NaN
        raise ValueError(f"{op}: {name} must be >= {minimum}, got {value}")


def blocksize(op: str, value, allowed: Optional[Sequence[int]]) -> None:
    """`value` is one of `allowed`; None: any positive blocksize (bitsandbytes' 8-bit blockwise ops
    take any; `covered_blocksize` then says whether the kernels do)."""
    integer(op, "blocksize", value)
    if allowed is None:
        if value < 1:
            raise ValueError(f"{op}: blocksize must be a positive int, got {value}")
    elif value not in allowed:
        raise ValueError(f"{op}: blocksize must be one of {', '.join(map(str, allowed))}, got {value}")


def covered_blocksize(value: int, allowed: Sequence[int]) -> None:
    if value not in allowed:
        raise NotCovered(f"blocksize {value} (the kernels take {', '.join(map(str, allowed))})")


def covered_dtype(name: str, t: torch.Tensor, dtypes: Sequence[torch.dtype], accepted: Sequence[torch.dtype]) -> None:
    """A tensor whose dtype bitsandbytes accepts (`accepted`, checked already) but the kernels take
    only in `dtypes`: NotCovered otherwise."""
    if t.dtype not in dtypes and t.dtype in accepted:
        raise NotCovered(f"{name} of dtype {t.dtype} (the kernels take {_names(dtypes)})")


def quant_type(op: str, value) -> None:
    if value not in QUANT_TYPES:
        raise ValueError(f"{op}: quant_type must be 'nf4' or 'fp4', got {value!r}")


def numel(op: str, name: str, t: torch.Tensor, expected: int, *, at_least: bool = False) -> None:
    n = t.numel()
    if (n < expected) if at_least else (n != expected):
        need = f"at least {expected}" if at_least else f"{expected}"
        raise ValueError(f"{op}: {name} must have {need} elements, got {n} (shape {tuple(t.shape)})")


def shape(op: str, name: str, t: torch.Tensor, expected: Sequence[int]) -> None:
    if tuple(t.shape) != tuple(expected):
        raise ValueError(f"{op}: {name} must have shape {tuple(expected)}, got {tuple(t.shape)}")


def int_list(op: str, name: str, value) -> None:
    if not isinstance(value, (list, tuple, torch.Size)) or not all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    ):
        raise TypeError(f"{op}: {name} must be a list of ints, got {value!r}")
    if any(v < 0 for v in value):
        raise ValueError(f"{op}: {name} must not contain negative sizes, got {list(value)}")


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def blocks(n: int, size: int) -> int:
    return -(n // -size)
