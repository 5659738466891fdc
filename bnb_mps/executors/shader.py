"""The shader tier: the project's kernel source through `torch.mps.compile_shader` (nothing to build).

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

Math mode: compile_shader takes no compile options; torch chooses them (recent torch sources
compile with safe math unless the environment sets PYTORCH_MPS_FAST_MATH; other releases may
differ). The kernels use metal::precise:: for the divisions and square roots of the quantization
paths, so quantized codes do not depend on that choice. Source rules: ASCII only (torch hands it to Metal as ASCII), fixed-size threadgroup
arrays (nothing can set threadgroup memory lengths) - both hold for csrc/kernels by lint.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Sequence

import torch

from ..msl import source as kernel_source
from ..kernel_args import Scalar
from ._gpu_common import (MAX_THREADS_PER_THREADGROUP, check_geometry, check_simd_width, first_lines,
                          mps_unavailable_reason)
from .base import Dim3, ExecutorUnavailable, KernelArg, PipelineLimitError

# Versions, checked in the released macOS arm64 wheels (the strings of libtorch_python.dylib):
# torch 2.6.0 already has the kernel call with `threads`, `group_size` and `arg_casts` (casts
# int8, int16, int32, uint8, fp16, bf16) but only behind the private torch.mps._compile_shader;
# torch 2.7.0 is the first with the public torch.mps.compile_shader, which is all this tier uses.
MIN_TORCH = (2, 7)

# Scalar byte width -> the arg_casts entry that binds an int with that many bytes (8: int64, the
# default, needs none).
_CAST_FOR_WIDTH = {1: "int8", 2: "int16", 4: "int32"}


def torch_version() -> tuple[int, int]:
    m = re.match(r"(\d+)\.(\d+)", torch.__version__)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


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
        self._library = library
        self._names = frozenset(dir(library))  # the library's kernel function names
        self._kernels: dict = {}  # kernel -> (function, its pipeline's max threads per threadgroup)

    def _kernel(self, kernel: str) -> tuple:
        found = self._kernels.get(kernel)
        if found is None:
            if kernel not in self._names:
                raise ValueError(f"kernel {kernel!r} is not in the bnb_mps kernel library")
            fn = getattr(self._library, kernel)
            # The pipeline's maxTotalThreadsPerThreadgroup, read once (torch's kernel function
            # reports it next to thread_execution_width; were it missing, Metal's general limit,
            # and torch's own check at dispatch has the last word).
            limit = getattr(fn, "max_threads_per_threadgroup", MAX_THREADS_PER_THREADGROUP)
            found = self._kernels[kernel] = (fn, limit)
        return found

    def launch(self, kernel: str, *, grid: Dim3, threadgroup: Dim3, args: Sequence[KernelArg]) -> None:
        if not check_geometry(grid, threadgroup):
            return
        fn, limit = self._kernel(kernel)
        gx, gy, gz = grid
        tx, ty, tz = threadgroup
        if tx * ty * tz > limit:  # refused before torch binds anything (it encodes as it binds)
            raise PipelineLimitError(kernel, tx * ty * tz, limit)
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
        fn(*values, threads=[gx * tx, gy * ty, gz * tz], group_size=[tx, ty, tz], arg_casts=casts or None)


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
        source = kernel_source.source()
    except (OSError, ValueError) as e:
        raise ExecutorUnavailable(f"cannot read the kernel sources: {e}") from None
    try:
        library = torch.mps.compile_shader(source)
    except Exception as e:  # torch raises SyntaxError for compile errors, RuntimeError otherwise
        raise ExecutorUnavailable(
            f"torch.mps.compile_shader rejected the kernel source:\n{first_lines(e)}"
        ) from None
    probe = min(dir(library))  # one pipeline: the width is a property of the GPU
    width = getattr(getattr(library, probe), "thread_execution_width", None)  # (torch >= 2.7 reports it)
    if width is not None:
        check_simd_width(width, probe)
    return ShaderExecutor(library)
