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
import torch

from ..kernel_args import float32, uint32
from . import validation as v
from .launch import DTYPE_NAMES, check_size, flat_arg, inplace_arg
from .plan import Plan, PlanBuilder
from .registry import checks, kernel_of, planner

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


def _numbers(op: str, step, numbers: dict) -> None:
    """step is an int and each hyperparameter a real number: errors otherwise."""
    v.integer(op, "step", step)
    for name, value in numbers.items():
        v.number(op, name, value)


def _covered_numbers(step: int, numbers: dict) -> None:
    """The kernels count steps from 1 (docs/semantics.md section 5) and take hyperparameters that
    float32 holds as finite values; bitsandbytes computes with the others too (to infinities and
    NaNs): NotCovered. Called after every error check of a call."""
    if step < 1:
        raise v.NotCovered(f"step {step} (the kernels count steps from 1)")
    for name, value in numbers.items():
        if not abs(value) <= _FLOAT32_MAX:  # (infinite, beyond float32, or NaN, which compares false)
            raise v.NotCovered(f"{name} {value!r} (the kernels take values finite as a float32)")


def _scalars(op: str, step, numbers: dict) -> None:
    _numbers(op, step, numbers)
    _covered_numbers(step, numbers)


def _common(op, optimizer_name, g, p, step, numbers: dict) -> int:
    if optimizer_name not in OPTIMIZERS:
        raise ValueError(f"{op}: optimizer_name must be one of {', '.join(OPTIMIZERS)}, got {optimizer_name!r}")
    v.tensor(op, "p", p, dtypes=v.FLOATS)
    v.tensor(op, "g", g, dtypes=(p.dtype,))
    if g.numel() != p.numel():
        raise ValueError(f"{op}: g and p must have the same number of elements, got {g.numel()} and {p.numel()}")
    _numbers(op, step, numbers)
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
    v.tensor(op, "state1", state1, dtypes=v.FLOATS)
    if optimizer_name == "ademamix" and state1.numel() == p.numel() != n1:
        raise ValueError(
            f"{op}: optimizer 'ademamix' keeps the fast and the slow EMA in state1, which must have 2n = {n1} "
            f"elements, got n = {state1.numel()} (shape {tuple(state1.shape)}). bitsandbytes' AdEMAMix32bit class "
            f"allocates state1 with n elements while its 32-bit kernel reads 2n (on CUDA it reads past the end); "
            f"use bitsandbytes.optim.AdEMAMix(params, optim_bits=32) instead, which allocates [2, *p.shape]")
    v.numel(op, "state1", state1, n1)
    two = _needs_state2(op, optimizer_name, state2)
    if two:
        v.tensor(op, "state2", state2, dtypes=v.FLOATS)
        v.numel(op, "state2", state2, p.numel())
    if max_unorm > 0:
        v.tensor(op, "unorm_vec", unorm_vec, dtypes=(torch.float32,))
        v.numel(op, "unorm_vec", unorm_vec, 1, at_least=True)
    else:
        v.tensor(op, "unorm_vec", unorm_vec, dtypes=(torch.float32,), optional=True)
    v.same_device(op, g=g, p=p, state1=state1, state2=state2, unorm_vec=unorm_vec)
    # bitsandbytes' pure-PyTorch update (what serves mps without bnb_mps) keeps states of any float dtype
    v.covered_dtype("state1", state1, (torch.float32,), v.FLOATS)
    if two:
        v.covered_dtype("state2", state2, (torch.float32,), v.FLOATS)
    _covered_numbers(step, numbers)


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
    _covered_numbers(step, numbers)


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
    """A buffer bound for `t` (plus `extra_elements`) starts at a multiple of one 4-element vector:
    `t` itself when contiguous, else the contiguous copy the plan binds (at offset 0)."""
    offset = t.storage_offset() if t.is_contiguous() else 0
    return (offset + extra_elements) % 4 == 0


def _m2_vector_ok(state1: torch.Tensor, n: int) -> bool:
    """AdEMAMix's m2 (state1 from element n on) takes vector accesses when state1's start does and
    n keeps the vector alignment (not merely when state1 + n happens to be aligned: the kernels
    are also checked under the emulator, which keeps a buffer's alignment only up to its start's)."""
    return _vector_ok(state1) and _vector_ok(state1, n)


def _flags(**vectors: bool) -> int:
    """The flags a plan fixes: which buffers take vector accesses."""
    bits = dict(g=VEC_G, p=VEC_P, s1=VEC_S1, s2=VEC_S2, m2=VEC_M2)
    return sum(bits[name] for name, ok in vectors.items() if ok)


# -- per-call scalars -------------------------------------------------------------------------------
#
# The hyperparameters and the step change from call to call (the step on every optimizer step) but not
# from one parameter tensor to the next, so a plan leaves them out of its key and each call turns them
# into the kernels' scalar arguments here, memoized on their exact values (one entry per step and
# parameter group). The checks of these arguments run whenever their values are new, with the messages
# and in the order of the op's `check`.

_MEMO_LIMIT = 256
_memo: dict = {}


def _memoized(key, compute):
    found = _memo.get(key)
    if found is None:
        if len(_memo) >= _MEMO_LIMIT:
            _memo.clear()
        found = _memo[key] = compute()
    return found


# Positions of the per-call arguments in each schema (bnb_mps.registration.SCHEMAS).
# 8-bit: beta1 beta2 beta3 alpha eps step lr weight_decay gnorm_scale skip_zeros
_DYNAMIC_8BIT = (5, 6, 7, 8, 9, 10, 11, 16, 17, 18)
_DYNAMIC_32BIT = (7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17)  # param_norm beta1 ... gnorm_scale skip_zeros
_VALUES_8BIT = struct.Struct("<5dq3d?")
_VALUES_32BIT = struct.Struct("<7dq2d?")


def _dynamic_8bit(args, static_flags: int) -> tuple:
    (beta1, beta2, beta3, alpha, eps, step, lr), (weight_decay, gnorm_scale) = args[5:12], args[16:18]
    skip_zeros = args[18] if len(args) > 18 else False
    try:
        key = (static_flags, _VALUES_8BIT.pack(beta1, beta2, beta3, alpha, eps, step, lr, weight_decay, gnorm_scale,
                                               skip_zeros))  # fmt: skip  (exact values, -0.0 apart from 0.0)
    except struct.error:
        key = None  # not numbers: the checks below say which

    def compute() -> tuple:
        op = "optimizer_update_8bit_blockwise"
        _scalars(op, step, dict(beta1=beta1, beta2=beta2, beta3=beta3, alpha=alpha, eps=eps, lr=lr,
                                 weight_decay=weight_decay, gnorm_scale=gnorm_scale))  # fmt: skip
        flags = static_flags | (FIRST_STEP if step == 1 else 0) | (SKIP_ZEROS if skip_zeros else 0)
        return (uint32(flags), *_hyper(beta1, beta2, beta3, alpha, eps, lr, weight_decay, gnorm_scale, step))

    return compute() if key is None else _memoized(key, compute)


def _dynamic_32bit(args, static_flags: int) -> tuple:
    max_unorm = args[6]
    (param_norm, beta1, beta2, beta3, alpha, eps, weight_decay, step, lr, gnorm_scale) = args[7:17]
    skip_zeros = args[17] if len(args) > 17 else False
    try:
        key = (static_flags, max_unorm, _VALUES_32BIT.pack(param_norm, beta1, beta2, beta3, alpha, eps, weight_decay,
                                                           step, lr, gnorm_scale, skip_zeros))  # fmt: skip
    except struct.error:
        key = None

    def compute() -> tuple:
        op = "optimizer_update_32bit"
        _scalars(op, step, dict(max_unorm=max_unorm, param_norm=param_norm, beta1=beta1, beta2=beta2, beta3=beta3,
                                 alpha=alpha, eps=eps, weight_decay=weight_decay, lr=lr,
                                 gnorm_scale=gnorm_scale))  # fmt: skip
        flags = static_flags | (FIRST_STEP if step == 1 else 0) | (SKIP_ZEROS if skip_zeros else 0)
        max_norm = float32(_f32(_f32(max_unorm) * _f32(param_norm))) if max_unorm > 0 else float32(0.0)
        hyper = _hyper(beta1, beta2, beta3, alpha, eps, lr, weight_decay, gnorm_scale, step)
        return (uint32(flags | (CLIP if max_unorm > 0 else 0)), *hyper, max_norm)

    return compute() if key is None else _memoized(key, compute)


_N_DYNAMIC_8BIT, _N_DYNAMIC_32BIT = 12, 13  # flags, 11 hyperparameter scalars (, max_norm)


@planner("optimizer_update_8bit_blockwise", dynamic_positions=_DYNAMIC_8BIT, dynamic=_dynamic_8bit)
def plan_optimizer_update_8bit_blockwise(
    optimizer_name, g, p, state1, state2, beta1, beta2, beta3, alpha, eps, step, lr, qmap1, qmap2, absmax1,
    absmax2, weight_decay, gnorm_scale, skip_zeros=False,
) -> Plan:  # fmt: skip
    op = "optimizer_update_8bit_blockwise"
    n = p.numel()
    mix = optimizer_name == "ademamix"
    check_size(op, "state1", n * (2 if mix else 1))
    two = OPTIMIZERS[optimizer_name] == 2
    b = PlanBuilder(p.device, op, n_dynamic=_N_DYNAMIC_8BIT)
    b.dynamic_base = _flags(g=_vector_ok(g), p=_vector_ok(p), s1=_vector_ok(state1), s2=two and _vector_ok(state2),
                            m2=mix and _m2_vector_ok(state1, n))  # fmt: skip
    if n == 0:
        return b.build()
    absmax_m2 = absmax1.shape[1] if mix and absmax1.dim() == 2 else v.blocks(n, BLOCKSIZE)
    pb, s1, a1 = inplace_arg(b, 2, p), inplace_arg(b, 3, state1), inplace_arg(b, 14, absmax1)
    s2, a2 = (inplace_arg(b, 4, state2), inplace_arg(b, 15, absmax2)) if two else (s1, a1)
    q1 = flat_arg(b, 12, qmap1)
    q2 = flat_arg(b, 13, qmap2) if two else q1
    b.launch(
        f"bnb_optimizer_8bit_{KERNEL_OPTIMIZER[optimizer_name]}_{DTYPE_NAMES[p.dtype]}",
        (groups_8bit(n), 1, 1), (THREADS, 1, 1),
        [flat_arg(b, 1, g), pb, s1, s2, q1, q2, a1, a2, uint32(n), uint32(absmax_m2),
         *(b.dynamic(k) for k in range(_N_DYNAMIC_8BIT))],
    )  # fmt: skip
    return b.build()


@planner("optimizer_update_32bit", dynamic_positions=_DYNAMIC_32BIT, dynamic=_dynamic_32bit)
def plan_optimizer_update_32bit(
    optimizer_name, g, p, state1, state2, unorm_vec, max_unorm, param_norm, beta1, beta2, beta3, alpha, eps,
    weight_decay, step, lr, gnorm_scale, skip_zeros=False,
) -> Plan:  # fmt: skip
    op = "optimizer_update_32bit"
    n = p.numel()
    mix = optimizer_name == "ademamix"
    check_size(op, "state1", n * (2 if mix else 1))
    two = OPTIMIZERS[optimizer_name] == 2
    b = PlanBuilder(p.device, op, n_dynamic=_N_DYNAMIC_32BIT)
    b.dynamic_base = _flags(g=_vector_ok(g), p=_vector_ok(p), s1=_vector_ok(state1), s2=two and _vector_ok(state2),
                            m2=mix and _m2_vector_ok(state1, n))  # fmt: skip
    if n == 0:
        return b.build()
    pb, s1 = inplace_arg(b, 2, p), inplace_arg(b, 3, state1)
    s2 = inplace_arg(b, 4, state2) if two else s1
    gb = flat_arg(b, 1, g)
    groups = groups_32bit(n)
    name = f"{KERNEL_OPTIMIZER[optimizer_name]}_{DTYPE_NAMES[p.dtype]}"
    geometry = ((groups, 1, 1), (THREADS, 1, 1))
    flags, *hyper, max_norm = (b.dynamic(k) for k in range(_N_DYNAMIC_32BIT))
    if max_unorm > 0:  # update-norm clipping: the norm pass, then the update
        unorm = inplace_arg(b, 5, unorm_vec)
        partials = b.output((groups,), torch.float32)  # one float per threadgroup
        common = [uint32(n), flags, *hyper, max_norm]
        b.launch(f"bnb_optimizer_32bit_unorm_{name}", *geometry, [gb, pb, s1, s2, unorm, partials, *common])
        b.launch(f"bnb_optimizer_32bit_{name}", *geometry, [gb, pb, s1, s2, unorm, partials, *common])
    else:
        b.launch(f"bnb_optimizer_32bit_{name}", *geometry, [gb, pb, s1, s2, s1, s1, uint32(n), flags, *hyper, max_norm])
    return b.build()


optimizer_update_8bit_blockwise_kernel = kernel_of("optimizer_update_8bit_blockwise")
optimizer_update_32bit_kernel = kernel_of("optimizer_update_32bit")
