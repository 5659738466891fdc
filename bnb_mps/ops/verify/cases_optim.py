"""The optimizer families' cases: one step of every 8-bit and 32-bit optimizer, and the 8-bit two-state
optimizers' rule for a non-finite gradient (docs/semantics.md section 5)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import torch

from .cases import Case, gen, signed_code, unsigned_code
from .compare import close, exact


def _ulp(t: torch.Tensor) -> torch.Tensor:
    """The spacing of t's dtype at |t| (float64)."""
    info = torch.finfo(t.dtype)
    mag = t.double().abs().clamp_min(float(info.tiny))
    return 2.0 ** torch.floor(torch.log2(mag)) * info.eps


def _optimizer_p_tolerance(p_before: torch.Tensor, p_want: torch.Tensor) -> torch.Tensor:
    """Both sides compute one float32 step in different operation orders, then round p once."""
    step = (p_want.double() - p_before.double()).abs()
    return 2 * _ulp(p_want) + 2 * _ulp(p_before) + 64 * 2.0**-24 * step + 1e-30


def _optimizer_8bit_compare(p_before: torch.Tensor) -> Callable:
    """p within a few roundings; each state's absmax within 1e-5 relative and its codes equal but for
    a few, which may differ by at most 3 steps: bitsandbytes' CPU re-quantizes with its lookup
    table (1-3 codes off next to decision points and among the smallest codes) and without the
    sign fix of docs/semantics.md 5.1."""

    def compare(got, want, got_args, want_args):
        err = close(got_args[2], want_args[2], _optimizer_p_tolerance(p_before, want_args[2]), "p")
        if err:
            return err
        for si, ai in ((3, 14), (4, 15)):
            if want_args[si] is None:
                continue
            err = close(got_args[ai], want_args[ai], 1e-5 * want_args[ai].double().abs() + 1e-30, f"absmax of state {si - 2}")
            if err:
                return err
            q, w = got_args[si].int(), want_args[si].int()
            off = (q - w).abs()
            if int(off.max()) > 3 or float((off > 0).float().mean()) > 0.02:
                return (f"state{si - 2}: {int((off > 0).sum())} of {off.numel()} codes differ from the CPU's, by up to "
                        f"{int(off.max())}")
        return None

    return compare


def _optimizer_32bit_compare(args: tuple) -> Callable:
    """p as for the 8-bit op; the float32 states within 2e-6 of the magnitudes of their terms
    (old state, gradient, its square): the two sides round a few operations differently, and a
    state that is a small difference of large terms carries their rounding."""
    p_before, g = args[2].clone(), args[1].double().abs() * args[16]
    before = [None if a is None else a.clone() for a in args[3:5]]

    def compare(got, want, got_args, want_args):
        err = close(got_args[2], want_args[2], _optimizer_p_tolerance(p_before, want_args[2]), "p")
        if err:
            return err
        for si in (3, 4):
            if want_args[si] is not None:
                terms = before[si - 3].double().abs() + want_args[si].double().abs() + g + g * g
                err = close(got_args[si], want_args[si], 2e-6 * terms + 1e-30, f"state{si - 2}")
                if err:
                    return err
        return None

    return compare


def _quantized_state(values: torch.Tensor, code: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    q, a = torch.ops.bitsandbytes.quantize_blockwise.default(values.reshape(-1).float().contiguous(), code, 256)
    return q.reshape(values.shape), a


# (name, dtype, weight decay): weight decay only where bitsandbytes' CPU code applies it as
# docs/semantics.md does (coupled for momentum/rmsprop/adagrad; decoupled-before for lion), none for
# adam/ademamix (the CPU code decays before the step, the page after it).
_OPT8 = [("adam", torch.float32, 0.0), ("ademamix", torch.float16, 0.0), ("momentum", torch.bfloat16, 0.01),
         ("rmsprop", torch.float32, 0.01), ("adagrad", torch.float16, 0.0), ("lion", torch.float32, 0.01)]
# (name, dtype, weight decay, max_unorm). Update-norm clipping that acts only for lars: bitsandbytes'
# CPU lamb takes the norm of m / (sqrt(v) + eps*bc2), without docs/semantics.md's bias corrections,
# so its trust ratio differs by bc2 / bc1. The others with max_unorm 1e4 clip with a bound their
# update norm stays far below: the norm pass of every optimizer runs (a wrong norm far above the
# bound would clip), the update is unchanged.
_OPT32 = [("adam", torch.float16, 0.0, 0.0), ("lamb", torch.float32, 0.0, 1e4), ("ademamix", torch.float32, 0.0, 1e4),
          ("momentum", torch.float32, 0.01, 0.0), ("lars", torch.bfloat16, 0.0, 0.002),
          ("rmsprop", torch.float32, 0.01, 1e4), ("adagrad", torch.float16, 0.01, 1e4), ("lion", torch.bfloat16, 0.01, 1e4)]  # fmt: skip
_TWO_STATE = ("adam", "lamb", "ademamix")


def optimizer_8bit_cases() -> Iterator[Case]:
    code, ucode = signed_code(), unsigned_code()
    n = 700  # two full 256-blocks and a partial one
    for i, (name, dtype, wd) in enumerate(_OPT8):
        g = gen(700 + i)
        p = (torch.randn(n, generator=g) * 0.1).to(dtype)
        grad = (torch.randn(n, generator=g) * 0.01).to(dtype)
        m = torch.randn(2 if name == "ademamix" else 1, n, generator=g) * 0.01
        if name in ("rmsprop", "adagrad"):
            m = m.square() * 10
        q1, a1 = zip(*(_quantized_state(m[c], code) for c in range(m.shape[0])))
        state1, absmax1 = (torch.stack(q1), torch.stack(a1)) if name == "ademamix" else (q1[0], a1[0])
        if name in _TWO_STATE:
            state2, absmax2 = _quantized_state(torch.randn(n, generator=g).square() * 1e-4, ucode)
            qmap2 = ucode
        else:
            state2 = absmax2 = qmap2 = None
        args = (name, grad, p, state1, state2, 0.9, 0.995, 0.999, 5.0, 1e-8, 3, 1e-3, code, qmap2, absmax1, absmax2,
                wd, 0.7, False)  # fmt: skip
        yield Case(f"optimizer_update_8bit_blockwise {name} {dtype} n={n}", "optimizer_update_8bit_blockwise", args,
                   _optimizer_8bit_compare(p.clone()))  # fmt: skip


def optimizer_32bit_cases() -> Iterator[Case]:
    n = 1100
    for i, (name, dtype, wd, max_unorm) in enumerate(_OPT32):
        g = gen(800 + i)
        p = (torch.randn(n, generator=g) * 0.1).to(dtype)
        grad = (torch.randn(n, generator=g) * 0.01).to(dtype)
        s1 = torch.randn(*((2, n) if name == "ademamix" else (n,)), generator=g) * 0.01
        if name in ("rmsprop", "adagrad"):
            s1 = s1.square() * 10
        s2 = torch.randn(n, generator=g).square() * 1e-4 if name in _TWO_STATE else None
        unorm = torch.zeros(1) if max_unorm > 0 else None
        param_norm = float(p.float().norm()) if max_unorm > 0 else 0.0
        args = (name, grad, p, s1, s2, unorm, max_unorm, param_norm, 0.9, 0.995, 0.999, 5.0, 1e-8, wd, 3, 1e-3, 0.7,
                False)  # fmt: skip
        yield Case(f"optimizer_update_32bit {name} {dtype} clip={max_unorm} n={n}", "optimizer_update_32bit", args,
                   _optimizer_32bit_compare(args))  # fmt: skip


def _zero_index(code: torch.Tensor) -> int:
    """The index of the code value 0.0 (both dynamic codes hold it exactly)."""
    return int((code == 0).nonzero()[0])


def _non_finite_expected(op: str, mask: torch.Tensor, zero1: int, zero2: int) -> Callable:
    """docs/semantics.md's result for a step whose gradient is NaN or infinite where `mask` is set: those
    elements' new states are 0 and their p unchanged, the others step as usual. That is the CPU's step
    with those gradients 0 and those old states 0 (with no weight decay, such an element's states stay
    0 and its update is 0), so the CPU computes it from arguments changed accordingly; only its codes
    for those zero states are not the spec's (bitsandbytes' CPU lookup table gives a code next to 0,
    e.g. 131 instead of 127), so they are set to the code of 0 afterwards."""
    from ..cpu_round_trip import cpu_call

    def expected(want_args):
        want_args[1][mask] = 0
        want_args[3][..., mask] = zero1
        want_args[4][mask] = zero2
        result = cpu_call(op, want_args)
        want_args[3][..., mask] = zero1
        want_args[4][mask] = zero2
        return result

    return expected


def _non_finite_compare(p_before: torch.Tensor, mask: torch.Tensor, zero1: int, zero2: int) -> Callable:
    """As for every 8-bit case, and exactly: the elements with a non-finite gradient keep p bit for bit,
    and their states' new codes are the code of 0."""
    usual = _optimizer_8bit_compare(p_before)

    def compare(got, want, got_args, want_args):
        err = exact(got_args[2][mask], p_before[mask], "p where the gradient is not finite")
        if err:
            return err.replace("the CPU gives", "it was")
        for si, zero in ((3, zero1), (4, zero2)):
            codes = got_args[si][..., mask]
            if bool((codes != zero).any()):
                return (f"state{si - 2} where the gradient is not finite: codes {sorted(set(codes.reshape(-1).tolist()))} "
                        f"where {zero} (the code of 0) is due")
        return usual(got, want, got_args, want_args)

    return compare


def optimizer_8bit_non_finite_cases() -> Iterator[Case]:
    """adam and ademamix with NaN, +inf and -inf gradients among finite ones, at elements whose old
    states are not 0 (in each block: a reset that did not happen, or a NaN let into a block maximum,
    shows)."""
    code, ucode = signed_code(), unsigned_code()
    zero1, zero2 = _zero_index(code), _zero_index(ucode)
    n = 600
    for i, (name, dtype) in enumerate((("adam", torch.float32), ("ademamix", torch.bfloat16))):
        g = gen(750 + i)
        p = (torch.randn(n, generator=g) * 0.1).to(dtype)
        grad = (torch.randn(n, generator=g) * 0.01).to(dtype)
        mask = torch.zeros(n, dtype=torch.bool)
        mask[3::37] = True
        special = torch.tensor([math.nan, math.inf, -math.inf]).to(dtype)
        grad[mask] = special[torch.arange(int(mask.sum())) % 3]
        m = torch.randn(2 if name == "ademamix" else 1, n, generator=g) * 0.01
        q1, a1 = zip(*(_quantized_state(m[c], code) for c in range(m.shape[0])))
        state1, absmax1 = (torch.stack(q1), torch.stack(a1)) if name == "ademamix" else (q1[0], a1[0])
        state2, absmax2 = _quantized_state(torch.randn(n, generator=g).square() * 1e-4 + 1e-6, ucode)
        args = (name, grad, p, state1, state2, 0.9, 0.995, 0.999, 5.0, 1e-8, 3, 1e-3, code, ucode, absmax1, absmax2,
                0.0, 1.0, False)  # fmt: skip
        yield Case(f"optimizer_update_8bit_blockwise {name} {dtype} n={n} non-finite gradients (nan, inf, -inf)",
                   "optimizer_update_8bit_blockwise", args, _non_finite_compare(p.clone(), mask, zero1, zero2),
                   expected=_non_finite_expected("optimizer_update_8bit_blockwise", mask, zero1, zero2))  # fmt: skip
