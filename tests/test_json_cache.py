"""bnb_mps.json_cache: a JSON file that several processes update at once without losing each other's
entries (read-change-replace under an fcntl lock on a sidecar file), and that never hangs its caller."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from bnb_mps import json_cache

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="fcntl: POSIX only")

REPO = Path(__file__).resolve().parents[1]


def python(code: str, *args: str) -> subprocess.Popen:
    """A Python process running `code` with this checkout's bnb_mps (its json_cache needs nothing else)."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip


WRITER = """
    import sys, time
    from bnb_mps import json_cache
    path, name, n, start = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
    while time.time() < start:  # (all writers begin together)
        time.sleep(0.001)
    for i in range(n):
        json_cache.update(path, lambda data: {**data, f"{name}-{i}": {"i": i}})
"""


def test_processes_updating_at_once_keep_every_entry(tmp_path):
    """Four processes each add 40 entries at the same time: all 160 are in the file. (Without the lock,
    a read-change-replace of one process drops what another wrote between its read and its rename.)"""
    path = tmp_path / "cache.json"
    start = time.time() + 2.0
    procs = [python(WRITER, str(path), f"p{k}", "40", str(start)) for k in range(4)]
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
    data = json_cache.read(path)
    assert set(data) == {f"p{k}-{i}" for k in range(4) for i in range(40)}, f"{160 - len(data)} entries lost"
    assert not [f for f in tmp_path.iterdir() if f.name not in ("cache.json", "cache.json.lock")]  # no temporaries


def test_read_takes_anything_malformed_for_empty(tmp_path):
    path = tmp_path / "c.json"
    assert json_cache.read(path) == {}  # missing
    for content in (b"\x00\xff{", b"[1, 2]", b'"text"', b"[" * 100_000, b'{"a": 1'):
        path.write_bytes(content)
        assert json_cache.read(path) == {}
    path.write_text('{"a": {"b": 1}}')
    assert json_cache.read(path) == {"a": {"b": 1}}


def test_update_replaces_malformed_content_and_returns_what_it_wrote(tmp_path):
    path = tmp_path / "sub" / "dir" / "c.json"  # (the directories are made)
    assert json_cache.update(path, lambda d: {**d, "x": 1}) == {"x": 1}
    path.write_bytes(b"not json")
    assert json_cache.update(path, lambda d: {**d, "y": [1, 2]}) == {"y": [1, 2]}
    assert json.loads(path.read_text()) == {"y": [1, 2]}


def test_a_failed_change_leaves_the_file_as_it_was(tmp_path):
    path = tmp_path / "c.json"
    json_cache.update(path, lambda d: {"kept": True})

    def boom(data):
        raise ValueError("no")

    with pytest.raises(ValueError):
        json_cache.update(path, boom)
    with pytest.raises(TypeError, match="must return a dict"):
        json_cache.update(path, lambda d: [1])
    with pytest.raises(TypeError):
        json_cache.update(path, lambda d: {"not json": object()})
    assert json_cache.read(path) == {"kept": True}
    assert sorted(f.name for f in tmp_path.iterdir()) == ["c.json", "c.json.lock"]


def test_an_update_inside_an_update_of_the_same_file_raises_instead_of_waiting_for_itself(tmp_path):
    path, other = tmp_path / "c.json", tmp_path / "d.json"

    def nested(data):
        json_cache.update(other, lambda d: {"other": 1})  # another file: fine
        json_cache.update(path, lambda d: d)  # the same file, on the same thread
        return data

    with pytest.raises(RuntimeError, match="inside an update of the same file"):
        json_cache.update(path, nested)
    assert json_cache.read(other) == {"other": 1}
    assert json_cache.update(path, lambda d: {"after": 1}) == {"after": 1}  # the lock was released


HOLDER = """
    import fcntl, os, sys, time
    fd = os.open(sys.argv[1] + ".lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    print("held", flush=True)
    time.sleep(float(sys.argv[2]))
"""


def test_a_lock_held_by_another_process_is_waited_for_and_then_given_up(tmp_path):
    path = tmp_path / "c.json"
    holder = python(HOLDER, str(path), "3")
    assert holder.stdout.readline().strip() == "held"
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="another process held its lock"):
        json_cache.update(path, lambda d: {"x": 1}, timeout=0.5)
    assert 0.4 < time.monotonic() - start < 2.5
    assert json_cache.update(path, lambda d: {"x": 1}, timeout=30) == {"x": 1}  # once the holder exits
    holder.communicate(timeout=30)


def test_cache_file_locations(monkeypatch, tmp_path):
    monkeypatch.setenv("SOME_CACHE", str(tmp_path / "f.json"))
    monkeypatch.setenv("BNB_MPS_CACHE_DIR", str(tmp_path / "dir"))
    assert json_cache.cache_file("x.json", "SOME_CACHE") == tmp_path / "f.json"
    assert json_cache.cache_file("x.json") == tmp_path / "dir" / "x.json"
    monkeypatch.delenv("BNB_MPS_CACHE_DIR")
    assert json_cache.cache_file("x.json", "UNSET_VARIABLE") == Path.home() / ".cache" / "bnb_mps" / "x.json"
