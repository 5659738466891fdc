"""The native tier (bnb_mps._native, csrc/mps_ops.mm).

Here (no Apple SDK) the module cannot be built: these tests cover its Python side (geometry
validation, Scalar -> bytes, which kernel library it loads), the build-time kernel embedding
(compiled with the host C++ compiler), and a syntax check of the Objective-C++ against stand-in
Apple headers. The `mps` tests launch a real kernel on a Mac with the module built.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
import types
from pathlib import Path

import extras
import pytest
import torch

from bnb_mps.msl import source as kernel_source
from bnb_mps.executors import _embed_kernels, native
from bnb_mps.executors.base import ExecutorUnavailable, KernelUnavailable, PipelineLimitError
from bnb_mps.kernel_args import Scalar, float16, float32, int64, uint32
from geometry_kernel import GEOMETRY_KERNEL, GEOMETRY_SCALARS, expected_geometry_output

ROOT = Path(__file__).resolve().parent.parent
HAVE_NATIVE = importlib.util.find_spec("bnb_mps._native") is not None
requires_native_mps = pytest.mark.skipif(
    not (HAVE_NATIVE and torch.backends.mps.is_available()), reason="needs bnb_mps._native and an mps device"
)


class RecordingLibrary:
    """Stands in for a `_native.KernelLibrary` (which needs Metal): records what launch() forwards."""

    origin = "source"

    def __init__(self, simd_width: int = 32, names=("bnb_b", "bnb_a")) -> None:
        self.calls = []
        self.simd_width = simd_width
        self.names = list(names)

    def function_names(self):
        return list(self.names)

    def pipeline_info(self, kernel):
        return {"max_total_threads_per_threadgroup": 1024, "thread_execution_width": self.simd_width,
                "static_threadgroup_memory_length": 0}

    def launch(self, kernel, grid, threadgroup, args, watch=None):
        self.calls.append((kernel, grid, threadgroup, args))
        self.watches = getattr(self, "watches", []) + [watch]


# --- load() here ---------------------------------------------------------------------------------


@pytest.mark.skipif(HAVE_NATIVE, reason="the native library is built here")
def test_load_says_not_built_and_how_to_build():
    with pytest.raises(ExecutorUnavailable) as info:
        native.load()
    message = str(info.value)
    assert "native library not built" in message
    assert "pip install --no-build-isolation -e ." in message
    assert "cmake -DCOMPUTE_BACKEND=mps" in message


# --- the build record: a module built against another torch is refused before import ------------


def write_record(path: Path, version: str, abi: int) -> Path:
    path.write_text(f'{{"torch_version": "{version}", "torch_cxx11_abi": {abi}}}\n')
    return path


def test_build_record_matches_only_the_same_torch_and_abi(tmp_path):
    rec = write_record(tmp_path / native.BUILD_RECORD, "2.13.0", 1)
    assert native.build_mismatch(rec, ("2.13.0", True)) is None
    assert "built against torch 2.13.0" in native.build_mismatch(rec, ("2.14.1", True))
    assert "runs torch 2.13.0 (C++11 ABI 0)" in native.build_mismatch(rec, ("2.13.0", False))
    assert "no build record" in native.build_mismatch(tmp_path / "missing.json", ("2.13.0", True))
    (tmp_path / "bad.json").write_text("{not json")
    assert "unreadable" in native.build_mismatch(tmp_path / "bad.json", ("2.13.0", True))


@pytest.mark.parametrize("record", ["other torch", "missing"])
def test_load_refuses_a_module_built_against_another_torch_before_importing_it(tmp_path, monkeypatch, record):
    """A stand-in built module (its file and build record): load() reads the record first and
    never imports a mismatched module; the reason names both torches and the rebuild command."""
    module_file = tmp_path / "_native.cpython-311-darwin.so"
    module_file.write_bytes(b"")
    if record == "other torch":
        write_record(tmp_path / native.BUILD_RECORD, "2.9.0", 0)
    spec = types.SimpleNamespace(origin=str(module_file))
    monkeypatch.setattr(native.importlib.util, "find_spec", lambda name: spec if name == native.NATIVE_MODULE else None)

    def no_import(name, *a, **k):
        raise AssertionError(f"{name} was imported despite its build record")

    monkeypatch.setattr(native.importlib, "import_module", no_import)
    with pytest.raises(ExecutorUnavailable) as info:
        native.load()
    message = str(info.value)
    assert "does not match this torch" in message and "pip install --no-build-isolation -e ." in message
    if record == "other torch":
        assert "built against torch 2.9.0" in message and f"runs torch {torch.__version__}" in message


def test_load_refuses_a_module_whose_compiled_in_torch_differs(tmp_path, monkeypatch):
    """Belt and braces: a matching record but a module compiled against another torch."""
    module_file = tmp_path / "_native.so"
    module_file.write_bytes(b"")
    version, abi = native.running_torch()
    write_record(tmp_path / native.BUILD_RECORD, version, int(abi))
    monkeypatch.setattr(native.importlib.util, "find_spec", lambda name: types.SimpleNamespace(origin=str(module_file)))
    fake = types.SimpleNamespace(BUILT_WITH_TORCH="1.0.0", BUILT_WITH_CXX11_ABI=abi)
    monkeypatch.setattr(native.importlib, "import_module", lambda name: fake)
    with pytest.raises(ExecutorUnavailable, match="compiled against torch 1.0.0"):
        native.load()


# --- launch(): geometry and arguments ------------------------------------------------------------


def test_launch_forwards_tensors_and_scalar_bytes_in_order():
    lib = RecordingLibrary()
    x = torch.zeros(4)
    scalars = [uint32(2**32 - 1), float16(-2.0), int64(-5), float32(0.1), Scalar(7, "uchar")]
    native.NativeExecutor(lib).launch("k", grid=(4, 1, 2), threadgroup=(64, 2, 1), args=[x, *scalars])
    ((kernel, grid, tg, args),) = lib.calls
    assert (kernel, grid, tg) == ("k", (4, 1, 2), (64, 2, 1))
    assert args[0] is x
    assert args[1:] == [s.to_bytes() for s in scalars]
    assert [len(a) for a in args[1:]] == [4, 2, 8, 4, 1]


def test_a_watched_launch_hands_its_watch_to_the_library_with_the_launch():
    """The watch goes to the library's launch itself (which attaches the completed handler inside the
    launch's own step on the stream's queue), not to a later call."""
    lib, watch = RecordingLibrary(), object()
    ex = native.NativeExecutor(lib)
    ex.launch("k", grid=(2, 1, 1), threadgroup=(32, 1, 1), args=[torch.zeros(2)], watch=watch)
    ex.launch("k", grid=(2, 1, 1), threadgroup=(32, 1, 1), args=[torch.zeros(2)])
    ex.launch("k", grid=(0, 1, 1), threadgroup=(32, 1, 1), args=[torch.zeros(2)], watch=watch)  # nothing to run
    assert [c[:3] for c in lib.calls] == [("k", (2, 1, 1), (32, 1, 1))] * 2 and lib.watches == [watch, None]
    with pytest.raises(ValueError, match="at most 1024"):
        ex.launch("k", grid=(1, 1, 1), threadgroup=(1024, 2, 1), args=[], watch=watch)


def test_a_kept_launch_plan_hands_each_call_the_watch_of_the_moment():
    """A launch prepared before `watching` (a launch plan kept from an earlier call) is given the timing
    watch on the calls made inside it, and none on those after it: the watch is read per call."""
    lib, watch = RecordingLibrary(), object()
    ex = native.NativeExecutor(lib)
    run = ex.prepare("k", (2, 1, 1), (32, 1, 1))
    run((torch.zeros(2),))
    with ex.watching(watch):
        run((torch.zeros(2),))
        ex.prepare("k", (2, 1, 1), (32, 1, 1))((torch.zeros(2),))
    run((torch.zeros(2),))
    assert lib.watches == [None, watch, watch, None]


def test_watching_is_per_thread():
    """Two threads time batches at once (tuning on two threads): each thread's launches get its own
    watch, a launch on a thread outside `watching` gets none, and one thread leaving `watching` does not
    take the other's watch away. The steps interleave in a fixed order (barriers)."""
    import threading

    lib = RecordingLibrary()
    ex = native.NativeExecutor(lib)
    run = ex.prepare("k", (2, 1, 1), (32, 1, 1))
    watches = {"a": object(), "b": object()}
    step = threading.Barrier(2)
    seen: dict = {"a": [], "b": [], "c": []}
    lock = threading.Lock()

    def launch(name, tag):
        with lock:  # (the recording library is not thread-safe; the watch is read before the lock is needed)
            before = len(lib.watches) if hasattr(lib, "watches") else 0
            run((torch.zeros(2),))
            seen[name].append((tag, lib.watches[before]))

    def a():
        with ex.watching(watches["a"]):
            step.wait()  # 1: both inside
            launch("a", 1)
            step.wait()  # 2: b has left
            step.wait()  # 3
            launch("a", 2)
        step.wait()  # 4: a has left, b launches unwatched... and c
        step.wait()  # 5

    def b():
        with ex.watching(watches["b"]):
            step.wait()  # 1
            launch("b", 1)
        step.wait()  # 2
        launch("b", 2)  # (outside watching)
        step.wait()  # 3
        step.wait()  # 4
        launch("b", 3)
        step.wait()  # 5

    threads = [threading.Thread(target=a), threading.Thread(target=b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads)
    assert seen["a"] == [(1, watches["a"]), (2, watches["a"])]
    assert seen["b"] == [(1, watches["b"]), (2, None), (3, None)]
    launch("c", 1)  # (the main thread never watched)
    assert seen["c"] == [(1, None)]


def test_a_prepared_launch_checks_its_geometry_once_and_forwards_its_arguments_as_they_are(monkeypatch):
    """prepare(): what a launch plan keeps. The geometry is checked when the launch is prepared (a
    bad one raises there); each call forwards the arguments object itself, Scalars being their bytes."""
    lib = RecordingLibrary()
    ex = native.NativeExecutor(lib)
    checks = []
    real = native.check_geometry
    monkeypatch.setattr(native, "check_geometry", lambda g, t: checks.append((g, t)) or real(g, t))
    run = ex.prepare("k", [4, 1, 2], (64, 2, 1))
    x = torch.zeros(4)
    for n in range(3):
        args = (x, uint32(n), float16(-2.0))
        run(args)
        assert lib.calls[-1][3] is args
    assert checks == [([4, 1, 2], (64, 2, 1))]
    assert [c[:3] for c in lib.calls] == [("k", (4, 1, 2), (64, 2, 1))] * 3
    assert lib.calls[-1][3][1] == (2).to_bytes(4, "little") and isinstance(lib.calls[-1][3][1], bytes)
    with pytest.raises(ValueError, match="at most 1024"):
        ex.prepare("k", (1, 1, 1), (1024, 2, 1))
    ex.prepare("k", (0, 1, 1), (32, 1, 1))((x,))  # an empty grid: nothing launched
    assert len(lib.calls) == 3


@pytest.mark.parametrize("grid", [(0, 1, 1), (1, 0, 1), (5, 5, 0)])
def test_empty_grid_is_a_no_op(grid):
    lib = RecordingLibrary()
    native.NativeExecutor(lib).launch("k", grid=grid, threadgroup=(32, 1, 1), args=[torch.zeros(1)])
    assert lib.calls == []


@pytest.mark.parametrize("grid", [(1, 1, 1), [2, 3, 4], (65535, 1, 1)])
@pytest.mark.parametrize("threadgroup", [(1, 1, 1), (1024, 1, 1), (32, 32, 1), (8, 8, 16)])
def test_valid_geometry_is_forwarded(grid, threadgroup):
    lib = RecordingLibrary()
    native.NativeExecutor(lib).launch("k", grid=grid, threadgroup=threadgroup, args=[])
    assert lib.calls == [("k", tuple(grid), tuple(threadgroup), [])]


@pytest.mark.parametrize(
    "grid, threadgroup, error, words",
    [
        ((1, 1), (32, 1, 1), ValueError, "grid"),
        ((1, 1, 1, 1), (32, 1, 1), ValueError, "grid"),
        (4, (32, 1, 1), ValueError, "grid"),
        ((-1, 1, 1), (32, 1, 1), ValueError, "grid"),
        ((1.0, 1, 1), (32, 1, 1), TypeError, "grid"),
        ((True, 1, 1), (32, 1, 1), TypeError, "grid"),
        ((1, 1, 1), (32, 1), ValueError, "threadgroup"),
        ((1, 1, 1), (0, 1, 1), ValueError, "threadgroup"),
        ((1, 1, 1), (32, -1, 1), ValueError, "threadgroup"),
        ((1, 1, 1), (1025, 1, 1), ValueError, "1024"),
        ((1, 1, 1), (32, 32, 2), ValueError, "1024"),
        ((1, 1, 1), ("32", 1, 1), TypeError, "threadgroup"),
    ],
)
def test_bad_geometry_is_refused_before_the_library(grid, threadgroup, error, words):
    lib = RecordingLibrary()
    with pytest.raises(error, match=words):
        native.NativeExecutor(lib).launch("k", grid=grid, threadgroup=threadgroup, args=[])
    assert lib.calls == []


# --- which kernel library ------------------------------------------------------------------------


def test_edited_kernels_are_compiled_from_the_current_text(tmp_path):
    metallib = tmp_path / native.METALLIB_NAME
    metallib.write_bytes(b"MTLB")
    assert native.choose_library("old", "new", metallib) == ("source", "new")


def test_unchanged_kernels_prefer_the_prebuilt_metallib(tmp_path):
    metallib = tmp_path / native.METALLIB_NAME
    metallib.write_bytes(b"MTLB")
    assert native.choose_library("same", "same", metallib) == ("metallib", str(metallib))
    assert native.choose_library("same", None, metallib) == ("metallib", str(metallib))


def test_without_metallib_the_embedded_text_is_compiled(tmp_path):
    assert native.choose_library("same", "same", tmp_path / "absent.metallib") == ("source", "same")
    assert native.choose_library("emb", None, None) == ("source", "emb")


def test_no_kernels_anywhere_is_unavailable_with_a_rebuild_hint():
    with pytest.raises(ExecutorUnavailable, match="built without kernel sources.*pip install --no-build-isolation"):
        native.choose_library("", None, None)
    assert native.choose_library("", "fresh", None) == ("source", "fresh")


def fake_native_module(tmp_path, *, embedded="EMB", metallib_ok=True, compile_error=None, language_version=None):
    """A stand-in for the built module: records which loader was called with what. compile_library
    makes a library of the `kernel void <name>(` of its text (the default names for a text without
    any), and raises the Metal compiler's RuntimeError for a text holding `@error <log>` (or for
    every text, with `compile_error`)."""
    calls = []
    libraries = []

    def load_metallib(path):
        calls.append(("metallib", path))
        if not metallib_ok:
            raise RuntimeError("cannot load: Invalid library file")
        library = RecordingLibrary()
        library.origin = "metallib:" + path
        return library

    def compile_library(source):
        calls.append(("compile", source))
        if compile_error is not None:
            raise RuntimeError(compile_error)
        if "@error" in source:
            raise RuntimeError("the Metal compiler rejected the kernel source: " + source.split("@error", 1)[1].strip())
        names = re.findall(r"kernel void (\w+)\(", source)
        libraries.append(RecordingLibrary(names=names) if names else RecordingLibrary())
        return libraries[-1]

    module = types.SimpleNamespace(
        __file__=str(tmp_path / "_native.so"),
        embedded_source=lambda: embedded,
        load_metallib=load_metallib,
        compile_library=compile_library,
        language_version=lambda: language_version,
        libraries=libraries,
    )
    return module, calls


UNITS = {"alpha": "kernel void bnb_alpha_f16() {}\nkernel void bnb_alpha_f32() {}\n",
         "beta": "kernel void bnb_beta() {}\n"}


def installed(monkeypatch, units):
    """Pretend the installation's kernel files are `units` (their amalgamation: "CURRENT")."""
    monkeypatch.setattr(native, "current_kernel_source", lambda: "CURRENT" if units is not None else None)
    monkeypatch.setattr(native, "current_kernel_units", lambda: units)


def test_a_bad_metallib_falls_back_to_compiling_each_unit(tmp_path, monkeypatch):
    installed(monkeypatch, UNITS)
    (tmp_path / native.METALLIB_NAME).write_bytes(b"junk")
    module, calls = fake_native_module(tmp_path, embedded="CURRENT", metallib_ok=False)
    units = native._open_library(module)
    assert calls == [("metallib", str(tmp_path / native.METALLIB_NAME)), ("compile", UNITS["alpha"]),
                     ("compile", UNITS["beta"])]  # fmt: skip
    assert units.unit_of == {"bnb_alpha_f16": "alpha", "bnb_alpha_f32": "alpha", "bnb_beta": "beta"}


def test_the_current_metallib_is_loaded_as_one_library_of_every_kernel(tmp_path, monkeypatch):
    installed(monkeypatch, UNITS)
    (tmp_path / native.METALLIB_NAME).write_bytes(b"MTLB")
    module, calls = fake_native_module(tmp_path, embedded="CURRENT", language_version=(3, 1))
    ex = native.NativeExecutor(native._open_library(module))
    assert calls == [("metallib", str(tmp_path / native.METALLIB_NAME))]
    ex.launch("bnb_a", grid=(1, 1, 1), threadgroup=(1, 1, 1), args=[])
    assert ex._library.calls[0][0] == "bnb_a" and ex.unit_failures == {}


def test_without_kernel_files_the_embedded_text_is_compiled_as_one_unit(tmp_path, monkeypatch):
    installed(monkeypatch, None)
    module, calls = fake_native_module(tmp_path, embedded="EMB")
    units = native._open_library(module)
    assert calls == [("compile", "EMB")] and list(units.libraries) == [native.EMBEDDED_UNIT]


def test_each_unit_is_its_own_library_and_launches_go_to_the_kernels_unit(tmp_path, monkeypatch):
    installed(monkeypatch, UNITS)
    module, _ = fake_native_module(tmp_path, embedded="CURRENT")
    ex = native.NativeExecutor(native._open_library(module))
    alpha, beta = module.libraries
    ex.launch("bnb_beta", grid=(1, 1, 1), threadgroup=(2, 1, 1), args=[uint32(9)])
    ex.launch("bnb_alpha_f32", grid=(3, 1, 1), threadgroup=(4, 1, 1), args=[])
    assert beta.calls == [("bnb_beta", (1, 1, 1), (2, 1, 1), [uint32(9).to_bytes()])]
    assert alpha.calls == [("bnb_alpha_f32", (3, 1, 1), (4, 1, 1), [])]
    assert ex.pipeline_info("bnb_beta")["thread_execution_width"] == 32
    with pytest.raises(ValueError, match="'bnb_gamma' is not in the bnb_mps kernel library"):
        ex.launch("bnb_gamma", grid=(1, 1, 1), threadgroup=(1, 1, 1), args=[])


def test_a_unit_that_does_not_compile_takes_out_only_its_own_kernels(tmp_path, monkeypatch):
    log = "program_source:4:2: error: unknown type name 'flaot'\n" + "note: more\n" * 40
    installed(monkeypatch, {**UNITS, "beta": UNITS["beta"] + "@error " + log})
    module, _ = fake_native_module(tmp_path, embedded="CURRENT")
    ex = native.NativeExecutor(native._open_library(module))  # one unit compiled: the tier stays
    (alpha,) = module.libraries
    assert set(ex.unit_failures) == {"beta"}
    with pytest.raises(KernelUnavailable) as info:
        ex.launch("bnb_beta", grid=(1, 1, 1), threadgroup=(1, 1, 1), args=[])
    assert info.value.units == ("beta",)
    first = str(info.value).splitlines()[0]
    assert "bnb_beta" in first and "beta.metal" in first and "unknown type name 'flaot'" in first
    with pytest.raises(KernelUnavailable):
        ex.pipeline_info("bnb_beta")
    ex.launch("bnb_alpha_f16", grid=(1, 1, 1), threadgroup=(1, 1, 1), args=[])
    assert [c[0] for c in alpha.calls] == ["bnb_alpha_f16"]


def test_the_tier_is_unavailable_when_no_unit_compiles(tmp_path, monkeypatch):
    installed(monkeypatch, {"alpha": "@error a.metal:1:1: error: one", "beta": "@error b.metal:1:1: error: two"})
    module, _ = fake_native_module(tmp_path, embedded="CURRENT")
    with pytest.raises(ExecutorUnavailable) as info:
        native._open_library(module)
    assert "does not compile for Metal" in str(info.value)
    assert "error: one" in str(info.value) and "error: two" in str(info.value)


@pytest.mark.parametrize("version, kind",
                         [((3, 1), "metallib"), (None, "metallib"), ((3, 2), "source"), ((4, 0), "source")])
def test_the_metallib_serves_only_where_the_run_time_compile_would_not_pin_the_math_mode(tmp_path, version, kind):
    """The metallib is Metal 3.1 (the source's math-mode pragmas compiled out); where the run-time
    compile requests 3.2 or later (macOS 15 on) the source is compiled instead."""
    metallib = tmp_path / native.METALLIB_NAME
    metallib.write_bytes(b"MTLB")
    assert native.choose_library("same", "same", metallib, version)[0] == kind


def test_the_run_time_language_version_is_the_modules_answer(tmp_path):
    assert native.runtime_language_version(fake_native_module(tmp_path, language_version=(3, 2))[0]) == (3, 2)
    assert native.runtime_language_version(fake_native_module(tmp_path, language_version=None)[0]) is None
    assert native.runtime_language_version(types.SimpleNamespace()) is None  # a module built before it said


def test_the_compile_requests_metal_3_2_from_macos_15_and_3_1_on_macos_14():
    """What csrc/mps_ops.mm asks of Metal (the syntax check below parses both branches): 3.2 only
    inside the macOS 15 availability check, 3.1 inside the macOS 14 one, and compile() uses it."""
    text = (ROOT / "csrc" / "mps_ops.mm").read_text()
    body = text[text.index("request_language_version(MTLCompileOptions* options) {"):]
    body = body[: body.index("\n}\n")]
    at15, at14 = body.index("@available(macOS 15.0, *)"), body.index("@available(macOS 14.0, *)")
    assert at15 < body.index("MTLLanguageVersion3_2") < at14 < body.index("MTLLanguageVersion3_1")
    compile_body = text[text.index("KernelLibrary::compile(const std::string& source, std::pair<int, int> version) {"):]
    assert "request_language_version(options);" in compile_body[: compile_body.index("\n}\n")]


def _blocks(text: str, opener: str) -> list[str]:
    """The brace-delimited bodies that follow each `opener` in `text`."""
    bodies = []
    at = text.find(opener)
    while at >= 0:
        start = text.index("{", at)
        depth = 0
        for end in range(start, len(text)):
            depth += {"{": 1, "}": -1}.get(text[end], 0)
            if depth == 0:
                break
        bodies.append(text[start : end + 1])
        at = text.find(opener, end)
    return bodies


def test_the_native_layer_throws_only_outside_autorelease_pools():
    """An exception unwinding through @autoreleasepool skips the pool's drain (ARC does not clean up
    for exceptions by default): every throw in csrc/mps_ops.mm comes after its pool is left, and
    the whole launch runs inside one pool."""
    text = (ROOT / "csrc" / "mps_ops.mm").read_text()
    pools = _blocks(text, "@autoreleasepool")
    assert len(pools) >= 5
    for body in pools:  # (metal_device() throws without a device: it is asked before the pool)
        assert "throw " not in body and "rethrow_exception" not in body and "metal_device()" not in body, body[:200]
    launch = text[text.index("void KernelLibrary::launch("):]
    launch = launch[: launch.index("\n}\n")]
    assert "@autoreleasepool" in launch and "encode(kernel, grid, threadgroup, args, watch);" in launch


def test_compiling_and_loading_release_the_gil():
    text = (ROOT / "csrc" / "mps_ops.mm").read_text()
    for name in ('"compile_library"', '"load_metallib"'):
        binding = text[text.index(name):]
        binding = binding[: binding.index("py::arg(")]
        assert "py::gil_scoped_release" in binding, name


@pytest.mark.parametrize("width", [32, 64, 16])
def test_a_gpu_with_another_simd_width_disables_the_tier(tmp_path, monkeypatch, width):
    """Stand-ins for the built module on a GPU reporting `width` lanes per SIMD-group."""
    version, abi = native.running_torch()
    write_record(tmp_path / native.BUILD_RECORD, version, int(abi))
    module = types.SimpleNamespace(
        __file__=str(tmp_path / "_native.so"), BUILT_WITH_TORCH=version, BUILT_WITH_CXX11_ABI=abi,
        embedded_source=lambda: "EMB", compile_library=lambda source: RecordingLibrary(simd_width=width),
    )  # fmt: skip
    monkeypatch.setattr(native.importlib.util, "find_spec", lambda name: types.SimpleNamespace(origin=module.__file__))
    monkeypatch.setattr(native.importlib, "import_module", lambda name: module)
    installed(monkeypatch, None)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    if width == 32:
        assert native.load().name == "native"
    else:
        with pytest.raises(ExecutorUnavailable, match=f"SIMD width of {width}.*written for 32"):
            native.load()


@pytest.mark.parametrize("metallib, runtime, expected",
                         [(True, (3, 1), (3, 1)), (False, (3, 2), (3, 2)), (True, (3, 2), (3, 2)),
                          (False, None, None)])  # fmt: skip
def test_load_records_the_language_version_the_kernels_were_compiled_at(tmp_path, monkeypatch, metallib, runtime,
                                                                        expected):  # fmt: skip
    """The metallib is Metal 3.1; the run-time compile is whatever the module requests (3.2 only from
    macOS 15 with a module built with the macOS 15 SDK or newer; None: the OS compiler's default)."""
    version, abi = native.running_torch()
    write_record(tmp_path / native.BUILD_RECORD, version, int(abi))
    module, _ = fake_native_module(tmp_path, embedded="CURRENT", language_version=runtime)
    module.BUILT_WITH_TORCH, module.BUILT_WITH_CXX11_ABI = version, abi
    if metallib:
        (tmp_path / native.METALLIB_NAME).write_bytes(b"MTLB")
    monkeypatch.setattr(native.importlib.util, "find_spec", lambda name: types.SimpleNamespace(origin=module.__file__))
    monkeypatch.setattr(native.importlib, "import_module", lambda name: module)
    installed(monkeypatch, UNITS)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    ex = native.load()
    assert ex.language_version == expected
    assert ex.origin.startswith("metallib") == (metallib and runtime != (3, 2))


def test_a_compile_error_disables_the_tier_with_the_compiler_message(tmp_path, monkeypatch):
    installed(monkeypatch, None)
    log = "the Metal compiler rejected the kernel source: program_source:3:1: error: unknown type 'flaot'\n"
    module, _ = fake_native_module(tmp_path, compile_error=log + "note\n" * 100)
    with pytest.raises(ExecutorUnavailable) as info:
        native._open_library(module)
    message = str(info.value)
    assert "unknown type 'flaot'" in message
    assert len(message.splitlines()) < 30


# --- build-time embedding ------------------------------------------------------------------------


def _compile_and_dump(header: Path, tmp_path: Path) -> bytes:
    cxx = shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    program = tmp_path / "dump.cpp"
    program.write_text(
        '#include "bnb_mps_kernels_embedded.h"\n#include <cstdio>\n'
        "int main() {\n"
        "  std::fwrite(bnb_mps::kBnbMpsKernelSource, 1, bnb_mps::kBnbMpsKernelSourceSize, stdout);\n"
        "  return bnb_mps::kBnbMpsKernelSource[bnb_mps::kBnbMpsKernelSourceSize] == 0 ? 0 : 3;\n"
        "}\n"
    )
    exe = tmp_path / "dump"
    subprocess.run([cxx, "-std=c++17", f"-I{header.parent}", str(program), "-o", str(exe)], check=True)
    return subprocess.run([str(exe)], check=True, capture_output=True).stdout


def test_embedded_header_holds_exactly_the_amalgamation(tmp_path):
    kernels = tmp_path / "kernels"
    kernels.mkdir()
    (kernels / "common.h").write_text("#pragma once\nconstant float kScale = 0.5f;\n")
    (kernels / "a.metal").write_text('#include "common.h"\nkernel void a(device float* x [[buffer(0)]]) { x[0] = kScale; }\n')
    (kernels / "b.metal").write_text('#include "common.h"\n// quotes " and )" and backslashes \\ survive\nkernel void b() {}\n')
    out = tmp_path / "gen"
    assert _embed_kernels.main(["--kernels", str(kernels), "--header", str(out / "bnb_mps_kernels_embedded.h"),
                                "--metal", str(out / "k.metal")]) == 0
    expected = kernel_source.amalgamate(kernels)
    assert _compile_and_dump(out / "bnb_mps_kernels_embedded.h", tmp_path).decode("ascii") == expected
    assert (out / "k.metal").read_text() == expected


def test_embedded_header_without_kernels_is_empty(tmp_path):
    out = tmp_path / "gen"
    _embed_kernels.main(["--kernels", str(tmp_path / "none"), "--header", str(out / "bnb_mps_kernels_embedded.h")])
    assert _compile_and_dump(out / "bnb_mps_kernels_embedded.h", tmp_path) == b""


def test_unchanged_header_is_not_rewritten(tmp_path):
    header = tmp_path / "bnb_mps_kernels_embedded.h"
    _embed_kernels.main(["--kernels", str(tmp_path / "none"), "--header", str(header)])
    before = header.stat().st_mtime_ns
    _embed_kernels.main(["--kernels", str(tmp_path / "none"), "--header", str(header)])
    assert header.stat().st_mtime_ns == before


# --- Objective-C++ syntax ------------------------------------------------------------------------


def test_native_source_passes_the_syntax_check():
    """clang parses csrc/mps_ops.mm (ObjC++/ARC) against the real torch headers and the stand-in
    Apple headers in tests/native_stubs; see scripts/check_native_syntax.sh for what that proves."""
    extras.require_tool("clang", "clang++")
    result = subprocess.run(
        ["bash", str(ROOT / "scripts" / "check_native_syntax.sh")],
        capture_output=True,
        text=True,
        env={"PYTHON": sys.executable, "PATH": "/usr/bin:/bin:/usr/local/bin"},
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr


# --- on a Mac ------------------------------------------------------------------------------------


@pytest.mark.mps
@requires_native_mps
def test_geometry_scalars_and_offsets_on_the_gpu():
    import bnb_mps._native as _native

    ex = native.NativeExecutor(_native.compile_library(GEOMETRY_KERNEL))
    n = 3 * 2 * 2 * 4 * 2
    storage = torch.full((7 + 5 * n,), -1, dtype=torch.int32, device="mps")
    ex.launch(
        "bnb_test_geometry",
        grid=(3, 2, 2),
        threadgroup=(4, 2, 1),
        args=[storage[7:], *GEOMETRY_SCALARS],
    )
    got = storage.cpu().to(torch.int64) & 0xFFFFFFFF
    expected = expected_geometry_output(n)
    assert torch.equal(got[:7], torch.full((7,), 0xFFFFFFFF, dtype=torch.int64))
    assert torch.equal(got[7:], expected)


@pytest.mark.mps
@requires_native_mps
def test_native_errors_are_python_errors():
    import bnb_mps._native as _native

    lib = _native.compile_library(GEOMETRY_KERNEL)
    info = lib.pipeline_info("bnb_test_geometry")
    assert info["max_total_threads_per_threadgroup"] >= 32 and info["thread_execution_width"] == 32
    with pytest.raises(ValueError, match="nope"):
        lib.launch("nope", (1, 1, 1), (1, 1, 1), [])
    with pytest.raises(ValueError, match="argument 0 .* on cpu"):
        lib.launch("bnb_test_geometry", (1, 1, 1), (1, 1, 1), [torch.zeros(5, dtype=torch.int32)] + [b"\0\0\0\0"] * 4)
    with pytest.raises(RuntimeError, match="rejected"):
        _native.compile_library("kernel void broken( {}")


@pytest.mark.mps
@requires_native_mps
def test_a_threadgroup_above_the_pipelines_maximum_is_a_pipeline_limit_error():
    """The C++ check (the Python geometry check, bypassed here, stops at Metal's 1024) raises the
    executors' own exception class, with the kernel, the threads and the pipeline's maximum."""
    import bnb_mps._native as _native

    lib = _native.compile_library(GEOMETRY_KERNEL)
    maximum = lib.pipeline_info("bnb_test_geometry")["max_total_threads_per_threadgroup"]
    out = torch.zeros(5 * (maximum + 32), dtype=torch.int32, device="mps")  # room for every thread, were it to run
    scalars = [s.to_bytes() for s in GEOMETRY_SCALARS]
    with pytest.raises(PipelineLimitError) as info:
        lib.launch("bnb_test_geometry", (1, 1, 1), (maximum + 32, 1, 1), [out, *scalars])
    assert (info.value.kernel, info.value.threads, info.value.maximum) == ("bnb_test_geometry", maximum + 32, maximum)


@pytest.mark.mps
@requires_native_mps
def test_native_tier_loads_the_project_kernels():
    ex = native.load()
    assert ex.name == "native"
    assert ex.origin == "source" or ex.origin.startswith("metallib:")
    assert ex.unit_failures == {}  # every compile unit compiled
