"""The native tier: kernels through the Objective-C++ library `bnb_mps._native` (csrc/mps_ops.mm).

The library is built on macOS with `COMPUTE_BACKEND=mps`. It holds the kernel amalgamation as of
the build (and, when Xcode's `metal` was present, a prebuilt `bnb_mps_kernels.metallib` of it),
compiles Metal source with safe math (`compile_library(text)`), caches pipelines and encodes on
PyTorch's MPS stream. This module decides which kernels to load and validates launch geometry
(once per launch plan: `prepare`); everything else happens in C++, which takes the launch's
arguments as they are (tensors, and Scalars, which are bytes).

Which kernels (`choose_library`): the offline metallib, one library of every kernel, where it is
current (built from the kernel files installed now) and the run-time compile would request the same
Metal language version it was built for (3.1); otherwise the kernel source, compiled at first use one
compile unit at a time (`bnb_mps.msl.source.units()`, one per `.metal` file; one `compile_library`
each, the kernel names mapped here to the library of their unit). A unit that does not compile makes
only its own kernels unavailable (their launches raise KernelUnavailable with the compiler's
message); the tier is unavailable only when no unit compiles. A metallib that does not load falls
back to the units. Only an installation without kernel files (which the package layout never
produces) compiles the amalgamation embedded at build time, as one unit. `language_version` says
which Metal language version the tier's kernels were compiled at (`python -m bnb_mps` shows it).

Math mode (what each path asks of Metal; none of it has been run on a Mac yet). The run-time compile's
language version follows the SDK the module was built with as well as the OS: Metal 3.2 needs the
macOS 15 SDK at build time (MTLLanguageVersion3_2) and macOS 15 at run time; a module built with an
older SDK requests 3.1 on every macOS.
- run-time compile at Metal 3.2 (macOS 15 and later, module built with the macOS 15 SDK or newer):
  mathMode safe and precise math functions, and the kernel source's `#pragma METAL fp
  math_mode(safe)` / `contract(off)` (csrc/kernels/bnb_math_mode.h);
- run-time compile at Metal 3.1 (macOS 14, or a module built with an older SDK): fastMathEnabled = NO
  (safe math);
- offline metallib: -std=metal3.1 -fno-fast-math, and -ffp-contract=off where the toolchain takes it
  (csrc/metal_toolchain.cmake); loaded where the run-time compile would request 3.1 as well.
At every version the source's unconditional `#pragma clang fp contract(off)` (bnb_math_mode.h) keeps
a * b + c from being contracted into a fused multiply-add, and the kernels call only
`metal::precise::` math functions, so 3.1 and 3.2 compute the same bits.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import json
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Optional

import torch

from ..msl import source as kernel_source
from . import clocks
from ._gpu_common import check_geometry, check_simd_width, mps_unavailable_reason
from .base import CompileUnits, Dim3, ExecutorUnavailable, KernelArg, first_lines

BUILD_HINT = (
    "on an Apple Silicon Mac, from the bnb-mps source checkout with torch installed, run "
    "`pip install --no-build-isolation -e .` "
    "(or `cmake -DCOMPUTE_BACKEND=mps -B build . && cmake --build build`)"
)
METALLIB_NAME = "bnb_mps_kernels.metallib"
NATIVE_MODULE = "bnb_mps._native"
#: written next to the module by the build (csrc/mps.cmake): the torch it was compiled against
BUILD_RECORD = "_native_build.json"
#: The Metal language version of the offline metallib (csrc/metal_toolchain.cmake: -std=metal3.1),
#: and the first one at which the kernel source pins its math mode (csrc/kernels/bnb_math_mode.h).
METALLIB_LANGUAGE_VERSION = (3, 1)
PINNED_MATH_LANGUAGE_VERSION = (3, 2)
#: The unit name of the amalgamation embedded at build time, compiled only where no kernel files are
#: installed (the name of the file the build writes it to, bnb_mps_kernels.metal).
EMBEDDED_UNIT = "bnb_mps_kernels"


class NativeExecutor:
    name = "native"
    device_type = "mps"  # where its tensors live

    def __init__(self, library, watch=None) -> None:
        """`library`: the compiled units (CompileUnits of `_native.KernelLibrary` objects), or one
        KernelLibrary that holds every kernel (the offline metallib; a library compiled from one
        text). A kernel in neither goes to that one library, which raises ValueError naming it.
        `watch`: `_native.CommandBufferWatch`, what `watch_command_buffers` makes."""
        #: the Metal language version the kernels were compiled at, (major, minor), or None for the
        #: OS compiler's default (set by `load`)
        self.language_version: Optional[tuple[int, int]] = None
        self._watch = watch
        self._timing = threading.local()  # .watch: what `watching` gives this thread's launches for now
        if isinstance(library, CompileUnits):
            self._units: Optional[CompileUnits] = library
            self.origin: str = "source"
            # kernel -> its unit library's launch, bound once: one dict lookup per launch
            self._launchers = {kernel: library.libraries[unit].launch for kernel, unit in library.unit_of.items()}
            self._other = self._unknown
        else:
            self._units = None
            self.origin = library.origin
            self._launchers = {}
            self._other = library.launch
            self._library = library

    @property
    def unit_failures(self) -> dict[str, str]:
        """The compile units that did not compile here, with the compiler's message."""
        return dict(self._units.failures) if self._units is not None else {}

    def _unknown(self, kernel: str, *_) -> None:
        unavailable = self._units.unavailable(kernel)
        if unavailable is not None:
            raise unavailable
        raise ValueError(f"kernel {kernel!r} is not in the bnb_mps kernel library ({self.origin})")

    def launch(self, kernel: str, *, grid: Dim3, threadgroup: Dim3, args: Sequence[KernelArg], watch=None) -> None:
        """`watch` (from `watch_command_buffers`): its completed handler goes to the command buffer
        that holds this launch, attached in the launch's own step on the stream's queue."""
        if watch is None:
            self.prepare(kernel, grid, threadgroup)(args)
        elif check_geometry(grid, threadgroup):
            self._launchers.get(kernel, self._other)(kernel, tuple(grid), tuple(threadgroup), args, watch)

    def prepare(self, kernel: str, grid: Dim3, threadgroup: Dim3) -> Callable[[Sequence[KernelArg]], None]:
        """The launch of `kernel` with this geometry as a function of its arguments, the geometry
        checked once, here (the op layer keeps it for every call of a launch plan). The arguments go
        to C++ as they are: tensors, bound at storage_offset * element_size after a check that they
        are on mps, and Scalars, which are their exact bytes (setBytes). The C++ side raises
        PipelineLimitError before encoding when the pipeline allows fewer threads than asked."""
        if not check_geometry(grid, threadgroup):
            return _nothing
        launch = self._launchers.get(kernel, self._other)
        grid, threadgroup = tuple(grid), tuple(threadgroup)

        timing = self._timing

        def launch_prepared(args) -> None:
            watch = getattr(timing, "watch", None)  # (read per call: None but inside `watching` on this thread)
            if watch is None:
                launch(kernel, grid, threadgroup, args)
            else:
                launch(kernel, grid, threadgroup, args, watch)

        return launch_prepared

    @contextlib.contextmanager
    def watching(self, watch) -> Iterator[None]:
        """While it lasts, every launch of this executor made on this thread (those of kept launch plans
        included) is given `watch` (from `watch_command_buffers`): the GPU clock of tuning
        (clocks.CommandBufferClock). Per thread: another thread's launches keep their own watch, or none."""
        before = getattr(self._timing, "watch", None)
        self._timing.watch = watch
        try:
            yield
        finally:
            self._timing.watch = before

    def synchronize(self) -> None:
        """Waits until the GPU ran everything encoded so far (torch.mps.synchronize)."""
        torch.mps.synchronize()

    def gpu_clock(self):
        """The clock that times a batch of this tier's calls on the GPU (bnb_mps.executors.clocks):
        the watched command buffers' GPU start and end times where the module reads them, else torch's
        timing events."""
        if self._watch is not None and hasattr(self._watch, "gpu_times"):
            return clocks.CommandBufferClock(self)
        return clocks.EventClock()

    def watch_command_buffers(self):
        """A new `_native.CommandBufferWatch` (csrc/mps_ops.h): a launch given it (`launch(...,
        watch=)`) has the command buffer that holds it watched; after a synchronisation `errors()`
        lists Metal's error of each watched buffer that failed, and then `gpu_times()` the
        (GPUStartTime, GPUEndTime) pair of each, in seconds. None where the module has none."""
        return self._watch() if self._watch is not None else None

    def pipeline_info(self, kernel: str) -> dict:
        """Metal's limits for `kernel`: max_total_threads_per_threadgroup, thread_execution_width,
        static_threadgroup_memory_length."""
        if self._units is None:
            return self._library.pipeline_info(kernel)
        try:
            library = self._units.library_of(kernel)
        except KeyError:
            self._unknown(kernel)
        return library.pipeline_info(kernel)


def _nothing(args) -> None:
    """The launch of an empty grid."""


def current_kernel_source() -> str | None:
    """The kernel source in this installation now, or None when it has no kernel files."""
    try:
        return kernel_source.source()
    except FileNotFoundError:
        return None


def current_kernel_units() -> Mapping[str, str] | None:
    """The compile units of the kernel source in this installation now, or None without kernel files."""
    try:
        return kernel_source.units()
    except FileNotFoundError:
        return None


def runtime_language_version(native) -> tuple[int, int] | None:
    """The Metal language version the module's `compile_library` requests on this OS, (major,
    minor), or None for the OS's default (or a module too old to say)."""
    ask = getattr(native, "language_version", None)
    version = ask() if ask is not None else None
    return tuple(version) if version else None


def choose_library(embedded: str, current: str | None, metallib: Path | None,
                   runtime_version: tuple[int, int] | None = None) -> tuple[str, str]:
    """Which kernel library the native tier loads: ("metallib", path) or ("source", text).

    The native tier must run the same kernels as every other tier. When the installation's kernel
    files differ from what the library embedded at build time (kernels edited in a checkout since
    the last build), compile the current text; otherwise prefer the prebuilt metallib (built
    from the embedded text), then the embedded text. The metallib is built for Metal 3.1, where
    the source's `#pragma METAL fp` lines are compiled out (its no-contraction pragma is not): where
    the run-time compile requests a version that has them (`runtime_version` >= 3.2: macOS 15 and a
    module built with the macOS 15 SDK or newer), the source is compiled instead, so that the tier
    never runs at a lower version than it could.
    ("source" is compiled one compile unit at a time from the installed files, see `_open_library`.)
    """
    if current is not None and current != embedded:
        return ("source", current)
    if not embedded:
        raise ExecutorUnavailable(
            "the native library was built without kernel sources (csrc/kernels had no .metal "
            f"files at build time) and none are installed now; rebuild it: {BUILD_HINT}"
        )
    # (the run-time compile pins the math mode, the metallib's language version does not)
    pins_more = runtime_version is not None and tuple(runtime_version) >= PINNED_MATH_LANGUAGE_VERSION > \
        METALLIB_LANGUAGE_VERSION
    if metallib is not None and metallib.is_file() and not pins_more:
        return ("metallib", str(metallib))
    return ("source", embedded)


def _open_library(native):
    """The metallib (one KernelLibrary), or the compile units (CompileUnits)."""
    embedded = native.embedded_source()
    try:
        current = current_kernel_source()
        units = current_kernel_units() if current is not None else None
    except (OSError, ValueError) as e:
        raise ExecutorUnavailable(f"cannot read the kernel sources: {e}") from None
    kind, what = choose_library(embedded, current, Path(native.__file__).with_name(METALLIB_NAME),
                                runtime_language_version(native))  # fmt: skip
    if kind == "metallib":
        try:
            return native.load_metallib(what)
        except RuntimeError:
            pass  # a stale or foreign metallib: the source is the same kernels
    if units is None:  # no kernel files installed: the text embedded at build time, as one unit
        units = {EMBEDDED_UNIT: embedded}
    compiled = CompileUnits.compile(units, lambda name, text: native.compile_library(text),
                                    lambda library: library.function_names(), (RuntimeError, ValueError))  # fmt: skip
    if not compiled.libraries:
        raise ExecutorUnavailable(
            f"the kernel source does not compile for Metal (no compile unit does):\n"
            f"{first_lines(compiled.describe_failures())}"
        )
    return compiled


def running_torch() -> tuple[str, bool]:
    """(version, C++11 ABI) of the torch in this process."""
    return torch.__version__, bool(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", False))


def build_mismatch(record_path: Path, running: tuple[str, bool]) -> str | None:
    """Why a native module with this build record must not be loaded with the `running` torch
    (version, C++11 ABI), or None when it matches. A module compiled against one torch links to
    that torch's C++ symbols: with another one it fails to load, or worse, misbehaves."""
    try:
        record = json.loads(record_path.read_text(encoding="utf-8"))
        built = (str(record["torch_version"]), bool(record["torch_cxx11_abi"]))
    except FileNotFoundError:
        return f"it has no build record ({record_path.name}) saying which torch it was built against"
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"its build record {record_path} is unreadable ({type(e).__name__}: {e})"
    if built != running:
        return (f"it was built against torch {built[0]} (C++11 ABI {int(built[1])}), but this process runs "
                f"torch {running[0]} (C++11 ABI {int(running[1])})")
    return None


def load() -> NativeExecutor:
    """A ready native executor, or ExecutorUnavailable saying what is missing and how to fix it."""
    spec = importlib.util.find_spec(NATIVE_MODULE)
    if spec is None or not spec.origin:
        raise ExecutorUnavailable(f"native library not built; {BUILD_HINT}")
    mismatch = build_mismatch(Path(spec.origin).with_name(BUILD_RECORD), running_torch())
    if mismatch is not None:  # checked before importing: a mismatched module may not even load
        raise ExecutorUnavailable(f"the native library does not match this torch: {mismatch}; rebuild it: {BUILD_HINT}")
    try:
        _native = importlib.import_module(NATIVE_MODULE)
    except ImportError as e:  # built, but against another Python
        raise ExecutorUnavailable(
            f"native library present but does not load ({first_lines(e, 3)}); rebuild it against "
            f"the installed torch: {BUILD_HINT}"
        ) from None
    built = (getattr(_native, "BUILT_WITH_TORCH", None), getattr(_native, "BUILT_WITH_CXX11_ABI", None))
    if built != running_torch():
        raise ExecutorUnavailable(
            f"the native library was compiled against torch {built[0]} but this process runs torch "
            f"{torch.__version__}; rebuild it: {BUILD_HINT}"
        )
    if not torch.backends.mps.is_available():
        raise ExecutorUnavailable(f"MPS is not available: {mps_unavailable_reason()}")
    executor = NativeExecutor(_open_library(_native), getattr(_native, "CommandBufferWatch", None))
    executor.language_version = METALLIB_LANGUAGE_VERSION if executor.origin.startswith("metallib") else \
        runtime_language_version(_native)
    # one pipeline: the width is a property of the GPU
    names = executor._units.kernels() if executor._units is not None else executor._library.function_names()
    if not names:
        raise ExecutorUnavailable("the kernel source defines no kernels")
    probe = min(names)
    check_simd_width(executor.pipeline_info(probe)["thread_execution_width"], probe)
    return executor
