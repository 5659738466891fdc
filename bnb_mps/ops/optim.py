"""Optimizer updates (docs/semantics.md section 5): argument checks and kernel launchers.

Both ops update the caller's tensors in place with one kernel of `csrc/kernels/optimizer.metal`
per call (two for the 32-bit op with update-norm clipping: the norm pass, then the update), with
the geometry documented there. Nothing is read back from the device: the scalars the kernels need
(bias corrections, the decoupled decay factor) are computed here from the call's numbers, in
float32 as docs/semantics.md section 5 writes them.
"""

from __future__ import annotations

import math
import struct
from typing import Optional

import torch

from ..kernel_args import float32, uint32
from . import validation as v
from .launch import DTYPE_NAMES, check_size, flat
from .registry import checks, kernel

# Every optimizer name bitsandbytes' update ops accept, and how many states each keeps.
OPTIMIZERS = {
    "adam": 2, "lamb": 2, "ademamix": 2,
    "momentum": 1, "lars": 1, "rmsprop": 1, "adagrad": 1, "lion": 1,
}  # fmt: skip
# The 8-bit op refuses these (as CUDA does): their trust ratio needs the update norm, which only
# the 32-bit schema carries (max_unorm, param_norm, unorm_vec).
NOT_8BIT = ("lamb", "lars")
BLOCKSIZE = 256  # the 8-bit optimizers' state block size

_FLOAT32_MAX = 3.4028234663852886e38

# -- checks ---------------------------------------------------------------------------------------


def _finite_numbers(op: str, numbers: dict) -> None:
    """Each hyperparameter is a real number that float32 holds as a finite value."""
    for name, value in numbers.items():
        v.number(op, name, value)
        if not (math.isfinite(value) and abs(value) <= _FLOAT32_MAX):
            raise ValueError(f"{op}: {name} must be finite (as a float32), got {value!r}")


def _common(op, optimizer_name, g, p, step, numbers: dict) -> int:
    if optimizer_name not in OPTIMIZERS:
        raise ValueError(f"{op}: optimizer_name must be one of {', '.join(OPTIMIZERS)}, got {optimizer_name!r}")
    v.tensor(op, "p", p, dtypes=v.FLOATS)
    v.tensor(op, "g", g, dtypes=(p.dtype,))
    if g.numel() != p.numel():
        raise ValueError(f"{op}: g and p must have the same number of elements, got {g.numel()} and {p.numel()}")
    v.integer(op, "step", step, minimum=1)
    _finite_numbers(op, numbers)
    return p.numel() * (2 if optimizer_name == "ademamix" else 1)


def _needs_state2(op, optimizer_name, state2, *others) -> bool:
    if OPTIMIZERS[optimizer_name] == 2:
        if state2 is None or any(o is None for o in others):
            extra = "".join(f", {n}" for n in ("qmap2", "absmax2")[: len(others)])
            raise ValueError(f"{op}: optimizer {optimizer_name!r} keeps two states: state2{extra} are required")
        return True
    return state2 is not None


@checks("optimizer_update_32bit")
def optimizer_update_32bit(
    optimizer_name, g, p, state1, state2, unorm_vec, max_unorm, param_norm, beta1, beta2, beta3, alpha, eps,
    weight_decay, step, lr, gnorm_scale, skip_zeros=False,
) -> None:  # fmt: skip
    op = "optimizer_update_32bit"
    numbers = dict(max_unorm=max_unorm, param_norm=param_norm, beta1=beta1, beta2=beta2, beta3=beta3, alpha=alpha,
                   eps=eps, weight_decay=weight_decay, lr=lr, gnorm_scale=gnorm_scale)  # fmt: skip
    n1 = _common(op, optimizer_name, g, p, step, numbers)
    v.tensor(op, "state1", state1, dtypes=(torch.float32,))
    v.numel(op, "state1", state1, n1)
    if _needs_state2(op, optimizer_name, state2):
        v.tensor(op, "state2", state2, dtypes=(torch.float32,))
        v.numel(op, "state2", state2, p.numel())
    if max_unorm > 0:
        v.tensor(op, "unorm_vec", unorm_vec, dtypes=(torch.float32,))
        v.numel(op, "unorm_vec", unorm_vec, 1, at_least=True)
    else:
        v.tensor(op, "unorm_vec", unorm_vec, dtypes=(torch.float32,), optional=True)
    v.same_device(op, g=g, p=p, state1=state1, state2=state2, unorm_vec=unorm_vec)


@checks("optimizer_update_8bit_blockwise")
def optimizer_update_8bit_blockwise(
    optimizer_name, g, p, state1, state2, beta1, beta2, beta3, alpha, eps, step, lr, qmap1, qmap2, absmax1, absmax2,
    weight_decay, gnorm_scale, skip_zeros=False,
) -> None:  # fmt: skip
    op = "optimizer_update_8bit_blockwise"
    if optimizer_name in NOT_8BIT:
        raise ValueError(
            f"{op}: optimizer {optimizer_name!r} has no 8-bit blockwise update (its trust ratio needs the update "
            f"norm of optimizer_update_32bit); keep its states in 32 bits (optim_bits=32)"
        )
    numbers = dict(beta1=beta1, beta2=beta2, beta3=beta3, alpha=alpha, eps=eps, lr=lr, weight_decay=weight_decay,
                   gnorm_scale=gnorm_scale)  # fmt: skip
    n1 = _common(op, optimizer_name, g, p, step, numbers)
    _state(op, "1", state1, qmap1, absmax1, n1, p.numel())
    if _needs_state2(op, optimizer_name, state2, qmap2, absmax2):
        _state(op, "2", state2, qmap2, absmax2, p.numel(), p.numel())
    if optimizer_name == "ademamix" and absmax1.dim() == 2:
        nblocks = v.blocks(p.numel(), BLOCKSIZE)
        if absmax1.shape[0] != 2 or absmax1.shape[1] < nblocks:
            raise ValueError(f"{op}: ademamix's absmax1 must have shape (2, {nblocks}) (one row per momentum), "
                             f"got {tuple(absmax1.shape)}")  # fmt: skip
    v.same_device(op, g=g, p=p, state1=state1, state2=state2, qmap1=qmap1, qmap2=qmap2, absmax1=absmax1,
                  absmax2=absmax2)  # fmt: skip


def _state(op, k, state, qmap, absmax, n, per_copy) -> None:
    v.tensor(op, f"state{k}", state, dtypes=(torch.uint8,))
    v.numel(op, f"state{k}", state, n)
    v.tensor(op, f"qmap{k}", qmap, dtypes=(torch.float32,))
    v.numel(op, f"qmap{k}", qmap, 256)
    v.tensor(op, f"absmax{k}", absmax, dtypes=(torch.float32,))
    copies = n // per_copy if per_copy else 1
    v.numel(op, f"absmax{k}", absmax, copies * v.blocks(per_copy, BLOCKSIZE), at_least=True)


# -- kernels --------------------------------------------------------------------------------------

# bitsandbytes' optimizer name -> the <opt> part of the kernel host names.
KERNEL_OPTIMIZER = {
    "adam": "adam", "lamb": "adam", "ademamix": "ademamix", "momentum": "momentum", "lars": "momentum",
    "rmsprop": "rmsprop", "adagrad": "adagrad", "lion": "lion",
}  # fmt: skip

THREADS = 256  # threads per threadgroup (both kernels)
PER_LANE = 8  # consecutive elements per lane
MAX_GROUPS = 1024  # grid cap: threadgroups loop over their share beyond this

# The `flags` bits of csrc/kernels/optimizer.h.
VEC_G, VEC_P, VEC_S1, VEC_S2, VEC_M2 = 1, 2, 4, 8, 16
FIRST_STEP, SKIP_ZEROS, CLIP = 32, 64, 128


def groups_8bit(n: int) -> int:
    """Threadgroups of the 8-bit kernel: one simdgroup per 256-block, 8 per threadgroup, capped."""
    return max(1, min(MAX_GROUPS, -(-v.blocks(n, BLOCKSIZE) // (THREADS // 32))))


def groups_32bit(n: int) -> int:
    """Threadgroups of the 32-bit kernels: 2048 elements per threadgroup and iteration, capped."""
    return max(1, min(MAX_GROUPS, -(-n // (THREADS * PER_LANE))))


def _f32(x: float) -> float:
    """x rounded to float32 (round to nearest even)."""
    return struct.unpack("<f", struct.pack("<f", x))[0]


def _hyper(beta1, beta2, beta3, alpha, eps, lr, weight_decay, gnorm_scale, step) -> list:
    """The float32 scalars both kernels take after their flags: beta1, beta2, beta3, alpha, eps,
    lr, bc1, bc2, decay, weight_decay, gnorm_scale. Each operation of bc1 = 1 - beta1^step,
    bc2 = sqrt(1 - beta2^step) and decay = 1 - lr * weight_decay is rounded to float32 (exact
    float32 arithmetic: a float64 result of float32 operands rounded once is the float32 result,
    and beta^step is the correctly rounded power of the float32 beta)."""
    b1, b2, lr32, wd32 = _f32(beta1), _f32(beta2), _f32(lr), _f32(weight_decay)
    bc1 = _f32(1.0 - _f32(b1**step))
    bc2 = _f32(math.sqrt(_f32(1.0 - _f32(b2**step))))
    decay = _f32(1.0 - _f32(lr32 * wd32))
    return [float32(x) for x in (b1, b2, beta3, alpha, eps, lr32, bc1, bc2, decay, wd32, gnorm_scale)]


def _vector_ok(t: torch.Tensor, extra_elements: int = 0) -> bool:
    """A buffer bound at `t` (plus `extra_elements`) starts at a multiple of one 4-element vector."""
    return ((t.storage_offset() + extra_elements) * t.element_size()) % (4 * t.element_size()) == 0


def _m2_vector_ok(state1: torch.Tensor, n: int) -> bool:
    """AdEMAMix's m2 (state1 from element n on) takes vector accesses when state1's start does and
    n keeps the vector alignment (not merely when state1 + n happens to be aligned: the kernels
    are also checked under the emulator, which keeps a buffer's alignment only up to its start's)."""
    return _vector_ok(state1) and _vector_ok(state1, n)


class _InPlace:
    """Binds the tensors a kernel updates in place: flat views of contiguous ones; a contiguous
    copy of a non-contiguous one, written back by `finish()` (bitsandbytes passes contiguous
    tensors; this keeps other callers correct)."""

    def __init__(self) -> None:
        self._copies: list[tuple[torch.Tensor, torch.Tensor]] = []

    def bind(self, t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        if t is None:
            return None
        if t.is_contiguous():
            return t.view(-1)
        c = t.contiguous().view(-1)
        self._copies.append((t, c))
        return c

    def finish(self) -> None:
        for t, c in self._copies:
            t.copy_(c.view(t.shape))


def _flags(step: int, skip_zeros: bool, **vectors: bool) -> int:
    bits = dict(g=VEC_G, p=VEC_P, s1=VEC_S1, s2=VEC_S2, m2=VEC_M2)
    f = sum(bits[name] for name, ok in vectors.items() if ok)
    return f | (FIRST_STEP if step == 1 else 0) | (SKIP_ZEROS if skip_zeros else 0)


@kernel("optimizer_update_8bit_blockwise")
def optimizer_update_8bit_blockwise_kernel(
    executor, optimizer_name, g, p, state1, state2, beta1, beta2, beta3, alpha, eps, step, lr, qmap1, qmap2, absmax1,
    absmax2, weight_decay, gnorm_scale, skip_zeros=False,
) -> None:  # fmt: skip
    op = "optimizer_update_8bit_blockwise"
    n = p.numel()
    mix = optimizer_name == "ademamix"
    check_size(op, "state1", n * (2 if mix else 1))
    if n == 0:
        return
    nblocks = v.blocks(n, BLOCKSIZE)
    absmax_m2 = absmax1.shape[1] if mix and absmax1.dim() == 2 else nblocks
    inplace = _InPlace()
    pb, s1, a1 = inplace.bind(p), inplace.bind(state1), inplace.bind(absmax1)
    two = OPTIMIZERS[optimizer_name] == 2
    s2, a2 = (inplace.bind(state2), inplace.bind(absmax2)) if two else (s1, a1)
    gb = flat(g)
    q1 = flat(qmap1)
    q2 = flat(qmap2) if two else q1
    flags = _flags(step, skip_zeros, g=_vector_ok(gb), p=_vector_ok(pb), s1=_vector_ok(s1),
                   s2=two and _vector_ok(s2), m2=mix and _m2_vector_ok(s1, n))  # fmt: skip
    executor.launch(
        f"bnb_optimizer_8bit_{KERNEL_OPTIMIZER[optimizer_name]}_{DTYPE_NAMES[p.dtype]}",
        grid=(groups_8bit(n), 1, 1),
        threadgroup=(THREADS, 1, 1),
        args=[gb, pb, s1, s2, q1, q2, a1, a2, uint32(n), uint32(absmax_m2), uint32(flags),
              *_hyper(beta1, beta2, beta3, alpha, eps, lr, weight_decay, gnorm_scale, step)],  # fmt: skip
    )
    inplace.finish()


@kernel("optimizer_update_32bit")
def optimizer_update_32bit_kernel(
    executor, optimizer_name, g, p, state1, state2, unorm_vec, max_unorm, param_norm, beta1, beta2, beta3, alpha, eps,
    weight_decay, step, lr, gnorm_scale, skip_zeros=False,
) -> None:  # fmt: skip
    op = "optimizer_update_32bit"
    n = p.numel()
    mix = optimizer_name == "ademamix"
    check_size(op, "state1", n * (2 if mix else 1))
    if n == 0:
        return
    clip = max_unorm > 0
    inplace = _InPlace()
    pb, s1 = inplace.bind(p), inplace.bind(state1)
    two = OPTIMIZERS[optimizer_name] == 2
    s2 = inplace.bind(state2) if two else s1
    gb = flat(g)
    groups = groups_32bit(n)
    flags = _flags(step, skip_zeros, g=_vector_ok(gb), p=_vector_ok(pb), s1=_vector_ok(s1),
                   s2=two and _vector_ok(s2), m2=mix and _m2_vector_ok(s1, n))  # fmt: skip
    hyper = _hyper(beta1, beta2, beta3, alpha, eps, lr, weight_decay, gnorm_scale, step)
    name = f"{KERNEL_OPTIMIZER[optimizer_name]}_{DTYPE_NAMES[p.dtype]}"
    geometry = dict(grid=(groups, 1, 1), threadgroup=(THREADS, 1, 1))
    if clip:
        unorm = inplace.bind(unorm_vec)
        partials = torch.empty(groups, dtype=torch.float32, device=p.device)  # one float per threadgroup
        max_norm = float32(_f32(_f32(max_unorm) * _f32(param_norm)))
        common = [uint32(n), uint32(flags | CLIP), *hyper, max_norm]
        executor.launch(f"bnb_optimizer_32bit_unorm_{name}", **geometry, args=[gb, pb, s1, s2, unorm, partials, *common])
        executor.launch(f"bnb_optimizer_32bit_{name}", **geometry, args=[gb, pb, s1, s2, unorm, partials, *common])
    else:
        executor.launch(f"bnb_optimizer_32bit_{name}", **geometry,
                        args=[gb, pb, s1, s2, s1, s1, uint32(n), uint32(flags), *hyper, float32(0.0)])  # fmt: skip
    inplace.finish()
