"""Tuning: an op with more than one route takes the fastest verified one on this machine's GPU, per
shape key, measured at first use and kept per machine.

The routes of a call and its shape key come from bnb_mps.ops.candidates. The first time a shape key
is met (in this process, and not in the cache), every candidate route runs on fresh inputs of that
shape, never the caller's tensors, timed on the GPU's clock (bnb_mps.ops.timing: one warm-up, batches
of at least about 1 ms, the median of 5). The built-in route (what serves without tuning) is kept
unless another is faster by more than `MARGIN`; a candidate that raises is dropped, its error kept
for the table. Only candidates whose kernel families passed first-use verification take part
(bnb_mps.ops.verify; all of them with BNB_MPS_VERIFY=0), and none that BNB_MPS_TUNE_EXCLUDE names.
The user's call, and every later call of that key, is then served by the choice.

Choices are cached on disk beside the verification verdicts, under the same key (tier, GPU, macOS,
torch, bitsandbytes, bnb-mps, kernel source hash, math mode: bnb_mps.ops.verify.cache_key), then the
shape key. Writers merge under a lock (bnb_mps.json_cache), so concurrent processes keep each other's
entries.

    BNB_MPS_TUNE=1         measure new shape keys, reuse cached ones (the default on the GPU tiers, for
                           mps tensors)
    BNB_MPS_TUNE=always    measure each shape key again, once per process, and rewrite its entry
    BNB_MPS_TUNE=0         the built-in order (the default elsewhere: CPU timings of emulated kernels
                           mean nothing; set 1 or always to run tuning there anyway, e.g. in tests)
    BNB_MPS_TUNE_CACHE     the cache file (default $BNB_MPS_CACHE_DIR/tune.json, else ~/.cache/bnb_mps/tune.json)
    BNB_MPS_TUNE_EXCLUDE   route names that are never candidates, comma-separated: `dequantize+linear`
                           keeps every 4-bit product free of a temporary as large as its weight

Measuring synchronises with the GPU (once per shape key, at first use), which nothing else on the
native path does.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from .. import json_cache
from ..executors import GPU_TIERS, clocks
from . import timing, verify
from .candidates import Candidate, Candidates
from .verify.runner import first_line

logger = logging.getLogger("bnb_mps")

ENV_VAR = "BNB_MPS_TUNE"
CACHE_ENV_VAR = "BNB_MPS_TUNE_CACHE"
EXCLUDE_ENV_VAR = "BNB_MPS_TUNE_EXCLUDE"
MODES = ("0", "1", "always")
#: the built-in route is kept unless another is faster by more than this (time ratio 1 + MARGIN)
MARGIN = 0.05


@dataclass(frozen=True)
class Decision:
    """The choice for one shape key on one tier of this machine."""

    op: str
    key: str  # the shape key
    choice: str  # the route that serves
    default: str  # the route the built-in order gives
    times: dict  # {route: seconds per call} of every candidate measured (inf: slower than every timed one)
    tier: str
    errors: dict = field(default_factory=dict)  # {route: error} of candidates that raised
    left_out: dict = field(default_factory=dict)  # {route: why} of routes that were no candidates
    clock: str = "gpu"  # "gpu", "host" (figures that mean nothing for a GPU) or "fixed" (testing.fixed_timings)
    seconds: float = 0.0  # wall time the measurement took
    cached: bool = False  # read from the disk cache, not measured in this process

    def row(self) -> dict:
        """The entry `bnb_mps.tuning_table()` returns."""
        return {"op": self.op, "key": self.key, "choice": self.choice, "default": self.default,
                "times": dict(self.times), "cached": self.cached, "tier": self.tier, "errors": dict(self.errors),
                "left_out": dict(self.left_out), "clock": self.clock, "seconds": self.seconds}  # fmt: skip


def decide(times: dict, default: str) -> str:
    """The route to take from measured `times`: the built-in `default` unless another is faster by more
    than MARGIN (the fastest then); the fastest when the default was not measured (it raised)."""
    if not times:
        return default
    best = min(times, key=lambda r: (times[r], r != default))
    if default not in times:
        return best
    return best if times[default] > times[best] * (1 + MARGIN) else default


# -- switches ------------------------------------------------------------------------------------------------

_warned: set = set()


def mode(tier: str, on_gpu: bool) -> str:
    """"0" under torch.use_deterministic_algorithms(True) (every shape takes its built-in route, so two
    machines compute the same bits); else BNB_MPS_TUNE, or where it is not set: "1" on the GPU tiers
    for their own device's tensors (`on_gpu`; and under testing.fixed_timings), else "0"."""
    if torch.are_deterministic_algorithms_enabled():
        return "0"
    value = os.environ.get(ENV_VAR, "").strip().lower()
    if value in MODES:
        return value
    if value and value not in _warned:
        _warned.add(value)
        logger.warning("bnb_mps: ignoring %s=%r; expected 0, 1 or always", ENV_VAR, value)
    return "1" if _fixed is not None or (tier in GPU_TIERS and on_gpu) else "0"


def on_gpu(tier: str, executor, device: torch.device) -> bool:
    """Whether calls with tensors on `device` run on a GPU tier's own device (mps; the CPU tensors that
    stand in for mps ones under bnb_mps.modelled_mps)."""
    return tier in GPU_TIERS and device.type == getattr(executor, "device_type", None)


def clock_for(tier: str, executor, device: torch.device):
    """The clock that times calls of this tier on `device` (bnb_mps.executors.clocks): the executor's
    GPU clock where the calls run on its GPU, else the host's. ClockUnavailable where they run on a
    GPU that cannot time them now (a torch.mps stream other than the default one)."""
    if not on_gpu(tier, executor, device):
        return clocks.HostClock()
    refusal = clocks.gpu_clock_refusal()
    if refusal is not None:
        raise ClockUnavailable(refusal)
    return executor.gpu_clock()


class ClockUnavailable(Exception):
    """No clock can time the calls now: tuning serves the built-in route and keeps nothing."""


def excluded() -> frozenset:
    """The route names BNB_MPS_TUNE_EXCLUDE takes out of the candidates (never the built-in one)."""
    return frozenset(r.strip() for r in os.environ.get(EXCLUDE_ENV_VAR, "").split(",") if r.strip())


def cache_path() -> Path:
    """$BNB_MPS_TUNE_CACHE, else $BNB_MPS_CACHE_DIR/tune.json, else ~/.cache/bnb_mps/tune.json."""
    return json_cache.cache_file("tune.json", CACHE_ENV_VAR)


# -- the process's choices -----------------------------------------------------------------------------------

_lock = threading.RLock()  # (reentrant: measuring a route may call an op whose shape is new too)
_decided: dict[tuple[str, str], Decision] = {}  # (machine key, shape key) -> the decision calls take
_made: dict[tuple[str, str], Decision] = {}  # (machine key, shape key) -> the last decision of this process
_fixed: Optional[dict] = None  # testing.fixed_timings


def choose(c: Candidates, tier: str, executor, verified: bool = True) -> str:
    """The route that serves calls of `c`'s shape key on `tier` (whose kernels run on `executor`).
    `verified`: routes other than the built-in one need their kernel families verified (on the tiers
    that serve mps; not for an executor an op was registered with, e.g. in tests, which is taken as it
    is, its kernels unverified as its built-in route's are).

    Everything first use does (keying, reading the cache, fresh inputs, building and timing the
    candidates, writing the cache) is guarded: whatever raises, the call is served by the built-in
    route, the reason is logged once, and nothing is kept or cached."""
    how = mode(tier, on_gpu(tier, executor, c.device))
    if how == "0" or len(c.routes) < 2:
        return c.default
    try:
        return _choose(c, tier, executor, verified, how)
    except Exception as e:  # noqa: BLE001  (first use must never fail the user's call)
        _note_once(c.key, f"bnb_mps: {c.key}: not tuned, the built-in route {c.default} serves it: {first_line(e)}")
        return c.default


def _choose(c: Candidates, tier: str, executor, verified: bool, how: str) -> str:
    machine = _machine_key(tier, executor)
    with _lock:
        found = _decided.get((machine, c.key))
        if found is not None and (how != "always" or not found.cached):
            offered, _ = _offered(c, tier, executor, verified)
            if found.choice in offered:
                return found.choice
        if how == "1" and _fixed is None:
            found = _from_entry(_cached(machine).get(c.key), c.key, tier)
            if found is not None and found.choice in _offered(c, tier, executor, verified)[0]:
                _decided[machine, c.key] = _made[machine, c.key] = found
                return found.choice
        return _measured(c, tier, executor, verified, machine).choice


_noted: set = set()


def _note_once(key: str, message: str) -> None:
    if key not in _noted:
        _noted.add(key)
        logger.warning(message)


def retune(c: Candidates, tier: str, executor, verified: bool = True) -> Decision:
    """Measures `c`'s shape key now, whatever the process or the cache knows, and keeps the decision
    as `choose` does (for this process and in the cache): what `python -m bnb_mps tune` runs."""
    with _lock:
        return _measured(c, tier, executor, verified, _machine_key(tier, executor))


def _measured(c: Candidates, tier: str, executor, verified: bool, machine: str) -> Decision:
    found = measure(c, tier, executor, verified)
    _decided[machine, c.key] = _made[machine, c.key] = found
    _store(machine, found)
    return found


def measure(c: Candidates, tier: str, executor, verified: bool = True) -> Decision:
    """Times every candidate of `c` on fresh inputs of its shape and decides (`decide`). A candidate
    that raises is dropped (its error kept); a clock that fails (timing.TimingFailed) or that cannot
    time these calls (ClockUnavailable) raises: nothing measured then may be kept."""
    start = time.perf_counter()
    offered, left_out = _offered(c, tier, executor, verified)
    fixed = _fixed
    clock = None if fixed is not None else clock_for(tier, executor, c.device)
    times: dict = {}
    errors: dict = {}
    args = c.fresh()
    for name, route in offered.items():
        try:
            served = route.build(args)
            call = tuple(args)
            if fixed is not None:
                served(call)  # (it runs, so that a route that raises is dropped as when timed)
                times[name] = float(fixed.get(name, math.inf))
            else:
                times[name] = timing.seconds(lambda: served(call), clock)
        except timing.TimingFailed:
            raise
        except Exception as e:  # noqa: BLE001  (a route that cannot serve this shape here is no candidate)
            errors[name] = first_line(e)
    choice = decide(times, c.default)
    decision = Decision(c.op, c.key, choice, c.default, times, tier, errors, left_out,
                        "fixed" if fixed is not None else clock.name, time.perf_counter() - start)  # fmt: skip
    logger.info("bnb_mps: tuned %s on the %s tier: %s (%s) in %.3f s", c.key, tier, choice,
                ", ".join(f"{r} {t:.3g} s" for r, t in times.items()), decision.seconds)  # fmt: skip
    return decision


def _offered(c: Candidates, tier: str, executor, verified: bool) -> tuple[dict[str, Candidate], dict[str, str]]:
    """The candidates of `c`: the built-in route, and each other one whose kernel families passed
    verification on `tier` (where `verified`) and that BNB_MPS_TUNE_EXCLUDE does not name; and
    {route: why} of the rest."""
    offered, left_out = {}, {}
    skip = excluded()
    for name, route in c.routes.items():
        why = None
        if name != c.default:
            if name in skip:
                why = f"excluded by {EXCLUDE_ENV_VAR}"
            elif verified:
                why = verify.unverified(route.families, tier, executor)
        if why is None:
            offered[name] = route
        else:
            left_out[name] = why
    return offered, left_out


# -- the cache -----------------------------------------------------------------------------------------------


def _machine_key(tier: str, executor=None) -> str:
    from ..msl import source

    return verify.cache_key(tier, source.source_hash(), executor)


def _read() -> dict:
    return json_cache.read(cache_path())


def _cached(machine: str) -> dict:
    """The cache's entries for `machine` ({} where the file is missing, unreadable, malformed, or holds
    no object for it): a cache that cannot be read means measuring, never a failed call."""
    entries = _read().get(machine)
    return entries if isinstance(entries, dict) else {}


def _store(machine: str, d: Decision) -> None:
    """Adds `d` to the cache file (merged under its lock). Never raises: a cache that cannot be written
    means measuring again in the next process."""
    entry = {"op": d.op, "choice": d.choice, "default": d.default, "times": _json_times(d.times),
             "errors": dict(d.errors), "clock": d.clock, "seconds": d.seconds}  # fmt: skip

    def change(data: dict) -> dict:
        kept = data.get(machine)
        return {**data, machine: {**(kept if isinstance(kept, dict) else {}), d.key: entry}}

    try:
        json_cache.update(cache_path(), change)
    except Exception as e:  # a read-only home, a full disk, a lock another process kept too long
        logger.info("bnb_mps: cannot write the tuning cache %s: %s", cache_path(), e)


def _json_times(times: dict) -> dict:
    return {r: (t if math.isfinite(t) else None) for r, t in times.items()}


def _from_entry(entry: Any, key: str, tier: str) -> Optional[Decision]:
    """The Decision a cache entry holds, or None where it is not of the shape `_store` writes."""
    if not isinstance(entry, dict):
        return None
    op, choice, default, times = entry.get("op"), entry.get("choice"), entry.get("default"), entry.get("times")
    errors, clock, seconds = entry.get("errors", {}), entry.get("clock", "gpu"), entry.get("seconds", 0.0)
    if not (isinstance(op, str) and isinstance(choice, str) and isinstance(default, str) and isinstance(times, dict)
            and isinstance(errors, dict) and isinstance(clock, str)):  # fmt: skip
        return None
    if not all(isinstance(r, str) and (t is None or _number(t)) for r, t in times.items()) or not _number(seconds):
        return None
    if not all(isinstance(r, str) and isinstance(e, str) for r, e in errors.items()):
        return None
    times = {r: math.inf if t is None else float(t) for r, t in times.items()}
    return Decision(op, key, choice, default, times, tier, dict(errors), {}, clock, float(seconds), cached=True)


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and (math.isfinite(x) or math.isinf(x))


# -- what the process knows, for people ---------------------------------------------------------------------


def table() -> list[dict]:
    """One entry per shape key: this process's decisions (the last of each key), then the cache's for
    this machine and this software (every tier), each once (see Decision.row)."""
    rows: dict = {}
    with _lock:
        for (machine, key), d in _made.items():
            rows[machine, key] = d.row()
    mine = {}
    for tier in ("native", "shader", "emulated"):
        try:
            mine[_machine_key(tier, _executor_of(tier))] = tier
        except Exception:  # (no kernel source: nothing cached can be ours)
            return list(rows.values())
    for machine, entries in _read().items():
        if machine not in mine or not isinstance(entries, dict):
            continue
        for key, entry in entries.items():
            d = _from_entry(entry, key, mine[machine])
            if d is not None and (machine, key) not in rows:
                rows[machine, key] = d.row()
    return list(rows.values())


def _executor_of(tier: str):
    """The executor whose kernels `tier` runs in this process, where one is known without compiling
    anything (the selected tier's; the emulated tier's process-wide executor), else None: what the key
    of its cached choices holds (the kernels' Metal language version)."""
    from .. import executors

    sel = executors.selection()
    if sel.tier == tier:
        return sel.executor
    if tier == "emulated":
        try:
            return executors.load_tier("emulated")
        except Exception:  # noqa: BLE001 (no emulator here: nothing of it cached either)
            return None
    return None


def reset() -> None:
    """Forget this process's choices, which are then made again (from the cache or measured), and the
    op layer's kept callables with them."""
    with _lock:
        _made.clear()
    _forget_choices()


def _forget_choices() -> None:
    """Forget the choices calls take (`table` still lists the decisions this process made)."""
    from . import routing

    with _lock:
        _decided.clear()
    routing.forget()


@contextlib.contextmanager
def fixed(times: dict) -> Iterator[None]:
    """Measurement returns `times[route]` seconds instead of timing (a route missing from it counts as
    slower than every one named); see bnb_mps.testing.fixed_timings."""
    global _fixed
    if not isinstance(times, dict) or not all(isinstance(r, str) for r in times):
        raise TypeError(f"fixed_timings: times must be a dict of route name -> seconds, got {times!r}")
    for r, t in times.items():
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not t >= 0:
            raise ValueError(f"fixed_timings: the time of route {r!r} must be a number of seconds >= 0, got {t!r}")
    with _lock:
        before, _fixed = _fixed, dict(times)
    _forget_choices()
    try:
        yield
    finally:
        with _lock:
            _fixed = before
        _forget_choices()
