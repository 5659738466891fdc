"""The native tier: kernels through the Objective-C++ library `bnb_mps._native` (csrc/mps_ops.mm).

The library is built on macOS with `COMPUTE_BACKEND=mps`. It holds the kernel amalgamation as of
the build (and, when Xcode's `metal` was present, a prebuilt `bnb_mps_kernels.metallib` of it),
compiles it once with safe math, caches pipelines and encodes on PyTorch's MPS stream. This module
decides which kernel source to use, validates launch geometry and turns Scalars into their bytes;
everything else happens in C++.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
from collections.abc import Sequence
from pathlib import Path

import torch

from ..msl import source as kernel_source
from ..kernel_args import Scalar
from ._gpu_common import check_geometry, check_simd_width, first_lines, mps_unavailable_reason
from .base import Dim3, ExecutorUnavailable, KernelArg

BUILD_HINT = (
    "on an Apple Silicon Mac, from the bnb-mps source checkout with torch installed, run "
    "`pip install --no-build-isolation -e .` "
    "(or `cmake -DCOMPUTE_BACKEND=mps -B build . && cmake --build build`)"
)
METALLIB_NAME = "bnb_mps_kernels.metallib"
NATIVE_MODULE = "bnb_mps._native"
#: written next to the module by the build (csrc/mps.cmake): the torch it was compiled against
BUILD_RECORD = "_native_build.json"


class NativeExecutor:
    name = "native"
    device_type = "mps"  # where its tensors live

    def __init__(self, library) -> None:
        self._library = library
        self._launch = library.launch  # bound once: one attribute lookup less per launch
        self.origin: str = library.origin

    def launch(self, kernel: str, *, grid: Dim3, threadgroup: Dim3, args: Sequence[KernelArg]) -> None:
        if not check_geometry(grid, threadgroup):
            return
        # Scalars travel as their exact bytes (setBytes); tensors as they are (the C++ side checks
        # that they are on mps and binds them at storage_offset * element_size, and raises
        # PipelineLimitError before encoding when the pipeline allows fewer threads than asked).
        self._launch(kernel, grid, threadgroup, [a.to_bytes() if isinstance(a, Scalar) else a for a in args])

    def pipeline_info(self, kernel: str) -> dict:
        """Metal's limits for `kernel`: max_total_threads_per_threadgroup, thread_execution_width,
        static_threadgroup_memory_length."""
        return self._library.pipeline_info(kernel)


def current_kernel_source() -> str | None:
    """The kernel source in this installation now, or None when it has no kernel files."""
    try:
        return kernel_source.source()
    except FileNotFoundError:
        return None


def choose_library(embedded: str, current: str | None, metallib: Path | None) -> tuple[str, str]:
    """Which kernel library the native tier loads: ("metallib", path) or ("source", text).

    The native tier must run the same kernels as every other tier. When the installation's kernel
    files differ from what the library embedded at build time (kernels edited in a checkout since
    the last build), compile the current text; otherwise prefer the prebuilt metallib (built
    from the embedded text), then the embedded text.
    """
    if current is not None and current != embedded:
        return ("source", current)
    if not embedded:
        raise ExecutorUnavailable(
            "the native library was built without kernel sources (csrc/kernels had no .metal "
            f"files at build time) and none are installed now; rebuild it: {BUILD_HINT}"
        )
    if metallib is not None and metallib.is_file():
        return ("metallib", str(metallib))
    return ("source", embedded)


def _open_library(native):
    embedded = native.embedded_source()
    try:
        current = current_kernel_source()
    except (OSError, ValueError) as e:
        raise ExecutorUnavailable(f"cannot read the kernel sources: {e}") from None
    kind, what = choose_library(embedded, current, Path(native.__file__).with_name(METALLIB_NAME))
    if kind == "metallib":
        try:
            return native.load_metallib(what)
        except RuntimeError:
            what = embedded  # a stale or foreign metallib: the embedded text is the same kernels
    try:
        return native.compile_library(what)
    except (RuntimeError, ValueError) as e:
        raise ExecutorUnavailable(f"the kernel source does not compile for Metal:\n{first_lines(e)}") from None


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
    library = _open_library(_native)
    probe = min(library.function_names())  # one pipeline: the width is a property of the GPU
    check_simd_width(library.pipeline_info(probe)["thread_execution_width"], probe)
    return NativeExecutor(library)
