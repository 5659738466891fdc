"""Inputs and comparisons shared by the optimizer kernel tests (emulator and Apple hardware).

`args_8bit` / `args_32bit` build one call of bitsandbytes' optimizer update op (positional
arguments in schema order, CPU tensors) from a seed; `compare_8bit` / `compare_32bit` check what
the op did against tests/reference_optim.py with docs/semantics.md 5.3's one-step rules and return the
measured deviations.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field

import numpy as np
import torch
from bitsandbytes.functional import create_dynamic_map

import reference_optim as R

CODE = create_dynamic_map(signed=True)
UCODE = create_dynamic_map(signed=False)
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
NAMES_8BIT = ("adam", "ademamix", "momentum", "rmsprop", "adagrad", "lion")
NAMES_32BIT = ("adam", "lamb", "ademamix", "momentum", "lars", "rmsprop", "adagrad", "lion")
TWO_STATE = ("adam", "lamb", "ademamix")


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def quantized(values: torch.Tensor, code: torch.Tensor):
    """Codes and absmax of `values` (flat, blocks of 256), as stored state."""
    q, a = torch.ops.bitsandbytes.quantize_blockwise(values.reshape(-1).float().contiguous(), code, 256)
    return q.reshape(values.shape), a


def args_8bit(name, n, dtype, *, seed=0, step=3, weight_decay=0.01, gnorm_scale=0.7, skip_zeros=False,
              lr=1e-3, g=None, p=None, state_scale=0.01) -> list:  # fmt: skip
    """A call of optimizer_update_8bit_blockwise on random state (codes of random values)."""
    r = gen(seed)
    p = (torch.randn(n, generator=r) * 0.1).to(dtype) if p is None else p
    g = (torch.randn(n, generator=r) * 0.01).to(dtype) if g is None else g
    mix = name == "ademamix"
    m = torch.randn(2 if mix else 1, n, generator=r) * state_scale
    if name in ("rmsprop", "adagrad"):
        m = m.square() * 10
    q1, a1 = zip(*(quantized(m[c], CODE) for c in range(m.shape[0])))
    state1 = torch.stack(q1) if mix else q1[0]
    absmax1 = torch.stack(a1) if mix else a1[0]
    if name in TWO_STATE:
        state2, absmax2 = quantized(torch.randn(n, generator=r).square() * state_scale**2, UCODE)
        qmap2 = UCODE.clone()
    else:
        state2 = absmax2 = qmap2 = None
    return [name, g, p, state1, state2, 0.9, 0.995, 0.999, 5.0, 1e-8, step, lr, CODE.clone(), qmap2, absmax1,
            absmax2, weight_decay, gnorm_scale, skip_zeros]  # fmt: skip


def args_32bit(name, n, dtype, *, seed=0, step=3, weight_decay=0.01, gnorm_scale=0.7, skip_zeros=False,
               max_unorm=0.0, lr=1e-3, g=None, p=None) -> list:  # fmt: skip
    r = gen(seed)
    p = (torch.randn(n, generator=r) * 0.1).to(dtype) if p is None else p
    g = (torch.randn(n, generator=r) * 0.01).to(dtype) if g is None else g
    mix = name == "ademamix"
    s1 = torch.randn(*((2, n) if mix else (n,)), generator=r) * 0.01
    if name in ("rmsprop", "adagrad"):
        s1 = s1.square() * 10
    s2 = torch.randn(n, generator=r).square() * 1e-4 if name in TWO_STATE else None
    unorm = torch.zeros(1) if max_unorm > 0 else None
    param_norm = float(p.float().norm()) if max_unorm > 0 else 0.0
    return [name, g, p, s1, s2, unorm, max_unorm, param_norm, 0.9, 0.995, 0.999, 5.0, 1e-8, weight_decay, step, lr,
            gnorm_scale, skip_zeros]  # fmt: skip


def clone(args: list) -> list:
    return copy.deepcopy(args)


def to_device(args: list, device) -> list:
    return [a.to(device) if isinstance(a, torch.Tensor) else a for a in args]


# -- comparisons -----------------------------------------------------------------------------------

_INT = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per element: how many representable values of the dtype lie between a and b (0 for equal
    values, for +0/-0 and for two NaNs; a huge number for NaN against a number)."""
    assert a.dtype == b.dtype and a.shape == b.shape
    it = _INT[a.dtype]
    lo = torch.iinfo(it).min

    def key(x):
        i = x.contiguous().view(it).to(torch.int64)
        return torch.where(i < 0, lo - i, i)

    d = (key(a) - key(b)).abs()
    nan_a, nan_b = torch.isnan(a), torch.isnan(b)
    d = torch.where(nan_a & nan_b, torch.zeros_like(d), d)
    return torch.where(nan_a ^ nan_b, torch.full_like(d, 1 << 40), d).reshape(-1)


_MANTISSA = {torch.float32: 23, torch.float16: 10, torch.bfloat16: 7}


def ulps_of_operands(got: torch.Tensor, want: torch.Tensor, before: torch.Tensor) -> torch.Tensor:
    """|got - want| in ulps (of the dtype) of max(|before|, |want|): p_new = p_old - update, so an
    error in the update of a few float32 roundings shows as a few ulps of the operands even where
    the update nearly cancels p_old and the result is tiny. NaN against NaN is 0, NaN against a
    number infinite."""
    g, w, b = (x.detach().cpu().reshape(-1).double() for x in (got, want, before))
    mag = torch.maximum(b.abs(), w.abs())
    finfo = torch.finfo(got.dtype)
    _, e = torch.frexp(torch.where(mag > 0, mag, torch.ones_like(mag)))
    ulp = torch.maximum(torch.ldexp(torch.ones_like(mag), e - 1 - _MANTISSA[got.dtype]),
                        torch.full_like(mag, finfo.smallest_normal * finfo.eps))  # fmt: skip
    d = (g - w).abs() / ulp
    both_nan = torch.isnan(g) & torch.isnan(w)
    d = torch.where(both_nan, torch.zeros_like(d), d)
    return torch.where(torch.isnan(d) | (g == w), torch.where(both_nan | (g == w), 0.0, float("inf")), d)


@dataclass
class Deviation:
    """What one call deviated from the reference: max ulps of p (and states for 32-bit), codes
    that differ (all of them near a threshold), max ulps of absmax."""

    p_ulps: int = 0
    state_ulps: int = 0
    codes_differing: int = 0
    codes_near_threshold: int = 0
    absmax_ulps: int = 0
    unorm_rel: float = 0.0
    notes: list = field(default_factory=list)

    @property
    def exact(self) -> bool:
        return not (self.p_ulps or self.state_ulps or self.codes_differing or self.absmax_ulps)


def _codes(got: torch.Tensor, want: torch.Tensor, scaled: np.ndarray, qmap: torch.Tensor, what: str, dev: Deviation):
    got, want = got.reshape(-1).cpu(), want.reshape(-1)
    diff = (got != want).numpy()
    near = R.near_threshold(scaled, qmap.cpu())
    bad = np.flatnonzero(diff & ~near)
    assert bad.size == 0, f"{what}: {bad.size} codes differ away from thresholds, at {bad[:10].tolist()}"
    dev.codes_differing += int(diff.sum())
    dev.codes_near_threshold += int(near.sum())


def _p_ulps(p: torch.Tensor, want: torch.Tensor, p_before) -> int:
    if p_before is None:
        return int(ulp_distance(p.cpu(), want).max())
    return int(math.ceil(float(ulps_of_operands(p, want, p_before).max())))


def compare_8bit(got_args: list, ref: R.Result8, max_p_ulps: int = 2, p_before=None) -> Deviation:
    """docs/semantics.md 5.3 one-step rules: p within 2 ulp, codes equal except near a threshold, absmax within
    1 ulp. With `p_before` (the parameter before the step), p's ulps are those of the operands
    (see ulps_of_operands), else of the result."""
    name, _, p, state1, state2 = got_args[:5]
    absmax1, absmax2, qmap1, qmap2 = got_args[14], got_args[15], got_args[12], got_args[13]
    dev = Deviation()
    dev.p_ulps = _p_ulps(p, ref.p, p_before)
    assert dev.p_ulps <= max_p_ulps, f"p: {dev.p_ulps} ulps from the reference"
    _codes(state1, ref.state1, ref.scaled1, qmap1, "state1", dev)
    d = ulp_distance(absmax1.cpu(), ref.absmax1)
    if state2 is not None:
        _codes(state2, ref.state2, ref.scaled2, qmap2, "state2", dev)
        d = torch.cat([d, ulp_distance(absmax2.cpu(), ref.absmax2)])
    dev.absmax_ulps = int(d.max()) if d.numel() else 0
    assert dev.absmax_ulps <= 1, f"absmax: {dev.absmax_ulps} ulps from the reference"
    return dev


def compare_32bit(got_args: list, ref: R.Result32, max_p_ulps: int = 2, max_state_ulps: int = 2,
                  p_before=None) -> Deviation:  # fmt: skip
    name, _, p, state1, state2, unorm = got_args[:6]
    dev = Deviation()
    dev.p_ulps = _p_ulps(p, ref.p, p_before)
    assert dev.p_ulps <= max_p_ulps, f"p: {dev.p_ulps} ulps from the reference"
    d = ulp_distance(state1.cpu(), ref.state1)
    if state2 is not None:
        d = torch.cat([d, ulp_distance(state2.cpu(), ref.state2)])
    dev.state_ulps = int(d.max())
    assert dev.state_ulps <= max_state_ulps, f"states: {dev.state_ulps} ulps from the reference"
    if ref.unorm is not None:
        got = float(unorm.cpu()[0])
        dev.unorm_rel = abs(got - ref.unorm) / max(ref.unorm, 1e-30)
        assert dev.unorm_rel < 1e-5, (got, ref.unorm)
    return dev
