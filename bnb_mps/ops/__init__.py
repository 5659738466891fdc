"""The op layer: validate, pick the tier, run.

Device-agnostic Python that knows bitsandbytes (schemas, shapes, dtypes) and nothing of Metal.
Importing this package fills `OPS` with every schema bnb_mps serves.
"""

from __future__ import annotations

from typing import Optional

import torch

from .. import executors
from ..executors import cpu as cpu_fallback
from . import blockwise, fourbit, int8, matmul_4bit, optim  # noqa: F401  (each declares its ops)
from .registry import OPS, OpDef, argument_spec, bind, op_packet

__all__ = ["OPS", "OpDef", "call", "dispatcher_entry", "op_packet"]


def _device_type(args: list) -> str:
    for a in args:
        if isinstance(a, torch.Tensor):
            return a.device.type
    return "cpu"


def call(op: OpDef, args: tuple, kwargs: Optional[dict] = None, executor: Optional[executors.Executor] = None):
    """Serve one call of `op`. With `executor` given, its kernel runs there (no fallback)."""
    bound = bind(op.name, args, kwargs or {})
    op.check(*bound)
    if executor is not None:
        return op.kernel(executor, *bound)
    device_type = _device_type(bound)
    executor = executors.executor_for(op.kernel is not None, device_type)
    if executor is not None:
        if device_type == "mps" and executor.name != "native":
            executors.notify_slow_tier(op.name, *executors.describe(True))
        return op.kernel(executor, *bound)
    if device_type == "mps":
        executors.notify_slow_tier(op.name, *executors.describe(op.kernel is not None))
    return cpu_fallback.run(op.name, bound)


def dispatcher_entry(name: str, executor: Optional[executors.Executor] = None):
    """The function the dispatcher's kernel for schema `name` forwards to: `f(args, kwargs)`."""
    from .. import registration

    op = OPS[name]
    if tuple(arg for arg, _ in argument_spec(name)) != op.params:
        # A bitsandbytes version whose schema bnb_mps does not know: hand the op back and let the
        # dispatcher route this call (and later ones) to bitsandbytes' own kernel.
        registration.leave_to_bitsandbytes(name, registration.schema_mismatch(name) or "schema changed")
        packet = op_packet(name)
        return lambda args, kwargs: packet(*args, **kwargs)

    def entry(args: tuple, kwargs: dict):
        return call(op, args, kwargs, executor)

    return entry
