"""A plain reference of docs/semantics.md section 5 (the optimizer updates), independent of any kernel.

Vectorised numpy in float32, one rounding per operation in the order docs/semantics.md writes the formulas;
section 2's re-quantization comes from tests/spec_reference.py (docs/semantics.md sections 1-3). Tensors in and
out are CPU torch tensors; nothing is updated in place: each function returns the new values.

Readings of docs/semantics.md where it leaves room (the kernels follow the same ones):
- Scalars: every hyperparameter is rounded to float32 first; bc1 = fl32(1 - fl32(beta1^step))
  with the power correctly rounded, bc2 = fl32(sqrt(fl32(1 - fl32(beta2^step)))), and the
  decoupled decay factor is fl32(1 - fl32(lr * weight_decay)).
- "p - lr * a / d" is evaluated as p - fl32(fl32(lr * a) / d), a being m/bc1 (adam) or
  m/bc1 + alpha*m2 (ademamix) or g' (rmsprop, adagrad); "(1-beta2)*g'*g'" left to right.
- sign(x) is 0 for +-0 and NaN.
- Re-quantization: docs/semantics.md section 2's index of fl32(x * fl32(1 / absmax)) (an all-zero block gives
  index 0), then, for state1 (the signed states: m and AdEMAMix's m2), the sign fix on the sign
  bits, stepping modulo 256. So +0.0 in an all-zero block is stored as 255 (code[0] is negative,
  +0.0 is not, and 0 - 1 wraps), exactly as CUDA's kernel does; -0.0 stays at 0. A NaN counts as
  positive whatever its sign bit (CUDA's arithmetic only makes the NaN 0x7fffffff): it is stored as 255.
- The update norm sums u^2 over the elements that are updated (a skipped zero gradient adds 0);
  u is the update before the learning rate for every optimizer (lion: sign(...); ademamix:
  (m/bc1 + alpha*m2) / (sqrt(v)/bc2 + eps)). The clipped step uses fl32(lr * scale); the
  decoupled decay keeps the plain lr.

Apple GPUs flush float32 subnormals (docs/semantics.md section 7). With `flush=True` (the default,
tests/spec_reference.py's `FLUSH`: what the kernels compute on a Mac and under the emulator's
default "apple" float mode) every float32 operation of the update takes its operands and gives its
result with magnitudes below 2^-126 as zeros of the same sign: the gradient, the parameter, the
dequantized or float32 states and the hyperparameters as they enter the arithmetic, and every
product, sum, quotient and square root. So a subnormal gradient counts as 0 (also for skip_zeros),
and a state that decays below 2^-126 becomes 0. What the op only moves keeps its bits: an element
that skip_zeros (or a non-finite gradient, for p) leaves alone is stored exactly as it was.
Re-quantization is section 2's IEEE arithmetic on those flushed values (the kernels give that
answer, docs/semantics.md section 7). `flush=False` is plain IEEE float32 (the emulator's "ieee"
mode, and CUDA).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

import spec_reference as sref

F32 = np.float32
BLOCK = 256
TWO_STATE = ("adam", "lamb", "ademamix")
ONE_STATE = ("momentum", "lars", "rmsprop", "adagrad", "lion")


def f32(x) -> np.float32:
    return F32(x)


@dataclass
class Hyper:
    beta1: np.float32
    beta2: np.float32
    beta3: np.float32
    alpha: np.float32
    eps: np.float32
    lr: np.float32
    weight_decay: np.float32
    gnorm_scale: np.float32
    bc1: np.float32
    bc2: np.float32
    decay: np.float32
    first_step: bool

    @classmethod
    def make(cls, beta1, beta2, beta3, alpha, eps, lr, weight_decay, gnorm_scale, step) -> "Hyper":
        b1, b2, lr32, wd32 = f32(beta1), f32(beta2), f32(lr), f32(weight_decay)
        bc1 = F32(1) - f32(float(b1) ** step)
        bc2 = np.sqrt(F32(1) - f32(float(b2) ** step))
        decay = F32(1) - lr32 * wd32
        return cls(b1, b2, f32(beta3), f32(alpha), f32(eps), lr32, wd32, f32(gnorm_scale), F32(bc1), F32(bc2),
                   F32(decay), step == 1)  # fmt: skip

    def flushed(self, flush: bool | None = None) -> "Hyper":
        """The scalars as the kernel's arithmetic takes them (computed on the host in IEEE float32,
        then, with flush, below 2^-126 as signed zeros)."""
        z = _arith(flush)
        fields = {k: (z(v) if isinstance(v, np.float32) else v) for k, v in vars(self).items()}
        return Hyper(**{k: (F32(v) if isinstance(v, np.ndarray) else v) for k, v in fields.items()})


def _arith(flush: bool | None):
    """z(x): a float32 value as Apple's float32 arithmetic takes or gives it (flush) or as IEEE does."""
    if sref._flush(flush):
        return sref.flush_subnormals
    return lambda x: np.asarray(x, dtype=F32)


def _sign(x: np.ndarray) -> np.ndarray:
    return np.where(x > 0, F32(1), np.where(x < 0, F32(-1), F32(0))).astype(F32)


def element_update(name: str, g, p, m, v, m2, lr_step: np.float32, h: Hyper, flush: bool | None = None):
    """docs/semantics.md 5.1 / 5.2 formulas on float32 arrays (all elements updated). Returns (p, m, v, m2, u).

    One rounding per operation; with flush (docs/semantics.md section 7), every operand and result
    below 2^-126 is a zero of its sign (`z`)."""
    z = _arith(flush)
    h = h.flushed(flush)
    lr_step = z(lr_step)
    g, p, m, v, m2 = (z(x) for x in (g, p, m, v, m2))
    with np.errstate(all="ignore"):
        gs = z(g * h.gnorm_scale)
        one = F32(1)
        if name in ("adam", "lamb", "ademamix"):
            m = z(z(h.beta1 * m) + z(z(one - h.beta1) * gs))
            v = z(z(h.beta2 * v) + z(z(z(one - h.beta2) * gs) * gs))
            num = z(m / h.bc1)
            if name == "ademamix":
                m2 = z(z(h.beta3 * m2) + z(z(one - h.beta3) * gs))
                num = z(num + z(h.alpha * m2))
            den = z(z(z(np.sqrt(v)) / h.bc2) + h.eps)
            u = z(num / den)
            p = z(p - z(z(lr_step * num) / den))
            if h.weight_decay > 0:
                p = z(p * h.decay)
        elif name == "lion":
            if h.weight_decay > 0:
                p = z(p * h.decay)
            u = _sign(z(z(h.beta1 * m) + z(z(one - h.beta1) * gs)))
            m = z(z(h.beta2 * m) + z(z(one - h.beta2) * gs))
            p = z(p - z(lr_step * u))
        else:
            gw = z(gs + z(h.weight_decay * p)) if h.weight_decay > 0 else gs
            if name in ("momentum", "lars"):
                m = gw.copy() if h.first_step else z(z(h.beta1 * m) + gw)
                u = m
                p = z(p - z(lr_step * m))
            else:
                if name == "rmsprop":
                    m = z(z(h.beta1 * m) + z(z(z(one - h.beta1) * gw) * gw))
                else:  # adagrad
                    m = z(m + z(gw * gw))
                den = z(z(np.sqrt(m)) + h.eps)
                u = z(gw / den)
                p = z(p - z(z(lr_step * gw) / den))
    return [np.asarray(x, dtype=F32) for x in (p, m, v, m2, u)]


def _np(t: torch.Tensor) -> np.ndarray:
    """The elements as float32, widened exactly: for float16 by numpy, which keeps a NaN's sign (torch's
    conversion makes every NaN positive, and the sign fix of docs/semantics.md 5.1 step 4 reads it)."""
    t = t.detach().reshape(-1)
    if t.dtype == torch.float16:
        return t.contiguous().view(torch.int16).numpy().view(np.float16).astype(F32)
    return t.to(torch.float32).numpy().copy()


def _to(x: np.ndarray, dtype: torch.dtype, shape) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(x, dtype=F32)).to(dtype).reshape(shape)


# -- 8-bit ---------------------------------------------------------------------------------------


def dequantize(codes: np.ndarray, absmax: np.ndarray, qmap: np.ndarray, flush: bool | None = None) -> np.ndarray:
    """x_i = fl32(qmap[codes_i] * absmax[i // 256]) (with flush: operands and product below 2^-126 as zeros)."""
    z = _arith(flush)
    return z(z(qmap)[codes] * np.repeat(z(absmax), BLOCK)[: codes.size])


def requantize(x: np.ndarray, qmap: np.ndarray, signed: bool):
    """docs/semantics.md 5.1 steps 3-4: new absmax per block, section 2's index, the sign fix for signed states.
    Returns (codes uint8, absmax float32, scaled values s)."""
    absmax = sref.blockwise_absmax(x, BLOCK)
    s = sref.scaled_values(x, absmax, BLOCK)
    q = sref.index_8bit(s, qmap).astype(np.int64)
    if signed:
        fix = np.signbit(qmap[q]) != (np.signbit(x) & ~np.isnan(x))  # a NaN counts as positive (CUDA's NaN)
        q = np.where(fix, np.where(x > 0, q + 1, q - 1) % 256, q)
    return q.astype(np.uint8), absmax, s


@dataclass
class Result8:
    p: torch.Tensor
    state1: torch.Tensor
    state2: torch.Tensor | None
    absmax1: torch.Tensor
    absmax2: torch.Tensor | None
    # float32 values before re-quantization and their scaled values (to locate near-threshold codes)
    values1: np.ndarray
    scaled1: np.ndarray
    values2: np.ndarray | None
    scaled2: np.ndarray | None


def optimizer_8bit(name, g, p, state1, state2, beta1, beta2, beta3, alpha, eps, step, lr, qmap1, qmap2, absmax1,
                   absmax2, weight_decay, gnorm_scale, skip_zeros=False, *, flush: bool | None = None) -> Result8:  # fmt: skip
    """optimizer_update_8bit_blockwise per docs/semantics.md 5.1 (state tensors keep their shapes); `flush`:
    Apple's float32 arithmetic (docs/semantics.md section 7; default `spec_reference.FLUSH`) or IEEE."""
    if name in ("lamb", "lars"):
        raise ValueError(name)
    n = p.numel()
    nb = -(-n // BLOCK)
    h = Hyper.make(beta1, beta2, beta3, alpha, eps, lr, weight_decay, gnorm_scale, step)
    c1 = qmap1.numpy().astype(F32)
    codes1 = state1.reshape(-1).numpy()
    a1 = absmax1.reshape(-1).numpy().astype(F32)
    gv, pv = _np(g), _np(p)
    z = _arith(flush)
    m = dequantize(codes1[:n], a1[:nb], c1, flush)
    mix = name == "ademamix"
    a1_m2 = absmax1.shape[1] if mix and absmax1.dim() == 2 else nb
    m2 = dequantize(codes1[n : 2 * n], a1[a1_m2 : a1_m2 + nb], c1, flush) if mix else np.zeros(n, F32)
    two = name in TWO_STATE
    if two:
        c2 = qmap2.numpy().astype(F32)
        v = dequantize(state2.reshape(-1).numpy(), absmax2.reshape(-1).numpy().astype(F32)[:nb], c2, flush)
    else:
        v = np.zeros(n, F32)
    np_, nm, nv, nm2, _ = element_update(name, gv, pv, m, v, m2, h.lr, h, flush)
    if two:
        ok = np.isfinite(gv)  # a subnormal gradient is finite (and counts as 0 in the update)
        np_ = np.where(ok, np_, pv)
        nm, nv, nm2 = (np.where(ok, x, F32(0)).astype(F32) for x in (nm, nv, nm2))
    else:
        # skip_zeros compares the gradient with 0 (a float32 operation: a subnormal is 0 with
        # flush); a skipped element keeps p's bits and its dequantized state.
        keep = (z(gv) == 0) if skip_zeros else np.zeros(n, bool)
        np_, nm = np.where(keep, pv, np_), np.where(keep, m, nm)
    q1, na1, s1 = requantize(nm, c1, signed=True)
    new_state1, new_absmax1 = state1.clone(), absmax1.clone()
    flat1, flata1 = new_state1.view(-1), new_absmax1.view(-1)
    flat1[:n] = torch.from_numpy(q1)
    flata1[:nb] = torch.from_numpy(na1)
    values1, scaled1 = nm, s1
    if mix:
        q3, na3, s3 = requantize(nm2, c1, signed=True)
        flat1[n : 2 * n] = torch.from_numpy(q3)
        flata1[a1_m2 : a1_m2 + nb] = torch.from_numpy(na3)
        values1, scaled1 = np.concatenate([nm, nm2]), np.concatenate([s1, s3])
    new_state2 = new_absmax2 = values2 = scaled2 = None
    if two:
        q2, na2, s2 = requantize(nv, c2, signed=False)
        new_state2 = torch.from_numpy(q2).reshape(state2.shape)
        new_absmax2 = absmax2.clone()
        new_absmax2.view(-1)[:nb] = torch.from_numpy(na2)
        values2, scaled2 = nv, s2
    return Result8(_to(np_, p.dtype, p.shape), new_state1, new_state2, new_absmax1, new_absmax2, values1, scaled1,
                   values2, scaled2)  # fmt: skip


def near_threshold(scaled: np.ndarray, qmap: torch.Tensor, rel: float = 1e-6) -> np.ndarray:
    """Elements whose scaled value lies within `rel` (relative) of a code threshold of qmap."""
    t = sref.thresholds(qmap.numpy().astype(F32)).astype(np.float64)
    s = scaled.astype(np.float64)
    i = np.clip(np.searchsorted(t, s), 1, t.size - 1)
    d = np.minimum(np.abs(s - t[i - 1]), np.abs(s - t[i]))
    with np.errstate(invalid="ignore"):
        return d <= rel * np.maximum(np.abs(s), 1e-30)


# -- 32-bit --------------------------------------------------------------------------------------


@dataclass
class Result32:
    p: torch.Tensor
    state1: torch.Tensor
    state2: torch.Tensor | None
    unorm: float | None  # the sum of u^2 (float64 sum of float32 squares) when clipping


def optimizer_32bit(name, g, p, state1, state2, unorm_vec, max_unorm, param_norm, beta1, beta2, beta3, alpha, eps,
                    weight_decay, step, lr, gnorm_scale, skip_zeros=False, *, flush: bool | None = None) -> Result32:  # fmt: skip
    """optimizer_update_32bit per docs/semantics.md 5.2; `flush`: Apple's float32 arithmetic
    (docs/semantics.md section 7; default `spec_reference.FLUSH`) or IEEE. A skipped element keeps
    the bits of p and of its states."""
    n = p.numel()
    h = Hyper.make(beta1, beta2, beta3, alpha, eps, lr, weight_decay, gnorm_scale, step)
    gv, pv = _np(g), _np(p)
    s1 = _np(state1)
    m, m2 = s1[:n], (s1[n : 2 * n] if name == "ademamix" else np.zeros(n, F32))
    two = name in TWO_STATE
    v = _np(state2) if two else np.zeros(n, F32)
    skippable = name != "ademamix"
    z = _arith(flush)
    keep = (z(gv) == 0) if (skip_zeros and skippable) else np.zeros(n, bool)
    lr_step = h.lr
    unorm = None
    if max_unorm > 0:
        *_, u = element_update(name, gv, pv, m, v, m2, h.lr, h, flush)
        u = np.where(keep, F32(0), u)
        squares = u.astype(np.float64) ** 2
        if sref._flush(flush):  # the kernel's float32 u * u below 2^-126 adds 0
            with np.errstate(all="ignore"):
                squares = np.where(z(u * u) == 0, 0.0, squares)
        unorm = float(np.sum(squares))
        with np.errstate(all="ignore"):
            norm = z(F32(math.sqrt(z(F32(unorm)))))
            max_norm = z(f32(max_unorm) * f32(param_norm))
            if norm > max_norm:
                lr_step = z(z(h.lr) * z(max_norm / norm))
    np_, nm, nv, nm2, _ = element_update(name, gv, pv, m, v, m2, lr_step, h, flush)
    np_ = np.where(keep, pv, np_)
    nm, nv, nm2 = np.where(keep, m, nm), np.where(keep, v, nv), np.where(keep, m2, nm2)
    new1 = np.concatenate([nm, nm2]) if name == "ademamix" else nm
    return Result32(
        _to(np_, p.dtype, p.shape),
        torch.from_numpy(new1.astype(F32)).reshape(state1.shape),
        torch.from_numpy(nv.astype(F32)).reshape(state2.shape) if two else None,
        unorm,
    )
