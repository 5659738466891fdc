"""The process's verdicts: each family verified once per process and tier on first use (or read
from the cache), and what routing asks of them (`failure`)."""

from __future__ import annotations

import logging
import os
import threading
import warnings
from typing import Optional

from .cache import _cached, _read_memo, _write_cache
from .families import FAMILIES, families_of
from .machine_key import cache_key, machine
from .runner import first_line
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


_lock = threading.Lock()
_verdicts: dict[tuple[str, int, str, str], Verdict] = {}  # (tier, executor id, cache key, family) -> verdict
_warned = False


def verdict(family: str, tier: str, executor, *, refresh: bool = False) -> Verdict:
    """`family`'s verdict on `tier` (run with `executor`): from this process, else the disk cache
    (unless BNB_MPS_VERIFY=always or `refresh`), else by running it now. Never raises."""
    from ...msl import source
    from . import run_family  # (looked up on the package at each call: tests wrap it there)

    try:
        key = cache_key(tier, source.source_hash(), executor)
    except Exception as e:  # no kernel source to hash, no machine to name: the kernels cannot run either
        return Verdict(family, False, 0.0, "(before the first case)", f"cannot key the verification: "
                       f"{first_line(e)}", could_not_run=True)  # fmt: skip
    memo = (tier, id(executor), key, family)
    with _lock:
        found = None if refresh else _verdicts.get(memo)
        if found is not None:
            return found
        use_cache = not refresh and mode() != "always"
        found = _cached(key, family) if use_cache else None
        if found is None:
            found = run_family(FAMILIES[family], executor, getattr(executor, "device_type", "cpu"))
            if not found.could_not_run:  # (a verification that could not run is tried again next process)
                _write_cache(key, {family: found})
        _verdicts[memo] = found
        return found


def failure(op: str, tier: str, executor) -> Optional[str]:
    """Why `op` must not run on `tier` (a family of it failed verification on this machine), or None.
    Verifies the op's families on first use (BNB_MPS_VERIFY=0: never)."""
    if mode() == "0":
        return None
    for family in families_of(op):
        v = verdict(family, tier, executor)
        if not v.passed:
            try:
                m = machine()
                where = f"{m['gpu']}, {m['os']}, torch {m['torch']}"
            except Exception:  # pragma: no cover
                where = "this machine"
            did = "could not be verified" if v.could_not_run else "failed verification"
            reason = f"the {tier} tier's {family} kernels {did} on this machine ({where}): {v.describe()}"
            _warn_once(reason)
            return reason
    return None


def _warn_once(reason: str) -> None:
    global _warned
    if _warned:
        return
    _warned = True
    warnings.warn(
        f"bnb_mps: {reason}. Its ops are served by the next route instead (see `python -m bnb_mps`). Please run "
        "`bash scripts/mac_acceptance.sh` from a bnb-mps checkout and attach its report to an issue.",
        VerificationWarning,
        stacklevel=4,
    )


def reset() -> None:
    """Forget this process's verdicts (tests; after changing kernels or tiers)."""
    global _warned
    with _lock:
        _verdicts.clear()
        _read_memo.clear()
        _warned = False
