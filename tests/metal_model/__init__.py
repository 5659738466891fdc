"""The native executor (csrc/mps_ops.mm, the Objective-C++ only a Mac runs) built and run on Linux,
against a test-side model of Metal and of torch's MPS stream (README.md here says what is modelled,
after which documentation, and what is not).

    native, model = metal_model.load()          # builds once per source (cached), or skips the test
    executor = metal_model.executor(native)     # bnb_mps.executors.native.NativeExecutor on it
    with metal_model.serving_cpu_ops(executor): # bitsandbytes ops on CPU tensors go through it
        ...
        model.synchronize()                     # torch.mps.synchronize(): commit, wait

The ops' CPU tensors stand in for mps ones: each launch binds them as the model's MTLBuffers
(`_metal_model.as_mps`, the storage torch's MPS allocator would give them), and the modelled GPU
runs each committed command buffer's dispatches under the emulator, on its own thread, after the
host has gone on. Results are there after `model.synchronize()`, as on a Mac.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import threading
import types
from pathlib import Path
from typing import Iterator, Optional

import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
STUBS = REPO / "tests" / "native_stubs"
MODEL_SOURCES = ("foundation.mm", "metal.mm", "stream.mm", "module.mm")
#: clang's Objective-C for a non-Apple runtime that has ARC: the GNUstep ABI, on gcc's libobjc with
#: tests/metal_model/objc_shim.c; legacy dispatch (objc_msg_lookup_sender), which the shim provides
OBJC_FLAGS = ["-fobjc-runtime=gnustep-1.9", "-Xclang", "-fobjc-dispatch-method=legacy", "-fblocks"]


class ModelUnavailable(RuntimeError):
    """The tools to build the model are missing here (clang++, libobjc, libBlocksRuntime)."""


def _torch_dirs() -> tuple[Path, Path]:
    root = Path(torch.__file__).resolve().parent
    return root / "include", root / "lib"


def _compiler() -> str:
    for name in (os.environ.get("BNB_MPS_MODEL_CXX"), "clang++", "clang++-16", "clang++-14"):
        if name and shutil.which(name):
            return shutil.which(name)
    raise ModelUnavailable("no clang++ (Debian: apt-get install clang)")


def _libobjc() -> Optional[tuple[str, str]]:
    """(the directory of gcc's libobjc.so, that of its headers): libobjc-12-dev puts both in gcc's
    own directories."""
    for gcc in ("gcc", "gcc-12", "gcc-13", "gcc-11"):
        if shutil.which(gcc):
            ask = lambda what: subprocess.run([gcc, f"-print-file-name={what}"], capture_output=True,  # noqa: E731
                                              text=True).stdout.strip()  # fmt: skip
            lib, include = ask("libobjc.so"), ask("include")
            if os.path.isabs(lib) and os.path.exists(lib) and Path(include, "objc", "runtime.h").is_file():
                return str(Path(lib).parent), include
    return None


def _inputs() -> list[Path]:
    files = [HERE / name for name in (*MODEL_SOURCES, "objc_shim.c", "model.h")]
    files += sorted(STUBS.rglob("*.h")) + [REPO / "csrc" / "mps_ops.mm", REPO / "csrc" / "mps_ops.h"]
    return files


def build_dir() -> Path:
    """Where the two modules of this source are built: a directory per digest of the inputs."""
    digest = hashlib.sha256()
    for f in _inputs():
        digest.update(f.name.encode() + b"\0" + f.read_bytes())
    digest.update(torch.__version__.encode() + sys.version.encode())
    root = os.environ.get("BNB_MPS_CACHE_DIR")
    base = Path(root) if root else Path.home() / ".cache" / "bnb_mps"
    return base / "metal_model" / digest.hexdigest()[:16]


def _run(command: list[str], what: str) -> None:
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"building the Metal model: {what} failed:\n{done.stderr[-6000:]}")


def _compile(command: list[str], source: Path, extra: list[Path], what: str, objects: Path) -> Path:
    """`command` + [source, "-o", object], cached under `objects` by the digest of the command and
    the files it reads (`source` and `extra`): an edit rebuilds only what it touches."""
    digest = hashlib.sha256("\0".join(command).encode())
    for f in (source, *extra):
        digest.update(f.read_bytes())
    obj = objects / f"{source.name}.{digest.hexdigest()[:16]}.o"
    if not obj.is_file():
        tmp = obj.with_name(obj.name + f".tmp{os.getpid()}")
        _run([*command, str(source), "-o", str(tmp)], what)
        tmp.replace(obj)
    return obj


def build() -> Path:
    """Builds `_metal_model.so` (the model) and `_native.so` (csrc/mps_ops.mm linked against it) once
    per source; returns their directory."""
    out = build_dir()
    if (out / "_native.so").is_file() and (out / "_metal_model.so").is_file():
        return out
    cxx = _compiler()
    found = _libobjc()
    if found is None:
        raise ModelUnavailable("no libobjc.so and its headers (Debian: apt-get install libobjc-12-dev)")
    objc_lib, objc_include = found
    if not any(Path(d, "libBlocksRuntime.so").exists() for d in ("/usr/lib/x86_64-linux-gnu", "/usr/lib",
                                                                 "/usr/lib/aarch64-linux-gnu")):  # fmt: skip
        raise ModelUnavailable("no libBlocksRuntime.so (Debian: apt-get install libblocksruntime-dev)")
    torch_include, torch_lib = _torch_dirs()
    python_include = sysconfig.get_paths()["include"]
    objects = out.parent / "objects"
    objects.mkdir(parents=True, exist_ok=True)
    work = out.with_name(out.name + f".tmp{os.getpid()}.{threading.get_ident()}")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    abi = int(bool(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True)))
    common = ["-std=c++20", "-fPIC", "-O1", "-g0", "-fexceptions", "-Wno-deprecated-declarations",
              "-Wno-nullability-completeness", "-Wno-objc-root-class", "-Wno-unused-command-line-argument",
              f"-D_GLIBCXX_USE_CXX11_ABI={abi}", "-D__MAC_15_0=150000", "-D__MAC_26_0=260000",
              "-isystem", str(STUBS), "-isystem", str(torch_include),
              "-isystem", str(torch_include / "torch" / "csrc" / "api" / "include"), "-isystem", python_include,
              "-I", str(HERE), f"-D_BNB_TORCH={torch.__version__}"]  # (the last: objects keyed by torch)  # fmt: skip
    headers = sorted(STUBS.rglob("*.h")) + [HERE / "model.h"]
    built = [_compile([cxx.replace("++", ""), "-x", "c", "-c", "-fPIC", "-O1", "-I", objc_include],
                      HERE / "objc_shim.c", [], "objc_shim.c", objects)]  # fmt: skip
    for name in MODEL_SOURCES:
        built.append(_compile([cxx, "-x", "objective-c++", "-c", "-fno-objc-arc", *OBJC_FLAGS, *common,
                               "-DTORCH_EXTENSION_NAME=_metal_model"], HERE / name, headers, name, objects))  # fmt: skip
    torch_libs = ["-L", str(torch_lib), f"-Wl,-rpath,{torch_lib}", "-ltorch", "-ltorch_cpu", "-lc10", "-ltorch_python"]
    objc_libs = ["-L", objc_lib, f"-Wl,-rpath,{objc_lib}", "-lobjc", "-lBlocksRuntime", "-ldl"]
    _run([cxx, "-shared", "-Wl,-soname,_metal_model.so", *map(str, built), *torch_libs, *objc_libs,
          "-o", str(work / "_metal_model.so")], "linking _metal_model.so")  # fmt: skip
    # csrc/mps_ops.mm as the Mac build compiles it (ARC; the GNUstep ABI), with the kernel header the build makes
    _run([sys.executable, str(REPO / "bnb_mps" / "executors" / "_embed_kernels.py"), "--header",
          str(work / "bnb_mps_kernels_embedded.h")], "generating the kernel header")  # fmt: skip
    native = _compile([cxx, "-x", "objective-c++", "-c", "-fobjc-arc", *OBJC_FLAGS, *common,
                       f"-DBNB_MPS_TORCH_VERSION=\"{torch.__version__}\"", f"-DBNB_MPS_TORCH_CXX11_ABI={abi}",
                       "-DTORCH_EXTENSION_NAME=_native", "-I", str(REPO / "csrc"), "-I", str(work)],
                      REPO / "csrc" / "mps_ops.mm", [*headers, REPO / "csrc" / "mps_ops.h",
                                                     work / "bnb_mps_kernels_embedded.h"], "csrc/mps_ops.mm", objects)  # fmt: skip
    _run([cxx, "-shared", str(native), str(work / "_metal_model.so"), "-Wl,-rpath,$ORIGIN",
          *torch_libs, *objc_libs, "-o", str(work / "_native.so")], "linking _native.so")  # fmt: skip
    try:
        work.rename(out)
    except OSError:  # (another process built it first)
        shutil.rmtree(work, ignore_errors=True)
    return out


_loaded: Optional[tuple[types.ModuleType, types.ModuleType]] = None
_lock = threading.Lock()


def _import(path: Path, name: str) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load() -> tuple[types.ModuleType, types.ModuleType]:
    """(the `_native` module built from csrc/mps_ops.mm, the `_metal_model` module), with the model's
    runtime set to the emulator. Raises ModelUnavailable where the tools are missing."""
    global _loaded
    with _lock:
        if _loaded is None:
            out = build()
            model = _import(out / "_metal_model.so", "_metal_model")
            native = _import(out / "_native.so", "_native")
            model.set_runtime(EmulatorRuntime().compile, EmulatorRuntime.instance_run, EmulatorRuntime.max_threads)
            _loaded = (native, model)
        return _loaded


class EmulatorRuntime:
    """What the modelled GPU compiles and runs kernels with: the emulator (bnb_mps.emulator), the
    same as the emulated tier, in its default float mode (Apple's: float32 subnormals flushed), at the
    Metal language version each compile asks for."""

    libraries: list = []
    limits: dict = {}  # kernel -> its pipelines' maxTotalThreadsPerThreadgroup (bnb_mps.modelled_mps.library)

    def compile(self, source: bytes, metal_version: str = "3.1"):
        from bnb_mps import emulator

        from bnb_mps.msl import source as kernel_source

        text = source.decode("utf-8")
        # (named as the emulated tier names a compile unit: the same text and name share its module cache)
        unit = next((name for name, unit_text in kernel_source.units().items() if unit_text == text), "metal-model")
        library = emulator.Library(text, name=f"{unit}.metal", metal_version=metal_version)
        names = library.kernels  # (compiles it: a compile error is the compiler's message)
        EmulatorRuntime.libraries.append(library)
        from bnb_mps.modelled_mps.library import modelled_max_threads

        EmulatorRuntime.limits.update(dict.fromkeys(names, modelled_max_threads(text)))
        return len(EmulatorRuntime.libraries) - 1, list(names)

    @staticmethod
    def max_threads(kernel: str) -> int:
        return EmulatorRuntime.limits.get(kernel, 1024)

    @staticmethod
    def instance_run(handle: int, kernel: str, grid, threadgroup, bindings) -> Optional[str]:
        from bnb_mps import emulator

        args = []
        for b in bindings:
            if isinstance(b, bytes):
                args.append(b)
            else:
                address, length = b
                args.append(_memory(address, length))
        try:
            EmulatorRuntime.libraries[handle].launch(kernel, grid=tuple(grid), threadgroup=tuple(threadgroup), args=args)
        except emulator.EmulatorError as e:
            return str(e)
        return None


def _memory(address: int, length: int) -> torch.Tensor:
    """A uint8 CPU tensor over `length` bytes at `address` (a buffer binding's memory)."""
    if length == 0:
        return torch.empty(0, dtype=torch.uint8)
    array = (ctypes.c_uint8 * length).from_address(address)
    return torch.frombuffer(array, dtype=torch.uint8)


class MpsBindings:
    """A `_native.KernelLibrary` whose launches take CPU tensors: each is bound as an mps tensor over
    the same memory (what torch's MPS allocator hands the native executor on a Mac)."""

    #: every kernel launched through the model, in order (the tests check the native path ran)
    launched: list = []

    def __init__(self, library, model) -> None:
        self.library, self.model = library, model
        self.origin = library.origin
        self.function_names = library.function_names
        self.pipeline_info = library.pipeline_info

    def launch(self, kernel, grid, threadgroup, args, watch=None):
        as_mps = self.model.as_mps
        bound = [as_mps(a) if isinstance(a, torch.Tensor) else a for a in args]
        self.library.launch(kernel, grid, threadgroup, bound, watch)
        MpsBindings.launched.append(kernel)


def executor(native=None, model=None):
    """bnb_mps.executors.native.NativeExecutor on the model: the kernel units compiled by `_native`'s
    compile_library (csrc/mps_ops.mm) as on a Mac, each launch through `_native`'s KernelLibrary."""
    from bnb_mps.executors import native as native_tier

    if native is None or model is None:
        native, model = load()
    module = types.SimpleNamespace(
        __file__=native.__file__, embedded_source=native.embedded_source,
        load_metallib=lambda path: MpsBindings(native.load_metallib(path), model),
        compile_library=lambda text: MpsBindings(native.compile_library(text), model),
        language_version=native.language_version,
    )  # fmt: skip
    ex = native_tier.NativeExecutor(native_tier._open_library(module), native.CommandBufferWatch)
    ex.language_version = native_tier.runtime_language_version(native)
    ex.device_type = "cpu"  # (its tensors here: CPU tensors standing in for mps ones)
    ex.synchronize = model.synchronize  # (torch.mps.synchronize() of the modelled stream)
    return ex


@contextlib.contextmanager
def serving_cpu_ops(ex) -> Iterator[None]:
    """bitsandbytes ops on CPU tensors are served by `ex` (as bnb_mps.testing.use_emulated_kernels
    does with the emulated tier)."""
    import bitsandbytes  # noqa: F401  (first: importing it later would put its own CPU kernels back)

    from bnb_mps import ops, registration

    names = [name for name, op in ops.OPS.items() if op.kernel is not None]
    if "CPU" in registration.registered_keys():
        raise RuntimeError("another executor serves CPU tensors already")
    registration.register("CPU", executor=ex, names=names)
    try:
        yield
    finally:
        registration.unregister("CPU")
