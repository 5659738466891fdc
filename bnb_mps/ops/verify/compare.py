"""Comparisons of a kernel tier's results with their references: bit for bit, or within a tolerance.

Each returns None, or what is wrong and by how much (the verdict's `error`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

import torch


def _bits(t: torch.Tensor) -> torch.Tensor:
    if not t.is_floating_point():
        return t
    nan = torch.isnan(t)
    as_int = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.masked_fill(nan, 0).view(as_int).masked_fill(nan, 1)


def exact(got: Any, want: Any, what: str = "result") -> Optional[str]:
    """None when `got` equals `want` bit for bit (NaN equal to any NaN; tuples element-wise), else why not."""
    if isinstance(want, (tuple, list)):
        for i, (g, w) in enumerate(zip(got, want)):
            err = exact(g, w, f"{what}[{i}]")
            if err:
                return err
        return None
    if want is None or got is None:
        return None if got is want else f"{what}: {type(got).__name__} where {type(want).__name__} was expected"
    if got.dtype != want.dtype or tuple(got.shape) != tuple(want.shape):
        return f"{what}: {got.dtype} {tuple(got.shape)} where {want.dtype} {tuple(want.shape)} was expected"
    g, w = _bits(got.reshape(-1)), _bits(want.reshape(-1))
    bad = g != w
    if bad.any():
        i = int(bad.nonzero()[0])
        return (f"{what}: {int(bad.sum())} of {bad.numel()} elements differ, e.g. element {i}: "
                f"{got.reshape(-1)[i].item()!r} where the CPU gives {want.reshape(-1)[i].item()!r}")
    return None


def close(got: torch.Tensor, want: torch.Tensor, allowed: torch.Tensor | float, what: str = "result") -> Optional[str]:
    """None when every element of `got` is within `allowed` of `want`'s, else the worst element.

    NaN and infinities are matched, never measured: where `want` is NaN, `got` must be NaN (any
    payload); where `want` is +inf or -inf, `got` must be the same infinity; where `want` is finite,
    |got - want| <= allowed, so a NaN or infinite `got` fails there. A NaN tolerance allows nothing."""
    if got.dtype != want.dtype or tuple(got.shape) != tuple(want.shape):
        return f"{what}: {got.dtype} {tuple(got.shape)} where {want.dtype} {tuple(want.shape)} was expected"
    g, w = got.double().reshape(-1), want.double().reshape(-1)
    allowed = torch.as_tensor(allowed, dtype=torch.float64).expand_as(want).reshape(-1)
    err = (g - w).abs()
    nan, inf = torch.isnan(w), torch.isinf(w)
    within = err <= allowed  # (False where err or allowed is NaN, or got is infinite and want finite)
    bad = torch.where(nan, ~torch.isnan(g), torch.where(inf, g != w, ~within))
    if bad.any():
        excess = torch.where(bad, err / allowed.clamp_min(1e-300), torch.zeros_like(err)).nan_to_num(nan=1e300, posinf=1e300)
        i = int(excess.argmax())
        return (f"{what}: {int(bad.sum())} of {bad.numel()} elements beyond the tolerance; worst, element {i}: "
                f"{g[i].item()!r} where the CPU gives {w[i].item()!r} (off by {err[i].item():.3g}, "
                f"tolerance {allowed[i].item():.3g})")
    return None


def eps(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).eps)


def same(got, want, got_args, want_args) -> Optional[str]:
    return exact(got, want)


def same_arg(index: int) -> Callable:
    def compare(got, want, got_args, want_args):
        return exact(got_args[index], want_args[index], f"argument {index} after the call")

    return compare


def arg_as_expected(index: int) -> Callable:
    """Compares argument `index` after the call with the expected result."""

    def compare(got, want, got_args, want_args):
        return exact(got_args[index], want, f"argument {index} after the call")

    return compare
