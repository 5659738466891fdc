"""The process's verdicts: each family verified once per process and tier on first use (or read
from the cache), and what routing asks of them (`failure`).

A family that does not pass runs a second time, after a synchronisation, in a fresh command buffer
(where the first failure is one a second run may not repeat: `Verdict.worth_a_second_run`). A
GPU fault (a watchdog timeout, a page fault, memory pressure) fails one run; a kernel bug fails
both. So a family that passes its second run serves, its verdict recording the first run's failure;
one that fails twice is cached as failed; one whose runs could not be judged (a device error) fails
in this process only and is verified again in the next.

The lock is reentrant, and a thread verifying a family skips verification for that family's own
ops: a family whose kernels call an op (through the dispatcher, which asks routing, which asks
`failure`) verifies that op's other families on the same thread, and cannot wait for itself. Routes
computed while a family's verdict was still open are computed again once it is known.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
import warnings
from collections.abc import Callable
from typing import Optional

from . import cache
from .cases import Family
from .families import FAMILIES, families_of
from .machine_key import cache_key, machine
from .runner import first_line, synchronize
from .verdicts import VerificationWarning, Verdict

logger = logging.getLogger("bnb_mps")

ENV_VAR = "BNB_MPS_VERIFY"
MODES = ("0", "1", "always")


def mode() -> str:
    value = os.environ.get(ENV_VAR, "1").strip().lower() or "1"
    if value not in MODES:
        logger.warning("bnb_mps: ignoring %s=%r; expected 0, 1 or always", ENV_VAR, value)
        return "1"
    return value


_lock = threading.RLock()
_verdicts: dict[tuple[str, int, str, str], Verdict] = {}  # (tier, executor id, cache key, family) -> verdict
_local = threading.local()  # .running: the families this thread is verifying; .stale_routes: see failure()
_warned = False


def _running() -> list[str]:
    return _local.__dict__.setdefault("running", [])


def verdict(family: str, tier: str, executor, *, refresh: bool = False) -> Verdict:
    """`family`'s verdict on `tier` (run with `executor`): from this process, else the disk cache
    (unless BNB_MPS_VERIFY=always or `refresh`), else by running it now. Never raises."""
    from ...msl import source

    try:
        key = cache_key(tier, source.source_hash(), executor) + _unit_key(FAMILIES[family])
    except Exception as e:  # no kernel source to hash, no machine to name: the kernels cannot run either
        return Verdict(family, False, 0.0, "(before the first case)", f"cannot key the verification: "
                       f"{first_line(e)}", could_not_run=True)  # fmt: skip
    memo = (tier, id(executor), key, family)
    with _lock:
        found = None if refresh else _verdicts.get(memo)
        if found is not None:
            return found
        use_cache = not refresh and mode() != "always"
        found = cache.cached(key, family) if use_cache else None
        if found is None:
            found = _verify(FAMILIES[family], executor, getattr(executor, "device_type", "cpu"))
            if not found.could_not_run:  # (a verification that could not run is tried again next process)
                cache.store(key, {family: found})
        _verdicts[memo] = found
    if not _running() and _local.__dict__.pop("stale_routes", False):
        for listener in _route_listeners:
            listener()
    return found


def _unit_key(family: Family) -> str:
    """What a family of one compile unit adds to its verdict's key: the digest of that unit's text."""
    from ...msl import source

    return "" if family.unit is None else f" | unit {family.unit} {source.source_hash(source.units()[family.unit])}"


_route_listeners: list[Callable[[], None]] = []


def on_stale_routes(listener: Callable[[], None]) -> None:
    """Have `listener()` called when routes made from `failure`'s answers may be stale: an op of a
    family was routed while that family's own verification ran on the thread (see failure()).
    bnb_mps.ops.routing registers its forget()."""
    _route_listeners.append(listener)


def _verify(family: Family, executor, device: str) -> Verdict:
    """`family` run (`run_family`), and once more after a failure a second run may not repeat."""
    from . import run_family  # (looked up on the package at each run: the seam tests wrap, see its docstring)

    running = _running()
    running.append(family.name)
    try:
        first = run_family(family, executor, device)
        if first.passed or not first.worth_a_second_run:
            return first
        with contextlib.suppress(Exception):  # (what the first run left in flight completes, or its error shows
            synchronize(executor)             # in the second run; that run starts a fresh command buffer)
        second = run_family(family, executor, device)
    finally:
        running.pop()
    return dataclasses.replace(second, seconds=first.seconds + second.seconds, launches=first.launches + second.launches,
                               bytes=first.bytes + second.bytes, first_failure=first.describe())  # fmt: skip


def failure(op: str, tier: str, executor) -> Optional[str]:
    """Why `op` must not run on `tier` (a family of it failed verification on this machine), or None.
    Verifies the op's families on first use (BNB_MPS_VERIFY=0: never)."""
    if mode() == "0":
        return None
    for family in families_of(op):
        if family in _running():
            # An op of a family this thread is verifying, called from inside that family's cases: it
            # runs on the tier as part of that verification, whose comparisons judge it. The route
            # made from this answer is dropped once the verdict is known (verdict()).
            _local.stale_routes = True
            continue
        v = verdict(family, tier, executor)
        if not v.passed:
            reason = failed_reason(family, tier, v)
            warn_once(reason, "Its ops are served by the next route instead")
            return reason
    return None


def failed_reason(family: str, tier: str, v: Verdict) -> str:
    """What a family's failed verdict `v` on `tier` says, with the machine it failed on."""
    try:
        m = machine()
        where = f"{m['gpu']}, {m['os']}, torch {m['torch']}"
    except Exception:  # pragma: no cover
        where = "this machine"
    did = "could not be verified" if v.could_not_run else "failed verification"
    return f"the {tier} tier's {family} kernels {did} on this machine ({where}): {v.describe()}"


def warn_once(reason: str, instead: str) -> None:
    """One VerificationWarning per process: the first failure's `reason` and what serves `instead`."""
    global _warned
    if _warned:
        return
    _warned = True
    warnings.warn(
        f"bnb_mps: {reason}. {instead} (see `python -m bnb_mps`). Please run "
        "`bash scripts/mac_acceptance.sh` from a bnb-mps checkout and attach its report to an issue.",
        VerificationWarning,
        stacklevel=4,
    )


def reset() -> None:
    """Forget this process's verdicts (tests; after changing kernels or tiers)."""
    global _warned
    with _lock:
        _verdicts.clear()
        cache.forget()
        _warned = False
