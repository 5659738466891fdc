"""Which implementation serves an op called on `mps`, decided per op from what is loaded and
registered, never from tensor data.

In order of preference:
1. bnb_mps' own Metal kernel, on the tier the executors selected (native, shader, or a forced
   emulated tier);
2. bitsandbytes' own implementation that runs on mps: its mps backend kernel, or its
   pure-PyTorch default kernel (route "bitsandbytes"); bnb_mps then withdraws its registration
   for the op so that the dispatcher sends calls there directly;
3. the CPU round trip (route "cpu"): bitsandbytes' CPU implementation with transfers, for ops
   bitsandbytes cannot run on mps at all, or when BNB_MPS_EXECUTOR=cpu forces it.

Where bnb_mps has no GPU tier for an op, bitsandbytes' own implementation serves it; where it has
one, the route of each call's shape on that tier (its kernel paths, dequantize+linear, bitsandbytes'
own implementation) is measured on the user's GPU at first use (bnb_mps.ops.tuning), so that
bnb_mps does not make a shape slower than stock on that machine.

A kernel tier serves an op only once the op's kernel families passed their first-use verification
on this machine (`bnb_mps.ops.verify`); a family that failed sends its ops to route 2 or 3, with the
failing case as the reason.

A route is also changed at run time: when the GPU tier refuses one of an op's launches because the
kernel's pipeline allows fewer threads per threadgroup than the op launches (PipelineLimitError),
the op takes route 2 or 3 from that call on (`refuse`). Verification does not decide this: a case
whose launch the tier refuses is skipped there (recorded in the verdict), so the family keeps
serving, and only an op whose own call meets the limit leaves the tier.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from .. import executors
from . import verify
from .registry import NAMESPACE, OPS

#: tiers an op can be served by, fastest first
TIERS = ("native", "shader", "emulated", "bitsandbytes", "cpu")


@dataclass(frozen=True)
class Route:
    tier: str
    reason: str


_lock = threading.Lock()
_routes: dict[str, Route] = {}
_selection = None  # the executors.Selection the cached routes were computed for
#: changes whenever cached routes are dropped or changed, so that what was planned for a route
#: (bnb_mps.ops' launch plans) is dropped with it
epoch = 0


def bitsandbytes_mps_implementation(name: str) -> str | None:
    """What of bitsandbytes' own would serve schema `name` on mps once bnb_mps' kernel is out of
    the way ("its mps kernel", "its pure-PyTorch default kernel"), or None.

    Read from the dispatcher's registrations while bnb_mps' MPS kernel is registered: another
    MPS kernel then shows as "MPS (inactive)"; a default kernel is registered for
    CompositeExplicitAutograd (or CompositeImplicitAutograd), which serves every device.
    """
    base, _, overload = name.partition(".")
    dump = torch._C._dispatch_dump(f"{NAMESPACE}::{base}" + (f".{overload}" if overload else ""))
    keys = {line.split(":", 1)[0] for line in dump.splitlines()}
    if "MPS (inactive)" in keys:
        return "bitsandbytes' own mps kernel"
    if keys & {"CompositeExplicitAutograd[alias]", "CompositeImplicitAutograd[alias]"}:
        return "bitsandbytes' pure-PyTorch default kernel, on the GPU"
    return None


def _compute(name: str, sel) -> Route:
    op = OPS[name]
    if op.kernel is not None and sel.executor is not None:
        # First use on this tier: the op's kernel families prove themselves here (bnb_mps.ops.verify).
        failed = verify.failure(name, sel.tier, sel.executor)
        if failed is None:
            return Route(sel.tier, sel.reason)
        return _past_our_kernels(name, failed)
    if sel.forced and sel.tier == "cpu":
        return Route("cpu", sel.reason)
    why = "no Metal kernel for this op yet" if op.kernel is None else f"no GPU tier: {sel.reason}"
    return _past_our_kernels(name, why)


def _past_our_kernels(name: str, why: str) -> Route:
    """The route after bnb_mps' kernel tier: bitsandbytes' own mps implementation, else the CPU round trip."""
    theirs = bitsandbytes_mps_implementation(name)
    if theirs is not None:
        return Route("bitsandbytes", f"{why}; {theirs} serves it")
    return Route("cpu", f"{why}; bitsandbytes cannot run it on mps: its CPU implementation, with transfers")


def route(name: str) -> Route:
    """The route of op `name` on mps (cached until the executors' selection changes)."""
    global _selection, epoch
    sel = executors.selection()
    with _lock:
        if sel is not _selection:
            _routes.clear()
            _selection = sel
            epoch += 1
        found = _routes.get(name)
    if found is None:
        computed = _compute(name, sel)  # outside the lock: it may verify a kernel family (seconds)
        with _lock:
            found = _routes.setdefault(name, computed) if sel is _selection else computed
    return found


def forget() -> None:
    """Drop the cached routes (after verification verdicts changed); they are computed again."""
    global epoch
    with _lock:
        _routes.clear()
        epoch += 1


verify.on_stale_routes(forget)  # (routes made while a family's own verification ran: see bnb_mps.ops.verify)


def refuse(name: str, refusal: Exception) -> Route:
    """Route op `name` past its kernel tier, whose executor refused one of the op's launches, and
    return the new route: a kernel's pipeline allows fewer threads per threadgroup than the op
    launches, on this GPU (PipelineLimitError), or the kernel's compile unit did not compile here
    (KernelUnavailable; first-use verification normally finds that first, unless BNB_MPS_VERIFY=0).
    The whole op leaves the tier, not only calls that need that kernel: a call's kernels are known
    only once it launches, and bitsandbytes takes an op back whole. The route holds until the
    executors' selection changes."""
    global epoch
    if isinstance(refusal, executors.PipelineLimitError):
        why = (f"kernel {refusal.kernel}: its pipeline allows at most {refusal.maximum} threads per threadgroup, the "
               f"op launches {refusal.threads}, so the whole op leaves bnb_mps' kernels")
    else:
        why = f"{str(refusal).splitlines()[0]}, so the whole op leaves bnb_mps' kernels"
    found = _past_our_kernels(name, why)
    sel = executors.selection()
    with _lock:
        if sel is _selection:  # (else the cached routes are stale already: nothing to keep)
            _routes[name] = found
        epoch += 1
    return found
