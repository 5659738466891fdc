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
from .validation import NotCovered
from .routing import Route, route

logger = logging.getLogger("bnb_mps")

__all__ = ["OPS", "NotCovered", "OpDef", "Route", "call", "call_counts", "dispatcher_entry", "not_covered_notes",
           "op_packet", "reset_call_counts", "route"]

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


#: stock(*args) -> bitsandbytes' own implementation of the op for the dispatch key it was registered
#: for (bnb_mps.registration.stock_kernel), or None where bitsandbytes has none
Stock = Optional[Callable[..., object]]

#: (op name, what was not covered) -> the tier that served such calls: one note each (backend_info)
_not_covered: dict[tuple[str, str], str] = {}
_NOTES_PER_OP = 8


def not_covered_notes() -> dict[str, list[str]]:
    """{op: [note, ...]}: the kinds of calls whose arguments bitsandbytes accepts but bnb_mps' kernels
    do not cover, seen in this process, and what served them."""
    out: dict[str, list[str]] = {}
    for (name, what), tier in list(_not_covered.items()):
        out.setdefault(name, []).append(f"calls with {what} are served by {_SERVED_BY[tier]}")
    return out


_SERVED_BY = {"bitsandbytes": "bitsandbytes' own implementation", "cpu": "the CPU round trip"}


def call(op: OpDef, args: tuple, kwargs: Optional[dict] = None, executor: Optional[executors.Executor] = None,
         hand_back: Optional[HandBack] = None, plans: Optional["_Plans"] = None, stock: Stock = None):
    """Serve one call of `op`: its kernel on `executor` when one is given (tests, the emulated
    tier registered for the CPU key), else on its route's tier (kernel or CPU round trip). When
    the tier refuses a launch (PipelineLimitError, KernelUnavailable), the op is routed past it and
    this call is served there: by bitsandbytes through `hand_back`, or by the CPU round trip. A call
    whose arguments bitsandbytes accepts but the kernels do not cover (NotCovered, from the checks
    or the planner) is served by `stock` (bitsandbytes' own implementation), else the CPU round trip.
    With `plans` (the dispatcher's entry, for a planned op), the call's plan is kept for later calls."""
    bound = bind(op.name, args, kwargs or {})
    try:
        op.check(*bound)
    except NotCovered as uncovered:
        return _serve_not_covered(op, bound, uncovered, executor, stock, plans, args)
    planned = plans is not None and op.planned is not None
    if executor is not None:
        try:
            result = plans.serve(args, bound, executor, executor.name) if planned else op.kernel(executor, *bound)
        except NotCovered as uncovered:
            return _serve_not_covered(op, bound, uncovered, executor, stock, plans, args)
        _calls[op.name, executor.name] += 1
        return result
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
    except NotCovered as uncovered:
        return _serve_not_covered(op, bound, uncovered, executor, stock, plans, args)
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


class _Elsewhere:
    """A call signature the kernels do not cover, kept with the launch plans: served by `fn`
    (bitsandbytes' own implementation, or the CPU round trip) with the call's arguments."""

    __slots__ = ("fn", "counted")

    def __init__(self, fn: Callable, counted: tuple) -> None:
        self.fn, self.counted = fn, counted

    def __call__(self, args: tuple):
        return self.fn(*args)


def _serve_not_covered(op: OpDef, bound: list, uncovered: NotCovered, executor, stock: Stock,
                       plans: Optional["_Plans"], args: tuple):  # fmt: skip
    """Serve a call whose arguments bitsandbytes accepts but the kernels do not cover (`uncovered`
    says what): with bitsandbytes' own implementation when there is one (`stock`), else the CPU round
    trip (also when that is the op's route anyway); nothing was launched or allocated for it yet. Kept
    with the launch plans when the call can be (its key holds everything the checks and the planner
    read)."""
    if stock is not None and (executor is not None or route(op.name).tier != "cpu"):
        tier, fn = "bitsandbytes", stock
    else:
        name = op.name
        tier, fn = "cpu", lambda *a: cpu_fallback.run(name, list(a))
    what = str(uncovered)
    if (op.name, what) not in _not_covered and sum(n == op.name for n, _ in _not_covered) < _NOTES_PER_OP:
        _not_covered[op.name, what] = tier
        logger.info("bnb_mps: %s: calls with %s are served by %s", op.name, what, _SERVED_BY[tier])
    _calls[op.name, tier] += 1
    if plans is not None and len(bound) == len(args) and not (op.planned and op.planned.dynamic_positions):
        plans.keep(args, _Elsewhere(fn, (op.name, tier)))
    return fn(*bound)


def _device_type(args: list) -> str:
    for a in args:
        if hasattr(a, "device"):
            return a.device.type
    return "cpu"


def dispatcher_entry(name: str, executor: Optional[executors.Executor] = None, hand_back: Optional[HandBack] = None,
                     stock: Stock = None):  # fmt: skip
    """The function the dispatcher's kernel for schema `name` forwards to: `f(args, kwargs)`.

    With `executor`, calls run the op's kernel there. Without, calls follow the op's route; on
    the "bitsandbytes" route (and for a schema whose arguments changed) the op is handed back
    with `hand_back`, once, and bitsandbytes' own implementation serves this call and later ones.
    That route can also be taken during a call, when the kernel tier refuses a launch (`call`).
    `stock` is bitsandbytes' own implementation for this dispatch key, which serves single calls
    whose arguments the kernels do not cover (`call`).

    A planned op (bnb_mps.ops.plan) keeps what served each call signature on a kernel tier, keyed
    by the metadata of the call's arguments: the call's launch plan, or the implementation that
    serves a signature the kernels do not cover. A later call with the same key is one lookup and
    one call of what was kept, without binding, checking, routing or planning again (see
    bnb_mps.ops.plan for why that is as strict as checking). What is kept is dropped whenever the
    route may have changed.
    """
    op = OPS[name]
    if executor is None and tuple(arg for arg, _ in argument_spec(name)) != op.params:
        reason = "schema arguments changed: bnb_mps does not know this bitsandbytes version's " + name
        return lambda args, kwargs: hand_back(name, reason)(*args, **kwargs)
    served = _Plans(op, executor)
    plans, skip = served.plans, served.skip
    planned = op.planned is not None

    def entry(args: tuple, kwargs: dict):
        if plans and not kwargs and served.generation == executors.generation and served.epoch == routing.epoch:
            key = _plan.key(args, skip)
            hit = plans.get(key) if key is not None else None
            if hit is not None:  # a call like an earlier one: what served it, at once
                _calls[hit.counted] += 1
                try:
                    return hit(args)
                except NotCovered as uncovered:  # (per-call values only: the optimizers' hyperparameters)
                    _calls[hit.counted] -= 1
                    return _serve_not_covered(op, bind(name, args, {}), uncovered, executor, stock, None, args)
                except _REFUSALS as refusal:
                    if executor is not None:
                        raise
                    _calls[hit.counted] -= 1
                    return _serve_past_the_tier(op, bind(name, args, {}), refusal, hand_back)
        if executor is None and hand_back is not None:
            r = route(name)
            if r.tier == "bitsandbytes":
                _calls[name, r.tier] += 1
                executors.notify_slow_tier(name, r.tier, r.reason)
                return hand_back(name, r.reason)(*args, **kwargs)
        return call(op, args, kwargs, executor, hand_back, served if not kwargs and planned else None, stock)

    entry.plans = plans  # (what it keeps, for tests and diagnostics)
    return entry


class _Plans:
    """What serves one op's call signatures on one kernel tier, keyed by metadata: launch plans
    (bnb_mps.ops.plan), and for signatures the kernels do not cover the implementation that serves
    them.

    They are bound to the executor that serves the op (the one the op was registered with, e.g. the
    emulated tier for the CPU key, else the one its route gave) and dropped whenever the executors'
    selection (executors.generation) or any route changes (routing.epoch): `routing.forget()` also
    makes them again, e.g. after a benchmark moved a planner's setting (matmul_4bit.GEMV_TABLE)."""

    LIMIT = 1024  # signatures kept per op (a caller with ever new shapes must not grow memory without bound)

    def __init__(self, op: OpDef, executor: Optional[executors.Executor]) -> None:
        self.op = op
        self.planned = op.planned
        self.fixed = executor
        self.plans: dict = {}
        self.skip = op.planned.dynamic_positions if op.planned is not None else 0
        self.dynamic = op.planned.dynamic if op.planned is not None else None
        # the tier selection and routes the plans were made under (executors.generation, routing.epoch)
        self.generation = self.epoch = -1

    def keep(self, args: tuple, served) -> None:
        """Keep what serves the call signature of `args` (positional arguments as the dispatcher gave them)."""
        key = _plan.key(args, self.skip)
        if key is None:
            return
        now = (executors.generation, routing.epoch)
        if len(self.plans) >= self.LIMIT or (self.generation, self.epoch) != now:
            self.plans.clear()
        self.generation, self.epoch = now
        self.plans[key] = served

    def serve(self, args: tuple, bound_args: list, executor: executors.Executor, tier: str):
        """Plan a call that passed its checks (arguments as the dispatcher gave them, and bound),
        keep the plan, and run it."""
        runner = BoundPlan(self.planned.planner(*bound_args), executor, (self.op.name, tier), self.dynamic)
        self.keep(args, runner)
        return runner(tuple(bound_args))
