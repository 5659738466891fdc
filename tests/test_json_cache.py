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


def python(code: str, *args: str, env: dict | None = None) -> subprocess.Popen:
    """A Python process running `code` with this checkout's bnb_mps, and `env` added to the environment."""
    path = os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(REPO)]))  # (what is set first stays first)
    env = {**os.environ, "PYTHONPATH": path, **(env or {})}
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip


WRITER = """
    import pathlib, sys, time
    from bnb_mps import json_cache
    from bnb_mps.ops import tuning
    from bnb_mps.ops.verify import Verdict, cache
    folder, me, n, writers = pathlib.Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    (folder / f"ready-{me}").touch()  # the start barrier: every writer imported, then all begin at "go"
    while not (folder / "go").exists():
        time.sleep(0.001)
    for i in range(n):
        json_cache.update(folder / "plain.json", lambda data: {**data, f"{me}-{i}": {"i": i}})
        tuning._store(f"machine {int(me) % 2}", tuning.Decision("gemm_4bit", f"key {me} {i}", "mma", "mma",
                                                                {"mma": 1e-3}, "native"))
        cache.store(f"{me} key {i}", {"int8_quant": Verdict("int8_quant", True, 0.5, launches=i)})
"""


def test_processes_updating_at_once_keep_every_entry(tmp_path):
    """The concurrent-writers fault (a lock released before the rename, or none): four processes, held
    at a start barrier until all have imported, each add 30 entries at once to a plain json_cache
    file, to the tuning cache (bnb_mps.ops.tuning, per machine) and to the verification cache
    (bnb_mps.ops.verify): every entry is in each file. (Without the lock, a read-change-replace of one
    process drops what another wrote between its read and its rename: most entries are lost.)"""
    from bnb_mps.ops import tuning
    from bnb_mps.ops.verify import cache

    writers, n = 4, 30
    env = {tuning.CACHE_ENV_VAR: str(tmp_path / "tune.json"), cache.CACHE_ENV_VAR: str(tmp_path / "verify.json")}
    procs = [python(WRITER, str(tmp_path), str(k), str(n), str(writers), env=env) for k in range(writers)]
    deadline = time.monotonic() + 300
    while len(list(tmp_path.glob("ready-*"))) < writers:
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), [p.communicate() for p in procs]
        time.sleep(0.01)
    (tmp_path / "go").touch()
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
    entries = {f"{k}-{i}" for k in range(writers) for i in range(n)}
    data = json_cache.read(tmp_path / "plain.json")
    assert set(data) == entries, f"{len(entries) - len(data)} entries lost"
    tune = json_cache.read(tmp_path / "tune.json")
    assert sorted(tune) == ["machine 0", "machine 1"]
    kept = {k for machine in tune.values() for k in machine}
    assert kept == {f"key {k} {i}" for k in range(writers) for i in range(n)}, f"{writers * n - len(kept)} lost"
    verdicts = json_cache.read(tmp_path / "verify.json")
    assert set(verdicts) == {f"{k} key {i}" for k in range(writers) for i in range(n)}
    assert cache.from_entry("int8_quant", verdicts["2 key 7"]["int8_quant"]).launches == 7
    temporaries = {f.name for f in tmp_path.iterdir()} - {"plain.json", "tune.json", "verify.json", "go"}
    assert {t for t in temporaries if not t.startswith("ready-") and not t.endswith(".lock")} == set()


def test_a_reader_that_opened_the_file_before_an_update_reads_the_old_content_whole(tmp_path):
    """Fault J3: the file written in place instead of replaced. Readers take no lock, so a reader in the
    middle of the file while a writer updates it must still read one whole version: the old one."""
    path = tmp_path / "c.json"
    old = {f"entry {i}": "x" * 100 for i in range(100)}
    json_cache.update(path, lambda d: old)
    with open(path, encoding="utf-8") as f:
        head = f.read(1000)
        json_cache.update(path, lambda d: {"new": 1})
        rest = f.read()
    assert json.loads(head + rest) == old
    assert json_cache.read(path) == {"new": 1}


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
