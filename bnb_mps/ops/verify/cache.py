"""The on-disk verdicts: one JSON file of {cache key: {family: entry}} per machine and user."""

from __future__ import annotations

import json
import logging
import math
import os
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any, Optional

from .verdicts import Verdict

logger = logging.getLogger("bnb_mps")

CACHE_ENV_VAR = "BNB_MPS_VERIFY_CACHE"


def cache_path() -> Path:
    """$BNB_MPS_VERIFY_CACHE, else $BNB_MPS_CACHE_DIR/verify.json, else ~/.cache/bnb_mps/verify.json."""
    file = os.environ.get(CACHE_ENV_VAR)
    if file:
        return Path(file).expanduser()
    root = os.environ.get("BNB_MPS_CACHE_DIR")
    return (Path(root) if root else Path.home() / ".cache" / "bnb_mps") / "verify.json"


_read_memo: dict[Path, dict] = {}  # cache file -> its content, read once per process


def _read_cache(fresh: bool = False) -> dict:
    """The cache file's content, {key: {family: entry}}; what is not of that shape counts as missing."""
    path = cache_path()
    if not fresh and path in _read_memo:
        return _read_memo[path]
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except Exception:  # missing, unreadable, not JSON (any malformed content counts as missing)
        data = {}
    if not isinstance(data, dict):
        data = {}
    data = {k: v for k, v in data.items() if isinstance(v, dict)}
    _read_memo[path] = data
    return data


def _write_cache(key: str, verdicts: dict[str, Verdict]) -> None:
    """Adds `verdicts` under `key` (atomically: a temporary file renamed into place). Never raises:
    a cache that cannot be written means verifying again next time."""
    path = cache_path()
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = {k: dict(v) for k, v in _read_cache(fresh=True).items()}  # (another process may have added some)
        entry = data.setdefault(key, {})
        for name, v in verdicts.items():
            entry[name] = {k: (list(val) if isinstance(val, tuple) else val) for k, val in asdict(v).items()
                           if k not in ("cached", "could_not_run")}  # fmt: skip
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".verify-", suffix=".json")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
        tmp = None
        _read_memo[path] = data
    except Exception as e:  # a read-only home, a full disk, a cache we cannot parse back
        logger.info("bnb_mps: cannot write the verification cache %s: %s", path, e)
    finally:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass


# The type of each field of a cached entry (bool is not an int here).
_ENTRY_FIELDS = {"family": str, "passed": bool, "seconds": float, "case": (str, type(None)),
                 "error": (str, type(None)), "launches": int, "bytes": int}  # fmt: skip


def _from_entry(family: str, entry: Any) -> Optional[Verdict]:
    """The Verdict a cache entry holds, or None where it is not exactly of the shape _write_cache writes."""
    if not isinstance(entry, dict) or set(entry) - set(_ENTRY_FIELDS) - {"skipped"}:
        return None
    for field_name, kind in _ENTRY_FIELDS.items():
        value = entry.get(field_name)
        if field_name == "seconds" and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if field_name not in entry or isinstance(value, bool) != (kind is bool) or not isinstance(value, kind):
            return None
    skipped = entry.get("skipped", [])
    if entry["family"] != family or not isinstance(skipped, list) or not all(isinstance(x, str) for x in skipped):
        return None
    if entry["launches"] < 0 or entry["bytes"] < 0 or not math.isfinite(entry["seconds"]):
        return None
    if not entry["passed"] and not (entry["case"] and entry["error"]):
        return None
    fields = {k: entry[k] for k in _ENTRY_FIELDS}
    fields["seconds"] = float(fields["seconds"])
    return Verdict(**fields, cached=True, skipped=tuple(skipped))


def _cached(key: str, family: str) -> Optional[Verdict]:
    entry = _read_cache().get(key)
    return _from_entry(family, entry.get(family)) if isinstance(entry, dict) else None
