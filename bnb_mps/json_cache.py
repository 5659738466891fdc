"""A JSON file holding one object, shared by every process of a user on a machine: bnb-mps' caches
(first-use verification's verdicts, bnb_mps.ops.verify) keep their entries in one.

    data = json_cache.read(path)                          # {} when missing, unreadable or not an object
    data = json_cache.update(path, lambda d: {**d, k: v})  # read, change, replace: under a lock

Readers take no lock: a writer never changes the file in place, it writes a temporary file next to
it and renames that over it, so a reader sees the old content or the new, whole. Writers take an
exclusive `fcntl.flock` on a sidecar file (`<path>.lock`) around the read-change-replace, so that
two processes adding entries at once both keep theirs: without it, each would replace the file
with its own read plus its own entry, and the one that renames last would drop the other's.

The lock waits at most `timeout` seconds (a process stuck while holding it must not hang others;
they get TimeoutError and may simply not write). Within one thread, an update of a path whose lock
that thread already holds (a `change` that updates the same file) raises RuntimeError instead of
waiting for itself. Where fcntl does not exist (Windows), updates are serialised within the process
only.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Union

try:
    import fcntl
except ImportError:  # pragma: no cover (not POSIX)
    fcntl = None

PathLike = Union[str, os.PathLike]

#: seconds an update waits for another process's lock before giving up
TIMEOUT = 10.0

_held = threading.local()  # .paths: the files whose lock this thread holds
_in_process = threading.Lock()  # (where there is no fcntl)


def cache_file(name: str, env_var: str | None = None) -> Path:
    """Where a bnb-mps cache file lives: $`env_var` when set (the file itself), else
    $BNB_MPS_CACHE_DIR/`name`, else ~/.cache/bnb_mps/`name`."""
    file = os.environ.get(env_var) if env_var else None
    if file:
        return Path(file).expanduser()
    root = os.environ.get("BNB_MPS_CACHE_DIR")
    return (Path(root) if root else Path.home() / ".cache" / "bnb_mps") / name


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
        if fcntl is None:  # pragma: no cover
            with _in_process:
                yield
            return
        fd = os.open(f"{path}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            _flock(fd, path, timeout)
            try:
                yield
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)
    finally:
        held.discard(key)


def _flock(fd: int, path: Path, timeout: float) -> None:
    """An exclusive flock on `fd`, waiting at most `timeout` seconds."""
    deadline = time.monotonic() + timeout
    delay = 0.001
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{path}: another process held its lock ({path}.lock) for {timeout:g} s") from None
            time.sleep(delay)
            delay = min(delay * 2, 0.05)


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
