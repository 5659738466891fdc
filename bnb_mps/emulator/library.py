"""A compiled kernel library and its launches.

Arguments bind to `[[buffer(0)]]`, `[[buffer(1)]]`, ... in order:
- a torch CPU tensor binds at its `data_ptr()` (so a view binds at its storage offset). The bound
  region runs from there to the last byte the view can reach: `numel * itemsize` bytes when
  contiguous; for a non-contiguous view the strided storage span, as Metal would see the buffer
  (the kernel indexes it with its own strides). For the dispatch the region is copied into memory
  that ends against a protected page (an access past its end is reported as OutOfBounds) and
  copied back afterwards; arguments whose regions overlap share one copy.
- a `bnb_mps.kernel_args.Scalar` binds its bytes (for `constant T&`); so does a one-element tensor.
- `bytes` bind as a read-only buffer.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import shutil
import subprocess
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Union

from ..kernel_args import Scalar
from . import build, errors, prepass
from .profile import LINE_BYTES, KernelProfile

_ORDERS = {"forward": 0, "reverse": 1, "random": 2}

#: The emulated GPU's float arithmetic: "apple" (the default) computes like an Apple GPU, whose
#: float32 units flush subnormal inputs and results to zero (fp16 keeps its subnormals, bfloat's are
#: float32's and flush); "ieee" keeps float32 subnormals, as the host CPU does, for comparison.
FLOAT_MODES = ("apple", "ieee")
#: The Metal language versions the tiers compile at, and their __METAL_VERSION__.
METAL_VERSIONS = {"3.1": 310, "3.2": 320, "4.0": 400}


def metal_version_number(metal_version: str) -> int:
    """__METAL_VERSION__ of a language version "3.1", "3.2" or "4.0" (ValueError otherwise)."""
    if metal_version not in METAL_VERSIONS:
        raise ValueError(f"metal_version must be one of {sorted(METAL_VERSIONS)}, got {metal_version!r}")
    return METAL_VERSIONS[metal_version]


#: Environment variable that sets the default float mode of every launch (e.g. BNB_MPS_EMU_FLOAT=ieee).
FLOAT_MODE_ENV = "BNB_MPS_EMU_FLOAT"


def default_float_mode() -> str:
    """The float mode of launches that do not name one: $BNB_MPS_EMU_FLOAT, else "apple"."""
    mode = os.environ.get(FLOAT_MODE_ENV, "").strip().lower() or "apple"
    if mode not in FLOAT_MODES:
        raise ValueError(f"{FLOAT_MODE_ENV}={mode!r} is not a float mode; expected 'apple' or 'ieee'")
    return mode


def _flush_subnormals(float_mode: str | None) -> bool:
    mode = default_float_mode() if float_mode is None else float_mode
    if mode not in FLOAT_MODES:
        raise ValueError(f"float_mode must be 'apple' or 'ieee', got {mode!r}")
    return mode == "apple"
Dims = Union[int, Sequence[int]]


@functools.lru_cache(maxsize=1)
def _runtime():
    override = os.environ.get("BNB_MPS_EMU_MODULE")  # another build of the runtime (sanitizers)
    if override:
        spec = importlib.util.spec_from_file_location("bnb_mps._emu", override)
        if spec is None or spec.loader is None:
            raise errors.KernelError(f"BNB_MPS_EMU_MODULE={override} is not a Python extension module")
        _emu = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(_emu)
        return _emu
    try:
        from .. import _emu
    except ImportError as e:
        raise errors.KernelError(
            f"the emulator runtime (bnb_mps._emu) is not built: run `pip install --no-build-isolation -e .` ({e})"
        ) from None
    if _emu.ABI_VERSION != build.ABI_VERSION:
        raise errors.KernelError(f"bnb_mps._emu has ABI {_emu.ABI_VERSION}, the Python side expects {build.ABI_VERSION}")
    return _emu


def _dim3(value: Dims | None, what: str, *, minimum: int) -> tuple[int, int, int]:
    if isinstance(value, bool):
        raise TypeError(f"{what} must be an int or a tuple of 1 to 3 ints, got {value!r}")
    if isinstance(value, int):
        value = (value,)
    try:
        dims = tuple(value)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"{what} must be an int or a tuple of 1 to 3 ints, got {value!r}") from None
    if not 1 <= len(dims) <= 3 or not all(isinstance(d, int) and not isinstance(d, bool) for d in dims):
        raise TypeError(f"{what} must be an int or a tuple of 1 to 3 ints, got {value!r}")
    if any(d < minimum for d in dims):
        raise ValueError(f"{what} components must be >= {minimum}, got {dims}")
    return tuple(dims) + (1,) * (3 - len(dims))  # type: ignore[return-value]


def _marshal(args: Sequence[object]) -> list:
    import torch

    out: list = []
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            if a.device.type != "cpu":
                raise TypeError(f"args[{i}]: the emulator binds CPU tensors only, got a tensor on {a.device}")
            item = a.element_size()
            if a.numel() == 0:
                span = 0
            elif a.is_contiguous():
                span = a.numel() * item
            else:
                if any(s < 0 for s in a.stride()):
                    raise ValueError(f"args[{i}]: tensors with negative strides cannot be bound")
                span = (sum((n - 1) * s for n, s in zip(a.shape, a.stride())) + 1) * item
            out.append((a.data_ptr(), span, min(item, 16), True))
        elif isinstance(a, Scalar):
            out.append(a.to_bytes())
        elif isinstance(a, (bytes, bytearray)):
            out.append(bytes(a))
        elif isinstance(a, (int, float, bool)):
            raise TypeError(
                f"args[{i}]: a bare Python {type(a).__name__} has no Metal type; wrap it, e.g. "
                f"bnb_mps.kernel_args.uint32({a!r}) or float32({a!r})"
            )
        else:
            raise TypeError(f"args[{i}]: expected a torch CPU tensor, a kernel_args.Scalar or bytes, got {type(a).__name__}")
    return out


@functools.lru_cache(maxsize=None)
def _addr2line(path: str, offset: int) -> str | None:
    tool = shutil.which("addr2line")
    if not tool:
        return None
    try:
        out = subprocess.run([tool, "-e", path, "-i", hex(offset)], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    # Innermost frame first (inlined code): the first line in kernel source, not in the shim.
    for ln in out.splitlines():
        loc = ln.split(" (discriminator")[0].strip()
        if not loc or loc.startswith("??") or loc.endswith(":0") or loc.endswith(":?"):
            continue
        if "bnb_emu/" in loc or "<emulator registrations>" in loc or "/include/" in loc:
            continue
        return loc.rsplit("/", 1)[-1]
    return None


class Library:
    """Kernels compiled from one MSL source at one Metal language version (`metal_version`: "3.1",
    "3.2" or "4.0", as __METAL_VERSION__ 310, 320, 400); `launch` runs them under the emulator,
    `profile` runs them and measures their memory traffic."""

    def __init__(self, source: str, *, name: str = "kernel.metal", compiler: str | None = None,
                 metal_version: str = "3.1") -> None:
        self.name = name
        self.metal_version = metal_version
        self._version = metal_version_number(metal_version)
        self._compiler = compiler
        self._translation = prepass.translate(source, name)
        self._modules: dict[tuple[bool, bool], object] = {}
        self._lock = threading.Lock()
        self._module(False)  # compile now: errors surface at load time

    def _module(self, race_check: bool, profile: bool = False):
        """The kernel module of one build variant (compiled on first use, then cached)."""
        with self._lock:
            mod = self._modules.get((race_check, profile))
            if mod is None:
                rt = _runtime()
                so = build.build(self._translation.cpp, compiler=self._compiler, race_check=race_check,
                                 profile=profile, name=self.name, metal_version=self._version)
                mod = rt.Module(str(so))
                self._modules[(race_check, profile)] = mod
            return mod

    @property
    def kernels(self) -> list[str]:
        return list(self._module(False).kernels)

    def __contains__(self, kernel: str) -> bool:
        return kernel in self._module(False).kernels

    def launch(
        self,
        kernel: str,
        *,
        grid: Dims | None = None,
        threadgroup: Dims,
        args: Sequence[object] = (),
        threads: Dims | None = None,
        order: str = "forward",
        race_check: bool = False,
        poison: int = 0xFF,
        seed: int = 0,
        float_mode: str | None = None,
        coherence_check: bool = False,
    ) -> None:
        """Runs `kernel` over `grid` threadgroups of `threadgroup` threads (or over `threads`
        threads in total, Metal's dispatchThreads, with smaller edge threadgroups), binding
        `args` to [[buffer(0)]], [[buffer(1)]], ... Returns when the dispatch is done; outputs are
        written back into the tensors. Faults raise an EmulatorError subclass.

        `float_mode`: "apple" (float32 subnormal inputs and results flush to zero, as on Apple GPUs)
        or "ieee" (they are kept, as on the host CPU); None takes `default_float_mode()`.

        `coherence_check`: run in the instrumented build (clang, as `profile`) and raise
        CoherenceError when a thread reads device memory that another threadgroup of this dispatch
        wrote and the library's Metal version does not make that write visible to it
        (docs/emulator.md, "Memory model")."""
        flush = _flush_subnormals(float_mode)
        mod, groups, tg, total, buffers = self._dispatch(kernel, grid, threadgroup, args, threads, order, race_check,
                                                         poison, seed, profile=bool(coherence_check))
        if 0 in groups:
            return
        res = _runtime().launch(mod, kernel, list(groups), list(tg), list(total), buffers, _ORDERS[order], seed,
                                poison, bool(race_check), flush, bool(coherence_check), self._version)
        self._raise_fault(kernel, mod, res)

    def profile(
        self,
        kernel: str,
        *,
        grid: Dims | None = None,
        threadgroup: Dims,
        args: Sequence[object] = (),
        threads: Dims | None = None,
        order: str = "forward",
        race_check: bool = False,
        poison: int = 0xFF,
        seed: int = 0,
        float_mode: str | None = None,
        required_bytes: int | None = None,
        line_bytes: int = LINE_BYTES,
    ) -> KernelProfile:
        """Runs `kernel` like `launch` (same arguments, same effect on the tensors) in an
        instrumented build that records every device access, and returns its memory traffic as a
        `KernelProfile` (see bnb_mps.emulator.profile for what each figure means).

        `required_bytes`: what the kernel must move at least (e.g. packed weight + absmax + input +
        output), for the estimate's efficiency. `line_bytes`: the cache line (128 on Apple GPUs).
        Needs clang >= 15 (CompileError otherwise); slower than `launch`, which it leaves untouched.

        What is counted: every load and store of 1..16 bytes the compiled kernel code makes into a
        buffer argument (tensors; scalars passed as kernel_args or bytes are constant data, not
        memory traffic, and are reported as None) or into threadgroup memory. A vector load or store
        (uchar4, half4, uint4, float4 ...) is one access of its width; so is a vector operand read
        straight from device memory. simdgroup_load/simdgroup_store count as each lane moving its
        share of the matrix (two elements of an 8x8); an atomic operation is one access.
        Lines are counted as if each tensor's storage began on a line boundary (Metal buffers do):
        a view starts `storage_offset * element_size` bytes into it.

        SIMD-group memory instructions: the lanes of a simdgroup run one after another here, so an
        instruction is reconstructed from each lane's sequence of accesses since the simdgroup last
        synchronised (a SIMD-group collective, a threadgroup barrier): the n-th access of each lane
        to one buffer with one kind (load, store, atomic) is one instruction, and its transactions
        are the distinct lines its lanes touch. In uniform control flow this is exactly the k-th
        device access of each active lane, the instruction the hardware issues. Divergent control
        flow is approximated: a lane's accesses made on a path the others do not take are paired
        with the others' accesses to the same buffer and kind by their count (so `if (lane == 0)
        absmax[b] = m;` is an instruction of its own and shifts nothing else, while two paths that
        load one buffer a different number of times are paired load by load), and the count
        restarts at every synchronisation.
        Accesses the compiler removes (loads hoisted out of loops, repeated loads of one address)
        are not counted, as on the GPU, whose compiler does the same; copies the compiler turns into
        memcpy calls of aggregates larger than 16 bytes are not seen.
        """
        if not isinstance(line_bytes, int) or line_bytes < 16 or line_bytes & (line_bytes - 1):
            raise ValueError(f"line_bytes must be a power of two >= 16, got {line_bytes!r}")
        if required_bytes is not None and (not isinstance(required_bytes, int) or required_bytes < 0):
            raise ValueError(f"required_bytes must be a non-negative int, got {required_bytes!r}")
        flush = _flush_subnormals(float_mode)
        counted = [_is_buffer(a) for a in args]
        offsets = [_line_offset(a, line_bytes) for a in args]
        mod, groups, tg, total, buffers = self._dispatch(kernel, grid, threadgroup, args, threads, order, race_check,
                                                         poison, seed, profile=True)
        sizes = [len(b) if isinstance(b, bytes) else b[1] for b in buffers]
        if 0 in groups:
            return KernelProfile.from_counts(kernel, groups, tg, counted, sizes, line_bytes, None, required_bytes)
        fault, counts = _runtime().profile(mod, kernel, list(groups), list(tg), list(total), buffers, _ORDERS[order],
                                           seed, poison, bool(race_check), flush, counted, offsets, line_bytes)
        self._raise_fault(kernel, mod, fault)
        return KernelProfile.from_counts(kernel, groups, tg, counted, sizes, line_bytes, counts, required_bytes)

    def _dispatch(self, kernel, grid, threadgroup, args, threads, order, race_check, poison, seed, *, profile):
        """Validates a launch; returns (module, groups, threadgroup, threads, marshalled args)."""
        if not isinstance(kernel, str):
            raise TypeError(f"kernel must be a kernel name (str), got {type(kernel).__name__}")
        if (grid is None) == (threads is None):
            raise ValueError("pass exactly one of grid= (threadgroups) or threads= (threads in total)")
        tg = _dim3(threadgroup, "threadgroup", minimum=1)
        if grid is not None:
            groups = _dim3(grid, "grid", minimum=0)
            total = tuple(g * t for g, t in zip(groups, tg))
        else:
            total = _dim3(threads, "threads", minimum=0)
            groups = tuple(-(-n // t) for n, t in zip(total, tg))
        if order not in _ORDERS:
            raise ValueError(f"order must be one of {sorted(_ORDERS)}, got {order!r}")
        if not isinstance(poison, int) or not 0 <= poison <= 255:
            raise ValueError(f"poison must be a byte value 0..255, got {poison!r}")
        if not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed must be a non-negative int, got {seed!r}")
        if any(n > 0xFFFFFFFF for n in total):
            raise ValueError(f"grid too large: {total} threads")
        buffers = _marshal(args)
        mod = self._module(bool(race_check), profile)
        if kernel not in mod.kernels:
            names = sorted(mod.kernels)
            shown = ", ".join(names[:8]) + (f", ... ({len(names)} in all)" if len(names) > 8 else "")
            raise errors.KernelError(f"kernel '{kernel}' is not in {self.name} (kernels: {shown or 'none'})",
                                     kernel=kernel)
        return mod, groups, tg, total, buffers

    @staticmethod
    def _raise_fault(kernel: str, mod, res) -> None:
        if res is None:
            return
        kind, message, where, obj, offset = res
        if not where and obj and Path(obj).resolve() == Path(mod.path).resolve():
            loc = _addr2line(obj, offset)
            if loc:
                where = loc
                message = message.replace(" [", f" at {loc} [", 1) if " [" in message else f"{message} at {loc}"
        cls = errors.BY_KIND.get(kind, errors.EmulatorError)
        raise cls(message, kernel=kernel, where=where)


def _is_buffer(arg: object) -> bool:
    """Tensors are buffers (memory traffic); scalars and bytes are constant data (setBytes)."""
    return not isinstance(arg, (Scalar, bytes, bytearray))


def _line_offset(arg: object, line_bytes: int) -> int:
    """Where a tensor's binding starts relative to a line on the GPU, whose buffers start on a line:
    its byte offset into its storage."""
    if not _is_buffer(arg) or not hasattr(arg, "storage_offset"):
        return 0
    return (arg.storage_offset() * arg.element_size()) % line_bytes  # type: ignore[union-attr]


def load(source_or_path: Union[str, Path], *, compiler: str | None = None, metal_version: str = "3.1") -> Library:
    """A Library from MSL text, or from a path to a `.metal` file (local includes are not
    resolved here: amalgamate first, see bnb_mps.msl.source), compiled at `metal_version`."""
    if isinstance(source_or_path, Path) or (
        isinstance(source_or_path, str) and "\n" not in source_or_path and source_or_path.endswith((".metal", ".h"))
    ):
        path = Path(source_or_path)
        if not path.is_file():
            raise FileNotFoundError(f"no such kernel source file: {path}")
        return Library(path.read_text(encoding="utf-8"), name=path.name, compiler=compiler, metal_version=metal_version)
    if not isinstance(source_or_path, str):
        raise TypeError(f"source_or_path must be MSL text or a path, got {type(source_or_path).__name__}")
    return Library(source_or_path, name="kernel.metal", compiler=compiler, metal_version=metal_version)
