"""The op layer: validate, route, run.

Device-agnostic Python that knows bitsandbytes (schemas, shapes, dtypes) and nothing of Metal.
Importing this package fills `OPS` with every schema bnb_mps serves.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from typing import Optional

from .. import executors
from . import cpu_round_trip as cpu_fallback
from . import blockwise, fourbit, int8, matmul_4bit, optim  # noqa: F401  (each declares its ops)
from . import routing
from . import plan as _plan
from .plan import BoundPlan
from .registry import OPS, OpDef, argument_spec, bind, op_packet
from .routing import Route, route

logger = logging.getLogger("bnb_mps")

__all__ = ["OPS", "OpDef", "Route", "call", "call_counts", "dispatcher_entry", "op_packet", "reset_call_counts",
           "route"]

#: hand_back(name, reason) -> a callable that runs the op with bitsandbytes' own implementation
#: (given by the registration, which withdraws bnb_mps' kernel for that op)
HandBack = Callable[[str, str], Callable[..., object]]

_calls: Counter = Counter()  # (op name, tier) -> calls the op layer served


def call_counts() -> dict[str, dict[str, int]]:
    """Calls the op layer served since the last reset: {op: {tier: calls}}. The tier is the
    executor's ("native", "shader", "emulated"), "cpu" (the round trip) or "bitsandbytes" (a call
    handed back; bitsandbytes then serves later calls of that op directly, and they are not seen)."""
    out: dict[str, dict[str, int]] = {}
    for (name, tier), n in list(_calls.items()):
        out.setdefault(name, {})[tier] = n
    return out


def reset_call_counts() -> None:
    _calls.clear()


def call(op: OpDef, args: tuple, kwargs: Optional[dict] = None, executor: Optional[executors.Executor] = None,
         hand_back: Optional[HandBack] = None, plans: Optional["_Plans"] = None):
    """Serve one call of `op`: its kernel on `executor` when one is given (tests, the emulated
    tier registered for the CPU key), else on its route's tier (kernel or CPU round trip). When
    the tier refuses a launch (PipelineLimitError, KernelUnavailable), the op is routed past it and
    this call is served there: by bitsandbytes through `hand_back`, or by the CPU round trip. With `plans` (the
    dispatcher's entry, for a planned op), the call's plan is kept for later calls."""
    bound = bind(op.name, args, kwargs or {})
    op.check(*bound)
    planned = plans is not None and op.planned is not None
    if executor is not None:
        _calls[op.name, executor.name] += 1
        return plans.serve(args, bound, executor, executor.name) if planned else op.kernel(executor, *bound)
    r = route(op.name)
    if r.tier == "cpu":
        _calls[op.name, r.tier] += 1
        executors.notify_slow_tier(op.name, r.tier, r.reason)
        return cpu_fallback.run(op.name, bound)
    try:
        tier_executor = executors.executor_for(_device_type(bound))
        if planned:
            result = plans.serve(args, bound, tier_executor, r.tier)
        else:
            result = op.kernel(tier_executor, *bound)
    except _REFUSALS as refusal:
        return _serve_past_the_tier(op, bound, refusal, hand_back)
    _calls[op.name, r.tier] += 1
    if r.tier != "native":
        executors.notify_slow_tier(op.name, r.tier, r.reason)
    return result


#: what a kernel tier raises, before encoding anything, for a launch it cannot make: the op then takes
#: the next route (routing.refuse)
_REFUSALS = (executors.PipelineLimitError, executors.KernelUnavailable)


def _serve_past_the_tier(op: OpDef, bound: list, refusal: Exception, hand_back: Optional[HandBack]):
    """Route `op` past its kernel tier, which refused one of its launches, and serve this call on
    the new route, from the caller's arguments as they came.

    Serving the whole call again is correct: the refused launch encoded nothing, and every launch
    of an op that comes before another one (the int8 outlier passes, the 32-bit optimizers' norm
    pass) writes only tensors the op allocated for this call; the caller's tensors (optimizer
    states, `out`, parameters) are written by an op's last launch alone, or after it. What the
    earlier launches computed is simply dropped.
    """
    r = routing.refuse(op.name, refusal)
    logger.warning("bnb_mps: %s is served by %s from now on: %s", op.name, r.tier, r.reason)
    if r.tier == "bitsandbytes" and hand_back is not None:
        _calls[op.name, r.tier] += 1
        return hand_back(op.name, r.reason)(*bound)
    _calls[op.name, "cpu"] += 1  # (without `hand_back`, e.g. a direct call(), the round trip serves this call)
    return cpu_fallback.run(op.name, bound)


def _device_type(args: list) -> str:
    for a in args:
        if hasattr(a, "device"):
            return a.device.type
    return "cpu"


def dispatcher_entry(name: str, executor: Optional[executors.Executor] = None, hand_back: Optional[HandBack] = None):
    """The function the dispatcher's kernel for schema `name` forwards to: `f(args, kwargs)`.

    With `executor`, calls run the op's kernel there. Without, calls follow the op's route; on
    the "bitsandbytes" route (and for a schema whose arguments changed) the op is handed back
    with `hand_back`, once, and bitsandbytes' own implementation serves this call and later ones.
    That route can also be taken during a call, when the kernel tier refuses a launch (`call`).

    A planned op (bnb_mps.ops.plan) keeps the plan of each call it served on a kernel tier, keyed by
    the metadata of the call's arguments: a later call with the same key runs that plan at once,
    without binding, checking, routing or planning again (see bnb_mps.ops.plan for why that is as
    strict as checking). The plans are dropped whenever the route may have changed.
    """
    op = OPS[name]
    if executor is None and tuple(arg for arg, _ in argument_spec(name)) != op.params:
        reason = "schema arguments changed: bnb_mps does not know this bitsandbytes version's " + name
        return lambda args, kwargs: hand_back(name, reason)(*args, **kwargs)
    served = _Plans(op, executor)
    plans, skip, dynamic = served.plans, served.skip, served.dynamic

    def entry(args: tuple, kwargs: dict):
        if plans and not kwargs and served.generation == executors.generation and served.epoch == routing.epoch:
            key = _plan.key(args, skip)
            hit = plans.get(key) if key is not None else None
            if hit is not None:  # a call like an earlier one: its plan, at once
                _calls[hit.counted] += 1
                scalars = dynamic(args, hit.plan.dynamic_base) if hit.plan.n_dynamic else ()
                if executor is not None:
                    return hit(args, scalars)
                try:
                    return hit(args, scalars)
                except _REFUSALS as refusal:
                    _calls[hit.counted] -= 1
                    return _serve_past_the_tier(op, bind(name, args, {}), refusal, hand_back)
        if executor is None and hand_back is not None:
            r = route(name)
            if r.tier == "bitsandbytes":
                _calls[name, r.tier] += 1
                executors.notify_slow_tier(name, r.tier, r.reason)
                return hand_back(name, r.reason)(*args, **kwargs)
        return call(op, args, kwargs, executor, hand_back, served if not kwargs and op.planned is not None else None)

    entry.plans = plans  # (what it keeps, for tests and diagnostics)
    return entry


class _Plans:
    """The launch plans of one op's calls on one kernel tier (bnb_mps.ops.plan), keyed by metadata.

    They are bound to the executor that serves the op (the one the op was registered with, e.g. the
    emulated tier for the CPU key, else the one its route gave) and dropped whenever the executors'
    selection (executors.generation) or any route changes (routing.epoch): `routing.forget()` also
    makes them again, e.g. after a benchmark moved a planner's setting (matmul_4bit.GEMV_TABLE)."""

    LIMIT = 1024  # plans kept per op (a caller with ever new shapes must not grow memory without bound)

    def __init__(self, op: OpDef, executor: Optional[executors.Executor]) -> None:
        self.op = op
        self.planned = op.planned
        self.fixed = executor
        self.plans: dict = {}
        self.skip = op.planned.dynamic_positions if op.planned is not None else 0
        self.dynamic = op.planned.dynamic if op.planned is not None else None
        # the tier selection and routes the plans were made under (executors.generation, routing.epoch)
        self.generation = self.epoch = -1

    def serve(self, args: tuple, bound_args: list, executor: executors.Executor, tier: str):
        """Plan a call that passed its checks (arguments as the dispatcher gave them, and bound),
        keep the plan, and run it."""
        plan = self.planned.planner(*bound_args)
        runner = BoundPlan(plan, executor, (self.op.name, tier))
        key = _plan.key(args, self.skip)
        if key is not None:
            now = (executors.generation, routing.epoch)
            if len(self.plans) >= self.LIMIT or (self.generation, self.epoch) != now:
                self.plans.clear()
            self.generation, self.epoch = now
            self.plans[key] = runner
        tup = tuple(bound_args)
        return runner(tup, self.dynamic(tup, plan.dynamic_base) if plan.n_dynamic else ())
