"""The shader tier: the project's kernel source through `torch.mps.compile_shader` (nothing to build).

One compile_shader library per compile unit (`bnb_mps.msl.source.units()`, one per `.metal` file);
each kernel is looked up in the library of its unit. A unit that does not compile makes only its
own kernels unavailable (their launches raise KernelUnavailable with torch's message); the tier is
unavailable only when no unit compiles.

How torch binds a kernel call `lib.<kernel>(*args, threads=, group_size=, arg_casts=)`, as read in
torch/csrc/mps/Module.cpp and aten/src/ATen/native/mps/MetalShaderLibrary.mm:
  - argument i binds to [[buffer(i)]];
  - a tensor binds as its storage's MTLBuffer at byte offset storage_offset * element_size, with
    no device check (so a CPU tensor must never get there: this module refuses it);
  - a Python int binds as 8 bytes (int64) and a float as 4 (float32), unless `arg_casts` maps the
    argument's index to "int8", "int16", "int32", "uint8", "fp16" or "bf16";
  - `threads` is the total thread count per dimension and `group_size` the threadgroup size,
    dispatched with dispatchThreads; torch raises if the group exceeds the pipeline's maximum, but
    only after it has started encoding, so this module checks first (PipelineLimitError);
  - the kernel function reports its pipeline's `max_threads_per_threadgroup` (and
    `thread_execution_width`).
So every Scalar is passed as the signed integer with exactly its bytes, cast to its width: a
`constant uint&` gets 4 bytes and a `constant half&` 2, bit for bit `Scalar.to_bytes()` (NaN
payloads and -0.0 included), whatever the MSL type. A grid of (gx, gy, gz) threadgroups of
(tx, ty, tz) threads is passed as threads = (gx*tx, gy*ty, gz*tz), group_size = (tx, ty, tz): a
uniform grid, the same as dispatchThreadgroups.

Math mode: compile_shader takes no compile options; torch chooses them. As read in torch's source
(MetalShaderLibrary::compileLibrary) and its released macOS arm64 wheels (torch 2.7 to 2.13): torch
reads PYTORCH_MPS_FAST_MATH once per process, at its first Metal compile (any value but "0", the empty
one included, asks for fast math), so it must be set before torch is imported, or not at all. With it,
on macOS >= 15 torch sets mathMode = Fast and mathFloatingPointFunctions = Fast (Safe and Precise
without it); before macOS 15 fastMathEnabled = YES. The language version is at most Metal 3.1 in
torch 2.7 to 2.10; from torch 2.11 it is 4.0 on macOS >= 26, 3.2 on macOS 15 and 3.1 before.

What the variable is expected to change in bnb_mps' kernels (csrc/kernels/bnb_math_mode.h): expected
from torch's source and Metal's documentation of the pragmas and math modes; the effect of fast math
has not been measured on a Mac yet (the acceptance run's probe, scripts/probe_math_mode.py, is the
check; only the contraction pragma's effect was measured, on an M4):
- contraction of a * b + c into a fused multiply-add: nothing; the source's unconditional
  `#pragma clang fp contract(off)` holds at every language version;
- the rest of the float arithmetic: nothing where torch compiles Metal >= 3.2 (torch >= 2.11 on macOS
  >= 15), whose `#pragma METAL fp math_mode(safe)` the source pins; below that, expected to be fast
  arithmetic (reassociation, no-NaN/no-infinity assumptions), and load() warns once
  (FastMathWarning). It may change the float results of the kernels that add float operations
  (matmuls, dequantizing matmuls, optimizer updates); the quantization kernels take their scales from
  metal::precise::divide and their absmax, NaN and sign tests from bit patterns, so their codes are
  expected not to depend on it as long as no intermediate is NaN or infinite;
- the math functions (sqrt, exp, rint, clamp, ...): nothing: the kernels call only
  `metal::precise::` functions (the MSL lint's rule float-math), which no setting changes.
(Not yet checked on a Mac: scripts/mac_acceptance.sh probes each of these.)

Source rules: ASCII only (torch hands it to Metal as ASCII), fixed-size threadgroup
arrays (nothing can set threadgroup memory lengths) - both hold for csrc/kernels by lint.
"""

from __future__ import annotations

import operator
import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Optional

import torch
from torch.torch_version import TorchVersion, Version

from ..device import _macos_version
from ..msl import source as kernel_source
from ..kernel_args import Scalar
from . import _gpu_common, clocks
from ._gpu_common import MAX_THREADS_PER_THREADGROUP, check_geometry, check_simd_width, mps_unavailable_reason
from .base import CompileUnits, Dim3, ExecutorUnavailable, KernelArg, PipelineLimitError, first_lines

# Versions, checked in the released macOS arm64 wheels (the strings of libtorch_python.dylib):
# torch 2.6.0 already has the kernel call with `threads`, `group_size` and `arg_casts` (casts
# int8, int16, int32, uint8, fp16, bf16) but only behind the private torch.mps._compile_shader;
# torch 2.7.0 is the first with the public torch.mps.compile_shader, which is all this tier uses.
MIN_TORCH = (2, 7)

# Where the kernel source's `#pragma METAL fp` lines hold (see the module docstring): torch >= 2.11,
# whose compile_shader asks for Metal 3.2 from macOS 15 on (3.1 before; torch 2.7 to 2.10: 3.1 at
# most, on every macOS).
FAST_MATH_ENV = "PYTORCH_MPS_FAST_MATH"
PINNED_MATH_TORCH = (2, 11)
PINNED_MATH_MACOS = (15, 0)


class FastMathWarning(UserWarning):
    """PYTORCH_MPS_FAST_MATH makes torch compile the shader tier's kernels with fast math."""


#: torch >= 2.15: this variable overrides the language version compile_shader asks for, exactly one of
#: these spellings (aten/src/ATen/mps/MPSDevice.mm, metal_language_version(): any other value is
#: ignored with a warning, and the OS's default holds)
METAL_VERSION_ENV = "PYTORCH_MPS_METAL_VERSION"
METAL_VERSION_TORCH = (2, 15)
METAL_VERSIONS = {"3.1": (3, 1), "3.2": (3, 2), "4.0": (4, 0)}


def metal_version_override(torch_ver: tuple, environ: Optional[Mapping[str, str]] = None) -> Optional[tuple[int, int]]:
    """The language version PYTORCH_MPS_METAL_VERSION asks torch >= 2.15 for, (major, minor), or None
    (not set, not one of the spellings torch takes, or a torch that does not read it)."""
    if tuple(torch_ver) < METAL_VERSION_TORCH:
        return None
    return METAL_VERSIONS.get((os.environ if environ is None else environ).get(METAL_VERSION_ENV))


def language_version(macos: Optional[tuple], torch_ver: tuple,
                     environ: Optional[Mapping[str, str]] = None) -> tuple[int, int]:  # fmt: skip
    """The Metal language version torch's compile_shader asks for on this macOS ((major, minor)) with
    this torch: PYTORCH_MPS_METAL_VERSION's where torch >= 2.15 reads it; else from torch 2.11, 4.0 on
    macOS >= 26, 3.2 on macOS 15, 3.1 before; 3.1 at most before."""
    override = metal_version_override(torch_ver, environ)
    if override is not None and macos is not None:
        return override
    if tuple(torch_ver) >= PINNED_MATH_TORCH and macos is not None:
        if tuple(macos) >= (26, 0):
            return (4, 0)
        if tuple(macos) >= PINNED_MATH_MACOS:
            return (3, 2)
    return (3, 1)


def math_mode_pinned(macos: Optional[tuple], torch_ver: tuple, environ: Optional[Mapping[str, str]] = None) -> bool:
    """True when compile_shader compiles with Metal >= 3.2 on this macOS ((major, minor), None off
    macOS) with this torch ((major, minor)), so that the kernel source's pinned safe math and
    no-contraction hold whatever PYTORCH_MPS_FAST_MATH says (PYTORCH_MPS_METAL_VERSION included)."""
    return macos is not None and language_version(macos, torch_ver, environ) >= (3, 2)


_process_fast_math: Optional[bool] = None  # the process's reading, made once (as torch makes its own)


def fast_math_requested(environ: Optional[Mapping[str, str]] = None) -> bool:
    """True when PYTORCH_MPS_FAST_MATH asks torch for fast math, read as torch reads it: set, to
    anything but "0" (an empty value counts), and once per process (torch keeps the value it finds at
    its first Metal compile: set the variable before importing torch). `environ`: read that mapping
    instead, now (tests)."""
    global _process_fast_math
    if environ is not None:
        value = environ.get(FAST_MATH_ENV)
        return value is not None and value != "0"
    if _process_fast_math is None:
        _process_fast_math = fast_math_requested(dict(os.environ))
    return _process_fast_math


_fast_math_warned = False


def warn_if_fast_math(macos: Optional[tuple], torch_ver: tuple, environ: Optional[Mapping[str, str]] = None) -> None:
    """Once per process: warn when PYTORCH_MPS_FAST_MATH compiles the kernels with fast math here."""
    global _fast_math_warned
    if _fast_math_warned or not fast_math_requested(environ) or math_mode_pinned(macos, torch_ver, environ):
        return
    _fast_math_warned = True
    where = f"macOS {'.'.join(map(str, macos))}" if macos is not None else "this system"
    warnings.warn(
        f"bnb_mps: {FAST_MATH_ENV} is set, so torch {torch.__version__} compiles the shader tier's Metal "
        f"kernels with fast math on {where} (their source pins safe math only where torch compiles Metal "
        f">= 3.2: torch >= {PINNED_MATH_TORCH[0]}.{PINNED_MATH_TORCH[1]} on macOS >= {PINNED_MATH_MACOS[0]}). "
        f"Fast math is expected (not yet measured on a Mac) to be able to change the float results of the "
        f"matmul, dequantizing matmul and optimizer kernels, and the quantization kernels' codes only where "
        f"a NaN or infinity arises (NaN or infinite inputs). For IEEE results, start Python without "
        f"{FAST_MATH_ENV} (or with it set to 0): torch reads it once per process.",
        FastMathWarning,
        stacklevel=2,
    )


# Scalar byte width -> the arg_casts entry that binds an int with that many bytes (8: int64, the
# default, needs none).
_CAST_FOR_WIDTH = {1: "int8", 2: "int16", 4: "int32"}


def torch_version() -> tuple[int, int]:
    """(major, minor) of the running torch (torch's own version parsing)."""
    return tuple(Version(TorchVersion(torch.__version__)).release[:2])


def scalar_binding(scalar: Scalar) -> tuple[int, str | None]:
    """(value, cast) under which compile_shader binds exactly `scalar.to_bytes()`."""
    raw = scalar.to_bytes()
    return int.from_bytes(raw, "little", signed=True), _CAST_FOR_WIDTH.get(len(raw))


class ShaderExecutor:
    name = "shader"
    # Where tensors must live (torch binds any tensor's storage pointer as an MTLBuffer), and the
    # check for it: an attribute read, the cheapest test per tensor per launch.
    device_type = "mps"
    _on_device = operator.attrgetter("is_mps")

    def __init__(self, library) -> None:
        """`library`: the compiled units (CompileUnits of compile_shader libraries, what load()
        makes), or one compile_shader library that holds every kernel."""
        if _gpu_common.tensor_device() != "mps":  # (the model of torch's MPS runtime: CPU tensors stand in)
            self.device_type = _gpu_common.tensor_device()
            self._on_device = operator.attrgetter(f"is_{self.device_type}")
        if not isinstance(library, CompileUnits):
            library = CompileUnits({"": library}, dict.fromkeys(dir(library), ""), {})
        self._units = library
        self._kernels: dict = {}  # kernel -> (function, its pipeline's max threads per threadgroup)

    @property
    def unit_failures(self) -> dict[str, str]:
        """The compile units that did not compile here, with the compiler's message."""
        return dict(self._units.failures)

    def _kernel(self, kernel: str) -> tuple:
        found = self._kernels.get(kernel)
        if found is None:
            try:
                library = self._units.library_of(kernel)  # the library of the unit that defines it
            except KeyError:
                unavailable = self._units.unavailable(kernel)
                if unavailable is not None:
                    raise unavailable from None
                raise ValueError(f"kernel {kernel!r} is not in the bnb_mps kernel library") from None
            fn = getattr(library, kernel)
            # The pipeline's maxTotalThreadsPerThreadgroup, read once (torch's kernel function
            # reports it next to thread_execution_width; were it missing, Metal's general limit,
            # and torch's own check at dispatch has the last word).
            limit = getattr(fn, "max_threads_per_threadgroup", MAX_THREADS_PER_THREADGROUP)
            found = self._kernels[kernel] = (fn, limit)
        return found

    def launch(self, kernel: str, *, grid: Dim3, threadgroup: Dim3, args: Sequence[KernelArg]) -> None:
        self.prepare(kernel, grid, threadgroup)(args)

    def synchronize(self) -> None:
        """Waits until the GPU ran everything encoded so far (torch.mps.synchronize)."""
        torch.mps.synchronize()

    def gpu_clock(self) -> clocks.EventClock:
        """The clock that times a batch of this tier's calls on the GPU (bnb_mps.executors.clocks)."""
        return clocks.EventClock()

    def prepare(self, kernel: str, grid: Dim3, threadgroup: Dim3) -> Callable[[Sequence[KernelArg]], None]:
        """The launch of `kernel` with this geometry as a function of its arguments: the geometry,
        the kernel's function and its pipeline limit are checked once, here (the op layer keeps it
        for every call of a launch plan)."""
        if not check_geometry(grid, threadgroup):
            return _nothing
        fn, limit = self._kernel(kernel)
        gx, gy, gz = grid
        tx, ty, tz = threadgroup
        if tx * ty * tz > limit:  # refused before torch binds anything (it encodes as it binds)
            raise PipelineLimitError(kernel, tx * ty * tz, limit)
        threads, group_size = [gx * tx, gy * ty, gz * tz], [tx, ty, tz]
        return lambda args: self._bind_and_run(kernel, fn, threads, group_size, args)

    def _bind_and_run(self, kernel: str, fn, threads: list, group_size: list, args: Sequence[KernelArg]) -> None:
        values: list = []
        casts: dict[int, str] = {}
        for i, arg in enumerate(args):
            if isinstance(arg, torch.Tensor):
                if not self._on_device(arg):
                    raise ValueError(
                        f"argument {i} of kernel {kernel!r} is a tensor on {arg.device}; expected a tensor on "
                        f"{self.device_type}"
                    )
                values.append(arg)
            elif isinstance(arg, Scalar):
                value, cast = scalar_binding(arg)
                values.append(value)
                if cast is not None:
                    casts[i] = cast
            else:
                raise TypeError(
                    f"argument {i} of kernel {kernel!r} must be a tensor or a bnb_mps.kernel_args.Scalar, "
                    f"got {type(arg).__name__}"
                )
        fn(*values, threads=threads, group_size=group_size, arg_casts=casts or None)


def _nothing(args) -> None:
    """The launch of an empty grid."""


def load() -> ShaderExecutor:
    """A ready shader executor, or ExecutorUnavailable saying what is missing and how to fix it."""
    if torch_version() < MIN_TORCH or not hasattr(getattr(torch, "mps", None), "compile_shader"):
        raise ExecutorUnavailable(
            f"torch {torch.__version__} is too old for the shader tier: it needs torch >= "
            f"{MIN_TORCH[0]}.{MIN_TORCH[1]} (torch.mps.compile_shader with arg_casts); "
            f"run `pip install -U 'torch>={MIN_TORCH[0]}.{MIN_TORCH[1]}'`"
        )
    if not torch.backends.mps.is_available():
        raise ExecutorUnavailable(f"MPS is not available: {mps_unavailable_reason()}")
    try:
        sources = kernel_source.units()
    except (OSError, ValueError) as e:
        raise ExecutorUnavailable(f"cannot read the kernel sources: {e}") from None
    # One library per compile unit: a unit that does not compile takes only its own kernels out
    # (their launches raise KernelUnavailable; first-use verification fails their families).
    # torch raises SyntaxError for compile errors, RuntimeError otherwise.
    units = CompileUnits.compile(sources, lambda name, text: torch.mps.compile_shader(text), dir)
    if not units.libraries:
        raise ExecutorUnavailable(
            f"torch.mps.compile_shader rejected every kernel compile unit:\n{first_lines(units.describe_failures())}"
        )
    warn_if_fast_math(_macos_version(), torch_version())
    if not units.unit_of:
        raise ExecutorUnavailable("the kernel source defines no kernels")
    probe = min(units.unit_of)  # one pipeline: the width is a property of the GPU
    width = getattr(getattr(units.library_of(probe), probe), "thread_execution_width", None)  # (torch >= 2.7)
    if width is not None:
        check_simd_width(width, probe)
    return ShaderExecutor(units)
