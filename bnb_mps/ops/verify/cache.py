"""The on-disk verdicts: one JSON file of {cache key: {family: entry}} per user and machine, kept
with bnb_mps.json_cache (entries of several processes merged under a lock). Read once per process;
a malformed file or entry counts as missing and is rewritten by the next verdict. Never raises: a
cache that cannot be read or written means verifying again next time."""

from __future__ import annotations

import logging
import math
from dataclasses import asdict
from pathlib import Path
from typing import Any, Optional

from ... import json_cache
from .verdicts import Verdict

logger = logging.getLogger("bnb_mps")

CACHE_ENV_VAR = "BNB_MPS_VERIFY_CACHE"


def cache_path() -> Path:
    """$BNB_MPS_VERIFY_CACHE, else $BNB_MPS_CACHE_DIR/verify.json, else ~/.cache/bnb_mps/verify.json."""
    return json_cache.cache_file("verify.json", CACHE_ENV_VAR)


_memo: dict[Path, dict] = {}  # cache file -> its content, read once per process


def read(fresh: bool = False) -> dict:
    """The cache file's content, {key: {family: entry}}; what is not of that shape counts as missing."""
    path = cache_path()
    if fresh or path not in _memo:
        _memo[path] = {k: v for k, v in json_cache.read(path).items() if isinstance(v, dict)}
    return _memo[path]


def cached(key: str, family: str) -> Optional[Verdict]:
    """`family`'s verdict under `key` in the cache file, or None."""
    entry = read().get(key)
    return from_entry(family, entry.get(family)) if isinstance(entry, dict) else None


def store(key: str, verdicts: dict[str, Verdict]) -> None:
    """Adds `verdicts` under `key` to the file, keeping what other processes wrote there."""
    path = cache_path()

    def add(data: dict) -> dict:
        data = {k: v for k, v in data.items() if isinstance(v, dict)}
        data[key] = {**data.get(key, {}), **{name: to_entry(v) for name, v in verdicts.items()}}
        return data

    try:
        _memo[path] = json_cache.update(path, add)
    except Exception as e:  # a read-only home, a full disk, a lock another process keeps
        logger.info("bnb_mps: cannot write the verification cache %s: %s", path, e)


def forget() -> None:
    """Read the file again at the next lookup."""
    _memo.clear()


# The type of each field of a cached entry (bool is not an int here); the optional fields and their defaults.
_ENTRY_FIELDS = {"family": str, "passed": bool, "seconds": float, "case": (str, type(None)),
                 "error": (str, type(None)), "launches": int, "bytes": int}  # fmt: skip
_OPTIONAL = {"skipped": [], "first_failure": None}
_NOT_CACHED = ("cached", "could_not_run", "device_error")  # (a verdict that could not run is never stored)


def to_entry(v: Verdict) -> dict[str, Any]:
    return {k: (list(val) if isinstance(val, tuple) else val) for k, val in asdict(v).items() if k not in _NOT_CACHED}


def from_entry(family: str, entry: Any) -> Optional[Verdict]:
    """The Verdict a cache entry holds, or None where it is not exactly of the shape `to_entry` writes."""
    if not isinstance(entry, dict) or set(entry) - set(_ENTRY_FIELDS) - set(_OPTIONAL):
        return None
    for field_name, kind in _ENTRY_FIELDS.items():
        value = entry.get(field_name)
        if field_name == "seconds" and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if field_name not in entry or isinstance(value, bool) != (kind is bool) or not isinstance(value, kind):
            return None
    skipped, first_failure = (entry.get(k, default) for k, default in _OPTIONAL.items())
    if entry["family"] != family or not isinstance(skipped, list) or not all(isinstance(x, str) for x in skipped):
        return None
    if not isinstance(first_failure, (str, type(None))):
        return None
    if entry["launches"] < 0 or entry["bytes"] < 0 or not math.isfinite(entry["seconds"]):
        return None
    if not entry["passed"] and not (entry["case"] and entry["error"]):
        return None
    fields = {k: entry[k] for k in _ENTRY_FIELDS}
    fields["seconds"] = float(fields["seconds"])
    return Verdict(**fields, cached=True, skipped=tuple(skipped), first_failure=first_failure)
