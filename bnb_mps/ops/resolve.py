"""How a call signature is served: resolved once, to one callable.

The first call of an op with a new call signature (its arguments' metadata: bnb_mps.ops.plan.key)
comes here from the op's dispatcher entry (bnb_mps.ops), which keeps what `resolve` returns with the
signature: every later call with that key is one lookup and one call of it (bnb_mps.ops.served).
Resolving, in this order:

1. route    where the op goes (bnb_mps.ops.routing, or the executor the op was registered with):
            bitsandbytes' own implementation (the whole op handed back: bitsandbytes then checks its
            calls itself), the CPU round trip, or a kernel tier;
2. checks   the op's argument checks: an error raises. A call whose arguments bitsandbytes accepts
            but bnb-mps' kernels do not cover (NotCovered) is served by the next route (`elsewhere`):
            bitsandbytes' own implementation for the dispatch key, else the CPU round trip;
3. tuning   on a kernel tier, the route of this call's shape among its candidates
            (bnb_mps.ops.candidates: kernel paths and variants, dequantize+linear, bitsandbytes):
            the built-in one, or the fastest measured on this GPU (bnb_mps.ops.tuning);
4. build    the callable of that route for this signature: a launch plan, the dequantize+linear
            composite, bitsandbytes' own implementation (bnb_mps.ops.served).

The built-in route is built first, from the call's own arguments, so a call it does not cover
(NotCovered from its planner) or a launch its tier refuses is found before anything is measured.
A kernel tier that refuses a launch (PipelineLimitError, KernelUnavailable), when a callable is
built or later when it runs, moves the whole op past that tier (`past_the_tier`): a call's kernels
are known only once it is planned, and bitsandbytes takes an op back whole. What raises when a kept
callable runs is handled by `after`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

from .. import executors
from . import candidates, routing, tuning
from .registry import OpDef, bind
from .served import HandedBack, RoundTrip, Stock, Unplanned
from .validation import NotCovered

logger = logging.getLogger("bnb_mps")

#: hand_back(name, reason) -> a callable that runs the op with bitsandbytes' own implementation
#: (given by the registration, which withdraws bnb_mps' kernel for that op)
HandBack = Callable[[str, str], Callable[..., object]]

#: what a kernel tier raises, before encoding anything, for a launch it cannot make
REFUSALS = (executors.PipelineLimitError, executors.KernelUnavailable)


@dataclass(frozen=True)
class Where:
    """What a dispatcher entry knows besides the call: the executor the op was registered with (None:
    its route decides), how the op is handed back to bitsandbytes, and bitsandbytes' own
    implementation for the dispatch key (bnb_mps.registration.stock_kernel), or None."""

    executor: Optional[Any] = None
    hand_back: Optional[HandBack] = None
    stock: Optional[Callable[..., object]] = None


def resolve(op: OpDef, args: tuple, kwargs: dict, where: Where) -> tuple[Any, tuple, bool]:
    """What serves calls with the signature of this call (its arguments as the dispatcher gave them),
    the call's positional arguments for it, and whether it may be kept for every call with that key."""
    bound = bind(op.name, args, kwargs)
    served, keep = _resolve(op, bound, where)
    return served, (args if not kwargs else tuple(bound)), keep and not kwargs


def _resolve(op: OpDef, args: list, where: Where) -> tuple[Any, bool]:
    tier, reason, executor = _route(op, args, where)  # 1. route
    if where.executor is None and tier != "native":
        executors.notify_slow_tier(op.name, tier, reason)
    if tier == "bitsandbytes":  # (the op handed back whole: bitsandbytes checks its calls)
        if where.hand_back is not None:
            return HandedBack(op.name, where.hand_back(op.name, reason)), False
        return (Stock(op.name, where.stock) if where.stock is not None else RoundTrip(op.name)), True
    try:
        op.check(*args)  # 2. checks
    except NotCovered as uncovered:
        return elsewhere(op, uncovered, where, tier), holds_for_signature(op)
    if tier == "cpu":
        return RoundTrip(op.name), True
    if op.planned is None and not candidates.has_other_routes(op, tier):
        return Unplanned(op.name, op.kernel, executor, tier), True
    verified = where.executor is None  # (an executor the op was registered with is taken as it is)
    routes = candidates.of(op, args, executor, tier, where.stock, verified)
    try:
        built = routes.routes[routes.default].build(args)  # (what the call's own arguments allow)
        choice = tuning.choose(routes, tier, executor, verified)  # 3. tuning
        if choice != routes.default:
            built = _build(routes, choice, args, built)  # 4. build
    except NotCovered as uncovered:
        return elsewhere(op, uncovered, where, tier), holds_for_signature(op)
    except REFUSALS as refusal:
        if where.executor is not None:
            raise
        return past_the_tier(op, refusal, where), False
    return built, True


def _route(op: OpDef, args: list, where: Where) -> tuple[str, str, Any]:
    """(tier, why, executor of its kernels) of `op`'s call."""
    if where.executor is not None:
        return where.executor.name, "the executor the op was registered with", where.executor
    r = routing.route(op.name)
    if r.tier in ("bitsandbytes", "cpu"):
        return r.tier, r.reason, None
    device = next((a.device.type for a in args if hasattr(a, "device")), "cpu")
    return r.tier, r.reason, executors.executor_for(device)


def _build(routes: candidates.Candidates, choice: str, args: list, default):
    """`choice` built for the call's signature; the built-in route where it cannot be (it was measured
    on fresh, contiguous inputs of the shape, which a caller's layout may not match)."""
    try:
        return routes.routes[choice].build(args)
    except Exception as e:  # noqa: BLE001
        logger.info("bnb_mps: %s: route %s does not take this call's arguments (%s); the built-in route %s serves it",
                    routes.key, choice, e, routes.default)  # fmt: skip
        return default


def holds_for_signature(op: OpDef) -> bool:
    """Whether what `op`'s checks found depends on the call's metadata alone (so it holds for every call
    with the same key): not for ops with per-call values left out of the key (the optimizers')."""
    return not (op.planned is not None and op.planned.dynamic_positions)


# -- the next route -------------------------------------------------------------------------------------------

#: (op name, what was not covered) -> the tier that served such calls: one note each (backend_info)
_not_covered: dict[tuple[str, str], str] = {}
_NOTES_PER_OP = 8
_SERVED_BY = {"bitsandbytes": "bitsandbytes' own implementation", "cpu": "the CPU round trip"}


def elsewhere(op: OpDef, uncovered: NotCovered, where: Where, tier: str):
    """What serves a call whose arguments bitsandbytes accepts but the kernels do not cover
    (`uncovered` says what): bitsandbytes' own implementation when there is one, else the CPU round
    trip (also when that is the op's route, `tier`, anyway). Nothing was launched or allocated for it."""
    if where.stock is not None and tier != "cpu":
        served = Stock(op.name, where.stock)
    else:
        served = RoundTrip(op.name)
    served_by, what = served.counted[1], str(uncovered)
    if (op.name, what) not in _not_covered and sum(n == op.name for n, _ in _not_covered) < _NOTES_PER_OP:
        _not_covered[op.name, what] = served_by
        logger.info("bnb_mps: %s: calls with %s are served by %s", op.name, what, _SERVED_BY[served_by])
    return served


def forget_notes() -> None:
    _not_covered.clear()


def not_covered_notes() -> dict[str, list[str]]:
    """{op: [note, ...]}: the kinds of calls whose arguments bitsandbytes accepts but bnb_mps' kernels
    do not cover, seen in this process, and what served them."""
    out: dict[str, list[str]] = {}
    for (name, what), tier in list(_not_covered.items()):
        out.setdefault(name, []).append(f"calls with {what} are served by {_SERVED_BY[tier]}")
    return out


def after(op: OpDef, e: Exception, served, where: Where) -> tuple[Any, bool]:
    """The next route of a call whose callable `served` raised `e` before launching anything, and
    whether it holds for every call of that signature: a call it does not cover after all (NotCovered
    from per-call values, the optimizers' hyperparameters, or from an unplanned kernel) is served
    `elsewhere`; a launch the kernel tier refuses moves the op `past_the_tier` (an executor the op was
    registered with raises it)."""
    if isinstance(e, NotCovered):
        return elsewhere(op, e, where, served.counted[1]), holds_for_signature(op)
    if where.executor is not None:
        raise e
    return past_the_tier(op, e, where), False


def past_the_tier(op: OpDef, refusal: Exception, where: Where):
    """Route `op` past its kernel tier, which refused one of its launches (routing.refuse), and return
    what serves its calls there: bitsandbytes through the hand-back, else the CPU round trip.

    Serving the refused call whole on the new route is correct: the refused launch encoded nothing,
    and every launch of an op that comes before another one (the int8 outlier passes, the 32-bit
    optimizers' norm pass) writes only tensors the op allocated for this call; the caller's tensors
    (optimizer states, `out`, parameters) are written by an op's last launch alone, or after it."""
    r = routing.refuse(op.name, refusal)
    logger.warning("bnb_mps: %s is served by %s from now on: %s", op.name, r.tier, r.reason)
    if r.tier == "bitsandbytes" and where.hand_back is not None:
        return HandedBack(op.name, where.hand_back(op.name, r.reason))
    return RoundTrip(op.name)  # (without a hand-back, e.g. a direct call(), the round trip serves)
