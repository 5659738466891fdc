"""A JSON file holding one object, shared by every process of a user on a machine: bnb-mps' caches
(first-use verification's verdicts, bnb_mps.ops.verify) keep their entries in one.

    data = json_cache.read(path)                          # {} when missing, unreadable or not an object
    data = json_cache.update(path, lambda d: {**d, k: v})  # read, change, replace: under a lock

Readers take no lock: a writer never changes the file in place, it writes a temporary file next to
it and renames that over it, so a reader sees the old content or the new, whole. Writers hold an
exclusive lock on a sidecar file (`<path>.lock`, the `filelock` package: `flock` on POSIX) around
the read-change-replace, so that two processes adding entries at once both keep theirs: without it,
each would replace the file with its own read plus its own entry, and the one that renames last
would drop the other's.

The lock waits at most `timeout` seconds (a process stuck while holding it must not hang others;
they get TimeoutError and may simply not write). Within one thread, an update of a path whose lock
that thread already holds (a `change` that updates the same file) raises RuntimeError instead of
waiting for itself.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Union

import filelock

PathLike = Union[str, os.PathLike]

#: seconds an update waits for another process's lock before giving up
TIMEOUT = 10.0

_held = threading.local()  # .paths: the files whose lock this thread holds


def cache_root() -> Path:
    """The folder of bnb-mps' caches: $BNB_MPS_CACHE_DIR, else ~/.cache/bnb_mps."""
    root = os.environ.get("BNB_MPS_CACHE_DIR")
    return Path(root).expanduser() if root else Path.home() / ".cache" / "bnb_mps"


def cache_file(name: str, env_var: str | None = None) -> Path:
    """Where a bnb-mps cache file lives: $`env_var` when set (the file itself), else
    `cache_root()`/`name`."""
    file = os.environ.get(env_var) if env_var else None
    if file:
        return Path(file).expanduser()
    return cache_root() / name


def read(path: PathLike) -> dict[str, Any]:
    """The object the file holds; {} when it is missing, unreadable, not JSON or not an object."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except Exception:  # (any malformed content counts as missing; it is rewritten by the next update)
        return {}
    return data if isinstance(data, dict) else {}


def update(path: PathLike, change: Callable[[dict[str, Any]], dict[str, Any]], *,
           timeout: float = TIMEOUT) -> dict[str, Any]:  # fmt: skip
    """Under the file's lock: read it (`read`), `change` what it holds, and replace the file with
    what `change` returns (an object that json can write); returns that. Creates the directory.
    Raises what the file system raises (a read-only home, a full disk), TimeoutError when another
    process held the lock for `timeout` seconds, RuntimeError for an update inside an update of the
    same file on the same thread, TypeError when `change` returns no dict."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with _locked(path, timeout):
        data = change(read(path))
        if not isinstance(data, dict):
            raise TypeError(f"json_cache.update: change() must return a dict, got {type(data).__name__}")
        _replace(path, data)
    return data


@contextlib.contextmanager
def _locked(path: Path, timeout: float) -> Iterator[None]:
    held = _held.__dict__.setdefault("paths", set())
    key = os.path.abspath(path)
    if key in held:
        raise RuntimeError(f"json_cache.update of {path} inside an update of the same file on this thread")
    held.add(key)
    try:
        lock = filelock.FileLock(f"{path}.lock")
        try:
            lock.acquire(timeout=timeout, poll_interval=0.01)
        except filelock.Timeout:
            raise TimeoutError(f"{path}: another process held its lock ({path}.lock) for {timeout:g} s") from None
        try:
            yield
        finally:
            lock.release()
    finally:
        held.discard(key)


def _replace(path: Path, data: dict[str, Any]) -> None:
    """Writes `data` to a temporary file next to `path` and renames it over `path`."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}-", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
