"""The op layer: validate, route, run.

Device-agnostic Python that knows bitsandbytes (schemas, shapes, dtypes) and nothing of Metal.
Importing this package fills `OPS` with every schema bnb_mps serves.

The dispatcher's kernel of an op forwards each call to the op's `dispatcher_entry`. Its first call
with a given call signature (the metadata of its arguments, bnb_mps.ops.plan.key) is resolved to one
callable (bnb_mps.ops.resolve: route, checks, tuning choice, build), which the entry keeps with the
signature; every later call with that key is one lookup and one call of what was kept, whichever
route serves it (bnb_mps.ops.served).
"""

from __future__ import annotations

from collections import Counter
from typing import Optional

from .. import executors
from . import blockwise, fourbit, int8, matmul_4bit, optim  # noqa: F401  (each declares its ops)
from . import resolve as _resolve
from . import routing
from . import plan as _plan
from .registry import OPS, OpDef, argument_spec, op_packet
from .resolve import HandBack, Where, not_covered_notes
from .validation import NotCovered
from .routing import Route, route

__all__ = ["OPS", "NotCovered", "OpDef", "Route", "call", "call_counts", "dispatcher_entry", "not_covered_notes",
           "op_packet", "reset_call_counts", "route"]

_calls: Counter = Counter()  # (op name, tier) -> calls the op layer served


def call_counts() -> dict[str, dict[str, int]]:
    """Calls the op layer served since the last reset: {op: {tier: calls}}. The tier is the
    executor's ("native", "shader", "emulated"), "cpu" (the round trip) or "bitsandbytes" (bitsandbytes'
    own implementation: for one call signature, or for a call handed back; bitsandbytes then serves
    later calls of that op directly, and they are not seen)."""
    out: dict[str, dict[str, int]] = {}
    for (name, tier), n in list(_calls.items()):
        out.setdefault(name, {})[tier] = n
    return out


def reset_call_counts() -> None:
    """Forget the calls counted so far, and the notes of calls the kernels did not cover
    (`not_covered_notes`): both are observations of the calls since the last reset."""
    _calls.clear()
    _resolve.forget_notes()


def call(op: OpDef, args: tuple, kwargs: Optional[dict] = None, executor: Optional[executors.Executor] = None,
         hand_back: Optional[HandBack] = None, stock=None):  # fmt: skip
    """Serve one call of `op` the whole way, keeping nothing: resolve it (bnb_mps.ops.resolve) and run
    what serves it. Its kernels run on `executor` when one is given (tests, the emulated tier
    registered for the CPU key), else on its route's tier; `hand_back` and `stock` as for
    `dispatcher_entry`."""
    where = Where(executor, hand_back, stock)
    served, args, _ = _resolve.resolve(op, args, kwargs or {}, where)
    _calls[served.counted] += 1
    try:
        return served(args)
    except (NotCovered, *_resolve.REFUSALS) as e:
        _calls[served.counted] -= 1
        return _next(op, e, served, args, where, None)


def dispatcher_entry(name: str, executor: Optional[executors.Executor] = None, hand_back: Optional[HandBack] = None,
                     stock=None):  # fmt: skip
    """The function the dispatcher's kernel for schema `name` forwards to: `f(args, kwargs)`.

    With `executor`, calls run the op's kernels there. Without, calls follow the op's route: on the
    "bitsandbytes" route (and for a schema whose arguments changed) the op is handed back with
    `hand_back`, once, and bitsandbytes' own implementation serves this call and later ones. `stock`
    is bitsandbytes' own implementation for this dispatch key: it serves single call signatures
    whose arguments the kernels do not cover, or where tuning measured it fastest.

    What serves each call signature is kept, keyed by the metadata of the call's arguments: a later
    call with the same key is one lookup and one call of what was kept, without binding, checking,
    routing, tuning or planning again (see bnb_mps.ops.plan for why that is as strict as checking).
    What is kept is dropped whenever the route may have changed.
    """
    op = OPS[name]
    if executor is None and tuple(arg for arg, _ in argument_spec(name)) != op.params:
        reason = "schema arguments changed: bnb_mps does not know this bitsandbytes version's " + name
        return lambda args, kwargs: hand_back(name, reason)(*args, **kwargs)
    where = Where(executor, hand_back, stock)
    kept = _Plans(op)
    plans, skip = kept.plans, kept.skip

    def entry(args: tuple, kwargs: dict):
        served = None
        if plans and not kwargs and kept.generation == executors.generation and kept.epoch == routing.epoch:
            key = _plan.key(args, skip)
            served = plans.get(key) if key is not None else None  # a call like an earlier one: what served it
        if served is None:  # a new call signature
            served, args, keep = _resolve.resolve(op, args, kwargs, where)
            if keep:
                kept.keep(args, served)
        _calls[served.counted] += 1
        try:
            return served(args)
        except (NotCovered, *_resolve.REFUSALS) as e:  # (raised before anything was launched)
            _calls[served.counted] -= 1
            return _next(op, e, served, args, where, kept if not kwargs else None)

    entry.plans = plans  # (what it keeps, for tests and diagnostics)
    return entry


def _next(op: OpDef, e: Exception, served, args: tuple, where: Where, kept: Optional["_Plans"]):
    """Serve a call on the next route, where `served` raised `e` before launching anything
    (bnb_mps.ops.resolve.after); keep that route for the signature where it holds for every call."""
    served, holds = _resolve.after(op, e, served, where)
    if holds and kept is not None:
        kept.keep(args, served)
    _calls[served.counted] += 1
    return served(args)


class _Plans:
    """What serves one op's call signatures, keyed by metadata: launch plans (bnb_mps.ops.plan) and
    the other callables a signature resolves to (bnb_mps.ops.served).

    They are dropped whenever the executors' selection (executors.generation: also when the emulated
    tier's Metal language version changes, which changes the kernels a plan may launch) or any route
    (routing.epoch) changes: `routing.forget()` (and bnb_mps.ops.tuning.reset()) makes them again."""

    LIMIT = 1024  # signatures kept per op (a caller with ever new shapes must not grow memory without bound)

    def __init__(self, op: OpDef) -> None:
        self.plans: dict = {}
        self.skip = op.planned.dynamic_positions if op.planned is not None else 0
        self.generation = self.epoch = -1  # the tier selection and routes the plans were made under

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
