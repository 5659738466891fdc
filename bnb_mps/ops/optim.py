"""Optimizer updates (SPEC.md section 5): argument checks."""

from __future__ import annotations

import torch

from . import validation as v
from .registry import checks

# Every optimizer name bitsandbytes' update ops accept, and how many states each keeps.
OPTIMIZERS = {
    "adam": 2, "lamb": 2, "ademamix": 2,
    "momentum": 1, "lars": 1, "rmsprop": 1, "adagrad": 1, "lion": 1,
}  # fmt: skip
BLOCKSIZE = 256  # the 8-bit optimizers' state block size


def _common(op, optimizer_name, g, p, step, numbers: dict) -> int:
    if optimizer_name not in OPTIMIZERS:
        raise ValueError(f"{op}: optimizer_name must be one of {', '.join(OPTIMIZERS)}, got {optimizer_name!r}")
    v.tensor(op, "p", p, dtypes=v.FLOATS)
    v.tensor(op, "g", g, dtypes=(p.dtype,))
    if g.numel() != p.numel():
        raise ValueError(f"{op}: g and p must have the same number of elements, got {g.numel()} and {p.numel()}")
    v.integer(op, "step", step, minimum=1)
    for name, value in numbers.items():
        v.number(op, name, value)
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
    numbers = dict(beta1=beta1, beta2=beta2, beta3=beta3, alpha=alpha, eps=eps, lr=lr, weight_decay=weight_decay,
                   gnorm_scale=gnorm_scale)  # fmt: skip
    n1 = _common(op, optimizer_name, g, p, step, numbers)
    _state(op, "1", state1, qmap1, absmax1, n1, p.numel())
    if _needs_state2(op, optimizer_name, state2, qmap2, absmax2):
        _state(op, "2", state2, qmap2, absmax2, p.numel(), p.numel())
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
